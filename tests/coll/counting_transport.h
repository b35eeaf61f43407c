#pragma once
// A transport that counts the bytes each rank sends to each peer (and the largest single message), forwarding
// everything to another (in-process) transport: for tests of what an algorithm puts on the wire.
#include <algorithm>
#include <utility>
#include <vector>

#include "forwarding_transport.h"

namespace conduit::test_util {

class CountingTransport : public ForwardingTransport {
 public:
  explicit CountingTransport(net::TransportPtr inner) : ForwardingTransport(std::move(inner)), sent_(size_) {}
  const char* name() const override { return "counting"; }
  net::RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    sent_[peer] += bytes;
    largest_ = std::max(largest_, bytes);
    return inner_->isend(peer, tag, data, bytes);
  }
  net::RequestPtr isend_reduced(int peer, uint64_t tag, const void* data, size_t bytes) override {
    sent_[peer] += bytes;
    largest_ = std::max(largest_, bytes);
    return inner_->isend_reduced(peer, tag, data, bytes);
  }
  net::RequestPtr irecv_reduce(int peer, uint64_t tag, void* dst, size_t count, DType dtype, ReduceOp op) override {
    return inner_->irecv_reduce(peer, tag, dst, count, dtype, op);
  }
  std::vector<size_t> take() { return std::exchange(sent_, std::vector<size_t>(sent_.size(), 0)); }
  size_t take_largest() { return std::exchange(largest_, 0); }

 private:
  std::vector<size_t> sent_;
  size_t largest_ = 0;
};

}  // namespace conduit::test_util
