// The CPU quota of a container (cgroup v2 cpu.max, v1 cfs quota/period) as a number of CPUs, and the CPU counts built
// on it.
#include "core/cpus.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace conduit {
namespace {

TEST(Cpus, QuotasBecomeWholeCpusRoundedUp) {
  EXPECT_EQ(cpus_from_cpu_max("200000 100000"), 2);
  EXPECT_EQ(cpus_from_cpu_max("150000 100000"), 2);  // 1.5 CPUs of time: two can run
  EXPECT_EQ(cpus_from_cpu_max("50000 100000"), 1);
  EXPECT_EQ(cpus_from_cpu_max("max 100000"), std::nullopt);
  EXPECT_EQ(cpus_from_cpu_max(""), std::nullopt);
  EXPECT_EQ(cpus_from_cpu_max("garbage"), std::nullopt);
  EXPECT_EQ(cpus_from_cfs("400000", "100000"), 4);
  EXPECT_EQ(cpus_from_cfs("-1", "100000"), std::nullopt);
  EXPECT_EQ(cpus_from_cfs("", ""), std::nullopt);
  // A quota of more CPUs than an int holds is no limit (it was cast to INT_MIN, and one CPU); so is inf or nan.
  EXPECT_EQ(cpus_from_cpu_max("3000000000000 1000"), std::nullopt);
  EXPECT_EQ(cpus_from_cpu_max("inf 1"), std::nullopt);
  EXPECT_EQ(cpus_from_cpu_max("nan 1000"), std::nullopt);
  EXPECT_EQ(cpus_from_cpu_max("2147483000000 1000"), 2147483000);
}

TEST(Cpus, WorkersAreSpreadSoTheBusiestCpuGetsLeast) {
  // Equal work: rank k on CPU k mod C, as binding always did.
  EXPECT_EQ(spread_over_cpus({1, 1, 1, 1}, 2), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(spread_over_cpus({0, 0, 0}, 4), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(spread_over_cpus({}, 2), (std::vector<int>{}));
  // 2 pipelines of a cnn cut 9:1: each CPU gets one heavy first stage and one light last stage (k mod 2 put both
  // heavy ones on CPU 0).
  EXPECT_EQ(spread_over_cpus({9, 1, 9, 1}, 2), (std::vector<int>{0, 0, 1, 1}));
  // Every CPU takes at most ceil(workers / C): the two lightest do not both go to the CPU beside the heavy one.
  EXPECT_EQ(spread_over_cpus({10, 1, 1, 1}, 2), (std::vector<int>{0, 1, 1, 0}));
  // The most work first, each to the least loaded CPU with room: 5 + 1 | 4 + 2 | 3 + 3.
  EXPECT_EQ(spread_over_cpus({3, 5, 4, 2, 1, 3}, 3), (std::vector<int>{2, 0, 1, 1, 0, 2}));
  EXPECT_EQ(spread_over_cpus({1, 2}, 8), (std::vector<int>{1, 0}));
  EXPECT_THROW(spread_over_cpus({1}, 0), InvalidArgument);
  EXPECT_THROW(spread_over_cpus({1, -1}, 2), InvalidArgument);
  EXPECT_THROW(spread_over_cpus({1, std::nan("")}, 2), InvalidArgument);
}

TEST(Cpus, OneCpuOfEveryCoreComesBeforeAnySibling) {
  // Siblings numbered next to each other (cores {0,1}, {2,3}, {4,5}): two workers bound to CPUs 0 and 1 shared a
  // core while two stayed idle.
  auto adjacent = [](int cpu) { return std::optional<int>(cpu / 2 * 2); };
  EXPECT_EQ(cores_first({0, 1, 2, 3, 4, 5}, adjacent), (std::vector<int>{0, 2, 4, 1, 3, 5}));
  // Siblings numbered half the machine apart (cores {0,4} .. {3,7}): already in that order, unchanged.
  auto apart = [](int cpu) { return std::optional<int>(cpu % 4); };
  EXPECT_EQ(cores_first({0, 1, 2, 3, 4, 5, 6, 7}, apart), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  // A mask (taskset 1,2,3,5) keeps its order within each level; a core with 4 threads gives four levels.
  EXPECT_EQ(cores_first({1, 2, 3, 5}, adjacent), (std::vector<int>{1, 2, 5, 3}));
  auto four = [](int cpu) { return std::optional<int>(cpu / 4); };
  EXPECT_EQ(cores_first({0, 1, 2, 3, 4, 5}, four), (std::vector<int>{0, 4, 1, 5, 2, 3}));
  // A CPU whose core cannot be read is a core of its own; nothing, or no SMT, stays as it was.
  auto unknown_odd = [](int cpu) { return cpu % 2 ? std::nullopt : std::optional<int>(0); };
  EXPECT_EQ(cores_first({0, 1, 2, 3}, unknown_odd), (std::vector<int>{0, 1, 3, 2}));
  EXPECT_EQ(cores_first({}, adjacent), (std::vector<int>{}));
  auto own = [](int cpu) { return std::optional<int>(cpu); };
  EXPECT_EQ(cores_first({3, 0, 2}, own), (std::vector<int>{3, 0, 2}));
  // This machine's sysfs names each CPU's core as a CPU of the same core, at most the CPU itself.
  for (int cpu : start_affinity()) {
    const std::optional<int> core = sysfs_core_of(cpu);
    if (!core) continue;  // (a container without sysfs' topology)
    EXPECT_GE(*core, 0);
    EXPECT_LE(*core, cpu);
    EXPECT_EQ(sysfs_core_of(*core), core) << "cpu " << cpu;
  }
}

TEST(Cpus, CountsAreBetweenOneAndTheOnlineCpus) {
  const int online = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_GE(quota_cpus(), 1);
  EXPECT_LE(quota_cpus(), online);
  EXPECT_GE(usable_cpus(), 1);
  EXPECT_LE(usable_cpus(), quota_cpus());
}

// The mask the program started with, not the calling thread's now: libgomp under OMP_PROC_BIND pins the thread that
// loads libtorch to one CPU, and `conduit train --workers N` then bound every worker to it. A thread narrowed here
// after start-up sees the start mask and its count.
TEST(Cpus, TheStartMaskOutlivesALaterPinning) {
  cpu_set_t now;
  CPU_ZERO(&now);
  ASSERT_EQ(::sched_getaffinity(0, sizeof now, &now), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &now)) cpus.push_back(c);
  ASSERT_EQ(start_affinity(), cpus);  // (nothing in this test binary narrows it before)
  const int usable = usable_cpus();
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus.back(), &one);
    ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
    EXPECT_EQ(start_affinity(), cpus);
    EXPECT_EQ(usable_cpus(), usable);
  }).join();
}

// An emulated host's programs see a sysfs without cgroup files; `cluster exec` passes the quota it measured before.
TEST(Cpus, AnInheritedQuotaCapsTheCount) {
  const int before = quota_cpus();
  setenv("CONDUIT_QUOTA_CPUS", "1", 1);
  EXPECT_EQ(quota_cpus(), 1);
  EXPECT_EQ(usable_cpus(), 1);
  // A bad value is an error naming it (it was ignored, and every CPU taken).
  for (const char* bad : {"junk", "0", "-2", "3x"}) {
    setenv("CONDUIT_QUOTA_CPUS", bad, 1);
    EXPECT_THROW(quota_cpus(), ConfigError) << bad;
  }
  unsetenv("CONDUIT_QUOTA_CPUS");
  EXPECT_EQ(quota_cpus(), before);
}

}  // namespace
}  // namespace conduit

// The cgroups whose CPU limits apply: this process's own and every parent's, for v2 and v1 (only the mount's root was
// read, so a quota on a sub-cgroup was missed).
TEST(Cpus, QuotaIsReadFromThisProcesssCgroupAndItsParents) {
  auto paths = [](const std::vector<conduit::CgroupDir>& ds) {
    std::vector<std::string> out;
    for (const auto& d : ds) out.push_back(std::to_string(d.version) + " " + d.path);
    return out;
  };
  EXPECT_EQ(paths(conduit::cgroup_cpu_dirs("0::/system.slice/job.scope\n", "/m")),
            (std::vector<std::string>{"2 /m/system.slice/job.scope", "2 /m/system.slice", "2 /m"}));
  EXPECT_EQ(paths(conduit::cgroup_cpu_dirs("0::/\n", "/m")), (std::vector<std::string>{"2 /m"}));
  EXPECT_EQ(paths(conduit::cgroup_cpu_dirs("4:memory:/x\n2:cpu,cpuacct:/slurm/job7\n0::/\n", "/m")),
            (std::vector<std::string>{"1 /m/cpu,cpuacct/slurm/job7", "1 /m/cpu,cpuacct/slurm", "1 /m/cpu,cpuacct",
                                      "1 /m/cpu/slurm/job7", "1 /m/cpu/slurm", "1 /m/cpu", "2 /m"}));
  EXPECT_EQ(paths(conduit::cgroup_cpu_dirs("", "/m")), (std::vector<std::string>{"2 /m", "1 /m/cpu"}));
}

// Memory limits are read from this process's cgroup and every parent, v2 and v1 (only the v2 root's memory.max was
// read: a sub-cgroup's limit and every v1 limit were missed, and the guards against a run too large for memory
// passed).
TEST(Cpus, MemoryLimitIsReadFromThisProcesssCgroupAndItsParents) {
  namespace fs = std::filesystem;
  const fs::path m = fs::temp_directory_path() / ("conduit-cgroup-" + std::to_string(::getpid()));
  fs::remove_all(m);
  auto put = [&](const fs::path& file, const std::string& text) {
    fs::create_directories(file.parent_path());
    std::ofstream(file) << text << "\n";
  };
  put(m / "system.slice" / "job.scope" / "memory.max", "max");
  put(m / "system.slice" / "memory.max", "3221225472");
  EXPECT_EQ(conduit::cgroup_memory_limit("0::/system.slice/job.scope\n", m.string()), 3221225472.0);
  put(m / "system.slice" / "job.scope" / "memory.max", "1073741824");
  EXPECT_EQ(conduit::cgroup_memory_limit("0::/system.slice/job.scope\n", m.string()), 1073741824.0);
  EXPECT_EQ(conduit::cgroup_memory_limit("0::/other\n", m.string()), std::nullopt);
  // v1: the memory controller's hierarchy (its "unlimited" is about 2^63, above any machine's memory).
  put(m / "memory" / "process_api" / "memory.limit_in_bytes", "2147483648");
  put(m / "memory" / "memory.limit_in_bytes", "9223372036854771712");
  EXPECT_EQ(conduit::cgroup_memory_limit("4:memory:/process_api\n2:cpu,cpuacct:/x\n", m.string()), 2147483648.0);
  const auto dirs = conduit::cgroup_dirs("4:memory:/process_api\n", "memory", "/m");
  ASSERT_EQ(dirs.size(), 2u);
  EXPECT_EQ(dirs[0].path, "/m/memory/process_api");
  EXPECT_EQ(dirs[1].path, "/m/memory");
  EXPECT_GT(conduit::usable_memory_bytes(), 0);
  fs::remove_all(m);
}
