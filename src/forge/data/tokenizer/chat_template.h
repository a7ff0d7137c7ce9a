// Hugging Face chat templates: a conversation rendered to text as transformers' apply_chat_template renders
// it (tokenize=False), with the template's Jinja run by forge's engine (jinja.h).
//
// transformers hands the template `messages` (each message with its None-valued keys dropped, and its
// reasoning under all three of reasoning_content, thinking and reasoning when it has one), `tools`,
// `documents` (None unless given), `add_generation_prompt`, the tokenizer's special tokens that are set
// (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token, as strings) and any further
// variables, which override the special tokens. continue_final_message ends the rendering where the last
// message's content ends, so that generation continues it. Each behaviour here is that of transformers 5;
// tests/reference/chat_template_golden.py writes the fixtures that hold the two to the same bytes.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "forge/data/tokenizer/jinja.h"

namespace forge::data {

struct ChatOptions {
  bool add_generation_prompt = false;
  bool continue_final_message = false;
  nlohmann::ordered_json tools;      // a list of JSON schemas (null: none)
  nlohmann::ordered_json documents;  // a list of objects (null: none)
  // Further template variables (e.g. Qwen3's enable_thinking); an object.
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
  int64_t now = 0;  // > 0: the time strftime_now formats (seconds since the epoch, UTC), else the clock's
};

class ChatTemplate {
 public:
  // A model or tokenizer folder: chat_template.jinja when it has one (transformers 5 saves templates so),
  // else tokenizer_config.json's chat_template; the special tokens from tokenizer_config.json. `name` picks
  // one of several named templates ("" = "default"). Throws forge::Error naming the file for a folder with no
  // template, a name it does not have, or a template that does not parse.
  static ChatTemplate from_folder(const std::filesystem::path& dir, const std::string& name = "");
  // A folder (from_folder), a tokenizer_config.json, or a template file (any other name: its text, with no
  // special tokens). `name` as from_folder; a template file has one.
  static ChatTemplate from_path(const std::filesystem::path& path, const std::string& name = "");
  // The parsed tokenizer_config.json (source: its name in errors).
  static ChatTemplate from_tokenizer_config(const nlohmann::ordered_json& config, std::string_view source,
                                            const std::string& name = "");
  // A template's text with the special tokens transformers would pass ({"bos_token": "<s>", ...}).
  ChatTemplate(std::string_view text, std::string_view source, nlohmann::ordered_json special_tokens);

  // messages: a JSON array of message objects. Throws forge::Error naming the source for a malformed
  // conversation, a template's raise_exception (with its message) and errors at run time.
  jinja::Rendered render(const nlohmann::ordered_json& messages, const ChatOptions& options = {}) const;

  const std::string& text() const { return text_; }
  const std::string& source() const { return source_; }
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }

 private:
  std::string text_, source_;
  nlohmann::ordered_json special_tokens_;
  jinja::Template template_;
};

}  // namespace forge::data
