#include "cli/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string_view>
#include <tuple>

#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"
#include "net/bootstrap.h"
#include "net/mpi_transport.h"
#include "net/shm.h"
#include "net/tcp_store.h"

extern char** environ;

namespace conduit::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kDefaultGraceSeconds = 10.0;
// After the last worker exited, how long to keep reading pipes still held open by processes it left behind.
constexpr auto kDrainTime = std::chrono::seconds(2);
constexpr size_t kReadChunk = 64 * 1024;
// A line longer than this is forwarded in pieces rather than buffered without bound.
constexpr size_t kMaxPendingLine = 1 << 20;

// The variables the launcher owns in a worker's environment; inherited values are dropped.
constexpr std::string_view kOwnedVariables[] = {
    "MASTER_ADDR", "MASTER_PORT",      "RANK",      "WORLD_SIZE",      "LOCAL_RANK",     "LOCAL_WORLD_SIZE",
    "GROUP_RANK",  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "CONDUIT_JOB_ID", "CONDUIT_LOCAL_CPUS"};
// Left by an outer mpirun (OpenMPI: OMPI_, PMIX_; MPICH/Hydra: PMI_): a worker that saw them would bootstrap
// through MPI instead of the TCP store; by an outer torchrun (TORCHELASTIC_): its agent-store flag made every worker
// refuse to start.
constexpr std::string_view kDroppedPrefixes[] = {"OMPI_", "PMIX_", "PMI_", "TORCHELASTIC_"};

// ---- signals: handlers write the signal number into a self-pipe that the poll loop watches ----

int g_signal_write_fd = -1;
std::atomic<bool> g_running{false};
// Set by SIGINT/SIGTERM: a write to a stalled stdout gives up, so that the signal is handled.
volatile sig_atomic_t g_stop_requested = 0;
// Set for stdout (1) / stderr (2) once a write to it stalled during a stop: later output to it is dropped.
bool g_output_stalled[3] = {false, false, false};
// Set for stdout (1) / stderr (2) once its reader went away (EPIPE): the workers' pipes to it are closed, so that
// they meet the closed pipe themselves, as in a shell pipeline (`conduit launch ... | head` ran on forever).
bool g_output_broken[3] = {false, false, false};
// Set for stdout (1) / stderr (2) when it can never take output (open for reading only, or not open): what the
// workers write to it is read and dropped, and they run on as with a closed one (which is /dev/null here).
bool g_output_dropped[3] = {false, false, false};
// SIGINT, SIGHUP and SIGQUIT as the launcher found them ignored (nohup, a background job of a shell without job
// control): they stay ignored, in the launcher and in its workers.
// SIGTSTP too: a launcher that cannot be stopped from the terminal keeps its workers running as well.
volatile sig_atomic_t g_ignored[4] = {0, 0, 0, 0};
int ignorable_index(int sig) {
  return sig == SIGINT ? 0 : sig == SIGHUP ? 1 : sig == SIGQUIT ? 2 : sig == SIGTSTP ? 3 : -1;
}
// The signal that stopped the last run_local_workers (0: none did).
int g_stop_signal = 0;

// Signals the workers receive as they are, without stopping the job: SLURM's --signal=USR1@T warns a job before its
// time limit, so that it can checkpoint. (Unhandled, they killed the launcher, and the workers with SIGKILL.)
bool passed_through(int sig) { return sig == SIGUSR1 || sig == SIGUSR2 || sig == SIGALRM; }

// Job control (Ctrl-Z, fg, bg): the workers run in process groups of their own, which the terminal does not signal.
// SIGTSTP stops them and then the launcher; SIGCONT continues them. (Unhandled, Ctrl-Z stopped the launcher alone and
// its workers ran on.)
bool job_control(int sig) { return sig == SIGTSTP || sig == SIGCONT; }
// Set by SIGTSTP until the job is stopped: the supervision loop, or a write blocked on a stalled output (`| less`
// stopped by the same Ctrl-Z), stops it.
volatile sig_atomic_t g_suspend_requested = 0;
// Set by SIGCONT: the launcher was stopped (by SIGTSTP, or SIGSTOP, which cannot be caught), and the time that passed
// meanwhile must not count against its deadlines.
volatile sig_atomic_t g_continued = 0;
// How long suspend_job's own stops lasted, measured around them (the supervision loop's thread only).
Clock::duration g_suspended_for{};
// How long the supervision loop's current pass waited as it asked to: its poll and write_all's waits for room on an
// output, each up to the timeout it gave, and its writes (the loop's thread only). What else a pass took is its own
// work, well under a second, unless the process was stopped meanwhile (see allow_for_a_stop).
Clock::duration g_waited{};

// poll(2), adding the time it waited, up to the timeout it was given, to g_waited.
int timed_poll(pollfd* fds, nfds_t n, int timeout_ms) {
  const auto before = Clock::now();
  const int r = ::poll(fds, n, timeout_ms);
  g_waited += std::min<Clock::duration>(Clock::now() - before, std::chrono::milliseconds(timeout_ms));
  return r;
}
// The supervision loop's next deadline (the job's time limit, the grace before SIGKILL, ...; the loop's thread only,
// set on each pass): a write blocked on a stalled output past it gives up as after SIGINT, so that the loop acts on
// it (`--timeout` never fired while the workers' output waited on a reader that did not read).
std::optional<Clock::time_point> g_output_deadline;

void on_signal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD && !passed_through(sig) && !job_control(sig)) g_stop_requested = 1;
  if (sig == SIGTSTP) g_suspend_requested = 1;
  if (sig == SIGCONT) g_continued = 1;
  unsigned char byte = static_cast<unsigned char>(sig);
  if (g_signal_write_fd >= 0) {
    ssize_t r = ::write(g_signal_write_fd, &byte, 1);
    (void)r;
  }
  errno = saved;
}

class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(FileDescriptor&& o) noexcept : fd_(o.release()) {}
  FileDescriptor& operator=(FileDescriptor&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

std::pair<FileDescriptor, FileDescriptor> make_pipe(int flags) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | flags) != 0) {
    throw Error(fmt::format("cannot create a pipe: {}", std::strerror(errno)));
  }
  return {FileDescriptor(fds[0]), FileDescriptor(fds[1])};
}

// Installs the handlers for the duration of one launch and restores the previous ones.
class SignalScope {
 public:
  SignalScope() {
    auto [r, w] = make_pipe(O_NONBLOCK);  // before claiming g_running: a throw here left it claimed for good
    if (g_running.exchange(true)) throw Error("launch: run_local_workers is already running in this process");
    read_ = std::move(r);
    write_ = std::move(w);
    g_signal_write_fd = write_.get();
    g_stop_requested = 0;
    g_suspend_requested = 0;
    g_continued = 0;
    for (bool& stalled : g_output_stalled) stalled = false;
    for (bool& broken : g_output_broken) broken = false;
    for (bool& dropped : g_output_dropped) dropped = false;
    g_stop_signal = 0;
    g_output_deadline.reset();
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: a blocking call returns EINTR and the loop looks at the pipe
    for (int i = 0; i < kHandled; ++i) {
      struct sigaction use = sa;
      if (kSignals[i] == SIGCHLD) use.sa_flags |= SA_NOCLDSTOP;
      ::sigaction(kSignals[i], nullptr, &old_[i]);
      const int ig = ignorable_index(kSignals[i]);
      if (ig >= 0) g_ignored[ig] = old_[i].sa_handler == SIG_IGN;
      if (ig >= 0 && g_ignored[ig]) continue;
      ::sigaction(kSignals[i], &use, nullptr);
    }
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, &old_pipe_);  // a closed stdout must not kill the launcher and orphan workers
    // A mask inherited blocked (a parent that blocks SIGCHLD or SIGTERM around exec) would keep the handlers from
    // ever running: the launcher never learnt that its workers exited, nor forwarded a stop.
    sigset_t handled;
    sigemptyset(&handled);
    for (int sig : kSignals) sigaddset(&handled, sig);
    pthread_sigmask(SIG_UNBLOCK, &handled, &old_mask_);
  }
  ~SignalScope() {
    pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
    for (int i = 0; i < kHandled; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    ::sigaction(SIGPIPE, &old_pipe_, nullptr);
    g_signal_write_fd = -1;
    g_running = false;
    // (the launch's deadlines and given-up outputs are its own: a later launch's messages before its scope, in the
    // same process, were dropped for them)
    g_output_deadline.reset();
    for (bool& stalled : g_output_stalled) stalled = false;
    // (a Ctrl-Z during the last drain: a later write outside a launch must not stop the process)
    g_suspend_requested = 0;
    g_continued = 0;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  int fd() const { return read_.get(); }

  // Signal numbers received since the last call, in order.
  std::vector<int> drain() {
    std::vector<int> sigs;
    unsigned char buf[256];
    while (true) {
      ssize_t r = ::read(read_.get(), buf, sizeof buf);
      if (r > 0) {
        sigs.insert(sigs.end(), buf, buf + r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      break;
    }
    return sigs;
  }

  // SIGHUP (a closed terminal) and SIGQUIT stop the workers as SIGTERM does: unhandled, they killed the launcher
  // alone and left whatever the workers had started running.
  static constexpr int kHandled = 10;
  static constexpr int kSignals[kHandled] = {SIGINT,  SIGTERM, SIGHUP,  SIGQUIT, SIGCHLD,
                                             SIGUSR1, SIGUSR2, SIGALRM, SIGTSTP, SIGCONT};

 private:
  FileDescriptor read_, write_;
  struct sigaction old_[kHandled] {};
  struct sigaction old_pipe_ {};
  sigset_t old_mask_{};
};

// Blocks every signal in this thread while a child is forked, so no handler runs in the child before exec.
class BlockSignals {
 public:
  BlockSignals() {
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old_);
  }
  ~BlockSignals() { pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

// Kills the workers' process groups when the launcher dies without doing so (SIGKILL, the OOM killer):
// PR_SET_PDEATHSIG reaches a worker itself, not what it started, and a worker's children (`sh -c`, a Python
// wrapper's) ran on, re-parented to init. A child of the launcher in a process group of its own with the stop signals
// ignored, reading a pipe only the launcher writes: each worker's process group once it started (+pgid) and once the
// launcher has reaped it (-pgid). At end of file with groups left, the launcher died with workers it had not reaped:
// it SIGKILLs their groups. Best effort: without a pipe or a fork, launches go on as before.
class Watchdog {
 public:
  // `orphan_command`: run (exec'd) by the watchdog when the launcher went without ending the job itself (killed with
  // SIGKILL), after it has killed the workers' groups (LaunchSpec::orphan_command).
  explicit Watchdog(const std::vector<std::string>& orphan_command) {
    for (const auto& a : orphan_command) argv_.push_back(const_cast<char*>(a.c_str()));
    if (!argv_.empty()) argv_.push_back(nullptr);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    const int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    rlimit files{};
    const int max_fd = ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur != RLIM_INFINITY
                           ? static_cast<int>(std::min<rlim_t>(files.rlim_cur, 1 << 20))
                           : 1 << 16;
    pid_t pid;
    {
      BlockSignals block;  // (no launcher handler runs in the child)
      pid = ::fork();
      if (pid == 0) watch(fds[0], fds[1], null_fd, max_fd, argv_.empty() ? nullptr : argv_.data());
    }
    ::close(fds[0]);
    if (null_fd >= 0) ::close(null_fd);
    if (pid < 0) {
      ::close(fds[1]);
      return;
    }
    pid_ = pid;
    fd_ = fds[1];
  }
  ~Watchdog() {
    send(1);                     // a clean end: no orphan command
    if (fd_ >= 0) ::close(fd_);  // end of file: it exits, with nothing left to kill
    if (pid_ <= 0) return;
    // (at once, normally; should it not see the end, a launch must not wait on it)
    for (int i = 0; i < 200 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i) ::usleep(5000);
    if (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void started(pid_t pgid) { send(static_cast<int32_t>(pgid)); }
  void reaped(pid_t pgid) { send(-static_cast<int32_t>(pgid)); }
  pid_t pid() const { return pid_; }

 private:
  void send(int32_t v) {
    if (fd_ < 0) return;
    ssize_t r;
    do {
      r = ::write(fd_, &v, sizeof v);
    } while (r < 0 && errno == EINTR);
  }
  // In the child: async-signal-safe calls only (the launcher may have threads: libtorch's in `conduit train`).
  [[noreturn]] static void watch(int rd, int wr, int null_fd, int max_fd, char* const* orphan_argv) {
    ::close(wr);      // (its own copy of the write end would keep the end of file from coming)
    ::setpgid(0, 0);  // out of the launcher's group: a Ctrl-C or a group kill meant for it leaves this to clean up
    for (int sig : SignalScope::kSignals) ::signal(sig, SIG_IGN);
    ::signal(SIGPIPE, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // The read end to 3, then /dev/null on 0-2 (not the launcher's output: its readers see it end; the read end may
    // have been one of them when the launcher started with one closed), every other descriptor closed.
    const int keep = ::fcntl(rd, F_DUPFD, 3);
    if (keep < 0) ::_exit(0);
    if (null_fd >= 0)
      for (int fd = 0; fd < 3; ++fd) ::dup2(null_fd, fd);
    if (keep != 3 && ::dup2(keep, 3) != 3) ::_exit(0);
    if (::close_range(4, ~0U, 0) != 0)  // (ENOSYS before Linux 5.9, or a seccomp filter)
      for (int fd = 4; fd < max_fd; ++fd) ::close(fd);
    pid_t groups[kMaxLocalWorkers];
    int n = 0;
    int32_t v;
    bool clean = false;  // the launcher said it ends the job itself
    for (;;) {
      const ssize_t r = ::read(3, &v, sizeof v);
      if (r < 0 && errno == EINTR) continue;
      if (r != static_cast<ssize_t>(sizeof v)) break;  // end of file: the launcher is gone
      if (v == 1) {
        clean = true;
      } else if (v > 1 && n < kMaxLocalWorkers) {  // (a process group id; 1 would make kill(-1) signal everything)
        groups[n++] = v;
      } else if (v < 0) {
        for (int i = 0; i < n; ++i)
          if (groups[i] == -v) {
            groups[i] = groups[--n];
            break;
          }
      }
    }
    for (int i = 0; i < n; ++i) ::kill(-groups[i], SIGKILL);
    if (!clean && orphan_argv != nullptr) {
      // (default dispositions first: an ignored SIGCHLD is kept across exec, and the command's own children were
      // reaped before it could wait for them)
      for (int sig : SignalScope::kSignals) ::signal(sig, SIG_DFL);
      ::signal(SIGPIPE, SIG_DFL);
      ::execv(orphan_argv[0], orphan_argv);
    }
    ::_exit(0);
  }
  std::vector<char*> argv_;
  pid_t pid_ = -1;
  int fd_ = -1;
};

// Stops the workers and then the launcher (SIGTSTP); returns once the launcher is continued, having continued them.
void suspend_job();

// ---- output forwarding ----

// Writes everything, blocking as the reader requires (back-pressure on the workers). Once SIGINT/SIGTERM arrived, or
// the supervision loop's next deadline passed, waits at most kStalledOutputWait for the output to take more, so a
// stalled terminal or pipe cannot keep the launcher from stopping the workers.
void write_all(int fd, const char* data, size_t size) {
  constexpr int kStalledOutputWaitMs = 1000;
  while (size > 0) {
    // (stalled: once given up on, its output stays dropped, also once the deadline that gave up has moved on to the
    // next one, the grace before SIGKILL: the writes waited that out, and the stopped workers went unreaped)
    if (fd >= 0 && fd < 3 && (g_output_dropped[fd] || g_output_stalled[fd])) return;
    if (g_suspend_requested) suspend_job();  // (blocked here, the launcher never reached its loop to stop)
    // (the time suspend_job stopped the job for is not yet added to the loop's deadlines)
    const bool giving_up =
        g_stop_requested || (g_output_deadline && Clock::now() >= *g_output_deadline + g_suspended_for);
    size_t chunk = size;
    if (giving_up) {
      pollfd p{fd, POLLOUT, 0};
      int r = timed_poll(&p, 1, kStalledOutputWaitMs);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0 || (p.revents & (POLLERR | POLLNVAL)) != 0) {
        if (fd >= 0 && fd < 3) g_output_stalled[fd] = true;
        return;
      }
      chunk = std::min<size_t>(size, PIPE_BUF);  // fits in the room POLLOUT promised
    } else {
      // Room first, waited for in slices, then no more than that room: a Ctrl-Z that came between the check above
      // and a write that blocks (on a reader stopped by the same Ctrl-Z) was never acted on.
      pollfd p{fd, POLLOUT, 0};
      const int r = timed_poll(&p, 1, 100);
      // (POLLOUT never comes: a pipe whose reader went away, as EPIPE below; a descriptor not open, or open for
      // reading only (`1<file`), whose output is dropped)
      if (r > 0 && (p.revents & POLLERR) != 0) {
        if (fd >= 0 && fd < 3) g_output_broken[fd] = true;
        return;
      }
      if ((r > 0 && (p.revents & POLLNVAL) != 0) || (r == 0 && (::fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDONLY)) {
        if (fd >= 0 && fd < 3) g_output_dropped[fd] = true;
        return;
      }
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      if (r > 0 && (p.revents & POLLOUT) != 0) chunk = std::min<size_t>(size, PIPE_BUF);
    }
    if (fd >= 0 && fd < 3 && g_output_broken[fd]) return;
    const auto write_started = Clock::now();
    ssize_t w = ::write(fd, data, chunk);
    g_waited += Clock::now() - write_started;  // (a stop lands after it: a write to a file is not interrupted)
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        // A non-blocking stdout (shared with a program that set O_NONBLOCK): full for now, not closed. Wait for room
        // (it was dropped as if closed: 864 of 6000 lines arrived, and the launcher said nothing).
        pollfd p{fd, POLLOUT, 0};
        if (timed_poll(&p, 1, kStalledOutputWaitMs) == 0 && giving_up) {
          if (fd >= 0 && fd < 3) g_output_stalled[fd] = true;
          return;
        }
        continue;
      }
      if (errno == EPIPE && fd >= 0 && fd < 3) g_output_broken[fd] = true;
      return;  // stdout/stderr closed or broken: drop the output, keep supervising the workers
    }
    data += w;
    size -= static_cast<size_t>(w);
  }
}

struct Stream {
  FileDescriptor fd;    // read end of the worker's stdout or stderr pipe
  int out_fd = 1;       // where its lines go
  std::string pending;  // an incomplete last line
  bool raw = false;     // bytes pass through as they come (one worker, no prefix): nothing held back
};

struct Worker {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  Stream streams[2];
  std::string prefix;
};

// The workers of the launch in progress, for suspend_job (null outside run_local_workers).
std::vector<Worker>* g_workers = nullptr;

void signal_workers(int sig) {
  if (g_workers == nullptr) return;
  for (auto& w : *g_workers)
    if (w.running) ::kill(-w.pid, sig);
}

void suspend_job() {
  g_suspend_requested = 0;
  // SIGTSTP rather than SIGSTOP: a worker that handles it (to restore a terminal, say) does, as in a foreground job.
  signal_workers(SIGTSTP);
  // Then the launcher, as SIGTSTP's default action: raised in this thread, it stops before raise returns. Where the
  // kernel discards it (an orphaned process group, which nobody would continue), the job goes on at once.
  struct sigaction dfl {
  }, handler{};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGTSTP, &dfl, &handler);
  const auto stopped_at = Clock::now();
  ::raise(SIGTSTP);
  g_suspended_for += Clock::now() - stopped_at;
  ::sigaction(SIGTSTP, &handler, nullptr);
  g_continued = 1;  // (SIGCONT's handler says so too; not where the stop was discarded)
  signal_workers(SIGCONT);
}

// Appends data to the stream and writes out every complete line, each with the prefix, in one write call.
void forward(Stream& s, const std::string& prefix, const char* data, size_t size) {
  if (s.raw) {  // (a progress bar's \r, a prompt or binary output showed nothing until a newline, and gained ones)
    write_all(s.out_fd, data, size);
    return;
  }
  s.pending.append(data, size);
  size_t last = s.pending.rfind('\n');
  if (last == std::string::npos) {
    if (s.pending.size() >= kMaxPendingLine) {
      // Tagged, a line of its own (raw streams never get here); untagged, the bytes as they are (a newline added
      // there changed a worker's binary output: 3,000,000 bytes came out as 3,000,003).
      std::string out = prefix.empty() ? std::move(s.pending) : prefix + s.pending + "\n";
      write_all(s.out_fd, out.data(), out.size());
      s.pending.clear();
    }
    return;
  }
  if (prefix.empty()) {
    write_all(s.out_fd, s.pending.data(), last + 1);
  } else {
    std::string out;
    out.reserve(last + 1 + prefix.size() * 8);
    size_t start = 0;
    while (start <= last) {
      size_t nl = s.pending.find('\n', start);
      out += prefix;
      out.append(s.pending, start, nl + 1 - start);
      start = nl + 1;
    }
    write_all(s.out_fd, out.data(), out.size());
  }
  s.pending.erase(0, last + 1);
}

// Writes an unterminated last line and closes the stream. Tagged, with a newline added, so that another worker's
// output starts a line of its own; untagged (--no-tag-output), as it is: the workers' bytes are passed on unchanged.
void finish(Stream& s, const std::string& prefix) {
  if (!s.pending.empty()) {
    std::string out = prefix.empty() ? s.pending : prefix + s.pending + "\n";
    write_all(s.out_fd, out.data(), out.size());
    s.pending.clear();
  }
  s.fd.reset();
}

// Reads once from a readable stream; closes it at end of file.
// Once the stream's destination lost its reader, the stream's pipe is closed: the worker's next write meets it.
bool drop_if_broken(Stream& s) {
  if (s.out_fd < 0 || s.out_fd >= 3 || !g_output_broken[s.out_fd]) return false;
  s.pending.clear();
  s.fd.reset();
  return true;
}

void pump(Stream& s, const std::string& prefix, std::vector<char>& buf) {
  ssize_t r = ::read(s.fd.get(), buf.data(), buf.size());
  if (r > 0) {
    forward(s, prefix, buf.data(), static_cast<size_t>(r));
    drop_if_broken(s);
  } else if (r == 0 || (errno != EINTR && errno != EAGAIN)) {
    finish(s, prefix);
  }
}

// Reads what a stream holds right now, up to a bound (a process left behind may keep writing), before the
// launcher announces that the stream's worker exited.
void pump_all(Stream& s, const std::string& prefix, std::vector<char>& buf) {
  for (int reads = 0; reads < 64 && s.fd.valid(); ++reads) {
    ssize_t r = ::read(s.fd.get(), buf.data(), buf.size());
    if (r > 0) {
      forward(s, prefix, buf.data(), static_cast<size_t>(r));
      if (drop_if_broken(s)) return;
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      if (r == 0 || errno != EAGAIN) finish(s, prefix);
      return;
    }
  }
}

// ---- what the workers start outside their process groups ----

// Makes this process the subreaper of its descendants for its lifetime (PR_SET_CHILD_SUBREAPER): what a worker starts
// outside its process group (setsid, a daemon's double fork), which the launcher's signals to the groups never reach,
// is re-parented here instead of to init once the process that started it exits, and can be found and stopped when
// the job ends (a `setsid sleep` of each worker ran on after the launch).
class SubreaperScope {
 public:
  explicit SubreaperScope(bool on) {
    if (on && ::prctl(PR_GET_CHILD_SUBREAPER, &before_) == 0) set_ = ::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  }
  ~SubreaperScope() {
    if (set_) ::prctl(PR_SET_CHILD_SUBREAPER, before_);
  }
  SubreaperScope(const SubreaperScope&) = delete;
  SubreaperScope& operator=(const SubreaperScope&) = delete;
  bool active() const { return set_; }

 private:
  int before_ = 0;
  bool set_ = false;
};

// This process's children but `skip` (the watchdog, the workers), from the parent pid in /proc/PID/stat: with the
// launcher their subreaper, what its workers left outside their process groups once their parents exited.
std::vector<pid_t> adopted_children(const std::vector<pid_t>& skip) {
  std::vector<pid_t> kids;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return kids;
  const pid_t self = ::getpid();
  while (const dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || std::find(skip.begin(), skip.end(), pid_t(pid)) != skip.end()) continue;
    std::ifstream in(fmt::format("/proc/{}/stat", pid));
    std::string stat;
    std::getline(in, stat);
    // pid (comm) state ppid ...: the name may hold spaces and parentheses, the last ')' ends it.
    const size_t paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    char state = 0;
    long ppid = 0;
    if (std::sscanf(stat.c_str() + paren + 1, " %c %ld", &state, &ppid) == 2 && ppid == self)
      kids.push_back(pid_t(pid));
  }
  ::closedir(proc);
  return kids;
}

// SIGKILLs the adopted children (and what they started, re-parented here as each goes) and reaps them, for up to
// two seconds: one stuck in uninterruptible sleep is left. Only this process's own children are signalled, not yet
// reaped: their pids cannot have been reused. Returns how many were stopped, not counting those still in one of
// `groups` (the workers' process groups, SIGKILLed already as each worker exited: those are still dying).
int stop_adopted(const std::vector<pid_t>& skip, const std::vector<pid_t>& groups) {
  int stopped = 0;
  const auto end = Clock::now() + std::chrono::seconds(2);
  std::vector<pid_t> left;
  while (Clock::now() < end) {
    std::vector<pid_t> kids = adopted_children(skip);
    kids.erase(std::remove_if(kids.begin(), kids.end(),
                              [&](pid_t k) { return std::find(left.begin(), left.end(), k) != left.end(); }),
               kids.end());
    if (kids.empty()) break;
    for (pid_t k : kids) {
      siginfo_t info{};
      // (one that already exited, a zombie, is only reaped)
      const bool exited = ::waitid(P_PID, id_t(k), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == k;
      if (!exited) {
        if (std::find(groups.begin(), groups.end(), ::getpgid(k)) == groups.end()) ++stopped;
        ::kill(k, SIGKILL);
      }
    }
    for (pid_t k : kids) {
      while (::waitpid(k, nullptr, WNOHANG) == 0 && Clock::now() < end) ::usleep(2000);
      if (::waitpid(k, nullptr, WNOHANG) == 0) left.push_back(k);
    }
  }
  return stopped;
}

// ---- program lookup ----

bool is_executable_file(const std::string& path, int* err) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    *err = errno;
    return false;
  }
  if (S_ISDIR(st.st_mode)) {
    *err = EISDIR;
    return false;
  }
  if (::access(path.c_str(), X_OK) != 0) {
    *err = errno;
    return false;
  }
  return true;
}

// The path execve will run, as execvp would find it; nullopt with `why` set when there is none.
std::optional<std::string> resolve_program(const std::string& program, std::string* why) {
  int err = ENOENT;
  if (program.empty()) {
    *why = "the program name is empty";
    return std::nullopt;
  }
  if (program.find('/') != std::string::npos) {
    if (is_executable_file(program, &err)) return program;
    *why = std::strerror(err);
    return std::nullopt;
  }
  auto path = env_string("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
  int first_err = 0;
  for (const auto& dir : split(path, ':')) {
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    int e = 0;
    if (is_executable_file(candidate, &e)) return candidate;
    if (e != ENOENT && e != ENOTDIR && first_err == 0) first_err = e;  // found but not runnable: say why
  }
  *why = first_err != 0 ? std::strerror(first_err) : "not found in PATH";
  return std::nullopt;
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

std::string describe_exit(const siginfo_t& info, int* code) {
  if (info.si_code == CLD_EXITED) {
    *code = info.si_status;
    return fmt::format("exited with code {}", info.si_status);
  }
  *code = 128 + info.si_status;
  return fmt::format("was killed by signal {} ({})", info.si_status, signal_name(info.si_status));
}

std::string plural_workers(int n) { return fmt::format("{} worker{}", n, n == 1 ? "" : "s"); }

std::string stopping_others(int others) {
  if (others == 0) return "";
  if (others == 1) return "; stopping the other worker";
  return fmt::format("; stopping the other {} workers", others);
}

void message(const LaunchSpec& spec, const std::string& text) {
  std::string line = spec.name + ": " + text + "\n";
  write_all(2, line.data(), line.size());
}

std::vector<std::string> current_environment() {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// In the child between fork and exec: async-signal-safe calls only.
// `cpu` >= 0: bound to that CPU; else given `start_mask` when there is one (the launcher's thread may have been
// narrowed since the program started: an unbound worker inherited it).
// `script_argv`: /bin/sh, path and argv's arguments, run when the kernel does not know the file's format (ENOEXEC):
// a script without a "#!" line, as execvp runs one.
[[noreturn]] void exec_child(int out_fd, int err_fd, int null_fd, int report_fd, pid_t parent, const char* path,
                             char* const* argv, char* const* script_argv, char* const* envp, const rlimit* file_limit,
                             int cpu, const cpu_set_t* start_mask) {
  if (cpu >= 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    ::sched_setaffinity(0, sizeof one, &one);
  } else if (start_mask != nullptr) {
    ::sched_setaffinity(0, sizeof *start_mask, start_mask);
  }
  ::setpgid(0, 0);                     // own process group: the launcher signals the worker and everything it starts
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL takes its workers (their children: Watchdog)
  if (::getppid() != parent) ::_exit(kExecFailedCode);
  if (file_limit != nullptr) ::setrlimit(RLIMIT_NOFILE, file_limit);  // what the launcher raised for itself
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  struct sigaction ign = dfl;
  ign.sa_handler = SIG_IGN;
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE, SIGTSTP, SIGCONT}) {
    const int ig = ignorable_index(sig);
    ::sigaction(sig, ig >= 0 && g_ignored[ig] ? &ign : &dfl, nullptr);
  }
  int targets[3] = {0, 1, 2};
  int sources[3] = {null_fd, out_fd, err_fd};
  for (int i = 0; i < 3; ++i) {
    if (sources[i] == targets[i]) {
      ::fcntl(targets[i], F_SETFD, 0);  // dup2 onto itself would keep close-on-exec
    } else if (::dup2(sources[i], targets[i]) < 0) {
      int e = errno;
      ssize_t r = ::write(report_fd, &e, sizeof e);
      (void)r;
      ::_exit(kExecFailedCode);
    }
  }
  sigset_t none;
  sigemptyset(&none);
  ::pthread_sigmask(SIG_SETMASK, &none, nullptr);
  ::execve(path, argv, envp);
  if (errno == ENOEXEC) ::execve(script_argv[0], script_argv, envp);  // (refused as "Exec format error", exit 127)
  int e = errno;
  ssize_t r = ::write(report_fd, &e, sizeof e);
  (void)r;
  ::_exit(kExecFailedCode);
}

// Each worker keeps two pipe ends open in the launcher: raise the soft limit on open files when it is too low.
// Returns the limit to restore in the workers when it was raised.
std::optional<rlimit> ensure_file_limit(int nprocs) {
  const rlim_t needed = static_cast<rlim_t>(nprocs) * 2 + 64;
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= needed) return std::nullopt;
  rlimit raised = lim;
  raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? needed : std::min(lim.rlim_max, needed);
  if (raised.rlim_cur < needed || ::setrlimit(RLIMIT_NOFILE, &raised) != 0) {
    throw ConfigError(
        fmt::format("launch: {} workers need about {} open files but the limit is {} (raise it with "
                    "ulimit -n, or start fewer workers)",
                    nprocs, static_cast<unsigned long long>(needed), static_cast<unsigned long long>(lim.rlim_max)));
  }
  return lim;
}

}  // namespace

std::optional<std::string> find_program(const std::string& program, std::string* why) {
  return resolve_program(program, why);
}

// The host part of a master address: an IPv6 literal in brackets ([::1]), as the TCP store takes it, without them.
static std::string master_host(const std::string& addr) {
  return addr.size() > 2 && addr.front() == '[' && addr.back() == ']' ? addr.substr(1, addr.size() - 2) : addr;
}

// The master address's addresses (ConfigError naming it when it does not resolve); the caller frees them.
static addrinfo* resolve_master(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(master_host(addr).c_str(), "0", &hints, &res);
  if (rc != 0) {
    throw ConfigError(fmt::format("launch: master address '{}' cannot be resolved: {}", addr, ::gai_strerror(rc)));
  }
  return res;
}

int find_free_port(const std::string& addr) {
  addrinfo* res = resolve_master(addr);
  const std::string host = master_host(addr);
  std::string last_error = "no address";
  int port = 0;
  // Binds `want` (0: the kernel's choice) on the address; the port bound, or 0. (An IPv6 socket takes IPv4 too, as
  // the store's wildcard does; to a specific address it makes no difference.)
  auto try_bind = [&](const addrinfo* ai, int want) {
    sockaddr_storage a{};
    std::memcpy(&a, ai->ai_addr, std::min<size_t>(ai->ai_addrlen, sizeof a));
    if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&a)->sin_port = htons(uint16_t(want));
    if (a.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&a)->sin6_port = htons(uint16_t(want));
    FileDescriptor s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    int zero = 0;
    if (s.valid() && ai->ai_family == AF_INET6) ::setsockopt(s.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (!s.valid() || ::bind(s.get(), reinterpret_cast<sockaddr*>(&a), ai->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      return 0;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(s.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      last_error = std::strerror(errno);
      return 0;
    }
    if (bound.ss_family == AF_INET) return int(ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port));
    if (bound.ss_family == AF_INET6) return int(ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port));
    return 0;
  };
  // Rank 0 binds the port seconds later. One from the kernel's ephemeral range
  // (/proc/sys/net/ipv4/ip_local_port_range) could meanwhile be handed to any process's outgoing connection, and a
  // worker retrying its connect to a port in that range can be given that very port as its own and connect to itself
  // (TCP's simultaneous open): a port below the range, from a start that differs between launchers, that binds now.
  int lo = 32768, hi = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> lo >> hi;
  constexpr int kFirst = 20000;  // (below: ports services commonly listen on)
  // Rank 0's store listens on every interface unless the address is a numeric loopback one
  // (net::store_listen_host): a candidate is probed as it will bind, IPv6's wildcard taking IPv4 too where the host
  // has IPv6, else IPv4's (a port free on one address can be taken on another).
  const bool any = net::store_listen_host(host) == "*";
  sockaddr_in6 any6{};
  any6.sin6_family = AF_INET6;
  any6.sin6_addr = in6addr_any;
  sockaddr_in any4{};
  any4.sin_family = AF_INET;
  any4.sin_addr.s_addr = htonl(INADDR_ANY);
  addrinfo wildcard{};
  wildcard.ai_socktype = SOCK_STREAM;
  if (FileDescriptor(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0)).valid()) {
    wildcard.ai_family = AF_INET6;
    wildcard.ai_addr = reinterpret_cast<sockaddr*>(&any6);
    wildcard.ai_addrlen = sizeof any6;
  } else {
    wildcard.ai_family = AF_INET;
    wildcard.ai_addr = reinterpret_cast<sockaddr*>(&any4);
    wildcard.ai_addrlen = sizeof any4;
  }
  for (addrinfo* ai = res; ai != nullptr && port == 0; ai = ai->ai_next) {
    if (try_bind(ai, 0) == 0) continue;  // (not an address of this host)
    const int span = lo - kFirst;
    if (span >= 1000) {
      const auto seed =
          uint64_t(::getpid()) * 7919u + uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
      const int start = int(seed % uint64_t(span));
      for (int i = 0; i < span && port == 0; ++i) {
        const int want = kFirst + (start + i) % span;
        port = try_bind(any ? &wildcard : ai, want);
      }
    }
    if (port == 0) port = try_bind(ai, 0);  // (no room below the range, or nothing there binds)
  }
  ::freeaddrinfo(res);
  if (port == 0) {
    throw ConfigError(fmt::format(
        "launch: cannot bind a port on master address '{}' ({}); give an address of this host with --master-addr "
        "or a port with --master-port",
        addr, last_error));
  }
  return port;
}

int env_world_size() {
  // (strict, as the bootstrap reads them: " 4" and "+4" passed here; an MPI launcher's size only where the bootstrap
  // takes MPI's world: torchrun's workers, TORCHELASTIC_RUN_ID, meet by WORLD_SIZE whatever an outer launcher set)
  if (net::mpi_launched())
    for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
      if (auto n = env_int(v, 1, 1 << 20)) return static_cast<int>(*n);
  if (auto n = env_int("WORLD_SIZE", 1, 1 << 20)) return static_cast<int>(*n);
  if (env_string("RANK"))  // (empty is unset, as everywhere else)
    throw ConfigError("environment: RANK is set but WORLD_SIZE is not; allowed: both (torchrun) or neither");
  return 0;
}

std::string make_job_id() {
  auto ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  return fmt::format("{:x}-{:x}", static_cast<unsigned>(::getpid()), static_cast<unsigned long long>(ns));
}

namespace {
std::string_view key_of(std::string_view entry) { return entry.substr(0, entry.find('=')); }
// An entry that gives its variable a value: an empty one is unset, as everywhere else (`OMP_NUM_THREADS=` left the
// workers of several without the 1 they get when it is unset).
bool has_value(std::string_view entry) { return entry.find('=') + 1 < entry.size(); }
bool sets(const LaunchSpec& spec, std::string_view key) {
  for (const auto& [k, v] : spec.extra_env)
    if (k == key) return true;
  return false;
}
}  // namespace

bool unpins_openmp(const std::vector<std::string>& base, const LaunchSpec& spec, bool bound) {
  if (spec.nprocs < 2 || bound || sets(spec, "OMP_PROC_BIND")) return false;
  for (const auto& entry : base)
    if ((key_of(entry) == "OMP_PROC_BIND" || key_of(entry) == "OMP_PLACES") && has_value(entry)) return true;
  return false;
}

std::vector<std::string> worker_environment(const std::vector<std::string>& base, const LaunchSpec& spec, int rank,
                                            int master_port, const std::string& job_id, bool bound) {
  const bool unpin = unpins_openmp(base, spec, bound);
  const int n = spec.nprocs;
  // As torchrun: several workers each running a full OpenMP pool would oversubscribe the cores.
  // (once: given in extra_env as well, the first of two entries won for getenv, the last for Python's os.environ)
  bool one_omp_thread = n > 1 && !sets(spec, "OMP_NUM_THREADS");
  for (const auto& entry : base)
    if (key_of(entry) == "OMP_NUM_THREADS" && has_value(entry)) one_omp_thread = false;
  auto dropped = [&](std::string_view key) {
    for (auto p : kDroppedPrefixes)
      if (key.starts_with(p)) return true;
    for (auto k : kOwnedVariables)
      if (key == k) return true;
    return sets(spec, key) || (unpin && key == "OMP_PROC_BIND") || (one_omp_thread && key == "OMP_NUM_THREADS");
  };
  std::vector<std::string> env;
  env.reserve(base.size() + 16);
  for (const auto& entry : base)
    if (!dropped(key_of(entry))) env.push_back(entry);
  auto set = [&](std::string_view key, const std::string& value) { env.push_back(fmt::format("{}={}", key, value)); };
  set("MASTER_ADDR", spec.master_addr);
  set("MASTER_PORT", std::to_string(master_port));
  set("RANK", std::to_string(rank));
  set("WORLD_SIZE", std::to_string(n));
  set("LOCAL_RANK", std::to_string(rank));
  set("LOCAL_WORLD_SIZE", std::to_string(n));
  set("GROUP_RANK", "0");
  set("GROUP_WORLD_SIZE", "1");
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_WORLD_SIZE", std::to_string(n));
  set("CONDUIT_JOB_ID", job_id);
  // The CPUs the workers share (the launcher's affinity and CPU quota, before any binding): the shm transport sizes
  // its spinning and fast path by ranks per CPU, and a bound worker alone would see one CPU.
  set("CONDUIT_LOCAL_CPUS", std::to_string(usable_cpus()));
  if (one_omp_thread) set("OMP_NUM_THREADS", "1");  // (an empty inherited one dropped above)
  if (unpin) set("OMP_PROC_BIND", "false");
  for (const auto& [k, v] : spec.extra_env) set(k, v);
  return env;
}

namespace {
// The CPUs workers are bound to, in order (empty: no binding).
std::vector<int> binding_cpus(const LaunchSpec& spec) {
  if (spec.bind != "auto" && spec.bind != "core" && spec.bind != "none")
    throw ConfigError(fmt::format("launch: --bind '{}' is not one of auto, core, none", spec.bind));
  // One worker keeps every CPU under "auto": binding it to the first one left a multi-threaded program one core.
  if (spec.bind == "none" || (spec.bind == "auto" && spec.nprocs == 1)) return {};
  // (the mask the program started with: the calling thread's may have been narrowed since, see start_affinity)
  std::vector<int> cpus = start_affinity();
  // Oversubscribed (more workers than CPUs), "auto" binds only when every CPU gets the same number of workers:
  // 4 shm workers on 2 cores bound two per core took 0.64-0.98x (median 0.85x) of the unbound median MLP step and
  // 0.87-1.21x (median 0.93x) of the CNN's, six alternating pairs of 100-300-step runs; with uneven counts a bound
  // CPU would run more workers than another and pace every synchronous step.
  const int c = static_cast<int>(cpus.size());
  if (spec.bind == "auto" && c < spec.nprocs && (c == 0 || spec.nprocs % c != 0)) return {};
  // One CPU of each core first: worker k mod C over the CPUs in number order put two workers on one core's SMT
  // siblings where the kernel numbers them next to each other, while other cores stayed idle.
  return cores_first(cpus, sysfs_core_of);
}
}  // namespace

int launcher_stop_signal() { return g_stop_signal; }
void set_launcher_stop_signal(int sig) { g_stop_signal = sig; }

int run_local_workers(const LaunchSpec& spec) {
  if (spec.nprocs < 1 || spec.nprocs > kMaxLocalWorkers) {
    throw ConfigError(fmt::format("launch: the number of workers (-n) must be between 1 and {}, got {}",
                                  kMaxLocalWorkers, spec.nprocs));
  }
  if (spec.master_port < 0 || spec.master_port > 65535) {
    throw ConfigError(fmt::format("launch: --master-port must be between 1 and 65535 (0 = pick a free one), got {}",
                                  spec.master_port));
  }
  if (spec.master_addr.empty()) throw ConfigError("launch: --master-addr is empty; give a host name or IP address");
  // (accepted, it reached the workers, whose bootstrap refused it, each rank after it started: refused here first, in
  // the same words)
  if (net::is_any_address(spec.master_addr))
    throw ConfigError("launch: " + net::any_address_refusal(fmt::format("--master-addr '{}'", spec.master_addr)));
  if (spec.command.empty()) throw ConfigError("launch: no program given; usage: conduit launch -n N -- PROGRAM [ARGS]");
  for (const auto& [k, v] : spec.extra_env) {
    if (k.empty() || k.find('=') != std::string::npos) {
      throw ConfigError(fmt::format("launch: environment variable name '{}' is invalid", k));
    }
  }
  double grace = spec.grace_seconds;
  // (the environment's range is the flag's: it said [0.001, 1e9] for -1 and up to 3600 for 3601)
  if (grace < 0) grace = env_seconds("CONDUIT_LAUNCH_GRACE", 3600).value_or(kDefaultGraceSeconds);
  if (grace > 3600)
    throw ConfigError(
        fmt::format("{}='{}' is invalid: expected a positive number of seconds up to 3600 (workers that "
                    "ignore SIGTERM are killed after it)",
                    spec.grace_seconds < 0 ? "environment variable CONDUIT_LAUNCH_GRACE" : "the grace period", grace));
  const auto grace_time = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace));
  // (1e-300 stopped the job at once: the least is CONDUIT_TIMEOUT's)
  if (!(spec.timeout_seconds == 0 || (spec.timeout_seconds >= 0.001 && spec.timeout_seconds <= 1e7)))
    throw ConfigError(fmt::format("{}: {} {:g} is invalid: allowed: 0 (none) or seconds from 0.001 up to 1e7",
                                  spec.name.rfind("conduit ", 0) == 0 ? spec.name.substr(8) : spec.name,
                                  spec.timeout_name, spec.timeout_seconds));
  // The flags first: a bad --bind was reported as the program's failure to run when both were wrong.
  const std::vector<int> bind_cpus = binding_cpus(spec);
  if (!spec.work.empty() && spec.work.size() != size_t(spec.nprocs))
    throw InvalidArgument(fmt::format("launch: {} workers' work for {} workers", spec.work.size(), spec.nprocs));
  // The index into bind_cpus of each rank's CPU.
  const std::vector<int> cpu_slot =
      bind_cpus.empty()
          ? std::vector<int>{}
          : spread_over_cpus(spec.work.empty() ? std::vector<double>(size_t(spec.nprocs), 1.0) : spec.work,
                             int(bind_cpus.size()));

  const std::string& program = spec.command[0];
  std::string why;
  auto resolved = resolve_program(program, &why);
  if (!resolved) {
    message(spec, fmt::format("cannot execute '{}': {}", program, why));
    return kExecFailedCode;
  }
  // (Checked with a port given too: the ranks started and each failed to reach it, or ran on without it.)
  if (spec.master_port != 0) ::freeaddrinfo(resolve_master(spec.master_addr));
  const int port = spec.master_port != 0 ? spec.master_port : find_free_port(spec.master_addr);
  const std::string job_id = spec.job_id.empty() ? make_job_id() : spec.job_id;
  // The workers' shared-memory segments go however this ends: an error out of the supervision below (poll failing,
  // memory running out while forwarding output) skipped the removal at its end. (Declared before the watchdog: its
  // end kills the workers first.)
  struct ShmCleanup {
    const std::string& job;
    int n;
    bool done = false;
    ~ShmCleanup() {
      if (done) return;
      try {
        net::remove_shm_segments(job, n);
      } catch (...) {  // (a destructor must not throw; the segments are named for this job alone)
      }
    }
  } shm_cleanup{job_id, spec.nprocs};

  const std::optional<rlimit> worker_file_limit = ensure_file_limit(spec.nprocs);
  SignalScope signals;
  Watchdog watchdog(spec.orphan_command);
  const SubreaperScope subreaper(spec.stop_escaped);
  // This process's children from before the workers (a shell's `cmd & exec conduit launch ...`, the `tee` of `exec >
  // >(tee log)`): not the workers', never stopped or reaped here (found by a review: they were killed as escaped,
  // and a job's log through a tee was cut short).
  const std::vector<pid_t> children_before = subreaper.active() ? adopted_children({}) : std::vector<pid_t>{};
  int escaped_stopped = 0;  // what the workers left outside their process groups, stopped when they were gone
  FileDescriptor dev_null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!dev_null.valid()) throw Error(fmt::format("launch: cannot open /dev/null: {}", std::strerror(errno)));

  const auto base_env = current_environment();
  const bool bound = !bind_cpus.empty();
  if (unpins_openmp(base_env, spec, bound))
    message(spec, fmt::format("OMP_PROC_BIND or OMP_PLACES is set and the {} workers are not bound to CPUs, so "
                              "each one's OpenMP runtime would pin its threads to the same first CPU: the workers "
                              "get OMP_PROC_BIND=false",
                              spec.nprocs));
  // Unbound workers get the mask the program started with (the launcher's thread may have been pinned since).
  const std::vector<int> start_cpus = start_affinity();
  cpu_set_t start_mask;
  CPU_ZERO(&start_mask);
  for (int c : start_cpus) CPU_SET(c, &start_mask);
  const cpu_set_t* unbound_mask = start_cpus.empty() ? nullptr : &start_mask;
  std::vector<std::string> args = spec.command;
  std::vector<char*> argv = c_strings(args);
  std::vector<std::string> script_args = {"/bin/sh", *resolved};
  script_args.insert(script_args.end(), args.begin() + 1, args.end());
  std::vector<char*> script_argv = c_strings(script_args);
  std::vector<Worker> workers(static_cast<size_t>(spec.nprocs));
  struct WorkersScope {
    explicit WorkersScope(std::vector<Worker>* w) { g_workers = w; }
    ~WorkersScope() { g_workers = nullptr; }
  } workers_scope(&workers);

  int result = 0;
  bool have_result = false;
  bool stopping = false;
  bool killed = false;
  int user_signals = 0;
  int stop_signal = SIGTERM;  // what the workers were asked to stop with
  Clock::time_point kill_deadline{};
  // After a worker's first failure by an error exit, the others get this long to end on their own before they are
  // told to stop: the rank whose error started it may not have printed it yet (it had closed its connections while
  // unwinding, a peer exited on the lost connection first, and the SIGTERM that followed ended the first rank before
  // it said why). A crash (a signal) stops the others at once.
  constexpr auto kSettle = std::chrono::milliseconds(500);
  std::optional<Clock::time_point> settle_deadline;

  auto running_count = [&]() {
    return static_cast<int>(std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return w.running; }));
  };
  auto signal_all = [&](int sig) {
    for (auto& w : workers)
      if (w.running) ::kill(-w.pid, sig);
  };
  auto begin_stop = [&](int sig) {
    settle_deadline.reset();
    signal_all(sig);
    signal_all(SIGCONT);  // a worker stopped meanwhile (SIGSTOP from elsewhere) acts on it now, not at SIGKILL
    if (!stopping) {
      stopping = true;
      stop_signal = sig;
      kill_deadline = Clock::now() + grace_time;
    }
  };
  // Workers SIGKILL has not ended by then (uninterruptible sleep) are left behind, named, rather than waited for
  // without end.
  constexpr auto kKilledWait = std::chrono::seconds(10);
  Clock::time_point abandon_deadline{};
  std::optional<Clock::time_point> drain_deadline;
  // The time the job spent stopped (Ctrl-Z, SIGSTOP) passes on the steady clock too: the deadlines move by it, so that
  // a job continued after its grace period had passed is not killed for it. A Ctrl-Z's stop is measured; a stop by
  // SIGSTOP from elsewhere is not seen, only the SIGCONT that ends it: the time the last pass of the loop below took
  // beyond its waits (g_waited), when that is over a second (as ExpiryThread: a pass's own work is shorter). The
  // whole pass was counted on any SIGCONT, so that one sent every 0.3 s without a stop put `--timeout` off for ever.
  // (Up to a second of a long stop goes uncounted: the part of the poll it cut short.)
  Clock::time_point last_pass = Clock::now();
  g_waited = Clock::duration::zero();
  // (a worker hung outside its collectives, or waiting on something else, kept the launcher waiting without end)
  std::optional<Clock::time_point> job_deadline;
  if (spec.timeout_seconds > 0)
    job_deadline =
        last_pass + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec.timeout_seconds));
  g_suspended_for = Clock::duration::zero();
  auto allow_for_a_stop = [&](Clock::time_point now) {
    auto stopped = g_suspended_for;
    if (stopped == Clock::duration::zero()) {
      const auto unexplained = now - last_pass - g_waited;
      if (unexplained > std::chrono::seconds(1)) stopped = unexplained;
    }
    g_suspended_for = Clock::duration::zero();
    kill_deadline += stopped;
    abandon_deadline += stopped;
    if (settle_deadline) *settle_deadline += stopped;
    if (drain_deadline) *drain_deadline += stopped;
    if (job_deadline) *job_deadline += stopped;
  };
  auto kill_all = [&]() {
    signal_all(SIGKILL);
    killed = true;
    abandon_deadline = Clock::now() + kKilledWait;
  };
  // Once the workers are gone: what they left outside their process groups goes too (it held the job's pipes open
  // through the drain below, and ran on after the launch).
  auto stop_escaped = [&]() {
    if (!subreaper.active()) return;
    std::vector<pid_t> workers_pids;
    for (const auto& w : workers)
      if (w.pid > 0) workers_pids.push_back(w.pid);
    std::vector<pid_t> skip = workers_pids;
    skip.push_back(watchdog.pid());
    skip.insert(skip.end(), children_before.begin(), children_before.end());
    escaped_stopped += stop_adopted(skip, workers_pids);  // (a worker's pid is its group's id)
  };

  // ---- start the workers ----
  // A SIGINT/SIGTERM that arrives meanwhile ends the loop; the supervision below handles it.
  for (int rank = 0; rank < spec.nprocs && !have_result && !g_stop_requested; ++rank) {
    Worker& w = workers[static_cast<size_t>(rank)];
    w.rank = rank;
    w.prefix = spec.tag_output ? fmt::format("[rank {}] ", rank) : std::string();
    auto env = worker_environment(base_env, spec, rank, port, job_id, bound);
    std::vector<char*> envp = c_strings(env);
    FileDescriptor out_r, out_w, err_r, err_w, rep_r, rep_w;
    try {
      std::tie(out_r, out_w) = make_pipe(0);
      std::tie(err_r, err_w) = make_pipe(0);
      std::tie(rep_r, rep_w) = make_pipe(0);
    } catch (const Error& e) {
      message(spec, fmt::format("cannot start rank {}: {}{}", rank, e.what(), stopping_others(running_count())));
      result = 1;
      have_result = true;
      begin_stop(SIGTERM);
      break;
    }
    pid_t parent = ::getpid();
    pid_t pid;
    {
      BlockSignals block;
      pid = ::fork();
      if (pid == 0) {
        exec_child(out_w.get(), err_w.get(), dev_null.get(), rep_w.get(), parent, resolved->c_str(), argv.data(),
                   script_argv.data(), envp.data(), worker_file_limit ? &*worker_file_limit : nullptr,
                   bind_cpus.empty() ? -1 : bind_cpus[size_t(cpu_slot[size_t(rank)])], unbound_mask);
      }
    }
    if (pid < 0) {
      message(spec, fmt::format("cannot start rank {}: fork failed: {}", rank, std::strerror(errno)));
      result = kExecFailedCode;
      have_result = true;
      begin_stop(SIGTERM);
      break;
    }
    ::setpgid(pid, pid);  // also here, so that signalling the group cannot race the child's own setpgid
    watchdog.started(pid);
    out_w.reset();
    err_w.reset();
    rep_w.reset();
    w.pid = pid;
    w.running = true;
    ::fcntl(out_r.get(), F_SETFL, O_NONBLOCK);  // the read ends only: the worker's stdout stays blocking
    ::fcntl(err_r.get(), F_SETFL, O_NONBLOCK);
    w.streams[0].fd = std::move(out_r);
    w.streams[0].out_fd = 1;
    w.streams[1].fd = std::move(err_r);
    w.streams[1].out_fd = 2;
    // One worker untagged: nothing to keep apart, its bytes go through as they come. (Several untagged are held back
    // to whole lines, or pieces of 1 MiB, so that one's lines are not cut into by another's; nothing is added.)
    w.streams[0].raw = w.streams[1].raw = !spec.tag_output && spec.nprocs == 1;
    // The report pipe closes on a successful exec; an errno arrives when exec failed.
    int exec_errno = 0;
    ssize_t r;
    do {
      r = ::read(rep_r.get(), &exec_errno, sizeof exec_errno);
    } while (r < 0 && errno == EINTR);
    if (r == static_cast<ssize_t>(sizeof exec_errno)) {
      watchdog.reaped(pid);
      ::waitpid(pid, nullptr, 0);
      w.running = false;
      for (auto& s : w.streams) s.fd.reset();
      int others = running_count();
      message(spec, fmt::format("cannot execute '{}' for rank {}: {}{}", program, rank, std::strerror(exec_errno),
                                stopping_others(others)));
      result = kExecFailedCode;
      have_result = true;
      begin_stop(SIGTERM);
    }
  }

  // ---- supervise: forward output, signals and exits until every worker is gone ----
  std::vector<char> buf(kReadChunk);
  std::vector<pollfd> fds;
  std::vector<std::pair<Stream*, const std::string*>> polled;  // stream and its worker's prefix

  auto reap = [&]() {
    // Every worker that has exited since the last pass, in rank order: exits this close together have no order we can
    // see, so when several failed in one pass all are named (the first by rank alone hid a failure that caused it).
    struct Exit {
      Worker* w;
      siginfo_t info;
      int code;
      std::string what;
    };
    std::vector<Exit> exits;
    for (auto& w : workers) {
      if (!w.running) continue;
      siginfo_t info{};
      // WNOWAIT keeps the worker a zombie, so its process group id cannot be reused while we signal it.
      if (::waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != w.pid)
        continue;
      int code = 0;
      std::string what = describe_exit(info, &code);
      // Whatever a worker started in its process group goes with it, also when it succeeded (its leftovers outlived
      // the launch, and in `conduit cluster run` shared the host with the next cell).
      ::kill(-w.pid, SIGKILL);
      watchdog.reaped(w.pid);  // (before the wait frees the group's id for reuse)
      ::waitpid(w.pid, nullptr, 0);
      w.running = false;
      exits.push_back({&w, info, code, std::move(what)});
    }
    // What the workers left outside their process groups and was re-parented here, reaped as it exits (no zombie
    // waits for the end of the job). WNOWAIT: a worker's exit found first is the loop's above, at the next pass (the
    // watchdog's, should it end early, waits for the end).
    while (subreaper.active()) {
      siginfo_t info{};
      if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) break;
      const pid_t pid = info.si_pid;
      if (pid == watchdog.pid() ||
          std::find(children_before.begin(), children_before.end(), pid) != children_before.end() ||
          std::any_of(workers.begin(), workers.end(), [pid](const Worker& w) { return w.running && w.pid == pid; }))
        break;
      ::waitpid(pid, nullptr, 0);
    }
    const Exit* first = nullptr;
    std::vector<std::string> also;
    const bool settling = settle_deadline.has_value();
    bool crashed = false;
    for (const auto& e : exits) {
      if (e.code == 0) continue;
      if (!stopping && !settling && first == nullptr) {
        first = &e;
      } else if (!stopping && !settling) {
        for (auto& st : e.w->streams) pump_all(st, e.w->prefix, buf);
        also.push_back(fmt::format("rank {} (pid {}) {}", e.w->rank, e.w->pid, e.what));
      } else if (settling ||
                 (e.info.si_code != CLD_EXITED && e.info.si_status != stop_signal && e.info.si_status != SIGKILL)) {
        // A worker that failed on its own after the first (the one that started it may be reaped later), or that
        // crashed while the others were being stopped: say so, or it stays hidden behind a peer's "connection
        // closed".
        for (auto& st : e.w->streams) pump_all(st, e.w->prefix, buf);
        message(spec, fmt::format("rank {} (pid {}) also {}", e.w->rank, e.w->pid, e.what));
        if (settling && e.info.si_code != CLD_EXITED) crashed = true;
      }
    }
    if (crashed && settle_deadline) begin_stop(SIGTERM);  // (a crash stops the others at once, as a first one does)
    if (first != nullptr) {
      for (auto& st : first->w->streams) pump_all(st, first->w->prefix, buf);
      const int others = running_count();
      result = first->code;
      have_result = true;
      // (decided before the line is written: a stalled stderr held the stop back; a crash among them stops the others
      // at once too)
      bool crash = first->info.si_code != CLD_EXITED;
      for (const auto& e : exits) crash = crash || (e.code != 0 && e.info.si_code != CLD_EXITED);
      if (!crash && others > 0)
        settle_deadline = Clock::now() + kSettle;
      else
        begin_stop(SIGTERM);
      message(spec,
              fmt::format("rank {} (pid {}) {}{}{}", first->w->rank, first->w->pid, first->what,
                          also.empty() ? std::string() : fmt::format(" (at about the same time: {})", join(also, "; ")),
                          stopping_others(others)));
    }
  };

  while (true) {
    auto now = Clock::now();
    if (g_continued) {  // before any deadline is looked at
      g_continued = 0;
      allow_for_a_stop(now);
    }
    last_pass = now;
    g_waited = Clock::duration::zero();
    bool any_running = running_count() > 0;
    bool any_open = false;
    for (auto& w : workers)
      for (auto& s : w.streams) any_open = any_open || s.fd.valid();
    if (!any_running && !any_open) break;
    if (!any_running && !drain_deadline) {
      stop_escaped();  // (a pipe that they held open closes now, and the drain ends)
      drain_deadline = Clock::now() + kDrainTime;  // (after the stopping, which may take up to 2 s)
    }
    if (drain_deadline && now >= *drain_deadline) {
      for (auto& w : workers)
        for (auto& s : w.streams)
          if (s.fd.valid()) finish(s, w.prefix);
      break;
    }
    if (settle_deadline && now >= *settle_deadline) begin_stop(SIGTERM);  // (the others still running: told now)
    if (job_deadline && !stopping && any_running && now >= *job_deadline) {
      job_deadline.reset();
      if (!have_result) {
        result = 124;  // (as timeout(1))
        have_result = true;
      }
      message(spec, fmt::format("{} still running at {} {:g} s; stopping {}", plural_workers(running_count()),
                                spec.timeout_name, spec.timeout_seconds, running_count() > 1 ? "them" : "it"));
      begin_stop(SIGTERM);
    }
    if (stopping && !killed && any_running && now >= kill_deadline) {
      message(spec, fmt::format("{} still running {:g} s after {}; sending SIGKILL", plural_workers(running_count()),
                                grace, signal_name(stop_signal)));
      kill_all();
    }
    if (killed && any_running && now >= abandon_deadline) {
      std::vector<std::string> left;
      for (auto& w : workers)
        if (w.running) {
          left.push_back(fmt::format("rank {} (pid {})", w.rank, w.pid));
          w.running = false;
        }
      message(spec, fmt::format("{} survived SIGKILL for {} s (uninterruptible sleep?); leaving {}", join(left, ", "),
                                kKilledWait.count(), left.size() > 1 ? "them" : "it"));
      if (!have_result) {
        result = 1;
        have_result = true;
      }
      break;
    }

    std::optional<Clock::time_point> wake;
    if (stopping && !killed && any_running) wake = kill_deadline;
    if (settle_deadline) wake = settle_deadline;
    if (killed && any_running) wake = abandon_deadline;
    if (drain_deadline) wake = wake ? std::min(*wake, *drain_deadline) : *drain_deadline;
    if (job_deadline && !stopping) wake = wake ? std::min(*wake, *job_deadline) : *job_deadline;
    g_output_deadline = wake;
    // At most a second between looks at the workers, should a child's exit ever go unsignalled.
    int timeout_ms = 1000;
    if (wake) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(*wake - now).count();
      timeout_ms = static_cast<int>(std::clamp<long long>(ms, 0, 1000));
    }

    fds.clear();
    polled.clear();
    fds.push_back({signals.fd(), POLLIN, 0});
    for (auto& w : workers) {
      for (auto& s : w.streams) {
        if (!s.fd.valid()) continue;
        fds.push_back({s.fd.get(), POLLIN, 0});
        polled.emplace_back(&s, &w.prefix);
      }
    }
    int n = timed_poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(fmt::format("launch: poll failed: {}", std::strerror(errno)));
    }

    bool child_event = false;
    if (fds[0].revents != 0) {
      for (int sig : signals.drain()) {
        if (sig == SIGCHLD) {
          child_event = true;  // reaped below
          continue;
        }
        if (passed_through(sig)) {
          signal_all(sig);
          continue;
        }
        if (sig == SIGTSTP) {
          if (g_suspend_requested) suspend_job();  // (else a write blocked on output did it already)
          continue;
        }
        if (sig == SIGCONT) {
          signal_all(SIGCONT);  // also workers stopped by something else (kill -STOP, a scheduler suspending the job)
          continue;
        }
        ++user_signals;
        if (!have_result) {
          result = 128 + sig;
          have_result = true;
          g_stop_signal = sig;
        }
        if (user_signals == 1) {
          // (SIGQUIT would make every worker dump core: they get SIGTERM, and the message says so)
          const int forward = sig == SIGQUIT ? SIGTERM : sig;
          message(spec, forward == sig ? fmt::format("received {}; forwarding it to {}", signal_name(sig),
                                                     plural_workers(running_count()))
                                       : fmt::format("received {}; sending {} to {}", signal_name(sig),
                                                     signal_name(forward), plural_workers(running_count())));
          begin_stop(forward);
        } else if (!killed) {
          message(spec,
                  fmt::format("received {} again; killing {}", signal_name(sig), plural_workers(running_count())));
          kill_all();
        }
      }
    }
    // Output first, so that what a worker printed before exiting comes before the launcher's line about it.
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      pump(*polled[i - 1].first, *polled[i - 1].second, buf);
    }
    if (child_event || n == 0) reap();
  }
  // (the loop's deadlines are over: a message after it, the cleanup's error, waits for its reader as any other)
  g_output_deadline.reset();
  stop_escaped();  // (also where the loop ended without a drain: no pipe held open)
  if (escaped_stopped > 0)
    message(spec, fmt::format(
                      "stopped {} the workers left running outside their process groups",
                      escaped_stopped == 1 ? std::string("1 process") : fmt::format("{} processes", escaped_stopped)));
  // A stop that came before the first worker started: the loop above had nothing to supervise and never read it (the
  // launch reported success).
  if (!have_result && g_stop_requested)
    for (int sig : signals.drain())
      if (sig != SIGCHLD && !passed_through(sig) && !job_control(sig) && !have_result) {
        message(spec, fmt::format("received {} before the workers started", signal_name(sig)));
        result = 128 + sig;
        have_result = true;
        g_stop_signal = sig;
      }
  // A worker killed while the ranks were meeting over shared memory leaves its segment behind (the ranks unlink them
  // once all have mapped them); with every worker gone, none is in use.
  net::remove_shm_segments(job_id, spec.nprocs);
  shm_cleanup.done = true;
  // The caller's cleanup while the watchdog still watches (it runs the orphan command should this process be killed
  // meanwhile: a `cluster run` killed during its own removal of what the workers left, left it).
  if (spec.after_workers) {
    try {
      spec.after_workers();
    } catch (const std::exception& e) {
      message(spec, fmt::format("cleaning up after the workers: {}", e.what()));
    }
    // A stop signal meanwhile (Ctrl-C during the cleanup) still ends this process by it once done: nothing read it.
    for (int sig : signals.drain())
      if (sig != SIGCHLD && !passed_through(sig) && !job_control(sig) && g_stop_signal == 0) g_stop_signal = sig;
  }
  return have_result ? result : 0;
}

}  // namespace conduit::cli
