// MLP, CNN and a small ResNet for 28x28 images.
#include "torch/models.h"

#include <torch/nn.h>

#include "core/error.h"

namespace conduit::train {
namespace {

namespace nn = torch::nn;

// 784-256-128-10 with ReLU.
class Mlp : public Net {
 public:
  Mlp() {
    fc1_ = register_module("fc1", nn::Linear(784, 256));
    fc2_ = register_module("fc2", nn::Linear(256, 128));
    fc3_ = register_module("fc3", nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = x.view({x.size(0), -1});
    x = torch::relu(fc1_->forward(x));
    x = torch::relu(fc2_->forward(x));
    return fc3_->forward(x);
  }

 private:
  nn::Linear fc1_{nullptr}, fc2_{nullptr}, fc3_{nullptr};
};

// conv 3x3 (32) - pool - conv 3x3 (64) - pool - fc 128 - fc 10.
class Cnn : public Net {
 public:
  Cnn() {
    c1_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
    c2_ = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
    f1_ = register_module("fc1", nn::Linear(64 * 7 * 7, 128));
    f2_ = register_module("fc2", nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::max_pool2d(torch::relu(c1_->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(c2_->forward(x)), 2);
    x = torch::relu(f1_->forward(x.view({x.size(0), -1})));
    return f2_->forward(x);
  }

 private:
  nn::Conv2d c1_{nullptr}, c2_{nullptr};
  nn::Linear f1_{nullptr}, f2_{nullptr};
};

class Block : public nn::Module {
 public:
  Block(int64_t in, int64_t out, int64_t stride) {
    c1_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    b1_ = register_module("bn1", nn::BatchNorm2d(out));
    c2_ = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    b2_ = register_module("bn2", nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      sc_ = register_module("shortcut", nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      sb_ = register_module("shortcut_bn", nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(b1_->forward(c1_->forward(x)));
    y = b2_->forward(c2_->forward(y));
    auto s = sc_ ? sb_->forward(sc_->forward(x)) : x;
    return torch::relu(y + s);
  }

 private:
  nn::Conv2d c1_{nullptr}, c2_{nullptr}, sc_{nullptr};
  nn::BatchNorm2d b1_{nullptr}, b2_{nullptr}, sb_{nullptr};
};

// ResNet-8-like: stem 16, blocks 16 / 32 (stride 2) / 64 (stride 2), global average pool, fc 10.
class ResNet : public Net {
 public:
  ResNet() {
    stem_ = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)));
    bn_ = register_module("bn", nn::BatchNorm2d(16));
    l1_ = register_module("layer1", std::make_shared<Block>(16, 16, 1));
    l2_ = register_module("layer2", std::make_shared<Block>(16, 32, 2));
    l3_ = register_module("layer3", std::make_shared<Block>(32, 64, 2));
    fc_ = register_module("fc", nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(bn_->forward(stem_->forward(x)));
    x = l3_->forward(l2_->forward(l1_->forward(x)));
    x = torch::adaptive_avg_pool2d(x, {1, 1}).view({x.size(0), -1});
    return fc_->forward(x);
  }

 private:
  nn::Conv2d stem_{nullptr};
  nn::BatchNorm2d bn_{nullptr};
  std::shared_ptr<Block> l1_, l2_, l3_;
  nn::Linear fc_{nullptr};
};

}  // namespace

const char* model_names_allowed() { return "mlp, cnn, resnet"; }

std::shared_ptr<Net> make_model(const std::string& name) {
  if (name == "mlp") return std::make_shared<Mlp>();
  if (name == "cnn") return std::make_shared<Cnn>();
  if (name == "resnet") return std::make_shared<ResNet>();
  throw ConfigError("config: model: '" + name + "' is not allowed; allowed: " + model_names_allowed());
}

}  // namespace conduit::train
