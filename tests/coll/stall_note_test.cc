// A connection held over the budget for unexpected messages (CONDUIT_TCP_UNEXPECTED_BYTES,
// CONDUIT_SHM_UNEXPECTED_BYTES) says so when a wait on that peer reaches its deadline: the message it waits for may
// sit behind the held one, and the timeout said only that nothing came.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "net/tags.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

class HeldConnection : public ::testing::TestWithParam<const char*> {};

// Rank 0 runs ahead: A (900 bytes, tag a) is buffered by rank 1, B (2400 bytes, tag b) is over 4x the 1K budget
// (a receive of another tag waits), and D, which rank 1 waits for, is behind B. The wait times out (D never comes
// out of the socket or ring), naming the variable, B's size and tag and the bytes buffered.
TEST_P(HeldConnection, ATimeoutNamesTheBudgetAndTheHeldMessage) {
  const std::string kind = GetParam();
  const std::string var = kind == "tcp" ? "CONDUIT_TCP_UNEXPECTED_BYTES" : "CONDUIT_SHM_UNEXPECTED_BYTES";
  constexpr size_t kA = 900, kB = 2400;
  std::vector<char> sa(kA, 'a'), sb(kB, 'b'), ra(kA), rb(kB);  // (outlive the transports)
  int64_t sd = 7, rd = -1;
  setenv(var.c_str(), "1K", 1);
  setenv("CONDUIT_SHM_RING_BYTES", "4K", 1);
  std::vector<TransportPtr> t;
  try {
    t = test_util::make_transport_pair(kind);
  } catch (...) {
    unsetenv(var.c_str());
    unsetenv("CONDUIT_SHM_RING_BYTES");
    throw;
  }
  unsetenv(var.c_str());
  unsetenv("CONDUIT_SHM_RING_BYTES");
  const uint64_t a = make_tag(kUser, 0, 1), b = make_tag(kUser, 0, 2), d = make_tag(kUser, 0, 3);
  auto wait_d = t[1]->irecv(0, d, &rd, sizeof rd);
  auto send_a = t[0]->isend(1, a, sa.data(), kA);
  auto send_b = t[0]->isend(1, b, sb.data(), kB);
  auto send_d = t[0]->isend(1, d, &sd, sizeof sd);
  const auto t0 = std::chrono::steady_clock::now();
  std::string e = "no error";
  try {
    wait_d->wait(Deadline::after(1.0));
  } catch (const TimeoutError& err) {
    e = err.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_NE(e.find("did not complete before the deadline"), std::string::npos) << e;
  EXPECT_NE(e.find(var + "=1024"), std::string::npos) << e;
  EXPECT_NE(e.find(kind + ": the messages from rank 0 are held: its next message (2400 bytes, tag " +
                   fmt::format("{:#x}", b) + ")"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("1796 bytes of its earlier messages"), std::string::npos) << e;  // A with its overhead
  EXPECT_NE(t[1]->peer_note(0), "") << "(the transport keeps the note while rank 0 is held)";
  // Receiving A and B lets D through (into the receive that timed out: it stays posted), and the note goes with the
  // stall.
  t[1]->irecv(0, a, ra.data(), kA)->wait(Deadline::after(10));
  t[1]->irecv(0, b, rb.data(), kB)->wait(Deadline::after(10));
  EXPECT_EQ(ra, sa);
  EXPECT_EQ(rb, sb);
  wait_d->wait(Deadline::after(10));
  EXPECT_EQ(rd, sd);
  EXPECT_EQ(t[1]->peer_note(0), "");
  for (auto& s : {send_a, send_b, send_d}) s->wait(Deadline::after(10));
}

INSTANTIATE_TEST_SUITE_P(Transports, HeldConnection, ::testing::Values("tcp", "shm"));

}  // namespace
