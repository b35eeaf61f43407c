// The libtorch side of `conduit fl` (fl/federation.h's LocalTrainer): a model, its data, local SGD on a client's
// partition (with FedProx's proximal term) and the evaluation of the global model.
#include "torch/fl_client.h"

#include <fmt/format.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <algorithm>
#include <random>

#include "core/clock.h"
#include "core/error.h"
#include "torch/batches.h"
#include "torch/data.h"
#include "torch/models.h"

namespace conduit::train {
namespace {

class TorchLocalTrainer : public fl::LocalTrainer {
 public:
  explicit TorchLocalTrainer(const fl::FlConfig& c) : c_(c) {
    torch::set_num_threads(1);
    torch::manual_seed(c.seed);
    model_ = make_model(c.model);
    TrainTestSets d =
        load_train_test(c.dataset, c.data_dir, c.train_limit, c.test_limit, c.synthetic_samples, c.seed, c.timeout_s);
    train_ = std::move(d.train);
    test_ = std::move(d.test);
    for (auto& p : model_->parameters()) state_.push_back(p);
    for (auto& b : model_->buffers())
      if (b.is_floating_point()) state_.push_back(b);
    for (auto& t : state_) numel_ += size_t(t.numel());
  }

  std::vector<float> initial_weights() override { return flatten(); }

  std::vector<int64_t> train_labels() override {
    return std::vector<int64_t>(train_.labels.begin(), train_.labels.begin() + train_.n);
  }
  int num_classes() override { return train_.classes; }

  fl::LocalResult train(const std::vector<float>& global, const std::vector<int64_t>& indices,
                        const fl::LocalWork& work) override {
    Stopwatch sw;
    load(global);
    std::vector<torch::Tensor> anchor;  // FedProx: the global weights the proximal term pulls towards
    if (c_.mu > 0)
      for (auto& p : model_->parameters()) anchor.push_back(p.detach().clone());
    std::vector<torch::Tensor> correction;  // SCAFFOLD: c - c_i of each parameter (parameters lead the flat order)
    if (work.correction) {
      if (work.correction->size() != numel_)
        throw InvalidArgument(
            fmt::format("fl: a correction of {} elements for a model of {}", work.correction->size(), numel_));
      size_t off = 0;
      for (auto& p : model_->parameters()) {
        correction.push_back(
            torch::from_blob(const_cast<float*>(work.correction->data() + off), p.sizes(), torch::kFloat).clone());
        off += size_t(p.numel());
      }
    }
    torch::optim::SGD opt(model_->parameters(),
                          torch::optim::SGDOptions(c_.lr).momentum(c_.momentum).weight_decay(c_.weight_decay));
    model_->train();
    std::vector<int64_t> order = indices;
    std::mt19937_64 g(work.seed);
    fl::LocalResult r;
    r.examples = int64_t(indices.size());
    double loss_sum = 0;
    const int64_t b = c_.batch_size;
    for (int e = 0; e < c_.local_epochs; ++e) {
      std::shuffle(order.begin(), order.end(), g);
      for (size_t i = 0; i < order.size(); i += size_t(b)) {
        if (work.max_steps > 0 && r.steps >= work.max_steps) break;
        std::vector<int64_t> idx(order.begin() + long(i), order.begin() + long(std::min(order.size(), i + size_t(b))));
        torch::Tensor x, y;
        make_batch(train_, idx, x, y);
        opt.zero_grad();
        auto loss = torch::nn::functional::cross_entropy(model_->forward(x), y);
        loss.backward();
        if (c_.mu > 0 || !correction.empty()) {
          torch::NoGradGuard ng;
          size_t k = 0;
          for (auto& p : model_->parameters()) {
            if (!p.grad().defined()) {
              if (correction.empty()) {
                ++k;
                continue;
              }
              p.mutable_grad() = torch::zeros_like(p);
            }
            if (c_.mu > 0) p.grad().add_(p.detach() - anchor[k], c_.mu);
            if (!correction.empty()) p.grad().add_(correction[k]);
            ++k;
          }
        }
        opt.step();
        loss_sum += double(loss.item<float>());
        ++r.steps;
      }
    }
    r.loss = r.steps ? loss_sum / double(r.steps) : 0;
    r.delta = flatten();
    for (size_t i = 0; i < r.delta.size(); ++i) r.delta[i] -= global[i];
    r.compute_s = sw.seconds();
    return r;
  }

  fl::EvalResult evaluate(const std::vector<float>& weights) override {
    load(weights);
    auto [acc, loss] = train::evaluate(*model_, test_, nullptr);
    return {acc, loss};
  }

 private:
  std::vector<float> flatten() {
    torch::NoGradGuard ng;
    std::vector<float> out;
    out.reserve(numel_);
    for (auto& t : state_) {
      auto c = t.detach().to(torch::kFloat).contiguous();
      const float* p = c.data_ptr<float>();
      out.insert(out.end(), p, p + c.numel());
    }
    return out;
  }
  void load(const std::vector<float>& w) {
    if (w.size() != numel_)
      throw InvalidArgument(fmt::format("fl: weights of {} elements for a model of {}", w.size(), numel_));
    torch::NoGradGuard ng;
    size_t off = 0;
    for (auto& t : state_) {
      auto src = torch::from_blob(const_cast<float*>(w.data() + off), t.sizes(), torch::kFloat);
      t.copy_(src);
      off += size_t(t.numel());
    }
  }

  fl::FlConfig c_;
  std::shared_ptr<Net> model_;
  ImageSet train_, test_;
  std::vector<torch::Tensor> state_;
  size_t numel_ = 0;
};

}  // namespace

std::unique_ptr<fl::LocalTrainer> make_fl_trainer(const fl::FlConfig& c) {
  return std::make_unique<TorchLocalTrainer>(c);
}

}  // namespace conduit::train
