// Malformed frames sent from a raw socket to a tcp transport are rejected on that connection with a clear error,
// never a crash; the frame validator is checked field by field.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/shm.h"
#include "net/tags.h"
#include "net/tcp.h"
#include "net/wire.h"
#include "transport_pair.h"

using namespace conduit;
using namespace conduit::net;

TEST(Wire, ValidatorRejectsEachBadField) {
  uint64_t tag = make_tag(kCollective, 3, 9);
  FrameHeader ok = make_frame(kFrameData, tag, 100, 1);
  EXPECT_EQ(validate_frame(ok, 1, 1 << 20), "");
  FrameHeader h = ok;
  h.magic = 0xdeadbeef;
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("magic"), std::string::npos);
  h = ok;
  h.version = 9;
  h.check = frame_checksum(h);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("version"), std::string::npos);
  h = ok;
  h.length = 101;  // changed without the checksum
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("checksum"), std::string::npos);
  h = make_frame(kFrameData, tag, 2u << 20, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("exceeds the limit"), std::string::npos);
  h = make_frame(kFrameData, 0x7700000000000000ull, 4, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("tag"), std::string::npos);
  h = make_frame(kFrameData, tag, 4, 2);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("source rank"), std::string::npos);
  h = make_frame(static_cast<FrameType>(9), tag, 4, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("type"), std::string::npos);
  h = make_frame(kFrameAbort, 0, kMaxAbortReason + 1, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("exceeds"), std::string::npos);
  // A single-copy frame is shm's alone: refused on tcp, and with a bad tag or length on shm too.
  h = make_frame(kFrameShmRead, tag, 1 << 20, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20).find("unknown frame type 4 (allowed 1..3)"), std::string::npos);
  EXPECT_EQ(validate_frame(h, 1, 1 << 20, /*shm_read=*/true), "");
  h = make_frame(kFrameShmRead, 0x7700000000000000ull, 4, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20, true).find("tag"), std::string::npos);
  h = make_frame(kFrameShmRead, tag, 2u << 20, 1);
  EXPECT_NE(validate_frame(h, 1, 1 << 20, true).find("exceeds the limit"), std::string::npos);
}

namespace {

// Rank 0 is a real tcp transport; "rank 1" is this test speaking raw bytes.
struct RawPeer {
  std::shared_ptr<Transport> t;
  int fd = -1;
  ~RawPeer() {
    if (fd >= 0) ::close(fd);
  }
};

std::unique_ptr<RawPeer> connect_raw() {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  std::promise<std::string> addr;
  auto fut = addr.get_future();
  auto made = std::async(std::launch::async, [&] {
    return make_tcp_transport(0, 2, {0, 0}, [&](const std::string& mine) {
      addr.set_value(mine);
      return std::vector<std::string>{mine, "unused:1"};
    }, Deadline::after(10));
  });
  std::string a = fut.get();
  auto colon = a.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(a.substr(colon + 1))));
  inet_pton(AF_INET, a.substr(0, colon).c_str(), &sa.sin_addr);
  auto p = std::make_unique<RawPeer>();
  p->fd = ::socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_EQ(::connect(p->fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  const uint64_t job = tcp_job_fingerprint({a, "unused:1"});
  FrameHeader hello = make_frame(kFrameHello, job, 2, 1);
  EXPECT_EQ(::send(p->fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  p->t = made.get();
  FrameHeader answer{};  // rank 0 answers the hello with its own (left unread, closing would reset the connection)
  EXPECT_EQ(::recv(p->fd, &answer, sizeof answer, MSG_WAITALL), static_cast<ssize_t>(sizeof answer));
  EXPECT_EQ(validate_frame(answer, 0, 0), "");
  EXPECT_EQ(answer.type, kFrameHello);
  EXPECT_EQ(answer.tag, job);  // the job it belongs to and its size
  EXPECT_EQ(answer.length, 2u);
  return p;
}

std::string recv_error(Transport& t, size_t bytes) {
  std::vector<char> buf(bytes);
  auto r = t.irecv(1, make_tag(kCollective, 0, 0), buf.data(), bytes);
  try {
    r->wait(Deadline::after(10));
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(TcpFrames, GarbageBytesAreAProtocolError) {
  auto p = connect_raw();
  char junk[64];
  std::memset(junk, 0x5a, sizeof junk);
  ::send(p->fd, junk, sizeof junk, 0);
  std::string e = recv_error(*p->t, 16);
  EXPECT_NE(e.find("protocol error"), std::string::npos) << e;
  EXPECT_NE(e.find("magic"), std::string::npos) << e;
}

TEST(TcpFrames, OversizedLengthIsRejectedWithoutAllocating) {
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), ~0ull >> 1, 1);
  ::send(p->fd, &h, sizeof h, 0);
  std::string e = recv_error(*p->t, 16);
  EXPECT_NE(e.find("exceeds the limit"), std::string::npos) << e;
}

TEST(TcpFrames, TruncatedPayloadIsReportedAsTruncated) {
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 1000, 1);
  ::send(p->fd, &h, sizeof h, 0);
  char part[100] = {0};
  ::send(p->fd, part, sizeof part, 0);
  ::shutdown(p->fd, SHUT_WR);
  std::string e = recv_error(*p->t, 1000);
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
}

// A close part-way through a frame header is a truncated frame too (it read as the peer's clean close).
TEST(TcpFrames, TruncatedHeaderIsReportedAsTruncated) {
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 1000, 1);
  ::send(p->fd, &h, sizeof h / 2, 0);
  ::shutdown(p->fd, SHUT_WR);
  std::string e = recv_error(*p->t, 1000);
  EXPECT_NE(e.find("bytes into a " + std::to_string(sizeof(FrameHeader)) + "-byte header"), std::string::npos) << e;
}

TEST(TcpFrames, WrongSizeForThePostedReceiveIsAProtocolError) {
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 8, 1);
  char payload[8] = {0};
  ::send(p->fd, &h, sizeof h, 0);
  ::send(p->fd, payload, sizeof payload, 0);
  std::string e = recv_error(*p->t, 16);
  // Whether the frame arrived before or after the receive was posted, the error names both sizes.
  EXPECT_NE(e.find("16"), std::string::npos) << e;
  EXPECT_NE(e.find("8 bytes"), std::string::npos) << e;
  EXPECT_NE(e.find("expect"), std::string::npos) << e;
}

TEST(TcpFrames, AWellFormedFrameIsDelivered) {
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 4, 1);
  int32_t v = 12345;
  ::send(p->fd, &h, sizeof h, 0);
  ::send(p->fd, &v, 4, 0);
  int32_t got = 0;
  p->t->irecv(1, make_tag(kCollective, 0, 0), &got, 4)->wait(Deadline::after(10));
  EXPECT_EQ(got, 12345);
}

TEST(TcpFrames, AMessageThatArrivedBeforeThePeerClosedIsStillReceived) {
  // The peer sends its last message and exits before this rank posts the receive (a small allreduce's last step
  // does this under load): the message must not be dropped with the connection.
  auto p = connect_raw();
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 4, 1);
  int32_t v = 777;
  ::send(p->fd, &h, sizeof h, 0);
  ::send(p->fd, &v, 4, 0);
  ::close(p->fd);
  p->fd = -1;
  // A receive on another tag fails once the transport has read the close, so the message is buffered by now.
  int32_t other = 0;
  auto waiter = p->t->irecv(1, make_tag(kCollective, 0, 1), &other, 4);
  EXPECT_THROW(waiter->wait(Deadline::after(10)), PeerError);
  int32_t got = 0;
  p->t->irecv(1, make_tag(kCollective, 0, 0), &got, 4)->wait(Deadline::after(10));
  EXPECT_EQ(got, 777);
  std::string e = recv_error(*p->t, 4);  // nothing more arrived: the next receive names the close
  EXPECT_NE(e.find("closed its connection"), std::string::npos) << e;
}

// A frame over the unexpected budget holds its connection unread until a receive is posted; the peer closing
// meanwhile must still be seen: the frame was cut short, so the receive waiting on another tag fails at once
// (it waited for its deadline, and after a reset the progress thread spun).
TEST(TcpFrames, APeerClosingBehindAHeldFrameIsSeenAtOnce) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "1M", 1);
  auto p = connect_raw();
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  FrameHeader h = make_frame(kFrameData, make_tag(kCollective, 0, 0), 8 << 20, 1);
  ::send(p->fd, &h, sizeof h, 0);
  std::vector<char> part(1000);
  ::send(p->fd, part.data(), part.size(), 0);
  int32_t other = 0;
  auto waiter = p->t->irecv(1, make_tag(kCollective, 0, 1), &other, 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the frame is held by now
  ::close(p->fd);
  p->fd = -1;
  const auto t0 = std::chrono::steady_clock::now();
  std::string e = "no error";
  try {
    waiter->wait(Deadline::after(10));
  } catch (const Error& err) {
    e = err.what();
  }
  EXPECT_NE(e.find("truncated frame: the connection closed with 1000 of a 8388608-byte payload sent"),
            std::string::npos)
      << e;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0) << e;
}

// A peer's abort reason is reported as one line whatever bytes it held (a reason with line breaks and terminal
// escapes was printed as sent).
TEST(Wire, AnAbortReasonIsReportedAsOneLine) {
  EXPECT_EQ(printable_reason(std::string("disk\nfull\r\t\x1b[2J\0!\x7f caf\xc3\xa9", 24)),
            "disk full  ?[2J?!? caf\xc3\xa9");
  EXPECT_EQ(printable_reason(""), "");
}

TEST(TcpFrames, TheUnexpectedBudgetIsBounded) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "2T", 1);
  std::string e = "no error";
  try {
    make_tcp_transport(
        0, 1, {0}, [](const std::string& mine) { return std::vector<std::string>{mine}; }, Deadline::after(5));
  } catch (const ConfigError& err) {
    e = err.what();
  }
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  EXPECT_NE(e.find("CONDUIT_TCP_UNEXPECTED_BYTES=2T is more than 1T; allowed: 0 to 1T"), std::string::npos) << e;
}

namespace {

sockaddr_in parse_address(const std::string& a) {
  auto colon = a.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(a.substr(colon + 1))));
  inet_pton(AF_INET, a.substr(0, colon).c_str(), &sa.sin_addr);
  return sa;
}

// Rank 0 of 2 on loopback making its transport in the background (rank 1 is the test's), `*sa` its listening address
// and `*hello` the hello rank 1 of its job says.
std::future<TransportPtr> listening_rank0(double seconds, sockaddr_in* sa, FrameHeader* hello = nullptr) {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  auto addr = std::make_shared<std::promise<std::string>>();
  auto fut = addr->get_future();
  auto made = std::async(std::launch::async, [addr, seconds] {
    return make_tcp_transport(
        0, 2, {0, 0},
        [addr](const std::string& mine) {
          addr->set_value(mine);
          return std::vector<std::string>{mine, "unused:1"};
        },
        Deadline::after(seconds));
  });
  const std::string a = fut.get();
  *sa = parse_address(a);
  if (hello) *hello = make_frame(kFrameHello, tcp_job_fingerprint({a, "unused:1"}), 2, 1);
  return made;
}

}  // namespace

// Connections that say nothing, or half a hello, cost the real peer behind them no time: accepted connections are
// read side by side. (Read one at a time until its hello came, a silent connection kept the real peer in the backlog
// until the rendezvous deadline; then, dropped after 5 s each, three of them cost 15 s.) The ones still waiting are
// closed when the rendezvous ends.
TEST(TcpRendezvous, SilentConnectionsDoNotKeepTheRealPeerOut) {
  const auto t0 = std::chrono::steady_clock::now();
  sockaddr_in sa;
  FrameHeader hello;
  auto made = listening_rank0(9, &sa, &hello);
  std::vector<int> silent;
  for (int i = 0; i < 4; ++i) {
    silent.push_back(::socket(AF_INET, SOCK_STREAM, 0));
    ASSERT_EQ(::connect(silent.back(), reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  }
  ASSERT_EQ(::send(silent.back(), &hello, 10, 0), 10);  // the last one: a hello cut short
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  RawPeer real;
  real.fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(real.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::send(real.fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  std::shared_ptr<Transport> t;
  EXPECT_NO_THROW(t = made.get());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  for (int fd : silent) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 2000), 1) << "a waiting connection was left open";
    char c;
    EXPECT_LE(::recv(fd, &c, 1, 0), 0);  // closed (or reset) by rank 0
    ::close(fd);
  }
}

// A connection that says nothing is dropped after 5 s, and a rendezvous that then times out says so, naming where it
// came from; one that came a moment before the deadline is not blamed for 5 s of silence (it was, its wait cut short
// by the deadline).
TEST(TcpRendezvous, ATimeoutNamesTheConnectionDroppedForSayingNothing) {
  sockaddr_in sa;
  auto made = listening_rank0(6, &sa);
  const int silent = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(silent, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  pollfd p{silent, POLLIN, 0};
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::poll(&p, 1, 8000), 1);  // dropped: closed by rank 0
  EXPECT_GT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 4.0);
  sockaddr_in mine{};
  socklen_t len = sizeof mine;
  ASSERT_EQ(::getsockname(silent, reinterpret_cast<sockaddr*>(&mine), &len), 0);
  const int late = ::socket(AF_INET, SOCK_STREAM, 0);  // ~0.5 s before the deadline
  ASSERT_EQ(::connect(late, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  std::string error = "no error";
  try {
    made.get();
  } catch (const TimeoutError& e) {
    error = e.what();
  }
  EXPECT_NE(error.find(fmt::format("timed out waiting for 1 more peers to connect; the last connection dropped: no "
                                   "hello within 5 s (from 127.0.0.1:{})",
                                   ntohs(mine.sin_port))),
            std::string::npos)
      << error;
  ::close(silent);
  ::close(late);
}

// Two processes started with the same rank: the lower rank refuses the second one's hello and tells it why, so that
// rank fails at once naming the reason (it was closed without a word and later reported a plain close), while the
// lower rank's own timeout names it too.
TEST(TcpRendezvous, ASecondProcessWithTheSameRankIsToldWhyItWasRefused) {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  std::promise<std::string> addr;
  std::shared_future<std::string> addr0 = addr.get_future().share();
  auto run = [](std::function<TransportPtr()> make) {
    return std::async(std::launch::async, [make] {
      const auto t0 = std::chrono::steady_clock::now();
      std::string error = "no error";
      try {
        make();
      } catch (const Error& e) {
        error = e.what();
      }
      return std::make_pair(error, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    });
  };
  auto rank0 = run([&] {
    return make_tcp_transport(
        0, 3, {0, 0, 0},
        [&](const std::string& mine) {
          addr.set_value(mine);
          return std::vector<std::string>{mine, "unused:1", "unused:1"};
        },
        Deadline::after(6));
  });
  auto rank1 = [&] {
    return make_tcp_transport(
        1, 3, {0, 0, 0},
        [&](const std::string&) {
          return std::vector<std::string>{addr0.get(), "unused:1", "unused:1"};  // (both: rank 0's book)
        },
        Deadline::after(6));
  };
  addr0.wait();  // rank 0 listens; whichever rank 1 it accepts first is the one it keeps
  auto first = run(rank1);
  auto second = run(rank1);
  auto [e2, t2] = second.get();
  auto [e1, t1] = first.get();
  auto [e0, t0] = rank0.get();
  const std::string refused = "rank 0 refused the connection of rank 1: a second hello from rank 1";
  const bool second_refused = e2.find(refused) != std::string::npos;
  const std::string& e_refused = second_refused ? e2 : e1;
  const std::string& e_kept = second_refused ? e1 : e2;
  EXPECT_NE(e_refused.find(refused), std::string::npos) << e1 << "\n" << e2;
  EXPECT_LT(second_refused ? t2 : t1, 3.0) << e_refused;  // at once, not at the deadline
  EXPECT_NE(e_kept.find("timed out waiting for 1 more peers"), std::string::npos) << e_kept;
  EXPECT_NE(e0.find("the last connection refused: a second hello from rank 1"), std::string::npos) << e0;
}

// A hello from a rank of another job (its ranks published other addresses, or it has another world size: a rank of an
// earlier run, or of a job sharing the store, that reached this port) is refused with the reason, not adopted as rank
// 1 (before wire version 3 a hello named only its rank), and the real rank 1 still joins.
TEST(TcpRendezvous, AHelloFromAnotherJobIsRefusedAndTheRealPeerStillJoins) {
  sockaddr_in sa;
  FrameHeader hello;
  auto made = listening_rank0(9, &sa, &hello);
  auto refusal = [&](const FrameHeader& h) {
    RawPeer stranger;
    stranger.fd = ::socket(AF_INET, SOCK_STREAM, 0);
    EXPECT_EQ(::connect(stranger.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    EXPECT_EQ(::send(stranger.fd, &h, sizeof h, 0), static_cast<ssize_t>(sizeof h));
    FrameHeader r{};
    if (::recv(stranger.fd, &r, sizeof r, MSG_WAITALL) != static_cast<ssize_t>(sizeof r)) return std::string("closed");
    EXPECT_EQ(validate_frame(r, 0, 0), "");
    EXPECT_EQ(r.type, kFrameAbort);
    std::string why(r.length, '\0');
    EXPECT_EQ(::recv(stranger.fd, why.data(), why.size(), MSG_WAITALL), static_cast<ssize_t>(why.size()));
    return why;
  };
  const std::string other = refusal(make_frame(kFrameHello, hello.tag ^ 1, 2, 1));
  EXPECT_NE(other.find("hello from rank 1 of another job: its ranks published other addresses"), std::string::npos)
      << other;
  const std::string bigger = refusal(make_frame(kFrameHello, hello.tag, 3, 1));
  EXPECT_NE(bigger.find("hello from rank 1 of a job of 3 ranks, not this job's 2"), std::string::npos) << bigger;
  RawPeer real;
  real.fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(real.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::send(real.fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  EXPECT_NO_THROW(made.get());
}

// The connecting rank checks the answer too: a lower "rank" of another job that answers its hello (a port of this
// job's book now held by another run) ends the rendezvous at once naming it.
TEST(TcpRendezvous, AnAnswerFromAnotherJobIsAProtocolError) {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  RawPeer rank0;  // a listener speaking raw bytes
  rank0.fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ASSERT_EQ(::bind(rank0.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(rank0.fd, 4), 0);
  socklen_t len = sizeof sa;
  ASSERT_EQ(::getsockname(rank0.fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  const std::vector<std::string> book = {fmt::format("127.0.0.1:{}", ntohs(sa.sin_port)), "unused:1"};
  auto made = std::async(std::launch::async, [&] {
    const auto t0 = std::chrono::steady_clock::now();
    std::string error = "no error";
    try {
      make_tcp_transport(
          1, 2, {0, 0}, [&](const std::string&) { return book; }, Deadline::after(8));
    } catch (const ProtocolError& e) {
      error = e.what();
    }
    return std::make_pair(error, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  });
  RawPeer conn;
  conn.fd = ::accept(rank0.fd, nullptr, nullptr);
  ASSERT_GE(conn.fd, 0);
  FrameHeader h{};
  ASSERT_EQ(::recv(conn.fd, &h, sizeof h, MSG_WAITALL), static_cast<ssize_t>(sizeof h));
  EXPECT_EQ(validate_frame(h, 1, 0), "");
  EXPECT_EQ(h.type, kFrameHello);
  EXPECT_EQ(h.tag, tcp_job_fingerprint(book));  // rank 1 names its job and size
  EXPECT_EQ(h.length, 2u);
  const FrameHeader answer = make_frame(kFrameHello, h.tag + 1, 2, 0);
  ASSERT_EQ(::send(conn.fd, &answer, sizeof answer, 0), static_cast<ssize_t>(sizeof answer));
  auto [error, seconds] = made.get();
  EXPECT_NE(error.find("tcp: rank 1 got a bad handshake from rank 0: hello from rank 0 of another job"),
            std::string::npos)
      << error;
  EXPECT_LT(seconds, 5.0) << error;  // at once, not at the deadline
}

// The job fingerprint tells books apart that concatenate alike, and depends on the order of the ranks.
TEST(Wire, TheJobFingerprintTellsAddressBooksApart) {
  const uint64_t a = tcp_job_fingerprint({"10.0.0.1:5000", "10.0.0.2:5000"});
  EXPECT_EQ(a, tcp_job_fingerprint({"10.0.0.1:5000", "10.0.0.2:5000"}));
  EXPECT_NE(a, tcp_job_fingerprint({"10.0.0.2:5000", "10.0.0.1:5000"}));
  EXPECT_NE(a, tcp_job_fingerprint({"10.0.0.1:5000", "10.0.0.2:5001"}));
  EXPECT_NE(tcp_job_fingerprint({"ab", "c"}), tcp_job_fingerprint({"a", "bc"}));
  EXPECT_NE(tcp_job_fingerprint({"a"}), tcp_job_fingerprint({"a", ""}));
}

// The address a peer published is checked: a port that is not a number 1..65535 is a protocol error naming the
// rank and the value (it was `stoi`, or a port truncated to 16 bits).
TEST(TcpRendezvous, BadPublishedAddressIsAProtocolError) {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  for (std::string bad : {"127.0.0.1:notaport", "127.0.0.1:99999999999", "127.0.0.1:0", "localhost:80", "nocolon"}) {
    try {
      make_tcp_transport(
          1, 2, {0, 0},
          [&](const std::string& mine) {
            return std::vector<std::string>{bad, mine};
          },
          Deadline::after(5));
      ADD_FAILURE() << bad << ": no error";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 published the address '" + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

// Connecting honours the deadline even when the peer's host never answers (a listener whose accept queue is full
// drops the SYNs; a blocking connect waited for the kernel's retries, about two minutes).
TEST(TcpRendezvous, ConnectHonoursTheDeadline) {
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  ASSERT_EQ(::listen(lfd, 0), 0);
  socklen_t len = sizeof sa;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::vector<int> fillers;  // fill the accept queue (never accepted)
  for (int i = 0; i < 4; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    fillers.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string where = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
  const auto t0 = std::chrono::steady_clock::now();
  std::string error = "no error";
  try {
    make_tcp_transport(
        1, 2, {0, 0},
        [&](const std::string& mine) {
          return std::vector<std::string>{where, mine};
        },
        Deadline::after(2));
  } catch (const Error& e) {
    error = e.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(error.find("could not connect to rank 0"), std::string::npos) << error;
  EXPECT_LT(took, 5.0) << error;
  for (int fd : fillers) ::close(fd);
  ::close(lfd);
}

// Found by a review: a send that failed for a reason of this rank's own (EFAULT: a buffer of no readable memory,
// ENOBUFS) left the connection open with the frame's header sent, so the peer's receive waited for the payload until
// its deadline. The connection now ends: the peer's receive fails at once, naming the truncated frame.
TEST(Transports, ATcpSendThatFailsOnItsOwnBufferEndsTheConnection) {
  auto pair = test_util::make_transport_pair("tcp");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* none = ::mmap(nullptr, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(none, MAP_FAILED);
  const uint64_t tag = make_tag(kUser, 0, 1);
  std::vector<char> in(page);
  auto recv = pair[1]->irecv(0, tag, in.data(), page);
  auto send = pair[0]->isend(1, tag, none, page);
  EXPECT_THROW(send->wait(Deadline::after(5)), PeerError);
  const auto t0 = std::chrono::steady_clock::now();
  std::string error = "no error";
  try {
    recv->wait(Deadline::after(20));
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(waited, 5.0) << error;
  EXPECT_EQ(error.find("deadline"), std::string::npos) << error;
  EXPECT_NE(error, "no error");
  ::munmap(none, page);
}

// Messages are ordered per tag only (transport.h): a receiver may take a small message sent after a large one first.
// When the large one has no receive yet and exceeds the unexpected budget, the connection used to stall and the small
// one behind it was never read (a valid program deadlocked until the deadline); with a receive of another tag
// waiting, the large message is buffered past the budget instead. Each with a 1 MiB budget (shm's was fixed at
// 64 MiB: the test sent 65 MiB).
TEST(Transports, ASmallMessageOvertakesALargeUnmatchedOne) {
  for (std::string kind : {"tcp", "shm"}) {
    setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "1M", 1);
    setenv("CONDUIT_SHM_UNEXPECTED_BYTES", "1M", 1);
    setenv("CONDUIT_SHM_SINGLE_COPY_BYTES", "off", 1);  // the large message goes through the ring
    const size_t big = size_t{2} << 20;
    auto pair = test_util::make_transport_pair(kind);
    unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
    unsetenv("CONDUIT_SHM_UNEXPECTED_BYTES");
    unsetenv("CONDUIT_SHM_SINGLE_COPY_BYTES");
    std::vector<std::string> errors(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        try {
          Transport& t = *pair[r];
          const uint64_t a = make_tag(kUser, 0, 1), b = make_tag(kUser, 0, 2);
          std::vector<char> buf(big, r == 0 ? 7 : 0);
          int small = 42, got = 0;
          if (r == 0) {
            auto s1 = t.isend(1, a, buf.data(), big);
            auto s2 = t.isend(1, b, &small, 4);
            s2->wait(Deadline::after(10));
            s1->wait(Deadline::after(10));
          } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the large message arrives first
            t.irecv(0, b, &got, 4)->wait(Deadline::after(5));
            t.irecv(0, a, buf.data(), big)->wait(Deadline::after(5));
            if (got != 42 || buf.front() != 7 || buf.back() != 7) errors[r] = "wrong data";
          }
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    EXPECT_EQ(errors[0], "") << kind;
    EXPECT_EQ(errors[1], "") << kind;
  }
}

// Rank 2 aborts with a send to rank 0 cut mid-frame (rank 0 never took it), so its abort frame reaches rank 1 only.
// Rank 1's transport fails every peer on it; when rank 1 then aborts with its own reason, rank 0, which waits only on
// rank 1, must hear it at once (it was sent only to peers not failed yet: rank 0 waited for its deadline).
TEST(TcpAbort, ARankFailedByAnothersAbortStillTellsThePeerWaitingOnIt) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "64K", 1);
  auto ts = test_util::make_transport_world("tcp", 3);
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  const uint64_t tag = make_tag(kUser, 0, 1);
  uint64_t v = 0;
  auto waiting = ts[0]->irecv(1, tag, &v, sizeof v);
  std::vector<char> big(16 << 20, 'x');
  auto cut = ts[2]->isend(0, tag, big.data(), big.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // (as much of it written as the sockets take)
  ts[2]->abort("rank 2 broke");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ts[1]->aborted_reason().empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_NE(ts[1]->aborted_reason().find("rank 2 broke"), std::string::npos) << ts[1]->aborted_reason();
  ts[1]->abort("rank 1 gives up");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    waiting->wait(Deadline::after(20));
    ADD_FAILURE() << "the receive from an aborted rank completed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 gives up"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5);
  EXPECT_TRUE(cut->done());
}

// Rank 0 aborts with a 16 MiB frame to rank 1 cut mid-frame, which rank 1 holds unread (over its unexpected budget,
// no receive posted for it) while it waits on another tag: the abort cannot finish the frame, and the end of the
// stream waited behind its unread bytes (rank 1's window shut), so rank 1 waited for its whole deadline. The abort
// resets such a connection: rank 1's receive fails at once.
TEST(TcpAbort, AnAbortStuckBehindAHeldFrameResetsTheConnection) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "64K", 1);
  auto ts = test_util::make_transport_world("tcp", 2);
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  std::vector<char> big(16 << 20, 'x');
  auto held = ts[0]->isend(1, make_tag(kUser, 0, 1), big.data(), big.size());
  int32_t other = 0;
  auto waiter = ts[1]->irecv(0, make_tag(kUser, 0, 2), &other, sizeof other);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // (as much of it written as the sockets take)
  ASSERT_FALSE(held->done());
  const auto t0 = std::chrono::steady_clock::now();
  ts[0]->abort("rank 0 broke");
  std::string e = "no error";
  try {
    waiter->wait(Deadline::after(20));
  } catch (const Error& err) {
    e = err.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(took, 5.0) << e;
  EXPECT_EQ(e.find("did not complete before the deadline"), std::string::npos) << e;
  EXPECT_NE(e, "no error");
}

// Rank 0 aborts with a send to rank 1 cut mid-frame (rank 1 holds it unread until it posts the receive). Its abort
// finishes that frame before the abort frame, so rank 1, posting the receive then, reads the reason; the stream
// ending inside the frame told rank 1 only that the connection closed.
TEST(TcpAbort, AnAbortFinishesASendCutMidFrameSoThePeerHearsTheReason) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "64K", 1);
  auto ts = test_util::make_transport_world("tcp", 2);
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  const uint64_t tag = make_tag(kUser, 0, 1);
  std::vector<char> big(16 << 20, 'x');
  auto cut = ts[0]->isend(1, tag, big.data(), big.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // (as much of it written as the sockets take)
  ASSERT_FALSE(cut->done());
  std::thread aborting([&] { ts[0]->abort("rank 0 broke"); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // (the abort waits for the frame to be read)
  std::vector<char> got(big.size());
  auto r = ts[1]->irecv(0, tag, got.data(), got.size());
  try {
    r->wait(Deadline::after(20));
  } catch (const Error&) {  // (whether the message or the abort is seen first)
  }
  aborting.join();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ts[1]->aborted_reason().empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_NE(ts[1]->aborted_reason().find("rank 0 aborted: rank 0 broke"), std::string::npos)
      << "rank 1's reason: '" << ts[1]->aborted_reason() << "'";
}
