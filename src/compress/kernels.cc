// Picks the kernel table for this CPU once.
#include "compress/kernels.h"

#include <cstdlib>
#include <cstring>

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

bool use_avx2() {
#if defined(__x86_64__) && defined(CONDUIT_COMPRESS_AVX2)
  const char* force = std::getenv("CONDUIT_COMPRESS_KERNELS");  // "base" forces the baseline (tests, comparisons)
  if (force && std::strcmp(force, "base") == 0) return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("aes");
#else
  return false;
#endif
}
}  // namespace

const Table& base_table() {
  static const Table t = CONDUIT_TABLE(base);
  return t;
}

const Table& get() {
  static const Table t = use_avx2() ? CONDUIT_TABLE(avx2) : base_table();
  return t;
}

}  // namespace conduit::compress::kernels
