// Shared memory's single copy: messages from CONDUIT_SHM_SINGLE_COPY_BYTES on (256 KiB by default) that do not fit
// the free space of the ring are read by the receiver straight out of the sender's memory (process_vm_readv; the
// two ranks of a pair are threads of this process here, which the kernel allows as well). The pairs here have 64 KiB
// rings, so that 1 MiB messages take that path. Checked: which path a message takes (the receiver of a single-copy
// message reads the sender's buffer when it receives, a ring message was copied at the send); the data of plain,
// reducing, late and wrong-size receives; that a message nobody receives is buffered after a while (two ranks that
// each wait for their send before receiving do not deadlock); more messages in flight than the done slots; messages
// read out of order; and the setting's errors.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/tags.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

constexpr size_t kBig = size_t{1} << 20;  // over the default threshold

// A pair made with CONDUIT_SHM_SINGLE_COPY_BYTES set to `setting` (null: the default) and rings of `ring` bytes.
std::vector<TransportPtr> shm_pair(const char* setting = nullptr, const char* ring = "64K") {
  if (setting) setenv("CONDUIT_SHM_SINGLE_COPY_BYTES", setting, 1);
  setenv("CONDUIT_SHM_RING_BYTES", ring, 1);
  std::vector<TransportPtr> p;
  try {
    p = test_util::make_transport_pair("shm");
  } catch (...) {
    unsetenv("CONDUIT_SHM_SINGLE_COPY_BYTES");
    unsetenv("CONDUIT_SHM_RING_BYTES");
    throw;
  }
  unsetenv("CONDUIT_SHM_SINGLE_COPY_BYTES");
  unsetenv("CONDUIT_SHM_RING_BYTES");
  return p;
}

// Sends kBig bytes of 3 from rank 0 to rank 1 and overwrites them with 9 before rank 1 receives (which a program
// must not do: here it shows which path the message took). Returns what rank 1 got.
std::vector<char> send_then_overwrite(std::vector<TransportPtr>& pair) {
  std::vector<char> out(kBig, 3), in(kBig, 0);
  auto s = pair[0]->isend(1, make_tag(kUser, 0, 1), out.data(), kBig);
  std::fill(out.begin(), out.end(), 9);
  std::string error;
  std::thread sender([&] {  // rank 0 must progress too when the message is larger than the ring
    try {
      s->wait(Deadline::after(20));
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  pair[1]->irecv(0, make_tag(kUser, 0, 1), in.data(), kBig)->wait(Deadline::after(20));
  sender.join();
  EXPECT_EQ(error, "");
  return in;
}

std::vector<float> ramp(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = base + static_cast<float>(i % 1000);
  return v;
}

uint64_t tag(uint32_t i) { return make_tag(kUser, 0, i); }

}  // namespace

TEST(ShmSingleCopy, PlainAndReducingReceivesGetTheSendersData) {
  auto pair = shm_pair();
  const size_t n = kBig / sizeof(float);
  auto a = ramp(n, 1), b = ramp(n, 5);
  std::vector<float> plain(n, -1), sum(n, 2);
  auto r1 = pair[1]->irecv(0, tag(1), plain.data(), kBig);
  auto r2 = pair[1]->irecv_reduce(0, tag(2), sum.data(), n, DType::f32, ReduceOp::sum);
  auto s1 = pair[0]->isend(1, tag(1), a.data(), kBig);
  auto s2 = pair[0]->isend(1, tag(2), b.data(), kBig);
  for (auto& r : {r1, r2, s1, s2}) r->wait(Deadline::after(20));
  EXPECT_EQ(plain, a);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(sum[i], b[i] + 2) << i;
}

// Single copy: the receiver reads the sender's buffer when it receives (all 9s); the send completes only then.
TEST(ShmSingleCopy, TheReceiverReadsTheSendersBufferWhenItReceives) {
  auto pair = shm_pair();
  EXPECT_EQ(send_then_overwrite(pair), std::vector<char>(kBig, 9));
  std::vector<char> out(kBig, 3);
  auto s = pair[0]->isend(1, tag(2), out.data(), kBig);
  // Nothing progresses rank 1's transport meanwhile: no reader.
  EXPECT_THROW(s->wait(Deadline::after(0.3)), TimeoutError);
  std::vector<char> in(kBig, 0);
  pair[1]->irecv(0, tag(2), in.data(), kBig)->wait(Deadline::after(20));
  s->wait(Deadline::after(20));
  EXPECT_EQ(in, out);
}

// Through the ring, the first ring-full was copied at the send (3s), the rest as the receiver drained it (9s).
TEST(ShmSingleCopy, OffSendsThroughTheRings) {
  auto pair = shm_pair("off");
  auto in = send_then_overwrite(pair);
  EXPECT_EQ(in.front(), 3);
  EXPECT_EQ(in.back(), 9);
}

TEST(ShmSingleCopy, AThresholdAboveTheMessageSendsThroughTheRings) {
  auto pair = shm_pair("2M");
  auto in = send_then_overwrite(pair);
  EXPECT_EQ(in.front(), 3);
  EXPECT_EQ(in.back(), 9);
}

// A message the ring has room for goes through it, whatever its size, and its send completes without the receiver:
// as before single copy (a program may count on it).
TEST(ShmSingleCopy, AMessageThatFitsTheRingGoesThroughIt) {
  auto pair = shm_pair(nullptr, "2M");
  std::vector<char> out(kBig, 3), in(kBig, 0);
  pair[0]->isend(1, tag(1), out.data(), kBig)->wait(Deadline::after(10));  // no reader
  std::fill(out.begin(), out.end(), 9);
  pair[1]->irecv(0, tag(1), in.data(), kBig)->wait(Deadline::after(20));
  EXPECT_EQ(in, std::vector<char>(kBig, 3));
}

// Each rank sends to the other and waits for its send before it receives: the message without a receive is read
// into a buffer after a millisecond, so both sends complete (they would wait for ever for a receive otherwise).
TEST(ShmSingleCopy, TwoRanksWaitingForTheirSendsBeforeReceivingDoNotDeadlock) {
  auto pair = shm_pair();
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        std::vector<char> out(kBig, static_cast<char>(10 + r)), in(kBig, 0);
        pair[r]->isend(1 - r, tag(7), out.data(), kBig)->wait(Deadline::after(20));
        std::fill(out.begin(), out.end(), 0);  // the send is complete: the buffer is ours again
        pair[r]->irecv(1 - r, tag(7), in.data(), kBig)->wait(Deadline::after(20));
        if (in != std::vector<char>(kBig, static_cast<char>(11 - r))) errors[r] = "wrong data";
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// More single-copy messages in flight than the receiver has done slots (64), received in reverse order: those past
// the window go through the ring, and every receive gets its own message.
TEST(ShmSingleCopy, ManyMessagesReceivedInReverseOrder) {
  auto pair = shm_pair();
  constexpr int kMsgs = 100;
  const size_t bytes = 256 << 10;
  std::vector<std::vector<char>> out(kMsgs), in(kMsgs, std::vector<char>(bytes, 0));
  std::vector<RequestPtr> sends;
  for (int i = 0; i < kMsgs; ++i) {
    out[i].assign(bytes, static_cast<char>(i));
    sends.push_back(pair[0]->isend(1, tag(100 + i), out[i].data(), bytes));
  }
  std::string error;
  std::thread sender([&] {  // progresses rank 0 (its sends complete as rank 1 reads them)
    try {
      for (auto& s : sends) s->wait(Deadline::after(30));
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  for (int i = kMsgs - 1; i >= 0; --i) pair[1]->irecv(0, tag(100 + i), in[i].data(), bytes)->wait(Deadline::after(30));
  sender.join();
  EXPECT_EQ(error, "");
  for (int i = 0; i < kMsgs; ++i) EXPECT_EQ(in[i], out[i]) << "message " << i;
}

// A receive of another size fails naming both sizes; the sender's send completes, and the next message (read out of
// the sender's memory too) arrives intact.
TEST(ShmSingleCopy, AWrongSizeFailsThatReceiveOnly) {
  auto pair = shm_pair();
  std::vector<char> out(kBig, 4), in(kBig / 2, 0), next(kBig, 0);
  auto bad = pair[1]->irecv(0, tag(1), in.data(), in.size());
  auto good = pair[1]->irecv(0, tag(2), next.data(), kBig);
  auto s1 = pair[0]->isend(1, tag(1), out.data(), kBig);
  auto s2 = pair[0]->isend(1, tag(2), out.data(), kBig);
  try {
    bad->wait(Deadline::after(20));
    ADD_FAILURE() << "a 512 KiB receive took a 1 MiB message";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("message of 1048576 bytes"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("expects 524288 bytes"), std::string::npos) << e.what();
  }
  good->wait(Deadline::after(20));
  s1->wait(Deadline::after(20));
  s2->wait(Deadline::after(20));
  EXPECT_EQ(next, out);
}

// Receives posted after their messages' frames were read off the ring, while the bytes still wait in the sender's
// memory: rank 1 progresses once (a receive of another tag, tested) and so sees the frames before it posts.
TEST(ShmSingleCopy, LateReceivesTakeMessagesWaitingInTheSendersMemory) {
  auto pair = shm_pair();
  const size_t n = kBig / sizeof(float);
  auto a = ramp(n, 1), b = ramp(n, 5);
  std::vector<float> plain(n, -1), sum(n, 2);
  auto s1 = pair[0]->isend(1, tag(1), a.data(), kBig);
  auto s2 = pair[0]->isend(1, tag(2), b.data(), kBig);
  int other = 0;
  auto r0 = pair[1]->irecv(0, tag(99), &other, sizeof other);
  EXPECT_FALSE(r0->test());  // reads both frames: no receive for them yet
  auto r1 = pair[1]->irecv(0, tag(1), plain.data(), kBig);
  auto r2 = pair[1]->irecv_reduce(0, tag(2), sum.data(), n, DType::f32, ReduceOp::sum);
  // Taken by a receive, the message is being delivered: not withdrawn (a later one of its tag may have been
  // matched meanwhile).
  EXPECT_FALSE(pair[1]->cancel(r1, std::make_exception_ptr(Error("test"))));
  for (auto& r : {r1, r2, s1, s2}) r->wait(Deadline::after(20));
  EXPECT_EQ(plain, a);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(sum[i], b[i] + 2) << i;
  const int v = 5;
  pair[0]->isend(1, tag(99), &v, sizeof v)->wait(Deadline::after(5));
  r0->wait(Deadline::after(5));
  EXPECT_EQ(other, 5);
}

// A late receive of the wrong size, for a message that waited in the sender's memory, fails the same way; the
// sender's send completes.
TEST(ShmSingleCopy, ALateReceiveOfTheWrongSizeFails) {
  auto pair = shm_pair();
  std::vector<char> out(kBig, 4), in(2 * kBig, 0);
  auto s = pair[0]->isend(1, tag(1), out.data(), kBig);
  int other = 0;
  auto r0 = pair[1]->irecv(0, tag(99), &other, sizeof other);
  EXPECT_FALSE(r0->test());
  try {
    pair[1]->irecv(0, tag(1), in.data(), in.size())->wait(Deadline::after(20));
    ADD_FAILURE() << "a 2 MiB receive took a 1 MiB message";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("expects 2097152 bytes"), std::string::npos) << e.what();
  }
  s->wait(Deadline::after(20));
  EXPECT_TRUE(pair[1]->cancel(r0, std::make_exception_ptr(Error("test"))));
}

TEST(ShmSingleCopy, BadSettingsAreRefusedNamingWhatIsAllowed) {
  for (const char* bad : {"1K", "lots", "-5"}) {
    try {
      shm_pair(bad);
      ADD_FAILURE() << bad << " was taken";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("CONDUIT_SHM_SINGLE_COPY_BYTES"), std::string::npos) << e.what();
    }
  }
}
