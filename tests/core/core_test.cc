#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/malloc_tuning.h"
#include "core/partition.h"
#include "core/reduce.h"
#include "core/stats.h"

using namespace conduit;

TEST(DType, NamesParseAndSizes) {
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  try {
    parse_dtype("f8");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("allowed are f32, f64, f16, bf16, i8, u8, i32, i64"), std::string::npos);
  }
}

TEST(DType, HalfConversionIsExactForEveryHalfValue) {
  // Every finite f16 value converts to f32 and back to itself; NaNs stay NaN.
  for (uint32_t h = 0; h < 65536; ++h) {
    uint16_t v = static_cast<uint16_t>(h);
    float f = f16_to_f32(v);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), v) << "h=" << h;
  }
}

// Signaling NaNs convert quiet on every path, as F16C converts them (the software path kept them signaling, so the
// bits depended on the CPU and on where an element sat).
TEST(DType, HalfNansConvertQuietOnEveryPath) {
  std::vector<uint16_t> h(19, 0x7c01);  // 16 through the vector path (when there is one), 3 through the scalar
  h[18] = 0xfd55;
  std::vector<float> f(h.size());
  convert_f16_to_f32(h.data(), f.data(), h.size());
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], 4);
    EXPECT_EQ(bits & 0x7fc00000u, 0x7fc00000u) << i << std::hex << " " << bits;
  }
  uint32_t last;
  std::memcpy(&last, &f[18], 4);
  EXPECT_EQ(last, 0xffeaa000u);
}

TEST(DType, HalfRoundsToNearestEvenAndOverflowsToInfinity) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f16_to_f32(f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(70000.0f))));
  // 1 + 2^-11 lies exactly between 1 and the next half (1 + 2^-10): ties go to even (1.0).
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(f16_to_f32(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11))), 1.0f + std::ldexp(1.0f, -9));
  // Subnormals: the smallest positive half.
  EXPECT_EQ(f16_to_f32(f32_to_f16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
}

TEST(DType, BulkConversionsMatchScalar) {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0, 100);
  std::vector<float> x(10007);
  for (auto& v : x) v = d(rng);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> h(x.size()), b(x.size());
  convert_f32_to_f16(x.data(), h.data(), x.size());
  convert_f32_to_bf16(x.data(), b.data(), x.size());
  std::vector<float> hb(x.size()), bb(x.size());
  convert_f16_to_f32(h.data(), hb.data(), x.size());
  convert_bf16_to_f32(b.data(), bb.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (i == 5) {
      EXPECT_TRUE(std::isnan(hb[i]));
      EXPECT_TRUE(std::isnan(bb[i]));
      continue;
    }
    ASSERT_EQ(h[i], f32_to_f16(x[i])) << i;
    ASSERT_EQ(b[i], f32_to_bf16(x[i])) << i;
    ASSERT_EQ(hb[i], f16_to_f32(h[i]));
    ASSERT_EQ(bb[i], bf16_to_f32(b[i]));
  }
}

// A block holding FLT_MAX: max / 127 rounded up, and 127 x that, its top code's value, was inf; the scale is an ulp
// or two lower and every finite value decodes finite (int4's 7 x scale fitted already).
TEST(DType, BlockInt8OfTheLargestFloatDecodesFinite) {
  const float big = std::numeric_limits<float>::max();
  std::vector<float> x{big, -big, 1.0f, 0.0f};
  std::vector<uint8_t> q(block_i8_bytes(x.size(), 4));
  quantize_block_i8(x.data(), x.size(), 4, q.data());
  std::vector<float> y(x.size());
  dequantize_block_i8(q.data(), x.size(), 4, y.data());
  EXPECT_TRUE(std::isfinite(y[0])) << y[0];
  EXPECT_NEAR(y[0] / big, 1.0, 1e-6);
  EXPECT_NEAR(y[1] / big, -1.0, 1e-6);
}

// Block int8: each block's values within half its own scale (max |x| / 127) of the input, its largest magnitude exact
// to a rounding; a block of zeros stays zeros, a block with an infinity or NaN decodes to NaN (the others unharmed).
TEST(DType, BlockInt8KeepsEachBlockWithinItsOwnScale) {
  const size_t block = 256, n = 3 * block + 17;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * float(i)) * (i < block ? 0.01f : i < 2 * block ? 100.f : 1.f);
  std::fill(x.begin() + 2 * block, x.begin() + 3 * block, 0.f);  // (block 2: zeros)
  std::vector<uint8_t> q(block_i8_bytes(n, block));
  EXPECT_EQ(q.size(), 4 * 4 + n);
  quantize_block_i8(x.data(), n, block, q.data());
  std::vector<float> y(n);
  dequantize_block_i8(q.data(), n, block, y.data());
  for (size_t k = 0; k < 4; ++k) {
    float amax = 0;
    for (size_t i = k * block; i < std::min(n, (k + 1) * block); ++i) amax = std::max(amax, std::abs(x[i]));
    for (size_t i = k * block; i < std::min(n, (k + 1) * block); ++i)
      ASSERT_LE(std::abs(y[i] - x[i]), amax / 254 * 1.0001f + 1e-12f) << i;
  }
  for (size_t i = 2 * block; i < 3 * block; ++i) ASSERT_EQ(y[i], 0.f) << i;
  EXPECT_NE(y[3], x[3]);  // (rounded)
  x[300] = std::numeric_limits<float>::infinity();
  quantize_block_i8(x.data(), n, block, q.data());
  dequantize_block_i8(q.data(), n, block, y.data());
  EXPECT_TRUE(std::isnan(y[256]) && std::isnan(y[511]));
  EXPECT_FALSE(std::isnan(y[0]) || std::isnan(y[512]) || std::isnan(y[n - 1]));
  x[300] = std::numeric_limits<float>::quiet_NaN();  // (a NaN likewise: max() would have passed over it)
  x[256] = 1;
  quantize_block_i8(x.data(), n, block, q.data());
  dequantize_block_i8(q.data(), n, block, y.data());
  EXPECT_TRUE(std::isnan(y[256]) && std::isnan(y[511]));
  // A block of tiny subnormals keeps its nonzero values nonzero (their scale would round to 0).
  std::vector<float> tiny(4, std::ldexp(1.0f, -148));
  tiny[1] = 0;
  std::vector<uint8_t> tq(block_i8_bytes(4, block));
  quantize_block_i8(tiny.data(), 4, block, tq.data());
  std::vector<float> ty(4);
  dequantize_block_i8(tq.data(), 4, block, ty.data());
  EXPECT_GT(ty[0], 0.f);
  EXPECT_EQ(ty[1], 0.f);
  EXPECT_THROW(block_i8_bytes(4, 0), InvalidArgument);
}

// Block int4 (ZeRO++'s int4 gradients): the scale max |x| / 7, codes in [-7, 7] stored + 8, two to a byte, element i
// in byte i / 2's low nibble when i is even; each value within half its block's scale; an odd count's last byte
// holds one; a non-finite block decodes to NaN; bits other than 8 and 4 refused.
TEST(DType, BlockInt4PacksTwoCodesAByteWithinHalfTheScale) {
  const size_t block = 4;
  const std::vector<float> x = {7, -7, 3.5f, 1, 0.4f, -2, 0, 1.4f, -0.7f};  // (blocks: scale 1, 2/7, 1.4/7 ... )
  std::vector<uint8_t> q(block_int_bytes(x.size(), block, 4));
  EXPECT_EQ(q.size(), 3 * 4 + 5u);
  quantize_block_int(x.data(), x.size(), block, 4, q.data());
  float s0 = 0;
  std::memcpy(&s0, q.data(), 4);
  EXPECT_EQ(s0, 1.0f);
  // Codes 7, -7, 4 (3.5 rounds to even), 1: bytes (7 + 8) | (-7 + 8) << 4 and (4 + 8) | (1 + 8) << 4.
  EXPECT_EQ(q[12], uint8_t(15 | (1 << 4)));
  EXPECT_EQ(q[13], uint8_t(12 | (9 << 4)));
  EXPECT_EQ(q[16] >> 4, 0);  // (the ninth element's byte holds only it)
  std::vector<float> y(x.size());
  dequantize_block_int(q.data(), x.size(), block, 4, y.data());
  EXPECT_EQ(y[0], 7.f);
  EXPECT_EQ(y[1], -7.f);
  EXPECT_EQ(y[2], 4.f);
  for (size_t k = 0; k < 3; ++k) {
    float amax = 0;
    for (size_t i = k * block; i < std::min(x.size(), (k + 1) * block); ++i) amax = std::max(amax, std::abs(x[i]));
    for (size_t i = k * block; i < std::min(x.size(), (k + 1) * block); ++i)
      ASSERT_LE(std::abs(y[i] - x[i]), amax / 14 * 1.0001f) << i;
  }
  EXPECT_NEAR(y[8], -0.7f, 1e-6f);  // (a block of one: its own scale)
  std::vector<float> bad = x;
  bad[5] = std::numeric_limits<float>::infinity();
  quantize_block_int(bad.data(), bad.size(), block, 4, q.data());
  dequantize_block_int(q.data(), bad.size(), block, 4, y.data());
  EXPECT_TRUE(std::isnan(y[4]) && std::isnan(y[7]));
  EXPECT_EQ(y[0], 7.f);
  // 8 bits through the same functions are block_i8's bytes.
  std::vector<uint8_t> a(block_i8_bytes(x.size(), block)), b(block_int_bytes(x.size(), block, 8));
  quantize_block_i8(x.data(), x.size(), block, a.data());
  quantize_block_int(x.data(), x.size(), block, 8, b.data());
  EXPECT_EQ(a, b);
  // Blocks of 3 (a boundary mid-byte) over 7 elements: each value its own block's, both nibbles of a shared byte.
  const std::vector<float> odd = {3, -3, 1, 14, -7, 7, 0.5f};  // (scales 3/7, 2, 0.5/7)
  std::vector<uint8_t> oq(block_int_bytes(odd.size(), 3, 4));
  EXPECT_EQ(oq.size(), 3 * 4 + 4u);
  quantize_block_int(odd.data(), odd.size(), 3, 4, oq.data());
  std::vector<float> oy(odd.size());
  dequantize_block_int(oq.data(), odd.size(), 3, 4, oy.data());
  EXPECT_FLOAT_EQ(oy[0], 3.f);
  EXPECT_FLOAT_EQ(oy[1], -3.f);
  EXPECT_FLOAT_EQ(oy[3], 14.f);  // (block 1 begins in byte 1's high nibble)
  EXPECT_FLOAT_EQ(oy[4], -8.f);  // (-7 / 2 = -3.5 rounds to -4: code -4 x 2)
  EXPECT_FLOAT_EQ(oy[5], 8.f);
  EXPECT_FLOAT_EQ(oy[6], 0.5f);
  EXPECT_NEAR(oy[2], 1.f, 3.f / 14 + 1e-6f);
  EXPECT_THROW(block_int_bytes(4, 4, 2), InvalidArgument);
}

template <typename T>
void check_reduce(DType dt) {
  std::vector<T> a(1001), b(1001);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<T>(static_cast<int>(i % 13) - 6);
    b[i] = static_cast<T>(static_cast<int>(i % 7) - 3);
  }
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::min, ReduceOp::max, ReduceOp::prod}) {
    auto acc = a;
    reduce_into(acc.data(), b.data(), acc.size(), dt, op);
    for (size_t i = 0; i < a.size(); ++i) {
      T want = op == ReduceOp::sum   ? static_cast<T>(a[i] + b[i])
               : op == ReduceOp::min ? std::min(a[i], b[i])
               : op == ReduceOp::max ? std::max(a[i], b[i])
                                     : static_cast<T>(a[i] * b[i]);
      ASSERT_EQ(acc[i], want) << reduce_op_name(op) << " at " << i;
    }
  }
}

TEST(Reduce, EveryOpOnNativeTypes) {
  check_reduce<float>(DType::f32);
  check_reduce<double>(DType::f64);
  check_reduce<int8_t>(DType::i8);
  check_reduce<int32_t>(DType::i32);
  check_reduce<int64_t>(DType::i64);
}

TEST(Reduce, HalfTypesAccumulateInFloat) {
  // 2048 + 1 is not representable in f16 (spacing 2 there) but the f32 sum 2048 + 1 + 1 rounds once to 2050.
  for (DType dt : {DType::f16, DType::bf16}) {
    auto enc = [&](float f) { return dt == DType::f16 ? f32_to_f16(f) : f32_to_bf16(f); };
    auto dec = [&](uint16_t h) { return dt == DType::f16 ? f16_to_f32(h) : bf16_to_f32(h); };
    std::vector<uint16_t> a(3000), b(3000), out(3000);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = enc(static_cast<float>(i % 50) * 0.5f);
      b[i] = enc(-static_cast<float>(i % 30) * 0.25f);
    }
    reduce_to(out.data(), a.data(), b.data(), a.size(), dt, ReduceOp::sum);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(out[i], enc(dec(a[i]) + dec(b[i]))) << i;
  }
}

// min and max do not depend on operand order: a NaN in either gives NaN (b < a ? b : a dropped it when it was the
// second operand), -0 and +0 give -0 for min and +0 for max; integers wrap without undefined behaviour. 37
// elements: the pattern repeats through the vectorized body (8 floats a step) and the scalar tail (4 reached only
// the tail).
TEST(Reduce, MinMaxAreSymmetricForNanAndSignedZerosAndIntegersWrap) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const size_t n = 37;
  for (bool in_place : {false, true})
    for (bool swap : {false, true}) {
      std::vector<float> a(n), b(n);
      for (size_t k = 0; k < n; ++k) {
        const float pa[] = {nan, 1.0f, -0.0f, 2.0f}, pb[] = {1.0f, nan, 0.0f, 2.0f};
        a[k] = pa[k % 4];
        b[k] = pb[k % 4];
      }
      if (swap) std::swap(a, b);
      for (ReduceOp op : {ReduceOp::min, ReduceOp::max}) {
        std::vector<float> x = a, y = b, out(n);
        float* o = in_place ? x.data() : out.data();
        reduce_to(o, x.data(), y.data(), n, DType::f32, op);
        for (size_t k = 0; k < n; ++k) {
          const std::string at = std::string(reduce_op_name(op)) + (in_place ? " in place" : "") +
                                 (swap ? " swapped" : "") + " at " + std::to_string(k);
          if (k % 4 < 2) {
            EXPECT_TRUE(std::isnan(o[k])) << at;
          }
          if (k % 4 == 2) {
            EXPECT_EQ(o[k], 0.0f) << at;
            EXPECT_EQ(std::signbit(o[k]), op == ReduceOp::min) << at;
          }
          if (k % 4 == 3) {
            EXPECT_EQ(o[k], 2.0f) << at;
          }
        }
      }
    }
  std::vector<double> d{-0.0}, e{0.0};
  reduce_into(e.data(), d.data(), 1, DType::f64, ReduceOp::min);
  EXPECT_TRUE(std::signbit(e[0]));
  std::vector<uint16_t> h{f32_to_f16(nan)}, g{f32_to_f16(3.0f)};
  reduce_into(g.data(), h.data(), 1, DType::f16, ReduceOp::max);
  EXPECT_TRUE(std::isnan(f16_to_f32(g[0])));
  std::vector<int32_t> i{INT32_MAX, INT32_MIN, 65536}, j{1, -1, 65536};
  reduce_into(i.data(), j.data(), 2, DType::i32, ReduceOp::sum);
  EXPECT_EQ(i[0], INT32_MIN);
  EXPECT_EQ(i[1], INT32_MAX);
  std::vector<int64_t> k{INT64_MAX}, l{2};
  reduce_into(k.data(), l.data(), 1, DType::i64, ReduceOp::prod);
  EXPECT_EQ(k[0], -2);
}

TEST(Reduce, InPlaceAliasingAndAverage) {
  std::vector<float> a{1, 2, 3, 4};
  reduce_to(a.data(), a.data(), a.data(), a.size(), DType::f32, ReduceOp::sum);
  EXPECT_EQ(a, (std::vector<float>{2, 4, 6, 8}));
  finalize_avg(a.data(), a.size(), DType::f32, 4);
  EXPECT_EQ(a, (std::vector<float>{0.5f, 1, 1.5f, 2}));
  std::vector<int32_t> i{7, -7, 9};
  finalize_avg(i.data(), i.size(), DType::i32, 2);
  EXPECT_EQ(i, (std::vector<int32_t>{3, -3, 4}));
  EXPECT_THROW(parse_reduce_op("mean2"), ConfigError);
}

// Operands at any byte offset (a payload in a byte ring, a view into a packed buffer) reduce as aligned ones do:
// every dtype, several staging blocks, out aliasing an input, and the average's division.
TEST(Reduce, UnalignedOperandsGiveTheAlignedResult) {
  for (DType dt : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    const size_t esz = dtype_size(dt), n = 3001;  // past 4 KiB for every size
    std::vector<unsigned char> a(n * esz), b(n * esz);
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = static_cast<unsigned char>((i * 7) % 61);  // small exponents: no NaN or Inf patterns
      b[i] = static_cast<unsigned char>((i * 13) % 59);
    }
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      std::vector<unsigned char> want(n * esz);
      reduce_to(want.data(), a.data(), b.data(), n, dt, op);
      for (size_t off : {size_t{1}, esz - 1}) {
        std::vector<unsigned char> ua(n * esz + off), ub(n * esz + off + 2), uo(n * esz + off + 1);
        std::memcpy(ua.data() + off, a.data(), a.size());
        std::memcpy(ub.data() + off + 2, b.data(), b.size());
        reduce_to(uo.data() + off + 1, ua.data() + off, ub.data() + off + 2, n, dt, op);
        EXPECT_EQ(std::memcmp(uo.data() + off + 1, want.data(), want.size()), 0) << dtype_name(dt) << off;
        reduce_into(ua.data() + off, ub.data() + off + 2, n, dt, op);  // in place
        EXPECT_EQ(std::memcmp(ua.data() + off, want.data(), want.size()), 0) << dtype_name(dt) << off;
        std::vector<unsigned char> avg = want;
        finalize_avg(avg.data(), n, dt, 3);
        finalize_avg(ua.data() + off, n, dt, 3);
        EXPECT_EQ(std::memcmp(ua.data() + off, avg.data(), avg.size()), 0) << dtype_name(dt) << off;
      }
    }
  }
}

TEST(Env, ParseBytesAcceptsSuffixesAndRejectsGarbage) {
  EXPECT_EQ(parse_bytes("4096", "x"), 4096u);
  EXPECT_EQ(parse_bytes("64K", "x"), 65536u);
  EXPECT_EQ(parse_bytes("4M", "x"), 4u << 20);
  EXPECT_EQ(parse_bytes("1.5G", "x"), 3ull << 29);
  EXPECT_EQ(parse_bytes("2MiB", "x"), 2u << 20);
  EXPECT_EQ(parse_bytes("1T", "x"), 1ull << 40);  // CONDUIT_MAX_MESSAGE_BYTES's documented top
  EXPECT_EQ(parse_bytes("0.5K", "x"), 512u);
  // Whole numbers exactly above 2^53 (a double rounded 2^53 + 1 to 2^53), up to the stated limit of 10^18.
  EXPECT_EQ(parse_bytes("9007199254740993", "x"), 9007199254740993ull);
  EXPECT_EQ(parse_bytes("1000000000000000000", "x"), 1000000000000000000ull);
  for (const char* big :
       {"1000000000000000001", "99999999999999999999999", "1000000T", "976562500000001K", "1000000000.5T"}) {
    try {
      parse_bytes(big, "--max-bytes");
      ADD_FAILURE() << big;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("more than 10^18 bytes"), std::string::npos) << big << ": " << e.what();
      // (the allowed maximum in a suffix parse_bytes takes: it said "about 888P", and P is not one)
      EXPECT_NE(std::string(e.what()).find("(about 909494T)"), std::string::npos) << e.what();
      EXPECT_EQ(parse_bytes("909494T", "x") <= 1000000000000000000ull, true);
    }
  }
  // A lowercase b reads as bits where bandwidths are written (cluster files): "64Mb" was 64 MiB here.
  EXPECT_EQ(parse_bytes("64MB", "x"), 64u << 20);
  EXPECT_EQ(parse_bytes("64mB", "x"), 64u << 20);
  for (const char* bits : {"64Mb", "8b", "1kb", "2Gb"}) {
    try {
      parse_bytes(bits, "--size");
      ADD_FAILURE() << bits;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ends in a lowercase b, which reads as bits"), std::string::npos)
          << e.what();
    }
  }
  // With the caller's range (as CONDUIT_TCP_UNEXPECTED_BYTES reads it), one "allowed" clause: an overflowing value
  // said "allowed: up to 10^18 (about 909494T); allowed: 0 to 1T".
  for (const char* v : {"99999999999999999999999", "64Mb", "abc"}) {
    try {
      parse_bytes(v, "CONDUIT_TCP_UNEXPECTED_BYTES", "0 to 1T");
      ADD_FAILURE() << v;
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find("allowed:"), m.rfind("allowed:")) << m;
      EXPECT_EQ(m.substr(m.size() - std::string("; allowed: 0 to 1T").size()), "; allowed: 0 to 1T") << m;
    }
  }
  try {
    parse_bytes("99999999999999999999999", "CONDUIT_TCP_UNEXPECTED_BYTES", "0 to 1T");
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "CONDUIT_TCP_UNEXPECTED_BYTES '99999999999999999999999' is more than 10^18 bytes; allowed: 0 to 1T");
  }
  for (const char* bad :
       {"", "-1", "4X", "abc", "1e30", "0x10", "1e3", "inf", ".5K", "1.2.3", "0.4", "0.1K", "1.", "1.K"}) {
    try {
      parse_bytes(bad, "--max-bytes");
      FAIL() << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--max-bytes"), std::string::npos);
    }
  }
  EXPECT_EQ(format_bytes(4 << 20), "4 MiB");
}

TEST(Env, TimeoutVariableIsValidated) {
  setenv("CONDUIT_TIMEOUT_TEST_VAR", "abc", 1);
  EXPECT_THROW(env_seconds("CONDUIT_TIMEOUT_TEST_VAR"), ConfigError);
  setenv("CONDUIT_TIMEOUT_TEST_VAR", "2.5", 1);
  EXPECT_EQ(*env_seconds("CONDUIT_TIMEOUT_TEST_VAR"), 2.5);
  setenv("CONDUIT_TIMEOUT_TEST_VAR", "1e2", 1);
  EXPECT_EQ(*env_seconds("CONDUIT_TIMEOUT_TEST_VAR"), 100);
  // Hex, spaces, infinity and timeouts too small to wait at all were taken (0x10 ran with 16 s).
  for (const char* bad : {"0x10", " 5", "+5", "inf", "nan", "1e-300", "0", "-1", "5s", "1e", "e5", "1e400"}) {
    setenv("CONDUIT_TIMEOUT_TEST_VAR", bad, 1);
    EXPECT_THROW(env_seconds("CONDUIT_TIMEOUT_TEST_VAR"), ConfigError) << bad;
  }
  for (const char* bad : {" 5", "+5", "5 ", "0x5", "-", ""}) {
    setenv("CONDUIT_INT_TEST_VAR", bad, 1);
    if (*bad)
      EXPECT_THROW(env_int("CONDUIT_INT_TEST_VAR", -10, 10), ConfigError) << bad;
    else
      EXPECT_FALSE(env_int("CONDUIT_INT_TEST_VAR", -10, 10).has_value());
  }
  setenv("CONDUIT_INT_TEST_VAR", "-7", 1);
  EXPECT_EQ(*env_int("CONDUIT_INT_TEST_VAR", -10, 10), -7);
  unsetenv("CONDUIT_INT_TEST_VAR");
  unsetenv("CONDUIT_TIMEOUT_TEST_VAR");
}

// Start-up waits the longer of the collectives' timeout and CONDUIT_TIMEOUT.
TEST(Env, StartUpWaitsTheLongerOfTheTimeoutAndConduitTimeout) {
  const char* was = std::getenv("CONDUIT_TIMEOUT");
  const std::string saved = was ? was : "";
  setenv("CONDUIT_TIMEOUT", "30", 1);
  EXPECT_EQ(startup_timeout_seconds(1), 30);
  EXPECT_EQ(startup_timeout_seconds(45), 45);
  EXPECT_EQ(startup_timeout_seconds(0), 30);
  unsetenv("CONDUIT_TIMEOUT");
  EXPECT_EQ(startup_timeout_seconds(2), 300);
  EXPECT_EQ(startup_timeout_seconds(600), 600);
  if (was) setenv("CONDUIT_TIMEOUT", saved.c_str(), 1);
}

namespace {
std::function<const char*(const char*)> fake_env(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

// Log levels in any case and spdlog's other names (INFO and warning were refused), and the error lists them.
TEST(Log, LevelNamesInAnyCase) {
  setenv("CONDUIT_LOG_LEVEL", "INFO", 1);
  EXPECT_EQ(log_level_from_env(), spdlog::level::info);
  setenv("CONDUIT_LOG_LEVEL", "Warning", 1);
  EXPECT_EQ(log_level_from_env(), spdlog::level::warn);
  setenv("CONDUIT_LOG_LEVEL", "loud", 1);
  try {
    log_level_from_env();
    ADD_FAILURE() << "loud accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("critical or off"), std::string::npos) << e.what();
  }
  // A library user's logger (no CLI to refuse the level first) warns and logs at warn: it threw at every log line,
  // and on a background thread that terminated the process.
  EXPECT_NO_THROW(logger().warn("a line with CONDUIT_LOG_LEVEL=loud"));
  EXPECT_EQ(logger().level(), spdlog::level::warn);
  unsetenv("CONDUIT_LOG_LEVEL");
}

// Two writers of one file (ranks, threads) each rename a whole text of their own into place: they shared
// "<path>.tmp", and one renamed the other's half-written file, or found it gone.
TEST(Files, ConcurrentWritersOfOneFileEachPutAWholeTextInPlace) {
  const std::string path = ::testing::TempDir() + "/conduit-files-" + std::to_string(::getpid()) + ".json";
  const std::string a(100000, 'a'), b(100000, 'b');
  std::atomic<int> errors{0};
  auto writer = [&](const std::string& text) {
    for (int i = 0; i < 200; ++i) {
      try {
        write_text_file(path, text);
      } catch (const std::exception&) {
        ++errors;
      }
    }
  };
  std::thread t1(writer, std::cref(a)), t2(writer, std::cref(b));
  t1.join();
  t2.join();
  EXPECT_EQ(errors.load(), 0);
  std::ifstream in(path);
  const std::string got((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(got == a || got == b) << got.size() << " bytes";
  std::remove(path.c_str());
}

namespace {
std::mutex g_fsync_mu;
std::vector<std::string> g_fsynced;  // what each fsync was of, by its descriptor's path at the time
}  // namespace

// fsync(2) of this test program, for every caller in it (conduit_core is linked in statically): records what it was
// of, then does it.
extern "C" int fsync(int fd) {
  char buf[4096];
  const ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf);
  {
    std::lock_guard<std::mutex> lock(g_fsync_mu);
    g_fsynced.emplace_back(n > 0 ? std::string(buf, size_t(n)) : std::string("?"));
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

// A whole file is on disk before it is renamed into place, and the rename after (found by an audit: it was renamed
// from the page cache, and a power loss could leave metrics.jsonl or checkpoint.json empty under their names).
TEST(Files, AWrittenFileAndItsRenameAreSyncedToDisk) {
  char templ[] = "/tmp/conduit-files-sync-XXXXXX";
  ASSERT_NE(::mkdtemp(templ), nullptr);
  char* real = ::realpath(templ, nullptr);  // (as /proc names the descriptors)
  ASSERT_NE(real, nullptr);
  const std::string dir = real, path = dir + "/metrics.jsonl";
  std::free(real);
  {
    std::lock_guard<std::mutex> lock(g_fsync_mu);
    g_fsynced.clear();
  }
  write_text_file(path, "{\"kind\": \"step\"}\n");
  std::vector<std::string> synced;
  {
    std::lock_guard<std::mutex> lock(g_fsync_mu);
    synced = g_fsynced;
  }
  // The temporary file under its own name (synced before the rename), then the directory holding the new name.
  ASSERT_EQ(synced.size(), 2u) << ::testing::PrintToString(synced);
  EXPECT_EQ(synced[0].rfind(path + ".tmp", 0), 0u) << synced[0];
  EXPECT_EQ(synced[1], dir);
  std::ifstream in(path);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()),
            "{\"kind\": \"step\"}\n");
  std::remove(path.c_str());
  ::rmdir(templ);
}

TEST(MallocTuning, LeavesTheUsersOwnMallocSettingsInCharge) {
  const std::vector<std::pair<std::map<std::string, std::string>, std::string>> cases = {
      {{{"CONDUIT_MALLOC_TUNING", "0"}}, "CONDUIT_MALLOC_TUNING=0"},
      {{{"CONDUIT_MALLOC_TUNING", "off"}}, "CONDUIT_MALLOC_TUNING=off"},
      {{{"CONDUIT_MALLOC_TUNING", "OFF"}}, "CONDUIT_MALLOC_TUNING=off"},  // any case, as env_flag
      {{{"GLIBC_TUNABLES", "glibc.pthread.rseq=0:glibc.malloc.arena_max=2"}}, "GLIBC_TUNABLES"},
      {{{"MALLOC_TRIM_THRESHOLD_", "0"}}, "MALLOC_TRIM_THRESHOLD_ is set"},
      {{{"MALLOC_MMAP_THRESHOLD_", "65536"}}, "MALLOC_MMAP_THRESHOLD_ is set"},
  };
  for (const auto& [env, why] : cases) {
    auto t = conduit::tune_malloc(fake_env(env));
    EXPECT_FALSE(t.applied) << why;
    EXPECT_NE(t.reason.find(why), std::string::npos) << t.reason;
  }
  // A value that is not a switch is named as given, in the words of every other switch (it said 'maybe' for Maybe).
  try {
    conduit::tune_malloc(fake_env({{"CONDUIT_MALLOC_TUNING", "Maybe"}}));
    ADD_FAILURE() << "CONDUIT_MALLOC_TUNING=Maybe was accepted";
  } catch (const conduit::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              "environment variable CONDUIT_MALLOC_TUNING='Maybe' is invalid: expected 1/0, true/false, yes/no or "
              "on/off");
  }
}

// An empty CONDUIT_MALLOC_TUNING is unset, as every other variable (it was "'' is not a switch").
TEST(MallocTuning, EmptyValueIsUnset) {
  const auto unset = conduit::tune_malloc(fake_env({}));
  conduit::MallocTuning empty;
  EXPECT_NO_THROW(empty = conduit::tune_malloc(fake_env({{"CONDUIT_MALLOC_TUNING", ""}})));
  EXPECT_EQ(empty.applied, unset.applied);
  EXPECT_EQ(empty.reason, unset.reason);
  EXPECT_TRUE(empty.applied) << empty.reason;  // (as without it: the default is on)
  // and one that is off is not applied (the comparison above can tell the two apart)
  EXPECT_FALSE(conduit::tune_malloc(fake_env({{"CONDUIT_MALLOC_TUNING", "0"}})).applied);
}

TEST(MallocTuning, KeepsStepSizedBlocksOnTheHeap) {
  // Tunables for other parts of glibc do not count as malloc settings.
  auto t = conduit::tune_malloc(fake_env({{"GLIBC_TUNABLES", "glibc.pthread.rseq=0"}}));
  ASSERT_TRUE(t.applied) << t.reason;
  EXPECT_EQ(t.mmap_threshold, 32L << 20);
  EXPECT_EQ(t.trim_threshold, 256L << 20);
  // A 14 MiB block (the CNN's largest im2col buffer) comes from the heap, not from its own mapping, and freeing
  // it keeps the memory for the next step instead of trimming it.
  const auto before = mallinfo2();
  void* p = std::malloc(size_t(14) << 20);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, size_t(14) << 20);
  const auto during = mallinfo2();
  EXPECT_EQ(during.hblks, before.hblks);
  EXPECT_GE(during.arena, before.arena + (size_t(14) << 20));
  std::free(p);
  const auto after = mallinfo2();
  EXPECT_GE(after.arena, before.arena + (size_t(14) << 20));
}

TEST(Clock, ADeadlineOfNoTimeOrNanHasExpiredAndAHugeOneIsNever) {
  EXPECT_TRUE(Deadline::after(0).expired());
  EXPECT_TRUE(Deadline::after(-3).expired());
  EXPECT_TRUE(Deadline::after(std::nan("")).expired());
  EXPECT_TRUE(Deadline::after(std::numeric_limits<double>::infinity()).is_never());
  EXPECT_FALSE(Deadline::after(60).expired());
  EXPECT_FALSE(Deadline::after(60).is_never());
}

TEST(Stats, MedianOfOddEvenEmptyAndNanSamples) {
  EXPECT_EQ(median({3, 1, 2}), 2);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(median({}), 0);
  EXPECT_TRUE(std::isnan(median({1, std::nan(""), 2})));
  EXPECT_TRUE(std::isnan(median({std::nan(""), 5})));
}

// Key-value lists: a bracketed value may hold commas, key_value brackets what holds one (and keeps a value already in
// one pair), and what it writes reads back the same; stray brackets are one line naming the item.
TEST(KeyValues, BracketedValuesHoldCommasAndRoundTrip) {
  auto bad = [](const std::string& kv) { return "bad '" + kv + "'"; };
  auto p = parse_key_values("a=[q:x=1,y=2],b=3", bad);
  EXPECT_EQ(p, (std::map<std::string, std::string>{{"a", "q:x=1,y=2"}, {"b", "3"}}));
  EXPECT_EQ(key_value("a", "q:x=1,y=2"), "a=[q:x=1,y=2]");
  EXPECT_EQ(key_value("a", "[q:x=1,y=2]"), "a=[q:x=1,y=2]");  // (one pair: kept)
  EXPECT_EQ(key_value("a", "[x],[y]"), "a=[[x],[y]]");        // (two pairs: bracketed again)
  EXPECT_EQ(key_value("b", "3"), "b=3");
  for (const std::string v : {"q:x=1,y=2", "[x],[y]", "plain"}) {
    const auto back = parse_key_values(key_value("k", v), bad);
    EXPECT_EQ(back.at("k"), v) << v;
  }
  for (const char* text : {"a=[q:x=1", "a=q]", "a=[q]x", "a=x[q]"}) {
    try {
      parse_key_values(text, bad);
      ADD_FAILURE() << text << " passed";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("bracket"), std::string::npos) << e.what();
    }
  }
}

namespace {
// A cost that is not a finite number of 0 or more, or costs summing past the largest double, are refused: the cut
// came back with empty runs ({inf, 1, 1} in 2 parts: 0, 3, 3), which the header promises it never does.
TEST(Partition, CostsThatAreNotFiniteAreRefused) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  for (const auto& costs :
       std::vector<std::vector<double>>{{inf, 1, 1}, {1, nan, 1}, {1, 1, -1}, {1e308, 1e308, 1}, {1, 1, inf}})
    EXPECT_THROW(conduit::partition_units(costs, 2), conduit::InvalidArgument);
  EXPECT_EQ(conduit::partition_units({0, 0, 0}, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(conduit::partition_units({1e307, 1e307, 1}, 2), (std::vector<int>{0, 1, 3}));
}
}  // namespace

namespace {
// A caller's context goes before the message and the error keeps its class (catch blocks for a timeout still match).
TEST(Errors, RethrowWithContextKeepsTheClass) {
  try {
    try {
      throw conduit::TimeoutError("recv from rank 1 timed out");
    } catch (const conduit::Error& e) {
      conduit::rethrow_with_context(e, "pipeline stage 0 of 2");
    }
  } catch (const conduit::TimeoutError& e) {
    EXPECT_STREQ(e.what(), "pipeline stage 0 of 2: recv from rank 1 timed out");
  }
  // Each class comes back as itself, exactly (a catch of Error matched every subclass: typeid tells them apart).
  auto same_class = [](const conduit::Error& e) {
    try {
      conduit::rethrow_with_context(e, "c");
    } catch (const conduit::Error& again) {
      return typeid(again) == typeid(e) && std::string(again.what()) == std::string("c: ") + e.what();
    }
  };
  EXPECT_TRUE(same_class(conduit::Error("x")));
  EXPECT_TRUE(same_class(conduit::ConfigError("x")));
  EXPECT_TRUE(same_class(conduit::InvalidArgument("x")));
  EXPECT_TRUE(same_class(conduit::TimeoutError("x")));
  EXPECT_TRUE(same_class(conduit::PeerError("x")));
  EXPECT_TRUE(same_class(conduit::ProtocolError("x")));
  EXPECT_TRUE(same_class(conduit::MismatchError("x")));
  EXPECT_TRUE(same_class(conduit::UnsupportedError("x")));
}
}  // namespace
