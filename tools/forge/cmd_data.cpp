// forge data: tokenize text corpora into Megatron indexed datasets (.bin/.idx), and describe one.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/data/indexed_dataset.h"
#include "forge/data/preprocess.h"
#include "forge/data/tokenizer.h"

namespace forge::cli {
using namespace forge::data;
namespace {

struct DataOptions {
  // preprocess
  std::vector<std::string> inputs;
  std::string output_prefix, tokenizer, json_key = "text", split_documents = "file";
  bool append_eod = true;
  int workers = 1;
  // info
  std::string data;
  bool json = false;
};

int run_preprocess(const DataOptions& o) {
  if (o.inputs.empty()) fail("data preprocess: --input FILE... is required");
  if (o.output_prefix.empty()) fail("data preprocess: --output-prefix PREFIX is required");
  if (o.tokenizer.empty()) fail("data preprocess: --tokenizer tokenizer.json is required");
  PreprocessOptions options;
  options.inputs = o.inputs;
  options.output_prefix = o.output_prefix;
  options.json_key = o.json_key;
  options.split = text_documents_from_name(o.split_documents);
  options.append_eod = o.append_eod;
  options.workers = o.workers;

  const Tokenizer tokenizer = Tokenizer::from_file(o.tokenizer);
  options.vocab_size = tokenizer.vocab_size();
  options.eod_id = tokenizer.eos_id();
  if (o.append_eod && !options.eod_id)
    fail(
        "data preprocess: tokenizer '{}' declares no end-of-sequence token; add one (e.g. <|endoftext|>) or "
        "pass "
        "--no-append-eod",
        o.tokenizer);
  const PreprocessStats stats = preprocess_to_indexed_dataset(
      options,
      [&tokenizer](std::string_view text, std::vector<int32_t>& out) { out = tokenizer.encode(text); });

  const double seconds = stats.seconds > 0 ? stats.seconds : 1e-9;
  std::printf("%lld documents", static_cast<long long>(stats.documents));
  if (stats.empty_documents)
    std::printf(" (%lld more skipped: no tokens)", static_cast<long long>(stats.empty_documents));
  std::printf(", %lld tokens%s, from %.2f MB of text in %.2f s: %.0f tokens/s, %.2f MB/s (%d worker%s)\n",
              static_cast<long long>(stats.tokens), o.append_eod ? " (end-of-document ids included)" : "",
              static_cast<double>(stats.bytes) / 1e6, stats.seconds,
              static_cast<double>(stats.tokens) / seconds, static_cast<double>(stats.bytes) / 1e6 / seconds,
              o.workers, o.workers == 1 ? "" : "s");
  std::printf("wrote %s and %s (%s tokens)\n", indexed_bin_path(o.output_prefix).c_str(),
              indexed_idx_path(o.output_prefix).c_str(),
              std::string(indexed_dtype_name(indexed_dtype_for_vocab(options.vocab_size))).c_str());
  return 0;
}

int run_info(const DataOptions& o) {
  if (o.data.empty()) fail("data info: --data PREFIX is required");
  const IndexedDataset data(o.data);
  int64_t longest = 0;
  for (int64_t s = 0; s < data.num_sequences(); ++s) longest = std::max(longest, data.sequence_length(s));
  const std::string dtype(indexed_dtype_name(data.dtype()));
  if (o.json) {
    nlohmann::ordered_json out = {{"prefix", o.data},
                                  {"dtype", dtype},
                                  {"documents", data.num_documents()},
                                  {"sequences", data.num_sequences()},
                                  {"tokens", data.total_tokens()},
                                  {"longest_sequence", longest}};
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("%s: %lld documents, %lld sequences, %lld %s tokens (longest sequence %lld)\n", o.data.c_str(),
              static_cast<long long>(data.num_documents()), static_cast<long long>(data.num_sequences()),
              static_cast<long long>(data.total_tokens()), dtype.c_str(), static_cast<long long>(longest));
  return 0;
}

}  // namespace

void add_data_command(CLI::App& app, Commands& commands) {
  auto o = std::make_shared<DataOptions>();
  auto* data = app.add_subcommand("data",
                                  "Tokenize corpora into Megatron indexed datasets (.bin/.idx) and inspect "
                                  "them");
  data->require_subcommand(1);

  auto* pre = data->add_subcommand(
      "preprocess",
      "Tokenize text or JSONL files into <prefix>.bin and <prefix>.idx (Megatron's format, one "
      "sequence per document)");
  pre->add_option("--input", o->inputs,
                  "input files, in order: .jsonl/.json (one JSON object per line) or plain text")
      ->expected(1, -1);
  pre->add_option("--output-prefix", o->output_prefix, "output path without .bin/.idx");
  pre->add_option("--tokenizer", o->tokenizer, "Hugging Face tokenizer.json");
  pre->add_option("--json-key", o->json_key, "JSONL field that holds the document text")
      ->capture_default_str();
  pre->add_option("--split-documents", o->split_documents,
                  "documents of a plain text file: file (the whole file), lines (each non-empty line) or "
                  "blank-lines (paragraphs)")
      ->capture_default_str();
  pre->add_flag("--append-eod,!--no-append-eod", o->append_eod,
                "end every document with the tokenizer's end-of-sequence id (default on)");
  pre->add_option("--workers", o->workers, "encoding threads (the output does not depend on it)")
      ->capture_default_str();
  pre->footer(
      "Blank JSONL lines are skipped; documents that encode to no tokens are skipped. The .bin is written "
      "first and the .idx last, each under a temporary name, so an interrupted run leaves no dataset.");

  auto* info = data->add_subcommand("info", "Validate an indexed dataset and print its sizes");
  info->add_option("--data", o->data, "dataset prefix (without .bin/.idx)");
  info->add_flag("--json", o->json, "print one JSON object");

  commands.push_back({data, [o, pre, info] {
                        if (*pre) return run_preprocess(*o);
                        if (*info) return run_info(*o);
                        return 1;
                      }});
}

}  // namespace forge::cli
