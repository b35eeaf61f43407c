#pragma once
// The operations `conduit bench coll --op` times; `conduit sweep` checks a bench cell's op against the same list
// before the first cell runs.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "coll/tuner.h"
#include "core/cpus.h"
#include "core/error.h"

namespace conduit::cli {

// Each rank of `bench coll` holds an input and an output of up to world x the largest size (gather-like ops) plus
// the check's copies: refuses a largest size whose `ranks` processes on this machine would not fit in a quarter of
// the memory a process may use each (the cgroup's limit too), instead of failing on an allocation halfway through.
// `what` names the size as given ("--max-bytes 5G").
inline void check_bench_coll_memory(uint64_t max_bytes, long long ranks, const std::string& what) {
  const double mem = usable_memory_bytes();
  if (mem > 0 && 4.0 * static_cast<double>(max_bytes) * static_cast<double>(ranks) > mem)
    throw ConfigError(
        fmt::format("{} needs about {:.1f} GB per rank, {} ranks on this host; a process here may use "
                    "{:.1f} GB (allowed: at most a quarter of it per rank)",
                    what, 4e-9 * static_cast<double>(max_bytes), ranks, mem * 1e-9));
}

inline constexpr std::array<std::string_view, 8> kBenchCollOps = {
    "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "gather", "scatter"};

inline bool is_bench_coll_op(std::string_view op) {
  return std::find(kBenchCollOps.begin(), kBenchCollOps.end(), op) != kBenchCollOps.end();
}

// The operations --reduce and --root apply to (bench coll and sweeps refuse them elsewhere).
inline bool bench_coll_op_reduces(std::string_view op) {
  return op == "allreduce" || op == "reduce_scatter" || op == "reduce";
}
inline bool bench_coll_op_rooted(std::string_view op) {
  return op == "broadcast" || op == "reduce" || op == "gather" || op == "scatter";
}

// The tuner's operation of a `bench coll --op` name, for --algo: empty for the ops without algorithms to choose.
inline std::optional<coll::CollOp> tunable_coll_op(std::string_view op) {
  if (op == "allreduce") return coll::CollOp::allreduce;
  if (op == "reduce_scatter") return coll::CollOp::reduce_scatter;
  if (op == "allgather") return coll::CollOp::allgather;
  if (op == "broadcast") return coll::CollOp::broadcast;
  if (op == "reduce") return coll::CollOp::reduce;
  return std::nullopt;
}

// "allreduce, reduce_scatter, ..." for error messages.
inline std::string bench_coll_ops_list() {
  std::string s;
  for (auto op : kBenchCollOps) {
    if (!s.empty()) s += ", ";
    s += op;
  }
  return s;
}

}  // namespace conduit::cli
