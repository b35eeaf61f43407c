#pragma once
// Internals shared by the compressor files: parameter parsing, counter-based random numbers, bit packing.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "compress/compressor.h"

// Marks the hot loops. (target_clones was tried: its ifunc dispatch went through the dynamic linker's symbol lookup
// on every call and cost more than the wider vectors gained; the loops are written to vectorize at -O3.)
#define CONDUIT_HOT

namespace conduit::compress::detail {

// Parameters of one compressor: the defaults it accepts, and typed getters with range checks that name the field.
class ParamReader {
 public:
  ParamReader(std::string compressor, const Params& defaults, const Params& given);
  double real(const std::string& key, double lo, double hi) const;
  int64_t integer(const std::string& key, int64_t lo, int64_t hi) const;
  bool boolean(const std::string& key) const;
  const std::string& text(const std::string& key) const;

 private:
  std::string name_;
  Params values_;
};

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// A 64-bit key for one call: every (seed, stream, step, salt) gives an independent stream of uniform numbers.
inline uint64_t call_key(uint64_t seed, uint64_t stream, uint64_t step, uint64_t salt) {
  return splitmix64(splitmix64(splitmix64(seed ^ salt) ^ stream) + step);
}
// The stochastic quantizers' random stream (kernels.inc computes the same numbers with AES-NI, and with the functions
// below on the baseline). Random block B (the 16 elements e with e >> 4 == B) is two 128-bit blocks
// o_j = R(R(R(in_j, K1), K2), K1), j = 0, 1, where in_j holds the 32-bit words (B, j, key_lo, key_hi) and R is one
// AES encryption round as x86's AESENC does it (ShiftRows, SubBytes, MixColumns, then XOR of the round key). The
// words of o_0 then o_1 are lanes 0-7; element e takes the low (e & 8 == 0) or high 16 bits of lane e & 7.
// Three rounds: with two, a chi-square test of pairs of draws 16 elements apart (adjacent blocks) failed by far.
constexpr uint32_t kAesKey1[4] = {0x9E3779B1u, 0x85EBCA6Bu, 0xC2B2AE35u, 0x27D4EB2Fu};
constexpr uint32_t kAesKey2[4] = {0x165667B1u, 0xD3A2646Cu, 0xFD7046C5u, 0xB55A4F09u};
// AESENC's SubBytes and MixColumns as one table (the classic T-table): the column that input byte x (row 0)
// contributes, as a little-endian word (2 S(x), S(x), S(x), 3 S(x)); rows 1-3 contribute it rotated by 8, 16, 24.
struct AesTable {
  uint32_t t[256] = {};
  static constexpr uint8_t mul(uint8_t a, uint8_t b) {  // in GF(2^8) mod x^8 + x^4 + x^3 + x + 1
    uint8_t r = 0;
    for (; b; b >>= 1, a = static_cast<uint8_t>((a << 1) ^ ((a >> 7) * 0x1b)))
      if (b & 1) r ^= a;
    return r;
  }
  constexpr AesTable() {
    for (int x = 0; x < 256; ++x) {
      uint8_t inv = 1, p = static_cast<uint8_t>(x);  // x^254 = x^-1 (0 for 0)
      for (int e = 254; e; e >>= 1, p = mul(p, p))
        if (e & 1) inv = mul(inv, p);
      if (x == 0) inv = 0;
      uint8_t sb = 0x63;  // the S-box: affine map of the inverse
      for (int k = 0; k < 5; ++k) sb ^= static_cast<uint8_t>((inv << k) | (inv >> ((8 - k) & 7)));
      t[x] = static_cast<uint32_t>(mul(sb, 2)) | static_cast<uint32_t>(sb) << 8 | static_cast<uint32_t>(sb) << 16 |
             static_cast<uint32_t>(mul(sb, 3)) << 24;
    }
  }
};
inline constexpr AesTable kAesTable{};
static_assert(((kAesTable.t[0] >> 8) & 0xff) == 0x63 && ((kAesTable.t[1] >> 8) & 0xff) == 0x7c &&
                  ((kAesTable.t[0x53] >> 8) & 0xff) == 0xed,
              "AES S-box");
// One AESENC round on the state w (column c = word c, row r = byte r, little-endian), round key rk.
inline void aes_round(uint32_t w[4], const uint32_t rk[4]) {
  auto rotl = [](uint32_t v, int k) { return (v << k) | (v >> (32 - k)); };
  uint32_t o[4];
  for (int c = 0; c < 4; ++c)  // ShiftRows: row r of column c comes from column c + r
    o[c] = kAesTable.t[w[c] & 0xff] ^ rotl(kAesTable.t[(w[(c + 1) & 3] >> 8) & 0xff], 8) ^
           rotl(kAesTable.t[(w[(c + 2) & 3] >> 16) & 0xff], 16) ^ rotl(kAesTable.t[w[(c + 3) & 3] >> 24], 24) ^ rk[c];
  for (int c = 0; c < 4; ++c) w[c] = o[c];
}
// The 8 lanes of random block B.
inline void random_block(uint32_t key_lo, uint32_t key_hi, uint32_t block, uint32_t out[8]) {
  for (uint32_t j = 0; j < 2; ++j) {
    uint32_t* w = out + 4 * j;
    w[0] = block, w[1] = j, w[2] = key_lo, w[3] = key_hi;
    aes_round(w, kAesKey1);
    aes_round(w, kAesKey2);
    aes_round(w, kAesKey1);
  }
}
// The 16-bit uniform of element e.
inline uint32_t draw16(uint32_t key_lo, uint32_t key_hi, uint32_t e) {
  uint32_t lanes[8];
  random_block(key_lo, key_hi, e >> 4, lanes);
  return (lanes[e & 7] >> ((e & 8) << 1)) & 0xffffu;
}
// Uniform in [0, 1) with 24 bits.
inline float u01(uint32_t h) { return static_cast<float>(h >> 8) * (1.0f / 16777216.0f); }

// A small sequential generator (xoshiro256**) for samples, indices and Gaussian initialisation.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& w : s_) w = seed = splitmix64(seed);
  }
  uint64_t next() {
    uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }
  uint64_t below(uint64_t n) { return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64); }
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

inline void put_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
inline float get_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Checks that a payload has the size the configuration implies (InvalidArgument otherwise).
void check_payload(const std::string& who, size_t got, size_t want);
// Checks that the `count` f32 scales at `p` are finite (no encoder writes another: a NaN scale decoded a whole chunk
// as NaN without a word), and with a `magnitude_stride`, that those at magnitude_first, + stride, ... are not
// negative: magnitudes an encoder wrote (max|x|, a norm, a range; a negative one flipped the signs it decoded).
void check_scales(const std::string& who, const uint8_t* p, size_t count, size_t magnitude_stride = 0,
                  size_t magnitude_first = 0);
void check_out(const std::string& who, size_t got, size_t want);
// Tensors of at most 2^32 - 1 elements: u32 indices (the sparsifiers), or element numbers of the random stream, which
// would repeat its draws past them (qsgd, terngrad, natural). InvalidArgument naming `what` otherwise.
void check_u32_elements(const std::string& who, size_t d, const char* what);
// The first of the n codes (bits wide, least significant first, as pack_codes writes them) above max_code, or n
// when none is: a payload's codes that no encoder writes. Codes past n in the last byte are not looked at. Codes
// of 2, 4 or 8 bits are compared 64 bits at a time.
size_t first_code_above(const uint8_t* in, size_t n, int bits, uint32_t max_code);

// Packs bits-wide codes (bits <= 16), least significant first, into ceil(n*bits/8) bytes.
void pack_codes(const uint16_t* codes, size_t n, int bits, uint8_t* out);
void unpack_codes(const uint8_t* in, size_t n, int bits, uint16_t* codes);

// Sign bits: bit i is x[i]'s sign bit (set for negatives and -0); ceil(n/8) bytes.
void pack_signs(const float* x, size_t n, uint8_t* out);
// out[i] = bit ? -neg_val... : pos_val (the two reconstruction values).
void unpack_signs(const uint8_t* in, size_t n, float pos, float neg, float* out);

// Exact top-k by magnitude (indices in ascending order) with a sampled threshold estimate; see sparse.cc.
void topk_select(std::span<const float> x, size_t k, double sample_fraction, uint64_t sample_seed,
                 std::vector<uint32_t>& idx);

}  // namespace conduit::compress::detail
