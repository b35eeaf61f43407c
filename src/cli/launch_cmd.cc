// `conduit launch -n N [--master-port P] [--master-addr A] [--tag-output/--no-tag-output] -- PROGRAM [ARGS...]`:
// starts N local workers with torchrun's environment (see cli/launcher.h).
#include <fmt/format.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "cli/registry.h"
#include "core/error.h"

namespace conduit::cli {
namespace {

struct LaunchOptions {
  int nprocs = 1;
  int master_port = 0;
  std::string master_addr = "127.0.0.1";
  bool tag_output = true;
  std::string bind = "auto";
  bool port_given = false;
  double timeout = 0;
  std::vector<std::string> command;
};

void run_launch(const LaunchOptions& o) {
  if (o.nprocs < 1 || o.nprocs > kMaxLocalWorkers) {
    throw ConfigError(fmt::format("launch: -n must be between 1 and {}, got {}", kMaxLocalWorkers, o.nprocs));
  }
  if (o.port_given && (o.master_port < 1 || o.master_port > 65535)) {
    throw ConfigError(fmt::format("launch: --master-port must be between 1 and 65535, got {}", o.master_port));
  }
  if (o.command.empty()) {
    throw ConfigError("launch: no program given; usage: conduit launch -n N [options] -- PROGRAM [ARGS...]");
  }
  LaunchSpec spec;
  spec.nprocs = o.nprocs;
  spec.master_addr = o.master_addr;
  spec.master_port = o.master_port;
  spec.command = o.command;
  spec.tag_output = o.tag_output;
  spec.bind = o.bind;
  spec.timeout_seconds = o.timeout;
  set_exit_code(run_local_workers(spec));
}

const bool kRegistered = register_command(10, [](CLI::App& app) {
  auto opts = std::make_shared<LaunchOptions>();
  auto* c = app.add_subcommand(
      "launch",
      "Start N local worker processes with the rendezvous environment torchrun sets (MASTER_ADDR, MASTER_PORT, "
      "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, CONDUIT_JOB_ID), and OMP_NUM_THREADS=1 for "
      "several unless it is set, as torchrun does; prefix their output lines with the rank; stop all when one fails");
  c->add_option("-n,--nprocs", opts->nprocs, "number of worker processes (1..1024)")->required();
  auto* port = c->add_option("--master-port", opts->master_port,
                             "port of the rendezvous store served by rank 0 (1..65535; default: a free port)");
  c->add_option("--master-addr", opts->master_addr, "address of rank 0's rendezvous store")->capture_default_str();
  c->add_flag("--tag-output,!--no-tag-output", opts->tag_output, "prefix each output line with [rank K] (default on)");
  c->add_option(
       "--bind", opts->bind,
       "auto (default: worker k on CPU k mod C when there are enough CPUs or the workers divide evenly over them; "
       "a single worker is not bound), "
       "core (always so), none")
      ->capture_default_str();
  c->add_option("--timeout", opts->timeout,
                "seconds the whole job may run (0: no limit, the default); workers still running then are stopped as "
                "on SIGTERM and the launcher exits 124");
  // After "--" everything is the program and its arguments, even what looks like an option.
  c->add_option("command", opts->command,
                "PROGRAM [ARGS...] that every worker runs: every argument from the first one that is not an option (or "
                "after --) is its own");
  c->footer(
      "Example: conduit launch -n 4 -- conduit bench coll --op allreduce\n"
      "SIGINT/SIGTERM/SIGHUP are forwarded to the workers (SIGQUIT as SIGTERM); those still running "
      "CONDUIT_LAUNCH_GRACE seconds "
      "(default 10) after a stop get SIGKILL. Ctrl-Z (SIGTSTP) stops the workers with the launcher, and fg/bg "
      "(SIGCONT) continues them; time spent stopped does not count against that grace (it does against the workers' "
      "own collective deadlines, CONDUIT_TIMEOUT: a stop longer than that fails the job when it continues). Workers "
      "read stdin from "
      "/dev/null and run in their own process groups.");
  c->callback([opts, port]() {
    LaunchOptions o = *opts;
    o.port_given = port->count() > 0;
    run_launch(o);
  });
});

}  // namespace
}  // namespace conduit::cli
