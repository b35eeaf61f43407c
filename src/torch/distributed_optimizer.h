#pragma once
// DistributedOptimizer: data-parallel training of a torch::nn::Module over a Conduit communicator, as Horovod's
// DistributedOptimizer and PyTorch DDP do.
//
//  - At construction rank 0's parameters and buffers are broadcast, so every rank starts from the same model.
//  - A hook on every parameter copies its gradient into a flat bucket as soon as autograd produces it. Buckets hold
//    parameters in the order their gradients become ready (reverse registration order at first; after the first
//    step the order rank 0 observed, broadcast so every rank agrees), the first one capped small
//    (first_bucket_bytes) so communication starts early, the others at bucket_cap_bytes (default 25 MiB).
//  - A full bucket goes to a background communication thread at once (overlap) which compresses, reduces
//    (averages) and decompresses it while backward goes on; buckets are communicated in bucket order on every rank.
//  - step() waits only for what is still in flight, writes the averaged gradients into .grad and runs the wrapped
//    optimizer's step.
//  - Any compressor of src/compress plugs in (compressed_allreduce_many per bucket; PowerSGD per matrix); its state
//    is kept per parameter and saved in checkpoints.
//  - ZeRO stages 1 and 2 (Rajbhandari et al., SC'20; DeepSpeed's zero_optimization): each bucket is reduce-scattered
//    instead of allreduced, every rank steps only its slice of every bucket and the stepped slices are allgathered,
//    so the optimizer state (and at stage 2 the gradients) held per rank is 1/W of the model's, for the same bytes
//    on the wire as the allreduce (DistOptions::zero_stage). Stage 3 also partitions the parameters themselves: a
//    unit of the model (a layer) is gathered whole only while its forward or backward runs.
//
// With overlap, DistOptions::backward_passes backward calls a step (one by default; one more gradient before step() is
// refused: its bucket may be exchanged already); without overlap any number accumulate. Every rank runs the same model.
// The buckets travel on `comm` from the communication thread: collectives run on `comm` from another thread while a
// step's buckets are in flight (a second DistributedOptimizer on it, a GAN's) could interleave differently on each
// rank; give each its own (comm->split). With find_unused_parameters the constructor is collective: it splits one off
// for the buckets (and at ZeRO stage 3, or stages 1 and 2 with units and zero_prefetch, one for the parameters'
// gathers).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "coll/communicator.h"
#include "torch/metrics.h"
#include "torch/models.h"

namespace conduit::train {

struct DistOptions {
  size_t bucket_cap_bytes = size_t(25) << 20;
  size_t first_bucket_bytes = size_t(1) << 20;
  bool overlap = true;             // false: communicate every bucket only when step() is called
  std::string compressor = "none";  // compressor spec (compress/compressor.h); "none": plain f32 allreduce
  // Parameters whose gradient has fewer bytes than this skip the compressor and go through a plain f32 allreduce
  // (as BytePS's min-compress-bytes): sparsifying a 32-element bias keeps almost nothing, at a byte cost that is
  // negligible next to the large layers. 0: every parameter goes through the compressor.
  size_t compress_min_bytes = 0;
  // SGD momentum applied to those plain-allreduced gradients before they are averaged (their state is kept with the
  // parameter's compressor state and checkpointed). For compressors that take over the optimizer's momentum (dgc's
  // momentum correction; the optimizer then runs plain SGD): without it the layers that skip dgc would train with no
  // momentum at all. Averaging is linear, so averaging u_i = m u_i + g_i is momentum on the averaged gradient.
  double dense_momentum = 0;
  uint64_t seed = 0;               // compressor seed (the same on every rank)
  bool rebuild_buckets = true;     // after the first step, re-bucket by the observed gradient-ready order
  // Parameters no rank produced a gradient for in a step (a branch no sample took, a head used only sometimes): with
  // this, one more allreduce a step (a byte per parameter) finds them and their .grad is left undefined, so the
  // optimizer skips them (weight decay and momentum leave them as they are), as DDP's find_unused_parameters, and
  // the compressor and dense momentum skip them too (error feedback keeps their residual for a step that uses them);
  // without, they are averaged as zero gradients and the optimizer steps them with those.
  bool find_unused_parameters = false;
  double timeout_s = 0;            // collective deadline (0: the communicator's)
  Trace* trace = nullptr;          // optional timeline
  // ZeRO stage. 0: every rank averages every gradient (allreduce) and steps every parameter. 1: the optimizer state
  // is partitioned. The model's trainable parameters are re-seated as views of one flat tensor laid out bucket
  // after bucket; each bucket is split into W near-equal slices (rank r's is the r-th), reduce-scattered, and the
  // optimizer's parameters become this rank's slices (views of that flat tensor), so its state (momentum, Adam's
  // moments) covers 1/W of the elements; step() steps the slices and allgathers them into every rank's parameters.
  // The optimizers here are elementwise (sgd, adam, adamw), so the result is plain data parallelism's. 2: the
  // gradients too: a parameter's .grad is dropped as soon as its hook has copied it into its bucket, and a bucket's
  // buffer is released once it is reduce-scattered, so between steps a rank holds its averaged slices and at most two
  // released bucket buffers kept for reuse (DeepSpeed keeps its reduce buckets likewise).
  // Needs compressor "none", or "fp16" / "bf16" to reduce-scatter the gradients as 16-bit floats, or "int8" / "int4" to
  // send them in int8 / int4 blocks by all-to-all (ZeRO++'s quantized gradients, qgZ: each rank's contribution to
  // each slice rounded once, about a quarter (an eighth) of f32's bytes, in two hops over several hosts:
  // compress::int_reduce_scatter; without error feedback, or with it as "ef:int8" / "ef:int4": each rank's residual
  // the size of its whole gradient, in the compressor state; int4 is this wire's only, no compressor at stage 0) (the
  // slices and the allgather stay f32), no find_unused_parameters, one parameter group over exactly the trainable
  // parameters and an optimizer that has not stepped (a checkpoint's optimizer state loads after construction, since
  // the state is the slices'). Buckets keep reverse registration order (rebuild_buckets does not apply: a run resumed
  // from a checkpoint must cut the same slices before its first step, when no order has been observed). .grad does not
  // hold averaged gradients after synchronize(), and last_stats() counts the allgather only once step() ran. A
  // constructor that throws after the checks (the initial broadcast failed) leaves the model re-seated and the
  // optimizer on the slices (at stage 3 the broadcast comes first: the model as it was). 3: the parameters too
  // (DeepSpeed's stage 3, FSDP's full sharding). Each unit of `units` is one bucket whose parameters are views of one
  // flat tensor that holds data only while the unit is gathered: the model runs each unit between the hooks of
  // unit_hooks() (Net::unit), which allgather its slices into it before its forward, release it after (the last unit
  // stays for the backward that follows at once), and gather it again before its backward; once the unit's gradients of
  // a backward pass are in its bucket it is released again. Between steps a rank holds 1/W of the parameters (its
  // slices, which the optimizer steps; nothing is allgathered after the step), 1/W of the gradients and 1/W of the
  // optimizer state, for 1.5 times the allreduce's bytes: an allgather forward, one backward (but the last unit's), the
  // reduce-scatter. The gathers run on a communicator of their own (the constructor is collective: it splits one off);
  // with zero_prefetch the next unit's gather (forward: the one after, backward: the one before) starts in the
  // background as a unit begins, so it moves while that unit computes, and only what is left of it when its unit begins
  // blocks (exposed communication); without, each gather blocks the thread of forward and backward whole. Every gather
  // is collective: the ranks run the same forwards and backwards (a forward without gradients gathers and releases unit
  // by unit; an evaluation whose ranks run other numbers of batches holds whole_parameters() instead, as anything else
  // that reads the parameters does: a checkpoint, a copy). After the DistributedOptimizer goes, the model holds only
  // what whole_parameters() gathered: take it before, and keep it, to use the model afterwards. The same conditions as
  // stages 1 and 2, and every trainable parameter in exactly one unit; bucket caps and rebuild_buckets do not apply.
  int zero_stage = 0;
  // ZeRO stage 3: gather the next unit while the current one computes (DeepSpeed's stage-3 prefetch, FSDP's
  // forward and backward prefetch), one unit ahead: two units whole at a time instead of one (a unit gathered ahead
  // that no pass then runs, one skipped by the model's forward, stays whole until step()). Stages 1 and 2 with
  // units: the allgather after step() goes on behind the next forward (below).
  bool zero_prefetch = true;
  // ZeRO stage 3: the element type the training gathers (forward, backward, prefetched) move the parameters in. bf16
  // or f16 halve their bytes (as ZeRO++'s quantized weights, qwZ, with a 16-bit float instead of int8); i8 is qwZ's
  // int8: each rank's slice in blocks of 256 elements, each block a f32 scale (its largest magnitude / 127) and the
  // elements rounded to multiples of it in [-127, 127], about 25% of f32's bytes (more where a rank's slice of a unit
  // is under 256 elements: each rank's part carries a scale). Each rank casts or quantizes its
  // slice, and every rank widens the whole unit back to f32, so forward and backward run on the unit's weights
  // rounded to that type (the same on every rank) while the optimizer steps the exact f32 slices.
  // whole_parameters() (evaluations, checkpoints) gathers f32: exact weights. f32 (the default): exact everywhere.
  DType zero_gather_dtype = DType::f32;
  // ZeRO stage 3: a secondary partition over groups of this many consecutive ranks of `comm` (ZeRO++'s hpZ; the
  // ranks of one node, as launchers number them): after a unit's training forward each rank keeps its 1/K of the
  // weights that forward ran, and the unit's backward gathers them within its group (in the forward's 16-bit wire,
  // else f32: a narrow forward wire's rounding carries over unchanged) instead of from all W ranks: (K-1)/K of the unit
  // a rank on the group's links instead of (W-1)/W across the cluster, for 1/K of a unit held from each unit's forward
  // to its backward. The training is the same bit for bit. 0 or 1: none; otherwise it must divide the ranks and be
  // fewer than them (a collective constructor then splits the groups off).
  int zero_secondary_ranks = 0;
  // ZeRO stage 3 sharded within groups of this many consecutive ranks of `comm` and replicated across the groups
  // (PyTorch FSDP's HYBRID_SHARD, MiCS): each unit's slices are cut over the group's K ranks, so its gathers run
  // within the group (on a node's links when the group is a node's ranks), and each unit's gradients are
  // reduce-scattered within the group, then each slice averaged with the same slice of the other groups (an
  // allreduce over the W/K ranks of one index in their groups). A rank holds 1/K of the parameters, gradients and
  // optimizer state instead of 1/W. On the f32 wire the same training as ZeRO-3 over all ranks, to the float sum's
  // order; on the 16-bit and int wires within their rounding (the groups' results are rounded again, or the
  // replicas' allreduce carries f32). 0: shard
  // over all ranks; otherwise it must divide the ranks, be 2 or more and fewer than them (a collective constructor
  // then splits the groups off). Not with zero_secondary_ranks (the gathers are within the group already).
  // At stages 1 and 2 likewise (FSDP's _HYBRID_SHARD_ZERO2): each bucket's slices cut over the group, reduce-scattered
  // within it, averaged across the groups, and the stepped slices allgathered within it; a rank holds 1/K of the
  // optimizer state (and at stage 2 of the gradients).
  int zero_shard_ranks = 0;
  // The int wires (the int8/int4 reduce-scatter, ZeRO-3's int8 gathers) start a quantization block at every
  // parameter, not only at each rank's slice: a block's one scale then never mixes two parameters. Tensor parallelism
  // needs it: a replicated parameter (layer norms, biases after a row-parallel layer) is equal on the ranks of a group
  // and a split one is not, so a block holding both got a scale of its own on each rank, rounded the replicated
  // elements differently, and the group's copies of them drifted apart. A few more scales on the wire.
  bool blocks_per_parameter = false;
  // ZeRO's int8/int4 reduce-scatter in two hops where the group spans hosts (compress::int_reduce_groups); false: one
  // hop over the group (tensor-parallel partners whose groups split over hosts otherwise: train::
  // tp_partners_split_alike).
  bool zero_int_hierarchy = true;
  // The parameters of each unit (Net::units()), in the order forward runs them. ZeRO stage 3 needs them. At stages 1
  // and 2 with zero_prefetch they let the allgather of the stepped slices go on behind the next forward: step() starts
  // it (on a communicator of its own, split off by the constructor: collective) as one allgather per unit and bucket,
  // in forward order, and returns; the model, running its units through unit_hooks(), waits before each unit only for
  // that unit's parameters (the wait is the next step's exposed communication, the bytes this step's; the parameters
  // of a unit that has not begun are not to be read meanwhile); synchronize() and whole_parameters()
  // finish what no forward did. Anything else that reads the parameters between step() and the next forward holds
  // whole_parameters() first (an evaluation, a checkpoint, a copy), as at stage 3. Empty at stages 1 and 2, or
  // without zero_prefetch: the allgather blocks in step().
  std::vector<std::vector<torch::Tensor>> units;
  // ZeRO stages 1 and 2, the allgather behind the next forward (units and zero_prefetch): consecutive units' parameters
  // within one bucket go in one allgather until it carries at least this many bytes (DeepSpeed's
  // allgather_bucket_size): fewer calls, each a unit's forward waits for a larger one. Over many ranks every call pays
  // the algorithm's latencies (a ring's W-1) whatever its size, and a call per unit can cost more than the forward
  // it hides behind. 0 (the default): one call per unit and bucket. A unit's parameters in several buckets still go
  // in as many calls (a call covers a contiguous range of one bucket). Nothing without the deferred allgather; stages
  // 0 and 3 refuse it.
  size_t zero_allgather_bytes = 0;
  // Backward calls a step (gradient accumulation over micro-batches, a pipeline's): each parameter's gradients are
  // summed in its bucket, and the bucket goes once every parameter in it has had its backward_passes-th, so the
  // exchange of the last micro-batch's buckets overlaps its backward, as DDP's no_sync() then a last backward. A
  // parameter no micro-batch reached is sent as zeros at step() (or left out with find_unused_parameters). With ZeRO
  // stages 2 and 3 the buckets then hold the whole gradient from the first micro-batch to their reduce-scatter (the
  // sum needs it; zero_reduce_each_pass reduce-scatters every micro-batch instead, as DeepSpeed, for M times the
  // bytes); between steps, as ever, the slices (and at stage 2 at most two spare buffers).
  int backward_passes = 1;
  // ZeRO stage 2 or 3 with backward_passes 2 or more: each pass's buckets are reduce-scattered as they fill and the
  // averaged slices added into the slices' .grad (DeepSpeed's ZeRO-2 and 3 under gradient accumulation), instead of
  // summing the passes in whole-gradient buckets and reducing once: backward_passes times the reduce-scatter's bytes
  // for 1/W of the gradients held between passes (the slices and at most two spare buffers, where the buckets held
  // every gradient). With zero_shard_ranks the replicas' allreduce still goes once a step, after the last pass (MiCS's
  // accumulation: the cross-group exchange waits for the accumulation boundary). A pass's gradient of a bucket whose
  // previous pass is still being exchanged waits for it (exposed). Needs overlap and every backward pass to reach
  // every trainable parameter (not with find_unused_parameters); refused at other stages.
  bool zero_reduce_each_pass = false;
};

// Bytes of the optimizer's state tensors (sgd's momentum buffers, adam's and adamw's moments): what ZeRO partitions.
uint64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// The parameters an optimizer steps: those that require a gradient, each once (a tensor registered under two names,
// tied weights, is listed under its first: libtorch's parameters() lists it twice), in registration order.
std::vector<std::pair<std::string, torch::Tensor>> trainable_parameters(torch::nn::Module& model);
// Broadcasts the buffers of `model` from rank 0 of `comm`, and its parameters: all, or only the frozen ones (those
// that do not require a gradient), or none. Coalesced like broadcast_buffers. timeout_s: each collective's deadline
// (0: the communicator's).
enum class Broadcast { kAllParameters, kFrozenParameters, kNoParameters };
void broadcast_module(torch::nn::Module& model, coll::Communicator& comm, Broadcast parameters, double timeout_s = 0);
// Broadcasts the buffers of `model` from rank 0, one collective per element type and 64 MiB (each type's buffers
// coalesced: two for BatchNorm's float statistics and int64 step counters).
// Returns the bytes broadcast (0 on one rank).
uint64_t broadcast_buffers(torch::nn::Module& model, coll::Communicator& comm, double timeout_s = 0);
// The mean of every float buffer (BatchNorm's running statistics) over the ranks, in one allreduce. Schemes other than
// bsp let each worker's statistics follow its own data; at the end they are averaged with the model.
void average_buffers(torch::nn::Module& model, coll::Communicator& comm);

class DistributedOptimizer {
 public:
  DistributedOptimizer(std::shared_ptr<torch::nn::Module> model, std::shared_ptr<torch::optim::Optimizer> optimizer,
                       coll::CommPtr comm, DistOptions options = {});
  // Exchanges the buckets this rank's backward has made ready and its thread has not (with overlap, unless one
  // failed), then stops the thread: after an error every rank raised between backward and step(), every rank's
  // thread ends at the same bucket and the communicator stays usable. (Not with find_unused_parameters, where a
  // bucket holding a parameter only some ranks used is ready on those alone: one of them waits for its deadline.)
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  void zero_grad();
  // Waits for the communication still in flight, writes the averaged gradients into .grad, runs the optimizer (at
  // ZeRO stages 1 and 2 with units and zero_prefetch, then starts the allgather of the stepped slices and returns).
  void step();
  // The first half of step(): every gradient averaged and in .grad (no optimizer update). A step() after it (e.g.
  // clip the averaged gradients, then step, as with Horovod) does not exchange again.
  void synchronize();

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  coll::Communicator& comm() { return *comm_; }
  const StepStats& last_stats() const { return last_; }
  const StepStats& total_stats() const { return total_; }
  void add_to_totals(const StepStats& s);  // restores counters from a checkpoint
  // Indices into trainable_parameters(model) (registration order, without frozen parameters and second names of tied
  // ones) of every bucket's parameters, in communication order.
  std::vector<std::vector<int>> bucket_layout() const;
  std::string compressor_name() const;
  // Elements the optimizer steps on this rank: every trainable one, or with ZeRO this rank's slices.
  size_t optimizer_elements() const;
  // Bytes of gradient memory this rank holds now: the buckets' buffers, the parameters' .grad and ZeRO's slices (and
  // with ef:int8 / ef:int4 at ZeRO the residuals, the size of the whole gradients).
  uint64_t gradient_bytes_held() const;
  // Bytes of trainable parameters this rank holds now: all of them, or at ZeRO stage 3 its slices and the units
  // gathered at the moment.
  uint64_t parameter_bytes_held() const;
  // The hooks the model runs its units between (Net::set_unit_hooks): ZeRO stage 3's gathers, or stages 1 and 2's
  // waits for the deferred allgather (DistOptions::units); null otherwise.
  std::shared_ptr<UnitHooks> unit_hooks();
  // ZeRO stage 3: every unit gathered whole, and kept so (a step refreshes it), until the returned handle and any
  // other such handle are gone: to evaluate, checkpoint or read the model. Collective: every rank at the same point.
  // Writes to the parameters meanwhile are lost at the release (the slices hold the model). Its gathers are not
  // counted in the step statistics (as evaluations are not). Stages 1 and 2: finishes a deferred allgather
  // (DistOptions::units), returns null. Stage 0: nothing to do.
  [[nodiscard]] std::shared_ptr<void> whole_parameters();

  // Compressor state of every parameter (residuals, PowerSGD's Q, step counters), for checkpoints.
  std::vector<uint8_t> save_compressor_state() const;
  void load_compressor_state(const std::vector<uint8_t>& bytes);

  struct Core;

 private:
  void broadcast_initial_state();
  void check_zero_optimizer();
  void allgather_slices();
  std::shared_ptr<torch::nn::Module> model_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  coll::CommPtr comm_;
  std::shared_ptr<Core> core_;
  StepStats last_, total_;
  double last_step_end_ = -1;
};

// ZeRO-2's released bucket buffers, by their capacities (in elements). `second`: the second-largest bucket's size.
// With overlap two buckets are in flight at once (the one sent, the one filling; more where backward outruns the
// reduce-scatters, or without overlap, and those past three allocate), and only one can be the largest: a
// spare past `second` is the largest bucket's alone (a smaller bucket that took it left the largest to allocate
// another, and two of the largest were kept from then on: more gradient memory than stage 0's), and up to two spares
// of at most `second` are kept for the others (with one, a pair of them in flight allocated every step).
namespace zero_spares {
// The spare a bucket of n elements takes (the smallest that may hold it), or capacities.size(): none, allocate one.
size_t pick(const std::vector<size_t>& capacities, size_t n, size_t second);
// The spares kept once one is released (indices into capacities, largest first): at most one past `second` and
// `others` of at most `second` (2 at stage 2: between steps the rank holds at most the largest bucket and two of the
// second-largest, never more than stage 0's two copies of the gradients; 1 at stage 3, whose point is memory: a pair
// of smaller units in flight then allocates, as its gathers do every pass).
std::vector<size_t> kept(const std::vector<size_t>& capacities, size_t second, int others = 2);
}  // namespace zero_spares

}  // namespace conduit::train
