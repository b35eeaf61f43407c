// SyncStats bytes per step match the formulas in docs/sync.md.
#include <gtest/gtest.h>

#include <mutex>

#include "core/error.h"
#include "harness.h"
#include "sync/graph.h"

using namespace conduit;
using namespace conduit::sync;

namespace {

std::vector<SyncStats> stats_of(int n, const std::string& name, const Params& p, int steps, size_t d) {
  std::vector<SyncStats> out(n);
  harness::on_ranks(n, [&](int r, coll::CommPtr c) {
    Strategy* s = nullptr;
    harness::train(r, c, name, p, steps, d, 0.1f, 0, &s, [&](Strategy& st) { out[r] = st.stats(); });
  });
  return out;
}

TEST(SyncBytes, PerStepVolumesMatchTheDocumentedFormulas) {
  const int n = 4, steps = 8;
  const size_t d = 100, b = 4 * d;
  const uint64_t allreduce = 2ull * (n - 1) * b / n;
  EXPECT_EQ(stats_of(n, "bsp", {}, steps, d)[1].bytes_sent, steps * allreduce);
  EXPECT_EQ(stats_of(n, "local", {{"period", "4"}}, steps, d)[1].bytes_sent, steps / 4 * allreduce);
  EXPECT_EQ(stats_of(n, "diloco", {{"period", "2"}}, steps, d)[1].bytes_sent, steps / 2 * allreduce);
  EXPECT_EQ(stats_of(n, "easgd", {{"period", "2"}}, steps, d)[1].bytes_sent, steps / 2 * allreduce);
  EXPECT_EQ(stats_of(n, "dpsgd", {}, steps, d)[1].bytes_sent, steps * 2 * b);
  EXPECT_EQ(stats_of(n, "dpsgd", {{"graph", "torus"}, {"rows", "2"}}, steps, d)[1].bytes_sent, steps * 2 * b);
  EXPECT_EQ(stats_of(8, "dpsgd", {{"graph", "torus"}, {"rows", "2"}}, steps, d)[1].bytes_sent, steps * 3 * b);
  EXPECT_EQ(stats_of(n, "sgp", {{"peers", "2"}}, steps, d)[1].bytes_sent, steps * 2 * (b + 4));
  // ps: 3 workers push to 2 dedicated shards; each push is a 32-byte header + the shard; plus the initial pull's
  // and the stop's headers.
  auto ps = stats_of(5, "ps-bsp", {{"servers", "2"}}, steps, d);
  EXPECT_EQ(ps[1].bytes_sent, steps * (2 * 32 + b) + 2 * 2 * 32);
  EXPECT_EQ(ps[1].bytes_received, (steps + 2) * (2 * 16 + b));  // + the initial pull and the final model
}

// AD-PSGD: every step each active rank sends its model and a flag (b + 4) and receives its neighbour's model (b),
// the neighbour the other way round; at the end each active rank sends each neighbour it initiates with a stop of a
// request's size (these were sent and counted nowhere: ~7% of a short run's bytes), then one final average. Every
// byte is counted once sent and once received.
TEST(SyncBytes, AdpsgdCountsItsExchangesItsStopsAndItsFinalAverage) {
  for (int n : {4, 5}) {
    const int steps = 8;
    const size_t d = 100, b = 4 * d;
    uint64_t active = 0, stops = 0;
    for (int r = 0; r < n; ++r) {
      const PairRoles roles = adpsgd_ring_roles(r, n);
      active += roles.initiates.empty() ? 0 : 1;
      stops += roles.initiates.size();
    }
    ASSERT_GT(stops, 0u);
    const uint64_t allreduce = 2ull * (n - 1) * b / n;
    const uint64_t expected = steps * active * (2 * b + 4) + stops * (b + 4) + n * allreduce;
    uint64_t sent = 0, received = 0;
    for (const SyncStats& s : stats_of(n, "adpsgd", {}, steps, d)) {
      sent += s.bytes_sent;
      received += s.bytes_received;
    }
    EXPECT_EQ(sent, expected) << n << " ranks";
    EXPECT_EQ(received, expected) << n << " ranks";
  }
}

}  // namespace
