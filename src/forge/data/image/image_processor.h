// Image preprocessing as Hugging Face's CLIPImageProcessor and SiglipImageProcessor compute it, configured
// from their preprocessor_config.json: resize (through PIL's arithmetic, image_resize.h), center crop (CLIP),
// rescale, normalize, channels first. Output: float32 [3, H, W], equal to transformers' `pixel_values`.
//
// The arithmetic, step by step (transformers' image_transforms.py):
//   - resize, size {"shortest_edge": s}: the short side becomes s, the long one int(s * long / short)
//     (truncated); size {"height", "width"}: exactly that. PIL's resampling on the 8-bit image.
//   - center crop to (ch, cw) on the 8-bit image: top = floor((H - ch) / 2), left likewise; where the image
//     is smaller than the crop, the missing pixels are zeros (then normalised like any other 0).
//   - rescale: float32(float64(pixel) * rescale_factor).
//   - normalize, in float32: (x - float32(mean[c])) / float32(std[c]).
// The input is always RGB (forge's decoder converts as PIL's convert("RGB") does), so do_convert_rgb has
// no effect.
#pragma once

#include <array>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "forge/core/tensor.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_resize.h"

namespace forge::data {

struct ImageProcessorConfig {
  enum class Kind { clip, siglip };
  Kind kind = Kind::clip;
  bool do_convert_rgb = true;
  bool do_resize = true;
  // Exactly one of: shortest_edge > 0, or resize_height and resize_width > 0.
  int64_t shortest_edge = 224;
  int64_t resize_height = 0, resize_width = 0;
  Resample resample = Resample::bicubic;
  bool do_center_crop = true;  // CLIP only
  int64_t crop_height = 224, crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};

  // Hugging Face's defaults for each class (what an absent key means).
  static ImageProcessorConfig clip_defaults();
  static ImageProcessorConfig siglip_defaults();

  // Strict: a key neither processor reads, other than the informational ones listed in
  // informational_keys(), is an error naming `where` and the key; so are wrong types, a std of 0, and a
  // resample forge does not implement. image_processor_type (or, in old CLIP files, feature_extractor_type
  // "CLIPFeatureExtractor") chooses the class.
  static ImageProcessorConfig from_json(const nlohmann::json& json, std::string_view where);
  static ImageProcessorConfig from_json_file(const std::filesystem::path& path);

  // Keys Hugging Face writes that do not change the arithmetic: processor_class, _processor_class,
  // feature_extractor_type, image_processor_type, _valid_processor_keys, image_seq_length.
  static const std::vector<std::string_view>& informational_keys();
};

class ImageProcessor {
 public:
  explicit ImageProcessor(const ImageProcessorConfig& config);

  const ImageProcessorConfig& config() const { return config_; }

  // (height, width) after the resize step, as transformers' get_resize_output_image_size computes it.
  std::array<int64_t, 2> resized_size(int64_t height, int64_t width) const;
  // (height, width) of pixel_values for an image of that size.
  std::array<int64_t, 2> output_size(int64_t height, int64_t width) const;

  // float32 [3, H, W].
  Tensor preprocess(const RgbImage& image) const;

  // The value channel c of pixel_values takes for an 8-bit value v after resize and crop (the rescale and
  // normalize steps are per value, so a table of 3 x 256 holds them exactly).
  float value(int c, uint8_t v) const { return table_[static_cast<size_t>(c) * 256 + v]; }

 private:
  ImageProcessorConfig config_;
  std::array<float, 3 * 256> table_{};
};

}  // namespace forge::data
