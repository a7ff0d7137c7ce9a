#include "forge/data/tokenizer/tokenizer_decoder.h"

#include <algorithm>

#include "forge/data/tokenizer/tokenizer_normalizer.h"
#include "forge/data/tokenizer/tokenizer_text.h"

namespace forge::data {
namespace {

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Start offsets of the characters of valid UTF-8 `s`, and s.size() at the end.
std::vector<size_t> character_starts(std::string_view s) {
  std::vector<size_t> starts;
  size_t i = 0;
  while (i < s.size()) {
    starts.push_back(i);
    tokenizer_text::next_code_point(s, i);
  }
  starts.push_back(s.size());
  return starts;
}

void byte_fallback(std::vector<std::string>& tokens) {
  std::vector<std::string> out;
  out.reserve(tokens.size());
  std::string bytes;
  size_t byte_tokens = 0;
  auto flush = [&] {
    if (byte_tokens == 0) return;
    if (tokenizer_text::find_invalid_utf8(bytes) == std::string::npos) {
      out.push_back(bytes);
    } else {
      for (size_t i = 0; i < byte_tokens; ++i) out.emplace_back(kReplacementCharacter);
    }
    bytes.clear();
    byte_tokens = 0;
  };
  for (std::string& token : tokens) {
    if (const auto byte = byte_fallback_byte(token)) {
      bytes.push_back(static_cast<char>(*byte));
      ++byte_tokens;
      continue;
    }
    flush();
    out.push_back(std::move(token));
  }
  flush();
  tokens = std::move(out);
}

void strip(std::vector<std::string>& tokens, std::string_view content, size_t start, size_t stop) {
  for (std::string& token : tokens) {
    const std::vector<size_t> starts = character_starts(token);
    const size_t count = starts.size() - 1;
    auto is_content = [&](size_t c) {
      return token.compare(starts[c], starts[c + 1] - starts[c], content) == 0;
    };
    size_t first = 0;
    while (first < std::min(start, count) && is_content(first)) ++first;
    size_t last = count;  // one past the last character kept
    for (size_t i = 0; i < std::min(stop, count) && is_content(count - 1 - i); ++i) last = count - 1 - i;
    token = first < last ? token.substr(starts[first], starts[last] - starts[first]) : std::string();
  }
}

void metaspace(std::vector<std::string>& tokens, std::string_view replacement, PrependScheme scheme) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool drop = i == 0 && scheme != PrependScheme::Never;
    tokens[i] = replace_all(tokens[i], replacement, drop ? "" : " ");
  }
}

void fuse(std::vector<std::string>& tokens) {
  std::string all;
  for (const std::string& token : tokens) all.append(token);
  tokens.assign(1, std::move(all));
}

}  // namespace

std::optional<uint8_t> byte_fallback_byte(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  // Rust's u8::from_str_radix(token[3..5], 16): hexadecimal digits, a leading '+' allowed.
  const int hi = hex_digit(token[3]), lo = hex_digit(token[4]);
  if (token[3] == '+' && lo >= 0) return static_cast<uint8_t>(lo);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  size_t i = 0;
  while (i < token.size()) {
    const int b = tokenizer_text::code_point_to_byte(tokenizer_text::next_code_point(token, i));
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

bool Decoder::byte_level_only() const {
  return !steps_.empty() && std::all_of(steps_.begin(), steps_.end(), [](const DecoderStep& s) {
    return s.kind == DecoderStep::Kind::ByteLevel;
  });
}

std::string Decoder::decode(std::vector<std::string> tokens) const {
  for (const DecoderStep& step : steps_) {
    switch (step.kind) {
      case DecoderStep::Kind::ByteLevel: {
        std::string bytes;
        for (const std::string& token : tokens) bytes.append(byte_level_decode(token));
        tokens.assign(1, tokenizer_text::utf8_lossy(bytes));
        break;
      }
      case DecoderStep::Kind::Replace:
        for (std::string& token : tokens)
          token = step.literal ? replace_all(token, *step.literal, step.content)
                               : replace_all(token, *step.pattern, step.content);
        break;
      case DecoderStep::Kind::ByteFallback:
        byte_fallback(tokens);
        break;
      case DecoderStep::Kind::Fuse:
        fuse(tokens);
        break;
      case DecoderStep::Kind::Strip:
        strip(tokens, step.content, step.start, step.stop);
        break;
      case DecoderStep::Kind::Metaspace:
        metaspace(tokens, step.content, step.prepend_scheme);
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text.append(token);
  return text;
}

std::string Decoder::token_text(std::string_view token) const {
  std::string text(token);
  for (const DecoderStep& step : steps_) {
    switch (step.kind) {
      case DecoderStep::Kind::ByteLevel:
        text = byte_level_decode(text);
        if (tokenizer_text::find_invalid_utf8(text) != std::string::npos) return text;
        break;
      case DecoderStep::Kind::Replace:
        text = step.literal ? replace_all(text, *step.literal, step.content)
                            : replace_all(text, *step.pattern, step.content);
        break;
      case DecoderStep::Kind::ByteFallback:
        // A raw byte may be invalid UTF-8 on its own: no later step reads it.
        if (const auto byte = byte_fallback_byte(text)) return std::string(1, static_cast<char>(*byte));
        break;
      case DecoderStep::Kind::Metaspace:
        text = replace_all(text, step.content, " ");
        break;
      case DecoderStep::Kind::Fuse:
      case DecoderStep::Kind::Strip:
        break;
    }
  }
  return text;
}

}  // namespace forge::data
