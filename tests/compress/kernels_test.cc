// The element-wise kernels (src/compress/kernels.inc) against plain scalar references written from the methods'
// definitions, bit for bit, for the baseline build and the AVX2 builds the CPU runs: the vector bodies, the
// 32-element packing and the scalar tails must agree, and the counter-based random stream (detail::random_block) must
// be the one every rank uses. Sizes cover empty, tails of every length and offsets that are not multiples of 32; the
// random stream's bases cover the aligned path (a multiple of 16) and the shifted window of either half.
#include "compress/kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "compress/detail.h"

using namespace conduit::compress;

namespace {

std::vector<const kernels::Table*> tables() { return kernels::available(); }

std::vector<float> data(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  if (n > 3) v[1] = 0.0f, v[2] = -0.0f;
  return v;
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

const size_t kN[] = {0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 100, 1000, 4099, 9000};
const uint32_t kBases[] = {64, 77, 83};  // aligned; offsets 13 and 3 within a random block
constexpr uint32_t kLo = 0x12345678u, kHi = 0x9abcdef0u;

// The quantizers' random stream, from its definition (detail::random_block: three AES rounds on (B, j, kLo, kHi)):
// element e takes the low (e & 8 == 0) or high 16 bits of lane e & 7 of random block e / 16.
uint32_t draw16(uint32_t e) {
  uint32_t lanes[8];
  detail::random_block(kLo, kHi, e / 16, lanes);
  return (e & 8) ? lanes[e % 8] >> 16 : lanes[e % 8] & 0xffff;
}
// round(v) to nearest even as int32, INT32_MIN for NaN and out of range.
int32_t round_i32(float v) {
  double r = std::nearbyint(static_cast<double>(v));
  return r >= -2147483648.0 && r < 2147483648.0 ? static_cast<int32_t>(r) : INT32_MIN;
}

}  // namespace

#if defined(__x86_64__)
// detail::aes_round (the baseline's AES round) is x86's AESENC, which the AVX2 kernels use.
__attribute__((target("aes"))) void aesenc(uint32_t s[4], const uint32_t rk[4]) {
  __m128i v = _mm_aesenc_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)),
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(rk)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(s), v);
}
TEST(Kernels, AesRoundIsAesenc) {
  if (!__builtin_cpu_supports("aes")) GTEST_SKIP() << "no AES-NI";
  std::mt19937 g(5);
  for (int t = 0; t < 1000; ++t) {
    uint32_t a[4], b[4], rk[4];
    for (auto& v : a) v = g();
    for (auto& v : rk) v = g();
    std::memcpy(b, a, 16);
    detail::aes_round(a, rk);
    aesenc(b, rk);
    ASSERT_EQ(std::memcmp(a, b, 16), 0) << "trial " << t;
  }
}
#endif

// A known answer, on any CPU (the comparison above is skipped without AES-NI, and compares the two with each other):
// the AESENC example of Intel's AES-NI white paper (Gueron, "Intel Advanced Encryption Standard (AES) New
// Instructions Set", 2010): state 7b5b5465 73745665 63746f72 5d53475d, round key 48692853 68617929 5b477565 726f6e5d,
// result a8311c2f 9fdba3c5 8b104b58 ded7e595 (128-bit numbers, most significant word first; word 0 is the least).
TEST(Kernels, AesRoundGivesAesencsKnownAnswer) {
  uint32_t w[4] = {0x5d53475du, 0x63746f72u, 0x73745665u, 0x7b5b5465u};
  const uint32_t rk[4] = {0x726f6e5du, 0x5b477565u, 0x68617929u, 0x48692853u};
  detail::aes_round(w, rk);
  EXPECT_EQ(w[0], 0xded7e595u);
  EXPECT_EQ(w[1], 0x8b104b58u);
  EXPECT_EQ(w[2], 0x9fdba3c5u);
  EXPECT_EQ(w[3], 0xa8311c2fu);
}

TEST(Kernels, QsgdPackEqualsScalarCodesForEveryWidth) {
  for (auto* k : tables())
    for (uint32_t kBase : kBases)
      for (size_t n : kN)
        for (float tiny : {1.0f, 1e-36f}) {  // 1e-36: scale * 2^16 overflows (the kernels' other path)
          auto x = data(n, n + 1);
          for (auto& v : x) v *= tiny;
          for (int bits : {2, 4, 8}) {
            uint32_t smax = (1u << (bits - 1)) - 1;
            float scale = static_cast<float>(smax) / (1.5f * tiny);
            std::vector<uint16_t> want(n);
            for (size_t i = 0; i < n; ++i) {
              // level = floor((R + u) / 2^16), R = round(|x| scale 2^16), at most smax.
              float r = std::fabs(x[i]) * scale;
              uint32_t R = static_cast<uint32_t>(round_i32(r * 65536.0f));
              uint32_t level = std::min<uint32_t>((R + draw16(kBase + static_cast<uint32_t>(i))) >> 16, smax);
              want[i] = static_cast<uint16_t>(level << 1 | bits_of(x[i]) >> 31);
            }
            std::vector<uint16_t> codes(n);
            k->qsgd_codes(x.data(), n, scale, smax, kBase, kLo, kHi, codes.data());
            EXPECT_EQ(codes, want) << k->name << " n=" << n << " base=" << kBase;
            std::vector<uint8_t> packed((n * bits + 7) / 8 + 1, 0xee), want_packed(packed.size(), 0xee);
            detail::pack_codes(want.data(), n, bits, want_packed.data());
            k->qsgd_pack(x.data(), n, scale, smax, bits, kBase, kLo, kHi, packed.data());
            EXPECT_EQ(packed, want_packed) << k->name << " n=" << n << " bits=" << bits << " base=" << kBase;
            for (bool add : {false, true}) {
              std::vector<float> y(n, 0.25f), ref(n, 0.25f);
              k->qsgd_unpack(packed.data(), n, bits, 0.375f, y.data(), add);
              for (size_t i = 0; i < n; ++i) {
                float v = 0.375f * static_cast<float>(want[i] >> 1);
                v = (want[i] & 1) ? -v : v;
                ref[i] = add ? ref[i] + v : v;
              }
              EXPECT_EQ(y, ref) << k->name << " n=" << n << " bits=" << bits << " add=" << add;
            }
          }
        }
}

// The word-at-a-time search for codes above a bound finds the same first element as reading code by code, for
// every width and bound, with the offending code in any field of a word or in the tail.
TEST(Kernels, FirstCodeAboveEqualsScalar) {
  std::mt19937 gen(11);
  for (int bits : {2, 3, 4, 5, 8}) {
    for (uint32_t max_code = 0; max_code < (1u << bits); ++max_code) {
      for (int trial = 0; trial < 20; ++trial) {
        const size_t n = 1 + gen() % 200;
        std::vector<uint16_t> codes(n);
        for (auto& c : codes) c = static_cast<uint16_t>(gen() % (max_code + 1));  // all allowed
        if (trial % 4 != 0) codes[gen() % n] = static_cast<uint16_t>(gen() % (1u << bits));
        std::vector<uint8_t> packed((n * bits + 7) / 8 + 1, 0);
        detail::pack_codes(codes.data(), n, bits, packed.data());
        if (const size_t used = n * bits % 8) packed[n * bits / 8] |= static_cast<uint8_t>(0xff << used);
        packed.back() = 0xff;  // the unused bits and a byte past the codes are never read as codes
        size_t want = n;
        for (size_t i = 0; i < n && want == n; ++i)
          if (codes[i] > max_code) want = i;
        EXPECT_EQ(detail::first_code_above(packed.data(), n, bits, max_code), want)
            << "bits " << bits << " max " << max_code << " n " << n;
      }
    }
  }
}

// NaN and infinities: QSGD gives level smax for them (R = INT32_MIN), TernGrad never keeps a NaN.
TEST(Kernels, NonFiniteInputs) {
  const size_t n = 40;
  std::vector<float> x(n, 0.5f);
  x[3] = NAN, x[20] = -NAN, x[21] = INFINITY;
  for (auto* k : tables()) {
    std::vector<uint16_t> codes(n);
    k->qsgd_codes(x.data(), n, 2.0f, 7, 0, kLo, kHi, codes.data());
    EXPECT_EQ(codes[3] >> 1, 7u);
    EXPECT_EQ(codes[20], 7u << 1 | 1u);
    EXPECT_EQ(codes[21] >> 1, 7u);
    std::vector<uint8_t> t(n / 4);
    k->tern_codes(x.data(), n, -INFINITY, INFINITY, 0.5f, 0, kLo, kHi, t.data());
    EXPECT_EQ((t[3 / 4] >> (2 * (3 % 4))) & 3, 0);
    EXPECT_EQ((t[20 / 4] >> (2 * (20 % 4))) & 3, 0);
  }
}

TEST(Kernels, TernGradCodesAndDecodeEqualScalar) {
  for (auto* k : tables())
    for (uint32_t kBase : kBases)
      for (size_t n : kN)
        for (float c : {INFINITY, 1.0f})
          for (float s : {2.5f, 2.5e-36f}) {  // 2.5e-36: inv * 2^16 overflows (the kernels' other path)
            auto x = data(n, n + 2);
            for (auto& v : x) v *= s / 2.5f;
            float cc = c * s / 2.5f, inv = 1 / s;
            std::vector<uint8_t> want((n + 3) / 4 + 1, 0xee), got(want.size(), 0xee);
            std::fill(want.begin(), want.begin() + static_cast<long>((n + 3) / 4), 0);
            for (size_t i = 0; i < n; ++i) {
              // Kept if u < R, R = round(|v| inv 2^16).
              float v = std::min(std::max(x[i], -cc), cc);
              int32_t R = round_i32(std::fabs(v) * inv * 65536.0f);
              uint32_t code =
                  static_cast<int32_t>(draw16(kBase + static_cast<uint32_t>(i))) < R ? (v < 0 ? 2u : 1u) : 0u;
              want[i / 4] |= static_cast<uint8_t>(code << (2 * (i % 4)));
            }
            k->tern_codes(x.data(), n, -cc, cc, inv, kBase, kLo, kHi, got.data());
            EXPECT_EQ(got, want) << k->name << " n=" << n << " base=" << kBase << " s=" << s;
            for (bool add : {false, true}) {
              std::vector<float> y(n, 0.5f), ref(n, 0.5f);
              k->tern_decode(got.data(), n, s, y.data(), add);
              for (size_t i = 0; i < n; ++i) {
                uint32_t code = (got[i / 4] >> (2 * (i % 4))) & 3;
                float v = code == 1 ? s : code == 2 ? -s : 0.0f;
                ref[i] = add ? ref[i] + v : v;
              }
              EXPECT_EQ(y, ref) << k->name << " n=" << n;
            }
          }
}

TEST(Kernels, NaturalEncodeDecodeEqualScalar) {
  for (auto* k : tables())
    for (uint32_t kBase : kBases)
      for (size_t n : kN) {
        auto x = data(n, n + 3);
        if (n > 5) x[3] = INFINITY, x[4] = 3e38f, x[5] = 1e-40f;  // saturating and subnormal exponents
        std::vector<uint8_t> signs((n + 7) / 8, 0xee), exps(n, 0xee), want_signs((n + 7) / 8, 0), want_exps(n);
        for (size_t i = 0; i < n; ++i) {
          // Rounded up if u < round(mantissa / 2^7) (half up).
          uint32_t b = bits_of(x[i]), e = (b >> 23) & 0xff;
          uint32_t u = draw16(kBase + static_cast<uint32_t>(i));
          want_exps[i] = static_cast<uint8_t>(e + (e < 254 && u < (((b & 0x7fffff) + 64) >> 7)));
          want_signs[i / 8] |= static_cast<uint8_t>((b >> 31) << (i % 8));
        }
        k->natural_encode(x.data(), n, kBase, kLo, kHi, signs.data(), exps.data());
        EXPECT_EQ(signs, want_signs) << k->name << " n=" << n;
        EXPECT_EQ(exps, want_exps) << k->name << " n=" << n;
        for (bool add : {false, true}) {
          std::vector<float> y(n, 1.0f), ref(n, 1.0f);
          k->natural_decode(signs.data(), exps.data(), n, y.data(), add);
          for (size_t i = 0; i < n; ++i) {
            float v = from_bits(((signs[i / 8] >> (i % 8)) & 1u) << 31 | uint32_t(exps[i]) << 23);
            ref[i] = add ? ref[i] + v : v;
          }
          for (size_t i = 0; i < n; ++i)
            EXPECT_EQ(bits_of(y[i]), bits_of(ref[i])) << k->name << " n=" << n << " i=" << i;
        }
      }
}

TEST(Kernels, ByteQuantizersEqualScalar) {
  for (auto* k : tables())
    for (size_t n : kN) {
      auto x = data(n, n + 4);
      std::vector<int8_t> q(n), want(n);
      std::vector<uint8_t> uq(n), uwant(n);
      const float inv = 40.0f, lo = -2.0f, uinv = 60.0f;  // some values clamp
      for (size_t i = 0; i < n; ++i) {
        float v = std::min(std::max(x[i] * inv, -127.0f), 127.0f);
        want[i] = static_cast<int8_t>(static_cast<int32_t>(v + std::copysign(0.5f, v)));
        float w = std::min(std::max((x[i] - lo) * uinv, 0.0f), 255.0f);
        uwant[i] = static_cast<uint8_t>(static_cast<int32_t>(w + 0.5f));
      }
      k->quant_i8(x.data(), n, inv, q.data());
      k->quant_u8(x.data(), n, lo, uinv, uq.data());
      EXPECT_EQ(q, want) << k->name << " n=" << n;
      EXPECT_EQ(uq, uwant) << k->name << " n=" << n;
    }
}

// The chunked quantizers (scale per chunk, then codes; the vector body skips the clamps when the scale is a normal
// float) against a per-chunk scalar reference with the clamps, including chunks whose scale is subnormal or infinite.
TEST(Kernels, ChunkedByteQuantizersEqualScalar) {
  for (auto* k : tables())
    for (size_t chunk : {1, 7, 32, 256, 300})
      for (size_t n : {size_t{0}, size_t{33}, size_t{1000}, size_t{4099}, size_t{9000}}) {
        auto x = data(n, n + chunk);
        if (n >= 1000) {
          for (size_t i = 0; i < 300; ++i) x[i] *= 3e-37f;  // subnormal scales, finite 1 / scale
          x[400] = INFINITY;
          x[700] = -3e38f, x[701] = 3e38f;  // max - min overflows
          // A double scale that rounds to FLT_MAX / 255 (the kernel tested overflow one way in the header, another in
          // the quantizer, and sent the top value to 0), and a range ending at FLT_MAX (decoded inf).
          x[900] = -(std::ldexp(1.0f, 127) - std::ldexp(1.0f, 103)), x[901] = std::ldexp(1.0f, 127);
          x[960] = -0x1.821c82p+127f, x[961] = 0x1.fffffep+127f;
        }
        if (n >= 4099)  // chunks of only 8.5e37 and FLT_MAX: min + 255 x scale rounded up to inf in f32
          for (size_t i = 2000; i < 2700; ++i) x[i] = i % 3 ? 8.5e37f : 0x1.fffffep+127f;
        size_t nc = (n + chunk - 1) / chunk;
        std::vector<float> scales(nc), want_scales(nc), header(2 * nc), want_header(2 * nc);
        std::vector<int8_t> q(n), want(n);
        std::vector<uint8_t> uq(n), uwant(n);
        for (size_t c = 0; c < nc; ++c) {
          size_t b = c * chunk, e = std::min(n, b + chunk);
          float amax = 0, lo = x[b], hi = x[b];
          for (size_t i = b; i < e; ++i)
            amax = std::max(amax, std::fabs(x[i])), lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
          // The decoders accept 127 x scale (int8) and min + 255 x scale (uint8, unless wide) only when finite in
          // f32: a scale rounded up past that (max|x| = FLT_MAX; a uint8 range from 8.5e37 to FLT_MAX) is taken
          // down an ulp at a time until it fits.
          float s = amax / 127.0f;
          while (std::isfinite(s) && s > 0 && !std::isfinite(127.0f * s)) s = std::nextafter(s, 0.0f);
          const float inv = s > 0 ? 1.0f / s : 0.0f;
          want_scales[c] = s;
          // A finite range wider than FLT_MAX: its scale in double; a scale that large (a range near or above
          // FLT_MAX) quantizes as x/s - lo/s (x - lo overflows).
          const bool over = std::isinf(hi - lo) && std::isfinite(hi) && std::isfinite(lo);
          float us = over ? float((double(hi) - double(lo)) / 255.0) : (hi - lo) / 255.0f;
          const bool wide = us > 1.3e36f && std::isfinite(us);
          while (!wide && std::isfinite(lo) && std::isfinite(us) && us > 0 && !std::isfinite(lo + 255.0f * us))
            us = std::nextafter(us, 0.0f);
          const float uinv = us > 0 ? 1.0f / us : 0.0f;
          want_header[2 * c] = lo, want_header[2 * c + 1] = us;
          // A subnormal scale divides (1 / s may be inf, and 0 * inf coded zeros as -128).
          const bool tiny = s > 0 && s < 1.17549435e-38f, utiny = us > 0 && us < 1.17549435e-38f;
          for (size_t i = b; i < e; ++i) {
            float v = tiny ? x[i] / s : x[i] * inv;
            v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
            // NaN (inf * 0, or inf - inf) gives the saturated INT32_MIN: -128, or 0 unsigned.
            want[i] = std::isnan(v) ? -128 : static_cast<int8_t>(static_cast<int32_t>(v + std::copysign(0.5f, v)));
            float w = wide ? x[i] * uinv - lo * uinv : utiny ? (x[i] - lo) / us : (x[i] - lo) * uinv;
            w = w < 0.0f ? 0.0f : w > 255.0f ? 255.0f : w;
            uwant[i] = std::isnan(w) ? 0 : static_cast<uint8_t>(static_cast<int32_t>(w + 0.5f));
          }
        }
        k->quant_i8_chunks(x.data(), n, chunk, scales.data(), q.data());
        k->quant_u8_chunks(x.data(), n, chunk, header.data(), uq.data());
        auto bits = [](const std::vector<float>& v) {  // NaN headers (inf - inf) compare by their bits
          std::vector<uint32_t> b(v.size());
          for (size_t i = 0; i < v.size(); ++i) b[i] = bits_of(v[i]);
          return b;
        };
        EXPECT_EQ(bits(scales), bits(want_scales)) << k->name << " chunk=" << chunk << " n=" << n;
        EXPECT_EQ(q, want) << k->name << " chunk=" << chunk << " n=" << n;
        EXPECT_EQ(bits(header), bits(want_header)) << k->name << " chunk=" << chunk << " n=" << n;
        EXPECT_EQ(uq, uwant) << k->name << " chunk=" << chunk << " n=" << n;
        // Decoding a chunk of finite values gives finite values (a range ending at FLT_MAX decoded inf, and so did
        // int8's chunks holding FLT_MAX), within half a step of each value.
        std::vector<float> back(n), iback(n);
        k->dequant_u8_chunks(uq.data(), n, chunk, header.data(), back.data(), false);
        k->dequant_i8_chunks(q.data(), n, chunk, scales.data(), iback.data(), false);
        for (size_t c = 0; c < nc; ++c) {
          size_t b = c * chunk, e = std::min(n, b + chunk);
          bool finite = true;
          for (size_t i = b; i < e; ++i) finite = finite && std::isfinite(x[i]);
          for (size_t i = b; finite && i < e; ++i) {
            EXPECT_TRUE(std::isfinite(back[i])) << k->name << " chunk=" << chunk << " n=" << n << " i=" << i;
            EXPECT_TRUE(std::isfinite(iback[i])) << k->name << " chunk=" << chunk << " n=" << n << " i=" << i;
            if (x[i] >= 8.5e37f) {  // the chunks that overflowed: half a step, and the rounding of the decode
              EXPECT_LE(std::fabs(double(back[i]) - double(x[i])), 0.5 * double(header[2 * c + 1]) * 1.001 + 2e31)
                  << k->name << " chunk=" << chunk << " n=" << n << " i=" << i;
              EXPECT_LE(std::fabs(double(iback[i]) - double(x[i])), 0.5 * double(scales[c]) * 1.001 + 2e31)
                  << k->name << " chunk=" << chunk << " n=" << n << " i=" << i;
            }
          }
        }
      }
}

// Bit i % 8 of byte i / 8 is x[i]'s sign bit (the wire format of the sign methods), written out element by element.
static std::vector<uint8_t> sign_bits_of(const std::vector<float>& x) {
  std::vector<uint8_t> s((x.size() + 7) / 8, 0);
  for (size_t i = 0; i < x.size(); ++i)
    if (std::signbit(x[i])) s[i / 8] = static_cast<uint8_t>(s[i / 8] | 1u << (i % 8));
  return s;
}

TEST(Kernels, SignStatsEqualSeparatePassesAndFeedbackAdds) {
  for (auto* k : tables())
    for (size_t n : {size_t(0), size_t(5), size_t(4096), size_t(4103), size_t(10000)}) {
      auto x = data(n, n + 5), g = data(n, n + 6);
      // -0.0 (a masked negative gradient, 0 x -g) goes with the negatives, as its sign bit sent does (counted with
      // the positives, onebit's decoded sum lost the positives' share of it)
      for (size_t i = 3; i < n; i += 7) x[i] = -0.0f;
      const std::vector<uint8_t> want_signs = sign_bits_of(x);
      std::vector<uint8_t> signs(want_signs.size(), 0xee);
      k->pack_signs(x.data(), n, signs.data());
      EXPECT_EQ(signs, want_signs) << k->name << " pack_signs n=" << n;
      std::fill(signs.begin(), signs.end(), 0xee);
      double a, b;
      size_t pn;
      k->sign_stats(x.data(), nullptr, nullptr, n, false, a, b, pn, signs.data());
      EXPECT_EQ(signs, want_signs);
      double l1 = 0;
      for (float v : x) l1 += std::fabs(v);
      EXPECT_NEAR(a, l1, 1e-5 * (1 + l1));
      k->sign_stats(x.data(), nullptr, nullptr, n, true, a, b, pn, signs.data());
      double ps = 0, ns = 0;
      size_t cnt = 0;
      for (float v : x) {
        if (std::signbit(v))
          ns += v;
        else
          ps += v, ++cnt;
      }
      EXPECT_EQ(pn, cnt);
      EXPECT_NEAR(a, ps, 1e-5 * (1 + ps));
      EXPECT_NEAR(b, ns, 1e-5 * (1 - ns));
      // With g: p = x + g is stored and is what the signs and sums describe.
      std::vector<float> p = x, want_p = x;
      k->add_to(want_p.data(), g.data(), n);
      k->sign_stats(p.data(), g.data(), p.data(), n, false, a, b, pn, signs.data());
      EXPECT_EQ(p, want_p);
      EXPECT_EQ(signs, sign_bits_of(want_p));
    }
  // sign_feedback: the pending correction (by e's sign bit), then what sign_stats(e, g, e) gives, bit for bit.
  for (auto* k : tables())
    for (size_t n : {size_t(0), size_t(5), size_t(37), size_t(4103), size_t(10000)})
      for (bool split : {false, true})
        for (bool corr : {false, true}) {
          auto e = data(n, n + 9), g = data(n, n + 10);
          const float cpos = -0.25f, cneg = 0.375f;
          std::vector<float> want_e = e;
          if (corr)
            for (auto& v : want_e) v = v + (std::signbit(v) ? cneg : cpos);
          std::vector<uint8_t> want_signs((n + 7) / 8), signs(want_signs.size(), 0xee);
          double wa, wb, a, b;
          size_t wpn, pn;
          k->sign_stats(want_e.data(), g.data(), want_e.data(), n, split, wa, wb, wpn, want_signs.data());
          k->sign_feedback(e.data(), g.data(), n, split, corr, cpos, cneg, a, b, pn, signs.data());
          EXPECT_EQ(e, want_e) << k->name << " n=" << n;
          EXPECT_EQ(signs, want_signs) << k->name << " n=" << n;
          EXPECT_EQ(a, wa);
          EXPECT_EQ(b, wb);
          EXPECT_EQ(pn, wpn);
        }
  // Every table gives the same sums bit for bit.
  auto x = data(10007, 8);
  std::vector<uint8_t> s(10007 / 8 + 1);
  std::vector<double> firsts;
  for (auto* k : tables()) {
    double a, b;
    size_t pn;
    k->sign_stats(x.data(), nullptr, nullptr, x.size(), true, a, b, pn, s.data());
    double c, d;
    k->sign_stats(x.data(), nullptr, nullptr, x.size(), false, c, d, pn, s.data());
    firsts.insert(firsts.end(), {a, b, c});
  }
  for (size_t i = 3; i < firsts.size(); ++i) EXPECT_EQ(firsts[i], firsts[i % 3]);
}

TEST(Kernels, MomentumSignsEqualScalar) {
  for (auto* k : tables())
    for (size_t n : kN) {
      auto m = data(n, n + 9), g = data(n, n + 10), want_m = m;
      std::vector<uint8_t> out((n + 7) / 8, 0xee), want((n + 7) / 8, 0);
      for (size_t i = 0; i < n; ++i) {
        want_m[i] = 0.9f * m[i] + (1 - 0.9f) * g[i];
        want[i / 8] |= static_cast<uint8_t>((bits_of(want_m[i]) >> 31) << (i % 8));
      }
      k->momentum_signs(m.data(), g.data(), n, 0.9f, out.data());
      EXPECT_EQ(m, want_m) << k->name << " n=" << n;
      EXPECT_EQ(out, want) << k->name << " n=" << n;
    }
}

// What every rank must compute alike whatever its CPU (a rank with AVX2 decodes a baseline rank's payload, and the
// reductions' results go on the wire as scales, headers and norms): each table against the baseline's, bit for bit.
// (The decoders and reductions had no such comparison: an audit.)
TEST(Kernels, DecodersAndWireReductionsAgreeAcrossTables) {
  const kernels::Table& base = kernels::base_table();
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (bits_of(a[i]) != bits_of(b[i])) return false;
    return true;
  };
  std::mt19937_64 g(11);
  for (auto* k : tables())
    for (size_t n : kN) {
      const auto x = data(n, n + 3);
      // Reductions whose results are sent: max |x| (int8's scales), min and max (uint8's headers), the sum and the sum
      // of squares (TernGrad's scale and clip, QSGD's norms).
      EXPECT_EQ(bits_of(k->abs_max(x.data(), n)), bits_of(base.abs_max(x.data(), n))) << k->name << " n=" << n;
      EXPECT_EQ(k->sum(x.data(), n), base.sum(x.data(), n)) << k->name << " n=" << n;
      EXPECT_EQ(k->sum_squares(x.data(), n), base.sum_squares(x.data(), n)) << k->name << " n=" << n;
      float lo = 0, hi = 0, blo = 0, bhi = 0;
      if (n > 0) {
        k->min_max(x.data(), n, lo, hi);
        base.min_max(x.data(), n, blo, bhi);
        EXPECT_EQ(bits_of(lo), bits_of(blo)) << k->name << " n=" << n;
        EXPECT_EQ(bits_of(hi), bits_of(bhi)) << k->name << " n=" << n;
      }
      // Decoders, replacing and adding.
      std::vector<uint8_t> signs((n + 7) / 8);
      for (auto& b : signs) b = static_cast<uint8_t>(g());
      std::vector<int8_t> q(n);
      std::vector<uint8_t> uq(n);
      for (size_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(g()), uq[i] = static_cast<uint8_t>(g());
      for (size_t chunk : {size_t{7}, size_t{256}}) {
        const size_t nc = (n + chunk - 1) / chunk;
        std::vector<float> scales(nc), header(2 * nc);
        for (size_t c = 0; c < nc; ++c) {
          scales[c] = c % 3 == 2 ? 3e-40f : 0.01f * float(c + 1);  // (a subnormal scale among them)
          header[2 * c] = -1.5f + float(c), header[2 * c + 1] = c % 3 == 2 ? 2e-41f : 0.003f * float(c + 1);
        }
        for (bool add : {false, true}) {
          std::vector<float> a = x, b = x;
          k->dequant_i8_chunks(q.data(), n, chunk, scales.data(), a.data(), add);
          base.dequant_i8_chunks(q.data(), n, chunk, scales.data(), b.data(), add);
          EXPECT_TRUE(same_bits(a, b)) << k->name << " dequant_i8_chunks n=" << n << " chunk=" << chunk;
          a = x, b = x;
          k->dequant_u8_chunks(uq.data(), n, chunk, header.data(), a.data(), add);
          base.dequant_u8_chunks(uq.data(), n, chunk, header.data(), b.data(), add);
          EXPECT_TRUE(same_bits(a, b)) << k->name << " dequant_u8_chunks n=" << n << " chunk=" << chunk;
        }
      }
      for (bool add : {false, true}) {
        std::vector<float> a = x, b = x;
        k->unpack_signs(signs.data(), n, 0.75f, -1.25f, a.data(), add);
        base.unpack_signs(signs.data(), n, 0.75f, -1.25f, b.data(), add);
        EXPECT_TRUE(same_bits(a, b)) << k->name << " unpack_signs n=" << n << " add=" << add;
        // and the baseline's as the bits say: bit set, neg; clear, pos
        for (size_t i = 0; i < n; ++i) {
          const float v = (signs[i / 8] >> (i % 8)) & 1 ? -1.25f : 0.75f;
          ASSERT_EQ(bits_of(b[i]), bits_of(add ? x[i] + v : v)) << "base unpack_signs i=" << i;
        }
      }
    }
}
