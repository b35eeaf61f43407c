#include "sim/compute.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace conduit::sim {
namespace {

// A measured kernel's time holds one launch: the part the analytic model's ratio scales is what is left of it (scaled
// whole, plus the launch again, a calibrated shape cost its measured time and a second launch: 4 us on a 10 us GEMM).
double measured_work(const Accelerator& acc, double measured_s) {
  return std::max(measured_s - acc.kernel_overhead, 0.0);
}

// The analytic time, and whether memory traffic, not arithmetic, bounds it. Each SM runs at peak * e_max / SMs; the
// tiles (full ones, then the edge ones of the M and N remainders, largest first) run SMs at a time, and a wave lasts
// as long as its largest tile. (Each tile was charged an equal share of the GEMM's FLOPs, so an edge tile one row
// high made a wave shorter: M = 257 took half M = 256's time.) A GEMM whose tiles leave SMs idle splits K over
// `split` blocks a tile (split-K), chosen for the shortest time, each split costing at least a slice of K a tile
// wide (a shallower one does less than the output it adds; capping the split at K / tile_n instead made a GEMM
// faster as K grew past each multiple), its fp32 partial sums written and read back as memory traffic: decode's
// GEMMs (M = batch) have a few tiles, and without splitting ran on as many SMs (10 of 132 for a 70B model's QKV at
// tp 8).
double analytic_time(const Accelerator& acc, const GemmShape& g, bool* memory_bound = nullptr) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0) return 0;
  const double tm = acc.tile_m, tn = acc.tile_n, sms = acc.sm_count;
  const double fm = std::floor(g.m / tm), fn = std::floor(g.n / tn), rm = g.m - fm * tm, rn = g.n - fn * tn;
  struct Kind {
    double area, count;
  } kinds[] = {{tm * tn, fm * fn * g.batch},
               {rm * tn, rm > 0 ? fn * g.batch : 0},
               {tm * rn, rn > 0 ? fm * g.batch : 0},
               {rm * rn, rm > 0 && rn > 0 ? g.batch : 0}};
  std::sort(std::begin(kinds), std::end(kinds), [](const Kind& a, const Kind& b) { return a.area > b.area; });
  // The sum over waves of each wave's largest tile: wave w starts at tile w * SMs.
  double tiles = 0, wave_area = 0;
  for (const Kind& k : kinds) {
    if (k.count <= 0) continue;
    const double first = std::ceil(tiles / sms), last = std::floor((tiles + k.count - 1) / sms);
    if (last >= first) wave_area += (last - first + 1) * k.area;
    tiles += k.count;
  }
  const double per_sm = acc.peak_flops * acc.gemm_efficiency / sms;
  const double bytes = 2.0 * (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch;
  const double bandwidth = acc.memory_bandwidth * acc.memory_efficiency;
  const double most = tiles < sms ? std::floor(sms / tiles) : 1.0;
  const double whole_k = 2.0 * g.k * wave_area / per_sm, least = 2.0 * std::min(g.k, tn) * wave_area / per_sm;
  double compute = whole_k, memory = bytes / bandwidth;
  for (double split = 2; split <= most; ++split) {
    const double c = std::max(whole_k / split, least), m = (bytes + 8.0 * split * g.m * g.n * g.batch) / bandwidth;
    if (std::max(c, m) < std::max(compute, memory)) compute = c, memory = m;
  }
  if (memory_bound) *memory_bound = memory > compute;
  return std::max(compute, memory);
}

}  // namespace

double gemm_time(const Accelerator& acc, const GemmShape& g, bool* bound) {
  bool memory_bound = false;
  double t = analytic_time(acc, g, &memory_bound);
  if (bound) *bound = memory_bound;
  if (t <= 0) return 0;
  if (!acc.calibration.empty()) {
    double best = std::numeric_limits<double>::infinity();
    const GemmSample* near = nullptr;
    for (const auto& s : acc.calibration) {
      double d = std::pow(std::log(s.m / g.m), 2) + std::pow(std::log(s.n / g.n), 2) + std::pow(std::log(s.k / g.k), 2);
      if (d < best) {
        best = d;
        near = &s;
      }
    }
    GemmShape sg{near->m, near->n, near->k, 1};
    bool sample_memory_bound = false;
    double predicted = analytic_time(acc, sg, &sample_memory_bound);
    double measured = sg.flops() / near->flops;
    // The sample corrects the bound it measured: an arithmetic-bound sample's efficiency says nothing of a GEMM that
    // streams its weights (decode's, M = batch), which it slowed as much (12.7 to 18.5 ms a token for one slow
    // 8192^3 sample), and the reverse.
    if (predicted > 0 && measured > 0 && sample_memory_bound == memory_bound)
      t *= measured_work(acc, measured) / predicted;
  }
  return t + acc.kernel_overhead;
}

GemmShape conv_pass_gemm(const ConvShape& c, ConvPass p) {
  const GemmShape f = c.forward_gemm();
  switch (p) {
    case ConvPass::kInputGrad:
      return {f.m, f.k, f.n, f.batch};
    case ConvPass::kWeightGrad:
      return {f.k, f.n, f.m, f.batch};
    default:
      return f;
  }
}

namespace {
ConvShape sample_shape(const ConvSample& s) { return {s.batch, s.in, s.out, s.out_height(), s.out_width(), s.kernel}; }
}  // namespace

const ConvSample* nearest_conv_sample(const Accelerator& acc, const ConvShape& c) {
  const ConvSample* near = nullptr;
  double best = std::numeric_limits<double>::infinity();
  const GemmShape g = c.forward_gemm();
  for (const auto& s : acc.conv_calibration) {
    const GemmShape h = sample_shape(s).forward_gemm();
    double d = std::pow(std::log(h.m / g.m), 2) + std::pow(std::log(h.n / g.n), 2) + std::pow(std::log(h.k / g.k), 2);
    if (d < best) {
      best = d;
      near = &s;
    }
  }
  return near;
}

double conv_time(const Accelerator& acc, const ConvShape& c, ConvPass p) {
  const GemmShape g = conv_pass_gemm(c, p);
  const ConvSample* near = nearest_conv_sample(acc, c);
  if (!near) return gemm_time(acc, g);
  double t = analytic_time(acc, g);
  if (t <= 0) return 0;
  const double measured = p == ConvPass::kForward     ? near->forward_s
                          : p == ConvPass::kInputGrad ? near->input_grad_s
                                                      : near->weight_grad_s;
  const double predicted = analytic_time(acc, conv_pass_gemm(sample_shape(*near), p));
  if (predicted > 0 && measured > 0) t *= measured_work(acc, measured) / predicted;
  return t + acc.kernel_overhead;
}

double pool_time(const Accelerator& acc, const PoolShape& p, bool backward, double elem_bytes) {
  const double n = p.elements();
  if (n <= 0) return 0;
  const PoolSample* near = nullptr;
  double best = std::numeric_limits<double>::infinity();
  for (const auto& s : acc.pool_calibration) {
    const double sn = s.batch * s.channels * s.height * s.width;
    const double d = std::pow(std::log(sn / n), 2) + std::pow(std::log(s.kernel / p.kernel), 2);
    if (d < best) {
      best = d;
      near = &s;
    }
  }
  if (near)
    return measured_work(acc, backward ? near->backward_s : near->forward_s) * n /
               (near->batch * near->channels * near->height * near->width) +
           acc.kernel_overhead;
  return memory_time(acc, elem_bytes * n * (1 + 1 / (p.kernel * p.kernel)), 1);
}

double gemm_efficiency(const Accelerator& acc, const GemmShape& g) {
  double t = gemm_time(acc, g);
  return t > 0 ? g.flops() / t / acc.peak_flops : 0;
}

double flash_attention_rate(const Accelerator& acc, const std::string& kernel, double seq, double head_dim,
                            const char* instead) {
  // (the nearest head width; of two as near, the narrower, the slower: the file's order decided)
  double best = std::numeric_limits<double>::infinity(), width = 0;
  for (const auto& s : acc.attention_calibration) {
    if (s.kernel != kernel) continue;
    const double d = std::abs(std::log(s.head_dim / head_dim));
    if (d < best - 1e-12 || (d <= best + 1e-12 && s.head_dim < width)) {
      best = std::min(best, d);
      width = s.head_dim;
    }
  }
  if (width == 0)
    throw ConfigError(fmt::format(
        "{0} (FlashAttention): the accelerator {1} has no {0} rate (its cluster file's attention_calibration "
        "holds no sample with kernel: {0}); allowed: {2}, or a cluster file with {0} samples (docs/sim.md section 3)",
        kernel, acc.name, instead));
  const AttentionSample *below = nullptr, *above = nullptr;
  for (const auto& s : acc.attention_calibration) {
    if (s.kernel != kernel || s.head_dim != width) continue;
    if (s.seq <= seq && (!below || s.seq > below->seq)) below = &s;
    if (s.seq >= seq && (!above || s.seq < above->seq)) above = &s;
  }
  if (!below) {
    // Shorter than every sample: the rate keeps falling (88 TFLOP/s at 512 tokens, 119 at 1024 on the A100), so
    // the two shortest samples' slope in log seq carries on, floored at the shortest's rate scaled by seq (its time
    // a token held: launch-bound) and never above it.
    const AttentionSample* next = nullptr;
    for (const auto& s : acc.attention_calibration)
      if (s.kernel == kernel && s.head_dim == width && s.seq > above->seq && (!next || s.seq < next->seq)) next = &s;
    double rate = above->achieved * seq / above->seq;
    if (next)
      rate = std::max(rate, above->achieved + (next->achieved - above->achieved) * std::log(seq / above->seq) /
                                                  std::log(next->seq / above->seq));
    return std::min(rate, above->achieved);
  }
  if (!above || above->seq == below->seq) return below->achieved;
  const double f = std::log(seq / below->seq) / std::log(above->seq / below->seq);
  return below->achieved + f * (above->achieved - below->achieved);
}

FlashRates flash_attention_rates(const Accelerator& acc, const std::string& kernel, double seq, double head_dim,
                                 const char* instead) {
  const double rate = flash_attention_rate(acc, kernel, seq, head_dim, instead);
  FlashRates r;
  r.forward = rate * (1 + 2.5 * 73 / 63) / 3.5;
  r.backward = r.forward * 63 / 73;
  return r;
}

double memory_time(const Accelerator& acc, double bytes, int kernels) {
  if (bytes <= 0) return 0;
  return bytes / (acc.memory_bandwidth * acc.memory_efficiency) + kernels * acc.kernel_overhead;
}

}  // namespace conduit::sim
