#include "sim/compute.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace conduit::sim {
namespace {

// A measured kernel's time holds one launch: the part the analytic model's ratio scales is what is left of it (scaled
// whole, plus the launch again, a calibrated shape cost its measured time and a second launch: 4 us on a 10 us GEMM).
double measured_work(const Accelerator& acc, double measured_s) {
  return std::max(measured_s - acc.kernel_overhead, 0.0);
}

// The analytic time, and whether memory traffic, not arithmetic, bounds it.
double analytic_time(const Accelerator& acc, const GemmShape& g, bool* memory_bound = nullptr) {
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch <= 0) return 0;
  const double tiles = std::ceil(g.m / acc.tile_m) * std::ceil(g.n / acc.tile_n) * g.batch;
  const double waves = std::ceil(tiles / acc.sm_count);
  const double wave_util = tiles / (waves * acc.sm_count);
  const double compute = g.flops() / (acc.peak_flops * acc.gemm_efficiency * wave_util);
  const double bytes = 2.0 * (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch;
  const double memory = bytes / (acc.memory_bandwidth * acc.memory_efficiency);
  if (memory_bound) *memory_bound = memory > compute;
  return std::max(compute, memory);
}

}  // namespace

double gemm_time(const Accelerator& acc, const GemmShape& g) {
  bool memory_bound = false;
  double t = analytic_time(acc, g, &memory_bound);
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

double memory_time(const Accelerator& acc, double bytes, int kernels) {
  if (bytes <= 0) return 0;
  return bytes / (acc.memory_bandwidth * acc.memory_efficiency) + kernels * acc.kernel_overhead;
}

}  // namespace conduit::sim
