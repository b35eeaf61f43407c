#pragma once
// A shell command run with a time limit, for the tests that start processes: its exit code, its output and stderr
// together, and its wall time.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace conduit::test {

struct ShellResult {
  int code = -1;  // the command's exit code; -1 when it did not exit (a signal); 124 when the limit stopped it
  std::string out;
  double seconds = 0;
};

// `cmd` under sh -c (quoted in single quotes: use double quotes inside), killed after `limit_s` (and SIGKILLed 5 s
// later); its output goes through a file of its own, removed after.
inline ShellResult run_shell(const std::string& cmd, int limit_s) {
  char path[] = "/tmp/conduit-test-out-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd >= 0) ::close(fd);
  const std::string full = "timeout -k 5 " + std::to_string(limit_s) + " sh -c '" + cmd + "' > " + path + " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = std::system(full.c_str());
  ShellResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  r.out = ss.str();
  std::remove(path);
  return r;
}

}  // namespace conduit::test
