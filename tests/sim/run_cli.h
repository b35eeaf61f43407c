#pragma once
// Runs the `conduit` binary with `args` (stderr into stdout) for the simulator's command-line tests.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

namespace conduit::sim::test_util {

// The combined output; *rc receives the exit code.
inline std::string run(const std::string& args, int* rc) {
  std::string cmd = std::string(CONDUIT_BINARY) + " " + args + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p.get())) > 0) out.append(buf.data(), n);
  *rc = WEXITSTATUS(pclose(p.release()));
  return out;
}

}  // namespace conduit::sim::test_util
