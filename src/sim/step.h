#pragma once
// One training iteration of a GPT model under 3-D parallelism (DP x TP x PP, ZeRO, recompute, schedules,
// compression, synchronization schemes) on a cluster.
//
// Ranks are laid out as Megatron-LM does: rank = tp + t * (dp + d * pp) (tensor parallel innermost, inside a
// node; data parallel next; pipeline outermost). Collectives run over those groups on the topology.
//
// Per micro-batch, on the slowest (last) pipeline stage with L/p layers:
//   t_f = L/p * (layer forward GEMMs + element-wise kernels + 2 TP allreduces [SP: 2 allgather + 2 reduce-scatter])
//         + logits
//   t_b = L/p * (2x forward GEMMs + element-wise + 2 TP allreduces + recomputation) + logits backward
//   p2p = activations b*s*h*2 bytes (divided by t: Megatron's scatter/gather) forward and backward, v times
//         per micro-batch for the interleaved schedule
// Pipeline: (m + (p-1)/v) (t_f + t_b + p2p); the bubble is (p-1)/v (t_f + t_b + p2p) = (p-1)/(v m) of ideal.
// Data parallel: gradients in buckets, reduced while the last micro-batch's backward runs (exposed part only);
//   ZeRO-1/2 reduce-scatter the gradients and allgather the updated fp16 parameters; ZeRO-3 also allgathers
//   every layer's parameters before its forward and backward of every micro-batch (prefetched, exposed where
//   the allgather is longer than the layer's compute).
// Optimizer: Adam reads/writes 28 bytes per (sharded) parameter at memory bandwidth.
// Synchronization: bsp (every step), local-sgd:H (the DP exchange every H steps: 1/H of it per step),
//   async (the exchange overlaps the next step's compute; only its excess over the compute is exposed).
// Compression (data-parallel gradients): fp16/int8/int4 quantization (allreduce of fewer bytes + a compress and
//   decompress pass per reduction step), topk:DENSITY (allgather of values + indices), powersgd:RANK
//   (allreduce of the rank-r factors P and Q + the GEMMs that compute them).
#include <string>
#include <vector>

#include "sim/collective.h"
#include "sim/workload.h"

namespace conduit::sim {

struct Compression {
  std::string kind = "none";  // none | fp16 | int8 | int4 | topk | powersgd
  double param = 0;           // topk density, powersgd rank
};
Compression parse_compression(const std::string& s);  // "none", "int8", "topk:0.01", "powersgd:4"

struct SyncScheme {
  std::string kind = "bsp";  // bsp | local-sgd | async
  int period = 1;
};
SyncScheme parse_sync(const std::string& s);  // "bsp", "local-sgd:8", "async"
// ConfigError for a compression with local SGD, which averages the parameters uncompressed (as `conduit train`).
void check_local_sgd_compression(const SyncScheme& sync, const Compression& compression);

enum class ZeroReduce { kModelDefault, kEveryMicroBatch, kOncePerStep };
ZeroReduce parse_zero_reduce(const std::string& s);  // "micro-batch", "step"
const char* zero_reduce_name(ZeroReduce z);          // "default", "micro-batch", "step"

struct ParallelConfig {
  int tp = 1, pp = 1;
  long long dp = 0;  // 0: gpus / (tp * pp)
  int micro_batch = 1;
  long long global_batch = 1;
  int zero = 0;
  Recompute recompute = Recompute::kNone;
  Schedule schedule = Schedule::k1F1B;
  int virtual_stages = 1;  // interleaved: model chunks per GPU (v)
  // An uneven pipeline split (GPT models, --pp 2 or more, not interleaved): the transformer layers of the first and
  // of the last stage (Megatron-LM's --decoder-first/last-pipeline-num-layers; Megatron-DeepSpeed's
  // partition_method type:transformer|embedding gives the ends one fewer, BLOOM-176B's 5, 6 x 10, 5). The stages
  // without a count share the rest evenly. -1: not given (an even split when neither is).
  int first_stage_layers = -1, last_stage_layers = -1;
  bool sequence_parallel = false;
  // The attention's kernels over the b (a/t) s^2 scores (`--attention-kernels`): kFused, Megatron-LM's fused
  // scale-mask-softmax and a dropout; kEager, PyTorch eager (minGPT, the FSDP paper's model): the scale, the causal
  // mask, the softmax and the dropout each a kernel that reads and writes the scores; kFlash, FlashAttention (Dao et
  // al. 2022; FA2 2023): the scores never reach memory, the backward recomputes them (one GEMM of QK^T more), and a
  // layer stores the softmax's log-sum-exp instead of the scores and their mask.
  AttentionKernels attention = AttentionKernels::kFused;
  bool dp_overlap = true;
  // ZeRO-3: each next layer's parameter gather starts while the layer before computes (DeepSpeed's prefetch, `conduit
  // train --zero-prefetch`); false: every gather blocks its layer. ZeRO-1/2: the allgather of the updated parameters
  // runs behind the next forward, one call a layer (as conduit train runs it); false: one allgather, exposed.
  bool zero_prefetch = true;
  // ZeRO-1/2 with zero_prefetch: consecutive layers' parameters within one gradient bucket go in one call of the
  // allgather behind the next forward until it carries at least this many bytes (`conduit train
  // --zero-allgather-mb`, DeepSpeed's allgather_bucket_size); 0: one call per layer and bucket.
  double zero_allgather_bytes = 0;
  // Heterogeneous clusters, data parallel only: give each accelerator a share of the global batch proportional
  // to its speed instead of equal shares (the slowest kind then no longer bounds the step).
  bool balance = false;
  double bucket_bytes = 25.0 * 1024 * 1024;  // 25 MiB, as `--bucket 25M` and PyTorch DDP's bucket_cap_mb = 25
  double grad_bytes = 2;                     // bytes per gradient element on the wire
  // ZeRO-3: bytes per parameter element its gathers move (0: as the parameters are held: a layer-list model's at
  // grad_bytes, a GPT model's 16-bit ones; 2 for `conduit train --zero-gather bf16|fp16`; 1 for int8 blocks,
  // `--zero-gather int8` and ZeRO++'s qwZ, which also move a 4-byte scale per 256 elements: gather_element_bytes).
  double gather_bytes = 0;
  // ZeRO-3 (GPT models): ZeRO++'s hpZ, a secondary partition of the 16-bit parameters over groups of this many
  // consecutive data-parallel ranks (the node's: gpus a node / tp), which the backward's gathers then run within;
  // each rank holds 1/K of the parameters more (`conduit train --zero-hpz`). 0 or 1: none; -1: the node's ranks
  // (gpus a node / tp; none where that is under 2 or does not divide the data-parallel ranks).
  long long zero_hpz = 0;
  // ZeRO sharded within groups of this many data-parallel ranks and replicated across them (FSDP's HYBRID_SHARD,
  // MiCS; _HYBRID_SHARD_ZERO2 at stages 1-2; `conduit train --zero-shard-group`): gathers (stage 3), reduce-scatters
  // and the stepped slices' allgather within the group, each slice's gradients then allreduced across the groups;
  // -1: the node's (gpus a node / tp); 0: all ranks.
  long long zero_shard = 0;
  // ZeRO-2 over several micro-batches: when the gradients are reduce-scattered. kEveryMicroBatch: after each
  // micro-batch's backward, each rank then holding only its shard (DeepSpeed's ZeRO-2, M times the bytes);
  // kOncePerStep: the step's micro-batches summed in whole-gradient buckets first and reduce-scattered once, as
  // ZeRO-1 and FSDP's no_sync (`conduit train --zero 2`), the gradients' memory whole meanwhile. kModelDefault: a GPT
  // model's every micro-batch, a layer list's once a step (what `conduit train` runs).
  ZeroReduce zero_reduce = ZeroReduce::kModelDefault;
  Algorithm dp_algorithm = Algorithm::kAuto;
  Algorithm tp_algorithm = Algorithm::kAuto;
  Compression compression;
  SyncScheme sync;
  EvalMode mode = EvalMode::kSymmetric;
};

// A GPT model's transformer layers per pipeline stage: the first stage's, each middle one's and the last's (with an
// even split all the same, with an uneven one the middle's 0 where p < 3: there is none); `uneven` where
// --first-stage-layers or --last-stage-layers gave them. ConfigError for a split that does not add up (the stages
// without a count must share the rest evenly, a layer each at least), or where there is no pipeline (p = 1) or an
// interleaved schedule (chunks of equal layers).
struct StageLayers {
  int first = 0, middle = 0, last = 0;
  bool uneven = false;
};
StageLayers stage_layers(const GptModel& m, const ParallelConfig& c);

// Bytes a ZeRO-3 gather moves per parameter element: gather_bytes (1: int8 and its blocks' scales), else `held`.
inline double gather_element_bytes(double gather_bytes, double held) {
  return gather_bytes == 1 ? 1 + 4.0 / 256 : gather_bytes > 0 ? gather_bytes : held;
}

struct StepBreakdown {
  double compute = 0;    // GEMMs + element-wise, all micro-batches, excluding the bubble
  double recompute = 0;  // part of compute spent recomputing
  double bubble = 0;
  double tp_comm = 0;  // exposed (Megatron does not overlap it)
  double pp_comm = 0;
  double embedding_sync = 0;  // tied embeddings' gradients between the first and last stage (p > 1), exposed
  double dp_comm = 0;         // total data-parallel exchange time
  double dp_exposed = 0;
  double zero3_exposed = 0;
  double compression = 0;  // compress/decompress compute
  double optimizer = 0;
  // Compute slowed by the data-parallel collectives it hides (their kernels hold comm_sms of the accelerator's SMs):
  // the step ends no earlier than its compute, stretched by comm_sms / sm_count of the hidden communication time
  // (sim/step.cc, overlap_slowdown); 0 where nothing overlaps or the collectives take no SMs.
  double overlap_slowdown = 0;
  // Layer-list models with a measured model step (`model_calibration:`): the framework's time per step beyond the
  // layers' kernels (part of compute; may be negative when the kernels timed alone are slower than in the model),
  // and the wait for the slowest of the data-parallel ranks (part of dp_exposed).
  double framework = 0;
  double rank_wait = 0;
  // A GPT pipeline's stages, one micro-batch's forward and backward each with their collectives and transfers, and
  // of that the forward (p = 1: `last` is the one stage; 0 for layer lists): the last runs the output layer and the
  // loss, the first the embedding's tensor-parallel collective, a middle one (none at p = 2) neither. 1F1B takes
  // m max + (sum - max), interleaved m max + (sum - max) / v + (p - 1/v)(first - middle), GPipe sum + (m - 1)(the
  // largest forward + the largest backward); sim/step.cc says why.
  double stage_first = 0, stage_middle = 0, stage_last = 0;
  double stage_first_forward = 0, stage_middle_forward = 0, stage_last_forward = 0;
  // One transformer layer's share of a stage's time above (its compute, recompute and tensor-parallel collectives),
  // and of its forward: each stage's time moves by it with each layer the stage gains or loses, which is how the
  // planner weighs other splits of the layers before it simulates them (0 for layer lists).
  double stage_layer = 0, stage_layer_forward = 0;
};

struct MemoryBreakdown {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  double total() const { return params + grads + optimizer + activations; }
};

// A pipeline's memory per GPU on its first, second and last stages, and the bytes one transformer layer more adds to
// each (a stage's memory is linear in its layers).
struct StageMemory {
  double first = 0, second = 0, last = 0;
  double first_layer = 0, second_layer = 0, last_layer = 0;
};

struct StepResult {
  ParallelConfig config;
  long long gpus = 0;
  long long microbatches = 0;
  double time = 0;  // seconds per iteration
  StepBreakdown breakdown;
  MemoryBreakdown memory;  // per GPU (the most loaded: first pipeline stage)
  StageLayers stage_layers;  // each pipeline stage's transformer layers (GPT steps)
  // GPT steps with pp > 1, GPipe or 1F1B (else zeros): the second stage is the most loaded middle one (one micro-batch
  // fewer in flight than the first under 1F1B; 0 where p = 2). The planner's search for a split that fits.
  StageMemory stage_memory;
  double memory_capacity = 0;
  bool fits = true;
  double model_flops = 0;     // per iteration, no recompute (72 formula terms from the GEMMs)
  double hardware_flops = 0;  // including recompute
  double model_tflops_per_gpu = 0;
  double hardware_tflops_per_gpu = 0;
  double mfu = 0;  // model FLOP/s per GPU / peak
  std::string dp_algorithm, tp_algorithm, dp_bottleneck;
  std::vector<std::string> notes;  // explanations
  bool approximate = false;        // some collective's time is symmetric mode's approximation (a note says which)
};

// Checks the configuration against the model and the cluster; ConfigError naming the flag.
void validate_config(const GptModel& m, const ParallelConfig& c, long long gpus);
// ConfigError for flags that contradict each other on the data-parallel exchange (async with --no-overlap), or act
// on one that dp = 1 does not have (ZeRO, compression, a sync scheme other than bsp, --no-overlap).
void check_data_parallel_flags(const ParallelConfig& c, long long dp);

StepResult simulate_step(CollectiveModel& net, const GptModel& m, const ParallelConfig& c);

// ZeRO-1/2's allgather behind the next forward, cut into calls as `conduit train` cuts it: the parameter tensors
// (`units`: each unit's tensors' element counts, both in forward order) fill the gradient buckets from the last one
// backward, a bucket closing before a tensor that would take it past `bucket_elems` (a tensor is never split); a
// call is a unit's elements within one bucket, and a unit's part joins the bucket's last call while that call holds
// fewer than `min_elems`. The calls in the order they are issued, each with the first unit that waits for it.
struct DeferredCall {
  double elems = 0;
  size_t unit = 0;
};
std::vector<DeferredCall> deferred_allgather_calls(const std::vector<std::vector<double>>& units, double bucket_elems,
                                                   double min_elems);

// A model given as a list of layers (MLP, CNN), data parallel, or cut into pipeline stages as `conduit train --pp`
// cuts it (tp = 1; docs/sim.md §5): forward GEMMs (convolutions as
// implicit GEMMs), backward input and weight gradients, an activation function pass per layer over elements of
// --grad-bytes (2: mixed precision, 4: f32), the gradient
// exchange bucketed and overlapped with backward (quantized when --compression says so), ZeRO memory.
StepResult simulate_layer_step(CollectiveModel& net, const LayerModel& m, const ParallelConfig& c);

}  // namespace conduit::sim
