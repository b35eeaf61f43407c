#pragma once
// The optimizer of a run whose compressor owns SGD's momentum (`--compressor dgc` or `signum`). DGC (Lin et al.
// 2018) moves the momentum into the compressor (momentum correction: each rank accumulates its velocity and sends its
// largest entries) and Signum votes on the signs of each rank's momentum, so the step applies the exchanged gradient
// as it is; weight decay, which never passes the compressor, keeps a momentum of its own, as DGC's reference DGCSGD
// does: buf = m·buf + λθ, θ -= lr·(g + buf). Plain SGD with momentum 0 and weight decay λ (what ran for dgc before)
// applied λθ without momentum: ten times weaker at m = 0.9 than the same flags without the compressor; and the
// layers below compress_min_bytes, whose momentum the distributed optimizer applies to g, then train as momentum SGD
// on g + λθ. The buffer is SGD's momentum buffer, so it is saved and restored with the optimizer.
#include <torch/optim/sgd.h>

#include <string>
#include <utility>
#include <vector>

namespace conduit::train {

class DgcSgd : public torch::optim::SGD {
 public:
  // options: lr and weight decay (its momentum must be 0: the compressor's); decay_momentum: DGC's momentum.
  DgcSgd(std::vector<torch::Tensor> params, torch::optim::SGDOptions options, double decay_momentum)
      : SGD(std::move(params), options), decay_momentum_(decay_momentum) {
    TORCH_CHECK(options.momentum() == 0 && !options.nesterov(), "DgcSgd: the momentum is the compressor's");
  }

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        torch::Tensor d = p.grad();
        if (o.weight_decay() != 0) {
          torch::Tensor decay = p.detach() * o.weight_decay();
          if (decay_momentum_ != 0) {
            const std::string key = c10::guts::to_string(p.unsafeGetTensorImpl());
            auto it = state_.find(key);
            if (it == state_.end()) {
              auto st = std::make_unique<torch::optim::SGDParamState>();
              st->momentum_buffer(decay);  // (decay is this step's own tensor: kept as the buffer)
              state_[key] = std::move(st);
            } else {
              auto& buf = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer();
              buf.mul_(decay_momentum_).add_(decay);
              decay = buf;
            }
          }
          d = d + decay;
        }
        p.detach().add_(d, -o.lr());
      }
    }
    return loss;
  }

 private:
  double decay_momentum_;
};

}  // namespace conduit::train
