// Reduction kernels against memcpy on the same buffers: a sum-into reads two buffers and writes one (3 streams),
// memcpy reads one and writes one (2 streams), so "near memory bandwidth" means bytes moved / time close to
// memcpy's. Rates per second of wall time (UseRealTime: per CPU-second they read high on a shared machine, 25.3 for
// 15.8 GB/s). Run: build/bench/bench_reduce_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/reduce.h"

using namespace conduit;

static void BM_Memcpy(benchmark::State& st) {
  size_t bytes = static_cast<size_t>(st.range(0));
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : st) {
    std::memcpy(a.data(), b.data(), bytes);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s moved"] = benchmark::Counter(2.0 * bytes, benchmark::Counter::kIsIterationInvariantRate);
}

static void BM_SumInto(benchmark::State& st, DType dt) {
  size_t bytes = static_cast<size_t>(st.range(0));
  size_t n = bytes / dtype_size(dt);
  std::vector<char> a(bytes, 0), b(bytes, 0);
  for (auto _ : st) {
    reduce_into(a.data(), b.data(), n, dt, ReduceOp::sum);
    benchmark::ClobberMemory();
  }
  st.counters["GB/s moved"] = benchmark::Counter(3.0 * bytes, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();
BENCHMARK_CAPTURE(BM_SumInto, f32, DType::f32)->Arg(1 << 20)->Arg(64 << 20)->UseRealTime();
BENCHMARK_CAPTURE(BM_SumInto, f64, DType::f64)->Arg(64 << 20)->UseRealTime();
BENCHMARK_CAPTURE(BM_SumInto, f16, DType::f16)->Arg(64 << 20)->UseRealTime();
BENCHMARK_CAPTURE(BM_SumInto, bf16, DType::bf16)->Arg(64 << 20)->UseRealTime();
BENCHMARK_CAPTURE(BM_SumInto, i32, DType::i32)->Arg(64 << 20)->UseRealTime();

BENCHMARK_MAIN();
