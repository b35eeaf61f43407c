// SchemeOptimizer: a sync::Strategy around the local optimizer, on flat views of the model's parameters.
#include "torch/scheme_optimizer.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>

#include "core/error.h"
#include "torch/distributed_optimizer.h"

namespace conduit::train {

SchemeOptimizer::SchemeOptimizer(std::shared_ptr<torch::nn::Module> model,
                                 std::shared_ptr<torch::optim::Optimizer> optimizer, coll::CommPtr comm,
                                 const SyncSpec& spec, double base_lr, Trace* trace)
    : model_(std::move(model)),
      optimizer_(std::move(optimizer)),
      comm_(std::move(comm)),
      spec_(spec),
      base_lr_(base_lr),
      trace_(trace) {
  strategy_ = sync::make_strategy(spec_.name, spec_.params, comm_);
  strategy_->set_drift_timeout(std::max(spec_.drift_timeout_s, comm_->timeout_s()));
  workers_ = comm_->size() == 1 ? comm_ : comm_->split(strategy_->is_worker() ? 0 : 1, comm_->rank());

  // Re-seat every trainable parameter (and its gradient) as a view of one flat tensor: the layout is registration
  // order, the same on every rank. Frozen parameters stay out (given a gradient, the optimizer's weight decay moved
  // them), and a tied one is seated once (seated twice, its first view was orphaned and every zero_grad failed).
  torch::NoGradGuard ng;
  for (auto& [name, p] : trainable_parameters(*model_)) {
    if (p.scalar_type() != torch::kFloat)
      throw InvalidArgument(fmt::format("train: --sync {} needs f32 parameters; '{}' is {}", spec_.name, name,
                                        c10::toString(p.scalar_type())));
    params_.push_back(p);
    d_ += size_t(p.numel());
  }
  flat_params_ = torch::empty({int64_t(d_)}, torch::kFloat);
  flat_grads_ = torch::zeros({int64_t(d_)}, torch::kFloat);
  int64_t off = 0;
  for (auto& p : params_) {
    const int64_t n = p.numel();
    auto view = flat_params_.narrow(0, off, n).view(p.sizes());
    view.copy_(p);
    p.set_data(view);
    p.mutable_grad() = flat_grads_.narrow(0, off, n).view(p.sizes());
    off += n;
  }
}

SchemeOptimizer::~SchemeOptimizer() = default;

void SchemeOptimizer::setup(bool resuming) {
  torch::NoGradGuard ng;
  if (resuming) {
    own_params_ = flat_params_.clone();
    // The rank's own buffers (BatchNorm's statistics) too: the broadcast below gave every rank rank 0's.
    own_buffers_.clear();
    for (const auto& b : model_->buffers()) own_buffers_.push_back(b.clone());
  }
  broadcast_module(*model_, *workers_, Broadcast::kFrozenParameters);  // the trainable ones are the strategy's
  strategy_->setup({flat_params_.data_ptr<float>(), d_});
  seen_ = strategy_->stats();
  last_step_end_ = now_s();
}

void SchemeOptimizer::resume(const std::vector<uint8_t>& state) {
  if (!own_params_.defined()) throw InvalidArgument("train: SchemeOptimizer::resume needs setup(true) first");
  workers_->barrier().wait();
  // The workers agree on whether every one loaded its state, where a barrier stood: a worker whose state was corrupt
  // threw, and the others waited at the barrier for their deadline, naming no file.
  std::exception_ptr err;
  try {
    strategy_->load_state(state);
  } catch (const std::exception&) {
    err = std::current_exception();
  }
  if (const int failed = coll::agree_on_failure(*workers_, err); failed >= 0)
    throw ConfigError(
        fmt::format("config: resume: worker {} cannot load its saved sync state (its error names the "
                    "file); allowed: a complete checkpoint",
                    failed));
  {
    torch::NoGradGuard ng;
    flat_params_.copy_(own_params_);
    auto buffers = model_->buffers();
    for (size_t i = 0; i < buffers.size() && i < own_buffers_.size(); ++i) buffers[i].copy_(own_buffers_[i]);
  }
  own_params_ = torch::Tensor();
  own_buffers_.clear();
}

void SchemeOptimizer::zero_grad() {
  last_step_end_ = now_s();  // compute time counts from here to step()
  flat_grads_.zero_();
  // Backward accumulates into .grad in place as long as it is defined: make sure nothing replaced our views.
  int64_t off = 0;
  for (auto& p : params_) {
    if (!p.grad().defined() || p.grad().data_ptr() != flat_grads_.data_ptr<float>() + off)
      throw InvalidArgument(
          "train: a parameter's .grad no longer views the flat gradient buffer (was zero_grad of "
          "the optimizer called?)");
    off += p.numel();
  }
}

void SchemeOptimizer::step(uint64_t step, double lr) {
  torch::NoGradGuard ng;
  const double t0 = now_s();
  StepStats s;
  s.compute_s = last_step_end_ >= 0 ? t0 - last_step_end_ : 0;
  std::span<float> params(flat_params_.data_ptr<float>(), d_), grads(flat_grads_.data_ptr<float>(), d_);
  if (spec_.parameter_server()) {
    if (lr != base_lr_) flat_grads_.mul_(lr / base_lr_);
    strategy_->set_lr_scale(lr / base_lr_);  // the servers' weight decay follows the schedule too
  }
  const bool local = strategy_->before_step(step, params, grads);
  const double t1 = now_s();
  if (local) optimizer_->step();
  const double t2 = now_s();
  strategy_->after_step(step, params);
  const double t3 = now_s();
  if (trace_) {
    trace_->complete("sync before_step", 0, t0, t1, {{"step", step}, {"scheme", spec_.name}});
    if (local) trace_->complete("optimizer", 0, t1, t2, {{"step", step}});
    trace_->complete("sync after_step", 0, t2, t3, {{"step", step}, {"scheme", spec_.name}});
  }
  const sync::SyncStats& now = strategy_->stats();
  s.bytes_sent = now.bytes_sent - seen_.bytes_sent;
  s.bytes_recv = now.bytes_received - seen_.bytes_received;
  s.comm_s = now.comm_seconds - seen_.comm_seconds;
  s.exposed_comm_s = s.comm_s;  // strategies block the training thread while they communicate
  s.step_s = t2 - t1;
  s.grad_bytes = d_ * 4;
  s.payload_bytes = now.payload_bytes - seen_.payload_bytes;
  const int w = strategy_->num_workers();
  s.raw_bytes = w > 1 ? uint64_t(2.0 * (w - 1) / w * double(d_ * 4)) : 0;  // what one bsp allreduce sends
  seen_ = now;
  last_ = s;
  add_to_totals(s);
  last_step_end_ = now_s();
}

void SchemeOptimizer::finish() {
  if (finished_) return;
  finished_ = true;
  strategy_->finish({flat_params_.data_ptr<float>(), d_});
  // BatchNorm's running statistics followed each worker's own data: the run ends with their mean on every worker
  // (they stayed each worker's own). Where the scheme averages the parameters at the end (local, diloco, easgd's
  // centre, adpsgd's final average, the servers' model) this is one averaged model; where replicas stay apart
  // (dpsgd, sgp, adpsgd:final_average=0) each keeps its parameters with the mean statistics.
  average_buffers(*model_, *workers_);
  const sync::SyncStats& now = strategy_->stats();
  StepStats s;
  s.bytes_sent = now.bytes_sent - seen_.bytes_sent;
  s.bytes_recv = now.bytes_received - seen_.bytes_received;
  s.comm_s = s.exposed_comm_s = now.comm_seconds - seen_.comm_seconds;
  s.payload_bytes = now.payload_bytes - seen_.payload_bytes;
  seen_ = now;
  add_to_totals(s);
}

void SchemeOptimizer::add_to_totals(const StepStats& s) { total_ += s; }

}  // namespace conduit::train
