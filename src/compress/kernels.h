#pragma once
// Element-wise kernels of the quantizers and sign methods (kernels.inc), compiled for AVX2+FMA+AES-NI, for that with
// VAES, and for the baseline; kernels::get() returns the table for this CPU (chosen once).
#include <cstddef>
#include <cstdint>
#include <vector>

namespace conduit::compress::kernels {

#define CONDUIT_KERNEL_DECLS                                                                                           \
  float abs_max(const float* x, size_t n);                                                                             \
  void min_max(const float* x, size_t n, float& lo, float& hi);                                                        \
  double sum_squares(const float* x, size_t n);                                                                        \
  double sum(const float* x, size_t n);                                                                                \
  void sign_stats(const float* x, const float* g, float* p, size_t n, bool split, double& a, double& b, size_t& pos_n, \
                  uint8_t* signs);                                                                                     \
  void quant_i8(const float* x, size_t n, float inv, int8_t* q);                                                       \
  void quant_u8(const float* x, size_t n, float lo, float inv, uint8_t* q);                                            \
  void dequant_i8(const int8_t* q, size_t n, float scale, float* out, bool add);                                       \
  void dequant_u8(const uint8_t* q, size_t n, float lo, float scale, float* out, bool add);                            \
  void pack_signs(const float* x, size_t n, uint8_t* out);                                                             \
  void unpack_signs(const uint8_t* in, size_t n, float pos, float neg, float* out, bool add);                          \
  void qsgd_codes(const float* x, size_t n, float scale, uint32_t smax, uint32_t base, uint32_t k_lo, uint32_t k_hi,   \
                  uint16_t* codes);                                                                                    \
  void qsgd_pack(const float* x, size_t n, float scale, uint32_t smax, int bits, uint32_t base, uint32_t k_lo,         \
                 uint32_t k_hi, uint8_t* out);                                                                         \
  void qsgd_unpack(const uint8_t* in, size_t n, int bits, float unit, float* out, bool add);                           \
  void tern_codes(const float* x, size_t n, float lo, float hi, float inv, uint32_t base, uint32_t k_lo,               \
                  uint32_t k_hi, uint8_t* out);                                                                        \
  void tern_decode(const uint8_t* in, size_t n, float s, float* out, bool add);                                        \
  void natural_encode(const float* x, size_t n, uint32_t base, uint32_t k_lo, uint32_t k_hi, uint8_t* signs,           \
                      uint8_t* exps);                                                                                  \
  void natural_decode(const uint8_t* signs, const uint8_t* exps, size_t n, float* out, bool add);                      \
  void add_to(float* acc, const float* x, size_t n);                                                                   \
  void sub_from(float* acc, const float* x, size_t n);                                                                 \
  void quant_i8_chunks(const float* x, size_t n, size_t chunk, float* scales, int8_t* q);                              \
  void dequant_i8_chunks(const int8_t* q, size_t n, size_t chunk, const float* scales, float* out, bool add);          \
  void quant_u8_chunks(const float* x, size_t n, size_t chunk, float* header, uint8_t* q);                             \
  void dequant_u8_chunks(const uint8_t* q, size_t n, size_t chunk, const float* header, float* out, bool add);         \
  void momentum_signs(float* m, const float* g, size_t n, float beta, uint8_t* out);                                   \
  void sign_feedback(float* e, const float* g, size_t n, bool split, bool corr, float cpos, float cneg, double& a,     \
                     double& b, size_t& pos_n, uint8_t* signs);

namespace avx2 {
CONDUIT_KERNEL_DECLS
}
namespace avx2_vaes {
CONDUIT_KERNEL_DECLS
}
namespace base {
CONDUIT_KERNEL_DECLS
}

struct Table {
  const char* name;
  float (*abs_max)(const float*, size_t);
  void (*min_max)(const float*, size_t, float&, float&);
  double (*sum_squares)(const float*, size_t);
  double (*sum)(const float*, size_t);
  // Sign bits of p (ceil(n/8) bytes) and, split false: a = sum |p|; split true: a = sum of p >= 0, b = sum of p < 0,
  // pos_n = count of p >= 0. p = x, or with g given p = x + g, stored to p (which may be x) unless p is null.
  void (*sign_stats)(const float*, const float*, float*, size_t, bool, double&, double&, size_t&, uint8_t*);
  void (*quant_i8)(const float*, size_t, float, int8_t*);
  void (*quant_u8)(const float*, size_t, float, float, uint8_t*);
  void (*dequant_i8)(const int8_t*, size_t, float, float*, bool);
  void (*dequant_u8)(const uint8_t*, size_t, float, float, float*, bool);
  void (*pack_signs)(const float*, size_t, uint8_t*);
  void (*unpack_signs)(const uint8_t*, size_t, float, float, float*, bool);
  void (*qsgd_codes)(const float*, size_t, float, uint32_t, uint32_t, uint32_t, uint32_t, uint16_t*);
  // QSGD codes packed at bits = 2, 4 or 8 from bit 0 of out (ceil(n*bits/8) bytes), and their decoder.
  void (*qsgd_pack)(const float*, size_t, float, uint32_t, int, uint32_t, uint32_t, uint32_t, uint8_t*);
  void (*qsgd_unpack)(const uint8_t*, size_t, int, float, float*, bool);
  void (*tern_codes)(const float*, size_t, float, float, float, uint32_t, uint32_t, uint32_t, uint8_t*);
  void (*tern_decode)(const uint8_t*, size_t, float, float*, bool);
  void (*natural_encode)(const float*, size_t, uint32_t, uint32_t, uint32_t, uint8_t*, uint8_t*);  // signs, exponents
  void (*natural_decode)(const uint8_t*, const uint8_t*, size_t, float*, bool);
  void (*add_to)(float*, const float*, size_t);
  void (*sub_from)(float*, const float*, size_t);
  void (*quant_i8_chunks)(const float*, size_t, size_t, float*, int8_t*);
  void (*dequant_i8_chunks)(const int8_t*, size_t, size_t, const float*, float*, bool);
  void (*quant_u8_chunks)(const float*, size_t, size_t, float*, uint8_t*);
  void (*dequant_u8_chunks)(const uint8_t*, size_t, size_t, const float*, float*, bool);
  void (*momentum_signs)(float*, const float*, size_t, float, uint8_t*);
  // Error feedback's pass for the sign methods: e = p = (e + (corr ? (e's sign bit ? cneg : cpos) : 0)) + g, with
  // p's sums and sign bits as sign_stats(e, g, e, ...) gives them.
  void (*sign_feedback)(float*, const float*, size_t, bool, bool, float, float, double&, double&, size_t&, uint8_t*);
};

const Table& get();
const Table& base_table();  // the baseline kernels (tests compare them with get()'s)
// Every table this CPU can run, the baseline first (tests compare them all).
std::vector<const Table*> available();

}  // namespace conduit::compress::kernels
