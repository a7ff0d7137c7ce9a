// Greedy answers to image-text samples, scored against their references: forge train's sample.captions and
// forge eval --captions. A sample is seq_len input ids and targets (-1 = no loss), as image-text data makes
// them: the answer is the first run of trained targets, the prompt every token up to its first position
// (image tokens, the prompt text), and the model answers it greedily with as many tokens as the reference
// has. An answer is exactly right when every one of its tokens is the reference's.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "forge/models/model.h"

namespace forge::models {

struct CaptionExample {
  int64_t index = 0;  // the caller's number for the sample
  std::vector<int32_t> answer, reference;
};

class CaptionScore {
 public:
  // Answers one sample (its images' pixels [images, channels, height, width], normalised, on the host);
  // false, counting nothing, when it has no trained target.
  bool add(Model& model, int64_t index, const int32_t* ids, const int32_t* targets, int64_t seq_len,
           const float* pixels, int64_t images);

  int64_t count() const { return count_; }    // samples answered
  int64_t exact() const { return exact_; }    // answers equal to their reference
  int64_t tokens() const { return tokens_; }  // reference tokens
  double token_accuracy() const;              // share of reference tokens matched at their position
  double exact_fraction() const;
  // The first kKept misses and the first kKept right answers, in sample order.
  const std::vector<CaptionExample>& wrong() const { return wrong_; }
  const std::vector<CaptionExample>& right() const { return right_; }
  static constexpr size_t kKept = 16;

 private:
  int64_t count_ = 0, exact_ = 0, tokens_ = 0, matched_ = 0;
  std::vector<CaptionExample> wrong_, right_;
};

// Token ids to text, for the lines and records below.
using CaptionDecode = std::function<std::string(std::span<const int32_t>)>;

// "held-out captions (greedy, 600 samples, 10.5 s): 460 exactly right (76.7%), 89.5% of their tokens right"
// (`what` first).
std::string caption_summary(std::string_view what, const CaptionScore& score, double seconds);
// Up to `most` misses ("  held-out 8: \"answer\"" and "      reference \"...\"" as one two-line entry), then
// up to `most` right answers, one entry each.
std::vector<std::string> caption_lines(const CaptionScore& score, const CaptionDecode& decode, size_t most);
// Up to CaptionScore::kKept examples, the misses first: [{"index", "answer", "reference"}].
nlohmann::json caption_examples_json(const CaptionScore& score, const CaptionDecode& decode);

}  // namespace forge::models
