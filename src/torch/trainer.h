#pragma once
// The training loop of one worker (torch-free interface, so the CLI and tests need no libtorch headers).
#include <cstdint>
#include <vector>

#include "coll/communicator.h"
#include "torch/config.h"

namespace conduit::train {

struct TrainResult {
  double test_accuracy = 0;     // after the last epoch evaluated (sharded over the ranks)
  double train_loss = 0;        // mean loss of the last epoch (this rank)
  double wall_s = 0;            // training time, resumed runs included
  double time_to_target_s = -1; // first epoch end with test accuracy >= target (-1: not reached / not set)
  int epochs = 0;               // epochs completed
  int64_t steps = 0;            // optimizer steps in all
  uint64_t bytes_sent = 0, bytes_recv = 0, raw_bytes = 0, payload_bytes = 0, grad_bytes = 0;  // this rank
  uint64_t world_bytes_sent = 0, world_raw_bytes = 0;  // summed over ranks
  double compute_s = 0, comm_s = 0, exposed_comm_s = 0;
  // This rank's optimizer at the end: its state's bytes (momentum, Adam's moments), the elements it steps (ZeRO:
  // this rank's slices), and the gradient memory held between steps (bsp only; 0 otherwise).
  uint64_t optimizer_state_bytes = 0, optimizer_elements = 0, gradient_bytes_held = 0;
  uint64_t parameter_bytes_held = 0;  // trainable parameters held between steps (ZeRO-3: the slices)
  // With pp or micro_batches: the most micro-batches whose activations this rank's stage held at once.
  int pipeline_peak_micro_batches = 0;
  std::vector<float> params;    // every parameter, flattened in registration order (when keep_params)
  std::vector<float> buffers;   // every floating-point buffer (BatchNorm statistics), likewise
  std::vector<std::vector<int>> buckets;  // parameter indices of each gradient bucket, in communication order
  std::vector<size_t> param_numel;        // elements of each trainable parameter (what buckets index)
};

struct WorkerOptions {
  bool keep_params = false;  // fill TrainResult::params
  bool write_outputs = true; // metrics, summary, checkpoints, trace under c.output
};

// Trains on `comm` (every rank calls it with the same config). Rank 0 prints the progress bar and writes
// metrics.jsonl and summary.json; every rank writes its own checkpoint files, and the lowest rank of each file system
// that holds some (rank 0 where the ranks share one; one rank a node where nodes have their own) writes
// checkpoint.json, switches the `checkpoint` link and removes the older stages.
TrainResult train_worker(const TrainConfig& c, coll::CommPtr comm, const WorkerOptions& o = {});

// Checks that need the model: a PowerSGD rank that compresses no matrix, a batch larger than the data. ConfigError.
// notes: print what passes but deserves a word (a pipeline stage PowerSGD compresses nothing of) on stderr.
void check_model_config(const TrainConfig& c, int world, bool notes = false);

// Whether the data-parallel groups of tensor-parallel partners (ranks of one model replica's stage: rank = replica x
// mp + stage x tp + position, mp = tp x pp; a group holds the ranks of one rank % mp) split over hosts alike:
// host_of[r] is rank r's host. ZeRO's int reduce-scatter goes in two hops where a group spans hosts, rounding partial
// sums at points the host map decides: partners whose groups split otherwise would round the replicated parameters'
// sums apart, so then it goes in one hop.
bool tp_partners_split_alike(const std::vector<int>& host_of, int tp, int mp);
// The same holds for the f32 sums: a data-parallel group's allreduce and reduce-scatter algorithm follows its host
// count and layout (hier over a host's ranks first, ring or halving-doubling else), and partners whose groups split
// over hosts otherwise summed a replicated parameter's gradient in other orders, its copies drifting apart by
// rounding for good. Where they split otherwise, `dp` (one partner's group) gets a tuner of its own that forces the
// ring, whose order follows the ranks alone. Returns whether it did.
bool agree_partner_sums(coll::Communicator& dp, const std::vector<int>& host_of, int tp, int mp);

}  // namespace conduit::train
