// Pipeline parallelism: the micro-batch schedules (GPipe, 1F1B) over point-to-point sends between stages.
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
  throw ConfigError(fmt::format("config: pp_schedule: '{}'; allowed: gpipe or 1f1b", s));
}

const char* to_string(PipeSchedule s) { return s == PipeSchedule::kGpipe ? "gpipe" : "1f1b"; }

namespace {
// Message kinds, each the tag of its messages: activations forward, their gradients backward, inference activations.
// One tag a kind: between two ranks, messages of one tag match receives in posting order (net/transport.h), which is
// the order both ends run the schedule. (A running count in the tag folded onto the outstanding sends' MPI tags: MPI
// keeps as few as 3 low bits of a tag, and GPipe has M sends in flight.)
constexpr int kForward = 0, kBackward = 1, kInfer = 2;
constexpr const char* kKindName[3] = {"forward", "backward", "inference"};
}  // namespace

Pipeline::Pipeline(coll::CommPtr stages, std::shared_ptr<Net> stage, std::vector<int64_t> activation,
                   PipeSchedule schedule, double timeout_s, Trace* trace, bool recompute)
    : comm_(std::move(stages)),
      net_(std::move(stage)),
      activation_(std::move(activation)),
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

torch::Tensor Pipeline::recv_activation(int64_t n, int kind) {
  const int peer = kind == kBackward ? stage_id_ + 1 : stage_id_ - 1;
  std::vector<int64_t> shape{n};
  shape.insert(shape.end(), activation_.begin(), activation_.end());
  torch::Tensor t = torch::empty(shape, torch::kFloat);
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  const double t0 = now_s();
  comm_->recv(t.data_ptr<float>(), size_t(t.numel()), DType::f32, peer, uint32_t(kind), o).wait();
  stats_.wait_s += now_s() - t0;
  const uint64_t bytes = uint64_t(t.numel()) * sizeof(float);
  stats_.bytes_recv += bytes;
  if (trace_ && trace_->enabled())
    trace_->complete("pp recv", 0, t0, now_s(), {{"from", peer}, {"bytes", bytes}, {"kind", kKindName[kind]}});
  return t;
}

void Pipeline::send(torch::Tensor t, int kind) {
  const int peer = kind == kBackward ? stage_id_ - 1 : stage_id_ + 1;
  t = t.detach().to(torch::kFloat).contiguous();
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  // Sends that have completed free their buffers now (not at the end of the step: GPipe would hold every one).
  while (!sends_.empty() && sends_.front().work.test()) sends_.pop_front();
  sends_.push_back({comm_->send(t.data_ptr<float>(), size_t(t.numel()), DType::f32, peer, uint32_t(kind), o), t});
  stats_.bytes_sent += uint64_t(t.numel()) * sizeof(float);
  stats_.messages += 1;
}

void Pipeline::wait_sends(size_t keep) {
  while (sends_.size() > keep) {
    const double t0 = now_s();
    sends_.front().work.wait();
    stats_.wait_s += now_s() - t0;
    sends_.pop_front();
  }
}

Pipeline::StepResult Pipeline::train_step(const torch::Tensor& x, const torch::Tensor& y, int micro_batches) {
  const int64_t b = y.size(0);
  const int m = micro_batches;
  if (m < 1 || m > b)
    throw InvalidArgument(fmt::format("Pipeline: {} micro-batches of a batch of {}; allowed: 1 to {}", m, b, b));
  if (x.defined() && x.size(0) != b)  // (on every stage given images: they stop together)
    throw InvalidArgument(fmt::format("Pipeline: {} images and {} labels; allowed: one label a sample", x.size(0), b));
  const size_t parts = static_cast<size_t>(m);
  std::vector<int64_t> size(parts), offset(parts);
  for (int k = 0; k < m; ++k) {
    size[size_t(k)] = b / m + (k < b % m ? 1 : 0);
    offset[size_t(k)] = k == 0 ? 0 : offset[size_t(k) - 1] + size[size_t(k) - 1];
  }
  struct Slot {
    // The stage's input (its gradient goes back) and output (or, last, the scaled loss); with recompute the input
    // alone (the forward runs again in the backward).
    torch::Tensor in, out;
  };
  // The stage's output for a micro-batch, or on the last stage its loss scaled by the micro-batch's share.
  auto run = [&](int k, const torch::Tensor& in) {
    torch::Tensor out = net_->forward(in);
    if (!last()) return std::make_pair(out, out);
    const torch::Tensor yk = y.narrow(0, offset[size_t(k)], size[size_t(k)]);
    const torch::Tensor l = torch::nn::functional::cross_entropy(out, yk);
    return std::make_pair(out, l * (double(size[size_t(k)]) / double(b)));
  };
  std::vector<Slot> slots(parts);
  int live = 0, peak = 0;
  double loss = 0, correct = 0;
  auto forward = [&](int k) {
    const double t0 = now_s();
    const int64_t n = size[size_t(k)];
    torch::Tensor in;
    if (first()) {
      in = x.narrow(0, offset[size_t(k)], n);
    } else {
      in = recv_activation(n, kForward);
      in.requires_grad_(true);
    }
    const double t1 = now_s();
    torch::Tensor out, scaled;
    {
      // (no graph with recompute: the backward builds it again)
      std::optional<torch::NoGradGuard> ng;
      if (recompute_) ng.emplace();
      std::tie(out, scaled) = run(k, in);
    }
    if (last()) {
      // The micro-batches' scaled losses add up to the batch's mean.
      loss += double(scaled.item<float>());
      correct += double(out.argmax(1).eq(y.narrow(0, offset[size_t(k)], n)).sum().item<int64_t>());
    } else {
      send(out, kForward);
    }
    slots[size_t(k)] = {in, recompute_ ? torch::Tensor() : scaled};
    peak = std::max(peak, ++live);
    if (trace_ && trace_->enabled())
      trace_->complete("forward", 0, t1, now_s(), {{"micro_batch", k}, {"waited_s", t1 - t0}});
  };
  auto backward = [&](int k) {
    Slot& s = slots[size_t(k)];
    const double t0 = now_s();
    torch::Tensor g;  // (the last stage starts from its loss)
    if (!last()) g = recv_activation(size[size_t(k)], kBackward);
    const double t1 = now_s();
    if (recompute_) s.out = run(k, s.in).second;
    s.out.backward(g);
    if (trace_ && trace_->enabled())
      trace_->complete("backward", 0, t1, now_s(), {{"micro_batch", k}, {"waited_s", t1 - t0}});
    if (!first()) send(s.in.grad(), kBackward);
    s = Slot{};
    --live;
  };
  // One stage (micro-batches only: gradient accumulation) runs each micro-batch's forward and backward together,
  // whatever the schedule: nothing is gained by holding the activations of several.
  if (schedule_ == PipeSchedule::kGpipe && n_stages_ > 1) {
    for (int k = 0; k < m; ++k) forward(k);
    for (int k = 0; k < m; ++k) backward(k);
  } else {
    const int warm = std::min(n_stages_ - stage_id_ - 1, m);
    for (int k = 0; k < warm; ++k) forward(k);
    for (int k = 0; k < m - warm; ++k) {
      forward(warm + k);
      backward(k);
    }
    for (int k = m - warm; k < m; ++k) backward(k);
  }
  wait_sends(0);
  stats_.peak_in_flight = std::max(stats_.peak_in_flight, peak);
  double r[2] = {loss, correct};
  from_last(r, 2);
  return {r[0], r[1]};
}

torch::Tensor Pipeline::infer(const torch::Tensor& x, int64_t n) {
  torch::Tensor in = first() ? x : recv_activation(n, kInfer);
  torch::Tensor out = net_->forward(in);
  if (last()) return out;
  send(out, kInfer);
  wait_sends(4);  // a few chunks in flight: the next stage works on one while this one computes the next
  return {};
}

void Pipeline::flush() { wait_sends(0); }

void Pipeline::from_last(double* v, size_t count) {
  if (!comm_) return;
  coll::CollOptions o;
  o.timeout_s = timeout_s_;
  const double t0 = now_s();
  comm_->broadcast(v, count, DType::f64, n_stages_ - 1, o).wait();
  stats_.wait_s += now_s() - t0;
}

PipeStats Pipeline::take_stats() {
  PipeStats s = stats_;
  stats_ = PipeStats{};
  return s;
}

}  // namespace conduit::train
