// PowerSGD; see powersgd.h for the algorithm, wire format and state.
#include "compress/powersgd.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "compress/methods.h"
#include "core/error.h"

namespace conduit::compress {

namespace {
constexpr const char* kQ = "psgd.q";
constexpr const char* kResidual = "psgd.residual";
}  // namespace

PowerSgd::Plan PowerSgd::plan(size_t numel, const TensorState& st) const {
  Plan p;
  if (st.shape.size() < 2 || st.step < start_iter_ || numel == 0) return p;
  size_t prod = 1;
  for (auto s : st.shape) prod *= s;
  if (prod != numel)
    throw InvalidArgument(fmt::format("powersgd: tensor of {} elements but the state's shape has {}", numel, prod));
  p.n = st.shape[0];
  p.m = numel / p.n;
  p.r = std::min<size_t>({static_cast<size_t>(r_), p.n, p.m});
  double ratio = static_cast<double>(p.n) * static_cast<double>(p.m) / (static_cast<double>(p.r) * (p.n + p.m));
  p.compressed = ratio >= min_ratio_ && ratio > 1.0;  // ratio 1 would make payload sizes ambiguous
  return p;
}

size_t PowerSgd::wire_bytes(size_t numel, const TensorState& st) const {
  Plan p = plan(numel, st);
  return p.compressed ? 4 * (p.p_len() + p.q_len()) : 4 * numel;
}

void PowerSgd::orthonormalise(float* rows, size_t r, size_t n) {
  for (size_t i = 0; i < r; ++i) {
    float* a = rows + i * n;
    for (size_t j = 0; j < i; ++j) {
      const float* b = rows + j * n;
      float dot = cblas_sdot(static_cast<int>(n), a, 1, b, 1);
      cblas_saxpy(static_cast<int>(n), -dot, b, 1, a, 1);
    }
    float norm = cblas_snrm2(static_cast<int>(n), a, 1);
    if (norm > 1e-30f)
      cblas_sscal(static_cast<int>(n), 1.0f / norm, a, 1);
    else
      std::fill(a, a + n, 0.0f);
  }
}

void PowerSgd::phase_p(std::span<const float> in, TensorState& st, std::span<float> p) const {
  Plan pl = plan(in.size(), st);
  const float* m = in.data();
  if (ef_) {
    auto& e = st.buffer(kResidual, in.size());
    for (size_t i = 0; i < in.size(); ++i) e[i] += in[i];
    m = e.data();
  }
  bool fresh = !st.buffers.count(kQ) || !warm_;
  auto& q = st.buffer(kQ, pl.q_len());
  if (fresh) {
    detail::Rng rng(detail::call_key(st.seed, 0, st.step, 0x7073));
    for (auto& v : q) v = static_cast<float>(rng.normal());
  }
  // P^T (r x n) = Q^T (r x m) * M^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(pl.r), static_cast<int>(pl.n),
              static_cast<int>(pl.m), 1.0f, q.data(), static_cast<int>(pl.m), m, static_cast<int>(pl.m), 0.0f,
              p.data(), static_cast<int>(pl.n));
}

void PowerSgd::phase_q(std::span<const float> in, TensorState& st, std::span<float> p, std::span<float> q) const {
  Plan pl = plan(in.size(), st);
  const float* m = ef_ ? st.buffers.at(kResidual).data() : in.data();
  orthonormalise(p.data(), pl.r, pl.n);
  // Q^T (r x m) = P^T (r x n) * M (n x m)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(pl.r), static_cast<int>(pl.m),
              static_cast<int>(pl.n), 1.0f, p.data(), static_cast<int>(pl.n), m, static_cast<int>(pl.m), 0.0f,
              q.data(), static_cast<int>(pl.m));
}

void PowerSgd::finish(std::span<const float> in, TensorState& st, std::span<const float> p,
                      std::span<const float> q_sum, int world, bool average, std::span<float> out) const {
  Plan pl = plan(in.size(), st);
  float inv_w = 1.0f / static_cast<float>(world);
  // out (n x m) = P (n x r) * Q^T (r x m), with P stored as P^T
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(pl.n), static_cast<int>(pl.m),
              static_cast<int>(pl.r), average ? inv_w : 1.0f, p.data(), static_cast<int>(pl.n), q_sum.data(),
              static_cast<int>(pl.m), 0.0f, out.data(), static_cast<int>(pl.m));
  if (ef_) {
    auto& e = st.buffers.at(kResidual);
    cblas_saxpy(static_cast<int>(e.size()), average ? -1.0f : -inv_w, out.data(), 1, e.data(), 1);
  }
  auto& q = st.buffer(kQ, pl.q_len());
  for (size_t i = 0; i < q.size(); ++i) q[i] = q_sum[i] * inv_w;
  ++st.step;
}

void PowerSgd::compress(std::span<const float> in, TensorState& st, Bytes& out) const {
  Plan pl = plan(in.size(), st);
  if (!pl.compressed) {
    out.resize(4 * in.size());
    if (!in.empty()) std::memcpy(out.data(), in.data(), 4 * in.size());
    skip(st);
    return;
  }
  out.resize(4 * (pl.p_len() + pl.q_len()));
  std::span<float> p(reinterpret_cast<float*>(out.data()), pl.p_len());
  std::span<float> q(reinterpret_cast<float*>(out.data()) + pl.p_len(), pl.q_len());
  phase_p(in, st, p);
  phase_q(in, st, p, q);
  std::vector<float> approx(in.size());
  finish(in, st, p, q, 1, true, approx);
}

void PowerSgd::decompress(std::span<const uint8_t> payload, const TensorState& st, std::span<float> out) const {
  size_t d = out.size();
  if (payload.size() == 4 * d) {
    if (d) std::memcpy(out.data(), payload.data(), 4 * d);
    return;
  }
  if (st.shape.size() < 2 || st.shape[0] == 0 || d % st.shape[0])
    throw InvalidArgument(fmt::format("powersgd: payload of {} bytes for {} elements without a matrix shape",
                                      payload.size(), d));
  size_t n = st.shape[0], m = d / n;
  size_t r = std::min<size_t>({static_cast<size_t>(r_), n, m});
  detail::check_payload("powersgd", payload.size(), 4 * r * (n + m));
  const float* p = reinterpret_cast<const float*>(payload.data());
  const float* q = p + n * r;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(m), static_cast<int>(r),
              1.0f, p, static_cast<int>(n), q, static_cast<int>(m), 0.0f, out.data(), static_cast<int>(m));
}

namespace methods {
CompressorPtr make_powersgd(const ParamReader& p) {
  return std::make_unique<PowerSgd>(static_cast<int>(p.integer("rank", 1, 1 << 20)),
                                    static_cast<uint64_t>(p.integer("start_iter", 0, int64_t(1) << 40)),
                                    p.real("min_ratio", 0, 1e12), p.boolean("error_feedback"),
                                    p.boolean("warm_start"));
}
}  // namespace methods

}  // namespace conduit::compress
