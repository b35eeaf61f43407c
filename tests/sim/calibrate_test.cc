// Calibration recovers the alpha, beta and gamma that generated a set of collective timings, and the cluster
// file it writes predicts those timings.
#include "sim/calibrate.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "sim/collective.h"
#include "sim/compute.h"
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

}  // namespace
}  // namespace conduit::sim
