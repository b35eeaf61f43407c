#include "sim/scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "sim/plan.h"

namespace conduit::sim {

Policy parse_policy(const std::string& s) {
  if (s == "fifo") return Policy::kFifo;
  if (s == "las") return Policy::kLas;
  if (s == "srtf") return Policy::kSrtf;
  throw ConfigError(fmt::format("--scheduler = '{}' (allowed: fifo, las, srtf)", s));
}

Placement parse_placement(const std::string& s) {
  if (s == "topology") return Placement::kTopology;
  if (s == "spread") return Placement::kSpread;
  throw ConfigError(fmt::format("--placement = '{}' (allowed: topology, spread)", s));
}

void validate(const SchedulerOptions& opt) {
  if (!(std::isfinite(opt.las_first_threshold) && opt.las_first_threshold > 0))
    throw ConfigError(
        fmt::format("--las-threshold = {} (allowed: accelerator-seconds above 0)", opt.las_first_threshold));
  if (opt.las_queues < 1 || opt.las_queues > kMaxLasQueues)
    throw ConfigError(fmt::format("--las-queues = {} (allowed: 1 to {})", opt.las_queues, kMaxLasQueues));
  // Each queue's threshold is ten times the one before: the last one must stay a number (an infinite one put every
  // job that had run at all in the last queue).
  double last = opt.las_first_threshold;
  for (int q = 1; q < opt.las_queues - 1; ++q) last *= 10;
  if (!std::isfinite(last))
    throw ConfigError(
        fmt::format("--las-threshold = {} with --las-queues = {}: the last queue's threshold, {} x 10^{}, "
                    "is past a double's range (allowed: thresholds up to 1.8e308)",
                    opt.las_first_threshold, opt.las_queues, opt.las_first_threshold, opt.las_queues - 2));
  if (!(std::isfinite(opt.restart_penalty) && opt.restart_penalty >= 0))
    throw ConfigError(fmt::format("--restart-penalty = {} (allowed: seconds, 0 or more)", opt.restart_penalty));
  if (!(std::isfinite(opt.min_lease) && opt.min_lease >= 0))
    throw ConfigError(fmt::format("--min-lease = {} (allowed: seconds, 0 or more)", opt.min_lease));
  if (!(std::isfinite(opt.las_promote_knob) && opt.las_promote_knob >= 0))
    throw ConfigError(fmt::format("--promote-knob = {} (allowed: 0 for no starvation guard, or a positive multiple)",
                                  opt.las_promote_knob));
}

std::vector<JobSpec> parse_job_trace(const std::string& text, const std::string& origin) {
  std::vector<JobSpec> jobs;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  bool header = false;
  size_t columns = 5;
  std::set<std::string> ids;
  while (std::getline(in, line)) {
    ++lineno;
    if (lineno == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // a UTF-8 byte-order mark
    std::string t = trim(line);
    if (t.empty() || t[0] == '#') continue;
    auto f = split(t, ',');
    for (auto& x : f) x = trim(x);
    if (!header) {
      header = true;
      if (f.size() < 5 || f.size() > 6 || f[0] != "id" || f[1] != "submit_s" || f[2] != "gpus" || f[3] != "model" ||
          f[4] != "iterations" || (f.size() == 6 && f[5] != "global_batch"))
        throw ConfigError(
            fmt::format("{}:{}: the header must be id,submit_s,gpus,model,iterations[,global_batch]", origin, lineno));
      columns = f.size();
      continue;
    }
    if (f.size() != columns)
      throw ConfigError(fmt::format("{}:{}: expected {} comma-separated fields (as the header), got {}", origin, lineno,
                                    columns, f.size()));
    JobSpec j;
    j.where = fmt::format("{}:{}", origin, lineno);
    j.id = f[0];
    if (j.id.empty()) throw ConfigError(fmt::format("{}:{}: id is empty", origin, lineno));
    // Ids go into JSON and tables: printable ASCII (a byte 0xFF failed the JSON writer after the whole simulation).
    for (unsigned char ch : j.id)
      if (ch < 0x20 || ch > 0x7e)
        throw ConfigError(fmt::format("{}:{}: id holds the byte 0x{:02X}; allowed: printable ASCII characters", origin,
                                      lineno, static_cast<unsigned>(ch)));
    if (!ids.insert(j.id).second)
      throw ConfigError(
          fmt::format("{}:{}: id '{}' is used by an earlier job (ids must be unique)", origin, lineno, j.id));
    auto num = [&](const std::string& v, const char* field, double lo, double hi) {
      const bool decimal = is_decimal(v, true);  // (strtod alone also took 0x8 and 0x1p4)
      char* end = nullptr;
      double x = decimal ? std::strtod(v.c_str(), &end) : std::nan("");
      if (!decimal || *end != 0 || !(x >= lo && x <= hi))
        throw ConfigError(
            fmt::format("{}:{}: {} = '{}' must be a number in [{:g}, {:g}]", origin, lineno, field, v, lo, hi));
      return x;
    };
    auto whole = [&](const std::string& v, const char* field, double hi) {
      double x = num(v, field, 1, hi);
      if (x != std::floor(x))
        throw ConfigError(fmt::format("{}:{}: {} = '{}' must be a whole number", origin, lineno, field, v));
      return static_cast<long long>(x);
    };
    j.submit = num(f[1], "submit_s", 0, kMaxTraceSeconds);
    j.gpus = whole(f[2], "gpus", static_cast<double>(kMaxSimulatedGpus));
    j.model = f[3];
    GptModel probe;
    if (!named_gpt(j.model, probe))
      throw ConfigError(
          fmt::format("{}:{}: model = '{}' (allowed: {})", origin, lineno, j.model, join(named_gpt_names(), ", ")));
    j.iterations = whole(f[4], "iterations", 1e12);
    // An empty cell asks for the default, 8 sequences per accelerator (JobSpec::global_batch 0), as a trace without
    // the column does: a trace giving some jobs' batches could not leave the others' at it.
    if (f.size() == 6 && !f[5].empty()) {
      try {
        j.global_batch = whole(f[5], "global_batch", 1e9);
      } catch (const ConfigError& e) {
        throw ConfigError(fmt::format("{}, or empty for 8 sequences per accelerator", e.what()));
      }
    }
    jobs.push_back(j);
  }
  if (jobs.empty()) throw ConfigError(fmt::format("{}: no jobs", origin));
  return jobs;
}

std::vector<JobSpec> load_job_trace(const std::string& path) {
  return parse_job_trace(read_input_file(path, "--jobs", "a CSV file of jobs"), path);
}

double job_iteration_time(const ClusterSpec& spec, const std::string& model, long long gpus, long long global_batch,
                          int leaves, std::string* why, const std::vector<long long>* kind_nodes, JobTimeCache* cache) {
  const bool by_kind = kind_nodes != nullptr && spec.node_kinds.size() > 1;
  auto key = std::make_tuple(model, gpus, global_batch, leaves, by_kind ? *kind_nodes : std::vector<long long>{});
  if (cache) {
    auto it = cache->find(key);
    if (it != cache->end()) {
      if (why) *why = it->second.second;
      return it->second.first;
    }
  }
  GptModel m;
  if (!named_gpt(model, m)) throw ConfigError(fmt::format("model '{}' is not a named model", model));
  ClusterSpec s = spec;
  if (by_kind) {
    // The kinds of the job's own nodes, as many of each as it holds: it runs at their pace, in their memory (timed
    // on the whole mixed cluster, every job ran at the slowest kind's pace wherever it was placed).
    if (kind_nodes->size() != spec.node_kinds.size())
      throw InvalidArgument("job_iteration_time: one node count per node kind");
    s.node_kinds.clear();
    for (size_t k = 0; k < spec.node_kinds.size(); ++k)
      if ((*kind_nodes)[k] > 0) {
        s.node_kinds.push_back(spec.node_kinds[k]);
        s.node_kinds.back().count = (*kind_nodes)[k];
      }
    if (s.node_kinds.empty()) throw InvalidArgument("job_iteration_time: a job on no node");
  }
  long long gpn = spec.gpus_per_node();
  if (gpus < gpn) {
    // A job smaller than a node runs on part of one: a node of `gpus` accelerators of its kind (its NICs unused), so
    // that it computes on what it was given, not on the whole node.
    s.node_kinds.resize(1);
    s.node_kinds[0].gpus = static_cast<int>(gpus);
    s.node_kinds[0].nics = 1;
    s.node_kinds[0].count = 0;
    gpn = gpus;
  }
  const long long nodes = std::max<long long>(1, (gpus + gpn - 1) / gpn);
  s.network.nodes_per_leaf = static_cast<int>(std::max<long long>(1, (nodes + leaves - 1) / leaves));
  s.network.uplink_share_of_attached = true;  // (its nodes' share of each leaf's uplink, as under a loaded cluster)
  // A job on a torus gets a ring of its nodes (the file's dimensions hold the whole cluster, not the job).
  if (s.network.topology == TopologyKind::kTorus) s.network.torus_dims = {static_cast<int>(nodes)};
  Topology topo(s, nodes * gpn);
  CollectiveModel net(topo);
  PlanSpace space;
  space.tp.clear();
  for (int t = 1; t <= std::min<long long>(gpn, m.heads); t *= 2) space.tp.push_back(t);
  space.micro_batch = {1, 2, 4};
  space.zero = {0, 1};
  space.schedules = {Schedule::k1F1B};
  space.recompute = {Recompute::kNone, Recompute::kFull};
  space.sequence_parallel = {true};
  const long long B = global_batch > 0 ? global_batch : 8 * nodes * gpn;
  PlanResult pr = plan(net, m, B, space, 1);
  double t = pr.ranked.empty() ? std::numeric_limits<double>::infinity() : pr.ranked.front().time;
  std::string reason;
  if (pr.ranked.empty())
    reason =
        pr.any_oom || pr.first_error.empty()
            ? fmt::format("no parallel configuration of {} fits in memory on {} accelerators", model, gpus)
            : fmt::format("no parallel configuration of {} runs on {} accelerators: {}", model, gpus, pr.first_error);
  if (cache) cache->emplace(key, std::make_pair(t, reason));
  if (why) *why = reason;
  return t;
}

namespace {

// "file:line: " of a trace's job, for the errors found once the cluster is known.
std::string job_where(const JobSpec& j) { return j.where.empty() ? std::string() : j.where + ": "; }

struct Running {
  size_t job;
  std::vector<std::pair<long long, long long>> alloc;  // (node, gpus)
  double iter_time;
};

}  // namespace

ScheduleResult simulate_cluster(const ClusterSpec& spec, long long gpus, const std::vector<JobSpec>& jobs,
                                const SchedulerOptions& opt) {
  validate(opt);
  if (jobs.empty()) throw InvalidArgument("simulate_cluster: no jobs (a trace holds at least one)");
  const long long gpn = spec.gpus_per_node();
  if (gpus < 1 || gpus > kMaxSimulatedGpus)
    throw ConfigError(fmt::format("--gpus = {} (allowed: 1..{})", gpus, kMaxSimulatedGpus));
  if (gpus % gpn != 0) throw ConfigError(fmt::format("--gpus = {} must be a multiple of {} per node", gpus, gpn));
  // On a torus every node is its own leaf, on a flat network all hang off one switch: placement does not group nodes
  // there (the file's nodes_per_leaf counted groups of nodes in the leaves column).
  const long long npl = spec.network.topology == TopologyKind::kTorus  ? 1
                        : spec.network.topology == TopologyKind::kFlat ? std::max<long long>(1, gpus / gpn)
                                                                       : spec.network.nodes_per_leaf;
  const long long per_leaf = npl * gpn;
  const long long nleaves = (gpus + per_leaf - 1) / per_leaf;
  const size_t n = jobs.size();
  for (const auto& j : jobs) {
    if (j.gpus > gpus)
      throw ConfigError(fmt::format("{}job {}: gpus = {}, and the cluster has {} accelerators (--gpus)", job_where(j),
                                    j.id, j.gpus, gpus));
    if (j.gpus > gpn && j.gpus % gpn != 0)
      throw ConfigError(fmt::format("{}job {}: gpus = {} must be at most {} or a multiple of it (whole nodes)",
                                    job_where(j), j.id, j.gpus, gpn));
  }
  // The cluster itself (its torus must hold these nodes, as for `sim step`), and the kind of every node.
  const Topology topo(spec, gpus);
  const long long nnodes = gpus / gpn;
  const size_t nkinds = spec.node_kinds.size();
  std::vector<uint16_t> kind_of(nnodes);
  for (long long nd = 0; nd < nnodes; ++nd)
    kind_of[nd] = static_cast<uint16_t>(&topo.kind_of_node(nd) - topo.spec().node_kinds.data());
  // A file of several kinds: jobs are timed on their own nodes' kinds even when --gpus holds one kind only (timed on
  // the file's first kind, a job on a node of the second was refused for the first one's memory).
  const bool mixed = nkinds > 1;
  auto nodes_of = [&](long long job_gpus) { return std::max<long long>(1, job_gpus / gpn); };
  JobTimeCache times;  // iteration times on this cluster, by model, size, batch and placement
  std::vector<JobOutcome> out(n);
  std::vector<double> remaining(n), attained(n, 0.0), packed(n, 0);
  std::vector<double> queued(n, 0.0);  // JobOutcome::queued (apart: adding to every waiting job's, strided, was slow)
  // The shortest iteration time each job ran at (the goodput counts a job at its base or at this, whichever is faster).
  std::vector<double> fastest_run(n, std::numeric_limits<double>::infinity());
  std::vector<int> state(n, 0);  // 0 not arrived, 1 waiting, 2 running, 3 done
  std::vector<double> restart_at(n, 0.0);
  std::vector<double> run_start(n, 0.0);  // when the job's current run began (its lease counts from the reload's end)
  // las with the starvation guard: seconds a job that has run waited since it first ran or was last promoted.
  std::vector<double> waited(n, 0.0);
  const bool guard = opt.policy == Policy::kLas && opt.las_promote_knob > 0;
  // On a cluster of several kinds: each job's iteration time on each kind alone (infinite where it does not fit in
  // that kind's memory: it is never placed there), and the kinds from the fastest for it.
  std::vector<std::vector<double>> on_kind(n);
  std::vector<std::vector<size_t>> fastest(n);
  for (size_t i = 0; i < n; ++i) {
    out[i].id = jobs[i].id;
    out[i].gpus = jobs[i].gpus;
    out[i].submit = jobs[i].submit;
    remaining[i] = static_cast<double>(jobs[i].iterations);
    std::string why;
    if (!mixed) continue;
    on_kind[i].assign(nkinds, std::numeric_limits<double>::infinity());
    for (size_t k = 0; k < nkinds; ++k) {
      if (topo.kind_counts()[k] == 0) continue;
      std::vector<long long> only(nkinds, 0);
      only[k] = nodes_of(jobs[i].gpus);
      std::string w;
      on_kind[i][k] = job_iteration_time(spec, jobs[i].model, jobs[i].gpus, jobs[i].global_batch, 1, &w, &only, &times);
      if (std::isfinite(on_kind[i][k]))
        fastest[i].push_back(k);
      else if (why.empty())
        why = fmt::format("{} (on {} nodes)", w, spec.node_kinds[k].name);
    }
    std::stable_sort(fastest[i].begin(), fastest[i].end(),
                     [&](size_t a, size_t b) { return on_kind[i][a] < on_kind[i][b]; });
    if (fastest[i].empty())
      throw ConfigError(fmt::format("{}job {}: on no node kind: {}", job_where(jobs[i]), jobs[i].id, why));
    long long room = 0;
    for (size_t k : fastest[i]) room += topo.kind_counts()[k] * gpn;
    if (jobs[i].gpus > room)
      throw ConfigError(fmt::format("{}job {} asks for {} accelerators; the node kinds it fits in memory have {}",
                                    job_where(jobs[i]), jobs[i].id, jobs[i].gpus, room));
  }
  std::vector<Running> running;
  // Each job's index in `running` (npos when it is not running): preempting a job found it by a scan of `running`.
  constexpr size_t npos = std::numeric_limits<size_t>::max();
  std::vector<size_t> run_idx(n, npos);
  double now = 0, busy = 0, useful = 0;
  // When running job j's lease ends (--min-lease: it trains that long after its reload before it can be preempted),
  // and whether it still holds it.
  auto lease_end = [&](size_t j) { return std::max(run_start[j], restart_at[j]) + opt.min_lease; };
  auto leased = [&](size_t j) { return opt.min_lease > 0 && now < lease_end(j); };

  // Free accelerators per node (a leaf's are its nodes'): a job smaller than a node gets part of one node, a larger
  // one whole free nodes. Counting per leaf let a 6-GPU job take 3 + 3 of two nodes and run as one NVSwitch node.
  std::vector<long long> free_node(nnodes, gpn);
  auto leaf_of_node = [&](long long node) { return node / npl; };
  // Places `need` accelerators on nodes of the `allowed` kinds (taking them when it fits), as `how` places.
  auto place_on = [&](std::vector<long long>& free_node, long long need, const std::vector<char>& allowed,
                      std::vector<std::pair<long long, long long>>& alloc, Placement how) -> bool {
    alloc.clear();
    if (need < gpn) {
      // Part of one node: best fit (topology) or first fit (spread).
      long long best = -1;
      for (long long nd = 0; nd < nnodes; ++nd)
        if (allowed[kind_of[nd]] && free_node[nd] >= need) {
          if (how == Placement::kSpread) {
            best = nd;
            break;
          }
          if (best < 0 || free_node[nd] < free_node[best]) best = nd;
        }
      if (best < 0) return false;
      alloc.push_back({best, need});
    } else {
      const long long k = need / gpn;
      std::vector<std::vector<long long>> whole(nleaves);  // whole free nodes of each leaf
      long long total = 0;
      for (long long nd = 0; nd < nnodes; ++nd)
        if (allowed[kind_of[nd]] && free_node[nd] == gpn) {
          whole[leaf_of_node(nd)].push_back(nd);
          ++total;
        }
      if (total < k) return false;
      if (how == Placement::kTopology) {
        // The fewest leaves: best fit in one leaf, else the leaves with the most whole free nodes first.
        long long best = -1;
        for (long long l = 0; l < nleaves; ++l)
          if (static_cast<long long>(whole[l].size()) >= k && (best < 0 || whole[l].size() < whole[best].size()))
            best = l;
        std::vector<long long> order;
        if (best >= 0) {
          order.push_back(best);
        } else {
          for (long long l = 0; l < nleaves; ++l) order.push_back(l);
          std::stable_sort(order.begin(), order.end(),
                           [&](long long x, long long y) { return whole[x].size() > whole[y].size(); });
        }
        long long left = k;
        for (long long l : order)
          for (long long nd : whole[l]) {
            if (left == 0) break;
            alloc.push_back({nd, gpn});
            --left;
          }
      } else {
        // Round-robin over the leaves, one node at a time.
        std::vector<size_t> next(nleaves, 0);
        long long left = k;
        while (left > 0)
          for (long long l = 0; l < nleaves && left > 0; ++l)
            if (next[l] < whole[l].size()) {
              alloc.push_back({whole[l][next[l]++], gpn});
              --left;
            }
      }
    }
    for (auto [nd, g] : alloc) free_node[nd] -= g;
    return true;
  };
  // Places job `job` on the free accelerators `free_node` describes, trying the kinds of nodes pass by pass: on a
  // cluster of several kinds only the kinds it fits on, and under topology placement one kind at a time, the fastest
  // for the job first (a job across kinds runs at its slowest kind's pace), before mixing them.
  auto passes_for = [&](size_t i, Placement how) {
    if (!mixed) return std::vector<std::vector<char>>{std::vector<char>(nkinds, 1)};
    std::vector<std::vector<char>> out;
    std::vector<char> all(nkinds, 0);
    for (size_t k : fastest[i]) all[k] = 1;
    if (how == Placement::kTopology)
      for (size_t k : fastest[i]) {
        std::vector<char> one(nkinds, 0);
        one[k] = 1;
        out.push_back(one);
      }
    out.push_back(all);
    return out;
  };
  std::vector<std::vector<std::vector<char>>> passes(n);
  for (size_t i = 0; i < n; ++i) passes[i] = passes_for(i, opt.placement);
  auto place_in = [&](std::vector<long long>& free_node, size_t job,
                      std::vector<std::pair<long long, long long>>& alloc) {
    for (const auto& allowed : passes[job])
      if (place_on(free_node, jobs[job].gpus, allowed, alloc, opt.placement)) return true;
    return false;
  };
  // The leaves an allocation spans and its nodes of each kind: what a job's iteration time is timed on.
  auto shape_of = [&](const std::vector<std::pair<long long, long long>>& alloc) {
    std::vector<long long> used;
    for (auto [nd, g] : alloc) used.push_back(leaf_of_node(nd));
    std::sort(used.begin(), used.end());
    std::vector<long long> kinds(nkinds, 0);
    for (auto [nd, g] : alloc) kinds[kind_of[nd]]++;
    return std::pair{static_cast<int>(std::unique(used.begin(), used.end()) - used.begin()), kinds};
  };
  // Each job's base, the pace its slowdown, goodput and srtf's ranking are measured against: where topology
  // placement puts it alone on the empty cluster (the fewest leaves; on several kinds the fastest kind that holds it,
  // else a mix), so that alone there a job's slowdown is 1. (Timed on one leaf, a job larger than a leaf had a base no
  // placement reaches, 1.01x alone; on the fastest kind alone, one larger than that kind's nodes: 6.2x alone.)
  {
    std::map<std::pair<long long, std::vector<size_t>>, std::pair<int, std::vector<long long>>> shapes;
    for (size_t i = 0; i < n; ++i) {
      auto [it, fresh] = shapes.try_emplace({jobs[i].gpus, fastest[i]});
      if (fresh) {
        std::vector<long long> empty(nnodes, gpn);
        std::vector<std::pair<long long, long long>> alloc;
        bool placed = false;
        for (const auto& allowed : passes_for(i, Placement::kTopology))
          if ((placed = place_on(empty, jobs[i].gpus, allowed, alloc, Placement::kTopology))) break;
        if (!placed)  // (the kinds it fits on hold it: checked above)
          throw Error(fmt::format("cluster simulation: job {} fits nowhere on the empty cluster", jobs[i].id));
        it->second = shape_of(alloc);
      }
      std::string why;
      packed[i] = job_iteration_time(spec, jobs[i].model, jobs[i].gpus, jobs[i].global_batch, it->second.first, &why,
                                     mixed ? &it->second.second : nullptr, &times);
      if (!std::isfinite(packed[i]))
        throw ConfigError(fmt::format("{}job {}: {}", job_where(jobs[i]), jobs[i].id, why));
    }
  }
  long long free_total = gpus;  // the sum of free_node
  auto place = [&](size_t job, std::vector<std::pair<long long, long long>>& alloc) {
    if (!place_in(free_node, job, alloc)) return false;
    free_total -= jobs[job].gpus;
    return true;
  };
  auto release = [&](const Running& r) {
    for (auto [nd, g] : r.alloc) {
      free_node[nd] += g;
      free_total += g;
    }
  };
  // Running job k stops (preempted or done): it leaves `running`, whose order (that of the jobs' starts) the sums of
  // busy and useful time follow, and the jobs after it move up one.
  auto stop_running = [&](size_t k) {
    run_idx[running[k].job] = npos;
    running.erase(running.begin() + static_cast<long>(k));
    for (size_t m = k; m < running.size(); ++m) run_idx[running[m].job] = m;
  };
  // Whether `job` fits on the free accelerators `free` describes: what place_in decides, without placing it (a part
  // of one node needs a node with that much free, whole nodes need as many whole free nodes, of the kinds allowed).
  auto fits_in = [&](const std::vector<long long>& free, size_t job) {
    const long long need = jobs[job].gpus;
    for (const auto& allowed : passes[job]) {
      long long whole = 0;
      for (long long nd = 0; nd < nnodes; ++nd) {
        if (!allowed[kind_of[nd]]) continue;
        if (need < gpn && free[nd] >= need) return true;
        if (free[nd] == gpn) ++whole;
      }
      if (need >= gpn && whole >= need / gpn) return true;
    }
    return false;
  };
  // Jobs that place alike (as many accelerators, on the same kinds of nodes in the same passes) share a class: within a
  // pass of las or srtf, once one fails to find room even by preempting every job it may, the later ones of its class
  // fail too (see schedule()).
  std::vector<size_t> fit_class(n);
  size_t nclasses = 0;
  {
    std::map<std::pair<long long, std::vector<size_t>>, size_t> classes;
    for (size_t i = 0; i < n; ++i)
      fit_class[i] = classes.try_emplace({jobs[i].gpus, fastest[i]}, classes.size()).first->second;
    nclasses = classes.size();
  }
  // LAS keeps each queue in the order jobs entered it, as Tiresias's simulator does: a job arriving, demoted or
  // promoted joins the end of its queue, and after each pass the waiting jobs move behind the running ones (keeping
  // their order), so a waiting job goes ahead only of jobs that entered its queue after it. (Ordered by submission
  // time inside a queue, a waiting job submitted earlier preempted a running one that had entered the queue before
  // it, and a promoted job went ahead of every job waiting in the first queue.)
  std::vector<int> in_queue(n, -1);
  std::vector<uint64_t> queue_seq(n, 0);
  uint64_t next_seq = 0;
  auto queue_of = [&](size_t i) {
    double th = opt.las_first_threshold;
    for (int q = 0; q < opt.las_queues - 1; ++q, th *= 10)
      if (attained[i] < th) return q;
    return opt.las_queues - 1;
  };
  // When the guard promotes waiting job i, counted from now (infinite for a job it does not apply to: one that never
  // ran, or is in the first queue already).
  auto promotion_in = [&](size_t i) {
    if (!guard || state[i] != 1 || out[i].start < 0 || queue_of(i) == 0) return std::numeric_limits<double>::infinity();
    return opt.las_promote_knob * attained[i] / static_cast<double>(jobs[i].gpus) - waited[i];
  };
  auto start_job = [&](size_t i, std::vector<std::pair<long long, long long>>& alloc) {
    auto [leaves, kinds] = shape_of(alloc);
    double it = job_iteration_time(spec, jobs[i].model, jobs[i].gpus, jobs[i].global_batch, leaves, nullptr,
                                   mixed ? &kinds : nullptr, &times);
    if (!std::isfinite(it))  // (kinds it fits on one by one hold it together too: the smallest memory decides)
      throw Error(
          fmt::format("cluster simulation: job {} has no configuration on the nodes it was placed on", jobs[i].id));
    run_idx[i] = running.size();
    running.push_back({i, alloc, it});
    fastest_run[i] = std::min(fastest_run[i], it);
    run_start[i] = now;
    if (out[i].start < 0)
      out[i].start = now;
    else
      restart_at[i] = now + opt.restart_penalty;  // a resumed job first reloads its checkpoint
    out[i].leaves_used = leaves;
    out[i].slowdown = it / packed[i];
    out[i].iteration_time = it;
    state[i] = 2;
  };
  // Jobs by submission time (ties: trace order) and the ones that arrived and are not done, in that order: each
  // event looks at those only (scanning all n jobs per event made 20,000 jobs take 21 s).
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return jobs[a].submit < jobs[b].submit; });
  size_t arrived = 0;
  std::vector<size_t> live;
  // las and srtf: the live jobs in the last pass's priority order (and this pass's), the jobs of `order` ranked so far,
  // the jobs whose keys moved since, and the failed placement classes (failed_gen[c] == pass_gen).
  std::vector<size_t> ranked, ranking;
  size_t ranked_upto = 0;
  std::vector<char> is_moved(n, 0);
  std::vector<double> srtf_key(n, 0.0);  // srtf: a job's predicted remaining GPU time, as of its last move
  std::vector<size_t> arrival_rank(n);   // (a job's place in `order`, as in `live`)
  for (size_t k = 0; k < n; ++k) arrival_rank[order[k]] = k;
  std::vector<uint64_t> failed_gen(nclasses, 0);
  uint64_t pass_gen = 0;
  auto schedule = [&]() {
    if (opt.policy == Policy::kFifo) {
      for (size_t i : live) {
        if (state[i] != 1) continue;
        std::vector<std::pair<long long, long long>> alloc;
        if (!place(i, alloc)) break;  // strict FIFO
        start_job(i, alloc);
      }
      return;
    }
    // LAS / SRTF: rank every active job; keep the running ones that still rank inside the capacity, preempt others.
    // The active jobs are ranked by las: queue, then the order they entered it; srtf: predicted remaining GPU time,
    // then submission, then trace order (as a stable sort of the jobs in arrival order ranked them). Only some jobs'
    // keys move between passes: the new arrivals; under srtf the jobs that ran (their remaining time); under las the
    // jobs that entered a queue, which only arrivals, the jobs that ran (demoted) and promoted jobs can. The others
    // keep the last pass's order (`ranked`), and the moved ones, sorted, merge into it: sorting the whole backlog
    // and looking up every job's queue at every event made an overloaded trace's run quadratic.
    std::vector<size_t> moved;
    if (guard)
      for (size_t i : live)  // (the event loop stops at each promotion time; the margin absorbs its rounding)
        if (promotion_in(i) <= 1e-9 * (1 + waited[i])) {
          attained[i] = 0;
          waited[i] = 0;
          out[i].promotions++;
          moved.push_back(i);  // (a waiting job: one running is not promoted)
        }
    for (const auto& r : running) moved.push_back(r.job);
    if (opt.policy == Policy::kLas) {
      // New arrivals join the first queue before jobs moved between queues at the same time, then those in arrival
      // order, as Tiresias's simulator does.
      std::sort(moved.begin(), moved.end(), [&](size_t a, size_t b) { return arrival_rank[a] < arrival_rank[b]; });
      const size_t ran = moved.size();
      for (size_t k = ranked_upto; k < arrived; ++k) {
        const size_t i = order[k];
        in_queue[i] = queue_of(i);
        queue_seq[i] = next_seq++;
        moved.push_back(i);
      }
      size_t kept = 0;
      for (size_t k = 0; k < ran; ++k)
        if (const size_t i = moved[k]; queue_of(i) != in_queue[i]) {
          in_queue[i] = queue_of(i);
          queue_seq[i] = next_seq++;
          moved[kept++] = i;
        }
      moved.erase(moved.begin() + static_cast<long>(kept), moved.begin() + static_cast<long>(ran));
    } else {
      for (size_t k = ranked_upto; k < arrived; ++k) moved.push_back(order[k]);
    }
    ranked_upto = arrived;
    for (size_t i : moved) {
      is_moved[i] = 1;
      if (opt.policy == Policy::kSrtf) srtf_key[i] = remaining[i] * packed[i] * static_cast<double>(jobs[i].gpus);
    }
    auto before = [&](size_t a, size_t b) {
      if (opt.policy == Policy::kSrtf) {
        if (srtf_key[a] != srtf_key[b]) return srtf_key[a] < srtf_key[b];
        if (jobs[a].submit != jobs[b].submit) return jobs[a].submit < jobs[b].submit;
      } else {
        if (in_queue[a] != in_queue[b]) return in_queue[a] < in_queue[b];
        if (queue_seq[a] != queue_seq[b]) return queue_seq[a] < queue_seq[b];
      }
      return a < b;
    };
    std::sort(moved.begin(), moved.end(), before);
    // The positions (in priority order) of the jobs running when this pass began: the only possible victims (a job
    // started in this pass ranks above the ones still to come). Scanning the whole backlog instead was quadratic.
    std::vector<size_t>& active = ranking;
    active.resize(live.size());
    std::vector<size_t> run_pos;
    size_t last_victim = 0;  // past the last position that may be preempted (a lease protects a job)
    {
      size_t at = 0, m = 0;
      auto put = [&](size_t i) {
        if (state[i] == 2) {
          run_pos.push_back(at);
          if (!leased(i)) last_victim = at + 1;
        }
        active[at++] = i;
      };
      for (size_t i : ranked) {
        if (state[i] == 3 || is_moved[i]) continue;
        for (; m < moved.size() && before(moved[m], i); ++m) put(moved[m]);
        put(i);
      }
      for (; m < moved.size(); ++m) put(moved[m]);
      if (at != active.size()) throw std::logic_error("cluster simulation: the ranking lost or repeated a job");
    }
    for (size_t i : moved) is_moved[i] = 0;
    // In priority order, a waiting job starts where it fits; one that does not fit preempts running jobs of lower
    // priority, the lowest first, only if that makes room for it (placement is per node, so a count of free
    // accelerators is not enough: deciding by counts kept a job that fragmentation left unplaced, idled its share,
    // and preempted jobs for nothing). Lower-priority jobs then backfill what is left.
    // A job that found no room, even with every running job it may preempt stopped, marks its class failed for the
    // rest of the pass (or until a preemption frees accelerators): later jobs of the class have no more room, since
    // starts only take free accelerators and their possible victims are fewer (those ranked below them), and placing
    // is monotone (a job that fits on some free accelerators fits on more). Trying each of thousands of waiting jobs
    // made an overloaded trace's run quadratic. Once every class failed and no job is left to preempt, nothing more
    // starts in this pass.
    ++pass_gen;
    size_t failed = 0;  // classes failed since pass_gen last moved
    std::vector<std::pair<long long, long long>> alloc;
    std::vector<long long> trial;
    std::vector<size_t> victims;
    for (size_t ai = 0; ai < active.size(); ++ai) {
      const size_t i = active[ai];
      if (state[i] != 1) continue;
      if (ai + 1 >= last_victim && (free_total == 0 || failed == nclasses)) break;  // (none left to preempt)
      if (failed_gen[fit_class[i]] == pass_gen) continue;
      if (place(i, alloc)) {
        start_job(i, alloc);
        continue;
      }
      trial = free_node;
      victims.clear();
      bool fits = false;
      for (size_t r = run_pos.size(); r-- > 0 && run_pos[r] > ai && !fits;) {
        const size_t j = active[run_pos[r]];
        if (state[j] != 2 || leased(j)) continue;
        for (auto [nd, g] : running[run_idx[j]].alloc) trial[nd] += g;
        victims.push_back(j);
        fits = fits_in(trial, i);
      }
      if (!fits) {
        failed_gen[fit_class[i]] = pass_gen;
        ++failed;
        continue;
      }
      // Keep the victims whose room turned out not to be needed (most recently added, i.e. highest priority,
      // first): a job preempted for nothing lost its restart penalty.
      for (size_t v = victims.size(); v-- > 0;) {
        const auto& a = running[run_idx[victims[v]]].alloc;
        for (auto [nd, g] : a) trial[nd] -= g;
        if (fits_in(trial, i)) {
          victims.erase(victims.begin() + static_cast<long>(v));
        } else {
          for (auto [nd, g] : a) trial[nd] += g;
        }
      }
      for (size_t j : victims) {
        const size_t k = run_idx[j];
        release(running[k]);
        state[j] = 1;
        out[j].preemptions++;
        stop_running(k);
      }
      ++pass_gen;  // (the preemptions freed accelerators: the classes that failed may fit now)
      failed = 0;
      if (place(i, alloc)) start_job(i, alloc);
    }
    // The next pass starts from this order, the keys of the jobs that did not move being the same. Under las the
    // waiting jobs then move behind the running ones of their queue, keeping their order.
    ranked.resize(active.size());
    if (opt.policy == Policy::kLas) {
      size_t at = 0;
      for (size_t s = 0; s < active.size();) {
        size_t e = s;
        while (e < active.size() && in_queue[active[e]] == in_queue[active[s]]) ++e;
        for (size_t k = s; k < e; ++k)
          if (state[active[k]] == 2) ranked[at++] = active[k];
        for (size_t k = s; k < e; ++k)
          if (const size_t i = active[k]; state[i] == 1) {
            queue_seq[i] = next_seq++;
            ranked[at++] = i;
          }
        s = e;
      }
    } else {
      std::swap(ranked, active);
    }
  };

  size_t done = 0;
  // A bound on the events (a second or so each million here): LAS's starvation guard promotes and demotes jobs again
  // and again, as often as its knob and the queues' thresholds make it, for as long as the jobs run.
  constexpr long long kMaxEvents = 10000000;
  long long events = 0;
  while (done < n) {
    if (++events > kMaxEvents)
      throw ConfigError(fmt::format(
          "cluster simulation: over {} scheduling events by simulated time {:.6g} s with {} of {} jobs done{}; "
          "allowed: "
          "traces that take fewer (fewer or shorter jobs{})",
          kMaxEvents, now, done, n,
          guard ? fmt::format(" (the starvation guard promotes waiting jobs every --promote-knob {} x their attained "
                              "service a GPU, and --las-threshold {} demotes them again)",
                              opt.las_promote_knob, opt.las_first_threshold)
                : std::string(),
          guard ? ", a larger --promote-knob or --las-threshold, or --promote-knob 0" : ""));
    // Arrivals at `now`.
    for (; arrived < n && jobs[order[arrived]].submit <= now; ++arrived) {
      state[order[arrived]] = 1;
      live.push_back(order[arrived]);
    }
    schedule();
    // Next event: an arrival, a completion, (LAS) a queue demotion, or a promotion by the starvation guard.
    double next = arrived < n ? jobs[order[arrived]].submit : std::numeric_limits<double>::infinity();
    if (guard)
      for (size_t i : live) next = std::min(next, now + promotion_in(i));
    for (const auto& r : running) {
      size_t i = r.job;
      double begin = std::max(now, restart_at[i]);
      next = std::min(next, begin + remaining[i] * r.iter_time);
      if (leased(i)) next = std::min(next, lease_end(i));
      if (opt.policy == Policy::kLas) {
        double th = opt.las_first_threshold;
        for (int q = 0; q < opt.las_queues - 1; ++q, th *= 10)
          if (attained[i] < th) {
            next = std::min(next, begin + (th - attained[i]) / static_cast<double>(jobs[i].gpus) + 1e-9);
            break;
          }
      }
    }
    if (!std::isfinite(next))
      throw ConfigError("cluster simulation: jobs can never run (a job needs more than the cluster)");
    // Time moves forward by at least one representable step (late in a long trace `now + tiny` equals `now`).
    next = std::max(next, std::nextafter(now, std::numeric_limits<double>::infinity()));
    const double dt = next - now;
    if (guard)  // (Tiresias counts a wait only once the job has run since its last promotion)
      for (size_t i : live)
        if (state[i] == 1 && attained[i] > 0) waited[i] += dt;
    for (size_t i : live)
      if (state[i] == 1) queued[i] += dt;
    for (const auto& r : running) {
      size_t i = r.job;
      const double begin = std::max(now, restart_at[i]);
      // A job whose finish time is this event ends now: comparing times, not the remaining iterations, keeps
      // rounding (which grows with `now`) from leaving a sliver of a job behind forever.
      if (begin + remaining[i] * r.iter_time <= next)
        remaining[i] = 0;
      else
        remaining[i] -= std::max(0.0, next - begin) / r.iter_time;
      // Attained service is training time: a job reloading its checkpoint attains nothing (counted, a large job whose
      // first queue ended within the restart penalty was demoted, and with the starvation guard promoted again, before
      // it trained at all, for ever).
      attained[i] += std::max(0.0, next - begin) * static_cast<double>(jobs[i].gpus);
      out[i].reloading += std::max(0.0, std::min(next, restart_at[i]) - now);
      busy += dt * static_cast<double>(jobs[i].gpus);
      useful += std::max(0.0, next - begin) * static_cast<double>(jobs[i].gpus);  // not reloading a checkpoint
      if (opt.policy == Policy::kLas) {  // a demotion event that rounding left just short of its threshold
        double th = opt.las_first_threshold;
        for (int q = 0; q < opt.las_queues - 1; ++q, th *= 10)
          if (attained[i] < th && th - attained[i] <= 1e-12 * th + 1e-9) attained[i] = th;
      }
    }
    now = next;
    size_t kept = 0;  // (the running jobs keep their order)
    for (size_t k = 0; k < running.size(); ++k) {
      const size_t i = running[k].job;
      if (remaining[i] <= 0) {
        release(running[k]);
        state[i] = 3;
        out[i].finish = now;
        ++done;
        run_idx[i] = npos;
      } else {
        if (kept != k) running[kept] = std::move(running[k]);
        run_idx[i] = kept++;
      }
    }
    running.resize(kept);
    live.erase(std::remove_if(live.begin(), live.end(), [&](size_t i) { return state[i] == 3; }), live.end());
  }
  for (size_t i = 0; i < n; ++i) out[i].queued = queued[i];
  ScheduleResult res;
  res.jobs = out;
  std::vector<double> jct;
  double first = std::numeric_limits<double>::infinity();
  for (const auto& j : out) {
    jct.push_back(j.finish - j.submit);
    res.makespan = std::max(res.makespan, j.finish);
    first = std::min(first, j.submit);
  }
  std::sort(jct.begin(), jct.end());
  for (double x : jct) res.mean_jct += x / static_cast<double>(jct.size());
  for (const auto& j : out) res.mean_queued += j.queued / static_cast<double>(out.size());
  auto pct = [&](double q) {
    return jct[std::min(jct.size() - 1, static_cast<size_t>(std::ceil(q * jct.size())) - 1)];
  };
  res.p50_jct = pct(0.5);
  res.p99_jct = pct(0.99);
  // From the first submission, as the utilization (a trace starting at t = 100000 s had a makespan of 100076 s).
  res.makespan -= first;
  // Shares of the accelerators' time over the makespan. Running jobs never hold more than the cluster, and they run
  // between the first submission and the last finish, so these are at most 1 by construction; what rounding leaves
  // above it (a sum of many intervals against one difference) is cut back, and more than that is a bug, not a figure
  // to print. (Both passed through min(1, x), which hid any such bug from the tests that bound them.)
  const double base = static_cast<double>(gpus) * res.makespan;
  auto share = [&](double x, const char* what) {
    if (!(x <= 1 + 1e-9))
      throw std::logic_error(fmt::format("cluster simulation: {} came to {:.17g}, above 1", what, x));
    return std::min(x, 1.0);
  };
  // Utilization counts iterations only; the restart penalty of preempted jobs holds accelerators without training.
  res.utilization = res.makespan > 0 ? share(useful / base, "the utilization") : 0;
  res.restart_overhead = res.makespan > 0 ? share((busy - useful) / base, "the restart overhead") : 0;
  // A job's iterations at its base pace, or at the fastest it ran where a placement beat the base (spread can land a
  // job on a faster mix of kinds): so no job counts more than the time it trained, and the goodput is at most the
  // utilization. (At the base alone a 17-GPU job spread over edge's kinds had a goodput of 1.1x its utilization.)
  double needed = 0;
  for (size_t i = 0; i < n; ++i)
    needed += static_cast<double>(jobs[i].iterations) * std::min(packed[i], fastest_run[i]) *
              static_cast<double>(jobs[i].gpus);
  res.goodput = res.makespan > 0 ? share(needed / base, "the goodput") : 0;
  if (res.goodput > res.utilization * (1 + 1e-9))
    throw std::logic_error(fmt::format("cluster simulation: the goodput ({:.17g}) is above the utilization ({:.17g})",
                                       res.goodput, res.utilization));
  return res;
}

}  // namespace conduit::sim
