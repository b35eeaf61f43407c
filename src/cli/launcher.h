#pragma once
// Local process launcher: what torchrun's standalone mode does for one host. Starts N worker processes with the
// rendezvous environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
// CONDUIT_JOB_ID), forwards each line of their output with a "[rank K] " prefix, forwards SIGINT/SIGTERM, stops and
// continues the workers with itself (SIGTSTP: Ctrl-Z; SIGCONT: fg/bg), and when one worker fails stops the others
// (at once when it was killed by a signal, half a second later when it exited with an error, so that a rank whose
// error a peer's exit preceded can still say why; each that fails meanwhile is named) and returns that worker's exit
// code. Used by `conduit launch` and by
// subcommands that start their own workers (`conduit train -n N`).
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace conduit::cli {

struct LaunchSpec {
  int nprocs = 1;                         // 1..kMaxLocalWorkers
  std::string master_addr = "127.0.0.1";  // MASTER_ADDR
  int master_port = 0;                    // MASTER_PORT; 0 = a free port found by binding port 0 on master_addr
  // program (looked up in PATH when it has no '/'; an executable file without a "#!" line runs under /bin/sh, as
  // execvp runs it) and its arguments
  std::vector<std::string> command;
  // Variables set in every worker after the launcher's own (they win over inherited and rendezvous ones).
  std::vector<std::pair<std::string, std::string>> extra_env;
  bool tag_output = true;               // prefix each output line with "[rank K] "
  double grace_seconds = -1;            // SIGTERM -> SIGKILL delay; < 0 = CONDUIT_LAUNCH_GRACE, else 10 s
  // > 0: the whole job's deadline (mpirun's --timeout): workers still running then are stopped as on SIGTERM and the
  // launcher returns 124 (time spent stopped by Ctrl-Z does not count); 0: none.
  double timeout_seconds = 0;
  std::string timeout_name = "--timeout";  // how the messages name it (conduit train: time_limit_s)
  std::string job_id;                   // CONDUIT_JOB_ID; empty = a fresh unique id
  std::string name = "conduit launch";  // how the launcher names itself in its messages
  // "core": worker k runs on CPU k mod C of the C CPUs this launcher may use, listed one CPU of each core before
  // any core's SMT sibling (cores_first, core/cpus.h), so two busy-polling workers never share a core when there
  // are enough and a peer on another core answers at once;
  // "none": the scheduler decides; "auto" (default): core when there are at least as many CPUs as workers or the
  // workers divide evenly over them (4 on 2 CPUs: two each), else none.
  std::string bind = "auto";
  // Each worker's share of the work (empty: equal); bound workers are spread by it (spread_over_cpus, core/cpus.h)
  // instead of k mod C: `conduit train` gives a pipeline's stages of unequal work.
  std::vector<double> work;
  // Run (exec'd, with /dev/null for output) when the launcher is killed with SIGKILL and cannot end the job itself,
  // once the workers' process groups are killed: `conduit cluster run` removes what its workers started outside
  // their groups. Empty: nothing. The first element is the program's path.
  std::vector<std::string> orphan_command;
  // What the workers start outside their process groups (setsid, a daemon), which the signals to the groups do not
  // reach, is re-parented to the launcher (PR_SET_CHILD_SUBREAPER) and SIGKILLed once the workers are gone, with a
  // line saying how many; not when the launcher itself is killed with SIGKILL (the watchdog kills the groups alone).
  // false: left to the caller (`conduit cluster run` stops them by their mark in the hosts, and says how many).
  bool stop_escaped = true;
  // Run when the workers are gone, before the watchdog is told the job ended cleanly (not when the launch throws or
  // its program cannot be executed); a stop signal meanwhile is kept for launcher_stop_signal().
  std::function<void()> after_workers;
};

inline constexpr int kMaxLocalWorkers = 1024;
inline constexpr int kExecFailedCode = 127;

// Runs the workers to completion. Returns 0 when all exit 0; the exit code of the first worker that failed
// (128 + signal when it was killed by one); 128 + signal when the launcher itself got SIGINT/SIGTERM; 127 when the
// program cannot be executed. Problems with the spec itself (bad n, port, empty command) throw ConfigError.
// Installs SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGCHLD/SIGUSR1/SIGUSR2/SIGALRM/SIGTSTP/SIGCONT handlers for its duration
// (keeping SIGINT, SIGHUP, SIGQUIT and SIGTSTP ignored when they were ignored at start, in the workers too), ignores
// SIGPIPE, and restores the previous ones; not reentrant. SIGTSTP stops the workers (forwarded to their process
// groups) and then the launcher; once continued it continues them (SIGCONT, which is also forwarded as it comes),
// and the time spent stopped does not count against its grace period and other deadlines.
int run_local_workers(const LaunchSpec& spec);
// The signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) that stopped the last run_local_workers, 0 when none did: `conduit`
// then ends by that signal itself (except SIGQUIT, which would dump core: exit code 131), so that a shell loop
// running it stops as it would for any program.
int launcher_stop_signal();
// Another command stopped by such a signal (conduit sweep between its cells) ends the same way.
void set_launcher_stop_signal(int sig);

// A TCP port that was free on `addr` a moment ago: below the kernel's ephemeral port range where there is room (a
// port from it could go to an outgoing connection before rank 0 binds it), else the kernel's choice (bind to port 0).
int find_free_port(const std::string& addr);

// The path execve will run for `program` (a path, or a name looked up in PATH as execvp does); nullopt with `why`
// set (e.g. "not found in PATH", "Permission denied") when there is none.
std::optional<std::string> find_program(const std::string& program, std::string* why);

// A unique id for one launch (hex of pid and time), safe in file and shared-memory names.
std::string make_job_id();

// WORLD_SIZE of an outer launcher: mpirun (OMPI/PMI/PMIx) or torchrun / conduit launch; 0 when none. ConfigError
// naming the variable when one is not a world size, or when RANK is set without WORLD_SIZE.
int env_world_size();

// The environment a worker starts with: `base` (KEY=VALUE entries) without OMPI_*/PMIX_*/PMI_* variables inherited
// from an outer mpirun and without the variables set here, then the rendezvous variables for `rank`, then extra_env.
// Workers of several (spec.nprocs > 1) that the launcher does not bind (`bound` false) get OMP_PROC_BIND=false in
// place of an inherited OMP_PROC_BIND or OMP_PLACES, unless extra_env sets it: each one's OpenMP runtime pinned its
// threads to the first CPU, all of them to the same one. Workers of several get OMP_NUM_THREADS=1 unless it is set
// (in `base` or extra_env). An empty variable counts as unset.
std::vector<std::string> worker_environment(const std::vector<std::string>& base, const LaunchSpec& spec, int rank,
                                            int master_port, const std::string& job_id, bool bound = false);
// Whether worker_environment replaces an inherited OMP_PROC_BIND or OMP_PLACES for unbound workers.
bool unpins_openmp(const std::vector<std::string>& base, const LaunchSpec& spec, bool bound);

}  // namespace conduit::cli
