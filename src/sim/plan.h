#pragma once
// The planner: searches DP x TP x PP x micro-batch x ZeRO stage x schedule x recompute (x sequence parallel,
// x compression) for a GPT model on a cluster, keeps the plans that fit in memory, ranks them by predicted
// iteration time and explains the best ones. Collective profiles are cached per group shape, so a candidate
// costs a few microseconds.
#include <string>
#include <vector>

#include "sim/step.h"

namespace conduit::sim {

struct PlanSpace {
  std::vector<int> tp;           // empty: powers of two up to min(heads, 2 x GPUs per node)
  bool sp_required = false;      // sequence_parallel {true} means every plan: tp = 1 is skipped (else it runs without)
  std::vector<int> pp;  // empty: 1 to the layer count (at most 128); one not dividing the layers with an uneven split
  std::vector<int>
      micro_batch;  // empty: 1 to 16, then 24, 32, 48, ... 1024 (those not dividing the batch per replica skipped)
  std::vector<int> zero{0, 1, 2, 3};
  std::vector<Schedule> schedules{Schedule::k1F1B, Schedule::kInterleaved, Schedule::kGpipe};
  std::vector<int> virtual_stages{2, 4};
  std::vector<Recompute> recompute{Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  std::vector<bool> sequence_parallel{false, true};
  std::vector<Compression> compression{Compression{}};
  ParallelConfig base;  // everything the search does not vary (grad bytes, bucket, algorithms, sync, mode)
};

struct PlanResult {
  std::vector<StepResult> ranked;  // fitting plans, fastest first (at most `top`)
  long long candidates = 0;        // configurations generated
  long long valid = 0;             // passed validation (divisibility etc.)
  long long fitting = 0;           // fit in memory
  long long resplit = 0;           // pipelines whose layers the second pass split otherwise (faster)
  long long refit = 0;             // pipelines that fit only with another split than the first pass's, added
  double seconds = 0;              // wall time of the search
  StepResult best_oom;             // the plan nearest to fitting, the least memory (when none fits)
  bool any_oom = false;
  std::string first_error;  // why the first invalid candidate was invalid (the hint when none is valid)
  // Valid candidates full-detail mode cannot time (copies of a group running different patterns, or more flows than
  // its budget): left out of the ranking; symmetric mode times them.
  long long untimeable = 0;
  std::string first_untimeable;
};

// A step time rounded to 30 significant bits (about 1e-9 relative), as the planner ranks and ties plans: equal
// schedules summed in different orders differ in their last bits.
double ranking_time(double t);
// The planner's order: the faster (by ranking_time; not a number last), then the smaller memory, then the name.
bool ranks_before(const StepResult& a, const StepResult& b);
PlanResult plan(CollectiveModel& net, const GptModel& m, long long global_batch, const PlanSpace& space, size_t top);

// One line per reason the plan wins (or loses) against `other`.
std::vector<std::string> explain_plan(const StepResult& best, const StepResult* runner_up);
std::string describe_config(const ParallelConfig& c);

}  // namespace conduit::sim
