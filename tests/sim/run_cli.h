#pragma once
// The simulator tests' helpers: the `conduit` binary run with `args` (stderr into stdout) for the command-line tests,
// and the message of the ConfigError a call throws.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "core/error.h"

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

// What `f` throws as a ConfigError ("no error" when it returns).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace conduit::sim::test_util
