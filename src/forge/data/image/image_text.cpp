// Image-text samples from JSONL (see image_text.h), and batches from either source.
#include "forge/data/image/image_text.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"
#include "forge/data/image/image_text_impl.h"
#include "forge/data/tokenizer/tokenizer.h"

namespace forge::data {

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char b : bytes) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

TextEncoder TextEncoder::from_tokenizer(const Tokenizer& tokenizer) {
  TextEncoder e;
  e.encode = [&tokenizer](std::string_view text) { return tokenizer.encode(text); };
  e.bos_id = tokenizer.bos_id();
  e.eos_id = tokenizer.eos_id();
  for (const char* name : {"<pad>", "<|pad|>", "[PAD]"}) {
    if (const auto id = tokenizer.token_to_id(name)) {
      e.pad_id = *id;
      break;
    }
  }
  e.vocab_size = tokenizer.vocab_size();
  e.fingerprint = fnv1a64(tokenizer.json_text());
  return e;
}

TextEncoder TextEncoder::bytes() {
  TextEncoder e;
  e.encode = [](std::string_view text) {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  };
  e.vocab_size = 256;
  e.fingerprint = fnv1a64("bytes");
  return e;
}

namespace {

using nlohmann::json;

// The one size every image is brought to; the batch is [images, 3, H, W].
std::array<int64_t, 2> fixed_output_size(const ImageProcessor& processor) {
  const ImageProcessorConfig& c = processor.config();
  if (c.kind == ImageProcessorConfig::Kind::clip && c.do_center_crop) return {c.crop_height, c.crop_width};
  if (c.do_resize && c.shortest_edge <= 0) return {c.resize_height, c.resize_width};
  fail(
      "image-text data needs every image at one size: the image processor must center-crop or resize to a "
      "height and width (a shortest-edge resize without a crop keeps the aspect ratio)");
}

int64_t floor_half(int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); }

// One line of the JSONL, parsed: the pieces of the sequence in order.
struct Piece {
  enum Kind { masked_text, trained_text, image, eos } kind;
  std::string text;
};

struct ParsedLine {
  std::vector<Piece> pieces;
  std::vector<std::string> images;  // relative paths, in order
};

// Splits `value` at each "<image>": text, image, text, ... Returns the number of placeholders.
int64_t append_with_placeholders(std::string_view value, Piece::Kind kind, std::vector<Piece>& pieces) {
  int64_t count = 0;
  size_t start = 0;
  while (true) {
    const size_t at = value.find(kImagePlaceholder, start);
    const std::string_view text = value.substr(start, at == std::string_view::npos ? at : at - start);
    if (!text.empty()) pieces.push_back({kind, std::string(text)});
    if (at == std::string_view::npos) break;
    pieces.push_back({Piece::image, {}});
    ++count;
    start = at + kImagePlaceholder.size();
  }
  return count;
}

const std::string& string_field(const json& object, const char* key, std::string_view where) {
  const json& v = object.at(key);
  if (!v.is_string()) fail("{}: '{}' must be a string, not {}", where, key, v.dump());
  return v.get_ref<const std::string&>();
}

ParsedLine parse_line(std::string_view text, std::string_view where, const ImageTextTemplate& t) {
  const json root = parse_json_strict(text, where);
  if (!root.is_object()) fail("{}: must be a JSON object", where);
  static const std::vector<std::string_view> keys = {"id", "image", "conversations", "caption"};
  for (const auto& [key, value] : root.items())
    if (std::find(keys.begin(), keys.end(), key) == keys.end())
      fail("{}: unknown key '{}' (image-text lines hold id, image, and conversations or caption){}", where,
           key, did_you_mean(key, keys));

  ParsedLine line;
  if (root.contains("image")) {
    const json& image = root["image"];
    if (image.is_string()) {
      line.images.push_back(image.get<std::string>());
    } else if (image.is_array() &&
               std::all_of(image.begin(), image.end(), [](const json& e) { return e.is_string(); })) {
      for (const json& e : image) line.images.push_back(e.get<std::string>());
    } else {
      fail("{}: 'image' must be a path or a list of paths, not {}", where, image.dump());
    }
    for (const std::string& path : line.images)
      if (path.empty()) fail("{}: 'image' names an empty path", where);
  }
  const bool has_conversations = root.contains("conversations"), has_caption = root.contains("caption");
  if (has_conversations == has_caption) fail("{}: needs exactly one of 'conversations' and 'caption'", where);

  int64_t placeholders = 0;
  auto& pieces = line.pieces;
  if (has_caption) {
    const std::string& caption = string_field(root, "caption", where);
    if (caption.find(kImagePlaceholder) != std::string::npos)
      fail("{}: 'caption' contains {}; the caption form places its images before the caption", where,
           kImagePlaceholder);
    if (!t.caption_prompt.empty()) pieces.push_back({Piece::masked_text, t.caption_prompt});
    for (size_t i = 0; i < line.images.size(); ++i) pieces.push_back({Piece::image, {}});
    placeholders = static_cast<int64_t>(line.images.size());
    if (!t.caption_separator.empty()) pieces.push_back({Piece::masked_text, t.caption_separator});
    if (!caption.empty()) pieces.push_back({Piece::trained_text, caption});
    pieces.push_back({Piece::eos, {}});
  } else {
    const json& turns = root["conversations"];
    if (!turns.is_array()) fail("{}: 'conversations' must be a list of turns", where);
    for (size_t k = 0; k < turns.size(); ++k) {
      const json& turn = turns[k];
      const std::string at = fmt::format("{}: conversations[{}]", where, k);
      if (!turn.is_object()) fail("{}: must be an object {{\"from\", \"value\"}}", at);
      for (const auto& [key, value] : turn.items())
        if (key != "from" && key != "value")
          fail("{}: unknown key '{}' (a turn holds from and value)", at, key);
      if (!turn.contains("from") || !turn.contains("value")) fail("{}: needs 'from' and 'value'", at);
      const std::string& from = string_field(turn, "from", at);
      const std::string& value = string_field(turn, "value", at);
      if (from == "human") {
        if (!t.human_prefix.empty()) pieces.push_back({Piece::masked_text, t.human_prefix});
        placeholders += append_with_placeholders(value, Piece::masked_text, pieces);
        if (!t.human_suffix.empty()) pieces.push_back({Piece::masked_text, t.human_suffix});
      } else if (from == "gpt") {
        if (value.find(kImagePlaceholder) != std::string::npos)
          fail("{}: an assistant turn contains {} (images belong to human turns)", at, kImagePlaceholder);
        if (!t.assistant_prefix.empty()) pieces.push_back({Piece::masked_text, t.assistant_prefix});
        if (!value.empty()) pieces.push_back({Piece::trained_text, value});
        pieces.push_back({Piece::eos, {}});
      } else {
        fail("{}: 'from' must be \"human\" or \"gpt\", not \"{}\"", at, from);
      }
    }
  }
  if (placeholders != static_cast<int64_t>(line.images.size()))
    fail("{}: {} {} placeholder{} but {} image{}", where, placeholders, kImagePlaceholder,
         placeholders == 1 ? "" : "s", line.images.size(), line.images.size() == 1 ? "" : "s");
  return line;
}

// A line's outcome: a sample, or why there is none.
struct LineResult {
  int64_t line = 0;
  enum Status { ok, bad, too_long } status = ok;
  std::string reason;
  std::vector<int32_t> ids, targets;  // seq_len each
  std::vector<std::filesystem::path> images;
};

void build_sample(const ParsedLine& parsed, std::string_view where, const TextEncoder& encoder,
                  const ImageTextOptions& o, LineResult& out) {
  std::vector<int32_t> tokens;
  std::vector<char> trained;
  int64_t images_end = 0;  // one past the last image token
  auto push = [&](int32_t id, bool train) {
    tokens.push_back(id);
    trained.push_back(train ? 1 : 0);
  };
  if (o.text_template.add_bos && encoder.bos_id) push(*encoder.bos_id, false);
  for (const Piece& piece : parsed.pieces) {
    switch (piece.kind) {
      case Piece::masked_text:
      case Piece::trained_text:
        for (int32_t id : encoder.encode(piece.text)) {
          if (id == o.image_token_id)
            fail("{}: the text encodes to the image token id {} (\"{}\"), which would read as an image",
                 where, id, piece.text);
          push(id, piece.kind == Piece::trained_text);
        }
        break;
      case Piece::image:
        for (int64_t k = 0; k < o.tokens_per_image; ++k) push(o.image_token_id, false);
        images_end = static_cast<int64_t>(tokens.size());
        break;
      case Piece::eos:
        if (o.text_template.add_eos && encoder.eos_id) push(*encoder.eos_id, true);
        break;
    }
  }
  if (images_end > o.seq_len) {
    out.status = LineResult::too_long;
    out.reason = fmt::format(
        "{}: the image tokens end at position {}, past seq_len {} ({} image{} x {} tokens); text after the "
        "last image is all that may be cut",
        where, images_end, o.seq_len, parsed.images.size(), parsed.images.size() == 1 ? "" : "s",
        o.tokens_per_image);
    return;
  }
  const auto length = static_cast<int64_t>(tokens.size());
  out.ids.assign(static_cast<size_t>(o.seq_len), encoder.pad_id);
  out.targets.assign(static_cast<size_t>(o.seq_len), -1);
  for (int64_t i = 0; i < std::min(length, o.seq_len); ++i) out.ids[static_cast<size_t>(i)] = tokens[i];
  // Target i is token i + 1 when that one is trained; a truncated sample's last target is the first cut one.
  for (int64_t i = 0; i < o.seq_len && i + 1 < length; ++i)
    if (trained[static_cast<size_t>(i + 1)]) out.targets[static_cast<size_t>(i)] = tokens[i + 1];
}

void check_options(const ImageTextOptions& o, const TextEncoder& encoder) {
  if (o.seq_len < 1) fail("image-text data: seq_len must be positive, not {}", o.seq_len);
  if (o.tokens_per_image < 1)
    fail("image-text data: tokens_per_image must be positive, not {}", o.tokens_per_image);
  if (o.image_token_id < 0)
    fail("image-text data: image_token_id must be set (>= 0), not {}", o.image_token_id);
  if (!encoder.encode) fail("image-text data: the text encoder has no encode function");
}

}  // namespace

std::vector<uint8_t> resize_and_crop(const ImageProcessor& processor, const RgbImage& image) {
  // ImageProcessor::preprocess's steps up to the table lookup, kept in step with it by a bitwise test.
  const ImageProcessorConfig& c = processor.config();
  if (image.height < 1 || image.width < 1) fail("image processor: empty image");
  const auto [rh, rw] = processor.resized_size(image.height, image.width);
  if (rh * rw > kMaxImagePixels)
    fail("image processor: a {}x{} image would be resized to {}x{}, over {} pixels", image.width,
         image.height, rw, rh, kMaxImagePixels);
  const RgbImage resized = c.do_resize ? resize_like_pil(image, rh, rw, c.resample) : RgbImage{};
  const RgbImage& source = c.do_resize ? resized : image;
  const auto [oh, ow] = processor.output_size(image.height, image.width);
  const bool crop = c.kind == ImageProcessorConfig::Kind::clip && c.do_center_crop;
  const int64_t top = crop ? floor_half(source.height - oh) : 0;
  const int64_t left = crop ? floor_half(source.width - ow) : 0;
  std::vector<uint8_t> out(static_cast<size_t>(3 * oh * ow));
  for (int ch = 0; ch < 3; ++ch) {
    uint8_t* plane = out.data() + static_cast<size_t>(ch) * oh * ow;
    for (int64_t y = 0; y < oh; ++y) {
      const int64_t sy = y + top;
      for (int64_t x = 0; x < ow; ++x) {
        const int64_t sx = x + left;
        const bool inside = sy >= 0 && sy < source.height && sx >= 0 && sx < source.width;
        plane[y * ow + x] = inside ? source.at(sy, sx, ch) : 0;
      }
    }
  }
  return out;
}

uint64_t resize_crop_fingerprint(const ImageProcessorConfig& c) {
  const bool crop = c.kind == ImageProcessorConfig::Kind::clip && c.do_center_crop;
  return fnv1a64(fmt::format("resize {} {} {}x{} resample {} crop {} {}x{}", c.do_resize, c.shortest_edge,
                             c.resize_height, c.resize_width, static_cast<int>(c.resample), crop,
                             crop ? c.crop_height : 0, crop ? c.crop_width : 0));
}

std::vector<uint8_t> decode_sample_crops(const ImageTextDataset::Impl& impl, int64_t index) {
  const int64_t first = impl.image_offsets[index], last = impl.image_offsets[index + 1];
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>((last - first) * impl.image_bytes()));
  for (int64_t k = first; k < last; ++k) {
    const std::vector<uint8_t> crop =
        resize_and_crop(impl.processor, read_image(impl.image_paths[static_cast<size_t>(k)]));
    out.insert(out.end(), crop.begin(), crop.end());
  }
  return out;
}

ImageTextDataset ImageTextDataset::from_jsonl(const std::filesystem::path& jsonl, const TextEncoder& encoder,
                                              const ImageProcessor& processor, const ImageTextOptions& o) {
  check_options(o, encoder);
  const auto [height, width] = fixed_output_size(processor);
  const std::string text = read_file(jsonl, "image-text JSONL");
  const std::filesystem::path root = o.images_root.empty() ? jsonl.parent_path() : o.images_root;

  // Non-blank lines, with their 1-based numbers.
  std::vector<std::pair<int64_t, std::string_view>> lines;
  {
    size_t start = 0;
    int64_t number = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      if (end == std::string::npos) end = text.size();
      ++number;
      std::string_view line(text.data() + start, end - start);
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.find_first_not_of(" \t") != std::string_view::npos) lines.emplace_back(number, line);
      start = end + 1;
    }
  }

  // Lines are independent: parse, tokenize and decode their images in parallel; errors are kept per line so
  // the one reported (the first by line number) does not depend on the thread count.
  std::vector<LineResult> results(lines.size());
  const auto count = static_cast<int64_t>(lines.size());
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t i = 0; i < count; ++i) {
    LineResult& r = results[static_cast<size_t>(i)];
    r.line = lines[static_cast<size_t>(i)].first;
    const std::string where = fmt::format("{}:{}", jsonl.string(), r.line);
    try {
      const ParsedLine parsed = parse_line(lines[static_cast<size_t>(i)].second, where, o.text_template);
      build_sample(parsed, where, encoder, o, r);
      if (r.status != LineResult::ok) continue;
      for (const std::string& relative : parsed.images) {
        const std::filesystem::path path = root / relative;
        try {
          const RgbImage image = read_image(path);
          const auto [rh, rw] = processor.resized_size(image.height, image.width);
          if (rh * rw > kMaxImagePixels)
            fail("{}: a {}x{} image would be resized to {}x{}, over {} pixels", path.string(), image.width,
                 image.height, rw, rh, kMaxImagePixels);
        } catch (const Error& e) {
          fail("{}: image '{}': {}", where, relative, e.what());
        }
        r.images.push_back(path);
      }
    } catch (const std::exception& e) {
      r.status = LineResult::bad;
      r.reason = e.what();
      r.ids.clear();
      r.targets.clear();
      r.images.clear();
    }
  }

  auto impl = std::make_unique<Impl>(processor);
  impl->seq_len = o.seq_len;
  impl->tokens_per_image = o.tokens_per_image;
  impl->image_token_id = o.image_token_id;
  impl->height = height;
  impl->width = width;
  impl->offsets_storage.push_back(0);
  for (LineResult& r : results) {
    if (r.status != LineResult::ok) {
      const bool skip = r.status == LineResult::bad ? o.skip_bad : o.skip_too_long;
      if (!skip) throw Error(r.reason);
      ++(r.status == LineResult::bad ? impl->skipped_bad : impl->skipped_too_long);
      if (impl->skip_reasons.size() < 10) impl->skip_reasons.push_back(r.reason);
      continue;
    }
    impl->ids_storage.insert(impl->ids_storage.end(), r.ids.begin(), r.ids.end());
    impl->targets_storage.insert(impl->targets_storage.end(), r.targets.begin(), r.targets.end());
    for (auto& path : r.images) impl->image_paths.push_back(std::move(path));
    impl->offsets_storage.push_back(static_cast<int64_t>(impl->image_paths.size()));
    impl->lines.push_back(r.line);
    r = LineResult{};  // free as we go
  }
  impl->samples = static_cast<int64_t>(impl->lines.size());
  impl->images = static_cast<int64_t>(impl->image_paths.size());
  if (impl->samples == 0) {
    const int64_t skipped = impl->skipped_bad + impl->skipped_too_long;
    if (skipped == 0) fail("{}: holds no samples", jsonl.string());
    fail("{}: holds no usable samples ({} skipped; the first: {})", jsonl.string(), skipped,
         impl->skip_reasons.front());
  }
  impl->image_offsets = impl->offsets_storage.data();
  impl->ids = impl->ids_storage.data();
  impl->targets = impl->targets_storage.data();
  return ImageTextDataset(std::move(impl));
}

ImageTextDataset::ImageTextDataset(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ImageTextDataset::ImageTextDataset(ImageTextDataset&&) noexcept = default;
ImageTextDataset& ImageTextDataset::operator=(ImageTextDataset&&) noexcept = default;
ImageTextDataset::~ImageTextDataset() = default;

int64_t ImageTextDataset::num_samples() const { return impl_->samples; }
int64_t ImageTextDataset::num_images() const { return impl_->images; }
int64_t ImageTextDataset::seq_len() const { return impl_->seq_len; }
int32_t ImageTextDataset::image_token_id() const { return impl_->image_token_id; }
int64_t ImageTextDataset::tokens_per_image() const { return impl_->tokens_per_image; }
std::array<int64_t, 3> ImageTextDataset::image_shape() const { return {3, impl_->height, impl_->width}; }
bool ImageTextDataset::packed() const { return impl_->mapping != nullptr; }
int64_t ImageTextDataset::skipped_bad() const { return impl_->skipped_bad; }
int64_t ImageTextDataset::skipped_too_long() const { return impl_->skipped_too_long; }
const std::vector<std::string>& ImageTextDataset::skip_reasons() const { return impl_->skip_reasons; }

namespace {
void check_index(int64_t index, int64_t samples) {
  if (index < 0 || index >= samples)
    fail("image-text data: sample index {} is out of range [0, {})", index, samples);
}
}  // namespace

int64_t ImageTextDataset::images_in_sample(int64_t index) const {
  check_index(index, impl_->samples);
  return impl_->image_offsets[index + 1] - impl_->image_offsets[index];
}

int64_t ImageTextDataset::count_images(std::span<const int64_t> indices) const {
  int64_t total = 0;
  for (int64_t index : indices) total += images_in_sample(index);
  return total;
}

int64_t ImageTextDataset::source_line(int64_t index) const {
  check_index(index, impl_->samples);
  return impl_->lines.empty() ? 0 : impl_->lines[static_cast<size_t>(index)];
}

std::span<const int32_t> ImageTextDataset::sample_ids(int64_t index) const {
  check_index(index, impl_->samples);
  return {impl_->ids + index * impl_->seq_len, static_cast<size_t>(impl_->seq_len)};
}

std::span<const int32_t> ImageTextDataset::sample_targets(int64_t index) const {
  check_index(index, impl_->samples);
  return {impl_->targets + index * impl_->seq_len, static_cast<size_t>(impl_->seq_len)};
}

const ImageProcessor& ImageTextDataset::processor() const { return impl_->processor; }

std::vector<uint8_t> ImageTextDataset::sample_image_bytes(int64_t index) const {
  check_index(index, impl_->samples);
  if (impl_->pixels == nullptr) return decode_sample_crops(*impl_, index);
  const int64_t first = impl_->image_offsets[index], last = impl_->image_offsets[index + 1];
  const uint8_t* begin = impl_->pixels + first * impl_->image_bytes();
  return {begin, begin + (last - first) * impl_->image_bytes()};
}

int64_t ImageTextDataset::fill_batch(std::span<const int64_t> indices, int32_t* ids, int32_t* targets,
                                     float* pixels, int64_t pixel_capacity) const {
  const Impl& m = *impl_;
  const auto n = static_cast<int64_t>(indices.size());
  std::vector<int64_t> first_image(static_cast<size_t>(n) + 1, 0);
  for (int64_t b = 0; b < n; ++b)
    first_image[static_cast<size_t>(b) + 1] =
        first_image[static_cast<size_t>(b)] + images_in_sample(indices[b]);
  if (n > 0 && (ids == nullptr || targets == nullptr))
    fail("image-text data: fill_batch needs ids and targets buffers of {} x {}", n, m.seq_len);
  const int64_t total = first_image.back();
  if (total > pixel_capacity)
    fail("image-text data: the batch holds {} images but the pixel buffer has room for {}", total,
         pixel_capacity);
  if (total > 0 && pixels == nullptr)
    fail("image-text data: the batch holds {} images but no pixel buffer", total);

  const int64_t plane = m.height * m.width;
  std::vector<std::string> errors(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t b = 0; b < n; ++b) {
    const int64_t index = indices[b];
    std::memcpy(ids + b * m.seq_len, m.ids + index * m.seq_len, sizeof(int32_t) * m.seq_len);
    std::memcpy(targets + b * m.seq_len, m.targets + index * m.seq_len, sizeof(int32_t) * m.seq_len);
    const int64_t first = m.image_offsets[index], last = m.image_offsets[index + 1];
    float* out = pixels + first_image[static_cast<size_t>(b)] * 3 * plane;
    try {
      for (int64_t k = first; k < last; ++k, out += 3 * plane) {
        if (m.pixels != nullptr) {
          const uint8_t* crop = m.pixels + k * m.image_bytes();
          for (int c = 0; c < 3; ++c)
            for (int64_t i = 0; i < plane; ++i)
              out[c * plane + i] = m.processor.value(c, crop[c * plane + i]);
        } else {
          const Tensor values = m.processor.preprocess(read_image(m.image_paths[static_cast<size_t>(k)]));
          std::memcpy(out, values.f32(), sizeof(float) * 3 * plane);
        }
      }
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(b)] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw Error(e);
  return total;
}

ImageTextDataset::Batch ImageTextDataset::batch(std::span<const int64_t> indices) const {
  const auto n = static_cast<int64_t>(indices.size());
  const int64_t images = count_images(indices);
  Batch b{Tensor::empty({n, impl_->seq_len}, DType::i32), Tensor::empty({n, impl_->seq_len}, DType::i32),
          Tensor::empty({images, 3, impl_->height, impl_->width}, DType::f32)};
  fill_batch(indices, b.ids.i32(), b.targets.i32(), images > 0 ? b.pixels.f32() : nullptr, images);
  return b;
}

}  // namespace forge::data
