#pragma once
// Cluster scheduling simulation: jobs arrive, ask for accelerators, and run at the speed the step model
// predicts for their placement (a job spread over more leaf switches crosses the oversubscribed spine and runs
// slower). Policies:
//   fifo   strict arrival order, no backfilling (head-of-line blocking)
//   las    Tiresias-style discretized two-dimensional least-attained-service (Gu et al., NSDI'19): jobs are
//          prioritized by attained service (accelerators x seconds trained, not reloading) in queues with exponentially
//          growing thresholds, arrival order inside a queue; preemptive (a preempted job checkpoints as it stops, as in
//          Tiresias, and loses `restart_penalty` seconds reloading when it resumes) where preempting lower-priority
//          jobs makes room on the nodes, lower-priority jobs backfill idle accelerators. Tiresias's
//          starvation guard is optional (`las_promote_knob`): a demoted job that has waited, since it first ran or
//          was last promoted, at least knob x the time it ran in that span goes back to the first queue with its
//          attained service reset, as Tiresias's simulator does. Off (0) by default: a large demoted job can then
//          wait behind a steady stream of small ones.
// Placement, per node: a job smaller than a node runs inside one node (best fit, or first fit under spread), a
// larger one on whole free nodes: topology (the fewest leaves: best fit in one leaf, else the leaves with the most
// free nodes) or spread (round-robin across leaves).
// Job speed for a placement: the planner's best configuration for the job's model and accelerator count on a
// cluster whose job nodes span that many leaves (cached per model, size and leaf count).
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "sim/cluster.h"
#include "sim/topology.h"

namespace conduit::sim {

// The latest submit time a job trace may give (about 31,700 years, in seconds).
constexpr double kMaxTraceSeconds = 1e12;

struct JobSpec {
  std::string id;
  double submit = 0;  // seconds
  long long gpus = 1;
  std::string model;  // a named GPT model (workload.h)
  long long iterations = 1;
  long long global_batch = 0;  // 0: 8 sequences per accelerator
  std::string where;           // "file:line" of a trace's job (empty: made in code), for the errors found later
};

// CSV with a header: id,submit_s,gpus,model,iterations[,global_batch] (global_batch left out or an empty cell: 8
// sequences per accelerator). ConfigError naming the line and field.
std::vector<JobSpec> load_job_trace(const std::string& path);
std::vector<JobSpec> parse_job_trace(const std::string& text, const std::string& origin);

enum class Policy { kFifo, kLas, kSrtf };
enum class Placement { kTopology, kSpread };
Policy parse_policy(const std::string& s);
Placement parse_placement(const std::string& s);

struct SchedulerOptions {
  Policy policy = Policy::kFifo;
  Placement placement = Placement::kTopology;
  double las_first_threshold = 3600;  // accelerator-seconds of the first LAS queue; each next one x10
  int las_queues = 3;                 // 1 to kMaxLasQueues
  double restart_penalty = 60;        // seconds lost when a preempted job restarts
  double las_promote_knob = 0;        // Tiresias's PROMOTEKNOB; 0: no starvation guard
  // las, srtf: seconds a job that (re)started trains before it can be preempted (its reload not counted); 0: none.
  // With a restart penalty far above the first queue's share, the starvation guard and the demotions otherwise
  // swap two jobs after every 0.1 s of training for 10 s of reloading; a lease of the penalty bounds the reloading
  // to half of what they hold.
  double min_lease = 0;
};
constexpr int kMaxLasQueues = 12;
// ConfigError naming the option and what is allowed.
void validate(const SchedulerOptions& opt);

struct JobOutcome {
  std::string id;
  long long gpus = 0;
  double submit = 0, start = -1, finish = -1;
  int leaves_used = 0;  // of its last placement
  double slowdown = 1;  // iteration time of its last placement / iteration time packed in one leaf
  int preemptions = 0;
  int promotions = 0;  // las: times the starvation guard put it back in the first queue
  double iteration_time = 0;
  // Seconds between submission and finish spent waiting (arrived, not placed: Tiresias's queueing delay) and reloading
  // a checkpoint after a preemption; JCT = queued + reloading + training.
  double queued = 0, reloading = 0;
};

struct ScheduleResult {
  std::vector<JobOutcome> jobs;
  double mean_jct = 0, p50_jct = 0, p99_jct = 0;
  double mean_queued = 0;       // mean of the jobs' queueing delays (JobOutcome::queued)
  double utilization = 0;       // accelerator-time spent on iterations / (accelerators x makespan)
  // Accelerator-time the jobs' iterations need at their best placement's speed (packed in one leaf, on the fastest
  // kind they fit; the pace a job ran at where that was faster) / (accelerators x makespan): unlike utilization, a
  // placement that slows jobs lowers it (their extra time counts as busy, not as work); at most the utilization.
  double goodput = 0;
  double restart_overhead = 0;  // accelerator-time preempted jobs spent reloading (the restart penalty), same base
  double makespan = 0;  // from the first submission to the last finish
};

ScheduleResult simulate_cluster(const ClusterSpec& spec, long long gpus, const std::vector<JobSpec>& jobs,
                                const SchedulerOptions& opt);

// Iteration time of a job on `gpus` accelerators whose nodes span `leaves` leaf switches (on a torus: a ring of
// its nodes). Infinity when no configuration runs; then `why` (when given) says what stopped them: memory, or the
// first configuration error (e.g. a global batch no micro-batch x data-parallel size divides). `kind_nodes` (on a
// cluster of several node kinds): how many of the job's nodes are of each kind; without it the job is timed on the
// cluster's own mix.
// `cache` (when given) keeps the times already computed on this one `spec` (simulate_cluster holds one per run): a
// cache shared between clusters would return one cluster's times for another.
using JobTimeCache = std::map<std::tuple<std::string, long long, long long, int, std::vector<long long>>,
                              std::pair<double, std::string>>;
double job_iteration_time(const ClusterSpec& spec, const std::string& model, long long gpus, long long global_batch,
                          int leaves, std::string* why = nullptr, const std::vector<long long>* kind_nodes = nullptr,
                          JobTimeCache* cache = nullptr);

}  // namespace conduit::sim
