#pragma once
// Algorithm choice, separate from the algorithms (as NCCL's tuner plugins are). An alpha-beta-gamma cost model
// (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009) predicts each algorithm's time; the cheapest wins, but
// an algorithm listed earlier (ring first) keeps the choice unless a later one is more than 10% cheaper.
// alpha: seconds per message, beta: seconds per byte on the wire, gamma: seconds per byte reduced; one triple for
// links inside a host and one across hosts. Parameters are measured at start-up (Communicator::from_env) or given
// by CONDUIT_COST_MODEL="intra=ALPHA,BETA,GAMMA;inter=ALPHA,BETA,GAMMA" (seconds, seconds/byte, seconds/byte).
// Forcing, per operation, as oneCCL's CCL_ALLREDUCE: CONDUIT_ALLREDUCE="ring" or
// "tree:0-64K,rhd:64K-4M,ring:4M-" (byte ranges, lower bound inclusive); likewise CONDUIT_REDUCE_SCATTER,
// CONDUIT_ALLGATHER, CONDUIT_BROADCAST, CONDUIT_REDUCE.
//
// Threads: one Tuner is shared by a communicator and the communicators made from it, whose collectives run on
// several threads; set_model and force may be called while they choose. The model and the rules live in one
// immutable state that a change replaces whole (under a mutex), so every reader works on one state, the old or the
// new, never a mix (the rules were reassigned in place under readers walking them). Safe for this process only: the
// ranks must agree on every collective's algorithm, so a change made after start-up belongs at a point where no
// collective runs on any rank and every rank makes the same change (as the start-up's measurement does).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace conduit::coll {

enum class CollOp { allreduce = 0, reduce_scatter, allgather, broadcast, reduce };
inline constexpr int kNumCollOps = 5;
const char* coll_op_name(CollOp op);

struct LinkCost {
  double alpha = 5e-6;    // 5 us
  double beta = 1e-10;    // 10 GB/s
  double gamma = 2.5e-10; // 4 GB/s reduction
};

struct CostModel {
  LinkCost intra;
  LinkCost inter{20e-6, 1e-9, 2.5e-10};
  std::string source = "defaults";  // "defaults", "measured", "CONDUIT_COST_MODEL", "config", "checkpoint"
};

// Parses "intra=a,b,g;inter=a,b,g"; ConfigError naming the part that is wrong.
CostModel parse_cost_model(const std::string& text, const std::string& what);
std::string format_cost_model(const CostModel& m);

struct ForceRule {
  std::string algorithm;
  size_t lo = 0;
  size_t hi = static_cast<size_t>(-1);  // exclusive
};

class Tuner {
 public:
  explicit Tuner(CostModel model = {});
  // A copy shares the state it copies (immutable); a later change to either replaces only its own.
  Tuner(const Tuner& other);
  Tuner& operator=(const Tuner& other);
  // Reads CONDUIT_COST_MODEL and the CONDUIT_<OP> forcing variables.
  static std::shared_ptr<Tuner> from_env();

  static const std::vector<std::string>& algorithms(CollOp op);
  // ConfigError unless `algo` is one of algorithms(op).
  static void check_algorithm(CollOp op, const std::string& algo);

  // Predicted seconds of `algo` for `bytes` per rank (the full vector for allreduce/broadcast/reduce, the
  // output for allgather, the input for reduce_scatter) over p ranks on `hosts` hosts.
  double predict(CollOp op, const std::string& algo, double bytes, int p, int hosts) const;
  // The forced algorithm for this size if any, else the cheapest that applies.
  std::string choose(CollOp op, size_t bytes, int p, int hosts, bool uniform_hosts) const;
  // True when a forced rule (force(), CONDUIT_<OP>) names the algorithm for this size.
  bool forced_at(CollOp op, size_t bytes) const;
  // The algorithm a forced rule names for this size, empty when none does.
  std::string forced_algorithm(CollOp op, size_t bytes) const;
  // The largest single message `algo` sends for `bytes` (as predict()) over p ranks on `hosts` hosts, 0 for those
  // that send in segments of ring_segment_bytes() (checked against the message limit at start-up). choose() passes
  // over algorithms whose messages are over net::max_message_bytes(): every receiver refuses them. Blocks are whole
  // elements, so the bound depends on `elem_bytes`; 0 (choose(), which sees bytes alone): a bound for every dtype.
  double largest_message(CollOp op, const std::string& algo, double bytes, int p, int hosts, bool uniform_hosts,
                         size_t elem_bytes = 0) const;

  void set_model(const CostModel& m);
  // A copy: another thread may replace the model meanwhile.
  CostModel model() const;
  void force(CollOp op, std::vector<ForceRule> rules);
  // Parses a forcing spec ("ring" or "tree:0-64K,ring:64K-"); ConfigError naming `what`.
  static std::vector<ForceRule> parse_rules(CollOp op, const std::string& spec, const std::string& what);

 private:
  // Everything a choice depends on; never changed once published.
  struct State {
    CostModel model;
    std::vector<ForceRule> forced[kNumCollOps];
    // Unique across every tuner and every change (copies share it with the state they copy), so choose()'s
    // per-thread cache never answers for another model or rule set.
    uint64_t version = 0;
  };
  static uint64_t next_version();
  std::shared_ptr<const State> snapshot() const;
  // Publishes a copy of the current state changed by `change` (the copy, the change and the swap under mu_, so two
  // writers do not lose each other's change).
  template <class F>
  void update(F&& change);
  static double predict_with(const State& s, CollOp op, const std::string& algo, double bytes, int p, int hosts);
  static std::string choose_with(const State& s, CollOp op, size_t bytes, int p, int hosts, bool uniform_hosts);
  static double largest_with(const State& s, CollOp op, const std::string& algo, double bytes, int p, int hosts,
                             bool uniform_hosts, size_t elem_bytes);
  // The model's choice, without forcing rules: the cheapest, an earlier-listed algorithm kept unless a later one is
  // more than 10% cheaper; of those whose messages fit the message limit (the first listed when none does).
  static std::string cheapest(const State& s, CollOp op, double bytes, int p, int hosts, bool uniform_hosts);

  mutable std::mutex mu_;
  std::shared_ptr<const State> state_;  // guarded by mu_; never null
  std::atomic<uint64_t> version_{0};    // state_->version, read without the lock by choose()'s cache check
};

}  // namespace conduit::coll
