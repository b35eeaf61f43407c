#include "net/routed.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/log.h"

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
    // A peer's abort reaches one of the transports only (shm's segment flag, or tcp's frame): the requests of the
    // others waited for their deadline (a rank of a two-host job with shm inside and tcp across failed after its
    // whole timeout, without the reason). Relayed to the others from a thread of its own: the transport that heard
    // it calls the listener with its own locks held.
    if (inner_.size() > 1)
      for (Transport* t : inner_) t->set_abort_listener([this, t](const std::string& why) { relay_abort(t, why); });
  }
  ~RoutedTransport() override {
    for (Transport* t : inner_) t->set_abort_listener(nullptr);  // (waits for a call in progress)
    {
      std::lock_guard<std::mutex> lk(relay_mu_);
      closing_ = true;
    }
    if (relay_.joinable()) relay_.join();
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
  std::string peer_note(int peer) const override {
    return peer >= 0 && peer < size_ && route_[peer] ? route_[peer]->peer_note(peer) : std::string();
  }
  void abort(const std::string& reason) override {
    set_aborted(reason);
    std::set<Transport*> seen;
    for (auto& t : route_)
      if (t && seen.insert(t.get()).second) t->abort(reason);
  }

 private:
  // The first abort one of the inner transports records: the others are aborted with its reason (once; nothing when
  // this transport's own abort started it, which aborts them all itself).
  void relay_abort(Transport* source, const std::string& why) {
    if (!Transport::aborted_reason().empty()) return;
    std::lock_guard<std::mutex> lk(relay_mu_);
    if (closing_ || relay_started_) return;
    // (called inside the source's abort or frame handling: a failed spawn must not unwind through it)
    try {
      relay_ = std::thread([this, source, why] {
        if (!Transport::aborted_reason().empty()) return;
        for (Transport* t : inner_)
          if (t != source && t->aborted_reason().empty()) t->abort(why);
      });
      relay_started_ = true;
    } catch (const std::exception& e) {
      CONDUIT_LOG_WARN(
          "routed transport: cannot start the thread that relays an abort ({}): the other transports' "
          "requests fail at their deadlines",
          e.what());
    }
  }
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
  std::mutex relay_mu_;
  bool relay_started_ = false, closing_ = false;
  std::thread relay_;
};

}  // namespace

TransportPtr make_routed_transport(int rank, int size, std::vector<int> hosts, std::vector<TransportPtr> route,
                                   const std::string& description) {
  return std::make_shared<RoutedTransport>(rank, size, std::move(hosts), std::move(route), description);
}

}  // namespace conduit::net
