// Bad and extreme inputs to the simulator: cluster files, layer specs, job traces, flag combinations, sizes that
// once looped per byte or overflowed. Each must end in one ConfigError naming the field and what is allowed, or in
// a finite answer.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/error.h"
#include "run_cli.h"
#include "sim/cluster.h"
#include "sim/compute.h"
#include "sim/inference.h"
#include "sim/plan.h"
#include "sim/scheduler.h"
#include "sim/step.h"
#include "sim/topology.h"
#include "sim/workload.h"

namespace conduit::sim {
namespace {

GptModel named_model(const char* n) {
  GptModel m;
  EXPECT_TRUE(named_gpt(n, m)) << n;
  return m;
}

using test_util::error_of;

std::string cluster_error(const std::string& yaml) {
  return error_of([&] { parse_cluster_yaml(yaml, "x.yaml"); });
}

// `from` replaced by `to` in the dgx-a100 preset (which must contain `from`).
std::string preset_with(const std::string& from, const std::string& to) {
  std::string y = preset_yaml("dgx-a100");
  const size_t at = y.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) y.replace(at, from.size(), to);
  return y;
}

TEST(Inputs, ClusterFilesRejectUnknownDuplicateMisshapenAndAbsurdValues) {
  EXPECT_EQ(cluster_error(preset_with("pipeline_segment: 512 KiB", "pipeline_segment: 32 B")),
            "x.yaml: network.pipeline_segment = 32 B (allowed: 64 B to 1 GiB)");
  EXPECT_NE(cluster_error(preset_with("pipeline_segment: 512 KiB", "pipeline_segment: 1 Mb")).find("is not a size"),
            std::string::npos);
  EXPECT_NE(
      cluster_error(preset_with("oversubscription:", "oversubscribtion:"))
          .find("x.yaml: network: unknown key 'oversubscribtion' (allowed: topology, nodes_per_leaf, oversubscription"),
      std::string::npos);
  EXPECT_NE(cluster_error("name: a\nname: b\nnodes: []\nnetwork: {topology: flat}\n").find("key 'name' is given twice"),
            std::string::npos);
  // A fat-tree or rail-optimized network without its leaves' size made every node a leaf of its own.
  EXPECT_NE(cluster_error(preset_with("  nodes_per_leaf: 20", "")).find("network.nodes_per_leaf is missing"),
            std::string::npos)
      << cluster_error(preset_with("  nodes_per_leaf: 20", ""));
  // A flat network has no switches: their keys were taken and ignored (the same times with and without them).
  EXPECT_NE(cluster_error(preset_with("topology: rail-optimized", "topology: flat"))
                .find("network.nodes_per_leaf describes leaf and spine switches, which a flat network does not have"),
            std::string::npos)
      << cluster_error(preset_with("topology: rail-optimized", "topology: flat"));
  EXPECT_EQ(cluster_error("name: x\nnodes: [5]\nnetwork: {topology: flat}\n"),
            "x.yaml: nodes[0] must be a map with name, count, gpus, accelerator, intra, nics, nic");
  EXPECT_NE(cluster_error("name: x\nnodes: [{gpus: 8}]\nnetwork: 5\n").find("nodes[0].accelerator must be a map"),
            std::string::npos);
  // A second document after `---` was ignored without a word.
  EXPECT_NE(cluster_error(preset_yaml("dgx-a100") + std::string("---\nname: second\nbogus: 1\n"))
                .find("x.yaml: holds 2 YAML documents; allowed: one cluster per file"),
            std::string::npos);
  // An empty value is no name (yaml-cpp reads it as the text "null": the cluster ran as "null").
  EXPECT_NE(cluster_error(preset_with("name: dgx-a100", "name:")).find("name must be a string; allowed: a non-empty"),
            std::string::npos)
      << cluster_error(preset_with("name: dgx-a100", "name:"));
  // Values that overflow to inf, or no hardware has, name the field and the largest allowed.
  EXPECT_NE(cluster_error(preset_with("peak_bf16: 312 TFLOP/s", "peak_bf16: 1e300 PFLOP/s"))
                .find("peak_bf16: '1e300 PFLOP/s' is above the largest value this simulator takes (1e+18 FLOP/s)"),
            std::string::npos)
      << cluster_error(preset_with("peak_bf16: 312 TFLOP/s", "peak_bf16: 1e300 PFLOP/s"));
  EXPECT_NE(cluster_error(preset_with("latency: 2.7 us", "latency: 1e300 s")).find("is above the largest value"),
            std::string::npos);
  const std::string zero_gamma = cluster_error(preset_with("reduction_bandwidth:", "reduction_bandwidth: 0 GB/s #"));
  EXPECT_NE(zero_gamma.find("network.reduction_bandwidth must be positive"), std::string::npos) << zero_gamma;
  // A measured GEMM above the peak would give an MFU over 100%.
  const std::string fast =
      cluster_error(preset_with("      kernel_overhead:",
                                "      calibration: [{m: 1024, n: 1024, k: 1024, achieved: 1000 TFLOP/s}]\n"
                                "      kernel_overhead:"));
  EXPECT_NE(fast.find("calibration[0].achieved (1000 TFLOP/s) is above the accelerator's peak_bf16"), std::string::npos)
      << fast;
  // So would a FlashAttention rate; its kernel is one with a measured rate, its sample one a shape.
  const std::string row = "{kernel: flash2, head_dim: 64, seq: 512, achieved: 88 TFLOP/s}";
  auto attention = [&](const std::string& to) { return cluster_error(preset_with(row, to)); };
  EXPECT_EQ(attention("{kernel: flash2, head_dim: 64, seq: 512, achieved: 400 TFLOP/s}"),
            "x.yaml: nodes[0].accelerator.attention_calibration[0].achieved (400 TFLOP/s) is above the accelerator's "
            "peak_bf16 (312 TFLOP/s): a measured kernel cannot beat the peak");
  EXPECT_EQ(attention("{kernel: flash1, head_dim: 64, seq: 512, achieved: 88 TFLOP/s}"),
            "x.yaml: nodes[0].accelerator.attention_calibration[0].kernel = 'flash1' (allowed: flash2, flash3; "
            "FlashAttention's first version runs at the GEMM rate)");
  EXPECT_EQ(attention("{kernel: flash2, head_dim: 64, seq: 1024, achieved: 88 TFLOP/s}"),
            "x.yaml: nodes[0].accelerator.attention_calibration[1]: a second flash2 sample at seq 1024 and head_dim 64 "
            "(allowed: one each)");
  EXPECT_NE(attention("{kernel: flash2, head_dim: 64, achieved: 88 TFLOP/s}")
                .find("attention_calibration[0].seq is "
                      "missing"),
            std::string::npos)
      << attention("{kernel: flash2, head_dim: 64, achieved: 88 TFLOP/s}");
  EXPECT_NE(attention("{kernel: flash2, head_dim: 0, seq: 512, achieved: 88 TFLOP/s}").find("head_dim"),
            std::string::npos);
  // Values the model would quietly drop: NICs beyond one per accelerator (cut to one each), torus settings on a
  // network that is not a torus (ignored).
  // Collectives cannot hold every SM: the compute they overlap would stop.
  EXPECT_EQ(cluster_error(preset_with("comm_sms: 16 ", "comm_sms: 108 ")),
            "x.yaml: nodes[0].accelerator.comm_sms = 108 must be below sm_count = 108 (allowed: 0 to 107)");
  EXPECT_NE(cluster_error(preset_with("comm_sms: 16 ", "comm_sms: 1.5 ")).find("comm_sms = 1.5 must be an integer"),
            std::string::npos);
  const std::string nics = cluster_error(preset_with("gpus: 8 ", "gpus: 4 "));
  EXPECT_NE(nics.find("nics (8) is more than gpus (4)"), std::string::npos) << nics;
  const std::string torus =
      cluster_error(preset_with("  topology: rail-optimized", "  torus_dims: [0]\n  topology: rail-optimized"));
  EXPECT_NE(torus.find("torus_dims and torus_link describe a torus; this network is not one"), std::string::npos)
      << torus;
  // A torus has no switches (leaf settings and in-network reduction were taken and ignored), and intra.kind none
  // has no fabric between a node's accelerators (they were routed at intra.bandwidth all the same).
  const std::string on_torus =
      cluster_error(preset_with("  topology: rail-optimized",
                                "  torus_dims: [140]\n  torus_link: {bandwidth: 50 GB/s, latency: 1 us}\n"
                                "  topology: torus"));
  EXPECT_NE(on_torus.find("x.yaml: network.nodes_per_leaf describes leaf and spine switches, which a torus does not "
                          "have (allowed with topology: torus: torus_dims, torus_link"),
            std::string::npos)
      << on_torus;
  const std::string none = cluster_error(preset_with("kind: nvswitch", "kind: none"));
  EXPECT_NE(none.find("nodes[0].intra.kind = none (no fabric between a node's accelerators) needs gpus: 1"),
            std::string::npos)
      << none;
  EXPECT_EQ(cluster_error(preset_yaml("edge")), "no error");  // (its devices: kind none, one accelerator each)
  EXPECT_EQ(cluster_error(preset_yaml("dgx-a100")), "no error");
}

TEST(Inputs, LayerSpecsTakeWholeNumbersOnly) {
  for (const char* bad : {"dense:nanx10", "dense:infx10", "dense:10x10garbage", "dense:2.5x3.7", "dense:1e300x10",
                          "dense:0x10", "dense:99999999x10", "conv:3x8k3@32", "pool:8k3@32x32x1", "dense:10x"}) {
    const std::string e = error_of([&] { parse_layer_model(bad); });
    EXPECT_NE(e.find("is not a layer (allowed: dense:INxOUT"), std::string::npos) << bad << ": " << e;
  }
  LayerModel m = parse_layer_model("conv:1x32k3@28x28,pool:32k2@28x28,dense:6272x10");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].out, 32);
  EXPECT_EQ(m.layers[2].in, 6272);
}

TEST(Inputs, JobTracesNeedWholeBoundedNumbersAndUniqueIds) {
  auto trace_error = [](const std::string& body, const std::string& header = "id,submit_s,gpus,model,iterations") {
    return error_of([&] { parse_job_trace(header + "\n" + body + "\n", "t.csv"); });
  };
  EXPECT_EQ(trace_error("a,0,8,gpt-1.7b,1e30"), "t.csv:2: iterations = '1e30' must be a number in [1, 1e+12]");
  EXPECT_EQ(trace_error("a,0,2.5,gpt-1.7b,10"), "t.csv:2: gpus = '2.5' must be a whole number");
  EXPECT_EQ(trace_error("a,inf,8,gpt-1.7b,10"), "t.csv:2: submit_s = 'inf' must be a number in [0, 1e+12]");
  EXPECT_EQ(trace_error("a,0,0x8,gpt-1.7b,10"), "t.csv:2: gpus = '0x8' must be a number in [1, 262144]");
  EXPECT_EQ(trace_error("a,0x1p4,8,gpt-1.7b,10"), "t.csv:2: submit_s = '0x1p4' must be a number in [0, 1e+12]");
  EXPECT_EQ(trace_error("a,0,8,gpt-1.7b,10\na,5,8,gpt-1.7b,10"),
            "t.csv:3: id 'a' is used by an earlier job (ids must be unique)");
  EXPECT_NE(trace_error("a,0,8,gpt-1.7b,10,5", "id,submit_s,gpus,model,iterations,foo").find("the header must be"),
            std::string::npos);
  EXPECT_NE(trace_error("a,0,8,gpt-1.7b,10", "id,submit_s,gpus,model,iterations,global_batch")
                .find("expected 6 comma-separated fields (as the header), got 5"),
            std::string::npos);
  // An empty global_batch cell asks for the default, 8 sequences per accelerator, as a trace without the column (it
  // was refused, and so was 0, so a trace giving some jobs' batches could not leave the others' at the default).
  const std::string batched = "id,submit_s,gpus,model,iterations,global_batch";
  EXPECT_EQ(trace_error("a,0,8,gpt-1.7b,10,0", batched),
            "t.csv:2: global_batch = '0' must be a number in [1, 1e+09], or empty for 8 sequences per accelerator");
  EXPECT_EQ(trace_error("a,0,8,gpt-1.7b,10,x", batched),
            "t.csv:2: global_batch = 'x' must be a number in [1, 1e+09], or empty for 8 sequences per accelerator");
  const auto mixed = parse_job_trace(batched + "\na,0,8,gpt-1.7b,10,\nb,0,8,gpt-1.7b,10,128\n", "t.csv");
  ASSERT_EQ(mixed.size(), 2u);
  EXPECT_EQ(mixed[0].global_batch, 0);
  EXPECT_EQ(mixed[1].global_batch, 128);
  const ClusterSpec spec = load_cluster("dgx-a100");
  const auto jobs = parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt-1.7b,10\n", "t");
  // The default is 8 sequences per accelerator: the empty cell's job runs as one given 64, and as a trace without the
  // column.
  const auto r_default = simulate_cluster(spec, 8, mixed, {});
  const auto r_given = simulate_cluster(
      spec, 8, parse_job_trace(batched + "\na,0,8,gpt-1.7b,10,64\nb,0,8,gpt-1.7b,10,128\n", "t.csv"), {});
  EXPECT_DOUBLE_EQ(r_default.jobs[0].iteration_time, r_given.jobs[0].iteration_time);
  EXPECT_DOUBLE_EQ(r_default.jobs[0].iteration_time, simulate_cluster(spec, 8, jobs, {}).jobs[0].iteration_time);
  EXPECT_NE(r_default.jobs[0].iteration_time, r_default.jobs[1].iteration_time);
  EXPECT_EQ(error_of([&] { simulate_cluster(spec, -1600, jobs, {}); }), "--gpus = -1600 (allowed: 1..262144)");
  EXPECT_THROW(simulate_cluster(spec, 8, {}, {}), InvalidArgument);  // (read past an empty list's end)
  // What only the cluster can refuse names the trace's line too (it named the job alone).
  const auto odd =
      parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt-1.7b,10\nb,0,12,gpt-1.7b,10\n", "t.csv");
  EXPECT_EQ(error_of([&] { simulate_cluster(spec, 64, odd, {}); }),
            "t.csv:3: job b: gpus = 12 must be at most 8 or a multiple of it (whole nodes)");
  EXPECT_EQ(error_of([&] { simulate_cluster(spec, 8, odd, {}); }),
            "t.csv:3: job b: gpus = 12, and the cluster has 8 accelerators (--gpus)");
  // 32 accelerators of llama2-7b-like fit only edge's AGX Orins (64 GB; the Orin Nanos have 8), which are 16: the
  // error names the trace's line as the others do (it named the job alone).
  EXPECT_EQ(error_of([&] {
              simulate_cluster(load_cluster("edge"), 64,
                               parse_job_trace("id,submit_s,gpus,model,iterations\na,0,1,gpt2-small,10\n"
                                               "x,0,32,llama2-7b-like,10\n",
                                               "t.csv"),
                               {});
            }),
            "t.csv:3: job x asks for 32 accelerators; the node kinds it fits in memory have 16");
  // LAS thresholds grow tenfold a queue: one past a double's range put every job that had run in the last queue.
  SchedulerOptions las;
  las.policy = Policy::kLas;
  las.las_first_threshold = 1e300;
  las.las_queues = 12;
  EXPECT_EQ(error_of([&] { simulate_cluster(spec, 8, jobs, las); }),
            "--las-threshold = 1e+300 with --las-queues = 12: the last queue's threshold, 1e+300 x 10^10, is past a "
            "double's range (allowed: thresholds up to 1.8e308)");
  las.las_queues = 3;
  EXPECT_EQ(simulate_cluster(spec, 8, jobs, las).jobs[0].preemptions, 0);
}

// A job's slowdown and the goodput are against its best placement on this cluster: alone on an empty cluster a job
// runs at exactly that pace. Timed on one leaf, a job larger than a leaf had a base no placement reaches (512 GPUs on
// ethernet-25g's leaves of 128: 1.01x, goodput 99%); on the fastest node kind alone, one larger than that kind's nodes
// (32 GPUs on edge's 16 AGX Orins: 6.2x, goodput 8%).
TEST(Inputs, AJobAloneRunsAtItsBestPlacementsPace) {
  struct Case {
    const char* cluster;
    long long gpus, job;
    const char* model;
    int leaves;
  };
  for (const Case c : {Case{"ethernet-25g", 512, 512, "gpt-1.7b", 4}, Case{"ethernet-25g", 512, 256, "gpt-1.7b", 2},
                       Case{"ethernet-25g", 512, 128, "gpt-1.7b", 1}, Case{"edge", 64, 32, "gpt2-small", 1},
                       Case{"edge", 64, 17, "gpt2-small", 1}, Case{"edge", 64, 8, "gpt2-small", 1}}) {
    const auto jobs =
        parse_job_trace(fmt::format("id,submit_s,gpus,model,iterations\na,0,{},{},100\n", c.job, c.model), "t");
    for (Policy p : {Policy::kFifo, Policy::kSrtf})
      for (Placement pl : {Placement::kTopology, Placement::kSpread}) {
        SchedulerOptions o;
        o.policy = p;
        o.placement = pl;
        const ScheduleResult r = simulate_cluster(load_cluster(c.cluster), c.gpus, jobs, o);
        const std::string what = fmt::format("{} GPUs of {} on {}", c.job, c.gpus, c.cluster);
        if (pl == Placement::kTopology) {
          EXPECT_EQ(r.jobs[0].leaves_used, c.leaves) << what;
          EXPECT_DOUBLE_EQ(r.jobs[0].slowdown, 1.0) << what;
          EXPECT_NEAR(r.goodput, r.utilization, 1e-9) << what;
        } else if (std::string(c.cluster) != "edge") {  // (on several kinds spread may find a faster mix)
          EXPECT_GE(r.jobs[0].slowdown, 1.0 - 1e-12) << what << " spread";
        }
        EXPECT_NEAR(r.utilization, static_cast<double>(c.job) / static_cast<double>(c.gpus), 1e-9) << what;
        // A job never counts more work than it trained (17 GPUs spread over edge's kinds, 0.91 of the base's time,
        // had a goodput of 1.1x the utilization).
        EXPECT_LE(r.goodput, r.utilization) << what;
      }
  }
}

// The utilization and the goodput are shares of the accelerators' time, at most 1 by construction, not cut to 1: a
// trace that keeps edge's 64 accelerators busy with a 17-GPU job spread over a faster mix of kinds than its base (16
// AGX Orins and an Orin Nano against 17 Orin Nanos) and a 47-GPU job on the other Orin Nanos, both ending together,
// needed 1.03x the cluster's time at the bases' pace; min(1, x) printed 100% goodput over 99% utilization.
TEST(Inputs, TheGoodputIsAtMostTheUtilizationAndOneWithoutACap) {
  const ClusterSpec edge = load_cluster("edge");
  SchedulerOptions o;
  o.placement = Placement::kSpread;
  auto run = [&](long long a, long long b) {
    return simulate_cluster(
        edge, 64,
        parse_job_trace(fmt::format("id,submit_s,gpus,model,iterations\na,0,17,gpt2-small,{}\nb,0,47,gpt2-small,{}\n",
                                    a, b),
                        "t"),
        o);
  };
  const ScheduleResult probe = run(1000, 1000);
  ASSERT_LT(probe.jobs[0].slowdown, 0.95);  // the faster mix
  const long long b = std::llround(1000 * probe.jobs[0].iteration_time / probe.jobs[1].iteration_time);
  const ScheduleResult r = run(1000, b);
  EXPECT_GT(r.utilization, 0.99);
  EXPECT_LE(r.utilization, 1.0);
  EXPECT_LE(r.goodput, r.utilization);
  // Job a counts at the pace it ran, b at its base (where it ran): all their training is work.
  EXPECT_NEAR(r.goodput, r.utilization, 1e-9);
}

// Late in a long trace `now + dt` rounds to `now`, and remaining iterations to a sliver that never reached zero:
// the loop spun forever. Completions now compare times, and time always moves forward.
TEST(Inputs, SchedulerFinishesLongTracesUnderEveryPolicy) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  const auto jobs = parse_job_trace(
      "id,submit_s,gpus,model,iterations\na,0,8,gpt-1.7b,123456789\nb,100000000,8,gpt-1.7b,100\n"
      "c,5,16,gpt-1.7b,1000\nd,1e12,8,gpt-1.7b,7\n",
      "t");
  for (Policy p : {Policy::kFifo, Policy::kLas, Policy::kSrtf}) {
    SchedulerOptions o;
    o.policy = p;
    const ScheduleResult r = simulate_cluster(spec, 512, jobs, o);
    ASSERT_EQ(r.jobs.size(), 4u);
    for (const auto& j : r.jobs) {
      EXPECT_TRUE(std::isfinite(j.finish)) << j.id;
      EXPECT_GT(j.finish, j.submit) << j.id;
    }
    EXPECT_GT(r.jobs[3].finish, 1e12);
    EXPECT_GT(r.utilization, 0);
    EXPECT_LE(r.utilization, 1 + 1e-9);
  }
}

// A job smaller than a node computes on the accelerators it asked for, not on the whole node's share of the batch:
// at the default 8 sequences per accelerator a 1-GPU job's iteration is that of one GPU of the same kind.
TEST(Inputs, SubNodeJobsRunOnWhatTheyAskFor) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  const double one = job_iteration_time(spec, "gpt2-small", 1, 0, 1);
  const double node = job_iteration_time(spec, "gpt2-small", 8, 0, 1);
  ClusterSpec single = spec;
  single.node_kinds[0].gpus = 1;
  single.node_kinds[0].nics = 1;
  Topology topo(single, 1);
  CollectiveModel net(topo);
  PlanSpace space;
  space.tp = {1};
  space.micro_batch = {1, 2, 4};
  space.zero = {0, 1};
  space.schedules = {Schedule::k1F1B};
  space.recompute = {Recompute::kNone, Recompute::kFull};
  space.sequence_parallel = {true};
  const PlanResult pr = plan(net, named_model("gpt2-small"), 8, space, 1);
  ASSERT_FALSE(pr.ranked.empty());
  EXPECT_DOUBLE_EQ(one, pr.ranked.front().time);
  EXPECT_NEAR(one, node, 0.5 * node);  // weak scaling within a node: about the same step
}

// One bucket per KiB of a 175B model's gradients is 3.4e8 buckets: the overlap is evaluated in closed form.
TEST(Inputs, TinyBucketsOfAHugeModelAreEvaluatedInClosedForm) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 8;
  c.bucket_bytes = 1024;
  const StepResult r = simulate_step(net, named_model("gpt3-175b"), c);
  EXPECT_TRUE(std::isfinite(r.time));
  // Each of n buckets pays the collective's latency: far more than one 25 MB-bucketed exchange.
  ParallelConfig big = c;
  big.bucket_bytes = 25e6;
  EXPECT_GT(r.breakdown.dp_comm, 10 * simulate_step(net, named_model("gpt3-175b"), big).breakdown.dp_comm);
}

TEST(Inputs, ContradictoryStepFlagsAreRefused) {
  Topology topo(load_cluster("dgx-a100"), 8);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt-1.7b");
  auto step_error = [&](const std::function<void(ParallelConfig&)>& set) {
    ParallelConfig c;
    c.global_batch = 64;
    set(c);
    return error_of([&] { simulate_step(net, m, c); });
  };
  EXPECT_NE(step_error([](ParallelConfig& c) { c.sequence_parallel = true; })
                .find("--sp (sequence parallelism) needs "
                      "--tp > 1"),
            std::string::npos);
  EXPECT_NE(step_error([](ParallelConfig& c) {
              c.sync = parse_sync("local-sgd:4");
              c.zero = 3;
            }).find("--sync local-sgd needs full model replicas"),
            std::string::npos);
  EXPECT_NE(step_error([](ParallelConfig& c) { c.balance = true; }).find("this cluster has one kind"),
            std::string::npos);
  EXPECT_NE(step_error([](ParallelConfig& c) {
              c.compression = parse_compression("powersgd:1000000");
            }).find("the rank must not exceed the smallest weight matrix side (hidden / tp = 2304)"),
            std::string::npos);
  EXPECT_EQ(step_error([](ParallelConfig& c) { c.compression = parse_compression("powersgd:4"); }), "no error");
  // An uneven pipeline split (24 layers): only with a pipeline, not interleaved, adding up, the rest shared evenly.
  EXPECT_EQ(step_error([](ParallelConfig& c) { c.first_stage_layers = 3; }),
            "--first-stage-layers: an uneven split of a pipeline's layers, this step has --pp 1; allowed: --pp 2 or "
            "more, or leave it out");
  auto split_error = [&](int p, int first, int last, Schedule sched = Schedule::k1F1B) {
    return step_error([&](ParallelConfig& c) {
      c.pp = p;
      c.first_stage_layers = first;
      c.last_stage_layers = last;
      c.schedule = sched;
      if (sched == Schedule::kInterleaved) c.virtual_stages = 2;
    });
  };
  EXPECT_EQ(split_error(4, 4, 8, Schedule::kInterleaved),
            "--first-stage-layers and --last-stage-layers with --schedule interleaved: its model chunks hold equal "
            "layers; allowed: --schedule 1f1b or gpipe, or leave them out");
  EXPECT_EQ(split_error(4, 25, -1), "--first-stage-layers = 25 exceeds --layers = 24 (allowed: 0 to 24)");
  EXPECT_EQ(split_error(4, 12, 13), "--first-stage-layers (12) + --last-stage-layers (13) exceed --layers (24)");
  EXPECT_EQ(split_error(2, 10, 10),
            "--first-stage-layers (10) + --last-stage-layers (10) must be --layers (24): --pp 2 has no other stages");
  EXPECT_EQ(split_error(4, 3, 4),
            "--first-stage-layers and --last-stage-layers leave 17 layers to the other 2 stages, which share them "
            "evenly, a layer each at least; allowed: counts that leave a positive multiple of 2");
  EXPECT_EQ(split_error(4, -1, 24),
            "--last-stage-layers leaves 0 layers to the other 3 stages, which share them evenly, a layer each at "
            "least; allowed: counts that leave a positive multiple of 3");
  EXPECT_EQ(split_error(2, 24, -1),
            "--first-stage-layers = 24 leaves no layers to the last stage; allowed: at most 23, or give "
            "--last-stage-layers 0 as well");
  EXPECT_EQ(split_error(2, 24, 0), "no error");
  EXPECT_EQ(error_of([&] {
              ParallelConfig c;  // (3 stages: on 8 GPUs the split itself, as sim step checks it)
              c.pp = 3;
              c.first_stage_layers = c.last_stage_layers = 12;
              stage_layers(m, c);
            }),
            "--first-stage-layers (12) + --last-stage-layers (12) leave no layers to the middle stage; allowed: counts "
            "that leave it one at least (below --layers = 24 together)");
  EXPECT_EQ(split_error(4, -1, 3), "no error");                    // (7 each on the other three)
  EXPECT_EQ(split_error(2, 0, 24, Schedule::kGpipe), "no error");  // (the first stage the embedding alone)
  EXPECT_EQ(error_of([] { Topology(load_cluster("dgx-a100"), 1LL << 20); }),
            "--gpus = 1048576 is beyond the simulator's limit of 262144 accelerators");
}

// Found by a review: inputs that printed nonsense with exit code 0 or blamed the wrong thing.
TEST(Inputs, OverflowsNanAndImpossibleRatesAreRefused) {
  Topology topo(load_cluster("dgx-h100"), 8);
  CollectiveModel net(topo);
  InferenceConfig ic;
  ic.tp = 8;
  ic.prompt = 9223372036854775807LL;  // prompt + generate overflowed and passed the context check
  ic.generate = 1;
  EXPECT_NE(error_of([&] { simulate_inference(net, named_model("llama2-70b-like"), ic); }).find("exceed"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_compression("topk:nan"); }).find("topk:DENSITY in (0,1]"), std::string::npos);
  const GptModel m = named_model("gpt-1.7b");
  ParallelConfig c;
  c.global_batch = 0;
  EXPECT_EQ(error_of([&] { simulate_step(net, m, c); }), "--global-batch = 0 must be at least 1");
  GptModel odd = m;
  odd.seq = 1001;
  c.global_batch = 8;
  c.tp = 4;
  c.sequence_parallel = true;
  EXPECT_NE(error_of([&] { simulate_step(net, odd, c); }).find("--tp = 4 must divide --seq = 1001"), std::string::npos);
  // A positive but absurdly small rate made every time inf (and the planner ranked inf plans).
  ClusterSpec slow = load_cluster("dgx-h100");
  slow.node_kinds[0].accelerator.peak_flops = 1e-300;
  Topology st(slow, 8);
  CollectiveModel sn(st);
  ParallelConfig d;
  d.global_batch = 8;
  EXPECT_NE(error_of([&] { simulate_step(sn, m, d); }).find("the simulated step time is inf"), std::string::npos);
}

TEST(Inputs, InferencePlanAndCollInputsThatWereSilentlyBent) {
  int rc = 0;
  std::string out =
      test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 8 --prompt 0", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("must be at least 1 token"), std::string::npos) << out;
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 0", &rc);
  EXPECT_NE(out.find("--tp = 0 and --pp = 1 must be at least 1"), std::string::npos) << out;
  // A prompt alone: the generated length fits what it leaves (it named a --generate nobody gave).
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 8 --prompt 4000", &rc);
  EXPECT_EQ(rc, 0) << out;
  // No valid candidate at all: refused in one line, as sim step refuses the configuration (it printed a header and
  // the reason, exit 1, like a search whose plans do not fit; before that an empty list and exit 0).
  for (const char* json : {"", " --json"}) {
    out = test_util::run(std::string("sim plan --cluster dgx-a100 --gpus 8 --pp 8 --model gpt2-small --global-batch "
                                     "512 --sp") +
                             json,
                         &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_EQ(out,
              "conduit: error: sim plan: no candidate is valid; the first tried: sequence parallelism (--sp) needs "
              "tp > 1; allowed: --gpus, --global-batch, fixed settings and the model's sizes with "
              "common divisors\n")
        << out;
  }
  // No plan fits in memory: a result, its reason and exit 1 (--json says it too).
  out = test_util::run("sim plan --cluster dgx-a100 --gpus 8 --model gpt3-175b --global-batch 8 --json", &rc);
  EXPECT_EQ(rc, 1) << out;
  // The plan nearest to fitting (it named the fastest of those that did not fit: 3167.1 GB, b=8 zero=1): every GPU in
  // the tensor-parallel group, full recompute, 350.6 GB of 85.9.
  EXPECT_NE(out.find("\"reason\":\"no plan fits in memory; the nearest needs 350.6 GB per GPU of 85.9 GB: dp=1 tp=8 "
                     "pp=1 b=1 zero=0 recompute=full sp\""),
            std::string::npos)
      << out;
  // --sp fixes sequence parallelism: no plan without it (tp = 1 plans ran without it and ranked first).
  out = test_util::run("sim plan --cluster dgx-a100 --gpus 64 --model gpt2-small --global-batch 512 --sp", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find(" tp=1 "), std::string::npos) << out;
  EXPECT_NE(out.find(" sp\n"), std::string::npos) << out;
  out = test_util::run("sim plan --cluster dgx-a100 --gpus 64 --model gpt2-small --global-batch 512 --sp --tp 1", &rc);
  EXPECT_NE(out.find("--sp (sequence parallelism) needs --tp > 1"), std::string::npos) << out;
  out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 64 --model gpt2-small --global-batch 512 --schedule interleaved "
      "--virtual-stages 1",
      &rc);
  EXPECT_NE(out.find("--virtual-stages = 1"), std::string::npos) << out;
  out = test_util::run("sim coll --op all-to-all --algorithm in-network --gpus 16 --cluster dgx-a100", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("all-to-all: the algorithm in-network does not apply; allowed: direct"), std::string::npos) << out;
}

TEST(Inputs, GradientMemoryFollowsGradBytes) {
  EXPECT_DOUBLE_EQ(zero_model_state(1e9, 8, 0, 4).grads, 4e9);
  EXPECT_DOUBLE_EQ(zero_model_state(1e9, 8, 2, 4).grads, 4e9 / 8);
  EXPECT_DOUBLE_EQ(zero_model_state(1e9, 8, 0).grads, 2e9);
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 64;
  const double two = simulate_step(net, named_model("gpt-7.5b"), c).memory.grads;
  c.grad_bytes = 4;
  EXPECT_DOUBLE_EQ(simulate_step(net, named_model("gpt-7.5b"), c).memory.grads, 2 * two);
}

TEST(Inputs, InferenceOnMixedNodesFitsTheSmallestAndRunsAtEachKindsPace) {
  const ClusterSpec edge = load_cluster("edge");
  Topology topo(edge, 64);
  CollectiveModel net(topo);
  double smallest = 1e300;
  for (size_t k = 0; k < edge.node_kinds.size(); ++k)
    if (topo.kind_counts()[k] > 0) smallest = std::min(smallest, edge.node_kinds[k].accelerator.memory_bytes);
  InferenceConfig ic;
  ic.prompt = 512;
  ic.generate = 64;
  const InferenceResult r = simulate_inference(net, named_model("gpt-7.5b"), ic);
  EXPECT_DOUBLE_EQ(r.memory_capacity, smallest);
  EXPECT_FALSE(r.fits);  // 15.9 GB of weights and cache on the 8 GB devices
  // The reported latency is the slowest replica's; the throughput sums every replica at its own pace, so it is
  // above what 64 replicas at the slowest pace give.
  EXPECT_GT(r.tokens_per_second, 64 * 64 / r.request_latency * 1.0001);
  // With tp 2 each kind's replicas exchange over that kind's links: the throughput is what each kind's replicas give
  // on a cluster of that kind alone (every replica was given the 1 GbE devices' exchanges: 666 tokens/s for 790).
  ic.tp = 2;
  ic.batch = 1;
  ic.prompt = 1024;
  ic.generate = 256;
  const GptModel small = named_model("gpt-1.7b");
  double expected = 0;
  for (size_t k = 0; k < edge.node_kinds.size(); ++k) {
    ClusterSpec alone = edge;
    alone.node_kinds = {edge.node_kinds[k]};
    Topology kt(alone, alone.node_kinds[0].count);
    CollectiveModel kn(kt);
    const InferenceResult kr = simulate_inference(kn, small, ic);
    expected += kr.tokens_per_second / static_cast<double>(kr.replicas) * topo.kind_counts()[k] / 2;
  }
  EXPECT_NEAR(simulate_inference(net, small, ic).tokens_per_second, expected, 1e-9 * expected);
}

TEST(Inputs, SchedulerPlacesPerNodeCountsFromTheFirstSubmitAndNamesWhyNothingRuns) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  // 16 GPUs: jobs of 5 and 5 take a node each; the 6-GPU job must not run as 3 + 3 GPUs of two nodes.
  auto jobs = parse_job_trace(
      "id,submit_s,gpus,model,iterations\na,0,5,gpt2-small,100\nb,0,5,gpt2-small,100\nc,0,6,gpt2-small,100\n", "t");
  for (Placement pl : {Placement::kTopology, Placement::kSpread}) {
    SchedulerOptions o;
    o.placement = pl;
    const ScheduleResult r = simulate_cluster(spec, 16, jobs, o);
    EXPECT_GT(r.jobs[2].start, 0) << "job c started beside a and b";
    EXPECT_GE(r.jobs[2].start, std::min(r.jobs[0].finish, r.jobs[1].finish) - 1e-9);
  }
  // Least-attained-service with fragmented nodes: A and B (6 GPUs each) fill two nodes but for 2 + 2; C (4 GPUs,
  // arriving once they have attained more service, so first in priority) fits nowhere. Deciding by counts of free
  // accelerators kept all three and left C waiting beside 4 idle GPUs; now C preempts the lowest-priority job that
  // makes room (B) and starts at once.
  jobs = parse_job_trace(
      "id,submit_s,gpus,model,iterations\na,0,6,gpt2-small,1000000\nb,0,6,gpt2-small,1000000\n"
      "c,1000,4,gpt2-small,100\n",
      "t");
  SchedulerOptions las;
  las.policy = Policy::kLas;
  const ScheduleResult frag = simulate_cluster(spec, 16, jobs, las);
  EXPECT_NEAR(frag.jobs[2].start, 1000, 1e-6);
  EXPECT_EQ(frag.jobs[1].preemptions, 1);
  EXPECT_EQ(frag.jobs[0].preemptions, 0);
  // Only the victims whose room is needed: c (8) needs node 1 (d, e); b on node 0 must keep running.
  jobs = parse_job_trace(
      "id,submit_s,gpus,model,iterations\na,0,6,gpt2-small,1000000\nb,0,2,gpt2-small,1000000\n"
      "d,0,4,gpt2-small,1000000\ne,0,4,gpt2-small,1000000\nc,5000,8,gpt2-small,100\n",
      "t");
  const ScheduleResult need = simulate_cluster(spec, 16, jobs, las);
  EXPECT_NEAR(need.jobs[4].start, 5000, 1e-6);
  EXPECT_EQ(need.jobs[0].preemptions + need.jobs[1].preemptions, 0);
  EXPECT_EQ(need.jobs[2].preemptions + need.jobs[3].preemptions, 2);
  // A trace that starts late: the makespan counts from its first submission (100076 s before, for 76 s of work).
  jobs = parse_job_trace("id,submit_s,gpus,model,iterations\na,100000,8,gpt2-small,1000\n", "t");
  const ScheduleResult late = simulate_cluster(spec, 8, jobs, {});
  EXPECT_NEAR(late.makespan, late.jobs[0].finish - 100000, 1e-6);
  EXPECT_NEAR(late.utilization, 1.0, 1e-9);
  // No configuration runs because of the batch, not memory.
  jobs = parse_job_trace("id,submit_s,gpus,model,iterations,global_batch\na,0,64,gpt2-small,10,7\n", "t");
  const std::string why = error_of([&] { simulate_cluster(spec, 64, jobs, {}); });
  EXPECT_NE(
      why.find("job a: no parallel configuration of gpt2-small runs on 64 accelerators: the global batch (7) is not"),
      std::string::npos)
      << why;
  // A torus cluster: a job's sub-cluster is a ring of its nodes (the file's dimensions hold the whole cluster).
  ClusterSpec torus = spec;
  torus.network.topology = TopologyKind::kTorus;
  torus.network.torus_dims = {4, 4};
  torus.network.torus_link = {50e9, 1e-6};
  torus.network.in_network_reduction = false;
  jobs = parse_job_trace("id,submit_s,gpus,model,iterations\na,0,16,gpt2-small,10\nb,0,4,gpt2-small,10\n", "t");
  const ScheduleResult tr = simulate_cluster(torus, 128, jobs, {});
  EXPECT_TRUE(std::isfinite(tr.makespan));
  // Every node is its own leaf there: the leaves column counts a job's nodes (it counted groups of the file's 20).
  EXPECT_EQ(tr.jobs[0].leaves_used, 2);
  EXPECT_EQ(tr.jobs[1].leaves_used, 1);
  // Ids are printable ASCII; a byte-order mark before the header is not part of it.
  EXPECT_NE(error_of([] {
              parse_job_trace("id,submit_s,gpus,model,iterations\n\xff\xfe,0,8,gpt2-small,1\n", "t");
            }).find("id holds the byte 0xFF"),
            std::string::npos);
  EXPECT_EQ(parse_job_trace("\xEF\xBB\xBFid,submit_s,gpus,model,iterations\na,0,8,gpt2-small,1\n", "t").size(), 1u);
}

using test_util::run;

// Three `conduit` runs: sim coll's group check without overflow; sim plan fixing a searched dimension given as a
// plain flag; sim scale's plot path reaching gnuplot as data, never through a shell.
TEST(Inputs, CliGroupsPlanConstraintsAndPlotPaths) {
  int rc = 0;
  std::string out = run("sim coll --group 3 --stride 5000000000000000000", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("must place the group's ranks within --gpus (64)"), std::string::npos) << out;
  // A flag the parser cannot convert: one line and exit code 2 as every other bad input (CLI11's own: two, 104).
  out = run("sim step --model gpt2-small --global-batch 8 --grad-bytes many", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out,
            "conduit: error: --grad-bytes: 'many': a decimal number (digits, an optional fraction and exponent; no "
            "blanks, '+', hexadecimal, inf or nan) (see --help)\n");
  // An integer flag says what it takes.
  out = run("sim coll --gpus many", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out, "conduit: error: --gpus: 'many': an integer in decimal digits (no blanks, no '+') (see --help)\n");
  // What each refusal names is what was given (an audit: --group not given, a multiple of 8 asked of 10^11, `all`
  // missing from the algorithms, 64Mb taken as 64 MiB).
  out = run("sim coll --cluster edge --gpus 1", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--gpus = 1: a collective needs at least 2 ranks"), std::string::npos) << out;
  out = run("sim coll --gpus 99999999999", &rc);
  EXPECT_NE(out.find("beyond the simulator's limit of 262144 accelerators"), std::string::npos) << out;
  out = run("sim coll --algorithm rings", &rc);
  EXPECT_NE(out.find("(allowed: all (every one that implements --op, the default), auto, ring,"), std::string::npos)
      << out;
  out = run("sim coll --size 64Mb", &rc);
  EXPECT_NE(out.find("ends in a lowercase b, which reads as bits"), std::string::npos) << out;

  out = run("sim plan --cluster dgx-a100 --gpus 16 --model gpt-1.7b --global-batch 64 --tp 2 --top 20 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  size_t plans = 0;
  for (size_t at = out.find("\"tp\":"); at != std::string::npos; at = out.find("\"tp\":", at + 1), ++plans)
    EXPECT_EQ(out.substr(at, 7), "\"tp\":2,") << out.substr(at, 40);
  EXPECT_GT(plans, 1u) << out;

  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("conduit-plot-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string name = "$(touch INJECTED)it's.png";
  out = run("sim scale --cluster dgx-a100 --model gpt-1.7b --global-batch 64 --gpus-list 8,16 --plot '" +
                (dir / "").string() + "$(touch INJECTED)it'\\''s.png'",
            &rc);
  const bool have_gnuplot = std::system("command -v gnuplot >/dev/null 2>&1") == 0;
  if (have_gnuplot) {
    EXPECT_EQ(rc, 0) << out;
    EXPECT_TRUE(fs::exists(dir / name)) << out;
  }
  EXPECT_FALSE(fs::exists(dir / "INJECTED"));
  EXPECT_FALSE(fs::exists("INJECTED"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

// Found by a review of the work model: flags that crashed, were ignored, or that two commands read differently.
TEST(Inputs, StageProductsVocabPaddingAndLayerListFlags) {
  // --pp x --virtual-stages overflowed an int: a division by zero (SIGFPE) or 8 layers "split" over 3 stages.
  Topology big(load_cluster("dgx-a100"), 24);
  CollectiveModel bn(big);
  GptModel m;
  m.layers = 8;
  m.hidden = 1024;
  m.heads = 16;
  m.seq = 1024;
  m.vocab = 51200;
  ParallelConfig c;
  c.tp = 8;
  c.pp = 3;
  c.global_batch = 3;
  c.schedule = Schedule::kInterleaved;
  c.virtual_stages = 1431655766;
  EXPECT_NE(error_of([&] { simulate_step(bn, m, c); }).find("--layers (8) must be a multiple of --pp x virtual stages"),
            std::string::npos);
  c.pp = 65536;
  c.virtual_stages = 65536;
  EXPECT_NE(error_of([&] { simulate_step(bn, m, c); }), "no error");

  // A vocabulary tp does not divide is padded (as Megatron-LM pads it) by training and inference alike: gpt2-xl's
  // 25 heads allow tp = 5 or 25 only, and training refused it while inference computed with 10060.8 rows per rank.
  Topology t40(load_cluster("dgx-a100"), 40);
  CollectiveModel n40(t40);
  const GptModel xl = named_model("gpt2-xl");
  ASSERT_NE(xl.vocab % 5, 0);
  EXPECT_EQ(vocab_padded(xl, 5).vocab, (xl.vocab + 4) / 5 * 5);
  EXPECT_EQ(vocab_padded(xl, 1).vocab, xl.vocab);
  ParallelConfig x;
  x.tp = 5;
  x.global_batch = 8;
  StepResult r = simulate_step(n40, xl, x);
  bool noted = false;
  for (const auto& n : r.notes) noted |= n.find("vocabulary is padded from 50304 to 50305") != std::string::npos;
  EXPECT_TRUE(noted);
  // The padded row is real work: one more output row than the unpadded vocabulary would give.
  EXPECT_DOUBLE_EQ(simulate_step(n40, vocab_padded(xl, 5), x).model_flops, r.model_flops);
  InferenceConfig ic;
  ic.tp = 5;
  ic.prompt = 128;
  ic.generate = 16;
  EXPECT_EQ(error_of([&] { simulate_inference(n40, xl, ic); }), "no error");

  // Layer-list models: --dp other than --gpus, and ZeRO under local SGD, are refused as for GPT models (--dp was
  // ignored; the ZeRO allgather was divided by the period).
  Topology t8(load_cluster("dgx-a100"), 8);
  CollectiveModel n8(t8);
  const LayerModel lm = parse_layer_model("dense:784x256,dense:256x10");
  ParallelConfig l;
  l.global_batch = 64;
  l.dp = 3;
  EXPECT_NE(error_of([&] { simulate_layer_step(n8, lm, l); }).find("--dp (3) must equal --gpus / --pp (8)"),
            std::string::npos);
  l.dp = 0;
  l.zero = 1;
  l.sync = parse_sync("local-sgd:4");
  EXPECT_NE(error_of([&] { simulate_layer_step(n8, lm, l); }).find("--sync local-sgd needs full model replicas"),
            std::string::npos);
  {  // GPT-only flags are named one at a time (one line listed four, whichever was given)
    ParallelConfig g;
    g.global_batch = 64;
    g.recompute = Recompute::kFull;
    EXPECT_EQ(error_of([&] { simulate_layer_step(n8, lm, g); }),
              "--recompute applies to GPT models; allowed with a layer-list model: leave it out");
    g.recompute = Recompute::kNone;
    g.sequence_parallel = true;
    EXPECT_EQ(error_of([&] { simulate_layer_step(n8, lm, g); }),
              "--sp applies to GPT models; allowed with a layer-list model: leave it out");
    g.sequence_parallel = false;
    g.attention = AttentionKernels::kEager;
    EXPECT_EQ(error_of([&] { simulate_layer_step(n8, lm, g); }),
              "--attention-kernels eager applies to GPT models; allowed with a layer-list model: leave it out");
    g.attention = AttentionKernels::kFused;
    g.first_stage_layers = 1;
    EXPECT_EQ(error_of([&] { simulate_layer_step(n8, lm, g); }),
              "--first-stage-layers applies to GPT models; allowed with a layer-list model: leave it out");
    g.first_stage_layers = -1;
    g.schedule = Schedule::kGpipe;
    EXPECT_NE(error_of([&] { simulate_layer_step(n8, lm, g); }).find("--schedule gpipe: a layer-list model takes"),
              std::string::npos);
  }
  // ZeRO-2 over micro-batches, as `conduit train` runs it: the micro-batches summed in the buckets and reduce-scattered
  // once a step, as ZeRO-1 (DeepSpeed's reduce-scatter after every micro-batch moved 4 times the bytes here), the
  // buckets holding the whole gradients meanwhile; with one micro-batch stage 2 holds its eighth.
  ParallelConfig z;
  z.global_batch = 8 * 4;  // 4 micro-batches of 1
  z.zero = 1;
  const StepResult z1 = simulate_layer_step(n8, lm, z);
  z.zero = 2;
  const StepResult z2 = simulate_layer_step(n8, lm, z);
  EXPECT_EQ(z2.breakdown.dp_comm, z1.breakdown.dp_comm);
  EXPECT_EQ(z2.memory.grads, z1.memory.grads);
  z.global_batch = 8;
  const StepResult one_mb = simulate_layer_step(n8, lm, z);
  EXPECT_NEAR(one_mb.memory.grads * 8, z1.memory.grads, 1e-9 * z1.memory.grads);
  // --zero-reduce micro-batch (DeepSpeed's): each micro-batch's gradients reduce-scattered after its backward, 3
  // more reduce-scatters of the bucket, exposed without overlap; the shard held. (A bucket's reduce-scatter: the
  // step's exchange less the blocking allgather of the parameters, held in --grad-bytes.)
  z.global_batch = 8 * 4;
  z.dp_overlap = false;
  z.zero_prefetch = false;
  const StepResult once = simulate_layer_step(n8, lm, z);
  z.zero_reduce = ZeroReduce::kEveryMicroBatch;
  const StepResult each = simulate_layer_step(n8, lm, z);
  const double params = 784 * 256 + 256 + 256 * 10 + 10;
  const double ag = n8.time(Collective::kAllGather, Algorithm::kAuto, Group{8, 1, 0}, params * z.grad_bytes) +
                    t8.spec().network.wake_latency;
  const double rs = once.breakdown.dp_comm - ag;
  EXPECT_GT(rs, 0);
  EXPECT_NEAR(each.breakdown.dp_comm, once.breakdown.dp_comm + 3 * rs, 1e-9 * each.breakdown.dp_comm);
  EXPECT_NEAR(each.breakdown.dp_exposed, once.breakdown.dp_exposed + 3 * rs, 1e-9 * each.breakdown.dp_comm);
  EXPECT_NEAR(each.memory.grads * 8, once.memory.grads, 1e-9 * once.memory.grads);
  z.zero_reduce = ZeroReduce::kOncePerStep;
  EXPECT_EQ(simulate_layer_step(n8, lm, z).time, once.time);
  // Sharded within pairs: the slices' allreduce across the 4 pairs once a step, after the last micro-batch, as
  // `conduit train --zero-reduce micro-batch` runs it (MiCS); the three more exchanges are the pairs' reduce-scatters
  // alone (they paid the allreduce too).
  z.zero_shard = 2;
  const StepResult pairs_once = simulate_layer_step(n8, lm, z);
  z.zero_reduce = ZeroReduce::kEveryMicroBatch;
  const StepResult pairs_each = simulate_layer_step(n8, lm, z);
  const double wake = t8.spec().network.wake_latency;
  const double across =
      n8.time(Collective::kAllReduce, Algorithm::kAuto, Group{4, 2, 0}, params / 2 * z.grad_bytes) + wake;
  const double pair_ag =
      n8.time(Collective::kAllGather, Algorithm::kAuto, Group{2, 1, 0}, params * z.grad_bytes) + wake;
  const double pair_rs = pairs_once.breakdown.dp_comm - pair_ag - across;
  EXPECT_GT(across, 0);
  EXPECT_GT(pair_rs, 0);
  EXPECT_NEAR(pairs_each.breakdown.dp_comm, pairs_once.breakdown.dp_comm + 3 * pair_rs,
              1e-9 * pairs_each.breakdown.dp_comm);
  z.zero_shard = 0;
  z.zero_reduce = ZeroReduce::kOncePerStep;
  // fp16 on the wire: its cast passes every micro-batch too (of f32 gradients: 16-bit ones are sent as they are).
  z.compression = parse_compression("fp16");
  {
    ParallelConfig plain = z;
    plain.compression = Compression{};
    EXPECT_EQ(simulate_layer_step(n8, lm, z).breakdown.compression, 0);
    EXPECT_EQ(simulate_layer_step(n8, lm, z).time, simulate_layer_step(n8, lm, plain).time);
  }
  z.grad_bytes = 4;
  const double passes = simulate_layer_step(n8, lm, z).breakdown.compression;
  z.zero_reduce = ZeroReduce::kEveryMicroBatch;
  EXPECT_GT(passes, 0);
  EXPECT_NEAR(simulate_layer_step(n8, lm, z).breakdown.compression, 4 * passes, 1e-9 * passes);
  // With overlap each earlier micro-batch's reduce-scatter hides behind its backward and the next forward: a layer
  // whose micro-batch computes longer than its reduce-scatter (8192 x 8192 at 4096 samples) exposes none of the three
  // more, though they are sent.
  {
    const LayerModel big = parse_layer_model("dense:8192x8192");
    ParallelConfig w;
    w.global_batch = 8 * 4096 * 4;
    w.micro_batch = 4096;
    w.zero = 2;
    w.zero_prefetch = false;
    const StepResult one = simulate_layer_step(n8, big, w);
    w.zero_reduce = ZeroReduce::kEveryMicroBatch;
    const StepResult every = simulate_layer_step(n8, big, w);
    const double rs = (every.breakdown.dp_comm - one.breakdown.dp_comm) / 3;
    EXPECT_GT(rs, 0);
    EXPECT_GT(one.breakdown.compute / 4, rs);  // (a micro-batch's window holds its exchange)
    EXPECT_NEAR(every.breakdown.dp_exposed, one.breakdown.dp_exposed, 1e-12);
    w.dp_overlap = false;  // (all of them exposed)
    EXPECT_NEAR(simulate_layer_step(n8, big, w).breakdown.dp_exposed - every.breakdown.dp_exposed,
                4 * rs + one.breakdown.dp_comm - rs - one.breakdown.dp_exposed, 1e-9 * every.breakdown.dp_comm);
  }
}

// Layer-list models at ZeRO-3 as `conduit train --zero 3` runs them: each layer with parameters a unit (the CNN's
// pooling in the convolution's), gathered before its forward and, but the last, before its backward, every
// micro-batch, exposed; the units' gradients reduce-scattered once a step. And ZeRO-1's allgather moves parameters of
// --grad-bytes bytes (4: f32, as conduit train holds them; it moved 2 whatever the precision).
// Layer-list models cut into pipeline stages as `conduit train --pp` cuts them: between units, by forward
// multiply-adds (the cnn's convolutions against its linear layers; the mlp's first layer alone); GPipe's step is
// each micro-batch on the busiest stage plus a fill and drain that do not grow with the micro-batches; 1F1B holds
// fewer micro-batches' activations; each stage's gradients go among its replicas only.
TEST(Inputs, LayerModelsCutIntoPipelineStagesAsConduitTrainCutsThem) {
  const ClusterSpec flat = flat_cluster(5e-6, 10e9, 1e-11);
  Topology t2(flat, 2), t4(flat, 4);
  CollectiveModel n2(t2), n4(t4);
  const LayerModel cnn = parse_layer_model(kTrainCnnLayers), mlp = parse_layer_model(kTrainMlpLayers);
  ParallelConfig c;
  c.pp = 2;
  c.micro_batch = 16;
  c.grad_bytes = 4;
  c.schedule = Schedule::kGpipe;
  auto note = [](const StepResult& r) { return r.notes.empty() ? std::string() : r.notes[0]; };
  auto at = [&](long long m, const LayerModel& model = parse_layer_model(kTrainCnnLayers)) {
    ParallelConfig x = c;
    x.global_batch = m * x.micro_batch;
    return simulate_layer_step(n2, model, x);
  };
  const StepResult g8 = at(8), g9 = at(9), g16 = at(16);
  EXPECT_NE(note(g8).find("2 stages from units 0 | 2 (of 4"), std::string::npos) << note(g8);
  EXPECT_NE(note(at(8, mlp)).find("2 stages from units 0 | 1 (of 3"), std::string::npos) << note(at(8, mlp));
  EXPECT_EQ(g8.microbatches, 8);
  // One more micro-batch adds one micro-batch of the busiest stage (stage 0: the convolutions); the bubble (fill,
  // drain and the two transfers) stays.
  EXPECT_NEAR(g9.time - g8.time, g8.breakdown.compute / 8, 1e-9 * g8.time);
  EXPECT_NEAR(g16.breakdown.bubble, g8.breakdown.bubble, 1e-9 * g8.time);
  EXPECT_GT(g8.breakdown.bubble, 0);
  EXPECT_NEAR(g8.time, g8.breakdown.compute + g8.breakdown.bubble + g8.breakdown.dp_exposed + g8.breakdown.optimizer,
              1e-9 * g8.time);
  EXPECT_EQ(g8.breakdown.dp_comm, 0);  // one pipeline: no data-parallel exchange
  // The bubble holds the boundary's transfer twice (the first micro-batch's activations forward, the last one's
  // gradient back; pp_comm is 2 transfers a micro-batch): on a link 10x slower, it grows by exactly the difference.
  {
    Topology slow_t(flat_cluster(5e-6, 1e9, 1e-11), 2);
    CollectiveModel slow_n(slow_t);
    ParallelConfig x = c;
    x.global_batch = 8 * x.micro_batch;
    const StepResult s8 = simulate_layer_step(slow_n, cnn, x);
    const double transfer = g8.breakdown.pp_comm / 16, slow_transfer = s8.breakdown.pp_comm / 16;
    EXPECT_GT(slow_transfer, 5 * transfer);
    EXPECT_NEAR(s8.breakdown.bubble - g8.breakdown.bubble, 2 * (slow_transfer - transfer), 1e-9 * s8.time);
  }
  // 1F1B: the first stage holds at most 2 micro-batches' activations, GPipe all 8.
  c.schedule = Schedule::k1F1B;
  const StepResult f8 = at(8);
  EXPECT_NEAR(f8.memory.activations * 4, g8.memory.activations, 1e-9 * g8.memory.activations);
  EXPECT_NEAR(f8.breakdown.compute, g8.breakdown.compute, 1e-12);
  // ... for time: stage 0 runs one forward between a micro-batch's forward and its backward, shorter than the
  // gradient's round trip (two transfers and stage 1's forward and backward), so it idles every micro-batch, where
  // GPipe's run of forwards covers it once (on this cluster of slow links and fast kernels).
  EXPECT_GT(f8.time, g8.time);
  // 2 pipelines on 4 GPUs: each stage's gradients among its 2 replicas, behind its last backward.
  ParallelConfig two = c;
  two.global_batch = 2 * 8 * 16;
  const StepResult d2 = simulate_layer_step(n4, cnn, two);
  EXPECT_EQ(d2.config.dp, 2);
  EXPECT_EQ(d2.microbatches, 8);
  EXPECT_GT(d2.breakdown.dp_comm, 0);
  EXPECT_GE(d2.time, f8.time);
  // A unit a stage at --pp 4; not more stages than units, nor ZeRO, other schedules or a --pp not dividing --gpus.
  c.pp = 4;
  c.global_batch = 64;
  Topology t8(flat, 8);
  CollectiveModel n8(t8);
  EXPECT_NE(note(simulate_layer_step(n8, cnn, c)).find("4 stages from units 0 | 1 | 2 | 3"), std::string::npos);
  c.pp = 5;
  EXPECT_NE(error_of([&] { simulate_layer_step(n8, cnn, c); }).find("--pp (5) must divide --gpus (8)"),
            std::string::npos);
  Topology t5(flat, 5);
  CollectiveModel n5(t5);
  c.global_batch = 80;
  EXPECT_NE(error_of([&] { simulate_layer_step(n5, cnn, c); }).find("--pp (5) exceeds the layer model's 4 units"),
            std::string::npos);
  c.pp = 2;
  c.zero = 1;
  EXPECT_NE(error_of([&] { simulate_layer_step(n2, cnn, c); }).find("--zero with --pp is not modelled"),
            std::string::npos);
  c.zero = 0;
  c.schedule = Schedule::kInterleaved;
  EXPECT_NE(error_of([&] { simulate_layer_step(n2, cnn, c); }).find("gpipe or 1f1b with --pp above 1"),
            std::string::npos);
}

TEST(Inputs, LayerModelsAtZero3GatherEachLayerAsConduitTrainDoes) {
  Topology t8(load_cluster("dgx-a100"), 8);
  CollectiveModel n8(t8);
  const Accelerator& acc = t8.spec().node_kinds[0].accelerator;
  const LayerModel cnn = parse_layer_model(kTrainCnnLayers);
  const Group dg{8, 1, 0};
  auto ag = [&](double params) { return n8.time(Collective::kAllGather, Algorithm::kAuto, dg, params * 4); };
  auto rs = [&](double params) {
    return n8.time(Collective::kReduceScatter, Algorithm::kAuto, dg, params * 4) + memory_time(acc, 8 * params / 8, 1);
  };
  // conv1 320, conv2 18,496, fc1 401,536 and fc2 1,290 parameters.
  const double units[4] = {320, 18496, 401536, 1290};
  ParallelConfig z;
  z.global_batch = 8 * 4 * 2;  // 2 micro-batches of 4 a rank
  z.micro_batch = 4;
  z.grad_bytes = 4;
  z.zero = 3;
  z.zero_prefetch = false;  // (every gather blocks its layer; prefetch below)
  const StepResult r = simulate_layer_step(n8, cnn, z);
  const double gathers = 2 * (2 * ag(units[0]) + 2 * ag(units[1]) + 2 * ag(units[2]) + ag(units[3]));
  EXPECT_NEAR(r.breakdown.zero3_exposed, gathers, 1e-9 * gathers);
  {
    // conduit train --zero-gather bf16: each gather of 2-byte elements; the memory as before (the units widened).
    ParallelConfig h = z;
    h.gather_bytes = 2;
    auto ag2 = [&](double params) { return n8.time(Collective::kAllGather, Algorithm::kAuto, dg, params * 2); };
    const double gathers2 = 2 * (2 * ag2(units[0]) + 2 * ag2(units[1]) + 2 * ag2(units[2]) + ag2(units[3]));
    const StepResult g2 = simulate_layer_step(n8, cnn, h);
    EXPECT_NEAR(g2.breakdown.zero3_exposed, gathers2, 1e-9 * gathers2);
    EXPECT_LT(gathers2, gathers);
    EXPECT_EQ(g2.memory.params, r.memory.params);
    // --zero-gather int8: a byte an element and a 4-byte scale per 256 of them.
    h.gather_bytes = 1;
    auto ag1 = [&](double params) {
      return n8.time(Collective::kAllGather, Algorithm::kAuto, dg, params * (1 + 4.0 / 256));
    };
    const double gathers1 = 2 * (2 * ag1(units[0]) + 2 * ag1(units[1]) + 2 * ag1(units[2]) + ag1(units[3]));
    EXPECT_NEAR(simulate_layer_step(n8, cnn, h).breakdown.zero3_exposed, gathers1, 1e-9 * gathers1);
    EXPECT_LT(gathers1, gathers2);
  }
  {
    // With prefetch each next layer's gather runs behind the layer before: the same bytes and the same gathers,
    // less of them exposed. Where every layer computes longer than any gather takes (a slow accelerator on a fast
    // network), only the first layer's forward gather is left, once a micro-batch.
    ParallelConfig p = z;
    p.zero_prefetch = true;
    const StepResult a = simulate_layer_step(n8, cnn, p);
    EXPECT_NEAR(a.breakdown.dp_comm, r.breakdown.dp_comm, 1e-12 * r.breakdown.dp_comm);
    EXPECT_LT(a.breakdown.zero3_exposed, r.breakdown.zero3_exposed);
    // (the backward no longer stretched by its gathers leaves the reduce-scatters less to hide behind)
    EXPECT_GT(a.breakdown.dp_exposed, r.breakdown.dp_exposed);
    EXPECT_LT(a.time, r.time);
    Topology ts(flat_cluster(1e-9, 1e12, 0, 1e9), 8);
    CollectiveModel ns(ts);
    const double first = ns.time(Collective::kAllGather, Algorithm::kAuto, dg, units[0] * 4);
    const StepResult s = simulate_layer_step(ns, cnn, p);
    EXPECT_NEAR(s.breakdown.zero3_exposed, 2 * first, 1e-9 * first);
    p.zero_prefetch = false;
    EXPECT_GT(simulate_layer_step(ns, cnn, p).breakdown.zero3_exposed, 10 * s.breakdown.zero3_exposed);
  }
  const double rs_all = rs(units[0]) + rs(units[1]) + rs(units[2]) + rs(units[3]);
  EXPECT_NEAR(r.breakdown.dp_comm, gathers + rs_all, 1e-9 * gathers);
  EXPECT_NEAR(r.time, r.breakdown.compute + r.breakdown.dp_exposed + gathers + r.breakdown.optimizer, 1e-9 * r.time);
  // Behind the backward, the reduce-scatters hide in part (fc2's goes first, behind fc1's and the convolutions'
  // backward; conv1's comes last, with nothing left to hide behind).
  EXPECT_LT(r.breakdown.dp_exposed, rs_all);
  z.dp_overlap = false;
  EXPECT_NEAR(simulate_layer_step(n8, cnn, z).breakdown.dp_exposed, rs_all, 1e-9 * rs_all);
  z.sync = parse_sync("async");
  EXPECT_NE(error_of([&] { simulate_layer_step(n8, cnn, z); }).find("--sync async with --zero 3 is not modelled"),
            std::string::npos);
  // Its memory, f32 as conduit train holds it: 4-byte parameters and Adam's two 4-byte moments a parameter, sharded
  // over the 8 ranks, plus the largest unit (fc1) whole; with prefetch the largest two adjacent units whole (conv2 and
  // fc1: conv2's gather, started ahead, is under way while fc1 runs). Its gradients: the 2 micro-batches summed in
  // the units' buckets, the whole gradients held (--zero-reduce step, conduit train's default; the shard and fc1's
  // bucket until 2026-12-05); reducing each micro-batch (--zero-reduce micro-batch, DeepSpeed's) holds the shard and
  // the largest bucket, and reduce-scatters twice, all exposed without overlap.
  const double p = cnn.params();
  z.sync = parse_sync("bsp");
  const StepResult m3 = simulate_layer_step(n8, cnn, z);
  EXPECT_DOUBLE_EQ(m3.memory.params, 4 * p / 8 + 4 * units[2]);
  EXPECT_DOUBLE_EQ(m3.memory.grads, 4 * p);
  z.zero_reduce = ZeroReduce::kEveryMicroBatch;
  const StepResult e3 = simulate_layer_step(n8, cnn, z);
  EXPECT_DOUBLE_EQ(e3.memory.grads, 4 * p / 8 + 4 * units[2]);
  EXPECT_NEAR(e3.breakdown.dp_comm, gathers + 2 * rs_all, 1e-9 * gathers);
  EXPECT_NEAR(e3.breakdown.dp_exposed, 2 * rs_all, 1e-9 * rs_all);
  z.zero_reduce = ZeroReduce::kModelDefault;
  z.zero_prefetch = true;
  EXPECT_DOUBLE_EQ(simulate_layer_step(n8, cnn, z).memory.params, 4 * p / 8 + 4 * (units[1] + units[2]));
  EXPECT_DOUBLE_EQ(simulate_layer_step(n8, cnn, z).memory.grads, 4 * p);
  z.zero_prefetch = false;
  EXPECT_DOUBLE_EQ(m3.memory.optimizer, 8 * p / 8);
  z.zero = 0;
  const StepResult m0 = simulate_layer_step(n8, cnn, z);
  EXPECT_DOUBLE_EQ(m0.memory.params, 4 * p);
  EXPECT_DOUBLE_EQ(m0.memory.grads, 4 * p);
  EXPECT_DOUBLE_EQ(m0.memory.optimizer, 8 * p);
  // ZeRO-1, one bucket, no overlap, no prefetch: the reduce-scatter and the allgather of 4-byte parameters, the
  // average over this rank's eighth.
  ParallelConfig one;
  one.global_batch = 8 * 4;
  one.micro_batch = 4;
  one.grad_bytes = 4;
  one.zero = 1;
  one.dp_overlap = false;
  one.zero_prefetch = false;
  one.bucket_bytes = 1e15;
  const double expect =
      n8.time(Collective::kReduceScatter, Algorithm::kAuto, dg, p * 4) + memory_time(acc, 8 * p / 8, 1) + ag(p);
  EXPECT_NEAR(simulate_layer_step(n8, cnn, one).breakdown.dp_comm, expect, 1e-9 * expect);
  // With prefetch (conduit train's default) the allgather goes behind the next forward, one call a unit: the same
  // bytes in four calls, and where every layer computes longer than the next unit's allgather takes (a slow
  // accelerator on a fast network) only conv1's is exposed.
  ParallelConfig behind = one;
  behind.zero_prefetch = true;
  const double pieces = ag(units[0]) + ag(units[1]) + ag(units[2]) + ag(units[3]);
  EXPECT_NEAR(simulate_layer_step(n8, cnn, behind).breakdown.dp_comm, expect - ag(p) + pieces, 1e-9 * expect);
  Topology ts(flat_cluster(1e-9, 1e12, 0, 1e9), 8);
  CollectiveModel ns(ts);
  auto ags = [&](double params) { return ns.time(Collective::kAllGather, Algorithm::kAuto, dg, params * 4); };
  const StepResult blocking = simulate_layer_step(ns, cnn, one), hidden = simulate_layer_step(ns, cnn, behind);
  EXPECT_NEAR(blocking.breakdown.dp_exposed - hidden.breakdown.dp_exposed, ags(p) - ags(units[0]), 1e-9 * ags(p));
  EXPECT_GT(ags(p), 10 * ags(units[0]));  // (what hid is most of it)
  EXPECT_LT(hidden.time, blocking.time);
}

// ZeRO-1/2 on a GPT: with prefetch (and overlap) the allgather of the updated parameters goes behind the next
// forward, as conduit train runs it, one call for the embeddings and one a layer; on a slow accelerator and a fast
// network only the embeddings' and the first layer's are exposed. --no-zero-prefetch exposes one allgather of them
// all; --no-overlap (the gradients') leaves it behind the forward, as the runtime does.
TEST(Inputs, ZeroOneAndTwoAllgatherBehindTheNextForward) {
  // (one bucket: a call per unit)
  Topology ts(flat_cluster(1e-9, 1e12, 0, 1e9), 8);
  CollectiveModel ns(ts);
  const GptModel m = named_model("gpt2-small");
  const Group dg{8, 1, 0};
  auto ag = [&](double bytes) { return ns.time(Collective::kAllGather, Algorithm::kAuto, dg, bytes); };
  const double layer = gpt_layer_parameters_per_rank(m, 1) * 2,
               emb = (static_cast<double>(m.vocab) + static_cast<double>(m.seq)) * static_cast<double>(m.hidden) * 2;
  const double whole = ag(m.layers * layer + emb), pieces = ag(emb) + m.layers * ag(layer);
  for (int zero : {1, 2}) {
    ParallelConfig c;
    c.global_batch = 8;
    c.zero = zero;
    c.bucket_bytes = 1e15;
    const StepResult behind = simulate_step(ns, m, c);
    c.zero_prefetch = false;
    const StepResult blocking = simulate_step(ns, m, c);
    EXPECT_NEAR(blocking.breakdown.dp_comm - behind.breakdown.dp_comm, whole - pieces, 1e-9 * whole) << zero;
    EXPECT_NEAR(blocking.breakdown.dp_exposed - behind.breakdown.dp_exposed, whole - ag(emb) - ag(layer), 1e-9 * whole)
        << zero;
    EXPECT_GT(whole, 2 * (ag(emb) + ag(layer))) << zero;  // (what hid is most of it)
    c.zero_prefetch = true;
    c.dp_overlap = false;
    ParallelConfig n = c;
    n.zero_prefetch = false;
    EXPECT_NEAR(simulate_step(ns, m, n).breakdown.dp_exposed - simulate_step(ns, m, c).breakdown.dp_exposed,
                whole - ag(emb) - ag(layer), 1e-9 * whole)
        << zero;
  }
  // With tensor parallelism each call is the rank's share: a layer's parameters over t, the word embeddings over t
  // (vocab-parallel), the position embeddings whole.
  Topology t16(flat_cluster(1e-9, 1e12, 0, 1e9), 16);
  CollectiveModel n16(t16);
  const Group dg2{8, 2, 0};
  auto ag2 = [&](double bytes) { return n16.time(Collective::kAllGather, Algorithm::kAuto, dg2, bytes); };
  const double layer2 = gpt_layer_parameters_per_rank(m, 2) * 2,
               emb2 =
                   (static_cast<double>(m.vocab) / 2 + static_cast<double>(m.seq)) * static_cast<double>(m.hidden) * 2;
  ParallelConfig c2;
  c2.global_batch = 8;
  c2.tp = 2;
  c2.zero = 1;
  c2.bucket_bytes = 1e15;
  const StepResult behind2 = simulate_step(n16, m, c2);
  c2.zero_prefetch = false;
  const StepResult blocking2 = simulate_step(n16, m, c2);
  const double whole2 = ag2(m.layers * layer2 + emb2);
  EXPECT_NEAR(blocking2.breakdown.dp_comm - behind2.breakdown.dp_comm, whole2 - (ag2(emb2) + m.layers * ag2(layer2)),
              1e-9 * whole2);
  EXPECT_NEAR(blocking2.breakdown.dp_exposed - behind2.breakdown.dp_exposed, whole2 - ag2(emb2) - ag2(layer2),
              1e-9 * whole2);
}

// The deferred allgather's calls, cut as the runtime cuts its pieces: tensors fill the buckets from the last one
// backward (never split), a call is a unit's part of one bucket, joined to the bucket's last call while that is
// smaller than the least size.
TEST(Inputs, DeferredAllgatherCallsFollowTheBucketsAndJoinUpToTheirSize) {
  auto calls = [](const std::vector<std::vector<double>>& units, double bucket, double least) {
    std::vector<std::pair<double, size_t>> out;
    for (const DeferredCall& d : deferred_allgather_calls(units, bucket, least)) out.emplace_back(d.elems, d.unit);
    return out;
  };
  using Calls = std::vector<std::pair<double, size_t>>;
  // Buckets of 20 from the back: {6, 4} and the 8 after them (18), the other 8, the 30 alone, the 10.
  const std::vector<std::vector<double>> units{{10, 30}, {8, 8}, {6, 4}};
  EXPECT_EQ(calls(units, 20, 0), (Calls{{30, 0}, {10, 0}, {8, 1}, {8, 1}, {10, 2}}));
  EXPECT_EQ(calls(units, 20, 16), (Calls{{30, 0}, {10, 0}, {18, 1}, {8, 1}}));
  // One bucket: every unit joins while the call is small; a large call stands, the next starts its own.
  EXPECT_EQ(calls(units, 1e9, 1e9), (Calls{{66, 0}}));
  EXPECT_EQ(calls(units, 1e9, 40), (Calls{{40, 0}, {26, 1}}));
  EXPECT_EQ(calls(units, 1e9, 0), (Calls{{40, 0}, {16, 1}, {10, 2}}));
  // A tensor larger than a bucket has one of its own; a unit without parameters has no call.
  EXPECT_EQ(calls({{50}, {}, {5}}, 20, 0), (Calls{{50, 0}, {5, 2}}));
}

// --zero-allgather-bucket: one call for the whole model is the blocking allgather's time, exposed before the first
// layer (the layers' tensors sum to a rank's parameters, with tensor parallelism too); calls of a few layers each
// hide all but the first behind the forward.
TEST(Inputs, ZeroAllgatherBucketJoinsTheLayersCalls) {
  Topology ts(flat_cluster(1e-6, 1e11, 0, 1e9), 64);
  CollectiveModel ns(ts);
  const GptModel m = named_model("gpt2-small");
  for (int tp : {1, 4}) {
    ParallelConfig c;
    c.global_batch = 64;
    c.tp = tp;
    c.zero = 1;
    c.bucket_bytes = 1e15;
    const StepResult per_layer = simulate_step(ns, m, c);
    c.zero_allgather_bytes = 1e15;
    const StepResult one = simulate_step(ns, m, c);
    c.zero_prefetch = false;
    const StepResult blocking = simulate_step(ns, m, c);
    EXPECT_NEAR(one.breakdown.dp_exposed, blocking.breakdown.dp_exposed, 1e-9 * blocking.breakdown.dp_exposed) << tp;
    EXPECT_NEAR(one.breakdown.dp_comm, blocking.breakdown.dp_comm, 1e-9 * blocking.breakdown.dp_comm) << tp;
    EXPECT_LT(per_layer.breakdown.dp_exposed, one.breakdown.dp_exposed) << tp;
    EXPECT_GT(per_layer.breakdown.dp_comm, one.breakdown.dp_comm) << tp;  // (12 more calls' latencies)
    bool noted = false;
    for (auto& n : one.notes) noted = noted || n.find("behind the next forward in 1 call (") != std::string::npos;
    EXPECT_TRUE(noted) << tp;
  }
}

// --zero-hpz (ZeRO++'s hpZ) on 8 nodes of 8: the backward's gathers (and the embeddings' second) run within each
// node's 8 data-parallel ranks, the rest as before; each GPU holds 1/8 of the 16-bit parameters more. Groups that do
// not divide the data-parallel ranks are refused, as is a layer list.
TEST(Inputs, ZeroHpzGathersTheBackwardWithinTheNode) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt-1.7b");
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  const StepResult plain = simulate_step(net, m, c);
  c.zero_hpz = 8;
  const StepResult hpz = simulate_step(net, m, c);
  auto ag = [&](long long ranks, double bytes) {
    return net.time(Collective::kAllGather, Algorithm::kAuto, Group{ranks, 1, 0}, bytes);
  };
  const double layer = gpt_layer_parameters_per_rank(m, 1),
               emb = static_cast<double>(m.vocab + m.seq) * static_cast<double>(m.hidden);
  const double less = static_cast<double>(m.layers) * (ag(64, 2 * layer) - ag(8, 2 * layer)) + ag(64, 2 * emb) -
                      ag(8, 2 * emb);  // (one micro-batch a rank)
  EXPECT_GT(less, 0);
  EXPECT_NEAR(plain.breakdown.dp_comm - hpz.breakdown.dp_comm, less, 1e-9 * plain.breakdown.dp_comm);
  EXPECT_NEAR(hpz.memory.params - plain.memory.params, 2 * (m.layers * layer + emb) / 8, 1e-6 * plain.memory.params);
  // Without prefetch every gather is exposed: exactly the backward's gathers' difference.
  c.zero_prefetch = false;
  const StepResult hpz_blocking = simulate_step(net, m, c);
  c.zero_hpz = 0;
  const StepResult plain_blocking = simulate_step(net, m, c);
  EXPECT_NEAR(plain_blocking.breakdown.zero3_exposed - hpz_blocking.breakdown.zero3_exposed, less,
              1e-9 * plain_blocking.breakdown.zero3_exposed);
  // `node` (-1): the node's data-parallel ranks, 8 at t = 1; none at t = 8, which fills a node (said in a note).
  c.zero_prefetch = true;
  c.zero_hpz = -1;
  EXPECT_EQ(simulate_step(net, m, c).breakdown.dp_comm, hpz.breakdown.dp_comm);
  c.tp = 8;
  const StepResult node8 = simulate_step(net, m, c);
  c.zero_hpz = 0;
  EXPECT_EQ(node8.breakdown.dp_comm, simulate_step(net, m, c).breakdown.dp_comm);
  bool noted = false;
  for (auto& n : node8.notes) noted = noted || n.find("--zero-hpz node: 1 data-parallel ranks a node") == 0;
  EXPECT_TRUE(noted);
  c.tp = 1;
  auto refused = [&](long long k, long long gpus, int tp = 1) {
    Topology tk(load_cluster("dgx-a100"), gpus);
    CollectiveModel nk(tk);
    ParallelConfig ck = c;
    ck.zero_hpz = k;
    ck.tp = tp;
    ck.global_batch = gpus;
    try {
      simulate_step(nk, m, ck);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(
      refused(3, 64).find("--zero-hpz = 3: groups that do not divide the 64 data-parallel ranks into two or more"),
      std::string::npos);
  EXPECT_NE(refused(64, 64).find("--zero-hpz = 64: groups"), std::string::npos);
  EXPECT_NE(
      refused(2, 8, 8).find("shards over the data-parallel ranks, and dp = 1 here; allowed with dp = 1: --zero 0"),
      std::string::npos);  // (one data-parallel rank: refused too, not ignored)
}

// --compression int8|int4 with --zero (ZeRO++'s qgZ, `conduit train --zero N --compressor int8`): each reduce-scatter
// becomes an all-to-all of blocks of 256 with a 4-byte scale each, on 8 nodes of 8 in two hops (within the node, then
// 1/8 of it among the ranks of one local index across nodes) plus a quantizing and a decoding pass a hop; at tp 8 (a
// node's GPUs one data-parallel rank) one hop over the nodes. fp16 is a 16-bit reduce-scatter (a GPT model's
// gradients are 16-bit already: nothing changes); top-k and PowerSGD are refused with --zero.
TEST(Inputs, ZeroInt8GradientsGoByAllToAllInTwoHopsAcrossNodes) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const Accelerator& acc = topo.spec().node_kinds.front().accelerator;
  const GptModel m = named_model("gpt-1.7b");
  const double layer = gpt_layer_parameters_per_rank(m, 1),
               emb = static_cast<double>(m.vocab + m.seq) * static_cast<double>(m.hidden);
  for (int zero : {1, 3}) {
    ParallelConfig c;
    c.global_batch = 64;
    c.zero = zero;
    c.dp_overlap = false;  // (every call on the critical path: the breakdown's sums)
    c.zero_prefetch = false;
    c.bucket_bytes = 1e15;  // (ZeRO-1: one bucket of every gradient)
    const StepResult plain = simulate_step(net, m, c);
    c.compression = parse_compression("fp16");
    EXPECT_EQ(simulate_step(net, m, c).time, plain.time) << zero;
    for (const std::string kind : {"int8", "int4"}) {
      c.compression = parse_compression(kind);
      const StepResult q = simulate_step(net, m, c);
      const double qb = (kind == "int8" ? 1.0 : 0.5) + 4.0 / 256;
      auto rs = [&](double n) {
        return net.time(Collective::kReduceScatter, Algorithm::kAuto, Group{64, 1, 0}, n * 2);
      };
      auto a2a = [&](double n) {
        return net.time(Collective::kAllToAll, Algorithm::kDirect, Group{8, 1, 0}, n * qb) +
               net.time(Collective::kAllToAll, Algorithm::kDirect, Group{8, 8, 0}, n * qb / 8) +
               memory_time(acc, n * (2 + qb) * 2 * (1 + 1.0 / 8), 4);
      };
      // ZeRO-3: each layer's and the embeddings' reduce-scatter; ZeRO-1: one call of every gradient.
      const double total = static_cast<double>(m.layers) * layer + emb;
      const double less = zero == 3 ? static_cast<double>(m.layers) * (rs(layer) - a2a(layer)) + rs(emb) - a2a(emb)
                                    : rs(total) - a2a(total);
      const std::string what = fmt::format("zero {} {}", zero, kind);
      EXPECT_GT(less, 0) << what;
      EXPECT_NEAR(plain.breakdown.dp_comm - q.breakdown.dp_comm, less, 1e-9 * plain.breakdown.dp_comm) << what;
      EXPECT_EQ(q.dp_algorithm, zero == 1 ? "all-to-all, two hops" : plain.dp_algorithm) << what;
      bool noted = false;
      for (auto& n : q.notes)
        noted = noted || n.find("ZeRO's gradients in " + kind +
                                " blocks by all-to-all (ZeRO++'s qgZ): within each "
                                "node's 8 data-parallel ranks, then 1/8 of them across nodes") == 0;
      EXPECT_TRUE(noted) << what;
    }
  }
  // tp 2: a node's 4 data-parallel ranks two apart, then the two ranks of a local index eight apart; ZeRO-2 with two
  // micro-batches reduce-scatters each one's gradients.
  {
    ParallelConfig c;
    c.global_batch = 64;  // (two micro-batches on each of the 32 data-parallel ranks)
    c.tp = 2;
    c.zero = 2;
    c.dp_overlap = false;
    c.zero_prefetch = false;
    c.bucket_bytes = 1e15;
    const StepResult plain = simulate_step(net, m, c);
    c.compression = parse_compression("int8");
    const StepResult q = simulate_step(net, m, c);
    const double n = static_cast<double>(m.layers) * gpt_layer_parameters_per_rank(m, 2) +
                     static_cast<double>(m.vocab) * static_cast<double>(m.hidden) / 2 +
                     static_cast<double>(m.seq) * static_cast<double>(m.hidden);
    const double qb = 1 + 4.0 / 256;
    const double less = net.time(Collective::kReduceScatter, Algorithm::kAuto, Group{32, 2, 0}, n * 2) -
                        net.time(Collective::kAllToAll, Algorithm::kDirect, Group{4, 2, 0}, n * qb) -
                        net.time(Collective::kAllToAll, Algorithm::kDirect, Group{8, 8, 0}, n * qb / 4) -
                        memory_time(acc, n * (2 + qb) * 2 * (1 + 1.0 / 4), 4);
    EXPECT_GT(less, 0);
    EXPECT_NEAR(plain.breakdown.dp_comm - q.breakdown.dp_comm, 2 * less, 1e-9 * plain.breakdown.dp_comm);
    EXPECT_EQ(q.microbatches, 2);
  }
  // tp 8: one data-parallel rank a node, one hop over the 8 nodes.
  ParallelConfig c;
  c.global_batch = 64;
  c.tp = 8;
  c.zero = 1;
  c.dp_overlap = false;
  c.zero_prefetch = false;
  c.bucket_bytes = 1e15;
  const StepResult plain = simulate_step(net, m, c);
  c.compression = parse_compression("int8");
  const StepResult q = simulate_step(net, m, c);
  const double n = static_cast<double>(m.layers) * gpt_layer_parameters_per_rank(m, 8) +
                   static_cast<double>(m.vocab) * static_cast<double>(m.hidden) / 8 +
                   static_cast<double>(m.seq) * static_cast<double>(m.hidden);
  const double qb = 1 + 4.0 / 256;
  const double less = net.time(Collective::kReduceScatter, Algorithm::kAuto, Group{8, 8, 0}, n * 2) -
                      net.time(Collective::kAllToAll, Algorithm::kDirect, Group{8, 8, 0}, n * qb) -
                      memory_time(acc, n * (2 + qb) * 2, 2);
  EXPECT_NEAR(plain.breakdown.dp_comm - q.breakdown.dp_comm, less, 1e-9 * plain.breakdown.dp_comm);
  EXPECT_EQ(q.dp_algorithm, "all-to-all");
  // Refused with --zero: what is not a reduce-scatter's wire.
  for (const std::string kind : {"topk:0.01", "powersgd:4"}) {
    c.compression = parse_compression(kind);
    try {
      simulate_step(net, m, c);
      ADD_FAILURE() << kind << " was taken with --zero 1";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("allowed with --zero > 0: none, fp16 (a 16-bit reduce-scatter), int8 or "
                                           "int4"),
                std::string::npos)
          << e.what();
    }
  }
  // Layer lists (`conduit train`'s f32 models) alike, at ZeRO-1 (one bucket) and ZeRO-3 (one unit): two hops over
  // ethernet-25g's nodes of 4 at 8 ranks, one within a node at 4, each the f32 reduce-scatter's time less the
  // all-to-all hops and their passes (the quantized ring's separate passes not charged again); at --zero 0 int8 stays
  // the quantized allreduce.
  for (long long gpus : {4LL, 8LL}) {
    Topology tl(load_cluster("ethernet-25g"), gpus);
    CollectiveModel nl(tl);
    const Accelerator& v100 = tl.spec().node_kinds.front().accelerator;
    const LayerModel lm = parse_layer_model("dense:2000x2000");
    double n = 0;
    for (auto& l : lm.layers) n += l.params();
    const double qb = 1 + 4.0 / 256;
    const Group flat{gpus, 1, 0};
    const double rs = nl.time(Collective::kReduceScatter, Algorithm::kAuto, flat, n * 4);
    const double a2a = gpus == 8 ? nl.time(Collective::kAllToAll, Algorithm::kDirect, Group{4, 1, 0}, n * qb) +
                                       nl.time(Collective::kAllToAll, Algorithm::kDirect, Group{2, 4, 0}, n * qb / 4) +
                                       memory_time(v100, n * (4 + qb) * 2 * (1 + 1.0 / 4), 4)
                                 : nl.time(Collective::kAllToAll, Algorithm::kDirect, flat, n * qb) +
                                       memory_time(v100, n * (4 + qb) * 2, 2);
    for (int zero : {1, 3}) {
      ParallelConfig lc;
      lc.global_batch = 64;
      lc.grad_bytes = 4;
      lc.zero = zero;
      lc.dp_overlap = false;
      lc.zero_prefetch = false;
      lc.bucket_bytes = 1e15;
      const StepResult f32 = simulate_layer_step(nl, lm, lc);
      lc.compression = parse_compression("int8");
      const StepResult q8 = simulate_layer_step(nl, lm, lc);
      const std::string what = fmt::format("{} ranks, zero {}", gpus, zero);
      EXPECT_EQ(q8.dp_algorithm, gpus == 8 ? "all-to-all, two hops" : "all-to-all") << what;
      EXPECT_GT(rs - a2a, 0) << what;
      EXPECT_NEAR(f32.breakdown.dp_comm - q8.breakdown.dp_comm, rs - a2a, 1e-9 * f32.breakdown.dp_comm) << what;
      EXPECT_EQ(q8.breakdown.compression, 0.0) << what;
      lc.zero = 0;
      EXPECT_NE(simulate_layer_step(nl, lm, lc).dp_algorithm.find("all-to-all"), 0u) << what;
    }
  }
  // Shard groups of 6 on nodes of 4 (24 ranks): each group holds 4 + 2 or 2 + 4 ranks of two nodes, and takes two
  // hops as the runtime does (it took one): within the node's part, then the smallest part's 2 ranks each sending 4/12
  // of the gradients across, an all-to-all over the 2 nodes of 2/3 (it sends half of that); the quantize passes of
  // 1 + 1/2 of the gradients.
  {
    Topology tl(load_cluster("ethernet-25g"), 24);
    CollectiveModel nl(tl);
    const Accelerator& v100 = tl.spec().node_kinds.front().accelerator;
    const LayerModel lm = parse_layer_model("dense:2000x2000");
    double n = 0;
    for (auto& l : lm.layers) n += l.params();
    const double qb = 1 + 4.0 / 256;
    const double rs = nl.time(Collective::kReduceScatter, Algorithm::kAuto, Group{6, 1, 0}, n * 4);
    const double a2a = nl.time(Collective::kAllToAll, Algorithm::kDirect, Group{4, 1, 0}, n * qb) +
                       nl.time(Collective::kAllToAll, Algorithm::kDirect, Group{2, 4, 0}, n * qb * 2 / 3) +
                       memory_time(v100, n * (4 + qb) * 2 * (1 + 1.0 / 2), 4);
    ParallelConfig lc;
    lc.global_batch = 24;
    lc.grad_bytes = 4;
    lc.zero = 1;
    lc.zero_shard = 6;
    lc.dp_overlap = false;
    lc.zero_prefetch = false;
    lc.bucket_bytes = 1e15;
    const StepResult f32 = simulate_layer_step(nl, lm, lc);
    lc.compression = parse_compression("int8");
    const StepResult q8 = simulate_layer_step(nl, lm, lc);
    EXPECT_EQ(q8.dp_algorithm, "all-to-all, two hops");
    EXPECT_GT(rs - a2a, 0);
    EXPECT_NEAR(f32.breakdown.dp_comm - q8.breakdown.dp_comm, rs - a2a, 1e-9 * f32.breakdown.dp_comm);
  }
}

// --zero-shard-group (FSDP's HYBRID_SHARD, MiCS) on 8 nodes of 8: every gather and reduce-scatter within the node's 8
// ranks, each rank's eighth of a layer's gradients then allreduced across the 8 nodes; the optimizer state sharded
// 8 ways instead of 64. `node` is the same at t 1; refused with hpZ, with a group that does not divide, and for
// layer lists.
TEST(Inputs, ZeroShardGroupsGatherWithinTheNodeAndAllreduceAcross) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt-1.7b");
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  c.dp_overlap = false;
  c.zero_prefetch = false;
  const StepResult plain = simulate_step(net, m, c);
  c.zero_shard = 8;
  const StepResult h = simulate_step(net, m, c);
  const Group node{8, 1, 0}, across{8, 8, 0};
  auto call = [&](double n) {
    return 2 * net.time(Collective::kAllGather, Algorithm::kAuto, node, n * 2) +
           net.time(Collective::kReduceScatter, Algorithm::kAuto, node, n * 2) +
           net.time(Collective::kAllReduce, Algorithm::kAuto, across, n / 8 * 2);
  };
  const double layer = gpt_layer_parameters_per_rank(m, 1),
               emb = static_cast<double>(m.vocab + m.seq) * static_cast<double>(m.hidden);
  EXPECT_NEAR(h.breakdown.dp_comm, static_cast<double>(m.layers) * call(layer) + call(emb), 1e-9 * h.breakdown.dp_comm);
  EXPECT_LT(h.breakdown.dp_comm, plain.breakdown.dp_comm);
  const double params = static_cast<double>(m.layers) * layer + emb;
  EXPECT_NEAR(h.memory.optimizer, zero_model_state(params, 8, 3, 2).optimizer, 1e-6 * h.memory.optimizer);
  EXPECT_NEAR(plain.memory.optimizer * 8, h.memory.optimizer, 1e-6 * h.memory.optimizer);
  c.zero_shard = -1;
  const StepResult by_node = simulate_step(net, m, c);
  EXPECT_EQ(by_node.breakdown.dp_comm, h.breakdown.dp_comm);
  // The result holds the group `node` resolved to, and its label says so (a plan's too).
  EXPECT_EQ(by_node.config.zero_shard, 8);
  EXPECT_NE(describe_config(by_node.config).find(" shard=8"), std::string::npos) << describe_config(by_node.config);
  EXPECT_NE(describe_config(c).find(" shard=node"), std::string::npos) << describe_config(c);
  {
    PlanSpace space;
    space.zero = {3};
    space.tp = {1};
    space.base.zero_shard = -1;
    const PlanResult pr = plan(net, m, 64, space, 3);
    ASSERT_FALSE(pr.ranked.empty());
    EXPECT_EQ(pr.ranked[0].config.zero_shard, 8);
    EXPECT_NE(describe_config(pr.ranked[0].config).find(" shard=8"), std::string::npos);
  }
  // t 2 (32 data-parallel ranks two apart) in groups of 4 (8 groups: K and G differ), 4-byte gradients: the group's
  // ranks 2 apart, the replicas of one index 8 apart, the allreduce of a quarter of a layer in 4 bytes.
  {
    ParallelConfig c2 = c;
    c2.tp = 2;
    c2.zero_shard = 4;
    c2.grad_bytes = 4;
    const StepResult h2 = simulate_step(net, m, c2);
    const Group group{4, 2, 0}, replicas{8, 8, 0};
    const double layer2 = gpt_layer_parameters_per_rank(m, 2),
                 emb2 = static_cast<double>(m.vocab) * static_cast<double>(m.hidden) / 2 +
                        static_cast<double>(m.seq) * static_cast<double>(m.hidden);
    auto call2 = [&](double n) {
      return 2 * net.time(Collective::kAllGather, Algorithm::kAuto, group, n * 2) +
             net.time(Collective::kReduceScatter, Algorithm::kAuto, group, n * 4);
    };
    auto across = [&](double n) { return net.time(Collective::kAllReduce, Algorithm::kAuto, replicas, n / 4 * 4); };
    // (64 samples over 32 data-parallel ranks: the gathers and reduce-scatters twice, the allreduce across the
    // groups once, after the last micro-batch, as MiCS and conduit train; it went every micro-batch until 2026-12-05)
    EXPECT_EQ(h2.microbatches, 2);
    EXPECT_NEAR(h2.breakdown.dp_comm,
                2 * (static_cast<double>(m.layers) * call2(layer2) + call2(emb2)) +
                    static_cast<double>(m.layers) * across(layer2) + across(emb2),
                1e-9 * h2.breakdown.dp_comm);
    EXPECT_NEAR(h2.memory.optimizer, zero_model_state(static_cast<double>(m.layers) * layer2 + emb2, 4, 3, 4).optimizer,
                1e-6 * h2.memory.optimizer);
  }
  auto refused = [&](ParallelConfig k) {
    try {
      simulate_step(net, m, k);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  ParallelConfig k = c;
  k.zero_shard = 3;
  EXPECT_NE(refused(k).find("--zero-shard-group = 3: groups that do not divide the 64 data-parallel ranks"),
            std::string::npos);
  k.zero_shard = 8;
  k.zero_hpz = 8;
  EXPECT_NE(refused(k).find("--zero-shard-group with --zero-hpz"), std::string::npos);
  // On the command line both flags are refused together, even where hpZ's `node` would resolve to no group.
  int rc = 0;
  const std::string both = test_util::run(
      "sim step --cluster dgx-a100 --gpus 64 --model gpt-1.7b --global-batch 64 --zero 3 --tp 8 --zero-hpz node "
      "--zero-shard-group 4",
      &rc);
  EXPECT_EQ(rc, 2) << both;
  EXPECT_NE(both.find("--zero-shard-group with --zero-hpz"), std::string::npos) << both;
}

// Layer lists take hpZ too (ZeRO-3): on 8 nodes of 8 with groups of 8, each unit's backward gather (the first of the
// two dense layers'; the last stays gathered) runs within the node on the f32 parts its forward kept (after f32 or
// int8 forward gathers), bf16 ones with 16-bit forward gathers; every rank holds those parts (an eighth of the first
// layer) besides; refused with shard groups.
TEST(Inputs, ZeroHpzForLayerLists) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const LayerModel m = parse_layer_model("dense:1000x1000,dense:1000x1000");
  const double layer = 1000.0 * 1000 + 1000;
  const Group all{64, 1, 0}, node{8, 1, 0};
  for (double gather : {0.0, 2.0, 1.0}) {
    ParallelConfig c;
    c.global_batch = 64;
    c.zero = 3;
    c.grad_bytes = 4;
    c.gather_bytes = gather;
    c.dp_overlap = false;
    c.zero_prefetch = false;
    const StepResult plain = simulate_layer_step(net, m, c);
    c.zero_hpz = 8;
    const StepResult h = simulate_layer_step(net, m, c);
    EXPECT_EQ(h.config.zero_hpz, 8);
    // (int8 forward gathers: blocks of 256 with a 4-byte scale; the parts kept in f32)
    const double fwd = gather == 2 ? 2 : gather == 1 ? 1 + 4.0 / 256 : 4, kept = gather == 2 ? 2 : 4;
    const double want = net.time(Collective::kAllGather, Algorithm::kAuto, node, layer * kept) -
                        net.time(Collective::kAllGather, Algorithm::kAuto, all, layer * fwd);
    EXPECT_NEAR(h.breakdown.dp_comm - plain.breakdown.dp_comm, want, 1e-9 * plain.breakdown.dp_comm) << gather;
    EXPECT_LT(h.breakdown.dp_comm, plain.breakdown.dp_comm) << gather;
    // (the first unit's part: the last unit's backward comes right after its forward, nothing kept)
    EXPECT_NEAR(h.memory.params - plain.memory.params, layer * kept / 8, 1e-6 * h.memory.params) << gather;
    c.zero_hpz = -1;
    EXPECT_EQ(simulate_layer_step(net, m, c).breakdown.dp_comm, h.breakdown.dp_comm) << gather;
    c.zero_shard = 8;
    EXPECT_THROW(simulate_layer_step(net, m, c), ConfigError);
  }
}

// Layer lists (the models `conduit train` runs) shard within groups too, at stages 1-3: on 8 nodes of 8, groups of
// 8, one bucket, no overlap or prefetch: against sharding over all 64 ranks, the reduce-scatters and allgathers run
// within the node instead and each slice is allreduced across the nodes (4-byte gradients, as conduit train's), the
// rest (the averaging passes, the compute) the same; the optimizer state sharded 8 ways.
TEST(Inputs, ZeroShardGroupsForLayerLists) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const LayerModel m = parse_layer_model("dense:1000x1000,dense:1000x1000");
  const double params = 2 * (1000.0 * 1000 + 1000);
  const Group all{64, 1, 0}, node{8, 1, 0}, across{8, 8, 0};
  const Accelerator& acc = topo.spec().node_kinds[0].accelerator;
  auto t = [&](Collective c, const Group& g, double bytes) { return net.time(c, Algorithm::kAuto, g, bytes); };
  for (int z : {1, 2, 3}) {
    ParallelConfig c;
    c.global_batch = 64;
    c.zero = z;
    c.grad_bytes = 4;
    c.dp_overlap = false;
    c.zero_prefetch = false;
    c.bucket_bytes = params * 4;
    const StepResult plain = simulate_layer_step(net, m, c);
    c.zero_shard = 8;
    const StepResult h = simulate_layer_step(net, m, c);
    EXPECT_EQ(h.config.zero_shard, 8) << z;
    double want = 0;
    if (z < 3) {
      // (each rank averages its slice: an eighth of the bucket instead of a 64th)
      want = t(Collective::kReduceScatter, node, params * 4) - t(Collective::kReduceScatter, all, params * 4) +
             t(Collective::kAllReduce, across, params / 8 * 4) + t(Collective::kAllGather, node, params * 4) -
             t(Collective::kAllGather, all, params * 4) + memory_time(acc, 8 * params / 8, 1) -
             memory_time(acc, 8 * params / 64, 1);
    } else {
      // (each layer a unit: gathered forward, the first again backward; each reduce-scattered with its averaging
      // pass over its slice: an eighth of the layer instead of a 64th)
      const double layer = 1000.0 * 1000 + 1000;
      for (int u = 0; u < 2; ++u)
        want += (u == 0 ? 2 : 1) *
                    (t(Collective::kAllGather, node, layer * 4) - t(Collective::kAllGather, all, layer * 4)) +
                t(Collective::kReduceScatter, node, layer * 4) - t(Collective::kReduceScatter, all, layer * 4) +
                t(Collective::kAllReduce, across, layer / 8 * 4) + memory_time(acc, 8 * layer / 8, 1) -
                memory_time(acc, 8 * layer / 64, 1);
    }
    EXPECT_NEAR(h.breakdown.dp_comm - plain.breakdown.dp_comm, want, 1e-9 * h.breakdown.dp_comm) << z;
    EXPECT_NEAR(h.memory.optimizer, 8 * plain.memory.optimizer, 1e-6 * h.memory.optimizer) << z;
    // (stage 2 shards the gradients too: 8 times the 64th; stage 3's whole unit and bucket held the same)
    if (z == 2) {
      EXPECT_NEAR(h.memory.grads, 8 * plain.memory.grads, 1e-6 * h.memory.grads) << z;
    } else if (z == 1) {
      EXPECT_EQ(h.memory.grads, plain.memory.grads) << z;
    }
    c.zero_shard = -1;
    EXPECT_EQ(simulate_layer_step(net, m, c).breakdown.dp_comm, h.breakdown.dp_comm) << z;
  }
}

// --zero-shard-group at stages 1 and 2 (FSDP's _HYBRID_SHARD_ZERO2) on 8 nodes of 8: the gradients reduce-scattered
// within the node, each rank's eighth allreduced across the 8 nodes, the stepped parameters allgathered within the
// node; the optimizer state (stage 2: and the gradients) sharded 8 ways instead of 64. (One bucket of the whole
// gradients: the call the closed form times.) Refused at stage 0, by step and by plan.
TEST(Inputs, ZeroShardGroupsAtStagesOneAndTwo) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt-1.7b");
  const double params = static_cast<double>(m.layers) * gpt_layer_parameters_per_rank(m, 1) +
                        static_cast<double>(m.vocab + m.seq) * static_cast<double>(m.hidden);
  const Group node{8, 1, 0}, across{8, 8, 0};
  for (int z : {1, 2}) {
    ParallelConfig c;
    c.global_batch = 64;
    c.zero = z;
    c.dp_overlap = false;
    c.zero_prefetch = false;
    c.bucket_bytes = params * 2;
    const StepResult plain = simulate_step(net, m, c);
    c.zero_shard = 8;
    const StepResult h = simulate_step(net, m, c);
    EXPECT_EQ(h.config.zero_shard, 8) << z;
    EXPECT_NE(describe_config(h.config).find(" shard=8"), std::string::npos) << describe_config(h.config);
    const double want = net.time(Collective::kReduceScatter, Algorithm::kAuto, node, params * 2) +
                        net.time(Collective::kAllReduce, Algorithm::kAuto, across, params / 8 * 2) +
                        net.time(Collective::kAllGather, Algorithm::kAuto, node, params * 2);
    EXPECT_NEAR(h.breakdown.dp_comm, want, 1e-9 * want) << z;
    EXPECT_NE(h.breakdown.dp_comm, plain.breakdown.dp_comm) << z;
    const ModelState st = zero_model_state(params, 8, z, 2);
    EXPECT_NEAR(h.memory.optimizer, st.optimizer, 1e-6 * st.optimizer) << z;
    EXPECT_NEAR(h.memory.optimizer, 8 * plain.memory.optimizer, 1e-6 * st.optimizer) << z;
    EXPECT_NEAR(h.memory.grads, st.grads, 1e-6 * st.grads) << z;
    c.zero_shard = -1;
    EXPECT_EQ(simulate_step(net, m, c).breakdown.dp_comm, h.breakdown.dp_comm) << z;
  }
  int rc = 0;
  const std::string zero0 = test_util::run(
      "sim step --cluster dgx-a100 --gpus 64 --model gpt-1.7b --global-batch 64 --zero 0 --zero-shard-group 8", &rc);
  EXPECT_EQ(rc, 2) << zero0;
  EXPECT_NE(zero0.find("--zero-shard-group: ZeRO's shard groups, this step has --zero 0"), std::string::npos) << zero0;
  const std::string plan0 = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 64 --model gpt-1.7b --global-batch 64 --zero-options 0 --zero-shard-group 8",
      &rc);
  EXPECT_EQ(rc, 2) << plan0;
  EXPECT_NE(plan0.find("this search has no ZeRO plans"), std::string::npos) << plan0;
}

// ZeRO-3's gathers and reduce-scatters hide behind a layer's whole time: its compute, its tensor-parallel
// collectives and, under full recompute, its recompute and the recompute's collectives (the windows were the
// compute alone, and the recompute counted as the output layer's). A slow network where every layer's exchange
// outlasts its backward: full recompute hides exactly its own time and its collectives' more.
TEST(Inputs, Zero3HidesBehindTensorParallelismAndRecompute) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 512;
  c.micro_batch = 4;
  c.tp = 2;
  c.zero = 3;
  const StepResult none = simulate_step(net, named_model("gpt-1.7b"), c);
  c.recompute = Recompute::kFull;
  const StepResult full = simulate_step(net, named_model("gpt-1.7b"), c);
  ASSERT_GT(full.breakdown.recompute, 0);
  ASSERT_GT(full.breakdown.tp_comm, none.breakdown.tp_comm);
  const double more = full.breakdown.recompute + full.breakdown.tp_comm - none.breakdown.tp_comm;
  EXPECT_NEAR(none.breakdown.zero3_exposed - full.breakdown.zero3_exposed, more, 1e-9 * more);
  EXPECT_GT(full.breakdown.zero3_exposed, 0);  // (still exposed: the difference is the windows', not a floor's)
}

// ZeRO-3's embeddings on a fast network, where every layer's gathers and reduce-scatters hide behind the layer before:
// what stays exposed is the first layer's gather, the embeddings' first gather and their gradients' reduce-scatter
// (the tied word embeddings' gradient is whole only after the input embedding's backward, the last); the output
// layer's gather hides behind the last layer's forward. Both were hidden behind the output layer's compute, which
// needs the one and produces the other: the reduce-scatter was exposed nowhere.
TEST(Inputs, Zero3ExposesTheEmbeddingsReduceScatter) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt-1.7b");
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  const StepResult r = simulate_step(net, m, c);
  const Group all{64, 1, 0};
  const double layer = gpt_layer_parameters_per_rank(m, 1),
               emb = static_cast<double>(m.vocab + m.seq) * static_cast<double>(m.hidden);
  const double first = net.time(Collective::kAllGather, Algorithm::kAuto, all, 2 * layer) +
                       net.time(Collective::kAllGather, Algorithm::kAuto, all, 2 * emb);
  const double rs_emb = net.time(Collective::kReduceScatter, Algorithm::kAuto, all, 2 * emb);
  EXPECT_GT(rs_emb, 0);
  EXPECT_NEAR(r.breakdown.zero3_exposed, first + rs_emb, 1e-9 * r.breakdown.zero3_exposed);
}

// --no-overlap exposes ZeRO-3's gathers and reduce-scatters (its prefetch overlap was applied regardless).
TEST(Inputs, NoOverlapExposesZero3) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  const StepResult a = simulate_step(net, named_model("gpt-1.7b"), c);
  c.dp_overlap = false;
  const StepResult b = simulate_step(net, named_model("gpt-1.7b"), c);
  EXPECT_NEAR(b.breakdown.zero3_exposed, b.breakdown.dp_comm, 1e-12 * b.breakdown.dp_comm);
  EXPECT_LT(a.breakdown.zero3_exposed, b.breakdown.zero3_exposed);
  // Overlap without prefetch: every gather exposed, the reduce-scatters behind the backward.
  c.dp_overlap = true;
  c.zero_prefetch = false;
  const StepResult n = simulate_step(net, named_model("gpt-1.7b"), c);
  EXPECT_LT(a.breakdown.zero3_exposed, n.breakdown.zero3_exposed);
  EXPECT_LT(n.breakdown.zero3_exposed, b.breakdown.zero3_exposed);
  EXPECT_EQ(n.breakdown.dp_comm, b.breakdown.dp_comm);
  // Memory: a layer prefetched is one more layer whole (its 16-bit parameters), none without prefetch or overlap.
  const double layer = gpt_layer_parameters_per_rank(named_model("gpt-1.7b"), 1);
  EXPECT_DOUBLE_EQ(a.memory.params - n.memory.params, 2 * layer);
  EXPECT_EQ(n.memory.params, b.memory.params);
}

// A search fixed to the interleaved schedule has no one-stage plans (they were ranked, labelled 1f1b).
TEST(Inputs, PlanFixedToInterleavedSkipsOneStage) {
  int rc = 0;
  const std::string out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 16 --model gpt2-small --global-batch 64 --schedule interleaved "
      "--pp-options 1,2 --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("\"schedule\":\"1f1b\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"schedule\":\"interleaved\""), std::string::npos) << out;
}

// Found by a review of sim plan/infer: sizes past 2^31 overflowed into negative parameters ranked first; async with
// ZeRO-3 counted its gathers twice; micro-batches 3, 6, 12 were never tried; --top 0, --virtual-stages 0, repeated
// options, --batch beside --batch-list and --layers-spec with a GPT model were bent or ignored; a sweep's JSON
// records lacked the single run's fields.
TEST(Inputs, PlanAndInferenceReviewFindings) {
  int rc = 0;
  std::string out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 8 --model gpt --layers 8 --hidden 64 --heads 8 --vocab "
      "9223372036854775807 --global-batch 8 --top 1",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--vocab = 9223372036854775807 (allowed: 1 to 2147483647)"), std::string::npos) << out;

  GptModel m = named_model("gpt-1.7b");
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  ParallelConfig c;
  c.global_batch = 64;
  c.zero = 3;
  c.recompute = Recompute::kFull;
  c.sync = parse_sync("async");
  EXPECT_NE(error_of([&] { simulate_step(net, m, c); }).find("--sync async with --zero 3 is not modelled"),
            std::string::npos);
  c.zero = 1;  // ZeRO-1 under async is still modelled, and no slower than under bsp
  const double async_time = simulate_step(net, m, c).time;
  c.sync = parse_sync("bsp");
  EXPECT_LE(async_time, simulate_step(net, m, c).time);

  PlanSpace space;
  space.tp = {1};
  space.pp = {1};
  space.zero = {0};
  space.recompute = {Recompute::kFull};
  Topology t64(load_cluster("dgx-a100"), 64);
  CollectiveModel n64(t64);
  const PlanResult pr = plan(n64, m, 384, space, 100);
  std::set<int> tried;
  for (const auto& r : pr.ranked) tried.insert(r.config.micro_batch);
  EXPECT_EQ(tried, (std::set<int>{1, 2, 3, 6}));  // 384 / 64 = 6 sequences a replica

  const std::string plan_cmd = "sim plan --cluster dgx-a100 --gpus 64 --model gpt2-small --global-batch 512 ";
  out = test_util::run(plan_cmd + "--top 0", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--top = 0 (allowed: 1 or more plans)"), std::string::npos) << out;
  out = test_util::run(plan_cmd + "--top 1", &rc);  // the one plan shown is still compared with the next
  EXPECT_EQ(rc, 0) << out;
  // (here ZeRO-2 ties with ZeRO-1, whose exchange is the same: the tie is said, where nothing was)
  EXPECT_NE(out.find("ties with the next plan (dp=64 tp=1 pp=1 b=8 zero=1"), std::string::npos) << out;
  EXPECT_EQ(out.find("\n     2 "), std::string::npos) << out;
  out = test_util::run(plan_cmd + "--tp-options 8,8", &rc);
  EXPECT_NE(out.find("--tp-options = '8,8' lists 8 twice"), std::string::npos) << out;
  out = test_util::run(plan_cmd + "--zero-options 1,1", &rc);
  EXPECT_NE(out.find("lists 1 twice"), std::string::npos) << out;
  out = test_util::run(plan_cmd + "--schedule interleaved --virtual-stages 0", &rc);
  EXPECT_NE(out.find("--virtual-stages = 0 must be positive"), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 16 --model gpt2-small --global-batch 64 --pp 2 --schedule interleaved "
      "--virtual-stages 0",
      &rc);
  EXPECT_NE(out.find("--virtual-stages = 0 must be positive"), std::string::npos) << out;
  out = test_util::run("sim plan --model layers --layers-spec dense:10x10 --global-batch 64 --gpus 8", &rc);
  EXPECT_NE(out.find("--model layers (a list of layers) is for `sim step` only; allowed here: gpt, gpt2-small"),
            std::string::npos)
      << out;
  out = test_util::run(plan_cmd + "--layers-spec dense:10x10", &rc);
  EXPECT_NE(out.find("--layers-spec describes --model layers"), std::string::npos) << out;
  out = test_util::run("sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 0", &rc);
  EXPECT_NE(out.find("--global-batch = 0 (allowed: a positive number"), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 0 "
      "--no-zero-prefetch",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--no-zero-prefetch: ZeRO gathers the parameters (stages 1 and 2 after the step, stage 3 each "
                     "layer's), this step has --zero 0"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 3 "
      "--no-zero-prefetch --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_prefetch\":false"), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 1 --no-zero-prefetch --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;  // (stages 1 and 2 take it too: their allgather after the step)
  EXPECT_NE(out.find("\"zero_prefetch\":false"), std::string::npos) << out;
  // --zero-allgather-bucket: the calls of stages 1 and 2's allgather behind the forward.
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 2 --zero-allgather-bucket 64M "
      "--json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_allgather_bytes\":67108864"), std::string::npos) << out;
  for (const char* extra : {"--zero 0", "--zero 3", "--zero 1 --no-zero-prefetch"}) {
    out = test_util::run(fmt::format("sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 {} "
                                     "--zero-allgather-bucket 64M",
                                     extra),
                         &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(fmt::format("--zero-allgather-bucket: sizes the calls of ZeRO-1/2's allgather behind the next "
                                   "forward, this step has {}; allowed: --zero 1 or 2 without --no-zero-prefetch",
                                   extra)),
              std::string::npos)
        << out;
  }
  // --zero-reduce: stages 2 and 3, named in the JSON and in the plans' labels; a search without either refuses it;
  // --zero2-reduce, its name before stage 3 took it, still works.
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero 2 --zero-reduce step --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_reduce\":\"step\""), std::string::npos) << out;
  // (as modelled: a GPT model's default every micro-batch, a layer list's once a step; none below stage 2)
  out =
      test_util::run("sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero 2 --json", &rc);
  EXPECT_NE(out.find("\"zero_reduce\":\"micro-batch\""), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model layers --layers-spec dense:784x256,dense:256x10 --global-batch 32 "
      "--zero 2 --json",
      &rc);
  EXPECT_NE(out.find("\"zero_reduce\":\"step\""), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model layers --layers-spec dense:784x256,dense:256x10 --global-batch 32 "
      "--zero 2 --zero-reduce micro-batch --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_reduce\":\"micro-batch\""), std::string::npos) << out;
  out =
      test_util::run("sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero 1 --json", &rc);
  EXPECT_NE(out.find("\"zero_reduce\":null"), std::string::npos) << out;
  // One micro-batch a rank: reduce-scattered once either way.
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 2 --zero-reduce step", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-reduce: this step has one micro-batch a data-parallel rank"), std::string::npos) << out;
  for (const char* extra : {"--zero 1", "--zero 0"}) {
    out = test_util::run(fmt::format("sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 {} "
                                     "--zero-reduce micro-batch",
                                     extra),
                         &rc);
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(fmt::format("--zero-reduce: when ZeRO-2 or 3 reduce-scatters over several micro-batches, this "
                                   "step has {}; allowed: --zero 2 or 3, or leave it out",
                                   extra)),
              std::string::npos)
        << out;
  }
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero 3 --zero2-reduce step --json",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_reduce\":\"step\""), std::string::npos) << out;
  out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero-options 3 --zero-reduce step "
      "--top 1000",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("zero=3 recompute=none zero-reduce=step"), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero 2 --zero-reduce once", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-reduce = 'once' (allowed: micro-batch (after every micro-batch's backward, DeepSpeed's), "
                     "step (once a step, conduit train's by default))"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero-options 1,2 --zero-reduce "
      "step --top 1000",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("zero=2 recompute=none zero-reduce=step"), std::string::npos) << out;
  EXPECT_EQ(out.find("zero=1 recompute=none zero-reduce"), std::string::npos) << out;
  out = test_util::run(
      "sim plan --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 32 --zero-options 0,1 --zero-reduce "
      "step",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-reduce: about ZeRO-2's and 3's reduce-scatters, and this search has no ZeRO-2 or 3 "
                     "plans"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 1 --zero-allgather-bucket 2X",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-allgather-bucket '2X' is not a size"), std::string::npos) << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model layers --layers-spec dense:784x256,dense:256x10 --global-batch 8 "
      "--zero 2 --gather-bytes 2",
      &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--gather-bytes: the wire of ZeRO-3's parameter gathers, this step has --zero 2"),
            std::string::npos)
      << out;
  // A GPT model gathers its 16-bit parameters, or int8 blocks (ZeRO++'s qwZ): fewer bytes, a shorter step.
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt2-small --global-batch 8 --zero 3 --gather-bytes 4", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--gather-bytes 4: a GPT model holds 16-bit parameters and gathers them so; allowed: 1"),
            std::string::npos)
      << out;
  {
    Topology t64(load_cluster("ethernet-25g"), 64);
    CollectiveModel n64(t64);
    ParallelConfig g;
    g.global_batch = 64;
    g.zero = 3;
    const StepResult sixteen = simulate_step(n64, named_model("gpt2-small"), g);
    g.gather_bytes = 2;
    EXPECT_EQ(simulate_step(n64, named_model("gpt2-small"), g).breakdown.dp_comm, sixteen.breakdown.dp_comm);
    g.gather_bytes = 1;
    const StepResult eight = simulate_step(n64, named_model("gpt2-small"), g);
    EXPECT_LT(eight.breakdown.dp_comm, 0.9 * sixteen.breakdown.dp_comm);
    EXPECT_GT(eight.breakdown.dp_comm, 0.5 * sixteen.breakdown.dp_comm);  // (the reduce-scatters stay 16-bit)
    EXPECT_LT(eight.time, sixteen.time);
  }
  // The planner applies it to its ZeRO-3 plans (and reports it there only); a search without them refuses it.
  const std::string plan3 = "sim plan --cluster ethernet-25g --gpus 64 --model gpt2-small --global-batch 64 --json ";
  out = test_util::run(plan3 + "--zero-options 3 --gather-bytes 1", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto with = nlohmann::json::parse(out);
  const auto without = nlohmann::json::parse(test_util::run(plan3 + "--zero-options 3", &rc));
  EXPECT_EQ(with["plans"][0]["config"]["gather_bytes"], 1) << out;
  EXPECT_LT(with["plans"][0]["time_s"].get<double>(), without["plans"][0]["time_s"].get<double>()) << out;
  out = test_util::run(plan3 + "--zero-options 1,3 --gather-bytes 1 --top 1000", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto mixed = nlohmann::json::parse(out);  // (kept: a range over a temporary's member dangles)
  ASSERT_GE(mixed["plans"].size(), 2u) << out;
  std::set<int> stages;
  for (const auto& p : mixed["plans"]) {
    EXPECT_EQ(p["config"]["gather_bytes"], p["config"]["zero"] == 3 ? 1 : 0) << p.dump();
    stages.insert(p["config"]["zero"].get<int>());
  }
  EXPECT_EQ(stages, (std::set<int>{1, 3})) << out;
  out = test_util::run(plan3 + "--zero-options 0,1 --gather-bytes 1", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--gather-bytes: about ZeRO-3's gathers, and this search has no ZeRO-3 plans"), std::string::npos)
      << out;
  out = test_util::run(plan3 + "--zero-options 0,1 --zero-hpz 2", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-hpz: about ZeRO-3's gathers, and this search has no ZeRO-3 plans"), std::string::npos)
      << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 16 --model gpt2-small --global-batch 16 --zero 1 --zero-hpz 8", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-hpz: a secondary partition of ZeRO-3's parameters, this step has --zero 1"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 16 --model gpt2-small --global-batch 16 --zero 3 --zero-hpz 8 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"zero_hpz\":8"), std::string::npos) << out;
  out = test_util::run(plan3 + "--zero 3 --zero-allgather-bucket 1G", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--zero-allgather-bucket: the calls of ZeRO-1/2's allgather, and this search has no ZeRO-1 or 2 "
                     "plans"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model layers --layers-spec dense:784x256,dense:256x10 --global-batch 8 "
      "--zero 3 --gather-bytes 3",
      &rc);
  EXPECT_NE(out.find("--gather-bytes = 3 (allowed: 1 (int8 blocks with their scales), 2, 4, or leave it out: as held)"),
            std::string::npos)
      << out;

  const std::string infer_cmd = "sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 8 ";
  out = test_util::run(infer_cmd + "--batch 4 --batch-list 1,2", &rc);
  EXPECT_NE(out.find("give --batch or --batch-list, not both"), std::string::npos) << out;
  // An empty list (it ran --batch's default) and a refused configuration (it printed the table's header first): one
  // line each.
  out = test_util::run(infer_cmd + "--batch-list ''", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out,
            "conduit: error: --batch-list = '': an empty list (allowed: a comma-separated list of integers from 1 to "
            "1048576, or leave it out)\n");
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 3 --batch-list 1,2", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out, "conduit: error: --tp (3) x --pp (1) must divide --gpus (8)\n");
  out = test_util::run(infer_cmd + "--batch-list 1,2 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  for (const char* field : {"\"prompt\":", "\"generate\":", "\"gpus\":", "\"replicas\":", "\"max_batch\":",
                            "\"decode_bound\":", "\"kv_cache_gb\":"})
    EXPECT_NE(out.find(field, out.find("\"batch\":2")), std::string::npos) << field << " " << out;
  // --kv-heads: a divisor of --heads; tp and it must divide one another.
  out = test_util::run(infer_cmd + "--kv-heads 3", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("--kv-heads = 3 does not divide --heads = 64 (allowed: --kv-heads a divisor of --heads, such as "
                     "--kv-heads 64"),
            std::string::npos)
      << out;
  out = test_util::run(
      "sim infer --cluster dgx-h100 --gpus 8 --model llama2-70b-like --tp 8 --kv-heads 12 --pp 1 "
      "--heads 48 --hidden 6144",
      &rc);
  EXPECT_NE(out.find("--tp = 8 and --kv-heads = 12: one must divide the other"), std::string::npos) << out;
  // --mlp and --ffn-hidden: named values only; the width split evenly over --tp.
  out = test_util::run(infer_cmd + "--mlp relu", &rc);
  EXPECT_NE(out.find("--mlp = 'relu' (allowed: gelu, swiglu)"), std::string::npos) << out;
  out = test_util::run(infer_cmd + "--ffn-hidden -3", &rc);
  EXPECT_NE(out.find("--ffn-hidden = -3 (allowed: 1 or more; 0 for 4 x --hidden)"), std::string::npos) << out;
  // Any value given is checked: 0 and negative values were taken as left out, and the named model's were used.
  for (const char* flag : {"--kv-heads -5", "--kv-heads 0", "--seq 0", "--hidden 0", "--layers -1", "--vocab 0"}) {
    out = test_util::run(infer_cmd + flag, &rc);
    EXPECT_EQ(rc, 2) << flag << out;
    EXPECT_NE(out.find("(allowed: 1 or more, or left out for the named model's)"), std::string::npos) << flag << out;
  }
  out = test_util::run(infer_cmd + "--ffn-hidden -1", &rc);
  EXPECT_NE(out.find("--ffn-hidden = -1 (allowed"), std::string::npos) << out;
  out = test_util::run(infer_cmd + "--ffn-hidden 28676", &rc);
  EXPECT_NE(out.find("--tp = 8 must divide the MLP's width, 28676 (--ffn-hidden)"), std::string::npos) << out;
  // A plain GPT model given Llama's MLP has Llama's parameters (less GQA's saving).
  out = test_util::run(
      "sim step --cluster dgx-a100 --gpus 8 --model gpt --layers 32 --hidden 4096 --heads 32 --seq 4096 --vocab 32000 "
      "--global-batch 8 --mlp swiglu --ffn-hidden 11008",
      &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("(6.63B params"), std::string::npos) << out;
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

// Found by a review of `sim cluster`: on a cluster of several node kinds every job ran at the slowest kind's pace
// (timed on the whole mixed cluster) and a job that fits only the larger kind's memory was refused; a torus that
// cannot hold --gpus was accepted; restart penalties counted as utilization.
TEST(Inputs, SchedulerPlacesByNodeKindAndChecksTheCluster) {
  const ClusterSpec edge = load_cluster("edge");
  std::string trace = "id,submit_s,gpus,model,iterations\n";
  for (int i = 0; i < 64; ++i) trace += fmt::format("j{},0,1,gpt2-small,100\n", i);
  const ScheduleResult r = simulate_cluster(edge, 64, parse_job_trace(trace, "t"), {});
  std::map<long long, int> by_finish;
  for (const auto& j : r.jobs) by_finish[std::llround(j.finish)]++;
  ASSERT_EQ(by_finish.size(), 2u);  // the AGX nodes' jobs, and the Nanos' (16 and 48 nodes)
  EXPECT_EQ(by_finish.begin()->second, 16);
  EXPECT_GT(static_cast<double>(by_finish.rbegin()->first) / by_finish.begin()->first, 2.0);
  // gpt2-xl needs the AGX's 64 GB: it runs there (it was refused), one job per AGX node at a time.
  trace = "id,submit_s,gpus,model,iterations\n";
  for (int i = 0; i < 20; ++i) trace += fmt::format("x{},0,1,gpt2-xl,10\n", i);
  const ScheduleResult xl = simulate_cluster(edge, 64, parse_job_trace(trace, "t"), {});
  int first_wave = 0;
  for (const auto& j : xl.jobs) first_wave += j.start == 0;
  EXPECT_EQ(first_wave, 16);
  // Every kind too small: the job is refused, naming why.
  EXPECT_NE(error_of([&] {
              simulate_cluster(edge, 64, parse_job_trace("id,submit_s,gpus,model,iterations\na,0,1,gpt3-175b,1\n", "t"),
                               {});
            }).find("t:2: job a: on no node kind"),
            std::string::npos);
  // A file of two kinds where --gpus holds one node, of the second kind: a job is timed on that kind (it was timed on
  // the first kind's 4 GiB and refused).
  ClusterSpec two = load_cluster("dgx-a100");
  two.node_kinds.push_back(two.node_kinds[0]);
  two.node_kinds[0].name = "small";
  two.node_kinds[0].count = 1;
  two.node_kinds[0].accelerator.memory_bytes = 4e9;
  two.node_kinds[1].name = "big";
  two.node_kinds[1].count = 3;
  const ScheduleResult one_kind =
      simulate_cluster(two, 8, parse_job_trace("id,submit_s,gpus,model,iterations\na,0,4,gpt2-xl,10\n", "t"), {});
  EXPECT_TRUE(std::isfinite(one_kind.jobs[0].finish));
  // A torus whose dimensions do not hold --gpus is refused as `sim step` refuses it.
  ClusterSpec torus = load_cluster("dgx-a100");
  torus.network.topology = TopologyKind::kTorus;
  torus.network.torus_dims = {8, 8, 8};
  torus.network.torus_link = {50e9, 1e-6};
  torus.network.in_network_reduction = false;
  EXPECT_NE(error_of([&] {
              simulate_cluster(torus, 64,
                               parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt2-small,1\n", "t"), {});
            }).find("torus_dims"),
            std::string::npos);
  // A preempted job's reload time is reported apart from utilization.
  SchedulerOptions las;
  las.policy = Policy::kLas;
  const ScheduleResult p = simulate_cluster(
      load_cluster("dgx-a100"), 8,
      parse_job_trace("id,submit_s,gpus,model,iterations\na,0,8,gpt2-small,10000000\nb,5000,8,gpt2-small,100\n", "t"),
      las);
  EXPECT_GE(p.jobs[0].preemptions, 1);
  EXPECT_NEAR(p.restart_overhead * 8 * p.makespan, 8 * las.restart_penalty * p.jobs[0].preemptions, 1e-3);
  EXPECT_LT(p.utilization + p.restart_overhead, 1 + 1e-9);
}

// las and srtf skip, for the rest of a scheduling pass, the jobs that place as one that found no room even by
// preempting (an overloaded trace tried each of thousands of waiting jobs at every event): jobs place alike only on
// the same node kinds as well as sizes. Here a one-GPU gpt2-xl job, which fits only the AGX nodes (all busy), finds no
// room; the one-GPU gpt2-small job behind it must still start on a free Orin Nano, at once.
TEST(Inputs, SchedulerSkipsOnlyJobsThatPlaceAsOneThatFailed) {
  const ClusterSpec edge = load_cluster("edge");
  std::string trace = "id,submit_s,gpus,model,iterations\n";
  for (int i = 0; i < 16; ++i) trace += fmt::format("j{},0,1,gpt2-xl,100\n", i);  // (srtf: shorter than x)
  trace += "x,1,1,gpt2-xl,1000\ns,1,1,gpt2-small,100000\n";                       // (srtf: x ranks above s)
  const auto jobs = parse_job_trace(trace, "t");
  for (Policy p : {Policy::kLas, Policy::kSrtf})
    for (Placement where : {Placement::kTopology, Placement::kSpread}) {
      SchedulerOptions o;
      o.policy = p;
      o.placement = where;
      const ScheduleResult r = simulate_cluster(edge, 64, jobs, o);
      double first_done = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < 16; ++i) {
        EXPECT_EQ(r.jobs[i].start, 0) << r.jobs[i].id;
        first_done = std::min(first_done, r.jobs[i].finish);
      }
      ASSERT_GT(first_done, 1);
      EXPECT_EQ(r.jobs[16].start, first_done) << static_cast<int>(p);  // x waits for an AGX node
      EXPECT_EQ(r.jobs[16].preemptions + r.jobs[17].preemptions, 0);
      EXPECT_EQ(r.jobs[17].start, 1) << static_cast<int>(p);  // s starts on an Orin Nano
      EXPECT_EQ(r.jobs[17].queued, 0);
    }
}

// A step's breakdown adds up to its time (the JSON counted compression twice: it is inside the exposed exchange);
// fp16 of 16-bit gradients is the exchange without compression (it charged cast passes for sending the same bytes);
// flags of a data-parallel exchange are refused where there is none (they were taken and ignored); --layers is
// bounded (ZeRO's per-layer calls grew without bound); an inference's largest batch is one --batch can take.
TEST(Inputs, BreakdownsAddUpAndFlagsOfNoEffectAreRefused) {
  Topology topo(load_cluster("ethernet-25g"), 64);
  CollectiveModel net(topo);
  const GptModel m = named_model("gpt2-small");
  auto gpt_sum = [](const StepResult& r) {
    const StepBreakdown& b = r.breakdown;
    return b.compute + b.bubble + b.tp_comm + b.pp_comm + b.embedding_sync + b.dp_exposed + b.zero3_exposed +
           b.optimizer + b.overlap_slowdown;  // (compute holds recompute)
  };
  ParallelConfig c;
  c.global_batch = 64;
  for (const char* sync : {"bsp", "async", "local-sgd:4"})
    for (const char* comp : {"int8", "topk:0.01", "powersgd:4"}) {
      // (local SGD averages the parameters uncompressed, as the trainer: a compressor is refused)
      if (std::string(sync) == "local-sgd:4") continue;
      c.sync = parse_sync(sync);
      c.compression = parse_compression(comp);
      const StepResult r = simulate_step(net, m, c);
      EXPECT_NEAR(gpt_sum(r), r.time, 1e-12 * r.time) << sync << " " << comp;
      EXPECT_LE(r.breakdown.compression, r.breakdown.dp_exposed) << sync << " " << comp;
      if (std::string(sync) != "async") {
        EXPECT_GT(r.breakdown.compression, 0) << sync << " " << comp;
      }
    }
  c.sync = parse_sync("async");  // (a step long enough to hide the whole exchange: nothing of it exposed)
  c.global_batch = 64 * 64;
  c.micro_batch = 64;
  c.compression = parse_compression("powersgd:4");
  const StepResult hidden = simulate_step(net, m, c);
  EXPECT_EQ(hidden.breakdown.dp_exposed, 0);
  EXPECT_EQ(hidden.breakdown.compression, 0);
  // A layer-list pipeline's transfers overlap its stages' work: its pp_comm is inside the bubble.
  const LayerModel lm = parse_layer_model("dense:784x512,dense:512x512,dense:512x10");
  ParallelConfig l;
  l.global_batch = 64 * 8;
  l.micro_batch = 8;
  l.compression = parse_compression("int8");
  l.grad_bytes = 4;
  for (int pp : {1, 2}) {
    l.pp = pp;
    l.schedule = pp > 1 ? Schedule::kGpipe : Schedule::k1F1B;
    const StepResult r = simulate_layer_step(net, lm, l);
    const StepBreakdown& b = r.breakdown;
    EXPECT_NEAR(b.compute + b.bubble + b.dp_exposed + b.zero3_exposed + b.overlap_slowdown + b.optimizer, r.time,
                1e-12 * r.time)
        << pp;
    EXPECT_GT(b.compression, 0) << pp;
    EXPECT_LE(b.compression, b.dp_exposed) << pp;
  }

  // fp16 of 16-bit gradients (the default --grad-bytes 2) sends them as they are: the plan without compression.
  c = ParallelConfig{};
  c.global_batch = 64;
  const StepResult plain = simulate_step(net, m, c);
  c.compression = parse_compression("fp16");
  EXPECT_EQ(simulate_step(net, m, c).time, plain.time);
  c.grad_bytes = 4;  // (f32 gradients are cast: slower than sending 16-bit ones, faster than sending f32)
  const StepResult cast = simulate_step(net, m, c);
  EXPECT_GT(cast.breakdown.compression, 0);
  EXPECT_GT(cast.time, plain.time);
  PlanSpace space;
  space.tp = {1};
  space.pp = {1};
  space.zero = {0};
  space.recompute = {Recompute::kNone};
  space.micro_batch = {1};
  space.compression = {Compression{}, parse_compression("fp16")};
  const PlanResult pr = plan(net, m, 64, space, 10);
  ASSERT_EQ(pr.ranked.size(), 1u);  // (fp16 was listed beside none, slower by its casts)
  EXPECT_EQ(pr.ranked[0].config.compression.kind, "none");
  space.compression = {parse_compression("fp16")};  // (asked for alone: planned, as fast as none)
  const PlanResult fp16_only = plan(net, m, 64, space, 10);
  ASSERT_EQ(fp16_only.ranked.size(), 1u);
  EXPECT_EQ(fp16_only.ranked[0].time, pr.ranked[0].time);

  // dp = 1: ZeRO, compression and a sync scheme have no exchange to act on.
  Topology t8(load_cluster("dgx-a100"), 8);
  CollectiveModel n8(t8);
  ParallelConfig one;
  one.tp = 4;
  one.pp = 2;
  one.global_batch = 8;
  EXPECT_EQ(error_of([&] { simulate_step(n8, m, one); }), "no error");
  auto refused = [&](const std::function<void(ParallelConfig&)>& set) {
    ParallelConfig x = one;
    set(x);
    return error_of([&] { simulate_step(n8, m, x); });
  };
  EXPECT_EQ(refused([](ParallelConfig& x) { x.zero = 3; }),
            "--zero 3 shards over the data-parallel ranks, and dp = 1 here; allowed with dp = 1: --zero 0");
  EXPECT_EQ(refused([](ParallelConfig& x) { x.compression = parse_compression("topk:0.01"); }),
            "--compression topk compresses the data-parallel exchange, which dp = 1 does not have; allowed with dp "
            "= 1: none");
  EXPECT_EQ(refused([](ParallelConfig& x) { x.sync = parse_sync("local-sgd:8"); }),
            "--sync local-sgd schedules the data-parallel exchange, which dp = 1 does not have; allowed with dp = 1: "
            "bsp");
  EXPECT_EQ(refused([](ParallelConfig& x) { x.dp_overlap = false; }),
            "--no-overlap: about the data-parallel exchange, which dp = 1 does not have; allowed with dp = 1: leave it "
            "out");
  EXPECT_EQ(
      refused([](ParallelConfig& x) { x.dp_algorithm = Algorithm::kRing; }),
      "--dp-algorithm ring: the data-parallel exchange's algorithm, which dp = 1 does not have; allowed with dp = "
      "1: leave it out");
  EXPECT_EQ(refused([](ParallelConfig& x) { x.tp = 1, x.pp = 4, x.tp_algorithm = Algorithm::kRing; }),
            "--tp-algorithm ring: the tensor-parallel collectives' algorithm, which --tp 1 does not have; allowed with "
            "--tp 1: leave it out");
  // An algorithm the step's collectives cannot run on: the flag named (it said "algorithm direct does not implement
  // allreduce", naming neither).
  EXPECT_EQ(refused([](ParallelConfig& x) { x.sequence_parallel = true, x.tp_algorithm = Algorithm::kBinomialTree; }),
            "--tp-algorithm: algorithm binomial-tree does not implement allgather; allowed: auto, or an algorithm that "
            "implements it (`conduit sim coll --op OP --algorithm all` lists them)");
  {
    Topology t16(load_cluster("dgx-a100"), 16);
    CollectiveModel n16(t16);
    ParallelConfig x = one;
    x.global_batch = 16;
    x.dp_algorithm = Algorithm::kDirect;
    EXPECT_EQ(error_of([&] { simulate_step(n16, m, x); }).substr(0, 60),
              "--dp-algorithm: algorithm direct does not implement allreduc");
    x.dp_algorithm = Algorithm::kAuto;
    x.sync = parse_sync("async");
    x.dp_overlap = false;  // (async runs the exchange behind the next step: --no-overlap changed nothing)
    EXPECT_EQ(error_of([&] { simulate_step(n16, m, x); }),
              "--no-overlap with --sync async: asynchronous training runs the exchange behind the next step's "
              "compute, which --no-overlap forbids; allowed: one of them");
  }
  {
    int rc = 0;
    const std::string out = test_util::run(
        "sim step --cluster dgx-a100 --model gpt-1.7b --gpus 8 --global-batch 8 --tp 8 --bucket 4M", &rc);
    EXPECT_EQ(rc, 2);
    EXPECT_NE(out.find("--bucket 4M: sizes the data-parallel exchange's calls, which dp = 1 does not have"),
              std::string::npos)
        << out;
  }
  Topology t1(flat_cluster(5e-6, 10e9, 1e-11), 1);
  CollectiveModel n1(t1);
  ParallelConfig lone;
  lone.global_batch = 8;
  EXPECT_EQ(error_of([&] { simulate_layer_step(n1, lm, lone); }), "no error");
  lone.compression = parse_compression("int8");
  EXPECT_NE(error_of([&] { simulate_layer_step(n1, lm, lone); }).find("which dp = 1 does not have"), std::string::npos);

  // The planner and a scaling curve keep their dp = 1 points: without an exchange to schedule or shard (sim plan
  // --sync local-sgd dropped every dp = 1 plan; sim scale --fixed --zero 1 lost its baseline size).
  PlanSpace lone_space;
  lone_space.tp = {8};
  lone_space.pp = {1};
  lone_space.zero = {0};
  lone_space.recompute = {Recompute::kNone};
  lone_space.base.sync = parse_sync("local-sgd:4");
  lone_space.base.dp_overlap = false;  // (and the exchange's other flags)
  lone_space.base.dp_algorithm = Algorithm::kRing;
  Topology t8b(load_cluster("dgx-a100"), 8);
  CollectiveModel n8b(t8b);
  GptModel heads8 = m;
  heads8.heads = 16;
  heads8.hidden = 1024;
  const PlanResult lone_plan = plan(n8b, heads8, 8, lone_space, 5);
  ASSERT_FALSE(lone_plan.ranked.empty()) << lone_plan.first_error;
  EXPECT_EQ(lone_plan.ranked[0].config.sync.kind, "bsp");
  bool noted = false;
  for (const auto& note : lone_plan.ranked[0].notes)
    noted = noted || note == "dp = 1: no data-parallel exchange, so --sync local-sgd does not apply";
  EXPECT_TRUE(noted);
  int rc = 0;
  const std::string scale = test_util::run(
      "sim scale --cluster dgx-a100 --model gpt-1.7b --global-batch 64 --gpus-list 8,16 --fixed --tp 8 --zero 1", &rc);
  EXPECT_EQ(rc, 0) << scale;
  EXPECT_NE(scale.find("100.0%  dp=1 tp=8 pp=1 b=1 zero=0"), std::string::npos) << scale;  // (the baseline)
  EXPECT_NE(scale.find("dp=2 tp=8 pp=1 b=1 zero=1"), std::string::npos) << scale;

  // --layers: a million at most.
  GptModel deep = m;
  deep.layers = 1000000;
  EXPECT_EQ(error_of([&] { deep.validate(); }), "no error");
  deep.layers = 1000001;
  EXPECT_EQ(error_of([&] { deep.validate(); }), "--layers = 1000001 (allowed: 1 to 1000000)");

  // The largest batch that fits, at most what --batch takes (2^20: up to INT_MAX was printed, which --batch refused),
  // and said to be capped; the text says "or more".
  GptModel tiny = m;
  tiny.layers = 1;
  tiny.hidden = 1;
  tiny.heads = 1;
  tiny.seq = 2;
  tiny.vocab = 1;
  InferenceConfig ic;
  ic.prompt = 1;
  ic.generate = 1;
  const InferenceResult capped = simulate_inference(n8, tiny, ic);
  EXPECT_EQ(capped.max_batch, 1048576);
  EXPECT_TRUE(capped.max_batch_capped);
  EXPECT_FALSE(simulate_inference(n8, m, ic).max_batch_capped);
  const std::string tiny_out = test_util::run(
      "sim infer --cluster dgx-h100 --gpus 8 --model gpt --layers 1 --hidden 8 --heads 1 --seq 2 --vocab 8", &rc);
  EXPECT_EQ(rc, 0) << tiny_out;
  EXPECT_NE(tiny_out.find("largest batch that fits         1048576 or more (--batch's limit)"), std::string::npos)
      << tiny_out;
}

// An audit's plan and infer findings (2026-12-06): --sp=false forced sequence parallelism on every plan; an empty
// option list searched everything; the list's range was not said; --recompute-options' errors named --recompute;
// --balance on one kind appended the generic advice; --attention is checked.
TEST(Inputs, PlanListsAndFlagsSayWhatTheyMean) {
  int rc = 0;
  const std::string plan = "sim plan --cluster dgx-a100 --gpus 64 --model gpt2-small --global-batch 512 --top 5 ";
  std::string out = test_util::run(plan + "--sp=false", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("dp=64 tp=1"), std::string::npos) << out;
  EXPECT_EQ(out.find(" sp\n"), std::string::npos) << out;
  out = test_util::run(plan + "--sp", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find(" sp\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("tp=1 "), std::string::npos) << out;
  for (const char* f :
       {"--tp-options", "--pp-options", "--micro-batch-options", "--zero-options", "--recompute-options"}) {
    out = test_util::run(plan + f + " ''", &rc);
    EXPECT_EQ(rc, 2) << f << ": " << out;
    EXPECT_NE(out.find(std::string(f) + " = '': an empty list (allowed: a comma-separated list of"), std::string::npos)
        << out;
  }
  out = test_util::run(plan + "--micro-batch-options 2000000", &rc);
  EXPECT_EQ(out,
            "conduit: error: --micro-batch-options = '2000000' (allowed: a comma-separated list of integers from 1 to "
            "1048576)\n");
  out = test_util::run(plan + "--recompute-options none,foo", &rc);
  EXPECT_EQ(out,
            "conduit: error: --recompute-options = 'none,foo' (allowed: a comma-separated list of none, selective, "
            "full)\n");
  // Selective recompute listed with FlashAttention: refused (every selective candidate was skipped: the list came
  // back without it, exit 0); fixed, the refusal names what is allowed (it was told to change --gpus).
  out = test_util::run(plan + "--attention-kernels flash --recompute-options selective,full", &rc);
  EXPECT_EQ(out,
            "conduit: error: --recompute-options = 'selective,full' lists selective, which recomputes the attention "
            "scores --attention-kernels flash never stores; allowed with flash: none, full\n");
  out = test_util::run(plan + "--attention-kernels flash2 --recompute selective", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("flash2 stores no scores; allowed: --recompute none or full"), std::string::npos) << out;
  EXPECT_EQ(out.find("--gpus, --global-batch"), std::string::npos) << out;
  out = test_util::run(plan + "--balance", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("this cluster has one kind; allowed: a cluster with several node kinds, or leave --balance out"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("--gpus, --global-batch"), std::string::npos) << out;
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model gpt2-small --attention flash4", &rc);
  EXPECT_EQ(out,
            "conduit: error: --attention = 'flash4' (allowed: fused or flash, FlashAttention's at the GEMM rate; "
            "flash2 or flash3, at the cluster file's attention_calibration rate; unfused)\n");
  // FlashAttention-2 needs its rates: the dgx-h100 preset has none (refused, naming them), dgx-a100's its paper's.
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model gpt2-small --attention flash2", &rc);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("the accelerator H100-SXM5-80GB has no flash2 rate"), std::string::npos) << out;
  // (naming the choices sim infer takes: it named sim step's, eager among them, which --attention refuses)
  EXPECT_NE(out.find("allowed: --attention flash or fused (FlashAttention at the GEMM rate), unfused, or a cluster "
                     "file with flash2 samples"),
            std::string::npos)
      << out;
  // (flash: FlashAttention, as sim step's --attention-kernels names it; the same prediction as fused)
  const std::string fused_out =
      test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model gpt2-small --attention fused --json", &rc);
  const std::string flash_out =
      test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model gpt2-small --attention flash --json", &rc);
  EXPECT_EQ(rc, 0) << flash_out;
  EXPECT_EQ(nlohmann::json::parse(flash_out)["tokens_per_s"], nlohmann::json::parse(fused_out)["tokens_per_s"])
      << flash_out;
  out = test_util::run("sim infer --cluster dgx-h100 --gpus 8 --model gpt2-small --tp 1 --pp 2 --json", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"batches_in_flight\":2"), std::string::npos) << out;
  EXPECT_NE(out.find("\"attention\":\"fused\""), std::string::npos) << out;
}

}  // namespace
}  // namespace conduit::sim
