#include "forge/sim/hardware.h"

#include <fmt/format.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

#include "forge/core/error.h"
#include "forge/core/file_io.h"

namespace forge::sim {
namespace {

// A table's keys, each read at most once; leftover keys are errors (a misspelt key must not be ignored).
class Fields {
 public:
  Fields(const toml::table& table, std::string where, std::string source)
      : table_(table), where_(std::move(where)), source_(std::move(source)) {}
  ~Fields() noexcept(false) {
    if (std::uncaught_exceptions() > 0) return;
    for (const auto& [key, value] : table_)
      if (!seen_.count(std::string(key.str())))
        fail("{}: unknown key '{}{}'", source_, where_.empty() ? "" : where_ + ".", key.str());
  }
  double number(const std::string& key, double fallback, double low, double high, bool required = false) {
    seen_.insert(key);
    const toml::node* n = table_.get(key);
    if (!n) {
      if (required) fail("{}: missing key '{}'", source_, name(key));
      return fallback;
    }
    std::optional<double> v = n->value<double>();
    if (!v || !std::isfinite(*v) || *v < low || *v > high)
      fail("{}: '{}' must be a number in [{}, {}]", source_, name(key), low, high);
    return *v;
  }
  std::string text(const std::string& key, const std::string& fallback, bool required = false) {
    seen_.insert(key);
    const toml::node* n = table_.get(key);
    if (!n) {
      if (required) fail("{}: missing key '{}'", source_, name(key));
      return fallback;
    }
    std::optional<std::string> v = n->value<std::string>();
    if (!v) fail("{}: '{}' must be a string", source_, name(key));
    return *v;
  }
  const toml::node* raw(const std::string& key) {
    seen_.insert(key);
    return table_.get(key);
  }
  std::string name(const std::string& key) const { return where_.empty() ? key : where_ + "." + key; }

 private:
  const toml::table& table_;
  std::string where_, source_;
  std::set<std::string> seen_;
};

toml::table parse_toml(const std::string& text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    fail("{}:{}: {}", source, e.source().begin.line, e.description());
  }
}

const toml::table* sub_table(Fields& fields, const std::string& key, const std::string& source) {
  const toml::node* n = fields.raw(key);
  if (!n) return nullptr;
  if (!n->is_table()) fail("{}: '{}' must be a table", source, fields.name(key));
  return n->as_table();
}

Link read_link(const toml::table& t, const std::string& where, const std::string& source, Link fallback) {
  Fields f(t, where, source);
  fallback.bandwidth_gbs = f.number("bandwidth_gbs", fallback.bandwidth_gbs, 1e-6, 1e6);
  fallback.latency_us = f.number("latency_us", fallback.latency_us, 0, 1e6);
  fallback.async_bandwidth_gbs = f.number("async_bandwidth_gbs", fallback.async_bandwidth_gbs, 0, 1e6);
  fallback.host_share = f.number("host_share", fallback.host_share, 0, 1);
  return fallback;
}

void read_links(Fields& top, const std::string& source, Link& node, Link& network) {
  if (const toml::table* links = sub_table(top, "link", source)) {
    Fields f(*links, "link", source);
    if (const toml::table* t = sub_table(f, "node", source)) node = read_link(*t, "link.node", source, node);
    if (const toml::table* t = sub_table(f, "network", source))
      network = read_link(*t, "link.network", source, network);
  }
}

// Which peak a row's detail names: its first word is the operand type ("bf16 NT ...", "fp8_e4m3x...").
double peak_tflops(const HardwareProfile& h, const ops::OpProfileRow& row) {
  if (row.op.rfind("attention", 0) == 0) return h.bf16_tflops * h.attention_efficiency;
  if (row.detail.rfind("fp8", 0) == 0) return h.fp8_tflops > 0 ? h.fp8_tflops : h.bf16_tflops;
  if (row.detail.rfind("f32", 0) == 0 || row.detail.rfind("fp32", 0) == 0) return h.fp32_tflops;
  return h.bf16_tflops;
}

}  // namespace

double HardwareProfile::efficiency(double flops_per_call) const {
  if (gemm_efficiency.empty()) return 1.0;
  const double x = std::log10(std::max(flops_per_call, 1.0));
  if (x <= gemm_efficiency.front().first) return gemm_efficiency.front().second;
  if (x >= gemm_efficiency.back().first) return gemm_efficiency.back().second;
  for (size_t i = 1; i < gemm_efficiency.size(); ++i)
    if (x <= gemm_efficiency[i].first) {
      const auto [x0, y0] = gemm_efficiency[i - 1];
      const auto [x1, y1] = gemm_efficiency[i];
      return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
    }
  return gemm_efficiency.back().second;
}

double HardwareProfile::row_seconds(const ops::OpProfileRow& row) const {
  if (row.calls <= 0) return 0;
  const double calls = static_cast<double>(row.calls);
  if (auto it = measured.find(row.op + "|" + row.detail); it != measured.end())
    return calls * (it->second + op_overhead_us * 1e-6);
  const double overhead = op_overhead_us * 1e-6;
  const double memory = memory_bandwidth_gbs > 0 ? row.bytes / calls / (memory_bandwidth_gbs * 1e9) : 0;
  if (row.flops <= 0) return calls * (memory + overhead);
  const double per_call = row.flops / calls;
  const bool attention = row.op.rfind("attention", 0) == 0;
  const double rate = peak_tflops(*this, row) * 1e12 * (attention ? 1.0 : efficiency(per_call));
  return calls * (std::max(rate > 0 ? per_call / rate : 0, memory) + overhead);
}

double HardwareProfile::rows_seconds(const std::vector<ops::OpProfileRow>& rows) const {
  double total = 0;
  for (const auto& r : rows) total += row_seconds(r);
  return total;
}

HardwareProfile HardwareProfile::parse(const std::string& text, const std::string& source) {
  const toml::table doc = parse_toml(text, source);
  HardwareProfile h;
  h.source = source;
  Fields top(doc, "", source);
  const toml::table* hw = sub_table(top, "hardware", source);
  if (!hw) fail("{}: missing table [hardware]", source);
  {
    Fields f(*hw, "hardware", source);
    h.name = f.text("name", "", true);
    h.kind = f.text("kind", "published");
    if (h.kind != "published" && h.kind != "measured")
      fail("{}: 'hardware.kind' must be \"published\" or \"measured\", got \"{}\"", source, h.kind);
    h.notes = f.text("notes", "");
    h.threads = static_cast<int>(f.number("threads", 0, 0, 4096));
    h.memory_gib = f.number("memory_gib", 0, 1e-3, 1e6, true);
    h.bf16_tflops = f.number("bf16_tflops", 0, 1e-6, 1e6, true);
    h.fp32_tflops = f.number("fp32_tflops", h.bf16_tflops, 1e-6, 1e6);
    h.fp8_tflops = f.number("fp8_tflops", h.bf16_tflops, 1e-6, 1e6);
    h.attention_efficiency = f.number("attention_efficiency", 0.5, 1e-4, 1);
    h.memory_bandwidth_gbs = f.number("memory_bandwidth_gbs", 0, 1e-3, 1e6, true);
    h.op_overhead_us = f.number("op_overhead_us", 0, 0, 1e6);
    h.host_link_gbs = f.number("host_link_gbs", 0, 0, 1e6);
    h.host_memory_bandwidth_gbs = f.number("host_memory_bandwidth_gbs", 0, 0, 1e6);
    h.host_memory_gib = f.number("host_memory_gib", 0, 0, 1e9);
    if ((h.host_link_gbs > 0) != (h.host_memory_bandwidth_gbs > 0) ||
        (h.host_link_gbs > 0) != (h.host_memory_gib > 0))
      fail(
          "{}: 'hardware.host_link_gbs', 'host_memory_bandwidth_gbs' and 'host_memory_gib' describe the host "
          "behind each device together: give all three or none",
          source);
    if (const toml::node* n = f.raw("gemm_efficiency")) {
      const toml::array* a = n->as_array();
      if (!a)
        fail("{}: 'hardware.gemm_efficiency' must be an array of [log10 FLOPs, fraction] pairs", source);
      for (const toml::node& e : *a) {
        const toml::array* pair = e.as_array();
        std::optional<double> x = pair && pair->size() == 2 ? (*pair)[0].value<double>() : std::nullopt;
        std::optional<double> y = pair && pair->size() == 2 ? (*pair)[1].value<double>() : std::nullopt;
        if (!x || !y || *y <= 0 || *y > 1 ||
            (!h.gemm_efficiency.empty() && *x <= h.gemm_efficiency.back().first))
          fail(
              "{}: 'hardware.gemm_efficiency' must be [log10 FLOPs, fraction in (0, 1]] pairs in increasing "
              "FLOPs",
              source);
        h.gemm_efficiency.push_back({*x, *y});
      }
    }
  }
  read_links(top, source, h.node, h.network);
  if (h.node.bandwidth_gbs <= 0) fail("{}: missing key 'link.node.bandwidth_gbs'", source);
  if (h.network.bandwidth_gbs <= 0) h.network = h.node;
  if (const toml::table* m = sub_table(top, "measured", source))
    for (const auto& [key, value] : *m) {
      std::optional<double> v = value.value<double>();
      if (!v || *v < 0 || !std::isfinite(*v))
        fail("{}: measured '{}' must be seconds per call (a number >= 0)", source, key.str());
      h.measured[std::string(key.str())] = *v;
    }
  return h;
}

HardwareProfile HardwareProfile::read(const std::string& path) {
  return parse(read_file(path, "hardware profile"), path);
}

std::string HardwareProfile::to_toml() const {
  std::ostringstream out;
  out << "# forge hardware profile (docs/simulator.md)\n[hardware]\n";
  out << "name = " << toml::value<std::string>(name) << "\n";
  out << "kind = " << toml::value<std::string>(kind) << "\n";
  if (!notes.empty()) out << "notes = " << toml::value<std::string>(notes) << "\n";
  if (threads > 0) out << "threads = " << threads << "\n";
  out << fmt::format("memory_gib = {:.6g}\nbf16_tflops = {:.6g}\nfp32_tflops = {:.6g}\nfp8_tflops = {:.6g}\n",
                     memory_gib, bf16_tflops, fp32_tflops, fp8_tflops);
  out << "gemm_efficiency = [";
  for (size_t i = 0; i < gemm_efficiency.size(); ++i)
    out << fmt::format("{}[{:.3f}, {:.4f}]", i ? ", " : "", gemm_efficiency[i].first,
                       gemm_efficiency[i].second);
  out << "]\n";
  out << fmt::format(
      "attention_efficiency = {:.6g}\nmemory_bandwidth_gbs = {:.6g}\nop_overhead_us = {:.6g}\n",
      attention_efficiency, memory_bandwidth_gbs, op_overhead_us);
  if (host_link_gbs > 0)
    out << fmt::format(
        "host_link_gbs = {:.6g}\nhost_memory_bandwidth_gbs = {:.6g}\nhost_memory_gib = {:.6g}\n",
        host_link_gbs, host_memory_bandwidth_gbs, host_memory_gib);
  auto link = [&](const char* name, const Link& l) {
    out << fmt::format("\n[link.{}]\nbandwidth_gbs = {:.6g}\nlatency_us = {:.6g}\n", name, l.bandwidth_gbs,
                       l.latency_us);
    if (l.async_bandwidth_gbs > 0)
      out << fmt::format("async_bandwidth_gbs = {:.6g}\n", l.async_bandwidth_gbs);
    if (l.host_share > 0) out << fmt::format("host_share = {:.4g}\n", l.host_share);
  };
  link("node", node);
  link("network", network);
  if (!measured.empty()) {
    out << "\n# seconds per call of each op at each shape, measured with forge's kernels\n[measured]\n";
    for (const auto& [key, seconds] : measured)
      out << toml::value<std::string>(key) << " = " << fmt::format("{:.6e}", seconds) << "\n";
  }
  return out.str();
}

std::string resolve_profile(const std::string& name) {
  if (name.find('/') != std::string::npos || name.find('.') != std::string::npos) return name;
  // The working directory's configs/, else the source tree's of this binary (build/bin/forge).
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  for (const std::filesystem::path& base :
       {std::filesystem::path("configs/hardware"),
        exe.parent_path().parent_path().parent_path() / "configs/hardware"}) {
    const std::filesystem::path p = base / (name + ".toml");
    if (std::filesystem::exists(p)) return p.string();
  }
  fail("hardware '{}': no such shipped profile (configs/hardware/{}.toml); give a profile file's path", name,
       name);
}

const Link& Cluster::link(const std::vector<int>& ranks) const {
  if (ranks.empty()) return hardware.node;
  const auto [low, high] = std::minmax_element(ranks.begin(), ranks.end());
  return *low / devices_per_node == *high / devices_per_node ? hardware.node : hardware.network;
}

Cluster Cluster::parse(const std::string& text, const std::string& source) {
  const toml::table doc = parse_toml(text, source);
  Fields top(doc, "", source);
  const toml::table* c = sub_table(top, "cluster", source);
  if (!c) fail("{}: missing table [cluster]", source);
  Cluster cluster;
  cluster.source = source;
  std::string hardware;
  {
    Fields f(*c, "cluster", source);
    hardware = f.text("hardware", "", true);
    cluster.devices_per_node = static_cast<int>(f.number("devices_per_node", 8, 1, 1024));
    cluster.nodes = static_cast<int>(f.number("nodes", 1, 1, 1e6));
  }
  std::string path = resolve_profile(hardware);
  if (std::filesystem::path(path).is_relative() && !std::filesystem::exists(path))
    path = (std::filesystem::path(source).parent_path() / path).string();
  cluster.hardware = HardwareProfile::read(path);
  read_links(top, source, cluster.hardware.node, cluster.hardware.network);
  return cluster;
}

Cluster Cluster::read(const std::string& path) { return parse(read_file(path, "cluster description"), path); }

Cluster Cluster::single_node(HardwareProfile hardware, int devices) {
  Cluster c;
  c.hardware = std::move(hardware);
  c.devices_per_node = std::max(1, devices), c.nodes = 1;
  c.source = "<one node>";
  return c;
}

double comm_seconds(const CommEvent& e, const Link& link) {
  const double n = e.group_size, bytes = static_cast<double>(e.bytes);
  if (n <= 1) return 0;
  const double bw = (!e.blocking && link.async_bandwidth_gbs > 0 ? link.async_bandwidth_gbs
                                                                 : link.bandwidth_gbs) *
                    1e9,
               lat = link.latency_us * 1e-6;
  if (e.op == "all_reduce") return 2 * (n - 1) / n * bytes / bw + 2 * (n - 1) * lat;
  if (e.op == "all_gather") return (n - 1) * bytes / bw + (n - 1) * lat;
  if (e.op == "reduce_scatter" || e.op == "all_to_all") return (n - 1) / n * bytes / bw + (n - 1) * lat;
  if (e.op == "send" || e.op == "broadcast") return bytes / bw + lat;
  if (e.op == "recv") return 0;  // the sender's cost
  if (e.op == "barrier") return 2 * std::log2(n) * lat;
  return bytes / bw + lat;
}

}  // namespace forge::sim
