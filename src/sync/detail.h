#pragma once
// Internals shared by the strategies: parameter parsing and point-to-point helpers over a communicator's transport.
#include <algorithm>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "coll/communicator.h"
#include "net/tags.h"
#include "sync/strategy.h"

namespace conduit::compress {
class Compressor;
}

namespace conduit::sync::detail {

// A compressor of differences to a copy both ends keep (CHOCO-gossip's x - x̂, the servers' pull θ - θ̂_w): the
// part not sent stays in the next difference, so it must shrink its input and keep no error feedback or momentum.
// ConfigError naming `field` and `method` otherwise.
void check_difference_compressor(std::string_view field, std::string_view method, const std::string& spec,
                                 const compress::Compressor& c);

// "<field> is empty; allowed: none or a compressor spec (...the methods...)": a scheme's compressor given as an empty
// value (`push_compressor=`, YAML's ''), which ran uncompressed without a word. `field` names it ("sync dpsgd:
// compressor").
std::string empty_compressor_message(std::string_view field);

// Reads a scheme's parameters: unknown keys raise ConfigError listing the allowed ones; values are range-checked.
class ParamReader {
 public:
  ParamReader(std::string scheme, const Params& given, const Params& defaults);
  double real(const std::string& key, double lo, double hi) const;
  int64_t integer(const std::string& key, int64_t lo, int64_t hi) const;
  bool flag(const std::string& key) const;
  std::string choice(const std::string& key, const std::vector<std::string>& allowed) const;
  std::string str(const std::string& key) const;
  // Whether the spec gave `key` another value than its default (as numbers where both are: "064" is 64): what a
  // setting of no effect is refused by (a checkpoint records every parameter of its scheme, defaults included, and a
  // resume hands them back).
  bool changed(const std::string& key) const;

 private:
  std::string scheme_;
  Params values_;
  Params defaults_;
};

// User tags of the strategies (top byte 0x5x keeps them apart from a trainer's own point-to-point tags).
enum SyncTag : uint32_t {
  kTagGossip = 0x51000001,
  kTagGossipLen = 0x51000002,
  kTagPushSum = 0x51000003,
  kTagPairReq = 0x51000004,
  kTagPairRep = 0x51000005,
  kTagPsHeader = 0x51000010,
  kTagPsPayload = 0x51000011,
  kTagPsReplyHeader = 0x51000012,
  kTagPsReply = 0x51000013,
  kTagPsInit = 0x51000014,
  kTagArrive = 0x51000020,  // await_workers
  kTagRelease = 0x51000021,
  kTagZeroArrived =
      0x51000022,  // await_workers: worker 0's arrival, which the others' wait for the release counts from
};

net::RequestPtr isend(coll::Communicator& c, int peer, uint32_t tag, const void* data, size_t bytes);
net::RequestPtr irecv(coll::Communicator& c, int peer, uint32_t tag, void* data, size_t bytes);
void wait_all(coll::Communicator& c, const std::vector<net::RequestPtr>& reqs);
void wait(coll::Communicator& c, const net::RequestPtr& r);
// Waits for reqs where the workers may rightly drift apart by more than a step: up to `limit_s` (from the drift
// timeout, as `limit_name` says: "drift_timeout_s", "drift_timeout_s + timeout_s"), not the communicator's timeout,
// with a warning after every timeout (at least 10 s) of waiting. `what` says what is awaited ("sync ps-ssp: rank 2:
// the servers' replies"). A request that fails ends the wait at once with its own error; at the limit, TimeoutError
// names `what`, the global ranks still awaited and the limit. On any failure every request is given up first; with
// `abort_on_timeout`, a timeout then aborts the transport with its text too (the rank that knows who is behind says
// so to every rank, not only that it stopped).
void wait_drifting(coll::Communicator& c, const std::vector<net::RequestPtr>& reqs, double limit_s,
                   const std::string& what, const char* limit_name = "drift_timeout_s", bool abort_on_timeout = false);

inline coll::CollOptions blocking_opts() {
  coll::CollOptions o;
  o.blocking = true;
  return o;
}

// Blocking average of buf over the communicator (ReduceOp::avg), with stats accounting. `timeout_s`: its deadline
// (0: the communicator's).
void allreduce_avg(coll::Communicator& c, std::span<float> buf, SyncStats& stats, double timeout_s = 0);
// The same with any reduction.
void allreduce_f32(coll::Communicator& c, std::span<float> buf, ReduceOp op, SyncStats& stats, double timeout_s = 0);

// The deadline of a synchronization every `period` steps (local SGD's average, DiLoCo's outer step, EASGD's elastic
// step): the workers meet there after up to `period` steps apart, so a straggler's lag at it is up to `period` times
// its lag a step, which bsp tolerates up to the communicator's timeout. period x timeout_s keeps that tolerance a
// step (a 2-worker run with a 150x straggler, timeout 1 s and period 20 failed where bsp finished); a frozen or
// hung peer still fails the sync within it, and a dead one at once.
// Capped at drift_timeout_s (`cap_s`) but never below the timeout: DiLoCo's period of 500 at the default 300 s gave its
// outer step a deadline of 42 hours.
inline double period_timeout_s(const coll::Communicator& c, int64_t period, double cap_s) {
  return std::min(c.timeout_s() * double(std::max<int64_t>(period, 1)), std::max(c.timeout_s(), cap_s));
}

// Byte (de)serialization for save_state/load_state.
class Writer {
 public:
  void u64(uint64_t v);
  void f64(double v);
  void floats(std::span<const float> v);
  void bytes(std::span<const uint8_t> v);
  Bytes take() { return std::move(b_); }

 private:
  Bytes b_;
};
class Reader {
 public:
  Reader(std::span<const uint8_t> b, std::string what) : b_(b), what_(std::move(what)) {}
  uint64_t u64();
  double f64();
  std::vector<float> floats();
  // A vector that must hold `expect` values (or none, when `or_empty`): InvalidArgument naming `field` otherwise.
  std::vector<float> floats(size_t expect, std::string_view field, bool or_empty = false);
  Bytes bytes();
  size_t remaining() const { return b_.size() - pos_; }
  void done() const;

 private:
  void need(size_t n) const;
  std::span<const uint8_t> b_;
  size_t pos_ = 0;
  std::string what_;
};

// A saved count of steps since the last synchronization, which stays below its period (an int): InvalidArgument
// otherwise (a corrupt 2^63 read as negative never synchronized again).
int64_t steps_since(uint64_t saved, const std::string& scheme);

}  // namespace conduit::sync::detail
