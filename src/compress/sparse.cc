// Sparsifiers. Indices are u32 (tensors up to 2^32 - 1 elements), sorted ascending.
//
//   method     wire format                        bytes                          collective   state
//   topk       u32 idx[k] , f32 val[k]            8k, k = ceil(ratio*d)          allgather    -
//   randk      f32 val[k] (indices from the shared seed and step)
//                                                  4k, k = ceil(ratio*d)          allreduce    -
//   threshold  u32 idx[n] , f32 val[n]            8n, n = #{i : |x_i| >= t}      allgather    -
//   dgc        u32 idx[k] , f32 val[k]            8k, k = ceil(density(step)*d)  allgather    u (momentum), v
//
// Top-k selection (as DGC does): estimate the threshold from a random sample of |x| (sample*d elements, at least
// 4096) at twice the wanted density, gather the candidates above it in one pass, and select the exact k largest
// among them; when the estimate yields fewer than k candidates, fall back to an exact selection over all of x.
// Ties at the k-th magnitude are broken by lower index. The result is always the exact top-k set.
// Random-k (Stich et al. 2018): k distinct indices drawn from (seed, step), identical on every rank, so only values
// travel and the payloads add up element-wise (allreduce); "unbiased" scales values by d/k so that E[C(x)] = x.
// DGC (Lin et al. 2018): optional local gradient clipping of g to clip_norm; momentum correction u = m u + g,
// v = v + u; send the top-k of v; momentum factor masking clears u and v where sent; the density warms up
// exponentially 25%, 6.25%, 1.5625%, 0.4% (never below ratio) over four equal stages of warmup_steps.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>

#include <fmt/format.h>

#include "compress/methods.h"
#include "core/error.h"

namespace conduit::compress {
namespace detail {
namespace {

void exact_topk(std::span<const float> x, size_t k, std::vector<uint32_t>& idx) {
  size_t d = x.size();
  std::vector<float> a(d);
  for (size_t i = 0; i < d; ++i) a[i] = std::fabs(x[i]);
  std::nth_element(a.begin(), a.begin() + (d - k), a.end());
  float t = a[d - k];
  size_t above = 0;
  for (size_t i = d - k; i < d; ++i) above += a[i] > t;
  size_t ties = k - above;  // how many elements equal to t to take (lowest indices first)
  idx.clear();
  idx.reserve(k);
  for (size_t i = 0; i < d; ++i) {
    float v = std::fabs(x[i]);
    if (v > t || (v == t && ties > 0)) {
      if (v == t && !(v > t)) --ties;
      idx.push_back(static_cast<uint32_t>(i));
    }
  }
}

// max |x| over 64 elements, in 16 independent lanes (vectorizes without reassociation).
inline float block_max64(const float* x) {
  float m[16] = {};
  for (size_t i = 0; i < 64; i += 16)
    for (size_t j = 0; j < 16; ++j) {
      float a = std::fabs(x[i + j]);
      m[j] = m[j] < a ? a : m[j];
    }
  float r = 0;
  for (float v : m) r = r < v ? v : r;
  return r;
}

// Indices with |x| >= t, in order; false when more than `cap` qualify.
bool gather_above(std::span<const float> x, float t, size_t cap, std::vector<uint32_t>& out) {
  out.clear();
  const size_t d = x.size();
  constexpr size_t kB = 64;
  size_t i = 0;
  for (; i + kB <= d; i += kB) {
    if (block_max64(x.data() + i) < t) continue;
    for (size_t j = i; j < i + kB; ++j)
      if (std::fabs(x[j]) >= t) out.push_back(static_cast<uint32_t>(j));
    if (out.size() > cap) return false;
  }
  for (; i < d; ++i)
    if (std::fabs(x[i]) >= t) out.push_back(static_cast<uint32_t>(i));
  return out.size() <= cap;
}

}  // namespace

namespace {
void topk_select_finite(std::span<const float> x, size_t k, double sample_fraction, uint64_t sample_seed,
                        std::vector<uint32_t>& idx);
}  // namespace

void topk_select(std::span<const float> x, size_t k, double sample_fraction, uint64_t sample_seed,
                 std::vector<uint32_t>& idx) {
  topk_select_finite(x, k, sample_fraction, sample_seed, idx);
  if (idx.size() == std::min(k, x.size())) return;
  // Only NaN makes the comparisons above select fewer than k (a diverged gradient). Every rank must still send
  // exactly k entries (receivers size their buffers from k), so rank |x| with NaN as the largest value. (The
  // compressed exchanges refuse non-finite input before compressing, check_finite_input; this keeps a direct caller's
  // payload well-formed.)
  auto mag = [&](uint32_t i) {
    float a = std::fabs(x[i]);
    return std::isnan(a) ? std::numeric_limits<float>::infinity() : a;
  };
  idx.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) idx[i] = static_cast<uint32_t>(i);
  std::stable_sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return mag(a) > mag(b); });
  idx.resize(std::min(k, x.size()));
  std::sort(idx.begin(), idx.end());
}

namespace {
void topk_select_finite(std::span<const float> x, size_t k, double sample_fraction, uint64_t sample_seed,
                        std::vector<uint32_t>& idx) {
  const size_t d = x.size();
  if (k >= d) {
    idx.resize(d);
    for (size_t i = 0; i < d; ++i) idx[i] = static_cast<uint32_t>(i);
    return;
  }
  if (k == 0) {
    idx.clear();
    return;
  }
  size_t m = static_cast<size_t>(sample_fraction * static_cast<double>(d));
  m = std::max<size_t>(m, 4096);
  // Sampling pays off only when the sample is much smaller than x and the density is low.
  if (sample_fraction <= 0 || m * 4 > d || k * 8 > d) {
    exact_topk(x, k, idx);
    return;
  }
  Rng rng(sample_seed);
  std::vector<float> s(m);
  for (size_t i = 0; i < m; ++i) s[i] = std::fabs(x[rng.below(d)]);
  // Rank (from the top) in the sample that corresponds to twice the wanted density.
  double want = 2.0 * static_cast<double>(k) / static_cast<double>(d);
  size_t r = std::min<size_t>(m - 1, static_cast<size_t>(want * static_cast<double>(m)));
  std::nth_element(s.begin(), s.begin() + (m - 1 - r), s.end());
  float t = s[m - 1 - r];
  std::vector<uint32_t> cand;
  cand.reserve(4 * k + 64);
  if (t <= 0 || !gather_above(x, t, 8 * k + 1024, cand) || cand.size() < k) {
    exact_topk(x, k, idx);
    return;
  }
  // Exact k largest among the candidates.
  std::vector<float> v(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) v[i] = std::fabs(x[cand[i]]);
  std::vector<float> w = v;
  size_t c = cand.size();
  std::nth_element(w.begin(), w.begin() + (c - k), w.end());
  float kth = w[c - k];
  size_t above = 0;
  for (size_t i = c - k; i < c; ++i) above += w[i] > kth;
  size_t ties = k - above;
  idx.clear();
  idx.reserve(k);
  for (size_t i = 0; i < c; ++i) {
    if (v[i] > kth) {
      idx.push_back(cand[i]);
    } else if (v[i] == kth && ties > 0) {
      --ties;
      idx.push_back(cand[i]);
    }
  }
}
}  // namespace

}  // namespace detail

namespace methods {
namespace {

using detail::ceil_div;
using detail::check_payload;

size_t k_of(double ratio, size_t d) {
  if (d == 0) return 0;
  size_t k = static_cast<size_t>(std::ceil(ratio * static_cast<double>(d) - 1e-9));
  return std::clamp<size_t>(k, 1, d);
}

void check_index_range(const std::string& who, size_t d) { detail::check_u32_elements(who, d, "u32 indices"); }

// Payload [u32 idx[n]][f32 val[n]] from indices into x.
void write_sparse(std::span<const float> x, const std::vector<uint32_t>& idx, Bytes& out) {
  size_t n = idx.size();
  out.resize(8 * n);
  if (n == 0) return;
  std::memcpy(out.data(), idx.data(), 4 * n);
  float* v = reinterpret_cast<float*>(out.data() + 4 * n);
  for (size_t i = 0; i < n; ++i) v[i] = x[idx[i]];
}

// Every encoder writes its indices in ascending order, each once; a payload whose indices are not (a duplicate
// added twice) or that holds another count than a fixed-size method's k is refused before anything is written.
// `least`..`most`: the entries a method with a schedule may send (DGC's warm-up densities down to its ratio).
// Values must be finite, as the other gathered (non-linear) methods' payloads must: the quantizers refuse a
// non-finite scale, and the compressed exchanges refuse a nan or inf in these methods' input before compressing
// (check_finite_input), so a peer's inf or NaN value is a diverged or corrupt sender (or DGC's accumulated v past
// the floats), refused with the entry named rather than summed into every rank's result. Only the casts and an
// uncompressed allreduce pass nan and inf on (as does random-k, whose values are summed by an allreduce before they
// are decoded; see RandK::decode).
void read_sparse(const std::string& who, std::span<const uint8_t> p, std::span<float> out, bool add,
                 bool subtract = false, size_t expect_entries = SIZE_MAX, size_t least = 0, size_t most = SIZE_MAX) {
  if (p.size() % 8) throw InvalidArgument(fmt::format("{}: payload of {} bytes is not 8 per entry", who, p.size()));
  size_t n = p.size() / 8;
  if (expect_entries != SIZE_MAX && n != expect_entries)
    throw InvalidArgument(fmt::format("{}: payload of {} entries for {} elements; allowed: exactly {}", who, n,
                                      out.size(), expect_entries));
  if (n < least || n > most)
    throw InvalidArgument(
        fmt::format("{}: payload of {} entries for {} elements; allowed: {} to {}", who, n, out.size(), least, most));
  const uint8_t* ip = p.data();
  const uint8_t* vp = p.data() + 4 * n;
  for (size_t i = 0, prev = 0; i < n; ++i) {
    uint32_t j;
    float v;
    std::memcpy(&j, ip + 4 * i, 4);
    std::memcpy(&v, vp + 4 * i, 4);
    if (j >= out.size())
      throw InvalidArgument(
          fmt::format("{}: index {} (entry {}) out of range; allowed: indices below {}, the "
                      "tensor's size",
                      who, j, i, out.size()));
    if (i > 0 && j <= prev)
      throw InvalidArgument(
          fmt::format("{}: index {} after {} (entry {}); allowed: ascending indices, each once", who, j, prev, i));
    if (!std::isfinite(v))
      throw InvalidArgument(
          fmt::format("{}: entry {} (index {}) of the payload has value {}; allowed: finite values "
                      "(the sender's input diverged)",
                      who, i, j, v));
    prev = j;
  }
  if (!add) std::fill(out.begin(), out.end(), 0.0f);
  for (size_t i = 0; i < n; ++i) {
    uint32_t j;
    float v;
    std::memcpy(&j, ip + 4 * i, 4);
    std::memcpy(&v, vp + 4 * i, 4);
    if (subtract)
      out[j] -= v;
    else
      out[j] += v;
  }
}

class TopK : public Compressor {
 public:
  TopK(double ratio, double sample) : ratio_(ratio), sample_(sample) {}
  std::string name() const override { return "topk"; }
  Collective collective() const override { return Collective::allgather; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return 8 * k_of(ratio_, d); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    check_index_range("topk", in.size());
    thread_local std::vector<uint32_t> idx;
    detail::topk_select(in, k_of(ratio_, in.size()), sample_,
                        detail::call_key(st.seed, st.stream, st.step, 0x746b), idx);
    write_sparse(in, idx, out);
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    read_sparse("topk", p, out, false, false, k_of(ratio_, out.size()));
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("topk", p, acc, true, false, k_of(ratio_, acc.size()));
  }
  void decompress_sub(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("topk", p, acc, true, true, k_of(ratio_, acc.size()));
  }

 private:
  double ratio_, sample_;
};

class RandK : public Compressor {
 public:
  RandK(double ratio, bool unbiased) : ratio_(ratio), unbiased_(unbiased) {}
  std::string name() const override { return "randk"; }
  Collective collective() const override { return Collective::allreduce; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return 4 * k_of(ratio_, d); }
  // k distinct indices, ascending, from (seed, step) only: Floyd's algorithm over a bitmap.
  void indices(size_t d, const TensorState& st, uint64_t step, std::vector<uint32_t>& idx) const {
    size_t k = k_of(ratio_, d);
    idx.clear();
    if (k == d) {
      for (size_t i = 0; i < d; ++i) idx.push_back(static_cast<uint32_t>(i));
      return;
    }
    detail::Rng rng(detail::call_key(st.seed, 0, step, 0x726b));
    std::vector<uint64_t> bits(ceil_div(d, 64), 0);
    for (size_t j = d - k; j < d; ++j) {
      size_t t = rng.below(j + 1);
      if (bits[t / 64] >> (t % 64) & 1) t = j;
      bits[t / 64] |= 1ull << (t % 64);
    }
    idx.reserve(k);
    for (size_t w = 0; w < bits.size(); ++w)
      for (uint64_t b = bits[w]; b; b &= b - 1) idx.push_back(static_cast<uint32_t>(w * 64 + __builtin_ctzll(b)));
  }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    check_index_range("randk", d);
    thread_local std::vector<uint32_t> idx;
    indices(d, st, st.step, idx);
    out.resize(4 * idx.size());
    float* v = reinterpret_cast<float*>(out.data());
    float scale = unbiased_ && !idx.empty() ? static_cast<float>(static_cast<double>(d) / idx.size()) : 1.0f;
    for (size_t i = 0; i < idx.size(); ++i) v[i] = in[idx[i]] * scale;
    ++st.step;
  }
  void decode(std::span<const uint8_t> p, const TensorState& st, std::span<float> out, bool add) const {
    size_t d = out.size();
    check_payload("randk", p.size(), 4 * k_of(ratio_, d));
    if (st.step == 0) throw InvalidArgument("randk: decompress before any compress (the indices come from its step)");
    thread_local std::vector<uint32_t> idx;
    indices(d, st, st.step - 1, idx);
    // Values are not checked for inf and NaN, unlike the gathered sparse payloads (read_sparse): random-k is linear,
    // so what arrives here is the f32 sum an allreduce made of every rank's values, and an overflowed or nan sum is
    // passed on as the uncompressed allreduce passes it (the trainer reports the divergence from the loss). The
    // indices come from the shared seed and this state's step, never from the payload, so a nan cannot move one;
    // the payload's length is checked above.
    if (!add) std::fill(out.begin(), out.end(), 0.0f);
    const float* v = reinterpret_cast<const float*>(p.data());
    for (size_t i = 0; i < idx.size(); ++i) out[idx[i]] += v[i];
  }
  void decompress(std::span<const uint8_t> p, const TensorState& st, std::span<float> out) const override {
    decode(p, st, out, false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    decode(p, st, acc, true);
  }

 private:
  double ratio_;
  bool unbiased_;
};

class Threshold : public Compressor {
 public:
  explicit Threshold(double t) : t_(static_cast<float>(t)) {}
  std::string name() const override { return "threshold"; }
  Collective collective() const override { return Collective::allgather; }
  bool fixed_size() const override { return false; }
  size_t wire_bytes(size_t, const TensorState&) const override {
    throw InvalidArgument("threshold: the payload size depends on the data; use the payload's length");
  }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    check_index_range("threshold", in.size());
    thread_local std::vector<uint32_t> idx;
    idx.clear();
    for (size_t i = 0; i < in.size(); ++i)
      if (std::fabs(in[i]) >= t_) idx.push_back(static_cast<uint32_t>(i));
    write_sparse(in, idx, out);
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    read_sparse("threshold", p, out, false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("threshold", p, acc, true);
  }
  void decompress_sub(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("threshold", p, acc, true, true);
  }

 private:
  float t_;
};

class Dgc : public Compressor {
 public:
  Dgc(double ratio, double momentum, double clip, int64_t warmup, double sample)
      : ratio_(ratio), m_(static_cast<float>(momentum)), clip_(clip), warmup_(warmup), sample_(sample) {}
  uint64_t warmup_calls() const override { return warmup_ > 0 ? static_cast<uint64_t>(warmup_) : 0; }
  std::string name() const override { return "dgc"; }
  Collective collective() const override { return Collective::allgather; }
  bool stateful() const override { return true; }
  double density(uint64_t step) const {
    static const double kStages[4] = {0.25, 0.0625, 0.015625, 0.004};
    if (warmup_ > 0 && step < static_cast<uint64_t>(warmup_)) {
      size_t stage = static_cast<size_t>(step * 4 / static_cast<uint64_t>(warmup_));
      return std::max(ratio_, kStages[stage]);
    }
    return ratio_;
  }
  size_t wire_bytes(size_t d, const TensorState& st) const override { return 8 * k_of(density(st.step), d); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    check_index_range("dgc", d);
    auto& u = st.buffer("dgc.u", d);
    auto& v = st.buffer("dgc.v", d);
    float scale = 1.0f;
    if (clip_ > 0) {
      double ss = 0;
      for (float g : in) ss += static_cast<double>(g) * g;
      double norm = std::sqrt(ss);
      if (norm > clip_) scale = static_cast<float>(clip_ / norm);
    }
    for (size_t i = 0; i < d; ++i) {
      u[i] = m_ * u[i] + scale * in[i];
      v[i] += u[i];
    }
    thread_local std::vector<uint32_t> idx;
    detail::topk_select(v, k_of(density(st.step), d), sample_, detail::call_key(st.seed, st.stream, st.step, 0x6467),
                        idx);
    write_sparse(v, idx, out);
    for (uint32_t i : idx) u[i] = v[i] = 0.0f;
    ++st.step;
  }
  // A payload holds k entries for some density of the schedule: from the ratio's k up to the first warm-up stage's
  // (a payload cut short, or empty, decoded silently; the step is the sender's, not necessarily the decoder's state's).
  size_t least(size_t d) const { return k_of(ratio_, d); }
  size_t most(size_t d) const { return k_of(density(0), d); }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    read_sparse("dgc", p, out, false, false, SIZE_MAX, least(out.size()), most(out.size()));
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("dgc", p, acc, true, false, SIZE_MAX, least(acc.size()), most(acc.size()));
  }
  void decompress_sub(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    read_sparse("dgc", p, acc, true, true, SIZE_MAX, least(acc.size()), most(acc.size()));
  }
  // The local accumulation v: what the momentum-corrected updates added and no payload has sent yet.
  std::vector<float> residual(const TensorState& st) const override {
    const auto it = st.buffers.find("dgc.v");
    return it == st.buffers.end() ? std::vector<float>{} : it->second;
  }

 private:
  double ratio_;
  float m_;
  double clip_;
  int64_t warmup_;
  double sample_;
};

}  // namespace

CompressorPtr make_topk(const ParamReader& p) {
  return std::make_unique<TopK>(p.real("ratio", 1e-9, 1), p.real("sample", 0, 1));
}
CompressorPtr make_randk(const ParamReader& p) {
  return std::make_unique<RandK>(p.real("ratio", 1e-9, 1), p.boolean("unbiased"));
}
CompressorPtr make_threshold(const ParamReader& p) {
  const double t = p.real("threshold", 0, 3.4e38);
  // Compared in f32: a threshold that rounds to 0 there kept every element (8 bytes each: twice the input).
  if (t > 0 && static_cast<float>(t) == 0.0f)
    throw ConfigError(
        fmt::format("compressor threshold: parameter threshold='{}' rounds to 0 in f32; allowed: 0, or "
                    "1.5e-45 to 3.4e38",
                    p.text("threshold")));
  return std::make_unique<Threshold>(t);
}
CompressorPtr make_dgc(const ParamReader& p) {
  const int64_t warmup = p.integer("warmup_steps", 0, int64_t(1) << 40);
  // Four stages of floor(4 step / warmup_steps): with fewer than 4 steps some stages would be skipped.
  if (warmup > 0 && warmup < 4)
    throw ConfigError(fmt::format("compressor dgc: warmup_steps = {} is shorter than its four stages (25%, 6.25%, "
                                  "1.5625%, 0.4%, a step each at least); allowed: 0 (no warm-up) or 4..2^40",
                                  warmup));
  const double clip = p.real("clip_norm", 0, 3.4e38);
  // The clipping factor clip_norm / |g| is applied in f32: below f32's normal range it is 0 for any gradient of
  // norm 1 or more, and DGC then sent zeros for ever.
  if (clip > 0 && clip < 1.1754944e-38)
    throw ConfigError(
        fmt::format("compressor dgc: parameter clip_norm='{}' is below f32's normal range; allowed: 0 "
                    "(no clipping), or 1.2e-38 to 3.4e38",
                    p.text("clip_norm")));
  return std::make_unique<Dgc>(p.real("ratio", 1e-9, 1), p.real("momentum", 0, 0.999999), clip, warmup,
                               p.real("sample", 0, 1));
}

}  // namespace methods
}  // namespace conduit::compress
