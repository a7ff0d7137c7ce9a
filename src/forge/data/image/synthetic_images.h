// A synthetic image-caption dataset forge renders itself (`forge data synth-images`): one or two shapes
// (circle, square, triangle, cross) in named colours, at named positions and sizes, on a plain or noisy
// grey background, with a caption that says what was drawn ("a small blue square at the top and a large red
// circle on the left"). Small enough to train a LLaVA-style model on in minutes; every byte is a
// function of (seed, image index).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "forge/data/image/image.h"

namespace forge::data {

enum class SynthShape { circle, square, triangle, cross };
enum class SynthPosition { left, right, top, bottom, centre };
enum class SynthSize { small, large };

struct SynthColour {
  std::string_view name;
  std::array<uint8_t, 3> rgb;
};
// red, green, blue, yellow, purple, orange, white, black: far from each other and from the background.
const std::vector<SynthColour>& synth_colours();

struct SynthObject {
  SynthShape shape = SynthShape::circle;
  int colour = 0;  // index into synth_colours()
  SynthPosition position = SynthPosition::centre;
  SynthSize size = SynthSize::large;
};

struct SynthScene {
  std::vector<SynthObject> objects;  // 1 or 2, never overlapping, at different positions
  uint8_t background = 128;          // grey level
  bool noisy = false;                // +-16 uniform noise per pixel and channel on the background
};

// Scene `index` of the dataset drawn from `seed`.
SynthScene synth_scene(uint64_t seed, int64_t index);
// The scene as a size x size image (anti-aliased edges: 4x4 samples per pixel).
RgbImage render_synth_scene(const SynthScene& scene, int64_t size, uint64_t seed, int64_t index);
// "a small blue square at the top and a large red circle on the left": the objects in reading order (top,
// then left, centre, right, then bottom), so that the caption depends on the picture only.
std::string synth_caption(const SynthScene& scene);

// Centre (x, y) and half-extent of an object in pixels for an image of `size`: the shape fits in the square
// centre +- half-extent, and covers its centre pixel.
std::array<double, 3> synth_object_box(const SynthObject& object, int64_t size);

std::string_view synth_shape_name(SynthShape shape);
std::string_view synth_position_phrase(SynthPosition position);  // "on the left", "in the centre", ...

// Bumped when the same options would make other images or captions (2: captions in reading order); the
// Makefile's run-multimodal checks it.
constexpr int kSynthImagesVersion = 2;

struct SynthImagesOptions {
  std::filesystem::path out;
  int64_t count = 0;
  int64_t size = 64;
  uint64_t seed = 0;
  double heldout = 0.1;  // the last round(count * heldout) images go to heldout.jsonl
  int workers = 0;       // 0: OpenMP's default; the output does not depend on it
};

struct SynthImagesStats {
  int64_t train = 0, heldout = 0;
  double seconds = 0;
};

// Writes out/images/NNNNNN.png, out/train.jsonl and out/heldout.jsonl (caption form, one
// {"id", "image", "caption"} line per image), out/preprocessor_config.json (SiglipImageProcessor,
// size x size, mean and std 0.5) and out/synth.json (the generator's version and the options), each file
// atomically.
SynthImagesStats write_synth_images(const SynthImagesOptions& options);

}  // namespace forge::data
