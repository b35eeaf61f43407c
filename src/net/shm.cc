#include "net/shm.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <mutex>

#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "core/reduce.h"
#include "net/bootstrap.h"
#include "net/matching.h"
#include "net/wire.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace conduit::net {
namespace {

// SegHeader::aborted: 0, kAbortClaimed while a rank writes its reason, then that rank + 1.
constexpr int32_t kAbortClaimed = -1;

// The segment layout's version, checked in every peer's segment: builds of another layout misread each other's
// segments, and one of the same size passed the size check. 2: the fast slots' data aligned to 64 bytes (it was at
// offset 14, and every reduction of 4- and 8-byte elements took the misaligned path).
constexpr uint32_t kShmLayout = 2;

struct alignas(64) SegHeader {
  std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> aborted;
  int32_t pid;
  uint32_t layout;  // kShmLayout
  char reason[kMaxAbortReason + 1];
};

constexpr size_t kReadSlots = 64;  // single-copy messages a producer may have unread (RingHeader::read_done)

struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // bytes ever written (producer)
  alignas(64) std::atomic<uint64_t> tail;  // bytes ever consumed (consumer)
  // Set by a producer that found the ring full; the consumer rings the producer's doorbell only then, so an
  // ordinary message costs no cache-line transfer back to the sender.
  alignas(64) std::atomic<uint32_t> want_space;
  // Single copy: the consumer stores message seq in slot seq % kReadSlots once it has read that message out of the
  // producer's memory. Messages are numbered 1, 2, ... in ring order but may be read out of order (one that found
  // no receive waits for one, a later one may have its receive), so the producer keeps at most kReadSlots unread.
  alignas(64) std::atomic<uint64_t> read_done[kReadSlots];
};

// What follows a kFrameShmRead header in the ring: where the payload lies in the sender's address space and the
// message's sequence number among the single-copy messages of that ring.
struct ShmReadDesc {
  uint64_t addr;
  uint64_t seq;
};

// Read by peers with process_vm_readv at start-up: whether this process's memory can be read from theirs.
volatile uint64_t g_read_probe = 0;

int futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return static_cast<int>(syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0));
}

// A store-then-load handshake with the sleeper's (sleepers += 1, then read the doorbell): only sequentially
// consistent operations keep both loads from reading the old values (a lost wake-up, up to the 50 ms sleep).
void ring_doorbell(SegHeader* h) {
  h->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futex(&h->doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// One rank's slot of the small-allreduce fast path (two per segment, used alternately): the payload, then the
// sequence number of the operation it belongs to, published last (release), so a reader that sees the number
// reads a complete payload. A rank writes slot s % 2 for operation s only after it has read every peer's payload of
// operation s - 1, and each peer published s - 1 only after finishing s - 2: nobody still reads the slot it reuses.
constexpr uint64_t kMaxRingBytes = uint64_t{1} << 30;  // CONDUIT_SHM_RING_BYTES at most
constexpr uint64_t kDefaultSingleCopyBytes = 256 << 10;  // CONDUIT_SHM_SINGLE_COPY_BYTES
uint64_t shm_ring_bytes();
uint64_t shm_single_copy_bytes();
uint64_t shm_unexpected_budget();
constexpr size_t kReadChunk = 128 << 10;  // a reducing single-copy receive reads and reduces this much at a time
// A single-copy message that found no receive is read into a buffer after this long without one: the sender's send
// completes only once it is read, and a program may wait for that before posting the receive.
constexpr auto kReadUnmatchedAfter = std::chrono::milliseconds(1);

// Under Yama's ptrace_scope 1 only a process's ancestors may read its memory, and local ranks are siblings: let
// processes of this user read it, as Open MPI's single copy does (scope 2 and 3 stay closed; the probe then fails).
// Counted over the transports of this process: the last that needs it closes it again, and so does one that opened
// it and then found single copy off (it stayed open for the life of the process). Closing sets no tracer at all: a
// tracer the program had named itself (a crash handler's pid) was replaced by "any" already while it was open.
std::mutex g_ptracer_mu;
int g_ptracer_users = 0;
// True when this call counts as a user (release_reads_under_yama once done).
bool allow_reads_under_yama() {
#ifdef PR_SET_PTRACER
  FILE* f = std::fopen("/proc/sys/kernel/yama/ptrace_scope", "r");
  if (f == nullptr) return false;
  int scope = 0;
  const bool read = std::fscanf(f, "%d", &scope) == 1;
  std::fclose(f);
  if (!read || scope != 1) return false;
  std::lock_guard<std::mutex> lk(g_ptracer_mu);
  if (g_ptracer_users++ == 0) ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  return true;
#else
  return false;
#endif
}
void release_reads_under_yama() {
#ifdef PR_SET_PTRACER
  std::lock_guard<std::mutex> lk(g_ptracer_mu);
  if (--g_ptracer_users == 0) ::prctl(PR_SET_PTRACER, 0, 0, 0, 0);
#endif
}
// What a rank that could not set up its segment publishes in the start-up exchange, before its error.
constexpr std::string_view kFailedMark = "failed: ";
constexpr size_t kFastBytes = 8192;       // a slot's capacity
constexpr size_t kFastReadBytes = 16384;  // what one fast allreduce may read (every rank's slot), each rank on a core
struct alignas(64) FastSlot {
  std::atomic<uint64_t> seq;
  uint32_t bytes;  // what the contribution is, checked by every reader (a mismatch is an error, not garbage)
  uint8_t dtype, op;
  alignas(64) char data[kFastBytes];  // (reduced in place: misaligned, it took reduce_to's slow path, 2x at 4-8 KiB)
};
static_assert(offsetof(FastSlot, data) % 64 == 0 && sizeof(FastSlot) % 64 == 0);

struct ShmSend {
  RequestPtr req;
  FrameHeader hdr;
  const char* data = nullptr;
  size_t bytes = 0;
  size_t sent = 0;  // includes header
  bool single_copy = false;  // the ring carries hdr + desc; the receiver reads `data` itself
  ShmReadDesc desc{};
  size_t frame_bytes() const { return sizeof(FrameHeader) + (single_copy ? sizeof(ShmReadDesc) : bytes); }
  // Where byte `off` of the frame (header included) comes from.
  const char* frame_at(size_t off) const {
    if (off < sizeof(FrameHeader)) return reinterpret_cast<const char*>(&hdr) + off;
    off -= sizeof(FrameHeader);
    return single_copy ? reinterpret_cast<const char*>(&desc) + off : data + off;
  }
};

// discard: the payload of a message whose matched receive expected another size (that receive has failed).
// deferred: a single-copy message that found no receive, left in the sender's memory (ShmPeer::deferred).
enum class Target { none, posted, unexpected, abort, discard, deferred };

struct ShmPeer {
  int rank = -1;
  bool serve = false;
  bool failed = false;
  std::exception_ptr error;
  pid_t pid = 0;
  // A pidfd of the peer process (Linux 5.3+), -1 where unavailable: it refers to that process, so it reports its
  // exit even when the pid was reused or the exited peer is a zombie nobody reaped yet (kill(pid, 0) answers for
  // both as if it lived).
  int pidfd = -1;
  SegHeader* seg = nullptr;    // the peer's segment (we write into our ring there)
  RingHeader* out = nullptr;   // ring rank -> peer (in the peer's segment)
  char* out_data = nullptr;
  uint64_t out_tail_cache = 0;  // last tail of `out` read
  RingHeader* in = nullptr;    // ring peer -> rank (in our segment)
  char* in_data = nullptr;
  std::deque<ShmSend> sendq;
  FrameHeader hdr{};
  size_t hdr_got = 0;
  bool have_hdr = false;
  bool noted = false;   // the transport's note says why this peer is held (stall_note)
  bool warned = false;  // a stall of this peer was logged (once)
  Target target = Target::none;
  PostedRecv cur;
  std::shared_ptr<Unexpected> cur_unexp;
  std::string abort_buf;
  size_t pay_got = 0;
  size_t reduced_bytes = 0;
  std::vector<char> carry;  // a partial element split across the ring's wrap point
  MatchQueues q;
  // Single copy. Sending: messages announced so far, and those written whose reader has not finished (their
  // sequence numbers, ascending). Receiving: the current frame's descriptor, the messages seen so far, and those
  // that found no receive (unread, in ring order).
  uint64_t reads_announced = 0;
  std::deque<std::pair<uint64_t, RequestPtr>> being_read;
  ShmReadDesc desc{};
  size_t desc_got = 0;
  uint64_t reads_seen = 0;
  struct Deferred {
    std::shared_ptr<Unexpected> u;
    ShmReadDesc desc;
    uint64_t length;
    Clock::time_point since;
  };
  std::deque<Deferred> deferred;
  bool pending() const {
    return !sendq.empty() || !being_read.empty() || !deferred.empty() || q.has_posted() || target != Target::none ||
           have_hdr;
  }
};

class ShmTransport : public Transport, public Progressor {
 public:
  ShmTransport(int rank, int size, std::vector<int> hosts, const std::string& job, const AllgatherFn& allgather,
               std::vector<char> serve)
      : peers_(size) {
    rank_ = rank;
    size_ = size;
    hosts_ = std::move(hosts);
    if (serve.empty()) serve.assign(size, 1);
    ring_bytes_ = shm_ring_bytes();
    unexpected_budget_ = shm_unexpected_budget();
    max_len_ = max_message_bytes();
    int local = 0;
    for (int i = 0; i < size; ++i) local += (serve[i] || i == rank) ? 1 : 0;
    // The CPUs the launcher could spread the ranks over (conduit launch passes them; every rank gets the same
    // number), else the online ones capped by a container's CPU quota (not the affinity: pinned ranks see one).
    long cpus = quota_cpus();
    if (auto v = env_int("CONDUIT_LOCAL_CPUS", 1, 1 << 20)) cpus = *v;
    oversubscribed_ = local > cpus;
    long spin_us = oversubscribed_ ? 5 : 50;
    if (auto v = env_int("CONDUIT_SHM_SPIN_US", 0, 1000000)) spin_us = *v;
    spin_ = std::chrono::microseconds(spin_us);
    // Messages from this size on are read by the receiver straight out of the sender's memory (one copy, by the
    // kernel, instead of one into the ring and one out of it), where every local rank can read every other's.
    single_copy_bytes_ = shm_single_copy_bytes();
    seg_bytes_ = ring_offset(size_) + 2 * sizeof(FastSlot);  // the rings, then the two fast slots
    all_local_ = true;
    for (int i = 0; i < size; ++i) all_local_ = all_local_ && (i == rank || serve[i]);

    std::string my_name = segment_name(job, rank);
    maps_.assign(size, nullptr);
    // On a failure below, the segment's name and every mapping go (the destructor does not run).
    auto undo = [&] {
      ::shm_unlink(my_name.c_str());
      close_pidfds();
      for (char*& m : maps_)
        if (m != nullptr && m != MAP_FAILED) ::munmap(m, seg_bytes_);
      if (mine_ != nullptr && mine_ != MAP_FAILED) ::munmap(mine_, seg_bytes_);
      if (opened_reads_) release_reads_under_yama();
    };
    // A failure to set up this rank's segment is published in the exchange below instead of the process id, and
    // thrown once it is: the peers stop with it at once (they waited for this rank to their start-up deadline).
    std::exception_ptr failure;
    std::string failed;
    try {
      int fd = ::shm_open(my_name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 && errno == EEXIST)  // (not ours: left as it is)
        throw ConfigError(fmt::format(
            "shm: cannot create segment {}: it exists: another job is using CONDUIT_JOB_ID={}, or a run of it crashed "
            "and left it (and its other ranks' segments); allowed: another CONDUIT_JOB_ID, or once no job uses it, rm "
            "-f "
            "/dev/shm{}-{{0..{}}}",
            my_name, job, my_name.substr(0, my_name.rfind('-')), size - 1));
      if (fd < 0) throw Error(fmt::format("shm: cannot create segment {}: {}", my_name, std::strerror(errno)));
      if (::ftruncate(fd, static_cast<off_t>(seg_bytes_)) != 0) {
        int e = errno;
        ::close(fd);
        undo();
        throw Error(fmt::format("shm: cannot size segment {} to {} bytes: {}", my_name, seg_bytes_, std::strerror(e)));
      }
      // The pages this rank's peers will write (their rings here, every ring header, the fast slots) are reserved
      // now: a full /dev/shm fails here with what it takes, not with SIGBUS when a ring first wraps mid-run.
      if (int e = reserve(fd, serve); e != 0) {
        ::close(fd);
        undo();
        struct statvfs vfs {};
        const std::string free_bytes =
            ::statvfs("/dev/shm", &vfs) == 0 ? fmt::format("{} bytes", uint64_t{vfs.f_bavail} * vfs.f_frsize) : "?";
        throw ConfigError(
            fmt::format("shm: cannot reserve {} bytes of /dev/shm for segment {}: {} ({} free); allowed: lower "
                        "CONDUIT_SHM_RING_BYTES (now {}: each rank holds a ring per local peer) or enlarge /dev/shm",
                        reserved_bytes(serve), my_name, std::strerror(e), free_bytes, ring_bytes_));
      }
      mine_ = static_cast<char*>(::mmap(nullptr, seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
      ::close(fd);
      if (mine_ == MAP_FAILED) {
        const int e = errno;
        undo();
        throw Error(fmt::format("shm: cannot map segment {}: {}", my_name, std::strerror(e)));
      }
      auto* h = new (mine_) SegHeader();
      h->pid = ::getpid();
      h->layout = kShmLayout;
      for (int i = 0; i < size; ++i) new (ring_at(mine_, i)) RingHeader();
      for (int i = 0; i < 2; ++i) new (fast_slot(mine_, i)) FastSlot();
      my_seg_ = h;
    } catch (const Error& e) {
      failure = std::current_exception();
      failed = e.what();
    }

    // Each rank's process id, whether it shares CPUs with more ranks than there are (one oversubscribed rank
    // keeps every rank's fast allreduce at the small limit: ranks that disagree on it wait in different places)
    // and, when it wants single-copy messages, the address and value of a word its peers try to read.
    if (single_copy_bytes_ > 0 && !failure) {
      if (g_read_probe == 0) g_read_probe = (static_cast<uint64_t>(::getpid()) << 32) | 0x5c0du;
      opened_reads_ = allow_reads_under_yama();
    }
    std::vector<std::string> pids;
    try {
      pids = allgather(failure ? std::string(kFailedMark) + printable_reason(failed)
                               : fmt::format("{} {} {:x} {:x}", ::getpid(), oversubscribed_ ? 1 : 0,
                                             single_copy_bytes_ > 0 ? reinterpret_cast<uintptr_t>(&g_read_probe) : 0,
                                             static_cast<uint64_t>(g_read_probe)));  // every segment exists after this
    } catch (...) {
      if (failure) std::rethrow_exception(failure);  // (the cause: the exchange's own error follows from it)
      undo();
      throw;
    }
    if (failure) std::rethrow_exception(failure);
    for (int p = 0; p < size; ++p)
      if (pids[p].rfind(kFailedMark, 0) == 0) {
        undo();
        throw PeerError(fmt::format("shm: rank {} could not start: {}", p, pids[p].substr(kFailedMark.size())));
      }
    std::vector<std::pair<uint64_t, uint64_t>> probes(size, {0, 0});  // address, value
    for (int p = 0; p < size; ++p) {
      const std::vector<std::string> f = split(pids[p], ' ');
      if (f.size() > 1 && f[1] == "1") fast_small_ = true;
      if (f.size() > 3) {
        uint64_t a = 0, b = 0;
        auto ra = std::from_chars(f[2].data(), f[2].data() + f[2].size(), a, 16);
        auto rb = std::from_chars(f[3].data(), f[3].data() + f[3].size(), b, 16);
        if (ra.ec == std::errc() && rb.ec == std::errc()) probes[p] = {a, b};
      }
      pids[p] = f[0];
    }
    for (int p = 0; p < size; ++p) {
      ShmPeer& peer = peers_[p];
      peer.rank = p;
      peer.serve = serve[p] && p != rank;
      if (!peer.serve) continue;
      std::string name = segment_name(job, p);
      int pfd = ::shm_open(name.c_str(), O_RDWR, 0600);
      if (pfd < 0) {
        const int e = errno;
        undo();
        throw Error(fmt::format("shm: cannot open segment {} of rank {}: {}", name, p, std::strerror(e)));
      }
      // A segment of another size (another ring size, another build's layout) would be read at wrong offsets or
      // past its end (SIGBUS).
      struct stat sb {};
      if (::fstat(pfd, &sb) != 0 || static_cast<uint64_t>(sb.st_size) != seg_bytes_) {
        const long long got = static_cast<long long>(sb.st_size);
        ::close(pfd);
        undo();
        throw ProtocolError(fmt::format(
            "shm: segment {} of rank {} is {} bytes, this rank's are {} (the ranks' CONDUIT_SHM_RING_BYTES or builds "
            "differ)",
            name, p, got, seg_bytes_));
      }
      maps_[p] = static_cast<char*>(::mmap(nullptr, seg_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0));
      ::close(pfd);
      if (maps_[p] == MAP_FAILED) {
        const int e = errno;
        undo();
        throw Error(fmt::format("shm: cannot map segment {} of rank {}: {}", name, p, std::strerror(e)));
      }
      peer.seg = reinterpret_cast<SegHeader*>(maps_[p]);
      if (peer.seg->layout != kShmLayout) {
        const uint32_t got = peer.seg->layout;
        undo();
        throw ProtocolError(
            fmt::format("shm: segment {} of rank {} has layout version {}, this rank's is {} (the ranks' builds "
                        "differ; allowed: the same conduit build on every rank of a host)",
                        name, p, got, kShmLayout));
      }
      {
        long pid = 0;
        const std::string& v = pids[p];
        auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), pid);
        if (ec != std::errc() || ptr != v.data() + v.size() || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) {
          undo();
          throw ProtocolError(
              fmt::format("shm: rank {} published the process id '{}' (expected a positive integer; is "
                          "the store shared with another job?)",
                          p, v));
        }
        peer.pid = static_cast<pid_t>(pid);
        peer.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, peer.pid, 0));
      }
      peer.out = ring_at(maps_[p], rank);
      peer.out_data = reinterpret_cast<char*>(peer.out) + sizeof(RingHeader);
      peer.in = ring_at(mine_, p);
      peer.in_data = reinterpret_cast<char*>(peer.in) + sizeof(RingHeader);
    }
    // Single copy is used only when every rank of the host can read every other's memory (a sender does not know
    // which of its peers could), and each rank reports whether it could.
    std::string cannot;
    if (single_copy_bytes_ > 0) {
      for (int p = 0; p < size && cannot.empty(); ++p) {
        if (!peers_[p].serve) continue;
        if (probes[p].first == 0) {
          cannot = fmt::format("rank {} does not offer it (CONDUIT_SHM_SINGLE_COPY_BYTES=off there)", p);
          continue;
        }
        uint64_t got = 0;
        iovec local{&got, sizeof got};
        iovec remote{reinterpret_cast<void*>(probes[p].first), sizeof got};
        const ssize_t n = ::process_vm_readv(peers_[p].pid, &local, 1, &remote, 1, 0);
        if (n != static_cast<ssize_t>(sizeof got) || got != probes[p].second)
          cannot = fmt::format("cannot read rank {}'s memory: {}", p,
                               n < 0 ? std::strerror(errno) : "it read back another value");
      }
    }
    std::vector<std::string> mapped;
    try {
      // Every peer has mapped our segment after this: its name is no longer needed.
      mapped = allgather(single_copy_bytes_ > 0 && cannot.empty() ? "mapped 1" : "mapped 0");
    } catch (...) {
      undo();
      throw;
    }
    single_copy_ = single_copy_bytes_ > 0;
    for (int p = 0; p < size; ++p)
      if ((peers_[p].serve || p == rank) && mapped[p] != "mapped 1") single_copy_ = false;
    if (opened_reads_ && !single_copy_) {
      release_reads_under_yama();
      opened_reads_ = false;
    }
    if (single_copy_bytes_ > 0 && !single_copy_)
      CONDUIT_LOG_INFO("shm: rank {}: messages go through the rings only (no single copy): {}", rank,
                       cannot.empty() ? "another local rank cannot read its peers' memory" : cannot);
    ::shm_unlink(my_name.c_str());
  }

  ~ShmTransport() override {
    // A send whose data is moving (a peer reading its buffer, single copy; a frame partly written into a ring) is told
    // to the peers as an abort: failed here, its buffer goes back to the caller while a peer could still read it, and
    // a peer waiting for the rest of a frame waited for its deadline. (Other pending requests, such as receives left
    // posted at the end of a run, say nothing to the peers, as tcp's closed connections do not.)
    bool moving = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& p : peers_) {
        if (!p.serve) continue;
        if (!p.being_read.empty()) sends_read(p);  // (reads a peer finished, which no wait here has seen yet)
        moving = moving || !p.being_read.empty() || (!p.sendq.empty() && p.sendq.front().sent > 0);
      }
    }
    if (moving && aborted_reason().empty()) abort("its shm transport was destroyed while sending");
    {
      // Pending requests fail now: their waits would call progress() on this transport once it is gone.
      std::lock_guard<std::mutex> lk(mu_);
      fail_all(std::make_exception_ptr(PeerError(fmt::format("shm transport (rank {}) was destroyed", rank_))));
    }
    close_pidfds();
    for (char* m : maps_)
      if (m != nullptr && m != MAP_FAILED) ::munmap(m, seg_bytes_);
    if (mine_ != nullptr && mine_ != MAP_FAILED) ::munmap(mine_, seg_bytes_);
    if (opened_reads_) release_reads_under_yama();
  }

  const char* name() const override { return "shm"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return post_send(peer, tag, data, bytes, true);
  }
  RequestPtr isend_reduced(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return post_send(peer, tag, data, bytes, false);
  }

  RequestPtr post_send(int peer, uint64_t tag, const void* data, size_t bytes, bool may_single_copy) {
    check_peer(peer);
    check_tag("shm", may_single_copy ? "isend" : "isend_reduced", tag);
    check_message_size(bytes, max_len_);
    auto req = std::make_shared<Request>(Request::Kind::send, peer, tag, bytes);
    req->set_progressor(this);
    req->set_notes(notes_);
    std::lock_guard<std::mutex> lk(mu_);
    ShmPeer& p = peers_[peer];
    if (p.failed) {
      req->fail(p.error);
      return req;
    }
    ShmSend s;
    s.req = req;
    s.data = static_cast<const char*>(data);
    s.bytes = bytes;
    if (may_single_copy && single_copy_ && bytes >= single_copy_bytes_) {
      s.single_copy = true;
      s.hdr = make_frame(kFrameShmRead, tag, bytes, rank_);
      s.desc.addr = reinterpret_cast<uintptr_t>(data);  // its sequence number once its frame starts (cancel())
    } else {
      s.hdr = make_frame(kFrameData, tag, bytes, rank_);
    }
    p.sendq.push_back(std::move(s));
    if (p.sendq.size() == 1) write_some(p);
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    check_tag("shm", "irecv", tag);
    return post_recv(peer, tag, make_recv(Request::Kind::recv, peer, tag, data, bytes));
  }

  RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) override {
    check_tag("shm", "irecv_reduce", tag);
    return post_recv(peer, tag, make_reduce_recv(peer, tag, dst, count, dtype, op));
  }

  bool cancel(const RequestPtr& r, std::exception_ptr error) override {
    if (r->peer() < 0 || r->peer() >= size_ || !peers_[r->peer()].serve) return false;
    std::lock_guard<std::mutex> lk(mu_);  // data moves only under it
    ShmPeer& p = peers_[r->peer()];
    bool removed = false;
    if (r->kind() == Request::Kind::send) {
      removed = !r->done() && cancel_unstarted_send(p.sendq, r.get());
    } else {
      // Not a receive being filled, nor one that took a single-copy message still in the sender's memory: that
      // message is being delivered, and later ones of its tag may have gone to later receives (putting it back
      // would hand it to a receive after theirs).
      const bool taking = std::any_of(p.deferred.begin(), p.deferred.end(), [&](const ShmPeer::Deferred& d) {
        return d.u->has_waiter && d.u->waiter.req == r;
      });
      removed = !r->done() && !taking && !(p.target == Target::posted && p.cur.req == r) && p.q.cancel(r.get());
    }
    if (removed) {
      r->fail(std::move(error));
      wake_local_waiters();  // (another thread of this process may be waiting on it)
    }
    return removed;
  }

  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::string why = fmt::format("rank {} aborted: {}", rank_, reason);
    set_aborted(why);
    for (auto& p : peers_) {
      if (!p.serve || p.seg == nullptr) continue;
      // Claim the slot, write the reason, then publish: a peer that sees `aborted` > 0 reads the whole reason
      // (publishing first let a waiting peer read an empty reason and report only "rank R aborted").
      int32_t expected = 0;
      if (p.seg->aborted.compare_exchange_strong(expected, kAbortClaimed, std::memory_order_acq_rel)) {
        std::snprintf(p.seg->reason, sizeof p.seg->reason, "%s", why.c_str());
        p.seg->aborted.store(rank_ + 1, std::memory_order_release);
      }
      ring_doorbell(p.seg);
    }
    fail_all(std::make_exception_ptr(PeerError(why)));
  }

  // Each rank reads every rank's slot. With a core per rank, up to 16 KiB of reading (8 KiB with 2 ranks, 1 KiB from
  // 16) beats a message algorithm's rounds: 2 ranks, 2-8 KiB, interleaved A/B on this VM: 1.4-2.1 us against 2.1-2.9
  // us for recursive doubling and the ring. Ranks that share cores keep 1 KiB: there every rank waits for all the
  // others to be scheduled (4 ranks on 2 cores, 4 KiB: 54-62 us median against 29-38 us).
  size_t fast_allreduce_max_bytes() const override {
    if (!all_local_ || size_ < 2) return 0;
    if (fast_small_) return 1024;
    return std::clamp<size_t>(kFastReadBytes / static_cast<size_t>(size_), 1024, kFastBytes);
  }

  void fast_allreduce(void* buf, size_t count, DType dtype, ReduceOp op, const Deadline& deadline) override {
    const size_t bytes = count * dtype_size(dtype);
    if (fast_allreduce_max_bytes() == 0 || bytes > fast_allreduce_max_bytes())
      throw InvalidArgument(fmt::format("shm: fast allreduce of {} bytes (at most {}, all ranks on this host)",
                                        bytes, fast_allreduce_max_bytes()));
    const uint64_t seq = ++fast_seq_;
    FastSlot* mine = fast_slot(mine_, seq & 1);
    std::memcpy(mine->data, buf, bytes);
    mine->bytes = static_cast<uint32_t>(bytes);
    mine->dtype = static_cast<uint8_t>(dtype);
    mine->op = static_cast<uint8_t>(op);
    mine->seq.store(seq, std::memory_order_release);
    // Wake the peers that gave up spinning (they raise `sleepers` before their last look at our slot).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && peers_[r].seg->sleepers.load(std::memory_order_relaxed) > 0) ring_doorbell(peers_[r].seg);
    // Reduce in rank order so every rank computes the same bits.
    for (int r = 0; r < size_; ++r) {
      const FastSlot* src = r == rank_ ? mine : fast_slot(maps_[r], seq & 1);
      if (r != rank_) {
        wait_fast(r, src, seq, deadline);
        if (src->bytes != bytes || src->dtype != mine->dtype || src->op != mine->op)
          throw MismatchError(fmt::format(
              "shm: fast allreduce #{}: rank {} contributed {} bytes of {} with {}, this rank {} bytes of {} with {}",
              seq - 1, r, src->bytes, src->dtype < 8 ? dtype_name(static_cast<DType>(src->dtype)) : "?",
              src->op < 5 ? reduce_op_name(static_cast<ReduceOp>(src->op)) : "?", bytes, dtype_name(dtype),
              reduce_op_name(op)));
      }
      if (r == 0) std::memcpy(buf, src->data, bytes);
      else reduce_into(buf, src->data, count, dtype, op);
    }
  }

  // Progressor
  bool progress() override {
    tl_seen_ = my_seg_->doorbell.load(std::memory_order_acquire);
    // Whether the peers still live, at least every 50 ms whatever the doorbell and the traffic do: a waiter woken by
    // other peers' writes (or kept busy by them) skipped the quiet-sleep check, and a rank died unseen while another
    // one kept writing here (until the deadline, or for ever without one). The clock is read every 256th call.
    if ((++tl_polls_ & 255u) == 0 && liveness_due()) check_liveness();
    std::lock_guard<std::mutex> lk(mu_);
    return progress_locked();
  }

  void notify() override { wake_local_waiters(); }

  void wait_for_activity(const Deadline& until) override {
    uint32_t seen = tl_seen_;
    // Spin first: a peer on another core answers within microseconds, and giving the core away costs a
    // scheduler round trip (milliseconds on a busy machine). Oversubscribed hosts spin briefly.
    auto spin_until = Clock::now() + spin_;
    while (true) {
      for (int i = 0; i < 64; ++i) {
        if (my_seg_->doorbell.load(std::memory_order_acquire) != seen) return;
        cpu_relax();
      }
      if (Clock::now() >= spin_until) break;
    }
    sched_yield();
    if (my_seg_->doorbell.load(std::memory_order_acquire) != seen) return;
    // A single-copy message without a receive is read into a buffer after a while: progress() must run by then.
    double rem = std::min(until.remaining_seconds(), have_deferred_.load(std::memory_order_relaxed) ? 1e-3 : 0.05);
    if (rem > 0) {
      timespec ts{0, static_cast<long>(rem * 1e9)};
      my_seg_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (my_seg_->doorbell.load(std::memory_order_seq_cst) == seen) futex(&my_seg_->doorbell, FUTEX_WAIT, seen, &ts);
      my_seg_->sleepers.fetch_sub(1, std::memory_order_acq_rel);
    }
    // After a quiet sleep (and on the 50 ms timer, progress()).
    if (my_seg_->doorbell.load(std::memory_order_acquire) == seen || liveness_due()) check_liveness();
  }

 private:
  static std::string segment_name(const std::string& job, int rank) { return shm_segment_name(job, rank); }
  FastSlot* fast_slot(char* seg, uint64_t parity) const {
    return reinterpret_cast<FastSlot*>(seg + ring_offset(size_)) + parity;  // after the last ring
  }

  // Waits until rank r has published operation seq: spins for the transport's spin budget, then sleeps on this
  // rank's doorbell (publishers ring the doorbells of sleeping peers), checking at least every millisecond for
  // the deadline, an abort and whether r is still alive.
  void wait_fast(int r, const FastSlot* slot, uint64_t seq, const Deadline& deadline) {
    for (int i = 0; i < 256; ++i) {  // a peer on another core answers within a microsecond: no clock until then
      if (slot->seq.load(std::memory_order_acquire) == seq) return;
      cpu_relax();
    }
    // While waiting, keep this rank's messages moving (progress happens in waiting threads): a peer may need the
    // rest of a non-blocking send of ours before it reaches this allreduce.
    const auto spin_until = Clock::now() + spin_;
    for (uint64_t i = 1;; ++i) {
      if (slot->seq.load(std::memory_order_acquire) == seq) return;
      if ((i & 63) != 0) {
        cpu_relax();
        continue;
      }
      progress();
      if (Clock::now() >= spin_until) break;
    }
    while (true) {
      tl_seen_ = my_seg_->doorbell.load(std::memory_order_acquire);
      progress();
      uint32_t seen = tl_seen_;
      my_seg_->sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (slot->seq.load(std::memory_order_seq_cst) != seq) {
        double rem = std::clamp(deadline.remaining_seconds(), 0.0, 1e-3);
        timespec ts{0, static_cast<long>(rem * 1e9)};
        if (rem > 0) futex(&my_seg_->doorbell, FUTEX_WAIT, seen, &ts);
      }
      my_seg_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (slot->seq.load(std::memory_order_acquire) == seq) return;
      if (my_seg_->aborted.load(std::memory_order_acquire) > 0) {
        std::string why =
            printable_reason(std::string_view(my_seg_->reason, strnlen(my_seg_->reason, kMaxAbortReason)));
        throw PeerError(why.empty() ? fmt::format("rank {} aborted", my_seg_->aborted.load() - 1) : why);
      }
      std::string reason = aborted_reason();
      if (!reason.empty()) throw PeerError(reason);
      if (peer_gone(peers_[r]))
        throw PeerError(fmt::format("shm: rank {} (pid {}) died", r, static_cast<long>(peers_[r].pid)));
      if (deadline.expired()) {
        std::vector<int> silent;
        for (int q = 0; q < size_; ++q)
          if (q != rank_ && fast_slot(maps_[q], seq & 1)->seq.load(std::memory_order_acquire) != seq)
            silent.push_back(q);
        throw TimeoutError(
            fmt::format("shm: fast allreduce #{} did not complete before the deadline; no data yet "
                        "from rank(s) {}",
                        seq - 1, fmt::join(silent, ", ")));
      }
    }
  }

  // The byte ranges of this rank's segment that get written: the header, every ring's header, the rings of the
  // local peers (each writes its ring here) and the fast slots.
  template <typename F>
  void for_each_written_range(const std::vector<char>& serve, F&& f) const {
    f(size_t{0}, sizeof(SegHeader));
    for (int i = 0; i < size_; ++i) f(ring_offset(i), sizeof(RingHeader) + (serve[i] && i != rank_ ? ring_bytes_ : 0));
    f(ring_offset(size_), 2 * sizeof(FastSlot));
  }
  uint64_t reserved_bytes(const std::vector<char>& serve) const {
    uint64_t n = 0;
    for_each_written_range(serve, [&](size_t, size_t len) { n += len; });
    return n;
  }
  // 0, or the error of the first range /dev/shm could not back.
  int reserve(int fd, const std::vector<char>& serve) const {
    int err = 0;
    for_each_written_range(serve, [&](size_t at, size_t len) {
      if (err == 0) err = ::posix_fallocate(fd, static_cast<off_t>(at), static_cast<off_t>(len));
    });
    return err;
  }

  // Where rank src's ring (its header, then ring_bytes_ of data) starts in a segment.
  size_t ring_offset(int src) const {
    return sizeof(SegHeader) + static_cast<size_t>(src) * (sizeof(RingHeader) + ring_bytes_);
  }
  RingHeader* ring_at(char* seg, int src) const { return reinterpret_cast<RingHeader*>(seg + ring_offset(src)); }

  void check_peer(int peer) const {
    if (peer < 0 || peer >= size_ || !peers_[peer].serve)
      throw InvalidArgument(
          fmt::format("shm: peer rank {} is not another rank of [0, {}) on this host", peer, size_));
  }

  RequestPtr post_recv(int peer, uint64_t tag, PostedRecv r) {
    check_peer(peer);
    r.req->set_progressor(this);
    r.req->set_notes(notes_);
    RequestPtr req = r.req;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ShmPeer& p = peers_[peer];
      completed_other_ = false;
      posting_ = req.get();
      if (p.q.take_unexpected(tag, r, "shm")) {
        // (the budget it frees may let a frame stalled in the ring go on)
        if (!p.failed && p.have_hdr && p.target == Target::none) read_some(p, false);
      } else if (p.failed) {
        req->fail(p.error);
      } else {
        p.q.post(tag, std::move(r));
        read_some(p, false);  // (the message may already sit in the ring)
      }
      posting_ = nullptr;
      if (!completed_other_) return req;
    }
    // Taking it took messages stalled behind it (over the budget for unexpected bytes) into receives other threads
    // wait on, for which no peer rings: wake them (only then: a doorbell add and a futex call on every receive that
    // found its message waiting cost the ring's hot path), after the lock, which they take next.
    wake_local_waiters();
    return req;
  }

  bool progress_locked() {
    bool moved = false, deferred = false;
    if (my_seg_->aborted.load(std::memory_order_acquire) > 0 && aborted_reason().empty()) {
      progress_abort();
      return true;
    }
    for (auto& p : peers_) {
      if (!p.serve || p.failed) continue;
      if (!p.sendq.empty()) moved |= write_some(p);
      if (!p.being_read.empty()) moved |= sends_read(p);
      moved |= read_some(p);
      if (!p.deferred.empty()) moved |= read_deferred(p);
      deferred |= !p.deferred.empty();
    }
    have_deferred_.store(deferred, std::memory_order_relaxed);
    return moved;
  }

  // A rank flagged an abort in this segment: fail everything with its reason (while the rank still writes it, the
  // flag is kAbortClaimed: everything fails then too).
  void progress_abort() {
    const int32_t who = my_seg_->aborted.load(std::memory_order_acquire);
    std::string why =
        who > 0 ? printable_reason(std::string_view(my_seg_->reason, strnlen(my_seg_->reason, kMaxAbortReason))) : "";
    if (why.empty()) why = who > 0 ? fmt::format("rank {} aborted", who - 1) : "a local rank aborted";
    if (aborted_reason().empty()) set_aborted(why);
    fail_all(std::make_exception_ptr(PeerError(why)));
  }

  // Copies queued sends into the ring in the peer's segment. True if anything was written.
  bool write_some(ShmPeer& p) {
    bool wrote = false;
    while (!p.sendq.empty()) {
      ShmSend& s = p.sendq.front();
      if (s.single_copy && s.sent == 0) {
        // A message the ring has room for goes through it: its send completes at once, whatever the receiver is
        // doing (a single-copy send waits for the receiver to read it, and programs may count on a send that fits
        // completing, as it always did). A single-copy message also needs a free done slot for its number.
        const uint64_t h = p.out->head.load(std::memory_order_relaxed);
        const uint64_t t = p.out_tail_cache = p.out->tail.load(std::memory_order_acquire);
        const bool fits = h - t <= ring_bytes_ && ring_bytes_ - (h - t) >= sizeof(FrameHeader) + s.bytes;
        const bool no_slot = !p.being_read.empty() && p.being_read.front().first + kReadSlots <= p.reads_announced + 1;
        if (fits || no_slot) {
          s.single_copy = false;
          s.hdr = make_frame(kFrameData, s.hdr.tag, s.bytes, rank_);
        }
      }
      uint64_t head = p.out->head.load(std::memory_order_relaxed);
      // The consumer's tail is read only when the cached value says the ring is too full: its cache line then
      // stays with the consumer.
      size_t total_left = s.frame_bytes() - s.sent;
      uint64_t tail = p.out_tail_cache;
      // The consumer's tail is never past the head nor more than a ring behind it: else the segment is corrupt and
      // the space computed from it would overwrite unread bytes.
      auto corrupt = [&] {
        if (head - tail <= ring_bytes_) return false;
        fail_peer(p, std::make_exception_ptr(ProtocolError(
                         fmt::format("shm: rank {} set the tail of our ring to it to {}, head {} (allowed: at most "
                                     "{} bytes behind the head): corrupt segment",
                                     p.rank, tail, head, ring_bytes_))));
        return true;
      };
      // (the cache may hold a tail read just now, by the single-copy check above: its space wrapped past the ring
      // and the checks below were skipped)
      if (corrupt()) return wrote;
      size_t space = ring_bytes_ - static_cast<size_t>(head - tail);
      if (space < total_left) {
        tail = p.out_tail_cache = p.out->tail.load(std::memory_order_acquire);
        if (corrupt()) return wrote;
        space = ring_bytes_ - static_cast<size_t>(head - tail);
      }
      if (space == 0) {
        // Ask the consumer to ring us when it frees space, then look again (it may have just done so).
        p.out->want_space.store(1, std::memory_order_seq_cst);
        tail = p.out_tail_cache = p.out->tail.load(std::memory_order_seq_cst);
        if (corrupt()) return wrote;
        space = ring_bytes_ - static_cast<size_t>(head - tail);
        if (space == 0) break;
      }
      size_t total = s.frame_bytes();
      if (s.single_copy && s.sent == 0) s.desc.seq = ++p.reads_announced;
      size_t n = std::min(space, total - s.sent);
      size_t done = 0;
      while (done < n) {
        size_t pos = static_cast<size_t>((head + done) & (ring_bytes_ - 1));
        size_t chunk = std::min(n - done, ring_bytes_ - pos);
        size_t off = s.sent + done;  // offset within header+payload
        if (off < sizeof(FrameHeader)) chunk = std::min(chunk, sizeof(FrameHeader) - off);
        std::memcpy(p.out_data + pos, s.frame_at(off), chunk);
        done += chunk;
      }
      p.out->head.store(head + n, std::memory_order_release);
      s.sent += n;
      wrote = true;
      if (s.sent < total) break;
      RequestPtr r = s.req;
      const bool read_by_peer = s.single_copy;
      const uint64_t seq = s.desc.seq;
      p.sendq.pop_front();
      // A single-copy send completes once the receiver has read its buffer (sends_read()).
      if (read_by_peer)
        p.being_read.emplace_back(seq, std::move(r));
      else
        r->complete();
    }
    if (wrote) ring_doorbell(p.seg);
    return wrote;
  }

  // Takes what the ring holds from p into its targets; a single-copy message is read from p's memory only with
  // remote_reads.
  bool read_some(ShmPeer& p, bool remote_reads = true) {
    bool consumed_any = false;
    while (!p.failed) {
      uint64_t tail = p.in->tail.load(std::memory_order_relaxed);
      uint64_t head = p.in->head.load(std::memory_order_acquire);
      size_t avail = static_cast<size_t>(head - tail);
      if (avail > ring_bytes_) {
        fail_protocol(p, fmt::format("ring indices are corrupt (head {}, tail {}: {} bytes pending, the ring holds {})",
                                     head, tail, head - tail, ring_bytes_));
        break;
      }
      if (!p.have_hdr) {
        if (avail == 0) break;
        consumed_any = true;
        if (p.hdr_got < sizeof(FrameHeader)) {
          if (!take_record(p, tail, avail, &p.hdr, sizeof(FrameHeader), p.hdr_got)) continue;
          std::string bad = validate_frame(p.hdr, p.rank, max_len_, single_copy_);
          if (!bad.empty()) {
            fail_protocol(p, bad);
            break;
          }
          p.desc_got = 0;
          if (p.hdr.type == kFrameShmRead) continue;  // its descriptor next
        } else {
          if (!take_record(p, tail, avail, &p.desc, sizeof(ShmReadDesc), p.desc_got)) continue;
          if (p.desc.seq != p.reads_seen + 1) {
            fail_protocol(p, fmt::format("single-copy message #{} follows #{} (expected #{})", p.desc.seq, p.reads_seen,
                                         p.reads_seen + 1));
            break;
          }
          // The sender keeps at most kReadSlots messages unread (its done slots).
          if (!p.deferred.empty() && p.desc.seq >= p.deferred.front().desc.seq + kReadSlots) {
            fail_protocol(p, fmt::format("single-copy message #{} while #{} is unread (at most {} may be)", p.desc.seq,
                                         p.deferred.front().desc.seq, kReadSlots));
            break;
          }
          p.reads_seen = p.desc.seq;
        }
        p.have_hdr = true;
        p.target = Target::none;
      }
      if (p.target == Target::none) {
        if (!choose_target(p)) {  // stalled: wait for a receive to be posted
          note_stall(p);
          break;
        }
        if (p.noted) {  // (the held frame goes on)
          notes_->clear(p.rank);
          p.noted = false;
        }
        if (p.failed) break;
        if (p.hdr.length == 0 && p.hdr.type != kFrameShmRead) {
          finish_payload(p);
          continue;
        }
      }
      if (p.hdr.type == kFrameShmRead) {
        if (p.target == Target::posted) {
          // Not while a receive is being posted: the caller may have the matching sends still to post, and the
          // peer, doing the same, would wait for them while this rank reads (the two ranks' reads took turns).
          if (!remote_reads) break;
          if (!read_into(p, p.cur, p.desc, p.hdr.length)) break;
        }
        if (p.target != Target::deferred) ack_read(p, p.desc.seq);  // posted, or discarded (a wrong size)
        finish_payload(p);
        consumed_any = true;
        continue;
      }
      tail = p.in->tail.load(std::memory_order_relaxed);
      avail = static_cast<size_t>(p.in->head.load(std::memory_order_acquire) - tail);
      if (avail == 0) break;
      size_t n = std::min(avail, static_cast<size_t>(p.hdr.length - p.pay_got));
      consume_payload(p, tail, n);
      consume(p, tail, n);
      consumed_any = true;
      p.pay_got += n;
      if (p.pay_got == p.hdr.length) finish_payload(p);
    }
    if (consumed_any) {
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (p.in->want_space.load(std::memory_order_relaxed) != 0) {
        p.in->want_space.store(0, std::memory_order_relaxed);
        ring_doorbell(p.seg);  // the sender waits for space
      }
    }
    return consumed_any;
  }

  void copy_out(ShmPeer& p, uint64_t from, char* dst, size_t n) {
    size_t pos = static_cast<size_t>(from & (ring_bytes_ - 1));
    size_t first = std::min(n, ring_bytes_ - pos);
    std::memcpy(dst, p.in_data + pos, first);
    if (first < n) std::memcpy(dst + first, p.in_data, n - first);
  }

  void consume(ShmPeer& p, uint64_t tail, size_t n) { p.in->tail.store(tail + n, std::memory_order_release); }

  // Takes what has arrived (avail bytes at tail) of a fixed-size record, the frame header or a single-copy
  // descriptor, into `obj`, of which `got` bytes were there already; true once all `size` are.
  bool take_record(ShmPeer& p, uint64_t tail, size_t avail, void* obj, size_t size, size_t& got) {
    const size_t n = std::min(avail, size - got);
    copy_out(p, tail, static_cast<char*>(obj) + got, n);
    consume(p, tail, n);
    got += n;
    return got == size;
  }

  // Copies a single-copy message (len bytes, described by d) out of the sender's memory into receive r: a reducing
  // receive reads a cache-sized chunk at a time and reduces it while it is still in cache. False when the peer has
  // failed.
  bool read_into(ShmPeer& p, const PostedRecv& r, const ShmReadDesc& d, uint64_t len) {
    if (!r.reduce) return read_remote(p, d, len, r.dst, 0, len);
    if (scratch_.empty()) scratch_.resize(kReadChunk / sizeof(uint64_t));
    for (uint64_t off = 0; off < len; off += kReadChunk) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(kReadChunk, len - off));
      if (!read_remote(p, d, len, reinterpret_cast<char*>(scratch_.data()), off, n)) return false;
      reduce_into(r.dst + off, scratch_.data(), n / dtype_size(r.dtype), r.dtype, r.op);
    }
    return true;
  }

  // Reads n bytes at offset `off` of the len-byte single-copy message d from the sender's memory into dst.
  bool read_remote(ShmPeer& p, const ShmReadDesc& d, uint64_t len, char* dst, uint64_t off, size_t n) {
    size_t got = 0;
    while (got < n) {
      iovec local{dst + got, n - got};
      iovec remote{reinterpret_cast<void*>(d.addr + off + got), n - got};
      const ssize_t r = ::process_vm_readv(p.pid, &local, 1, &remote, 1, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      const int e = r < 0 ? errno : EFAULT;
      // A sender that aborted may have freed the buffer already: the abort is the cause, not its memory (it was
      // reported as a protocol error of the sender's).
      if (my_seg_->aborted.load(std::memory_order_seq_cst) != 0) {
        progress_abort();
        return false;
      }
      if (e == ESRCH) {
        fail_peer(p,
                  std::make_exception_ptr(
                      PeerError(fmt::format("shm: rank {} (pid {}) died", p.rank, static_cast<long>(p.pid)))),
                  /*keep_arrived=*/true);
      } else if (e == EPERM) {
        fail_peer(p, std::make_exception_ptr(PeerError(fmt::format(
                         "shm: rank {} (pid {}) no longer lets this rank read its memory (process_vm_readv: {}); "
                         "CONDUIT_SHM_SINGLE_COPY_BYTES=off sends through the rings",
                         p.rank, static_cast<long>(p.pid), std::strerror(e)))));
      } else {
        fail_protocol(p, fmt::format("cannot read bytes {}-{} of the {}-byte message #{} at {:#x} in its memory: {}",
                                     off + got, off + n, len, d.seq, d.addr, std::strerror(e)));
      }
      return false;
    }
    // A sender that aborted has failed this send and may have reused the buffer while it was read: the bytes are not
    // to be trusted (it flags the abort here before it fails its requests).
    if (my_seg_->aborted.load(std::memory_order_seq_cst) != 0) {
      progress_abort();
      return false;
    }
    return true;
  }

  // Tells p that its single-copy message seq has been read: its buffer is free again (it waits on its doorbell).
  void ack_read(ShmPeer& p, uint64_t seq) {
    p.in->read_done[seq % kReadSlots].store(seq, std::memory_order_release);
    ring_doorbell(p.seg);
  }

  // Reads the single-copy messages from p that found no receive: into the receive once one has taken the message,
  // or into a buffer once the message has waited kReadUnmatchedAfter (within the budget). True if any was read.
  bool read_deferred(ShmPeer& p) {
    bool any = false;
    const auto now = Clock::now();
    for (auto it = p.deferred.begin(); it != p.deferred.end();) {
      Unexpected& u = *it->u;
      const uint64_t len = it->length;
      if (u.has_waiter) {
        PostedRecv r = p.q.take_waiter(u);
        if (r.bytes != len) {
          fail_wrong_size(r, len, "shm");
        } else if (!read_into(p, r, it->desc, len)) {
          r.req->fail(p.error);  // fail_peer dropped p.deferred; r had left the queues it fails
          return true;
        } else {
          r.req->complete();
        }
      } else if (now - it->since >= kReadUnmatchedAfter && may_buffer(p, len)) {
        u.data.resize(len);
        p.q.charge(len);
        if (!read_remote(p, it->desc, len, u.data.data(), 0, len)) return true;
        p.q.complete_unexpected(u, "shm");
      } else {
        ++it;
        continue;
      }
      ack_read(p, it->desc.seq);
      it = p.deferred.erase(it);
      any = true;
    }
    return any;
  }

  // Completes this rank's single-copy sends to p that p has finished reading. True if any completed.
  bool sends_read(ShmPeer& p) {
    bool any = false;
    for (auto it = p.being_read.begin(); it != p.being_read.end();) {
      const uint64_t v = p.out->read_done[it->first % kReadSlots].load(std::memory_order_acquire);
      if (v > p.reads_announced) {
        fail_protocol(p, fmt::format("it reports single-copy message #{} read, {} were sent (corrupt segment)", v,
                                     p.reads_announced));
        return true;
      }
      if (v != it->first) {
        ++it;
        continue;
      }
      RequestPtr r = std::move(it->second);
      it = p.being_read.erase(it);
      r->complete();
      any = true;
    }
    return any;
  }

  void consume_payload(ShmPeer& p, uint64_t from, size_t n) {
    switch (p.target) {
      case Target::posted:
        if (!p.cur.reduce) {
          copy_out(p, from, p.cur.dst + p.pay_got, n);
        } else {
          reduce_from_ring(p, from, n);
        }
        break;
      case Target::unexpected:
        copy_out(p, from, p.cur_unexp->data.data() + p.pay_got, n);
        break;
      case Target::abort:
        copy_out(p, from, p.abort_buf.data() + p.pay_got, n);
        break;
      case Target::discard:
      case Target::deferred:  // (no payload in the ring)
      case Target::none:
        break;
    }
  }

  // Reduces n bytes starting at ring position `from` into the current receive, element-aligned; a partial element
  // (at the ring's wrap point or the end of what has arrived) is carried to the next call.
  void reduce_from_ring(ShmPeer& p, uint64_t from, size_t n) {
    size_t esz = dtype_size(p.cur.dtype);
    while (n > 0) {
      if (!p.carry.empty()) {
        size_t need = esz - p.carry.size();
        size_t take = std::min(need, n);
        size_t old = p.carry.size();
        p.carry.resize(old + take);
        copy_out(p, from, p.carry.data() + old, take);
        from += take;
        n -= take;
        if (p.carry.size() == esz) {
          reduce_into(p.cur.dst + p.reduced_bytes, p.carry.data(), 1, p.cur.dtype, p.cur.op);
          p.reduced_bytes += esz;
          p.carry.clear();
        }
        continue;
      }
      size_t pos = static_cast<size_t>(from & (ring_bytes_ - 1));
      size_t contiguous = std::min(n, ring_bytes_ - pos);
      size_t whole = contiguous / esz;
      if (whole > 0) {
        reduce_into(p.cur.dst + p.reduced_bytes, p.in_data + pos, whole, p.cur.dtype, p.cur.op);
        p.reduced_bytes += whole * esz;
        from += whole * esz;
        n -= whole * esz;
      } else {
        size_t take = std::min(n, esz);
        p.carry.resize(take);
        copy_out(p, from, p.carry.data(), take);
        from += take;
        n -= take;
        if (take == esz) {
          reduce_into(p.cur.dst + p.reduced_bytes, p.carry.data(), 1, p.cur.dtype, p.cur.op);
          p.reduced_bytes += esz;
          p.carry.clear();
        }
      }
    }
  }

  // Over the budget a message from p waits where it is (the ring, or the sender's memory), unless receives of other
  // tags wait on p: their messages may be behind it, so it is buffered past the budget, up to 4x (tcp does the same).
  bool may_buffer(const ShmPeer& p, uint64_t bytes) const {
    return p.q.can_buffer(bytes, unexpected_budget_) ||
           (p.q.has_posted() && p.q.can_buffer(bytes, 4 * unexpected_budget_));
  }

  bool choose_target(ShmPeer& p) {
    const FrameHeader& h = p.hdr;
    p.pay_got = 0;
    if (h.type == kFrameAbort) {
      p.target = Target::abort;
      p.abort_buf.assign(h.length, '\0');
      return true;
    }
    if (h.type != kFrameData && h.type != kFrameShmRead) {
      fail_protocol(p, "unexpected hello frame in a shared-memory ring");
      return true;
    }
    if (p.q.pop_posted(h.tag, &p.cur)) {
      if (p.cur.bytes != h.length) {
        // That receive fails and the message is read past, as tcp does: the ring stays usable.
        fail_wrong_size(p.cur, h.length, "shm");
        p.target = Target::discard;
        return true;
      }
      p.target = Target::posted;
      p.reduced_bytes = 0;
      p.carry.clear();
      return true;
    }
    if (h.type == kFrameShmRead) {
      // Its bytes wait in the sender's memory for a receive (the ring goes on): read_deferred().
      p.deferred.push_back({p.q.add_remote(h.tag), p.desc, h.length, Clock::now()});
      have_deferred_.store(true, std::memory_order_relaxed);
      p.target = Target::deferred;
      return true;
    }
    if (!may_buffer(p, h.length)) return false;  // the ring holds it (a stall)
    p.cur_unexp = p.q.add_unexpected(h.tag, h.length);
    p.target = Target::unexpected;
    return true;
  }

  // The ring from p stalls on its header (choose_target): a wait on p that reaches its deadline says why, and the
  // first stall of p is logged.
  void note_stall(ShmPeer& p) {
    std::string note = stall_note("shm", p.rank, p.hdr.tag, p.hdr.length, p.q.unexpected_bytes(), unexpected_budget_,
                                  p.q.has_posted(), "CONDUIT_SHM_UNEXPECTED_BYTES");
    if (!p.warned) {
      p.warned = true;
      CONDUIT_LOG_WARN("rank {}: {}", rank_, note);
    }
    notes_->set(p.rank, std::move(note));
    p.noted = true;
  }

  void finish_payload(ShmPeer& p) {
    Target t = p.target;
    p.target = Target::none;
    p.have_hdr = false;
    p.hdr_got = 0;
    p.desc_got = 0;
    if (t == Target::posted) {
      RequestPtr r = p.cur.req;
      p.cur = PostedRecv{};
      if (r.get() != posting_) completed_other_ = true;
      r->complete();
    } else if (t == Target::unexpected) {
      auto u = p.cur_unexp;
      p.cur_unexp.reset();
      p.q.complete_unexpected(*u, "shm");
    } else if (t == Target::abort) {
      std::string why = fmt::format("rank {} aborted: {}", p.rank, printable_reason(p.abort_buf));
      set_aborted(why);
      fail_all(std::make_exception_ptr(PeerError(why)));
    }
  }

  void fail_protocol(ShmPeer& p, const std::string& what) {
    CONDUIT_LOG_ERROR("shm: rank {}: protocol error in the ring from rank {}: {}", rank_, p.rank, what);
    fail_peer(p, std::make_exception_ptr(
                     ProtocolError(fmt::format("shm: protocol error in the ring from rank {}: {}", p.rank, what))));
  }

  // `keep_arrived`: the peer is gone without an abort; what it delivered whole stays receivable.
  void fail_peer(ShmPeer& p, std::exception_ptr err, bool keep_arrived = false) {
    if (!p.failed) {
      p.failed = true;
      p.error = err;
    }
    for (auto& s : p.sendq) s.req->fail(err);
    p.sendq.clear();
    // A peer may still be reading these buffers if it has not failed too (an abort reaches it at once).
    for (auto& b : p.being_read) b.second->fail(err);
    p.being_read.clear();
    p.deferred.clear();  // their entries leave the match queues below
    if (p.target == Target::posted && p.cur.req) p.cur.req->fail(err);
    p.q.fail_all(err, keep_arrived);
    if (p.noted) notes_->clear(p.rank);
    p.noted = false;
    p.target = Target::none;
    p.have_hdr = false;
    p.cur_unexp.reset();
    // Whatever failed them here (this rank's abort, a peer's abort seen by another thread, a peer found dead, a
    // protocol error), this process's threads waiting on them sleep on its own doorbell, which only a peer's write
    // rang: they slept on up to their 50 ms timeout.
    wake_local_waiters();
  }

  // Wakes this process's threads waiting on this transport: they sleep on this rank's own doorbell (and spin on it
  // first), which peers ring when they write; a request completed or failed here, by another thread, rings nothing.
  void wake_local_waiters() {
    if (my_seg_ != nullptr) ring_doorbell(my_seg_);
  }

  void fail_all(std::exception_ptr err) {
    for (auto& p : peers_)
      if (p.serve) fail_peer(p, err);
  }

  // Whether the peer's process has exited: its pidfd is readable then; without one, its pid no longer exists.
  static bool peer_gone(const ShmPeer& p) {
    if (p.pidfd >= 0) {
      pollfd f{p.pidfd, POLLIN, 0};
      return ::poll(&f, 1, 0) > 0 && (f.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    }
    return ::kill(p.pid, 0) != 0 && errno == ESRCH;
  }
  void close_pidfds() {
    for (auto& p : peers_)
      if (p.pidfd >= 0) {
        ::close(p.pidfd);
        p.pidfd = -1;
      }
  }

  // True at most once per 50 ms (across threads): time for check_liveness().
  bool liveness_due() {
    const int64_t now = Clock::now().time_since_epoch().count();
    const int64_t every = std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(50)).count();
    int64_t last = last_liveness_.load(std::memory_order_relaxed);
    return now - last >= every && last_liveness_.compare_exchange_strong(last, now, std::memory_order_relaxed);
  }

  // A peer process that no longer exists will never answer: fail what waits on it.
  void check_liveness() {
    std::lock_guard<std::mutex> lk(mu_);
    progress_locked();
    for (auto& p : peers_) {
      if (!p.serve || p.failed || !p.pending()) continue;
      if (peer_gone(p)) {
        fail_peer(p, std::make_exception_ptr(
                         PeerError(fmt::format("shm: rank {} (pid {}) died", p.rank, static_cast<long>(p.pid)))),
                  /*keep_arrived=*/true);
      }
    }
  }

  std::vector<ShmPeer> peers_;
  std::vector<char*> maps_;
  char* mine_ = nullptr;
  SegHeader* my_seg_ = nullptr;
  size_t ring_bytes_;
  size_t seg_bytes_;
  uint64_t unexpected_budget_;
  uint64_t max_len_;
  Clock::duration spin_;
  bool oversubscribed_ = false;  // more local ranks than cores
  bool fast_small_ = false;      // some rank is oversubscribed: the fast allreduce's small limit on every rank
  uint64_t single_copy_bytes_ = 0;          // messages from this size on are read from the sender's memory; 0: never
  bool single_copy_ = false;                // every local rank can read every other's memory
  bool opened_reads_ = false;               // counted in g_ptracer_users (allow_reads_under_yama)
  std::vector<uint64_t> scratch_;           // a reducing single-copy receive's chunk
  std::atomic<bool> have_deferred_{false};  // some peer has single-copy messages waiting for a receive
  // (under mu_: the receive post_recv is posting, and whether a read there completed another request)
  const Request* posting_ = nullptr;
  bool completed_other_ = false;
  std::mutex mu_;
  bool all_local_ = false;    // every other rank is served here (the fast allreduce needs them all)
  // Fast allreduces so far (the same count on every rank). Errors number them from 0, this transport's own count: the
  // communicator's number of the operation where all its operations so far were fast allreduces ("allreduce #5 ...
  // fast allreduce #6" was one operation).
  uint64_t fast_seq_ = 0;
  std::atomic<int64_t> last_liveness_{0};  // Clock ticks of the last check_liveness()
  static thread_local uint32_t tl_seen_;
  static thread_local uint32_t tl_polls_;
};

thread_local uint32_t ShmTransport::tl_seen_ = 0;
thread_local uint32_t ShmTransport::tl_polls_ = 0;

// CONDUIT_SHM_RING_BYTES: each ring's size (default 2M).
uint64_t shm_ring_bytes() {
  auto s = env_string("CONDUIT_SHM_RING_BYTES");
  if (!s) return kDefaultShmRingBytes;
  constexpr const char* allowed = "a power of two from 4K to 1G";
  const uint64_t b = parse_bytes(*s, "CONDUIT_SHM_RING_BYTES", allowed);
  if (b < 4096 || b > kMaxRingBytes || (b & (b - 1)) != 0)
    throw ConfigError(fmt::format("CONDUIT_SHM_RING_BYTES={} is invalid: allowed: {}", *s, allowed));
  return b;
}

// CONDUIT_SHM_SINGLE_COPY_BYTES: 0 for off.
uint64_t shm_single_copy_bytes() {
  auto v = env_string("CONDUIT_SHM_SINGLE_COPY_BYTES");
  if (!v) return kDefaultSingleCopyBytes;
  if (*v == "off") return 0;
  constexpr const char* allowed =
      "'off' or a size from 4K (the smallest message read straight from the sender's memory)";
  const uint64_t b = parse_bytes(*v, "CONDUIT_SHM_SINGLE_COPY_BYTES", allowed);
  if (b < 4096) throw ConfigError(fmt::format("CONDUIT_SHM_SINGLE_COPY_BYTES={} is invalid: allowed: {}", *v, allowed));
  return b;
}

// CONDUIT_SHM_UNEXPECTED_BYTES: the bytes of messages without a receive yet buffered per peer (default 64M; as tcp's).
uint64_t shm_unexpected_budget() { return unexpected_budget("CONDUIT_SHM_UNEXPECTED_BYTES"); }

}  // namespace

void check_shm_environment() {
  (void)shm_ring_bytes();
  (void)shm_single_copy_bytes();
  (void)shm_unexpected_budget();
  (void)env_int("CONDUIT_LOCAL_CPUS", 1, 1 << 20);
  (void)env_int("CONDUIT_SHM_SPIN_US", 0, 1000000);
}

std::string shm_segment_name(const std::string& job, int rank) { return fmt::format("/conduit-{}-{}", job, rank); }

int remove_shm_segments(const std::string& job, int ranks) {
  int removed = 0;
  for (int r = 0; r < ranks; ++r) removed += ::shm_unlink(shm_segment_name(job, r).c_str()) == 0 ? 1 : 0;
  return removed;
}

TransportPtr make_shm_transport(int rank, int size, std::vector<int> hosts, const std::string& job,
                                const AllgatherFn& allgather, std::vector<char> serve) {
  return std::make_shared<ShmTransport>(rank, size, std::move(hosts), job, allgather, std::move(serve));
}

}  // namespace conduit::net
