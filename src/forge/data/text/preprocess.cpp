#include "forge/data/text/preprocess.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "forge/core/error.h"
#include "forge/data/text/indexed_dataset.h"

namespace forge::data {
namespace {

namespace fs = std::filesystem;

struct Document {
  std::string text;
  std::string where;  // "file" or "file:line", for error messages
};

bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos;
}

bool is_jsonl(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  return ext == ".jsonl" || ext == ".json";
}

std::string json_type_name(const nlohmann::json& value) { return value.type_name(); }

// Encodes documents in parallel and writes them in order.
class BatchWriter {
 public:
  BatchWriter(const PreprocessOptions& options, const EncodeFunction& encode, IndexedDatasetWriter& writer,
              PreprocessStats& stats)
      : options_(options), encode_(encode), writer_(writer), stats_(stats) {}

  void add(std::string text, std::string where) {
    pending_bytes_ += text.size();
    pending_.push_back({std::move(text), std::move(where)});
    if (pending_.size() >= kMaxDocuments || pending_bytes_ >= kMaxBytes) flush();
  }

  void flush() {
    const size_t n = pending_.size();
    if (n == 0) return;
    std::vector<std::vector<int32_t>> ids(n);
    std::vector<std::string> errors(n);
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t i; (i = next.fetch_add(1)) < n;) {
        try {
          encode_(pending_[i].text, ids[i]);
        } catch (const std::exception& e) {
          errors[i] = fmt::format("'{}': cannot encode: {}", pending_[i].where, e.what());
        }
      }
    };
    const size_t threads = std::min<size_t>(static_cast<size_t>(std::max(1, options_.workers)), n);
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& thread : pool) thread.join();

    for (size_t i = 0; i < n; ++i) {
      if (!errors[i].empty()) throw Error(errors[i]);
      std::vector<int32_t>& tokens = ids[i];
      stats_.bytes += static_cast<int64_t>(pending_[i].text.size());
      if (tokens.empty()) {
        ++stats_.empty_documents;
        continue;
      }
      for (size_t t = 0; t < tokens.size(); ++t)
        if (tokens[t] < 0 || tokens[t] >= options_.vocab_size)
          fail("'{}': token {} of the document is id {}, outside the vocabulary [0, {})", pending_[i].where,
               t, tokens[t], options_.vocab_size);
      if (options_.append_eod) tokens.push_back(*options_.eod_id);
      writer_.add_document(tokens);
      ++stats_.documents;
      stats_.tokens += static_cast<int64_t>(tokens.size());
    }
    pending_.clear();
    pending_bytes_ = 0;
  }

 private:
  static constexpr size_t kMaxDocuments = 8192, kMaxBytes = 16u << 20;
  const PreprocessOptions& options_;
  const EncodeFunction& encode_;
  IndexedDatasetWriter& writer_;
  PreprocessStats& stats_;
  std::vector<Document> pending_;
  size_t pending_bytes_ = 0;
};

std::ifstream open_input(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail("input '{}': no such file", path);
  if (fs::is_directory(path, ec)) fail("input '{}': is a directory, expected a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("input '{}': cannot open", path);
  return in;
}

void read_jsonl(const std::string& path, const std::string& key, BatchWriter& out) {
  std::ifstream in = open_input(path);
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (is_blank(line)) continue;
    const std::string where = fmt::format("{}:{}", path, number);
    nlohmann::json value;
    try {
      value = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      fail("{}: malformed JSON: {}", where, e.what());
    }
    if (!value.is_object()) fail("{}: expected a JSON object, got {}", where, json_type_name(value));
    const auto it = value.find(key);
    if (it == value.end()) fail("{}: the object has no \"{}\" field", where, key);
    if (!it->is_string()) fail("{}: field \"{}\" is {}, not a string", where, key, json_type_name(*it));
    out.add(it->get<std::string>(), where);
  }
  if (in.bad()) fail("input '{}': read error", path);
}

void read_text(const std::string& path, TextDocuments mode, BatchWriter& out) {
  std::ifstream in = open_input(path);
  if (mode == TextDocuments::file) {
    std::ostringstream text;
    text << in.rdbuf();
    if (in.bad()) fail("input '{}': read error", path);
    out.add(std::move(text).str(), path);
    return;
  }
  std::string line, paragraph;
  int64_t paragraph_line = 0;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (mode == TextDocuments::lines) {
      if (!is_blank(line)) out.add(line, fmt::format("{}:{}", path, number));
      continue;
    }
    if (is_blank(line)) {
      if (!paragraph.empty()) out.add(std::move(paragraph), fmt::format("{}:{}", path, paragraph_line));
      paragraph.clear();
      continue;
    }
    if (paragraph.empty()) {
      paragraph_line = number;
    } else {
      paragraph += '\n';
    }
    paragraph += line;
  }
  if (in.bad()) fail("input '{}': read error", path);
  if (!paragraph.empty()) out.add(std::move(paragraph), fmt::format("{}:{}", path, paragraph_line));
}

}  // namespace

TextDocuments text_documents_from_name(std::string_view name) {
  if (name == "file") return TextDocuments::file;
  if (name == "lines") return TextDocuments::lines;
  if (name == "blank-lines" || name == "blank_lines") return TextDocuments::blank_lines;
  fail("unknown document split '{}' for text files (expected file, lines or blank-lines)", name);
}

PreprocessStats preprocess_to_indexed_dataset(const PreprocessOptions& options,
                                              const EncodeFunction& encode) {
  const auto start = std::chrono::steady_clock::now();
  if (options.inputs.empty()) fail("preprocess: no input files");
  if (options.output_prefix.empty()) fail("preprocess: no output prefix");
  if (options.vocab_size <= 0)
    fail("preprocess: vocabulary size must be positive, got {}", options.vocab_size);
  if (options.workers < 1) fail("preprocess: workers must be at least 1, got {}", options.workers);
  if (options.json_key.empty()) fail("preprocess: the JSON key is empty");
  if (options.append_eod) {
    if (!options.eod_id)
      fail("preprocess: an end-of-document token is required (the tokenizer declares none)");
    if (*options.eod_id < 0 || *options.eod_id >= options.vocab_size)
      fail("preprocess: end-of-document id {} is outside the vocabulary [0, {})", *options.eod_id,
           options.vocab_size);
  }
  // Fail on a missing input before any output is created.
  for (const auto& input : options.inputs) open_input(input);

  const fs::path parent = fs::path(options.output_prefix).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec)
      fail("output '{}': cannot create directory '{}': {}", options.output_prefix, parent.string(),
           ec.message());
  }

  PreprocessStats stats;
  IndexedDatasetWriter writer(options.output_prefix, indexed_dtype_for_vocab(options.vocab_size));
  BatchWriter batches(options, encode, writer, stats);
  for (const auto& input : options.inputs) {
    if (is_jsonl(input)) {
      read_jsonl(input, options.json_key, batches);
    } else {
      read_text(input, options.split, batches);
    }
  }
  batches.flush();
  if (stats.documents == 0) fail("preprocess: the inputs hold no non-empty document");
  writer.finalize();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace forge::data
