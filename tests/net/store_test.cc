// Rendezvous stores: TCP (server thread, clients across threads and processes, malformed input, server death),
// file store, and the allgather/barrier helpers. No fixed ports: servers bind port 0.
#include "net/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <thread>
#include <tuple>

#include "../test_port.h"
#include "core/error.h"
#include "net/tcp_store.h"

namespace conduit::net {
namespace {

StorePtr start_server(int* port) {
  auto s = make_tcp_store("127.0.0.1", 0, true, Deadline::after(10));
  *port = tcp_store_port(*s);
  return s;
}

// A server started under CONDUIT_STORE_MAX_BYTES = limit (the variable is read as it starts).
StorePtr start_server_limited(const char* limit, int* port) {
  setenv("CONDUIT_STORE_MAX_BYTES", limit, 1);
  auto s = start_server(port);
  unsetenv("CONDUIT_STORE_MAX_BYTES");
  return s;
}

StorePtr client(int port, double connect_seconds = 10) {
  return make_tcp_store("127.0.0.1", port, false, Deadline::after(connect_seconds));
}

// A port free a moment ago, and outside the kernel's ephemeral range (tests/test_port.h).
int free_port() { return conduit::test::unused_port(); }

// rcvbuf > 0: the socket's receive buffer, set before connecting (the kernel then takes little of a reply nobody
// reads).
int raw_connect(int port, int rcvbuf = 0) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Waits for a child with a bound; kills it when the bound passes. Returns its exit code (or -signal).
int wait_child(pid_t pid, double seconds = 30) {
  Stopwatch sw;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (sw.seconds() > seconds) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1000;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

class TempDir {
 public:
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "conduit_store_XXXXXX").string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The semantics every store shares.
void basic_semantics(Store& s) {
  EXPECT_FALSE(s.check("a"));
  s.set("a", "hello");
  EXPECT_TRUE(s.check("a"));
  EXPECT_EQ(s.get("a", Deadline::after(5)), "hello");
  s.set("a", "again");
  EXPECT_EQ(s.get("a", Deadline::after(5)), "again");
  std::string bin("\0\x01\xff binary", 10);
  s.set("bin", bin);
  EXPECT_EQ(s.get("bin", Deadline::after(5)), bin);
  s.set("empty", "");
  EXPECT_TRUE(s.check("empty"));
  EXPECT_EQ(s.get("empty", Deadline::after(5)), "");
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -2), 3);
  EXPECT_EQ(s.add("n", 0), 3);
  EXPECT_EQ(s.get("n", Deadline::after(5)), "3");
  EXPECT_THROW(s.add("a", 1), InvalidArgument);
  // Only a whole decimal integer counts (strtoll took " +7" as 7, and "5\0x" as 5, stopping at the NUL).
  for (const std::string& v : {std::string(" +7"), std::string("+7"), std::string("5\0x", 3), std::string("7 ")}) {
    s.set("odd", v);
    EXPECT_THROW(s.add("odd", 1), InvalidArgument) << v;
    EXPECT_EQ(s.get("odd", Deadline::after(5)), v);
  }
  s.set("neg", "-7");
  EXPECT_EQ(s.add("neg", 1), -6);
  // A counter past int64's range is refused and keeps its value (it wrapped to the most negative, answered as ok).
  const std::string top = std::to_string(std::numeric_limits<int64_t>::max());
  s.set("big", top);
  try {
    s.add("big", 1);
    ADD_FAILURE() << "an add past int64 was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add of 1 on key 'big' (value " + top + ") would overflow a 64-bit integer"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(s.get("big", Deadline::after(5)), top);
  EXPECT_EQ(s.add("big", -1), std::numeric_limits<int64_t>::max() - 1);
  // Keys with separators, dots and odd bytes stay distinct.
  s.set("x/y", "1");
  s.set("x%2Fy", "2");
  s.set("..", "3");
  s.set("sp ace", "4");
  EXPECT_EQ(s.get("x/y", Deadline::after(5)), "1");
  EXPECT_EQ(s.get("x%2Fy", Deadline::after(5)), "2");
  EXPECT_EQ(s.get("..", Deadline::after(5)), "3");
  EXPECT_EQ(s.get("sp ace", Deadline::after(5)), "4");
  std::string long_a(400, 'a'), long_b = std::string(399, 'a') + "b";
  s.set(long_a, "A");
  s.set(long_b, "B");
  EXPECT_EQ(s.get(long_a, Deadline::after(5)), "A");
  EXPECT_EQ(s.get(long_b, Deadline::after(5)), "B");
}

// (Whether the get returned before the set is read from the future itself, not from a clock started in the reading
// thread: a thread scheduled 50 ms late on a loaded machine measured under 0.1 s and failed.)
void get_blocks_until_set(Store& reader, Store& writer) {
  Stopwatch sw;
  auto f = std::async(std::launch::async, [&] { return reader.get("late", Deadline::after(10)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::timeout) << "the get returned before the set";
  writer.set("late", "now");
  EXPECT_EQ(f.get(), "now");
  EXPECT_LT(sw.seconds(), 5.0);
}

void get_times_out(Store& s, const std::string& where) {
  Stopwatch sw;
  try {
    s.get("never/set", Deadline::after(0.2));
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("never/set"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(where), std::string::npos) << e.what();
  }
  EXPECT_GE(sw.seconds(), 0.19);
  EXPECT_LT(sw.seconds(), 2.0);
  // The store stays usable after a timeout.
  s.set("after", "ok");
  EXPECT_EQ(s.get("after", Deadline::after(5)), "ok");
}

// ---------------------------------------------------------------------------------------------- TCP store

TEST(TcpStore, SetGetAddCheck) {
  int port = 0;
  auto server = start_server(&port);
  EXPECT_GT(port, 0);
  basic_semantics(*server);
  auto c = client(port);
  EXPECT_EQ(c->get("a", Deadline::after(5)), "again");
  EXPECT_EQ(c->add("n", 1), 4);
}

// A connect that met itself (its source port the one it dialled, nothing listening there) is told apart from a
// server: made here directly, by binding the socket to the address it then connects to.
TEST(TcpStore, AConnectionToItselfIsToldApart) {
  const int port = conduit::test::unused_port();
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  EXPECT_TRUE(conduit::net::connected_to_itself(fd));
  ::close(fd);
  // and a real server's connection is not
  int sport = 0;
  auto server = start_server(&sport);
  const int c = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  a.sin_port = htons(static_cast<uint16_t>(sport));
  ASSERT_EQ(::connect(c, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  EXPECT_FALSE(conduit::net::connected_to_itself(c));
  ::close(c);
}

TEST(TcpStore, LargeValue) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  std::string big(8 << 20, 'x');
  for (size_t i = 0; i < big.size(); i += 4093) big[i] = static_cast<char>(i);
  c->set("big", big);
  EXPECT_EQ(server->get("big", Deadline::after(10)), big);
  EXPECT_THROW(c->set("huge", std::string(kMaxStoreFieldBytes + 1, 'y')), InvalidArgument);
}

// The server holds at most CONDUIT_STORE_MAX_BYTES of keys and values (a client setting ever more keys grew rank 0
// without bound): a set past it is refused with one line, the store unchanged; replacing a value counts only the
// difference; the limit's own value is checked when the server starts.
TEST(TcpStore, TheServerHoldsAtMostItsLimit) {
  int port = 0;
  auto server = start_server_limited("1M", &port);
  auto c = client(port);
  const std::string part(600 << 10, 'a');
  c->set("a", part);
  try {
    c->set("b", part);
    ADD_FAILURE() << "a set past the limit was taken";
  } catch (const InvalidArgument& e) {
    // (refused as it arrives: 600 KiB come in several reads, and the store passes its limit before the last)
    const std::string m = e.what();
    EXPECT_NE(m.find("set of key 'b' rejected: the store holds 614497 bytes besides the "), std::string::npos) << m;
    EXPECT_NE(m.find(" bytes of this request of 614425 received so far, which take it past CONDUIT_STORE_MAX_BYTES = "
                     "1048576"),
              std::string::npos)
        << m;
  }
  EXPECT_FALSE(c->check("b"));
  // A get waiting for its key holds its key too: one that would pass the limit is refused at once (not parked until
  // its deadline; this one as its key arrives, which it would hold as well); a short one waits as ever.
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c->get(std::string(500 << 10, 'k'), Deadline::after(20));
    ADD_FAILURE() << "a waiting get past the limit was parked";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the store holds 614497 bytes besides the "), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("this request of 512024 received so far, which take it past "
                                         "CONDUIT_STORE_MAX_BYTES = 1048576"),
              std::string::npos)
        << std::string(e.what()).substr(0, 300);
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_THROW(c->get("missing", Deadline::after(0.2)), TimeoutError);
  c->set("a", std::string(100 << 10, 'a'));  // (replaced: the old value's bytes given back)
  c->set("b", part);
  EXPECT_EQ(c->get("b", Deadline::after(10)), part);
  EXPECT_EQ(c->add("n", 5), 5);
  for (const char* bad : {"512K", "2T", "lots"}) {
    setenv("CONDUIT_STORE_MAX_BYTES", bad, 1);
    try {
      start_server(&port);
      ADD_FAILURE() << bad << " was taken";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("CONDUIT_STORE_MAX_BYTES"), std::string::npos) << e.what();
    }
  }
  unsetenv("CONDUIT_STORE_MAX_BYTES");
}

TEST(TcpStore, GetBlocksUntilLaterSet) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  get_blocks_until_set(*c, *server);
}

TEST(TcpStore, GetDeadlineThrowsTimeoutNamingKeyAndAddress) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  get_times_out(*c, "127.0.0.1:" + std::to_string(port));
}

TEST(TcpStore, ExpiredDeadlineIsTimeoutNotPeerError) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  c->set("k", "v");
  // Two concurrent gets: the second needs a fresh pooled connection, which must not be a PeerError.
  auto f = std::async(std::launch::async, [&] { return c->get("k", Deadline::after(5)); });
  EXPECT_EQ(f.get(), "v");
  EXPECT_THROW(c->get("missing", Deadline::after(0)), TimeoutError);
  EXPECT_THROW(c->get("missing", Deadline::after(-1)), TimeoutError);
  EXPECT_EQ(c->get("k", Deadline::after(5)), "v");
}

TEST(TcpStore, ThreadsShareOneStoreAndCount) {
  int port = 0;
  auto server = start_server(&port);
  auto shared = client(port);
  constexpr int kThreads = 8, kAdds = 50;
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      try {
        // Half the threads share one client (and block in get at the same time), half have their own.
        StorePtr own = t % 2 ? client(port) : nullptr;
        Store& s = own ? *own : *shared;
        for (int i = 0; i < kAdds; ++i) s.add("count", 1);
        s.set("t" + std::to_string(t), std::to_string(t));
        for (int o = 0; o < kThreads; ++o) {
          if (s.get("t" + std::to_string(o), Deadline::after(10)) != std::to_string(o)) failures++;
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(server->add("count", 0), kThreads * kAdds);
}

TEST(TcpStore, ManyClientsParkedOnOneKeyWakeTogether) {
  int port = 0;
  auto server = start_server(&port);
  constexpr int kClients = 48;
  std::vector<StorePtr> clients;
  for (int i = 0; i < kClients; ++i) clients.push_back(client(port));
  std::vector<std::future<std::string>> gets;
  for (auto& c : clients) {
    gets.push_back(std::async(std::launch::async, [c] { return c->get("go", Deadline::after(20)); }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Stopwatch sw;
  server->set("go", "now");
  for (auto& g : gets) EXPECT_EQ(g.get(), "now");
  EXPECT_LT(sw.seconds(), 5.0);
}

TEST(TcpStore, ClientConnectsBeforeServerStarts) {
  int port = free_port();
  auto f = std::async(std::launch::async, [&] {
    auto c = client(port, 10);
    return c->get("k", Deadline::after(10));
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto server = make_tcp_store("127.0.0.1", port, true, Deadline::after(10));
  server->set("k", "v");
  EXPECT_EQ(f.get(), "v");
}

TEST(TcpStore, ConnectDeadlineWithoutServer) {
  int port = free_port();
  Stopwatch sw;
  try {
    client(port, 0.3);
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
  EXPECT_LT(sw.seconds(), 3.0);
}

TEST(TcpStore, Ipv6Loopback) {
  StorePtr server;
  try {
    server = make_tcp_store("[::1]", 0, true, Deadline::after(5));
  } catch (const ConfigError& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  auto c = make_tcp_store("::1", tcp_store_port(*server), false, Deadline::after(5));
  c->set("k", "v6");
  EXPECT_EQ(server->get("k", Deadline::after(5)), "v6");
}

// MASTER_ADDR that is not a loopback address: the server listens on every interface (it listened on that address
// only, so a Kubernetes service address or a floating IP could not start a job, and a host name resolving to
// loopback here refused the other hosts). A loopback MASTER_ADDR keeps the job on this machine.
TEST(TcpStore, ServerListensEverywhereUnlessMasterAddrIsLoopback) {
  EXPECT_EQ(store_listen_host("127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(store_listen_host("127.3.2.1"), "127.3.2.1");
  EXPECT_EQ(store_listen_host("::1"), "::1");
  EXPECT_EQ(store_listen_host("::ffff:127.0.0.1"), "::ffff:127.0.0.1");
  EXPECT_EQ(store_listen_host("10.255.255.1"), "*");
  EXPECT_EQ(store_listen_host("node7.cluster"), "*");
  EXPECT_EQ(store_listen_host("localhost"), "*");
  // ... but "localhost" never names another machine: its server serves loopback peers only (it served any host).
  EXPECT_TRUE(names_localhost("localhost"));
  EXPECT_TRUE(names_localhost("LocalHost."));
  EXPECT_TRUE(names_localhost("db.localhost"));
  EXPECT_FALSE(names_localhost("notlocalhost"));
  EXPECT_FALSE(names_localhost("127.0.0.1"));
  // A name that does not resolve fails at once on rank 0 (listening everywhere needs no address, but its own
  // client does: it waited out the connect deadline and blamed rank 0).
  try {
    make_tcp_store("nosuchhost.invalid", 0, true, Deadline::after(60));
    ADD_FAILURE() << "an unresolvable MASTER_ADDR was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot resolve server address 'nosuchhost.invalid"), std::string::npos)
        << e.what();
  }
  // A name: reachable over IPv4 and (where the host has it) IPv6 loopback alike.
  auto server = make_tcp_store("localhost", 0, true, Deadline::after(5));
  const int port = tcp_store_port(*server);
  make_tcp_store("127.0.0.1", port, false, Deadline::after(5))->set("k4", "v4");
  EXPECT_EQ(server->get("k4", Deadline::after(5)), "v4");
  const int probe = socket(AF_INET6, SOCK_STREAM, 0);
  if (probe >= 0) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    const bool v6 = bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    close(probe);
    if (v6) {
      make_tcp_store("::1", port, false, Deadline::after(5))->set("k6", "v6");
      EXPECT_EQ(server->get("k6", Deadline::after(5)), "v6");
    }
  }
  // From this host's own non-loopback address (where it has one), the "localhost" server is not served.
  ifaddrs* ifs = nullptr;
  std::string external;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i != nullptr && external.empty(); i = i->ifa_next)
      if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET) {
        char name[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, name, sizeof name);
        if (store_listen_host(name) == "*") external = name;
      }
    freeifaddrs(ifs);
  }
  if (external.empty()) GTEST_SKIP() << "no non-loopback IPv4 address to connect from";
  EXPECT_ANY_THROW(make_tcp_store(external, port, false, Deadline::after(2))->set("k", "v")) << external;
}

// A store server that accepts connections and never answers: a barrier's arrival and its count of arrivals end by
// the barrier's deadline (set and add took CONDUIT_TIMEOUT, 300 s, whatever the caller's deadline, and the count
// after a timed-out wait took another 300 s and replaced the TimeoutError).
TEST(TcpStore, EveryCallEndsByItsDeadlineAgainstAServerThatNeverAnswers) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(lfd, 16), 0);
  socklen_t len = sizeof a;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  auto c = make_tcp_store("127.0.0.1", ntohs(a.sin_port), false, Deadline::after(5));
  for (const auto& call : std::vector<std::function<void()>>{
           [&] { store_barrier(*c, "b", 1, 2, Deadline::after(0.5)); },
           [&] { c->set("k", "v", Deadline::after(0.5)); },
           [&] { c->check("k", Deadline::after(0.5)); },
       }) {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_THROW(call(), TimeoutError);
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  }
  close(lfd);
}

TEST(TcpStore, BadPortIsConfigError) {
  EXPECT_THROW(make_tcp_store("127.0.0.1", 70000, true, Deadline::after(1)), ConfigError);
  EXPECT_THROW(make_tcp_store("127.0.0.1", 0, false, Deadline::after(1)), ConfigError);
  int port = 0;
  auto server = start_server(&port);
  EXPECT_THROW(make_tcp_store("127.0.0.1", port, true, Deadline::after(1)), ConfigError);  // in use
}

TEST(TcpStore, MalformedFramesDropOnlyThatClient) {
  int port = 0;
  auto server = start_server(&port);
  auto good = client(port);
  good->set("before", "1");

  // Closed by the server: an orderly end or a reset, not raw_connect's 5 s receive timeout (which passed as well).
  auto expect_dropped = [](int fd) {
    char b[64];
    ssize_t n = recv(fd, b, sizeof(b), 0);
    const int e = errno;
    EXPECT_TRUE(n == 0 || (n < 0 && e == ECONNRESET))
        << "server should have closed the connection (recv " << n << ", " << std::strerror(e) << ")";
    close(fd);
  };
  {  // garbage
    int fd = raw_connect(port);
    const char junk[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_GT(send(fd, junk, sizeof(junk), MSG_NOSIGNAL), 0);
    expect_dropped(fd);
  }
  {  // right magic and version, oversized key length
    int fd = raw_connect(port);
    unsigned char h[24] = {0x43, 0x44, 0x53, 0x54, 1, 0, 1, 0};
    uint32_t huge = 0xfffffff0u;
    std::memcpy(h + 16, &huge, 4);
    ASSERT_EQ(send(fd, h, sizeof(h), MSG_NOSIGNAL), 24);
    expect_dropped(fd);
  }
  {  // wrong version
    int fd = raw_connect(port);
    unsigned char h[24] = {0x43, 0x44, 0x53, 0x54, 9, 0, 1, 0};
    ASSERT_EQ(send(fd, h, sizeof(h), MSG_NOSIGNAL), 24);
    expect_dropped(fd);
  }
  {  // unknown op
    int fd = raw_connect(port);
    unsigned char h[24] = {0x43, 0x44, 0x53, 0x54, 1, 0, 0x42, 0};
    ASSERT_EQ(send(fd, h, sizeof(h), MSG_NOSIGNAL), 24);
    expect_dropped(fd);
  }
  {  // add with a wrong value length
    int fd = raw_connect(port);
    unsigned char h[24 + 1 + 3] = {0x43, 0x44, 0x53, 0x54, 1, 0, 3, 0};
    h[16] = 1;
    h[20] = 3;
    ASSERT_EQ(send(fd, h, sizeof(h), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(h)));
    expect_dropped(fd);
  }
  {  // truncated frame: a header announcing 100 key bytes, then 10, then close
    int fd = raw_connect(port);
    unsigned char h[24 + 10] = {0x43, 0x44, 0x53, 0x54, 1, 0, 1, 0};
    h[16] = 100;
    ASSERT_EQ(send(fd, h, sizeof(h), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(h)));
    close(fd);
  }
  {  // half a header, then close
    int fd = raw_connect(port);
    ASSERT_EQ(send(fd, "CDST", 4, MSG_NOSIGNAL), 4);
    close(fd);
  }
  // The server still serves everyone else.
  EXPECT_EQ(good->get("before", Deadline::after(5)), "1");
  auto fresh = client(port);
  fresh->set("after", "2");
  EXPECT_EQ(good->get("after", Deadline::after(5)), "2");
  EXPECT_EQ(server->add("c", 1), 1);
}

namespace {
// Sends `n` gets of a 3-letter key on a raw connection without reading anything (request ids 1..n).
void send_raw_gets(int fd, const char* key, int n) {
  unsigned char h[24 + 3] = {0x43, 0x44, 0x53, 0x54, 1, 0, 2, 0};
  h[16] = 3;
  std::memcpy(h + 24, key, 3);
  for (int i = 0; i < n; ++i) {
    h[8] = static_cast<unsigned char>(i + 1);  // request id
    ASSERT_EQ(send(fd, h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
  }
}

long vm_rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}
}  // namespace

namespace {
// A raw request header (op, request id, key and value lengths) as the store's wire format has it.
std::string raw_header(uint8_t op, uint8_t id, uint32_t key_len, uint32_t value_len) {
  std::string h(24, '\0');
  const unsigned char start[8] = {0x43, 0x44, 0x53, 0x54, 1, 0, op, 0};
  std::memcpy(h.data(), start, 8);
  h[8] = static_cast<char>(id);
  std::memcpy(h.data() + 16, &key_len, 4);
  std::memcpy(h.data() + 20, &value_len, 4);
  return h;
}
void send_all(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    ASSERT_GT(n, 0) << std::strerror(errno);
    sent += size_t(n);
  }
}
// The reply to a request: (request id, status, value); id 0 when none came within raw_connect's 5 s.
std::tuple<int, int, std::string> raw_reply(int fd) {
  unsigned char h[24];
  if (recv(fd, h, sizeof h, MSG_WAITALL) != 24) return {0, -1, ""};
  uint32_t len;
  std::memcpy(&len, h + 20, 4);
  std::string v(len, '\0');
  if (len > 0 && recv(fd, v.data(), len, MSG_WAITALL) != static_cast<ssize_t>(len)) return {0, -1, ""};
  return {h[8], h[7], v};
}
}  // namespace

// A request still arriving counts against the limit by the bytes received: clients that each sent most of a 64 MiB
// value and stopped held 64 MiB apiece in rank 0, uncounted. One that takes the store past the limit is refused as it
// arrives, its bytes discarded as they come (the connection stays in step); a client that leaves mid-request gives its
// bytes back; and a header with nothing behind it holds only itself (charging the size it announced let a few such
// headers block the store).
TEST(TcpStore, ARequestStillArrivingCountsAgainstTheLimit) {
  int port = 0;
  auto server = start_server_limited("2M", &port);
  const uint32_t big = 1200000;
  const std::string body(big, 'v');
  int a = raw_connect(port), b = raw_connect(port);
  send_all(a, raw_header(1, 1, 3, big) + "aaa" + body.substr(0, 1100000));  // most of a set, then nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // b's whole set passes the limit beside a's 1.1 MB as it arrives: refused before it is in.
  send_all(b, raw_header(1, 1, 3, big) + "bbb" + body + raw_header(4, 2, 3, 0) + "bbb");  // then a check
  auto [id, status, why] = raw_reply(b);
  EXPECT_EQ(id, 1);
  EXPECT_EQ(status, 2);  // bad request
  // (a's bytes so far, told apart as a request still arriving: found by an audit, one stalled half-sent request read
  // as values the store held)
  EXPECT_NE(why.find("the store holds 1100027 bytes (1100027 of them requests still arriving, released when they end "
                     "or after 30 s without progress) besides the "),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("bytes of this request of 1200027 received so far, which take it past CONDUIT_STORE_MAX_BYTES = "
                     "2097152"),
            std::string::npos)
      << why;
  auto [id2, status2, v2] = raw_reply(b);  // the check after it, answered in step
  EXPECT_EQ(id2, 2);
  EXPECT_EQ(status2, 1);  // not found: the refused set left nothing
  auto c = client(port);
  try {
    c->set("ccc", std::string(1000000, 'c'));  // 1.1 MB + 1 MB > 2 MiB
    ADD_FAILURE() << "a set past the limit was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("(1100027 of them requests still arriving"), std::string::npos) << e.what();
  }
  close(a);  // gone in the middle of its set: its bytes given back
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(c->check("aaa"));
  // A header announcing 1.9 MB with nothing behind it, then a set of 1.5 MB: taken.
  int d = raw_connect(port);
  send_all(d, raw_header(1, 1, 3, 1900000));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_NO_THROW(c->set("ccc", std::string(1500000, 'c')));
  close(b);
  close(d);
}

// A client that sent part of a request and nothing more is dropped after a while (30 s; here 3 s), and the bytes it
// held against the limit given back (found by an audit: a stalled half-sent request held them for ever, and the
// store refused the ranks' values). A client that sends its requests whole, however idle between them, stays.
TEST(TcpStore, AClientStalledMidRequestIsDroppedAndItsBytesReleased) {
  set_tcp_store_server_limits_for_testing(3, 0);  // (3 s: the refusal below must come before it, under load too)
  int port = 0;
  auto server = start_server_limited("2M", &port);
  set_tcp_store_server_limits_for_testing(0, 0);
  auto c = client(port);
  int a = raw_connect(port);
  send_all(a, raw_header(1, 1, 3, 1200000) + "aaa" + std::string(1100000, 'v'));  // most of a set, then nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_THROW(c->set("ccc", std::string(1000000, 'c')), InvalidArgument);  // 1.1 MB + 1 MB > 2 MiB
  std::this_thread::sleep_for(std::chrono::milliseconds(4500));
  char byte;
  const timeval wait{20, 0};  // (a regression fails here, not at ctest's timeout)
  setsockopt(a, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  EXPECT_EQ(recv(a, &byte, 1, 0), 0);  // closed by the server
  EXPECT_NO_THROW(c->set("ccc", std::string(1000000, 'c')));
  EXPECT_EQ(c->get("ccc", Deadline::after(5)).size(), 1000000u);  // (idle for 4.5 s between requests: kept)
  close(a);
}

// The server keeps at most so many connections (1024, or 8 a rank of WORLD_SIZE; here 3): one more is told so in a
// frame of its own (status 4, id 0) and closed at once, with a log line (found by an audit: past the open-file limit
// it only warned, and the ranks' connections waited in the backlog until their deadline); once one goes, a new one is
// taken.
TEST(TcpStore, ConnectionsPastTheLimitAreRefusedAtOnce) {
  set_tcp_store_server_limits_for_testing(0, 3);
  int port = 0;
  auto server = start_server(&port);  // (its own client holds the first connection)
  set_tcp_store_server_limits_for_testing(0, 0);
  int a = raw_connect(port), b = raw_connect(port);
  send_all(a, raw_header(5, 1, 0, 0));  // a ping each: both served
  send_all(b, raw_header(5, 1, 0, 0));
  EXPECT_EQ(std::get<1>(raw_reply(a)), 0);
  EXPECT_EQ(std::get<1>(raw_reply(b)), 0);
  int d = raw_connect(port);  // the fourth: told why, and closed
  const auto [id, status, why] = raw_reply(d);
  EXPECT_EQ(id, 0);
  EXPECT_EQ(status, 4);
  EXPECT_EQ(why, "3 clients are connected, the most it keeps");
  char byte;
  const timeval wait{20, 0};
  setsockopt(d, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  EXPECT_EQ(recv(d, &byte, 1, 0), 0);
  close(d);
  close(a);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  int e = raw_connect(port);
  send_all(e, raw_header(5, 1, 0, 0));
  EXPECT_EQ(std::get<1>(raw_reply(e)), 0);
  close(b);
  close(e);
}

// Connections that never send a byte are dropped after the stall limit (30 s; here 2 s), each told why in a refusal
// frame (found by an audit: kept for ever, 1024 of them locked every rank out). A real client whose first connection
// idled that long (TcpStore connects eagerly) is refused on it and sends its request again on a new one.
TEST(TcpStore, ConnectionsThatNeverSpeakAreDroppedSoTheRanksGetIn) {
  set_tcp_store_server_limits_for_testing(2, 3);
  int port = 0;
  auto server = start_server(&port);  // (its own client holds the first connection, silent until it is used)
  set_tcp_store_server_limits_for_testing(0, 0);
  int a = raw_connect(port), b = raw_connect(port);  // silent: the server is full
  int d = raw_connect(port);
  EXPECT_EQ(std::get<1>(raw_reply(d)), 4);  // refused while they are kept
  close(d);
  std::this_thread::sleep_for(std::chrono::milliseconds(3000));
  for (int fd : {a, b}) {
    const auto [id, status, why] = raw_reply(fd);
    EXPECT_EQ(id, 0);
    EXPECT_EQ(status, 4);
    EXPECT_EQ(why, "the connection sent nothing for 2 s after connecting");
    char byte;
    EXPECT_EQ(recv(fd, &byte, 1, 0), 0);  // closed by the server (raw_connect's 5 s receive timeout bounds it)
    close(fd);
  }
  auto c = client(port);
  EXPECT_NO_THROW(c->set("k", "v", Deadline::after(5)));
  EXPECT_NO_THROW(server->set("s", "w", Deadline::after(5)));  // (its idle first connection was dropped: retried)
  EXPECT_EQ(server->get("k", Deadline::after(5)), "v");
  EXPECT_EQ(c->get("s", Deadline::after(5)), "w");
}

// A client whose connection the full server refused sends its request again on a new one until its deadline (found by
// an audit: it read the close as "did rank 0 exit?" and gave up at once): served once a connection goes, and past
// the deadline told that the server refused it and why.
TEST(TcpStore, AClientTheServerRefusesRetriesUntilItsDeadline) {
  set_tcp_store_server_limits_for_testing(0, 2);
  int port = 0;
  auto server = start_server(&port);  // (its own client holds the first connection)
  set_tcp_store_server_limits_for_testing(0, 0);
  int a = raw_connect(port);
  send_all(a, raw_header(5, 1, 0, 0));
  ASSERT_EQ(std::get<1>(raw_reply(a)), 0);  // the second: served, and held
  auto c = client(port);                    // (connects: the server refuses it once it reads it)
  Stopwatch sw;
  try {
    c->set("k", "v", Deadline::after(3));
    ADD_FAILURE() << "a refused set went through";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("set of key 'k' did not complete before the deadline: the server refused its "
                                         "connections (2 clients are connected, the most it keeps; is something "
                                         "else connecting to MASTER_PORT?)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(sw.seconds(), 12.0);
  EXPECT_FALSE(server->check("k"));  // (refused, not read)
  auto later = std::async(std::launch::async, [&] { c->set("k", "v", Deadline::after(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  close(a);  // a connection goes: the retried set is taken
  later.get();
  EXPECT_EQ(server->get("k", Deadline::after(5)), "v");
}

// A rank's failure is kept even when the store is full (found by an audit: refused like any value, the other ranks
// were told only that the connection was lost).
TEST(TcpStore, RankZerosErrorIsTakenWhenTheStoreIsFull) {
  int port = 0;
  auto server = start_server_limited("1M", &port);
  auto c = client(port);
  c->set("a", std::string((1 << 20) - 97 - 2000, 'a'));  // (2000 bytes left: a key costs its bytes and 96)
  EXPECT_THROW(c->set("b", std::string(2000, 'b')), InvalidArgument);
  const std::string why = "rank 0: out of memory " + std::string(4000, '.');
  server->set(kTcpStoreErrorKey, why);
  try {
    c->get("never", Deadline::after(5));
    ADD_FAILURE() << "the get went on";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 failed: " + why), std::string::npos) << e.what();
  }
}

// A client that sends requests without reading the replies is not read while its replies back up: each get of a
// 4 MiB value queued another 4 MiB in the server (60 held 240 MiB); the others are served meanwhile, and once the
// client reads, every reply arrives.
TEST(TcpStore, AClientThatDoesNotReadItsRepliesIsNotServedUntilItDoes) {
  int port = 0;
  auto server = start_server(&port);
  const std::string big(4 << 20, 'v');
  server->set("big", big);
  constexpr int kGets = 100;
  auto send_gets = [&](int fd, const char* key) { send_raw_gets(fd, key, kGets); };
  // Reads the kGets replies of the 4 MiB value, then closes.
  const size_t want = size_t(kGets) * (24 + big.size());
  std::vector<char> buf(1 << 20);
  auto read_replies = [&](int fd) {
    size_t got = 0;
    while (got < want) {
      ssize_t n = recv(fd, buf.data(), buf.size(), 0);
      ASSERT_GT(n, 0) << got << " of " << want;
      got += size_t(n);
    }
    EXPECT_EQ(got, want);
    close(fd);
  };
  int fd = raw_connect(port);  // (the kernel's socket buffers take ~10 MB of the 240 before the server holds any)
  const long before = vm_rss_kib();
  send_gets(fd, "big");
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long grown = vm_rss_kib() - before;
  EXPECT_LT(grown, 40 * 1024) << "KiB";  // the limit and a reply or two, not 100 replies
  auto other = client(port);
  other->set("x", "1");
  EXPECT_EQ(other->get("x", Deadline::after(5)), "1");
  // Reading now, the client gets all 100 replies.
  read_replies(fd);
  // Gets waiting for a key that a set then answers are held to the same limit (the set queued one copy of its value
  // per waiting get at once).
  fd = raw_connect(port);
  send_gets(fd, "sit");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the gets wait in the server
  const long before_set = vm_rss_kib();
  other->set("sit", big);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_LT(vm_rss_kib() - before_set, 40 * 1024) << "KiB";
  read_replies(fd);
}

// The bytes a TCP store server holds by its own count, read from the refusal of a set of `limit` bytes (its limit: it
// cannot fit).
unsigned long long store_holds(Store& s, size_t limit) {
  try {
    s.set("probe", std::string(limit, 'p'));
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    const size_t at = m.find("the store holds ");
    if (at != std::string::npos) return std::stoull(m.substr(at + 16));
  }
  ADD_FAILURE() << "no refusal";
  return 0ull;
}

// A get woken by a set while its client's replies are backed up waits in the server for the client to read: it stays
// charged against CONDUIT_STORE_MAX_BYTES until its answer goes (its key and 64 bytes), so a client that never reads
// cannot hold memory past the limit; the refusals say how much the store holds.
TEST(TcpStore, AWokenGetStaysChargedUntilItsAnswerGoes) {
  int port = 0;
  auto server = start_server_limited("16M", &port);
  auto other = client(port);
  const std::string big(4 << 20, 'v');
  auto held = [&] { return store_holds(*other, size_t(16) << 20); };
  const uint64_t empty = held();
  int fd = raw_connect(port);
  constexpr int kGets = 100;
  send_raw_gets(fd, "sit", kGets);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the gets wait in the server
  EXPECT_EQ(held(), empty + kGets * (3 + 64));
  other->set("sit", big);  // two answers fill the client's 8 MiB of pending replies; the rest wait for it to read
  const uint64_t set = 3 + big.size() + 96;
  // (as the kernel takes some of the pending bytes, a few more answers go: 98 or a few fewer still wait)
  const uint64_t waiting = held() - empty - set;
  EXPECT_LE(waiting, 98u * (3 + 64));
  EXPECT_GE(waiting, 80u * (3 + 64));
  EXPECT_EQ(waiting % (3 + 64), 0u);
  std::vector<char> buf(1 << 20);
  size_t got = 0;
  while (got < size_t(kGets) * (24 + big.size())) {
    const ssize_t n = recv(fd, buf.data(), buf.size(), 0);
    ASSERT_GT(n, 0) << got;
    got += size_t(n);
  }
  EXPECT_EQ(held(), empty + set);  // every answer gone: their charge given back
  close(fd);
}

// Replies queued for many clients stay within the limit together: 40 connections that each sent one get of an 8 MiB
// value and read nothing had 40 copies of it queued in rank 0 (320 MiB past a 32 MiB limit; one client's backlog
// limit bounds only its own). Past the room the limit leaves, a get waits, charged as a waiting get, until replies
// drain; every client still gets its whole answer once it reads.
TEST(TcpStore, RepliesQueuedForManyClientsStayWithinTheLimit) {
  int port = 0;
  auto server = start_server_limited("32M", &port);
  auto other = client(port);
  const std::string big(8 << 20, 'v');
  auto held = [&] { return store_holds(*other, size_t(32) << 20); };
  other->set("big", big);
  const uint64_t base = held();
  const long before = vm_rss_kib();
  constexpr int kClients = 40;
  std::vector<int> fds;
  for (int i = 0; i < kClients; ++i) {
    fds.push_back(raw_connect(port, 4096));
    send_raw_gets(fds.back(), "big", 1);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long grown = vm_rss_kib() - before;
  const uint64_t waiting = held() - base;
  EXPECT_LT(grown, 48 * 1024) << "KiB";  // the limit's room (24 MiB) and one reply, not 40 copies
  EXPECT_GT(waiting, 0u);                // (what the kernel's buffers did not take waits)
  EXPECT_EQ(waiting % (3 + 64), 0u);
  // (each client reads on its own: one held back waits for the others' replies to drain)
  std::vector<size_t> got(kClients, 0);
  std::vector<std::thread> readers;
  for (int i = 0; i < kClients; ++i)
    readers.emplace_back([&, i] {
      std::vector<char> buf(1 << 20);
      const size_t want = 24 + big.size();
      while (got[size_t(i)] < want) {
        const ssize_t n = recv(fds[size_t(i)], buf.data(), std::min(buf.size(), want - got[size_t(i)]), 0);
        if (n <= 0) break;
        got[size_t(i)] += size_t(n);
      }
      close(fds[size_t(i)]);
    });
  for (auto& r : readers) r.join();
  EXPECT_EQ(got, std::vector<size_t>(kClients, 24 + big.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(held(), base);  // every answer gone: their charge given back
}

// A small answer goes to a client with none queued whatever the room: a client that took the room by not reading
// (one 12 MiB answer queued beside the 12 MiB value, under a 16 MiB limit) kept every other client's 1-byte answer
// waiting to its deadline.
TEST(TcpStore, ClientsThatDoNotReadDoNotHoldUpOthersSmallAnswers) {
  int port = 0;
  auto server = start_server_limited("16M", &port);
  auto other = client(port);
  other->set("big", std::string(size_t(12) << 20, 'v'));
  other->set("small", "s");
  int stalled = raw_connect(port, 4096);
  send_raw_gets(stalled, "big", 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(other->get("small", Deadline::after(5)), "s");
  close(stalled);
}

TEST(TcpStore, MalformedReplyIsProtocolError) {
  // A fake server that answers every request with garbage.
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(lfd, 4), 0);
  socklen_t len = sizeof(a);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len);
  int port = ntohs(a.sin_port);
  std::thread fake([lfd] {
    int fd = accept(lfd, nullptr, nullptr);
    char b[256];
    recv(fd, b, sizeof(b), 0);  // the request
    unsigned char reply[24] = {0x43, 0x44, 0x53, 0x54, 1, 0, 0x81, 0};
    reply[8] = 1;  // id 1
    uint32_t huge = 0x7fffffffu;
    std::memcpy(reply + 20, &huge, 4);
    send(fd, reply, sizeof(reply), MSG_NOSIGNAL);
    recv(fd, b, sizeof(b), 0);  // until the client closes
    close(fd);
  });
  {
    auto c = client(port);
    EXPECT_THROW(c->set("k", "v"), ProtocolError);
  }
  fake.join();
  close(lfd);
}

// Rank 0's error under kTcpStoreErrorKey ends every get waiting for a key, and every later get of a key not set, with
// it (found by an audit: the other ranks were told "connection to the server lost ... did rank 0 exit?"); keys that
// are set are still read.
TEST(TcpStore, RankZerosErrorEndsTheWaitingGets) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  server->set("there", "v");
  auto f = std::async(std::launch::async, [&] { return c->get("never", Deadline::after(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Stopwatch sw;
  server->set(kTcpStoreErrorKey, "rank 0: something is wrong; allowed: something else");
  try {
    f.get();
    ADD_FAILURE() << "the get went on";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 failed: rank 0: something is wrong; allowed: something else (the "
                                         "answer of its tcp store 127.0.0.1:" +
                                         std::to_string(port) + " to the get of key 'never')"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(sw.seconds(), 5.0);
  EXPECT_THROW(c->get("later", Deadline::after(20)), PeerError);
  EXPECT_LT(sw.seconds(), 5.0);
  EXPECT_EQ(c->get("there", Deadline::after(5)), "v");
}

// Rank 0's own client connects over loopback where its server listens everywhere (found by an audit: it connected to
// MASTER_ADDR, which a Kubernetes service, NAT or a floating IP need not route back to rank 0). 192.0.2.1
// (TEST-NET-1, RFC 5737) is no address of this host and reaches nothing.
TEST(TcpStore, TheServingRanksOwnClientConnectsOverLoopback) {
  auto server = make_tcp_store("192.0.2.1", 0, true, Deadline::after(3));
  server->set("k", "v");
  EXPECT_EQ(server->get("k", Deadline::after(5)), "v");
  auto c = client(tcp_store_port(*server));
  EXPECT_EQ(c->get("k", Deadline::after(5)), "v");
}

TEST(TcpStore, ServerDestroyedIsPeerError) {
  int port = 0;
  auto server = start_server(&port);
  auto c = client(port);
  auto f = std::async(std::launch::async, [&] { return c->get("never", Deadline::after(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Stopwatch sw;
  server.reset();  // stops the server thread and closes every connection
  try {
    f.get();
    FAIL() << "expected PeerError";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
  EXPECT_LT(sw.seconds(), 5.0);
  EXPECT_THROW(c->set("k", "v"), PeerError);
}

TEST(TcpStore, ServerProcessKilledIsPeerError) {
  int pfd[2];
  ASSERT_EQ(pipe(pfd), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    close(pfd[0]);
    try {
      int port = 0;
      auto s = start_server(&port);
      s->set("hello", "world");
      if (write(pfd[1], &port, sizeof(port)) != sizeof(port)) _exit(2);
      pause();
    } catch (...) {
    }
    _exit(1);
  }
  close(pfd[1]);
  int port = 0;
  ASSERT_EQ(read(pfd[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(pfd[0]);
  auto c = client(port);
  EXPECT_EQ(c->get("hello", Deadline::after(5)), "world");
  auto f = std::async(std::launch::async, [&] { return c->get("never", Deadline::after(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(pid, SIGKILL);
  EXPECT_EQ(wait_child(pid), -SIGKILL);
  Stopwatch sw;
  EXPECT_THROW(f.get(), PeerError);
  EXPECT_LT(sw.seconds(), 5.0);
  EXPECT_THROW(c->add("k", 1), PeerError);
}

TEST(TcpStore, AcrossProcesses) {
  int port = 0;
  auto server = start_server(&port);
  constexpr int kProcs = 4;
  std::vector<pid_t> pids;
  for (int r = 0; r < kProcs; ++r) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        auto c = client(port);
        for (int i = 0; i < 25; ++i) c->add("procs/count", 1);
        auto all = store_allgather(*c, "procs/ag", r, kProcs, "v" + std::to_string(r), Deadline::after(20));
        for (int o = 0; o < kProcs; ++o) {
          if (all[o] != "v" + std::to_string(o)) code = 3;
        }
        store_barrier(*c, "procs/b", r, kProcs, Deadline::after(20));
        if (c->add("procs/count", 0) != 25 * kProcs) code = 4;
      } catch (...) {
        code = 5;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  for (pid_t p : pids) EXPECT_EQ(wait_child(p), 0);
  EXPECT_EQ(server->add("procs/count", 0), 25 * kProcs);
}

// --------------------------------------------------------------------------------------------- file store

TEST(FileStore, SetGetAddCheck) {
  TempDir d;
  auto s = make_file_store(d.path());
  basic_semantics(*s);
  auto other = make_file_store(d.path() + "/");
  EXPECT_EQ(other->get("a", Deadline::after(1)), "again");
}

// A claim is the first caller's alone, from any store object on the directory, and needs no lock file (flock is
// missing on some network file systems; a lock file another user made is not writable).
TEST(FileStore, AKeyIsClaimedOnceWithoutALockFile) {
  TempDir d;
  auto a = make_file_store(d.path());
  auto b = make_file_store(d.path());
  EXPECT_TRUE(a->claim("conduit/j/claimed/1", Deadline::after(1)));
  EXPECT_FALSE(b->claim("conduit/j/claimed/1", Deadline::after(1)));
  EXPECT_FALSE(a->claim("conduit/j/claimed/1", Deadline::after(1)));
  EXPECT_TRUE(b->claim("conduit/j/claimed/2", Deadline::after(1)));
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/.lock"));
}

// Found by an audit: a claim on key K was the file of K's value with ".claim" appended ('.' is not escaped), which is
// the value file of the key "K.claim": setting that key made the claim on K fail, and claiming K made that key
// appear, empty. Claims have files of their own now.
TEST(FileStore, AClaimAndTheKeyNamedLikeItsOldFileAreIndependent) {
  TempDir d;
  auto s = make_file_store(d.path());
  EXPECT_TRUE(s->claim("a", Deadline::after(1)));
  EXPECT_FALSE(s->check("a.claim", Deadline::after(1)));
  EXPECT_FALSE(s->check("a", Deadline::after(1)));
  EXPECT_THROW(s->get("a.claim", Deadline::after(0.1)), TimeoutError);
  s->set("a.claim", "v", Deadline::after(1));
  EXPECT_EQ(s->get("a.claim", Deadline::after(1)), "v");
  EXPECT_FALSE(s->claim("a", Deadline::after(1)));
  EXPECT_EQ(s->get("a.claim", Deadline::after(1)), "v");
  // The other way round: the key first, then the claim.
  s->set("b.claim", "w", Deadline::after(1));
  EXPECT_TRUE(s->claim("b", Deadline::after(1)));
  EXPECT_FALSE(s->claim("b", Deadline::after(1)));
  EXPECT_EQ(s->get("b.claim", Deadline::after(1)), "w");
}

// The pause between polls is the time left, clamped to [0, cap] before it becomes an integer duration: cast as it was,
// Deadline::never()'s remaining time (1e18 s) overflowed to a negative pause.
TEST(StorePolling, APauseIsClampedToTheTimeLeftAndTheCap) {
  using std::chrono::microseconds;
  using std::chrono::milliseconds;
  using std::chrono::nanoseconds;
  EXPECT_EQ(Deadline::never().remaining_at_most(microseconds(50000)), microseconds(50000));
  EXPECT_EQ(Deadline::never().remaining_at_most(nanoseconds(500000000)), nanoseconds(500000000));
  EXPECT_EQ(Deadline::never().remaining_at_most(milliseconds(0)), milliseconds(0));
  // Not never, but 292 years away: in picoseconds past any int64. (GCC folds never()'s constant 1e18 s to a
  // saturated count, which hid the overflow above in optimized builds; this one is computed at run time.)
  const Deadline far(Clock::time_point::max() - std::chrono::hours(1));
  using Picoseconds = std::chrono::duration<int64_t, std::pico>;
  EXPECT_EQ(far.remaining_at_most(Picoseconds(7)), Picoseconds(7));
  EXPECT_EQ(far.remaining_at_most(nanoseconds(7)), nanoseconds(7));
  EXPECT_EQ(Deadline::after(1e6).remaining_at_most(microseconds(1000)), microseconds(1000));
  EXPECT_EQ(Deadline::after(0).remaining_at_most(microseconds(1000)), microseconds(0));
  EXPECT_EQ(Deadline(Clock::now() - std::chrono::seconds(5)).remaining_at_most(milliseconds(10)), milliseconds(0));
  const auto soon = Deadline::after(0.002).remaining_at_most(milliseconds(50));
  EXPECT_GE(soon, milliseconds(0));
  EXPECT_LE(soon, milliseconds(2));
}

// Found by an audit: a get with Deadline::never() computed a negative pause (above) and spun a core on open() until
// the key came, in builds where the undefined conversion gave INT64_MIN (GCC -O0, clang -O3; GCC -O1 and above fold
// it to a saturated count, and did not spin). It sleeps between polls: the waiting thread uses a small part of one
// core (well under 1% here; a spinning one used all it was given).
TEST(FileStore, AGetWithoutADeadlineSleepsBetweenPolls) {
  TempDir d;
  auto s = make_file_store(d.path());
  struct Waited {
    std::string value;
    double cpu = 0, wall = 0;
  };
  auto thread_cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  auto f = std::async(std::launch::async, [&] {
    Waited w;
    const double cpu0 = thread_cpu();
    Stopwatch sw;
    w.value = s->get("later", Deadline::never());
    w.wall = sw.seconds();
    w.cpu = thread_cpu() - cpu0;
    return w;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  s->set("later", "here", Deadline::after(5));
  ASSERT_EQ(f.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "the get did not see the key";
  const Waited w = f.get();
  EXPECT_EQ(w.value, "here");
  EXPECT_GE(w.wall, 0.25);
  EXPECT_LT(w.cpu, 0.25 * w.wall) << "the waiting thread used " << w.cpu << " s of CPU in " << w.wall << " s";
}

TEST(FileStore, GetBlocksUntilLaterSet) {
  TempDir d;
  auto a = make_file_store(d.path());
  auto b = make_file_store(d.path());
  get_blocks_until_set(*a, *b);
}

// A rank's failure published under the store's failure key ends every get waiting for a key not there, at once and
// later too (found by an audit: the other ranks waited for the failed rank's values until their deadline); keys that
// are there are still read, and a store without a failure key waits on.
TEST(FileStore, AFailurePublishedEndsTheWaitingGets) {
  TempDir d;
  auto waiting = make_file_store(d.path(), "conduit/j/error");
  auto plain = make_file_store(d.path());
  plain->set("there", "v");
  auto f = std::async(std::launch::async, [&] { return waiting->get("never", Deadline::after(20)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Stopwatch sw;
  plain->set("conduit/j/error", "rank 1 failed: something is wrong");
  try {
    f.get();
    ADD_FAILURE() << "the get went on";
  } catch (const PeerError& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1 failed: something is wrong (published in the file store " + d.path() +
                                         " while this rank waited for key 'never')");
  }
  EXPECT_LT(sw.seconds(), 5.0);
  EXPECT_THROW(waiting->get("later", Deadline::after(20)), PeerError);
  EXPECT_EQ(waiting->get("there", Deadline::after(5)), "v");
  EXPECT_THROW(plain->get("later", Deadline::after(0.2)), TimeoutError);
}

TEST(FileStore, GetDeadlineThrowsTimeoutNamingKeyAndDir) {
  TempDir d;
  auto s = make_file_store(d.path());
  get_times_out(*s, d.path());
}

// add() takes the store's lock file with the store's deadline: a holder that never lets go (a stale lock on a
// network file system) is a TimeoutError naming the lock, not a hang.
TEST(FileStore, AddGivesUpOnALockHeldPastTheDeadline) {
  TempDir d;
  auto s = make_file_store(d.path());
  EXPECT_EQ(s->add("n", 2), 2);
  const std::string lock = d.path() + "/.lock";
  int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  auto gives_up = [&](const std::function<void()>& add) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      add();
      ADD_FAILURE() << "add went past a held lock";
    } catch (const TimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find(".lock"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  };
  setenv("CONDUIT_TIMEOUT", "0.3", 1);  // without a deadline of its own: CONDUIT_TIMEOUT's
  gives_up([&] { s->add("n", 1); });
  unsetenv("CONDUIT_TIMEOUT");
  gives_up([&] { s->add("n", 1, Deadline::after(0.3)); });  // the caller's (it took CONDUIT_TIMEOUT's, 300 s)
  ::flock(fd, LOCK_UN);
  ::close(fd);
  EXPECT_EQ(s->add("n", 1), 3);  // nothing was added by the attempt that gave up
}

// A key's file that is not a regular file, or too large to be a value, is refused at once with one line: a FIFO
// under a key's name blocked get() in open() past every deadline. A value over the limit is refused by set().
TEST(FileStore, AKeyThatIsNotAValueFileIsRefusedAtOnce) {
  TempDir d;
  auto s = make_file_store(d.path());
  s->set("fifo-key", "x");
  s->set("big-key", "x");
  auto file_of = [&](const std::string& part) {
    for (const auto& e : std::filesystem::directory_iterator(d.path()))
      if (e.path().filename().string().find(part) != std::string::npos) return e.path().string();
    ADD_FAILURE() << "no file for " << part;
    return std::string();
  };
  const std::string fifo = file_of("fifo-key"), big = file_of("big-key");
  ASSERT_EQ(::unlink(fifo.c_str()), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    s->get("fifo-key", Deadline::after(20));
    ADD_FAILURE() << "a FIFO was read as a value";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("key 'fifo-key' is " + fifo + ", not a regular file"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  ASSERT_EQ(::truncate(big.c_str(), off_t{kMaxStoreFieldBytes} + 1), 0);
  try {
    s->get("big-key", Deadline::after(20));
    ADD_FAILURE() << "a value over the limit was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds more than 67108864 bytes"), std::string::npos) << e.what();
  }
  try {
    s->set("k", std::string(kMaxStoreFieldBytes + 1, 'v'));
    ADD_FAILURE() << "a value over the limit was written";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is 67108865 bytes; allowed: up to 67108864"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(s->check("k"));
}

TEST(FileStore, MissingOrUnusableDirIsConfigError) {
  TempDir d;
  try {
    make_file_store(d.path() + "/missing");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(d.path() + "/missing"), std::string::npos) << e.what();
  }
  std::string file = d.path() + "/file";
  fclose(fopen(file.c_str(), "w"));
  EXPECT_THROW(make_file_store(file), ConfigError);
  EXPECT_THROW(make_file_store(""), ConfigError);
}

TEST(FileStore, AddIsAtomicAcrossProcesses) {
  TempDir d;
  constexpr int kProcs = 4, kAdds = 50;
  std::vector<pid_t> pids;
  for (int r = 0; r < kProcs; ++r) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int code = 0;
      try {
        auto s = make_file_store(d.path());
        for (int i = 0; i < kAdds; ++i) s->add("count", 1);
        store_barrier(*s, "b", r, kProcs, Deadline::after(20));
        if (s->add("count", 0) != kProcs * kAdds) code = 3;
      } catch (...) {
        code = 5;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  for (pid_t p : pids) EXPECT_EQ(wait_child(p), 0);
  EXPECT_EQ(make_file_store(d.path())->add("count", 0), kProcs * kAdds);
}

// Two containers sharing the directory may have the same host name and pid (pid 1 in each), and copies of one program
// the same state. Children forked from here stand in for them: the same state, and through the hook the same host
// name and pid in their temporary file names. The names had only host, pid and a per-process counter, opened with
// O_TRUNC: such writers wrote into one file, and published torn values or failed to rename a file the other had
// renamed away.
TEST(FileStore, WritersWithTheSameHostNameAndPidDoNotClobberEachOther) {
  TempDir d;
  const std::string dir = d.path();
  int events = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);  // to see every temporary file created
  if (events >= 0 && inotify_add_watch(events, dir.c_str(), IN_CREATE) < 0) {
    close(events);
    events = -1;
  }
  set_file_store_identity_for_testing("node", 1);
  // Many rounds of whole values of one letter per writer, all started together (the old names of both writers
  // advanced in step: a collision every round they overlapped).
  constexpr int kWriters = 3, kRounds = 150;
  constexpr size_t kSize = 128 * 1024;
  int go[2];
  ASSERT_EQ(pipe(go), 0);
  std::vector<pid_t> pids;
  for (int w = 0; w < kWriters; ++w) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(go[1]);
      char c;
      while (read(go[0], &c, 1) < 0 && errno == EINTR) {
      }
      int code = 0;
      try {
        auto s = make_file_store(dir);
        const std::string mine(kSize, static_cast<char>('a' + w));
        for (int i = 0; i < kRounds && code == 0; ++i) {
          s->set("shared", mine);
          const std::string v = s->get("shared", Deadline::after(10));
          // One writer's whole value: full length, every byte the same letter of a writer.
          const bool whole = v.size() == kSize && v[0] >= 'a' && v[0] < 'a' + kWriters &&
                             v.find_first_not_of(v[0]) == std::string::npos;
          if (!whole) code = 3;
        }
      } catch (...) {
        code = 5;
      }
      _exit(code);
    }
    pids.push_back(pid);
  }
  close(go[0]);
  close(go[1]);  // the writers start
  for (pid_t p : pids) EXPECT_EQ(wait_child(p), 0) << "3: a read returned a torn value; 5: a write failed";
  set_file_store_identity_for_testing("", 0);
  // Every temporary file was renamed into place, none left over; and no temporary name was used twice.
  for (const auto& e : std::filesystem::directory_iterator(dir))
    EXPECT_NE(e.path().filename().string().rfind(".tmp.", 0), 0u) << e.path();
  if (events < 0) GTEST_SKIP() << "no inotify here: the writers were checked, their temporary names were not";
  std::map<std::string, int> created;
  alignas(inotify_event) char buf[64 * 1024];
  for (ssize_t n; (n = read(events, buf, sizeof buf)) > 0;)
    for (char* p = buf; p < buf + n;) {
      auto* ev = reinterpret_cast<inotify_event*>(p);
      if (ev->len > 0 && std::string(ev->name).rfind(".tmp.node.1.", 0) == 0) created[ev->name]++;
      p += sizeof(inotify_event) + ev->len;
    }
  close(events);
  EXPECT_EQ(created.size(), size_t(kWriters * kRounds)) << "temporary files seen (the queue may have overflowed)";
  for (const auto& [name, times] : created) EXPECT_EQ(times, 1) << name << " was created " << times << " times";
}

// ------------------------------------------------------------------------------------ allgather / barrier

void run_collectives(const std::function<StorePtr()>& open, int size) {
  std::vector<std::thread> ts;
  std::atomic<int> failures{0};
  for (int r = 0; r < size; ++r) {
    ts.emplace_back([&, r] {
      try {
        auto s = open();
        for (int round = 0; round < 3; ++round) {
          std::string prefix = "round" + std::to_string(round);
          auto all = store_allgather(*s, prefix + "/ag", r, size, fmt::format("{}:{}", round, r), Deadline::after(20));
          for (int o = 0; o < size; ++o) {
            if (all[o] != fmt::format("{}:{}", round, o)) failures++;
          }
          store_barrier(*s, prefix + "/barrier", r, size, Deadline::after(20));
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
        failures++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(StoreCollectives, AllgatherAndBarrierOverTcp) {
  int port = 0;
  auto server = start_server(&port);
  run_collectives([&] { return client(port); }, 5);
}

TEST(StoreCollectives, AllgatherAndBarrierOverOneSharedTcpStore) {
  int port = 0;
  auto server = start_server(&port);
  run_collectives([&] { return server; }, 6);
}

TEST(StoreCollectives, AllgatherAndBarrierOverFiles) {
  TempDir d;
  run_collectives([&] { return make_file_store(d.path()); }, 5);
}

TEST(StoreCollectives, BarrierTimeoutSaysWhoArrived) {
  TempDir d;
  auto s = make_file_store(d.path());
  s->add("b/arrived", 1);  // one other rank arrived; the third never comes
  Stopwatch sw;
  try {
    store_barrier(*s, "b", 0, 3, Deadline::after(0.2));
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("2 of 3"), std::string::npos) << e.what();
  }
  EXPECT_LT(sw.seconds(), 2.0);
  EXPECT_THROW(store_allgather(*s, "ag", 3, 3, "x", Deadline::after(1)), InvalidArgument);
  EXPECT_THROW(store_allgather(*s, "ag", 1, 2, "x", Deadline::after(0.1)), TimeoutError);
}

}  // namespace
}  // namespace conduit::net
