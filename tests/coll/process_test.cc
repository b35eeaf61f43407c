// Collectives over real processes: tcp, shm, shm+tcp across emulated hosts and mpi, each checked by
// `conduit selftest`; a crashed peer and an expired deadline give the errors the runtime promises, in time.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../shell_run.h"
#include "../test_port.h"

namespace {

const std::string kConduit = CONDUIT_BINARY;

using Result = conduit::test::ShellResult;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string temp_path(const std::string& stem) {
  return "/tmp/conduit-test-" + std::to_string(::getpid()) + "-" + stem;
}

// Runs a shell command with a time limit; returns its exit code and combined output. Without the 4 KiB ring segments
// this binary sets for its in-process tests (collectives_test.cc): the processes run the default segment size (over
// shm the only one whose messages reach the single-copy threshold), unless a command sets its own.
Result run_sh(const std::string& cmd, int limit_s = 240) {
  return conduit::test::run_shell("unset CONDUIT_RING_SEGMENT_BYTES; " + cmd, limit_s);
}

// A port free a moment ago, and outside the kernel's ephemeral range (tests/test_port.h): rank 0 binds it up to 6 s
// later.
int free_port() { return conduit::test::unused_port(); }

TEST(Processes, SelftestOverTcp) {
  auto r = run_sh(kConduit + " launch -n 3 -- " + kConduit + " selftest --transport tcp --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over tcp: 0 wrong elements"), std::string::npos) << r.out;
}

TEST(Processes, SelftestOverShm) {
  auto r = run_sh(kConduit + " launch -n 4 -- " + kConduit + " selftest --transport shm --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over shm: 0 wrong elements"), std::string::npos) << r.out;
}

// Large shm messages are read out of the sender's memory (single copy) only where every local rank offers it: one
// rank with CONDUIT_SHM_SINGLE_COPY_BYTES=off puts all of them on the rings, which each rank says once.
TEST(Processes, ShmRanksDisagreeingOnSingleCopyAllUseTheRings) {
  auto r = run_sh(kConduit +
                  " launch -n 2 -- sh -c \"if [ \\$RANK = 1 ]; then export CONDUIT_SHM_SINGLE_COPY_BYTES=off; "
                  "fi; CONDUIT_LOG_LEVEL=info exec " +
                  kConduit + " selftest --transport shm --timeout 60\"");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over shm: 0 wrong elements"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 0: messages go through the rings only (no single copy): rank 1 does not offer it"),
            std::string::npos)
      << r.out;
}

TEST(Processes, SelftestAcrossTwoEmulatedHostsUsesShmAndTcp) {
  // Ranks 0,1 claim host a, ranks 2,3 host b: shared memory inside a host, tcp across, hierarchical allreduce.
  auto r = run_sh(kConduit + " launch -n 4 -- sh -c \"CONDUIT_HOST_ID=h\\$((RANK / 2)) exec " + kConduit +
                  " selftest --timeout 60\"");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over shm+tcp: 0 wrong elements"), std::string::npos) << r.out;
}

TEST(Processes, SelftestUnderMpirunOverMpi) {
  auto r = run_sh("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun "
                  "--oversubscribe -np 3 " + kConduit + " selftest --transport mpi --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over mpi: 0 wrong elements"), std::string::npos) << r.out;
}

// A rank that never starts MPI: the others waited inside MPI_Init_thread, which has no deadline, with no word (an
// audit: 25 s and counting with CONDUIT_TIMEOUT=5). They now stop at the start-up deadline naming the step.
TEST(Processes, AnMpiRankThatNeverStartsMpiStopsTheOthersAtTheDeadline) {
  auto r = run_sh(
      "CONDUIT_TIMEOUT=3 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe "
      "-x CONDUIT_TIMEOUT -np 2 " +
          kConduit + " selftest --op barrier --timeout 3 : -np 1 sleep 60",
      50);
  EXPECT_NE(r.code, 124) << "hung: " << r.out;  // timeout's code
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("conduit: error: mpi: MPI_Init_thread did not return within 3 s on rank "), std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 40) << r.out;
}

TEST(Processes, UnderMpirunTheDefaultTransportBootstrapsThroughMpi) {
  auto r = run_sh("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 " +
                  kConduit + " selftest --op allreduce --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("over shm: 0 wrong elements"), std::string::npos) << r.out;
}

// Ranks that ask for different transports stop at start-up with one line naming both (they failed with misleading
// errors about shm segments or store addresses, or hung in MPI); under mpirun a rank's error ends the job through
// MPI_Abort (MPI_Finalize waited for the other ranks, still in MPI's start-up: the job hung).
TEST(Processes, RanksAskingForDifferentTransportsStopAtStartUp) {
  const std::string script = temp_path("mixed.sh");
  {
    std::ofstream f(script);
    f << "#!/bin/sh\n"
         "r=${RANK:-$OMPI_COMM_WORLD_RANK}\n"
         "if [ \"$r\" = 1 ]; then export CONDUIT_TRANSPORT=\"$SECOND\"; else export CONDUIT_TRANSPORT=\"$FIRST\"; fi\n"
         "exec "
      << kConduit << " selftest --op barrier --timeout 20\n";
  }
  ::chmod(script.c_str(), 0755);
  auto r = run_sh("FIRST=auto SECOND=tcp " + kConduit + " launch -n 2 -- " + script, 60);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("transport: rank 0 asks for 'auto' but rank 1 for 'tcp'"), std::string::npos) << r.out;
  // Rank 0, serving the store, waits for the others to have read the exchange before its error ends it: each rank
  // says what is wrong (ranks still reading lost the store and asked "did rank 0 exit?"; 3 runs of 3 did so).
  for (int run = 0; run < 3; ++run) {
    r = run_sh("FIRST=auto SECOND=tcp " + kConduit + " launch -n 4 -- " + script, 60);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("transport: rank 0 asks for 'auto' but rank 1 for 'tcp'"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("did rank 0 exit"), std::string::npos) << r.out;
  }
  r = run_sh(
      "FIRST=mpi SECOND=bogus OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe "
      "-x FIRST -x SECOND -np 2 " +
          script,
      60);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "hung: " << r.out;  // timeout's code
  EXPECT_NE(r.out.find("transport: rank 0 asks for 'mpi' but rank 1 for 'bogus'"), std::string::npos) << r.out;
  std::remove(script.c_str());
  // Another MPI's launcher (PMI variables this library's MPI_Init does not read): a singleton world that ran alone
  // as "rank 0 of 1".
  r = run_sh("PMI_RANK=1 PMI_SIZE=2 " + kConduit + " selftest --op barrier --timeout 10", 60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("mpi: the launcher started 2 ranks (PMI_SIZE=2) but this MPI library's world has 1"),
            std::string::npos)
      << r.out;
  // A rank without a size (Slurm's PMIx sets PMIX_RANK alone) ran as "rank 0 of 1" too; and RANK/WORLD_SIZE beside
  // an MPI launch that says otherwise (a 2-rank job split into two of 1, both exiting 0).
  const std::string root = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  r = run_sh(root + "PMI_RANK=1 " + kConduit + " selftest --op barrier --timeout 10", 60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("mpi: the launcher made this process rank 1 (PMI_RANK=1) but this MPI library's world makes "
                       "it rank 0 of 1"),
            std::string::npos)
      << r.out;
  r = run_sh(root + "PMIX_RANK=0 RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 " + kConduit +
                 " selftest --op barrier --timeout 10",
             60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("RANK=1 but mpirun made this process rank 0 of 1: two launchers' variables meet here"),
            std::string::npos)
      << r.out;
  // torchrun's workers under `srun --mpi=pmix torchrun` inherit PMIX_RANK: TORCHELASTIC_RUN_ID marks them, and they
  // meet by RANK and WORLD_SIZE.
  char dir[] = "/tmp/conduit-torchelastic-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  r = run_sh(root + "CONDUIT_LOG_LEVEL=info TORCHELASTIC_RUN_ID=t1 PMIX_RANK=3 RANK=0 WORLD_SIZE=1 " +
                 "CONDUIT_STORE_PATH=" + dir + " " + kConduit + " selftest --op barrier --timeout 10",
             60);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("via file-store"), std::string::npos) << r.out;
  std::filesystem::remove_all(dir);
}

// Settings whose mix crashed or hung the ranks are compared at start-up: a smaller ring on one rank (its peer wrote
// past the end of its segment: SIGBUS), the fast allreduce's limit (the ranks waited to the deadline in different
// places). A ring size whose segment overflowed (SIGSEGV) and a /dev/shm too small for the rings (SIGBUS once a ring
// wrapped) stop with what is allowed.
TEST(Processes, SharedMemorySettingsMustAgreeAndFit) {
  const std::string selftest = kConduit + " selftest --transport shm --op allreduce --timeout 20";
  // (run_sh quotes the command in single quotes: the inner ones are double, $ escaped for the inner shell.)
  auto r = run_sh(kConduit + " launch -n 2 -- sh -c \"[ \\$RANK = 0 ] && export CONDUIT_SHM_RING_BYTES=4096; exec " +
                  selftest + "\"");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_SHM_RING_BYTES is '4096' on rank 0 but '2097152' on rank 1; allowed: the same "
                       "value on every rank"),
            std::string::npos)
      << r.out;
  r = run_sh(kConduit + " launch -n 2 -- sh -c \"[ \\$RANK = 1 ] && export CONDUIT_SHM_FAST_BYTES=0; exec " + selftest +
             "\"");
  EXPECT_NE(r.out.find("CONDUIT_SHM_FAST_BYTES is unset on rank 0 but '0' on rank 1"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
  // The largest message a rank takes, on any transport (a rank with a smaller one refused a peer's message mid-run).
  r = run_sh(kConduit + " launch -n 2 -- sh -c \"[ \\$RANK = 0 ] && export CONDUIT_MAX_MESSAGE_BYTES=2M; exec " +
             selftest + "\"");
  // (unset is its default, 16G)
  EXPECT_NE(r.out.find("CONDUIT_MAX_MESSAGE_BYTES is '2097152' on rank 0 but '17179869184' on rank 1"),
            std::string::npos)
      << r.out;
  // The same values spelled two ways agree: sizes as bytes, the debug flag unset or 0.
  r = run_sh("CONDUIT_SHM_RING_BYTES=2M " + kConduit +
             " launch -n 2 -- sh -c \"[ \\$RANK = 1 ] && export CONDUIT_SHM_RING_BYTES=2097152 " +
             "CONDUIT_DEBUG_COLLECTIVES=0; exec " + selftest + "\"");
  EXPECT_EQ(r.code, 0) << r.out;
  // So do a default given and the same setting unset (a mismatch once: a site exporting the documented default on
  // some nodes did not start).
  r = run_sh(kConduit + " launch -n 2 -- sh -c \"[ \\$RANK = 1 ] && export CONDUIT_SHM_RING_BYTES=2M " +
             "CONDUIT_RING_SEGMENT_BYTES=1048576; exec " + selftest + "\"");
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_sh("CONDUIT_SHM_RING_BYTES=524288T " + kConduit + " launch -n 2 -- " + selftest);
  EXPECT_NE(r.out.find("CONDUIT_SHM_RING_BYTES=524288T is invalid: allowed: a power of two from 4K to 1G"),
            std::string::npos)
      << r.out;
  if (geteuid() != 0 || run_sh("unshare -m sh -c \"mount -t tmpfs -o size=3M tmpfs /dev/shm\"").code != 0)
    GTEST_SKIP() << "a small /dev/shm of its own needs root and a mount namespace (unshare -m)";
  // 3 ranks with 1 MiB rings need 2 MiB each in a 3 MiB /dev/shm: the second or third rank cannot have its rings.
  r = run_sh("unshare -m sh -c \"mount -t tmpfs -o size=3M tmpfs /dev/shm && CONDUIT_SHM_RING_BYTES=1M " + kConduit +
             " launch -n 3 -- " + selftest + "\"");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("bytes of /dev/shm for segment"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("allowed: lower CONDUIT_SHM_RING_BYTES (now 1048576: each rank holds a ring per local peer) "
                       "or enlarge /dev/shm"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("signal"), std::string::npos) << r.out;
}

// Ranks of one machine in PID namespaces of their own (containers with host networking) are other hosts to shared
// memory, whose liveness checks open a peer's pid: rank 0 was told its live peer had died. They meet over tcp.
TEST(Processes, RanksInAnotherPidNamespaceAreAnotherHost) {
  if (geteuid() != 0 || run_sh("unshare -p -f true").code != 0)
    GTEST_SKIP() << "a PID namespace of its own needs root (unshare -p)";
  const std::string selftest = kConduit + " selftest --op allreduce --timeout 20";
  auto r = run_sh(kConduit + " launch -n 2 -- sh -c \"if [ \\$RANK = 1 ]; then exec unshare -p -f " + selftest +
                  "; else exec " + selftest + "; fi\"");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("0 wrong elements"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("died"), std::string::npos) << r.out;
}

// WORLD_SIZE set otherwise on one rank: every rank that meets another's value stops at once naming both (rank 1 of a
// job of 2 in a job of 3 finished its bootstrap as a job of its own; ranks 0 and 2 waited for it to the deadline).
TEST(Processes, WorldSizesMustAgree) {
  std::string dir = temp_path("sizes");
  auto r = run_sh("mkdir -p " + dir + " && for r in 0 1 2; do s=3; [ $r = 1 ] && s=2; RANK=$r WORLD_SIZE=$s " +
                  "CONDUIT_STORE_PATH=" + dir + " CONDUIT_JOB_ID=ws" + std::to_string(::getpid()) + " " + kConduit +
                  " selftest --op allreduce --timeout 20 & done; wait");
  std::system(("rm -rf " + dir).c_str());
  EXPECT_NE(r.out.find("rank 1: WORLD_SIZE is 2 here but 3 on rank 0; allowed: the same WORLD_SIZE on every rank"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rank 0: WORLD_SIZE is 3 here but 2 on rank 1"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
  // Over rank 0's TCP store as well (which outlives its own refusal by 5 s, should the others still read).
  const int port = free_port();
  r = run_sh("for r in 0 1 2; do s=3; [ $r = 1 ] && s=2; RANK=$r WORLD_SIZE=$s MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
             std::to_string(port) + " CONDUIT_JOB_ID=wt" + std::to_string(::getpid()) + " " + kConduit +
             " selftest --op allreduce --timeout 20 & done; wait");
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_NE(r.out.find("rank " + std::to_string(rank) + ": WORLD_SIZE is"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
  // Each value is checked as it is read: rank 0 of a job of 3 meeting only rank 1 of a job of 2 stops at once (it
  // waited its whole deadline for rank 2, then blamed it); a rank of a larger job among a smaller one's stops at once.
  for (const char* sizes : {"3 2", "2 2 3"}) {
    std::string d = temp_path("sizes2");
    r = run_sh("mkdir -p " + d + " && r=0; for s in " + sizes + "; do RANK=$r WORLD_SIZE=$s CONDUIT_STORE_PATH=" + d +
               " CONDUIT_JOB_ID=wz" + std::to_string(::getpid()) + " " + kConduit +
               " selftest --op allreduce --timeout 30 & r=$((r+1)); done; wait");
    std::system(("rm -rf " + d).c_str());
    if (std::string(sizes) == "3 2")
      EXPECT_NE(r.out.find("rank 0: WORLD_SIZE is 3 here but 2 on rank 1"), std::string::npos) << r.out;
    else
      EXPECT_NE(r.out.find("rank 2: WORLD_SIZE is 3 here but 2 on rank 0"), std::string::npos) << r.out;
    EXPECT_LT(r.seconds, 15) << sizes << ": " << r.out;
  }
}

TEST(Processes, FileStoreRendezvousWithoutFlags) {
  // RANK and WORLD_SIZE with CONDUIT_STORE_PATH (no MASTER_ADDR): the ranks meet through files.
  std::string dir = temp_path("store");
  std::string cmd = "mkdir -p " + dir + " && for r in 0 1 2; do RANK=$r WORLD_SIZE=3 CONDUIT_STORE_PATH=" + dir +
                    " CONDUIT_JOB_ID=fs" + std::to_string(::getpid()) + " " + kConduit +
                    " selftest --op allreduce --timeout 60 & done; wait";
  auto r = run_sh(cmd);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("on 3 ranks over shm: 0 wrong elements"), std::string::npos) << r.out;
  // The same job id in the same directory again: every rank finds its own earlier value and says so at once (it
  // read the earlier run's addresses and timed out connecting to them).
  r = run_sh(cmd);
  std::system(("rm -rf " + dir).c_str());
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_NE(r.out.find("already holds rank " + std::to_string(rank) + "'s values of job 'fs"), std::string::npos)
        << r.out;
  EXPECT_LT(r.seconds, 30) << r.out;
}

// Two processes given one rank over a TCP store (RANK set alike twice, or another job's ranks on this MASTER_PORT):
// the second to join is refused at once naming the rank and the store; it overwrote the first one's address, and
// the job's ranks connected to whichever they read. The first goes on with rank 0.
TEST(Processes, ASecondProcessForOneRankIsRefusedAtTheStore) {
  const int port = free_port();
  const std::string env = "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
                          " CONDUIT_TIMEOUT=20 CONDUIT_JOB_ID=twice" + std::to_string(::getpid()) + " ";
  // Both rank 1s wait for rank 0's store, which comes a second later: the first to claim the rank goes on.
  const std::string rank1 =
      "RANK=1 " + env + kConduit + " selftest --op allreduce --timeout 20; echo \"rank 1 exit $?\"";
  auto r = run_sh("(" + rank1 + ") & (" + rank1 + ") & sleep 1; RANK=0 " + env + kConduit +
                  " selftest --op allreduce --timeout 20; wait");
  EXPECT_NE(r.out.find("rank 1: another process already joined the store at MASTER_ADDR=127.0.0.1:" +
                       std::to_string(port) + " as rank 1 (RANK given twice"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rank 1 exit 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 exit 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("on 2 ranks over"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 20) << r.out;
  // Over a file store: the second is refused naming the rank (it was told the directory held an earlier run's
  // values when the first had published them, and went on when it had not: the store's claim counts there too).
  const std::string dir = temp_path("twice");
  const std::string fenv = "WORLD_SIZE=2 CONDUIT_STORE_PATH=" + dir + " CONDUIT_TIMEOUT=20 CONDUIT_JOB_ID=ftwice" +
                           std::to_string(::getpid()) + " ";
  const std::string frank1 =
      "RANK=1 " + fenv + kConduit + " selftest --op allreduce --timeout 20; echo \"rank 1 exit $?\"";
  r = run_sh("mkdir -p " + dir + " && (" + frank1 + ") & (" + frank1 + ") & sleep 1; RANK=0 " + fenv + kConduit +
             " selftest --op allreduce --timeout 20; wait");
  std::system(("rm -rf " + dir).c_str());
  EXPECT_TRUE(r.out.find("rank 1: another process already joined CONDUIT_STORE_PATH=" + dir + " as rank 1") !=
                  std::string::npos ||
              r.out.find("already holds rank 1's values of job 'ftwice") != std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rank 1 exit 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 exit 0"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 20) << r.out;
}

// Ranks given different CONDUIT_JOB_IDs at one TCP store: ranks of two jobs on one MASTER_PORT (two launches given
// one --master-port), which met and ran as one job (an audit: a selftest passed across two jobs' ranks); they are
// refused at once naming both ids (before that, each waited under its own id until the deadline, and rank 0 blamed
// rank 1 for a value it had published under its own). A rank given none takes rank 0's. Over a shared file store
// they cannot be told from ranks that never came, and the timeout says what to check.
TEST(Processes, RanksGivenDifferentJobIdsAreRefusedOverTcpAndToldOverAFileStore) {
  const int port = free_port();
  const std::string env =
      "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " CONDUIT_TIMEOUT=20 ";
  const std::string a = "a" + std::to_string(::getpid()), b = "b" + std::to_string(::getpid());
  auto r =
      run_sh("RANK=1 CONDUIT_JOB_ID=" + b + " " + env + kConduit + " selftest --op allreduce --timeout 20 & RANK=0 " +
             "CONDUIT_JOB_ID=" + a + " " + env + kConduit + " selftest --op allreduce --timeout 20; wait");
  EXPECT_EQ(r.out.find("on 2 ranks over"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1: CONDUIT_JOB_ID is '" + b + "' here but '" + a +
                       "' on rank 0: ranks of two jobs met "
                       "at one store (another job on this MASTER_PORT?)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("rank 0: CONDUIT_JOB_ID is '" + a + "' here but '" + b + "' on rank 1"), std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
  const int port2 = free_port();
  const std::string env2 =
      "WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port2) + " CONDUIT_TIMEOUT=20 ";
  r = run_sh("RANK=1 " + env2 + kConduit + " selftest --op allreduce --timeout 20 & RANK=0 CONDUIT_JOB_ID=" + a + " " +
             env2 + kConduit + " selftest --op allreduce --timeout 20; wait");
  EXPECT_NE(r.out.find("on 2 ranks over"), std::string::npos) << r.out;
  const std::string dir = temp_path("jobids");
  const std::string fenv = "WORLD_SIZE=2 CONDUIT_STORE_PATH=" + dir + " CONDUIT_TIMEOUT=3 ";
  r = run_sh("mkdir -p " + dir + " && (RANK=1 CONDUIT_JOB_ID=fb" + std::to_string(::getpid()) + " " + fenv + kConduit +
             " selftest --timeout 3) & RANK=0 CONDUIT_JOB_ID=fa" + std::to_string(::getpid()) + " " + fenv + kConduit +
             " selftest --timeout 3; wait");
  std::system(("rm -rf " + dir).c_str());
  EXPECT_NE(r.out.find("(looked for under CONDUIT_JOB_ID 'fa" + std::to_string(::getpid()) +
                       "': every rank of a job needs the same CONDUIT_JOB_ID, or none)"),
            std::string::npos)
      << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
}

TEST(Processes, ForcedAlgorithmsFromTheEnvironment) {
  auto r = run_sh("CONDUIT_ALLREDUCE=tree:0-1K,rhd:1K- " + kConduit + " launch -n 3 -- " + kConduit +
                  " bench coll --min-bytes 512 --max-bytes 2K --iters 2 --warmup 0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tree"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rhd"), std::string::npos) << r.out;
  auto bad = run_sh("CONDUIT_ALLREDUCE=warp " + kConduit + " launch -n 2 -- " + kConduit + " bench coll");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(
      bad.out.find("CONDUIT_ALLREDUCE: unknown allreduce algorithm 'warp': allowed are ring, rhd, rd, tree, hier"),
      std::string::npos)
      << bad.out;
  // A ring segment below 64 bytes is refused (0 was raised to 64 silently: every megabyte took 16,384 steps).
  bad = run_sh("CONDUIT_RING_SEGMENT_BYTES=0 " + kConduit + " launch -n 2 -- " + kConduit +
               " selftest --transport tcp --timeout 30");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("CONDUIT_RING_SEGMENT_BYTES='0' is 0 bytes (allowed: 64 bytes to 1G)"), std::string::npos)
      << bad.out;
  // ... and above the message limit, at start-up (a ring failed mid-run on its first segment over it).
  bad = run_sh("CONDUIT_RING_SEGMENT_BYTES=8M CONDUIT_MAX_MESSAGE_BYTES=2M " + kConduit + " launch -n 2 -- " +
               kConduit + " bench coll --op broadcast -b 1K -e 1K --transport tcp --timeout 30");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("CONDUIT_RING_SEGMENT_BYTES='8M' is 8388608 bytes, over CONDUIT_MAX_MESSAGE_BYTES = 2097152"),
            std::string::npos)
      << bad.out;
  // Under a 2 MiB message limit a 4 MiB broadcast between 2 ranks takes the chain's segments (the tree's one message
  // failed mid-run); forced to the tree, it is refused before anything is sent, naming the segmented alternative.
  const std::string small_limit = "CONDUIT_MAX_MESSAGE_BYTES=2M CONDUIT_COST_MODEL=intra=5e-6,1e-10,2.5e-10 ";
  r = run_sh(small_limit + kConduit + " launch -n 2 --timeout 60 -- " + kConduit +
             " bench coll --op broadcast --transport shm -b 1M -e 4M --iters 2 --warmup 0");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("chain"), std::string::npos) << r.out;
  bad = run_sh(small_limit + "CONDUIT_BROADCAST=tree " + kConduit + " launch -n 2 --timeout 60 -- " + kConduit +
               " bench coll --op broadcast --transport shm -b 4M -e 4M --iters 2 --warmup 0");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("broadcast of 4194304 bytes over 2 ranks: algorithm tree sends a message of 4194304 bytes, "
                         "over CONDUIT_MAX_MESSAGE_BYTES = 2097152; allowed: chain (its messages fit)"),
            std::string::npos)
      << bad.out;
  // A reduce where no algorithm fits (the tree sends the whole 8 MiB, rsg half of it to the root) is refused before
  // anything is sent, unforced too (the tuner's fallback failed mid-run and aborted the transport).
  bad = run_sh(small_limit + kConduit + " launch -n 2 --timeout 60 -- " + kConduit +
               " bench coll --op reduce --transport shm -b 8M -e 8M --iters 2 --warmup 0");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("reduce of 8388608 bytes over 2 ranks: every reduce algorithm would send a message over "
                         "CONDUIT_MAX_MESSAGE_BYTES = 2097152; allowed: a larger CONDUIT_MAX_MESSAGE_BYTES"),
            std::string::npos)
      << bad.out;
  EXPECT_EQ(bad.out.find("aborted"), std::string::npos) << bad.out;
}

// The "bytes" field of each JSON row `bench coll` printed, in order.
std::vector<std::string> row_sizes(const std::string& out) {
  std::vector<std::string> sizes;
  for (size_t at = out.find("\"bytes\":"); at != std::string::npos; at = out.find("\"bytes\":", at + 1))
    sizes.push_back(out.substr(at, out.find(',', at) - at));
  return sizes;
}

// Sizes below ranks x element size give reduce_scatter the same one-element block: it is timed and printed once.
TEST(Processes, BenchCollPrintsEachBlockSizeOnce) {
  auto r = run_sh(kConduit + " launch -n 3 -- " + kConduit +
                  " bench coll --op reduce_scatter --min-bytes 4 --max-bytes 32 --iters 2 --warmup 0 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(row_sizes(r.out), (std::vector<std::string>{"\"bytes\":12", "\"bytes\":24"})) << r.out;
  // The record says what else was measured (a --reduce max or --async run read as the default), and an --async run
  // is checked on the path it timed.
  r = run_sh(
      kConduit + " launch -n 2 -- " + kConduit +
      " bench coll --op allreduce --reduce max --async --min-bytes 64 --max-bytes 64 --iters 2 --warmup 1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* field : {"\"reduce\":\"max\"", "\"blocking\":false", "\"warmup\":1", "\"wrong\":0"})
    EXPECT_NE(r.out.find(field), std::string::npos) << field << ": " << r.out;
  EXPECT_EQ(r.out.find("\"root\""), std::string::npos) << r.out;  // (an allreduce has none)
}

// Every row lies within [--min-bytes, --max-bytes]: a gather-like op's sizes are whole blocks a rank (multiples of
// ranks x element size), so a sweep size is rounded down to one, and up to the first at or above --min-bytes (on 3
// ranks, -b 20 printed 12 bytes; on 4, -b 4 -e 8 printed 16). A range that holds none is refused in one line naming the
// smallest size there is.
TEST(Processes, BenchCollRowsLieWithinTheSizeRange) {
  auto r = run_sh(kConduit + " launch -n 3 -- " + kConduit +
                  " bench coll --op allgather -b 20 -e 40 --iters 2 --warmup 0 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(row_sizes(r.out), (std::vector<std::string>{"\"bytes\":24", "\"bytes\":36"})) << r.out;
  for (const char* op : {"allgather", "reduce_scatter", "alltoall", "gather", "scatter"}) {
    r = run_sh(kConduit + " launch -n 4 -- " + kConduit + " bench coll --op " + op + " -b 4 -e 8 --iters 2 --warmup 0");
    EXPECT_EQ(r.code, 2) << op << ": " << r.out;
    EXPECT_NE(r.out.find(std::string("--min-bytes 4 to --max-bytes 8 (4 to 8 bytes) holds no size of --op ") + op +
                         " on 4 ranks: its sizes are whole f32 elements a rank, multiples of 16 bytes, the smallest 16 "
                         "bytes; allowed: a range that holds one, e.g. --max-bytes 16"),
              std::string::npos)
        << op << ": " << r.out;
    EXPECT_EQ(r.out.find("size(B)"), std::string::npos) << op << ": " << r.out;  // (no table begun)
  }
  // Sizes between two multiples: -b 20 -e 30 holds none of 16 and 32.
  r = run_sh(kConduit + " launch -n 4 -- " + kConduit + " bench coll --op allgather -b 20 -e 30 --json");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("the smallest 16 bytes; allowed: a range that holds one, e.g. --max-bytes 32"),
            std::string::npos)
      << r.out;
  // An op of whole vectors takes any whole number of elements.
  r = run_sh(kConduit + " launch -n 4 -- " + kConduit +
             " bench coll --op allreduce -b 4 -e 8 --iters 2 --warmup 0 --json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"bytes\":4,"), std::string::npos) << r.out;
}

// Small allreduces over shm take the shared-memory fast path (checked results), larger ones an algorithm; a forced
// algorithm or CONDUIT_SHM_FAST_BYTES=0 turns the fast path off.
TEST(Processes, SmallShmAllreducesTakeTheFastPath) {
  const std::string bench = " bench coll --transport shm --min-bytes 8 --max-bytes 4K --iters 50 --warmup 2";
  // The limit depends on whether each rank has a core (1 KiB when they share, 16 KiB / ranks otherwise): pinned to
  // 1 KiB here so that the rows do not depend on the machine; the 2-rank test below covers the larger limit.
  auto r = run_sh("CONDUIT_SHM_FAST_BYTES=1024 " + kConduit + " launch -n 3 -- " + kConduit + bench +
                  " --dtype bf16 --reduce avg");
  EXPECT_EQ(r.code, 0) << r.out;
  size_t fast = 0;
  for (size_t at = r.out.find(" 0  shm-fast"); at != std::string::npos; at = r.out.find(" 0  shm-fast", at + 1))
    ++fast;
  EXPECT_EQ(fast, 8u) << r.out;  // 8 B to 1 KiB, each with 0 wrong elements
  // 2 KiB and 4 KiB: the tuner's message algorithm (which one depends on the measured cost model), no errors.
  for (const char* size : {" 2048 ", " 4096 "}) {
    size_t at = r.out.find(size);
    ASSERT_NE(at, std::string::npos) << r.out;
    std::string row = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_EQ(row.find("shm-fast"), std::string::npos) << row;
    EXPECT_NE(row.find(" 0  "), std::string::npos) << row;
  }
  for (const char* off : {"CONDUIT_SHM_FAST_BYTES=0 ", "CONDUIT_ALLREDUCE=ring "}) {
    auto o = run_sh(off + kConduit + " launch -n 2 -- " + kConduit + bench);
    EXPECT_EQ(o.code, 0) << o.out;
    EXPECT_EQ(o.out.find("shm-fast"), std::string::npos) << off << o.out;
  }
}

// With a core per rank the fast path takes up to 16 KiB / ranks (8 KiB for 2 ranks); the results are checked.
TEST(Processes, TwoRanksWithACoreEachTakeTheFastPathUpTo8K) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs a core per rank";
  auto r = run_sh(kConduit + " launch -n 2 -- " + kConduit +
                  " bench coll --transport shm --min-bytes 2K --max-bytes 16K --iters 20 --warmup 2 --dtype bf16");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* size : {" 2048 ", " 4096 ", " 8192 "}) {
    size_t at = r.out.find(size);
    ASSERT_NE(at, std::string::npos) << r.out;
    std::string row = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(row.find(" 0  shm-fast"), std::string::npos) << row;
  }
  size_t at = r.out.find(" 16384 ");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::string row = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_EQ(row.find("shm-fast"), std::string::npos) << row;
  EXPECT_NE(row.find(" 0  "), std::string::npos) << row;
  // Launched on one CPU (taskset; a container's cpuset or quota alike) the two ranks share it: the launcher passes
  // the CPUs it has (CONDUIT_LOCAL_CPUS), and 2 KiB leaves the fast path.
  if (std::system("command -v taskset >/dev/null 2>&1") != 0) return;
  auto one = run_sh("taskset -c 0 " + kConduit + " launch -n 2 -- " + kConduit +
                    " bench coll --transport shm --min-bytes 2K --max-bytes 2K --iters 20 --warmup 2");
  EXPECT_EQ(one.code, 0) << one.out;
  at = one.out.find(" 2048 ");
  ASSERT_NE(at, std::string::npos) << one.out;
  row = one.out.substr(at, one.out.find('\n', at) - at);
  EXPECT_EQ(row.find("shm-fast"), std::string::npos) << row;
  EXPECT_NE(row.find(" 0  "), std::string::npos) << row;
}

// `bench coll --stagger-us`: the last rank calls late; the records say so (what `sim calibrate` reads to fit the wake
// latency) and the correctness check still passes. A bad value is one line naming the flag and the allowed range.
TEST(Processes, StaggeredBenchCallsAreMarkedAndChecked) {
  auto r = run_sh(kConduit + " launch -n 2 --no-tag-output -- " + kConduit +
                  " bench coll --transport shm --algo ring -b 1K -e 2K -n 3 -w 1 --json --stagger-us 300");
  EXPECT_EQ(r.code, 0) << r.out;
  size_t marked = 0;
  for (size_t at = r.out.find("\"stagger_us\":300"); at != std::string::npos;
       at = r.out.find("\"stagger_us\":300", at + 1))
    ++marked;
  EXPECT_EQ(marked, 2u) << r.out;  // 1 KiB and 2 KiB
  EXPECT_NE(r.out.find("\"wrong\":0"), std::string::npos) << r.out;
  EXPECT_NE(run_sh(kConduit + " bench coll --warmup 2147483647 --stagger-us 10").out.find("--warmup must be in"),
            std::string::npos);  // it overflowed the loop count and crashed reading an empty sample list
  auto bad = run_sh(kConduit + " bench coll --stagger-us -5");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--stagger-us = -5 (allowed: 0..1000000 microseconds)"), std::string::npos) << bad.out;
  auto late = run_sh(kConduit + " bench coll --stagger-us 600000 --timeout 0.5");
  EXPECT_NE(late.code, 0);
  EXPECT_NE(late.out.find("--stagger-us = 600000 is not below the collective deadline (0.5 s, --timeout)"),
            std::string::npos)
      << late.out;
}

// The number after "key": in a JSON line (NaN when absent).
double json_number(const std::string& line, const std::string& key) {
  size_t at = line.find("\"" + key + "\":");
  return at == std::string::npos ? std::nan("") : std::strtod(line.c_str() + at + key.size() + 3, nullptr);
}

// Back-to-back `bench coll` records carry the median and the slowest single call beside the mean: median <= max,
// and no call is longer than all of them together (mean x iterations); the table prints them as columns.
TEST(Processes, BenchCollReportsTheMedianAndSlowestCall) {
  auto r = run_sh(kConduit + " launch -n 2 --no-tag-output -- " + kConduit +
                  " bench coll --transport shm -b 4K -e 64K -n 30 -w 2 --json --no-check");
  EXPECT_EQ(r.code, 0) << r.out;
  std::istringstream lines(r.out);
  int records = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("\"impl\":\"conduit\"") == std::string::npos) continue;
    ++records;
    const double mean = json_number(line, "time_us"), med = json_number(line, "median_us"),
                 max = json_number(line, "max_us");
    EXPECT_GT(med, 0) << line;
    EXPECT_LE(med, max) << line;
    EXPECT_LE(max, mean * 30 * 1.0001) << line;
  }
  EXPECT_EQ(records, 5) << r.out;  // 4 KiB to 64 KiB
  // Bus bandwidth as nccl-tests defines it: gather and scatter move (n-1)/n of the buffer (they said 1).
  for (const char* op : {"gather", "scatter", "allgather"}) {
    auto g = run_sh("CONDUIT_RING_SEGMENT_BYTES=8K " + kConduit + " launch -n 2 --no-tag-output -- " + kConduit +
                    " bench coll --op " + op + " --transport shm -b 4K -e 4K -n 3 -w 1 --json");
    const size_t at = g.out.find("\"impl\":\"conduit\"");
    ASSERT_NE(at, std::string::npos) << g.out;
    const std::string line = g.out.substr(g.out.rfind('\n', at) + 1);
    EXPECT_NEAR(json_number(line, "busbw_gbs") / json_number(line, "algbw_gbs"), 0.5, 1e-9) << op << line;
    // (the segment the run used: `sim calibrate` times the chain broadcast's segments with it)
    EXPECT_EQ(json_number(line, "segment_bytes"), 8192) << line;
  }
  // One rank moves nothing over a bus: 0, as nccl-tests and the peers say (it said algbw, the peers 0).
  auto one = run_sh(kConduit + " bench coll -b 4K -e 4K -n 3 -w 1 --json");
  const size_t at = one.out.find("\"impl\":\"conduit\"");
  ASSERT_NE(at, std::string::npos) << one.out;
  EXPECT_EQ(json_number(one.out.substr(one.out.rfind('\n', at) + 1), "busbw_gbs"), 0) << one.out;
  auto table = run_sh(kConduit + " launch -n 2 -- " + kConduit + " bench coll --transport shm -b 1K -e 1K -n 5");
  EXPECT_EQ(table.code, 0) << table.out;
  EXPECT_NE(table.out.find("time(us)    p50(us)    max(us)"), std::string::npos) << table.out;
}

// The redop column and the header's reduce name the reduction where the operation has one, and `-` where it reduces
// nothing (allgather, broadcast, ... printed `sum`, as if they summed).
TEST(Processes, BenchCollNamesAReductionOnlyWhereOneRuns) {
  // The redop column of the table's one row (size, count, type, redop, ...).
  auto redop = [](const std::string& out) {
    std::istringstream lines(out);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] == '#' || line.find("size(B)") != std::string::npos) continue;
      std::istringstream cols(line);
      std::string size, count, type, op;
      if (cols >> size >> count >> type >> op) return op;
    }
    return std::string("no row");
  };
  for (const char* op : {"allgather", "broadcast", "alltoall", "gather", "scatter"}) {
    auto r = run_sh(kConduit + " bench coll --op " + op + " -b 1K -e 1K -n 2 -w 0");
    EXPECT_EQ(r.code, 0) << op << ": " << r.out;
    EXPECT_NE(r.out.find("dtype f32, reduce -, iters 2"), std::string::npos) << op << ": " << r.out;
    EXPECT_EQ(redop(r.out), "-") << op << ": " << r.out;
  }
  for (auto [op, rop] :
       {std::pair{"allreduce", "sum"}, std::pair{"reduce_scatter", "max"}, std::pair{"reduce", "min"}}) {
    auto r = run_sh(kConduit + " bench coll --op " + op + " --reduce " + rop + " -b 1K -e 1K -n 2 -w 0");
    EXPECT_EQ(r.code, 0) << op << ": " << r.out;
    EXPECT_NE(r.out.find(std::string("dtype f32, reduce ") + rop + ", iters 2"), std::string::npos) << op << r.out;
    EXPECT_EQ(redop(r.out), rop) << op << ": " << r.out;
  }
}

// Flags of bench coll and selftest that once passed silently: --timeout 0/nan (the default was used), an unknown
// selftest --op (0 cases, exit 0), a rank to crash that does not exist, sizes that are not whole elements or cannot
// fit in memory (std::bad_alloc halfway through the sweep).
TEST(Processes, BenchAndSelftestFlagsAreChecked) {
  struct Case {
    std::string args, expect;
  };
  for (const Case& c :
       {Case{"bench coll --timeout 0", "--timeout = 0 (allowed: seconds from 0.001 to 1000000)"},
        Case{"bench coll --timeout nan", "--timeout: 'nan': a decimal number"},
        Case{"bench coll --timeout 0x10", "--timeout: '0x10': a decimal number"},
        Case{"selftest --timeout -1", "--timeout = -1 (allowed: seconds from 0.001 to 1000000)"},
        Case{"selftest --timeout 0.0001", "--timeout = 0.0001 (allowed: seconds from 0.001 to 1000000)"},
        Case{"selftest --op foo", "--op 'foo' is not supported: allowed are all, allreduce"},
        Case{"selftest --crash-rank 5", "--crash-rank 5 is not a rank of [0, 1)"},
        Case{"bench coll -b 3 -e 3", "--min-bytes 3 is not a whole number of f32 elements (4 bytes each)"},
        Case{"bench coll -b 0 -e 0", "--max-bytes 0 is not a message size; allowed: at least one f32 element"},
        Case{"bench coll -b 1000G -e 1000G", "--max-bytes 1000G needs about"},
        // The core parsers' messages named the value, not the flag it came from.
        Case{"bench coll --dtype f8", "--dtype = 'f8': unknown dtype; allowed: f32, f64, f16, bf16, i8, u8, i32, i64"},
        Case{"bench coll --reduce xor", "--reduce = 'xor': unknown reduction; allowed: sum, avg, min, max, prod"},
        Case{"bench coll --algo foo",
             "--algo = 'foo': unknown allreduce algorithm; allowed: ring, rhd, rd, tree, hier"},
        Case{"bench coll --op allgather --algo rhd", "--algo = 'rhd': unknown allgather algorithm; allowed: ring, rd"},
        // Every rank on the host needs its buffers (1 GiB passed for 64 ranks on this 24 GB machine).
        Case{"env LOCAL_WORLD_SIZE=64 " + kConduit + " bench coll -e 1G", "GB per rank, 64 ranks on this host"},
        // A conv shape's error names the flag it came from (it named --layers-spec).
        Case{"bench gemm --shapes conv:", "--shapes: 'conv:'"},
        // Digits only in MxNxK (sscanf took a sign and a space, and overflowed a long side undefined).
        Case{"bench gemm --shapes +4x4x4", "--shapes: '+4x4x4' is not allowed"},
        Case{"bench gemm --shapes \"4x 4x4\"", "--shapes: '4x 4x4' is not allowed"},
        Case{"bench gemm --shapes 4x4x99999999999999999999", "--shapes: '4x4x99999999999999999999' is not allowed"}}) {
    auto r = run_sh(c.args.rfind("env ", 0) == 0 ? c.args : kConduit + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << ": " << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << ": " << r.out;
  }
}

// Environment values that cannot work are refused with one line naming the variable and what it takes: a job id
// with a '/' (it names /dev/shm segments; it failed with a hint about another job), and a message limit below what
// start-up itself sends (64K failed every job with an error that blamed the peer).
TEST(Processes, RendezvousEnvironmentIsChecked) {
  auto r = run_sh("CONDUIT_JOB_ID=team/a " + kConduit + " selftest --op allreduce");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_JOB_ID='team/a' is invalid: expected 1 to 200 letters, digits"), std::string::npos)
      << r.out;
  r = run_sh("CONDUIT_MAX_MESSAGE_BYTES=64K " + kConduit + " launch -n 2 -- " + kConduit +
             " selftest --op allreduce --transport tcp --timeout 20");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_MAX_MESSAGE_BYTES='64K' is invalid: expected a size from 2M to 1T"), std::string::npos)
      << r.out;
  // A port inside MASTER_ADDR is refused at once (ranks other than 0 retried it to the deadline), an IPv6 address
  // is not mistaken for one; torchrun's agent store is named (rank 0 could not bind its port).
  const std::string rank1 = "RANK=1 WORLD_SIZE=2 MASTER_PORT=1 CONDUIT_TIMEOUT=30 ";
  auto t0 = std::chrono::steady_clock::now();
  r = run_sh(rank1 + "MASTER_ADDR=127.0.0.1:29500 " + kConduit + " selftest --op allreduce");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("MASTER_ADDR='127.0.0.1:29500' holds a port"), std::string::npos) << r.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  r = run_sh(rank1 + "CONDUIT_TIMEOUT=0.5 MASTER_ADDR=::1 " + kConduit + " selftest --op allreduce");
  EXPECT_EQ(r.out.find("holds a port"), std::string::npos) << r.out;
  // The any-address names no host (it was taken as loopback on every rank: ranks on other hosts dialled their own).
  for (const char* any : {"0.0.0.0", "::", "[::]", "0", "0x0", "::ffff:0.0.0.0"}) {
    r = run_sh(rank1 + "MASTER_ADDR=" + any + " " + kConduit + " selftest --op allreduce");
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(std::string("MASTER_ADDR='") + any + "' is the any-address"), std::string::npos) << r.out;
  }
  r = run_sh(rank1 + "MASTER_ADDR=127.0.0.1 TORCHELASTIC_USE_AGENT_STORE=True " + kConduit +
             " selftest --op allreduce");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"), std::string::npos) << r.out;
  // The shm settings are checked whatever the transport (over tcp, or one rank a host, they were never read), and a
  // size that is not one names what is allowed.
  r = run_sh("CONDUIT_SHM_RING_BYTES=3M " + kConduit + " launch -n 2 -- " + kConduit +
             " selftest --op barrier --transport tcp --timeout 20");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_SHM_RING_BYTES=3M is invalid: allowed: a power of two from 4K to 1G"),
            std::string::npos)
      << r.out;
  r = run_sh("CONDUIT_SHM_SINGLE_COPY_BYTES=lots " + kConduit + " launch -n 2 -- " + kConduit +
             " selftest --op barrier --transport tcp --timeout 20");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("is not a size: expected a non-negative number with an optional K, M, G or T suffix (powers "
                       "of 1024), e.g. 4096, 64K, 4M, 1G; allowed: 'off' or a size from 4K"),
            std::string::npos)
      << r.out;
  r = run_sh("CONDUIT_SHM_UNEXPECTED_BYTES=-1 " + kConduit + " launch -n 2 -- " + kConduit +
             " selftest --op barrier --transport tcp --timeout 20");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_SHM_UNEXPECTED_BYTES '-1' is not a size"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; allowed: 0 to 1T"), std::string::npos) << r.out;
  // A file store's path beside MASTER_ADDR is not taken, and rank 0 says so (it was dropped without a word).
  r = run_sh("RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
             " CONDUIT_STORE_PATH=/nonexistent/store " + kConduit + " selftest --op barrier --timeout 20");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_STORE_PATH=/nonexistent/store is not used: MASTER_ADDR/MASTER_PORT are set"),
            std::string::npos)
      << r.out;
}

// Starts `n` ranks by hand (no launcher, so nothing stops the survivors for us) and reaps them as they exit. Rank 0
// (which serves the store) starts `rank0_late_s` seconds after the others.
std::vector<Result> run_ranks_by_hand(int n, const std::string& transport, const std::string& extra, double timeout,
                                      int rank0_late_s = 0) {
  int port = free_port();
  std::string job = "t" + std::to_string(::getpid()) + transport;
  std::vector<pid_t> pids(n);
  std::vector<std::string> outs(n);
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < n; ++r) {
    outs[r] = temp_path("rank" + std::to_string(r) + transport);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("CONDUIT_JOB_ID", job.c_str(), 1);
      std::string cmd = (r == 0 && rank0_late_s > 0 ? "sleep " + std::to_string(rank0_late_s) + "; " : "") + "exec " +
                        kConduit + " selftest --transport " + transport + " --timeout " + std::to_string(timeout) +
                        " " + extra + " > " + outs[r] + " 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    pids[r] = pid;
  }
  std::vector<Result> res(n);
  int left = n;
  while (left > 0) {
    int status = 0;
    pid_t p = waitpid(-1, &status, 0);
    if (p < 0) break;
    for (int r = 0; r < n; ++r)
      if (pids[r] == p) {
        res[r].code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        res[r].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        --left;
      }
  }
  for (int r = 0; r < n; ++r) {
    res[r].out = slurp(outs[r]);
    std::remove(outs[r].c_str());
  }
  return res;
}

// Two hosts of two ranks, shm inside and tcp across: rank 0 gives up after 3 s (ranks 2 and 3 never take part) and
// aborts; rank 1 hears it through shm, and its tcp requests, waiting on the other host, fail with it (they waited for
// rank 1's own 25 s deadline, and its error named a silent rank, not rank 0's abort).
TEST(Processes, AnAbortHeardOverShmFailsTheTcpRequestsToo) {
  const std::string env = "WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(free_port()) +
                          " CONDUIT_JOB_ID=relay" + std::to_string(::getpid()) + " ";
  auto rank = [&](int r, const std::string& flags) {
    return "(RANK=" + std::to_string(r) + " CONDUIT_HOST_ID=h" + std::to_string(r / 2) + " " + env + kConduit +
           " selftest --op allreduce " + flags + " > /dev/null 2>&1) & ";
  };
  // (the hanging ranks sleep 7 s: the whole command takes that long when rank 1 stops with rank 0)
  auto r = run_sh(rank(2, "--hang-rank 2 --timeout 6") + rank(3, "--hang-rank 3 --timeout 6") + rank(0, "--timeout 3") +
                  "RANK=1 CONDUIT_HOST_ID=h0 " + env + kConduit +
                  " selftest --op allreduce --timeout 25; echo \"rank 1 exit $?\"; wait");
  EXPECT_NE(r.out.find("rank 0 aborted"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 exit "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("rank 1 exit 0"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 15) << r.out;
}

class Failures : public ::testing::TestWithParam<std::string> {};

TEST_P(Failures, KilledPeerFailsTheOthersFastNamingTheOperation) {
  // Rank 1 dies before its first collective; the deadline is 60 s but the survivors must fail well before it.
  auto res = run_ranks_by_hand(3, GetParam(), "--crash-rank 1", 60);
  EXPECT_EQ(res[1].code, 3) << res[1].out;
  for (int r : {0, 2}) {
    EXPECT_NE(res[r].code, 0) << res[r].out;
    EXPECT_LT(res[r].seconds, 30) << res[r].out;
    EXPECT_NE(res[r].out.find("conduit: error: "), std::string::npos) << res[r].out;
    EXPECT_NE(res[r].out.find(" #"), std::string::npos) << res[r].out;
    EXPECT_NE(res[r].out.find("rank 1"), std::string::npos) << res[r].out;
  }
}

TEST_P(Failures, ExpiredDeadlineNamesTheSilentRank) {
  auto res = run_ranks_by_hand(3, GetParam(), "--hang-rank 2", 2);
  for (int r : {0, 1}) {
    EXPECT_NE(res[r].code, 0) << res[r].out;
    EXPECT_LT(res[r].seconds, 20) << res[r].out;
    EXPECT_NE(res[r].out.find("failed after"), std::string::npos) << res[r].out;
  }
  // Rank 1's ring predecessor is rank 0 and rank 0's is rank 2: the one that waited on rank 2 names it.
  bool named = res[0].out.find("rank(s) 2") != std::string::npos || res[1].out.find("rank(s) 2") != std::string::npos;
  EXPECT_TRUE(named) << res[0].out << "\n---\n" << res[1].out;
  bool timed_out = res[0].out.find("deadline") != std::string::npos ||
                   res[1].out.find("deadline") != std::string::npos;
  EXPECT_TRUE(timed_out) << res[0].out << "\n---\n" << res[1].out;
}

// A collective's deadline does not bound start-up: rank 0 (the store's server) starting 6 s after rank 1 under a
// 3 s deadline failed rank 1 ("could not connect to the server ... before the deadline"); start-up waits
// CONDUIT_TIMEOUT (here 30 s) when that is longer, and both ranks pass.
TEST_P(Failures, ARankStartingLaterThanTheCollectiveDeadlineStillJoins) {
  setenv("CONDUIT_TIMEOUT", "30", 1);
  auto res = run_ranks_by_hand(2, GetParam(), "--op allreduce", 3, 6);
  unsetenv("CONDUIT_TIMEOUT");
  for (int r : {0, 1}) EXPECT_EQ(res[r].code, 0) << "rank " << r << ": " << res[r].out;
  EXPECT_EQ(res[1].out.find("before the deadline"), std::string::npos) << res[1].out;
}

INSTANTIATE_TEST_SUITE_P(Transports, Failures, ::testing::Values("tcp", "shm"));

}  // namespace
