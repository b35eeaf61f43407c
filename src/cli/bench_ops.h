#pragma once
// The operations `conduit bench coll --op` times; `conduit sweep` checks a bench cell's op against the same list
// before the first cell runs.
#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "coll/tuner.h"

namespace conduit::cli {

inline constexpr std::array<std::string_view, 8> kBenchCollOps = {
    "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall", "gather", "scatter"};

inline bool is_bench_coll_op(std::string_view op) {
  return std::find(kBenchCollOps.begin(), kBenchCollOps.end(), op) != kBenchCollOps.end();
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
