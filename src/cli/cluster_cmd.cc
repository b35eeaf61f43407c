// `conduit cluster up|down|status|exec|run`: emulated clusters of network namespaces on one machine (cli/cluster.h).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli/cluster.h"
#include "cli/launcher.h"
#include "cli/registry.h"
#include "core/error.h"

namespace conduit::cli {
namespace {

namespace cl = conduit::cli::cluster;

struct ClusterOptions {
  std::string name = "default";
  int hosts = 0;
  bool hosts_given = false;  // run: --hosts was on the command line (0 and negatives are then errors)
  std::string bandwidth;
  std::string latency = "0";
  std::string loss = "0";
  cl::LinkGiven given;  // up: which of --bandwidth, --latency, --loss were on the command line (0 included)
  std::string hosts_file;
  bool all = false;
  bool json = false;
  bool quiet = false;
  std::string host;
  int master_port = 29500;
  int ranks_per_host = 1;  // run: workers a host (ranks K*R .. K*R+R-1 in host K)
  double timeout = 0;      // run: the whole job's deadline in seconds (0: none), as conduit launch's
  std::vector<std::string> command;
};

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error("cluster: cannot find the conduit binary (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

void require_root(const std::string& what) {
  if (geteuid() != 0) {
    throw ConfigError(fmt::format("cluster {}: needs root (network namespaces and tc); run it with sudo", what));
  }
}

std::string fmt_latency(double s) { return s <= 0 ? "0" : fmt::format("{:g}ms", s * 1e3); }
std::string fmt_loss(double p) { return p <= 0 ? "0" : fmt::format("{:g}%", p * 100); }

// The namespaces of cluster `name` that are there now.
std::set<std::string> present_namespaces(const std::string& name) {
  const auto names = cl::existing_namespaces(name);
  return {names.begin(), names.end()};
}

void print_state(const cl::ClusterState& s) {
  const auto present = present_namespaces(s.name);
  const auto has = [&](const std::string& ns) { return present.count(ns) > 0; };
  fmt::print("cluster {}: {} hosts, shaping {}, switch namespace {}{}\n", s.name, s.hosts.size(), s.shaping,
             s.switch_ns, has(s.switch_ns) ? "" : " (MISSING)");
  fmt::print("  {:<5} {:<24} {:<12} {:<10} {:<9} {:<7} {}\n", "host", "namespace", "address", "bandwidth", "latency",
             "loss", "state");
  for (size_t k = 0; k < s.hosts.size(); ++k) {
    const auto& h = s.hosts[k];
    fmt::print("  {:<5} {:<24} {:<12} {:<10} {:<9} {:<7} {}\n", k, h.ns, h.address, cl::format_rate(h.link.rate_bps),
               fmt_latency(h.link.latency_s), fmt_loss(h.link.loss), has(h.ns) ? "up" : "MISSING");
  }
}

void cmd_up(const ClusterOptions& o) {
  require_root("up");
  cl::validate_name(o.name);
  cl::LinkSpec base;
  if (!o.bandwidth.empty()) base.rate_bps = cl::parse_rate(o.bandwidth, "--bandwidth");
  base.latency_s = cl::parse_duration(o.latency, "--latency");
  base.loss = cl::parse_loss(o.loss, "--loss");
  std::vector<cl::LinkSpec> links;
  if (!o.hosts_file.empty()) {
    links = cl::load_hosts_file(o.hosts_file, o.hosts, base, o.given);
  } else {
    if (o.hosts == 0)
      throw ConfigError(
          fmt::format("cluster up: --hosts is required (1 to {}) unless --hosts-file lists them", cl::kMaxHosts));
    if (o.hosts < 1 || o.hosts > cl::kMaxHosts) {
      throw ConfigError(fmt::format("cluster up: --hosts must be between 1 and {}, got {}", cl::kMaxHosts, o.hosts));
    }
    if (o.bandwidth.empty()) {
      throw ConfigError("cluster up: --bandwidth is required (e.g. --bandwidth 1gbit) unless --hosts-file sets it");
    }
    links.assign(static_cast<size_t>(o.hosts), base);
  }
  const auto s = cl::up(o.name, links);
  if (!o.quiet) print_state(s);
}

void cmd_down(const ClusterOptions& o) {
  require_root("down");
  std::vector<std::string> names;
  if (o.all) {
    names = cl::list_clusters();
  } else {
    cl::validate_name(o.name);
    names = {o.name};
  }
  int skipped = 0;
  for (const auto& n : names) {
    if (o.all) {
      // A leftover whose name `up` would refuse (not made by conduit, or by an older one) must not stop the rest.
      try {
        cl::validate_name(n);
      } catch (const ConfigError& e) {
        fmt::print(stderr, "conduit cluster down: skipping '{}': {}\n", n, e.what());
        ++skipped;
        continue;
      }
    }
    struct stat st {};
    const bool known = !cl::existing_namespaces(n).empty() || stat(cl::state_path(n).c_str(), &st) == 0;
    int removed = 0;
    try {
      removed = cl::down(n);
    } catch (const Error& e) {
      if (!o.all) throw;
      // --all goes on with the other clusters and fails at the end.
      fmt::print(stderr, "conduit cluster down: {}: {}\n", n, e.what());
      ++skipped;
      continue;
    }
    if (!o.quiet)
      fmt::print("cluster {}: {}\n", n,
                 known ? fmt::format("removed {} namespaces", removed)
                       : std::string("no such cluster (no state file, no namespaces); nothing to remove"));
  }
  if (skipped > 0) set_exit_code(1);
}

void cmd_status(const ClusterOptions& o) {
  const auto names = cl::list_clusters();
  nlohmann::json out = nlohmann::json::array();
  if (names.empty() && !o.json) fmt::print("no clusters\n");
  for (const auto& n : names) {
    cl::ClusterState s;
    try {
      s = cl::load_state(n);
    } catch (const ConfigError&) {
      const auto left = cl::existing_namespaces(n);
      // No state file, or one that is there but cannot be read: say which.
      struct stat st {};
      const bool damaged = stat(cl::state_path(n).c_str(), &st) == 0;
      if (o.json) {
        out.push_back({{"name", n}, {"state", damaged ? "damaged" : "leftover"}, {"namespaces", left}});
      } else {
        fmt::print("cluster {}: {}; leftover namespaces: {}; run `conduit cluster down --name {}`\n", n,
                   damaged ? "state file damaged" : "no state file", fmt::join(left, " "), n);
      }
      continue;
    }
    if (o.json) {
      // (whether each namespace is there, as the table says: the JSON claimed a whole cluster where one was gone)
      const auto present = present_namespaces(s.name);
      const auto up = [&](const std::string& ns) { return present.count(ns) > 0; };
      nlohmann::json j = {
          {"name", s.name}, {"switch_ns", s.switch_ns}, {"switch_up", up(s.switch_ns)}, {"shaping", s.shaping}};
      j["hosts"] = nlohmann::json::array();
      for (const auto& h : s.hosts) {
        j["hosts"].push_back({{"ns", h.ns},
                              {"address", h.address},
                              {"ifname", cl::kHostIfname},
                              {"rate_bps", h.link.rate_bps},
                              {"latency_s", h.link.latency_s},
                              {"loss", h.link.loss},
                              {"up", up(h.ns)}});
      }
      out.push_back(j);
    } else {
      print_state(s);
    }
  }
  if (o.json) fmt::print("{}\n", out.dump());
}

// `cluster reap` (hidden): what is left in the first `hosts` hosts by the `cluster run` whose mark this is, stopped
// (run by that run's launcher watchdog when the run was killed with SIGKILL).
void cmd_reap(const ClusterOptions& o) {
  require_root("reap");
  if (o.host.empty()) throw ConfigError("cluster reap: --mark is required");
  const auto s = cl::load_state(o.name);
  const int hosts = o.hosts > 0 ? std::min<int>(o.hosts, static_cast<int>(s.hosts.size())) : int(s.hosts.size());
  cl::stop_marked_processes(s, hosts, "CONDUIT_CLUSTER_RUN=" + o.host);
}

void cmd_exec(const ClusterOptions& o) {
  require_root("exec");
  if (o.host.empty() || o.command.empty()) {
    throw ConfigError("cluster exec: usage: conduit cluster exec [--name NAME] HOST -- CMD [ARGS...]");
  }
  const auto s = cl::load_state(o.name);
  cl::exec_in_host(s, cl::resolve_host(s, o.host), o.command);
}

void cmd_run(const ClusterOptions& o) {
  require_root("run");
  if (o.command.empty())
    throw ConfigError("cluster run: usage: conduit cluster run [--name NAME] -- PROGRAM [ARGS...]");
  if (o.master_port < 1 || o.master_port > 65535) {
    throw ConfigError(fmt::format("cluster run: --master-port must be between 1 and 65535, got {}", o.master_port));
  }
  const auto s = cl::load_state(o.name);
  if (o.hosts_given && (o.hosts < 1 || o.hosts > static_cast<int>(s.hosts.size())))
    throw ConfigError(fmt::format("cluster run: --hosts {} is out of range; allowed 1..{} (the hosts of {})", o.hosts,
                                  s.hosts.size(), s.name));
  const int n = o.hosts > 0 ? o.hosts : static_cast<int>(s.hosts.size());
  if (n > static_cast<int>(s.hosts.size())) {
    throw ConfigError(fmt::format("cluster run: --hosts {} but cluster '{}' has {}", n, s.name, s.hosts.size()));
  }
  if (o.ranks_per_host < 1 || o.ranks_per_host > 64)
    throw ConfigError(fmt::format("cluster run: --ranks-per-host {} is out of range; allowed 1..64", o.ranks_per_host));
  if (n * o.ranks_per_host > kMaxLocalWorkers)
    throw ConfigError(fmt::format(
        "cluster run: {} hosts x --ranks-per-host {} = {} workers; allowed: at most {} (fewer --hosts or ranks a host)",
        n, o.ranks_per_host, n * o.ranks_per_host, kMaxLocalWorkers));
  LaunchSpec spec;
  spec.nprocs = n * o.ranks_per_host;
  spec.master_addr = s.hosts[0].address;
  spec.master_port = o.master_port;
  spec.name = "conduit cluster run";
  spec.timeout_seconds = o.timeout;
  // Each worker is `conduit cluster exec rank -- PROGRAM...`: it enters the namespace of host RANK and execs.
  spec.command = {self_exe(), "cluster", "exec", "--name", s.name, "rank", "--"};
  spec.command.insert(spec.command.end(), o.command.begin(), o.command.end());
  // The workers and every process they start carry this run's mark: what is left in the hosts once the workers are
  // gone (a daemon, a setsid child: out of the process groups the launcher stops) is stopped by it, and nothing of
  // another run or started by hand (`cluster exec`) is touched. Left, they held CPU and ports for the next run.
  const std::string mark =
      fmt::format("{}-{}", ::getpid(), std::chrono::steady_clock::now().time_since_epoch().count());
  // Killed with SIGKILL, this process cannot stop what its workers left in the hosts: its launcher's watchdog runs
  // `cluster reap` for it (they stayed until `cluster down`).
  spec.orphan_command = {self_exe(), "cluster", "reap", "--name", s.name, "--hosts", std::to_string(n), "--mark", mark};
  spec.extra_env = {{"CONDUIT_TRANSPORT", "tcp"},
                    {"CONDUIT_SOCKET_IFNAME", cl::kHostIfname},
                    {"CONDUIT_RANKS_PER_HOST", std::to_string(o.ranks_per_host)},
                    {"CONDUIT_CLUSTER_RUN", mark}};
  // (also when the launcher failed, and a cleanup that fails says so without hiding the workers' exit code)
  auto stop_leftovers = [&] {
    try {
      const int left = cl::stop_marked_processes(s, n, "CONDUIT_CLUSTER_RUN=" + mark);
      if (left > 0)
        std::fprintf(stderr,
                     "conduit cluster run: stopped %d process(es) the workers left running in the hosts of '%s' "
                     "(started by them outside their process groups)\n",
                     left, s.name.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "conduit cluster run: %s; `conduit cluster down --name %s` removes them\n", e.what(),
                   s.name.c_str());
    }
  };
  spec.after_workers = stop_leftovers;  // (covered by the watchdog's reap until it is done)
  spec.stop_escaped = false;            // (stop_leftovers does, by the mark, and names the hosts)
  int rc = 0;
  try {
    rc = run_local_workers(spec);
  } catch (...) {
    stop_leftovers();
    throw;
  }
  set_exit_code(rc);
}

const bool kRegistered = register_command(40, [](CLI::App& app) {
  auto* grp = app.add_subcommand(
      "cluster", "Emulated clusters on this machine: network namespaces joined by a bridge, links shaped with tc");
  grp->require_subcommand(1);
  grp->footer(
      "Example:\n  conduit cluster up --hosts 4 --bandwidth 1gbit\n  conduit cluster run -- conduit bench coll\n"
      "  conduit cluster down");

  auto add_name = [](CLI::App* c, const std::shared_ptr<ClusterOptions>& o) {
    c->add_option("--name", o->name, "cluster name (1-24 of a-z 0-9 _ -)")->capture_default_str();
  };

  auto up = std::make_shared<ClusterOptions>();
  auto* cu = grp->add_subcommand("up", "Create N hosts (namespaces conduit-NAME-hK, 10.213.0.K+1 on eth0)");
  add_name(cu, up);
  cu->add_option("--hosts", up->hosts, "number of hosts (1..250)");
  auto* up_bw =
      cu->add_option("--bandwidth", up->bandwidth, "each host's link rate, both directions (e.g. 100mbit, 1gbit)");
  auto* up_lat = cu->add_option("--latency", up->latency, "one-way host-to-host latency (needs netem; e.g. 5ms)")
                     ->capture_default_str();
  auto* up_loss = cu->add_option("--loss", up->loss, "packet loss on each host's egress (needs netem; e.g. 0.1%)")
                      ->capture_default_str();
  cu->add_option("--hosts-file", up->hosts_file, "YAML with per-host bandwidth/latency/loss (see docs/cluster.md)");
  cu->add_flag("-q,--quiet", up->quiet, "print nothing on success");
  auto* up_hosts = cu->get_option("--hosts");
  cu->callback([up, up_bw, up_lat, up_loss, up_hosts]() {
    // (with --hosts-file, 0 meant "the file's count" whether given or not: --hosts 0 was taken without a word)
    if (up_hosts->count() > 0 && up->hosts < 1)
      throw ConfigError(fmt::format("cluster up: --hosts must be between 1 and {}, got {}", cl::kMaxHosts, up->hosts));
    // Given or not by the command line, not by the value: an explicit --latency 0 or --loss 0 is a value too (it
    // was taken for "not given", and a hosts file's defaults then applied theirs without a word).
    up->given.bandwidth = up_bw->count() > 0 ? "--bandwidth" : "";
    up->given.latency = up_lat->count() > 0 ? "--latency" : "";
    up->given.loss = up_loss->count() > 0 ? "--loss" : "";
    cmd_up(*up);
  });

  auto dn = std::make_shared<ClusterOptions>();
  auto* cd = grp->add_subcommand("down", "Remove a cluster's namespaces, links and qdiscs (also after a failed up)");
  add_name(cd, dn);
  cd->add_flag("--all", dn->all, "remove every cluster (all namespaces named conduit-*-sw / conduit-*-hK)");
  cd->add_flag("-q,--quiet", dn->quiet, "print nothing on success");
  cd->callback([dn]() { cmd_down(*dn); });

  auto st = std::make_shared<ClusterOptions>();
  auto* cs = grp->add_subcommand("status", "List clusters, their hosts and links, and leftovers");
  cs->add_flag("--json", st->json, "one JSON array");
  cs->callback([st]() { cmd_status(*st); });

  auto ex = std::make_shared<ClusterOptions>();
  auto* ce = grp->add_subcommand("exec", "Run a command inside one host's namespace (CONDUIT_SOCKET_IFNAME=eth0)");
  add_name(ce, ex);
  ce->add_option("host", ex->host, "host: index, hK, its address, or 'rank' (RANK from the environment)");
  ce->add_option("command", ex->command,
                 "CMD [ARGS...]: every argument from the first one that is not an option (or after --) is its own");
  ce->callback([ex]() { cmd_exec(*ex); });

  auto rp = std::make_shared<ClusterOptions>();
  auto* cp = grp->add_subcommand("reap", "");  // (hidden: a killed `cluster run`'s watchdog runs it)
  cp->group("");
  add_name(cp, rp);
  cp->add_option("--hosts", rp->hosts, "the run's first N hosts");
  cp->add_option("--mark", rp->host, "the run's CONDUIT_CLUSTER_RUN mark");
  cp->callback([rp]() { cmd_reap(*rp); });

  auto rn = std::make_shared<ClusterOptions>();
  auto* cr = grp->add_subcommand(
      "run",
      "Start one worker per host (rank K in host K), or --ranks-per-host R (ranks K*R..K*R+R-1 in host K: their "
      "traffic to each other stays off the shaped link), over tcp with the rendezvous environment of `conduit "
      "launch`; MASTER_ADDR is host 0");
  add_name(cr, rn);
  auto* run_hosts = cr->add_option("--hosts", rn->hosts, "use the first N hosts (default: all)");
  cr->add_option("--master-port", rn->master_port, "rendezvous port on host 0")->capture_default_str();
  cr->add_option("--ranks-per-host", rn->ranks_per_host, "workers in each host (consecutive ranks)")
      ->capture_default_str();
  cr->add_option("--timeout", rn->timeout,
                 "seconds the whole job may run (0: no limit, the default); workers still running then are stopped "
                 "as on SIGTERM and it exits 124");
  cr->add_option("command", rn->command,
                 "PROGRAM [ARGS...]: every argument from the first one that is not an option (or after --) is its own");
  cr->footer("Example: conduit cluster run -- conduit bench coll --op allreduce -b 1M -e 64M --json");
  cr->callback([rn, run_hosts]() {
    rn->hosts_given = run_hosts->count() > 0;
    cmd_run(*rn);
  });
});

}  // namespace
}  // namespace conduit::cli
