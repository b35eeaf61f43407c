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
// Counter-based 32-bit uniform for element i (murmur3's finaliser; vectorizes with 32-bit multiplies).
inline uint32_t hash32(uint32_t key_lo, uint32_t key_hi, uint32_t i) {
  uint32_t x = i * 0x9E3779B1u + key_lo;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= key_hi;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
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
void check_out(const std::string& who, size_t got, size_t want);

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
