// The DistributedOptimizer API itself (libtorch in the test: the only test file here that includes it, as each such
// file costs ~20 s to compile): synchronize() then step() exchanges once, as Horovod's clip-then-step pattern needs.
#include "torch/distributed_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

#include "coll/communicator.h"

namespace conduit::train {
namespace {

// Two in-process ranks, one linear layer; rank r's gradient is (r + 1) everywhere. Returns each rank's weights after
// one SGD step (lr 1) taken as `synchronize, clip, step` or as a plain step.
std::vector<std::vector<float>> one_step(bool synchronize_first) {
  auto comms = coll::Communicator::inproc(2);
  std::vector<std::vector<float>> out(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      auto model = std::make_shared<torch::nn::LinearImpl>(4, 3);
      {
        torch::NoGradGuard ng;  // fixed weights (the global RNG is shared by the two rank threads)
        model->weight.fill_(0.1f);
        model->bias.fill_(0.0f);
      }
      auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1.0));
      DistOptions o;
      o.rebuild_buckets = false;
      DistributedOptimizer opt(model, sgd, comms[size_t(r)], o);
      opt.zero_grad();
      auto x = torch::ones({1, 4}) * float(r + 1);
      model->forward(x).sum().backward();
      if (synchronize_first) {
        opt.synchronize();
        torch::nn::utils::clip_grad_norm_(model->parameters(), 1e9);  // reads the averaged gradients, changes nothing
      }
      opt.step();
      auto w = model->weight.detach().contiguous().view(-1);
      out[size_t(r)].assign(w.data_ptr<float>(), w.data_ptr<float>() + w.numel());
    });
  for (auto& t : ts) t.join();
  return out;
}

TEST(DistributedOptimizer, SynchronizeThenStepExchangesOnce) {
  // d(sum(W x + b))/dW = x = (r + 1) everywhere: averaged over the two ranks 1.5, so W = 0.1 - 1.5 after the step.
  const std::vector<float> expected(12, 0.1f - 1.5f);
  for (bool synchronize_first : {false, true}) {
    auto w = one_step(synchronize_first);
    // With synchronize() first, step() exchanged again and averaged zeros into the gradients (W stayed 0.1).
    EXPECT_EQ(w[0], expected) << synchronize_first;
    EXPECT_EQ(w[1], expected) << synchronize_first;
  }
}

}  // namespace
}  // namespace conduit::train
