// The kernels compiled for AVX2 + FMA (see kernels.inc; chosen at run time by kernels.cc).
#define CONDUIT_KERNEL_NS avx2
#include "compress/kernels.inc"
