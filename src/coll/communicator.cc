#include "coll/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>

#include "coll/algorithms.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "net/inproc.h"
#include "net/tags.h"
#include "net/wire.h"

namespace conduit::coll {

// ---------------------------------------------------------------------------------------------------------- Work

namespace {
// Waits on (or tests) a point-to-point request and records its outcome in the state, once.
bool settle_request(Work::State& s, bool block) {
  std::exception_ptr err;
  try {
    if (block) {
      s.request->wait(s.deadline);
    } else if (!s.request->test()) {
      if (!s.deadline.expired()) return false;
      s.request->wait(s.deadline);  // past the deadline: raises the TimeoutError wait() would (test() polled forever)
    }
  } catch (const TimeoutError& e) {
    // The caller may free or reuse the buffer once this returns: withdraw the request (or stop the transport) so
    // that a message arriving later neither lands in it nor is taken from the next receive of the tag.
    std::string msg = fmt::format("{} timed out: {}", s.what, e.what());
    if (!s.transport || !net::give_up(*s.transport, s.request, msg)) err = std::make_exception_ptr(TimeoutError(msg));
  } catch (const Error& e) {
    err = std::make_exception_ptr(PeerError(fmt::format("{} failed: {}", s.what, e.what())));
  }
  std::lock_guard<std::mutex> lk(s.mu);
  if (!s.done) {
    s.done = true;
    s.error = err;
    s.seconds = s.posted.seconds();  // (the last wait's or test()'s own time, 0 for a polled request, it was)
  }
  return true;
}
}  // namespace

void Work::wait() {
  if (!s_) throw InvalidArgument("wait() on an empty Work handle");
  if (s_->request) settle_request(*s_, true);
  if (auto owner = s_->owner.lock()) owner->try_run_inline(s_);
  std::unique_lock<std::mutex> lk(s_->mu);
  s_->cv.wait(lk, [&] { return s_->done; });
  if (s_->error) std::rethrow_exception(s_->error);
}

bool Work::test() {
  if (!s_) throw InvalidArgument("test() on an empty Work handle");
  if (s_->request && !settle_request(*s_, false)) return false;
  std::lock_guard<std::mutex> lk(s_->mu);
  if (s_->done && s_->error) std::rethrow_exception(s_->error);
  return s_->done;
}

// (under the lock: the worker writes them when the operation ends, perhaps while a caller that has not waited reads)
double Work::seconds() const {
  if (!s_) return 0;
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->seconds;
}
std::string Work::algorithm() const {
  if (!s_) return "";
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->algorithm;
}

double checked_timeout(double seconds, const char* what) {
  // (nan too: it compared false with 0 and quietly became the default; a positive value under a millisecond, as
  // CONDUIT_TIMEOUT's floor, expired before the first message: 1e-12 rounded to a zero duration)
  if (!(seconds == 0 || seconds >= 1e-3))
    throw InvalidArgument(
        fmt::format("{} = {}: allowed: 0 (the default timeout) or a number of seconds from 0.001", what, seconds));
  return seconds;
}

int agree_on_failure(Communicator& c, const std::exception_ptr& err) {
  int64_t failed = err ? c.rank() + 1 : 0;  // (the highest such rank, plus one)
  try {
    if (c.size() > 1) c.allreduce(&failed, 1, DType::i64, ReduceOp::max).wait();
  } catch (...) {
    if (err) std::rethrow_exception(err);  // (its own error first)
    throw;
  }
  if (err) std::rethrow_exception(err);
  return int(failed) - 1;
}

uint64_t allgatherv_sent(const std::string& algorithm, const std::vector<size_t>& counts, int rank) {
  const int p = int(counts.size());
  if (p <= 1) return 0;
  uint64_t sent = 0;
  if (algorithm == "rd" && (p & (p - 1)) == 0) {
    // (rd_allgather_inplace: at step `mask` the aligned group of `mask` ranks holding this one)
    for (int mask = 1; mask < p; mask <<= 1)
      for (int q = rank & ~(mask - 1); q < (rank & ~(mask - 1)) + mask; ++q) sent += counts[size_t(q)];
    return sent;
  }
  for (int q = 0; q < p; ++q)
    if (q != (rank + 1) % p) sent += counts[size_t(q)];
  return sent;
}

// ----------------------------------------------------------------------------------------------------------- Ctx

namespace {
// The receives posted by the operation running on this thread (including those of sub-communicators it uses), so
// that a failure can name the ranks that never answered.
thread_local std::vector<net::RequestPtr>* tl_op_recvs = nullptr;
thread_local Clock::time_point tl_op_start{};  // when the operation running on this thread started
// Records the running operation's failure and stops the transport with it (run_op's), called before a failed wait's
// exception unwinds the operation's buffers.
thread_local std::function<void(const std::exception&)>* tl_op_stop = nullptr;
}  // namespace

// (Operations run inside run_op, which sets tl_op_stop; without it, as a last resort, the transport stops alone.)
void Ctx::stop(const std::exception& e) {
  if (tl_op_stop)
    (*tl_op_stop)(e);
  else
    comm_.transport_->abort(e.what());
}

// Runs f (a post or a wait); if it throws, the transport stops before the exception leaves: requests posted earlier
// may point into the operation's scratch buffers, which the unwinding frees.
template <typename F>
auto Ctx::stopping(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    stop(e);
    throw;
  }
}

void Ctx::wait(const net::RequestPtr& r) {
  stopping([&] { r->wait(deadline_); });
}

void Ctx::wait_all(const std::vector<net::RequestPtr>& rs) {
  stopping([&] { net::wait_all(rs, deadline_); });
}

int Ctx::rank() const { return comm_.rank(); }
int Ctx::size() const { return comm_.size(); }

net::RequestPtr Ctx::send(int peer, const void* data, size_t bytes) {
  return stopping([&] { return comm_.transport_->isend(comm_.members_[peer], tag_, data, bytes); });
}

net::RequestPtr Ctx::send_reduced(int peer, const void* data, size_t bytes) {
  return stopping([&] { return comm_.transport_->isend_reduced(comm_.members_[peer], tag_, data, bytes); });
}

net::RequestPtr Ctx::recv(int peer, void* data, size_t bytes) {
  auto r = stopping([&] { return comm_.transport_->irecv(comm_.members_[peer], tag_, data, bytes); });
  if (tl_op_recvs) tl_op_recvs->push_back(r);
  return r;
}

net::RequestPtr Ctx::recv_reduce(int peer, void* dst, size_t count, DType dtype, ReduceOp op) {
  auto r = stopping([&] { return comm_.transport_->irecv_reduce(comm_.members_[peer], tag_, dst, count, dtype, op); });
  if (tl_op_recvs) tl_op_recvs->push_back(r);
  return r;
}

std::vector<int> Communicator::silent_peers(const std::vector<net::RequestPtr>& recvs) const {
  std::set<int> s;
  for (const auto& r : recvs) {
    if (r->succeeded()) continue;
    auto it = std::find(members_.begin(), members_.end(), r->peer());
    if (it != members_.end()) s.insert(static_cast<int>(it - members_.begin()));
  }
  return {s.begin(), s.end()};
}

// -------------------------------------------------------------------------------------------------- Communicator

namespace {
// Ids of the host groups (built by each member alone from the host map) lie in the upper half of the 24 bits;
// splits count up from 1 in the lower half (split()).
constexpr uint32_t kHostGroupIds = 0x800000u;

std::string join_ints(const std::vector<int>& v) {
  std::vector<std::string> s;
  for (int x : v) s.push_back(std::to_string(x));
  return join(s, ", ");
}
}  // namespace

Communicator::Communicator(net::TransportPtr transport, std::vector<int> members, uint32_t comm_id,
                           const CommConfig& cfg, std::shared_ptr<Tuner> tuner)
    : transport_(std::move(transport)), members_(std::move(members)), id_(comm_id) {
  // (a tag holds 24 bits of id: 1 << 24 wrapped to 0, the world communicator's)
  if (comm_id > 0xffffffu)
    throw InvalidArgument(
        fmt::format("communicator id {:#x}: allowed below {:#x} (a tag's 24 bits)", comm_id, 1u << 24));
  {
    std::vector<int> sorted = members_;
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (sorted[i] < 0 || sorted[i] >= transport_->size())
        throw InvalidArgument(
            fmt::format("communicator: member {} is not a transport rank (0..{})", sorted[i], transport_->size() - 1));
      if (i > 0 && sorted[i] == sorted[i - 1])
        throw InvalidArgument(fmt::format("communicator: transport rank {} is listed twice", sorted[i]));
    }
  }
  auto it = std::find(members_.begin(), members_.end(), transport_->rank());
  if (it == members_.end()) throw InvalidArgument("communicator: this rank is not a member");
  // Ids between the splits' range and the host groups' would leave no id for later splits and could not form host
  // groups of their own (3 x id + role): refused here, not at the first split or hierarchical collective.
  if (id_ >= kHostGroupIds / 3 && id_ < kHostGroupIds)
    throw InvalidArgument(
        fmt::format("communicator id {:#x}: allowed below {:#x} (ids from {:#x} are the host groups')", id_,
                    kHostGroupIds / 3, kHostGroupIds));
  if (id_ > 0 && id_ < kHostGroupIds)
    transport_->raise_comm_id_floor(id_);  // an id given by the caller: splits skip it
  rank_ = static_cast<int>(it - members_.begin());
  timeout_s_ = checked_timeout(cfg.timeout_s, "CommConfig.timeout_s") > 0 ? cfg.timeout_s : default_timeout_seconds();
  debug_ = cfg.debug_collectives || env_flag("CONDUIT_DEBUG_COLLECTIVES");
  tuner_ = tuner ? std::move(tuner) : Tuner::from_env();
  // The transport's fast allreduce serves one communicator: the world one (id 0, every transport rank in order),
  // which exists once per transport. CONDUIT_SHM_FAST_BYTES lowers its size limit (0 turns it off).
  bool world = id_ == 0 && static_cast<int>(members_.size()) == transport_->size();
  for (size_t i = 0; world && i < members_.size(); ++i) world = members_[i] == static_cast<int>(i);
  // Id 0's tags are the world communicator's: another group under it would take the world's messages.
  if (id_ == 0 && !world)
    throw InvalidArgument(
        "communicator id 0: the world's (every transport rank, in order); allowed for another group: an id of its "
        "own from 1");
  fast_allreduce_bytes_ = world ? transport_->fast_allreduce_max_bytes() : 0;
  // A size as the other *_BYTES variables take it (4K was refused as not an integer); the start-up agreement check
  // reads it the same way.
  if (auto v = env_string("CONDUIT_SHM_FAST_BYTES"); v && !v->empty()) {
    const uint64_t b = parse_bytes(*v, "CONDUIT_SHM_FAST_BYTES");
    if (b > (uint64_t{1} << 40))
      throw ConfigError(
          fmt::format("environment variable CONDUIT_SHM_FAST_BYTES='{}' is invalid: expected a size from 0 to 1T", *v));
    fast_allreduce_bytes_ = std::min<size_t>(fast_allreduce_bytes_, static_cast<size_t>(b));
  }
  fast_allreduce_ok_ = fast_allreduce_bytes_ > 0;
}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lk(qmu_);
    stopping_ = true;
  }
  qcv_.notify_all();
  if (worker_.joinable()) {
    if (worker_.get_id() == std::this_thread::get_id()) worker_.detach();
    else worker_.join();
  }
}

CommPtr Communicator::create(net::TransportPtr transport, std::vector<int> members, uint32_t comm_id,
                             const CommConfig& cfg, std::shared_ptr<Tuner> tuner) {
  // Ids from kHostGroupIds are the host groups' (host_groups()): one given here shared their tags.
  if (comm_id >= kHostGroupIds / 3)
    throw InvalidArgument(
        fmt::format("communicator id {:#x}: allowed below {:#x} (ids from {:#x} are the host groups')", comm_id,
                    kHostGroupIds / 3, kHostGroupIds));
  return CommPtr(new Communicator(std::move(transport), std::move(members), comm_id, cfg, std::move(tuner)));
}

std::vector<CommPtr> Communicator::inproc(int n, int ranks_per_host, const CommConfig& cfg) {
  auto ts = net::make_inproc_world(n, ranks_per_host);
  std::vector<int> members(n);
  std::iota(members.begin(), members.end(), 0);
  std::vector<CommPtr> out;
  for (auto& t : ts) out.push_back(create(t, members, 0, cfg));
  return out;
}

int Communicator::num_hosts() const {
  std::set<int> h;
  for (int m : members_) h.insert(transport_->hosts()[m]);
  return static_cast<int>(h.size());
}

bool Communicator::hosts_uniform_multi() const {
  std::map<int, int> per_host;
  for (int m : members_) ++per_host[transport_->hosts()[m]];
  const int each = per_host.begin()->second;
  for (const auto& [h, n] : per_host)
    if (n != each) return false;
  return each > 1;
}

int Communicator::consecutive_host_ranks() const {
  const int w = size();
  int k = 1;
  while (k < w && host_of(k) == host_of(0)) ++k;
  if (w % k != 0) return 0;
  std::set<int> seen;
  for (int g = 0; g < w; g += k) {
    if (!seen.insert(host_of(g)).second) return 0;
    for (int r = g + 1; r < g + k; ++r)
      if (host_of(r) != host_of(g)) return 0;
  }
  return k;
}

std::string Communicator::describe() const {
  // A transport's own errors name its ranks: a group's rank that is not the same number says which it is.
  bool same = size() == transport_->size();
  for (int r = 0; same && r < size(); ++r) same = members_[r] == r;
  if (same) return fmt::format("rank {} of {} ({})", rank_, size(), transport_->name());
  return fmt::format("rank {} of {} ({} rank {} of {})", rank_, size(), transport_->name(), members_[rank_],
                     transport_->size());
}

void Communicator::check_root(int root, const char* op) const {
  if (root < 0 || root >= size())
    throw InvalidArgument(fmt::format("{}: root {} is not a rank of this communicator [0, {})", op, root, size()));
}

void Communicator::check_counts(const std::vector<size_t>& counts, const char* what) const {
  if (counts.size() != static_cast<size_t>(size()))
    throw InvalidArgument(
        fmt::format("{}: {} counts given for a communicator of {} ranks", what, counts.size(), size()));
}

uint32_t host_group_comm_id(uint32_t parent, int role) {
  if (role < 0 || role > 2) throw InvalidArgument(fmt::format("host_group_comm_id: role {} (allowed: 0, 1, 2)", role));
  // Splits hand out ids below kHostGroupIds / 3 long before their floor nears kHostGroupIds; a host group's own
  // groups (a parent id at or above kHostGroupIds) and parents past that bound are refused, not hashed.
  if (parent >= kHostGroupIds / 3)
    throw InvalidArgument(fmt::format(
        "host groups of communicator {}: ids of host groups come from 3 x the parent's id, which must be below {}",
        parent, kHostGroupIds / 3));
  return kHostGroupIds | (3 * parent + static_cast<uint32_t>(role));
}

Communicator::HostGroups& Communicator::host_groups() {
  if (groups_) return *groups_;
  groups_ = std::make_unique<HostGroups>();
  std::vector<int> local, leaders;
  std::map<int, std::vector<int>> by_host;  // host -> members (transport ranks) in group order
  for (int m : members_) by_host[transport_->hosts()[m]].push_back(m);
  int my_host = host_of(rank_);
  local = by_host[my_host];
  int my_local = static_cast<int>(std::find(local.begin(), local.end(), members_[rank_]) - local.begin());
  bool uniform = true;
  for (auto& [h, v] : by_host) {
    if (v.size() != local.size()) uniform = false;
    leaders.push_back(v.front());
  }
  groups_->uniform = uniform;
  CommConfig cfg;
  cfg.timeout_s = timeout_s_;
  groups_->local = CommPtr(new Communicator(transport_, local, host_group_comm_id(id_, 0), cfg, tuner_));
  if (uniform) {
    std::vector<int> cross;
    for (auto& [h, v] : by_host) cross.push_back(v[my_local]);
    groups_->cross = CommPtr(new Communicator(transport_, cross, host_group_comm_id(id_, 1), cfg, tuner_));
  }
  if (my_local == 0)
    groups_->leaders = CommPtr(new Communicator(transport_, leaders, host_group_comm_id(id_, 2), cfg, tuner_));
  return *groups_;
}

CommPtr Communicator::split(int color, int key) {
  // Every rank contributes (color, key, the floor of the communicator ids its transport has handed out); the members
  // of each color are ordered by (key, old rank). The new communicators take ids from the largest floor up, one per
  // color in ascending order: no member already uses them (ids from a hash of the parent's id, the split count and
  // the color collided: split #1 with color 0 and split #2 with color 3145728, and after ~1700 splits with small
  // colors; two communicators of one id share tags and could take each other's messages).
  std::vector<int64_t> mine{color, key, static_cast<int64_t>(transport_->comm_id_floor())}, all(3 * size());
  allgather(mine.data(), all.data(), 3, DType::i64).wait();
  int64_t base = 1;
  std::set<int64_t> colors;
  for (int r = 0; r < size(); ++r) {
    base = std::max(base, all[3 * r + 2]);
    if (all[3 * r] >= 0) colors.insert(all[3 * r]);
  }
  const int64_t last = base + static_cast<int64_t>(colors.size()) - 1;
  // (below a third of the host groups' first id: each split communicator's host groups take 3 x its id)
  if (last >= static_cast<int64_t>(kHostGroupIds / 3))
    throw Error(fmt::format("split: out of communicator ids ({} are in use on this transport; at most {})", base,
                            kHostGroupIds / 3 - 1));
  if (!colors.empty()) transport_->raise_comm_id_floor(static_cast<uint32_t>(last));
  if (color < 0) return nullptr;
  const int64_t new_id = base + std::distance(colors.begin(), colors.find(color));
  std::vector<std::pair<std::pair<int64_t, int>, int>> sel;
  for (int r = 0; r < size(); ++r)
    if (all[3 * r] == color) sel.push_back({{all[3 * r + 1], r}, members_[r]});
  std::sort(sel.begin(), sel.end());
  std::vector<int> members;
  for (auto& s : sel) members.push_back(s.second);
  CommConfig cfg;
  cfg.timeout_s = timeout_s_;
  cfg.debug_collectives = debug_;
  return create(transport_, members, static_cast<uint32_t>(new_id), cfg, tuner_);
}

// -------------------------------------------------------------------------------------------- execution engine

void Communicator::run_front(std::unique_lock<std::mutex>& lk) {
  Task task = std::move(queue_.front());
  queue_.pop_front();
  executing_ = true;
  lk.unlock();
  task.fn();
  lk.lock();
  executing_ = false;
  qcv_.notify_all();
}

void Communicator::worker_loop() {
  std::unique_lock<std::mutex> lk(qmu_);
  while (true) {
    qcv_.wait(lk, [&] { return (stopping_ && !executing_) || (!queue_.empty() && !executing_); });
    if (queue_.empty()) return;
    run_front(lk);
  }
}

bool Communicator::try_run_inline(const std::shared_ptr<Work::State>& state) {
  std::unique_lock<std::mutex> lk(qmu_);
  if (executing_ || queue_.empty() || queue_.front().state != state) return false;
  run_front(lk);
  return true;
}

namespace {
// The signature of a refused call (refuse()): debug mode's comparison is skipped (the call fails at once; comparing
// it named a mismatch where the arguments were at fault).
constexpr uint32_t kSigRefused = 0xffffffffu;
}  // namespace

template <typename F>
void Communicator::own_checks(const char* op_name, F&& checks) {
  try {
    checks();
  } catch (const Error& e) {
    if (size() > 1) refuse(op_name, e);
    throw;
  }
}

void Communicator::refuse(const char* op_name, const std::exception& e) {
  // (queued behind the operations called before it, which run as they would have; a default CollOptions: this
  // call's own may be what was refused)
  Signature sig;
  sig.op = kSigRefused;
  const std::string why = fmt::format("refused on this rank: {}", e.what());
  submit(op_name, sig, CollOptions{}, [why](Ctx&) -> std::string { throw InvalidArgument(why); });
}

Work Communicator::submit(const char* op_name, const Signature& sig_in, const CollOptions& o, Body body) {
  double timeout_s = 0;
  own_checks(op_name, [&] { timeout_s = effective_timeout(o); });
  // Debug mode compares the algorithm a call forces too: ranks that ran different algorithms under one tag finished
  // with different results (rd on one rank, tree on the others) or waited for their deadline.
  Signature sig = sig_in;
  if (debug_)
    for (unsigned char ch : o.algorithm) sig.algorithm_hash = (sig.algorithm_hash ^ ch) * 1099511628211ull + 1;
  auto state = std::make_shared<Work::State>();
  state->owner = weak_from_this();
  auto task = [this, state, op_name, sig, timeout_s, body = std::move(body)]() mutable {
    // The sequence number is taken when the operation starts, on the thread that runs it: operations run one at a
    // time in the order they were submitted, so every rank numbers them (and the run_* steps inside them, which take
    // numbers of their own) alike. Taken at submit, on the caller's thread, it interleaved with the numbers the
    // worker took for the operation ahead whenever a rank queued two before the first had started: the ranks then
    // used different tags for the same operation and waited for each other until the deadline.
    const uint64_t seq = next_seq();
    // One clock read starts the operation's stopwatch and deadline (and run_op's error messages): small operations
    // on shared memory take under a microsecond, where every clock read shows.
    const auto start = Clock::now();
    tl_op_start = start;
    std::exception_ptr err;
    std::string algo;
    try {
      Deadline d = timeout_s <= 0 ? Deadline(start)
                   : timeout_s > 1e9
                       ? Deadline::never()
                       : Deadline(start + std::chrono::duration_cast<Clock::duration>(Seconds(timeout_s)));
      algo = run_op(op_name, seq, sig, d, body);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(state->mu);
      state->done = true;
      state->error = err;
      state->seconds = std::chrono::duration<double>(Clock::now() - start).count();
      state->algorithm = algo;
    }
    state->cv.notify_all();
  };
  {
    std::unique_lock<std::mutex> lk(qmu_);
    if (o.blocking && queue_.empty() && !executing_) {
      executing_ = true;
      lk.unlock();
      task();
      lk.lock();
      executing_ = false;
      if (!queue_.empty()) qcv_.notify_all();
      lk.unlock();
      Work w(state);
      w.wait();  // a blocking call reports its error from the call, as the queued path does
      return w;
    }
    if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
    queue_.push_back(Task{state, std::move(task)});
  }
  qcv_.notify_one();
  Work w(state);
  if (o.blocking) w.wait();
  return w;
}

namespace {
template <typename E>
[[noreturn]] void rethrow_as(const std::string& msg) {
  throw E(msg);
}
}  // namespace

std::string Communicator::run_op(const char* op_name, uint64_t seq, const Signature& sig, const Deadline& d,
                                 Body& body) {
  if (failed_flag_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lk(fail_mu_);
    if (!failed_.empty())
      throw PeerError(fmt::format("{} #{} on {}: the communicator was aborted earlier: {}", op_name, seq, describe(),
                                  failed_));
  }
  std::string reason = transport_->aborted_reason();
  if (!reason.empty())
    throw PeerError(fmt::format("{} #{} on {}: the transport was aborted earlier: {}", op_name, seq, describe(),
                                reason));
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(seq)), d);
  const auto start = tl_op_start;  // set by submit's task, which runs this on the same thread
  std::vector<net::RequestPtr> recvs;
  std::string stopped;  // the failure the transport was stopped with by a failed wait, before unwinding
  std::function<void(const std::exception&)> stop;
  struct Reset {
    std::vector<net::RequestPtr>* recvs = tl_op_recvs;
    std::function<void(const std::exception&)>* stop = tl_op_stop;
    ~Reset() {
      tl_op_recvs = recvs;
      tl_op_stop = stop;
    }
  } reset;
  tl_op_recvs = &recvs;
  tl_op_stop = &stop;
  // The operation's error message, recorded as the communicator's failure (later operations refuse to run).
  auto fail = [&](const char* what, const std::string& detail) {
    std::string msg = fmt::format("{} #{} on {} failed after {:.1f} s: {}{}", op_name, seq, describe(),
                                  std::chrono::duration<double>(Clock::now() - start).count(), what, detail);
    std::lock_guard<std::mutex> lk(fail_mu_);
    if (failed_.empty()) failed_ = msg;
    failed_flag_.store(true, std::memory_order_release);
    return msg;
  };
  // (so that the other ranks fail now rather than at their deadline, and no transport keeps filling or reading a
  // scratch buffer the unwinding frees)
  auto stop_with = [&](const std::exception& e) {
    if (!stopped.empty()) return stopped;
    auto silent = silent_peers(recvs);
    std::string quiet;
    if (!silent.empty()) {
      std::vector<int> theirs;  // (as the transport's errors number them)
      for (int r : silent) theirs.push_back(members_[r]);
      quiet = fmt::format("; no data yet from rank(s) {}", join_ints(silent));
      if (theirs != silent) quiet += fmt::format(" ({} rank(s) {})", transport_->name(), join_ints(theirs));
      // Why the transport holds a silent peer's messages, when it knows (the wait that timed out may have named
      // another peer's request, whose note it carried)
      for (int r : theirs) {
        const std::string note = transport_->peer_note(r);
        if (!note.empty() && std::string_view(e.what()).find(note) == std::string_view::npos) quiet += "; " + note;
      }
    }
    stopped = fail(e.what(), quiet);
    transport_->abort(stopped);
    return stopped;
  };
  stop = [&](const std::exception& e) { stop_with(e); };
  try {
    if (debug_ && size() > 1 && sig.op != kSigRefused) check_signature(seq, sig, d, op_name);
    return body(ctx);
  } catch (const Error& e) {
    // An argument error found inside the operation too (the arguments were checked before it was queued: what
    // remains is found mid-way, with the other ranks already in it).
    const std::string msg = stop_with(e);
    if (dynamic_cast<const TimeoutError*>(&e)) rethrow_as<TimeoutError>(msg);
    if (dynamic_cast<const ProtocolError*>(&e)) rethrow_as<ProtocolError>(msg);
    if (dynamic_cast<const MismatchError*>(&e)) rethrow_as<MismatchError>(msg);
    if (dynamic_cast<const InvalidArgument*>(&e)) rethrow_as<InvalidArgument>(msg);
    // (this rank's own setting or platform: a PeerError blamed the other ranks)
    if (dynamic_cast<const ConfigError*>(&e)) rethrow_as<ConfigError>(msg);
    if (dynamic_cast<const UnsupportedError*>(&e)) rethrow_as<UnsupportedError>(msg);
    rethrow_as<PeerError>(msg);
  } catch (const std::exception& e) {
    // Not one of ours (std::bad_alloc of a scratch buffer, ...): this rank cannot go on with the operation, and
    // its peers would wait for it until their deadline. Fail the communicator and the transport as for any error.
    std::string msg = stopped;
    if (msg.empty()) {
      msg = fail(e.what(), "");
      transport_->abort(msg);
    }
    rethrow_as<Error>(msg);  // this rank's own failure, not a peer's
  }
}

void Communicator::check_signature(uint64_t seq, const Signature& sig, const Deadline& d, const char* op_name) {
  // Rank 0 collects every rank's (op, dtype, count, root, reduction) and answers with a verdict.
  uint64_t tag = net::make_tag(net::kDebug, id_, static_cast<uint32_t>(seq));
  struct Verdict {
    char text[480];
  };
  static const char* op_names[] = {"allreduce", "reduce_scatter", "allgather", "allgatherv", "broadcast", "reduce",
                                   "gather",    "scatter",        "alltoall",  "alltoallv",  "barrier"};
  auto describe_sig = [&](const Signature& s) {
    return fmt::format("{}(dtype={}, count={}, root={}, op={})", s.op < 11 ? op_names[s.op] : "?",
                       dtype_name(static_cast<DType>(s.dtype)), s.count, s.root,
                       reduce_op_name(static_cast<ReduceOp>(s.redop)));
  };
  Verdict v{};
  // (a failed wait stops the transport before `all` and `v` are freed: they are its receives' buffers)
  auto waited = [&](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      if (tl_op_stop)
        (*tl_op_stop)(e);
      else
        transport_->abort(e.what());
      throw;
    }
  };
  if (rank_ == 0) {
    std::vector<Signature> all(size());
    std::vector<net::RequestPtr> rs;
    for (int r = 1; r < size(); ++r) rs.push_back(transport_->irecv(members_[r], tag, &all[r], sizeof(Signature)));
    waited([&] { net::wait_all(rs, d); });
    all[0] = sig;
    std::string bad;
    uint64_t sent = 0, received = 0;
    for (int r = 0; r < size(); ++r) {
      sent += all[r].pairs_sent;
      received += all[r].pairs_received;
      if (r > 0 && std::memcmp(&all[r], &all[0], offsetof(Signature, pairs_sent)) != 0) {
        bad = all[r].counts_hash != all[0].counts_hash &&
                      std::memcmp(&all[r], &all[0], offsetof(Signature, count) + sizeof(uint64_t)) == 0
                  ? fmt::format(
                        "collective mismatch at call #{}: ranks 0 and {} called {} with different per-rank "
                        "counts (the same total)",
                        seq, r, describe_sig(all[0]))
              : all[r].algorithm_hash != all[0].algorithm_hash &&
                      std::memcmp(&all[r], &all[0], offsetof(Signature, algorithm_hash)) == 0
                  ? fmt::format(
                        "collective mismatch at call #{}: ranks 0 and {} called {} forcing different "
                        "algorithms (CollOptions::algorithm)",
                        seq, r, describe_sig(all[0]))
                  : fmt::format("collective mismatch at call #{}: rank 0 called {} but rank {} called {}", seq,
                                describe_sig(all[0]), r, describe_sig(all[r]));
        break;
      }
    }
    if (bad.empty() && sent != received)
      bad = fmt::format(
          "collective mismatch at call #{}: alltoall's counts do not pair up (some rank sends a peer "
          "another number of elements than that peer's receive count for it)",
          seq);
    std::snprintf(v.text, sizeof v.text, "%s", bad.c_str());
    std::vector<net::RequestPtr> ss;
    for (int r = 1; r < size(); ++r) ss.push_back(transport_->isend(members_[r], tag, &v, sizeof v));
    waited([&] { net::wait_all(ss, d); });
  } else {
    auto sq = transport_->isend(members_[0], tag, &sig, sizeof sig);
    auto rq = transport_->irecv(members_[0], tag, &v, sizeof v);
    waited([&] {
      sq->wait(d);
      rq->wait(d);
    });
  }
  if (v.text[0] != '\0') throw MismatchError(std::string(v.text) + " (CONDUIT_DEBUG_COLLECTIVES)");
  (void)op_name;
}

// ------------------------------------------------------------------------------------------------- collectives

namespace {
enum SigOp : uint32_t {
  kSigAllreduce = 0, kSigReduceScatter, kSigAllgather, kSigAllgatherv, kSigBroadcast, kSigReduce, kSigGather,
  kSigScatter, kSigAlltoall, kSigAlltoallv, kSigBarrier
};

// Elements of one buffer: their bytes must be a size a process can address (a count near 2^62 wrapped into a few
// bytes, so the shm fast path read far past the buffer and point-to-point moved nothing and returned success).
size_t checked_total(const std::vector<size_t>& counts, DType dt, const char* what) {
  const size_t esz = dtype_size(dt), limit = static_cast<size_t>(PTRDIFF_MAX) / esz;
  size_t total = 0;
  for (size_t c : counts) {
    if (c > limit - total)
      throw InvalidArgument(
          fmt::format("{}: {} elements of {} bytes in all, more than a buffer can hold (allowed: up "
                      "to {} elements)",
                      what, c > limit ? c : total + c, esz, limit));
    total += c;
  }
  return total;
}

// (an op outside the enum reduced nothing: {1,1,1,1} and {2,2,2,2} gave 1 1 2 2)
void check_reduce_op(ReduceOp op, const char* what) {
  if (static_cast<uint32_t>(op) > static_cast<uint32_t>(ReduceOp::prod))
    throw InvalidArgument(fmt::format("{}: reduction op code {} is not one (allowed: sum, avg, min, max, prod)", what,
                                      static_cast<uint32_t>(op)));
}

// A count whose bytes (times `copies`) no buffer can hold: every rank refuses it alike (the ranks agree on counts).
void check_count(size_t count, DType dt, const char* what, size_t copies = 1) {
  const size_t esz = dtype_size(dt), limit = static_cast<size_t>(PTRDIFF_MAX) / esz / copies;
  if (count > limit)
    throw InvalidArgument(
        fmt::format("{}: {} elements of {} bytes{} are more than a buffer can hold (allowed: up to "
                    "{} elements)",
                    what, count, esz, copies > 1 ? fmt::format(" times {} ranks", copies) : "", limit));
}

// A null buffer: this rank's alone (collectives check it inside own_checks).
void check_not_null(const void* p, size_t count, const char* what) {
  if (p == nullptr && count > 0)
    throw InvalidArgument(fmt::format(
        "{}: null buffer for {} elements (allowed: a buffer of that many, or null with a count of 0)", what, count));
}

void check_buffer(const void* p, size_t count, DType dt, const char* what) {
  check_count(count, dt, what);
  check_not_null(p, count, what);
}

// One message of an operation that sends blocks whole (gather, scatter, alltoall, send/recv) must fit the message
// limit: refused before the operation is queued, on the sending and the receiving rank alike (the isend failed inside
// the operation and aborted the transport for every communicator; a receive over it waited out its deadline).
void check_message(size_t bytes, const std::string& what) {
  const uint64_t limit = net::max_message_bytes();
  if (bytes > limit)
    throw ConfigError(
        fmt::format("{} is one message of {} bytes, over CONDUIT_MAX_MESSAGE_BYTES = {}; allowed: up to "
                    "{} bytes (smaller calls), or a larger CONDUIT_MAX_MESSAGE_BYTES on every rank",
                    what, bytes, limit, limit));
}

// Debug mode's fingerprints of count vectors (splitmix64 finalizer: a difference anywhere changes the result).
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
uint64_t counts_hash(const std::vector<size_t>& counts) {
  uint64_t h = counts.size();
  for (size_t c : counts) h = mix64(h ^ c);
  return h;
}
// One term per (sender, receiver, count): summed over every rank's sends and over every rank's receives, equal
// when every send count meets the receive count its peer gave.
uint64_t pair_term(uint64_t from, uint64_t to, uint64_t count) {
  return mix64(mix64(from * 0x100000001b3ull + to) ^ count);
}

// Whether a call of `bytes` may send a message over the message limit at all: none is larger than the vector, but
// for rsg's block (at most one element over n/p).
bool may_pass_limit(size_t bytes) { return double(bytes) + 16 > double(net::max_message_bytes()); }

// The largest single message `algo` sends for this call of `esz`-byte elements: the tuner's bound, and with `even`
// false (reduce_scatter and allgatherv with blocks of different sizes) the whole vector for the halving and doubling
// algorithms (one of their steps may carry nearly all of it: counts {N, 0, 0, 0}).
double largest_message(Communicator& c, CollOp op, const std::string& algo, size_t bytes, size_t esz, bool even) {
  // (rd off a power of two runs the ring)
  if (!even && (algo == "rh" || (algo == "rd" && (c.size() & (c.size() - 1)) == 0))) return double(bytes);
  return c.tuner().largest_message(op, algo, double(bytes), c.size(), c.num_hosts(), c.hosts_uniform_multi(), esz);
}

// The first algorithm of `op` (in the tuner's order) whose messages fit the limit; empty when none does.
std::string fitting_algorithm(Communicator& c, CollOp op, size_t bytes, size_t esz, bool even) {
  for (const auto& a : Tuner::algorithms(op))
    if (largest_message(c, op, a, bytes, esz, even) <= double(net::max_message_bytes())) return a;
  return {};
}

std::string pick(Communicator& c, CollOp op, const std::string& forced, size_t bytes, size_t esz, bool even = true) {
  if (!forced.empty()) {
    Tuner::check_algorithm(op, forced);
    return forced;
  }
  // (the host map decides; building the host groups here made every collective build them, and a host group's own
  // communicators cannot have host groups of their own)
  std::string algo = c.tuner().choose(op, bytes, c.size(), c.num_hosts(), c.hosts_uniform_multi());
  // The tuner passes over algorithms past the limit, from sizes alone; uneven blocks are known here (check_fits
  // refused the call before it was queued when no algorithm fits).
  if (may_pass_limit(bytes) && largest_message(c, op, algo, bytes, esz, even) > double(net::max_message_bytes())) {
    const std::string fits = fitting_algorithm(c, op, bytes, esz, even);
    if (!fits.empty()) algo = fits;
  }
  return algo;
}

// The input a reduction sums: for avg of f16 on more than one rank, a copy divided first (the caller's input stays);
// else `in` itself. `copy` holds the divided copy.
const void* avg_input(const void* in, size_t count, DType dt, ReduceOp op, int ranks, std::vector<char>& copy) {
  if (op != ReduceOp::avg || !avg_divides_first(dt) || ranks <= 1) return in;
  copy.resize(count * dtype_size(dt));
  prescale_avg(in, copy.data(), count, dt, ranks);
  return copy.data();
}
}  // namespace

void Communicator::run_allreduce(const Deadline& d, void* buf, size_t count, DType dt, ReduceOp op,
                                 const std::string& algo) {
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
  if (size() == 1 || count == 0) return;
  if (algo == "ring") ring_allreduce(ctx, buf, count, dt, op);
  else if (algo == "rhd") rhd_allreduce(ctx, buf, count, dt, op);
  else if (algo == "rd") rd_allreduce(ctx, buf, count, dt, op);
  else if (algo == "tree") tree_allreduce(ctx, buf, count, dt, op);
  else if (algo == "hier") {
    // (one host, or one member a host, host groups' own cross and leader groups among them: nothing to split; their
    // host groups could not be built, and a forced hier failed mid-operation)
    if (num_hosts() <= 1 || num_hosts() == size())
      ring_allreduce(ctx, buf, count, dt, op);
    else hier_allreduce(ctx, buf, count, dt, op);
  } else Tuner::check_algorithm(CollOp::allreduce, algo);
}

void Communicator::run_reduce_scatter(const Deadline& d, const void* in, void* out, const std::vector<size_t>& counts,
                                      DType dt, ReduceOp op, const std::string& algo, bool in_place) {
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
  Blocks b(counts);
  const size_t esz = dtype_size(dt);
  char* work;
  std::vector<char> scratch;
  if (in_place) {
    work = static_cast<char*>(const_cast<void*>(in));  // internal callers' own buffer: block r stays at its offset
  } else {
    scratch.assign(static_cast<const char*>(in), static_cast<const char*>(in) + b.total() * esz);
    work = scratch.data();
  }
  if (size() > 1) {
    if (algo == "rh") rh_reduce_scatter_inplace(ctx, work, b, dt, op);
    else ring_reduce_scatter_inplace(ctx, work, b, dt, op);
  }
  if (out != nullptr && b.count[rank_]) std::memcpy(out, work + b.offset[rank_] * esz, b.count[rank_] * esz);
}

void Communicator::run_allgatherv(const Deadline& d, const void* in, void* out, const std::vector<size_t>& counts,
                                  DType dt, const std::string& algo) {
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
  Blocks b(counts);
  const size_t esz = dtype_size(dt);
  char* o = static_cast<char*>(out);
  if (in != nullptr && counts[rank_] && o + b.offset[rank_] * esz != in)
    std::memmove(o + b.offset[rank_] * esz, in, counts[rank_] * esz);
  if (size() == 1) return;
  if (algo == "rd") rd_allgather_inplace(ctx, o, b, esz);
  else ring_allgather_inplace(ctx, o, b, esz);
}

void Communicator::run_broadcast(const Deadline& d, void* buf, size_t count, DType dt, int root,
                                 const std::string& algo) {
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
  if (size() == 1) return;
  if (algo == "chain") chain_broadcast(ctx, buf, count * dtype_size(dt), root);
  else tree_broadcast(ctx, buf, count * dtype_size(dt), root);
}

void Communicator::run_reduce(const Deadline& d, const void* in, void* out, size_t count, DType dt, ReduceOp op,
                              int root, const std::string& algo) {
  const size_t esz = dtype_size(dt);
  const size_t bytes = count * esz;
  if (algo == "rsg" && size() > 1) {
    // Ring reduce-scatter, then every rank's reduced block goes to the root.
    Blocks b(count, size());
    std::vector<char> work(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    run_reduce_scatter(d, work.data(), nullptr, b.count, dt, op, "ring", true);
    Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
    if (rank_ == root) {
      char* o = static_cast<char*>(out);
      std::vector<net::RequestPtr> rs;
      for (int r = 0; r < size(); ++r)
        if (r != root) rs.push_back(ctx.recv(r, o + b.offset[r] * esz, b.count[r] * esz));
      std::memcpy(o + b.offset[root] * esz, work.data() + b.offset[root] * esz, b.count[root] * esz);
      ctx.wait_all(rs);
    } else {
      ctx.wait(ctx.send(root, work.data() + b.offset[rank_] * esz, b.count[rank_] * esz));
    }
    return;
  }
  Ctx ctx(*this, net::make_tag(net::kCollective, id_, static_cast<uint32_t>(next_seq())), d);
  if (rank_ == root) {
    if (out != in && bytes) std::memmove(out, in, bytes);
    tree_reduce_inplace(ctx, out, count, dt, op, root);
  } else {
    std::vector<char> work(static_cast<const char*>(in), static_cast<const char*>(in) + bytes);
    tree_reduce_inplace(ctx, work.data(), count, dt, op, root);
  }
}

void Communicator::check_fits(CollOp op, const std::string& forced, size_t bytes, size_t esz, bool even) {
  if (!forced.empty()) Tuner::check_algorithm(op, forced);
  if (!may_pass_limit(bytes)) return;  // (every call below the limit: nothing more to do)
  // (refused here, before anything is sent: the message failed mid-operation, and the transport was aborted)
  const uint64_t limit = net::max_message_bytes();
  const std::string fits = fitting_algorithm(*this, op, bytes, esz, even);
  if (fits.empty())
    throw ConfigError(
        fmt::format("{} of {} bytes over {} ranks: every {} algorithm would send a message over "
                    "CONDUIT_MAX_MESSAGE_BYTES = {}; allowed: a larger CONDUIT_MAX_MESSAGE_BYTES, or smaller calls",
                    coll_op_name(op), bytes, size(), coll_op_name(op), limit));
  const std::string algo = forced.empty() ? tuner_->forced_algorithm(op, bytes) : forced;
  if (algo.empty()) return;  // the tuner's pick, which pick() keeps within the limit
  const double big = largest_message(*this, op, algo, bytes, esz, even);
  if (big > double(limit))
    throw ConfigError(fmt::format(
        "{} of {} bytes over {} ranks: algorithm {} sends a message of {:.0f} bytes, over CONDUIT_MAX_MESSAGE_BYTES "
        "= {}; allowed: {} (its messages fit), or a larger CONDUIT_MAX_MESSAGE_BYTES",
        coll_op_name(op), bytes, size(), algo, big, limit, fits));
}

Work Communicator::allreduce(void* buf, size_t count, DType dt, ReduceOp op, const CollOptions& o) {
  check_count(count, dt, "allreduce");
  check_reduce_op(op, "allreduce");
  Signature sig{kSigAllreduce, static_cast<uint32_t>(dt), static_cast<uint32_t>(op), -1, count};
  const std::string forced = o.algorithm;
  check_fits(CollOp::allreduce, forced, count * dtype_size(dt), dtype_size(dt), true);
  own_checks("allreduce", [&] { check_not_null(buf, count, "allreduce"); });
  return submit("allreduce", sig, o, [=, this](Ctx& c) {
    // avg of f16 divides each rank's input first (its sum overflows where the average does not).
    const bool divided = op == ReduceOp::avg && avg_divides_first(dt);
    if (divided) prescale_avg(buf, buf, count, dt, size());
    // Small vectors of a communicator spanning every rank of a shared-memory transport skip messages altogether
    // (unless an algorithm is forced, by the call or by a rule): each rank publishes its vector in its segment and
    // reduces everyone's.
    if (forced.empty() && fast_allreduce_ok_ && count > 0 && count * dtype_size(dt) <= fast_allreduce_bytes_ &&
        !tuner_->forced_at(CollOp::allreduce, count * dtype_size(dt))) {
      transport_->fast_allreduce(buf, count, dt, op, c.deadline());
      if (op == ReduceOp::avg && !divided) finalize_avg(buf, count, dt, size());
      return std::string("shm-fast");
    }
    std::string algo = pick(*this, CollOp::allreduce, forced, count * dtype_size(dt), dtype_size(dt));
    // what runs (and is reported) on one host, or with one member a host
    if (algo == "hier" && (num_hosts() <= 1 || num_hosts() == size())) algo = "ring";
    run_allreduce(c.deadline(), buf, count, dt, op, algo);
    if (op == ReduceOp::avg && !divided) finalize_avg(buf, count, dt, size());
    return algo;
  });
}

Work Communicator::reduce_scatter(const void* in, void* out, std::vector<size_t> counts, DType dt, ReduceOp op,
                                  const CollOptions& o) {
  check_counts(counts, "reduce_scatter");
  size_t total = checked_total(counts, dt, "reduce_scatter input");
  check_reduce_op(op, "reduce_scatter");
  Signature sig{kSigReduceScatter, static_cast<uint32_t>(dt), static_cast<uint32_t>(op), -1, total};
  if (debug_) sig.counts_hash = counts_hash(counts);
  const std::string forced = o.algorithm;
  const bool even = std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
  check_fits(CollOp::reduce_scatter, forced, total * dtype_size(dt), dtype_size(dt), even);
  own_checks("reduce_scatter", [&] {
    check_not_null(in, total, "reduce_scatter input");
    check_not_null(out, counts[rank_], "reduce_scatter output");
  });
  return submit("reduce_scatter", sig, o, [=, this](Ctx& c) {
    std::string algo = pick(*this, CollOp::reduce_scatter, forced, total * dtype_size(dt), dtype_size(dt), even);
    std::vector<char> divided;
    run_reduce_scatter(c.deadline(), avg_input(in, total, dt, op, size(), divided), out, counts, dt, op, algo);
    if (op == ReduceOp::avg && !avg_divides_first(dt)) finalize_avg(out, counts[rank_], dt, size());
    return algo;
  });
}

Work Communicator::reduce_scatter(const void* in, void* out, size_t recv_count, DType dt, ReduceOp op,
                                  const CollOptions& o) {
  return reduce_scatter(in, out, std::vector<size_t>(size(), recv_count), dt, op, o);
}

Work Communicator::allgather(const void* in, void* out, size_t count, DType dt, const CollOptions& o) {
  return allgatherv(in, out, std::vector<size_t>(size(), count), dt, o);
}

Work Communicator::allgatherv(const void* in, void* out, std::vector<size_t> counts, DType dt, const CollOptions& o) {
  check_counts(counts, "allgatherv");
  size_t total = checked_total(counts, dt, "allgather output");
  Signature sig{kSigAllgatherv, static_cast<uint32_t>(dt), 0, -1, total};
  if (debug_) sig.counts_hash = counts_hash(counts);
  const std::string forced = o.algorithm;
  const bool even = std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
  check_fits(CollOp::allgather, forced, total * dtype_size(dt), dtype_size(dt), even);
  own_checks("allgather", [&] {
    check_not_null(in, counts[rank_], "allgather input");
    check_not_null(out, total, "allgather output");
  });
  return submit("allgather", sig, o, [=, this](Ctx& c) {
    std::string algo = pick(*this, CollOp::allgather, forced, total * dtype_size(dt), dtype_size(dt), even);
    // (recursive doubling needs a power of two ranks and runs the ring elsewhere: reported as what ran)
    if (algo == "rd" && (size() & (size() - 1)) != 0) algo = "ring";
    run_allgatherv(c.deadline(), in, out, counts, dt, algo);
    return algo;
  });
}

Work Communicator::broadcast(void* buf, size_t count, DType dt, int root, const CollOptions& o) {
  check_root(root, "broadcast");
  check_count(count, dt, "broadcast");
  Signature sig{kSigBroadcast, static_cast<uint32_t>(dt), 0, root, count};
  const std::string forced = o.algorithm;
  check_fits(CollOp::broadcast, forced, count * dtype_size(dt), dtype_size(dt), true);
  own_checks("broadcast", [&] { check_not_null(buf, count, "broadcast"); });
  return submit("broadcast", sig, o, [=, this](Ctx& c) {
    std::string algo = pick(*this, CollOp::broadcast, forced, count * dtype_size(dt), dtype_size(dt));
    run_broadcast(c.deadline(), buf, count, dt, root, algo);
    return algo;
  });
}

Work Communicator::reduce(const void* in, void* out, size_t count, DType dt, ReduceOp op, int root,
                          const CollOptions& o) {
  check_root(root, "reduce");
  check_count(count, dt, "reduce input");
  check_reduce_op(op, "reduce");
  Signature sig{kSigReduce, static_cast<uint32_t>(dt), static_cast<uint32_t>(op), root, count};
  const std::string forced = o.algorithm;
  check_fits(CollOp::reduce, forced, count * dtype_size(dt), dtype_size(dt), true);
  own_checks("reduce", [&] {
    check_not_null(in, count, "reduce input");
    if (rank_ == root) check_not_null(out, count, "reduce output");
  });
  return submit("reduce", sig, o, [=, this](Ctx& c) {
    std::string algo = pick(*this, CollOp::reduce, forced, count * dtype_size(dt), dtype_size(dt));
    std::vector<char> divided;
    run_reduce(c.deadline(), avg_input(in, count, dt, op, size(), divided), out, count, dt, op, root, algo);
    if (op == ReduceOp::avg && rank_ == root && !avg_divides_first(dt)) finalize_avg(out, count, dt, size());
    return algo;
  });
}

namespace {
// At the root of gather (in: one block, out: all) or scatter (the reverse), the one block may be the root's own slot
// of the whole buffer (in place) or lie apart from it; any other overlap is overwritten by the other ranks' blocks
// before it is moved, or moved over a block still being sent (in == out gathered rank 0's block into the root's).
void check_root_block(const void* block, const void* all, size_t bytes, int root, int size, const char* op) {
  const auto* b = static_cast<const char*>(block);
  const auto* a = static_cast<const char*>(all);
  if (size <= 1 || bytes == 0 || b == a + static_cast<size_t>(root) * bytes) return;
  if (b < a + bytes * static_cast<size_t>(size) && a < b + bytes)
    throw InvalidArgument(
        fmt::format("{}: at the root the block overlaps the whole buffer other than at the root's own "
                    "slot; allowed: separate buffers, or the block at the root's slot (in place)",
                    op));
}
}  // namespace

// The one algorithm an operation has: CollOptions::algorithm may name it or be empty (another name was taken without a
// word: "ring" for a gather ran the linear gather).
static void check_only_algorithm(const CollOptions& o, const char* op, const char* only) {
  if (!o.algorithm.empty() && o.algorithm != only)
    throw ConfigError(fmt::format("unknown {} algorithm '{}': allowed is {} (or none given)", op, o.algorithm, only));
}

Work Communicator::gather(const void* in, void* out, size_t count, DType dt, int root, const CollOptions& o) {
  check_only_algorithm(o, "gather", "linear");
  check_root(root, "gather");
  check_count(count, dt, "gather input", size());  // (and the root's count x size(): its whole output)
  if (size() > 1) check_message(count * dtype_size(dt), fmt::format("gather over {} ranks: each rank's block", size()));
  own_checks("gather", [&] {
    check_not_null(in, count, "gather input");
    if (rank_ == root) check_not_null(out, count * size(), "gather output");
    if (rank_ == root) check_root_block(in, out, count * dtype_size(dt), root, size(), "gather");
  });
  Signature sig{kSigGather, static_cast<uint32_t>(dt), 0, root, count};
  return submit("gather", sig, o, [=](Ctx& c) {
    linear_gather(c, in, out, count * dtype_size(dt), root);
    return std::string("linear");
  });
}

Work Communicator::scatter(const void* in, void* out, size_t count, DType dt, int root, const CollOptions& o) {
  check_only_algorithm(o, "scatter", "linear");
  check_root(root, "scatter");
  check_count(count, dt, "scatter output", size());  // (and the root's count x size(): its whole input)
  if (size() > 1)
    check_message(count * dtype_size(dt), fmt::format("scatter over {} ranks: each rank's block", size()));
  own_checks("scatter", [&] {
    check_not_null(out, count, "scatter output");
    if (rank_ == root) check_not_null(in, count * size(), "scatter input");
    if (rank_ == root) check_root_block(out, in, count * dtype_size(dt), root, size(), "scatter");
  });
  Signature sig{kSigScatter, static_cast<uint32_t>(dt), 0, root, count};
  return submit("scatter", sig, o, [=](Ctx& c) {
    linear_scatter(c, in, out, count * dtype_size(dt), root);
    return std::string("linear");
  });
}

Work Communicator::alltoall(const void* in, void* out, size_t count, DType dt, const CollOptions& o) {
  // (every rank knows every block's size here, and refuses alike: no abort, as alltoallv's for a block two ranks see)
  if (size() > 1) check_message(count * dtype_size(dt), fmt::format("alltoall over {} ranks: each block", size()));
  return alltoallv(in, std::vector<size_t>(size(), count), out, std::vector<size_t>(size(), count), dt, o);
}

Work Communicator::alltoallv(const void* in, std::vector<size_t> send_counts, void* out,
                             std::vector<size_t> recv_counts, DType dt, const CollOptions& o) {
  check_only_algorithm(o, "alltoall", "pairwise");
  // (every count here is this rank's own: each rank sends and receives blocks of its own sizes)
  const size_t esz = dtype_size(dt);
  std::vector<size_t> sb(size()), rb(size());
  size_t st = 0, rt = 0;
  own_checks("alltoall", [&] {
    check_counts(send_counts, "alltoallv send_counts");
    check_counts(recv_counts, "alltoallv recv_counts");
    if (send_counts[rank_] != recv_counts[rank_])
      throw InvalidArgument(
          fmt::format("alltoallv: rank {} sends {} elements to itself but expects {}; allowed: the same count", rank_,
                      send_counts[rank_], recv_counts[rank_]));
    checked_total(send_counts, dt, "alltoallv input");
    checked_total(recv_counts, dt, "alltoallv output");
    for (int i = 0; i < size(); ++i) {
      sb[i] = send_counts[i] * esz;
      rb[i] = recv_counts[i] * esz;
    }
    st = std::accumulate(sb.begin(), sb.end(), size_t{0});
    rt = std::accumulate(rb.begin(), rb.end(), size_t{0});
    check_not_null(in, st / esz, "alltoallv input");
    check_not_null(out, rt / esz, "alltoallv output");
    // Receives land in out while sends still read in: overlapping buffers would be overwritten before they are sent.
    const auto* ib = static_cast<const char*>(in);
    const auto* ob = static_cast<const char*>(out);
    if (size() > 1 && st > 0 && rt > 0 && ib < ob + rt && ob < ib + st)
      throw InvalidArgument("alltoall: the input and output buffers overlap; allowed: separate buffers");
  });
  try {
    for (int i = 0; i < size(); ++i) {
      if (i == rank_) continue;  // (copied, not sent)
      check_message(sb[i], fmt::format("alltoallv: rank {}'s block for rank {}", rank_, i));
      check_message(rb[i], fmt::format("alltoallv: rank {}'s block from rank {}", rank_, i));
    }
  } catch (const ConfigError& e) {
    // Only the two ranks of the block know its size: with more, the others would wait in the call for this rank (and
    // a caller going on after the refusal could meet their messages in its next call); refused as own_checks does.
    if (size() > 2) refuse("alltoall", e);
    throw;
  }
  Signature sig{kSigAlltoallv, static_cast<uint32_t>(dt), 0, -1, 0};
  for (int i = 0; debug_ && i < size(); ++i) {
    sig.pairs_sent += pair_term(static_cast<uint64_t>(rank_), static_cast<uint64_t>(i), send_counts[i]);
    sig.pairs_received += pair_term(static_cast<uint64_t>(i), static_cast<uint64_t>(rank_), recv_counts[i]);
  }
  return submit("alltoall", sig, o, [=](Ctx& c) {
    pairwise_alltoallv(c, static_cast<const char*>(in), sb, static_cast<char*>(out), rb);
    return std::string("pairwise");
  });
}

Work Communicator::barrier(const CollOptions& o) {
  check_only_algorithm(o, "barrier", "dissemination");
  Signature sig{kSigBarrier, 0, 0, -1, 0};
  return submit("barrier", sig, o, [](Ctx& c) {
    dissemination_barrier(c);
    return std::string("dissemination");
  });
}

Work Communicator::p2p(bool is_send, void* buf, size_t count, DType dt, int peer, uint32_t tag,
                       const CollOptions& o) {
  const char* what = is_send ? "send" : "recv";
  if (peer < 0 || peer >= size() || peer == rank_)
    throw InvalidArgument(fmt::format("{}: peer {} is not another rank of [0, {})", what, peer, size()));
  check_buffer(buf, count, dt, what);
  check_message(count * dtype_size(dt),
                fmt::format("{} {} rank {} (tag {})", what, is_send ? "to" : "from", peer, tag));
  const double timeout_s = effective_timeout(o);  // (refused before the request is posted on the caller's buffer)
  uint64_t t = net::make_tag(net::kUser, id_, tag);
  size_t bytes = count * dtype_size(dt);
  auto state = std::make_shared<Work::State>();
  // Point-to-point does not go through the worker queue: the Work waits on the transport request itself.
  state->request = is_send ? transport_->isend(members_[peer], t, buf, bytes)
                           : transport_->irecv(members_[peer], t, buf, bytes);
  state->transport = transport_;
  state->deadline = Deadline::after(timeout_s);
  state->algorithm = "p2p";
  state->what = fmt::format("{} {} rank {} (tag {}) on {}", what, is_send ? "to" : "from", peer, tag, describe());
  return Work(state);
}

Work Communicator::send(const void* buf, size_t count, DType dt, int peer, uint32_t tag, const CollOptions& o) {
  return p2p(true, const_cast<void*>(buf), count, dt, peer, tag, o);
}

Work Communicator::recv(void* buf, size_t count, DType dt, int peer, uint32_t tag, const CollOptions& o) {
  return p2p(false, buf, count, dt, peer, tag, o);
}

}  // namespace conduit::coll
