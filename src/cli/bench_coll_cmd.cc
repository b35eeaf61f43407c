// `conduit bench coll`: an nccl-tests-style sweep of one collective over message sizes, with a correctness check
// per size; `conduit selftest`: every collective, algorithm and several dtypes/counts checked over the world
// communicator (used by the test suite over real processes: tcp, shm, mpi).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/bench_ops.h"
#include "cli/registry.h"
#include "coll/algorithms.h"
#include "coll/communicator.h"
#include "coll/verify.h"
#include "core/dtype.h"
#include "core/env.h"
#include "core/error.h"
#include "core/reduce.h"
#include "core/stats.h"

namespace conduit::cli {
namespace {

using coll::CollOptions;
using coll::Communicator;

struct BenchArgs {
  std::string op = "allreduce";
  std::string algo;
  std::string transport;
  std::string dtype = "f32";
  std::string reduce = "sum";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  int iters = 20;
  int warmup = 5;
  int root = 0;
  double timeout = 0;
  bool json = false;
  bool check = true;
  bool blocking = true;
  double stagger_us = 0;  // > 0: the last rank calls this long after the others (they have gone to sleep waiting)
};

// nccl-tests' bus bandwidth factors.
double bus_factor(const std::string& op, int n) {
  // (With one rank nothing crosses a bus: 0 for every op but broadcast and reduce, as nccl-tests and the peers
  // of bench/peers/compare.py report it.)
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  // Gather and scatter move (n-1)/n of the whole buffer through the root's link (nccl-tests' GatherGetBw).
  if (op == "reduce_scatter" || op == "allgather" || op == "alltoall" || op == "gather" || op == "scatter")
    return static_cast<double>(n - 1) / n;
  return 1;
}

coll::Work launch_op(Communicator& c, const BenchArgs& a, DType dt, ReduceOp rop, size_t count, char* in, char* out,
                     const CollOptions& o) {
  const std::string& op = a.op;
  if (op == "allreduce") return c.allreduce(in, count, dt, rop, o);
  if (op == "reduce_scatter") return c.reduce_scatter(in, out, count, dt, rop, o);
  if (op == "allgather") return c.allgather(in, out, count, dt, o);
  if (op == "broadcast") return c.broadcast(in, count, dt, a.root, o);
  if (op == "reduce") return c.reduce(in, out, count, dt, rop, a.root, o);
  if (op == "alltoall") return c.alltoall(in, out, count, dt, o);
  if (op == "gather") return c.gather(in, out, count, dt, a.root, o);
  if (op == "scatter") return c.scatter(in, out, count, dt, a.root, o);
  throw ConfigError(fmt::format("--op '{}' is not supported: allowed are {}", op, bench_coll_ops_list()));
}

void run_bench(const BenchArgs& a) {
  if (!is_bench_coll_op(a.op))
    throw ConfigError(fmt::format("--op '{}' is not supported: allowed are {}", a.op, bench_coll_ops_list()));
  // (the core parsers' messages named the value but not the flag it came from)
  DType dt;
  try {
    dt = parse_dtype(a.dtype);
  } catch (const ConfigError&) {
    throw ConfigError(fmt::format("--dtype = '{}': unknown dtype; allowed: {}", a.dtype, dtype_names_allowed()));
  }
  ReduceOp rop;
  try {
    rop = parse_reduce_op(a.reduce);
  } catch (const ConfigError&) {
    throw ConfigError(
        fmt::format("--reduce = '{}': unknown reduction; allowed: {}", a.reduce, reduce_op_names_allowed()));
  }
  uint64_t lo = parse_bytes(a.min_bytes, "--min-bytes"), hi = parse_bytes(a.max_bytes, "--max-bytes");
  if (lo == 0) lo = dtype_size(dt);
  if (lo % dtype_size(dt) != 0)
    throw ConfigError(fmt::format("--min-bytes {} is not a whole number of {} elements ({} bytes each)", a.min_bytes,
                                  dtype_name(dt), dtype_size(dt)));
  // (--min-bytes 0 means one element; "0 is below 0" named the wrong reason for a zero --max-bytes.)
  if (hi == 0)
    throw ConfigError(fmt::format("--max-bytes {} is not a message size; allowed: at least one {} element ({} bytes)",
                                  a.max_bytes, dtype_name(dt), dtype_size(dt)));
  if (hi < lo)
    throw ConfigError(fmt::format("--max-bytes {} is below --min-bytes {} ({} bytes)", a.max_bytes, a.min_bytes, lo));
  // (the ranks on this host all hold theirs: `conduit launch` and mpirun say how many; the ranks of `launch -n 2 ...
  // -e 5G` needed ~30 GB of 23)
  check_bench_coll_memory(hi, ranks_on_this_host(), "--max-bytes " + a.max_bytes);
  if (a.iters < 1 || a.iters > 1000000) throw ConfigError("--iters must be in [1, 1000000]");
  if (a.warmup < 0 || a.warmup > 1000000) throw ConfigError("--warmup must be in [0, 1000000]");
  if (!(a.stagger_us >= 0) || a.stagger_us > 1e6)
    throw ConfigError(fmt::format("--stagger-us = {} (allowed: 0..1000000 microseconds)", a.stagger_us));
  // (checked before the communicator comes up: it needs none)
  if (!a.algo.empty()) {
    const auto op = tunable_coll_op(a.op);
    if (!op)
      throw ConfigError(fmt::format(
          "--algo applies to allreduce, reduce_scatter, allgather, broadcast and reduce, not to --op {}", a.op));
    try {
      coll::Tuner::check_algorithm(*op, a.algo);
    } catch (const ConfigError&) {
      throw ConfigError(fmt::format("--algo = '{}': unknown {} algorithm; allowed: {}", a.algo, coll::coll_op_name(*op),
                                    join(coll::Tuner::algorithms(*op), ", ")));
    }
  }
  coll::CommConfig cfg;
  cfg.timeout_s = a.timeout;
  cfg.transport = a.transport;
  auto comm = Communicator::from_env(cfg);
  Communicator& c = *comm;
  const int n = c.size();
  if (a.root < 0 || a.root >= n) throw ConfigError(fmt::format("--root {} is not a rank of [0, {})", a.root, n));
  if (a.stagger_us * 1e-6 >= c.timeout_s())
    throw ConfigError(
        fmt::format("--stagger-us = {} is not below the collective deadline ({} s, --timeout): the "
                    "waiting ranks would time out",
                    a.stagger_us, c.timeout_s()));
  CollOptions o;
  o.algorithm = a.algo;
  o.blocking = a.blocking;
  const size_t esz = dtype_size(dt);
  // size = the bytes each rank contributes (allreduce, broadcast, reduce) or the full vector (gather-like). A
  // gather-like op moves a block of whole elements a rank, so its sizes are multiples of n x esz: each size of the
  // sweep is rounded down to one, and up to the first at or above --min-bytes, so that every row lies within
  // [--min-bytes, --max-bytes] (-b 4 -e 8 on 4 ranks printed a row of 16 bytes, and -b 20 on 4 ranks one of 16).
  const bool per_rank_block =
      a.op == "reduce_scatter" || a.op == "allgather" || a.op == "alltoall" || a.op == "gather" || a.op == "scatter";
  const uint64_t unit = per_rank_block ? static_cast<uint64_t>(n) * esz : esz;
  const uint64_t first_blocks = (lo + unit - 1) / unit;  // the smallest size in the range, in units
  // (a range that holds none is refused on every rank alike, before the table begins)
  if (first_blocks * unit > hi)
    throw ConfigError(fmt::format(
        "--min-bytes {} to --max-bytes {} ({} to {} bytes) holds no size of --op {} on {} ranks: its sizes are "
        "whole {} elements a rank, multiples of {} bytes, the smallest {} bytes; allowed: a range that holds one, "
        "e.g. --max-bytes {}",
        a.min_bytes, a.max_bytes, lo, hi, a.op, n, dtype_name(dt), unit, unit, first_blocks * unit));
  // (allgather, broadcast, alltoall, gather and scatter reduce nothing: their rows and header said sum)
  const char* redop = bench_coll_op_reduces(a.op) ? reduce_op_name(rop) : "-";
  if (c.rank() == 0 && !a.json) {
    std::printf("# conduit bench coll: op %s, %d ranks, transport %s, dtype %s, reduce %s, iters %d\n", a.op.c_str(), n,
                c.transport().name(), dtype_name(dt), redop, a.iters);
    if (a.stagger_us > 0)
      std::printf("# rank %d calls %g us after the others; time(us) and p50(us) are its median call\n", n - 1,
                  a.stagger_us);
    else
      std::printf("# time(us): mean per call; p50(us), max(us): median and slowest single call (slowest rank)\n");
    std::printf("# cost model (%s): %s\n", c.tuner().model().source.c_str(),
                coll::format_cost_model(c.tuner().model()).c_str());
    std::printf("%12s %12s %6s %8s %10s %10s %10s %10s %10s %7s  %s\n", "size(B)", "count", "type", "redop", "time(us)",
                "p50(us)", "max(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong", "algo");
  }
  size_t last_count = 0;  // sweep sizes that round to the same block give one row
  for (uint64_t bytes = lo; bytes <= hi; bytes *= 2) {
    size_t count = bytes / esz;
    if (per_rank_block) count = static_cast<size_t>(std::max(bytes / unit, first_blocks));
    if (count == last_count) continue;
    last_count = count;
    size_t in_elems = (a.op == "reduce_scatter" || a.op == "alltoall" || a.op == "scatter") ? count * n : count;
    // (allreduce and broadcast work in place: their output is never written)
    size_t out_elems = (a.op == "allgather" || a.op == "alltoall" || a.op == "gather") ? count * n
                       : (a.op == "allreduce" || a.op == "broadcast")                  ? 1
                                                                                       : count;
    std::vector<char> in(std::max<size_t>(in_elems, 1) * esz, 0), out(std::max<size_t>(out_elems, 1) * esz, 0);
    std::string algo_used;
    coll::Work last;
    double t = 0, t_median = 0, t_max = 0;
    if (a.stagger_us > 0) {
      // Each call as training meets it: the ranks leave a barrier together, the last rank computes for stagger_us
      // (busy, as a backward pass) while the others wait in the collective, and its time from the call to the end is
      // the sample: what a collective costs once its peers have given up spinning. The median call is reported (a
      // call that meets a preempted peer is not what a step pays typically).
      const bool late = c.rank() == n - 1;
      std::vector<double> calls;
      for (int i = 0; i < a.warmup + a.iters; ++i) {
        c.barrier().wait();
        if (late) {
          const Stopwatch busy;
          while (busy.seconds() * 1e6 < a.stagger_us) {
          }
        }
        const Stopwatch call;
        last = launch_op(c, a, dt, rop, count, in.data(), out.data(), o);
        last.wait();
        if (i >= a.warmup && late) calls.push_back(call.seconds());
      }
      if (late) {
        t_max = *std::max_element(calls.begin(), calls.end());
        t = t_median = median(std::move(calls));
      }
    } else {
      for (int i = 0; i < a.warmup; ++i) launch_op(c, a, dt, rop, count, in.data(), out.data(), o).wait();
      c.barrier().wait();
      // Nothing but the operation and one clock read in the timed loop (as the peers'); each iteration's time is
      // kept so that the median and the slowest show a single stall that decides the mean of a short run.
      std::vector<double> each(a.iters);
      Stopwatch sw;
      double prev = 0;
      for (int i = 0; i < a.iters; ++i) {
        last = launch_op(c, a, dt, rop, count, in.data(), out.data(), o);
        last.wait();
        const double now = sw.seconds();
        each[i] = now - prev;
        prev = now;
      }
      t = prev / a.iters;
      t_max = *std::max_element(each.begin(), each.end());
      t_median = median(std::move(each));
    }
    algo_used = last.algorithm();
    double slowest[3] = {t, t_median, t_max};  // each the largest over the ranks
    c.allreduce(slowest, 3, DType::f64, ReduceOp::max).wait();
    t = slowest[0];
    t_median = slowest[1];
    t_max = slowest[2];
    uint64_t wrong = 0;
    if (a.check) {
      // (the form timed: launch_op's reduce_scatter has equal blocks, verify's "reduce_scatter" too)
      coll::VerifyCase vc{a.op, a.algo, dt, rop, count, a.root, a.timeout, a.blocking};
      wrong = coll::run_and_verify(c, vc);
      c.allreduce(&wrong, 1, DType::i64, ReduceOp::sum).wait();
    }
    double size_bytes = static_cast<double>(per_rank_block ? count * n * esz : count * esz);
    double algbw = size_bytes / t / 1e9;
    double busbw = algbw * bus_factor(a.op, n);
    if (c.rank() == 0) {
      if (a.json) {
        nlohmann::json j{{"impl", "conduit"},
                         {"op", a.op},
                         {"algo", algo_used},
                         {"transport", c.transport().name()},
                         {"world", n},
                         {"dtype", dtype_name(dt)},
                         {"bytes", static_cast<uint64_t>(size_bytes)},
                         {"count", per_rank_block ? count * n : count},
                         {"iters", a.iters},
                         {"warmup", a.warmup},
                         // what else the run measured: a --reduce max or --async run was indistinguishable from the
                         // default in its record (calibrate and compare.py read these records)
                         {"blocking", a.blocking},
                         {"time_us", t * 1e6},
                         {"segment_bytes", coll::ring_segment_bytes()},  // (the chain's and ring's; calibrate)
                         {"median_us", t_median * 1e6},
                         {"max_us", t_max * 1e6},
                         {"algbw_gbs", algbw},
                         {"busbw_gbs", busbw},
                         {"wrong", a.check ? nlohmann::json(wrong) : nlohmann::json(nullptr)}};  // null: not checked
        if (a.stagger_us > 0) j["stagger_us"] = a.stagger_us;
        if (bench_coll_op_reduces(a.op)) j["reduce"] = reduce_op_name(rop);  // (where the operation has one)
        if (bench_coll_op_rooted(a.op)) j["root"] = a.root;
        std::cout << j.dump() << std::endl;
      } else {
        const std::string checked = a.check ? std::to_string(wrong) : "-";  // (--no-check read as 0 wrong)
        std::printf("%12.0f %12zu %6s %8s %10.2f %10.2f %10.2f %10.3f %10.3f %7s  %s\n", size_bytes,
                    per_rank_block ? count * n : count, dtype_name(dt), redop, t * 1e6, t_median * 1e6, t_max * 1e6,
                    algbw, busbw, checked.c_str(), algo_used.c_str());
        std::fflush(stdout);
      }
    }
    if (wrong) set_exit_code(1);
    if (bytes > hi / 2) break;
  }
}

struct SelftestArgs {
  std::string transport;
  double timeout = 0;
  int crash_rank = -1;
  int hang_rank = -1;
  std::string ops = "all";
};

// Every collective selftest checks and the algorithms it forces for each ("" is the tuner's choice: small
// allreduces over shm take the shared-memory fast path).
struct SelftestCase {
  std::string op;
  std::vector<std::string> algos;
};
const std::vector<SelftestCase>& selftest_cases() {
  static const std::vector<SelftestCase> cases = {{"allreduce", {"", "ring", "rhd", "rd", "tree", "hier"}},
                                                  {"reduce_scatter", {"ring", "rh"}},
                                                  {"reduce_scatterv", {"ring", "rh"}},
                                                  {"allgather", {"ring", "rd"}},
                                                  {"allgatherv", {"ring", "rd"}},
                                                  {"broadcast", {"tree", "chain"}},
                                                  {"reduce", {"tree", "rsg"}},
                                                  {"gather", {""}},
                                                  {"scatter", {""}},
                                                  {"alltoall", {""}},
                                                  {"alltoallv", {""}},
                                                  {"barrier", {""}},
                                                  {"sendrecv", {""}}};
  return cases;
}

void run_selftest(const SelftestArgs& a) {
  std::string allowed = "all";
  bool known = a.ops == "all";
  for (const auto& cs : selftest_cases()) {
    allowed += ", " + cs.op;
    known = known || a.ops == cs.op;
  }
  if (!known) throw ConfigError(fmt::format("--op '{}' is not supported: allowed are {}", a.ops, allowed));
  coll::CommConfig cfg;
  cfg.timeout_s = a.timeout;
  cfg.transport = a.transport;
  auto comm = Communicator::from_env(cfg);
  Communicator& c = *comm;
  for (auto [flag, r] : {std::pair{"--crash-rank", a.crash_rank}, std::pair{"--hang-rank", a.hang_rank}})
    if (r != -1 && (r < 0 || r >= c.size()))
      throw ConfigError(fmt::format("{} {} is not a rank of [0, {})", flag, r, c.size()));
  if (c.rank() == a.crash_rank) {
    std::fprintf(stderr, "selftest: rank %d exits abruptly as asked (--crash-rank)\n", c.rank());
    std::fflush(stderr);
    ::_exit(3);
  }
  if (c.rank() == a.hang_rank) {
    std::fprintf(stderr, "selftest: rank %d sleeps instead of taking part (--hang-rank)\n", c.rank());
    std::this_thread::sleep_for(std::chrono::duration<double>(c.timeout_s() + 1));
    return;
  }
  size_t ncases = 0, wrong = 0;
  for (const auto& cs : selftest_cases()) {
    if (a.ops != "all" && a.ops != cs.op) continue;
    for (auto& algo : cs.algos)
      for (DType t : {DType::f32, DType::bf16, DType::i64})
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{5003}, size_t{300001}}) {
          for (ReduceOp rop : {ReduceOp::sum, ReduceOp::max}) {
            coll::VerifyCase vc{cs.op, algo, t, rop, count, static_cast<int>(count % c.size()), a.timeout};
            size_t w = coll::run_and_verify(c, vc);
            if (w)
              std::fprintf(stderr, "selftest: rank %d: %s %s %s count %zu: %zu wrong\n", c.rank(), cs.op.c_str(),
                           algo.c_str(), dtype_name(t), count, w);
            wrong += w;
            ++ncases;
          }
        }
    // The reductions with the other dtypes and operations, over the real transport (f16's divide-first average,
    // integer averages and products, the narrow integer kernels: only the in-process tests ran them).
    if (cs.op == "allreduce" || cs.op == "reduce_scatter" || cs.op == "reduce_scatterv" || cs.op == "reduce")
      for (auto& algo : cs.algos)
        for (auto [t, rop] : {std::pair{DType::f16, ReduceOp::avg}, std::pair{DType::u8, ReduceOp::prod},
                              std::pair{DType::i8, ReduceOp::min}, std::pair{DType::i32, ReduceOp::avg},
                              std::pair{DType::f64, ReduceOp::avg}})
          for (size_t count : {size_t{7}, size_t{5003}}) {
            coll::VerifyCase vc{cs.op, algo, t, rop, count, static_cast<int>(count % c.size()), a.timeout};
            size_t w = coll::run_and_verify(c, vc);
            if (w)
              std::fprintf(stderr, "selftest: rank %d: %s %s %s %s count %zu: %zu wrong\n", c.rank(), cs.op.c_str(),
                           algo.c_str(), dtype_name(t), reduce_op_name(rop), count, w);
            wrong += w;
            ++ncases;
          }
  }
  uint64_t total = wrong;
  c.allreduce(&total, 1, DType::i64, ReduceOp::sum).wait();
  if (c.rank() == 0)
    std::printf("selftest: %zu cases on %d ranks over %s: %llu wrong elements\n", ncases, c.size(),
                c.transport().name(), static_cast<unsigned long long>(total));
  if (total) set_exit_code(1);
}

const bool kRegistered = register_command(30, [](CLI::App& app) {
  auto* bench = subcommand_group(app, "bench", "Benchmarks: collectives (coll), compression (compress), GEMMs (gemm)");
  auto a = std::make_shared<BenchArgs>();
  auto* c = bench->add_subcommand("coll", "nccl-tests-style sweep of a collective over message sizes");
  c->add_option("--op", a->op, "allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall, gather, scatter")
      ->capture_default_str();
  c->add_option("--algo", a->algo, "force an algorithm (default: the tuner's choice per size)");
  c->add_option("--transport", a->transport, "auto, tcp, shm, mpi (default: CONDUIT_TRANSPORT or auto)");
  c->add_option("--dtype", a->dtype, "f32, f64, f16, bf16, i8, u8, i32, i64")->capture_default_str();
  auto* reduce = c->add_option("--reduce", a->reduce, "sum, avg, min, max, prod (allreduce, reduce_scatter, reduce)")
                     ->capture_default_str();
  c->add_option("--min-bytes,-b", a->min_bytes, "smallest size (K/M/G suffixes)")->capture_default_str();
  c->add_option("--max-bytes,-e", a->max_bytes, "largest size (K/M/G suffixes)")->capture_default_str();
  c->add_option("--iters,-n", a->iters, "timed iterations per size")->capture_default_str();
  c->add_option("--warmup,-w", a->warmup, "untimed iterations per size")->capture_default_str();
  auto* root = c->add_option("--root", a->root, "root rank of broadcast/reduce/gather/scatter")->capture_default_str();
  auto* bt =
      c->add_option("--timeout", a->timeout, "seconds before a collective fails (default CONDUIT_TIMEOUT or 300)");
  c->add_flag("--json", a->json, "one JSON object per size instead of the table");
  c->add_flag("!--no-check", a->check, "skip the correctness check");
  c->add_flag("!--async", a->blocking,
              "start each operation on the communicator's worker thread and wait for it (default: blocking calls "
              "on the calling thread, as MPI_Allreduce)");
  c->add_option("--stagger-us", a->stagger_us,
                "time each call as training meets it: the last rank arrives this many microseconds after the others "
                "(busy meanwhile) and its median time from call to end is reported (default 0: back-to-back "
                "calls, their mean, with the median and slowest single call)");
  c->callback([a, bt, reduce, root] {
    check_timeout_flag(bt, a->timeout);
    // (taken and ignored, yet printed in the redop column: --op allgather --reduce prod)
    if (reduce->count() > 0 && !bench_coll_op_reduces(a->op) && is_bench_coll_op(a->op))
      throw ConfigError(
          fmt::format("--reduce {}: {} reduces nothing; allowed with --reduce: allreduce, "
                      "reduce_scatter, reduce",
                      a->reduce, a->op));
    if (root->count() > 0 && !bench_coll_op_rooted(a->op) && is_bench_coll_op(a->op))
      throw ConfigError(
          fmt::format("--root {}: {} has no root; allowed with --root: broadcast, reduce, gather, "
                      "scatter",
                      a->root, a->op));
    run_bench(*a);
  });

  auto s = std::make_shared<SelftestArgs>();
  auto* st = app.add_subcommand("selftest", "check every collective and algorithm over this job's ranks");
  st->add_option("--transport", s->transport, "auto, tcp, shm, mpi");
  auto* stt = st->add_option("--timeout", s->timeout, "seconds before a collective fails");
  st->add_option("--op", s->ops, "one operation, or all")->capture_default_str();
  st->add_option("--crash-rank", s->crash_rank, "(testing) this rank exits abruptly before the first collective");
  st->add_option("--hang-rank", s->hang_rank, "(testing) this rank never takes part");
  st->callback([s, stt] {
    check_timeout_flag(stt, s->timeout);
    run_selftest(*s);
  });
});

}  // namespace

// --timeout, when given, is a finite number of seconds from 0.001 (CONDUIT_TIMEOUT's least; 0 or nan used to mean the
// default silently, inf made --hang-rank's sleep return at once, and 0.0001 failed every rank at rendezvous).
void check_timeout_flag(const CLI::Option* opt, double v) {
  if (opt->count() > 0 && !(v >= 0.001 && v <= 1e6))
    throw ConfigError(fmt::format("--timeout = {} (allowed: seconds from 0.001 to 1000000)", v));
}

long long ranks_on_this_host() {
  if (auto v = env_int("LOCAL_WORLD_SIZE", 1, 1 << 20)) return *v;
  if (auto v = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1 << 20)) return *v;
  return 1;
}

}  // namespace conduit::cli
