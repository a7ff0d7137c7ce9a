#include "forge/models/captions.h"

#include <algorithm>

#include "forge/core/error.h"
#include "forge/models/sampling.h"

namespace forge::models {

bool CaptionScore::add(Model& model, int64_t index, const int32_t* ids, const int32_t* targets,
                       int64_t seq_len, const float* pixels, int64_t images) {
  const int32_t* end = targets + seq_len;
  const int32_t* first = std::find_if(targets, end, [](int32_t t) { return t >= 0; });
  if (first == end) return false;
  const int32_t* last = std::find_if(first, end, [](int32_t t) { return t < 0; });
  const std::vector<int32_t> prompt(ids, ids + (first - targets) + 1);
  CaptionExample e;
  e.index = index;
  e.reference.assign(first, last);
  SamplingOptions greedy;
  greedy.temperature = 0, greedy.context = seq_len;
  greedy.max_new_tokens = static_cast<int64_t>(e.reference.size());
  greedy.pixels = images > 0 ? pixels : nullptr, greedy.images = images;
  e.answer = generate(model, prompt, greedy);
  int64_t same = 0;
  for (size_t t = 0; t < e.reference.size(); ++t)
    same += t < e.answer.size() && e.answer[t] == e.reference[t];
  const bool right = e.answer == e.reference;
  ++count_, exact_ += right, matched_ += same, tokens_ += static_cast<int64_t>(e.reference.size());
  std::vector<CaptionExample>& kept = right ? right_ : wrong_;
  if (kept.size() < kKept) kept.push_back(std::move(e));
  return true;
}

double CaptionScore::token_accuracy() const {
  return tokens_ > 0 ? static_cast<double>(matched_) / static_cast<double>(tokens_) : 0.0;
}

double CaptionScore::exact_fraction() const {
  return count_ > 0 ? static_cast<double>(exact_) / static_cast<double>(count_) : 0.0;
}

std::string caption_summary(std::string_view what, const CaptionScore& score, double seconds) {
  return fmt::format(
      "{} (greedy, {} samples, {:.1f} s): {} exactly right ({:.1f}%), {:.1f}% of their tokens right", what,
      score.count(), seconds, score.exact(), 100.0 * score.exact_fraction(), 100.0 * score.token_accuracy());
}

std::vector<std::string> caption_lines(const CaptionScore& score, const CaptionDecode& decode, size_t most) {
  std::vector<std::string> lines;
  for (size_t i = 0; i < std::min(most, score.wrong().size()); ++i) {
    const CaptionExample& e = score.wrong()[i];
    lines.push_back(fmt::format("  held-out {}: \"{}\"\n      reference \"{}\"", e.index, decode(e.answer),
                                decode(e.reference)));
  }
  for (size_t i = 0; i < std::min(most, score.right().size()); ++i)
    lines.push_back(
        fmt::format("  held-out {}: \"{}\"", score.right()[i].index, decode(score.right()[i].answer)));
  return lines;
}

nlohmann::json caption_examples_json(const CaptionScore& score, const CaptionDecode& decode) {
  nlohmann::json all = nlohmann::json::array();
  for (const auto* kept : {&score.wrong(), &score.right()})
    for (const CaptionExample& e : *kept)
      if (all.size() < CaptionScore::kKept)
        all.push_back({{"index", e.index}, {"answer", decode(e.answer)}, {"reference", decode(e.reference)}});
  return all;
}

}  // namespace forge::models
