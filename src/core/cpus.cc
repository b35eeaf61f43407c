#include "core/cpus.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include "core/env.h"
#include "core/error.h"

namespace conduit {
namespace {

// No limit for a quota of more CPUs than an int holds, or not a number (cast, 3e12 us a 1 ms period was INT_MIN,
// and one CPU).
std::optional<int> cpus_of(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  const double cpus = std::ceil(quota / period);
  if (!(cpus < static_cast<double>(std::numeric_limits<int>::max()))) return std::nullopt;
  return std::max(1, static_cast<int>(cpus));
}

std::string first_line(const std::string& path) {
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

std::vector<CgroupDir> cgroup_cpu_dirs(const std::string& self_cgroup, const std::string& mount) {
  return cgroup_dirs(self_cgroup, "cpu", mount);
}

std::vector<CgroupDir> cgroup_dirs(const std::string& self_cgroup, const std::string& controller,
                                   const std::string& mount) {
  std::vector<CgroupDir> out;
  // Every directory from `rel` (a cgroup path, "/a/b") up to the root, below `base`.
  auto chain = [&](const std::string& base, std::string rel, int version) {
    if (rel.empty() || rel[0] != '/') rel = "/" + rel;
    while (true) {
      while (rel.size() > 1 && rel.back() == '/') rel.pop_back();
      out.push_back({rel == "/" ? base : base + rel, version});
      if (rel == "/") break;
      rel = rel.substr(0, rel.rfind('/'));
      if (rel.empty()) rel = "/";
    }
  };
  std::istringstream in(self_cgroup);
  std::string line;
  bool any = false;
  while (std::getline(in, line)) {
    // "hierarchy-id:controllers:path"; the path may hold ':' itself.
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string id = line.substr(0, a), controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (id == "0" && controllers.empty()) {
      chain(mount, path, 2);
      any = true;
    } else {
      std::istringstream cs(controllers);
      std::string c;
      bool mine = false;
      while (std::getline(cs, c, ',')) mine = mine || c == controller;
      if (!mine) continue;
      chain(mount + "/" + controllers, path, 1);
      if (controllers != controller) chain(mount + "/" + controller, path, 1);  // the usual symlink ("cpu,cpuacct")
      any = true;
    }
  }
  if (!any) {  // no /proc/self/cgroup: the mount's root, both layouts
    out.push_back({mount, 2});
    out.push_back({mount + "/" + controller, 1});
  }
  return out;
}

int quota_cpus() {
  int n = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
  std::ifstream self("/proc/self/cgroup");
  std::stringstream text;
  text << self.rdbuf();
  // The smallest quota of this cgroup and every parent (a parent's limit binds its children too).
  for (const auto& d : cgroup_cpu_dirs(text.str())) {
    const std::optional<int> q = d.version == 2 ? cpus_from_cpu_max(first_line(d.path + "/cpu.max"))
                                                : cpus_from_cfs(first_line(d.path + "/cpu.cfs_quota_us"),
                                                                first_line(d.path + "/cpu.cfs_period_us"));
    if (q) n = std::min(n, *q);
  }
  // Set by `conduit cluster exec`, measured before it mounted a sysfs of the emulated host's own (which has no cgroup
  // files): the container's quota still applies there.
  // (a bad value was ignored, and every CPU taken)
  if (auto c = env_int("CONDUIT_QUOTA_CPUS", 1, 1 << 20)) n = std::min<long>(n, static_cast<long>(*c));
  return n;
}

namespace {
std::vector<int> read_affinity() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof mask, &mask) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  return cpus;
}
// Read while the program loads, before main runs and before any library is opened.
const std::vector<int> g_start_affinity = read_affinity();
}  // namespace

std::vector<int> start_affinity() { return g_start_affinity; }

std::vector<int> cores_first(const std::vector<int>& cpus, const std::function<std::optional<int>(int)>& core_of) {
  // (a CPU of unknown core is its own: keyed by -1 - cpu, apart from every real core's key)
  std::vector<std::pair<int, size_t>> level(cpus.size());  // (the CPU's index among its core's, its position)
  std::vector<std::pair<int, int>> seen;                   // (core, CPUs of it so far)
  for (size_t i = 0; i < cpus.size(); ++i) {
    const std::optional<int> core = core_of(cpus[i]);
    const int key = core ? *core : -1 - cpus[i];
    auto it = std::find_if(seen.begin(), seen.end(), [&](const auto& s) { return s.first == key; });
    if (it == seen.end()) it = seen.insert(seen.end(), {key, 0});
    level[i] = {it->second++, i};
  }
  std::stable_sort(level.begin(), level.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<int> out;
  out.reserve(cpus.size());
  for (const auto& [k, i] : level) out.push_back(cpus[i]);
  return out;
}

std::optional<int> sysfs_core_of(int cpu) {
  // "0-1", "0,4" or "3": the first number is the core's lowest CPU.
  const std::string list = first_line(fmt::format("/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list", cpu));
  int first = 0;
  size_t i = 0;
  for (; i < list.size() && i < 9 && list[i] >= '0' && list[i] <= '9'; ++i) first = first * 10 + (list[i] - '0');
  if (i == 0) return std::nullopt;
  return first;
}

int usable_cpus() {
  int n = quota_cpus();
  if (!g_start_affinity.empty()) n = std::min(n, static_cast<int>(g_start_affinity.size()));
  return n;
}

std::vector<int> spread_over_cpus(const std::vector<double>& work, int ncpus) {
  if (ncpus < 1) throw InvalidArgument(fmt::format("spread_over_cpus: {} CPUs; allowed: 1 or more", ncpus));
  for (double w : work)
    if (!std::isfinite(w) || w < 0)
      throw InvalidArgument(fmt::format("spread_over_cpus: a worker's work is {}; allowed: finite, 0 or more", w));
  const size_t n = work.size(), c = size_t(ncpus), cap = (n + c - 1) / c;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return work[a] > work[b]; });
  std::vector<double> load(c, 0.0);
  std::vector<size_t> taken(c, 0);
  std::vector<int> cpu(n, 0);
  for (size_t k : order) {
    size_t best = c;
    for (size_t i = 0; i < c; ++i)
      if (taken[i] < cap && (best == c || load[i] < load[best] || (load[i] == load[best] && taken[i] < taken[best])))
        best = i;
    cpu[k] = int(best);
    load[best] += work[k];
    ++taken[best];
  }
  return cpu;
}

std::optional<double> cgroup_memory_limit(const std::string& self_cgroup, const std::string& mount) {
  std::optional<double> limit;
  for (const auto& d : cgroup_dirs(self_cgroup, "memory", mount)) {
    // v2 memory.max ("max": none), v1 memory.limit_in_bytes (about 2^63 for none: above any machine's memory)
    std::ifstream f(d.path + (d.version == 2 ? "/memory.max" : "/memory.limit_in_bytes"));
    double v = 0;
    if (f >> v && v > 0) limit = limit ? std::min(*limit, v) : v;
  }
  return limit;
}

double usable_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  double have = pages > 0 && page > 0 ? double(pages) * double(page) : 0;
  std::ifstream self("/proc/self/cgroup");
  std::stringstream text;
  text << self.rdbuf();
  // This process's cgroup and every parent's, v2 and v1 (only the v2 root's memory.max was read: a limit on a
  // sub-cgroup, systemd-run -p MemoryMax or a batch job's, and every v1 limit were missed, and the guards that
  // refuse a run too large for memory let the out-of-memory killer end it instead).
  if (const auto limit = cgroup_memory_limit(text.str())) have = have > 0 ? std::min(have, *limit) : *limit;
  return have;
}

}  // namespace conduit
