// The tokenizer pipeline: added tokens, pre-tokenizers, BPE, post-processors and the decoder, each step
// as the reference implementation (Hugging Face tokenizers) does it. tokenizer_config.cpp builds it.
#include "forge/data/tokenizer/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <sstream>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/tokenizer/tokenizer_impl.h"
#include "forge/data/tokenizer/tokenizer_regex.h"
#include "forge/data/tokenizer/tokenizer_text.h"

namespace forge::data {
namespace tokenizer_detail {

void AddedTokenMatcher::add(const AddedToken* token) {
  auto& list = by_first_byte_[static_cast<uint8_t>(token->form[0])];
  if (list.empty()) {
    ++distinct_first_bytes_;
    only_first_byte_ = token->form[0];
  }
  list.push_back(token);
  std::stable_sort(list.begin(), list.end(),
                   [](const AddedToken* a, const AddedToken* b) { return a->form.size() > b->form.size(); });
  ++count_;
}

bool AddedTokenMatcher::find(std::string_view text, size_t from, size_t& start,
                             const AddedToken*& token) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (distinct_first_bytes_ == 1) {
      const void* hit = std::memchr(text.data() + i, only_first_byte_, text.size() - i);
      if (!hit) return false;
      i = static_cast<size_t>(static_cast<const char*>(hit) - text.data());
    }
    const auto& candidates = by_first_byte_[static_cast<uint8_t>(text[i])];
    for (const AddedToken* t : candidates) {
      if (text.compare(i, t->form.size(), t->form) == 0) {
        start = i;
        token = t;
        return true;
      }
    }
  }
  return false;
}

}  // namespace tokenizer_detail

namespace {

using namespace tokenizer_detail;

char32_t last_code_point(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return tokenizer_text::next_code_point(s, i);
}

char32_t first_code_point(std::string_view s) {
  size_t i = 0;
  return tokenizer_text::next_code_point(s, i);
}

// Start of the run of white space that ends `s` (s.size() if none).
size_t trailing_space_start(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
    size_t j = i;
    if (!tokenizer_text::is_white_space(tokenizer_text::next_code_point(s, j))) break;
    end = i;
  }
  return end;
}

// Length of the run of white space that starts `s`.
size_t leading_space_length(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i;
    if (!tokenizer_text::is_white_space(tokenizer_text::next_code_point(s, j))) break;
    i = j;
  }
  return i;
}

// A piece of text on its way through the pre-tokenizers. byte_level: the text is raw and stands for
// its byte-level form (the mapping is applied lazily, by the model, or by materialize()). at_start: the
// piece begins the whole text (the reference's "original offset 0", which Metaspace's "first" reads).
struct Piece {
  std::string_view text;
  bool byte_level = false, at_start = false;
};

class Encoder {
 public:
  Encoder(const TokenizerAccess::Impl& impl, std::vector<int32_t>& ids) : impl_(impl), ids_(ids) {}
  // Words go to on_word instead of the model.
  Encoder(const TokenizerAccess::Impl& impl, std::vector<int32_t>& ids,
          const std::function<void(std::string_view, bool)>* on_word)
      : impl_(impl), ids_(ids), on_word_(on_word) {}

  // As the reference: the non-normalized added tokens are split out of the whole text; each piece left
  // is normalized; the normalized added tokens are split out of that; the rest is pre-tokenized and
  // encoded.
  void encode(std::string_view text) {
    split_added(text, impl_.non_normalized_tokens, [&](std::string_view rest, bool rest_at_start) {
      std::string normalized;
      std::string_view view = rest;
      if (!impl_.normalizer.empty()) {
        normalized = impl_.normalizer.normalize(rest);
        view = normalized;
      }
      split_added(view, impl_.normalized_tokens, [&](std::string_view plain, bool plain_at_start) {
        pre_tokenize(0, {plain, false, rest_at_start && plain_at_start});
        arena_.clear();
      });
    });
  }

 private:
  // The reference's find_matches: leftmost-longest matches, honouring single_word, lstrip and rstrip.
  // on_text(text, at_start) gets the non-empty pieces between matches.
  template <typename OnText>
  void split_added(std::string_view sentence, const AddedTokenMatcher& matcher, OnText&& on_text) {
    if (sentence.empty()) return;
    if (matcher.empty()) {
      on_text(sentence, true);
      return;
    }
    size_t start_offset = 0, search_from = 0, match_start = 0;
    const AddedToken* token = nullptr;
    while (matcher.find(sentence, search_from, match_start, token)) {
      size_t start = match_start, stop = match_start + token->form.size();
      search_from = stop;
      if (token->single_word) {
        const bool word_before = start > 0 && is_word_char(last_code_point(sentence.substr(0, start)));
        const bool word_after =
            stop < sentence.size() && is_word_char(first_code_point(sentence.substr(stop)));
        if (word_before || word_after) continue;
      }
      if (token->lstrip) start = std::max(trailing_space_start(sentence.substr(0, start)), start_offset);
      if (token->rstrip) stop += leading_space_length(sentence.substr(stop));
      if (start_offset < start)
        on_text(sentence.substr(start_offset, start - start_offset), start_offset == 0);
      ids_.push_back(token->id);
      start_offset = stop;
    }
    if (start_offset < sentence.size()) on_text(sentence.substr(start_offset), start_offset == 0);
  }

  std::string_view store(std::string text) { return arena_.emplace_back(std::move(text)); }

  Piece materialize(Piece piece) {
    if (!piece.byte_level) return piece;
    return {store(tokenizer_text::to_byte_level(piece.text)), false, piece.at_start};
  }

  void pre_tokenize(size_t step_index, Piece piece) {
    if (piece.text.empty()) return;
    if (step_index == impl_.pre_tokenizers.size()) {
      if (on_word_) {
        (*on_word_)(piece.text, piece.byte_level);
      } else {
        impl_.model->tokenize(piece.text, piece.byte_level, ids_);
      }
      return;
    }
    const PreTokenizerStep& step = impl_.pre_tokenizers[step_index];
    piece = materialize(piece);
    switch (step.kind) {
      case PreTokenizerStep::Kind::ByteLevel:
        if (step.add_prefix_space && piece.text[0] != ' ') {
          std::string prefixed(1, ' ');
          prefixed.append(piece.text);
          piece.text = store(std::move(prefixed));
        }
        if (!step.use_regex) {
          pre_tokenize(step_index + 1, {piece.text, true, piece.at_start});
          return;
        }
        split(step_index, piece, step, SplitBehavior::Isolated, false, true);
        return;
      case PreTokenizerStep::Kind::Split:
        split(step_index, piece, step, step.behavior, step.invert, false);
        return;
      case PreTokenizerStep::Kind::Metaspace: {
        std::string replaced = replace_all(piece.text, " ", step.replacement);
        const bool prepend = step.prepend_scheme == PrependScheme::Always ||
                             (step.prepend_scheme == PrependScheme::First && piece.at_start);
        if (prepend && replaced.compare(0, step.replacement.size(), step.replacement) != 0)
          replaced.insert(0, step.replacement);
        piece.text = store(std::move(replaced));
        if (step.split) {
          split(step_index, piece, step, SplitBehavior::MergedWithNext, false, false);
        } else {
          pre_tokenize(step_index + 1, piece);
        }
        return;
      }
    }
  }

  // Runs a split step over `text` and passes every resulting piece on to the next step.
  void split(size_t step_index, Piece piece, const PreTokenizerStep& step, SplitBehavior behavior,
             bool invert, bool byte_level_out) {
    const std::string_view text = piece.text;
    // Pending piece of the merging behaviors.
    bool have_pending = false, pending_match = false, previous_match = false;
    size_t pending_start = 0, pending_end = 0;
    auto emit = [&](size_t s, size_t e) {
      if (e > s)
        pre_tokenize(step_index + 1, {text.substr(s, e - s), byte_level_out, piece.at_start && s == 0});
    };
    auto flush = [&] {
      if (have_pending) emit(pending_start, pending_end);
      have_pending = false;
    };
    auto hold = [&](size_t s, size_t e, bool m) {
      have_pending = true;
      pending_start = s;
      pending_end = e;
      pending_match = m;
    };
    auto on_segment = [&](size_t s, size_t e, bool is_match) {
      is_match = is_match != invert;
      switch (behavior) {
        case SplitBehavior::Isolated:
          emit(s, e);
          break;
        case SplitBehavior::Removed:
          if (!is_match) emit(s, e);
          break;
        case SplitBehavior::Contiguous:
          if (have_pending && is_match == previous_match) {
            pending_end = e;
          } else {
            flush();
            hold(s, e, is_match);
          }
          break;
        case SplitBehavior::MergedWithPrevious:
          if (have_pending && is_match && !previous_match) {
            pending_end = e;
          } else {
            flush();
            hold(s, e, is_match);
          }
          break;
        case SplitBehavior::MergedWithNext:
          // A match joins the piece after it when that piece is not a match.
          if (have_pending && pending_match && !is_match) {
            emit(pending_start, e);
            have_pending = false;
          } else {
            flush();
            if (is_match) {
              hold(s, e, true);
            } else {
              emit(s, e);
            }
          }
          break;
      }
      previous_match = is_match;
    };
    size_t previous_end = 0;
    auto on_match = [&](size_t s, size_t e) {
      if (previous_end != s) on_segment(previous_end, s, false);
      on_segment(s, e, true);
      previous_end = e;
    };
    step.regex->for_each_match(text, on_match);
    if (previous_end != text.size()) on_segment(previous_end, text.size(), false);
    flush();
  }

  const TokenizerAccess::Impl& impl_;
  std::vector<int32_t>& ids_;
  const std::function<void(std::string_view, bool)>* on_word_ = nullptr;
  std::deque<std::string> arena_;  // pieces that had to be rewritten (prefix space, byte-level form)
};

}  // namespace

void TokenizerAccess::pre_tokenize(const Tokenizer& tokenizer, std::string_view text,
                                   const std::function<void(std::string_view, bool)>& on_word) {
  std::vector<int32_t> added_ids;
  Encoder(*tokenizer.impl_, added_ids, &on_word).encode(text);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

std::unique_ptr<TokenizerAccess::Impl> parse_checked(const nlohmann::json& json,
                                                     std::string_view source_name) {
  try {
    return TokenizerAccess::parse(json, source_name);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed tokenizer.json: {}", source_name, e.what());
  }
}

}  // namespace

Tokenizer Tokenizer::from_json(const nlohmann::json& json, std::string_view source_name) {
  auto impl = parse_checked(json, source_name);
  try {
    impl->json_text = json.dump(2);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed tokenizer.json: {}", source_name, e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_json_text(std::string_view text, std::string_view source_name) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", source_name, e.what());
  }
  auto impl = parse_checked(json, source_name);
  impl->json_text = std::string(text);
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  return from_json_text(read_file(path, "tokenizer file"), path.string());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  tokenizer_text::check_utf8(text, "text to encode");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  Encoder(*impl_, ids).encode(text);
  if (add_special_tokens) {
    for (const PostProcessorStep& step : impl_->post_processors) {
      if (!step.is_template) continue;
      std::vector<int32_t> processed;
      processed.reserve(ids.size() + 4);
      for (const TemplateItem& item : step.single)
        processed.insert(processed.end(), item.is_sequence ? ids.begin() : item.ids.begin(),
                         item.is_sequence ? ids.end() : item.ids.end());
      ids = std::move(processed);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& impl = *impl_;
  auto check = [&](int32_t id) {
    if (id < 0 || id >= static_cast<int64_t>(impl.exists.size()) || !impl.exists[id])
      fail("{}: cannot decode id {}: no such token (vocabulary size {})", impl.source, id, vocab_size());
  };
  // A byte-level decoder maps every token on its own: concatenate, repair the UTF-8 once.
  if (impl.decoder && impl.decoder->byte_level_only()) {
    std::string bytes;
    for (int32_t id : ids) {
      check(id);
      if (!(skip_special_tokens && impl.skip_as_special[id])) bytes.append(impl.text_bytes[id]);
    }
    return tokenizer_text::utf8_lossy(bytes);
  }
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    check(id);
    if (!(skip_special_tokens && impl.skip_as_special[id])) tokens.push_back(impl.token_string[id]);
  }
  if (impl.decoder) return impl.decoder->decode(std::move(tokens));
  // Without a decoder the reference joins the tokens with spaces.
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (i > 0) text.push_back(' ');
    text.append(tokens[i]);
  }
  return text;
}

int64_t Tokenizer::token_byte_length(int32_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(impl_->exists.size()) || !impl_->exists[id])
    fail("{}: token_byte_length: no token has id {}", impl_->source, id);
  return impl_->is_special[id] ? 0 : static_cast<int64_t>(impl_->text_bytes[id].size());
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->exists.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return impl_->added_tokens[it->second].id;
  if (const auto it = impl_->model->vocab().find(token); it != impl_->model->vocab().end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (const AddedToken* added = impl_->added_by_id(id)) return added->content;
  if (const std::string* token = impl_->model->id_to_token(id)) return *token;
  return std::nullopt;
}

std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }

nlohmann::json Tokenizer::to_json() const { return nlohmann::json::parse(impl_->json_text); }
const std::string& Tokenizer::json_text() const { return impl_->json_text; }

void Tokenizer::save(const std::filesystem::path& path) const {
  const std::string& text = impl_->json_text;
  // Checked writes, fsync and rename; a failed write (a full disk) leaves no temporary behind.
  write_file_atomically(path, text.empty() || text.back() != '\n' ? text + '\n' : text, "tokenizer file");
}

}  // namespace forge::data
