#include <gtest/gtest.h>

#include <cmath>

#include "coll/tuner.h"
#include "core/error.h"

using namespace conduit;
using namespace conduit::coll;

TEST(Tuner, RingCostIsTheClosedForm) {
  CostModel m;
  m.intra = {1e-5, 1e-9, 5e-10};
  Tuner t(m);
  double n = 1 << 20;
  int p = 4;
  double want = 2 * (p - 1) * 1e-5 + 2.0 * (p - 1) / p * n * 1e-9 + (p - 1.0) / p * n * 5e-10;
  EXPECT_NEAR(t.predict(CollOp::allreduce, "ring", n, p, 1), want, 1e-12);
}

// At a non-power of two the recursive algorithms' bandwidth terms are over p' (the largest power of two <= p), as
// docs/algorithms.md gives them, plus the fix-up; rh's halving steps move the larger half of blocks of n/p, of which
// the first p - p' ranks hold two, and its fix-up returns one block; a rule's bad algorithm names its variable.
TEST(Tuner, RecursiveAlgorithmsAtNonPowersOfTwoAreChargedAsDocumented) {
  CostModel m;
  const double a = 1e-5, b = 1e-9, g = 5e-10;
  m.intra = {a, b, g};
  Tuner t(m);
  const double n = 1 << 20;
  const int p = 6;
  const double pp = 4, f = (pp - 1) / pp;
  EXPECT_NEAR(t.predict(CollOp::allreduce, "rhd", n, p, 1),
              2 * 2 * a + 2 * f * n * b + f * n * g + 2 * (a + n * b) + n * g, 1e-12);
  // rh at p = 6: 2 of the 4 taking part hold two blocks, so its halving steps move 4 and 2 blocks of n/6: n in all.
  EXPECT_NEAR(t.predict(CollOp::reduce_scatter, "rh", n, p, 1),
              2 * a + 1.0 * n * (b + g) + (a + n * b + n * g) + (a + n / p * b), 1e-12);
  EXPECT_NEAR(t.predict(CollOp::reduce_scatter, "rh", n, 8, 1), 3 * a + 7.0 / 8 * n * (b + g), 1e-12);
  try {
    Tuner::parse_rules(CollOp::allgather, "ring:0-1K,rhd:1K-", "CONDUIT_ALLGATHER");
    ADD_FAILURE() << "rhd taken for allgather";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "CONDUIT_ALLGATHER: unknown allgather algorithm 'rhd': allowed are ring, rd");
  }
}

TEST(Tuner, LatencyBoundSizesPickLogarithmicAlgorithmsAndLargeOnesBandwidthOptimal) {
  CostModel m;
  m.intra = {1e-5, 1e-10, 1e-10};
  Tuner t(m);
  std::string small = t.choose(CollOp::allreduce, 8, 8, 1, true);
  EXPECT_TRUE(small == "rd" || small == "rhd" || small == "tree") << small;
  std::string big = t.choose(CollOp::allreduce, 256 << 20, 8, 1, true);
  EXPECT_TRUE(big == "ring" || big == "rhd") << big;
  EXPECT_NE(t.choose(CollOp::allreduce, 256 << 20, 7, 1, true), "rd");
  // Several hosts with a slow inter-host link: the hierarchical algorithm moves fewer bytes across it.
  CostModel two;
  two.intra = {1e-6, 1e-11, 1e-10};
  two.inter = {5e-5, 1e-8, 1e-10};
  Tuner th(two);
  EXPECT_EQ(th.choose(CollOp::allreduce, 64 << 20, 8, 2, true), "hier");
  EXPECT_NE(th.choose(CollOp::allreduce, 64 << 20, 8, 2, false), "hier");
}

TEST(Tuner, ForcingRulesBySizeRange) {
  Tuner t;
  t.force(CollOp::allreduce, Tuner::parse_rules(CollOp::allreduce, "tree:0-64K,rhd:64K-4M,ring:4M-", "X"));
  EXPECT_EQ(t.choose(CollOp::allreduce, 100, 4, 1, true), "tree");
  EXPECT_EQ(t.choose(CollOp::allreduce, 64 << 10, 4, 1, true), "rhd");
  EXPECT_EQ(t.choose(CollOp::allreduce, 1 << 30, 4, 1, true), "ring");
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "warp", "X"), ConfigError);
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "ring:5M-1M", "X"), ConfigError);
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "ring:abc", "X"), ConfigError);
  // Overlapping ranges left part of a later rule dead; sizes that are not whole bytes, or hex and exponent
  // spellings, were read as something else (0.4-0.6 became [0, 1), 0x10-1e3 16 to 1000).
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "tree:0-1M,ring:0-", "X"), ConfigError);
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "ring,tree", "X"), ConfigError);
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "ring:0.4-0.6", "X"), ConfigError);
  EXPECT_THROW(Tuner::parse_rules(CollOp::allreduce, "ring:0x10-1e3", "X"), ConfigError);
  EXPECT_NO_THROW(Tuner::parse_rules(CollOp::allreduce, "tree:0-1.5K,ring:1.5K-", "X"));
}

// choose() remembers its last answer per operation; any change of rules or model, and another tuner, is seen.
TEST(Tuner, RememberedChoicesFollowChangesAndOtherTuners) {
  Tuner t;
  std::string first = t.choose(CollOp::allreduce, 4096, 4, 1, true);
  EXPECT_EQ(t.choose(CollOp::allreduce, 4096, 4, 1, true), first);
  std::string other = first == "ring" ? "tree" : "ring";
  t.force(CollOp::allreduce, Tuner::parse_rules(CollOp::allreduce, other + ":0-", "X"));
  EXPECT_EQ(t.choose(CollOp::allreduce, 4096, 4, 1, true), other);
  EXPECT_TRUE(t.forced_at(CollOp::allreduce, 4096));
  Tuner copy = t;  // shares the rules it copied
  EXPECT_EQ(copy.choose(CollOp::allreduce, 4096, 4, 1, true), other);
  t.force(CollOp::allreduce, {});
  EXPECT_FALSE(t.forced_at(CollOp::allreduce, 4096));
  EXPECT_EQ(t.choose(CollOp::allreduce, 4096, 4, 1, true), first);
  EXPECT_EQ(copy.choose(CollOp::allreduce, 4096, 4, 1, true), other);
  // A model where latency dominates everything against one where bandwidth does: the answer follows the model.
  CostModel lat, bw;
  lat.intra = {1e-3, 1e-12, 0};
  bw.intra = {1e-9, 1e-6, 0};
  Tuner m(lat);
  std::string a = m.choose(CollOp::allreduce, 64 << 20, 8, 1, true);
  m.set_model(bw);
  std::string b = m.choose(CollOp::allreduce, 64 << 20, 8, 1, true);
  Tuner fresh(bw);
  EXPECT_EQ(b, fresh.choose(CollOp::allreduce, 64 << 20, 8, 1, true));
  Tuner fresh_lat(lat);
  EXPECT_EQ(a, fresh_lat.choose(CollOp::allreduce, 64 << 20, 8, 1, true));
  EXPECT_NE(a, b);
}

TEST(Tuner, CostModelTextRoundTripsAndRejectsGarbage) {
  CostModel m = parse_cost_model("intra=1e-6,2e-10,3e-10;inter=2e-5,1e-9,3e-10", "CONDUIT_COST_MODEL");
  EXPECT_DOUBLE_EQ(m.intra.alpha, 1e-6);
  EXPECT_DOUBLE_EQ(m.inter.beta, 1e-9);
  EXPECT_THROW(parse_cost_model("intra=1,2", "X"), ConfigError);
  EXPECT_THROW(parse_cost_model("cross=1,2,3", "X"), ConfigError);
  // A key given twice (the last silently won).
  try {
    parse_cost_model("intra=1,2,3;inter=1,2,3;intra=4,5,6", "X");
    ADD_FAILURE() << "a repeated key was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("X: 'intra' is given twice"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_cost_model("intra=1,-2,3", "X"), ConfigError);
}
