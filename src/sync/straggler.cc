#include "sync/straggler.h"

#include <fmt/format.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "core/env.h"
#include "core/error.h"

namespace conduit::sync {

std::map<int, Slowdown> parse_slow(const std::string& spec, int world) {
  std::map<int, Slowdown> out;
  if (spec.empty()) return out;
  size_t pos = 0;
  while (true) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    auto colon = item.find(':');
    auto at = item.find('@');
    const std::string who = colon == std::string::npos ? item : item.substr(0, colon);
    const std::string fac = colon == std::string::npos
                                ? ""
                                : item.substr(colon + 1, at == std::string::npos ? std::string::npos : at - colon - 1);
    const std::string prob = at == std::string::npos || at < colon ? "" : item.substr(at + 1);
    char* e1 = nullptr;
    char* e2 = nullptr;
    char* e3 = nullptr;
    errno = 0;
    long r = who == "*" ? kEveryRank : std::strtol(who.c_str(), &e1, 10);
    const bool too_big = errno == ERANGE || r > INT_MAX;  // (int(r) made 4294967295 the every-rank key, -1)
    double f = std::strtod(fac.c_str(), &e2);
    double p = at == std::string::npos ? 1.0 : std::strtod(prob.c_str(), &e3);
    // (decimal digits only, as the scheme parameters: strtol and strtod took " 1", "+1" and 0x10 for a factor 16)
    const bool digits = who == "*" || (!who.empty() && who.find_first_not_of("0123456789") == std::string::npos);
    if (colon == std::string::npos || !digits || (who != "*" && *e1 != '\0') || !is_decimal(fac) || *e2 != '\0' ||
        (at != std::string::npos && (at < colon || !is_decimal(prob) || *e3 != '\0')))
      throw ConfigError(fmt::format(
          "--slow: '{}' is not RANK:FACTOR[@PROBABILITY] with RANK a number or * (e.g. --slow 1:3, --slow 1:3,2:1.5 "
          "or --slow '*:3@0.25')",
          item));
    if (who != "*" && (too_big || r < 0 || (world > 0 && r >= world)))
      throw ConfigError(
          fmt::format("--slow: rank {} in '{}' is not in [0, {}) or *", r, item, world > 0 ? world : 1 << 30));
    if (!std::isfinite(f) || f < 1 || f > 1000)
      throw ConfigError(fmt::format("--slow: factor {} in '{}' must be in [1, 1000]", f, item));
    if (!std::isfinite(p) || p <= 0 || p > 1)
      throw ConfigError(fmt::format("--slow: probability {} in '{}' must be in (0, 1]", p, item));
    if (!out.emplace(int(r), Slowdown{f, p}).second)
      throw ConfigError(fmt::format("--slow: rank {} is given twice in '{}'", who, spec));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Straggler::Straggler(const std::map<int, Slowdown>& plan, int rank, uint64_t seed)
    : rng_(seed * 0x9E3779B97F4A7C15ull ^ (uint64_t(rank) + 1) * 0xC2B2AE3D27D4EB4Full) {
  auto it = plan.find(rank);
  if (it == plan.end()) it = plan.find(kEveryRank);
  if (it != plan.end()) s_ = it->second;
}

namespace {
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void Straggler::skip(int64_t steps) {
  if (s_.factor <= 1) return;  // begin() draws nothing then
  for (int64_t i = 0; i < steps; ++i) std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

void Straggler::begin() {
  slowed_ = false;
  if (s_.factor <= 1) return;
  // One draw per step, also for a persistent straggler, so a rank's sequence depends on the seed only.
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  slowed_ = u < s_.probability;
  if (!slowed_) return;
  ++slowed_steps_;
  cpu0_ = thread_cpu_seconds();
  wall0_ = wall_seconds();
}

double Straggler::end() {
  if (!slowed_) return 0;
  const double cpu = std::max(0.0, thread_cpu_seconds() - cpu0_);
  const double s = std::max(0.0, s_.factor * cpu - (wall_seconds() - wall0_));
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
  slept_ += s;
  return s;
}

}  // namespace conduit::sync
