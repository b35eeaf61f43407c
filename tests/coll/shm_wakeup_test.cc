// A shm waiter is woken at once when another thread of its process fails the request it waits on.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <thread>

#include "core/error.h"
#include "net/tags.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

using test_util::make_transport_pair;

// Starts a thread waiting on `r`, lets it fall asleep (`asleep` later), runs `fail`, and returns how long after
// `fail` began the waiter's wait returned, in seconds.
double wake_delay(const RequestPtr& r, std::chrono::milliseconds asleep, const std::function<void()>& fail) {
  std::atomic<Clock::time_point> woke{};
  std::thread waiter([&] {
    try {
      r->wait(Deadline::after(20));
    } catch (const std::exception&) {
    }
    woke.store(Clock::now());
  });
  std::this_thread::sleep_for(asleep);
  const auto start = Clock::now();
  fail();
  waiter.join();
  return std::chrono::duration<double>(woke.load() - start).count();
}

// Found by an audit: shm waiters sleep on their own segment's doorbell, up to 50 ms at a time, and only peers rang
// it. A request another thread of the process failed (cancel, abort) left its waiter asleep until the timeout:
// 25 ms on average. The waits start at several phases of that 50 ms cycle; the mean delay is a few hundred
// microseconds now, and the bound leaves room for a loaded machine.
TEST(ShmWakeup, AWaiterIsWokenWhenAnotherThreadCancelsItsRequest) {
  auto t = make_transport_pair("shm");
  ASSERT_TRUE(t[0] && t[1]);
  constexpr int kTries = 12;
  double total = 0;
  for (int i = 0; i < kTries; ++i) {
    int never = -1;
    RequestPtr r = t[1]->irecv(0, make_tag(kUser, 0, 100 + static_cast<uint32_t>(i)), &never, 4);
    total += wake_delay(r, std::chrono::milliseconds(100 + 4 * i), [&] {
      EXPECT_TRUE(t[1]->cancel(r, std::make_exception_ptr(TimeoutError("given up by the test"))));
    });
    EXPECT_THROW(r->test(), TimeoutError);
    EXPECT_EQ(never, -1);
  }
  EXPECT_LT(total / kTries, 0.010) << "a waiter woke " << 1e3 * total / kTries << " ms after its request failed";
}

TEST(ShmWakeup, AWaiterIsWokenWhenAnotherThreadAborts) {
  constexpr int kTries = 6;
  double total = 0;
  for (int i = 0; i < kTries; ++i) {
    auto t = make_transport_pair("shm");
    ASSERT_TRUE(t[0] && t[1]);
    int never = -1;
    RequestPtr r = t[1]->irecv(0, make_tag(kUser, 0, 1), &never, 4);
    total += wake_delay(r, std::chrono::milliseconds(100 + 8 * i), [&] { t[1]->abort("aborted by the test"); });
    EXPECT_THROW(r->test(), PeerError);
  }
  EXPECT_LT(total / kTries, 0.010) << "a waiter woke " << 1e3 * total / kTries << " ms after its request failed";
}

}  // namespace
