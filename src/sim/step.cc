#include "sim/step.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string_view>
#include <tuple>

#include "core/env.h"
#include "core/error.h"
#include "core/partition.h"
#include "sim/units.h"

namespace conduit::sim {

Compression parse_compression(const std::string& s) {
  Compression c;
  auto parts = split(s, ':');
  c.kind = parts.empty() ? "" : parts[0];
  auto bad = [&]() {
    return ConfigError(fmt::format(
        "--compression = '{}' (allowed: none, fp16, int8, int4, topk:DENSITY in (0,1], powersgd:RANK >= 1)", s));
  };
  if (c.kind == "none" || c.kind == "fp16" || c.kind == "int8" || c.kind == "int4") {
    if (parts.size() != 1) throw bad();
    return c;
  }
  if ((c.kind == "topk" || c.kind == "powersgd") && parts.size() == 2) {
    char* end = nullptr;
    if (!is_decimal(parts[1])) throw bad();  // (strtod also took 0x0.1)
    c.param = std::strtod(parts[1].c_str(), &end);
    if (end == parts[1].c_str() || *end != 0) throw bad();
    if (c.kind == "topk" && !(c.param > 0 && c.param <= 1)) throw bad();  // (nan passed both tests)
    if (c.kind == "powersgd" && (c.param < 1 || c.param != std::floor(c.param))) throw bad();
    return c;
  }
  throw bad();
}

SyncScheme parse_sync(const std::string& s) {
  SyncScheme k;
  auto parts = split(s, ':');
  auto bad = [&]() {
    return ConfigError(fmt::format("--sync = '{}' (allowed: bsp, local-sgd:PERIOD >= 1, async)", s));
  };
  if (parts.empty()) throw bad();
  k.kind = parts[0];
  if ((k.kind == "bsp" || k.kind == "async") && parts.size() == 1) return k;
  if (k.kind == "local-sgd" && parts.size() == 2) {
    char* end = nullptr;
    long v = std::strtol(parts[1].c_str(), &end, 10);
    if (end == parts[1].c_str() || *end != 0 || v < 1 || v > 1000000) throw bad();
    k.period = static_cast<int>(v);
    return k;
  }
  throw bad();
}

ZeroReduce parse_zero_reduce(const std::string& s) {
  if (s == "micro-batch") return ZeroReduce::kEveryMicroBatch;
  if (s == "step") return ZeroReduce::kOncePerStep;
  throw ConfigError(fmt::format(
      "--zero-reduce = '{}' (allowed: micro-batch (after every micro-batch's backward, DeepSpeed's), step (once a "
      "step, conduit train's by default))",
      s));
}

const char* zero_reduce_name(ZeroReduce z) {
  return z == ZeroReduce::kEveryMicroBatch ? "micro-batch" : z == ZeroReduce::kOncePerStep ? "step" : "default";
}

void check_local_sgd_compression(const SyncScheme& sync, const Compression& compression) {
  if (sync.kind == "local-sgd" && compression.kind != "none")
    throw ConfigError(fmt::format(
        "--compression {} with --sync local-sgd: local SGD averages the parameters uncompressed (as `conduit train`, "
        "which takes no compressor with it); allowed with local-sgd: none",
        compression.kind));
}

// Flags that act on the data-parallel exchange, refused where there is none (dp = 1): `sim step` took them, printed
// them in its config and predicted the step without them (`sim plan` and `sim scale --fixed` leave them out of such
// candidates themselves, saying so).
void check_data_parallel_flags(const ParallelConfig& c, long long dp) {
  // (async runs the exchange behind the next step's compute by definition: --no-overlap changed nothing)
  if (c.sync.kind == "async" && !c.dp_overlap)
    throw ConfigError(
        "--no-overlap with --sync async: asynchronous training runs the exchange behind the next step's compute, "
        "which --no-overlap forbids; allowed: one of them");
  // (local SGD averages the parameters after the step, in one call: nothing overlaps and nothing is bucketed)
  if (c.sync.kind == "local-sgd" && !c.dp_overlap)
    throw ConfigError(
        "--no-overlap with --sync local-sgd: local SGD averages the parameters after the step in one call, which "
        "overlaps nothing already; allowed: one of them");
  if (dp > 1) return;
  if (c.zero != 0)
    throw ConfigError(fmt::format(
        "--zero {} shards over the data-parallel ranks, and dp = 1 here; allowed with dp = 1: --zero 0", c.zero));
  if (c.compression.kind != "none")
    throw ConfigError(fmt::format(
        "--compression {} compresses the data-parallel exchange, which dp = 1 does not have; allowed with dp = 1: "
        "none",
        c.compression.kind));
  if (c.sync.kind != "bsp")
    throw ConfigError(fmt::format(
        "--sync {} schedules the data-parallel exchange, which dp = 1 does not have; allowed with dp = 1: bsp",
        c.sync.kind));
  if (!c.dp_overlap)
    throw ConfigError(
        "--no-overlap: about the data-parallel exchange, which dp = 1 does not have; allowed with dp = 1: leave it "
        "out");
  if (c.dp_algorithm != Algorithm::kAuto)
    throw ConfigError(fmt::format(
        "--dp-algorithm {}: the data-parallel exchange's algorithm, which dp = 1 does not have; allowed with dp = 1: "
        "leave it out",
        algorithm_name(c.dp_algorithm)));
}

StageLayers stage_layers(const GptModel& m, const ParallelConfig& c) {
  const int p = c.pp, v = c.schedule == Schedule::kInterleaved ? c.virtual_stages : 1;
  const bool has_first = c.first_stage_layers >= 0, has_last = c.last_stage_layers >= 0;
  if (!has_first && !has_last) {
    const long long stages = static_cast<long long>(p) * v;  // (an int product overflowed: a crash, or 8 / 3)
    if (p < 1 || m.layers % stages != 0)
      throw ConfigError(fmt::format(
          "--layers ({}) must be a multiple of --pp x virtual stages ({}){}", m.layers, stages,
          v > 1 ? ""
                : "; or, with `sim step` or `sim scale --fixed`, give the first and last stages their own layers "
                  "(--first-stage-layers, --last-stage-layers)"));
    const int each = m.layers / p;
    return {each, each, each, false};
  }
  const char* named = has_first && has_last ? "--first-stage-layers and --last-stage-layers"
                      : has_first           ? "--first-stage-layers"
                                            : "--last-stage-layers";
  if (p < 2)
    throw ConfigError(
        fmt::format("{}: an uneven split of a pipeline's layers, this step has --pp {}; allowed: --pp 2 "
                    "or more, or leave it out",
                    named, p));
  if (v > 1)
    throw ConfigError(
        fmt::format("{} with --schedule interleaved: its model chunks hold equal layers; allowed: "
                    "--schedule 1f1b or gpipe, or leave {} out",
                    named, has_first && has_last ? "them" : "it"));
  for (auto [given, value, flag] : {std::tuple{has_first, c.first_stage_layers, "--first-stage-layers"},
                                    std::tuple{has_last, c.last_stage_layers, "--last-stage-layers"}})
    if (given && value > m.layers)
      throw ConfigError(
          fmt::format("{} = {} exceeds --layers = {} (allowed: 0 to {})", flag, value, m.layers, m.layers));
  const long long rest =
      static_cast<long long>(m.layers) - std::max(c.first_stage_layers, 0) - std::max(c.last_stage_layers, 0);
  const int sharing = p - (has_first ? 1 : 0) - (has_last ? 1 : 0);
  if (rest < 0)
    throw ConfigError(fmt::format("--first-stage-layers ({}) + --last-stage-layers ({}) exceed --layers ({})",
                                  c.first_stage_layers, c.last_stage_layers, m.layers));
  if (sharing == 0 && rest != 0)
    throw ConfigError(fmt::format(
        "--first-stage-layers ({}) + --last-stage-layers ({}) must be --layers ({}): --pp 2 has no other stages",
        c.first_stage_layers, c.last_stage_layers, m.layers));
  if (sharing == 1 && rest < 1) {
    if (has_first && has_last)
      throw ConfigError(fmt::format(
          "--first-stage-layers ({}) + --last-stage-layers ({}) leave no layers to the middle stage; allowed: counts "
          "that leave it one at least (below --layers = {} together)",
          c.first_stage_layers, c.last_stage_layers, m.layers));
    throw ConfigError(fmt::format("{} = {} leaves no layers to the {} stage; allowed: at most {}, or give {} 0 as well",
                                  named, has_first ? c.first_stage_layers : c.last_stage_layers,
                                  has_first ? "last" : "first", m.layers - 1,
                                  has_first ? "--last-stage-layers" : "--first-stage-layers"));
  }
  if (sharing > 0 && (rest < sharing || rest % sharing != 0))
    throw ConfigError(fmt::format(
        "{} leave{} {} layers to the other {} stage{}, which share them evenly, a layer each at least; allowed: "
        "counts that leave a positive multiple of {}",
        named, has_first && has_last ? "" : "s", rest, sharing, sharing == 1 ? "" : "s", sharing));
  const int each = sharing > 0 ? static_cast<int>(rest / sharing) : 0;
  const StageLayers s{has_first ? c.first_stage_layers : each, p > 2 ? each : 0, has_last ? c.last_stage_layers : each,
                      true};
  if (s.first == s.last && (p < 3 || s.middle == s.first)) return {s.first, s.first, s.first, false};  // (even)
  return s;
}

void validate_config(const GptModel& m, const ParallelConfig& c, long long gpus) {
  m.validate();
  if (c.tp < 1) throw ConfigError(fmt::format("--tp = {} must be at least 1", c.tp));
  if (c.pp < 1) throw ConfigError(fmt::format("--pp = {} must be at least 1", c.pp));
  if (gpus % (static_cast<long long>(c.tp) * c.pp) != 0)
    throw ConfigError(fmt::format("--tp ({}) x --pp ({}) must divide --gpus ({})", c.tp, c.pp, gpus));
  long long dp = gpus / (static_cast<long long>(c.tp) * c.pp);
  if (c.dp != 0 && c.dp != dp)
    throw ConfigError(fmt::format("--dp ({}) x --tp ({}) x --pp ({}) must equal --gpus ({})", c.dp, c.tp, c.pp, gpus));
  if (m.heads % c.tp != 0) throw ConfigError(fmt::format("--tp = {} must divide --heads = {}", c.tp, m.heads));
  kv_heads_per_rank(m, c.tp);  // (one of tp and the key/value heads divides the other)
  check_ffn_split(m, c.tp);
  if (c.micro_batch < 1) throw ConfigError(fmt::format("--micro-batch = {} must be at least 1", c.micro_batch));
  if (c.global_batch < 1) throw ConfigError(fmt::format("--global-batch = {} must be at least 1", c.global_batch));
  if (c.global_batch % (static_cast<long long>(c.micro_batch) * dp) != 0)
    throw ConfigError(
        fmt::format("--global-batch ({}) must be a multiple of --micro-batch ({}) x data-parallel size ({})",
                    c.global_batch, c.micro_batch, dp));
  const long long mb = c.global_batch / (static_cast<long long>(c.micro_batch) * dp);
  check_data_parallel_flags(c, dp);
  if (c.schedule == Schedule::kInterleaved) {
    if (c.virtual_stages < 2) throw ConfigError("--schedule interleaved needs --virtual-stages >= 2");
    if (c.pp < 2) throw ConfigError("--schedule interleaved needs --pp >= 2");
    if (mb % c.pp != 0)
      throw ConfigError(fmt::format(
          "--schedule interleaved needs the number of micro-batches ({}) to be a multiple of --pp ({})", mb, c.pp));
  } else if (c.virtual_stages != 1) {
    throw ConfigError("--virtual-stages > 1 needs --schedule interleaved");
  }
  stage_layers(m, c);  // (the layers split over the stages: evenly, or as given)
  if (c.zero < 0 || c.zero > 3) throw ConfigError(fmt::format("--zero = {} (allowed: 0, 1, 2, 3)", c.zero));
  if (c.zero >= 2 && c.pp > 1)
    throw ConfigError("--zero 2 and 3 with --pp > 1 are not modelled (DeepSpeed does not combine them either)");
  if (c.zero > 0 && c.compression.kind != "none" && c.compression.kind != "fp16" && c.compression.kind != "int8" &&
      c.compression.kind != "int4")
    throw ConfigError(fmt::format(
        "--compression {} with --zero {}: ZeRO reduce-scatters the gradients; allowed with --zero > 0: none, fp16 (a "
        "16-bit reduce-scatter), int8 or int4 (blocks by all-to-all, ZeRO++'s qgZ)",
        c.compression.kind, c.zero));
  if (c.tp == 1 && c.tp_algorithm != Algorithm::kAuto)
    throw ConfigError(fmt::format(
        "--tp-algorithm {}: the tensor-parallel collectives' algorithm, which --tp 1 does not have; allowed with --tp "
        "1: leave it out",
        algorithm_name(c.tp_algorithm)));
  if (c.sequence_parallel && c.tp == 1)
    throw ConfigError("--sp (sequence parallelism) needs --tp > 1: it splits the tensor-parallel activations");
  // (Megatron-LM's selective recompute drops the attention core's s^2 scores and recomputes them; FlashAttention
  // never stores them, so there is nothing to drop: Megatron-LM does not checkpoint the core with flash)
  if (c.recompute == Recompute::kSelective && scores_on_chip(c.attention))
    throw ConfigError(fmt::format(
        "--recompute selective recomputes the attention core to drop its s^2 scores, which --attention-kernels {0} "
        "never stores; allowed with {0}: --recompute none or full",
        attention_kernels_name(c.attention)));
  if (c.sequence_parallel && m.seq % c.tp != 0)
    throw ConfigError(fmt::format(
        "--sp splits the sequence over the tensor-parallel ranks: --tp = {} must divide --seq = {}", c.tp, m.seq));
  if (c.sync.kind == "local-sgd" && c.zero > 0)
    throw ConfigError("--sync local-sgd needs full model replicas: use --zero 0");
  // (as `conduit train`: int4 is ZeRO's reduce-scatter wire; local SGD averages the parameters uncompressed)
  if (c.compression.kind == "int4" && c.zero == 0)
    throw ConfigError(
        "--compression int4 is ZeRO's reduce-scatter wire (qgZ, --zero 1, 2 or 3); allowed with --zero 0: none, fp16, "
        "int8, topk:D, powersgd:R");
  check_local_sgd_compression(c.sync, c.compression);
  if (c.sync.kind == "async" && c.zero == 3)
    throw ConfigError(
        "--sync async with --zero 3 is not modelled: ZeRO-3 gathers every layer's parameters inside the step, so its "
        "exchange cannot run a step behind (allowed with async: --zero 0, 1, 2)");
  if (c.compression.kind == "powersgd" && c.compression.param > static_cast<double>(m.hidden / c.tp))
    throw ConfigError(fmt::format(
        "--compression powersgd:{:g}: the rank must not exceed the smallest weight matrix side (hidden / tp = {}), "
        "or the factors outgrow the gradient",
        c.compression.param, m.hidden / c.tp));
  if (c.bucket_bytes <= 0) throw ConfigError("--bucket must be positive");
  if (c.grad_bytes != 2 && c.grad_bytes != 4)
    throw ConfigError(fmt::format("--grad-bytes = {} (allowed: 2, 4)", c.grad_bytes));
}

namespace {

// MFU's denominator: the peak FLOP/s of the accelerators in use, averaged over them (the slowest kind's peak made a
// mixed cluster's MFU exceed 100%: 251% with one node of 312 and one of 31.2 TFLOP/s).
double mean_peak_flops(const Topology& topo) {
  double sum = 0, n = 0;
  for (size_t i = 0; i < topo.kind_counts().size(); ++i) {
    const NodeKind& k = topo.spec().node_kinds[i];
    const double g = static_cast<double>(topo.kind_counts()[i]) * k.gpus;
    sum += g * k.accelerator.peak_flops;
    n += g;
  }
  return n > 0 ? sum / n : 0;
}

// How an all-to-all over g (ZeRO's int8/int4 gradients, qgZ) is timed: the pairwise exchange up to 512 ranks; past
// that as a ring reduce-scatter of the same bytes (the same volume a rank and the same p - 1 latencies; its steps to
// a neighbour cross fewer spine links than a pairwise exchange's shifts, so it can be optimistic on oversubscribed
// networks), a pattern the model routes in a fraction of the time (a 3,125-rank pairwise exchange took 9 s).
std::pair<Collective, Algorithm> all_to_all_as(const Group& g) {
  if (g.size > 512) return {Collective::kReduceScatter, Algorithm::kRing};
  return {Collective::kAllToAll, Algorithm::kDirect};
}

// ZeRO's gradients in int blocks by all-to-all (--compression int8|int4 with --zero, ZeRO++'s qgZ, `conduit train
// --zero N --compressor int8`): blocks of 256 elements with a 4-byte scale each, every rank's part of each other
// rank's slice sent once; where a node holds `per_node` (K) of the `flat` group's ranks, `stride` apart, in two hops
// as ZeRO++'s hierarchical all-to-all and the runtime's: within the node, then 1/K of it among the ranks of one
// local index across nodes. A group of S consecutive ranks that K does not divide (shard groups of 6 on nodes of 4)
// holds parts of nodes, the smallest k = gcd(S, K) of its ranks, and the runtime takes two hops there too: within
// each part, then each part's partial sums to their owners on the other parts, the smallest part's ranks each
// sending (S - k) / (S k) of the gradients across (1/K where K divides S), timed as an all-to-all over the nodes a
// group spans at most, ceil((S + K - k) / K). Each hop quantizes and decodes its part (two passes over the gradients'
// `grad_bytes` and the blocks, at memory bandwidth) and pays the wake-up of its call.
struct Qgz {
  bool on = false, two_hops = false;
  double wire = 0;  // bytes an element on the wire
  Group flat, local, cross;
  long long k = 1;      // a node's ranks of the group (the most)
  long long least = 1;  // the fewest ranks of the group a node holds (k where k divides the group)
  double across = 0;    // the cross hop's all-to-all bytes per element on the wire
  Qgz(const ParallelConfig& cfg, const Group& dp, long long per_node) : flat(dp) {
    const std::string& kind = cfg.compression.kind;
    on = cfg.zero >= 1 && (kind == "int8" || kind == "int4");
    wire = (kind == "int8" ? 1.0 : 0.5) + 4.0 / 256;
    k = per_node;
    two_hops = on && k >= 2 && k < dp.size;
    if (two_hops) {
      const long long s = dp.size;
      least = std::gcd(s, k);
      const long long nodes = (s + k - least + k - 1) / k;
      local = Group{k, dp.stride, dp.first};
      cross = Group{nodes, dp.stride * k, dp.first};
      // (an all-to-all of n sends (nodes - 1) / nodes of n a rank: n such that that is the smallest part's share)
      across = static_cast<double>(s - least) / static_cast<double>(s * least) * static_cast<double>(nodes) /
               static_cast<double>(nodes - 1);
    }
  }
  // `time(collective, algorithm, group, bytes)`: the caller's timing (symmetric or full); `bottleneck` the slowest
  // hop's.
  template <typename TimeFn>
  double time(TimeFn&& time_of, const Accelerator& acc, double elems, double grad_bytes, double wake) const {
    auto hop = [&](const Group& g, double bytes) {
      const auto [c, a] = all_to_all_as(g);
      return time_of(c, a, g, bytes) + wake;
    };
    const double passes =
        memory_time(acc, elems * (grad_bytes + wire) * 2 * (two_hops ? 1 + 1.0 / static_cast<double>(least) : 1.0),
                    two_hops ? 4 : 2);
    return (two_hops ? hop(local, elems * wire) + hop(cross, elems * wire * across) : hop(flat, elems * wire)) + passes;
  }
  const Group& outer() const { return two_hops ? cross : flat; }  // (the hop that crosses nodes)
};

// A cluster file's rates are only checked to be positive: 1e-300 FLOP/s or b/s made every time inf (and the planner
// ranked inf and nan plans).
void check_finite(const StepResult& r) {
  if (std::isfinite(r.time) && r.time > 0) return;
  throw ConfigError(fmt::format(
      "the simulated step time is {}: a rate of the cluster (peak FLOP/s, memory bandwidth, link bandwidth) is too "
      "small or a time too large to compute with; allowed: rates and times whose products stay finite",
      r.time));
}

struct MicroTimes {
  double fwd_compute = 0, bwd_compute = 0, recompute = 0;  // per micro-batch on the last stage
  double layer_fwd = 0, layer_bwd = 0;                     // one layer (for ZeRO-3 overlap)
  double layer_recompute = 0;                              // one layer's recompute (in its backward)
};

GemmShape dgrad(const GemmShape& g) { return {g.m, g.k, g.n, g.batch}; }
GemmShape wgrad(const GemmShape& g) { return {g.k, g.n, g.m, g.batch}; }

// A 1F1B pipeline played out operation by operation: stage i (of p) runs w = min(p - 1 - i, m) forwards, then a
// forward and a backward in turn, then the backwards left; a forward waits for the stage before's forward of its
// micro-batch, a backward for the stage after's backward (the last stage's for its own forward). `fwd` and `bwd`: each
// stage's time per micro-batch. Returns the time the last operation ends. Each stage's order is generated as it goes
// and the finish times kept for the last 2p + 2 micro-batches only (a stage is never further ahead of its neighbours
// than its w + 1 micro-batches in flight): O(p) memory a stage, O(p m) time (it held every operation: 3 GB and 18 s
// at p 64 and a million micro-batches, found by a review).
constexpr long long kMaxPlayedOps = 25000000, kMaxPlayedWindow = 1LL << 22;

double played_1f1b(const std::vector<double>& fwd, const std::vector<double>& bwd, long long m) {
  const size_t p = fwd.size(), window = static_cast<size_t>(std::min<long long>(2 * p + 2, std::max(m, 1LL)));
  struct Done {
    long long mb = -1;  // (the micro-batch whose finish time `at` is, -1: none yet)
    double at = 0;
  };
  std::vector<std::vector<Done>> fdone(p, std::vector<Done>(window)), bdone = fdone;
  std::vector<long long> next(p, 0);  // each stage's next operation
  std::vector<double> free_at(p, 0.0);
  auto op = [&](size_t i, long long k) {  // stage i's k-th operation: (backward?, micro-batch)
    const long long w = std::min(static_cast<long long>(p - 1 - i), m);
    if (k < w) return std::pair{false, k};
    if (k < w + 2 * (m - w)) return (k - w) % 2 == 0 ? std::pair{false, w + (k - w) / 2} : std::pair{true, (k - w) / 2};
    return std::pair{true, k - w - (m - w)};
  };
  auto finished = [&](const std::vector<Done>& d, long long j) -> const Done* {
    const Done& x = d[static_cast<size_t>(j) % window];
    return x.mb == j ? &x : nullptr;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t i = 0; i < p; ++i)
      for (; next[i] < 2 * m; ++next[i]) {
        const auto [back, j] = op(i, next[i]);
        const Done* in =
            !back ? (i > 0 ? finished(fdone[i - 1], j) : nullptr) : finished(i + 1 < p ? bdone[i + 1] : fdone[i], j);
        if (!in && (back || i > 0)) break;  // (its input is not there yet)
        free_at[i] = std::max(free_at[i], in ? in->at : 0.0) + (back ? bwd[i] : fwd[i]);
        (back ? bdone : fdone)[i][static_cast<size_t>(j) % window] = {j, free_at[i]};
        moved = true;
      }
  }
  for (size_t i = 0; i < p; ++i)
    if (next[i] < 2 * m) throw std::logic_error("played_1f1b: the schedule deadlocked");
  return *std::max_element(free_at.begin(), free_at.end());
}

MicroTimes micro_times(const Accelerator& acc, const GptModel& m, const ParallelConfig& c, int layers_per_stage,
                       bool last_stage) {
  MicroTimes t;
  const int tp = c.tp;
  const double b = c.micro_batch, s = static_cast<double>(m.seq), h = static_cast<double>(m.hidden);
  const double a = static_cast<double>(m.heads);
  // FlashAttention-2 and -3 run the core (QK^T, the softmax and AV, forward and backward) at the accelerator's
  // measured rate for them; every other kernel choice runs its GEMMs at the GEMM model's.
  const bool measured_core = c.attention == AttentionKernels::kFlash2 || c.attention == AttentionKernels::kFlash3;
  double fwd = 0, core = 0, bwd = 0;
  for (const auto& g : gpt_layer_gemms(m, b, tp)) {
    if (measured_core && g.attention_core) continue;
    double tf = gemm_time(acc, g.shape);
    fwd += tf;
    if (g.attention_core) core += tf;
    bwd += gemm_time(acc, dgrad(g.shape)) + gemm_time(acc, wgrad(g.shape));
  }
  const bool flash = scores_on_chip(c.attention);
  if (measured_core) {
    // FlashAttention's FLOPs, as its benchmarks count them: the forward 4 s^2 d a head, halved by the causal mask,
    // the backward (which recomputes the scores) 2.5 times that, each at its share of the measured rate.
    const double head_dim = h / a;
    const FlashRates rate = flash_attention_rates(acc, attention_kernels_name(c.attention), s, head_dim);
    const double flops = flash_attention_forward_flops(b, a / tp, s, head_dim);
    core = flops / rate.forward;
    fwd += core;
    bwd += 2.5 * flops / rate.backward;
  } else if (flash) {
    // FlashAttention's backward recomputes the scores: QK^T once more (the core's two GEMMs, QK^T and AV, do as many
    // multiply-adds: half its forward).
    bwd += core / 2;
  }
  // Element-wise kernels, 2-byte elements: two layer norms (read + write), two bias-dropout-adds (two reads, a
  // write, a 1-byte mask), fused scale-mask-softmax (read + write) and attention dropout (read, write, mask) on
  // the b*a/t*s*s scores, fused bias-GeLU (read + write) on the b*s*4h/t MLP activations (SwiGLU reads the gate and up
  // halves and writes their product); the backward twice the forward's traffic. Eager attention scales and masks the
  // scores in two kernels more, each a read and a write, and so do their backwards (the gradient scaled, and masked).
  const double hdiv = c.sequence_parallel ? tp : 1;
  const double h_bytes = 2 * (2 * 2 + 2 * 3.5) * b * s * h / hdiv;
  // FlashAttention keeps the scores on chip: no softmax or dropout kernels over them, forward or backward.
  const double s_bytes = flash ? 0 : 2 * (2 + 2.5) * b * (a / tp) * s * s;
  const int s_kernels = flash ? 0 : 2;
  const double f_bytes = 2 * b * s * (m.mlp_up_width() + m.ffn()) / tp;
  const bool eager = c.attention == AttentionKernels::kEager;
  const double e_bytes = eager ? 2 * (2 + 2) * b * (a / tp) * s * s : 0;
  const int e_kernels = eager ? 2 : 0;
  const double ew_fwd = memory_time(acc, h_bytes + s_bytes + f_bytes + e_bytes, 5 + s_kernels + e_kernels);
  const double ew_bwd = memory_time(acc, 2 * (h_bytes + s_bytes + f_bytes) + e_bytes, 10 + 2 * s_kernels + e_kernels);
  const double ew_core = memory_time(acc, s_bytes + e_bytes, s_kernels + e_kernels);
  t.layer_fwd = fwd + ew_fwd;
  t.layer_bwd = bwd + ew_bwd;
  double rec = 0;
  if (c.recompute == Recompute::kFull) rec = fwd + ew_fwd;
  if (c.recompute == Recompute::kSelective) rec = core + ew_core;
  t.layer_recompute = rec;
  t.fwd_compute = layers_per_stage * t.layer_fwd;
  t.bwd_compute = layers_per_stage * (t.layer_bwd + rec);
  t.recompute = layers_per_stage * rec;
  if (last_stage) {
    GemmShape lg = gpt_logits_gemm(m, b, tp);
    const double ce = memory_time(acc, 3 * 4 * b * s * static_cast<double>(m.vocab) / tp, 3);  // fp32 softmax + loss
    t.fwd_compute += gemm_time(acc, lg) + ce;
    t.bwd_compute += gemm_time(acc, dgrad(lg)) + gemm_time(acc, wgrad(lg)) + ce;
  }
  return t;
}

// The time a step gains because the collectives it hides behind compute slow that compute: while they run, their
// kernels hold comm_sms of the accelerator's sm_count SMs, and the compute they overlap runs on the rest, so the
// compute path takes f = comm_sms / sm_count of the hidden time longer. The step ends at the later of that path's end
// and the communication's (unchanged): the stretch past the time the compute spent waiting for exposed communication.
// `share` is comm_sms / sm_count, `hidden` the communication time that overlapped compute (capped at `compute`),
// `exposed` the time the step waited for communication (all of it counted as slack the stretch can fill: a wait that
// comes strictly before or after the compute, a gather before the first layer, is not, which this leaves out).
double overlap_slowdown(double share, double hidden, double compute, double exposed) {
  if (share <= 0 || hidden <= 0) return 0;
  return std::max(0.0, share * std::min(hidden, compute) - exposed);
}

double comm_share(const Accelerator& acc) { return static_cast<double>(acc.comm_sms) / acc.sm_count; }

// Time of bucketed gradient exchange overlapped with a backward pass of length `window`: buckets become ready
// uniformly during the window and are exchanged one after another. Returns the time past the window's end.
// `busy` (when given) receives the total exchange time of all buckets (each pays its own latency).
template <class TimeOf>
double bucketed_exposed(double window, double total_bytes, double bucket_bytes, TimeOf time_of,
                        double* busy = nullptr) {
  if (total_bytes <= 0) return 0;
  const double n = std::max(1.0, std::ceil(total_bytes / bucket_bytes));  // buckets
  const double each = total_bytes / n;
  const double t_each = time_of(each);
  // Bucket i (0-based) is ready at window (i + 1) / n; exchanges run one after another, so the last ends at
  // max over i of ready_i + (n - i) t_each: linear in i, hence at i = 0 or i = n - 1 (closed form: any bucket
  // count, even one per byte, costs the same to evaluate).
  const double end = std::max(window / n + n * t_each, window + t_each);
  if (busy) *busy = t_each * n;
  return std::max(0.0, end - window);
}

// ZeRO-1/2's deferred allgather played out against the next forward (units in forward order, each computing
// `fwd[u]` once its calls are done; the calls one after another on the gathers' channel, `time_of` each): the
// forward's end minus its compute (the exposed part), and the calls' total time in `busy`.
template <class TimeOf>
double deferred_allgather_exposed(const std::vector<DeferredCall>& calls, const std::vector<double>& fwd,
                                  TimeOf time_of, double* busy) {
  double done = 0, clock = 0, compute = 0;
  size_t k = 0;
  for (size_t u = 0; u < fwd.size(); ++u) {
    for (; k < calls.size() && calls[k].unit == u; ++k) done += time_of(calls[k].elems);
    clock = std::max(clock, done) + fwd[u];
    compute += fwd[u];
  }
  *busy = done;
  return clock - compute;
}

// The step notes' mention of the per-call wake latency, when the cluster has one.
std::string wake_note(double wake) {
  return wake > 0 ? fmt::format("; each call includes {} of waking peers (network.wake_latency)", format_seconds(wake))
                  : std::string();
}

// The accelerator's measured step of exactly these layers (kind, sizes, kernel, map), or nullptr.
const ModelStepSample* find_model_step(const Accelerator& acc, const LayerModel& m) {
  for (const auto& s : acc.model_calibration) {
    const LayerModel c = parse_layer_model(s.layers);
    bool same = c.layers.size() == m.layers.size();
    for (size_t i = 0; same && i < c.layers.size(); ++i) {
      const Layer &x = c.layers[i], &y = m.layers[i];
      same = x.kind == y.kind && x.in == y.in && x.out == y.out && x.kernel == y.kernel && x.height == y.height &&
             x.width == y.width;
    }
    if (same) return &s;
  }
  return nullptr;
}

}  // namespace

std::vector<DeferredCall> deferred_allgather_calls(const std::vector<std::vector<double>>& units, double bucket_elems,
                                                   double min_elems) {
  // Each tensor's bucket: the tensors from the last backward.
  std::vector<std::vector<int>> bucket(units.size());
  int b = 0;
  double fill = 0;
  bool empty = true;
  for (size_t u = units.size(); u-- > 0;) {
    bucket[u].assign(units[u].size(), 0);
    for (size_t i = units[u].size(); i-- > 0;) {
      if (!empty && fill + units[u][i] > bucket_elems) {
        ++b;
        fill = 0;
      }
      bucket[u][i] = b;
      fill += units[u][i];
      empty = false;
    }
  }
  std::vector<DeferredCall> calls;
  std::map<int, size_t> last;  // each bucket's latest call
  for (size_t u = 0; u < units.size(); ++u) {
    // The unit's elements per bucket (its tensors are consecutive in the buckets: one range in each).
    std::map<int, double> part;
    for (size_t i = 0; i < units[u].size(); ++i)
      if (units[u][i] > 0) part[bucket[u][i]] += units[u][i];
    for (auto [bk, elems] : part) {  // (the runtime issues a unit's pieces bucket by bucket, the lowest first)
      // The bucket's last call is the previous unit's part of it (the units' ranges touch): joined while small.
      if (auto it = last.find(bk); it != last.end() && calls[it->second].elems < min_elems) {
        calls[it->second].elems += elems;
        continue;
      }
      last[bk] = calls.size();
      calls.push_back({elems, u});
    }
  }
  return calls;
}

namespace {

// ZeRO's groups of K consecutive data-parallel ranks (--zero-hpz's secondary partition, ZeRO-3's; --zero-shard-group's
// shards, stages 1-3): the K given, or `node` (-1): the node's data-parallel ranks (node_gpus / t); none (0) below
// `from_stage`, or where a node's do not cut the d data-parallel ranks into two groups or more (a note says so; a K
// given so is refused).
long long zero_group_size(int zero, int from_stage, long long given, long long d, long long node_gpus, int t,
                          const char* flag, const char* what, const char* instead, std::vector<std::string>& notes) {
  if (zero < from_stage || (given >= 0 && given <= 1)) return 0;
  const long long k = given > 1 ? given : node_gpus / t;
  if (k >= 2 && d % k == 0 && k < d) return k;
  if (given > 1)
    throw ConfigError(fmt::format(
        "{} = {}: groups that do not divide the {} data-parallel ranks into two or more; allowed: a divisor of {} "
        "below it, or node (gpus a node / tp)",
        flag, given, d, d));
  notes.push_back(fmt::format("{} node: {} data-parallel ranks a node ({} GPUs / tp {}) form no {} of the {}; {}", flag,
                              k, node_gpus, t, what, d, instead));
  return 0;
}

// A layer list's FLOPs a sample, as the step times them: each layer's forward, weight gradient and input gradient,
// but the first layer's input gradient (its input is the data). (Three forwards for every layer, Megatron's count for
// transformers, took the first layer's input gradient as done: a model of one large convolution reported an MFU of
// 119%.)
double layer_model_flops(const LayerModel& m) {
  double flops = 0;
  for (size_t li = 0; li < m.layers.size(); ++li) flops += (li > 0 ? 3 : 2) * m.layers[li].forward_gemm(1).flops();
  return flops;
}

// --zero-reduce as modelled: at ZeRO-2 and 3, the model's default resolved (a GPT model's every micro-batch,
// DeepSpeed's; a layer list's once a step, conduit train's); refused where a data-parallel rank has one micro-batch
// (then both are one reduce-scatter).
ZeroReduce zero_reduce_mode(const ParallelConfig& cfg, long long mb, ZeroReduce model_default) {
  if (cfg.zero < 2) return ZeroReduce::kModelDefault;
  if (mb <= 1 && cfg.zero_reduce != ZeroReduce::kModelDefault)
    throw ConfigError(
        "--zero-reduce: this step has one micro-batch a data-parallel rank (--global-batch / (--micro-batch x dp)), "
        "reduce-scattered once either way; allowed: leave it out, or a --global-batch of several micro-batches a rank");
  return cfg.zero_reduce == ZeroReduce::kModelDefault ? model_default : cfg.zero_reduce;
}

// An algorithm given for a collective it does not implement (--tp-algorithm direct with --sp's all-gathers), or
// not on this cluster (in-network without switches that aggregate): the flag named. `flag` says which given
// algorithm's collectives were being timed (nullptr: none, or the flag was left at auto); other refusals (full-detail
// mode's) pass as they are.
template <class Simulate>
StepResult naming_the_algorithm_flag(const char*& flag, Simulate simulate) {
  try {
    return simulate();
  } catch (const UnsupportedError& e) {
    if (!flag || std::string_view(e.what()).starts_with("full-detail mode")) throw;
    throw ConfigError(fmt::format(
        "{}: {}; allowed: auto, or an algorithm that implements it (`conduit sim coll --op OP --algorithm all` "
        "lists them)",
        flag, e.what()));
  }
}

StepResult gpt_step(CollectiveModel& net, const GptModel& given, const ParallelConfig& cfg, const char*& flag);

}  // namespace

StepResult simulate_step(CollectiveModel& net, const GptModel& given, const ParallelConfig& cfg) {
  const char* flag = nullptr;
  return naming_the_algorithm_flag(flag, [&] { return gpt_step(net, given, cfg, flag); });
}

namespace {

StepResult gpt_step(CollectiveModel& net, const GptModel& given, const ParallelConfig& cfg, const char*& flag) {
  const Topology& topo = net.topology();
  const long long gpus = topo.gpus();
  validate_config(given, cfg, gpus);
  const GptModel m = vocab_padded(given, cfg.tp);
  StepResult r;
  if (m.vocab != given.vocab)
    r.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} entries so that the {} tensor-parallel "
                    "ranks split it evenly",
                    given.vocab, m.vocab, cfg.tp));
  r.config = cfg;
  r.gpus = gpus;
  // Collective time in the chosen mode: symmetric profiles, or every concurrent group simulated flow by flow.
  // Symmetric mode says which groups it could only approximate (copies sharing links unevenly, too many to route).
  std::set<std::tuple<int, long long, long long>> approximated;
  auto ctime = [&](Collective c, const CollectiveCost& prof, const Group& g, double n) {
    if (cfg.mode == EvalMode::kFull) return net.time_full(c, prof.algorithm, g, n);
    r.approximate = r.approximate || prof.approximate;
    if (prof.approximate && approximated.emplace(static_cast<int>(c), g.size, g.stride).second)
      r.notes.push_back(fmt::format(
          "approximate: the {} groups of {} ranks (stride {}) straddle nodes or leaves unevenly and are too many to "
          "route together or run different patterns, so symmetric mode scales each placement's own link loads (the "
          "time can be well under the truth; `sim coll --mode full` times such groups when their patterns agree)",
          collective_name(c), g.size, g.stride));
    return prof.time(n);
  };
  const int t = cfg.tp, p = cfg.pp;
  const long long d = gpus / (static_cast<long long>(t) * p);
  r.config.dp = d;
  const long long hpz = zero_group_size(cfg.zero, 3, cfg.zero_hpz, d, topo.gpus_per_node(), t, "--zero-hpz",
                                        "secondary partition", "none used", r.notes);
  if (hpz > 1 && cfg.zero == 3 && (cfg.zero_shard > 1 || cfg.zero_shard < 0))
    throw ConfigError(
        "--zero-shard-group with --zero-hpz: the gathers run within the shard group already; allowed: one of them");
  const long long shard = zero_group_size(cfg.zero, 1, cfg.zero_shard, d, topo.gpus_per_node(), t, "--zero-shard-group",
                                          "shard groups", "sharded over all", r.notes);
  // (the result's configuration holds the groups used: `node` resolved, 0 where none)
  r.config.zero_hpz = hpz;
  r.config.zero_shard = shard;
  const int v = cfg.schedule == Schedule::kInterleaved ? cfg.virtual_stages : 1;
  const long long mb = cfg.global_batch / (static_cast<long long>(cfg.micro_batch) * d);
  r.microbatches = mb;
  const ZeroReduce z2 = zero_reduce_mode(cfg, mb, ZeroReduce::kEveryMicroBatch);
  r.config.zero_reduce = z2;
  // Each stage's transformer layers (the first's also the embedding, the last's the output layer and the loss).
  const StageLayers split = stage_layers(m, cfg);
  r.stage_layers = split;
  const int lps_first = split.first, lps_mid = split.middle, lps_last = split.last;
  const double b = cfg.micro_batch, s = static_cast<double>(m.seq), h = static_cast<double>(m.hidden);
  const double V = static_cast<double>(m.vocab);

  // Compute: the slowest node kind bounds a synchronous step (ranked on the last stage, the output layer's, or with
  // an uneven split on the most layers a stage holds: the output layer alone ranked them with --last-stage-layers 0).
  const int rank_layers = split.uneven ? std::max({lps_first, lps_mid, lps_last}) : lps_last;
  MicroTimes mt;
  const Accelerator* slowest = nullptr;
  double mem_capacity = 1e300, largest_share = 0;
  int kinds = 0;
  for (size_t i = 0; i < topo.kind_counts().size(); ++i) {
    if (topo.kind_counts()[i] == 0) continue;
    ++kinds;
    const NodeKind& k = topo.spec().node_kinds[i];
    MicroTimes x = micro_times(k.accelerator, m, cfg, rank_layers, true);
    if (!slowest || x.fwd_compute + x.bwd_compute > mt.fwd_compute + mt.bwd_compute) {
      mt = x;
      slowest = &k.accelerator;
    }
    mem_capacity = std::min(mem_capacity, k.accelerator.memory_bytes);
    largest_share = std::max(largest_share, comm_share(k.accelerator));
  }
  if (rank_layers != lps_last) mt = micro_times(*slowest, m, cfg, lps_last, true);  // (the last stage's, as ranked)
  if (kinds > 1 && cfg.balance) {
    if (t != 1 || p != 1) throw ConfigError("--balance needs --tp 1 and --pp 1 (data parallelism only)");
    // Shares proportional to speed: all ranks finish their micro-batches together after
    // (global micro-batches) / sum over ranks of (1 / time per micro-batch).
    double rate = 0;
    for (size_t i = 0; i < topo.kind_counts().size(); ++i) {
      if (topo.kind_counts()[i] == 0) continue;
      const NodeKind& k = topo.spec().node_kinds[i];
      MicroTimes x = micro_times(k.accelerator, m, cfg, lps_last, true);
      rate += static_cast<double>(topo.kind_counts()[i] * k.gpus) / (x.fwd_compute + x.bwd_compute);
    }
    const double total_mb = static_cast<double>(cfg.global_batch) / cfg.micro_batch;
    const double ratio = (total_mb / rate) / (static_cast<double>(mb) * (mt.fwd_compute + mt.bwd_compute));
    mt.fwd_compute *= ratio;
    mt.bwd_compute *= ratio;
    mt.recompute *= ratio;
    mt.layer_fwd *= ratio;
    mt.layer_bwd *= ratio;
    mt.layer_recompute *= ratio;
    r.notes.push_back(
        fmt::format("heterogeneous cluster, batch shares proportional to speed: compute {:.0f}% of the "
                    "equal-share time bounded by {}",
                    100 * ratio, slowest->name));
  } else if (kinds > 1) {
    r.notes.push_back(fmt::format("heterogeneous cluster: {} accelerators bound the step", slowest->name));
  } else if (cfg.balance) {
    throw ConfigError(
        "--balance shares the batch among different accelerators: this cluster has one kind; allowed: a cluster "
        "with several node kinds, or leave --balance out");
  }

  const Accelerator& acc = *slowest;

  // Tensor-parallel communication per micro-batch: per layer, and at the model's two ends.
  flag = cfg.tp_algorithm != Algorithm::kAuto ? "--tp-algorithm" : nullptr;
  double tp_fwd = 0, tp_bwd = 0, tp_first = 0, tp_last_fwd = 0, tp_last_bwd = 0;
  if (t > 1) {
    const Group tg{t, 1, 0};
    const double act = b * s * h * 2;
    auto one = [&](Collective k, double n) { return ctime(k, net.profile(k, cfg.tp_algorithm, tg, n), tg, n); };
    const Collective per_layer = cfg.sequence_parallel ? Collective::kAllGather : Collective::kAllReduce;
    const CollectiveCost prof = net.profile(per_layer, cfg.tp_algorithm, tg, act);
    r.tp_algorithm = algorithm_name(prof.algorithm);
    tp_fwd = 2 * (ctime(per_layer, prof, tg, act) + (cfg.sequence_parallel ? one(Collective::kReduceScatter, act) : 0));
    tp_bwd = tp_fwd + (cfg.recompute == Recompute::kFull ? tp_fwd : 0);
    // The vocab-parallel embedding's output and the output layer's input (Megatron-LM): an allreduce in the
    // embedding's forward (first stage) and one of the output layer's input gradient (last stage); with sequence
    // parallelism a reduce-scatter there, and an all-gather of the output layer's input plus a reduce-scatter of its
    // gradient; and the vocab-parallel cross entropy's allreduces of the per-token max, target logit and sum (fp32).
    tp_first = cfg.sequence_parallel ? one(Collective::kReduceScatter, act) : one(Collective::kAllReduce, act);
    tp_last_fwd =
        (cfg.sequence_parallel ? one(Collective::kAllGather, act) : 0.0) + 3 * one(Collective::kAllReduce, b * s * 4);
    tp_last_bwd = cfg.sequence_parallel ? one(Collective::kReduceScatter, act) : one(Collective::kAllReduce, act);
  }

  // Pipeline point-to-point per micro-batch: forward activations and backward gradients, v times (interleaved).
  flag = nullptr;
  double p2p_mb = 0;
  if (p > 1) {
    const double msg = b * s * h * 2 / t;  // scatter/gather across the t ranks of a stage
    const Group pg{p, static_cast<long long>(t) * d, 0};
    double one = ctime(Collective::kShift, net.profile(Collective::kShift, Algorithm::kDirect, pg, msg), pg, msg);
    p2p_mb = 2.0 * v * one;
  }

  // Each stage's time per micro-batch, forward and backward (its layers, their collectives and its transfers): the
  // last stage also runs the output layer and the loss, the first the embedding's collective (forward), a middle one
  // neither; one stage (p = 1) runs both ends. With stage times S_i = F_i + B_i, played out operation by operation:
  //   1F1B: m max S + (sum S - max S); interleaved: m max S + (sum S - max S) / v + (p - 1/v)(S_first - S_middle)
  //     (the first stage's extra sits in its first chunk, through which the first p micro-batches pass before the
  //     pipeline fills); both exact whenever the last stage is the slowest, as the output layer makes it (its
  //     collectives hold the first stage's and more), for any split of S into F and B;
  //   GPipe (every forward, then every backward: two flow shops): sum S + (m - 1)(max F + max B), exact;
  // each (m + (p - 1) / v) S when the stages are equal. Charging every stage the last one's time overstated the
  // pipeline by 16% (GPT 1.7B, p 8, m 8 on dgx-a100), 41% with 8 small layers (an audit).
  struct StageTime {
    double fwd = 0, bwd = 0, compute = 0, recompute = 0, tp = 0;
    double total() const { return fwd + bwd; }
  };
  auto stage = [&](const MicroTimes& x, double tp_f, double tp_b) {
    return StageTime{x.fwd_compute + tp_f + p2p_mb / 2, x.bwd_compute + tp_b + p2p_mb / 2,
                     x.fwd_compute + x.bwd_compute, x.recompute, tp_f + tp_b};
  };
  const MicroTimes inner = p > 1 ? micro_times(acc, m, cfg, lps_first, false) : mt;
  const MicroTimes inner_mid = lps_mid == lps_first ? inner : micro_times(acc, m, cfg, lps_mid, false);
  const StageTime last =
      stage(mt, lps_last * tp_fwd + tp_last_fwd + (p == 1 ? tp_first : 0.0), lps_last * tp_bwd + tp_last_bwd);
  const StageTime first = stage(inner, lps_first * tp_fwd + tp_first, lps_first * tp_bwd);
  const StageTime middle = stage(inner_mid, lps_mid * tp_fwd, lps_mid * tp_bwd);
  r.breakdown.stage_layer_forward = inner.layer_fwd + tp_fwd;
  r.breakdown.stage_layer = inner.layer_fwd + inner.layer_bwd + inner.layer_recompute + tp_fwd + tp_bwd;
  // The slowest stage, whose m micro-batches the pipeline runs back to back: the last with an even split (the output
  // layer and the loss), any with an uneven one (BLOOM's middle stages, a layer more than the ends).
  const StageTime* slowest_stage = &last;
  if (split.uneven && first.total() > slowest_stage->total()) slowest_stage = &first;
  if (split.uneven && p > 2 && middle.total() > slowest_stage->total()) slowest_stage = &middle;
  const double slot = slowest_stage->total();
  const double stages_sum = p == 1 ? slot : first.total() + static_cast<double>(p - 2) * middle.total() + last.total();
  r.breakdown.compute = mb * slowest_stage->compute;
  r.breakdown.recompute = mb * slowest_stage->recompute;
  r.breakdown.tp_comm = mb * slowest_stage->tp;
  r.breakdown.pp_comm = mb * p2p_mb;
  if (p > 1) {
    r.breakdown.stage_first = first.total(), r.breakdown.stage_first_forward = first.fwd;
    r.breakdown.stage_middle = middle.total(), r.breakdown.stage_middle_forward = middle.fwd;
  }
  r.breakdown.stage_last = last.total(), r.breakdown.stage_last_forward = last.fwd;
  const double mf = static_cast<double>(mb);
  if (p == 1) {
    r.breakdown.bubble = 0;
  } else if (cfg.schedule == Schedule::kGpipe) {
    const double max_f = std::max({first.fwd, p > 2 ? middle.fwd : 0.0, last.fwd});
    const double max_b = std::max({first.bwd, p > 2 ? middle.bwd : 0.0, last.bwd});
    r.breakdown.bubble = stages_sum + (mf - 1) * (max_f + max_b) - mf * slot;
  } else if (split.uneven) {
    // (1F1B with a stage slower than the last: its warm-up can wait less than the closed form's sum, so played out)
    // (O(p m) time and O(p min(2p + 2, m)) memory: bounded, p 16384 asked for 17 GB)
    // (the quotients, not the products: a batch of 3e18 wrapped the product negative and ran for ever)
    const long long pl = p, window = std::min(2 * pl + 2, mb);
    const bool too_many = mb > kMaxPlayedOps / pl;
    if (too_many || window > kMaxPlayedWindow / pl)
      throw ConfigError(fmt::format(
          "an uneven pipeline split is played out micro-batch by micro-batch on each stage: {} (allowed: up to {}); "
          "allowed: fewer stages or micro-batches (--global-batch, --micro-batch), or an even split",
          too_many ? fmt::format("pp ({}) x {} micro-batches is {}", p, mb,
                                 mb > std::numeric_limits<long long>::max() / pl ? std::string("over 2^63")
                                                                                 : std::to_string(pl * mb))
                   : fmt::format("pp ({}) x min(2 pp + 2, {} micro-batches) is {}", p, mb, pl * window),
          too_many ? kMaxPlayedOps : kMaxPlayedWindow));
    std::vector<double> fwd(static_cast<size_t>(p), middle.fwd), bwd(static_cast<size_t>(p), middle.bwd);
    fwd.front() = first.fwd, bwd.front() = first.bwd, fwd.back() = last.fwd, bwd.back() = last.bwd;
    r.breakdown.bubble = played_1f1b(fwd, bwd, mb) - mf * slot;
  } else {
    const double skew = v > 1 ? (static_cast<double>(p) - 1.0 / v) * (first.total() - middle.total()) : 0.0;
    r.breakdown.bubble = (stages_sum - slot) / v + skew;
  }
  r.breakdown.bubble = std::max(0.0, r.breakdown.bubble);  // (rounding left -2e-16, printed as -0.0%)
  const double pipe = mf * slot + r.breakdown.bubble;

  // Parameters per GPU on the largest stage (the first holds the embeddings; with p = 1 everything).
  // t times one rank's share (the K and V of replicated KV heads whole on each rank), so that / t is a rank's.
  const double layer_params = gpt_layer_parameters_per_rank(m, t) * t;
  // The embeddings on one GPU: the word embeddings split over the t ranks (vocab-parallel), the position embeddings
  // whole on each (Megatron-LM replicates them; they were divided by t as well).
  const double emb_gpu = V * h / t + s * h;
  const double params_gpu = lps_first * layer_params / t + emb_gpu;  // (the first stage's)
  // The stage whose data-parallel exchange and optimizer step the step waits for: the first, whose last backward is
  // the schedule's last operation and which holds the most (its layers and the embeddings), unless an uneven split
  // gives another stage more: a middle one its layers, the last its layers and the output layer's copy of the word
  // embeddings. That stage's exchange is charged as if it too ended last (its lead over the first stage, a drain's
  // worth of backwards, is not credited: an over-estimate where its exchange is exposed).
  enum class DpStage { kFirst, kMiddle, kLast };
  DpStage dp_stage = DpStage::kFirst;
  double dp_params = params_gpu;
  int dp_layers = lps_first;
  if (split.uneven && p > 2 && lps_mid * layer_params / t > dp_params)
    dp_stage = DpStage::kMiddle, dp_params = lps_mid * layer_params / t, dp_layers = lps_mid;
  if (split.uneven && (lps_last * layer_params + V * h) / t > dp_params)
    dp_stage = DpStage::kLast, dp_params = (lps_last * layer_params + V * h) / t, dp_layers = lps_last;
  const MicroTimes& dp_micro = dp_stage == DpStage::kFirst ? inner : dp_stage == DpStage::kMiddle ? inner_mid : mt;

  // Data-parallel exchange. Each data-parallel call also pays the wake-up of peers that arrived first and stopped
  // polling (calibrated CPU clusters; 0 elsewhere): the ranks reach a gradient exchange apart.
  const double wake = topo.spec().network.wake_latency;
  double dp_total = 0, dp_exposed = 0, comp_time = 0;
  flag = cfg.dp_algorithm != Algorithm::kAuto ? "--dp-algorithm" : nullptr;
  // The data-parallel exchange overlaps the first stage's last backward (p = 1: the whole model's), the pipeline's
  // last operation, whose gradients (with the embeddings) are the most; the last stage's backward, with the output
  // layer's, ended a drain earlier.
  const double bwd_window =
      dp_micro.bwd_compute + dp_layers * tp_bwd + (dp_stage == DpStage::kLast && p > 1 ? tp_last_bwd : 0.0);
  if (d > 1) {
    const Group dg{d, static_cast<long long>(t), 0};
    const double grad_bytes = dp_params * cfg.grad_bytes;
    // ZeRO's reduce-scatter of n gradient elements (each cfg.grad_bytes): a reduce-scatter, of 2-byte elements with
    // --compression fp16; with int8 or int4 (ZeRO++'s qgZ, `conduit train --compressor int8`) an all-to-all of
    // blocks of 256 with a 4-byte scale each, every rank's part of each other rank's slice sent once, in two hops
    // where a node holds several data-parallel ranks (K = gpus a node / t): within the node, then 1/K of it across
    // nodes among the ranks of one local index; each hop quantizes and dequantizes its part (two passes over the
    // gradients and the blocks at memory bandwidth).
    const std::string& zq = cfg.compression.kind;
    const double zero_rs_bytes = cfg.zero >= 1 && zq == "fp16" ? 2.0 : cfg.grad_bytes;
    // ZeRO sharded within groups (--zero-shard-group K): its gathers and reduce-scatters within the K ranks `zg`,
    // then each rank's slice (1/K of the call) allreduced across the d/K groups (`rg`, the ranks of one index).
    const Group zg = shard > 1 ? Group{shard, static_cast<long long>(t), 0} : dg;
    const Group rg{shard > 1 ? d / shard : 1, static_cast<long long>(t) * std::max(shard, 1LL), 0};
    // (on the reduce-scatter's 16-bit wire with --compression fp16, else in the gradients' own precision, as the
    // runtime's: int blocks are the group's reduce-scatter's only)
    auto replicas = [&](double elems) {
      if (shard <= 1) return 0.0;
      const double bytes = elems / static_cast<double>(shard) * zero_rs_bytes;
      auto ar = net.profile(Collective::kAllReduce, cfg.dp_algorithm, rg, bytes);
      return ctime(Collective::kAllReduce, ar, rg, bytes) + wake;
    };
    // (a node's data-parallel ranks: G / t where t divides a node's G, else none on one node)
    const Qgz qgz(cfg, zg, topo.gpus_per_node() % t == 0 ? topo.gpus_per_node() / t : 1);
    std::map<double, double> qgz_took;
    // (profiled at `at` bytes of the gradients when given: the algorithm the bucket size picks)
    auto zero_rs = [&](double elems, double at = 0) {
      if (!qgz.on) {
        const double on_wire = at > 0 ? at * zero_rs_bytes / cfg.grad_bytes : elems * zero_rs_bytes;
        auto rs = net.profile(Collective::kReduceScatter, cfg.dp_algorithm, zg, on_wire);
        return ctime(Collective::kReduceScatter, rs, zg, elems * zero_rs_bytes) + wake + replicas(elems);
      }
      auto [it, fresh] = qgz_took.emplace(elems, 0.0);
      if (fresh)
        it->second = qgz.time([&](Collective c, Algorithm a, const Group& g,
                                  double n) { return ctime(c, net.profile(c, a, g, n), g, n); },
                              acc, elems, cfg.grad_bytes, wake) +
                     replicas(elems);
      return it->second;
    };
    if (qgz.on)
      r.notes.push_back(fmt::format(
          "ZeRO's gradients in {} blocks by all-to-all (ZeRO++'s qgZ){}", zq,
          !qgz.two_hops ? std::string(", one hop")
          : qgz.least == qgz.k
              ? fmt::format(": within each node's {} data-parallel ranks, then 1/{} of them across nodes", qgz.k, qgz.k)
              : fmt::format(": within each node's part of a group ({} data-parallel ranks, {} in the smallest part), "
                            "then each part's partial sums across nodes",
                            qgz.k, qgz.least)));
    if (cfg.zero == 3) {
      const int lps = lps_first;                                    // (--pp 1: every layer)
      const double gb = gather_element_bytes(cfg.gather_bytes, 2);  // (the parameters are held in 16 bits)
      const double layer_bytes = layer_params / t * gb;
      auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, zg, layer_bytes);
      const double t_ag = ctime(Collective::kAllGather, ag, zg, layer_bytes) + wake, t_rs = zero_rs(layer_params / t);
      // The embeddings (word and position; the output layer shares the word embeddings) are sharded too: gathered
      // before the first layer (nothing to hide behind) and again for the output layer and its backward, prefetched
      // behind the last layer's forward as each layer's is behind the one before; their gradients are whole once the
      // input embedding's backward, the last, has added its part: reduce-scattered after it, with nothing left to hide
      // behind. (Both were hidden behind the output layer's compute, which needs the one and produces the other.)
      const double emb_bytes = emb_gpu * gb;
      auto eag = net.profile(Collective::kAllGather, cfg.dp_algorithm, zg, emb_bytes);
      const double te_ag = ctime(Collective::kAllGather, eag, zg, emb_bytes) + wake, te_rs = zero_rs(emb_gpu);
      // --zero-hpz K (ZeRO++'s hpZ): the backward's gathers (and the output layer's of the embeddings) within groups
      // of K data-parallel ranks (K = the node's, G / t, keeps them on its fabric), of the 16-bit weights the forward
      // kept there.
      double t_agb = t_ag, te_agb = te_ag;
      if (hpz > 1) {
        const Group hg{hpz, static_cast<long long>(t), 0};
        auto hag = net.profile(Collective::kAllGather, cfg.dp_algorithm, hg, layer_params / t * 2);
        auto heg = net.profile(Collective::kAllGather, cfg.dp_algorithm, hg, emb_gpu * 2);
        t_agb = ctime(Collective::kAllGather, hag, hg, layer_params / t * 2) + wake;
        te_agb = ctime(Collective::kAllGather, heg, hg, emb_gpu * 2) + wake;
      }
      // A layer's time in the forward and the backward, which the data-parallel gathers and reduce-scatters hide
      // behind: its compute, its tensor-parallel collectives (on the tensor-parallel group's links) and in the
      // backward its recompute (the windows were the compute alone).
      const double rec_layer = lps > 0 ? mt.recompute / lps : 0.0;
      const double fwd_window = mt.layer_fwd + tp_fwd, bwd_window_layer = mt.layer_bwd + rec_layer + tp_bwd;
      // A micro-batch's gathers and the reduce-scatters it pays (a layer's `rs`, the embeddings' `ers`): its time on
      // the data-parallel links, and what of it the compute does not hide. --no-overlap: no prefetch, every gather
      // and reduce-scatter on the critical path; --zero-prefetch false: every gather on it, the reduce-scatters
      // behind the backward.
      auto micro_batch = [&](double rs, double ers) {
        const double total = lps * (t_ag + t_agb + rs) + te_ag + te_agb + ers;
        const double exposed =
            !cfg.dp_overlap ? total
            : !cfg.zero_prefetch
                ? lps * (t_ag + t_agb) + te_ag + te_agb + ers + lps * std::max(0.0, rs - bwd_window_layer)
                // the first layer's gather in full, each next one behind the layer before (it was
                // counted twice: in full and among the lps prefetched ones)
                : t_ag + te_ag + std::max(0.0, te_agb - fwd_window) + ers +
                      (lps - 1) * std::max(0.0, t_ag - fwd_window) + lps * std::max(0.0, t_agb + rs - bwd_window_layer);
        return std::pair{total, exposed};
      };
      // The last micro-batch reduce-scatters (and across shard groups allreduces) the step's gradients; the earlier
      // ones, with --zero-reduce micro-batch (DeepSpeed's, the default here), reduce-scatter theirs within the group
      // (the allreduce across the groups once a step, as MiCS and `conduit train`), with step (conduit train's
      // default) nothing: their gradients summed in each layer's bucket, held whole.
      const auto [last_total, last_exposed] = micro_batch(t_rs, te_rs);
      const auto [each_total, each_exposed] =
          mb > 1 && z2 == ZeroReduce::kOncePerStep
              ? micro_batch(0.0, 0.0)
              : micro_batch(t_rs - replicas(layer_params / t), te_rs - replicas(emb_gpu));
      dp_total = (mb - 1) * each_total + last_total;
      r.breakdown.zero3_exposed = (mb - 1) * each_exposed + last_exposed;
      r.dp_algorithm = algorithm_name(ag.algorithm);
      r.dp_bottleneck = ag.bottleneck;
      r.notes.push_back(fmt::format(
          "ZeRO-3: every micro-batch allgathers each layer's parameters twice ({} each{}) and the "
          "embeddings twice ({} each{}); their gradients are reduce-scattered {} ({} a layer); {} exposed per "
          "iteration",
          format_seconds(t_ag),
          hpz > 1 ? fmt::format(", {} within the groups of {}", format_seconds(t_agb), hpz) : std::string(),
          format_seconds(te_ag), hpz > 1 ? fmt::format(", {} within the group", format_seconds(te_agb)) : std::string(),
          mb > 1 && z2 == ZeroReduce::kOncePerStep ? "once, summed over the micro-batches (--zero-reduce step)"
                                                   : "every micro-batch",
          format_seconds(t_rs), format_seconds(r.breakdown.zero3_exposed)));
      if (shard > 1) {
        const double across = replicas(layer_params / t);
        const double bytes = layer_params / t / static_cast<double>(shard) * zero_rs_bytes;
        const std::string where = net.profile(Collective::kAllReduce, cfg.dp_algorithm, rg, bytes).bottleneck;
        r.notes.push_back(fmt::format(
            "ZeRO-3 sharded within groups of {} data-parallel ranks, replicated across the {} groups: the gathers "
            "and reduce-scatters within the group, each slice's gradients allreduced across the groups once a step "
            "({} a layer, bottleneck {})",
            shard, d / shard, format_seconds(across), where));
        if (across > t_ag) r.dp_bottleneck = where;  // (the slower of a layer's gather and its replicas' allreduce)
      }
    } else if (cfg.zero >= 1) {
      // (sharded within groups: the stepped slices allgathered within the group, zg, as its reduce-scatter)
      auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, zg, dp_params * 2);
      const double t_ag = ctime(Collective::kAllGather, ag, zg, dp_params * 2) + wake;
      auto rs_time = [&](double n) { return zero_rs(n / cfg.grad_bytes, cfg.bucket_bytes); };
      // Bucket by bucket; without overlap all of them after the backward pass (a window of 0).
      double busy = 0;
      dp_exposed = bucketed_exposed(cfg.dp_overlap ? bwd_window : 0.0, grad_bytes, cfg.bucket_bytes, rs_time, &busy);
      dp_total = busy;
      if (cfg.zero == 2 && mb > 1 && z2 == ZeroReduce::kEveryMicroBatch) {
        // ZeRO-2 keeps only its shard of the gradients, so every micro-batch's gradients are reduce-scattered after
        // its backward (DeepSpeed reduces at each backward); an earlier micro-batch's exchange can also run during
        // the next one's forward. ZeRO-1 keeps whole gradients and reduce-scatters them once per iteration, and so
        // does ZeRO-2 with --zero-reduce step (the buckets sum the micro-batches first). With shard groups the
        // slices' allreduce across the groups goes once, after the last micro-batch (MiCS's accumulation, as
        // `conduit train --zero-reduce micro-batch` runs it): the earlier micro-batches pay the reduce-scatters only.
        double each = busy;
        if (shard > 1)
          bucketed_exposed(
              0.0, grad_bytes, cfg.bucket_bytes, [&](double n) { return rs_time(n) - replicas(n / cfg.grad_bytes); },
              &each);
        const double hidden = cfg.dp_overlap ? bwd_window + dp_micro.fwd_compute + dp_layers * tp_fwd : 0.0;
        dp_exposed += static_cast<double>(mb - 1) * std::max(0.0, each - hidden);
        dp_total += static_cast<double>(mb - 1) * each;
      }
      if (shard > 1)
        r.notes.push_back(fmt::format(
            "ZeRO-{} sharded within groups of {} data-parallel ranks, replicated across the {} groups: the "
            "reduce-scatter and the stepped slices' allgather within the group, each slice's gradients allreduced "
            "across the groups ({} a {} bucket)",
            cfg.zero, shard, d / shard, format_seconds(replicas(cfg.bucket_bytes / cfg.grad_bytes)),
            format_bytes(cfg.bucket_bytes)));
      if (!cfg.zero_prefetch) {
        dp_exposed += t_ag;
        dp_total += t_ag;
      } else {
        // The allgather behind the next forward, as `conduit train --zero 1|2` runs it (--no-overlap, about the
        // gradients, leaves it so there too): the embeddings, then each layer, in forward order, a call per unit and
        // gradient bucket (deferred_allgather_calls: a layer's tensors are its two norms' weights and biases, and
        // the weights and biases of QKV, the projection and the MLP's two matrices), each layer of the first
        // micro-batch waiting only for its own. Each call is timed as an even allgather of its bytes (the runtime's
        // pieces are a unit's share of each rank's slice, uneven where the unit is smaller than a slice), and with
        // interleaved chunks the first stage's layers are played out back to back (their later chunks run later: an
        // over-estimate). (each a rank's share as gpt_layer_parameters_per_rank counts it: all of them over t but the K
        // and V of replicated KV heads, so that they sum to a rank's layer)
        const double qkv = qkv_width_per_rank(m, t), up = m.mlp_up_width() / t, f = m.ffn(), n = h / t;
        // (the exchanging stage's units: the first stage's embeddings, its layers, the last stage's output layer's
        // copy of the word embeddings, none of them computing anything the next one's gather could hide behind)
        const size_t lead = dp_stage == DpStage::kFirst ? 1 : 0;
        std::vector<std::vector<double>> units(lead + static_cast<size_t>(dp_layers),
                                               {n, n, qkv * h, qkv, h * n, n, n, n, up * h, up, f * h / t, n});
        if (lead) units.front() = {V * h / t, s * h};
        if (dp_stage == DpStage::kLast && p > 1) units.push_back({V * h / t});
        const auto calls =
            deferred_allgather_calls(units, cfg.bucket_bytes / cfg.grad_bytes, cfg.zero_allgather_bytes / 2);
        std::vector<double> fwd(units.size(), mt.layer_fwd + tp_fwd);
        if (lead) fwd.front() = 0;  // (the embeddings' lookup)
        if (dp_stage == DpStage::kLast && p > 1) fwd.back() = 0;
        std::map<double, double> took;  // each call size's time
        double busy = 0;
        dp_exposed += deferred_allgather_exposed(
            calls, fwd,
            [&](double elems) {
              auto [it, fresh] = took.emplace(elems, 0.0);
              if (fresh) {
                auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, zg, elems * 2);
                it->second = ctime(Collective::kAllGather, ag, zg, elems * 2) + wake;
              }
              return it->second;
            },
            &busy);
        dp_total += busy;
        r.notes.push_back(fmt::format(
            "ZeRO-{}: the allgather of the stepped parameters goes on behind the next forward in {} call{} ({} "
            "buckets cut the layers){}",
            cfg.zero, calls.size(), calls.size() == 1 ? "" : "s", format_bytes(cfg.bucket_bytes),
            cfg.zero_allgather_bytes > 0 ? fmt::format(", a layer's joining the one before while under {}",
                                                       format_bytes(cfg.zero_allgather_bytes))
                                         : std::string()));
      }
      if (qgz.on) {
        r.dp_algorithm = qgz.two_hops ? "all-to-all, two hops" : "all-to-all";
        const auto [c, a] = all_to_all_as(qgz.outer());
        r.dp_bottleneck = net.profile(c, a, qgz.outer(), cfg.bucket_bytes).bottleneck;
      } else {
        // (within the shard group where there is one; its replicas' allreduce the bottleneck where it outlasts it)
        auto rs = net.profile(Collective::kReduceScatter, cfg.dp_algorithm, zg, cfg.bucket_bytes);
        r.dp_algorithm = algorithm_name(rs.algorithm);
        r.dp_bottleneck = rs.bottleneck;
        if (shard > 1) {
          const double elems = cfg.bucket_bytes / cfg.grad_bytes,
                       bytes = elems / static_cast<double>(shard) * zero_rs_bytes;
          const double across = replicas(elems);
          if (across > ctime(Collective::kReduceScatter, rs, zg, elems * zero_rs_bytes))
            r.dp_bottleneck = net.profile(Collective::kAllReduce, cfg.dp_algorithm, rg, bytes).bottleneck;
        }
      }
    } else {
      const Compression& cp = cfg.compression;
      const double elems = dp_params;
      // Local SGD averages the parameters after the step (the runtime's parameter averaging): nothing to hide behind.
      const bool local = cfg.sync.kind == "local-sgd";
      const double window = cfg.dp_overlap && !local ? bwd_window : 0.0;
      // The runtime runs int8 and top-k tensor by tensor (compress/collectives.cc: a call per tensor of a bucket, the
      // bucket's once it is full): a bucket's share of the tensors, 12 a layer and the embeddings' and final norm's
      // 4, and at least one.
      // (a middle stage's layers only; the last stage's also the output layer's copy and the final norm's 2)
      const double tensors = 12.0 * dp_layers + (dp_stage == DpStage::kFirst ? 4 : dp_stage == DpStage::kLast ? 3 : 0);
      if (cp.kind == "none" || cp.kind == "fp16") {
        // (local SGD averages the f32 parameters: sync/collective.cc)
        double bytes_per = local ? 4 : cp.kind == "none" ? cfg.grad_bytes : 2;
        const double wire = elems * bytes_per;
        // (local SGD: one allreduce of all the parameters)
        const double cap = local ? wire : cfg.bucket_bytes * bytes_per / cfg.grad_bytes;
        auto ar =
            net.profile(Collective::kAllReduce, cfg.dp_algorithm, dg, std::min(wire, local ? wire : cfg.bucket_bytes));
        // Bucket by bucket; without overlap all of them after the backward pass (a window of 0).
        dp_exposed = bucketed_exposed(
            window, wire, cap, [&](double n) { return ctime(Collective::kAllReduce, ar, dg, n) + wake; }, &dp_total);
        if (bytes_per != cfg.grad_bytes && !local)  // (fp16 of 16-bit gradients sends them as they are)
          comp_time = memory_time(acc, elems * (cfg.grad_bytes * 2 + bytes_per * 2), 2);  // cast there and back
        r.dp_algorithm = algorithm_name(ar.algorithm);
        r.dp_bottleneck = ar.bottleneck;
      } else if (cp.kind == "int8") {
        // The runtime's int8 (`conduit train --compressor int8`, compress/quantize.cc): each tensor in blocks of 256
        // elements with an f32 scale each, allgathered (a sum re-quantized at every step of a ring would compound the
        // rounding), every rank decoding and adding the other d - 1 payloads. (Timed as a ring allreduce of 1-byte
        // elements until 2026-12-05: 0.6x the uncompressed exchange of GPT-2 small on 64 ethernet-25g GPUs, where
        // the runtime's is 16x.)
        const double per = 1 + 4.0 / 256, wire = elems * per, cap = cfg.bucket_bytes * per / cfg.grad_bytes;
        const double calls = std::max(1.0, tensors / std::ceil(wire / cap));  // (a bucket's, once it is full)
        auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, dg, std::min(wire, cap) / calls * d);
        auto each = [&](double n) {
          return calls * (ctime(Collective::kAllGather, ag, dg, n / calls * d) + wake) +
                 memory_time(acc, static_cast<double>(d - 1) * (n + 8 * n / per), 1);
        };
        dp_exposed = bucketed_exposed(window, wire, cap, each, &dp_total);
        comp_time = memory_time(acc, elems * (cfg.grad_bytes * 2 + per * 2), 2);  // quantize; error feedback
        r.dp_algorithm = algorithm_name(ag.algorithm);
        r.dp_bottleneck = ag.bottleneck;
      } else if (cp.kind == "topk") {
        // Each tensor's largest D of its elements, as the runtime's compressor runs it (compress/sparse.cc): a u32
        // index and an f32 value each (6 bytes, an fp16 value, until 2026-12-05), allgathered while the backward
        // goes on, every rank adding the others' (it was timed after the whole backward).
        // (every tensor sends one element at least, as the runtime's k = ceil(density x its size): at least the
        // tensors' count over the elements is sent, and a bucket as much of its share; topk:1e-300 was charged for
        // 1e297 buckets)
        const double density = std::max(cp.param, tensors / elems);
        const double per = density * 8, wire = elems * per, cap = cfg.bucket_bytes * per / cfg.grad_bytes;
        const double calls = std::max(1.0, tensors / std::ceil(wire / cap));  // (a bucket's, once it is full)
        auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, dg, std::min(wire, cap) / calls * d);
        auto each = [&](double n) {
          return calls * (ctime(Collective::kAllGather, ag, dg, n / calls * d) + wake) +
                 memory_time(acc, static_cast<double>(d - 1) * n * 2, 1);
        };
        dp_exposed = bucketed_exposed(window, wire, cap, each, &dp_total);
        comp_time = memory_time(acc, elems * cfg.grad_bytes * 3, 4);  // selection, error feedback
        r.dp_algorithm = algorithm_name(ag.algorithm);
        r.dp_bottleneck = ag.bottleneck;
      } else if (cp.kind == "powersgd") {
        const double rank = cp.param;
        // Weight matrices of a layer per GPU: (h x 3h/t), (h/t x h), (h x 4h/t), (4h/t x h); the word embedding
        // (V/t x h) and the position embedding (seq x h). As the runtime (compress/powersgd.cc, min_ratio 2), a
        // matrix whose factors would be over half its size goes raw, and so do the vectors (biases, norms): they
        // were left out, and factors larger than their matrix were charged as factors.
        const std::vector<std::pair<double, double>> mats{
            {h, qkv_width_per_rank(m, t)}, {h / t, h}, {h, m.mlp_up_width() / t}, {m.ffn() / t, h}};
        double factors = 0, gemm = 0, raw = 0, matrix_elems = 0;
        auto add = [&](double rows, double cols, double copies) {
          matrix_elems += copies * rows * cols;
          if (2 * rank * (rows + cols) > rows * cols) {
            raw += copies * rows * cols;
            return;
          }
          factors += copies * rank * (rows + cols);
          gemm += copies * 3 * gemm_time(acc, {rows, rank, cols, 1});  // P = MQ, Q = M^T P, decompress P Q^T
        };
        for (auto [rows, cols] : mats) add(rows, cols, dp_layers);
        if (dp_stage != DpStage::kMiddle) add(V / t, h, 1);
        if (dp_stage == DpStage::kFirst) add(static_cast<double>(m.seq), h, 1);
        raw += std::max(0.0, elems - matrix_elems);  // the vectors
        // Bucket by bucket behind the backward, as the runtime (powersgd_allreduce, per bucket): its matrices' P
        // with its raw tensors in one allreduce, then their Q, in fp16 (P and Q each about half of the factors).
        // (It was timed after the whole backward.)
        const double p_round = factors + 2 * raw, q_round = factors, wire = p_round + q_round;
        const double cap = cfg.bucket_bytes * wire / (elems * cfg.grad_bytes);
        auto ar = net.profile(Collective::kAllReduce, cfg.dp_algorithm, dg, std::min(p_round, cap * p_round / wire));
        auto each = [&](double n) {
          return ctime(Collective::kAllReduce, ar, dg, n * p_round / wire) +
                 ctime(Collective::kAllReduce, ar, dg, n * q_round / wire) + 2 * wake;
        };
        dp_exposed = bucketed_exposed(window, wire, cap, each, &dp_total);
        comp_time = gemm + memory_time(acc, elems * cfg.grad_bytes * 2, 2);
        r.dp_algorithm = algorithm_name(ar.algorithm);
        r.dp_bottleneck = ar.bottleneck;
      }
      dp_exposed += comp_time;
    }
    if (cfg.sync.kind == "local-sgd") {
      dp_total /= cfg.sync.period;
      dp_exposed /= cfg.sync.period;
      comp_time /= cfg.sync.period;
      r.breakdown.zero3_exposed /= cfg.sync.period;
      r.notes.push_back(
          fmt::format("local SGD: parameters averaged once every {} steps, after the step (not hidden behind a "
                      "backward); the exchange is amortized",
                      cfg.sync.period));
    } else if (cfg.sync.kind == "async") {
      dp_exposed = std::max(0.0, dp_total + comp_time - pipe);
      r.notes.push_back("asynchronous: the exchange overlaps the next step's compute (gradients one step stale)");
    }
  }
  // The output layer shares the word embeddings: with pipeline stages the last one holds a copy, and after every
  // backward pass the two copies' gradients are allreduced between the first and the last stage of each replica
  // (Megatron), exposed, whatever the data-parallel scheme. Timed as a shift of those bytes between neighbouring
  // stages (a 2-rank allreduce moves n each way; every stage's pair at once is the pipeline group the model has).
  flag = nullptr;
  double embedding_sync = 0;
  if (p > 1) {
    const Group pg{p, static_cast<long long>(t) * d, 0};
    const double eb = V * h / t * cfg.grad_bytes;
    embedding_sync = ctime(Collective::kShift, net.profile(Collective::kShift, Algorithm::kDirect, pg, eb), pg, eb);
    r.breakdown.embedding_sync = embedding_sync;
  }
  r.breakdown.dp_comm = dp_total;
  r.breakdown.dp_exposed = dp_exposed;
  r.breakdown.compression = std::min(comp_time, dp_exposed);  // (the part exposed: async hides the rest)

  // Optimizer: Adam over this GPU's (sharded) parameters: ~28 bytes of memory traffic per parameter.
  const double opt_params =
      dp_params / (cfg.zero >= 1 ? static_cast<double>(shard > 1 ? shard : d) : 1.0);  // (a shard group's)
  r.breakdown.optimizer = memory_time(acc, opt_params * 28, 4);

  {
    // (dp_total holds ZeRO-3's gathers; dp_exposed the compression compute that is exposed, not communication)
    // (with --balance every kind finishes together, so the kind whose collectives take the largest share of its SMs
    // sets the stretch; otherwise the slowest kind, whose compute the step waits for)
    const double share = kinds > 1 && cfg.balance ? largest_share : comm_share(acc);
    const double waited = dp_exposed - r.breakdown.compression + r.breakdown.zero3_exposed;
    r.breakdown.overlap_slowdown = overlap_slowdown(share, dp_total - waited, r.breakdown.compute, waited);
    if (r.breakdown.overlap_slowdown > 0)
      r.notes.push_back(fmt::format(
          "the {} of data-parallel communication hidden behind compute holds {:.1f}% of the SMs (comm_sms / "
          "sm_count): the compute it overlaps runs that much slower, {} more a step",
          format_seconds(std::min(dp_total - waited, r.breakdown.compute)), 100.0 * share,
          format_seconds(r.breakdown.overlap_slowdown)));
  }
  r.time = pipe + embedding_sync + dp_exposed + r.breakdown.zero3_exposed + r.breakdown.optimizer +
           r.breakdown.overlap_slowdown;

  // Memory per GPU: the larger of the first stage (the input embeddings and the most micro-batches in flight) and
  // the last (the output layer's copy of the word embeddings, the fewest in flight, and the fp32 logits of the loss).
  // In flight, in micro-batches of the stage's layers (Megatron's warm-up counts; chunks of L/(p v) layers when
  // interleaved: p v + p - 1 chunks on the first stage, (v - 1) p + 1 on the last), never more than the m there are.
  const double mbs = static_cast<double>(mb), pv = static_cast<double>(p) * v;
  double first_inflight, last_inflight;
  if (p == 1) {
    first_inflight = last_inflight = 1;
  } else if (cfg.schedule == Schedule::kGpipe) {
    first_inflight = last_inflight = mbs;
  } else if (cfg.schedule == Schedule::k1F1B) {
    first_inflight = std::min<double>(p, mbs);
    last_inflight = 1;
  } else {
    first_inflight = std::min(mbs, (pv + p - 1) / v);
    last_inflight = std::min(mbs, (pv - p + 1) / v);
  }
  const bool flash = scores_on_chip(cfg.attention);
  const double layer_act = gpt_layer_activation_bytes(m, b, t, cfg.sequence_parallel, cfg.recompute, flash);
  // The layer being recomputed holds its full activations, of which what it stored is counted already (selective
  // recompute stores all but the attention core: counting its whole layer again overcounted 34 sbh/t).
  const double recomputing =
      cfg.recompute != Recompute::kNone
          ? gpt_layer_activation_bytes(m, b, t, cfg.sequence_parallel, Recompute::kNone, flash) - layer_act
          : 0.0;
  // The loss's fp32 logits stay until that micro-batch's backward: GPipe runs every forward first, so the last
  // stage holds all m of them (it counted one); 1F1B and interleaving take each backward soon after.
  const double loss_copies = p > 1 && cfg.schedule == Schedule::kGpipe ? mbs : 1.0;
  // ZeRO-3 also holds what it gathers: the layer it runs and, prefetched, the next (one without overlap or prefetch),
  // the embeddings it gathers for the first and the output layer, and one layer's full gradients before their
  // reduce-scatter (the sharded state alone left out about a third of GPT-1T's memory at t = 8), and the embeddings'
  // full gradients, whole from the output layer's backward until the input embedding's, the last (their
  // reduce-scatter's timing, above).
  const bool zero3 = cfg.zero == 3 && d > 1;
  const double gathered =
      zero3 ? ((cfg.dp_overlap && cfg.zero_prefetch ? 2 : 1) * layer_params / t + emb_gpu) * 2 : 0.0;
  const double unsharded_grads = zero3 ? (layer_params / t + emb_gpu) * cfg.grad_bytes : 0.0;
  auto stage_memory = [&](double params, double inflight, bool loss, int layers) {
    // (sharded within groups: over the group's ranks only)
    const ModelState st = zero_model_state(params, shard > 1 ? shard : d, cfg.zero, cfg.grad_bytes);
    MemoryBreakdown mem;
    // (hpZ: the secondary partition, 1/K of the stage's 16-bit parameters)
    mem.params = st.params + gathered + (zero3 && hpz > 1 ? params * 2 / static_cast<double>(hpz) : 0.0);
    // (ZeRO-2 or 3 reducing once a step: the buckets hold the stage's whole gradients from the first micro-batch on)
    const bool whole = cfg.zero >= 2 && mbs > 1 && z2 == ZeroReduce::kOncePerStep;
    mem.grads = whole ? params * cfg.grad_bytes : st.grads + unsharded_grads;
    mem.optimizer = st.optimizer;
    mem.activations = layer_act * layers * inflight + recomputing + (loss ? 4 * b * s * V / t * loss_copies : 0.0);
    return mem;
  };
  r.memory = stage_memory(params_gpu, first_inflight, p == 1, lps_first);
  if (p > 1) {
    const MemoryBreakdown last = stage_memory((lps_last * layer_params + V * h) / t, last_inflight, true, lps_last);
    const MemoryBreakdown first_memory = r.memory;
    // An uneven split's second stage: a middle stage's layers with one micro-batch fewer in flight than the first
    // (1F1B; GPipe all m), which holds the most where the middle stages have more layers (BLOOM's 6 to the ends' 5).
    // With an even split it never does: the first holds as many layers, the embeddings and more in flight.
    const double second_inflight = cfg.schedule == Schedule::kGpipe ? mbs : std::min<double>(p - 1, mbs);
    const MemoryBreakdown second = split.uneven && p > 2
                                       ? stage_memory(lps_mid * layer_params / t, second_inflight, false, lps_mid)
                                       : MemoryBreakdown{};
    if (second.total() > std::max(first_memory.total(), last.total())) {
      r.memory = second;
      r.notes.push_back(fmt::format(
          "memory: the second pipeline stage holds the most ({} for {} layers and {:g} micro-batches in flight, "
          "against {} on the first and {} on the last)",
          format_gb(second.total()), lps_mid, second_inflight, format_gb(first_memory.total()),
          format_gb(last.total())));
    } else if (last.total() > first_memory.total()) {
      r.memory = last;
      r.notes.push_back(fmt::format(
          "memory: the last pipeline stage holds the most ({} with the fp32 logits of the loss, against {} on the "
          "first)",
          format_gb(last.total()), format_gb(first_memory.total())));
    }
  }
  if (p > 1 && cfg.schedule != Schedule::kInterleaved) {
    const double second_inflight = cfg.schedule == Schedule::kGpipe ? mbs : std::min<double>(p - 1, mbs);
    auto first_of = [&](int l) {
      return stage_memory(l * layer_params / t + emb_gpu, first_inflight, false, l).total();
    };
    auto second_of = [&](int l) { return stage_memory(l * layer_params / t, second_inflight, false, l).total(); };
    auto last_of = [&](int l) { return stage_memory((l * layer_params + V * h) / t, last_inflight, true, l).total(); };
    StageMemory& sm = r.stage_memory;
    sm.first = first_of(lps_first);
    sm.first_layer = first_of(lps_first + 1) - sm.first;
    if (p > 2) {
      sm.second = second_of(lps_mid);
      sm.second_layer = second_of(lps_mid + 1) - sm.second;
    }
    sm.last = last_of(lps_last);
    sm.last_layer = last_of(lps_last + 1) - sm.last;
  }
  r.memory_capacity = mem_capacity;
  r.fits = r.memory.total() <= mem_capacity;
  if (!r.fits)
    r.notes.push_back(
        fmt::format("does not fit: {} per GPU > {} capacity", format_gb(r.memory.total()), format_gb(mem_capacity)));

  r.model_flops = gpt_iteration_flops(m, static_cast<double>(cfg.global_batch), Recompute::kNone);
  r.hardware_flops = gpt_iteration_flops(m, static_cast<double>(cfg.global_batch), cfg.recompute);
  r.model_tflops_per_gpu = r.model_flops / r.time / gpus / 1e12;
  r.hardware_tflops_per_gpu = r.hardware_flops / r.time / gpus / 1e12;
  r.mfu = r.model_flops / r.time / gpus / mean_peak_flops(topo);

  if (split.uneven)
    r.notes.push_back(fmt::format(
        "uneven pipeline split: {} layers on the first stage, {}{} on the last (forward and backward a micro-batch: "
        "{} first, {}{} last)",
        lps_first, p > 2 ? fmt::format("{} on each of the {} middle ones, ", lps_mid, p - 2) : std::string(), lps_last,
        format_seconds(r.breakdown.stage_first),
        p > 2 ? fmt::format("{} middle, ", format_seconds(r.breakdown.stage_middle)) : std::string(),
        format_seconds(r.breakdown.stage_last)));
  if (p > 1)
    r.notes.push_back(fmt::format(
        "pipeline bubble {:.1f}% of the slowest stage's m micro-batches ((p-1)/(v m) = {:.1f}% were the stages "
        "equal; {}) with p={}, v={}, m={}",
        100 * r.breakdown.bubble / (static_cast<double>(mb) * slot), 100 * pipeline_bubble_fraction(p, mb, v),
        slowest_stage == &last    ? "the last runs the output layer"
        : slowest_stage == &first ? "the slowest is the first"
                                  : "the slowest is a middle one",
        p, v, mb));
  if (d > 1 && cfg.zero != 3)
    r.notes.push_back(fmt::format("data-parallel exchange {} ({}, bottleneck {}), {} exposed{}",
                                  format_seconds(dp_total), r.dp_algorithm, r.dp_bottleneck, format_seconds(dp_exposed),
                                  wake_note(wake)));
  if (t > 1)
    r.notes.push_back(fmt::format("tensor-parallel collectives {} per iteration ({}), not overlapped",
                                  format_seconds(r.breakdown.tp_comm), r.tp_algorithm));
  check_finite(r);
  return r;
}

// Elements a sample of a layer's output.
double output_elements(const Layer& l) {
  if (l.kind == "pool") return l.in * std::floor(l.height / l.kernel) * std::floor(l.width / l.kernel);
  const GemmShape g = l.forward_gemm(1);
  return g.m * g.n;
}

// A layer-list model cut into cfg.pp pipeline stages, as `conduit train --pp` cuts the mlp and cnn (docs/sim.md §5):
// between units, the cut whose largest stage has the fewest forward multiply-adds a sample (partition_units). Each
// stage's forward and backward of a micro-batch are its layers' kernels (pf, pb: each layer's at the micro-batch)
// with the framework's time shared out in proportion; the schedule (GPipe or 1F1B) is played out micro-batch by
// micro-batch, a forward waiting for the activations of the stage before (a point-to-point transfer of the
// boundary's output), a backward for the gradient from the stage after; each stage's data-parallel exchange among its
// d replicas overlaps its last backward.
StepResult layer_pipeline(CollectiveModel& net, const LayerModel& m, const ParallelConfig& cfg, StepResult r,
                          const Accelerator& acc, const ModelStepSample* measured,
                          const std::vector<size_t>& unit_first, const std::vector<double>& pf,
                          const std::vector<double>& pb, double scale, double cap, long long mb, double wake) {
  const int p = cfg.pp;
  const long long gpus = r.gpus, d = gpus / p;
  const double b = cfg.micro_batch, eb = cfg.grad_bytes;
  const size_t units = unit_first.size();
  auto unit_end = [&](size_t u) { return u + 1 < units ? unit_first[u + 1] : m.layers.size(); };
  std::vector<double> macs(units, 0.0);
  for (size_t u = 0; u < units; ++u)
    for (size_t li = unit_first[u]; li < unit_end(u); ++li)
      if (m.layers[li].kind != "pool") macs[u] += m.layers[li].forward_gemm(1).flops() / 2;
  const std::vector<int> bounds = partition_units(macs, p);
  // Each stage's layers as they run in the step: their kernels times `scale` (the measured ratio plus the framework's
  // share, simulate_layer_step).
  std::vector<double> F(size_t(p), 0.0), B(size_t(p), 0.0), params(size_t(p), 0.0), act(size_t(p), 0.0),
      out(size_t(p), 0.0), tensors(size_t(p), 0.0);
  for (int s = 0; s < p; ++s)
    for (size_t u = size_t(bounds[size_t(s)]); u < size_t(bounds[size_t(s) + 1]); ++u)
      for (size_t li = unit_first[u]; li < unit_end(u); ++li) {
        const Layer& l = m.layers[li];
        F[size_t(s)] += pf[li] * scale;
        B[size_t(s)] += pb[li] * scale;
        params[size_t(s)] += l.params();
        if (l.params() > 0) tensors[size_t(s)] += 2;  // (weight and bias)
        const GemmShape g = l.forward_gemm(b);
        act[size_t(s)] += 2 * g.m * g.n * eb;  // (as the data-parallel model counts them)
        out[size_t(s)] = output_elements(l);
      }
  // Each boundary's transfer, forward (the activations) and backward (their gradient): the pipeline's ranks are
  // consecutive (rank = replica x p + stage).
  // (The pipeline's shift as one collective: every boundary is charged its slowest pair, e.g. the one crossing nodes;
  // a pair timed as a group of its own would be tiled over the cluster in pairs that are not the pipelines'.)
  const Group pg{p, 1, 0};
  std::vector<double> link(size_t(p), 0.0);  // link[s]: between stages s and s + 1
  for (int s = 0; s + 1 < p; ++s) {
    const double msg = b * out[size_t(s)] * eb;
    auto prof = net.profile(Collective::kShift, Algorithm::kDirect, pg, msg);
    link[size_t(s)] =
        (cfg.mode == EvalMode::kFull ? net.time_full(Collective::kShift, prof.algorithm, pg, msg) : prof.time(msg)) +
        wake;
  }
  // The schedule, played out: each stage runs its operations in order, each once its input has arrived.
  const size_t M = size_t(mb), P = size_t(p);
  std::vector<std::vector<std::pair<bool, size_t>>> ops(P);  // (backward, micro-batch)
  for (size_t s = 0; s < P; ++s) {
    if (cfg.schedule == Schedule::kGpipe) {
      for (size_t k = 0; k < M; ++k) ops[s].push_back({false, k});
      for (size_t k = 0; k < M; ++k) ops[s].push_back({true, k});
    } else {  // 1F1B: min(p - s - 1, m) forwards, then one forward and one backward in turn, then the backwards
      const size_t warm = std::min(P - s - 1, M);
      for (size_t k = 0; k < warm; ++k) ops[s].push_back({false, k});
      for (size_t k = 0; k < M - warm; ++k) {
        ops[s].push_back({false, warm + k});
        ops[s].push_back({true, k});
      }
      for (size_t k = M - warm; k < M; ++k) ops[s].push_back({true, k});
    }
  }
  const double unknown = -1;
  std::vector<std::vector<double>> fdone(P, std::vector<double>(M, unknown)), bdone = fdone;
  std::vector<size_t> next(P, 0);
  std::vector<double> free_at(P, 0.0);
  for (size_t left = 2 * M * P; left > 0;) {
    bool moved = false;
    for (size_t s = 0; s < P; ++s)
      while (next[s] < ops[s].size()) {
        const auto [back, k] = ops[s][next[s]];
        double ready = 0;
        if (!back && s > 0) {
          if (fdone[s - 1][k] == unknown) break;
          ready = fdone[s - 1][k] + link[s - 1];
        } else if (back && s + 1 < P) {
          if (bdone[s + 1][k] == unknown) break;
          ready = bdone[s + 1][k] + link[s];
        }
        const double end = std::max(free_at[s], ready) + (back ? B[s] : F[s]);
        (back ? bdone : fdone)[s][k] = end;
        free_at[s] = end;
        ++next[s];
        --left;
        moved = true;
      }
    if (!moved) throw std::logic_error("layer_pipeline: the schedule deadlocked");
  }
  const double makespan = *std::max_element(free_at.begin(), free_at.end());
  size_t busiest = 0;
  for (size_t s = 1; s < P; ++s)
    if (F[s] + B[s] > F[busiest] + B[busiest]) busiest = s;
  r.breakdown.compute = static_cast<double>(mb) * (F[busiest] + B[busiest]);
  r.breakdown.framework = scale > 0 ? r.breakdown.compute * (scale - 1) / scale : 0;
  r.breakdown.pp_comm = static_cast<double>(mb) * 2 * (link[busiest] + (busiest > 0 ? link[busiest - 1] : 0));
  r.breakdown.bubble = makespan - r.breakdown.compute;
  // Each stage's gradients among its d replicas, bucketed behind its last backward, then its optimizer step (the
  // measured step's share by parameters): a stage that finishes its backwards early (every stage but the first) steps
  // while the first still works. The step ends when the last stage's optimizer does.
  const double total_params = m.params();
  auto optimizer_of = [&](double n) {
    return measured && measured->optimizer > 0 && total_params > 0 ? measured->optimizer * n / total_params
                                                                   : memory_time(acc, n * 28, 4);
  };
  double dp_end = makespan, end = 0, dp_total = 0, comp = 0;
  std::vector<double> exposed_s(P, 0.0), stretch(P, 0.0);
  if (d > 1) {
    const std::string& k = cfg.compression.kind;
    // (int8: the runtime's blocks of 256 with an f32 scale, allgathered and decoded by every rank, as the GPT path)
    const bool gathered = k == "int8";
    const double per = k == "none" ? cfg.grad_bytes : k == "fp16" ? 2 : 1 + 4.0 / 256;
    const Collective coll = gathered ? Collective::kAllGather : Collective::kAllReduce;
    const double spread = gathered ? static_cast<double>(d) : 1.0;  // (an allgather's size: every rank's part)
    for (size_t s = 0; s < P; ++s) {
      const Group dg{d, p, static_cast<long long>(s)};  // stage s of every replica
      const double wire = params[s] * per;
      // (int8 a call per tensor of a bucket, as the runtime's compressed_allreduce_many)
      const double cap = cfg.bucket_bytes * per / cfg.grad_bytes;
      const double calls = gathered ? std::max(1.0, tensors[s] / std::ceil(wire / cap)) : 1.0;
      auto prof = net.profile(coll, cfg.dp_algorithm, dg,
                              gathered ? std::min(wire, cap) / calls * spread : std::min(wire, cfg.bucket_bytes));
      auto tof = [&](double n) {
        return calls * ((cfg.mode == EvalMode::kFull ? net.time_full(coll, prof.algorithm, dg, n / calls * spread)
                                                     : prof.time(n / calls * spread)) +
                        wake) +
               memory_time(acc, 8 * n / per, 1) + (gathered ? memory_time(acc, (d - 1) * (n + 8 * n / per), 1) : 0);
      };
      double total = 0;
      const double window = cfg.dp_overlap ? B[s] : 0.0;
      const double exposed = bucketed_exposed(window, wire, cap, tof, &total);
      // (the stage's last backward runs beside its buckets' collectives: stretched as in a step of one stage)
      stretch[s] = overlap_slowdown(comm_share(acc), total - exposed, window, exposed);
      // (quantize, or cast, before sending; error feedback)
      const double c = per != cfg.grad_bytes ? memory_time(acc, params[s] * (cfg.grad_bytes * 2 + per * 2), 2) : 0;
      exposed_s[s] = exposed + c;
      if (s == 0) {
        r.dp_algorithm = algorithm_name(prof.algorithm);
        r.dp_bottleneck = prof.bottleneck;
      }
      dp_total = std::max(dp_total, total);
      comp = std::max(comp, c);
    }
  }
  double stretched_end = 0;
  for (size_t s = 0; s < P; ++s) {
    dp_end = std::max(dp_end, free_at[s] + exposed_s[s]);
    end = std::max(end, free_at[s] + exposed_s[s] + optimizer_of(params[s]));
    stretched_end = std::max(stretched_end, free_at[s] + exposed_s[s] + stretch[s] + optimizer_of(params[s]));
  }
  r.breakdown.overlap_slowdown = stretched_end - end;
  // The wait for the slowest rank, measured at a barrier among as many ranks (the stages meet every micro-batch).
  if (measured)
    r.breakdown.rank_wait =
        measured->wait_ranks == static_cast<double>(gpus)
            ? measured->slowest_wait
            : measured->quantile(std::pow(0.5, 1.0 / static_cast<double>(gpus))) - measured->median();
  r.breakdown.dp_comm = dp_total;
  r.breakdown.dp_exposed = dp_end - makespan + r.breakdown.rank_wait;
  r.breakdown.compression = std::min(comp, dp_end - makespan);  // (a stage done early hides some)
  r.breakdown.optimizer = end - dp_end;                         // (past the last exchange)
  r.time = makespan + r.breakdown.dp_exposed + r.breakdown.optimizer + r.breakdown.overlap_slowdown;
  // Memory: the fullest stage's parameters, gradients and optimizer state, and the activations of the micro-batches it
  // holds at once (GPipe all of them, 1F1B at most p - s).
  for (size_t s = 0; s < P; ++s) {
    ModelState st = zero_model_state(params[s], 1, 0, cfg.grad_bytes);
    if (eb == 4) {
      st.params = 4 * params[s];
      st.optimizer = 8 * params[s];
    }
    const double held =
        cfg.schedule == Schedule::kGpipe ? static_cast<double>(mb) : static_cast<double>(std::min<size_t>(P - s, M));
    MemoryBreakdown mem{st.params, st.grads, st.optimizer, act[s] * held};
    if (s == 0 || mem.total() > r.memory.total()) r.memory = mem;
  }
  r.memory_capacity = cap;
  r.fits = r.memory.total() <= cap;
  const double flops = layer_model_flops(m);
  r.model_flops = r.hardware_flops = flops * static_cast<double>(cfg.global_batch);
  r.model_tflops_per_gpu = r.hardware_tflops_per_gpu = r.model_flops / r.time / static_cast<double>(gpus) / 1e12;
  r.mfu = r.model_flops / r.time / static_cast<double>(gpus) / mean_peak_flops(net.topology());
  std::string cut, times;
  for (int s = 0; s < p; ++s) {
    cut += fmt::format("{}{}", s ? " | " : "", bounds[size_t(s)]);
    times += fmt::format("{}{}+{}", s ? ", " : "", format_seconds(F[size_t(s)]), format_seconds(B[size_t(s)]));
  }
  r.notes.push_back(fmt::format(
      "pipeline: {} stages from units {} (of {}; each layer with parameters, a pooling layer with the one before it, "
      "cut by forward multiply-adds as conduit train cuts), {} micro-batches {}, forward+backward a micro-batch {}; "
      "bubble {} (the busiest stage idle: fill, drain and transfers)",
      p, cut, units, mb, cfg.schedule == Schedule::kGpipe ? "gpipe" : "1f1b", times,
      format_seconds(r.breakdown.bubble)));
  if (d > 1)
    r.notes.push_back(
        fmt::format("data-parallel exchange of each stage among {} replicas, the longest {} ({}), {} "
                    "past the pipeline{}",
                    d, format_seconds(dp_total), r.dp_algorithm,
                    format_seconds(r.breakdown.dp_exposed - r.breakdown.rank_wait), wake_note(wake)));
  check_finite(r);
  return r;
}

}  // namespace

namespace {

StepResult layer_step(CollectiveModel& net, const LayerModel& m, const ParallelConfig& cfg) {
  const Topology& topo = net.topology();
  const long long gpus = topo.gpus();
  if (cfg.tp != 1) throw ConfigError("--tp must be 1 for a layer-list model (data and pipeline parallel only)");
  if (cfg.micro_batch < 1) throw ConfigError(fmt::format("--micro-batch = {} must be at least 1", cfg.micro_batch));
  const int p = cfg.pp;
  if (p < 1 || gpus % p != 0)
    throw ConfigError(fmt::format("--pp ({}) must divide --gpus ({}) for a layer-list model", p, gpus));
  // (each named: one line listed four flags, whichever was given)
  const std::string kernels = fmt::format("--attention-kernels {}", attention_kernels_name(cfg.attention));
  const char* gpt_only = cfg.recompute != Recompute::kNone           ? "--recompute"
                         : cfg.sequence_parallel                     ? "--sp"
                         : cfg.virtual_stages != 1                   ? "--virtual-stages"
                         : cfg.balance                               ? "--balance"
                         : cfg.attention != AttentionKernels::kFused ? kernels.c_str()
                         : cfg.first_stage_layers >= 0               ? "--first-stage-layers"
                         : cfg.last_stage_layers >= 0                ? "--last-stage-layers"
                                                                     : nullptr;
  if (gpt_only)
    throw ConfigError(fmt::format("{} applies to GPT models; allowed with a layer-list model: leave it out", gpt_only));
  if (cfg.schedule == Schedule::kInterleaved || (p == 1 && cfg.schedule != Schedule::k1F1B))
    throw ConfigError(fmt::format(
        "--schedule {}: a layer-list model takes --schedule gpipe or 1f1b with --pp above 1 (one stage has no "
        "schedule: leave it out)",
        cfg.schedule == Schedule::kInterleaved ? "interleaved" : "gpipe"));
  // The units `conduit train` runs (torch/models.h): each layer with parameters, a pooling layer in the unit before
  // it; a pipeline cuts between them, ZeRO-3 gathers each.
  std::vector<size_t> unit_first, unit_of(m.layers.size());  // each unit's first layer; each layer's unit
  for (size_t li = 0; li < m.layers.size(); ++li) {
    if (m.layers[li].params() > 0 || unit_first.empty()) unit_first.push_back(li);
    unit_of[li] = unit_first.size() - 1;
  }
  if (p > 1) {
    if (static_cast<size_t>(p) > unit_first.size())
      throw ConfigError(
          fmt::format("--pp ({}) exceeds the layer model's {} units (each layer with parameters, a "
                      "pooling layer with the one before it)",
                      p, unit_first.size()));
    if (cfg.zero != 0) throw ConfigError("--zero with --pp is not modelled for a layer-list model: use --zero 0");
    if (cfg.sync.kind != "bsp") throw ConfigError("--pp needs --sync bsp for a layer-list model");
  }
  const long long d = gpus / p;  // data-parallel replicas of the pipeline
  if (cfg.global_batch % (static_cast<long long>(cfg.micro_batch) * d) != 0)
    throw ConfigError(
        fmt::format("--global-batch ({}) must be a multiple of --micro-batch ({}) x the data-parallel "
                    "ranks ({}: --gpus / --pp)",
                    cfg.global_batch, cfg.micro_batch, d));
  if (cfg.dp != 0 && cfg.dp != d)
    throw ConfigError(fmt::format("--dp ({}) must equal --gpus / --pp ({}) for a layer-list model", cfg.dp, d));
  if (cfg.zero < 0 || cfg.zero > 3)
    throw ConfigError(fmt::format("--zero = {} (allowed for layer models: 0, 1, 2, 3)", cfg.zero));
  if (cfg.sync.kind == "async" && cfg.zero == 3)
    throw ConfigError(
        "--sync async with --zero 3 is not modelled: ZeRO-3 gathers every layer's parameters inside the step; use "
        "--zero 0, 1 or 2");
  if (cfg.sync.kind == "local-sgd" && cfg.zero > 0)
    throw ConfigError("--sync local-sgd needs full model replicas: use --zero 0");
  check_local_sgd_compression(cfg.sync, cfg.compression);
  if (cfg.grad_bytes != 2 && cfg.grad_bytes != 4)
    throw ConfigError(fmt::format("--grad-bytes = {} (allowed: 2, 4)", cfg.grad_bytes));
  if (cfg.compression.kind != "none" && cfg.compression.kind != "fp16" && cfg.compression.kind != "int8" &&
      cfg.compression.kind != "int4")
    throw ConfigError("--compression for layer models: none, fp16, int8 or int4");
  if (cfg.compression.kind == "int4" && cfg.zero == 0)
    throw ConfigError(
        "--compression int4 is ZeRO's reduce-scatter wire (qgZ, --zero 1, 2 or 3); allowed for layer models with "
        "--zero 0: none, fp16, int8");
  check_data_parallel_flags(cfg, d);
  StepResult r;
  r.config = cfg;
  r.config.dp = d;
  r.gpus = gpus;
  const long long mb = cfg.global_batch / (static_cast<long long>(cfg.micro_batch) * d);
  // (a pipeline's schedule is played out micro-batch by micro-batch on every stage, its operations held in memory)
  constexpr long long kMaxPipelineOps = 10000000;
  if (p > 1 && mb > kMaxPipelineOps / p)
    throw ConfigError(fmt::format(
        "--global-batch ({}) makes {} micro-batches a step on each of the {} stages of the layer-list pipeline "
        "(--global-batch / (--micro-batch x --gpus / --pp)); allowed: micro-batches x --pp up to {} (the schedule is "
        "played out micro-batch by micro-batch)",
        cfg.global_batch, mb, p, kMaxPipelineOps));
  r.microbatches = mb;
  const ZeroReduce z2 = zero_reduce_mode(cfg, mb, ZeroReduce::kOncePerStep);
  r.config.zero_reduce = z2;
  const double b = cfg.micro_batch;
  // Activations are held in the precision the gradients are exchanged in: 2 bytes (mixed precision) or 4 (f32,
  // as `conduit train` runs on CPUs).
  const double eb = cfg.grad_bytes;
  const Accelerator* slow = nullptr;
  const ModelStepSample* measured = nullptr;
  double fwd = 0, bwd = 0, cap = 1e300, framework = 0, kernels_measured = 0;
  // The layers' forward and backward kernels at `b` samples on `acc` (with `per_layer`: each layer's backward too;
  // with `per_layer_fwd`, its forward).
  auto layer_times = [&](const Accelerator& acc, double b, double& f, double& bw,
                         std::vector<double>* per_layer = nullptr, std::vector<double>* per_layer_fwd = nullptr) {
    f = bw = 0;
    if (per_layer) per_layer->clear();
    if (per_layer_fwd) per_layer_fwd->clear();
    for (size_t li = 0; li < m.layers.size(); ++li) {
      if (per_layer) per_layer->push_back(-bw);
      if (per_layer_fwd) per_layer_fwd->push_back(-f);
      const Layer& l = m.layers[li];
      GemmShape g = l.forward_gemm(b);
      // Convolutions through conv_time (measured convolutions when the cluster has them, else the implicit GEMM).
      // The first layer computes no input gradient: its input is the data, which needs none.
      if (l.kind == "pool") {  // max pooling: no GEMM, no activation function of its own
        f += pool_time(acc, l.pool_shape(b), false, eb);
        bw += pool_time(acc, l.pool_shape(b), true, eb);
        if (per_layer) per_layer->back() += bw;
        if (per_layer_fwd) per_layer_fwd->back() += f;
        continue;
      }
      if (l.kind == "conv") {
        const ConvShape c = l.conv_shape(b);
        f += conv_time(acc, c, ConvPass::kForward);
        bw += (li > 0 ? conv_time(acc, c, ConvPass::kInputGrad) : 0) + conv_time(acc, c, ConvPass::kWeightGrad);
      } else {
        f += gemm_time(acc, g);
        bw += (li > 0 ? gemm_time(acc, dgrad(g)) : 0) + gemm_time(acc, wgrad(g));
      }
      f += memory_time(acc, 2 * eb * g.m * g.n, 1);   // activation function: read + write
      bw += memory_time(acc, 3 * eb * g.m * g.n, 1);  // its gradient
      if (per_layer) per_layer->back() += bw;
      if (per_layer_fwd) per_layer_fwd->back() += f;
    }
  };
  for (size_t i = 0; i < topo.kind_counts().size(); ++i) {
    if (topo.kind_counts()[i] == 0) continue;
    const Accelerator& acc = topo.spec().node_kinds[i].accelerator;
    double f = 0, bw = 0;
    layer_times(acc, b, f, bw);
    // A measured step of these very layers: the framework's time beyond its kernels (the measured median step minus
    // the layers modelled at the measured batch) is added per micro-batch, at any micro-batch size.
    const ModelStepSample* ms = find_model_step(acc, m);
    double over = 0, fc = 0, bc = 0;
    if (ms) {
      layer_times(acc, ms->batch, fc, bc);
      over = ms->median() - (fc + bc);
    }
    if (!slow || f + bw + over > fwd + bwd + framework) {
      fwd = f;
      bwd = bw;
      framework = over;
      kernels_measured = fc + bc;
      measured = ms;
      slow = &acc;
    }
    cap = std::min(cap, acc.memory_bytes);
  }
  const double params = m.params();
  // The measured step's difference from its kernels, at a micro-batch other than the measured batch: time beyond the
  // kernels (dispatch, autograd) comes once per micro-batch; kernels faster inside the model than timed alone (a
  // negative difference) are faster by that ratio at any size (subtracting the difference per micro-batch took twice
  // the measured saving from two micro-batches of half the batch, whose kernels take about half the time).
  const double ratio =
      framework < 0 && kernels_measured > 0 ? std::max(0.0, kernels_measured + framework) / kernels_measured : 1;
  framework = std::max(framework, 0.0);
  r.breakdown.compute = mb * ((fwd + bwd) * ratio + framework);
  r.breakdown.framework = r.breakdown.compute - mb * (fwd + bwd);
  // The layers as they run in the step, for a pipeline's stages and the windows communication hides behind: kernels
  // at the ratio, plus the framework's time in proportion to them.
  const double run_scale = ratio + (fwd + bwd > 0 ? framework / (fwd + bwd) : 0.0);
  const double wake = topo.spec().network.wake_latency;
  // ZeRO sharded within groups of K consecutive ranks (--zero-shard-group; `conduit train --zero-shard-group`): the
  // reduce-scatters and allgathers (ZeRO-3's gathers) within the group, each slice's gradients then allreduced across
  // the groups (on the reduce-scatter's 16-bit wire with fp16, else in the gradients' own bytes); state sharded K ways.
  // (with pipelines ZeRO is refused above: none)
  const long long shard = zero_group_size(cfg.zero, 1, cfg.zero_shard, gpus, topo.gpus_per_node(), 1,
                                          "--zero-shard-group", "shard groups", "sharded over all", r.notes);
  r.config.zero_shard = shard;
  // (the ranks ZeRO cuts the state over: the group's, or all; 1 without ZeRO)
  const long long sharded_over = cfg.zero >= 1 ? (shard > 1 ? shard : gpus) : 1;
  // ZeRO-3's secondary partition (--zero-hpz; `conduit train --zero-hpz`): each unit's backward gather within groups
  // of K ranks, of the part of the weights its forward kept (in the forward's 16-bit wire, else in f32).
  const long long hpz = zero_group_size(cfg.zero, 3, cfg.zero_hpz, gpus, topo.gpus_per_node(), 1, "--zero-hpz",
                                        "secondary partition", "none used", r.notes);
  if (hpz > 1 && shard > 1)
    throw ConfigError(
        "--zero-shard-group with --zero-hpz: the gathers run within the shard group already; allowed: one of them");
  r.config.zero_hpz = hpz;
  const double kept_bytes = gather_element_bytes(cfg.gather_bytes, cfg.grad_bytes) == 2 ? 2.0 : 4.0;
  if (p > 1) {
    std::vector<double> pf, pb;
    double f0 = 0, b0 = 0;
    layer_times(*slow, b, f0, b0, &pb, &pf);
    return layer_pipeline(net, m, cfg, std::move(r), *slow, measured, unit_first, pf, pb, run_scale, cap, mb, wake);
  }
  double dp_total = 0, dp_exposed = 0, comp = 0;
  if (shard > 1)
    r.notes.push_back(fmt::format(
        "ZeRO-{} sharded within groups of {} ranks, replicated across the {} groups: the reduce-scatters and "
        "allgathers within the group, each slice's gradients allreduced across the groups",
        cfg.zero, shard, gpus / shard));
  if (gpus > 1) {
    const Group dg{gpus, 1, 0};
    const Group zg = shard > 1 ? Group{shard, 1, 0} : dg, rg{shard > 1 ? gpus / shard : 1, std::max(shard, 1LL), 0};
    const std::string& k = cfg.compression.kind;
    // (f32 after int blocks, as the runtime's: no allreduce re-encodes them)
    const double replica_bytes = k == "fp16" ? 2.0 : k == "int8" || k == "int4" ? 4.0 : cfg.grad_bytes;
    auto replicas = [&](double elems) {
      if (shard <= 1) return 0.0;
      const double bytes = elems / static_cast<double>(shard) * replica_bytes;
      auto ar = net.profile(Collective::kAllReduce, cfg.dp_algorithm, rg, bytes);
      return (cfg.mode == EvalMode::kFull ? net.time_full(Collective::kAllReduce, ar.algorithm, rg, bytes)
                                          : ar.time(bytes)) +
             wake;
    };
    // ZeRO with int8 or int4: blocks by all-to-all (Qgz; `conduit train --zero N --compressor int8`), in two hops
    // where a node holds several ranks.
    const Qgz qgz(cfg, zg, topo.gpus_per_node());
    // (int8 without ZeRO: the runtime's blocks of 256 with an f32 scale, allgathered and decoded by every rank)
    const bool gathered = !qgz.on && k == "int8";
    // (local SGD averages the f32 parameters after the step: sync/collective.cc)
    const bool local = cfg.sync.kind == "local-sgd";
    const double per = qgz.on ? qgz.wire : local ? 4.0 : k == "none" ? cfg.grad_bytes : k == "fp16" ? 2 : 1 + 4.0 / 256;
    const double wire = params * per;
    const Collective coll = cfg.zero >= 1 ? Collective::kReduceScatter
                            : gathered    ? Collective::kAllGather
                                          : Collective::kAllReduce;
    const double spread = gathered ? static_cast<double>(zg.size) : 1.0;  // (an allgather's size: every rank's part)
    // (int8 a call per tensor of a bucket, weight and bias of each layer with parameters, as the runtime's)
    const double tensors = 2.0 * static_cast<double>(std::count_if(m.layers.begin(), m.layers.end(),
                                                                   [](const Layer& l) { return l.params() > 0; }));
    const double cap = local ? wire : cfg.bucket_bytes * per / cfg.grad_bytes;
    const double calls = gathered ? std::max(1.0, tensors / std::ceil(wire / cap)) : 1.0;
    auto prof =
        net.profile(coll, cfg.dp_algorithm, zg,
                    gathered ? std::min(wire, cap) / calls * spread : std::min(wire, local ? wire : cfg.bucket_bytes));
    auto qgz_time = [&](double elems) {
      return qgz.time(
          [&](Collective c, Algorithm a, const Group& g, double n) {
            return cfg.mode == EvalMode::kFull ? net.time_full(c, a, g, n) : net.profile(c, a, g, n).time(n);
          },
          *slow, elems, cfg.grad_bytes, wake);
    };
    // Each bucket's exchange, then its average: the runtime divides the reduced f32 gradients by the world size (read
    // + write 4 bytes per element) before the next bucket. Each call also pays the wake-up of peers that arrived
    // first and stopped polling (calibrated CPU clusters; 0 elsewhere; qgZ's a hop).
    // (ZeRO averages this rank's slice only: 1/K of the bucket, K the ranks it is cut over)
    const double averaged = static_cast<double>(sharded_over);
    // (tof_within: without the slices' allreduce across shard groups, which --zero-reduce micro-batch pays once)
    auto tof_within = [&](double n) {
      const double elems = n / per;
      if (qgz.on) return qgz_time(elems) + memory_time(*slow, 8 * elems / averaged, 1);
      return calls * ((cfg.mode == EvalMode::kFull ? net.time_full(coll, prof.algorithm, zg, n / calls * spread)
                                                   : prof.time(n / calls * spread)) +
                      wake) +
             memory_time(*slow, 8 * elems / averaged, 1) +
             (gathered ? memory_time(*slow, (spread - 1) * (n + 8 * elems), 1) : 0.0);
    };
    auto tof = [&](double n) { return tof_within(n) + replicas(n / per); };
    // Bucket by bucket; without overlap all of them after the backward pass (a window of 0).
    dp_exposed = bucketed_exposed(cfg.dp_overlap && !local ? bwd * run_scale : 0.0, wire, cap, tof, &dp_total);
    // (ZeRO-2 with micro-batches: `conduit train` sums a step's micro-batches in its buckets and reduce-scatters them
    // once, as ZeRO-1, the buckets holding the whole gradients meanwhile (below); DeepSpeed's, which the GPT model
    // follows by default, reduce-scatters after every micro-batch's backward, for M times the bytes: --zero-reduce
    // micro-batch, each earlier micro-batch's exchange hidden behind its backward and the next one's forward; with
    // shard groups the slices' allreduce across them once, after the last, as the runtime's.)
    if (cfg.zero == 2 && mb > 1 && z2 == ZeroReduce::kEveryMicroBatch) {
      double each = dp_total;
      if (shard > 1) bucketed_exposed(0.0, wire, cfg.bucket_bytes * per / cfg.grad_bytes, tof_within, &each);
      const double hidden = cfg.dp_overlap ? (bwd + fwd) * run_scale : 0.0;
      dp_exposed += static_cast<double>(mb - 1) * std::max(0.0, each - hidden);
      dp_total += static_cast<double>(mb - 1) * each;
    }
    // The parameters are allgathered in the precision they are held in: 2 bytes (mixed precision) or 4 (f32, as
    // `conduit train` runs; the factor 2 stood here for both).
    auto allgather = [&](double bytes, const Group* within = nullptr) {
      const Group& g = within ? *within : zg;
      auto ag = net.profile(Collective::kAllGather, cfg.dp_algorithm, g, bytes);
      return (cfg.mode == EvalMode::kFull ? net.time_full(Collective::kAllGather, ag.algorithm, g, bytes)
                                          : ag.time(bytes)) +
             wake;
    };
    // Each unit's (each layer with parameters, the pooling after it: `conduit train`'s units) parameters, forward and
    // backward, the kernels scaled as the step's.
    const size_t units = unit_first.size();
    std::vector<double> unit_params(units, 0.0), unit_bwd(units, 0.0), unit_fwd(units, 0.0);
    if (cfg.zero >= 1) {
      std::vector<double> per_layer, per_layer_fwd;
      double f0 = 0, b0 = 0;
      layer_times(*slow, b, f0, b0, &per_layer, &per_layer_fwd);
      for (size_t li = 0; li < m.layers.size(); ++li) {
        unit_params[unit_of[li]] += m.layers[li].params();
        unit_bwd[unit_of[li]] += per_layer[li] * run_scale;
        unit_fwd[unit_of[li]] += per_layer_fwd[li] * run_scale;
      }
    }
    if ((cfg.zero == 1 || cfg.zero == 2) && !cfg.zero_prefetch) {
      const double t_ag = allgather(params * eb);
      dp_total += t_ag;
      dp_exposed += t_ag;
    } else if (cfg.zero == 1 || cfg.zero == 2) {
      // `conduit train --zero 1|2` (docs/training.md): step() starts the allgather of the stepped slices, a call
      // per unit and gradient bucket in forward order on the gathers' own channel (deferred_allgather_calls; the
      // layers' tensors are their weights and biases), and the next step's first forward waits before each unit
      // only for that unit's: what it waits is exposed. (Each call timed as an even allgather of its bytes; the
      // runtime's are a unit's share of each rank's bucket slice, uneven where the unit is smaller than a slice.)
      std::vector<std::vector<double>> tensors(units);
      for (size_t li = 0; li < m.layers.size(); ++li) {
        const Layer& l = m.layers[li];
        if (l.params() > 0) tensors[unit_of[li]].insert(tensors[unit_of[li]].end(), {l.params() - l.out, l.out});
      }
      const auto calls =
          deferred_allgather_calls(tensors, cfg.bucket_bytes / cfg.grad_bytes, cfg.zero_allgather_bytes / eb);
      double busy = 0;
      dp_exposed += deferred_allgather_exposed(
          calls, unit_fwd, [&](double elems) { return allgather(elems * eb); }, &busy);
      dp_total += busy;
    }
    if (cfg.zero == 3) {
      // `conduit train --zero 3` (docs/training.md): each layer with parameters is a unit, with the pooling after
      // it. Every micro-batch gathers each unit before its forward and, but the last one, before its backward. With
      // --zero-prefetch (the runtime's default) the next unit's gather starts as a unit begins, one at a time on the
      // gathers' own channel, and only what is left of it when its unit begins is exposed; without, every gather
      // blocks. The units' gradients are reduce-scattered once a step (--zero-reduce step, the runtime's default),
      // each as soon as the last micro-batch's backward has passed it, behind the backward of the units before it;
      // with micro-batch, after every micro-batch's backward (below).
      // (with hpZ the backward's within its group, of the kept parts)
      std::vector<double> t_ag(units, 0.0), g_bwd(units, 0.0);  // each unit's gathers, forward and backward
      std::vector<double> rs_of(units, 0.0);                    // and its reduce-scatter
      double gathers = 0, rs_total = 0, comm_free = 0;
      const Group hg{std::max(hpz, 1LL), 1, 0};
      for (size_t u = 0; u < units; ++u) {
        if (unit_params[u] <= 0) continue;
        t_ag[u] = allgather(unit_params[u] * gather_element_bytes(cfg.gather_bytes, eb));
        g_bwd[u] = hpz > 1 ? allgather(unit_params[u] * kept_bytes, &hg) : t_ag[u];
        gathers += t_ag[u] + (u + 1 < units ? g_bwd[u] : 0.0);
      }
      // One pass over the units in `order`, each after its gather `g` (0: none): when each unit's compute ends, and
      // the time the pass waited for gathers.
      auto play = [&](const std::vector<size_t>& order, const std::vector<double>& g, const std::vector<double>& c,
                      std::vector<double>& end) {
        double clock = 0, waited = 0, ahead = 0;  // ahead: when the gather started one unit ahead is done
        end.assign(units, 0.0);
        for (size_t k = 0; k < order.size(); ++k) {
          const size_t u = order[k];
          const double ready = cfg.zero_prefetch && k > 0 ? ahead : clock + g[u];
          const double begin = std::max(clock, ready);
          waited += begin - clock;
          if (k + 1 < order.size()) ahead = begin + g[order[k + 1]];  // (the channel is free: this one's is done)
          clock = begin + c[u];
          end[u] = clock;
        }
        return waited;
      };
      std::vector<size_t> forward_order(units), backward_order(units);
      for (size_t u = 0; u < units; ++u) forward_order[u] = u, backward_order[u] = units - 1 - u;
      std::vector<double> end_fwd, end_bwd;
      g_bwd.back() = 0;  // (the last unit stays gathered from its forward)
      const double waited =
          play(forward_order, t_ag, unit_fwd, end_fwd) + play(backward_order, g_bwd, unit_bwd, end_bwd);
      double t = 0;
      for (size_t u = units; u-- > 0;) {  // the last micro-batch's backward, unit by unit
        t = end_bwd[u];
        if (unit_params[u] <= 0) continue;
        const double n = unit_params[u] * per;
        auto rs = net.profile(Collective::kReduceScatter, cfg.dp_algorithm, zg, n);
        const double avg = memory_time(*slow, 8 * n / per / static_cast<double>(sharded_over), 1);
        const double t_rs =
            (qgz.on ? qgz_time(unit_params[u]) + avg
                    : (cfg.mode == EvalMode::kFull ? net.time_full(Collective::kReduceScatter, rs.algorithm, zg, n)
                                                   : rs.time(n)) +
                          avg + wake) +
            replicas(unit_params[u]);
        rs_total += t_rs;
        rs_of[u] = t_rs;
        comm_free = std::max(comm_free, cfg.dp_overlap ? t : 0.0) + t_rs;
      }
      dp_total = static_cast<double>(mb) * gathers + rs_total;
      dp_exposed = cfg.dp_overlap ? std::max(0.0, comm_free - t) : rs_total;
      r.breakdown.zero3_exposed = static_cast<double>(mb) * waited;
      if (mb > 1 && z2 == ZeroReduce::kEveryMicroBatch) {
        // --zero-reduce micro-batch (DeepSpeed's stage 3): every micro-batch's units reduce-scattered after its
        // backward, each earlier one's behind its own backward and the next forward (with shard groups the slices'
        // allreduce across them once, after the last, as the runtime's)
        double within = 0;
        for (size_t u = 0; u < units; ++u)
          if (unit_params[u] > 0) within += rs_of[u] - replicas(unit_params[u]);
        const double hidden = cfg.dp_overlap ? (bwd + fwd) * run_scale : 0.0;
        dp_total += static_cast<double>(mb - 1) * within;
        dp_exposed += static_cast<double>(mb - 1) * std::max(0.0, within - hidden);
      }
      const size_t with_params =
          size_t(std::count_if(unit_params.begin(), unit_params.end(), [](double n) { return n > 0; }));
      const size_t backward = with_params - (unit_params.back() > 0 ? 1 : 0);
      r.notes.push_back(fmt::format(
          "ZeRO-3: every micro-batch gathers {} unit(s) forward and {} backward{} ({} a micro-batch, {} of it "
          "exposed{}), "
          "and each unit's gradients are reduce-scattered {} ({} in all, {} of it past the backward)",
          with_params, backward,
          hpz > 1 ? fmt::format(" within groups of {} (hpZ: the parts the forward kept)", hpz) : std::string(),
          format_seconds(gathers), format_seconds(waited),
          cfg.zero_prefetch ? ": each next unit's gather behind the unit before" : ": no prefetch",
          mb > 1 && z2 == ZeroReduce::kEveryMicroBatch ? "every micro-batch (--zero-reduce micro-batch)"
                                                       : "once an iteration",
          format_seconds(dp_total - static_cast<double>(mb) * gathers), format_seconds(dp_exposed)));
    }
    // (the cast to fp16 or the int8 blocks and back, error feedback; qgZ's passes are in its calls)
    // (an exchange's passes: every micro-batch's with --zero-reduce micro-batch)
    if (per != cfg.grad_bytes && !qgz.on && !local)
      comp = memory_time(*slow, params * (cfg.grad_bytes * 2 + per * 2), 2) *
             (cfg.zero >= 2 && z2 == ZeroReduce::kEveryMicroBatch ? static_cast<double>(mb) : 1.0);
    dp_exposed += comp;
    // Synchronous data parallelism waits for the slowest rank every step: measured at a barrier among as many ranks
    // (the ranks' steps are not independent when they share cores), else the median step of the slowest of `gpus`
    // ranks whose steps are independent draws from the measured distribution, its 0.5^(1/gpus) quantile, minus the
    // median.
    if (measured && cfg.sync.kind != "async")
      r.breakdown.rank_wait =
          measured->wait_ranks == static_cast<double>(gpus)
              ? measured->slowest_wait
              : measured->quantile(std::pow(0.5, 1.0 / static_cast<double>(gpus))) - measured->median();
    dp_exposed += r.breakdown.rank_wait;
    r.dp_algorithm = qgz.on ? (qgz.two_hops ? "all-to-all, two hops" : "all-to-all") : algorithm_name(prof.algorithm);
    if (qgz.on) {
      const auto [c, a] = all_to_all_as(qgz.outer());
      r.dp_bottleneck = net.profile(c, a, qgz.outer(), std::min(wire, cfg.bucket_bytes)).bottleneck;
    } else {
      r.dp_bottleneck = prof.bottleneck;
    }
    if (shard > 1 && cfg.zero >= 1) {
      // (the slices' allreduce across the groups where it outlasts a bucket's reduce-scatter within the group)
      const double elems = std::min(wire, cfg.bucket_bytes * per / cfg.grad_bytes) / per;
      const double within = qgz.on ? qgz_time(elems) : prof.time(elems * per);
      const double bytes = elems / static_cast<double>(shard) * replica_bytes;
      if (replicas(elems) > within)
        r.dp_bottleneck = net.profile(Collective::kAllReduce, cfg.dp_algorithm, rg, bytes).bottleneck;
    }
    if (cfg.sync.kind == "local-sgd") {
      dp_total /= cfg.sync.period;
      dp_exposed /= cfg.sync.period;
      comp /= cfg.sync.period;
      r.breakdown.rank_wait /= cfg.sync.period;
    } else if (cfg.sync.kind == "async") {
      dp_exposed = std::max(0.0, dp_total + comp - r.breakdown.compute);
    }
  }
  r.breakdown.dp_comm = dp_total;
  r.breakdown.dp_exposed = dp_exposed;
  r.breakdown.compression = std::min(comp, dp_exposed);  // (the part exposed: async hides the rest)
  // The optimizer streams 28 bytes per (sharded) parameter, or takes its measured time for these layers (SGD with
  // momentum, as conduit train runs it; sharded by ZeRO like the parameters: over the shard group where there is one).
  const double over = static_cast<double>(sharded_over);
  r.breakdown.optimizer =
      measured && measured->optimizer > 0 ? measured->optimizer / over : memory_time(*slow, params / over * 28, 4);
  {
    // (dp_exposed holds the wait for the slowest rank, whose own compute is stretched too: not slack, and not
    // communication)
    const double waited = dp_exposed - r.breakdown.compression - r.breakdown.rank_wait + r.breakdown.zero3_exposed;
    r.breakdown.overlap_slowdown = overlap_slowdown(comm_share(*slow), dp_total - waited, r.breakdown.compute, waited);
    if (r.breakdown.overlap_slowdown > 0)
      r.notes.push_back(fmt::format(
          "the {} of data-parallel communication hidden behind compute holds {:.1f}% of the SMs (comm_sms / "
          "sm_count): the compute it overlaps runs that much slower, {} more a step",
          format_seconds(std::min(dp_total - waited, r.breakdown.compute)), 100.0 * comm_share(*slow),
          format_seconds(r.breakdown.overlap_slowdown)));
  }
  r.time = r.breakdown.compute + dp_exposed + r.breakdown.zero3_exposed + r.breakdown.optimizer +
           r.breakdown.overlap_slowdown;
  ModelState st = zero_model_state(params, sharded_over, cfg.zero, cfg.grad_bytes);
  if (eb == 4) {
    // f32 training (`conduit train`): 4-byte parameters and Adam's two f32 moments, no f32 master copy (the mixed
    // precision state above is 2-byte parameters and 12 bytes of optimizer state a parameter).
    const double n = static_cast<double>(sharded_over);
    st.params = 4 * params / (cfg.zero >= 3 ? n : 1);
    st.optimizer = 8 * params / (cfg.zero >= 1 ? n : 1);
  }
  // (ZeRO-2 and 3 over micro-batches reduced once a step: the buckets hold the whole gradients from the first
  // micro-batch to their reduce-scatter, as `conduit train` sums them by default)
  const bool whole_grads = cfg.zero >= 2 && mb > 1 && z2 == ZeroReduce::kOncePerStep;
  if (whole_grads) st.grads = params * cfg.grad_bytes;
  if (cfg.zero == 3 && gpus > 1) {
    // ZeRO-3 also holds the unit it runs whole (with prefetch, and the next one's being gathered: the largest two
    // adjacent units), and that unit's gradient bucket until it is reduce-scattered.
    double largest = 0, whole = 0, previous = 0;
    for (const auto& l : m.layers) {
      if (l.params() <= 0) continue;
      largest = std::max(largest, l.params());
      whole = std::max(whole, l.params() + (cfg.zero_prefetch ? previous : 0.0));
      previous = l.params();
    }
    st.params += whole * eb;
    if (!whole_grads) st.grads += largest * cfg.grad_bytes;  // (within the whole gradients otherwise)
    // (hpZ: every unit's kept part but the last unit's, whose backward comes next: from its forward to its backward)
    if (hpz > 1) {
      double last = 0;
      for (size_t li = 0; li < m.layers.size(); ++li)
        if (unit_of[li] + 1 == unit_first.size()) last += m.layers[li].params();
      st.params += (params - last) * kept_bytes / static_cast<double>(hpz);
    }
  }
  r.memory.params = st.params;
  r.memory.grads = st.grads;
  r.memory.optimizer = st.optimizer;
  double act = 0;
  for (const auto& l : m.layers) {
    GemmShape g = l.forward_gemm(b);
    act += 2 * g.m * g.n * eb;  // pre- and post-activation outputs kept for backward
  }
  r.memory.activations = act;
  r.memory_capacity = cap;
  r.fits = r.memory.total() <= cap;
  const double flops = layer_model_flops(m);
  r.model_flops = r.hardware_flops = flops * static_cast<double>(cfg.global_batch);
  r.model_tflops_per_gpu = r.hardware_tflops_per_gpu = r.model_flops / r.time / gpus / 1e12;
  r.mfu = r.model_flops / r.time / gpus / mean_peak_flops(topo);
  if (gpus > 1)
    r.notes.push_back(fmt::format("data-parallel exchange {} ({}, bottleneck {}), {} exposed{}",
                                  format_seconds(dp_total), r.dp_algorithm, r.dp_bottleneck, format_seconds(dp_exposed),
                                  wake_note(wake)));
  check_finite(r);
  return r;
}

}  // namespace

StepResult simulate_layer_step(CollectiveModel& net, const LayerModel& m, const ParallelConfig& cfg) {
  // (its only given algorithm: a layer list has no tensor parallelism)
  if (cfg.tp_algorithm != Algorithm::kAuto)
    throw ConfigError(fmt::format(
        "--tp-algorithm {}: the tensor-parallel collectives' algorithm, and a layer-list model has none (--tp 1); "
        "allowed: leave it out",
        algorithm_name(cfg.tp_algorithm)));
  const char* flag = cfg.dp_algorithm != Algorithm::kAuto ? "--dp-algorithm" : nullptr;
  return naming_the_algorithm_flag(flag, [&] { return layer_step(net, m, cfg); });
}

}  // namespace conduit::sim
