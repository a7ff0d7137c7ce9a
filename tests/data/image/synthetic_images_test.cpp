// The synthetic image-caption generator: the same seed gives the same bytes, captions say what was drawn
// (checked on the pixels), the written set loads as image-text data; and PNG writing round-trips.
#include "forge/data/image/synthetic_images.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/image/image_text.h"

namespace forge::data::synthetic_images_test {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir() {
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("forge_synth_{}_{}", ::getpid(),
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(PngWrite, RoundTripsAndIsDeterministic) {
  RgbImage image;
  image.height = 13;
  image.width = 29;
  for (int64_t i = 0; i < 13 * 29 * 3; ++i) image.pixels.push_back(static_cast<uint8_t>((i * 7919) >> 3));
  const std::string png = encode_png(image, "test");
  EXPECT_EQ(sniff_image_format(std::span(reinterpret_cast<const uint8_t*>(png.data()), png.size())),
            ImageFormat::png);
  const RgbImage back =
      decode_image(std::span(reinterpret_cast<const uint8_t*>(png.data()), png.size()), "test");
  EXPECT_EQ(back.height, 13);
  EXPECT_EQ(back.width, 29);
  EXPECT_EQ(back.pixels, image.pixels);
  EXPECT_EQ(encode_png(image, "test"), png);
  RgbImage empty;
  EXPECT_THROW(encode_png(empty, "empty"), Error);
  image.pixels.pop_back();
  EXPECT_THROW(encode_png(image, "short"), Error);
}

TEST(SyntheticImages, CaptionsAgreeWithThePixels) {
  constexpr int64_t size = 64;
  std::set<std::string> captions;
  int two = 0, noisy = 0;
  for (int64_t i = 0; i < 200; ++i) {
    const SynthScene scene = synth_scene(7, i);
    ASSERT_GE(scene.objects.size(), 1u);
    ASSERT_LE(scene.objects.size(), 2u);
    two += scene.objects.size() == 2;
    noisy += scene.noisy;
    const RgbImage image = render_synth_scene(scene, size, 7, i);
    const std::string caption = synth_caption(scene);
    captions.insert(caption);
    for (const SynthObject& o : scene.objects) {
      const std::string_view colour = synth_colours()[static_cast<size_t>(o.colour)].name;
      // The caption names the object...
      const std::string phrase =
          fmt::format("a {} {} {} {}", o.size == SynthSize::large ? "large" : "small", colour,
                      synth_shape_name(o.shape), synth_position_phrase(o.position));
      EXPECT_NE(caption.find(phrase), std::string::npos) << caption;
      // ...and the pixel at its stated position has its colour.
      const auto [cx, cy, h] = synth_object_box(o, size);
      const auto x = static_cast<int64_t>(cx), y = static_cast<int64_t>(cy);
      const auto& rgb = synth_colours()[static_cast<size_t>(o.colour)].rgb;
      for (int c = 0; c < 3; ++c)
        EXPECT_EQ(image.at(y, x, c), rgb[static_cast<size_t>(c)]) << caption << " " << c;
      // The position phrase matches where the object is.
      const double fx = cx / size, fy = cy / size;
      if (o.position == SynthPosition::left) {
        EXPECT_LT(fx, 0.4);
      }
      if (o.position == SynthPosition::right) {
        EXPECT_GT(fx, 0.6);
      }
      if (o.position == SynthPosition::top) {
        EXPECT_LT(fy, 0.4);
      }
      if (o.position == SynthPosition::bottom) {
        EXPECT_GT(fy, 0.6);
      }
      if (o.size == SynthSize::large) {
        EXPECT_GT(h, size * 0.12);
      }
      if (o.size == SynthSize::small) {
        EXPECT_LT(h, size * 0.1);
      }
    }
    if (scene.objects.size() == 2) {
      EXPECT_NE(scene.objects[0].position, scene.objects[1].position);
      // Named in reading order, whatever order they were drawn in: the caption is the picture's.
      const SynthScene swapped{{scene.objects[1], scene.objects[0]}, scene.background, scene.noisy};
      EXPECT_EQ(synth_caption(swapped), caption);
      const auto first_y = synth_object_box(scene.objects[0], size)[1];
      const auto second_y = synth_object_box(scene.objects[1], size)[1];
      const auto first_x = synth_object_box(scene.objects[0], size)[0];
      const auto second_x = synth_object_box(scene.objects[1], size)[0];
      const bool first_reads_first = first_y != second_y ? first_y < second_y : first_x < second_x;
      const std::string first_phrase(synth_position_phrase(scene.objects[0].position));
      const std::string second_phrase(synth_position_phrase(scene.objects[1].position));
      EXPECT_EQ(caption.find(first_phrase) < caption.find(second_phrase), first_reads_first) << caption;
    }
    // A corner is background: grey, within the noise of the background level.
    for (int c = 0; c < 3; ++c)
      EXPECT_LE(std::abs(image.at(0, 0, c) - scene.background), scene.noisy ? 16 : 0);
  }
  EXPECT_GT(two, 40);
  EXPECT_GT(noisy, 40);
  EXPECT_GT(captions.size(), 150u);
}

TEST(SyntheticImages, SameSeedSameBytesWhateverTheThreads) {
  const fs::path root = temp_dir(), a = root / "a", b = root / "b", c = root / "c";
  SynthImagesOptions o;
  o.count = 24;
  o.size = 32;
  o.seed = 3;
  o.heldout = 0.25;
  o.out = a;
  o.workers = 1;
  const SynthImagesStats stats = write_synth_images(o);
  EXPECT_EQ(stats.train, 18);
  EXPECT_EQ(stats.heldout, 6);
  o.out = b;
  o.workers = 3;
  write_synth_images(o);
  o.out = c;
  o.seed = 4;
  write_synth_images(o);
  for (const char* name : {"train.jsonl", "heldout.jsonl", "preprocessor_config.json", "images/000000.png",
                           "images/000023.png"}) {
    EXPECT_EQ(read_file(a / name, "a"), read_file(b / name, "b")) << name;
  }
  EXPECT_NE(read_file(a / "train.jsonl", "a"), read_file(c / "train.jsonl", "c"));
  const auto made = nlohmann::json::parse(read_file(a / "synth.json", "a"));
  EXPECT_EQ(made["version"], kSynthImagesVersion);
  EXPECT_EQ(made["count"], 24);
  EXPECT_EQ(made["seed"], 3);
  EXPECT_NE(read_file(a / "images/000005.png", "a"), read_file(c / "images/000005.png", "c"));

  // The set is self-contained: its preprocessor config and JSONL load as image-text data.
  const ImageProcessor processor(ImageProcessorConfig::from_json_file(a / "preprocessor_config.json"));
  ImageTextOptions options;
  options.seq_len = 96;
  options.image_token_id = 256;
  options.tokens_per_image = 4;
  const auto train =
      ImageTextDataset::from_jsonl(a / "train.jsonl", TextEncoder::bytes(), processor, options);
  const auto heldout =
      ImageTextDataset::from_jsonl(a / "heldout.jsonl", TextEncoder::bytes(), processor, options);
  EXPECT_EQ(train.num_samples(), 18);
  EXPECT_EQ(heldout.num_samples(), 6);
  EXPECT_EQ(train.image_shape(), (std::array<int64_t, 3>{3, 32, 32}));
  // Pixels are the PNG's values mapped by (v / 255 - 0.5) / 0.5: the image is already 32x32.
  const auto batch = train.batch(std::vector<int64_t>{5});
  const RgbImage image = read_image(a / "images/000005.png");
  EXPECT_EQ(batch.pixels.f32()[0], processor.value(0, image.at(0, 0, 0)));
  const std::string text = read_file(a / "train.jsonl", "a");
  const auto json = nlohmann::json::parse(text.substr(0, text.find('\n')));
  EXPECT_EQ(json["image"], "images/000000.png");
  EXPECT_EQ(json["caption"], synth_caption(synth_scene(3, 0)));
  fs::remove_all(root);
}

TEST(SyntheticImages, BadOptions) {
  SynthImagesOptions o;
  o.out = temp_dir();
  o.count = 0;
  EXPECT_THROW(write_synth_images(o), Error);
  o.count = 2;
  o.size = 8;
  EXPECT_THROW(write_synth_images(o), Error);
  o.size = 32;
  o.heldout = 1.0;
  EXPECT_THROW(write_synth_images(o), Error);
  fs::remove_all(o.out);
}

}  // namespace
}  // namespace forge::data::synthetic_images_test
