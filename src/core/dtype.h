#pragma once
// Element types and the f16/bf16 <-> f32 conversions every layer uses.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

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
// The same with `bits` 8 or 4 (ZeRO++'s int4 gradients: largest magnitude / 7, elements in [-7, 7], two to a byte,
// element i in byte i / 2's low nibble when i is even, stored + 8): ceil(n / block) scales, then ceil(n * bits / 8)
// bytes of values. Other bits: InvalidArgument.
size_t block_int_bytes(size_t n, size_t block, int bits);
void quantize_block_int(const float* in, size_t n, size_t block, int bits, uint8_t* out);
void dequantize_block_int(const uint8_t* in, size_t n, size_t block, int bits, float* out);
// The lengths of the elements [begin, begin + n) of a buffer cut at every bound (ascending offsets into the buffer)
// strictly inside them: the pieces a block-quantized wire rounds in blocks of their own (one piece without such a
// bound; an empty one for n = 0). Tensor parallelism cuts at its parameters' starts (compress::int_reduce_scatter,
// ZeRO-3's int8 gathers).
std::vector<size_t> cut_at_bounds(size_t begin, size_t n, std::span<const size_t> bounds);

}  // namespace conduit
