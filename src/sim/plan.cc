#include "sim/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <set>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "sim/units.h"

namespace conduit::sim {

std::string describe_config(const ParallelConfig& c) {
  std::string s = fmt::format("dp={} tp={} pp={} b={} zero={} recompute={}", c.dp, c.tp, c.pp, c.micro_batch, c.zero,
                              recompute_name(c.recompute));
  if (c.first_stage_layers >= 0) s += fmt::format(" first-stage-layers={}", c.first_stage_layers);
  if (c.last_stage_layers >= 0) s += fmt::format(" last-stage-layers={}", c.last_stage_layers);
  if (c.pp > 1) {
    s += fmt::format(" schedule={}", schedule_name(c.schedule));
    if (c.schedule == Schedule::kInterleaved) s += fmt::format(" v={}", c.virtual_stages);
  }
  if (c.tp > 1 && c.sequence_parallel) s += " sp";
  // (ZeRO's gathers and groups, where set; `node` until a step resolves it; shard groups at stages 1-3)
  auto group = [&](const char* name, long long k) {
    if (k < 0) s += fmt::format(" {}=node", name);
    if (k > 1) s += fmt::format(" {}={}", name, k);
  };
  if (c.zero == 3) {
    if (c.gather_bytes != 0) s += fmt::format(" gather-bytes={:g}", c.gather_bytes);
    group("hpz", c.zero_hpz);
  }
  if (c.zero >= 1) group("shard", c.zero_shard);
  // (as modelled: a GPT model's default, every micro-batch as DeepSpeed, left unsaid)
  if (c.zero >= 2 && c.zero_reduce == ZeroReduce::kOncePerStep) s += " zero-reduce=step";
  if (c.compression.kind != "none")
    s += c.compression.param > 0 ? fmt::format(" compression={}:{}", c.compression.kind, c.compression.param)
                                 : fmt::format(" compression={}", c.compression.kind);
  return s;
}

double ranking_time(double t) {
  if (!std::isfinite(t) || t == 0) return t;
  int e = 0;
  const double mantissa = std::frexp(t, &e);
  return std::ldexp(std::round(std::ldexp(mantissa, 30)), e - 30);
}

namespace {

// A pipeline's layers split over its stages: the first's, each middle one's and the last's.
struct Split {
  int first = 0, middle = 0, last = 0;
};

// The plan's split of its layers, and whether other splits can be estimated from its stage times.
Split split_of(const StepResult& r) {
  const int p = r.config.pp;
  return {r.stage_layers.first, p > 2 ? r.stage_layers.middle : 0, r.stage_layers.last};
}
bool resplittable(const StepResult& r) {
  return r.config.pp >= 2 && r.config.schedule != Schedule::kInterleaved && r.breakdown.stage_layer > 0 &&
         r.microbatches >= 1;
}

// The time of the plan `r` with its layers split as `s` (see faster_splits).
double split_time(const StepResult& r, const Split& s) {
  const ParallelConfig& c = r.config;
  const StepBreakdown& b = r.breakdown;
  const int p = c.pp;
  const double per = b.stage_layer, per_fwd = b.stage_layer_forward;
  const Split now = split_of(r);
  const double mb = static_cast<double>(r.microbatches);
  const double first = b.stage_first + (s.first - now.first) * per;
  const double middle = b.stage_middle + (s.middle - now.middle) * per;
  const double last = b.stage_last + (s.last - now.last) * per;
  if (c.schedule == Schedule::kGpipe) {
    const double first_fwd = b.stage_first_forward + (s.first - now.first) * per_fwd;
    const double middle_fwd = b.stage_middle_forward + (s.middle - now.middle) * per_fwd;
    const double last_fwd = b.stage_last_forward + (s.last - now.last) * per_fwd;
    const double max_f = std::max({first_fwd, p > 2 ? middle_fwd : 0.0, last_fwd});
    const double max_b = std::max({first - first_fwd, p > 2 ? middle - middle_fwd : 0.0, last - last_fwd});
    return first + (p - 2) * middle + last + (mb - 1) * (max_f + max_b);
  }
  double bound = mb * first, ahead = first;
  if (p > 2) {  // (of the middle stages, the last has the most ahead of it)
    bound = std::max(bound, mb * middle + ahead + (p - 3) * middle);
    ahead += (p - 2) * middle;
  }
  return std::max(bound, mb * last + ahead);
}

// The fastest of the splits whose last stage holds lo..hi layers (the first the rest of `rest`), by the estimate,
// which is convex in the last stage's layers: binary search for the first l whose next is no faster.
std::pair<Split, double> best_in_range(const StepResult& r, int middle, int rest, int lo, int hi) {
  auto at = [&](int l) { return split_time(r, Split{rest - l, middle, l}); };
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (at(mid + 1) >= at(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return {Split{rest - lo, middle, lo}, at(lo)};
}

// The most layers each stage holds within the memory capacity (the first's, each middle one's, the last's; -1: not
// even none), from its memory linear in its layers (StepResult.stage_memory; no bound without it).
struct FitBounds {
  long long first, middle, last;
};
FitBounds fit_bounds(const StepResult& r, int layers) {
  const StageMemory& sm = r.stage_memory;
  const Split now = split_of(r);
  auto most = [&](double at_now, double per, int layers_now) -> long long {
    if (!(per > 0)) return layers;
    const double room = std::floor((r.memory_capacity - at_now) / per) + layers_now;
    return room < 0 ? -1 : room > layers ? layers : static_cast<long long>(room);
  };
  return {most(sm.first, sm.first_layer, now.first),
          r.config.pp > 2 ? most(sm.second, sm.second_layer, now.middle) : layers,
          most(sm.last, sm.last_layer, now.last)};
}

// Per count of the middle stages' layers, the fastest split by the estimate among those whose stages fit
// (fit_bounds; the estimate is convex in the last stage's layers there too).
std::vector<std::pair<Split, double>> best_fitting_splits(const StepResult& r, int layers) {
  const int p = r.config.pp;
  const FitBounds fit = fit_bounds(r, layers);
  std::vector<std::pair<Split, double>> found;
  if (fit.first < 0 || fit.last < 0) return found;
  auto consider = [&](int middle, int rest) {
    const long long lo = std::max<long long>(0, rest - fit.first), hi = std::min<long long>(rest, fit.last);
    if (lo <= hi) found.push_back(best_in_range(r, middle, rest, static_cast<int>(lo), static_cast<int>(hi)));
  };
  if (p == 2) {
    consider(0, layers);
  } else {
    for (int middle = 1; middle <= fit.middle && static_cast<long long>(p - 2) * middle <= layers; ++middle)
      consider(middle, layers - (p - 2) * middle);
  }
  return found;
}

// Other splits of a planned pipeline's layers (1F1B or GPipe; interleaved chunks hold equal layers) that its own
// stage times say are faster, the fastest first (at most four), each with the time it is expected to save. A stage's
// time is linear in its layers (the step's `stage_layer` a layer), so the plan's three stage times give every other
// split's, and with them the schedule's: GPipe's sum S + (m - 1)(max F + max B) (its closed form, exact), and for
// 1F1B the bound max over stages i of m S_i + sum_{j<i} S_j (stage i starts after the stages ahead ran micro-batch 0's
// forward, runs m forwards and backwards, and they run the last backward after it), the played-out schedule's time
// when the last stage is the slowest. (m max S + (sum S - max S), exact only then, overcharged splits whose first
// stage was the slowest by 5.5%, a review.) Both are convex in the last stage's layers for a given middle count (a
// maximum of linear terms, and a sum of two), so a binary search finds each count's best.
std::vector<std::pair<Split, double>> faster_splits(const StepResult& r, int layers) {
  if (!resplittable(r)) return {};
  const Split now = split_of(r);
  const double base = split_time(r, now);
  std::vector<std::pair<Split, double>> found;
  // Within the splits that fit (the estimate's fastest of a count that does not fit hid one that does, 14% faster
  // than the plan: a review).
  for (const auto& [s, t] : best_fitting_splits(r, layers)) {
    if (s.first == now.first && s.middle == now.middle && s.last == now.last) continue;
    const double gain = base - t;
    if (gain > 1e-9 * base) found.push_back({s, gain});
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (found.size() > 4) found.resize(4);
  return found;
}

// Splits of a pipeline that does not fit under which each stage would (a stage's memory is linear in its layers:
// StepResult.stage_memory; of the middle stages the second holds the most, one micro-batch fewer in flight than the
// first under 1F1B, and bounds them all), the fastest by the estimate first (at most four), each with its estimated
// time.
std::vector<std::pair<Split, double>> fitting_splits(const StepResult& r, int layers) {
  if (!resplittable(r)) return {};
  const StageMemory& sm = r.stage_memory;
  if (!(sm.first_layer > 0) || !(sm.last_layer > 0) || (r.config.pp > 2 && !(sm.second_layer > 0))) return {};
  std::vector<std::pair<Split, double>> found = best_fitting_splits(r, layers);
  std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  if (found.size() > 4) found.resize(4);
  return found;
}

// The configuration that runs `asked` with its layers split as `s` (an even split as the default).
ParallelConfig with_split(ParallelConfig c, const Split& s) {
  const bool even = s.first == s.last && (c.pp == 2 || s.middle == s.first);
  c.first_stage_layers = even ? -1 : s.first;
  c.last_stage_layers = even ? -1 : s.last;
  return c;
}

}  // namespace

bool ranks_before(const StepResult& a, const StepResult& b) {
  if (std::isnan(a.time) != std::isnan(b.time)) return std::isnan(b.time);
  const double ta = ranking_time(a.time), tb = ranking_time(b.time);
  if (!std::isnan(a.time) && ta != tb) return ta < tb;
  if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
  return describe_config(a.config) < describe_config(b.config);
}

PlanResult plan(CollectiveModel& net, const GptModel& m, long long global_batch, const PlanSpace& space_in,
                size_t top) {
  m.validate();
  const auto start = std::chrono::steady_clock::now();
  const Topology& topo = net.topology();
  const long long gpus = topo.gpus();
  PlanSpace space = space_in;
  if (space.tp.empty())
    for (int t = 1; t <= std::min<long long>(m.heads, 2LL * topo.gpus_per_node()); t *= 2) space.tp.push_back(t);
  if (space.sp_required && std::none_of(space.tp.begin(), space.tp.end(), [](int t) { return t > 1; }))
    throw ConfigError(
        fmt::format("--sp (sequence parallelism) needs a tensor-parallel size above 1, and none is "
                    "searched here (heads {}, GPUs per node {}); leave --sp out or give --tp",
                    m.heads, topo.gpus_per_node()));
  // Every size up to the layers (and 128): one that does not divide the layers with an uneven split (below).
  if (space.pp.empty())
    for (int p = 1; p <= std::min(m.layers, 128); ++p) space.pp.push_back(p);
  // Every size from 1 to 16, then 24, 32, 48, ... (powers of two and 1.5 times them) to 1024; those that do not
  // divide a rank's share of the batch are skipped. (Up to 16 only, GPT-2 small on 16 dgx-a100 GPUs at batch 1024
  // missed micro-batch 64, 2.3% faster: small models fill the GPU only with large micro-batches.)
  if (space.micro_batch.empty()) {
    for (int b = 1; b <= 16; ++b) space.micro_batch.push_back(b);
    for (int b = 16; b < 1024; b *= 2) space.micro_batch.insert(space.micro_batch.end(), {b + b / 2, 2 * b});
  }
  PlanResult res;
  auto note_dp1 = [&](StepResult& r) {
    if (space.base.sync.kind != "bsp")
      r.notes.push_back(
          fmt::format("dp = 1: no data-parallel exchange, so --sync {} does not apply", space.base.sync.kind));
  };
  std::vector<StepResult> all;
  std::vector<ParallelConfig> asked;  // (each plan's configuration as simulated, before the step resolved it)
  struct Unfit {                      // a pipeline that does not fit as split, and the splits under which it would
    double expected;
    ParallelConfig asked;
    std::vector<std::pair<Split, double>> splits;
  };
  std::vector<Unfit> unfit;
  for (int t : space.tp) {
    for (int p : space.pp) {
      auto skip = [&](std::string why) {
        if (res.first_error.empty()) res.first_error = std::move(why);
      };
      if (gpus % (static_cast<long long>(t) * p) != 0) {
        skip(fmt::format("tp ({}) x pp ({}) does not divide the {} accelerators", t, p, gpus));
        continue;
      }
      const long long d = gpus / (static_cast<long long>(t) * p);
      // A pipeline size that does not divide the layers: the middle stages ceil(l / p) each (floor where
      // that would leave the ends fewer than none) and the ends the rest, the last the smaller half, as it
      // also runs the output layer and the loss (BLOOM's 70 layers on 12 stages: 5, 6 x 10, 5; 31 on 4:
      // 8, 8, 8, 7, 9% faster than 7 first and 8 last); not interleaved, whose chunks hold equal layers.
      const bool uneven = p > 1 && m.layers % p != 0;
      int first_layers = -1, last_layers = -1;
      if (uneven) {
        if (p - 2 >= m.layers) {  // (a middle stage would hold none)
          skip(fmt::format("pp ({}) leaves a pipeline stage without layers: the model has {}", p, m.layers));
          continue;
        }
        int mid = (m.layers + p - 1) / p;
        if (static_cast<long long>(p - 2) * mid > m.layers) mid = m.layers / p;
        const int rest = m.layers - (p - 2) * mid;
        first_layers = rest - rest / 2, last_layers = rest / 2;
      }
      for (int b : space.micro_batch) {
        if (global_batch % (static_cast<long long>(b) * d) != 0) {
          skip(
              fmt::format("the global batch ({}) is not a multiple of micro-batch ({}) x dp ({})", global_batch, b, d));
          continue;
        }
        for (int z : space.zero) {
          if (z >= 2 && p > 1) {
            skip(fmt::format("ZeRO {} with pp = {} is not modelled (DeepSpeed does not combine them)", z, p));
            continue;
          }
          if (z > 0 && d == 1) {  // nothing to shard
            skip(fmt::format("ZeRO {} needs data parallelism, and tp ({}) x pp ({}) leaves dp = 1", z, t, p));
            continue;
          }
          for (Recompute rc : space.recompute) {
            if (rc == Recompute::kSelective && scores_on_chip(space.base.attention)) {
              skip(
                  fmt::format("--recompute selective with --attention-kernels {0}: nothing to recompute, {0} stores "
                              "no scores; allowed: --recompute none or full",
                              attention_kernels_name(space.base.attention)));
              continue;
            }
            const bool has_none = std::any_of(space.compression.begin(), space.compression.end(),
                                              [](const Compression& c) { return c.kind == "none"; });
            const bool has_plain = std::find(space.sequence_parallel.begin(), space.sequence_parallel.end(), false) !=
                                   space.sequence_parallel.end();
            for (bool sp_option : space.sequence_parallel) {
              if (sp_option && t == 1 && has_plain) continue;  // the same plan as sp = false
              if (sp_option && t == 1 && space.sp_required) {
                skip("sequence parallelism (--sp) needs tp > 1");
                continue;
              }
              const bool sp = sp_option && t > 1;
              for (const Compression& cp : space.compression) {
                if (cp.kind == "fp16" && space.base.grad_bytes == 2 && has_none) continue;  // (the same plan)
                // (ZeRO reduce-scatters: its wire can be 16-bit or int blocks, not top-k or PowerSGD's factors;
                // fp16 with 16-bit gradients is the plan without compression)
                const bool zero_wire =
                    cp.kind == "int8" || cp.kind == "int4" || (cp.kind == "fp16" && space.base.grad_bytes != 2);
                if (cp.kind != "none" && (d == 1 || (z > 0 && !zero_wire))) {
                  skip(d == 1 ? std::string("compression needs data parallelism (dp = 1 here)")
                              : fmt::format("compression {} with ZeRO {}: ZeRO's reduce-scatter takes int8 or int4 "
                                            "(fp16 is the 16-bit gradients' own wire)",
                                            cp.kind, z));
                  continue;
                }
                std::vector<std::pair<Schedule, int>> scheds;
                if (p == 1) {
                  // One stage: GPipe and 1F1B are the same plan (labelled as the options give it); interleaving
                  // needs two stages, so a search fixed to it has none here.
                  auto it = std::find_if(space.schedules.begin(), space.schedules.end(),
                                         [](Schedule s) { return s != Schedule::kInterleaved; });
                  if (it == space.schedules.end()) {
                    skip("--schedule interleaved needs pp >= 2");
                    continue;
                  }
                  scheds.push_back({*it, 1});
                } else
                  for (Schedule s : space.schedules) {
                    if (s == Schedule::kInterleaved)
                      for (int v : space.virtual_stages) scheds.push_back({s, v});
                    else
                      scheds.push_back({s, 1});
                  }
                for (auto [sched, v] : scheds) {
                  if (uneven && sched == Schedule::kInterleaved) {
                    skip(
                        fmt::format("--schedule interleaved: pp ({}) does not divide the {} layers, which only an "
                                    "uneven split (1f1b, gpipe) cuts",
                                    p, m.layers));
                    continue;
                  }
                  ParallelConfig c = space.base;
                  c.first_stage_layers = first_layers;
                  c.last_stage_layers = last_layers;
                  c.tp = t;
                  c.pp = p;
                  c.dp = 0;
                  c.micro_batch = b;
                  c.global_batch = global_batch;
                  c.zero = z;
                  // (other stages' gathers and shards: not this plan's)
                  if (z != 3) c.gather_bytes = 0, c.zero_hpz = 0;
                  if (z == 0) c.zero_shard = 0, c.zero_prefetch = true;
                  if (z != 1 && z != 2) c.zero_allgather_bytes = 0;
                  // (and where a rank has one micro-batch: reduce-scattered once either way)
                  if (z < 2 ||
                      global_batch / (static_cast<long long>(b) * (gpus / (static_cast<long long>(t) * p))) <= 1)
                    c.zero_reduce = ZeroReduce::kModelDefault;
                  c.recompute = rc;
                  c.sequence_parallel = sp;
                  c.compression = cp;
                  // (no exchange to schedule, no collectives to choose an algorithm for)
                  if (d == 1) c.sync = SyncScheme{}, c.dp_overlap = true, c.dp_algorithm = Algorithm::kAuto;
                  if (t == 1) c.tp_algorithm = Algorithm::kAuto;
                  c.schedule = sched;
                  c.virtual_stages = v;
                  ++res.candidates;
                  StepResult r;
                  try {
                    r = simulate_step(net, m, c);
                  } catch (const ConfigError& e) {
                    if (res.first_error.empty()) res.first_error = e.what();
                    continue;
                  } catch (const UnsupportedError& e) {
                    // A placement full-detail mode cannot time in lock step: this candidate is left out, and
                    // counted (it stopped the whole search, naming no plan).
                    if (!std::string_view(e.what()).starts_with("full-detail mode")) throw;
                    if (res.untimeable == 0) res.first_untimeable = e.what();
                    ++res.untimeable;
                    continue;
                  }
                  ++res.valid;
                  if (d == 1) note_dp1(r);
                  if (!r.fits) {
                    // (the nearest to fitting: how far the search is from a plan says more than the fastest
                    // failure's memory, which may be far off)
                    if (!res.any_oom || r.memory.total() < res.best_oom.memory.total() ||
                        (r.memory.total() == res.best_oom.memory.total() && r.time < res.best_oom.time)) {
                      res.best_oom = r;
                      res.any_oom = true;
                    }
                    if (auto splits = fitting_splits(r, m.layers); !splits.empty())
                      unfit.push_back({splits.front().second, c, std::move(splits)});
                    continue;
                  }
                  ++res.fitting;
                  all.push_back(std::move(r));
                  asked.push_back(c);
                }
              }
            }
          }
        }
      }
    }
  }
  // Fastest first; equal times (plans that differ only where nothing is charged) by memory, then by description, so
  // the ranking, the --top cut and the runner-up explain_plan names are the same on every run (std::sort on the time
  // alone left ties in no defined order). A time that is not a number ranks last.
  // Times are compared to 30 bits (about 1e-9): the same schedule summed in another order (GPipe's closed form,
  // 1F1B's, its play-out) differs in the last bits, which ranked a GPipe plan of 3-8x the memory above its equal 1F1B.
  std::vector<size_t> order(all.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto by_rank = [&](size_t x, size_t y) { return ranks_before(all[x], all[y]); };
  std::sort(order.begin(), order.end(), by_rank);

  // A second pass: each pipeline's layers split otherwise (the first pass cut them evenly, or with the one uneven
  // split above), where the plan's own stage times say another split is faster (faster_splits) and that could bring
  // it into the `top` shown; each such split simulated in full (it may not fit, or its played-out bubble differ),
  // and the plan replaced by the fastest of them that fits, where that is faster. A last stage with a large output
  // layer (Gemma's vocabulary of 256k over a hidden size of 2048) runs fewer layers than the others. Plans are taken in
  // order of their expected times, up to the first that could not reach the `top` any more. (Plans that would fit only
  // with another split are added first, just below.)
  std::multiset<double> times;
  for (const auto& r : all)
    if (std::isfinite(r.time)) times.insert(r.time);  // (a time that is not a number has no place in an order)
  auto cut = [&] {                                    // the time a plan needs to be in the top shown
    if (top == 0) return -std::numeric_limits<double>::infinity();  // (nothing shown)
    if (times.size() < top) return std::numeric_limits<double>::infinity();
    return *std::next(times.begin(), static_cast<long>(top) - 1);
  };
  // Pipelines that do not fit as the first pass split them but would with fewer layers on a stage that holds the most
  // (the first, with the most micro-batches in flight under 1F1B; the last, with the output layer and the logits), by
  // their stages' memory (fitting_splits): the fastest of those splits by the estimate are simulated in full, and the
  // fastest that fits joins the plans; taken in the order of their expected times, up to the first that could not
  // enter the plans shown. (Until 2026-12-08 a plan that did not fit was dropped, whatever split would have fitted.)
  std::stable_sort(unfit.begin(), unfit.end(), [](const Unfit& x, const Unfit& y) { return x.expected < y.expected; });
  // The fastest of `splits` of `base` that fits, each simulated in full (and counted), where it ranks before `than`
  // when one is given: into `best` and the configuration asked for, `best_asked`.
  auto fastest_fitting = [&](const ParallelConfig& base, const std::vector<std::pair<Split, double>>& splits,
                             const StepResult* than, StepResult* best, ParallelConfig* best_asked) {
    bool found = false;
    for (const auto& [s, estimate] : splits) {
      const ParallelConfig c = with_split(base, s);
      ++res.candidates;
      StepResult r;
      try {
        r = simulate_step(net, m, c);
      } catch (const ConfigError&) {
        continue;  // (a split whose play-out is past its bounds)
      } catch (const UnsupportedError& e) {
        if (!std::string_view(e.what()).starts_with("full-detail mode")) throw;
        continue;
      }
      ++res.valid;
      if (!r.fits) continue;
      ++res.fitting;
      if (found ? !ranks_before(r, *best) : than != nullptr && !ranks_before(r, *than)) continue;
      *best = std::move(r);
      *best_asked = c;
      found = true;
    }
    return found;
  };
  for (const Unfit& u : unfit) {
    if (!(u.expected < cut())) break;
    StepResult best;
    ParallelConfig best_asked;
    if (!fastest_fitting(u.asked, u.splits, nullptr, &best, &best_asked)) continue;
    if (best.config.dp == 1) note_dp1(best);
    if (std::isfinite(best.time)) times.insert(best.time);
    all.push_back(std::move(best));
    asked.push_back(best_asked);
    order.push_back(all.size() - 1);
    ++res.refit;
  }
  struct Resplit {
    double expected;
    size_t plan;
    std::vector<std::pair<Split, double>> splits;
  };
  std::vector<Resplit> resplits;
  for (size_t i : order) {
    auto splits = faster_splits(all[i], m.layers);
    if (!splits.empty()) resplits.push_back({all[i].time - splits.front().second, i, std::move(splits)});
  }
  std::stable_sort(resplits.begin(), resplits.end(),
                   [](const Resplit& x, const Resplit& y) { return x.expected < y.expected; });
  for (const Resplit& rs : resplits) {
    if (!(rs.expected < cut())) break;
    StepResult& now = all[rs.plan];
    StepResult better;
    ParallelConfig better_asked;
    if (!fastest_fitting(asked[rs.plan], rs.splits, &now, &better, &better_asked)) continue;
    if (auto it = times.find(now.time); it != times.end()) times.erase(it);
    if (std::isfinite(better.time)) times.insert(better.time);
    if (better.config.dp == 1) note_dp1(better);
    now = std::move(better);
    asked[rs.plan] = better_asked;
    ++res.resplit;
  }
  std::sort(order.begin(), order.end(), by_rank);
  for (size_t i = 0; i < order.size() && i < top; ++i) res.ranked.push_back(std::move(all[order[i]]));
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return res;
}

std::vector<std::string> explain_plan(const StepResult& best, const StepResult* other) {
  std::vector<std::string> out;
  const StepBreakdown& b = best.breakdown;
  struct Part {
    const char* name;
    double v;
  };
  std::vector<Part> parts{{"compute", b.compute - b.recompute},
                          {"recompute", b.recompute},
                          {"pipeline bubble", b.bubble},
                          {"tensor-parallel comm", b.tp_comm},
                          {"pipeline p2p", b.pp_comm + b.embedding_sync},
                          {"exposed data-parallel comm", b.dp_exposed + b.zero3_exposed},
                          {"compute slowed by overlap", b.overlap_slowdown},
                          {"optimizer", b.optimizer}};
  std::sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) { return x.v > y.v; });
  std::string top;
  for (size_t i = 0; i < parts.size() && i < 3; ++i) {
    if (parts[i].v <= 0) break;
    if (!top.empty()) top += ", ";
    top += fmt::format("{} {:.0f}%", parts[i].name, 100 * parts[i].v / best.time);
  }
  out.push_back(fmt::format("time goes to {}", top));
  out.push_back(fmt::format("memory {} of {} ({} activations)", format_gb(best.memory.total()),
                            format_gb(best.memory_capacity), format_gb(best.memory.activations)));
  if (other) {
    const StepBreakdown& o = other->breakdown;
    std::vector<Part> diffs{
        {"compute", (o.compute - o.recompute) - (b.compute - b.recompute)},
        {"recompute", o.recompute - b.recompute},
        {"pipeline bubble", o.bubble - b.bubble},
        {"tensor-parallel comm", o.tp_comm - b.tp_comm},
        {"pipeline p2p", (o.pp_comm + o.embedding_sync) - (b.pp_comm + b.embedding_sync)},
        {"exposed data-parallel comm", (o.dp_exposed + o.zero3_exposed) - (b.dp_exposed + b.zero3_exposed)},
        {"compute slowed by overlap", o.overlap_slowdown - b.overlap_slowdown},
        {"optimizer", o.optimizer - b.optimizer}};
    std::sort(diffs.begin(), diffs.end(), [](const Part& x, const Part& y) { return x.v > y.v; });
    // (a tie within rounding too, as the ranking counts one: ZeRO-1 and 2 reach the same time by different sums)
    const bool tie = ranking_time(other->time) == ranking_time(best.time);
    if (!tie && diffs.front().v > 0)
      out.push_back(fmt::format("beats the next plan ({}) by {:.1f}% mostly through {} ({} less)",
                                describe_config(other->config), 100 * (other->time - best.time) / other->time,
                                diffs.front().name, format_seconds(diffs.front().v)));
    else if (tie)  // (a tie said nothing: ZeRO-1 and 2 of a small model, one bucket)
      out.push_back(fmt::format("ties with the next plan ({}): the same predicted time, ranked first by {}",
                                describe_config(other->config),
                                best.memory.total() < other->memory.total() ? "its smaller memory" : "its name"));
  }
  return out;
}

}  // namespace conduit::sim
