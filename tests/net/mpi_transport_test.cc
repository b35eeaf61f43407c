// The MPI transport between real processes: runs `mpirun -np 3 net_mpi_worker` (tests/net_mpi_worker.cc, built
// next to this binary) and checks that every rank passed every phase. The tag mapping is checked in-process.
#include "net/mpi_transport.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>

#include "net/tags.h"

namespace conduit::net {
namespace {

std::string worker_path() {
  if (const char* p = std::getenv("CONDUIT_MPI_WORKER")) return p;
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  return (self.parent_path() / "net_mpi_worker").string();
}

// Runs `cmd` through the shell; returns its exit code and fills `out` with stdout+stderr.
int run(const std::string& cmd, std::string* out) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out->append(buf, n);
  int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

bool same_route(uint64_t a, uint64_t b, int ub) {
  MpiRoute x = mpi_route_for(a, ub), y = mpi_route_for(b, ub);
  return x.comm == y.comm && x.tag == y.tag;
}

TEST(MpiTags, MappingStaysInRangeAndSeparatesNearbyTags) {
  for (int ub : {32767, 65535, 0x7fffffff}) {
    std::set<std::pair<int, int>> seen;
    for (TagKind k : {kCollective, kUser, kDebug, kControl}) {
      for (uint32_t comm : {0u, 1u, 63u, 64u, 65u, 4096u, 0xffffffu}) {
        for (uint32_t seq = 0; seq < 16; ++seq) {  // 2^l >= 16 even for the smallest MPI_TAG_UB (32767)
          MpiRoute r = mpi_route_for(make_tag(k, comm, seq), ub);
          ASSERT_GE(r.tag, 0);
          ASSERT_LE(r.tag, ub);
          ASSERT_GE(r.comm, 0);
          ASSERT_LT(r.comm, kDataComms);
          seen.insert({r.comm, r.tag});
        }
      }
    }
    EXPECT_EQ(seen.size(), 4u * 7u * 16u) << "collision among nearby tags with MPI_TAG_UB " << ub;
  }
}

TEST(MpiTags, OpenMpiKeepsKindAndCommunicatorWhole) {
  const int ub = 0x7fffffff;
  // Communicator ids are hashes (coll/communicator.cc): any two distinct ids must stay apart, whatever the seq.
  uint32_t x = 0x9e3779u;
  for (int i = 0; i < 2000; ++i) {
    uint32_t a = (x = x * 1103515245u + 12345u) & 0xffffffu;
    uint32_t b = (x = x * 1103515245u + 12345u) & 0xffffffu;
    if (a == b) continue;
    for (uint32_t seq : {0u, 1u, 2048u, 77777u}) {
      ASSERT_FALSE(same_route(make_tag(kCollective, a, seq), make_tag(kCollective, b, seq), ub)) << a << " " << b;
    }
  }
  EXPECT_FALSE(same_route(make_tag(kCollective, 1, 5), make_tag(kUser, 1, 5), ub));
  EXPECT_FALSE(same_route(make_tag(kDebug, 7, 5), make_tag(kControl, 7, 5), ub));
  // The documented fold: low parts 2^11 apart share a route (harmless for in-order sequences), 2^10 apart do not.
  EXPECT_TRUE(same_route(make_tag(kCollective, 1, 5), make_tag(kCollective, 1, 5 + (1u << 11)), ub));
  EXPECT_FALSE(same_route(make_tag(kCollective, 1, 5), make_tag(kCollective, 1, 5 + (1u << 10)), ub));
}

// OpenMPI's UCX layer has MPI_TAG_UB 2^23 - 1: the communicator id still travels whole (it kept 14 of its 18 tag
// bits, so a host group's id 0x800005 and the split id 5 shared a route), and 3 low bits of the sequence.
TEST(MpiTags, UcxTagBoundKeepsTheCommunicatorWhole) {
  const int ub = (1 << 23) - 1;
  EXPECT_EQ(mpi_route_low_bits(ub), 3);
  EXPECT_FALSE(same_route(make_tag(kCollective, 0x800005u, 0), make_tag(kCollective, 5, 0), ub));
  for (uint32_t a : {1u, 64u, 0x100000u, 0x7fffc0u, 0x800000u, 0xffffffu})
    for (uint32_t b : {2u, 128u, 0x200000u, 0x400000u, 0x800040u})
      if (a != b) {
        ASSERT_FALSE(same_route(make_tag(kUser, a, 9), make_tag(kUser, b, 9), ub)) << a << " " << b;
      }
  EXPECT_TRUE(same_route(make_tag(kCollective, 1, 5), make_tag(kCollective, 1, 5 + 8), ub));
  EXPECT_FALSE(same_route(make_tag(kCollective, 1, 5), make_tag(kCollective, 1, 6), ub));
}

TEST(MpiTransport, NotLaunchedByMpirun) {
  if (std::getenv("OMPI_COMM_WORLD_RANK") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK")) {
    GTEST_SKIP() << "running under mpirun";
  }
  EXPECT_FALSE(mpi_launched());
}

// Runs the worker on 3 ranks; `env` is prepended to the command.
void run_worker(const std::string& env) {
  std::string worker = worker_path();
  if (worker.empty() || access(worker.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "MPI worker not built at '" << worker << "' (target net_mpi_worker)";
  }
  std::string probe;
  if (run("command -v mpirun", &probe) != 0) GTEST_SKIP() << "mpirun not found";
  // Containers often run as root and forbid cross-process memory attach: allow root, keep to shared memory and
  // loopback TCP, and do not rely on CMA single-copy.
  std::string cmd = env +
                    " OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                    "OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 5 120 mpirun --oversubscribe -np 3 "
                    "--bind-to none --mca btl self,vader,tcp --mca btl_tcp_if_include lo '" +
                    worker + "'";
  std::string out;
  int rc = run(cmd, &out);
  EXPECT_EQ(rc, 0) << cmd << "\n" << out;
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(out.find("rank " + std::to_string(r) + ": ALL OK"), std::string::npos) << "rank " << r << "\n" << out;
    for (const char* phase : {"stale-messages", "abort-waits-for-sends", "many-transports", "absent-rank"})
      EXPECT_NE(out.find("rank " + std::to_string(r) + ": ok " + phase), std::string::npos)
          << "rank " << r << " phase " << phase << "\n"
          << out;
  }
  EXPECT_EQ(out.find("FAIL"), std::string::npos) << out;
}

// Tags in flight, FIFO per tag, threads, size mismatch -> ProtocolError, deadline -> TimeoutError, abort -> PeerError;
// a transport made after another went never gets the old one's message or abort notice; an abort finishes a send
// in flight before failing it (its caller reuses the buffer); transports made one after another beyond the 16 whose
// communicators are kept; a rank that never comes to the start-up is a TimeoutError naming the step, not a hang.
TEST(MpiTransport, ThreeProcessesUnderMpirun) { run_worker("CONDUIT_MPI_SERIALIZE=0"); }

// The same with every MPI call behind one lock (the path taken when MPI only provides MPI_THREAD_SERIALIZED).
// Also sends everything above 1000 bytes as derived datatypes (the path of messages > 2 GiB).
TEST(MpiTransport, ThreeProcessesUnderMpirunSerialized) {
  run_worker("CONDUIT_MPI_SERIALIZE=1 CONDUIT_MPI_TEST_BLOCK_BYTES=1000");
}

// A program that started MPI at MPI_THREAD_FUNNELED gets its Conduit transport refused, with the level it needs.
TEST(MpiTransport, AThreadLevelBelowSerializedIsRefused) {
  std::string worker = worker_path();
  if (worker.empty() || access(worker.c_str(), X_OK) != 0) GTEST_SKIP() << "MPI worker not built";
  std::string probe;
  if (run("command -v mpirun", &probe) != 0) GTEST_SKIP() << "mpirun not found";
  std::string out;
  const int rc =
      run("CONDUIT_TEST_MPI_FUNNELED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 5 "
          "60 mpirun --oversubscribe -np 1 --bind-to none '" +
              worker + "'",
          &out);
  EXPECT_EQ(rc, 0) << out;
  if (out.find("rank 0: SKIP funneled") != std::string::npos)
    GTEST_SKIP() << "this MPI library gives MPI_THREAD_SERIALIZED when asked for less: " << out;
  EXPECT_NE(out.find("rank 0: ok funneled"), std::string::npos) << out;
  EXPECT_EQ(out.find("FAIL"), std::string::npos) << out;
}

}  // namespace
}  // namespace conduit::net
