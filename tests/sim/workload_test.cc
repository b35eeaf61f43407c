// Workload closed forms: Megatron's FLOPs and parameter formulas, ZeRO memory, activation memory, bubbles,
// compute efficiency, and the step model's structure.
#include "sim/workload.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "sim/compute.h"
#include "sim/plan.h"
#include "sim/step.h"

namespace conduit::sim {
namespace {

double rel(double a, double b) { return std::abs(a - b) / std::abs(b); }

GptModel gpt(int l, long long h, long long a, long long s = 2048, long long V = 51200) {
  GptModel m;
  m.layers = l;
  m.hidden = h;
  m.heads = a;
  m.seq = s;
  m.vocab = V;
  return m;
}

TEST(Workload, MegatronFlopsFormulaWithFullRecompute) {
  // GEMM-by-GEMM count against 96 B s l h^2 (1 + s/6h + V/(16 l h)) for the paper's GPT-3 and 1T configs.
  for (auto [m, B] : {std::pair{gpt(96, 12288, 96), 1536.0}, std::pair{gpt(128, 25600, 160), 3072.0},
                      std::pair{gpt(24, 2304, 24), 512.0}}) {
    double counted = gpt_iteration_flops(m, B, Recompute::kFull);
    double formula = megatron_flops_formula(m, B, true);
    EXPECT_LT(rel(counted, formula), 1e-12) << m.layers;
    EXPECT_LT(rel(gpt_iteration_flops(m, B, Recompute::kNone), megatron_flops_formula(m, B, false)), 1e-12);
  }
  // Selective recompute sits in between (only the attention core is recomputed).
  GptModel m = gpt(96, 12288, 96);
  EXPECT_GT(gpt_iteration_flops(m, 8, Recompute::kSelective), gpt_iteration_flops(m, 8, Recompute::kNone));
  EXPECT_LT(gpt_iteration_flops(m, 8, Recompute::kSelective), gpt_iteration_flops(m, 8, Recompute::kFull));
}

TEST(Workload, MegatronParameterCounts) {
  // Table 1 of Narayanan et al. 2021: 1.7B, 18.4B, 145.6B, 1008.0B.
  EXPECT_NEAR(gpt_parameters(gpt(24, 2304, 24)) / 1e9, 1.7, 0.05);
  EXPECT_NEAR(gpt_parameters(gpt(40, 6144, 48)) / 1e9, 18.4, 0.05);
  EXPECT_NEAR(gpt_parameters(gpt(80, 12288, 96)) / 1e9, 145.6, 0.05);
  EXPECT_NEAR(gpt_parameters(gpt(128, 25600, 160)) / 1e9, 1008.0, 0.5);
}

TEST(Workload, ZeroMemoryFor7_5BOn64Ranks) {
  // ZeRO paper (Rajbhandari et al. 2020), figure 1: 120, 31.4, 16.6 and 1.9 GB per GPU for stages 0-3.
  const double psi = 7.5e9;
  EXPECT_NEAR(zero_model_state(psi, 64, 0).total() / 1e9, 120.0, 0.05);
  EXPECT_NEAR(zero_model_state(psi, 64, 1).total() / 1e9, 31.4, 0.05);
  EXPECT_NEAR(zero_model_state(psi, 64, 2).total() / 1e9, 16.6, 0.05);
  EXPECT_NEAR(zero_model_state(psi, 64, 3).total() / 1e9, 1.9, 0.05);
  EXPECT_THROW(zero_model_state(psi, 64, 4), ConfigError);
}

TEST(Workload, ActivationMemoryKorthikanti) {
  // GPT-3 175B, s = 2048, b = 1, t = 8: sbh(34/t + 5as/(ht)) with sequence parallelism.
  GptModel m = gpt(96, 12288, 96);
  const double sbh = 2048.0 * 12288;
  EXPECT_LT(rel(gpt_layer_activation_bytes(m, 1, 8, true, Recompute::kNone),
                sbh * (34.0 / 8 + 5.0 * 96 * 2048 / (12288 * 8))),
            1e-12);
  EXPECT_LT(rel(gpt_layer_activation_bytes(m, 1, 8, false, Recompute::kNone),
                sbh * (10 + 24.0 / 8 + 5.0 * 96 * 2048 / (12288 * 8))),
            1e-12);
  EXPECT_LT(rel(gpt_layer_activation_bytes(m, 1, 8, true, Recompute::kSelective), sbh * 34.0 / 8), 1e-12);
  EXPECT_LT(rel(gpt_layer_activation_bytes(m, 1, 1, false, Recompute::kFull), 2 * sbh), 1e-12);
}

TEST(Workload, GatedMlpShapesParametersAndActivations) {
  // Llama 2's released sizes: 6,738,415,616 and 68,976,648,192 parameters (untied output layers, no biases, RoPE).
  // The "-like" models tie the output layer and add GPT's biases and learned positions: 1.7% and 0.3% fewer. Counted
  // as GPT's 4h MLP they were 16% and 20% short (the SwiGLU MLP holds 3hf, not 8h^2).
  GptModel l7, l70;
  ASSERT_TRUE(named_gpt("llama2-7b-like", l7));
  ASSERT_TRUE(named_gpt("llama2-70b-like", l70));
  EXPECT_NEAR(gpt_parameters(l7) / 6738415616.0, 1, 0.02);
  EXPECT_NEAR(gpt_parameters(l70) / 68976648192.0, 1, 0.005);
  GptModel plain = l70;
  plain.gated_mlp = false;
  plain.ffn_hidden = 0;
  EXPECT_DOUBLE_EQ(gpt_layer_parameters(l70) - gpt_layer_parameters(plain),
                   (3.0 * 28672 - 8.0 * 8192) * 8192 + (2.0 * 28672 - 4 * 8192));
  // Forward GEMMs at t = 8: up (bs x h)(h x 2f/t), down (bs x f/t)(f/t x h); FLOPs 2 bs h 3f/t for the MLP.
  double mlp = 0;
  for (const auto& g : gpt_layer_gemms(l70, 1, 8))
    if (std::string(g.name).rfind("mlp", 0) == 0) mlp += g.shape.flops();
  EXPECT_DOUBLE_EQ(mlp, 2.0 * 4096 * 8192 * 3 * 28672 / 8);
  // Activations per layer, t = 8 with sequence parallelism (sbh units): 10/t replicated, Q and the projection's
  // input 4/t, K and V 2 + 2 at one 128-wide head per rank, the gated MLP 6f/(ht), the scores 5as/(ht).
  const double sbh = 4096.0 * 8192;
  const double expect = 10.0 / 8 + (4 + 6 * 3.5) / 8 + 4 * 128.0 / 8192 + 5.0 * 64 * 4096 / (8192 * 8);
  EXPECT_LT(rel(gpt_layer_activation_bytes(l70, 1, 8, true, Recompute::kNone), sbh * expect), 1e-12);
  // A width the tensor-parallel ranks cannot split evenly is refused; so is a negative or too large one.
  GptModel odd = l7;
  odd.ffn_hidden = 11000;  // 8 x 1375
  EXPECT_NO_THROW(check_ffn_split(odd, 8));
  EXPECT_THROW(check_ffn_split(odd, 16), ConfigError);
  odd.ffn_hidden = -1;
  EXPECT_THROW(odd.validate(), ConfigError);
  // A rank's share: a t-th up to t = kv_heads (8); past it each rank keeps one KV head's whole K and V weights
  // (2 x 128 x 8193), not kv/t of a head (the weights at t = 16 were counted as exactly half of t = 8's).
  EXPECT_DOUBLE_EQ(gpt_layer_parameters_per_rank(l70, 8), gpt_layer_parameters(l70) / 8);
  const double kv_all = 2.0 * 1024 * 8193;  // K and V, 8 heads of 128, with biases
  EXPECT_DOUBLE_EQ(gpt_layer_parameters_per_rank(l70, 16),
                   (gpt_layer_parameters(l70) - kv_all) / 16 + 2.0 * 128 * 8193);
}

TEST(Workload, PipelineBubble) {
  EXPECT_DOUBLE_EQ(pipeline_bubble_fraction(8, 64, 1), 7.0 / 64);
  EXPECT_DOUBLE_EQ(pipeline_bubble_fraction(8, 64, 4), 7.0 / 256);
  EXPECT_THROW(pipeline_bubble_fraction(0, 1, 1), InvalidArgument);
}

TEST(Compute, EfficiencyGrowsWithShapeAndWavesQuantize) {
  Accelerator a;
  a.peak_flops = 312e12;
  a.memory_bandwidth = 2039e9;
  a.sm_count = 108;
  a.tile_m = 256;
  a.tile_n = 128;
  a.gemm_efficiency = 0.8;
  a.memory_efficiency = 0.85;
  a.kernel_overhead = 4e-6;
  double small = gemm_efficiency(a, {256, 256, 256, 1});
  double large = gemm_efficiency(a, {8192, 8192, 8192, 1});
  EXPECT_LT(small, 0.1);
  EXPECT_GT(large, 0.75);
  EXPECT_LE(large, 0.8);
  // 108 SMs: 12 x 9 = 108 tiles fill one wave; 12 x 10 = 120 tiles need two (the second 11% full).
  double full = gemm_efficiency(a, {256 * 12, 128 * 9, 8192, 1});
  double spill = gemm_efficiency(a, {256 * 12, 128 * 10, 8192, 1});
  EXPECT_GT(full, spill * 1.6);
  // A skinny GEMM is memory-bound: bytes / bandwidth, not FLOPs / peak.
  GemmShape skinny{8192, 16, 8192, 1};
  EXPECT_NEAR(gemm_time(a, skinny), 2.0 * (8192.0 * 8192 + 8192 * 16 + 8192 * 16) / (2039e9 * 0.85) + 4e-6, 1e-9);
  // Calibration: a measured shape predicts its measured time, launch included (it was that and a second launch).
  a.calibration.push_back({4096, 4096, 4096, 200e12});
  EXPECT_NEAR(gemm_time(a, {4096, 4096, 4096, 1}), 2.0 * 4096 * 4096 * 4096 / 200e12, 1e-12);
  // Twice the work at the same efficiency: twice the measured work, one launch.
  EXPECT_NEAR(gemm_time(a, {8192, 4096, 4096, 1}) - 4e-6, 2 * (2.0 * 4096 * 4096 * 4096 / 200e12 - 4e-6), 1e-12);
  // An arithmetic-bound sample's efficiency leaves a memory-bound GEMM (decode's weight streaming) at its bandwidth
  // time (a slow 4096^3 sample slowed it as much).
  EXPECT_NEAR(gemm_time(a, skinny), 2.0 * (8192.0 * 8192 + 8192 * 16 + 8192 * 16) / (2039e9 * 0.85) + 4e-6, 1e-9);
}

// Edge tiles and split-K: a GEMM never takes less time for more rows or columns (an edge tile one row high halved
// the wave's time: M = 257 took half of M = 256's), a GEMM whose tiles leave SMs idle splits K to use them (decode's
// M = batch GEMMs), and with one SM (a calibrated CPU) the time is the FLOPs at the sustained rate, edges included.
TEST(Compute, EdgeTilesNeverShortenAGemmAndFewTilesSplitK) {
  // The dgx-h100 preset's H100: 989 TFLOP/s at 0.72, 3350 GB/s at 0.85, 132 SMs, 256 x 128 tiles, 4 us a launch.
  const Accelerator a = load_cluster("dgx-h100").node_kinds[0].accelerator;
  ASSERT_EQ(a.sm_count, 132);
  ASSERT_TRUE(a.calibration.empty());
  for (double n : {1280.0, 8192.0, 28672.0 / 4})
    for (double m = 1; m <= 1100; m += 1) {
      const double t0 = gemm_time(a, {m, n, 8192, 1}), t1 = gemm_time(a, {m + 1, n, 8192, 1});
      ASSERT_GE(t1, t0 * (1 - 1e-12)) << "M " << m << " to " << m + 1 << ", N " << n;
    }
  for (double n = 1000; n <= 1400; n += 1)
    ASSERT_GE(gemm_time(a, {512, n + 1, 4096, 1}), gemm_time(a, {512, n, 4096, 1}) * (1 - 1e-12)) << "N " << n;
  // Nor for a deeper K (capping the split at K / tile_n halved a 64 x 128 GEMM's time from K = 255 to 256).
  for (double m : {64.0, 256.0, 1000.0})
    for (double k = 1; k <= 2100; k += 1)
      ASSERT_GE(gemm_time(a, {m, 128, k + 1, 1}), gemm_time(a, {m, 128, k, 1}) * (1 - 1e-12))
          << "M " << m << " K " << k;
  for (double b = 1; b <= 300; b += 1)
    ASSERT_GE(gemm_time(a, {64, 128, 512, b + 1}), gemm_time(a, {64, 128, 512, b}) * (1 - 1e-12)) << "batch " << b;
  // The QKV GEMM of a 70B model's decode at tp 8, batch 256: 10 tiles. On 10 SMs it was 99.5 us of arithmetic;
  // split over the idle SMs it is far less, and no faster than streaming its weights.
  const GemmShape qkv{256, 1280, 8192, 1};
  const double on_ten_sms = qkv.flops() / (a.peak_flops * a.gemm_efficiency * 10 / 132);
  const double streaming = 2.0 * (256.0 * 8192 + 8192.0 * 1280 + 256.0 * 1280) / (3350e9 * 0.85);
  EXPECT_LT(gemm_time(a, qkv), on_ten_sms / 4);
  EXPECT_GT(gemm_time(a, qkv), streaming + 4e-6);
  // One SM: every tile, the edge ones too, at the sustained rate.
  Accelerator cpu = a;
  cpu.sm_count = 1;
  cpu.tile_m = cpu.tile_n = 64;
  cpu.peak_flops = 20e9;
  cpu.gemm_efficiency = 1;
  for (const GemmShape g : {GemmShape{100, 10, 128, 1}, GemmShape{64, 784, 128, 3}, GemmShape{1000, 1000, 1000, 1}})
    EXPECT_NEAR(gemm_time(cpu, g), g.flops() / 20e9 + 4e-6, 1e-12);
}

ParallelConfig cfg(int tp, int pp, int b, long long B) {
  ParallelConfig c;
  c.tp = tp;
  c.pp = pp;
  c.micro_batch = b;
  c.global_batch = B;
  return c;
}

// The pipeline schedule played out operation by operation (Megatron-LM's order, as `conduit train --pp` runs it):
// each device runs its forwards (f[d][j]: chunk j of device d, a micro-batch) and backwards (g[d][j]) in order, each
// once its input has arrived; v = 1 is 1F1B (or GPipe), v > 1 the interleaved schedule. Returns the makespan.
double played_pipeline(int p, int v, long long m, bool gpipe, const std::vector<std::vector<double>>& f,
                       const std::vector<std::vector<double>>& g) {
  struct Op {
    bool back;
    int chunk;
    long long mb;
  };
  const long long total = m * v;
  auto micro = [&](long long k) { return v == 1 ? k : (k / (static_cast<long long>(p) * v)) * p + k % p; };
  auto fchunk = [&](long long k) { return v == 1 ? 0 : static_cast<int>((k / p) % v); };
  auto bchunk = [&](long long k) { return v == 1 ? 0 : v - 1 - static_cast<int>((k / p) % v); };
  std::vector<std::vector<Op>> ops(static_cast<size_t>(p));
  for (int d = 0; d < p; ++d) {
    const long long warm =
        gpipe ? total
              : std::min<long long>(v == 1 ? p - d - 1 : 2LL * (p - d - 1) + static_cast<long long>(v - 1) * p, total);
    auto& o = ops[static_cast<size_t>(d)];
    for (long long k = 0; k < warm; ++k) o.push_back({false, fchunk(k), micro(k)});
    for (long long k = 0; k < total - warm; ++k) {
      o.push_back({false, fchunk(warm + k), micro(warm + k)});
      o.push_back({true, bchunk(k), micro(k)});
    }
    for (long long k = total - warm; k < total; ++k) o.push_back({true, bchunk(k), micro(k)});
  }
  std::map<std::tuple<int, int, long long>, double> fdone, bdone;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> free_at(static_cast<size_t>(p), 0.0);
  for (long long left = 2 * total * p; left > 0;) {
    bool moved = false;
    for (int d = 0; d < p; ++d)
      for (auto& o = ops[static_cast<size_t>(d)]; next[static_cast<size_t>(d)] < o.size();) {
        const Op op = o[next[static_cast<size_t>(d)]];
        double ready = 0;
        if (!op.back && (d > 0 || op.chunk > 0)) {
          auto it = fdone.find(d > 0 ? std::tuple{d - 1, op.chunk, op.mb} : std::tuple{p - 1, op.chunk - 1, op.mb});
          if (it == fdone.end()) break;
          ready = it->second;
        } else if (op.back) {
          auto it = d == p - 1 && op.chunk == v - 1 ? fdone.find({d, op.chunk, op.mb})
                    : d < p - 1                     ? bdone.find({d + 1, op.chunk, op.mb})
                                                    : bdone.find({0, op.chunk + 1, op.mb});
          if (it == (d == p - 1 && op.chunk == v - 1 ? fdone.end() : bdone.end())) break;
          ready = it->second;
        }
        const double end = std::max(free_at[static_cast<size_t>(d)], ready) +
                           (op.back ? g : f)[static_cast<size_t>(d)][static_cast<size_t>(op.chunk)];
        (op.back ? bdone : fdone)[{d, op.chunk, op.mb}] = end;
        free_at[static_cast<size_t>(d)] = end;
        ++next[static_cast<size_t>(d)];
        --left;
        moved = true;
      }
    if (!moved) ADD_FAILURE() << "the played-out schedule deadlocked";
    if (!moved) return 0;
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

// A stage's time per micro-batch, and of that its forward.
struct Stage {
  double total, forward;
};

// Chunk times from stage times: a plain (middle) stage's forward and backward spread over its v chunks, the first
// stage's extra in its first chunk, the last's in its last chunk (where the embedding and the output layer are).
double played_stages(int p, int v, long long m, bool gpipe, Stage first, Stage middle, Stage last) {
  const size_t P = static_cast<size_t>(p), V = static_cast<size_t>(v);
  std::vector<std::vector<double>> f(P, std::vector<double>(V, middle.forward / v));
  std::vector<std::vector<double>> g(P, std::vector<double>(V, (middle.total - middle.forward) / v));
  f[0][0] += first.forward - middle.forward;
  g[0][0] += (first.total - first.forward) - (middle.total - middle.forward);
  f[P - 1][V - 1] += last.forward - middle.forward;
  g[P - 1][V - 1] += (last.total - last.forward) - (middle.total - middle.forward);
  return played_pipeline(p, v, m, gpipe, f, g);
}

TEST(Step, PipelineBubbleMatchesTheScheduleItModels) {
  // Equal stages: the closed form (m + (p-1)/v) S, the bubble (p-1)/(v m) of the ideal.
  for (auto [p, v, m] : {std::tuple{4, 1, 32LL}, std::tuple{4, 1, 3LL}, std::tuple{8, 1, 8LL}, std::tuple{4, 2, 8LL},
                         std::tuple{4, 4, 32LL}, std::tuple{3, 2, 6LL}})
    for (bool gpipe : {false, true}) {
      if (gpipe && v > 1) continue;
      const Stage same{1, 1.0 / 3};
      EXPECT_NEAR(played_stages(p, v, m, gpipe, same, same, same), m * (1 + pipeline_bubble_fraction(p, m, v)), 1e-9)
          << p << " " << v << " " << m;
    }
  // Inside the step: the pipeline (the busiest stage's m micro-batches and the bubble) is the schedule played out
  // with the stage times the step reports, the last stage slower by the output layer, the first by the embedding's
  // collective (tp > 1), forward only; on ethernet-25g at tp 8 across two nodes that collective is slow enough that
  // the first stage has the largest forward and the last the largest backward (GPipe's sum + (m - 1)(max F + max B):
  // charging m - 1 of the largest stage came out low there).
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  Topology eth(load_cluster("ethernet-25g"), 32);
  CollectiveModel eth_net(eth);
  GptModel m = gpt(32, 4096, 32);
  struct Case {
    Schedule sched;
    int v, tp, pp, b;
    long long B;
    bool ethernet = false;
  };
  for (const Case k : {Case{Schedule::k1F1B, 1, 8, 4, 1, 64}, Case{Schedule::kGpipe, 1, 8, 4, 1, 64},
                       Case{Schedule::kInterleaved, 4, 8, 4, 1, 64}, Case{Schedule::kInterleaved, 2, 8, 4, 2, 16},
                       Case{Schedule::k1F1B, 1, 1, 8, 1, 64}, Case{Schedule::k1F1B, 1, 2, 8, 2, 16},
                       Case{Schedule::kInterleaved, 2, 8, 2, 1, 8}, Case{Schedule::kGpipe, 1, 8, 2, 1, 16, true},
                       Case{Schedule::kGpipe, 1, 8, 4, 1, 8, true}, Case{Schedule::k1F1B, 1, 8, 4, 1, 8, true}}) {
    ParallelConfig c = cfg(k.tp, k.pp, k.b, k.B);
    c.schedule = k.sched;
    c.virtual_stages = k.v;
    StepResult r = simulate_step(k.ethernet ? eth_net : net, m, c);
    const auto& s = r.breakdown;
    EXPECT_GT(s.stage_last, s.stage_middle);
    EXPECT_GE(s.stage_first, s.stage_middle);
    EXPECT_EQ(s.stage_first > s.stage_middle, k.tp > 1);  // (the embedding's allreduce)
    EXPECT_NEAR(s.stage_first - s.stage_first_forward, s.stage_middle - s.stage_middle_forward, 1e-15);  // (forward)
    if (k.ethernet && k.pp == 2) {  // (GPipe's largest forward and largest backward on different stages)
      EXPECT_GT(s.stage_first_forward, s.stage_last_forward);
    }
    const double pipe = s.compute + s.tp_comm + s.pp_comm + s.bubble;
    EXPECT_NEAR(
        pipe,
        played_stages(k.pp, k.v, r.microbatches, k.sched == Schedule::kGpipe, {s.stage_first, s.stage_first_forward},
                      {s.stage_middle, s.stage_middle_forward}, {s.stage_last, s.stage_last_forward}),
        1e-9 * pipe)
        << static_cast<int>(k.sched) << " v " << k.v << " tp " << k.tp << " m " << r.microbatches;
    // Cheaper than charging every stage the last one's time (what it did until 2026-12-06), where the last stage
    // holds both the largest forward and backward (GPipe over ethernet's slow embedding collective: dearer than
    // that, as played out).
    if (!k.ethernet) {
      EXPECT_LT(pipe, (r.microbatches + static_cast<double>(k.pp - 1) / k.v) * s.stage_last);
    }
    // ... and the step's time is made of it: the pipeline, then the exchanges and the optimizer after it.
    EXPECT_NEAR(r.time, pipe + s.embedding_sync + s.dp_exposed + s.zero3_exposed + s.optimizer + s.overlap_slowdown,
                1e-9 * r.time);
  }
}

// An uneven pipeline split (--first-stage-layers, --last-stage-layers): the stages' times from their own layers, the
// pipeline the schedule played out with them (the slowest stage a middle one here, where the closed form that holds
// when the last is slowest does not), the memory of the stage that holds the most. BLOOM-176B ran 70 layers on 12
// stages as 5, 6 x 10, 5; the even split it could not have is refused naming the flags.
TEST(Step, UnevenPipelineSplitsAreTheirStagesPlayedOut) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = gpt(32, 4096, 32);
  // Spelled out, the even split is the even split (the last stage the slowest: the same pipeline).
  ParallelConfig even = cfg(8, 4, 1, 64);
  ParallelConfig spelled = even;
  spelled.first_stage_layers = 8;
  spelled.last_stage_layers = 8;
  const StageLayers sl = stage_layers(m, spelled);
  EXPECT_EQ(std::tuple(sl.first, sl.middle, sl.last, sl.uneven), std::tuple(8, 8, 8, false));
  const StepResult re = simulate_step(net, m, even), rs = simulate_step(net, m, spelled);
  EXPECT_DOUBLE_EQ(rs.time, re.time);
  EXPECT_DOUBLE_EQ(rs.memory.total(), re.memory.total());
  // The ends with 2 layers, the middle stages 14 each: a middle one is the slowest and sets the pipeline's pace.
  for (Schedule sched : {Schedule::k1F1B, Schedule::kGpipe}) {
    ParallelConfig c = even;
    c.schedule = sched;
    c.first_stage_layers = 2;
    c.last_stage_layers = 2;
    const StepResult r = simulate_step(net, m, c);
    const StepBreakdown& s = r.breakdown;
    EXPECT_GT(s.stage_middle, 2 * s.stage_last);
    EXPECT_GT(s.stage_middle, 2 * s.stage_first);
    const double pipe = s.compute + s.tp_comm + s.pp_comm + s.bubble;
    EXPECT_NEAR(pipe,
                played_stages(4, 1, r.microbatches, sched == Schedule::kGpipe, {s.stage_first, s.stage_first_forward},
                              {s.stage_middle, s.stage_middle_forward}, {s.stage_last, s.stage_last_forward}),
                1e-9 * pipe)
        << static_cast<int>(sched);
    // (the pipeline runs the middle stage's m micro-batches: its compute, not the last stage's)
    EXPECT_NEAR(s.compute + s.tp_comm + s.pp_comm, static_cast<double>(r.microbatches) * s.stage_middle, 1e-9 * pipe);
    // 1F1B: the closed form (m max S + sum S - max S) overstates it, the slow stage's warm-up hiding the others'.
    if (sched == Schedule::k1F1B) {
      EXPECT_LT(pipe, (static_cast<double>(r.microbatches) - 1) * s.stage_middle + s.stage_first + 2 * s.stage_middle +
                          s.stage_last - 1e-9 * pipe);
    }
    EXPECT_NEAR(r.time, pipe + s.embedding_sync + s.dp_exposed + s.zero3_exposed + s.optimizer + s.overlap_slowdown,
                1e-9 * r.time);
    // Memory: the second stage, 14 layers with p - 1 = 3 micro-batches in flight under 1F1B (all 8 under GPipe),
    // holds more than the first (2 layers, 4 in flight, the embeddings) and the last.
    const double in_flight = sched == Schedule::kGpipe ? static_cast<double>(r.microbatches) : 3.0;
    EXPECT_NEAR(r.memory.activations, gpt_layer_activation_bytes(m, 1, 8, false, Recompute::kNone) * 14 * in_flight,
                1e-9 * r.memory.activations);
    // (one note, naming the stage that holds the most: the last's was added beside it when it held more than the first)
    EXPECT_EQ(
        std::count_if(r.notes.begin(), r.notes.end(), [](const std::string& n) { return n.starts_with("memory: "); }),
        1);
    EXPECT_NE(std::find_if(
                  r.notes.begin(), r.notes.end(),
                  [](const std::string& n) { return n.find("memory: the second pipeline stage holds the most") == 0; }),
              r.notes.end());
    EXPECT_NE(std::find_if(r.notes.begin(), r.notes.end(),
                           [](const std::string& n) {
                             return n.find(
                                        "uneven pipeline split: 2 layers on the first stage, 14 on each of the 2 "
                                        "middle ones, 2 on the last") == 0;
                           }),
              r.notes.end());
  }
  // The data-parallel exchange and the optimizer step are those of the stage that holds the most: with the ends empty
  // (--first-stage-layers 0 --last-stage-layers 0) a middle stage's 16 layers, not the first stage's embeddings alone
  // (they were charged for the first stage's parameters whatever the split: 4x too little here). After the flush, all
  // of it exposed (--no-overlap).
  {
    ParallelConfig flat = cfg(1, 4, 1, 64);
    flat.dp_overlap = false;
    ParallelConfig ends = flat;
    ends.first_stage_layers = 0;
    ends.last_stage_layers = 0;
    const StepResult e = simulate_step(net, m, flat), u = simulate_step(net, m, ends);
    const double layer = gpt_layer_parameters_per_rank(m, 1);
    const double first_stage = 8 * layer + 51200.0 * 4096 + 2048.0 * 4096;  // (even: 8 layers and the embeddings)
    EXPECT_NEAR(u.breakdown.optimizer / e.breakdown.optimizer, 16 * layer / first_stage, 0.01);
    EXPECT_NEAR(u.breakdown.dp_comm / e.breakdown.dp_comm, 16 * layer / first_stage, 0.03);
    EXPECT_NEAR(u.breakdown.dp_exposed, u.breakdown.dp_comm, 1e-12);
    // Two stages, the last with 30 layers and the output layer's copy of the word embeddings: its exchange.
    ParallelConfig two = cfg(1, 2, 1, 64);
    two.dp_overlap = false;
    two.first_stage_layers = 2;
    const StepResult t2 = simulate_step(net, m, two);
    EXPECT_NEAR(t2.breakdown.optimizer / e.breakdown.optimizer, (30 * layer + 51200.0 * 4096) / first_stage, 0.01);
    // (the first stage is the slowest there: its bubble, from the play-out, is not below 0 by a rounding)
    EXPECT_GE(t2.breakdown.bubble, 0.0);
  }
  // One end given: the other stages share the rest (32 - 5 = 27 over 3).
  ParallelConfig one = even;
  one.first_stage_layers = 5;
  const StageLayers so = stage_layers(m, one);
  EXPECT_EQ(std::tuple(so.first, so.middle, so.last), std::tuple(5, 9, 9));
  // BLOOM-176B's split (Megatron-DeepSpeed's partition_method type:transformer|embedding).
  ParallelConfig bloom = cfg(4, 12, 2, 2048);
  bloom.first_stage_layers = 5;
  bloom.last_stage_layers = 5;
  const StageLayers sb = stage_layers(gpt(70, 14336, 112, 2048, 250880), bloom);
  EXPECT_EQ(std::tuple(sb.first, sb.middle, sb.last), std::tuple(5, 6, 5));
  EXPECT_THROW(stage_layers(gpt(70, 14336, 112, 2048, 250880), cfg(4, 12, 2, 2048)), ConfigError);
}

// The planner tries pipeline sizes that do not divide the layers, first with the uneven split BLOOM ran (the middle
// stages ceil(l / p), the ends the rest), then others its second pass finds faster: a 30-layer model on 4 stages (it
// searched only p = 1, 2, 3, 5, 6, ... of them), where 8, 8, 8, 6 beats BLOOM's 7, 8, 8, 7 (the last stage's output
// layer is two layers' work at a vocabulary of 51200 over a hidden size of 2048).
TEST(Plan, PipelineSizesThatDoNotDivideTheLayersAreSplitUnevenly) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = gpt(30, 2048, 16);
  PlanSpace space;
  space.tp = {1};
  space.pp = {4};
  space.micro_batch = {1};
  space.zero = {0};
  space.recompute = {Recompute::kFull};
  space.sequence_parallel = {false};
  const PlanResult pr = plan(net, m, 256, space, 5);
  ASSERT_FALSE(pr.ranked.empty()) << pr.first_error;
  for (const StepResult& r : pr.ranked) {
    EXPECT_EQ(r.config.pp, 4);
    EXPECT_EQ(r.stage_layers.first + 2 * r.stage_layers.middle + r.stage_layers.last, 30);
    EXPECT_TRUE(r.stage_layers.uneven);
    EXPECT_NE(r.config.schedule, Schedule::kInterleaved);
    EXPECT_DOUBLE_EQ(r.time, simulate_step(net, m, r.config).time);
  }
  EXPECT_NE(describe_config(pr.ranked[0].config).find("first-stage-layers=8 last-stage-layers=6"), std::string::npos)
      << describe_config(pr.ranked[0].config);
  // 31 layers: 8 on each middle stage, the last (with the output layer) the smaller half of the rest (8 and 7: 9%
  // faster than 7 and 8), the first pass's split; 10 on 8 stages: the first pass's a layer each in the middle (2 each
  // would leave the ends -2) and 2 on each end, the second's 3 on the first and 1 on the last (the output layer's
  // stage the lighter).
  for (auto [layers, p, first, last, first_pass] :
       {std::tuple{31, 4, 8, 7, std::pair{8, 7}}, std::tuple{10, 8, 3, 1, std::pair{2, 2}},
        std::tuple{30, 4, 8, 6, std::pair{7, 7}}}) {
    SCOPED_TRACE(fmt::format("{} on {}", layers, p));
    space.pp = {p};
    const GptModel g = gpt(layers, 2048, 16);
    const PlanResult q = plan(net, g, 256, space, 1);
    ASSERT_FALSE(q.ranked.empty()) << q.first_error;
    ParallelConfig c = q.ranked[0].config;
    EXPECT_EQ(std::pair(c.first_stage_layers, c.last_stage_layers), std::pair(first, last));
    EXPECT_EQ(q.resplit > 0, first_pass != std::pair(first, last));
    std::tie(c.first_stage_layers, c.last_stage_layers) = first_pass;
    EXPECT_LE(q.ranked[0].time, simulate_step(net, g, c).time);
  }
  // Equal schedules summed in different orders (GPipe's closed form, 1F1B's play-out) differ in their last bits: they
  // tie, and the one with less memory ranks first (a GPipe plan of 67.6 GB ranked above its 20.8 GB 1F1B twin, and
  // the explanation called them tied "by name").
  PlanSpace searched;
  searched.tp = {1};
  searched.pp = {4};
  searched.zero = {0};
  const PlanResult wide = plan(net, m, 256, searched, 5000);
  for (size_t i = 0; i + 1 < wide.ranked.size(); ++i) {
    const StepResult &a = wide.ranked[i], &b = wide.ranked[i + 1];
    if (ranking_time(a.time) == ranking_time(b.time)) {
      EXPECT_LE(a.memory.total(), b.memory.total()) << describe_config(a.config) << " / " << describe_config(b.config);
    }
  }
  EXPECT_EQ(ranking_time(1.0 + 1e-13), 1.0);
  EXPECT_LT(ranking_time(1.0), ranking_time(1.0 + 1e-8));
  // The order itself: a time one ulp faster but 3x the memory ranks second, and the explanation says why.
  StepResult lean = wide.ranked[0], heavy = wide.ranked[0];
  lean.time = 1.0;
  heavy.time = std::nextafter(1.0, 0.0);
  lean.memory = {1e9, 0, 0, 0};
  heavy.memory = {3e9, 0, 0, 0};
  EXPECT_TRUE(ranks_before(lean, heavy));
  EXPECT_FALSE(ranks_before(heavy, lean));
  heavy.time = 1.0 - 1e-6;  // (a real difference still wins)
  EXPECT_TRUE(ranks_before(heavy, lean));
  heavy.time = std::nextafter(1.0, 0.0);
  heavy.config.micro_batch = lean.config.micro_batch + 1;
  const auto why = explain_plan(lean, &heavy);
  ASSERT_EQ(why.size(), 3u);
  EXPECT_NE(why[2].find("ties with the next plan (" + describe_config(heavy.config) +
                        "): the same predicted time, ranked first by its smaller memory"),
            std::string::npos)
      << why[2];
  // More stages than layers allow (a middle stage with none): skipped naming that (it named flags sim plan lacks).
  space.pp = {40};
  Topology big(load_cluster("dgx-a100"), 40);
  CollectiveModel big_net(big);
  const PlanResult none = plan(big_net, m, 40, space, 1);
  EXPECT_TRUE(none.ranked.empty());
  EXPECT_EQ(none.first_error, "pp (40) leaves a pipeline stage without layers: the model has 30");
}

// Every split of `m`'s layers over the pipeline of `c` (the first's, each middle one's and the last's counts), each
// simulated: the fastest that fits, as the ranking orders them.
StepResult fastest_split(CollectiveModel& net, const GptModel& m, ParallelConfig c) {
  StepResult best;
  bool any = false;
  const int p = c.pp;
  for (int middle = p > 2 ? 1 : 0; (p - 2) * middle <= m.layers && (p > 2 || middle == 0); ++middle) {
    const int rest = m.layers - (p - 2) * middle;
    for (int last = 0; last <= rest; ++last) {
      c.first_stage_layers = rest - last;
      c.last_stage_layers = last;
      const StepResult r = simulate_step(net, m, c);
      if (r.fits && (!any || ranks_before(r, best))) best = r, any = true;
    }
  }
  EXPECT_TRUE(any);
  return best;
}

// The planner's second pass splits a pipeline's layers otherwise where the plan's stage times say another split is
// faster: a vocabulary of 256k over a hidden size of 2048 (Gemma's) puts several layers' work on the last stage, which
// then runs fewer layers than the others (7-16% faster than 32 layers evenly on 2 or 4 stages). The split it finds is
// the fastest of every split, each simulated (1F1B and GPipe, 2 and 4 stages), to 0.1%; with a small vocabulary the
// even split is the fastest, and the pass leaves it.
TEST(Plan, ASecondPassGivesAStageWithALargeOutputLayerFewerLayers) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  PlanSpace space;
  space.tp = {4};
  space.micro_batch = {1};
  space.zero = {0};
  space.recompute = {Recompute::kFull};
  space.sequence_parallel = {false};
  for (Schedule sched : {Schedule::k1F1B, Schedule::kGpipe}) {
    for (int p : {2, 4}) {
      SCOPED_TRACE(fmt::format("{} pp {}", schedule_name(sched), p));
      space.pp = {p};
      space.schedules = {sched};
      const GptModel m = gpt(32, 2048, 16, 2048, 256000);
      const PlanResult pr = plan(net, m, 256, space, 1);
      ASSERT_EQ(pr.ranked.size(), 1u) << pr.first_error;
      const StepResult& got = pr.ranked[0];
      EXPECT_EQ(pr.resplit, 1);
      EXPECT_LT(got.config.last_stage_layers, 32 / p);
      EXPECT_DOUBLE_EQ(got.time, simulate_step(net, m, got.config).time);
      ParallelConfig even = got.config;
      even.first_stage_layers = even.last_stage_layers = -1;
      EXPECT_LT(got.time, 0.95 * simulate_step(net, m, even).time) << describe_config(got.config);
      // (the estimate leaves out the data-parallel exchange, which follows the stage with the most parameters: GPipe
      // on 4 stages found 8, 8, 8, 6, 0.03% slower than 7, 9, 9, 7)
      const StepResult best = fastest_split(net, m, got.config);
      EXPECT_LE(got.time, 1.001 * best.time) << describe_config(got.config) << " / " << describe_config(best.config);
      const GptModel small = gpt(32, 2048, 16, 2048, 1024);
      const PlanResult kept = plan(net, small, 256, space, 1);
      ASSERT_EQ(kept.ranked.size(), 1u) << kept.first_error;
      EXPECT_EQ(kept.resplit, 0);
      EXPECT_EQ(std::pair(kept.ranked[0].config.first_stage_layers, kept.ranked[0].config.last_stage_layers),
                std::pair(-1, -1));
      EXPECT_EQ(ranking_time(kept.ranked[0].time), ranking_time(fastest_split(net, small, kept.ranked[0].config).time));
    }
  }
  // 8 stages, no recompute, tp 1 (a review's cases): an output layer of about 8 layers' work wants the last stage
  // empty (4, 6 x 6, 0: the search's range around the first and last stages' crossing lay below 0, 9.7% slower), and
  // GPipe's best that fits needs a split the estimate ranks below two that do not fit (10.1% slower).
  space.tp = {1};
  space.pp = {8};
  space.recompute = {Recompute::kNone};
  for (auto [layers, hidden, sched] : {std::tuple{40, 1024, Schedule::k1F1B}, std::tuple{39, 2048, Schedule::k1F1B},
                                       std::tuple{26, 1024, Schedule::kGpipe}}) {
    SCOPED_TRACE(fmt::format("{} layers, hidden {}, {}", layers, hidden, schedule_name(sched)));
    space.schedules = {sched};
    const GptModel m = gpt(layers, hidden, 16, 2048, 256000);
    const PlanResult pr = plan(net, m, 256, space, 1);
    ASSERT_EQ(pr.ranked.size(), 1u) << pr.first_error;
    const StepResult best = fastest_split(net, m, pr.ranked[0].config);
    EXPECT_LE(pr.ranked[0].time, 1.001 * best.time)
        << describe_config(pr.ranked[0].config) << " / " << describe_config(best.config);
  }
}

// A pipeline that does not fit as the first pass splits it, but does with fewer layers on the stage that holds the
// most (1F1B's first, with p micro-batches in flight, against the last's one), is a plan now: it was dropped, and a
// search fixed to it found none. The split found is the fastest of every split that fits, each simulated, to 0.1%; a
// stage's memory is linear in its layers (StepResult.stage_memory, which the search reads), and a plan whose stages
// cannot fit under any split (a batch twice as large) is still refused.
TEST(Plan, APipelineThatFitsOnlyWithAnotherSplitIsPlanned) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = gpt(64, 4096, 32, 2048, 51200);
  PlanSpace space;
  space.tp = {4};
  space.pp = {4};
  space.micro_batch = {4};
  space.zero = {0};
  space.recompute = {Recompute::kNone};
  space.sequence_parallel = {false};
  space.schedules = {Schedule::k1F1B};
  const PlanResult pr = plan(net, m, 256, space, 1);
  ASSERT_EQ(pr.ranked.size(), 1u) << pr.first_error;
  EXPECT_EQ(pr.refit, 1);
  const StepResult& got = pr.ranked[0];
  EXPECT_TRUE(got.fits);
  EXPECT_TRUE(got.stage_layers.uneven);
  EXPECT_LT(got.stage_layers.first, 16);
  EXPECT_DOUBLE_EQ(got.time, simulate_step(net, m, got.config).time);
  ParallelConfig even = got.config;
  even.first_stage_layers = even.last_stage_layers = -1;
  const StepResult e = simulate_step(net, m, even);
  EXPECT_FALSE(e.fits);
  const StepResult best = fastest_split(net, m, got.config);
  EXPECT_LE(got.time, 1.001 * best.time) << describe_config(got.config) << " / " << describe_config(best.config);
  // The stages' memory, linear in their layers: 14, 17, 17, 16 from 16 x 4.
  ParallelConfig moved = even;
  moved.first_stage_layers = 14;
  moved.last_stage_layers = 16;
  const StepResult mv = simulate_step(net, m, moved);
  const StageMemory &a = e.stage_memory, &b = mv.stage_memory;
  EXPECT_NEAR(b.first, a.first - 2 * a.first_layer, 1e-9 * a.first);
  EXPECT_NEAR(b.second, a.second + a.second_layer, 1e-9 * a.second);
  EXPECT_NEAR(b.last, a.last, 1e-9 * a.last);
  EXPECT_NEAR(std::max({a.first, a.second, a.last}), e.memory.total(), 1e-9 * e.memory.total());
  EXPECT_NEAR(std::max({b.first, b.second, b.last}), mv.memory.total(), 1e-9 * mv.memory.total());
  EXPECT_GT(a.first_layer, a.second_layer);  // (one micro-batch more in flight)
  // The second pass looks within the splits that fit too: 18 layers with a 256k vocabulary on 4 stages, where the
  // estimate's fastest split of each middle count does not fit and one that fits is 14% faster than the even split (a
  // review: the plan kept 4, 5, 5, 4 at 3.950 s; 4, 6, 6, 2 takes 3.409 s).
  {
    Topology eight(load_cluster("dgx-a100"), 8);
    CollectiveModel eight_net(eight);
    const GptModel big_vocab = gpt(18, 2048, 8, 4096, 256000);
    PlanSpace s2 = space;
    s2.tp = {1};
    const PlanResult q = plan(eight_net, big_vocab, 64, s2, 1);
    ASSERT_EQ(q.ranked.size(), 1u) << q.first_error;
    const StepResult fastest = fastest_split(eight_net, big_vocab, q.ranked[0].config);
    EXPECT_LE(q.ranked[0].time, 1.001 * fastest.time)
        << describe_config(q.ranked[0].config) << " / " << describe_config(fastest.config);
    EXPECT_TRUE(q.ranked[0].fits);
  }
  // No split fits micro-batches of 8: no plan, and the nearest named.
  space.micro_batch = {8};
  const PlanResult none = plan(net, m, 256, space, 1);
  EXPECT_TRUE(none.ranked.empty());
  EXPECT_EQ(none.refit, 0);
  EXPECT_TRUE(none.any_oom);
}

TEST(Step, ThroughputAndMemoryAreSane) {
  Topology topo(load_cluster("dgx-a100"), 128);
  CollectiveModel net(topo);
  GptModel m = gpt(36, 4096, 32);  // 7.5B, table 1 row 3
  ParallelConfig c = cfg(4, 1, 1, 512);
  c.recompute = Recompute::kFull;
  StepResult r = simulate_step(net, m, c);
  EXPECT_GT(r.hardware_tflops_per_gpu, 50);
  EXPECT_LT(r.hardware_tflops_per_gpu, 312 * 0.8);
  EXPECT_TRUE(r.fits);
  EXPECT_NEAR(r.hardware_flops, megatron_flops_formula(m, 512, true), 1e-6 * r.hardware_flops);
  // ZeRO stages shrink the model state monotonically.
  double prev = 1e300;
  for (int z = 0; z <= 3; ++z) {
    c.zero = z;
    StepResult rz = simulate_step(net, m, c);
    double state = rz.memory.params + rz.memory.grads + rz.memory.optimizer;
    EXPECT_LT(state, prev);
    prev = state;
  }
}

TEST(Step, SymmetricAndFullDetailStepsAgree) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(16, 2048, 16, 1024, 32000);
  ParallelConfig c = cfg(4, 2, 1, 64);
  StepResult sym = simulate_step(net, m, c);
  c.mode = EvalMode::kFull;
  StepResult full = simulate_step(net, m, c);
  EXPECT_LT(rel(sym.time, full.time), 1e-6);
}

// Compute that hides collectives runs on the SMs their kernels leave (comm_sms of sm_count): the step ends no
// earlier than its compute stretched by comm_sms / sm_count of the hidden time, nor than it ended before. The FSDP
// paper's GPT-175B with ZeRO-3 on 128 A100s hides most of its gathers and reduce-scatters behind the compute; an
// exchange after the backward (--no-overlap) hides nothing; a network slow enough that the compute waits on it longer
// than the stretch absorbs it.
TEST(Step, ComputeThatHidesCollectivesRunsOnTheSmsTheyLeave) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  ASSERT_EQ(spec.node_kinds[0].accelerator.comm_sms, 16);
  ASSERT_EQ(spec.node_kinds[0].accelerator.sm_count, 108);
  ClusterSpec none = spec;
  none.node_kinds[0].accelerator.comm_sms = 0;
  auto step = [](const ClusterSpec& s, const ParallelConfig& c) {
    Topology topo(s, 128);
    CollectiveModel net(topo);
    return simulate_step(net, gpt(96, 12288, 96, 2048, 50000), c);
  };
  ParallelConfig c = cfg(1, 1, 1, 128);
  c.zero = 3;
  c.recompute = Recompute::kFull;
  const StepResult with = step(spec, c), without = step(none, c);
  const StepBreakdown& b = without.breakdown;
  const double waited = b.dp_exposed - b.compression + b.zero3_exposed;
  const double hidden = std::min(b.dp_comm - waited, b.compute);
  ASSERT_GT(hidden, 0.5 * b.compute);
  EXPECT_EQ(b.overlap_slowdown, 0);
  EXPECT_NEAR(with.breakdown.overlap_slowdown, 16.0 / 108 * hidden - waited, 1e-9 * with.time);
  EXPECT_GT(with.breakdown.overlap_slowdown, 0.05 * without.time);
  EXPECT_NEAR(with.time, without.time + with.breakdown.overlap_slowdown, 1e-9 * with.time);
  EXPECT_DOUBLE_EQ(with.breakdown.compute, b.compute);
  EXPECT_DOUBLE_EQ(with.breakdown.dp_comm, b.dp_comm);
  EXPECT_NE(with.notes.back().find(
                "holds 14.8% of the SMs (comm_sms / sm_count): the compute it overlaps runs that much slower"),
            std::string::npos)
      << with.notes.back();

  ParallelConfig after = cfg(1, 1, 1, 128);
  after.recompute = Recompute::kFull;
  after.dp_overlap = false;
  const StepResult a = step(spec, after);
  EXPECT_GT(a.breakdown.dp_comm, 0);
  EXPECT_EQ(a.breakdown.overlap_slowdown, 0);
  EXPECT_DOUBLE_EQ(a.time, step(none, after).time);

  ClusterSpec slow = spec;
  slow.node_kinds[0].nic.bandwidth /= 100;
  const StepResult s = step(slow, c);
  ASSERT_GT(s.breakdown.zero3_exposed + s.breakdown.dp_exposed, 16.0 / 108 * s.breakdown.compute);
  EXPECT_EQ(s.breakdown.overlap_slowdown, 0);
}

// Layer-list models: a pipeline's stages stretch their last backward beside their buckets' collectives as a step of
// one stage does (it had no such term); the wait for the slowest rank is not slack for the stretch (the slowest
// rank's own compute is stretched too: a longer wait made the step shorter, 71.29 against 71.59 ms).
TEST(Step, LayerModelsStretchTheComputeBesideTheirCollectivesToo) {
  std::string layers = "dense:8192x8192";
  for (int i = 1; i < 8; ++i) layers += ",dense:8192x8192";
  auto step = [&](int pp, double wait) {
    ClusterSpec spec = load_cluster("dgx-a100");
    if (wait > 0) {
      ModelStepSample s;
      s.layers = layers;
      s.batch = 4096;
      s.quantiles = {0.020, 0.021};
      s.wait_ranks = 64;
      s.slowest_wait = wait;
      spec.node_kinds[0].accelerator.model_calibration.push_back(s);
    }
    Topology topo(spec, 64);
    CollectiveModel net(topo);
    ParallelConfig c;
    c.global_batch = 64 * 4096;
    c.micro_batch = 4096;
    c.pp = pp;
    return simulate_layer_step(net, parse_layer_model(layers), c);
  };
  const StepResult one = step(1, 0), two = step(2, 0);
  EXPECT_GT(one.breakdown.overlap_slowdown, 0);
  EXPECT_GT(two.breakdown.overlap_slowdown, 0);
  EXPECT_NEAR(two.time,
              two.breakdown.compute + two.breakdown.bubble + two.breakdown.dp_exposed + two.breakdown.overlap_slowdown +
                  two.breakdown.optimizer,
              1e-9 * two.time);
  const StepResult short_wait = step(1, 0.0005), long_wait = step(1, 0.002);
  ASSERT_GT(long_wait.breakdown.rank_wait, short_wait.breakdown.rank_wait);
  EXPECT_GT(long_wait.time, short_wait.time);
  EXPECT_NEAR(long_wait.breakdown.overlap_slowdown, short_wait.breakdown.overlap_slowdown, 1e-9 * long_wait.time);
}

TEST(Step, CompressionAndLocalSgdReduceExposedCommunication) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(12, 768, 12, 1024, 50304);  // GPT-2 small
  ParallelConfig c = cfg(1, 1, 8, 512);
  StepResult base = simulate_step(net, m, c);
  // int8 as the runtime sends it without ZeRO: every rank's blocks allgathered (64 x 1.016 bytes an element per
  // rank against a ring's 2 x 2): slower than the uncompressed ring at 64 ranks (it was a 1-byte ring: 0.6x).
  c.compression = parse_compression("int8");
  StepResult q = simulate_step(net, m, c);
  EXPECT_GT(q.breakdown.dp_comm, base.breakdown.dp_comm * 5);
  // top-k allgathers every rank's kept elements, 8 bytes each: at 0.1% (64 x 0.008 bytes an element received) it
  // sends less than the ring's 2 x 2, at 1% (5.1) more.
  c.compression = parse_compression("topk:0.001");
  EXPECT_LT(simulate_step(net, m, c).breakdown.dp_comm, base.breakdown.dp_comm);
  c.compression = parse_compression("topk:0.01");
  EXPECT_GT(simulate_step(net, m, c).breakdown.dp_comm, base.breakdown.dp_comm);
  c.compression = parse_compression("powersgd:4");
  StepResult ps = simulate_step(net, m, c);
  EXPECT_LT(ps.breakdown.dp_comm, base.breakdown.dp_comm);
  // PowerSGD's factors never outgrow a matrix: at rank 384 (over half of 768) the layers' matrices go raw in fp16,
  // about the uncompressed exchange (it charged r (n + m) fp16 factors each: 0.6x of it).
  c.compression = parse_compression("powersgd:384");
  const double raw = simulate_step(net, m, c).breakdown.dp_comm;
  EXPECT_GT(raw, 0.8 * base.breakdown.dp_comm);
  EXPECT_LT(raw, 1.2 * base.breakdown.dp_comm);
  // Local SGD averages the f32 parameters in one allreduce after the step, nothing hidden behind the backward: 1/8
  // of one unhidden exchange of 4-byte elements (it was 1/8 of the bucketed 2-byte gradients' exposed part).
  c.compression = parse_compression("none");
  c.dp_overlap = false;
  c.grad_bytes = 4;
  c.bucket_bytes = 1e15;
  const StepResult unhidden = simulate_step(net, m, c);
  c.dp_overlap = true;
  c.grad_bytes = 2;
  c.bucket_bytes = 25 * 1048576.0;
  c.sync = parse_sync("local-sgd:8");
  StepResult ls = simulate_step(net, m, c);
  EXPECT_NEAR(ls.breakdown.dp_exposed, unhidden.breakdown.dp_exposed / 8, 1e-9 * unhidden.breakdown.dp_exposed);
  c.dp_overlap = false;  // (local SGD's one call after the step overlaps nothing: the flag changed nothing)
  EXPECT_THROW(simulate_step(net, m, c), ConfigError);
  c.dp_overlap = true;
  c.compression = parse_compression("int8");  // (the trainer takes no compressor with local SGD)
  EXPECT_THROW(simulate_step(net, m, c), ConfigError);
  // A layer list the same way (it hid the exchange behind the backward: 10.51 ms exposed against 10.55 unhidden).
  const LayerModel lm = parse_layer_model("dense:4096x4096,dense:4096x4096,dense:4096x4096,dense:4096x10");
  ParallelConfig l;
  l.global_batch = 256;
  l.grad_bytes = 4;
  l.dp_overlap = false;
  l.bucket_bytes = 1e15;
  const double unhidden_layers = simulate_layer_step(net, lm, l).breakdown.dp_exposed;
  l.dp_overlap = true;
  l.bucket_bytes = 25 * 1048576.0;
  l.sync = parse_sync("local-sgd:8");
  EXPECT_NEAR(simulate_layer_step(net, lm, l).breakdown.dp_exposed, unhidden_layers / 8, 1e-9 * unhidden_layers);
  c.compression = parse_compression("int4");
  c.sync = parse_sync("bsp");
  EXPECT_THROW(simulate_step(net, m, c), ConfigError);  // (int4 is ZeRO's wire: the runtime refuses it at ZeRO 0)
  EXPECT_THROW(parse_compression("topk:2"), ConfigError);
  EXPECT_THROW(parse_sync("local-sgd:0"), ConfigError);
}

TEST(Step, BadConfigurationsNameTheFlag) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(32, 4096, 32);
  auto expect_msg = [&](ParallelConfig c, const char* needle) {
    try {
      simulate_step(net, m, c);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_msg(cfg(3, 1, 1, 64), "--tp");
  expect_msg(cfg(8, 3, 1, 64), "--tp");
  expect_msg(cfg(8, 1, 3, 64), "--global-batch");
  ParallelConfig c = cfg(8, 2, 1, 64);
  c.zero = 3;
  expect_msg(c, "--zero");
  c = cfg(8, 2, 1, 64);
  c.schedule = Schedule::kInterleaved;
  expect_msg(c, "--virtual-stages");
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

TEST(LayerModel, ParsesAndScalesWithDataParallelism) {
  LayerModel m = parse_layer_model("conv:3x64k3@32x32, conv:64x128k3@16x16, dense:32768x1024, dense:1024x10");
  EXPECT_EQ(m.layers.size(), 4u);
  EXPECT_DOUBLE_EQ(m.layers[0].params(), 3 * 64 * 9 + 64);
  // Implicit GEMM of a convolution: M = batch*H*W, N = out channels, K = in channels * k * k.
  GemmShape g = m.layers[1].forward_gemm(8);
  EXPECT_DOUBLE_EQ(g.m, 8 * 16 * 16);
  EXPECT_DOUBLE_EQ(g.n, 128);
  EXPECT_DOUBLE_EQ(g.k, 64 * 9);
  Topology one(load_cluster("ethernet-25g"), 4), many(load_cluster("ethernet-25g"), 64);
  CollectiveModel n1(one), n2(many);
  ParallelConfig c;
  c.micro_batch = 32;
  c.global_batch = 32 * 64;
  StepResult a = simulate_layer_step(n2, m, c);
  c.global_batch = 32 * 4;
  StepResult b = simulate_layer_step(n1, m, c);
  EXPECT_GT(a.breakdown.dp_comm, b.breakdown.dp_comm);           // 16 nodes over 25 GbE vs one PCIe server
  EXPECT_NEAR(a.breakdown.compute, b.breakdown.compute, 1e-12);  // same work per GPU
  EXPECT_THROW(parse_layer_model("dense:10"), ConfigError);
  c.tp = 2;
  EXPECT_THROW(simulate_layer_step(n1, m, c), ConfigError);
}

// Layers that do not connect are refused with one line naming the layer (dense:10x20,dense:50x5 was simulated); the
// train models' lists connect. The FLOPs a step counts leave out the first layer's input gradient, as its time does
// (three forwards a layer gave one large convolution an MFU of 119%).
TEST(LayerModel, LayersConnectAndTheFirstComputesNoInputGradient) {
  for (const auto& [spec, want] : std::vector<std::pair<std::string, std::string>>{
           {"dense:10x20,dense:50x5", "layer 2 (dense:50x5) takes 50 features where the one before gives 20"},
           {"conv:1x32k3@28x28,dense:6272x10",
            "layer 2 (dense:6272x10) takes 6272 features where the one before "
            "gives 25088"},
           {"conv:1x32k3@28x28,pool:32k2@14x14", "takes 32 channels of 14x14 where the one before gives 32 of 28x28"},
           {"conv:1x32k3@28x28,conv:16x8k3@28x28", "takes 16 channels of 28x28 where the one before gives 32 of"},
           {"dense:4x4,conv:4x4k3@2x2", "takes a map where the dense layer before gives flat features"}}) {
    try {
      parse_layer_model(spec);
      ADD_FAILURE() << spec << " was taken";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << spec << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("allowed: layers that connect"), std::string::npos) << e.what();
    }
  }
  for (const char* ok : {kTrainCnnLayers, kTrainMlpLayers, "conv:1x32k3@28x28,pool:32k2@28x28,dense:6272x10",
                         "conv:3x64k3@32x32,conv:64x128k3@16x16"})
    EXPECT_NO_THROW(parse_layer_model(ok)) << ok;
  Topology t(load_cluster("dgx-a100"), 8);
  CollectiveModel net(t);
  ParallelConfig c;
  c.global_batch = 8;
  const LayerModel one = parse_layer_model("conv:10000x10000k3@1000x1000");
  const StepResult r = simulate_layer_step(net, one, c);
  EXPECT_DOUBLE_EQ(r.model_flops, 8 * 2 * one.layers[0].forward_gemm(1).flops());
  EXPECT_LT(r.mfu, 1.0);
  const LayerModel two = parse_layer_model("dense:784x256,dense:256x10");
  EXPECT_DOUBLE_EQ(simulate_layer_step(net, two, c).model_flops,
                   8 * (2 * two.layers[0].forward_gemm(1).flops() + 3 * two.layers[1].forward_gemm(1).flops()));
}

}  // namespace
}  // namespace conduit::sim
