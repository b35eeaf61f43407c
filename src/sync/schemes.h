#pragma once
// The concrete strategies (built by make_strategy; declared here for tests and for callers that want their
// introspection: consensus weights, parameter-server clocks).
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <random>
#include <thread>

#include "compress/compressor.h"
#include "sync/graph.h"
#include "sync/strategy.h"

namespace conduit::sync {

// bsp: gradients averaged by one allreduce every step. Per step: one allreduce of 4*d bytes.
class BspStrategy : public Strategy {
 public:
  explicit BspStrategy(coll::CommPtr comm) : Strategy(std::move(comm)) {}
  std::string name() const override { return "bsp"; }
  bool before_step(uint64_t step, std::span<float> params, std::span<float> grads) override;
};

// local: local SGD / post-local SGD. Steps < warmup average gradients (BSP); afterwards parameters are averaged
// after every `period`-th step. adaptive=1 doubles the period (up to max_period) when the replicas' relative
// divergence at an average is below `target`, and halves it (down to 1) when above 2*target.
class LocalSgdStrategy : public Strategy {
 public:
  LocalSgdStrategy(coll::CommPtr comm, int period, int64_t warmup, bool adaptive, int max_period, double target);
  std::string name() const override { return "local"; }
  bool before_step(uint64_t step, std::span<float> params, std::span<float> grads) override;
  void after_step(uint64_t step, std::span<float> params) override;
  void finish(std::span<float> params) override;
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;
  int period() const { return period_; }

 private:
  int period_;
  int64_t warmup_;
  bool adaptive_;
  int max_period_;
  double target_;
  int64_t since_avg_ = 0;
};

// diloco: inner optimizer for `period` steps, then the averaged parameter delta (outer gradient) drives an outer
// SGD step with Nesterov momentum on the outer parameters, which every replica then continues from.
class DilocoStrategy : public Strategy {
 public:
  DilocoStrategy(coll::CommPtr comm, int period, double outer_lr, double momentum, bool nesterov);
  std::string name() const override { return "diloco"; }
  void setup(std::span<float> params) override;
  void after_step(uint64_t step, std::span<float> params) override;
  // An outer step on the last, partial round (if any): every replica ends at the outer model.
  void finish(std::span<float> params) override;
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;

 private:
  int period_;
  double outer_lr_, momentum_;
  bool nesterov_;
  int64_t since_sync_ = 0;
  std::vector<float> outer_, velocity_, delta_;
  void outer_step(std::span<float> params);
};

// easgd: synchronous elastic averaging. Every `period` steps: d_i = x_i - c; x_i -= alpha d_i;
// c += alpha * sum_i d_i (one allreduce; the center is replicated on every rank).
class EasgdStrategy : public Strategy {
 public:
  EasgdStrategy(coll::CommPtr comm, int period, double alpha);
  std::string name() const override { return "easgd"; }
  void setup(std::span<float> params) override;
  void after_step(uint64_t step, std::span<float> params) override;
  // An elastic step on the last, partial round (if any), then every replica takes the center: EASGD's model.
  void finish(std::span<float> params) override;
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;
  const std::vector<float>& center() const { return center_; }

 private:
  int period_;
  double alpha_;
  int64_t since_sync_ = 0;
  std::vector<float> center_, diff_;
  void elastic_step(std::span<float> params);
};

// dpsgd: after every step x_i <- sum_j W_ij x_j over an undirected graph with Metropolis-Hastings weights
// (doubly stochastic). With a compressor: CHOCO-gossip (public copies x^_j, q_i = Q(x_i - x^_i),
// x_i += gamma * sum_j W_ij (x^_j - x^_i)).
class DpsgdStrategy : public Strategy {
 public:
  DpsgdStrategy(coll::CommPtr comm, Graph graph, compress::CompressorPtr compressor, double gamma, uint64_t seed);
  std::string name() const override { return "dpsgd"; }
  void setup(std::span<float> params) override;
  void after_step(uint64_t step, std::span<float> params) override;
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;
  const Graph& graph() const { return graph_; }

 private:
  void plain_gossip(std::span<float> params);
  void choco_gossip(std::span<float> params);
  Graph graph_;
  std::vector<int> nbrs_;
  compress::CompressorPtr compressor_;
  double gamma_;
  std::vector<std::vector<float>> inbox_;
  // CHOCO: public copies, [0] is mine, [k+1] is nbrs_[k]'s.
  std::vector<std::vector<float>> hat_;
  compress::TensorState cstate_;
};

// sgp: Stochastic Gradient Push (PushSum) over a directed time-varying exponential graph: at step t rank i sends
// 1/(k+1) of (x_i, w_i) to each of its k peers (i + 2^((t k + p) mod ceil(log2 n)), p < k: the offsets 1, 2, 4, ...
// below n, ceil(log2 n) of them) and keeps 1/(k+1); params hold the de-biased z_i = x_i / w_i.
class SgpStrategy : public Strategy {
 public:
  SgpStrategy(coll::CommPtr comm, int peers_per_step);
  std::string name() const override { return "sgp"; }
  void setup(std::span<float> params) override;
  void after_step(uint64_t step, std::span<float> params) override;
  void finish(std::span<float> params) override;
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;
  const std::vector<float>& numerator() const { return x_; }
  double weight() const { return w_; }
  // The out-peers of `rank` at step t (n ranks).
  static std::vector<int> out_peers(int rank, int n, uint64_t t, int peers_per_step);

 private:
  int peers_;
  std::vector<float> x_, z_, in_;
  double w_ = 1;
};

// adpsgd: asynchronous pairwise averaging on a bipartite graph (even ranks active, odd ranks passive, as in the
// AD-PSGD paper): after its step an active rank averages with a random passive neighbour, which answers from a
// background thread and applies the change at its next after_step. Passive ranks never initiate: no deadlock. On an
// odd ring the wrap edge joins two even ranks: rank n-1 initiates it and rank 0 answers it too (graph.h's
// adpsgd_ring_roles: still no wait cycle).
// finish() averages the replicas once (an allreduce; final_average = false: not), so every worker ends with the
// consensus model.
class AdpsgdStrategy : public Strategy {
 public:
  AdpsgdStrategy(coll::CommPtr comm, uint64_t seed, bool final_average = true);
  ~AdpsgdStrategy() override;
  std::string name() const override { return "adpsgd"; }
  bool workers_drift() const override { return true; }
  // The rng (the next neighbours an active rank picks) and, on a passive rank, the averaging deltas its neighbours
  // left since its last step (pending_, not yet in its parameters: a checkpoint between two steps keeps them).
  Bytes save_state() const override;
  void load_state(std::span<const uint8_t> bytes) override;
  void setup(std::span<float> params) override;
  void after_step(uint64_t step, std::span<float> params) override;
  void finish(std::span<float> params) override;
  bool active() const { return comm_->rank() % 2 == 0; }
  const std::vector<int>& neighbours() const { return nbrs_; }
  uint64_t exchanges() const { return exchanges_; }

 private:
  // Answers `peer`'s requests for a model of d parameters (on its own thread).
  void serve_peer(int peer, size_t d);
  void stop_serving(int peer, const char* what);
  void apply_pending(std::span<float> params);
  std::vector<int> nbrs_;
  std::mt19937_64 rng_;
  std::vector<float> send_, recv_;
  // Passive side.
  mutable std::mutex mu_;
  std::vector<float> shadow_, pending_;
  std::vector<std::thread> servers_;
  std::exception_ptr error_;
  std::atomic<uint64_t> exchanges_{0};
  // What the serving threads moved, folded into stats_ by the training thread (stats() is read without a lock).
  std::atomic<uint64_t> served_sent_{0}, served_received_{0}, served_rounds_{0};
  bool final_average_ = true;
  bool finished_ = false;
  bool set_up_ = false, ended_ = false;  // setup() ran; finish() returned normally
};

}  // namespace conduit::sync
