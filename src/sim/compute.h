#pragma once
// Compute time of kernels as a function of their shape.
//
// GEMM (M x K) * (K x N), `batch` of them, 2MNK FLOPs each:
//   time = max(FLOPs / (peak * e_max * wave(M, N)), bytes / (memory bandwidth * e_mem)) + launch overhead
//   wave(M, N) = tiles / (waves * SMs), tiles = ceil(M / tile_m) * ceil(N / tile_n) * batch,
//                waves = ceil(tiles / SMs)   (tile and wave quantization, NVIDIA "Matrix Multiplication
//                Background User's Guide")
//   bytes = 2 (MK + KN + MN) * batch for 16-bit operands.
// e_max, e_mem, the tile and the SM count come from the cluster file (published kernel measurements). A
// `calibration:` table of measured GEMMs rescales the model by the measured/predicted ratio of the nearest
// measured shape (log distance), so a measured machine predicts itself.
// Element-wise kernels are memory-bound: bytes / (memory bandwidth * e_mem) + launch overhead.
#include "sim/cluster.h"

namespace conduit::sim {

struct GemmShape {
  double m = 1, n = 1, k = 1, batch = 1;
  double flops() const { return 2.0 * m * n * k * batch; }
};

double gemm_time(const Accelerator& acc, const GemmShape& g);
double gemm_efficiency(const Accelerator& acc, const GemmShape& g);  // achieved / peak
double memory_time(const Accelerator& acc, double bytes, int kernels = 1);

}  // namespace conduit::sim
