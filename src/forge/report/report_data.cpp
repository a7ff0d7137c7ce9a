// forge report: reading a run directory into curves, events and heat maps (report.h).
#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "forge/core/error.h"
#include "forge/report/report.h"

namespace forge::report {

namespace fs = std::filesystem;

namespace {

// A JSON value as it appears in a note, cut short.
std::string shown(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

class Reader {
 public:
  explicit Reader(RunData& run) : run_(run) {}

  void skip(std::string note) {
    if (run_.skipped.size() < RunData::kMaxSkipNotes) run_.skipped.push_back(std::move(note));
    ++run_.skipped_count;
  }

  void line(const std::string& text, int64_t number, bool last_without_newline) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) return;
    nlohmann::json record = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded()) {
      skip(fmt::format("metrics.jsonl line {}: not valid JSON{}", number,
                       last_without_newline ? " (a half-written last line, as a killed run leaves)" : ""));
      return;
    }
    if (!record.is_object()) {
      skip(fmt::format("metrics.jsonl line {}: not a JSON object: {}", number, shown(record)));
      return;
    }
    const auto step_it = record.find("step");
    const bool has_step = step_it != record.end() && step_it->is_number_integer();
    if (record.contains("event")) {
      event(record, has_step ? step_it->get<int64_t>() : -1);
      return;
    }
    if (!has_step) {
      skip(fmt::format("metrics.jsonl line {}: no integer \"step\"{}", number,
                       step_it == record.end() ? "" : ": " + shown(*step_it)));
      return;
    }
    const int64_t step = step_it->get<int64_t>();
    if (record.contains("eval_loss")) {
      values(record, "", step, number);
      return;
    }
    // The tokens of a training record: its own, else as many per step as the last record had.
    if (const auto t = record.find("tokens"); t != record.end() && t->is_number() && step > 0)
      tokens_per_step_ = t->get<double>() / static_cast<double>(step);
    values(record, "", step, number);
    moe_layers(record, step, number);
  }

  void event(const nlohmann::json& record, int64_t step) {
    Event e;
    e.step = step;
    e.kind = record["event"].is_string() ? record["event"].get<std::string>() : shown(record["event"]);
    std::string text;
    if (e.kind == "captions") run_.captions = record;  // its examples go to their own section
    for (const auto& [key, value] : record.items()) {
      if (key == "event" || key == "step" || (e.kind == "captions" && key == "examples")) continue;
      text += fmt::format("{}{} {}", text.empty() ? "" : ", ", key,
                          value.is_string() ? value.get<std::string>() : shown(value));
    }
    e.text = std::move(text);
    // A rollback restores an earlier step: the curves continue from there, the abandoned points go.
    if (e.kind == "rollback")
      if (const auto r = record.find("restored_step"); r != record.end() && r->is_number_integer())
        truncate_after(r->get<int64_t>());
    run_.events.push_back(std::move(e));
  }

  void truncate_after(int64_t step) {
    for (auto& [name, points] : run_.series)
      while (!points.empty() && points.back().step > static_cast<double>(step)) points.pop_back();
    while (!run_.violation_steps.empty() && run_.violation_steps.back() > step) {
      run_.violation_steps.pop_back();
      run_.violation.pop_back();
    }
  }

  void add(const std::string& name, int64_t step, double value) {
    std::vector<Point>& points = run_.series[name];
    const double x = static_cast<double>(step);
    while (!points.empty() && points.back().step >= x) points.pop_back();  // a repeated or earlier step
    points.push_back({x, x * tokens_per_step_, value});
  }

  // Every number of the record (nested objects flattened with dots; arrays of objects with a "depth" by it:
  // mtp.1.loss) becomes a point of its curve. A null (NaN or infinity as written) or a string where the
  // record's own fields hold numbers is skipped with a note.
  void values(const nlohmann::json& object, const std::string& prefix, int64_t step, int64_t number) {
    for (const auto& [key, value] : object.items()) {
      if (prefix.empty() && (key == "step" || key == "final" || key == "tokens")) continue;
      const std::string name = prefix + key;
      if (value.is_number()) {
        add(name, step, value.get<double>());
      } else if (value.is_object()) {
        values(value, name + ".", step, number);
      } else if (value.is_array()) {
        if (name == "moe.layers") continue;  // moe_layers()
        for (const nlohmann::json& item : value)
          if (item.is_object() && item.contains("depth") && item["depth"].is_number_integer())
            values(item, fmt::format("{}.{}.", name, item["depth"].get<int64_t>()), step, number);
      } else if (value.is_null()) {
        skip(fmt::format("metrics.jsonl line {}: \"{}\" is null (a NaN or infinity) at step {}", number, name,
                         step));
      } else if (!value.is_boolean()) {
        skip(fmt::format("metrics.jsonl line {}: \"{}\" is not a number: {}", number, name, shown(value)));
      }
    }
  }

  // moe.layers: each layer's max_violation (the layers x steps heat map) and, where present, its per-expert
  // loads (the layers x experts heat map of the latest such step).
  void moe_layers(const nlohmann::json& record, int64_t step, int64_t number) {
    const auto moe = record.find("moe");
    if (moe == record.end() || !moe->is_object()) return;
    const auto layers = moe->find("layers");
    if (layers == moe->end() || !layers->is_array() || layers->empty()) return;
    std::vector<int64_t> ids;
    std::vector<double> violation;
    std::vector<std::vector<double>> load;
    bool with_load = true;
    for (const nlohmann::json& layer : *layers) {
      const auto id = layer.find("layer"), v = layer.find("max_violation");
      if (!layer.is_object() || id == layer.end() || !id->is_number_integer() || v == layer.end() ||
          !v->is_number()) {
        skip(
            fmt::format("metrics.jsonl line {}: a moe.layers entry without an integer \"layer\" and a "
                        "numeric \"max_violation\": {}",
                        number, shown(layer)));
        return;
      }
      ids.push_back(id->get<int64_t>());
      violation.push_back(v->get<double>());
      std::vector<double> experts;
      if (const auto l = layer.find("load"); l != layer.end() && l->is_array()) {
        for (const nlohmann::json& x : *l) {
          if (!x.is_number()) {
            skip(fmt::format("metrics.jsonl line {}: layer {} has a load that is not a number: {}", number,
                             ids.back(), shown(x)));
            experts.clear();
            break;
          }
          experts.push_back(x.get<double>());
        }
      }
      with_load = with_load && !experts.empty();
      load.push_back(std::move(experts));
    }
    if (!run_.moe_layers.empty() && run_.moe_layers != ids) {
      skip(fmt::format("metrics.jsonl line {}: MoE layers {} differ from the earlier records'", number,
                       ids.size()));
      return;
    }
    run_.moe_layers = ids;
    while (!run_.violation_steps.empty() && run_.violation_steps.back() >= step) {
      run_.violation_steps.pop_back();
      run_.violation.pop_back();
    }
    run_.violation_steps.push_back(step);
    run_.violation.push_back(std::move(violation));
    if (with_load) run_.load_step = step, run_.load = std::move(load);
  }

 private:
  RunData& run_;
  double tokens_per_step_ = 0;
};

std::optional<nlohmann::json> read_json_file(const fs::path& path, RunData& run) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  nlohmann::json value = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded() || !value.is_object()) {
    Reader(run).skip(fmt::format("{}: not a valid JSON object, left out", path.filename().string()));
    return std::nullopt;
  }
  return value;
}

void flatten(const toml::table& table, const std::string& prefix, std::map<std::string, std::string>& out) {
  for (const auto& [key, node] : table) {
    const std::string name = prefix + std::string(key.str());
    if (const toml::table* sub = node.as_table()) {
      flatten(*sub, name + ".", out);
    } else if (const auto* s = node.as_string()) {
      out[name] = s->get();
    } else if (const auto* f = node.as_floating_point()) {
      out[name] = fmt::format("{}", f->get());  // the shortest text that reads back the same
    } else {
      std::ostringstream text;
      node.visit([&](const auto& value) { text << value; });
      out[name] = text.str();
    }
  }
}

}  // namespace

RunData read_run(const fs::path& dir) {
  RunData run;
  run.dir = dir;
  fs::path name = fs::absolute(dir).lexically_normal();
  if (name.filename().empty()) name = name.parent_path();
  run.label = name.filename().string();
  const fs::path metrics = dir / "metrics.jsonl";
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail("{}: not a directory (forge report takes run directories)", dir.string());
  std::ifstream in(metrics, std::ios::binary);
  if (!in) fail("{}: no readable metrics.jsonl (not a forge run directory?)", dir.string());
  Reader reader(run);
  std::string text;
  int64_t number = 0;
  while (std::getline(in, text)) {
    ++number;
    reader.line(text, number, in.eof());
  }
  run.lines = number;
  run.profile = read_json_file(dir / "profile.json", run);
  run.pipeline_trace = read_json_file(dir / "pipeline_trace.json", run);
  if (fs::exists(dir / "config.toml", ec)) {
    try {
      flatten(toml::parse_file((dir / "config.toml").string()), "", run.settings);
    } catch (const toml::parse_error& e) {
      reader.skip(fmt::format("config.toml: not valid TOML ({}), settings left out", e.description()));
    }
  }
  return run;
}

std::vector<Point> downsample(const std::vector<Point>& points, size_t max_points) {
  FORGE_CHECK(max_points >= 8, "downsample: max_points = {} (at least 8)", max_points);
  if (points.size() <= max_points) return points;
  const size_t buckets = max_points / 4;
  const double first = points.front().step, span = points.back().step - first;
  std::vector<Point> out;
  out.reserve(max_points);
  size_t i = 0;
  for (size_t b = 0; b < buckets && i < points.size(); ++b) {
    const double end = b + 1 == buckets ? INFINITY : first + span * static_cast<double>(b + 1) / buckets;
    const size_t begin = i;
    size_t lo = i, hi = i;
    for (; i < points.size() && points[i].step < end; ++i) {
      if (points[i].value < points[lo].value) lo = i;
      if (points[i].value > points[hi].value) hi = i;
    }
    if (i == begin) continue;
    size_t keep[4] = {begin, lo, hi, i - 1};
    std::sort(keep, keep + 4);
    for (int k = 0; k < 4; ++k)
      if (k == 0 || keep[k] != keep[k - 1]) out.push_back(points[keep[k]]);
  }
  return out;
}

}  // namespace forge::report
