#pragma once
// Pipeline parallelism for `conduit train --pp P --micro-batches M`: the model is cut into P stages on P ranks (the
// vit's blocks, torch/tensor_parallel.h; the other models' units balanced by their work, torch/models.h); each batch is
// split into M micro-batches that flow through the stages, so the stages compute different micro-batches at once.
//
//  - Forward of a micro-batch on stage s: receive its activations from s-1 (the first stage slices the images),
//    compute, send the output to s+1; the last stage computes the loss (scaled by the micro-batch's share of the
//    batch, so the sum over micro-batches is the batch's mean loss). Backward: receive the gradient of the output
//    from s+1 (the last stage starts from its loss), backpropagate, send the input's gradient to s-1. Gradients
//    accumulate in .grad over the micro-batches; the data-parallel exchange (DistributedOptimizer with
//    backward_passes = M) overlaps the last micro-batch's backward.
//  - Schedules (Narayanan et al., SC'21, "Efficient large-scale language model training on GPU clusters"):
//    gpipe (Huang et al. 2019): every forward, then every backward; a stage holds the activations of all M
//    micro-batches. 1f1b (PipeDream-Flush): stage s runs min(P-s-1, M) forwards, then alternates one forward and one
//    backward, then the remaining backwards; at most min(P-s, M) micro-batches in flight. interleaved (Megatron-LM's
//    interleaved 1F1B): each stage holds v chunks of blocks (stage s the model's chunks s, s+P, ...: the vit's 4
//    blocks give v = 2 on 2 stages), micro-batches go in groups of P (M a multiple of P) and the last stage's chunk
//    j feeds the first stage's chunk j+1, so the bubble shrinks to (P-1)/(vM) for v times the messages and more
//    activations held. All are synchronous (one optimizer step a batch, the same gradients as without a pipeline,
//    BatchNorm aside: it normalises each micro-batch by its own statistics);
//    GPipe and 1F1B idle (P-1)/M of an ideal step (the bubble); 1F1B saves activation memory, not time.
//  - Activation recomputation (Chen et al. 2016; GPipe's re-materialisation): a stage keeps only each micro-batch's
//    input, computes the forward without a graph, and again with one in the backward; the same gradients for one
//    more forward a micro-batch (and, with tensor parallelism, its collectives again). The recomputed forward leaves
//    the stage's buffers (BatchNorm's running statistics) as the first one left them: each micro-batch counts once.
//  - Sends are asynchronous (posted; their buffers freed once complete, all waited for at the end of the step),
//    receives block: on every link messages flow in the order both ends run their schedule, so no schedule can
//    deadlock, and messages of one kind into one chunk (one tag) match receives in that order.
//  - Pipeline and tensor parallelism compose: the T ranks of a stage run the same schedule (their tensor-parallel
//    collectives meet), and each sends to the rank at its position in the next stage's group.
#include <torch/types.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "coll/communicator.h"

namespace conduit::train {

class Net;
class Trace;

enum class PipeSchedule { kGpipe, k1F1B, kInterleaved };
// "gpipe", "1f1b" or "interleaved"; ConfigError (one line) for anything else.
PipeSchedule parse_pipe_schedule(const std::string& s);
const char* to_string(PipeSchedule s);

// What the pipeline moved and waited for since the last take_stats().
struct PipeStats {
  uint64_t bytes_sent = 0, bytes_recv = 0;  // activations and their gradients
  double wait_s = 0;       // blocked in receives and in the sends' completion: transfers and the bubble
  // Most micro-batches whose activations this stage held at once for their backward (with recompute: their inputs);
  // send buffers not yet complete are not counted.
  int peak_in_flight = 0;
};

class Pipeline {
 public:
  // stages: the P ranks of this pipeline, rank = stage (null or one rank: a single stage, micro-batches only, which
  // is gradient accumulation). stage: this rank's part of the model, whose chunk_input_shape / chunk_output_shape
  // give the per-sample shapes it receives (the vit's {49, 64} between any two stages; the cnn's {64, 7, 7} after
  // its convolutions).
  Pipeline(coll::CommPtr stages, std::shared_ptr<Net> stage, PipeSchedule schedule, double timeout_s = 0,
           Trace* trace = nullptr, bool recompute = false);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  struct StepResult {
    double loss = 0;     // the batch's mean cross-entropy
    double correct = 0;  // samples whose argmax was the label
  };
  // Forward and backward of one batch in `micro_batches` near-equal parts (1 to the batch size); x (images) is read
  // by the first stage only (others may pass it or an undefined tensor), y (labels, its size the batch's) by the
  // last; every stage passes the same labels' size. The result is the same
  // on every stage (the last one's, broadcast).
  StepResult train_step(const torch::Tensor& x, const torch::Tensor& y, int micro_batches);
  // Inference of one chunk: the first stage reads x, the others receive from the stage before; returns the logits on
  // the last stage, an undefined tensor elsewhere. The sends are left in flight (a few at a time) so consecutive
  // chunks overlap across stages; flush() waits for them.
  torch::Tensor infer(const torch::Tensor& x, int64_t n);
  void flush();
  // Broadcast of `count` doubles from the last stage to every stage.
  void from_last(double* v, size_t count);

  PipeStats take_stats();

 private:
  // kind 0: forward, from the stage before; 1: backward, from the stage after; 2: inference, from the stage before;
  // into chunk `chunk` of this stage; send: from chunk `chunk` of this stage.
  torch::Tensor recv_activation(int64_t n, int kind, int chunk);
  void send(torch::Tensor t, int kind, int chunk);
  // Whether chunk j of this stage is the model's first (it takes the images) or last (it has the loss).
  bool first_chunk(int j) const { return stage_id_ == 0 && j == 0; }
  bool last_chunk(int j) const { return stage_id_ == n_stages_ - 1 && j == chunks_ - 1; }
  void wait_sends(size_t keep);

  coll::CommPtr comm_;
  std::shared_ptr<Net> net_;
  PipeSchedule schedule_;
  double timeout_s_;
  Trace* trace_;
  bool recompute_;
  int stage_id_ = 0, n_stages_ = 1, chunks_ = 1;
  struct Pending {
    coll::Work work;
    torch::Tensor buf;
    bool back = false;  // for its errors (formatted only then): the gradient of the input, or the output
    int chunk = 0, peer = 0;
  };
  std::string describe(const Pending& p) const;
  void wait_send(Pending& p);
  std::deque<Pending> sends_;
  PipeStats stats_;
};

}  // namespace conduit::train
