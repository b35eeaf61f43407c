// One secure-aggregation round, every party in this process one after another: Bonawitz et al.'s complete graph
// (neighbors 0) against SecAgg+'s k-regular graph at the same round size, 5% of the clients dropping after their
// key shares (so the server also removes their pairwise masks). Counters: the mean client's and the server's time in
// the round (wall clock, one thread: the parties run one after another). Run: build/bench/bench_secagg_bench
// --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "fl/secagg.h"

using namespace conduit::fl;

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

// range(0): clients n; range(1): neighbours k (0: every pair); range(2): elements per vector.
static void BM_SecAggRound(benchmark::State& st) {
  SecAggConfig cfg;
  cfg.num_clients = static_cast<int>(st.range(0));
  cfg.neighbors = static_cast<int>(st.range(1));
  cfg.length = static_cast<size_t>(st.range(2));
  cfg.bits = 32;
  cfg.threshold = group_size(cfg) / 2 + 1;
  std::mt19937 rng(1);
  std::vector<uint32_t> x(cfg.length);
  for (auto& e : x) e = rng();
  double client_s = 0, server_s = 0;
  for (auto _ : st) {
    ++cfg.round_id;
    SecAggServer server(cfg);
    std::vector<SecAggClient> clients;
    auto t0 = Clock::now();
    for (int i = 0; i < cfg.num_clients; ++i) clients.emplace_back(cfg, i);
    std::vector<AdvertiseMsg> ads;
    for (auto& c : clients) ads.push_back(c.advertise());
    client_s += since(t0);
    t0 = Clock::now();
    for (auto& a : ads) server.add_advertise(a);
    const auto u1 = server.advertised();
    server_s += since(t0);
    for (auto& c : clients) {
      t0 = Clock::now();
      auto shares = c.share_keys(u1);
      client_s += since(t0);
      t0 = Clock::now();
      server.add_shares(c.id(), shares);
      server_s += since(t0);
    }
    t0 = Clock::now();
    const auto u2 = server.u2();
    server_s += since(t0);
    for (int u : u2) {
      t0 = Clock::now();
      auto inbox = server.inbox_for(u);
      server_s += since(t0);
      t0 = Clock::now();
      auto y = clients[u].mask_input(inbox, x.data());
      client_s += since(t0);
      if (u % 20 == 7) continue;  // 5% drop after their key shares
      t0 = Clock::now();
      server.add_masked_input(u, std::move(y));
      server_s += since(t0);
    }
    t0 = Clock::now();
    const auto u3 = server.survivors();
    server_s += since(t0);
    for (int u : u3) {
      t0 = Clock::now();
      auto m = clients[u].unmask(u3);
      client_s += since(t0);
      t0 = Clock::now();
      server.add_unmask(m);
      server_s += since(t0);
    }
    t0 = Clock::now();
    benchmark::DoNotOptimize(server.finish());
    server_s += since(t0);
  }
  const double rounds = static_cast<double>(st.iterations());
  st.counters["client_ms"] = 1e3 * client_s / rounds / cfg.num_clients;
  st.counters["server_ms"] = 1e3 * server_s / rounds;
}

// 100k elements (a 400 KB update). k = 16 stays fixed as the round grows; the complete graph is run where it fits a
// few seconds. One round a repetition, five repetitions: the _median rows are what to quote (one round alone was
// one sample of a noisy machine).
BENCHMARK(BM_SecAggRound)
    ->ArgsProduct({{100, 200}, {0, 16}, {100000}})
    ->Args({400, 16, 100000})
    ->Args({800, 16, 100000})
    ->Iterations(1)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_MAIN();
