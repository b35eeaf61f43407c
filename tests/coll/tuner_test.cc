#include "coll/tuner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

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

// hier's cross-host step runs the tuner's pick for n/L bytes among H ranks, and is priced so (it was priced as a ring:
// 2(H-1) latencies where rd pays log H, and hier lost to a flat rd it beats). 16 ranks on 8 hosts, 64 KiB, a
// high-latency inter-host link: the cross step is rd's, and hier wins.
TEST(Tuner, HierPricesItsCrossHostStepAsTheAlgorithmItRuns) {
  CostModel m;
  m.intra = {1e-7, 1e-12, 1e-12};
  m.inter = {5e-5, 1e-9, 1e-12};
  Tuner t(m);
  const double n = 64 << 10, L = 2;
  const double local = 2 * ((L - 1) * m.intra.alpha + (L - 1) / L * n * m.intra.beta) + (L - 1) / L * n * m.intra.gamma;
  const double rd = t.predict(CollOp::allreduce, "rd", n / L, 8, 8);
  for (const char* a : {"ring", "rhd", "tree"}) EXPECT_LT(rd, 0.9 * t.predict(CollOp::allreduce, a, n / L, 8, 8)) << a;
  EXPECT_NEAR(t.predict(CollOp::allreduce, "hier", n, 16, 8), local + rd, 1e-12);
  EXPECT_EQ(t.choose(CollOp::allreduce, 64 << 10, 16, 8, true), "hier");
  // A forcing rule that covers the cross step's n/L bytes is what the step runs, and what it is priced as.
  t.force(CollOp::allreduce, Tuner::parse_rules(CollOp::allreduce, "tree:0-40K,ring:40K-", "X"));
  EXPECT_NEAR(t.predict(CollOp::allreduce, "hier", n, 16, 8), local + t.predict(CollOp::allreduce, "tree", n / L, 8, 8),
              1e-12);
}

// The tuner passes over algorithms that send one message past the message limit (16 GiB by default): every receiver
// refuses it. A 2-rank broadcast took the tree (one message of the whole vector) at every size and failed past it.
TEST(Tuner, AlgorithmsWithMessagesPastTheLimitAreNotPicked) {
  Tuner t;
  const double limit = double(size_t{16} << 30), big = 2 * limit;
  EXPECT_EQ(t.largest_message(CollOp::broadcast, "tree", big, 2, 1, false), big);
  EXPECT_EQ(t.largest_message(CollOp::broadcast, "chain", big, 2, 1, false), 0);
  EXPECT_EQ(t.choose(CollOp::broadcast, 1 << 20, 2, 1, false), "tree");
  EXPECT_EQ(t.choose(CollOp::broadcast, size_t(big), 2, 1, false), "chain");
  // reduce: the tree sends the whole vector, rsg a block of it to the root (one element over n/p: 8 bytes, of any
  // dtype, where the element size is not given)
  EXPECT_EQ(t.largest_message(CollOp::reduce, "rsg", big, 4, 1, false), big / 4 + 8);
  EXPECT_EQ(t.choose(CollOp::reduce, size_t(big), 4, 1, false), "rsg");
  // Halving and doubling send half at a power of two (up to p/4 elements over it); off one, the fold sends the whole
  // vector.
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "rhd", big, 4, 1, false), big / 2 + 8);
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "rhd", big, 6, 1, false), big);
  EXPECT_EQ(t.largest_message(CollOp::allgather, "rd", big, 6, 1, false), 0);  // (runs the ring)
  // hier: across hosts the step runs the tuner's pick for n/L bytes, inside them rings; uneven hosts use trees.
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "hier", 4 * limit, 8, 2, true), 0);
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "hier", big, 8, 2, false), big);
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "hier", big, 2, 2, false), 0);  // one member a host: the ring
  // Nothing fits (a 2-rank reduce past twice the limit): the smallest message, rsg's half (the call is refused).
  EXPECT_EQ(t.choose(CollOp::reduce, size_t(2 * big), 2, 1, false), "rsg");
  CostModel latency;  // a latency-bound model, where the logarithmic algorithms win up to large sizes
  latency.intra = {1e-3, 1e-12, 1e-12};
  Tuner tl(latency);
  EXPECT_NE(tl.choose(CollOp::allreduce, 1 << 20, 8, 1, true), "ring");
  EXPECT_EQ(tl.choose(CollOp::allreduce, size_t(big), 8, 1, true), "ring");
}

// Blocks are whole elements, the first count % p of them one element longer. rhd's upper rank sends the lower, larger
// half: 4 ranks and 1,048,578 f32 elements send 2,097,160 bytes, not n/2 = 2,097,156 (under a limit of 2,097,156 the
// call passed the checks and aborted the job). hier's cross-host step takes a local rank's block: 8 ranks on 2 hosts
// and 4001 f32 elements give blocks of 1001 elements, 4004 bytes, not n/L = 4001.
TEST(Tuner, LargestMessagesAreWholeElements) {
  Tuner t;
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "rhd", 4194312, 4, 1, false, 4), 2097160);
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "rhd", 4194304, 4, 1, false, 4), 2097152);
  EXPECT_EQ(t.largest_message(CollOp::allreduce, "rhd", 7 * 8, 8, 1, false, 8), 4 * 8);  // blocks 1,1,...,1,0
  EXPECT_EQ(t.largest_message(CollOp::reduce, "rsg", 1001 * 4, 4, 1, false, 4), 251 * 4);
  for (size_t esz : {1, 2, 4, 8})  // without the element size: a bound for every dtype
    EXPECT_GE(t.largest_message(CollOp::allreduce, "rhd", 4194312, 4, 1, false),
              t.largest_message(CollOp::allreduce, "rhd", 4194312, 4, 1, false, esz))
        << esz;
  Tuner rd;  // (the cross-host step forced to rd: it sends its whole block)
  rd.force(CollOp::allreduce, Tuner::parse_rules(CollOp::allreduce, "rd", "X"));
  EXPECT_EQ(rd.largest_message(CollOp::allreduce, "hier", 4001 * 4, 8, 2, true, 4), 1001 * 4);
  EXPECT_GE(rd.largest_message(CollOp::allreduce, "hier", 4001 * 4, 8, 2, true), 1001 * 4);
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

// One tuner is shared by a communicator and its host groups and splits, whose collectives choose on several threads,
// while set_model (world.cc's measured model) or force may run: every reader must see one whole state, old or new.
// The rules and the model were assigned in place, under readers walking the rules' vector and copying the model's
// strings (a crash, a garbage name or a choice no state gives; a data race under ThreadSanitizer).
TEST(Tuner, ChangesWhileOtherThreadsChooseAreSeenWhole) {
  CostModel lat, bw;
  lat.intra = lat.inter = {1e-3, 1e-12, 0};
  lat.source = "latency";
  bw.intra = bw.inter = {1e-9, 1e-6, 0};
  bw.source = "a bandwidth-bound model, its name longer than any string's inline buffer";
  const auto rules = Tuner::parse_rules(CollOp::allreduce, "tree:0-64K,rd:64K-4M,ring:4M-", "X");
  const auto bc_rules = Tuner::parse_rules(CollOp::broadcast, "chain", "X");
  using Query = std::tuple<CollOp, size_t, int, int, bool>;
  std::vector<Query> queries;
  for (CollOp op : {CollOp::allreduce, CollOp::reduce_scatter, CollOp::allgather, CollOp::broadcast, CollOp::reduce})
    for (size_t bytes : {size_t{8}, size_t{100} << 10, size_t{64} << 20})
      for (auto [p, hosts] : {std::pair{8, 1}, std::pair{6, 1}, std::pair{8, 2}})
        queries.emplace_back(op, bytes, p, hosts, true);
  // Every answer a state the writer publishes can give ({lat, bw} x {no rules, rules}).
  std::map<Query, std::set<std::string>> allowed;
  for (const CostModel* m : {&lat, &bw})
    for (bool forced : {false, true}) {
      Tuner t(*m);
      if (forced) {
        t.force(CollOp::allreduce, rules);
        t.force(CollOp::broadcast, bc_rules);
      }
      for (const auto& q : queries) allowed[q].insert(std::apply([&](auto... a) { return t.choose(a...); }, q));
    }
  ASSERT_GT(allowed.at(Query{CollOp::allreduce, size_t{64} << 20, 8, 1, true}).size(), 1u);  // the states disagree

  Tuner shared(lat);
  constexpr int kReaders = 4, kChanges = 20000;
  std::atomic<bool> done{false};
  std::atomic<int> started{0};
  std::atomic<long> reads{0};
  std::mutex bad_mu;
  std::vector<std::string> bad;
  auto report = [&](std::string what) {
    std::lock_guard<std::mutex> lk(bad_mu);
    if (bad.size() < 10) bad.push_back(std::move(what));
  };
  std::vector<std::thread> readers;
  for (int r = 0; r < kReaders; ++r)
    readers.emplace_back([&] {
      bool first = true;
      while (!done.load()) {
        for (const auto& q : queries) {
          const std::string a = std::apply([&](auto... x) { return shared.choose(x...); }, q);
          if (!allowed.at(q).count(a)) report("choice '" + a + "' for " + coll_op_name(std::get<0>(q)));
        }
        const CostModel m = shared.model();
        auto is = [&](const CostModel& x) {
          return m.source == x.source && m.intra.alpha == x.intra.alpha && m.inter.beta == x.inter.beta;
        };
        if (!is(lat) && !is(bw)) report("a model mixing two: source '" + m.source + "'");
        shared.forced_at(CollOp::allreduce, 100);
        reads.fetch_add(1);
        if (first) started.fetch_add(1);
        first = false;
      }
    });
  while (started.load() < kReaders) std::this_thread::yield();
  for (int i = 0; i < kChanges; ++i) {
    shared.set_model(i % 2 ? bw : lat);
    shared.force(CollOp::allreduce, i % 3 == 0 ? rules : std::vector<ForceRule>{});
    shared.force(CollOp::broadcast, i % 5 == 0 ? bc_rules : std::vector<ForceRule>{});
  }
  done = true;
  for (auto& t : readers) t.join();
  EXPECT_TRUE(bad.empty()) << bad.size() << " bad reads, the first: " << (bad.empty() ? "" : bad.front());
  EXPECT_GT(reads.load(), kReaders);
  // The last change is what every thread sees afterwards (i = kChanges - 1: bw, no allreduce rules, broadcast's).
  Tuner want(bw);
  want.force(CollOp::broadcast, (kChanges - 1) % 5 == 0 ? bc_rules : std::vector<ForceRule>{});
  EXPECT_EQ(shared.model().source, bw.source);
  EXPECT_FALSE(shared.forced_at(CollOp::allreduce, 100));
  for (const auto& q : queries)
    EXPECT_EQ(std::apply([&](auto... x) { return shared.choose(x...); }, q),
              std::apply([&](auto... x) { return want.choose(x...); }, q));
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
