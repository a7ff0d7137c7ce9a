// CLIP / SigLIP preprocessing (see image_processor.h) and the strict reader of preprocessor_config.json.
#include "forge/data/image/image_processor.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"

namespace forge::data {
namespace {

using nlohmann::json;

// The keys each class reads (its constructor's arguments).
const std::vector<std::string_view> kClipKeys = {
    "do_convert_rgb", "do_resize",      "size",         "resample",   "do_center_crop", "crop_size",
    "do_rescale",     "rescale_factor", "do_normalize", "image_mean", "image_std"};
const std::vector<std::string_view> kSiglipKeys = {"do_convert_rgb", "do_resize",  "size",
                                                   "resample",       "do_rescale", "rescale_factor",
                                                   "do_normalize",   "image_mean", "image_std"};

class Reader {
 public:
  Reader(const json& root, std::string_view where) : root_(root), where_(where) {}

  [[noreturn]] void error(std::string_view key, std::string_view message) const {
    fail("{}: '{}' {}", where_, key, message);
  }

  const json* find(const char* key) const {
    const auto it = root_.find(key);
    return it == root_.end() ? nullptr : &*it;
  }

  void boolean(const char* key, bool& into, bool null_allowed = false) const {
    const json* v = find(key);
    if (v == nullptr || (null_allowed && v->is_null())) return;
    if (!v->is_boolean()) error(key, fmt::format("must be true or false, not {}", v->dump()));
    into = v->get<bool>();
  }

  int64_t side(const json& v, std::string_view key) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxImageSide)
      error(key, fmt::format("must be an integer in [1, {}], not {}", kMaxImageSide, v.dump()));
    return v.get<int64_t>();
  }

  // A number, or a list of 3 numbers (one per channel), each finite.
  void per_channel(const char* key, std::array<double, 3>& into, bool positive) const {
    const json* v = find(key);
    if (v == nullptr) return;
    std::array<double, 3> values{};
    if (v->is_number()) {
      values.fill(v->get<double>());
    } else if (v->is_array() && v->size() == 3 &&
               std::all_of(v->begin(), v->end(), [](const json& e) { return e.is_number(); })) {
      for (int c = 0; c < 3; ++c) values[static_cast<size_t>(c)] = (*v)[static_cast<size_t>(c)].get<double>();
    } else {
      error(key,
            fmt::format("must be a number or a list of 3 numbers (one per RGB channel), not {}", v->dump()));
    }
    for (double x : values) {
      if (!std::isfinite(x) || (positive && !(x > 0)))
        error(key, fmt::format("must hold {} numbers, not {}", positive ? "positive finite" : "finite",
                               v->dump()));
    }
    into = values;
  }

 private:
  const json& root_;
  std::string where_;
};

ImageProcessorConfig::Kind processor_kind(const Reader& r, std::string_view where) {
  const json* type = r.find("image_processor_type");
  if (type == nullptr) {
    const json* legacy = r.find("feature_extractor_type");
    if (legacy != nullptr && *legacy == "CLIPFeatureExtractor") return ImageProcessorConfig::Kind::clip;
    fail(
        "{}: names no image_processor_type (forge reads CLIPImageProcessor and SiglipImageProcessor configs)",
        where);
  }
  if (!type->is_string())
    r.error("image_processor_type", fmt::format("must be a string, not {}", type->dump()));
  const std::string name = type->get<std::string>();
  if (name == "CLIPImageProcessor") return ImageProcessorConfig::Kind::clip;
  if (name == "SiglipImageProcessor") return ImageProcessorConfig::Kind::siglip;
  if (name == "CLIPImageProcessorFast" || name == "SiglipImageProcessorFast")
    r.error(
        "image_processor_type",
        fmt::format("'{}' is not supported: the fast processors resize with torchvision, whose arithmetic "
                    "differs from PIL's; forge matches the PIL-based {}",
                    name, name.substr(0, name.size() - 4)));
  r.error(
      "image_processor_type",
      fmt::format("'{}' is not supported (forge reads CLIPImageProcessor and SiglipImageProcessor)", name));
}

}  // namespace

const std::vector<std::string_view>& ImageProcessorConfig::informational_keys() {
  static const std::vector<std::string_view> keys = {"processor_class",        "_processor_class",
                                                     "feature_extractor_type", "image_processor_type",
                                                     "_valid_processor_keys",  "image_seq_length"};
  return keys;
}

ImageProcessorConfig ImageProcessorConfig::clip_defaults() { return ImageProcessorConfig{}; }

ImageProcessorConfig ImageProcessorConfig::siglip_defaults() {
  ImageProcessorConfig c;
  c.kind = Kind::siglip;
  c.shortest_edge = 0;
  c.resize_height = c.resize_width = 224;
  c.do_center_crop = false;
  c.image_mean = {0.5, 0.5, 0.5};
  c.image_std = {0.5, 0.5, 0.5};
  return c;
}

ImageProcessorConfig ImageProcessorConfig::from_json(const json& root, std::string_view where) {
  if (!root.is_object()) fail("{}: must be a JSON object", where);
  const Reader r(root, where);
  const Kind kind = processor_kind(r, where);
  ImageProcessorConfig c = kind == Kind::clip ? clip_defaults() : siglip_defaults();
  const auto& known = kind == Kind::clip ? kClipKeys : kSiglipKeys;
  const char* class_name = kind == Kind::clip ? "CLIPImageProcessor" : "SiglipImageProcessor";

  std::vector<std::string_view> candidates = known;
  candidates.insert(candidates.end(), informational_keys().begin(), informational_keys().end());
  for (const auto& [key, value] : root.items()) {
    if (std::find(candidates.begin(), candidates.end(), key) == candidates.end())
      fail("{}: unknown key '{}' for {}{}", where, key, class_name, did_you_mean(key, candidates));
  }

  r.boolean("do_convert_rgb", c.do_convert_rgb, /*null_allowed=*/true);
  r.boolean("do_resize", c.do_resize);
  r.boolean("do_rescale", c.do_rescale);
  r.boolean("do_normalize", c.do_normalize);

  if (const json* size = r.find("size")) {
    // An integer is Hugging Face's legacy form: get_size_dict(size, default_to_square=False) makes it a
    // shortest edge.
    if (size->is_number_integer()) {
      c.shortest_edge = r.side(*size, "size");
      c.resize_height = c.resize_width = 0;
    } else if (size->is_object() && size->size() == 1 && size->contains("shortest_edge")) {
      c.shortest_edge = r.side((*size)["shortest_edge"], "size.shortest_edge");
      c.resize_height = c.resize_width = 0;
    } else if (size->is_object() && size->size() == 2 && size->contains("height") &&
               size->contains("width")) {
      c.resize_height = r.side((*size)["height"], "size.height");
      c.resize_width = r.side((*size)["width"], "size.width");
      c.shortest_edge = 0;
    } else {
      r.error("size",
              fmt::format("must be {{\"shortest_edge\": n}} or {{\"height\": h, \"width\": w}}, not {}",
                          size->dump()));
    }
    if (kind == Kind::siglip && c.shortest_edge > 0)
      r.error("size", "must be {\"height\": h, \"width\": w} for SiglipImageProcessor (it reads both)");
  }

  if (const json* resample = r.find("resample")) {
    if (!resample->is_number_integer() || resample->get<int64_t>() < 0 || resample->get<int64_t>() > 5)
      r.error("resample", fmt::format("must be a PIL resampling code 0..5, not {}", resample->dump()));
    c.resample = static_cast<Resample>(resample->get<int>());
    if (!resample_supported(c.resample))
      r.error("resample",
              fmt::format("{} ({}) is not implemented; forge implements 0 (nearest), 2 (bilinear) "
                          "and 3 (bicubic)",
                          resample->get<int>(), resample_name(c.resample)));
  }

  if (kind == Kind::clip) {
    r.boolean("do_center_crop", c.do_center_crop);
    if (const json* crop = r.find("crop_size")) {
      // An integer means a square (get_size_dict(crop_size, default_to_square=True)).
      if (crop->is_number_integer()) {
        c.crop_height = c.crop_width = r.side(*crop, "crop_size");
      } else if (crop->is_object() && crop->size() == 2 && crop->contains("height") &&
                 crop->contains("width")) {
        c.crop_height = r.side((*crop)["height"], "crop_size.height");
        c.crop_width = r.side((*crop)["width"], "crop_size.width");
      } else {
        r.error("crop_size",
                fmt::format("must be an integer or {{\"height\": h, \"width\": w}}, not {}", crop->dump()));
      }
    }
  }

  if (const json* factor = r.find("rescale_factor")) {
    if (!factor->is_number() || !std::isfinite(factor->get<double>()) || !(factor->get<double>() > 0))
      r.error("rescale_factor", fmt::format("must be a positive number, not {}", factor->dump()));
    c.rescale_factor = factor->get<double>();
  }
  r.per_channel("image_mean", c.image_mean, /*positive=*/false);
  r.per_channel("image_std", c.image_std, /*positive=*/true);
  // A std that is positive as a double but 0 as the float32 normalize uses would divide by zero.
  for (double s : c.image_std)
    if (static_cast<float>(s) == 0.0f) r.error("image_std", "rounds to 0 in float32");
  return c;
}

ImageProcessorConfig ImageProcessorConfig::from_json_file(const std::filesystem::path& path) {
  const std::string text = read_file(path, "preprocessor config");
  return from_json(parse_json_strict(text, path.string()), path.string());
}

ImageProcessor::ImageProcessor(const ImageProcessorConfig& config) : config_(config) {
  if (config_.do_resize && config_.shortest_edge <= 0 &&
      (config_.resize_height <= 0 || config_.resize_width <= 0))
    fail("image processor: do_resize needs a shortest edge or a height and width");
  if (config_.do_center_crop && (config_.crop_height <= 0 || config_.crop_width <= 0))
    fail("image processor: do_center_crop needs a positive crop size");
  if (config_.do_resize && !resample_supported(config_.resample))
    fail("image processor: resample {} is not implemented", static_cast<int>(config_.resample));
  for (int c = 0; c < 3; ++c) {
    const float mean = static_cast<float>(config_.image_mean[static_cast<size_t>(c)]);
    const float std = static_cast<float>(config_.image_std[static_cast<size_t>(c)]);
    if (config_.do_normalize && std == 0.0f) fail("image processor: image_std[{}] is 0", c);
    for (int v = 0; v < 256; ++v) {
      // rescale: computed in float64 and stored as float32; normalize casts an unscaled image to float32.
      float x = config_.do_rescale ? static_cast<float>(static_cast<double>(v) * config_.rescale_factor)
                                   : static_cast<float>(v);
      if (config_.do_normalize) x = (x - mean) / std;
      table_[static_cast<size_t>(c * 256 + v)] = x;
    }
  }
}

std::array<int64_t, 2> ImageProcessor::resized_size(int64_t height, int64_t width) const {
  if (!config_.do_resize) return {height, width};
  if (config_.shortest_edge <= 0) return {config_.resize_height, config_.resize_width};
  const int64_t s = config_.shortest_edge;
  const int64_t short_side = std::min(height, width), long_side = std::max(height, width);
  // Python: int(s * long / short), a true (correctly rounded) division then truncation; both operands are
  // exact in double here.
  const auto new_long =
      static_cast<int64_t>(static_cast<double>(s * long_side) / static_cast<double>(short_side));
  return width <= height ? std::array<int64_t, 2>{new_long, s} : std::array<int64_t, 2>{s, new_long};
}

std::array<int64_t, 2> ImageProcessor::output_size(int64_t height, int64_t width) const {
  if (config_.kind == ImageProcessorConfig::Kind::clip && config_.do_center_crop)
    return {config_.crop_height, config_.crop_width};
  return resized_size(height, width);
}

namespace {
// Python's floor division.
int64_t floor_div2(int64_t v) { return v >= 0 ? v / 2 : -((-v + 1) / 2); }
}  // namespace

Tensor ImageProcessor::preprocess(const RgbImage& image) const {
  if (image.height < 1 || image.width < 1) fail("image processor: empty image");
  const auto [rh, rw] = resized_size(image.height, image.width);
  if (rh * rw > kMaxImagePixels)
    fail("image processor: a {}x{} image would be resized to {}x{}, over {} pixels", image.width,
         image.height, rw, rh, kMaxImagePixels);
  const RgbImage resized = config_.do_resize ? resize_like_pil(image, rh, rw, config_.resample) : RgbImage{};
  const RgbImage& source = config_.do_resize ? resized : image;

  const auto [oh, ow] = output_size(image.height, image.width);
  // Center crop offsets; equal to 0 without a crop. Source pixels outside the image read as 0 (HF pads).
  const bool crop = config_.kind == ImageProcessorConfig::Kind::clip && config_.do_center_crop;
  const int64_t top = crop ? floor_div2(source.height - oh) : 0;
  const int64_t left = crop ? floor_div2(source.width - ow) : 0;

  Tensor out = Tensor::empty({3, oh, ow}, DType::f32);
  float* data = out.f32();
  for (int c = 0; c < 3; ++c) {
    const float* table = table_.data() + c * 256;
    float* plane = data + static_cast<size_t>(c) * oh * ow;
    for (int64_t y = 0; y < oh; ++y) {
      const int64_t sy = y + top;
      for (int64_t x = 0; x < ow; ++x) {
        const int64_t sx = x + left;
        const bool inside = sy >= 0 && sy < source.height && sx >= 0 && sx < source.width;
        plane[y * ow + x] = table[inside ? source.at(sy, sx, c) : 0];
      }
    }
  }
  return out;
}

}  // namespace forge::data
