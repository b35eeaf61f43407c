// Calibration recovers the alpha, beta and gamma that generated a set of collective timings, and the cluster
// file it writes predicts those timings.
#include "sim/calibrate.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "sim/collective.h"
#include "sim/compute.h"
#include "sim/step.h"
#include "sim/topology.h"
#include "sim/workload.h"

namespace conduit::sim {
namespace {

TEST(Calibrate, RecoversAlphaBetaGammaFromSyntheticBenchLines) {
  const double alpha = 25e-6, beta = 1 / 2e9, gamma = 1 / 6e9;
  Topology truth(flat_cluster(alpha, 1 / beta, gamma), 4);
  CollectiveModel m(truth);
  std::string lines;
  for (double n = 1024; n <= 64e6; n *= 4) {
    for (auto [op, c, algo, a] :
         {std::tuple{"allreduce", Collective::kAllReduce, "ring", Algorithm::kRing},
          std::tuple{"allreduce", Collective::kAllReduce, "halving_doubling", Algorithm::kHalvingDoubling},
          std::tuple{"allgather", Collective::kAllGather, "ring", Algorithm::kRing},
          std::tuple{"broadcast", Collective::kBroadcast, "binomial", Algorithm::kBinomialTree}}) {
      double t = m.time(c, a, Group{4, 1, 0}, n);
      lines += fmt::format(
          "{{\"impl\":\"conduit\",\"op\":\"{}\",\"algo\":\"{}\",\"transport\":\"shm\",\"world\":4,"
          "\"bytes\":{},\"time_us\":{}}}\n",
          op, algo, n, t * 1e6);
    }
  }
  lines += "# a comment line\n{\"op\":\"alltoall\",\"algo\":\"pairwise\",\"world\":4,\"bytes\":1024,\"time_us\":50}\n";
  int skipped = 0;
  auto samples = parse_bench_lines(lines, "bench.jsonl", &skipped);
  int unmodelled = 0;
  AlphaBetaGamma f = fit_alpha_beta_gamma(samples, &unmodelled);
  EXPECT_EQ(unmodelled, 1);  // the all-to-all line
  EXPECT_NEAR(f.alpha / alpha, 1, 1e-6);
  EXPECT_NEAR(f.beta / beta, 1, 1e-6);
  EXPECT_NEAR(f.gamma / gamma, 1, 1e-6);
  EXPECT_LT(f.rms_relative_error, 1e-6);
  // The written cluster predicts the measured ring allreduce.
  std::string yaml = calibrated_cluster_yaml("here", 4, f, 10e9, 8e9, 50e9, {}, "shm");
  ClusterSpec c = parse_cluster_yaml(yaml, "calibrated");
  Topology here(c, 4);
  CollectiveModel mh(here);
  double n = 16e6;
  EXPECT_NEAR(mh.time(Collective::kAllReduce, Algorithm::kRing, Group{4, 1, 0}, n) /
                  m.time(Collective::kAllReduce, Algorithm::kRing, Group{4, 1, 0}, n),
              1, 1e-4);
  EXPECT_THROW(parse_bench_lines("nothing here\n", "x"), ConfigError);
}

// `conduit bench gemm --json` lines (a model_step line among them) are read into the cluster file's calibration
// table, scaled by each rank's share of a core, and the simulator then predicts those GEMMs as measured.
TEST(Calibrate, GemmLinesLandInTheCalibrationTable) {
  const std::string lines =
      "{\"kind\":\"bench.gemm\",\"label\":\"cnn conv2 fwd\",\"m\":12544,\"n\":64,\"k\":288,\"gflops\":40,"
      "\"time_us\":11561,\"calls\":20,\"threads\":1,\"dtype\":\"f32\"}\n"
      "{\"kind\":\"bench.model_step\",\"model\":\"cnn\",\"forward_s\":0.02,\"backward_s\":0.04}\n"
      "{\"m\":64,\"n\":128,\"k\":3136,\"gflops\":25.5}\n";
  auto gemms = parse_gemm_lines(lines, "gemm.jsonl");
  ASSERT_EQ(gemms.size(), 2u);
  EXPECT_EQ(gemms[0].m, 12544);
  EXPECT_EQ(gemms[0].k, 288);
  EXPECT_DOUBLE_EQ(gemms[1].flops, 25.5e9);
  AlphaBetaGamma f;
  f.alpha = 20e-6;
  f.beta = 1 / 2e9;
  f.samples = 10;
  ClusterSpec c = parse_cluster_yaml(calibrated_cluster_yaml("here", 4, f, 10e9, 8e9, 40e9, gemms, "shm", 0.5), "here");
  const Accelerator& acc = c.node_kinds.at(0).accelerator;
  ASSERT_EQ(acc.calibration.size(), 2u);
  EXPECT_EQ(acc.calibration[0].n, 64);
  EXPECT_NEAR(acc.calibration[0].flops, 20e9, 1e3);  // half a core each
  EXPECT_NEAR(acc.calibration[1].flops, 12.75e9, 1e3);
  EXPECT_NEAR(acc.peak_flops, 20e9, 1e3);
  EXPECT_NEAR(acc.memory_bandwidth, 5e9, 1e3);
  GemmShape g{12544, 64, 288, 1};
  EXPECT_NEAR(gemm_time(acc, g) - acc.kernel_overhead, g.flops() / 20e9, 1e-9);
  // The default shapes hold every GEMM of the CNN's step at batch 64 (conv2 forward: M = 64 x 14 x 14).
  auto shapes = calibration_gemm_shapes(64);
  bool conv2 = false;
  for (const auto& s : shapes) conv2 |= s.m == 12544 && s.n == 64 && s.k == 288;
  EXPECT_TRUE(conv2);
  EXPECT_EQ(layer_step_gemms(parse_layer_model(kTrainCnnLayers), 64).size(), 12u);
}

std::string error_of(const std::string& text) {
  try {
    parse_gemm_lines(text, "gemm.jsonl");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Calibrate, BadGemmLinesFailNamingTheField) {
  EXPECT_NE(error_of("{\"m\":64,\"n\":64,\"k\":64}\n").find("gemm.jsonl:1: field 'gflops' is missing"),
            std::string::npos)
      << error_of("{\"m\":64,\"n\":64,\"k\":64}\n");
  std::string e =
      error_of("# shapes\n{\"m\":64,\"n\":64,\"k\":64,\"gflops\":1}\n{\"m\":-3,\"n\":1,\"k\":1,\"gflops\":1}\n");
  EXPECT_NE(e.find("gemm.jsonl:3: field 'm' must be a positive number"), std::string::npos) << e;
  e = error_of("{\"m\":\"big\",\"n\":1,\"k\":1,\"gflops\":1}\n");
  EXPECT_NE(e.find("field 'm'"), std::string::npos) << e;
  e = error_of("{\"m\":1,\"n\":1,\"k\":1,\"gflops\":1\n");
  EXPECT_NE(e.find("gemm.jsonl:1: not a JSON record"), std::string::npos) << e;
  e = error_of("nothing\n");
  EXPECT_NE(e.find("no GEMM records"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);  // one line
}

// `conduit bench gemm --json` convolution records (bench.conv) land in the cluster file's conv_calibration table,
// their times divided by each rank's share of a core; the compute model then costs a measured convolution layer at
// its measured time per pass, a larger one by the implicit-GEMM model's ratio, and falls back to the implicit GEMM
// without the table.
TEST(Calibrate, ConvLinesLandInTheConvCalibrationTableAndCostConvLayers) {
  const std::string lines =
      "{\"kind\":\"bench.gemm\",\"label\":\"cnn conv2 fwd\",\"m\":12544,\"n\":64,\"k\":288,\"gflops\":40}\n"
      "{\"kind\":\"bench.conv\",\"label\":\"cnn conv2\",\"batch\":64,\"in\":32,\"out\":64,\"height\":14,\"width\":14,"
      "\"kernel\":3,\"stride\":1,\"padding\":1,\"forward_us\":4000,\"input_grad_us\":5000,\"weight_grad_us\":6000,"
      "\"forward_gflops\":115.6,\"calls\":20,\"threads\":1,\"dtype\":\"f32\"}\n"
      "{\"kind\":\"bench.conv\",\"batch\":8,\"in\":3,\"out\":16,\"height\":32,\"width\":32,\"kernel\":5,"
      "\"forward_us\":100,\"input_grad_us\":200,\"weight_grad_us\":300}\n";
  auto gemms = parse_gemm_lines(lines, "gemm.jsonl");
  auto convs = parse_conv_lines(lines, "gemm.jsonl");
  ASSERT_EQ(gemms.size(), 1u);
  ASSERT_EQ(convs.size(), 2u);
  EXPECT_EQ(convs[0].in, 32);
  EXPECT_EQ(convs[0].out_height(), 14);
  EXPECT_DOUBLE_EQ(convs[0].weight_grad_s, 6e-3);
  EXPECT_EQ(convs[1].stride, 1);  // defaults
  EXPECT_EQ(convs[1].padding, 0);
  EXPECT_EQ(convs[1].out_height(), 28);
  EXPECT_TRUE(parse_conv_lines("{\"m\":1,\"n\":1,\"k\":1,\"gflops\":1}\n", "g").empty());  // none: not an error
  AlphaBetaGamma f;
  f.alpha = 20e-6;
  f.beta = 1 / 2e9;
  f.samples = 10;
  const std::string yaml = calibrated_cluster_yaml("here", 4, f, 10e9, 8e9, 40e9, gemms, "shm", 0.5, convs);
  ClusterSpec c = parse_cluster_yaml(yaml, "here");
  const Accelerator& acc = c.node_kinds.at(0).accelerator;
  ASSERT_EQ(acc.conv_calibration.size(), 2u);
  EXPECT_NEAR(acc.conv_calibration[0].forward_s, 8e-3, 1e-12);  // half a core each: twice the time
  EXPECT_NEAR(acc.conv_calibration[0].input_grad_s, 10e-3, 1e-12);
  EXPECT_NEAR(acc.conv_calibration[1].weight_grad_s, 600e-6, 1e-12);
  EXPECT_EQ(acc.conv_calibration[1].kernel, 5);
  // The CNN's conv2 as a layer: measured time per pass.
  const LayerModel cnn = parse_layer_model(kTrainCnnLayers);
  const ConvShape conv2 = cnn.layers[2].conv_shape(64);
  EXPECT_NEAR(conv_time(acc, conv2, ConvPass::kForward) - acc.kernel_overhead, 8e-3, 1e-12);
  EXPECT_NEAR(conv_time(acc, conv2, ConvPass::kInputGrad) - acc.kernel_overhead, 10e-3, 1e-12);
  EXPECT_NEAR(conv_time(acc, conv2, ConvPass::kWeightGrad) - acc.kernel_overhead, 12e-3, 1e-12);
  // Twice the batch (nearest: conv2; compute-bound on one "SM"): twice the time.
  const ConvShape conv2x2 = cnn.layers[2].conv_shape(128);
  EXPECT_EQ(nearest_conv_sample(acc, conv2x2), &acc.conv_calibration[0]);
  EXPECT_NEAR((conv_time(acc, conv2x2, ConvPass::kWeightGrad) - acc.kernel_overhead) / 12e-3, 2, 1e-9);
  // Without the table: the implicit GEMM (12544 x 64 x 288 forward, at the measured 40 GFLOP/s x 0.5).
  Accelerator plain = acc;
  plain.conv_calibration.clear();
  EXPECT_EQ(nearest_conv_sample(plain, conv2), nullptr);
  EXPECT_DOUBLE_EQ(conv_time(plain, conv2, ConvPass::kForward), gemm_time(plain, {12544, 64, 288, 1}));
  EXPECT_NEAR(conv_time(plain, conv2, ConvPass::kForward) - plain.kernel_overhead, conv2.flops() / 20e9, 1e-9);
  // A data-parallel step of the CNN (4 workers, one micro-batch each): its convolution layers are costed by conv_time
  // (conv1 scaled from the nearest measured convolution, the 5x5 one), its dense layers as before; the first layer
  // computes no input gradient.
  ClusterSpec with = c, without = c;
  without.node_kinds[0].accelerator.conv_calibration.clear();
  Topology tw(with, 4), to(without, 4);
  CollectiveModel nw(tw), no(to);
  ParallelConfig pc;
  pc.micro_batch = 64;
  pc.global_batch = 4 * 64;
  pc.grad_bytes = 4;
  StepResult rw = simulate_layer_step(nw, cnn, pc), ro = simulate_layer_step(no, cnn, pc);
  double conv_with = 0, conv_without = 0;
  for (size_t i : {0, 2}) {  // conv1, pool1, conv2, ...
    ASSERT_EQ(cnn.layers[i].kind, "conv");
    const ConvShape cs = cnn.layers[i].conv_shape(64);
    for (ConvPass p : {ConvPass::kForward, ConvPass::kInputGrad, ConvPass::kWeightGrad}) {
      if (i == 0 && p == ConvPass::kInputGrad) continue;  // the data needs no gradient
      conv_with += conv_time(acc, cs, p);
      conv_without += conv_time(plain, cs, p);
    }
  }
  EXPECT_NEAR(ro.breakdown.compute - rw.breakdown.compute, conv_without - conv_with, 1e-12);
  EXPECT_GT(conv_without, conv_with);  // 20 GFLOP/s GEMMs vs conv2 at ~29-58 GFLOP/s per half core
}

std::string conv_error_of(const std::string& text) {
  try {
    parse_conv_lines(text, "gemm.jsonl");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Calibrate, BadConvLinesFailNamingFileLineAndField) {
  const std::string ok =
      "\"batch\":64,\"in\":32,\"out\":64,\"height\":14,\"width\":14,\"kernel\":3,\"stride\":1,\"padding\":1,"
      "\"forward_us\":4000,\"input_grad_us\":5000";
  std::string e = conv_error_of("# convs\n{\"kind\":\"bench.conv\"," + ok + "}\n");
  EXPECT_NE(e.find("gemm.jsonl:2: field 'weight_grad_us' is missing"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);  // one line
  e = conv_error_of("{\"kind\":\"bench.conv\"," + ok + ",\"weight_grad_us\":0}\n");
  EXPECT_NE(e.find("gemm.jsonl:1: field 'weight_grad_us' must be a positive number"), std::string::npos) << e;
  e = conv_error_of("{\"kind\":\"bench.gemm\",\"m\":1}\n{\"kind\":\"bench.conv\",\"batch\":\"64\"}\n");
  EXPECT_NE(e.find("gemm.jsonl:2: field 'batch' must be a positive number"), std::string::npos) << e;
  const std::string full = ok + ",\"weight_grad_us\":6000";
  auto with = [&](const std::string& key, const std::string& value) {
    std::string t = "{\"kind\":\"bench.conv\"," + full + "}\n";
    const auto at = t.find("\"" + key + "\":");
    const auto end = t.find_first_of(",}", at);
    return t.substr(0, at) + "\"" + key + "\":" + value + t.substr(end);
  };
  EXPECT_EQ(conv_error_of(with("in", "32")), "(no error)");
  e = conv_error_of(with("stride", "0"));
  EXPECT_NE(e.find("gemm.jsonl:1: field 'stride' must be a number >= 1"), std::string::npos) << e;
  e = conv_error_of(with("padding", "-1"));
  EXPECT_NE(e.find("gemm.jsonl:1: field 'padding' must be a number >= 0"), std::string::npos) << e;
  e = conv_error_of(with("kernel", "31"));
  EXPECT_NE(e.find("gemm.jsonl:1: field 'kernel' (31) does not fit the input 14x14 padded by 1"), std::string::npos)
      << e;
  e = conv_error_of(with("out", "-64"));
  EXPECT_NE(e.find("gemm.jsonl:1: field 'out' must be a positive number"), std::string::npos) << e;
  e = conv_error_of("{\"kind\":\"bench.conv\"," + full + "\n");
  EXPECT_NE(e.find("gemm.jsonl:1: not a JSON record"), std::string::npos) << e;
  // A cluster file's conv_calibration entry names its field.
  AlphaBetaGamma f;
  f.alpha = 20e-6;
  f.beta = 1 / 2e9;
  f.samples = 10;
  ConvSample cs;
  cs.batch = 64;
  cs.in = 32;
  cs.out = 64;
  cs.height = cs.width = 14;
  cs.kernel = 3;
  cs.padding = 1;
  cs.forward_s = cs.input_grad_s = cs.weight_grad_s = 1e-3;
  std::string yaml = calibrated_cluster_yaml("here", 2, f, 10e9, 8e9, 40e9, {}, "shm", 1.0, {cs});
  EXPECT_NO_THROW(parse_cluster_yaml(yaml, "here.yaml"));
  const auto at = yaml.find("input_grad: ");
  std::string bad = yaml.substr(0, at) + yaml.substr(yaml.find(", ", at) + 2);
  try {
    parse_cluster_yaml(bad, "here.yaml");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("conv_calibration[0].input_grad is missing"), std::string::npos) << e.what();
  }
}

// Max pooling: bench.pool records land in the pool_calibration table (times / share) and cost the CNN's pooling
// layers by their element count; without the table pooling is memory-bound; bad records name file, line and field.
TEST(Calibrate, PoolLinesCostPoolingLayers) {
  const std::string lines =
      "{\"kind\":\"bench.gemm\",\"m\":64,\"n\":64,\"k\":64,\"gflops\":10}\n"
      "{\"kind\":\"bench.pool\",\"label\":\"cnn pool1\",\"batch\":64,\"channels\":32,\"height\":28,\"width\":28,"
      "\"kernel\":2,\"forward_us\":9000,\"backward_us\":5000,\"calls\":20}\n";
  auto pools = parse_pool_lines(lines, "gemm.jsonl");
  ASSERT_EQ(pools.size(), 1u);
  EXPECT_EQ(pools[0].channels, 32);
  EXPECT_DOUBLE_EQ(pools[0].backward_s, 5e-3);
  EXPECT_TRUE(parse_pool_lines("{\"m\":1}\n", "g").empty());
  AlphaBetaGamma f;
  f.alpha = 20e-6;
  f.beta = 1 / 2e9;
  f.samples = 10;
  ClusterSpec c = parse_cluster_yaml(
      calibrated_cluster_yaml("here", 4, f, 10e9, 8e9, 40e9, parse_gemm_lines(lines, "g"), "shm", 0.5, {}, pools),
      "here");
  const Accelerator& acc = c.node_kinds.at(0).accelerator;
  ASSERT_EQ(acc.pool_calibration.size(), 1u);
  EXPECT_NEAR(acc.pool_calibration[0].forward_s, 18e-3, 1e-12);
  const LayerModel cnn = parse_layer_model(kTrainCnnLayers);
  ASSERT_EQ(cnn.layers[1].kind, "pool");
  EXPECT_EQ(cnn.layers[1].params(), 0);
  EXPECT_EQ(layer_step_gemms(cnn, 64).size(), 12u);  // pooling has no GEMMs
  const PoolShape p1 = cnn.layers[1].pool_shape(64), p2 = cnn.layers[3].pool_shape(64);
  EXPECT_NEAR(pool_time(acc, p1, false, 4) - acc.kernel_overhead, 18e-3, 1e-12);
  EXPECT_NEAR(pool_time(acc, p1, true, 4) - acc.kernel_overhead, 10e-3, 1e-12);
  EXPECT_NEAR(pool_time(acc, p2, false, 4) - acc.kernel_overhead, 9e-3, 1e-12);  // half the elements
  Accelerator plain = acc;
  plain.pool_calibration.clear();
  EXPECT_NEAR(pool_time(plain, p1, false, 4), memory_time(plain, 4 * p1.elements() * 1.25), 1e-15);
  // The step: the two poolings' measured time is in the compute.
  ClusterSpec without = c;
  without.node_kinds[0].accelerator.pool_calibration.clear();
  Topology tw(c, 4), to(without, 4);
  CollectiveModel nw(tw), no(to);
  ParallelConfig pc;
  pc.micro_batch = 64;
  pc.global_batch = 4 * 64;
  pc.grad_bytes = 4;
  double with_p = 0, without_p = 0;
  for (const PoolShape& p : {p1, p2})
    for (bool bw : {false, true}) {
      with_p += pool_time(acc, p, bw, 4);
      without_p += pool_time(plain, p, bw, 4);
    }
  EXPECT_NEAR(simulate_layer_step(nw, cnn, pc).breakdown.compute - simulate_layer_step(no, cnn, pc).breakdown.compute,
              with_p - without_p, 1e-12);
  // Bad records and layers.
  auto err = [](const std::string& text) {
    try {
      parse_pool_lines(text, "gemm.jsonl");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  std::string e =
      err("# pools\n{\"kind\":\"bench.pool\",\"batch\":64,\"channels\":32,\"height\":28,\"width\":28,"
          "\"kernel\":2,\"forward_us\":9000}\n");
  EXPECT_NE(e.find("gemm.jsonl:2: field 'backward_us' is missing"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);
  e =
      err("{\"kind\":\"bench.pool\",\"batch\":64,\"channels\":0,\"height\":28,\"width\":28,\"kernel\":2,"
          "\"forward_us\":1,\"backward_us\":1}\n");
  EXPECT_NE(e.find("gemm.jsonl:1: field 'channels' must be a positive number"), std::string::npos) << e;
  e =
      err("{\"kind\":\"bench.pool\",\"batch\":64,\"channels\":3,\"height\":2,\"width\":28,\"kernel\":4,"
          "\"forward_us\":1,\"backward_us\":1}\n");
  EXPECT_NE(e.find("gemm.jsonl:1: field 'kernel' (4) is larger than the map 2x28"), std::string::npos) << e;
  EXPECT_THROW(parse_layer_model("pool:32k2"), ConfigError);
  EXPECT_THROW(parse_layer_model("pool:32k30@28x28"), ConfigError);
}

}  // namespace
}  // namespace conduit::sim
