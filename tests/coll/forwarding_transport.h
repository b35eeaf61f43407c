#pragma once
// A transport that hands its sends, receives, aborts and cancels to another one: tests derive from it to change one
// call (count a send, drop what a receive brings, refuse a send) and leave the rest to the inner transport. The fused
// calls (isend_reduced, irecv_reduce) keep Transport's own versions, made of this transport's isend and irecv, unless
// a test forwards them too.
#include <exception>
#include <string>
#include <utility>

#include "net/transport.h"

namespace conduit::test_util {

class ForwardingTransport : public net::Transport {
 public:
  explicit ForwardingTransport(net::TransportPtr inner) : inner_(std::move(inner)) {
    rank_ = inner_->rank();
    size_ = inner_->size();
    hosts_ = inner_->hosts();
  }
  net::RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return inner_->isend(peer, tag, data, bytes);
  }
  net::RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return inner_->irecv(peer, tag, data, bytes);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  bool cancel(const net::RequestPtr& r, std::exception_ptr error) override { return inner_->cancel(r, error); }

 protected:
  net::TransportPtr inner_;
};

}  // namespace conduit::test_util
