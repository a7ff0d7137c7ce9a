#include "forge/report/timeline_svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>

#include "forge/core/error.h"
#include "forge/core/xml.h"

namespace forge::report {
using pipeline::Action;
using pipeline::Op;
using pipeline::TimelineSpan;

namespace {

struct Rgb {
  double r, g, b;
};

// Light and dark shade of each kind's hue: chunk 0 light, the last chunk dark, others in between.
enum Kind { kind_f, kind_b, kind_i, kind_w, kinds };
constexpr std::array<std::array<Rgb, 2>, kinds> palette = {{
    {{{0x9e, 0xc5, 0xf0}, {0x2f, 0x6d, 0xb8}}},  // F: blue
    {{{0xa8, 0xdc, 0xa0}, {0x33, 0x8a, 0x3e}}},  // B: green
    {{{0xf7, 0xc4, 0x86}, {0xc9, 0x6d, 0x12}}},  // I: orange
    {{{0xd2, 0xb6, 0xe8}, {0x7b, 0x4f, 0xaa}}},  // W: purple
}};
constexpr const char* kind_letter[kinds] = {"F", "B", "I", "W"};
constexpr const char* kind_label[kinds] = {"forward", "backward", "backward (input)", "backward (weights)"};

Rgb shade(Kind kind, int chunk, int chunks) {
  const double t = chunks <= 1 ? 0 : std::clamp(static_cast<double>(chunk) / (chunks - 1), 0.0, 1.0);
  const Rgb& a = palette[kind][0];
  const Rgb& b = palette[kind][1];
  return {a.r + (b.r - a.r) * t, a.g + (b.g - a.g) * t, a.b + (b.b - a.b) * t};
}

std::string hex(Rgb c) {
  auto byte = [](double v) { return static_cast<int>(std::lround(std::clamp(v, 0.0, 255.0))); };
  return fmt::format("#{:02x}{:02x}{:02x}", byte(c.r), byte(c.g), byte(c.b));
}

// Dark text on the light shades, white on the dark ones.
const char* text_on(Rgb c) {
  return (0.299 * c.r + 0.587 * c.g + 0.114 * c.b) / 255 > 0.55 ? "#1b1f24" : "#fff";
}

Kind kind_of(Op op) {
  switch (op) {
    case Op::backward:
      return kind_b;
    case Op::backward_input:
      return kind_i;
    case Op::backward_weight:
      return kind_w;
    default:
      return kind_f;
  }
}

// An axis step of 1, 2 or 5 times a power of ten giving at most about `ticks` ticks.
double nice_step(double range, int ticks) {
  if (range <= 0) return 1;
  const double raw = range / ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * power >= raw) return m * power;
  return 10 * power;
}

// Rough width of a text in px at a font size (no font metrics in a plain SVG writer).
double text_width(const std::string& s, double font_px) {
  return 0.58 * font_px * static_cast<double>(s.size());
}

}  // namespace

std::string timeline_svg(const std::vector<TimelineSpan>& spans, int rows, const std::string& title,
                         const TimelineSvgStyle& style) {
  FORGE_CHECK(rows >= 1, "timeline_svg: {} rows", rows);
  double t0 = 0, t1 = 0;
  bool any = false, kind_present[kinds] = {}, pairs = false;
  int chunks = 1;
  for (const TimelineSpan& s : spans) {
    if (!is_compute(s.op)) continue;
    FORGE_CHECK(s.row >= 0 && s.row < rows, "timeline_svg: span on row {} of {}", s.row, rows);
    t0 = any ? std::min(t0, s.start) : s.start;
    t1 = any ? std::max(t1, s.end) : s.end;
    any = true;
    chunks = std::max({chunks, s.chunk + 1, s.chunk_b + 1});
    if (s.op == Op::forward_backward) {
      pairs = true;
      kind_present[kind_f] = kind_present[kind_b] = true;
    } else {
      kind_present[kind_of(s.op)] = true;
    }
  }
  const double duration = t1 > t0 ? t1 - t0 : 1;
  const double scale = style.px_per_unit > 0 ? style.px_per_unit : style.width_px / duration;
  const double pad = 10, label_w = 54, row_h = style.row_height, gap = 3;
  const double left = pad + label_w, axis_w = duration * scale;
  const double title_y = pad + 13, subtitle_y = title_y + 16;
  const double top = (style.subtitle.empty() ? title_y : subtitle_y) + 10;
  const double axis_y = top + rows * (row_h + gap) + 1;
  const double legend_y = axis_y + 34;
  auto x_of = [&](double t) { return left + (t - t0) * scale; };

  std::string body;
  // Row backgrounds: what no box covers is idle time.
  for (int r = 0; r < rows; ++r) {
    const double y = top + r * (row_h + gap);
    body += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\" fill=\"#444\">rank {}</text>\n",
        left - 6, y + row_h / 2 + 4, r);
    body += fmt::format(
        "<rect class=\"idle\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
        "fill=\"#eceef1\"/>\n",
        left, y, axis_w, row_h);
  }
  const bool show_chunk = chunks > 1;
  auto box = [&](const char* cls, double x, double y, double w, Kind kind, int chunk, int micro_batch,
                 const std::string& tip) {
    const Rgb fill = shade(kind, chunk, chunks);
    body += fmt::format(
        "<rect class=\"op {}\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
        "stroke=\"#fff\" stroke-width=\"0.8\"><title>{}</title></rect>\n",
        cls, x, y, w, row_h, hex(fill), xml_escape(tip));
    const std::string label = std::to_string(micro_batch);
    const double font = row_h >= 18 ? 10 : 8;
    if (w >= text_width(label, font) + 3)
      body += fmt::format(
          "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"{}\" text-anchor=\"middle\" fill=\"{}\">{}</text>\n",
          x + w / 2, y + row_h / 2 + font * 0.35, font, text_on(fill), label);
  };
  for (const TimelineSpan& s : spans) {
    if (!is_compute(s.op)) continue;
    const double x = x_of(s.start), w = (s.end - s.start) * scale;
    const double y = top + s.row * (row_h + gap);
    const std::string when = fmt::format(" from {:g} to {:g}", s.start, s.end);
    if (s.op == Op::forward_backward) {
      // One box, its forward half and backward half in their own colours; the outline keeps it one box.
      const Action f{Op::forward, s.chunk, s.micro_batch}, b{Op::backward, s.chunk_b, s.micro_batch_b};
      const std::string tip = to_string(f, show_chunk) + "+" + to_string(b, show_chunk) + when;
      box("F pair", x, y, w / 2, kind_f, s.chunk, s.micro_batch, tip);
      box("B pair", x + w / 2, y, w / 2, kind_b, s.chunk_b, s.micro_batch_b, tip);
      body += fmt::format(
          "<rect class=\"pair\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
          "stroke=\"#1b1f24\" stroke-width=\"1\"/>\n",
          x + 0.5, y + 0.5, std::max(0.0, w - 1), row_h - 1);
    } else {
      const Kind kind = kind_of(s.op);
      const Action a{s.op, s.chunk, s.micro_batch};
      box(kind_letter[kind], x, y, w, kind, s.chunk, s.micro_batch, to_string(a, show_chunk) + when);
    }
  }
  // Time axis, in the spans' units.
  body += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#888\"/>\n",
                      left, axis_y, left + axis_w, axis_y);
  const double step = nice_step(duration, std::max(2, static_cast<int>(axis_w / 60)));
  for (double t = std::ceil(t0 / step) * step; t <= t1 + step * 1e-9; t += step) {
    const double x = x_of(t);
    body += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#888\"/>\n",
                        x, axis_y, x, axis_y + 4);
    body += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"9\" text-anchor=\"middle\" fill=\"#666\">{:g}</text>\n",
        x, axis_y + 14, t);
  }
  // Legend: the kinds present (every chunk's shade), the F&B pair, idle.
  double lx = left;
  auto swatch = [&](double x, const std::string& fill, const char* stroke) {
    body += fmt::format(
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\" "
        "stroke=\"{}\" "
        "stroke-width=\"0.8\"/>\n",
        x, legend_y - 10, fill, stroke);
  };
  auto legend_text = [&](const std::string& text) {
    body += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" fill=\"#333\">{}</text>\n", lx,
                        legend_y, xml_escape(text));
    lx += text_width(text, 11) + 14;
  };
  for (int k = 0; k < kinds; ++k) {
    if (!kind_present[k]) continue;
    for (int c = 0; c < chunks; ++c, lx += 13)
      swatch(lx, hex(shade(static_cast<Kind>(k), c, chunks)), "#fff");
    lx += 3;
    legend_text(std::string(kind_letter[k]) + " " + kind_label[k]);
  }
  if (pairs) {
    const std::string f = hex(shade(kind_f, 0, chunks)), b = hex(shade(kind_b, 0, chunks));
    body += fmt::format(
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"8\" height=\"12\" fill=\"{}\"/>\n"
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"8\" height=\"12\" fill=\"{}\"/>\n"
        "<rect class=\"legend\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"16\" height=\"12\" fill=\"none\" "
        "stroke=\"#1b1f24\"/>\n",
        lx, legend_y - 10, f, lx + 8, legend_y - 10, b, lx, legend_y - 10);
    lx += 19;
    legend_text("F&B overlapped pair");
  }
  swatch(lx, "#eceef1", "#eceef1");
  lx += 15;
  legend_text("idle");
  if (chunks > 1) legend_text("(darker: later chunk)");

  const double content_w =
      std::max({left + axis_w, lx, pad + text_width(title, 14), pad + text_width(style.subtitle, 11)});
  const double width = std::ceil(content_w + pad), height = std::ceil(legend_y + pad + 4);
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"Helvetica, Arial, sans-serif\">\n"
      "<rect class=\"background\" width=\"{0}\" height=\"{1}\" rx=\"6\" fill=\"#fff\"/>\n"
      "<text x=\"{2}\" y=\"{3}\" font-size=\"14\" font-weight=\"bold\" fill=\"#1b1f24\">{4}</text>\n",
      width, height, pad, title_y, xml_escape(title));
  if (!style.subtitle.empty())
    out += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"11\" fill=\"#555\">{}</text>\n", pad, subtitle_y,
                       xml_escape(style.subtitle));
  out += body;
  out += "</svg>\n";
  return out;
}

}  // namespace forge::report
