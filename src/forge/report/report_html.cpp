// forge report: the page (report.h). Plain HTML, CSS and inline SVG written here; the embedded data block
// and a few lines of plain script for hover values.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <functional>
#include <numeric>
#include <set>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/xml.h"
#include "forge/report/report.h"
#include "forge/report/timeline_svg.h"

namespace forge::report {

namespace fs = std::filesystem;

namespace {

// Tableau's ten: one per run, in order (the first is the loss path's colour the browser test looks for).
constexpr const char* kRunColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                      "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
const char* run_color(size_t run) { return kRunColors[run % std::size(kRunColors)]; }

std::string esc(std::string_view text) { return xml_escape(text); }

enum class Unit { plain, percent, bytes, count, seconds };

std::string format_value(double v, Unit unit) {
  if (!std::isfinite(v)) return "–";
  switch (unit) {
    case Unit::percent:
      return fmt::format("{:.3g}%", 100 * v);
    case Unit::bytes: {
      const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
      int i = 0;
      double x = v;
      while (std::fabs(x) >= 1024 && i < 4) x /= 1024, ++i;
      return fmt::format("{:.3g} {}", x, names[i]);
    }
    case Unit::count: {
      const double a = std::fabs(v);
      if (a >= 1e9) return fmt::format("{:.3g}G", v / 1e9);
      if (a >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
      if (a >= 1e3) return fmt::format("{:.3g}k", v / 1e3);
      return fmt::format("{:.3g}", v);
    }
    case Unit::seconds: {
      if (v >= 3600)
        return fmt::format("{}h{:02}m", static_cast<int64_t>(v / 3600), static_cast<int64_t>(v / 60) % 60);
      if (v >= 60)
        return fmt::format("{}m{:02}s", static_cast<int64_t>(v / 60), static_cast<int64_t>(v) % 60);
      return fmt::format("{:.3g} s", v);
    }
    case Unit::plain:
      break;
  }
  std::string text = fmt::format("{:.4g}", v);  // 1e+08 -> 1e8, 1e-05 -> 1e-5
  for (const char* from : {"e+0", "e+", "e-0"})
    if (const size_t at = text.find(from); at != std::string::npos)
      text.replace(at, std::strlen(from), from[1] == '-' ? "e-" : "e");
  return text;
}

// An axis step of 1, 2 or 5 times a power of ten, about `ticks` of them over range.
double nice_step(double range, int ticks) {
  if (!(range > 0)) return 1;
  const double raw = range / ticks;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * power >= raw * 0.999) return m * power;
  return 10 * power;
}

struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  std::vector<double> ticks;
  double map(double v, double a, double b) const {  // onto [a, b]
    const double t =
        log ? (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) : (v - lo) / (hi - lo);
    return a + t * (b - a);
  }
};

Axis make_axis(double lo, double hi, bool log, int ticks) {
  Axis a;
  a.log = log && lo > 0;
  if (a.log) {
    double e0 = std::floor(std::log10(lo)), e1 = std::ceil(std::log10(hi));
    if (e1 <= e0) e1 = e0 + 1;
    a.lo = std::pow(10.0, e0), a.hi = std::pow(10.0, e1);
    const bool fine = e1 - e0 <= 2;
    for (double e = e0; e <= e1; ++e)
      for (double m : {1.0, 2.0, 5.0})
        if ((m == 1 || fine) && m * std::pow(10.0, e) <= a.hi * 1.0001)
          a.ticks.push_back(m * std::pow(10.0, e));
    return a;
  }
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  const double step = nice_step(hi - lo, ticks);
  a.lo = std::floor(lo / step) * step, a.hi = std::ceil(hi / step) * step;
  for (double t = a.lo; t <= a.hi + step * 1e-6; t += step)
    a.ticks.push_back(std::fabs(t) < step * 1e-9 ? 0 : t);
  return a;
}

struct Line {
  std::string label;  // the chart's own legend ("" = none: the page legend names the runs)
  std::string color, dash;
  size_t run = 0;
  std::string series;  // the curve's name, in data-series
  std::vector<Point> points;
  bool dots = false;   // a marker at every point (sparse curves: held-out evaluations)
  bool faint = false;  // drawn thin and light, under its smoothed twin
};

struct Marker {
  double step = 0;
  std::string color, title;
};

struct Chart {
  std::string id, title, y_label;
  bool x_tokens = false, log_y = false;
  Unit unit = Unit::plain;
  std::vector<Line> lines;
  std::vector<Marker> markers;
};

constexpr double kW = 560, kH = 270, kLeft = 62, kRight = 14, kTop = 34, kBottom = 40;

std::string chart_svg(const Chart& c) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  const auto x_of_point = [&](const Point& p) { return c.x_tokens ? p.tokens : p.step; };
  for (const Line& l : c.lines)
    for (const Point& p : l.points) {
      if (!std::isfinite(p.value) || (c.log_y && p.value <= 0)) continue;
      x0 = std::min(x0, x_of_point(p)), x1 = std::max(x1, x_of_point(p));
      y0 = std::min(y0, p.value), y1 = std::max(y1, p.value);
    }
  if (!(x1 >= x0)) return {};
  if (!c.x_tokens)
    for (const Marker& m : c.markers) x0 = std::min(x0, m.step), x1 = std::max(x1, m.step);
  const Axis xa = make_axis(x0, x1, false, 6);
  // Bytes: round ticks in the unit of the largest value (KiB, MiB, GiB), not in decimal bytes.
  double unit = 1;
  if (c.unit == Unit::bytes && !c.log_y)
    while (std::max(std::fabs(y0), std::fabs(y1)) / unit >= 1024 && unit < 0x1p40) unit *= 1024;
  Axis ya = make_axis(y0 / unit, y1 / unit, c.log_y, 5);
  ya.lo *= unit, ya.hi *= unit;
  for (double& t : ya.ticks) t *= unit;
  const double px0 = kLeft, px1 = kW - kRight, py0 = kH - kBottom, py1 = kTop;
  std::string out = fmt::format(
      "<svg class=\"chart\" data-chart=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" "
      "height=\"{}\" viewBox=\"0 0 {} {}\" role=\"img\" aria-label=\"{}\" data-x0=\"{}\" data-x1=\"{}\" "
      "data-px0=\"{}\" data-px1=\"{}\" data-py0=\"{}\" data-py1=\"{}\" data-xtokens=\"{}\">\n"
      "<text x=\"{}\" y=\"18\" class=\"f-title\">{}</text>\n",
      esc(c.id), kW, kH, kW, kH, esc(c.title), xa.lo, xa.hi, px0, px1, py0, py1, c.x_tokens ? 1 : 0, kLeft,
      esc(c.title));
  // Grid and tick labels.
  for (double t : ya.ticks) {
    const double y = ya.map(t, py0, py1);
    out += fmt::format(
        "<line class=\"f-grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>"
        "<text class=\"f-tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
        px0, y, px1, y, px0 - 5, y + 3.5, esc(format_value(t, c.unit)));
  }
  for (double t : xa.ticks) {
    const double x = xa.map(t, px0, px1);
    out += fmt::format(
        "<line class=\"f-grid\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\"/>"
        "<text class=\"f-tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
        x, py0, x, py1, x, py0 + 14, esc(format_value(t, Unit::count)));
  }
  out += fmt::format("<rect class=\"f-frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>\n", px0, py1,
                     px1 - px0, py0 - py1);
  out += fmt::format("<text class=\"f-axis\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
                     (px0 + px1) / 2, kH - 6, c.x_tokens ? "tokens" : "step");
  if (!c.y_label.empty())
    out += fmt::format("<text class=\"f-axis\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", px1, 18,
                       esc(c.y_label));
  // Events (rollbacks, anomalies) as vertical rules.
  if (!c.x_tokens)
    for (const Marker& m : c.markers) {
      if (m.step < xa.lo || m.step > xa.hi) continue;
      const double x = xa.map(m.step, px0, px1);
      out += fmt::format(
          "<line class=\"f-event\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\">"
          "<title>{}</title></line>\n",
          x, py0, x, py1, m.color, esc(m.title));
    }
  // The curves: a path each, broken where a value cannot be drawn.
  for (const Line& l : c.lines) {
    std::string d, dots;
    bool pen = false;
    for (const Point& p : l.points) {
      if (!std::isfinite(p.value) || (c.log_y && p.value <= 0)) {
        pen = false;
        continue;
      }
      const double x = xa.map(x_of_point(p), px0, px1), y = ya.map(p.value, py0, py1);
      d += fmt::format("{}{:.1f} {:.1f}", pen ? " L" : (d.empty() ? "M" : " M"), x, y);
      pen = true;
      if (l.dots)
        dots += fmt::format(
            "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.6\" fill=\"{}\"><title>step {:g}: {}</title>"
            "</circle>",
            x, y, l.color, p.step, esc(format_value(p.value, c.unit)));
    }
    if (d.empty()) continue;
    out += fmt::format(
        "<path class=\"f-curve\" data-run=\"{}\" data-series=\"{}\" d=\"{}\" stroke=\"{}\"{}{}/>\n", l.run,
        esc(l.series), d, l.color, l.dash.empty() ? "" : " stroke-dasharray=\"" + l.dash + "\"",
        l.faint ? " stroke-width=\"0.8\" stroke-opacity=\"0.3\"" : "");
    out += dots;
  }
  // The chart's own legend: line styles that the run colours do not explain, on a light box.
  std::string legend;
  double lx = px0 + 8;
  std::set<std::string> shown;
  for (const Line& l : c.lines) {
    if (l.label.empty() || !shown.insert(l.label).second) continue;
    legend += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#444\" "
        "stroke-width=\"{}\"{}/>"
        "<text class=\"f-legend\" x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n",
        lx, py1 + 11, lx + 18, py1 + 11, l.faint ? "1\" stroke-opacity=\"0.35" : "1.6",
        l.dash.empty() ? "" : " stroke-dasharray=\"" + l.dash + "\"", lx + 22, py1 + 14.5, esc(l.label));
    lx += 36 + 6.6 * static_cast<double>(l.label.size());
  }
  if (!legend.empty())
    out += fmt::format(
               "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"16\" fill=\"#fff\" "
               "fill-opacity=\"0.9\" stroke=\"#e1e4e8\"/>\n",
               px0 + 3, py1 + 3, lx - px0 - 8) +
           legend;
  out += "</svg>\n";
  return out;
}

// A colour on a scale through the stops (t in [0, 1]).
std::string ramp(double t, const std::vector<std::array<int, 3>>& stops) {
  t = std::clamp(std::isfinite(t) ? t : 0.0, 0.0, 1.0) * static_cast<double>(stops.size() - 1);
  const size_t i = std::min(static_cast<size_t>(t), stops.size() - 2);
  const double f = t - static_cast<double>(i);
  int rgb[3];
  for (int k = 0; k < 3; ++k)
    rgb[k] = static_cast<int>(std::lround(stops[i][k] + f * (stops[i + 1][k] - stops[i][k])));
  return fmt::format("#{:02x}{:02x}{:02x}", rgb[0], rgb[1], rgb[2]);
}
const std::vector<std::array<int, 3>> kDiverging = {{33, 102, 172}, {247, 247, 247}, {178, 24, 43}};
const std::vector<std::array<int, 3>> kHeat = {{255, 255, 255}, {253, 174, 97}, {215, 48, 39}, {103, 0, 13}};

// A heat map: rows x columns of values, coloured by color(value), each cell titled.
std::string heat_map_svg(const std::string& id, const std::string& title,
                         const std::vector<std::string>& row_names, const std::string& column_axis,
                         const std::vector<std::string>& column_names,
                         const std::vector<std::vector<double>>& values,
                         const std::function<std::string(double)>& color,
                         const std::function<std::string(size_t, size_t, double)>& tip,
                         const std::string& scale_note) {
  const size_t rows = values.size(), columns = rows ? values[0].size() : 0;
  if (rows == 0 || columns == 0) return {};
  const double left = 70, top = 34, width = 600;
  const double cw = width / static_cast<double>(columns);
  const double rh = std::clamp(420.0 / static_cast<double>(rows), 3.0, 16.0);
  const double height = top + rh * static_cast<double>(rows) + 44;
  std::string out = fmt::format(
      "<svg class=\"heatmap\" data-chart=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" "
      "height=\"{:.0f}\" "
      "viewBox=\"0 0 {} {:.0f}\" shape-rendering=\"crispEdges\">\n<text x=\"{}\" y=\"18\" "
      "class=\"f-title\">{}</text>\n",
      esc(id), left + width + 14, height, left + width + 14, height, left, esc(title));
  const size_t label_every = std::max<size_t>(1, static_cast<size_t>(std::ceil(11.0 / rh)));
  for (size_t r = 0; r < rows; ++r) {
    const double y = top + rh * static_cast<double>(r);
    if (r % label_every == 0)
      out += fmt::format("<text class=\"f-tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
                         left - 5, y + rh / 2 + 3.5, esc(row_names[r]));
    for (size_t c = 0; c < columns; ++c)
      out += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
          "fill=\"{}\"><title>{}</title></rect>",
          left + cw * static_cast<double>(c), y, cw + 0.05, rh + 0.05, color(values[r][c]),
          esc(tip(r, c, values[r][c])));
    out += "\n";
  }
  const double axis_y = top + rh * static_cast<double>(rows);
  const size_t column_every = std::max<size_t>(1, static_cast<size_t>(std::ceil(40.0 / cw)));
  for (size_t c = 0; c < columns; c += column_every)
    out += fmt::format("<text class=\"f-tick\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
                       left + cw * (static_cast<double>(c) + 0.5), axis_y + 13, esc(column_names[c]));
  out += fmt::format("<text class=\"f-axis\" x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{}</text>\n",
                     left + width / 2, axis_y + 28, esc(column_axis));
  out += fmt::format("<text class=\"f-axis\" x=\"{:.1f}\" y=\"18\" text-anchor=\"end\">{}</text>\n</svg>\n",
                     left + width, esc(scale_note));
  return out;
}

// ---- the runs' summaries ----

const Point* last_point(const RunData& r, const std::string& name) {
  const std::vector<Point>* p = r.find(name);
  return p ? &p->back() : nullptr;
}

// The mean of a curve over its points after the first (the first interval carries start-up costs).
double mean_after_first(const RunData& r, const std::string& name) {
  const std::vector<Point>* p = r.find(name);
  if (!p) return NAN;
  const size_t from = p->size() > 1 ? 1 : 0;
  double sum = 0;
  for (size_t i = from; i < p->size(); ++i) sum += (*p)[i].value;
  return sum / static_cast<double>(p->size() - from);
}

double max_of(const RunData& r, const std::string& name) {
  const std::vector<Point>* p = r.find(name);
  if (!p) return NAN;
  double m = -INFINITY;
  for (const Point& x : *p) m = std::max(m, x.value);
  return m;
}

int64_t count_events(const RunData& r, const std::string& kind) {
  return std::count_if(r.events.begin(), r.events.end(), [&](const Event& e) { return e.kind == kind; });
}

struct SummaryRow {
  std::string name;
  std::function<std::string(const RunData&, nlohmann::json&)> cell;  // also records the number in the data
};

std::string cell_value(nlohmann::json& data, const char* key, double v, Unit unit,
                       const char* plain_format = nullptr) {
  if (!std::isfinite(v)) return "–";
  data[key] = v;
  return plain_format ? fmt::format(fmt::runtime(plain_format), v) : format_value(v, unit);
}

std::string summary_table(const std::vector<RunData>& runs, nlohmann::json& data) {
  const std::vector<SummaryRow> rows = {
      {"steps",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "loss");
         return p ? cell_value(d, "steps", p->step, Unit::plain, "{:.0f}") : std::string("–");
       }},
      {"tokens",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "loss");
         return p ? cell_value(d, "tokens", p->tokens, Unit::count) : std::string("–");
       }},
      {"training time",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "elapsed_s");
         return p ? cell_value(d, "elapsed_s", p->value, Unit::seconds) : std::string("–");
       }},
      {"final training loss",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "loss");
         return p ? cell_value(d, "final_loss", p->value, Unit::plain, "{:.4f}") : std::string("–");
       }},
      {"final held-out loss",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "eval_loss");
         return p ? cell_value(d, "final_eval_loss", p->value, Unit::plain, "{:.4f}") : std::string("–");
       }},
      {"held-out bits per byte",
       [](const RunData& r, nlohmann::json& d) {
         const Point* p = last_point(r, "eval_bits_per_byte");
         return p ? cell_value(d, "final_eval_bits_per_byte", p->value, Unit::plain, "{:.4f}")
                  : std::string("–");
       }},
      {"mean tokens/s",
       [](const RunData& r, nlohmann::json& d) {
         return cell_value(d, "mean_tokens_per_s", mean_after_first(r, "tokens_per_s"), Unit::count);
       }},
      {"mean MFU",
       [](const RunData& r, nlohmann::json& d) {
         return cell_value(d, "mean_mfu", mean_after_first(r, "mfu"), Unit::percent);
       }},
      {"peak memory (largest rank)",
       [](const RunData& r, nlohmann::json& d) {
         return cell_value(d, "peak_memory_bytes", max_of(r, "peak_memory_bytes"), Unit::bytes);
       }},
      {"rollbacks",
       [](const RunData& r, nlohmann::json& d) {
         d["rollbacks"] = count_events(r, "rollback");
         return std::to_string(count_events(r, "rollback"));
       }},
      {"checkpoints saved",
       [](const RunData& r, nlohmann::json& d) {
         d["checkpoints"] = count_events(r, "checkpoint");
         return std::to_string(count_events(r, "checkpoint"));
       }},
  };
  std::string out = "<table class=\"summary\"><thead><tr><th></th>";
  for (size_t i = 0; i < runs.size(); ++i)
    out += fmt::format("<th><span class=\"swatch\" style=\"background:{}\"></span>{}</th>", run_color(i),
                       esc(runs[i].label));
  out += "</tr></thead><tbody>\n";
  std::vector<nlohmann::json> cells(runs.size(), nlohmann::json::object());
  for (const SummaryRow& row : rows) {
    out += "<tr><th>" + esc(row.name) + "</th>";
    for (size_t i = 0; i < runs.size(); ++i) out += "<td>" + esc(row.cell(runs[i], cells[i])) + "</td>";
    out += "</tr>\n";
  }
  // The simulator's prediction, where the run had one (log.hardware_profile).
  bool predicted = false;
  for (const RunData& r : runs) predicted = predicted || count_events(r, "prediction_check") > 0;
  if (predicted) {
    out += "<tr><th>step time: predicted / measured</th>";
    for (size_t i = 0; i < runs.size(); ++i) {
      std::string text = "–";
      for (const Event& e : runs[i].events)
        if (e.kind == "prediction_check") text = e.text;
      out += "<td class=\"small\">" + esc(text) + "</td>";
    }
    out += "</tr>\n";
  }
  out += "</tbody></table>\n";
  for (size_t i = 0; i < runs.size(); ++i) data[i]["summary"] = cells[i];
  return out;
}

// The settings that differ between the runs (one run: the layout and the main training settings).
std::string settings_table(const std::vector<RunData>& runs) {
  std::set<std::string> keys;
  for (const RunData& r : runs)
    for (const auto& [k, v] : r.settings) keys.insert(k);
  std::vector<std::string> shown;
  if (runs.size() == 1) {
    for (const char* k : {"model.config",
                          "model.init_from",
                          "data.corpus",
                          "data.dataset",
                          "data.seq_len",
                          "train.micro_batch",
                          "train.grad_accum",
                          "train.lr",
                          "train.schedule",
                          "train.dtype",
                          "train.recompute",
                          "train.recompute_layers",
                          "train.recompute_modules",
                          "train.device",
                          "parallel.tp",
                          "parallel.pp",
                          "parallel.schedule",
                          "parallel.dp",
                          "parallel.ep",
                          "parallel.cp",
                          "parallel.distributed_optimizer",
                          "fp8.recipe"})
      if (keys.count(k)) shown.push_back(k);
  } else {
    for (const std::string& k : keys) {
      std::set<std::string> values;
      for (const RunData& r : runs) {
        const auto it = r.settings.find(k);
        values.insert(it == r.settings.end() ? "(unset)" : it->second);
      }
      if (values.size() > 1 && k != "log.run_dir" && k != "checkpoint.dir") shown.push_back(k);
    }
  }
  if (shown.empty())
    return runs.size() > 1 ? "<p class=\"note\">The runs' config.toml files do not differ.</p>\n" : "";
  std::string out = fmt::format("<h3>{}</h3><table class=\"settings\"><thead><tr><th>key</th>",
                                runs.size() > 1 ? "Settings that differ" : "Settings");
  for (size_t i = 0; i < runs.size(); ++i) out += "<th>" + esc(runs[i].label) + "</th>";
  out += "</tr></thead><tbody>\n";
  for (const std::string& k : shown) {
    out += "<tr><td class=\"l\"><code>" + esc(k) + "</code></td>";
    for (const RunData& r : runs) {
      const auto it = r.settings.find(k);
      out += "<td>" + esc(it == r.settings.end() ? "–" : it->second) + "</td>";
    }
    out += "</tr>\n";
  }
  return out + "</tbody></table>\n";
}

// ---- sections ----

struct CurveSpec {
  std::string id, title, series, y_label;
  Unit unit = Unit::plain;
  bool log_y = false, x_tokens = false, dots = false, markers = false;
};

// A curve smoothed by the mean of the points within `half` on either side (fewer at the ends): unlike an
// exponential average it does not lag behind the curve.
std::vector<Point> moving_mean(const std::vector<Point>& points, size_t half) {
  std::vector<double> sum(points.size() + 1, 0.0);
  for (size_t i = 0; i < points.size(); ++i) sum[i + 1] = sum[i] + points[i].value;
  std::vector<Point> out = points;
  for (size_t i = 0; i < points.size(); ++i) {
    const size_t lo = i >= half ? i - half : 0, hi = std::min(points.size(), i + half + 1);
    out[i].value = (sum[hi] - sum[lo]) / static_cast<double>(hi - lo);
  }
  return out;
}

// 100 * (run / baseline - 1) at the steps both have.
std::vector<Point> relative_to(const std::vector<Point>& run, const std::vector<Point>& baseline) {
  std::vector<Point> out;
  size_t j = 0;
  for (const Point& p : run) {
    while (j < baseline.size() && baseline[j].step < p.step) ++j;
    if (j < baseline.size() && baseline[j].step == p.step && baseline[j].value != 0)
      out.push_back({p.step, p.tokens, 100 * (p.value / baseline[j].value - 1)});
  }
  return out;
}

constexpr size_t kSmoothFrom = 50;  // points: longer loss curves are drawn smoothed over their raw values
// The half-width of the smoothing window of a curve of n points: 1% of them on either side, at least 2.
size_t smoothing(size_t n) { return std::max<size_t>(2, n / 100); }

// Every curve chart the runs have data for, in page order: (id, SVG).
std::vector<std::pair<std::string, std::string>> curve_charts(const std::vector<RunData>& runs,
                                                              const Options& o) {
  const std::vector<CurveSpec> specs = {
      {"loss", "Training loss", "loss", "nats/token", Unit::plain, false, false, false, true},
      {"loss_tokens", "Training and held-out loss against tokens", "loss", "nats/token", Unit::plain, false,
       true},
      {"eval_loss", "Held-out loss", "eval_loss", "nats/token", Unit::plain, false, false, true, true},
      {"eval_bpb", "Held-out bits per byte", "eval_bits_per_byte", "bits/byte", Unit::plain, false, false,
       true},
      {"lr", "Learning rate", "lr", "", Unit::plain},
      {"grad_norm", "Gradient norm (before clipping)", "grad_norm", "", Unit::plain, true, false, false,
       true},
      {"tokens_per_s", "Throughput", "tokens_per_s", "tokens/s", Unit::count},
      {"mfu", "Model FLOPs utilisation", "mfu", "of peak", Unit::percent},
      {"peak_memory", "Peak memory (largest rank)", "peak_memory_bytes", "allocator", Unit::bytes},
      {"dp_overlap", "Data-parallel reduction hidden under backward", "dp_overlap", "", Unit::percent},
      {"moe_violation", "MoE load: largest violation over layers", "moe.max_violation", "max/mean − 1"},
      {"moe_dropped", "MoE: dropped assignments", "moe.dropped_fraction", "", Unit::percent},
      {"moe_balance", "MoE: sequence-wise balance loss", "moe.balance_loss", ""},
  };
  std::vector<std::pair<std::string, std::string>> out;
  const auto add = [&](const Chart& c) {
    if (!c.lines.empty()) out.push_back({c.id, chart_svg(c)});
  };
  for (const CurveSpec& s : specs) {
    Chart c;
    c.id = s.id, c.title = s.title, c.y_label = s.y_label, c.unit = s.unit, c.log_y = s.log_y;
    c.x_tokens = s.x_tokens;
    for (size_t i = 0; i < runs.size(); ++i) {
      const std::vector<Point>* p = runs[i].find(s.series);
      if (!p) continue;
      // A curve that is all zero (no drops, the loss switched off) says nothing.
      if (s.series.rfind("moe.", 0) == 0 &&
          std::all_of(p->begin(), p->end(), [](const Point& x) { return x.value == 0; }))
        continue;
      const bool smooth = s.series == "loss" && p->size() >= kSmoothFrom;
      Line line{"", run_color(i), "", i, s.series, downsample(*p, o.max_points), s.dots || p->size() <= 40};
      if (smooth) {
        line.faint = true, line.label = "as logged";
        c.lines.push_back(line);
        const size_t half = smoothing(p->size());
        line = {fmt::format("mean of {} points", 2 * half + 1), run_color(i), "", i, s.series + ".smoothed",
                downsample(moving_mean(*p, half), o.max_points)};
      }
      c.lines.push_back(std::move(line));
      // Against tokens the held-out loss joins the training loss (dashed, a dot per evaluation).
      if (s.id == "loss_tokens")
        if (const std::vector<Point>* e = runs[i].find("eval_loss"))
          c.lines.push_back(
              {"held-out", run_color(i), "4 3", i, "eval_loss", downsample(*e, o.max_points), true});
      if (s.markers)
        for (const Event& e : runs[i].events)
          if ((e.kind == "rollback" || e.kind == "anomaly") && e.step >= 0)
            c.markers.push_back({static_cast<double>(e.step), run_color(i),
                                 e.kind + " at step " + std::to_string(e.step) + ": " + e.text});
    }
    add(c);
  }
  // Against a baseline run: each other run's held-out and (smoothed) training loss in percent of its.
  if (!o.baseline.empty()) {
    const auto base =
        std::find_if(runs.begin(), runs.end(), [&](const RunData& r) { return r.label == o.baseline; });
    const size_t b = static_cast<size_t>(base - runs.begin());
    for (const auto& [id, series, what] :
         {std::tuple{"eval_vs_baseline", "eval_loss", "Held-out loss"},
          std::tuple{"loss_vs_baseline", "loss", "Training loss (smoothed)"}}) {
      Chart c;
      c.id = id, c.y_label = "% vs " + o.baseline;
      c.title = fmt::format("{} relative to {}", what, o.baseline);
      const std::vector<Point>* reference = base == runs.end() ? nullptr : base->find(series);
      if (!reference) continue;
      const bool smooth = std::string(series) == "loss";
      const std::vector<Point> ref =
          smooth ? moving_mean(*reference, smoothing(reference->size())) : *reference;
      c.lines.push_back(
          {"", run_color(b), "4 3", b, std::string(series) + ".vs_baseline", relative_to(ref, ref), !smooth});
      for (size_t i = 0; i < runs.size(); ++i) {
        const std::vector<Point>* p = runs[i].find(series);
        if (i == b || !p) continue;
        c.lines.push_back(
            {"", run_color(i), "", i, std::string(series) + ".vs_baseline",
             downsample(relative_to(smooth ? moving_mean(*p, smoothing(p->size())) : *p, ref), o.max_points),
             !smooth});
      }
      if (c.lines.size() > 1) add(c);
    }
  }
  // FP8: the median scale of each operand role over the Linears (delayed recipe), log scale.
  {
    Chart c;
    c.id = "fp8_scales", c.title = "FP8 scales (delayed recipe; median over Linears)", c.log_y = true;
    const std::pair<const char*, const char*> roles[] = {
        {"input", ""}, {"weight", "6 3"}, {"grad_output", "2 3"}};
    for (size_t i = 0; i < runs.size(); ++i)
      for (const auto& [role, dash] : roles)
        if (const std::vector<Point>* p = runs[i].find(fmt::format("fp8.scale.{}.median", role)))
          c.lines.push_back({role, run_color(i), dash, i, fmt::format("fp8.scale.{}.median", role),
                             downsample(*p, o.max_points)});
    add(c);
  }
  // MTP: each depth's loss.
  {
    Chart c;
    c.id = "mtp", c.title = "Multi-token prediction loss per depth", c.y_label = "nats/token";
    const char* dashes[] = {"", "6 3", "2 3", "8 2 2 2"};
    for (size_t i = 0; i < runs.size(); ++i)
      for (int d = 1; d <= 8; ++d)
        if (const std::vector<Point>* p = runs[i].find(fmt::format("mtp.{}.loss", d)))
          c.lines.push_back({fmt::format("depth {}", d), run_color(i), dashes[(d - 1) % 4], i,
                             fmt::format("mtp.{}.loss", d), downsample(*p, o.max_points)});
    add(c);
  }
  return out;
}

std::string curves(const std::vector<RunData>& runs, const Options& o) {
  std::string out;
  for (const auto& [id, svg] : curve_charts(runs, o)) out += svg;
  return out.empty() ? "<p class=\"note\">No training records with numbers to draw.</p>\n"
                     : "<div class=\"grid\">\n" + out + "</div>\n";
}

std::string events_section(const std::vector<RunData>& runs) {
  std::string rows;
  for (size_t i = 0; i < runs.size(); ++i)
    for (const Event& e : runs[i].events) {
      if (e.kind == "checkpoint") continue;  // counted in the summary; failures are listed
      rows += fmt::format(
          "<tr><td class=\"l\"><span class=\"swatch\" style=\"background:{}\"></span>{}</td><td>{}</td>"
          "<td class=\"l kind {}\">{}</td><td class=\"l small\">{}</td></tr>\n",
          run_color(i), esc(runs[i].label), e.step >= 0 ? std::to_string(e.step) : "", esc(e.kind),
          esc(e.kind), esc(e.text));
    }
  if (rows.empty()) return {};
  return "<h2 id=\"events\">Events</h2>\n<table "
         "class=\"events\"><thead><tr><th>run</th><th>step</th><th>event"
         "</th><th>details</th></tr></thead><tbody>\n" +
         rows + "</tbody></table>\n";
}

// sample.captions: how many held-out answers were exactly right, and the recorded examples with the
// characters that differ from the reference marked.
std::string captions_section(const std::vector<RunData>& runs) {
  std::string out;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].captions) continue;
    const nlohmann::json& c = *runs[i].captions;
    const auto number = [&](const char* key) {
      return c.contains(key) && c[key].is_number() ? c[key].get<double>() : 0.0;
    };
    const double count = number("count"), exact = number("exact");
    out += fmt::format(
        "<h3><span class=\"swatch\" style=\"background:{}\"></span>{}: {:.0f} of {:.0f} exactly right "
        "({:.1f}%), "
        "{:.1f}% of their tokens</h3>\n",
        run_color(i), esc(runs[i].label), exact, count, count > 0 ? 100 * exact / count : 0.0,
        100 * number("token_accuracy"));
    std::string rows;
    if (c.contains("examples") && c["examples"].is_array())
      for (const nlohmann::json& e : c["examples"]) {
        if (!e.is_object() || !e.contains("answer") || !e.contains("reference") || !e["answer"].is_string() ||
            !e["reference"].is_string())
          continue;
        const std::string answer = e["answer"], reference = e["reference"];
        std::string marked;
        for (size_t k = 0; k < answer.size();) {  // runs of equal and of differing bytes
          const bool same = k < reference.size() && answer[k] == reference[k];
          size_t end = k;
          while (end < answer.size() && (end < reference.size() && answer[end] == reference[end]) == same)
            ++end;
          marked +=
              same ? esc(answer.substr(k, end - k)) : "<mark>" + esc(answer.substr(k, end - k)) + "</mark>";
          k = end;
        }
        rows += fmt::format("<tr><td>{}</td><td class=\"l\">{}</td><td class=\"l\">{}</td><td>{}</td></tr>\n",
                            e.contains("index") ? esc(e["index"].dump()) : "", marked, esc(reference),
                            answer == reference ? "&#10003;" : "");
      }
    if (!rows.empty())
      out +=
          "<table "
          "class=\"captions\"><thead><tr><th>held-out</th><th>answer</th><th>reference</th><th>right</th>"
          "</tr></thead><tbody>\n" +
          rows + "</tbody></table>\n";
  }
  if (out.empty()) return {};
  return "<h2 id=\"captions\">Held-out captions</h2>\n<p class=\"note\">Answered greedily after training "
         "(sample.captions); the answer's bytes that differ from the reference are marked.</p>\n" +
         out;
}

std::string profile_section(const std::vector<RunData>& runs, const Options& o, nlohmann::json& data) {
  std::string out;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].profile) continue;
    const nlohmann::json& p = *runs[i].profile;
    if (!p.contains("rows") || !p["rows"].is_array()) continue;
    // Seconds by kind of op (the bar chart), and the rows as the profiler sorted them (the table).
    std::map<std::string, double> by_op;
    double total = 0;
    std::string table;
    int64_t shown = 0;
    for (const nlohmann::json& row : p["rows"]) {
      if (!row.is_object() || !row.contains("seconds") || !row["seconds"].is_number()) continue;
      const std::string op = row.value("op", "?");
      const double seconds = row["seconds"].get<double>();
      by_op[op] += seconds, total += seconds;
    }
    for (const nlohmann::json& row : p["rows"]) {
      if (!row.is_object() || !row.contains("seconds") || !row["seconds"].is_number()) continue;
      if (shown++ >= o.profile_rows) break;
      const double seconds = row["seconds"].get<double>();
      const double flops = row.value("flops", 0.0), bytes = row.value("bytes", 0.0);
      table += fmt::format(
          "<tr><td>{:.3f}</td><td>{:.1f}%</td><td>{}</td><td>{}</td><td>{}</td><td class=\"l\">{}</td>"
          "<td class=\"l small\">{}</td></tr>\n",
          1e3 * seconds, total > 0 ? 100 * seconds / total : 0.0, row.value("calls", 0),
          flops > 0 && seconds > 0 ? fmt::format("{:.1f}", flops / seconds / 1e9) : "–",
          bytes > 0 && seconds > 0 ? fmt::format("{:.1f}", bytes / seconds / 1e9) : "–",
          esc(row.value("op", "?")), esc(row.value("detail", "")));
    }
    std::vector<std::pair<double, std::string>> bars;
    for (const auto& [op, s] : by_op) bars.push_back({s, op});
    std::sort(bars.rbegin(), bars.rend());
    const size_t n = std::min<size_t>(bars.size(), 14);
    const double bw = 360, left = 200, bh = 18, height = 34 + bh * static_cast<double>(n) + 10;
    std::string svg = fmt::format(
        "<svg class=\"bars\" data-chart=\"profile\" data-run=\"{}\" xmlns=\"http://www.w3.org/2000/svg\" "
        "width=\"{}\" height=\"{:.0f}\" viewBox=\"0 0 {} {:.0f}\">\n<text x=\"10\" y=\"18\" "
        "class=\"f-title\">Op "
        "time by kind</text>\n",
        i, left + bw + 80, height, left + bw + 80, height);
    const double top_value = n ? bars[0].first : 1;
    nlohmann::json kinds = nlohmann::json::object();
    for (size_t k = 0; k < n; ++k) {
      const double y = 30 + bh * static_cast<double>(k), w = bw * bars[k].first / top_value;
      kinds[bars[k].second] = bars[k].first;
      svg += fmt::format(
          "<text class=\"f-tick\" x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text><rect x=\"{}\" "
          "y=\"{:.1f}\" "
          "width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\"><title>{}: {:.3f} ms ({:.1f}%)</title></rect>"
          "<text class=\"f-tick\" x=\"{:.1f}\" y=\"{:.1f}\">{:.1f}%</text>\n",
          left - 6, y + 12, esc(bars[k].second), left, y + 2, w, bh - 4, run_color(i), esc(bars[k].second),
          1e3 * bars[k].first, 100 * bars[k].first / total, left + w + 5, y + 12,
          100 * bars[k].first / total);
    }
    svg += "</svg>\n";
    data[i]["profile_seconds_by_op"] = kinds;
    const double wall = p.value("wall_seconds", 0.0);
    out += fmt::format(
        "<h3><span class=\"swatch\" style=\"background:{}\"></span>{}</h3>\n<p class=\"note\">{} "
        "step{} on {}: {:.2f} ms in ops{}.</p>\n",
        run_color(i), esc(runs[i].label), p.value("steps", 1), p.value("steps", 1) == 1 ? "" : "s",
        esc(p.value("device", "?")), 1e3 * total,
        wall > 0 ? fmt::format(" of {:.2f} ms wall ({:.0f}%)", 1e3 * wall, 100 * total / wall) : "");
    out += svg +
           fmt::format("<details><summary>The {} largest rows</summary>", std::min(shown, o.profile_rows)) +
           "<table class=\"profile\"><thead><tr><th>ms</th><th>share</th><th>calls</th><th>GFLOP/s</th>"
           "<th>GB/s</th><th>op</th><th>shape</th></tr></thead><tbody>\n" +
           table + "</tbody></table></details>\n";
  }
  if (out.empty()) return {};
  return "<h2 id=\"profile\">Op profile</h2>\n<p class=\"note\">Of the step named by "
         "<code>log.profile_step</code>"
         " (<code>profile.json</code>): every op's time on the first rank.</p>\n" +
         out;
}

std::string pipeline_section(const std::vector<RunData>& runs) {
  std::string out;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (!runs[i].pipeline_trace) continue;
    int rows = 0;
    std::vector<pipeline::TimelineSpan> spans;
    try {
      spans = pipeline::spans_from_chrome_trace(runs[i].pipeline_trace->dump(), 1e-3, &rows);
    } catch (const std::exception& e) {
      out += fmt::format("<p class=\"note\">{}: pipeline_trace.json left out: {}</p>\n", esc(runs[i].label),
                         esc(e.what()));
      continue;
    }
    if (spans.empty() || rows < 1) continue;
    TimelineSvgStyle style;
    style.subtitle = "measured, time in ms; boxes labelled with their micro-batch";
    out += "<div class=\"timeline\" data-run=\"" + std::to_string(i) + "\">" +
           timeline_svg(spans, rows, runs[i].label + ": pipeline timeline of the profiled step", style) +
           "</div>\n";
  }
  if (out.empty()) return {};
  return "<h2 id=\"pipeline\">Pipeline timeline</h2>\n" + out;
}

std::string experts_section(const std::vector<RunData>& runs) {
  std::string out;
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunData& r = runs[i];
    if (r.moe_layers.empty()) continue;
    std::vector<std::string> layer_names;
    for (int64_t l : r.moe_layers) layer_names.push_back(fmt::format("layer {}", l));
    out +=
        fmt::format("<h3><span class=\"swatch\" style=\"background:{}\"></span>{}</h3>\n<div class=\"row\">",
                    run_color(i), esc(r.label));
    if (r.load_step >= 0 && !r.load.empty() && !r.load[0].empty()) {
      std::vector<std::vector<double>> ratio = r.load;
      for (auto& row : ratio) {
        const double mean = std::accumulate(row.begin(), row.end(), 0.0) / static_cast<double>(row.size());
        for (double& x : row) x = mean > 0 ? x / mean : 0;
      }
      std::vector<std::string> experts;
      for (size_t e = 0; e < r.load[0].size(); ++e) experts.push_back(std::to_string(e));
      out += heat_map_svg(
          "expert_load", fmt::format("Expert load at step {} (tokens / layer mean)", r.load_step),
          layer_names, "expert", experts, ratio, [](double v) { return ramp(v / 2, kDiverging); },
          [&](size_t row, size_t e, double v) {
            return fmt::format("layer {}, expert {}: {:.0f} tokens, {:.2f}x the mean", r.moe_layers[row], e,
                               r.load[row][e], v);
          },
          "blue 0, white 1, red ≥ 2");
    }
    if (!r.violation.empty()) {
      // Layers x logged steps (at most 240 columns, evenly chosen).
      const size_t n = r.violation_steps.size(), columns = std::min<size_t>(n, 240);
      std::vector<std::vector<double>> v(r.moe_layers.size(), std::vector<double>(columns));
      std::vector<std::string> steps(columns);
      double top = 0;
      for (size_t c = 0; c < columns; ++c) {
        const size_t k = columns == 1 ? n - 1 : c * (n - 1) / (columns - 1);
        steps[c] = std::to_string(r.violation_steps[k]);
        for (size_t l = 0; l < v.size() && l < r.violation[k].size(); ++l)
          v[l][c] = r.violation[k][l], top = std::max(top, v[l][c]);
      }
      if (top <= 0) top = 1;
      out += heat_map_svg(
          "violation", "Load violation per layer over the run (max / mean − 1)", layer_names, "step", steps,
          v, [top](double x) { return ramp(x / top, kHeat); },
          [&](size_t row, size_t c, double x) {
            return fmt::format("layer {}, step {}: violation {:.3f}", r.moe_layers[row], steps[c], x);
          },
          fmt::format("white 0, dark {:.2f}", top));
    }
    out += "</div>\n";
  }
  if (out.empty()) return {};
  return "<h2 id=\"experts\">Expert load</h2>\n" + out;
}

std::string skipped_section(const std::vector<RunData>& runs) {
  std::string out;
  for (const RunData& r : runs) {
    if (r.skipped_count == 0) continue;
    out += fmt::format("<h3>{}: {} skipped</h3><ul class=\"skipped\">\n", esc(r.label), r.skipped_count);
    for (const std::string& s : r.skipped) out += "<li>" + esc(s) + "</li>\n";
    if (r.skipped_count > static_cast<int64_t>(r.skipped.size()))
      out +=
          fmt::format("<li>… and {} more</li>\n", r.skipped_count - static_cast<int64_t>(r.skipped.size()));
    out += "</ul>\n";
  }
  if (out.empty()) return {};
  return "<h2 id=\"skipped\">Skipped input</h2>\n<p class=\"note\">Everything valid was drawn; these lines "
         "or "
         "values were not.</p>\n" +
         out;
}

// Hovering a chart: a vertical rule and, for each curve, its value at the nearest logged point (read from
// the embedded data). Plain DOM code; the page reads fine without it.
constexpr const char* kScript = R"(
(function () {
  var runs = JSON.parse(document.getElementById('forge-report-data').textContent).runs;
  var tip = document.createElement('div');
  tip.className = 'f-tip';
  document.body.appendChild(tip);
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c];
    });
  }
  function fmt(v) {
    var a = Math.abs(v);
    return a >= 1e5 || (a < 1e-3 && v !== 0) ? v.toExponential(3) : String(+v.toPrecision(5));
  }
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var d = svg.dataset, x0 = +d.x0, x1 = +d.x1, p0 = +d.px0, p1 = +d.px1, tokens = d.xtokens === '1';
    var lines = [];
    svg.querySelectorAll('path.f-curve').forEach(function (path) {
      var run = runs[+path.dataset.run];
      var points = run && run.series[path.dataset.series];
      if (points && points.length) lines.push({run: run, name: path.dataset.series, points: points,
                                               color: path.getAttribute('stroke')});
    });
    if (!lines.length) return;
    var rule = document.createElementNS('http://www.w3.org/2000/svg', 'line');
    rule.setAttribute('class', 'f-rule');
    rule.setAttribute('y1', d.py1);
    rule.setAttribute('y2', d.py0);
    rule.style.display = 'none';
    svg.appendChild(rule);
    function hide() { tip.style.display = 'none'; rule.style.display = 'none'; }
    svg.addEventListener('mouseleave', hide);
    svg.addEventListener('mousemove', function (e) {
      var box = svg.getBoundingClientRect();
      var px = (e.clientX - box.left) * svg.viewBox.baseVal.width / box.width;
      if (px < p0 || px > p1) { hide(); return; }
      var x = x0 + (px - p0) / (p1 - p0) * (x1 - x0), rows = [];
      lines.forEach(function (l) {
        var best = l.points[0];
        l.points.forEach(function (q) {
          if (Math.abs((tokens ? q[1] : q[0]) - x) < Math.abs((tokens ? best[1] : best[0]) - x)) best = q;
        });
        rows.push('<span style="color:' + l.color + '">&#9632;</span> ' + esc(l.run.label) + ' ' + esc(l.name) +
                  ' <b>' + fmt(best[2]) + '</b> <span class="f-dim">step ' + best[0] + '</span>');
      });
      rule.setAttribute('x1', px);
      rule.setAttribute('x2', px);
      rule.style.display = '';
      tip.innerHTML = rows.join('<br>');
      tip.style.display = 'block';
      tip.style.left = (e.pageX + 14) + 'px';
      tip.style.top = (e.pageY + 12) + 'px';
    });
  });
  document.documentElement.dataset.ready = '1';
})();
)";

// The charts' own styles (also inside each SVG that write_chart_svgs writes), then the page's.
constexpr const char* kSvgStyle = R"(
svg{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif}svg .f-title{font-size:13px;font-weight:600;fill:#1b1f24}
svg .f-tick{font-size:10px;fill:#555}svg .f-axis{font-size:11px;fill:#555}svg .f-legend{font-size:11px;fill:#333}
svg .f-grid{stroke:#eceef1;stroke-width:1}svg .f-frame{fill:none;stroke:#c9ced4}
svg .f-curve{fill:none;stroke-width:1.8;stroke-linejoin:round;stroke-linecap:round}
svg .f-event{stroke-width:1.2;stroke-dasharray:4 3;opacity:.8}
)";
constexpr const char* kStyle = R"(
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 22px 40px}
h1{font-size:22px;margin:6px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dce1;padding-bottom:4px}
h3{font-size:14px;margin:16px 0 6px}.note{color:#555;font-size:13px}.small{font-size:12px;color:#444}
table{border-collapse:collapse;font-size:13px;background:#fff}th,td{border:1px solid #e1e4e8;padding:4px 8px;text-align:right}
thead th{background:#eef1f4}tbody th,td.l{text-align:left}code{font-size:12px}
details summary{cursor:pointer;font-size:13px;color:#333;margin:6px 0}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;vertical-align:middle}
.grid{display:flex;flex-wrap:wrap;gap:12px}.row{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}
svg{background:#fff;border:1px solid #e1e4e8;border-radius:6px}
td.kind.rollback,td.kind.anomaly,td.kind.checkpoint_failed{color:#b2182b;font-weight:600}
ul.skipped{font-size:12px;color:#7a4b00}.timeline svg{max-width:100%;height:auto}
.f-tip{position:absolute;display:none;background:#fff;border:1px solid #c9ced4;border-radius:4px;padding:5px 8px;
font-size:12px;box-shadow:0 2px 6px rgba(0,0,0,.12);pointer-events:none;white-space:nowrap}.f-dim{color:#777}
svg .f-rule{stroke:#888;stroke-width:1;stroke-dasharray:2 2}
table.captions td.l{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}mark{background:#fdd;color:#b2182b}
)";

}  // namespace

void check_baseline(const std::vector<RunData>& runs, const Options& o) {
  if (o.baseline.empty()) return;
  std::string labels;
  for (const RunData& r : runs) {
    if (r.label == o.baseline) return;
    labels += (labels.empty() ? "" : ", ") + r.label;
  }
  fail("--baseline {}: not one of the runs ({})", o.baseline, labels);
}

std::string render_html(const std::vector<RunData>& runs, const Options& o) {
  FORGE_CHECK(!runs.empty(), "render_html: no runs");
  check_baseline(runs, o);
  std::string labels;
  for (const RunData& r : runs) labels += (labels.empty() ? "" : ", ") + r.label;
  const std::string title = o.title.empty() ? "forge report: " + labels : o.title;
  nlohmann::json data = nlohmann::json::array();
  for (const RunData& r : runs) {
    nlohmann::json run = {{"label", r.label},
                          {"dir", r.dir.string()},
                          {"lines", r.lines},
                          {"skipped_count", r.skipped_count},
                          {"skipped", r.skipped}};
    nlohmann::json series = nlohmann::json::object();
    for (const auto& [name, points] : r.series) {
      nlohmann::json values = nlohmann::json::array();
      for (const Point& p : downsample(points, o.max_points)) values.push_back({p.step, p.tokens, p.value});
      series[name] = std::move(values);
    }
    run["series"] = std::move(series);
    nlohmann::json events = nlohmann::json::array();
    for (const Event& e : r.events) events.push_back({{"step", e.step}, {"kind", e.kind}});
    run["events"] = std::move(events);
    if (r.load_step >= 0)
      run["expert_load"] = {{"step", r.load_step}, {"layers", r.moe_layers}, {"load", r.load}};
    if (r.captions) run["captions"] = *r.captions;
    data.push_back(std::move(run));
  }
  const std::string summary = summary_table(runs, data);
  std::string legend;
  for (size_t i = 0; i < runs.size(); ++i)
    legend += fmt::format(
        "<span class=\"run\"><span class=\"swatch\" style=\"background:{}\"></span>{} "
        "<span class=\"small\">({})</span></span> &nbsp; ",
        run_color(i), esc(runs[i].label), esc(runs[i].dir.string()));
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));

  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" "
      "content=\"width=device-width, "
      "initial-scale=1\">\n<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n"
      "<main>\n<h1>{}</h1>\n<p class=\"note\">{} &middot; written by forge report {}</p>\n",
      esc(title), std::string(kStyle) + kSvgStyle, esc(title), legend, when);
  // Several runs: what differs between them explains the curves, so it comes first.
  html += "<h2 id=\"summary\">Summary</h2>\n" + summary + (runs.size() > 1 ? settings_table(runs) : "");
  html += "<h2 id=\"curves\">Curves</h2>\n" + curves(runs, o);
  html += events_section(runs);
  html += captions_section(runs);
  html += profile_section(runs, o, data);
  html += pipeline_section(runs);
  html += experts_section(runs);
  if (runs.size() == 1) html += settings_table(runs);
  html += skipped_section(runs);
  // The data, as JSON that cannot end the script element early.
  std::string json =
      nlohmann::json({{"runs", data}}).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  for (size_t at = json.find("</"); at != std::string::npos; at = json.find("</", at + 3))
    json.replace(at, 2, "<\\/");
  html += "<script type=\"application/json\" id=\"forge-report-data\">" + json + "</script>\n";
  html += std::string("<script>") + kScript + "</script>\n";
  html += "</main>\n</body>\n</html>\n";
  return html;
}

std::vector<RunData> read_runs(const std::vector<fs::path>& given) {
  if (given.empty()) fail("forge report: no run directories given");
  // A folder of runs (a sweep, a study) stands for the runs in it, in name order.
  std::vector<fs::path> dirs;
  for (const fs::path& d : given) {
    std::error_code ec;
    std::vector<fs::path> inside;
    if (fs::is_directory(d, ec) && !fs::exists(d / "metrics.jsonl", ec))
      for (const fs::directory_entry& e : fs::directory_iterator(d, ec))
        if (e.is_directory(ec) && fs::exists(e.path() / "metrics.jsonl", ec)) inside.push_back(e.path());
    std::sort(inside.begin(), inside.end());
    if (inside.empty()) inside.push_back(d);
    // A run named twice (on its own and inside its folder) is drawn once, where it came first.
    for (const fs::path& run : inside) {
      const fs::path key = fs::weakly_canonical(run, ec);
      if (std::none_of(dirs.begin(), dirs.end(),
                       [&](const fs::path& o) { return fs::weakly_canonical(o, ec) == key; }))
        dirs.push_back(run);
    }
  }
  std::vector<RunData> runs;
  std::map<std::string, int> seen;
  for (const fs::path& d : dirs) {
    runs.push_back(read_run(d));
    std::string& label = runs.back().label;
    if (seen[label]++ > 0) {
      fs::path full = fs::absolute(d).lexically_normal();
      if (full.filename().empty()) full = full.parent_path();
      label = (full.parent_path().filename() / label).string();
    }
  }
  return runs;
}

void write_report(const std::vector<RunData>& runs, const fs::path& output, const Options& options) {
  write_file_atomically(output, render_html(runs, options), "report");
}

std::vector<fs::path> write_chart_svgs(const std::vector<RunData>& runs, const fs::path& dir,
                                       const Options& options) {
  check_baseline(runs, options);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("{}: cannot create the folder: {}", dir.string(), ec.message());
  std::vector<fs::path> written;
  // Standalone pictures (markdown, slides): the page's chart styles and a legend line of the runs go inside.
  std::string legend;
  for (size_t i = 0; i < runs.size(); ++i)
    legend += fmt::format("<tspan fill=\"{}\">■ {}</tspan>  ", run_color(i), esc(runs[i].label));
  for (auto [id, svg] : curve_charts(runs, options)) {
    // 18 px more at the bottom for the runs' names, below the axis label.
    for (const std::string& from :
         {fmt::format("height=\"{}\"", kH), fmt::format("viewBox=\"0 0 {} {}\"", kW, kH)}) {
      const size_t at = svg.find(from);
      FORGE_CHECK(at != std::string::npos, "chart {}: no {}", id, from);
      const std::string height = std::to_string(static_cast<int>(kH));  // the end of `from`, before its quote
      svg.replace(
          at, from.size(),
          from.substr(0, from.size() - height.size() - 1) + std::to_string(static_cast<int>(kH) + 18) + "\"");
    }
    const size_t body = svg.find(">\n") + 2;
    svg.insert(body, fmt::format("<style>{}</style>\n<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n"
                                 "<text x=\"8\" y=\"{}\" class=\"f-legend\">{}</text>\n",
                                 kSvgStyle, kH + 10, legend));
    svg.insert(0, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    const fs::path path = dir / (id + ".svg");
    write_file_atomically(path, svg, "chart");
    written.push_back(path);
  }
  return written;
}

}  // namespace forge::report
