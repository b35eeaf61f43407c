// The DistributedOptimizer API itself (libtorch in the test: the only test file here that includes it, as each such
// file costs ~20 s to compile): synchronize() then step() exchanges once, as Horovod's clip-then-step pattern needs.
#include "torch/distributed_optimizer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <thread>
#include <tuple>
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

// Found by a review: with overlap a second backward before step() added to buckets that may be averaged already
// (each rank then held its own mix), zero_grad() after a backward could not withdraw the exchange, a gradient after
// synchronize() was lost, and a second synchronize() averaged zeros into .grad. One rank is enough to see each.
TEST(DistributedOptimizer, MisuseIsRefusedAndARepeatedSynchronizeChangesNothing) {
  auto setup = [](bool overlap, bool rebuild = false) {
    auto comms = coll::Communicator::inproc(1);
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 3);
    {
      torch::NoGradGuard ng;
      model->weight.fill_(0.1f);
      model->bias.fill_(0.0f);
    }
    auto sgd = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1.0));
    DistOptions o;
    o.rebuild_buckets = rebuild;
    o.overlap = overlap;
    auto opt = std::make_shared<DistributedOptimizer>(model, sgd, comms[0], o);
    return std::make_tuple(comms, model, opt);
  };
  auto backward = [](torch::nn::Linear& m) { m->forward(torch::ones({1, 4})).sum().backward(); };
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  {
    auto [comms, lin, opt] = setup(true);
    torch::nn::Linear m(lin);
    opt->zero_grad();
    backward(m);
    EXPECT_NE(message([&] { backward(m); }).find("got a second gradient before step()"), std::string::npos);
    EXPECT_NE(message([&] { opt->zero_grad(); }).find("zero_grad() after a backward"), std::string::npos);
    opt->synchronize();
    EXPECT_NE(message([&] { backward(m); }).find("after synchronize() and before step()"), std::string::npos);
  }
  {
    auto [comms, lin, opt] = setup(true);
    torch::nn::Linear m(lin);
    opt->zero_grad();
    backward(m);
    opt->synchronize();
    opt->synchronize();  // averaged already: leaves .grad as it is
    opt->step();
    EXPECT_FLOAT_EQ(m->weight[0][0].item<float>(), 0.1f - 1.0f);
  }
  {
    // Without overlap a second backward accumulates, and zero_grad() drops what the buckets hold.
    auto [comms, lin, opt] = setup(false);
    torch::nn::Linear m(lin);
    opt->zero_grad();
    backward(m);
    opt->zero_grad();
    backward(m);
    backward(m);
    opt->step();
    EXPECT_FLOAT_EQ(m->weight[0][0].item<float>(), 0.1f - 2.0f);
  }
  {
    // A backward discarded before the first step leaves no trace in the order the buckets are rebuilt from (it
    // recorded every parameter once, the next backward again: each slot twice, 120 bytes a step for 60).
    auto [comms, lin, opt] = setup(false, true);
    torch::nn::Linear m(lin);
    opt->zero_grad();
    backward(m);
    opt->zero_grad();
    backward(m);
    opt->step();
    opt->zero_grad();
    backward(m);
    opt->step();
    size_t slots = 0;
    for (const auto& b : opt->bucket_layout()) slots += b.size();
    EXPECT_EQ(slots, 2u);
    EXPECT_EQ(opt->last_stats().grad_bytes, (12u + 3u) * 4u);
  }
}

// Three heads: `a` used by both ranks, `b` by rank 1 only, `c` by neither. With find_unused_parameters, c's gradient
// stays undefined and SGD with weight decay leaves it as it was (it decayed, on a zero gradient); b gets the average
// on both ranks. Without, c is averaged as zero and decays.
struct Heads : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  Heads() {
    a = register_module("a", torch::nn::Linear(2, 1));
    b = register_module("b", torch::nn::Linear(2, 1));
    c = register_module("c", torch::nn::Linear(2, 1));
    torch::NoGradGuard ng;
    for (auto& p : parameters()) p.fill_(1.0f);
  }
};

TEST(DistributedOptimizer, ParametersNoRankUsedAreLeftToTheOptimizerUntouched) {
  for (bool find : {true, false}) {
    auto comms = coll::Communicator::inproc(2);
    std::vector<std::vector<float>> bw(2), cw(2);
    std::vector<int> c_grad(2, -1);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        auto m = std::make_shared<Heads>();
        auto sgd =
            std::make_shared<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.5).weight_decay(0.2));
        DistOptions o;
        o.find_unused_parameters = find;
        DistributedOptimizer opt(m, sgd, comms[size_t(r)], o);
        opt.zero_grad();
        auto x = torch::ones({1, 2});
        auto y = m->a->forward(x).sum();
        if (r == 1) y = y + m->b->forward(x).sum();
        y.backward();
        opt.step();
        c_grad[size_t(r)] = m->c->weight.grad().defined() ? 1 : 0;
        auto flat = [](const torch::Tensor& t) {
          auto v = t.detach().contiguous().view(-1);
          return std::vector<float>(v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
        };
        bw[size_t(r)] = flat(m->b->weight);
        cw[size_t(r)] = flat(m->c->weight);
      });
    for (auto& t : ts) t.join();
    // b: gradient 1 on rank 1, none on rank 0: average 0.5; w = 1 - 0.5 (0.5 + 0.2 x 1) = 0.65 on both ranks.
    for (int r = 0; r < 2; ++r) EXPECT_EQ(bw[size_t(r)], std::vector<float>(2, 0.65f)) << find << " rank " << r;
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(c_grad[size_t(r)], find ? 0 : 1) << find;
      // Untouched with the option; decayed by lr x wd = 0.1 without it.
      EXPECT_EQ(cw[size_t(r)], std::vector<float>(2, find ? 1.0f : 0.9f)) << find << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace conduit::train
