// The kernels compiled for AVX2 + FMA + VAES (see kernels.inc; chosen at run time by kernels.cc): the same code as
// kernels_avx2.cc but for the random blocks, whose AES rounds run on both 128-bit halves of a ymm register at once.
#define CONDUIT_KERNEL_NS avx2_vaes
#include "compress/kernels.inc"
