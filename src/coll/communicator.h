#pragma once
// A Communicator is a group of ranks over one transport. Collectives are non-blocking: each call is queued on the
// communicator's worker thread (in call order, which must be the same on every rank) and returns a Work handle.
// Every collective has a deadline (CollOptions::timeout_s, else the communicator's, else CONDUIT_TIMEOUT, else
// 300 s); on timeout or a peer's failure every rank raises an error naming the operation, its sequence number and
// the ranks it has not heard from, and the communicator is aborted (later calls fail at once). Bad arguments are
// refused by the call (InvalidArgument, ConfigError); one refused for what only its own rank sees (a null or
// overlapping buffer, alltoallv's counts of its own blocks, CollOptions::timeout_s) aborts the communicator and its
// transport too where there are other ranks, which fail at once naming it (they would wait in the call for this rank).
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coll/tuner.h"
#include "core/dtype.h"
#include "core/reduce.h"
#include "net/bootstrap.h"
#include "net/transport.h"

namespace conduit::coll {

struct CollOptions {
  // 0: the communicator's timeout. Counted from when the operation starts: one queued behind others (each
  // communicator runs its operations one at a time, in order) gets its whole timeout once it runs.
  double timeout_s = 0;
  std::string algorithm;  // empty: the tuner chooses; else one of Tuner::algorithms(op)
  // Run on the calling thread and return when done (as MPI_Allreduce does): no hand-off to the worker thread,
  // the lowest latency. The default starts the operation in the background and returns at once.
  bool blocking = false;
};

// `seconds` when it is 0 (the default) or more; else InvalidArgument naming `what` (a negative or nan timeout
// quietly became the default).
double checked_timeout(double seconds, const char* what);

struct CommConfig {
  // Deadline of each collective (0: CONDUIT_TIMEOUT or 300 s). from_env's start-up (meeting the other ranks, the
  // transport's connections, the cost model's measurement) waits this or CONDUIT_TIMEOUT, whichever is longer.
  double timeout_s = 0;
  std::string transport = "";    // empty: CONDUIT_TRANSPORT or auto
  bool debug_collectives = false;  // also on with CONDUIT_DEBUG_COLLECTIVES=1
  bool measure_cost_model = true;  // measure alpha/beta/gamma at start-up unless CONDUIT_COST_MODEL is set
};

class Communicator;

class Work {
 public:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
    double seconds = 0;
    std::string algorithm;
    std::weak_ptr<Communicator> owner;  // lets a waiter run the operation itself when it is next in line
    // Point-to-point operations: the transport request (and its transport, kept alive while the request may need
    // it), its deadline and what it is (for errors).
    net::RequestPtr request;
    net::TransportPtr transport;
    Deadline deadline;
    std::string what;
    Stopwatch posted;  // point-to-point: since the request was posted (seconds() until its completion was seen)
  };
  Work() = default;
  explicit Work(std::shared_ptr<State> s) : s_(std::move(s)) {}
  void wait();        // rethrows the operation's error
  bool test();        // true when done; rethrows the error
  // Once done: a collective's execution time (from when it ran, not queued); a send's or receive's from its post to
  // the wait() or test() that saw it complete.
  double seconds() const;
  std::string algorithm() const;   // the algorithm that ran
  bool valid() const { return s_ != nullptr; }

 private:
  std::shared_ptr<State> s_;
};

class Communicator;
using CommPtr = std::shared_ptr<Communicator>;

// The context an algorithm runs in: its tag, deadline and the requests it posted (for error reports).
class Ctx {
 public:
  Ctx(Communicator& comm, uint64_t tag, const Deadline& deadline) : comm_(comm), tag_(tag), deadline_(deadline) {}
  Communicator& comm() { return comm_; }
  int rank() const;
  int size() const;
  const Deadline& deadline() const { return deadline_; }
  net::RequestPtr send(int peer, const void* data, size_t bytes);
  // A send the peer takes with recv_reduce (the transport may carry it differently: Transport::isend_reduced).
  net::RequestPtr send_reduced(int peer, const void* data, size_t bytes);
  net::RequestPtr recv(int peer, void* data, size_t bytes);
  net::RequestPtr recv_reduce(int peer, void* dst, size_t count, DType dtype, ReduceOp op);
  // A failed wait stops the transport before the exception leaves (the operation's scratch buffers, freed as it
  // unwinds, may still be a posted receive's or send's).
  void wait(const net::RequestPtr& r);
  void wait_all(const std::vector<net::RequestPtr>& rs);

 private:
  void stop(const std::exception& e);
  template <typename F>
  auto stopping(F&& f) -> decltype(f());
  Communicator& comm_;
  uint64_t tag_;
  Deadline deadline_;
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  // The world communicator of this process, from the environment (net/bootstrap.h).
  static CommPtr from_env(const CommConfig& cfg = {});
  // Communicators over an existing transport; `members` are transport ranks (in group order).
  static CommPtr create(net::TransportPtr transport, std::vector<int> members, uint32_t comm_id,
                        const CommConfig& cfg = {}, std::shared_ptr<Tuner> tuner = nullptr);
  // n in-process ranks (threads), for tests and simulations; rank r on host r / ranks_per_host.
  static std::vector<CommPtr> inproc(int n, int ranks_per_host = 0, const CommConfig& cfg = {});
  ~Communicator();

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  uint32_t id() const { return id_; }
  net::Transport& transport() { return *transport_; }
  int transport_rank(int group_rank) const { return members_[group_rank]; }
  int host_of(int group_rank) const { return transport_->hosts()[members_[group_rank]]; }
  int num_hosts() const;
  // Every host holds as many of the members as every other, and some hold more than one: hierarchical algorithms
  // apply. Computed from the host map alone (host_groups() builds communicators).
  bool hosts_uniform_multi() const;
  // K when every host holds K of the members, consecutive in rank order (ranks gK .. gK+K-1 on one host, each such
  // group on a host of its own: as launchers number a node's ranks); 0 otherwise. From the host map alone.
  int consecutive_host_ranks() const;
  double timeout_s() const { return timeout_s_; }
  Tuner& tuner() { return *tuner_; }
  // Gives this communicator a tuner of its own (split() shares its parent's): before its first collective.
  void set_tuner(std::shared_ptr<Tuner> tuner) { tuner_ = std::move(tuner); }
  const net::Bootstrap* bootstrap() const { return bootstrap_.get(); }

  // Collective over this communicator: ranks with the same color form a new communicator, ordered by (key, rank).
  // A negative color returns nullptr (the rank joins none). The new communicator's id is one no member uses yet;
  // splits of communicators that share ranks must not run at the same time (they would draw the same id).
  CommPtr split(int color, int key);

  Work allreduce(void* buf, size_t count, DType dtype, ReduceOp op, const CollOptions& o = {});
  // in: sum(counts) elements in rank order; out: counts[rank] elements.
  Work reduce_scatter(const void* in, void* out, std::vector<size_t> counts, DType dtype, ReduceOp op,
                      const CollOptions& o = {});
  Work reduce_scatter(const void* in, void* out, size_t recv_count, DType dtype, ReduceOp op,
                      const CollOptions& o = {});
  Work allgather(const void* in, void* out, size_t count, DType dtype, const CollOptions& o = {});
  Work allgatherv(const void* in, void* out, std::vector<size_t> counts, DType dtype, const CollOptions& o = {});
  Work broadcast(void* buf, size_t count, DType dtype, int root, const CollOptions& o = {});
  // out is used at the root only (it may equal in).
  Work reduce(const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root, const CollOptions& o = {});
  // gather: out (count x size elements) at the root only; scatter: in at the root only. At the root the one-block
  // buffer may be the root's own slot of the whole one (in place); another overlap is an InvalidArgument.
  Work gather(const void* in, void* out, size_t count, DType dtype, int root, const CollOptions& o = {});
  Work scatter(const void* in, void* out, size_t count, DType dtype, int root, const CollOptions& o = {});
  Work alltoall(const void* in, void* out, size_t count, DType dtype, const CollOptions& o = {});
  Work alltoallv(const void* in, std::vector<size_t> send_counts, void* out, std::vector<size_t> recv_counts,
                 DType dtype, const CollOptions& o = {});
  Work barrier(const CollOptions& o = {});
  // Point-to-point within the group; `tag` is the user's (any 32-bit value).
  Work send(const void* buf, size_t count, DType dtype, int peer, uint32_t tag, const CollOptions& o = {});
  Work recv(void* buf, size_t count, DType dtype, int peer, uint32_t tag, const CollOptions& o = {});

  // Synchronous variants used by algorithms that compose others (run on the calling thread, which must be the
  // worker thread of a parent operation). The op's sequence number is taken now.
  void run_allreduce(const Deadline& d, void* buf, size_t count, DType dtype, ReduceOp op, const std::string& algo);
  // in_place: reduce inside `in` (an internal caller's own buffer; out unused); else a scratch copy of `in`.
  void run_reduce_scatter(const Deadline& d, const void* in, void* out, const std::vector<size_t>& counts, DType dtype,
                          ReduceOp op, const std::string& algo, bool in_place = false);
  void run_allgatherv(const Deadline& d, const void* in, void* out, const std::vector<size_t>& counts, DType dtype,
                      const std::string& algo);
  void run_broadcast(const Deadline& d, void* buf, size_t count, DType dtype, int root, const std::string& algo);
  void run_reduce(const Deadline& d, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root,
                  const std::string& algo);

  // Intra-host and cross-host sub-communicators (built without communication from the host map).
  struct HostGroups {
    CommPtr local;   // ranks on my host
    CommPtr cross;   // ranks with my local index on every host (null when hosts differ in rank count)
    CommPtr leaders; // local rank 0 of every host (null unless I am one)
    bool uniform = false;
  };
  HostGroups& host_groups();

  std::string describe() const;  // "rank 1 of 4 (tcp)"
  // Group ranks of the receives in `recvs` that are not complete.
  std::vector<int> silent_peers(const std::vector<net::RequestPtr>& recvs) const;

 private:
  Communicator(net::TransportPtr transport, std::vector<int> members, uint32_t comm_id, const CommConfig& cfg,
               std::shared_ptr<Tuner> tuner);
  using Body = std::function<std::string(Ctx&)>;  // returns the algorithm name
  // What debug mode compares: every field up to counts_hash must be equal on every rank (counts_hash: the per-rank
  // counts of reduce_scatter and allgatherv); alltoallv's pairs are checked by sums, as rank i's send count to j must
  // be rank j's receive count from i: the sum over ranks of pairs_sent equals that of pairs_received.
  struct Signature {
    uint32_t op = 0, dtype = 0, redop = 0;
    int32_t root = -1;
    uint64_t count = 0;
    uint64_t counts_hash = 0;
    uint64_t algorithm_hash = 0;  // of the algorithm a call forces (CollOptions::algorithm; 0: none)
    uint64_t pairs_sent = 0, pairs_received = 0;
  };
  Work submit(const char* op_name, const Signature& sig, const CollOptions& o, Body body);
  // Runs `checks`, the refusals of what only this rank can see of its call (its buffers' addresses and overlaps,
  // alltoallv's counts of its own blocks, its CollOptions::timeout_s): a refusal there left the other ranks in the
  // call until their deadline, and a caller going on after it took the refused call's tag for its next collective,
  // where it could take a peer's message of the refused one as its own (a wrong result, returned as success). With
  // other ranks, a refusal takes the call's place in the order of operations: the call is queued as one that fails
  // at once, consuming its sequence number, failing this communicator and stopping the transport with the reason
  // (the other ranks in the call fail with it, not at their deadline). The caller gets the refusal itself. Checks
  // every rank makes alike on the arguments the ranks must agree on (counts, dtype, root, op, algorithm) stay local.
  template <typename F>
  void own_checks(const char* op_name, F&& checks);
  void refuse(const char* op_name, const std::exception& e);
  Work p2p(bool is_send, void* buf, size_t count, DType dt, int peer, uint32_t tag, const CollOptions& o);
  std::string run_op(const char* op_name, uint64_t seq, const Signature& sig, const Deadline& d, Body& body);
  void check_signature(uint64_t seq, const Signature& sig, const Deadline& d, const char* op_name);
  void worker_loop();
  // Runs the task at the front of the queue with qmu_ released meanwhile (lk holds qmu_ on entry and exit).
  void run_front(std::unique_lock<std::mutex>& lk);
  // Runs the queued operation of `state` on the calling thread if it is next and nothing else is running: a
  // waiting caller then pays no thread hand-off (the latency of small collectives).
  bool try_run_inline(const std::shared_ptr<Work::State>& state);
  friend class Work;
  // Only on the thread running an operation (executing_ is set: one at a time, in submission order).
  uint64_t next_seq() { return seq_++; }
  double effective_timeout(const CollOptions& o) const {
    return checked_timeout(o.timeout_s, "CollOptions.timeout_s") > 0 ? o.timeout_s : timeout_s_;
  }
  void check_root(int root, const char* op) const;
  // A forced algorithm (`forced` by the call, else a forcing rule for this size) must be known and send no message
  // over the transport's message limit, and some algorithm must fit it: ConfigError naming the algorithm and one that
  // fits. `esz`: the element size (blocks are whole elements); `even`: every rank's block has the same count
  // (reduce_scatter, allgatherv).
  void check_fits(CollOp op, const std::string& forced, size_t bytes, size_t esz, bool even);
  void check_counts(const std::vector<size_t>& counts, const char* what) const;

  net::TransportPtr transport_;
  std::vector<int> members_;
  int rank_ = 0;
  uint32_t id_;
  bool fast_allreduce_ok_ = false;   // small allreduces go through the transport's shared-memory fast path
  size_t fast_allreduce_bytes_ = 0;  // up to this many bytes
  double timeout_s_;
  bool debug_;
  std::shared_ptr<Tuner> tuner_;
  std::shared_ptr<net::Bootstrap> bootstrap_;
  uint64_t seq_ = 0;
  std::unique_ptr<HostGroups> groups_;

  std::mutex qmu_;
  std::condition_variable qcv_;
  struct Task {
    std::shared_ptr<Work::State> state;
    std::function<void()> fn;
  };
  std::deque<Task> queue_;
  bool executing_ = false;
  bool stopping_ = false;
  std::thread worker_;
  std::string failed_;  // set once an operation failed: the communicator is unusable
  std::atomic<bool> failed_flag_{false};  // failed_ is set (checked before taking fail_mu_)
  std::mutex fail_mu_;

  friend class Ctx;
};

// The id of a host group of the communicator `parent` (role 0: the ranks of one host, 1: the ranks of one local
// index across hosts, 2: the hosts' leaders). The groups of one parent and role are disjoint, so they share it;
// distinct (parent, role) pairs get distinct ids for every parent id a split can hand out (hashed, two parents'
// groups could share an id, and with it tags).
uint32_t host_group_comm_id(uint32_t parent, int role);

// The elements rank `rank` sends in an allgatherv of `counts` run by `algorithm` (Work::algorithm()): the ring
// forwards every block but its successor's; recursive doubling sends its group's blocks at each step. Blocks of
// different sizes make this differ from rank to rank, and from (size - 1) x the rank's own.
uint64_t allgatherv_sent(const std::string& algorithm, const std::vector<size_t>& counts, int rank);

// Every rank of `c` says whether a local step failed (`err`, null when it did not), in one allreduce: a rank that
// failed rethrows its own error (also when the agreement itself fails); the others get the highest rank that failed, or
// -1 when none did, and can say so in one line where they would have failed later in a collective naming nothing.
int agree_on_failure(Communicator& c, const std::exception_ptr& err);

}  // namespace conduit::coll
