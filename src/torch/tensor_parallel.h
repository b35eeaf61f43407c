#pragma once
// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) for `conduit train --tp T`: a vision transformer whose
// attention heads and MLP hidden units are split over the T ranks of a tensor-parallel group.
//
//  - Each transformer block has two collectives forward and two backward, as Megatron's: the attention's QKV
//    projection and the MLP's first layer are column-parallel (each rank computes its heads' / hidden units' share,
//    entered through f: identity forward, allreduce of the input gradient backward), the attention's output
//    projection and the MLP's second layer are row-parallel (each rank's partial product summed by g: allreduce
//    forward, identity backward; the bias added once, after the sum).
//  - Embeddings, layer norms and the classifier are replicated: every rank of a group computes them alike, and their
//    gradients are alike because f's backward sums the input gradients. Data parallelism runs over the groups (the
//    ranks with the same position in theirs).
//  - Every rank draws the whole model's initial weights from the seed and keeps its share, so a run with T ranks a
//    group computes what the same model unsplit computes, up to the order of float sums.
#include <atomic>
#include <cstdint>
#include <memory>

#include "coll/communicator.h"

namespace conduit::train {

class Net;
class Trace;

// A tensor-parallel group and what its collectives cost (read by the trainer after each step).
struct TpGroup {
  coll::CommPtr comm;  // the T ranks that split each layer
  double timeout_s = 0;
  // Sequence parallelism (Megatron-LM's --sequence-parallel, Korthikanti et al. 2022): between the split layers each
  // rank holds and computes (layer norms, residual additions) only its share of the tokens; the allreduces of f and
  // g become an allgather and a reduce-scatter of the tokens, the same bytes, and the replicated parameters those
  // shares use get their partial gradients summed over the group.
  bool sequence_parallel = false;
  Trace* trace = nullptr;  // optional: a "tp allreduce" (allgather, reduce_scatter) event per collective
  // allreduced bytes, forward and backward (an allgather or reduce-scatter of n bytes counts n/2: half an allreduce's)
  std::atomic<uint64_t> payload_bytes{0};
  std::atomic<uint64_t> calls{0};
  std::atomic<int64_t> comm_ns{0};  // time inside the collectives
};

// The vision transformer "vit" for 28x28 images: 4x4 patches (49 tokens), width 64, 4 heads, 4 pre-norm blocks with
// an MLP of 128, mean pooling, a linear classifier. group null or of one rank: the whole model. Otherwise its size
// must divide the heads (1, 2 or 4). Initialised from torch's global generator (the whole model, on every rank).
// With stages > 1 (1, 2 or 4: they divide the blocks): pipeline stage `stage` (torch/pipeline.h), holding its share
// of the blocks, the first also the embedding (it takes images), the last also the final norm and the classifier (it
// returns logits); the others take and return activations of 49 tokens x 64 per sample (chunk_input_shape).
// chunks > 1: the interleaved schedule's stage, holding chunks non-consecutive parts of the blocks (chunk j is part
// j x stages + stage of stages x chunks), each a forward_chunk.
std::shared_ptr<Net> make_vit(TpGroup* group, int stage = 0, int stages = 1, int chunks = 1);
// The parameters tensor-parallel rank 0 of `tp` holds in that stage (their shapes: every rank of a group holds alike
// shapes), without a group: for checks before the ranks exist. Its forward throws.
std::shared_ptr<Net> make_vit_layout(int tp, int stage = 0, int stages = 1, int chunks = 1);
constexpr int kVitHeads = 4;
constexpr int kVitBlocks = 4;

}  // namespace conduit::train
