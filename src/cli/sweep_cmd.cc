// `conduit sweep FILE.yaml [-o DIR] [--dry-run | --replot]`: a grid of runs on emulated clusters (cli/cluster.h), one
// cell after another: (sync scheme x compressor) of `conduit train`, PyTorch DDP peers (bench/peers/ddp_train.py with
// a communication hook) and `conduit bench coll`, each at every network setting and seed. Every cell runs through
// `conduit cluster run` (one worker per emulated host, over tcp) with its own output folder and log; the sweep
// writes results.csv, results.json and PNG plots (gnuplot): accuracy vs wall time, accuracy vs bytes sent,
// throughput vs bandwidth (and bench busbw vs bandwidth; one line per label and network latency/loss, seeds as the
// median with their range).
//
// FILE.yaml:
//   name: demo                       # optional; output defaults to runs/sweep-<name>
//   output: runs/sweep-demo          # optional; --output wins
//   hosts: 4                         # emulated hosts = workers
//   networks:                        # each: bandwidth, latency, loss (or hosts_file), optional label
//     - {bandwidth: 100mbit}
//     - {bandwidth: 1gbit}
//   seeds: [42]
//   schemes: [bsp]                   # conduit train cells: schemes x compressors (pairs of a scheme that
//                                    # averages parameters with a compressor are left out)
//   compressors: [none, "powersgd:rank=4"]
//   peers: [none, fp16, powersgd]    # PyTorch DDP cells, one per hook
//   peer_powersgd_rank: 4
//   train: {epochs: 1, train_limit: 8192, test_limit: 2000, target_accuracy: 0.85}   # conduit train flags
//   bench: {op: allreduce, min_bytes: 1M, max_bytes: 16M, iters: 5, warmup: 2}      # adds a bench cell
//   timeout_s: 1800                  # per cell
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cli/bench_ops.h"
#include "cli/cluster.h"
#include "cli/launcher.h"
#include "cli/registry.h"
#include "core/dtype.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "core/reduce.h"
#include "core/yaml_file.h"
#ifdef CONDUIT_WITH_COMPRESS
#include "compress/compressor.h"
#endif
#ifdef CONDUIT_WITH_SYNC
#include "sync/strategy.h"
#endif
#ifdef CONDUIT_WITH_TORCH
#include "torch/config.h"  // the keys only; no libtorch headers
#endif

namespace conduit::cli {
namespace {

namespace cl = conduit::cli::cluster;
namespace fs = std::filesystem;
using json = nlohmann::json;

struct Network {
  std::string label;
  std::vector<cl::LinkSpec> links;
  double rate_bps = 0, latency_s = 0, loss = 0;
  bool hetero = false;  // links from a hosts file (rate_bps is the slowest, latency_s and loss the worst)
};

struct Cell {
  int index = 0;
  std::string kind;  // train | ddp | bench
  std::string scheme, compressor, hook;
  const Network* net = nullptr;
  uint64_t seed = 0;
  std::string label;  // series name: what is compared (not the network or seed)
  std::string dir;
};

struct SweepSpec {
  std::string name = "sweep";
  std::string output;
  int hosts = 2;
  std::vector<Network> networks;
  std::vector<uint64_t> seeds = {42};
  std::vector<std::string> schemes, compressors, peers;
  int peer_powersgd_rank = 4;
  std::vector<std::pair<std::string, std::string>> train;  // flag (dashes) -> value
  bool has_bench = false;
  std::vector<std::pair<std::string, std::string>> bench;
  double timeout_s = 1800;
  std::string python = "/usr/bin/python3";
  std::string ddp_script;
};

// A network's label, at most (it is part of every cell folder's name, which the file system caps at 255 bytes).
constexpr size_t kMaxLabel = 64;
// Cells in one grid, at most (networks x seeds x configurations: a typo of a list made 120,000 cells, days of runs).
constexpr double kMaxCells = 10000;

volatile sig_atomic_t g_stop = 0;
void on_stop(int sig) { g_stop = sig; }
constexpr int kStops[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("sweep: cannot find the conduit binary (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

std::string scalar(const YAML::Node& n, const std::string& where) {
  if (!n.IsScalar()) throw ConfigError(fmt::format("sweep: {} must be a scalar", where));
  return n.as<std::string>();
}

std::vector<std::string> string_list(const YAML::Node& n, const std::string& where) {
  std::vector<std::string> out;
  if (!n) return out;
  if (n.IsScalar()) return {n.as<std::string>()};
  if (!n.IsSequence()) throw ConfigError(fmt::format("sweep: {} must be a list", where));
  for (size_t i = 0; i < n.size(); ++i) out.push_back(scalar(n[i], fmt::format("{}[{}]", where, i)));
  return out;
}

std::vector<std::pair<std::string, std::string>> flag_map(const YAML::Node& n, const std::string& where) {
  std::vector<std::pair<std::string, std::string>> out;
  if (!n) return out;
  // (`bench:` alone, meaning the defaults, was told only that it must be a map; an audit)
  if (n.IsNull())
    throw ConfigError(fmt::format("sweep: {} has no value; allowed: a map of key: value, or {}: {{}} for the defaults",
                                  where, where));
  if (!n.IsMap()) throw ConfigError(fmt::format("sweep: {} must be a map of key: value", where));
  for (const auto& kv : n) {
    if (!kv.first.IsScalar()) throw ConfigError(fmt::format("sweep: {} has a key that is not a name", where));
    std::string k = kv.first.as<std::string>();
    for (auto& c : k) {
      if (c == '_') c = '-';
    }
    if (k.empty() || k.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-") != std::string::npos) {
      throw ConfigError(fmt::format("sweep: {}: key '{}' is not a flag name", where, k));
    }
    // min_bytes and min-bytes are one flag: given twice, bench cells failed on the repeat once their cluster was up
    // and train cells took the last silently.
    for (const auto& [seen, v] : out)
      if (seen == k)
        throw ConfigError(fmt::format("sweep: {}: '{}' is given twice ('_' and '-' name the same flag); give it once",
                                      where, kv.first.as<std::string>()));
    out.emplace_back(k, scalar(kv.second, where + "." + k));
  }
  return out;
}

// The train: keys bench/peers/ddp_train.py takes (the others go to Conduit's train cells only).
const std::set<std::string>& ddp_keys() {
  static const std::set<std::string> keys = {"model",      "data-dir",      "epochs",          "batch-size",
                                             "lr",         "momentum",      "lr-schedule",     "train-limit",
                                             "test-limit", "max-steps",     "target-accuracy", "timeout",
                                             "eval-every", "bucket-cap-mb", "optimizer"};
  return keys;
}

std::string find_ddp_script() {
  const fs::path exe = self_exe();
  for (const fs::path& p : {exe.parent_path().parent_path().parent_path() / "bench/peers/ddp_train.py",
                            fs::current_path() / "bench/peers/ddp_train.py"}) {
    if (fs::exists(p)) return fs::canonical(p).string();
  }
  return "";
}

bool compressor_applies(const std::string& scheme, const std::string& compressor);  // below

SweepSpec load_spec(const std::string& path) {
  const YAML::Node root = load_yaml_file(path, "sweep", "a YAML file");
  if (!root.IsMap()) throw ConfigError(fmt::format("sweep: {} must be a YAML map", path));
  static const std::set<std::string> kKeys = {"name",    "output",      "hosts",  "networks",           "seeds",
                                              "schemes", "compressors", "peers",  "peer_powersgd_rank", "train",
                                              "bench",   "timeout_s",   "python", "ddp_script"};
  std::set<std::string> seen_keys;
  for (const auto& kv : root) {
    if (!kv.first.IsScalar()) throw ConfigError(fmt::format("sweep: {} has a top-level key that is not a name", path));
    const std::string k = kv.first.as<std::string>();
    if (!seen_keys.insert(k).second)
      throw ConfigError(fmt::format("sweep: '{}' is given twice in {}; give it once", k, path));
    if (!kKeys.count(k)) {
      throw ConfigError(
          fmt::format("sweep: unknown key '{}' in {}; allowed: name, output, hosts, networks, seeds, "
                      "schemes, compressors, peers, peer_powersgd_rank, train, bench, timeout_s, python, "
                      "ddp_script",
                      k, path));
    }
  }
  SweepSpec s;
  try {
    if (root["name"]) {
      s.name = scalar(root["name"], "name");
      // (an empty one named the output folder runs/sweep- and the sweep in its lines nothing)
      if (s.name.empty())
        throw ConfigError(
            fmt::format("sweep: {}: name is empty; allowed: a name such as demo, or leave name out", path));
    }
    if (root["output"]) s.output = scalar(root["output"], "output");
    auto number = [&](const char* key, const char* allowed) {
      try {
        return root[key].as<double>();
      } catch (const YAML::Exception&) {
        throw ConfigError(fmt::format("sweep: {}: {} must be {}", path, key, allowed));
      }
    };
    if (root["hosts"]) {
      const double h = number("hosts", "a whole number of hosts");
      // ("must be between 1 and 250, got 2.5" did not say why 2.5 was refused; an audit)
      if (h != std::floor(h) || !(h >= 1 && h <= cl::kMaxHosts))
        throw ConfigError(fmt::format("sweep: hosts must be a whole number from 1 to {}, got {}", cl::kMaxHosts, h));
      s.hosts = static_cast<int>(h);
    }
    if (root["timeout_s"]) s.timeout_s = number("timeout_s", "seconds > 0");
    if (root["peer_powersgd_rank"]) {
      const double r = number("peer_powersgd_rank", "a whole number >= 1");
      if (r != std::floor(r) || !(r >= 1 && r <= 1024))
        throw ConfigError(fmt::format("sweep: peer_powersgd_rank must be a whole number from 1 to 1024, got {}", r));
      s.peer_powersgd_rank = static_cast<int>(r);
    }
    if (root["python"]) s.python = scalar(root["python"], "python");
    if (root["ddp_script"]) s.ddp_script = scalar(root["ddp_script"], "ddp_script");
    if (root["seeds"]) {
      s.seeds.clear();
      for (const auto& v : string_list(root["seeds"], "seeds")) {
        if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) throw std::invalid_argument(v);
        // (conduit train's --seed takes at most INT64_MAX: a larger one failed every cell after its cluster came up;
        // one past 2^64 - 1 was called not a non-negative integer)
        const size_t digits = v.size() - std::min(v.find_first_not_of('0'), v.size());
        const unsigned long long seed = digits > 19 ? ULLONG_MAX : std::stoull(v);
        if (seed > static_cast<unsigned long long>(INT64_MAX))
          throw ConfigError(fmt::format("sweep: {}: seed {} is too large; allowed: 0 to {}", path, v, INT64_MAX));
        s.seeds.push_back(seed);
      }
    }
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("sweep: {}: {}", path, e.what()));
  } catch (const std::logic_error&) {
    throw ConfigError(fmt::format("sweep: {}: seeds must be non-negative integers", path));
  }
  if (s.hosts < 1 || s.hosts > cl::kMaxHosts) {
    throw ConfigError(fmt::format("sweep: hosts must be between 1 and {}, got {}", cl::kMaxHosts, s.hosts));
  }
  // (below a second no cell can bring up its workers: 0.001 passed and every cell timed out)
  if (!(s.timeout_s >= 1 && s.timeout_s <= 7 * 86400))
    throw ConfigError(fmt::format(
        "sweep: timeout_s = {} (allowed: seconds from 1 to 604800: every cell has a deadline)", s.timeout_s));
  if (s.seeds.empty()) throw ConfigError("sweep: seeds must list at least one seed");
  if (std::set<uint64_t>(s.seeds.begin(), s.seeds.end()).size() != s.seeds.size())
    throw ConfigError("sweep: seeds lists a seed twice (the cells would repeat)");
  s.schemes = string_list(root["schemes"], "schemes");
  s.compressors = string_list(root["compressors"], "compressors");
  s.peers = string_list(root["peers"], "peers");
  for (const auto& [name, list] :
       {std::pair{"schemes", &s.schemes}, std::pair{"compressors", &s.compressors}, std::pair{"peers", &s.peers}})
    if (std::set<std::string>(list->begin(), list->end()).size() != list->size())
      throw ConfigError(fmt::format("sweep: {} lists an entry twice (the cells would repeat)", name));
  s.train = flag_map(root["train"], "train");
  if (root["bench"]) {
    s.has_bench = true;
    s.bench = flag_map(root["bench"], "bench");
  }
  if (!s.compressors.empty() && s.schemes.empty()) s.schemes = {"bsp"};
  if (!s.schemes.empty() && s.compressors.empty()) s.compressors = {"none"};
  for (const auto& p : s.peers) {
    if (p != "none" && p != "fp16" && p != "powersgd") {
      throw ConfigError(fmt::format("sweep: peers: '{}' is not a DDP hook; allowed none, fp16, powersgd", p));
    }
  }
  for (const auto& sc : s.schemes) {
    if (sc.empty() || sc.find_first_of(" \t'\"") != std::string::npos) {
      throw ConfigError(fmt::format("sweep: schemes: '{}' is not a scheme name", sc));
    }
  }
  // What the cells would find out one by one, on a cluster already up, is checked here for the whole grid.
#ifdef CONDUIT_WITH_COMPRESS
  for (const auto& c : s.compressors) {
    // (ZeRO's reduce-scatter wire only: each train cell checks it with its zero)
    if (c == "int4" || c == "ef:int4") continue;
    try {
      compress::parse_compressor(c);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("sweep: compressors: '{}': {}", c, e.what()));
    }
  }
#endif
#ifdef CONDUIT_WITH_SYNC
  {
    std::vector<std::string> names = sync::strategy_names();
    if (std::find(names.begin(), names.end(), "bsp") == names.end()) names.push_back("bsp");
    for (const auto& sc : s.schemes)
      if (std::find(names.begin(), names.end(), sc.substr(0, sc.find(':'))) == names.end())
        throw ConfigError(fmt::format("sweep: schemes: '{}' is not a scheme; allowed: {}", sc, join(names, ", ")));
  }
#endif
  // The keys a train cell sets itself: a train: value after them won (conduit train takes the last), so a cell ran
  // over shared memory on a "1mbit" network while its results row named the grid's compressor and seed.
  for (const auto& [k, v] : s.train) {  // keys with '-' (flag_map)
    static const std::set<std::string> kOwned = {"transport", "compressor", "seed",   "output",
                                                 "progress",  "sync",       "config", "workers"};
    if (kOwned.count(k))
      throw ConfigError(fmt::format(
          "sweep: train: '{}' would override what the sweep sets for each cell (transport tcp over the emulated "
          "network; compressor, scheme and seed from the grid: compressors:, schemes:, seeds:; workers from hosts:; "
          "output per cell; a config file's values); remove it",
          k));
    // (a cell's train runs under cluster run, which refuses it there: every cell failed at start)
    // (0 as conduit train reads it: "-0", "0.0", "0e5"; "abc", " 0", "+0" and "1e-400", which strtod read as 0, are
    // refused there too)
    static const std::regex kZero("^-?(0+(\\.0*)?|\\.0+)([eE][+-]?[0-9]+)?$");
    if (k == "time-limit-s" && !std::regex_match(v, kZero))
      throw ConfigError(
          "sweep: train: 'time_limit_s' is conduit train's own deadline, which its workers under cluster run refuse; "
          "allowed: the sweep's timeout_s (each cell's deadline)");
  }
  // timeout (the peer's) and timeout_s (conduit train's, the peer's --timeout too) both became the peer's --timeout,
  // and the last won.
  {
    bool timeout = false, timeout_s = false;
    for (const auto& [k, v] : s.train) {
      timeout = timeout || k == "timeout";
      timeout_s = timeout_s || k == "timeout-s";
    }
    if (timeout && timeout_s)
      throw ConfigError(
          "sweep: train: 'timeout' and 'timeout_s' are both given, and both are the DDP peer's --timeout (the "
          "last one won); allowed: one of them (timeout_s, which conduit train takes too)");
  }
  // DDP peer cells take the train: keys bench/peers/ddp_train.py has; one that changes what is trained and that it
  // lacks would make the peer train something else than the cells it is compared with (weight_decay was dropped; tp
  // and pp divide the workers into fewer data-parallel replicas, a smaller global batch than the peer's). A key of
  // conduit train's the peer has no flag for is taken only at the value that is what the peer does (micro_batches
  // 2, time_limit_s and first_bucket_mb were passed to the Conduit cells alone, silently); trace, checkpoint_every
  // and drift_timeout_s, which change nothing that is compared, go to the Conduit cells alone.
  if (!s.peers.empty())
    for (const auto& [k, v] : s.train) {
      if (k == "model" && v != "cnn" && v != "mlp")
        throw ConfigError(
            fmt::format("sweep: train: model '{}' is not one the PyTorch DDP peer (peers:) trains; "
                        "allowed with peers: cnn, mlp",
                        v));
      static const std::set<std::string> kTrainsOtherwise = {
          "weight-decay",      "warmup-epochs", "dataset",   "slow", "resume",
          "synthetic-samples", "sync-period",   "staleness", "tp",   "pp"};
      // (16-bit or int8 weight gathers train on rounded weights, the peer's ZeRO on f32 ones)
      if (k == "zero-gather" && v != "f32")
        throw ConfigError(fmt::format(
            "sweep: train: 'zero-gather' {} is not something the PyTorch DDP peer (peers:) can do (it gathers f32 "
            "weights), so its cells would train differently; allowed with peers: f32, or leave it out",
            v));
      // (the peer has sgd and adam: adamw's decoupled decay it does not)
      if (k == "optimizer" && v != "sgd" && v != "adam")
        throw ConfigError(
            fmt::format("sweep: train: optimizer '{}' is not one the PyTorch DDP peer (peers:) has; "
                        "allowed with peers: sgd, adam",
                        v));
      if (kTrainsOtherwise.count(k))
        throw ConfigError(fmt::format(
            "sweep: train: '{}' is not something the PyTorch DDP peer (peers:) can do, so its cells would train "
            "differently from the ones they are compared with; allowed with peers: {}; remove it or the peers",
            k, join(std::vector<std::string>(ddp_keys().begin(), ddp_keys().end()), ", ")));
      // The peer does what these say at one value: the value conduit train takes by default.
      static const std::map<std::string, std::pair<std::string, const char*>> kPeerDoes = {
          {"micro-batches", {"1", "it steps once a batch"}},
          {"time-limit-s", {"0", "it has no whole-run deadline; timeout_s: is each cell's"}},
          {"first-bucket-mb", {"1", "DDP's first bucket is 1 MiB"}},
          {"compress-min-bytes", {"0", "its hook compresses every bucket"}},
          {"overlap", {"true", "DDP communicates while backward runs"}},
          {"sequence-parallel", {"false", "it has no tensor parallelism"}},
          {"recompute", {"false", "it has no pipeline"}},
          {"pp-schedule", {"1f1b", "it has no pipeline"}},
          {"zero-prefetch", {"true", "its --zero is PyTorch's ZeroRedundancyOptimizer, without that setting"}},
          {"zero-hpz", {"0", "its --zero is PyTorch's ZeroRedundancyOptimizer, without that setting"}},
          {"zero-shard-group", {"0", "its --zero is PyTorch's ZeroRedundancyOptimizer, without that setting"}},
          {"zero-allgather-mb", {"0", "its --zero is PyTorch's ZeroRedundancyOptimizer, without that setting"}},
          {"zero-reduce", {"step", "its --zero is PyTorch's ZeroRedundancyOptimizer, without that setting"}}};
      static const std::set<std::string> kConduitOnly = {"trace", "checkpoint-every", "drift-timeout-s"};
      // (zero-gather f32 and zero: the peer's ZeRO gathers f32 weights; zero 1-3 is its --zero)
      const bool passed = ddp_keys().count(k) > 0 || k == "timeout-s" || k == "zero" || k == "zero-gather";
      bool conduit_key = false;  // (one that is none is refused below as such)
#ifdef CONDUIT_WITH_TORCH
      {
        std::string key = k;
        std::replace(key.begin(), key.end(), '-', '_');
        for (const auto& [ck, desc] : train::config_keys()) conduit_key = conduit_key || ck == key;
      }
#endif
      if (const auto it = kPeerDoes.find(k); it != kPeerDoes.end()) {
        const std::string& at = it->second.first;
        // (as conduit train reads the value: 1.0 is 1, yes is true)
        const bool boolean = at == "true" || at == "false";
        const auto norm = [boolean](const std::string& x) {
          if (x == "true" || x == "yes" || x == "on" || (boolean && x == "1")) return std::string("true");
          if (x == "false" || x == "no" || x == "off" || (boolean && x == "0")) return std::string("false");
          char* end = nullptr;
          const double d = std::strtod(x.c_str(), &end);
          return !x.empty() && *end == '\0' ? fmt::format("{:g}", d) : x;
        };
        if (norm(v) != norm(at))
          throw ConfigError(
              fmt::format("sweep: train: '{}' {} is not something the PyTorch DDP peer (peers:) takes ({}), so its "
                          "cells would run differently from the ones they are compared with; allowed with peers: "
                          "{} {}, or leave it out",
                          k, v, it->second.second, k, at));
      } else if (!passed && !kConduitOnly.count(k) && conduit_key) {
        throw ConfigError(fmt::format(
            "sweep: train: '{}' is not something the PyTorch DDP peer (peers:) takes; allowed with "
            "peers: {}, timeout_s, zero, and trace, checkpoint_every and drift_timeout_s (Conduit cells only)",
            k, join(std::vector<std::string>(ddp_keys().begin(), ddp_keys().end()), ", ")));
      }
      if (kConduitOnly.count(k) && s.schemes.empty())
        throw ConfigError(
            fmt::format("sweep: train: '{}' applies to Conduit's train cells only and this grid has none (peers "
                        "alone); allowed: compressors: or schemes: beside it, or leave it out",
                        k));
    }
#ifdef CONDUIT_WITH_TORCH
  // Train cells pass every train: key to `conduit train`; a grid of DDP peers alone passes only the keys it shares,
  // but a misspelled key is an error either way (with peers alone it was dropped silently).
  train::RawConfig base;  // the train: keys as conduit train's configuration names them
  for (const auto& [k, v] : s.train) {
    std::string key = k;
    std::replace(key.begin(), key.end(), '-', '_');
    bool known = false;
    for (const auto& [ck, desc] : train::config_keys()) known = known || ck == key;
    // A grid of DDP peers alone also takes the peer's own keys (timeout, which conduit train calls timeout_s).
    if (!known && s.schemes.empty()) known = ddp_keys().count(k) > 0 || ddp_keys().count(key) > 0;
    if (!known)
      throw ConfigError(fmt::format("sweep: train: '{}' is not a `conduit train` key (see conduit train --help){}", k,
                                    s.schemes.empty() ? " nor one of the DDP peer's" : ""));
    base[key] = v;
  }
  if (!s.schemes.empty()) {
    // The values too, for every (scheme, compressor) cell, as `conduit train` will read them (epochs: abc or an
    // unknown model failed each cell after its cluster came up).
    for (const auto& sc : s.schemes)
      for (const auto& comp : s.compressors) {
        if (!compressor_applies(sc, comp)) continue;  // the grid leaves that cell out
        train::RawConfig raw = base;
        raw["compressor"] = comp;
        if (sc != "bsp") raw["sync"] = sc;
        try {
          const train::TrainConfig c = train::resolve_config(raw, s.hosts, false);
          train::check_sync_config(c);
        } catch (const ConfigError& e) {
          throw ConfigError(fmt::format("sweep: train cell (scheme {}, compressor {}): {}", sc, comp, e.what()));
        }
      }
  } else if (!s.peers.empty()) {
    // A grid of DDP peers alone: the values they share with conduit train, read as conduit train reads them (none
    // were checked: epochs: abc or lr: -1 failed every peer cell after its cluster came up).
    train::RawConfig raw;
    for (const auto& [k, v] : base)
      for (const auto& [ck, desc] : train::config_keys())
        if (ck == k) raw[k] = v;
    try {
      (void)train::resolve_config(raw, s.hosts, false);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("sweep: train (the DDP peer cells): {}", e.what()));
    }
  }
#endif
  {
    static const std::set<std::string> kBench = {"op",    "algo",   "dtype", "reduce",  "min-bytes", "max-bytes",
                                                 "iters", "warmup", "root",  "timeout", "stagger-us"};
    std::string lo = "8", hi = "64M";
    double stagger_us = 0, timeout = 0;
    for (const auto& [k, v] : s.bench) {
      if (!kBench.count(k))
        throw ConfigError(fmt::format("sweep: bench: '{}' is not a `conduit bench coll` flag; allowed: {}", k,
                                      join(std::vector<std::string>(kBench.begin(), kBench.end()), ", ")));
      if (k == "op" && !is_bench_coll_op(v))
        throw ConfigError(fmt::format("sweep: bench: op '{}' is not supported; allowed: {}", v, bench_coll_ops_list()));
      if (k == "algo") {  // as `bench coll --algo` checks it (a bad one failed every cell after its cluster came up)
        std::string op = "allreduce";
        for (const auto& [bk, bv] : s.bench)
          if (bk == "op") op = bv;
        const auto tuned = tunable_coll_op(op);
        if (!tuned)
          throw ConfigError(
              fmt::format("sweep: bench: algo applies to allreduce, reduce_scatter, allgather, "
                          "broadcast and reduce, not {}",
                          op));
        try {
          coll::Tuner::check_algorithm(*tuned, v);
        } catch (const Error& e) {
          throw ConfigError(fmt::format("sweep: bench: algo: {}", e.what()));
        }
      }
      if (k == "min-bytes") lo = v;
      if (k == "max-bytes") hi = v;
      // The values `bench coll` checks, checked here for the whole grid (iters: abc failed each cell after its
      // cluster came up).
      // As `bench coll` reads them: whole numbers in digits only, without leading zeros (it refused 1e3 and 010),
      // seconds in (0, 1e6].
      auto number = [&](double lo_v, double hi_v, bool whole, bool open_low = false) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        const bool digits = whole
                                ? !v.empty() && (v.size() == 1 || v[0] != '0') &&
                                      std::all_of(v.begin(), v.end(), [](unsigned char ch) { return std::isdigit(ch); })
                                : is_decimal(v);
        if (!digits || *end != '\0' || !(open_low ? x > lo_v : x >= lo_v) || !(x <= hi_v))
          throw ConfigError(fmt::format("sweep: bench: {} = '{}' (allowed: {} in {}{:g}, {:g}])", k, v,
                                        whole ? "a whole number without leading zeros" : "a number",
                                        open_low ? "(" : "[", lo_v, hi_v));
        return x;
      };
      if (k == "iters") number(1, 1e6, true);
      if (k == "warmup") number(0, 1e6, true);
      if (k == "root") number(0, s.hosts - 1, true);  // a rank of the cell's hosts
      if (k == "stagger-us") stagger_us = number(0, 1e6, false);
      if (k == "timeout") timeout = number(0.001, 1e6, false);  // (bench coll's range: 0.0001 passed here)
      // (their errors named neither the sweep nor the key)
      try {
        if (k == "dtype") parse_dtype(v);
        if (k == "reduce") parse_reduce_op(v);
      } catch (const ConfigError& e) {
        throw ConfigError(fmt::format("sweep: bench: {}: {}", k, e.what()));
      }
    }
    {  // (as bench coll refuses them: taken and ignored otherwise)
      std::string op = "allreduce";
      bool reduce = false, root = false;
      for (const auto& [bk, bv] : s.bench) {
        if (bk == "op") op = bv;
        reduce = reduce || bk == "reduce";
        root = root || bk == "root";
      }
      if (reduce && !bench_coll_op_reduces(op))
        throw ConfigError(fmt::format(
            "sweep: bench: reduce: {} reduces nothing; allowed with reduce: allreduce, reduce_scatter, reduce", op));
      if (root && !bench_coll_op_rooted(op))
        throw ConfigError(fmt::format(
            "sweep: bench: root: {} has no root; allowed with root: broadcast, reduce, gather, scatter", op));
    }
    const uint64_t lo_b = parse_bytes(lo, "sweep: bench: min-bytes"), hi_b = parse_bytes(hi, "sweep: bench: max-bytes");
    if (hi_b < lo_b) throw ConfigError(fmt::format("sweep: bench: max-bytes {} is below min-bytes {}", hi, lo));
    // (bench coll refuses it, so every cell failed once its cluster was up)
    if (hi_b == 0)
      throw ConfigError(
          fmt::format("sweep: bench: max-bytes {} is not a message size; allowed: 1 element or more", hi));
    // (every emulated host's rank runs on this machine; bench coll checks only its own host's, after the cluster is
    // up)
    check_bench_coll_memory(hi_b, s.hosts, "sweep: bench: max-bytes " + hi);
    // (as bench coll: whole elements of the dtype; 3 bytes of f32 passed here and failed each cell once its cluster
    // was up)
    {
      std::string dtype = "f32";
      for (const auto& [bk, bv] : s.bench)
        if (bk == "dtype") dtype = bv;
      const size_t e = dtype_size(parse_dtype(dtype));
      if (lo_b % e != 0 || hi_b % e != 0)
        throw ConfigError(
            fmt::format("sweep: bench: min-bytes {} and max-bytes {} must be whole numbers of {} elements "
                        "({} bytes each)",
                        lo, hi, dtype, e));
    }
    if (timeout > 0 && stagger_us * 1e-6 >= timeout)
      throw ConfigError(
          fmt::format("sweep: bench: stagger-us {:g} is not below the timeout ({:g} s): the waiting ranks "
                      "would time out",
                      stagger_us, timeout));
  }
  const YAML::Node nets = root["networks"];
  if (!nets || !nets.IsSequence() || nets.size() == 0) {
    throw ConfigError("sweep: networks must list at least one setting, e.g. networks: [{bandwidth: 100mbit}]");
  }
  for (size_t i = 0; i < nets.size(); ++i) {
    const std::string where = fmt::format("networks[{}]", i);
    if (!nets[i].IsMap()) throw ConfigError(fmt::format("sweep: {} must be a map", where));
    Network n;
    cl::LinkSpec l;
    cl::LinkGiven given;  // the keys given (0 too), which a hosts file's defaults must not also set
    std::string hosts_file;
    std::set<std::string> net_keys;
    for (const auto& kv : nets[i]) {
      if (!kv.first.IsScalar()) throw ConfigError(fmt::format("sweep: {} has a key that is not a name", where));
      const std::string k = kv.first.as<std::string>();
      if (!net_keys.insert(k).second)
        throw ConfigError(fmt::format("sweep: {}.{} is given twice; give it once", where, k));
      const std::string v = scalar(kv.second, where + "." + k);
      if (k == "bandwidth") {
        l.rate_bps = cl::parse_rate(v, "sweep: " + where + ".bandwidth");
        given.bandwidth = where + ".bandwidth";
      } else if (k == "latency") {
        l.latency_s = cl::parse_duration(v, "sweep: " + where + ".latency");
        given.latency = where + ".latency";
      } else if (k == "loss") {
        l.loss = cl::parse_loss(v, "sweep: " + where + ".loss");
        given.loss = where + ".loss";
      } else if (k == "hosts_file") {
        // Relative to the sweep file, as its other paths are read by whoever wrote it (it was read from the current
        // directory, so the same sweep file worked from one directory only).
        hosts_file = v.empty() || fs::path(v).is_absolute() ? v : (fs::path(path).parent_path() / v).string();
      } else if (k == "label") {
        // It names the cells' folders and the plots' lines: a 250-character one passed here and the sweep died on
        // "File name too long" after its first cell; a newline broke the results and the plot titles.
        if (v.empty() || v.size() > kMaxLabel ||
            std::any_of(v.begin(), v.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
          throw ConfigError(
              fmt::format("sweep: {}.label is {}; allowed: 1 to {} bytes (UTF-8) without control characters "
                          "(newlines, tabs)",
                          where,
                          v.empty()              ? std::string("empty")
                          : v.size() > kMaxLabel ? fmt::format("{} bytes long", v.size())
                                                 : std::string("a text with control characters"),
                          kMaxLabel));
        n.label = v;
      } else {
        throw ConfigError(
            fmt::format("sweep: {}: unknown key '{}'; allowed bandwidth, latency, loss, hosts_file, label", where, k));
      }
    }
    try {
      n.links = hosts_file.empty() ? std::vector<cl::LinkSpec>(static_cast<size_t>(s.hosts), l)
                                   : cl::load_hosts_file(hosts_file, s.hosts, l, given);
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      // (a count mismatch named a --hosts flag the sweep does not have)
      const bool count = what.find("does not match the") != std::string::npos;
      throw ConfigError(fmt::format("sweep: {}.hosts_file: {}{}", where, what,
                                    count ? fmt::format(" (the sweep's hosts: is {}{}; make them agree)", s.hosts,
                                                        root["hosts"] ? "" : ", the default")
                                          : std::string()));
    }
    n.rate_bps = l.rate_bps;
    n.latency_s = l.latency_s;
    n.loss = l.loss;
    n.hetero = !hosts_file.empty();
    for (const auto& hl : n.links) {  // a hosts file's links: the worst latency and loss name the setting
      n.latency_s = std::max(n.latency_s, hl.latency_s);
      n.loss = std::max(n.loss, hl.loss);
    }
    if (n.rate_bps <= 0 && hosts_file.empty()) {
      throw ConfigError(fmt::format("sweep: {}: bandwidth is required (e.g. 100mbit)", where));
    }
    if (!hosts_file.empty()) {  // several rates: the slowest link bounds a collective, so it names the setting
      n.rate_bps = n.links[0].rate_bps;
      for (const auto& l2 : n.links) n.rate_bps = std::min(n.rate_bps, l2.rate_bps);
    }
    if (n.label.empty()) {
      n.label = cl::format_rate(n.rate_bps);
      if (n.latency_s > 0) n.label += fmt::format("-{:g}ms", n.latency_s * 1e3);
      if (n.loss > 0) n.label += fmt::format("-{:g}pct", n.loss * 100);
      if (!hosts_file.empty()) n.label += "-hetero";
    }
    for (const auto& other : s.networks)
      if (other.label == n.label)
        throw ConfigError(
            fmt::format("sweep: {}: its label '{}' is also another network's (give each a distinct "
                        "label:)",
                        where, n.label));
    s.networks.push_back(n);
  }
  if (s.schemes.empty() && s.peers.empty() && !s.has_bench) {
    throw ConfigError("sweep: nothing to run; give compressors (and schemes), peers, or bench");
  }
  // The DDP peer's own settings without peers: applied to nothing (a misplaced or commented-out peers: went unseen).
  if (s.peers.empty())
    for (const char* key : {"python", "ddp_script", "peer_powersgd_rank"})
      if (root[key])
        throw ConfigError(
            fmt::format("sweep: {} is a setting of the PyTorch DDP peer cells and {} has no peers:; allowed: "
                        "peers: (none, fp16, powersgd) beside it, or leave {} out",
                        key, path, key));
  {
    // (make_cells' count, before any is made: 120,000 cells were taken, and days of runs)
    double configs = static_cast<double>(s.peers.size()) + (s.has_bench ? 1 : 0);
    for (const auto& sc : s.schemes)
      for (const auto& comp : s.compressors) configs += compressor_applies(sc, comp) ? 1 : 0;
    const double cells = static_cast<double>(s.networks.size()) * static_cast<double>(s.seeds.size()) * configs;
    if (cells > kMaxCells)
      throw ConfigError(fmt::format(
          "sweep: {}: the grid has {:.0f} cells ({} networks x {} seeds x {:.0f} configurations: train cells, peers, "
          "bench); allowed: at most {:.0f} cells, so fewer networks, seeds, schemes, compressors or peers",
          path, cells, s.networks.size(), s.seeds.size(), configs, kMaxCells));
  }
  if (!s.peers.empty() && s.ddp_script.empty()) {
    s.ddp_script = find_ddp_script();
    if (s.ddp_script.empty()) {
      throw ConfigError("sweep: peers need bench/peers/ddp_train.py; run from the repository root or set ddp_script");
    }
  }
  if (!s.peers.empty()) {
    // (a missing interpreter or script failed every DDP cell, exit 127, after its cluster came up)
    std::error_code ec;
    if (!fs::is_regular_file(s.ddp_script, ec))
      throw ConfigError(
          fmt::format("sweep: ddp_script '{}' is not a file; allowed: the path of "
                      "bench/peers/ddp_train.py (or leave it out)",
                      s.ddp_script));
    std::string why;
    if (!find_program(s.python, &why))
      throw ConfigError(
          fmt::format("sweep: python '{}' cannot run the DDP peer: {}; allowed: a Python 3 with torch "
                      "(default /usr/bin/python3)",
                      s.python, why));
  }
  return s;
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  return out;
}

// Schemes that average parameters (local, diloco, easgd, sgp, adpsgd) take no gradient compressor (conduit train
// refuses the pair): the grid leaves those cells out. bsp compresses gradients, dpsgd its gossip, ps-* its pushes.
// (A compressor one of those refuses, dgc or signum with the servers, signsgd with the servers or gossip, refuses the
// grid in one line naming the cell and the reason, before any cell runs.)
bool compressor_applies(const std::string& scheme, const std::string& compressor) {
  const std::string name = scheme.substr(0, scheme.find(':'));
  return compressor == "none" || name == "bsp" || name == "dpsgd" || name.rfind("ps-", 0) == 0;
}

std::vector<Cell> make_cells(const SweepSpec& s, const std::string& out_dir) {
  std::vector<Cell> cells;
  for (const auto& net : s.networks) {
    for (uint64_t seed : s.seeds) {
      const auto add = [&](Cell c) {
        c.index = static_cast<int>(cells.size());
        c.net = &net;
        c.seed = seed;
        // (the label's first 100 characters: a long scheme or compressor spec made a name past the file system's
        // 255 bytes; the index keeps the names apart)
        c.dir = (fs::path(out_dir) / fmt::format("cell{:03d}-{}-{}-s{}", c.index, sanitize(c.label).substr(0, 100),
                                                 sanitize(net.label), seed))
                    .string();
        cells.push_back(c);
      };
      for (const auto& sc : s.schemes) {
        for (const auto& comp : s.compressors) {
          if (!compressor_applies(sc, comp)) continue;
          Cell c;
          c.kind = "train";
          c.scheme = sc;
          c.compressor = comp;
          c.label = fmt::format("conduit {} {}", sc, comp);
          add(c);
        }
      }
      for (const auto& h : s.peers) {
        Cell c;
        c.kind = "ddp";
        c.scheme = "bsp";
        c.hook = h;
        c.compressor = h == "powersgd" ? fmt::format("powersgd:rank={}", s.peer_powersgd_rank) : h;
        c.label = fmt::format("ddp {}", c.compressor);
        add(c);
      }
      if (s.has_bench) {
        Cell c;
        c.kind = "bench";
        c.label = "bench coll";
        add(c);
      }
    }
  }
  return cells;
}

bool train_supports_sync(const std::string& exe) {
  std::string out;
  cl::run_program({exe, "train", "--help"}, &out);
  return out.find("--sync") != std::string::npos;
}

// What a cell's `cluster run` is given past the sweep's own deadline for the cell (its SIGTERM at timeout_s, SIGKILL
// 15 s later): its own --timeout, which only acts when the sweep is not there to enforce the cell's.
constexpr double kCellTimeoutGraceS = 30;

std::vector<std::string> cell_command(const SweepSpec& s, const Cell& c, const std::string& cluster,
                                      const std::string& exe) {
  // The cell's deadline travels with it: enforced by the sweep's polling alone, a cell whose sweep was killed with
  // SIGKILL ran on without one, in a cluster nobody owned (an audit). (run_logged also has it sent SIGTERM when the
  // sweep dies.)
  std::vector<std::string> cmd = {
      exe, "cluster", "run", "--name", cluster, "--timeout", fmt::format("{}", s.timeout_s + kCellTimeoutGraceS), "--"};
  if (c.kind == "train") {
    cmd.insert(cmd.end(), {exe, "train", "--transport", "tcp", "--compressor", c.compressor, "--seed",
                           std::to_string(c.seed), "--output", c.dir, "--progress", "false"});
    if (c.scheme != "bsp") cmd.insert(cmd.end(), {"--sync", c.scheme});
    for (const auto& [k, v] : s.train) cmd.insert(cmd.end(), {"--" + k, v});
  } else if (c.kind == "ddp") {
    cmd.insert(cmd.end(), {s.python, s.ddp_script, "--hook", c.hook, "--powersgd-rank",
                           std::to_string(s.peer_powersgd_rank), "--seed", std::to_string(c.seed), "--output", c.dir});
    bool adam = false, lr = false;
    for (const auto& [k, v] : s.train) {
      if (ddp_keys().count(k)) cmd.insert(cmd.end(), {"--" + k, v});
      // conduit train's deadline is the peer's --timeout (the peer cells ran on its default, whatever was set).
      if (k == "timeout-s") cmd.insert(cmd.end(), {"--timeout", v});
      // ZeRO 1-3: the peer's PyTorch ZeroRedundancyOptimizer (the peer cells ran without, silently).
      if (k == "zero" && std::strtod(v.c_str(), nullptr) != 0) cmd.push_back("--zero");
      adam = adam || (k == "optimizer" && v == "adam");
      lr = lr || k == "lr";
    }
    // conduit train's learning rate for adam unless given (the peer's default is sgd's 0.1)
    if (adam && !lr) cmd.insert(cmd.end(), {"--lr", "0.001"});
  } else {
    cmd.insert(cmd.end(), {exe, "bench", "coll", "--json", "--transport", "tcp"});
    for (const auto& [k, v] : s.bench) cmd.insert(cmd.end(), {"--" + k, v});
  }
  return cmd;
}

// Bytes the hosts sent during a cell: the switch ports' receive counters.
constexpr uint64_t kUnreadable = UINT64_MAX;

// Bytes the switch's ports received so far; kUnreadable when `ip` failed.
uint64_t switch_rx_bytes(const std::string& cluster) {
  std::string out;
  if (cl::run_program({"ip", "-n", cl::switch_ns(cluster), "-s", "-j", "link", "show"}, &out) != 0) return kUnreadable;
  uint64_t sum = 0;
  try {
    for (const auto& l : json::parse(out)) {
      const std::string ifname = l.value("ifname", "");
      if (ifname.size() > 1 && ifname[0] == 'p' && l.contains("stats64"))
        sum += l["stats64"]["rx"]["bytes"].get<uint64_t>();
    }
  } catch (const json::exception&) {
    return kUnreadable;
  }
  return sum;
}

// Runs argv with stdout/stderr into `log`; kills it after timeout_s or when the sweep is told to stop.
// *stopped: it was ended because the sweep was told to stop.
int run_logged(const std::vector<std::string>& argv, const std::string& log, double timeout_s, bool* timed_out,
               bool* stopped) {
  *timed_out = false;
  *stopped = false;
  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(fmt::format("sweep: cannot write {}", log));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The stop signals blocked across the fork: one that came before the child had its default handlers back went to
  // the sweep's handler in the child (a SIGTERM to it was lost and the cell ran on until SIGKILL 15 s later); pending,
  // it acts once they are back.
  sigset_t stops, before;
  sigemptyset(&stops);
  for (int sig : kStops) sigaddset(&stops, sig);
  sigprocmask(SIG_BLOCK, &stops, &before);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // SIGTERM when the sweep dies (SIGKILL, the OOM killer): `cluster run` then stops its workers as on any SIGTERM,
    // instead of running on with nobody to enforce the cell's deadline or take its cluster down. (Kept across the
    // exec; a sweep gone before the prctl is seen by the parent pid's change.)
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(128 + SIGTERM);
    setpgid(0, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    const int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    for (int sig : kStops) {
      struct sigaction now {};
      sigaction(sig, nullptr, &now);
      if (now.sa_handler != SIG_IGN) signal(sig, SIG_DFL);  // (ignored ones, nohup's, stay ignored)
    }
    sigprocmask(SIG_SETMASK, &before, nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  sigprocmask(SIG_SETMASK, &before, nullptr);
  if (pid < 0) {
    close(fd);
    throw Error("sweep: fork failed");
  }
  close(fd);
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  bool termed = false;
  std::chrono::steady_clock::time_point term_at;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    const auto now = std::chrono::steady_clock::now();
    const bool late = std::chrono::duration<double>(now - t0).count() > timeout_s;
    if ((late || g_stop) && !termed) {
      *timed_out = late;
      *stopped = !late;
      kill(pid, SIGTERM);
      termed = true;
      term_at = now;
    } else if (termed && now - term_at > std::chrono::seconds(15)) {
      kill(-pid, SIGKILL);
      kill(pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

json read_json_file(const fs::path& p) {
  std::ifstream f(p);
  if (!f) return nullptr;
  try {
    return json::parse(f);
  } catch (const json::exception&) {
    return nullptr;
  }
}

std::string csv_field(const json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) {
    std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  }
  if (v.is_number_float()) return fmt::format("{:.6g}", v.get<double>());
  return v.dump();
}

// Collects what a finished cell wrote: summary and per-epoch curve (train/ddp), JSON records (bench). Returns whether
// it wrote its results: a summary.json (train/ddp), a record (bench).
bool collect(const Cell& c, json& row, json& detail) {
  const fs::path dir = c.dir;
  if (c.kind == "bench") {
    std::ifstream log(dir / "log.txt");
    std::string line;
    json recs = json::array();
    double best = 0;
    while (std::getline(log, line)) {
      const size_t b = line.find('{');
      if (line.rfind("[rank 0] ", 0) != 0 || b == std::string::npos) continue;
      try {
        json r = json::parse(line.substr(b));
        recs.push_back(r);
        best = std::max(best, r.value("busbw_gbs", 0.0));
      } catch (const json::exception&) {
      }
    }
    detail["records"] = recs;
    if (!recs.empty()) {
      row["busbw_gbs_max"] = best;
      row["busbw_link_frac"] = best * 8e9 / c.net->rate_bps;
    }
    return !recs.empty();
  }
  const json sum = read_json_file(dir / "summary.json");
  if (sum.is_object()) {
    row["final_test_accuracy"] = sum.value("final_test_accuracy", json());
    row["time_to_target_s"] = sum.value("time_to_target_s", json());
    row["wall_s"] = sum.value("wall_time_s", json());
    row["bytes_on_wire"] = sum.value("bytes_on_wire", json());
  }
  // The curve holds every test evaluation: epoch ends and, with eval_every, the model copies evaluated after
  // training (records "eval"), in time order, so the plots show what time to target was read from. Throughput comes
  // from the epoch records alone. A record without bytes_sent plots no point against bytes.
  json curve = json::array();
  std::ifstream m(dir / "metrics.jsonl");
  std::string line;
  double sps = 0;
  while (std::getline(m, line)) {
    try {
      json r = json::parse(line);
      const std::string kind = r.value("kind", "");
      if (kind != "epoch" && kind != "eval") continue;
      // Fields read as numbers or left out: value() throws on a null, and a whole record went with it (an epoch
      // record under a scheme with eval_every has test_accuracy null, and its throughput was lost).
      auto number = [&](const char* key, const json& otherwise = json()) {
        return r.contains(key) && r[key].is_number() ? r[key] : otherwise;
      };
      if (kind == "epoch" && number("samples_per_s").is_number()) sps = number("samples_per_s").get<double>();
      // (a point needs its accuracy and time: the copies evaluated after training stand for that epoch)
      if (!number("test_accuracy").is_number() || !number("time_s").is_number()) continue;
      // (nor one that is no accuracy or time: a damaged record's 7 or -3 s set the plots' ranges)
      const double acc = number("test_accuracy").get<double>(), at = number("time_s").get<double>();
      if (!(acc >= 0 && acc <= 1) || !(at >= 0)) continue;
      json p = {{"kind", kind},
                {"epoch", number("epoch", 0)},
                {"time_s", number("time_s")},
                {"test_accuracy", number("test_accuracy")},
                {"bytes_sent", number("bytes_sent")}};
      if (kind == "eval") p["global_step"] = number("global_step", 0);
      if (kind == "epoch") p["samples_per_s"] = number("samples_per_s", 0.0);
      curve.push_back(std::move(p));
    } catch (const json::exception&) {
    }
  }
  std::stable_sort(curve.begin(), curve.end(),
                   [](const json& a, const json& b) { return a["time_s"].get<double>() < b["time_s"].get<double>(); });
  detail["curve"] = curve;
  if (sps > 0) row["samples_per_s"] = sps;
  std::ofstream dat(dir / "curve.dat");
  dat << "# time_s test_accuracy bytes_sent_MB (NaN: not recorded)\n";
  for (const auto& p : curve) {
    dat << p["time_s"].get<double>() << " " << p["test_accuracy"].get<double>() << " ";
    if (p["bytes_sent"].is_number())
      dat << p["bytes_sent"].get<double>() / 1e6 << "\n";
    else
      dat << "NaN\n";
  }
  return sum.is_object();
}

const std::vector<std::string> kColumns = {"cell",
                                           "label",
                                           "kind",
                                           "scheme",
                                           "compressor",
                                           "network",
                                           "bandwidth_mbit",
                                           "latency_ms",
                                           "loss_pct",
                                           "hosts",
                                           "seed",
                                           "status",
                                           "reason",
                                           "exit_code",
                                           "cell_s",
                                           "wall_s",
                                           "final_test_accuracy",
                                           "time_to_target_s",
                                           "bytes_on_wire",
                                           "net_bytes",
                                           "samples_per_s",
                                           "busbw_gbs_max",
                                           "busbw_link_frac",
                                           "output"};

// Each file whole or failing with one line (a full disk left a cut results.csv in place of the last good one).
void write_results(const fs::path& out, const json& rows, const json& details) {
  std::ostringstream csv;
  for (size_t i = 0; i < kColumns.size(); ++i) csv << (i ? "," : "") << kColumns[i];
  csv << "\n";
  for (const auto& r : rows) {
    for (size_t i = 0; i < kColumns.size(); ++i) csv << (i ? "," : "") << csv_field(r.value(kColumns[i], json()));
    csv << "\n";
  }
  json all = json::array();
  for (size_t i = 0; i < rows.size(); ++i) {
    json j = rows[i];
    j.update(details[i]);
    all.push_back(j);
  }
  write_text_file((out / "results.csv").string(), csv.str());
  write_text_file((out / "results.json").string(), all.dump(2) + "\n");
}

// Whether a cell's curve.dat holds a point (a line beyond its '#' header).
bool curve_has_points(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty() && line[0] != '#') return true;
  return false;
}

// One line of a plot against bandwidth: the cells of one label on the networks of one shape, every bandwidth a point
// whose value is the median of its cells (the seeds) with their range.
struct SeriesPoint {
  double x = 0, median = 0, lo = 0, hi = 0;
  int n = 0;  // cells (seeds) behind the point
};
struct Series {
  std::string title;
  std::vector<SeriesPoint> points;  // by bandwidth
};

// The lines of a plot whose x axis is the link bandwidth: one per (label, network shape), where the shape is every
// swept dimension of a network other than its bandwidth: latency and loss, and a hosts file's network is a shape of
// its own (its links are not a bandwidth's). The seeds of one point are summarised (median, min, max). Keyed by the
// label alone, one line joined points of other latencies and seeds, zigzagging between them at one bandwidth.
// value: the cell's number (nullopt: none); only cells whose status is ok count.
std::vector<Series> build_series(const std::vector<Cell>& cells, const json& rows,
                                 const std::function<std::optional<double>(const json&)>& value) {
  // The shapes in the plot: latency and loss are named in every title once any plotted cell has a non-zero one
  // (a failed cell is not plotted: its 5 ms alone made the others' titles say @0ms).
  bool any_latency = false, any_loss = false;
  for (size_t i = 0; i < cells.size() && i < rows.size(); ++i) {
    if (rows[i].value("status", "") != "ok" || !value(rows[i])) continue;
    const Cell& c = cells[i];
    any_latency = any_latency || (!c.net->hetero && c.net->latency_s > 0);
    any_loss = any_loss || (!c.net->hetero && c.net->loss > 0);
  }
  // Networks of one setting (bandwidth, latency, loss) under different labels: each is a line of its own, named by
  // its label (keyed by the setting alone, their cells were taken for seeds of one point).
  std::set<const Network*> twins;
  {
    std::map<std::tuple<double, double, double>, std::set<const Network*>> by_setting;
    for (const auto& c : cells)
      if (!c.net->hetero) by_setting[{c.net->rate_bps, c.net->latency_s, c.net->loss}].insert(c.net);
    for (const auto& [setting, nets] : by_setting)
      if (nets.size() > 1) twins.insert(nets.begin(), nets.end());
  }
  // (label, hetero, latency, loss, the label of a hetero or twin network): in that order, so 0 ms comes before 5 ms.
  using Key = std::tuple<std::string, bool, double, double, std::string>;
  std::map<Key, std::map<double, std::vector<double>>> groups;
  std::map<Key, std::string> titles;
  for (size_t i = 0; i < cells.size() && i < rows.size(); ++i) {
    if (rows[i].value("status", "") != "ok") continue;
    const auto v = value(rows[i]);
    if (!v) continue;
    const Cell& c = cells[i];
    const Network& n = *c.net;
    // (latency and loss rounded to what the title shows: 5ms and 5000us may differ in the last bit)
    const double lat = std::round(n.latency_s * 1e9) / 1e9, loss = std::round(n.loss * 1e9) / 1e9;
    const bool twin = twins.count(&n) > 0;
    const Key key = n.hetero ? Key{c.label, true, 0.0, 0.0, n.label}
                             : Key{c.label, false, lat, loss, twin ? n.label : std::string()};
    groups[key][n.rate_bps / 1e6].push_back(*v);
    if (!titles.count(key)) {
      std::vector<std::string> shape;
      if (n.hetero || twin) {
        shape.push_back(n.label);
      } else {
        if (any_latency) shape.push_back(fmt::format("{:g}ms", n.latency_s * 1e3));
        if (any_loss) shape.push_back(fmt::format("{:g}% loss", n.loss * 100));
      }
      titles[key] = shape.empty() ? c.label : fmt::format("{} @{}", c.label, fmt::join(shape, " "));
    }
  }
  std::vector<Series> out;
  for (auto& [key, by_x] : groups) {
    Series s;
    s.title = titles[key];
    for (auto& [x, ys] : by_x) {
      std::sort(ys.begin(), ys.end());
      const size_t m = ys.size() / 2;
      s.points.push_back({x, ys.size() % 2 ? ys[m] : (ys[m - 1] + ys[m]) / 2, ys.front(), ys.back(), int(ys.size())});
    }
    out.push_back(std::move(s));
  }
  return out;
}

// Writes plot.gp and the data files beside it, runs gnuplot; returns the PNGs made.
// target: the train cells' target accuracy (0: none), drawn as a dashed line on the accuracy plots.
std::vector<std::string> plot(const fs::path& out, const std::vector<Cell>& cells, const json& rows, double target) {
  std::ostringstream gp;
  gp << "set terminal pngcairo size 900,600 noenhanced\nset grid\nset key below\nset datafile missing 'NaN'\n";
  std::vector<std::string> pngs;
  std::vector<std::string> curves;  // plot clauses for per-cell curves
  for (size_t i = 0; i < cells.size(); ++i) {
    const auto& c = cells[i];
    if (c.kind == "bench" || rows[i].value("status", "") != "ok") continue;
    if (!curve_has_points(fs::path(c.dir) / "curve.dat")) continue;  // (a header alone broke the plot's x range)
    curves.push_back(fmt::format("{} using {{X}}:2 with linespoints title {}",
                                 gnuplot_quote(fs::relative(fs::path(c.dir) / "curve.dat", out).string()),
                                 gnuplot_quote(fmt::format("{} @{} s{}", c.label, c.net->label, c.seed))));
  }
  const auto join_plot = [&](const std::string& x) {
    std::string s;
    for (const auto& c : curves) {
      std::string t = c;
      t.replace(t.find("{X}"), 3, x);
      s += (s.empty() ? "" : ", \\\n  ") + t;
    }
    return s;
  };
  const std::string target_line =
      target > 0
          ? fmt::format(", \\\n  {} with lines dashtype 2 lc rgb 'gray' title 'target {:g}%'", target, 100 * target)
          : "";
  if (!curves.empty()) {
    gp << "set output 'accuracy_vs_time.png'\nset xlabel 'wall time (s)'\nset ylabel 'test accuracy'\n"
       << "set title 'Test accuracy vs wall time'\nplot " << join_plot("1") << target_line << "\n";
    // (the two sides count differently: Conduit its messages' bytes, the DDP peer its interface's transmitted
    // bytes, headers included; results.csv's net_bytes is the one measure of both)
    gp << "set output 'accuracy_vs_bytes.png'\nset xlabel 'bytes sent by rank 0 (MB; Conduit: messages, DDP: interface "
          "tx)'\n"
       << "set title 'Test accuracy vs bytes sent'\nplot " << join_plot("3") << target_line << "\n";
    pngs.insert(pngs.end(), {"accuracy_vs_time.png", "accuracy_vs_bytes.png"});
  }
  // Throughput vs bandwidth (train/ddp: samples/s; bench: the best busbw in Mbit/s): one line per label and network
  // shape (build_series); several seeds give each point the median and a bar from the lowest to the highest.
  const auto number = [](const json& r, const char* key, double scale) -> std::optional<double> {
    if (!r.contains(key) || !r[key].is_number() || !(r[key].get<double>() > 0)) return std::nullopt;  // (log axes)
    return r[key].get<double>() * scale;
  };
  const auto tput = build_series(cells, rows, [&](const json& r) { return number(r, "samples_per_s", 1); });
  const auto busbw = build_series(cells, rows, [&](const json& r) { return number(r, "busbw_gbs_max", 8e3); });
  // Each series into <stem>-K.dat ("bandwidth_mbit median min max seeds"); the plot clauses, and whether any point
  // summarises several seeds (then every line has its bars, and the title says so).
  const auto series = [&](const std::vector<Series>& all, const std::string& stem, bool& seeds) {
    seeds = false;
    for (const auto& s : all)
      for (const auto& p : s.points) seeds = seeds || p.n > 1;
    std::string clauses;
    int k = 0;
    for (const auto& s : all) {
      const std::string file = fmt::format("{}-{}.dat", stem, k++);
      std::ofstream d(out / file);
      d << "# bandwidth_mbit median min max seeds\n";
      for (const auto& p : s.points) d << p.x << " " << p.median << " " << p.lo << " " << p.hi << " " << p.n << "\n";
      clauses += (clauses.empty() ? "" : ", \\\n  ") +
                 fmt::format("{} using {} title {}", gnuplot_quote(file),
                             seeds ? "1:2:3:4 with yerrorlines" : "1:2 with linespoints", gnuplot_quote(s.title));
    }
    return clauses;
  };
  const auto over_seeds = [](bool seeds) { return seeds ? " (median over seeds, bars: lowest to highest)" : ""; };
  if (!tput.empty()) {
    bool seeds = false;
    const std::string s = series(tput, "throughput", seeds);
    gp << "set output 'throughput_vs_bandwidth.png'\nset logscale x\nset xlabel 'link bandwidth (Mbit/s)'\n"
       << "set ylabel 'training throughput (samples/s)'\nset title 'Throughput vs bandwidth" << over_seeds(seeds)
       << "'\nplot " << s << "\nunset logscale x\n";
    pngs.push_back("throughput_vs_bandwidth.png");
  }
  if (!busbw.empty()) {
    bool seeds = false;
    const std::string s = series(busbw, "busbw", seeds);
    gp << "set output 'busbw_vs_bandwidth.png'\nset logscale xy\nset xlabel 'link bandwidth (Mbit/s)'\n"
       << "set ylabel 'best busbw (Mbit/s)'\nset title 'Collective throughput vs bandwidth" << over_seeds(seeds)
       << "'\nplot " << s << ", x with lines dashtype 2 title 'link rate'\nunset logscale xy\n";
    pngs.push_back("busbw_vs_bandwidth.png");
  }
  if (pngs.empty()) return pngs;
  std::ofstream(out / "plot.gp") << gp.str();
  std::string log;
  const std::string cwd = fs::current_path().string();
  fs::current_path(out);
  const int rc = cl::run_program({"gnuplot", "plot.gp"}, &log);
  fs::current_path(cwd);
  if (rc != 0) {
    fmt::print(stderr, "sweep: gnuplot failed (exit {}): {}\n", rc, log.substr(0, log.find('\n')));
    return {};
  }
  return pngs;
}

// The train cells' target_accuracy (a number in (0, 1], as `conduit train` checks it), 0 when absent.
double train_target(const SweepSpec& s) {
  for (const auto& [flag, value] : s.train) {
    if (flag != "target-accuracy") continue;
    try {
      const double t = std::stod(value);
      return t > 0 && t <= 1 ? t : 0;
    } catch (const std::logic_error&) {
      return 0;
    }
  }
  return 0;
}

// A cell folder's name as make_cells writes it: "cell", the index in at least three digits, '-' (cell1000-... too:
// a test of the fourth digit left those of sweeps past 999 cells behind).
bool is_cell_folder_name(const std::string& name) {
  if (name.rfind("cell", 0) != 0) return false;
  const size_t end = name.find_first_not_of("0123456789", 4);
  return end != std::string::npos && end >= 7 && name[end] == '-';
}

// The plots and the files behind them (plot.gp, the series' .dat files) that a run or a replot wrote: a new one
// removes them before plotting, so none of an earlier one stays beside its results looking current. (the four plots
// by name: `-o .` or `-o docs` holds other images)
void remove_plots(const fs::path& out) {
  static const std::set<std::string> kPlots = {"accuracy_vs_time.png", "accuracy_vs_bytes.png",
                                               "throughput_vs_bandwidth.png", "busbw_vs_bandwidth.png"};
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    if (name == "plot.gp" ||
        (e.is_regular_file() &&
         (kPlots.count(name) > 0 ||
          ((name.rfind("throughput-", 0) == 0 || name.rfind("busbw-", 0) == 0) && name.ends_with(".dat")))))
      fs::remove_all(e.path());
  }
}

// What an earlier run into the folder wrote: its results, plots and cell folders (other files stay).
void remove_earlier_results(const fs::path& out) {
  remove_plots(out);
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    if (name == "results.csv" || name == "results.json" || (e.is_directory() && is_cell_folder_name(name)))
      fs::remove_all(e.path());
  }
}

// An exclusive lock on OUT/.sweep.lock, held while a sweep (or a replot) writes the folder: a second one is refused
// in one line (two sweeps into one folder removed each other's cell folders and wrote over each other's results).
// The descriptor is close-on-exec, so no cell's processes keep it.
class OutputLock {
 public:
  explicit OutputLock(const fs::path& out) {
    const std::string path = (out / ".sweep.lock").string();
    fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    // (flock takes a read-only descriptor: a lock file root's sweep left refused a user's replot of a folder the user
    // can write)
    const int first_err = errno;
    if (fd_ < 0 && first_err == EACCES) fd_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0)
      throw ConfigError(fmt::format("sweep: cannot open {}: {}; allowed: an output folder this user can write", path,
                                    std::strerror(first_err)));
    if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      close(fd_);
      if (err == EWOULDBLOCK)
        throw ConfigError(
            fmt::format("sweep: output {} is being written by another sweep (it holds {}); allowed: another -o "
                        "folder, or this one once that sweep has ended",
                        out.string(), path));
      throw ConfigError(
          fmt::format("sweep: cannot lock {}: {}; allowed: an output folder on a file system that "
                      "takes flock",
                      path, std::strerror(err)));
    }
  }
  ~OutputLock() { close(fd_); }
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

 private:
  int fd_ = -1;
};

// --replot: collects again every cell that results.json of an earlier run of the same file lists (its folder's
// summary, metrics and log) and rewrites results.csv, results.json and the plots; runs nothing and needs no root.
// For a sweep run by an older build, or one stopped part way.
void replot_sweep(const SweepSpec& s, const std::vector<Cell>& cells, const fs::path& out) {
  const fs::path file = out / "results.json";
  const json old = read_json_file(file);
  if (!old.is_array()) {
    throw ConfigError(
        fmt::format("sweep --replot: {} is missing or is not a sweep's results; run the sweep first", file.string()));
  }
  // (not while a sweep writes the folder: each wrote over the other's results)
  const OutputLock lock(out);
  // The columns a sweep writes, by their type (a damaged field ended the replot with a raw JSON exception, exit 1).
  static const std::set<std::string> kText = {"kind", "scheme", "compressor", "network", "reason", "output"};
  json rows = json::array(), details = json::array();
  std::vector<Cell> done;
  std::set<int64_t> seen;
  for (const auto& r : old) {
    const bool named = r.is_object() && r.contains("cell") && r["cell"].is_number_integer() && r.contains("label") &&
                       r["label"].is_string();
    const int64_t i = named ? r["cell"].get<int64_t>() : -1;
    const std::string label = named ? r["label"].get<std::string>() : "?";
    const auto bad = [&](const std::string& key, const std::string& must) {
      return ConfigError(
          fmt::format("sweep --replot: {} cell {}: {} must be {}; replot with the results.json the "
                      "sweep wrote",
                      file.string(), i, key, must));
    };
    if (named) {
      for (const auto& k : kColumns) {
        if (!r.contains(k) || k == "cell" || k == "label") continue;
        const json& v = r[k];
        if (k == "status") {
          if (!v.is_string() || (v != "ok" && v != "failed" && v != "timeout" && v != "stopped"))
            throw bad(k, "one of ok, failed, timeout, stopped");
        } else if (k == "seed") {
          if (!v.is_number_unsigned()) throw bad(k, "a whole number >= 0");
        } else if (k == "hosts") {
          if (!v.is_number_unsigned() || v.get<uint64_t>() < 1) throw bad(k, "a whole number >= 1");
        } else if (k == "network" || k == "kind") {
          if (!v.is_string()) throw bad(k, "a string");
        } else if (kText.count(k)) {
          if (!v.is_string() && !v.is_null()) throw bad(k, "a string or null");
        } else if (k == "bandwidth_mbit" || k == "latency_ms" || k == "loss_pct") {
          if (!v.is_number() || v.get<double>() < 0) throw bad(k, "a number >= 0");
        } else if (!v.is_number() && !v.is_null()) {
          throw bad(k, "a number or null");
        }
      }
    }
    // The cell's network and seed too: labels leave them out, so a file whose networks or seeds changed matched.
    const bool same = i >= 0 && i < int64_t(cells.size()) && label == cells[size_t(i)].label &&
                      (!r.contains("network") || r["network"] == json(cells[size_t(i)].net->label)) &&
                      (!r.contains("seed") || r["seed"] == json(cells[size_t(i)].seed));
    if (!same) {
      throw ConfigError(
          fmt::format("sweep --replot: {} lists cell {} ({}), which is not that cell of this file's "
                      "grid of {}; replot with the file the sweep ran",
                      file.string(), i, label, cells.size()));
    }
    // (twice, its seeds were counted twice in the plots' medians)
    if (!seen.insert(i).second)
      throw ConfigError(
          fmt::format("sweep --replot: {} lists cell {} ({}) twice; allowed: each cell once, as the "
                      "sweep wrote it",
                      file.string(), i, label));
    // What the row says of the cell's network and kind, as this file says it (a file whose network changed its
    // bandwidth under the same label replotted the old numbers at the new bandwidth).
    const Cell& c = cells[size_t(i)];
    const auto differs = [&](const char* key, const json& now) {
      if (!r.contains(key)) return;
      const bool equal = now.is_number() ? std::abs(r[key].get<double>() - now.get<double>()) <=
                                               1e-9 * std::max(1.0, std::abs(now.get<double>()))
                                         : r[key] == now;
      if (!equal)
        throw ConfigError(
            fmt::format("sweep --replot: {} cell {} ({}): {} is {} there and {} in this file's grid; "
                        "replot with the file the sweep ran",
                        file.string(), i, label, key, r[key].dump(), now.dump()));
    };
    differs("kind", c.kind);
    differs("bandwidth_mbit", c.net->rate_bps / 1e6);
    differs("latency_ms", c.net->latency_s * 1e3);
    differs("loss_pct", c.net->loss * 100);
    differs("hosts", s.hosts);
    // The cell's folder as the run named it (one written before folder names took the first 100 characters of a
    // label is longer than the name this version makes, and was not found).
    Cell cell = c;
    if (r.contains("output") && r["output"].is_string()) {
      const fs::path own = out / fs::path(r["output"].get<std::string>()).filename();
      std::error_code ec;
      if (is_cell_folder_name(own.filename().string()) && fs::is_directory(own, ec)) cell.dir = own.string();
    }
    json row = json::object();
    for (const auto& k : kColumns)
      if (r.contains(k)) row[k] = r[k];
    json detail = json::object();
    collect(cell, row, detail);
    rows.push_back(row);
    details.push_back(detail);
    done.push_back(cell);
  }
  write_results(out, rows, details);
  // (an earlier replot's plots stayed when this one plots nothing; without gnuplot they are kept, as it cannot
  // redraw them: they went, and the replot ended 0)
  std::string no_gnuplot;
  if (!find_program("gnuplot", &no_gnuplot)) {
    fmt::print(
        "replotted {} cells: {}/results.csv, results.json; plots: kept as they were (gnuplot: {}; the "
        "gnuplot-nox package redraws them)\n",
        rows.size(), out.string(), no_gnuplot);
    return;
  }
  remove_plots(out);
  const auto pngs = plot(out, done, rows, train_target(s));
  fmt::print("replotted {} cells: {}/results.csv, results.json; plots: {}\n", rows.size(), out.string(),
             pngs.empty() ? std::string("none") : fmt::format("{}", fmt::join(pngs, ", ")));
}

// This sweep's cluster: sweep<pid>-<6 of a-z0-9, random> (at most 22 characters: cluster names take 24). The pid
// alone was not unique: a user's cluster named sweep<pid> (a shell's $$ that then `exec`s the sweep) was "this
// sweep's" name, its `up` failed on it, and the failure path took the user's cluster down (an audit).
std::string sweep_cluster_name() {
  static constexpr char kChars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::random_device rd;
  std::string suffix;
  for (int k = 0; k < 6; ++k) suffix += kChars[rd() % (sizeof kChars - 1)];
  return fmt::format("sweep{}-{}", static_cast<long>(getpid()), suffix);
}

// True when the cluster a sweep marked as its own (owner "sweep") outlived that sweep: its process is gone, or the
// pid now belongs to a process that started at another time (a reused pid), or it is this process's pid (this sweep
// has made no cluster yet when it looks). `pid` is the recorded one, else the one in the name. Only a record of this
// pid namespace is judged: a container sharing /run whose sweep runs as the same pid (often 1) had its live cluster
// removed; a record without its namespace (before 2026-12-07) is never stale by its pid being this one.
bool sweep_cluster_is_stale(const cl::ClusterState& st, long pid) {
  if (st.owner_pid > 0) pid = st.owner_pid;
  if (pid <= 0 || pid > INT_MAX) return false;
  const unsigned long long ns = cl::own_pid_namespace();
  if (st.owner_pidns != 0 && ns != 0 && st.owner_pidns != ns) return false;
  if (pid == static_cast<long>(getpid())) return st.owner_pidns != 0 && st.owner_pidns == ns;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  // (alive: stale only when its start time is known and differs; unreadable, it is taken as the sweep's own)
  if (st.owner_start == 0) return false;
  const unsigned long long now = cl::process_start_time(pid);
  return now != 0 && now != st.owner_start;
}

void run_sweep(const std::string& file, std::string output, bool dry_run, bool replot) {
  if (fs::is_directory(file))
    throw ConfigError(fmt::format("sweep: {} is a directory; allowed: a sweep YAML file", file));
  SweepSpec s = load_spec(file);
  if (output.empty()) output = s.output.empty() ? "runs/sweep-" + sanitize(s.name) : s.output;
  const fs::path out = fs::absolute(output);
  const auto cells = make_cells(s, out.string());
  // Every (scheme, compressor) pair left out: nothing ran and the sweep said it succeeded; beside peers: or bench:
  // the Conduit cells asked for were dropped with a line the cells' output buried.
  const bool any_train = std::any_of(cells.begin(), cells.end(), [](const Cell& c) { return c.kind == "train"; });
  if (!s.schemes.empty() && !any_train)
    throw ConfigError(
        fmt::format("sweep: no Conduit cell to run: every scheme of schemes: averages parameters and takes no "
                    "gradient compressor, and compressors: has no none; allowed: add none to "
                    "compressors:, a scheme that compresses (bsp, dpsgd, ps-*), or leave schemes: out"));
  const std::string exe = self_exe();
  const std::string cluster = sweep_cluster_name();
  bool needs_sync = false;
  for (const auto& c : cells) needs_sync = needs_sync || (c.kind == "train" && c.scheme != "bsp");
  if (needs_sync && !train_supports_sync(exe)) {
    throw ConfigError("sweep: schemes other than bsp need `conduit train --sync`, which this build lacks");
  }
  fmt::print("sweep {}: {} cells on {} emulated hosts, output {}\n", s.name, cells.size(), s.hosts, out.string());
  for (const auto& sc : s.schemes)
    for (const auto& comp : s.compressors)
      if (!compressor_applies(sc, comp))
        fmt::print("sweep: left out {} with {}: {} averages parameters and takes no gradient compressor\n", sc, comp,
                   sc.substr(0, sc.find(':')));
  // Latency and loss need netem: a kernel without it refuses the sweep, --dry-run too once it has listed the cells
  // (it passed, and the run then failed; an audit). The probe makes a namespace, which needs root: without it
  // --dry-run says it did not look.
  auto needs_netem = [](const Network& n) {
    return std::any_of(n.links.begin(), n.links.end(),
                       [](const cl::LinkSpec& l) { return l.latency_s > 0 || l.loss > 0; });
  };
  auto check_netem = [&] {
    for (const auto& n : s.networks) {
      if (needs_netem(n) && !cl::kernel_has_netem())
        throw ConfigError(
            fmt::format("sweep: network {} asks for latency or loss, which need the netem qdisc; this "
                        "kernel has none (allowed here: bandwidth only)",
                        n.label));
    }
  };
  if (dry_run) {
    for (const auto& c : cells) {
      fmt::print("cell {}: {} @ {} seed {}: {}\n", c.index, c.label, c.net->label, c.seed,
                 fmt::join(cell_command(s, c, cluster, exe), " "));
    }
    std::fflush(stdout);
    if (geteuid() == 0) {
      check_netem();
    } else {
      for (const auto& n : s.networks)
        if (needs_netem(n))
          fmt::print(stderr,
                     "sweep: network {} asks for latency or loss, which need the netem qdisc: not probed "
                     "(that needs root); the run refuses it on a kernel without netem\n",
                     n.label);
    }
    return;
  }
  if (replot) {
    replot_sweep(s, cells, out);
    return;
  }
  if (geteuid() != 0) throw ConfigError("sweep: needs root (emulated clusters); run it with sudo");
  check_netem();
  // Clusters of sweeps that were killed (SIGKILL, a test's timeout): their namespaces stayed for good. Only those
  // whose sweep no longer runs (sweep_cluster_is_stale). Names sweep<pid>-<suffix>, and sweep<pid> of sweeps before
  // 2026-12-07 (an audit).
  static const std::regex sweep_name("^sweep([1-9][0-9]{0,9})(-[a-z0-9]+)?$");
  for (const auto& name : cl::list_clusters()) {
    std::smatch m;
    if (!std::regex_match(name, m, sweep_name)) continue;
    const long pid = std::strtol(m[1].str().c_str(), nullptr, 10);
    // Only clusters this machine's sweeps recorded (a state file here): namespaces of another container's sweep,
    // whose pid means nothing in this pid namespace, are not ours to judge.
    if (!fs::exists(cl::state_path(name))) continue;
    // Only a sweep's own (its state file says so): a user's cluster named sweep<digits> was taken down with the
    // processes inside it.
    cl::ClusterState st;
    try {
      st = cl::load_state(name);
    } catch (const std::exception&) {
      continue;  // (a damaged state file is not ours to judge either)
    }
    if (st.owner != "sweep" || !sweep_cluster_is_stale(st, pid)) continue;
    try {
      cl::down(name);
      fmt::print(stderr, "sweep: removed cluster {}, left by a sweep (pid {}) that no longer runs\n", name,
                 st.owner_pid > 0 ? st.owner_pid : pid);
    } catch (const std::exception& e) {
      fmt::print(stderr, "sweep: cluster {} of a sweep that no longer runs could not be removed: {}\n", name, e.what());
    }
  }
  make_output_dir(out, "sweep: output");
  // One sweep at a time into a folder, for the whole run: two at once removed each other's cell folders.
  const OutputLock lock(out);
  // What an earlier run into this folder wrote goes, but only once this run's first cell is about to write (its
  // cluster up): its plots, series and cell folders stayed beside this run's results (a run whose cells all failed
  // left the last run's accuracy plots looking current); removed at the start, a run that failed at its first
  // `cluster up` left the folder empty.
  bool cleared = false;
  const auto clear_earlier = [&] {
    if (cleared) return;
    cleared = true;
    remove_earlier_results(out);
  };
  // SIGHUP and SIGQUIT stop a sweep as SIGINT and SIGTERM do (by default they killed it with its cluster up); one
  // the caller ignores (nohup) stays ignored, as `cluster up` and the launcher keep it.
  struct sigaction sa {};
  struct sigaction old_handlers[4] = {};
  sa.sa_handler = on_stop;
  for (int i = 0; i < 4; ++i) {
    sigaction(kStops[i], nullptr, &old_handlers[i]);
    if (old_handlers[i].sa_handler != SIG_IGN) sigaction(kStops[i], &sa, nullptr);
  }
  auto restore_handlers = [&] {
    for (int i = 0; i < 4; ++i) sigaction(kStops[i], &old_handlers[i], nullptr);
  };
  g_stop = 0;
  json rows = json::array(), details = json::array();
  const Network* up_net = nullptr;
  int failed = 0;
  bool bringing_up = false;  // inside cl::down/cl::up, where a stop signal ends with an error
  // Takes the cluster down, saying why when that fails instead of throwing: its error replaced the one that ended
  // the sweep, and skipped restoring the handlers and writing the results. False when it failed.
  auto down_reporting = [&]() {
    if (up_net == nullptr) return true;
    up_net = nullptr;
    try {
      cl::down(cluster);
      return true;
    } catch (const std::exception& e) {
      fmt::print(stderr, "sweep: taking the cluster down: {}\n", e.what());
      return false;
    }
  };
  // The columns every row has: what the cell is.
  const auto cell_row = [&](const Cell& c) {
    return json{{"cell", c.index},
                {"label", c.label},
                {"kind", c.kind},
                {"scheme", c.kind == "bench" ? json() : json(c.scheme)},
                {"compressor", c.kind == "bench" ? json() : json(c.compressor)},
                {"network", c.net->label},
                {"bandwidth_mbit", c.net->rate_bps / 1e6},
                {"latency_ms", c.net->latency_s * 1e3},
                {"loss_pct", c.net->loss * 100},
                {"hosts", s.hosts},
                {"seed", c.seed},
                {"output", fs::relative(c.dir, out).string()}};
  };
  // A cell that could not start: failed with the reason, and the sweep goes on (its network's `cluster up` or its
  // folder failing ended the whole sweep, with no results or plots for the cells that ran).
  // (announced: its "[i/n] ..." is printed already)
  const auto fail_cell = [&](const Cell& c, const std::string& why, bool announced = false) {
    json row = cell_row(c);
    row["status"] = "failed";
    row["reason"] = why;
    rows.push_back(row);
    details.push_back(json::object());
    ++failed;
    if (!announced)
      fmt::print("[{}/{}] {} @ {} seed {} ... ", c.index + 1, cells.size(), c.label, c.net->label, c.seed);
    fmt::print("failed: {}\n", why);
    if (cleared) write_results(out, rows, details);
  };
  const Network* failed_net = nullptr;  // the network whose cluster did not come up, and why
  std::string failed_why;
  try {
    for (const auto& c : cells) {
      if (g_stop) break;
      if (c.net == failed_net) {
        fail_cell(c, failed_why);
        continue;
      }
      if (up_net != c.net) {
        bringing_up = true;
        if (up_net != nullptr) {
          cl::down(cluster);
          up_net = nullptr;
        }
        if (g_stop) break;  // a stop during the switch: the next cluster is not built for a cell that will not run
        bool claimed = false;
        try {
          cl::up(cluster, c.net->links, "sweep", &claimed);
        } catch (const std::exception& e) {
          if (g_stop) throw;  // (a stop: the sweep ends as a stopped one, below)
          // (`up` removed what it made) This network's cells fail; the next network's run.
          bringing_up = false;
          // What up could not remove of itself stays under this name, and every later network would fail on "a
          // cluster named ... exists": removed here, or the sweep ends as before. Only when this `up` claimed the
          // name: a cluster it found under the name is someone else's (it took down a user's cluster; an audit).
          if (claimed && (!cl::existing_namespaces(cluster).empty() || fs::exists(cl::state_path(cluster))))
            cl::down(cluster);
          failed_net = c.net;
          std::string why = e.what();
          failed_why = why.rfind("cluster up: ", 0) == 0 ? why : "cluster up: " + why;
          fmt::print(stderr, "sweep: network {}: {}; its cells are marked failed\n", c.net->label, failed_why);
          fail_cell(c, failed_why);
          continue;
        }
        up_net = c.net;
        bringing_up = false;
        // (a signal after `up` gave its handlers back: the cell ran on, and was marked stopped however it ended)
        if (g_stop) break;
      }
      clear_earlier();
      // A cell's folder starts empty: an earlier sweep's summary.json was read as this cell's result when the cell
      // failed before writing its own.
      const auto cmd = cell_command(s, c, cluster, exe);
      try {
        fs::remove_all(c.dir);
        fs::create_directories(c.dir);
        std::ofstream f(fs::path(c.dir) / "command.txt");
        f << fmt::format("{}\n", fmt::join(cmd, " "));
        f.close();
        if (!f) throw Error(fmt::format("cannot write {}", (fs::path(c.dir) / "command.txt").string()));
      } catch (const std::exception& e) {
        fail_cell(c, fmt::format("its folder: {}", e.what()));
        continue;
      }
      fmt::print("[{}/{}] {} @ {} seed {} ... ", c.index + 1, cells.size(), c.label, c.net->label, c.seed);
      std::fflush(stdout);
      const uint64_t rx0 = switch_rx_bytes(cluster);
      const auto t0 = std::chrono::steady_clock::now();
      bool timed_out = false, stopped = false;
      int rc = 0;
      try {
        rc = run_logged(cmd, (fs::path(c.dir) / "log.txt").string(), s.timeout_s, &timed_out, &stopped);
      } catch (const std::exception& e) {  // (its log not opened, or no fork: nothing started)
        fail_cell(c, e.what(), true);
        continue;
      }
      // The cell's time ends with its program (it also counted stopping what the cell left behind below, up to
      // seconds of SIGTERM and SIGKILL; an audit).
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // What the cell started and left behind (a worker's children after its launcher was killed) must not share
      // the hosts with the next cell: processes that survive SIGKILL end the sweep, after this cell's row is kept.
      std::string leftovers;
      try {
        cl::stop_processes(cluster);
      } catch (const std::exception& e) {
        leftovers = e.what();
      }
      const uint64_t rx1 = switch_rx_bytes(cluster);
      json row = cell_row(c);
      row["status"] = timed_out ? "timeout" : stopped ? "stopped" : rc == 0 ? "ok" : "failed";
      row["exit_code"] = rc;
      row["cell_s"] = secs;
      // null when a counter could not be read (0 - x wrapped to ~1.8e19)
      row["net_bytes"] = rx0 != kUnreadable && rx1 != kUnreadable && rx1 >= rx0 ? json(rx1 - rx0) : json();
      json detail = json::object();
      // A cell that exited 0 and wrote nothing (no summary.json, no bench record) has no results: it was "ok" with
      // empty columns.
      if (!collect(c, row, detail) && row["status"] == "ok") {
        row["status"] = "failed";
        row["reason"] = "no results";
      }
      if (row["status"] != "ok") ++failed;
      fmt::print("{}{} in {:.1f} s{}\n", row["status"].get<std::string>(),
                 row.contains("reason") ? fmt::format(" ({})", row["reason"].get<std::string>()) : "", secs,
                 row.contains("final_test_accuracy") && row["final_test_accuracy"].is_number()
                     ? fmt::format(", test acc {:.2f}%", 100 * row["final_test_accuracy"].get<double>())
                 : row.contains("busbw_gbs_max")
                     ? fmt::format(", best busbw {:.3f} GB/s = {:.0f}% of the link", row["busbw_gbs_max"].get<double>(),
                                   100 * row["busbw_link_frac"].get<double>())
                     : "");
      rows.push_back(row);
      details.push_back(detail);
      write_results(out, rows, details);  // after every cell, so an interrupted sweep keeps what it has
      if (!leftovers.empty()) throw Error(fmt::format("sweep: after cell {}: {}", c.label, leftovers));
    }
  } catch (const std::exception& e) {
    // A stop while a cluster came up ends `up` with an error naming the signal (it removed what it made): finish as
    // any stopped sweep, with the results so far and 128 + the signal (it exited 2 with that error). Any other error
    // is reported as before.
    if (!g_stop || !bringing_up) {
      down_reporting();
      restore_handlers();
      throw;
    }
  }
  const bool down_ok = down_reporting();
  restore_handlers();
  // No cell ran (every network's `cluster up` failed, or a stop came first): an earlier run's results stay as they
  // were, rather than be replaced by rows of cells that never started.
  std::error_code ec;
  if (!cleared && (fs::exists(out / "results.json", ec) || fs::exists(out / "results.csv", ec))) {
    fmt::print(stderr, "sweep: no cell ran; the earlier results in {} are left as they were\n", out.string());
  } else {
    clear_earlier();
    write_results(out, rows, details);
    const std::vector<Cell> done(cells.begin(), cells.begin() + static_cast<long>(rows.size()));
    const auto pngs = plot(out, done, rows, train_target(s));
    fmt::print("results: {}/results.csv, results.json; plots: {}\n", out.string(),
               pngs.empty() ? std::string("none") : fmt::format("{}", fmt::join(pngs, ", ")));
  }
  if (g_stop) {
    set_exit_code(128 + g_stop);
    // (and ends by the signal itself, as conduit launch does: a shell loop of sweeps took exit code 130 for a
    // handled signal and went on to the next)
    set_launcher_stop_signal(g_stop);
  } else if (failed > 0) {
    fmt::print(stderr,
               "sweep: {} of {} cells failed (results.csv's status and reason; a cell that ran has its "
               "log.txt)\n",
               failed, rows.size());
    set_exit_code(1);
  } else if (!down_ok) {
    set_exit_code(1);
  }
}

const bool kRegistered = register_command(50, [](CLI::App& app) {
  auto file = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  auto dry = std::make_shared<bool>(false);
  auto* c = app.add_subcommand(
      "sweep",
      "Run a grid (sync scheme x compressor x network x seed, plus PyTorch DDP peers and bench cells) on emulated "
      "clusters, one cell after another; results.csv, results.json and PNG plots");
  c->add_option("file", *file, "sweep YAML (see docs/cluster.md)")->required();
  c->add_option("-o,--output", *output, "output folder (default: the file's output, else runs/sweep-<name>)");
  auto replot = std::make_shared<bool>(false);
  auto* dry_flag = c->add_flag("--dry-run", *dry, "print the cells and their commands, run nothing");
  c->add_flag("--replot", *replot,
              "collect the cells an earlier run of this file wrote to the output folder again and redo its "
              "results and plots; run nothing")
      ->excludes(dry_flag);
  c->footer("Example: sudo conduit sweep bench/sweeps/smoke.yaml -o runs/smoke");
  c->callback([file, output, dry, replot]() { run_sweep(*file, *output, *dry, *replot); });
});

}  // namespace
}  // namespace conduit::cli
