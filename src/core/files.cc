#include "core/files.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace conduit {

void write_text_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw ConfigError(fmt::format("output: cannot write '{}'", path));
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
