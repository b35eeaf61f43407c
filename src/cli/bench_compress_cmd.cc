// `conduit bench compress`: compress and decompress throughput (GB/s of f32 input) of every compressor, its
// compression ratio, and the single-core memcpy bandwidth measured in the same run as the limit.
// `conduit selftest-compress` (hidden): every compressed collective over this job's ranks (any transport, started
// by `conduit launch`) checked against decompress-then-reduce computed locally; used by the process tests.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "cli/registry.h"
#include "coll/communicator.h"
#include "compress/collectives.h"
#include "compress/compressor.h"
#include "compress/detail.h"
#include "compress/powersgd.h"
#include "core/clock.h"
#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"

namespace conduit::cli {
namespace {

using namespace conduit::compress;

struct CompressBenchArgs {
  std::string methods = "all";
  std::string sizes = "1M,10M,100M";
  double min_time = 0.2;  // seconds per measurement (at least 2 repetitions; the best is kept)
  bool json = false;
};

constexpr uint64_t kMaxWarmupCalls = 1000;
// The largest tensor: 2^32 - 1 f32 elements, the most the sparsifiers and quantizers index (check_u32_elements).
constexpr double kMaxBenchBytes = 4.0 * 4294967295.0;

size_t parse_size(const std::string& s) {
  // (parse_bytes, as bench coll's sizes: stod took 0x10 and 1e3)
  auto bad = [&]() {
    return ConfigError(
        fmt::format("--size '{}' must be a byte count from 4 B to 16G - 4 B (2^32 - 1 f32 elements, the most the "
                    "sparsifiers index), a multiple of 4, with an optional K, M or G suffix (powers of 1024), e.g. "
                    "1M,10M,100M",
                    s));
  };
  uint64_t v = 0;
  try {
    v = parse_bytes(s, "--size");
  } catch (const ConfigError&) {
    throw bad();
  }
  if (v < 4 || static_cast<double>(v) > kMaxBenchBytes || v % 4 != 0) throw bad();
  // An input, its output, the payload and a method's state (DGC's two buffers, an error-feedback residual) are held
  // at once, about 5x the size: at most half of the memory this process may use (--size 12G went to the
  // out-of-memory killer on a 23 GB machine).
  const double mem = usable_memory_bytes();
  if (mem > 0 && 5.0 * static_cast<double>(v) > mem / 2)
    throw ConfigError(
        fmt::format("--size '{}' holds about {:.1f} GB at once (input, output, payload, a method's "
                    "state); this process may use {:.1f} GB (allowed: at most half of it)",
                    s, 5e-9 * static_cast<double>(v), mem * 1e-9));
  return static_cast<size_t>(v);
}

// The items of a `sep`-separated list; an empty list or an empty item is an error naming `flag`.
std::vector<std::string> split_list(const std::string& s, char sep, const char* flag) {
  std::vector<std::string> out;
  size_t p = 0;
  while (p <= s.size()) {
    size_t q = s.find(sep, p);
    if (q == std::string::npos) q = s.size();
    if (q == p)
      throw ConfigError(fmt::format("{} '{}' has an empty item; allowed: items separated by '{}'", flag, s, sep));
    out.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return out;
}

// The methods of a default run: each with the parameters the README quotes.
std::vector<std::string> default_methods() {
  return {"none",
          "fp16",
          "bf16",
          "int8",
          "uint8",
          "qsgd:levels=127",
          "qsgd:levels=7",
          "qsgd:levels=7,bucket=512,coding=elias",
          "terngrad",
          "natural",
          "signsgd",
          "signum",
          "scaled_sign",
          "efsignsgd",
          "onebit",
          "topk:ratio=0.01",
          "topk:ratio=0.001",
          "randk:ratio=0.01",
          "threshold:threshold=2.5",
          "dgc:ratio=0.001",
          "powersgd:rank=4"};
}

template <typename Fn>
double best_time(double min_time, Fn fn) {
  double best = 1e30, total = 0;
  for (int i = 0; i < 1000 && (i < 2 || total < min_time); ++i) {
    Stopwatch sw;
    fn();
    double t = sw.seconds();
    best = std::min(best, t);
    total += t;
  }
  return best;
}

std::vector<float> bench_input(size_t n) {
  std::vector<float> x(n);
  detail::Rng rng(12345);
  for (size_t i = 0; i + 1 < n; i += 2) {
    double u1 = std::max(rng.uniform(), 1e-300), u2 = rng.uniform();
    double r = std::sqrt(-2 * std::log(u1));
    x[i] = static_cast<float>(r * std::cos(6.283185307179586 * u2));
    x[i + 1] = static_cast<float>(r * std::sin(6.283185307179586 * u2));
  }
  if (n % 2) x[n - 1] = 0.5f;
  return x;
}

void run_compress_bench(const CompressBenchArgs& a) {
  std::vector<std::string> methods = a.methods == "all" ? default_methods() : split_list(a.methods, ';', "--method");
  std::vector<CompressorPtr> comps;
  for (const auto& m : methods) {
    comps.push_back(parse_compressor(m));  // fails early on a bad name
    // Timed from its steady state: the calls of a warm-up (PowerSGD before start_iter, DGC's stages) compress
    // otherwise (the fastest call, an uncompressed copy, was reported with the compressed ratio: 46 GB/s for 3.3).
    if (comps.back()->warmup_calls() > kMaxWarmupCalls)
      throw ConfigError(
          fmt::format("--method '{}' warms up for {} calls; allowed in a benchmark: at most {} (it is "
                      "timed after them)",
                      m, comps.back()->warmup_calls(), kMaxWarmupCalls));
  }
  std::vector<size_t> sizes;
  for (const auto& s : split_list(a.sizes, ',', "--size")) sizes.push_back(parse_size(s));
  if (!(a.min_time > 0 && a.min_time <= 60)) throw ConfigError("--min-time must be in (0, 60] seconds");
  if (!a.json)
    std::printf("%-24s %10s %9s %10s %10s %8s %8s %10s  %s\n", "method", "size", "ratio", "comp GB/s", "dec GB/s",
                "comp/mc", "dec/mc", "memcpy", "note");
  for (size_t bytes : sizes) {
    size_t n = bytes / 4;
    auto x = bench_input(n);
    std::vector<float> y(n);
    // The copy to compare with: the faster of two destinations 64 bytes apart. glibc's memcpy (rep movsb) ran at a
    // twentieth of its speed on this VM's AMD CPU where the destination lay just past the source modulo 4 KiB, as two
    // buffers allocated one after the other do at small sizes: 2.2 GB/s at 64K, and the none method's own copy at
    // 15-21 times "memcpy" (an audit).
    std::vector<float> to(n + 16);
    std::memcpy(to.data(), x.data(), n * 4);  // touch every page of the target
    std::memcpy(to.data() + 16, x.data(), n * 4);
    double t_mc = std::min(best_time(a.min_time, [&] { std::memcpy(to.data(), x.data(), n * 4); }),
                           best_time(a.min_time, [&] { std::memcpy(to.data() + 16, x.data(), n * 4); }));
    double mc = static_cast<double>(n) * 4 / t_mc / 1e9;
    for (size_t i = 0; i < comps.size(); ++i) {
      const Compressor& c = *comps[i];
      // PowerSGD views the tensor as a matrix of 1024 rows (or fewer for small tensors).
      std::vector<size_t> shape{n};
      if (c.collective() == Collective::powersgd) {
        size_t rows = 1024;
        while (rows > 1 && n % rows) rows /= 2;
        shape = {rows, n / rows};
      }
      TensorState st = c.make_state(shape, 1, 0);
      Bytes payload;
      // Warm-up: allocates the payload and the state, and runs the method's own warm-up calls.
      for (uint64_t w = 0; w <= c.warmup_calls(); ++w) c.compress(x, st, payload);
      double blas0 = PowerSgd::blas_seconds(), all_c = 0;
      double t_c = best_time(a.min_time, [&] {
        Stopwatch sw;
        c.compress(x, st, payload);
        all_c += sw.seconds();
      });
      double blas_share = (PowerSgd::blas_seconds() - blas0) / all_c;
      double t_d = best_time(a.min_time, [&] { c.decompress(payload, st, y); });
      double cgb = static_cast<double>(n) * 4 / t_c / 1e9, dgb = static_cast<double>(n) * 4 / t_d / 1e9;
      // (An empty payload, threshold's above every value, is an infinite ratio: it printed 4 n. The table says inf;
      // JSON has no infinity, so there the ratio is null with "empty_payload": true, which says why.)
      double ratio = payload.empty() ? std::numeric_limits<double>::infinity()
                                     : 4.0 * static_cast<double>(n) / static_cast<double>(payload.size());
      std::string note;
      if (c.collective() == Collective::powersgd)
        note = fmt::format("{}x{} matrix; sgemm {:.0f}% of compress time", shape[0], shape[1], 100 * blas_share);
      if (a.json) {
        nlohmann::json j{{"bench", "compress"},
                         {"method", methods[i]},
                         {"bytes", n * 4},
                         {"elements", n},
                         {"wire_bytes", payload.size()},
                         {"ratio", payload.empty() ? nlohmann::json(nullptr) : nlohmann::json(ratio)},
                         {"empty_payload", payload.empty()},
                         {"compress_gbs", cgb},
                         {"decompress_gbs", dgb},
                         {"memcpy_gbs", mc},
                         {"compress_vs_memcpy", cgb / mc},
                         {"decompress_vs_memcpy", dgb / mc},
                         {"compress_s", t_c},
                         {"decompress_s", t_d},
                         {"collective", collective_name(c.collective())},
                         {"warmup_calls", c.warmup_calls()}};  // untimed, before the timed ones
        if (c.collective() == Collective::powersgd) j["blas_share"] = blas_share;
        std::cout << j.dump() << std::endl;
      } else {
        std::printf("%-24s %10zu %9.1f %10.2f %10.2f %8.2f %8.2f %10.2f  %s\n", methods[i].c_str(), n * 4, ratio, cgb,
                    dgb, cgb / mc, dgb / mc, mc, note.c_str());
        std::fflush(stdout);
      }
    }
  }
}

// ---- selftest-compress ------------------------------------------------------------------------------------------

std::vector<float> seeded(size_t n, uint64_t seed) {
  std::vector<float> v(n);
  detail::Rng rng(seed);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

size_t check_one(coll::Communicator& c, const std::string& spec, size_t d) {
  auto comp = parse_compressor(spec);
  const int n = c.size();
  std::vector<size_t> shape{d};
  if (comp->collective() == Collective::powersgd) shape = {d / 50, 50};
  TensorState st = comp->make_state(shape, 7, c.rank());
  std::vector<float> got = seeded(d, 100 + c.rank());
  compressed_allreduce(c, *comp, st, got);
  size_t wrong = 0;
  if (comp->collective() == Collective::powersgd) {
    // Linearity: equal (to f32 rounding) to single-worker PowerSGD of the sum, without error feedback.
    std::vector<float> sum(d, 0.0f), want(d);
    for (int r = 0; r < n; ++r) {
      auto x = seeded(d, 100 + r);
      for (size_t i = 0; i < d; ++i) sum[i] += x[i];
    }
    TensorState s1 = comp->make_state(shape, 7, 0);
    comp->decompress(comp->compress(sum, s1), s1, want);
    for (size_t i = 0; i < d; ++i) wrong += std::fabs(got[i] - want[i]) > 1e-3 * (1 + std::fabs(want[i]));
    return wrong;
  }
  std::vector<Bytes> payloads;
  std::vector<TensorState> ref;
  for (int r = 0; r < n; ++r) {
    ref.push_back(comp->make_state(shape, 7, r));
    payloads.push_back(comp->compress(seeded(d, 100 + r), ref.back()));
  }
  std::vector<float> want(d, 0.0f);
  if (comp->collective() == Collective::majority_vote) {
    Bytes all;
    for (auto& p : payloads) all.insert(all.end(), p.begin(), p.end());
    majority_vote(all, n, want);
  } else {
    for (int r = 0; r < n; ++r) comp->decompress_add(payloads[r], ref[r], want);  // (as its sender decodes it)
  }
  double tol = !comp->linear() ? 0.0 : comp->linear_dtype() == DType::f32 ? 1e-5 * n : n / 128.0;
  for (size_t i = 0; i < d; ++i) wrong += std::fabs(got[i] - want[i]) > tol * (std::fabs(want[i]) + 4 * n);
  return wrong;
}

size_t check_ring(coll::Communicator& c, const std::string& codec, size_t d) {
  auto x = seeded(d, 300 + c.rank());
  quantized_ring_allreduce(c, x, codec);
  std::vector<double> exact(d, 0);
  for (int r = 0; r < c.size(); ++r) {
    auto v = seeded(d, 300 + r);
    for (size_t i = 0; i < d; ++i) exact[i] += v[i];
  }
  double tol = codec == "fp16" ? 4e-3 : codec == "bf16" ? 0.05 : 0.05;
  size_t wrong = 0;
  for (size_t i = 0; i < d; ++i) wrong += std::fabs(x[i] - exact[i]) > tol * 3 * c.size();
  // Every rank must hold the same values: compare a checksum.
  double sum = 0;
  for (float v : x) sum += v;
  double lo = sum, hi = sum;
  c.allreduce(&lo, 1, DType::f64, ReduceOp::min).wait();
  c.allreduce(&hi, 1, DType::f64, ReduceOp::max).wait();
  return wrong + (lo != hi ? 1 : 0);
}

void run_selftest_compress(const std::string& transport, double timeout) {
  coll::CommConfig cfg;
  cfg.transport = transport;
  cfg.timeout_s = timeout;
  auto world = coll::Communicator::from_env(cfg);
  coll::Communicator& c = *world;
  std::vector<std::string> specs = {"none",
                                    "fp16",
                                    "bf16",
                                    "int8",
                                    "uint8",
                                    "qsgd:levels=7",
                                    "qsgd:levels=7,coding=elias",
                                    "terngrad",
                                    "natural",
                                    "signsgd",
                                    "signum",
                                    "efsignsgd",
                                    "onebit",
                                    "topk:ratio=0.01",
                                    "randk:ratio=0.01",
                                    "threshold:threshold=2",
                                    "dgc:ratio=0.01",
                                    "powersgd:rank=2,error_feedback=0"};
  size_t wrong = 0, cases = 0;
  auto run_all = [&](coll::Communicator& comm, const char* label) {
    for (const auto& s : specs) {
      size_t w = check_one(comm, s, 10000);
      if (w) std::fprintf(stderr, "selftest-compress: rank %d %s %s: %zu wrong\n", c.rank(), label, s.c_str(), w);
      wrong += w;
      ++cases;
    }
    for (std::string codec : {"fp16", "bf16", "int8"}) {
      size_t w = check_ring(comm, codec, 100003);
      if (w) std::fprintf(stderr, "selftest-compress: rank %d %s ring %s: %zu wrong\n", c.rank(), label,
                          codec.c_str(), w);
      wrong += w;
      ++cases;
    }
  };
  run_all(c, "world");
  if (c.size() >= 2) {
    auto sub = c.split(c.rank() % 2, c.rank());
    run_all(*sub, "split");
  }
  uint64_t total = wrong;
  c.allreduce(&total, 1, DType::i64, ReduceOp::sum).wait();
  if (c.rank() == 0)
    std::printf("selftest-compress: %zu cases on %d ranks over %s: %llu wrong elements\n", cases, c.size(),
                c.transport().name(), static_cast<unsigned long long>(total));
  if (total) set_exit_code(1);
}

const bool kRegistered = register_command(31, [](CLI::App& app) {
  auto* bench = subcommand_group(app, "bench", "benchmarks: collectives, compression, ...");
  auto a = std::make_shared<CompressBenchArgs>();
  auto* c = bench->add_subcommand("compress",
                                  "compress/decompress throughput of every compressor vs single-core memcpy");
  c->add_option("--method", a->methods,
                "'all' or methods separated by ';', each name[:key=value,...], e.g. 'topk:ratio=0.001;fp16'");
  c->add_option("--size", a->sizes, "tensor sizes in bytes of f32, comma-separated (K, M, G = powers of 1024)");
  c->add_option("--min-time", a->min_time, "seconds per measurement (best of the repetitions is reported)");
  c->add_flag("--json", a->json, "one JSON record per method and size");
  c->callback([a] { run_compress_bench(*a); });

  auto transport = std::make_shared<std::string>();
  auto timeout = std::make_shared<double>(0);
  auto* st = app.add_subcommand("selftest-compress", "");  // hidden: used by the process tests
  st->group("");
  st->add_option("--transport", *transport, "transport (default: CONDUIT_TRANSPORT or auto)");
  auto* tf = st->add_option("--timeout", *timeout, "deadline of each collective in seconds");
  st->callback([transport, timeout, tf] {
    check_timeout_flag(tf, *timeout);
    run_selftest_compress(*transport, *timeout);
  });
});

}  // namespace
}  // namespace conduit::cli
