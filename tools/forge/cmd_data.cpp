// forge data: tokenize text corpora into Megatron indexed datasets (.bin/.idx), and describe one; pack
// image-text JSONL for multimodal training, and render a synthetic image-caption set.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/philox.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/image/image_text.h"
#include "forge/data/image/synthetic_images.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/data/text/preprocess.h"
#include "forge/data/text/text_corpus.h"
#include "forge/data/tokenizer/tokenizer.h"

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
  // preprocess-images
  std::string image_input, image_output, preprocessor, images_root, caption_prompt, caption_separator = "\n";
  int64_t seq_len = 0, tokens_per_image = 0;
  int32_t image_token_id = -1;
  bool skip_bad = false, skip_too_long = false, add_bos = true, add_eos = true;
  // synth-images
  std::string synth_out;
  int64_t synth_count = 0, synth_size = 64;
  uint64_t synth_seed = 0;
  double synth_heldout = 0.1;
  std::string qa_out;
  double qa_heldout = 0.05;
  uint64_t qa_seed = 1;
  int image_workers = 0;  // preprocess-images, synth-images: 0 = OpenMP's default
};

int run_preprocess_images(const DataOptions& o) {
  const char* name = "data preprocess-images";
  if (o.image_input.empty()) fail("{}: --input FILE.jsonl is required", name);
  if (o.image_output.empty()) fail("{}: --output FILE is required", name);
  if (o.preprocessor.empty()) fail("{}: --preprocessor preprocessor_config.json is required", name);
  if (o.tokenizer.empty()) fail("{}: --tokenizer tokenizer.json (or 'bytes') is required", name);
  if (o.seq_len < 1) fail("{}: --seq-len must be positive", name);
  if (o.image_token_id < 0) fail("{}: --image-token-id is required (the model's image_token_index)", name);
  if (o.tokens_per_image < 1)
    fail("{}: --tokens-per-image is required (the vision tower's patch count)", name);

  std::unique_ptr<Tokenizer> tokenizer;
  TextEncoder encoder = TextEncoder::bytes();
  if (o.tokenizer != "bytes") {
    tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_file(o.tokenizer));
    encoder = TextEncoder::from_tokenizer(*tokenizer);
  }
  const ImageProcessor processor(ImageProcessorConfig::from_json_file(o.preprocessor));
  ImageTextOptions options;
  options.seq_len = o.seq_len;
  options.image_token_id = o.image_token_id;
  options.tokens_per_image = o.tokens_per_image;
  options.images_root = o.images_root;
  options.skip_bad = o.skip_bad;
  options.skip_too_long = o.skip_too_long;
  options.text_template.caption_prompt = o.caption_prompt;
  options.text_template.caption_separator = o.caption_separator;
  options.text_template.add_bos = o.add_bos;
  options.text_template.add_eos = o.add_eos;

  const ImageTextDataset dataset = ImageTextDataset::from_jsonl(o.image_input, encoder, processor, options);
  for (const std::string& reason : dataset.skip_reasons())
    std::fprintf(stderr, "skipped: %s\n", reason.c_str());
  const PackImageTextStats stats =
      write_packed_image_text(dataset, o.image_output, encoder.fingerprint, o.image_workers);
  const auto shape = dataset.image_shape();
  std::printf("%lld samples, %lld images (%lldx%lld), seq_len %lld", static_cast<long long>(stats.samples),
              static_cast<long long>(stats.images), static_cast<long long>(shape[2]),
              static_cast<long long>(shape[1]), static_cast<long long>(dataset.seq_len()));
  if (dataset.skipped_bad() + dataset.skipped_too_long() > 0)
    std::printf("; skipped %lld bad and %lld too long", static_cast<long long>(dataset.skipped_bad()),
                static_cast<long long>(dataset.skipped_too_long()));
  const double seconds = stats.seconds > 0 ? stats.seconds : 1e-9;
  std::printf("\nwrote %s (%.2f MB) in %.2f s: %.0f images/s\n", o.image_output.c_str(),
              static_cast<double>(stats.bytes) / 1e6, stats.seconds,
              static_cast<double>(stats.images) / seconds);
  return 0;
}

// The KJV as questions and answers for fine-tuning: "Which book of the Bible has this verse?" for every
// verse, answered with the book's name; a chat template in plain text ending each answer with <|endoftext|>
// (the end-of-sequence token of the tokenizer `forge train` learns on the KJV).
int run_synth_qa(const DataOptions& o) {
  if (o.qa_out.empty()) fail("data synth-qa: --out DIR is required");
  if (!(o.qa_heldout > 0 && o.qa_heldout < 1))
    fail("data synth-qa: --heldout must be in (0, 1), got {}", o.qa_heldout);
  const std::vector<KjvVerse> verses = load_kjv_verses();
  std::filesystem::create_directories(o.qa_out);
  std::string train, heldout;
  int64_t held = 0;
  for (size_t i = 0; i < verses.size(); ++i) {
    nlohmann::ordered_json row;
    row["id"] = fmt::format("{} {}:{}", verses[i].book, verses[i].chapter, verses[i].verse);
    row["messages"] = {
        {{"role", "user"}, {"content", "Which book of the Bible has this verse? " + verses[i].text}},
        {{"role", "assistant"}, {"content", verses[i].book}}};
    // Held out by a draw per verse from (seed, index): spread over every book.
    const uint32_t draw =
        philox4x32_10({static_cast<uint32_t>(i), 0, 0, 0},
                      {static_cast<uint32_t>(o.qa_seed), static_cast<uint32_t>(o.qa_seed >> 32)})[0];
    const bool out = static_cast<double>(draw) / 4294967296.0 < o.qa_heldout;
    (out ? heldout : train) += row.dump() + "\n";
    held += out;
  }
  const std::filesystem::path dir = o.qa_out;
  write_file_atomically(dir / "train.jsonl", train, "questions");
  write_file_atomically(dir / "heldout.jsonl", heldout, "questions");
  nlohmann::ordered_json config;
  config["eos_token"] = "<|endoftext|>";
  config["chat_template"] =
      "{% for m in messages %}{% if m.role == 'user' %}{{ 'Question: ' + m.content + '\\n' }}"
      "{% elif m.role == 'assistant' %}{{ 'Answer: ' + m.content + eos_token + '\\n' }}{% endif %}{% endfor "
      "%}"
      "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}";
  write_file_atomically(dir / "tokenizer_config.json", config.dump(2) + "\n", "chat template");
  std::printf(
      "wrote %lld training and %lld held-out questions (%zu verses, 66 books) and a chat template to %s\n",
      static_cast<long long>(verses.size()) - held, static_cast<long long>(held), verses.size(),
      o.qa_out.c_str());
  return 0;
}

int run_synth_images(const DataOptions& o) {
  if (o.synth_out.empty()) fail("data synth-images: --out DIR is required");
  if (o.synth_count < 1) fail("data synth-images: --count N is required (N >= 1)");
  SynthImagesOptions options;
  options.out = o.synth_out;
  options.count = o.synth_count;
  options.size = o.synth_size;
  options.seed = o.synth_seed;
  options.heldout = o.synth_heldout;
  options.workers = o.image_workers;
  const SynthImagesStats stats = write_synth_images(options);
  std::printf("wrote %lld training and %lld held-out %lldx%lld images with captions to %s in %.2f s\n",
              static_cast<long long>(stats.train), static_cast<long long>(stats.heldout),
              static_cast<long long>(o.synth_size), static_cast<long long>(o.synth_size), o.synth_out.c_str(),
              stats.seconds);
  return 0;
}

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
                                  "them; pack image-text data; render a synthetic image-caption set");
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

  auto* images = data->add_subcommand(
      "preprocess-images",
      "Tokenize image-text JSONL (LLaVA conversations or captions) and pack it with its preprocessed images "
      "into one file for multimodal training");
  images->add_option("--input", o->image_input,
                     "JSONL file, one {\"image\", \"conversations\"|\"caption\"} per line");
  images->add_option("--output", o->image_output, "packed file to write");
  images->add_option("--preprocessor", o->preprocessor,
                     "the vision tower's preprocessor_config.json (CLIP or SigLIP image processor)");
  images->add_option("--tokenizer", o->tokenizer,
                     "Hugging Face tokenizer.json, or 'bytes' (id = byte value)");
  images->add_option("--seq-len", o->seq_len, "tokens per sample");
  images->add_option("--image-token-id", o->image_token_id, "the model's image token id (image_token_index)");
  images->add_option("--tokens-per-image", o->tokens_per_image, "image token positions per image");
  images->add_option("--images-root", o->images_root,
                     "folder the image paths are relative to (default: the JSONL's)");
  images->add_option("--caption-prompt", o->caption_prompt, "caption form: text before the image (masked)");
  images->add_option("--caption-separator", o->caption_separator,
                     "caption form: text between the image and the caption (masked; default a newline)");
  images->add_flag("--bos,!--no-bos", o->add_bos,
                   "start each sample with the tokenizer's BOS id, if any (default on)");
  images->add_flag("--eos,!--no-eos", o->add_eos,
                   "end each answer / caption with the tokenizer's end-of-text id, if any (default on)");
  images->add_flag("--skip-bad", o->skip_bad,
                   "skip and count malformed lines and missing or corrupt images instead of stopping");
  images->add_flag("--skip-too-long", o->skip_too_long,
                   "skip and count samples whose image tokens do not fit in --seq-len instead of stopping");
  images
      ->add_option("--workers", o->image_workers,
                   "image decoding threads, 0 for all (the output does not depend on it)")
      ->capture_default_str();
  images->footer(
      "Conversation turns are USER: <human value>\\n (masked), ASSISTANT: (masked) <gpt value><eos> "
      "(trained); "
      "each <image> becomes --tokens-per-image copies of --image-token-id. The file holds ids, targets and "
      "each "
      "image's 8-bit crop after resize and crop; it is written under a temporary name and renamed when "
      "complete. Layout: docs/formats.md (Image-text data).");

  auto* synth = data->add_subcommand(
      "synth-images",
      "Render a synthetic image-caption dataset (shapes, colours, positions) with train.jsonl, heldout.jsonl "
      "and a SigLIP preprocessor_config.json");
  synth->add_option("--out", o->synth_out, "output folder");
  synth->add_option("--count", o->synth_count, "number of images");
  synth->add_option("--size", o->synth_size, "image side in pixels (16..4096)")->capture_default_str();
  synth->add_option("--seed", o->synth_seed, "random seed (the same seed gives the same bytes)")
      ->capture_default_str();
  synth->add_option("--heldout", o->synth_heldout, "fraction of images (the last ones) in heldout.jsonl")
      ->capture_default_str();
  synth
      ->add_option("--workers", o->image_workers,
                   "rendering threads, 0 for all (the output does not depend on it)")
      ->capture_default_str();
  synth->footer(
      "Each image holds one or two non-overlapping shapes (circle, square, triangle, cross) in one of 8 "
      "colours, "
      "small or large, on the left, right, top, bottom or in the centre, over a plain or noisy grey "
      "background; "
      "its caption says so (\"a large red circle on the left and a small blue square at the top\").");

  auto* qa = data->add_subcommand(
      "synth-qa",
      "Write the KJV as fine-tuning conversations (\"Which book of the Bible has this verse?\"), train.jsonl "
      "and heldout.jsonl, with a plain-text chat template in tokenizer_config.json");
  qa->add_option("--out", o->qa_out, "output folder");
  qa->add_option("--heldout", o->qa_heldout,
                 "fraction of the verses held out (drawn per verse from the seed)")
      ->capture_default_str();
  qa->add_option("--seed", o->qa_seed, "seed of the held-out draw")->capture_default_str();
  commands.push_back({data, [o, pre, info, images, synth, qa] {
                        if (*qa) return run_synth_qa(*o);
                        if (*pre) return run_preprocess(*o);
                        if (*info) return run_info(*o);
                        if (*images) return run_preprocess_images(*o);
                        if (*synth) return run_synth_images(*o);
                        return 1;
                      }});
}

}  // namespace forge::cli
