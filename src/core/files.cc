#include "core/files.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace conduit {

uint64_t raise_open_file_limit(uint64_t want) {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 1024;
  if (lim.rlim_cur < lim.rlim_max && lim.rlim_cur < want) {
    rlimit raised = lim;
    raised.rlim_cur = std::min<rlim_t>(lim.rlim_max, static_cast<rlim_t>(want));
    // (an infinite hard limit is refused above fs.nr_open: then as far as that allows)
    if (::setrlimit(RLIMIT_NOFILE, &raised) != 0 && lim.rlim_max == RLIM_INFINITY) {
      std::ifstream nr("/proc/sys/fs/nr_open");
      rlim_t most = 0;
      if (nr >> most && most > lim.rlim_cur) {
        raised.rlim_cur = std::min<rlim_t>(most, static_cast<rlim_t>(want));
        ::setrlimit(RLIMIT_NOFILE, &raised);
      }
    }
    ::getrlimit(RLIMIT_NOFILE, &lim);
  }
  return lim.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(lim.rlim_cur);
}

void make_output_dir(const std::string& path, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec)
    throw ConfigError(
        fmt::format("{}: cannot create the directory '{}' ({}); allowed: a directory that exists or can be "
                    "made",
                    what, path, ec.message()));
}

std::string read_input_file(const std::string& path, const std::string& what, const std::string& allowed) {
  // What it is, asked of the path (a device is never opened: opening some has effects) and again of what was opened
  // (without blocking: a FIFO's open waits for a writer; nor as a controlling terminal): the path's answer alone left
  // a moment for a FIFO to be put in its place.
  struct stat st {};
  auto refuse_kind = [&](const struct stat& s) {
    if (S_ISDIR(s.st_mode)) throw ConfigError(fmt::format("{}: '{}' is a directory; allowed: {}", what, path, allowed));
    if (!S_ISREG(s.st_mode))
      throw ConfigError(
          fmt::format("{}: '{}' is not a regular file (a pipe, device or socket); allowed: {}", what, path, allowed));
  };
  if (::stat(path.c_str(), &st) == 0) refuse_kind(st);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0)
    throw ConfigError(fmt::format("{}: cannot read '{}' ({}); allowed: {}", what, path, std::strerror(errno), allowed));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (::fstat(fd, &st) != 0)
    throw ConfigError(fmt::format("{}: cannot read '{}' ({}); allowed: {}", what, path, std::strerror(errno), allowed));
  refuse_kind(st);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // (a regular file: reads as a plain one)
  constexpr size_t kMax = size_t(1) << 30;
  auto too_large = [&]() {
    return ConfigError(fmt::format("{}: '{}' holds over 1 GiB; allowed: {}, up to 1 GiB", what, path, allowed));
  };
  if (static_cast<uintmax_t>(st.st_size) > kMax) throw too_large();
  // In pieces up to the bound: a regular file that says 0 bytes (/proc's) may hold far more.
  std::string text;
  std::vector<char> piece(size_t(1) << 20);
  while (true) {
    const ssize_t got = ::read(fd, piece.data(), piece.size());
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      throw ConfigError(
          fmt::format("{}: cannot read '{}' ({}); allowed: {}", what, path, std::strerror(errno), allowed));
    if (got == 0) break;
    if (text.size() + static_cast<size_t>(got) > kMax) throw too_large();
    text.append(piece.data(), static_cast<size_t>(got));
  }
  return text;
}

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
  // On disk before its name is, and the rename after: a power loss or kernel crash could leave the new name on an
  // empty file (the rename reached the disk before the data), or the old text, under files that a resume trusts
  // (metrics.jsonl trimmed to the checkpoint, checkpoint.json).
  try {
    sync_path(tmp);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("output: cannot put '{}' in place: {}", path, std::strerror(e)));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  sync_path(dir.empty() ? "." : dir);
}

void sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("output: cannot open '{}' to sync it: {}", path, std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  // EINVAL: a file system without fsync for this kind of file (some directories): nothing more to do there.
  if (rc != 0 && e != EINVAL && e != EROFS)
    throw Error(fmt::format("output: syncing '{}' to disk failed: {}", path, std::strerror(e)));
}

void sync_tree(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> dirs;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_symlink()) continue;
    if (e.is_directory())
      dirs.push_back(e.path().string());
    else if (e.is_regular_file())
      sync_path(e.path().string());
  }
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) sync_path(*it);
  sync_path(dir);
}

}  // namespace conduit
