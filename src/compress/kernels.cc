// Picks the kernel table for this CPU once.
#include "compress/kernels.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace conduit::compress::kernels {

namespace {
#define CONDUIT_TABLE(ns)                                                                                     \
  Table {                                                                                                     \
#ns, ns::abs_max, ns::min_max, ns::sum_squares, ns::sum, ns::sign_stats, ns::quant_i8, ns::quant_u8,      \
        ns::dequant_i8, ns::dequant_u8, ns::pack_signs, ns::unpack_signs, ns::qsgd_codes, ns::qsgd_pack,      \
        ns::qsgd_unpack, ns::tern_codes, ns::tern_decode, ns::natural_encode, ns::natural_decode, ns::add_to, \
        ns::sub_from, ns::quant_i8_chunks, ns::dequant_i8_chunks, ns::quant_u8_chunks, ns::dequant_u8_chunks, \
        ns::momentum_signs, ns::sign_feedback                                                                 \
  }

// "base" or "avx2" in CONDUIT_COMPRESS_KERNELS caps the choice (tests, comparisons).
const char* forced() {
  static const char* f = [] {
    const char* v = std::getenv("CONDUIT_COMPRESS_KERNELS");
    if (v && *v && std::strcmp(v, "base") != 0 && std::strcmp(v, "avx2") != 0)
      throw ConfigError(
          fmt::format("environment variable CONDUIT_COMPRESS_KERNELS='{}' is invalid: expected base or "
                      "avx2 (or unset: the fastest this CPU runs)",
                      v));
    return v ? v : "";
  }();
  return f;
}
bool has_avx2() {
#if defined(__x86_64__) && defined(CONDUIT_COMPRESS_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("aes");
#else
  return false;
#endif
}
bool has_vaes() {
#if defined(__x86_64__) && defined(CONDUIT_COMPRESS_AVX2)
  return has_avx2() && __builtin_cpu_supports("vaes");
#else
  return false;
#endif
}
}  // namespace

const Table& base_table() {
  static const Table t = CONDUIT_TABLE(base);
  return t;
}

std::vector<const Table*> available() {
  static const Table avx2_t = CONDUIT_TABLE(avx2), vaes_t = CONDUIT_TABLE(avx2_vaes);
  std::vector<const Table*> v{&base_table()};
  if (has_avx2()) v.push_back(&avx2_t);
  if (has_vaes()) v.push_back(&vaes_t);
  return v;
}

const Table& get() {
  static const Table* t = [] {
    auto v = available();
    if (std::strcmp(forced(), "base") == 0) return v[0];
    if (std::strcmp(forced(), "avx2") == 0) {
      // Asked for by name on a CPU (or build) without it: say so rather than run (and report) other kernels.
      if (v.size() < 2)
        throw ConfigError(
            "environment variable CONDUIT_COMPRESS_KERNELS=avx2, but this CPU (or build) has no AVX2, FMA and AES; "
            "allowed here: base (or unset)");
      return v[1];
    }
    return v.back();
  }();
  return *t;
}

}  // namespace conduit::compress::kernels
