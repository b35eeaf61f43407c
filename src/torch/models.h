#pragma once
// Models for 28x28 single-channel images and 10 classes: an MLP, a small CNN, a small ResNet and a small vision
// transformer (torch/tensor_parallel.h, which also splits it over a tensor-parallel group).
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace conduit::train {

// ZeRO stage 3 (torch/distributed_optimizer.h) keeps each parameter as slices spread over the ranks and gathers a
// unit of the model (a layer, a transformer block) whole only while it runs, as DeepSpeed's stage 3 and FSDP's
// wrapped modules do: a model that supports it runs each unit between these two calls.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;
  // `out`: what the unit returned (a hook on it gathers the unit again before its backward).
  virtual void after_forward(int unit, torch::Tensor& out) = 0;
};

class Net : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(torch::Tensor x) = 0;  // x: (B, 1, 28, 28) -> logits (B, 10)
  // A pipeline stage of the interleaved schedule holds several chunks of the model (torch/pipeline.h); the others
  // are one chunk, forward().
  virtual int chunks() const { return 1; }
  virtual torch::Tensor forward_chunk(int /*chunk: 0*/, torch::Tensor x) { return forward(x); }
  // A pipeline stage's per-sample shapes: of what chunk j takes from the stage before and of what it passes on to the
  // next. Asked only where such a neighbour exists (not of the images the model's first chunk takes, nor of the
  // logits its last returns); empty: the model is not cut into stages.
  virtual std::vector<int64_t> chunk_input_shape(int /*chunk*/) const { return {}; }
  virtual std::vector<int64_t> chunk_output_shape(int /*chunk*/) const { return {}; }
  // The parameters of each unit, in the order forward runs the units (every parameter in one); empty: the model
  // does not run its units through the hooks, so ZeRO stage 3 cannot shard it.
  virtual std::vector<std::vector<torch::Tensor>> units() { return {}; }
  void set_unit_hooks(std::shared_ptr<UnitHooks> hooks) { hooks_ = std::move(hooks); }

 protected:
  // Runs unit k (f returns its output) between the hooks, if any are set.
  template <class F>
  torch::Tensor unit(int k, F&& f) {
    if (!hooks_) return f();
    hooks_->before_forward(k);
    torch::Tensor out = f();
    hooks_->after_forward(k, out);
    return out;
  }

 private:
  std::shared_ptr<UnitHooks> hooks_;
};

// "mlp", "cnn", "resnet" or "vit" (whole); ConfigError for anything else. Initialised from torch's global generator.
std::shared_ptr<Net> make_model(const std::string& name);
const char* model_names_allowed();

// Pipeline parallelism for the mlp, cnn and resnet (the vit's stages: make_vit). Stage `stage` of `stages`: the
// model's units (above) cut into `stages` consecutive runs (stage_bounds, torch/stages.h), of which it keeps run
// `stage`: it draws the whole model's weights as make_model does, so the stages together are the unsplit model, and
// drops the other units' modules. ConfigError (one line) for another model or more stages than the model has units.
std::shared_ptr<Net> make_model_stage(const std::string& name, int stage, int stages);
}  // namespace conduit::train
