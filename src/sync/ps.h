#pragma once
// Sharded parameter servers (ps-asp, ps-ssp, ps-bsp).
#include <string>

#include "sync/strategy.h"

namespace conduit::sync {

// The servers' SGD settings the schemes take (lr, momentum): a trainer that fills them in from its own settings checks
// those against these, naming its own.
inline constexpr double kPsMinLr = 1e-9, kPsMaxLr = 1e6;  // (0 would never train)
inline constexpr double kPsMaxMomentum = 0.9999;

struct PsConfig {
  std::string mode = "ssp";  // asp | ssp | bsp
  int64_t staleness = 3;     // ssp: a worker more than this many clocks ahead of the slowest waits; asp: -1
  int64_t servers = 1;       // shards (parameters split in contiguous ranges)
  bool colocate = false;     // shard s on rank s (every rank a worker) vs. the last `servers` ranks serve only
  double lr = 0.1, momentum = 0.9, weight_decay = 0;               // the servers' SGD
  // asp/ssp delay compensation (DC-ASGD-a, Zheng et al. 2017): a gradient computed on the parameters w_bak a worker
  // last received is applied as g + lambda * g*g*(w - w_bak), lambda = dc / sqrt(mean square of g) per element.
  // 0: off.
  double dc = 0;
  // asp/ssp staleness-aware step: a gradient computed on parameters tau > W - 1 updates old (W workers taking turns
  // give W - 1) is applied scaled by (W - 1) / tau (Zhang et al. 2016). Off: every gradient at 1/W.
  bool staleness_lr = false;
  // asp/ssp look-ahead momentum (DANA-Zero, Hakimi et al. 2019, "Taming Momentum in a Distributed Asynchronous
  // Environment"): the shard keeps one momentum vector v_i per worker, applies worker i's gradient as
  // v_i = momentum * v_i + g / W, w -= lr * v_i, and replies with the estimated future position
  // w - lr * momentum * sum_j v_j, where the gradient is then computed. One worker: Nesterov's momentum.
  bool dana = false;
  std::string push_compressor = "none", pull_compressor = "none";  // compressor specs (compress/compressor.h)
};

StrategyPtr make_ps_strategy(coll::CommPtr comm, const PsConfig& cfg);

// Clock instrumentation of one shard (tests assert the SSP bound on it).
struct PsClockStats {
  int64_t max_gap = 0;  // max over released pulls of (worker clock - slowest worker's clock)
  uint64_t pushes = 0;  // gradients applied
  uint64_t waits = 0;   // pulls that had to wait for slower workers
  uint64_t max_tau = 0; // asp/ssp: the largest staleness (updates since the gradient's parameters) of a push
  uint64_t scaled = 0;  // pushes scaled down by staleness_lr (staler than the workers taking turns)
};
// The stats of the shards served in this process on `comm`'s rank (empty when it serves none). Valid after finish()
// (co-located) or serve() returned.
PsClockStats ps_clock_stats(const Strategy& s);

}  // namespace conduit::sync
