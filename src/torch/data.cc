// IDX reader (zlib), synthetic data and the distributed sampler (torch-free).
#include "torch/data.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <thread>

#include "core/env.h"
#include "core/error.h"

namespace conduit::train {
namespace {

// The largest file the reader takes, decompressed (Fashion-MNIST's training images are 47 MB): a corrupt or
// hostile gzip stream that inflates without end is an error, not an exhausted memory.
constexpr size_t kMaxIdxBytes = size_t{4} << 30;

// Opens a data file for gzread (which reads plain files too). A pipe (data another process writes) is read whole
// by `until` (default: start-up's deadline from now, CONDUIT_TIMEOUT or 300 s): gzopen waited for a writer for
// ever. Directories, devices and sockets are refused.
gzFile open_data(const std::string& path, std::chrono::steady_clock::time_point until) {
  struct stat s {};
  if (::stat(path.c_str(), &s) != 0) throw ConfigError(fmt::format("data: cannot open '{}'", path));
  if (S_ISREG(s.st_mode)) {
    gzFile f = gzopen(path.c_str(), "rb");
    if (!f) throw ConfigError(fmt::format("data: cannot open '{}'", path));
    return f;
  }
  if (!S_ISFIFO(s.st_mode))
    throw ConfigError(fmt::format(
        "data: '{}' is not a regular file (a directory, device or socket); allowed: an IDX file, plain or gzipped",
        path));
  // (each descriptor closed on every way out)
  struct Fd {
    int fd;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  };
  Fd in{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  if (in.fd < 0) throw ConfigError(fmt::format("data: cannot open '{}'", path));
  if (until == std::chrono::steady_clock::time_point{})
    until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                   std::chrono::duration<double>(startup_timeout_seconds(0)));
  // The whole pipe is read here, against the deadline, into a memory file that zlib then reads: handed to gzdopen
  // once its first bytes came, a writer that stalled held the worker without a deadline.
  Fd mem{::memfd_create("conduit-data", MFD_CLOEXEC)};
  if (mem.fd < 0)
    throw ConfigError(fmt::format("data: cannot hold the pipe '{}' in memory: {}", path, std::strerror(errno)));
  const auto waiting = std::chrono::steady_clock::now();
  size_t size = 0;
  for (;;) {
    // The deadline is checked on every turn: a writer that came and closed the pipe without writing left it
    // reporting a hang-up at once, and one writing without end never let a wait time out.
    if (std::chrono::steady_clock::now() >= until) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
      if (size == 0)
        throw ConfigError(fmt::format(
            "data: '{}' is a pipe nothing wrote to in {:.0f} s, by start-up's deadline (the longer of --timeout-s "
            "and CONDUIT_TIMEOUT, 300 s unset); allowed: an IDX file, plain or gzipped, or a pipe written to in time",
            path, waited));
      throw ConfigError(fmt::format(
          "data: the pipe '{}' was not written whole in {:.0f} s, by start-up's deadline (the longer of --timeout-s "
          "and CONDUIT_TIMEOUT, 300 s unset): {} bytes came, and its writer has not closed it; allowed: a pipe "
          "written whole and closed in time",
          path, waited, size));
    }
    char buf[1 << 16];
    const ssize_t got = ::read(in.fd, buf, sizeof buf);
    if (got > 0) {
      if (size + size_t(got) > kMaxIdxBytes)
        throw ConfigError(
            fmt::format("data: the pipe '{}' holds more than 4 GiB; allowed: an IDX file of at most 4 GiB", path));
      for (ssize_t at = 0; at < got;) {
        const ssize_t w = ::write(mem.fd, buf + at, size_t(got - at));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
          throw ConfigError(fmt::format("data: cannot hold the pipe '{}' in memory: {}", path,
                                        std::strerror(w < 0 ? errno : ENOSPC)));
        at += w;
      }
      size += size_t(got);
      continue;
    }
    if (got == 0 && size > 0) break;  // the writer closed it (0 before any byte: no writer yet, or one that left)
    if (got < 0 && errno != EAGAIN && errno != EINTR)
      throw ConfigError(fmt::format("data: cannot read the pipe '{}': {}", path, std::strerror(errno)));
    const double left = std::chrono::duration<double>(until - std::chrono::steady_clock::now()).count();
    pollfd p{in.fd, POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::clamp(left * 1000, 1.0, 1e9)));
    if (rc < 0 && errno != EINTR)
      throw ConfigError(fmt::format("data: cannot wait for the pipe '{}': {}", path, std::strerror(errno)));
    // (a writer that left before writing: the hang-up stays until another opens it; waited for, not spun on)
    if (rc > 0 && (p.revents & POLLHUP) && !(p.revents & POLLIN))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::lseek(mem.fd, 0, SEEK_SET);
  gzFile f = gzdopen(mem.fd, "rb");
  if (!f) throw ConfigError(fmt::format("data: cannot open '{}'", path));
  mem.fd = -1;  // (gzclose closes it)
  return f;
}

// Reads the whole (inflated) file. `expected(head)` is asked after each chunk until it returns the file's size from
// its header (0: not enough of it yet): from then on the buffer holds exactly that much and a byte more fails at
// once (a small gzip file inflating to 4 GiB was read whole, and copied, before its header was compared).
std::vector<uint8_t> read_gz_file(const std::string& path, std::chrono::steady_clock::time_point until,
                                  const std::function<size_t(std::span<const uint8_t>)>& expected) {
  gzFile f = open_data(path, until);
  std::vector<uint8_t> out;
  uint8_t buf[1 << 16];
  auto fail = [&](std::string why) {
    gzclose(f);
    if (why.rfind(path + ": ", 0) == 0) why = why.substr(path.size() + 2);  // zlib's message names the file too
    return InvalidArgument(
        fmt::format("data: '{}' is corrupt ({}); allowed: a whole IDX file, plain or gzipped", path, why));
  };
  size_t size = 0;  // from the header, once known
  bool longer = false;
  for (;;) {
    int got = gzread(f, buf, sizeof buf);
    if (got < 0) {
      int err = 0;
      std::string msg = gzerror(f, &err);
      throw fail(msg);
    }
    if (got == 0) break;
    if (out.size() + size_t(got) > kMaxIdxBytes) throw fail("it inflates past 4 GiB");
    out.insert(out.end(), buf, buf + got);
    if (size == 0) {
      try {
        size = expected(out);
      } catch (...) {
        gzclose(f);
        throw;
      }
      // (up to 64 MiB at once: a header is not trusted with gigabytes before its data has come)
      if (size > 0) out.reserve(std::min(size, size_t{64} << 20));
    }
    if (size > 0 && out.size() > size) {
      longer = true;  // (refused below, without reading the rest)
      break;
    }
  }
  if (longer) {
    gzclose(f);
    throw InvalidArgument(fmt::format(
        "data: '{}' is longer than its header says: more than the {} bytes of header and data it gives (allowed: "
        "exactly that many)",
        path, size));
  }
  // A gzip stream cut short (no CRC and length trailer) reads as a quiet end of file: zlib says so only here.
  int err = Z_OK;
  const char* msg = gzerror(f, &err);
  if (err != Z_OK) throw fail(msg ? msg : "read error");
  if (gzclose(f) != Z_OK)
    throw InvalidArgument(
        fmt::format("data: '{}' is corrupt (its gzip trailer does not check out); allowed: a whole "
                    "IDX file, plain or gzipped",
                    path));
  return out;
}

uint32_t be32(const uint8_t* p) { return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3]; }

std::string find_file(const std::string& dir, const std::string& base) {
  namespace fs = std::filesystem;
  fs::path p = fs::path(dir) / base;
  if (fs::exists(p.string() + ".gz")) return p.string() + ".gz";
  if (fs::exists(p)) return p.string();
  throw ConfigError(fmt::format("data: '{}' has no {}[.gz]", dir, base));
}

}  // namespace

int64_t mnist_format_train_count(const std::string& dir) {
  const std::string path = find_file(dir, "train-labels-idx1-ubyte");
  // (its header read here and the whole file again by the workers: a pipe's bytes would be gone, and it waited for a
  // writer for ever, before any worker started)
  if (!std::filesystem::is_regular_file(path))
    throw ConfigError(fmt::format(
        "data: '{}' is not a regular file; allowed: an IDX file, plain or gzipped (the labels are read twice)", path));
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) return -1;
  uint8_t h[8] = {};
  const int got = gzread(f, h, sizeof h);
  gzclose(f);
  if (got != 8 || h[0] != 0 || h[1] != 0 || h[2] != 0x08 || h[3] != 1) return -1;
  return be32(h + 4);
}

IdxArray read_idx(const std::string& path, std::chrono::steady_clock::time_point until) {
  IdxArray a;
  size_t off = 0, total = 1;
  // The header, checked as soon as its bytes are in: the file's size (header + data), or 0 while it is incomplete.
  auto header = [&](std::span<const uint8_t> bytes) -> size_t {
    if (bytes.size() < 4) return 0;
    if (bytes[0] != 0 || bytes[1] != 0)
      throw InvalidArgument(
          fmt::format("data: '{}' is not an IDX file: it starts with {:02x} {:02x}; allowed: 00 00 "
                      "08 <dims>",
                      path, bytes[0], bytes[1]));
    if (bytes[2] != 0x08)
      throw InvalidArgument(
          fmt::format("data: '{}': IDX type 0x{:02x} is not supported (only unsigned bytes, 0x08)", path, bytes[2]));
    const int nd = bytes[3];
    if (nd < 1)
      throw InvalidArgument(fmt::format("data: '{}': the IDX header has 0 dimensions; allowed: 1 or more", path));
    off = 4 + 4 * size_t(nd);
    if (bytes.size() < off) return 0;
    a.dims.clear();
    total = 1;
    for (int i = 0; i < nd; ++i) {
      a.dims.push_back(be32(&bytes[4 + 4 * size_t(i)]));
      // (a product past 2^64 wrapped: [2^31, 2^31, 4] with no data passed)
      if (a.dims.back() != 0 && total > kMaxIdxBytes / a.dims.back())
        throw InvalidArgument(fmt::format("data: '{}': the IDX dimensions multiply past 4 GiB", path));
      total *= a.dims.back();
    }
    // (an empty array: nothing may follow the header; 0 would mean "not known yet")
    return off + total;
  };
  auto bytes = read_gz_file(path, until, header);
  if (bytes.size() < 4)
    throw InvalidArgument(
        fmt::format("data: '{}' is not an IDX file: it starts with {} byte(s) only; allowed: 00 00 "
                    "08 <dims>",
                    path, bytes.size()));
  if (bytes.size() < off)
    throw InvalidArgument(fmt::format("data: '{}': truncated IDX header ({} dimensions need {} bytes, the file has {})",
                                      path, bytes[3], off, bytes.size()));
  if (bytes.size() - off != total)
    throw InvalidArgument(fmt::format(
        "data: '{}' is {}: {} data bytes, the header says {} (allowed: exactly that many)", path,
        bytes.size() - off < total ? "truncated" : "longer than its header says", bytes.size() - off, total));
  // (the data moved down over the header in place: a second copy of the file doubled the peak)
  bytes.erase(bytes.begin(), bytes.begin() + std::ptrdiff_t(off));
  a.data = std::move(bytes);
  return a;
}

ImageSet load_mnist_format(const std::string& dir, bool train, int64_t limit,
                           std::chrono::steady_clock::time_point until) {
  std::string pre = train ? "train" : "t10k";
  auto img_path = find_file(dir, pre + "-images-idx3-ubyte");
  auto lab_path = find_file(dir, pre + "-labels-idx1-ubyte");
  IdxArray img = read_idx(img_path, until), lab = read_idx(lab_path, until);
  if (img.dims.size() != 3) throw InvalidArgument(fmt::format("data: '{}' is not 3-D (n x rows x cols)", img_path));
  if (img.dims[1] != 28 || img.dims[2] != 28)
    throw InvalidArgument(fmt::format("data: '{}' has {}x{} images; allowed: 28x28 (the models' input)", img_path,
                                      img.dims[1], img.dims[2]));
  if (lab.dims.size() != 1)
    throw InvalidArgument(
        fmt::format("data: '{}' is not a label file: it has {} dimensions, labels have 1", lab_path, lab.dims.size()));
  if (lab.dims[0] != img.dims[0])
    throw InvalidArgument(fmt::format("data: '{}' has {} labels for {} images", lab_path, lab.dims[0], img.dims[0]));
  if (img.dims[0] == 0)  // (an empty test set reported 0% accuracy and exited 0)
    throw InvalidArgument(
        fmt::format("data: '{}' holds 0 images; allowed: at least 1 ({} set)", img_path, train ? "training" : "test"));
  ImageSet s;
  s.n = img.dims[0];
  s.rows = img.dims[1];
  s.cols = img.dims[2];
  s.pixels = std::move(img.data);
  s.labels = std::move(lab.data);
  for (auto l : s.labels)
    if (l >= 10) throw InvalidArgument(fmt::format("data: '{}' has label {} (allowed 0..9)", lab_path, int(l)));
  if (limit > 0 && limit < s.n) {
    s.n = limit;
    s.pixels.resize(size_t(limit * s.rows * s.cols));
    s.labels.resize(size_t(limit));
  }
  // Mean and standard deviation of the training pixels (scaled to [0, 1]).
  double sum = 0, sq = 0;
  for (auto p : s.pixels) {
    sum += p;
    sq += double(p) * p;
  }
  double cnt = double(s.pixels.size());
  double m = sum / cnt / 255.0;
  double var = sq / cnt / (255.0 * 255.0) - m * m;
  s.mean = float(m);
  s.stddev = float(std::sqrt(std::max(var, 1e-6)));
  return s;
}

ImageSet make_synthetic(int64_t n, uint64_t seed, bool train) {
  ImageSet s;
  s.n = n;
  s.rows = s.cols = 28;
  const size_t px = 28 * 28;
  std::mt19937_64 proto_rng(seed * 7919 + 17);
  std::vector<float> proto(10 * px);
  for (auto& p : proto) p = float(proto_rng() % 256);
  std::mt19937_64 rng(seed * 104729 + (train ? 1 : 2));
  s.pixels.resize(size_t(n) * px);
  s.labels.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    int label = int(rng() % 10);
    s.labels[i] = uint8_t(label);
    for (size_t k = 0; k < px; ++k) {
      int noise = int(rng() % 161) - 80;
      int v = int(proto[label * px + k]) + noise;
      s.pixels[size_t(i) * px + k] = uint8_t(std::clamp(v, 0, 255));
    }
  }
  s.mean = 0.5f;
  s.stddev = 0.3f;
  return s;
}

DistributedSampler::DistributedSampler(int64_t n, int world, int rank, uint64_t seed, bool shuffle)
    : n_(n), per_rank_(world >= 1 ? n / world : 0), world_(world), rank_(rank), seed_(seed), shuffle_(shuffle) {
  if (world < 1 || rank < 0 || rank >= world)  // (checked after the division, world 0 was a SIGFPE)
    throw InvalidArgument(fmt::format("sampler: rank {} of world {} is out of range", rank, world));
  set_epoch(0);
}

void DistributedSampler::set_epoch(int64_t epoch) {
  perm_.resize(size_t(n_));
  for (int64_t i = 0; i < n_; ++i) perm_[size_t(i)] = i;
  if (!shuffle_) return;
  // Fisher-Yates with an explicit draw, so every rank and every standard library gets the same permutation.
  std::mt19937_64 rng(seed_ ^ (0x9E3779B97F4A7C15ull * uint64_t(epoch + 1)));
  for (int64_t i = n_ - 1; i > 0; --i) {
    int64_t j = int64_t(rng() % uint64_t(i + 1));
    std::swap(perm_[size_t(i)], perm_[size_t(j)]);
  }
}

std::vector<int64_t> DistributedSampler::batch(int64_t step, int64_t batch) const {
  std::vector<int64_t> out;
  out.reserve(size_t(batch));
  for (int64_t j = 0; j < batch; ++j) {
    int64_t local = step * batch + j;
    if (local >= per_rank_) break;
    out.push_back(perm_[size_t(local * world_ + rank_)]);
  }
  return out;
}

TrainTestSets load_train_test(const std::string& dataset, const std::string& data_dir, int64_t train_limit,
                              int64_t test_limit, int64_t synthetic_samples, uint64_t seed, double timeout_s) {
  TrainTestSets d;
  if (dataset == "synthetic") {
    d.train = make_synthetic(synthetic_samples, seed, true);
    d.test = make_synthetic(std::max<int64_t>(synthetic_samples / 4, 1), seed, false);
    if (train_limit > 0 && train_limit < d.train.n) d.train.n = train_limit;
    if (test_limit > 0 && test_limit < d.test.n) d.test.n = test_limit;
  } else {
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(startup_timeout_seconds(timeout_s)));
    d.train = load_mnist_format(data_dir, true, train_limit, until);
    d.test = load_mnist_format(data_dir, false, test_limit, until);
    d.test.mean = d.train.mean;
    d.test.stddev = d.train.stddev;
  }
  return d;
}

}  // namespace conduit::train
