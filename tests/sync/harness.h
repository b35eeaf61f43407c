#pragma once
// Runs strategies on n in-process ranks (threads) over a quadratic problem: rank r minimizes
// 0.5 h_r |x - a_r|^2 with a_r[i] = sin(1 + r + 0.37 i), so replicas drift apart between synchronizations.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coll/communicator.h"
#include "core/error.h"
#include "sync/strategy.h"

namespace conduit::sync::harness {

inline std::vector<coll::CommPtr> make_comms(int n) {
  coll::CommConfig cfg;
  cfg.timeout_s = 20;
  cfg.measure_cost_model = false;
  return coll::Communicator::inproc(n, 0, cfg);
}

// Runs fn(rank, comm) on n ranks; fails the test with every rank's error.
inline void on_ranks(int n, const std::function<void(int, coll::CommPtr)>& fn) {
  auto comms = make_comms(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        fn(r, comms[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

inline float target(int rank, size_t i) { return std::sin(1.0f + rank + 0.37f * i); }

// Curvature differs per rank, so local steps do not commute with averaging (local SGD is not BSP here).
inline float curvature(int rank) { return 1.0f + 0.5f * rank; }

// The minimizer of sum_r curvature(r) |x - a_r|^2 / 2 over n ranks.
inline float optimum(size_t i, int n) {
  float num = 0, den = 0;
  for (int r = 0; r < n; ++r) num += curvature(r) * target(r, i), den += curvature(r);
  return num / den;
}

inline std::vector<float> initial(int rank, size_t d) {
  std::vector<float> x(d);
  for (size_t i = 0; i < d; ++i) x[i] = std::cos(0.5f * rank + 0.11f * i);
  return x;
}

// Lockstep for the worker threads of asynchronous schemes: each step starts only when every worker has reached it,
// so how far the replicas drift no longer depends on how the OS schedules the threads (under load one worker could
// run its last steps alone, pulled toward its own target). Gives up after 30 s (a worker that failed never comes).
class Pacer {
 public:
  explicit Pacer(int workers) : n_(workers) {}
  void arrive() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lk, std::chrono::seconds(30), [&] { return gen_ != gen; }))
      throw Error("harness: a worker did not reach the step within 30 s");
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, arrived_ = 0;
  uint64_t gen_ = 0;
};

// Trains with plain SGD (lr) for `steps` steps; returns this rank's final parameters (empty on server ranks).
// `slow`: extra sleep per step on this rank. `step_hook(worker, t, returned)` is called as before_step(t) begins
// and after it returns. `unfinished`: the parameters after the last step, before finish() (whose final average hides
// how close the replicas came).
inline std::vector<float> train(int rank, coll::CommPtr comm, const std::string& name, const Params& p, int steps,
                                size_t d = 40, float lr = 0.1f, double slow_ms = 0, Strategy** out = nullptr,
                                std::function<void(Strategy&)> after = nullptr, Pacer* pace = nullptr,
                                const std::function<void(int, int, bool)>& step_hook = nullptr,
                                std::vector<float>* unfinished = nullptr) {
  auto s = make_strategy(name, p, comm);
  if (out) *out = s.get();
  if (!s->is_worker()) {
    s->serve();
    if (after) after(*s);
    return {};
  }
  int w = s->worker_rank();
  auto x = initial(rank, d);
  std::vector<float> g(d);
  s->setup(x);
  for (int t = 0; t < steps; ++t) {
    if (pace) pace->arrive();
    if (slow_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(slow_ms));
    for (size_t i = 0; i < d; ++i) g[i] = curvature(w) * (x[i] - target(w, i));
    if (step_hook) step_hook(w, t, false);
    const bool apply = s->before_step(t, x, g);
    if (step_hook) step_hook(w, t, true);
    if (apply)
      for (size_t i = 0; i < d; ++i) x[i] -= lr * g[i];
    s->after_step(t, x);
  }
  if (unfinished) *unfinished = x;
  s->finish(x);
  if (after) after(*s);
  return x;
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, double(std::abs(a[i] - b[i])));
  return m;
}

}  // namespace conduit::sync::harness
