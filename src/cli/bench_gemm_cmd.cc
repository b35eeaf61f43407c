// `conduit bench gemm`: libtorch matrix multiplications timed on this CPU, as `conduit train`'s workers run them
// (one intra-op thread by default), over the GEMMs of the training models' steps and a square sweep, or given
// shapes. `--json` writes the {m, n, k, gflops} lines `conduit sim calibrate --gemm` reads. `--model` also times
// one forward and backward of a training model, to compare with the sum of its GEMMs.
// Torch-free: the timing code is in src/torch/models.cc behind torch/gemm_bench.h. Built only with libtorch and
// the simulator (the GEMM shapes of a step are the simulator's).
#if defined(CONDUIT_WITH_TORCH) && defined(CONDUIT_WITH_SIM)
#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "core/env.h"
#include "core/error.h"
#include "sim/calibrate.h"
#include "sim/workload.h"
#include "torch/gemm_bench.h"

namespace conduit::cli {
namespace {

struct GemmArgs {
  std::string shapes = "cnn,mlp,square";
  int batch = 64;
  int threads = 1;
  double min_time = 0.2;
  std::string model;
  int model_steps = 20;
  bool json = false;
};

struct Shape {
  std::array<int64_t, 3> mnk;
  std::string label;
};

void add_layer_gemms(std::vector<Shape>& out, const std::string& name, const char* spec, int batch) {
  const char* kinds[] = {"fwd", "dgrad", "wgrad"};
  auto lm = sim::parse_layer_model(spec);
  auto gs = sim::layer_step_gemms(lm, batch);
  for (size_t i = 0; i < gs.size(); ++i) {
    const auto& l = lm.layers[i / 3];
    out.push_back({{int64_t(gs[i].m), int64_t(gs[i].n), int64_t(gs[i].k)},
                   fmt::format("{} {}{} {}", name, l.kind, i / 3 + 1, kinds[i % 3])});
  }
}

std::vector<Shape> parse_shapes(const GemmArgs& a) {
  std::vector<Shape> out;
  for (const auto& item : split(a.shapes, ',')) {
    const std::string s = trim(item);
    if (s == "cnn") {
      add_layer_gemms(out, "cnn", sim::kTrainCnnLayers, a.batch);
    } else if (s == "mlp") {
      add_layer_gemms(out, "mlp", sim::kTrainMlpLayers, a.batch);
    } else if (s == "square") {
      for (int64_t n = 32; n <= 1024; n *= 2) out.push_back({{n, n, n}, "square"});
    } else {
      long long m = 0, n = 0, k = 0;
      char tail = 0;
      if (std::sscanf(s.c_str(), "%lldx%lldx%lld%c", &m, &n, &k, &tail) != 3 || m < 1 || n < 1 || k < 1 ||
          m * n > (1LL << 28) || m * k > (1LL << 28) || n * k > (1LL << 28))
        throw ConfigError(fmt::format(
            "--shapes: '{}' is not allowed; allowed: cnn, mlp, square or MxNxK (positive, each matrix at most 2^28 "
            "elements), comma-separated",
            s));
      out.push_back({{m, n, k}, "given"});
    }
  }
  // Without duplicates (the first label wins).
  std::vector<Shape> uniq;
  for (const auto& s : out) {
    bool dup = false;
    for (const auto& u : uniq) dup |= u.mnk == s.mnk;
    if (!dup) uniq.push_back(s);
  }
  if (uniq.empty()) throw ConfigError("--shapes: no shapes given");
  return uniq;
}

void run_gemm(const GemmArgs& a) {
  if (a.batch < 1) throw ConfigError(fmt::format("--batch = {} must be at least 1", a.batch));
  if (a.threads < 1 || a.threads > 1024) throw ConfigError(fmt::format("--threads = {} (allowed: 1..1024)", a.threads));
  if (!(a.min_time > 0) || a.min_time > 60)
    throw ConfigError(fmt::format("--min-time = {} (allowed: seconds in (0, 60])", a.min_time));
  if (a.model_steps < 1 || a.model_steps > 10000)
    throw ConfigError(fmt::format("--model-steps = {} (allowed: 1..10000)", a.model_steps));
  std::vector<Shape> shapes = parse_shapes(a);
  std::vector<std::array<int64_t, 3>> mnk;
  for (const auto& s : shapes) mnk.push_back(s.mnk);
  auto timings = train::time_gemms(mnk, a.threads, a.min_time);
  double gemm_sum = 0;  // of the --model's step GEMMs
  const std::string prefix = a.model + " ";
  if (!a.json)
    fmt::print("  {:<20} {:>8} {:>8} {:>8} {:>12} {:>10} {:>8}\n", "gemm", "m", "n", "k", "time", "GFLOP/s", "calls");
  for (size_t i = 0; i < timings.size(); ++i) {
    const auto& t = timings[i];
    if (!a.model.empty() && shapes[i].label.rfind(prefix, 0) == 0) gemm_sum += t.seconds;
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.gemm"},
                                  {"label", shapes[i].label},
                                  {"m", t.m},
                                  {"n", t.n},
                                  {"k", t.k},
                                  {"gflops", t.gflops()},
                                  {"time_us", t.seconds * 1e6},
                                  {"calls", t.calls},
                                  {"threads", a.threads},
                                  {"dtype", "f32"}}
                       .dump()
                << "\n";
    } else {
      fmt::print("  {:<20} {:>8} {:>8} {:>8} {:>9.1f} us {:>10.2f} {:>8}\n", shapes[i].label, t.m, t.n, t.k,
                 t.seconds * 1e6, t.gflops(), t.calls);
    }
  }
  if (!a.model.empty()) {
    auto ms = train::time_model_step(a.model, a.batch, a.threads, a.model_steps);
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.model_step"}, {"model", a.model},
                                  {"batch", a.batch},           {"threads", a.threads},
                                  {"forward_s", ms.forward_s},  {"backward_s", ms.backward_s},
                                  {"steps", ms.steps},          {"gemm_sum_s", gemm_sum}}
                       .dump()
                << "\n";
    } else {
      fmt::print("\n  {} at batch {}: forward {:.2f} ms + backward {:.2f} ms = {:.2f} ms (median of {} steps)", a.model,
                 a.batch, ms.forward_s * 1e3, ms.backward_s * 1e3, (ms.forward_s + ms.backward_s) * 1e3, ms.steps);
      if (gemm_sum > 0) fmt::print("; its GEMMs above sum to {:.2f} ms", gemm_sum * 1e3);
      fmt::print("\n");
    }
  }
}

const bool kRegistered = register_command(32, [](CLI::App& app) {
  auto* bench = subcommand_group(app, "bench", "Benchmarks: collectives (coll), compression (compress), GEMMs (gemm)");
  auto* c = bench->add_subcommand("gemm", "Time libtorch GEMMs on this CPU (for `conduit sim calibrate --gemm`)");
  auto a = std::make_shared<GemmArgs>();
  c->add_option("--shapes", a->shapes,
                "comma-separated: cnn and mlp (every GEMM of a training step of conduit train's models at --batch: "
                "forward, input and weight gradients; convolutions as im2col GEMMs), square (32..1024), MxNxK")
      ->capture_default_str();
  c->add_option("--batch", a->batch, "samples per worker for the cnn/mlp shapes and --model")->capture_default_str();
  c->add_option("--threads", a->threads, "intra-op threads (conduit train's workers use 1)")->capture_default_str();
  c->add_option("--min-time", a->min_time, "seconds of timed calls per shape (median call reported)")
      ->capture_default_str();
  c->add_option("--model", a->model, "also time one forward+backward of this training model (mlp, cnn, resnet)");
  c->add_option("--model-steps", a->model_steps, "timed steps for --model")->capture_default_str();
  c->add_flag("--json", a->json, "JSON lines {kind: bench.gemm, m, n, k, gflops, ...} for sim calibrate --gemm");
  c->callback([a]() { run_gemm(*a); });
});

}  // namespace
}  // namespace conduit::cli
#endif
