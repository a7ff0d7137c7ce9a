#include "forge/data/tokenizer/chat_template.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>

#include "forge/core/error.h"

namespace forge::data {
namespace {

using nlohmann::ordered_json;

constexpr std::array<const char*, 7> kSpecialTokens = {"bos_token", "eos_token", "unk_token", "sep_token",
                                                       "pad_token", "cls_token", "mask_token"};
constexpr std::array<const char*, 3> kReasoningFields = {"reasoning_content", "thinking", "reasoning"};
constexpr std::string_view kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot be read", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The set special tokens as strings (an AddedToken object gives its content).
ordered_json special_tokens_of(const ordered_json& config, std::string_view source) {
  ordered_json tokens = ordered_json::object();
  for (const char* key : kSpecialTokens) {
    const auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    if (it->is_string())
      tokens[key] = *it;
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
      tokens[key] = (*it)["content"];
    else
      fail("{}: '{}' must be a string or an object with a string 'content'", source, key);
  }
  return tokens;
}

std::string python_strip(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n\r\f\v");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\n\r\f\v") - a + 1);
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view text, std::string_view source, ordered_json special_tokens)
    : text_(text),
      source_(source),
      special_tokens_(std::move(special_tokens)),
      template_(jinja::Template::parse(text, source)) {}

ChatTemplate ChatTemplate::from_tokenizer_config(const ordered_json& config, std::string_view source,
                                                 const std::string& name) {
  if (!config.is_object()) fail("{}: must be a JSON object", source);
  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) fail("{}: has no 'chat_template'", source);
  const std::string wanted = name.empty() ? "default" : name;
  if (it->is_string()) {
    if (!name.empty() && name != "default")
      fail("{}: has one chat template, not one named '{}'", source, name);
    return ChatTemplate(it->get<std::string>(), fmt::format("{} chat_template", source),
                        special_tokens_of(config, source));
  }
  if (!it->is_array()) fail("{}: 'chat_template' must be a string or a list of {{name, template}}", source);
  std::vector<std::string> names;
  for (const ordered_json& entry : *it) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("template") || !entry["template"].is_string())
      fail("{}: each 'chat_template' entry must be an object with string 'name' and 'template'", source);
    names.push_back(entry["name"].get<std::string>());
    if (names.back() == wanted)
      return ChatTemplate(entry["template"].get<std::string>(),
                          fmt::format("{} chat_template '{}'", source, wanted),
                          special_tokens_of(config, source));
  }
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  fail("{}: no chat template named '{}' (it has: {})", source, wanted, list);
}

ChatTemplate ChatTemplate::from_folder(const std::filesystem::path& dir, const std::string& name) {
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  ordered_json config = ordered_json::object();
  if (std::filesystem::is_regular_file(config_path)) {
    try {
      config = ordered_json::parse(read_text(config_path));
    } catch (const ordered_json::parse_error& e) {
      fail("{}: not valid JSON: {}", config_path.string(), e.what());
    }
  }
  const std::filesystem::path jinja = dir / "chat_template.jinja";
  if (std::filesystem::is_regular_file(jinja) && (name.empty() || name == "default"))
    return ChatTemplate(read_text(jinja), jinja.string(), special_tokens_of(config, config_path.string()));
  if (!std::filesystem::is_regular_file(config_path))
    fail("{}: no chat_template.jinja or tokenizer_config.json with a chat template", dir.string());
  return from_tokenizer_config(config, config_path.string(), name);
}

ChatTemplate ChatTemplate::from_path(const std::filesystem::path& path, const std::string& name) {
  if (std::filesystem::is_directory(path)) return from_folder(path, name);
  if (!std::filesystem::is_regular_file(path)) fail("{}: is neither a folder nor a file", path.string());
  const std::string text = read_text(path);
  if (path.extension() == ".json") {
    ordered_json config;
    try {
      config = ordered_json::parse(text);
    } catch (const ordered_json::parse_error& e) {
      fail("{}: not valid JSON: {}", path.string(), e.what());
    }
    return from_tokenizer_config(config, path.string(), name);
  }
  if (!name.empty() && name != "default")
    fail("{}: a template file holds one template, not one named '{}'", path.string(), name);
  return ChatTemplate(text, path.string(), ordered_json::object());
}

jinja::Rendered ChatTemplate::render(const ordered_json& messages, const ChatOptions& options) const {
  if (!messages.is_array()) fail("{}: the conversation must be a JSON array of messages", source_);
  if (messages.empty()) fail("{}: the conversation is empty; give at least one message", source_);
  if (options.continue_final_message && options.add_generation_prompt)
    fail("{}: continue_final_message and add_generation_prompt do not go together", source_);
  if (!options.variables.is_object()) fail("{}: the template variables must be a JSON object", source_);
  // Each message without its null-valued keys, and with its reasoning under every name templates read it by.
  ordered_json chat = ordered_json::array();
  for (size_t m = 0; m < messages.size(); ++m) {
    const ordered_json& message = messages[m];
    if (!message.is_object())
      fail("{}: message {} of the conversation is not an object (got {})", source_, m + 1,
           message.type_name());
    ordered_json kept = ordered_json::object();
    for (const auto& [key, value] : message.items())
      if (!value.is_null()) kept[key] = value;
    const ordered_json* reasoning = nullptr;
    for (const char* field : kReasoningFields)
      if (kept.contains(field)) {
        reasoning = &kept[field];
        break;
      }
    if (reasoning) {
      ordered_json aliased = ordered_json::object();
      aliased["thinking"] = *reasoning;
      for (const auto& [key, value] : kept.items()) aliased[key] = value;
      aliased["reasoning_content"] = *reasoning;
      kept = std::move(aliased);
    }
    chat.push_back(std::move(kept));
  }
  std::string final_message;
  if (options.continue_final_message) {
    ordered_json& last = chat.back();
    if (!last.contains("content"))
      fail("{}: continue_final_message is set but the final message has no 'content' to continue", source_);
    if (text_.find("content") == std::string::npos)
      fail("{}: continue_final_message is set but the template reads no 'content'", source_);
    ordered_json& content = last["content"];
    if (content.is_array()) {
      bool found = false;
      for (auto block = content.rbegin(); block != content.rend(); ++block)
        if (block->is_object() && block->contains("text") && (*block)["text"].is_string()) {
          final_message = (*block)["text"].get<std::string>();
          (*block)["text"] = final_message + std::string(kContinueTag);
          found = true;
          break;
        }
      if (!found)
        fail("{}: continue_final_message is set but the final message has no text to continue", source_);
    } else if (content.is_string()) {
      final_message = content.get<std::string>();
      content = final_message + std::string(kContinueTag);
    } else {
      fail("{}: continue_final_message needs the final message's content as text", source_);
    }
  }
  ordered_json context = special_tokens_;
  context["messages"] = std::move(chat);
  context["tools"] = options.tools;
  context["documents"] = options.documents;
  context["add_generation_prompt"] = options.add_generation_prompt;
  for (const auto& [key, value] : options.variables.items()) context[key] = value;
  jinja::Rendered out = template_.render(context, options.now);
  if (options.continue_final_message) {
    const std::string tag = python_strip(std::string(kContinueTag));
    if (out.text.find(python_strip(final_message)) == std::string::npos ||
        out.text.find(tag) == std::string::npos)
      fail("{}: continue_final_message is set but the template does not render the final message as it is",
           source_);
    const size_t at = out.text.rfind(tag);
    if (out.text.compare(at, kContinueTag.size(), kContinueTag) == 0) {
      out.text.resize(at);
    } else {
      out.text.resize(at);
      while (!out.text.empty() &&
             std::string_view(" \t\n\r\f\v").find(out.text.back()) != std::string_view::npos)
        out.text.pop_back();
    }
    for (auto& [begin, end] : out.generation)
      begin = std::min(begin, out.text.size()), end = std::min(end, out.text.size());
  }
  return out;
}

}  // namespace forge::data
