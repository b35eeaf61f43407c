// `conduit bench gemm`: libtorch matrix multiplications timed on this CPU, as `conduit train`'s workers run them
// (one intra-op thread by default), over the GEMMs of the training models' steps and a square sweep, or given
// shapes; and the CNN's convolution layers as convolutions (forward, input gradient, weight gradient: oneDNN's
// direct kernels, not the im2col GEMMs). `--json` writes the {m, n, k, gflops} and bench.conv lines
// `conduit sim calibrate --gemm` reads. `--model mlp,cnn` also times training steps of those models as
// `conduit train` runs them up to the gradient exchange (bench.model_step: the framework's time beyond the timed
// kernels and the spread of step times, which calibrate carries into the cluster file). Under `conduit launch -n N`
// every record says "concurrent": N (each of N processes timed the same shapes at the same time).
// Torch-free: the timing code is in src/torch/models.cc behind torch/gemm_bench.h. Built only with libtorch and
// the simulator (the GEMM shapes of a step are the simulator's).
#if defined(CONDUIT_WITH_TORCH) && defined(CONDUIT_WITH_SIM)
#include <fmt/format.h>

#include <array>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/registry.h"
#include "cli/torch_plugin.h"
#include "coll/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "net/bootstrap.h"
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
  std::string transport = "auto";  // of the barrier between model steps under `conduit launch`
  bool json = false;
  bool batch_given = false, model_steps_given = false, transport_given = false;
};

struct Shape {
  std::array<int64_t, 3> mnk;
  std::string label;
  std::vector<std::string> also = {};  // the labels of the same shape elsewhere (timed once, counted for each)
};

struct Conv {
  train::ConvTiming shape;
  std::string label;
  std::vector<std::string> also = {};
};

// The convolution layers of a layer list at `batch`, as models.cc builds them: stride 1, padding kernel / 2.
void add_layer_convs(std::vector<Conv>& out, const std::string& name, const std::string& spec, int batch) {
  auto lm = sim::parse_layer_model(spec);
  int n = 0;  // numbered as the GEMM labels: among the layers with GEMMs (pooling has none)
  for (size_t i = 0; i < lm.layers.size(); ++i) {
    const auto& l = lm.layers[i];
    if (l.kind != "pool") ++n;
    if (l.kind != "conv") continue;
    train::ConvTiming c;
    c.batch = batch;
    c.in = int64_t(l.in);
    c.out = int64_t(l.out);
    c.height = int64_t(l.height);
    c.width = int64_t(l.width);
    c.kernel = int64_t(l.kernel);
    c.stride = 1;
    c.padding = c.kernel / 2;
    out.push_back({c, fmt::format("{} conv{}", name, n)});
  }
}

void add_layer_gemms(std::vector<Shape>& out, const std::string& name, const char* spec, int batch) {
  const char* kinds[] = {"fwd", "dgrad", "wgrad"};
  auto lm = sim::parse_layer_model(spec);
  auto gs = sim::layer_step_gemms(lm, batch);  // three per layer with GEMMs (not pooling), in order
  std::vector<const sim::Layer*> with_gemms;
  for (const auto& l : lm.layers)
    if (l.kind != "pool") with_gemms.push_back(&l);
  for (size_t i = 0; i < gs.size(); ++i)
    out.push_back({{int64_t(gs[i].m), int64_t(gs[i].n), int64_t(gs[i].k)},
                   fmt::format("{} {}{} {}", name, with_gemms.at(i / 3)->kind, i / 3 + 1, kinds[i % 3])});
}

struct Pool {
  train::PoolTiming shape;
  std::string label;
};

void add_layer_pools(std::vector<Pool>& out, const std::string& name, const std::string& spec, int batch) {
  int n = 0;
  for (const auto& l : sim::parse_layer_model(spec).layers) {
    if (l.kind != "pool") continue;
    train::PoolTiming p;
    p.batch = batch;
    p.channels = int64_t(l.in);
    p.height = int64_t(l.height);
    p.width = int64_t(l.width);
    p.kernel = int64_t(l.kernel);
    out.push_back({p, fmt::format("{} pool{}", name, ++n)});
  }
}

std::vector<Shape> parse_shapes(const GemmArgs& a, std::vector<Conv>& convs, std::vector<Pool>& pools) {
  std::vector<Shape> out;
  std::vector<std::string> seen;
  for (const auto& item : split(a.shapes, ',')) {
    const std::string s = trim(item);
    // (A repeated item credited its models twice: cnn,cnn doubled the CNN's sums and timed its poolings twice.)
    if (!s.empty() && std::find(seen.begin(), seen.end(), s) != seen.end())
      throw ConfigError(fmt::format("--shapes: '{}' is given twice; allowed: each item once", s));
    seen.push_back(s);
    if (s == "cnn") {
      add_layer_gemms(out, "cnn", sim::kTrainCnnLayers, a.batch);
      add_layer_convs(convs, "cnn", sim::kTrainCnnLayers, a.batch);
      add_layer_pools(pools, "cnn", sim::kTrainCnnLayers, a.batch);
    } else if (s.rfind("conv:", 0) == 0) {
      std::vector<Conv> one;
      try {
        add_layer_convs(one, "given", s, a.batch);
      } catch (const ConfigError& e) {  // the layer parser names --layers-spec, its own flag elsewhere
        std::string why = e.what();
        if (why.rfind("--layers-spec", 0) == 0) why.erase(0, std::string("--layers-spec").size());
        throw ConfigError(fmt::format("--shapes{}", why));
      }
      if (one.empty())
        throw ConfigError(fmt::format("--shapes: '{}' holds no convolution (e.g. conv:3x16k3@28x28)", s));
      const auto& c = one.at(0).shape;
      if (c.kernel > c.height || c.kernel > c.width || c.in * c.kernel * c.kernel > (1LL << 20) ||
          double(a.batch) * c.in * c.height * c.width > double(1LL << 28) ||
          double(a.batch) * c.out * c.height * c.width > double(1LL << 28))
        throw ConfigError(
            fmt::format("--shapes: '{}': each tensor must be at most 2^28 elements and the kernel at "
                        "most the feature map",
                        s));
      convs.push_back(one.at(0));
    } else if (s == "mlp") {
      add_layer_gemms(out, "mlp", sim::kTrainMlpLayers, a.batch);
    } else if (s == "square") {
      for (int64_t n = 32; n <= 1024; n *= 2) out.push_back({{n, n, n}, "square"});
    } else {
      // Each side digits only (sscanf took "+4x4x4" and "4x 4x4", and overflowed a long side undefined), at most
      // 2^28 before any product (a product of sides near 2^32 wrapped past the 2^28 check).
      constexpr long long kMax = 1LL << 28;
      const auto sides = split(s, 'x');
      long long mnk[3] = {0, 0, 0};
      bool ok = sides.size() == 3;
      for (size_t i = 0; ok && i < 3; ++i) {
        const std::string& t = sides[i];
        const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), mnk[i]);
        ok = !t.empty() && std::isdigit(static_cast<unsigned char>(t[0])) && ec == std::errc() &&
             end == t.data() + t.size();
      }
      const long long m = mnk[0], n = mnk[1], k = mnk[2];
      if (!ok || m < 1 || n < 1 || k < 1 || m > kMax || n > kMax || k > kMax || m * n > kMax || m * k > kMax ||
          n * k > kMax)
        throw ConfigError(fmt::format(
            "--shapes: '{}' is not allowed; allowed: cnn, mlp, square, MxNxK (positive, each matrix at most 2^28 "
            "elements) or conv:INxOUTkK@HxW (a stride-1 convolution padded by K/2 at --batch), comma-separated",
            s));
      out.push_back({{m, n, k}, "given"});
    }
  }
  // Without duplicates: the first label names the shape, the others are kept so that every model using it is
  // credited its time (a shape of two models counted only in the first's sums).
  std::vector<Shape> uniq;
  for (const auto& s : out) {
    auto it = std::find_if(uniq.begin(), uniq.end(), [&](const Shape& u) { return u.mnk == s.mnk; });
    if (it == uniq.end())
      uniq.push_back(s);
    else
      it->also.push_back(s.label);
  }
  std::vector<Conv> cu;
  for (const auto& c : convs) {
    auto it = std::find_if(cu.begin(), cu.end(), [&](const Conv& u) {
      return u.shape.in == c.shape.in && u.shape.out == c.shape.out && u.shape.height == c.shape.height &&
             u.shape.width == c.shape.width && u.shape.kernel == c.shape.kernel;
    });
    if (it == cu.end())
      cu.push_back(c);
    else
      it->also.push_back(c.label);
  }
  convs = cu;
  if (uniq.empty() && convs.empty()) throw ConfigError("--shapes: no shapes given");
  return uniq;
}

void run_gemm(const GemmArgs& a) {
  // The processes on this host running this benchmark at once (each rank times the same shapes, so the records carry
  // the speed one of N concurrent workers gets).
  const long long concurrent = ranks_on_this_host();
  // The cnn/mlp shapes and --model grow with the batch (200000 needed ~20 GB for one im2col matrix).
  if (a.batch < 1 || a.batch > 65536) throw ConfigError(fmt::format("--batch = {} (allowed: 1..65536)", a.batch));
  if (a.threads < 1 || a.threads > 1024) throw ConfigError(fmt::format("--threads = {} (allowed: 1..1024)", a.threads));
  // (checked before the kernels are timed: it was taken unchecked alone, and under launch after the whole pass)
  if (a.transport != "auto" && a.transport != "tcp" && a.transport != "shm" && a.transport != "mpi")
    throw ConfigError(fmt::format("--transport = '{}' (allowed: {})", a.transport, net::transport_kinds_allowed()));
  if (!(a.min_time > 0) || a.min_time > 60)
    throw ConfigError(fmt::format("--min-time = {} (allowed: seconds in (0, 60])", a.min_time));
  if (a.model_steps < 1 || a.model_steps > 10000)
    throw ConfigError(fmt::format("--model-steps = {} (allowed: 1..10000)", a.model_steps));
  std::vector<Conv> convs;
  std::vector<Pool> pools;
  std::vector<Shape> shapes = parse_shapes(a, convs, pools);
  std::vector<std::array<int64_t, 3>> mnk;
  for (const auto& s : shapes) mnk.push_back(s.mnk);
  std::vector<std::string> models;
  for (const auto& m : split(a.model, ','))
    if (!trim(m).empty()) models.push_back(trim(m));
  for (const auto& m : models)  // before the timings (a bad name was refused after the whole GEMM pass)
    if (m != "mlp" && m != "cnn" && m != "resnet")
      throw ConfigError(fmt::format("--model: '{}' is not allowed; allowed: mlp, cnn, resnet", m));
  // Flags that apply to what this run does not time (they were taken and changed nothing, and the records did not
  // show them).
  if (models.empty() && a.model_steps_given)
    throw ConfigError("--model-steps applies to --model's training steps; allowed: give --model too, or leave it out");
  // Under `conduit launch -n N` (or mpirun) the ranks meet in a barrier before each shape and at the end of each
  // --model step: the records say "concurrent": N, and the ranks' timing windows drifted apart without it (one rank
  // made 164 calls of a shape in --min-time while another made 627 of the same; an audit), so a rate read as one of N
  // concurrent workers' was partly measured alone.
  const long long world =
      env_int("WORLD_SIZE", 1, 1 << 20).value_or(env_int("OMPI_COMM_WORLD_SIZE", 1, 1 << 20).value_or(1));
  if (world == 1 && a.transport_given)
    throw ConfigError(
        "--transport applies to the barriers between the ranks of a launch (before each shape, after each --model "
        "step); allowed: run under conduit launch -n N, or leave it out");
  bool batched = !models.empty();
  // (a conv: shape is timed at --batch too: refused alone, it could only be timed at 64)
  for (const auto& s : split(a.shapes, ','))
    batched = batched || trim(s) == "cnn" || trim(s) == "mlp" || trim(s).rfind("conv:", 0) == 0;
  if (a.batch_given && !batched)
    throw ConfigError(
        "--batch applies to the cnn and mlp shapes, conv: shapes and --model; allowed: one of those too, or leave it "
        "out");
  coll::CommPtr comm;
  if (world > 1) {
    coll::CommConfig cfg;
    cfg.transport = a.transport;
    comm = coll::Communicator::from_env(cfg);
  }
  // Each shape timed after a barrier of the ranks (alone, the list at once).
  auto lined_up = [&comm](const auto& shapes, auto&& time) {
    if (!comm) return time(shapes);
    decltype(time(shapes)) all;
    for (const auto& s : shapes) {
      comm->barrier().wait();
      auto one = time(std::vector{s});
      all.insert(all.end(), one.begin(), one.end());
    }
    return all;
  };
  auto timings = lined_up(mnk, [&](const auto& s) { return torch_api().time_gemms(s, a.threads, a.min_time); });
  struct Sums {
    double gemm = 0;   // of the model's step GEMMs
    double dense = 0;  // of its dense layers' GEMMs
    double conv = 0;   // of its convolutions (timed as convolutions) and poolings
  };
  std::map<std::string, Sums> sums;
  // The model a shape's label belongs to ("mlp dense1 fwd" -> mlp), when it is one of --model's.
  auto owner = [&](const std::string& label) -> Sums* {
    for (const auto& m : models)
      if (label.rfind(m + " ", 0) == 0) return &sums[m];
    return nullptr;
  };
  if (!a.json && !shapes.empty())
    fmt::print("  {:<20} {:>8} {:>8} {:>8} {:>12} {:>10} {:>8}\n", "gemm", "m", "n", "k", "time", "GFLOP/s", "calls");
  // Calls every model's sums that a label of the shape belongs to, once per label (a model whose step runs the
  // shape twice, e.g. as two layers, pays it twice).
  auto credit = [&](const std::string& label, const std::vector<std::string>& also, auto&& add) {
    if (Sums* o = owner(label)) add(*o, label);
    for (const auto& l : also)
      if (Sums* o = owner(l)) add(*o, l);
  };
  for (size_t i = 0; i < timings.size(); ++i) {
    const auto& t = timings[i];
    credit(shapes[i].label, shapes[i].also, [&](Sums& o, const std::string& label) {
      o.gemm += t.seconds;
      if (label.find(" dense") != std::string::npos) o.dense += t.seconds;
    });
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.gemm"},
                                  {"concurrent", concurrent},
                                  {"label", shapes[i].label},
                                  {"also", shapes[i].also},
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
  std::vector<train::ConvTiming> cshapes;
  for (const auto& c : convs) cshapes.push_back(c.shape);
  auto ctimes = lined_up(cshapes, [&](const auto& s) { return torch_api().time_convs(s, a.threads, a.min_time); });
  if (!a.json && !ctimes.empty())
    fmt::print("\n  {:<20} {:>5} {:>4} {:>4} {:>9} {:>3} {:>11} {:>11} {:>11} {:>21}\n", "conv", "batch", "in", "out",
               "HxW", "k", "forward", "input grad", "weight grad", "GFLOP/s (f / i / w)");
  for (size_t i = 0; i < ctimes.size(); ++i) {
    const auto& c = ctimes[i];
    credit(convs[i].label, convs[i].also,
           [&](Sums& o, const std::string&) { o.conv += c.forward_s + c.input_grad_s + c.weight_grad_s; });
    auto gf = [&](double s) { return s > 0 ? c.flops() / s / 1e9 : 0.0; };
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.conv"},
                                  {"concurrent", concurrent},
                                  {"label", convs[i].label},
                                  {"batch", c.batch},
                                  {"in", c.in},
                                  {"out", c.out},
                                  {"height", c.height},
                                  {"width", c.width},
                                  {"kernel", c.kernel},
                                  {"stride", c.stride},
                                  {"padding", c.padding},
                                  {"forward_us", c.forward_s * 1e6},
                                  {"input_grad_us", c.input_grad_s * 1e6},
                                  {"weight_grad_us", c.weight_grad_s * 1e6},
                                  {"forward_gflops", gf(c.forward_s)},
                                  {"input_grad_gflops", gf(c.input_grad_s)},
                                  {"weight_grad_gflops", gf(c.weight_grad_s)},
                                  {"calls", c.calls},
                                  {"threads", a.threads},
                                  {"dtype", "f32"}}
                       .dump()
                << "\n";
    } else {
      fmt::print(
          "  {:<20} {:>5} {:>4} {:>4} {:>9} {:>3} {:>8.1f} us {:>8.1f} us {:>8.1f} us {:>6.1f} /{:>6.1f} /{:>6.1f}\n",
          convs[i].label, c.batch, c.in, c.out, fmt::format("{}x{}", c.height, c.width), c.kernel, c.forward_s * 1e6,
          c.input_grad_s * 1e6, c.weight_grad_s * 1e6, gf(c.forward_s), gf(c.input_grad_s), gf(c.weight_grad_s));
    }
  }
  std::vector<train::PoolTiming> pshapes;
  for (const auto& p : pools) pshapes.push_back(p.shape);
  auto ptimes = lined_up(pshapes, [&](const auto& s) { return torch_api().time_pools(s, a.threads, a.min_time); });
  if (!a.json && !ptimes.empty())
    fmt::print("\n  {:<20} {:>5} {:>8} {:>9} {:>3} {:>11} {:>11}\n", "max pool", "batch", "channels", "HxW", "k",
               "forward", "backward");
  for (size_t i = 0; i < ptimes.size(); ++i) {
    const auto& p = ptimes[i];
    if (Sums* o = owner(pools[i].label)) o->conv += p.forward_s + p.backward_s;
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.pool"},
                                  {"concurrent", concurrent},
                                  {"label", pools[i].label},
                                  {"batch", p.batch},
                                  {"channels", p.channels},
                                  {"height", p.height},
                                  {"width", p.width},
                                  {"kernel", p.kernel},
                                  {"forward_us", p.forward_s * 1e6},
                                  {"backward_us", p.backward_s * 1e6},
                                  {"calls", p.calls},
                                  {"threads", a.threads},
                                  {"dtype", "f32"}}
                       .dump()
                << "\n";
    } else {
      fmt::print("  {:<20} {:>5} {:>8} {:>9} {:>3} {:>8.1f} us {:>8.1f} us\n", pools[i].label, p.batch, p.channels,
                 fmt::format("{}x{}", p.height, p.width), p.kernel, p.forward_s * 1e6, p.backward_s * 1e6);
    }
  }
  // Under `conduit launch -n N` the ranks' model steps end in a barrier, as BSP training's steps end in the blocking
  // gradient exchange: each rank's steps are then timed with the same pattern of blocking and waking (which the
  // scheduler of a shared machine treats differently from a process that never blocks).
  std::function<void()> barrier;
  if (comm) barrier = [&comm] { comm->barrier().wait(); };
  for (const auto& name : models) {
    auto ms = torch_api().time_model_step(name, a.batch, a.threads, a.model_steps, barrier);
    const Sums& sm = sums[name];
    const std::string layers = name == "mlp" ? sim::kTrainMlpLayers : name == "cnn" ? sim::kTrainCnnLayers : "";
    if (a.json) {
      std::cout << nlohmann::json{{"kind", "bench.model_step"},
                                  {"concurrent", concurrent},
                                  {"model", name},
                                  {"synchronized", comm != nullptr},
                                  {"layers", layers},
                                  {"batch", a.batch},
                                  {"threads", a.threads},
                                  {"prepare_s", ms.prepare_s},
                                  {"forward_s", ms.forward_s},
                                  {"backward_s", ms.backward_s},
                                  {"stats_s", ms.stats_s},
                                  {"step_samples_s", ms.step_s},
                                  {"barrier_samples_s", ms.after_s},
                                  {"optimizer_s", ms.optimizer_s},
                                  {"steps", ms.steps},
                                  {"gemm_sum_s", sm.gemm},
                                  {"conv_pool_dense_sum_s", sm.conv > 0 ? sm.conv + sm.dense : 0.0}}
                       .dump()
                << "\n";
    } else {
      fmt::print(
          "\n  {} at batch {}: zero grads + batch {:.2f} ms, forward {:.2f} ms + backward {:.2f} ms = {:.2f} ms, "
          "loss and accuracy read back {:.2f} ms (median of {} steps)",
          name, a.batch, ms.prepare_s * 1e3, ms.forward_s * 1e3, ms.backward_s * 1e3,
          (ms.forward_s + ms.backward_s) * 1e3, ms.stats_s * 1e3, ms.steps);
      if (sm.gemm > 0) fmt::print("; its GEMMs above sum to {:.2f} ms", sm.gemm * 1e3);
      if (sm.conv > 0)
        fmt::print("; its convolutions (as convolutions), poolings and dense GEMMs to {:.2f} ms",
                   (sm.conv + sm.dense) * 1e3);
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
                "forward, input and weight gradients; convolutions as im2col GEMMs, and cnn's convolution layers also "
                "as convolutions: forward, input and weight gradients, and its max poolings), square (32..1024), "
                "MxNxK, conv:INxOUTkK@HxW")
      ->capture_default_str();
  c->add_option("--batch", a->batch, "samples per worker for the cnn/mlp shapes, conv: shapes and --model")
      ->capture_default_str();
  c->add_option("--threads", a->threads, "intra-op threads (conduit train's workers use 1)")->capture_default_str();
  c->add_option("--min-time", a->min_time, "seconds of timed calls per shape (median call reported)")
      ->capture_default_str();
  c->add_option("--model", a->model,
                "also time training steps of these models (comma-separated: mlp, cnn, resnet) as conduit train runs "
                "them without the gradient exchange: zero grads + batch, forward, backward with gradient-copy "
                "hooks, and the loss and accuracy read back after the optimizer");
  c->add_option("--model-steps", a->model_steps, "timed steps for --model")->capture_default_str();
  c->add_option("--transport", a->transport,
                "under conduit launch: transport of the barrier that ends each --model step (auto, shm, tcp, ...)")
      ->capture_default_str();
  c->add_flag(
      "--json", a->json,
      "JSON lines {kind: bench.gemm, m, n, k, gflops, ...} and {kind: bench.conv, batch, in, out, height, width, "
      "kernel, stride, padding, forward_us, input_grad_us, weight_grad_us, ...} for sim calibrate --gemm");
  c->callback([a, c]() {
    a->batch_given = c->get_option("--batch")->count() > 0;
    a->model_steps_given = c->get_option("--model-steps")->count() > 0;
    a->transport_given = c->get_option("--transport")->count() > 0;
    run_gemm(*a);
  });
});

}  // namespace
}  // namespace conduit::cli
#endif
