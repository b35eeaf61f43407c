// Compressed collectives over real processes (`conduit launch`: tcp, shm; mpirun: mpi), on the world communicator
// and on a split, each method checked against decompress-then-reduce by `conduit selftest-compress`.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace {

const std::string kConduit = CONDUIT_BINARY;

struct Result {
  int code = -1;
  std::string out;
};

Result run_sh(const std::string& cmd, int limit_s = 240) {
  std::string out = "/tmp/conduit-compress-test-" + std::to_string(::getpid()) + ".txt";
  std::string full = "timeout -k 5 " + std::to_string(limit_s) + " sh -c '" + cmd + "' > " + out + " 2>&1";
  int rc = std::system(full.c_str());
  Result r;
  r.code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream f(out);
  std::stringstream ss;
  ss << f.rdbuf();
  r.out = ss.str();
  std::remove(out.c_str());
  return r;
}

}  // namespace

TEST(Processes, CompressedCollectivesOverTcp) {
  auto r = run_sh(kConduit + " launch -n 3 -- " + kConduit + " selftest-compress --transport tcp --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("on 3 ranks over tcp: 0 wrong elements"), std::string::npos) << r.out;
}

TEST(Processes, CompressedCollectivesOverShm) {
  auto r = run_sh(kConduit + " launch -n 4 -- " + kConduit + " selftest-compress --transport shm --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("on 4 ranks over shm: 0 wrong elements"), std::string::npos) << r.out;
}

TEST(Processes, CompressedCollectivesUnderMpirunOverMpi) {
  auto r = run_sh("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 3 " +
                  kConduit + " selftest-compress --transport mpi --timeout 60");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("on 3 ranks over mpi: 0 wrong elements"), std::string::npos) << r.out;
}
