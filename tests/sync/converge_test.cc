// Every scheme trains the heterogeneous quadratic of harness.h to near its optimum; each step "computes" 0.2 ms on
// every rank (with a straggler and a fixed step count, asynchronous schemes end unevenly: the last rank to finish
// pulls the model toward its own target, which is not what this test measures). Tolerances cover each scheme's
// bias at a constant lr: client drift of local steps, consensus distance of gossip, staleness. The replicas' spread
// after the last step (before finish()'s final average) is bounded too: with no exchange at all they end ~1.99 apart
// (each at its own target), and the average alone came within the tolerance for adpsgd and easgd even so.
#include <gtest/gtest.h>

#include "core/error.h"
#include "harness.h"

using namespace conduit;
using namespace conduit::sync;

namespace {

struct Case {
  std::string name;
  Params params;
  int ranks;   // including dedicated servers
  double tol;  // on the average worker model, max over coordinates
  double spread;  // the workers' largest gap in a coordinate after the last step (seen: about half of it)
  int paced = 0;  // asynchronous schemes: their workers step in lockstep (harness::Pacer)
};

TEST(SyncConverge, EverySchemeReachesTheOptimum) {
  std::vector<Case> cases = {
      // (the synchronous averages end on an averaging step: the replicas are one)
      {"bsp", {}, 4, 0.01, 1e-6},
      {"local", {{"period", "4"}}, 4, 0.1, 1e-6},
      {"local", {{"period", "2"}, {"warmup", "10"}, {"adaptive", "1"}}, 4, 0.05, 1e-6},
      {"diloco", {{"period", "4"}, {"outer_lr", "0.7"}, {"momentum", "0.5"}}, 4, 0.1, 1e-6},
      // (the elastic force lets the replicas keep their distance: 0.97)
      {"easgd", {{"period", "2"}}, 4, 0.2, 1.4},
      {"dpsgd", {{"graph", "ring"}}, 4, 0.05, 0.4},
      {"dpsgd", {{"graph", "torus"}}, 6, 0.05, 0.6},
      {"dpsgd", {{"graph", "exponential"}}, 5, 0.05, 0.1},
      {"dpsgd", {{"compressor", "topk:ratio=0.3"}}, 4, 0.1, 1.0},
      {"sgp", {}, 5, 0.05, 0.6},
      // Asynchronous schemes with their workers in lockstep (free-running, under load one worker ran its last steps
      // alone and the average missed by 0.7; paced: at most 0.083 and 0.041 in 40 runs beside a CPU hog).
      {"adpsgd", {}, 4, 0.2, 1.1, 4},
      {"ps-bsp", {{"servers", "2"}}, 6, 0.05, 1e-6},
      // Stale gradients with the servers' default momentum 0.9 diverge at this lr (asynchrony acts as extra momentum).
      {"ps-ssp", {{"servers", "2"}, {"colocate", "1"}, {"staleness", "2"}, {"momentum", "0"}}, 4, 0.2, 0.4},
      {"ps-asp", {{"push_compressor", "int8"}, {"momentum", "0"}}, 5, 0.1, 0.4, 4},
  };
  for (const auto& c : cases) {
    std::vector<std::vector<float>> x(c.ranks), last(c.ranks);
    int workers = 0;
    harness::Pacer pace(c.paced);
    harness::on_ranks(c.ranks, [&](int r, coll::CommPtr comm) {
      Strategy* s = nullptr;
      x[r] = harness::train(
          r, comm, c.name, c.params, 80, 20, 0.1f, 0.2, &s,
          [&](Strategy& st) {
            if (r == 0) workers = st.num_workers();
          },
          c.paced ? &pace : nullptr, nullptr, &last[r]);
    });
    ASSERT_GT(workers, 0);
    double worst = 0;
    for (size_t i = 0; i < 20; ++i) {
      double mean = 0;
      for (int w = 0; w < workers; ++w) mean += x[w][i] / workers;
      worst = std::max(worst, std::abs(mean - harness::optimum(i, workers)));
    }
    EXPECT_LT(worst, c.tol) << c.name << " " << c.params.size();
    double spread = 0;
    for (size_t i = 0; i < 20; ++i) {
      double lo = 1e9, hi = -1e9;
      for (int w = 0; w < workers; ++w) lo = std::min(lo, double(last[w][i])), hi = std::max(hi, double(last[w][i]));
      spread = std::max(spread, hi - lo);
    }
    EXPECT_LT(spread, c.spread) << c.name << " " << c.params.size();
  }
}

}  // namespace
