// PowerSGD; see powersgd.h for the algorithm, wire format and state.
#include "compress/powersgd.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "compress/methods.h"
#include "core/error.h"

namespace conduit::compress {

namespace {
std::atomic<uint64_t> g_blas_ns{0};

// Times one cblas_sgemm call.
template <typename... A>
void sgemm(A... args) {
  auto t0 = std::chrono::steady_clock::now();
  cblas_sgemm(args...);
  g_blas_ns.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0).count()),
                      std::memory_order_relaxed);
}

constexpr const char* kQ = "psgd.q";
constexpr const char* kResidual = "psgd.residual";
}  // namespace

PowerSgd::Plan PowerSgd::plan(size_t numel, const TensorState& st) const {
  Plan p;
  if (st.shape.size() < 2 || st.step < start_iter_ || numel == 0) return p;
  // The shape's product, checked for overflow (a wrapped product matched numel with n x m != numel).
  size_t prod = 1;
  bool wrapped = false;
  for (auto s : st.shape) wrapped |= __builtin_mul_overflow(prod, s, &prod);
  if (wrapped || prod != numel)
    throw InvalidArgument(fmt::format("powersgd: tensor of {} elements but the state's shape has {}", numel,
                                      wrapped ? std::string("more than 2^64") : std::to_string(prod)));
  p.n = st.shape[0];
  p.m = numel / p.n;
  p.r = std::min<size_t>({static_cast<size_t>(r_), p.n, p.m});
  double ratio = static_cast<double>(p.n) * static_cast<double>(p.m) / (static_cast<double>(p.r) * (p.n + p.m));
  // ratio 1 would make payload sizes ambiguous; BLAS takes int dimensions: a side past INT_MAX goes uncompressed
  // (cast, it wrapped negative and OpenBLAS refused the call, leaving P and the approximation stale).
  constexpr size_t kBlasMax = static_cast<size_t>(std::numeric_limits<int>::max());
  p.compressed = ratio >= min_ratio_ && ratio > 1.0 && p.n <= kBlasMax && p.m <= kBlasMax;
  return p;
}

size_t PowerSgd::wire_bytes(size_t numel, const TensorState& st) const {
  Plan p = plan(numel, st);
  return wire_size() * (p.compressed ? p.p_len() + p.q_len() : numel);
}

void PowerSgd::round_to_wire(std::span<float> x) const {
  if (wire_ == DType::f32 || x.empty()) return;
  std::vector<uint16_t> h(x.size());
  if (wire_ == DType::f16) {
    convert_f32_to_f16(x.data(), h.data(), x.size());
    convert_f16_to_f32(h.data(), x.data(), x.size());
  } else {
    convert_f32_to_bf16(x.data(), h.data(), x.size());
    convert_bf16_to_f32(h.data(), x.data(), x.size());
  }
}

namespace {
// Writes x as the wire type into out (x.size() * size bytes).
void encode_wire(DType wire, std::span<const float> x, uint8_t* out) {
  if (x.empty()) return;
  if (wire == DType::f32) std::memcpy(out, x.data(), 4 * x.size());
  else if (wire == DType::f16) convert_f32_to_f16(x.data(), reinterpret_cast<uint16_t*>(out), x.size());
  else convert_f32_to_bf16(x.data(), reinterpret_cast<uint16_t*>(out), x.size());
}
void decode_wire(DType wire, const uint8_t* in, std::span<float> x) {
  if (x.empty()) return;
  if (wire == DType::f32) std::memcpy(x.data(), in, 4 * x.size());
  else if (wire == DType::f16) convert_f16_to_f32(reinterpret_cast<const uint16_t*>(in), x.data(), x.size());
  else convert_bf16_to_f32(reinterpret_cast<const uint16_t*>(in), x.data(), x.size());
}
}  // namespace

void PowerSgd::orthonormalise(float* rows, size_t r, size_t n) {
  // O(n r^2), small next to the products; dot products in double. (Hand-written: OpenBLAS 0.3.21's snrm2 returned
  // wrong norms for the nearly cancelled columns of rank-deficient inputs.)
  for (size_t i = 0; i < r; ++i) {
    float* a = rows + i * n;
    double before = 0;
    for (size_t k = 0; k < n; ++k) before += static_cast<double>(a[k]) * a[k];
    // Two passes ("twice is enough"): one pass loses orthogonality when a column is nearly dependent on the
    // previous ones (e.g. a gradient of rank below r), and the normalised remainder would leak into their span.
    for (int pass = 0; pass < 2; ++pass)
      for (size_t j = 0; j < i; ++j) {
        const float* b = rows + j * n;
        double dot = 0;
        for (size_t k = 0; k < n; ++k) dot += static_cast<double>(a[k]) * b[k];
        float f = static_cast<float>(dot);
        for (size_t k = 0; k < n; ++k) a[k] -= f * b[k];
      }
    double ss = 0;
    for (size_t k = 0; k < n; ++k) ss += static_cast<double>(a[k]) * a[k];
    double norm = std::sqrt(ss);
    // A column (numerically) in the span of the previous ones carries no new direction: its remainder is rounding
    // noise that would not be orthogonal to the span. It becomes zero (phase_p draws a fresh Q column for it).
    if (norm > 1e-30 && norm > 1e-4 * std::sqrt(before)) {
      float inv = static_cast<float>(1.0 / norm);
      for (size_t k = 0; k < n; ++k) a[k] *= inv;
    } else {
      std::fill(a, a + n, 0.0f);
    }
  }
}

double PowerSgd::blas_seconds() { return static_cast<double>(g_blas_ns.load()) * 1e-9; }

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
  } else {
    // A column of Q that became zero (its P column was dependent) is redrawn, identically on every rank.
    detail::Rng rng(detail::call_key(st.seed, 1, st.step, 0x7073));
    for (size_t j = 0; j < pl.r; ++j) {
      float* row = q.data() + j * pl.m;
      if (std::all_of(row, row + pl.m, [](float v) { return v == 0.0f; }))
        for (size_t k = 0; k < pl.m; ++k) row[k] = static_cast<float>(rng.normal());
    }
  }
  // P^T (r x n) = Q^T (r x m) * M^T
  sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(pl.r), static_cast<int>(pl.n),
              static_cast<int>(pl.m), 1.0f, q.data(), static_cast<int>(pl.m), m, static_cast<int>(pl.m), 0.0f,
              p.data(), static_cast<int>(pl.n));
}

void PowerSgd::phase_q(std::span<const float> in, TensorState& st, std::span<float> p, std::span<float> q) const {
  Plan pl = plan(in.size(), st);
  const float* m = ef_ ? st.buffers.at(kResidual).data() : in.data();
  orthonormalise(p.data(), pl.r, pl.n);
  // Q^T (r x m) = P^T (r x n) * M (n x m)
  sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(pl.r), static_cast<int>(pl.m),
              static_cast<int>(pl.n), 1.0f, p.data(), static_cast<int>(pl.n), m, static_cast<int>(pl.m), 0.0f,
              q.data(), static_cast<int>(pl.m));
}

void PowerSgd::finish(std::span<const float> in, TensorState& st, std::span<const float> p,
                      std::span<const float> q_sum, int world, bool average, std::span<float> out) const {
  Plan pl = plan(in.size(), st);
  float inv_w = 1.0f / static_cast<float>(world);
  // out (n x m) = P (n x r) * Q^T (r x m), with P stored as P^T
  sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(pl.n), static_cast<int>(pl.m),
              static_cast<int>(pl.r), average ? inv_w : 1.0f, p.data(), static_cast<int>(pl.n), q_sum.data(),
              static_cast<int>(pl.m), 0.0f, out.data(), static_cast<int>(pl.m));
  if (ef_) {
    auto& e = st.buffers.at(kResidual);
    // In pieces BLAS's int counts hold (a tensor of 2^31 elements or more wrapped to a negative count, and BLAS
    // did nothing: the residual kept what had been sent).
    constexpr size_t kPiece = size_t{1} << 30;
    for (size_t at = 0; at < e.size(); at += kPiece)
      cblas_saxpy(static_cast<int>(std::min(kPiece, e.size() - at)), average ? -1.0f : -inv_w, out.data() + at, 1,
                  e.data() + at, 1);
  }
  // The next step's warm start. Each column of Q is kept at unit length: P = M Q is orthonormalised column by column,
  // which no column's length changes, but an unnormalised Q grows like M's largest singular value s, so P grew like
  // s^2 and left a 16-bit wire's range (f16 tops out at 65504: s = 1000 sent zeros and twice the gradient in turn,
  // s = 1e-3 underflowed to 30-40% error). A zero column stays zero (phase_p redraws it).
  auto& q = st.buffer(kQ, pl.q_len());
  for (size_t j = 0; j < pl.r; ++j) {
    const float* src = q_sum.data() + j * pl.m;
    float* dst = q.data() + j * pl.m;
    double ss = 0;
    for (size_t k = 0; k < pl.m; ++k) ss += static_cast<double>(src[k]) * src[k];
    const float inv = ss > 0 ? static_cast<float>(1.0 / std::sqrt(ss)) : 0.0f;
    for (size_t k = 0; k < pl.m; ++k) dst[k] = src[k] * inv;
  }
  ++st.step;
}

void PowerSgd::compress(std::span<const float> in, TensorState& st, Bytes& out) const {
  Plan pl = plan(in.size(), st);
  const size_t w = wire_size();
  if (!pl.compressed) {
    out.resize(w * in.size());
    encode_wire(wire_, in, out.data());
    skip(st);
    return;
  }
  // The single-worker form of the allreduce path: P and Q rounded to the wire type as a receiver sees them, and the
  // approximation (hence the residual) made from exactly what the payload carries.
  thread_local std::vector<float> p, q, approx;  // reused: fresh buffers per call would cost page faults
  p.resize(pl.p_len());
  q.resize(pl.q_len());
  phase_p(in, st, p);
  round_to_wire(p);
  phase_q(in, st, p, q);
  round_to_wire(p);
  round_to_wire(q);
  out.resize(w * (pl.p_len() + pl.q_len()));
  encode_wire(wire_, p, out.data());
  encode_wire(wire_, q, out.data() + w * pl.p_len());
  approx.resize(in.size());
  finish(in, st, p, q, 1, true, approx);
}

void PowerSgd::decompress(std::span<const uint8_t> payload, const TensorState& st, std::span<float> out) const {
  size_t d = out.size();
  const size_t w = wire_size();
  if (payload.size() == w * d) {
    decode_wire(wire_, payload.data(), out);
    // (as the factor branch refuses them: a corrupt payload, or a value past a 16-bit wire's range at its sender)
    for (size_t i = 0; i < d; ++i)
      if (!std::isfinite(out[i]))
        throw InvalidArgument(
            fmt::format("powersgd: element {} of an uncompressed payload of {} elements is {} ({} "
                        "wire): beyond the wire's range at its sender (f16 tops out at 65504, bf16 at "
                        "about 3.39e38), a diverged run, or a corrupt payload; allowed: finite values "
                        "within the wire's range (wire=bf16 or f32)",
                        i, d, out[i], dtype_name(wire_)));
    return;
  }
  if (st.shape.size() < 2 || st.shape[0] == 0 || d % st.shape[0])
    throw InvalidArgument(fmt::format("powersgd: payload of {} bytes for {} elements without a matrix shape",
                                      payload.size(), d));
  size_t n = st.shape[0], m = d / n;
  // BLAS takes int dimensions, so plan() sends a matrix with a side past INT_MAX uncompressed (w * d bytes, decoded
  // above) and no encoder writes P and Q for one. The shape is this rank's, but the payload is a peer's: one of
  // exactly r (n + m) elements for such a matrix (corrupt, or from a peer with another configuration) reached the
  // casts below, where n = 2^31 became negative and OpenBLAS refused the product, leaving out as it was.
  constexpr size_t kBlasMax = static_cast<size_t>(std::numeric_limits<int>::max());
  if (n > kBlasMax || m > kBlasMax)
    throw InvalidArgument(
        fmt::format("powersgd: payload of {} bytes is not the {} bytes of an uncompressed {} x {} "
                    "matrix; allowed: P and Q only for sides up to {} (BLAS's int), larger ones "
                    "travel uncompressed",
                    payload.size(), w * d, n, m, kBlasMax));
  size_t r = std::min<size_t>({static_cast<size_t>(r_), n, m});
  detail::check_payload("powersgd", payload.size(), w * r * (n + m));
  thread_local std::vector<float> pq;
  pq.resize(r * (n + m));
  decode_wire(wire_, payload.data(), pq);
  const float* p = pq.data();
  const float* q = p + n * r;
  // A peer's factors, refused before anything is written where they are not finite or their product could leave
  // the floats (each element of P^T Q is at most r max|P| max|Q|), as every other decoder refuses a payload that
  // decodes past them (the collective path checks the summed factors).
  float most_p = 0, most_q = 0;
  for (size_t i = 0; i < pq.size(); ++i) {
    if (!std::isfinite(pq[i]))
      throw InvalidArgument(
          fmt::format("powersgd: element {} of the payload's factors is {}; allowed: finite factors", i, pq[i]));
    float& most = i < n * r ? most_p : most_q;
    most = std::max(most, std::abs(pq[i]));
  }
  if (static_cast<double>(r) * most_p * most_q > std::numeric_limits<float>::max())
    throw InvalidArgument(
        fmt::format("powersgd: the payload's factors (max |P| {}, max |Q| {}, rank {}) can multiply past the floats; "
                    "allowed: factors whose product stays within 3.4e38",
                    most_p, most_q, r));
  sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(m), static_cast<int>(r),
              1.0f, p, static_cast<int>(n), q, static_cast<int>(m), 0.0f, out.data(), static_cast<int>(m));
}

std::vector<float> PowerSgd::residual(const TensorState& st) const {
  const auto it = st.buffers.find(kResidual);
  return it == st.buffers.end() ? std::vector<float>{} : it->second;
}

namespace methods {
CompressorPtr make_powersgd(const ParamReader& p) {
  const std::string& w = p.text("wire");
  DType wire = w == "f32" ? DType::f32 : w == "f16" ? DType::f16 : w == "bf16" ? DType::bf16 : DType::i8;
  if (wire == DType::i8)
    throw ConfigError(fmt::format("compressor powersgd: parameter wire='{}' must be one of f32, f16, bf16", w));
  return std::make_unique<PowerSgd>(static_cast<int>(p.integer("rank", 1, 1 << 20)),
                                    static_cast<uint64_t>(p.integer("start_iter", 0, int64_t(1) << 40)),
                                    p.real("min_ratio", 0, 1e12), p.boolean("error_feedback"),
                                    p.boolean("warm_start"), wire);
}
}  // namespace methods

}  // namespace conduit::compress
