#include "sim/calibrate.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/env.h"
#include "core/error.h"
#include "core/stats.h"
#include "sim/collective.h"
#include "sim/topology.h"
#include "sim/workload.h"

namespace conduit::sim {

std::vector<BenchSample> parse_bench_lines(const std::string& text, const std::string& origin, std::string* skipped) {
  std::vector<BenchSample> out;
  std::istringstream in(text);
  std::string line;
  int no = 0, other_impl = 0, one_rank = 0, empty = 0;
  while (std::getline(in, line)) {
    ++no;
    if (line.find('{') == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", origin, no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line.substr(line.find('{')));
    } catch (const std::exception&) {
      throw ConfigError(
          fmt::format("{}: not a JSON object (a truncated line?); allowed: the lines of `conduit bench "
                      "coll --json`, any prefix before the '{{'",
                      where));
    }
    if (!j.is_object() || !j.contains("op")) continue;   // another tool's record (bench gemm, a summary)
    if (j.contains("impl") && j["impl"] != "conduit") {  // a peer's (gloo, MPI) timing: not this runtime's
      ++other_impl;
      continue;
    }
    for (const char* f : {"world", "bytes", "time_us"})
      if (!j.contains(f) || !j[f].is_number())
        throw ConfigError(fmt::format("{}: a bench coll record needs {} as a number", where, f));
    for (const char* f : {"op", "algo", "transport"})
      if (j.contains(f) && !j[f].is_string())
        throw ConfigError(fmt::format("{}: a bench coll record's {} must be a string", where, f));
    BenchSample s;
    s.op = j["op"].get<std::string>();
    s.algo = j.value("algo", std::string("ring"));
    s.transport = j.value("transport", std::string("?"));
    // (written into the cluster file's YAML as is: "tcp # x" cut its description short, "a: b" broke the file)
    if (s.transport != "?" && (s.transport.empty() || s.transport.size() > 32 ||
                               s.transport.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                             "0123456789_.-") != std::string::npos))
      throw ConfigError(
          fmt::format("{}: transport = {} (allowed: a name of letters, digits, _ . -, as bench coll "
                      "writes: tcp, shm, mpi)",
                      where, j["transport"].dump()));
    const double world = j["world"].get<double>();
    if (!j["world"].is_number_integer() || world < 1 || world > 1024)
      throw ConfigError(
          fmt::format("{}: world = {} (allowed: a whole number of ranks, 1..1024, the most one "
                      "calibrated node holds)",
                      where, j["world"].dump()));
    s.world = static_cast<long long>(world);
    s.bytes = j["bytes"].get<double>();
    s.seconds = j["time_us"].get<double>() * 1e-6;
    // (a petabyte, or a time under a nanosecond, passed and spoiled the fit quietly)
    if (!(s.bytes >= 0) || !(s.bytes <= 1099511627776.0))
      throw ConfigError(
          fmt::format("{}: bytes = {} (allowed: 0 to 1 TiB, what a benchmark moves)", where, j["bytes"].dump()));
    // (1e300 us passed and spoiled the fit as tiny times did; no benchmarked collective takes 1e9 us, 17 minutes)
    if (!(s.seconds >= 1e-9) || !(s.seconds <= 1e3))
      throw ConfigError(fmt::format("{}: time_us = {} (allowed: 0.001 us to 1e9 us, what a benchmark measures)", where,
                                    j["time_us"].dump()));
    if (j.contains("segment_bytes")) {
      const auto& v = j["segment_bytes"];
      if (!v.is_number_integer() || v.get<double>() < 64 || v.get<double>() > 1073741824.0)
        throw ConfigError(
            fmt::format("{}: segment_bytes = {} (allowed: a whole number of bytes, 64 to 1 GiB)", where, v.dump()));
      s.segment = v.get<double>();
    }
    if (j.contains("stagger_us")) {
      if (!j["stagger_us"].is_number() || !(j["stagger_us"].get<double>() >= 0) ||
          !(j["stagger_us"].get<double>() <= 1e6))  // (1e300 passed)
        throw ConfigError(
            fmt::format("{}: stagger_us = {} (allowed: 0 to 1000000 us, what bench coll --stagger-us takes)", where,
                        j["stagger_us"].dump()));
      s.stagger = j["stagger_us"].get<double>() * 1e-6;
    }
    // bench coll writes the count of wrong elements, or null when it did not check; true says the run was wrong too,
    // anything else ("yes", false) is not its record (only a non-zero number was refused: `"wrong": true` and
    // `"wrong": "yes"` let a broken run into the fit).
    if (j.contains("wrong")) {
      const auto& w = j["wrong"];
      if ((w.is_number() && w.get<double>() != 0) || w == true)
        throw ConfigError(
            fmt::format("{}: the collective gave wrong results in this run (wrong = {}); calibrating on it "
                        "would fit a broken run: rerun the benchmark",
                        where, w.dump()));
      if (!w.is_null() && !w.is_number())
        throw ConfigError(
            fmt::format("{}: wrong = {} (allowed: a number, the count of wrong elements bench coll writes; null or no "
                        "field when it did not check)",
                        where, w.dump()));
    }
    if (s.world == 1) {  // nothing moves between ranks
      ++one_rank;
      continue;
    }
    if (s.bytes == 0) {
      ++empty;
      continue;
    }
    out.push_back(s);
  }
  std::vector<std::string> why;
  if (other_impl) why.push_back(fmt::format("{} of another implementation", other_impl));
  if (one_rank) why.push_back(fmt::format("{} with one rank", one_rank));
  if (empty) why.push_back(fmt::format("{} of 0 bytes", empty));
  if (skipped) *skipped = why.empty() ? std::string() : fmt::format("{}: skipped records: {}", origin, join(why, ", "));
  if (out.empty())
    throw ConfigError(
        fmt::format("{}: no `conduit bench coll --json` records of two or more ranks (op, world, bytes, time_us){}",
                    origin, why.empty() ? std::string() : " (" + join(why, ", ") + " skipped)"));
  return out;
}

namespace {
// Calls fn(record, line number) for every JSON object of `text`, one per line (text before a line's first '{' is a
// prefix such as "[rank 0] "; lines without one are skipped); a line that is not a JSON object is a ConfigError
// naming origin:line, with `hint` appended.
template <typename Fn>
void for_each_json_line(const std::string& text, const std::string& origin, const std::string& hint, Fn fn) {
  std::istringstream in(text);
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    const auto brace = line.find('{');
    if (brace == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line.substr(brace));
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("{}:{}: not a JSON record{}", origin, no, hint));
    }
    if (!j.is_object()) throw ConfigError(fmt::format("{}:{}: not a JSON object", origin, no));
    fn(j, no);
  }
}

template <typename T, typename Get>
double median_of(const std::vector<T>& v, Get get) {
  std::vector<double> x;
  for (const auto& e : v) x.push_back(get(e));
  return median(std::move(x));
}

// One element per group of `same` elements (in first-seen order), made by `merge` from the group.
template <typename T, typename Same, typename Merge>
std::vector<T> merge_by_median(const std::vector<T>& in, Same same, Merge merge) {
  std::vector<std::vector<T>> groups;
  for (const auto& e : in) {
    bool placed = false;
    for (auto& g : groups)
      if (same(g.front(), e)) {
        g.push_back(e);
        placed = true;
        break;
      }
    if (!placed) groups.push_back({e});
  }
  std::vector<T> out;
  for (auto& g : groups) out.push_back(merge(g));
  return out;
}
}  // namespace

// The ranges the cluster file takes back (cluster.cc), checked against the measurement's own line: out of them, the
// error named the file written from it (calibration[0].m = 1e12 is out of range).
void in_calibration_range(const std::string& origin, int no, const char* f, double v, double hi) {
  if (!(v >= 1 && v <= hi))
    throw ConfigError(fmt::format("{}:{}: field '{}' = {} (allowed: 1 to {:g}, as a cluster file's calibration)",
                                  origin, no, f, v, hi));
}

std::vector<GemmSample> parse_gemm_lines(const std::string& text, const std::string& origin) {
  std::vector<GemmSample> out;
  for_each_json_line(
      text, origin, R"( (allowed: {"m", "n", "k", "gflops"} per line))", [&](const nlohmann::json& j, int no) {
        if (j.contains("kind") && j["kind"] != "bench.gemm") return;  // e.g. bench.model_step lines
        auto field = [&](const char* f) {
          if (!j.contains(f) || !j[f].is_number() || !(j[f].get<double>() > 0) || !std::isfinite(j[f].get<double>()))
            throw ConfigError(fmt::format("{}:{}: field '{}' {} (a GEMM record needs positive numbers m, n, k, gflops)",
                                          origin, no, f, j.contains(f) ? "must be a positive number" : "is missing"));
          return j[f].get<double>();
        };
        GemmSample g;
        g.m = field("m");
        g.n = field("n");
        g.k = field("k");
        g.flops = field("gflops") * 1e9;
        for (auto [f, v] : {std::pair{"m", g.m}, {"n", g.n}, {"k", g.k}})
          in_calibration_range(origin, no, f, v, kMaxCalibratedDim);
        out.push_back(g);
      });
  if (out.empty())
    throw ConfigError(
        fmt::format("{}: no GEMM records {{m, n, k, gflops}} (write them with `conduit bench gemm --json`)", origin));
  return merge_by_median(
      out, [](const GemmSample& a, const GemmSample& b) { return a.m == b.m && a.n == b.n && a.k == b.k; },
      [](std::vector<GemmSample>& same) {
        GemmSample g = same.front();
        g.flops = median_of(same, [](const GemmSample& x) { return x.flops; });
        return g;
      });
}

std::vector<ConvSample> parse_conv_lines(const std::string& text, const std::string& origin) {
  std::vector<ConvSample> out;
  for_each_json_line(text, origin, "", [&](const nlohmann::json& j, int no) {
    if (!j.contains("kind") || j["kind"] != "bench.conv") return;
    // A positive number (lo = 0: greater than 0; else at least lo); `fallback` when absent if it is >= 0.
    auto field = [&](const char* f, double lo, double fallback) {
      if (!j.contains(f) && fallback >= 0) return fallback;
      if (j.contains(f) && j[f].is_number()) {
        const double v = j[f].get<double>();
        if (std::isfinite(v) && (lo > 0 ? v >= lo : lo == 0 && fallback == 0 ? v >= 0 : v > 0)) return v;
      }
      const char* need = !j.contains(f)             ? "is missing"
                         : lo > 0                   ? "must be a number >= 1"
                         : lo == 0 && fallback == 0 ? "must be a number >= 0"
                                                    : "must be a positive number";
      throw ConfigError(fmt::format(
          "{}:{}: field '{}' {} (a convolution record needs batch, in, out, height, width, kernel, forward_us, "
          "input_grad_us, weight_grad_us > 0; stride >= 1, padding >= 0)",
          origin, no, f, need));
    };
    ConvSample c;
    c.batch = field("batch", 0, -1);
    c.in = field("in", 0, -1);
    c.out = field("out", 0, -1);
    c.height = field("height", 0, -1);
    c.width = field("width", 0, -1);
    c.kernel = field("kernel", 0, -1);
    c.stride = field("stride", 1, 1);
    c.padding = field("padding", 0, 0);
    for (auto [f, v] :
         {std::pair{"batch", c.batch}, {"in", c.in}, {"out", c.out}, {"height", c.height}, {"width", c.width}})
      in_calibration_range(origin, no, f, v, kMaxCalibratedDim);
    for (auto [f, v] : {std::pair{"kernel", c.kernel}, {"stride", c.stride}})
      in_calibration_range(origin, no, f, v, kMaxCalibratedKernel);
    if (c.padding > kMaxCalibratedKernel)
      throw ConfigError(
          fmt::format("{}:{}: field 'padding' = {} (allowed: 0 to {:g})", origin, no, c.padding, kMaxCalibratedKernel));
    if (c.out_height() < 1 || c.out_width() < 1)
      throw ConfigError(fmt::format("{}:{}: field 'kernel' ({}) does not fit the input {}x{} padded by {}", origin, no,
                                    c.kernel, c.height, c.width, c.padding));
    c.forward_s = field("forward_us", 0, -1) * 1e-6;
    c.input_grad_s = field("input_grad_us", 0, -1) * 1e-6;
    c.weight_grad_s = field("weight_grad_us", 0, -1) * 1e-6;
    out.push_back(c);
  });
  return merge_by_median(
      out,
      [](const ConvSample& a, const ConvSample& b) {
        return a.batch == b.batch && a.in == b.in && a.out == b.out && a.height == b.height && a.width == b.width &&
               a.kernel == b.kernel && a.stride == b.stride && a.padding == b.padding;
      },
      [](std::vector<ConvSample>& same) {
        ConvSample c = same.front();
        c.forward_s = median_of(same, [](const ConvSample& x) { return x.forward_s; });
        c.input_grad_s = median_of(same, [](const ConvSample& x) { return x.input_grad_s; });
        c.weight_grad_s = median_of(same, [](const ConvSample& x) { return x.weight_grad_s; });
        return c;
      });
}

std::vector<PoolSample> parse_pool_lines(const std::string& text, const std::string& origin) {
  std::vector<PoolSample> out;
  for_each_json_line(text, origin, "", [&](const nlohmann::json& j, int no) {
    if (!j.contains("kind") || j["kind"] != "bench.pool") return;
    auto field = [&](const char* f) {
      if (j.contains(f) && j[f].is_number() && std::isfinite(j[f].get<double>()) && j[f].get<double>() > 0)
        return j[f].get<double>();
      throw ConfigError(fmt::format(
          "{}:{}: field '{}' {} (a pooling record needs batch, channels, height, width, kernel, forward_us, "
          "backward_us > 0)",
          origin, no, f, j.contains(f) ? "must be a positive number" : "is missing"));
    };
    PoolSample p;
    p.batch = field("batch");
    p.channels = field("channels");
    p.height = field("height");
    p.width = field("width");
    p.kernel = field("kernel");
    for (auto [f, v] :
         {std::pair{"batch", p.batch}, {"channels", p.channels}, {"height", p.height}, {"width", p.width}})
      in_calibration_range(origin, no, f, v, kMaxCalibratedDim);
    // (A kernel of 0.5 passed here and failed only in the written file, naming its field there, not this line.)
    in_calibration_range(origin, no, "kernel", p.kernel, kMaxCalibratedKernel);
    if (p.kernel > p.height || p.kernel > p.width)
      throw ConfigError(fmt::format("{}:{}: field 'kernel' ({}) is larger than the map {}x{}", origin, no, p.kernel,
                                    p.height, p.width));
    p.forward_s = field("forward_us") * 1e-6;
    p.backward_s = field("backward_us") * 1e-6;
    out.push_back(p);
  });
  return merge_by_median(
      out,
      [](const PoolSample& a, const PoolSample& b) {
        return a.batch == b.batch && a.channels == b.channels && a.height == b.height && a.width == b.width &&
               a.kernel == b.kernel;
      },
      [](std::vector<PoolSample>& same) {
        PoolSample p = same.front();
        p.forward_s = median_of(same, [](const PoolSample& x) { return x.forward_s; });
        p.backward_s = median_of(same, [](const PoolSample& x) { return x.backward_s; });
        return p;
      });
}

namespace {
// Linear interpolation between order statistics of sorted values (q in [0, 1]).
double sorted_quantile(const std::vector<double>& v, double q) {
  const double x = q * double(v.size() - 1);
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(x));
  return i + 1 < v.size() ? v[i] + (x - double(i)) * (v[i + 1] - v[i]) : v[i];
}
}  // namespace

std::vector<ModelStepSample> parse_model_step_lines(const std::string& text, const std::string& origin) {
  struct Pool {
    std::string layers;
    double batch = 0;
    std::vector<double> steps, synced;  // synced: step + barrier, when the records have barrier samples
    std::vector<double> optimizer;      // each record's median optimizer step
    std::vector<double> medians;        // each record's median step
    long long ranks = 0;
    bool all_synced = true;
  };
  std::vector<Pool> pools;
  for_each_json_line(text, origin, "", [&](const nlohmann::json& j, int no) {
    if (!j.contains("kind") || j["kind"] != "bench.model_step") return;
    if (!j.contains("layers") || !j["layers"].is_string() || j["layers"].get<std::string>().empty()) return;
    const std::string layers = j["layers"].get<std::string>();
    try {
      parse_layer_model(layers);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{}:{}: field 'layers': {}", origin, no, e.what()));
    }
    auto bad = [&](const char* f, const char* need) {
      return ConfigError(
          fmt::format("{}:{}: field '{}' {} (a model step record needs layers, batch > 0 and "
                      "step_samples_s: a list of positive seconds)",
                      origin, no, f, j.contains(f) ? need : "is missing"));
    };
    if (!j.contains("batch") || !j["batch"].is_number() || !(j["batch"].get<double>() > 0))
      throw bad("batch", "must be a positive number");
    const double batch = j["batch"].get<double>();
    in_calibration_range(origin, no, "batch", batch, kMaxCalibratedDim);
    if (!j.contains("step_samples_s") || !j["step_samples_s"].is_array() || j["step_samples_s"].empty())
      throw bad("step_samples_s", "must be a non-empty list of positive seconds");
    Pool* p = nullptr;
    for (auto& q : pools)
      if (q.layers == layers && q.batch == batch) p = &q;
    if (!p) {
      p = &pools.emplace_back();
      p->layers = layers;
      p->batch = batch;
    }
    const auto& st = j["step_samples_s"];
    const size_t first = p->steps.size();
    for (const auto& v : st) {
      if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
        throw bad("step_samples_s", "must be a non-empty list of positive seconds");
      p->steps.push_back(v.get<double>());
    }
    std::vector<double> mine(p->steps.begin() + static_cast<std::ptrdiff_t>(first), p->steps.end());  // this record's
    std::sort(mine.begin(), mine.end());
    p->medians.push_back(sorted_quantile(mine, 0.5));
    if (j.contains("optimizer_s")) {
      if (!j["optimizer_s"].is_number() || !(j["optimizer_s"].get<double>() > 0))
        throw bad("optimizer_s", "must be a positive number");
      p->optimizer.push_back(j["optimizer_s"].get<double>());
    }
    // Steps that ended in a barrier among `concurrent` ranks: one wait per step.
    const long long ranks =
        j.contains("concurrent") && j["concurrent"].is_number_integer() ? j["concurrent"].get<long long>() : 1;
    const bool synced = ranks > 1 && j.contains("barrier_samples_s") && j["barrier_samples_s"].is_array() &&
                        !j["barrier_samples_s"].empty();
    if (!synced) {
      p->all_synced = false;
      return;
    }
    const auto& bw = j["barrier_samples_s"];
    if (bw.size() != st.size())
      throw ConfigError(
          fmt::format("{}:{}: field 'barrier_samples_s' has {} samples, step_samples_s {} (one each "
                      "per step)",
                      origin, no, bw.size(), st.size()));
    for (size_t k = 0; k < bw.size(); ++k) {
      if (!bw[k].is_number() || !(bw[k].get<double>() >= 0) || !std::isfinite(bw[k].get<double>()))
        throw ConfigError(
            fmt::format("{}:{}: field 'barrier_samples_s' must be a list of non-negative seconds", origin, no));
      p->synced.push_back(st[k].get<double>() + bw[k].get<double>());
    }
    p->ranks = ranks;
  });
  std::vector<ModelStepSample> out;
  for (auto& p : pools) {
    std::sort(p.steps.begin(), p.steps.end());
    ModelStepSample m;
    m.layers = p.layers;
    m.batch = p.batch;
    for (int i = 0; i <= 20; ++i) m.quantiles.push_back(sorted_quantile(p.steps, i / 20.0));
    const auto [lo, hi] = std::minmax_element(p.medians.begin(), p.medians.end());
    m.rank_spread = *hi / *lo;
    if (!p.optimizer.empty()) {
      std::sort(p.optimizer.begin(), p.optimizer.end());
      m.optimizer = sorted_quantile(p.optimizer, 0.5);
    }
    if (p.all_synced && !p.synced.empty()) {
      std::sort(p.synced.begin(), p.synced.end());
      m.wait_ranks = double(p.ranks);
      m.slowest_wait = std::max(0.0, sorted_quantile(p.synced, 0.5) - sorted_quantile(p.steps, 0.5));
    }
    out.push_back(m);
  }
  return out;
}

long long bench_concurrency(const std::string& text, const std::string& origin) {
  long long seen = 0;
  for_each_json_line(text, origin, "", [&](const nlohmann::json& j, int no) {
    long long c = 1;
    if (j.contains("concurrent")) {
      if (!j["concurrent"].is_number_integer() || j["concurrent"].get<long long>() < 1)
        throw ConfigError(fmt::format("{}:{}: field 'concurrent' must be a positive integer", origin, no));
      c = j["concurrent"].get<long long>();
    }
    if (seen != 0 && c != seen)
      throw ConfigError(
          fmt::format("{}:{}: field 'concurrent' = {}, but earlier records say {} (time each file with "
                      "one number of concurrent processes)",
                      origin, no, c, seen));
    seen = c;
  });
  return seen == 0 ? 1 : seen;
}

std::vector<PoolSample> calibration_pool_shapes(double batch) {
  std::vector<PoolSample> out;
  for (const auto& l : parse_layer_model(kTrainCnnLayers).layers) {
    if (l.kind != "pool") continue;
    PoolSample p;
    p.batch = batch;
    p.channels = l.in;
    p.height = l.height;
    p.width = l.width;
    p.kernel = l.kernel;
    out.push_back(p);
  }
  return out;
}

std::vector<ConvSample> calibration_conv_shapes(double batch) {
  std::vector<ConvSample> out;
  for (const auto& l : parse_layer_model(kTrainCnnLayers).layers) {
    if (l.kind != "conv") continue;
    ConvSample c;
    c.batch = batch;
    c.in = l.in;
    c.out = l.out;
    c.height = l.height;  // stride 1, padding k / 2: the input is the output's size
    c.width = l.width;
    c.kernel = l.kernel;
    c.stride = 1;
    c.padding = std::floor(l.kernel / 2);
    out.push_back(c);
  }
  return out;
}

std::vector<GemmShape> calibration_gemm_shapes(double batch) {
  std::vector<GemmShape> all;
  for (const char* spec : {kTrainCnnLayers, kTrainMlpLayers})
    for (const auto& g : layer_step_gemms(parse_layer_model(spec), batch)) all.push_back(g);
  for (double s = 32; s <= 1024; s *= 2) all.push_back({s, s, s, 1});
  std::vector<GemmShape> out;
  for (const auto& g : all) {
    bool dup = false;
    for (const auto& o : out) dup |= o.m == g.m && o.n == g.n && o.k == g.k;
    if (!dup) out.push_back(g);
  }
  return out;
}

bool bench_collective(const std::string& s, Collective& c) {
  if (s == "allreduce")
    c = Collective::kAllReduce;
  else if (s == "reduce_scatter" || s == "reduce-scatter")
    c = Collective::kReduceScatter;
  else if (s == "allgather")
    c = Collective::kAllGather;
  else if (s == "broadcast")
    c = Collective::kBroadcast;
  else if (s == "reduce")
    c = Collective::kReduce;
  else
    return false;
  return true;
}

bool bench_algorithm(Collective c, std::string s, long long world, Algorithm& a) {
  std::replace(s.begin(), s.end(), '_', '-');
  const bool pow2 = world > 0 && (world & (world - 1)) == 0;
  // The runtime's names per operation (src/coll/tuner.cc: allreduce ring, rhd, rd, tree; reduce-scatter ring, rh;
  // allgather ring, rd; broadcast tree, chain; reduce tree, rsg) and the simulator's. The runtime's recursive
  // halving reduce-scatter and recursive doubling allgather are the halving-doubling patterns (at a non-power of two
  // the reduce-scatter folds as the runtime's, the allgather runs the ring as the runtime's).
  if (s == "ring") {
    a = Algorithm::kRing;
  } else if (s == "rhd" || s == "halving-doubling" || s == "rabenseifner" || s == "recursive-halving") {
    a = Algorithm::kHalvingDoubling;
  } else if (s == "rh" && c == Collective::kReduceScatter) {
    a = Algorithm::kHalvingDoubling;  // (any size: the simulator folds as the runtime does)
  } else if (s == "rd" && c == Collective::kAllGather) {
    a = pow2 ? Algorithm::kHalvingDoubling : Algorithm::kRing;
  } else if (s == "rd" || s == "recursive-doubling") {
    a = Algorithm::kRecursiveDoubling;
  } else if (s == "chain" && c == Collective::kBroadcast) {
    a = Algorithm::kRing;  // the pipelined chain
  } else if (s == "tree" || s == "binomial" || s == "binomial-tree") {
    a = Algorithm::kBinomialTree;
  } else if (s == "double-binary-tree") {
    a = Algorithm::kDoubleBinaryTree;
  } else if ((s == "rsg" || s == "reduce-scatter-gather") && c == Collective::kReduce) {
    a = Algorithm::kReduceScatterGather;
  } else {
    return false;
  }
  // Only patterns the simulator has for this operation (rd names recursive doubling only for allreduce).
  try {
    Topology flat(flat_cluster(1.0, 1.0, 1.0), std::max<long long>(world, 2));
    CollectiveModel(flat).profile(c, a, Group{std::max<long long>(world, 2), 1, 0});
  } catch (const Error&) {
    return false;
  }
  return true;
}

namespace {

// Solves the 3x3 normal equations restricted to the `active` unknowns.
std::vector<double> least_squares(const std::vector<std::array<double, 3>>& X, const std::vector<double>& y,
                                  const std::array<bool, 3>& active) {
  std::vector<int> idx;
  for (int i = 0; i < 3; ++i)
    if (active[i]) idx.push_back(i);
  const size_t k = idx.size();
  std::vector<std::vector<double>> A(k, std::vector<double>(k + 1, 0.0));
  for (size_t r = 0; r < X.size(); ++r)
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = 0; j < k; ++j) A[i][j] += X[r][idx[i]] * X[r][idx[j]];
      A[i][k] += X[r][idx[i]] * y[r];
    }
  for (size_t c = 0; c < k; ++c) {  // Gauss-Jordan with partial pivoting
    size_t piv = c;
    for (size_t r = c + 1; r < k; ++r)
      if (std::abs(A[r][c]) > std::abs(A[piv][c])) piv = r;
    std::swap(A[c], A[piv]);
    if (std::abs(A[c][c]) < 1e-300) continue;
    for (size_t r = 0; r < k; ++r) {
      if (r == c) continue;
      double f = A[r][c] / A[c][c];
      for (size_t j = c; j <= k; ++j) A[r][j] -= f * A[c][j];
    }
  }
  std::vector<double> x(3, 0.0);
  for (size_t i = 0; i < k; ++i) x[idx[i]] = std::abs(A[i][i]) > 1e-300 ? A[i][k] / A[i][i] : 0.0;
  return x;
}

}  // namespace

namespace {
// The coefficients of alpha, beta and gamma in a sample's time, read off its pattern on a flat network with
// alpha = beta = gamma = 1 (per byte: times the sample's bytes); false when the simulator does not model it.
bool sample_coefficients(const BenchSample& s, std::array<double, 3>& coef) {
  Collective c;
  Algorithm a;
  if (!bench_collective(s.op, c) || !bench_algorithm(c, s.algo, s.world, a)) return false;
  ClusterSpec unit = flat_cluster(1.0, 1.0, 1.0);
  unit.network.pipeline_segment = s.segment;
  Topology flat(unit, s.world);
  CollectiveModel m(flat);
  CollectiveCost cost;
  try {
    cost = m.profile(c, a, Group{s.world, 1, 0});
  } catch (const Error&) {
    return false;
  }
  // (a chain's further segments pay alpha each, its fill moves and reduces the first segment over the other hops)
  const double first = cost.segment > 0 ? std::min(s.bytes, cost.segment) : 0.0;
  const double more = cost.segment > 0 && s.bytes > 0 ? std::ceil(s.bytes / cost.segment) - 1 : 0.0;
  coef = {cost.latency + more * cost.segment_latency, cost.per_byte * s.bytes + first * cost.fill_per_byte,
          cost.reduce_frac * s.bytes + first * cost.fill_reduce};
  return true;
}
}  // namespace

bool fit_uses(const BenchSample& s) {
  std::array<double, 3> k;
  return s.stagger <= 0 && sample_coefficients(s, k);
}

AlphaBetaGamma fit_alpha_beta_gamma(const std::vector<BenchSample>& samples, int* unmodelled) {
  std::vector<std::array<double, 3>> X;
  std::vector<double> y;
  int skip = 0, late = 0;
  std::map<double, size_t> segments;  // the runtime's segment size: samples that ran with it
  for (const auto& s : samples) {
    if (s.stagger > 0) {
      ++late;
      continue;
    }
    std::array<double, 3> k;
    if (!sample_coefficients(s, k)) {
      ++skip;
      continue;
    }
    ++segments[s.segment];
    // Weight each sample by 1/time so that small and large messages count alike (relative error).
    const double w = 1.0 / s.seconds;
    X.push_back({k[0] * w, k[1] * w, k[2] * w});
    y.push_back(1.0);
  }
  if (unmodelled) *unmodelled = skip;
  if (X.size() < 3)
    throw ConfigError(fmt::format(
        "calibrate: {} usable back-to-back samples{}{}; need at least 3 (sweep sizes with `conduit bench coll "
        "--json -b 8 -e 64M`, without --stagger-us)",
        X.size(), late ? fmt::format(" ({} staggered ones only give the wake latency)", late) : std::string(),
        skip ? fmt::format(" ({} of an operation or algorithm the simulator does not model, e.g. reduce rsg)", skip)
             : std::string()));
  // One message size (or sizes that keep every sample's latency and bandwidth terms in one ratio) cannot tell alpha
  // from beta: any split fits alike, and rounding picked one (two files a byte apart gave 13 and 8 us).
  {
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    bool proportional = true;
    for (const auto& r : X) {
      if (r[0] <= 0 || r[1] <= 0) {
        proportional = proportional && r[0] <= 0 && r[1] <= 0;
        continue;
      }
      lo = std::min(lo, r[1] / r[0]);
      hi = std::max(hi, r[1] / r[0]);
    }
    if (proportional && lo <= hi && hi - lo <= 1e-9 * hi)
      throw ConfigError(
          "calibrate: every sample's latency and bandwidth terms keep one ratio (one message size), so alpha and "
          "beta cannot be told apart; sweep sizes with `conduit bench coll --json -b 8 -e 64M`");
  }
  bool any_gamma = false;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;  // gamma's coefficient over beta's, per sample
  for (const auto& r : X) {
    any_gamma |= r[2] > 0;
    if (r[1] > 0) {
      lo = std::min(lo, r[2] / r[1]);
      hi = std::max(hi, r[2] / r[1]);
    }
  }
  // Proportional columns make the normal equations singular: the split between beta and gamma is then rounding.
  const bool inseparable = any_gamma && lo <= hi && hi - lo <= 1e-9 * hi;
  // Non-negative least squares: the optimum is the unconstrained fit over the unknowns it leaves non-zero (its KKT
  // conditions), so the best of the non-negative fits over every subset of the three unknowns is it, the larger
  // subsets first on a tie. (Dropping every negative coefficient at once and refitting could miss it: a residual up
  // to 2x the optimum's on noisy samples.)
  auto squared_error = [&](const std::vector<double>& c) {  // (each sample's relative error: its time is 1 here)
    double se = 0;
    for (const auto& r : X) {
      const double e = r[0] * c[0] + r[1] * c[1] + r[2] * c[2] - 1;
      se += e * e;
    }
    return se;
  };
  std::vector<double> x(3, 0.0);
  double best = std::numeric_limits<double>::infinity();
  for (int set : {7, 3, 5, 6, 1, 2, 4}) {
    if ((set & 4) && (!any_gamma || inseparable)) continue;
    const std::array<bool, 3> active{(set & 1) != 0, (set & 2) != 0, (set & 4) != 0};
    const std::vector<double> c = least_squares(X, y, active);
    if (!std::all_of(c.begin(), c.end(), [](double v) { return v >= 0 && std::isfinite(v); })) continue;
    const double se = squared_error(c);
    if (se < best * (1 - 1e-12)) {
      best = se;
      x = c;
    }
  }
  AlphaBetaGamma f;
  f.alpha = std::max(0.0, x[0]);
  f.beta = std::max(0.0, x[1]);
  f.gamma = std::max(0.0, x[2]);
  f.samples = X.size();
  f.gamma_inseparable = inseparable;
  f.pipeline_segment =
      std::max_element(segments.begin(), segments.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
  f.rms_relative_error = std::sqrt(squared_error({f.alpha, f.beta, f.gamma}) / X.size());
  return f;
}

double fit_wake_latency(const std::vector<BenchSample>& samples, const AlphaBetaGamma& fit, size_t* used) {
  std::vector<double> extra;
  for (const auto& s : samples) {
    std::array<double, 3> k;
    if (s.stagger <= 0 || !sample_coefficients(s, k)) continue;
    extra.push_back(s.seconds - (k[0] * fit.alpha + k[1] * fit.beta + k[2] * fit.gamma));
  }
  if (used) *used = extra.size();
  if (extra.empty()) return 0;
  return std::max(0.0, median(std::move(extra)));
}

double measure_memory_bandwidth(size_t bytes, int repeats) {
  const size_t n = bytes / sizeof(double);
  std::vector<double> a(n, 1.0), b(n, 2.0), c(n, 0.0);
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < n; ++i) c[i] = a[i] + 1.5 * b[i];
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile double sink = c[n / 2];
    (void)sink;
    best = std::max(best, 3.0 * n * sizeof(double) / dt);
  }
  return best;
}

std::string calibrated_cluster_yaml(const std::string& name, int ranks, const AlphaBetaGamma& fit,
                                    double memory_bandwidth, double memory_bytes, double peak_flops,
                                    const std::vector<GemmSample>& gemms, const std::string& transport, double share,
                                    const std::vector<ConvSample>& convs, const std::vector<PoolSample>& pools,
                                    const std::vector<ModelStepSample>& models) {
  if (!(share > 0) || share > 1) throw ConfigError(fmt::format("calibrate: share = {} must be in (0, 1]", share));
  std::string y;
  y += fmt::format("# Written by `conduit sim calibrate` from {} `conduit bench coll --json` samples over {}\n",
                   fit.samples, transport);
  y += fmt::format("# (fit: alpha {:.3g} s/step, beta {:.3g} s/B, gamma {:.3g} s/B; rms relative error {:.1f}%).\n",
                   fit.alpha, fit.beta, fit.gamma, 100 * fit.rms_relative_error);
  if (fit.gamma_inseparable)
    y += "# The samples reduce bytes in the same proportion to those they move: gamma (0) is folded into beta.\n";
  y += fmt::format("name: {}\ndescription: this machine, {} ranks over {}, calibrated\nnodes:\n", name, ranks,
                   transport);
  y += fmt::format("  - name: local\n    gpus: {}\n    accelerator:\n      name: calibrated-worker\n", ranks);
  if (share < 1)
    y += fmt::format("      # each rank runs on {:.3g} of a core: measured (one-thread) rates below are scaled by it\n",
                     share);
  y += fmt::format("      peak_bf16: {:.6g} GFLOP/s   # fp32 on this CPU\n", peak_flops * share / 1e9);
  y += fmt::format("      memory: {:.6g} GB\n", memory_bytes / 1e9);
  y += fmt::format("      memory_bandwidth: {:.6g} GB/s   # measured one-thread copy bandwidth x share\n",
                   memory_bandwidth * share / 1e9);
  y += "      sm_count: 1\n      gemm_tile: [64, 64]\n      gemm_efficiency: 1.0\n      memory_efficiency: 1.0\n";
  y += "      kernel_overhead: 1 us\n";
  if (!gemms.empty()) {
    y += "      calibration:\n";
    for (const auto& g : gemms)
      y += fmt::format("        - {{m: {}, n: {}, k: {}, achieved: {:.6g} GFLOP/s}}\n", g.m, g.n, g.k,
                       g.flops * share / 1e9);
  }
  if (!convs.empty()) {
    y += "      conv_calibration:   # measured convolutions (forward, input and weight gradients), times / share\n";
    for (const auto& c : convs)
      y += fmt::format(
          "        - {{batch: {}, in: {}, out: {}, height: {}, width: {}, kernel: {}, stride: {}, padding: {}, "
          "forward: {:.6g} us, input_grad: {:.6g} us, weight_grad: {:.6g} us}}\n",
          c.batch, c.in, c.out, c.height, c.width, c.kernel, c.stride, c.padding, c.forward_s / share * 1e6,
          c.input_grad_s / share * 1e6, c.weight_grad_s / share * 1e6);
  }
  if (!pools.empty()) {
    y += "      pool_calibration:   # measured max poolings (forward with indices, backward), times / share\n";
    for (const auto& p : pools)
      y += fmt::format(
          "        - {{batch: {}, channels: {}, height: {}, width: {}, kernel: {}, forward: {:.6g} us, backward: "
          "{:.6g} "
          "us}}\n",
          p.batch, p.channels, p.height, p.width, p.kernel, p.forward_s / share * 1e6, p.backward_s / share * 1e6);
  }
  if (!models.empty()) {
    y += "      model_calibration:   # measured training steps without the gradient exchange (zero grads, batch, "
         "forward,\n";
    y += "                           # backward with gradient copies, and the loss and accuracy read back after the\n";
    y += "                           # optimizer), quantiles 0, 0.05, ..., 1 of the steps, times / share\n";
    for (const auto& m : models) {
      std::string q;
      for (double t : m.quantiles) q += fmt::format("{}{:.6g} us", q.empty() ? "" : ", ", t / share * 1e6);
      const std::string wait = m.wait_ranks > 0 ? fmt::format(", wait_ranks: {}, slowest_wait: {:.6g} us", m.wait_ranks,
                                                              m.slowest_wait / share * 1e6)
                                                : "";
      const std::string opt = m.optimizer > 0 ? fmt::format(", optimizer: {:.6g} us", m.optimizer / share * 1e6) : "";
      y += fmt::format("        - {{layers: \"{}\", batch: {}, step_quantiles: [{}]{}{}}}\n", m.layers, m.batch, q,
                       wait, opt);
    }
  }
  // 1 PB/s at most (what cluster files take): a fit over small messages can give a beta of (almost) 0.
  const double bw = fit.beta > 1e-15 ? 1.0 / fit.beta : 1e15;
  y += fmt::format("    intra:\n      kind: nvswitch\n      bandwidth: {:.6g} MB/s\n      latency: 0 us\n", bw / 1e6);
  y += fmt::format("    nics: 1\n    nic:\n      bandwidth: {:.6g} MB/s\n      latency: 0 us\n", bw / 1e6);
  y += "network:\n  topology: fat-tree\n  nodes_per_leaf: 1\n  oversubscription: 1\n  switch_latency: 0 us\n";
  y += fmt::format("  software_overhead: {:.6g} us\n", fit.alpha * 1e6);
  if (fit.wake > 0)
    y += fmt::format("  wake_latency: {:.6g} us   # per call, measured with the last rank arriving late\n",
                     fit.wake * 1e6);
  y += fmt::format("  reduction_bandwidth: {:.6g} MB/s\n", fit.gamma > 1e-15 ? 1.0 / fit.gamma / 1e6 : 1e9);
  y += fmt::format("  pipeline_segment: {:.0f} B   # the runtime's CONDUIT_RING_SEGMENT_BYTES in the benchmark\n",
                   fit.pipeline_segment);
  y += "  in_network_reduction: false\n";
  return y;
}

}  // namespace conduit::sim
