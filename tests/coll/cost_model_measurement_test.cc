// The start-up measurement of the cost model (coll/world.cc) over links of a known rate: its time and bytes are
// bounded on a slow link, it still uses large messages on a fast one, and a failure names it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "coll/algorithms.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "forwarding_transport.h"
#include "net/inproc.h"

using namespace conduit;

namespace {

// A link of `bytes_per_s`: each send waits its bytes' time on the wire before it leaves (the ping-pong's sender
// waits for its reply, so a round trip takes both messages' times), and the bytes sent are counted.
class SlowLink : public test_util::ForwardingTransport {
 public:
  SlowLink(net::TransportPtr inner, double bytes_per_s) : ForwardingTransport(std::move(inner)), rate_(bytes_per_s) {}
  const char* name() const override { return "slow-link"; }
  net::RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    sent += bytes;
    std::this_thread::sleep_for(std::chrono::duration<double>(static_cast<double>(bytes) / rate_));
    return inner_->isend(peer, tag, data, bytes);
  }
  std::atomic<size_t> sent{0};

 private:
  double rate_;
};

struct Measured {
  std::vector<size_t> sent;
  double seconds = 0;
  coll::CostModel model;
  std::string error;
};

// Two ranks on two hosts joined by links of `bytes_per_s`, measuring the cost model with `start_up_s`.
Measured measure(double bytes_per_s, double start_up_s) {
  auto world = net::make_inproc_world(2, 1);
  std::vector<std::shared_ptr<SlowLink>> links;
  std::vector<coll::CommPtr> comms;
  for (auto& t : world) {
    links.push_back(std::make_shared<SlowLink>(t, bytes_per_s));
    comms.push_back(coll::Communicator::create(links.back(), {0, 1}, 0));
  }
  Measured m;
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        coll::measure_cost_model(*comms[r], start_up_s);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& th : ranks) th.join();
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& l : links) m.sent.push_back(l->sent);
  m.model = comms[0]->tuner().model();
  m.error = errors[0].empty() ? errors[1] : errors[0];
  return m;
}

// At 2 Mbit/s the measurement sent seven round trips of 1 MiB each way (~15 MB): a minute of the link, past the
// start-up deadline, which every `conduit train` on such a link failed on. Now it grows its message only until one
// takes 20 ms, and times it for 0.1 s: tens of kilobytes.
TEST(CostModelMeasurement, IsBoundedInTimeAndBytesOnASlowLink) {
  const double rate = 250e3;  // bytes/s: 2 Mbit/s
  const Measured m = measure(rate, 10);
  ASSERT_EQ(m.error, "");
  std::printf("2 Mbit/s: %.2f s, %zu and %zu bytes sent, inter beta %.3g s/byte (the link's %.3g)\n", m.seconds,
              m.sent[0], m.sent[1], m.model.inter.beta, 1 / rate);
  // At most half a second of the link's bytes each way (~32 KB expected), and a few seconds of a loaded machine.
  EXPECT_LT(m.sent[0], static_cast<size_t>(0.5 * rate));
  EXPECT_LT(m.sent[1], static_cast<size_t>(0.5 * rate));
  EXPECT_LT(m.seconds, 5.0);
  // Still a measurement of the link: its beta within a factor of two.
  EXPECT_GT(m.model.inter.beta, 0.5 / rate);
  EXPECT_LT(m.model.inter.beta, 2.0 / rate);
  EXPECT_EQ(m.model.source, "measured");
}

// A fast link keeps the large message (1 MiB, as before the bound), which its beta needs to stand above the latency.
TEST(CostModelMeasurement, AFastLinkIsStillMeasuredWithLargeMessages) {
  const double rate = 2e9;  // bytes/s
  const Measured m = measure(rate, 10);
  ASSERT_EQ(m.error, "");
  EXPECT_GE(m.sent[0], size_t{2} << 20);
  EXPECT_LT(m.model.inter.beta, 50.0 / rate);
}

// A peer that never answers: the deadline's error says it was the cost model's measurement (it named a receive of
// 1048576 bytes and nothing else).
TEST(CostModelMeasurement, ItsDeadlineErrorNamesIt) {
  auto comms = coll::Communicator::inproc(2, 1);
  try {
    coll::measure_cost_model(*comms[0], 0.2);
    FAIL() << "no error";
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("start-up measurement of the network cost model"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 on another host"), std::string::npos) << what;
    EXPECT_NE(what.find("CONDUIT_COST_MODEL"), std::string::npos) << what;
  }
}

}  // namespace
