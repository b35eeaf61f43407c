#pragma once
// Emulated clusters on one machine (`conduit cluster ...`): N Linux network namespaces ("hosts"), each with one
// interface eth0 whose veth peer sits on a bridge in a switch namespace of the cluster's own. The root namespace
// only gains the namespaces themselves: every link, bridge and qdisc lives inside them, so `down` (deleting the
// namespaces) removes all of it, and no host has a route out of its cluster.
//
//   namespace conduit-NAME-sw:  br0 (bridge, no address)  <- p0, p1, ... (veth ends toward the hosts)
//   namespace conduit-NAME-hK:  lo, eth0 = 10.213.0.(K+1)/24 (veth end), no default route
//
// Each host's link is shaped in both directions at its rate: tbf on the host's eth0 (host -> switch) and on the
// switch's pK (switch -> host), burst of three full frames or 1 ms of the rate, whichever is larger (above the MTU,
// so TCP never stalls; tbf segments a GSO super-packet larger than it), and where three frames are the larger (below
// 36 Mbit/s) a peak rate 1.1x the rate over a one-frame bucket, queue of 50 ms of the rate (at least 64 KiB:
// a super-packet's segments; a second of queue and more below 0.5 Mbit/s). Latency and
// loss need netem: when the kernel has it, each direction gets htb (rate) with a netem leaf (half the latency each
// way, the loss on the host's egress) whose limit is its delay line plus the same queue, in full frames
// (shape_commands); when it does not, asking for them fails with one line naming what is missing.
// State is kept in /run/conduit/cluster-NAME.json (CONDUIT_CLUSTER_STATE_DIR overrides); `down` also finds
// namespaces of the cluster by their names, so it cleans up after an interrupted `up`.
#include <string>
#include <vector>

namespace conduit::cli::cluster {

inline constexpr int kMaxHosts = 250;
inline constexpr const char* kNsPrefix = "conduit-";
inline constexpr const char* kHostIfname = "eth0";
inline constexpr const char* kSubnetPrefix = "10.213.0.";  // host K is kSubnetPrefix + (K + 1), /24

// One host's link to the switch. rate_bps 0 = unshaped.
struct LinkSpec {
  double rate_bps = 0;
  double latency_s = 0;  // one-way host-to-host latency this link contributes (half on each direction)
  double loss = 0;       // probability in [0, 1) that a packet leaving the host is dropped
};

struct HostInfo {
  std::string ns;       // network namespace name
  std::string address;  // IPv4 address of eth0
  LinkSpec link;
};

struct ClusterState {
  std::string name;
  std::string switch_ns;
  std::string shaping;  // "tbf" or "htb+netem"
  std::vector<HostInfo> hosts;
  std::string owner;  // "sweep": made by conduit sweep, which removes it once that sweep's pid is gone; else ""
  // With an owner: the process that made it and that process's start time (process_start_time; 0: not read), so
  // that a pid reused by an unrelated process does not keep the cluster alive.
  long owner_pid = 0;
  unsigned long long owner_start = 0;
  // The owner's pid namespace (the inode of /proc/self/ns/pid; 0: not recorded): its pid means something only to a
  // process of the same namespace (containers sharing /run see each other's clusters).
  unsigned long long owner_pidns = 0;
};

// When process `pid` started (clock ticks after boot, /proc/PID/stat's 22nd field); 0 when that cannot be read (the
// process is gone, or /proc hides it).
unsigned long long process_start_time(long pid);
// The inode of this process's pid namespace (/proc/self/ns/pid); 0 when it cannot be read.
unsigned long long own_pid_namespace();

// "100mbit", "1gbit", "1Gbit/s", "500kbit", "2.5G", "1000000" (bit/s) -> bit/s. Throws ConfigError naming `field`.
double parse_rate(const std::string& text, const std::string& field);
// "0", "5ms", "100us", "0.2s" -> seconds.
double parse_duration(const std::string& text, const std::string& field);
// "1%", "0.5%", "0.01" -> probability in [0, 1).
double parse_loss(const std::string& text, const std::string& field);
// Cluster names: 1-24 characters of [a-z0-9_] and '-' inside; throws ConfigError otherwise.
void validate_name(const std::string& name);

// Which values of a `base` LinkSpec were given (by a flag, or a sweep network's key), an explicit 0 included, each
// by the name an error calls it ("--latency", "sweep: networks[0].latency"); empty: not given. (A value's being 0
// said "not given": an explicit --latency 0 beside a file's defaults.latency was dropped for the file's.)
struct LinkGiven {
  std::string bandwidth, latency, loss;
};

// Per-host links from a YAML file:
//   defaults: {bandwidth: 1gbit, latency: 0ms, loss: 0%}     # optional, over `base`
//   hosts:                                                    # one entry per host, in order
//     - {bandwidth: 100mbit}
//     - {bandwidth: 1gbit, latency: 2ms}
// `hosts` (> 0) must equal the number of entries when the file lists any; with no `hosts` list, `hosts` copies
// of the defaults. Unknown keys are ConfigErrors, and so is a value `given` names that the file's defaults also set
// (which one applies would be a guess), or that every host listed sets (it would apply to none).
std::vector<LinkSpec> load_hosts_file(const std::string& path, int hosts, const LinkSpec& base, const LinkGiven& given);

bool kernel_has_netem();

std::string state_dir();
std::string host_ns(const std::string& name, int index);
std::string switch_ns(const std::string& name);

// Creates the cluster; on any failure removes what it made and rethrows. Throws ConfigError when a cluster of that
// name exists (or left namespaces behind: run down first) and UnsupportedError when latency/loss need netem.
// *claimed (when given) says whether this call claimed the name (created its state file): only then is what is
// left under the name after a failure this call's; a cluster it found there is someone else's and not to be removed.
// With an owner, the calling process's pid and start time are recorded as owner_pid and owner_start.
ClusterState up(const std::string& name, const std::vector<LinkSpec>& links, const std::string& owner = "",
                bool* claimed = nullptr);
// Removes the cluster's namespaces (stopping processes still inside them) and state file. Returns the number of
// namespaces removed; 0 when there was nothing.
int down(const std::string& name);
// Stops every process left inside the cluster's namespaces (SIGTERM, then SIGKILL); throws Error naming the ones
// still there after a few seconds.
void stop_processes(const std::string& name);
// Stops the processes in the first `hosts` hosts of the cluster whose environment holds `marked` (KEY=VALUE: what a
// run gave its workers, which their children inherit), as stop_processes; returns how many there were.
int stop_marked_processes(const ClusterState& s, int hosts, const std::string& marked);
// Names of clusters with a state file or namespaces.
std::vector<std::string> list_clusters();
// The recorded state; throws ConfigError when there is no such cluster.
ClusterState load_state(const std::string& name);
// The namespaces named like this cluster's that exist now.
std::vector<std::string> existing_namespaces(const std::string& name);

// Host index from "3", "h3" or "10.213.0.4"; "rank" reads RANK from the environment. Throws ConfigError.
int resolve_host(const ClusterState& state, const std::string& host);
// Enters the host's namespace, sets CONDUIT_SOCKET_IFNAME=eth0 and CONDUIT_CLUSTER_HOST, and execs the command
// (PATH lookup). Returns only on failure (throws Error).
[[noreturn]] void exec_in_host(const ClusterState& state, int index, const std::vector<std::string>& command);

// The tc commands (argv each, in order) that shape egress of `dev` in namespace `ns`: tbf at rate_bps alone; with a
// delay or loss, htb at the rate with a netem leaf whose limit (packets) is its delay line plus the tbf path's queue
// in full frames, so that both paths queue alike; netem alone when unshaped (rate_bps 0); none for neither.
std::vector<std::vector<std::string>> shape_commands(const std::string& ns, const std::string& dev, double rate_bps,
                                                     double delay_s, double loss);
// The line of a failed tool's output that says why: the first starting with "Error", else the first that is not a
// "Warning" (tc prints "Warning: sch_htb: quantum of class ... is big" first), else the first; trimmed.
std::string tool_error_line(const std::string& output);

// Runs a program (argv[0] looked up in PATH) and returns its exit status; output captured into *out when given.
int run_program(const std::vector<std::string>& argv, std::string* out = nullptr);

std::string format_rate(double bps);

// Where the state of cluster `name` is kept (CONDUIT_CLUSTER_STATE_DIR or /run/conduit).
std::string state_path(const std::string& name);

}  // namespace conduit::cli::cluster
