#include "forge/data/tokenizer/tokenizer_text.h"

#include <array>

#include "forge/core/error.h"

namespace forge::tokenizer_text {
namespace {

bool stands_for_itself(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); }

struct ByteTables {
  std::array<char32_t, 256> code_point{};
  std::array<char, 512> utf8{};  // two bytes per entry
  std::array<uint8_t, 256> utf8_size{};
  std::array<int16_t, 324> byte_of{};  // indexed by code point (all are below U+0144)
  ByteTables() {
    byte_of.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      code_point[b] = stands_for_itself(b) ? static_cast<char32_t>(b) : next++;
      byte_of[code_point[b]] = static_cast<int16_t>(b);
      std::string s;
      append_utf8(code_point[b], s);
      utf8_size[b] = static_cast<uint8_t>(s.size());
      for (size_t k = 0; k < s.size(); ++k) utf8[2 * b + k] = s[k];
    }
  }
};

const ByteTables& tables() {
  static const ByteTables t;
  return t;
}

// Length of the well-formed prefix of the sequence starting at s[i] (Unicode table 3-7), and whether it
// is complete. A lone continuation byte or an impossible lead has a prefix of length 0.
struct SequenceCheck {
  size_t valid_prefix;
  size_t full_length;
};

SequenceCheck check_sequence(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return {1, 1};
  size_t length;
  uint8_t low = 0x80, high = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3;
    if (b0 == 0xE0) low = 0xA0;
    if (b0 == 0xED) high = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4;
    if (b0 == 0xF0) low = 0x90;
    if (b0 == 0xF4) high = 0x8F;
  } else {
    return {0, 1};
  }
  size_t k = 1;
  for (; k < length && i + k < s.size(); ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t lo = k == 1 ? low : 0x80, hi = k == 1 ? high : 0xBF;
    if (b < lo || b > hi) break;
  }
  return {k, length};
}

}  // namespace

char32_t byte_to_code_point(uint8_t byte) { return tables().code_point[byte]; }

int code_point_to_byte(char32_t c) {
  const auto& t = tables();
  return c < t.byte_of.size() ? t.byte_of[c] : -1;
}

std::string_view byte_to_utf8(uint8_t byte) {
  const auto& t = tables();
  return {t.utf8.data() + 2 * byte, t.utf8_size[byte]};
}

void append_byte_level(std::string_view raw, std::string& out) {
  const auto& t = tables();
  for (char c : raw) {
    const auto b = static_cast<uint8_t>(c);
    out.append(t.utf8.data() + 2 * b, t.utf8_size[b]);
  }
}

std::string to_byte_level(std::string_view raw) {
  std::string out;
  out.reserve(raw.size() * 2);
  append_byte_level(raw, out);
  return out;
}

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // Fast path over ASCII, eight bytes at a time.
    while (i + 8 <= n) {
      uint64_t word;
      __builtin_memcpy(&word, s.data() + i, 8);
      if (word & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const SequenceCheck c = check_sequence(s, i);
    if (c.valid_prefix != c.full_length) return i;
    i += c.full_length;
  }
  return std::string_view::npos;
}

void check_utf8(std::string_view s, std::string_view what) {
  const size_t bad = find_invalid_utf8(s);
  if (bad != std::string_view::npos)
    fail("{} is not valid UTF-8 (byte 0x{:02X} at offset {})", what, static_cast<uint8_t>(s[bad]), bad);
}

size_t utf8_length(uint8_t lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  const size_t n = utf8_length(b0);
  char32_t c = b0 & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n && i + k < s.size(); ++k) c = (c << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  i += n;
  return c;
}

void append_utf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    const SequenceCheck c = check_sequence(bytes, i);
    if (c.valid_prefix == c.full_length) {
      out.append(bytes.substr(i, c.full_length));
      i += c.full_length;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD for the maximal ill-formed subpart
      i += c.valid_prefix == 0 ? 1 : c.valid_prefix;
    }
  }
  return out;
}

bool is_white_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  switch (c) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

}  // namespace forge::tokenizer_text
