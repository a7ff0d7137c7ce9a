// Byte-level BPE training, producing a tokenizer.json that forge and the reference implementation
// (Hugging Face tokenizers) both load.
//
// The algorithm is the reference's BpeTrainer: the text is pre-tokenized (special tokens split out
// first, then the split pattern, then the byte-level mapping), identical words are counted, and words
// start as sequences of byte symbols. Then, until the vocabulary has vocab_size tokens, the most
// frequent adjacent pair is merged into a new token; ties go to the pair whose (left id, right id) is
// smallest. Pair counts are updated incrementally from the words that contain the merged pair, so a
// merge costs time in proportion to where the pair occurs, not to the corpus.
//
// Vocabulary ids: the special tokens first (0, 1, ... in the order given), then the byte symbols sorted
// by the code point that stands for them in the byte-level alphabet ('!' is the first, 'Ġ' (space) is
// 220 without special tokens, as in GPT-2), then merged tokens in the order they were made.
//
// Differences from the reference, on purpose: special tokens that occur in the training text are split
// out before counting (the reference counts their text like any other), and by default all 256 byte
// symbols are in the vocabulary (the reference only has the bytes it saw unless given an initial
// alphabet; full_byte_alphabet = false reproduces that). Files are read line by line, each line (with
// its newline) pre-tokenized on its own, as the reference's train-from-files does; texts passed as
// strings are pre-tokenized whole.
//
//   Tokenizer t = train_bpe(text, {.vocab_size = 4096, .special_tokens = {"<|endoftext|>"}});
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/tokenizer/tokenizer.h"

namespace forge::data {

struct BpeTrainerOptions {
  int64_t vocab_size = 4096;  // special tokens, byte symbols and merged tokens together
  // A pair must occur at least this often to be merged (0 and 1 both mean: any pair that occurs).
  int64_t min_frequency = 0;
  std::vector<std::string> special_tokens;  // e.g. {"<|endoftext|>"}
  // "gpt2" (GPT-2's pattern, inside a ByteLevel pre-tokenizer), "llama3" (LLaMA-3's pattern in a Split
  // before a ByteLevel pre-tokenizer, as LLaMA-3's tokenizer.json), or any other regular expression
  // (used like "llama3").
  std::string pattern = "gpt2";
  // The model's ignore_merges flag (a word that is itself a token is emitted whole). Default: true for
  // "llama3" (as LLaMA-3 sets it), false otherwise.
  std::optional<bool> ignore_merges;
  // When set (it must be one of special_tokens), encoding with add_special_tokens puts it first.
  std::string bos_token;
  bool full_byte_alphabet = true;
};

struct BpeTrainerStats {
  int64_t sequences = 0;  // texts or lines pre-tokenized
  int64_t words = 0;      // pre-tokens counted
  int64_t distinct_words = 0;
  int64_t merges = 0;      // merge rules in the tokenizer
  int64_t vocab_size = 0;  // reached (smaller than asked when the corpus runs out of pairs)
  double seconds = 0;
};

// Trains on the given texts, each pre-tokenized as a whole. Throws forge::Error for invalid UTF-8,
// an unknown or invalid pattern, or a vocab_size below the special tokens plus the byte symbols.
Tokenizer train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options,
                    BpeTrainerStats* stats = nullptr);
Tokenizer train_bpe(std::string_view text, const BpeTrainerOptions& options,
                    BpeTrainerStats* stats = nullptr);
// Trains on files, line by line (see above). Throws forge::Error naming a missing or unreadable file.
Tokenizer train_bpe_from_files(const std::vector<std::filesystem::path>& files,
                               const BpeTrainerOptions& options, BpeTrainerStats* stats = nullptr);

}  // namespace forge::data
