#pragma once
// The operations `conduit bench coll --op` times; `conduit sweep` checks a bench cell's op against the same list
// before the first cell runs.
#include <algorithm>
#include <array>
#include <string>
#include <string_view>

namespace conduit::cli {

inline constexpr std::array<std::string_view, 8> kBenchCollOps = {
    "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "gather", "scatter"};

inline bool is_bench_coll_op(std::string_view op) {
  return std::find(kBenchCollOps.begin(), kBenchCollOps.end(), op) != kBenchCollOps.end();
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
