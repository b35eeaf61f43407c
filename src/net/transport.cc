#include "net/transport.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "core/error.h"
#include "net/tags.h"

namespace conduit::net {

bool Request::test() {
  if (progressor_ != nullptr && !done()) progressor_->progress();
  int s = state_.load(std::memory_order_acquire);
  if (s == kFailed) std::rethrow_exception(error_);
  return s == kDone;
}

void Request::wait(const Deadline& deadline) {
  if (progressor_ != nullptr) {
    while (!done()) {
      // (Progress elsewhere, another request's data moving, does not put off the deadline.)
      if (progressor_->progress() && !deadline.expired()) continue;
      if (done()) break;
      if (deadline.expired()) break;
      progressor_->wait_for_activity(deadline);
    }
  } else if (!done()) {
    std::unique_lock<std::mutex> lk(mu_);
    if (deadline.is_never()) {
      cv_.wait(lk, [&] { return done(); });
    } else {
      cv_.wait_until(lk, deadline.at(), [&] { return done(); });
    }
  }
  int s = state_.load(std::memory_order_acquire);
  if (s == kFailed) std::rethrow_exception(error_);
  if (s != kDone) {
    const std::string note = notes_ ? notes_->get(peer_) : std::string();
    throw TimeoutError(fmt::format("{} of {} bytes with rank {} (tag {:#x}) did not complete before the deadline{}{}",
                                   kind_ == Kind::send ? "send" : "receive", bytes_, peer_, tag_,
                                   note.empty() ? "" : "; ", note));
  }
}

void PeerNotes::set(int peer, std::string note) {
  std::lock_guard<std::mutex> lk(mu_);
  notes_[peer] = std::move(note);
}

void PeerNotes::clear(int peer) {
  std::lock_guard<std::mutex> lk(mu_);
  notes_.erase(peer);
}

std::string PeerNotes::get(int peer) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = notes_.find(peer);
  return it == notes_.end() ? std::string() : it->second;
}

void Request::complete() {
  if (state_.load(std::memory_order_acquire) != kPending) return;  // failed meanwhile (cancelled, aborted)
  on_complete();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_.load() != kPending) return;
    state_.store(kDone, std::memory_order_release);
  }
  cv_.notify_all();
}

void Request::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (state_.load() != kPending) return;
    error_ = std::move(error);
    state_.store(kFailed, std::memory_order_release);
  }
  cv_.notify_all();
}

void Transport::fast_allreduce(void*, size_t, DType, ReduceOp, const Deadline&) {
  throw InvalidArgument(fmt::format("{}: no shared-memory fast allreduce (check fast_allreduce_max_bytes first)",
                                    name()));
}

void check_tag(const char* transport, const char* op, uint64_t tag) {
  if (tag_valid(tag)) return;
  throw InvalidArgument(fmt::format(
      "{}: {} with tag {:#x} is invalid: its kind byte (bits 56..63) is {}; allowed: {} to {} (collective, user, "
      "debug, control; see net/tags.h)",
      transport, op, tag, tag_kind(tag), static_cast<int>(kCollective), static_cast<int>(kControl)));
}

int Transport::num_hosts() const {
  return static_cast<int>(std::set<int>(hosts_.begin(), hosts_.end()).size());
}

std::string Transport::aborted_reason() const {
  if (!aborted_flag_.load(std::memory_order_acquire)) return {};  // every operation asks: no lock when healthy
  std::lock_guard<std::mutex> lk(abort_mu_);
  return aborted_;
}

void Transport::set_aborted(const std::string& reason) {
  std::lock_guard<std::mutex> lk(abort_mu_);
  const bool first = aborted_.empty();
  if (first) aborted_ = reason.empty() ? "aborted" : reason;
  aborted_flag_.store(true, std::memory_order_release);
  if (first && abort_listener_) abort_listener_(aborted_);
}

namespace {
// A receive that lands in a staging buffer and is reduced into the destination when it completes.
class StagedReduceRequest : public Request {
 public:
  StagedReduceRequest(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op)
      : Request(Kind::recv, peer, tag, count * dtype_size(dtype)),
        dst_(dst), count_(count), dtype_(dtype), op_(op), staging_(count * dtype_size(dtype)) {}
  void attach(RequestPtr inner) { inner_ = std::move(inner); }
  bool poll() {
    if (done()) return true;
    // One thread at a time: two testing it (a waiter and give_up) both passed done() and added the data twice.
    std::lock_guard<std::mutex> lk(poll_mu_);
    if (done()) return true;
    if (!inner_->test()) return false;
    reduce_into(dst_, staging_.data(), count_, dtype_, op_);
    complete();
    return true;
  }
  char* staging() { return staging_.data(); }
  RequestPtr inner_;

 private:
  std::mutex poll_mu_;
  void* dst_;
  size_t count_;
  DType dtype_;
  ReduceOp op_;
  std::vector<char> staging_;
};

// Drives a staged request: waiting on it waits on the inner receive, then reduces.
class StagedProgressor : public Progressor {
 public:
  explicit StagedProgressor(StagedReduceRequest* r) : r_(r) {}
  bool progress() override {
    try {
      return r_->poll();
    } catch (...) {
      r_->fail(std::current_exception());
      return true;
    }
  }
  void wait_for_activity(const Deadline& until) override {
    try {
      r_->inner_->wait(until);
    } catch (const TimeoutError&) {
    } catch (...) {
      r_->fail(std::current_exception());
    }
  }

 private:
  StagedReduceRequest* r_;
};

class OwningStaged : public StagedReduceRequest {
 public:
  using StagedReduceRequest::StagedReduceRequest;
  StagedProgressor prog_{this};
};
}  // namespace

RequestPtr Transport::irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) {
  auto r = std::make_shared<OwningStaged>(peer, tag, dst, count, dtype, op);
  r->attach(irecv(peer, tag, r->staging(), count * dtype_size(dtype)));
  r->set_progressor(&r->prog_);
  return r;
}

bool Transport::cancel(const RequestPtr&, std::exception_ptr) { return false; }

namespace {
// Staged requests whose inner receive could not be withdrawn: the transport may still write their staging buffers,
// so they are kept for the life of the process (only after a transport abort, which ends its use).
std::mutex g_abandoned_mu;
std::vector<RequestPtr> g_abandoned;
}  // namespace

bool give_up(Transport& t, const RequestPtr& r, const std::string& why) {
  if (r->succeeded()) return true;
  if (r->done()) return false;
  auto error = std::make_exception_ptr(TimeoutError(why));
  if (auto* staged = dynamic_cast<StagedReduceRequest*>(r.get())) {
    // The transport knows the inner receive into the request's own staging buffer; the caller's buffer is written
    // only by poll(), in a waiting thread, and never once the request has failed.
    if (t.cancel(staged->inner_, error) || (staged->inner_->done() && !staged->inner_->succeeded())) {
      r->fail(error);
      return false;
    }
    if (staged->inner_->succeeded()) {
      try {
        if (staged->poll()) return r->succeeded();
      } catch (...) {
        r->fail(std::current_exception());
        return false;
      }
    }
    t.abort(fmt::format("{} (its data was already moving, so the transport stops)", why));
    r->fail(error);
    std::lock_guard<std::mutex> lk(g_abandoned_mu);
    g_abandoned.push_back(r);
    return false;
  }
  if (t.cancel(r, error)) return false;
  if (r->succeeded()) return true;  // it finished while the transport was asked
  if (r->done()) return false;
  t.abort(
      fmt::format("{} (its data was already moving, so the transport stops rather than touch the caller's "
                  "buffer later)",
                  why));
  return r->succeeded();
}

void wait_all_or_give_up(Transport& t, const std::vector<RequestPtr>& reqs, const Deadline& deadline) {
  try {
    wait_all(reqs, deadline);
  } catch (const Error& e) {
    for (const auto& r : reqs) give_up(t, r, e.what());
    throw;
  } catch (...) {  // (anything else too: the caller's buffers are freed as it unwinds)
    for (const auto& r : reqs) give_up(t, r, "the wait ended with an exception");
    throw;
  }
}

void wait_all(const std::vector<RequestPtr>& reqs, const Deadline& deadline) {
  // The first failure (or the deadline) ends the wait; the caller then aborts the transport, which fails the rest,
  // or gives them up (wait_all_or_give_up).
  for (const auto& r : reqs) r->wait(deadline);
}

}  // namespace conduit::net
