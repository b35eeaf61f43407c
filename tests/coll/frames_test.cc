// Malformed frames sent from a raw socket to a tcp transport are rejected on that connection with a clear error,
// never a crash; the frame validator is checked field by field.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>

#include "core/error.h"
#include "net/tags.h"
#include "net/tcp.h"
#include "net/wire.h"

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
  FrameHeader hello = make_frame(kFrameHello, 0, 0, 1);
  EXPECT_EQ(::send(p->fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  p->t = made.get();
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
