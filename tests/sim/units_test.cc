// Units in cluster files, and the smaller switches of the step model (ZeRO-1/2 traffic, top-k, async, pipeline
// inference) that the closed-form tests do not reach.
#include "sim/units.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "sim/inference.h"
#include "sim/plan.h"
#include "sim/step.h"

namespace conduit::sim {
namespace {

TEST(Units, ParseEveryUnitAndRejectTheRest) {
  EXPECT_DOUBLE_EQ(parse_bandwidth("200 Gb/s", "f"), 25e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("300 GB/s", "f"), 300e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1.5 Mb/s", "f"), 1.5e6 / 8);
  EXPECT_DOUBLE_EQ(parse_bandwidth("12B/s", "f"), 12);
  EXPECT_DOUBLE_EQ(parse_duration("0.7 us", "f"), 0.7e-6);
  EXPECT_DOUBLE_EQ(parse_duration("130 ns", "f"), 130e-9);
  EXPECT_DOUBLE_EQ(parse_duration("2 ms", "f"), 2e-3);
  EXPECT_DOUBLE_EQ(parse_size("80 GiB", "f"), 80.0 * (1LL << 30));
  EXPECT_DOUBLE_EQ(parse_size("32 GB", "f"), 32e9);
  EXPECT_DOUBLE_EQ(parse_size("4 KiB", "f"), 4096);
  EXPECT_DOUBLE_EQ(parse_flops("312 TFLOP/s", "f"), 312e12);
  EXPECT_DOUBLE_EQ(parse_flops("20 GFLOP/s", "f"), 20e9);
  for (const char* bad : {"200", "200 Gbps", "fast", "-1 GB/s", "nan GB/s"}) {
    try {
      parse_bandwidth(bad, "nodes[0].nic.bandwidth");
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("nodes[0].nic.bandwidth"), std::string::npos) << e.what();
    }
  }
  // Decimal numbers only, units without spaces, P prefixes, rates that keep times finite (found by a review: 0x10,
  // "1 G b / s" and 1e-300 B/s were taken, 1e400 was "not a number").
  EXPECT_DOUBLE_EQ(parse_bandwidth("1e2 Gb/s", "f"), 12.5e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1 PB/s", "f"), 1e15);
  EXPECT_DOUBLE_EQ(parse_size("1 PiB", "f"), std::pow(1024.0, 5));
  EXPECT_DOUBLE_EQ(parse_flops(".5 TFLOP/s", "f"), 0.5e12);
  for (const char* bad : {"0x10 GB/s", "1 G b / s", "1e-300 B/s", "inf GB/s", "1e GB/s"})
    EXPECT_THROW(parse_bandwidth(bad, "f"), ConfigError) << bad;
  try {
    parse_bandwidth("1e400 Gb/s", "f");
    ADD_FAILURE() << "1e400 taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("above the largest value"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_flops("1e-9 FLOP/s", "f"), ConfigError);
  EXPECT_THROW(parse_duration("3 hours", "f"), ConfigError);
  EXPECT_THROW(parse_size("3 Gb", "f"), ConfigError);
  // Sizes under a byte, and non-zero values that underflow to 0, are refused (0.5 B of memory was taken, and a
  // latency of 1e-400 us became 0); 0 itself stays allowed.
  EXPECT_THROW(parse_size("0.5 B", "f"), ConfigError);
  EXPECT_THROW(parse_size("1e-300 GiB", "f"), ConfigError);
  EXPECT_THROW(parse_duration("1e-400 us", "f"), ConfigError);
  EXPECT_DOUBLE_EQ(parse_duration("0 us", "f"), 0.0);
  EXPECT_DOUBLE_EQ(parse_duration("0.0e-400 us", "f"), 0.0);
  EXPECT_THROW(parse_flops("3 TOPS", "f"), ConfigError);
  EXPECT_EQ(format_seconds(1.5e-3), "1.50 ms");
  EXPECT_EQ(format_gb(31.4e9), "31.4 GB");
}

GptModel gpt(int l, long long h, long long a, long long s, long long V) {
  GptModel m;
  m.layers = l;
  m.hidden = h;
  m.heads = a;
  m.seq = s;
  m.vocab = V;
  return m;
}

// Tensor parallelism splits the layers' weights and the word embeddings (vocab-parallel) over the t ranks; the
// position embeddings stay whole on each (they were divided by t too).
TEST(Step, TensorParallelRanksEachHoldThePositionEmbeddingsWhole) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  GptModel m = gpt(24, 2048, 16, 2048, 51200);
  ParallelConfig c;
  c.global_batch = 8;
  c.micro_batch = 1;
  c.tp = 8;
  const StepResult r = simulate_step(net, m, c);
  const double per_rank = 24 * gpt_layer_parameters(m) / 8 + 51200.0 * 2048 / 8 + 2048.0 * 2048;
  EXPECT_NEAR(r.memory.params, 2 * per_rank, 1e-9 * r.memory.params);  // fp16 weights
}

TEST(Step, ZeroStagesMoveTheSameGradientBytesPlusAParameterGather) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(24, 2048, 16, 2048, 51200);
  ParallelConfig c;
  c.global_batch = 128;
  c.micro_batch = 2;
  c.dp_overlap = false;
  c.dp_algorithm = Algorithm::kRing;  // ring RS + AG is exactly one ring allreduce (auto may pick SHARP for it)
  c.bucket_bytes = 1e12;              // one bucket: the RS and the AG then have the allreduce's latency terms
  c.zero_prefetch = false;            // (ZeRO-1/2: one allgather after the step, not one a layer)
  StepResult z0 = simulate_step(net, m, c);
  c.zero = 1;
  StepResult z1 = simulate_step(net, m, c);
  c.zero = 2;
  StepResult z2 = simulate_step(net, m, c);
  c.zero = 3;
  c.zero_prefetch = true;
  StepResult z3 = simulate_step(net, m, c);
  // ZeRO-1/2: reduce-scatter + allgather ~ one allreduce (same wire bytes), and the optimizer shards by 64.
  EXPECT_NEAR(z1.breakdown.dp_comm / z0.breakdown.dp_comm, 1.0, 1e-9);
  EXPECT_DOUBLE_EQ(z1.breakdown.dp_comm, z2.breakdown.dp_comm);
  EXPECT_NEAR(z0.breakdown.optimizer / z1.breakdown.optimizer, 64, 64 * 0.1);
  // ZeRO-3 gathers the parameters twice per micro-batch: more traffic than one allreduce per step.
  EXPECT_GT(z3.breakdown.dp_comm, z0.breakdown.dp_comm);
  // Its memory: the sharded state plus what it gathers (the running layer, no prefetch without overlap, and the
  // embeddings) and one layer's full gradients before their reduce-scatter (it counted the shards alone), and the
  // embeddings' full gradients, whole until the input embedding's backward, the last.
  const double layer = gpt_layer_parameters(m), emb = double(m.vocab + m.seq) * m.hidden;
  EXPECT_NEAR(z3.memory.params, z0.memory.params / 64 + (layer + emb) * 2, 1e-9 * z3.memory.params);
  EXPECT_NEAR(z3.memory.grads, z0.memory.grads / 64 + (layer + emb) * c.grad_bytes, 1e-9 * z3.memory.grads);
  c.dp_overlap = true;  // the next layer prefetched
  EXPECT_NEAR(simulate_step(net, m, c).memory.params, z0.memory.params / 64 + (2 * layer + emb) * 2,
              1e-9 * z3.memory.params);
}

// Without overlap every bucket still is its own call, all after the backward pass: never faster than with overlap
// (it charged one call of the whole gradient, which made a large ring's step 8x faster with --no-overlap).
TEST(Step, NoOverlapPaysEveryBucketAfterTheBackward) {
  for (int zero : {0, 1}) {
    Topology topo(load_cluster("dgx-h100"), 4096);
    CollectiveModel net(topo);
    GptModel m = gpt(12, 768, 12, 1024, 50304);
    ParallelConfig c;
    c.global_batch = 4096;
    c.zero = zero;
    c.zero_prefetch = false;  // (ZeRO-1's allgather in one call after the step, with or without overlap)
    c.dp_algorithm = Algorithm::kRing;
    StepResult on = simulate_step(net, m, c);
    c.dp_overlap = false;
    StepResult off = simulate_step(net, m, c);
    EXPECT_DOUBLE_EQ(off.breakdown.dp_comm, on.breakdown.dp_comm) << zero;
    EXPECT_DOUBLE_EQ(off.breakdown.dp_exposed, off.breakdown.dp_comm) << zero;
    EXPECT_GE(off.time, on.time) << zero;
    // ~10 buckets of 25 MB, each paying the ring's 2(p-1) latencies: far more than one call would.
    c.bucket_bytes = 1e12;
    StepResult one = simulate_step(net, m, c);
    EXPECT_GT(off.breakdown.dp_comm, 3 * one.breakdown.dp_comm) << zero;
  }
}

// ZeRO-3 shards the embeddings too, so it gathers and reduce-scatters them like a layer's parameters: GPT-2 small's
// embeddings are a third of its parameters and its ZeRO-3 traffic grows by about that (they were left out).
TEST(Step, ZeroThreeGathersTheEmbeddingsToo) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  c.dp_algorithm = Algorithm::kRing;
  GptModel m = gpt(12, 768, 12, 1024, 50304);
  StepResult r = simulate_step(net, m, c);
  ASSERT_EQ(r.microbatches, 1);
  // Per micro-batch: each layer's parameters gathered twice and its gradients reduce-scattered, and the same for the
  // embeddings ((V + s) h parameters), 2 bytes an element.
  const Group g{64, 1, 0};
  auto ag = [&](double n) { return net.time(Collective::kAllGather, Algorithm::kRing, g, n); };
  auto rs = [&](double n) { return net.time(Collective::kReduceScatter, Algorithm::kRing, g, n); };
  const double layer = gpt_layer_parameters(m), emb = (50304 + 1024) * 768.0;
  const double layers_only = 12 * (2 * ag(layer * 2) + rs(layer * 2));
  EXPECT_NEAR(r.breakdown.dp_comm, layers_only + 2 * ag(emb * 2) + rs(emb * 2), 1e-9 * r.breakdown.dp_comm);
  EXPECT_GT(r.breakdown.dp_comm, 1.2 * layers_only);
}

// ZeRO-2 keeps only its gradient shard, so it reduce-scatters after every micro-batch's backward; ZeRO-1 once per
// iteration. With one micro-batch they are the same.
TEST(Step, ZeroTwoReduceScattersEveryMicroBatch) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(24, 2304, 24, 2048, 51200);
  ParallelConfig c;
  c.global_batch = 256;  // 4 per replica
  c.micro_batch = 1;
  c.dp_overlap = false;
  c.zero = 1;
  StepResult z1 = simulate_step(net, m, c);
  c.zero = 2;
  StepResult z2 = simulate_step(net, m, c);
  EXPECT_EQ(z2.microbatches, 4);
  // dp_comm = k x (one micro-batch's reduce-scatter) + the parameter allgather, k = 1 (ZeRO-1) or 4 (ZeRO-2).
  const double rs = (z2.breakdown.dp_comm - z1.breakdown.dp_comm) / 3;
  EXPECT_GT(rs, 0);
  EXPECT_NEAR(z2.breakdown.dp_exposed - z1.breakdown.dp_exposed, 3 * rs, 1e-9);
  c.global_batch = 64;  // one micro-batch per replica
  StepResult one2 = simulate_step(net, m, c);
  c.zero = 1;
  StepResult one1 = simulate_step(net, m, c);
  EXPECT_DOUBLE_EQ(one2.breakdown.dp_comm, one1.breakdown.dp_comm);
}

// --zero-reduce step (conduit train's ZeRO-2, FSDP's no_sync): the micro-batches summed in whole-gradient buckets and
// reduce-scattered once, as ZeRO-1, which holds the whole gradients too; micro-batch (DeepSpeed's) is the GPT
// model's default.
TEST(Step, ZeroTwoReducingOnceAStepIsZeroOnesExchange) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(24, 2304, 24, 2048, 51200);
  for (bool overlap : {false, true}) {
    ParallelConfig c;
    c.global_batch = 256;  // 4 per replica
    c.dp_overlap = overlap;
    c.zero = 1;
    const StepResult z1 = simulate_step(net, m, c);
    c.zero = 2;
    const StepResult each = simulate_step(net, m, c);
    c.zero_reduce = ZeroReduce::kEveryMicroBatch;
    const StepResult each_given = simulate_step(net, m, c);
    c.zero_reduce = ZeroReduce::kOncePerStep;
    const StepResult once = simulate_step(net, m, c);
    EXPECT_EQ(each_given.time, each.time) << overlap;
    EXPECT_DOUBLE_EQ(once.breakdown.dp_comm, z1.breakdown.dp_comm) << overlap;
    EXPECT_DOUBLE_EQ(once.breakdown.dp_exposed, z1.breakdown.dp_exposed) << overlap;
    EXPECT_DOUBLE_EQ(once.memory.grads, z1.memory.grads) << overlap;
    EXPECT_GT(once.memory.grads, 60 * each.memory.grads) << overlap;             // (the 64th, the shard)
    EXPECT_GT(each.breakdown.dp_comm, 1.5 * once.breakdown.dp_comm) << overlap;  // (3 more reduce-scatters)
    EXPECT_LT(once.time, each.time) << overlap;
    // (the optimizer's state sharded alike)
    EXPECT_DOUBLE_EQ(once.memory.optimizer, each.memory.optimizer) << overlap;
  }
}

// With shard groups, --zero-reduce micro-batch (stages 2 and 3) allreduces the slices across the groups once a step,
// after the last micro-batch (MiCS's accumulation, as conduit train runs it): what the three earlier micro-batches add
// is the groups' reduce-scatters alone, the same whatever the links between the groups (nodes of 8, groups of 8: the
// reduce-scatters on the node's links, the allreduce on the NICs).
TEST(Step, ZeroTwoWithinShardGroupsAllreducesAcrossThemOnceAStep) {
  for (int zero : {2, 3}) {
    std::vector<double> added, across;
    for (double nic : {25e9 / 8, 100e9 / 8}) {
      ClusterSpec spec = load_cluster("dgx-a100");
      for (auto& kind : spec.node_kinds) kind.nic.bandwidth = nic;
      Topology topo(spec, 64);
      CollectiveModel net(topo);
      GptModel m = gpt(24, 2304, 24, 2048, 51200);
      ParallelConfig c;
      c.global_batch = 256;  // 4 micro-batches a replica
      c.dp_overlap = false;
      c.zero_prefetch = false;
      c.zero = zero;
      c.zero_shard = 8;
      c.zero_reduce = ZeroReduce::kOncePerStep;
      const StepResult once = simulate_step(net, m, c);
      c.zero_reduce = ZeroReduce::kEveryMicroBatch;
      const StepResult each = simulate_step(net, m, c);
      added.push_back(each.breakdown.dp_comm - once.breakdown.dp_comm);
      across.push_back(once.breakdown.dp_comm);
    }
    EXPECT_GT(added[0], 0) << zero;
    EXPECT_NEAR(added[0], added[1], 1e-9 * added[0]) << zero;
    EXPECT_GT(across[0], across[1] * 1.5) << zero;  // (the allreduce across the groups slowed down on the slower NICs)
  }
}

// ZeRO-3 with --zero-reduce step (conduit train's default): the layers' gradients summed over the micro-batches and
// reduce-scattered once, the whole gradients held meanwhile; every micro-batch (the GPT model's default, DeepSpeed's)
// pays each earlier micro-batch's reduce-scatters too: (M - 1) of them, the same each.
TEST(Step, ZeroThreeReducingOnceAStepHoldsTheWholeGradients) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(24, 2304, 24, 2048, 51200);
  for (bool overlap : {false, true}) {
    std::vector<double> extra;
    for (long long per_replica : {2, 4}) {
      ParallelConfig c;
      c.global_batch = 64 * per_replica;
      c.zero = 3;
      c.dp_overlap = overlap;
      c.zero_reduce = ZeroReduce::kOncePerStep;
      const StepResult once = simulate_step(net, m, c);
      c.zero_reduce = ZeroReduce::kModelDefault;
      const StepResult each = simulate_step(net, m, c);
      EXPECT_EQ(each.config.zero_reduce, ZeroReduce::kEveryMicroBatch);
      extra.push_back(each.breakdown.dp_comm - once.breakdown.dp_comm);
      EXPECT_NEAR(once.memory.grads, gpt_parameters(m) * c.grad_bytes, 1e-9 * once.memory.grads);
      EXPECT_LT(each.memory.grads * 4, once.memory.grads);  // (a layer's and the embeddings' whole, the rest sharded)
      EXPECT_LT(once.time, each.time);
      EXPECT_LE(once.breakdown.zero3_exposed, each.breakdown.zero3_exposed);
    }
    EXPECT_GT(extra[0], 0) << overlap;
    EXPECT_NEAR(extra[1], 3 * extra[0], 1e-9 * extra[1]) << overlap;
  }
}

TEST(Step, TopkAndAsyncChangeTheExchange) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  GptModel m = gpt(12, 768, 12, 1024, 50304);
  ParallelConfig c;
  c.global_batch = 512;
  c.micro_batch = 8;
  StepResult base = simulate_step(net, m, c);
  c.compression = parse_compression("topk:0.001");
  StepResult tk = simulate_step(net, m, c);
  // (a call per tensor, as the runtime's: 148 allgathers, each recursive doubling as the runtime's rd, whose pieces
  // grow to half the gathered data at distance 32, across the nodes' one NIC: 0.59 of the uncompressed exchange;
  // under half while the pattern sent the largest pieces to the nearest rank, which rd does not)
  EXPECT_LT(tk.breakdown.dp_comm, base.breakdown.dp_comm * 0.7);
  // The calls of a bucket go once the bucket is full: the last bucket's tensors after the backward, not one
  // tensor's (the per-tensor calls were first timed as 148 buckets, each ready on its own: total / 148 exposed).
  {
    Topology t8(load_cluster("dgx-h100"), 8);
    CollectiveModel n8(t8);
    ParallelConfig s;
    s.global_batch = 8;
    s.compression = parse_compression("topk:0.01");
    const StepResult r = simulate_step(n8, m, s);
    const double exposed_exchange = r.breakdown.dp_exposed - r.breakdown.compression;
    EXPECT_GT(exposed_exchange, 5 * r.breakdown.dp_comm / (12 * 12 + 4)) << r.breakdown.dp_comm;
  }
  EXPECT_GT(tk.breakdown.compression, 0);
  // Every tensor sends one element at least (the runtime's k = ceil(density x size)): a density far below one element
  // a tensor costs what one element a tensor does, not nothing (topk:1e-300 was charged nothing on the wire).
  c.compression = parse_compression("topk:1e-300");
  const StepResult tiny = simulate_step(net, m, c);
  c.compression = parse_compression("topk:1e-12");
  EXPECT_EQ(tiny.breakdown.dp_comm, simulate_step(net, m, c).breakdown.dp_comm);
  EXPECT_GT(tiny.breakdown.dp_comm, 0);
  EXPECT_THROW(parse_compression("topk:0x0.1"), ConfigError);
  c.compression = parse_compression("none");
  c.sync = parse_sync("async");
  StepResult as = simulate_step(net, m, c);
  EXPECT_LE(as.breakdown.dp_exposed, base.breakdown.dp_exposed);
  EXPECT_NEAR(as.breakdown.dp_exposed,
              std::max(0.0, as.breakdown.dp_comm - (as.time - as.breakdown.dp_exposed - as.breakdown.optimizer -
                                                    as.breakdown.overlap_slowdown)),
              1e-9);
}

TEST(Inference, PipelineStagesAddLatencyButSplitTheWeights) {
  Topology topo(load_cluster("dgx-a100"), 16);
  CollectiveModel net(topo);
  GptModel m = gpt(96, 12288, 96, 2048, 51200);
  InferenceConfig c;
  c.tp = 8;
  c.pp = 2;
  c.batch = 8;
  InferenceResult two = simulate_inference(net, m, c);
  EXPECT_EQ(two.replicas, 1);
  EXPECT_TRUE(two.fits);
  c.pp = 1;
  InferenceResult one = simulate_inference(net, m, c);  // 175B in fp16 on 8 x 80 GB: 43.7 GB of weights each
  EXPECT_TRUE(one.fits);
  EXPECT_EQ(one.replicas, 2);
  // Each stage has half the layers; the first also holds the embeddings whole (V h split over tp, the position
  // embeddings s h whole on each rank).
  EXPECT_NEAR(two.weight_bytes * 2 - one.weight_bytes, 2.0 * (51200.0 / 8 + 2048) * 12288, 1);
  // Two batches in flight, one a stage: each stage holds half the layers' caches of both, as much as one replica's
  // whole model holds of one batch; half the weights leave room for more sequences a batch.
  EXPECT_EQ(two.batches_in_flight, 2);
  EXPECT_EQ(one.batches_in_flight, 1);
  EXPECT_DOUBLE_EQ(two.kv_bytes, one.kv_bytes);
  EXPECT_GT(two.max_batch, one.max_batch);
  // The stages serve as many sequences as two replicas (one batch in flight made it half), short of them by the
  // transfers between the stages and the last stage's share of the output layer, which sets the pace.
  EXPECT_LE(two.tokens_per_second, one.tokens_per_second);
  EXPECT_GT(two.tokens_per_second, 0.9 * one.tokens_per_second);
  GptModel twelve = m;
  twelve.heads = 12;
  try {
    InferenceConfig tp8;
    tp8.tp = 8;
    tp8.prompt = tp8.generate = 16;
    simulate_inference(net, twelve, tp8);
    ADD_FAILURE() << "tp 8 of 12 heads passed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--tp = 8 must divide --heads = 12"), std::string::npos) << e.what();
  }
}

// With a 256,000-token vocabulary the output layer runs on the last of 4 stages alone and takes more than its layers:
// that stage sets the steady-state rate, which no faster stage can lift. The throughput was p batches over the
// latency, as if the stages shared the work evenly: 31,404 tokens/s, as much as --pp 1, where the last stage alone
// serves about 21,000.
TEST(Inference, TheBusiestPipelineStageSetsTheThroughput) {
  Topology topo(load_cluster("dgx-h100"), 8);
  CollectiveModel net(topo);
  const GptModel m = gpt(16, 2048, 16, 4096, 256000);
  InferenceConfig c;
  c.pp = 4;
  c.batch = 8;
  c.prompt = 512;
  c.generate = 128;
  const InferenceResult four = simulate_inference(net, m, c);
  EXPECT_EQ(four.replicas, 2);
  // The last stage's work on one request: its 4 layers and the logits, as a 4-layer model on one GPU (which sends
  // no sampled token back to a first stage: its latency is a little under the stage's time).
  GptModel last = m;
  last.layers = 4;
  c.pp = 1;
  const InferenceResult alone = simulate_inference(net, last, c);
  const double ceiling = 2 * 8 * 128 / alone.request_latency;  // two replicas at the last stage's pace
  EXPECT_LE(four.tokens_per_second, ceiling);
  EXPECT_GT(four.tokens_per_second, 0.97 * ceiling);
  // p batches over the latency (the stages' work spread evenly) is well above it.
  EXPECT_LT(four.tokens_per_second, 0.75 * 2 * 4 * 8 * 128 / four.request_latency);
  // One stage holds the whole model: its rate is p batches over the latency, as before.
  const InferenceResult one = simulate_inference(net, m, c);
  EXPECT_NEAR(one.tokens_per_second, 8 * 8 * 128 / one.request_latency, 1e-9 * one.tokens_per_second);
  // The latency still runs the stages one after another: the stages add up to it.
  EXPECT_GT(four.request_latency, one.request_latency);
  // At that throughput the 4 batches in flight wait for the busiest stage in turn: a request takes what Little's law
  // says (4 x 8 sequences in flight a replica over its sequences a second), 1.5x the latency of a batch alone (which
  // the throughput was paired with), and a decode step 4 of the last stage's; at p = 1 both are the latency alone.
  const double sequences_per_s = four.tokens_per_second / 128 / four.replicas;
  EXPECT_NEAR(four.loaded_request_latency, 4 * 8 / sequences_per_s, 1e-9 * four.loaded_request_latency);
  EXPECT_GT(four.loaded_request_latency, 1.4 * four.request_latency);
  EXPECT_GT(four.loaded_decode_per_token, 1.2 * four.decode_per_token);
  EXPECT_LT(four.loaded_decode_per_token, 4 * four.decode_per_token);
  EXPECT_EQ(one.loaded_request_latency, one.request_latency);
  EXPECT_EQ(one.loaded_decode_per_token, one.decode_per_token);
  // Equal stages (a vocabulary too small to weigh): as alone, to rounding.
  c.pp = 4;
  const InferenceResult even = simulate_inference(net, gpt(16, 2048, 16, 4096, 16), c);
  EXPECT_NEAR(even.loaded_request_latency, even.request_latency, 0.05 * even.request_latency);
}

// Fused attention (FlashAttention, the serving default): a 32,000-token prompt of a 7B model keeps no s x s scores
// (4 b a s^2 bytes, 131 GB here, made it not fit an 80 GB GPU) and computes the causal half of them.
TEST(Inference, FusedAttentionKeepsNoScoresAndSkipsTheCausalHalf) {
  Topology topo(load_cluster("dgx-h100"), 8);
  CollectiveModel net(topo);
  GptModel m = gpt(32, 4096, 32, 32768, 32000);
  InferenceConfig c;
  c.prompt = 32000;
  c.generate = 256;
  const InferenceResult fused = simulate_inference(net, m, c);
  c.fused_attention = false;
  const InferenceResult unfused = simulate_inference(net, m, c);
  const double scores = 4.0 * 32 * 32000.0 * 32000.0;
  EXPECT_GT(unfused.memory_total - fused.memory_total, 0.95 * scores);
  EXPECT_LT(unfused.memory_total - fused.memory_total, scores);
  EXPECT_TRUE(fused.fits);
  EXPECT_FALSE(unfused.fits);
  EXPECT_GT(fused.max_batch, 0);
  EXPECT_EQ(unfused.max_batch, 0);
  // Attention is most of this prefill's FLOPs: halving them and writing no scores takes well over a third off.
  EXPECT_LT(fused.prefill, 0.65 * unfused.prefill);
  EXPECT_EQ(fused.kv_bytes, unfused.kv_bytes);
  EXPECT_EQ(fused.decode_per_token, unfused.decode_per_token);
}

TEST(Planner, DescribesAndExplainsInWords) {
  ParallelConfig c;
  c.dp = 4;
  c.tp = 8;
  c.pp = 2;
  c.schedule = Schedule::kInterleaved;
  c.virtual_stages = 2;
  c.sequence_parallel = true;
  EXPECT_EQ(describe_config(c), "dp=4 tp=8 pp=2 b=1 zero=0 recompute=none schedule=interleaved v=2 sp");
  StepResult a, b;
  a.time = 1;
  a.breakdown.compute = 0.8;
  a.breakdown.bubble = 0.2;
  b.time = 1.5;
  b.breakdown.compute = 0.8;
  b.breakdown.bubble = 0.7;
  auto lines = explain_plan(a, &b);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_NE(lines[0].find("compute 80%"), std::string::npos) << lines[0];
  EXPECT_NE(lines[2].find("pipeline bubble"), std::string::npos) << lines[2];
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

TEST(Robustness, RandomConfigurationsEitherFailCleanlyOrGiveFiniteResults) {
  // Fixed seed: 400 random (cluster, model, parallel configuration) triples. Every one either raises a
  // ConfigError naming a flag or yields a finite, positive time and memory.
  std::mt19937 rng(12345);
  auto pick = [&](std::initializer_list<long long> v) { return *(v.begin() + rng() % v.size()); };
  const char* clusters[] = {"dgx-a100", "dgx-h100", "ethernet-25g", "edge"};
  int ok = 0, rejected = 0;
  for (int i = 0; i < 400; ++i) {
    std::string cl = clusters[rng() % 4];
    long long gpus = cl == "edge" ? pick({8, 16, 64}) : pick({8, 16, 64, 256, 1024});
    Topology topo(load_cluster(cl), gpus);
    CollectiveModel net(topo);
    GptModel m;
    m.layers = static_cast<int>(pick({2, 12, 24, 30, 96}));
    m.heads = pick({8, 12, 16, 32});
    m.hidden = m.heads * pick({64, 128});
    m.seq = pick({128, 1024, 2048});
    m.vocab = pick({32000, 50304, 51200});
    ParallelConfig c;
    c.tp = static_cast<int>(pick({1, 2, 4, 8, 3}));
    c.pp = static_cast<int>(pick({1, 2, 4, 6}));
    c.micro_batch = static_cast<int>(pick({1, 2, 4}));
    c.global_batch = pick({8, 64, 256, 1000});
    c.zero = static_cast<int>(pick({0, 1, 2, 3}));
    c.recompute = static_cast<Recompute>(rng() % 3);
    c.schedule = static_cast<Schedule>(rng() % 3);
    c.virtual_stages = c.schedule == Schedule::kInterleaved ? 2 : 1;
    c.sequence_parallel = rng() % 2;
    c.compression = parse_compression(std::vector<std::string>{"none", "int8", "topk:0.01", "powersgd:2"}[rng() % 4]);
    c.sync = parse_sync(std::vector<std::string>{"bsp", "local-sgd:4", "async"}[rng() % 3]);
    try {
      StepResult r = simulate_step(net, m, c);
      EXPECT_TRUE(std::isfinite(r.time) && r.time > 0) << describe_config(r.config);
      EXPECT_TRUE(std::isfinite(r.memory.total()) && r.memory.total() > 0);
      EXPECT_GE(r.breakdown.dp_exposed, 0);
      ++ok;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--"), std::string::npos) << e.what();
      ++rejected;
    }
  }
  EXPECT_GT(ok, 10);  // (18 of 400 once local SGD took no compressor and int4 needed ZeRO, 2026-12-05)
  EXPECT_GT(rejected, 20);
}

}  // namespace
}  // namespace conduit::sim
