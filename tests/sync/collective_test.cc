// bsp, local SGD, DiLoCo and EASGD on in-process ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "harness.h"
#include "sync/detail.h"
#include "sync/schemes.h"

using namespace conduit;
using namespace conduit::sync;
using conduit::sync::harness::max_abs_diff;
using conduit::sync::harness::on_ranks;
using conduit::sync::harness::train;

namespace {

std::vector<std::vector<float>> run(int n, const std::string& name, const Params& p, int steps, size_t d = 40) {
  std::vector<std::vector<float>> out(n);
  on_ranks(n, [&](int r, coll::CommPtr c) { out[r] = train(r, c, name, p, steps, d); });
  return out;
}

TEST(SyncCollective, BspAveragesGradientsAndKeepsReplicasEqual) {
  auto b = run(4, "bsp", {}, 20);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(b[r], b[0]);
  // Averaged gradients converge to the minimizer of the sum.
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_NEAR(b[0][i], harness::optimum(i, 4), 0.05);
  }
}

TEST(SyncCollective, LocalSgdWithPeriodOneEqualsBsp) {
  for (int n : {2, 3, 4}) {
    auto b = run(n, "bsp", {}, 15);
    auto l = run(n, "local", {{"period", "1"}}, 15);
    for (int r = 0; r < n; ++r) EXPECT_LT(max_abs_diff(b[r], l[r]), 1e-5) << n << " ranks, rank " << r;
    // A longer period is not BSP (the comparison above can fail).
    auto l4 = run(n, "local", {{"period", "4"}}, 15);
    EXPECT_GT(max_abs_diff(b[0], l4[0]), 1e-3);
  }
}

TEST(SyncCollective, PostLocalWarmupIsBspThenLocal) {
  auto b = run(3, "bsp", {}, 6);
  auto l = run(3, "local", {{"period", "100"}, {"warmup", "6"}}, 6);
  for (int r = 0; r < 3; ++r) EXPECT_LT(max_abs_diff(b[r], l[r]), 1e-6);
  // Warm-up replicas stay equal; afterwards they diverge until the final average in finish().
  std::vector<std::vector<float>> mid(3);
  on_ranks(3, [&](int r, coll::CommPtr c) {
    auto s = make_strategy("local", {{"period", "100"}, {"warmup", "2"}}, c);
    auto x = harness::initial(r, 8);
    std::vector<float> g(8);
    s->setup(x);
    for (int t = 0; t < 5; ++t) {
      for (size_t i = 0; i < 8; ++i) g[i] = x[i] - harness::target(r, i);
      if (s->before_step(t, x, g))
        for (size_t i = 0; i < 8; ++i) x[i] -= 0.1f * g[i];
      s->after_step(t, x);
    }
    mid[r] = x;
    s->finish(x);
    if (r == 0) {
      EXPECT_GT(s->stats().rounds, 2u);
    }
  });
  EXPECT_GT(max_abs_diff(mid[0], mid[1]), 1e-3);
}

TEST(SyncCollective, AdaptivePeriodGrowsWhenReplicasAgree) {
  on_ranks(2, [](int r, coll::CommPtr c) {
    LocalSgdStrategy s(c, 1, 0, true, 16, 0.5);  // divergence is far below 0.5 here: the period doubles
    std::vector<float> x(16, 1.0f + 0.001f * r);
    s.setup(x);
    for (int t = 0; t < 40; ++t) s.after_step(t, x);
    EXPECT_EQ(s.period(), 16);
    // Each average's one-number allreduce of the squared norms is counted as any exchange is: both ways, in the
    // rounds (periods 1, 2, 4, 8, 16 over 40 steps: 5 averages of 16 floats and 5 sums of one, 2 ranks).
    EXPECT_EQ(s.stats().rounds, 10u);
    EXPECT_EQ(s.stats().bytes_sent, 5u * (64 + 4));
    EXPECT_EQ(s.stats().bytes_received, s.stats().bytes_sent);
    auto st = s.save_state();
    LocalSgdStrategy s2(c, 1, 0, true, 16, 0.5);
    s2.load_state(st);
    EXPECT_EQ(s2.period(), 16);
  });
}

// Replicas far apart (divergence above 2 x target) halve an adaptive period down to 1.
TEST(SyncCollective, AdaptivePeriodHalvesWhenReplicasDiverge) {
  on_ranks(2, [](int r, coll::CommPtr c) {
    LocalSgdStrategy s(c, 8, 0, true, 16, 1e-6);
    std::vector<float> x(16);
    int averages = 0;
    for (int t = 0; t < 16; ++t) {
      // Each rank steps its replica its own way: after an average they are apart again by the next one.
      for (size_t i = 0; i < x.size(); ++i) x[i] += (r == 0 ? 1.0f : -1.0f) * float(i + 1);
      const uint64_t before = s.stats().rounds;
      s.after_step(uint64_t(t), x);
      if (s.stats().rounds != before) ++averages;
    }
    EXPECT_EQ(s.period(), 1);  // 8 -> 4 -> 2 -> 1
    EXPECT_GE(averages, 4);
  });
}

TEST(SyncCollective, DilocoWithPeriodOneUnitOuterLrNoMomentumIsPlainAveraging) {
  auto avg = run(4, "local", {{"period", "1"}}, 12);
  auto dl = run(4, "diloco", {{"period", "1"}, {"outer_lr", "1"}, {"momentum", "0"}, {"nesterov", "0"}}, 12);
  for (int r = 0; r < 4; ++r) EXPECT_LT(max_abs_diff(avg[r], dl[r]), 1e-5);
  // With Nesterov momentum it is a different method.
  auto dn = run(4, "diloco", {{"period", "1"}, {"outer_lr", "1"}, {"momentum", "0.9"}}, 12);
  EXPECT_GT(max_abs_diff(avg[0], dn[0]), 1e-3);
  // And H = 3 with lr 1, no momentum equals local SGD with period 3.
  auto l3 = run(4, "local", {{"period", "3"}}, 12);
  auto d3 = run(4, "diloco", {{"period", "3"}, {"outer_lr", "1"}, {"momentum", "0"}, {"nesterov", "0"}}, 12);
  for (int r = 0; r < 4; ++r) EXPECT_LT(max_abs_diff(l3[r], d3[r]), 1e-5);
}

// A fixed period is the configured one on resume (the saved period overrode it); an adaptive one goes on.
TEST(SyncCollective, LocalSgdResumeKeepsAFixedPeriodAndAnAdaptiveOnesState) {
  on_ranks(1, [](int, coll::CommPtr c) {
    LocalSgdStrategy saved(c, 8, 0, false, 64, 0.01), resumed(c, 32, 0, false, 64, 0.01);
    resumed.load_state(saved.save_state());
    EXPECT_EQ(resumed.period(), 32);
    LocalSgdStrategy adaptive(c, 8, 0, true, 64, 0.01);
    detail::Writer w;  // an adaptive run that had grown its period to 16
    w.u64(16);
    w.u64(0);
    adaptive.load_state(w.take());
    EXPECT_EQ(adaptive.period(), 16);
  });
}

// DiLoCo's outer step by hand (PyTorch's Nesterov SGD on the outer gradient g = mean(outer - x)): v = mu v + g,
// outer -= lr (g + mu v). Two outer steps, so the momentum carried from the first counts (the test above only saw
// that Nesterov differs from averaging: heavy ball or a missing mu would pass it).
TEST(SyncCollective, DilocoOuterStepIsNesterovOnTheMeanOuterGradient) {
  const double lr = 0.7, mu = 0.9;
  const double d1[3] = {0.1, -0.2, 0.3}, d2[3] = {0.05, 0.05, -0.1};
  std::vector<std::vector<float>> out(2);
  on_ranks(2, [&](int r, coll::CommPtr c) {
    DilocoStrategy s(c, 1, lr, mu, true);
    std::vector<float> x = {1.0f, 2.0f, -1.0f};
    s.setup(x);
    for (int step = 0; step < 2; ++step) {
      for (size_t i = 0; i < 3; ++i) x[i] += float((r + 1) * (step == 0 ? d1[i] : d2[i]));  // the local steps
      s.after_step(uint64_t(step), x);
    }
    out[size_t(r)] = x;
  });
  const double x0[3] = {1.0, 2.0, -1.0};
  for (size_t i = 0; i < 3; ++i) {
    // mean over ranks 1 and 2 of (r + 1) d: 1.5 d; the outer gradient is its negative.
    const double g1 = -1.5 * d1[i], v1 = g1, o1 = x0[i] - lr * (g1 + mu * v1);
    const double g2 = -1.5 * d2[i], v2 = mu * v1 + g2, o2 = o1 - lr * (g2 + mu * v2);
    for (int r = 0; r < 2; ++r) EXPECT_NEAR(out[size_t(r)][i], o2, 1e-6) << "rank " << r << ", element " << i;
  }
}

TEST(SyncCollective, DilocoStateRoundTrips) {
  on_ranks(2, [](int r, coll::CommPtr c) {
    DilocoStrategy a(c, 2, 0.7, 0.9, true), b(c, 2, 0.7, 0.9, true);
    auto x = harness::initial(r, 10);
    a.setup(x);
    for (int t = 0; t < 3; ++t) {
      for (auto& v : x) v *= 0.9f;
      a.after_step(t, x);
    }
    auto y = x;
    b.setup(y);
    b.load_state(a.save_state());
    for (auto* v : {&x, &y})
      for (auto& e : *v) e += 0.5f;
    a.after_step(3, x);
    b.after_step(3, y);
    EXPECT_EQ(x, y);
    EXPECT_THROW(b.load_state(std::vector<uint8_t>(3)), InvalidArgument);
  });
}

// A state saved for another model, or a corrupt one, is refused with a line naming what does not match: the
// outer momentum, center, push-sum numerators and public copies were taken at any length and indexed as the model
// (out of range), a compressor state's announced length was trusted (SIGSEGV), and a vector length near 2^62 wrapped
// the length check (std::length_error).
TEST(SyncState, OtherModelsAndCorruptStatesAreRefused) {
  auto refused = [](Strategy& s, const std::vector<uint8_t>& state, const std::string& want) {
    try {
      s.load_state(state);
      ADD_FAILURE() << s.name() << ": loaded; wanted an error with '" << want << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  on_ranks(2, [&](int r, coll::CommPtr c) {
    std::vector<float> big(16, 0.5f), small(8, 0.5f);
    for (const std::string name : {"diloco", "easgd", "sgp"}) {
      auto a = make_strategy(name, {}, c), b = make_strategy(name, {}, c);
      a->setup(big);
      b->setup(small);
      refused(*b, a->save_state(), "holds 16 values, this model has 8");
    }
    auto a = make_strategy("dpsgd", {{"compressor", "topk:ratio=0.25"}}, c);
    auto b = make_strategy("dpsgd", {{"compressor", "topk:ratio=0.25"}}, c);
    a->setup(big);
    b->setup(small);
    refused(*b, a->save_state(), "public copy holds 16 values, this model has 8");
    // The compressor state's length, the u64 after the two public copies (each a u64 length and 16 floats).
    auto state = a->save_state();
    const size_t at = 8 + 2 * (8 + 16 * 4);
    ASSERT_LT(at + 8, state.size());
    const uint64_t huge = uint64_t{1} << 40;
    std::memcpy(state.data() + at, &huge, 8);
    auto b16 = make_strategy("dpsgd", {{"compressor", "topk:ratio=0.25"}}, c);
    b16->setup(big);
    refused(*b16, state, "announces 1099511627776 bytes of compressor state");
    // A DiLoCo state: since_sync, then a vector announcing 2^62 floats.
    std::vector<uint8_t> wrap(16, 0);
    const uint64_t n = uint64_t{1} << 62;
    std::memcpy(wrap.data() + 8, &n, 8);
    auto d = make_strategy("diloco", {}, c);
    d->setup(big);
    refused(*d, wrap, "truncated");
    auto local = make_strategy("local", {}, c);
    local->setup(big);
    refused(*local, std::vector<uint8_t>(16, 0), "period is 0 (allowed: 1 to");
    // Steps since the last synchronization of 2^63 and more (read as negative: local SGD, DiLoCo and EASGD never
    // synchronized again and finish() skipped its last round, leaving the replicas apart without a word), or at
    // or past local SGD's own period.
    detail::Writer lw;
    lw.u64(8);
    lw.u64(8);
    refused(*local, lw.take(), "steps since the last average are 8 (allowed: 0 to 7");
    for (const std::string name : {"diloco", "easgd"}) {
      auto s = make_strategy(name, {}, c);
      s->setup(big);
      auto saved = s->save_state();
      const uint64_t negative = uint64_t{1} << 63;
      std::memcpy(saved.data(), &negative, 8);
      refused(*s, saved, "steps since the last synchronization are 9223372036854775808");
    }
    (void)r;
  });
}

// finish() ends a partial round: DiLoCo takes one more outer step, EASGD one more elastic step and hands every
// replica the center; either way all replicas end equal (they ended apart, at worker 0's unsynchronized replica).
TEST(SyncCollective, DilocoAndEasgdEndWithOneModelAfterAPartialRound) {
  for (const char* name : {"diloco", "easgd"}) {
    const int n = 3;
    std::vector<std::vector<float>> before(n), after(n);
    on_ranks(n, [&](int r, coll::CommPtr c) {
      auto s = make_strategy(name, {{"period", "4"}}, c);
      auto x = harness::initial(r, 16);
      std::vector<float> g(16);
      s->setup(x);
      for (int t = 0; t < 6; ++t) {  // one full round of 4, then 2 steps of the next
        for (size_t i = 0; i < x.size(); ++i) g[i] = x[i] - harness::target(r, i);
        if (s->before_step(t, x, g))
          for (size_t i = 0; i < x.size(); ++i) x[i] -= 0.1f * g[i];
        s->after_step(t, x);
      }
      before[r] = x;
      s->finish(x);
      after[r] = x;
    });
    EXPECT_GT(max_abs_diff(before[0], before[1]), 1e-4) << name;  // the partial round left them apart
    for (int r = 1; r < n; ++r) EXPECT_EQ(after[r], after[0]) << name;
  }
}

TEST(SyncCollective, EasgdPreservesSumOfWorkersPlusCenterWithZeroGradients) {
  const int n = 4;
  const size_t d = 12;
  std::vector<std::vector<float>> x(n), center(n);
  std::vector<double> before(d, 0);
  std::mutex mu;
  on_ranks(n, [&](int r, coll::CommPtr c) {
    EasgdStrategy s(c, 1, 0.2);
    auto p = harness::initial(0, d);
    s.setup(p);
    // Replicas drift apart (as local steps would make them), then only communication happens.
    for (size_t i = 0; i < d; ++i) p[i] += harness::target(r, i);
    {
      std::lock_guard<std::mutex> lk(mu);
      for (size_t i = 0; i < d; ++i) before[i] += p[i] + (r == 0 ? s.center()[i] : 0);
    }
    for (int t = 0; t < 30; ++t) s.after_step(t, p);
    x[r] = p;
    center[r] = s.center();
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(center[r], center[0]);
  double spread = 0;
  for (size_t i = 0; i < d; ++i) {
    double after = center[0][i];
    for (int r = 0; r < n; ++r) after += x[r][i], spread = std::max(spread, double(std::abs(x[r][i] - center[0][i])));
    EXPECT_NEAR(after, before[i], 1e-4) << i;
  }
  EXPECT_LT(spread, 1e-2);  // the elastic force pulled workers and center together
}

// Found by an audit: local, diloco and easgd met at their sync point with the collectives' deadline, while the
// workers rightly drift up to `period` steps apart between syncs: a straggler that bsp waits for (its lag a step
// within the timeout) failed them ("allreduce #6 ... did not complete before the deadline"). The sync's deadline is
// period x timeout_s: that straggler syncs; a frozen one still fails the sync within it.
struct PeriodRun {
  std::string error0, error1;
  double seconds0 = 0;  // rank 0: from rank 1's freeze to its error
};

PeriodRun period_run(const std::string& scheme, double timeout_s, int period, double slow_s, bool frozen, int steps) {
  coll::CommConfig cfg;
  cfg.timeout_s = timeout_s;
  cfg.measure_cost_model = false;
  auto comms = coll::Communicator::inproc(2, 0, cfg);
  PeriodRun out;
  std::mutex mu;
  std::condition_variable cv;
  bool ended0 = false;
  std::chrono::steady_clock::time_point frozen_at = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      std::string error;
      try {
        auto s = make_strategy(scheme, {{"period", std::to_string(period)}}, comms[size_t(r)]);
        auto x = harness::initial(r, 16);
        std::vector<float> g(x.size());
        s->setup(x);
        for (int t = 0; t < steps; ++t) {
          if (r == 1 && frozen && t == 1) {  // takes no further part, its connections open, until rank 0 has ended
            std::unique_lock<std::mutex> lk(mu);
            frozen_at = std::chrono::steady_clock::now();
            cv.wait_for(lk, std::chrono::seconds(30), [&] { return ended0; });
            comms[1]->transport().abort("test: the frozen rank goes away");
            return;
          }
          if (r == 1) std::this_thread::sleep_for(std::chrono::duration<double>(slow_s));
          for (size_t i = 0; i < x.size(); ++i) g[i] = harness::curvature(r) * (x[i] - harness::target(r, i));
          if (s->before_step(uint64_t(t), x, g))
            for (size_t i = 0; i < x.size(); ++i) x[i] -= 0.1f * g[i];
          s->after_step(uint64_t(t), x);
        }
        s->finish(x);
      } catch (const std::exception& e) {
        error = e.what();
        comms[size_t(r)]->transport().abort(e.what());
      }
      std::lock_guard<std::mutex> lk(mu);
      (r == 0 ? out.error0 : out.error1) = error;
      if (r == 0) {
        out.seconds0 = std::chrono::duration<double>(std::chrono::steady_clock::now() - frozen_at).count();
        ended0 = true;
        cv.notify_all();
      }
    });
  for (auto& t : ts) t.join();
  return out;
}

TEST(SyncCollective, APeriodicSyncWaitsForAStragglersWholePeriodLagButNotForAFrozenPeer) {
  const double timeout = 0.3;
  const int period = 8;
  for (const char* scheme : {"local", "diloco", "easgd"}) {
    // 0.12 s a step behind (bsp would wait for it: within the timeout), 0.96 s a period (past it).
    const auto slow = period_run(scheme, timeout, period, 0.12, false, 2 * period);
    EXPECT_EQ(slow.error0, "") << scheme;
    EXPECT_EQ(slow.error1, "") << scheme;
    // Rank 1 stops after its first step: rank 0's sync at step 8 fails within period x timeout.
    const auto stuck = period_run(scheme, timeout, period, 0, true, 2 * period);
    EXPECT_NE(stuck.error0.find("deadline"), std::string::npos) << scheme << ": " << stuck.error0;
    EXPECT_GE(stuck.seconds0, period * timeout - 0.3) << scheme << ": " << stuck.error0;
    EXPECT_LE(stuck.seconds0, period * timeout + 3.0) << scheme << ": " << stuck.error0;
  }
}

}  // namespace
