// Tokenizes text corpora into a Megatron indexed dataset (`forge data preprocess`).
//
// Inputs are read in the order given. A file ending in `.jsonl` or `.json` holds one JSON object per line
// whose string field `json_key` (default "text") is one document; blank lines are skipped, and any other
// line that is not such an object is an error naming file:line. Any other file is plain UTF-8 text, cut
// into documents by `split`: the whole file (`file`), each non-empty line without its newline (`lines`),
// or paragraphs separated by blank lines, keeping the newlines inside a paragraph (`blank_lines`).
//
// Each document is encoded to token ids, followed by the end-of-document id when append_eod is set, and
// written as one sequence and one document (GPT style). Documents that encode to no tokens are skipped.
// With several workers, documents are encoded in parallel in batches and written in input order, so the
// output is byte-identical for any worker count. The token dtype is uint16 when vocab_size < 65500,
// else int32 (Megatron's rule).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forge::data {

enum class TextDocuments { file, lines, blank_lines };
// "file", "lines", "blank-lines"; anything else is an error listing them.
TextDocuments text_documents_from_name(std::string_view name);

// Appends the token ids of `text` to `out`. Must be safe to call from several threads at once.
using EncodeFunction = std::function<void(std::string_view text, std::vector<int32_t>& out)>;

struct PreprocessOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::string json_key = "text";
  TextDocuments split = TextDocuments::file;
  bool append_eod = true;
  std::optional<int32_t> eod_id;  // required when append_eod
  int64_t vocab_size = 0;         // every id must be below it; chooses the token dtype
  int workers = 1;
};

struct PreprocessStats {
  int64_t documents = 0;        // written
  int64_t empty_documents = 0;  // skipped: no tokens
  int64_t tokens = 0;           // written, end-of-document ids included
  int64_t bytes = 0;            // text bytes encoded
  double seconds = 0;
};

// Throws forge::Error naming the file (and line) for unreadable or malformed input, and the document for
// an id outside [0, vocab_size). The output appears only when everything succeeded.
PreprocessStats preprocess_to_indexed_dataset(const PreprocessOptions& options, const EncodeFunction& encode);

}  // namespace forge::data
