#include "core/reduce.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/error.h"

namespace conduit {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

const char* reduce_op_names_allowed() { return "sum, avg, min, max, prod"; }

ReduceOp parse_reduce_op(std::string_view n) {
  if (n == "sum") return ReduceOp::sum;
  if (n == "avg" || n == "mean") return ReduceOp::avg;
  if (n == "min") return ReduceOp::min;
  if (n == "max") return ReduceOp::max;
  if (n == "prod" || n == "product") return ReduceOp::prod;
  throw ConfigError(fmt::format("unknown reduction '{}': allowed are {}", n, reduce_op_names_allowed()));
}

namespace {

// One element of each reduction. Integers wrap (computed unsigned: signed overflow is undefined in C++). min and
// max are symmetric in their operands, so a result never depends on which rank or which side of a pair holds a
// value: a NaN in either operand gives the one canonical quiet NaN (as torch.minimum/maximum propagate it; `b < a ?
// b : a` kept or dropped it by operand order, so a max over ranks could hide a diverged one), and of -0 and +0 min
// gives -0 and max +0 (IEEE 754-2019 minimum/maximum).
template <typename T>
inline T add_of(T a, T b) {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return static_cast<T>(a + b);
  }
}
template <typename T>
inline T mul_of(T a, T b) {
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    using U = std::make_unsigned_t<T>;
    // (unsigned short operands would promote to int and overflow again: multiply in at least unsigned int)
    using W = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
    return static_cast<T>(static_cast<U>(static_cast<W>(static_cast<U>(a)) * static_cast<W>(static_cast<U>(b))));
  } else if constexpr (std::is_integral_v<T> && sizeof(T) < sizeof(unsigned)) {
    return static_cast<T>(static_cast<unsigned>(a) * static_cast<unsigned>(b));
  } else {
    return static_cast<T>(a * b);
  }
}
template <typename T>
using BitsOf = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
template <typename T>
inline T min_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::bit_cast<T>(std::bit_cast<BitsOf<T>>(a) | std::bit_cast<BitsOf<T>>(b));  // -0 wins
  }
  return b < a ? b : a;
}
template <typename T>
inline T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    if (a == b) return std::bit_cast<T>(std::bit_cast<BitsOf<T>>(a) & std::bit_cast<BitsOf<T>>(b));  // +0 wins
  }
  return b > a ? b : a;
}

// The element loops are written so GCC vectorizes them; target_clones builds an AVX2 copy chosen at load time.
template <typename T>
struct Kernels {
  __attribute__((target_clones("avx2", "default"))) static void sum(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = add_of(a[i], b[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void prod(T* __restrict out, const T* __restrict a,
                                                                      const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = mul_of(a[i], b[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void min(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = min_of(a[i], b[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void max(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = max_of(a[i], b[i]);
  }
};

// In-place variants (out == a or out == b: the operations are symmetric) cannot use __restrict on both; these
// loops vectorize as well.
template <typename T>
struct InPlace {
  __attribute__((target_clones("avx2", "default"))) static void sum(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = add_of(acc[i], in[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void prod(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = mul_of(acc[i], in[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void min(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = min_of(acc[i], in[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void max(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = max_of(acc[i], in[i]);
  }
};

template <typename T>
void typed_to(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  if (o == x || o == y) {
    const T* other = (o == x) ? y : x;
    if (o == other) {  // op(a, a): reduce against a private copy of the block
      T tmp[512];
      for (size_t s = 0; s < n; s += 512) {
        size_t m = std::min<size_t>(512, n - s);
        std::copy(o + s, o + s + m, tmp);
        typed_to<T>(o + s, tmp, o + s, m, op);
      }
      return;
    }
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: return InPlace<T>::sum(o, other, n);
      case ReduceOp::prod: return InPlace<T>::prod(o, other, n);
      case ReduceOp::min:
        return InPlace<T>::min(o, other, n);
      case ReduceOp::max:
        return InPlace<T>::max(o, other, n);
    }
  }
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return Kernels<T>::sum(o, x, y, n);
    case ReduceOp::prod: return Kernels<T>::prod(o, x, y, n);
    case ReduceOp::min: return Kernels<T>::min(o, x, y, n);
    case ReduceOp::max: return Kernels<T>::max(o, x, y, n);
  }
}

// f16/bf16: widen blocks to f32, reduce in f32, round back once.
void half_to(void* out, const void* a, const void* b, size_t n, ReduceOp op, bool bf16) {
  constexpr size_t kBlock = 1024;
  float fa[kBlock], fb[kBlock];
  auto* o = static_cast<uint16_t*>(out);
  auto* x = static_cast<const uint16_t*>(a);
  auto* y = static_cast<const uint16_t*>(b);
  for (size_t s = 0; s < n; s += kBlock) {
    size_t m = std::min(kBlock, n - s);
    if (bf16) {
      convert_bf16_to_f32(x + s, fa, m);
      convert_bf16_to_f32(y + s, fb, m);
    } else {
      convert_f16_to_f32(x + s, fa, m);
      convert_f16_to_f32(y + s, fb, m);
    }
    typed_to<float>(fa, fa, fb, m, op);
    if (bf16) convert_f32_to_bf16(fa, o + s, m);
    else convert_f32_to_f16(fa, o + s, m);
  }
}

bool misaligned(const void* p, size_t align) { return reinterpret_cast<uintptr_t>(p) % align != 0; }
constexpr size_t kStageBytes = 4096;

}  // namespace

void reduce_to(void* out, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
  const size_t esz = dtype_size(dtype);
  if (esz > 1 && (misaligned(out, esz) || misaligned(a, esz) || misaligned(b, esz))) {
    // Element loads through a pointer not aligned to the element are undefined behaviour (a frame's payload in a
    // byte ring, a user's offset view): each block of a misaligned operand goes through an aligned copy (only those:
    // a payload reduced into an aligned buffer costs one copy). Inputs are copied before the output is written, so
    // out may be a or b.
    alignas(64) unsigned char sa[kStageBytes], sb[kStageBytes], so[kStageBytes];
    const size_t per = kStageBytes / esz;
    const bool ma = misaligned(a, esz), mb = misaligned(b, esz), mo = misaligned(out, esz);
    for (size_t s = 0; s < count; s += per) {
      const size_t m = std::min(per, count - s), at = s * esz;
      const void* x = static_cast<const unsigned char*>(a) + at;
      const void* y = static_cast<const unsigned char*>(b) + at;
      void* o = static_cast<unsigned char*>(out) + at;
      if (ma) x = std::memcpy(sa, x, m * esz);
      if (mb) y = std::memcpy(sb, y, m * esz);
      reduce_to(mo ? so : o, x, y, m, dtype, op);
      if (mo) std::memcpy(o, so, m * esz);
    }
    return;
  }
  switch (dtype) {
    case DType::f32: return typed_to<float>(out, a, b, count, op);
    case DType::f64: return typed_to<double>(out, a, b, count, op);
    case DType::f16: return half_to(out, a, b, count, op, false);
    case DType::bf16: return half_to(out, a, b, count, op, true);
    case DType::i8: return typed_to<int8_t>(out, a, b, count, op);
    case DType::u8: return typed_to<uint8_t>(out, a, b, count, op);
    case DType::i32: return typed_to<int32_t>(out, a, b, count, op);
    case DType::i64: return typed_to<int64_t>(out, a, b, count, op);
  }
  throw InvalidArgument(fmt::format("reduce: unknown dtype code {}", static_cast<int>(dtype)));
}

void reduce_into(void* acc, const void* in, size_t count, DType dtype, ReduceOp op) {
  reduce_to(acc, acc, in, count, dtype, op);
}

namespace {
template <typename T>
void divide(void* buf, size_t n, int d) {
  T* p = static_cast<T*>(buf);
  if constexpr (std::is_floating_point_v<T>) {
    const T div = static_cast<T>(d);
    for (size_t i = 0; i < n; ++i) p[i] /= div;
  } else {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / d);
  }
}
}  // namespace

void prescale_avg(const void* in, void* out, size_t count, DType dtype, int n) {
  if (in != out && count) std::memmove(out, in, count * dtype_size(dtype));
  finalize_avg(out, count, dtype, n);
}

void finalize_avg(void* buf, size_t count, DType dtype, int n) {
  if (n <= 1 || count == 0) return;
  const size_t esz = dtype_size(dtype);
  if (esz > 1 && misaligned(buf, esz)) {  // as in reduce_to: divide aligned copies
    alignas(64) unsigned char st[kStageBytes];
    const size_t per = kStageBytes / esz;
    for (size_t s = 0; s < count; s += per) {
      const size_t m = std::min(per, count - s);
      unsigned char* at = static_cast<unsigned char*>(buf) + s * esz;
      std::memcpy(st, at, m * esz);
      finalize_avg(st, m, dtype, n);
      std::memcpy(at, st, m * esz);
    }
    return;
  }
  switch (dtype) {
    case DType::f32: return divide<float>(buf, count, n);
    case DType::f64: return divide<double>(buf, count, n);
    case DType::i8: return divide<int8_t>(buf, count, n);
    case DType::u8: return divide<uint8_t>(buf, count, n);
    case DType::i32: return divide<int32_t>(buf, count, n);
    case DType::i64: return divide<int64_t>(buf, count, n);
    case DType::f16:
    case DType::bf16: {
      auto* p = static_cast<uint16_t*>(buf);
      const float div = static_cast<float>(n);
      for (size_t i = 0; i < count; ++i) {
        if (dtype == DType::f16) p[i] = f32_to_f16(f16_to_f32(p[i]) / div);
        else p[i] = f32_to_bf16(bf16_to_f32(p[i]) / div);
      }
      return;
    }
  }
}

}  // namespace conduit
