#pragma once
// Compute time of kernels as a function of their shape.
//
// GEMM (M x K) * (K x N), `batch` of them, 2MNK FLOPs each:
//   time = max(compute, bytes / (memory bandwidth * e_mem)) + launch overhead
//   compute = sum over waves of the wave's largest tile, 2 K rows cols / (peak * e_max / SMs): the
//             ceil(M / tile_m) * ceil(N / tile_n) * batch tiles (those of the M and N remainders smaller), largest
//             first, SMs at a time (tile and wave quantization, NVIDIA "Matrix Multiplication Background User's
//             Guide"); full tiles only: FLOPs / (peak * e_max * tiles / (waves * SMs))
//   bytes = 2 (MK + KN + MN) * batch for 16-bit operands.
//   Fewer tiles than SMs: K split over s blocks a tile (split-K; s <= SMs / tiles, each split at least a tile_n deep
//   slice's time), compute / s
//   and 8 s M N batch more bytes (fp32 partial sums written and read), the s of the shortest time.
// e_max, e_mem, the tile and the SM count come from the cluster file (published kernel measurements). A
// `calibration:` table of measured GEMMs rescales the model by the measured/predicted ratio of the nearest
// measured shape (log distance), so a measured machine predicts itself.
// A 2-D convolution is costed as its implicit GEMM (M = batch * H_out * W_out, N = out channels, K = in * k * k;
// the input gradient (M x N)(N x K), the weight gradient (K x M)(M x N)), unless the accelerator has a
// `conv_calibration:` table of measured convolutions: then the pass's time is the nearest measured convolution's
// (log distance over M, N, K) time for that pass, scaled by the implicit-GEMM model's ratio between the two shapes
// (exactly the measured time at a measured shape). CPU frameworks run convolutions as direct kernels (oneDNN),
// several times faster than the im2col GEMM of the same shape.
// Max pooling (k x k windows, stride k) over N = batch * channels * H * W elements of `elem_bytes` each: the nearest
// measured pooling (`pool_calibration:`, log distance over N and k) scaled by N / its N; without one, memory-bound
// (forward reads N and writes N / k^2 elements, backward the reverse).
// Element-wise kernels are memory-bound: bytes / (memory bandwidth * e_mem) + launch overhead.
#include "sim/cluster.h"

namespace conduit::sim {

struct GemmShape {
  double m = 1, n = 1, k = 1, batch = 1;
  double flops() const { return 2.0 * m * n * k * batch; }
};

// A convolution with an output feature map of out_h x out_w (stride and padding only set the input size).
struct ConvShape {
  double batch = 1, in = 1, out = 1, out_h = 1, out_w = 1, kernel = 1;
  GemmShape forward_gemm() const { return {batch * out_h * out_w, out, in * kernel * kernel, 1}; }
  double flops() const { return forward_gemm().flops(); }  // each of the three passes
};
enum class ConvPass { kForward, kInputGrad, kWeightGrad };
GemmShape conv_pass_gemm(const ConvShape& c, ConvPass p);  // the implicit GEMM of a pass

// (*memory_bound: whether memory traffic, not arithmetic, bounds the analytic time)
double gemm_time(const Accelerator& acc, const GemmShape& g, bool* memory_bound = nullptr);
double conv_time(const Accelerator& acc, const ConvShape& c, ConvPass p);
struct PoolShape {
  double batch = 1, channels = 1, height = 1, width = 1, kernel = 2;
  double elements() const { return batch * channels * height * width; }
};
double pool_time(const Accelerator& acc, const PoolShape& p, bool backward, double elem_bytes);

// The measured convolution conv_time scales from (nullptr without a conv calibration table).
const ConvSample* nearest_conv_sample(const Accelerator& acc, const ConvShape& c);
double gemm_efficiency(const Accelerator& acc, const GemmShape& g);  // achieved / peak
double memory_time(const Accelerator& acc, double bytes, int kernels = 1);

// FlashAttention-2 or -3's (`kernel`: "flash2", "flash3") forward + backward FLOP/s over causal attention of `seq`
// tokens and heads `head_dim` wide, from the accelerator's attention_calibration: the samples of the nearest head
// width (log distance; the narrower of two as near), interpolated linearly in log seq between the two around it; the
// longest's rate beyond them (it levels off), below the shortest the two shortest's slope carried on, floored at
// the shortest's rate times seq / its seq. ConfigError naming the accelerator when it has no sample of the kernel,
// and `instead`, the command's other choices (sim step's by default; sim infer takes others).
inline constexpr const char* kStepAttentionInstead =
    "--attention-kernels flash (FlashAttention at the GEMM rate), fused, eager";
double flash_attention_rate(const Accelerator& acc, const std::string& kernel, double seq, double head_dim,
                            const char* instead = kStepAttentionInstead);
// That rate split between the passes as FlashAttention-2's peaks on the A100 are, "up to 73% of the theoretical max
// throughput in the forward pass, and up to 63% ... in the backward pass" (Dao 2023, section 1): 3.5 F / rate =
// F / forward + 2.5 F / backward, backward = forward 63 / 73 (F: the forward's FLOPs, FlashAttention's count).
struct FlashRates {
  double forward = 0, backward = 0;
};
FlashRates flash_attention_rates(const Accelerator& acc, const std::string& kernel, double seq, double head_dim,
                                 const char* instead = kStepAttentionInstead);
// The forward's FLOPs as FlashAttention counts them: 4 s^2 d a head and sequence, halved by the causal mask.
inline double flash_attention_forward_flops(double batch, double heads, double seq, double head_dim) {
  return 2 * batch * heads * seq * seq * head_dim;
}

}  // namespace conduit::sim
