// Parameter servers: the SSP staleness bound (instrumented), s = 0 equals BSP, sharding, compression.
#include "sync/ps.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "harness.h"
#include "sync/detail.h"

using namespace conduit;
using namespace conduit::sync;
using conduit::sync::harness::max_abs_diff;
using conduit::sync::harness::on_ranks;
using conduit::sync::harness::train;

namespace {

struct Run {
  std::vector<std::vector<float>> x;
  PsClockStats clocks;  // merged over every shard
};

Run run(int n, const std::string& name, Params p, int steps, double slow_ms_rank1 = 0,
        const std::function<void(int, int, bool)>& step_hook = nullptr) {
  Run out;
  out.x.resize(n);
  std::mutex mu;
  on_ranks(n, [&](int r, coll::CommPtr c) {
    out.x[r] = train(
        r, c, name, p, steps, 40, 0.1f, r == 1 ? slow_ms_rank1 : 0, nullptr,
        [&](Strategy& s) {
          if (name.rfind("ps-", 0) != 0) return;
          auto st = ps_clock_stats(s);
          std::lock_guard<std::mutex> lk(mu);
          out.clocks.max_gap = std::max(out.clocks.max_gap, st.max_gap);
          out.clocks.pushes += st.pushes;
          out.clocks.waits += st.waits;
          out.clocks.max_tau = std::max(out.clocks.max_tau, st.max_tau);
          out.clocks.scaled += st.scaled;
        },
        nullptr, step_hook);
  });
  return out;
}

// The staleness bound as the workers see it, apart from the servers' own bookkeeping: a worker whose step t
// returns has pushed t + 1 gradients, and ssp lets it on only once every worker has pushed at least t + 1 - s
// (a worker that began step u has pushed at most u + 1). Returns the largest (t + 1) - min over workers of pushes
// begun, seen as steps return.
struct SeenGap {
  std::mutex mu;
  std::vector<int> begun;
  int max_gap = 0;
  explicit SeenGap(int workers) : begun(size_t(workers), 0) {}
  std::function<void(int, int, bool)> hook() {
    return [this](int w, int t, bool returned) {
      std::lock_guard<std::mutex> lk(mu);
      if (!returned) {
        begun[size_t(w)] = t + 1;
        return;
      }
      max_gap = std::max(max_gap, t + 1 - *std::min_element(begun.begin(), begun.end()));
    };
  }
};

// Makes asynchronous runs deterministic: the workers' steps (push and pull) run one at a time in the given order of
// worker ids (each id once per step of that worker), so every gradient is exactly as stale as the order makes it.
struct Order {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> order;
  size_t pos = 0;
  explicit Order(std::vector<int> o) : order(std::move(o)) {}
  std::function<void(int, int, bool)> hook() {
    return [this](int w, int, bool returned) {
      std::unique_lock<std::mutex> lk(mu);
      if (returned) {
        ++pos;
        cv.notify_all();
        return;
      }
      if (!cv.wait_for(lk, std::chrono::seconds(30), [&] { return pos < order.size() && order[pos] == w; }))
        throw Error(fmt::format("test: worker {} never got its turn (position {})", w, pos));
    };
  }
};

TEST(SyncPs, BspThroughServersEqualsAllreduceBsp) {
  // Plain SGD on the server (momentum 0) with the trainer's lr: the same updates as bsp + a local SGD step.
  auto ref = run(3, "bsp", {}, 10);
  for (auto [servers, colocate] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {5, 1}}) {
    auto ps =
        run(3, "ps-bsp",
            {{"momentum", "0"}, {"servers", std::to_string(servers)}, {"colocate", std::to_string(colocate)}}, 10);
    for (int r = 0; r < 3; ++r) EXPECT_LT(max_abs_diff(ps.x[r], ref.x[0]), 1e-5) << servers << " shards";
    EXPECT_EQ(ps.clocks.pushes, 3u * 10 * servers);
  }
  // Dedicated server ranks: 3 workers + 2 servers.
  auto ded = run(5, "ps-bsp", {{"momentum", "0"}, {"servers", "2"}}, 10);
  for (int r = 0; r < 3; ++r) EXPECT_LT(max_abs_diff(ded.x[r], ref.x[0]), 1e-5);
  EXPECT_TRUE(ded.x[3].empty());
}

// Each shard's pushes draw their random-k positions of their own: with the same seed in every shard, two shards of
// one size kept the same positions (here 10 of 20 each, from one worker's first push to two dedicated servers).
TEST(SyncPs, ShardsDrawTheirOwnRandomPositions) {
  const auto r = run(3, "ps-bsp", {{"servers", "2"}, {"colocate", "0"}, {"push_compressor", "randk:ratio=0.5"}}, 1);
  const std::vector<float> x0 = harness::initial(0, 40);
  std::vector<int> moved[2];
  for (size_t i = 0; i < 40; ++i)
    if (r.x[0][i] != x0[i]) moved[i / 20].push_back(int(i % 20));
  EXPECT_EQ(moved[0].size(), 10u);
  EXPECT_EQ(moved[1].size(), 10u);
  EXPECT_NE(moved[0], moved[1]);
}

// ssp with s = 0 applies each clock's mean once, as bsp: with momentum and weight decay too (a step a push decayed
// the momentum by 0.9^4 a round with 4 workers, another optimizer: the loss 0.26 where bsp's was 0.0009 after 10
// steps of a 4-worker mlp, an audit). asp/ssp's pushes applied one at a time agree with it only without momentum.
TEST(SyncPs, SspWithZeroStalenessEqualsBsp) {
  for (const std::string mu : {"0", "0.9"})
    for (const std::string wd : {"0", "0.3"}) {
      const Params common = {{"momentum", mu}, {"servers", "2"}, {"colocate", "1"}, {"weight_decay", wd}};
      Params s0 = common;
      s0["staleness"] = "0";
      auto bsp = run(4, "ps-bsp", common, 12, 1.0);
      auto ssp = run(4, "ps-ssp", s0, 12, 1.0);
      for (int r = 0; r < 4; ++r)
        EXPECT_LT(max_abs_diff(ssp.x[r], bsp.x[r]), 1e-6) << "momentum " << mu << ", weight decay " << wd;
      EXPECT_EQ(ssp.clocks.max_gap, 0);
      if (mu == "0.9" && wd == "0") {  // (the step a push, as asp takes it, is another optimizer with momentum)
        auto asp = run(4, "ps-asp", common, 12, 1.0,
                       Order({0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3,
                              0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3})
                           .hook());
        EXPECT_GT(max_abs_diff(asp.x[0], bsp.x[0]), 1e-3);
      }
    }
  // dc and staleness_lr act on stale gradients, of which s = 0 has none: refused (dana=1 keeps a push at a time).
  for (const char* key : {"dc", "staleness_lr"}) {
    try {
      make_strategy("ps-ssp", {{"staleness", "0"}, {key, "1"}, {"colocate", "1"}}, harness::make_comms(1)[0]);
      ADD_FAILURE() << key << " accepted with staleness=0";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(key) + " would do nothing"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(make_strategy("ps-ssp", {{"staleness", "0"}, {"dana", "1"}, {"dc", "1"}, {"colocate", "1"}},
                                harness::make_comms(1)[0]));
  // A leading sign or space is refused (the trainer's own readings refused it: "staleness=+0" ran as s = 0 while the
  // trainer took it for a stale scheme).
  for (const char* bad : {"+0", " 0", "+1"})
    EXPECT_THROW(make_strategy("ps-ssp", {{"staleness", bad}, {"colocate", "1"}}, harness::make_comms(1)[0]),
                 ConfigError)
        << bad;
  EXPECT_THROW(make_strategy("ps-asp", {{"lr", "+0.1"}}, harness::make_comms(1)[0]), ConfigError);
  EXPECT_THROW(make_strategy("ps-asp", {{"lr", " 0.1"}}, harness::make_comms(1)[0]), ConfigError);
}

TEST(SyncPs, SspNeverLetsTheClockGapExceedStaleness) {
  for (int s : {1, 3}) {
    // 4 workers and a dedicated server; worker 1 is slow.
    SeenGap seen(4);
    auto r = run(5, "ps-ssp", {{"staleness", std::to_string(s)}}, 30, 2.0, seen.hook());
    EXPECT_LE(seen.max_gap, s) << "a worker went on more than s steps ahead of the slowest";
    EXPECT_EQ(r.clocks.max_gap, s) << "the fast workers should reach the bound";
    EXPECT_GT(r.clocks.waits, 0u);
  }
  // Without the bound the same run drifts further apart (both the workers and the instrumentation see it).
  SeenGap seen(4);
  auto asp = run(5, "ps-asp", {}, 30, 2.0, seen.hook());
  EXPECT_GT(seen.max_gap, 3);
  EXPECT_GT(asp.clocks.max_gap, 3);
}

// Found by a review: under ssp with s > 0 the workers drift, but a worker s clocks ahead waited for the slowest at
// the shard (and for the reply) with the communicator's deadline, and its timeout stopped every rank. Worker 1 takes
// 1.6 s a step here, with a 0.6 s timeout (every other wait must end within it on a loaded machine); dedicated and
// co-located servers.
TEST(SyncPs, SspWaitsForAStragglerPastTheTimeout) {
  for (const char* colocate : {"0", "1"}) {
    const int n = 3;
    coll::CommConfig cfg;
    cfg.timeout_s = 0.6;
    cfg.measure_cost_model = false;
    auto comms = coll::Communicator::inproc(n, 0, cfg);
    const Params p{{"staleness", "1"}, {"colocate", colocate}, {"servers", colocate[0] == '1' ? "3" : "1"}};
    std::vector<std::string> errors(n);
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        try {
          auto s = make_strategy("ps-ssp", p, comms[size_t(r)]);
          if (!s->is_worker()) return s->serve();
          auto x = harness::initial(r, 16);
          std::vector<float> g(x.size(), 0.1f);
          s->setup(x);
          for (int t = 0; t < 3; ++t) {
            if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1600));
            if (s->before_step(uint64_t(t), x, g))
              for (float& v : x) v -= 0.1f;
            s->after_step(uint64_t(t), x);
          }
          if (colocate[0] == '1') await_workers(*comms[size_t(r)]);  // as the trainer does before finishing
          s->finish(x);
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
          comms[size_t(r)]->transport().abort(e.what());  // as a failing process would: the others' waits end
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < n; ++r) EXPECT_EQ(errors[size_t(r)], "") << "colocate=" << colocate << ", rank " << r;
  }
}

// A frozen worker (alive, its connections open, pushing nothing) under ps-ssp with s > 0: the others wait for it at
// the shard and for the servers' replies up to the drift timeout (1.5 s), not the communicator's (0.3 s), and then fail
// naming drift_timeout_s (they waited without a deadline). The frozen rank wakes after 20 s at most and trains on, so
// that the test fails, rather than hangs, where the waits have no deadline.
TEST(SyncPs, SspFailsAFrozenWorkerAtTheDriftTimeout) {
  for (const char* colocate : {"1", "0"}) {
    SCOPED_TRACE(fmt::format("colocate={}", colocate));
    const int n = 3;
    coll::CommConfig cfg;
    cfg.timeout_s = 0.3;
    cfg.measure_cost_model = false;
    auto comms = coll::Communicator::inproc(n, 0, cfg);
    // colocate=0: one dedicated server (rank 2), workers 0 and 1.
    const Params p{{"staleness", "1"}, {"colocate", colocate}, {"servers", colocate[0] == '1' ? "3" : "1"}};
    std::vector<std::string> errors(n);
    std::vector<double> seconds(n, 0);
    std::mutex mu;
    std::condition_variable cv;
    bool thaw = false;
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        std::unique_ptr<Strategy> s;
        auto t0 = std::chrono::steady_clock::now();
        try {
          s = make_strategy("ps-ssp", p, comms[size_t(r)]);
          s->set_drift_timeout(1.5);
          if (!s->is_worker()) return s->serve();
          auto x = harness::initial(r, 16);
          std::vector<float> g(x.size(), 0.1f);
          s->setup(x);
          t0 = std::chrono::steady_clock::now();
          if (r == 1) {
            std::unique_lock<std::mutex> lk(mu);
            cv.wait_for(lk, std::chrono::seconds(20), [&] { return thaw; });
          }
          for (int t = 0; t < 4; ++t) {
            if (s->before_step(uint64_t(t), x, g))
              for (float& v : x) v -= 0.1f;
            s->after_step(uint64_t(t), x);
          }
          s->finish(x);
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
          seconds[size_t(r)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (r == 0) {  // the frozen worker thaws once the others failed (it then fails on their abort)
            std::lock_guard<std::mutex> lk(mu);
            thaw = true;
            cv.notify_all();
          }
          comms[size_t(r)]->transport().abort(e.what());  // as a failing process would
        }
      });
    for (auto& t : ts) t.join();
    EXPECT_NE(errors[0].find("drift_timeout_s"), std::string::npos) << errors[0];
    // (named by the shard, which knows who is behind: the worker's own wait for the replies, a timeout longer, named
    // the servers that had not replied)
    EXPECT_NE(errors[0].find("for slower workers: worker(s) 1 at clock 0"), std::string::npos) << errors[0];
    EXPECT_GT(seconds[0], 1.4) << errors[0];
    EXPECT_LT(seconds[0], 10.0) << errors[0];
  }
}

TEST(SyncPs, WorkersEndWithTheServersFinalModel) {
  // Under asp a slow worker's last pushes land after the fast workers' last pulls; finish() hands every worker the
  // servers' final model, so all replicas agree: co-located shards by an allreduce, dedicated servers in reply to
  // the stop (each worker kept its own last pull, the fast ones missing the slow worker's last steps).
  auto r = run(3, "ps-asp", {{"servers", "3"}, {"colocate", "1"}, {"momentum", "0"}}, 20, 2.0);
  for (int w = 1; w < 3; ++w) EXPECT_EQ(r.x[w], r.x[0]);
  for (const char* servers : {"1", "2"}) {
    auto ded = run(5, "ps-asp", {{"servers", servers}, {"momentum", "0"}}, 20, 2.0);
    const int workers = 5 - std::stoi(servers);
    for (int w = 1; w < workers; ++w) EXPECT_EQ(ded.x[w], ded.x[0]) << servers << " servers, worker " << w;
  }
}

// Bounded staleness keeps every worker's last pull near the optimum (under asp a worker that runs alone at the end
// pulls the model toward its own target).
TEST(SyncPs, SspTrainingConvergesWithCompressionBothWays) {
  for (Params p : {Params{}, Params{{"push_compressor", "int8"}, {"pull_compressor", "topk:ratio=0.3"}},
                   Params{{"push_compressor", "ef:topk:ratio=0.2"}, {"servers", "3"}, {"colocate", "1"}}}) {
    p["momentum"] = "0.5";
    p["lr"] = "0.03";
    p["colocate"] = "1";
    p["staleness"] = "2";
    auto r = run(3, "ps-ssp", p, 150);
    for (size_t i = 0; i < 40; ++i) {
      float mean = harness::optimum(i, 3);
      for (int w = 0; w < 3; ++w) EXPECT_NEAR(r.x[w][i], mean, 0.2) << p.size() << " i=" << i;
    }
  }
}

}  // namespace

namespace {

// Co-located servers: a run resumed from save_state (after a barrier) continues as the uninterrupted one: bit for
// bit with 2 workers (ps-bsp sums a clock's gradients in worker order, whatever order they arrived in); within rounding
// otherwise (asp and ssp apply each push as it arrives).
TEST(SyncPs, ColocatedStateResumes) {
  for (std::string mode : {"ps-bsp", "plain", "ps-ssp", "dana"}) {
    const int n = mode == "ps-bsp" ? 2 : 3;
    const size_t d = 30;
    std::vector<std::vector<float>> straight(n), resumed(n);
    Params p = {
        {"servers", "2"}, {"colocate", "1"}, {"push_compressor", "ef:topk:ratio=0.3"}, {"pull_compressor", "int8"}};
    // (momentum 0: the pushes' order does not matter whichever way the server applies them)
    if (mode == "ps-ssp") p = {{"servers", "2"}, {"colocate", "1"}, {"staleness", "0"}, {"momentum", "0"}};
    if (mode == "plain") mode = "ps-bsp", p.erase("push_compressor"), p.erase("pull_compressor");
    // dana's per-worker momenta and their sum are state too (s = 0 fixes which pushes each look-ahead has seen).
    if (mode == "dana") mode = "ps-ssp", p = {{"servers", "2"}, {"colocate", "1"}, {"staleness", "0"}, {"dana", "1"}};
    on_ranks(n, [&](int r, coll::CommPtr c) {
      coll::CollOptions o;
      o.blocking = true;
      auto steps = [&](Strategy& s, std::vector<float>& x, int from, int to) {
        std::vector<float> g(d);
        for (int t = from; t < to; ++t) {
          for (size_t i = 0; i < d; ++i) g[i] = harness::curvature(r) * (x[i] - harness::target(r, i));
          s.before_step(t, x, g);
          s.after_step(t, x);
        }
      };
      auto a = make_strategy(mode, p, c);
      auto x = harness::initial(r, d);
      a->setup(x);
      steps(*a, x, 0, 4);
      c->barrier(o).wait();  // every push of step 3 is answered: the state is quiescent
      auto state = a->save_state();
      auto saved_x = x;
      c->barrier(o).wait();
      steps(*a, x, 4, 8);
      a->finish(x);
      straight[r] = x;
      c->barrier(o).wait();

      auto b = make_strategy(mode, p, c);
      auto y = harness::initial(r, d);
      b->setup(y);
      c->barrier(o).wait();  // every worker's initial pull is served before the shards are overwritten
      b->load_state(state);
      y = saved_x;
      c->barrier(o).wait();
      steps(*b, y, 4, 8);
      b->finish(y);
      resumed[r] = y;
    });
    for (int r = 0; r < n; ++r) {
      if (n == 2)
        EXPECT_EQ(resumed[r], straight[r]) << mode << " rank " << r;
      else
        EXPECT_LT(max_abs_diff(resumed[r], straight[r]), 1e-5) << mode << " rank " << r;
    }
  }
}

// A checkpoint's clock near 2^63 turned negative as a signed clock and passed the next push's clock + 1 check: a
// corrupt state is refused naming it.
TEST(SyncPs, ACorruptCheckpointClockIsRefused) {
  on_ranks(1, [&](int, coll::CommPtr c) {
    const Params p = {{"servers", "1"}, {"colocate", "1"}};
    auto a = make_strategy("ps-asp", p, c);
    std::vector<float> x(4, 1.0f), g(4, 0.5f);
    a->setup(x);
    a->before_step(0, x, g);
    auto state = a->save_state();
    ASSERT_GE(state.size(), 8u);
    state[7] = 0x80;  // (the worker's clock, the state's first u64, little-endian)
    a->finish(x);
    auto b = make_strategy("ps-asp", p, c);
    std::vector<float> y(4, 1.0f);
    b->setup(y);
    try {
      b->load_state(state);
      ADD_FAILURE() << "a clock past 2^62 was restored";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("the checkpoint's clock is 9223372036854775809 (allowed: below 2^62"),
                std::string::npos)
          << e.what();
    }
    b->finish(y);
  });
}

}  // namespace

namespace {
// DC-ASGD: the compensation is g*g*(w - w_bak); with one worker nothing else moves w between its pull and its push,
// so dc changes nothing (bit for bit); with several asynchronous workers it changes the updates and still converges.
TEST(SyncPs, DelayCompensationIsZeroWithoutStalenessChangesStaleUpdatesAndStaysBounded) {
  auto plain = run(2, "ps-asp", {{"momentum", "0"}, {"servers", "1"}}, 15);
  auto dc = run(2, "ps-asp", {{"momentum", "0"}, {"servers", "1"}, {"dc", "2"}}, 15);
  EXPECT_EQ(dc.x[0], plain.x[0]);  // rank 0 the only worker, rank 1 the server
  // Two workers taking strict turns (a dedicated server): every gradient one update stale, the same runs every
  // time. Compensation changes the result, and the same way twice (two free-running runs differed anyway).
  auto turns = [](const Params& p) {
    std::vector<int> order;
    for (int t = 0; t < 8; ++t) order.insert(order.end(), {0, 1});
    Order o(order);
    return run(3, "ps-asp", p, 8, 0, o.hook());
  };
  const Params base = {{"momentum", "0"}, {"servers", "1"}};
  Params with_dc = base;
  with_dc["dc"] = "2";
  auto p1 = turns(base), p2 = turns(base), d1 = turns(with_dc), d2 = turns(with_dc);
  EXPECT_EQ(p1.x[0], p2.x[0]);
  EXPECT_EQ(d1.x[0], d2.x[0]);
  EXPECT_GT(max_abs_diff(d1.x[0], p1.x[0]), 1e-4) << "delay compensation changed nothing";
  auto asp = run(4, "ps-asp", {{"momentum", "0"}, {"servers", "2"}, {"colocate", "1"}}, 60);
  auto comp = run(4, "ps-asp", {{"momentum", "0"}, {"servers", "2"}, {"colocate", "1"}, {"dc", "0.5"}}, 60);
  // (free-running, the two runs differ by timing alone: that dc changes the updates is the ordered check's above)
  auto worst = [](const ::Run& r) {
    double w = 0;
    for (size_t i = 0; i < r.x[0].size(); ++i) {
      double mean = 0;
      for (int k = 0; k < 4; ++k) mean += r.x[k][i] / 4;
      w = std::max(w, std::abs(mean - harness::optimum(i, 4)));
    }
    return w;
  };
  // Asynchronous runs end unevenly (the last worker pulls toward its own target): 0.4-0.8 seen for asp, 0.4-0.55
  // for dc at 0.5, and once 1.12 under ctest -j2 (2026-12-01; the untrained start is 1.08 away, so that run ended
  // no better than it began, which this cannot explain). Targets and optimum lie in [-1, 1]: a compensation that
  // blows up leaves that box, which is all this guards against.
  EXPECT_LT(worst(comp), 2.0);
  EXPECT_TRUE(std::isfinite(worst(asp)));
  EXPECT_THROW(make_strategy("ps-asp", {{"dc", "-1"}}, harness::make_comms(1)[0]), ConfigError);
  EXPECT_THROW(make_strategy("ps-bsp", {{"dc", "1"}}, harness::make_comms(1)[0]), ConfigError);
}
}  // namespace

namespace {
// Staleness-aware steps: W workers taking turns see tau = W - 1 at most, so under ssp with s = 0 (dana: a push at a
// time; momentum 0: bsp's steps) nothing is scaled (still bsp, and the largest tau is exactly W - 1); under asp with a
// slow worker its pushes arrive staler than that and are scaled down (counted by the shards; comparing worker 0's final
// model with the unscaled run's was timing-dependent: in one CI run every scaled push landed after worker 0's last pull
// and the models were equal).
TEST(SyncPs, StalenessAwareStepsScaleOnlyGradientsStalerThanTheWorkersTakingTurns) {
  auto bsp = run(4, "ps-bsp", {{"momentum", "0"}, {"servers", "2"}, {"colocate", "1"}}, 12, 1.0);
  auto ssp = run(4, "ps-ssp",
                 {{"momentum", "0"},
                  {"servers", "2"},
                  {"colocate", "1"},
                  {"staleness", "0"},
                  {"dana", "1"},
                  {"staleness_lr", "1"}},
                 12, 1.0);
  for (int r = 0; r < 4; ++r) EXPECT_LT(max_abs_diff(ssp.x[r], bsp.x[r]), 1e-5);
  EXPECT_EQ(ssp.clocks.max_tau, 3u);
  EXPECT_EQ(ssp.clocks.scaled, 0u);
  // Three workers, worker 1's four steps after the others' eight: its first gradient is 8 updates stale, more than
  // the 2 of workers taking turns, and only then is the step scaled. Deterministic: with the scaling the result
  // differs, and the same way twice (the scaled counter alone was checked, not the update).
  auto ordered = [](const Params& p) {
    Order o({0, 2, 0, 2, 0, 2, 0, 2, 1, 1, 1, 1});
    return run(4, "ps-asp", p, 4, 0, o.hook());
  };
  auto o1 = ordered({{"momentum", "0"}}), s1 = ordered({{"momentum", "0"}, {"staleness_lr", "1"}}),
       s2 = ordered({{"momentum", "0"}, {"staleness_lr", "1"}});
  EXPECT_EQ(o1.clocks.scaled, 0u);
  EXPECT_EQ(s1.clocks.scaled, 1u);  // worker 1's first push (its next ones each follow its own fresh pull)
  EXPECT_EQ(s1.x[1], s2.x[1]);
  EXPECT_GT(max_abs_diff(s1.x[1], o1.x[1]), 1e-4) << "the staleness-aware step changed nothing";
  auto asp = run(5, "ps-asp", {{"momentum", "0"}}, 30, 3.0);  // 4 workers, a dedicated server, worker 1 slow
  auto sa = run(5, "ps-asp", {{"momentum", "0"}, {"staleness_lr", "1"}}, 30, 3.0);
  EXPECT_GT(asp.clocks.max_tau, 3u);
  EXPECT_GT(sa.clocks.max_tau, 3u);
  EXPECT_GT(sa.clocks.scaled, 0u);
  EXPECT_EQ(asp.clocks.scaled, 0u);  // staleness_lr off
  for (int r = 0; r < 4; ++r)
    for (float v : sa.x[r]) EXPECT_TRUE(std::isfinite(v));
  EXPECT_THROW(make_strategy("ps-asp", {{"staleness_lr", "2"}}, harness::make_comms(1)[0]), ConfigError);
  EXPECT_THROW(make_strategy("ps-bsp", {{"staleness_lr", "1"}}, harness::make_comms(1)[0]), ConfigError);
}
}  // namespace

namespace {
size_t threads_in_process() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// A rank that stops with an error destroys its strategy without finish(). The threads that serve peers (co-located
// parameter servers, adpsgd's passive ranks) block on receives and use the strategy; its destructor must end and
// join them (they used to be detached and ran on into freed memory: a worker whose loss turned non-finite under
// ps-asp then died of SIGSEGV at exit instead of reporting the error). Nothing may stay behind or wait for the
// 20 s collective deadline.
// Found by a review: the sides without serving threads (a worker of dedicated servers, adpsgd's active ranks) did not
// abort when destroyed without finish(), so the ranks serving them (serve(), a passive rank's finish()) waited for
// their requests with no deadline. Those must now end with the cause.
TEST(SyncPs, ARankWithoutServingThreadsStillReleasesThoseServingIt) {
  for (auto [name, p, n, survivor] : std::vector<std::tuple<std::string, Params, int, int>>{
           {"ps-asp", {{"servers", "1"}, {"colocate", "0"}}, 3, 2}, {"adpsgd", {}, 2, 1}}) {
    auto comms = harness::make_comms(n);
    std::string error;
    std::promise<void> done;
    auto ended = done.get_future();
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        auto x = harness::initial(r, 16);
        try {
          auto s = make_strategy(name, p, comms[size_t(r)]);
          if (r != survivor) {
            s->setup(x);  // then destroyed without finish(), as an error unwinding the trainer does
            return;
          }
          if (s->is_worker()) {
            s->setup(x);
            std::this_thread::sleep_for(std::chrono::milliseconds(300));
            s->finish(x);
          } else {
            s->serve();
          }
          error = "no error";
        } catch (const Error& e) {
          if (r == survivor) error = e.what();
        }
        if (r == survivor) done.set_value();
      });
    if (ended.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << name << ": the serving rank still waits 10 s on";
      comms[size_t(survivor)]->transport().abort("test: gave up");
    }
    for (auto& t : ts) t.join();
    EXPECT_NE(error.find("stopped before finish()"), std::string::npos) << name << ": " << error;
  }
}

TEST(SyncPs, DestroyingStrategiesWithoutFinishJoinsTheirServingThreads) {
  for (auto [name, p, n] : std::vector<std::tuple<std::string, Params, int>>{
           {"ps-asp", {{"servers", "3"}, {"colocate", "1"}}, 3},
           {"ps-ssp", {{"servers", "2"}, {"colocate", "1"}, {"staleness", "0"}}, 3},
           {"adpsgd", {}, 4}}) {
    const size_t before = threads_in_process();
    auto t0 = std::chrono::steady_clock::now();
    {
      auto comms = harness::make_comms(n);
      std::vector<std::thread> ts;
      for (int r = 0; r < n; ++r)
        ts.emplace_back([&, r] {
          auto x = harness::initial(r, 16);
          try {
            auto s = make_strategy(name, p, comms[size_t(r)]);
            s->setup(x);
            // Destroyed here without finish(): what an exception unwinding through the trainer does. (A worker
            // blocked in its own step: AWorkerWaitingInItsOwnShardFailsAtOnceWhenAPeerGoesAway.)
          } catch (const Error&) {
            // a peer's abort may reach this rank's setup first
          }
        });
      for (auto& t : ts) t.join();
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0) << name;
    // A joined thread may still be listed for a moment: the kernel wakes its joiner before it removes the task.
    size_t now = threads_in_process();
    for (int i = 0; i < 200 && now != before; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      now = threads_in_process();
    }
    EXPECT_EQ(now, before) << name << ": serving threads left running";
  }
}

// Found by an audit: when a worker's requests to the servers failed (a server that died, or the deadline), its
// exchange gave up the sends alone: the receives of every server's reply header stayed posted into a buffer the
// exception freed, where a later reply from another server landed. Here server rank 2 takes worker 0's pull, then
// server rank 1 refuses it (a receive of another size fails the send); once setup() has thrown, rank 2 sends on the
// reply header's tag, and no receive of the worker's may take it (in-process, a send meets a posted receive at once).
// Ranks 1 and 2 speak the protocol by hand.
TEST(SyncPs, AFailedRequestGivesUpTheReceivesOfEveryServersReply) {
  const size_t d = 8;  // 4 parameters a shard
  std::promise<void> took, failed, probed;
  auto took_f = took.get_future();
  auto failed_f = failed.get_future();
  auto probed_f = probed.get_future();
  std::string error;
  bool taken = false;
  on_ranks(3, [&](int r, coll::CommPtr c) {
    if (r == 0) {
      auto s = make_strategy("ps-bsp", {{"servers", "2"}, {"colocate", "0"}}, c);
      auto x = harness::initial(0, d);
      try {
        s->setup(x);
        error = "no error";
      } catch (const Error& e) {
        error = e.what();
      }
      failed.set_value();
      // The strategy, and whatever its exchange left posted, lives until the probe was sent.
      probed_f.wait_for(std::chrono::seconds(10));
      return;
    }
    uint64_t header[4];  // a request's header: kind, bytes, clock, lr scale
    float shard[d / 2];
    detail::wait(*c, detail::irecv(*c, 0, detail::kTagPsInit, header, sizeof header));
    detail::wait(*c, detail::irecv(*c, 0, detail::kTagPsInit, shard, sizeof shard));
    if (r == 1) {  // once rank 2 has the request (a failed exchange withdraws the requests not taken yet)
      EXPECT_EQ(took_f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
      EXPECT_THROW(detail::wait(*c, detail::irecv(*c, 0, detail::kTagPsHeader, header, 8)), ProtocolError);
      return;
    }
    detail::wait(*c, detail::irecv(*c, 0, detail::kTagPsHeader, header, sizeof header));
    took.set_value();
    EXPECT_EQ(failed_f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    const uint8_t probe = 0;
    auto req = detail::isend(*c, 0, detail::kTagPsReplyHeader, &probe, 1);
    taken = req->done();  // (by a receive of another size: it failed both, and wrote nothing)
    if (!taken) c->transport().cancel(req, std::make_exception_ptr(TimeoutError("test: the probe is withdrawn")));
    probed.set_value();
  });
  EXPECT_NE(error.find("message size mismatch"), std::string::npos) << error;
  EXPECT_FALSE(taken) << "a receive of worker 0's failed exchange was still posted";
}

TEST(SyncPs, AWorkerWaitingInItsOwnShardFailsAtOnceWhenAPeerGoesAway) {
  // ps-ssp with s = 0: ranks 0 and 1 push and wait in their own shards for rank 2's clock; rank 2 goes away
  // (destroyed without finish(), as an error unwinding its trainer does). Their steps must fail with the cause now,
  // not with a timeout at the communicator's 20 s deadline.
  const int n = 3;
  Params p{{"servers", "3"}, {"colocate", "1"}, {"staleness", "0"}};
  auto comms = harness::make_comms(n);
  std::vector<std::string> errors(n);
  std::vector<double> seconds(n, 0);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      auto x = harness::initial(r, 16);
      std::vector<float> g(x.size(), 0.5f);
      try {
        auto s = make_strategy("ps-ssp", p, comms[size_t(r)]);
        s->setup(x);
        if (r == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the others are waiting by now
          return;
        }
        auto t0 = std::chrono::steady_clock::now();
        try {
          s->before_step(0, x, g);
          errors[r] = "no error";
        } catch (const Error& e) {
          errors[r] = e.what();
        }
        seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } catch (const Error& e) {
        errors[r] = std::string("outside the step: ") + e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r].find("waited"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("stopped before finish()"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_LT(seconds[r], 10.0) << "rank " << r << ": " << errors[r];
  }
}
}  // namespace

namespace {
// DANA-Zero: with one worker the shard's look-ahead reply turns momentum into Nesterov's (the gradient is taken at
// w - lr*mu*v); computed here in the same float order, it matches step for step. Momentum 0 is plain asp.
TEST(SyncPs, DanaWithOneWorkerIsNesterovMomentum) {
  const size_t d = 16;
  const float lr = 0.05f, mu = 0.9f;
  auto nesterov = [&](int steps) {
    auto w = harness::initial(0, d);
    std::vector<float> v(d, 0.f), x = w;
    for (int t = 0; t < steps; ++t) {
      for (size_t i = 0; i < d; ++i) {
        const float g = harness::curvature(0) * (x[i] - harness::target(0, i));
        v[i] = mu * v[i] + g;
        w[i] -= lr * v[i];
      }
      for (size_t i = 0; i < d; ++i) x[i] = w[i] - lr * mu * v[i];
    }
    return x;
  };
  auto dana = [&](Params p, int steps) {
    std::vector<float> x;
    on_ranks(1, [&](int, coll::CommPtr c) {
      auto s = make_strategy("ps-asp", p, c);
      x = harness::initial(0, d);
      s->setup(x);
      std::vector<float> g(d);
      for (int t = 0; t < steps; ++t) {
        for (size_t i = 0; i < d; ++i) g[i] = harness::curvature(0) * (x[i] - harness::target(0, i));
        EXPECT_FALSE(s->before_step(t, x, g));  // the server updated x
        s->after_step(t, x);
      }
    });
    return x;
  };
  Params p = {{"colocate", "1"}, {"lr", "0.05"}, {"momentum", "0.9"}, {"dana", "1"}};
  for (int steps : {1, 7, 40}) EXPECT_LT(max_abs_diff(dana(p, steps), nesterov(steps)), 1e-6) << steps << " steps";
  // The model a run ends with is the servers' parameters w, not the look-ahead point the worker last computed on:
  // co-located (the allreduce of the shards) and with a dedicated server (its reply to the stop).
  auto final_w = [&](int steps) {
    auto w = harness::initial(0, d);
    std::vector<float> v(d, 0.f);
    for (int t = 0; t < steps; ++t)
      for (size_t i = 0; i < d; ++i) {
        const float x = w[i] - lr * mu * v[i];  // where the gradient is taken
        v[i] = mu * v[i] + harness::curvature(0) * (x - harness::target(0, i));
        w[i] -= lr * v[i];
      }
    return w;
  };
  for (const char* colocate : {"1", "0"}) {
    const int n = colocate[0] == '1' ? 1 : 2;
    std::vector<float> x;
    on_ranks(n, [&](int r, coll::CommPtr c) {
      auto s = make_strategy("ps-asp", {{"colocate", colocate}, {"lr", "0.05"}, {"momentum", "0.9"}, {"dana", "1"}}, c);
      if (!s->is_worker()) return s->serve();
      x = harness::initial(0, d);
      s->setup(x);
      std::vector<float> g(d);
      for (int t = 0; t < 7; ++t) {
        for (size_t i = 0; i < d; ++i) g[i] = harness::curvature(0) * (x[i] - harness::target(0, i));
        s->before_step(t, x, g);
        s->after_step(t, x);
      }
      EXPECT_LT(max_abs_diff(x, nesterov(7)), 1e-6) << "colocate " << colocate;  // the look-ahead point
      s->finish(x);
    });
    EXPECT_LT(max_abs_diff(x, final_w(7)), 1e-6) << "colocate " << colocate;
    EXPECT_GT(max_abs_diff(x, nesterov(7)), 1e-4) << "colocate " << colocate;
  }
  // Without the look-ahead the same momentum is heavy ball, a different trajectory.
  auto heavy = dana({{"colocate", "1"}, {"lr", "0.05"}, {"momentum", "0.9"}}, 7);
  EXPECT_GT(max_abs_diff(heavy, nesterov(7)), 1e-3);
  EXPECT_EQ(dana({{"colocate", "1"}, {"momentum", "0"}, {"dana", "1"}}, 9),
            dana({{"colocate", "1"}, {"momentum", "0"}}, 9));
  EXPECT_THROW(make_strategy("ps-bsp", {{"dana", "1"}}, harness::make_comms(1)[0]), ConfigError);
  EXPECT_THROW(make_strategy("ps-asp", {{"dana", "yes"}}, harness::make_comms(1)[0]), ConfigError);
}

// Several workers: under ssp with s = 0 every look-ahead has seen exactly the pushes of the clocks before it, and the
// per-worker momenta sum to one momentum on the mean gradient, so the run is bsp with Nesterov's momentum (computed
// here). Asynchronous, with a slow worker: the ssp bound still holds and the runs stay near the joint optimum
// (asynchronous runs end unevenly: the last pushes pull toward their own rank's optimum; 0.55-1.3 seen with dana and
// 0.55-7.5 with one shared momentum at 0.9, so this guards against a look-ahead that blows up).
TEST(SyncPs, DanaWithZeroStalenessIsNesterovBspAndStaysBoundedAsynchronously) {
  const int n = 4, steps = 25;
  const size_t d = 12;
  const float lr = 0.1f, mu = 0.9f;
  std::vector<std::vector<float>> got(n);
  on_ranks(n, [&](int r, coll::CommPtr c) {
    auto s = make_strategy("ps-ssp", {{"servers", "2"}, {"colocate", "1"}, {"staleness", "0"}, {"dana", "1"}}, c);
    auto x = harness::initial(0, d);  // every worker starts from worker 0's initial parameters (setup pulls them)
    s->setup(x);
    std::vector<float> g(d);
    for (int t = 0; t < steps; ++t) {
      for (size_t i = 0; i < d; ++i) g[i] = harness::curvature(r) * (x[i] - harness::target(r, i));
      s->before_step(t, x, g);
      s->after_step(t, x);
    }
    got[r] = x;
    s->finish(x);
  });
  auto w = harness::initial(0, d), x = w;
  std::vector<float> v(d, 0.f);
  for (int t = 0; t < steps; ++t) {
    for (size_t i = 0; i < d; ++i) {
      float g = 0;
      for (int r = 0; r < n; ++r) g += harness::curvature(r) * (x[i] - harness::target(r, i)) / float(n);
      v[i] = mu * v[i] + g;
      w[i] -= lr * v[i];
    }
    for (size_t i = 0; i < d; ++i) x[i] = w[i] - lr * mu * v[i];
  }
  for (int r = 0; r < n; ++r) EXPECT_LT(max_abs_diff(got[r], x), 1e-4) << "rank " << r;

  auto worst = [](const ::Run& run, int k) {
    double e = 0;
    for (size_t i = 0; i < run.x[0].size(); ++i) {
      double mean = 0;
      for (int q = 0; q < k; ++q) mean += run.x[q][i] / k;
      e = std::max(e, std::abs(mean - harness::optimum(i, k)));
    }
    return e;
  };
  auto asp = run(4, "ps-asp", {{"servers", "2"}, {"colocate", "1"}, {"dana", "1"}}, 60, 1.0);
  auto shared = run(4, "ps-asp", {{"servers", "2"}, {"colocate", "1"}}, 60, 1.0);
  for (int r = 0; r < 4; ++r)
    for (float val : asp.x[r]) ASSERT_TRUE(std::isfinite(val));
  EXPECT_LT(worst(asp, 4), 1.5);
  EXPECT_GT(max_abs_diff(asp.x[0], shared.x[0]), 0.0);
  SeenGap seen(4);
  auto ssp =
      run(4, "ps-ssp", {{"servers", "2"}, {"colocate", "1"}, {"dana", "1"}, {"staleness", "2"}}, 40, 1.0, seen.hook());
  EXPECT_LE(seen.max_gap, 2);
  EXPECT_LT(worst(ssp, 4), 1.5);
}
TEST(SyncPs, WeightDecayFollowsTheTrainersLearningRateSchedule) {
  // The trainer scales pushed gradients by lr(t)/lr; the servers' weight decay must follow (it decayed at full
  // strength while warm-up or a cosine tail had the gradient steps near zero). Zero gradients isolate the decay.
  for (std::string mode : {"ps-asp", "ps-bsp"}) {
    on_ranks(1, [&](int, coll::CommPtr c) {
      auto s = make_strategy(mode, {{"lr", "0.1"}, {"momentum", "0"}, {"weight_decay", "0.5"}, {"colocate", "1"}}, c);
      std::vector<float> p(4, 2.0f), g(4, 0.0f);
      s->setup(p);
      s->set_lr_scale(0);  // e.g. the first warm-up step
      s->before_step(0, p, g);
      for (float x : p) EXPECT_FLOAT_EQ(x, 2.0f) << mode;
      s->set_lr_scale(0.5);
      s->before_step(1, p, g);
      for (float x : p) EXPECT_FLOAT_EQ(x, 2.0f * (1 - 0.1f * 0.5f * 0.5f)) << mode;
      s->finish(p);
    });
  }
}

}  // namespace

namespace {
// Parameters a server's updates drove past the floats cannot go out through a compressed pull: every rank fails with
// the line that names it (int8's scale of an inf is inf: the workers' replicas turned nan and the run went on).
TEST(SyncPs, ACompressedPullOfDivergedParametersIsRefused) {
  auto comms = harness::make_comms(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      try {
        // (lr 1e6 on a quadratic: the parameters grow a millionfold a step, past FLT_MAX within 10 steps)
        train(r, comms[size_t(r)], "ps-asp", {{"colocate", "1"}, {"lr", "1e6"}, {"pull_compressor", "int8"}}, 40);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[size_t(r)].find("the parameter change pulled by worker"), std::string::npos)
        << "rank " << r << ": " << errors[size_t(r)] << " / rank " << 1 - r << ": " << errors[size_t(1 - r)];
}

// Found by a review: a peer's malformed request (an unknown kind, a push before the pull, a clock going back, a
// length no request has) reached the shard, which applied it as a gradient, read out of range or allocated what the
// header claimed. Each is now refused naming what is allowed, and the worker waiting on the shard hears why.
TEST(SyncPs, MalformedRequestsAreRefusedNamingWhatIsAllowed) {
  struct Case {
    uint64_t kind, bytes, clock;
    const char* want;
    bool pull_first = false;  // (the push after the worker's one pull)
  };
  const size_t d = 16;
  const Case cases[] = {{7, 0, 0, "sent a message of kind 7; allowed: push (1), stop (2), pull (3)"},
                        {1, 4 * d, 1, "pushed before its pull"},
                        {3, 1u << 30, 0, "announced 1073741824 bytes for a pull; allowed: 0 bytes"},
                        // (a clock leaping ahead set bsp's applied clock past every later pull's: bsp ran as asp)
                        {1, 4 * d, 1000, "worker 1 pushed clock 1000 after clock 0 (allowed: the next clock, 1)", true},
                        {1, 4 * d, 0, "worker 1 pushed clock 0 after clock 0 (allowed: the next clock, 1)", true}};
  for (const Case& c : cases) {
    auto comms = harness::make_comms(2);
    std::string error;
    std::thread server([&] {
      // Rank 0 hosts the one shard and is a worker too: under bsp its push waits for worker 1's.
      auto x = harness::initial(0, d);
      std::vector<float> g(d, 0.5f);
      auto s = make_strategy("ps-bsp", {{"servers", "1"}, {"colocate", "1"}}, comms[0]);
      try {
        s->setup(x);
        s->before_step(0, x, g);
        error = "no error";
      } catch (const Error& e) {
        error = e.what();
      }
    });
    // Rank 1 speaks the protocol by hand: the header of its first request (its shard tag: shard 0's).
    struct Header {
      uint64_t kind, bytes, clock;
      double lr_scale;
    } h{c.kind, c.bytes, c.clock, 1.0};
    std::vector<float> payload(d, 0.25f);
    try {
      if (c.pull_first) {  // (and takes the reply: the starting parameters)
        const Header pull{3, 0, 0, 1.0};
        uint64_t reply_header[2] = {0, 0};
        std::vector<float> start(d);
        detail::wait(*comms[1], detail::isend(*comms[1], 0, detail::kTagPsHeader, &pull, sizeof pull));
        detail::wait(*comms[1],
                     detail::irecv(*comms[1], 0, detail::kTagPsReplyHeader, reply_header, sizeof reply_header));
        EXPECT_EQ(reply_header[0], 4 * d);
        detail::wait(*comms[1], detail::irecv(*comms[1], 0, detail::kTagPsReply, start.data(), 4 * d));
      }
      detail::wait(*comms[1], detail::isend(*comms[1], 0, detail::kTagPsHeader, &h, sizeof h));
      if (c.kind == 1) detail::isend(*comms[1], 0, detail::kTagPsPayload, payload.data(), 4 * d);
    } catch (const Error&) {
      // (the shard may refuse and abort before this side's last send is done: what it said is checked below)
    }
    server.join();
    EXPECT_NE(error.find(c.want), std::string::npos) << error;
    comms[1]->transport().abort("test over");
  }
  // Worker 0's initial upload announcing a model whose shard this process could not hold is refused before
  // anything is allocated for it (std::bad_alloc, or the out-of-memory killer, was all it said).
  {
    auto comms = harness::make_comms(2);
    std::string error = "no error";
    std::thread server([&] {
      auto s = make_strategy("ps-bsp", {{"servers", "1"}, {"colocate", "0"}}, comms[1]);
      try {
        s->serve();
      } catch (const Error& e) {
        error = e.what();
      }
    });
    struct Header {
      uint64_t kind, bytes, clock;
      double lr_scale;
    } h{0, uint64_t{4} << 39, uint64_t{1} << 39, 1.0};  // the init header of a model of 2^39 parameters
    detail::wait(*comms[0], detail::isend(*comms[0], 1, detail::kTagPsInit, &h, sizeof h));
    server.join();
    EXPECT_NE(error.find("shard 0: worker 0 sent a model of 549755813888 parameters, whose shard of 2199023255552 "
                         "bytes this process cannot hold four times"),
              std::string::npos)
        << error;
    comms[0]->transport().abort("test over");
  }
  // What a compressor may rightly send passes the length checks both ways: uint8 with one scale pair an element
  // takes 9 bytes an element (a first bound of 8 refused it once a shard passed 4096 elements); a payload whose size
  // depends on the data (threshold, qsgd's Elias codes: 7 bytes an element at 32767 levels in buckets of one) is
  // bounded by 8 bytes an element without asking its wire size (it has none: asking threw at the first push).
  for (const auto& [spec, d] : {std::pair<std::string, size_t>{"uint8:chunk=1", 10000},
                                {"threshold:threshold=0.001", 1000},
                                {"qsgd:levels=7,bucket=32,coding=elias", 1000},
                                {"qsgd:levels=32767,bucket=1,coding=elias", 1000}})
    on_ranks(2, [&](int r, coll::CommPtr c) {
      const auto x =
          train(r, c, "ps-bsp",
                {{"servers", "1"}, {"colocate", "0"}, {"push_compressor", spec}, {"pull_compressor", spec}}, 2, d);
      if (r == 0) {
        EXPECT_EQ(x.size(), d) << spec;
      }
    });
}
}  // namespace
