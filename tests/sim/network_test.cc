// Closed forms of the collective cost models (MPICH formulas on a flat alpha-beta network), max-min fairness,
// and agreement of the symmetric and full-detail modes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "core/error.h"
#include "sim/cluster.h"
#include "sim/collective.h"
#include "sim/flow.h"
#include "sim/topology.h"

namespace conduit::sim {
namespace {

constexpr double kAlpha = 5e-6;        // s
constexpr double kBw = 10e9;           // bytes/s
constexpr double kBeta = 1.0 / kBw;    // s/byte
constexpr double kGamma = 1.0 / 40e9;  // s/byte

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

class FlatTest : public ::testing::TestWithParam<int> {};

TEST_P(FlatTest, MpichClosedForms) {
  const int p = GetParam();
  const double n = 64e6;
  Topology topo(flat_cluster(kAlpha, kBw, kGamma), p);
  CollectiveModel m(topo);
  Group g{p, 1, 0};
  const double lg = std::log2(static_cast<double>(p));
  // Ring allreduce: 2(p-1)a + 2(p-1)/p nb + (p-1)/p ng.
  double ring = 2 * (p - 1) * kAlpha + 2.0 * (p - 1) / p * n * kBeta + 1.0 * (p - 1) / p * n * kGamma;
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kRing, g, n), ring), 1e-9);
  // Ring reduce-scatter and allgather.
  EXPECT_LT(rel(m.time(Collective::kReduceScatter, Algorithm::kRing, g, n),
                (p - 1) * kAlpha + 1.0 * (p - 1) / p * n * (kBeta + kGamma)),
            1e-9);
  EXPECT_LT(
      rel(m.time(Collective::kAllGather, Algorithm::kRing, g, n), (p - 1) * kAlpha + 1.0 * (p - 1) / p * n * kBeta),
      1e-9);
  // Binomial broadcast and reduce: ceil(log p)(a + nb [+ ng]).
  const double clg = std::ceil(lg);
  EXPECT_LT(rel(m.time(Collective::kBroadcast, Algorithm::kBinomialTree, g, n), clg * (kAlpha + n * kBeta)), 1e-9);
  EXPECT_LT(rel(m.time(Collective::kReduce, Algorithm::kBinomialTree, g, n), clg * (kAlpha + n * kBeta + n * kGamma)),
            1e-9);
  // The runtime's rsg reduce: a ring reduce-scatter, then the p - 1 blocks into the root's link at once (charged
  // ceil(log p) latencies, as the runtime's cost model does).
  EXPECT_LT(
      rel(m.time(Collective::kReduce, Algorithm::kReduceScatterGather, g, n),
          (p - 1) * kAlpha + 1.0 * (p - 1) / p * n * (kBeta + kGamma) + clg * kAlpha + 1.0 * (p - 1) / p * n * kBeta),
      1e-9);
  // The chain (pipelined `ring`) broadcast and reduce, in segments of 512 KiB (the default pipeline_segment), as the
  // runtime's chain: (p-1+S-1)(a + n/S b [+ n/S g]); one segment: (p-1)(a + nb). (An ideal chain, (p-1)a + nb, was
  // 4.7x too fast for 64 MiB over 1024 GPUs: an audit.)
  {
    const double big = 64.0 * 1024 * 1024, S = big / (512.0 * 1024);
    EXPECT_LT(
        rel(m.time(Collective::kBroadcast, Algorithm::kRing, g, big), (p - 1 + S - 1) * (kAlpha + big / S * kBeta)),
        1e-9);
    EXPECT_LT(rel(m.time(Collective::kReduce, Algorithm::kRing, g, big),
                  (p - 1 + S - 1) * (kAlpha + big / S * (kBeta + kGamma))),
              1e-9);
    EXPECT_LT(rel(m.time(Collective::kBroadcast, Algorithm::kRing, g, 1000), (p - 1) * (kAlpha + 1000 * kBeta)), 1e-9);
    // (`sim coll --steps`: the chain's one step, then its segments and fill, add up to the time)
    double sum = 0;
    for (const StepReport& s : m.explain(Collective::kBroadcast, Algorithm::kRing, g, big)) sum += s.repeat * s.time;
    EXPECT_LT(rel(sum, m.time(Collective::kBroadcast, Algorithm::kRing, g, big)), 1e-9);
  }
  if ((p & (p - 1)) == 0) {
    // Rabenseifner: 2 log p a + 2(p-1)/p nb + (p-1)/p ng.
    double rab = 2 * lg * kAlpha + 2.0 * (p - 1) / p * n * kBeta + 1.0 * (p - 1) / p * n * kGamma;
    EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kHalvingDoubling, g, n), rab), 1e-9);
    // Recursive doubling: log p (a + nb + ng).
    EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kRecursiveDoubling, g, n),
                  lg * (kAlpha + n * kBeta + n * kGamma)),
              1e-9);
    // Recursive halving reduce-scatter, recursive doubling allgather.
    EXPECT_LT(rel(m.time(Collective::kReduceScatter, Algorithm::kHalvingDoubling, g, n),
                  lg * kAlpha + 1.0 * (p - 1) / p * n * (kBeta + kGamma)),
              1e-9);
    EXPECT_LT(rel(m.time(Collective::kAllGather, Algorithm::kHalvingDoubling, g, n),
                  lg * kAlpha + 1.0 * (p - 1) / p * n * kBeta),
              1e-9);
  } else {
    // Non-power of two (MPICH): fold the p - p' extra ranks in first (a + nb + ng) and return (a + nb) at the end.
    const double q = std::exp2(std::floor(lg));
    double rab = 2 * std::log2(q) * kAlpha + 2.0 * (q - 1) / q * n * kBeta + (q - 1) / q * n * kGamma +
                 2 * (kAlpha + n * kBeta) + n * kGamma;
    EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kHalvingDoubling, g, n), rab), 1e-9);
  }
  // In-network aggregation: each rank sends n up and receives n down once: 2a + nb.
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kInNetwork, g, n), 2 * kAlpha + n * kBeta), 1e-9);
  // Pairwise all-to-all: (p-1)(a + n/p b).
  EXPECT_LT(rel(m.time(Collective::kAllToAll, Algorithm::kDirect, g, n), (p - 1) * (kAlpha + n / p * kBeta)), 1e-9);
  // Binomial allreduce: a reduce, then a broadcast.
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kBinomialTree, g, n),
                2 * clg * (kAlpha + n * kBeta) + clg * n * kGamma),
            1e-9);
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, FlatTest, ::testing::Values(2, 4, 8, 64, 6, 12));

// The share of n each rank sends each other rank over a whole pattern, summed over its steps.
std::map<std::pair<long long, long long>, double> shares(Collective c, Algorithm a, long long p) {
  Topology topo(flat_cluster(kAlpha, kBw, kGamma), p);
  std::map<std::pair<long long, long long>, double> out;
  for (const Step& s : make_pattern(topo, c, a, Group{p, 1, 0}))
    for (const Transfer& t : s.transfers) out[{t.src, t.dst}] += t.frac * s.repeat;
  return out;
}

// The patterns are the runtime's algorithms (tests/coll's AlgorithmShape counts the same shares on the runtime's
// ranks): which partner gets which share decides which links carry the most, e.g. whether the largest halves of a
// halving-doubling stay inside a node. (Until 2026-12-06 the reduce-scatter, the allgather and the binomial tree ran
// in the opposite order to the runtime's, and the fold of a non-power of two paired rank i with i + q, across nodes,
// where the runtime pairs 2i with 2i + 1.)
TEST(Collective, PatternsGiveEachPartnerTheRuntimesShare) {
  using Pairs = std::map<std::pair<long long, long long>, double>;
  auto expect = [](const Pairs& got, const Pairs& want, const char* what) {
    for (const auto& [k, v] : want) {
      auto it = got.find(k);
      EXPECT_TRUE(it != got.end() && std::abs(it->second - v) < 1e-12)
          << what << ": " << k.first << " -> " << k.second << " got " << (it == got.end() ? -1 : it->second)
          << ", want " << v;
    }
    double total = 0, want_total = 0;
    for (const auto& [k, v] : got) total += v;
    for (const auto& [k, v] : want) want_total += v;
    EXPECT_NEAR(total, want_total, 1e-12) << what << ": transfers beyond the expected ones";
  };
  // 8 ranks: every rank r sends r ^ 1, r ^ 2, r ^ 4 these shares.
  auto by_distance = [](double d1, double d2, double d4) {
    Pairs w;
    for (long long r = 0; r < 8; ++r) w[{r, r ^ 1}] = d1, w[{r, r ^ 2}] = d2, w[{r, r ^ 4}] = d4;
    return w;
  };
  expect(shares(Collective::kAllReduce, Algorithm::kHalvingDoubling, 8), by_distance(1, 0.5, 0.25), "rhd allreduce");
  expect(shares(Collective::kReduceScatter, Algorithm::kHalvingDoubling, 8), by_distance(0.125, 0.25, 0.5),
         "rh reduce-scatter");
  expect(shares(Collective::kAllGather, Algorithm::kHalvingDoubling, 8), by_distance(0.125, 0.25, 0.5), "rd allgather");
  expect(shares(Collective::kAllReduce, Algorithm::kRecursiveDoubling, 8), by_distance(1, 1, 1), "rd allreduce");
  // Binomial broadcast from 0: 0 -> 4, then 0 -> 2 and 4 -> 6, then the odd ranks; the reduce its mirror.
  expect(shares(Collective::kBroadcast, Algorithm::kBinomialTree, 8),
         {{{0, 4}, 1}, {{0, 2}, 1}, {{4, 6}, 1}, {{0, 1}, 1}, {{2, 3}, 1}, {{4, 5}, 1}, {{6, 7}, 1}}, "broadcast");
  expect(shares(Collective::kReduce, Algorithm::kBinomialTree, 8),
         {{{4, 0}, 1}, {{2, 0}, 1}, {{6, 4}, 1}, {{1, 0}, 1}, {{3, 2}, 1}, {{5, 4}, 1}, {{7, 6}, 1}}, "reduce");
  // 6 ranks (q = 4, two folded): 0 -> 1 and 2 -> 3 fold; participants 1, 3, 4, 5. The reduce-scatter's halving
  // gives away the far half of its range, which covers its ranks' blocks (participant 0: blocks 0-1, 1: 2-3),
  // then the folded ranks get their block back.
  const double s = 1.0 / 6;
  expect(shares(Collective::kReduceScatter, Algorithm::kHalvingDoubling, 6),
         {{{0, 1}, 1},
          {{2, 3}, 1},
          {{1, 4}, 2 * s},
          {{4, 1}, 4 * s},
          {{3, 5}, 2 * s},
          {{5, 3}, 4 * s},
          {{1, 3}, 2 * s},
          {{3, 1}, 2 * s},
          {{4, 5}, s},
          {{5, 4}, s},
          {{1, 0}, s},
          {{3, 2}, s}},
         "rh reduce-scatter, 6 ranks");
  // The allreduce's fold and return, and equal blocks over the four participants.
  expect(shares(Collective::kAllReduce, Algorithm::kHalvingDoubling, 6),
         {{{0, 1}, 1},
          {{2, 3}, 1},
          {{1, 3}, 1},
          {{3, 1}, 1},
          {{4, 5}, 1},
          {{5, 4}, 1},
          {{1, 4}, 0.5},
          {{4, 1}, 0.5},
          {{3, 5}, 0.5},
          {{5, 3}, 0.5},
          {{1, 0}, 1},
          {{3, 2}, 1}},
         "rhd allreduce, 6 ranks");
}

TEST(Collective, DoubleBinaryTreeOnFlat) {
  // p = 8: tree depth 3 (in-order tree rooted at 8), every rank is inner in one tree and a leaf in the other,
  // so each link carries 2n: 2*3*a + 2nb + ng.
  const double n = 32e6;
  Topology topo(flat_cluster(kAlpha, kBw, kGamma), 8);
  CollectiveModel m(topo);
  double t = m.time(Collective::kAllReduce, Algorithm::kDoubleBinaryTree, Group{8, 1, 0}, n);
  EXPECT_LT(rel(t, 6 * kAlpha + 2 * n * kBeta + n * kGamma), 1e-9);
}

// Odd group sizes too: tree B shifts tree A by one rank there (NCCL's ncclGetDtree); a mirror at odd p left some
// ranks inner in both trees, 3n on their links (p = 7: 1.5x the time).
TEST(Collective, DoubleBinaryTreeCarriesTwoNPerLinkAtOddSizes) {
  const double n = 32e6;
  for (long long p : {3, 5, 7, 9, 15, 31}) {
    Topology topo(flat_cluster(kAlpha, kBw, kGamma), p);
    CollectiveModel m(topo);
    const double t = m.time(Collective::kAllReduce, Algorithm::kDoubleBinaryTree, Group{p, 1, 0}, n);
    const double bw = 2 * n * kBeta + n * kGamma;
    EXPECT_LT(t, bw + 2 * 6 * kAlpha) << p;  // depth <= 5 here: at most the latency term on top, not 3n
  }
}

TEST(Collective, AutoPicksLatencyOptimalForSmallAndBandwidthOptimalForLarge) {
  Topology topo(flat_cluster(kAlpha, kBw, kGamma), 64);
  CollectiveModel m(topo);
  Group g{64, 1, 0};
  auto small = m.profile(Collective::kAllReduce, Algorithm::kAuto, g, 1024);
  auto large = m.profile(Collective::kAllReduce, Algorithm::kAuto, g, 1e9);
  EXPECT_NE(small.algorithm, Algorithm::kRing);               // 126 alphas lose to 12 for a 1 KiB message
  EXPECT_NE(large.algorithm, Algorithm::kRecursiveDoubling);  // log p full copies lose for 1 GB
  EXPECT_NE(large.algorithm, Algorithm::kBinomialTree);
}

ClusterSpec two_level(int gpus_per_node, int nics, double intra_bw, double nic_bw, TopologyKind topo) {
  ClusterSpec c = flat_cluster(0, nic_bw, 0);
  c.node_kinds[0].gpus = gpus_per_node;
  c.node_kinds[0].nics = nics;
  c.node_kinds[0].intra = {intra_bw, 1e-6};
  c.node_kinds[0].nic = {nic_bw, 3e-6};
  c.network.topology = topo;
  c.network.nodes_per_leaf = 2;
  c.network.oversubscription = 2;
  c.network.switch_latency = 0.5e-6;
  c.network.software_overhead = 4e-6;
  c.network.reduction_bandwidth = 200e9;
  return c;
}

TEST(Collective, HierarchicalMatchesItsClosedForm) {
  // 4 nodes x 4 GPUs, one NIC per GPU, one leaf (no oversubscription on the path).
  ClusterSpec c = two_level(4, 4, 100e9, 10e9, TopologyKind::kFatTree);
  c.network.nodes_per_leaf = 4;
  Topology topo(c, 16);
  CollectiveModel m(topo);
  const double n = 256e6, k = 4, nodes = 4, a = 4e-6, g = 1 / 200e9;
  double intra = (k - 1) * (a + 1e-6) + (k - 1) / k * n / 100e9;
  double inter = 2 * (nodes - 1) * (a + 3e-6 + 0.5e-6) + 2 * (nodes - 1) / nodes * (n / k) / 10e9;
  double red = (k - 1) / k * n * g + (nodes - 1) / nodes * (n / k) * g;
  double expect = 2 * intra + inter + red;
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kHierarchical, Group{16, 1, 0}, n), expect), 1e-9);
  // Across the nodes by halving-doubling: 2 log 4 steps instead of 2 (4 - 1), the same bytes and reductions; by a
  // double binary tree: 2 x depth 2 latencies (pipelined), each NIC carrying 2 n/k (a rank inner in one tree sends
  // to and gets from its children and parent there: half of n/k each way per tree edge).
  const double hop = a + 3e-6 + 0.5e-6;
  const double hd = 2 * intra + 2 * 2 * hop + 2 * (nodes - 1) / nodes * (n / k) / 10e9 + red;
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kHierarchicalHd, Group{16, 1, 0}, n), hd), 1e-9);
  const double tree = 2 * intra + 2 * 2 * hop + 2 * (n / k) / 10e9 + (k - 1) / k * n * g + (n / k) * g;
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kHierarchicalTree, Group{16, 1, 0}, n), tree), 1e-9);
  // The reduce-scatter and allgather halves: the intra-node ring and the halving (doubling) across.
  const double rs = intra + 2 * hop + (nodes - 1) / nodes * (n / k) / 10e9 + red;
  EXPECT_LT(rel(m.time(Collective::kReduceScatter, Algorithm::kHierarchicalHd, Group{16, 1, 0}, n), rs), 1e-9);
  const double ag = intra + 2 * hop + (nodes - 1) / nodes * (n / k) / 10e9;
  EXPECT_LT(rel(m.time(Collective::kAllGather, Algorithm::kHierarchicalHd, Group{16, 1, 0}, n), ag), 1e-9);
  EXPECT_THROW(m.time(Collective::kAllGather, Algorithm::kHierarchicalTree, Group{16, 1, 0}, n), UnsupportedError);
}

TEST(Flow, TwoFlowsOnOneLinkEachGetHalf) {
  std::vector<double> cap{10e9};
  auto r = max_min_rates({{0}, {0}}, cap);
  EXPECT_DOUBLE_EQ(r[0], 5e9);
  EXPECT_DOUBLE_EQ(r[1], 5e9);
  // Completion: 1 GB each at 5 GB/s -> 0.2 s; after one ends the other speeds up.
  auto res = simulate_flows({{{0}, 1e9, 0, 0}, {{0}, 0.5e9, 0, 0}}, cap);
  EXPECT_NEAR(res.finish[1], 0.1, 1e-12);         // 0.5 GB at 5 GB/s
  EXPECT_NEAR(res.finish[0], 0.1 + 0.05, 1e-12);  // 0.5 GB left at 10 GB/s
}

TEST(Flow, MaxMinGivesLeftoverToUnbottleneckedFlows) {
  // Link 0 (10) shared by A and B; link 1 (4) shared by B and C. B is bottlenecked at link 1 (2 each),
  // A gets the rest of link 0 (8).
  auto r = max_min_rates({{0}, {0, 1}, {1}}, {10, 4});
  EXPECT_DOUBLE_EQ(r[1], 2);
  EXPECT_DOUBLE_EQ(r[2], 2);
  EXPECT_DOUBLE_EQ(r[0], 8);
}

TEST(Flow, LateArrivalSharesFromItsStart) {
  auto res = simulate_flows({{{0}, 10, 0, 0}, {{0}, 5, 0.5, 0}}, {10});
  // Alone for 0.5 s (5 bytes), then 5 each at rate 5 -> both finish at 1.5 s.
  EXPECT_NEAR(res.finish[0], 1.5, 1e-12);
  EXPECT_NEAR(res.finish[1], 1.5, 1e-12);
}

ClusterSpec torus_cluster() {
  ClusterSpec c = load_cluster("dgx-h100");
  c.network.topology = TopologyKind::kTorus;
  c.network.torus_dims = {4, 4};
  c.network.torus_link = {50e9, 1e-6};
  c.network.in_network_reduction = false;
  return c;
}

TEST(Topology, TorusRingMatchesItsClosedForm) {
  // A 1-D torus of 8 single-GPU nodes: a ring over neighbours uses one torus link per step.
  ClusterSpec c = flat_cluster(4e-6, 1e12, 0);
  c.network.topology = TopologyKind::kTorus;
  c.network.torus_dims = {8};
  c.network.torus_link = {20e9, 1e-6};
  Topology topo(c, 8);
  std::vector<int> path;
  EXPECT_NEAR(topo.route(0, 3, path), 3e-6, 1e-15);  // 3 hops one way
  path.clear();
  EXPECT_NEAR(topo.route(0, 6, path), 2e-6, 1e-15);  // 2 hops the other way round
  CollectiveModel m(topo);
  const double n = 64e6, p = 8;
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kRing, Group{8, 1, 0}, n),
                2 * (p - 1) * (4e-6 + 1e-6) + 2 * (p - 1) / p * n / 20e9),
            1e-9);
  // Half way round, + from an even node and - from an odd one: pairs 4 apart (groups {i, i + 4}, every copy at once)
  // put two flows on each link of both directions; all + (as it was) put four on the + links and left the - ones idle.
  path.clear();
  topo.route(0, 4, path);
  std::vector<int> back;
  topo.route(1, 5, back);
  ASSERT_EQ(path.size(), 4u);
  ASSERT_EQ(back.size(), 4u);
  EXPECT_EQ(std::set<int>(path.begin(), path.end()).count(back[0]), 0u);  // (another direction's links)
  EXPECT_LT(rel(m.time(Collective::kAllReduce, Algorithm::kRing, Group{2, 4, 0}, n),
                2 * (4e-6 + 4e-6) + 2 * (2 * n / 2) / 20e9),
            1e-9);
  EXPECT_LT(rel(m.time_full(Collective::kAllReduce, Algorithm::kRing, Group{2, 4, 0}, n),
                2 * (4e-6 + 4e-6) + 2 * (2 * n / 2) / 20e9),
            1e-6);
}

// Rail-optimized, 2:1 oversubscribed, nodes of 4 GPUs: one of 4 NICs, then one of 2 (whose ranks reach the higher
// rails through the spine), `pod` nodes a pod.
ClusterSpec rail_het(int pod) {
  ClusterSpec c = load_cluster("dgx-a100");
  c.node_kinds[0].gpus = 4;
  c.node_kinds[0].nics = 4;
  c.node_kinds[0].count = 1;
  c.node_kinds.push_back(c.node_kinds[0]);
  c.node_kinds[1].nics = 2;
  c.network.nodes_per_leaf = pod;
  c.network.oversubscription = 2;
  return c;
}

// A part-full leaf keeps its switch's uplinks: the 32 pairs (i, i + 80) on 160 accelerators whose far ends sit on the
// last leaf's 8 servers (of 32) are bound by those servers' NICs (4 accelerators share each), as without any
// oversubscription; the leaf was given its 8 servers' share of the uplinks, a third of their NICs on the 3:1 leaf,
// and the pairs took 3x their NICs' time. Under `sim cluster` a job
// keeps its nodes' share (uplink_share_of_attached), as under a loaded cluster.
TEST(Topology, APartFullLeafKeepsItsSwitchsUplinks) {
  ClusterSpec spec = load_cluster("ethernet-25g");
  const Group g{2, 80, 0};
  const double n = 100e6;
  Topology part(spec, 160);  // 40 servers, 32 a leaf
  CollectiveModel m(part);
  const double t = m.time(Collective::kAllReduce, Algorithm::kRing, g, n);
  EXPECT_LT(rel(t, m.time_full(Collective::kAllReduce, Algorithm::kRing, g, n)), 1e-6);
  ClusterSpec blocking = spec;  // (no oversubscription at all: the NIC's time)
  blocking.network.oversubscription = 1;
  Topology nb(blocking, 160);
  CollectiveModel mn(nb);
  EXPECT_LT(rel(t, mn.time(Collective::kAllReduce, Algorithm::kRing, g, n)), 1e-9);
  // The uplinks' capacities: a part-full leaf scales by its pod's missing nodes, at most its NICs; a full pod's upper
  // rails, which nodes with fewer NICs leave short (rail-optimized, a node of 4 NICs and one of 2), keep the NICs on
  // them over the oversubscription.
  auto uplinks = [](const Topology& topo) {  // each leaf's, in leaf order
    std::vector<double> up;
    for (size_t i = 0; i < topo.num_links(); ++i)
      if (topo.link(i).kind == LinkKind::kLeafUp) up.push_back(topo.link(i).bandwidth);
    return up;
  };
  const std::vector<double> ups = uplinks(part);
  ASSERT_EQ(ups.size(), 2u);
  EXPECT_EQ(ups[1], 8 * spec.node_kinds[0].nic.bandwidth);
  EXPECT_NEAR(ups[0], 32 * spec.node_kinds[0].nic.bandwidth / 3, 1);
  const ClusterSpec rails = rail_het(2);
  Topology rt(rails, 8);  // one pod of both nodes: full
  const double nic = rails.node_kinds[0].nic.bandwidth;
  const std::vector<double> rail_ups = uplinks(rt);
  ASSERT_EQ(rail_ups.size(), 4u);
  for (size_t rail = 0; rail < 4; ++rail) EXPECT_EQ(rail_ups[rail], (rail < 2 ? 2 : 1) * nic / 2) << rail;
  spec.network.uplink_share_of_attached = true;
  Topology shared(spec, 160);
  CollectiveModel ms(shared);
  EXPECT_EQ(ms.profile(Collective::kAllReduce, Algorithm::kRing, g, n).bottleneck.substr(0, 5), "leaf-");
  EXPECT_GT(ms.time(Collective::kAllReduce, Algorithm::kRing, g, n), 2.5 * t);
}

struct Agree {
  const char* preset;
  int gpus;
  long long size, stride;
  Algorithm alg;
  Collective coll;
  // Copies loading links unevenly: symmetric mode takes the most loaded link's time, full detail shares it max-min
  // fairly among flows that do not all start and end together (close, not equal).
  double tol = 1e-6;
};

class AgreeTest : public ::testing::TestWithParam<Agree> {};

TEST_P(AgreeTest, SymmetricMatchesFullDetail) {
  const Agree a = GetParam();
  const std::string preset = a.preset;
  ClusterSpec ring = flat_cluster(4e-6, 1e12, 0);  // "ring8": a 1-D torus of 8 one-accelerator nodes
  ring.network.topology = TopologyKind::kTorus;
  ring.network.torus_dims = {8};
  ring.network.torus_link = {10e9, 1e-6};
  // "flat8": a flat network of nodes with 8 GPUs and 8 NICs (routes took NIC 0 for every GPU: 8x apart).
  ClusterSpec flat8 = flat_cluster(10e-6, 10e9, 0);
  flat8.node_kinds[0].gpus = 8;
  flat8.node_kinds[0].nics = 8;
  flat8.node_kinds[0].intra = {100e9, 1e-6};
  // "rail4": rail-optimized, 8 GPUs and 4 NICs a node, a slow intra link: the GPUs sharing a NIC sent their PXN hops
  // through one proxy GPU, whose port symmetric mode counted once (2x faster than full detail).
  ClusterSpec rail4 = load_cluster("dgx-a100");
  rail4.node_kinds[0].nics = 4;
  rail4.node_kinds[0].intra = {2e9, 1e-6};
  rail4.node_kinds[0].nic = {10e9, 1e-6};
  rail4.network.nodes_per_leaf = 2;
  rail4.network.in_network_reduction = false;
  // "het": nodes of 4 GPUs and one NIC, two of a kind with a slow intra link and a fast NIC, then one with a fast intra
  // link and a slow NIC, 4 nodes a leaf; "railhet": rail-optimized, oversubscribed, a node of 4 NICs then one of 2
  // (whose ranks reach the higher rails through the spine), 4 nodes a pod. With 24 and 40 GPUs the last leaf is part
  // full, and copies inside one leaf still share links unevenly (a review: 0.22 s against 0.42 s, 24.2 ms against
  // 16.2 ms, when the leaf's size was left out for copies inside one leaf).
  ClusterSpec het = two_level(4, 1, 2e9, 12.5e9, TopologyKind::kFatTree);
  het.network.nodes_per_leaf = 4;
  het.network.oversubscription = 1;
  het.node_kinds.push_back(het.node_kinds[0]);
  het.node_kinds[0].count = 2;
  het.node_kinds[1].count = 1;
  het.node_kinds[1].intra = {300e9, 1e-6};
  het.node_kinds[1].nic = {1.25e9, 25e-6};
  const ClusterSpec railhet = rail_het(4);
  // "rail5": rail-optimized, 4:1 oversubscribed, 8 nodes of 8 GPUs and 4 NICs then 8 of 2 NICs, 6 nodes a pod: the
  // middle pod mixes the kinds, so copies of a group on one local index sit on unlike rails there (local 2: rail 1 on
  // the 4-NIC nodes, rail 0 on the 2-NIC ones), and the ranks a copy puts behind a rail leaf differ from copy to copy.
  // Symmetric mode scaled each copy's leaf load by accelerators behind the leaf / its ranks behind it (16 ranks 8
  // apart, in-network: 17.9 ms against 10.8 ms in full detail on 64 MiB; 8 ranks 16 apart, 35.8 ms against 21.5 ms),
  // as if every copy put as many there.
  const std::string rail5_yaml = R"(name: rail5
nodes:
  - name: four-nics
    count: 8
    gpus: 8
    accelerator: {name: A100, peak_bf16: 312 TFLOP/s, memory: 80 GiB, memory_bandwidth: 2039 GB/s}
    intra: {kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us}
    nics: 4
    nic: {bandwidth: 200 Gb/s, latency: 2.7 us}
  - name: two-nics
    count: 8
    gpus: 8
    accelerator: {name: A100, peak_bf16: 312 TFLOP/s, memory: 80 GiB, memory_bandwidth: 2039 GB/s}
    intra: {kind: nvswitch, bandwidth: 300 GB/s, latency: 0.7 us}
    nics: 2
    nic: {bandwidth: 200 Gb/s, latency: 2.7 us}
network:
  topology: rail-optimized
  nodes_per_leaf: 6
  oversubscription: 4
  switch_latency: 0.13 us
  software_overhead: 5 us
  reduction_bandwidth: 500 GB/s
  in_network_reduction: true
)";
  Topology topo(preset == "torus"     ? torus_cluster()
                : preset == "ring8"   ? ring
                : preset == "flat8"   ? flat8
                : preset == "rail4"   ? rail4
                : preset == "het"     ? het
                : preset == "railhet" ? railhet
                : preset == "rail5"   ? parse_cluster_yaml(rail5_yaml, "rail5")
                                      : load_cluster(a.preset),
                a.gpus);
  CollectiveModel m(topo);
  Group g{a.size, a.stride, 0};
  const double n = 128e6;
  double sym = m.time(a.coll, a.alg, g, n);
  double full = m.time_full(a.coll, a.alg, g, n);
  EXPECT_LT(rel(sym, full), a.tol) << "symmetric " << sym << " full " << full;
}

INSTANTIATE_TEST_SUITE_P(
    Placements, AgreeTest,
    ::testing::Values(Agree{"dgx-a100", 64, 8, 1, Algorithm::kRing, Collective::kAllReduce},   // TP groups
                      Agree{"dgx-a100", 64, 8, 8, Algorithm::kRing, Collective::kAllReduce},   // DP, one per node
                      Agree{"dgx-a100", 64, 16, 4, Algorithm::kRing, Collective::kAllReduce},  // DP, 2 per node
                      Agree{"dgx-a100", 64, 64, 1, Algorithm::kHierarchical, Collective::kAllReduce},
                      Agree{"dgx-a100", 64, 64, 1, Algorithm::kHierarchicalHd, Collective::kAllReduce},
                      Agree{"dgx-a100", 64, 64, 1, Algorithm::kHierarchicalTree, Collective::kAllReduce},
                      Agree{"dgx-a100", 96, 48, 2, Algorithm::kHierarchicalHd, Collective::kReduceScatter},
                      Agree{"dgx-a100", 64, 8, 8, Algorithm::kHalvingDoubling, Collective::kAllReduce},
                      Agree{"dgx-a100", 64, 8, 8, Algorithm::kInNetwork, Collective::kAllReduce},
                      Agree{"ethernet-25g", 32, 8, 4, Algorithm::kRing, Collective::kAllReduce},    // NIC shared by 4
                      Agree{"ethernet-25g", 256, 64, 4, Algorithm::kRing, Collective::kAllGather},  // oversubscribed
                      Agree{"dgx-h100", 128, 4, 32, Algorithm::kDirect, Collective::kShift},
                      Agree{"dgx-a100", 64, 32, 2, Algorithm::kRing, Collective::kAllReduce},  // PXN across rails
                      Agree{"dgx-a100", 64, 32, 2, Algorithm::kDoubleBinaryTree, Collective::kAllReduce},
                      Agree{"dgx-a100", 64, 64, 1, Algorithm::kBinomialTree, Collective::kBroadcast},
                      Agree{"dgx-a100", 64, 16, 4, Algorithm::kReduceScatterGather, Collective::kReduce},
                      Agree{"dgx-a100", 640, 80, 8, Algorithm::kHalvingDoubling, Collective::kAllReduce},  // 4 pods
                      Agree{"edge", 64, 64, 1, Algorithm::kRing, Collective::kAllReduce},  // heterogeneous NICs
                      // Groups within one node kind each: the slowest kind's copies decide (symmetric mode priced the
                      // copy on rank 0's kind, 10x too fast on edge's 1 GbE devices).
                      Agree{"edge", 64, 2, 1, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"edge", 64, 16, 2, Algorithm::kRing, Collective::kAllGather},
                      Agree{"flat8", 64, 8, 8, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"flat8", 64, 16, 4, Algorithm::kHalvingDoubling, Collective::kAllReduce},
                      Agree{"torus", 128, 16, 8, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"torus", 128, 128, 1, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"torus", 128, 16, 8, Algorithm::kHalvingDoubling, Collective::kAllReduce},
                      // Patterns whose copies are routed as shifted transfers on a torus, beyond ring and HD.
                      Agree{"torus", 128, 16, 8, Algorithm::kDoubleBinaryTree, Collective::kAllReduce},
                      Agree{"torus", 128, 16, 8, Algorithm::kRecursiveDoubling, Collective::kAllReduce},
                      Agree{"torus", 128, 16, 8, Algorithm::kBinomialTree, Collective::kBroadcast},
                      Agree{"torus", 128, 8, 4, Algorithm::kDirect, Collective::kAllToAll},
                      // Groups whose multi-hop routes cross each other's links: symmetric mode counted only the
                      // links behind a group's own accelerators (2x too fast here; a pipeline shift 8x).
                      Agree{"rail4", 16, 4, 4, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"rail4", 32, 16, 2, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"rail4", 32, 8, 4, Algorithm::kDirect, Collective::kAllToAll},
                      Agree{"ring8", 8, 4, 2, Algorithm::kRing, Collective::kAllReduce},
                      Agree{"ring8", 8, 2, 4, Algorithm::kDirect, Collective::kShift},
                      Agree{"torus", 128, 8, 16, Algorithm::kRing, Collective::kAllGather},
                      // Copies straddling nodes differently share NICs unevenly: the shares scaled from one copy
                      // gave 8.1 ms against 14.4 ms (stride 5), 7.2 against 12.5 ms (two groups splitting a node).
                      Agree{"dgx-a100", 80, 16, 5, Algorithm::kHalvingDoubling, Collective::kAllReduce, 0.01},
                      Agree{"dgx-a100", 200, 100, 1, Algorithm::kRing, Collective::kAllReduce, 0.01},
                      Agree{"ethernet-25g", 96, 12, 1, Algorithm::kRing, Collective::kAllGather, 0.01},
                      // PXN proxies of different copies on one NIC (a review: 2.77 ms against 5.45 ms; 4.87 ms
                      // against 8.89 ms), which no rank of the group sits behind.
                      Agree{"dgx-a100", 160, 2, 10, Algorithm::kRing, Collective::kAllReduce, 0.01},
                      Agree{"dgx-a100", 72, 8, 9, Algorithm::kHalvingDoubling, Collective::kAllReduce, 0.01},
                      Agree{"dgx-a100", 72, 2, 9, Algorithm::kDoubleBinaryTree, Collective::kAllReduce, 0.01},
                      // Hierarchical copies that split over nodes alike but straddle leaves unevenly (30 nodes, leaves
                      // of 20, copies of 3 nodes): routed as g's pattern shifted instead of built one by one.
                      Agree{"dgx-a100", 240, 24, 1, Algorithm::kHierarchical, Collective::kAllReduce, 0.01},
                      Agree{"dgx-a100", 240, 24, 1, Algorithm::kHierarchical, Collective::kReduceScatter, 0.01},
                      Agree{"dgx-a100", 240, 24, 1, Algorithm::kHierarchicalHd, Collective::kAllReduce, 0.01},
                      Agree{"dgx-a100", 240, 24, 1, Algorithm::kHierarchicalTree, Collective::kAllReduce, 0.01},
                      Agree{"het", 24, 8, 1, Algorithm::kHalvingDoubling, Collective::kAllReduce},
                      Agree{"het", 24, 8, 1, Algorithm::kRecursiveDoubling, Collective::kAllReduce},
                      // (full detail's first latency is the last flow's: one switch hop, 130 ns, under the slowest
                      // copy's since the part-full leaf keeps its switch's uplinks)
                      Agree{"railhet", 40, 8, 1, Algorithm::kInNetwork, Collective::kAllReduce, 1e-4},
                      // In-network copies straddling the part-full leaf unevenly (2 ranks a node): its intra-node
                      // rings routed as g's shifted, each copy's aggregation step built over its own NICs and uplinks
                      // (full detail's first latency is the last flow's, a switch hop under the slowest copy's).
                      Agree{"dgx-a100", 224, 28, 4, Algorithm::kInNetwork, Collective::kAllReduce, 1e-3},
                      Agree{"railhet", 40, 10, 2, Algorithm::kInNetwork, Collective::kAllReduce, 1e-3},
                      Agree{"railhet", 40, 2, 4, Algorithm::kRing, Collective::kReduce},
                      // Pods mixing node kinds of 4 and 2 NICs: copies on one local index each put unlike numbers
                      // of ranks behind a rail leaf (the middle pod's rail 1 carries four copies' 2-NIC ranks and
                      // two others' 4-NIC ranks), which the scaled shares took to be g's count everywhere.
                      Agree{"rail5", 128, 16, 8, Algorithm::kInNetwork, Collective::kAllReduce, 1e-3},
                      Agree{"rail5", 128, 32, 4, Algorithm::kInNetwork, Collective::kAllReduce, 1e-3},
                      Agree{"rail5", 128, 8, 16, Algorithm::kInNetwork, Collective::kAllReduce, 1e-3}));

// In-network aggregation across leaves: each way up (and down) passes the NIC, the leaf and the spine switch (a review
// found the step's latency was the larger of the NIC's and the two switches', a NIC's short; inside a leaf it left the
// switch out). dgx-a100: 20 nodes a leaf, one GPU of each of 40 nodes (two leaves).
TEST(Topology, InNetworkLatencyAcrossLeavesIsTheWholeWay) {
  const ClusterSpec spec = load_cluster("dgx-a100");
  Topology topo(spec, 320);
  CollectiveModel m(topo);
  const auto c = m.profile(Collective::kAllReduce, Algorithm::kInNetwork, Group{40, 8, 0});
  const double nic = spec.node_kinds[0].nic.latency, sw = spec.network.switch_latency;
  EXPECT_NEAR(c.latency, 2 * (nic + 2 * sw + spec.network.software_overhead), 1e-15);
  // Inside one leaf the way passes the NIC and the leaf switch, as a point-to-point route does.
  const auto one = m.profile(Collective::kAllReduce, Algorithm::kInNetwork, Group{20, 8, 0});
  EXPECT_NEAR(one.latency, 2 * (nic + sw + spec.network.software_overhead), 1e-15);
}

TEST(Topology, OversubscribedUplinkSlowsCrossLeafRings) {
  // ethernet-25g: 32 nodes a leaf, 3:1 oversubscribed. A ring of 64 nodes (2 leaves) with 4 concurrent rings
  // (one per GPU slot) pushes 4 flows over each leaf uplink of 32*25/3 Gb/s: still NIC-bound (4 GPUs share the
  // NIC). Check the NIC is reported as the bottleneck and the time equals the NIC-bound closed form.
  Topology topo(load_cluster("ethernet-25g"), 256);
  CollectiveModel m(topo);
  auto c = m.profile(Collective::kAllReduce, Algorithm::kRing, Group{64, 4, 0});
  EXPECT_EQ(c.bottleneck, "nic-out");
  EXPECT_NEAR(c.per_byte, 2.0 * 63 / 64 * 4 / (25e9 / 8), 1e-15);
}

// Nothing to move costs nothing in either mode (full detail charged every step's latencies and software overheads for
// n = 0, 110 us for a ring of 8, where symmetric mode's time is 0); a group that does not tile is still refused.
TEST(Topology, FullDetailOfNothingIsZeroAsSymmetrics) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel m(topo);
  const Group g{8, 8, 0};
  for (Algorithm a : {Algorithm::kRing, Algorithm::kInNetwork, Algorithm::kAuto}) {
    EXPECT_EQ(m.time(Collective::kAllReduce, a, g, 0), 0.0) << algorithm_name(a);
    EXPECT_EQ(m.time_full(Collective::kAllReduce, a, g, 0), 0.0) << algorithm_name(a);
    EXPECT_EQ(m.time_full(Collective::kAllReduce, a, g, -1), 0.0) << algorithm_name(a);
    // (one byte still pays the latencies, in both modes alike)
    const double one = m.time_full(Collective::kAllReduce, a, g, 1);
    EXPECT_GT(one, 0) << algorithm_name(a);
    EXPECT_LT(rel(one, m.time(Collective::kAllReduce, a, g, 1)), 1e-3) << algorithm_name(a);
  }
  EXPECT_THROW(m.time_full(Collective::kAllReduce, Algorithm::kRing, Group{3, 1, 0}, 0), InvalidArgument);
}

TEST(Topology, RoutesAndErrors) {
  Topology topo(load_cluster("dgx-a100"), 64);
  std::vector<int> path;
  topo.route(0, 1, path);
  EXPECT_EQ(path.size(), 2u);  // NVSwitch
  path.clear();
  topo.route(0, 8, path);
  EXPECT_EQ(path.size(), 2u);  // same rail, same leaf: NIC out, NIC in
  path.clear();
  topo.route(0, 9, path);
  EXPECT_EQ(path.size(), 4u);  // PXN: NVLink to GPU 1, then rail 1
  EXPECT_THROW(Topology(load_cluster("dgx-a100"), 12), ConfigError);
  Topology flat(flat_cluster(1e-6, 1e9, 0), 4);
  CollectiveModel m(flat);
  EXPECT_THROW(m.time(Collective::kAllReduce, Algorithm::kRing, Group{8, 1, 0}, 1), InvalidArgument);
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

TEST(Collective, ExplainedStepsAddUpToTheProfile) {
  Topology topo(load_cluster("dgx-a100"), 64);
  CollectiveModel m(topo);
  const double n = 256e6;
  for (Algorithm a : {Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kHierarchical, Algorithm::kInNetwork}) {
    double sum = 0;
    for (const auto& s : m.explain(Collective::kAllReduce, a, Group{64, 1, 0}, n)) {
      EXPECT_GE(s.bottleneck_link, 0);
      sum += s.repeat * s.time;
    }
    EXPECT_NEAR(sum / m.time(Collective::kAllReduce, a, Group{64, 1, 0}, n), 1.0, 1e-9) << algorithm_name(a);
  }
}

// Where symmetric mode routes more than the one group: every copy on a torus (other groups' routes cross its links;
// the steps showed half the total), the slowest copy on a cluster of node kinds (the steps showed the 10 GbE copy,
// 9 ms of an 84 ms total).
TEST(Collective, ExplainedStepsAddUpOnATorusAndOverNodeKinds) {
  ClusterSpec ring = flat_cluster(4e-6, 1e12, 0);
  ring.network.topology = TopologyKind::kTorus;
  ring.network.torus_dims = {8};
  ring.network.torus_link = {10e9, 1e-6};
  struct Case {
    Topology topo;
    Group g;
  };
  Case cases[] = {{Topology(ring, 8), Group{4, 2, 0}}, {Topology(load_cluster("edge"), 64), Group{2, 1, 0}}};
  for (auto& k : cases) {
    CollectiveModel m(k.topo);
    const double n = 100e6;
    double sum = 0;
    long long first = -1;
    for (const auto& s : m.explain(Collective::kAllReduce, Algorithm::kRing, k.g, n, &first)) sum += s.repeat * s.time;
    EXPECT_NEAR(sum / m.time(Collective::kAllReduce, Algorithm::kRing, k.g, n), 1.0, 1e-9) << k.topo.spec().name;
    // The torus routes every copy with the group's own; edge's slowest copy is on its 48 1 GbE devices (nodes 16-63).
    if (k.topo.spec().name == "edge") {
      EXPECT_GE(first, 16);
      EXPECT_LT(first, 64);
    } else {
      EXPECT_EQ(first, 0);
    }
  }
}

}  // namespace
}  // namespace conduit::sim

namespace conduit::sim {
namespace {

// Symmetric mode also times one copy of each other placement of a group: 2 ranks 96 apart on 192 ethernet-25g
// accelerators, where 64 pairs cross the 3:1 uplinks into the half-full last leaf, was priced as rank 0's pair, which
// stays in its leaf (86 ms, its NIC's time, against 129 ms in full detail). Full mode refuses copies that run
// different patterns (it read past the shorter one and crashed).
TEST(Symmetric, EveryPlacementOfAGroupIsTimed) {
  ClusterSpec spec = load_cluster("ethernet-25g");
  Topology topo(spec, 192);
  CollectiveModel m(topo);
  const double n = 64 << 20;
  const Group g{2, 96, 0};
  const double t = m.time(Collective::kAllReduce, Algorithm::kRing, g, n);
  EXPECT_NEAR(t / m.time_full(Collective::kAllReduce, Algorithm::kRing, g, n), 1, 1e-6);
  spec.network.oversubscription = 1;  // (rank 0's pair's time: its NIC's)
  Topology nb(spec, 192);
  CollectiveModel mn(nb);
  EXPECT_GT(t, 1.4 * mn.time(Collective::kAllReduce, Algorithm::kRing, g, n));
  Topology a100(load_cluster("dgx-a100"), 72);
  CollectiveModel h(a100);
  try {
    h.time_full(Collective::kAllReduce, Algorithm::kHierarchical, Group{6, 3, 0}, n);
    ADD_FAILURE() << "copies with different patterns were timed";
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("run different hierarchical patterns"), std::string::npos) << e.what();
  }
}

// Copies that straddle nodes unevenly are all routed (two groups of 100 splitting a node of 200 A100s); where they
// run different patterns (hierarchical splits at each copy's own node boundaries) the time is flagged approximate,
// and copies placed alike are neither.
TEST(Symmetric, UnevenCopiesAreRoutedOrFlagged) {
  Topology topo(load_cluster("dgx-a100"), 200);
  CollectiveModel m(topo);
  const Group split{100, 1, 0};
  auto ring = m.profile(Collective::kAllReduce, Algorithm::kRing, split);
  EXPECT_TRUE(ring.all_copies_routed);
  EXPECT_FALSE(ring.approximate);
  auto hier = m.profile(Collective::kAllReduce, Algorithm::kHierarchical, split);
  EXPECT_FALSE(hier.all_copies_routed);
  EXPECT_TRUE(hier.approximate);
  auto aligned = m.profile(Collective::kAllReduce, Algorithm::kRing, Group{25, 8, 0});
  EXPECT_FALSE(aligned.all_copies_routed);
  EXPECT_FALSE(aligned.approximate);
}

// Symmetric mode reuses a step's cost wherever the same transfers come again for the same group (a ring allreduce's
// two phases, the reduce-scatter and allgather profiles, the halving and doubling steps): a profile is the same
// whatever was profiled before it. Halving-doubling and recursive doubling exchange between the same pairs with
// different fractions of n; 28 dgx-a100 nodes leave the last leaf part full, so some groups route every copy.
TEST(Symmetric, AProfileDoesNotDependOnWhatWasProfiledBefore) {
  for (const char* preset : {"dgx-a100", "ethernet-25g"}) {
    Topology topo(load_cluster(preset), 224);
    CollectiveModel shared(topo);
    int routed = 0, checked = 0;
    for (const Group g : {Group{8, 1, 0}, Group{16, 1, 0}, Group{28, 8, 0}, Group{56, 4, 0}, Group{32, 7, 0}})
      for (Algorithm a :
           {Algorithm::kHalvingDoubling, Algorithm::kRecursiveDoubling, Algorithm::kRing, Algorithm::kDoubleBinaryTree,
            Algorithm::kHierarchical, Algorithm::kHierarchicalHd, Algorithm::kHierarchicalTree, Algorithm::kInNetwork})
        for (Collective c : {Collective::kReduceScatter, Collective::kAllGather, Collective::kAllReduce}) {
          CollectiveModel fresh(topo);
          CollectiveCost x, y;
          try {
            x = fresh.profile(c, a, g);
          } catch (const UnsupportedError&) {
            EXPECT_THROW(shared.profile(c, a, g), UnsupportedError);
            continue;
          }
          y = shared.profile(c, a, g);
          const std::string what =
              fmt::format("{} {} {} of {} stride {}", preset, algorithm_name(a), collective_name(c), g.size, g.stride);
          EXPECT_EQ(x.latency, y.latency) << what;
          EXPECT_EQ(x.per_byte, y.per_byte) << what;
          EXPECT_EQ(x.reduce_frac, y.reduce_frac) << what;
          EXPECT_EQ(x.bottleneck, y.bottleneck) << what;
          EXPECT_EQ(x.all_copies_routed, y.all_copies_routed) << what;
          EXPECT_EQ(x.approximate, y.approximate) << what;
          routed += x.all_copies_routed;
          ++checked;
        }
    EXPECT_GT(checked, 40) << preset;
    if (std::string(preset) == "dgx-a100") {
      EXPECT_GT(routed, 5);
    }
  }
}

// Auto chooses what profiling every candidate chooses (the fastest for n, the first in candidate order on a tie),
// though candidates whose bound from routing the group alone loses are not profiled: for large and small messages,
// on part-full leaves and heterogeneous nodes, groups on and off the cluster's tiling, asked in any order.
TEST(Symmetric, AutoPicksWhatProfilingEveryCandidatePicks) {
  ClusterSpec het = two_level(4, 1, 2e9, 12.5e9, TopologyKind::kFatTree);
  het.network.nodes_per_leaf = 4;
  het.node_kinds.push_back(het.node_kinds[0]);
  het.node_kinds[0].count = 2;
  het.node_kinds[1].intra = {300e9, 1e-6};
  het.node_kinds[1].nic = {1.25e9, 25e-6};
  int skipped = 0, checked = 0;
  for (const auto& [spec, gpus] :
       {std::pair{load_cluster("dgx-a100"), 224}, std::pair{load_cluster("ethernet-25g"), 96}, std::pair{het, 24}}) {
    Topology topo(spec, gpus);
    CollectiveModel shared(topo);
    for (const Group g : {Group{8, 1, 0}, Group{28, 4, 0}, Group{12, 2, 0}, Group{6, 2, 5}, Group{4, 3, 1}})
      for (Collective c : {Collective::kAllReduce, Collective::kAllGather, Collective::kBroadcast})
        for (double n : {1e3, 1e6, 1e9}) {
          if (g.first + (g.size - 1) * g.stride >= gpus) continue;
          CollectiveModel all(topo), one(topo);
          CollectiveCost best;
          double best_t = -1;
          int applicable = 0;
          for (Algorithm a : candidate_algorithms(c, topo)) {
            try {
              const CollectiveCost cc = all.profile(c, a, g, n);
              ++applicable;
              if (best_t < 0 || cc.time(n) < best_t) {
                best_t = cc.time(n);
                best = cc;
              }
            } catch (const UnsupportedError&) {
            }
          }
          const std::string what = fmt::format("{} {} of {} stride {} first {}, {} bytes", spec.name,
                                               collective_name(c), g.size, g.stride, g.first, n);
          ASSERT_GT(applicable, 0) << what;
          for (CollectiveModel* m : {&shared, &one}) {
            const CollectiveCost x = m->profile(c, Algorithm::kAuto, g, n);
            EXPECT_EQ(algorithm_name(x.algorithm), algorithm_name(best.algorithm)) << what;
            EXPECT_EQ(x.time(n), best_t) << what;
          }
          skipped += static_cast<int>(one.cache_size()) < applicable;
          ++checked;
        }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(skipped, checked / 4) << "candidates profiled that their bounds rule out";
}

// A group inside a node costs the same in the last, part-full leaf as in a full one: its copies are not routed one
// by one (every tensor-parallel group of 262,144 dgx-a100 GPUs was, since the last leaf holds 8 nodes of 20), and the
// time is the full-leaf cluster's and full detail's.
TEST(Symmetric, GroupsInsideANodeAreNotRoutedCopyByCopy) {
  Topology part(load_cluster("dgx-a100"), 224), whole(load_cluster("dgx-a100"), 320);
  CollectiveModel m(part), w(whole);
  const double n = 64 << 20;
  for (const Group g : {Group{8, 1, 0}, Group{4, 2, 0}, Group{2, 4, 0}})
    for (Algorithm a : {Algorithm::kRing, Algorithm::kInNetwork}) {
      const std::string what = fmt::format("{} of {} stride {}", algorithm_name(a), g.size, g.stride);
      const auto c = m.profile(Collective::kAllReduce, a, g);
      EXPECT_FALSE(c.all_copies_routed) << what;
      EXPECT_FALSE(c.approximate) << what;
      EXPECT_DOUBLE_EQ(c.time(n), w.time(Collective::kAllReduce, a, g, n)) << what;
      EXPECT_LT(rel(c.time(n), m.time_full(Collective::kAllReduce, a, g, n)), 1e-6) << what;
    }
}

}  // namespace
}  // namespace conduit::sim
