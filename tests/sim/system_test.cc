// Planner, inference, cluster scheduling, presets, scale, and the `conduit sim` command line.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <tuple>

#include "core/error.h"
#include "run_cli.h"
#include "sim/cluster.h"
#include "sim/inference.h"
#include "sim/plan.h"
#include "sim/scheduler.h"
#include "sim/step.h"

namespace conduit::sim {
namespace {

// CPU time of the calling thread (the simulator is single-threaded): the speed goals of this file hold for this
// thread's work, whatever else ctest -j2 runs beside it on the two cores (wall time was 0.39 s alone, more under load).
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

using test_util::error_of;

GptModel named(const char* n) {
  GptModel m;
  EXPECT_TRUE(named_gpt(n, m));
  return m;
}

TEST(Presets, AllParseAndTheFilesMatchTheEmbeddedText) {
  for (const auto& name : preset_names()) {
    ClusterSpec s = load_cluster(name);
    EXPECT_EQ(s.name, name);
    EXPECT_GT(s.node_kinds.front().accelerator.peak_flops, 1e12);
    std::ifstream in(std::string(CONDUIT_SOURCE_DIR) + "/configs/clusters/" + name + ".yaml");
    ASSERT_TRUE(in) << name;
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, preset_yaml(name)) << "rebuild after editing configs/clusters/" << name << ".yaml";
  }
  EXPECT_EQ(preset_names().size(), 4u);
}

TEST(Presets, BadFilesNameTheField) {
  auto msg = [](const std::string& yaml) {
    try {
      parse_cluster_yaml(yaml, "x.yaml");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string good = preset_yaml("dgx-a100");
  std::string bad_unit = good;
  bad_unit.replace(bad_unit.find("bandwidth: 200 Gb/s"), 19, "bandwidth: 200 Gbps");
  EXPECT_NE(msg(bad_unit).find("nodes[0].nic.bandwidth"), std::string::npos) << msg(bad_unit);
  std::string bad_topo = good;
  bad_topo.replace(bad_topo.find("rail-optimized  "), 14, "dragonfly-plus");
  EXPECT_NE(msg(bad_topo).find("network.topology"), std::string::npos) << msg(bad_topo);
  EXPECT_NE(msg("nodes: []\n").find("nodes"), std::string::npos);
  EXPECT_NE(msg("{").find("not valid YAML"), std::string::npos);
  EXPECT_THROW(load_cluster("no-such-preset"), ConfigError);
}

GptModel gpt_layers_even(GptModel m) {
  m.layers = 12;
  return m;
}

TEST(Presets, HeterogeneousEdgeScalesKindsProportionally) {
  Topology t(load_cluster("edge"), 32);
  EXPECT_EQ(t.kind_counts()[0], 8);
  EXPECT_EQ(t.kind_counts()[1], 24);
  CollectiveModel net(t);
  GptModel m = named("gpt2-small");
  ParallelConfig c;
  c.global_batch = 64;
  c.micro_batch = 2;
  StepResult r = simulate_step(net, m, c);
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.front().find("Orin-Nano"), std::string::npos);  // the slow kind bounds the step
  // Shares proportional to speed: 8 fast + 24 slow devices finish together, faster than equal shares, and
  // exactly (global micro-batches) / (sum of per-device rates).
  c.balance = true;
  StepResult bal = simulate_step(net, m, c);
  EXPECT_LT(bal.breakdown.compute, r.breakdown.compute);
  const double slow_mb = r.breakdown.compute / r.microbatches;  // per micro-batch on an Orin Nano
  // Per micro-batch on an AGX Orin: the fast kind's 8 devices alone.
  ClusterSpec fast_only = load_cluster("edge");
  fast_only.node_kinds.resize(1);
  Topology ft(fast_only, 8);
  CollectiveModel fnet(ft);
  ParallelConfig fc = c;
  fc.balance = false;
  fc.global_batch = 16;
  StepResult f = simulate_step(fnet, m, fc);
  const double fast_mb = f.breakdown.compute / f.microbatches;
  ASSERT_LT(fast_mb, slow_mb);
  EXPECT_NEAR(bal.breakdown.compute, (64.0 / 2) / (8 / fast_mb + 24 / slow_mb), 1e-9 * bal.breakdown.compute);
  // MFU against the peak of the devices in use, averaged over them (the slow kind's peak gave the whole cluster's
  // FLOP/s against 32 Orin Nanos', over 100% with a kind fast enough).
  const ClusterSpec edge = load_cluster("edge");
  const double mean_peak =
      (8 * edge.node_kinds[0].accelerator.peak_flops + 24 * edge.node_kinds[1].accelerator.peak_flops) / 32;
  EXPECT_NEAR(bal.mfu, bal.model_tflops_per_gpu * 1e12 / mean_peak, 1e-9 * bal.mfu);
  EXPECT_LT(bal.mfu, 1.0);
  c.tp = 1;
  c.pp = 2;
  EXPECT_THROW(simulate_step(net, gpt_layers_even(m), c), ConfigError);
}

// With pipeline stages, the word embeddings' gradients (tied to the output layer on the last stage) are allreduced
// between the first and the last stage after the backward pass, even without data parallelism (it was not charged).
TEST(Step, PipelinesExchangeTheTiedEmbeddingGradients) {
  Topology topo(load_cluster("dgx-a100"), 16);
  CollectiveModel net(topo);
  GptModel m = named("gpt-7.5b");
  ParallelConfig c;
  c.tp = 8;
  c.global_batch = 16;
  c.pp = 2;  // d = 1
  StepResult two = simulate_step(net, m, c);
  const double eb = double(m.vocab) * m.hidden / c.tp * c.grad_bytes;
  const Group pg{2, 8, 0};
  auto sync_of = [&](CollectiveModel& n) { return n.time(Collective::kShift, Algorithm::kDirect, pg, eb); };
  const double sync = sync_of(net);
  EXPECT_NEAR(two.breakdown.embedding_sync, sync, 1e-12);
  EXPECT_GT(sync, 0);
  EXPECT_EQ(two.breakdown.dp_comm, 0);  // pipeline traffic of each replica, not a data-parallel exchange
  // Without data parallelism there is no scheme to choose (it was taken and ignored).
  c.sync = parse_sync("async");
  EXPECT_THROW(simulate_step(net, m, c), ConfigError);
  // Every step, whatever the data-parallel scheme (local SGD divided it, async hid it).
  Topology topo2(load_cluster("dgx-a100"), 32);
  CollectiveModel net2(topo2);
  c.global_batch = 32;
  for (const char* sync : {"bsp", "async", "local-sgd:4"}) {
    c.sync = parse_sync(sync);
    EXPECT_NEAR(simulate_step(net2, m, c).breakdown.embedding_sync, sync_of(net2), 1e-12) << sync;
  }
}

TEST(Step, ScheduleMemoryGpipeHoldsAllMicroBatches) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  GptModel m = named("gpt-7.5b");
  ParallelConfig c;
  c.tp = 4;
  c.pp = 4;
  c.global_batch = 64;  // d = 4, m = 16 micro-batches
  StepResult f1b = simulate_step(net, m, c);
  c.schedule = Schedule::kGpipe;
  StepResult gp = simulate_step(net, m, c);
  c.schedule = Schedule::kInterleaved;
  c.virtual_stages = 3;
  StepResult il = simulate_step(net, m, c);
  // GPipe keeps all 16 micro-batches' activations on every stage, so its last stage holds the most, with the fp32
  // logits of all 16 (it counted one: each stays until its micro-batch's backward); 1F1B keeps p = 4 on the first
  // stage, interleaved p (1 + (p-1)/(p v)).
  const double logits = 4.0 * c.micro_batch * m.seq * m.vocab / c.tp;
  EXPECT_NEAR(gp.memory.activations, 16.0 / 4 * f1b.memory.activations + 16 * logits, 1e-9 * gp.memory.activations);
  EXPECT_NEAR(il.memory.activations / f1b.memory.activations, 1 + 3.0 / 12, 1e-9);
  EXPECT_LT(il.breakdown.bubble, f1b.breakdown.bubble);
  EXPECT_DOUBLE_EQ(gp.time, f1b.time);  // same bubble; GPipe only costs memory
  // Interleaving never holds more than the m micro-batches there are: with m = p = 4 it holds what GPipe does on
  // the first stage (it reported p (1 + (p-1)/(p v)) = 5.5 micro-batches, more than exist).
  c.global_batch = 16;  // m = 4: interleaving's 4 (1 + 3/12) = 5 is capped at 4
  StepResult il4 = simulate_step(net, m, c);
  c.schedule = Schedule::k1F1B;
  c.virtual_stages = 1;
  StepResult f4 = simulate_step(net, m, c);
  EXPECT_NEAR(il4.memory.activations, f4.memory.activations, 1e-9 * f4.memory.activations);
}

// Tensor parallelism per micro-batch (no pipeline, no recompute): 2 allreduces of b s h a layer in the forward and 2
// in the backward, the vocab-parallel embedding's forward allreduce and the output layer's input-gradient one (they
// were not charged), and the cross entropy's 3 fp32 allreduces of b s.
TEST(Step, TensorParallelCommunicationCountsTheEmbeddingAndOutputLayer) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  GptModel m = named("gpt-7.5b");
  ParallelConfig c;
  c.tp = 8;
  c.global_batch = 4;  // 4 micro-batches of 1
  const StepResult r = simulate_step(net, m, c);
  const Group tg{8, 1, 0};
  const double act = 1.0 * m.seq * m.hidden * 2, ce = 1.0 * m.seq * 4;
  auto ar = [&](double n) { return net.profile(Collective::kAllReduce, c.tp_algorithm, tg, n).time(n); };
  EXPECT_NEAR(r.breakdown.tp_comm, 4 * ((4.0 * m.layers + 2) * ar(act) + 3 * ar(ce)), 1e-9 * r.breakdown.tp_comm);
}

// While a layer is recomputed it holds its full activations, of which the part it stored is counted already: under
// selective recompute that is all but the attention core (counting the whole layer again overcounted 34 sbh/t).
TEST(Step, RecomputeAddsOnlyWhatTheLayerDidNotStore) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  GptModel m = named("gpt-7.5b");
  ParallelConfig c;
  c.tp = 8;
  c.global_batch = 8;
  c.sequence_parallel = true;
  const double logits = 4.0 * c.micro_batch * m.seq * m.vocab / c.tp;
  for (Recompute rc : {Recompute::kSelective, Recompute::kFull}) {
    c.recompute = rc;
    const double stored = gpt_layer_activation_bytes(m, c.micro_batch, c.tp, true, rc);
    const double whole = gpt_layer_activation_bytes(m, c.micro_batch, c.tp, true, Recompute::kNone);
    const StepResult r = simulate_step(net, m, c);
    EXPECT_NEAR(r.memory.activations, m.layers * stored + (whole - stored) + logits, 1e-9 * r.memory.activations);
  }
}

// The attention kernels' steps: GPT 7.5B on one dgx-a100 node, tp 8, one micro-batch of two sequences.
class AttentionSteps : public ::testing::Test {
 protected:
  Topology topo{load_cluster("dgx-a100"), 8};
  CollectiveModel net{topo};
  GptModel m = named("gpt-7.5b");
  const Accelerator& acc = topo.spec().node_kinds[0].accelerator;
  ParallelConfig c = [] {
    ParallelConfig one_node;
    one_node.tp = 8;
    one_node.global_batch = 2;
    one_node.micro_batch = 2;
    return one_node;
  }();
};

// Eager attention (PyTorch's scale, mask, softmax and dropout, one kernel each: minGPT) scales and masks the b (a/t)
// s^2 scores in two more kernels than Megatron-LM's fused scale-mask-softmax, each a read and a write of 2-byte
// elements: the forward pays them, their backwards (the gradient scaled, and masked) as much, full recompute again.
TEST_F(AttentionSteps, EagerAttentionReadsAndWritesTheScoresTwiceMore) {
  for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    c.recompute = rc;
    c.attention = AttentionKernels::kFused;
    const StepResult fused = simulate_step(net, m, c);
    c.attention = AttentionKernels::kEager;
    const StepResult eager = simulate_step(net, m, c);
    const double passes = rc == Recompute::kNone ? 2 : 3;  // forward, backward, recompute (the core's, selective)
    const double bytes = 2.0 * 2 * 2 * c.micro_batch * (m.heads / c.tp) * double(m.seq) * double(m.seq);
    const double want =
        m.layers * passes * (bytes / (acc.memory_bandwidth * acc.memory_efficiency) + 2 * acc.kernel_overhead);
    EXPECT_NEAR(eager.breakdown.compute - fused.breakdown.compute, want, 1e-6 * want) << int(rc);
    EXPECT_GT(want, 0.01 * fused.breakdown.compute);
    EXPECT_EQ(eager.memory.activations, fused.memory.activations);  // (softmax output, dropout mask and output alike)
  }
}

// FlashAttention-2 runs the core (QK^T, softmax, AV, forward and backward) at the dgx-a100 preset's published rate for
// it: 140 TFLOP/s at 2048 tokens (Dao 2023, fig. 4c), its FLOPs counted as FlashAttention's benchmark counts them (4
// s^2 d a head forward, halved by the causal mask, the backward 2.5 times that) and split 73 : 63 between the passes;
// in place of the first version's GEMMs at the GEMM model's rate (the forward's, the backward's and its QK^T again).
// Everything else, memory too, as with FlashAttention's first version.
TEST_F(AttentionSteps, FlashAttention2RunsTheCoreAtItsPublishedRate) {
  const double head_dim = double(m.hidden) / m.heads;
  ASSERT_EQ(head_dim, 128);
  EXPECT_DOUBLE_EQ(flash_attention_rate(acc, "flash2", double(m.seq), head_dim), 140e12);  // (head dim 64's: nearest)
  double gemm_core_fwd = 0, gemm_core_bwd = 0;
  for (const auto& g : gpt_layer_gemms(m, c.micro_batch, c.tp))
    if (g.attention_core) {
      gemm_core_fwd += gemm_time(acc, g.shape);
      const GemmShape& s = g.shape;  // (the input and weight gradients' GEMMs)
      gemm_core_bwd += gemm_time(acc, {s.m, s.k, s.n, s.batch}) + gemm_time(acc, {s.k, s.n, s.m, s.batch});
    }
  ASSERT_GT(gemm_core_fwd, 0);
  const double flops = 2.0 * c.micro_batch * (m.heads / c.tp) * double(m.seq) * double(m.seq) * head_dim;
  const double r_fwd = 140e12 * (1 + 2.5 * 73 / 63) / 3.5;
  for (Recompute rc : {Recompute::kNone, Recompute::kFull}) {
    c.recompute = rc;
    c.attention = AttentionKernels::kFlash;
    const StepResult flash = simulate_step(net, m, c);
    c.attention = AttentionKernels::kFlash2;
    const StepResult flash2 = simulate_step(net, m, c);
    const bool again = rc == Recompute::kFull;  // (full recompute runs the forward's core once more)
    const double first = gemm_core_fwd * (again ? 2 : 1) + gemm_core_bwd + gemm_core_fwd / 2;
    const double second = 3.5 * flops / 140e12 + (again ? flops / r_fwd : 0);
    EXPECT_NEAR(flash.breakdown.compute - flash2.breakdown.compute, m.layers * (first - second),
                1e-6 * flash.breakdown.compute)
        << int(rc);
    EXPECT_NE(first, second);
    EXPECT_EQ(flash2.memory.activations, flash.memory.activations);
  }
  // The rate between samples: linear in log seq; beyond them, the nearest end's.
  EXPECT_NEAR(flash_attention_rate(acc, "flash2", 3000, 128), 140e12 + 16e12 * std::log2(3000.0 / 2048), 1e3);
  // Below the shortest: the two shortest's slope carried on (31 TFLOP/s a doubling: 57 at 256), floored at the
  // shortest's rate times seq / its seq (11 at 64, where the slope would go below 0); it held 88 at any length.
  EXPECT_NEAR(flash_attention_rate(acc, "flash2", 256, 64), 57e12, 1e3);
  EXPECT_NEAR(flash_attention_rate(acc, "flash2", 64, 64), 11e12, 1e3);
  // Of two head widths as near, the narrower (slower): the file's order decided.
  for (bool wide_first : {false, true}) {
    Accelerator two = acc;
    two.attention_calibration.clear();
    const AttentionSample narrow{"flash2", 2048, 64, 100e12}, wide{"flash2", 2048, 256, 200e12};
    two.attention_calibration = wide_first ? std::vector{wide, narrow} : std::vector{narrow, wide};
    EXPECT_DOUBLE_EQ(flash_attention_rate(two, "flash2", 2048, 128), 100e12) << wide_first;
  }
  EXPECT_DOUBLE_EQ(flash_attention_rate(acc, "flash2", 65536, 256), 171e12);
  // An accelerator without the kernel's rates refuses it, naming what is allowed (flash3 on the A100; flash2 on the
  // H100, whose preset cites no published causal forward + backward figures).
  c.recompute = Recompute::kNone;
  c.attention = AttentionKernels::kFlash3;
  EXPECT_EQ(error_of([&] { simulate_step(net, m, c); }),
            "flash3 (FlashAttention): the accelerator A100-SXM4-80GB has no flash3 rate (its cluster file's "
            "attention_calibration holds no sample with kernel: flash3); allowed: --attention-kernels flash "
            "(FlashAttention at the GEMM rate), fused, eager, or a cluster file with flash3 samples (docs/sim.md "
            "section 3)");
  Topology h100(load_cluster("dgx-h100"), 8);
  CollectiveModel h100_net(h100);
  c.attention = AttentionKernels::kFlash2;
  EXPECT_NE(error_of([&] { simulate_step(h100_net, m, c); }).find("has no flash2 rate"), std::string::npos);
  // Selective recompute is refused as with the first version (no scores stored), naming the kernel given.
  c.recompute = Recompute::kSelective;
  EXPECT_EQ(error_of([&] { simulate_step(net, m, c); }),
            "--recompute selective recomputes the attention core to drop its s^2 scores, which --attention-kernels "
            "flash2 never stores; allowed with flash2: --recompute none or full");
}

// FlashAttention keeps the scores on chip: none of the fused path's softmax and dropout traffic over the b (a/t) s^2
// scores (9 bytes an element: read and write, then a dropout's read, write and mask) in the forward, the backward
// (twice) and a full recompute, nor their kernels; its backward recomputes QK^T (half the core's forward GEMMs); a
// layer stores the softmax's fp32 log-sum-exp (4 b a s / t bytes) in place of the scores and their mask (5 b a s^2 /
// t).
TEST_F(AttentionSteps, FlashAttentionKeepsTheScoresOnChip) {
  double core = 0;
  for (const auto& g : gpt_layer_gemms(m, c.micro_batch, c.tp))
    if (g.attention_core) core += gemm_time(acc, g.shape);
  ASSERT_GT(core, 0);
  const double elems = c.micro_batch * double(m.heads / c.tp) * double(m.seq) * double(m.seq);
  for (Recompute rc : {Recompute::kNone, Recompute::kFull}) {
    c.recompute = rc;
    c.attention = AttentionKernels::kFused;
    const StepResult fused = simulate_step(net, m, c);
    c.attention = AttentionKernels::kFlash;
    const StepResult flash = simulate_step(net, m, c);
    const double passes = rc == Recompute::kNone ? 3 : 4;  // forward, backward twice, recompute
    const double saved =
        m.layers *
        (passes * (9 * elems / (acc.memory_bandwidth * acc.memory_efficiency) + 2 * acc.kernel_overhead) - core / 2);
    EXPECT_NEAR(fused.breakdown.compute - flash.breakdown.compute, saved, 1e-6 * saved) << int(rc);
    EXPECT_GT(saved, 0.02 * fused.breakdown.compute);
    const double sbh = double(m.seq) * c.micro_batch * double(m.hidden);
    const double per_layer = sbh * (5.0 * m.heads * double(m.seq) - 4.0 * m.heads) / (double(m.hidden) * c.tp);
    // (stored in every layer without recompute; with full recompute only the one recomputing holds them)
    EXPECT_NEAR(fused.memory.activations - flash.memory.activations,
                (rc == Recompute::kNone ? m.layers : 1) * per_layer, 1e-9 * fused.memory.activations)
        << int(rc);
  }
  EXPECT_EQ(parse_attention_kernels("flash"), AttentionKernels::kFlash);
  EXPECT_EQ(parse_attention_kernels("flash3"), AttentionKernels::kFlash3);
  // Selective recompute drops the scores flash never stores: refused (it charged the core's recompute for nothing).
  c.recompute = Recompute::kSelective;
  try {
    simulate_step(net, m, c);
    ADD_FAILURE() << "selective recompute with flash was taken";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--recompute selective recomputes the attention core to drop its s^2 scores, which "
              "--attention-kernels flash never stores; allowed with flash: --recompute none or full");
  }
}

// The last pipeline stage holds the fp32 logits of the loss (4 b s V / t bytes) and one micro-batch: with large
// micro-batches and full recompute it holds more than the first, and the reported memory is the larger.
TEST(Step, MemoryIsTheLargerOfTheFirstAndLastStage) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  GptModel m = named("gpt-1.7b");
  ParallelConfig c;
  c.pp = 2;
  c.micro_batch = 16;
  c.global_batch = 64;
  c.recompute = Recompute::kFull;
  StepResult r = simulate_step(net, m, c);
  const double logits = 4.0 * 16 * m.seq * m.vocab;
  EXPECT_GT(r.memory.activations, logits);
  bool noted = false;
  for (const auto& n : r.notes) noted |= n.rfind("memory: the last pipeline stage", 0) == 0;
  EXPECT_TRUE(noted);
  c.micro_batch = 1;  // no recompute: the first stage's two micro-batches of full activations hold more
  c.recompute = Recompute::kNone;
  StepResult small = simulate_step(net, m, c);
  EXPECT_GT(small.memory.activations, 2 * logits / 16);
  for (const auto& n : small.notes) EXPECT_NE(n.rfind("memory: the last", 0), 0u) << n;
}

// Small models fill a GPU only with large micro-batches: the search goes past 16 (it stopped there, and GPT-2 small
// on 16 A100s at batch 1024 missed micro-batch 64, 2.3% faster).
TEST(Planner, SearchesMicroBatchesAboveSixteen) {
  Topology topo(load_cluster("dgx-a100"), 16);
  CollectiveModel net(topo);
  PlanResult pr = plan(net, named("gpt2-small"), 1024, PlanSpace{}, 1);
  ASSERT_FALSE(pr.ranked.empty()) << pr.first_error;
  EXPECT_EQ(pr.ranked[0].config.micro_batch, 64);
  PlanSpace upto16;
  for (int b = 1; b <= 16; ++b) upto16.micro_batch.push_back(b);
  PlanResult small = plan(net, named("gpt2-small"), 1024, upto16, 1);
  ASSERT_FALSE(small.ranked.empty());
  EXPECT_LT(pr.ranked[0].time, small.ranked[0].time * 0.99);
}

TEST(Planner, RanksFittingPlansFastAndExplains) {
  Topology topo(load_cluster("dgx-a100"), 512);
  CollectiveModel net(topo);
  GptModel m = named("gpt-39b");
  PlanSpace space;
  const double t0 = thread_cpu_seconds();
  PlanResult pr = plan(net, m, 1536, space, 10);
  const double cpu = thread_cpu_seconds() - t0;
  ASSERT_FALSE(pr.ranked.empty());
  EXPECT_GT(pr.candidates, 1000);
  EXPECT_GT(pr.candidates / cpu, 1000.0);  // thousands of candidates per second of this thread's CPU time
  for (size_t i = 1; i < pr.ranked.size(); ++i) EXPECT_LE(pr.ranked[i - 1].time, pr.ranked[i].time);
  for (const auto& r : pr.ranked) EXPECT_TRUE(r.fits);
  auto why = explain_plan(pr.ranked[0], &pr.ranked[1]);
  EXPECT_GE(why.size(), 2u);
  // The best plan is at least as fast as Megatron's published configuration (t=8, p=2, b=1, full recompute).
  ParallelConfig meg;
  meg.tp = 8;
  meg.pp = 2;
  meg.global_batch = 1536;
  meg.recompute = Recompute::kFull;
  EXPECT_LE(pr.ranked[0].time, simulate_step(net, m, meg).time);
}

TEST(Inference, DecodeIsBoundByWhatTakesMostOfItAndKvCacheMatchesItsFormula) {
  Topology topo(load_cluster("dgx-h100"), 8);
  CollectiveModel net(topo);
  GptModel m = named("llama2-70b-like");
  InferenceConfig c;
  c.tp = 8;
  c.batch = 1;
  c.prompt = 1024;
  c.generate = 128;
  InferenceResult r = simulate_inference(net, m, c);
  // Batch 1 over 8 ranks: 80 layers' kernel launches and 160 allreduces take more of a step than streaming the
  // 17 GB of weights (it was called memory-bound from the GEMMs' FLOPs against their bytes alone).
  EXPECT_EQ(r.decode_bound, "latency");
  // The prefill makes the first token; each of the other 127 takes a decode step.
  EXPECT_NEAR(r.request_latency, r.prefill + 127 * r.decode_per_token, 1e-9 * r.request_latency);
  InferenceConfig one = c;
  one.generate = 1;
  EXPECT_DOUBLE_EQ(simulate_inference(net, m, one).request_latency, simulate_inference(net, m, one).prefill);
  // A 7B model on one GPU streams its weights (memory); at batch 1024 over 16-token contexts its GEMMs are
  // arithmetic-bound (compute).
  InferenceConfig solo;
  solo.batch = 1;
  solo.prompt = 16;
  solo.generate = 16;
  EXPECT_EQ(simulate_inference(net, named("llama2-7b-like"), solo).decode_bound, "memory");
  solo.batch = 1024;
  EXPECT_EQ(simulate_inference(net, named("llama2-7b-like"), solo).decode_bound, "compute");
  // (the position embeddings are whole on each rank, the rest split over the 8)
  const double weights = 2 * (gpt_parameters(m) / 8 + m.seq * m.hidden * (1 - 1.0 / 8));
  EXPECT_NEAR(r.weight_bytes, weights, 1);
  const double floor = weights / (3350e9 * 0.85);  // every decode step streams the weights once
  EXPECT_GT(r.decode_per_token, floor);
  EXPECT_LT(r.decode_per_token, 2.5 * floor);
  // Grouped-query attention: 8 key/value heads of 128, one on each of the 8 ranks (it was h/t = 1024 wide: 8x).
  EXPECT_EQ(m.kv(), 8);
  EXPECT_DOUBLE_EQ(kv_cache_bytes(m, 8, 1, 1152, 1), 2.0 * 80 * 128 * 1152 * 2);
  EXPECT_NEAR(r.kv_bytes, kv_cache_bytes(m, 8, 1, 1152, 1), 1);
  GptModel mha = m;
  mha.kv_heads = 0;
  EXPECT_DOUBLE_EQ(kv_cache_bytes(mha, 8, 1, 1152, 1), 8 * kv_cache_bytes(m, 8, 1, 1152, 1));
  EXPECT_GT(simulate_inference(net, m, c).max_batch, simulate_inference(net, mha, c).max_batch);
  // Its K and V projections are 8x narrower: 2 x 8 x 128 columns instead of 2 x 8192.
  EXPECT_DOUBLE_EQ(gpt_layer_parameters(mha) - gpt_layer_parameters(m), 2.0 * (8192 - 1024) * (8192 + 1));
  // More ranks than key/value heads replicate one on each; a tp neither dividing nor a multiple of 8 is refused.
  EXPECT_DOUBLE_EQ(kv_heads_per_rank(m, 16), 1.0);
  EXPECT_DOUBLE_EQ(kv_heads_per_rank(m, 2), 4.0);
  GptModel odd = m;
  odd.kv_heads = 16;
  EXPECT_THROW(kv_heads_per_rank(odd, 24), ConfigError);
  odd.kv_heads = 3;
  EXPECT_THROW(odd.validate(), ConfigError);  // 3 does not divide 64 heads
  // Larger batches amortize the weights: more tokens/s, longer steps; the KV cache grows linearly.
  c.batch = 32;
  InferenceResult big = simulate_inference(net, m, c);
  EXPECT_GT(big.tokens_per_second, 10 * r.tokens_per_second);
  EXPECT_NEAR(big.kv_bytes, 32 * r.kv_bytes, 1);
  EXPECT_GT(big.prefill, r.prefill);
  EXPECT_GT(r.max_batch, 32);
  // Memory holds what the prefill timing writes: with a long prompt and unfused attention the attention phase (QKV,
  // the b (a/t) s^2 scores and their softmax, 2 bytes each) is the largest transient (it was left out: 0.47 GB
  // counted against 1.07 GB); fused, the MLP phase (its up-projection's output and QKV).
  c.batch = 4;
  c.prompt = 3072;
  c.generate = 512;
  const InferenceResult fused = simulate_inference(net, m, c);
  c.fused_attention = false;
  InferenceResult longp = simulate_inference(net, m, c);
  const double b = 4, s = 3072, h = m.hidden, heads = m.heads / 8.0, V = m.vocab;
  const double attention = 2 * b * s * (h / 8 + 2 * 128) + 2 * 2 * b * heads * s * s, logits = 4 * b * V / 8;
  EXPECT_NEAR(longp.memory_total - longp.weight_bytes - longp.kv_bytes, attention + logits, 1e3);
  const double mlp = 2 * b * s * (m.mlp_up_width() / 8 + h / 8 + 2 * 128);
  EXPECT_NEAR(fused.memory_total - fused.weight_bytes - fused.kv_bytes, mlp + logits, 1e3);
}

// FlashAttention-2 in serving: the prefill's attention core at the accelerator's forward rate for it (the causal
// forward's 2 b (a/t) s^2 d FLOPs, as sim step counts them) in place of its causal half at the GEMM rate; the decode
// as before.
TEST(Inference, FlashAttention2PrefillsAtItsPublishedRate) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  const GptModel m = named("llama2-70b-like");
  const Accelerator& acc = topo.spec().node_kinds[0].accelerator;
  InferenceConfig c;
  c.tp = 8;
  c.batch = 4;
  c.prompt = 2048;
  c.generate = 64;
  const InferenceResult flash = simulate_inference(net, m, c);
  c.flash_kernel = "flash2";
  const InferenceResult flash2 = simulate_inference(net, m, c);
  GptModel pm = m;
  pm.seq = c.prompt;
  double half = 0;  // (the causal half of the core's two GEMMs at the GEMM rate)
  for (auto g : gpt_layer_gemms(pm, c.batch, c.tp))
    if (g.attention_core) {
      (std::string(g.name) == "attention scores" ? g.shape.n : g.shape.k) /= 2;
      half += gemm_time(acc, g.shape);
    }
  const double d = double(m.hidden) / m.heads, s = double(c.prompt);
  const double own = 2.0 * c.batch * (m.heads / c.tp) * s * s * d / flash_attention_rates(acc, "flash2", s, d).forward;
  EXPECT_NE(half, own);
  EXPECT_NEAR(flash.prefill - flash2.prefill, m.layers * (half - own), 1e-6 * flash.prefill);
  EXPECT_EQ(flash2.decode_per_token, flash.decode_per_token);
  EXPECT_EQ(flash2.memory_total, flash.memory_total);
  // Its rates split 73 : 63 between the passes, their mean the measured one (3.5 F / rate = F / fwd + 2.5 F / bwd).
  const FlashRates r = flash_attention_rates(acc, "flash2", s, d);
  EXPECT_NEAR(3.5 / flash_attention_rate(acc, "flash2", s, d), 1 / r.forward + 2.5 / r.backward, 1e-20);
  EXPECT_NEAR(r.backward / r.forward, 63.0 / 73, 1e-12);
}

TEST(Scheduler, LasBeatsFifoOnMeanJctWithAHeadOfLineJob) {
  // A long 512-GPU job arrives first; short jobs queue behind it under FIFO; LAS lets them through.
  std::string trace =
      "id,submit_s,gpus,model,iterations\n"
      "big,0,512,gpt-7.5b,4000\n"
      "s1,10,64,gpt2-xl,100\n"
      "s2,20,64,gpt2-xl,100\n"
      "s3,30,128,gpt2-xl,100\n";
  auto jobs = parse_job_trace(trace, "trace");
  ClusterSpec spec = load_cluster("dgx-a100");
  SchedulerOptions fifo;
  SchedulerOptions las;
  las.policy = Policy::kLas;
  auto rf = simulate_cluster(spec, 512, jobs, fifo);
  auto rl = simulate_cluster(spec, 512, jobs, las);
  EXPECT_LT(rl.mean_jct, rf.mean_jct);
  EXPECT_GT(rl.jobs[0].preemptions, 0);
  SchedulerOptions srtf;
  srtf.policy = Policy::kSrtf;
  auto rs = simulate_cluster(spec, 512, jobs, srtf);
  EXPECT_LT(rs.mean_jct, rf.mean_jct);  // knowing the predicted lengths helps at least as much
  EXPECT_THROW(parse_policy("lottery"), ConfigError);
  for (const auto& j : rf.jobs) EXPECT_GE(j.start, j.submit);
  EXPECT_GT(rf.utilization, 0.5);
  EXPECT_LE(rf.utilization, 1.0 + 1e-9);
}

// Tiresias's starvation guard: one 8-GPU job B and a stream of small jobs that alone keep the 8 GPUs busy. With
// T one iteration, the first queue ends at 10T of B's service. Without the guard B runs 10T, is demoted, and waits for
// the whole stream (2000T); with knob 1, B goes back to the first queue after waiting as long as it ran (10T), at the
// end of it, as Tiresias's simulator appends a promoted job: behind the small jobs waiting there (2 at 20T), whose
// backlog grows by two for each of B's runs. Its wait there does not count towards the next promotion (Tiresias
// counts a wait only once the job has run since its promotion), so run k + 1 starts 10T (the wait to promotion) +
// 10kT (2k jobs ahead) after run k ends: runs at 0, 30, 70, 120, ..., 630: done at 640T after 9 promotions (190T
// when promotion put B first in the queue). The small
// jobs arrive a quarter of T after each multiple of 5T, so that no arrival ties with a completion or a promotion (a tie
// was decided by rounding: a step model change that moved T by a fraction turned 9 promotions into 10).
TEST(Scheduler, LasStarvationGuardPromotesAJobThatWaitedKnobTimesItsRun) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  const double T = job_iteration_time(spec, "gpt2-small", 8, 0, 1);
  ASSERT_TRUE(std::isfinite(T) && T > 0);
  std::string trace = "id,submit_s,gpus,model,iterations\nB,0,8,gpt2-small,100\n";
  for (int k = 0; k < 400; ++k)
    trace += "s" + std::to_string(k) + "," + fmt::format("{:.17g}", (k * 5 + 0.25) * T) + ",8,gpt2-small,5\n";
  const auto jobs = parse_job_trace(trace, "stream");
  SchedulerOptions las;
  las.policy = Policy::kLas;
  las.las_first_threshold = 8 * 10 * T;
  las.las_queues = 2;
  las.restart_penalty = 0;
  const ScheduleResult off = simulate_cluster(spec, 8, jobs, las);
  EXPECT_EQ(off.jobs[0].promotions, 0);
  EXPECT_NEAR(off.jobs[0].finish, 2100 * T, T);  // behind all 400 small jobs
  EXPECT_NEAR(off.jobs[0].queued, 2000 * T, T);  // after its first 10T, it waits for the stream to drain
  // Every job's time is its wait, its reloads and its iterations at its placement's speed (one node: T each).
  auto accounted = [&](const ScheduleResult& r, const std::vector<JobSpec>& js) {
    double queued = 0;
    for (size_t i = 0; i < r.jobs.size(); ++i) {
      const JobOutcome& j = r.jobs[i];
      EXPECT_NEAR(j.iteration_time, T, 1e-12 * T) << j.id;
      EXPECT_NEAR(j.finish - j.submit, j.queued + j.reloading + static_cast<double>(js[i].iterations) * T, 1e-6 * T)
          << j.id;
      queued += j.queued;
    }
    EXPECT_NEAR(r.mean_queued, queued / static_cast<double>(r.jobs.size()), 1e-9 * T);
  };
  accounted(off, jobs);
  las.las_promote_knob = 1;
  const ScheduleResult on = simulate_cluster(spec, 8, jobs, las);
  EXPECT_EQ(on.jobs[0].promotions, 9);
  EXPECT_NEAR(on.jobs[0].finish, 640 * T, T);
  for (size_t i = 1; i < on.jobs.size(); ++i) EXPECT_EQ(on.jobs[i].promotions, 0) << on.jobs[i].id;  // never demoted
  // The work is the same: the stream finishes 90T later, when B's rest (90T) has run in its gaps.
  EXPECT_NEAR(on.makespan, off.makespan, T);
  // Knob 2: 20T to each promotion, then 10kT behind 2k jobs: runs at 0, 40, 90, 150, ..., 720: done at 730T.
  las.las_promote_knob = 2;
  const ScheduleResult two = simulate_cluster(spec, 8, jobs, las);
  EXPECT_NEAR(two.jobs[0].finish, 730 * T, T);
  // SRTF has no such guard: the knob changes nothing there.
  SchedulerOptions srtf = las;
  srtf.policy = Policy::kSrtf;
  srtf.las_promote_knob = 0;
  const ScheduleResult s0 = simulate_cluster(spec, 8, jobs, srtf);
  srtf.las_promote_knob = 1;
  EXPECT_EQ(simulate_cluster(spec, 8, jobs, srtf).mean_jct, s0.mean_jct);
  // A restart penalty longer than the first queue's share: attained service counts training, not reloading, so each
  // run trains 2T before the next demotion (counted while reloading, two such jobs promoted and preempted each other
  // for ever without training).
  SchedulerOptions slow_restart = las;
  slow_restart.las_first_threshold = 8 * 2 * T;
  slow_restart.restart_penalty = 10 * T;
  slow_restart.las_promote_knob = 1;
  const ScheduleResult pair = simulate_cluster(
      spec, 8, parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt2-small,20\nb,0,8,gpt2-small,20\n", "t"),
      slow_restart);
  for (const auto& j : pair.jobs) {
    EXPECT_TRUE(std::isfinite(j.finish)) << j.id;
    EXPECT_GT(j.promotions, 0) << j.id;
  }
  EXPECT_GT(pair.restart_overhead, 0);
  accounted(pair,
            parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt2-small,20\nb,0,8,gpt2-small,20\n", "t"));
  for (const auto& j : pair.jobs) {  // each restart reloads for up to the penalty (unless preempted again meanwhile)
    EXPECT_GT(j.reloading, 0) << j.id;
    EXPECT_LE(j.reloading, j.preemptions * 10 * T * (1 + 1e-9)) << j.id;
  }
  // A lease of the restart penalty: each run trains 10T before it can be preempted, so reloading holds at most half
  // of the accelerators' time (without it 75%, 99 preemptions each) and both finish in half the time (770T, 1492T).
  SchedulerOptions leased = slow_restart;
  leased.min_lease = 10 * T;
  const auto pair_trace =
      parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt2-small,200\nb,0,8,gpt2-small,200\n", "t");
  const ScheduleResult thrash = simulate_cluster(spec, 8, pair_trace, slow_restart);
  const ScheduleResult calm = simulate_cluster(spec, 8, pair_trace, leased);
  EXPECT_GT(thrash.restart_overhead, 0.7);
  EXPECT_LE(calm.restart_overhead, 0.5 + 1e-9);
  EXPECT_LT(calm.mean_jct * 1.8, thrash.mean_jct);
  for (const auto& j : calm.jobs) EXPECT_TRUE(std::isfinite(j.finish)) << j.id;
  // Bad settings are refused with the option named.
  auto refused = [&](SchedulerOptions o, const std::string& flag) {
    try {
      simulate_cluster(spec, 8, jobs, o);
      ADD_FAILURE() << flag << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  SchedulerOptions bad = las;
  bad.las_promote_knob = -1;
  refused(bad, "--promote-knob");
  bad.las_promote_knob = std::nan("");
  refused(bad, "--promote-knob");
  bad = las;
  bad.min_lease = -1;
  refused(bad, "--min-lease");
  bad = las;
  bad.las_queues = 0;
  refused(bad, "--las-queues");
  bad.las_queues = kMaxLasQueues + 1;
  refused(bad, "--las-queues");
  bad = las;
  bad.las_first_threshold = 0;
  refused(bad, "--las-threshold");
  bad = las;
  bad.restart_penalty = std::numeric_limits<double>::infinity();
  refused(bad, "--restart-penalty");
  // The command line sets all four.
  const std::string path = ::testing::TempDir() + "/stream-" + std::to_string(::getpid()) + ".csv";
  std::ofstream(path) << trace;
  int rc = 0;
  std::string out = test_util::run(fmt::format("sim cluster --cluster dgx-a100 --gpus 8 --jobs {} --scheduler las "
                                               "--las-threshold {:.17g} --las-queues 2 --restart-penalty 0 "
                                               "--promote-knob 1 --json",
                                               path, 80 * T),
                                   &rc);
  ASSERT_EQ(rc, 0) << out;
  auto js = nlohmann::json::parse(out);
  EXPECT_EQ(js["jobs"][0]["promotions"], 9) << out.substr(0, 400);
  EXPECT_NEAR(js["jobs"][0]["finish_s"].get<double>(), 640 * T, T);
  out = test_util::run("sim cluster --gpus 8 --jobs " + path + " --scheduler las --promote-knob -1", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("--promote-knob = -1 (allowed"), std::string::npos) << out;
  // Another scheduler's options are refused, not ignored (fifo ran with --promote-knob 2 as without it).
  out = test_util::run("sim cluster --gpus 8 --jobs " + path + " --scheduler fifo --promote-knob 2", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--promote-knob applies to --scheduler las, not fifo"), std::string::npos) << out;
  out = test_util::run("sim cluster --gpus 8 --jobs " + path + " --scheduler srtf --restart-penalty 5", &rc);
  EXPECT_EQ(rc, 0) << out;
  out = test_util::run("sim cluster --gpus 8 --jobs " + path + " --scheduler fifo --min-lease 5", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--min-lease applies to --scheduler las or srtf, not fifo"), std::string::npos) << out;
  out = test_util::run("sim cluster --gpus 8 --jobs " + path + " --scheduler srtf --min-lease 5", &rc);
  EXPECT_EQ(rc, 0) << out;
  std::remove(path.c_str());
}

TEST(Scheduler, SpreadPlacementIsSlowerOnAnOversubscribedNetwork) {
  ClusterSpec spec = load_cluster("ethernet-25g");
  double packed = job_iteration_time(spec, "gpt2-small", 64, 0, 1);
  double spread = job_iteration_time(spec, "gpt2-small", 64, 0, 4);
  EXPECT_GT(spread, packed);  // a ring barely notices 3:1 oversubscription; halving-doubling does
  std::string trace = "id,submit_s,gpus,model,iterations\na,0,64,gpt2-small,100\nb,0,64,gpt2-small,100\n";
  SchedulerOptions topo, spr;
  spr.placement = Placement::kSpread;
  auto a = simulate_cluster(spec, 512, parse_job_trace(trace, "t"), topo);
  auto b = simulate_cluster(spec, 512, parse_job_trace(trace, "t"), spr);
  EXPECT_EQ(a.jobs[0].leaves_used, 1);
  EXPECT_GT(b.jobs[0].leaves_used, 1);
  EXPECT_LT(a.makespan, b.makespan);
  // Goodput counts the work at the packed speed: the spread placement's slower iterations count as busy (its
  // utilization is the same or higher) but not as work. Packed, both are the same figure.
  EXPECT_NEAR(a.goodput, a.utilization, 1e-9);
  EXPECT_LT(b.goodput, b.utilization);
  EXPECT_NEAR(b.goodput * b.makespan, a.goodput * a.makespan, 1e-6 * a.makespan);
  // A cluster of the same name with slower accelerators runs its jobs slower: the times are not kept across
  // clusters by name (a process-wide cache returned the first cluster's times for every later one so named).
  ClusterSpec slower = spec;
  for (auto& k : slower.node_kinds) {
    k.accelerator.peak_flops /= 4;
    k.accelerator.peak_flops_fp32 /= 4;
  }
  EXPECT_GT(job_iteration_time(slower, "gpt2-small", 64, 0, 1), 1.5 * packed);
  const std::string two = "id,submit_s,gpus,model,iterations\na,0,64,gpt2-small,100\n";
  EXPECT_GT(simulate_cluster(slower, 512, parse_job_trace(two, "t"), topo).makespan,
            1.5 * simulate_cluster(spec, 512, parse_job_trace(two, "t"), topo).makespan);
  EXPECT_THROW(parse_job_trace("id,submit_s,gpus,model,iterations\nx,0,8,nope,1\n", "t"), ConfigError);
  EXPECT_THROW(parse_job_trace("bad header\n", "t"), ConfigError);
}

TEST(Scale, HundredThousandGpuIterationUnderOneSecond) {
  const double t0 = thread_cpu_seconds();
  Topology topo(load_cluster("dgx-h100"), 100000);
  CollectiveModel net(topo);
  GptModel m = named("gpt3-175b");
  ParallelConfig c;
  c.tp = 8;
  c.pp = 4;
  c.global_batch = 12500;
  c.recompute = Recompute::kSelective;
  c.sequence_parallel = true;
  StepResult r = simulate_step(net, m, c);
  const double took = thread_cpu_seconds() - t0;
  EXPECT_LT(took, 1.0);
  EXPECT_GT(r.time, 0);
  EXPECT_EQ(r.config.dp, 3125);
}

using test_util::run;

// sim coll, calibrate and infer, from a read-only audit: a flag taken and dropped is refused, full-detail mode bounds
// the flows it builds, a one-copy group is not marked approximate, and a flat network aggregates in the switch only
// where its file says so.
TEST(Cli, CollCalibrateAndInferRefuseWhatTheyDropped) {
  int rc = 0;
  std::string out = run("sim coll --steps --json", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--steps shows the table's steps, which --json does not write"), std::string::npos) << out;
  out = run("sim coll --cluster dgx-a100 --gpus 4096 --op all-to-all --size 1G --mode full", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("is 1.68e+07 flows, over its budget of 4e+06; use symmetric mode"), std::string::npos) << out;
  out = run("sim coll --cluster dgx-a100 --gpus 2048 --op all-to-all --size 1G --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"approximate\":false"), std::string::npos) << out;
  // An algorithm that cannot run on the group has a record saying why, as the table has a row (the JSON left it out).
  out = run("sim coll --gpus 96 --group 6 --size 64M --mode full --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"algorithm\":\"hierarchical\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"error\":"), std::string::npos) << out;
  out = run("sim calibrate --bench /dev/null --peak \"50 GFLOP/s\" --batch -5", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--batch sizes the kernels calibrate times itself, which --peak replaces"), std::string::npos)
      << out;
  out = run("sim infer --model gpt3-175b --gpus 8 --tp 8 --batch 2147483647", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--batch = 2147483647 (allowed: 1 to 1048576 sequences)"), std::string::npos) << out;
  const std::string file = "/tmp/conduit-flat-" + std::to_string(::getpid()) + ".yaml";
  const std::string flat =
      "name: f\nnodes:\n  - name: n\n    gpus: 1\n    accelerator: {peak_bf16: 100 TFLOP/s, memory: 80 GB, "
      "memory_bandwidth: 1000 GB/s}\n    intra: {kind: none, bandwidth: 10 GB/s, latency: 1 us}\n    nics: 1\n    "
      "nic: {bandwidth: 10 GB/s, latency: 5 us}\nnetwork: {topology: flat";
  std::ofstream(file) << flat << "}\n";
  out = run("sim coll --cluster " + file + " --gpus 4 --algorithm in-network --size 1M", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("cluster 'f' has no in-network reduction"), std::string::npos) << out;
  std::ofstream(file) << flat << ", in_network_reduction: true}\n";
  out = run("sim coll --cluster " + file + " --gpus 4 --algorithm in-network --size 1M", &rc);
  EXPECT_EQ(rc, 0) << out;
  std::remove(file.c_str());
}

// Each run starts the whole `conduit` binary, which loads every area's libraries (libtorch's dependency chain
// alone takes about a second to load here), so this test keeps to a few runs; the library tests cover the rest.
TEST(Cli, StepPlanAndErrors) {
  int rc = 0;
  std::string out =
      run("sim step --cluster dgx-a100 --gpus 64 --model gpt --layers 24 --hidden 2304 --heads 24 "
          "--global-batch 64 --tp 2 --json",
          &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"kind\":\"sim.step\""), std::string::npos) << out;
  EXPECT_NE(out.find("model_tflops_per_gpu"), std::string::npos);
  out = run(
      "sim step --cluster dgx-a100 --gpus 64 --model gpt --layers 24 --hidden 2304 --heads 24 --global-batch 64 --tp 5",
      &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("conduit: error: --tp"), std::string::npos) << out;
  out = run("sim plan --cluster dgx-h100 --gpus 64 --model gpt-7.5b --global-batch 256 --top 3", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("rank"), std::string::npos);
  // Full-detail mode cannot time some placements (copies of a group running different patterns): those candidates
  // are left out and counted, and the search goes on (the first one stopped it, naming no plan).
  out = run("sim plan --cluster dgx-a100 --gpus 200 --model gpt-1.7b --global-batch 400 --mode full --top 1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("valid candidate(s) full-detail mode cannot time (e.g. full-detail mode: the copies"),
            std::string::npos)
      << out;
  // So is --no-overlap with it, in the planner too (refused per candidate, only the dp = 1 plans were left).
  out = run("sim plan --cluster dgx-a100 --gpus 16 --model gpt-1.7b --global-batch 64 --sync local-sgd:4 --no-overlap",
            &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--no-overlap with --sync local-sgd"), std::string::npos) << out;
  // A bucket size with local SGD, which averages everything in one call, is refused (it changed nothing).
  out = run("sim step --cluster dgx-a100 --gpus 64 --model gpt-1.7b --global-batch 64 --sync local-sgd:4 --bucket 1M",
            &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--bucket 1M with --sync local-sgd"), std::string::npos) << out;
  out = run("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32,64 --fixed --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"kind\":\"sim.scale\""), std::string::npos) << out;
  EXPECT_NE(out.find("scaling_efficiency"), std::string::npos) << out;
  // A fixed interleaved schedule takes its virtual stages (it was always v = 2), with --fixed only.
  out =
      run("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32,64 --fixed --pp 4 "
          "--schedule interleaved --virtual-stages 3 --json",
          &rc);
  EXPECT_EQ(rc, 0) << out;
  size_t with_v3 = 0;
  for (size_t at = 0; (at = out.find("\"virtual_stages\":3", at)) != std::string::npos; ++at) ++with_v3;
  EXPECT_EQ(with_v3, 2u) << out;
  out =
      run("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32,64 --virtual-stages 3", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--virtual-stages applies with --fixed only"), std::string::npos) << out;
  // So does an uneven pipeline split (sim scale had no stage-layer flags: `sim step`'s BLOOM split had no curve).
  out =
      run("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32,64 --fixed --pp 4 "
          "--first-stage-layers 5 --last-stage-layers 5 --json",
          &rc);
  EXPECT_EQ(rc, 0) << out;
  size_t split = 0;
  for (size_t at = 0;
       (at = out.find(R"("stage_layers":{"first":5,"last":5,"middle":7,"uneven":true})", at)) != std::string::npos;
       ++at)
    ++split;
  EXPECT_EQ(split, 2u) << out;
  out =
      run("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32 --last-stage-layers 5", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("--last-stage-layers applies with --fixed only"), std::string::npos) << out;
  // The attention's kernels apply at every size, planned or fixed (sim scale had no --attention-kernels: the FSDP
  // rows of docs/sim.md §10 could not be drawn as a curve).
  for (const char* fixed : {" --fixed", ""}) {
    const std::string cmd =
        std::string("sim scale --cluster dgx-a100 --model gpt-1.7b --batch-per-gpu 4 --gpus-list 32 --json") + fixed;
    const std::string fused = run(cmd, &rc);
    EXPECT_EQ(rc, 0) << fused;
    const std::string eager = run(cmd + " --attention-kernels eager", &rc);
    EXPECT_EQ(rc, 0) << eager;
    EXPECT_NE(eager.find("\"attention_kernels\":\"eager\""), std::string::npos) << eager;
    const auto time_of = [](const std::string& j) { return nlohmann::json::parse(j)["time_s"].get<double>(); };
    EXPECT_GT(time_of(eager), time_of(fused)) << fixed;
    // FlashAttention-2 at the preset's published rate: faster than the first version's GEMM-rate core.
    const std::string flash = run(cmd + " --attention-kernels flash", &rc);
    EXPECT_EQ(rc, 0) << flash;
    const std::string flash2 = run(cmd + " --attention-kernels flash2", &rc);
    EXPECT_EQ(rc, 0) << flash2;
    EXPECT_NE(flash2.find("\"attention_kernels\":\"flash2\""), std::string::npos) << flash2;
    EXPECT_LT(time_of(flash2), time_of(flash)) << fixed;
  }
  // An uneven split in the JSON record: the counts used, a middle stage's figures null where there is none (p = 2: a
  // middle stage's time was printed for a stage that does not exist).
  out =
      run("sim step --cluster dgx-a100 --gpus 8 --model gpt-1.7b --global-batch 8 --pp 2 --first-stage-layers 10 "
          "--json",
          &rc);
  EXPECT_EQ(rc, 0) << out;
  {
    const auto j = nlohmann::json::parse(out);
    EXPECT_EQ(j["stage_layers"].dump(), R"({"first":10,"last":14,"middle":null,"uneven":true})");
    EXPECT_TRUE(j["stage_per_micro_batch_s"]["middle"].is_null()) << out;
    EXPECT_EQ(j["config"]["first_stage_layers"], 10);
    EXPECT_TRUE(j["config"]["last_stage_layers"].is_null()) << out;
  }
  // The efficiency is relative to the smallest size, whatever the list's order (it was the first listed's).
  out = run("sim scale --cluster dgx-a100 --model gpt-1.7b --global-batch 256 --gpus-list 64,32 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  const std::string second = out.substr(out.find('\n') + 1);  // the 32-GPU point's record
  EXPECT_NE(second.find("\"gpus\":32"), std::string::npos) << out;
  EXPECT_NE(second.find("\"scaling_efficiency\":1.0,"), std::string::npos) << out;
  // No size fits: the table, exit 1 (as sim plan); no size can run at all: one line, exit 2 (each row said it, 0).
  out = run("sim scale --cluster dgx-a100 --model gpt3-175b --global-batch 64 --gpus-list 8,16", &rc);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("no configuration fits in memory"), std::string::npos) << out;
  out = run("sim scale --cluster dgx-a100 --model gpt2-small --global-batch 64 --gpus-list 8,16 --fixed --tp 8", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out, "conduit: error: no size of --gpus-list = '8,16' can run: --tp = 8 must divide --heads = 12\n");
}

// `conduit bench gemm --json` (libtorch) feeds `conduit sim calibrate --gemm`; its shapes land in the written
// cluster file's calibration table. Bad --gemm input fails with one line naming the field. Three `conduit` runs.
// A cluster file that gives its nodes' count sizes the cluster when --gpus is not given (the count was ignored for
// --gpus's default); --gpus given wins. Four DGX A100 nodes: 32 accelerators.
TEST(Cli, AClusterFilesNodeCountIsItsSizeUnlessGpusIsGiven) {
  std::string yaml = preset_yaml("dgx-a100");
  const size_t at = yaml.find("    gpus: 8");
  ASSERT_NE(at, std::string::npos);
  yaml.insert(at, "    count: 4\n");
  const std::string path = ::testing::TempDir() + "conduit_counted_cluster_" + std::to_string(::getpid()) + ".yaml";
  std::ofstream(path) << yaml;
  int rc = 0;
  auto gpus_of = [&](const std::string& args) {
    std::string out = run(args + " --json", &rc);
    EXPECT_EQ(rc, 0) << out;
    const size_t brace = out.find('{');
    if (brace == std::string::npos) return -1LL;
    return nlohmann::json::parse(out.substr(brace, out.find('\n', brace) - brace))["gpus"].get<long long>();
  };
  const std::string step = "sim step --cluster " + path + " --model gpt2-small --global-batch 64";
  EXPECT_EQ(gpus_of(step), 32);
  EXPECT_EQ(gpus_of(step + " --gpus 16"), 16);
  EXPECT_EQ(gpus_of("sim coll --cluster " + path + " --size 1M --algorithm ring"), 32);
  std::remove(path.c_str());
}

TEST(Cli, GemmBenchFeedsCalibrate) {
  const std::string dir = ::testing::TempDir() + "conduit_gemm_calibrate_" + std::to_string(::getpid());
  std::string mk = "mkdir -p " + dir;
  ASSERT_EQ(std::system(mk.c_str()), 0);
  int rc = 0;
  std::string gemm =
      run("bench gemm --json --shapes 48x40x24,32x32x32 --min-time 0.005 --model mlp --model-steps 3", &rc);
  if (rc != 0 && gemm.find("gemm") != std::string::npos && gemm.find("bench.gemm") == std::string::npos)
    GTEST_SKIP() << "conduit built without libtorch: " << gemm;
  ASSERT_EQ(rc, 0) << gemm;
  std::ofstream(dir + "/gemm.jsonl") << gemm;
  // The model step record carries the per-step loss and accuracy read-back the trainer does, timed.
  const size_t ms = gemm.find("\"kind\":\"bench.model_step\"");
  ASSERT_NE(ms, std::string::npos) << gemm;
  const std::string rec = gemm.substr(gemm.rfind('{', ms), gemm.find('\n', ms) - gemm.rfind('{', ms));
  const auto j = nlohmann::json::parse(rec);
  ASSERT_TRUE(j.contains("stats_s")) << rec;
  EXPECT_GT(j["stats_s"].get<double>(), 0) << rec;
  EXPECT_EQ(j["step_samples_s"].size(), 3u) << rec;
  // A shape timed once counts for every layer (of every model) that runs it: each model's GEMM sum is the sum of its
  // labels' times (a shape of two models, or of two layers, counted once, for the first label's model).
  {
    std::string both = run("bench gemm --json --shapes mlp,cnn --min-time 0.002 --model mlp,cnn --model-steps 1", &rc);
    ASSERT_EQ(rc, 0) << both;
    std::map<std::string, double> want, got;
    int shared = 0;
    std::istringstream lines(both);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != '{') continue;
      auto r = nlohmann::json::parse(line);
      if (r["kind"] == "bench.gemm") {
        std::vector<std::string> labels{r["label"].get<std::string>()};
        for (const auto& l : r["also"]) labels.push_back(l.get<std::string>());
        shared += labels.size() > 1;
        for (const auto& l : labels) want[l.substr(0, l.find(' '))] += r["time_us"].get<double>() * 1e-6;
      } else if (r["kind"] == "bench.model_step") {
        got[r["model"].get<std::string>()] = r["gemm_sum_s"].get<double>();
      }
    }
    EXPECT_GT(shared, 0) << "no shape is run by two layers here: the test checks nothing";
    for (const char* m : {"mlp", "cnn"}) EXPECT_NEAR(got[m], want[m], 1e-9 * want[m] + 1e-12) << m;
  }
  // Collective timings of a flat 2-rank network (alpha 20 us, 1 GB/s, gamma 1/4 GB/s): ring allreduce.
  {
    std::ofstream b(dir + "/bench.jsonl");
    for (double n = 1024; n <= 16e6; n *= 4) {
      double t = 2 * 20e-6 + n / 1e9 + 0.5 * n / 4e9;
      b << "{\"op\":\"allreduce\",\"algo\":\"ring\",\"transport\":\"shm\",\"world\":2,\"bytes\":" << n
        << ",\"time_us\":" << t * 1e6 << "}\n";
    }
  }
  std::string out = run("sim calibrate --bench " + dir + "/bench.jsonl --gemm " + dir + "/gemm.jsonl --share 1 --out " +
                            dir + "/here.yaml",
                        &rc);
  ASSERT_EQ(rc, 0) << out;
  ClusterSpec c = load_cluster(dir + "/here.yaml");
  const auto& cal = c.node_kinds.at(0).accelerator.calibration;
  ASSERT_EQ(cal.size(), 2u) << out;
  EXPECT_EQ(cal[0].m, 48);
  EXPECT_EQ(cal[0].n, 40);
  EXPECT_EQ(cal[0].k, 24);
  EXPECT_GT(cal[0].flops, 0);
  EXPECT_EQ(cal[1].m, 32);
  std::ofstream(dir + "/bad.jsonl") << "{\"m\":64,\"n\":64,\"k\":64,\"gflops\":0}\n";
  out = run("sim calibrate --bench " + dir + "/bench.jsonl --gemm " + dir + "/bad.jsonl", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("conduit: error: " + dir + "/bad.jsonl:1: field 'gflops' must be a positive number"),
            std::string::npos)
      << out;
  // A rate past the cluster file's range: the measurements named as its cause, not only the written file's field.
  std::ofstream(dir + "/fast.jsonl") << "{\"m\":64,\"n\":64,\"k\":64,\"gflops\":1e10}\n";
  out = run("sim calibrate --bench " + dir + "/bench.jsonl --gemm " + dir + "/fast.jsonl --out -", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("conduit: error: the measurements give a cluster out of the simulator's range (calibrated "
                     "cluster: nodes[0].accelerator.peak_bf16:"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("check the records' gflops, time_us and *_us fields"), std::string::npos) << out;
  // The default world and transport are those with the most samples the fit can use: 24 unmodelled records (an
  // algorithm the simulator has no pattern for) and 2 ring ones at 4 ranks over tcp did not outvote the 7 shm ring
  // samples at 2 (it failed on 2).
  {
    std::ofstream b(dir + "/mixed.jsonl");
    std::ifstream(dir + "/bench.jsonl") >> b.rdbuf();
    for (int i = 0; i < 24; ++i)
      b << "{\"op\":\"reduce\",\"algo\":\"warp\",\"transport\":\"tcp\",\"world\":4,\"bytes\":" << 1024 * (i + 1)
        << ",\"time_us\":50}\n";
    for (int i = 0; i < 2; ++i)
      b << "{\"op\":\"allreduce\",\"algo\":\"ring\",\"transport\":\"tcp\",\"world\":4,\"bytes\":" << 4096 * (i + 1)
        << ",\"time_us\":70}\n";
  }
  out = run("sim calibrate --bench " + dir + "/mixed.jsonl --gemm " + dir + "/gemm.jsonl --share 1 --out -", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("description: this machine, 2 ranks over shm, calibrated"), std::string::npos) << out;
  // bench gemm's inputs: sides whose products wrapped past the 2^28 check, a batch without a bound, a model name that
  // was refused only after the whole timing pass.
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--shapes 4294967296x4294967296x4294967296", "--shapes: '4294967296x4294967296x4294967296' is not allowed"},
           {"--shapes mlp --batch 2000000000", "--batch = 2000000000 (allowed: 1..65536)"},
           {"--shapes 8x8x8 --model foo", "--model: 'foo' is not allowed; allowed: mlp, cnn, resnet"},
           // (a repeated item credited its models twice and timed its poolings twice)
           {"--shapes cnn,8x8x8,cnn --model cnn", "--shapes: 'cnn' is given twice; allowed: each item once"},
           // (an audit: flags for what the run does not time were taken and changed nothing)
           {"--shapes 8x8x8 --model-steps 7", "--model-steps applies to --model's training steps"},
           {"--shapes 8x8x8 --transport tcp", "--transport applies to the barriers between the ranks of a launch"},
           {"--shapes square --batch 999", "--batch applies to the cnn and mlp shapes, conv: shapes and --model"}}) {
    out = run("bench gemm " + args, &rc);
    EXPECT_EQ(rc, 2) << args << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << out;
    EXPECT_EQ(out.find("GFLOP"), std::string::npos) << args << out;  // nothing timed first
  }
  // A conv: shape alone is timed at --batch (refused, it could only be timed at 64; an audit).
  out = run("bench gemm --shapes conv:3x4k3@8x8 --batch 2 --min-time 0.001", &rc);
  EXPECT_EQ(rc, 0) << out;
  // bench compress times a method's steady state: PowerSGD's calls before start_iter (uncompressed copies) were the
  // fastest and were reported with the compressed ratio (46 GB/s for 3.3); a warm-up too long to run, a tensor past
  // what the sparsifiers index (they threw after the others had run) are refused first.
  out = run("bench compress --method 'powersgd:rank=4,start_iter=3' --size 64K --min-time 0.002 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"warmup_calls\":3"), std::string::npos) << out;
  EXPECT_NE(out.find("\"empty_payload\":false"), std::string::npos) << out;
  // A method that sends nothing (threshold above every value: the payload is empty) has an infinite ratio, which
  // JSON cannot hold: null, with "empty_payload": true saying why (it was a bare null).
  out = run("bench compress --method 'threshold:threshold=2.5' --size 4 --min-time 0.002 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"ratio\":null"), std::string::npos) << out;
  EXPECT_NE(out.find("\"empty_payload\":true"), std::string::npos) << out;
  EXPECT_NE(out.find("\"wire_bytes\":0"), std::string::npos) << out;
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"bench compress --method 'dgc:warmup_steps=5000' --size 1M",
            "warms up for 5000 calls; allowed in a benchmark: at most 1000"},
           {"bench compress --method fp16 --size 16G", "--size '16G' must be a byte count from 4 B to 16G - 4 B"},
           // (stod took 0x10; 15G wanted ~45 GB and met the out-of-memory killer)
           {"bench compress --method none --size 0x10", "--size '0x10' must be a byte count from 4 B"},
           {"bench compress --method none --size 16383M", "(allowed: at most half of it)"},
           {"bench gemm --shapes 4x4x4 --transport bogus", "--transport = 'bogus' (allowed: auto, tcp, shm, mpi)"},
           {"selftest-compress --timeout -1", "--timeout = -1 (allowed: seconds from 0.001"}}) {
    out = run(args, &rc);
    EXPECT_EQ(rc, 2) << args << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << out;
  }
  // Flags of other operations (taken and ignored: --op allgather --reduce prod printed prod).
  out = run("bench coll --op allgather --reduce prod", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--reduce prod: allgather reduces nothing; allowed with --reduce: allreduce, reduce_scatter, "
                     "reduce"),
            std::string::npos)
      << out;
  out = run("bench coll --op alltoall --root 1", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--root 1: alltoall has no root"), std::string::npos) << out;
  // bench coll --no-check says nothing was checked (it reported 0 wrong, as a verified run does).
  out = run("bench coll --op allreduce --min-bytes 8 --max-bytes 8 --no-check --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"wrong\":null"), std::string::npos) << out;
  // --name lands in the YAML as a plain scalar: "my: box" broke the file, "#lab" named the cluster null.
  for (const char* bad : {"my: box", "#lab", ""}) {
    out = run("sim calibrate --bench " + dir + "/bench.jsonl --peak 1GFLOP/s --name '" + bad + "' --out -", &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find("--name = '" + std::string(bad) + "' (allowed: 1 to 64 letters"), std::string::npos) << out;
  }
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// `sim calibrate` with the cluster file on stdout: the report goes to stderr, so `> file.yaml` loads (the fit table
// came first and the file was refused); a few stray records of a transport not written are left out with a warning
// (they failed the whole run); without --ranks only the largest world's samples are fitted, as the help says (all
// worlds were pooled and the check table showed one of them); a directory given as --bench is named as such.
TEST(Cli, CalibrateToStdoutGivesALoadableFileAndFitsOneWorld) {
  const std::string dir = ::testing::TempDir() + "conduit_calibrate_stdout_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir).c_str()), 0);
  {
    std::ofstream b(dir + "/bench.jsonl");
    // world 4: alpha 20 us, 1 GB/s; world 2: three times slower, which a pooled fit would blur.
    for (int world : {2, 4})
      for (double n = 1024; n <= 16e6; n *= 4) {
        const double t = (world == 4 ? 1 : 3) * (2 * 20e-6 + n / 1e9);
        b << "{\"op\":\"allreduce\",\"algo\":\"ring\",\"transport\":\"shm\",\"world\":" << world << ",\"bytes\":" << n
          << ",\"time_us\":" << t * 1e6 << "}\n";
      }
    b << "{\"op\":\"allreduce\",\"algo\":\"ring\",\"transport\":\"tcp\",\"world\":4,\"bytes\":1024,"
         "\"time_us\":90}\n";
  }
  const std::string cmd = std::string(CONDUIT_BINARY) + " sim calibrate --bench " + dir +
                          "/bench.jsonl --peak 1GFLOP/s > " + dir + "/out.yaml 2> " + dir + "/err.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream ef(dir + "/err.txt");
  const std::string err((std::istreambuf_iterator<char>(ef)), std::istreambuf_iterator<char>());
  EXPECT_NE(err.find("warning: tcp left out"), std::string::npos) << err;
  EXPECT_NE(err.find("shm         7 samples"), std::string::npos) << err;  // world 4 only
  EXPECT_NE(err.find("rms error 0.0%"), std::string::npos) << err;
  ClusterSpec c = load_cluster(dir + "/out.yaml");
  EXPECT_EQ(c.name, "local-calibrated");
  int rc = 0;
  std::string out = run("sim calibrate --bench " + dir + " --peak 1GFLOP/s", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--bench: '" + dir + "' is a directory"), std::string::npos) << out;
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// Inputs that hung the simulator or ate its memory (a bad-input audit): a pipe or a device as --jobs (read for ever),
// a layer-list pipeline of 10^18 micro-batches (its schedule, played out one by one, in memory), and LAS's
// starvation guard cycling three endless jobs through its queues (events without end): each is one line, exit 2.
TEST(Cli, PipesDevicesEndlessSchedulesAndEventsAreRefused) {
  const std::string dir = ::testing::TempDir() + "conduit_sim_refusals_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir + " && mkfifo " + dir + "/pipe").c_str()), 0);
  int rc = 0;
  for (const std::string& jobs : {dir + "/pipe", std::string("/dev/zero")}) {
    const std::string out = run("sim cluster --jobs " + jobs + " --gpus 8", &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find("--jobs: '" + jobs + "' is not a regular file (a pipe, device or socket); allowed: a CSV file"),
              std::string::npos)
        << out;
  }
  std::string out =
      run("sim step --cluster dgx-a100 --gpus 8 --model layers --layers-spec dense:4x4,dense:4x4 --pp 2 --global-batch "
          "4000000000000000000",
          &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("makes 1000000000000000000 micro-batches a step on each of the 2 stages"), std::string::npos)
      << out;
  EXPECT_NE(out.find("allowed: micro-batches x --pp up to 10000000"), std::string::npos) << out;
  // (a deep pipeline of few micro-batches each is as many operations: 4096 stages)
  std::string deep;
  for (int i = 0; i < 4096; ++i) deep += std::string(i ? "," : "") + "dense:8x8";
  out = run("sim step --cluster dgx-a100 --gpus 4096 --model layers --layers-spec " + deep +
                " --pp 4096 --global-batch 10000",
            &rc);
  EXPECT_EQ(rc, 2) << out.substr(0, 300);
  EXPECT_NE(out.find("makes 10000 micro-batches a step on each of the 4096 stages"), std::string::npos)
      << out.substr(0, 300);
  // So is a GPT pipeline split unevenly (played out too): bounded in its operations and memory (p 16384 asked for 17
  // GB), its window no longer than its micro-batches (one micro-batch over 8192 stages ran out of a 3 GB limit).
  const std::string uneven =
      "sim step --cluster dgx-a100 --gpus 4096 --pp 4096 --model gpt --layers 4097 --hidden 512 --heads 8 --seq 128 "
      "--vocab 1024 --first-stage-layers 2";
  out = run(uneven + " --global-batch 10000", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("pp (4096) x 10000 micro-batches is 40960000 (allowed: up to 25000000)"), std::string::npos)
      << out;
  // (the memory bound alone: p x min(2p + 2, m); and a batch whose product with p passes 2^63, which wrapped
  // negative, passed the bound and ran for ever)
  out = run(uneven + " --global-batch 1500", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("pp (4096) x min(2 pp + 2, 1500 micro-batches) is 6144000 (allowed: up to 4194304)"),
            std::string::npos)
      << out;
  out =
      run("sim step --cluster dgx-a100 --gpus 8 --tp 2 --pp 4 --model gpt --layers 12 --hidden 768 --heads 12 "
          "--first-stage-layers 3 --last-stage-layers 1 --global-batch 3000000000000000000",
          &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("pp (4) x 3000000000000000000 micro-batches is over 2^63 (allowed: up to 25000000)"),
            std::string::npos)
      << out;
  out = run(uneven + " --global-batch 1 --json", &rc);
  EXPECT_EQ(rc, 0) << out.substr(0, 300);
  EXPECT_NE(out.find(R"("stage_layers":{"first":2,"last":1,"middle":1,"uneven":true})"), std::string::npos)
      << out.substr(0, 300);
  // A file over 1 GiB (sparse: nothing written) is refused before it is read.
  ASSERT_EQ(std::system(("truncate -s 1100M " + dir + "/big.csv").c_str()), 0);
  out = run("sim cluster --jobs " + dir + "/big.csv --gpus 8", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("big.csv' holds over 1 GiB; allowed: a CSV file of jobs, up to 1 GiB"), std::string::npos) << out;
  {
    std::ofstream t(dir + "/endless.csv");
    t << "id,submit_s,gpus,model,iterations\n";
    for (const char* id : {"a", "b", "c"}) t << id << ",0,8,gpt2-small,1000000000000\n";
  }
  out = run("sim cluster --jobs " + dir + "/endless.csv --gpus 8 --scheduler las --promote-knob 2", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("cluster simulation: over 10000000 scheduling events"), std::string::npos) << out;
  EXPECT_NE(out.find("a larger --promote-knob or --las-threshold, or --promote-knob 0"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// Flags a bad-input audit found taken silently or named wrongly: an integer past 64 bits (CLI11 clamped it, and
// LLONG_MIN read as "left out"; 010 read as octal 8), --group 0, --dp 0 and --gather-bytes 0 (taken as left out), a
// transformer's shape with --model layers (ignored), a negative --batch-per-gpu (taken as strong scaling), a count of
// --gpus-list named as --gpus, a cluster file's size named as --gpus, and sim coll's table printed before its refusal.
// Each one line, exit 2.
TEST(Cli, OutOfRangeZeroAndIgnoredFlagsAreRefusedInOneLine) {
  const std::string dir = ::testing::TempDir() + "conduit_sim_flags_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()), 0);
  {
    std::string yaml = preset_yaml("dgx-a100");
    const size_t at = yaml.find("    gpus: 8");
    ASSERT_NE(at, std::string::npos);
    yaml.insert(at, "    count: 10000000\n");
    std::ofstream(dir + "/huge.yaml") << yaml;
  }
  int rc = 0;
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"sim step --model gpt2-small --global-batch 8 --hidden -99999999999999999999",
            "--hidden: an integer out of range: -99999999999999999999 (allowed: -9223372036854775807 to "
            "9223372036854775807 at most, or the option's own range)"},
           {"sim step --model gpt2-small --global-batch 99999999999999999999",
            "--global-batch: an integer out of range: 99999999999999999999"},
           {"sim coll --gpus 16 --size 1M --group 0", "--group = 0: a collective needs at least 2 ranks"},
           {"sim step --model gpt2-small --global-batch 8 --layers 010",
            "--layers: '010': a decimal integer without leading zeros (0x and 0 prefixes read as hexadecimal and "
            "octal)"},
           {"sim step --model gpt2-small --global-batch 0x8", "--global-batch: '0x8': a decimal integer"},
           {"sim step --model gpt2-small --global-batch 8 --zero 3 --gather-bytes 0",
            "--gather-bytes = 0 (allowed: 1 (int8 blocks with their scales), 2, 4, or leave it out: as held)"},
           {"sim step --model gpt2-small --global-batch 8 --zero 3 --gather-bytes -1", "--gather-bytes = -1 (allowed:"},
           {"sim step --model gpt2-small --global-batch 8 --dp 0.5",
            "--dp: '0.5': an integer in decimal digits (no blanks, no '+')"},
           // (strtoll skipped the blank and took the '+': both were 8)
           {"sim step --model gpt2-small --global-batch ' 8'", "--global-batch: ' 8': an integer in decimal digits"},
           {"sim step --model gpt2-small --global-batch +8", "--global-batch: '+8': an integer in decimal digits"},
           {"sim coll --gpus 16 --size 1M --group -9223372036854775808",
            "--group: an integer out of range: -9223372036854775808"},
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --batch-per-gpu 4",
            "--global-batch with --batch-per-gpu: strong and weak scaling; allowed: one of them"},
           {"sim step --model gpt2-small --global-batch 8 --dp 0",
            "--dp = 0 (allowed: a positive data-parallel size, or leave it out for gpus / (tp pp))"},
           {"sim step --model gpt2-small --global-batch 8 --pp 2 --first-stage-layers -2",
            "--first-stage-layers = -2 (allowed: 0 or more transformer layers)"},
           {"sim step --model gpt2-small --global-batch 8 --attention-kernels flash4",
            "--attention-kernels = 'flash4' (allowed: fused, Megatron-LM's scale-mask-softmax; eager, PyTorch's scale, "
            "mask, softmax and dropout one kernel each; flash, FlashAttention's, the scores never in memory; flash2 or "
            "flash3, FlashAttention-2 or -3 at the rates the cluster file's attention_calibration gives)"},
           {"sim step --model layers --layers-spec dense:4x4 --hidden 5 --global-batch 8",
            "--hidden: a transformer's shape, and --model layers takes its layers from --layers-spec"},
           {"sim step --model layers --layers-spec dense:4x4 --mlp swiglu --global-batch 8",
            "--mlp: a transformer's MLP"},
           // (the error named --algorithm, a flag sim step does not have)
           {"sim step --model gpt2-small --global-batch 8 --dp-algorithm foo",
            "--dp-algorithm = 'foo' (allowed: auto, ring,"},
           // (sim scale took --gpus and ignored it; sim plan took settings sim step refuses, ignored or dropping plans)
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --gpus 32",
            "--gpus: sim scale takes its sizes from --gpus-list; allowed: leave it out"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --no-zero-prefetch --zero 0",
            "--no-zero-prefetch: about ZeRO's parameter gathers, and this search has no ZeRO plans"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --no-zero-prefetch --zero-allgather-bucket 1M",
            "--zero-allgather-bucket with --no-zero-prefetch"},
           // (a compression no plan can take: only uncompressed plans came back, exit 0)
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --sync local-sgd:4 --compression int8",
            "--compression int8 with --sync local-sgd: local SGD averages the parameters uncompressed"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --zero 0 --compression int4",
            "--compression int4 is ZeRO's reduce-scatter wire (qgZ), and this search has no ZeRO plans"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --zero 1 --compression topk:0.01",
            "--compression topk:0.01: it compresses the gradients' allreduce, which ZeRO replaces"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --zero 0 --compression powersgd:1000",
            "--compression powersgd:1000: the rank exceeds the smallest weight matrix side of every searched plan "
            "(hidden / tp = 768)"},
           {"sim plan --model gpt2-small --gpus 16 --global-batch 64 --zero-shard-group 2 --zero-hpz 2",
            "--zero-shard-group with --zero-hpz: the gathers run within the shard group already"},
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --batch-per-gpu -5",
            "--batch-per-gpu = -5 (allowed: a positive number of sequences)"},
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,12",
            "--gpus-list = '8,12': 12 must be a multiple of the 8 accelerators per node"},
           // (planned over every configuration, each size ran without them)
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --tp 8 --pp 2",
            "--tp applies with --fixed only (allowed: add --fixed to simulate that configuration at every size, or "
            "leave it out to plan each size)"},
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --recompute full", "--recompute applies"},
           {"sim scale --model gpt2-small --global-batch 64 --gpus-list 8,16 --sp", "--sp applies with --fixed only"},
           {"sim step --cluster " + dir + "/huge.yaml --model gpt2-small --global-batch 8",
            "cluster 'dgx-a100': its nodes' counts describe 80000000 accelerators, beyond the simulator's limit of "
            "262144"},
           {"sim coll --size 1T --op all-to-all --gpus 262144",
            "no algorithm can run all-to-all on 262144 ranks of dgx-a100"}}) {
    const std::string out = run(args, &rc);
    EXPECT_EQ(rc, 2) << args << ": " << out;
    EXPECT_NE(out.find(want), std::string::npos) << args << ": " << out;
    EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << args << ": " << out;
  }
  // (a group left out is all ranks, as before)
  const std::string out = run("sim coll --gpus 16 --size 1M --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"ranks\":16"), std::string::npos) << out;
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

// The emulated cluster's state file (a pipe in its place blocked every command that read it; no hosts crashed
// `cluster run`), a hosts file giving a bandwidth twice under its two names (the last won), and the launcher's grace
// period from the environment (its range said 1e9 where the flag's is 3600). Nothing is created: each is refused
// before any namespace.
TEST(Cli, DamagedClusterStateAndHostsFilesAndTheGracePeriodAreRefused) {
  const std::string dir = ::testing::TempDir() + "conduit_cluster_state_" + std::to_string(::getpid());
  ASSERT_EQ(
      std::system(("rm -rf " + dir + " && mkdir -p " + dir + " && mkfifo " + dir + "/cluster-piped.json").c_str()), 0);
  std::ofstream(dir + "/cluster-empty.json") << R"({"name":"empty","switch_ns":"conduit-empty-sw","hosts":[]})";
  std::ofstream(dir + "/twice.yaml") << "defaults: {bandwidth: 100mbit}\nhosts: [{bandwidth: 1gbit, rate: 10mbit}]\n";
  int rc = 0;
  ASSERT_EQ(::setenv("CONDUIT_CLUSTER_STATE_DIR", dir.c_str(), 1), 0);
  // (the cluster commands need root before they read anything: elsewhere they say so, and only that is checked)
  const bool root = ::geteuid() == 0;
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"cluster exec --name piped 0 -- true",
            "cluster-piped.json' is not a regular file (a pipe, device or socket)"},
           {"cluster run --name empty -- true", "cluster-empty.json is damaged (0 hosts; allowed: 1 to 250)"},
           {"cluster up --name fresh --hosts-file " + dir + "/twice.yaml",
            "hosts[0].rate: given twice (bandwidth and rate are one setting, latency and delay another)"}}) {
    const std::string out = run(args, &rc);
    EXPECT_EQ(rc, 2) << args << ": " << out;
    EXPECT_NE(out.find(root ? want : std::string("root")), std::string::npos) << args << ": " << out;
  }
  ::unsetenv("CONDUIT_CLUSTER_STATE_DIR");
  ASSERT_EQ(::setenv("CONDUIT_LAUNCH_GRACE", "-1", 1), 0);
  const std::string out = run("launch -n 2 -- true", &rc);
  ::unsetenv("CONDUIT_LAUNCH_GRACE");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("CONDUIT_LAUNCH_GRACE='-1' is invalid: expected a decimal number of seconds in [0.001, 3600]"),
            std::string::npos)
      << out;
  // Settings read when first used are checked at start-up: a bad ring segment size passed where shm's fast
  // allreduce served (and failed mid-run where a ring ran), a bad tcp budget or interface unless the run was over tcp.
  for (const auto& [var, value, want] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"CONDUIT_RING_SEGMENT_BYTES", "63",
            "CONDUIT_RING_SEGMENT_BYTES='63' is 63 bytes (allowed: 64 bytes to 1G)"},
           {"CONDUIT_TCP_UNEXPECTED_BYTES", "2T", "CONDUIT_TCP_UNEXPECTED_BYTES=2T is more than 1T; allowed: 0 to 1T"},
           {"CONDUIT_SOCKET_IFNAME", "nosuch0",
            "CONDUIT_SOCKET_IFNAME=nosuch0 names no interface with an IPv4 address (the tcp transport speaks IPv4 "
            "only); allowed here: lo"}}) {
    ASSERT_EQ(::setenv(var.c_str(), value.c_str(), 1), 0);
    const std::string o = run("bench coll --op allreduce -b 1K -e 1K -n 1 -w 0 --transport shm", &rc);
    ::unsetenv(var.c_str());
    EXPECT_EQ(rc, 2) << var << ": " << o;
    EXPECT_NE(o.find(want), std::string::npos) << var << ": " << o;
  }
  EXPECT_EQ(std::system(("rm -rf " + dir).c_str()), 0);
}

}  // namespace
}  // namespace conduit::sim
