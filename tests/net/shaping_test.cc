// The tc commands `conduit cluster up` shapes a link with (cli/cluster.h's shape_commands), and the line it reports
// of a tool that failed: pure functions, checked without root. (The htb+netem path cannot run on a kernel without
// netem, the development machine's: its arguments are checked here.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cli/cluster.h"

namespace {

namespace cl = conduit::cli::cluster;

// The value after `key` in argv; -1 when it is not there.
long long arg_after(const std::vector<std::string>& argv, const std::string& key) {
  const auto it = std::find(argv.begin(), argv.end(), key);
  return it == argv.end() || it + 1 == argv.end() ? -1 : std::stoll(*(it + 1));
}

bool holds(const std::vector<std::string>& argv, const std::string& word) {
  return std::find(argv.begin(), argv.end(), word) != argv.end();
}

TEST(LinkShaping, RateAloneIsOneTbfWithFiftyMillisecondsOfQueue) {
  const auto cmds = cl::shape_commands("ns", "eth0", 100e6, 0, 0);
  ASSERT_EQ(cmds.size(), 1u);
  EXPECT_TRUE(holds(cmds[0], "tbf"));
  EXPECT_EQ(arg_after(cmds[0], "burst"), 12500);           // 1 ms of 100 Mbit/s
  EXPECT_EQ(arg_after(cmds[0], "limit"), 12500 + 625000);  // the burst and 50 ms of the rate
  EXPECT_TRUE(cl::shape_commands("ns", "eth0", 0, 0, 0).empty());
}

// Below 36.3 Mbit/s the burst of three frames is more than 1 ms of the rate (4.5 s at 8 kbit/s), and tbf let it
// through at the veth's speed after every pause: a 4,000-byte message crossed 200 kbit/s in 0.3 ms instead of 167.
// There tbf gets a peak rate a tenth above the rate over a bucket of one full frame (tc's `mtu`: a frame larger than
// it would be dropped); from 36.3 Mbit/s, where the burst is 1 ms of the rate, none (a peak rate held 39-55% of
// 1 Gbit/s).
TEST(LinkShaping, SlowLinksGetAPeakRateOverOneFrame) {
  for (const double rate : {8e3, 200e3, 1e6, 10e6, 36e6}) {
    const auto cmds = cl::shape_commands("ns", "eth0", rate, 0, 0);
    ASSERT_EQ(cmds.size(), 1u) << rate;
    EXPECT_EQ(arg_after(cmds[0], "burst"), 3 * 1514) << rate;
    const auto peak = std::find(cmds[0].begin(), cmds[0].end(), "peakrate");
    ASSERT_NE(peak, cmds[0].end()) << rate;
    ASSERT_NE(peak + 1, cmds[0].end()) << rate;
    const std::string p = *(peak + 1);
    ASSERT_EQ(p.substr(p.size() - 3), "bit") << p;
    const double peak_bps = std::stod(p.substr(0, p.size() - 3));
    EXPECT_GT(peak_bps, rate) << p;  // (tc refuses a peak rate at or below the rate)
    EXPECT_LE(peak_bps, 1.1 * rate + 1) << p;
    EXPECT_EQ(arg_after(cmds[0], "mtu"), 1514) << rate;
    // A message after a pause: one frame at the veth's speed, the rest at most at the peak rate, so 4,000 bytes
    // (2,486 past the frame) take at least 90% of what they take past that frame at the rate.
    EXPECT_GE((4000.0 - 1514) * 8 / peak_bps, 0.9 * (4000.0 - 1514) * 8 / rate) << rate;
  }
  for (const double rate : {36.4e6, 100e6, 1e9, 10e9}) {
    const auto cmds = cl::shape_commands("ns", "eth0", rate, 0, 0);
    ASSERT_EQ(cmds.size(), 1u) << rate;
    EXPECT_FALSE(holds(cmds[0], "peakrate")) << rate;
    EXPECT_FALSE(holds(cmds[0], "mtu")) << rate;
    EXPECT_GE(arg_after(cmds[0], "burst") * 8, static_cast<long long>(rate * 0.001)) << rate;
  }
}

// With latency, the backlog waiting for htb's tokens sits in the netem leaf: its limit (packets) is the delay line
// plus the tbf path's queue in full frames. A floor of 100,000 packets let a 100 Mbit/s link with latency queue
// 151 MB, 12 s of its rate, where the tbf path queues 50 ms (an audit).
TEST(LinkShaping, NetemUnderHtbQueuesWhatTbfQueuesBesideItsDelayLine) {
  for (const double rate : {8e3, 10e6, 100e6, 1e9, 10e9}) {
    for (const double delay : {0.0, 0.0005, 0.005, 0.1, 5.0}) {
      const auto cmds = cl::shape_commands("ns", "eth0", rate, delay, delay > 0 ? 0 : 0.01);
      const std::string at = std::to_string(rate) + " bit/s, " + std::to_string(delay) + " s";
      ASSERT_EQ(cmds.size(), 3u) << at;
      EXPECT_TRUE(holds(cmds[0], "htb")) << at;
      EXPECT_TRUE(holds(cmds[2], "netem")) << at;
      const long long tbf_limit = arg_after(cl::shape_commands("ns", "eth0", rate, 0, 0)[0], "limit");
      const long long line = static_cast<long long>(std::ceil(1.5 * rate * delay / (1514 * 8)));
      const long long limit = arg_after(cmds[2], "limit");
      EXPECT_EQ(limit, line + (tbf_limit + 1513) / 1514) << at;
      // Full frames: the queue holds what tbf's does, within one frame.
      EXPECT_GE((limit - line) * 1514, tbf_limit) << at;
      EXPECT_LT((limit - line - 1) * 1514, tbf_limit) << at;
      // The same rate and burst as the tbf path, and an explicit quantum (at least a frame, at most 200,000): without
      // one, tc prints "Warning: sch_htb: quantum of class ... is big" above 16 Mbit/s.
      EXPECT_EQ(arg_after(cmds[1], "burst"), arg_after(cl::shape_commands("ns", "eth0", rate, 0, 0)[0], "burst"));
      const long long quantum = arg_after(cmds[1], "quantum");
      EXPECT_GE(quantum, 1514) << at;
      EXPECT_LE(quantum, 200000) << at;
    }
  }
  // 100 Mbit/s with 5 ms each way: 62 frames of delay line and 422 of queue (637,500 bytes).
  EXPECT_EQ(arg_after(cl::shape_commands("ns", "eth0", 100e6, 0.005, 0)[2], "limit"), 62 + 422);
  // Unshaped (netem alone, nothing waits but for the delay): the delay line, at least 100,000.
  const auto bare = cl::shape_commands("ns", "eth0", 0, 0.005, 0);
  ASSERT_EQ(bare.size(), 1u);
  EXPECT_EQ(arg_after(bare[0], "limit"), 100000);
}

// A failing tool's reason, not the warning tc prints before it.
TEST(LinkShaping, AFailedToolIsReportedByItsError) {
  const std::string warning = "Warning: sch_htb: quantum of class 10001 is big. Consider r2q change.";
  EXPECT_EQ(cl::tool_error_line(warning + "\nError: Specified qdisc kind is unknown.\n"),
            "Error: Specified qdisc kind is unknown.");
  EXPECT_EQ(cl::tool_error_line(warning + "\nRTNETLINK answers: File exists\n"), "RTNETLINK answers: File exists");
  EXPECT_EQ(cl::tool_error_line("first\nError: second\n"), "Error: second");
  EXPECT_EQ(cl::tool_error_line("\n  " + warning + "  \n"), warning);
  EXPECT_EQ(cl::tool_error_line(""), "");
}

}  // namespace
