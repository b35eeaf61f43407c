#include "net/routed.h"

#include <set>

#include <fmt/format.h>

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
  }
  const char* name() const override { return desc_.c_str(); }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return at(peer).isend(peer, tag, data, bytes);
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return at(peer).irecv(peer, tag, data, bytes);
  }
  RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) override {
    return at(peer).irecv_reduce(peer, tag, dst, count, dtype, op);
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
  std::vector<TransportPtr> route_;
  std::string desc_;
};

}  // namespace

TransportPtr make_routed_transport(int rank, int size, std::vector<int> hosts, std::vector<TransportPtr> route,
                                   const std::string& description) {
  return std::make_shared<RoutedTransport>(rank, size, std::move(hosts), std::move(route), description);
}

}  // namespace conduit::net
