// Every bad scheme name, parameter and value gives one ConfigError line naming it and what is allowed.
#include <gtest/gtest.h>
#include <time.h>

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
      {"diloco", "momentum", "1", "'momentum'"},
      {"easgd", "alpha", "2", "'alpha'"},
      {"dpsgd", "graph", "star", "ring, torus, exponential"},
      {"dpsgd", "rows", "3", "torus rows"},
      {"dpsgd", "compressor", "zip", "zip"},
      {"sgp", "peers", "0", "'peers'"},
      {"ps-ssp", "staleness", "-1", "'staleness'"},
      {"ps-asp", "servers", "0", "'servers'"},
      {"ps-bsp", "lr", "x", "'lr'"},
      {"ps-asp", "push_compressor", "powersgd", "needs a collective"},
      {"ps-asp", "servers", "1", "leaves no worker"},
  };
  for (const auto& c : cases) {
    Params p = {{c.key, c.value}};
    if (c.key == "rows") p["graph"] = "torus";
    if (c.key == "push_compressor") p["colocate"] = "1";
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
  EXPECT_EQ(f[1], 3.0);
  EXPECT_EQ(f[2], 1.5);
  EXPECT_TRUE(parse_slow("").empty());
  for (auto bad : {"1", "1:", ":3", "a:3", "1:x", "1:0.5", "-1:2", "9:2", "1:2,1:3", "1:2;2:3"}) {
    auto m = config_error([&] { parse_slow(bad, 4); });
    EXPECT_NE(m.find("--slow"), std::string::npos) << bad << ": " << m;
  }
}

TEST(SyncStraggler, SleepsFactorMinusOneTimesTheComputesCpuTime) {
  Straggler fast(parse_slow("1:3"), 0), slow(parse_slow("1:3"), 1);
  EXPECT_EQ(fast.factor(), 1.0);
  fast.begin();
  EXPECT_EQ(fast.end(), 0.0);
  // 20 ms of CPU work on this thread: the straggler sleeps about twice that.
  auto busy = [](double seconds) {
    timespec t0{}, t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
    volatile double x = 1;
    do {
      for (int i = 0; i < 1000; ++i) x = x * 1.0000001 + 1e-9;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    } while (double(t.tv_sec - t0.tv_sec) + 1e-9 * double(t.tv_nsec - t0.tv_nsec) < seconds);
  };
  slow.begin();
  busy(0.02);
  Stopwatch sw;
  double s = slow.end();
  EXPECT_GE(s, 0.039);
  EXPECT_GE(sw.seconds(), 0.039);
  EXPECT_LT(s, 0.2);
  // Time spent off the CPU (waiting for a core, or here sleeping) is not compute and is not multiplied.
  slow.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LT(slow.end(), 0.02);
  EXPECT_NEAR(slow.slept_seconds(), s, 0.02);
}

}  // namespace
