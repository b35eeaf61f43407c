#include "core/partition.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace conduit {

std::vector<int> partition_units(const std::vector<double>& costs, int parts) {
  const int n = int(costs.size());
  if (parts < 1 || parts > n)
    throw InvalidArgument(fmt::format("partition_units: {} parts of {} units; allowed: 1 to {}", parts, n, n));
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    // (a cost or sum past the largest double compared with nothing: the runs came back empty)
    if (!(costs[size_t(i)] >= 0) || !std::isfinite(costs[size_t(i)]))
      throw InvalidArgument(
          fmt::format("partition_units: unit {} costs {}; allowed: a finite cost of 0 or more", i, costs[size_t(i)]));
    prefix[size_t(i) + 1] = prefix[size_t(i)] + costs[size_t(i)];
  }
  if (!std::isfinite(prefix[size_t(n)]))
    throw InvalidArgument(
        fmt::format("partition_units: the {} units' costs sum past the largest double; allowed: a "
                    "finite sum",
                    n));
  // best[p][i]: the least largest sum cutting units [i, n) into p runs; end[p][i]: where its first run ends.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(parts) + 1, std::vector<double>(size_t(n) + 1, inf));
  std::vector<std::vector<int>> end(size_t(parts) + 1, std::vector<int>(size_t(n) + 1, n));
  best[0][size_t(n)] = 0;
  for (int p = 1; p <= parts; ++p)
    for (int i = n - p; i >= 0; --i)
      for (int e = i + 1; e <= n - (p - 1); ++e) {
        const double v = std::max(prefix[size_t(e)] - prefix[size_t(i)], best[size_t(p) - 1][size_t(e)]);
        if (v < best[size_t(p)][size_t(i)]) {  // (strictly: of equals, the earliest end)
          best[size_t(p)][size_t(i)] = v;
          end[size_t(p)][size_t(i)] = e;
        }
      }
  std::vector<int> bounds{0};
  for (int p = parts; p >= 1; --p) bounds.push_back(end[size_t(p)][size_t(bounds.back())]);
  return bounds;
}

}  // namespace conduit
