#pragma once
// Configuration of `conduit train` (torch-free). Every option is a YAML key of the --config file and a flag of the
// same name (`batch_size` <-> `--batch-size`); flags win over the file. resolve_config() checks every value and
// throws ConfigError with one line naming the field and what is allowed.
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <vector>

#include "sync/defaults.h"

namespace conduit::train {

// ZeRO's reduce-scatter in int blocks by all-to-all (ZeRO++'s qgZ) from a compressor spec: int8 or int4, with ef:
// error feedback (compress::int_reduce_scatter's residual); bits 0 for any other spec.
struct ZeroIntWire {
  int bits = 0;
  bool error_feedback = false;
};
inline ZeroIntWire zero_int_wire(const std::string& spec) {
  const bool ef = spec.rfind("ef:", 0) == 0;
  const std::string name = ef ? spec.substr(3) : spec;
  if (name == "int8" || name == "int4") return {name == "int8" ? 8 : 4, ef};
  return {};
}

// TrainConfig::zero_hpz and zero_shard_group given as `node`.
inline constexpr int kHostGroup = -1;
// Groups asked for: a size of 2 or more, or node.
inline bool zero3_group_set(int k) { return k > 1 || k == kHostGroup; }
inline std::string zero3_group_text(int k) { return k == kHostGroup ? "node" : std::to_string(k); }

struct TrainConfig {
  std::string model = "cnn";             // mlp | cnn | resnet
  std::string dataset = "fashion-mnist";  // fashion-mnist | mnist | synthetic
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int workers = 4;                        // local workers started when not under mpirun/torchrun
  std::string transport = "auto";         // auto | tcp | shm | mpi
  // A compressor spec, "name:key=value,..." (compress/compressor.h). Default: PowerSGD rank 4 with error feedback
  // (docs/training.md says why); "none" when built without src/compress.
#ifdef CONDUIT_WITH_COMPRESS
  std::string compressor = "powersgd:rank=4,wire=f16";
#else
  std::string compressor = "none";
#endif
  std::string optimizer = "sgd";          // sgd (with momentum) | adam
  double lr = 0.1;                        // for the global batch (workers * batch_size)
  double momentum = 0.9;
  double weight_decay = 0.0;
  std::string lr_schedule = "cosine";     // constant | step | cosine
  double warmup_epochs = 0.0;
  int epochs = 3;
  int batch_size = 64;                    // per worker
  uint64_t seed = 42;
  std::string output;                     // empty: runs/<model>-<compressor>-<time>
  double target_accuracy = 0.0;           // in (0, 1]; 0: not set
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  int64_t compress_min_bytes = 0;         // gradients smaller than this skip the compressor (plain allreduce)
  bool overlap = true;                    // communicate full buckets while backward goes on
  int tp = 1;                             // tensor-parallel ranks a group (model vit)
  int pp = 1;                             // pipeline stages (vit: 1, 2, 4; others: to their units): ranks a pipeline
  int micro_batches = 1;                  // parts of each batch (pipelined with pp; gradient accumulation without)
  std::string pp_schedule = "1f1b";       // gpipe | 1f1b
  bool sequence_parallel = false;         // with tp: each rank holds its share of the tokens between split layers
  bool recompute = false;                 // pipeline stages keep each micro-batch's input only (pp > 1)
  bool zero_prefetch = true;              // zero 1-3: parameters gathered while other layers compute
  std::string zero_gather = "f32";        // zero 3: the parameter gathers' wire: f32, bf16, fp16 or int8
  // zero 3: ranks a secondary partition group (ZeRO++'s hpZ; 0: none); zero 1-3: ranks a shard group, replicated
  // across groups (FSDP's HYBRID_SHARD; 0: all); kHostGroup (`node`): a host's data-parallel workers, which
  // train_worker resolves from the host map (the resolved size in config.yaml, checkpoints and the summary).
  int zero_hpz = 0;
  int zero_shard_group = 0;
  double zero_allgather_mb = 0;           // zero 1, 2: the deferred allgather's calls' least size (0: one a layer)
  std::string zero_reduce = "step";       // zero 2-3 with micro_batches > 1: step | micro-batch
  int zero = 0;                           // ZeRO stage of bsp's DistributedOptimizer (0, 1, 2, 3)
  bool trace = false;                     // write trace-rank<R>.json (Chrome trace format)
  int checkpoint_every = 0;               // steps between checkpoints (0: at the end of every epoch only)
  std::string resume;                     // checkpoint directory to resume from (empty: none)
  int64_t max_steps = 0;                  // stop after this many steps in all (0: no limit)
  int64_t train_limit = 0;                // use the first N training samples (0: all)
  int64_t test_limit = 0;                 // evaluate on the first N test samples (0: all)
  int64_t synthetic_samples = 4096;       // training samples of the synthetic dataset (test: a quarter)
  bool progress = true;                   // rank 0 prints a progress bar
  double timeout_s = 300;                 // deadline of every collective
  // Deadline of the waits where the workers rightly drift apart by more than a step (sync::kDefaultDriftTimeoutS's
  // list), at least timeout_s.
  double drift_timeout_s = sync::kDefaultDriftTimeoutS;
  // > 0: the whole run's deadline in seconds (mpirun's --timeout), kept by the parent that starts the workers: those
  // still running then are stopped as on SIGTERM and conduit train exits 124; 0: none.
  double time_limit_s = 0;
  // Synchronization scheme spec "name[:key=value,...]" (sync/strategy.h, docs/sync.md): bsp (the
  // DistributedOptimizer above), local, diloco, easgd, dpsgd, sgp, adpsgd, ps-asp, ps-ssp, ps-bsp.
  std::string sync = "bsp";
  int64_t sync_period = 0;                // H of local / diloco / easgd (0: the scheme's own default)
  int64_t staleness = -1;                 // s of ps-ssp (-1: the scheme's default, 3)
  std::string slow;                       // straggler injection "RANK:FACTOR[,RANK:FACTOR...]" (empty: none)
  int64_t eval_every = 0;                 // steps between extra test evaluations (0: at epoch ends only)
};

// The scheme of c.sync with the trainer's settings folded in: sync_period -> period, staleness, ps-* take the
// trainer's lr, momentum and weight_decay and co-locate one shard per worker unless told otherwise; a compressor goes to dpsgd (CHOCO gossip) or
// ps-* (push_compressor). ConfigError (one line) where a setting does not apply to the scheme.
struct SyncSpec {
  std::string name = "bsp";
  std::map<std::string, std::string> params;
  // Keys of params that effective_sync filled in from the trainer's own settings (the servers' lr, momentum and
  // weight decay; the compressor), not given in the sync spec: they follow those settings, as they do for bsp.
  std::set<std::string> derived;
  // TrainConfig::drift_timeout_s: where the run runs, not a parameter of the scheme (not in params or checkpoints).
  double drift_timeout_s = sync::kDefaultDriftTimeoutS;
  bool bsp() const { return name == "bsp"; }
  bool parameter_server() const { return name.rfind("ps-", 0) == 0; }
  std::string to_string() const;
};
SyncSpec effective_sync(const TrainConfig& c);
// The ranks that train (and share the training set): all of them, less dedicated parameter servers (colocate=0).
int training_workers(const TrainConfig& c);
// "dgc" or "signum" when the compressor keeps SGD's momentum itself (DGC's momentum correction; Signum's signs of the
// momentum), else "": resolve_config gives it the trainer's momentum unless its spec names one.
std::string momentum_compressor(const std::string& compressor);
// The momentum the local optimizer applies: 0 with a momentum compressor, whose momentum replaces it; c.momentum
// otherwise.
double optimizer_momentum(const TrainConfig& c);

// Raw key -> value strings (from YAML and flags) before checking.
using RawConfig = std::map<std::string, std::string>;

// Every key, in the order `conduit train --help` lists them, with a one-line description.
const std::vector<std::pair<std::string, std::string>>& config_keys();
// Reads a YAML mapping of scalars (the value of `compressor` may also be a mapping {name: topk, ratio: 0.01}).
// Unknown keys and unreadable files raise ConfigError.
RawConfig read_yaml_config(const std::string& path);
// A resumed run (raw has `resume`) takes from the checkpoint's checkpoint.json what the checkpoint must agree with
// and `raw` does not give: model, compressor, sync scheme and its parameters, optimizer, target accuracy, batch size,
// seed, dataset and its limits, and (unless `workers_from_env`) the number of workers; and the rest of the run's
// settings (lr, momentum, weight decay, schedule, warm-up, epochs, test_limit, data_dir with its dataset, the
// checkpoint and evaluation intervals, buckets, overlap). `--resume DIR --epochs 3` then continues the run. The
// checkpoint.json it read goes to `meta` where given (left as it was where raw has no resume or the file is missing).
void apply_resume_defaults(RawConfig& raw, bool workers_from_env, nlohmann::json* meta = nullptr);
// The checkpoint.json of the checkpoint in `dir`, or a one-line ConfigError naming the file, what is wrong with it
// (unreadable, not JSON) and what is allowed.
nlohmann::json read_checkpoint_json(const std::filesystem::path& dir);
// A whole-number field of a checkpoint's checkpoint.json (in `dir`), or a one-line ConfigError naming the file and the
// field.
int64_t checkpoint_int(const nlohmann::json& meta, const char* key, const std::filesystem::path& dir);
// The fields of checkpoint.json a run reads have their types (a damaged or hand-edited file is a one-line error naming
// the field, not a JSON library exception); without `counts_required`, a missing epoch, step, global step or world
// passes (the launching process's check: the workers require them).
void check_checkpoint_fields(const nlohmann::json& meta, const std::filesystem::path& dir, bool counts_required = true);
// A checkpoint's checkpoint.json against this run's settings and its `world` of ranks: what its saved files belong
// to (the ranks, model, compressor, sync scheme and its parameters, tp, pp and the schedule's kind, the ZeRO kind,
// optimizer, target accuracy, ZeRO 1-2's bucket caps, compress_min_bytes, and mid-epoch the sampler's fields). A
// one-line ConfigError naming the field, both values and what is allowed. The launching process checks it once, so
// that a mismatch stops before any worker starts; each worker checks it again against its own copy (and the layout
// checks only a worker can make: the pipeline's cut, a node-sized shard group).
void check_resume_against(const nlohmann::json& meta, const TrainConfig& c, int world);
// The parameters a scheme's saved state depends on, its defaults filled in (checkpoint.json's sync_params).
nlohmann::json scheme_params(const SyncSpec& spec);
// Applies `raw` over the defaults and validates; `env_world` is WORLD_SIZE of an outer launcher (0 when none) and
// `workers_given` says whether workers was set explicitly (it must then agree with env_world).
TrainConfig resolve_config(const RawConfig& raw, int env_world = 0, bool workers_given = false);
// Builds the scheme on `workers` in-process ranks, so every parameter value is checked before workers start.
void check_sync_config(const TrainConfig& c);
// Pipelines with ZeRO-3 or ZeRO's per-micro-batch reduction (resolve_config's refusals, repeated by train_worker for
// callers that did not run it): a stage would gather its layers twice a micro-batch, or stall the schedule.
void check_pipeline_pairs(const TrainConfig& c);
// Checks that need the file system (the dataset files); separate so tests can run without the dataset.
void check_dataset(const TrainConfig& c);
// The config as YAML (every key), so workers and resumed runs read exactly what the first run used.
std::string config_to_yaml(const TrainConfig& c);
std::string default_output_dir(const TrainConfig& c);
// The compressor spec split into name and parameters ("topk:ratio=0.01" -> topk, {ratio: 0.01}).
std::pair<std::string, std::map<std::string, std::string>> split_compressor_spec(const std::string& spec);

}  // namespace conduit::train
