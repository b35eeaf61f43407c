// `conduit sim ...`: the cluster simulator and planner (src/sim). Subcommands:
//   presets   list the embedded cluster presets, or --dump one as YAML
//   coll      cost of one collective on a cluster, every algorithm, symmetric or full-detail
//   step      one training iteration of a GPT model under DP x TP x PP (table or --json)
//   plan      search the parallel configurations, rank the ones that fit, explain the best
//   infer     prefill and decode latency/throughput of tensor/pipeline-parallel serving with a KV cache
//   cluster   a job-scheduling simulation (FIFO, least-attained-service) with topology-aware placement
//   calibrate this machine as a cluster file (bench coll lines; GEMMs from `conduit bench gemm` or timed here)
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "cli/cluster.h"
#include "cli/registry.h"
#include "core/clock.h"
#include "core/cpus.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "sim/calibrate.h"
#include "sim/cluster.h"
#include "sim/collective.h"
#include "sim/inference.h"
#include "sim/plan.h"
#include "sim/scheduler.h"
#include "sim/step.h"
#include "sim/units.h"
#include "sim/workload.h"
#ifdef CONDUIT_WITH_TORCH
#include "cli/kernel_samples.h"  // torch-free interface
#include "cli/torch_plugin.h"
#endif

namespace conduit::cli {
namespace {

// Model steps timed by several processes at once whose medians differ more than this (slowest over fastest) were
// not timed on a steady machine: 1.05-1.15x in steady rounds here, 2.3-6.8x when one process was slowed (glibc's
// adaptive malloc thresholds, before core/malloc_tuning.h).
constexpr double kSteadySpread = 1.5;

using namespace conduit::sim;
using nlohmann::json;

// A model flag left out (any value given is checked: 0 or -5 were taken as left out, and silently ignored).
inline constexpr long long kNotGiven = std::numeric_limits<long long>::min();

struct ModelArgs {
  std::string model = "gpt";
  std::string layers_spec;  // --model layers
  long long layers = kNotGiven;
  long long hidden = kNotGiven, heads = kNotGiven, seq = kNotGiven, vocab = kNotGiven;  // else 2048 / 51200
  long long kv_heads = kNotGiven;    // the named model's, else --heads
  long long ffn_hidden = kNotGiven;  // the named model's, else 4 x --hidden
  std::string mlp;                   // empty: the named model's, else gelu
};

struct StepArgs {
  std::string cluster = "dgx-a100";
  long long gpus = 8;
  bool gpus_given = false;  // else a cluster file that describes its size (nodes' count) gives it
  ModelArgs model;
  long long global_batch = 0;
  int micro_batch = 1;
  int tp = 1, pp = 1;
  long long dp = kNotGiven;  // (gpus / (tp pp) when left out; an explicit 0 was taken as that)
  int zero = 0;
  std::string recompute = "none";
  std::string attention_kernels = "fused";
  std::string schedule = "1f1b";
  int virtual_stages = 0;
  int first_stage_layers = -1, last_stage_layers = -1;  // (sim step: an uneven pipeline split; -1: not given)
  bool sp = false;
  bool no_overlap = false;
  bool no_zero_prefetch = false;
  bool balance = false;
  std::string bucket = "25M";
  std::string zero_allgather_bucket = "0";
  double grad_bytes = 2;
  double gather_bytes = 0;  // (0: left out, as held; given, `given` holds it and only 1, 2, 4 pass)
  std::string zero_hpz = "0";
  std::string zero_shard = "0";
  std::string zero_reduce;  // (empty: the model's default)
  std::string dp_algorithm = "auto", tp_algorithm = "auto";
  std::string compression = "none";
  std::string sync = "bsp";
  std::string mode = "symmetric";
  bool json = false;
  int top = 5;
  std::string tp_options, pp_options, mb_options, zero_options, recompute_options;
  // The options given on the command line: sim plan's (they fix that dimension) and step's --virtual-stages, ...
  std::set<std::string> given;
};

GptModel make_model(const ModelArgs& a) {
  if (a.model == "layers")
    throw ConfigError(fmt::format("--model layers (a list of layers) is for `sim step` only; allowed here: gpt, {}",
                                  join(named_gpt_names(), ", ")));
  if (!a.layers_spec.empty())
    throw ConfigError(fmt::format("--layers-spec describes --model layers (`sim step` only), not --model {}", a.model));
  GptModel m;
  m.name = a.model;
  bool named = named_gpt(a.model, m);
  if (!named && a.model != "gpt") {
    std::string names = "gpt, " + join(named_gpt_names(), ", ");
    throw ConfigError(
        fmt::format("--model = '{}' (allowed: {}; layers with --layers-spec for `sim step`)", a.model, names));
  }
  for (auto [flag, v] : {std::pair{"--layers", a.layers},
                         {"--hidden", a.hidden},
                         {"--heads", a.heads},
                         {"--seq", a.seq},
                         {"--vocab", a.vocab},
                         {"--kv-heads", a.kv_heads}})
    if (v != kNotGiven && v < 1)
      throw ConfigError(
          fmt::format("{} = {} (allowed: 1 or more, or left out{})", flag, v, named ? " for the named model's" : ""));
  if (a.ffn_hidden != kNotGiven && a.ffn_hidden < 0)
    throw ConfigError(fmt::format("--ffn-hidden = {} (allowed: 1 or more; 0 for 4 x --hidden)", a.ffn_hidden));
  if (!named) {
    if (a.layers == kNotGiven || a.hidden == kNotGiven || a.heads == kNotGiven)
      throw ConfigError("--model gpt needs --layers, --hidden and --heads (or a named --model such as gpt3-175b)");
    m.seq = 2048;
    m.vocab = 51200;
  }
  if (a.layers > std::numeric_limits<int>::max())
    throw ConfigError(fmt::format("--layers = {} (allowed: at most {})", a.layers, std::numeric_limits<int>::max()));
  if (a.layers != kNotGiven) m.layers = static_cast<int>(a.layers);
  if (a.hidden != kNotGiven) m.hidden = a.hidden;
  if (a.heads != kNotGiven) m.heads = a.heads;
  if (a.seq != kNotGiven) m.seq = a.seq;
  if (a.vocab != kNotGiven) m.vocab = a.vocab;
  if (a.kv_heads != kNotGiven) m.kv_heads = a.kv_heads;
  if (a.ffn_hidden != kNotGiven) m.ffn_hidden = a.ffn_hidden;
  if (!a.mlp.empty()) {
    if (a.mlp != "gelu" && a.mlp != "swiglu")
      throw ConfigError(fmt::format("--mlp = '{}' (allowed: gelu, swiglu)", a.mlp));
    m.gated_mlp = a.mlp == "swiglu";
  }
  m.validate();
  return m;
}

// The cluster's accelerators: --gpus when given, else the size the file describes (its nodes' counts), else --gpus's
// default (a file's `count: 140` was ignored for the default of 8, 64 or 512).
ClusterSpec load_sized(const std::string& cluster, long long& gpus, bool given) {
  ClusterSpec spec = load_cluster(cluster);
  if (!given && spec.described_gpus() > 0) {
    gpus = spec.described_gpus();
    // (the topology's refusal names --gpus, which was not given)
    if (gpus > kMaxSimulatedGpus)
      throw ConfigError(fmt::format(
          "cluster '{}': its nodes' counts describe {} accelerators, beyond the simulator's limit of {}; allowed: "
          "fewer nodes in the file, or --gpus",
          spec.name, gpus, kMaxSimulatedGpus));
  }
  return spec;
}

void add_model_flags(CLI::App* c, StepArgs& a) {
  c->add_option("--cluster", a.cluster, "preset (dgx-a100, dgx-h100, ethernet-25g, edge) or YAML file")
      ->capture_default_str();
  c->add_option("--gpus", a.gpus, "accelerators (default: the cluster file's nodes' count when it gives one)")
      ->capture_default_str()
      ->each([&a](const std::string&) { a.gpus_given = true; });
  c->add_option("--model", a.model.model,
                "gpt (give --layers/--hidden/--heads) or a named model: gpt2-small, gpt2-xl, "
                "gpt-1.7b, gpt-7.5b, gpt-18.4b, gpt-39b, gpt3-175b, gpt-530b, gpt-1t, llama2-7b-like, "
                "llama2-70b-like; or layers (sim step only: a list of layers, --layers-spec)")
      ->capture_default_str();
  c->add_option("--layers", a.model.layers, "transformer layers");
  c->add_option("--layers-spec", a.model.layers_spec,
                "with --model layers (sim step only): dense:INxOUT,conv:INxOUTkK@HxW,pool:CkK@HxW,... (an MLP or "
                "CNN, data parallel)");
  c->add_option("--hidden", a.model.hidden, "hidden size");
  c->add_option("--heads", a.model.heads, "attention heads");
  c->add_option("--kv-heads", a.model.kv_heads,
                "key/value heads: fewer than --heads (dividing it) is grouped-query attention (default: the named "
                "model's, else --heads)");
  c->add_option("--ffn-hidden", a.model.ffn_hidden,
                "the MLP's hidden width (default: the named model's, else 4 x --hidden; 0: 4 x --hidden)");
  c->add_option("--mlp", a.model.mlp,
                "gelu (two matrices) or swiglu (gated: three, Llama's) (default: the named model's, else gelu)");
  c->add_option("--seq", a.model.seq, "sequence length (default: the named model's, else 2048)");
  c->add_option("--vocab", a.model.vocab, "vocabulary size (default: the named model's, else 51200)");
}

// --zero-hpz, --zero-shard-group: node (-1: the node's data-parallel ranks) or a group size (0 or 1: `none`).
long long parse_zero3_group(const std::string& text, const char* flag, const char* none) {
  if (text == "node") return -1;
  long long k = -1;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), k);
  if (ec != std::errc() || end != text.data() + text.size() || k < 0)
    throw ConfigError(fmt::format(
        "{} = '{}' (allowed: node (the node's data-parallel ranks), 0 or 1 ({}), or a group size of 2 or more)", flag,
        text, none));
  return k;
}

ParallelConfig make_config(const StepArgs& a) {
  ParallelConfig c;
  c.tp = a.tp;
  c.pp = a.pp;
  if (a.dp != kNotGiven && a.dp <= 0)
    throw ConfigError(
        fmt::format("--dp = {} (allowed: a positive data-parallel size, or leave it out for gpus / (tp pp))", a.dp));
  c.dp = a.dp == kNotGiven ? 0 : a.dp;
  c.micro_batch = a.micro_batch;
  c.global_batch = a.global_batch;
  c.zero = a.zero;
  c.recompute = parse_recompute(a.recompute);
  c.schedule = parse_schedule(a.schedule);
  if (a.virtual_stages < 0 || (a.given.count("--virtual-stages") && a.virtual_stages < 1))
    throw ConfigError(fmt::format("--virtual-stages = {} must be positive (2 or more with --schedule interleaved)",
                                  a.virtual_stages));
  c.virtual_stages = a.virtual_stages > 0 ? a.virtual_stages : (c.schedule == Schedule::kInterleaved ? 2 : 1);
  for (auto [value, flag] :
       {std::pair{a.first_stage_layers, "--first-stage-layers"}, std::pair{a.last_stage_layers, "--last-stage-layers"}})
    if (a.given.count(flag) && value < 0)
      throw ConfigError(fmt::format("{} = {} (allowed: 0 or more transformer layers)", flag, value));
  c.first_stage_layers = a.given.count("--first-stage-layers") ? a.first_stage_layers : -1;
  c.last_stage_layers = a.given.count("--last-stage-layers") ? a.last_stage_layers : -1;
  c.sequence_parallel = a.sp;
  c.attention = parse_attention_kernels(a.attention_kernels);
  c.dp_overlap = !a.no_overlap;
  c.zero_prefetch = !a.no_zero_prefetch;
  c.balance = a.balance;
  c.bucket_bytes = static_cast<double>(parse_bytes(a.bucket, "--bucket"));
  if (c.bucket_bytes < 1024) throw ConfigError(fmt::format("--bucket = {} (allowed: 1K or more)", a.bucket));
  c.zero_allgather_bytes = static_cast<double>(parse_bytes(a.zero_allgather_bucket, "--zero-allgather-bucket"));
  c.grad_bytes = a.grad_bytes;
  if (c.grad_bytes != 2 && c.grad_bytes != 4)
    throw ConfigError(fmt::format("--grad-bytes = {} (allowed: 2, 4)", c.grad_bytes));
  // (an explicit 0 was taken as left out, which means as held)
  if (a.given.count("--gather-bytes") && a.gather_bytes != 1 && a.gather_bytes != 2 && a.gather_bytes != 4)
    throw ConfigError(fmt::format(
        "--gather-bytes = {:g} (allowed: 1 (int8 blocks with their scales), 2, 4, or leave it out: as held)",
        a.gather_bytes));
  c.gather_bytes = a.gather_bytes;
  c.zero_hpz = parse_zero3_group(a.zero_hpz, "--zero-hpz", "none");
  c.zero_shard = parse_zero3_group(a.zero_shard, "--zero-shard-group", "all ranks");
  if (a.given.count("--zero-reduce")) c.zero_reduce = parse_zero_reduce(a.zero_reduce);
  if (c.gather_bytes != 0 && c.gather_bytes != 1 && c.gather_bytes != 2 && c.gather_bytes != 4)
    throw ConfigError(
        fmt::format("--gather-bytes = {} (allowed: 1 (int8 blocks with their scales), 2, 4)", c.gather_bytes));
  c.dp_algorithm = parse_algorithm(a.dp_algorithm, "--dp-algorithm");
  c.tp_algorithm = parse_algorithm(a.tp_algorithm, "--tp-algorithm");
  c.compression = parse_compression(a.compression);
  c.sync = parse_sync(a.sync);
  if (a.mode == "symmetric")
    c.mode = EvalMode::kSymmetric;
  else if (a.mode == "full")
    c.mode = EvalMode::kFull;
  else
    throw ConfigError(fmt::format("--mode = '{}' (allowed: symmetric, full)", a.mode));
  return c;
}

// sim step: --no-zero-prefetch is about ZeRO's parameter gathers (sim plan searches stages and applies it to stages
// 1-3).
void check_step_config(const ParallelConfig& c) {
  if (c.gather_bytes != 0 && c.zero != 3)
    throw ConfigError(fmt::format(
        "--gather-bytes: the wire of ZeRO-3's parameter gathers, this step has --zero {}; allowed with --zero {}: "
        "leave it out",
        c.zero, c.zero));
  if ((c.zero_shard > 1 || c.zero_shard < 0) && (c.zero_hpz > 1 || c.zero_hpz < 0))
    throw ConfigError(
        "--zero-shard-group with --zero-hpz: the gathers run within the shard group already; allowed: one of them");
  if ((c.zero_shard > 1 || c.zero_shard < 0) && c.zero == 0)
    throw ConfigError(
        "--zero-shard-group: ZeRO's shard groups, this step has --zero 0; allowed with --zero 0: leave it out; or "
        "--zero 1, 2 or 3");
  if ((c.zero_hpz > 1 || c.zero_hpz < 0) && c.zero != 3)
    throw ConfigError(fmt::format(
        "--zero-hpz: a secondary partition of ZeRO-3's parameters, this step has --zero {}; allowed with --zero {}: "
        "leave it out",
        c.zero, c.zero));
  if (!c.zero_prefetch && c.zero == 0)
    throw ConfigError(
        "--no-zero-prefetch: ZeRO gathers the parameters (stages 1 and 2 after the step, stage 3 each layer's), "
        "this step has --zero 0, which keeps them whole on every rank; allowed with --zero 0: leave it out");
  if (c.zero_reduce != ZeroReduce::kModelDefault && c.zero < 2)
    throw ConfigError(fmt::format(
        "--zero-reduce: when ZeRO-2 or 3 reduce-scatters over several micro-batches, this step has --zero {}; "
        "allowed: --zero 2 or 3, or leave it out",
        c.zero));
  if (c.zero_allgather_bytes > 0 && (c.zero == 0 || c.zero == 3 || !c.zero_prefetch))
    throw ConfigError(fmt::format(
        "--zero-allgather-bucket: sizes the calls of ZeRO-1/2's allgather behind the next forward, this step has "
        "--zero {}{}; allowed: --zero 1 or 2 without --no-zero-prefetch, or leave it out",
        c.zero, c.zero_prefetch ? "" : " --no-zero-prefetch"));
}

json config_json(const ParallelConfig& c) {
  return json{{"dp", c.dp},
              {"tp", c.tp},
              {"pp", c.pp},
              {"micro_batch", c.micro_batch},
              {"global_batch", c.global_batch},
              {"zero", c.zero},
              {"zero_prefetch", c.zero_prefetch},
              {"gather_bytes", c.gather_bytes},
              {"zero_allgather_bytes", c.zero_allgather_bytes},
              {"zero_hpz", c.zero_hpz < 0 ? json("node") : json(c.zero_hpz)},
              {"zero_shard_group", c.zero_shard < 0 ? json("node") : json(c.zero_shard)},
              {"zero_reduce", c.zero >= 2 ? json(zero_reduce_name(c.zero_reduce)) : json(nullptr)},
              {"recompute", recompute_name(c.recompute)},
              {"schedule", schedule_name(c.schedule)},
              {"virtual_stages", c.virtual_stages},
              {"first_stage_layers", c.first_stage_layers >= 0 ? json(c.first_stage_layers) : json(nullptr)},
              {"last_stage_layers", c.last_stage_layers >= 0 ? json(c.last_stage_layers) : json(nullptr)},
              {"sequence_parallel", c.sequence_parallel},
              {"attention_kernels", attention_kernels_name(c.attention)},
              {"compression", c.compression.kind},
              {"compression_param", c.compression.param},
              {"sync", c.sync.kind},
              {"sync_period", c.sync.period}};
}

json step_json(const std::string& cluster, const GptModel& m, const StepResult& r) {
  const StepBreakdown& b = r.breakdown;
  const StageLayers& split = r.stage_layers;
  // (a middle stage's figures, null where there is none: p = 2)
  auto middle = [&](auto value) { return r.config.pp > 2 ? json(value) : json(nullptr); };
  return json{{"kind", "sim.step"},
              {"cluster", cluster},
              {"gpus", r.gpus},
              {"model",
               {{"name", m.name},
                {"layers", m.layers},
                {"hidden", m.hidden},
                {"heads", m.heads},
                {"seq", m.seq},
                {"vocab", m.vocab},
                {"parameters", gpt_parameters(m)}}},
              {"config", config_json(r.config)},
              {"microbatches", r.microbatches},
              {"time_s", r.time},
              {"model_tflops_per_gpu", r.model_tflops_per_gpu},
              {"hardware_tflops_per_gpu", r.hardware_tflops_per_gpu},
              {"mfu", r.mfu},
              {"memory_gb",
               {{"params", r.memory.params / 1e9},
                {"grads", r.memory.grads / 1e9},
                {"optimizer", r.memory.optimizer / 1e9},
                {"activations", r.memory.activations / 1e9},
                {"total", r.memory.total() / 1e9},
                {"capacity", r.memory_capacity / 1e9}}},
              {"fits", r.fits},
              {"breakdown_s",
               {{"compute", b.compute - b.recompute},
                {"recompute", b.recompute},
                {"bubble", b.bubble},
                {"tp_comm", b.tp_comm},
                {"pp_comm", b.pp_comm},
                {"embedding_sync", b.embedding_sync},
                {"dp_comm_total", b.dp_comm},
                {"dp_exposed", b.dp_exposed},
                {"zero3_exposed", b.zero3_exposed},
                {"compression", b.compression},
                {"overlap_slowdown", b.overlap_slowdown},
                {"optimizer", b.optimizer}}},
              {"stage_layers", r.config.pp > 1 ? json{{"first", split.first},
                                                      {"middle", middle(split.middle)},
                                                      {"last", split.last},
                                                      {"uneven", split.uneven}}
                                               : json(nullptr)},
              {"stage_per_micro_batch_s", r.config.pp > 1 ? json{{"first", b.stage_first},
                                                                 {"middle", middle(b.stage_middle)},
                                                                 {"last", b.stage_last},
                                                                 {"first_forward", b.stage_first_forward},
                                                                 {"middle_forward", middle(b.stage_middle_forward)},
                                                                 {"last_forward", b.stage_last_forward}}
                                                          : json(nullptr)},
              {"dp_algorithm", r.dp_algorithm},
              {"tp_algorithm", r.tp_algorithm},
              {"notes", r.notes}};
}

void print_step(const std::string& cluster, const GptModel& m, const StepResult& r) {
  const StepBreakdown& b = r.breakdown;
  fmt::print("cluster {}  gpus {}  model {} ({:.2f}B params: l={} h={} a={} s={} V={})\n", cluster, r.gpus, m.name,
             gpt_parameters(m) / 1e9, m.layers, m.hidden, m.heads, m.seq, m.vocab);
  fmt::print("config  {}  micro-batches {}\n\n", describe_config(r.config), r.microbatches);
  fmt::print("  time per iteration        {}\n", format_seconds(r.time));
  fmt::print("  model TFLOP/s per GPU     {:.1f}  (MFU {:.1f}%)\n", r.model_tflops_per_gpu, 100 * r.mfu);
  fmt::print("  hardware TFLOP/s per GPU  {:.1f}  (with recompute; Megatron's reporting)\n", r.hardware_tflops_per_gpu);
  fmt::print("  memory per GPU            {} of {}{}\n", format_gb(r.memory.total()), format_gb(r.memory_capacity),
             r.fits ? "" : "  DOES NOT FIT");
  fmt::print("    params {}  grads {}  optimizer {}  activations {}\n\n", format_gb(r.memory.params),
             format_gb(r.memory.grads), format_gb(r.memory.optimizer), format_gb(r.memory.activations));
  fmt::print("  {:<32} {:>12} {:>8}\n", "breakdown", "time", "share");
  auto row = [&](const char* name, double v) {
    fmt::print("  {:<32} {:>12} {:>7.1f}%\n", name, format_seconds(v), 100 * v / r.time);
  };
  row("compute", b.compute - b.recompute);
  row("recompute", b.recompute);
  row("pipeline bubble", b.bubble);
  row("tensor-parallel comm (exposed)", b.tp_comm);
  row("pipeline p2p (exposed)", b.pp_comm);
  row("tied embeddings (exposed)", b.embedding_sync);
  row("data-parallel comm (exposed)", b.dp_exposed);
  if (b.compression > 0) row("  of which compression", b.compression);  // (a part of the row above)
  row("ZeRO-3 gathers (exposed)", b.zero3_exposed);
  row("compute slowed by overlap", b.overlap_slowdown);
  row("optimizer step", b.optimizer);
  fmt::print("  {:<32} {:>12}\n", "data-parallel comm (total)", format_seconds(b.dp_comm));
  if (r.config.pp > 1)
    fmt::print("  a micro-batch's stage (forward, backward, its collectives and transfers): first {}{}, last {}\n",
               format_seconds(b.stage_first),
               r.config.pp > 2 ? fmt::format(", middle {}", format_seconds(b.stage_middle)) : std::string(),
               format_seconds(b.stage_last));
  if (!r.notes.empty()) {
    fmt::print("\n");
    for (const auto& n : r.notes) fmt::print("  - {}\n", n);
  }
}

// given: the flag was on the command line (an empty list given is refused: it searched everything).
std::vector<int> parse_int_list(const std::string& s, const char* flag, bool given = false) {
  std::vector<int> out;
  if (s.empty() && given)
    throw ConfigError(fmt::format(
        "{} = '': an empty list (allowed: a comma-separated list of integers from 1 to 1048576, or leave it out)",
        flag));
  if (s.empty()) return out;
  for (const auto& p : split(s, ',')) {
    const std::string item = trim(p);
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != 0 || errno != 0 || v < 1 || v > 1 << 20)
      throw ConfigError(
          fmt::format("{} = '{}' (allowed: a comma-separated list of integers from 1 to 1048576)", flag, s));
    if (std::find(out.begin(), out.end(), static_cast<int>(v)) != out.end())
      throw ConfigError(fmt::format("{} = '{}' lists {} twice (allowed: each value once)", flag, s, v));
    out.push_back(static_cast<int>(v));
  }
  return out;
}

// --bucket given where dp = 1 (the flags a ParallelConfig holds are checked by the step itself; this one's default
// cannot be told from a given value there).
void check_bucket_given(const StepArgs& a, long long dp) {
  if (a.given.count("--bucket") && a.sync.rfind("local-sgd", 0) == 0)
    throw ConfigError(fmt::format(
        "--bucket {} with --sync local-sgd: local SGD averages all the parameters in one call, not in buckets; "
        "allowed with local-sgd: leave it out",
        a.bucket));
  if (a.given.count("--bucket") && dp == 1)
    throw ConfigError(fmt::format(
        "--bucket {}: sizes the data-parallel exchange's calls, which dp = 1 does not have; allowed with dp = 1: "
        "leave it out",
        a.bucket));
}

void run_layer_step(const StepArgs& given_args) {
  StepArgs a = given_args;
  // (a layer list has no transformer's shape: those flags did nothing)
  for (const auto& [flag, v] : std::vector<std::pair<const char*, long long>>{{"--layers", a.model.layers},
                                                                              {"--hidden", a.model.hidden},
                                                                              {"--heads", a.model.heads},
                                                                              {"--kv-heads", a.model.kv_heads},
                                                                              {"--ffn-hidden", a.model.ffn_hidden},
                                                                              {"--seq", a.model.seq},
                                                                              {"--vocab", a.model.vocab}})
    if (v != kNotGiven)
      throw ConfigError(fmt::format(
          "{}: a transformer's shape, and --model layers takes its layers from --layers-spec; allowed: leave it out",
          flag));
  if (!a.model.mlp.empty())
    throw ConfigError(
        "--mlp: a transformer's MLP, and --model layers takes its layers from --layers-spec; allowed: leave it out");
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  LayerModel lm = parse_layer_model(a.model.layers_spec);
  if (a.global_batch <= 0)
    throw ConfigError(fmt::format("--global-batch = {} (allowed: a positive number of samples)", a.global_batch));
  ParallelConfig c = make_config(a);
  check_step_config(c);
  Topology topo(spec, a.gpus);
  CollectiveModel net(topo);
  StepResult r = simulate_layer_step(net, lm, c);
  check_bucket_given(a, r.config.dp);
  const StepBreakdown& b = r.breakdown;
  if (a.json) {
    std::cout << json{{"kind", "sim.step"},
                      {"cluster", spec.name},
                      {"gpus", r.gpus},
                      {"model", {{"name", "layers"}, {"spec", a.model.layers_spec}, {"parameters", lm.params()}}},
                      {"config", config_json(r.config)},
                      {"time_s", r.time},
                      {"model_tflops_per_gpu", r.model_tflops_per_gpu},
                      {"mfu", r.mfu},
                      {"memory_gb", {{"total", r.memory.total() / 1e9}, {"activations", r.memory.activations / 1e9}}},
                      {"fits", r.fits},
                      {"breakdown_s",
                       {{"compute", b.compute},
                        {"framework", b.framework},
                        {"dp_comm_total", b.dp_comm},
                        {"dp_exposed", b.dp_exposed},
                        {"zero3_exposed", b.zero3_exposed},
                        {"bubble", b.bubble},
                        {"pp_comm", b.pp_comm},
                        {"rank_wait", b.rank_wait},
                        {"compression", b.compression},
                        {"overlap_slowdown", b.overlap_slowdown},
                        {"optimizer", b.optimizer}}},
                      {"dp_algorithm", r.dp_algorithm},
                      {"notes", r.notes}}
                     .dump()
              << "\n";
    return;
  }
  fmt::print("cluster {}  gpus {}  layer model ({:.1f}M params, {} layers)  global batch {}  micro-batch {}\n\n",
             spec.name, r.gpus, lm.params() / 1e6, lm.layers.size(), c.global_batch, c.micro_batch);
  fmt::print("  time per iteration        {}\n", format_seconds(r.time));
  fmt::print("  TFLOP/s per GPU           {:.2f}  (MFU {:.1f}%)\n", r.model_tflops_per_gpu, 100 * r.mfu);
  fmt::print("  memory per GPU            {} of {}\n", format_gb(r.memory.total()), format_gb(r.memory_capacity));
  fmt::print("  compute {}  data-parallel exposed {} (total {})  optimizer {}\n", format_seconds(b.compute),
             format_seconds(b.dp_exposed + b.zero3_exposed), format_seconds(b.dp_comm), format_seconds(b.optimizer));
  if (b.overlap_slowdown > 0)
    fmt::print("  compute slowed by the collectives it overlaps {}\n", format_seconds(b.overlap_slowdown));
  if (c.pp > 1)
    fmt::print("  pipeline bubble {} (the busiest stage idle; its transfers {})\n", format_seconds(b.bubble),
               format_seconds(b.pp_comm));
  if (b.framework != 0 || b.rank_wait != 0)
    fmt::print(
        "  of which framework time beyond the kernels {}{} (measured model step), wait for the slowest rank {}\n",
        b.framework < 0 ? "-" : "", format_seconds(std::abs(b.framework)), format_seconds(b.rank_wait));
  for (const auto& n : r.notes) fmt::print("  - {}\n", n);
}

void run_step(const StepArgs& given_args) {
  if (given_args.model.model == "layers") {
    run_layer_step(given_args);
    return;
  }
  StepArgs a = given_args;
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  GptModel m = make_model(a.model);
  if (a.global_batch <= 0)
    throw ConfigError(fmt::format("--global-batch = {} (allowed: a positive number of sequences)", a.global_batch));
  ParallelConfig c = make_config(a);
  check_step_config(c);
  if (c.gather_bytes == 4)
    throw ConfigError(
        "--gather-bytes 4: a GPT model holds 16-bit parameters and gathers them so; allowed: 1 (int8 blocks, ZeRO++'s "
        "qwZ), 2, or leave it out");
  Topology topo(spec, a.gpus);
  CollectiveModel net(topo);
  Stopwatch sw;
  StepResult r = simulate_step(net, m, c);
  double took = sw.seconds();
  check_bucket_given(a, r.config.dp);
  if (a.json) {
    json j = step_json(spec.name, m, r);
    j["simulation_wall_s"] = took;
    std::cout << j.dump() << "\n";
  } else {
    print_step(spec.name, m, r);
    fmt::print("\n  (simulated in {})\n", format_seconds(took));
  }
}

// Full-detail mode simulates every flow of every candidate: 256 accelerators took 7.6 s for ~5,000 candidates here.
constexpr long long kMaxFullPlanGpus = 256;
bool cfg_full_too_large(const ParallelConfig& c, long long gpus) {
  return c.mode == EvalMode::kFull && gpus > kMaxFullPlanGpus;
}

void run_plan(const StepArgs& given_args) {
  StepArgs a = given_args;
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  GptModel m = make_model(a.model);
  if (a.global_batch <= 0)
    throw ConfigError(fmt::format("--global-batch = {} (allowed: a positive number of sequences)", a.global_batch));
  ParallelConfig base = make_config(a);
  if (base.gather_bytes == 4)
    throw ConfigError(
        "--gather-bytes 4: the planner's GPT models hold 16-bit parameters and gather them so; allowed: 1 (int8 "
        "blocks, ZeRO++'s qwZ, for the ZeRO-3 plans), 2, or leave it out");
  Topology topo(spec, a.gpus);
  CollectiveModel net(topo);
  PlanSpace space;
  space.base = base;
  space.tp = parse_int_list(a.tp_options, "--tp-options", a.given.count("--tp-options") > 0);
  space.pp = parse_int_list(a.pp_options, "--pp-options", a.given.count("--pp-options") > 0);
  space.micro_batch = parse_int_list(a.mb_options, "--micro-batch-options", a.given.count("--micro-batch-options") > 0);
  for (const char* f : {"--zero-options", "--recompute-options"})
    if (a.given.count(f) && (std::string(f) == "--zero-options" ? a.zero_options : a.recompute_options).empty())
      throw ConfigError(fmt::format("{} = '': an empty list (allowed: a comma-separated list of {}, or leave it out)",
                                    f, std::string(f) == "--zero-options" ? "0, 1, 2, 3" : "none, selective, full"));
  if (!a.zero_options.empty()) {
    space.zero.clear();
    for (const auto& z : split(a.zero_options, ',')) {
      std::string t = trim(z);
      if (t != "0" && t != "1" && t != "2" && t != "3")
        throw ConfigError(fmt::format("--zero-options = '{}': a comma-separated list of 0, 1, 2, 3", a.zero_options));
      if (std::find(space.zero.begin(), space.zero.end(), t[0] - '0') != space.zero.end())
        throw ConfigError(
            fmt::format("--zero-options = '{}' lists {} twice (allowed: each value once)", a.zero_options, t));
      space.zero.push_back(t[0] - '0');
    }
  }
  if (!a.recompute_options.empty()) {
    space.recompute.clear();
    for (const auto& r : split(a.recompute_options, ',')) {
      Recompute rc;
      try {
        rc = parse_recompute(trim(r));
      } catch (const ConfigError&) {  // (it named --recompute)
        throw ConfigError(
            fmt::format("--recompute-options = '{}' (allowed: a comma-separated list of none, "
                        "selective, full)",
                        a.recompute_options));
      }
      if (std::find(space.recompute.begin(), space.recompute.end(), rc) != space.recompute.end())
        throw ConfigError(fmt::format("--recompute-options = '{}' lists {} twice (allowed: each value once)",
                                      a.recompute_options, trim(r)));
      // (with FlashAttention each selective candidate was skipped: a list naming it came back without it)
      if (rc == Recompute::kSelective && scores_on_chip(space.base.attention))
        throw ConfigError(fmt::format(
            "--recompute-options = '{0}' lists selective, which recomputes the attention scores --attention-kernels "
            "{1} never stores; allowed with {1}: none, full",
            a.recompute_options, attention_kernels_name(space.base.attention)));
      space.recompute.push_back(rc);
    }
  }
  if (a.compression != "none") space.compression = {Compression{}, parse_compression(a.compression)};
  // A dimension given as a plain option is fixed for the search (--tp 8: only tp = 8).
  auto fix = [&](const char* flag, const std::string& options, const char* options_flag) {
    if (!a.given.count(flag)) return false;
    if (!options.empty()) throw ConfigError(fmt::format("give {} or {}, not both", flag, options_flag));
    return true;
  };
  if (a.given.count("--dp"))
    throw ConfigError("sim plan takes dp = gpus / (tp x pp); fix --tp and --pp (or their -options) instead of --dp");
  if (fix("--tp", a.tp_options, "--tp-options")) space.tp = {a.tp};
  if (fix("--pp", a.pp_options, "--pp-options")) space.pp = {a.pp};
  if (fix("--micro-batch", a.mb_options, "--micro-batch-options")) space.micro_batch = {a.micro_batch};
  if (fix("--zero", a.zero_options, "--zero-options")) space.zero = {a.zero};
  if (fix("--recompute", a.recompute_options, "--recompute-options")) space.recompute = {base.recompute};
  if (a.given.count("--schedule")) space.schedules = {base.schedule};
  if (a.given.count("--virtual-stages")) {
    if (base.schedule != Schedule::kInterleaved || !a.given.count("--schedule"))
      throw ConfigError("--virtual-stages needs --schedule interleaved");
    if (base.virtual_stages < 2)
      throw ConfigError(
          fmt::format("--virtual-stages = {} (allowed with --schedule interleaved: 2 or more)", base.virtual_stages));
    space.virtual_stages = {base.virtual_stages};
  }
  // Settings of one ZeRO stage's gathers need that stage among the searched ones (else they did nothing).
  auto searched = [&](std::initializer_list<int> stages) {
    for (int z : space.zero)
      for (int s : stages)
        if (z == s) return true;
    return false;
  };
  if ((base.gather_bytes != 0 || base.zero_hpz > 1 || base.zero_hpz < 0) && !searched({3}))
    throw ConfigError(fmt::format(
        "{}: about ZeRO-3's gathers, and this search has no ZeRO-3 plans; allowed: --zero-options with 3, or leave "
        "it out",
        base.gather_bytes != 0 ? "--gather-bytes" : "--zero-hpz"));
  if ((base.zero_shard > 1 || base.zero_shard < 0) && !searched({1, 2, 3}))
    throw ConfigError(
        "--zero-shard-group: about ZeRO's shards, and this search has no ZeRO plans; allowed: --zero-options with 1, "
        "2 or 3, or leave it out");
  if (base.zero_reduce != ZeroReduce::kModelDefault && !searched({2, 3}))
    throw ConfigError(
        "--zero-reduce: about ZeRO-2's and 3's reduce-scatters, and this search has no ZeRO-2 or 3 plans; allowed: "
        "--zero-options with 2 or 3, or leave it out");
  if (base.zero_allgather_bytes > 0 && !searched({1, 2}))
    throw ConfigError(
        "--zero-allgather-bucket: the calls of ZeRO-1/2's allgather, and this search has no ZeRO-1 or 2 plans; "
        "allowed: --zero-options with 1 or 2, or leave it out");
  // (as sim step refuses them: the planner took them and did nothing, or dropped every plan they conflict on)
  if (!base.zero_prefetch && !searched({1, 2, 3}))
    throw ConfigError(
        "--no-zero-prefetch: about ZeRO's parameter gathers, and this search has no ZeRO plans; allowed: "
        "--zero-options with 1, 2 or 3, or leave it out");
  if (base.zero_allgather_bytes > 0 && !base.zero_prefetch)
    throw ConfigError(
        "--zero-allgather-bucket with --no-zero-prefetch: it sizes the calls of the allgather behind the next "
        "forward, which --no-zero-prefetch runs after the step instead; allowed: one of them");
  if ((base.zero_shard > 1 || base.zero_shard < 0) && (base.zero_hpz > 1 || base.zero_hpz < 0))
    throw ConfigError(
        "--zero-shard-group with --zero-hpz: the gathers run within the shard group already; allowed: one of them");
  // (a compression no plan can take: the search kept only the uncompressed plans, exit 0)
  const Compression cp = space.compression.empty() ? Compression{} : space.compression.back();
  check_local_sgd_compression(base.sync, cp);
  // (the conflicts, refused as sim step does: refused per candidate, local SGD's left only the dp = 1 plans)
  if ((base.sync.kind == "async" || base.sync.kind == "local-sgd") && !base.dp_overlap)
    check_data_parallel_flags(base, 2);
  if (cp.kind == "int4" && !searched({1, 2, 3}))
    throw ConfigError(
        "--compression int4 is ZeRO's reduce-scatter wire (qgZ), and this search has no ZeRO plans; allowed: "
        "--zero-options with 1, 2 or 3, or another compression");
  if (cp.kind == "topk" || cp.kind == "powersgd") {
    if (!searched({0}))
      throw ConfigError(fmt::format(
          "--compression {}: it compresses the gradients' allreduce, which ZeRO replaces with its reduce-scatter, "
          "and this search has only ZeRO plans; allowed: --zero-options with 0, or none, fp16, int8, int4",
          a.compression));
    const int least_tp = space.tp.empty() ? 1 : *std::min_element(space.tp.begin(), space.tp.end());
    if (cp.kind == "powersgd" && cp.param > static_cast<double>(m.hidden / least_tp))
      throw ConfigError(fmt::format(
          "--compression {}: the rank exceeds the smallest weight matrix side of every searched plan (hidden / tp "
          "= {}); allowed: a rank up to it",
          a.compression, m.hidden / least_tp));
  }
  if (a.given.count("--sp") && !a.sp) {
    space.sequence_parallel = {false};  // (--sp=false: none of the plans uses it; it forced it on every plan)
  } else if (a.given.count("--sp")) {
    // Fixed: every plan uses it, so tp = 1 (where the planner would drop it) is out of the search.
    if (!space.tp.empty() && std::all_of(space.tp.begin(), space.tp.end(), [](int t) { return t == 1; }))
      throw ConfigError("--sp (sequence parallelism) needs --tp > 1: it splits the tensor-parallel activations");
    space.sequence_parallel = {true};
    space.sp_required = true;
  }
  for (int t : space.tp)
    if (t < 1) throw ConfigError(fmt::format("--tp = {} must be at least 1", t));
  for (int p : space.pp)
    if (p < 1) throw ConfigError(fmt::format("--pp = {} must be at least 1", p));
  for (int b : space.micro_batch)
    if (b < 1) throw ConfigError(fmt::format("--micro-batch = {} must be at least 1", b));
  for (int z : space.zero)
    if (z < 0 || z > 3) throw ConfigError(fmt::format("--zero = {} (allowed: 0, 1, 2, 3)", z));
  if (cfg_full_too_large(base, a.gpus))
    throw ConfigError(fmt::format(
        "sim plan --mode full is limited to {} accelerators (every candidate simulates every flow); search in "
        "symmetric mode and check the best plans with `sim step --mode full`",
        kMaxFullPlanGpus));
  if (a.top < 1) throw ConfigError(fmt::format("--top = {} (allowed: 1 or more plans)", a.top));
  // One plan more than shown, so the last one shown is compared with the plan after it.
  PlanResult pr = plan(net, m, a.global_batch, space, static_cast<size_t>(a.top) + 1);
  // No candidate valid at all is an input the search cannot meet (fixed settings that contradict each other or the
  // cluster), refused as sim step refuses it; a search whose valid plans do not fit in memory is a result (exit 1).
  if (pr.valid == 0 && pr.untimeable > 0)
    throw ConfigError(
        fmt::format("sim plan: no candidate full-detail mode can time ({} valid ones it cannot, e.g. {}); "
                    "allowed: --mode symmetric",
                    pr.untimeable, pr.first_untimeable));
  if (pr.valid == 0)
    throw ConfigError(fmt::format(
        "sim plan: no candidate is valid{}{}", pr.first_error.empty() ? "" : "; the first tried: " + pr.first_error,
        pr.first_error.find("allowed:") != std::string::npos
            ? ""
            : "; allowed: --gpus, --global-batch, fixed settings and the model's sizes with common divisors"));
  const size_t shown = std::min(pr.ranked.size(), static_cast<size_t>(a.top));
  if (a.json) {
    json plans = json::array();
    for (size_t i = 0; i < shown; ++i) {
      json j = step_json(spec.name, m, pr.ranked[i]);
      j["rank"] = i + 1;
      j["explanation"] = explain_plan(pr.ranked[i], i + 1 < pr.ranked.size() ? &pr.ranked[i + 1] : nullptr);
      plans.push_back(j);
    }
    json out{{"kind", "sim.plan"},
             {"cluster", spec.name},
             {"gpus", a.gpus},
             {"candidates", pr.candidates},
             {"valid", pr.valid},
             {"fitting", pr.fitting},
             {"resplit", pr.resplit},
             {"refit", pr.refit},
             {"search_s", pr.seconds},
             {"candidates_per_s", pr.candidates / std::max(pr.seconds, 1e-9)},
             {"untimeable", pr.untimeable},
             {"plans", plans}};
    // With no plan, the reason too and exit code 1, as the text output (it printed an empty list and exited 0).
    if (pr.ranked.empty()) {
      out["reason"] = fmt::format("no plan fits in memory; the nearest needs {} per GPU of {}: {}",
                                  format_gb(pr.best_oom.memory.total()), format_gb(pr.best_oom.memory_capacity),
                                  describe_config(pr.best_oom.config));
      set_exit_code(1);
    }
    std::cout << out.dump() << "\n";
    return;
  }
  fmt::print("cluster {}  gpus {}  model {} ({:.2f}B params)  global batch {}\n", spec.name, a.gpus, m.name,
             gpt_parameters(m) / 1e9, a.global_batch);
  fmt::print("searched {} candidates ({} valid, {} fit in memory{}{}) in {} ({:.0f} candidates/s)\n", pr.candidates,
             pr.valid, pr.fitting,
             pr.resplit > 0 ? fmt::format("; {} pipeline(s) split otherwise, faster", pr.resplit) : std::string(),
             pr.refit > 0 ? fmt::format("; {} pipeline(s) that fit only split otherwise", pr.refit) : std::string(),
             format_seconds(pr.seconds), pr.candidates / std::max(pr.seconds, 1e-9));
  if (pr.untimeable > 0)
    fmt::print("left out: {} valid candidate(s) full-detail mode cannot time (e.g. {}); --mode symmetric times them\n",
               pr.untimeable, pr.first_untimeable);
  fmt::print("\n");
  if (pr.ranked.empty()) {
    fmt::print("no plan fits in memory; the nearest needs {} per GPU of {}: {}\n",
               format_gb(pr.best_oom.memory.total()), format_gb(pr.best_oom.memory_capacity),
               describe_config(pr.best_oom.config));
    set_exit_code(1);
    return;
  }
  // Plans whose time symmetric mode could only approximate (groups sharing links unevenly) are marked.
  fmt::print("  {:>4} {:>10} {:>8} {:>6} {:>9}  {}\n", "rank", "time", "TFLOP/s", "MFU", "memory", "plan");
  bool marked = false;
  for (size_t i = 0; i < shown; ++i) {
    const auto& r = pr.ranked[i];
    const bool approx = r.approximate;
    marked |= approx;
    fmt::print("  {:>4} {:>10} {:>8.1f} {:>5.1f}% {:>9}  {}{}\n", i + 1, format_seconds(r.time), r.model_tflops_per_gpu,
               100 * r.mfu, format_gb(r.memory.total()), describe_config(r.config), approx ? "  *" : "");
  }
  if (marked) fmt::print("  * approximate time: see the plan's note (explained below for the first three)\n");
  size_t explain_n = std::min<size_t>(3, shown);
  for (size_t i = 0; i < explain_n; ++i) {
    fmt::print("\n#{} {}\n", i + 1, describe_config(pr.ranked[i].config));
    for (const auto& line : explain_plan(pr.ranked[i], i + 1 < pr.ranked.size() ? &pr.ranked[i + 1] : nullptr))
      fmt::print("  - {}\n", line);
    for (const auto& n : pr.ranked[i].notes)
      if (n.rfind("approximate:", 0) == 0) fmt::print("  - {}\n", n);
  }
}

struct CollArgs {
  std::string cluster = "dgx-a100";
  long long gpus = 64;
  bool gpus_given = false;
  std::string op = "allreduce";
  std::string algorithm = "all";
  std::string size = "256M";
  long long group = kNotGiven, stride = 1;  // (group: all ranks when left out; an explicit 0 was taken as that)
  std::string mode = "symmetric";
  bool json = false;
  bool steps = false;
};

void run_coll(const CollArgs& given_args) {
  CollArgs a = given_args;
  if (a.steps && a.json)  // (dropped without a word)
    throw ConfigError("--steps shows the table's steps, which --json does not write; allowed: one of them");
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  Topology topo(spec, a.gpus);
  CollectiveModel net(topo);
  Collective c;
  if (a.op == "allreduce")
    c = Collective::kAllReduce;
  else if (a.op == "reduce-scatter")
    c = Collective::kReduceScatter;
  else if (a.op == "allgather")
    c = Collective::kAllGather;
  else if (a.op == "broadcast")
    c = Collective::kBroadcast;
  else if (a.op == "reduce")
    c = Collective::kReduce;
  else if (a.op == "all-to-all")
    c = Collective::kAllToAll;
  else
    throw ConfigError(fmt::format(
        "--op = '{}' (allowed: allreduce, reduce-scatter, allgather, broadcast, reduce, all-to-all)", a.op));
  if (a.mode != "symmetric" && a.mode != "full")
    throw ConfigError(fmt::format("--mode = '{}' (allowed: symmetric, full)", a.mode));
  const double n = static_cast<double>(parse_bytes(a.size, "--size"));
  if (n <= 0) throw ConfigError("--size must be positive (e.g. 64M)");
  Group g{a.group != kNotGiven ? a.group : a.gpus, a.stride, 0};
  // (group - 1) x stride < gpus, without overflowing: group <= gpus and stride < gpus first.
  if ((a.group != kNotGiven && a.group < 0) || a.stride < 1 || g.size > a.gpus ||
      (g.size > 1 && (a.stride >= a.gpus || g.size - 1 > (a.gpus - 1) / g.stride)))
    throw ConfigError(
        fmt::format("--group ({}) and --stride ({}) must place the group's ranks within --gpus ({}): "
                    "group >= 2, stride >= 1, (group - 1) x stride < gpus",
                    g.size, g.stride, a.gpus));
  if (g.size < 2)
    throw ConfigError(a.group != kNotGiven
                          ? fmt::format("--group = {}: a collective needs at least 2 ranks", g.size)
                          : fmt::format("--gpus = {}: a collective needs at least 2 ranks (the group is every "
                                        "accelerator unless --group says otherwise)",
                                        a.gpus));
  std::vector<Algorithm> algs;
  if (a.algorithm == "all") {
    algs = candidate_algorithms(c, topo);
  } else {
    try {
      algs = {parse_algorithm(a.algorithm)};
    } catch (const ConfigError&) {  // (its list left out `all`, this command's default)
      throw ConfigError(fmt::format(
          "--algorithm = '{}' (allowed: all (every one that implements --op, the default), auto, ring, "
          "halving-doubling, recursive-doubling, binomial-tree, double-binary-tree, hierarchical, hierarchical-hd, "
          "hierarchical-tree, in-network, direct, reduce-scatter-gather)",
          a.algorithm));
    }
  }
  // (the table is kept until some algorithm can run: a refusal is one line)
  std::string table;
  auto out = std::back_inserter(table);
  if (!a.json) {
    fmt::format_to(out, "{} of {} on {} ranks (stride {}) of {} ({} accelerators), {} mode\n\n", a.op, format_bytes(n),
                   g.size, g.stride, spec.name, a.gpus, a.mode);
    fmt::format_to(out, "  {:<20} {:>12} {:>12} {:>10}  {}\n", "algorithm", "time", "bus GB/s", "steps", "bottleneck");
  }
  int shown = 0, approximate = 0;
  std::string why;
  for (Algorithm alg : algs) {
    CollectiveCost cost;
    double t;
    try {
      cost = net.profile(c, alg, g, n);
      Stopwatch sw;
      t = a.mode == "full" ? net.time_full(c, cost.algorithm, g, n) : cost.time(n);
      (void)sw;
    } catch (const UnsupportedError& e) {
      // One algorithm asked for by name that cannot run is an error; among all of them, a row that says why.
      if (a.algorithm != "all") throw ConfigError(fmt::format("--algorithm {}: {}", a.algorithm, e.what()));
      if (!a.json) fmt::format_to(out, "  {:<20} {}\n", algorithm_name(alg), e.what());
      // (JSON too: its records left the others out without a word)
      if (a.json)
        std::cout << json{{"kind", "sim.coll"},
                          {"cluster", spec.name},
                          {"gpus", a.gpus},
                          {"op", a.op},
                          {"algorithm", algorithm_name(alg)},
                          {"bytes", n},
                          {"ranks", g.size},
                          {"stride", g.stride},
                          {"mode", a.mode},
                          {"error", e.what()}}
                         .dump()
                  << "\n";
      why = e.what();
      continue;
    }
    ++shown;
    // Symmetric mode could not route every copy of a group whose copies share links unevenly (marked *).
    const bool approx = a.mode == "symmetric" && cost.approximate;
    approximate += approx;
    double p = static_cast<double>(g.size);
    double factor = c == Collective::kAllReduce                                 ? 2 * (p - 1) / p
                    : (c == Collective::kBroadcast || c == Collective::kReduce) ? 1
                                                                                : (p - 1) / p;
    double busbw = n * factor / t / 1e9;
    if (a.json) {
      std::cout << json{{"kind", "sim.coll"},
                        {"cluster", spec.name},
                        {"gpus", a.gpus},
                        {"op", a.op},
                        {"algorithm", algorithm_name(cost.algorithm)},
                        {"bytes", n},
                        {"ranks", g.size},
                        {"stride", g.stride},
                        {"mode", a.mode},
                        {"time_s", t},
                        {"bus_gbps", busbw},
                        {"steps", cost.steps},
                        {"bottleneck", cost.bottleneck},
                        {"approximate", approx}}
                       .dump()
                << "\n";
    } else {
      fmt::format_to(out, "  {:<20} {:>12} {:>12.1f} {:>10.0f}  {}{}\n", algorithm_name(cost.algorithm),
                     format_seconds(t), busbw, cost.steps, cost.bottleneck, approx ? "  *" : "");
      if (a.steps) {
        long long copy_first = g.first;
        const auto steps = net.explain(c, cost.algorithm, g, n, &copy_first);
        if (copy_first != g.first)
          fmt::format_to(out, "      (the steps of the slowest copy of the group, from accelerator {})\n", copy_first);
        if (a.mode == "full")  // (the time above is full detail's; the steps are routed as symmetric mode routes them)
          fmt::format_to(out, "      (the steps as symmetric mode routes and times them)\n");
        for (const auto& st : steps)
          if (st.links_used == 0)  // (a chain's further segments and fill: time, no transfers of their own)
            fmt::format_to(out, "      x{:<6.0f} {:<34} {:>81}  {}\n", st.repeat, st.phase, "",
                           format_seconds(st.time));
          else
            fmt::format_to(out,
                           "      x{:<6.0f} {:<34} {:>7} transfers {:>7} links  bound by {} (link {}, {} per step)  "
                           "{}\n",
                           st.repeat, st.phase, st.transfers, st.links_used, st.bottleneck, st.bottleneck_link,
                           format_bytes(st.bottleneck_bytes), format_seconds(st.time));
      }
    }
  }
  if (shown == 0)
    throw ConfigError(fmt::format("no algorithm can run {} on {} ranks of {}: {}", a.op, g.size, spec.name, why));
  std::cout << table;
  if (approximate > 0 && !a.json)
    fmt::print(
        "\n  * approximate: the group's copies straddle nodes or leaves unevenly, and they are too many to route "
        "together or run different patterns (which --mode full refuses as well), so symmetric mode scales each "
        "placement's own link loads: the time can be well under the truth\n");
}

InferenceConfig make_infer(const StepArgs& a, int batch, long long prompt, long long gen,
                           const std::string& attention) {
  InferenceConfig c;
  c.fused_attention = attention != "unfused";
  if (attention == "flash2" || attention == "flash3") c.flash_kernel = attention;
  c.tp = a.tp;
  c.pp = a.pp;
  c.batch = batch;
  c.prompt = prompt;
  c.generate = gen;
  return c;
}

struct InferArgs {
  int batch = 1;
  long long prompt = -1, generate = -1;  // when not given: fit the model's context (at most 1024 and 256)
  bool prompt_given = false, generate_given = false, batch_given = false, batch_list_given = false;
  std::string batch_list;
  std::string attention = "fused";
};

// One `sim.infer` record: a single run's and each row of a --batch-list sweep have the same fields.
json infer_json(const StepArgs& a, const InferArgs& ia, const ClusterSpec& spec, const GptModel& m, int batch,
                const InferenceResult& r) {
  return json{{"kind", "sim.infer"},
              {"cluster", spec.name},
              {"gpus", a.gpus},
              {"model", m.name},
              {"tp", a.tp},
              {"pp", a.pp},
              {"replicas", r.replicas},
              {"batch", batch},
              {"batches_in_flight", r.batches_in_flight},
              {"attention", ia.attention},
              {"prompt", ia.prompt},
              {"generate", ia.generate},
              {"prefill_s", r.prefill},
              {"decode_token_s", r.decode_per_token},
              {"time_to_first_token_s", r.prefill},
              {"request_latency_s", r.request_latency},
              {"decode_token_loaded_s", r.loaded_decode_per_token},
              {"request_latency_loaded_s", r.loaded_request_latency},
              {"tokens_per_s", r.tokens_per_second},
              {"weights_gb", r.weight_bytes / 1e9},
              {"kv_cache_gb", r.kv_bytes / 1e9},
              {"memory_gb", r.memory_total / 1e9},
              {"capacity_gb", r.memory_capacity / 1e9},
              {"fits", r.fits},
              {"max_batch", r.max_batch},
              {"max_batch_capped", r.max_batch_capped},
              {"decode_bound", r.decode_bound}};
}

// The serving trade-off: latency against throughput over batch sizes.
void run_infer_sweep(const StepArgs& a, const InferArgs& ia, const ClusterSpec& spec, const GptModel& m,
                     CollectiveModel& net) {
  std::vector<int> batches = parse_int_list(ia.batch_list, "--batch-list", true);
  // (an empty list ran the single batch of --batch's default: parse_int_list refuses it)
  // Every row before any output: a refused configuration printed the table's header, then its error.
  std::vector<InferenceResult> rows;
  for (int b : batches)
    rows.push_back(simulate_inference(net, m, make_infer(a, b, ia.prompt, ia.generate, ia.attention)));
  if (!a.json)
    fmt::print(
        "cluster {}  model {}  tp={} pp={}  prompt {}  generate {}  {} attention{}\n\n  {:>6} {:>12} {:>14} {:>12}{} "
        "{:>14} {:>10}\n",
        spec.name, m.name, a.tp, a.pp, ia.prompt, ia.generate, ia.attention,
        a.pp > 1 ? fmt::format("  {} batches in flight", a.pp) : "", "batch", "TTFT", "per token", "request",
        a.pp > 1 ? fmt::format(" {:>14}", "loaded request") : "", "tokens/s", "memory");
  for (size_t i = 0; i < batches.size(); ++i) {
    const int b = batches[i];
    const InferenceResult& r = rows[i];
    if (a.json) {
      std::cout << infer_json(a, ia, spec, m, b, r).dump() << "\n";
    } else {
      fmt::print("  {:>6} {:>12} {:>14} {:>12}{} {:>14.0f} {:>10}{}\n", b, format_seconds(r.prefill),
                 format_seconds(r.decode_per_token), format_seconds(r.request_latency),
                 a.pp > 1 ? fmt::format(" {:>14}", format_seconds(r.loaded_request_latency)) : "", r.tokens_per_second,
                 format_gb(r.memory_total), r.fits ? "" : "  does not fit");
    }
  }
}

void run_infer(const StepArgs& given_args, const InferArgs& given) {
  StepArgs a = given_args;
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  GptModel m = make_model(a.model);
  // Unset lengths fit the model's context: 256 generated tokens (a quarter of it at most) after a 1024-token prompt
  // (what is left, at most).
  InferArgs ia = given;
  // (flash: the same kernels `sim step --attention-kernels flash` names, whose `fused` is Megatron-LM's other kernel)
  if (ia.attention != "fused" && ia.attention != "flash" && ia.attention != "flash2" && ia.attention != "flash3" &&
      ia.attention != "unfused")
    throw ConfigError(fmt::format(
        "--attention = '{}' (allowed: fused or flash, FlashAttention's at the GEMM rate; flash2 or flash3, at the "
        "cluster file's attention_calibration rate; unfused)",
        ia.attention));
  if (ia.prompt_given && ia.prompt < 1)
    throw ConfigError(fmt::format("--prompt = {} must be at least 1 token", ia.prompt));
  if (ia.generate_given && ia.generate < 1)
    throw ConfigError(fmt::format("--generate = {} must be at least 1 token", ia.generate));
  // (the same range as --batch-list's: 2^31 - 1 was taken, a decode step of 5e5 s)
  if (ia.batch < 1 || ia.batch > kMaxInferBatch)
    throw ConfigError(fmt::format("--batch = {} (allowed: 1 to {} sequences)", ia.batch, kMaxInferBatch));
  if (!ia.prompt_given) ia.prompt = -1;
  if (!ia.generate_given) ia.generate = -1;
  if (ia.generate >= m.seq)
    throw ConfigError(
        fmt::format("--generate ({}) leaves no room for a prompt in the model's context of {} tokens "
                    "(--seq)",
                    ia.generate, m.seq));
  if (ia.prompt > m.seq)
    throw ConfigError(fmt::format("--prompt ({}) exceeds the model's context of {} tokens (--seq)", ia.prompt, m.seq));
  // A generate length left out fits what the prompt leaves (at most 256, a quarter of the context).
  if (ia.generate < 0) {
    ia.generate = std::min<long long>(std::max<long long>(1, std::min<long long>(256, m.seq / 4)),
                                      ia.prompt > 0 ? m.seq - ia.prompt : m.seq);
    if (ia.generate < 1)
      throw ConfigError(
          fmt::format("--prompt ({}) leaves no room in the model's context of {} tokens (--seq) to "
                      "generate any",
                      ia.prompt, m.seq));
  }
  if (ia.prompt < 0) ia.prompt = std::max<long long>(1, std::min<long long>(1024, m.seq - ia.generate));
  Topology topo(spec, a.gpus);
  CollectiveModel net(topo);
  if (ia.batch_list_given) {
    if (ia.batch_given) throw ConfigError("give --batch or --batch-list, not both");
    run_infer_sweep(a, ia, spec, m, net);
    return;
  }
  InferenceResult r = simulate_inference(net, m, make_infer(a, ia.batch, ia.prompt, ia.generate, ia.attention));
  if (a.json) {
    std::cout << infer_json(a, ia, spec, m, ia.batch, r).dump() << "\n";
    return;
  }
  fmt::print("cluster {}  model {} ({:.1f}B)  tp={} pp={} ({} replicas on {} accelerators)\n", spec.name, m.name,
             gpt_parameters(m) / 1e9, a.tp, a.pp, r.replicas, a.gpus);
  fmt::print("batch {}{}  prompt {} tokens  generate {} tokens  {} attention\n\n", ia.batch,
             r.batches_in_flight > 1 ? fmt::format(" x {} in flight (one a stage)", r.batches_in_flight) : "",
             ia.prompt, ia.generate, ia.attention);
  fmt::print("  prefill (time to first token)   {}\n", format_seconds(r.prefill));
  // (with p batches in flight, a batch alone in the pipeline and at the throughput below, where they differ)
  const bool loaded =
      r.batches_in_flight > 1 && ranking_time(r.loaded_request_latency) != ranking_time(r.request_latency);
  fmt::print("  decode per token                {}  ({}-bound){}\n", format_seconds(r.decode_per_token), r.decode_bound,
             loaded ? fmt::format("; {} with {} batches in flight", format_seconds(r.loaded_decode_per_token),
                                  r.batches_in_flight)
                    : "");
  fmt::print("  request latency                 {}{}\n", format_seconds(r.request_latency),
             loaded ? fmt::format(" a batch alone; {} with {} batches in flight (at the throughput below)",
                                  format_seconds(r.loaded_request_latency), r.batches_in_flight)
                    : "");
  fmt::print("  throughput (all replicas)       {:.0f} generated tokens/s\n", r.tokens_per_second);
  fmt::print("  memory per GPU                  {} of {} (weights {}, KV cache {}){}\n", format_gb(r.memory_total),
             format_gb(r.memory_capacity), format_gb(r.weight_bytes), format_gb(r.kv_bytes),
             r.fits ? "" : "  DOES NOT FIT");
  fmt::print("  largest batch that fits         {}{}\n", r.max_batch,
             r.max_batch_capped ? " or more (--batch's limit)" : "");
}

struct ClusterArgs {
  std::string cluster = "dgx-a100";
  long long gpus = 512;
  bool gpus_given = false;
  std::string jobs;
  std::string scheduler = "fifo";
  std::string placement = "topology";
  SchedulerOptions las;  // the las and srtf settings (policy and placement come from the strings above)
  bool json = false;
};

void run_cluster(const ClusterArgs& given_args) {
  ClusterArgs a = given_args;
  ClusterSpec spec = load_sized(a.cluster, a.gpus, a.gpus_given);
  std::vector<JobSpec> jobs = load_job_trace(a.jobs);
  SchedulerOptions o = a.las;
  o.policy = parse_policy(a.scheduler);
  o.placement = parse_placement(a.placement);
  Stopwatch sw;
  ScheduleResult r = simulate_cluster(spec, a.gpus, jobs, o);
  double took = sw.seconds();
  if (a.json) {
    json js = json::array();
    for (const auto& j : r.jobs)
      js.push_back({{"id", j.id},
                    {"submit_s", j.submit},
                    {"start_s", j.start},
                    {"finish_s", j.finish},
                    {"jct_s", j.finish - j.submit},
                    {"queued_s", j.queued},
                    {"reloading_s", j.reloading},
                    {"iteration_s", j.iteration_time},
                    {"gpus", j.gpus},
                    {"leaves", j.leaves_used},
                    {"slowdown", j.slowdown},
                    {"preemptions", j.preemptions},
                    {"promotions", j.promotions}});
    std::cout << json{{"kind", "sim.cluster"},
                      {"cluster", spec.name},
                      {"gpus", a.gpus},
                      {"scheduler", a.scheduler},
                      {"placement", a.placement},
                      {"jobs", js},
                      {"mean_jct_s", r.mean_jct},
                      {"p50_jct_s", r.p50_jct},
                      {"p99_jct_s", r.p99_jct},
                      {"mean_queued_s", r.mean_queued},
                      {"makespan_s", r.makespan},
                      {"utilization", r.utilization},
                      {"restart_overhead", r.restart_overhead},
                      {"goodput", r.goodput},
                      {"simulation_wall_s", took}}
                     .dump()
              << "\n";
    return;
  }
  fmt::print("cluster {} ({} accelerators)  scheduler {}  placement {}  {} jobs\n\n", spec.name, a.gpus, a.scheduler,
             a.placement, r.jobs.size());
  fmt::print("  {:<12} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>9} {:>6}\n", "job", "gpus", "submit",
             "start", "finish", "JCT", "queued", "iteration", "leaves", "slowdown", "preempt");
  for (const auto& j : r.jobs)
    fmt::print("  {:<12} {:>6} {:>10.0f} {:>10.0f} {:>10.0f} {:>10.0f} {:>10.0f} {:>8.3g} s {:>7} {:>8.2f}x {:>6}\n",
               j.id, j.gpus, j.submit, j.start, j.finish, j.finish - j.submit, j.queued, j.iteration_time,
               j.leaves_used, j.slowdown, j.preemptions);
  fmt::print(
      "\n  mean JCT {:.0f} s   p50 {:.0f} s   p99 {:.0f} s   mean queueing delay {:.0f} s   makespan {:.0f} s   "
      "utilization {:.1f}%{}   goodput "
      "{:.1f}% (the jobs' work at their best placement's speed)\n",
      r.mean_jct, r.p50_jct, r.p99_jct, r.mean_queued, r.makespan, 100 * r.utilization,
      r.restart_overhead > 0
          ? fmt::format(" (+{:.1f}% reloading checkpoints after preemptions)", 100 * r.restart_overhead)
          : std::string(),
      100 * r.goodput);
  if (o.policy == Policy::kLas && o.las_promote_knob > 0) {
    int promoted = 0, times = 0;
    for (const auto& j : r.jobs) {
      promoted += j.promotions > 0 ? 1 : 0;
      times += j.promotions;
    }
    fmt::print("  starvation guard (knob {}): {} promotions of {} jobs\n", o.las_promote_knob, times, promoted);
  }
  if (r.restart_overhead > r.utilization && o.min_lease == 0)
    fmt::print(
        "  preempted jobs spent more time reloading than the cluster spent training: jobs swap faster than "
        "they restart; --min-lease {} (the restart penalty) lets each run train that long first\n",
        o.restart_penalty);
  fmt::print("  (simulated in {})\n", format_seconds(took));
}

struct CalibrateArgs {
  std::vector<std::string> bench;
  std::string gemm;
  std::string peak;
  std::string transport;
  std::string out;
  std::string name = "local-calibrated";
  long long ranks = 0;  // 0: the largest world in the bench files
  double share = 0;     // 0: cores / ranks, at most 1
  int batch = 64;       // samples per worker for the GEMMs timed when neither --gemm nor --peak is given
};

void run_calibrate(const CalibrateArgs& a) {
  if (a.bench.empty()) throw ConfigError("--bench is required: JSON lines from `conduit bench coll --json`");
  // The name goes into the cluster file as a plain YAML scalar (": " or a leading '#' broke the file or named the
  // cluster null).
  if (a.name.empty() || a.name.size() > 64 ||
      !std::all_of(a.name.begin(), a.name.end(),
                   [](unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '.'; }) ||
      !std::isalnum(static_cast<unsigned char>(a.name[0])))
    throw ConfigError(
        fmt::format("--name = '{}' (allowed: 1 to 64 letters, digits, '-', '_' and '.', starting with a "
                    "letter or digit)",
                    a.name));
  // The flags first: a mistake in them should not wait for the fit and the memory measurement.
  if (a.share != 0 && !(a.share > 0 && a.share <= 1))
    throw ConfigError(fmt::format("--share = {} must be in (0, 1] (or 0: from the cores)", a.share));
  const double given_peak = a.peak.empty() ? 0 : parse_flops(a.peak, "--peak");
  if (!a.peak.empty() && !(given_peak > 0)) throw ConfigError("--peak must be positive (e.g. 80 GFLOP/s)");
  if (!a.out.empty() && a.out != "-") {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(a.out).has_parent_path() ? fs::path(a.out).parent_path() : fs::path(".");
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw ConfigError(fmt::format("--out: '{}' is not a directory one can write '{}' into", dir.string(), a.out));
    if (fs::is_directory(a.out, ec)) throw ConfigError(fmt::format("--out: '{}' is a directory", a.out));
    if (::access(dir.c_str(), W_OK) != 0) throw ConfigError(fmt::format("--out: cannot write into '{}'", dir.string()));
  }
  // With the cluster file on stdout, the report goes to stderr: `> file.yaml` must give a file that loads.
  const bool yaml_to_stdout = a.out.empty() || a.out == "-";
  std::FILE* report = yaml_to_stdout ? stderr : stdout;
  std::map<std::string, std::vector<BenchSample>> by_transport;
  std::vector<BenchSample> all;
  long long ranks = a.ranks;
  for (const auto& f : a.bench) {
    std::string skipped;
    for (auto& s : parse_bench_lines(read_input_file(f, "--bench", "a file of JSON lines"), f, &skipped))
      all.push_back(s);
    if (!skipped.empty()) std::fprintf(stderr, "sim calibrate: %s\n", skipped.c_str());
  }
  if (a.ranks < 0) throw ConfigError(fmt::format("--ranks = {} must be positive", a.ranks));
  // A sample the fit can use: back to back, of an operation and algorithm the simulator models. The defaults go by
  // these (by records, 24 unmodelled `reduce rsg` lines at 4 ranks outvoted 14 ring samples at 2, and the fit failed).
  std::set<long long> worlds;
  std::map<long long, size_t> usable_at;
  for (const auto& s : all) {
    worlds.insert(s.world);
    if (fit_uses(s)) ++usable_at[s.world];
  }
  // (the world with the most usable samples, the largest on a tie: the largest with any took 2 ring samples at 4
  // ranks over 14 at 2, and failed)
  if (ranks == 0) {
    ranks = *worlds.rbegin();
    size_t most = 0;
    for (auto [w, k] : usable_at)
      if (k >= most) most = k, ranks = w;
  }
  // Fit the samples taken at that world size only (the largest without --ranks): ranks that share cores are slower
  // per step, and a fit pooled over world sizes was then checked against one of them only.
  for (const auto& s : all)
    if (s.world == ranks) by_transport[s.transport].push_back(s);
  if (by_transport.empty()) {
    std::vector<std::string> have;
    for (long long w : worlds) have.push_back(std::to_string(w));
    throw ConfigError(fmt::format("--ranks = {}: no samples with that world size in the --bench files (have: {})",
                                  ranks, join(have, ", ")));
  }
  std::string chosen = a.transport;
  if (chosen.empty()) {
    long long most = -1;
    for (auto& [t, v] : by_transport) {
      const auto n = static_cast<long long>(std::count_if(v.begin(), v.end(), fit_uses));
      if (n > most) {
        most = n;
        chosen = t;
      }
    }
  }
  if (!by_transport.count(chosen))
    throw ConfigError(fmt::format("--transport = '{}': no samples over it in the --bench files", chosen));
  AlphaBetaGamma chosen_fit;
  for (auto& [t, v] : by_transport) {
    int unmodelled = 0;
    AlphaBetaGamma f;
    try {
      f = fit_alpha_beta_gamma(v, &unmodelled);
    } catch (const ConfigError& e) {
      // Only the transport written must fit; a few stray records of another are reported and left out.
      if (t == chosen) throw;
      fmt::print(stderr, "sim calibrate: warning: {} left out: {}\n", t, e.what());
      continue;
    }
    fmt::print(report,
               "{:<8} {:>4} samples ({} unmodelled): alpha {:.2f} us  beta {:.3g} s/B ({:.2f} GB/s)  gamma {:.3g} s/B  "
               "rms error {:.1f}%\n",
               t, f.samples, unmodelled, f.alpha * 1e6, f.beta, f.beta > 0 ? 1e-9 / f.beta : 0.0, f.gamma,
               100 * f.rms_relative_error);
    size_t staggered = 0;
    f.wake = fit_wake_latency(v, f, &staggered);
    if (staggered > 0)
      fmt::print(
          report,
          "{:<8} {:>4} staggered samples (the last rank late): {:.1f} us per call beyond the fit (wake_latency)\n", t,
          staggered, f.wake * 1e6);
    if (t == chosen) chosen_fit = f;
  }
  if (chosen_fit.gamma_inseparable)
    fmt::print(stderr,
               "sim calibrate: warning: every {} sample reduces bytes in the same proportion to those it moves, so "
               "beta and gamma cannot be told apart: gamma is written as 0 and beta carries both, which over-predicts "
               "collectives that do not reduce (allgather, broadcast); add `bench coll --op allgather` samples\n",
               chosen);
  if (!(chosen_fit.beta > 1e-15))
    fmt::print(stderr,
               "sim calibrate: warning: the {} samples' times hardly grow with their size (beta fitted as {:.3g} s/B), "
               "so the cluster file gets 1 PB/s links; time larger messages (bench coll -e 4M or more)\n",
               chosen, chosen_fit.beta);
  std::vector<GemmSample> gemms;
  std::vector<ConvSample> convs;
  std::vector<PoolSample> pools;
  std::vector<ModelStepSample> models;
  long long concurrent = 1;  // processes that timed the --gemm records together
  double peak = 0;
  if (!a.gemm.empty()) {
    const std::string text = read_input_file(a.gemm, "--gemm", "a file of JSON lines");
    gemms = parse_gemm_lines(text, a.gemm);
    convs = parse_conv_lines(text, a.gemm);
    pools = parse_pool_lines(text, a.gemm);
    models = parse_model_step_lines(text, a.gemm);
    concurrent = bench_concurrency(text, a.gemm);
    for (const auto& m : models) {
      if (m.rank_spread <= kSteadySpread) continue;
      fmt::print(stderr,
                 "sim calibrate: warning: {}: the model steps of {} at batch {:g} differ {:.1f}x between the processes "
                 "that timed them together (median step of the slowest over the fastest; steady runs here stay "
                 "under {:g}x): one process ran slower throughout, so the rank wait written ({:.1f} ms) is its lag, "
                 "not training's; time them again on a steady machine (the cause seen here was glibc's adaptive malloc "
                 "thresholds, which conduit fixes unless CONDUIT_MALLOC_TUNING=0 or malloc settings of your own)\n",
                 a.gemm, m.layers, m.batch, m.rank_spread, kSteadySpread, m.slowest_wait * 1e3);
    }
    fmt::print(report,
               "{}: {} GEMM shapes, {} convolutions, {} poolings, {} model steps, timed by {} concurrent process{}{}\n",
               a.gemm, gemms.size(), convs.size(), pools.size(), models.size(), concurrent, concurrent == 1 ? "" : "es",
               convs.empty() ? " (convolution layers will be costed as im2col GEMMs)" : "");
  }
  if (a.gemm.empty() && a.peak.empty()) {
#ifdef CONDUIT_WITH_TORCH
    if (a.batch < 1) throw ConfigError(fmt::format("--batch = {} must be at least 1", a.batch));
    std::vector<std::array<int64_t, 3>> shapes;
    for (const auto& g : calibration_gemm_shapes(a.batch))
      shapes.push_back({static_cast<int64_t>(g.m), static_cast<int64_t>(g.n), static_cast<int64_t>(g.k)});
    for (const auto& t : torch_api().time_gemms(shapes, 1, 0.05))
      gemms.push_back(GemmSample{double(t.m), double(t.n), double(t.k), t.gflops() * 1e9});
    std::vector<train::ConvTiming> cshapes;
    for (const auto& c : calibration_conv_shapes(a.batch)) cshapes.push_back(cli::conv_shape(c));
    for (const auto& t : torch_api().time_convs(cshapes, 1, 0.05)) convs.push_back(cli::conv_sample(t));
    std::vector<train::PoolTiming> pshapes;
    for (const auto& p : calibration_pool_shapes(a.batch)) pshapes.push_back(cli::pool_shape(p));
    for (const auto& t : torch_api().time_pools(pshapes, 1, 0.05)) pools.push_back(cli::pool_sample(t));
    fmt::print(
        report,
        "timed {} GEMMs, {} poolings and {} convolutions with libtorch (one thread; conduit train's CNN and MLP at "
        "batch {}, square 32..1024)\n",
        gemms.size(), pools.size(), convs.size(), a.batch);
#else
    throw ConfigError(
        "give --gemm FILE (JSON lines {m, n, k, gflops}, e.g. from `conduit bench gemm --json`) or --peak (e.g. 50 "
        "GFLOP/s): this conduit was built without libtorch, so it cannot time GEMMs itself");
#endif
  }
  for (const auto& g : gemms) peak = std::max(peak, g.flops);
  if (given_peak > 0) {
    if (given_peak < peak)
      throw ConfigError(
          fmt::format("--peak = {} is below the fastest measured GEMM ({:.4g} GFLOP/s): give at least "
                      "that, or leave --peak out",
                      a.peak, peak / 1e9));
    peak = given_peak;
  }
  if (peak <= 0)
    throw ConfigError(
        "give --gemm FILE (JSON lines {m, n, k, gflops} from `conduit bench gemm --json`) or --peak (e.g. 50 GFLOP/s)");
  double share = a.share;
  const unsigned cores = static_cast<unsigned>(usable_cpus());  // a container's quota or cpuset, not the host's
  // Records timed by `concurrent` processes at once already carry the speed one of them gets; scale by the cores
  // `ranks` workers get relative to that (1 when the bench ran with as many processes as the cluster has ranks).
  if (share == 0)
    share =
        std::min(1.0, std::min(1.0, double(cores) / double(ranks)) / std::min(1.0, double(cores) / double(concurrent)));
  if (!(share > 0) || share > 1) throw ConfigError(fmt::format("--share = {} must be in (0, 1]", share));
  double mem_bytes = 0;
  {
    std::ifstream mi("/proc/meminfo");
    std::string key;
    double kb = 0;
    std::string unit;
    while (mi >> key >> kb >> unit)
      if (key == "MemTotal:") {
        mem_bytes = kb * 1024;
        break;
      }
  }
  if (mem_bytes <= 0) mem_bytes = 8e9;
  double bw = measure_memory_bandwidth();
  fmt::print(report, "memory bandwidth (copy, measured): {:.1f} GB/s; memory {:.1f} GB; peak {:.1f} GFLOP/s\n",
             bw / 1e9, mem_bytes / 1e9, peak / 1e9);
  fmt::print(report,
             "{} ranks on {} cores: each rank gets {:.3g} of the measured rates (GEMMs, convolutions, poolings and "
             "model steps timed by {} concurrent process{}; copy bandwidth by one thread)\n",
             ranks, cores, share, concurrent, concurrent == 1 ? "" : "es");
  std::string yaml =
      calibrated_cluster_yaml(a.name, static_cast<int>(ranks), chosen_fit, bw, mem_bytes / static_cast<double>(ranks),
                              peak, gemms, chosen, share, convs, pools, models);
  // What we write must load; a value out of a cluster file's range comes from a measurement (a GEMM's gflops, a
  // record's time_us or *_us), which the file's field name alone did not say.
  ClusterSpec cal;
  try {
    cal = parse_cluster_yaml(yaml, "calibrated cluster");
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format(
        "the measurements give a cluster out of the simulator's range ({}); check the records' gflops, time_us and "
        "*_us fields",
        e.what()));
  }
  {
    // Predicted (from the written cluster) against measured, sample by sample.
    Topology topo(cal, ranks);
    CollectiveModel net(topo);
    fmt::print(report, "\n  {:<10} {:<6} {:>10} {:>8} {:>12} {:>12} {:>8}\n", "op", "algo", "bytes", "late by",
               "measured", "predicted", "error");
    double worst = 0, sum = 0;
    int count = 0;
    for (const auto& s : by_transport[chosen]) {
      Collective c;
      Algorithm al;
      if (!bench_collective(s.op, c) || !bench_algorithm(c, s.algo, s.world, al) || s.world != ranks) continue;
      // Calls with a late rank also pay the wake latency (the step model charges it per data-parallel call).
      double pred = net.time(c, al, Group{s.world, 1, 0}, s.bytes) + (s.stagger > 0 ? cal.network.wake_latency : 0);
      double err = (pred - s.seconds) / s.seconds;
      worst = std::max(worst, std::abs(err));
      sum += std::abs(err);
      ++count;
      fmt::print(report, "  {:<10} {:<6} {:>10.0f} {:>8} {:>12} {:>12} {:>+7.1f}%\n", s.op, s.algo, s.bytes,
                 s.stagger > 0 ? format_seconds(s.stagger) : "-", format_seconds(s.seconds), format_seconds(pred),
                 100 * err);
    }
    if (count)
      fmt::print(report, "  mean |error| {:.1f}%, max {:.1f}% over {} samples\n\n", 100 * sum / count, 100 * worst,
                 count);
  }
  if (yaml_to_stdout) {
    std::cout << yaml;
  } else {
    write_text_file(a.out, yaml);
    fmt::print("wrote {} (use: conduit sim step --cluster {} --gpus {} ...)\n", a.out, a.out, ranks);
  }
}

struct ScaleArgs {
  std::string gpus_list = "64,128,256,512,1024,2048,4096,8192";
  long long batch_per_gpu = kNotGiven;  // (weak scaling when given; -5 was taken as left out)
  std::string plot;
};

// A scaling curve: for each accelerator count, the planner's best plan (or the fixed --tp/--pp/... when
// --fixed), at a fixed global batch (strong scaling) or a fixed batch per GPU (weak scaling).
void run_scale(const StepArgs& a, const ScaleArgs& sa, bool fixed) {
  ClusterSpec spec = load_cluster(a.cluster);
  GptModel m = make_model(a.model);
  std::vector<int> counts = parse_int_list(sa.gpus_list, "--gpus-list");
  if (counts.empty()) throw ConfigError("--gpus-list: give at least one accelerator count");
  if (sa.batch_per_gpu != kNotGiven && sa.batch_per_gpu <= 0)
    throw ConfigError(fmt::format("--batch-per-gpu = {} (allowed: a positive number of sequences)", sa.batch_per_gpu));
  if (sa.batch_per_gpu != kNotGiven && a.global_batch != 0)
    throw ConfigError(
        "--global-batch with --batch-per-gpu: strong and weak scaling; allowed: one of them (--batch-per-gpu scales "
        "the global batch with the GPUs)");
  if (sa.batch_per_gpu == kNotGiven && a.global_batch < 0)
    throw ConfigError(fmt::format("--global-batch = {} (allowed: a positive number of sequences)", a.global_batch));
  if (sa.batch_per_gpu == kNotGiven && a.global_batch <= 0)
    throw ConfigError("give --global-batch (strong scaling) or --batch-per-gpu (weak scaling)");
  struct Point {
    long long gpus;
    StepResult r;
    bool ok;
    std::string why;       // when not ok: the configuration's error, or that nothing fits
    bool invalid = false;  // why is the configuration's error
  };
  std::vector<Point> pts;
  for (int n : counts) {
    // (the topology's refusals name --gpus, which this command takes from the list)
    std::optional<Topology> made;
    try {
      made.emplace(spec, n);
    } catch (const ConfigError& e) {
      // ("--gpus = 12 must be ..." -> "12 must be ...": the count is the list's)
      std::string why = e.what();
      for (size_t at; (at = why.find("--gpus = ")) != std::string::npos;) why.erase(at, 9);
      throw ConfigError(fmt::format("--gpus-list = '{}': {}", sa.gpus_list, why));
    }
    const Topology& topo = *made;
    CollectiveModel net(topo);
    if (sa.batch_per_gpu > 0 && sa.batch_per_gpu > (1LL << 40) / n)
      throw ConfigError(
          fmt::format("--batch-per-gpu = {} x {} GPUs exceeds the largest global batch (2^40)", sa.batch_per_gpu, n));
    const long long B = sa.batch_per_gpu > 0 ? sa.batch_per_gpu * n : a.global_batch;
    Point p{n, {}, false, "no configuration fits in memory"};
    if (fixed) {
      StepArgs f = a;
      f.global_batch = B;
      ParallelConfig c = make_config(f);
      // (a size whose tp x pp leaves one data-parallel rank has nothing for ZeRO to shard: the curve's point at
      // --zero 0, as its plan column says, rather than a gap where its baseline was)
      const bool lone = n / (static_cast<long long>(c.tp) * c.pp) == 1 && c.zero != 0;
      if (lone) c.zero = 0;
      try {
        p.r = simulate_step(net, m, c);
        if (lone)
          p.r.notes.push_back("dp = 1 at this size: no data-parallel ranks to shard over, so --zero does not apply");
        p.ok = p.r.fits;
        if (!p.ok) p.why = fmt::format("does not fit: {} per GPU", format_gb(p.r.memory.total()));
      } catch (const ConfigError& e) {
        p.why = e.what();
        p.invalid = true;
      }
    } else {
      PlanSpace space;
      space.base = make_config(a);
      PlanResult pr = plan(net, m, B, space, 1);
      if (!pr.ranked.empty()) {
        p.r = pr.ranked.front();
        p.ok = true;
      } else if (!pr.any_oom && !pr.first_error.empty()) {
        p.why = "no valid configuration, e.g. " + pr.first_error;
        p.invalid = true;
      }
    }
    pts.push_back(p);
  }
  // The efficiency is relative to the smallest size that ran (it was the first listed: a list given largest first
  // put 109% beside 256 GPUs).
  const Point* base = nullptr;
  for (const auto& p : pts)
    if (p.ok && (!base || p.gpus < base->gpus)) base = &p;
  // No size valid: one line and exit 2, as sim step and sim plan (every row printed the same error, exit 0).
  if (std::all_of(pts.begin(), pts.end(), [](const Point& p) { return p.invalid; }))
    throw ConfigError(fmt::format("no size of --gpus-list = '{}' can run: {}", sa.gpus_list, pts.front().why));
  // None fits: the table, and exit 1 as sim plan's "no plan fits".
  if (!base) set_exit_code(1);
  if (a.json) {
    for (const auto& p : pts) {
      json j = p.ok ? step_json(spec.name, m, p.r)
                    : json{{"kind", "sim.step"}, {"gpus", p.gpus}, {"fits", false}, {"why", p.why}};
      j["kind"] = "sim.scale";
      if (p.ok && base) j["scaling_efficiency"] = p.r.model_tflops_per_gpu / base->r.model_tflops_per_gpu;
      std::cout << j.dump() << "\n";
    }
  } else {
    fmt::print("cluster {}  model {} ({:.1f}B)  {}  {}\n\n", spec.name, m.name, gpt_parameters(m) / 1e9,
               sa.batch_per_gpu > 0 ? fmt::format("weak scaling, {} sequences per GPU", sa.batch_per_gpu)
                                    : fmt::format("strong scaling, global batch {}", a.global_batch),
               fixed ? "fixed configuration" : "best plan per size");
    fmt::print("  {:>8} {:>11} {:>9} {:>7} {:>11}  {}\n", "GPUs", "time", "TFLOP/s", "MFU", "efficiency", "plan");
    for (const auto& p : pts) {
      if (!p.ok) {
        fmt::print("  {:>8}  {}\n", p.gpus, p.why);
        continue;
      }
      fmt::print("  {:>8} {:>11} {:>9.1f} {:>6.1f}% {:>10.1f}%  {}\n", p.gpus, format_seconds(p.r.time),
                 p.r.model_tflops_per_gpu, 100 * p.r.mfu, 100 * p.r.model_tflops_per_gpu / base->r.model_tflops_per_gpu,
                 describe_config(p.r.config));
    }
  }
  if (!sa.plot.empty()) {
    for (unsigned char ch : sa.plot)
      if (ch < 0x20 || ch == 0x7f)
        throw ConfigError("--plot: the path has a control character (newline, tab, ...); allowed: printable ones");
    std::string dat = sa.plot + ".dat";
    {
      std::ofstream f(dat);
      if (!f) throw ConfigError(fmt::format("--plot: cannot write '{}'", dat));
      for (const auto& p : pts)
        if (p.ok) f << p.gpus << " " << p.r.model_tflops_per_gpu << "\n";
    }
    // gnuplot reads a script file (no shell sees the paths).
    const auto quoted = gnuplot_quote;
    const std::string gp = sa.plot + ".gp";
    {
      std::ofstream f(gp);
      if (!f) throw ConfigError(fmt::format("--plot: cannot write '{}'", gp));
      f << fmt::format(
          "set terminal pngcairo size 900,500 font ',10'\nset output {}\nset logscale x 2\nset yrange [0:*]\n"
          "set xlabel 'accelerators'\nset ylabel 'model TFLOP/s per GPU'\nset title {}\n"
          "plot {} using 1:2 with linespoints title 'predicted'\n",
          quoted(sa.plot), quoted(m.name + " on " + spec.name),
          quoted(dat.front() == '/' ? dat : "./" + dat));  // a name starting with $ would be a datablock
    }
    std::string log;
    if (cluster::run_program({"gnuplot", gp}, &log) != 0)
      throw ConfigError(fmt::format("--plot: gnuplot failed (is it installed?): {}; the data are in {}",
                                    trim(log.substr(0, log.find('\n'))), dat));
    if (!a.json) fmt::print("\n  plot: {} (data: {})\n", sa.plot, dat);
  }
}

void setup(CLI::App& app) {
  auto* sim = app.add_subcommand("sim", "Simulate training and inference on clusters far larger than this machine");
  sim->require_subcommand(1);

  {
    auto* c = sim->add_subcommand("presets", "List the embedded cluster presets, or --dump one as YAML");
    auto dump = std::make_shared<std::string>();
    c->add_option("--dump", *dump, "print this preset's YAML (edit it and pass the file to --cluster)");
    c->callback([dump]() {
      if (!dump->empty()) {
        std::cout << preset_yaml(*dump);
        return;
      }
      for (const auto& n : preset_names()) {
        ClusterSpec s = parse_cluster_yaml(preset_yaml(n), n);
        fmt::print("  {:<14} {}\n", n, s.description);
      }
    });
  }
  {
    auto* c = sim->add_subcommand("coll", "Cost of one collective, per algorithm, mapped onto a cluster's topology");
    auto a = std::make_shared<CollArgs>();
    c->add_option("--cluster", a->cluster, "preset or YAML file")->capture_default_str();
    c->add_option("--gpus", a->gpus, "accelerators in the cluster (default: the file's nodes' count when it gives one)")
        ->capture_default_str()
        ->each([a](const std::string&) { a->gpus_given = true; });
    c->add_option("--op", a->op, "allreduce, reduce-scatter, allgather, broadcast, reduce, all-to-all")
        ->capture_default_str();
    c->add_option("--algorithm", a->algorithm, "all, or one algorithm")->capture_default_str();
    c->add_option("--size", a->size, "message size (e.g. 64M)")->capture_default_str();
    c->add_option("--group", a->group, "ranks in the group (default: all)");
    c->add_option("--stride", a->stride, "distance between consecutive ranks of the group")->capture_default_str();
    c->add_option("--mode", a->mode, "symmetric or full (every concurrent group, max-min fair flows)")
        ->capture_default_str();
    c->add_flag("--json", a->json, "JSON lines");
    c->add_flag("--steps", a->steps, "show each step: the links it uses and the one that bounds it");
    c->callback([a]() { run_coll(*a); });
  }
  for (const char* name : {"step", "plan"}) {
    const bool is_step = std::string(name) == "step";
    auto* c =
        sim->add_subcommand(name, is_step ? "Predict one training iteration: time, TFLOP/s, memory, breakdown"
                                          : "Search parallel configurations; rank those that fit; explain the best");
    auto a = std::make_shared<StepArgs>();
    add_model_flags(c, *a);
    c->add_option("--global-batch", a->global_batch, "sequences per iteration")->required();
    // The dimensions the planner searches: plan shows no step default for them (it tries every value unless one
    // is given, which fixes it).
    const std::string searched = is_step ? "" : " (searched unless given)";
    auto dflt = [is_step](CLI::Option* o) {
      if (is_step) o->capture_default_str();
    };
    dflt(c->add_option("--micro-batch", a->micro_batch, "sequences per micro-batch" + searched));
    dflt(c->add_option("--tp", a->tp, "tensor-parallel size" + searched));
    dflt(c->add_option("--pp", a->pp, "pipeline-parallel size" + searched));
    c->add_option("--dp", a->dp,
                  is_step ? "data-parallel size (default: gpus / (tp pp))"
                          : "not taken: each plan's is gpus / (tp pp) (fix --tp and --pp instead)");
    dflt(c->add_option("--zero", a->zero, "ZeRO stage 0-3" + searched));
    dflt(c->add_option("--recompute", a->recompute, "none, selective or full" + searched));
    dflt(c->add_option("--schedule", a->schedule, "gpipe, 1f1b or interleaved" + searched));
    c->add_option("--virtual-stages", a->virtual_stages,
                  is_step ? "model chunks per GPU for --schedule interleaved (default 2)"
                          : "model chunks per GPU for --schedule interleaved (searched: 2 and 4, unless given)");
    if (is_step) {
      c->add_option("--first-stage-layers", a->first_stage_layers,
                    "an uneven pipeline split: the first stage's transformer layers (Megatron-LM's "
                    "--decoder-first-pipeline-num-layers); the stages without a count share the rest evenly");
      c->add_option("--last-stage-layers", a->last_stage_layers,
                    "an uneven pipeline split: the last stage's transformer layers (with the output layer and the "
                    "loss)");
    }
    c->add_flag("--sp", a->sp, "sequence parallelism with tensor parallelism" + searched);
    c->add_option("--attention-kernels", a->attention_kernels,
                  "the attention's kernels over the scores: fused (Megatron-LM's scale-mask-softmax, then dropout), "
                  "eager (PyTorch's scale, mask, softmax and dropout one kernel each, as minGPT), flash "
                  "(FlashAttention: the scores never in memory, recomputed in the backward; the core at the GEMM "
                  "rate), flash2 or flash3 (the same, the core at the cluster file's attention_calibration rate)")
        ->capture_default_str();
    c->add_flag("--no-overlap", a->no_overlap, "do not overlap the data-parallel exchange with backward");
    c->add_flag("--no-zero-prefetch", a->no_zero_prefetch,
                "ZeRO-3: every layer's gather blocks it (default: the next layer's starts while one computes); ZeRO-1 "
                "and 2: the allgather after the step blocks (default: behind the next forward, layer by layer)");
    c->add_flag("--balance", a->balance,
                "heterogeneous clusters (data parallel): batch shares proportional to each accelerator's speed");
    c->add_option("--bucket", a->bucket, "gradient bucket size")->capture_default_str();
    c->add_option("--zero-allgather-bucket", a->zero_allgather_bucket,
                  "ZeRO-1/2: consecutive layers' parameters in one bucket go in one call of the allgather behind the "
                  "next forward until it carries this much (conduit train --zero-allgather-mb; 0: a call per layer "
                  "and bucket)")
        ->capture_default_str();
    c->add_option("--gather-bytes", a->gather_bytes,
                  "ZeRO-3: bytes per parameter element gathered (1: int8 blocks with a scale each, conduit train "
                  "--zero-gather int8 and ZeRO++'s qwZ; 2: --zero-gather bf16 or fp16; default: as held, a GPT "
                  "model's 16 bits, a layer list's --grad-bytes)");
    c->add_option("--zero-hpz", a->zero_hpz,
                  "ZeRO-3 (GPT models and layer lists): ZeRO++'s hpZ, a secondary partition over groups of this many "
                  "data-parallel "
                  "ranks, which the backward's gathers run within (conduit train --zero-hpz); node: the node's, gpus "
                  "a node / tp, for each plan; 0: none")
        ->capture_default_str();
    c->add_option("--zero-shard-group", a->zero_shard,
                  "ZeRO 1-3 (GPT models and layer lists): shard within groups of this many data-parallel ranks and "
                  "replicate across "
                  "them (FSDP's HYBRID_SHARD, MiCS; conduit train --zero-shard-group); node: the node's, gpus a node / "
                  "tp, for each plan; 0: all ranks")
        ->capture_default_str();
    c->add_option("--zero-reduce,--zero2-reduce", a->zero_reduce,
                  "ZeRO-2 and 3 (at --zero 2 or 3) over several micro-batches: micro-batch (reduce-scatter after "
                  "every micro-batch's backward, holding only the shard: DeepSpeed's, a GPT model's default; with "
                  "shard groups the allreduce across them once a step, as MiCS) or step (sum them in whole-gradient "
                  "buckets, reduce-scatter once: FSDP's no_sync, conduit train's and a layer list's default); "
                  "--zero2-reduce: its name before stage 3 took it");
    c->add_option("--grad-bytes", a->grad_bytes, "bytes per gradient element exchanged (2 or 4)")
        ->capture_default_str();
    c->add_option("--dp-algorithm", a->dp_algorithm, "collective algorithm for data parallelism")
        ->capture_default_str();
    c->add_option("--tp-algorithm", a->tp_algorithm, "collective algorithm for tensor parallelism")
        ->capture_default_str();
    c->add_option("--compression", a->compression,
                  "none, fp16, int8, int4, topk:DENSITY, powersgd:RANK (with --zero: none, fp16, or int8/int4 blocks "
                  "by all-to-all, ZeRO++'s qgZ)")
        ->capture_default_str();
    c->add_option("--sync", a->sync, "bsp, local-sgd:PERIOD or async")->capture_default_str();
    c->add_option("--mode", a->mode, "symmetric or full (every group's flows, max-min fair)")->capture_default_str();
    c->add_flag("--json", a->json, "one JSON record instead of the table");
    if (is_step) {
      c->callback([a, c]() {
        for (const char* f : {"--virtual-stages", "--zero-reduce", "--gather-bytes", "--bucket", "--first-stage-layers",
                              "--last-stage-layers"})
          if (c->get_option(f)->count() > 0) a->given.insert(f);
        run_step(*a);
      });
    } else {
      c->add_option("--top", a->top, "plans to list")->capture_default_str();
      c->add_option("--tp-options", a->tp_options, "tensor-parallel sizes to try, e.g. 1,2,4,8");
      c->add_option("--pp-options", a->pp_options, "pipeline sizes to try");
      c->add_option("--micro-batch-options", a->mb_options, "micro-batch sizes to try");
      c->add_option("--zero-options", a->zero_options, "ZeRO stages to try, e.g. 0,1");
      c->add_option("--recompute-options", a->recompute_options, "recompute modes to try, e.g. selective,full");
      c->callback([a, c]() {
        for (const char* f : {"--tp", "--pp", "--dp", "--micro-batch", "--zero", "--recompute", "--schedule",
                              "--virtual-stages", "--sp", "--zero-reduce", "--gather-bytes", "--tp-options",
                              "--pp-options", "--micro-batch-options", "--zero-options", "--recompute-options"})
          if (c->get_option(f)->count() > 0) a->given.insert(f);
        run_plan(*a);
      });
    }
  }
  {
    auto* c = sim->add_subcommand("scale", "Scaling curve: best plan (or a fixed one) per accelerator count");
    auto a = std::make_shared<StepArgs>();
    auto sa = std::make_shared<ScaleArgs>();
    auto fixed = std::make_shared<bool>(false);
    add_model_flags(c, *a);
    c->add_option("--gpus-list", sa->gpus_list, "accelerator counts")->capture_default_str();
    c->add_option("--global-batch", a->global_batch, "sequences per iteration (strong scaling)");
    c->add_option("--batch-per-gpu", sa->batch_per_gpu, "sequences per GPU per iteration (weak scaling)");
    c->add_flag("--fixed", *fixed, "simulate the given --tp/--pp/--micro-batch/... instead of planning each size");
    const std::vector<CLI::Option*> with_fixed = {
        c->add_option("--tp", a->tp, "tensor-parallel size (with --fixed)")->capture_default_str(),
        c->add_option("--pp", a->pp, "pipeline-parallel size (with --fixed)")->capture_default_str(),
        c->add_option("--micro-batch", a->micro_batch, "micro-batch (with --fixed)")->capture_default_str(),
        c->add_option("--zero", a->zero, "ZeRO stage (with --fixed)")->capture_default_str(),
        c->add_option("--recompute", a->recompute, "none, selective, full (with --fixed)")->capture_default_str(),
        c->add_option("--schedule", a->schedule, "gpipe, 1f1b, interleaved (with --fixed)")->capture_default_str(),
        c->add_option("--virtual-stages", a->virtual_stages,
                      "model chunks per GPU for --schedule interleaved (with --fixed; default 2)"),
        c->add_flag("--sp", a->sp, "sequence parallelism (with --fixed)"),
        c->add_option("--first-stage-layers", a->first_stage_layers,
                      "an uneven pipeline split: the first stage's transformer layers (with --fixed)"),
        c->add_option("--last-stage-layers", a->last_stage_layers,
                      "an uneven pipeline split: the last stage's transformer layers (with --fixed)")};
    // (the model's kernels, so for every size, planned or fixed)
    c->add_option("--attention-kernels", a->attention_kernels,
                  "the attention's kernels over the scores: fused (Megatron-LM's), eager (PyTorch's, as minGPT), "
                  "flash (FlashAttention), flash2 or flash3 (at the cluster file's attention_calibration rate)")
        ->capture_default_str();
    c->add_option("--plot", sa->plot, "write a PNG of the curve with gnuplot");
    c->add_flag("--json", a->json, "one JSON record per size");
    c->callback([a, sa, fixed, with_fixed]() {
      // (without --fixed each size is planned over every configuration: these were taken and ignored)
      for (auto* o : with_fixed)
        if (o->count() > 0 && !*fixed)
          throw ConfigError(
              fmt::format("{} applies with --fixed only (allowed: add --fixed to simulate that "
                          "configuration at every size, or leave it out to plan each size)",
                          o->get_name()));
      for (auto* o : with_fixed)  // (the flags whose value counts only when given)
        for (const char* f : {"--virtual-stages", "--first-stage-layers", "--last-stage-layers"})
          if (o->count() > 0 && o->get_name() == f) a->given.insert(f);
      // (add_model_flags registers --gpus for every command; scale took it and ignored it)
      if (a->gpus_given) throw ConfigError("--gpus: sim scale takes its sizes from --gpus-list; allowed: leave it out");
      run_scale(*a, *sa, *fixed);
    });
  }
  {
    auto* c = sim->add_subcommand("infer", "Prefill and decode latency and throughput of LLM serving with a KV cache");
    auto a = std::make_shared<StepArgs>();
    auto ia = std::make_shared<InferArgs>();
    add_model_flags(c, *a);
    c->add_option("--tp", a->tp, "tensor-parallel size")->capture_default_str();
    c->add_option("--pp", a->pp, "pipeline-parallel size")->capture_default_str();
    auto* batch = c->add_option("--batch", ia->batch, "sequences a batch (with --pp p, p batches in flight)")
                      ->capture_default_str();
    auto* batch_list =
        c->add_option("--batch-list", ia->batch_list, "sweep batch sizes, e.g. 1,4,16,64 (latency vs throughput)");
    auto* prompt = c->add_option("--prompt", ia->prompt, "prompt tokens (default: 1024, or what the context leaves)");
    auto* generate =
        c->add_option("--generate", ia->generate, "generated tokens (default: 256, at most a quarter of the context)");
    c->add_option("--attention", ia->attention,
                  "fused or flash (FlashAttention: no s x s scores in memory, the causal half skipped, at the GEMM "
                  "rate), flash2 or flash3 (the same at the cluster file's attention_calibration rate) or unfused")
        ->capture_default_str();
    c->add_flag("--json", a->json, "one JSON record");
    c->callback([a, ia, prompt, generate, batch, batch_list]() {
      ia->prompt_given = prompt->count() > 0;
      ia->generate_given = generate->count() > 0;
      ia->batch_given = batch->count() > 0;
      ia->batch_list_given = batch_list->count() > 0;
      run_infer(*a, *ia);
    });
  }
  {
    auto* c =
        sim->add_subcommand("calibrate",
                            "This machine as a cluster file: alpha/beta/gamma fitted to `conduit bench coll --json` "
                            "runs, GEMM speed measured with libtorch");
    auto a = std::make_shared<CalibrateArgs>();
    c->add_option("--bench", a->bench, "files of `conduit bench coll --json` lines (any ops, algorithms, sizes)")
        ->required();
    c->add_option("--gemm", a->gemm,
                  "JSON lines {m, n, k, gflops} of measured GEMMs and {kind: bench.conv, ...} of measured convolutions "
                  "(`conduit bench gemm --json`); with neither --gemm nor --peak, calibrate times them itself with "
                  "libtorch");
    c->add_option("--peak", a->peak, "compute rate instead of measured GEMMs (e.g. 80 GFLOP/s)");
    c->add_option(
        "--ranks", a->ranks,
        "workers of the cluster file; fits only bench samples of that world size (default: the world with the "
        "most usable samples, the largest on a tie)");
    c->add_option("--share", a->share,
                  "fraction of the measured speed each rank gets (default: min(1, cores / ranks) / min(1, cores / the "
                  "processes that timed the --gemm records together), so 1 under `conduit launch -n ranks`");
    auto* cbatch = c->add_option("--batch", a->batch, "samples per worker of the model GEMMs timed without --gemm")
                       ->capture_default_str();
    c->add_option("--transport", a->transport, "which transport's fit to write (default: the one with most samples)");
    c->add_option("--name", a->name, "cluster name")->capture_default_str();
    c->add_option("--out", a->out, "cluster YAML to write (default: stdout)");
    c->callback([a, cbatch]() {
      // (it sizes the kernels calibrate times itself: taken and ignored beside --gemm or --peak, -5 included)
      if (cbatch->count() > 0 && (!a->gemm.empty() || !a->peak.empty()))
        throw ConfigError(
            fmt::format("--batch sizes the kernels calibrate times itself, which {} replaces; allowed: "
                        "--batch without --gemm and --peak",
                        a->gemm.empty() ? "--peak" : "--gemm"));
      run_calibrate(*a);
    });
  }
  {
    auto* c = sim->add_subcommand(
        "cluster", "Job-scheduling simulation: FIFO, least-attained-service or SRTF; topology-aware placement");
    auto a = std::make_shared<ClusterArgs>();
    c->add_option("--cluster", a->cluster, "preset or YAML file")->capture_default_str();
    c->add_option("--gpus", a->gpus, "accelerators in the cluster (default: the file's nodes' count when it gives one)")
        ->capture_default_str()
        ->each([a](const std::string&) { a->gpus_given = true; });
    c->add_option("--jobs", a->jobs,
                  "job trace (CSV: id,submit_s,gpus,model,iterations[,global_batch]; global_batch empty or left out: "
                  "8 sequences per accelerator)")
        ->required();
    c->add_option("--scheduler", a->scheduler,
                  "fifo, las (Tiresias-style) or srtf (shortest predicted remaining GPU-time first: remaining "
                  "iterations x iteration time x accelerators)")
        ->capture_default_str();
    c->add_option("--placement", a->placement, "topology (fewest leaves) or spread (round-robin over leaves)")
        ->capture_default_str();
    auto* threshold =
        c->add_option("--las-threshold", a->las.las_first_threshold,
                      "las: attained accelerator-seconds that end the first queue; each next queue's threshold is x10")
            ->capture_default_str();
    auto* queues =
        c->add_option("--las-queues", a->las.las_queues, "las: number of priority queues")->capture_default_str();
    auto* penalty = c->add_option("--restart-penalty", a->las.restart_penalty,
                                  "las, srtf: seconds a preempted job spends reloading its checkpoint when it resumes")
                        ->capture_default_str();
    auto* knob = c->add_option("--promote-knob", a->las.las_promote_knob,
                               "las: Tiresias's starvation guard: a demoted job that waited this many times as long as "
                               "it ran goes back to the first queue (0: off)")
                     ->capture_default_str();
    auto* lease = c->add_option("--min-lease", a->las.min_lease,
                                "las, srtf: seconds a (re)started job trains before it can be preempted (0: none; "
                                "with a restart penalty far above the first queue's share, about the penalty)")
                      ->capture_default_str();
    c->add_flag("--json", a->json, "one JSON record");
    c->callback([a, threshold, queues, penalty, knob, lease]() {
      // A scheduler's options given to another were taken and ignored without a word.
      for (auto* o : {threshold, queues, knob, penalty, lease}) {
        const bool both = o == penalty || o == lease;
        if (o->count() > 0 && a->scheduler != "las" && (!both || a->scheduler != "srtf"))
          throw ConfigError(fmt::format("{} applies to --scheduler {}, not {}", o->get_name(),
                                        both ? "las or srtf" : "las", a->scheduler));
      }
      run_cluster(*a);
    });
  }
}

const bool kRegistered = register_command(70, setup);

}  // namespace
}  // namespace conduit::cli
