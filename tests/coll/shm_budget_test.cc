// shm's per-peer budget for messages that arrive before their receive (CONDUIT_SHM_UNEXPECTED_BYTES): its checks,
// and, with a budget small enough to fill, what happens at its edge.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/shm.h"
#include "net/tags.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

// Sets the shm variables for the transports built in its scope: rings of 4 KiB, and a budget of `budget`.
struct SmallShm {
  explicit SmallShm(const char* budget) {
    setenv("CONDUIT_SHM_RING_BYTES", "4K", 1);
    setenv("CONDUIT_SHM_UNEXPECTED_BYTES", budget, 1);
  }
  ~SmallShm() {
    unsetenv("CONDUIT_SHM_RING_BYTES");
    unsetenv("CONDUIT_SHM_UNEXPECTED_BYTES");
  }
};

std::string shm_setup_error(const char* value) {
  setenv("CONDUIT_SHM_UNEXPECTED_BYTES", value, 1);
  std::string e = "no error";
  try {
    check_shm_environment();
  } catch (const ConfigError& err) {
    e = err.what();
  }
  unsetenv("CONDUIT_SHM_UNEXPECTED_BYTES");
  return e;
}

// As CONDUIT_TCP_UNEXPECTED_BYTES: a size from 0 to 1T, else one line naming the variable and what is allowed, at
// start-up (check_shm_environment, which Communicator::from_env calls whatever the transport) and when a transport
// is built.
TEST(ShmUnexpectedBudget, ABadValueIsRefusedNamingTheVariable) {
  EXPECT_EQ(shm_setup_error("0"), "no error");
  EXPECT_EQ(shm_setup_error("1T"), "no error");
  EXPECT_EQ(shm_setup_error("64K"), "no error");
  for (const char* bad : {"abc", "-1", "1.5x"}) {
    const std::string e = shm_setup_error(bad);
    EXPECT_NE(e.find(std::string("CONDUIT_SHM_UNEXPECTED_BYTES '") + bad + "' is not a size"), std::string::npos) << e;
    EXPECT_NE(e.find("; allowed: 0 to 1T"), std::string::npos) << e;
  }
  EXPECT_NE(shm_setup_error("2T").find("CONDUIT_SHM_UNEXPECTED_BYTES=2T is more than 1T; allowed: 0 to 1T"),
            std::string::npos);
  setenv("CONDUIT_SHM_UNEXPECTED_BYTES", "2T", 1);
  std::string e = "no error";
  try {
    test_util::make_transport_pair("shm");
  } catch (const Error& err) {
    e = err.what();
  }
  unsetenv("CONDUIT_SHM_UNEXPECTED_BYTES");
  EXPECT_NE(e.find("CONDUIT_SHM_UNEXPECTED_BYTES=2T is more than 1T; allowed: 0 to 1T"), std::string::npos) << e;
}

// Rank 1 buffers message A (tag a) up to its budget; message B behind it is over the budget with no receive of its
// tag, so it waits in the ring, and the ring fills: rank 0's send of C waits for space. A receive of A posted on rank
// 1 frees the budget, and must read on (B into the budget, C's bytes out of the ring) and ring rank 0, though no
// thread of rank 1 waits on anything: rank 0's send of C completes. (Before 2026-12-07, post_recv returned as soon as
// it took A, and rank 0 waited until rank 1 next made progress: here, for ever. A 64 MiB budget, all there was,
// left this untested.)
TEST(ShmUnexpectedBudget, AReceiveThatFreesTheBudgetLetsAStalledSenderGoOn) {
  SmallShm small("4K");
  auto t = test_util::make_transport_pair("shm");
  ASSERT_TRUE(t[0] && t[1]);
  auto* p0 = dynamic_cast<Progressor*>(t[0].get());
  auto* p1 = dynamic_cast<Progressor*>(t[1].get());
  ASSERT_TRUE(p0 && p1);
  // Each 3000 bytes: one buffered (3000 + 128 + 768 of the budget's 4096) leaves no room for the next, and with 32
  // bytes of frame header two do not fit a 4 KiB ring.
  constexpr size_t kBytes = 3000;
  const uint64_t a = make_tag(kUser, 0, 1), b = make_tag(kUser, 0, 2), c = make_tag(kUser, 0, 3);
  std::vector<char> sa(kBytes, 'a'), sb(kBytes, 'b'), sc(kBytes, 'c');
  auto send_a = t[0]->isend(1, a, sa.data(), kBytes);
  auto send_b = t[0]->isend(1, b, sb.data(), kBytes);
  auto send_c = t[0]->isend(1, c, sc.data(), kBytes);
  // Both ranks make progress (this thread, no other) until the stall: rank 1 has buffered A and read B's header, B's
  // payload fills rank 0's ring to it, and C is written in part.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!send_b->done() && std::chrono::steady_clock::now() < until) {
    p0->progress();
    p1->progress();
  }
  ASSERT_TRUE(send_a->done() && send_b->done()) << "A and B never went into the ring";
  for (int i = 0; i < 100; ++i) {
    p0->progress();
    p1->progress();
  }
  ASSERT_FALSE(send_c->done()) << "C went through: nothing filled rank 1's unexpected budget";
  std::vector<char> ra(kBytes), rb(kBytes), rc(kBytes);
  auto recv_a = t[1]->irecv(0, a, ra.data(), kBytes);
  EXPECT_TRUE(recv_a->done());  // (taken from the buffered messages)
  // Only rank 0 makes progress now: C completes once rank 1 has read on past B.
  std::string error;
  try {
    send_c->wait(Deadline::after(5));
  } catch (const TimeoutError& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "") << "rank 0's send stayed stalled after rank 1's receive freed its unexpected budget";
  t[1]->irecv(0, b, rb.data(), kBytes)->wait(Deadline::after(10));
  send_c->wait(Deadline::after(10));  // (done by now, unless the check above failed)
  t[1]->irecv(0, c, rc.data(), kBytes)->wait(Deadline::after(10));
  EXPECT_EQ(ra, sa);
  EXPECT_EQ(rb, sb);
  EXPECT_EQ(rc, sc);
}

// The same stall with a thread of rank 1 waiting for a message (tag d) behind B: a receive of A posted by another
// thread reads on past B into that thread's receive (a receive of another tag waits on the peer, so B is buffered up
// to 4x the budget), and must wake the thread, which sleeps on its rank's doorbell, that peers ring only when they
// write. Unwoken, it saw its receive complete only when its sleep ran out: 25 ms on average, up to 50.
TEST(ShmUnexpectedBudget, AReceiveThatCompletesAnotherThreadsReceiveWakesIt) {
  SmallShm small("1K");
  auto t = test_util::make_transport_pair("shm");
  ASSERT_TRUE(t[0] && t[1]);
  // A (900 bytes) buffered counts 1796 bytes; B (2400) then passes 4x the budget (4096). All three frames fit the
  // ring (932 + 2432 + 40 bytes).
  constexpr size_t kA = 900, kB = 2400;
  constexpr int kTries = 12;
  double total = 0;
  for (int i = 0; i < kTries; ++i) {
    const uint32_t base = 10 * static_cast<uint32_t>(i);
    const uint64_t a = make_tag(kUser, 0, base + 1), b = make_tag(kUser, 0, base + 2), d = make_tag(kUser, 0, base + 3);
    std::vector<char> sa(kA, 'a'), sb(kB, 'b'), ra(kA), rb(kB);
    int64_t sd = 1000 + i, rd = -1;
    auto wait_d = t[1]->irecv(0, d, &rd, sizeof rd);
    auto send_a = t[0]->isend(1, a, sa.data(), kA);
    auto send_b = t[0]->isend(1, b, sb.data(), kB);
    auto send_d = t[0]->isend(1, d, &sd, sizeof sd);
    ASSERT_TRUE(send_a->done() && send_b->done() && send_d->done()) << "the ring did not take all three at once";
    std::atomic<Clock::time_point> woke{};
    std::string waiter_error;
    std::thread waiter([&] {
      try {
        wait_d->wait(Deadline::after(20));
      } catch (const std::exception& e) {
        waiter_error = e.what();
      }
      woke.store(Clock::now());
    });
    // (the waiter reads A and B's header, stalls at B, then falls asleep: the phases of its 50 ms sleep vary)
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + 4 * i));
    EXPECT_FALSE(wait_d->done()) << "d arrived though B should have held it back in the ring";
    const auto start = Clock::now();
    auto recv_a = t[1]->irecv(0, a, ra.data(), kA);
    waiter.join();
    total += std::chrono::duration<double>(woke.load() - start).count();
    EXPECT_EQ(waiter_error, "");
    EXPECT_TRUE(recv_a->done());
    t[1]->irecv(0, b, rb.data(), kB)->wait(Deadline::after(10));
    EXPECT_EQ(ra, sa);
    EXPECT_EQ(rb, sb);
    EXPECT_EQ(rd, sd);
  }
  EXPECT_LT(total / kTries, 0.010) << "a waiter woke " << 1e3 * total / kTries
                                   << " ms after another thread's receive completed its own";
}

}  // namespace
