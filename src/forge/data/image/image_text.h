// Image-text training data for LLaVA-style models: a JSONL file of conversations or captions beside a
// folder of images, tokenized into fixed-length samples whose images are preprocessed exactly as Hugging
// Face's image processor would (image_processor.h), or the same samples from a packed binary file.
//
// A sample is seq_len input ids and seq_len targets (the next token; -1 = no loss). Each image is a run of
// tokens_per_image copies of image_token_id in the ids, and the model replaces those positions with the
// image's features, images in order of appearance. Targets are masked on image tokens, on the prompt
// (human turns, role prefixes, the caption prompt, BOS) and on padding; the assistant turns / the caption
// and the end-of-text id after each are trained on. The template, the packed layout and every error are
// described in docs/formats.md ("Image-text data").
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "forge/core/tensor.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_processor.h"

namespace forge::data {

class Tokenizer;

// How text becomes ids: a Hugging Face tokenizer.json, or bytes (id = byte value, vocabulary 256).
struct TextEncoder {
  std::function<std::vector<int32_t>(std::string_view)> encode;  // thread-safe
  std::optional<int32_t> bos_id, eos_id;
  int32_t pad_id = 0;
  int64_t vocab_size = 0;
  // Identifies the tokenization (a hash of the tokenizer.json text, or of "bytes"); a packed file records it.
  uint64_t fingerprint = 0;

  // BOS/EOS as Tokenizer::bos_id/eos_id; pad: the first added token among <pad>, <|pad|>, [PAD], else 0.
  // `tokenizer` must outlive the encoder.
  static TextEncoder from_tokenizer(const Tokenizer& tokenizer);
  static TextEncoder bytes();  // no BOS, no EOS, pad 0
};

// The text around the images. Conversation form ({"conversations": [{"from": "human"|"gpt", "value"}...]}):
//   [BOS] then per turn: human: human_prefix + value + human_suffix (masked);
//                        gpt:   assistant_prefix (masked), value + [EOS] (trained)
// Caption form ({"caption": ...}):
//   [BOS] caption_prompt (masked) <image>... caption_separator (masked) caption + [EOS] (trained)
// Each "<image>" inside a value is replaced by the image's tokens; the text between placeholders and role
// boundaries is encoded piece by piece (BPE never merges across them). Empty pieces add nothing.
struct ImageTextTemplate {
  std::string human_prefix = "USER: ";
  std::string human_suffix = "\n";
  std::string assistant_prefix = "ASSISTANT: ";
  std::string caption_prompt;            // before the image(s)
  std::string caption_separator = "\n";  // between the image(s) and the caption
  bool add_bos = true;                   // when the encoder has a BOS id
  bool add_eos = true;                   // after each trained piece, when the encoder has an EOS id
};

inline constexpr std::string_view kImagePlaceholder = "<image>";

struct ImageTextOptions {
  int64_t seq_len = 0;
  int32_t image_token_id = -1;
  int64_t tokens_per_image = 0;
  ImageTextTemplate text_template;
  // Image paths in the JSONL are relative to this folder; empty: the JSONL file's folder.
  std::filesystem::path images_root;
  // Skip (and count) lines that are malformed, name a missing or undecodable image, or whose placeholder
  // count differs from the image count; otherwise the first such line is an error.
  bool skip_bad = false;
  // Skip (and count) samples whose image tokens do not fit in seq_len; otherwise an error.
  bool skip_too_long = false;
};

// What a packed file must agree with, besides what the image processor fixes (image shape, resize/crop).
struct PackedImageTextExpectation {
  int64_t seq_len = 0;
  int32_t image_token_id = -1;
  int64_t tokens_per_image = 0;
  uint64_t text_fingerprint = 0;  // 0: not checked
  bool verify_checksum = true;    // CRC32 of the whole file at open (about 1 GB/s)
};

class ImageTextDataset {
 public:
  // Parses and tokenizes every line and decodes every image once to validate it (in parallel); images are
  // decoded again when a batch asks for them. Errors: one line "<file>:<line>: ..." (see skip_bad).
  static ImageTextDataset from_jsonl(const std::filesystem::path& jsonl, const TextEncoder& encoder,
                                     const ImageProcessor& processor, const ImageTextOptions& options);
  // A file written by write_packed_image_text. Its header must agree with `expect` and with the
  // processor's output size and resize/crop settings; a truncated or corrupt file fails with one line.
  static ImageTextDataset from_packed(const std::filesystem::path& packed, const ImageProcessor& processor,
                                      const PackedImageTextExpectation& expect);

  ImageTextDataset(ImageTextDataset&&) noexcept;
  ImageTextDataset& operator=(ImageTextDataset&&) noexcept;
  ~ImageTextDataset();

  int64_t num_samples() const;
  int64_t num_images() const;  // in all samples
  int64_t seq_len() const;
  int32_t image_token_id() const;
  int64_t tokens_per_image() const;
  std::array<int64_t, 3> image_shape() const;  // {3, H, W}
  bool packed() const;
  // Lines skipped under skip_bad / skip_too_long (from_jsonl; a packed file records the counts it was
  // written with), and the first few reasons, one line each.
  int64_t skipped_bad() const;
  int64_t skipped_too_long() const;
  const std::vector<std::string>& skip_reasons() const;

  // The images sample `index` carries, and the total over `indices` (the size of a batch's pixels).
  int64_t images_in_sample(int64_t index) const;
  int64_t count_images(std::span<const int64_t> indices) const;
  // The JSONL line a sample came from (1-based; 0 for a packed dataset).
  int64_t source_line(int64_t index) const;

  // Fills ids and targets [n, seq_len] and pixels [images, 3, H, W] (normalised float32, images in order of
  // appearance over the samples in the order given) for n = indices.size(); returns the image count.
  // `pixel_capacity` is the number of images `pixels` has room for. Samples are prepared in parallel
  // (OpenMP), each into its own slots: the bytes do not depend on the thread count. Thread-safe.
  int64_t fill_batch(std::span<const int64_t> indices, int32_t* ids, int32_t* targets, float* pixels,
                     int64_t pixel_capacity) const;

  struct Batch {
    Tensor ids;      // i32 [n, seq_len]
    Tensor targets;  // i32 [n, seq_len]
    Tensor pixels;   // f32 [images, 3, H, W]
  };
  Batch batch(std::span<const int64_t> indices) const;

  // A sample's ids and targets (seq_len each).
  std::span<const int32_t> sample_ids(int64_t index) const;
  std::span<const int32_t> sample_targets(int64_t index) const;
  const ImageProcessor& processor() const;

  // A sample's 8-bit images after resize and crop, channels first ([3, H, W] each, back to back): what the
  // packed file stores and the rescale/normalise table turns into pixels.
  std::vector<uint8_t> sample_image_bytes(int64_t index) const;

  struct Impl;

 private:
  explicit ImageTextDataset(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The 8-bit crop ImageProcessor::preprocess normalises: resize (PIL's arithmetic), then center crop with
// zeros outside, channels first [3, H, W]. preprocess(image) equals processor.value(c, crop[c, y, x]).
std::vector<uint8_t> resize_and_crop(const ImageProcessor& processor, const RgbImage& image);

// A 64-bit hash of the settings that decide the 8-bit crop (kind, resize, resample, crop).
uint64_t resize_crop_fingerprint(const ImageProcessorConfig& config);

struct PackImageTextStats {
  int64_t samples = 0, images = 0, bytes = 0;
  double seconds = 0;
};

// Whether `path` is a packed image-text file (it starts with the magic FORGEITX); anything else reads as
// JSONL.
bool is_packed_image_text(const std::filesystem::path& path);

// Writes `dataset` (usually from_jsonl) as a packed file: header, per-sample image offsets, ids, targets and
// every image's 8-bit crop; the file appears only once complete (temporary name, fsync, rename). Images are
// decoded `workers` at a time (0: OpenMP's default); the bytes do not depend on it.
PackImageTextStats write_packed_image_text(const ImageTextDataset& dataset, const std::filesystem::path& out,
                                           uint64_t text_fingerprint, int workers = 0);

}  // namespace forge::data
