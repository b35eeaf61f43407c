#include "core/reduce.h"

#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

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

ReduceOp parse_reduce_op(std::string_view n) {
  if (n == "sum") return ReduceOp::sum;
  if (n == "avg" || n == "mean") return ReduceOp::avg;
  if (n == "min") return ReduceOp::min;
  if (n == "max") return ReduceOp::max;
  if (n == "prod" || n == "product") return ReduceOp::prod;
  throw ConfigError(fmt::format("unknown reduction '{}': allowed are sum, avg, min, max, prod", n));
}

namespace {

// The element loops are written so GCC vectorizes them; target_clones builds an AVX2 copy chosen at load time.
template <typename T>
struct Kernels {
  __attribute__((target_clones("avx2", "default"))) static void sum(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] + b[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void prod(T* __restrict out, const T* __restrict a,
                                                                      const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i] * b[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void min(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = b[i] < a[i] ? b[i] : a[i];
  }
  __attribute__((target_clones("avx2", "default"))) static void max(T* __restrict out, const T* __restrict a,
                                                                     const T* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = b[i] > a[i] ? b[i] : a[i];
  }
};

// In-place variants (out == a) cannot use __restrict on both; these loops vectorize as well.
template <typename T>
struct InPlace {
  __attribute__((target_clones("avx2", "default"))) static void sum(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] + in[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void prod(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] * in[i]);
  }
  __attribute__((target_clones("avx2", "default"))) static void min(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = in[i] < acc[i] ? in[i] : acc[i];
  }
  __attribute__((target_clones("avx2", "default"))) static void max(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = in[i] > acc[i] ? in[i] : acc[i];
  }
  // acc is the second operand (out == b): the same choice as Kernels' b < a ? b : a, so that NaN and -0/+0 come out
  // alike whichever operand the output aliases (ranks reducing in place on either side got different bits).
  __attribute__((target_clones("avx2", "default"))) static void min_second(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] < in[i] ? acc[i] : in[i];
  }
  __attribute__((target_clones("avx2", "default"))) static void max_second(T* acc, const T* __restrict in, size_t n) {
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] > in[i] ? acc[i] : in[i];
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
        return o == x ? InPlace<T>::min(o, other, n) : InPlace<T>::min_second(o, other, n);
      case ReduceOp::max:
        return o == x ? InPlace<T>::max(o, other, n) : InPlace<T>::max_second(o, other, n);
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

}  // namespace

void reduce_to(void* out, const void* a, const void* b, size_t count, DType dtype, ReduceOp op) {
  if (count == 0) return;
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

void finalize_avg(void* buf, size_t count, DType dtype, int n) {
  if (n <= 1 || count == 0) return;
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
