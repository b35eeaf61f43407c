#pragma once
// Models for 28x28 single-channel images and 10 classes: an MLP, a small CNN, a small ResNet and a small vision
// transformer (torch/tensor_parallel.h, which also splits it over a tensor-parallel group).
#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <string>

namespace conduit::train {

class Net : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(torch::Tensor x) = 0;  // x: (B, 1, 28, 28) -> logits (B, 10)
  // A pipeline stage of the interleaved schedule holds several chunks of the model (torch/pipeline.h); the others
  // are one chunk, forward().
  virtual int chunks() const { return 1; }
  virtual torch::Tensor forward_chunk(int /*chunk: 0*/, torch::Tensor x) { return forward(x); }
};

// "mlp", "cnn", "resnet" or "vit" (whole); ConfigError for anything else. Initialised from torch's global generator.
std::shared_ptr<Net> make_model(const std::string& name);
const char* model_names_allowed();

}  // namespace conduit::train
