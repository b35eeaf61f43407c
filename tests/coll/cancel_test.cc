// A caller that gives up on a request (its wait timed out) gets the transport off its buffer: the request is
// withdrawn while no data has moved for it, and a message arriving later goes to the next receive of its tag; a
// request whose data is already moving can only be stopped by aborting the transport.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coll/algorithms.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "net/inproc.h"
#include "net/matching.h"
#include "net/shm.h"
#include "net/tags.h"
#include "net/tcp.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

namespace {

using test_util::make_transport_pair;

class Cancel : public ::testing::TestWithParam<std::string> {};

TEST_P(Cancel, ATimedOutReceiveIsWithdrawnAndTheLateMessageGoesToTheNextReceive) {
  auto t = make_transport_pair(GetParam());
  ASSERT_TRUE(t[0] && t[1]);
  const uint64_t tag = make_tag(kUser, 0, 9);
  int first = -1, second = -1;
  RequestPtr r1 = t[1]->irecv(0, tag, &first, 4);
  EXPECT_THROW(r1->wait(Deadline::after(0.05)), TimeoutError);
  EXPECT_FALSE(give_up(*t[1], r1, "test gave up"));
  EXPECT_TRUE(r1->done());
  EXPECT_THROW(r1->test(), TimeoutError);
  EXPECT_EQ(t[1]->aborted_reason(), "");  // withdrawn, not aborted

  int value = 42;
  RequestPtr s = t[0]->isend(1, tag, &value, 4);
  RequestPtr r2 = t[1]->irecv(0, tag, &second, 4);
  r2->wait(Deadline::after(10));
  s->wait(Deadline::after(10));
  EXPECT_EQ(second, 42);
  EXPECT_EQ(first, -1) << "the withdrawn receive's buffer was written";
  EXPECT_FALSE(t[1]->cancel(r2, nullptr)) << "a completed request cannot be withdrawn";
}

// A destroyed transport fails its pending requests at once: a waiter that still holds one got a TimeoutError only at
// its deadline (tcp), or its wait called into the freed transport (shm's progress in the waiting thread).
TEST_P(Cancel, ADestroyedTransportsPendingRequestsFailAtOnce) {
  // A tcp peer's progress thread takes in up to its budget for unexpected bytes (64 MiB by default): an 8 MiB send
  // all left and completed before the transport was destroyed, now and then. With a budget of 1 MiB a 64 MiB send
  // cannot (it and the sockets' buffers, up to tcp_rmem's 32 MiB here, hold less; shm's rings 2 MiB, read only by a
  // waiting peer).
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "1M", 1);
  auto t = make_transport_pair(GetParam());
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  ASSERT_TRUE(t[0] && t[1]);
  int never = -1;
  RequestPtr r = t[0]->irecv(1, make_tag(kUser, 0, 3), &never, 4);
  // (past the peer's budget for unexpected bytes and what the sockets' buffers take at most here: not all leaves)
  size_t most = 0;
  for (const char* f : {"/proc/sys/net/ipv4/tcp_rmem", "/proc/sys/net/ipv4/tcp_wmem"}) {
    size_t lo = 0, mid = 0, hi = 0;
    std::ifstream(f) >> lo >> mid >> hi;
    most += hi;
  }
  const std::vector<char> big(std::max<size_t>(size_t{64} << 20, most + (size_t{16} << 20)), 'x');
  RequestPtr s = t[0]->isend(1, make_tag(kUser, 0, 4), big.data(), big.size());
  EXPECT_FALSE(r->done());
  EXPECT_FALSE(s->done());
  t[0].reset();
  for (const RequestPtr& q : {r, s}) {
    const auto start = std::chrono::steady_clock::now();
    try {
      q->wait(Deadline::after(5));
      ADD_FAILURE() << "a request of a destroyed transport completed";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("destroyed"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected a PeerError, got: " << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  }
  EXPECT_EQ(never, -1);
  // shm: the send's buffer was the peer's to read (single copy): the peer is told, as of an abort, before the buffer
  // goes back to its owner.
  if (GetParam() == "shm") {
    int other = 0;
    RequestPtr later = t[1]->irecv(0, make_tag(kUser, 0, 5), &other, 4);
    try {
      later->wait(Deadline::after(5));
      ADD_FAILURE() << "the peer of a transport destroyed while sending received";
    } catch (const PeerError& e) {
      EXPECT_NE(std::string(e.what()).find("destroyed while sending"), std::string::npos) << e.what();
    }
  }
}

// A send nothing of which was written is withdrawn; one partly written cannot be, and giving up on it aborts the
// transport (the peer's 1 MiB budget for unexpected bytes keeps the 8 MiB message from leaving in full).
TEST_P(Cancel, AnUnstartedSendIsWithdrawnAPartlyWrittenOneAbortsTheTransport) {
  if (GetParam() == "inproc") {  // a send waits in the peer's mailbox until matched, then moves in one copy
    auto t = make_inproc_world(2);
    int small = 7, got = -1;
    RequestPtr s = t[0]->isend(1, make_tag(kUser, 0, 2), &small, 4);
    EXPECT_FALSE(give_up(*t[0], s, "test gave up"));
    EXPECT_THROW(s->test(), TimeoutError);
    EXPECT_THROW(t[1]->irecv(0, make_tag(kUser, 0, 2), &got, 4)->wait(Deadline::after(0.05)), TimeoutError);
    EXPECT_EQ(got, -1) << "the withdrawn send was delivered";
    return;
  }
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "1M", 1);
  // The big message must sit partly written in shm's ring, not be read from this process (single copy).
  setenv("CONDUIT_SHM_SINGLE_COPY_BYTES", "off", 1);
  auto t = make_transport_pair(GetParam());
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  unsetenv("CONDUIT_SHM_SINGLE_COPY_BYTES");
  ASSERT_TRUE(t[0] && t[1]);
  const size_t big = GetParam() == "shm" ? (size_t{80} << 20) : (size_t{8} << 20);
  std::vector<char> data(big, 3);
  int small = 7;
  RequestPtr s1 = t[0]->isend(1, make_tag(kUser, 0, 1), data.data(), big);
  RequestPtr s2 = t[0]->isend(1, make_tag(kUser, 0, 2), &small, 4);
  EXPECT_THROW(s1->wait(Deadline::after(0.3)), TimeoutError);
  EXPECT_FALSE(s2->done());
  EXPECT_FALSE(give_up(*t[0], s2, "test gave up"));
  EXPECT_THROW(s2->test(), TimeoutError);
  EXPECT_EQ(t[0]->aborted_reason(), "");
  EXPECT_FALSE(t[0]->cancel(s1, nullptr)) << "part of it is written";
  EXPECT_FALSE(give_up(*t[0], s1, "test gave up on the big send"));
  EXPECT_NE(t[0]->aborted_reason().find("test gave up on the big send"), std::string::npos) << t[0]->aborted_reason();
  EXPECT_THROW(s1->test(), PeerError);
}

INSTANTIATE_TEST_SUITE_P(Transports, Cancel, ::testing::Values("tcp", "shm", "inproc"));

// A destroyed inproc transport takes its operations out of the mailboxes: a peer's later send matched its receive
// and wrote into the caller's buffer, freed by then (ASan: heap-use-after-free). Its pending requests, the peer's
// operations waiting for it and later ones with it fail at once.
TEST(Inproc, ADestroyedRanksOperationsLeaveTheMailboxes) {
  auto t = make_inproc_world(2);
  auto buf = std::make_unique<std::vector<char>>(64, 'a');
  RequestPtr r = t[0]->irecv(1, make_tag(kUser, 0, 5), buf->data(), 64);
  RequestPtr waiting = t[1]->irecv(0, make_tag(kUser, 0, 6), buf->data(), 64);  // for rank 0, which goes
  t[0].reset();
  EXPECT_THROW(r->test(), PeerError);
  EXPECT_THROW(waiting->test(), PeerError);
  const std::vector<char> src(64, 'z');
  const auto buf_was = *buf;
  RequestPtr s = t[1]->isend(0, make_tag(kUser, 0, 5), src.data(), 64);
  try {
    s->test();
    ADD_FAILURE() << "a send to a destroyed rank was accepted";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0's transport was destroyed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(*buf, buf_was) << "the destroyed rank's buffer was written";
}

// Failing every request (a peer failed; arrived messages kept) releases the budget of a message still arriving to
// an attached receive, and the failed receive stops being its waiter (both stayed).
TEST(MatchQueues, FailingAllReleasesAnArrivingMessagesBudget) {
  MatchQueues q;
  auto m = q.add_unexpected(5, 64);  // still arriving
  char a[64] = {};
  PostedRecv r = make_recv(Request::Kind::recv, 0, 5, a, 64);
  RequestPtr req = r.req;
  ASSERT_TRUE(q.take_unexpected(5, r, "test"));
  EXPECT_FALSE(q.can_buffer(1, 64));
  q.fail_all(std::make_exception_ptr(PeerError("peer failed")), true);
  EXPECT_THROW(req->test(), PeerError);
  EXPECT_TRUE(q.can_buffer(64, 64));
  EXPECT_FALSE(m->has_waiter);
}

// Every buffered message counts against the budget with its overhead, so a peer sending empty messages nobody
// receives is held to a bound (2M empty tcp frames grew a rank by 250 MB with the budget at 0 bytes used); taking
// or failing them gives it all back.
TEST(MatchQueues, EmptyMessagesCountAgainstTheBudget) {
  MatchQueues q;
  const size_t budget = 4096;
  std::vector<std::shared_ptr<Unexpected>> held;
  while (q.can_buffer(0, budget) && held.size() < 100000) {
    held.push_back(q.add_unexpected(7, 0));
    q.complete_unexpected(*held.back(), "test");
  }
  constexpr size_t kTag = MatchQueues::kTagOverhead;
  EXPECT_EQ(held.size(), (budget - kTag) / MatchQueues::kMessageOverhead + 1);  // (and tag 7's queue)
  // A message still in its sender's memory (shm single copy) counts its overhead too.
  auto remote = q.add_remote(8);
  EXPECT_FALSE(q.can_buffer(0, 2 * kTag + (held.size() + 1) * MatchQueues::kMessageOverhead - 1));
  char none[1];
  for (size_t i = 0; i < held.size(); ++i) {
    PostedRecv r = make_recv(Request::Kind::recv, 0, 7, none, 0);
    RequestPtr req = r.req;
    ASSERT_TRUE(q.take_unexpected(7, r, "test"));
    EXPECT_TRUE(req->succeeded());
  }
  EXPECT_TRUE(q.can_buffer(budget - MatchQueues::kMessageOverhead - kTag, budget));
  EXPECT_FALSE(q.can_buffer(budget - MatchQueues::kMessageOverhead - kTag + 1, budget));
  PostedRecv r = make_recv(Request::Kind::recv, 0, 8, none, 0);
  ASSERT_TRUE(q.take_unexpected(8, r, "test"));  // attaches to the remote message
  PostedRecv w = q.take_waiter(*remote);         // the transport reads its bytes into the receive
  EXPECT_TRUE(q.can_buffer(budget, budget));
  EXPECT_FALSE(q.can_buffer(budget + 1, budget));
}

// Messages of ever new tags count their tags' queues too (each grew a rank by ~850 bytes against 128 counted: 217 MB
// within an 8M budget); all taken, the budget is whole again.
TEST(MatchQueues, MessagesOfNewTagsCountTheirQueues) {
  MatchQueues q;
  const size_t budget = 64 << 10;
  std::vector<std::shared_ptr<Unexpected>> held;
  uint64_t tag = 100;
  while (q.can_buffer(0, budget) && held.size() < 100000) {
    held.push_back(q.add_unexpected(tag++, 0));
    q.complete_unexpected(*held.back(), "test");
  }
  EXPECT_EQ(held.size(), budget / (MatchQueues::kMessageOverhead + MatchQueues::kTagOverhead) + 1);
  char none[1];
  for (uint64_t t = 100; t < tag; ++t) {
    PostedRecv r = make_recv(Request::Kind::recv, 0, t, none, 0);
    ASSERT_TRUE(q.take_unexpected(t, r, "test"));
  }
  EXPECT_TRUE(q.can_buffer(budget, budget));
  EXPECT_FALSE(q.can_buffer(budget + 1, budget));
}

// A receive attached to a message still arriving into the transport's buffer is detached, and the message stays
// the oldest of its tag: the next receive gets it, not the one behind it.
TEST(MatchQueues, AWithdrawnReceiveLeavesItsArrivingMessageFirstInLine) {
  MatchQueues q;
  const uint64_t tag = 5;
  auto m1 = q.add_unexpected(tag, 4);  // still arriving
  auto m2 = q.add_unexpected(tag, 4);
  std::memcpy(m2->data.data(), "BBBB", 4);
  q.complete_unexpected(*m2, "test");
  char a[4] = {}, b[4] = {}, c[4] = {};
  PostedRecv r1 = make_recv(Request::Kind::recv, 0, tag, a, 4);
  RequestPtr req1 = r1.req;
  ASSERT_TRUE(q.take_unexpected(tag, r1, "test"));  // attaches to m1
  EXPECT_TRUE(q.cancel(req1.get()));
  EXPECT_FALSE(q.cancel(req1.get()));
  PostedRecv r2 = make_recv(Request::Kind::recv, 0, tag, b, 4);
  RequestPtr req2 = r2.req;
  ASSERT_TRUE(q.take_unexpected(tag, r2, "test"));  // m1 again
  std::memcpy(m1->data.data(), "AAAA", 4);
  q.complete_unexpected(*m1, "test");
  EXPECT_TRUE(req2->succeeded());
  EXPECT_EQ(std::string(b, 4), "AAAA");
  EXPECT_EQ(std::string(a, 4), std::string(4, '\0'));
  PostedRecv r3 = make_recv(Request::Kind::recv, 0, tag, c, 4);
  RequestPtr req3 = r3.req;
  ASSERT_TRUE(q.take_unexpected(tag, r3, "test"));
  EXPECT_TRUE(req3->succeeded());
  EXPECT_EQ(std::string(c, 4), "BBBB");
  // A posted receive is withdrawn from the posted queue.
  PostedRecv r4 = make_recv(Request::Kind::recv, 0, tag, c, 4);
  RequestPtr req4 = r4.req;
  q.post(tag, std::move(r4));
  EXPECT_TRUE(q.cancel(req4.get()));
  EXPECT_FALSE(q.has_posted());
}

// A receive posted behind the withdrawn one (it found nothing buffered) takes the arriving message: it is the oldest
// receive of the tag now, and the message the oldest message.
TEST(MatchQueues, AWithdrawnReceiveHandsItsArrivingMessageToTheNextPostedReceive) {
  MatchQueues q;
  const uint64_t tag = 6;
  auto m1 = q.add_unexpected(tag, 4);
  char a[4] = {}, b[4] = {};
  PostedRecv r1 = make_recv(Request::Kind::recv, 0, tag, a, 4);
  RequestPtr req1 = r1.req;
  ASSERT_TRUE(q.take_unexpected(tag, r1, "test"));
  PostedRecv r2 = make_recv(Request::Kind::recv, 0, tag, b, 4);
  RequestPtr req2 = r2.req;
  ASSERT_FALSE(q.take_unexpected(tag, r2, "test"));
  q.post(tag, std::move(r2));
  EXPECT_TRUE(q.cancel(req1.get()));
  EXPECT_FALSE(q.has_posted());
  std::memcpy(m1->data.data(), "CCCC", 4);
  q.complete_unexpected(*m1, "test");
  EXPECT_TRUE(req2->succeeded());
  EXPECT_EQ(std::string(b, 4), "CCCC");
  EXPECT_EQ(std::string(a, 4), std::string(4, '\0'));
}

// The communicator's point-to-point receive gives up on its request when its wait times out: the message sent
// afterwards reaches the next receive of the tag (it used to fill the timed-out receive's buffer, and the next
// receive waited for its deadline).
TEST(Communicator, ATimedOutPointToPointReceiveDoesNotTakeTheNextMessage) {
  auto comms = coll::Communicator::inproc(2);
  float stale = -1, fresh = -1;
  coll::CollOptions o;
  o.timeout_s = 0.1;
  EXPECT_THROW(comms[0]->recv(&stale, 1, DType::f32, 1, 3, o).wait(), TimeoutError);
  float v = 2.5f;
  auto s = comms[1]->send(&v, 1, DType::f32, 0, 3);
  o.timeout_s = 10;
  comms[0]->recv(&fresh, 1, DType::f32, 1, 3, o).wait();
  s.wait();
  EXPECT_EQ(fresh, 2.5f);
  EXPECT_EQ(stale, -1.0f);
  EXPECT_EQ(comms[0]->transport().aborted_reason(), "");
}

// The start-up ping-pong gives its request up when a wait fails: its buffer is freed as the error unwinds, and the
// send left posted on it was taken later by the peer's receive (read from freed memory; over tcp a receive left so
// was written into it by the progress thread).
TEST(Communicator, AFailedPingPongLeavesNothingPostedOnItsBuffer) {
  auto comms = coll::Communicator::inproc(2);
  EXPECT_THROW(coll::ping_pong(*comms[0], 0, 1, 8, 1, Deadline::after(0.1)), TimeoutError);
  auto& t = comms[1]->transport();
  char got[8];
  auto r = t.irecv(0, make_tag(kControl, comms[1]->id(), 8), got, 8);
  EXPECT_THROW(wait_all_or_give_up(t, {r}, Deadline::after(0.2)), TimeoutError) << "the withdrawn send arrived";
  EXPECT_EQ(comms[0]->transport().aborted_reason(), "");  // withdrawn, not aborted
}

// A point-to-point Work's seconds() run from its post to the completion seen, however it was waited for (a receive
// polled with test() until done reported the last test()'s own time: about 0).
TEST(Communicator, APolledPointToPointRequestTimesItsWholeLife) {
  auto comms = coll::Communicator::inproc(2);
  float got = -1, v = 4.0f;
  auto r = comms[0]->recv(&got, 1, DType::f32, 1, 5);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  auto s = comms[1]->send(&v, 1, DType::f32, 0, 5);
  while (!r.test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  s.wait();
  EXPECT_EQ(got, 4.0f);
  EXPECT_GE(r.seconds(), 0.14);
  EXPECT_LT(s.seconds(), r.seconds());
}

}  // namespace
