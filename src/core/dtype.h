#pragma once
// Element types and the f16/bf16 <-> f32 conversions every layer uses.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace conduit {

enum class DType : uint8_t { f32 = 0, f64, f16, bf16, i8, u8, i32, i64 };
inline constexpr int kNumDTypes = 8;

size_t dtype_size(DType t);
const char* dtype_name(DType t);
bool is_floating(DType t);
// Parses "f32", "float32", "float", "f16", "half", "bf16", ...; ConfigError listing the allowed names otherwise.
DType parse_dtype(std::string_view name);
const char* dtype_names_allowed();

// IEEE binary16 and bfloat16 with round-to-nearest-even; NaN stays NaN, overflow goes to infinity.
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
inline float bf16_to_f32(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Bulk conversions (vectorized with F16C/AVX2 where the CPU has them).
void convert_f32_to_f16(const float* in, uint16_t* out, size_t n);
void convert_f16_to_f32(const uint16_t* in, float* out, size_t n);
void convert_f32_to_bf16(const float* in, uint16_t* out, size_t n);
void convert_bf16_to_f32(const uint16_t* in, float* out, size_t n);

// Symmetric int8 in blocks of `block` elements (ZeRO++'s quantized weights, qwZ): each block a f32 scale (its
// largest magnitude / 127; 0 for a block of zeros) and its elements round(x / scale) in [-127, 127]. n elements take
// block_i8_bytes(n, block) bytes: the ceil(n / block) scales (4 bytes each, stored unaligned), then the n values.
// A block holding an infinity or NaN decodes to NaN (its scale is not finite).
size_t block_i8_bytes(size_t n, size_t block);
void quantize_block_i8(const float* in, size_t n, size_t block, uint8_t* out);
void dequantize_block_i8(const uint8_t* in, size_t n, size_t block, float* out);

}  // namespace conduit
