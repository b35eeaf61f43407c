// The rendezvous of `conduit` processes started with RANK/WORLD_SIZE (net/bootstrap.cc), end to end through the
// binary: what ranks of different runs sharing a store are told.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "../shell_run.h"
#include "../test_port.h"

namespace {

const std::string kConduit = CONDUIT_BINARY;

using Result = conduit::test::ShellResult;

std::string temp_dir() {
  char tmpl[] = "/tmp/conduit-bootstrap-test-XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d == nullptr ? std::string("/tmp") : std::string(d);
}

Result run_sh(const std::string& cmd, int limit_s = 120) { return conduit::test::run_shell(cmd, limit_s); }

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Ranks 0 and 1 of a file-store job in `dir`, `env` given to both (no CONDUIT_JOB_ID), in the background.
std::string file_job(const std::string& dir, const std::string& env) {
  return "for r in 0 1; do RANK=$r WORLD_SIZE=2 CONDUIT_STORE_PATH=" + dir + " CONDUIT_TIMEOUT=30 " + env + " " +
         kConduit + " selftest --op allreduce --timeout 30 & done; ";
}

}  // namespace

// Without CONDUIT_JOB_ID the file store's keys take the launcher's id of the run (found by an audit: every such job
// met under "job"): two jobs sharing one CONDUIT_STORE_PATH at once do not mix their ranks. A torchrun restart (the
// same run id; the restart count is not in the key, each node's agent counting its own: ranks of one attempt could
// hold two) finds its first attempt's values and says so, with another job's using the directory now as a cause.
TEST(BootstrapProcess, FileStoreJobsWithoutAJobIdKeepApartByTheirLaunchersIds) {
  const std::string dir = temp_dir();
  const std::string torch = "TORCHELASTIC_RUN_ID=tr" + std::to_string(::getpid());
  Result r = run_sh(file_job(dir, torch + " TORCHELASTIC_RESTART_COUNT=0") +
                    file_job(dir, "SLURM_JOB_ID=" + std::to_string(::getpid()) + " SLURM_STEP_ID=0") + "wait");
  EXPECT_EQ(count(r.out, "on 2 ranks over shm: 0 wrong elements"), 2u) << r.out;
  r = run_sh(file_job(dir, torch + " TORCHELASTIC_RESTART_COUNT=1") + "wait");
  EXPECT_NE(r.out.find("already holds rank 0's values of job 'torchelastic-tr"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("or another job using this directory now"), std::string::npos) << r.out;
  std::system(("rm -rf " + dir).c_str());
}

// A file store from a smaller earlier run: rank 0's value there is that run's, and the WORLD_SIZE refusal says it may
// be (found by an audit: it blamed this run's sizes alone).
TEST(BootstrapProcess, AStaleFileStoreIsNamedInTheWorldSizeRefusal) {
  const std::string dir = temp_dir();
  const std::string job = " CONDUIT_JOB_ID=stale" + std::to_string(::getpid()) + " ";
  Result r = run_sh("RANK=0 WORLD_SIZE=1 CONDUIT_STORE_PATH=" + dir + job + kConduit +
                    " selftest --op allreduce --timeout 20");
  EXPECT_EQ(r.code, 0) << r.out;
  // Rank 1 of a run of two reads the earlier run's rank 0 value (its own rank 0 refuses the directory).
  r = run_sh("RANK=1 WORLD_SIZE=2 CONDUIT_STORE_PATH=" + dir + job + kConduit +
             " selftest --op allreduce --timeout 20");
  EXPECT_NE(r.out.find("rank 1: WORLD_SIZE is 2 here but 1 on rank 0; allowed: the same WORLD_SIZE on every rank "
                       "(rank 0's value may be an earlier run's left in CONDUIT_STORE_PATH=" +
                       dir + ": empty it, or give each run its own CONDUIT_JOB_ID)"),
            std::string::npos)
      << r.out;
  std::system(("rm -rf " + dir).c_str());
}

// A rank of a file-store job that fails once the ranks have met publishes why in the directory: the others' waiting
// ends with it (found by an audit: rank 0 waited for rank 1's address until its deadline, then named it missing);
// the first failure only (each rank it stopped wrote its own over it). Here rank 1's tcp transport is given an
// interface that does not exist (by Gloo's variable: Conduit's own is checked at start-up, before the ranks meet). A
// process refused before it met the others (a second RANK 1 here) publishes nothing:
// it would stop the job it was refused from (found by a review).
TEST(BootstrapProcess, AFileStoreRanksStartUpErrorReachesTheOtherRanks) {
  const std::string dir = temp_dir();
  const std::string job = "failed" + std::to_string(::getpid());
  const std::string env = "WORLD_SIZE=2 CONDUIT_STORE_PATH=" + dir + " CONDUIT_JOB_ID=" + job +
                          " CONDUIT_TIMEOUT=60 CONDUIT_TRANSPORT=tcp ";
  Result r =
      run_sh("RANK=1 GLOO_SOCKET_IFNAME=nosuch0 " + env + kConduit + " selftest --op allreduce --timeout 60 & RANK=0 " +
             env + kConduit + " selftest --op allreduce --timeout 60; wait");
  EXPECT_EQ(count(r.out, "rank 1 failed: "), 1u) << r.out;
  EXPECT_NE(r.out.find("nosuch0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(published in the file store " + dir + " while this rank waited for key 'conduit/"),
            std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
  const std::string failure = dir + "/k_conduit%2F" + job + "%2Ferror";
  EXPECT_TRUE(std::ifstream(failure).good()) << failure;
  // A process refused before it met the others (rank 1 again: its values are there) publishes nothing.
  std::system(("rm -f " + failure).c_str());
  r = run_sh("RANK=1 " + env + kConduit + " selftest --op allreduce --timeout 60");
  EXPECT_NE(r.out.find("CONDUIT_STORE_PATH=" + dir + " already holds rank 1's values"), std::string::npos) << r.out;
  EXPECT_FALSE(std::ifstream(failure).good()) << failure;
  std::system(("rm -rf " + dir).c_str());
}

// Rank 0 failing after its TCP store started publishes its error there and keeps the store a few seconds: a rank
// waiting for its value learns why (found by an audit: it was told "connection to the server lost ... did rank 0
// exit?"). Here rank 0's own CONDUIT_JOB_ID is invalid, which it reads after its store started.
TEST(BootstrapProcess, RankZerosStartUpErrorReachesTheOtherRanks) {
  const int port = conduit::test::unused_port();
  const std::string env =
      "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " CONDUIT_TIMEOUT=30 ";
  Result r =
      run_sh("RANK=1 " + env + kConduit + " selftest --op allreduce --timeout 30 & RANK=0 CONDUIT_JOB_ID=bad/id " +
             env + kConduit + " selftest --op allreduce --timeout 30; wait");
  EXPECT_NE(r.out.find("rank 0 failed: environment variable CONDUIT_JOB_ID='bad/id' is invalid"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("did rank 0 exit"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 25) << r.out;
}
