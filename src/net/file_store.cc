// File rendezvous store: a directory on a file system every rank sees (a shared mount, or /tmp on one host).
// Each key is a file "k_<escaped key>", and a claim on a key the empty file "c_<escaped key>"; a value is written to a
// temporary file of its own (created with O_EXCL, named with 64 random bits) and renamed over the key's file, so
// readers see either no file or the whole value. add() holds flock() on "<dir>/.lock" around its read-modify-write.
// get() polls with a growing pause (1 ms to 50 ms) until the key appears, a rank publishes its failure under the
// failure key, or the deadline passes.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "net/store.h"

namespace conduit::net {
namespace {

// The host name and pid that temporary file names carry, when a test sets them (empty: the real ones).
std::mutex g_identity_mu;
std::string g_identity_host;
long g_identity_pid = 0;

// 64 bits from the kernel's random source, drawn anew for every call (a forked child draws its own, where a
// generator seeded once would repeat its parent's names), as 16 hex digits.
std::string random_hex() {
  uint64_t v = 0;
  auto* p = reinterpret_cast<unsigned char*>(&v);
  size_t got = 0;
  while (got < sizeof v) {
    ssize_t n = ::getrandom(p + got, sizeof v - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      break;
    }
  }
  if (got < sizeof v) {  // a kernel without getrandom (before 3.17)
    const int e = errno;
    int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? ::read(fd, &v, sizeof v) : -1;
    if (fd >= 0) ::close(fd);
    if (n != static_cast<ssize_t>(sizeof v))
      throw Error(fmt::format("file store: no random bytes for a temporary file name (getrandom: {}; /dev/urandom: {})",
                              std::strerror(e), n < 0 ? std::strerror(errno) : "short read"));
  }
  return fmt::format("{:016x}", v);
}

constexpr size_t kMaxNameBytes = 200;  // well below NAME_MAX (255) with the prefix and a hash suffix

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// `prefix` then the key: letters, digits, '-', '_' and '.' stay; every other byte becomes %XX. Very long names keep
// their head and get a hash of the whole key appended, so distinct keys stay distinct files. Values are "k_" files,
// claims "c_" files: a claim named by a suffix ("k_<key>.claim") was the value file of the key "<key>.claim", so a
// set of that key made the claim fail and a claim made that key appear, empty.
std::string escape_key(const std::string& key, const char* prefix = "k_") {
  std::string out = prefix;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  if (out.size() > kMaxNameBytes) out = fmt::format("{}~{:016x}", out.substr(0, kMaxNameBytes - 17), fnv1a(key));
  return out;
}

class FileStore : public Store {
 public:
  FileStore(std::string dir, std::string failure_key) : dir_(std::move(dir)), failure_key_(std::move(failure_key)) {
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
    struct stat st {};
    if (dir_.empty() || stat(dir_.c_str(), &st) != 0) {
      throw ConfigError(
          fmt::format("file store: directory '{}' does not exist ({}); create it on a file system "
                      "every rank can see",
                      dir_, dir_.empty() ? "empty path" : std::strerror(errno)));
    }
    if (!S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("file store: '{}' is not a directory", dir_));
    if (access(dir_.c_str(), R_OK | W_OK | X_OK) != 0) {
      throw ConfigError(fmt::format("file store: directory '{}' is not writable: {}", dir_, std::strerror(errno)));
    }
  }

  void set(const std::string& key, const std::string& value, const Deadline&) override {
    if (value.size() > kMaxStoreFieldBytes)
      throw InvalidArgument(fmt::format("file store: the value of key '{}' is {} bytes; allowed: up to {}",
                                        key.substr(0, 64), value.size(), kMaxStoreFieldBytes));
    write_atomic(key, value);
  }

  std::string get(const std::string& key, const Deadline& deadline) override {
    auto pause = std::chrono::microseconds(1000);
    Stopwatch sw;
    double failure_checked = -1;
    while (true) {
      std::string v;
      if (read(key, &v)) return v;
      // (a rank that failed said why: the key waited for will not come; found by an audit, the others waited for it
      // until their deadline and then blamed the rank that was missing. Looked for every 0.25 s, not every poll: a
      // missing file's lookup on a network file system goes to the server)
      const bool look = !failure_key_.empty() && key != failure_key_ && sw.seconds() - failure_checked >= 0.25;
      if (look) failure_checked = sw.seconds();
      if (look && read(failure_key_, &v))
        throw PeerError(fmt::format("{} (published in the file store {} while this rank waited for key '{}')", v, dir_,
                                    key.substr(0, 200)));
      if (deadline.expired()) {
        throw TimeoutError(
            fmt::format("file store {}: key '{}' did not appear within {:.1f}s", dir_, key, sw.seconds()));
      }
      // (clamped before the cast: Deadline::never()'s remaining time overflowed the microseconds, undefined; where
      // that gave a negative pause (GCC -O0, clang), a get without a deadline spun a core on open())
      std::this_thread::sleep_for(deadline.remaining_at_most(pause));
      pause = std::min(pause * 2, std::chrono::microseconds(50000));
    }
  }

  bool claim(const std::string& key, const Deadline&) override {
    const std::string path = dir_ + "/" + escape_key(key, "c_");
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::close(fd);
      return true;
    }
    if (errno == EEXIST) return false;
    throw Error(fmt::format("file store {}: cannot claim key '{}': {}", dir_, key.substr(0, 64), std::strerror(errno)));
  }

  int64_t add(const std::string& key, int64_t delta, const Deadline& deadline) override {
    std::string lock_path = dir_ + "/.lock";
    int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(fmt::format("file store: cannot open {}: {}", lock_path, std::strerror(errno)));
    // Polled, with the caller's deadline: a holder that hangs (a stale lock on a network file system) must not
    // hang every rank's rendezvous.
    Stopwatch waited;
    auto pause = std::chrono::microseconds(100);
    while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e != EINTR && e != EWOULDBLOCK) {
        close(fd);
        throw Error(fmt::format("file store: flock on {} failed: {}", lock_path, std::strerror(e)));
      }
      if (deadline.expired()) {
        close(fd);
        throw TimeoutError(fmt::format("file store {}: the lock {} stayed held for {:.1f} s (add on key '{}')", dir_,
                                       lock_path, waited.seconds(), key));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(2000));
    }
    try {
      int64_t cur = 0;
      std::string v;
      if (read(key, &v)) {
        // (all of it: strtoll took " +7" as 7, and "5\0x" as 5, stopping at the NUL)
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), cur);
        if (v.empty() || ec != std::errc() || end != v.data() + v.size()) {
          throw InvalidArgument(fmt::format("file store {}: add on key '{}' whose value is not an integer", dir_, key));
        }
      }
      int64_t next = 0;
      if (__builtin_add_overflow(cur, delta, &next))  // (it wrapped silently)
        throw InvalidArgument(
            fmt::format("file store {}: add of {} on key '{}' (value {}) would overflow a 64-bit "
                        "integer",
                        dir_, delta, key, cur));
      write_atomic(key, std::to_string(next));
      flock(fd, LOCK_UN);
      close(fd);
      return next;
    } catch (...) {
      flock(fd, LOCK_UN);
      close(fd);
      throw;
    }
  }

  bool check(const std::string& key, const Deadline&) override {
    std::string path = dir_ + "/" + escape_key(key);
    return access(path.c_str(), F_OK) == 0;
  }

 private:
  bool read(const std::string& key, std::string* out) {
    std::string path = dir_ + "/" + escape_key(key);
    // Non-blocking, then only a regular file is read: a FIFO under a key's name blocked open() (and a read) with no
    // deadline, and a device such as /dev/zero filled memory.
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      if (errno == ENOENT) return false;
      throw Error(fmt::format("file store: cannot read key '{}' from {}: {}", key, path, std::strerror(errno)));
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      close(fd);
      throw Error(
          fmt::format("file store: key '{}' is {}, not a regular file; allowed: the files this store writes "
                      "(another program's file under its name?)",
                      key, path));
    }
    out->clear();
    char buf[65536];
    while (true) {
      ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n > 0) {
        out->append(buf, static_cast<size_t>(n));
        if (out->size() > kMaxStoreFieldBytes) {
          close(fd);
          throw Error(fmt::format("file store: key '{}' ({}) holds more than {} bytes; allowed: values up to that", key,
                                  path, kMaxStoreFieldBytes));
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      int e = errno;
      close(fd);
      if (n < 0) throw Error(fmt::format("file store: reading {} failed: {}", path, std::strerror(e)));
      return true;
    }
  }

  void write_atomic(const std::string& key, const std::string& value) {
    std::string path = dir_ + "/" + escape_key(key);
    // Unique across everything that shares the directory: host name and pid say who wrote a file left behind, and
    // do not tell two containers apart (same host name, pid 1 in each); 64 random bits do. O_EXCL makes even a
    // repeated name fail here instead of truncating another writer's file (the name had host, pid and a counter,
    // opened with O_TRUNC: two such containers wrote into one file and published each other's torn values).
    std::string host = host_;
    long pid = static_cast<long>(getpid());
    {
      std::lock_guard<std::mutex> lk(g_identity_mu);
      if (!g_identity_host.empty()) {
        host = g_identity_host;
        pid = g_identity_pid;
      }
    }
    std::string tmp;
    int fd = -1;
    for (int attempt = 0; fd < 0; ++attempt) {
      tmp = fmt::format("{}/.tmp.{}.{}.{}", dir_, host, pid, random_hex());
      fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd < 0 && (errno != EEXIST || attempt == 8)) {
        throw Error(fmt::format("file store: cannot write key '{}' into {}: {}", key, dir_, std::strerror(errno)));
      }
    }
    size_t off = 0;
    while (off < value.size()) {
      ssize_t n = ::write(fd, value.data() + off, value.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        int e = n == 0 ? EIO : errno;  // (a write of 0 bytes sets no errno)
        close(fd);
        unlink(tmp.c_str());
        throw Error(fmt::format("file store: writing key '{}' into {} failed: {}", key, dir_, std::strerror(e)));
      }
      off += static_cast<size_t>(n);
    }
    // A network file system may report a failed write (quota, space, I/O) only here: publishing the file anyway
    // would hand other ranks a truncated value.
    if (close(fd) != 0 && errno != EINTR) {
      int e = errno;
      unlink(tmp.c_str());
      throw Error(fmt::format("file store: writing key '{}' into {} failed: {}", key, dir_, std::strerror(e)));
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
      int e = errno;
      unlink(tmp.c_str());
      throw Error(fmt::format("file store: renaming {} to {} failed: {}", tmp, path, std::strerror(e)));
    }
  }

  std::string dir_;
  std::string failure_key_;  // where a failed rank publishes why (empty: none)
  std::string host_ = [] {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    std::string h;
    for (char* p = name; *p; ++p) h += std::isalnum(static_cast<unsigned char>(*p)) || *p == '-' ? *p : '_';
    return h;
  }();
};

}  // namespace

StorePtr make_file_store(const std::string& dir, const std::string& failure_key) {
  return std::make_shared<FileStore>(dir, failure_key);
}

// Test hook (net/store.h): every file store of this process names its
// temporary files with this host name and pid, as two containers sharing the directory may both have; an empty host
// restores the real ones.
void set_file_store_identity_for_testing(const std::string& host, long pid) {
  std::lock_guard<std::mutex> lk(g_identity_mu);
  g_identity_host = host;
  g_identity_pid = pid;
}

}  // namespace conduit::net
