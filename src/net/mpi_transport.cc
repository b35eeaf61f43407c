// OpenMPI transport.
//
// Communicators: duplicates of MPI_COMM_WORLD, all with MPI_ERRORS_RETURN so that errors come back as codes (and
// become Conduit exceptions) instead of killing the job: kDataComms (64) carry messages, one more carries abort
// notices (every rank keeps one MPI_Irecv(MPI_ANY_SOURCE) posted on it; abort() sends its reason to every peer).
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
// plus a remainder), and MPI_Get_elements_x measures what arrived. A receive whose message is larger than expected
// fails as MPI_ERR_TRUNCATE, a smaller one is caught by the count: both are ProtocolErrors.
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
#include <atomic>
#include <climits>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "net/tags.h"
#include "net/wire.h"

namespace conduit::net {
namespace {

constexpr int kCtrlTag = 0;
constexpr int kCtrlMaxBytes = 4096;

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

void finalize_at_exit() {
  int init = 0;
  MPI_Initialized(&init);
  if (!init || mpi_finalized()) return;
  if (const int code = g_error_exit.load()) {
    std::fflush(nullptr);  // the error line first
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  MPI_Finalize();
}

// count + datatype for a contiguous byte buffer of any size. `owned` types must be freed by the caller (allowed
// right after the operation is posted).
struct ByteType {
  int count;
  MPI_Datatype type;
  bool owned;
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
  if (bytes <= block_sizes().max_count) return {static_cast<int>(bytes), MPI_BYTE, false};
  const size_t kBlock = block_sizes().block;
  MPI_Datatype block, blocks, whole;
  size_t n = bytes / kBlock, rem = bytes % kBlock;
  if (n > static_cast<size_t>(INT_MAX))
    throw InvalidArgument(fmt::format("mpi transport: {} bytes is too large", bytes));
  check_mpi(MPI_Type_contiguous(static_cast<int>(kBlock), MPI_BYTE, &block), "MPI_Type_contiguous");
  check_mpi(MPI_Type_contiguous(static_cast<int>(n), block, &blocks), "MPI_Type_contiguous");
  MPI_Type_free(&block);
  if (rem == 0) {
    whole = blocks;
  } else {
    int lens[2] = {1, static_cast<int>(rem)};
    MPI_Aint disp[2] = {0, static_cast<MPI_Aint>(n * kBlock)};
    MPI_Datatype types[2] = {blocks, MPI_BYTE};
    check_mpi(MPI_Type_create_struct(2, lens, disp, types, &whole), "MPI_Type_create_struct");
    MPI_Type_free(&blocks);
  }
  check_mpi(MPI_Type_commit(&whole), "MPI_Type_commit");
  return {1, whole, true};
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
  MpiEngine() {
    MpiGuard g;
    for (auto& c : data_) {
      check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &c), "MPI_Comm_dup");
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &ctrl_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(ctrl_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ctrl_, &rank_);
    MPI_Comm_size(ctrl_, &size_);
    void* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    tag_ub_ = flag ? *static_cast<int*>(ub) : 32767;
    check_mpi(MPI_Irecv(ctrl_buf_, kCtrlMaxBytes, MPI_CHAR, MPI_ANY_SOURCE, kCtrlTag, ctrl_, &ctrl_req_),
              "MPI_Irecv (abort listener)");
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
    if (!tag_valid(tag)) {
      throw InvalidArgument(
          fmt::format("mpi transport: {} with tag {:#x} is invalid: its kind byte must be 1..4 "
                      "(see net/tags.h)",
                      what, tag));
    }
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
        ByteType bt = byte_type(bytes);
        MPI_Comm comm = data_[route.comm];
        int rc = kind == Request::Kind::send ? MPI_Isend(data, bt.count, bt.type, peer, route.tag, comm, &r->req_)
                                             : MPI_Irecv(data, bt.count, bt.type, peer, route.tag, comm, &r->req_);
        if (bt.owned) MPI_Type_free(&bt.type);
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
          remote_abort = fmt::format("rank {} aborted: {}", st.MPI_SOURCE,
                                     std::string(ctrl_buf_, static_cast<size_t>(std::max(n, 0))));
          if (aborted_.empty()) aborted_ = remote_abort;
          ctrl_req_ = MPI_REQUEST_NULL;
        } else if (rc != MPI_SUCCESS) {
          CONDUIT_LOG_WARN("mpi transport (rank {}): the abort listener failed: {}", rank_, mpi_error_string(rc));
          ctrl_req_ = MPI_REQUEST_NULL;
        }
      }
      if (!remote_abort.empty()) {
        fail_all_locked(remote_abort, finished);
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
      auto left = std::chrono::duration_cast<std::chrono::microseconds>(
          Seconds(std::clamp(until.remaining_seconds(), 0.0, 1.0)));
      std::this_thread::sleep_for(std::min(pause, left));
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
        for (auto& c : data_) MPI_Comm_free(&c);
        MPI_Comm_free(&ctrl_);
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

  void fail_all_locked(const std::string& why,
                       std::vector<std::pair<std::shared_ptr<MpiRequest>, std::exception_ptr>>& out) {
    bool can_call = !mpi_finalized();
    // A receive MPI had already matched cannot be cancelled: its data keeps arriving into the buffer, which the
    // failed caller frees as it unwinds (heap corruption). Such receives are given a bounded time to finish first;
    // the cancelled ones complete at once.
    if (can_call) {
      std::vector<MPI_Request*> recvs;
      {
        MpiGuard g;
        for (auto& r : pending_)
          if (r->req_ != MPI_REQUEST_NULL && r->kind() == Request::Kind::recv) {
            MPI_Cancel(&r->req_);
            recvs.push_back(&r->req_);
          }
      }
      Stopwatch sw;
      while (!recvs.empty() && sw.seconds() < 2.0) {
        {
          MpiGuard g;
          for (size_t i = 0; i < recvs.size();) {
            int flag = 0;
            if (MPI_Test(recvs[i], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
              recvs[i] = recvs.back();  // (MPI_Test set a completed request to MPI_REQUEST_NULL)
              recvs.pop_back();
            } else {
              ++i;
            }
          }
        }
        if (!recvs.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
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
  explicit MpiTransport(std::vector<int> hosts) : engine_(std::make_shared<MpiEngine>()) {
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
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && *s != '\0') return true;
  }
  return false;
}

void mpi_init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    int init = 0;
    MPI_Initialized(&init);
    int provided = MPI_THREAD_SINGLE;
    if (init) {
      if (mpi_finalized()) throw Error("mpi transport: MPI was already finalized in this process");
      MPI_Query_thread(&provided);
    } else {
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
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

int mpi_world_rank() {
  mpi_init_once();
  int r = 0;
  MpiGuard g;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
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
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* e = std::getenv(v);
    if (e == nullptr || *e == '\0') continue;
    char* end = nullptr;
    const long declared = std::strtol(e, &end, 10);
    if (*end == '\0' && declared != n)
      throw ConfigError(fmt::format(
          "mpi: the launcher started {} ranks ({}={}) but this MPI library's world has {}: the launcher is not "
          "this library's (e.g. another MPI's mpiexec); allowed: the mpirun of the MPI Conduit was built with",
          declared, v, e, n));
  }
  return n;
}

std::vector<std::string> mpi_allgather_strings(const std::string& mine) {
  mpi_init_once();
  if (mine.size() > static_cast<size_t>(INT_MAX / 1024)) {
    throw InvalidArgument(fmt::format("mpi_allgather_strings: {} bytes is too large", mine.size()));
  }
  MpiGuard g;
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(size), displs(size);
  check_mpi(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, MPI_COMM_WORLD), "MPI_Allgather");
  long long total = 0;
  for (int i = 0; i < size; ++i) {
    displs[i] = static_cast<int>(total);
    total += lens[i];
    if (lens[i] < 0 || total > INT_MAX) throw ProtocolError("mpi_allgather_strings: invalid lengths from peers");
  }
  std::string all(static_cast<size_t>(total), '\0');
  check_mpi(
      MPI_Allgatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, MPI_COMM_WORLD),
      "MPI_Allgatherv");
  std::vector<std::string> out(size);
  for (int i = 0; i < size; ++i) out[i] = all.substr(displs[i], lens[i]);
  return out;
}

TransportPtr make_mpi_transport(std::vector<int> hosts) {
  mpi_init_once();
  int size = mpi_world_size();
  if (hosts.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    auto names = mpi_allgather_strings(name);
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
  return std::make_shared<MpiTransport>(std::move(hosts));
}

}  // namespace conduit::net
