#pragma once
// How many CPUs this process may use: the online CPUs, fewer when a container's CPU quota (cgroup v2 cpu.max or
// v1 cpu.cfs_quota_us / cpu.cfs_period_us) allows fewer, and (usable_cpus) fewer when the affinity mask does.
#include <optional>
#include <string>

namespace conduit {

// CPUs a cgroup v2 `cpu.max` line ("200000 100000", "max 100000") allows, rounded up; nullopt for no limit or an
// unreadable line.
std::optional<int> cpus_from_cpu_max(const std::string& line);
// The same from cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us (quota -1: no limit).
std::optional<int> cpus_from_cfs(const std::string& quota, const std::string& period);

// Online CPUs, capped by this cgroup's CPU quota. The same on every process of a container, whatever each one's
// affinity (ranks pinned one per core by mpirun or `conduit launch` see one CPU in their mask).
int quota_cpus();
// quota_cpus() capped by this process's affinity mask (taskset, a cpuset): what a launcher can spread workers over.
int usable_cpus();

}  // namespace conduit
