#include "net/matching.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"

namespace conduit::net {

PostedRecv make_recv(Request::Kind kind, int peer, uint64_t tag, void* dst, size_t bytes) {
  PostedRecv r;
  r.req = std::make_shared<Request>(kind, peer, tag, bytes);
  r.dst = static_cast<char*>(dst);
  r.bytes = bytes;
  return r;
}

PostedRecv make_reduce_recv(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) {
  PostedRecv r = make_recv(Request::Kind::recv, peer, tag, dst, count * dtype_size(dtype));
  r.reduce = true;
  r.count = count;
  r.dtype = dtype;
  r.op = op;
  return r;
}

void fail_wrong_size(PostedRecv& r, size_t got, const char* transport) {
  RequestPtr req = std::move(r.req);
  r = PostedRecv{};
  req->fail(std::make_exception_ptr(
      ProtocolError(fmt::format("{}: from rank {}: message of {} bytes on tag {:#x} but the receive expects {} bytes",
                                transport, req->peer(), got, req->tag(), req->bytes()))));
}

void deliver(const Unexpected& u, PostedRecv& r, const char* transport) {
  if (u.data.size() != r.bytes) return fail_wrong_size(r, u.data.size(), transport);
  if (r.reduce) reduce_into(r.dst, u.data.data(), r.count, r.dtype, r.op);
  else if (r.bytes) std::memcpy(r.dst, u.data.data(), r.bytes);
  r.req->complete();
}

std::deque<std::shared_ptr<Unexpected>>& MatchQueues::unexpected_queue(uint64_t tag) {
  auto [it, made] = unexpected_.try_emplace(tag);
  if (made) unexpected_bytes_ += kTagOverhead;
  return it->second;
}

MatchQueues::UnexpectedQueues::iterator MatchQueues::drop_queue(UnexpectedQueues::iterator it) {
  unexpected_bytes_ -= kTagOverhead;
  return unexpected_.erase(it);
}

bool MatchQueues::take_unexpected(uint64_t tag, PostedRecv& r, const char* transport) {
  auto it = unexpected_.find(tag);
  if (it == unexpected_.end() || it->second.empty()) return false;
  auto u = it->second.front();
  it->second.pop_front();
  if (it->second.empty()) drop_queue(it);
  if (u->complete) {
    unexpected_bytes_ -= u->data.size() + kMessageOverhead;
    deliver(*u, r, transport);
  } else {
    u->has_waiter = true;
    u->waiter = std::move(r);
    arriving_.push_back(u);
  }
  return true;
}

bool MatchQueues::pop_posted(uint64_t tag, PostedRecv* out) {
  auto it = posted_.find(tag);
  if (it == posted_.end() || it->second.empty()) return false;
  *out = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) posted_.erase(it);
  return true;
}

bool MatchQueues::cancel(const Request* req) {
  auto it = posted_.find(req->tag());
  if (it != posted_.end()) {
    auto& q = it->second;
    auto pos = std::find_if(q.begin(), q.end(), [&](const PostedRecv& r) { return r.req.get() == req; });
    if (pos != q.end()) {
      q.erase(pos);
      if (q.empty()) posted_.erase(it);
      return true;
    }
  }
  auto a = std::find_if(arriving_.begin(), arriving_.end(), [&](const std::shared_ptr<Unexpected>& u) {
    return u->has_waiter && u->waiter.req.get() == req;
  });
  if (a == arriving_.end()) return false;
  std::shared_ptr<Unexpected> u = *a;
  // It was the oldest message of its tag when the receive took it, and messages of a tag are matched in order: it
  // goes to the oldest receive of the tag posted since (which found nothing buffered), or back to the front of the
  // buffered messages.
  PostedRecv next;
  if (pop_posted(req->tag(), &next)) {
    u->waiter = std::move(next);
    return true;
  }
  arriving_.erase(a);
  u->has_waiter = false;
  u->waiter = PostedRecv{};
  unexpected_queue(req->tag()).push_front(std::move(u));
  return true;
}

std::shared_ptr<Unexpected> MatchQueues::add_unexpected(uint64_t tag, size_t bytes) {
  auto u = std::make_shared<Unexpected>();
  u->data.resize(bytes);
  unexpected_queue(tag).push_back(u);
  unexpected_bytes_ += bytes + kMessageOverhead;  // (once it is held; a failed push may leave its new, empty queue)
  return u;
}

std::shared_ptr<Unexpected> MatchQueues::add_remote(uint64_t tag) {
  auto u = std::make_shared<Unexpected>();
  unexpected_queue(tag).push_back(u);
  unexpected_bytes_ += kMessageOverhead;
  return u;
}

PostedRecv MatchQueues::take_waiter(Unexpected& u) {
  PostedRecv r = std::move(u.waiter);
  u.waiter = PostedRecv{};
  u.has_waiter = false;
  u.complete = true;
  unexpected_bytes_ -= u.data.size() + kMessageOverhead;  // (delivered: it leaves the queues)
  arriving_.erase(std::remove_if(arriving_.begin(), arriving_.end(),
                                 [&](const std::shared_ptr<Unexpected>& p) { return p.get() == &u; }),
                  arriving_.end());
  return r;
}

void MatchQueues::complete_unexpected(Unexpected& u, const char* transport) {
  u.complete = true;
  if (!u.has_waiter) return;
  // It left the unexpected queue when the receive attached; deliver now.
  unexpected_bytes_ -= u.data.size() + kMessageOverhead;
  deliver(u, u.waiter, transport);
  arriving_.erase(std::remove_if(arriving_.begin(), arriving_.end(),
                                 [&](const std::shared_ptr<Unexpected>& p) { return p.get() == &u; }),
                  arriving_.end());
}

void MatchQueues::fail_all(std::exception_ptr err, bool keep_arrived) {
  for (auto& [tag, q] : posted_)
    for (auto& r : q) r.req->fail(err);
  posted_.clear();
  for (auto& u : arriving_) {
    if (u->has_waiter) u->waiter.req->fail(err);
    // (out of the unexpected queue since a receive attached, its bytes still counted: they stayed against the
    // budget for good, and the failed receive stayed its waiter)
    unexpected_bytes_ -= u->data.size() + kMessageOverhead;
    u->has_waiter = false;
    u->waiter = PostedRecv{};
  }
  arriving_.clear();
  if (!keep_arrived) {
    unexpected_.clear();
    unexpected_bytes_ = 0;
    return;
  }
  for (auto it = unexpected_.begin(); it != unexpected_.end();) {
    std::erase_if(it->second, [&](const std::shared_ptr<Unexpected>& u) {
      if (u->complete) return false;
      unexpected_bytes_ -= u->data.size() + kMessageOverhead;
      return true;
    });
    it = it->second.empty() ? drop_queue(it) : std::next(it);
  }
}

}  // namespace conduit::net
