#pragma once
// Folders for one test program, removed when it ends, passed or failed (a failed ASSERT returns before a test's own
// removal, and the folders of training runs stayed in /tmp).
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace conduit::test {

// A new empty folder <tmp>/<prefix>-<pid>-<name> (an earlier one of that name emptied).
inline std::filesystem::path temp_dir(const std::string& prefix, const std::string& name) {
  struct TempDirs {
    std::vector<std::filesystem::path> paths;
    ~TempDirs() {
      std::error_code ec;
      for (const auto& p : paths) std::filesystem::remove_all(p, ec);
    }
  };
  static TempDirs made;
  std::filesystem::path p =
      std::filesystem::temp_directory_path() / (prefix + "-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  made.paths.push_back(p);
  return p;
}

}  // namespace conduit::test
