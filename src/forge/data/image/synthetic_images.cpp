// Synthetic shapes-and-captions images (see synthetic_images.h). Random choices come from Philox keyed by the
// seed with the image index in the counter, so any image can be drawn alone and threads never change a byte.
#include "forge/data/image/synthetic_images.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/philox.h"

namespace forge::data {
namespace {

// Centre of each position as a fraction of the side.
constexpr std::array<std::array<double, 2>, 5> kCentres = {{
    {0.25, 0.5},  // left
    {0.75, 0.5},  // right
    {0.5, 0.25},  // top
    {0.5, 0.75},  // bottom
    {0.5, 0.5},   // centre
}};
constexpr double kHalfExtent[2] = {0.08, 0.15};  // small, large, as a fraction of the side
constexpr double kGap = 0.02;                    // between two objects' boxes
constexpr int kSamplesPerSide = 4;               // anti-aliasing: 4 x 4 samples per pixel

// Random words for draw `stream` of image `index`.
std::array<uint32_t, 4> draw(uint64_t seed, int64_t index, uint32_t stream, uint32_t attempt) {
  const auto i = static_cast<uint64_t>(index);
  return philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), stream, attempt},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

SynthObject random_object(const std::array<uint32_t, 4>& w) {
  SynthObject o;
  o.shape = static_cast<SynthShape>(w[0] % 4);
  o.colour = static_cast<int>(w[1] % synth_colours().size());
  o.position = static_cast<SynthPosition>(w[2] % 5);
  o.size = static_cast<SynthSize>(w[3] % 2);
  return o;
}

bool apart(const SynthObject& a, const SynthObject& b) {
  if (a.position == b.position) return false;
  const auto& ca = kCentres[static_cast<size_t>(a.position)];
  const auto& cb = kCentres[static_cast<size_t>(b.position)];
  const double need = kHalfExtent[static_cast<int>(a.size)] + kHalfExtent[static_cast<int>(b.size)] + kGap;
  return std::max(std::abs(ca[0] - cb[0]), std::abs(ca[1] - cb[1])) >= need;
}

// Whether point (px, py) (pixel units) lies in the object whose box is centre (cx, cy) +- h.
bool inside(SynthShape shape, double px, double py, double cx, double cy, double h) {
  const double dx = std::abs(px - cx), dy = std::abs(py - cy);
  switch (shape) {
    case SynthShape::circle:
      return dx * dx + dy * dy <= h * h;
    case SynthShape::square:
      return dx <= 0.85 * h && dy <= 0.85 * h;
    case SynthShape::triangle:  // apex at the top, base at the bottom of the box
      return py <= cy + h && dx <= 0.5 * (py - (cy - h));
    case SynthShape::cross:
      return (dx <= 0.3 * h && dy <= h) || (dy <= 0.3 * h && dx <= h);
  }
  return false;
}

std::string image_name(int64_t index) { return fmt::format("{:06d}.png", index); }

// Plain write: the images are many and small; the JSONL files, written atomically last, make the set whole.
void write_plain(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) fail("cannot write image {}", path.string());
}

}  // namespace

const std::vector<SynthColour>& synth_colours() {
  static const std::vector<SynthColour> colours = {
      {"red", {220, 30, 30}},     {"green", {30, 170, 50}},   {"blue", {40, 70, 230}},
      {"yellow", {235, 215, 30}}, {"purple", {140, 50, 190}}, {"orange", {245, 130, 20}},
      {"white", {245, 245, 245}}, {"black", {15, 15, 15}},
  };
  return colours;
}

std::string_view synth_shape_name(SynthShape shape) {
  static constexpr std::string_view names[] = {"circle", "square", "triangle", "cross"};
  return names[static_cast<int>(shape)];
}

std::string_view synth_position_phrase(SynthPosition position) {
  static constexpr std::string_view phrases[] = {"on the left", "on the right", "at the top", "at the bottom",
                                                 "in the centre"};
  return phrases[static_cast<int>(position)];
}

SynthScene synth_scene(uint64_t seed, int64_t index) {
  SynthScene scene;
  const auto w = draw(seed, index, 0, 0);
  scene.background = static_cast<uint8_t>(96 + w[0] % 65);  // 96..160
  scene.noisy = (w[1] & 1) != 0;
  const bool two = (w[2] & 1) != 0;
  scene.objects.push_back(random_object(draw(seed, index, 1, 0)));
  if (two) {
    // Redraw the second object until it keeps clear of the first (at most 64 tries, else one object).
    for (uint32_t attempt = 0; attempt < 64; ++attempt) {
      const SynthObject second = random_object(draw(seed, index, 2, attempt));
      if (apart(scene.objects[0], second)) {
        scene.objects.push_back(second);
        break;
      }
    }
  }
  return scene;
}

std::array<double, 3> synth_object_box(const SynthObject& object, int64_t size) {
  const auto& c = kCentres[static_cast<size_t>(object.position)];
  const auto side = static_cast<double>(size);
  // Centres sit on pixel centres, so the centre pixel is fully covered by every shape when size >= 16.
  return {std::floor(c[0] * side) + 0.5, std::floor(c[1] * side) + 0.5,
          kHalfExtent[static_cast<int>(object.size)] * side};
}

RgbImage render_synth_scene(const SynthScene& scene, int64_t size, uint64_t seed, int64_t index) {
  if (size < 16 || size > 4096) fail("synthetic images: size must be in [16, 4096], not {}", size);
  RgbImage image;
  image.height = image.width = size;
  image.pixels.resize(static_cast<size_t>(size * size * 3));
  for (int64_t p = 0; p < size * size; ++p) {
    for (int c = 0; c < 3; ++c) image.pixels[static_cast<size_t>(p * 3 + c)] = scene.background;
    if (scene.noisy) {
      const auto w = draw(seed, index, 3, static_cast<uint32_t>(p));
      for (int c = 0; c < 3; ++c) {
        const int v = scene.background + static_cast<int>(w[static_cast<size_t>(c)] % 33) - 16;
        image.pixels[static_cast<size_t>(p * 3 + c)] = static_cast<uint8_t>(std::clamp(v, 0, 255));
      }
    }
  }
  constexpr int samples = kSamplesPerSide * kSamplesPerSide;
  for (const SynthObject& object : scene.objects) {
    const auto [cx, cy, h] = synth_object_box(object, size);
    const auto& rgb = synth_colours()[static_cast<size_t>(object.colour)].rgb;
    const int64_t x0 = std::max<int64_t>(0, static_cast<int64_t>(cx - h) - 1);
    const int64_t x1 = std::min<int64_t>(size - 1, static_cast<int64_t>(cx + h) + 1);
    const int64_t y0 = std::max<int64_t>(0, static_cast<int64_t>(cy - h) - 1);
    const int64_t y1 = std::min<int64_t>(size - 1, static_cast<int64_t>(cy + h) + 1);
    for (int64_t y = y0; y <= y1; ++y) {
      for (int64_t x = x0; x <= x1; ++x) {
        int covered = 0;
        for (int j = 0; j < kSamplesPerSide; ++j)
          for (int i = 0; i < kSamplesPerSide; ++i)
            covered += inside(object.shape, static_cast<double>(x) + (i + 0.5) / kSamplesPerSide,
                              static_cast<double>(y) + (j + 0.5) / kSamplesPerSide, cx, cy, h);
        if (covered == 0) continue;
        uint8_t* px = &image.pixels[static_cast<size_t>((y * size + x) * 3)];
        for (int c = 0; c < 3; ++c)
          px[c] = static_cast<uint8_t>(
              (px[c] * (samples - covered) + rgb[static_cast<size_t>(c)] * covered + samples / 2) / samples);
      }
    }
  }
  return image;
}

std::string synth_caption(const SynthScene& scene) {
  // Reading order (top to bottom, then left to right): the caption is a function of the picture alone, not
  // of the order the objects were drawn in.
  std::vector<SynthObject> objects = scene.objects;
  std::stable_sort(objects.begin(), objects.end(), [](const SynthObject& a, const SynthObject& b) {
    const auto& ca = kCentres[static_cast<size_t>(a.position)];
    const auto& cb = kCentres[static_cast<size_t>(b.position)];
    return ca[1] != cb[1] ? ca[1] < cb[1] : ca[0] < cb[0];
  });
  std::string caption;
  for (size_t k = 0; k < objects.size(); ++k) {
    const SynthObject& o = objects[k];
    caption +=
        fmt::format("{}a {} {} {} {}", k == 0 ? "" : " and ", o.size == SynthSize::large ? "large" : "small",
                    synth_colours()[static_cast<size_t>(o.colour)].name, synth_shape_name(o.shape),
                    synth_position_phrase(o.position));
  }
  return caption;
}

SynthImagesStats write_synth_images(const SynthImagesOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  if (o.out.empty()) fail("synthetic images: an output folder is required");
  if (o.count < 1) fail("synthetic images: count must be positive, not {}", o.count);
  if (o.size < 16 || o.size > 4096) fail("synthetic images: size must be in [16, 4096], not {}", o.size);
  if (!(o.heldout >= 0 && o.heldout < 1))
    fail("synthetic images: heldout must be in [0, 1), not {}", o.heldout);
  const std::filesystem::path images = o.out / "images";
  std::error_code ec;
  std::filesystem::create_directories(images, ec);
  if (ec) fail("cannot create {}: {}", images.string(), ec.message());

  std::vector<std::string> captions(static_cast<size_t>(o.count));
  std::vector<std::string> errors(static_cast<size_t>(o.count));
  const int threads = o.workers > 0 ? o.workers : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads)
  for (int64_t i = 0; i < o.count; ++i) {
    try {
      const SynthScene scene = synth_scene(o.seed, i);
      const std::filesystem::path path = images / image_name(i);
      write_plain(path, encode_png(render_synth_scene(scene, o.size, o.seed, i), path.string()));
      captions[static_cast<size_t>(i)] = synth_caption(scene);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(i)] = e.what();
    }
  }
  for (const std::string& e : errors)
    if (!e.empty()) throw Error(e);

  const auto heldout = static_cast<int64_t>(std::llround(static_cast<double>(o.count) * o.heldout));
  std::string train_text, heldout_text;
  for (int64_t i = 0; i < o.count; ++i) {
    const nlohmann::ordered_json line = {{"id", fmt::format("{:06d}", i)},
                                         {"image", "images/" + image_name(i)},
                                         {"caption", captions[static_cast<size_t>(i)]}};
    (i < o.count - heldout ? train_text : heldout_text) += line.dump() + "\n";
  }
  const nlohmann::ordered_json config = {{"image_processor_type", "SiglipImageProcessor"},
                                         {"do_resize", true},
                                         {"size", {{"height", o.size}, {"width", o.size}}},
                                         {"resample", 3},
                                         {"do_rescale", true},
                                         {"rescale_factor", 1.0 / 255.0},
                                         {"do_normalize", true},
                                         {"image_mean", {0.5, 0.5, 0.5}},
                                         {"image_std", {0.5, 0.5, 0.5}}};
  write_file_atomically(o.out / "preprocessor_config.json", config.dump(2) + "\n", "preprocessor config");
  // What made the set, so that a tool (make run-multimodal) can tell a set of an older generator.
  const nlohmann::ordered_json made = {{"generator", "forge data synth-images"},
                                       {"version", kSynthImagesVersion},
                                       {"count", o.count},
                                       {"size", o.size},
                                       {"seed", o.seed},
                                       {"heldout", o.heldout}};
  write_file_atomically(o.out / "synth.json", made.dump(2) + "\n", "synthetic set description");
  write_file_atomically(o.out / "heldout.jsonl", heldout_text, "held-out JSONL");
  write_file_atomically(o.out / "train.jsonl", train_text, "training JSONL");

  SynthImagesStats stats;
  stats.train = o.count - heldout;
  stats.heldout = heldout;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace forge::data
