// Configuration of `conduit train`: defaults, YAML, flags, validation (torch-free).
#include "torch/config.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "coll/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "core/yaml_file.h"
#include "sync/ps.h"
#include "sync/straggler.h"
#include "sync/strategy.h"
#include "torch/metrics.h"
#include "torch/stages.h"
#ifdef CONDUIT_WITH_COMPRESS
#include "compress/compressor.h"
#endif

namespace conduit::train {
namespace {

[[noreturn]] void bad(const std::string& key, const std::string& value, const std::string& allowed) {
  throw ConfigError(fmt::format("config: {}: '{}' is not allowed; {}", key, value, allowed));
}

std::string one_of(const std::string& key, const std::string& v, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed)
    if (v == a) return v;
  std::string list;
  for (const char* a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
  bad(key, v, "allowed: " + list);
}

int64_t to_int(const std::string& key, const std::string& v, int64_t lo, int64_t hi) {
  int64_t x = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || p != v.data() + v.size() || x < lo || x > hi)
    bad(key, v, fmt::format("allowed: an integer from {} to {}", lo, hi));
  return x;
}

double to_double(const std::string& key, const std::string& v, double lo, double hi, bool lo_open,
                 const char* what) {
  double x = 0;
  size_t used = 0;
  try {
    // (as a person writes it: stod also took 0x1p-3, leading blanks, a '+', inf and nan)
    if (!v.empty() && v[0] != '+' && is_decimal(v, true)) x = std::stod(v, &used);
  } catch (...) {
    used = 0;
  }
  bool ok = used == v.size() && !v.empty() && std::isfinite(x) && (lo_open ? x > lo : x >= lo) && x <= hi;
  if (!ok) bad(key, v, fmt::format("allowed: {}", what));
  return x;
}

// "config: sync: unknown..." -> "unknown...": the message of a lower layer under this layer's own prefix.
std::string without_prefixes(std::string msg, std::initializer_list<const char*> prefixes) {
  for (bool again = true; again;) {
    again = false;
    for (const char* p : prefixes)
      if (msg.rfind(p, 0) == 0) {
        msg = msg.substr(std::string_view(p).size());
        again = true;
      }
  }
  return msg;
}

bool to_bool(const std::string& key, const std::string& v) {
  if (v == "true" || v == "1" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "0" || v == "no" || v == "off") return false;
  bad(key, v, "allowed: true or false");
}

}  // namespace

const std::vector<std::pair<std::string, std::string>>& config_keys() {
  static const std::vector<std::pair<std::string, std::string>> k = {
      {"model", "mlp | cnn | resnet | vit (a vision transformer, the model --tp splits) (default cnn)"},
      {"dataset", "fashion-mnist | mnist | synthetic (default fashion-mnist)"},
      {"data_dir", "folder with the IDX files (gzipped or not)"},
      {"workers", "local workers to start when not under mpirun/torchrun (default 4)"},
      {"transport", "auto | tcp | shm | mpi (default auto)"},
      {"compressor",
       "gradient compressor spec name[:key=value,...], e.g. none, fp16, ef:topk:ratio=0.01 "
       "(default powersgd:rank=4,wire=f16)"},
      {"optimizer",
       "sgd (with momentum) | adam | adamw (decoupled weight decay; DiLoCo's inner optimizer) (default sgd)"},
      {"lr",
       "learning rate for the global batch (> 0, default 0.1 with sgd, 0.001 with adam and adamw: PyTorch's "
       "Adam default)"},
      {"momentum", "SGD momentum in [0, 0.999999] (default 0.9)"},
      {"weight_decay", "L2 weight decay, in [0, 1]"},
      {"lr_schedule", "constant | step | cosine (default cosine)"},
      {"warmup_epochs", "linear warm-up length in epochs (>= 0)"},
      {"epochs", "number of epochs (>= 1, default 3)"},
      {"batch_size",
       "samples per worker per step; per data-parallel replica with tp or pp (a tensor-parallel group, a pipeline) "
       "(>= 1, default 64)"},
      {"seed",
       "seed of initialisation, shuffling and compressors (default 42; a sync scheme's own draws, e.g. "
       "adpsgd's peers, take the scheme's seed parameter: --sync adpsgd:seed=N)"},
      {"output", "output directory (default runs/<model>-<compressor>-<time>)"},
      {"target_accuracy", "test accuracy in [0, 1] whose first reach is timed in summary.json (0: none)"},
      {"bucket_cap_mb", "gradient bucket cap in MiB (default 25)"},
      {"first_bucket_mb", "cap of the first bucket in MiB (default 1), so communication starts early"},
      {"compress_min_bytes",
       "parameters whose gradient is smaller (bytes) skip the compressor and are allreduced "
       "uncompressed (default 0: none)"},
      {"overlap", "communicate buckets while backward runs (default true)"},
      {"tp",
       "tensor-parallel ranks a group (Megatron-style): the vit's attention heads and MLP split over them, data "
       "parallelism over the groups; 1, 2 or 4, dividing workers (default 1)"},
      {"sequence_parallel",
       "with tp: between the split layers each rank holds its share of the tokens (layer norms and residuals on "
       "it: less activation memory), the allreduces become allgathers and reduce-scatters of the tokens; pp 1 "
       "(default false)"},
      {"pp",
       "pipeline stages on as many ranks (tp each), data parallelism over the pipelines: the vit's 4 blocks cut "
       "into 1, 2 or 4; the mlp's 3, cnn's 4 and resnet's 5 layers or blocks into up to as many, balanced by their "
       "work; tp x pp dividing workers (default 1)"},
      {"micro_batches",
       "parts each batch is split into: they flow through the pipeline's stages at once; with pp 1, gradient "
       "accumulation (BatchNorm then normalises each part); 1 to batch_size, sync bsp (default 1)"},
      {"pp_schedule",
       "gpipe (every forward, then every backward) | 1f1b (one forward, one backward: activations of at most pp "
       "micro-batches held) | interleaved (Megatron's: each of 2 stages holds 2 chunks of the vit's blocks, a smaller "
       "bubble; micro_batches a multiple of pp) (default 1f1b)"},
      {"recompute",
       "pipeline stages keep only each micro-batch's input and compute its forward again in backward (activation "
       "recomputation); pp > 1 (default false)"},
      {"zero",
       "ZeRO stage of sync bsp: 0 | 1 (the optimizer state partitioned over the workers) | 2 (the gradients too) | "
       "3 (the parameters too, each layer gathered only while it runs; pp 1); compressor none (the default then), "
       "fp16 or bf16 (the reduce-scatter's wire) or int8 / int4 (int blocks by all-to-all, ZeRO++'s qgZ; ef:int8 / "
       "ef:int4 "
       "with error feedback: each worker keeps what its roundings took off, a residual the size of its whole gradient, "
       "and adds it to the next step's) (default 0)"},
      {"zero_prefetch",
       "with zero 1-3: gather parameters while other layers compute: at zero 3 the next layer while the current one "
       "runs (one layer ahead, forward and backward), at zero 1 and 2 the stepped slices behind the next forward, "
       "layer by layer; false: each gather blocks (default true)"},
      {"zero_gather",
       "with zero 3: the element type its parameter gathers travel in: f32 | bf16 | fp16 (half the gathers' bytes) | "
       "int8 (ZeRO++'s quantized weights: blocks of 256 with a scale each, about 25% of the bytes, more for layers "
       "under 256 elements a worker); forward and backward "
       "then run on the layers' weights rounded to it, the optimizer steps exact f32 slices (default f32)"},
      {"zero_hpz",
       "with zero 3: ZeRO++'s hpZ, a secondary partition over groups of this many consecutive data-parallel ranks "
       "(with tp every tp-th worker: a node's are its workers / tp): each keeps its share of every layer's weights "
       "from the layer's forward to its backward, whose gather then runs within the group (on the node's links; in the "
       "forward's 16-bit zero_gather, else f32: more bytes than int8 gathers'); a divisor of the data-parallel ranks "
       "below their number; node: a host's data-parallel workers (the host map's; none where one host holds them "
       "all); 0: none (default 0)"},
      {"zero_shard_group",
       "with zero 1-3: shard over groups of this many consecutive data-parallel ranks and replicate across the groups "
       "(FSDP's HYBRID_SHARD, MiCS; _HYBRID_SHARD_ZERO2 at zero 1-2): the gathers (zero 3), the reduce-scatter and "
       "the allgather of the stepped slices run within the group (a node's links when it is a node's workers / (tp x "
       "pp)), "
       "each slice's gradients averaged across the groups; each worker holds 1/group of what ZeRO partitions "
       "instead of 1/workers; a divisor of the data-parallel ranks from 2 to below "
       "their number; node: a host's data-parallel workers (the host map's; over all where one host holds them "
       "all); 0: shard over all (default 0)"},
      {"zero_allgather_mb",
       "with zero 1 or 2 and zero_prefetch: consecutive layers' parameters within one gradient bucket go in one call "
       "of the allgather behind the next forward until it carries at least this many MiB (DeepSpeed's "
       "allgather_bucket_size): fewer calls, each waited for by a layer's forward; 0: one call per layer and bucket "
       "(default 0)"},
      {"zero_reduce",
       "with zero 2 or 3 and micro_batches above 1: when the gradients are reduce-scattered; step: the micro-batches' "
       "gradients summed in whole-gradient buckets, reduced once after the last (as FSDP's no_sync: the whole "
       "gradient held until then); micro-batch: each micro-batch's buckets reduced as they fill and the slices summed "
       "(DeepSpeed's ZeRO-2 and 3: micro_batches times the reduce-scatter's bytes, 1/workers of the gradients held; "
       "with zero_shard_group the allreduce across the groups still goes once a step, as MiCS) (default step)"},
      {"trace", "write a Chrome trace per rank (trace-rank<R>.json) (default false)"},
      {"checkpoint_every",
       "steps between checkpoints; 0: at each epoch end under bsp, at the end of the run under other schemes "
       "(default 0)"},
      {"resume", "checkpoint directory to resume from"},
      {"max_steps", "stop after this many steps (0: no limit)"},
      {"train_limit", "use only the first N training samples (0: all)"},
      {"test_limit", "evaluate on the first N test samples (0: all)"},
      {"synthetic_samples", "training samples of the synthetic dataset"},
      {"progress", "rank 0 shows a progress bar (default true)"},
      {"timeout_s",
       "deadline of each collective in seconds (default 300); a local/diloco/easgd sync's is period times it"},
      {"drift_timeout_s",
       "the longest a worker waits for the others where they rightly drift apart by more than a step: ps-asp, "
       "ps-ssp (s > 0) and adpsgd's waits for slower workers, every scheme's meetings at checkpoints, the end and "
       "worker 0's evaluations, and a local/diloco/easgd sync (period x timeout_s, capped at it); a frozen or hung "
       "peer fails the run then; at least timeout_s (default 1800 or timeout_s, whichever is longer)"},
      {"time_limit_s",
       "the whole run's deadline in seconds, from the workers' start (mpirun's --timeout): workers still running "
       "then are stopped as on SIGTERM (no checkpoint is written) and conduit train exits 124; kept by conduit "
       "train itself, not by its workers (under mpirun or torchrun give theirs); 0: none (default 0)"},
      {"sync",
       "synchronization scheme name[:key=value,...]: bsp | local | diloco | easgd | dpsgd | sgp | adpsgd | "
       "ps-asp | ps-ssp | ps-bsp (default bsp; docs/sync.md)"},
      {"sync_period", "steps between synchronizations of local, diloco and easgd (0: the scheme's default)"},
      {"staleness", "ps-ssp staleness bound s: a worker more than s steps ahead of the slowest waits (-1: 3)"},
      {"slow",
       "straggler injection RANK:FACTOR[@P][,...]: those ranks' compute takes FACTOR times longer (RANK * for "
       "every rank; @P: each step with probability P)"},
      {"eval_every", "steps between extra test evaluations (0: at epoch ends only)"},
  };
  return k;
}

RawConfig read_yaml_config(const std::string& path) {
  const YAML::Node root = load_yaml_file(path, "config", "a YAML file");
  RawConfig raw;
  if (root.IsNull()) return raw;
  if (!root.IsMap()) throw ConfigError(fmt::format("config: '{}' must be a mapping of key: value", path));
  std::set<std::string> known;
  for (auto& [k, d] : config_keys()) known.insert(k);
  for (auto it = root.begin(); it != root.end(); ++it) {
    // (yaml-cpp's own "bad conversion" named neither the key nor the file, and exited 1)
    if (!it->first.IsScalar())
      throw ConfigError(fmt::format("config: '{}' line {}: a key that is not a name; allowed: key: value", path,
                                    it->first.Mark().line + 1));
    std::string key = it->first.as<std::string>();
    std::replace(key.begin(), key.end(), '-', '_');
    if (raw.count(key)) throw ConfigError(fmt::format("config: {} is given twice in {}; give it once", key, path));
    if (!known.count(key)) {
      std::string list;
      for (auto& [k, d] : config_keys()) list += (list.empty() ? "" : ", ") + k;
      throw ConfigError(fmt::format("config: unknown key '{}' in {}; allowed: {}", key, path, list));
    }
    const YAML::Node v = it->second;  // a copy: it->second is a temporary
    if ((key == "compressor" || key == "sync") && v.IsMap()) {
      // {name: topk, ratio: 0.01} -> "topk:ratio=0.01"; {name: local, period: 8} -> "local:period=8"
      std::string name, params;
      bool named = false;
      for (auto p = v.begin(); p != v.end(); ++p) {
        if (!p->first.IsScalar() || !p->second.IsScalar())
          throw ConfigError(
              fmt::format("config: {} in {} (line {}): each entry of its mapping must be name: value "
                          "with a single value, e.g. {}",
                          key, path, p->first.Mark().line + 1,
                          key == "sync" ? "{name: local, period: 8}" : "{name: topk, ratio: 0.01}"));
        auto pk = p->first.as<std::string>();
        if (pk == "name" && named)
          throw ConfigError(fmt::format("config: {} in {} (line {}): 'name' is given twice; give it once", key, path,
                                        p->first.Mark().line + 1));
        if (pk == "name") {
          name = p->second.as<std::string>();
          named = true;
        } else {
          params += (params.empty() ? "" : ",") + key_value(pk, p->second.as<std::string>());
        }
      }
      if (name.empty())
        throw ConfigError(fmt::format("config: {}: a mapping needs a 'name' key, e.g. {}", key,
                                      key == "sync" ? "{name: local, period: 8}" : "{name: topk, ratio: 0.01}"));
      raw[key] = params.empty() ? name : name + ":" + params;
    } else if (v.IsScalar()) {
      raw[key] = v.as<std::string>();
    } else if (v.IsNull()) {
      raw[key] = "";
    } else {
      throw ConfigError(fmt::format("config: {}: must be a single value in {}", key, path));
    }
  }
  return raw;
}

std::pair<std::string, std::map<std::string, std::string>> split_compressor_spec(const std::string& spec) {
  // Names may nest ("ef:topk:ratio=0.01"): the parameters follow the last ':' whose tail has an '='.
  std::map<std::string, std::string> params;
  auto colon = spec.rfind(':');
  if (colon == std::string::npos || spec.find('=', colon) == std::string::npos) return {spec, params};
  std::string name = spec.substr(0, colon);
  std::stringstream ss(spec.substr(colon + 1));
  std::string item;
  while (std::getline(ss, item, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos)
      throw ConfigError(fmt::format("config: compressor: '{}' is not key=value in '{}'", item, spec));
    if (!params.emplace(item.substr(0, eq), item.substr(eq + 1)).second)
      throw ConfigError(
          fmt::format("config: compressor: '{}' is given twice in '{}'; give it once", item.substr(0, eq), spec));
  }
  return {name, params};
}

void check_pipeline_pairs(const TrainConfig& c) {
  if (c.pp < 2) return;
  if (c.zero_reduce == "micro-batch")
    throw ConfigError(fmt::format(
        "config: zero_reduce: micro-batch with pp {}: not with pipelines (a micro-batch's backward waiting for its "
        "bucket's previous exchange would stall the schedule the stage's replicas need to reach it); allowed: pp 1, "
        "or zero_reduce step",
        c.pp));
  if (c.zero == 3)
    throw ConfigError(fmt::format(
        "config: zero: 3 gathers each layer's parameters for its forward and again for its backward, so a pipeline "
        "stage would gather its layers twice per micro-batch (DeepSpeed refuses the pair too); allowed with pp {}: "
        "zero 0, 1 or 2; or pp 1",
        c.pp));
}

TrainConfig resolve_config(const RawConfig& raw, int env_world, bool workers_given) {
  TrainConfig c;
  std::set<std::string> known;
  for (auto& [k, d] : config_keys()) known.insert(k);
  for (auto& [k, v] : raw) {
    if (!known.count(k)) throw ConfigError(fmt::format("config: unknown key '{}'", k));
  }
  auto get = [&](const char* k) -> const std::string* {
    auto it = raw.find(k);
    return it == raw.end() ? nullptr : &it->second;
  };
  if (auto v = get("model")) c.model = one_of("model", *v, {"mlp", "cnn", "resnet", "vit"});
  if (auto v = get("dataset")) c.dataset = one_of("dataset", *v, {"fashion-mnist", "mnist", "synthetic"});
  if (auto v = get("data_dir")) c.data_dir = *v;
  else if (c.dataset == "mnist") c.data_dir = "/usr/share/datasets/mnist";
  if (auto v = get("workers")) c.workers = static_cast<int>(to_int("workers", *v, 1, 1024));
  if (auto v = get("transport")) c.transport = one_of("transport", *v, {"auto", "tcp", "shm", "mpi"});
  if (auto v = get("compressor")) {
    if (v->empty()) bad("compressor", *v, "allowed: a compressor spec such as none, fp16 or powersgd:rank=4");
    c.compressor = *v;
  }
#ifdef CONDUIT_WITH_COMPRESS
  try {
    // (int4 is ZeRO's reduce-scatter wire only, checked with zero below)
    if (zero_int_wire(c.compressor).bits != 4) compress::parse_compressor(c.compressor);
  } catch (const Error& e) {
    std::string msg = e.what();
    if (msg.rfind("config: ", 0) == 0) msg = msg.substr(8);
    throw ConfigError(fmt::format("config: compressor: {}", msg));
  }
#else
  if (c.compressor != "none") bad("compressor", c.compressor, "allowed: none (built without src/compress)");
#endif
  if (auto v = get("optimizer")) c.optimizer = one_of("optimizer", *v, {"sgd", "adam", "adamw"});
  if (auto v = get("lr"))
    c.lr = to_double("lr", *v, 0, 1e3, true, "a number > 0 and <= 1000");
  else if (c.optimizer != "sgd")  // (sgd's 0.1 took Adam's cnn to 10% accuracy in one epoch)
    c.lr = 0.001;
  if (auto v = get("momentum")) c.momentum = to_double("momentum", *v, 0, 0.999999, false, "a number in [0, 0.999999]");
  if (get("momentum") && c.optimizer != "sgd")  // (adam's betas are its own; the value was dropped without a word)
    throw ConfigError(fmt::format("config: momentum: applies to optimizer sgd, not {}; allowed with {}: leave it unset",
                                  c.optimizer, c.optimizer));
  if (auto v = get("weight_decay")) c.weight_decay = to_double("weight_decay", *v, 0, 1, false, "a number in [0, 1]");
  if (auto v = get("lr_schedule")) c.lr_schedule = one_of("lr_schedule", *v, {"constant", "step", "cosine"});
  if (auto v = get("warmup_epochs"))
    c.warmup_epochs = to_double("warmup_epochs", *v, 0, 1e6, false, "a number from 0 to 1000000");
  if (auto v = get("epochs")) c.epochs = static_cast<int>(to_int("epochs", *v, 1, 1000000));
  if (auto v = get("batch_size")) c.batch_size = static_cast<int>(to_int("batch_size", *v, 1, 1 << 20));
  if (auto v = get("seed")) c.seed = static_cast<uint64_t>(to_int("seed", *v, 0, INT64_MAX));
  if (auto v = get("output")) {
    if (v->empty()) bad("output", *v, "allowed: a directory path (leave it unset for runs/<model>-<time>)");
    c.output = *v;
  }
  if (auto v = get("target_accuracy"))
    c.target_accuracy = to_double("target_accuracy", *v, 0, 1, false, "a fraction in [0, 1] (0: none), e.g. 0.9");
  if (auto v = get("bucket_cap_mb"))
    c.bucket_cap_mb = to_double("bucket_cap_mb", *v, 0, 1 << 20, true, "a size in MiB > 0 and <= 1048576");
  if (auto v = get("first_bucket_mb"))
    c.first_bucket_mb = to_double("first_bucket_mb", *v, 0, 1 << 20, true, "a size in MiB > 0 and <= 1048576");
  // The caps become whole bytes: under one byte they would be 0 (each worker then failed at start).
  for (auto [key, mb] : {std::pair<const char*, double>{"bucket_cap_mb", c.bucket_cap_mb},
                         std::pair<const char*, double>{"first_bucket_mb", c.first_bucket_mb}})
    if (mb * 1024 * 1024 < 1)
      throw ConfigError(
          fmt::format("config: {}: {} MiB is under one byte; allowed: a size in MiB from 1e-6 (one "
                      "byte) to 1048576",
                      key, mb));
  if (auto v = get("compress_min_bytes"))
    c.compress_min_bytes = to_int("compress_min_bytes", *v, 0, INT64_MAX);
  if (auto v = get("overlap")) c.overlap = to_bool("overlap", *v);
  if (auto v = get("tp")) {
    c.tp = std::stoi(one_of("tp", *v, {"1", "2", "4"}));  // (they divide the vit's 4 attention heads)
    if (c.tp > 1 && c.model != "vit")
      throw ConfigError(
          fmt::format("config: tp: {} splits the vit's attention heads and MLP, model {} has none; "
                      "allowed with model {}: tp 1",
                      c.tp, c.model, c.model));
  }
  if (auto v = get("pp")) {
    // The vit's stages split its 4 blocks evenly; the other models' are runs of their units (stage_bounds).
    if (c.model == "vit")
      c.pp = std::stoi(one_of("pp", *v, {"1", "2", "4"}));
    else
      c.pp = static_cast<int>(to_int("pp", *v, 1, 1 << 20));
    if (c.pp > 1 && c.model != "vit") stage_bounds(c.model, c.pp);  // (more stages than units: its one line)
  }
  if (auto v = get("micro_batches")) c.micro_batches = static_cast<int>(to_int("micro_batches", *v, 1, 1 << 20));
  if (c.micro_batches > c.batch_size)
    throw ConfigError(fmt::format("config: micro_batches: {} parts of a batch of {}; allowed: 1 to batch_size ({})",
                                  c.micro_batches, c.batch_size, c.batch_size));
  if (auto v = get("pp_schedule")) c.pp_schedule = one_of("pp_schedule", *v, {"gpipe", "1f1b", "interleaved"});
  if (c.pp < 2 && c.pp_schedule != TrainConfig().pp_schedule)
    throw ConfigError(
        fmt::format("config: pp_schedule: {} orders the micro-batches of a pipeline's stages, this run "
                    "has none (pp 1); allowed with pp 1: leave it unset",
                    c.pp_schedule));
  if (c.pp_schedule == "interleaved" && (c.pp != 2 || c.model != "vit"))
    throw ConfigError(
        fmt::format("config: pp_schedule: interleaved gives each stage 2 or more chunks of the vit's 4 "
                    "blocks, this run has model {} and pp {}; allowed: model vit and pp 2, or gpipe or 1f1b",
                    c.model, c.pp));
  if (c.pp_schedule == "interleaved" && c.micro_batches % c.pp != 0)
    throw ConfigError(
        fmt::format("config: micro_batches: {} is not a multiple of pp ({}): the interleaved schedule "
                    "takes micro-batches in groups of the stages; allowed: a multiple of {}",
                    c.micro_batches, c.pp, c.pp));
  if (auto v = get("sequence_parallel")) c.sequence_parallel = to_bool("sequence_parallel", *v);
  if (c.sequence_parallel && c.tp < 2)
    throw ConfigError(
        "config: sequence_parallel: splits the tokens over a tensor-parallel group, this run has none (tp 1); "
        "allowed with tp 1: sequence_parallel false");
  if (c.sequence_parallel && c.pp > 1)
    throw ConfigError(fmt::format(
        "config: sequence_parallel: a pipeline stage sends whole activations (tokens x width) to the next, not a "
        "rank's share of the tokens; allowed with pp {}: sequence_parallel false",
        c.pp));
  if (auto v = get("recompute")) c.recompute = to_bool("recompute", *v);
  if (c.recompute && c.pp < 2)
    throw ConfigError(
        "config: recompute: recomputes the forward of a pipeline stage's micro-batches, this run has no pipeline "
        "(pp 1: each micro-batch's backward follows its forward); allowed with pp 1: recompute false");
  if (auto v = get("zero")) {
    c.zero = static_cast<int>(to_int("zero", *v, 0, 3));
    // ZeRO reduce-scatters the gradients (f32, fp16 or bf16 on the wire, or int8 blocks by all-to-all): the
    // default compressor gives way, another one asked for is refused.
    if (c.zero > 0 && !get("compressor")) c.compressor = "none";
    if (c.zero > 0 && c.compressor != "none" && c.compressor != "fp16" && c.compressor != "bf16" &&
        zero_int_wire(c.compressor).bits == 0)
      throw ConfigError(
          fmt::format("config: zero: {} reduce-scatters the gradients, compressor {} cannot "
                      "go with it; allowed with zero {}: compressor none, fp16, bf16, int8 or int4 (without "
                      "parameters: the reduce-scatter's wire), ef:int8 or ef:int4 (with error feedback); or zero 0",
                      c.zero, c.compressor, c.zero));
  }
  if (zero_int_wire(c.compressor).bits == 4 && c.zero == 0)
    throw ConfigError(fmt::format(
        "config: compressor: {} is ZeRO's reduce-scatter wire (int4 blocks by all-to-all, ZeRO++'s qgZ), this run "
        "has zero 0; allowed with zero 0: a compressor spec such as int8, qsgd or powersgd:rank=4; or zero 1, 2 or 3",
        c.compressor));
  if (auto v = get("zero_prefetch")) {
    c.zero_prefetch = to_bool("zero_prefetch", *v);
    if (c.zero == 0)
      throw ConfigError(
          "config: zero_prefetch: gathers parameters ahead under zero 1, 2 or 3, this run has zero 0, which keeps "
          "them whole on every rank; allowed with zero 0: leave it unset");
  }
  if (auto v = get("zero_gather")) {
    if (*v != "f32" && *v != "bf16" && *v != "fp16" && *v != "int8")
      throw ConfigError(fmt::format("config: zero_gather: '{}' (allowed: f32, bf16, fp16 or int8)", *v));
    c.zero_gather = *v;
    if (c.zero != 3 && c.zero_gather != "f32")
      throw ConfigError(fmt::format(
          "config: zero_gather: {} is the wire of ZeRO-3's parameter gathers, this run has zero {}; allowed with "
          "zero {}: f32, or leave it unset",
          c.zero_gather, c.zero, c.zero));
  }
  // ZeRO-3's groups of consecutive data-parallel workers: a size, or node (kHostGroup: a host's, which the trainer
  // resolves from the communicator's host map).
  auto zero3_group = [&](const char* key, const std::string& v, const char* none) {
    if (v == "node") return kHostGroup;
    int64_t x = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec != std::errc() || p != v.data() + v.size() || x < 0 || x > 1024)
      bad(key, v,
          fmt::format("allowed: node (the data-parallel workers of one host), 0 or 1 ({}), or a group size up to 1024",
                      none));
    return static_cast<int>(x);
  };
  if (auto v = get("zero_hpz")) {
    c.zero_hpz = zero3_group("zero_hpz", *v, "none");
    if (zero3_group_set(c.zero_hpz) && c.zero != 3)
      throw ConfigError(fmt::format(
          "config: zero_hpz: {} is a secondary partition of ZeRO-3's parameters, this run has zero {}; allowed with "
          "zero {}: 0 or 1 (none), or leave it unset",
          zero3_group_text(c.zero_hpz), c.zero, c.zero));
  }
  if (auto v = get("zero_shard_group")) {
    c.zero_shard_group = zero3_group("zero_shard_group", *v, "shard over all");
    if (zero3_group_set(c.zero_shard_group) && c.zero == 0)
      throw ConfigError(fmt::format(
          "config: zero_shard_group: {} shards ZeRO's state within groups, this run has zero 0; allowed with zero 0: "
          "0 or 1 (shard over all), or leave it unset; or zero 1, 2 or 3",
          zero3_group_text(c.zero_shard_group)));
    if (zero3_group_set(c.zero_shard_group) && zero3_group_set(c.zero_hpz))
      throw ConfigError(fmt::format(
          "config: zero_shard_group: {} with zero_hpz {}: the gathers run within the shard group already; allowed: "
          "one of them",
          zero3_group_text(c.zero_shard_group), zero3_group_text(c.zero_hpz)));
  }
  if (auto v = get("zero_allgather_mb")) {
    c.zero_allgather_mb = to_double("zero_allgather_mb", *v, 0, 1 << 20, false,
                                    "a size in MiB >= 0 and <= 1048576 (0: one call a layer)");
    if (c.zero_allgather_mb > 0 && c.zero != 1 && c.zero != 2)
      throw ConfigError(fmt::format(
          "config: zero_allgather_mb: {} sizes the calls of zero 1 and 2's allgather behind the next forward, this run "
          "has zero {}; allowed with zero {}: 0, or leave it unset",
          c.zero_allgather_mb, c.zero, c.zero));
  }
  if (auto v = get("zero_reduce")) {
    if (*v != "step" && *v != "micro-batch") bad("zero_reduce", *v, "allowed: step, micro-batch");
    c.zero_reduce = *v;
    // (as sim step refuses it: where either value changes nothing)
    if ((c.zero != 2 && c.zero != 3) || c.micro_batches < 2)
      throw ConfigError(fmt::format(
          "config: zero_reduce: {} is when zero 2 or 3 reduce-scatters a step's micro-batches, this run has zero {} "
          "and micro_batches {}; allowed with them: leave it unset",
          c.zero_reduce, c.zero, c.micro_batches));
    check_pipeline_pairs(c);
    if (c.zero_reduce == "micro-batch" && !c.overlap)
      throw ConfigError(
          "config: zero_reduce: micro-batch reduces each micro-batch's buckets as they fill, which overlap: false "
          "leaves to the end of the step; allowed: overlap true, or zero_reduce step");
  }
  if (auto v = get("trace")) c.trace = to_bool("trace", *v);
  if (auto v = get("checkpoint_every"))
    c.checkpoint_every = static_cast<int>(to_int("checkpoint_every", *v, 0, INT32_MAX));
  if (auto v = get("resume")) {
    if (v->empty()) bad("resume", *v, "allowed: a checkpoint directory (<output>/checkpoint), or leave it unset");
    c.resume = *v;
  }
  if (auto v = get("max_steps")) c.max_steps = to_int("max_steps", *v, 0, INT64_MAX);
  if (auto v = get("train_limit")) c.train_limit = to_int("train_limit", *v, 0, INT64_MAX);
  if (auto v = get("test_limit")) c.test_limit = to_int("test_limit", *v, 0, INT64_MAX);
  if (auto v = get("synthetic_samples"))
    c.synthetic_samples = to_int("synthetic_samples", *v, 1, 2000000);  // 1.6 GB of images per worker
  if (auto v = get("progress")) c.progress = to_bool("progress", *v);
  if (auto v = get("timeout_s"))
    c.timeout_s = to_double("timeout_s", *v, 0.001, 1e7, false, "seconds from 0.001 to 10000000");
  if (auto v = get("drift_timeout_s")) {
    c.drift_timeout_s =
        to_double("drift_timeout_s", *v, 0.001, 1e7, false, "seconds from 0.001 to 10000000, at least timeout_s");
    if (c.drift_timeout_s < c.timeout_s)
      bad("drift_timeout_s", *v,
          fmt::format("allowed: at least timeout_s ({:g} s): where workers drift apart they wait at least as long as "
                      "in step",
                      c.timeout_s));
  } else {
    c.drift_timeout_s = std::max(c.drift_timeout_s, c.timeout_s);  // (the default under a longer timeout_s)
  }
  if (auto v = get("time_limit_s")) {
    const char* allowed = "0 (none) or seconds from 0.001 to 10000000";
    c.time_limit_s = to_double("time_limit_s", *v, 0, 1e7, false, allowed);
    if (c.time_limit_s > 0 && c.time_limit_s < 0.001) bad("time_limit_s", *v, fmt::format("allowed: {}", allowed));
  }
  if (auto v = get("sync")) {
    if (v->empty()) bad("sync", *v, "allowed: a sync scheme such as bsp, local:period=8 or ps-ssp:staleness=2");
    c.sync = *v;
  }
  if (auto v = get("sync_period")) c.sync_period = to_int("sync_period", *v, 0, 1 << 24);
  if (auto v = get("staleness")) c.staleness = to_int("staleness", *v, -1, 1 << 30);
  if (auto v = get("slow")) c.slow = *v;
  if (auto v = get("eval_every")) c.eval_every = to_int("eval_every", *v, 0, INT64_MAX);
  // Schemes other than bsp average parameters, not gradients: the default gradient compressor does not apply.
  if (c.sync.substr(0, c.sync.find(':')) != "bsp" && !get("compressor")) c.compressor = "none";
  // DGC (Lin et al. 2018) corrects momentum locally: the compressor accumulates the velocity (momentum factor
  // masking included) and sends its largest entries, so the optimizer must not add momentum a second time. Signum
  // (Bernstein et al. 2018) votes on the signs of each rank's momentum and steps by lr times the vote (an audit found
  // the optimizer's momentum 0.9 stacked on it: ten times the step, lagged twice). Either takes the trainer's
  // momentum unless the spec sets its own, and the optimizer then runs plain SGD.
  if (const std::string owner = momentum_compressor(c.compressor); !owner.empty()) {
    if (c.optimizer != "sgd")
      throw ConfigError(
          fmt::format("config: optimizer: {} with compressor {}, which applies SGD momentum itself "
                      "({}); allowed: sgd",
                      c.optimizer, owner, owner == "dgc" ? "momentum correction" : "signs of the momentum"));
    const auto params = split_compressor_spec(c.compressor).second;
    if (!params.count("momentum")) {
      c.compressor += fmt::format("{}momentum={}", c.compressor.find(':') == std::string::npos ? ":" : ",",
                                  c.momentum);
    } else {
      char* end = nullptr;
      const std::string& m = params.at("momentum");
      const double in_spec = std::strtod(m.c_str(), &end);
      // Both given and different: one of them would be dropped without a word (a resumed dgc run's compressor
      // carries its momentum, so a new --momentum was ignored).
      if (get("momentum") && (end == m.c_str() || *end != '\0' || in_spec != c.momentum))
        throw ConfigError(
            fmt::format("config: momentum: {} given, and compressor {} sets momentum={}; allowed: one "
                        "of the two, or the same value in both",
                        c.momentum, c.compressor, m));
      // The run's momentum is the spec's, so that what is written (config.yaml for the workers, the checkpoint)
      // says one value (the workers read the trainer's default beside the spec as a second one and refused it).
      if (end != m.c_str() && *end == '\0') c.momentum = in_spec;
    }
  }
  if (c.warmup_epochs > c.epochs)
    throw ConfigError(
        fmt::format("config: warmup_epochs: {} is longer than the run's {} epochs (the learning rate would "
                    "never reach lr); allowed: 0 to {}",
                    c.warmup_epochs, c.epochs, c.epochs));
  if (env_world > 0 && workers_given && c.workers != env_world) {
    throw ConfigError(fmt::format(
        "config: workers: {} does not match WORLD_SIZE={} of the launcher that started this process; allowed: {} "
        "or leave workers unset",
        c.workers, env_world, env_world));
  }
  if (env_world > 0) c.workers = env_world;
  if (c.resume.size() && !std::filesystem::exists(std::filesystem::path(c.resume) / "checkpoint.json"))
    throw ConfigError(
        fmt::format("config: resume: '{}' holds no checkpoint.json; allowed: a checkpoint directory "
                    "written by conduit train (<output>/checkpoint)",
                    c.resume));
  if (c.tp > 1 && c.workers % c.tp != 0)
    throw ConfigError(
        fmt::format("config: tp: {} ranks a group do not divide the {} workers; allowed: workers a "
                    "multiple of tp",
                    c.tp, c.workers));
  if (c.tp > 1 && !effective_sync(c).bsp())
    throw ConfigError(
        fmt::format("config: tp: {} needs sync bsp (the groups' ranks step together), not {}; allowed "
                    "with sync {}: tp 1",
                    c.tp, effective_sync(c).name, effective_sync(c).name));
  if (c.tp * c.pp > 1 && c.workers % (c.tp * c.pp) != 0)
    throw ConfigError(
        fmt::format("config: pp: {} stages of {} rank{} (tp) do not divide the {} workers; allowed: workers a "
                    "multiple of tp x pp ({})",
                    c.pp, c.tp, c.tp > 1 ? "s" : "", c.workers, c.tp * c.pp));
  // One data-parallel rank exchanges its gradients with nobody: the default compressor would only make them lossy
  // (Horovod and DDP skip the exchange at world 1). One asked for is kept (its effect on accuracy is a question
  // worth asking) and the trainer says it saves nothing.
  if (c.workers / (c.tp * c.pp) == 1 && !get("compressor")) c.compressor = "none";
  if (c.output.empty()) c.output = default_output_dir(c);
  if ((c.pp > 1 || c.micro_batches > 1) && !effective_sync(c).bsp()) {
    const char* key = c.pp > 1 ? "pp" : "micro_batches";
    const std::string scheme = effective_sync(c).name;
    throw ConfigError(fmt::format(
        "config: {}: {} needs sync bsp (one optimizer step a batch, every micro-batch's gradient in it), not {}; "
        "allowed with sync {}: {} 1",
        key, c.pp > 1 ? c.pp : c.micro_batches, scheme, scheme, key));
  }
  check_pipeline_pairs(c);
  if (c.zero_hpz > 1 && (c.workers / c.tp % c.zero_hpz != 0 || c.zero_hpz >= c.workers / c.tp))  // (node: resolved)
    throw ConfigError(fmt::format(
        "config: zero_hpz: groups of {} do not divide the {} data-parallel workers (workers {} / tp {}) into two or "
        "more; allowed: 0 or 1 (none), or a divisor of {} below it",
        c.zero_hpz, c.workers / c.tp, c.workers, c.tp, c.workers / c.tp));
  const int dp_workers = c.workers / (c.tp * c.pp);
  if (c.zero_shard_group > 1 && (dp_workers % c.zero_shard_group != 0 || c.zero_shard_group >= dp_workers))
    throw ConfigError(fmt::format(
        "config: zero_shard_group: groups of {} do not divide the {} data-parallel workers (workers {} / (tp {} x pp "
        "{})) into two or more; allowed: 0 or 1 (shard over all), or a divisor of {} below it",
        c.zero_shard_group, dp_workers, c.workers, c.tp, c.pp, dp_workers));
  if (c.zero > 0 && !effective_sync(c).bsp())
    throw ConfigError(
        fmt::format("config: zero: {} partitions the optimizer of sync bsp, not of {}; allowed with "
                    "sync {}: zero 0",
                    c.zero, effective_sync(c).name, effective_sync(c).name));
  effective_sync(c);  // names and applicability (values: check_sync_config)
  std::map<int, sync::Slowdown> slow;
  try {
    slow = sync::parse_slow(c.slow, c.workers);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("config: slow: {}; allowed: RANK:FACTOR[@P][,...] with RANK < workers or "
                                  "*, FACTOR in [1, 1000] and P in (0, 1]",
                                  without_prefixes(e.what(), {"config: ", "--slow: "})));
  }
  // Dedicated parameter servers (the last ranks) take no training steps to slow: the flag was accepted and did
  // nothing, while the summary said the rank was slowed.
  const int trainers = training_workers(c);
  for (const auto& [rank, how] : slow)
    if (rank != sync::kEveryRank && rank >= trainers)
      throw ConfigError(
          fmt::format("config: slow: rank {} is a parameter server under sync {} (ranks {} to {} serve, "
                      "training nothing); allowed: a training rank 0 to {}, or *",
                      rank, effective_sync(c).to_string(), trainers, c.workers - 1, trainers - 1));
  return c;
}

std::string SyncSpec::to_string() const {
  std::string s = name;
  char sep = ':';
  for (const auto& [k, v] : params) {
    s += sep + key_value(k, v);
    sep = ',';
  }
  return s;
}

int training_workers(const TrainConfig& c) {
  const SyncSpec s = effective_sync(c);
  if (!s.parameter_server()) return c.workers;
  auto colocate = s.params.find("colocate");
  if (colocate == s.params.end() || !sync::same_param_value(colocate->second, "0")) return c.workers;
  // The scheme's own default count when none is given (1).
  auto servers = s.params.find("servers");
  const std::string count = servers != s.params.end() ? servers->second : sync::strategy_defaults(s.name).at("servers");
  int n = 0;
  const auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), n);
  // (a bad count is the scheme's to refuse, with its own message)
  if (ec != std::errc() || end != count.data() + count.size() || n < 1 || n >= c.workers) return c.workers;
  return c.workers - n;
}

std::string momentum_compressor(const std::string& compressor) {
  const std::string name = compressor.substr(0, compressor.find(':'));
  return name == "dgc" || name == "signum" ? name : "";
}

double optimizer_momentum(const TrainConfig& c) { return momentum_compressor(c.compressor).empty() ? c.momentum : 0.0; }

SyncSpec effective_sync(const TrainConfig& c) {
  SyncSpec s;
  auto colon = c.sync.find(':');
  s.name = c.sync.substr(0, colon);
  if (colon != std::string::npos) {
    try {
      s.params = parse_key_values(c.sync.substr(colon + 1), [&](const std::string& kv) {
        return fmt::format("config: sync: '{}' in '{}' is not key=value (e.g. local:period=8)", kv, c.sync);
      });
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      if (what.rfind("config: ", 0) == 0) throw;
      throw ConfigError(fmt::format("config: sync: {} (in '{}')", what, c.sync));
    }
  }
  sync::Params defaults;
  try {
    defaults = sync::strategy_defaults(s.name);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("config: sync: {}", without_prefixes(e.what(), {"config: ", "sync: "})));
  }
  for (const auto& [k, v] : s.params) {
    if (!defaults.count(k)) {
      std::string allowed;
      for (const auto& [dk, dv] : defaults) allowed += (allowed.empty() ? "" : ", ") + dk;
      throw ConfigError(fmt::format("config: sync: scheme {} has no parameter '{}'; allowed: {}", s.name, k,
                                    allowed.empty() ? "none" : allowed));
    }
  }
  auto set = [&](const std::string& key, const std::string& value, const char* from) {
    auto it = s.params.find(key);
    // (by value: period=08 and --sync-period 8 agree, as a resume compares them)
    if (it != s.params.end() && !sync::same_param_value(it->second, value))
      throw ConfigError(fmt::format("config: {}: {} contradicts {}={} of sync '{}'; allowed: give it once", from,
                                    value, key, it->second, c.sync));
    s.params[key] = value;
  };
  // A key filled in from the trainer's own settings: `derive` where the spec may give another value, `set_from`
  // where it must agree (the compressor); either way recorded as derived unless the spec gave it.
  auto derive = [&](const std::string& key, const std::string& value) {
    if (s.params.try_emplace(key, value).second) s.derived.insert(key);
  };
  auto set_from = [&](const std::string& key, const std::string& value, const char* from) {
    if (!s.params.count(key)) s.derived.insert(key);
    set(key, value, from);
  };
  if (c.sync_period > 0) {
    if (!defaults.count("period"))
      throw ConfigError(fmt::format("config: sync_period: scheme {} has no period; allowed with local, diloco, "
                                    "easgd",
                                    s.name));
    set("period", std::to_string(c.sync_period), "sync_period");
  }
  if (c.staleness >= 0) {
    if (!defaults.count("staleness"))
      throw ConfigError(fmt::format("config: staleness: scheme {} has no staleness bound; allowed with ps-ssp",
                                    s.name));
    set("staleness", std::to_string(c.staleness), "staleness");
  }
  const bool compressed = c.compressor != "none";
  if (!s.bsp() && c.compress_min_bytes > 0)
    throw ConfigError(fmt::format("config: compress_min_bytes: applies to bsp's gradient buckets, not to {}; "
                                  "allowed with {}: 0",
                                  s.name, s.name));
  if (!s.bsp() && c.compressor.substr(0, c.compressor.find(':')) == "dgc")
    throw ConfigError(
        fmt::format("config: compressor: dgc corrects the momentum of gradients averaged by bsp, but {} "
                    "sends {}; allowed with {}: {}",
                    s.name, s.parameter_server() ? "gradients to servers that own the momentum" : "parameters", s.name,
                    s.parameter_server() ? "a compressor without momentum (e.g. ef:topk)"
                    : s.name == "dpsgd"  ? "a compressor without state (e.g. topk)"
                                         : "none (it averages parameters uncompressed)"));
  if (s.parameter_server()) {
    // Stale gradients act as extra momentum: ps-asp with the trainer's 0.9 and one shared momentum on the servers
    // diverged on the Fashion-MNIST CNN with one worker 3x slow (10% accuracy from step 50), and so did ps-ssp with
    // s = 3. So the stale schemes (ps-asp; ps-ssp with s > 0; s = 0 is bsp) default to dana=1: one momentum per
    // worker and gradients taken at the estimated future position (sync/ps.h), with the trainer's lr and momentum.
    // Seed 42, --slow 3:3: 88% in 0.80x bsp's time and 90.75% after 3 epochs (bsp 90.65%), where the shared
    // momentum needed half the effective step at momentum 0.5 (1.53x, 88.81%) and the whole step at momentum 0.5
    // diverged (so does bsp at lr 0.5, momentum 0.5). dana=0 keeps that half-step rule.
    double lr = c.lr, momentum = c.momentum;
    auto staleness = s.params.find("staleness");
    auto is_zero = [](const std::string& v) {  // "0", "00", ...: s = 0 (a bad value is named by the scheme later)
      long long x = -1;
      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
      return ec == std::errc() && end == v.data() + v.size() && x == 0;
    };
    const bool stale = s.name == "ps-asp" ||
                       (s.name == "ps-ssp" && (staleness == s.params.end() || !is_zero(staleness->second)));
    if (stale) s.params.try_emplace("dana", "1");
    auto dana = s.params.find("dana");
    const bool lookahead = dana != s.params.end() && (dana->second == "1" || dana->second == "true");
    if (stale && !lookahead && !s.params.count("momentum") && momentum > 0.5) {
      if (!s.params.count("lr")) lr = 0.5 * c.lr * (1 - 0.5) / (1 - momentum);
      momentum = 0.5;
    }
    derive("lr", fmt::format("{:.6g}", lr));
    derive("momentum", fmt::format("{:.6g}", momentum));
    // The servers' range, checked here where their values are the trainer's: the scheme's own check named its
    // parameter, which the user never set ("sync: ps-bsp: parameter 'momentum' = '0.99995' must be a number in [0,
    // 0.9999]" for --momentum 0.99995). (As written for the scheme, which is what it reads.)
    if (s.derived.count("momentum") && std::stod(s.params.at("momentum")) > sync::kPsMaxMomentum)
      throw ConfigError(
          fmt::format("config: momentum: {} with sync {}: the parameter servers' momentum is at most {}; "
                      "allowed with {}: a momentum in [0, {}]",
                      c.momentum, s.name, sync::kPsMaxMomentum, s.name, sync::kPsMaxMomentum));
    if (const double servers_lr = s.derived.count("lr") ? std::stod(s.params.at("lr")) : sync::kPsMinLr;
        !(servers_lr >= sync::kPsMinLr && servers_lr <= sync::kPsMaxLr)) {
      if (lr == c.lr)  // (the trainer's lr is at most 1000)
        throw ConfigError(
            fmt::format("config: lr: {} with sync {}: the parameter servers' lr is at least {:g}; "
                        "allowed with {}: an lr in [{:g}, 1000]",
                        c.lr, s.name, sync::kPsMinLr, s.name, sync::kPsMinLr));
      throw ConfigError(fmt::format(
          "config: lr: {} with momentum {} under sync {} (dana=0) gives the parameter servers lr {:g} (scaled by "
          "0.25 / (1 - momentum) to keep the step at their momentum 0.5); allowed: a servers' lr in [{:g}, {:g}]: "
          "another lr or momentum, or the scheme's own lr",
          c.lr, c.momentum, s.name, servers_lr, sync::kPsMinLr, sync::kPsMaxLr));
    }
    derive("weight_decay", fmt::format("{}", c.weight_decay));
    s.params.try_emplace("colocate", "1");
    // (true and false are the scheme's flags too: colocate=true left servers at 1, all the work on rank 0, and
    // colocate=false skipped the resume refusal, to fail later naming a missing checkpoint; an audit)
    // Co-located: one shard per worker spreads the servers' work (and traffic) evenly, as BytePS does.
    if (sync::same_param_value(s.params["colocate"], "1")) s.params.try_emplace("servers", std::to_string(c.workers));
    if (!c.resume.empty() && sync::same_param_value(s.params["colocate"], "0"))
      throw ConfigError(fmt::format("config: resume: {} with dedicated server ranks (colocate=0) keeps the model on "
                                    "ranks that are not checkpointed; allowed: colocate=1",
                                    s.name));
    if (compressed) set_from("push_compressor", c.compressor, "compressor");  // (checked on its own at a resume)
    if (c.optimizer != "sgd")
      throw ConfigError(fmt::format("config: optimizer: {} runs on the workers, but {} servers own the optimizer "
                                    "(SGD with momentum); allowed: sgd",
                                    c.optimizer, s.name));
  } else if (s.name == "dpsgd") {
    if (compressed) set_from("compressor", c.compressor, "compressor");
  } else if (!s.bsp() && compressed) {
    throw ConfigError(fmt::format("config: compressor: {} averages parameters, not gradients, so '{}' does not "
                                  "apply; allowed: none, or a scheme that compresses (bsp, dpsgd, ps-*)",
                                  s.name, c.compressor));
  }
  s.drift_timeout_s = c.drift_timeout_s;
  return s;
}

void check_sync_config(const TrainConfig& c) {
  SyncSpec s = effective_sync(c);
  if (s.bsp()) return;
  auto comms = coll::Communicator::inproc(c.workers);
  try {
    sync::make_strategy(s.name, s.params, comms[0]);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("config: sync: {}", without_prefixes(e.what(), {"config: ", "sync "})));
  }
}

void check_dataset(const TrainConfig& c) {
  if (c.dataset == "synthetic") return;
  namespace fs = std::filesystem;
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                        "t10k-labels-idx1-ubyte"}) {
    fs::path p = fs::path(c.data_dir) / f;
    if (!fs::exists(p) && !fs::exists(p.string() + ".gz")) {
      // (Debian packages Fashion-MNIST only: MNIST's files come from its own site)
      throw ConfigError(fmt::format(
          "config: data_dir: '{}' has no {}[.gz]; allowed: a folder with the four MNIST-format IDX files ({}) "
          "or dataset: synthetic",
          c.data_dir, f,
          c.dataset == "fashion-mnist" ? "Debian: apt-get install dataset-fashion-mnist"
                                       : "MNIST's train- and t10k- images and labels, gzipped or not"));
    }
  }
}

std::string default_output_dir(const TrainConfig& c) {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  std::string comp = c.compressor;
  const std::string scheme = c.sync.substr(0, c.sync.find(':'));
  if (scheme != "bsp") comp = scheme + (c.compressor == "none" ? "" : "-" + c.compressor);
  for (char& ch : comp)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '-') ch = '_';
  // Another run started in the same second has that name: the next free one (-2, -3, ...) instead of sharing it.
  const std::string base = fmt::format("runs/{}-{}-{}", c.model, comp, buf);
  std::string name = base;
  for (int k = 2; std::filesystem::exists(name) && k < 1000; ++k) name = fmt::format("{}-{}", base, k);
  return name;
}

// A whole-number field of checkpoint.json, or a one-line error naming the file and the field.
int64_t checkpoint_int(const nlohmann::json& meta, const char* key, const std::filesystem::path& dir) {
  auto it = meta.find(key);
  if (it == meta.end() || !it->is_number_integer() || it->get<int64_t>() < 0)
    throw ConfigError(
        fmt::format("config: resume: {} has no whole number '{}' ({}); allowed: a checkpoint "
                    "directory written by conduit train",
                    (dir / "checkpoint.json").string(), key, it == meta.end() ? "missing" : it->dump()));
  return it->get<int64_t>();
}

// The fields of checkpoint.json this run reads have their types (a damaged or hand-edited file is a one-line error
// naming the field, not a JSON library exception).
void check_checkpoint_fields(const nlohmann::json& meta, const std::filesystem::path& dir, bool counts_required) {
  if (!meta.is_object())
    throw ConfigError(
        fmt::format("config: resume: {} is not a JSON object; allowed: a checkpoint directory written "
                    "by conduit train",
                    (dir / "checkpoint.json").string()));
  for (const char* key : {"epoch", "step", "global_step", "world"})
    if (counts_required || meta.contains(key)) checkpoint_int(meta, key, dir);
  const std::pair<const char*, const char*> typed[] = {{"model", "string"},
                                                       {"compressor", "string"},
                                                       {"sync", "string"},
                                                       {"optimizer", "string"},
                                                       {"dataset", "string"},
                                                       {"wall_s", "number"},
                                                       {"time_to_target_s", "number"},
                                                       {"test_accuracy", "number"},
                                                       {"target_accuracy", "number"},
                                                       {"batch_size", "number"},
                                                       {"seed", "number"},
                                                       {"train_limit", "number"},
                                                       {"synthetic_samples", "number"},
                                                       {"lr", "number"},
                                                       {"momentum", "number"},
                                                       {"optimizer_momentum", "number"},
                                                       {"weight_decay", "number"},
                                                       {"lr_schedule", "string"},
                                                       {"warmup_epochs", "number"},
                                                       {"epochs", "number"},
                                                       {"test_limit", "number"},
                                                       {"data_dir", "string"},
                                                       {"data_dir_resolved", "string"},
                                                       {"train_data", "string"},
                                                       {"checkpoint_every", "number"},
                                                       {"eval_every", "number"},
                                                       {"bucket_cap_mb", "number"},
                                                       {"first_bucket_mb", "number"},
                                                       {"overlap", "boolean"},
                                                       {"zero", "integer"},
                                                       {"zero_prefetch", "boolean"},
                                                       {"zero_gather", "string"},
                                                       {"zero_allgather_mb", "number"},
                                                       {"zero_reduce", "string"},
                                                       {"zero_hpz", "integer"},
                                                       {"zero_shard_group", "integer"},
                                                       {"tp", "integer"},
                                                       {"pp", "integer"},
                                                       {"micro_batches", "integer"},
                                                       {"pp_schedule", "string"},
                                                       {"recompute", "boolean"},
                                                       {"sequence_parallel", "boolean"}};
  for (const auto& [key, type] : typed) {
    auto it = meta.find(key);
    if (it == meta.end()) continue;
    const std::string t = type;
    const bool ok = t == "string"    ? it->is_string()
                    : t == "boolean" ? it->is_boolean()
                    : t == "integer" ? it->is_number_integer()
                                     : it->is_number();
    if (!ok)
      throw ConfigError(
          fmt::format("config: resume: {}: '{}' is {}, not a {}; allowed: a checkpoint directory "
                      "written by conduit train",
                      (dir / "checkpoint.json").string(), key, it->dump(), type));
  }
}

// ZeRO's optimizer state is of this rank's slices, cut from buckets of these caps (checkpoints before ZeRO: 0);
// stages 1 and 2 cut the same slices, so either resumes the other. Stage 3 cuts its slices per layer instead.
static void check_zero_against(const nlohmann::json& meta, int zero) {
  const int saved_zero = meta.value("zero", 0);
  auto zero_kind = [](int z) { return z == 0 ? 0 : z < 3 ? 1 : 2; };
  if (zero_kind(saved_zero) != zero_kind(zero))
    throw ConfigError(fmt::format(
        "config: resume: the checkpoint was written with zero = {}, this run has {}; allowed: {} (its optimizer "
        "state is {})",
        saved_zero, zero,
        saved_zero == 0  ? "zero 0"
        : saved_zero < 3 ? "zero 1 or 2"
                         : "zero 3",
        saved_zero == 0  ? "whole on every rank"
        : saved_zero < 3 ? "each rank's slices of every bucket"
                         : "each rank's slices of every layer"));
}

nlohmann::json read_checkpoint_json(const std::filesystem::path& dir) {
  try {
    return read_json_file((dir / "checkpoint.json").string());
  } catch (const ConfigError& e) {  // (a truncated file said only that it was not valid JSON)
    throw ConfigError(
        fmt::format("config: resume: {}; allowed: a checkpoint directory written by conduit train", e.what()));
  }
}

void apply_resume_defaults(RawConfig& raw, bool workers_from_env, nlohmann::json* meta_out) {
  auto it = raw.find("resume");
  if (it == raw.end() || it->second.empty()) return;
  const std::filesystem::path meta_path = std::filesystem::path(it->second) / "checkpoint.json";
  if (!std::filesystem::exists(meta_path)) return;  // resolve_config names the missing checkpoint
  const nlohmann::json meta = read_checkpoint_json(std::filesystem::path(it->second));
  // (a damaged or hand-edited file is one line here, not one from every worker)
  check_checkpoint_fields(meta, std::filesystem::path(it->second), false);
  if (meta_out != nullptr) *meta_out = meta;
  auto text = [](const nlohmann::json& v) -> std::optional<std::string> {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
    if (v.is_number()) return fmt::format("{}", v.get<double>());
    if (v.is_boolean()) return std::string(v.get<bool>() ? "true" : "false");
    return std::nullopt;
  };
  auto take = [&](const std::string& key, const char* field) {
    if (raw.count(key) || !meta.contains(field)) return;
    if (auto v = text(meta[field])) raw[key] = *v;
  };
  // Everything that defines the run, so that a resume given only --resume continues it (the schedule, the test set
  // and the data directory fell back to the defaults: 3 cosine epochs on the full test set after 2 constant ones on
  // 999 images). Not taken: max_steps (a run it stopped continues past it), where and how this run runs (output,
  // transport, timeout_s, time_limit_s, progress, trace, slow).
  // The ZeRO stage this run gives, as a number (-1: none given, -2: not a stage number, which resolve_config names).
  // A given setting's value as a whole number or a bool, as resolve_config will read it (nullopt: not given, or not
  // one): compared as text, pp 01 or overlap no carried a checkpoint's schedule or zero_reduce into a run that then
  // refused it, naming a key nobody set (an audit).
  auto whole = [](const std::string& s) -> std::optional<long long> {
    long long v = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
    return v;
  };
  auto given_int = [&](const char* key) { return raw.count(key) ? whole(raw.at(key)) : std::nullopt; };
  auto given_bool = [&](const char* key) -> std::optional<bool> {
    if (!raw.count(key)) return std::nullopt;
    try {
      return to_bool(key, raw.at(key));
    } catch (const ConfigError&) {  // (resolve_config names it)
      return std::nullopt;
    }
  };
  int given_zero = -1;
  if (raw.count("zero")) {
    const std::string& z = raw.at("zero");
    const auto [end, ec] = std::from_chars(z.data(), z.data() + z.size(), given_zero);
    if (ec != std::errc() || end != z.data() + z.size() || given_zero < 0) given_zero = -2;
  }
  // A stage the checkpoint cannot resume at is named first: the settings taken below (a compressor of stage 0's)
  // were refused with the given stage instead, and, given too, refused as the checkpoint's (an audit).
  if (given_zero >= 0 && given_zero <= 3) check_zero_against(meta, given_zero);
  // A signum run before 2026-12-05 stacked the optimizer's momentum on Signum's: its optimizer state is that
  // momentum, which this version would read as its weight decay's. Such checkpoints do not record the optimizer's
  // own momentum (optimizer_momentum), which every checkpoint since does.
  if (meta.contains("compressor") && meta["compressor"].is_string() && !meta.contains("optimizer_momentum") &&
      split_compressor_spec(meta["compressor"].get<std::string>()).first == "signum")
    throw ConfigError(fmt::format(
        "config: resume: the checkpoint's compressor '{}' was trained before signum took over the momentum "
        "(2026-12-05), and its optimizer state is not what this version keeps; allowed: a new run (--output "
        "elsewhere)",
        meta["compressor"].get<std::string>()));
  for (const char* k : {"model",
                        "compressor",
                        "optimizer",
                        "target_accuracy",
                        "batch_size",
                        "seed",
                        "dataset",
                        "train_limit",
                        "synthetic_samples",
                        "compress_min_bytes",
                        "lr",
                        "momentum",
                        "weight_decay",
                        "lr_schedule",
                        "warmup_epochs",
                        "epochs",
                        "test_limit",
                        "checkpoint_every",
                        "eval_every",
                        "bucket_cap_mb",
                        "first_bucket_mb",
                        "overlap",
                        "tp",
                        "pp",
                        "micro_batches",
                        "pp_schedule",
                        "recompute",
                        "sequence_parallel",
                        "zero",
                        "zero_prefetch",
                        "zero_gather",
                        "zero_hpz",
                        "zero_shard_group",
                        "zero_allgather_mb",
                        "zero_reduce"}) {
    // (an adam or adamw run records sgd's momentum it never used; taken, it would be refused as set for adam)
    // (nor when this run asks for another optimizer: the optimizer mismatch is the error to report)
    if (std::string(k) == "momentum" && ((meta.contains("optimizer") && meta["optimizer"] != "sgd") ||
                                         (raw.count("optimizer") && raw.at("optimizer") != "sgd")))
      continue;
    // (a dgc run's momentum is its compressor's, taken with it: the trainer's unused default, recorded beside it by
    // runs before the two were kept equal, would be refused as a second value)
    if (std::string(k) == "momentum" && meta.contains("compressor") && meta["compressor"].is_string()) {
      const auto [name, params] = split_compressor_spec(meta["compressor"].get<std::string>());
      if (!momentum_compressor(name).empty() && params.count("momentum")) continue;
    }
    // (a vit checkpoint's tp or pp with another model given: the model mismatch is the error to report)
    if ((std::string(k) == "tp" || std::string(k) == "pp") && raw.count("model") && meta.contains("model") &&
        meta["model"] != raw.at("model"))
      continue;
    // (the checkpoint's micro-batches split its batch: not taken when they outnumber the samples of the batch size
    // this resume gives; a malformed one is named by resolve_config)
    if (std::string(k) == "micro_batches" && raw.count("batch_size") && meta.contains(k) &&
        meta[k].is_number_integer()) {
      int64_t given = 0;
      const std::string& bs = raw.at("batch_size");
      const auto [end, ec] = std::from_chars(bs.data(), bs.data() + bs.size(), given);
      if (ec != std::errc() || end != bs.data() + bs.size() || meta[k].get<int64_t>() > given) continue;
    }
    // (a pipeline's schedule and recomputation, not taken by a run without one: pp 1 given, or a checkpoint of pp 1
    // written before its schedule was refused; the pp mismatch, or nothing, is the error to report)
    if ((std::string(k) == "pp_schedule" || std::string(k) == "recompute") &&
        (!raw.count("pp") || given_int("pp") == 1))
      continue;
    // (sequence parallelism, not taken by a run that cannot have it: tp 1 or pp above 1 given, or another model;
    // the tp, pp or model mismatch is the error to report)
    if (std::string(k) == "sequence_parallel" &&
        (given_int("tp") == 1 || (raw.count("pp") && given_int("pp") != 1) ||
         (raw.count("model") && meta.contains("model") && meta["model"] != raw.at("model"))))
      continue;
    // (the secondary partition's group size, not taken by a run given other workers or tp than the checkpoint's:
    // that mismatch is the error to report, or the groups the new size allows are this run's to choose)
    if (std::string(k) == "zero_hpz" || std::string(k) == "zero_shard_group") {
      bool other = false;
      for (auto [given, saved] : {std::pair<const char*, const char*>{"workers", "world"}, {"tp", "tp"}, {"pp", "pp"}})
        if (raw.count(given) && meta.contains(saved)) {
          const auto t = text(meta[saved]);
          other = other || !t || !whole(*t) || whole(*t) != given_int(given);
        }
      if (other) continue;
    }
    // (ZeRO-3's gather wire and secondary partition, not taken by a run given another stage, which refuses them; the
    // shard groups not by a run given zero 0)
    if ((std::string(k) == "zero_gather" || std::string(k) == "zero_hpz") && given_zero != -1 && given_zero != 3)
      continue;
    if (std::string(k) == "zero_shard_group" && given_zero == 0) continue;
    // (the deferred allgather's call size, not taken by a run given stage 0 or 3, which refuse it)
    if (std::string(k) == "zero_allgather_mb" && given_zero != -1 && given_zero != 1 && given_zero != 2) continue;
    // (when ZeRO-2 or 3 reduces, not taken by a run given another stage, one micro-batch (given, or the
    // checkpoint's not taken: carried before this key) or overlap off, which refuse it)
    if (std::string(k) == "zero_reduce" &&
        ((given_zero != -1 && given_zero != 2 && given_zero != 3) || !raw.count("micro_batches") ||
         given_int("micro_batches") == 1 || given_bool("overlap") == false))
      continue;
    // (ZeRO's prefetch, not taken by a run given stage 0, which refuses it: the zero mismatch is the error to
    // report)
    if (std::string(k) == "zero_prefetch" && given_zero != -1 && given_zero <= 0) continue;
    take(k, k);
  }
  // The checkpoint's data directory belongs to its dataset (taken above unless given): taken only with that
  // dataset (resumed at an epoch end with --dataset mnist, a Fashion-MNIST run's directory replaced mnist's own).
  if (meta.contains("dataset") && meta["dataset"].is_string() && raw.count("dataset") &&
      raw.at("dataset") == meta["dataset"].get<std::string>())
    take("data_dir", "data_dir");
  if (!workers_from_env) take("workers", "world");
  // The scheme with the parameters it was written with (sync_period and staleness are parameters of it too).
  // A sync_period or staleness given takes the place of the checkpoint's period or staleness (and is then checked
  // against it like any other parameter).
  if (!raw.count("sync") && meta.contains("sync") && meta["sync"].is_string()) {
    std::string spec = meta["sync"].get<std::string>();
    std::vector<std::string> params;
    if (meta.contains("sync_params") && meta["sync_params"].is_object())
      for (const auto& [k, v] : meta["sync_params"].items()) {
        if ((k == "period" && raw.count("sync_period")) || (k == "staleness" && raw.count("staleness"))) continue;
        if (auto t = text(v)) params.push_back(key_value(k, *t));
      }
    if (!params.empty()) spec += ":" + join(params, ",");
    raw["sync"] = spec;
  }
}

std::string config_to_yaml(const TrainConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << c.model;
  e << YAML::Key << "dataset" << YAML::Value << c.dataset;
  e << YAML::Key << "data_dir" << YAML::Value << c.data_dir;
  e << YAML::Key << "workers" << YAML::Value << c.workers;
  e << YAML::Key << "transport" << YAML::Value << c.transport;
  e << YAML::Key << "compressor" << YAML::Value << c.compressor;
  e << YAML::Key << "optimizer" << YAML::Value << c.optimizer;
  e << YAML::Key << "lr" << YAML::Value << fmt::format("{}", c.lr);
  if (c.optimizer == "sgd")  // (adam's and adamw's workers refuse a momentum: theirs are their betas)
    e << YAML::Key << "momentum" << YAML::Value << fmt::format("{}", c.momentum);
  e << YAML::Key << "weight_decay" << YAML::Value << fmt::format("{}", c.weight_decay);
  e << YAML::Key << "lr_schedule" << YAML::Value << c.lr_schedule;
  e << YAML::Key << "warmup_epochs" << YAML::Value << fmt::format("{}", c.warmup_epochs);
  e << YAML::Key << "epochs" << YAML::Value << c.epochs;
  e << YAML::Key << "batch_size" << YAML::Value << c.batch_size;
  e << YAML::Key << "seed" << YAML::Value << c.seed;
  e << YAML::Key << "output" << YAML::Value << c.output;
  e << YAML::Key << "target_accuracy" << YAML::Value << fmt::format("{}", c.target_accuracy);
  e << YAML::Key << "bucket_cap_mb" << YAML::Value << fmt::format("{}", c.bucket_cap_mb);
  e << YAML::Key << "first_bucket_mb" << YAML::Value << fmt::format("{}", c.first_bucket_mb);
  e << YAML::Key << "compress_min_bytes" << YAML::Value << c.compress_min_bytes;
  e << YAML::Key << "overlap" << YAML::Value << (c.overlap ? "true" : "false");
  e << YAML::Key << "tp" << YAML::Value << c.tp;
  e << YAML::Key << "pp" << YAML::Value << c.pp;
  e << YAML::Key << "micro_batches" << YAML::Value << c.micro_batches;
  e << YAML::Key << "pp_schedule" << YAML::Value << c.pp_schedule;
  e << YAML::Key << "recompute" << YAML::Value << (c.recompute ? "true" : "false");
  e << YAML::Key << "sequence_parallel" << YAML::Value << (c.sequence_parallel ? "true" : "false");
  e << YAML::Key << "zero" << YAML::Value << c.zero;
  if (c.zero > 0) e << YAML::Key << "zero_prefetch" << YAML::Value << (c.zero_prefetch ? "true" : "false");
  if (c.zero == 3) e << YAML::Key << "zero_gather" << YAML::Value << c.zero_gather;
  if (c.zero == 3) e << YAML::Key << "zero_hpz" << YAML::Value << zero3_group_text(c.zero_hpz);
  if (c.zero > 0) e << YAML::Key << "zero_shard_group" << YAML::Value << zero3_group_text(c.zero_shard_group);
  if (c.zero == 1 || c.zero == 2)
    e << YAML::Key << "zero_allgather_mb" << YAML::Value << fmt::format("{}", c.zero_allgather_mb);
  if (c.zero >= 2 && c.micro_batches > 1) e << YAML::Key << "zero_reduce" << YAML::Value << c.zero_reduce;
  e << YAML::Key << "trace" << YAML::Value << (c.trace ? "true" : "false");
  e << YAML::Key << "checkpoint_every" << YAML::Value << c.checkpoint_every;
  if (!c.resume.empty()) e << YAML::Key << "resume" << YAML::Value << c.resume;
  e << YAML::Key << "max_steps" << YAML::Value << c.max_steps;
  e << YAML::Key << "train_limit" << YAML::Value << c.train_limit;
  e << YAML::Key << "test_limit" << YAML::Value << c.test_limit;
  e << YAML::Key << "synthetic_samples" << YAML::Value << c.synthetic_samples;
  e << YAML::Key << "progress" << YAML::Value << (c.progress ? "true" : "false");
  e << YAML::Key << "timeout_s" << YAML::Value << fmt::format("{}", c.timeout_s);
  // (only where it is not the default: a config.yaml reused with a longer --timeout-s refused the drift timeout it
  // had derived from the shorter one)
  if (c.drift_timeout_s != std::max(TrainConfig{}.drift_timeout_s, c.timeout_s))
    e << YAML::Key << "drift_timeout_s" << YAML::Value << fmt::format("{}", c.drift_timeout_s);
  e << YAML::Key << "sync" << YAML::Value << c.sync;
  e << YAML::Key << "sync_period" << YAML::Value << c.sync_period;
  e << YAML::Key << "staleness" << YAML::Value << c.staleness;
  e << YAML::Key << "slow" << YAML::Value << c.slow;
  e << YAML::Key << "eval_every" << YAML::Value << c.eval_every;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

// The parameters a scheme's saved state depends on, its defaults filled in: what a resume must not change. Those the
// trainer derived from its own flags (the servers' lr, momentum and weight decay; the compressor, checked on its
// own) may change as they may for bsp; the same keys given in the spec are the spec's (DiLoCo's outer lr and
// momentum, a dpsgd compressor): they were dropped too, so a resume fell back to the defaults without a word.
nlohmann::json scheme_params(const SyncSpec& spec) {
  nlohmann::json out = nlohmann::json::object();
  if (spec.bsp()) return out;
  sync::Params p = sync::strategy_defaults(spec.name);
  for (const auto& [k, v] : spec.params) p[k] = v;
  for (const auto& k : spec.derived) p.erase(k);
  for (const auto& [k, v] : p) out[k] = v;
  return out;
}

namespace {

// A checkpoint's scheme parameters differ from this run's: a key both record with different values, or one only one
// of them records. Checkpoints written before the spec's own lr, momentum, weight decay and compressor were recorded
// (they were dropped with the trainer's) are not judged on those.
bool scheme_params_differ(const nlohmann::json& saved, const nlohmann::json& now) {
  static const std::set<std::string> kOnceDropped = {"lr", "momentum", "weight_decay", "compressor", "push_compressor"};
  // (the same setting spelled otherwise is the same: adaptive=false against a recorded "0" was another scheme)
  auto same = [](const nlohmann::json& a, const nlohmann::json& b) {
    return a == b ||
           (a.is_string() && b.is_string() && sync::same_param_value(a.get<std::string>(), b.get<std::string>()));
  };
  for (const auto& [k, v] : now.items())
    if (saved.contains(k) ? !same(saved[k], v) : !kOnceDropped.count(k)) return true;
  for (const auto& [k, v] : saved.items())
    if (!now.contains(k)) return true;
  return false;
}

}  // namespace

void check_resume_against(const nlohmann::json& meta, const TrainConfig& c, int world) {
  const SyncSpec spec = effective_sync(c);
  if (meta.value("world", 0) != world)
    throw ConfigError(
        fmt::format("config: resume: the checkpoint was written by {} ranks, this run has {}; "
                    "allowed: {} ranks",
                    meta.value("world", 0), world, meta.value("world", 0)));
  // (the line named the checkpoint's three and not which differed, nor what this run asked for)
  for (const auto& [field, was, now] :
       {std::tuple<const char*, std::string, std::string>{"model", meta.value("model", std::string()), c.model},
        {"compressor", meta.value("compressor", std::string()), c.compressor},
        {"sync", meta.value("sync", std::string("bsp")), spec.name}})
    if (was != now)
      throw ConfigError(
          was.empty()
              ? fmt::format("config: resume: the checkpoint records no {} (this run has {}); allowed: a checkpoint "
                            "written by conduit train",
                            field, now)
              : fmt::format("config: resume: the checkpoint was written with {} {}, this run has {}; allowed: {} {} "
                            "(leave --{} out to take the checkpoint's)",
                            field, was, now, field, was, field));
  // The scheme's parameters too: its saved state belongs to them (local SGD restored the checkpoint's period over
  // a new --sync-period; dpsgd's public copies would attach to another graph's neighbours).
  if (meta.contains("sync_params") && scheme_params_differ(meta["sync_params"], scheme_params(spec)))
    throw ConfigError(
        fmt::format("config: resume: the checkpoint was written with sync {} {}, this run asks for "
                    "{}; allowed: the same scheme parameters",
                    spec.name, meta["sync_params"].dump(), scheme_params(spec).dump()));
  // The optimizer's saved state is its kind's (sgd's momentum buffers, adam's moments; adamw decays the weights
  // another way than adam), and the time to the target was judged against the checkpoint's target accuracy.
  nlohmann::json same = {{"optimizer", c.optimizer}, {"target_accuracy", c.target_accuracy}};
  // Each rank's files hold its share of the split layers.
  if (meta.value("tp", 1) != c.tp)
    throw ConfigError(
        fmt::format("config: resume: the checkpoint was written with tp = {}, this run has {}; "
                    "allowed: the same tp (each rank's model file holds its share of the split "
                    "layers)",
                    meta.value("tp", 1), c.tp));
  if (meta.value("pp", 1) != c.pp)
    throw ConfigError(
        fmt::format("config: resume: the checkpoint was written with pp = {}, this run has {}; "
                    "allowed: the same pp (each rank's model file holds its stage's blocks or layers)",
                    meta.value("pp", 1), c.pp));
  const bool saved_interleaved = meta.value("pp_schedule", std::string("1f1b")) == "interleaved";
  if (saved_interleaved != (c.pp_schedule == "interleaved"))
    throw ConfigError(fmt::format(
        "config: resume: the checkpoint was written with pp_schedule {}, this run has {}; allowed: {} (a stage's "
        "model file holds {})",
        meta.value("pp_schedule", std::string("1f1b")), c.pp_schedule,
        saved_interleaved ? "interleaved" : "gpipe or 1f1b",
        saved_interleaved ? "its interleaved chunks of blocks" : "consecutive blocks or layers"));
  check_zero_against(meta, c.zero);
  if (c.zero == 1 || c.zero == 2) {  // (stage 3 cuts them per layer)
    same["bucket_cap_mb"] = c.bucket_cap_mb;
    same["first_bucket_mb"] = c.first_bucket_mb;
  }
  // compress_min_bytes only matters with a compressor (which must be the checkpoint's, checked above).
  if (c.compressor != "none") same["compress_min_bytes"] = c.compress_min_bytes;
  for (const auto& [key, value] : same.items())
    if (meta.contains(key) && meta[key] != value)
      throw ConfigError(fmt::format(
          "config: resume: the checkpoint was written with {} = {}, this run has {}; allowed: the same {}{}", key,
          meta[key].dump(), value.dump(), key,
          key == "optimizer" ? " (its saved state is that optimizer's)"
          : key.find("bucket") != std::string::npos
              ? " (with zero, each rank's optimizer state is of its slices of every bucket)"
          : key == "compress_min_bytes" ? " (the tensors it leaves uncompressed have no compressor state: error "
                                          "feedback's residuals and momentum would be dropped or start empty)"
                                        : " (the evaluations before the checkpoint were judged against it)"));
  // The sampler position (epoch, step) counts batches of this size in this seed's shuffle of this data: resumed
  // with another, the rest of the epoch would repeat or skip samples. (Checkpoints written before these fields
  // existed are not checked.)
  const nlohmann::json now = {{"batch_size", c.batch_size},
                              {"seed", c.seed},
                              {"dataset", c.dataset},
                              {"train_limit", c.train_limit},
                              {"synthetic_samples", c.synthetic_samples}};
  for (const auto& [key, value] : now.items())
    if (meta.value("step", int64_t{0}) != 0 && meta.contains(key) && meta[key] != value)
      throw ConfigError(
          fmt::format("config: resume: the checkpoint was written with {} = {}, this run has {}; "
                      "allowed: the same {} (the sampler position counts its batches)",
                      key, meta[key].dump(), value.dump(), key));
}

}  // namespace conduit::train
