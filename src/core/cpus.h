#pragma once
// How many CPUs this process may use: the online CPUs, fewer when a container's CPU quota (cgroup v2 cpu.max or
// v1 cpu.cfs_quota_us / cpu.cfs_period_us) allows fewer, and (usable_cpus) fewer when the affinity mask does.
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace conduit {

// CPUs a cgroup v2 `cpu.max` line ("200000 100000", "max 100000") allows, rounded up; nullopt for no limit or an
// unreadable line.
std::optional<int> cpus_from_cpu_max(const std::string& line);
// The same from cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us (quota -1: no limit).
std::optional<int> cpus_from_cfs(const std::string& quota, const std::string& period);

// The cgroup directories whose CPU limit applies to a process with this /proc/self/cgroup text, from its own cgroup up
// to the mount's root, each with its version (2: cpu.max; 1: cpu.cfs_quota_us and cpu.cfs_period_us), under
// `mount` (/sys/fs/cgroup). Only the root's were read: a process in a sub-cgroup (systemd-run -p CPUQuota, a batch
// system's job cgroup) had its quota missed.
struct CgroupDir {
  std::string path;
  int version;
};
std::vector<CgroupDir> cgroup_cpu_dirs(const std::string& self_cgroup, const std::string& mount = "/sys/fs/cgroup");
// The same for another v1 controller ("memory": v1 directories under <mount>/memory).
std::vector<CgroupDir> cgroup_dirs(const std::string& self_cgroup, const std::string& controller,
                                   const std::string& mount = "/sys/fs/cgroup");
// The smallest memory limit of this cgroup and its parents (v2 memory.max, v1 memory.limit_in_bytes), in bytes;
// nullopt when none is set or readable.
std::optional<double> cgroup_memory_limit(const std::string& self_cgroup, const std::string& mount = "/sys/fs/cgroup");

// Online CPUs, capped by the smallest CPU quota of this process's cgroup and its parents. The same on every process of
// a container, whatever each one's affinity (ranks pinned one per core by mpirun or `conduit launch` see one CPU in
// their mask).
int quota_cpus();
// quota_cpus() capped by this process's affinity mask (taskset, a cpuset) as the program started
// (start_affinity): what a launcher can spread workers over.
int usable_cpus();
// The CPUs of this process's affinity mask as it was when the program started, in increasing order (empty when it
// cannot be read). A library loaded later may narrow the loading thread's mask: libgomp under OMP_PROC_BIND or
// OMP_PLACES pins it to its first place, and `conduit train --workers N`, which loads libtorch before it launches,
// bound every worker to that one CPU.
std::vector<int> start_affinity();
// `cpus` reordered so that one logical CPU of every core comes before any core's second (then the second of each,
// and so on), keeping their order otherwise: a launcher binding worker k to the k-th CPU then gives workers up to
// the number of cores a core each, also where the kernel numbers SMT siblings next to each other (0 and 1 one
// core). core_of(cpu) names a CPU's core (nullopt: unknown, a core of its own); sysfs_core_of reads it from
// /sys/devices/system/cpu/cpuN/topology (the lowest CPU of its thread_siblings_list).
std::vector<int> cores_first(const std::vector<int>& cpus, const std::function<std::optional<int>(int)>& core_of);
std::optional<int> sysfs_core_of(int cpu);
// The memory this process may use: the machine's, or the smallest limit of its cgroup and their parents
// (cgroup_memory_limit) when lower; 0: unknown.
double usable_memory_bytes();

// Which of `ncpus` CPUs each of work.size() workers is bound to, work[k] being worker k's share of the work (any
// positive scale): every CPU takes ceil(workers / ncpus) at most, and the workers go one by one, the most work first
// (of equal work, the lowest rank first), each to the CPU with the least work so far (of equal, the lowest), so the
// busiest CPU gets as little as this greedy order can give it. Equal work gives rank k CPU k mod ncpus. A pipeline's
// stages of unequal work, bound k mod ncpus, put every heavy first stage on one CPU. InvalidArgument for ncpus < 1
// or a negative or non-finite work.
std::vector<int> spread_over_cpus(const std::vector<double>& work, int ncpus);

}  // namespace conduit
