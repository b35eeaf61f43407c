#include "net/inproc.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "core/error.h"
#include "net/tags.h"

namespace conduit::net {

struct InprocOp {
  RequestPtr req;
  const void* src = nullptr;  // sends
  void* dst = nullptr;        // receives
  size_t bytes = 0;
  bool reduce = false;
  size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
};

class InprocWorld {
 public:
  explicit InprocWorld(int size) : boxes_(size), gone(static_cast<size_t>(size), 0) {}
  struct Box {
    std::mutex mu;
    std::map<std::pair<int, uint64_t>, std::deque<InprocOp>> sends, recvs;
  };
  std::vector<Box> boxes_;
  std::mutex abort_mu;
  std::string aborted;
  std::vector<Transport*> members;
  std::vector<char> gone;  // (under abort_mu) ranks whose transport was destroyed

  // Moves a matched pair's data and completes both requests; called under the mailbox's lock, so that a cancel
  // (which takes it) finds the operation either still queued or done (completion only sets the requests' state and
  // wakes their waiters).
  static void deliver(const InprocOp& send, const InprocOp& recv) {
    if (send.bytes != recv.bytes) {
      auto err = std::make_exception_ptr(ProtocolError(
          fmt::format("message size mismatch on tag {:#x}: rank {} sent {} bytes, rank {} expected {} bytes",
                      send.req->tag(), recv.req->peer(), send.bytes, send.req->peer(), recv.bytes)));
      send.req->fail(err);
      recv.req->fail(err);
      return;
    }
    if (recv.reduce) {
      reduce_into(recv.dst, send.src, recv.count, recv.dtype, recv.op);
    } else if (send.bytes > 0) {
      std::memcpy(recv.dst, send.src, send.bytes);
    }
    recv.req->complete();
    send.req->complete();
  }
};

namespace {

class InprocTransport : public Transport {
 public:
  InprocTransport(std::shared_ptr<InprocWorld> world, int rank, int size, std::vector<int> hosts)
      : world_(std::move(world)) {
    rank_ = rank;
    size_ = size;
    hosts_ = std::move(hosts);
  }
  // Leaves the world's members, so that another rank's abort does not reach a transport destroyed already, and takes
  // its operations out of the mailboxes: a peer's later send matched a receive of this rank and wrote into its
  // caller's buffer, freed by then. Later operations with this rank fail at once.
  ~InprocTransport() override {
    {
      std::lock_guard<std::mutex> lk(world_->abort_mu);
      std::erase(world_->members, this);
      world_->gone[static_cast<size_t>(rank_)] = 1;
    }
    auto err = std::make_exception_ptr(PeerError(fmt::format("inproc: rank {}'s transport was destroyed", rank_)));
    for (int b = 0; b < size_; ++b) {
      auto& box = world_->boxes_[static_cast<size_t>(b)];
      std::lock_guard<std::mutex> lk(box.mu);
      for (auto* table : {&box.sends, &box.recvs})
        for (auto it = table->begin(); it != table->end();) {
          // This rank's receives (its own box) and its sends (keyed by it in the others'), and what waits for it.
          if (b == rank_ || it->first.first == rank_) {
            for (auto& op : it->second) op.req->fail(err);
            it = table->erase(it);
          } else {
            ++it;
          }
        }
    }
  }
  const char* name() const override { return "inproc"; }

  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    check_tag("inproc", "isend", tag);
    InprocOp op;
    op.req = std::make_shared<Request>(Request::Kind::send, peer, tag, bytes);
    op.src = data;
    op.bytes = bytes;
    RequestPtr req = op.req;
    post(peer, rank_, tag, std::move(op), /*is_send=*/true);
    return req;
  }

  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    check_tag("inproc", "irecv", tag);
    InprocOp op;
    op.req = std::make_shared<Request>(Request::Kind::recv, peer, tag, bytes);
    op.dst = data;
    op.bytes = bytes;
    post(rank_, peer, tag, op, false);
    return op.req;
  }

  RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp rop) override {
    check_tag("inproc", "irecv_reduce", tag);
    InprocOp op;
    op.bytes = count * dtype_size(dtype);
    op.req = std::make_shared<Request>(Request::Kind::recv, peer, tag, op.bytes);
    op.dst = dst;
    op.reduce = true;
    op.count = count;
    op.dtype = dtype;
    op.op = rop;
    post(rank_, peer, tag, op, false);
    return op.req;
  }

  // A posted operation waits in a mailbox until its match arrives, and the matching thread delivers it at once.
  bool cancel(const RequestPtr& r, std::exception_ptr error) override {
    const int peer = r->peer();
    if (peer < 0 || peer >= size_) return false;
    const bool is_send = r->kind() == Request::Kind::send;
    auto& box = world_->boxes_[is_send ? peer : rank_];
    std::lock_guard<std::mutex> lk(box.mu);
    auto& table = is_send ? box.sends : box.recvs;
    auto it = table.find({is_send ? rank_ : peer, r->tag()});
    if (it == table.end()) return false;
    auto pos = std::find_if(it->second.begin(), it->second.end(), [&](const InprocOp& op) { return op.req == r; });
    if (pos == it->second.end()) return false;
    it->second.erase(pos);
    if (it->second.empty()) table.erase(it);
    r->fail(std::move(error));
    return true;
  }

  void abort(const std::string& reason) override {
    std::string why = fmt::format("rank {} aborted: {}", rank_, reason);
    {
      std::lock_guard<std::mutex> lk(world_->abort_mu);
      if (world_->aborted.empty()) world_->aborted = why;
    }
    auto err = std::make_exception_ptr(PeerError(why));
    for (auto& box : world_->boxes_) {
      std::lock_guard<std::mutex> lk(box.mu);
      for (auto* table : {&box.sends, &box.recvs}) {
        for (auto& [key, q] : *table)
          for (auto& op : q) op.req->fail(err);
        table->clear();
      }
    }
    std::lock_guard<std::mutex> lk(world_->abort_mu);
    for (auto* t : world_->members) static_cast<InprocTransport*>(t)->set_aborted(why);
  }

 private:
  // Posts an op into the mailbox of `dst_rank` keyed by (src_rank, tag), matching the opposite queue.
  void post(int dst_rank, int src_rank, uint64_t tag, InprocOp op, bool is_send) {
    int peer = is_send ? dst_rank : src_rank;
    if (peer < 0 || peer >= size_) {
      throw InvalidArgument(fmt::format("inproc: peer rank {} out of range [0, {})", peer, size_));
    }
    auto& box = world_->boxes_[dst_rank];
    std::lock_guard<std::mutex> lk(box.mu);
    // Looked at under the box's lock: an abort either came first (the op fails now) or clears this box after the
    // op is in it. Looked at before taking it, an abort in between cleared the box first and the op then waited
    // for its deadline (a test saw 20 s).
    {
      std::lock_guard<std::mutex> alk(world_->abort_mu);
      if (!world_->aborted.empty()) {
        op.req->fail(std::make_exception_ptr(PeerError(world_->aborted)));
        return;
      }
      if (world_->gone[static_cast<size_t>(peer)]) {
        op.req->fail(
            std::make_exception_ptr(PeerError(fmt::format("inproc: rank {}'s transport was destroyed (rank {} {} it)",
                                                          peer, rank_, is_send ? "sending to" : "receiving from"))));
        return;
      }
    }
    auto key = std::make_pair(src_rank, tag);
    auto& other = is_send ? box.recvs : box.sends;
    auto it = other.find(key);
    if (it != other.end() && !it->second.empty()) {
      InprocOp match = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) other.erase(it);
      InprocWorld::deliver(is_send ? op : match, is_send ? match : op);
    } else {
      (is_send ? box.sends : box.recvs)[key].push_back(op);
    }
  }

  std::shared_ptr<InprocWorld> world_;
};

}  // namespace

std::vector<TransportPtr> make_inproc_world(int size, int ranks_per_host) {
  if (size < 1) throw InvalidArgument(fmt::format("inproc world size {} must be at least 1", size));
  auto world = std::make_shared<InprocWorld>(size);
  std::vector<int> hosts(size);
  for (int r = 0; r < size; ++r) hosts[r] = ranks_per_host > 0 ? r / ranks_per_host : 0;
  std::vector<TransportPtr> out;
  for (int r = 0; r < size; ++r) {
    out.push_back(std::make_shared<InprocTransport>(world, r, size, hosts));
    world->members.push_back(out.back().get());
  }
  return out;
}

}  // namespace conduit::net
