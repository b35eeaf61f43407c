#include "sim/cluster.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <set>
#include <sstream>

#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "sim/presets_data.h"
#include "sim/units.h"
#include "sim/workload.h"

namespace conduit::sim {
namespace {

// `field` names the map (with the file in front, e.g. "a.yaml: nodes[0]").
YAML::Node require(const YAML::Node& parent, const char* key, const std::string& field) {
  YAML::Node n = parent[key];
  if (!n) throw ConfigError(fmt::format("{}.{} is missing", field, key));
  return n;
}

// `n` is a map whose keys are all in `allowed`, each once: a misspelt key would otherwise leave its default in
// place without a word.
void check_map(const YAML::Node& n, const std::string& field, std::initializer_list<const char*> allowed) {
  std::string names;
  for (const char* a : allowed) names += (names.empty() ? "" : ", ") + std::string(a);
  if (!n || !n.IsMap()) throw ConfigError(fmt::format("{} must be a map with {}", field, names));
  std::set<std::string> seen;
  for (const auto& kv : n) {
    std::string key;
    try {
      key = kv.first.as<std::string>();
    } catch (const YAML::Exception&) {
      throw ConfigError(fmt::format("{}: a key is not a string (allowed keys: {})", field, names));
    }
    if (std::find_if(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; }) == allowed.end())
      throw ConfigError(fmt::format("{}: unknown key '{}' (allowed: {})", field, key, names));
    if (!seen.insert(key).second) throw ConfigError(fmt::format("{}: key '{}' is given twice", field, key));
  }
}

std::string get_string(const YAML::Node& n, const std::string& field) {
  // (an empty value is a null node, which yaml-cpp reads as the text "null": a file with `name:` ran as "null")
  if (!n.IsScalar()) throw ConfigError(fmt::format("{} must be a string; allowed: a non-empty value", field));
  try {
    return n.as<std::string>();
  } catch (const YAML::Exception&) {
    throw ConfigError(fmt::format("{} must be a string", field));
  }
}

double get_number(const YAML::Node& n, const std::string& field, double lo, double hi) {
  double v;
  try {
    v = n.as<double>();
  } catch (const YAML::Exception&) {
    throw ConfigError(fmt::format("{} must be a number in [{}, {}]", field, lo, hi));
  }
  if (!(v >= lo && v <= hi)) throw ConfigError(fmt::format("{} = {} is out of range [{}, {}]", field, v, lo, hi));
  return v;
}

int get_int(const YAML::Node& n, const std::string& field, int lo, int hi) {
  double v = get_number(n, field, lo, hi);
  if (v != static_cast<int>(v)) throw ConfigError(fmt::format("{} = {} must be an integer", field, v));
  return static_cast<int>(v);
}

LinkSpec parse_link(const YAML::Node& n, const std::string& field, bool with_kind = false) {
  if (with_kind)
    check_map(n, field, {"kind", "bandwidth", "latency"});
  else
    check_map(n, field, {"bandwidth", "latency"});
  LinkSpec l;
  if (!n["bandwidth"]) throw ConfigError(fmt::format("{}.bandwidth is missing (e.g. 200 Gb/s)", field));
  if (!n["latency"]) throw ConfigError(fmt::format("{}.latency is missing (e.g. 2 us)", field));
  l.bandwidth = parse_bandwidth(get_string(n["bandwidth"], field + ".bandwidth"), field + ".bandwidth");
  l.latency = parse_duration(get_string(n["latency"], field + ".latency"), field + ".latency");
  if (l.bandwidth <= 0) throw ConfigError(fmt::format("{}.bandwidth must be positive", field));
  return l;
}

// A required duration ("12 ms", "350 us") under `key` of a calibration record at `fi`, positive.
double positive_duration(const YAML::Node& record, const char* key, const std::string& fi) {
  const std::string fk = fi + "." + key;
  double t = parse_duration(get_string(require(record, key, fi), fk), fk);
  if (!(t > 0)) throw ConfigError(fmt::format("{} must be positive", fk));
  return t;
}

Accelerator parse_accelerator(const YAML::Node& n, const std::string& f) {
  check_map(n, f,
            {"name", "peak_bf16", "peak_fp32", "memory", "memory_bandwidth", "sm_count", "comm_sms", "gemm_tile",
             "gemm_efficiency", "memory_efficiency", "kernel_overhead", "calibration", "conv_calibration",
             "pool_calibration", "model_calibration", "attention_calibration"});
  Accelerator a;
  auto req = [&](const char* k) {
    if (!n[k]) throw ConfigError(fmt::format("{}.{} is missing", f, k));
    return n[k];
  };
  a.name = n["name"] ? get_string(n["name"], f + ".name") : "accelerator";
  a.peak_flops = parse_flops(get_string(req("peak_bf16"), f + ".peak_bf16"), f + ".peak_bf16");
  a.peak_flops_fp32 =
      n["peak_fp32"] ? parse_flops(get_string(n["peak_fp32"], f + ".peak_fp32"), f + ".peak_fp32") : a.peak_flops / 16;
  a.memory_bytes = parse_size(get_string(req("memory"), f + ".memory"), f + ".memory");
  a.memory_bandwidth =
      parse_bandwidth(get_string(req("memory_bandwidth"), f + ".memory_bandwidth"), f + ".memory_bandwidth");
  if (a.peak_flops <= 0 || a.peak_flops_fp32 <= 0 || a.memory_bytes <= 0 || a.memory_bandwidth <= 0)
    throw ConfigError(fmt::format("{}: peak_bf16, peak_fp32, memory and memory_bandwidth must be positive", f));
  if (n["sm_count"]) a.sm_count = get_int(n["sm_count"], f + ".sm_count", 1, 100000);
  if (n["comm_sms"]) {
    a.comm_sms = get_int(n["comm_sms"], f + ".comm_sms", 0, 100000);
    if (a.comm_sms >= a.sm_count)
      throw ConfigError(fmt::format("{}.comm_sms = {} must be below sm_count = {} (allowed: 0 to {})", f, a.comm_sms,
                                    a.sm_count, a.sm_count - 1));
  }
  if (n["gemm_tile"]) {
    auto t = n["gemm_tile"];
    if (!t.IsSequence() || t.size() != 2) throw ConfigError(fmt::format("{}.gemm_tile must be [M, N]", f));
    a.tile_m = get_int(t[0], f + ".gemm_tile[0]", 1, 4096);
    a.tile_n = get_int(t[1], f + ".gemm_tile[1]", 1, 4096);
  }
  if (n["gemm_efficiency"]) a.gemm_efficiency = get_number(n["gemm_efficiency"], f + ".gemm_efficiency", 0.01, 1);
  if (n["memory_efficiency"])
    a.memory_efficiency = get_number(n["memory_efficiency"], f + ".memory_efficiency", 0.01, 1);
  if (n["kernel_overhead"])
    a.kernel_overhead =
        parse_duration(get_string(n["kernel_overhead"], f + ".kernel_overhead"), f + ".kernel_overhead");
  if (auto c = n["calibration"]) {
    if (!c.IsSequence()) throw ConfigError(fmt::format("{}.calibration must be a list of {{m, n, k, achieved}}", f));
    for (size_t i = 0; i < c.size(); ++i) {
      std::string fi = fmt::format("{}.calibration[{}]", f, i);
      check_map(c[i], fi, {"m", "n", "k", "achieved"});
      GemmSample s;
      s.m = get_number(require(c[i], "m", fi), fi + ".m", 1, kMaxCalibratedDim);
      s.n = get_number(require(c[i], "n", fi), fi + ".n", 1, kMaxCalibratedDim);
      s.k = get_number(require(c[i], "k", fi), fi + ".k", 1, kMaxCalibratedDim);
      s.flops = parse_flops(get_string(require(c[i], "achieved", fi), fi + ".achieved"), fi + ".achieved");
      if (s.flops <= 0) throw ConfigError(fmt::format("{}.achieved must be positive", fi));
      if (s.flops > a.peak_flops * (1 + 1e-9))
        throw ConfigError(
            fmt::format("{}.achieved ({:.4g} TFLOP/s) is above the accelerator's peak_bf16 ({:.4g} "
                        "TFLOP/s): a measured GEMM cannot beat the peak",
                        fi, s.flops / 1e12, a.peak_flops / 1e12));
      a.calibration.push_back(s);
    }
  }
  if (auto c = n["conv_calibration"]) {
    if (!c.IsSequence())
      throw ConfigError(fmt::format(
          "{}.conv_calibration must be a list of {{batch, in, out, height, width, kernel, stride, padding, forward, "
          "input_grad, weight_grad}}",
          f));
    for (size_t i = 0; i < c.size(); ++i) {
      std::string fi = fmt::format("{}.conv_calibration[{}]", f, i);
      check_map(c[i], fi,
                {"batch", "in", "out", "height", "width", "kernel", "stride", "padding", "forward", "input_grad",
                 "weight_grad"});
      ConvSample s;
      s.batch = get_number(require(c[i], "batch", fi), fi + ".batch", 1, kMaxCalibratedDim);
      s.in = get_number(require(c[i], "in", fi), fi + ".in", 1, kMaxCalibratedDim);
      s.out = get_number(require(c[i], "out", fi), fi + ".out", 1, kMaxCalibratedDim);
      s.height = get_number(require(c[i], "height", fi), fi + ".height", 1, kMaxCalibratedDim);
      s.width = get_number(require(c[i], "width", fi), fi + ".width", 1, kMaxCalibratedDim);
      s.kernel = get_number(require(c[i], "kernel", fi), fi + ".kernel", 1, kMaxCalibratedKernel);
      if (c[i]["stride"]) s.stride = get_number(c[i]["stride"], fi + ".stride", 1, kMaxCalibratedKernel);
      if (c[i]["padding"]) s.padding = get_number(c[i]["padding"], fi + ".padding", 0, kMaxCalibratedKernel);
      if (s.out_height() < 1 || s.out_width() < 1)
        throw ConfigError(fmt::format("{}: the kernel does not fit the padded input", fi));
      s.forward_s = positive_duration(c[i], "forward", fi);
      s.input_grad_s = positive_duration(c[i], "input_grad", fi);
      s.weight_grad_s = positive_duration(c[i], "weight_grad", fi);
      a.conv_calibration.push_back(s);
    }
  }
  if (auto c = n["pool_calibration"]) {
    if (!c.IsSequence())
      throw ConfigError(fmt::format(
          "{}.pool_calibration must be a list of {{batch, channels, height, width, kernel, forward, backward}}", f));
    for (size_t i = 0; i < c.size(); ++i) {
      std::string fi = fmt::format("{}.pool_calibration[{}]", f, i);
      check_map(c[i], fi, {"batch", "channels", "height", "width", "kernel", "forward", "backward"});
      PoolSample s;
      s.batch = get_number(require(c[i], "batch", fi), fi + ".batch", 1, kMaxCalibratedDim);
      s.channels = get_number(require(c[i], "channels", fi), fi + ".channels", 1, kMaxCalibratedDim);
      s.height = get_number(require(c[i], "height", fi), fi + ".height", 1, kMaxCalibratedDim);
      s.width = get_number(require(c[i], "width", fi), fi + ".width", 1, kMaxCalibratedDim);
      s.kernel = get_number(require(c[i], "kernel", fi), fi + ".kernel", 1, std::min(s.height, s.width));
      s.forward_s = positive_duration(c[i], "forward", fi);
      s.backward_s = positive_duration(c[i], "backward", fi);
      a.pool_calibration.push_back(s);
    }
  }
  if (auto c = n["attention_calibration"]) {
    if (!c.IsSequence())
      throw ConfigError(
          fmt::format("{}.attention_calibration must be a list of {{kernel, seq, head_dim, achieved}}", f));
    for (size_t i = 0; i < c.size(); ++i) {
      std::string fi = fmt::format("{}.attention_calibration[{}]", f, i);
      check_map(c[i], fi, {"kernel", "seq", "head_dim", "achieved"});
      AttentionSample s;
      s.kernel = get_string(require(c[i], "kernel", fi), fi + ".kernel");
      if (s.kernel != "flash2" && s.kernel != "flash3")
        throw ConfigError(fmt::format(
            "{}.kernel = '{}' (allowed: flash2, flash3; FlashAttention's first version runs at the GEMM rate)", fi,
            s.kernel));
      s.seq = get_number(require(c[i], "seq", fi), fi + ".seq", 1, kMaxCalibratedDim);
      s.head_dim = get_number(require(c[i], "head_dim", fi), fi + ".head_dim", 1, kMaxCalibratedDim);
      s.achieved = parse_flops(get_string(require(c[i], "achieved", fi), fi + ".achieved"), fi + ".achieved");
      if (!(s.achieved > 0)) throw ConfigError(fmt::format("{}.achieved must be positive", fi));
      if (s.achieved > a.peak_flops * (1 + 1e-9))
        throw ConfigError(
            fmt::format("{}.achieved ({:.4g} TFLOP/s) is above the accelerator's peak_bf16 ({:.4g} "
                        "TFLOP/s): a measured kernel cannot beat the peak",
                        fi, s.achieved / 1e12, a.peak_flops / 1e12));
      for (const auto& o : a.attention_calibration)
        if (o.kernel == s.kernel && o.seq == s.seq && o.head_dim == s.head_dim)
          throw ConfigError(fmt::format("{}: a second {} sample at seq {} and head_dim {} (allowed: one each)", fi,
                                        s.kernel, s.seq, s.head_dim));
      a.attention_calibration.push_back(s);
    }
  }
  if (auto c = n["model_calibration"]) {
    if (!c.IsSequence())
      throw ConfigError(fmt::format("{}.model_calibration must be a list of {{layers, batch, step_quantiles}}", f));
    for (size_t i = 0; i < c.size(); ++i) {
      std::string fi = fmt::format("{}.model_calibration[{}]", f, i);
      check_map(c[i], fi, {"layers", "batch", "step_quantiles", "wait_ranks", "slowest_wait", "optimizer"});
      ModelStepSample s;
      s.layers = get_string(require(c[i], "layers", fi), fi + ".layers");
      try {
        parse_layer_model(s.layers);
      } catch (const ConfigError& e) {
        throw ConfigError(fmt::format("{}.layers: {}", fi, e.what()));
      }
      s.batch = get_number(require(c[i], "batch", fi), fi + ".batch", 1, kMaxCalibratedDim);
      auto q = require(c[i], "step_quantiles", fi);
      if (!q.IsSequence() || q.size() < 2)
        throw ConfigError(
            fmt::format("{}.step_quantiles must be a list of at least two durations (quantiles 0..1)", fi));
      for (size_t k = 0; k < q.size(); ++k) {
        const std::string fk = fmt::format("{}.step_quantiles[{}]", fi, k);
        const double t = parse_duration(get_string(q[k], fk), fk);
        if (!(t > 0)) throw ConfigError(fmt::format("{} must be positive", fk));
        if (!s.quantiles.empty() && t < s.quantiles.back())
          throw ConfigError(fmt::format("{} must not be below the quantile before it", fk));
        s.quantiles.push_back(t);
      }
      if (c[i]["wait_ranks"] || c[i]["slowest_wait"]) {
        s.wait_ranks = get_number(require(c[i], "wait_ranks", fi), fi + ".wait_ranks", 2, 1e9);
        const std::string fw = fi + ".slowest_wait";
        s.slowest_wait = parse_duration(get_string(require(c[i], "slowest_wait", fi), fw), fw);
      }
      if (c[i]["optimizer"]) s.optimizer = positive_duration(c[i], "optimizer", fi);
      a.model_calibration.push_back(s);
    }
  }
  return a;
}

}  // namespace

double ModelStepSample::quantile(double q) const {
  if (quantiles.empty()) return 0;
  const double x = std::clamp(q, 0.0, 1.0) * double(quantiles.size() - 1);
  const size_t i = std::min(quantiles.size() - 1, static_cast<size_t>(x));
  if (i + 1 >= quantiles.size()) return quantiles.back();
  return quantiles[i] + (x - double(i)) * (quantiles[i + 1] - quantiles[i]);
}

long long ClusterSpec::described_gpus() const {
  long long total = 0;
  for (const auto& k : node_kinds) {
    if (k.count <= 0) return 0;
    total += static_cast<long long>(k.count) * k.gpus;
  }
  return total;
}

ClusterSpec parse_cluster_yaml(const std::string& text, const std::string& origin) {
  YAML::Node root;
  try {
    // One document: the ones after a `---` were ignored without a word.
    const std::vector<YAML::Node> docs = YAML::LoadAll(text);
    if (docs.size() > 1)
      throw ConfigError(fmt::format("{}: holds {} YAML documents; allowed: one cluster per file", origin, docs.size()));
    if (!docs.empty()) root = docs[0];
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("{}: not valid YAML: {}", origin, e.what()));
  }
  if (!root.IsMap()) throw ConfigError(fmt::format("{}: a cluster file is a map with name, nodes and network", origin));
  check_map(root, origin + ": the cluster", {"name", "description", "nodes", "network"});
  ClusterSpec c;
  c.name = root["name"] ? get_string(root["name"], origin + ": name") : origin;
  c.description = root["description"] ? get_string(root["description"], origin + ": description") : "";
  auto nodes = require(root, "nodes", origin + ": cluster");
  if (!nodes.IsSequence() || nodes.size() == 0)
    throw ConfigError(fmt::format("{}: nodes must be a non-empty list of node kinds", origin));
  for (size_t i = 0; i < nodes.size(); ++i) {
    std::string f = fmt::format("{}: nodes[{}]", origin, i);
    const YAML::Node& n = nodes[i];
    check_map(n, f, {"name", "count", "gpus", "accelerator", "intra", "nics", "nic"});
    NodeKind k;
    k.name = n["name"] ? get_string(n["name"], f + ".name") : fmt::format("kind{}", i);
    if (n["count"]) k.count = get_int(n["count"], f + ".count", 1, 10000000);
    k.gpus = get_int(require(n, "gpus", f), f + ".gpus", 1, 1024);
    k.accelerator = parse_accelerator(n["accelerator"], f + ".accelerator");
    auto intra = n["intra"];
    if (!intra) throw ConfigError(fmt::format("{}.intra is missing (kind, bandwidth, latency)", f));
    check_map(intra, f + ".intra", {"kind", "bandwidth", "latency"});
    k.intra_kind = intra["kind"] ? get_string(intra["kind"], f + ".intra.kind") : "nvswitch";
    if (k.intra_kind != "nvswitch" && k.intra_kind != "pcie" && k.intra_kind != "none")
      throw ConfigError(fmt::format("{}.intra.kind = '{}' (allowed: nvswitch, pcie, none)", f, k.intra_kind));
    // (none routed a node's accelerators to each other at intra.bandwidth all the same)
    if (k.intra_kind == "none" && k.gpus != 1)
      throw ConfigError(fmt::format(
          "{}.intra.kind = none (no fabric between a node's accelerators) needs gpus: 1; allowed with more: "
          "nvswitch, pcie",
          f));
    k.intra = parse_link(intra, f + ".intra", true);
    k.nics = get_int(require(n, "nics", f), f + ".nics", 1, 1024);
    if (k.gpus % k.nics != 0 && k.nics % k.gpus != 0)
      throw ConfigError(fmt::format("{}: gpus ({}) and nics ({}) must divide one another", f, k.gpus, k.nics));
    // (they were cut to one per accelerator without a word, and half of 8 NICs' bandwidth on 4 GPUs went unused)
    if (k.nics > k.gpus)
      throw ConfigError(
          fmt::format("{}: nics ({}) is more than gpus ({}): the model gives each accelerator at most one "
                      "NIC; allowed: nics <= gpus (give a NIC the bandwidth of the ones it stands for)",
                      f, k.nics, k.gpus));
    k.nic = parse_link(n["nic"], f + ".nic");
    c.node_kinds.push_back(std::move(k));
  }
  if (c.node_kinds.size() > 1) {
    for (size_t i = 0; i < c.node_kinds.size(); ++i) {
      if (c.node_kinds[i].count <= 0)
        throw ConfigError(
            fmt::format("{}: nodes[{}].count is required when a cluster has several node kinds", origin, i));
      if (c.node_kinds[i].gpus != c.node_kinds[0].gpus)
        throw ConfigError(fmt::format("{}: nodes[{}].gpus must equal nodes[0].gpus ({}) in this version", origin, i,
                                      c.node_kinds[0].gpus));
    }
  }
  auto net = require(root, "network", origin + ": cluster");
  std::string f = origin + ": network";
  check_map(net, f,
            {"topology", "nodes_per_leaf", "oversubscription", "switch_latency", "software_overhead", "wake_latency",
             "reduction_bandwidth", "in_network_reduction", "torus_dims", "torus_link", "pipeline_segment"});
  NetworkSpec& ns = c.network;
  std::string topo = get_string(require(net, "topology", f), f + ".topology");
  if (topo == "fat-tree")
    ns.topology = TopologyKind::kFatTree;
  else if (topo == "rail-optimized")
    ns.topology = TopologyKind::kRailOptimized;
  else if (topo == "torus")
    ns.topology = TopologyKind::kTorus;
  else if (topo == "flat")
    ns.topology = TopologyKind::kFlat;
  else
    throw ConfigError(fmt::format("{}.topology = '{}' (allowed: fat-tree, rail-optimized, torus, flat)", f, topo));
  if (net["nodes_per_leaf"]) ns.nodes_per_leaf = get_int(net["nodes_per_leaf"], f + ".nodes_per_leaf", 1, 1 << 20);
  if (net["oversubscription"])
    ns.oversubscription = get_number(net["oversubscription"], f + ".oversubscription", 1, 1000);
  if (net["switch_latency"])
    ns.switch_latency = parse_duration(get_string(net["switch_latency"], f + ".switch_latency"), f + ".switch_latency");
  if (net["software_overhead"])
    ns.software_overhead =
        parse_duration(get_string(net["software_overhead"], f + ".software_overhead"), f + ".software_overhead");
  if (net["wake_latency"])
    ns.wake_latency = parse_duration(get_string(net["wake_latency"], f + ".wake_latency"), f + ".wake_latency");
  if (net["reduction_bandwidth"])
    ns.reduction_bandwidth =
        parse_bandwidth(get_string(net["reduction_bandwidth"], f + ".reduction_bandwidth"), f + ".reduction_bandwidth");
  if (!(ns.reduction_bandwidth > 0)) throw ConfigError(fmt::format("{}.reduction_bandwidth must be positive", f));
  if (net["pipeline_segment"]) {
    ns.pipeline_segment =
        parse_size(get_string(net["pipeline_segment"], f + ".pipeline_segment"), f + ".pipeline_segment");
    if (ns.pipeline_segment < 64 || ns.pipeline_segment > 1024.0 * 1024 * 1024)
      throw ConfigError(fmt::format("{}.pipeline_segment = {} (allowed: 64 B to 1 GiB)", f,
                                    get_string(net["pipeline_segment"], f + ".pipeline_segment")));
  }
  if (net["in_network_reduction"]) {
    try {
      ns.in_network_reduction = net["in_network_reduction"].as<bool>();
    } catch (const YAML::Exception&) {
      throw ConfigError(fmt::format("{}.in_network_reduction must be true or false", f));
    }
  }
  if (ns.topology != TopologyKind::kTorus && (net["torus_dims"] || net["torus_link"]))
    throw ConfigError(
        fmt::format("{}: torus_dims and torus_link describe a torus; this network is not one (allowed "
                    "with topology: torus only)",
                    f));
  // (left out, every node was a leaf of its own and every transfer between nodes crossed the spine at the NICs'
  // bandwidth over the oversubscription: a ring 3x slower than with the preset's leaves, without a word)
  if ((ns.topology == TopologyKind::kFatTree || ns.topology == TopologyKind::kRailOptimized) && !net["nodes_per_leaf"])
    throw ConfigError(
        fmt::format("{}.nodes_per_leaf is missing: a {} network needs the nodes under a leaf switch (a "
                    "pod's, rail-optimized); allowed: a whole number from 1",
                    f, topo));
  if (ns.topology == TopologyKind::kFlat)
    // (every node's NICs straight to every other's: no switches; these were taken and ignored)
    for (const char* key : {"nodes_per_leaf", "oversubscription", "switch_latency"})
      if (net[key])
        throw ConfigError(fmt::format(
            "{}.{} describes leaf and spine switches, which a flat network does not have (allowed with topology: "
            "flat: software_overhead, wake_latency, reduction_bandwidth, in_network_reduction, pipeline_segment)",
            f, key));
  if (ns.topology == TopologyKind::kTorus) {
    // (a torus has no switches: these were taken and ignored, in-network reduction then listed as unsupported)
    for (const char* key : {"nodes_per_leaf", "oversubscription", "switch_latency", "in_network_reduction"})
      if (net[key])
        throw ConfigError(fmt::format(
            "{}.{} describes leaf and spine switches, which a torus does not have (allowed with topology: torus: "
            "torus_dims, torus_link, software_overhead, wake_latency, reduction_bandwidth, pipeline_segment)",
            f, key));
    auto d = net["torus_dims"];
    if (!d || !d.IsSequence() || d.size() < 1 || d.size() > 3)
      throw ConfigError(fmt::format("{}.torus_dims must be a list of 1-3 node counts, e.g. [8, 8, 8]", f));
    for (size_t i = 0; i < d.size(); ++i) ns.torus_dims.push_back(get_int(d[i], f + ".torus_dims", 1, 1 << 16));
    ns.torus_link = parse_link(net["torus_link"], f + ".torus_link");
  }
  return c;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const auto& p : detail::kPresetTexts) out.emplace_back(p.name);
  return out;
}

const char* preset_yaml(const std::string& name) {
  for (const auto& p : detail::kPresetTexts)
    if (name == p.name) return p.yaml;
  throw ConfigError(fmt::format("--cluster: unknown preset '{}' (presets: {}; or give a path to a YAML file)", name,
                                join(preset_names(), ", ")));
}

ClusterSpec load_cluster(const std::string& preset_or_file) {
  for (const auto& p : detail::kPresetTexts)
    if (preset_or_file == p.name) return parse_cluster_yaml(p.yaml, std::string("preset ") + p.name);
  std::error_code ec;
  if (!std::filesystem::exists(preset_or_file, ec) || std::filesystem::is_directory(preset_or_file, ec)) {
    throw ConfigError(fmt::format("--cluster: '{}' is neither a preset ({}) nor a readable YAML file", preset_or_file,
                                  join(preset_names(), ", ")));
  }
  return parse_cluster_yaml(read_input_file(preset_or_file, "--cluster", "a preset or a cluster YAML file"),
                            preset_or_file);
}

ClusterSpec flat_cluster(double alpha, double bandwidth, double gamma, double peak_flops) {
  ClusterSpec c;
  c.name = "flat";
  c.description = "every endpoint has one alpha-beta link (closed-form checks)";
  NodeKind k;
  k.name = "endpoint";
  k.gpus = 1;
  k.accelerator.name = "ideal";
  k.accelerator.peak_flops = peak_flops;
  k.accelerator.peak_flops_fp32 = peak_flops;
  k.accelerator.memory_bytes = 1e12;
  k.accelerator.memory_bandwidth = 1e13;
  k.intra_kind = "none";
  k.intra = {bandwidth, 0};
  k.nics = 1;
  k.nic = {bandwidth, 0};
  c.node_kinds.push_back(k);
  c.network.topology = TopologyKind::kFlat;
  c.network.in_network_reduction = true;  // (the closed-form checks time in-network aggregation too)
  c.network.software_overhead = alpha;
  c.network.reduction_bandwidth = gamma > 0 ? 1.0 / gamma : 1e300;
  return c;
}

}  // namespace conduit::sim
