#include "core/dtype.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace conduit {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i8: return 1;
    case DType::u8: return 1;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  throw InvalidArgument(fmt::format("unknown dtype code {}", static_cast<int>(t)));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

bool is_floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16; }

const char* dtype_names_allowed() { return "f32, f64, f16, bf16, i8, u8, i32, i64"; }

DType parse_dtype(std::string_view n) {
  if (n == "f32" || n == "float32" || n == "float") return DType::f32;
  if (n == "f64" || n == "float64" || n == "double") return DType::f64;
  if (n == "f16" || n == "float16" || n == "half") return DType::f16;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "i8" || n == "int8") return DType::i8;
  if (n == "u8" || n == "uint8") return DType::u8;
  if (n == "i32" || n == "int32" || n == "int") return DType::i32;
  if (n == "i64" || n == "int64") return DType::i64;
  throw ConfigError(fmt::format("unknown dtype '{}': allowed are {}", n, dtype_names_allowed()));
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
  }
  int32_t e = static_cast<int32_t>(exp) - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (e <= 0) {                                                 // subnormal or zero
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - e);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into exponent: correct
  return static_cast<uint16_t>(half);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      x = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    // NaNs come out quiet, as the F16C instruction gives them (a signaling one kept its bit here, so the converted
    // bits depended on the CPU and on where the element sat: the last n % 8 take this path).
    x = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
  } else {
    x = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

#if defined(__x86_64__)
namespace {
bool has_f16c() {
  static const bool v = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  return v;
}

__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(in + i);
    __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

__attribute__((target("avx2,f16c"))) void f16_to_f32_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}
}  // namespace
#endif

void convert_f32_to_f16(const float* in, uint16_t* out, size_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return f32_to_f16_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

void convert_f16_to_f32(const uint16_t* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return f16_to_f32_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

__attribute__((target_clones("avx2", "default"))) void convert_f32_to_bf16(const float* in, uint16_t* out,
                                                                           size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t x;
    std::memcpy(&x, in + i, 4);
    uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
    uint16_t r = static_cast<uint16_t>((x + rounding) >> 16);
    // NaN must stay NaN (the rounding could carry a NaN's mantissa into infinity).
    out[i] = ((x & 0x7fffffffu) > 0x7f800000u) ? static_cast<uint16_t>((x >> 16) | 0x40u) : r;
  }
}

__attribute__((target_clones("avx2", "default"))) void convert_bf16_to_f32(const uint16_t* in, float* out,
                                                                           size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

size_t block_int_bytes(size_t n, size_t block, int bits) {
  if (block == 0) throw InvalidArgument("block int8/int4: block 0; allowed: 1 element or more");
  if (bits != 8 && bits != 4) throw InvalidArgument(fmt::format("block int: {} bits; allowed: 8 or 4", bits));
  return 4 * ((n + block - 1) / block) + (bits == 8 ? n : (n + 1) / 2);
}

size_t block_i8_bytes(size_t n, size_t block) { return block_int_bytes(n, block, 8); }

std::vector<size_t> cut_at_bounds(size_t begin, size_t n, std::span<const size_t> bounds) {
  std::vector<size_t> out;
  size_t at = begin;
  for (auto b = std::upper_bound(bounds.begin(), bounds.end(), begin); b != bounds.end() && *b < begin + n; ++b) {
    out.push_back(*b - at);
    at = *b;
  }
  out.push_back(begin + n - at);
  return out;
}

namespace {

// (the bit width a template parameter: GCC at -O2 does not unswitch a per-element test of it)
template <int Bits>
void quantize_blocks(const float* in, size_t n, size_t block, uint8_t* out) {
  const size_t blocks = (n + block - 1) / block;
  uint8_t* q = out + 4 * blocks;
  constexpr float top = Bits == 8 ? 127.f : 7.f;
  if constexpr (Bits == 4) std::fill(q, q + (n + 1) / 2, uint8_t{0});
  for (size_t k = 0; k < blocks; ++k) {
    const size_t lo = k * block, hi = std::min(n, lo + block);
    float amax = 0;
    bool finite = true;
    for (size_t i = lo; i < hi; ++i) {
      amax = std::max(amax, std::fabs(in[i]));
      finite = finite && std::isfinite(in[i]);
    }
    float scale = finite ? amax / top : std::numeric_limits<float>::quiet_NaN();
    if (scale == 0 && amax > 0) scale = std::numeric_limits<float>::denorm_min();  // (tiny subnormals: kept nonzero)
    // (FLT_MAX / 127 rounds up: 127 x it, the top code's value, was inf for a finite block; an ulp or two less fits)
    for (int i = 0; i < 8 && std::isfinite(scale) && scale > 0 && !std::isfinite(top * scale); ++i)
      scale = std::nextafter(scale, 0.0f);
    std::memcpy(out + 4 * k, &scale, 4);
    if (!(scale > 0 && std::isfinite(scale))) {  // (zeros, or a non-finite block: code 0)
      for (size_t i = lo; i < hi; ++i) {
        if constexpr (Bits == 8)
          q[i] = 0;
        else
          q[i / 2] |= static_cast<uint8_t>(8 << (4 * (i % 2)));
      }
      continue;
    }
    for (size_t i = lo; i < hi; ++i) {
      const int c = static_cast<int>(std::clamp(std::nearbyint(in[i] / scale), -top, top));
      if constexpr (Bits == 8)
        q[i] = static_cast<uint8_t>(static_cast<int8_t>(c));
      else
        q[i / 2] |= static_cast<uint8_t>((c + 8) << (4 * (i % 2)));
    }
  }
}

template <int Bits>
void dequantize_blocks(const uint8_t* in, size_t n, size_t block, float* out) {
  const size_t blocks = (n + block - 1) / block;
  const uint8_t* q = in + 4 * blocks;
  for (size_t k = 0; k < blocks; ++k) {
    float scale = 0;
    std::memcpy(&scale, in + 4 * k, 4);
    const size_t lo = k * block, hi = std::min(n, lo + block);
    if (!std::isfinite(scale)) {
      std::fill(out + lo, out + hi, std::numeric_limits<float>::quiet_NaN());
      continue;
    }
    for (size_t i = lo; i < hi; ++i) {
      int c;
      if constexpr (Bits == 8)
        c = static_cast<int8_t>(q[i]);
      else
        c = ((q[i / 2] >> (4 * (i % 2))) & 15) - 8;
      out[i] = static_cast<float>(c) * scale;
    }
  }
}

}  // namespace

void quantize_block_int(const float* in, size_t n, size_t block, int bits, uint8_t* out) {
  (void)block_int_bytes(n, block, bits);  // (refuses block 0 and other bits)
  if (bits == 8)
    quantize_blocks<8>(in, n, block, out);
  else
    quantize_blocks<4>(in, n, block, out);
}

void dequantize_block_int(const uint8_t* in, size_t n, size_t block, int bits, float* out) {
  (void)block_int_bytes(n, block, bits);
  if (bits == 8)
    dequantize_blocks<8>(in, n, block, out);
  else
    dequantize_blocks<4>(in, n, block, out);
}

void quantize_block_i8(const float* in, size_t n, size_t block, uint8_t* out) {
  quantize_block_int(in, n, block, 8, out);
}

void dequantize_block_i8(const uint8_t* in, size_t n, size_t block, float* out) {
  dequantize_block_int(in, n, block, 8, out);
}

}  // namespace conduit
