#pragma once
// Point-to-point transports (Gloo's split): a Transport owns I/O to every peer of one job; messages are tagged and
// non-blocking; every wait has a deadline.
//
// Matching rule (as MPI's non-overtaking rule): between one sender and one receiver, messages with the same tag
// match receives in the order both were posted. A receive names the exact byte size it expects; a message of
// another size fails that receive with a ProtocolError naming both sizes and is consumed, whichever came first
// (the connection stays usable, as with MPI's truncation error). The failed receive's buffer is left as it was,
// except under MPI, which may have written a message's first bytes into it. The send completes (tcp, shm, MPI),
// except in-process, where sender and receiver meet directly and both fail with the mismatch. Tags carry a kind in
// their top byte (see tags.h).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/reduce.h"

namespace conduit::net {

// Something that moves data when a waiter calls it (the shared-memory transport progresses in the caller).
class Progressor {
 public:
  virtual ~Progressor() = default;
  // Moves whatever can move now; returns true if anything moved.
  virtual bool progress() = 0;
  // Blocks until something may have changed or until `until`; spins briefly first.
  virtual void wait_for_activity(const Deadline& until) = 0;
  // Wakes the threads blocked in wait_for_activity (called when another transport completes a request).
  virtual void notify() {}
};

// Why a peer's messages are not moving, kept by a transport while it knows (a connection held over its budget for
// unexpected messages): a request with that peer appends it to its timeout, which otherwise says only that nothing
// came. Shared by the transport and its requests (a request may outlive its transport).
class PeerNotes {
 public:
  void set(int peer, std::string note);
  void clear(int peer);
  std::string get(int peer) const;  // empty when none

 private:
  mutable std::mutex mu_;
  std::map<int, std::string> notes_;
};

class Request {
 public:
  enum class Kind : uint8_t { send, recv };
  Request(Kind kind, int peer, uint64_t tag, size_t bytes) : kind_(kind), peer_(peer), tag_(tag), bytes_(bytes) {}
  virtual ~Request() = default;

  // True once complete; rethrows the failure (PeerError, ProtocolError, ...) if it failed.
  bool test();
  // Blocks until complete; TimeoutError once `deadline` passes; rethrows a failure.
  void wait(const Deadline& deadline);
  bool done() const { return state_.load(std::memory_order_acquire) != kPending; }
  bool succeeded() const { return state_.load(std::memory_order_acquire) == kDone; }

  Kind kind() const { return kind_; }
  int peer() const { return peer_; }
  uint64_t tag() const { return tag_; }
  size_t bytes() const { return bytes_; }

  // Called by transports.
  void complete();
  void fail(std::exception_ptr error);
  void set_progressor(Progressor* p) { progressor_ = p; }
  bool has_progressor() const { return progressor_ != nullptr; }
  // Where the timeout looks for a note on its peer (PeerNotes).
  void set_notes(std::shared_ptr<const PeerNotes> n) { notes_ = std::move(n); }
  // Runs when the request completes successfully, in the completing thread, before waiters wake.
  virtual void on_complete() {}

 protected:
  static constexpr int kPending = 0, kDone = 1, kFailed = 2;
  Kind kind_;
  int peer_;
  uint64_t tag_;
  size_t bytes_;
  std::atomic<int> state_{kPending};
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;
  Progressor* progressor_ = nullptr;
  std::shared_ptr<const PeerNotes> notes_;
};

using RequestPtr = std::shared_ptr<Request>;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Host index of every rank (ranks with equal index share a host and can use shared memory).
  const std::vector<int>& hosts() const { return hosts_; }
  int num_hosts() const;

  virtual RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  virtual RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) = 0;
  // Receives `count` elements of `dtype` from `peer` and reduces them into dst (dst = op(dst, incoming)).
  // Transports that can reduce straight out of their buffers override this; the default stages the message.
  virtual RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op);
  // A send that the receiver takes with irecv_reduce. Shared memory sends it through its rings, whose copy out is
  // fused with the reduction, rather than letting the receiver read it out of this process (shm's single copy, a
  // gain only for a plain copy); other transports send it as any message.
  virtual RequestPtr isend_reduced(int peer, uint64_t tag, const void* data, size_t bytes) {
    return isend(peer, tag, data, bytes);
  }

  // Small allreduce of the whole transport through shared memory, bypassing messages (shm between ranks that are all
  // on one host): the largest payload it takes, 0 where unsupported. fast_allreduce reduces buf in place (op as
  // reduce_into; avg is summed, the caller divides); every rank calls it in the same order with the same count,
  // dtype and op, and every rank gets the same bits (reduced in rank order). One caller at a time per transport.
  virtual size_t fast_allreduce_max_bytes() const { return 0; }
  virtual void fast_allreduce(void* buf, size_t count, DType dtype, ReduceOp op, const Deadline& deadline);

  // Fails every pending and future request with PeerError(reason) and tells the peers (best effort) so that
  // their pending requests fail too instead of waiting for their deadline.
  virtual void abort(const std::string& reason) = 0;
  // Withdraws a request of this transport that no data has moved for yet (a receive still waiting for its message,
  // or attached to one that is still arriving into the transport's own buffer; a send not yet started): fails it
  // with `error` and returns true, and the transport never touches its buffer again (a message the receive had
  // matched stays for the next receive of its tag). False when the request is done already, or its data is moving
  // (a receive being filled, a send partly written) or the transport cannot withdraw requests: then abort() keeps
  // tcp, shm and inproc off the buffer; MPI's abort gives matched receives and started sends up to 2 s together to
  // finish before it fails them, and may still read a send its receiver takes later, or fill a receive whose data
  // stopped coming, until the process ends.
  virtual bool cancel(const RequestPtr& r, std::exception_ptr error);
  // Empty when healthy, else why it was aborted (a routed transport: also why one of the transports it routes
  // over was, by a peer's abort).
  virtual std::string aborted_reason() const;
  // Why messages from `peer` are held back now (a stall over the transport's budget for unexpected messages, naming
  // the variable that sets it), or empty: for a timeout that waited on that peer.
  virtual std::string peer_note(int peer) const { return notes_->get(peer); }
  // Called (from the transport's own thread) after it completes or fails requests; lets a routed transport wake
  // waiters that sleep in another transport's progressor.
  void set_activity_target(Progressor* p) { activity_target_.store(p, std::memory_order_release); }
  // Called once, with the reason, when the transport is first marked aborted (by its own abort or a peer's), from
  // whichever thread marked it, with the transport's abort lock held: it must only note the reason or hand it on
  // (a routed transport relays a peer's abort to the transports beside this one). Null clears it; clearing waits for
  // a call in progress.
  void set_abort_listener(std::function<void(const std::string&)> f) {
    std::lock_guard<std::mutex> lk(abort_mu_);
    abort_listener_ = std::move(f);
  }

  // Communicator ids (the middle 24 bits of a tag) that splits handed out on this transport, and ids below 0x800000
  // that callers gave Communicator::create, lie below this floor; a split takes the largest floor of its members, so
  // its ids are new to every one of them. (Two splits running at once on communicators that share ranks read the
  // same floor: split such communicators one after another, as collectives on them must be ordered anyway.)
  uint32_t comm_id_floor() const { return comm_id_floor_.load(std::memory_order_acquire); }
  void raise_comm_id_floor(uint32_t above) {
    uint32_t cur = comm_id_floor_.load(std::memory_order_acquire);
    while (cur <= above && !comm_id_floor_.compare_exchange_weak(cur, above + 1, std::memory_order_acq_rel)) {
    }
  }

 protected:
  void set_aborted(const std::string& reason);
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> hosts_;
  std::atomic<Progressor*> activity_target_{nullptr};
  mutable std::mutex abort_mu_;
  std::string aborted_;
  std::atomic<bool> aborted_flag_{false};  // aborted_ is set
  std::function<void(const std::string&)> abort_listener_;
  std::atomic<uint32_t> comm_id_floor_{1};  // 0 is the world communicator
  std::shared_ptr<PeerNotes> notes_ = std::make_shared<PeerNotes>();  // (peer_note; given to this transport's requests)
};

using TransportPtr = std::shared_ptr<Transport>;

// Refuses, with InvalidArgument, a tag whose kind byte (its top 8 bits, tags.h) is not one of the kinds: every
// transport checks it when a request is posted (`transport` and `op` name where, as "tcp" and "isend"). Queued, such a
// tag reached the receiver, whose frame check failed the whole link from this rank as a protocol error.
void check_tag(const char* transport, const char* op, uint64_t tag);

// Waits for the requests in order and rethrows the first failure (or the deadline's TimeoutError) at once: the rest
// may still be pending with their buffers, which the caller then gives up (wait_all_or_give_up) or aborts.
void wait_all(const std::vector<RequestPtr>& reqs, const Deadline& deadline);

// For a caller that gives up on a request (its wait timed out) and will reuse or free the buffer: cancels the
// request, or, when the transport is already moving its data, aborts the transport (`why` is the reason) so that
// nothing reads or writes the buffer afterwards. Returns true when the request completed meanwhile (nothing to
// give up), false when it was withdrawn or the transport aborted.
bool give_up(Transport& t, const RequestPtr& r, const std::string& why);

// wait_all for a caller whose buffers go away when it throws: on any failure (the deadline, a peer's error) it gives
// up every request first, then rethrows.
void wait_all_or_give_up(Transport& t, const std::vector<RequestPtr>& reqs, const Deadline& deadline);

}  // namespace conduit::net
