#include "forge/train/faults.h"

#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "forge/core/error.h"
#include "forge/core/suggest.h"

namespace forge::train {
namespace {

struct KindName {
  FaultKind kind;
  const char* name;
};
constexpr KindName kKinds[] = {{FaultKind::nan_loss, "nan_loss"},
                               {FaultKind::inf_loss, "inf_loss"},
                               {FaultKind::nan_grad, "nan_grad"},
                               {FaultKind::spike, "spike"},
                               {FaultKind::grad_spike, "grad_spike"},
                               {FaultKind::data_error, "data_error"},
                               {FaultKind::throw_exception, "throw"},
                               {FaultKind::kill, "kill"},
                               {FaultKind::hang, "hang"},
                               {FaultKind::disk_full, "disk_full"},
                               {FaultKind::corrupt_checkpoint, "corrupt_checkpoint"},
                               {FaultKind::truncate_checkpoint, "truncate_checkpoint"}};

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n' || s.front() == '\r'))
    s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, auto is_separator) {
  std::vector<std::string_view> out;
  size_t begin = 0;
  for (size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || is_separator(s[i])) {
      if (std::string_view part = trim(s.substr(begin, i - begin)); !part.empty()) out.push_back(part);
      begin = i + 1;
    }
  return out;
}

bool is_checkpoint_fault(FaultKind k) {
  return k == FaultKind::corrupt_checkpoint || k == FaultKind::truncate_checkpoint;
}

}  // namespace

const char* FaultPlan::name(FaultKind kind) {
  for (const KindName& k : kKinds)
    if (k.kind == kind) return k.name;
  return "?";
}

FaultPlan FaultPlan::parse(std::string_view text, std::string_view origin) {
  FaultPlan plan;
  int index = 0;
  for (std::string_view item : split(text, [](char c) { return c == ';'; })) {
    ++index;
    const std::vector<std::string_view> words = split(item, [](char c) { return c == ' ' || c == '\t'; });
    const std::string where = fmt::format("{}: fault {} '{}'", origin, index, item);
    Fault f;
    bool known = false;
    std::vector<std::string_view> names;
    for (const KindName& k : kKinds) {
      names.push_back(k.name);
      if (words[0] == k.name) f.kind = k.kind, known = true;
    }
    if (!known) {
      const std::string hint = did_you_mean(words[0], names);
      fail(
          "{}: unknown kind '{}'{}; the kinds are nan_loss, inf_loss, nan_grad, spike, grad_spike, "
          "data_error, throw, kill, hang, disk_full, corrupt_checkpoint, truncate_checkpoint",
          where, words[0], hint);
    }
    if (is_checkpoint_fault(f.kind)) f.rank = 0;
    bool has_step = false;
    for (size_t w = 1; w < words.size(); ++w) {
      const size_t eq = words[w].find('=');
      if (eq == std::string_view::npos) fail("{}: '{}' is not key=value", where, words[w]);
      const std::string_view key = words[w].substr(0, eq), value = words[w].substr(eq + 1);
      auto integer = [&](int64_t lowest) {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
        if (ec != std::errc() || end != value.data() + value.size() || v < lowest)
          fail("{}: {} = '{}' is not an integer >= {}", where, key, value, lowest);
        return v;
      };
      if (key == "step") {
        f.step = integer(1), has_step = true;
      } else if (key == "rank") {
        f.rank = static_cast<int>(integer(0));
      } else if (key == "times") {
        f.times = integer(0);
      } else if (key == "attempt") {
        f.attempt = value == "any" ? -1 : static_cast<int>(integer(0));
      } else if (key == "factor") {
        char* end = nullptr;
        const std::string v(value);
        f.factor = std::strtod(v.c_str(), &end);
        if (v.empty() || *end != '\0' || !(f.factor > 0))
          fail("{}: factor = '{}' is not a number > 0", where, value);
      } else {
        fail("{}: unknown key '{}' (step, rank, times, factor, attempt)", where, key);
      }
    }
    if (!has_step) fail("{}: step=<k> is missing (the 1-based step the fault strikes)", where);
    plan.faults_.push_back(f);
  }
  return plan;
}

FaultPlan FaultPlan::for_run(const std::string& inject, std::string_view inject_origin) {
  FaultPlan plan = parse(inject, inject_origin);
  if (const char* env = std::getenv("FORGE_FAULT"); env && *env) {
    FaultPlan more = parse(env, "FORGE_FAULT");
    plan.faults_.insert(plan.faults_.end(), more.faults_.begin(), more.faults_.end());
  }
  if (const char* attempt = std::getenv("FORGE_LAUNCH_ATTEMPT"); attempt && *attempt)
    plan.attempt_ = std::atoi(attempt);
  return plan;
}

const Fault* FaultPlan::take(FaultKind kind, int64_t step, int rank) {
  for (Fault& f : faults_) {
    if (f.kind != kind || f.step != step || (f.rank >= 0 && f.rank != rank)) continue;
    if (f.attempt >= 0 && f.attempt != attempt_) continue;
    if (f.times > 0 && f.fired >= f.times) continue;
    ++f.fired;
    return &f;
  }
  return nullptr;
}

std::string FaultPlan::describe(const Fault& f) {
  std::string text = fmt::format("{} at step {}", name(f.kind), f.step);
  if (f.rank >= 0) text += fmt::format(" on rank {}", f.rank);
  return text;
}

void corrupt_file(const std::string& file, bool truncate) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  if (ec || size == 0) fail("fault injection: cannot damage {}: {}", file, ec ? ec.message() : "it is empty");
  if (truncate) {
    fs::resize_file(file, size / 2, ec);
    if (ec) fail("fault injection: cannot truncate {}: {}", file, ec.message());
    return;
  }
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  // Past the safetensors header, in the tensor data: the file still parses, only its checksum tells.
  const std::streamoff at = static_cast<std::streamoff>(size - size / 4);
  f.seekg(at);
  char byte = 0;
  f.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x10);
  f.seekp(at);
  f.write(&byte, 1);
  if (!f) fail("fault injection: cannot flip a byte of {}", file);
}

}  // namespace forge::train
