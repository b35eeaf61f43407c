#pragma once
// Small statistics over samples, shared by the benchmarks and the calibration.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace conduit {

// The median of `v` (the mean of the two middle values for an even count); 0 for no samples, NaN if any sample is
// NaN (sorting NaN is undefined: the result depended on where it sat).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  if (std::any_of(v.begin(), v.end(), [](double x) { return std::isnan(x); }))
    return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

}  // namespace conduit
