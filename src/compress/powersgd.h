#pragma once
// PowerSGD (Vogels et al. 2019): a rank-r approximation of each gradient matrix M (n x m: shape[0] x the rest) by
// one step of subspace iteration, warm-started from the previous step's Q, with error feedback:
//   M = G + E;  P = M Q;  allreduce P;  P = orthonormalise(P);  Q = M^T P;  allreduce Q;  approx = P Q^T / W
//   E = M - approx (per worker; approx is the same on every worker)
// Both products and the final approximation are cblas_sgemm calls; the Gram-Schmidt step is O(n r^2).
// Tensors that are 1-D, whose ratio n*m / (r*(n+m)) is below min_ratio, or seen before start_iter go uncompressed
// (allreduced in the wire type; no error feedback yet before start_iter, as in the reference implementation).
//
// Wire: w*r*(n+m) bytes per compressed matrix (P then Q), w*d otherwise, where w is the wire element size: 4 for
// `wire=f32` (the default), 2 for `wire=f16` / `wire=bf16` (P, Q and the uncompressed tensors travel as 16-bit floats,
// summed in f32 at each hop by the runtime's allreduce, as PyTorch's powerSGD hook over an fp16 bucket does). Averaged
// over f16, a round whose sum leaves the range is sent again with each rank's part divided by W before it is narrowed
// (the mean crosses; P's scale drops out when it is orthonormalised, Q arrives as the mean). The
// approximation and the residual are computed from the rounded P and Q everyone received, so error feedback also
// absorbs the rounding.
// State: "psgd.q" (m x r, kept between steps when warm_start), "psgd.residual" (n x m when error_feedback).
// Layout: P and Q are stored transposed (r x n and r x m, each column of P contiguous).
//
// The Compressor interface (compress/decompress) runs the single-worker form (W = 1): the payload is P then Q and
// decompress returns P Q^T. compressed_allreduce runs the phases below over a communicator; the batched variant
// (compressed_allreduce_many) packs the P's (and raw tensors) of many tensors into one allreduce and the Q's into
// a second one.
#include "compress/compressor.h"
#include "core/dtype.h"

namespace conduit::compress {

class PowerSgd : public Compressor {
 public:
  PowerSgd(int rank, uint64_t start_iter, double min_ratio, bool error_feedback, bool warm_start,
           DType wire = DType::f32)
      : r_(rank), start_iter_(start_iter), min_ratio_(min_ratio), ef_(error_feedback), warm_(warm_start), wire_(wire) {}
  std::string name() const override { return "powersgd"; }
  Collective collective() const override { return Collective::powersgd; }
  bool stateful() const override { return true; }
  size_t wire_bytes(size_t numel, const TensorState& st) const override;
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override;
  void decompress(std::span<const uint8_t> payload, const TensorState& st, std::span<float> out) const override;
  // "psgd.residual": empty without error_feedback, for a tensor sent uncompressed, and before its first compressed
  // step (start_iter).
  std::vector<float> residual(const TensorState& st) const override;

  struct Plan {
    bool compressed = false;
    size_t n = 0, m = 0, r = 0;
    size_t p_len() const { return n * r; }
    size_t q_len() const { return m * r; }
  };
  Plan plan(size_t numel, const TensorState& st) const;
  // Phase 1 (compressed plans only): folds the residual into M and writes P = M Q (r x n, transposed) into p.
  void phase_p(std::span<const float> in, TensorState& st, std::span<float> p) const;
  // Phase 2: orthonormalises the summed P in place and writes this worker's Q = M^T P into q.
  void phase_q(std::span<const float> in, TensorState& st, std::span<float> p, std::span<float> q) const;
  // Phase 3: with the summed Q, out = P Q^T (divided by `world` when average), residual = M - P Q^T / world, keeps
  // the summed Q's columns scaled to unit length for the next warm start and advances the step. out may alias in.
  // A Q that arrived as the mean (each rank's divided by W before the sum) is passed with world 1.
  void finish(std::span<const float> in, TensorState& st, std::span<const float> p, std::span<const float> q_sum,
              int world, bool average, std::span<float> out) const;
  // The element type P, Q and uncompressed tensors travel as (f32, f16 or bf16) and its size in bytes.
  DType wire() const { return wire_; }
  size_t wire_size() const { return wire_ == DType::f32 ? 4 : 2; }
  // Rounds x in place to the wire type (what a receiver gets back after converting to f32); no-op for f32.
  void round_to_wire(std::span<float> x) const;
  // For uncompressed plans: advance the state (out = the allreduced tensor, handled by the caller).
  void skip(TensorState& st) const { ++st.step; }

  // Gram-Schmidt (two passes) on the r rows (length n) of a row-major r x n matrix; a row that is numerically
  // dependent on the previous ones (remainder below 1e-4 of its norm) becomes zero.
  static void orthonormalise(float* rows, size_t r, size_t n);
  // Seconds spent in the matrix products (cblas_sgemm) by this process so far (for `conduit bench compress`).
  static double blas_seconds();

 private:
  int r_;
  uint64_t start_iter_;

 public:
  uint64_t warmup_calls() const override { return start_iter_; }

 private:
  double min_ratio_;
  bool ef_, warm_;
  DType wire_;
};

}  // namespace conduit::compress
