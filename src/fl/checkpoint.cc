// Checkpoints of a federation (checkpoint.h): two file kinds (and the DP ledger), each magic, version, fields, an end
// mark that a cut file lacks, and the CRC-32 (zlib's) of every byte before it, checked before the fields are read.
#include "fl/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/files.h"
#include "fl/server_opt.h"

namespace conduit::fl {
namespace {

namespace fs = std::filesystem;

// 2: the CRC-32 trailer (version 1 files have none and are refused: nothing in them could be told from damage).
constexpr uint64_t kVersion = 2;
constexpr char kServerMagic[8] = {'C', 'D', 'F', 'L', 'S', 'R', 'V', '1'};
constexpr char kHostMagic[8] = {'C', 'D', 'F', 'L', 'H', 'S', 'T', '1'};
constexpr char kEndMagic[8] = {'C', 'D', 'F', 'L', 'E', 'N', 'D', '1'};
constexpr char kLedgerMagic[8] = {'C', 'D', 'F', 'L', 'D', 'P', 'L', '1'};
constexpr const char* kLedgerName = "dp-ledger.bin";
std::atomic<double> g_host_read_delay_for_testing{0};  // (set_host_checkpoint_read_delay_for_testing)

// (zlib takes a null buffer as a request for the initial value, whatever crc is: an empty block, whose data() may be
// null, would restart the sum)
uint32_t crc_update(uint32_t crc, const void* p, size_t n) {
  return n == 0 ? crc : uint32_t(::crc32_z(crc, static_cast<const Bytef*>(p), n));
}

// A file being written, and the CRC-32 of what went into it (computed from the bytes handed over, not read back).
class Sink {
 public:
  explicit Sink(std::ofstream& f) : f_(f) {}
  void write(const void* p, size_t n) {
    f_.write(static_cast<const char*>(p), std::streamsize(n));
    crc_ = crc_update(crc_, p, n);
  }
  uint32_t crc() const { return crc_; }

 private:
  std::ofstream& f_;
  uint32_t crc_ = 0;  // (CRC-32's initial value)
};

// Writes through `fill` to a temporary name, then renames it into place (whole, or an Error naming the path).
template <class F>
void write_whole(const fs::path& path, F&& fill) {
  static std::atomic<uint64_t> serial{0};
  const std::string tmp = fmt::format("{}.tmp{}-{}", path.string(), long(::getpid()), serial++);
  try {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(fmt::format("fl: checkpoint: cannot write '{}': {}", path.string(), std::strerror(errno)));
    Sink o(f);
    fill(o);
    o.write(kEndMagic, 8);
    const uint32_t crc = o.crc();
    f.write(reinterpret_cast<const char*>(&crc), 4);
    f.close();
    if (!f) throw Error(fmt::format("fl: checkpoint: writing '{}' failed (a full disk?)", path.string()));
    sync_path(tmp);  // (on disk before its name is: a power loss leaves the old generation, not a cut file)
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("fl: checkpoint: cannot put '{}' in place: {}", path.string(), std::strerror(e)));
  }
  sync_path(path.parent_path().string());
}

template <class T>
void put(Sink& o, const T& v) {
  o.write(&v, sizeof v);
}
void put_bytes(Sink& o, const void* p, size_t n) {
  put(o, uint64_t(n));
  o.write(p, n);
}

// Reads a file's fields in order, every read checked against what is left.
class Reader {
 public:
  explicit Reader(const fs::path& p) : path_(p.string()) {
    // (opening a pipe of a checkpoint's name blocked for ever)
    std::error_code ec;
    if (fs::exists(p, ec) && !fs::is_regular_file(p, ec))
      throw ConfigError(
          fmt::format("fl: resume: '{}' is not a regular file; allowed: a checkpoint folder conduit fl "
                      "wrote",
                      path_));
    f_.open(p, std::ios::binary);
    if (!f_)
      throw ConfigError(fmt::format("fl: resume: cannot read '{}': {}; allowed: a readable checkpoint folder", path_,
                                    std::strerror(errno)));
    f_.seekg(0, std::ios::end);
    size_ = left_ = uint64_t(f_.tellg());
    f_.seekg(0);
  }
  // The magic and the version, then the checksum of the whole file, before any field is read.
  void header(const char (&m)[8], const char* what) {
    magic(m, what);
    if (const uint64_t v = get<uint64_t>(); v != kVersion)
      // (the version is read before the checksum can be: a damaged one reads as another conduit's, said so)
      bad(v < kVersion ? fmt::format("has format version {}, an earlier conduit's without a checksum (or the file is "
                                     "damaged)",
                                     v)
                       : fmt::format("has format version {}, a later conduit's (or the file is damaged)", v));
    if (left_ < 8 + 4) bad(fmt::format("is cut short ({} bytes)", size_));
    const uint64_t body = size_ - 4;
    f_.seekg(0);
    std::vector<char> buf(size_t(1) << 20);
    uint32_t crc = 0;
    for (uint64_t done = 0; done < body;) {
      const size_t k = size_t(std::min<uint64_t>(buf.size(), body - done));
      f_.read(buf.data(), std::streamsize(k));
      if (!f_) bad("could not be read to its end");
      crc = crc_update(crc, buf.data(), k);
      done += k;
    }
    uint32_t written = 0;
    f_.read(reinterpret_cast<char*>(&written), 4);
    if (!f_) bad("could not be read to its end");
    if (crc != written)
      bad(
          fmt::format("fails its checksum (CRC-32 {:08x}, written {:08x}): it changed after it was written (a "
                      "damaged disk or copy, a cut file)",
                      crc, written));
    f_.seekg(std::streamoff(size_ - left_));
    left_ -= 4;  // (the checksum: the fields end at the end mark)
  }
  void magic(const char (&m)[8], const char* what) {
    char b[8];
    raw(b, 8);
    if (std::memcmp(b, m, 8) != 0) bad(fmt::format("is not a {}", what));
  }
  template <class T>
  T get() {
    T v;
    raw(&v, sizeof v);
    return v;
  }
  // A length-prefixed block of at most `max` bytes.
  uint64_t length(uint64_t max) {
    const uint64_t n = get<uint64_t>();
    if (n > left_ || n > max) bad(fmt::format("announces {} bytes with {} left", n, left_));
    return n;
  }
  void raw(void* p, uint64_t n) {
    if (n > left_) bad(fmt::format("is cut short ({} bytes more needed, {} left)", n, left_));
    f_.read(static_cast<char*>(p), std::streamsize(n));
    if (!f_) bad("could not be read to its end");
    left_ -= n;
  }
  uint64_t left() const { return left_; }
  void end() {
    magic(kEndMagic, "checkpoint whose end mark is in place");
    if (left_ != 0) bad(fmt::format("has {} bytes after its end mark", left_));
  }
  [[noreturn]] void bad(const std::string& what) const {
    throw ProtocolError(
        fmt::format("fl: resume: '{}' {}; allowed: a checkpoint this version of conduit wrote", path_, what));
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ifstream f_;
  uint64_t size_ = 0, left_ = 0;
};

std::vector<float> floats(Reader& r) {
  const uint64_t bytes = r.length(r.left());
  if (bytes % 4) r.bad(fmt::format("holds a float block of {} bytes", bytes));
  std::vector<float> v(bytes / 4);
  r.raw(v.data(), bytes);
  // (weights and control variates are finite when written: a damaged file's surfaced as "local training diverged")
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      r.bad(fmt::format("holds a value that is not finite ({}, float {} of a block of {})", v[i], i, v.size()));
  return v;
}

// Rounds of the files named <prefix><round>.bin in dir, ascending.
std::vector<int64_t> rounds_of(const fs::path& dir, const std::string& prefix) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() + 4 || name.compare(0, prefix.size(), prefix) != 0 ||
        name.compare(name.size() - 4, 4, ".bin") != 0)
      continue;
    const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - 4);
    if (digits.empty() || digits.size() > 12 || (digits.size() > 1 && digits[0] == '0') ||
        !std::all_of(digits.begin(), digits.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
      continue;
    out.push_back(std::stoll(digits));
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string host_prefix(int64_t rank) { return fmt::format("host-{}-", rank); }

// The files of `prefix` below round `below`.
void remove_below(const fs::path& dir, const std::string& prefix, int64_t below) {
  for (int64_t r : rounds_of(dir, prefix))
    if (r < below) {
      std::error_code ec;
      fs::remove(dir / fmt::format("{}{}.bin", prefix, r), ec);
    }
}

bool hosts_complete(const fs::path& dir, int64_t round, int64_t host_files) {
  std::error_code ec;
  for (int64_t h = 1; h <= host_files; ++h)
    if (!fs::exists(dir / fmt::format("{}{}.bin", host_prefix(h), round), ec)) return false;
  return true;
}

ServerCheckpoint read_server(const fs::path& p) {
  Reader r(p);
  r.header(kServerMagic, "server checkpoint");
  ServerCheckpoint s;
  s.round = r.get<int64_t>();
  const uint64_t cfg = r.length(1 << 24);
  s.config_json.resize(cfg);
  r.raw(s.config_json.data(), cfg);
  s.weights = floats(r);
  s.control = floats(r);
  const uint64_t opt = r.length(r.left());
  s.optimizer.resize(opt);
  r.raw(s.optimizer.data(), opt);
  s.accountant_steps = r.get<int64_t>();
  s.step_s = r.get<double>();
  s.rounds_applied = r.get<int64_t>();
  s.host_files = r.get<int64_t>();
  s.samples = r.get<int64_t>();
  s.data_hash = r.get<uint64_t>();
  r.end();
  if (s.round < 1 || s.accountant_steps < 0 || s.rounds_applied < 0 || s.rounds_applied > s.round || s.host_files < 0 ||
      s.host_files > 4096 || !(std::isfinite(s.step_s) && s.step_s >= 0) || s.weights.empty() ||
      (!s.control.empty() && s.control.size() != s.weights.size()))
    r.bad(fmt::format("holds inconsistent fields (round {}, {} weights, {} control, {} host files, step {} s)", s.round,
                      s.weights.size(), s.control.size(), s.host_files, s.step_s));
  return s;
}

}  // namespace

std::string checkpoint_dir(const std::string& output) { return (fs::path(output) / "checkpoints").string(); }

bool holds_checkpoints(const std::string& dir) { return !rounds_of(dir, "server-").empty(); }

std::string resume_checkpoint_dir(const std::string& resume) {
  std::error_code ec;
  const std::string sub = checkpoint_dir(resume);
  return fs::is_directory(sub, ec) ? sub : resume;
}

void write_dp_ledger(const std::string& dir, int64_t accountant_steps) {
  fs::create_directories(dir);
  write_whole(fs::path(dir) / kLedgerName, [&](Sink& o) {
    o.write(kLedgerMagic, 8);
    put(o, kVersion);
    put(o, accountant_steps);
  });
}

int64_t read_dp_ledger(const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::path(dir) / kLedgerName;
  if (!fs::exists(p, ec)) return 0;
  Reader r(p);
  r.header(kLedgerMagic, "differential privacy ledger");
  const int64_t steps = r.get<int64_t>();
  if (steps < 0) r.bad(fmt::format("counts {} rounds", steps));
  r.end();
  return steps;
}

void check_dp_ledger_writable(const std::string& dir) {
  // (a file made and removed: the ledger's own write makes a temporary file there and renames it over the ledger)
  static std::atomic<uint64_t> serial{0};
  const fs::path probe = fs::path(dir) / fmt::format(".{}.probe{}-{}", kLedgerName, long(::getpid()), serial++);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    throw ConfigError(fmt::format(
        "fl: resume: cannot write in '{}' ({}): a resume under differential privacy raises the privacy ledger of the "
        "checkpoints it resumed from ({}), so that another resume from them counts this run's releases; allowed: a "
        "writable checkpoint folder (a writable copy of a read-only one)",
        dir, std::strerror(errno), kLedgerName));
  ::close(fd);
  ::unlink(probe.c_str());
}

void write_server_checkpoint(const std::string& dir, const ServerCheckpoint& s) {
  fs::create_directories(dir);
  write_whole(fs::path(dir) / fmt::format("server-{}.bin", s.round), [&](Sink& o) {
    o.write(kServerMagic, 8);
    put(o, kVersion);
    put(o, s.round);
    put_bytes(o, s.config_json.data(), s.config_json.size());
    put_bytes(o, s.weights.data(), s.weights.size() * 4);
    put_bytes(o, s.control.data(), s.control.size() * 4);
    put_bytes(o, s.optimizer.data(), s.optimizer.size());
    put(o, s.accountant_steps);
    put(o, s.step_s);
    put(o, s.rounds_applied);
    put(o, s.host_files);
    put(o, s.samples);
    put(o, s.data_hash);
  });
  // Keeps this generation and the newest complete one before it (the hosts may still be writing this one's files):
  // older server files go; the hosts remove their files below the oldest server file left.
  const std::vector<int64_t> rounds = rounds_of(dir, "server-");
  for (auto it = rounds.rbegin(); it != rounds.rend(); ++it)
    if (*it < s.round && hosts_complete(dir, *it, s.host_files)) {
      remove_below(dir, "server-", *it);
      break;
    }
}

void write_host_checkpoint(const std::string& dir, int rank, int64_t round,
                           const std::map<int, std::vector<float>>& control, size_t n) {
  fs::create_directories(dir);
  write_whole(fs::path(dir) / fmt::format("{}{}.bin", host_prefix(rank), round), [&](Sink& o) {
    o.write(kHostMagic, 8);
    put(o, kVersion);
    put(o, round);
    put(o, int64_t(rank));
    put(o, uint64_t(n));
    put(o, uint64_t(control.size()));
    for (const auto& [client, v] : control) {
      if (v.size() != n)
        throw Error(
            fmt::format("fl: checkpoint: client {}'s control variate has {} elements, not {}", client, v.size(), n));
      put(o, int64_t(client));
      o.write(v.data(), n * 4);
    }
  });
  const std::vector<int64_t> servers = rounds_of(dir, "server-");
  if (!servers.empty()) remove_below(dir, host_prefix(rank), std::min(servers.front(), round));
}

ServerCheckpoint read_latest_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw ConfigError(
        fmt::format("fl: resume: '{}' is not a folder of checkpoints; allowed: <output>/checkpoints of a run with "
                    "--checkpoint-every > 0 (or that run's output folder)",
                    dir));
  std::vector<int64_t> rounds = rounds_of(dir, "server-");
  for (auto it = rounds.rbegin(); it != rounds.rend(); ++it) {
    ServerCheckpoint s = read_server(fs::path(dir) / fmt::format("server-{}.bin", *it));
    if (s.round != *it)
      throw ProtocolError(fmt::format("fl: resume: '{}/server-{}.bin' says round {}", dir, *it, s.round));
    if (hosts_complete(dir, s.round, s.host_files)) return s;
  }
  throw ConfigError(fmt::format(
      "fl: resume: '{}' holds no complete checkpoint (a server-<round>.bin with all its host files); allowed: the "
      "checkpoints of a run with --checkpoint-every > 0",
      dir));
}

void set_host_checkpoint_read_delay_for_testing(double seconds) { g_host_read_delay_for_testing = seconds; }

std::map<int, std::vector<float>> read_host_checkpoints(const std::string& dir, int64_t round, size_t n, int clients,
                                                        const std::function<bool(int)>& keep) {
  if (const double d = g_host_read_delay_for_testing.load(); d > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(d));
  std::map<int, std::vector<float>> out;
  int64_t host_files = 0;
  std::error_code ec;
  while (fs::exists(fs::path(dir) / fmt::format("{}{}.bin", host_prefix(host_files + 1), round), ec)) ++host_files;
  if (host_files == 0)
    throw ConfigError(fmt::format(
        "fl: resume: '{}' holds no host-<rank>-{}.bin (the clients' SCAFFOLD control variates); allowed: the "
        "checkpoints of a SCAFFOLD run",
        dir, round));
  for (int64_t h = 1; h <= host_files; ++h) {
    Reader r(fs::path(dir) / fmt::format("{}{}.bin", host_prefix(h), round));
    r.header(kHostMagic, "host checkpoint");
    const int64_t rd = r.get<int64_t>(), rank = r.get<int64_t>();
    const uint64_t width = r.get<uint64_t>(), count = r.get<uint64_t>();
    if (rd != round || rank != h || width != n)
      r.bad(fmt::format("is of round {}, rank {}, {} weights; expected round {}, rank {}, {}", rd, rank, width, round,
                        h, n));
    if (count > r.left() / (8 + 4 * n)) r.bad(fmt::format("announces {} clients with {} bytes left", count, r.left()));
    std::vector<float> v(n);
    for (uint64_t i = 0; i < count; ++i) {
      const int64_t client = r.get<int64_t>();
      if (client < 0 || client >= clients || out.count(int(client)))
        r.bad(fmt::format("names client {} (of {}, or twice)", client, clients));
      r.raw(v.data(), n * 4);
      // (a c_i is finite when written: a damaged one would correct every gradient of its client with it)
      for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(v[i]))
          r.bad(fmt::format("holds a value that is not finite ({}, float {} of client {}'s control variate)", v[i], i,
                            client));
      if (keep(int(client))) out[int(client)] = v;
    }
    r.end();
  }
  return out;
}

ServerCheckpoint check_resume_files(const FlConfig& c) {
  const std::string dir = resume_checkpoint_dir(c.resume);
  ServerCheckpoint s = read_latest_checkpoint(dir);
  check_resume(c, s);
  try {
    make_server_optimizer(server_opt_config(c), s.weights.size())->load_state(s.optimizer);
  } catch (const ProtocolError& e) {
    throw ProtocolError(fmt::format("fl: resume: '{}/server-{}.bin' holds a server optimizer state that is not one: {}",
                                    dir, s.round, e.what()));
  }
  // (the hosts' width is the model's: the server file's weights, which the server compares with its model)
  if (c.scaffold) read_host_checkpoints(dir, s.round, s.weights.size(), c.clients, [](int) { return false; });
  if (c.dp_noise > 0) check_dp_ledger_writable(dir);
  return s;
}

void check_resume(const FlConfig& c, const ServerCheckpoint& s) {
  static const std::set<std::string> free_keys = {"rounds",   "output",     "resume",    "checkpoint_every",
                                                  "progress", "eval_every", "timeout_s", "transport",
                                                  "workers",  "data_dir"};
  const FlConfig then = config_from_json(s.config_json, "the checkpoint's settings");
  const nlohmann::json a = nlohmann::json::parse(config_to_json(c)), b = nlohmann::json::parse(config_to_json(then));
  for (auto& [k, v] : b.items()) {
    if (free_keys.count(k)) continue;
    if (!a.contains(k) || a.at(k) != v)
      throw ConfigError(fmt::format(
          "fl: resume: {} is {} here and {} in the checkpoint; allowed: the checkpoint's settings (only rounds, "
          "output, checkpoint_every, progress, eval_every, timeout_s, transport, workers and data_dir may change)",
          k, a.contains(k) ? a.at(k).dump() : "unset", v.dump()));
  }
  if (s.round >= c.rounds)
    throw ConfigError(
        fmt::format("fl: resume: the checkpoint is after round {} and --rounds is {}; allowed: more rounds than {}",
                    s.round, c.rounds, s.round));
}

}  // namespace conduit::fl
