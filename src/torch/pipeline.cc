// Pipeline parallelism: the micro-batch schedules (GPipe, 1F1B, interleaved) over point-to-point sends between stages.
#include "torch/pipeline.h"

#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/nn/functional.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "core/error.h"
#include "torch/metrics.h"
#include "torch/models.h"

namespace conduit::train {

PipeSchedule parse_pipe_schedule(const std::string& s) {
  if (s == "gpipe") return PipeSchedule::kGpipe;
  if (s == "1f1b") return PipeSchedule::k1F1B;
  if (s == "interleaved") return PipeSchedule::kInterleaved;
  throw ConfigError(fmt::format("config: pp_schedule: '{}'; allowed: gpipe, 1f1b or interleaved", s));
}

const char* to_string(PipeSchedule s) {
  return s == PipeSchedule::kGpipe ? "gpipe" : s == PipeSchedule::k1F1B ? "1f1b" : "interleaved";
}

namespace {
// Message kinds: activations forward, their gradients backward, inference activations. The tag is the kind and the
// receiving chunk: between two ranks, messages of one tag match receives in posting order (net/transport.h), which
// is the order both ends run the schedule. (A running count in the tag folded onto the outstanding sends' MPI tags:
// MPI keeps as few as 3 low bits of a tag, and GPipe has M sends in flight.)
constexpr int kForward = 0, kBackward = 1, kInfer = 2;
// (Chunks 0 and 1 keep distinct tags within the 3 low bits MPI keeps under UCX; the vit's stages have at most 2.)
uint32_t tag_of(int kind, int chunk) { return uint32_t(kind) | (uint32_t(chunk) << 2); }
constexpr const char* kKindName[3] = {"forward", "backward", "inference"};
}  // namespace

Pipeline::Pipeline(coll::CommPtr stages, std::shared_ptr<Net> stage, PipeSchedule schedule, double timeout_s,
                   Trace* trace, bool recompute)
    : comm_(std::move(stages)),
      net_(std::move(stage)),
      schedule_(schedule),
      timeout_s_(timeout_s),
      trace_(trace),
      recompute_(recompute) {
  if (!net_) throw InvalidArgument("Pipeline: a stage model is required");
  if (comm_ && comm_->size() > 1) {
    stage_id_ = comm_->rank();
    n_stages_ = comm_->size();
  } else {
    comm_ = nullptr;
  }
  chunks_ = net_->chunks();
  if (chunks_ > 1 && schedule_ != PipeSchedule::kInterleaved)
    throw InvalidArgument(fmt::format("Pipeline: a stage of {} chunks needs the interleaved schedule, not {}", chunks_,
                                      to_string(schedule_)));
  if (schedule_ == PipeSchedule::kInterleaved && (chunks_ < 2 || n_stages_ < 2))
    throw InvalidArgument(
        fmt::format("Pipeline: the interleaved schedule needs 2 or more stages of 2 or more chunks, "
                    "this one is stage {} of {} with {} chunk(s)",
                    stage_id_, n_stages_, chunks_));
}

Pipeline::~Pipeline() {
  // A send's buffer must outlive the transport's use of it: wait (each under its deadline) before they go.
  for (auto& p : sends_) {
    try {
      p.work.wait();
    } catch (...) {
    }
  }
}

std::string Pipeline::describe(const Pending& p) const {
  return fmt::format("pipeline stage {} of {}: sending the {} of chunk {} to stage {}", stage_id_, n_stages_,
                     p.back ? "gradient of its input" : "output activations", p.chunk, p.peer);
}

void Pipeline::wait_send(Pending& p) {
  try {
    p.work.wait();
  } catch (const Error& e) {
    rethrow_with_context(e, describe(p));
  }
}

torch::Tensor Pipeline::recv_activation(int64_t n, int kind, int chunk) {
  // (around the ring: with interleaved chunks the first stage's chunk j + 1 follows the last stage's chunk j)
  const int peer = (kind == kBackward ? stage_id_ + 1 : stage_id_ + n_stages_ - 1) % n_stages_;
  // (forward and inference: the chunk's input; backward: the gradient of its output)
  const std::vector<int64_t> per = kind == kBackward ? net_->chunk_output_shape(chunk) : net_->chunk_input_shape(chunk);
  if (per.empty())
    throw InvalidArgument(
        fmt::format("Pipeline: stage {} of {} has no activation shape for chunk {}", stage_id_, n_stages_, chunk));
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), per.begin(), per.end());
  torch::Tensor t = torch::empty(shape, torch::kFloat);
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  const double t0 = now_s();
  try {
    comm_->recv(t.data_ptr<float>(), size_t(t.numel()), DType::f32, peer, tag_of(kind, chunk), o).wait();
  } catch (const Error& e) {  // (the communicator names a rank and a tag: which stage waited for what)
    rethrow_with_context(
        e, fmt::format("pipeline stage {} of {}: receiving the {} of chunk {} from stage {}", stage_id_, n_stages_,
                       kind == kBackward ? "gradient of its output" : "input activations", chunk, peer));
  }
  stats_.wait_s += now_s() - t0;
  const uint64_t bytes = uint64_t(t.numel()) * sizeof(float);
  stats_.bytes_recv += bytes;
  if (trace_ && trace_->enabled())
    trace_->complete("pp recv", 0, t0, now_s(), {{"from", peer}, {"bytes", bytes}, {"kind", kKindName[kind]}});
  return t;
}

void Pipeline::send(torch::Tensor t, int kind, int chunk) {
  const bool back = kind == kBackward;
  const int peer = (back ? stage_id_ + n_stages_ - 1 : stage_id_ + 1) % n_stages_;
  // The receiving chunk: around the ring the last stage's chunk j feeds the first stage's j + 1 (and back).
  const int to = back ? (stage_id_ == 0 ? chunk - 1 : chunk) : (stage_id_ == n_stages_ - 1 ? chunk + 1 : chunk);
  t = t.detach().to(torch::kFloat).contiguous();
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  // Sends that have completed free their buffers now (not at the end of the step: GPipe would hold every one).
  while (!sends_.empty()) {
    bool done = false;
    try {
      done = sends_.front().work.test();
    } catch (const Error& e) {
      rethrow_with_context(e, describe(sends_.front()));
    }
    if (!done) break;
    sends_.pop_front();
  }
  sends_.push_back({comm_->send(t.data_ptr<float>(), size_t(t.numel()), DType::f32, peer, tag_of(kind, to), o), t, back,
                    chunk, peer});
  stats_.bytes_sent += uint64_t(t.numel()) * sizeof(float);
}

void Pipeline::wait_sends(size_t keep) {
  while (sends_.size() > keep) {
    const double t0 = now_s();
    wait_send(sends_.front());
    stats_.wait_s += now_s() - t0;
    sends_.pop_front();
  }
}

Pipeline::StepResult Pipeline::train_step(const torch::Tensor& x, const torch::Tensor& y, int micro_batches) {
  const int64_t b = y.size(0);
  const int m = micro_batches, p = n_stages_, d = stage_id_, v = chunks_;
  if (m < 1 || m > b)
    throw InvalidArgument(fmt::format("Pipeline: {} micro-batches of a batch of {}; allowed: 1 to {}", m, b, b));
  if (x.defined() && x.size(0) != b)  // (on every stage given images: they stop together)
    throw InvalidArgument(fmt::format("Pipeline: {} images and {} labels; allowed: one label a sample", x.size(0), b));
  if (v > 1 && m % p != 0)
    throw InvalidArgument(
        fmt::format("Pipeline: the interleaved schedule takes micro-batches in groups of the {} "
                    "stages, {} is not a multiple; allowed: a multiple of {}",
                    p, m, p));
  const size_t parts = static_cast<size_t>(m);
  std::vector<int64_t> size(parts), offset(parts);
  for (int k = 0; k < m; ++k) {
    size[size_t(k)] = b / m + (k < b % m ? 1 : 0);
    offset[size_t(k)] = k == 0 ? 0 : offset[size_t(k) - 1] + size[size_t(k) - 1];
  }
  struct Slot {
    // The chunk's input (its gradient goes back) and output (or, last, the scaled loss); with recompute the input
    // alone (the forward runs again in the backward).
    torch::Tensor in, out;
  };
  // The chunk's output for a micro-batch, or on the model's last chunk its loss scaled by the micro-batch's share.
  auto run = [&](int j, int k, const torch::Tensor& in) {
    torch::Tensor out = net_->forward_chunk(j, in);
    if (!last_chunk(j)) return std::make_pair(out, out);
    const torch::Tensor yk = y.narrow(0, offset[size_t(k)], size[size_t(k)]);
    const torch::Tensor l = torch::nn::functional::cross_entropy(out, yk);
    return std::make_pair(out, l * (double(size[size_t(k)]) / double(b)));
  };
  std::vector<Slot> slots(parts * size_t(v));
  // Recomputation saves memory where a chunk holds several micro-batches' activations: not where every backward
  // follows its forward at once (a 1F1B stage with no warm-up: the last, or the only one; the interleaved last
  // chunk; any schedule with one micro-batch).
  auto recompute = [&](int j) {
    if (!recompute_) return false;
    if (v > 1) return !last_chunk(j);
    if (schedule_ == PipeSchedule::kGpipe && p > 1) return m > 1;
    return std::min(p - d, m) > 1;
  };
  int live = 0, peak = 0;
  double loss = 0, correct = 0;
  auto forward = [&](int j, int k) {
    const double t0 = now_s();
    const int64_t n = size[size_t(k)];
    torch::Tensor in;
    if (first_chunk(j)) {
      in = x.narrow(0, offset[size_t(k)], n);
    } else {
      in = recv_activation(n, kForward, j);
      in.requires_grad_(true);
    }
    const double t1 = now_s();
    torch::Tensor out, scaled;
    {
      // (no graph with recompute: the backward builds it again)
      std::optional<torch::NoGradGuard> ng;
      if (recompute(j)) ng.emplace();
      std::tie(out, scaled) = run(j, k, in);
    }
    if (last_chunk(j)) {
      // The micro-batches' scaled losses add up to the batch's mean.
      loss += double(scaled.item<float>());
      correct += double(out.argmax(1).eq(y.narrow(0, offset[size_t(k)], n)).sum().item<int64_t>());
    } else {
      send(out, kForward, j);
    }
    slots[size_t(j) * parts + size_t(k)] = {in, recompute(j) ? torch::Tensor() : scaled};
    peak = std::max(peak, ++live);
    if (trace_ && trace_->enabled())
      trace_->complete("forward", 0, t1, now_s(), {{"micro_batch", k}, {"chunk", j}, {"waited_s", t1 - t0}});
  };
  auto backward = [&](int j, int k) {
    Slot& s = slots[size_t(j) * parts + size_t(k)];
    const double t0 = now_s();
    torch::Tensor g;  // (the last chunk starts from its loss)
    if (!last_chunk(j)) g = recv_activation(size[size_t(k)], kBackward, j);
    const double t1 = now_s();
    // The first forward updated the buffers (BatchNorm's running statistics) for this micro-batch: the second
    // computes the same outputs (training mode normalises by the micro-batch's own statistics), and its updates are
    // undone once the backward has freed the graph that saved the buffers.
    std::vector<torch::Tensor> buffers, kept;
    if (recompute(j)) {
      buffers = net_->buffers();
      {
        torch::NoGradGuard ng;
        for (auto& t : buffers) kept.push_back(t.clone());
      }
      s.out = run(j, k, s.in).second;
    }
    s.out.backward(g);
    if (!kept.empty()) {
      // (through variable_data(): the same storage under a version counter of its own, so a graph still alive that
      // saved these buffers, another chunk's, is not failed by the copy)
      torch::NoGradGuard ng;
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].variable_data().copy_(kept[i]);
    }
    if (trace_ && trace_->enabled())
      trace_->complete("backward", 0, t1, now_s(), {{"micro_batch", k}, {"chunk", j}, {"waited_s", t1 - t0}});
    if (!first_chunk(j)) send(s.in.grad(), kBackward, j);
    s = Slot{};
    --live;
  };
  if (v > 1) {
    // Interleaved 1F1B (Megatron-LM's): micro-batches in groups of p; the k-th forward of this stage is chunk
    // (k / p) mod v of micro-batch (k / (p v)) p + k mod p, the k-th backward the same micro-batch's chunk counted
    // from the last; (p - d - 1) 2 + (v - 1) p forwards first, then one forward and one backward in turn.
    const int total = m * v;
    auto mb = [&](int op) { return (op / (p * v)) * p + op % p; };
    auto fchunk = [&](int op) { return (op / p) % v; };
    auto bchunk = [&](int op) { return v - 1 - (op / p) % v; };
    const int warm = std::min((p - d - 1) * 2 + (v - 1) * p, total);
    for (int op = 0; op < warm; ++op) forward(fchunk(op), mb(op));
    for (int i = 0; i < total - warm; ++i) {
      forward(fchunk(warm + i), mb(warm + i));
      backward(bchunk(i), mb(i));
    }
    for (int i = total - warm; i < total; ++i) backward(bchunk(i), mb(i));
  } else if (schedule_ == PipeSchedule::kGpipe && p > 1) {
    for (int k = 0; k < m; ++k) forward(0, k);
    for (int k = 0; k < m; ++k) backward(0, k);
  } else {
    // 1F1B. One stage (micro-batches only: gradient accumulation) runs each micro-batch's forward and backward
    // together: nothing is gained by holding the activations of several.
    const int warm = std::min(p - d - 1, m);
    for (int k = 0; k < warm; ++k) forward(0, k);
    for (int k = 0; k < m - warm; ++k) {
      forward(0, warm + k);
      backward(0, k);
    }
    for (int k = m - warm; k < m; ++k) backward(0, k);
  }
  wait_sends(0);
  stats_.peak_in_flight = std::max(stats_.peak_in_flight, peak);
  double r[2] = {loss, correct};
  from_last(r, 2);
  return {r[0], r[1]};
}

torch::Tensor Pipeline::infer(const torch::Tensor& x, int64_t n) {
  for (int j = 0; j < chunks_; ++j) {
    torch::Tensor in = first_chunk(j) ? x : recv_activation(n, kInfer, j);
    torch::Tensor out = net_->forward_chunk(j, in);
    if (last_chunk(j)) return out;
    send(out, kInfer, j);
    wait_sends(4);  // a few chunks in flight: the next stage works on one while this one computes the next
  }
  return {};
}

void Pipeline::flush() { wait_sends(0); }

void Pipeline::from_last(double* v, size_t count) {
  if (!comm_) return;
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  const double t0 = now_s();
  try {
    comm_->broadcast(v, count, DType::f64, n_stages_ - 1, o).wait();
  } catch (const Error& e) {
    rethrow_with_context(e, fmt::format("pipeline stage {} of {}: the last stage's broadcast of the step's results",
                                        stage_id_, n_stages_));
  }
  stats_.wait_s += now_s() - t0;
}

PipeStats Pipeline::take_stats() {
  PipeStats s = stats_;
  stats_ = PipeStats{};
  return s;
}

}  // namespace conduit::train
