// TCP rendezvous store (as torch's TCPStore with MASTER_ADDR/MASTER_PORT): rank 0 serves a key-value map from a
// background thread; every rank (rank 0 included, over loopback) talks to it as a client.
//
// Wire format (little-endian), the same 24-byte header in front of every request and reply:
//   u32 magic 'CDST' | u16 version | u8 op | u8 status | u64 request id | u32 key length | u32 value length
// followed by the key and the value bytes. Requests: set(key, value), get(key) (the server parks it until the key
// exists, so a waiting client sleeps in poll(), never spins), add(key, 8-byte delta) (the reply carries the new
// value; the stored value is its decimal text so get() reads it too), check(key) (status ok / not found).
// A set of kTcpStoreErrorKey (rank 0 failed) answers every get waiting for a key, and every later get of a key not set,
// with status failed carrying that value.
// A reply has op = request op | 0x80 and echoes the request id; a client that timed out on a get may later
// receive the stale reply on the same connection and skips it by id.
// Validation: a bad magic, version or op, or a length > kMaxStoreFieldBytes (64 MiB) makes the server drop that
// client with a logged error (other clients are unaffected) and makes a client throw ProtocolError. A frame cut
// short by end-of-stream is also dropped / a PeerError.
//
// Concurrency: the server is one thread around poll() (listening socket, a wake-up pipe, every client); it keeps
// no thread per client. A client keeps a small pool of connections so that several threads sharing one Store can
// block in get() at the same time without serializing behind each other.
#include "net/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

namespace conduit::net {

bool names_localhost(const std::string& master_addr) {
  // RFC 6761: "localhost" and names under it never name another machine.
  std::string lower = master_addr;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (!lower.empty() && lower.back() == '.') lower.pop_back();
  return lower == "localhost" || lower.ends_with(".localhost");
}

namespace {
// A numeric loopback address: 127/8, ::1, or 127/8 mapped into IPv6.
bool loopback_address(const std::string& addr) {
  in_addr v4{};
  if (inet_pton(AF_INET, addr.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return inet_pton(AF_INET6, addr.c_str(), &v6) == 1 &&
         (IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127));
}
}  // namespace

bool connected_to_itself(int fd) {
  sockaddr_storage mine{}, peer{};
  socklen_t ml = sizeof mine, pl = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &ml) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0)
    return false;
  return ml == pl && std::memcmp(&mine, &peer, ml) == 0;
}

std::string store_listen_host(const std::string& master_addr) {
  return loopback_address(master_addr) ? master_addr : "*";
}

namespace {
// set_tcp_store_server_limits_for_testing's values (0: the defaults), read as a server starts.
std::atomic<double> g_stall_seconds_for_testing{0};
std::atomic<size_t> g_max_clients_for_testing{0};
}  // namespace

void set_tcp_store_server_limits_for_testing(double stall_seconds, size_t max_clients) {
  g_stall_seconds_for_testing = stall_seconds;
  g_max_clients_for_testing = max_clients;
}

namespace {

// A client that sent part of a request and nothing more for this long is dropped, its bytes given back (found by an
// audit: a half-sent request held its bytes against CONDUIT_STORE_MAX_BYTES for ever, and the store refused every
// rank's values for them). Longer than any pause of a live client mid-frame: it writes each request whole at once.
constexpr double kStallSeconds = 30;
// The most connections the server keeps, unless the job is larger (8 a rank: a client keeps a few of its own) or the
// open-file limit is lower: a flood of connections took every descriptor and the server only warned, while the
// ranks' own connections waited in the backlog until their deadline (found by an audit).
constexpr size_t kMinMaxClients = 1024;

// The largest failure (kTcpStoreErrorKey) set past CONDUIT_STORE_MAX_BYTES (writers keep to kStoredFailureBytes).
constexpr size_t kMaxErrorBytes = 64 << 10;
static_assert(kStoredFailureBytes <= kMaxErrorBytes);

constexpr uint32_t kMagic = 0x54534443u;  // "CDST" as bytes on the wire
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 24;
enum Op : uint8_t { kOpSet = 1, kOpGet = 2, kOpAdd = 3, kOpCheck = 4, kOpPing = 5, kReplyBit = 0x80 };
// kRefused: the server keeps its most connections; sent unasked (id 0) on a connection it closes at once, whose
// requests were never read, so the client may send them again on another.
enum Status : uint8_t { kOk = 0, kNotFound = 1, kBadRequest = 2, kFailed = 3, kRefused = 4 };

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint8_t op = 0;
  uint8_t status = kOk;
  uint64_t id = 0;
  uint32_t key_len = 0;
  uint32_t value_len = 0;
};

template <typename T>
void put_le(char* p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}
template <typename T>
T get_le(const char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return static_cast<T>(v);
}

void encode_header(const Header& h, char* p) {
  put_le<uint32_t>(p, h.magic);
  put_le<uint16_t>(p + 4, h.version);
  p[6] = static_cast<char>(h.op);
  p[7] = static_cast<char>(h.status);
  put_le<uint64_t>(p + 8, h.id);
  put_le<uint32_t>(p + 16, h.key_len);
  put_le<uint32_t>(p + 20, h.value_len);
}

Header decode_header(const char* p) {
  Header h;
  h.magic = get_le<uint32_t>(p);
  h.version = get_le<uint16_t>(p + 4);
  h.op = static_cast<uint8_t>(p[6]);
  h.status = static_cast<uint8_t>(p[7]);
  h.id = get_le<uint64_t>(p + 8);
  h.key_len = get_le<uint32_t>(p + 16);
  h.value_len = get_le<uint32_t>(p + 20);
  return h;
}

// Empty when the header is acceptable, else one line saying what is wrong.
std::string check_header(const Header& h, bool reply) {
  if (h.magic != kMagic) return fmt::format("bad magic {:#010x} (expected {:#010x})", h.magic, kMagic);
  if (h.version != kVersion) return fmt::format("unsupported version {} (this build speaks {})", h.version, kVersion);
  uint8_t op = reply ? static_cast<uint8_t>(h.op & ~kReplyBit) : h.op;
  if (reply != ((h.op & kReplyBit) != 0) || op < kOpSet || op > kOpPing)
    return fmt::format("unexpected op {:#04x} in a {}", h.op, reply ? "reply" : "request");
  if (h.key_len > kMaxStoreFieldBytes || h.value_len > kMaxStoreFieldBytes)
    return fmt::format("key length {} / value length {} exceed the limit of {} bytes", h.key_len, h.value_len,
                       kMaxStoreFieldBytes);
  return {};
}

std::string frame(const Header& h, const std::string& key, const std::string& value) {
  std::string out(kHeaderBytes + key.size() + value.size(), '\0');
  Header hh = h;
  hh.key_len = static_cast<uint32_t>(key.size());
  hh.value_len = static_cast<uint32_t>(value.size());
  encode_header(hh, out.data());
  std::memcpy(out.data() + kHeaderBytes, key.data(), key.size());
  std::memcpy(out.data() + kHeaderBytes + key.size(), value.data(), value.size());
  return out;
}

std::string encode_i64(int64_t v) {
  std::string s(8, '\0');
  put_le<uint64_t>(s.data(), static_cast<uint64_t>(v));
  return s;
}

void set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

int poll_timeout_ms(const Deadline& d, int cap_ms) {
  if (d.is_never()) return cap_ms;
  double r = d.remaining_seconds();
  if (r <= 0) return 0;
  return static_cast<int>(std::min<double>(cap_ms, r * 1000.0 + 1.0));
}

std::string connect_host(const std::string& host) {
  if (host.empty() || host == "*" || host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// ------------------------------------------------------------------------------------------------ server

class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& master_addr, int port)
      : host_(store_listen_host(master_addr)),
        loopback_only_(names_localhost(master_addr)),
        max_bytes_(store_max_bytes()) {
    {
      const double stall = g_stall_seconds_for_testing.load();
      stall_ = std::chrono::duration_cast<Clock::duration>(Seconds(stall > 0 ? stall : kStallSeconds));
      // (descriptors: the server's clients and the rest of the process, its transport's connections and files)
      const uint64_t world = static_cast<uint64_t>(env_int("WORLD_SIZE", 1, 1 << 20).value_or(1));
      uint64_t most = std::max<uint64_t>(kMinMaxClients, 8 * world);
      const uint64_t files = raise_open_file_limit(most + 256);
      if (files < UINT64_MAX) most = std::min<uint64_t>(most, files > 512 ? files - 256 : files / 2);
      const size_t given = g_max_clients_for_testing.load();
      max_clients_ = given > 0 ? given : static_cast<size_t>(most);
    }
    const bool any = host_ == "*";
    if (any && !master_addr.empty() && master_addr != "*") {
      // Listening everywhere needs no address, but the other ranks connect to MASTER_ADDR: a name that does not
      // resolve here (where it most likely resolves) fails at once, not after the other ranks' connect deadline.
      addrinfo hints{};
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      const int rc = getaddrinfo(master_addr.c_str(), nullptr, &hints, &res);
      if (rc != 0)
        throw ConfigError(fmt::format("tcp store: cannot resolve server address '{}:{}': {} (check MASTER_ADDR)",
                                      master_addr, port, gai_strerror(rc)));
      freeaddrinfo(res);
    }
    std::string why = "no address";
    int err = 0;
    // Every interface: IPv6's wildcard taking IPv4 too where the host has IPv6, else IPv4's.
    for (int family : any ? std::vector<int>{AF_INET6, AF_INET} : std::vector<int>{AF_UNSPEC}) {
      if (listen_fd_ >= 0) break;
      addrinfo hints{};
      hints.ai_family = family;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_PASSIVE;
      addrinfo* res = nullptr;
      int rc = getaddrinfo(any ? nullptr : host_.c_str(), std::to_string(port).c_str(), &hints, &res);
      if (rc != 0) {
        if (any) continue;
        throw ConfigError(fmt::format("tcp store: cannot resolve server address '{}:{}': {} (check MASTER_ADDR)", host_,
                                      port, gai_strerror(rc)));
      }
      for (addrinfo* ai = res; ai != nullptr && listen_fd_ < 0; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
          err = errno;
          why = std::strerror(errno);
          continue;
        }
        int one = 1, zero = 0;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (any && ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
          err = errno;
          why = std::strerror(errno);
          close(fd);
          continue;
        }
        listen_fd_ = fd;
      }
      freeaddrinfo(res);
    }
    if (listen_fd_ < 0) {
      const char* hint = err == EADDRINUSE      ? " (is another job using this MASTER_PORT? choose another port)"
                         : err == EADDRNOTAVAIL ? " (MASTER_ADDR is a loopback address this host does not have)"
                                                : "";
      throw ConfigError(fmt::format("tcp store: cannot listen on {}:{}: {}{}", host_, port, why, hint));
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    // Rank 0's own client: over loopback where the server listens everywhere (found by an audit: it connected to
    // MASTER_ADDR, which a Kubernetes service, NAT or a floating IP may not route back to this host). The IPv6
    // wildcard takes IPv4 too unless the host insists on IPv6 only (net.ipv6.bindv6only).
    if (!any) {
      self_host_ = host_;  // (a loopback address, listened on as given)
    } else {
      int v6only = 0;
      socklen_t vl = sizeof v6only;
      const bool v6_only = ss.ss_family == AF_INET6 &&
                           (getsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &vl) != 0 || v6only != 0);
      self_host_ = v6_only ? "::1" : "127.0.0.1";
    }
    set_nonblocking(listen_fd_);
    if (pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      close(listen_fd_);
      throw Error(fmt::format("tcp store: pipe2 failed: {}", std::strerror(errno)));
    }
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "conduit-store");
      run();
    });
    CONDUIT_LOG_INFO("tcp store: serving on {}:{}", host_, port_);
  }

  ~TcpStoreServer() {
    char b = 1;
    while (write(wake_[1], &b, 1) < 0 && errno == EINTR) {
    }
    if (thread_.joinable()) thread_.join();
    for (auto& [id, c] : clients_) close(c.fd);
    close(listen_fd_);
    close(wake_[0]);
    close(wake_[1]);
  }

  int port() const { return port_; }
  // Where rank 0's own client connects: a loopback address the server listens on.
  const std::string& self_host() const { return self_host_; }

 private:
  struct Client {
    int fd = -1;
    std::string peer;
    std::string in;
    // The replies queued, each its own buffer, freed once it has gone whole (one string grown by appends kept its
    // largest capacity, and a reply partly sent kept the part that had gone), and how much of the first has gone.
    std::deque<std::string> out;
    size_t out_off = 0;
    size_t out_bytes = 0;  // the bytes of `out`'s replies, sent or not: what they hold
    // Gets of a key that is set whose answers wait, in order: (key, request id). Answered by a set while this
    // client's replies were backed up (a set answering 1,000 waiting gets queued 1,000 copies of its value at once),
    // or held back for room (reply_fits); answered once replies drained.
    std::deque<std::pair<std::string, uint64_t>> deferred;
    uint64_t arriving = 0;  // the bytes of requests not served yet it holds, charged against the limit (serve())
    uint64_t skip = 0;      // bytes still to come of a request refused before it was in, read and discarded
    Clock::time_point last_read{};  // when it last sent bytes, or was last paused (drop_stalled()), or was accepted
    bool spoke = false;             // it has sent a byte
    size_t pending() const { return out_bytes - out_off; }
  };
  // A client's requests are not read or served while more than this of its replies waits to be sent: one that
  // sent requests without reading the replies grew the server's memory by a reply each (60 gets of a 4 MiB value
  // held 240 MiB). One reply may still take it past this (a value is up to 64 MiB).
  static constexpr size_t kMaxPendingReplies = size_t{8} << 20;
  static bool backed_up(const Client& c) { return c.pending() > kMaxPendingReplies; }
  // Nor while a get's answer waits (its later requests' replies would overtake it).
  static bool paused(const Client& c) { return backed_up(c) || !c.deferred.empty(); }
  // A reply this small to a client with none queued goes whatever the room (reply_fits), while the replies queued stay
  // within the limit itself: clients that hold the room by not reading kept every other client's small answers
  // waiting (the replies then hold twice the limit at most).
  static constexpr size_t kSmallReply = size_t{64} << 10;

  void run() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    while (true) {
      fds.clear();
      ids.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      // Out of file descriptors: the pending connection keeps the listening socket readable, so it is left out of
      // the poll for a moment (polling it spun the thread and logged a warning every pass).
      const bool accept_paused = Clock::now() < accept_paused_until_;
      fds.push_back({accept_paused ? -1 : listen_fd_, POLLIN, 0});
      for (auto& [id, c] : clients_) {
        short ev = paused(c) ? 0 : POLLIN;  // (a hang-up or error is reported either way)
        if (!c.out.empty()) ev |= POLLOUT;
        fds.push_back({c.fd, ev, 0});
        ids.push_back(id);
      }
      int n = poll(fds.data(), fds.size(), poll_wait_ms(accept_paused));
      if (n < 0) {
        if (errno == EINTR) continue;
        CONDUIT_LOG_ERROR("tcp store server {}:{}: poll failed: {}; stopping", host_, port_, std::strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;  // destructor asked us to stop
      if (fds[1].revents & POLLIN) accept_all();
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        auto it = clients_.find(ids[i - 2]);
        if (it == clients_.end()) continue;
        if (paused(it->second) && (fds[i].revents & (POLLHUP | POLLERR))) {  // (not read: it spun on the event)
          drop(it->first);
          continue;
        }
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          bool keep = false;
          try {
            keep = read_client(it->first, it->second);
          } catch (const std::exception& e) {  // e.g. out of memory for a large value: lose the client, not the job
            CONDUIT_LOG_ERROR("tcp store server {}:{}: serving client {} failed: {}; dropped it", host_, port_,
                              it->second.peer, e.what());
          }
          if (!keep) drop(it->first);
        }
      }
      // Flush every client with pending output (replies may have been queued for any client, e.g. by a set); a
      // client whose replies drained below the limit has the requests it sent meanwhile served.
      std::vector<uint64_t> dead;
      for (auto& [id, c] : clients_)
        if (!service(id, c)) dead.push_back(id);
      for (uint64_t id : dead) drop(id);
      drop_stalled();
      // (an answer held back for room that a later client's flush made, or a client dropped: not left to wait for
      // the next poll, which nothing may wake)
      for (bool again = true; again;) {
        dead.clear();
        for (auto& [id, c] : clients_)
          if (!c.deferred.empty() && !service(id, c)) dead.push_back(id);
        for (uint64_t id : dead) drop(id);
        again = !dead.empty();
      }
    }
  }

  // Whether `c` holds part of a request that it should be sending: not a client the server paused, whose requests
  // wait for it to read its replies.
  static bool mid_request(const Client& c) { return !paused(c) && (c.skip > 0 || !c.in.empty()); }

  // A connection that has sent nothing since it was accepted (last_read). Dropped after stall_ as one stalled
  // mid-request is: 1024 connections that never spoke were kept for ever, and the server refused the ranks' own.
  // A client may leave its first connection idle for longer (TcpStore connects eagerly, and sends its first request
  // when it has one): it is told, as a refused connection is, and sends the request again on a new one.
  static bool silent(const Client& c) { return !c.spoke; }

  // How long poll() may wait: until the first client mid-request or silent may be dropped (else for ever), within
  // 100 ms while accepting is paused.
  int poll_wait_ms(bool accept_paused) const {
    int ms = accept_paused ? 100 : -1;
    const auto now = Clock::now();
    for (const auto& [id, c] : clients_) {
      if (!mid_request(c) && !silent(c)) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(c.last_read + stall_ - now).count();
      const int wait = static_cast<int>(std::clamp<long long>(left + 1, 1, 1000));
      ms = ms < 0 ? wait : std::min(ms, wait);
    }
    return ms;
  }

  // Drops every client that sent part of a request and nothing more for stall_: its bytes are given back. And every
  // one that sent nothing at all for stall_ after it connected (silent()), telling it why as a refusal.
  void drop_stalled() {
    const auto now = Clock::now();
    std::vector<uint64_t> stalled, quiet;
    for (auto& [id, c] : clients_) {
      if (paused(c))
        c.last_read = now;  // (not reading it is the server's doing)
      else if (mid_request(c) && now - c.last_read >= stall_)
        stalled.push_back(id);
      else if (silent(c) && now - c.last_read >= stall_)
        quiet.push_back(id);
    }
    if (!quiet.empty())
      CONDUIT_LOG_WARN(
          "tcp store server {}:{}: dropped {} connection(s) (the first from {}) that sent nothing for {:.0f} s after "
          "connecting ({} clients were connected, at most {} are kept; allowed: a client that sends its requests; is "
          "something else connecting to MASTER_PORT?)",
          host_, port_, quiet.size(), clients_.at(quiet.front()).peer, std::chrono::duration<double>(stall_).count(),
          clients_.size(), max_clients_);
    for (uint64_t id : quiet) {
      Client& c = clients_.at(id);
      refuse(c.fd, fmt::format("the connection sent nothing for {:.0f} s after connecting",
                               std::chrono::duration<double>(stall_).count()));
      c.fd = -1;  // (closed by refuse)
      drop(id);
    }
    for (uint64_t id : stalled) {
      const Client& c = clients_.at(id);
      CONDUIT_LOG_WARN(
          "tcp store server {}:{}: client {} sent {} bytes of a request and nothing more for {:.0f} s; dropped it and "
          "released them (allowed: a request sent whole)",
          host_, port_, c.peer, c.skip > 0 ? c.skip : c.in.size(), std::chrono::duration<double>(stall_).count());
      drop(id);
    }
  }

  // Sends what `c`'s socket takes of its replies, answers its waiting gets that may go now, and serves the requests
  // it sent meanwhile once it is no longer paused. False: drop it.
  bool service(uint64_t id, Client& c) {
    // (as reading: an exception here, out of memory for a 64 MiB reply, loses the client, not every rank's store by
    // std::terminate)
    try {
      const bool was_paused = paused(c);
      if (!c.out.empty() && !flush(c)) return false;
      answer_deferred(c);
      // (resumed: its stall clock starts now; poll may have waited with every client paused, drop_stalled not
      // refreshing it, and a client the server had not read was dropped as stalled the moment it resumed)
      if (was_paused && !paused(c)) c.last_read = Clock::now();
      return !(was_paused && !paused(c) && !c.in.empty() && !serve(id, c));
    } catch (const std::exception& e) {
      CONDUIT_LOG_ERROR("tcp store server {}:{}: serving client {} failed: {}; dropped it", host_, port_, c.peer,
                        e.what());
      return false;
    }
  }

  // Answers the gets `c` has waiting for their key's value to go (backed up, or held back for room), in order.
  void answer_deferred(Client& c) {
    while (!c.deferred.empty() && !backed_up(c)) {
      const std::string& value = data_.at(c.deferred.front().first);  // (keys are never deleted)
      if (!reply_fits(c, value.size())) return;
      reply_get(c, c.deferred.front().second, value);
      parked_bytes_ -= parked_cost(c.deferred.front().first);
      c.deferred.pop_front();
    }
  }

  // Tells the client on `fd` why in a refusal frame (status kRefused, id 0), which it retries within its deadline (it
  // read a bare close as "did rank 0 exit?" and gave up), and closes `fd`.
  static void refuse(int fd, const std::string& why) {
    Header h;
    h.op = kOpPing | kReplyBit;
    h.status = kRefused;
    const std::string f = frame(h, {}, why);
    (void)!::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(fd, SHUT_WR);
    // (what it sent already, read so the close sends no reset that could drop the frame; at most 64 KiB, the
    // server's one thread not held by a peer that keeps sending)
    char drain[4096];
    for (int i = 0; i < 16 && ::recv(fd, drain, sizeof drain, MSG_DONTWAIT) > 0; ++i) {
    }
    ::close(fd);
  }

  void accept_all() {
    while (true) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          if (!accept_warned_)  // once until an accept succeeds again
            CONDUIT_LOG_WARN(
                "tcp store server {}:{}: accept failed: {} ({} clients connected, open-file limit {}); retrying every "
                "100 ms",
                host_, port_, std::strerror(errno), clients_.size(), raise_open_file_limit(max_clients_ + 256));
          accept_warned_ = true;
          accept_paused_until_ = Clock::now() + std::chrono::milliseconds(100);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
          CONDUIT_LOG_WARN("tcp store server {}:{}: accept failed: {}", host_, port_, std::strerror(errno));
        }
        return;
      }
      accept_warned_ = false;
      if (clients_.size() >= max_clients_) {
        // (refused at once: left in the backlog, the ranks' own connections waited behind it until their deadline)
        if (!clients_warned_)  // once until one is taken again
          CONDUIT_LOG_WARN(
              "tcp store server {}:{}: refused a connection: {} clients are connected, the most it keeps (allowed: "
              "at most {}, 8 a rank of WORLD_SIZE or 1024, within the open-file limit; is something else "
              "connecting to MASTER_PORT?)",
              host_, port_, clients_.size(), max_clients_);
        clients_warned_ = true;
        refuse(fd, fmt::format("{} clients are connected, the most it keeps", clients_.size()));
        continue;
      }
      clients_warned_ = false;
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      char name[INET6_ADDRSTRLEN] = "?";
      int peer_port = 0;
      if (ss.ss_family == AF_INET) {
        auto* a = reinterpret_cast<sockaddr_in*>(&ss);
        inet_ntop(AF_INET, &a->sin_addr, name, sizeof(name));
        peer_port = ntohs(a->sin_port);
      } else if (ss.ss_family == AF_INET6) {
        auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
        inet_ntop(AF_INET6, &a->sin6_addr, name, sizeof(name));
        peer_port = ntohs(a->sin6_port);
      }
      if (loopback_only_ && !loopback_address(name)) {
        CONDUIT_LOG_WARN("tcp store server localhost:{}: refused a connection from {} (MASTER_ADDR localhost)", port_,
                         name);
        ::close(fd);
        continue;
      }
      Client c;
      c.fd = fd;
      c.last_read = Clock::now();
      c.peer = fmt::format("{}:{}", name, peer_port);
      clients_.emplace(next_client_++, std::move(c));
    }
  }

  // Reads what is available and serves every complete request. False: drop the client.
  bool read_client(uint64_t id, Client& c) {
    char buf[65536];
    while (true) {
      if (paused(c)) return true;  // read again once its replies drained and its gets were answered
      ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n > 0) {
        c.last_read = Clock::now();
        c.spoke = true;
        c.in.append(buf, static_cast<size_t>(n));
        if (!serve(id, c)) return false;
        if (static_cast<size_t>(n) < sizeof(buf)) return true;
        continue;
      }
      if (n == 0) {
        if (!c.in.empty()) {
          CONDUIT_LOG_ERROR(
              "tcp store server {}:{}: client {} closed the connection in the middle of a frame "
              "({} bytes pending); dropped it",
              host_, port_, c.peer, c.in.size());
        }
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      CONDUIT_LOG_WARN("tcp store server {}:{}: read from client {} failed: {}; dropped it", host_, port_, c.peer,
                       std::strerror(errno));
      return false;
    }
  }

  bool serve(uint64_t id, Client& c) {
    set_arriving(c, 0);  // (what is complete is judged as what it is; what is not is counted again below)
    size_t off = 0;
    bool ok = true;
    while (!paused(c)) {
      if (c.skip > 0) {
        const size_t d = static_cast<size_t>(std::min<uint64_t>(c.skip, c.in.size() - off));
        off += d;
        c.skip -= d;
        if (c.skip > 0) break;
      }
      if (c.in.size() - off < kHeaderBytes) break;
      Header h = decode_header(c.in.data() + off);
      std::string bad = check_header(h, false);
      if (!bad.empty()) {
        CONDUIT_LOG_ERROR("tcp store server {}:{}: malformed request from {}: {}; dropped the client", host_, port_,
                          c.peer, bad);
        ok = false;
        break;
      }
      size_t total = kHeaderBytes + static_cast<size_t>(h.key_len) + h.value_len;
      // (not reserved from the header: 30 connections that sent a header each reserved 4 GB)
      if (c.in.size() - off < total) break;
      std::string key = c.in.substr(off + kHeaderBytes, h.key_len);
      std::string value = c.in.substr(off + kHeaderBytes + h.key_len, h.value_len);
      off += total;
      if (!handle(id, c, h, std::move(key), std::move(value))) {
        ok = false;
        break;
      }
    }
    if (off > 0) c.in.erase(0, off);
    if (!ok) return false;
    // What is left is held here as it came: a request still arriving (or requests waiting for a backed-up client to
    // read its replies) counts against the limit by the bytes received (clients that each sent most of a 64 MiB value
    // and stopped held 64 MiB apiece, uncounted; counting what a header announces let a few headers with nothing
    // behind them block the store). A request still arriving that takes the store past the limit is refused now, its
    // remaining bytes discarded as they come, so the connection stays in step.
    set_arriving(c, c.in.size());
    if (c.in.size() >= kHeaderBytes && holding() > max_bytes_) {
      const Header h = decode_header(c.in.data());
      const uint64_t total = kHeaderBytes + uint64_t{h.key_len} + h.value_len;
      if (check_header(h, false).empty() && c.in.size() < total) {
        refuse(c, h, fmt::format("a request of {} bytes", total),
               fmt::format("the store holds {} besides the {} bytes of this request of {} received so far, "
                           "which take it past CONDUIT_STORE_MAX_BYTES = {} (rank 0's); allowed: fewer or smaller "
                           "values or keys, or a larger limit",
                           held_text(holding() - c.arriving, arriving_bytes_ - c.arriving), c.in.size(), total,
                           max_bytes_));
        c.skip = total - c.in.size();
        c.in.clear();
        set_arriving(c, 0);
      }
    }
    // (a 64 MiB request's buffer is not kept by an idle connection: six that had each sent one held 128 MiB apiece)
    if (c.in.capacity() > (size_t{1} << 20) && c.in.size() < c.in.capacity() / 4) c.in.shrink_to_fit();
    return true;
  }
  void set_arriving(Client& c, uint64_t bytes) {
    arriving_bytes_ = arriving_bytes_ - c.arriving + bytes;
    c.arriving = bytes;
  }

  void reply(Client& c, const Header& req, Status st, const std::string& value) {
    Header h;
    h.op = static_cast<uint8_t>(req.op | kReplyBit);
    h.status = st;
    h.id = req.id;
    c.out.push_back(frame(h, std::string(), value));
    c.out_bytes += c.out.back().size();
    replying_bytes_ += c.out.back().size();
  }
  // Whether an answer carrying `value` bytes may be queued for `c` now: the replies queued for every client stay
  // within what the limit leaves (each is a copy of its value: 40 clients that each sent a get of an 8 MiB value and
  // read nothing held 320 MiB beside the one counted), or none is queued (one larger than the room still goes, alone),
  // or it is small and `c` has none queued. One that may not waits, charged as a waiting get, until replies drain.
  // (Only the answers of gets wait: the replies to sets, adds, checks and refusals are small and always go.)
  bool reply_fits(const Client& c, size_t value) const {
    const size_t bytes = kHeaderBytes + value;
    return replying_bytes_ == 0 || (bytes <= kSmallReply && c.out.empty() && replying_bytes_ + bytes <= max_bytes_) ||
           holding() + replying_bytes_ + bytes <= max_bytes_;
  }
  // The answer to a get that waited for its key.
  void reply_get(Client& c, uint64_t req_id, const std::string& value) {
    Header req;
    req.op = kOpGet;
    req.id = req_id;
    reply(c, req, kOk, value);
  }

  bool handle(uint64_t id, Client& c, const Header& h, std::string key, std::string value) {
    switch (h.op) {
      case kOpSet:
        // (a rank's failure goes in whatever the store holds: refused when it was full, the ranks were told only
        // that the connection was lost; bounded so it cannot be used to pass the limit)
        if (!(key == kTcpStoreErrorKey && value.size() <= kMaxErrorBytes) && !room_for(c, h, key, value.size()))
          return true;
        set_key(key, std::move(value));
        reply(c, h, kOk, {});
        return true;
      case kOpGet: {
        auto it = data_.find(key);
        // (a get of a key that is there waits for room for its reply, behind the client's earlier answers)
        const bool held_back = it != data_.end() && (!c.deferred.empty() || !reply_fits(c, it->second.size()));
        if (it != data_.end() && !held_back) {
          reply(c, h, kOk, it->second);
        } else if (it == data_.end() && failed()) {
          reply(c, h, kFailed, data_.at(kTcpStoreErrorKey));
        } else if (holding() + parked_cost(key) > max_bytes_) {
          // (a get waiting for its key or for room holds memory too: one client could park gets without end)
          refuse(c, h, "a waiting get",
                 fmt::format("the store holds {} of values and waiting gets, and one more waiting get would "
                             "pass CONDUIT_STORE_MAX_BYTES = {} (rank 0's); allowed: {}, or a larger limit",
                             held_text(holding(), arriving_bytes_ - c.arriving), max_bytes_,
                             held_back ? "clients that read their answers (this get's waits for room for its reply)"
                                       : "fewer gets of keys not set yet"));
        } else if (held_back) {
          c.deferred.emplace_back(key, h.id);  // (answered by run() once replies drained)
          parked_bytes_ += parked_cost(key);
        } else {
          waiters_[key].push_back({id, h.id});
          parked_bytes_ += parked_cost(key);
        }
        return true;
      }
      case kOpAdd: {
        if (value.size() != 8) {
          CONDUIT_LOG_ERROR(
              "tcp store server {}:{}: add from {} carries {} value bytes (expected 8); dropped the client", host_,
              port_, c.peer, value.size());
          return false;
        }
        auto delta = static_cast<int64_t>(get_le<uint64_t>(value.data()));
        int64_t cur = 0;
        auto it = data_.find(key);
        if (it != data_.end()) {
          // (all of it: strtoll took " +7" as 7, and "5\0x" as 5, stopping at the NUL)
          const std::string& v = it->second;
          const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), cur);
          if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
            reply(c, h, kBadRequest, fmt::format("value of key '{}' is not an integer", key));
            return true;
          }
        }
        int64_t next = 0;
        if (__builtin_add_overflow(cur, delta, &next)) {  // (it wrapped, answered as a success)
          reply(c, h, kBadRequest,
                fmt::format("add of {} on key '{}' (value {}) would overflow a 64-bit integer", delta, key, cur));
          return true;
        }
        std::string text = std::to_string(next);
        if (!room_for(c, h, key, text.size())) return true;
        set_key(key, std::move(text));
        reply(c, h, kOk, encode_i64(next));
        return true;
      }
      case kOpCheck:
        reply(c, h, data_.count(key) ? kOk : kNotFound, {});
        return true;
      case kOpPing:
        reply(c, h, kOk, {});
        return true;
      default:
        return false;  // unreachable: check_header rejects other ops
    }
  }

  void set_key(const std::string& key, std::string value) {
    auto found = data_.find(key);
    const uint64_t was = found == data_.end() ? 0 : entry_cost(key, found->second.size());
    const uint64_t will = entry_cost(key, value.size());
    auto& slot = data_[key];
    slot = std::move(value);
    held_bytes_ = held_bytes_ - was + will;  // (once it is in: a failed insert leaves the count as it was)
    if (key == kTcpStoreErrorKey) fail_waiters();
    auto w = waiters_.find(key);
    if (w == waiters_.end()) return;
    // The waiting gets join their clients' answers in waiting, which run() sends as room allows, in order (answered
    // here, an allocation failing halfway left the answered ones in the list, to be charged off twice).
    const auto list = std::move(w->second);
    waiters_.erase(w);
    for (auto [client_id, req_id] : list) {
      auto c = clients_.find(client_id);
      if (c == clients_.end()) {  // that client went away while it waited
        parked_bytes_ -= parked_cost(key);
        continue;
      }
      c->second.deferred.emplace_back(key, req_id);  // (still charged: it holds its key until the reply goes)
    }
  }

  // Rank 0 failed (its error under kTcpStoreErrorKey): no key a get waits for will come.
  bool failed() const { return data_.count(kTcpStoreErrorKey) != 0; }
  // Answers every get waiting for a key with rank 0's error (the others learned it only from the lost connection once
  // rank 0 exited: "did rank 0 exit?", found by an audit).
  void fail_waiters() {
    const std::string& why = data_.at(kTcpStoreErrorKey);
    for (auto& [key, list] : waiters_) {
      for (auto [client_id, req_id] : list) {
        parked_bytes_ -= parked_cost(key);
        auto c = clients_.find(client_id);
        if (c == clients_.end()) continue;
        Header req;
        req.op = kOpGet;
        req.id = req_id;
        reply(c->second, req, kFailed, why);
      }
    }
    waiters_.clear();
  }

  bool flush(Client& c) {
    while (!c.out.empty()) {
      const std::string& front = c.out.front();
      ssize_t n = send(c.fd, front.data() + c.out_off, front.size() - c.out_off, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += static_cast<size_t>(n);
        if (c.out_off == front.size()) {
          c.out_bytes -= front.size();
          replying_bytes_ -= front.size();
          c.out.pop_front();
          c.out_off = 0;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      CONDUIT_LOG_WARN("tcp store server {}:{}: write to client {} failed: {}; dropped it", host_, port_, c.peer,
                       std::strerror(errno));
      return false;
    }
    return true;
  }

  void drop(uint64_t id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    if (it->second.fd >= 0) close(it->second.fd);
    for (const auto& d : it->second.deferred) parked_bytes_ -= parked_cost(d.first);  // (answers it never took)
    arriving_bytes_ -= it->second.arriving;
    replying_bytes_ -= it->second.out_bytes;
    clients_.erase(it);
    // The gets it left waiting go with it (they stayed, each with its key, until the key was set, if ever).
    for (auto w = waiters_.begin(); w != waiters_.end();) {
      auto& v = w->second;
      const size_t before = v.size();
      v.erase(std::remove_if(v.begin(), v.end(), [id](const auto& e) { return e.first == id; }), v.end());
      parked_bytes_ -= (before - v.size()) * parked_cost(w->first);
      w = v.empty() ? waiters_.erase(w) : std::next(w);
    }
  }

  std::string host_;
  // MASTER_ADDR "localhost": listening everywhere (both loopbacks), it serves loopback peers only (it served any
  // host, unauthenticated as it is).
  bool loopback_only_ = false;
  int port_ = 0;
  int listen_fd_ = -1;
  Clock::time_point accept_paused_until_{};
  bool accept_warned_ = false;
  bool clients_warned_ = false;  // (the refusal of a connection past max_clients_ logged, until one is taken)
  Clock::duration stall_{};      // a client mid-request that sends nothing for this long is dropped (kStallSeconds)
  size_t max_clients_ = kMinMaxClients;
  int wake_[2] = {-1, -1};
  std::string self_host_;
  std::thread thread_;
  // Owned by the server thread only.
  std::unordered_map<uint64_t, Client> clients_;
  uint64_t next_client_ = 1;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> waiters_;
  // Keys' and values' bytes held, within max_bytes_ (CONDUIT_STORE_MAX_BYTES): the store listens on every interface
  // unless MASTER_ADDR is a loopback address, unauthenticated as torch's TCPStore, and a client setting ever more keys
  // grew rank 0 without bound.
  uint64_t held_bytes_ = 0;
  uint64_t max_bytes_ = 0;
  // Gets waiting for their key (or for their client to take the answer) count against the same limit: their key and
  // a record each; a stored key its key, its value and the map's node.
  uint64_t parked_bytes_ = 0;
  static uint64_t parked_cost(const std::string& key) { return key.size() + 64; }
  // Bytes of requests received and not served yet (Client::arriving).
  uint64_t arriving_bytes_ = 0;
  // Bytes of the replies queued, every client's (Client::out_bytes, a reply's until the whole of it has gone): within
  // what max_bytes_ leaves (reply_fits), not counted in holding() (a set is not refused for replies on their way).
  uint64_t replying_bytes_ = 0;
  static uint64_t entry_cost(const std::string& key, size_t value) { return key.size() + value + 96; }
  bool warned_ = false;  // (one warning of a refusal until one is taken again: a flood would fill the log)

  static uint64_t store_max_bytes() {
    const auto s = env_string("CONDUIT_STORE_MAX_BYTES");
    if (!s) return uint64_t{1} << 30;
    const uint64_t b = parse_bytes(*s, "CONDUIT_STORE_MAX_BYTES");
    if (b < (uint64_t{1} << 20) || b > (uint64_t{1} << 40))
      throw ConfigError(fmt::format(
          "CONDUIT_STORE_MAX_BYTES='{}' is {} bytes; allowed: 1M to 1T (the TCP store's keys and values, 1G by "
          "default)",
          *s, b));
    return b;
  }
  // Refuses (kBadRequest, the client's one-line error) a set of `key` to `bytes` of value that would take the store
  // past max_bytes_. False: refused.
  bool room_for(Client& c, const Header& h, const std::string& key, size_t bytes) {
    auto it = data_.find(key);
    const uint64_t now = it == data_.end() ? 0 : entry_cost(key, it->second.size());
    // (the gets this set answers give their charge back)
    auto w = waiters_.find(key);
    const uint64_t answered = w == waiters_.end() ? 0 : w->second.size() * parked_cost(key);
    const uint64_t after = holding() - now - answered + entry_cost(key, bytes);
    if (after <= max_bytes_) {
      warned_ = false;
      return true;
    }
    refuse(c, h, fmt::format("a set of {} bytes", key.size() + bytes),
           fmt::format("the store holds {} and this value would take it to {}, past CONDUIT_STORE_MAX_BYTES = "
                       "{} (rank 0's); allowed: fewer or smaller values, or a larger limit",
                       held_text(holding(), arriving_bytes_ - c.arriving), after, max_bytes_));
    return false;
  }
  uint64_t holding() const { return held_bytes_ + parked_bytes_ + arriving_bytes_; }
  // "N bytes", and how many of them are other clients' requests still arriving (found by an audit: one stalled
  // half-sent request read as values the store held).
  std::string held_text(uint64_t held, uint64_t arriving) const {
    if (arriving == 0) return fmt::format("{} bytes", held);
    return fmt::format(
        "{} bytes ({} of them requests still arriving, released when they end or after {:.0f} s without "
        "progress)",
        held, arriving, std::chrono::duration<double>(stall_).count());
  }
  // A request the limit refuses: the client's one-line error, and a warning (once until one is taken again).
  void refuse(Client& c, const Header& h, const std::string& what, const std::string& why) {
    if (!warned_)
      CONDUIT_LOG_WARN("tcp store server {}:{}: refused {} from {}: the store holds {} of {}", host_, port_, what,
                       c.peer, holding(), max_bytes_);
    warned_ = true;
    reply(c, h, kBadRequest, why);
  }
};

// ------------------------------------------------------------------------------------------------ client

struct Conn {
  int fd = -1;
  uint64_t next_id = 1;
  ~Conn() {
    if (fd >= 0) close(fd);
  }
};

class TcpStore : public Store {
 public:
  TcpStore(std::shared_ptr<TcpStoreServer> server, const std::string& host, int port, const Deadline& connect_deadline)
      : server_(std::move(server)),
        host_(server_ ? server_->self_host() : host),
        port_(port),
        addr_(fmt::format("{}:{}", host, port)) {
    // Connect eagerly so that a wrong address or a missing server surfaces here, within the connect deadline.
    auto c = connect(connect_deadline, /*first=*/true);
    std::lock_guard<std::mutex> lk(mu_);
    idle_.push_back(std::move(c));
  }

  ~TcpStore() override {
    std::lock_guard<std::mutex> lk(mu_);
    idle_.clear();  // close our connections before the server (if ours) stops
  }

  int port() const { return port_; }

  void set(const std::string& key, const std::string& value, const Deadline& deadline) override {
    check_sizes(key, value.size());
    request(kOpSet, key, value, deadline);
  }

  std::string get(const std::string& key, const Deadline& deadline) override {
    check_sizes(key, 0);
    return request(kOpGet, key, {}, deadline).second;
  }

  int64_t add(const std::string& key, int64_t delta, const Deadline& deadline) override {
    check_sizes(key, 8);
    auto [st, v] = request(kOpAdd, key, encode_i64(delta), deadline);
    if (v.size() != 8)
      throw ProtocolError(
          fmt::format("tcp store {}: add reply for key '{}' carries {} bytes "
                      "(expected 8)",
                      addr_, key, v.size()));
    return static_cast<int64_t>(get_le<uint64_t>(v.data()));
  }

  bool check(const std::string& key, const Deadline& deadline) override {
    check_sizes(key, 0);
    return request(kOpCheck, key, {}, deadline).first == kOk;
  }

 private:
  void check_sizes(const std::string& key, size_t value_bytes) const {
    if (key.size() > kMaxStoreFieldBytes || value_bytes > kMaxStoreFieldBytes) {
      throw InvalidArgument(fmt::format("tcp store {}: key '{}...' or its value is larger than the {} byte limit",
                                        addr_, key.substr(0, 64), kMaxStoreFieldBytes));
    }
  }

  std::unique_ptr<Conn> connect(const Deadline& deadline, bool first) {
    // After the first connection succeeded the server is known to be up: a refused connection then means it is
    // gone, and waiting out a long deadline would only hide that, so refusals get 1 s. A connection that is merely
    // slow (a full backlog, a server busy accepting) gets the caller's deadline (all of them got 1 s: a loaded
    // server was reported gone).
    Deadline d = deadline;
    bool refused_before = false;
    std::string target = connect_host(host_);
    std::string why = "no attempt";
    auto backoff = std::chrono::milliseconds(5);
    while (true) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      int rc = getaddrinfo(target.c_str(), std::to_string(port_).c_str(), &hints, &res);
      if (rc != 0) {
        why = fmt::format("cannot resolve '{}': {}", target, gai_strerror(rc));
      } else {
        for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
          int fd = try_connect(ai, d, &why);
          if (fd >= 0) {
            freeaddrinfo(res);
            auto c = std::make_unique<Conn>();
            c->fd = fd;
            return c;
          }
        }
        freeaddrinfo(res);
      }
      if (!first && !refused_before && why == std::strerror(ECONNREFUSED)) {
        refused_before = true;
        d = deadline.min(Deadline::after(1.0));
      }
      if (d.expired()) break;
      // (clamped before the cast: Deadline::never()'s remaining time overflowed the nanoseconds, undefined; where
      // that gave a negative pause, a connection retried without a deadline spun a core)
      std::this_thread::sleep_for(d.remaining_at_most(std::chrono::nanoseconds(backoff)));
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(500));
      if (d.expired()) break;
    }
    if (first || deadline.expired()) {
      throw TimeoutError(
          fmt::format("tcp store: could not connect to the server at {} before the deadline: {} "
                      "(is rank 0 running and MASTER_ADDR/MASTER_PORT right?)",
                      addr_, why));
    }
    throw PeerError(fmt::format("tcp store: the server at {} is unreachable: {} (did rank 0 exit?)", addr_, why));
  }

  static int try_connect(addrinfo* ai, const Deadline& d, std::string* why) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      *why = std::strerror(errno);
      return -1;
    }
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int n;
      do {
        n = poll(&p, 1, std::max(10, poll_timeout_ms(d, 1000)));  // even a spent deadline gets one real try
      } while (n < 0 && errno == EINTR);
      int err = 0;
      socklen_t len = sizeof(err);
      if (n <= 0) {
        err = n == 0 ? ETIMEDOUT : errno;
      } else {
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      *why = std::strerror(errno);
      close(fd);
      return -1;
    }
    // Nothing listening on a port of the kernel's ephemeral range: a retried connect can be handed that very port as
    // its own and meet itself (TCP's simultaneous open), and its requests then came back as malformed replies. It is
    // a refusal, and its port goes back at once (held, it kept rank 0 from listening there).
    if (connected_to_itself(fd)) {
      *why = std::strerror(ECONNREFUSED);
      close(fd);
      return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return fd;
  }

  std::unique_ptr<Conn> acquire(const Deadline& deadline, uint8_t op, const std::string& key) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!idle_.empty()) {
        auto c = std::move(idle_.back());
        idle_.pop_back();
        return c;
      }
    }
    try {
      return connect(deadline, /*first=*/false);
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("tcp store {}: {} of key '{}' did not complete before the deadline ({})", addr_,
                                     op_name(op), key, e.what()));
    }
  }

  void release(std::unique_ptr<Conn> c) {
    std::lock_guard<std::mutex> lk(mu_);
    if (idle_.size() < 8) idle_.push_back(std::move(c));
  }

  static const char* op_name(uint8_t op) {
    switch (op) {
      case kOpSet:
        return "set";
      case kOpGet:
        return "get";
      case kOpAdd:
        return "add";
      case kOpCheck:
        return "check";
      default:
        return "ping";
    }
  }

  [[noreturn]] void timeout(uint8_t op, const std::string& key, const Deadline& d) const {
    throw TimeoutError(
        fmt::format("tcp store {}: {} of key '{}' did not complete before the deadline", addr_, op_name(op), key));
  }

  [[noreturn]] void gone(uint8_t op, const std::string& key, const std::string& why) const {
    throw PeerError(
        fmt::format("tcp store {}: connection to the server lost during {} of key '{}': {} (did rank 0 "
                    "exit?)",
                    addr_, op_name(op), key, why));
  }

  // Waits until fd is ready for `events`; false on deadline.
  static bool wait_fd(int fd, short events, const Deadline& d) {
    while (true) {
      pollfd p{fd, events, 0};
      int n = poll(&p, 1, poll_timeout_ms(d, 1000));
      if (n > 0) return true;
      if (n < 0 && errno != EINTR) return true;  // let the following read/write report the error
      if (d.expired()) return false;
    }
  }

  void send_all(Conn& c, const std::string& bytes, uint8_t op, const std::string& key, const Deadline& d) {
    size_t off = 0;
    while (off < bytes.size()) {
      ssize_t n = ::send(c.fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!wait_fd(c.fd, POLLOUT, d)) timeout(op, key, d);
        continue;
      }
      gone(op, key, std::strerror(errno));
    }
  }

  void recv_all(Conn& c, char* p, size_t len, uint8_t op, const std::string& key, const Deadline& d) {
    size_t off = 0;
    while (off < len) {
      ssize_t n = ::recv(c.fd, p + off, len - off, 0);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) gone(op, key, off == 0 ? "server closed the connection" : "server closed the connection mid-reply");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (!wait_fd(c.fd, POLLIN, d)) timeout(op, key, d);
        continue;
      }
      gone(op, key, std::strerror(errno));
    }
  }

  std::pair<uint8_t, std::string> request(uint8_t op, const std::string& key, const std::string& value,
                                          const Deadline& deadline) {
    // A connection the server refused (it keeps its most) read none of the request: sent again on a new one, with a
    // growing pause, until the deadline.
    auto pause = std::chrono::milliseconds(10);
    std::string refused;
    auto refused_until_deadline = [&] {
      return TimeoutError(
          fmt::format("tcp store {}: {} of key '{}' did not complete before the deadline: the server "
                      "refused its connections ({}; is something else connecting to MASTER_PORT?)",
                      addr_, op_name(op), key, refused));
    };
    while (true) {
      std::optional<std::pair<uint8_t, std::string>> got;
      try {
        got = request_once(op, key, value, deadline, &refused);
      } catch (const TimeoutError&) {
        if (refused.empty()) throw;
        throw refused_until_deadline();  // (the last try, begun as the deadline came)
      }
      if (got) return *got;
      if (deadline.expired()) throw refused_until_deadline();
      // (the remaining time clamped before its cast: a distant deadline's overflowed to a negative pause)
      std::this_thread::sleep_for(deadline.remaining_at_most(std::chrono::nanoseconds(pause)));
      pause = std::min(pause * 2, std::chrono::milliseconds(500));
      if (deadline.expired()) throw refused_until_deadline();
    }
  }

  // The server's refusal frame, when it is what `c` holds: true, and why in `*refused`. Reads without waiting.
  static bool read_refusal(Conn& c, std::string* refused) {
    char hb[kHeaderBytes];
    if (::recv(c.fd, hb, kHeaderBytes, MSG_DONTWAIT | MSG_PEEK) != static_cast<ssize_t>(kHeaderBytes)) return false;
    const Header r = decode_header(hb);
    if (!check_header(r, true).empty() || r.status != kRefused || r.id != 0 || r.key_len != 0 || r.value_len > 4096)
      return false;
    std::string frame_bytes(kHeaderBytes + r.value_len, '\0');
    if (::recv(c.fd, frame_bytes.data(), frame_bytes.size(), MSG_DONTWAIT) != static_cast<ssize_t>(frame_bytes.size()))
      return false;
    *refused = refusal_reason(frame_bytes.substr(kHeaderBytes));
    return true;
  }

  // The refusal frame's text (its value), "refused" where it has none.
  static std::string refusal_reason(std::string value) { return value.empty() ? "refused" : value; }

  // One try of request(): empty when the server refused the connection (`*refused`: why, set then only).
  std::optional<std::pair<uint8_t, std::string>> request_once(uint8_t op, const std::string& key,
                                                              const std::string& value, const Deadline& deadline,
                                                              std::string* refused) {
    auto c = acquire(deadline, op, key);
    Header h;
    h.op = op;
    h.id = c->next_id++;
    try {
      try {
        send_all(*c, frame(h, key, value), op, key, deadline);
      } catch (const PeerError&) {
        // (a request longer than what the refusing server drained met its reset mid-send: the refusal is read first)
        if (read_refusal(*c, refused)) return std::nullopt;
        throw;
      }
      while (true) {
        char hb[kHeaderBytes];
        recv_all(*c, hb, kHeaderBytes, op, key, deadline);
        Header r = decode_header(hb);
        std::string bad = check_header(r, true);
        if (!bad.empty()) {
          throw ProtocolError(
              fmt::format("tcp store {}: malformed reply to {} of key '{}': {}", addr_, op_name(op), key, bad));
        }
        std::string body(static_cast<size_t>(r.key_len) + r.value_len, '\0');
        recv_all(*c, body.data(), body.size(), op, key, deadline);
        if (r.status == kRefused && r.id == 0) {
          *refused = refusal_reason(body.substr(r.key_len));
          return std::nullopt;  // (`c` closed)
        }
        if (r.id < h.id) continue;  // the late reply of an earlier request that timed out
        if (r.id != h.id || (r.op & ~kReplyBit) != op) {
          throw ProtocolError(fmt::format("tcp store {}: reply id {} op {:#04x} does not match request id {} ({})",
                                          addr_, r.id, r.op, h.id, op_name(op)));
        }
        if (r.status == kBadRequest) {
          release(std::move(c));
          throw InvalidArgument(fmt::format("tcp store {}: {} of key '{}' rejected: {}", addr_, op_name(op),
                                            key.size() > 64 ? key.substr(0, 64) + "..." : key, body.substr(r.key_len)));
        }
        if (r.status == kFailed) {
          release(std::move(c));
          throw PeerError(fmt::format("rank 0 failed: {} (the answer of its tcp store {} to the {} of key '{}')",
                                      body.substr(r.key_len), addr_, op_name(op), key));
        }
        if (r.status != kOk && !(op == kOpCheck && r.status == kNotFound)) {
          throw ProtocolError(fmt::format("tcp store {}: unknown status {} in the reply to {} of key '{}'", addr_,
                                          r.status, op_name(op), key));
        }
        release(std::move(c));
        return std::pair{r.status, body.substr(r.key_len)};
      }
    } catch (const Error&) {
      // `c` is closed here, not returned to the pool: after a timeout or an error it may hold half a frame.
      throw;
    }
  }

  std::shared_ptr<TcpStoreServer> server_;  // declared first: destroyed after the connections
  std::string host_;
  int port_;
  std::string addr_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Conn>> idle_;
};

}  // namespace

StorePtr make_tcp_store(const std::string& host, int port, bool is_server, const Deadline& connect_deadline) {
  if (port < 0 || port > 65535) {
    throw ConfigError(fmt::format("tcp store: port {} is invalid: expected 0..65535 (MASTER_PORT)", port));
  }
  if (!is_server && port == 0) {
    throw ConfigError("tcp store: a client needs the server's port, got 0 (set MASTER_PORT)");
  }
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);  // "[::1]"
  std::shared_ptr<TcpStoreServer> server;
  if (is_server) {
    server = std::make_shared<TcpStoreServer>(h, port);
    port = server->port();
  }
  return std::make_shared<TcpStore>(std::move(server), h, port, connect_deadline);
}

int tcp_store_port(const Store& store) {
  const auto* t = dynamic_cast<const TcpStore*>(&store);
  if (t == nullptr) throw InvalidArgument("tcp_store_port: the store is not a TCP store");
  return t->port();
}

}  // namespace conduit::net
