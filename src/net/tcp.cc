#include "net/tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "net/matching.h"
#include "net/wire.h"

namespace conduit::net {

std::string tcp_listen_address(std::string* why) {
  const char* vars[] = {"CONDUIT_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"};
  std::string wanted, var;
  for (const char* v : vars) {
    if (auto s = env_string(v)) {
      wanted = *s;
      var = v;
      break;
    }
  }
  // NCCL's and Gloo's variables may hold their own list syntax (^exclude, a,b, =exact); Conduit takes one name.
  if (!wanted.empty() && wanted.find_first_of("^,=") != std::string::npos)
    throw ConfigError(
        fmt::format("{}='{}' is a list or pattern, which Conduit does not read; allowed: one interface "
                    "name (CONDUIT_SOCKET_IFNAME, read first, overrides it for Conduit alone)",
                    var, wanted));
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw Error(fmt::format("getifaddrs failed: {}", std::strerror(errno)));
  std::string found, found_if, names;
  std::vector<std::string> others;  // interfaces without an IPv4 address (IPv6 only, or none)
  bool down = false;                // the named interface is down
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) {
      if (std::find(others.begin(), others.end(), a->ifa_name) == others.end()) others.emplace_back(a->ifa_name);
      continue;
    }
    if (!names.empty()) names += ", ";
    names += a->ifa_name;
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
    bool up = (a->ifa_flags & IFF_UP) != 0;
    bool loop = (a->ifa_flags & IFF_LOOPBACK) != 0;
    if (!wanted.empty()) {
      if (wanted == a->ifa_name) {
        down = !up;
        found = buf;
        found_if = a->ifa_name;
        break;
      }
    } else if (up && !loop && found.empty()) {
      found = buf;
      found_if = a->ifa_name;
    }
  }
  freeifaddrs(list);
  // (an interface listed with IPv4 is not one without)
  std::string without;
  for (const std::string& o : others)
    if ((", " + names + ", ").find(", " + o + ", ") == std::string::npos) without += (without.empty() ? "" : ", ") + o;
  if (down)
    throw ConfigError(fmt::format("{}={}: the interface is down; allowed: an interface that is up", var, wanted));
  std::string reason;
  if (!wanted.empty() && found.empty()) {
    throw ConfigError(
        fmt::format("{}={} names no interface with an IPv4 address (the tcp transport speaks IPv4 only); allowed "
                    "here: {}{}",
                    var, wanted, names.empty() ? "none" : names,
                    without.empty() ? "" : fmt::format(" (without an IPv4 address: {})", without)));
  }
  if (!wanted.empty())
    reason = fmt::format("interface {} ({}) from {}", found_if, found, var);
  else if (!found.empty())
    reason = fmt::format("interface {} ({}): first up non-loopback interface", found_if, found);
  else {
    found = "127.0.0.1";
    reason = fmt::format(
        "loopback 127.0.0.1: no other interface with an IPv4 address is up (ranks on other hosts cannot reach it; "
        "the tcp transport speaks IPv4 only{})",
        without.empty() ? "; set CONDUIT_SOCKET_IFNAME to an interface that has one"
                        : fmt::format("; interfaces without an IPv4 address here: {}", without));
  }
  if (why) *why = reason;
  return found;
}

uint64_t tcp_job_fingerprint(const std::vector<std::string>& addresses) {
  // FNV-1a 64 over the count and each address with its length (so that no two books hash alike by concatenation).
  uint64_t x = 14695981039346656037ull;
  auto mix = [&x](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) x = (x ^ p[i]) * 1099511628211ull;
  };
  const uint64_t count = addresses.size();
  mix(&count, sizeof count);
  for (const std::string& a : addresses) {
    const uint64_t n = a.size();
    mix(&n, sizeof n);
    mix(a.data(), a.size());
  }
  return x;
}

namespace {

constexpr size_t kStagingBytes = 256 * 1024;

struct TcpSend {
  RequestPtr req;
  FrameHeader hdr;
  const char* data = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // counts the header too
  std::string owned;
};

// discard: the payload of a message whose matched receive expected another size (that receive has failed).
enum class Target { none, posted, unexpected, abort, discard };

// Locks: the transport's mu_ guards the receive side of every peer (state machine, matching queues, failure);
// send_mu guards one peer's send queue and socket writes, so a caller's isend never waits for the progress thread
// to finish reading (and reducing) another connection; interest_mu guards the epoll registration. Order: mu_, then
// send_mu, then interest_mu.
struct Peer {
  int rank = -1;
  int fd = -1;
  std::atomic<bool> failed{false};  // set (with error, under mu_) once; error is read after failed is seen
  std::exception_ptr error;
  std::mutex send_mu;
  std::deque<TcpSend> sendq;
  std::exception_ptr send_error;         // a write failed: sends queue unwritten until the read side fails them all
  std::atomic<bool> send_failed{false};  // send_error is set (readable without send_mu)
  bool dropped_mid_frame = false;        // under send_mu: fail_peer cleared a partly written send
  bool ended = false;                    // under send_mu: an abort ended the connection (a second one leaves it)
  std::mutex interest_mu;
  uint32_t interest = 0;
  std::atomic<bool> want_out{false};  // sendq has sends to write (updated under send_mu)
  std::atomic<bool> stalled{false};   // a header waits for a receive to be posted (updated under mu_)
  bool noted = false;                 // under mu_: the transport's note says why this peer is held (stall_note)
  bool warned = false;                // under mu_: a stall of this peer was logged (once)
  // The peer shut its side (or the connection broke): nothing more will come (set under mu_; read by update_interest
  // on a sender's thread too).
  std::atomic<bool> peer_closed{false};
  // receive state machine
  FrameHeader hdr{};
  size_t hdr_got = 0;
  bool have_hdr = false;
  Target target = Target::none;
  PostedRecv cur;
  std::shared_ptr<Unexpected> cur_unexp;
  std::string abort_buf;
  size_t pay_got = 0;
  std::vector<char> staging;
  size_t staged = 0;
  size_t reduced_elems = 0;
  MatchQueues q;
};

void set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

// How long an accepted connection may take to say hello before it is dropped, and how many may be waited on at once.
constexpr double kHelloSeconds = 5.0;
constexpr size_t kMaxPendingHellos = 64;

bool poll_fd(int fd, short events, const Deadline& d) {
  while (true) {
    double rem = d.remaining_seconds();
    if (rem <= 0) return false;
    pollfd p{fd, events, 0};
    int ms = rem > 1e6 ? 1000 : static_cast<int>(rem * 1000) + 1;
    int r = ::poll(&p, 1, ms);
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

void write_all_blocking(int fd, const void* data, size_t n, const Deadline& d) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!poll_fd(fd, POLLOUT, d)) throw TimeoutError("tcp: handshake write timed out");
      continue;
    }
    throw PeerError(fmt::format("tcp: handshake write failed: {}", std::strerror(errno)));
  }
}

void read_all_blocking(int fd, void* data, size_t n, const Deadline& d) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!poll_fd(fd, POLLIN, d)) throw TimeoutError("tcp: handshake read timed out");
    ssize_t r = ::recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      throw PeerError("tcp: connection closed during handshake");
    } else if (errno != EAGAIN && errno != EINTR) {
      throw PeerError(fmt::format("tcp: handshake read failed: {}", std::strerror(errno)));
    }
  }
}

class TcpTransport : public Transport {
 public:
  TcpTransport(int rank, int size, std::vector<int> hosts, std::vector<char> serve, const AllgatherFn& allgather,
               const Deadline& deadline)
      : peers_(size), serve_(std::move(serve)) {
    if (serve_.empty()) serve_.assign(size, 1);
    rank_ = rank;
    size_ = size;
    hosts_ = std::move(hosts);
    unexpected_budget_ = tcp_unexpected_budget();
    max_len_ = max_message_bytes();
    for (int i = 0; i < size; ++i) peers_[i].rank = i;
    connect_all(allgather, deadline);
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    evfd_ = ep_ >= 0 ? eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC) : -1;
    if (ep_ < 0 || evfd_ < 0) {
      const int e = errno;
      if (ep_ >= 0) ::close(ep_);
      for (auto& p : peers_)
        if (p.fd >= 0) ::close(p.fd);
      throw Error(
          fmt::format("tcp: rank {} cannot create its event loop ({}: {}); allowed: a process with free file "
                      "descriptors (ulimit -n)",
                      rank_, ep_ < 0 ? "epoll_create1" : "eventfd", std::strerror(e)));
    }
    // A descriptor the loop does not watch is never read: every wait on it ran to its deadline with no cause given
    // (epoll_ctl fails with ENOMEM, or ENOSPC past fs.epoll.max_user_watches).
    auto watch = [&](int fd, epoll_event ev, const std::string& what) {
      if (epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) == 0) return;
      const int e = errno;
      ::close(evfd_);
      ::close(ep_);
      for (auto& p : peers_)
        if (p.fd >= 0) ::close(p.fd);
      throw Error(
          fmt::format("tcp: rank {} cannot watch {} (epoll_ctl: {}); allowed: a process under its epoll and "
                      "memory limits (fs.epoll.max_user_watches)",
                      rank_, what, std::strerror(e)));
    };
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u32 = 0xffffffffu;
    watch(evfd_, ev, "its wake-up descriptor");
    for (auto& p : peers_) {
      if (p.fd < 0) continue;
      epoll_event pe{};
      p.interest = EPOLLIN;
      pe.events = p.interest;
      pe.data.u32 = static_cast<uint32_t>(p.rank);
      watch(p.fd, pe, fmt::format("its connection to rank {}", p.rank));
    }
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (...) {  // (EAGAIN past a thread limit: the destructor does not run, the descriptors would leak)
      ::close(evfd_);
      ::close(ep_);
      for (auto& p : peers_)
        if (p.fd >= 0) ::close(p.fd);
      throw;
    }
  }

  ~TcpTransport() override {
    running_ = false;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(evfd_, &one, 8);
    if (thread_.joinable()) thread_.join();
    {
      // Requests still pending fail now rather than at their deadlines: nothing will move their data any more.
      std::lock_guard<std::mutex> lk(mu_);
      const auto err = std::make_exception_ptr(PeerError(fmt::format("tcp transport (rank {}) was destroyed", rank_)));
      for (auto& p : peers_)
        if (p.rank != rank_) fail_peer(p, err);
    }
    for (auto& p : peers_)
      if (p.fd >= 0) ::close(p.fd);
    ::close(ep_);
    ::close(evfd_);
  }

  const char* name() const override { return "tcp"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    check_peer(peer);
    check_tag("tcp", "isend", tag);
    check_message_size(bytes, max_len_);
    auto req = std::make_shared<Request>(Request::Kind::send, peer, tag, bytes);
    req->set_notes(notes_);
    Peer& p = peers_[peer];
    std::lock_guard<std::mutex> lk(p.send_mu);
    if (p.failed) {
      req->fail(p.error);
      return req;
    }
    // After a failed write (send_error) the send queues, unwritten, and fails with the queue (fail_peer, under this
    // lock after failed is set) when the read side has seen the end: with the peer's abort reason if it sent one.
    TcpSend s;
    s.req = req;
    s.hdr = make_frame(kFrameData, tag, bytes, rank_);
    s.data = static_cast<const char*>(data);
    s.bytes = bytes;
    p.sendq.push_back(std::move(s));
    if (p.sendq.size() == 1) handle_write(p);  // try to send from the caller's thread right away
    p.want_out = !p.sendq.empty() && !p.send_error;
    update_interest(p);
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    check_tag("tcp", "irecv", tag);
    return post_recv(peer, tag, make_recv(Request::Kind::recv, peer, tag, data, bytes));
  }

  RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) override {
    check_tag("tcp", "irecv_reduce", tag);
    return post_recv(peer, tag, make_reduce_recv(peer, tag, dst, count, dtype, op));
  }

  // Ends the connection on `fd` with a reset, which reaches a peer whose receive window is shut: the end of the
  // stream (shutdown's FIN) waits behind the bytes it has not read, and a peer holding a frame over its unexpected
  // budget reads none until it posts that frame's receive (it waited for its deadline on another tag, never seeing
  // the abort). The socket's last close with a zero linger sends it; the number stays open, on /dev/null, for the
  // peer's other uses of it until the destructor (where /dev/null cannot be had, the shutdown before stays).
  static void reset_connection(int fd) {
    const linger now{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &now, sizeof now);
    const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null_fd >= 0) {
      ::dup3(null_fd, fd, O_CLOEXEC);
      ::close(null_fd);
    }
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::string why = fmt::format("rank {} aborted: {}", rank_, reason);
    set_aborted(why);
    std::string msg = reason.substr(0, kMaxAbortReason);
    const FrameHeader h = make_frame(kFrameAbort, 0, msg.size(), rank_);
    std::string frame(reinterpret_cast<const char*>(&h), sizeof h);
    frame += msg;
    // The whole frame goes out, or the peer reads half of it and reports a truncated frame instead of the reason;
    // a peer whose socket stays full may hold all of them up for this long at most.
    const Deadline give_up = Deadline::after(0.5);
    // Peers already failed get the frame too: failed by another rank's abort (relayed to every peer), the
    // connections to the others are sound, and a peer waiting on this rank would otherwise hear nothing until its
    // deadline (its rank may never talk to the one that aborted first). The healthy ones first, those with a send
    // cut mid-frame after them (finishing it needs the peer to read, and one stalled on a frame it has no receive for
    // reads nothing), failed ones last: a peer that is not reading must not spend the others' share of the deadline.
    std::vector<std::pair<int, Peer*>> ranked;  // (0 healthy, 1 a send cut mid-frame, 2 failed; each peer once)
    for (auto& p : peers_) {
      if (p.fd < 0) continue;
      std::lock_guard<std::mutex> sl(p.send_mu);
      ranked.push_back({p.failed ? 2 : !p.sendq.empty() && p.sendq.front().sent > 0 ? 1 : 0, &p});
    }
    std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    auto err = std::make_exception_ptr(PeerError(why));
    for (const auto& [rank_class, pp] : ranked) {
      Peer& p = *pp;
      std::lock_guard<std::mutex> sl(p.send_mu);
      if (p.ended) continue;  // (a second abort: its write failed on the closed stream, and a reset lost the first's)
      // (A failed write ended the stream, mid-frame perhaps, and its queue waits to be failed, or a failure dropped a
      // partly written send: nothing more goes on it.)
      bool stuck = false;  // the peer took nothing more within the deadline: its window is shut
      if (!p.send_failed && !p.dropped_mid_frame) {
        try {
          // A send cut mid-frame is finished first (its buffer is still the caller's to lend): the peer reading it
          // then reads the reason, where the stream ending inside the frame told it only of a truncated frame.
          if (!p.sendq.empty() && p.sendq.front().sent > 0) {
            const TcpSend& s = p.sendq.front();
            if (s.sent < sizeof(FrameHeader))
              write_all_blocking(p.fd, reinterpret_cast<const char*>(&s.hdr) + s.sent, sizeof(FrameHeader) - s.sent,
                                 give_up);
            const size_t off = s.sent > sizeof(FrameHeader) ? s.sent - sizeof(FrameHeader) : 0;
            write_all_blocking(p.fd, s.data + off, s.bytes - off, give_up);
          }
          write_all_blocking(p.fd, frame.data(), frame.size(), give_up);
        } catch (const TimeoutError&) {
          stuck = true;
        } catch (const Error&) {  // gone: the connection's end tells the peer
        }
      }
      ::shutdown(p.fd, SHUT_RDWR);
      if (stuck) {
        {
          std::lock_guard<std::mutex> il(p.interest_mu);
          epoll_ctl(ep_, EPOLL_CTL_DEL, p.fd, nullptr);  // (the socket may outlive this number in a forked child)
        }
        reset_connection(p.fd);
      }
      p.ended = true;
      // (a send racing the abort fails with its reason, not on the descriptor the reset left)
      if (!p.send_error) {
        p.send_error = err;
        p.send_failed = true;
      }
    }
    for (auto& p : peers_) fail_peer(p, err);
  }

  bool cancel(const RequestPtr& r, std::exception_ptr error) override {
    if (r->peer() < 0 || r->peer() >= size_) return false;
    std::lock_guard<std::mutex> lk(mu_);  // the progress thread reads and delivers under it
    Peer& p = peers_[r->peer()];
    bool removed = false;
    if (r->kind() == Request::Kind::send) {
      std::lock_guard<std::mutex> sl(p.send_mu);
      removed = !r->done() && cancel_unstarted_send(p.sendq, r.get());
      p.want_out = !p.sendq.empty() && !p.send_error;
      update_interest(p);
    } else {
      removed = !r->done() && !(p.target == Target::posted && p.cur.req == r) && p.q.cancel(r.get());
    }
    if (removed) r->fail(std::move(error));
    return removed;
  }

 private:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || !serve_[peer])
      throw InvalidArgument(fmt::format("tcp: peer rank {} is not another rank of [0, {}) served by tcp", peer, size_));
  }

  RequestPtr post_recv(int peer, uint64_t tag, PostedRecv r) {
    check_peer(peer);
    RequestPtr req = r.req;
    req->set_notes(notes_);
    std::lock_guard<std::mutex> lk(mu_);
    Peer& p = peers_[peer];
    if (!p.q.take_unexpected(tag, r, "tcp")) {
      if (p.failed) {
        req->fail(p.error);
        return req;
      }
      p.q.post(tag, std::move(r));
    }
    if (p.have_hdr && p.target == Target::none) wake();  // a stalled connection may go on now
    return req;
  }

  void wake() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(evfd_, &one, 8);
  }

  // Under mu_: the read side's part of the epoll interest.
  void refresh_read_interest(Peer& p) {
    p.stalled = p.have_hdr && p.target == Target::none;
    update_interest(p);
  }

  void update_interest(Peer& p) {
    std::lock_guard<std::mutex> lk(p.interest_mu);
    if (p.fd < 0 || p.failed) return;
    uint32_t want = 0;
    // A held connection is not read, but its peer's close or reset must still be seen (an abort frame behind the
    // held one, or the peer's death, were noticed only at the deadline).
    want |= p.stalled ? (p.peer_closed ? 0u : uint32_t{EPOLLRDHUP}) : uint32_t{EPOLLIN};
    if (p.want_out) want |= EPOLLOUT;
    if (want == p.interest) return;
    p.interest = want;
    epoll_event ev{};
    ev.events = want;
    ev.data.u32 = static_cast<uint32_t>(p.rank);
    epoll_ctl(ep_, EPOLL_CTL_MOD, p.fd, &ev);
  }

  // Under mu_. `keep_arrived`: the connection ended without an abort, so messages that arrived whole stay
  // receivable (a peer may send its last message and exit before this rank posts the receive).
  void fail_peer(Peer& p, std::exception_ptr err, bool keep_arrived = false) {
    if (!p.failed) {
      p.error = err;
      p.failed = true;
      std::lock_guard<std::mutex> il(p.interest_mu);
      if (p.fd >= 0) epoll_ctl(ep_, EPOLL_CTL_DEL, p.fd, nullptr);
    }
    {
      std::lock_guard<std::mutex> sl(p.send_mu);
      if (!p.sendq.empty() && p.sendq.front().sent > 0) p.dropped_mid_frame = true;
      for (auto& s : p.sendq) s.req->fail(err);
      p.sendq.clear();
      p.want_out = false;
    }
    if (p.target == Target::posted) p.cur.req->fail(err);
    p.q.fail_all(err, keep_arrived);
    if (p.noted) notes_->clear(p.rank);  // (its requests fail with err: the stall no longer explains anything)
    p.noted = false;
    p.target = Target::none;
    p.have_hdr = false;
    p.cur_unexp.reset();
  }

  void fail_peer_protocol(Peer& p, const std::string& what) {
    CONDUIT_LOG_ERROR("tcp: rank {}: protocol error on the connection from rank {}: {}", rank_, p.rank, what);
    auto err = std::make_exception_ptr(
        ProtocolError(fmt::format("tcp: protocol error on the connection from rank {}: {}", p.rank, what)));
    ::shutdown(p.fd, SHUT_RDWR);
    fail_peer(p, err);
  }

  // Under p.send_mu: writes as much of the send queue as the socket takes now.
  void handle_write(Peer& p) {
    while (!p.sendq.empty() && !p.failed && !p.send_error) {
      TcpSend& s = p.sendq.front();
      size_t total = sizeof(FrameHeader) + s.bytes;
      iovec iov[2];
      int n = 0;
      if (s.sent < sizeof(FrameHeader)) {
        iov[n++] = {reinterpret_cast<char*>(&s.hdr) + s.sent, sizeof(FrameHeader) - s.sent};
        if (s.bytes) iov[n++] = {const_cast<char*>(s.data), s.bytes};
      } else {
        size_t off = s.sent - sizeof(FrameHeader);
        iov[n++] = {const_cast<char*>(s.data) + off, s.bytes - off};
      }
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = n;
      ssize_t w = ::sendmsg(p.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EAGAIN || errno == EINTR) return;
        // The sends fail with the receives, when the progress thread (woken) has read what the peer sent before its
        // end: a peer that aborted wrote its reason first, and a send failed here at once said only "broken pipe"
        // (the caller met that before the progress thread read the abort frame). A send that fails part-way leaves
        // the stream mid-frame, so the connection ends whatever the cause; only a reset or a broken pipe means the
        // peer went (a bad buffer was blamed on it).
        const int e = errno;
        const bool gone = e == EPIPE || e == ECONNRESET || e == ETIMEDOUT || e == ENOTCONN || e == EHOSTUNREACH;
        p.send_error = std::make_exception_ptr(PeerError(fmt::format(
            "tcp: sending to rank {} failed: {} ({})", p.rank, std::strerror(e),
            gone ? "the peer died or closed its connection" : "this rank's send failed; the connection ends")));
        p.send_failed = true;
        // Ended here, so that the peer sees it (not half a frame it would wait on until its deadline) and this
        // rank's reads end too: EFAULT or ENOBUFS left the socket open.
        ::shutdown(p.fd, SHUT_RDWR);
        wake();
        return;
      }
      s.sent += static_cast<size_t>(w);
      if (s.sent < total) return;
      RequestPtr done = s.req;
      p.sendq.pop_front();
      done->complete();
    }
  }

  // Decides where the payload of a complete header goes. Returns false when the connection must stall.
  bool choose_target(Peer& p) {
    const FrameHeader& h = p.hdr;
    p.pay_got = 0;
    if (h.type == kFrameAbort) {
      p.target = Target::abort;
      p.abort_buf.assign(h.length, '\0');
      return true;
    }
    if (h.type == kFrameHello) {
      fail_peer_protocol(p, "unexpected hello frame after the handshake");
      return true;
    }
    if (p.q.pop_posted(h.tag, &p.cur)) {
      if (p.cur.bytes != h.length) {
        // That receive fails and the message is read past, as when it arrived before the receive (matching.cc's
        // deliver) and on the other transports: the connection stays usable.
        fail_wrong_size(p.cur, h.length, "tcp");
        p.target = Target::discard;
        if (p.staging.empty()) p.staging.resize(kStagingBytes);
        return true;
      }
      p.target = Target::posted;
      p.staged = 0;
      p.reduced_elems = 0;
      if (p.cur.reduce && p.staging.empty()) p.staging.resize(kStagingBytes);
      return true;
    }
    // Over the budget, the connection stalls until a receive is posted or buffered messages are consumed. While
    // receives of other tags wait on this peer, their messages may be behind this one (transport.h orders messages
    // per tag only) and stalling would deadlock a valid program, so it is buffered past the budget, up to 4x (a
    // bound on memory: beyond it the connection stalls again and such a program meets its deadline).
    if (!p.q.can_buffer(h.length, unexpected_budget_) &&
        !(p.q.has_posted() && p.q.can_buffer(h.length, 4 * unexpected_budget_))) {
      if (p.peer_closed) {
        // Nothing more comes from a closed peer, so what it sent is in the socket already: buffered past the
        // budget (the kernel's buffer bounds it) when the whole frame is there, so the messages and any abort frame
        // behind it are read; a frame cut short fails now.
        int avail = 0;
        if (::ioctl(p.fd, FIONREAD, &avail) != 0 || avail < 0 || static_cast<uint64_t>(avail) < h.length) {
          fail_peer_protocol(p, fmt::format("truncated frame: the connection closed with {} of a {}-byte payload sent",
                                            std::max(avail, 0), h.length));
          return true;
        }
      } else {
        p.target = Target::none;
        note_stall(p);
        return false;
      }
    }
    p.cur_unexp = p.q.add_unexpected(h.tag, h.length);
    p.target = Target::unexpected;
    return true;
  }

  // Under mu_: the connection from p stalls on its header (choose_target). A wait on p that reaches its deadline says
  // why (the frame is in the socket, behind nothing this rank reads), and the first stall of p is logged.
  void note_stall(Peer& p) {
    const bool widened = p.q.has_posted();
    std::string note = stall_note("tcp", p.rank, p.hdr.tag, p.hdr.length, p.q.unexpected_bytes(), unexpected_budget_,
                                  widened, "CONDUIT_TCP_UNEXPECTED_BYTES");
    if (!p.warned) {
      p.warned = true;
      CONDUIT_LOG_WARN("rank {}: {}", rank_, note);
    }
    notes_->set(p.rank, std::move(note));
    p.noted = true;
  }

  void finish_payload(Peer& p) {
    switch (p.target) {
      case Target::posted: {
        if (p.cur.reduce) flush_staging(p, true);
        RequestPtr r = p.cur.req;
        p.cur = PostedRecv{};
        r->complete();
        break;
      }
      case Target::unexpected: {
        auto u = p.cur_unexp;
        p.cur_unexp.reset();
        p.q.complete_unexpected(*u, "tcp");
        break;
      }
      case Target::abort: {
        std::string why = fmt::format("rank {} aborted: {}", p.rank, printable_reason(p.abort_buf));
        set_aborted(why);
        auto err = std::make_exception_ptr(PeerError(why));
        p.target = Target::none;
        p.have_hdr = false;
        for (auto& q : peers_) fail_peer(q, err);
        return;
      }
      case Target::discard:
      case Target::none:
        break;
    }
    p.target = Target::none;
    p.have_hdr = false;
    p.hdr_got = 0;
  }

  void flush_staging(Peer& p, bool final) {
    size_t esz = dtype_size(p.cur.dtype);
    size_t whole = p.staged / esz;
    if (whole > 0) {
      reduce_into(p.cur.dst + p.reduced_elems * esz, p.staging.data(), whole, p.cur.dtype, p.cur.op);
      p.reduced_elems += whole;
      size_t rest = p.staged - whole * esz;
      if (rest) std::memmove(p.staging.data(), p.staging.data() + whole * esz, rest);
      p.staged = rest;
    }
    (void) final;
  }

  void handle_read(Peer& p) {
    for (int rounds = 0; rounds < 64 && !p.failed; ++rounds) {
      if (!p.have_hdr) {
        ssize_t r =
            ::recv(p.fd, reinterpret_cast<char*>(&p.hdr) + p.hdr_got, sizeof(FrameHeader) - p.hdr_got, MSG_DONTWAIT);
        if (!check_read(p, r)) return;
        p.hdr_got += static_cast<size_t>(r);
        if (p.hdr_got < sizeof(FrameHeader)) continue;
        std::string bad = validate_frame(p.hdr, p.rank, max_len_);
        if (!bad.empty()) return fail_peer_protocol(p, bad);
        p.have_hdr = true;
        p.target = Target::none;
      }
      if (p.target == Target::none) {
        if (!choose_target(p)) return refresh_read_interest(p);
        if (p.noted) {  // (the held frame goes on)
          notes_->clear(p.rank);
          p.noted = false;
        }
        if (p.failed) return;
        if (p.hdr.length == 0) {
          finish_payload(p);
          continue;
        }
      }
      char* dst = nullptr;
      size_t want = p.hdr.length - p.pay_got;
      if (p.target == Target::posted && p.cur.reduce) {
        want = std::min(want, p.staging.size() - p.staged);
        dst = p.staging.data() + p.staged;
      } else if (p.target == Target::discard) {
        want = std::min(want, p.staging.size());
        dst = p.staging.data();
      } else if (p.target == Target::posted) {
        dst = p.cur.dst + p.pay_got;
      } else if (p.target == Target::unexpected) {
        dst = p.cur_unexp->data.data() + p.pay_got;
      } else {
        dst = p.abort_buf.data() + p.pay_got;
      }
      ssize_t r = ::recv(p.fd, dst, want, MSG_DONTWAIT);
      if (!check_read(p, r)) return;
      p.pay_got += static_cast<size_t>(r);
      if (p.target == Target::posted && p.cur.reduce) {
        p.staged += static_cast<size_t>(r);
        if (p.staged == p.staging.size() || p.pay_got == p.hdr.length) flush_staging(p, p.pay_got == p.hdr.length);
      }
      if (p.pay_got == p.hdr.length) finish_payload(p);
    }
  }

  // False when nothing more can be read now (EAGAIN) or the connection failed.
  bool check_read(Peer& p, ssize_t r) {
    if (r > 0) return true;
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    std::string what = r == 0 ? "closed its connection (it exited or crashed)"
                              : fmt::format("connection error: {}", std::strerror(errno));
    std::string why = aborted_reason();
    auto err = std::make_exception_ptr(PeerError(!why.empty() ? why : fmt::format("tcp: rank {} {}", p.rank, what)));
    if (why.empty() && p.send_failed) {
      // This rank's failed write told more ("broken pipe": the peer died or closed), also where the stream ended
      // inside a frame (a peer killed while sending: its "truncated frame" blamed the protocol).
      fail_peer(p, p.send_error, /*keep_arrived=*/true);
      return false;
    }
    if (p.have_hdr && r == 0) {
      fail_peer_protocol(p, fmt::format("truncated frame: the connection closed {} bytes into a {}-byte payload",
                                        p.pay_got, p.hdr.length));
      return false;
    }
    if (!p.have_hdr && p.hdr_got > 0 && r == 0) {  // (it read as a clean close)
      fail_peer_protocol(p, fmt::format("truncated frame: the connection closed {} bytes into a {}-byte header",
                                        p.hdr_got, sizeof(FrameHeader)));
      return false;
    }
    fail_peer(p, err, /*keep_arrived=*/why.empty());
    return false;
  }

  // Under mu_: handle_read on the progress thread, where an exception (std::bad_alloc buffering a message) would
  // end the process (std::terminate): it fails that peer's requests with the reason instead.
  void read_guarded(Peer& p) {
    try {
      handle_read(p);
    } catch (const std::exception& e) {
      CONDUIT_LOG_ERROR("tcp: rank {}: reading from rank {} failed: {}", rank_, p.rank, e.what());
      ::shutdown(p.fd, SHUT_RDWR);
      fail_peer(
          p, std::make_exception_ptr(PeerError(fmt::format("tcp: reading from rank {} failed: {}", p.rank, e.what()))));
    }
  }

  void loop() {
    epoll_event evs[64];
    while (running_) {
      int n = epoll_wait(ep_, evs, 64, 200);
      for (int i = 0; i < n; ++i) {
        uint32_t id = evs[i].data.u32;
        if (id == 0xffffffffu) {
          uint64_t v;
          while (::read(evfd_, &v, 8) > 0) {
          }
          std::lock_guard<std::mutex> lk(mu_);
          for (auto& p : peers_) {
            if (p.fd < 0 || p.failed) continue;
            if (p.have_hdr && p.target == Target::none) read_guarded(p);
            if (p.send_failed && !p.failed) {  // a write failed: let the read side see the end
              p.peer_closed = true;
              read_guarded(p);
            }
            refresh_read_interest(p);
          }
          continue;
        }
        Peer& p = peers_[id];
        if (p.failed) continue;
        if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP | EPOLLRDHUP)) {
          std::lock_guard<std::mutex> lk(mu_);
          if (evs[i].events & (EPOLLERR | EPOLLHUP | EPOLLRDHUP)) p.peer_closed = true;
          if (!p.failed) read_guarded(p);
          refresh_read_interest(p);
        }
        if (evs[i].events & EPOLLOUT) {
          std::lock_guard<std::mutex> sl(p.send_mu);
          handle_write(p);
          p.want_out = !p.sendq.empty() && !p.send_error;
          update_interest(p);
        }
      }
      if (n > 0)
        if (Progressor* t = activity_target_.load(std::memory_order_acquire)) t->notify();
    }
  }

  void connect_all(const AllgatherFn& allgather, const Deadline& deadline) {
    std::string why;
    std::string addr = tcp_listen_address(&why);
    CONDUIT_LOG_INFO("tcp: rank {} listens on {}", rank_, why);
    int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (lfd < 0)  // (out of descriptors read as bind's "Bad file descriptor")
      throw Error(fmt::format("tcp: cannot open a socket to listen on {}: {}", addr, std::strerror(errno)));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = 0;
    inet_pton(AF_INET, addr.c_str(), &sa.sin_addr);
    if (::bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(lfd, 1024) != 0) {
      int e = errno;
      ::close(lfd);
      throw Error(fmt::format("tcp: cannot listen on {}: {}", addr, std::strerror(e)));
    }
    socklen_t sl = sizeof sa;
    getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &sl);
    std::string mine = fmt::format("{}:{}", addr, ntohs(sa.sin_port));
    std::vector<std::string> all;
    try {
      all = allgather(mine);
    } catch (...) {
      ::close(lfd);
      throw;
    }
    job_ = tcp_job_fingerprint(all);
    try {
      // Higher ranks connect to lower ones and introduce themselves with a hello frame.
      for (int j = 0; j < rank_; ++j)
        if (serve_[j]) peers_[j].fd = connect_to(all[j], j, deadline);
      int expected = 0;
      for (int k = rank_ + 1; k < size_; ++k) expected += serve_[k] ? 1 : 0;
      std::string last_bad;  // what became of the last connection refused or dropped, and where it came from
      // Each lower rank answers this rank's hello with its own, or with the reason it refused the connection: the
      // answers are read as they come while this rank accepts its own peers, so a refusal ends the rendezvous at
      // once and waiting for them adds no step to it.
      std::vector<int> unanswered;
      for (int j = 0; j < rank_; ++j)
        if (serve_[j]) unanswered.push_back(j);
      // Accepted connections are read as their bytes come, side by side with each other and with the answers: a
      // connection that says nothing (a port scan, a stale process) is dropped after kHelloSeconds and costs the real
      // peers no time (read one at a time, every silent connection held the rendezvous up for kHelloSeconds). At
      // most kMaxPendingHellos wait at once; later ones wait in the listen backlog.
      struct Pending {
        int fd = -1;
        Deadline until;  // its own kHelloSeconds (not the rendezvous' deadline: a timeout would blame it)
        std::string peer;
        FrameHeader h{};
        size_t got = 0;
      };
      struct PendingSet {  // (closed however the rendezvous ends)
        std::vector<Pending> v;
        ~PendingSet() {
          for (const Pending& p : v)
            if (p.fd >= 0) ::close(p.fd);
        }
      } pending;
      pending.v.reserve(kMaxPendingHellos);  // (no allocation between an accept and its entry)
      auto drop = [&](Pending& p, const std::string& why) {
        CONDUIT_LOG_WARN("tcp: rank {} dropped a connection from {} during handshake: {}", rank_, p.peer, why);
        last_bad = fmt::format("dropped: {} (from {})", why, p.peer);
        ::close(p.fd);
        p.fd = -1;
      };
      int accepted = 0;
      // A whole hello: the peer's connection from now on, or refused with the reason.
      auto take_hello = [&](Pending& p) {
        const FrameHeader& h = p.h;
        std::string bad = validate_frame(h, -1, 0);
        if (bad.empty() && h.type != kFrameHello) bad = "first frame is not a hello";
        if (bad.empty()) bad = hello_job_mismatch(h);
        if (bad.empty() && h.src >= static_cast<uint32_t>(size_))
          bad = fmt::format("hello from rank {}, outside this job of {} ranks", h.src, size_);
        else if (bad.empty() && h.src <= static_cast<uint32_t>(rank_))
          bad = fmt::format("hello from rank {}, which this rank connects to itself (higher ranks connect to lower)",
                            h.src);
        else if (bad.empty() && !serve_[h.src])
          bad = fmt::format("hello from rank {}, which this rank does not talk to directly", h.src);
        else if (bad.empty() && peers_[h.src].fd >= 0)
          bad = fmt::format("a second hello from rank {} (two processes with the same rank?)", h.src);
        if (!bad.empty()) {
          CONDUIT_LOG_WARN("tcp: rank {} rejected a connection from {}: {}", rank_, p.peer, bad);
          last_bad = fmt::format("refused: {} (from {})", bad, p.peer);
          // A connection that speaks this protocol is told why (an abort frame with the reason) before it is
          // closed, so the rank behind it reports the reason rather than a plain close.
          if (h.magic == kFrameMagic) {  // (another version too: it reads ours and names both)
            const std::string why = bad.substr(0, kMaxAbortReason);
            FrameHeader r = make_frame(kFrameAbort, 0, why.size(), rank_);
            try {
              write_all_blocking(p.fd, &r, sizeof r, Deadline::after(1));
              write_all_blocking(p.fd, why.data(), why.size(), Deadline::after(1));
            } catch (const Error&) {
            }
          }
          ::close(p.fd);
          p.fd = -1;
          return;
        }
        try {
          // The hello is answered with this rank's own.
          FrameHeader ack = make_frame(kFrameHello, job_, static_cast<uint64_t>(size_), rank_);
          write_all_blocking(p.fd, &ack, sizeof ack, deadline.min(Deadline::after(kHelloSeconds)));
        } catch (const Error& e) {
          drop(p, e.what());
          return;
        }
        peers_[h.src].fd = p.fd;
        p.fd = -1;
        ++accepted;
      };
      std::vector<pollfd> fds;
      Deadline accept_pause = Deadline::after(0);
      while (accepted < expected || !unanswered.empty()) {
        const double rem = deadline.remaining_seconds();
        if (rem <= 0) {
          if (accepted < expected)
            throw TimeoutError(fmt::format("tcp: rank {} timed out waiting for {} more peers to connect{}", rank_,
                                           expected - accepted,
                                           last_bad.empty() ? "" : "; the last connection " + last_bad));
          throw TimeoutError(
              fmt::format("tcp: rank {} timed out waiting for rank {} to answer its hello", rank_, unanswered.front()));
        }
        double wait = rem;
        for (const Pending& p : pending.v) wait = std::min(wait, p.until.remaining_seconds());
        // (a shortage of buffers leaves the connection queued and the socket readable: polled again after a pause,
        // not at once, which spun a core until the deadline)
        const bool paused = !accept_pause.expired();
        if (paused) wait = std::min(wait, accept_pause.remaining_seconds());
        const bool listen = accepted < expected && pending.v.size() < kMaxPendingHellos && !paused;
        fds.clear();
        if (listen) fds.push_back({lfd, POLLIN, 0});
        const size_t first_pending = fds.size();
        for (const Pending& p : pending.v) fds.push_back({p.fd, POLLIN, 0});
        const size_t first_answer = fds.size();
        for (int j : unanswered) fds.push_back({peers_[j].fd, POLLIN, 0});
        const int r =
            ::poll(fds.data(), fds.size(), wait > 1e6 ? 1000 : static_cast<int>(std::max(0.0, wait) * 1000) + 1);
        if (r < 0 && errno != EINTR) throw Error(fmt::format("tcp: poll failed: {}", std::strerror(errno)));
        for (size_t i = 0; i < pending.v.size(); ++i) {
          Pending& p = pending.v[i];
          if (r > 0 && fds[first_pending + i].revents != 0) {
            const ssize_t n = ::recv(p.fd, reinterpret_cast<char*>(&p.h) + p.got, sizeof p.h - p.got, 0);
            if (n > 0) {
              p.got += static_cast<size_t>(n);
              if (p.got == sizeof p.h) take_hello(p);
            } else if (n == 0) {
              drop(p, "connection closed during handshake");
            } else if (errno != EAGAIN && errno != EINTR) {
              drop(p, fmt::format("handshake read failed: {}", std::strerror(errno)));
            }
          }
          if (p.fd >= 0 && p.until.expired()) drop(p, fmt::format("no hello within {} s", kHelloSeconds));
        }
        std::erase_if(pending.v, [](const Pending& p) { return p.fd < 0; });
        if (r > 0) {
          std::vector<int> still;
          for (size_t i = first_answer; i < fds.size(); ++i) {
            const int j = unanswered[i - first_answer];
            if (fds[i].revents != 0)  // (begun: the rest of a 32-byte answer within the hello's own bound, not the
                                      // rendezvous' whole deadline, which a stalled half-answer held this loop for)
              read_hello_answer(j, deadline.min(Deadline::after(kHelloSeconds)));
            else
              still.push_back(j);
          }
          unanswered.swap(still);
        }
        if (r > 0 && listen && fds[0].revents != 0) {
          while (pending.v.size() < kMaxPendingHellos) {
            sockaddr_in from{};
            socklen_t from_len = sizeof from;
            const int fd = ::accept4(lfd, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
            if (fd >= 0) {
              char ip[INET_ADDRSTRLEN] = "?";
              inet_ntop(AF_INET, &from.sin_addr, ip, sizeof ip);
              try {
                pending.v.push_back(
                    {fd, Deadline::after(kHelloSeconds), fmt::format("{}:{}", ip, ntohs(from.sin_port))});
              } catch (...) {
                ::close(fd);
                throw;
              }
              continue;
            }
            const int e = errno;
            // Errors of this socket or process stop the rendezvous; the network errors a pending connection hands
            // on (EPROTO, ENETDOWN, EHOSTUNREACH, ...) and a passing shortage of buffers are retried at the next
            // poll, as accept(2) says.
            if (e == EMFILE || e == ENFILE || e == EBADF || e == EINVAL || e == ENOTSOCK || e == EFAULT)
              throw Error(
                  fmt::format("tcp: rank {} cannot accept its peers' connections: {}{}", rank_, std::strerror(e),
                              e == EMFILE || e == ENFILE ? " (allowed: more file descriptors, ulimit -n)" : ""));
            if (e == ENOBUFS || e == ENOMEM) accept_pause = Deadline::after(0.1);
            break;
          }
        }
      }
    } catch (...) {
      ::close(lfd);
      // The destructor does not run for a constructor that throws: close the peers connected so far.
      for (auto& p : peers_)
        if (p.fd >= 0) {
          ::close(p.fd);
          p.fd = -1;
        }
      throw;
    }
    ::close(lfd);
    for (auto& p : peers_) {
      if (p.fd < 0) continue;
      int one = 1;
      setsockopt(p.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      set_nonblocking(p.fd);
    }
  }

  // Empty when a hello (or its answer) comes from a rank of this job, else why not.
  std::string hello_job_mismatch(const FrameHeader& h) const {
    if (h.length != static_cast<uint64_t>(size_))
      return fmt::format(
          "hello from rank {} of a job of {} ranks, not this job's {} (another job, or a rank of an "
          "earlier run, reached this port)",
          h.src, h.length, size_);
    if (h.tag != job_)
      return fmt::format(
          "hello from rank {} of another job: its ranks published other addresses than this job's (a "
          "rank of another or an earlier run reached this port; is the store shared with another job?)",
          h.src);
    return {};
  }

  void read_hello_answer(int peer, const Deadline& deadline) {
    const int fd = peers_[peer].fd;
    FrameHeader h{};
    try {
      read_all_blocking(fd, &h, sizeof h, deadline);
    } catch (const TimeoutError&) {
      throw TimeoutError(fmt::format("tcp: rank {} timed out waiting for rank {} to answer its hello", rank_, peer));
    } catch (const Error& e) {
      throw PeerError(
          fmt::format("tcp: rank {} lost its connection to rank {} during the handshake: {}", rank_, peer, e.what()));
    }
    std::string bad = validate_frame(h, peer, 0);
    if (bad.empty() && h.type == kFrameAbort) {
      std::string why(h.length, '\0');
      try {
        read_all_blocking(fd, why.data(), why.size(), deadline.min(Deadline::after(kHelloSeconds)));
      } catch (const Error&) {
        why = "(reason cut off)";
      }
      throw ProtocolError(
          fmt::format("tcp: rank {} refused the connection of rank {}: {} (is another process "
                      "using the same rank, or the same store?)",
                      peer, rank_, printable_reason(why)));
    }
    if (bad.empty() && h.type != kFrameHello) bad = "the answer to its hello is not a hello";
    if (bad.empty()) bad = hello_job_mismatch(h);
    if (!bad.empty())
      throw ProtocolError(fmt::format("tcp: rank {} got a bad handshake from rank {}: {}", rank_, peer, bad));
  }

  int connect_to(const std::string& hostport, int peer, const Deadline& deadline) {
    // The address a peer published in the store: IPv4:port, port 1..65535.
    const auto colon = hostport.rfind(':');
    int port = 0;
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    const char* end = hostport.data() + hostport.size();
    const bool ok = colon != std::string::npos && [&] {
      auto [ptr, ec] = std::from_chars(hostport.data() + colon + 1, end, port);
      return ec == std::errc() && ptr == end && port >= 1 && port <= 65535;
    }() && inet_pton(AF_INET, hostport.substr(0, colon).c_str(), &sa.sin_addr) == 1;
    if (!ok)
      throw ProtocolError(
          fmt::format("tcp: rank {} published the address '{}' (expected IPv4:port with port "
                      "1..65535; is the store shared with another job?)",
                      peer, hostport));
    sa.sin_port = htons(static_cast<uint16_t>(port));
    double backoff = 0.001;
    while (true) {
      // Non-blocking, so the deadline also bounds a connect that the peer's host never answers (a blocking one
      // waits for the kernel's SYN retries, about two minutes).
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) throw Error(fmt::format("tcp: cannot create a socket: {}", std::strerror(errno)));
      int e = ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 ? 0 : errno;
      if (e == EINPROGRESS) {
        if (poll_fd(fd, POLLOUT, deadline)) {
          socklen_t len = sizeof e;
          if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0) e = errno;
        } else {
          e = ETIMEDOUT;
        }
      }
      if (e == 0) {
        try {
          FrameHeader h = make_frame(kFrameHello, job_, static_cast<uint64_t>(size_), rank_);
          write_all_blocking(fd, &h, sizeof h, deadline);
        } catch (const Error& e) {
          ::close(fd);
          // (it said only "handshake write timed out")
          rethrow_with_context(e,
                               fmt::format("tcp: rank {} sending its hello to rank {} at {}", rank_, peer, hostport));
        } catch (...) {
          ::close(fd);
          throw;
        }
        return fd;
      }
      ::close(fd);
      if (deadline.expired()) {
        // A loopback address from a rank on another host is this host's own loopback here: say so.
        const bool foreign_loopback = hostport.rfind("127.", 0) == 0 && !hosts_.empty() &&
                                      hosts_[static_cast<size_t>(peer)] != hosts_[static_cast<size_t>(rank_)];
        throw TimeoutError(fmt::format("tcp: rank {} could not connect to rank {} at {}: {}{}", rank_, peer, hostport,
                                       std::strerror(e),
                                       foreign_loopback ? " (rank " + std::to_string(peer) +
                                                              " is on another host but listens on loopback: it found "
                                                              "no other interface up; set CONDUIT_SOCKET_IFNAME there)"
                                                        : ""));
      }
      std::this_thread::sleep_for(
          std::chrono::duration<double>(std::min(backoff, std::max(0.0, deadline.remaining_seconds()))));
      backoff = std::min(backoff * 2, 0.2);
    }
  }

  std::vector<Peer> peers_;
  std::vector<char> serve_;
  std::mutex mu_;
  int ep_ = -1, evfd_ = -1;
  std::thread thread_;
  std::atomic<bool> running_{true};
  uint64_t unexpected_budget_;
  uint64_t max_len_;
  uint64_t job_ = 0;  // tcp_job_fingerprint of the rendezvous' addresses: what every hello names
};

}  // namespace

uint64_t tcp_unexpected_budget() { return unexpected_budget("CONDUIT_TCP_UNEXPECTED_BYTES"); }

TransportPtr make_tcp_transport(int rank, int size, std::vector<int> hosts, const AllgatherFn& allgather,
                                const Deadline& connect_deadline, std::vector<char> serve) {
  return std::make_shared<TcpTransport>(rank, size, std::move(hosts), std::move(serve), allgather, connect_deadline);
}

}  // namespace conduit::net
