// MLP, CNN and a small ResNet for 28x28 images; and the libtorch timings of torch/gemm_bench.h (here, so that no
// further translation unit includes libtorch).
#include "torch/models.h"

#include <ATen/Parallel.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "core/error.h"
#include "core/stats.h"
#include "torch/gemm_bench.h"
#include "torch/tensor_parallel.h"

// OpenBLAS's own thread count (the pthread build ignores OpenMP's); weak, so other BLAS libraries link too.
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));

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
    x = unit(0, [&] { return torch::relu(fc1_->forward(x)); });
    x = unit(1, [&] { return torch::relu(fc2_->forward(x)); });
    return unit(2, [&] { return fc3_->forward(x); });
  }
  std::vector<std::vector<torch::Tensor>> units() override {
    return {fc1_->parameters(), fc2_->parameters(), fc3_->parameters()};
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
    x = unit(0, [&] { return torch::max_pool2d(torch::relu(c1_->forward(x)), 2); });
    x = unit(1, [&] { return torch::max_pool2d(torch::relu(c2_->forward(x)), 2); });
    x = unit(2, [&] { return torch::relu(f1_->forward(x.view({x.size(0), -1}))); });
    return unit(3, [&] { return f2_->forward(x); });
  }
  std::vector<std::vector<torch::Tensor>> units() override {
    return {c1_->parameters(), c2_->parameters(), f1_->parameters(), f2_->parameters()};
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
    x = unit(0, [&] { return torch::relu(bn_->forward(stem_->forward(x))); });
    x = unit(1, [&] { return l1_->forward(x); });
    x = unit(2, [&] { return l2_->forward(x); });
    x = unit(3, [&] { return l3_->forward(x); });
    x = torch::adaptive_avg_pool2d(x, {1, 1}).view({x.size(0), -1});
    return unit(4, [&] { return fc_->forward(x); });
  }
  std::vector<std::vector<torch::Tensor>> units() override {
    auto stem = stem_->parameters();
    for (auto& p : bn_->parameters()) stem.push_back(p);
    return {stem, l1_->parameters(), l2_->parameters(), l3_->parameters(), fc_->parameters()};
  }

 private:
  nn::Conv2d stem_{nullptr};
  nn::BatchNorm2d bn_{nullptr};
  std::shared_ptr<Block> l1_, l2_, l3_;
  nn::Linear fc_{nullptr};
};

}  // namespace

const char* model_names_allowed() { return "mlp, cnn, resnet, vit"; }

std::shared_ptr<Net> make_model(const std::string& name) {
  if (name == "mlp") return std::make_shared<Mlp>();
  if (name == "cnn") return std::make_shared<Cnn>();
  if (name == "resnet") return std::make_shared<ResNet>();
  if (name == "vit") return make_vit(nullptr);
  throw ConfigError("config: model: '" + name + "' is not allowed; allowed: " + model_names_allowed());
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
