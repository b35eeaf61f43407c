// Element-wise quantizers.
//
//   method    wire format                                               bytes for d elements     collective
//   none      f32[d]                                                    4d                       allreduce (f32)
//   fp16      f16[d] (round to nearest even)                            2d                       allreduce (f16)
//   bf16      bf16[d]                                                   2d                       allreduce (bf16)
//   int8      f32 scale[c] , i8[d]  (scale = max|x|/127 per chunk)      d + 4*ceil(d/chunk)      allgather
//   uint8     (f32 min, f32 scale)[c] , u8[d]  (min-max per chunk)      d + 8*ceil(d/chunk)      allgather
//   qsgd      f32 norm[c] , b-bit codes (level<<1 | sign), b=1+ceil(log2(s+1))
//                                                                        4*c + ceil(d*b/8)        allgather
//   qsgd      f32 norm[c] , Elias omega codes: nnz+1, then per nonzero     4*c + the codes' bytes   allgatherv
//   (coding=elias)        gap, sign bit, level; zero bits to a byte       (data-dependent)
//   terngrad  f32 scale , 2-bit codes (0, +1, -1)                        4 + ceil(d/4)            allgather
//   natural   sign bits[ceil(d/8)] , u8 exponent[d]                      d + ceil(d/8)            allgather
//
// QSGD (Alistarh et al. 2017): with norm = ||v||_2 of a bucket and r = s|v_i|/norm, the level is floor(r) + 1 with
// probability r - floor(r), else floor(r); Q(v_i) = norm * sign(v_i) * level / s is unbiased.
// coding=elias sends the same levels as the paper's section 3.1 codes them: only the nonzero levels, each as the
// Elias omega code of its distance from the previous nonzero element (the first's from position 0, 1-based), a sign
// bit and the omega code of its level (1..s), after the omega code of their count + 1; most significant bit first,
// the last byte padded with zero bits. At few levels most levels are 0 (s = 1 sends at most sqrt(d) nonzeros of a
// bucket of d in expectation) and the codes take a few bits a nonzero instead of b bits an element.
// TernGrad (Wen et al. 2017): s = max|g| (after optional clipping to 2.5 sigma), Q(g_i) = s sign(g_i) b_i with
// b_i ~ Bernoulli(|g_i|/s): unbiased when not clipped.
// Natural compression (Horvath et al. 2019): |x| in [2^e, 2^(e+1)) rounds up to 2^(e+1) with probability
// (|x| - 2^e)/2^e, which is the mantissa fraction: unbiased and E[C(x)^2] <= 9/8 x^2. Exponents saturate at 2^127;
// the input is finite (the exchanges refuse inf and NaN) and a payload with exponent 255 is refused.
// The kernels (kernels.inc) draw 16-bit uniforms (detail::random_block) and compare them with each probability kept
// to 16 fractional bits (rounded to nearest): each Bernoulli above is exact for a probability within 2^-17 of the
// stated as computed in f32. QSGD's r is |v_i| times scale = s / norm, the quotient and the product each rounded to
// f32 (the norm as sent), within a relative 2^-23 of the exact s|v_i|/norm: that much of r is bias too, up to
// s 2^-23 of a level, more than 2^-17 for s above 64 (TernGrad's |g_i| / s likewise, at most 2^-23 of s).
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "compress/kernels.h"
#include "compress/methods.h"
#include "core/error.h"

namespace conduit::compress::methods {
namespace {

using detail::ceil_div;
using detail::check_out;
using detail::check_payload;
using detail::get_f32;
using detail::put_f32;

// Thin forwards to the kernels chosen for this CPU (kernels.h).
float abs_max(const float* x, size_t n) { return kernels::get().abs_max(x, n); }
// The kernels square in f32 lanes, which overflow for |x| above ~1.8e19 (QSGD's norm then became inf and its whole
// bucket decoded as nan); such a bucket is summed again in double, scaled by its largest magnitude.
// Squares below FLT_MIN (|x| under ~1e-19) flush toward zero in those lanes: a bucket of such values summed to 0 or
// to a norm a percent low (a biased QSGD), so a small sum is summed again the same way.
double sum_squares(const float* x, size_t n) {
  const double fast = kernels::get().sum_squares(x, n);
  if (std::isfinite(fast) && fast > 1e-30) return fast;
  const double amax = abs_max(x, n);  // vectorized: an all-zero bucket ends here
  if (!(amax > 0) || !std::isfinite(amax)) return fast;
  double ss = 0;
  for (size_t i = 0; i < n; ++i) {
    const double v = static_cast<double>(x[i]) / amax;
    ss += v * v;
  }
  return ss * amax * amax;
}
void qsgd_codes(const float* x, size_t n, float scale, uint32_t smax, uint32_t base, uint32_t k_lo, uint32_t k_hi,
                uint16_t* codes) {
  kernels::get().qsgd_codes(x, n, scale, smax, base, k_lo, k_hi, codes);
}
// x[0..n) times 2^64 (exact for floats this small), in a per-thread buffer that stays valid until the next call:
// the input of a coder whose scale would overflow, brought up to where it fits.
const float* scaled_up(const float* x, size_t n) {
  thread_local std::vector<float> scaled;
  scaled.assign(x, x + n);
  for (auto& v : scaled) v = std::ldexp(v, 64);
  return scaled.data();
}

void tern_codes(const float* x, size_t n, float lo, float hi, float inv, uint32_t base, uint32_t k_lo, uint32_t k_hi,
                uint8_t* out) {
  kernels::get().tern_codes(x, n, lo, hi, inv, base, k_lo, k_hi, out);
}
// TernGrad writes codes 0 (zero), 1 (+s) and 2 (-s); a 3 is a corrupt payload.
void check_tern_codes(const uint8_t* in, size_t n) {
  if (size_t e = detail::first_code_above(in, n, 2, 2); e < n)
    throw InvalidArgument(
        fmt::format("terngrad: element {} of the payload has code 3; allowed: 0 (zero), 1 (+scale) "
                    "or 2 (-scale)",
                    e));
}
void tern_decode(const uint8_t* in, size_t n, float s, float* out, bool add) {
  kernels::get().tern_decode(in, n, s, out, add);
}
void natural_decode(const uint8_t* signs, const uint8_t* exps, size_t n, float* out, bool add) {
  kernels::get().natural_decode(signs, exps, n, out, add);
}

class NoneCompressor : public Compressor {
 public:
  std::string name() const override { return "none"; }
  Collective collective() const override { return Collective::allreduce; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return 4 * d; }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    out.resize(4 * in.size());
    if (!in.empty()) std::memcpy(out.data(), in.data(), 4 * in.size());
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    check_payload("none", p.size(), 4 * out.size());
    if (!out.empty()) std::memcpy(out.data(), p.data(), p.size());
  }
};

class HalfCompressor : public Compressor {
 public:
  explicit HalfCompressor(bool bf) : bf_(bf) {}
  std::string name() const override { return bf_ ? "bf16" : "fp16"; }
  Collective collective() const override { return Collective::allreduce; }
  DType linear_dtype() const override { return bf_ ? DType::bf16 : DType::f16; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return 2 * d; }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    out.resize(2 * in.size());
    auto* o = reinterpret_cast<uint16_t*>(out.data());
    if (bf_)
      convert_f32_to_bf16(in.data(), o, in.size());
    else
      convert_f32_to_f16(in.data(), o, in.size());
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    check_payload(name(), p.size(), 2 * out.size());
    auto* i = reinterpret_cast<const uint16_t*>(p.data());
    if (bf_)
      convert_bf16_to_f32(i, out.data(), out.size());
    else
      convert_f16_to_f32(i, out.data(), out.size());
  }

 private:
  bool bf_;
};

// int8 (symmetric) and uint8 (min-max), one scale (and min) per chunk.
class ByteQuantizer : public Compressor {
 public:
  ByteQuantizer(bool is_signed, size_t chunk) : signed_(is_signed), chunk_(chunk) {}
  std::string name() const override { return signed_ ? "int8" : "uint8"; }
  Collective collective() const override { return Collective::allgather; }
  size_t header(size_t d) const { return (signed_ ? 4 : 8) * ceil_div(d, chunk_); }
  size_t wire_bytes(size_t d, const TensorState&) const override { return d + header(d); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    out.resize(d + header(d));
    auto* h = reinterpret_cast<float*>(out.data());
    uint8_t* q = out.data() + header(d);
    if (signed_)
      kernels::get().quant_i8_chunks(in.data(), d, chunk_, h, reinterpret_cast<int8_t*>(q));
    else
      kernels::get().quant_u8_chunks(in.data(), d, chunk_, h, q);
    ++st.step;
  }
  void decode(std::span<const uint8_t> p, std::span<float> out, bool add) const {
    size_t d = out.size();
    check_payload(name(), p.size(), d + header(d));
    // int8's scales are magnitudes, and the second of each of uint8's (min, scale) pairs.
    detail::check_scales(name(), p.data(), header(d) / 4, signed_ ? 1 : 2, signed_ ? 0 : 1);
    // Copied out: a payload inside a gathered buffer need not be 4-byte aligned (read in place, it was misaligned
    // float loads).
    thread_local std::vector<float> hdr;
    hdr.resize(header(d) / 4);
    std::memcpy(hdr.data(), p.data(), header(d));
    const float* h = hdr.data();
    // Scales no encoder writes, whose codes decode past the floats (a hostile int8 scale of 1e38 gave inf), checked
    // in float as the decoders compute: int8's 127 x scale, uint8's min + 255 x scale (above a scale of 1.3e36,
    // kernels.inc's wide_u8_scale, the uint8 decoder clamps in double). The encoders take a scale that rounded up
    // past this down to one that passes (kernels.inc's fit_i8_scale, fit_u8_scale): every finite input round-trips.
    for (size_t c = 0; c < ceil_div(d, chunk_); ++c) {
      const float lo = signed_ ? 0.0f : h[2 * c], sc = signed_ ? h[c] : h[2 * c + 1];
      if (signed_ ? !std::isfinite(127.0f * sc) : !(sc > 1.3e36f || std::isfinite(lo + 255.0f * sc)))
        throw InvalidArgument(
            signed_ ? fmt::format("int8: chunk {}'s scale {} decodes past the floats; allowed: at most {}", c, sc,
                                  3.40282347e38 / 127)
                    : fmt::format("uint8: chunk {}'s range (min {}, scale {}) decodes past the floats; allowed: min "
                                  "+ 255 x scale within +-3.4e38",
                                  c, lo, sc));
    }
    const uint8_t* q = p.data() + header(d);
    if (signed_)
      if (const void* at = std::memchr(q, 0x80, d))
        throw InvalidArgument(fmt::format("int8: element {} of the payload is -128; allowed: -127..127",
                                          static_cast<const uint8_t*>(at) - q));
    if (signed_)
      kernels::get().dequant_i8_chunks(reinterpret_cast<const int8_t*>(q), d, chunk_, h, out.data(), add);
    else
      kernels::get().dequant_u8_chunks(q, d, chunk_, h, out.data(), add);
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    decode(p, out, false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    decode(p, acc, true);
  }

 private:
  bool signed_;
  size_t chunk_;
};

constexpr size_t kBlock = 1024;  // codes are staged per block of this many elements (a multiple of 8)

// Elias omega codes (Elias 1975), most significant bit first: the code of v >= 1 is the groups v, bit_width(v) - 1,
// ... down to a group of 2 bits, written innermost first, then a 0 bit (1 is the 0 bit alone).
struct OmegaCode {
  uint32_t bits = 0;  // the code, right-aligned
  uint8_t len = 0;
};
OmegaCode omega_code(uint64_t v) {  // v < 2^21 (the code fits 32 bits; it is called below 256)
  OmegaCode c{0, 1};
  int shift = 1;  // where the next group goes: above the trailing 0 and the groups inside it
  while (v > 1) {
    const int len = std::bit_width(v);
    c.bits |= static_cast<uint32_t>(v << shift);
    shift += len;
    v = static_cast<uint64_t>(len - 1);
  }
  c.len = static_cast<uint8_t>(shift);
  return c;
}
constexpr int kOmegaPeek = 12;  // a table decodes every code of at most this many bits (the values below 64)
// The widest group of an omega code a decoder reads: no encoder writes one wider (positions up to 2^32 take 33 bits,
// levels 15).
constexpr int kMaxEliasBits = 40;
struct OmegaTables {
  OmegaCode encode[256];                // the codes of 0..255 (0 unused)
  uint8_t value[1 << kOmegaPeek] = {};  // the value a 12-bit window starts with, 0: a code longer than the window
  uint8_t len[1 << kOmegaPeek] = {};
  OmegaTables() {
    for (uint32_t v = 1; v < 256; ++v) {
      encode[v] = omega_code(v);
      const OmegaCode c = encode[v];
      if (c.len > kOmegaPeek) continue;
      const uint32_t first = c.bits << (kOmegaPeek - c.len), n = 1u << (kOmegaPeek - c.len);
      for (uint32_t w = first; w < first + n; ++w) value[w] = static_cast<uint8_t>(v), len[w] = c.len;
    }
  }
};
const OmegaTables& omega_tables() {
  static const OmegaTables t;
  return t;
}

// Bits written most significant first into a byte vector, 32 at a time; flush() pads the last byte with zero bits
// and cuts the vector to the bytes written.
class BitWriter {
 public:
  explicit BitWriter(Bytes& out) : out_(out), size_(out.size()) {}
  void put(uint64_t v, int len) {  // the low len (<= 64) bits of v
    if (len > 32) {
      put(v >> 32, len - 32);
      len = 32;
    }
    acc_ = (acc_ << len) | (v & ((uint64_t{1} << len) - 1));  // (n_ < 32 before: at most 63 bits)
    n_ += len;
    if (n_ >= 32) {
      n_ -= 32;
      const uint32_t word = __builtin_bswap32(static_cast<uint32_t>(acc_ >> n_));
      if (size_ + 4 > out_.size()) out_.resize(std::max<size_t>(2 * out_.size(), size_ + 64));
      std::memcpy(out_.data() + size_, &word, 4);
      size_ += 4;
      acc_ &= (uint64_t{1} << n_) - 1;
    }
  }
  void omega(uint64_t v) {
    if (v < 256) {
      const OmegaCode c = omega_tables().encode[v];
      return put(c.bits, c.len);
    }
    uint64_t groups[8];
    int lens[8], k = 0;
    while (v > 1) {
      const int len = std::bit_width(v);
      groups[k] = v;
      lens[k++] = len;
      v = static_cast<uint64_t>(len - 1);
    }
    while (k > 0) --k, put(groups[k], lens[k]);
    put(0, 1);
  }
  // A nonzero element: its gap's code, its sign bit and its level's code, in one put where both codes are short.
  void element(uint64_t gap, bool negative, uint32_t level) {
    if (gap < 256 && level < 256) {
      const OmegaCode g = omega_tables().encode[gap], l = omega_tables().encode[level];
      return put((uint64_t{g.bits} << (l.len + 1)) | (uint64_t{negative} << l.len) | l.bits, g.len + 1 + l.len);
    }
    omega(gap);
    put(negative, 1);
    omega(level);
  }
  void flush() {
    out_.resize(size_ + (n_ + 7) / 8);
    for (int left = n_; left > 0; left -= 8)
      out_[size_++] = static_cast<uint8_t>(left >= 8 ? acc_ >> (left - 8) : acc_ << (8 - left));
    acc_ = 0;
    n_ = 0;
  }

 private:
  Bytes& out_;
  size_t size_;
  uint64_t acc_ = 0;
  int n_ = 0;
};

// The reader of BitWriter's bits; get() and omega() return false where the bits end first.
class BitReader {
 public:
  BitReader(const uint8_t* p, size_t bytes) : p_(p), bits_(8 * bytes), bytes_(bytes) {}
  size_t position() const { return pos_; }
  // The next 57 bits or more at the top of a word (zeros past the end).
  uint64_t window() const {
    const size_t at = pos_ / 8;
    uint64_t w = 0;
    if (at + 8 <= bytes_) {
      std::memcpy(&w, p_ + at, 8);
      w = __builtin_bswap64(w);
    } else {
      for (size_t i = 0; i < 8; ++i) w = (w << 8) | (at + i < bytes_ ? p_[at + i] : 0u);
    }
    return w << (pos_ % 8);
  }
  bool get(int len, uint64_t& v) {  // len <= 56
    if (pos_ + static_cast<size_t>(len) > bits_) return false;
    v = len == 0 ? 0 : window() >> (64 - len);
    pos_ += static_cast<size_t>(len);
    return true;
  }
  // A nonzero element whose gap and level codes the table decodes, read from one window; false (nothing read) for
  // any other.
  bool short_element(uint64_t& gap, uint64_t& sign, uint64_t& level) {
    const OmegaTables& t = omega_tables();
    const uint64_t w = window();
    const uint64_t g = w >> (64 - kOmegaPeek);
    const int gl = t.len[g];
    if (gl == 0) return false;
    const uint64_t rest = w << (gl + 1);
    const uint64_t l = rest >> (64 - kOmegaPeek);
    const int ll = t.len[l];
    if (ll == 0 || pos_ + static_cast<size_t>(gl + 1 + ll) > bits_) return false;
    gap = t.value[g];
    sign = (w << gl) >> 63;
    level = t.value[l];
    pos_ += static_cast<size_t>(gl + 1 + ll);
    return true;
  }
  // An omega code; `too_long` is set (and false returned) for a group wider than max_bits.
  bool omega(uint64_t& v, int max_bits, bool& too_long) {
    too_long = false;
    const OmegaTables& t = omega_tables();
    const uint64_t peek = window() >> (64 - kOmegaPeek);
    if (const int len = t.len[peek]; len > 0) {
      if (pos_ + static_cast<size_t>(len) > bits_) return false;
      pos_ += static_cast<size_t>(len);
      v = t.value[peek];
      return true;
    }
    uint64_t n = 1, b = 0;
    for (;;) {
      if (!get(1, b)) return false;
      if (b == 0) {
        v = n;
        return true;
      }
      if (n + 1 > static_cast<uint64_t>(max_bits)) {
        too_long = true;
        return false;
      }
      uint64_t rest = 0;
      if (!get(static_cast<int>(n), rest)) return false;
      n = (uint64_t{1} << n) | rest;
    }
  }

 private:
  const uint8_t* p_;
  size_t bits_, bytes_, pos_ = 0;
};

class Qsgd : public Compressor {
 public:
  Qsgd(int levels, size_t bucket, bool elias) : s_(levels), bucket_(bucket), elias_(elias) {
    int lb = 0;
    while ((1 << lb) < s_ + 1) ++lb;
    bits_ = 1 + lb;
  }
  std::string name() const override { return "qsgd"; }
  Collective collective() const override { return Collective::allgather; }
  bool fixed_size() const override { return !elias_; }
  size_t bucket(size_t d) const { return bucket_ == 0 ? std::max<size_t>(d, 1) : bucket_; }
  size_t buckets(size_t d) const { return d == 0 ? 0 : ceil_div(d, bucket(d)); }
  size_t wire_bytes(size_t d, const TensorState&) const override {
    if (elias_) throw InvalidArgument("qsgd: with coding=elias the payload size depends on the data; use its length");
    return 4 * buckets(d) + ceil_div(d * bits_, 8);
  }
  int bits() const { return bits_; }
  // Whether the top level decodes within the floats: decode computes unit = norm / s, then unit x level (level <= s).
  bool decodes_finite(float norm) const {
    return std::isfinite(norm / static_cast<float>(s_) * static_cast<float>(s_));
  }
  // 2-, 4- and 8-bit codes of buckets that start on a byte boundary are computed and packed by one kernel.
  bool byte_aligned(size_t d) const {
    return (bits_ == 2 || bits_ == 4 || bits_ == 8) && (buckets(d) <= 1 || bucket(d) * bits_ % 8 == 0);
  }
  // A bucket's norm as sent, the scale s / norm its codes are computed with and the elements they are computed from.
  struct BucketScale {
    float norm, scale;
    const float* src;
  };
  BucketScale bucket_scale(const float* x, size_t n) const {
    // The wire carries the norm as an f32: a norm above FLT_MAX (values near it) is sent as FLT_MAX, whose codes
    // then saturate at s (inf made the scale 0 and every value decode as 0 * inf = NaN).
    float norm = static_cast<float>(std::min(std::sqrt(sum_squares(x, n)), 3.4028234663852886e38));
    // The decoder's unit = norm / s times a level up to s, in f32, rounded past FLT_MAX for a norm of FLT_MAX
    // (s = 127: a saturated element decoded as inf); decode refuses such a norm, so the encoder sends the largest
    // norm below it whose top level decodes finite (one ulp less; the codes follow from the norm sent).
    for (int i = 0; i < 8 && std::isfinite(norm) && !decodes_finite(norm); ++i) norm = std::nextafter(norm, 0.0f);
    float scale = norm > 0 ? static_cast<float>(s_) / norm : 0.0f;
    if (!std::isfinite(scale)) {
      // s / norm overflows for norms below ~s / FLT_MAX: the codes come from the bucket scaled by 2^64 (exact) and
      // the scale that then fits (0 * inf made the zeros NaN, and every element decoded as +-norm).
      x = scaled_up(x, n);
      scale = static_cast<float>(static_cast<double>(s_) / std::ldexp(static_cast<double>(norm), 64));
    }
    return {norm, scale, x};
  }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    detail::check_u32_elements(name(), d, "the random stream's element numbers");
    if (elias_) return compress_elias(in, st, out);
    bool packed = byte_aligned(d);
    if (packed)
      out.resize(wire_bytes(d, st));  // every byte is written
    else
      out.assign(wire_bytes(d, st), 0);
    size_t bk = bucket(d), nb = buckets(d);
    uint64_t key = detail::call_key(st.seed, st.stream, st.step, 0x5153);
    uint32_t k_lo = static_cast<uint32_t>(key), k_hi = static_cast<uint32_t>(key >> 32);
    uint8_t* codes_out = out.data() + 4 * nb;
    uint16_t codes[kBlock];
    // Blocks never straddle buckets when bucket is a multiple of 8; pack per block of whole bytes.
    for (size_t b = 0; b < nb; ++b) {
      size_t off = b * bk, n = std::min(bk, d - off);
      const auto [norm, scale, src] = bucket_scale(in.data() + off, n);
      put_f32(out.data() + 4 * b, norm);
      if (packed) {
        kernels::get().qsgd_pack(src, n, scale, static_cast<uint32_t>(s_), bits_, static_cast<uint32_t>(off), k_lo,
                                 k_hi, codes_out + off * bits_ / 8);
        continue;
      }
      for (size_t o = 0; o < n; o += kBlock) {
        size_t m = std::min(kBlock, n - o);
        qsgd_codes(src + o, m, scale, static_cast<uint32_t>(s_), static_cast<uint32_t>(off + o), k_lo, k_hi, codes);
        write_codes(codes, m, off + o, codes_out);
      }
    }
    ++st.step;
  }
  // The checks of the norms both codings send first.
  void check_norms(std::span<const uint8_t> p, size_t nb) const {
    detail::check_scales("qsgd", p.data(), nb, 1);
    for (size_t b = 0; b < nb; ++b)
      if (const float norm = get_f32(p.data() + 4 * b); !decodes_finite(norm))
        throw InvalidArgument(
            fmt::format("qsgd: bucket {}'s norm {} decodes past the floats at level {}; allowed: a "
                        "norm whose norm / {} x {} stays within 3.4e38 in f32",
                        b, norm, s_, s_, s_));
  }
  void decode(std::span<const uint8_t> p, std::span<float> out, bool add) const {
    if (elias_) return decode_elias(p, out, add);
    size_t d = out.size();
    TensorState none;
    check_payload("qsgd", p.size(), wire_bytes(d, none));
    size_t bk = bucket(d), nb = buckets(d);
    check_norms(p, nb);
    const uint8_t* codes_in = p.data() + 4 * nb;
    if (size_t e = detail::first_code_above(codes_in, d, bits_, 2 * static_cast<uint32_t>(s_) + 1); e < d)
      throw InvalidArgument(
          fmt::format("qsgd: element {} of the payload has a level above {}; allowed: levels 0 to {}", e, s_, s_));
    bool packed = byte_aligned(d);
    uint16_t codes[kBlock];
    for (size_t b = 0; b < nb; ++b) {
      size_t off = b * bk, n = std::min(bk, d - off);
      const float norm = get_f32(p.data() + 4 * b);
      const float unit = norm / static_cast<float>(s_);
      // A unit below the normal floats (a norm under ~1e-36) keeps too few bits: every element of the bucket came out
      // scaled by its rounding (1.92x at 1e-43), a bias; those buckets decode each element in double.
      const bool tiny = unit != 0 && std::abs(unit) < std::numeric_limits<float>::min();
      if (packed && !tiny) {
        kernels::get().qsgd_unpack(codes_in + off * bits_ / 8, n, bits_, unit, out.data() + off, add);
        continue;
      }
      for (size_t o = 0; o < n; o += kBlock) {
        size_t m = std::min(kBlock, n - o);
        read_codes(codes_in, off + o, m, codes);
        float* y = out.data() + off + o;
        for (size_t i = 0; i < m; ++i) {
          float v = tiny ? static_cast<float>(static_cast<double>(norm) * (codes[i] >> 1) / s_)
                         : unit * static_cast<float>(codes[i] >> 1);
          v = (codes[i] & 1) ? -v : v;
          y[i] = add ? y[i] + v : v;
        }
      }
    }
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    decode(p, out, false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState&, std::span<float> acc) const override {
    decode(p, acc, true);
  }

 private:
  void compress_elias(std::span<const float> in, TensorState& st, Bytes& out) const {
    const size_t d = in.size(), bk = bucket(d), nb = buckets(d);
    if (d == 0) {  // (nothing to count: an empty tensor sends nothing, as the fixed coding)
      out.clear();
      ++st.step;
      return;
    }
    const uint64_t key = detail::call_key(st.seed, st.stream, st.step, 0x5153);
    const uint32_t k_lo = static_cast<uint32_t>(key), k_hi = static_cast<uint32_t>(key >> 32);
    // The levels are drawn as the fixed coding draws them (the same random stream), a block at a time, twice: their
    // count leads the codes (the second pass draws the same levels again; the codes kernel runs at 10+ GB/s, the
    // coder at under 1).
    uint16_t codes[kBlock];
    auto levels = [&](auto&& each_block) {
      for (size_t b = 0; b < nb; ++b) {
        const size_t off = b * bk, n = std::min(bk, d - off);
        const auto [norm, scale, src] = bucket_scale(in.data() + off, n);
        each_block(b, norm, [&, scale, src](auto&& each_code) {
          for (size_t o = 0; o < n; o += kBlock) {
            const size_t m = std::min(kBlock, n - o);
            qsgd_codes(src + o, m, scale, static_cast<uint32_t>(s_), static_cast<uint32_t>(off + o), k_lo, k_hi, codes);
            for (size_t i = 0; i < m; ++i)
              if (codes[i] > 1) each_code(off + o + i, codes[i]);
          }
        });
      }
    };
    out.assign(4 * nb, 0);
    size_t nonzero = 0;
    levels([&](size_t b, float norm, auto&& codes_of) {
      put_f32(out.data() + 4 * b, norm);
      codes_of([&](size_t, uint16_t) { ++nonzero; });
    });
    BitWriter w(out);
    w.omega(nonzero + 1);
    size_t last = 0;  // 1-based position of the last nonzero written
    levels([&](size_t, float, auto&& codes_of) {
      codes_of([&](size_t i, uint16_t code) {
        w.element(i + 1 - last, code & 1, code >> 1u);
        last = i + 1;
      });
    });
    w.flush();
    ++st.step;
  }
  void decode_elias(std::span<const uint8_t> p, std::span<float> out, bool add) const {
    const size_t d = out.size(), nb = buckets(d);
    if (p.size() < 4 * nb + (d > 0 ? 1 : 0))
      throw InvalidArgument(fmt::format(
          "qsgd: a payload of {} bytes for {} elements is shorter than its {} bucket norms and codes ({} bytes at "
          "least; compressed with another configuration or tensor size?)",
          p.size(), d, nb, 4 * nb + (d > 0 ? 1 : 0)));
    if (d == 0) return check_payload("qsgd", p.size(), 0);
    check_norms(p, nb);
    // Every code is checked before anything is written (as the fixed coding's decoder checks every level first): a
    // refused payload leaves the output or the sum it adds to as it was. Where at most an eighth of the elements
    // are nonzero the codes are read twice, checked then decoded; where more are, reading them costs more than three
    // passes over the tensor, and they are decoded once into a buffer of the tensor's size, copied or added to the
    // output once the last is checked.
    uint64_t count = 0;
    bool too_long = false;
    BitReader r(p.data() + 4 * nb, p.size() - 4 * nb);
    if (r.omega(count, kMaxEliasBits, too_long) && count - 1 > d / 8 && count - 1 <= d) {
      std::unique_ptr<float[]> buffer(new float[d]);
      const std::span<float> decoded(buffer.get(), d);
      if (!add) {
        elias_codes(p, decoded, false, true);
        std::memcpy(out.data(), buffer.get(), 4 * d);
        return;
      }
      // The elements no code names are -0, which adds nothing (x + -0 is x, -0 too), as the two-pass path adds
      // nothing to them.
      std::fill(decoded.begin(), decoded.end(), -0.0f);
      elias_codes(p, decoded, true, true);
      for (size_t i = 0; i < d; ++i) out[i] += buffer[i];
      return;
    }
    elias_codes(p, out, add, false);
    elias_codes(p, out, add, true);
  }
  // One pass over a payload's Elias codes (the norms checked): refuses what no encoder writes, and with `write`
  // decodes into out (adding where `add`).
  void elias_codes(std::span<const uint8_t> p, std::span<float> out, bool add, bool write) const {
    const size_t d = out.size(), bk = bucket(d), nb = buckets(d);
    const uint8_t* codes = p.data() + 4 * nb;
    const size_t bytes = p.size() - 4 * nb;
    BitReader r(codes, bytes);
    auto ended = [&](const std::string& where, bool too_long) {
      return InvalidArgument(
          too_long ? fmt::format("qsgd: {} is an Elias code wider than {} bits; allowed: counts and positions up to "
                                 "the tensor's {} elements and levels up to {}",
                                 where, kMaxEliasBits, d, s_)
                   : fmt::format("qsgd: the payload's {} bytes of Elias codes end inside {}; allowed: a count of "
                                 "nonzero elements then a gap, a sign bit and a level for each",
                                 bytes, where));
    };
    uint64_t count = 0;
    bool too_long = false;
    if (!r.omega(count, kMaxEliasBits, too_long)) throw ended("the count of nonzero elements", too_long);
    if (count - 1 > d)
      throw InvalidArgument(
          fmt::format("qsgd: the payload announces {} nonzero elements of {}; allowed: at most the tensor's elements",
                      count - 1, d));
    if (write && !add) std::fill(out.begin(), out.end(), 0.0f);
    // The bucket of the element being decoded: [end - bk, end), its norm and unit = norm / s as the fixed coding's
    // decoder computes them (in double where the unit is below the normal floats).
    size_t end = 0;
    float norm = 0, unit = 0;
    bool tiny = false;
    uint64_t last = 0;
    for (uint64_t k = 0; k + 1 < count; ++k) {
      uint64_t gap = 0, sign = 0, level = 0;
      auto what = [k](const char* part) { return fmt::format("nonzero element {}'s {}", k, part); };
      const bool short_codes = r.short_element(gap, sign, level);
      if (!short_codes && !r.omega(gap, kMaxEliasBits, too_long)) throw ended(what("gap"), too_long);
      if (gap > d - last)
        throw InvalidArgument(
            fmt::format("qsgd: nonzero element {} of the payload lies at position {}, past the "
                        "tensor's {} elements",
                        k, last + gap - 1, d));
      last += gap;
      if (!short_codes && !r.get(1, sign)) throw ended(what("sign"), false);
      if (!short_codes && !r.omega(level, kMaxEliasBits, too_long)) throw ended(what("level"), too_long);
      const size_t e = static_cast<size_t>(last - 1);
      if (level > static_cast<uint64_t>(s_))
        throw InvalidArgument(
            fmt::format("qsgd: element {} of the payload has a level above {}; allowed: levels 0 to {}", e, s_, s_));
      if (!write) continue;
      if (e >= end) {
        const size_t b = e / bk;
        end = (b + 1) * bk;
        norm = get_f32(p.data() + 4 * b);
        unit = norm / static_cast<float>(s_);
        tiny = unit != 0 && std::abs(unit) < std::numeric_limits<float>::min();
      }
      float v = tiny ? static_cast<float>(static_cast<double>(norm) * static_cast<double>(level) / s_)
                     : unit * static_cast<float>(level);
      v = sign != 0 ? -v : v;
      out[e] = add ? out[e] + v : v;
    }
    // The encoder pads the last byte with zero bits and writes nothing after it.
    uint64_t pad = 0;
    const int pad_bits = static_cast<int>((8 - r.position() % 8) % 8);
    const size_t used = ceil_div(r.position(), size_t{8});
    if (used != bytes || (r.get(pad_bits, pad) && pad != 0))
      throw InvalidArgument(fmt::format(
          "qsgd: the payload holds {} bytes of Elias codes, of which its {} nonzero elements take {} (padded with "
          "zero bits); allowed: exactly those bytes",
          bytes, count - 1, used));
  }
  // Codes of elements [first, first+m) at bit offset first*bits_; byte-aligned fast path when possible.
  void write_codes(const uint16_t* codes, size_t m, size_t first, uint8_t* out) const {
    size_t bit = first * bits_;
    if (bit % 8 == 0) {
      detail::pack_codes(codes, m, bits_, out + bit / 8);
      return;
    }
    for (size_t i = 0; i < m; ++i, bit += bits_)
      for (int t = 0; t < bits_; ++t)
        if ((codes[i] >> t) & 1) out[(bit + t) / 8] |= static_cast<uint8_t>(1u << ((bit + t) % 8));
  }
  void read_codes(const uint8_t* in, size_t first, size_t m, uint16_t* codes) const {
    size_t bit = first * bits_;
    if (bit % 8 == 0) {
      detail::unpack_codes(in + bit / 8, m, bits_, codes);
      return;
    }
    for (size_t i = 0; i < m; ++i, bit += bits_) {
      uint16_t c = 0;
      for (int t = 0; t < bits_; ++t) c |= static_cast<uint16_t>(((in[(bit + t) / 8] >> ((bit + t) % 8)) & 1) << t);
      codes[i] = c;
    }
  }
  int s_;
  size_t bucket_;
  bool elias_;
  int bits_;
};

class TernGrad : public Compressor {
 public:
  explicit TernGrad(bool clip) : clip_(clip) {}
  std::string name() const override { return "terngrad"; }
  Collective collective() const override { return Collective::allgather; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return 4 + ceil_div(d, 4); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    detail::check_u32_elements(name(), d, "the random stream's element numbers");
    out.resize(wire_bytes(d, st));
    float lo = -INFINITY, hi = INFINITY;
    const float amax = d ? abs_max(in.data(), d) : 0.0f;
    if (clip_ && d > 0) {
      // Two passes in double: E[x^2] - mean^2 in f32 cancelled (x = 1000 + 0.01 N(0,1) clipped at 0.52 instead of
      // 0.025). A constant tensor (or one element) has no spread to clip to: clipping at 0 would send zeros.
      // The deviations in f32 lanes (x - mean is exact near the mean), summed into 16 independent partial sums the
      // compiler vectorizes, then in double: as fast as the other passes (a serial double loop ran 9x slower). The
      // partials go into the double sum every 4,096 elements: run over a whole 64M-element tensor, each f32 partial
      // summed 4M squares and the clip came out 1.8e-3 low.
      double mean = kernels::get().sum(in.data(), d) / static_cast<double>(d);
      if (!std::isfinite(mean)) {  // (values near FLT_MAX summed past it in an f32 lane: summed again in double)
        mean = 0;
        for (size_t k = 0; k < d; ++k) mean += in[k];
        mean /= static_cast<double>(d);
      }
      const float m = static_cast<float>(mean);
      constexpr size_t kBlock = 4096;
      double ss = 0;
      size_t i = 0;
      while (i + 16 <= d) {
        float part[16] = {};
        const size_t e = std::min(d, i + kBlock) / 16 * 16;
        for (; i < e; i += 16)
          for (int k = 0; k < 16; ++k) {
            const float v = in[i + k] - m;
            part[k] += v * v;
          }
        for (float v : part) ss += v;
      }
      for (; i < d; ++i) ss += (in[i] - mean) * (in[i] - mean);
      if (!std::isfinite(ss) || (ss < 1e-30 * static_cast<double>(d) && amax > 0)) {
        // Summed again in double, scaled by the largest deviation: deviations above ~1.8e19 square past FLT_MAX in
        // the f32 lanes (the clip became inf: no clipping at all), and those below ~1e-19 square under FLT_MIN, to
        // zero under ~1e-23 (the clip came out at 0.86 sigma for values of 1e-23, and at 0 for 1e-25, which clipped
        // nothing). Squares under FLT_MIN add at most d * 1.2e-38, so a mean square of 1e-30 or more is kept (off by
        // 1.2e-8 at most). (An all-zero tensor has nothing to sum again.)
        double dmax = 0;
        for (size_t k = 0; k < d; ++k) dmax = std::max(dmax, std::abs(in[k] - mean));
        ss = 0;
        if (dmax > 0 && std::isfinite(dmax))
          for (size_t k = 0; k < d; ++k) {
            const double v = (in[k] - mean) / dmax;
            ss += v * v;
          }
        ss *= dmax * dmax;
      }
      float c = static_cast<float>(2.5 * std::sqrt(ss / static_cast<double>(d)));
      if (c > 0) {
        lo = -c;
        hi = c;
      }
    }
    float s = std::min(amax, hi);
    put_f32(out.data(), s);
    uint64_t key = detail::call_key(st.seed, st.stream, st.step, 0x7465);
    const float* src = in.data();
    float inv = s > 0 ? 1.0f / s : 0.0f;
    if (!std::isfinite(inv)) {
      // 1 / s overflows for a subnormal s below ~1 / FLT_MAX: the input (and its clip bounds) scaled by 2^64, exact,
      // with the inverse that then fits (an infinite inverse kept no element: zeros were sent).
      src = scaled_up(src, d);
      lo = std::ldexp(lo, 64);
      hi = std::ldexp(hi, 64);
      inv = static_cast<float>(1.0 / std::ldexp(static_cast<double>(s), 64));
    }
    tern_codes(src, d, lo, hi, inv, 0, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), out.data() + 4);
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState& st, std::span<float> out) const override {
    check_payload("terngrad", p.size(), wire_bytes(out.size(), st));
    detail::check_scales("terngrad", p.data(), 1, 1);
    check_tern_codes(p.data() + 4, out.size());
    tern_decode(p.data() + 4, out.size(), get_f32(p.data()), out.data(), false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    check_payload("terngrad", p.size(), wire_bytes(acc.size(), st));
    detail::check_scales("terngrad", p.data(), 1, 1);
    check_tern_codes(p.data() + 4, acc.size());
    tern_decode(p.data() + 4, acc.size(), get_f32(p.data()), acc.data(), true);
  }

 private:
  bool clip_;
};

class Natural : public Compressor {
 public:
  std::string name() const override { return "natural"; }
  Collective collective() const override { return Collective::allgather; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return d + ceil_div(d, 8); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    detail::check_u32_elements(name(), d, "the random stream's element numbers");
    out.resize(wire_bytes(d, st));
    uint64_t key = detail::call_key(st.seed, st.stream, st.step, 0x6e61);
    kernels::get().natural_encode(in.data(), d, 0, static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32),
                                  out.data(), out.data() + ceil_div(d, 8));
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState& st, std::span<float> out) const override {
    size_t d = out.size();
    check(p, d, st);
    natural_decode(p.data(), p.data() + ceil_div(d, 8), d, out.data(), false);
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    size_t d = acc.size();
    check(p, d, st);
    natural_decode(p.data(), p.data() + ceil_div(d, 8), d, acc.data(), true);
  }

 private:
  void check(std::span<const uint8_t> p, size_t d, const TensorState& st) const {
    check_payload("natural", p.size(), wire_bytes(d, st));
    // Exponent 255 is inf or NaN, which the encoder never writes (its inputs are finite).
    const uint8_t* exps = p.data() + ceil_div(d, 8);
    if (const void* at = std::memchr(exps, 0xff, d))
      throw InvalidArgument(
          fmt::format("natural: element {} of the payload has exponent 255 (inf or NaN); allowed: "
                      "0..254",
                      static_cast<const uint8_t*>(at) - exps));
  }
};

}  // namespace

CompressorPtr make_none(const ParamReader&) { return std::make_unique<NoneCompressor>(); }
CompressorPtr make_fp16(const ParamReader&) { return std::make_unique<HalfCompressor>(false); }
CompressorPtr make_bf16(const ParamReader&) { return std::make_unique<HalfCompressor>(true); }
CompressorPtr make_int8(const ParamReader& p) {
  return std::make_unique<ByteQuantizer>(true, static_cast<size_t>(p.integer("chunk", 1, 1 << 30)));
}
CompressorPtr make_uint8(const ParamReader& p) {
  return std::make_unique<ByteQuantizer>(false, static_cast<size_t>(p.integer("chunk", 1, 1 << 30)));
}
CompressorPtr make_qsgd(const ParamReader& p) {
  const std::string& coding = p.text("coding");
  if (coding != "fixed" && coding != "elias")
    throw ConfigError(fmt::format(
        "compressor qsgd: parameter coding='{}' must be one of fixed (b bits an element), elias (Elias codes of "
        "the nonzero levels)",
        coding));
  return std::make_unique<Qsgd>(static_cast<int>(p.integer("levels", 1, 32767)),
                                static_cast<size_t>(p.integer("bucket", 0, int64_t(1) << 40)), coding == "elias");
}
CompressorPtr make_terngrad(const ParamReader& p) { return std::make_unique<TernGrad>(p.boolean("clip")); }
CompressorPtr make_natural(const ParamReader&) { return std::make_unique<Natural>(); }

}  // namespace conduit::compress::methods
