#include "net/routed.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "core/error.h"

namespace conduit::net {
namespace {

class RoutedTransport : public Transport {
 public:
  RoutedTransport(int rank, int size, std::vector<int> hosts, std::vector<TransportPtr> route, std::string desc)
      : route_(std::move(route)), desc_(std::move(desc)) {
    rank_ = rank;
    size_ = size;
    hosts_ = std::move(hosts);
    // A transport that progresses in the waiting thread (shm) must keep moving while the thread waits on a request
    // of another transport (tcp): every request gets that progressor, and the other transports wake it when they
    // complete something.
    for (auto& t : route_)
      if (t && std::find(inner_.begin(), inner_.end(), t.get()) == inner_.end()) inner_.push_back(t.get());
    for (auto& t : route_)
      if (t && !progressor_) progressor_ = dynamic_cast<Progressor*>(t.get());
    if (progressor_) {
      Progressor* prog = progressor_;
      for (auto& t : route_)
        if (t && dynamic_cast<Progressor*>(t.get()) != prog) t->set_activity_target(prog);
    }
  }
  ~RoutedTransport() override {
    // The other transports' threads notify the progressor: stop and destroy them before it goes.
    for (auto& t : route_)
      if (t && dynamic_cast<Progressor*>(t.get()) != progressor_) {
        t->set_activity_target(nullptr);
        t.reset();
      }
  }
  const char* name() const override { return desc_.c_str(); }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return adopt(at(peer).isend(peer, tag, data, bytes));
  }
  RequestPtr isend_reduced(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return adopt(at(peer).isend_reduced(peer, tag, data, bytes));
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return adopt(at(peer).irecv(peer, tag, data, bytes));
  }
  RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) override {
    return adopt(at(peer).irecv_reduce(peer, tag, dst, count, dtype, op));
  }
  bool cancel(const RequestPtr& r, std::exception_ptr error) override {
    const int peer = r->peer();
    if (peer < 0 || peer >= size_ || !route_[peer]) return false;
    return route_[peer]->cancel(r, std::move(error));
  }
  std::string aborted_reason() const override {
    std::string why = Transport::aborted_reason();
    for (size_t i = 0; why.empty() && i < inner_.size(); ++i) why = inner_[i]->aborted_reason();
    return why;
  }
  void abort(const std::string& reason) override {
    set_aborted(reason);
    std::set<Transport*> seen;
    for (auto& t : route_)
      if (t && seen.insert(t.get()).second) t->abort(reason);
  }

 private:
  Transport& at(int peer) {
    if (peer < 0 || peer >= size_ || !route_[peer])
      throw InvalidArgument(fmt::format("peer rank {} is not another rank of [0, {})", peer, size_));
    return *route_[peer];
  }
  RequestPtr adopt(RequestPtr r) {
    if (progressor_ && !r->has_progressor()) r->set_progressor(progressor_);
    return r;
  }
  std::vector<TransportPtr> route_;
  std::vector<Transport*> inner_;  // the transports of route_, each once (route_ owns them)
  std::string desc_;
  Progressor* progressor_ = nullptr;
};

}  // namespace

TransportPtr make_routed_transport(int rank, int size, std::vector<int> hosts, std::vector<TransportPtr> route,
                                   const std::string& description) {
  return std::make_shared<RoutedTransport>(rank, size, std::move(hosts), std::move(route), description);
}

}  // namespace conduit::net
