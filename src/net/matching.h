#pragma once
// Receive matching shared by the byte-stream transports (tcp, shm): per peer, receives posted before their message
// arrives and messages that arrive before their receive (buffered up to a budget), both FIFO per tag, so the
// non-overtaking rule of transport.h holds.
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <vector>

#include "net/transport.h"

namespace conduit::net {

struct PostedRecv {
  RequestPtr req;
  char* dst = nullptr;
  size_t bytes = 0;
  bool reduce = false;  // dst = op(dst, incoming) instead of a copy
  size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
};

PostedRecv make_recv(Request::Kind kind, int peer, uint64_t tag, void* dst, size_t bytes);
PostedRecv make_reduce_recv(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op);

struct Unexpected {
  std::vector<char> data;
  bool complete = false;
  bool has_waiter = false;  // a receive matched it while its bytes were still arriving
  PostedRecv waiter;
};

class MatchQueues {
 public:
  // A receive just posted: takes the oldest buffered message of its tag if there is one (delivering it now when
  // complete, or attaching the receive to it) and returns true; false when the receive must wait in the queue.
  bool take_unexpected(uint64_t tag, PostedRecv& r, const char* transport);
  void post(uint64_t tag, PostedRecv r) { posted_[tag].push_back(std::move(r)); }
  // The oldest posted receive of `tag`, if any.
  bool pop_posted(uint64_t tag, PostedRecv* out);
  // What a buffered message costs besides its payload (its record and queue slot), counted against the budget with
  // its bytes: a peer sending many empty or tiny messages nobody receives grew memory without bound within a
  // budget of payload bytes alone.
  static constexpr size_t kMessageOverhead = 128;
  // And a tag's queue while it holds messages (its map node, the deque's first 512-byte block and block map): a peer
  // sending empty messages of ever new tags grew a rank by ~850 bytes a message against the budget's 128.
  static constexpr size_t kTagOverhead = 768;
  // Room for one more buffered message of `bytes` within `budget`? (The messages held count with their overhead; one
  // message within the budget always fits an empty queue, so a budget under the overhead still buffers one.)
  bool can_buffer(size_t bytes, size_t budget) const { return unexpected_bytes_ + bytes <= budget; }
  // What the buffered messages count against the budget now (with their overhead).
  size_t unexpected_bytes() const { return unexpected_bytes_; }
  std::shared_ptr<Unexpected> add_unexpected(uint64_t tag, size_t bytes);
  // A message whose bytes stay in its sender's memory for now (shm single copy): its data is empty and only its
  // overhead counts against the budget until the transport reads them into the receive that takes it (take_waiter), or
  // into data once it has waited long enough for one (charge, then complete_unexpected).
  std::shared_ptr<Unexpected> add_remote(uint64_t tag);
  // A message of add_remote is being read into its data after all: its bytes count against the budget from now on.
  void charge(size_t bytes) { unexpected_bytes_ += bytes; }
  // A message of add_remote with a receive attached: detaches that receive (returned), for the transport to read the bytes
  // into and complete, and marks the message delivered.
  PostedRecv take_waiter(Unexpected& u);
  // The message's bytes have all arrived: deliver it if a receive is attached.
  void complete_unexpected(Unexpected& u, const char* transport);
  bool has_posted() const { return !posted_.empty(); }
  // Withdraws a receive that is posted, or attached to a message still arriving (which goes back to the front of
  // its tag's buffered messages for the next receive). False when this peer's queues do not hold it.
  bool cancel(const Request* req);
  // Fails every posted receive and attached waiter and drops partly arrived messages. Messages that arrived whole
  // are dropped too unless `keep_arrived`: a peer that sent and then exited or closed its connection has delivered
  // them, and a receive posted later must still get them (an abort drops them: nothing is delivered after one).
  void fail_all(std::exception_ptr err, bool keep_arrived = false);

 private:
  std::map<uint64_t, std::deque<PostedRecv>> posted_;
  using UnexpectedQueues = std::map<uint64_t, std::deque<std::shared_ptr<Unexpected>>>;
  UnexpectedQueues unexpected_;
  std::vector<std::shared_ptr<Unexpected>> arriving_;  // matched while arriving (for fail_all)
  // The buffered messages of `tag`, its queue made (and its overhead counted) when it has none.
  std::deque<std::shared_ptr<Unexpected>>& unexpected_queue(uint64_t tag);
  // Removes an empty queue and its overhead.
  UnexpectedQueues::iterator drop_queue(UnexpectedQueues::iterator it);
  size_t unexpected_bytes_ = 0;
};

// Removes a send that has not started (nothing of it written) from a send queue (elements with `req` and `sent`).
template <class Queue>
bool cancel_unstarted_send(Queue& q, const Request* req) {
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (it->req.get() != req) continue;
    if (it->sent > 0) return false;
    q.erase(it);
    return true;
  }
  return false;
}

// Copies or reduces a buffered message into its receive and completes it; ProtocolError on a size mismatch.
void deliver(const Unexpected& u, PostedRecv& r, const char* transport);
// A receive matched by a message of another size: fails it with a ProtocolError naming both sizes (the message is
// consumed: deliver drops it, tcp and shm read past its payload) and clears `r`.
void fail_wrong_size(PostedRecv& r, size_t got, const char* transport);

}  // namespace conduit::net
