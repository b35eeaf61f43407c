#pragma once
// SchemeOptimizer: data-parallel training under a synchronization scheme other than bsp (sync/strategy.h: local
// SGD, DiLoCo, EASGD, gossip, parameter servers), the counterpart of DistributedOptimizer for `conduit train --sync`.
//
//  - The model's parameters and gradients are re-seated as views of two flat f32 tensors, so the strategy works on
//    the very memory the local optimizer updates (no copies per step).
//  - step() runs strategy->before_step (which may average gradients, or push them to the parameter servers and pull
//    the parameters back), the local optimizer unless the servers own it, then strategy->after_step (which may
//    average or gossip the parameters).
//  - Parameter servers own the optimizer, so their learning rate cannot follow the trainer's schedule by itself:
//    the worker scales each pushed gradient by lr(t) / lr, the "v = mu v + lr g" form of momentum SGD.
//  - Dedicated server ranks (ps-* with colocate=0) run serve() and never train; the workers' own communicator
//    (worker_comm()) is for evaluation and checkpoint barriers.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "coll/communicator.h"
#include "sync/strategy.h"
#include "torch/config.h"
#include "torch/metrics.h"

namespace conduit::train {

class SchemeOptimizer {
 public:
  // Collective over `comm` (it splits off the workers' communicator). base_lr: the trainer's lr before any schedule.
  SchemeOptimizer(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> optimizer,
                  coll::CommPtr comm, const SyncSpec& spec, double base_lr, Trace* trace = nullptr);
  ~SchemeOptimizer();
  SchemeOptimizer(const SchemeOptimizer&) = delete;
  SchemeOptimizer& operator=(const SchemeOptimizer&) = delete;

  bool is_worker() const { return strategy_->is_worker(); }
  void serve() { strategy_->serve(); }
  int worker_rank() const { return strategy_->worker_rank(); }
  int num_workers() const { return strategy_->num_workers(); }
  coll::CommPtr worker_comm() const { return workers_; }
  const std::string& name() const { return spec_.name; }
  // Asynchronous schemes (sync::Strategy::workers_drift): the workers meet at checkpoints and at the end through
  // await_workers(), whose deadline is drift_timeout_s (a timeout more for the workers other than 0: a straggler's
  // remaining steps may take longer than the collectives' timeout); it fails at once when a worker dies.
  bool workers_drift() const { return strategy_->workers_drift(); }
  void await_workers() { sync::await_workers(*workers_, strategy_->drift_timeout_s()); }
  // SyncSpec::drift_timeout_s, raised to the communicator's timeout where it is below it.
  double drift_timeout_s() const { return strategy_->drift_timeout_s(); }

  // Once before the first step (collective over the workers): worker 0's parameters and buffers everywhere.
  // resuming: keep a copy of this rank's own parameters for resume().
  void setup(bool resuming = false);
  // After setup(true), collective over the workers: the scheme's saved state (save_state() of the checkpoint) and
  // this rank's own parameters back, between two barriers (every initial pull served before co-located shards are
  // overwritten; no step before every shard is restored).
  void resume(const std::vector<uint8_t>& state);
  void zero_grad();
  // The strategy around the local optimizer; lr is this step's scheduled learning rate.
  void step(uint64_t step, double lr);
  // Once at the end (collective where the scheme has a final average); stops servers and background threads.
  void finish();

  const StepStats& last_stats() const { return last_; }
  const StepStats& total_stats() const { return total_; }
  void add_to_totals(const StepStats& s);

  std::vector<uint8_t> save_state() const { return strategy_->save_state(); }

 private:
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  coll::CommPtr comm_, workers_;
  SyncSpec spec_;
  double base_lr_;
  Trace* trace_;
  sync::StrategyPtr strategy_;
  std::vector<torch::Tensor> params_;  // the trainable parameters, each once: views of flat_params_
  torch::Tensor flat_params_, flat_grads_, own_params_;
  std::vector<torch::Tensor> own_buffers_;  // a resuming rank's own buffers, put back by resume()
  size_t d_ = 0;
  StepStats last_, total_;
  sync::SyncStats seen_;
  double last_step_end_ = -1;
  bool finished_ = false;
};

}  // namespace conduit::train
