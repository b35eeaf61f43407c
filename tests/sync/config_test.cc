// Every bad scheme name, parameter and value gives one ConfigError line naming it and what is allowed.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "harness.h"
#include "sync/straggler.h"

using namespace conduit;
using namespace conduit::sync;

namespace {

std::string config_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ConfigError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no error";
  return "";
}

const std::vector<coll::CommPtr>& one_rank() {
  static const auto c = harness::make_comms(1);
  return c;
}
#define kComms one_rank()

TEST(SyncConfig, UnknownSchemeListsEverySchemeOnOneLine) {
  auto m = config_error([] { make_strategy("gossip", {}, kComms[0]); });
  EXPECT_NE(m.find("'gossip'"), std::string::npos) << m;
  for (auto n : {"bsp", "local", "ps-asp", "ps-ssp", "ps-bsp", "dpsgd", "adpsgd", "sgp", "easgd", "diloco"})
    EXPECT_NE(m.find(n), std::string::npos) << n << " missing in: " << m;
  EXPECT_EQ(strategy_names().size(), 10u);
}

TEST(SyncConfig, UnknownParameterListsTheAllowedOnes) {
  for (const auto& name : strategy_names()) {
    auto m = config_error([&] { make_strategy(name, {{"bogus", "1"}}, kComms[0]); });
    EXPECT_NE(m.find("'bogus'"), std::string::npos) << m;
    for (const auto& [k, v] : strategy_defaults(name)) EXPECT_NE(m.find(k), std::string::npos) << k << " in " << m;
  }
  auto m = config_error([] { make_strategy("bsp", {{"period", "2"}}, kComms[0]); });
  EXPECT_NE(m.find("allowed: none"), std::string::npos) << m;
}

TEST(SyncConfig, BadValuesNameTheParameterAndRange) {
  struct Case {
    std::string name, key, value, expect;
  };
  std::vector<Case> cases = {
      {"local", "period", "0", "'period'"},
      {"local", "period", "abc", "integer"},
      {"local", "adaptive", "yes", "one of"},
      {"local", "target", "-1", "'target'"},
      {"diloco", "outer_lr", "nan", "'outer_lr'"},
      {"diloco", "outer_lr", "0", "'outer_lr'"},  // 0 never moves the outer model: no training at all
      {"diloco", "momentum", "1", "'momentum'"},
      {"easgd", "alpha", "2", "'alpha'"},
      {"easgd", "alpha", "1e-300", "sync easgd: alpha = 1e-300 is 0 in f32, where it is applied (no elastic force"},
      // Underflow to 0 (which for alpha means the default, the strongest pull; for dc, no compensation) and hex.
      {"easgd", "alpha", "1e-400", "sync easgd: parameter 'alpha' = '1e-400' is too small for a double"},
      {"ps-asp", "dc", "1e-400", "parameter 'dc' = '1e-400' is too small for a double"},
      {"easgd", "alpha", "0x0.1", "must be a number in"},
      {"dpsgd", "graph", "star", "ring, torus, exponential"},
      {"dpsgd", "rows", "3", "torus rows"},
      {"dpsgd", "compressor", "zip", "sync dpsgd: compressor 'zip': "},
      // A bad compressor of a scheme says which field it is (push and pull gave the same line).
      {"ps-asp", "push_compressor", "topk:ratio=2", "sync ps: push_compressor 'topk:ratio=2': "},
      {"ps-asp", "pull_compressor", "topk:ratio=2", "sync ps: pull_compressor 'topk:ratio=2': "},
      {"sgp", "peers", "0", "'peers'"},
      {"ps-ssp", "staleness", "-1", "'staleness'"},
      {"ps-asp", "servers", "0", "'servers'"},
      {"ps-bsp", "lr", "x", "'lr'"},
      {"ps-asp", "push_compressor", "powersgd", "needs a collective"},
      // Servers sum pushes and own the momentum (an audit: signsgd's signs were averaged into the servers' momentum,
      // train loss 346 after 5 steps; dgc's and signum's momentum stacked on theirs).
      {"ps-bsp", "push_compressor", "signsgd", "'signsgd' is a majority vote of the ranks' signs, which servers"},
      {"ps-asp", "push_compressor", "signum:momentum=0.5", "is a majority vote of the ranks' signs of their own"},
      {"ps-ssp", "push_compressor", "dgc", "'dgc' keeps its own momentum (momentum correction)"},
      // A pull moves the worker's copy by the decoded difference (review: unbiased randk and ef:topk were accepted
      // and drove the copies 3e8 and 889 off the servers' parameters).
      {"ps-asp", "pull_compressor", "randk:ratio=0.1", "sync ps: pull_compressor 'randk:ratio=0.1': the pull"},
      {"ps-ssp", "pull_compressor", "ef:topk:ratio=0.1", "has error feedback or momentum of its own"},
      {"ps-bsp", "pull_compressor", "signsgd", "smaller than its input"},
      {"ps-asp", "servers", "1", "leaves no worker"},
      {"dpsgd", "seed", "99999999999999999999", "must be an integer"},
      {"ps-asp", "servers", "65", "servers = 65 puts 65 shards on a rank of 1; allowed: at most 64 a rank"},
  };
  for (const auto& c : cases) {
    Params p = {{c.key, c.value}};
    if (c.key == "rows") p["graph"] = "torus";
    if (c.key == "push_compressor" || c.key == "pull_compressor" || c.value == "65") p["colocate"] = "1";
    auto m = config_error([&] {
      auto comms = c.key == "rows" ? harness::make_comms(4) : kComms;
      make_strategy(c.name, p, comms[0]);
    });
    EXPECT_NE(m.find(c.expect), std::string::npos) << c.name << " " << c.key << "=" << c.value << ": " << m;
  }
}

TEST(SyncConfig, ParseSpec) {
  auto s = parse_strategy("local:period=3,warmup=5", kComms[0]);
  EXPECT_EQ(s->name(), "local");
  auto m = config_error([] { parse_strategy("local:period", kComms[0]); });
  EXPECT_NE(m.find("key=value"), std::string::npos) << m;
}

TEST(SyncConfig, StragglerFlag) {
  auto f = parse_slow("1:3,2:1.5", 4);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[1], (Slowdown{3.0, 1.0}));
  EXPECT_EQ(f[2], (Slowdown{1.5, 1.0}));
  EXPECT_TRUE(parse_slow("").empty());
  auto t = parse_slow("*:3@0.25,0:2@1", 4);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[kEveryRank], (Slowdown{3.0, 0.25}));
  EXPECT_EQ(t[0], (Slowdown{2.0, 1.0}));
  for (auto bad : {"1", "1:", ":3", "a:3", "1:x", "1:0.5", "-1:2", "9:2", "1:2,1:3", "1:2;2:3", "1:3@", "1:3@0",
                   "1:3@1.5", "1:3@x", "**:3", "*:3,*:2", "1@0.5:3", "*",
                   // (decimal only, as the scheme parameters: these ran, 0x10 as a factor of 16)
                   " 1:3", "1:3, 2:2", "+1:3", "1:0x10", "1:+3", "1:3@+0.5", "1:inf"}) {
    auto m = config_error([&] { parse_slow(bad, 4); });
    EXPECT_NE(m.find("--slow"), std::string::npos) << bad << ": " << m;
  }
  // Without a world size: a rank past an int (4294967295 became -1, the every-rank key) or past a long.
  for (auto bad : {"4294967295:3", "99999999999999999999:3"}) {
    auto m = config_error([&] { parse_slow(bad); });
    EXPECT_NE(m.find("is not in [0,"), std::string::npos) << bad << ": " << m;
  }
}

TEST(SyncStraggler, TransientSlowdownsHitTheirShareOfStepsTheSameWayForTheSameSeed) {
  const auto plan = parse_slow("*:3@0.25,2:4", 4);
  auto slowed_steps = [&](int rank, uint64_t seed) {
    Straggler s(plan, rank, seed);
    std::vector<bool> out;
    for (int i = 0; i < 400; ++i) {
      s.begin();
      out.push_back(s.slowed());
      s.end();
    }
    EXPECT_EQ(s.slowed_steps(), std::count(out.begin(), out.end(), true));
    return out;
  };
  const auto a = slowed_steps(0, 42), b = slowed_steps(1, 42), again = slowed_steps(0, 42), other = slowed_steps(0, 7);
  const auto n = [](const std::vector<bool>& v) { return std::count(v.begin(), v.end(), true); };
  // 400 draws at p = 0.25: 100 expected, standard deviation 8.7.
  EXPECT_GE(n(a), 60);
  EXPECT_LE(n(a), 140);
  EXPECT_GE(n(b), 60);
  EXPECT_LE(n(b), 140);
  EXPECT_EQ(a, again);                     // reproducible per seed and rank
  EXPECT_NE(a, b);                         // independent across ranks
  EXPECT_NE(a, other);                     // and across seeds
  EXPECT_EQ(n(slowed_steps(2, 42)), 400);  // a rank named on its own overrides *: persistent
  // A resumed run slows the steps the uninterrupted one would have (its draws restarted at step 0).
  Straggler resumed(plan, 0, 42);
  resumed.skip(150);
  for (int i = 150; i < 400; ++i) {
    resumed.begin();
    EXPECT_EQ(resumed.slowed(), a[size_t(i)]) << i;
    resumed.end();
  }
  Straggler never(parse_slow("1:3"), 0, 42);
  never.begin();
  EXPECT_FALSE(never.slowed());
  EXPECT_EQ(never.end(), 0.0);
}

TEST(SyncStraggler, AStepTakesFactorTimesTheComputesCpuTime) {
  Straggler fast(parse_slow("1:3"), 0), slow(parse_slow("1:3"), 1);
  EXPECT_EQ(fast.factor(), 1.0);
  fast.begin();
  EXPECT_EQ(fast.end(), 0.0);
  auto cpu_now = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  auto busy = [&](double seconds) {
    const double t0 = cpu_now();
    volatile double x = 1;
    do {
      for (int i = 0; i < 1000; ++i) x = x * 1.0000001 + 1e-9;
    } while (cpu_now() - t0 < seconds);
  };
  // 20 ms of CPU work: the step (compute + sleep) lasts at least 3 x the CPU time used, and the sleep is at most
  // twice it (on a busy machine the compute's wall time exceeds its CPU time and the sleep is shorter).
  Stopwatch sw;
  const double c0 = cpu_now();
  slow.begin();
  busy(0.02);
  const double cpu = cpu_now() - c0;
  const double s = slow.end();
  EXPECT_GE(sw.seconds(), 3 * cpu - 0.002);
  EXPECT_LE(s, 2 * cpu + 0.001);
  // Time off the CPU (waiting for a core; here a sleep) is part of the emulated slowness, not added to it: 20 ms of
  // CPU and 30 ms off it make a 50 ms step that a 3x device would finish at 60 ms, so about 10 ms more, not 40.
  Stopwatch sw2;
  const double c1 = cpu_now();
  slow.begin();
  busy(0.02);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const double cpu2 = cpu_now() - c1;
  const double s2 = slow.end();
  EXPECT_GE(sw2.seconds(), 3 * cpu2 - 0.002);
  EXPECT_LT(s2, 2 * cpu2 - 0.025);
  // A step that spent its time off the CPU is not slowed further.
  slow.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LT(slow.end(), 0.005);
  EXPECT_NEAR(slow.slept_seconds(), s + s2, 0.006);
}

}  // namespace

TEST(SyncConfig, EasgdAlphaThatDivergesAndPowerSgdForGossipAreRefused) {
  // With n workers each round scales the gap between their mean and the centre by 1 - (n+1) alpha: alpha = 1 with
  // 2 workers reached an inf loss at step 24. Allowed: alpha < 2/(n+1).
  static const auto two = harness::make_comms(2);
  auto m = config_error([] { make_strategy("easgd", {{"alpha", "1"}}, two[0]); });
  EXPECT_NE(m.find("alpha = 1 diverges with 2 workers"), std::string::npos) << m;
  EXPECT_NE(m.find("2/(n+1) = 0.6667"), std::string::npos) << m;
  EXPECT_NO_THROW(make_strategy("easgd", {{"alpha", "0.6"}}, two[0]));
  EXPECT_NO_THROW(make_strategy("easgd", {}, two[0]));  // 0.9/n
  // CHOCO gossip compresses one flat buffer: PowerSGD would have no matrix and send it raw.
  m = config_error([] { make_strategy("dpsgd", {{"compressor", "powersgd"}}, kComms[0]); });
  EXPECT_NE(m.find("needs the layers' matrices"), std::string::npos) << m;
  EXPECT_NO_THROW(make_strategy("dpsgd", {{"compressor", "topk:ratio=0.1"}}, kComms[0]));
}

// Found by an audit: parameter servers start a thread per (shard on the rank, other worker), with no limit but the 64
// shards a rank: up to 64 (n - 1), and a process out of threads failed setup() with std::system_error "Resource
// temporarily unavailable", naming nothing. Refused when built, before any thread starts; the largest allowed passes.
TEST(SyncConfig, ParameterServersServingThreadsARankAreBounded) {
  const auto forty = harness::make_comms(40);  // 27 shards a rank x 39 others = 1053; 26 x 39 = 1014
  std::string m = config_error([&] { make_strategy("ps-asp", {{"servers", "1080"}, {"colocate", "1"}}, forty[0]); });
  EXPECT_NE(m.find("sync ps-asp: servers = 1080 co-located on 40 ranks start 27 shards x 39 other workers = 1053 "
                   "serving threads on a rank; allowed: at most 1024 a rank (servers <= 1040)"),
            std::string::npos)
      << m;
  EXPECT_NO_THROW(make_strategy("ps-asp", {{"servers", "1040"}, {"colocate", "1"}}, forty[0]));
  // Dedicated servers: a thread per worker, whatever the number of servers.
  const auto many = harness::make_comms(1030);
  m = config_error([&] { make_strategy("ps-bsp", {{"servers", "5"}}, many[0]); });
  EXPECT_NE(m.find("sync ps-bsp: servers = 5 dedicated of 1030 ranks serve 1025 workers each, a thread per worker; "
                   "allowed: at most 1024 serving threads a rank (servers >= 6)"),
            std::string::npos)
      << m;
  EXPECT_NO_THROW(make_strategy("ps-bsp", {{"servers", "6"}}, many[0]));
  // Co-located on more ranks than that: not even one shard a rank.
  m = config_error([&] { make_strategy("ps-bsp", {{"servers", "1030"}, {"colocate", "1"}}, many[0]); });
  EXPECT_NE(m.find("= 1029 serving threads on a rank; allowed: at most 1024 a rank (colocate=0 with servers >= 6)"),
            std::string::npos)
      << m;
}

// Found by a review of the gossip schemes: CHOCO-gossip with a compressor whose error exceeds its input (signs
// without a scale, unbiased random-k, QSGD over the whole buffer, TernGrad) or that keeps error feedback of its own
// diverged (signsgd: loss 2.3 to 51016 in one step; ef:topk: 2725 after 3 epochs); sgp's peers above the distinct
// offsets, local SGD's max_period below its period and dpsgd's rows on a ring were bent or ignored without a word.
TEST(SyncConfig, GossipCompressorsMustShrinkTheirInputAndParametersMustApply) {
  for (const char* bad :
       {"signsgd", "signum", "randk:ratio=0.1", "qsgd", "terngrad", "ef:topk:ratio=0.1", "efsignsgd", "onebit"}) {
    const std::string m = config_error([&] { make_strategy("dpsgd", {{"compressor", bad}}, kComms[0]); });
    EXPECT_NE(m.find(std::string("sync dpsgd: compressor '") + bad + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("allowed: "), std::string::npos) << m;
  }
  EXPECT_NE(config_error([] {
              make_strategy("dpsgd", {{"compressor", "randk:ratio=0.1"}}, kComms[0]);
            }).find("allowed: randk:unbiased=0"),
            std::string::npos);
  // An example with parameters comes in brackets, as a scheme's parameter is written.
  const std::string qsgd = config_error([] { make_strategy("dpsgd", {{"compressor", "qsgd"}}, kComms[0]); });
  EXPECT_NE(qsgd.find("(e.g. [qsgd:levels="), std::string::npos) << qsgd;
  EXPECT_NE(qsgd.find("])"), std::string::npos) << qsgd;
  for (const char* good : {"topk:ratio=0.1", "randk:ratio=0.1,unbiased=0", "int8", "uint8", "fp16", "scaled_sign",
                           "natural", "threshold", "qsgd:levels=127,bucket=1024"})
    EXPECT_NO_THROW(make_strategy("dpsgd", {{"compressor", good}}, kComms[0])) << good;

  static const auto four = harness::make_comms(4);
  auto m = config_error([] { make_strategy("sgp", {{"peers", "3"}}, four[0]); });
  EXPECT_NE(m.find("sync sgp: peers = 3 with 4 workers; allowed: 1 to 2"), std::string::npos) << m;
  EXPECT_NO_THROW(make_strategy("sgp", {{"peers", "2"}}, four[0]));
  m = config_error([] { make_strategy("local", {{"period", "16"}, {"max_period", "4"}, {"adaptive", "1"}}, four[0]); });
  EXPECT_NE(m.find("max_period = 4 is below period = 16"), std::string::npos) << m;
  // Settings of no effect are refused, not taken without a word (an audit: not adaptive, max_period and target
  // changed nothing; plain gossip has no step size and draws nothing).
  m = config_error([] { make_strategy("local", {{"period", "16"}, {"max_period", "4"}}, four[0]); });
  EXPECT_NE(m.find("sync local: max_period = 4 steers the adaptive period, which is off; allowed: adaptive=1"),
            std::string::npos)
      << m;
  m = config_error([] { make_strategy("local", {{"target", "0.1"}}, four[0]); });
  EXPECT_NE(m.find("sync local: target = 0.1 steers the adaptive period"), std::string::npos) << m;
  EXPECT_NO_THROW(make_strategy("local", {{"target", "0.1"}, {"adaptive", "1"}}, four[0]));
  // A checkpoint records every parameter, defaults included, and a resume gives them back: those pass.
  EXPECT_NO_THROW(make_strategy("local", {{"period", "2"}, {"max_period", "64"}, {"target", "0.01"}}, four[0]));
  EXPECT_NO_THROW(make_strategy("dpsgd", {{"gamma", "0.5"}, {"seed", "0"}}, four[0]));
  EXPECT_NO_THROW(make_strategy("local", {{"max_period", "064"}, {"target", "0.010"}}, four[0]));  // (as numbers)
  EXPECT_NO_THROW(make_strategy("dpsgd", {{"gamma", "0.50"}, {"seed", "00"}}, four[0]));
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"64", "064"}, {"0.5", "0.50"}, {"0.01", "1e-2"}, {"false", "0"}, {"true", "1"}, {"ring", "ring"}})
    EXPECT_TRUE(same_param_value(a, b)) << a << " " << b;
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"64", "65"}, {"true", "0"}, {"ring", "torus"}, {"1x", "1"}, {"", "0"}})
    EXPECT_FALSE(same_param_value(a, b)) << a << " " << b;
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"gamma", "0.25"}, {"seed", "7"}}) {
    m = config_error([k, v] { make_strategy("dpsgd", {{k, v}}, four[0]); });
    EXPECT_NE(m.find(fmt::format("sync dpsgd: {} = {} applies to compressed (CHOCO) gossip", k, v)), std::string::npos)
        << m;
  }
  EXPECT_NO_THROW(make_strategy("dpsgd", {{"gamma", "0.25"}, {"seed", "3"}, {"compressor", "topk"}}, four[0]));
  m = config_error([] { make_strategy("dpsgd", {{"graph", "ring"}, {"rows", "2"}}, four[0]); });
  EXPECT_NE(m.find("rows = 2 applies to graph=torus, not graph=ring"), std::string::npos) << m;
  m = config_error([] { make_strategy("dpsgd", {{"graph", "torus"}, {"rows", "3"}}, four[0]); });
  EXPECT_NE(m.find("allowed: 0 (the most square grid) or 1, 2, 4"), std::string::npos) << m;
}

// Found by an audit: an empty compressor (`ps-asp:push_compressor=`, `dpsgd:compressor=`, YAML's '') ran uncompressed
// without a word, as if it said none.
TEST(SyncConfig, AnEmptyCompressorIsRefusedNotTakenForNone) {
  const std::string allowed = "is empty; allowed: none or a compressor spec (";
  for (const char* field : {"push_compressor", "pull_compressor"}) {
    auto m = config_error([field] { make_strategy("ps-asp", {{"colocate", "1"}, {field, ""}}, kComms[0]); });
    EXPECT_NE(m.find(fmt::format("sync ps: {} {}", field, allowed)), std::string::npos) << m;
    EXPECT_NE(m.find("topk"), std::string::npos) << m;
  }
  auto m = config_error([] { make_strategy("dpsgd", {{"compressor", ""}}, kComms[0]); });
  EXPECT_NE(m.find("sync dpsgd: compressor " + allowed), std::string::npos) << m;
  // The spec form a command line gives, and none still meaning none.
  m = config_error([] { parse_strategy("ps-ssp:colocate=1,push_compressor=", kComms[0]); });
  EXPECT_NE(m.find("push_compressor " + allowed), std::string::npos) << m;
  EXPECT_NO_THROW(make_strategy("ps-asp", {{"colocate", "1"}, {"push_compressor", "none"}}, kComms[0]));
  EXPECT_NO_THROW(make_strategy("dpsgd", {{"compressor", "none"}}, kComms[0]));
}
