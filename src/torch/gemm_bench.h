#pragma once
// Timing libtorch on this machine for the simulator's calibration (`conduit bench gemm`, `conduit sim calibrate`):
// matrix multiplications of given shapes and one forward/backward of a training model. A torch-free interface;
// the code lives in models.cc so that no further translation unit includes libtorch (~20 s of compile each).
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace conduit::train {

struct GemmTiming {
  int64_t m = 0, n = 0, k = 0;
  double seconds = 0;  // median of the timed calls
  int calls = 0;
  double gflops() const { return seconds > 0 ? 2.0 * double(m) * double(n) * double(k) / seconds / 1e9 : 0; }
};

// Times torch::mm of an (m x k) by (k x n) float32 CPU matrix, as training runs it (the output allocated per call),
// with `threads` intra-op threads (libtorch's and OpenBLAS's; training workers use one). Per shape: one untimed
// call, then calls until `min_seconds` have passed (at least 5); the median call. Restores the thread counts.
std::vector<GemmTiming> time_gemms(const std::vector<std::array<int64_t, 3>>& shapes, int threads, double min_seconds);

struct ConvTiming {
  int64_t batch = 0, in = 0, out = 0, height = 0, width = 0, kernel = 0, stride = 1, padding = 0;  // input size
  double forward_s = 0, input_grad_s = 0, weight_grad_s = 0;  // medians of the timed calls of each pass
  int calls = 0;                                              // timed calls of the forward
  int64_t out_height() const { return (height + 2 * padding - kernel) / stride + 1; }
  int64_t out_width() const { return (width + 2 * padding - kernel) / stride + 1; }
  double flops() const {  // of each pass: 2 x batch x H_out x W_out x out x in x k^2
    return 2.0 * double(batch) * double(out_height()) * double(out_width()) * double(out) * double(in) *
           double(kernel) * double(kernel);
  }
};

// Times a float32 2-D convolution (bias included) as training runs it, with `threads` intra-op threads: the forward
// (torch::conv2d) and the two passes of its backward through at::convolution_backward, the function autograd
// calls: the input gradient alone, and the weight and bias gradients together. Per pass: one untimed call, then
// calls until `min_seconds` have passed (at least 5); the median call. `batch`, `in`, ... of each element are the
// shape (the times are filled in). ConfigError for a shape that is not positive or whose kernel does not fit.
std::vector<ConvTiming> time_convs(const std::vector<ConvTiming>& shapes, int threads, double min_seconds);

struct PoolTiming {
  int64_t batch = 0, channels = 0, height = 0, width = 0, kernel = 2;  // max pooling, stride = kernel
  double forward_s = 0, backward_s = 0;                                // medians
  int calls = 0;
};

// Times float32 max pooling as training runs it (the input requires a gradient): the forward with indices
// (at::max_pool2d_with_indices) and its backward (at::max_pool2d_with_indices_backward), as time_convs does.
std::vector<PoolTiming> time_pools(const std::vector<PoolTiming>& shapes, int threads, double min_seconds);

struct ModelStepTiming {
  double forward_s = 0, backward_s = 0;  // medians: forward with the cross-entropy loss; backward
  double prepare_s = 0;                  // median: zeroing the gradients and building the batch
  double stats_s = 0;                    // median: reading back the step's loss and accuracy (as the trainer does)
  std::vector<double> step_s;            // every timed step's prepare + forward + backward + stats, in order
  std::vector<double> after_s;           // the time in `after_step` after each timed step (empty without one)
  double optimizer_s = 0;                // median: SGD with momentum 0.9 (conduit train's default) over the parameters
  int steps = 0;
};

// One worker's training step of model `name` (mlp, cnn, resnet) at `batch` 28x28 images as `conduit train` runs it
// up to the gradient exchange: zero the gradients (detach and zero, as DistributedOptimizer::zero_grad), build the
// batch from 8-bit pixels (normalized as the trainer's make_batch), forward with the cross-entropy loss, and backward
// with a hook per parameter that copies its gradient into one flat buffer (as DistributedOptimizer's hooks copy
// them into buckets), and after the optimizer the loss and accuracy read back (as the trainer does every step). `steps`
// timed steps after one untimed step, with `threads` intra-op threads; `after_step` (untimed, when given) runs after
// every step, e.g. a barrier among ranks timing together, which blocks each step as BSP training's gradient exchange
// does; then the optimizer step is timed on its own. ConfigError for an unknown model.
ModelStepTiming time_model_step(const std::string& name, int batch, int threads, int steps,
                                const std::function<void()>& after_step = {});

}  // namespace conduit::train
