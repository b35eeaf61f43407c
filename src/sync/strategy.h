#pragma once
// Synchronization strategies: what a data-parallel trainer communicates, and when, around its local optimizer
// step. A strategy works on one flat f32 parameter buffer and one flat f32 gradient buffer of the same length
// (the trainer flattens or views its tensors; the layout must be the same on every rank).
//
// The trainer's loop (see docs/sync.md):
//
//   auto s = sync::make_strategy(mode, params, comm);     // ConfigError: one line listing what is allowed
//   if (!s->is_worker()) { s->serve(); return; }          // dedicated parameter-server ranks only
//   s->setup(params);                                      // once, before the first step (makes replicas equal)
//   for (step = 0; ...) {
//     forward/backward -> grads
//     if (s->before_step(step, params, grads)) local_optimizer.step();   // false: params already updated
//     s->after_step(step, params);
//   }
//   s->finish(params);                                     // once, at the end (stops servers, final average)
//
// Data sharding uses worker_rank()/num_workers() (parameter servers on ranks of their own are not workers).
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coll/communicator.h"
#include "sync/defaults.h"

namespace conduit::sync {

using Params = std::map<std::string, std::string>;
using Bytes = std::vector<uint8_t>;

struct SyncStats {
  uint64_t bytes_sent = 0;      // payload bytes this rank sent (collectives: the algorithm-independent volume
                                // 2(n-1)/n * bytes for an allreduce)
  uint64_t bytes_received = 0;  // payload bytes this rank received (point-to-point schemes)
  uint64_t payload_bytes = 0;   // bytes of the messages this rank composed, each counted once however many peers
                                // get it or however an allreduce moves it (the compression ratio's denominator)
  uint64_t rounds = 0;          // communication rounds this rank took part in
  double comm_seconds = 0;      // time spent blocked in communication
};

// A rendezvous of every rank of `workers` for the points where the workers meet out of step (checkpoints, the end,
// worker 0's evaluations): a fast worker waits there for a straggler's remaining steps, which may rightly take longer
// than the collectives' timeout, so worker 0's wait has `drift_timeout_s` as its deadline (a frozen or hung peer fails
// it then, and worker 0 aborts the transport naming the workers that did not arrive) and the others' wait for its
// release a timeout more. It fails at once when a peer dies or any rank aborts the transport. Collective over
// `workers`.
void await_workers(coll::Communicator& workers, double drift_timeout_s = kDefaultDriftTimeoutS);

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // False on ranks that only run parameter servers: they call serve() instead of training.
  virtual bool is_worker() const { return true; }
  virtual int worker_rank() const;
  virtual int num_workers() const;
  // Runs a dedicated server until every worker has called finish().
  virtual void serve();

  // Once before the first step: replicas start equal (rank 0's parameters are broadcast where that matters).
  virtual void setup(std::span<float> params);
  // After backward, before the local optimizer step. May rewrite grads (bsp averages them) or params. Returns
  // false when the local optimizer must not step (parameter servers: the server stepped and params were pulled).
  virtual bool before_step(uint64_t step, std::span<float> params, std::span<float> grads);
  // After the local optimizer step (or after before_step returned false). May mix or replace params.
  virtual void after_step(uint64_t step, std::span<float> params);
  // Once at the end: final averaging where the scheme has one, stops background threads and servers.
  virtual void finish(std::span<float> params);

  // True where the workers may drift apart by more than a step (asynchronous schemes: ps-asp, ps-ssp with a
  // staleness above 0, adpsgd): a worker that is done, or at a checkpoint, may wait for a straggler's remaining
  // steps, up to drift_timeout_s. The trainer meets the other workers there with await_workers().
  virtual bool workers_drift() const { return false; }
  // The trainer's learning rate at this step over its base rate, before before_step. Parameter servers own the
  // optimizer: the trainer scales the gradients it pushes by this, and the servers scale their weight decay by it.
  virtual void set_lr_scale(double) {}

  // State for checkpoints (counters, replicas, momentum); restore after setup() on a fresh strategy.
  virtual Bytes save_state() const { return {}; }
  virtual void load_state(std::span<const uint8_t> bytes);

  const SyncStats& stats() const { return stats_; }

  // The deadline of the waits where the workers drift apart (kDefaultDriftTimeoutS's list): before setup(), at least
  // the communicator's timeout (InvalidArgument otherwise).
  void set_drift_timeout(double seconds);
  double drift_timeout_s() const { return drift_timeout_s_; }

 protected:
  explicit Strategy(coll::CommPtr comm) : comm_(std::move(comm)) {}
  coll::CommPtr comm_;
  SyncStats stats_;
  double drift_timeout_s_ = kDefaultDriftTimeoutS;  // (set before setup starts any serving thread)
};

using StrategyPtr = std::unique_ptr<Strategy>;

// Names: bsp local ps-asp ps-ssp ps-bsp dpsgd adpsgd sgp easgd diloco. Unknown names or parameters raise
// ConfigError with one line listing what is allowed; bad values name the parameter and the allowed range.
StrategyPtr make_strategy(const std::string& name, const Params& params, coll::CommPtr comm);
std::vector<std::string> strategy_names();
// Parameters `name` accepts, with their defaults.
Params strategy_defaults(const std::string& name);
// Whether two spellings of a scheme parameter are the same setting: equal text, the same number ("064" and "64",
// "0.50" and "0.5"), or the same flag ("false" and "0", "true" and "1").
bool same_param_value(const std::string& a, const std::string& b);
// "local:period=8,warmup=100" -> make_strategy("local", {{"period","8"},{"warmup","100"}}, comm).
StrategyPtr parse_strategy(const std::string& spec, coll::CommPtr comm);

}  // namespace conduit::sync
