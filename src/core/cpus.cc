#include "core/cpus.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace conduit {
namespace {

std::optional<int> cpus_of(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  return std::max(1, static_cast<int>(std::ceil(quota / period)));
}

std::string first_line(const char* path) {
  std::ifstream f(path);
  std::string line;
  if (f) std::getline(f, line);
  return line;
}

}  // namespace

std::optional<int> cpus_from_cpu_max(const std::string& line) {
  std::istringstream in(line);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max") return std::nullopt;
  try {
    return cpus_of(std::stod(quota), period);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<int> cpus_from_cfs(const std::string& quota, const std::string& period) {
  try {
    return cpus_of(std::stod(quota), std::stod(period));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

int quota_cpus() {
  int n = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  std::optional<int> q = cpus_from_cpu_max(first_line("/sys/fs/cgroup/cpu.max"));
  if (!q)
    q = cpus_from_cfs(first_line("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                      first_line("/sys/fs/cgroup/cpu/cpu.cfs_period_us"));
  if (q) n = std::min(n, *q);
  // Set by `conduit cluster exec`, measured before it mounted a sysfs of the emulated host's own (which has no cgroup
  // files): the container's quota still applies there.
  if (const char* v = std::getenv("CONDUIT_QUOTA_CPUS")) {
    char* end = nullptr;
    const long c = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && c >= 1) n = std::min<long>(n, c);
  }
  return n;
}

int usable_cpus() {
  int n = quota_cpus();
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof mask, &mask) == 0) n = std::min(n, std::max(1, CPU_COUNT(&mask)));
  return n;
}

}  // namespace conduit
