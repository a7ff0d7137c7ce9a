// Supervised fine-tuning data: conversations as JSONL, rendered with the model's chat template, tokenized,
// and given a loss mask that trains on what the assistant says.
//
// Lines. One JSON object per line (blank lines skipped; line numbers count every line) with either
// `messages` (the common form: [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...],
// any further keys a template reads, such as tool_calls or reasoning_content) or ShareGPT's `conversations`
// ([{"from": "system" | "human" | "gpt" | "tool" | "function_call" | "observation", "value": "..."}]),
// optionally `tools` (JSON schemas for the template) and `id` (ignored).
//
// Loss mask. The assistant's tokens are those the template's {% generation %} blocks render, as
// transformers' return_assistant_tokens_mask reads them, when the template has such blocks. Otherwise each
// assistant message's span starts where the whole conversation stops agreeing with the conversation before
// the message rendered with the generation prompt, and ends where rendering the conversation through the
// message ends (its content and the template's end of turn, e.g. "...<|im_end|>\n") when that rendering is
// the start of the whole; a template that renders an earlier turn otherwise once later turns follow (Qwen3
// drops its reasoning) ends the turn at the first eos_token after its start instead, and one with no
// eos_token there is refused. A token is trained when its text overlaps a span (transformers' rule); with
// loss_on_all every token is. Tokens: the whole rendering encoded at once (no special tokens added, as
// apply_chat_template(tokenize=True)).
//
// Samples. Conversation i is ids[0 .. seq_len) (padded with the tokenizer's pad token, else its EOS, else
// 0) and targets[t] = ids[t + 1] when token t + 1 is trained, else -1; a longer conversation is cut to
// seq_len + 1 tokens and counted. Conversations with no trained token left are skipped and counted.
//
// Errors are one line naming the file and line (invalid JSON, an unknown key, a wrong type, neither or
// both of messages/conversations, an unknown ShareGPT role, a template's raise_exception); with skip_bad
// such lines are skipped and counted, the first ten reasons kept. A file with no usable conversation is an
// error.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "forge/data/tokenizer/chat_template.h"
#include "forge/data/tokenizer/tokenizer.h"

namespace forge::data {

struct SftOptions {
  int64_t seq_len = 0;
  bool loss_on_all = false;  // train on every token, prompts and template text included
  bool skip_bad = false;
};

// One conversation, tokenized, with its mask.
struct SftConversation {
  std::vector<int32_t> ids;
  std::vector<uint8_t> trained;  // per token: 1 = trained
  int64_t line = 0;
};

// The mask of one conversation's rendering (exposed for tests and `forge tokenizer chat --mask`).
SftConversation tokenize_conversation(const ChatTemplate& chat, const Tokenizer& tokenizer,
                                      const nlohmann::ordered_json& messages,
                                      const nlohmann::ordered_json& tools, bool loss_on_all);

class SftDataset {
 public:
  static SftDataset from_jsonl(const std::filesystem::path& path, const ChatTemplate& chat,
                               const Tokenizer& tokenizer, const SftOptions& options);

  int64_t size() const { return static_cast<int64_t>(conversations_.size()); }
  int64_t seq_len() const { return seq_len_; }
  // ids and targets [seq_len] of conversation i.
  void fill(int64_t i, int32_t* ids, int32_t* targets) const;
  // Packing: the conversations `members` one after another in one sequence of seq_len (a conversation cut to
  // seq_len + 1 tokens takes seq_len positions, its last token only a target), then padding.
  void fill_packed(const std::vector<int64_t>& members, int32_t* ids, int32_t* targets) const;
  // Appends that sequence's document lengths: the members', then the padding's when there is any (for
  // attention within each).
  void packed_documents(const std::vector<int64_t>& members, std::vector<int64_t>& documents) const;
  // Packs conversations in the given order: each joins the current sequence when it fits, else starts the
  // next one (greedy, order kept). Returns each sequence's members.
  std::vector<std::vector<int64_t>> pack(const std::vector<int64_t>& order) const;
  int64_t positions(int64_t i) const;  // the positions conversation i takes in a sequence
  const SftConversation& conversation(int64_t i) const { return conversations_.at(static_cast<size_t>(i)); }

  int64_t lines() const { return lines_; }
  int64_t skipped_bad() const { return skipped_bad_; }
  int64_t skipped_untrained() const { return skipped_untrained_; }
  int64_t truncated() const { return truncated_; }
  int64_t trained_tokens() const { return trained_tokens_; }  // targets that are not -1, over the set
  const std::vector<std::string>& skip_reasons() const { return skip_reasons_; }
  int32_t pad_id() const { return pad_id_; }

 private:
  std::vector<SftConversation> conversations_;
  int64_t seq_len_ = 0;
  int32_t pad_id_ = 0;
  int64_t lines_ = 0, skipped_bad_ = 0, skipped_untrained_ = 0, truncated_ = 0, trained_tokens_ = 0;
  std::vector<std::string> skip_reasons_;
};

}  // namespace forge::data
