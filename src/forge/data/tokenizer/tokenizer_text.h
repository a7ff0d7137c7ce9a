// Text helpers shared by the tokenizer and the BPE trainer: UTF-8 validation and decoding, the GPT-2
// byte-level alphabet, lossy UTF-8 repair as the reference decoder does it, and Unicode White_Space.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace forge::tokenizer_text {

// The GPT-2 byte-level alphabet: each byte stands for one printable code point. Bytes '!'..'~',
// 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order, for
// U+0100, U+0101, ... (so the space 0x20 is U+0120 'Ġ' and the newline 0x0A is U+010A 'Ċ').
char32_t byte_to_code_point(uint8_t byte);
// The byte a code point of the alphabet stands for, or -1 if it is not in the alphabet.
int code_point_to_byte(char32_t c);
// UTF-8 of byte_to_code_point(byte) (one or two bytes).
std::string_view byte_to_utf8(uint8_t byte);
// Appends the byte-level form of every byte of `raw` to `out`.
void append_byte_level(std::string_view raw, std::string& out);
std::string to_byte_level(std::string_view raw);

// Byte offset of the first byte that does not start a well-formed UTF-8 sequence (overlong forms,
// surrogates and code points above U+10FFFF are ill-formed), or npos when all of `s` is valid.
size_t find_invalid_utf8(std::string_view s);
// Throws forge::Error "<what> is not valid UTF-8 (byte 0x.. at offset N)" unless `s` is valid.
void check_utf8(std::string_view s, std::string_view what);

// The code point starting at s[i] of valid UTF-8 `s`; advances i past it.
char32_t next_code_point(std::string_view s, size_t& i);
// Byte length of the UTF-8 sequence whose first byte is `lead` (1 for anything that is not a lead).
size_t utf8_length(uint8_t lead);
void append_utf8(char32_t c, std::string& out);

// Like Rust's String::from_utf8_lossy (and WHATWG's decoder): every maximal ill-formed subsequence
// becomes one U+FFFD, well-formed parts are copied.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space (Rust's char::is_whitespace; the \s of the reference's regular expressions).
bool is_white_space(char32_t c);

}  // namespace forge::tokenizer_text
