// forge tokenizer: train a byte-level BPE tokenizer, encode or decode text with a tokenizer.json, and render
// a conversation with a Hugging Face chat template.
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/data/text/sft_data.h"
#include "forge/data/tokenizer/bpe_trainer.h"
#include "forge/data/tokenizer/chat_template.h"
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
  // chat
  std::string chat_template, template_name, messages, tools;
  std::vector<std::string> variables;
  bool add_generation_prompt = false, continue_final_message = false, spans = false, mask = false;
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

std::string read_file_or_stdin(const std::string& path, const char* what) {
  if (path.empty() || path == "-") return read_stdin();
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer chat: {} '{}' cannot be read", what, path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

nlohmann::ordered_json parse_json(const std::string& text, const std::string& source) {
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::ordered_json::parse_error& e) {
    fail("tokenizer chat: {} is not valid JSON: {}", source, e.what());
  }
}

int run_chat(const TokenizerOptions& o) {
  const ChatTemplate chat = ChatTemplate::from_path(o.chat_template, o.template_name);
  const std::string source = o.messages.empty() || o.messages == "-" ? "standard input" : o.messages;
  nlohmann::ordered_json conversation = parse_json(read_file_or_stdin(o.messages, "--messages"), source);
  ChatOptions options;
  // {"messages": [...], "tools": [...]} (the common dataset row) or the messages' array itself.
  if (conversation.is_object()) {
    if (!conversation.contains("messages")) fail("tokenizer chat: {} has no 'messages'", source);
    if (conversation.contains("tools")) options.tools = conversation["tools"];
    conversation = nlohmann::ordered_json(conversation["messages"]);
  }
  if (!o.tools.empty()) options.tools = parse_json(read_file_or_stdin(o.tools, "--tools"), o.tools);
  options.add_generation_prompt = o.add_generation_prompt;
  options.continue_final_message = o.continue_final_message;
  for (const std::string& v : o.variables) {
    const size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0) fail("tokenizer chat: --var '{}' is not name=value", v);
    const std::string value = v.substr(eq + 1);
    // A JSON value where it reads as one (true, 3, "x", [..]), else the text itself.
    options.variables[v.substr(0, eq)] = nlohmann::ordered_json::accept(value)
                                             ? nlohmann::ordered_json::parse(value)
                                             : nlohmann::ordered_json(value);
  }
  if (o.mask) {  // the ids and, below them, which ones fine-tuning trains on
    if (o.tokenizer.empty()) fail("tokenizer chat: --mask needs --tokenizer");
    if (o.add_generation_prompt || o.continue_final_message || !o.variables.empty())
      fail(
          "tokenizer chat: --mask shows a training conversation as is (no generation prompt, continuation or "
          "--var)");
    const Tokenizer tokenizer = Tokenizer::from_file(o.tokenizer);
    const SftConversation c = tokenize_conversation(chat, tokenizer, conversation, options.tools, false);
    std::string ids, mask;
    for (size_t i = 0; i < c.ids.size(); ++i)
      ids += (i ? " " : "") + std::to_string(c.ids[i]), mask += (i ? " " : "") + std::to_string(c.trained[i]);
    std::printf("%s\n%s\n", ids.c_str(), mask.c_str());
    return 0;
  }
  const jinja::Rendered rendered = chat.render(conversation, options);
  if (!o.tokenizer.empty()) {
    const Tokenizer tokenizer = Tokenizer::from_file(o.tokenizer);
    const std::vector<int32_t> ids = tokenizer.encode(rendered.text, false);
    std::string line;
    for (size_t i = 0; i < ids.size(); ++i) line += (i ? " " : "") + std::to_string(ids[i]);
    std::printf("%s\n", line.c_str());
    return 0;
  }
  std::fwrite(rendered.text.data(), 1, rendered.text.size(), stdout);
  if (o.spans)
    for (const auto& [begin, end] : rendered.generation)
      std::fprintf(stderr, "generation [%zu, %zu)\n", begin, end);
  return 0;
}

}  // namespace

void add_tokenizer_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<TokenizerOptions>();
  auto* tok = app.add_subcommand("tokenizer",
                                 "Train byte-level BPE tokenizers; encode and decode text with a "
                                 "Hugging Face tokenizer.json; render conversations with chat templates");
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

  auto* chat = tok->add_subcommand(
      "chat",
      "Render a conversation with a Hugging Face chat template, as transformers' apply_chat_template");
  chat->add_option("--template", o->chat_template,
                   "a model or tokenizer folder (chat_template.jinja or tokenizer_config.json), a "
                   "tokenizer_config.json, or a .jinja file")
      ->required();
  chat->add_option("--name", o->template_name,
                   "which of a tokenizer_config.json's named templates (default: default)");
  chat->add_option("--messages", o->messages,
                   "JSON file: the messages' array, or an object with 'messages' (and 'tools') "
                   "(default: standard input)");
  chat->add_option("--tools", o->tools, "JSON file: a list of tool schemas");
  chat->add_flag("--add-generation-prompt", o->add_generation_prompt, "end with the assistant's turn header");
  chat->add_flag("--continue-final-message", o->continue_final_message,
                 "end where the last message's content ends, for generation to continue it");
  chat->add_option(
      "--var", o->variables,
      "a template variable, name=value (value as JSON where it parses, e.g. enable_thinking=false; "
      "repeatable)");
  chat->add_option("--tokenizer", o->tokenizer, "tokenizer.json: print the rendering's token ids instead")
      ->check(CLI::ExistingFile);
  chat->add_flag("--spans", o->spans,
                 "also print the {% generation %} spans (byte ranges) to standard error");
  chat->add_flag("--mask", o->mask,
                 "with --tokenizer: print the ids, then a line of 0/1 marking the assistant's tokens that "
                 "fine-tuning trains on (data.sft)");
  chat->footer(
      "The text is written exactly, without a trailing newline. Special tokens come from the "
      "template's tokenizer_config.json (or --var bos_token=...).");

  commands.push_back({tok, [o, train, encode, decode, chat] {
                        if (*train) return run_train(*o);
                        if (*encode) return run_encode(*o);
                        if (*decode) return run_decode(*o);
                        if (*chat) return run_chat(*o);
                        return 1;
                      }});
}

}  // namespace forge::cli
