// Calibration recovers the alpha, beta and gamma that generated a set of collective timings, and the cluster
// file it writes predicts those timings.
#include "sim/calibrate.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "sim/collective.h"

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

}  // namespace
}  // namespace conduit::sim
