// The kernels for the baseline x86-64 (SSE2) or any other CPU (see kernels.inc).
#define CONDUIT_KERNEL_NS base
#include "compress/kernels.inc"
