#include "core/files.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace conduit {

void write_text_file(const std::string& path, const std::string& text) {
  // A temporary name of this process and call: two writers of one file (ranks, threads) shared "<path>.tmp" and
  // renamed each other's half-written text into place.
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = fmt::format("{}.tmp{}-{}", path, static_cast<long>(::getpid()), serial++);
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw ConfigError(fmt::format("output: cannot write '{}': {}", path, std::strerror(errno)));
    f << text;
    f.close();
    // A failed write (a full disk) left a partial file that was then renamed into place.
    if (!f) {
      std::remove(tmp.c_str());
      throw Error(fmt::format("output: writing '{}' failed (a full disk?)", path));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("output: cannot put '{}' in place: {}", path, std::strerror(e)));
  }
}

}  // namespace conduit
