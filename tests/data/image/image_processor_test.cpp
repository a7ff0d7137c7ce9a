// CLIP / SigLIP preprocessing (data/image_processor.h) against tests/reference/image_twin.py's pixel
// values for every fixture image and config, and the strict preprocessor_config.json reader.
#include "forge/data/image/image_processor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "data/image_test_util.h"
#include "forge/core/error.h"

namespace forge::data::image_processor_test {
namespace {

using image_test::fixture_dir;
using image_test::manifest;
using image_test::read_dz;
using nlohmann::json;

TEST(ImageProcessor, PixelValuesMatchTheTwinForEveryFixtureAndConfig) {
  double max_abs_diff = 0;
  int cases = 0;
  for (const auto& entry : manifest()["cases"]) {
    const std::string image_name = entry["image"], config_name = entry["config"];
    const auto& config_entry = manifest()["configs"][config_name];
    const ImageProcessor processor(
        ImageProcessorConfig::from_json_file(fixture_dir() / config_entry["file"].get<std::string>()));
    const Tensor out = processor.preprocess(read_image(fixture_dir() / image_name));
    const int64_t h = entry["height"], w = entry["width"];
    ASSERT_EQ(out.shape(), (Shape{3, h, w})) << image_name << " " << config_name;
    const auto& size = processor.output_size(read_image(fixture_dir() / image_name).height,
                                             read_image(fixture_dir() / image_name).width);
    EXPECT_EQ(size[0], h);
    EXPECT_EQ(size[1], w);
    // The twin's float32 pixel_values, rebuilt exactly from its uint8 stage and its per-value table.
    const std::vector<uint8_t> u8 = read_dz(entry["uint8"], h, w);
    const float* got = out.f32();
    double case_max = 0;
    for (int c = 0; c < 3; ++c) {
      const auto& table = config_entry["table"][static_cast<size_t>(c)];
      for (int64_t i = 0; i < h * w; ++i) {
        const float expected = table[u8[static_cast<size_t>(i * 3 + c)]].get<float>();
        case_max = std::max(case_max, static_cast<double>(std::fabs(got[c * h * w + i] - expected)));
      }
    }
    EXPECT_LE(case_max, 1e-6) << image_name << " " << config_name;
    max_abs_diff = std::max(max_abs_diff, case_max);
    ++cases;
  }
  EXPECT_GE(cases, 98);
  std::printf("%d cases, max |forge - twin| = %g\n", cases, max_abs_diff);
}

TEST(ImageProcessor, PerValueTablesAreBitwiseTheTwins) {
  for (const auto& [name, entry] : manifest()["configs"].items()) {
    const ImageProcessor processor(
        ImageProcessorConfig::from_json_file(fixture_dir() / entry["file"].get<std::string>()));
    for (int c = 0; c < 3; ++c) {
      for (int v = 0; v < 256; ++v) {
        const float expected = entry["table"][static_cast<size_t>(c)][static_cast<size_t>(v)].get<float>();
        const float got = processor.value(c, static_cast<uint8_t>(v));
        EXPECT_EQ(std::memcmp(&expected, &got, sizeof got), 0) << name << " c=" << c << " v=" << v;
      }
    }
  }
}

TEST(ImageProcessor, ResizedSizeFollowsTransformers) {
  ImageProcessorConfig config = ImageProcessorConfig::clip_defaults();
  const ImageProcessor clip(config);
  // Short side to 224, long side int(224 * long / short), truncated.
  EXPECT_EQ(clip.resized_size(181, 300), (std::array<int64_t, 2>{224, 371}));  // 371.27
  EXPECT_EQ(clip.resized_size(300, 181), (std::array<int64_t, 2>{371, 224}));
  EXPECT_EQ(clip.resized_size(23, 37), (std::array<int64_t, 2>{224, 360}));  // 360.35
  EXPECT_EQ(clip.resized_size(100, 100), (std::array<int64_t, 2>{224, 224}));
  EXPECT_EQ(clip.resized_size(3, 1000), (std::array<int64_t, 2>{224, 74666}));
  EXPECT_EQ(clip.output_size(3, 1000), (std::array<int64_t, 2>{224, 224}));
  const ImageProcessor siglip(ImageProcessorConfig::siglip_defaults());
  EXPECT_EQ(siglip.resized_size(23, 37), (std::array<int64_t, 2>{224, 224}));
  EXPECT_EQ(siglip.output_size(23, 37), (std::array<int64_t, 2>{224, 224}));
}

TEST(ImageProcessor, ResizesBeyondThePixelLimitAreRefused) {
  const ImageProcessor clip(ImageProcessorConfig::clip_defaults());
  RgbImage thin{1, 16384, std::vector<uint8_t>(16384 * 3, 9)};  // 224 x 3670016 after the resize
  EXPECT_THROW(clip.preprocess(thin), Error);
}

std::string refusal(const std::string& text) {
  try {
    ImageProcessorConfig::from_json(json::parse(text), "pp.json");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    return e.what();
  }
  return "(accepted)";
}

TEST(ImageProcessor, BadConfigsAreRefusedInOneLine) {
  const std::string clip = R"("image_processor_type": "CLIPImageProcessor")";
  const std::string siglip = R"("image_processor_type": "SiglipImageProcessor")";
  EXPECT_EQ(refusal("{" + clip + R"(, "do_center_crops": true})"),
            "pp.json: unknown key 'do_center_crops' for CLIPImageProcessor; did you mean 'do_center_crop'?");
  EXPECT_EQ(refusal("{" + siglip + R"(, "crop_size": 224})"),
            "pp.json: unknown key 'crop_size' for SiglipImageProcessor");
  EXPECT_EQ(refusal("{" + clip + R"(, "do_resize": "yes"})"),
            "pp.json: 'do_resize' must be true or false, not \"yes\"");
  EXPECT_EQ(refusal("{" + clip + R"(, "image_std": [0.5, 0, 0.5]})"),
            "pp.json: 'image_std' must hold positive finite numbers, not [0.5,0,0.5]");
  EXPECT_EQ(refusal("{" + clip + R"(, "image_std": 1e-50})"), "pp.json: 'image_std' rounds to 0 in float32");
  EXPECT_EQ(
      refusal("{" + clip + R"(, "image_mean": [0.5, 0.5]})"),
      "pp.json: 'image_mean' must be a number or a list of 3 numbers (one per RGB channel), not [0.5,0.5]");
  EXPECT_EQ(
      refusal("{" + clip + R"(, "resample": 1})"),
      "pp.json: 'resample' 1 (lanczos) is not implemented; forge implements 0 (nearest), 2 (bilinear) and 3 "
      "(bicubic)");
  EXPECT_EQ(refusal("{" + clip + R"(, "resample": 7})"),
            "pp.json: 'resample' must be a PIL resampling code 0..5, not 7");
  EXPECT_EQ(refusal("{" + clip + R"(, "size": {"longest_edge": 224}})"),
            "pp.json: 'size' must be {\"shortest_edge\": n} or {\"height\": h, \"width\": w}, not "
            "{\"longest_edge\":224}");
  EXPECT_EQ(refusal("{" + clip + R"(, "size": {"shortest_edge": 0}})"),
            "pp.json: 'size.shortest_edge' must be an integer in [1, 16384], not 0");
  EXPECT_EQ(refusal("{" + siglip + R"(, "size": 224})"),
            "pp.json: 'size' must be {\"height\": h, \"width\": w} for SiglipImageProcessor (it reads both)");
  EXPECT_EQ(refusal("{" + clip + R"(, "rescale_factor": "1/255"})"),
            "pp.json: 'rescale_factor' must be a positive number, not \"1/255\"");
  EXPECT_EQ(refusal(R"({"image_processor_type": "ViTImageProcessor"})"),
            "pp.json: 'image_processor_type' 'ViTImageProcessor' is not supported (forge reads "
            "CLIPImageProcessor and "
            "SiglipImageProcessor)");
  EXPECT_NE(refusal(R"({"image_processor_type": "SiglipImageProcessorFast"})").find("torchvision"),
            std::string::npos);
  EXPECT_EQ(refusal(R"({"do_resize": true})"),
            "pp.json: names no image_processor_type (forge reads CLIPImageProcessor and SiglipImageProcessor "
            "configs)");
  EXPECT_EQ(refusal("[1, 2]"), "pp.json: must be a JSON object");
}

TEST(ImageProcessor, FileErrorsNameTheFile) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("forge_pp_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto path = dir / "preprocessor_config.json";
  write_file_atomically(
      path, R"({"image_processor_type": "CLIPImageProcessor", "resample": 3, "resample": 2})", "test");
  try {
    ImageProcessorConfig::from_json_file(path);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), path.string() + ": key 'resample' appears twice");
  }
  write_file_atomically(path, R"({"image_processor_type": "CLIPImageProcessor", "foo": 1})", "test");
  try {
    ImageProcessorConfig::from_json_file(path);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), path.string() + ": unknown key 'foo' for CLIPImageProcessor");
  }
  std::filesystem::remove_all(dir);
}

TEST(ImageProcessor, LegacyAndDefaultKeysAreRead) {
  // openai/clip-vit-large-patch14-336's file: integer size and crop_size, no image_processor_type.
  const auto c = ImageProcessorConfig::from_json(
      json::parse(R"({"crop_size": 336, "do_center_crop": true, "do_normalize": true, "do_resize": true,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 336})"),
      "clip336");
  EXPECT_EQ(c.kind, ImageProcessorConfig::Kind::clip);
  EXPECT_EQ(c.shortest_edge, 336);
  EXPECT_EQ(c.crop_height, 336);
  EXPECT_EQ(c.crop_width, 336);
  const auto s = ImageProcessorConfig::from_json(
      json::parse(R"({"image_processor_type": "SiglipImageProcessor", "do_convert_rgb": null,
        "image_seq_length": 576, "processor_class": "PaliGemmaProcessor", "size": {"height": 384, "width": 384}})"),
      "siglip384");
  EXPECT_EQ(s.kind, ImageProcessorConfig::Kind::siglip);
  EXPECT_EQ(s.resize_height, 384);
  EXPECT_FALSE(s.do_center_crop);
  EXPECT_EQ(s.image_mean[0], 0.5);
  EXPECT_EQ(s.resample, Resample::bicubic);
}

}  // namespace
}  // namespace forge::data::image_processor_test
