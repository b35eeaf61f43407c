// OpenMPI transport.
//
// Communicators: duplicates of MPI_COMM_WORLD, all with MPI_ERRORS_RETURN so that errors come back as codes (and
// become Conduit exceptions) instead of killing the job: kDataComms (64) carry messages, one more carries abort
// notices (every rank keeps one MPI_Irecv(MPI_ANY_SOURCE) posted on it; abort() sends its reason to every peer).
//
// Start-up: MPI_Init_thread itself waits for every rank, with no deadline: a watchdog ends the process past the
// start-up deadline (mpi_init_once). Then the 65 duplicates are 65 collectives on MPI_COMM_WORLD, which MPI cannot
// interrupt. Each is an
// MPI_Comm_idup (MPI-3) polled with MPI_Test against the caller's deadline (CONDUIT_TIMEOUT by default), one after
// another (several outstanding idups on one communicator have hung OpenMPI before), as is the host-name exchange
// (MPI_Iallgather): a rank that never comes is a TimeoutError naming the step, not a hang. MPI allows neither
// cancelling nor freeing a pending collective request, so one given up on stays pending with its buffers (leaked on
// purpose) and MPI_COMM_WORLD's collectives no longer line up on that rank: the process is expected to end
// (mpi_exit_after_error turns the exit into MPI_Abort). (The missing ranks may still make the same call late, as
// long as this rank starts no other collective on MPI_COMM_WORLD before that completes: an idup's later rounds start
// from MPI's progress.)
//
// Stale messages: a transport's communicators are not freed when it is destroyed but retired, and only the oldest
// beyond kRetiredTransports transports are freed. OpenMPI hands a freed communicator's context id to the next
// communicator made, and keeps a message that arrives for an unknown context id until a communicator with that id
// appears: a message sent on a destroyed transport (a send nobody received before an abort or a timeout, an abort
// notice) matched the next transport's receive, or aborted it. A retired communicator keeps its id, so such a
// message waits in its queue and is dropped with it; by the time a retired communicator is freed, kRetiredTransports
// collective start-ups later, every message sent on it has long arrived.
//
// Tag mapping. Conduit tags are 64 bits (tags.h: kind | 24-bit communicator id | 32-bit sequence or user tag);
// MPI tags are 0..MPI_TAG_UB (at least 32767; 2^31-1 on OpenMPI). A Conduit tag travels on data communicator
// (comm_id mod 64) under an MPI tag built from B = floor(log2(MPI_TAG_UB + 1)) bits, R = B - 2:
//     mpi_tag = (kind - 1) << R  |  (comm_id >> 6 mod 2^t) << l  |  (low32 mod 2^l)
// with t = 18 and l = R - 18 when R >= 21 (OpenMPI's ob1: l = 11; its UCX layer, MPI_TAG_UB 2^23 - 1: l = 3), else
// l = R / 3 and t = R - l. With OpenMPI the (kind, communicator id) pair is kept whole (6 bits pick the MPI
// communicator, 18 sit in the tag): messages of different Conduit communicators or kinds never match each other.
// Only the low 32 bits are folded, mod 2^l: two tags of one communicator and kind whose low parts differ by a
// multiple of 2^l (2048 under ob1, 8 under UCX) share an MPI tag.
// That is harmless for collective sequence numbers, because both ranks issue one communicator's operations in the
// same order and MPI matches messages of one MPI tag in posting order (non-overtaking); it matters only for user
// tags >= 2^l sent and received in different orders. The map is deterministic, so FIFO per (peer, tag) holds as
// transport.h requires.
//
// Sizes: a message up to INT_MAX bytes is `count` MPI_BYTEs; a larger one uses a derived datatype (1 GiB blocks
// plus a remainder; every type made is owned by a handle, so an error between its creation and its release frees
// it), and MPI_Get_elements_x measures what arrived. A receive whose message is larger than expected fails as
// MPI_ERR_TRUNCATE, a smaller one is caught by the count: both are ProtocolErrors.
//
// Abort: see fail_all_locked (requests still in flight, sends included, get up to kAbortDrainSeconds to finish).
//
// Progress: no progress thread. Request::wait calls progress() (MPI_Test on every pending request, and on the
// abort listener) and wait_for_activity(), which spins ~20 us, yields until ~200 us, then sleeps with a growing
// pause (50 us to 1 ms) so that a rank waiting on a slow peer does not hold a core. progress() also reports
// requests that another thread completed, so no waiter sleeps through its own completion.
#include "net/mpi_transport.h"

#define OMPI_SKIP_MPICXX 1
#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>

#include "core/env.h"
#include "core/error.h"
#include "core/expiry.h"
#include "core/log.h"
#include "net/tags.h"
#include "net/wire.h"

namespace conduit::net {
namespace {

constexpr int kCtrlTag = 0;
constexpr int kCtrlMaxBytes = 4096;
// One transport's communicators: kDataComms for messages, then the one for abort notices.
constexpr int kTransportComms = kDataComms + 1;
// Destroyed transports whose communicators are kept (see "Stale messages" above): 16 x 65 context ids of OpenMPI's
// 65535, a few MB at most.
constexpr size_t kRetiredTransports = 16;
// How long an abort lets requests MPI is still moving data for finish before it fails them (fail_all_locked).
constexpr double kAbortDrainSeconds = 2.0;

// Set when the library provides less than MPI_THREAD_MULTIPLE: every MPI call then takes g_mpi_mu.
bool g_serialize = false;
std::recursive_mutex g_mpi_mu;  // recursive: a guarded section may call a helper that guards again

struct MpiGuard {
  std::unique_lock<std::recursive_mutex> lk;
  MpiGuard() {
    if (g_serialize) lk = std::unique_lock<std::recursive_mutex>(g_mpi_mu);
  }
};

// Bumped after requests complete (any engine). progress() reports "something moved" to a thread when the count
// changed since that thread last looked, so a waiter whose request was completed by another thread's progress()
// wakes up instead of sleeping until its deadline.
std::atomic<uint64_t> g_completions{0};
thread_local uint64_t t_seen_completions = 0;

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(buf, static_cast<size_t>(len));
}

int mpi_error_class(int rc) {
  int cls = rc;
  MPI_Error_class(rc, &cls);
  return cls;
}

void check_mpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) throw Error(fmt::format("{} failed: {}", what, mpi_error_string(rc)));
}

std::atomic<int> g_error_exit{0};

bool abandoned_settled();

void finalize_at_exit() {
  int init = 0;
  MPI_Initialized(&init);
  if (!init || mpi_finalized()) return;
  if (const int code = g_error_exit.load()) {
    std::fflush(nullptr);  // the error line first
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  // A collective given up on and still pending: MPI_Finalize would wait for it (for ever, if its rank is stuck).
  if (!abandoned_settled()) {
    std::fprintf(stderr,
                 "mpi: exiting with a collective on MPI_COMM_WORLD given up on at a deadline still pending: "
                 "MPI_Abort instead of MPI_Finalize\n");
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
}

// An MPI datatype this code made, freed (MPI_Type_free) when the handle goes, an exception passing included. Freeing
// right after the operation that uses it is posted is allowed: MPI keeps the type until the operation completes.
class OwnedType {
 public:
  OwnedType() = default;
  explicit OwnedType(MPI_Datatype t) : t_(t) {}
  OwnedType(OwnedType&& o) noexcept : t_(std::exchange(o.t_, MPI_DATATYPE_NULL)) {}
  OwnedType& operator=(OwnedType&& o) noexcept {
    if (this != &o) {
      release();
      t_ = std::exchange(o.t_, MPI_DATATYPE_NULL);
    }
    return *this;
  }
  OwnedType(const OwnedType&) = delete;
  OwnedType& operator=(const OwnedType&) = delete;
  ~OwnedType() { release(); }
  MPI_Datatype get() const { return t_; }
  MPI_Datatype* ptr() { return &t_; }  // for MPI_Type_commit

 private:
  void release() {
    if (t_ != MPI_DATATYPE_NULL && !mpi_finalized()) MPI_Type_free(&t_);
    t_ = MPI_DATATYPE_NULL;
  }
  MPI_Datatype t_ = MPI_DATATYPE_NULL;
};

// Wraps the type an MPI constructor made, or throws (the constructor made nothing then).
OwnedType owned_type(int rc, const MPI_Datatype& made, const char* what) {  // (read after the call that sets it)
  check_mpi(rc, what);
  return OwnedType(made);
}

// count + datatype for a contiguous byte buffer of any size; a derived type is owned by `derived` (keep the
// ByteType alive until the operation is posted, and destroy it under the MpiGuard that posted it).
struct ByteType {
  int count = 0;
  MPI_Datatype type = MPI_BYTE;
  OwnedType derived;
};

// Messages above kMaxCount bytes use a derived type of kBlock-byte blocks. Env CONDUIT_MPI_TEST_BLOCK_BYTES lowers
// both (a test hook, so that the derived-type path runs with small messages).
struct BlockSizes {
  size_t max_count = static_cast<size_t>(INT_MAX);
  size_t block = size_t{1} << 30;
};

const BlockSizes& block_sizes() {
  static const BlockSizes b = [] {
    BlockSizes v;
    if (auto n = env_int("CONDUIT_MPI_TEST_BLOCK_BYTES", 1, INT_MAX)) v.max_count = v.block = static_cast<size_t>(*n);
    return v;
  }();
  return b;
}

ByteType byte_type(size_t bytes) {
  ByteType bt;
  if (bytes <= block_sizes().max_count) {
    bt.count = static_cast<int>(bytes);
    return bt;
  }
  const size_t kBlock = block_sizes().block;
  size_t n = bytes / kBlock, rem = bytes % kBlock;
  if (n > static_cast<size_t>(INT_MAX))
    throw InvalidArgument(fmt::format("mpi transport: a message of {} bytes is too large; allowed: at most {} bytes",
                                      bytes, static_cast<size_t>(INT_MAX) * kBlock));
  MPI_Datatype made = MPI_DATATYPE_NULL;
  OwnedType block =
      owned_type(MPI_Type_contiguous(static_cast<int>(kBlock), MPI_BYTE, &made), made, "MPI_Type_contiguous");
  OwnedType blocks =
      owned_type(MPI_Type_contiguous(static_cast<int>(n), block.get(), &made), made, "MPI_Type_contiguous");
  if (rem == 0) {
    bt.derived = std::move(blocks);
  } else {
    int lens[2] = {1, static_cast<int>(rem)};
    MPI_Aint disp[2] = {0, static_cast<MPI_Aint>(n * kBlock)};
    MPI_Datatype types[2] = {blocks.get(), MPI_BYTE};
    bt.derived = owned_type(MPI_Type_create_struct(2, lens, disp, types, &made), made, "MPI_Type_create_struct");
  }
  check_mpi(MPI_Type_commit(bt.derived.ptr()), "MPI_Type_commit");
  bt.count = 1;
  bt.type = bt.derived.get();
  return bt;  // (block and blocks are freed here: a committed type keeps what it was built from)
}

// Collectives on MPI_COMM_WORLD given up on at a deadline, and the buffers MPI may still write for them: never
// freed, nor destroyed at exit. While one is pending the ranks' collectives on MPI_COMM_WORLD no longer line up.
struct Abandoned {
  std::mutex mu;
  std::vector<MPI_Request> reqs;
  std::vector<std::shared_ptr<void>> kept;
};
Abandoned& abandoned() {
  static auto* a = new Abandoned;
  return *a;
}
void abandon(MPI_Request req, std::shared_ptr<void> keep) {
  Abandoned& a = abandoned();
  std::lock_guard<std::mutex> lk(a.mu);
  a.reqs.push_back(req);
  a.kept.push_back(std::move(keep));
}
// Tests the abandoned collectives once (the caller holds the MpiGuard, or MPI is single-threaded); true when none is
// pending any more.
bool abandoned_settled() {
  Abandoned& a = abandoned();
  std::lock_guard<std::mutex> lk(a.mu);
  for (size_t i = 0; i < a.reqs.size();) {
    int flag = 0;
    if (MPI_Test(&a.reqs[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
      a.reqs[i] = a.reqs.back();
      a.reqs.pop_back();
    } else {
      ++i;
    }
  }
  return a.reqs.empty();
}
// Before a new collective on MPI_COMM_WORLD: one given up on earlier must have completed (the missing rank came
// late), or the new one would pair with it on the other ranks. Waits up to `deadline`, then refuses in one line.
void settle_abandoned(const Deadline& deadline) {
  auto pause = std::chrono::microseconds(50);
  while (true) {
    {
      MpiGuard g;
      if (abandoned_settled()) return;
    }
    if (deadline.expired())
      throw Error(
          "mpi: MPI_COMM_WORLD's collectives no longer line up: one given up on at an earlier deadline (a start-up "
          "timeout) has not completed; allowed: end the process after such a timeout (mpi_exit_after_error)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}
// The start-up's collectives of one process, one start-up at a time: two threads making transports (or exchanging
// strings) at once could start their collectives in different orders on different ranks and pair across. (Recursive:
// make_mpi_transport exchanges host names inside its own.)
std::recursive_mutex& startup_mu() {
  static auto* m = new std::recursive_mutex;
  return *m;
}

// Polls a nonblocking collective to completion. At `deadline` it is given up on: left pending with `keep` (the
// memory it reads and writes) and TimeoutError(timeout_message(seconds waited)) is thrown. MPI_Test is called under
// the MpiGuard, which is let go between looks; the looks yield for the first millisecond, then sleep 50 us growing
// to 1 ms.
void wait_collective(MPI_Request& req, const Deadline& deadline, const std::shared_ptr<void>& keep, const char* what,
                     const std::function<std::string(double)>& timeout_message) {
  Stopwatch sw;
  auto pause = std::chrono::microseconds(50);
  while (true) {
    int flag = 0, rc = MPI_SUCCESS;
    {
      MpiGuard g;
      rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    }
    check_mpi(rc, what);
    if (flag) return;
    if (deadline.expired()) {
      abandon(req, keep);
      throw TimeoutError(timeout_message(sw.seconds()));
    }
    if (sw.seconds() < 1e-3) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
}

// Keeps `comms` (one transport's) instead of freeing them; frees the oldest retired transport's beyond
// kRetiredTransports (see "Stale messages" above). Called with MPI not finalized.
void retire_comms(std::vector<MPI_Comm> comms) {
  // Oldest first; never destroyed (a transport may go after static destructors ran).
  static auto* mu = new std::mutex;
  static auto* retired = new std::deque<std::vector<MPI_Comm>>;
  MpiGuard g;  // (before mu: shutdown calls this holding the guard already)
  std::lock_guard<std::mutex> lk(*mu);
  retired->push_back(std::move(comms));
  while (retired->size() > kRetiredTransports) {
    for (MPI_Comm& c : retired->front())
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
    retired->pop_front();
  }
}

// The communicators of a new transport: kTransportComms duplicates of MPI_COMM_WORLD, each an MPI_Comm_idup polled
// against `deadline` (collective: every rank calls it). On any failure the ones made so far are retired.
std::vector<MPI_Comm> dup_world(const Deadline& deadline) {
  // (heap: an idup given up on writes its communicator here when the missing ranks come late)
  auto made = std::make_shared<std::array<MPI_Comm, kTransportComms>>();
  made->fill(MPI_COMM_NULL);
  int rank = 0, size = 1;
  {
    MpiGuard g;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  int done = 0;
  const Stopwatch started;
  try {
    for (; done < kTransportComms; ++done) {
      MPI_Request req = MPI_REQUEST_NULL;
      {
        MpiGuard g;
        check_mpi(MPI_Comm_idup(MPI_COMM_WORLD, &(*made)[done], &req), "MPI_Comm_idup");
      }
      const int step = done + 1;
      wait_collective(req, deadline, made, "MPI_Comm_idup (mpi transport start-up)", [&](double) {
        return fmt::format(
            "mpi transport (rank {} of {}): start-up gave up after {:.1f} s in MPI_Comm_idup {} of {} on "
            "MPI_COMM_WORLD: {}; allowed: every rank makes its MPI transport within the deadline (CONDUIT_TIMEOUT, "
            "default 300 s)",
            rank, size, started.seconds(), step, kTransportComms,
            step == 1 ? "not every rank entered make_mpi_transport (a rank died, is stuck before it, or makes no MPI "
                        "transport)"
                      : "a rank stopped taking part (it died, or is too slow)");
      });
      MpiGuard g;
      MPI_Comm_set_errhandler((*made)[done], MPI_ERRORS_RETURN);
    }
  } catch (...) {
    // Made ones carry no traffic, but another rank may have made more: kept like a destroyed transport's.
    if (done > 0) retire_comms(std::vector<MPI_Comm>(made->begin(), made->begin() + done));
    throw;
  }
  return std::vector<MPI_Comm>(made->begin(), made->end());
}

class MpiEngine;

class MpiRequest : public Request {
 public:
  MpiRequest(Kind kind, int peer, uint64_t tag, size_t bytes, std::shared_ptr<MpiEngine> engine)
      : Request(kind, peer, tag, bytes), engine_(std::move(engine)) {}
  MPI_Request req_ = MPI_REQUEST_NULL;
  MpiRoute route_{};
  // Taken off the pending list by progress() (under the engine's lock), completed or failed just after it.
  std::atomic<bool> finishing_{false};

 private:
  std::shared_ptr<MpiEngine> engine_;  // keeps the progressor alive as long as the request
};

// Owns the communicators and the pending requests; outlives the transport while requests reference it.
class MpiEngine : public Progressor {
 public:
  // `comms`: dup_world's, kDataComms for messages then the abort notices'; owned from here on (retired by shutdown).
  explicit MpiEngine(const std::vector<MPI_Comm>& comms) {
    std::copy(comms.begin(), comms.begin() + kDataComms, data_);
    ctrl_ = comms[kDataComms];
    MpiGuard g;
    MPI_Comm_rank(ctrl_, &rank_);
    MPI_Comm_size(ctrl_, &size_);
    void* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    tag_ub_ = flag ? *static_cast<int*>(ub) : 32767;
    const int rc = MPI_Irecv(ctrl_buf_, kCtrlMaxBytes, MPI_CHAR, MPI_ANY_SOURCE, kCtrlTag, ctrl_, &ctrl_req_);
    if (rc != MPI_SUCCESS) {
      retire_comms(comms);  // (the destructor does not run)
      check_mpi(rc, "MPI_Irecv (abort listener)");
    }
  }

  ~MpiEngine() override { shutdown(); }

  int rank() const { return rank_; }
  int size() const { return size_; }

  void set_abort_callback(std::function<void(const std::string&)> cb) {
    std::lock_guard<std::mutex> lk(mu_);
    on_abort_ = std::move(cb);
  }

  RequestPtr post(Request::Kind kind, int peer, uint64_t tag, void* data, size_t bytes,
                  const std::shared_ptr<MpiEngine>& self) {
    const char* what = kind == Request::Kind::send ? "isend" : "irecv";
    if (peer < 0 || peer >= size_) {
      throw InvalidArgument(
          fmt::format("mpi transport: {} to rank {} is invalid: expected 0 <= peer < {}", what, peer, size_));
    }
    check_tag("mpi transport", what, tag);
    if (bytes > 0 && data == nullptr) {
      throw InvalidArgument(fmt::format("mpi transport: {} of {} bytes with a null buffer", what, bytes));
    }
    if (kind == Request::Kind::send) check_message_size(bytes, max_message_bytes());  // as tcp and shm do
    auto r = std::make_shared<MpiRequest>(kind, peer, tag, bytes, self);
    r->set_progressor(this);
    std::exception_ptr err;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!aborted_.empty()) {
        err =
            std::make_exception_ptr(PeerError(fmt::format("mpi transport (rank {}): {} rank {} tag {:#x} refused: "
                                                          "the transport was aborted: {}",
                                                          rank_, what, peer, tag, aborted_)));
      } else {
        MpiRoute route = mpi_route_for(tag, tag_ub_);
        r->route_ = route;
        // Two different Conduit tags folded onto one MPI tag can only be told apart by posting order; while both
        // are outstanding with the same peer, MPI may match either message to either request and swap their data
        // silently. Refuse the second instead (see the folding above: user tags 2^l apart, e.g. more than 64
        // parameter-server shards on one rank). Best effort: only this rank's outstanding requests are seen (a send
        // already completed eagerly can still meet a folded receive at the other end).
        for (const auto& q : pending_)
          if (q->kind() == kind && q->peer() == peer && q->tag() != tag && q->route_.comm == route.comm &&
              q->route_.tag == route.tag)
            throw ProtocolError(fmt::format(
                "mpi transport (rank {}): {} rank {} tag {:#x} folds onto the MPI tag of the outstanding tag {:#x} "
                "(MPI tags hold {} bits of a Conduit tag's low 32; allowed: tags of one communicator that differ "
                "below bit {} while both are in flight)",
                rank_, what, peer, tag, q->tag(), mpi_route_low_bits(tag_ub_), mpi_route_low_bits(tag_ub_)));
        MpiGuard g;
        const ByteType bt = byte_type(bytes);  // (freed before g lets go)
        MPI_Comm comm = data_[route.comm];
        int rc = kind == Request::Kind::send ? MPI_Isend(data, bt.count, bt.type, peer, route.tag, comm, &r->req_)
                                             : MPI_Irecv(data, bt.count, bt.type, peer, route.tag, comm, &r->req_);
        if (rc != MPI_SUCCESS) {
          err =
              std::make_exception_ptr(PeerError(fmt::format("mpi transport (rank {}): {} of {} bytes, rank {} tag "
                                                            "{:#x}: {}",
                                                            rank_, what, bytes, peer, tag, mpi_error_string(rc))));
        } else {
          pending_.push_back(r);
        }
      }
    }
    if (err) r->fail(err);
    return r;
  }

  bool progress() override {
    std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>> finished;
    std::string remote_abort;
    int remote_abort_rank = -1;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_) return false;
      MpiGuard g;
      if (ctrl_req_ != MPI_REQUEST_NULL) {
        int flag = 0;
        MPI_Status st;
        int rc = MPI_Test(&ctrl_req_, &flag, &st);
        if (rc == MPI_SUCCESS && flag) {
          int n = 0;
          MPI_Get_count(&st, MPI_CHAR, &n);
          remote_abort =
              fmt::format("rank {} aborted: {}", st.MPI_SOURCE,
                          printable_reason(std::string_view(ctrl_buf_, static_cast<size_t>(std::max(n, 0)))));
          remote_abort_rank = st.MPI_SOURCE;
          if (aborted_.empty()) aborted_ = remote_abort;
          ctrl_req_ = MPI_REQUEST_NULL;
        } else if (rc != MPI_SUCCESS) {
          CONDUIT_LOG_WARN("mpi transport (rank {}): the abort listener failed: {}", rank_, mpi_error_string(rc));
          ctrl_req_ = MPI_REQUEST_NULL;
        }
      }
      if (!remote_abort.empty()) {
        fail_all_locked(remote_abort, finished, remote_abort_rank);
      } else {
        for (size_t i = 0; i < pending_.size();) {
          auto& r = pending_[i];
          int flag = 0;
          MPI_Status st;
          int rc = MPI_Test(&r->req_, &flag, &st);
          if (rc == MPI_SUCCESS && !flag) {
            ++i;
            continue;
          }
          finished.emplace_back(r, rc == MPI_SUCCESS ? check_size(*r, st) : error_for(*r, rc));
          r->req_ = MPI_REQUEST_NULL;
          r->finishing_ = true;
          pending_[i] = std::move(pending_.back());
          pending_.pop_back();
        }
      }
      if (!remote_abort.empty() && on_abort_) on_abort_(remote_abort);
      reap_locked();
    }
    finish(finished);
    uint64_t now = g_completions.load(std::memory_order_acquire);
    bool others = now != t_seen_completions;
    t_seen_completions = now;
    return !finished.empty() || !remote_abort.empty() || others;
  }

  // Spin ~20 us (a reply from a busy peer often lands within that), yield until ~200 us (lets another rank on an
  // oversubscribed core run), then sleep with a pause growing from 50 us to 1 ms.
  void wait_for_activity(const Deadline& until) override {
    Stopwatch sw;
    while (sw.seconds() < 20e-6) {
      if (progress() || until.expired()) return;
    }
    while (sw.seconds() < 200e-6) {
      std::this_thread::yield();
      if (progress() || until.expired()) return;
    }
    auto pause = std::chrono::microseconds(50);
    while (!until.expired()) {
      // (clamped before the cast: Deadline::never()'s 1e18 s overflowed the microseconds to a negative sleep, and a
      // wait without a deadline spun a core)
      std::this_thread::sleep_for(until.remaining_at_most(pause));
      if (progress()) return;
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }

  // Withdraws a receive MPI has not matched yet (MPI_Cancel, then its completion, which for an unmatched receive
  // comes at once). A matched receive completes instead (its message is arriving; up to one second is given to it)
  // and is finished as usual. Sends are not withdrawn: MPI cannot reliably cancel them.
  bool cancel(const RequestPtr& req, std::exception_ptr error) {
    if (req->kind() != Request::Kind::recv) return false;
    Finished finished;
    bool cancelled = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (shut_ || mpi_finalized()) return false;
      auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& q) { return q.get() == req.get(); });
      if (it == pending_.end()) {
        // Finished by another thread's progress() that has not completed it yet: give_up, seeing it neither
        // withdrawn nor done, aborted the whole job over a request that succeeded. Its completion comes next.
        const auto* mine = dynamic_cast<const MpiRequest*>(req.get());
        if (mine == nullptr || !mine->finishing_) return false;
        lk.unlock();
        const Deadline until = Deadline::after(1.0);
        while (!req->done() && !until.expired()) std::this_thread::yield();
        return false;
      }
      std::shared_ptr<MpiRequest> r = *it;
      MpiGuard g;
      MPI_Cancel(&r->req_);
      MPI_Status st;
      int flag = 0, rc = MPI_SUCCESS;
      const Deadline until = Deadline::after(1.0);
      while (rc == MPI_SUCCESS && !flag) {
        rc = MPI_Test(&r->req_, &flag, &st);
        if (!flag && until.expired()) return false;  // still moving: the caller aborts
      }
      int was_cancelled = 0;
      if (rc == MPI_SUCCESS) MPI_Test_cancelled(&st, &was_cancelled);
      cancelled = rc == MPI_SUCCESS && was_cancelled != 0;
      r->req_ = MPI_REQUEST_NULL;
      pending_.erase(it);
      finished.emplace_back(r, cancelled ? error : rc == MPI_SUCCESS ? check_size(*r, st) : error_for(*r, rc));
    }
    finish(finished);
    return cancelled;
  }

  // Fails everything pending, tells every peer (best effort), refuses later requests.
  void abort(const std::string& reason) {
    std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>> finished;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_ || !aborted_.empty()) return;
      aborted_ = reason;
      if (!mpi_finalized()) {
        MpiGuard g;
        abort_msg_ = reason.substr(0, kCtrlMaxBytes);
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          MPI_Request q = MPI_REQUEST_NULL;
          int rc = MPI_Isend(abort_msg_.data(), static_cast<int>(abort_msg_.size()), MPI_CHAR, p, kCtrlTag, ctrl_, &q);
          if (rc == MPI_SUCCESS) {
            ctrl_sends_.push_back(q);
          } else {
            CONDUIT_LOG_WARN("mpi transport (rank {}): could not tell rank {} about the abort: {}", rank_, p,
                             mpi_error_string(rc));
          }
        }
      }
      fail_all_locked(fmt::format("mpi transport (rank {}) aborted: {}", rank_, reason), finished);
    }
    finish(finished);
  }

  // Called by the transport's destructor: no MPI call happens after this one.
  void shutdown() {
    std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>> finished;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (shut_) return;
      on_abort_ = nullptr;
      fail_all_locked(fmt::format("mpi transport (rank {}) was destroyed", rank_), finished);
      shut_ = true;
      if (!mpi_finalized()) {
        MpiGuard g;
        if (ctrl_req_ != MPI_REQUEST_NULL) {
          MPI_Cancel(&ctrl_req_);
          MPI_Wait(&ctrl_req_, MPI_STATUS_IGNORE);  // a cancelled (or already matched, small) receive completes
        }
        // Give abort notices a moment to leave, then let go of whatever is still in flight.
        Stopwatch sw;
        while (sw.seconds() < 0.2) {
          if (reap_locked()) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        for (MPI_Request& q : zombies_) {
          MPI_Cancel(&q);
          MPI_Request_free(&q);
        }
        for (MPI_Request& q : ctrl_sends_) MPI_Request_free(&q);
        zombies_.clear();
        ctrl_sends_.clear();
        // Retired, not freed: a message still on its way to them must not meet a later transport (see "Stale
        // messages" above).
        std::vector<MPI_Comm> comms(data_, data_ + kDataComms);
        comms.push_back(ctrl_);
        retire_comms(std::move(comms));
      }
    }
    finish(finished);
  }

 private:
  using Finished = std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>>;

  // Completes or fails requests taken off the pending list (outside the lock), then bumps the completion count.
  static void finish(Finished& finished) {
    if (finished.empty()) return;
    for (auto& [r, e] : finished) {
      if (e) {
        r->fail(e);
      } else {
        r->complete();
      }
    }
    g_completions.fetch_add(1, std::memory_order_acq_rel);
  }

  std::exception_ptr check_size(const MpiRequest& r, const MPI_Status& st) {
    if (r.kind() != Request::Kind::recv) return nullptr;
    MPI_Count got = 0;
    MPI_Get_elements_x(&st, MPI_BYTE, &got);
    if (got == static_cast<MPI_Count>(r.bytes())) return nullptr;
    return std::make_exception_ptr(ProtocolError(fmt::format(
        "mpi transport (rank {}): message from rank {} with tag {:#x} has {} bytes but the receive expects {} "
        "(the ranks disagree on the message size)",
        rank_, r.peer(), r.tag(), static_cast<long long>(got), r.bytes())));
  }

  std::exception_ptr error_for(const MpiRequest& r, int rc) {
    const char* what = r.kind() == Request::Kind::send ? "send to" : "receive from";
    if (mpi_error_class(rc) == MPI_ERR_TRUNCATE) {
      return std::make_exception_ptr(ProtocolError(fmt::format(
          "mpi transport (rank {}): message from rank {} with tag {:#x} is larger than the {} bytes the receive "
          "expects (the ranks disagree on the message size)",
          rank_, r.peer(), r.tag(), r.bytes())));
    }
    return std::make_exception_ptr(
        PeerError(fmt::format("mpi transport (rank {}): {} rank {} (tag {:#x}, {} bytes) "
                              "failed: {}",
                              rank_, what, r.peer(), r.tag(), r.bytes(), mpi_error_string(rc))));
  }

  // MPI keeps using a request's buffer after its caller has been told it failed, and the caller frees or reuses the
  // buffer as it unwinds: a receive MPI already matched cannot be cancelled (its data keeps arriving: heap
  // corruption), and a send may still be read (the rest of a large message leaves as the receiver asks for it: the
  // peer gets the reused bytes, or the sender faults on memory given back). So receives are cancelled (the unmatched
  // ones complete at once), and every request still in flight, sends included, gets up to kAbortDrainSeconds in all
  // to finish before all are failed (a send its receiver never takes costs the whole bound: MPI cannot withdraw a
  // send). A send still pending then is one its receiver has not taken (it died, or cancelled the receive on the
  // abort notice): its buffer is read again only if that peer posts the matching receive later, before it has seen
  // the notice (after that its transport refuses receives, and a destroyed transport's retired communicators never
  // take one); transport.h states that residue. Sends to the rank whose abort notice this is (`aborted_by`) are not
  // waited for: it cancels its receives as it aborts, so they would only cost the whole bound.
  void fail_all_locked(const std::string& why,
                       std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>>& out,
                       int aborted_by = -1) {
    bool can_call = !mpi_finalized();
    if (can_call) {
      std::vector<MPI_Request*> moving;
      {
        MpiGuard g;
        for (auto& r : pending_)
          if (r->req_ != MPI_REQUEST_NULL) {
            const bool send = r->kind() == Request::Kind::send;
            if (!send) MPI_Cancel(&r->req_);
            if (!send || r->peer() != aborted_by) moving.push_back(&r->req_);
          }
      }
      Stopwatch sw;
      while (!moving.empty() && sw.seconds() < kAbortDrainSeconds) {
        {
          MpiGuard g;
          for (size_t i = 0; i < moving.size();) {
            int flag = 0;
            if (MPI_Test(moving[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
              moving[i] = moving.back();  // (MPI_Test set a completed request to MPI_REQUEST_NULL)
              moving.pop_back();
            } else {
              ++i;
            }
          }
        }
        if (!moving.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    for (auto& r : pending_) {
      if (can_call && r->req_ != MPI_REQUEST_NULL) {
        zombies_.push_back(r->req_);
        r->req_ = MPI_REQUEST_NULL;
      }
      r->finishing_ = true;
      out.emplace_back(
          r, std::make_exception_ptr(PeerError(fmt::format(
                 "{} ({} rank {}, tag {:#x}, {} bytes)", why,
                 r->kind() == Request::Kind::send ? "send to" : "receive from", r->peer(), r->tag(), r->bytes()))));
    }
    pending_.clear();
  }

  // Tests abandoned requests (cancelled receives, sends of an aborted job, abort notices); true when none is left.
  bool reap_locked() {
    auto test_list = [](std::vector<MPI_Request>& v) {
      for (size_t i = 0; i < v.size();) {
        int flag = 0;
        int rc = MPI_Test(&v[i], &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || flag) {
          v[i] = v.back();
          v.pop_back();
        } else {
          ++i;
        }
      }
    };
    if (zombies_.empty() && ctrl_sends_.empty()) return true;
    MpiGuard g;
    test_list(zombies_);
    test_list(ctrl_sends_);
    return zombies_.empty() && ctrl_sends_.empty();
  }

  MPI_Comm data_[kDataComms];
  MPI_Comm ctrl_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  std::mutex mu_;
  std::vector<std::shared_ptr<MpiRequest>> pending_;
  std::vector<MPI_Request> zombies_, ctrl_sends_;
  MPI_Request ctrl_req_ = MPI_REQUEST_NULL;
  char ctrl_buf_[kCtrlMaxBytes];
  std::string abort_msg_;
  std::string aborted_;
  bool shut_ = false;
  std::function<void(const std::string&)> on_abort_;
};

class MpiTransport : public Transport {
 public:
  MpiTransport(std::vector<int> hosts, const std::vector<MPI_Comm>& comms)
      : engine_(std::make_shared<MpiEngine>(comms)) {
    rank_ = engine_->rank();
    size_ = engine_->size();
    hosts_ = std::move(hosts);
    engine_->set_abort_callback([this](const std::string& why) { set_aborted(why); });
  }
  ~MpiTransport() override { engine_->shutdown(); }

  const char* name() const override { return "mpi"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return engine_->post(Request::Kind::send, peer, tag, const_cast<void*>(data), bytes, engine_);
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return engine_->post(Request::Kind::recv, peer, tag, data, bytes, engine_);
  }
  void abort(const std::string& reason) override {
    set_aborted(reason);
    engine_->abort(reason.empty() ? "aborted" : reason);
  }
  bool cancel(const RequestPtr& r, std::exception_ptr error) override { return engine_->cancel(r, std::move(error)); }

 private:
  std::shared_ptr<MpiEngine> engine_;
};

}  // namespace

int mpi_route_low_bits(int tag_ub) {
  int bits = 0;
  while (bits < 31 && (static_cast<uint64_t>(1) << (bits + 1)) - 1 <= static_cast<uint64_t>(tag_ub)) ++bits;
  const int r = bits - 2;
  // The whole communicator id (18 bits beside the 6 that pick the MPI communicator) whenever the tag has room for
  // it and 3 low bits: OpenMPI's ob1 (MPI_TAG_UB 2^31 - 1) keeps 11 low bits, its UCX layer (2^23 - 1) 3. (29 was
  // the bound: under UCX ids 2^20 apart, a host group's and a split's, shared a route.)
  return r >= 21 ? r - 18 : r / 3;
}

MpiRoute mpi_route_for(uint64_t tag, int tag_ub) {
  int bits = 0;
  while (bits < 31 && (static_cast<uint64_t>(1) << (bits + 1)) - 1 <= static_cast<uint64_t>(tag_ub)) ++bits;
  const int r = bits - 2;
  const int l = mpi_route_low_bits(tag_ub), t = r - l;
  const uint64_t kind = (tag_kind(tag) - 1u) & 3u;
  const uint64_t comm = (tag >> 32) & 0xffffffu;
  const uint64_t low = tag & 0xffffffffu;
  const uint64_t m = (kind << r) | (((comm >> 6) & ((uint64_t{1} << t) - 1)) << l) | (low & ((uint64_t{1} << l) - 1));
  return {static_cast<int>(comm % kDataComms), static_cast<int>(m)};
}

bool mpi_launched() {
  // torchrun's workers inherit the variables of an MPI launcher that started torchrun itself (`srun --mpi=pmix
  // torchrun ...`: Slurm sets PMIX_RANK, not PMIX_SIZE): they are torchrun's ranks, by RANK and WORLD_SIZE (each
  // ran as MPI's "rank 0 of 1", a job of 2 split into two of 1 that both succeeded).
  if (const char* t = std::getenv("TORCHELASTIC_RUN_ID"); t != nullptr && *t != '\0') return false;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && *s != '\0') return true;
  }
  return false;
}

// Ends the process when MPI_Init_thread has not returned within `seconds` (CONDUIT_TIMEOUT): it waits for every rank
// of the job, and a rank that never starts MPI (killed, stuck before it, a program that is not an MPI one) left the
// others there with no word.
[[noreturn]] void stop_at_init_deadline(double seconds) {
  const char* rank = nullptr;
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (!rank) rank = std::getenv(v);
  std::fprintf(stderr,
               "conduit: error: mpi: MPI_Init_thread did not return within %g s on rank %s: a rank of this job has "
               "not started MPI (gone, stuck before it, or not an MPI program); allowed: every rank starting MPI "
               "within CONDUIT_TIMEOUT\n",
               seconds, rank ? rank : "?");
  std::fflush(stderr);
  ::_exit(2);
}

void mpi_init_once(double timeout_s) {
  static std::once_flag once;
  std::call_once(once, [timeout_s] {
    int init = 0;
    MPI_Initialized(&init);
    int provided = MPI_THREAD_SINGLE;
    if (init) {
      if (mpi_finalized()) throw Error("mpi transport: MPI was already finalized in this process");
      MPI_Query_thread(&provided);
    } else {
      {
        const ExpiryThread watchdog(timeout_s, [timeout_s] { stop_at_init_deadline(timeout_s); });
        check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
      }
      std::atexit(finalize_at_exit);
    }
    // Conduit calls MPI from its communicators' worker threads (and parameter-server and gossip threads): below
    // SERIALIZED that is not allowed whatever lock serializes the calls (it was a warning).
    if (provided < MPI_THREAD_SERIALIZED)
      throw ConfigError(fmt::format(
          "mpi transport: MPI runs at thread level {} ({}), but Conduit calls MPI from its communicators' worker "
          "threads; allowed: MPI_THREAD_SERIALIZED ({}) or MPI_THREAD_MULTIPLE ({}) (MPI_Init_thread, or let Conduit "
          "initialize MPI)",
          provided, provided == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "MPI_THREAD_FUNNELED", MPI_THREAD_SERIALIZED,
          MPI_THREAD_MULTIPLE));
    if (env_flag("CONDUIT_MPI_SERIALIZE")) {  // tests the fallback path on a library that provides MULTIPLE
      g_serialize = true;
      CONDUIT_LOG_INFO("mpi: CONDUIT_MPI_SERIALIZE=1: serializing every MPI call with one lock");
    } else if (provided < MPI_THREAD_MULTIPLE) {
      g_serialize = true;
      CONDUIT_LOG_WARN(
          "mpi: the MPI library provides thread level {} (MPI_THREAD_SERIALIZED, < MPI_THREAD_MULTIPLE = {}); "
          "Conduit serializes its MPI calls with one lock",
          provided, MPI_THREAD_MULTIPLE);
    }
  });
}

// The first of the launcher's variables `vars` that holds a whole number other than MPI's `value`: its name and number.
static std::optional<std::pair<const char*, long>> launcher_disagrees(std::initializer_list<const char*> vars,
                                                                      int value) {
  for (const char* v : vars) {
    const char* e = std::getenv(v);
    if (e == nullptr || *e == '\0') continue;
    char* end = nullptr;
    const long declared = std::strtol(e, &end, 10);
    if (*end == '\0' && declared != value) return std::pair{v, declared};
  }
  return std::nullopt;
}

int mpi_world_rank() {
  mpi_init_once();
  int r = 0, n = 1;
  {
    MpiGuard g;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
  }
  // The launcher's rank must be MPI's too: PMI_RANK or PMIX_RANK without a size (which mpi_world_size checks) from a
  // launcher this library does not speak made every process a singleton, "rank 0 of 1", whatever it was given.
  if (auto d = launcher_disagrees({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}, r))
    throw ConfigError(fmt::format(
        "mpi: the launcher made this process rank {} ({}={}) but this MPI library's world makes it rank {} of {}: "
        "the launcher is not this library's, or {} was inherited from another launch; allowed: the mpirun of the MPI "
        "Conduit was built with, or {} unset to meet by RANK and WORLD_SIZE",
        d->second, d->first, d->second, r, n, d->first, d->first));
  return r;
}

void mpi_exit_after_error(int code) { g_error_exit.store(code != 0 ? code : 1); }

int mpi_world_size() {
  mpi_init_once();
  int n = 1;
  {
    MpiGuard g;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
  }
  // The launcher's own count must be MPI's: an mpiexec of another MPI (MPICH's Hydra, srun's PMI2 with an OpenMPI
  // build) starts processes this library sees as singletons, and each ran alone as "rank 0 of 1".
  if (auto d = launcher_disagrees({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}, n))
    throw ConfigError(fmt::format(
        "mpi: the launcher started {} ranks ({}={}) but this MPI library's world has {}: the launcher is not "
        "this library's (e.g. another MPI's mpiexec); allowed: the mpirun of the MPI Conduit was built with",
        d->second, d->first, d->second, n));
  return n;
}

std::vector<std::string> mpi_allgather_strings(const std::string& mine) {
  return mpi_allgather_strings(mine, Deadline::after(default_timeout_seconds()));
}

std::vector<std::string> mpi_allgather_strings(const std::string& mine, const Deadline& deadline) {
  mpi_init_once();
  std::lock_guard<std::recursive_mutex> one_at_a_time(startup_mu());
  settle_abandoned(deadline);
  if (mine.size() > static_cast<size_t>(INT_MAX / 1024)) {
    throw InvalidArgument(fmt::format("mpi_allgather_strings: a string of {} bytes is too large; allowed: at most {}",
                                      mine.size(), INT_MAX / 1024));
  }
  // Everything the two collectives read or write, kept by wait_collective if one is given up on.
  struct Exchange {
    int len = 0;
    std::string mine, all;
    std::vector<int> lens, displs;
  };
  auto x = std::make_shared<Exchange>();
  int rank = 0, size = 1;
  {
    MpiGuard g;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  x->mine = mine;
  x->len = static_cast<int>(mine.size());
  x->lens.assign(static_cast<size_t>(size), 0);
  x->displs.assign(static_cast<size_t>(size), 0);
  auto timed_out = [&](const char* step) {
    return [&, step](double waited) {
      return fmt::format(
          "mpi_allgather_strings (rank {} of {}): gave up after {:.1f} s in {} on MPI_COMM_WORLD: not every rank "
          "reached this exchange (a rank died or is stuck before it); allowed: every rank within the deadline "
          "(CONDUIT_TIMEOUT, default 300 s)",
          rank, size, waited, step);
    };
  };
  MPI_Request req = MPI_REQUEST_NULL;
  {
    MpiGuard g;
    check_mpi(MPI_Iallgather(&x->len, 1, MPI_INT, x->lens.data(), 1, MPI_INT, MPI_COMM_WORLD, &req), "MPI_Iallgather");
  }
  wait_collective(req, deadline, x, "MPI_Iallgather", timed_out("MPI_Iallgather"));
  long long total = 0;
  for (int i = 0; i < size; ++i) {
    x->displs[i] = static_cast<int>(total);
    total += x->lens[i];
    if (x->lens[i] < 0 || total > INT_MAX) throw ProtocolError("mpi_allgather_strings: invalid lengths from peers");
  }
  x->all.assign(static_cast<size_t>(total), '\0');
  {
    MpiGuard g;
    check_mpi(MPI_Iallgatherv(x->mine.data(), x->len, MPI_CHAR, x->all.data(), x->lens.data(), x->displs.data(),
                              MPI_CHAR, MPI_COMM_WORLD, &req),
              "MPI_Iallgatherv");
  }
  wait_collective(req, deadline, x, "MPI_Iallgatherv", timed_out("MPI_Iallgatherv"));
  std::vector<std::string> out(size);
  for (int i = 0; i < size; ++i) out[i] = x->all.substr(x->displs[i], x->lens[i]);
  return out;
}

TransportPtr make_mpi_transport(std::vector<int> hosts) {
  return make_mpi_transport(std::move(hosts), Deadline::after(default_timeout_seconds()));
}

TransportPtr make_mpi_transport(std::vector<int> hosts, const Deadline& deadline) {
  mpi_init_once();
  std::lock_guard<std::recursive_mutex> one_at_a_time(startup_mu());
  settle_abandoned(deadline);
  int size = mpi_world_size();
  if (hosts.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    auto names = mpi_allgather_strings(name, deadline);
    std::unordered_map<std::string, int> index;
    for (const auto& n : names) {
      auto it = index.emplace(n, static_cast<int>(index.size())).first;
      hosts.push_back(it->second);
    }
  }
  if (static_cast<int>(hosts.size()) != size) {
    throw InvalidArgument(
        fmt::format("make_mpi_transport: {} host indices for {} ranks (expected one per rank)", hosts.size(), size));
  }
  return std::make_shared<MpiTransport>(std::move(hosts), dup_world(deadline));
}

}  // namespace conduit::net
