#include "sync/straggler.h"

#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "core/error.h"

namespace conduit::sync {

std::map<int, double> parse_slow(const std::string& spec, int world) {
  std::map<int, double> out;
  if (spec.empty()) return out;
  size_t pos = 0;
  while (true) {
    size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    auto colon = item.find(':');
    char* e1 = nullptr;
    char* e2 = nullptr;
    long r = colon == std::string::npos ? -1 : std::strtol(item.c_str(), &e1, 10);
    double f = colon == std::string::npos ? 0 : std::strtod(item.c_str() + colon + 1, &e2);
    if (colon == std::string::npos || colon == 0 || e1 != item.c_str() + colon || *e2 != '\0' ||
        colon + 1 == item.size())
      throw ConfigError(fmt::format("--slow: '{}' is not RANK:FACTOR (e.g. --slow 1:3 or --slow 1:3,2:1.5)", item));
    if (r < 0 || (world > 0 && r >= world))
      throw ConfigError(fmt::format("--slow: rank {} in '{}' is not in [0, {})", r, item, world > 0 ? world : 1 << 30));
    if (!std::isfinite(f) || f < 1 || f > 1000)
      throw ConfigError(fmt::format("--slow: factor {} in '{}' must be in [1, 1000]", f, item));
    if (!out.emplace(int(r), f).second)
      throw ConfigError(fmt::format("--slow: rank {} is given twice in '{}'", r, spec));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

Straggler::Straggler(const std::map<int, double>& factors, int rank) {
  auto it = factors.find(rank);
  if (it != factors.end()) factor_ = it->second;
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

void Straggler::begin() {
  if (factor_ <= 1) return;
  cpu0_ = thread_cpu_seconds();
  wall0_ = wall_seconds();
}

double Straggler::end() {
  if (factor_ <= 1) return 0;
  const double cpu = std::max(0.0, thread_cpu_seconds() - cpu0_);
  const double s = std::max(0.0, factor_ * cpu - (wall_seconds() - wall0_));
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
  slept_ += s;
  return s;
}

}  // namespace conduit::sync
