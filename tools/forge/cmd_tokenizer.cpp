// forge tokenizer: train a byte-level BPE tokenizer, and encode or decode text with a tokenizer.json.
#include <cerrno>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/data/tokenizer/bpe_trainer.h"
#include "forge/data/tokenizer/tokenizer.h"

namespace forge::cli {
using namespace forge::data;
namespace {

struct TokenizerOptions {
  // train
  std::vector<std::string> inputs;
  int64_t vocab_size = 4096;
  int64_t min_frequency = 0;
  std::string output, pattern = "gpt2", bos_token;
  std::vector<std::string> special_tokens;
  // encode / decode
  std::string tokenizer;
  std::string text;
  bool text_given = false, add_special_tokens = false, skip_special_tokens = false;
  std::vector<std::string> ids;
};

std::string read_stdin() {
  std::ostringstream buffer;
  buffer << std::cin.rdbuf();
  return buffer.str();
}

int run_train(const TokenizerOptions& o) {
  BpeTrainerOptions options;
  options.vocab_size = o.vocab_size;
  options.min_frequency = o.min_frequency;
  options.special_tokens = o.special_tokens;
  options.pattern = o.pattern;
  options.bos_token = o.bos_token;
  std::vector<std::filesystem::path> files(o.inputs.begin(), o.inputs.end());
  BpeTrainerStats stats;
  Tokenizer tokenizer = train_bpe_from_files(files, options, &stats);
  tokenizer.save(o.output);
  std::printf("trained a %lld-token vocabulary (%lld merges, %zu special tokens, pattern %s) in %.2f s\n",
              static_cast<long long>(stats.vocab_size), static_cast<long long>(stats.merges),
              o.special_tokens.size(), o.pattern.c_str(), stats.seconds);
  std::printf("corpus: %zu file(s), %lld lines, %lld words (%lld distinct)\n", files.size(),
              static_cast<long long>(stats.sequences), static_cast<long long>(stats.words),
              static_cast<long long>(stats.distinct_words));
  if (stats.vocab_size < o.vocab_size)
    std::printf("note: the corpus ran out of pairs to merge before reaching %lld tokens\n",
                static_cast<long long>(o.vocab_size));
  std::printf("wrote %s\n", o.output.c_str());
  return 0;
}

int run_encode(const TokenizerOptions& o) {
  const Tokenizer tokenizer = Tokenizer::from_file(o.tokenizer);
  const std::string text = o.text_given ? o.text : read_stdin();
  const std::vector<int32_t> ids = tokenizer.encode(text, o.add_special_tokens);
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);
  return 0;
}

int run_decode(const TokenizerOptions& o) {
  const Tokenizer tokenizer = Tokenizer::from_file(o.tokenizer);
  std::vector<std::string> words = o.ids;
  if (words.empty()) {
    std::istringstream in(read_stdin());
    words.assign(std::istream_iterator<std::string>(in), std::istream_iterator<std::string>());
  }
  std::vector<int32_t> ids;
  ids.reserve(words.size());
  for (const std::string& word : words) {
    char* end = nullptr;
    errno = 0;
    const long long value = std::strtoll(word.c_str(), &end, 10);
    if (word.empty() || *end != '\0' || errno == ERANGE || value < 0 || value > INT32_MAX)
      fail("tokenizer decode: '{}' is not a token id", word);
    ids.push_back(static_cast<int32_t>(value));
  }
  const std::string text = tokenizer.decode(ids, o.skip_special_tokens);
  std::fwrite(text.data(), 1, text.size(), stdout);
  return 0;
}

}  // namespace

void add_tokenizer_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<TokenizerOptions>();
  auto* tok = app.add_subcommand("tokenizer",
                                 "Train byte-level BPE tokenizers; encode and decode text with a "
                                 "Hugging Face tokenizer.json");
  tok->require_subcommand(1);

  auto* train =
      tok->add_subcommand("train", "Train a byte-level BPE tokenizer on text files and write tokenizer.json");
  train->add_option("--input", o->inputs, "training text files (read line by line)")
      ->required()
      ->check(CLI::ExistingFile);
  train->add_option("--vocab-size", o->vocab_size, "vocabulary size, special tokens included")
      ->capture_default_str();
  train->add_option("--output", o->output, "where to write tokenizer.json")->required();
  train->add_option("--pattern", o->pattern, "pre-tokenization: gpt2, llama3 or a regular expression")
      ->capture_default_str();
  train->add_option("--special-token", o->special_tokens,
                    "special token, e.g. <|endoftext|> (repeatable; ids 0, 1, ...)");
  train->add_option("--bos-token", o->bos_token,
                    "special token that --add-special-tokens puts first when encoding");
  train->add_option("--min-frequency", o->min_frequency, "merge only pairs seen at least this often")
      ->capture_default_str();

  auto* encode =
      tok->add_subcommand("encode", "Print the token ids of a text (from --text or standard input)");
  encode->add_option("--tokenizer", o->tokenizer, "tokenizer.json")->required()->check(CLI::ExistingFile);
  encode->add_option("--text", o->text, "text to encode (default: all of standard input)")
      ->each([o](const std::string&) { o->text_given = true; });
  encode->add_flag("--add-special-tokens", o->add_special_tokens, "apply the post-processor (e.g. add BOS)");

  auto* decode = tok->add_subcommand("decode", "Print the text of token ids (arguments or standard input)");
  decode->add_option("--tokenizer", o->tokenizer, "tokenizer.json")->required()->check(CLI::ExistingFile);
  decode->add_option("ids", o->ids, "token ids (default: whitespace-separated ids on standard input)");
  decode->add_flag("--skip-special-tokens", o->skip_special_tokens, "leave special tokens out");
  decode->footer("The text is written exactly, without a trailing newline.");

  commands.push_back({tok, [o, train, encode, decode] {
                        if (*train) return run_train(*o);
                        if (*encode) return run_encode(*o);
                        if (*decode) return run_decode(*o);
                        return 1;
                      }});
}

}  // namespace forge::cli
