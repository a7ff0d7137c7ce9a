#include "forge/data/text/sft_data.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <regex>

#include "forge/core/error.h"
#include "forge/core/suggest.h"

namespace forge::data {
namespace {

using nlohmann::ordered_json;

// transformers' test for a template with assistant spans.
bool has_generation_blocks(const std::string& text) {
  static const std::regex pattern(R"(\{%-?\s*generation\s*-?%\})");
  return std::regex_search(text, pattern);
}

// The tokens of `ids` (the encoding of the whole text) before byte `at`: with exact, the tokens up to `at`
// are exactly the encoding of text[0, at); else the token at the returned index straddles `at`.
int64_t tokens_before(const Tokenizer& tokenizer, const std::string& text, size_t at,
                      const std::vector<int32_t>& ids, bool& exact) {
  const std::vector<int32_t> head = tokenizer.encode(std::string_view(text).substr(0, at), false);
  size_t common = 0;
  while (common < head.size() && common < ids.size() && head[common] == ids[common]) ++common;
  exact = common == head.size();
  return static_cast<int64_t>(common);
}

// Each assistant message's span: what rendering the conversation through it adds to rendering the
// conversation before it with the generation prompt.
std::vector<std::pair<size_t, size_t>> prefix_spans(const ChatTemplate& chat, const ordered_json& messages,
                                                    const ChatOptions& base, const std::string& full) {
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object() || messages[i].value("role", "") != "assistant") continue;
    std::string before;
    if (i > 0) {
      ChatOptions prompt = base;
      prompt.add_generation_prompt = true;
      before =
          chat.render(ordered_json(std::vector<ordered_json>(messages.begin(), messages.begin() + i)), prompt)
              .text;
    }
    const std::string through =
        chat.render(ordered_json(std::vector<ordered_json>(messages.begin(), messages.begin() + i + 1)), base)
            .text;
    // Where the whole conversation stops agreeing with the one before the message and its generation prompt
    // (all of that prompt, unless the template's prompt opens what an earlier turn then renders otherwise,
    // as Qwen3's "<think>").
    size_t start = 0;
    while (start < before.size() && start < full.size() && before[start] == full[start]) ++start;
    if (start == before.size() && through.compare(0, start, before) == 0 &&
        full.compare(0, through.size(), through) == 0) {
      spans.emplace_back(start, through.size());
      continue;
    }
    // The turn renders otherwise once later turns follow (Qwen3 drops an earlier turn's reasoning): it ends
    // at the template's end-of-sequence token, the first after its start.
    const std::string eos = chat.special_tokens().value("eos_token", "");
    const size_t end = eos.empty() ? std::string::npos : full.find(eos, start);
    if (end == std::string::npos)
      fail(
          "{}: the chat template renders assistant message {} differently once later turns follow, and no "
          "eos_token ends it; use a template with {{% generation %}} blocks, or train on every token "
          "(data.sft_loss = \"all\")",
          chat.source(), i + 1);
    spans.emplace_back(start, end + eos.size());
  }
  return spans;
}

// ShareGPT's "conversations" as messages.
ordered_json from_sharegpt(const ordered_json& turns) {
  if (!turns.is_array()) fail("'conversations' must be a list of turns");
  ordered_json messages = ordered_json::array();
  for (size_t t = 0; t < turns.size(); ++t) {
    const ordered_json& turn = turns[t];
    if (!turn.is_object() || !turn.contains("from") || !turn["from"].is_string() || !turn.contains("value"))
      fail("turn {} of 'conversations' needs 'from' and 'value'", t + 1);
    const std::string from = turn["from"].get<std::string>();
    std::string role;
    if (from == "human" || from == "user")
      role = "user";
    else if (from == "gpt" || from == "assistant" || from == "function_call")
      role = "assistant";
    else if (from == "system")
      role = "system";
    else if (from == "tool" || from == "observation")
      role = "tool";
    else
      fail(
          "turn {} of 'conversations': 'from' is '{}' (human, gpt, system, tool, function_call or "
          "observation)",
          t + 1, from);
    ordered_json m = ordered_json::object();
    m["role"] = role, m["content"] = turn["value"];
    messages.push_back(std::move(m));
  }
  return messages;
}

int32_t pad_id_of(const Tokenizer& tokenizer) {
  for (const char* name : {"<pad>", "<|pad|>", "[PAD]", "<|endoftext|>"})
    if (const auto id = tokenizer.token_to_id(name)) return *id;
  return tokenizer.eos_id().value_or(0);
}

}  // namespace

SftConversation tokenize_conversation(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                      const ordered_json& messages, const ordered_json& tools,
                                      bool loss_on_all) {
  ChatOptions options;
  options.tools = tools;
  const jinja::Rendered full = chat.render(messages, options);
  SftConversation out;
  out.ids = tokenizer.encode(full.text, false);
  out.trained.assign(out.ids.size(), loss_on_all ? 1 : 0);
  if (loss_on_all) return out;
  const std::vector<std::pair<size_t, size_t>> spans =
      has_generation_blocks(chat.text()) ? full.generation : prefix_spans(chat, messages, options, full.text);
  for (const auto& [begin, end] : spans) {
    if (begin >= end) continue;
    bool exact = false;
    const int64_t first = tokens_before(tokenizer, full.text, begin, out.ids, exact);
    int64_t last = tokens_before(tokenizer, full.text, end, out.ids, exact);
    if (!exact) ++last;  // the token across the span's end overlaps it
    last = std::min<int64_t>(last, static_cast<int64_t>(out.ids.size()));
    for (int64_t t = first; t < last; ++t) out.trained[static_cast<size_t>(t)] = 1;
  }
  return out;
}

SftDataset SftDataset::from_jsonl(const std::filesystem::path& path, const ChatTemplate& chat,
                                  const Tokenizer& tokenizer, const SftOptions& options) {
  if (options.seq_len < 1) fail("{}: seq_len must be at least 1", path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot be read", path.string());
  SftDataset set;
  set.seq_len_ = options.seq_len;
  set.pad_id_ = pad_id_of(tokenizer);
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++set.lines_;
    try {
      ordered_json row;
      try {
        row = ordered_json::parse(line);
      } catch (const ordered_json::parse_error& e) {
        fail("invalid JSON: {}", e.what());
      }
      if (!row.is_object()) fail("a line must be a JSON object, got {}", row.type_name());
      const bool has_messages = row.contains("messages"), has_turns = row.contains("conversations");
      if (has_messages == has_turns) {
        std::string hint = has_messages ? " (it has both)" : "";
        for (const auto& [k, v] : row.items())
          if (hint.empty()) {
            const std::string near = did_you_mean(k, {"messages", "conversations"});
            if (!near.empty()) hint = fmt::format(" (it has '{}'{})", k, near);
          }
        fail("a line needs one of 'messages' and 'conversations'{}", hint);
      }
      const ordered_json messages = has_messages ? row["messages"] : from_sharegpt(row["conversations"]);
      if (!messages.is_array() || messages.empty()) fail("'messages' must be a non-empty list");
      const ordered_json tools = row.contains("tools") ? row["tools"] : ordered_json();
      SftConversation c = tokenize_conversation(chat, tokenizer, messages, tools, options.loss_on_all);
      c.line = number;
      const size_t keep = static_cast<size_t>(options.seq_len) + 1;
      if (c.ids.size() > keep) c.ids.resize(keep), c.trained.resize(keep), ++set.truncated_;
      int64_t trained = 0;
      for (size_t t = 1; t < c.ids.size(); ++t) trained += c.trained[t];
      if (trained == 0) {
        ++set.skipped_untrained_;
        continue;
      }
      set.trained_tokens_ += trained;
      set.conversations_.push_back(std::move(c));
    } catch (const Error& e) {
      const std::string reason = fmt::format("{}:{}: {}", path.string(), number, e.what());
      if (!options.skip_bad) fail("{}", reason);
      ++set.skipped_bad_;
      if (set.skip_reasons_.size() < 10) set.skip_reasons_.push_back(reason);
    }
  }
  if (set.conversations_.empty())
    fail("{}: no usable conversation ({} lines, {} skipped as bad, {} with no trained token)", path.string(),
         set.lines_, set.skipped_bad_, set.skipped_untrained_);
  return set;
}

int64_t SftDataset::positions(int64_t i) const {
  return std::min<int64_t>(static_cast<int64_t>(conversation(i).ids.size()), seq_len_);
}

std::vector<std::vector<int64_t>> SftDataset::pack(const std::vector<int64_t>& order) const {
  std::vector<std::vector<int64_t>> packs;
  int64_t used = seq_len_;
  for (const int64_t i : order) {
    const int64_t n = positions(i);
    if (used + n > seq_len_) packs.emplace_back(), used = 0;
    packs.back().push_back(i), used += n;
  }
  return packs;
}

void SftDataset::fill_packed(const std::vector<int64_t>& members, int32_t* ids, int32_t* targets) const {
  int64_t at = 0;
  for (const int64_t i : members) {
    const SftConversation& c = conversation(i);
    const int64_t n = static_cast<int64_t>(c.ids.size()), length = positions(i);
    FORGE_CHECK(at + length <= seq_len_, "packed conversations overflow a sequence of {}", seq_len_);
    for (int64_t t = 0; t < length; ++t) {
      ids[at + t] = c.ids[static_cast<size_t>(t)];
      targets[at + t] =
          t + 1 < n && c.trained[static_cast<size_t>(t + 1)] ? c.ids[static_cast<size_t>(t + 1)] : -1;
    }
    at += length;
  }
  for (; at < seq_len_; ++at) ids[at] = pad_id_, targets[at] = -1;
}

void SftDataset::packed_documents(const std::vector<int64_t>& members,
                                  std::vector<int64_t>& documents) const {
  int64_t at = 0;
  for (const int64_t i : members) documents.push_back(positions(i)), at += positions(i);
  if (at < seq_len_) documents.push_back(seq_len_ - at);
}

void SftDataset::fill(int64_t i, int32_t* ids, int32_t* targets) const {
  const SftConversation& c = conversation(i);
  const int64_t n = static_cast<int64_t>(c.ids.size());
  for (int64_t t = 0; t < seq_len_; ++t) {
    ids[t] = t < n ? c.ids[static_cast<size_t>(t)] : pad_id_;
    targets[t] = t + 1 < n && c.trained[static_cast<size_t>(t + 1)] ? c.ids[static_cast<size_t>(t + 1)] : -1;
  }
}

}  // namespace forge::data
