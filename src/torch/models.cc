// MLP, CNN and a small ResNet for 28x28 images; and the libtorch timings of torch/gemm_bench.h (here, so that no
// further translation unit includes libtorch).
#include "torch/models.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/stats.h"
#include "torch/gemm_bench.h"
#include "torch/stages.h"
#include "torch/tensor_parallel.h"

// OpenBLAS's own thread count (the pthread build ignores OpenMP's); weak, so other BLAS libraries link too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));

namespace conduit::train {
namespace {

namespace nn = torch::nn;

using Named = std::vector<std::pair<std::string, std::shared_ptr<nn::Module>>>;

// A model that runs as a sequence of units (models.h): the whole model, or after keep(a, b) the pipeline stage of
// units [a, b), which holds only their modules.
class UnitNet : public Net {
 public:
  torch::Tensor forward(torch::Tensor x) override {
    for (int k = first_; k < last_; ++k) x = unit(k - first_, [&] { return run_unit(k, x); });
    return x;
  }
  std::vector<std::vector<torch::Tensor>> units() override {
    std::vector<std::vector<torch::Tensor>> out;
    for (int k = first_; k < last_; ++k) {
      out.emplace_back();
      for (auto& [name, m] : modules_of(k))
        for (auto& p : m->parameters()) out.back().push_back(p);
    }
    return out;
  }
  std::vector<int64_t> chunk_input_shape(int) const override {
    return first_ > 0 ? output_shape(first_ - 1) : std::vector<int64_t>{1, 28, 28};
  }
  std::vector<int64_t> chunk_output_shape(int) const override { return output_shape(last_ - 1); }
  virtual int unit_count() const = 0;
  // Keeps units [a, b): the others' modules are unregistered (no parameters, buffers or checkpoint entries) and freed.
  void keep(int a, int b) {
    for (int k = 0; k < unit_count(); ++k) {
      if (k >= a && k < b) continue;
      for (auto& [name, m] : modules_of(k)) unregister_module(name);
      drop(k);
    }
    first_ = a;
    last_ = b;
  }

 protected:
  virtual torch::Tensor run_unit(int k, torch::Tensor x) = 0;
  virtual Named modules_of(int k) const = 0;                   // as registered
  virtual void drop(int k) = 0;                                // releases unit k's modules
  virtual std::vector<int64_t> output_shape(int k) const = 0;  // per sample
  void init_range() { last_ = unit_count(); }                  // (a subclass's constructor: every unit)

 private:
  int first_ = 0, last_ = 0;
};

// 784-256-128-10 with ReLU; a unit per linear layer.
class Mlp : public UnitNet {
 public:
  Mlp() {
    for (int k = 0; k < 3; ++k) fc_[k] = register_module(fmt::format("fc{}", k + 1), nn::Linear(kIn[k], kIn[k + 1]));
    init_range();
  }
  int unit_count() const override { return 3; }

 protected:
  torch::Tensor run_unit(int k, torch::Tensor x) override {
    if (k == 0) x = x.view({x.size(0), -1});
    x = fc_[k]->forward(x);
    return k < 2 ? torch::relu(x) : x;
  }
  Named modules_of(int k) const override { return {{fmt::format("fc{}", k + 1), fc_[k].ptr()}}; }
  void drop(int k) override { fc_[k] = nullptr; }
  std::vector<int64_t> output_shape(int k) const override { return {kIn[k + 1]}; }

 private:
  static constexpr int64_t kIn[4] = {784, 256, 128, 10};
  nn::Linear fc_[3] = {nullptr, nullptr, nullptr};
};

// conv 3x3 (32) - pool - conv 3x3 (64) - pool - fc 128 - fc 10; units: each convolution with its pooling, each linear
// layer.
class Cnn : public UnitNet {
 public:
  Cnn() {
    c1_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
    c2_ = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
    f1_ = register_module("fc1", nn::Linear(64 * 7 * 7, 128));
    f2_ = register_module("fc2", nn::Linear(128, 10));
    init_range();
  }
  int unit_count() const override { return 4; }

 protected:
  torch::Tensor run_unit(int k, torch::Tensor x) override {
    switch (k) {
      case 0:
        return torch::max_pool2d(torch::relu(c1_->forward(x)), 2);
      case 1:
        return torch::max_pool2d(torch::relu(c2_->forward(x)), 2);
      case 2:
        return torch::relu(f1_->forward(x.view({x.size(0), -1})));
      default:
        return f2_->forward(x);
    }
  }
  Named modules_of(int k) const override {
    switch (k) {
      case 0:
        return {{"conv1", c1_.ptr()}};
      case 1:
        return {{"conv2", c2_.ptr()}};
      case 2:
        return {{"fc1", f1_.ptr()}};
      default:
        return {{"fc2", f2_.ptr()}};
    }
  }
  void drop(int k) override {
    if (k == 0) c1_ = nullptr;
    if (k == 1) c2_ = nullptr;
    if (k == 2) f1_ = nullptr;
    if (k == 3) f2_ = nullptr;
  }
  std::vector<int64_t> output_shape(int k) const override {
    switch (k) {
      case 0:
        return {32, 14, 14};
      case 1:
        return {64, 7, 7};
      case 2:
        return {128};
      default:
        return {10};
    }
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

// ResNet-8-like: stem 16, blocks 16 / 32 (stride 2) / 64 (stride 2), global average pool, fc 10; units: the stem with
// its BatchNorm, each block, the pooling with the classifier.
class ResNet : public UnitNet {
 public:
  ResNet() {
    stem_ = register_module("stem", nn::Conv2d(nn::Conv2dOptions(1, 16, 3).padding(1).bias(false)));
    bn_ = register_module("bn", nn::BatchNorm2d(16));
    l_[0] = register_module("layer1", std::make_shared<Block>(16, 16, 1));
    l_[1] = register_module("layer2", std::make_shared<Block>(16, 32, 2));
    l_[2] = register_module("layer3", std::make_shared<Block>(32, 64, 2));
    fc_ = register_module("fc", nn::Linear(64, 10));
    init_range();
  }
  int unit_count() const override { return 5; }

 protected:
  torch::Tensor run_unit(int k, torch::Tensor x) override {
    if (k == 0) return torch::relu(bn_->forward(stem_->forward(x)));
    if (k < 4) return l_[k - 1]->forward(x);
    return fc_->forward(torch::adaptive_avg_pool2d(x, {1, 1}).view({x.size(0), -1}));
  }
  Named modules_of(int k) const override {
    if (k == 0) return {{"stem", stem_.ptr()}, {"bn", bn_.ptr()}};
    if (k < 4) return {{fmt::format("layer{}", k), l_[k - 1]}};
    return {{"fc", fc_.ptr()}};
  }
  void drop(int k) override {
    if (k == 0) {
      stem_ = nullptr;
      bn_ = nullptr;
    } else if (k < 4) {
      l_[k - 1] = nullptr;
    } else {
      fc_ = nullptr;
    }
  }
  std::vector<int64_t> output_shape(int k) const override {
    switch (k) {
      case 0:
      case 1:
        return {16, 28, 28};
      case 2:
        return {32, 14, 14};
      case 3:
        return {64, 7, 7};
      default:
        return {10};
    }
  }

 private:
  nn::Conv2d stem_{nullptr};
  nn::BatchNorm2d bn_{nullptr};
  std::shared_ptr<Block> l_[3];
  nn::Linear fc_{nullptr};
};

std::shared_ptr<UnitNet> make_unit_net(const std::string& name, int stages) {
  if (name == "mlp") return std::make_shared<Mlp>();
  if (name == "cnn") return std::make_shared<Cnn>();
  if (name == "resnet") return std::make_shared<ResNet>();
  throw ConfigError(
      fmt::format("config: pp: {} stages of model '{}', which is not cut by units; allowed: mlp, cnn or "
                  "resnet (the vit's stages are its blocks')",
                  stages, name));
}

}  // namespace

const char* model_names_allowed() { return "mlp, cnn, resnet, vit"; }

std::shared_ptr<Net> make_model(const std::string& name) {
  if (name == "mlp" || name == "cnn" || name == "resnet") return make_unit_net(name, 1);
  if (name == "vit") return make_vit(nullptr);
  throw ConfigError("config: model: '" + name + "' is not allowed; allowed: " + model_names_allowed());
}

std::shared_ptr<Net> make_model_stage(const std::string& name, int stage, int stages) {
  const auto bounds = stage_bounds(name, stages);
  if (stage < 0 || stage >= stages)
    throw InvalidArgument(fmt::format("make_model_stage: stage {} of {}; allowed: 0 to {}", stage, stages, stages - 1));
  auto m = make_unit_net(name, stages);
  m->keep(bounds[size_t(stage)], bounds[size_t(stage) + 1]);
  return m;
}

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Sets libtorch's and OpenBLAS's thread counts for its lifetime.
class ThreadScope {
 public:
  explicit ThreadScope(int threads) : torch_(at::get_num_threads()) {
    if (openblas_get_num_threads) blas_ = openblas_get_num_threads();
    at::set_num_threads(std::max(1, threads));
    if (openblas_set_num_threads) openblas_set_num_threads(std::max(1, threads));
  }
  ~ThreadScope() {
    at::set_num_threads(torch_);
    if (openblas_set_num_threads && blas_ > 0) openblas_set_num_threads(blas_);
  }

 private:
  int torch_ = 1, blas_ = 0;
};

}  // namespace

std::vector<GemmTiming> time_gemms(const std::vector<std::array<int64_t, 3>>& shapes, int threads, double min_seconds) {
  ThreadScope scope(threads);
  torch::NoGradGuard ng;
  std::vector<GemmTiming> out;
  for (const auto& [m, n, k] : shapes) {
    if (m <= 0 || n <= 0 || k <= 0)
      throw ConfigError("gemm shape " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
                        ": every dimension must be positive");
    auto a = torch::randn({m, k});
    auto b = torch::randn({k, n});
    auto c = torch::mm(a, b);  // untimed: first-touch and BLAS buffers
    std::vector<double> t;
    const double start = now();
    while ((t.size() < 5 || now() - start < min_seconds) && t.size() < 100000) {
      const double t0 = now();
      c = torch::mm(a, b);
      t.push_back(now() - t0);
    }
    GemmTiming g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.seconds = median(t);
    g.calls = static_cast<int>(t.size());
    out.push_back(g);
  }
  return out;
}

namespace {
// Median seconds of `call` (one untimed call first), at least 5 calls and `min_seconds`.
template <class F>
double median_call(F&& call, double min_seconds, int* calls) {
  call();
  std::vector<double> t;
  const double start = now();
  while ((t.size() < 5 || now() - start < min_seconds) && t.size() < 100000) {
    const double t0 = now();
    call();
    t.push_back(now() - t0);
  }
  if (calls) *calls = static_cast<int>(t.size());
  return median(t);
}
}  // namespace

std::vector<ConvTiming> time_convs(const std::vector<ConvTiming>& shapes, int threads, double min_seconds) {
  ThreadScope scope(threads);
  torch::NoGradGuard ng;
  std::vector<ConvTiming> out;
  for (ConvTiming c : shapes) {
    if (c.batch < 1 || c.in < 1 || c.out < 1 || c.height < 1 || c.width < 1 || c.kernel < 1 || c.stride < 1 ||
        c.padding < 0 || c.out_height() < 1 || c.out_width() < 1)
      throw ConfigError("conv shape " + std::to_string(c.batch) + "x" + std::to_string(c.in) + "x" +
                        std::to_string(c.height) + "x" + std::to_string(c.width) + " -> " + std::to_string(c.out) +
                        " k" + std::to_string(c.kernel) + ": every dimension must be positive and the kernel must fit");
    auto x = torch::randn({c.batch, c.in, c.height, c.width});
    auto w = torch::randn({c.out, c.in, c.kernel, c.kernel});
    auto b = torch::randn({c.out});
    const std::vector<int64_t> stride{c.stride, c.stride}, pad{c.padding, c.padding}, dil{1, 1}, opad{0, 0};
    torch::Tensor y;
    c.forward_s = median_call([&] { y = torch::conv2d(x, w, b, stride, pad); }, min_seconds, &c.calls);
    auto gy = torch::randn_like(y);
    const std::vector<int64_t> bias_sizes{c.out};
    std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> g;
    c.input_grad_s = median_call(
        [&] {
          g = at::convolution_backward(gy, x, w, at::IntArrayRef(bias_sizes), stride, pad, dil, false, opad, 1,
                                       {true, false, false});
        },
        min_seconds, nullptr);
    c.weight_grad_s = median_call(
        [&] {
          g = at::convolution_backward(gy, x, w, at::IntArrayRef(bias_sizes), stride, pad, dil, false, opad, 1,
                                       {false, true, true});
        },
        min_seconds, nullptr);
    out.push_back(c);
  }
  return out;
}

std::vector<PoolTiming> time_pools(const std::vector<PoolTiming>& shapes, int threads, double min_seconds) {
  ThreadScope scope(threads);
  torch::NoGradGuard ng;
  std::vector<PoolTiming> out;
  for (PoolTiming p : shapes) {
    if (p.batch < 1 || p.channels < 1 || p.height < 1 || p.width < 1 || p.kernel < 1 || p.kernel > p.height ||
        p.kernel > p.width)
      throw ConfigError("pool shape " + std::to_string(p.batch) + "x" + std::to_string(p.channels) + "x" +
                        std::to_string(p.height) + "x" + std::to_string(p.width) + " k" + std::to_string(p.kernel) +
                        ": every dimension must be positive and the window must fit");
    auto x = torch::randn({p.batch, p.channels, p.height, p.width});
    const std::vector<int64_t> k{p.kernel, p.kernel}, pad{0, 0}, dil{1, 1};
    std::tuple<torch::Tensor, torch::Tensor> y;
    p.forward_s =
        median_call([&] { y = at::max_pool2d_with_indices(x, k, k, pad, dil, false); }, min_seconds, &p.calls);
    auto gy = torch::randn_like(std::get<0>(y));
    torch::Tensor gx;
    p.backward_s = median_call(
        [&] { gx = at::max_pool2d_with_indices_backward(gy, x, k, k, pad, dil, false, std::get<1>(y)); }, min_seconds,
        nullptr);
    out.push_back(p);
  }
  return out;
}

ModelStepTiming time_model_step(const std::string& name, int batch, int threads, int steps,
                                const std::function<void()>& after_step) {
  ThreadScope scope(threads);
  auto model = make_model(name);
  const int64_t px = 28 * 28;
  std::vector<uint8_t> pixels(size_t(batch * px));
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = uint8_t((i * 2654435761u) >> 24);
  auto y = torch::randint(10, {batch}, torch::kLong);
  auto params = model->parameters();
  std::vector<size_t> offset;
  size_t total = 0;
  for (auto& p : params) {
    offset.push_back(total);
    total += size_t(p.numel());
  }
  std::vector<float> flat(total);
  for (size_t i = 0; i < params.size(); ++i)
    params[i].register_hook([&flat, o = offset[i]](torch::Tensor g) {
      torch::Tensor c = g.contiguous();
      std::memcpy(flat.data() + o, c.data_ptr<float>(), size_t(c.numel()) * sizeof(float));
    });
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  std::vector<double> f, b, p, all, o, st;
  ModelStepTiming r;
  for (int s = 0; s <= std::max(1, steps); ++s) {
    const double t0 = now();
    for (auto& q : params)
      if (q.grad().defined()) {
        q.mutable_grad().detach_();
        q.mutable_grad().zero_();
      }
    auto x = torch::empty({batch, 1, 28, 28}, torch::kFloat);
    float* xp = x.data_ptr<float>();
    const float scale = 1.0f / (255.0f * 0.3530f), shift = 0.2860f / 0.3530f;
    for (int64_t k = 0; k < batch * px; ++k) xp[k] = float(pixels[size_t(k)]) * scale - shift;
    const double t1 = now();
    auto logits = model->forward(x);
    auto loss = torch::nn::functional::cross_entropy(logits, y);
    const double t2 = now();
    loss.backward();
    const double t3 = now();
    if (after_step) after_step();
    const double t4 = now();
    sgd.step();
    const double t5 = now();
    // The step's loss and accuracy, read back as the trainer does after every step.
    volatile double seen = double(loss.item<float>()) + double(logits.argmax(1).eq(y).sum().item<int64_t>());
    (void)seen;
    const double t6 = now();
    if (s == 0) continue;  // untimed
    o.push_back(t5 - t4);
    st.push_back(t6 - t5);
    if (after_step) r.after_s.push_back(t4 - t3);
    p.push_back(t1 - t0);
    f.push_back(t2 - t1);
    b.push_back(t3 - t2);
    all.push_back(t3 - t0 + t6 - t5);
  }
  r.stats_s = median(st);
  r.forward_s = median(f);
  r.backward_s = median(b);
  r.prepare_s = median(p);
  r.optimizer_s = median(o);
  r.step_s = all;
  r.steps = static_cast<int>(f.size());
  return r;
}

}  // namespace conduit::train
