#include "cli/cluster.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "core/yaml_file.h"

namespace conduit::cli::cluster {
namespace {

constexpr const char* kNetnsDir = "/run/netns";

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// Splits "12.5mbit" into 12.5 and "mbit"; false when there is no leading number.
bool split_number(const std::string& text, double* value, std::string* unit) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  // Decimal only (strtod also takes hex, "inf" and "nan": --latency 0x10ms was 16 ms).
  const size_t digits_end = t.find_first_not_of("0123456789.eE+-");
  if (!is_decimal(std::string_view(t).substr(0, digits_end))) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(t.c_str(), &end);
  // ... and strtod stops where the decimal ends ("0x10ms": the decimal is "0", strtod read "0x10").
  if (end != t.c_str() + std::min(digits_end, t.size()) || errno != 0 || !std::isfinite(v)) return false;
  *value = v;
  *unit = lower(trim(std::string(end)));
  return true;
}

std::string first_line(const std::string& s) {
  std::string t = trim(s);
  const size_t nl = t.find('\n');
  return nl == std::string::npos ? t : t.substr(0, nl);
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += ' ';
    out += s;
  }
  return out;
}

// Runs argv; throws Error naming `what` and the line of the command's output that says what failed.
void must(const std::vector<std::string>& argv, const std::string& what) {
  std::string out;
  const int rc = run_program(argv, &out);
  if (rc != 0) {
    throw Error(fmt::format("{}: `{}` failed (exit {}): {}", what, join(argv), rc, tool_error_line(out)));
  }
}

std::vector<std::string> netns_entries() {
  std::vector<std::string> out;
  DIR* d = opendir(kNetnsDir);
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

const std::regex& ns_regex() {
  static const std::regex re("^conduit-([a-z0-9_-]+)-(sw|h[0-9]+)$");
  return re;
}

nlohmann::json link_json(const LinkSpec& l) {
  return {{"rate_bps", l.rate_bps}, {"latency_s", l.latency_s}, {"loss", l.loss}};
}

LinkSpec link_from_json(const nlohmann::json& j) {
  LinkSpec l;
  l.rate_bps = j.value("rate_bps", 0.0);
  l.latency_s = j.value("latency_s", 0.0);
  l.loss = j.value("loss", 0.0);
  return l;
}

// The temporary copies of state files (cluster-NAME.json.tmpPID, below) that an `up` killed between writing and
// linking one left behind: those whose process is gone and that are over a minute old (a copy lives microseconds;
// the age spares a copy of a process in another pid namespace sharing the folder). They stayed for good (an audit).
void remove_stale_temporaries(const std::string& dir) {
  static const std::regex tmp_re("^cluster-[a-z0-9_-]+\\.json\\.tmp([1-9][0-9]{0,9})$");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  const auto now = std::chrono::system_clock::now();
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    std::smatch m;
    if (!std::regex_match(n, m, tmp_re)) continue;
    const long pid = std::stol(m[1].str());
    const std::string path = dir + "/" + n;
    struct stat st {};
    if (pid > INT_MAX || pid == static_cast<long>(getpid()) || ::lstat(path.c_str(), &st) != 0) continue;
    if (now - std::chrono::system_clock::from_time_t(st.st_mtime) < std::chrono::minutes(1)) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    ::unlink(path.c_str());
  }
  closedir(d);
}

// An open file holding an flock, released (closed) when done or destroyed.
class StateLock {
 public:
  explicit StateLock(int fd = -1) : fd_(fd) {}
  StateLock(const StateLock&) = delete;
  StateLock& operator=(const StateLock&) = delete;
  StateLock(StateLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  ~StateLock() { release(); }
  void release() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// Creates the state file, which must not exist yet: creating it claims the name (two `up` of one name at once: the
// second sees the first's file and stops before it touches anything). Returns it locked (flock, taken on the
// temporary copy before it is linked into place, so it is never seen unlocked): `down` waits for the lock, so one
// run during an `up` of the name waits until the cluster is whole (it removed the namespaces made so far, `up` made
// the rest and left them without a state file; an audit).
StateLock write_state(const ClusterState& s) {
  const std::string dir = state_dir();
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    throw Error(fmt::format("cluster: cannot create state directory {}: {}", dir, std::strerror(errno)));
  }
  remove_stale_temporaries(dir);
  nlohmann::json j;
  j["name"] = s.name;
  j["switch_ns"] = s.switch_ns;
  j["shaping"] = s.shaping;
  if (!s.owner.empty()) {
    j["owner"] = s.owner;
    j["owner_pid"] = s.owner_pid;
    j["owner_start"] = s.owner_start;
    j["owner_pidns"] = s.owner_pidns;
  }
  j["hosts"] = nlohmann::json::array();
  for (const auto& h : s.hosts) {
    j["hosts"].push_back({{"ns", h.ns}, {"address", h.address}, {"ifname", kHostIfname}, {"link", link_json(h.link)}});
  }
  const std::string path = state_path(s.name);
  const std::string tmp = fmt::format("{}.tmp{}", path, static_cast<long>(getpid()));
  {
    errno = 0;
    std::ofstream f(tmp);
    f << j.dump(2) << "\n";
    f.close();
    if (!f) {
      const int err = errno;
      ::unlink(tmp.c_str());  // (a full disk left the partial file behind)
      throw Error(fmt::format("cluster: cannot write {}: {}", tmp, err ? std::strerror(err) : "write failed"));
    }
  }
  // (a lock not taken only loses the wait of a concurrent `down`, as before)
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) ::flock(fd, LOCK_EX);
  StateLock lock(fd);
  // link() fails when the name exists, atomically, and the file appears whole or not at all.
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int err = errno;
  ::unlink(tmp.c_str());
  if (rc != 0 && err == EEXIST) {
    throw ConfigError(fmt::format("cluster up: a cluster named '{}' exists; run `conduit cluster down --name {}` first",
                                  s.name, s.name));
  }
  if (rc != 0) throw Error(fmt::format("cluster: cannot write {}: {}", path, std::strerror(err)));
  return lock;
}

// tbf burst: three full Ethernet frames or 1 ms of the rate, the larger; queue: 50 ms of the rate on top. tbf splits a
// GSO super-packet larger than the burst into frames, so TCP does not stall on it; a burst of 96 KiB (once chosen to
// hold a whole 64 KiB super-packet) let that much through at the veth's speed after every pause: a compressed
// exchange between two compute phases crossed a 10 Mbit/s link in 1 ms instead of 54. The 1 ms is what tbf needs to
// hold high rates on a small VM (at 1 Gbit/s three frames gave 44-72% of the rate, 1 ms 92-96%; docs/cluster.md):
// after a pause a message crosses up to 1 ms sooner than the rate allows. Below 36 Mbit/s three frames are more than
// 1 ms (36 ms at 1 Mbit/s, 4.5 s at 8 kbit/s: a 4,000-byte message after a pause crossed 200 kbit/s in 0.3 ms instead
// of 167; an audit), so tbf there also gets a peak rate (peak_rate_bps).
constexpr long kFrameBytes = 1514;  // a full Ethernet frame (MTU 1500 and its header)
long burst_bytes(double rate_bps) { return std::max<long>(3 * kFrameBytes, static_cast<long>(rate_bps / 8 * 0.001)); }
// Where the burst (three frames) is more than 1 ms of the rate: a peak rate a tenth above the rate, over a bucket of
// one frame (tbf's `peakrate` and `mtu`), so that after a pause one frame crosses at the veth's speed and the rest of
// the burst at most at the peak rate. (1.1x held 19.1 of 20 and 34.4 of 36 Mbit/s in TCP goodput, as tbf alone did;
// 1.01x lost 2.5% at 36 Mbit/s, its frames' slack against the qdisc's timer being 3 us.) 0: none.
double peak_rate_bps(double rate_bps) {
  return burst_bytes(rate_bps) * 8.0 > rate_bps * 0.001 ? std::ceil(rate_bps * 1.1) : 0;
}
long queue_limit_bytes(double rate_bps) {
  return burst_bytes(rate_bps) + std::max<long>(64 * 1024, static_cast<long>(rate_bps / 8 * 0.05));
}

// Shapes egress of `dev` in namespace `ns` (shape_commands).
void shape(const std::string& ns, const std::string& dev, double rate_bps, double delay_s, double loss) {
  const std::string what = fmt::format("cluster up: shaping {} in {}", dev, ns);
  for (const auto& argv : shape_commands(ns, dev, rate_bps, delay_s, loss)) must(argv, what);
}

// True when the process's environment holds `entry` (KEY=VALUE) exactly.
bool environment_holds(pid_t pid, const std::string& entry) {
  std::ifstream f(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string e;
  while (std::getline(f, e, '\0'))
    if (e == entry) return true;
  return false;
}

// Stops every process in the namespace (SIGTERM, then SIGKILL from the second second), or only those whose
// environment holds `marked` (KEY=VALUE) when it is set; false when some are still there after 4 s (in
// uninterruptible sleep). *signalled counts the processes it signalled first.
bool kill_namespace_processes(const std::string& ns, const std::string& marked = "", int* signalled = nullptr) {
  for (int round = 0; round < 40; ++round) {
    std::string out;
    if (run_program({"ip", "netns", "pids", ns}, &out) != 0) return true;
    std::vector<pid_t> pids;
    std::istringstream in(out);
    long p;
    while (in >> p) {
      if (p > 1 && p != getpid() && (marked.empty() || environment_holds(static_cast<pid_t>(p), marked)))
        pids.push_back(static_cast<pid_t>(p));
    }
    if (pids.empty()) return true;
    if (round == 0 && signalled) *signalled += static_cast<int>(pids.size());
    // Signalled through a pidfd taken while the pid is still seen in this namespace: a pid that ended after the
    // listing and was reused by a process elsewhere is not signalled (kill(pid) could have hit it).
    struct stat ns_st {};
    const bool have_ns = ::stat((std::string(kNetnsDir) + "/" + ns).c_str(), &ns_st) == 0;
    for (pid_t pid : pids) {
      // (the system calls themselves: Debian 12's <sys/pidfd.h> declares them without C linkage)
      const int pfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
      if (pfd < 0) continue;  // (gone)
      struct stat pid_ns {};
      const bool same = have_ns && ::stat(fmt::format("/proc/{}/ns/net", pid).c_str(), &pid_ns) == 0 &&
                        pid_ns.st_ino == ns_st.st_ino && pid_ns.st_dev == ns_st.st_dev;
      if (same) ::syscall(SYS_pidfd_send_signal, pfd, round < 10 ? SIGTERM : SIGKILL, nullptr, 0);
      ::close(pfd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// Stops the processes of every namespace given; the names of those where some survived, each after a space.
std::string stop_namespaces_processes(const std::vector<std::string>& names) {
  std::string survivors;
  for (const auto& ns : names)
    if (!kill_namespace_processes(ns)) survivors += " " + ns;
  return survivors;
}

// SIGINT/SIGTERM/SIGHUP/SIGQUIT while `up` builds namespaces: remember the signal, finish the current step, remove
// what was made (a hang-up, a dropped ssh session, killed `up` half way and left its namespaces).
volatile sig_atomic_t g_up_signal = 0;
void note_up_signal(int sig) { g_up_signal = sig; }

// Installs note_up_signal for the stop signals while alive; restores the previous handlers after.
class UpSignals {
 public:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
  UpSignals() {
    g_up_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = note_up_signal;
    sigemptyset(&sa.sa_mask);
    // A signal the caller ignores (nohup, a backgrounded script) stays ignored.
    for (size_t i = 0; i < std::size(kSignals); ++i) {
      sigaction(kSignals[i], nullptr, &old_[i]);
      if (old_[i].sa_handler != SIG_IGN) sigaction(kSignals[i], &sa, nullptr);
    }
  }
  ~UpSignals() { restore(); }
  // The signal to pass on: SIGQUIT's default action dumps core (as root, of `cluster up`): SIGTERM then, as the
  // launcher does; a handler the caller installed gets SIGQUIT itself.
  int passed_on(int sig) const {
    for (size_t i = 0; i < std::size(kSignals); ++i)
      if (kSignals[i] == sig && sig == SIGQUIT && old_[i].sa_handler == SIG_DFL) return SIGTERM;
    return sig;
  }
  void restore() {
    if (restored_) return;
    restored_ = true;
    for (size_t i = 0; i < std::size(kSignals); ++i) sigaction(kSignals[i], &old_[i], nullptr);
  }

 private:
  struct sigaction old_[std::size(kSignals)] = {};
  bool restored_ = false;
};

}  // namespace

int run_program(const std::vector<std::string>& argv, std::string* out) {
  if (argv.empty()) throw InvalidArgument("run_program: empty argv");
  int fds[2] = {-1, -1};
  if (out != nullptr && pipe2(fds, O_CLOEXEC) != 0) {
    throw Error(fmt::format("cannot create a pipe: {}", std::strerror(errno)));
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(fmt::format("cannot fork to run {}: {}", argv[0], std::strerror(errno)));
  if (pid == 0) {
    // A process group of its own: the terminal's Ctrl-C goes to the caller, which stops and cleans up in order. A
    // second Ctrl-C during `cluster up`'s clean-up killed the `ip netns del` it was running, and left namespaces.
    setpgid(0, 0);
    sigset_t none;  // the programs run with no signal blocked (the netem probe blocks stop signals around them)
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    const int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) dup2(devnull, 0);
    if (out != nullptr) {
      dup2(fds[1], 1);
      dup2(fds[1], 2);
    }
    execvp(args[0], args.data());
    const std::string msg = fmt::format("cannot run {}: {}\n", argv[0], std::strerror(errno));
    (void)!write(2, msg.data(), msg.size());
    _exit(127);
  }
  if (out != nullptr) {
    close(fds[1]);
    out->clear();
    char buf[4096];
    for (;;) {
      const ssize_t n = read(fds[0], buf, sizeof buf);
      if (n > 0) {
        out->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        break;
      }
    }
    close(fds[0]);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw Error(fmt::format("waitpid for {} failed: {}", argv[0], std::strerror(errno)));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

double parse_rate(const std::string& text, const std::string& field) {
  double v = 0;
  std::string unit;
  const auto bad = [&]() {
    return ConfigError(
        fmt::format("{}: '{}' is not a rate; use e.g. 100mbit, 1gbit, 500kbit (bits per second)", field, text));
  };
  if (!split_number(text, &v, &unit) || lower(text).find('x') != std::string::npos) throw bad();
  if (unit.size() > 2 && unit.substr(unit.size() - 2) == "/s") unit = unit.substr(0, unit.size() - 2);
  // tc reads "mbps" as megabytes per second, most people as megabits: refuse the ambiguity.
  // ('b' alone was taken as bits, 800000b as 800 kbit, beside 'kb' refused as a size)
  if ((unit.size() >= 3 && unit.substr(unit.size() - 3) == "bps") || unit == "b" || unit == "kb" || unit == "mb" ||
      unit == "gb")
    throw ConfigError(
        fmt::format("{}: '{}' is ambiguous (tc reads 'mbps' as megabytes per second and 'mb' as a size); use "
                    "bits: e.g. 100mbit, 1gbit, 500kbit",
                    field, text));
  double mult = 0;
  if (unit.empty() || unit == "bit") {
    mult = 1;
  } else if (unit == "k" || unit == "kbit") {
    mult = 1e3;
  } else if (unit == "m" || unit == "mbit") {
    mult = 1e6;
  } else if (unit == "g" || unit == "gbit") {
    mult = 1e9;
  } else {
    throw bad();
  }
  const double bps = v * mult;
  if (bps < 8000 || bps > 400e9) {
    throw ConfigError(fmt::format("{}: {} is out of range; allowed 8kbit .. 400gbit{}", field, text,
                                  unit.empty() ? " (a number without a unit is bits per second)" : ""));
  }
  return bps;
}

double parse_duration(const std::string& text, const std::string& field) {
  double v = 0;
  std::string unit;
  if (!split_number(text, &v, &unit) || v < 0) {
    throw ConfigError(fmt::format("{}: '{}' is not a duration; use e.g. 0, 500us, 5ms, 0.1s", field, text));
  }
  double mult = 0;
  if (unit == "s" || (unit.empty() && v == 0)) {
    mult = 1;
  } else if (unit == "ms") {
    mult = 1e-3;
  } else if (unit == "us") {
    mult = 1e-6;
  } else {
    throw ConfigError(fmt::format("{}: '{}' needs a unit: us, ms or s (e.g. 5ms)", field, text));
  }
  const double s = v * mult;
  if (s > 10) throw ConfigError(fmt::format("{}: {} is out of range; allowed 0 .. 10s", field, text));
  return s;
}

double parse_loss(const std::string& text, const std::string& field) {
  double v = 0;
  std::string unit;
  if (!split_number(text, &v, &unit) || (!unit.empty() && unit != "%") || v < 0) {
    throw ConfigError(fmt::format("{}: '{}' is not a loss rate; use a percentage, e.g. 0.1%", field, text));
  }
  // A bare number is ambiguous: netem reads `loss 0.5` as 0.5%, a fraction as 50% (it was taken as 50%).
  if (unit.empty() && v != 0)
    throw ConfigError(fmt::format("{}: '{}' has no unit; allowed: a percentage such as {}% (or 0)", field, text, v));
  const double p = unit == "%" ? v / 100 : v;
  if (p >= 1) throw ConfigError(fmt::format("{}: {} is out of range; allowed 0 <= loss < 100%", field, text));
  return p;
}

void validate_name(const std::string& name) {
  static const std::regex re("^[a-z0-9_]([a-z0-9_-]{0,22}[a-z0-9_])?$");
  if (!std::regex_match(name, re)) {
    throw ConfigError(fmt::format(
        "cluster: --name '{}' is not allowed; use 1-24 of a-z 0-9 _ (and - inside), e.g. c1 or sweep-3", name));
  }
}

std::vector<LinkSpec> load_hosts_file(const std::string& path, int hosts, const LinkSpec& base,
                                      const LinkGiven& given) {
  if (hosts < 0 || hosts > kMaxHosts)  // 0: not given (the file's count)
    throw ConfigError(fmt::format("--hosts {}: allowed 1..{}", hosts, kMaxHosts));
  const YAML::Node root = load_yaml_file(path, "--hosts-file", "a YAML file");
  if (!root.IsMap())
    throw ConfigError(fmt::format("--hosts-file {}: expected a map with 'hosts' and 'defaults'", path));
  // (`set`, when given, gets what the map sets: bandwidth, latency, loss)
  const auto apply = [&](const YAML::Node& n, LinkSpec l, const std::string& where,
                         std::set<std::string>* set = nullptr) {
    if (!n.IsMap()) throw ConfigError(fmt::format("--hosts-file {}: {} must be a map", path, where));
    std::set<std::string> seen;
    for (const auto& kv : n) {
      if (!kv.first.IsScalar())
        throw ConfigError(fmt::format(
            "--hosts-file {}: {} has a key that is not a name; allowed bandwidth, latency, loss", path, where));
      const std::string key = kv.first.as<std::string>();
      const std::string field = fmt::format("--hosts-file {}: {}.{}", path, where, key);
      // (by what it sets: bandwidth and rate, or latency and delay, in one map were both taken, the last winning)
      const std::string what = key == "rate" ? "bandwidth" : key == "delay" ? "latency" : key;
      if (!seen.insert(what).second)
        throw ConfigError(fmt::format(
            "{}: given twice (bandwidth and rate are one setting, latency and delay another); give it once", field));
      if (!kv.second.IsScalar()) throw ConfigError(fmt::format("{}: must be a single value, e.g. 100mbit", field));
      const std::string val = kv.second.as<std::string>();
      if (key == "bandwidth" || key == "rate") {
        l.rate_bps = parse_rate(val, field);
      } else if (key == "latency" || key == "delay") {
        l.latency_s = parse_duration(val, field);
      } else if (key == "loss") {
        l.loss = parse_loss(val, field);
      } else {
        throw ConfigError(fmt::format("{}: unknown key; allowed bandwidth, latency, loss", field));
      }
    }
    if (set != nullptr) set->insert(seen.begin(), seen.end());
    return l;
  };
  LinkSpec defaults = base;
  std::set<std::string> top;
  for (const auto& kv : root) {
    if (!kv.first.IsScalar())
      throw ConfigError(fmt::format("--hosts-file {}: a top-level key is not a name; allowed defaults, hosts", path));
    const std::string key = kv.first.as<std::string>();
    if (!top.insert(key).second)
      throw ConfigError(fmt::format("--hosts-file {}: '{}' is given twice; give it once", path, key));
    if (key != "defaults" && key != "hosts") {
      throw ConfigError(fmt::format("--hosts-file {}: unknown key '{}'; allowed defaults, hosts", path, key));
    }
  }
  if (root["defaults"]) {
    // A flag and the file's defaults both setting a value: which one applies would be a guess. Given is given, 0
    // too (judged by the value, an explicit --latency 0 was taken as absent and the file's latency applied).
    const YAML::Node d = root["defaults"];
    for (const auto& [flag, keys] :
         {std::pair{given.bandwidth, std::pair{"bandwidth", "rate"}},
          std::pair{given.latency, std::pair{"latency", "delay"}}, std::pair{given.loss, std::pair{"loss", "loss"}}})
      if (!flag.empty() && d.IsMap() && (d[keys.first] || d[keys.second]))
        throw ConfigError(fmt::format("{} conflicts with defaults.{} in --hosts-file {}; allowed: one of the two", flag,
                                      keys.first, path));
    defaults = apply(d, defaults, "defaults");
  }
  std::vector<LinkSpec> out;
  if (root["hosts"]) {
    const YAML::Node list = root["hosts"];
    if (!list.IsSequence() || list.size() == 0) {
      throw ConfigError(fmt::format("--hosts-file {}: hosts must be a non-empty list", path));
    }
    // A value given (a flag, a sweep network's key) only fills in what the defaults and a host leave out: set by
    // every host, it applied to none, and nothing said so (an audit).
    std::map<std::string, int> set_by;  // hosts that set each of bandwidth, latency, loss themselves
    for (size_t i = 0; i < list.size(); ++i) {
      std::set<std::string> set;
      out.push_back(list[i].IsNull() ? defaults : apply(list[i], defaults, fmt::format("hosts[{}]", i), &set));
      for (const auto& k : set) ++set_by[k];
    }
    if (hosts > 0 && static_cast<int>(out.size()) != hosts) {
      throw ConfigError(fmt::format("--hosts {} does not match the {} hosts listed in {}", hosts, out.size(), path));
    }
    for (const auto& [flag, key] :
         {std::pair{given.bandwidth, "bandwidth"}, std::pair{given.latency, "latency"}, std::pair{given.loss, "loss"}})
      if (!flag.empty() && set_by[key] == static_cast<int>(list.size()))
        throw ConfigError(fmt::format(
            "{} applies to no host: every host in --hosts-file {} sets its own {}; allowed: leave {} out, or leave "
            "{} out of a host there",
            flag, path, key, flag, key));
  } else {
    if (hosts <= 0) throw ConfigError(fmt::format("--hosts-file {} lists no hosts; give --hosts N", path));
    out.assign(static_cast<size_t>(hosts), defaults);
  }
  if (static_cast<int>(out.size()) > kMaxHosts) {
    throw ConfigError(fmt::format("--hosts-file {}: {} hosts; allowed 1..{}", path, out.size(), kMaxHosts));
  }
  for (size_t i = 0; i < out.size(); ++i)
    if (!(out[i].rate_bps > 0))
      throw ConfigError(
          fmt::format("--hosts-file {}: hosts[{}] has no bandwidth; set it there, in defaults, or with "
                      "--bandwidth",
                      path, i));
  return out;
}

bool kernel_has_netem() {
  static int cached = -1;
  if (cached >= 0) return cached == 1;
  // Named by this process's pid and pid namespace: containers that share /run/netns but not their pids (where one's
  // pid is another's too) judge only their own probes by their pids.
  const unsigned long long pidns = own_pid_namespace();
  const std::string ns = fmt::format("conduit-probe{}-{}", getpid(), pidns);
  std::string out;
  bool ok = false;
  // A stop signal waits until the probe's namespace is gone (killed in between, it was left behind, and no
  // `cluster down` knows its name).
  sigset_t stops, old;
  sigemptyset(&stops);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&stops, sig);
  pthread_sigmask(SIG_BLOCK, &stops, &old);
  struct Restore {  // also when run_program throws (a failed fork or pipe)
    sigset_t* old;
    ~Restore() { pthread_sigmask(SIG_SETMASK, old, nullptr); }
  } restore{&old};
  // Only tc's "unknown qdisc" means no netem: another failure (no /run/netns in a container, no veth module) was
  // reported as a kernel without netem, hiding what to fix.
  std::string failed;
  bool made = false;
  // A probe's namespace outlives a process killed with SIGKILL during the probe (which no blocking stops), and no
  // `cluster down` matches its name: each probe removes those whose process is gone, judged by its pid only in its
  // own pid namespace (a pid of another container's, found gone here, deleted a live probe there; an audit), and
  // any other once a minute old (a probe lasts well under a second). Those named by the pid alone (before
  // 2026-12-07) have no namespace to judge them in: by their age.
  static const std::regex stale_probe("^conduit-probe([1-9][0-9]{0,9})(-([0-9]{1,20}))?$");
  for (const std::string& e : netns_entries()) {
    std::smatch m;
    if (e == ns || !std::regex_match(e, m, stale_probe)) continue;
    const long owner = std::stol(m[1].str());
    const bool here = pidns != 0 && m[3].matched && m[3].str() == std::to_string(pidns);
    const bool gone = here && owner <= INT_MAX && ::kill(static_cast<pid_t>(owner), 0) != 0 && errno == ESRCH;
    struct stat st {};
    const bool old = ::stat((std::string(kNetnsDir) + "/" + e).c_str(), &st) == 0 &&
                     std::difftime(std::time(nullptr), st.st_mtime) > 60;
    if (gone || old) run_program({"ip", "netns", "del", e}, &out);
  }
  try {
    made = run_program({"ip", "netns", "add", ns}, &out) == 0;
    if (!made) {
      failed = fmt::format("`ip netns add {}` failed: {}", ns, first_line(out));
    } else if (run_program({"ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"}, &out) != 0) {
      failed = fmt::format("adding a veth pair failed: {}", first_line(out));
    } else {
      ok = run_program({"tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms"}, &out) == 0;
      if (!ok && out.find("unknown") == std::string::npos)
        failed = fmt::format("`tc qdisc add ... netem` failed: {}", first_line(out));
    }
  } catch (...) {
    if (made) run_program({"ip", "netns", "del", ns}, &out);
    throw;
  }
  if (made) run_program({"ip", "netns", "del", ns}, &out);
  if (!failed.empty()) throw Error("cluster: probing for netem (a throwaway namespace): " + failed);
  cached = ok ? 1 : 0;
  return ok;
}

std::string state_dir() {
  const char* d = std::getenv("CONDUIT_CLUSTER_STATE_DIR");
  return d != nullptr && *d != '\0' ? d : "/run/conduit";
}

std::string state_path(const std::string& name) { return state_dir() + "/cluster-" + name + ".json"; }

std::string host_ns(const std::string& name, int index) { return fmt::format("{}{}-h{}", kNsPrefix, name, index); }
std::string switch_ns(const std::string& name) { return fmt::format("{}{}-sw", kNsPrefix, name); }

std::string format_rate(double bps) {
  if (bps <= 0) return "unshaped";
  if (bps >= 1e9) return fmt::format("{:g}gbit", bps / 1e9);
  if (bps >= 1e6) return fmt::format("{:g}mbit", bps / 1e6);
  if (bps >= 1e3) return fmt::format("{:g}kbit", bps / 1e3);
  return fmt::format("{:g}bit", bps);
}

std::vector<std::string> existing_namespaces(const std::string& name) {
  std::vector<std::string> out;
  std::smatch m;
  for (const auto& n : netns_entries()) {
    if (std::regex_match(n, m, ns_regex()) && m[1].str() == name) out.push_back(n);
  }
  return out;
}

std::string tool_error_line(const std::string& output) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string l; std::getline(in, l);)
    if (!trim(l).empty()) lines.push_back(trim(l));
  for (const auto& l : lines)
    if (l.rfind("Error", 0) == 0) return l;
  for (const auto& l : lines)
    if (l.rfind("Warning", 0) != 0) return l;
  return lines.empty() ? "" : lines.front();
}

std::vector<std::vector<std::string>> shape_commands(const std::string& ns, const std::string& dev, double rate_bps,
                                                     double delay_s, double loss) {
  const std::string rate = fmt::format("{}bit", static_cast<long long>(std::llround(rate_bps)));
  const bool netem = delay_s > 0 || loss > 0;
  if (!netem && rate_bps <= 0) return {};
  std::vector<std::string> netem_args;
  if (netem) {
    // netem's limit counts packets: those in its delay line and, under htb, those whose delay is over but that wait
    // for htb's tokens: the queue. The delay line holds rate x delay of full frames (with half again for bursts): a
    // fixed 100,000 dropped what a long latency at a high rate kept in flight (10 s at 1 gbit: ~413,000 frames),
    // loss nobody asked for. The queue is the tbf path's, in full frames: a minimum of 100,000 packets let a link
    // with latency queue seconds of its rate where one without queues 50 ms (an audit). Unshaped (no htb, nothing
    // waits but for the delay), the 100,000 stays as the least.
    const double line = std::ceil(1.5 * rate_bps * delay_s / (kFrameBytes * 8.0));
    const long long limit =
        rate_bps > 0 ? static_cast<long long>(line) + (queue_limit_bytes(rate_bps) + kFrameBytes - 1) / kFrameBytes
                     : std::max<long long>(100000, static_cast<long long>(line));
    netem_args = {"netem", "limit", std::to_string(limit)};
    if (delay_s > 0) {
      netem_args.insert(netem_args.end(),
                        {"delay", fmt::format("{}us", static_cast<long long>(std::llround(delay_s * 1e6)))});
    }
    if (loss > 0) netem_args.insert(netem_args.end(), {"loss", fmt::format("{}%", loss * 100)});
  }
  if (rate_bps <= 0) {
    std::vector<std::string> a = {"tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:"};
    a.insert(a.end(), netem_args.begin(), netem_args.end());
    return {a};
  }
  const std::string burst = std::to_string(burst_bytes(rate_bps));
  if (!netem) {
    std::vector<std::string> tbf = {"tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf"};
    tbf.insert(tbf.end(), {"rate", rate, "burst", burst, "limit", std::to_string(queue_limit_bytes(rate_bps))});
    if (const double peak = peak_rate_bps(rate_bps); peak > 0) {
      tbf.insert(tbf.end(),
                 {"peakrate", fmt::format("{}bit", static_cast<long long>(peak)), "mtu", std::to_string(kFrameBytes)});
    }
    return {tbf};
  }
  // quantum: what htb would take by default (a tenth of the rate's bytes a second, at most 200,000, and here at
  // least a frame), given, so that tc does not print "Warning: sch_htb: quantum of class ... is big" above
  // 16 Mbit/s (one class: the quantum shares nothing out).
  const long long quantum = std::clamp<long long>(static_cast<long long>(rate_bps / 8 / 10), kFrameBytes, 200000);
  std::vector<std::string> leaf = {"tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"};
  leaf.insert(leaf.end(), netem_args.begin(), netem_args.end());
  return {{"tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"},
          {"tc",  "-n",   ns,   "class", "add", "dev",   dev,   "parent", "1:",  "classid", "1:1",
           "htb", "rate", rate, "ceil",  rate,  "burst", burst, "cburst", burst, "quantum", std::to_string(quantum)},
          leaf};
}

unsigned long long own_pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<unsigned long long>(st.st_ino) : 0;
}

unsigned long long process_start_time(long pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (pid <= 0 || !std::getline(f, line)) return 0;
  // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, so the fields count from the last ')'.
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(line.substr(close + 1));
  std::string field;
  for (int k = 3; k <= 22 && in >> field; ++k)
    if (k == 22) return std::strtoull(field.c_str(), nullptr, 10);
  return 0;
}

ClusterState up(const std::string& name, const std::vector<LinkSpec>& links, const std::string& owner, bool* claimed) {
  if (claimed != nullptr) *claimed = false;
  validate_name(name);
  if (links.empty() || static_cast<int>(links.size()) > kMaxHosts) {
    throw ConfigError(fmt::format("cluster up: --hosts must be between 1 and {}, got {}", kMaxHosts, links.size()));
  }
  struct stat st {};
  if (!existing_namespaces(name).empty() || stat(state_path(name).c_str(), &st) == 0) {
    throw ConfigError(
        fmt::format("cluster up: a cluster named '{}' exists; run `conduit cluster down --name {}` first", name, name));
  }
  bool wants_netem = false;
  for (const auto& l : links) wants_netem = wants_netem || l.latency_s > 0 || l.loss > 0;
  if (wants_netem && !kernel_has_netem()) {
    throw UnsupportedError(
        "cluster up: --latency/--loss need the netem qdisc (sch_netem), which this kernel lacks (tc: \"Specified "
        "qdisc kind is unknown\"); use a kernel with CONFIG_NET_SCH_NETEM or leave --latency/--loss at 0");
  }
  ClusterState s;
  s.name = name;
  s.switch_ns = switch_ns(name);
  s.shaping = wants_netem ? "htb+netem" : "tbf";
  s.owner = owner;
  if (!owner.empty()) {
    s.owner_pid = static_cast<long>(getpid());
    s.owner_start = process_start_time(s.owner_pid);
    s.owner_pidns = own_pid_namespace();
  }
  for (size_t k = 0; k < links.size(); ++k) {
    s.hosts.push_back({host_ns(name, static_cast<int>(k)), fmt::format("{}{}", kSubnetPrefix, k + 1), links[k]});
  }
  // Record first, so that `down` knows the cluster even when this is interrupted half way.
  UpSignals signals;
  StateLock lock = write_state(s);
  if (claimed != nullptr) *claimed = true;
  const auto check_signal = [] {
    if (g_up_signal != 0) throw Error(fmt::format("cluster up: stopped by signal {}", static_cast<int>(g_up_signal)));
  };
  try {
    must({"ip", "netns", "add", s.switch_ns}, "cluster up");
    must({"ip", "-n", s.switch_ns, "link", "add", "br0", "type", "bridge"}, "cluster up");
    must({"ip", "-n", s.switch_ns, "link", "set", "br0", "up"}, "cluster up");
    for (size_t k = 0; k < s.hosts.size(); ++k) {
      const HostInfo& h = s.hosts[k];
      const std::string port = fmt::format("p{}", k);
      must({"ip", "netns", "add", h.ns}, "cluster up");
      must({"ip", "-n", s.switch_ns, "link", "add", port, "type", "veth", "peer", "name", kHostIfname, "netns", h.ns},
           "cluster up");
      must({"ip", "-n", s.switch_ns, "link", "set", port, "master", "br0"}, "cluster up");
      must({"ip", "-n", s.switch_ns, "link", "set", port, "up"}, "cluster up");
      must({"ip", "-n", h.ns, "link", "set", "lo", "up"}, "cluster up");
      must({"ip", "-n", h.ns, "addr", "add", h.address + "/24", "dev", kHostIfname}, "cluster up");
      must({"ip", "-n", h.ns, "link", "set", kHostIfname, "up"}, "cluster up");
      // Host -> switch carries the loss and half the latency; switch -> host the other half.
      shape(h.ns, kHostIfname, h.link.rate_bps, h.link.latency_s / 2, h.link.loss);
      shape(s.switch_ns, port, h.link.rate_bps, h.link.latency_s / 2, 0);
      check_signal();
    }
  } catch (...) {
    lock.release();  // (down takes it)
    try {
      down(name);
    } catch (const std::exception& e) {  // (said, not dropped: what it left behind needs a `cluster down`)
      std::fprintf(stderr, "conduit cluster up: undoing the failed start: %s\n", e.what());
    }
    // A signal that arrived meanwhile goes on to whoever handled it before (the default ends the process with it,
    // after the namespaces and the state file are gone; `sweep` notes it and stops).
    const int sig = g_up_signal;
    signals.restore();
    if (sig != 0) raise(signals.passed_on(sig));
    throw;
  }
  signals.restore();
  // (the cluster is whole: a waiting `down` goes on)
  lock.release();
  if (g_up_signal != 0) {  // arrived after the last step: the cluster is whole, but the caller asked to stop
    const int sig = g_up_signal;
    try {
      down(name);
    } catch (...) {
    }
    raise(signals.passed_on(sig));
    throw Error(fmt::format("cluster up: stopped by signal {}", sig));
  }
  return s;
}

int down(const std::string& name) {
  validate_name(name);
  // An `up` of this name building it holds its state file's lock: wait until the cluster is whole (or removed
  // again), at most two minutes (an `up` that hangs does not keep the cluster for good).
  const int fd = ::open(state_path(name).c_str(), O_RDONLY | O_CLOEXEC);
  const StateLock lock(fd);
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  while (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0 && (errno == EWOULDBLOCK || errno == EINTR) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto names = existing_namespaces(name);
  // Hosts first (their processes hold sockets), the switch last.
  const std::string survivors = stop_namespaces_processes(names);
  std::string errors;
  int removed = 0;
  for (const auto& ns : names) {
    std::string out;
    if (run_program({"ip", "netns", "del", ns}, &out) == 0) {
      ++removed;
    } else if (std::error_code ec; !std::filesystem::exists(std::filesystem::path(kNetnsDir) / ns, ec) && !ec) {
      // (gone meanwhile: another `down` of this cluster, a sweep's clean-up, took it; that one counts it)
    } else {
      errors += fmt::format(" {}: {};", ns, first_line(out));
    }
  }
  // (kept while namespaces are left, so that `cluster list` still shows the cluster to take down)
  if (!errors.empty()) throw Error(fmt::format("cluster down: could not delete namespaces:{}", errors));
  std::remove(state_path(name).c_str());
  // The namespaces are gone from the names, but processes that outlived SIGKILL (uninterruptible sleep) still hold
  // them and their links.
  if (!survivors.empty())
    throw Error(fmt::format("cluster down: deleted {} namespaces, but processes survived SIGKILL for 3 s in:{}",
                            removed, survivors));
  return removed;
}

int stop_marked_processes(const ClusterState& s, int hosts, const std::string& marked) {
  int signalled = 0;
  std::string survivors;
  for (int k = 0; k < hosts && k < static_cast<int>(s.hosts.size()); ++k)
    if (!kill_namespace_processes(s.hosts[size_t(k)].ns, marked, &signalled)) survivors += " " + s.hosts[size_t(k)].ns;
  if (!survivors.empty())
    throw Error(fmt::format("cluster {}: processes the run left survived SIGKILL for 3 s in:{}", s.name, survivors));
  return signalled;
}

void stop_processes(const std::string& name) {
  validate_name(name);
  const std::string survivors = stop_namespaces_processes(existing_namespaces(name));
  if (!survivors.empty())
    throw Error(fmt::format("cluster {}: processes survived SIGKILL for 3 s in:{}", name, survivors));
}

std::vector<std::string> list_clusters() {
  std::set<std::string> names;
  std::smatch m;
  for (const auto& n : netns_entries()) {
    if (std::regex_match(n, m, ns_regex())) names.insert(m[1].str());
  }
  if (DIR* d = opendir(state_dir().c_str())) {
    static const std::regex re("^cluster-([a-z0-9_-]+)\\.json$");
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (std::regex_match(n, m, re)) names.insert(m[1].str());
    }
    closedir(d);
  }
  return {names.begin(), names.end()};
}

ClusterState load_state(const std::string& name) {
  validate_name(name);
  std::error_code ec;
  if (!std::filesystem::exists(state_path(name), ec)) {
    throw ConfigError(
        fmt::format("cluster: no cluster named '{}' (start one with `conduit cluster up --name {} "
                    "--hosts N --bandwidth RATE`)",
                    name, name));
  }
  // (a pipe in its place blocked every command that reads it)
  const std::string text = read_input_file(state_path(name), "cluster: state file", "the file `cluster up` wrote");
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    ClusterState s;
    s.name = j.at("name").get<std::string>();
    s.switch_ns = j.at("switch_ns").get<std::string>();
    s.shaping = j.value("shaping", "tbf");
    s.owner = j.value("owner", "");
    s.owner_pid = j.value("owner_pid", 0L);
    s.owner_start = j.value("owner_start", 0ULL);
    s.owner_pidns = j.value("owner_pidns", 0ULL);
    for (const auto& h : j.at("hosts")) {
      s.hosts.push_back(
          {h.at("ns").get<std::string>(), h.at("address").get<std::string>(), link_from_json(h.at("link"))});
    }
    // (no hosts: `cluster run` read the first of none)
    if (s.hosts.empty() || s.hosts.size() > static_cast<size_t>(kMaxHosts))
      throw ConfigError(
          fmt::format("cluster: state file {} is damaged ({} hosts; allowed: 1 to {}); run `conduit "
                      "cluster down --name {}`",
                      state_path(name), s.hosts.size(), kMaxHosts, name));
    // The names are the ones `up` makes from the cluster's name, nothing else: commands run as root open
    // /run/netns/<ns> from this file (a written "../../proc/1/ns/net" ran them unshaped in the machine's own).
    std::string odd;
    if (s.name != name) odd = fmt::format("name '{}'", s.name);
    if (odd.empty() && s.switch_ns != switch_ns(name)) odd = fmt::format("switch namespace '{}'", s.switch_ns);
    for (size_t k = 0; k < s.hosts.size() && odd.empty(); ++k) {
      if (s.hosts[k].ns != host_ns(name, int(k)))
        odd = fmt::format("host {}'s namespace '{}'", k, s.hosts[k].ns);
      else if (s.hosts[k].address != fmt::format("{}{}", kSubnetPrefix, k + 1))
        odd = fmt::format("host {}'s address '{}'", k, s.hosts[k].address);
    }
    if (!odd.empty())
      throw ConfigError(
          fmt::format("cluster: state file {} is damaged ({}: not what `cluster up --name {}` makes); "
                      "run `conduit cluster down --name {}`",
                      state_path(name), odd, name, name));
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(fmt::format("cluster: state file {} is damaged ({}); run `conduit cluster down --name {}`",
                                  state_path(name), e.what(), name));
  }
}

int resolve_host(const ClusterState& state, const std::string& host) {
  const int n = static_cast<int>(state.hosts.size());
  std::string h = host;
  if (h == "rank") {
    const char* r = std::getenv("RANK");
    if (r == nullptr) throw ConfigError("cluster exec: host 'rank' needs RANK in the environment");
    h = r;
    // (`cluster run --ranks-per-host R`: ranks K*R .. K*R+R-1 in host K)
    const char* per = std::getenv("CONDUIT_RANKS_PER_HOST");
    const std::string p = per ? per : "1";
    if (p.empty() || p.size() > 2 || !std::all_of(p.begin(), p.end(), ::isdigit) || std::stoi(p) < 1 ||
        std::stoi(p) > 64)
      throw ConfigError(
          fmt::format("cluster exec: host 'rank': CONDUIT_RANKS_PER_HOST='{}' (allowed: 1..64 workers a host)", p));
    const int per_host = std::stoi(p);
    if (h.empty() || h.size() > 6 || !std::all_of(h.begin(), h.end(), ::isdigit) || std::stoi(h) / per_host >= n)
      throw ConfigError(
          fmt::format("cluster exec: host 'rank': RANK='{}' is not a rank of cluster '{}' (allowed 0..{}: {} host{}, "
                      "{} rank{} each)",
                      h, state.name, n * per_host - 1, n, n == 1 ? "" : "s", per_host, per_host == 1 ? "" : "s"));
    h = std::to_string(std::stoi(h) / per_host);
  }
  for (int k = 0; k < n; ++k) {
    if (h == state.hosts[static_cast<size_t>(k)].address || h == state.hosts[static_cast<size_t>(k)].ns) return k;
  }
  std::string digits = (!h.empty() && h[0] == 'h') ? h.substr(1) : h;
  if (!digits.empty() && digits.size() < 5 && std::all_of(digits.begin(), digits.end(), ::isdigit)) {
    const int k = std::stoi(digits);
    if (k < n) return k;
  }
  throw ConfigError(fmt::format("cluster exec: no host '{}' in cluster '{}'; use 0..{}, h0..h{} or an address {}1..",
                                host, state.name, n - 1, n - 1, kSubnetPrefix));
}

void exec_in_host(const ClusterState& state, int index, const std::vector<std::string>& command) {
  if (command.empty()) throw ConfigError("cluster exec: no command given; usage: conduit cluster exec HOST -- CMD...");
  const HostInfo& h = state.hosts.at(static_cast<size_t>(index));
  const std::string path = std::string(kNetnsDir) + "/" + h.ns;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(
        fmt::format("cluster exec: namespace {} is gone ({}); run `conduit cluster down --name {}` and up again", h.ns,
                    std::strerror(errno), state.name));
  }
  if (setns(fd, CLONE_NEWNET) != 0) {
    throw Error(fmt::format("cluster exec: cannot enter {}: {} (needs root)", h.ns, std::strerror(errno)));
  }
  close(fd);
  // The new sysfs below has no cgroup mounts, where a container's CPU quota is read: it is measured now and passed
  // on (core/cpus.h reads it back).
  setenv("CONDUIT_QUOTA_CPUS", std::to_string(quota_cpus()).c_str(), 1);
  // As `ip netns exec` does: a mount namespace of its own with sysfs mounted again, so that /sys/class/net shows
  // this host's interfaces (sysfs shows the network namespace of whoever mounted it: the machine's otherwise).
  const char* failed = nullptr;
  if (unshare(CLONE_NEWNS) != 0 || mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0)
    failed = "a mount namespace of its own";
  else if (umount2("/sys", MNT_DETACH) != 0 && errno != EINVAL)
    failed = "unmounting the machine's /sys";
  else if (mount(h.ns.c_str(), "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0)
    failed = "mounting sysfs (/sys is empty)";
  if (failed)
    fmt::print(stderr, "conduit: warning: cluster exec: /sys does not show {}'s interfaces: {} failed: {}\n", h.ns,
               failed, std::strerror(errno));
  setenv("CONDUIT_SOCKET_IFNAME", kHostIfname, 1);
  setenv("CONDUIT_CLUSTER_HOST", std::to_string(index).c_str(), 1);
  setenv("CONDUIT_CLUSTER_NAME", state.name.c_str(), 1);
  setenv("CONDUIT_CLUSTER_ADDR", h.address.c_str(), 1);
  // Each emulated host is a host of its own to Conduit (its hostname and boot id are the machine's): ranks on two
  // hosts must not pair over shared memory past the shaped links, and the tuner must see two hosts, not one.
  setenv("CONDUIT_HOST_ID", fmt::format("conduit-{}-h{}", state.name, index).c_str(), 1);
  std::vector<char*> args;
  for (const auto& a : command) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execvp(args[0], args.data());
  const int err = errno;
  fmt::print(stderr, "conduit: error: cluster exec: cannot run {}: {}\n", command[0], std::strerror(err));
  std::fflush(stderr);
  _exit(127);
}

}  // namespace conduit::cli::cluster
