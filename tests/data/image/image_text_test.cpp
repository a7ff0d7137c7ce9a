// Image-text data: tokenization and masking on hand-made JSONL (exact ids and targets), padding and
// truncation, placeholders, every error path, the packed file's round trip (bitwise pixels) and its errors,
// and determinism over thread counts.
#include "forge/data/image/image_text.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/data/image/image.h"
#include "forge/data/image/image_processor.h"
#include "forge/data/tokenizer/tokenizer.h"

namespace forge::data::image_text_test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int32_t kBos = 300, kEos = 301, kPad = 302, kImage = 500;

// Bytes, plus BOS/EOS/pad ids past the byte range, so that expected ids can be written by hand.
TextEncoder test_encoder() {
  TextEncoder e = TextEncoder::bytes();
  e.bos_id = kBos;
  e.eos_id = kEos;
  e.pad_id = kPad;
  e.vocab_size = 303;
  return e;
}

ImageProcessor siglip(int64_t side) {
  ImageProcessorConfig c = ImageProcessorConfig::siglip_defaults();
  c.resize_height = c.resize_width = side;
  return ImageProcessor(c);
}

// CLIP: shortest edge then a center crop, so resize and crop both matter.
ImageProcessor clip(int64_t edge, int64_t crop) {
  ImageProcessorConfig c = ImageProcessorConfig::clip_defaults();
  c.shortest_edge = edge;
  c.crop_height = c.crop_width = crop;
  return ImageProcessor(c);
}

RgbImage pattern_image(int64_t height, int64_t width, int salt) {
  RgbImage image;
  image.height = height;
  image.width = width;
  image.pixels.resize(static_cast<size_t>(height * width * 3));
  for (size_t i = 0; i < image.pixels.size(); ++i)
    image.pixels[i] = static_cast<uint8_t>((i * 37 + static_cast<size_t>(salt) * 101 + (i / 7) * 13) & 0xFF);
  return image;
}

class ImageTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("forge_image_text_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "img");
    write_png(pattern_image(12, 20, 1), dir_ / "img" / "a.png");
    write_png(pattern_image(17, 9, 2), dir_ / "img" / "b.png");
    write_png(pattern_image(8, 8, 3), dir_ / "img" / "c.png");
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path jsonl(const std::string& text, const std::string& name = "data.jsonl") {
    write_file_atomically(dir_ / name, text, "test JSONL");
    return dir_ / name;
  }

  ImageTextOptions options(int64_t seq_len, int64_t tokens_per_image = 3) const {
    ImageTextOptions o;
    o.seq_len = seq_len;
    o.image_token_id = kImage;
    o.tokens_per_image = tokens_per_image;
    // Single characters (assign(1, c): GCC 12 warns falsely on assigning a one-character literal at -O3).
    o.text_template.human_prefix.assign(1, 'U');
    o.text_template.human_suffix.clear();
    o.text_template.assistant_prefix.assign(1, 'G');
    return o;
  }

  std::string error_of(const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      return message;
    }
    ADD_FAILURE() << "no error";
    return {};
  }

  fs::path dir_;
};

std::vector<int32_t> to_vector(std::span<const int32_t> s) { return {s.begin(), s.end()}; }

TEST_F(ImageTextTest, CaptionFormIdsAndTargets) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "hi"})"
                          "\n");
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(10));
  ASSERT_EQ(d.num_samples(), 1);
  EXPECT_EQ(d.num_images(), 1);
  EXPECT_EQ(d.source_line(0), 1);
  // BOS, 3 image tokens, the separator "\n" (masked), then the caption and EOS (trained), then padding.
  EXPECT_EQ(to_vector(d.sample_ids(0)),
            (std::vector<int32_t>{kBos, kImage, kImage, kImage, '\n', 'h', 'i', kEos, kPad, kPad}));
  EXPECT_EQ(to_vector(d.sample_targets(0)),
            (std::vector<int32_t>{-1, -1, -1, -1, 'h', 'i', kEos, -1, -1, -1}));
}

TEST_F(ImageTextTest, CaptionPromptIsMasked) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "x"})"
                          "\n");
  ImageTextOptions o = options(8, 2);
  o.text_template.caption_prompt = "P";
  o.text_template.caption_separator = "";
  o.text_template.add_bos = false;
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o);
  EXPECT_EQ(to_vector(d.sample_ids(0)),
            (std::vector<int32_t>{'P', kImage, kImage, 'x', kEos, kPad, kPad, kPad}));
  EXPECT_EQ(to_vector(d.sample_targets(0)), (std::vector<int32_t>{-1, -1, 'x', kEos, -1, -1, -1, -1}));
}

TEST_F(ImageTextTest, ConversationFormMasksHumanTurnsAndPrefixes) {
  const auto path = jsonl(
      R"({"id": 7, "image": "img/b.png", "conversations": [{"from": "human", "value": "<image>\nQ"}, )"
      R"({"from": "gpt", "value": "A"}, {"from": "human", "value": "R"}, {"from": "gpt", "value": "B"}]})"
      "\n");
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(16, 2));
  // BOS U [img img] \n Q G A EOS U R G B EOS pad pad
  EXPECT_EQ(to_vector(d.sample_ids(0)), (std::vector<int32_t>{kBos, 'U', kImage, kImage, '\n', 'Q', 'G', 'A',
                                                              kEos, 'U', 'R', 'G', 'B', kEos, kPad, kPad}));
  EXPECT_EQ(to_vector(d.sample_targets(0)),
            (std::vector<int32_t>{-1, -1, -1, -1, -1, -1, 'A', kEos, -1, -1, -1, 'B', kEos, -1, -1, -1}));
}

TEST_F(ImageTextTest, DefaultTemplateWithATokenizerWithoutSpecialIds) {
  const auto path =
      jsonl(R"({"image": "img/a.png", "conversations": [{"from": "human", "value": "<image>"}, )"
            R"({"from": "gpt", "value": "ok"}]})"
            "\n");
  ImageTextOptions o = options(32, 1);
  o.text_template = ImageTextTemplate{};
  const auto d = ImageTextDataset::from_jsonl(path, TextEncoder::bytes(), siglip(8), o);
  const std::string expected_text = "USER: ";
  std::vector<int32_t> ids(expected_text.begin(), expected_text.end());
  ids.push_back(kImage);
  for (char c : std::string("\nASSISTANT: ok")) ids.push_back(c);
  ids.resize(32, 0);  // pad 0, no BOS or EOS
  EXPECT_EQ(to_vector(d.sample_ids(0)), ids);
  const auto targets = to_vector(d.sample_targets(0));
  const auto ok_at = static_cast<size_t>(expected_text.size() + 1 + 12);  // the position of "o"
  for (size_t i = 0; i < targets.size(); ++i)
    EXPECT_EQ(targets[i], i + 1 == ok_at ? 'o' : (i == ok_at ? 'k' : -1)) << i;
}

TEST_F(ImageTextTest, WithATokenizerJson) {
  // The small byte-level BPE of the tokenizer tests: "hell" is 258, <|endoftext|> (special) 259, no BOS, no
  // pad.
  const Tokenizer tokenizer = Tokenizer::from_json(forge::testing::small_tokenizer_json(), "small");
  const TextEncoder encoder = TextEncoder::from_tokenizer(tokenizer);
  EXPECT_EQ(encoder.eos_id, 259);
  EXPECT_FALSE(encoder.bos_id.has_value());
  EXPECT_EQ(encoder.pad_id, 0);
  EXPECT_NE(encoder.fingerprint, TextEncoder::bytes().fingerprint);
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "hello"})"
                          "\n");
  const auto d = ImageTextDataset::from_jsonl(path, encoder, siglip(8), options(9));
  EXPECT_EQ(to_vector(d.sample_ids(0)),
            (std::vector<int32_t>{kImage, kImage, kImage, '\n', 258, 'o', 259, 0, 0}));
  EXPECT_EQ(to_vector(d.sample_targets(0)), (std::vector<int32_t>{-1, -1, -1, 258, 'o', 259, -1, -1, -1}));
}

TEST_F(ImageTextTest, TextOnlyLinesAndSeveralImages) {
  const auto path =
      jsonl(R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})"
            "\n\n"
            R"({"image": ["img/a.png", "img/c.png"], "conversations": [{"from": "human", )"
            R"("value": "<image><image>"}, {"from": "gpt", "value": "z"}]})"
            "\n");
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(12, 2));
  ASSERT_EQ(d.num_samples(), 2);
  EXPECT_EQ(d.source_line(1), 3);  // blank lines count
  EXPECT_EQ(d.images_in_sample(0), 0);
  EXPECT_EQ(d.images_in_sample(1), 2);
  const std::vector<int64_t> order = {1, 0, 1};
  EXPECT_EQ(d.count_images(order), 4);
  const auto batch = d.batch(order);
  EXPECT_EQ(batch.pixels.shape(), (Shape{4, 3, 8, 8}));
  EXPECT_EQ(std::memcmp(batch.ids.i32(), d.sample_ids(1).data(), 12 * 4), 0);
  EXPECT_EQ(std::memcmp(batch.ids.i32() + 12, d.sample_ids(0).data(), 12 * 4), 0);
  // Images in order of appearance: a, c (sample 1), then a, c again.
  const Tensor a = siglip(8).preprocess(read_image(dir_ / "img" / "a.png"));
  const Tensor c = siglip(8).preprocess(read_image(dir_ / "img" / "c.png"));
  const size_t image_floats = 3 * 8 * 8;
  EXPECT_EQ(std::memcmp(batch.pixels.f32(), a.f32(), image_floats * 4), 0);
  EXPECT_EQ(std::memcmp(batch.pixels.f32() + image_floats, c.f32(), image_floats * 4), 0);
  EXPECT_EQ(std::memcmp(batch.pixels.f32() + 2 * image_floats, a.f32(), image_floats * 4), 0);
  EXPECT_EQ(std::memcmp(batch.pixels.f32() + 3 * image_floats, c.f32(), image_floats * 4), 0);
}

TEST_F(ImageTextTest, TruncatesTextAfterTheLastImage) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "abcdef"})"
                          "\n");
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(7));
  EXPECT_EQ(to_vector(d.sample_ids(0)), (std::vector<int32_t>{kBos, kImage, kImage, kImage, '\n', 'a', 'b'}));
  // The last target is the first token cut off.
  EXPECT_EQ(to_vector(d.sample_targets(0)), (std::vector<int32_t>{-1, -1, -1, -1, 'a', 'b', 'c'}));
}

TEST_F(ImageTextTest, ImageTokensThatDoNotFitAreRefusedOrSkipped) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "a"})"
                          "\n"
                          R"({"caption": "text only"})"
                          "\n");
  // BOS + 3 image tokens end at position 4: seq_len 3 cannot hold them.
  const std::string e =
      error_of([&] { ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(3)); });
  EXPECT_THAT(e, HasSubstr("data.jsonl:1:"));
  EXPECT_THAT(e, HasSubstr("past seq_len 3"));
  ImageTextOptions o = options(3);
  o.skip_too_long = true;
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o);
  EXPECT_EQ(d.num_samples(), 1);
  EXPECT_EQ(d.skipped_too_long(), 1);
  EXPECT_EQ(d.skipped_bad(), 0);
  EXPECT_EQ(d.source_line(0), 2);
  // Exactly fitting is fine.
  EXPECT_EQ(ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(4)).num_samples(), 2);
}

TEST_F(ImageTextTest, EveryBadLineIsOneLineNamingFileAndLine) {
  fs::create_directories(dir_ / "img");
  write_file_atomically(dir_ / "img" / "corrupt.png", std::string("\x89PNG\r\n\x1a\nnot really"), "test");
  write_file_atomically(dir_ / "img" / "notes.txt", std::string("hello"), "test");
  const std::string good = R"({"image": "img/a.png", "caption": "ok"})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"image": "img/missing.png", "caption": "x"})", "missing.png"},
      {R"({"image": "img/corrupt.png", "caption": "x"})", "corrupt PNG"},
      {R"({"image": "img/notes.txt", "caption": "x"})", "not a JPEG or PNG"},
      {R"({"image": "img/a.png", "caption": "x")", "invalid JSON"},
      {R"([1, 2])", "must be a JSON object"},
      {R"({"image": "img/a.png", "captoin": "x"})", "unknown key 'captoin'"},
      {R"({"image": "img/a.png", "caption": "x", "caption": "y"})", "appears twice"},
      {R"({"image": "img/a.png"})", "exactly one of"},
      {R"({"image": 3, "caption": "x"})", "'image' must be a path"},
      {R"({"image": "img/a.png", "conversations": [{"from": "human", "value": "no placeholder"}]})",
       "0 <image> placeholders but 1 image"},
      {R"({"conversations": [{"from": "human", "value": "<image>"}]})", "1 <image> placeholder but 0 images"},
      {R"({"image": "img/a.png", "conversations": [{"from": "system", "value": "<image>"}]})",
       "'from' must be"},
      {R"({"image": "img/a.png", "conversations": [{"from": "human", "value": "<image>", "x": 1}]})",
       "unknown key 'x'"},
      {R"({"image": "img/a.png", "conversations": [{"from": "human", "value": "<image>"}, )"
       R"({"from": "gpt", "value": "<image>"}]})",
       "assistant turn"},
      {R"({"caption": "has <image> inside"})", "contains <image>"},
  };
  for (const auto& [line, expected] : cases) {
    const auto path = jsonl(good + "\n" + line + "\n" + good + "\n");
    const std::string e =
        error_of([&] { ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(16)); });
    EXPECT_THAT(e, HasSubstr("data.jsonl:2:")) << line;
    EXPECT_THAT(e, HasSubstr(expected)) << line;
    ImageTextOptions o = options(16);
    o.skip_bad = true;
    const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o);
    EXPECT_EQ(d.num_samples(), 2) << line;
    EXPECT_EQ(d.skipped_bad(), 1) << line;
    ASSERT_EQ(d.skip_reasons().size(), 1u);
    EXPECT_THAT(d.skip_reasons()[0], HasSubstr(expected));
    EXPECT_EQ(d.source_line(1), 3);
  }
}

TEST_F(ImageTextTest, TextThatEncodesToTheImageTokenIsRefused) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "A"})"
                          "\n");
  ImageTextOptions o = options(16);
  o.image_token_id = 'A';
  EXPECT_THAT(error_of([&] { ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o); }),
              HasSubstr("encodes to the image token id 65"));
}

TEST_F(ImageTextTest, SettingsAndEmptyFiles) {
  const auto path = jsonl(R"({"image": "img/a.png", "caption": "A"})"
                          "\n");
  EXPECT_THAT(error_of([&] { ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(0)); }),
              HasSubstr("seq_len must be positive"));
  ImageTextOptions o = options(8);
  o.image_token_id = -1;
  EXPECT_THAT(error_of([&] { ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o); }),
              HasSubstr("image_token_id"));
  ImageProcessorConfig no_crop = ImageProcessorConfig::clip_defaults();
  no_crop.do_center_crop = false;
  EXPECT_THAT(error_of([&] {
                ImageTextDataset::from_jsonl(path, test_encoder(), ImageProcessor(no_crop), options(8));
              }),
              HasSubstr("every image at one size"));
  EXPECT_THAT(error_of([&] {
                ImageTextDataset::from_jsonl(jsonl("\n\n", "empty.jsonl"), test_encoder(), siglip(8),
                                             options(8));
              }),
              HasSubstr("empty.jsonl: holds no samples"));
  EXPECT_THAT(error_of([&] {
                ImageTextDataset::from_jsonl(dir_ / "nope.jsonl", test_encoder(), siglip(8), options(8));
              }),
              HasSubstr("nope.jsonl"));
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), options(8));
  EXPECT_THAT(error_of([&] { d.images_in_sample(1); }), HasSubstr("out of range"));
  const std::vector<int64_t> one = {0};
  std::vector<int32_t> ids(8), targets(8);
  EXPECT_THAT(error_of([&] { d.fill_batch(one, ids.data(), targets.data(), nullptr, 0); }),
              HasSubstr("room for 0"));
}

TEST_F(ImageTextTest, ImagesRootAndAnImageRemovedAfterOpening) {
  fs::create_directories(dir_ / "other");
  write_png(pattern_image(5, 6, 4), dir_ / "other" / "x.png");
  const auto path = jsonl(R"({"image": "x.png", "caption": "a"})"
                          "\n");
  ImageTextOptions o = options(8);
  o.images_root = dir_ / "other";
  const auto d = ImageTextDataset::from_jsonl(path, test_encoder(), siglip(8), o);
  fs::remove(dir_ / "other" / "x.png");
  EXPECT_THAT(error_of([&] { d.batch(std::vector<int64_t>{0}); }), HasSubstr("x.png"));
}

TEST(ImageTextCrop, ResizeAndCropThenTheTableIsPreprocess) {
  for (const ImageProcessor& p : {clip(14, 12), siglip(10), clip(20, 24)}) {
    for (const auto& [h, w] : std::vector<std::pair<int, int>>{{12, 20}, {17, 9}, {31, 31}, {5, 40}}) {
      const RgbImage image = pattern_image(h, w, h * w);
      const Tensor expected = p.preprocess(image);
      const std::vector<uint8_t> crop = resize_and_crop(p, image);
      ASSERT_EQ(static_cast<int64_t>(crop.size()), expected.numel());
      const int64_t plane = expected.numel() / 3;
      for (int64_t i = 0; i < expected.numel(); ++i) {
        const float v = p.value(static_cast<int>(i / plane), crop[static_cast<size_t>(i)]);
        ASSERT_EQ(std::memcmp(&v, expected.f32() + i, 4), 0) << h << "x" << w << " at " << i;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ packed form

class PackedImageTextTest : public ImageTextTest {
 protected:
  void SetUp() override {
    ImageTextTest::SetUp();
    source_ = jsonl(R"({"image": "img/a.png", "caption": "red"})"
                    "\n"
                    R"({"caption": "no image here"})"
                    "\n"
                    R"({"image": ["img/b.png", "img/c.png"], "conversations": [{"from": "human", )"
                    R"("value": "<image> and <image>?"}, {"from": "gpt", "value": "two"}]})"
                    "\n"
                    R"({"image": "img/c.png", "caption": "a caption longer than the sequence"})"
                    "\n");
    packed_ = dir_ / "data.packed";
  }
  PackedImageTextExpectation expect() const {
    PackedImageTextExpectation e;
    e.seq_len = 24;
    e.image_token_id = kImage;
    e.tokens_per_image = 3;
    e.text_fingerprint = test_encoder().fingerprint;
    return e;
  }
  ImageTextDataset unpacked() {
    return ImageTextDataset::from_jsonl(source_, test_encoder(), clip(14, 12), options(24));
  }
  void pack() { write_packed_image_text(unpacked(), packed_, test_encoder().fingerprint); }

  fs::path source_, packed_;
};

void expect_same_batches(const ImageTextDataset& a, const ImageTextDataset& b,
                         std::span<const int64_t> order) {
  const auto x = a.batch(order), y = b.batch(order);
  ASSERT_EQ(x.pixels.shape(), y.pixels.shape());
  EXPECT_EQ(std::memcmp(x.ids.i32(), y.ids.i32(), x.ids.numel() * 4), 0);
  EXPECT_EQ(std::memcmp(x.targets.i32(), y.targets.i32(), x.targets.numel() * 4), 0);
  EXPECT_EQ(std::memcmp(x.pixels.f32(), y.pixels.f32(), x.pixels.numel() * 4), 0);
}

TEST_F(PackedImageTextTest, RoundTripIsBitwise) {
  pack();
  EXPECT_FALSE(fs::exists(fs::path(packed_.string() + ".tmp")));
  const auto a = unpacked();
  const auto b = ImageTextDataset::from_packed(packed_, clip(14, 12), expect());
  EXPECT_TRUE(b.packed());
  EXPECT_EQ(b.num_samples(), 4);
  EXPECT_EQ(b.num_images(), 4);
  EXPECT_EQ(b.image_shape(), (std::array<int64_t, 3>{3, 12, 12}));
  for (int64_t s = 0; s < 4; ++s) {
    EXPECT_EQ(to_vector(a.sample_ids(s)), to_vector(b.sample_ids(s)));
    EXPECT_EQ(to_vector(a.sample_targets(s)), to_vector(b.sample_targets(s)));
    EXPECT_EQ(a.sample_image_bytes(s), b.sample_image_bytes(s));
  }
  const std::vector<int64_t> order = {2, 0, 3, 1, 2};
  expect_same_batches(a, b, order);
  // The normalisation comes from the caller's processor: other mean/std, same resize and crop, still loads.
  ImageProcessorConfig other = clip(14, 12).config();
  other.image_mean = {0.1, 0.2, 0.3};
  const ImageProcessor other_processor(other);
  const auto c = ImageTextDataset::from_packed(packed_, other_processor, expect());
  const auto batch = c.batch(std::vector<int64_t>{0});
  const Tensor direct = other_processor.preprocess(read_image(dir_ / "img" / "a.png"));
  EXPECT_EQ(std::memcmp(batch.pixels.f32(), direct.f32(), direct.numel() * 4), 0);
  // Skip counts travel with the file.
  ImageTextOptions skipping = options(24);
  skipping.skip_too_long = true;
  skipping.seq_len = 4;
  const auto short_one = ImageTextDataset::from_jsonl(source_, test_encoder(), clip(14, 12), skipping);
  EXPECT_EQ(short_one.skipped_too_long(), 1);
  write_packed_image_text(short_one, dir_ / "short.packed", test_encoder().fingerprint);
  PackedImageTextExpectation e4 = expect();
  e4.seq_len = 4;
  const auto reopened = ImageTextDataset::from_packed(dir_ / "short.packed", clip(14, 12), e4);
  EXPECT_EQ(reopened.num_samples(), 3);
  EXPECT_EQ(reopened.skipped_too_long(), 1);
}

TEST_F(PackedImageTextTest, DeterministicOverThreadsAndRuns) {
  pack();
  const std::string first = read_file(packed_, "packed");
  const int threads = omp_get_max_threads();
  omp_set_num_threads(3);
  write_packed_image_text(unpacked(), packed_, test_encoder().fingerprint, 2);
  EXPECT_EQ(read_file(packed_, "packed"), first);
  const auto d = ImageTextDataset::from_packed(packed_, clip(14, 12), expect());
  const std::vector<int64_t> order = {3, 2, 1, 0, 2};
  const auto many = d.batch(order);
  const auto jsonl_many = unpacked().batch(order);
  omp_set_num_threads(1);
  const auto one = d.batch(order);
  const auto jsonl_one = unpacked().batch(order);
  omp_set_num_threads(threads);
  EXPECT_EQ(std::memcmp(many.pixels.f32(), one.pixels.f32(), one.pixels.numel() * 4), 0);
  EXPECT_EQ(std::memcmp(jsonl_many.pixels.f32(), jsonl_one.pixels.f32(), one.pixels.numel() * 4), 0);
  EXPECT_EQ(std::memcmp(many.pixels.f32(), jsonl_one.pixels.f32(), one.pixels.numel() * 4), 0);
}

TEST_F(PackedImageTextTest, HeaderMustAgreeWithTheRun) {
  pack();
  auto check = [&](PackedImageTextExpectation e, const ImageProcessor& p, const std::string& expected) {
    EXPECT_THAT(error_of([&] { ImageTextDataset::from_packed(packed_, p, e); }), HasSubstr(expected));
  };
  auto e = expect();
  e.seq_len = 32;
  check(e, clip(14, 12), "packed with seq_len 24, but this run uses 32");
  e = expect();
  e.image_token_id = 7;
  check(e, clip(14, 12), "image_token_id 500");
  e = expect();
  e.tokens_per_image = 4;
  check(e, clip(14, 12), "tokens_per_image 3");
  e = expect();
  e.text_fingerprint = 12345;
  check(e, clip(14, 12), "another tokenizer");
  check(expect(), clip(14, 10), "12x12 images, but the image processor makes 10x10");
  check(expect(), clip(16, 12), "other resize/crop settings");
}

TEST_F(PackedImageTextTest, TruncatedOrCorruptFilesFailWithOneLine) {
  pack();
  const std::string bytes = read_file(packed_, "packed");
  const fs::path bad = dir_ / "bad.packed";
  auto open_with = [&](const std::string& content) {
    write_file_atomically(bad, content, "test");
    return error_of([&] { ImageTextDataset::from_packed(bad, clip(14, 12), expect()); });
  };
  EXPECT_THAT(open_with(bytes.substr(0, bytes.size() - 1)), HasSubstr("truncated packed image-text data"));
  EXPECT_THAT(open_with(bytes.substr(0, 100)), HasSubstr("shorter than its 128-byte header"));
  EXPECT_THAT(open_with(""), HasSubstr("shorter than its 128-byte header"));
  EXPECT_THAT(open_with(bytes + "x"), HasSubstr("oversized"));
  std::string flipped = bytes;
  flipped[bytes.size() - 5] ^= 0x40;  // a pixel
  EXPECT_THAT(open_with(flipped), HasSubstr("body checksum mismatch"));
  flipped = bytes;
  flipped[20] ^= 1;  // the sample count
  EXPECT_THAT(open_with(flipped), HasSubstr("corrupt packed image-text header"));
  flipped = bytes;
  flipped[0] = 'X';
  EXPECT_THAT(open_with(flipped), HasSubstr("not a packed image-text file"));
  EXPECT_THAT(error_of([&] { ImageTextDataset::from_packed(dir_ / "none.packed", clip(14, 12), expect()); }),
              HasSubstr("none.packed: cannot open"));
}

}  // namespace
}  // namespace forge::data::image_text_test
