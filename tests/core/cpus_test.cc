// The CPU quota of a container (cgroup v2 cpu.max, v1 cfs quota/period) as a number of CPUs, and the CPU counts built
// on it.
#include "core/cpus.h"

#include <gtest/gtest.h>
#include <unistd.h>

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
}

TEST(Cpus, CountsAreBetweenOneAndTheOnlineCpus) {
  const int online = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_GE(quota_cpus(), 1);
  EXPECT_LE(quota_cpus(), online);
  EXPECT_GE(usable_cpus(), 1);
  EXPECT_LE(usable_cpus(), quota_cpus());
}

// An emulated host's programs see a sysfs without cgroup files; `cluster exec` passes the quota it measured before.
TEST(Cpus, AnInheritedQuotaCapsTheCount) {
  const int before = quota_cpus();
  setenv("CONDUIT_QUOTA_CPUS", "1", 1);
  EXPECT_EQ(quota_cpus(), 1);
  EXPECT_EQ(usable_cpus(), 1);
  setenv("CONDUIT_QUOTA_CPUS", "junk", 1);
  EXPECT_EQ(quota_cpus(), before);
  unsetenv("CONDUIT_QUOTA_CPUS");
  EXPECT_EQ(quota_cpus(), before);
}

}  // namespace
}  // namespace conduit
