#pragma once
// Fixed glibc malloc thresholds for training processes.
//
// glibc adapts its mmap threshold to the largest mapped block freed so far (128 KiB at start, at most 32 MiB) and
// trims the heap top beyond twice that. A process whose allocation history left them below what a training step
// allocates and frees at once gives that memory back to the kernel and faults it in again on every step: measured
// here, the CNN's step under `conduit launch -n 2 -- conduit bench gemm --model mlp,cnn` then took 105-114 ms
// instead of 20-23 ms, in 4 of 9 runs, in whichever process the earlier kernel timings left that way. Fixing the
// mmap threshold alone still slowed 4 of 6 runs (the trim threshold then stays at 128 KiB); fixing the trim
// threshold alone made every run 280 ms a step (every block above 128 KiB mapped). Both fixed, mmap 32 MiB and trim
// 256 MiB: 0 of 8 runs slowed. jemalloc and tcmalloc, which PyTorch recommends for CPU training, avoid the same
// cost their own way.
#include <functional>
#include <string>

namespace conduit {

struct MallocTuning {
  bool applied = false;  // false: the user's own GLIBC_TUNABLES / MALLOC_*_ settings were left in charge
  long mmap_threshold = 0, trim_threshold = 0;
  std::string reason;  // why not applied
};

inline constexpr long kMallocMmapThreshold = 32L << 20;
inline constexpr long kMallocTrimThreshold = 256L << 20;

// Applies the fixed thresholds unless the environment already sets malloc parameters (glibc.malloc.* in
// GLIBC_TUNABLES, MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_), or
// CONDUIT_MALLOC_TUNING is off (0, false, no, off; any other value but 1, true, yes, on is a ConfigError). `getenv`
// is the lookup (tests pass their own).
MallocTuning tune_malloc(const std::function<const char*(const char*)>& getenv);
MallocTuning tune_malloc();  // with the process environment

}  // namespace conduit
