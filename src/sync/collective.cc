// Schemes built on allreduce: bsp, local (post-local, adaptive), diloco, easgd.
//
// Bytes per rank and round (d parameters, n ranks, ring-equivalent volume): one allreduce of 4d bytes sends
// 2(n-1)/n * 4d bytes. bsp: every step. local: every `period` steps (adaptive: + an allreduce of one float, the
// divergence's squared norms, a round of its own).
// diloco: every `period` steps. easgd: every `period` steps.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/error.h"
#include "sync/detail.h"
#include "sync/schemes.h"

namespace conduit::sync {

using detail::allreduce_avg;

bool BspStrategy::before_step(uint64_t, std::span<float>, std::span<float> grads) {
  allreduce_avg(*comm_, grads, stats_);
  return true;
}

LocalSgdStrategy::LocalSgdStrategy(coll::CommPtr comm, int period, int64_t warmup, bool adaptive, int max_period,
                                   double target)
    : Strategy(std::move(comm)),
      period_(period),
      warmup_(warmup),
      adaptive_(adaptive),
      max_period_(std::max(max_period, period)),
      target_(target) {}

bool LocalSgdStrategy::before_step(uint64_t step, std::span<float>, std::span<float> grads) {
  if (static_cast<int64_t>(step) < warmup_) allreduce_avg(*comm_, grads, stats_);
  return true;
}

void LocalSgdStrategy::after_step(uint64_t step, std::span<float> params) {
  if (static_cast<int64_t>(step) < warmup_) return;
  if (++since_avg_ < period_) return;
  since_avg_ = 0;
  const double t =
      detail::period_timeout_s(*comm_, period_, drift_timeout_s_);  // (the workers drifted up to a period apart)
  if (!adaptive_) {
    allreduce_avg(*comm_, params, stats_, t);
    return;
  }
  // Relative divergence sum_i |x_i - xbar|^2 / sum_i |x_i|^2 = 1 - n|xbar|^2 / sum_i |x_i|^2, from one extra
  // allreduce of one number before the average.
  double own = 0;
  for (float v : params) own += double(v) * v;
  float sq = static_cast<float>(own);
  // (counted as every exchange is: it added its bytes to bytes_sent only, none to received, time or rounds)
  detail::allreduce_f32(*comm_, std::span<float>(&sq, 1), ReduceOp::sum, stats_, t);
  allreduce_avg(*comm_, params, stats_);  // (met at the one above: the normal deadline)
  double mean = 0;
  for (float v : params) mean += double(v) * v;
  double div = sq > 0 ? std::max(0.0, 1.0 - comm_->size() * mean / sq) : 0;
  if (div < target_)
    period_ = std::min(period_ * 2, max_period_);
  else if (div > 2 * target_)
    period_ = std::max(period_ / 2, 1);
}

void LocalSgdStrategy::finish(std::span<float> params) {
  if (since_avg_ > 0)
    allreduce_avg(*comm_, params, stats_, detail::period_timeout_s(*comm_, since_avg_, drift_timeout_s_));
  since_avg_ = 0;
}

Bytes LocalSgdStrategy::save_state() const {
  detail::Writer w;
  w.u64(period_);
  w.u64(since_avg_);
  return w.take();
}
void LocalSgdStrategy::load_state(std::span<const uint8_t> bytes) {
  detail::Reader r(bytes, name());
  const uint64_t period = r.u64();
  if (period < 1 || period > static_cast<uint64_t>(INT_MAX))
    throw InvalidArgument(fmt::format("sync {}: the state's period is {} (allowed: 1 to {})", name(), period, INT_MAX));
  // An adaptive period goes on from where it was (a smaller max_period given on resume wins); a fixed one is the
  // configured one (the saved 8 overrode a resume's period=32 without a word).
  const uint64_t since = r.u64();
  // (since the last average: below the period it counts to; a corrupt 2^63 read as negative never averaged again,
  // and finish() skipped the final average, leaving the replicas apart without a word)
  if (since >= period)
    throw InvalidArgument(
        fmt::format("sync {}: the state's steps since the last average are {} (allowed: 0 to {}, "
                    "below its period)",
                    name(), since, period - 1));
  r.done();
  if (adaptive_) period_ = std::min(static_cast<int>(period), max_period_);
  since_avg_ = static_cast<int64_t>(since);
}

DilocoStrategy::DilocoStrategy(coll::CommPtr comm, int period, double outer_lr, double momentum, bool nesterov)
    : Strategy(std::move(comm)), period_(period), outer_lr_(outer_lr), momentum_(momentum), nesterov_(nesterov) {}

void DilocoStrategy::setup(std::span<float> params) {
  Strategy::setup(params);
  outer_.assign(params.begin(), params.end());
  velocity_.assign(params.size(), 0.f);
  delta_.resize(params.size());
}

void DilocoStrategy::after_step(uint64_t, std::span<float> params) {
  if (outer_.size() != params.size())
    throw InvalidArgument(fmt::format("sync diloco: {} parameters but setup() saw {}", params.size(), outer_.size()));
  if (++since_sync_ < period_) return;
  outer_step(params);
}

void DilocoStrategy::finish(std::span<float> params) {
  if (since_sync_ > 0) outer_step(params);
}

void DilocoStrategy::outer_step(std::span<float> params) {
  const int64_t steps = since_sync_;  // (up to a period: the workers drifted that far apart)
  since_sync_ = 0;
  for (size_t i = 0; i < params.size(); ++i) delta_[i] = outer_[i] - params[i];  // outer gradient
  allreduce_avg(*comm_, delta_, stats_, detail::period_timeout_s(*comm_, steps, drift_timeout_s_));
  const float lr = static_cast<float>(outer_lr_), mu = static_cast<float>(momentum_);
  for (size_t i = 0; i < params.size(); ++i) {
    float g = delta_[i];
    velocity_[i] = mu * velocity_[i] + g;
    float upd = nesterov_ ? g + mu * velocity_[i] : velocity_[i];
    outer_[i] -= lr * upd;
    params[i] = outer_[i];
  }
}

Bytes DilocoStrategy::save_state() const {
  detail::Writer w;
  w.u64(since_sync_);
  w.floats(outer_);
  w.floats(velocity_);
  return w.take();
}
void DilocoStrategy::load_state(std::span<const uint8_t> bytes) {
  detail::Reader r(bytes, name());
  since_sync_ = detail::steps_since(r.u64(), name());
  outer_ = r.floats(outer_.size(), "outer parameters");
  velocity_ = r.floats(outer_.size(), "outer momentum");
  r.done();
  delta_.resize(outer_.size());
}

EasgdStrategy::EasgdStrategy(coll::CommPtr comm, int period, double alpha)
    : Strategy(std::move(comm)), period_(period), alpha_(alpha) {}

void EasgdStrategy::setup(std::span<float> params) {
  Strategy::setup(params);
  center_.assign(params.begin(), params.end());
  diff_.resize(params.size());
}

void EasgdStrategy::after_step(uint64_t, std::span<float> params) {
  if (center_.size() != params.size())
    throw InvalidArgument(fmt::format("sync easgd: {} parameters but setup() saw {}", params.size(), center_.size()));
  if (++since_sync_ < period_) return;
  elastic_step(params);
}

void EasgdStrategy::finish(std::span<float> params) {
  if (since_sync_ > 0) elastic_step(params);
  std::copy(center_.begin(), center_.end(), params.begin());
}

void EasgdStrategy::elastic_step(std::span<float> params) {
  const int64_t steps = since_sync_;  // (up to a period: the workers drifted that far apart)
  since_sync_ = 0;
  const float a = static_cast<float>(alpha_);
  for (size_t i = 0; i < params.size(); ++i) {
    diff_[i] = params[i] - center_[i];
    params[i] -= a * diff_[i];
  }
  allreduce_avg(*comm_, diff_, stats_,
                detail::period_timeout_s(*comm_, steps, drift_timeout_s_));  // mean of the differences
  const float an = a * comm_->size();
  for (size_t i = 0; i < params.size(); ++i) center_[i] += an * diff_[i];
}

Bytes EasgdStrategy::save_state() const {
  detail::Writer w;
  w.u64(since_sync_);
  w.floats(center_);
  return w.take();
}
void EasgdStrategy::load_state(std::span<const uint8_t> bytes) {
  detail::Reader r(bytes, name());
  since_sync_ = detail::steps_since(r.u64(), name());
  center_ = r.floats(center_.size(), "center variable");
  r.done();
  diff_.resize(center_.size());
}

}  // namespace conduit::sync
