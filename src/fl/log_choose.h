#pragma once
// ln C(n, k) for the privacy accountant (fl/privacy.cc) and SecAgg+'s bounds (fl/secagg.cc), one definition.
#include <math.h>

#include <cstdint>

namespace conduit::fl {

// ln Γ(x) through lgamma_r: std::lgamma writes the global signgam, a data race between the threads that run
// clients, servers and tests at once.
inline double log_gamma(double x) {
  int sign = 0;
  return lgamma_r(x, &sign);
}

// ln C(n, k) for 0 <= k <= n.
inline double log_choose(int64_t n, int64_t k) {
  return log_gamma(double(n) + 1) - log_gamma(double(k) + 1) - log_gamma(double(n - k) + 1);
}

}  // namespace conduit::fl
