#include "net/bootstrap.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "net/mpi_transport.h"
#include "net/routed.h"
#include "net/shm.h"
#include "net/tcp_store.h"

namespace conduit::net {
namespace {

// CONDUIT_JOB_ID names store keys and shared-memory segments (/dev/shm/conduit-<job>-<rank>): letters, digits,
// '.', '_' and '-' only ("team/a" made the segment name a path and failed with a misleading hint).
std::optional<std::string> job_id_from_env() {
  auto v = env_string("CONDUIT_JOB_ID");
  if (!v) return v;
  const bool ok = !v->empty() && v->size() <= 200 && std::all_of(v->begin(), v->end(), [](unsigned char c) {
    return std::isalnum(c) || c == '.' || c == '_' || c == '-';
  });
  if (!ok)
    throw ConfigError(
        fmt::format("environment variable CONDUIT_JOB_ID='{}' is invalid: expected 1 to 200 letters, "
                    "digits, '.', '_' or '-'",
                    *v));
  return v;
}

// The file store's key prefix: CONDUIT_JOB_ID, else the launcher's id of this run, so that two jobs sharing one
// CONDUIT_STORE_PATH do not mix their ranks (found by an audit: both met under "job"): TORCHELASTIC_RUN_ID (unless
// "none", torchrun's default), else SLURM_JOB_ID with SLURM_STEP_ID, else "job". Characters a job id may not hold
// become '_'.
std::string file_store_job_prefix() {
  if (auto id = job_id_from_env()) return *id;
  auto clean = [](std::string v) {
    for (char& ch : v)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_' && ch != '-') ch = '_';
    return v.substr(0, 200);
  };
  // (not TORCHELASTIC_RESTART_COUNT: each node's agent counts its own workers' failures, so after another node's
  // failure or a scaling event the ranks of one attempt hold different counts and split into two jobs)
  const auto run = env_string("TORCHELASTIC_RUN_ID");
  if (run && !run->empty() && *run != "none") return clean(fmt::format("torchelastic-{}", *run));
  const auto slurm = env_string("SLURM_JOB_ID");
  if (slurm && !slurm->empty())
    return clean(fmt::format("slurm-{}-{}", *slurm, env_string("SLURM_STEP_ID").value_or("0")));
  return "job";
}

// The key under which a rank of a file-store job publishes why it failed (stop_serving): the other ranks' waiting
// gets end with it.
std::string file_store_failure_key() { return fmt::format("conduit/{}/error", file_store_job_prefix()); }

std::string host_identity() {
  if (auto id = env_string("CONDUIT_HOST_ID")) return *id;
  char name[256] = {0};
  ::gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  // Shared memory between two ranks needs the same /dev/shm and the same process ids (its liveness checks open the
  // peer's pid): containers of one machine with host networking but a PID namespace or a /dev/shm of their own are
  // other hosts to it (one was told its live peer had died; one could not open the peer's segment).
  char pidns[64] = {0};
  if (::readlink("/proc/self/ns/pid", pidns, sizeof pidns - 1) < 0) pidns[0] = '\0';
  struct stat shm {};
  const unsigned long long shm_dev = ::stat("/dev/shm", &shm) == 0 ? static_cast<unsigned long long>(shm.st_dev) : 0;
  return fmt::format("{}/{}/{}/{}", name, boot, pidns, shm_dev);
}

int required_int(const char* var, long long lo, long long hi) {
  auto v = env_int(var, lo, hi);
  if (!v) throw ConfigError(fmt::format("environment variable {} must be set (an integer in [{}, {}])", var, lo, hi));
  return static_cast<int>(*v);
}

void fill_hosts(Bootstrap& b) {
  auto ids = b.allgather(host_identity());
  std::map<std::string, int> index;
  b.hosts.resize(b.size);
  for (int r = 0; r < b.size; ++r) {
    auto it = index.find(ids[r]);
    if (it == index.end()) it = index.emplace(ids[r], static_cast<int>(index.size())).first;
    b.hosts[r] = it->second;
  }
  b.local_size = 0;
  b.local_rank = 0;
  for (int r = 0; r < b.size; ++r) {
    if (b.hosts[r] != b.hosts[b.rank]) continue;
    if (r < b.rank) ++b.local_rank;
    ++b.local_size;
  }
}

std::string new_job_id() {
  auto t = std::chrono::system_clock::now().time_since_epoch().count();
  return fmt::format("{:x}{:x}", static_cast<unsigned long>(::getpid()), static_cast<unsigned long long>(t) & 0xffffffffffull);
}

// Rank r's value in the first bootstrap exchange, "<job id>\x1f<1 when CONDUIT_JOB_ID gave it>\x1f<WORLD_SIZE>":
// ConfigError naming both sizes when its WORLD_SIZE is not this rank's (every rank takes rank 0's job id, so segment
// names agree; the sizes go with it), or both ids when both were given and differ: ranks of two jobs on one
// MASTER_PORT (two launches given one --master-port: a rank of one joined the other's store and the two ran as one
// job). `my_job`: this rank's CONDUIT_JOB_ID, empty when unset (a rank without one takes rank 0's). `store_path`: the
// file store's directory (empty for the TCP store), whose values may be an earlier run's.
void check_first_value(int rank, int size, const std::string& my_job, int r, const std::string& v,
                       const std::string& store_path) {
  const std::string theirs = v.substr(v.rfind('\x1f') + 1);
  const size_t first = v.find('\x1f');
  const std::string their_job = v.substr(0, first);
  const bool their_given = first != std::string::npos && v.compare(first + 1, 2, "1\x1f") == 0;
  const bool other_job = !my_job.empty() && their_given && their_job != my_job;
  if (theirs == std::to_string(size) && !other_job) return;
  // (Rank 0 serving the TCP store keeps it 5 s before it goes, its error published (stop_serving): a rank still
  // reading lost the connection instead of learning why; stopping at the first mismatch, it may not have met every
  // rank yet, and a rank coming later retried the refused connection until its deadline.)
  if (other_job)
    throw ConfigError(fmt::format(
        "rank {}: CONDUIT_JOB_ID is '{}' here but '{}' on rank {}: ranks of two jobs met at one store (another job on "
        "this MASTER_PORT?) or were given different ids; allowed: one CONDUIT_JOB_ID on every rank of a job (or none), "
        "and a MASTER_PORT of each job's own",
        rank, my_job, their_job, r));
  // (a file store outlives its run: a smaller earlier run's rank 0 left its value where this run's looks, found by an
  // audit: the message blamed this run's WORLD_SIZE)
  const std::string stale = store_path.empty()
                                ? std::string()
                                : fmt::format(
                                      " (rank {}'s value may be an earlier run's left in CONDUIT_STORE_PATH={}: empty "
                                      "it, or give each run its own CONDUIT_JOB_ID)",
                                      r, store_path);
  throw ConfigError(
      fmt::format("rank {}: WORLD_SIZE is {} here but {} on rank {}; allowed: the same WORLD_SIZE on every rank{}",
                  rank, size, theirs, r, stale));
}

}  // namespace

const char* transport_kinds_allowed() { return "auto, tcp, shm, mpi"; }

// Rank 0 serving the TCP store failed with `what` after its store started (its bootstrap or its transport's
// start-up): the others were told only that the connection was lost ("did rank 0 exit?", found by an audit). Its error
// goes under kTcpStoreErrorKey, which ends their waiting gets with it, and the store is kept a few seconds for the
// ranks still to ask (a detached thread keeping it did not outlive the process, which exits on this error).
static void stop_serving(const Bootstrap& b, const char* what) {
  if (!b.store || b.size < 2) return;  // (no one else to tell)
  if (b.method == "file-store") {
    // A rank's failure, kept in the directory: the others' gets end with it, later ones too (they waited for this
    // rank's values until their deadline and then named it missing, found by an audit). Only a rank of the job
    // (`met`), and the first failure only: the ranks it stops fail in turn, and each wrote its own "rank R failed:
    // rank Q failed: ..." over the cause (found by a review).
    if (!b.met->load()) return;
    try {
      const std::string key = file_store_failure_key();
      if (!b.store->check(key, Deadline::after(2)))
        b.store->set(key, fmt::format("rank {} failed: {}", b.rank, std::string(what).substr(0, kStoredFailureBytes)),
                     Deadline::after(2));
    } catch (const Error&) {  // (the error about to be thrown is what counts)
    }
    return;
  }
  if (b.rank != 0 || b.method != "tcp-store") return;
  try {
    b.store->set(kTcpStoreErrorKey, std::string(what).substr(0, kStoredFailureBytes), Deadline::after(2));
  } catch (const Error&) {  // (the store itself failed: the error about to be thrown is what counts)
    return;
  }
  // (said now: a launcher that sees the others exit stops this rank within the wait, before its own line)
  CONDUIT_LOG_ERROR("rank 0: {} (the store stays 5 s for the other ranks to read it)", what);
  std::this_thread::sleep_for(std::chrono::seconds(5));
}

static std::shared_ptr<Bootstrap> bootstrap_from_env_unguarded(double timeout_s, std::shared_ptr<Bootstrap>& b) {
  b = std::make_shared<Bootstrap>();
  Deadline deadline = Deadline::after(timeout_s);
  if (mpi_launched()) {
    mpi_init_once(timeout_s);
    b->method = "mpi";
    b->size = mpi_world_size();  // (first: a launcher's size that is not MPI's explains a rank that is not either)
    b->rank = mpi_world_rank();
    // RANK and WORLD_SIZE beside MPI's own (a launcher's variables inherited, or set by hand) must say the same: the
    // ranks would otherwise form another job than the one meant, silently.
    // (read as the RANK path reads them: RANK=00 is 0)
    for (const auto& [var, mpi] : {std::pair{"RANK", b->rank}, std::pair{"WORLD_SIZE", b->size}}) {
      const auto given = env_int(var, 0, 1 << 20);
      if (given && *given != mpi)
        throw ConfigError(fmt::format(
            "{}={} but mpirun made this process rank {} of {}: two launchers' variables meet here; allowed: "
            "{} unset (or equal to MPI's) under mpirun, or OMPI_COMM_WORLD_RANK, PMIX_RANK and PMI_RANK unset to meet "
            "by RANK and WORLD_SIZE (torchrun's workers, which TORCHELASTIC_RUN_ID marks, do)",
            var, *env_string(var), b->rank, b->size, var));
    }
    b->allgather = [timeout_s](const std::string& mine) {
      return mpi_allgather_strings(mine, Deadline::after(timeout_s));
    };
  } else if (env_string("RANK") || env_string("WORLD_SIZE")) {
    b->size = required_int("WORLD_SIZE", 1, 1 << 20);
    b->rank = required_int("RANK", 0, b->size - 1);
    auto addr = env_string("MASTER_ADDR");
    auto path = env_string("CONDUIT_STORE_PATH");
    // torchrun's c10d rendezvous serves its own store at MASTER_ADDR:MASTER_PORT and tells the workers to use it
    // (TORCHELASTIC_USE_AGENT_STORE): rank 0 could not listen there, and the message blamed another job. A file
    // store given then takes the place of the TCP one.
    const auto agent = env_string("TORCHELASTIC_USE_AGENT_STORE");
    const bool agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
    if (addr && agent_store && !path)
      throw ConfigError(
          "torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), which "
          "Conduit does not speak; allowed: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torchrun then leaves the port to "
          "rank 0), or CONDUIT_STORE_PATH on a directory every rank sees");
    if (addr && !(agent_store && path)) {
      // A port inside the address (host:port) never resolves: the ranks other than 0 retried it until the deadline.
      // (An IPv6 address has colons of its own: bracketed or not, it parses as one.)
      std::string bare = *addr;
      if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') bare = bare.substr(1, bare.size() - 2);
      if (const size_t zone = bare.find('%'); zone != std::string::npos) bare.resize(zone);  // fe80::1%eth0
      in6_addr v6{};
      if (bare.find(':') != std::string::npos && inet_pton(AF_INET6, bare.c_str(), &v6) != 1)
        throw ConfigError(
            fmt::format("MASTER_ADDR='{}' holds a port or is not an address; allowed: a host name or "
                        "an IPv4/IPv6 address, with the port in MASTER_PORT",
                        *addr));
      // (a wildcard was taken as loopback on every rank: ranks on other hosts dialled their own)
      if (is_any_address(*addr)) throw ConfigError(any_address_refusal(fmt::format("MASTER_ADDR='{}'", *addr)));
      int port = required_int("MASTER_PORT", 1, 65535);
      if (path && b->rank == 0)  // (taken silently: the user may have meant the file store)
        CONDUIT_LOG_WARN(
            "bootstrap: CONDUIT_STORE_PATH={} is not used: MASTER_ADDR/MASTER_PORT are set and the ranks meet at the "
            "TCP store there (the file store is taken with them only under torchrun's agent store); unset one of them",
            *path);
      b->method = "tcp-store";
      b->store = make_tcp_store(*addr, port, b->rank == 0, deadline);
    } else if (path) {
      b->method = "file-store";
      b->store = make_file_store(*path, file_store_failure_key());
    } else {
      throw ConfigError(
          "RANK and WORLD_SIZE are set but neither MASTER_ADDR/MASTER_PORT (TCP store) nor CONDUIT_STORE_PATH (file "
          "store) says where to meet the other ranks");
    }
    auto counter = std::make_shared<std::atomic<int>>(0);
    // A TCP store is the job's own (its rank 0 serves it): its keys leave the job id out, so ranks given different
    // CONDUIT_JOB_IDs meet and take rank 0's (each waited under its own id until its deadline, then blamed a rank
    // that had published). A file store's directory may be shared by jobs: the id keeps them apart.
    const std::string job_prefix = b->method == "tcp-store" ? std::string("job") : file_store_job_prefix();
    // A file store outlives its job: a rank that finds its own first value already there is in a directory an
    // earlier run of this job id used, and would read that run's addresses (it timed out connecting to old ports).
    if (b->method == "file-store" && b->store->check(fmt::format("conduit/{}/bootstrap/0/{}", job_prefix, b->rank)))
      throw ConfigError(fmt::format(
          "CONDUIT_STORE_PATH={} already holds rank {}'s values of job '{}' (from an earlier run, from another "
          "process given this RANK, or another job using this directory now); allowed: one process a rank, and an "
          "empty directory or a CONDUIT_JOB_ID unique to each run",
          *path, b->rank, job_prefix));
    // One process a rank: the first to claim it is counted 1. A second (RANK set alike twice, or ranks of another
    // job whose rank 0 could not listen on this MASTER_PORT) is refused here, before it publishes an address the
    // job's ranks would read and connect to (it overwrote the first one's).
    // (The file store too: a second process of one rank was told the directory held an earlier run's values.)
    {
      const bool first =
          b->store->claim(fmt::format("conduit/{}/claimed/{}", job_prefix, b->rank), Deadline::after(timeout_s));
      if (!first && b->method == "tcp-store")
        throw ConfigError(fmt::format(
            "rank {}: another process already joined the store at MASTER_ADDR={}:{} as rank {} (RANK given twice, a "
            "rank restarted during the rendezvous, or another job on this MASTER_PORT); allowed: one process a rank, "
            "and a MASTER_PORT of each job's own",
            b->rank, *addr, env_string("MASTER_PORT").value_or("?"), b->rank));
      if (!first)
        throw ConfigError(fmt::format(
            "rank {}: another process already joined CONDUIT_STORE_PATH={} as rank {} of job '{}' (RANK given "
            "twice, a rank restarted during the rendezvous, an earlier attempt of this job id that stopped early, or "
            "another job with this CONDUIT_JOB_ID); allowed: one process a rank, and an empty directory or a "
            "CONDUIT_JOB_ID of each job's own",
            b->rank, *path, b->rank, job_prefix));
    }
    StorePtr store = b->store;
    int rank = b->rank, size = b->size;
    const bool serves = b->method == "tcp-store";
    const std::string store_path = b->method == "file-store" ? *path : std::string();
    auto met = b->met;
    b->allgather = [store, counter, rank, size, job_prefix, timeout_s, serves, store_path,
                    met](const std::string& mine) {
      const int n = counter->fetch_add(1);
      std::string prefix = fmt::format("conduit/{}/bootstrap/{}", job_prefix, n);
      // The first exchange carries each rank's WORLD_SIZE: checked as each value comes (rank 0's first), so a rank
      // of a larger job stops at once rather than waiting out its deadline for ranks that will never come.
      std::function<void(int, const std::string&)> check;
      const std::string my_job = job_id_from_env().value_or("");
      if (n == 0) check = [&](int r, const std::string& v) { check_first_value(rank, size, my_job, r, v, store_path); };
      // (A rank beyond this world, of a larger job, is stopped by its own check as it reads rank 0's value; this job's
      // ranks do not look for it: one that saw it and one that had looked before would stop apart, the other
      // waiting for its peer until its deadline.)
      try {
        auto all = store_allgather(*store, prefix, rank, size, mine, Deadline::after(timeout_s), check);
        if (serves) store->add(prefix + "/read", 1, Deadline::after(timeout_s));  // (wait_readers counts them)
        met->store(true);
        return all;
      } catch (const TimeoutError& e) {
        if (serves) throw;
        // (a rank of this job given another CONDUIT_JOB_ID publishes under it: this one cannot tell it from a rank
        // that never came)
        throw TimeoutError(
            fmt::format("{} (looked for under {}: every rank of a job needs the same "
                        "CONDUIT_JOB_ID, or none)",
                        e.what(),
                        job_id_from_env() ? fmt::format("CONDUIT_JOB_ID '{}'", job_prefix)
                                          : fmt::format("no CONDUIT_JOB_ID (the keys of '{}')", job_prefix)));
      }
    };
    if (serves && rank == 0)
      b->wait_readers = [store, counter, size, job_prefix](double seconds) {
        const std::string key = fmt::format("conduit/{}/bootstrap/{}/read", job_prefix, counter->load() - 1);
        const Deadline due = Deadline::after(seconds);
        try {
          while (store->add(key, 0, due) < size && !due.expired())
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        } catch (const Error&) {  // (the error about to be thrown is what counts)
        }
      };
  } else {
    b->method = "single";
    b->allgather = [](const std::string& mine) { return std::vector<std::string>{mine}; };
  }
  // Every rank takes rank 0's job id (CONDUIT_JOB_ID when set), so segment names agree; the world sizes go with it
  // (WORLD_SIZE set otherwise on some rank: a rank of a larger job passed the bootstrap and was refused only by the
  // tcp rendezvous, one of a smaller job ran on as a job of its own).
  const auto given_job = job_id_from_env();
  const std::string job = given_job.value_or(new_job_id());
  const std::vector<std::string> first =
      b->allgather(job + "\x1f" + (given_job ? "1" : "0") + "\x1f" + std::to_string(b->size));
  b->job = first[0].substr(0, first[0].find('\x1f'));
  fill_hosts(*b);
  set_log_rank(b->rank);
  CONDUIT_LOG_INFO("bootstrap: rank {} of {} via {}, {} host(s)", b->rank, b->size, b->method,
                   b->hosts.empty() ? 1 : *std::max_element(b->hosts.begin(), b->hosts.end()) + 1);
  return b;
}

std::shared_ptr<Bootstrap> bootstrap_from_env(double timeout_s) {
  std::shared_ptr<Bootstrap> b;
  try {
    return bootstrap_from_env_unguarded(timeout_s, b);
  } catch (const std::exception& e) {
    if (b) stop_serving(*b, e.what());
    throw;
  }
}

static TransportPtr make_transport_unguarded(const Bootstrap& b, const std::string& kind, double timeout_s) {
  Deadline deadline = Deadline::after(timeout_s);
  // Every rank must ask for the same transport (each reads CONDUIT_TRANSPORT or its flag on its own): mixed, the
  // ranks failed with misleading errors about shm segments or store addresses, or hung in MPI. Exchanged before it
  // is checked, so a name one rank got wrong stops every rank with this line instead of leaving them waiting.
  // The settings the ranks must share go with it: the shm segments' layout, the fast allreduce's limit, the ring's
  // segments, the algorithms chosen and debug mode's extra exchanges. Mixed, ranks crashed (SIGBUS on a peer's
  // smaller segment) or waited to the deadline in different algorithms.
  // (and the largest message a rank takes: a rank with a smaller one refused a peer's message hours into a run)
  static constexpr const char* kShared[] = {
      "CONDUIT_SHM_RING_BYTES", "CONDUIT_SHM_FAST_BYTES", "CONDUIT_RING_SEGMENT_BYTES", "CONDUIT_MAX_MESSAGE_BYTES",
      "CONDUIT_ALLREDUCE",      "CONDUIT_REDUCE_SCATTER", "CONDUIT_ALLGATHER",          "CONDUIT_BROADCAST",
      "CONDUIT_REDUCE",         "CONDUIT_COST_MODEL",     "CONDUIT_DEBUG_COLLECTIVES"};
  constexpr size_t kShmOnly = 2;  // the first two only matter between ranks of one host (they share segments)
  // Compared as the ranks read them: sizes as bytes (2M is 2097152), the debug flag as on or off; what does not
  // parse is compared as written (the rank that reads it stops with its own error).
  auto normalized = [](size_t i, const char* value) -> std::string {
    const std::string v = value;
    try {
      if (i < 4) return std::to_string(parse_bytes(v, kShared[i]));
      if (i + 1 == std::size(kShared)) return env_flag(kShared[i]) ? "on" : "off";
    } catch (const ConfigError&) {
    }
    return v;
  };
  std::string mine = kind;
  for (size_t i = 0; i < std::size(kShared); ++i) {
    const char* val = std::getenv(kShared[i]);
    if (val && *val == '\0') val = nullptr;              // empty is unset, as the readers take it
    if (!val && i + 1 == std::size(kShared)) val = "0";  // the debug flag unset is off, as 0 is
    if (!val && i == 3) val = "16G";                     // the message limit unset is its default
    // (so are the rings' sizes: a rank given the documented default met one without it as a mismatch; the fast
    // path's limit, the cost model and the algorithm rules unset mean "automatic", which no value given is)
    const std::string shm_default = std::to_string(kDefaultShmRingBytes);
    const std::string segment_default = std::to_string(kDefaultRingSegmentBytes);
    if (!val && i == 0) val = shm_default.c_str();
    if (!val && i == 2) val = segment_default.c_str();
    mine += '\x1f';
    if (val) mine += "=" + normalized(i, val);  // "=" marks a set value
  }
  const std::vector<std::string> all = b.allgather(mine);
  // (an error here on rank 0 waits for the others to have read the exchange: each then finds it too)
  try {
    std::vector<std::vector<std::string>> f(all.size());
    for (size_t r = 0; r < all.size(); ++r) f[r] = split(all[r], '\x1f');
    for (int r = 0; r < static_cast<int>(all.size()); ++r) {
      if (f[r][0] != f[0][0])
        throw ConfigError(
            fmt::format("transport: rank 0 asks for '{}' but rank {} for '{}' (CONDUIT_TRANSPORT or "
                        "--transport); allowed: the same transport on every rank",
                        f[0][0], r, f[r][0]));
      for (size_t i = 0; i < std::size(kShared); ++i) {
        // Against rank 0, or for the shared-memory settings the first rank on this rank's host.
        int ref = 0;
        if (i < kShmOnly && !b.hosts.empty())
          while (b.hosts[static_cast<size_t>(ref)] != b.hosts[static_cast<size_t>(r)]) ++ref;
        const auto at = [&](int q) { return i + 1 < f[q].size() ? f[q][i + 1] : std::string(); };
        if (at(ref) == at(r)) continue;
        auto show = [](const std::string& x) { return x.empty() ? std::string("unset") : "'" + x.substr(1) + "'"; };
        throw ConfigError(fmt::format("{} is {} on rank {} but {} on rank {}; allowed: the same value on every rank{}",
                                      kShared[i], show(at(ref)), ref, show(at(r)), r,
                                      i < kShmOnly ? " of a host" : ""));
      }
    }
    if (kind == "mpi" && b.method != "mpi")
      throw ConfigError(
          "transport 'mpi' needs the program to be started by mpirun (none of OMPI_COMM_WORLD_RANK, PMIX_RANK and "
          "PMI_RANK is set, or TORCHELASTIC_RUN_ID marks a torchrun worker)");
    if (kind != "mpi" && kind != "auto" && kind != "tcp" && kind != "shm")
      throw ConfigError(fmt::format("unknown transport '{}': allowed are {}", kind, transport_kinds_allowed()));
  } catch (...) {
    if (b.wait_readers) b.wait_readers(5.0);
    throw;
  }
  if (kind == "mpi") return make_mpi_transport(b.hosts, deadline);
  std::vector<char> local(b.size, 0), remote(b.size, 0);
  bool any_remote = false;
  for (int r = 0; r < b.size; ++r) {
    if (r == b.rank) continue;
    if (b.hosts[r] == b.hosts[b.rank]) local[r] = 1;
    else {
      remote[r] = 1;
      any_remote = true;
    }
  }
  if (kind == "shm" && any_remote)
    throw ConfigError(
        "transport 'shm' needs every rank on one host (one machine's boot, PID namespace and /dev/shm), but the ranks "
        "span several hosts; use auto or tcp");
  if (kind == "tcp" || b.size == 1) {
    return make_tcp_transport(b.rank, b.size, b.hosts, b.allgather, deadline);
  }
  if (kind == "shm" || !any_remote) {
    return make_shm_transport(b.rank, b.size, b.hosts, b.job, b.allgather);
  }
  // auto across hosts: shm to the local peers, tcp to the rest.
  auto shm = make_shm_transport(b.rank, b.size, b.hosts, b.job, b.allgather, local);
  auto tcp = make_tcp_transport(b.rank, b.size, b.hosts, b.allgather, deadline, remote);
  std::vector<TransportPtr> route(b.size);
  for (int r = 0; r < b.size; ++r) route[r] = local[r] ? shm : (remote[r] ? tcp : nullptr);
  return make_routed_transport(b.rank, b.size, b.hosts, route, "shm+tcp");
}

TransportPtr make_transport(const Bootstrap& b, const std::string& kind, double timeout_s) {
  try {
    return make_transport_unguarded(b, kind, timeout_s);
  } catch (const std::exception& e) {
    stop_serving(b, e.what());
    throw;
  }
}

bool is_any_address(const std::string& addr) {
  std::string bare = addr;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') bare = bare.substr(1, bare.size() - 2);
  if (const size_t zone = bare.find('%'); zone != std::string::npos) bare.resize(zone);
  // (inet_aton reads the forms the resolver takes, "0" and "0x0" among them; ::ffff:0.0.0.0 is the IPv4 one mapped)
  in_addr v4{};
  in6_addr v6{};
  const bool v6_any =
      inet_pton(AF_INET6, bare.c_str(), &v6) == 1 &&
      (IN6_IS_ADDR_UNSPECIFIED(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 0 && v6.s6_addr[13] == 0 &&
                                        v6.s6_addr[14] == 0 && v6.s6_addr[15] == 0));
  return (inet_aton(bare.c_str(), &v4) != 0 && v4.s_addr == INADDR_ANY) || v6_any;
}

std::string any_address_refusal(const std::string& given) {
  return fmt::format(
      "{} is the any-address, which names no host to meet at; allowed: rank 0's host name or an address of it the "
      "other ranks reach (127.0.0.1 on one host)",
      given);
}

}  // namespace conduit::net
