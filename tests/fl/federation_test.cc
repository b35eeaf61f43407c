// The federation's round protocol on in-process ranks with a toy model: client k's "training" moves the weights a
// fixed fraction towards a target of its own, so every round's aggregate has a closed form. (Each step is plain SGD on
// f_k(y) = (0.05 / lr) |y - target_k|^2: gradient (0.1 / lr)(y - target_k), which SCAFFOLD's correction adds to.)
#include "fl/federation.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../coll/transport_pair.h"
#include "../error_of.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "core/log.h"
#include "fl/checkpoint.h"
#include "fl/partition.h"
#include "fl/privacy.h"
#include "fl/secagg.h"
#include "fl/server_opt.h"

namespace conduit::fl {
namespace {

using conduit::test::error_of;

constexpr size_t kDim = 37;
constexpr int kSamples = 400;
size_t g_dim = kDim;     // the toy model's size (a test may raise it for statistics)
double g_spread = 0.01;  // how far apart the clients' targets lie (a test may raise it)
// The step limit each (round, client) was given (LocalWork::max_steps; 0: full work), as the toy saw it (its seed
// carries both: seed ^ round << 32 ^ client).
std::mutex g_limits_mu;
std::map<std::pair<int, int>, int64_t> g_limits;

// The client whose partition starts with sample `first` (partitions are disjoint: the first index names it).
float target(int64_t first, size_t i) {
  return 0.5f * std::sin(0.3f + float(g_spread) * float(first) + 0.7f * float(i));
}
double toy_loss(int64_t first) { return 0.5 + 0.1 * double(first % 7); }

class ToyTrainer : public LocalTrainer {
 public:
  explicit ToyTrainer(const FlConfig& c) : c_(c) {}
  std::vector<float> initial_weights() override { return std::vector<float>(g_dim, 0.0f); }
  std::vector<int64_t> train_labels() override {
    if (load_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(load_ms_));
    std::vector<int64_t> l(kSamples);
    for (int i = 0; i < kSamples; ++i) l[size_t(i)] = (i + label_shift_) % 10;
    return l;
  }
  int num_classes() override { return 10; }
  LocalResult train(const std::vector<float>& global, const std::vector<int64_t>& idx, const LocalWork& w) override {
    if (fail_ && trained_++ >= fail_after_) throw Error("toy: local training failed on purpose");
    if (sleep_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    {
      const uint64_t s = w.seed ^ c_.seed;
      std::lock_guard<std::mutex> lk(g_limits_mu);
      g_limits[{int(s >> 32), int(s & 0xffffffffu)}] = w.max_steps;
    }
    LocalResult r;
    r.examples = int64_t(idx.size());
    const int64_t full = c_.local_epochs * ((r.examples + c_.batch_size - 1) / c_.batch_size);
    r.steps = w.max_steps > 0 ? std::min(w.max_steps, full) : full;
    r.loss = toy_loss(idx.front());
    r.compute_s = 1e-4 * double(r.steps);
    // Each step closes 10% of the gap to the client's target (less lr times SCAFFOLD's correction): after K steps
    // y - x = (1 - 0.9^K) (target - x - 10 lr corr).
    const double keep = std::pow(0.9, double(r.steps));
    r.delta.resize(g_dim);
    for (size_t i = 0; i < g_dim; ++i) {
      const double corr = w.correction ? double((*w.correction)[i]) : 0.0;
      r.delta[i] = float((1 - keep) * (target(idx.front(), i) - global[i] - 10 * c_.lr * corr));
    }
    return r;
  }
  EvalResult evaluate(const std::vector<float>& w) override {
    evaluated_ = w;
    return {0.5, 1.0};
  }
  bool fail_ = false;
  int fail_after_ = 0;  // trainings that succeed before it fails
  int trained_ = 0;
  int sleep_ms_ = 0;  // each training takes at least this long
  int load_ms_ = 0;   // loading the labels (the data) takes at least this long
  int label_shift_ = 0;  // another copy of the data: the same size, other labels
  std::vector<float> evaluated_;

 private:
  FlConfig c_;
};

FlConfig base_config() {
  FlConfig c;
  c.clients = 12;
  c.fraction = 0.5;
  c.min_clients = 2;
  c.rounds = 3;
  c.partition = "iid";
  c.batch_size = 8;
  c.workers = 3;
  c.output = "";
  c.progress = false;
  c.timeout_s = 20;
  c.secagg = false;
  c.eval_every = 0;
  return c;
}

struct RunResult {
  FlResult server;
  std::vector<RoundRecord> records;  // as the server reported them (kept when it throws at the end)
  std::vector<float> evaluated;      // the weights the server evaluated last
  std::vector<std::string> errors;
};

// per_rank: changes a rank's own settings (ranks that drew otherwise from one seed, as on another standard library).
RunResult run(const FlConfig& c, int fail_rank = -1, int fail_after = 0, int slow_rank = -1, int slow_load_ms = 0,
              int odd_data_rank = -1, const std::function<void(int, FlConfig&)>& per_rank = {}) {
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  cc.measure_cost_model = false;
  auto comms = coll::Communicator::inproc(c.workers, 0, cc);
  RunResult out;
  out.errors.resize(size_t(c.workers));
  std::vector<std::thread> ts;
  for (int r = 0; r < c.workers; ++r)
    ts.emplace_back([&, r] {
      FlConfig mine = c;
      if (per_rank) per_rank(r, mine);
      ToyTrainer t(mine);
      t.fail_ = r == fail_rank;
      t.fail_after_ = fail_after;
      if (r == slow_rank) t.load_ms_ = slow_load_ms;
      if (r == odd_data_rank) t.label_shift_ = 3;
      try {
        FlResult res =
            run_federation(mine, comms[size_t(r)], t, [&](const RoundRecord& x) { out.records.push_back(x); });
        if (r == 0) out.server = std::move(res);
      } catch (const std::exception& e) {
        out.errors[size_t(r)] = e.what();
      }
      if (r == 0) out.evaluated = t.evaluated_;
    });
  for (auto& t : ts) t.join();
  return out;
}

// What conduit's logger writes (every rank's thread) while it lives.
class LoggedLines {
 public:
  LoggedLines() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    conduit::logger().sinks().push_back(sink_);
  }
  ~LoggedLines() {
    auto& s = conduit::logger().sinks();
    s.erase(std::remove(s.begin(), s.end(), sink_), s.end());
  }
  std::string text() {
    sink_->flush();
    return out_.str();
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

void expect_ok(const RunResult& r) {
  for (size_t i = 0; i < r.errors.size(); ++i) EXPECT_EQ(r.errors[i], "") << "rank " << i;
}

// Runs `c` for 2 rounds, checkpointed after round 2 in `dir`/first, and returns it set to resume from there for
// `rounds` rounds in all, without checkpoints or an output folder of its own.
FlConfig resuming_after_two_rounds(FlConfig c, const std::string& dir, int rounds) {
  c.rounds = 2;
  c.checkpoint_every = 2;
  c.output = dir + "/first";
  expect_ok(run(c));
  c.rounds = rounds;
  c.checkpoint_every = 0;
  c.resume = dir + "/first";
  c.output = "";
  return c;
}

// The plain FedAvg of one round from `global`: sum_k n_k delta_k / sum_k n_k over the sampled clients that send.
std::vector<float> fedavg_round(const FlConfig& c, const std::vector<float>& global, int round,
                                const std::vector<int>& excluded = {}) {
  ToyTrainer t(c);
  auto labels = t.train_labels();
  auto parts = partition(labels, 10, c.clients, parse_partition(c.partition), c.seed);
  auto sampled = sample_clients(c.clients, c.fraction, c.min_clients, c.seed, uint64_t(round));
  std::vector<double> sum(global.size(), 0.0);
  double wsum = 0;
  for (int k : sampled) {
    if (std::find(excluded.begin(), excluded.end(), k) != excluded.end()) continue;
    LocalResult r = t.train(global, parts[size_t(k)], {});
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += double(r.examples) * r.delta[i];
    wsum += double(r.examples);
  }
  std::vector<float> w = global;
  for (size_t i = 0; i < sum.size(); ++i) w[i] += float(sum[i] / wsum);
  return w;
}

TEST(Federation, PlainFedAvgIsTheSampleWeightedAverageOfTheClientsUpdates) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";  // unequal partition sizes: the weights matter
  RunResult r = run(c);
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 3u);
  std::vector<float> w(kDim, 0.0f);
  for (int round = 0; round < 3; ++round) w = fedavg_round(c, w, round);
  ASSERT_EQ(r.server.weights.size(), kDim);
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], w[i], 1e-5) << i;
  EXPECT_EQ(r.server.rounds[0].sampled, 6);
  EXPECT_EQ(r.server.rounds[0].aggregated, 6);
  EXPECT_GT(r.server.rounds[0].bytes_up, 6 * (kDim + 1) * 4);
  EXPECT_GT(r.server.label_tv_distance, 0.1);
}

TEST(Federation, SecureAggregationGivesThePlainAverageWithinItsQuantization) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.secagg = true;
  c.secagg_clip = 4.0;
  RunResult r = run(c);
  expect_ok(r);
  std::vector<float> w(kDim, 0.0f);
  for (int round = 0; round < 3; ++round) w = fedavg_round(c, w, round);
  // 32 bits over 6 summands of |x| <= 4: a level is 4 / (2^31 / 6) ~ 1.1e-8, within float rounding of the weights.
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], w[i], 1e-6) << i;
  EXPECT_EQ(r.server.rounds[2].aggregated, 6);
  EXPECT_EQ(r.server.rounds[2].clipped, 0u);
}

// The masked loss and clipped-count elements: their sums decode to the clients' mean loss and total count.
TEST(Federation, SecureAggregationSumsTheLossesAndTheClippedCounts) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.secagg = true;
  c.secagg_clip = 0.05;  // below many of the weighted deltas
  c.rounds = 1;
  RunResult r = run(c);
  expect_ok(r);
  ToyTrainer t(c);
  auto parts = partition(t.train_labels(), 10, c.clients, parse_partition(c.partition), c.seed);
  const double mean = double(kSamples) / c.clients;
  double loss = 0;
  uint64_t clipped = 0;
  auto sampled = sample_clients(c.clients, c.fraction, c.min_clients, c.seed, 0);
  for (int k : sampled) {
    LocalResult lr = t.train(std::vector<float>(kDim, 0.0f), parts[size_t(k)], {});
    loss += lr.loss;
    const double w = double(lr.examples) / mean;
    for (float d : lr.delta) clipped += std::abs(float(w * d)) > c.secagg_clip ? 1 : 0;
  }
  ASSERT_GT(clipped, 0u);
  EXPECT_EQ(r.server.rounds[0].clipped, clipped);
  EXPECT_NEAR(r.server.rounds[0].train_loss, loss / double(sampled.size()), 1e-5);
}

// At 8 bits the clipped count was one more element scaled into the codec's range: a level was 9% of a client's
// elements (1.9 of the toy's 37 with 6 clients), and the >1% warning allowed a level a client of slack, 5% of the
// round's elements, so 4% clipped went unwarned (the audit's repro: 9.4% at 8 bits with 10 clients). The count now
// travels exactly: 9 of 222 elements clipped are counted and warned about, 2 (0.9%) counted and not, 0 neither.
TEST(Federation, EightBitSecureAggregationCountsTheClippedElementsExactlyAndWarnsAboveOnePercent) {
  FlConfig c = base_config();
  c.secagg = true;
  c.secagg_bits = 8;
  c.rounds = 1;
  ToyTrainer t(c);
  auto parts = partition(t.train_labels(), 10, c.clients, parse_partition(c.partition), c.seed);
  const double mean = double(kSamples) / c.clients;
  std::vector<float> mags;  // the round's weighted update elements' magnitudes, largest first
  for (int k : sample_clients(c.clients, c.fraction, c.min_clients, c.seed, 0)) {
    LocalResult lr = t.train(std::vector<float>(kDim, 0.0f), parts[size_t(k)], {});
    const double w = double(lr.examples) / mean;
    for (float d : lr.delta) mags.push_back(std::abs(float(w * d)));
  }
  ASSERT_EQ(mags.size(), 6 * kDim);
  std::sort(mags.rbegin(), mags.rend());
  for (size_t want : {9, 2, 0}) {
    // `want` elements above the clip (between two of them: no element at it)
    c.secagg_clip = want == 0 ? 2.0 * mags[0] : (double(mags[want - 1]) + double(mags[want])) / 2;
    if (want > 0) {
      ASSERT_GT(mags[want - 1], mags[want]) << "a tie at the clip";
    }
    LoggedLines log;
    RunResult r = run(c);
    expect_ok(r);
    ASSERT_EQ(r.server.rounds.size(), 1u);
    EXPECT_EQ(r.server.rounds[0].aggregated, 6);
    EXPECT_EQ(r.server.rounds[0].clipped, want);
    const std::string warned = fmt::format("fl: round 1: {:.1f}% of the update elements exceeded --secagg-clip",
                                           100.0 * double(want) / double(6 * kDim));
    EXPECT_EQ(log.text().find(warned) != std::string::npos, want * 100 > 6 * kDim) << want << ": " << log.text();
  }
}

TEST(Federation, SixteenBitSecureAggregationHalvesTheUploadAndStaysClose) {
  FlConfig c = base_config();
  c.secagg = true;
  c.secagg_clip = 2.0;
  c.rounds = 1;
  RunResult r32 = run(c);
  c.secagg_bits = 16;
  RunResult r16 = run(c);
  expect_ok(r32);
  expect_ok(r16);
  // Keys and shares are the same size; each element (the model's and the loss and clipped-count ones) is 2 bytes
  // instead of 4.
  EXPECT_EQ(r32.server.bytes_up - r16.server.bytes_up, 6 * (kDim + 2) * 2);
  std::vector<float> w = fedavg_round(c, std::vector<float>(kDim, 0.0f), 0);
  // 16 bits over 6 summands of |x| <= 2: a step of about 2 * 6 * 2 / 2^15.
  // 16 bits over 6 summands of |x| <= 2: L = 32767 / 6 = 5461 levels, a step of 2 / 5460; six clients' rounding
  // errors of under a step each, divided by their summed weight (about 6).
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r16.server.weights[i], w[i], 6 * (2.0 / 5460) / 5) << i;
}

TEST(Federation, DropoutsAreLeftOutAndSecureAggregationRecoversTheirMasks) {
  FlConfig c = base_config();
  c.fraction = 1.0;  // 12 a round, t = 7
  c.dropout = 0.25;
  c.rounds = 4;
  c.secagg = true;
  c.secagg_clip = 4.0;
  RunResult masked = run(c);
  c.secagg = false;
  RunResult plain = run(c);
  expect_ok(masked);
  expect_ok(plain);
  int dropouts = 0;
  for (size_t k = 0; k < masked.server.rounds.size(); ++k) {
    const auto& m = masked.server.rounds[k];
    dropouts += m.dropouts;
    EXPECT_EQ(m.dropouts, plain.server.rounds[k].dropouts);  // the same clients leave (seeded)
    EXPECT_FALSE(m.abandoned) << "round " << k << ": " << m.sampled - m.dropouts << " survivors";
    if (!m.abandoned) {
      EXPECT_EQ(m.aggregated, m.sampled - m.dropouts);
    }
  }
  EXPECT_GT(dropouts, 0) << "the seed gave no dropout: the test checks nothing";
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(masked.server.weights[i], plain.server.weights[i], 1e-4) << i;
}

// 24 clients, all sampled every round, 10% dropping out, under secure aggregation.
FlConfig every_client_masked() {
  FlConfig c = base_config();
  c.clients = 24;
  c.fraction = 1.0;
  c.dropout = 0.1;
  c.secagg = true;
  c.secagg_clip = 4.0;
  return c;
}

// SecAgg+: the sum is exact in the field whichever pairs mask one another, so a sparse graph gives the complete
// graph's weights bit for bit, with each client's key shares going to 6 neighbours instead of the other 23.
TEST(Federation, SecAggPlusGivesTheCompleteGraphsWeightsWithFewerShares) {
  FlConfig c = every_client_masked();
  c.rounds = 3;
  c.secagg_threshold = 0.5;  // t = 4 of each client's 7 (SecAgg+), 13 of 24 (every pair)
  c.secagg_neighbors = 6;
  RunResult sparse = run(c);
  c.secagg_neighbors = 0;
  RunResult full = run(c);
  c.secagg_neighbors = 24;  // more than a round's 24 - 2: every pair
  RunResult wide = run(c);
  expect_ok(sparse);
  expect_ok(full);
  expect_ok(wide);
  ASSERT_EQ(wide.server.rounds.size(), 3u);
  ASSERT_EQ(sparse.server.rounds.size(), 3u);
  ASSERT_EQ(full.server.rounds.size(), 3u);
  int dropouts = 0;
  for (size_t k = 0; k < 3; ++k) {
    const auto& s = sparse.server.rounds[k];
    const auto& f = full.server.rounds[k];
    dropouts += s.dropouts;
    ASSERT_LE(s.dropouts, 3) << "round " << k << ": the seed lets a neighbourhood of 7 lose 4";
    EXPECT_FALSE(s.abandoned) << "round " << k;
    EXPECT_EQ(s.aggregated, f.aggregated) << "round " << k;
    // 17 fewer 126-byte shares from each of the 24 clients (and fewer unmasking shares).
    EXPECT_GE(f.bytes_up, s.bytes_up + 24 * 17 * kShareMsgBytes) << "round " << k;
    EXPECT_GE(f.bytes_down, s.bytes_down + 24 * 17 * kShareMsgBytes) << "round " << k;
    EXPECT_EQ(wide.server.rounds[k].bytes_up, f.bytes_up) << "round " << k;
    EXPECT_EQ(wide.server.rounds[k].bytes_down, f.bytes_down) << "round " << k;
  }
  EXPECT_EQ(wide.server.weights, full.server.weights);
  EXPECT_GT(dropouts, 0) << "the seed gave no dropout: the unmasking of dropped clients is not exercised";
  EXPECT_EQ(sparse.server.weights, full.server.weights);
}

// --secagg-neighbors auto: each round's k from choose_neighbors for its clients, recorded per round; the weights are
// every pair's (the sum is exact), with fewer shares.
TEST(Federation, SecAggPlusAutoChoosesKForTheRound) {
  FlConfig c = every_client_masked();
  c.rounds = 3;
  c.secagg_neighbors = -1;
  c.secagg_max_corrupt = 0.05;
  c.secagg_max_dropout = 0.2;
  const int k = choose_neighbors(24, 0.05, 0.2, c.secagg_threshold);
  ASSERT_GT(k, 0);
  ASSERT_LE(k, 22);
  RunResult sparse = run(c);
  c.secagg_neighbors = 0;
  RunResult full = run(c);
  expect_ok(sparse);
  expect_ok(full);
  ASSERT_EQ(sparse.records.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const auto& s = sparse.records[i];
    EXPECT_EQ(s.secagg_neighbors, k) << "round " << s.round;
    EXPECT_EQ(full.records[i].secagg_neighbors, 0) << "round " << s.round;
    ASSERT_LE(s.dropouts, 4) << "round " << s.round << ": the seed drops more than the graph was chosen for";
    EXPECT_FALSE(s.abandoned) << "round " << s.round;
    EXPECT_LT(s.bytes_up, full.records[i].bytes_up) << "round " << s.round;
  }
  EXPECT_EQ(sparse.server.weights, full.server.weights);
}

// With t = 5 of each client's 5 (k = 4, threshold 0.9) one dropout abandons the round through its neighbours'
// check, though far more than t clients sent in all.
TEST(Federation, SecAggPlusAbandonsARoundWhenANeighbourhoodKeepsFewerThanT) {
  FlConfig c = every_client_masked();
  c.rounds = 4;
  c.secagg_threshold = 0.9;
  c.secagg_neighbors = 4;
  RunResult r = run(c);
  ASSERT_EQ(r.records.size(), 4u) << r.errors[0];
  int abandoned = 0;
  for (const auto& x : r.records) {
    EXPECT_EQ(x.abandoned, x.dropouts > 0) << "round " << x.round << ": " << x.dropouts << " dropouts";
    EXPECT_EQ(x.aggregated, x.abandoned ? 0 : x.sampled) << "round " << x.round;
    abandoned += x.abandoned ? 1 : 0;
  }
  EXPECT_GT(abandoned, 0) << "the seed gave no dropout: the test checks nothing";
  EXPECT_EQ(r.errors[1], "");
  EXPECT_EQ(r.errors[2], "");
}

// A host loading its data 3 s after the others, under a 0.5 s deadline: the ranks meet after loading under start-up's
// deadline (CONDUIT_TIMEOUT), so the server's first message (the round's header, one step: "could not hand its
// message ... within 0.5 s" without the meeting) does not time out behind it.
TEST(Federation, AHostSlowToLoadItsDataDoesNotTimeTheServerOut) {
  const char* was = std::getenv("CONDUIT_TIMEOUT");  // (start-up's deadline must outlast the 3 s)
  const std::string saved = was ? was : "";
  setenv("CONDUIT_TIMEOUT", "30", 1);
  FlConfig c = base_config();
  c.secagg = true;
  c.secagg_clip = 4.0;
  c.timeout_s = 1.0;  // (a third of the slow load; the round's ordinary hand-offs under 0.5 s failed on a busy machine)
  c.rounds = 1;
  RunResult r = run(c, -1, 0, /*slow_rank=*/2, /*slow_load_ms=*/3000);
  if (was)
    setenv("CONDUIT_TIMEOUT", saved.c_str(), 1);
  else
    unsetenv("CONDUIT_TIMEOUT");
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 1u);
  EXPECT_EQ(r.server.rounds[0].aggregated, 6);
}

// A host that read another copy of the data would split the clients otherwise than the server: every rank stops at
// the meeting after loading, naming it.
TEST(Federation, AHostWithOtherDataStopsEveryRankNamingIt) {
  FlConfig c = base_config();
  RunResult r = run(c, -1, 0, -1, 0, /*odd_data_rank=*/2);
  for (size_t i = 0; i < r.errors.size(); ++i) {
    EXPECT_NE(r.errors[i].find("fl: rank(s) 2 loaded other training labels or a model of another size than rank 0 "
                               "(rank 0: 400 samples"),
              std::string::npos)
        << "rank " << i << ": " << r.errors[i];
  }
  EXPECT_TRUE(r.records.empty());
}

// The partition, the speed factors and the dropouts come from std's gamma, normal and uniform_real distributions,
// whose algorithms are implementation-defined: ranks built on other standard libraries can draw them otherwise from
// one seed, and the clients' samples and outcomes would differ between the server and their hosts without a word.
// Every rank stops at start-up naming both hashes. (A rank given another Dirichlet concentration, or another speed
// spread, stands in for another library's draws.)
TEST(Federation, ARankThatDrewAnotherPartitionOrOtherSpeedsStopsEveryRankNamingBothHashes) {
  for (int which : {0, 1}) {
    SCOPED_TRACE(which == 0 ? "partition" : "speeds");
    FlConfig c = base_config();
    c.partition = "dirichlet:0.5";
    c.speed_sigma = 0.5;
    c.dropout = 0.1;
    RunResult r = run(c, -1, 0, -1, 0, -1, [&](int rank, FlConfig& mine) {
      if (rank != 2) return;
      if (which == 0) mine.partition = "dirichlet:0.6";
      if (which == 1) mine.speed_sigma = 0.6;
    });
    for (size_t i = 0; i < r.errors.size(); ++i) {
      const std::string& e = r.errors[i];
      EXPECT_NE(e.find("fl: rank(s) 2 drew another partition of the clients, or other speed factors or dropouts, than "
                       "rank 0 from the same seed and settings (rank 0: partition "),
                std::string::npos)
          << "rank " << i << ": " << e;
      EXPECT_NE(e.find("; rank 2: "), std::string::npos) << "rank " << i << ": " << e;
      EXPECT_NE(e.find("different C++ standard libraries"), std::string::npos) << "rank " << i << ": " << e;
    }
    EXPECT_TRUE(r.records.empty());
  }
  // The same draws on every rank: the run goes on.
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.speed_sigma = 0.5;
  c.dropout = 0.1;
  expect_ok(run(c));
}

TEST(Federation, TooFewSurvivorsAbandonTheRoundAndTheWeightsStay) {
  FlConfig c = base_config();
  c.secagg = true;
  c.dropout = 0.85;
  c.rounds = 4;
  RunResult r = run(c);
  // Nothing was ever applied: the server says so after releasing the hosts, which end cleanly.
  EXPECT_NE(r.errors[0].find("none of the 4 rounds aggregated an update"), std::string::npos) << r.errors[0];
  EXPECT_EQ(r.errors[1], "");
  EXPECT_EQ(r.errors[2], "");
  int abandoned = 0;
  ASSERT_EQ(r.records.size(), 4u);
  for (auto& x : r.records) {
    if (!x.abandoned) continue;
    ++abandoned;
    EXPECT_EQ(x.aggregated, 0);
    EXPECT_LT(x.sampled - x.dropouts, 4);  // t = floor(6 / 2) + 1
    EXPECT_EQ(x.abandon_reason, fmt::format("{} of 6 sent, fewer than the threshold 4", x.sampled - x.dropouts));
  }
  // This seed leaves fewer than t = 4 of the 6 in every round: nothing was ever applied.
  ASSERT_EQ(abandoned, 4);
  ASSERT_EQ(r.evaluated.size(), kDim);
  for (float v : r.evaluated) EXPECT_EQ(v, 0.0f);
}

// The threshold's boundary: a round in which exactly t = 4 of the 6 sampled send is applied, one with t - 1 is
// abandoned. The seeds are tried in order until both kinds of round have been seen.
TEST(Federation, SecureAggregationAppliesARoundOfExactlyTSendersAndAbandonsOneOfTMinusOne) {
  bool seen_t = false, seen_below = false;
  for (uint64_t seed = 1; seed <= 60 && !(seen_t && seen_below); ++seed) {
    FlConfig c = base_config();
    c.secagg = true;
    c.dropout = 0.35;
    c.rounds = 4;
    c.seed = seed;
    RunResult r = run(c);
    ASSERT_EQ(r.records.size(), 4u) << "seed " << seed << ": " << r.errors[0];
    for (const RoundRecord& x : r.records) {
      const int senders = x.sampled - x.dropouts;
      if (senders == 4) {
        seen_t = true;
        EXPECT_FALSE(x.abandoned) << "seed " << seed << " round " << x.round;
        EXPECT_EQ(x.aggregated, 4) << "seed " << seed << " round " << x.round;
      } else if (senders == 3) {
        seen_below = true;
        EXPECT_TRUE(x.abandoned) << "seed " << seed << " round " << x.round;
        EXPECT_EQ(x.aggregated, 0) << "seed " << seed << " round " << x.round;
      }
    }
  }
  EXPECT_TRUE(seen_t && seen_below) << "no seed gave both a round of t senders and one of t - 1";
}

// A round secure aggregation abandons aggregates nobody: it reported 0 aggregated and still counted the clients of it
// that did partial work (partial > aggregated). The seeds are tried in order until an abandoned round held one.
TEST(Federation, AnAbandonedRoundReportsNoPartialWork) {
  bool seen = false;
  for (uint64_t seed = 1; seed <= 30 && !seen; ++seed) {
    FlConfig c = base_config();
    c.seed = seed;
    c.secagg = true;
    c.secagg_clip = 4.0;
    c.secagg_threshold = 1.0;  // (every sampled client must send: a dropout abandons the round)
    c.dropout = 0.15;
    c.batch_size = 4;  // several steps a client, so a limit cuts some
    c.speed_sigma = 1.0;
    c.deadline = 1.0;
    c.stragglers = "partial";
    c.rounds = 4;
    {
      std::lock_guard<std::mutex> lk(g_limits_mu);
      g_limits.clear();
    }
    RunResult r = run(c);
    ASSERT_EQ(r.records.size(), 4u) << "seed " << seed << ": " << r.errors[0];
    std::map<int, int> cut;  // round (from 0) -> clients that trained with a step limit (sent partial work)
    {
      std::lock_guard<std::mutex> lk(g_limits_mu);
      for (auto& [key, limit] : g_limits) cut[key.first] += limit > 0 ? 1 : 0;
    }
    for (const RoundRecord& x : r.records) {
      if (!x.abandoned) {
        EXPECT_EQ(x.partial, cut[x.round - 1]) << "seed " << seed << " round " << x.round;
        continue;
      }
      EXPECT_EQ(x.aggregated, 0) << "seed " << seed << " round " << x.round;
      EXPECT_EQ(x.partial, 0) << "seed " << seed << " round " << x.round;
      seen = seen || cut[x.round - 1] > 0;
    }
  }
  EXPECT_TRUE(seen) << "no seed gave an abandoned round with partial work in it: the test checks nothing";
}

TEST(Federation, StragglersPastTheDeadlineDropOrDoPartialWork) {
  FlConfig c = base_config();
  c.speed_sigma = 1.0;
  c.deadline = 1.0;
  c.stragglers = "drop";
  c.downlink_mbps = c.uplink_mbps = 1e9;  // (the links' terms vanish: the modelled time is the steps')
  RunResult dropped = run(c);
  c.stragglers = "partial";
  RunResult partial = run(c);
  expect_ok(dropped);
  expect_ok(partial);
  int stragglers = 0, parts = 0, too_slow = 0;
  for (size_t k = 0; k < 3; ++k) {
    stragglers += dropped.server.rounds[k].stragglers;
    parts += partial.server.rounds[k].partial;
    // (partial work drops only a client too slow for one step: PartialWorkDropsAClientTooSlowForOneStep)
    too_slow += partial.server.rounds[k].stragglers;
    EXPECT_EQ(partial.server.rounds[k].aggregated + partial.server.rounds[k].stragglers,
              partial.server.rounds[k].sampled);
    // A dropped straggler keeps the server waiting until the deadline: deadline x reference steps x 1e-4 s a step
    // (400 / 12 samples in batches of 8: 5 steps), and every client it aggregates fits the deadline.
    if (dropped.server.rounds[k].stragglers > 0) {
      EXPECT_NEAR(dropped.server.rounds[k].modelled_s, 1.0 * 5 * 1e-4, 1e-8) << k;
    }
  }
  EXPECT_GT(parts, 0);
  EXPECT_EQ(stragglers, parts + too_slow);  // the same slow clients: dropped in one run, cut short in the other
}

// A deadline shorter than one step of a slow client: partial work cannot cut it to a step that fits, so it is a
// straggler in either mode (it did one step, counted as neither, and the round was modelled past its deadline).
TEST(Federation, PartialWorkDropsAClientTooSlowForOneStep) {
  FlConfig c = base_config();
  c.speed_sigma = 1.0;
  c.deadline = 0.2;  // 0.2 x 5 reference steps: one step of a speed-1 client
  c.stragglers = "partial";
  c.downlink_mbps = c.uplink_mbps = 1e9;
  RunResult r = run(c);
  expect_ok(r);
  int stragglers = 0;
  for (const auto& x : r.server.rounds) {
    stragglers += x.stragglers;
    EXPECT_EQ(x.aggregated + x.stragglers, x.sampled) << "round " << x.round;
    // Every client aggregated or waited for fits the deadline: 1 step x 1e-4 s (and the links' 1e-9-scale terms).
    EXPECT_LE(x.modelled_s, 0.2 * 5 * 1e-4 + 1e-6) << "round " << x.round;
  }
  EXPECT_GT(stragglers, 0) << "the seed gave no client slower than speed 1: nothing was checked";
}

// What the clients download is counted as a deployed federation sends it, a copy to each client, whatever the number
// of processes hosting them (the weights went once to each host process: 2 hosts counted 2 copies of the weights for
// 6 clients, and 5 hosts 5); the processes' own traffic is wire_bytes_down.
// Secure aggregation's lists and inboxes too (each client its own copy of the list of those who shared keys).
TEST(Federation, BytesDownCountEachClientsDownloadWhateverTheHosts) {
  for (bool secagg : {false, true}) {
    FlConfig c = base_config();
    c.secagg = secagg;
    c.workers = 3;
    RunResult two = run(c);
    c.workers = 6;
    RunResult five = run(c);
    expect_ok(two);
    expect_ok(five);
    ASSERT_EQ(two.server.rounds.size(), 3u);
    ASSERT_EQ(five.server.rounds.size(), 3u);
    uint64_t total = 0;
    for (size_t k = 0; k < 3; ++k) {
      const auto& a = two.server.rounds[k];
      const auto& b = five.server.rounds[k];
      EXPECT_EQ(a.bytes_down, b.bytes_down) << "round " << k << " secagg " << secagg;
      EXPECT_GE(a.bytes_down, uint64_t(a.sampled) * kDim * 4) << "round " << k;  // the weights, once a client
      EXPECT_LT(a.wire_bytes_down, a.bytes_down) << "round " << k;               // (2 hosts for 6 clients)
      EXPECT_GT(b.wire_bytes_down, a.wire_bytes_down) << "round " << k;
      total += a.bytes_down;
    }
    EXPECT_EQ(two.server.bytes_down, total);
  }
}

// (after 0 trainings: before its first update; after 1: with its first client's update already on its way)
TEST(Federation, AFailingClientHostStopsTheServerAtOnceWithItsError) {
  for (int after : {0, 1})
    for (bool secagg : {false, true}) {
      FlConfig c = base_config();
      c.timeout_s = 60;
      c.secagg = secagg;  // (with it, the host fails between the key exchange and the masked update)
      auto t0 = std::chrono::steady_clock::now();
      RunResult r = run(c, 2, after);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_NE(r.errors[2].find("failed on purpose"), std::string::npos) << r.errors[2];
      EXPECT_NE(r.errors[0].find("failed on purpose"), std::string::npos) << r.errors[0];
      EXPECT_NE(r.errors[1], "");
      EXPECT_LT(s, 30) << "the server waited for its deadline (secagg " << secagg << ", after " << after << ")";
    }
}

// Over tcp with updates larger than its unexpected-message budget: the failing host's sends are partly written
// while the server still takes the slow first host's updates, so its abort frame cannot follow them to the server;
// the other host hears it, and its own abort must reach the server, which waits on it (before the fix it did not,
// being sent only to peers not failed yet: the server waited its 6 x 60 s deadline). The reason must name the failure,
// not a truncated frame or a generic "stopped with sends in flight".
TEST(Federation, AHostFailingWithUpdatesInFlightOverTcpStopsTheServerWithItsReason) {
  setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "64K", 1);
  auto transports = net::test_util::make_transport_world("tcp", 3);
  unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
  g_dim = 100000;  // 400 KB updates
  struct Restore {
    ~Restore() { g_dim = kDim; }
  } restore;
  FlConfig c = base_config();
  c.timeout_s = 60;
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  cc.measure_cost_model = false;
  std::vector<std::string> errors(3);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      ToyTrainer t(c);
      if (r == 1) t.sleep_ms_ = 300;  // the server takes rank 1's first update first
      if (r == 2) {
        t.fail_ = true;
        t.fail_after_ = 2;  // two updates posted, the server not taking them yet
      }
      try {
        auto comm = coll::Communicator::create(transports[size_t(r)], {0, 1, 2}, 7, cc);
        run_federation(c, comm, t);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(errors[2].find("failed on purpose"), std::string::npos) << errors[2];
  EXPECT_NE(errors[0].find("failed on purpose"), std::string::npos) << errors[0];
  EXPECT_LT(s, 30) << "the server waited for its deadline";
}

// Forwards to a transport and records, per tag, the peer of each 8-byte receive (a frame's length) in the order
// they were posted.
class RecordingTransport : public net::Transport {
 public:
  explicit RecordingTransport(net::TransportPtr inner) : inner_(std::move(inner)) {
    rank_ = inner_->rank();
    size_ = inner_->size();
    hosts_ = inner_->hosts();
  }
  const char* name() const override { return inner_->name(); }
  net::RequestPtr isend(int peer, uint64_t tag, const void* p, size_t n) override {
    return inner_->isend(peer, tag, p, n);
  }
  net::RequestPtr irecv(int peer, uint64_t tag, void* p, size_t n) override {
    if (n == 8) {
      std::lock_guard<std::mutex> lk(mu_);
      lengths_[tag].push_back(peer);
    }
    return inner_->irecv(peer, tag, p, n);
  }
  void abort(const std::string& why) override { inner_->abort(why); }
  bool cancel(const net::RequestPtr& r, std::exception_ptr e) override { return inner_->cancel(r, e); }
  std::string aborted_reason() const override { return inner_->aborted_reason(); }
  // The peers of the tag received most often.
  std::vector<int> busiest() {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<int> most;
    for (auto& [tag, peers] : lengths_)
      if (peers.size() > most.size()) most = peers;
    return most;
  }

 private:
  net::TransportPtr inner_;
  std::mutex mu_;
  std::map<uint64_t, std::vector<int>> lengths_;
};

// A host keeps at most its window of updates posted: with 20 clients of 400 KB updates per host and a 1 MiB window,
// over tcp with a 64 KB unexpected-message budget and one host slower than the other, each host's peak stays within
// the window (8 MB without it), every update released was sent, the server takes the updates in turns (one of each
// host: a host's oldest is never behind the other's whole list), and the weights are exactly those of the run
// without a window.
TEST(Federation, AHostKeepsAtMostItsWindowOfUpdatesPosted) {
  g_dim = 100000;  // 400 KB updates
  struct Restore {
    ~Restore() { g_dim = kDim; }
  } restore;
  for (bool secagg : {false, true}) {
    SCOPED_TRACE(secagg ? "secure aggregation" : "plain");
    FlConfig c = base_config();
    c.clients = 40;
    c.fraction = 1.0;
    c.rounds = 2;
    c.secagg = secagg;
    c.secagg_threshold = 0.9;
    c.timeout_s = 60;
    std::vector<float> weights[2];
    uint64_t peaks[2][3] = {};
    for (int windowed : {0, 1}) {
      c.host_window_bytes_for_testing = windowed ? uint64_t(1) << 20 : 0;
      setenv("CONDUIT_TCP_UNEXPECTED_BYTES", "64K", 1);
      auto transports = net::test_util::make_transport_world("tcp", 3);
      unsetenv("CONDUIT_TCP_UNEXPECTED_BYTES");
      coll::CommConfig cc;
      cc.timeout_s = c.timeout_s;
      cc.measure_cost_model = false;
      auto recording = std::make_shared<RecordingTransport>(transports[0]);
      transports[0] = recording;
      std::vector<std::string> errors(3);
      std::vector<std::thread> ts;
      for (int r = 0; r < 3; ++r)
        ts.emplace_back([&, r] {
          ToyTrainer t(c);
          if (r == 1) t.sleep_ms_ = 20;  // the other host runs ahead, up to its window
          try {
            auto comm = coll::Communicator::create(transports[size_t(r)], {0, 1, 2}, 7, cc);
            FlResult res = run_federation(c, comm, t);
            peaks[windowed][r] = res.host_peak_posted_bytes;
            if (r == 0) weights[windowed] = res.weights;
          } catch (const std::exception& e) {
            errors[size_t(r)] = e.what();
          }
        });
      for (auto& t : ts) t.join();
      for (int r = 0; r < 3; ++r) EXPECT_EQ(errors[size_t(r)], "") << "rank " << r;
      const std::vector<int> updates = recording->busiest();  // the update messages: 40 a round
      ASSERT_EQ(updates.size(), 80u);
      for (size_t k = 0; k < updates.size(); ++k) EXPECT_EQ(updates[k], 1 + int(k % 2)) << k;
    }
    for (int r : {1, 2}) {
      EXPECT_GE(peaks[0][r], uint64_t(8000000)) << "rank " << r;  // the round's 20 updates
      EXPECT_LE(peaks[1][r], uint64_t(1) << 20) << "rank " << r;
      EXPECT_GE(peaks[1][r], uint64_t(800000)) << "rank " << r;  // two updates posted at once
    }
    ASSERT_EQ(weights[0].size(), g_dim);
    EXPECT_EQ(weights[0], weights[1]);
    if (!secagg) {
      std::vector<float> w(g_dim, 0.0f);
      for (int round = 0; round < 2; ++round) w = fedavg_round(c, w, round);
      for (size_t i = 0; i < g_dim; i += 997) EXPECT_NEAR(weights[1][i], w[i], 1e-5) << i;
    }
  }
}

TEST(Federation, ModelledRoundTimeIsTheSlowestClientsLinksAndSteps) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.rounds = 1;
  c.downlink_mbps = 8;
  c.uplink_mbps = 2;
  RunResult r = run(c);
  expect_ok(r);
  ToyTrainer t(c);
  auto parts = partition(t.train_labels(), 10, c.clients, parse_partition(c.partition), c.seed);
  int64_t most = 0;
  for (int k : sample_clients(c.clients, c.fraction, c.min_clients, c.seed, 0))
    most = std::max<int64_t>(most, (int64_t(parts[size_t(k)].size()) + 7) / 8);
  // Download of the weights, the slowest client's steps at the 1e-4 s a step the toy measured, upload of its update.
  const double want = kDim * 4 * 8 / 8e6 + double(most) * 1e-4 + kDim * 4 * 8 / 2e6;
  EXPECT_NEAR(r.server.rounds[0].modelled_s, want, 1e-9);
}

// Seconds one host's share step takes here: `per_host` clients, each agreeing keys with and encrypting shares for
// all `n`.
double share_step_seconds(int n, int per_host) {
  SecAggConfig s;
  s.num_clients = n;
  s.threshold = n / 2 + 1;
  s.length = kDim + 2;
  std::vector<SecAggClient> clients;
  std::vector<AdvertiseMsg> u1;
  clients.reserve(size_t(n));
  for (int i = 0; i < n; ++i) {
    clients.emplace_back(s, i);
    u1.push_back(clients.back().advertise());
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < per_host; ++i) clients[size_t(i)].share_keys(u1);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The key exchange's work grows with the clients a host runs times the round's clients (80 x 160 key agreements and
// share encryptions a host here): its waits span a host's work for each of its clients, as the updates' do. With
// one step each they failed at the first exchange under a timeout shorter than that work (a third of it here).
TEST(Federation, SecureAggregationsKeyExchangeWaitsSpanEachHostsClients) {
  const double share_s = share_step_seconds(160, 80);
  FlConfig c = base_config();
  c.clients = 160;
  c.fraction = 1.0;
  c.rounds = 1;
  c.partition = "iid";
  c.batch_size = 64;
  c.secagg = true;
  c.timeout_s = std::clamp(share_s / 3, 0.15, 0.5);
  if (share_s <= 2 * c.timeout_s)
    GTEST_SKIP() << "one host's share step takes " << share_s
                 << " s here: too quick for a timeout the rest of the run keeps to tell one step from many";
  RunResult r = run(c);
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 1u);
  EXPECT_EQ(r.server.rounds[0].aggregated, 160);
  const std::vector<float> w = fedavg_round(c, std::vector<float>(kDim, 0.0f), 0);
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], w[i], 1e-5) << i;
}

TEST(Federation, SecureAggregationWithIdleHostsAndDroppedHostsMatchesThePlainAverage) {
  FlConfig c = base_config();
  c.workers = 6;  // 5 hosts for 6 sampled clients a round: some hosts have none
  c.dropout = 0.15;
  c.rounds = 6;
  c.secagg = true;
  c.secagg_clip = 4.0;
  c.secagg_threshold = 0.5;
  RunResult masked = run(c);
  c.secagg = false;
  RunResult plain = run(c);
  expect_ok(masked);
  expect_ok(plain);
  int idle = 0;
  for (int round = 0; round < c.rounds; ++round) {
    std::set<int> busy;
    for (int k : sample_clients(c.clients, c.fraction, c.min_clients, c.seed, uint64_t(round))) busy.insert(1 + k % 5);
    idle += 5 - int(busy.size());
  }
  EXPECT_GT(idle, 0) << "every host had a client in every round: the test checks nothing";
  int dropouts = 0;
  for (size_t k = 0; k < masked.records.size(); ++k) {
    ASSERT_FALSE(masked.records[k].abandoned) << k;
    dropouts += masked.records[k].dropouts;
  }
  EXPECT_GT(dropouts, 0) << "nobody dropped out: the unmasking of dropped clients was not tested";
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(masked.server.weights[i], plain.server.weights[i], 1e-4) << i;
}

TEST(Federation, DifferentialPrivacyReportsAGrowingEpsilon) {
  FlConfig c = base_config();
  c.dp_clip = 0.5;
  c.dp_noise = 1.0;
  c.rounds = 3;
  RunResult r = run(c);
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 3u);
  EXPECT_GT(r.server.rounds[2].epsilon, r.server.rounds[1].epsilon);
  EXPECT_GT(r.server.rounds[1].epsilon, r.server.rounds[0].epsilon);
  // The accountant of noise z and rate q = fraction, one step a round (z != q: a swap would show).
  RdpAccountant a(1.0, 0.5);
  for (int k = 0; k < 3; ++k) {
    a.step(1);
    EXPECT_DOUBLE_EQ(r.server.rounds[size_t(k)].epsilon, a.epsilon(c.dp_delta)) << k;
  }
  EXPECT_EQ(r.server.rounds[0].train_loss, -1);  // withheld: it is not covered by the accounting
}

TEST(Federation, DpNoiseIsSecretAndAppliedAlsoWhenNobodySent) {
  FlConfig c = base_config();
  c.dp_clip = 0.5;
  c.dp_noise = 1.0;
  // Poisson sampling from the secret seed samples nobody in a round with probability 0.5^12: with 3 rounds a run
  // aggregates nothing (and fails) with probability 2^-36, where one round failed one CI run in 4096.
  c.rounds = 3;
  RunResult a = run(c), b = run(c);  // the secret seed from the OS: two runs differ
  expect_ok(a);
  expect_ok(b);
  EXPECT_NE(a.server.weights, b.server.weights);
  c.rounds = 1;
  c.dropout = 0.99;  // nobody sends: the run fails at the end, but the noise was applied to the model
  RunResult none = run(c);
  EXPECT_NE(none.errors[0].find("none of the 1 rounds"), std::string::npos) << none.errors[0];
  ASSERT_EQ(none.records.size(), 1u);
  EXPECT_EQ(none.records[0].aggregated, 0);
  double norm = 0;
  for (float v : none.evaluated) norm += double(v) * v;
  EXPECT_GT(norm, 0) << "no noise on an empty round: an observer of the model learns nobody took part";
}

// Without secure aggregation the server sees each update in the clear and holds it to dp_clip, the sensitivity the
// noise and the accountant rest on: a host that does not clip is refused, naming it (its updates were summed).
TEST(Federation, DpRefusesAnUpdateAboveTheClip) {
  FlConfig c = base_config();
  c.dp_clip = 1e-4;  // every update's norm is above it
  c.dp_noise = 1.0;
  c.rounds = 2;
  c.dp_secret_seed_for_testing = 7;
  RunResult honest = run(c);
  expect_ok(honest);
  c.dp_unclipped_for_testing = true;
  RunResult r = run(c);
  EXPECT_NE(r.errors[0].find("sent an update for client"), std::string::npos) << r.errors[0];
  EXPECT_NE(r.errors[0].find("allowed: at most --dp-clip 0.0001"), std::string::npos) << r.errors[0];
}

// Under DP a client clips to dp_clip less secure aggregation's rounding (sqrt(n) levels of secagg_clip / (L - 1) in
// L2). A secagg_clip above dp_clip is range no element of an update of norm dp_clip uses: the error and the warning
// name it first (they named only a larger --dp-clip, which raises the noise, or more bits).
TEST(Federation, DpUnderSecureAggregationNamesTheSecaggClipWhenRoundingTakesTheBound) {
  FlConfig c = base_config();
  c.secagg = true;
  c.secagg_bits = 8;
  c.dp_clip = 0.5;
  c.dp_noise = 1.0;
  c.rounds = 1;
  c.dp_secret_seed_for_testing = 7;
  // 8 bits for the 12 clients a Poisson round may hold: L = 127 / 12 = 10 levels, a step of secagg_clip / 9, and
  // sqrt(37) steps of secagg_clip 1 are 0.676 in L2, more than dp_clip.
  c.secagg_clip = 1.0;
  RunResult r = run(c);
  EXPECT_NE(r.errors[0].find("fl: dp_clip: 0.5 leaves no room for secure aggregation's rounding (0.676 in L2 for 37 "
                             "weights at 8 bits and --secagg-clip 1); allowed: a --secagg-clip of at most --dp-clip "
                             "0.5 (it is 1: an update clipped to L2 norm 0.5 has no element above it, so the rest of "
                             "the range only coarsens the rounding), or more --secagg-bits"),
            std::string::npos)
      << r.errors[0];
  c.secagg_clip = 0.5;  // 0.338 of rounding: 0.162 left, under nine tenths of dp_clip
  LoggedLines log;
  r = run(c);
  expect_ok(r);
  EXPECT_NE(log.text().find("fl: dp_clip: updates are clipped to 0.162, not 0.5 (secure aggregation's rounding at 8 "
                            "bits and --secagg-clip 0.5 takes the rest of the bound); to keep more of it, allowed: "
                            "more --secagg-bits, or a smaller --secagg-clip (elements above it are clipped)"),
            std::string::npos)
      << log.text();
}

// A dropout keeps the server waiting until the deadline, as a straggler does (it cannot tell who left before then),
// and so does a round abandoned for its dropouts: the modelled time was the slowest sender's.
TEST(Federation, ModelledRoundTimeRunsToTheDeadlineWhenAClientDropsOut) {
  FlConfig c = base_config();
  c.secagg = true;   // (t = 4 of 6: three dropouts abandon a round)
  c.deadline = 3.0;  // 3 x 5 reference steps x 1e-4 s; every client does 5 steps at speed 1: nobody straggles
  c.dropout = 0.25;
  c.rounds = 10;
  c.downlink_mbps = c.uplink_mbps = 1e9;  // (the links' terms vanish)
  RunResult r = run(c);
  expect_ok(r);
  ASSERT_EQ(r.records.size(), 10u);
  int dropped = 0, abandoned = 0, full = 0;
  for (const auto& x : r.records) {
    EXPECT_EQ(x.stragglers, 0) << x.round;
    if (x.dropouts == 0) {
      ++full;
      EXPECT_NEAR(x.modelled_s, 5 * 1e-4, 1e-8) << x.round;
    } else if (x.dropouts < x.sampled) {  // (someone sent: the round measured a step's seconds)
      ++(x.abandoned ? abandoned : dropped);
      EXPECT_NEAR(x.modelled_s, 3.0 * 5 * 1e-4, 1e-8) << x.round;
    }
  }
  EXPECT_GT(full, 0);
  EXPECT_GT(dropped, 0);
  EXPECT_GT(abandoned, 0);
}

// The noise is N(0, (z S)^2) on the sum, divided by the expected number of clients q N (not by how many sent).
void check_dp_noise(bool secagg) {
  struct Dim {
    Dim() { g_dim = 4000; }
    ~Dim() { g_dim = kDim; }
  } dim;
  FlConfig c = base_config();
  c.dp_clip = 0.5;
  c.dp_noise = 1.0;
  c.rounds = 1;
  c.dropout = 0.4;
  c.secagg = secagg;
  c.secagg_clip = 1.0;
  c.dp_secret_seed_for_testing = 101;  // the same clients sampled in both runs
  RunResult noisy = run(c);
  c.dp_noise = 0;
  RunResult quiet = run(c);
  expect_ok(noisy);
  expect_ok(quiet);
  ASSERT_EQ(noisy.server.weights.size(), g_dim);
  double s = 0, s2 = 0;
  for (size_t i = 0; i < g_dim; ++i) {
    const double d = double(noisy.server.weights[i]) - quiet.server.weights[i];
    s += d;
    s2 += d * d;
  }
  const double mean = s / double(g_dim), sd = std::sqrt(s2 / double(g_dim) - mean * mean);
  const double want = 1.0 * 0.5 / (0.5 * 12);
  EXPECT_NEAR(sd, want, 0.05 * want) << "secagg " << secagg;  // the sample sd's standard error is 1.1%
  EXPECT_NEAR(mean, 0, 5 * want / std::sqrt(double(g_dim)));
  // The seeds give a round whose senders are not q N = 6, so dividing by the senders would fail the sd check.
  const RoundRecord& r0 = noisy.server.rounds[0];
  EXPECT_FALSE(r0.abandoned);
  EXPECT_GT(r0.aggregated, 0);
  EXPECT_NE(r0.aggregated, 6) << "the test cannot tell the fixed denominator from the senders' count";
  EXPECT_NE(r0.sampled, 6) << "the test cannot tell the fixed denominator from the sampled count";
  // Clipping: the noiseless update is the clipped deltas' sum over q N, so its norm is at most senders x S / (q N).
  double qn = 0;
  for (float v : quiet.server.weights) qn += double(v) * v;
  EXPECT_LE(std::sqrt(qn), r0.aggregated * 0.5 / 6 * (1 + 1e-6));
}

TEST(Federation, DpNoiseHasTheStatedScaleAndTheFixedDenominator) { check_dp_noise(false); }
TEST(Federation, DpNoiseUnderSecureAggregationHasTheStatedScale) { check_dp_noise(true); }

TEST(Federation, TheServerEvaluatesEveryEvalEveryRoundsAndTheLast) {
  FlConfig c = base_config();
  c.rounds = 5;
  c.eval_every = 2;
  RunResult r = run(c);
  expect_ok(r);
  std::vector<bool> evaluated;
  for (auto& x : r.server.rounds) evaluated.push_back(x.test_accuracy >= 0);
  EXPECT_EQ(evaluated, (std::vector<bool>{false, true, false, true, true}));
  EXPECT_DOUBLE_EQ(r.server.final_accuracy, 0.5);
}

// SCAFFOLD by hand on the toy: the server's c and every client's c_i (committed when its update is applied). With
// `clip` > 0, secure aggregation's clip of each element of the weighted update and of the scaled change w_k s dc.
struct ScaffoldReference {
  std::vector<double> w = std::vector<double>(kDim, 0.0), c = std::vector<double>(kDim, 0.0);
  std::map<int, std::vector<double>> ci;
  uint64_t clipped = 0;                  // elements clipped in the last round
  std::unique_ptr<ServerOptimizer> opt;  // set: the weights' pseudo-gradient goes through it (c never does)

  // limits: the step limit of each client this round (absent: full work); trained: the clients that trained (null:
  // every sampled one; the others were stragglers).
  void round(const FlConfig& cfg, int r, double clip = 0, const std::map<int, int64_t>& limits = {},
             const std::set<int>* trained = nullptr) {
    ToyTrainer t(cfg);
    auto parts = partition(t.train_labels(), 10, cfg.clients, parse_partition(cfg.partition), cfg.seed);
    auto sampled = sample_clients(cfg.clients, cfg.fraction, cfg.min_clients, cfg.seed, uint64_t(r));
    const double mean = double(kSamples) / cfg.clients;
    // s: lr times the steps of a speed-1 client's full work on a mean-sized partition.
    const double s = cfg.lr * double(cfg.local_epochs) * std::ceil(mean / cfg.batch_size);
    auto clamp = [&](double x) {
      if (clip <= 0 || std::abs(double(float(x))) <= clip) return x;
      ++clipped;
      return x > 0 ? clip : -clip;
    };
    clipped = 0;
    std::vector<double> dy(kDim, 0.0), dc(kDim, 0.0);
    double wsum = 0;
    std::map<int, std::vector<double>> next;
    std::vector<float> x(w.begin(), w.end());
    for (int k : sampled) {
      if (trained && !trained->count(k)) continue;
      std::vector<double>& mine = ci.try_emplace(k, std::vector<double>(kDim, 0.0)).first->second;
      std::vector<float> corr(kDim);
      for (size_t i = 0; i < kDim; ++i) corr[i] = float(c[i] - mine[i]);
      LocalWork work;
      work.correction = &corr;
      if (auto it = limits.find(k); it != limits.end()) work.max_steps = it->second;
      LocalResult lr = t.train(x, parts[size_t(k)], work);
      const double wk = double(lr.examples) / mean;
      next[k].resize(kDim);
      for (size_t i = 0; i < kDim; ++i) {
        const double change = -c[i] - double(lr.delta[i]) / (double(lr.steps) * cfg.lr);
        const double sent = clamp(wk * change * s);
        next[k][i] = mine[i] + sent / (wk * s);
        dy[i] += clamp(wk * lr.delta[i]);
        dc[i] += sent / s;
      }
      wsum += wk;
    }
    if (opt) {  // (in f32, as the server keeps its weights)
      std::vector<float> wf(w.begin(), w.end()), d(kDim);
      for (size_t i = 0; i < kDim; ++i) d[i] = float(dy[i] / wsum);
      opt->step(wf.data(), d.data(), kDim);
      w.assign(wf.begin(), wf.end());
    }
    for (size_t i = 0; i < kDim; ++i) {
      if (!opt) w[i] += dy[i] / wsum;
      c[i] += dc[i] / cfg.clients;
    }
    for (auto& [k, v] : next) ci[k] = v;
  }
};

TEST(Federation, ScaffoldMatchesTheAlgorithmByHandWithPartialParticipation) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.rounds = 4;
  RunResult r = run(c);
  expect_ok(r);
  ScaffoldReference ref;
  for (int round = 0; round < c.rounds; ++round) ref.round(c, round);
  ASSERT_EQ(r.server.weights.size(), kDim);
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], ref.w[i], 2e-5) << i;
  // Without the control variates the rounds differ (the test would not notice a correction that is never applied).
  std::vector<float> fedavg(kDim, 0.0f);
  for (int round = 0; round < c.rounds; ++round) fedavg = fedavg_round(c, fedavg, round);
  double diff = 0;
  for (size_t i = 0; i < kDim; ++i) diff = std::max(diff, std::abs(double(fedavg[i]) - ref.w[i]));
  EXPECT_GT(diff, 1e-3);
  // The download carries the weights and c (once to each of the 2 hosts), the upload each client's update and its
  // control variate's change.
  EXPECT_GT(r.server.rounds[0].bytes_up, 6 * (2 * kDim + 1) * 4);
  EXPECT_GT(r.server.rounds[0].bytes_down, 2 * 2 * kDim * 4);
}

// SCAFFOLD under a server optimizer: the weights' pseudo-gradient goes through it, the control variate c does not
// (c estimates the clients' mean gradient, which momentum or adaptivity would distort; a c that went through it
// would change the next rounds' corrections, hence the weights compared here).
TEST(Federation, ScaffoldWithAServerOptimizerMatchesTheAlgorithmByHand) {
  for (const std::string name : {"fedavgm", "fedadam"}) {
    SCOPED_TRACE(name);
    FlConfig c = base_config();
    c.partition = "dirichlet:0.5";
    c.scaffold = true;
    c.rounds = 4;
    c.server_opt = name;
    c.server_lr = name == "fedadam" ? 0.01 : 0.7;
    RunResult r = run(c);
    expect_ok(r);
    ServerOptConfig so;
    so.name = name;
    so.lr = c.server_lr;
    so.momentum = c.server_momentum;
    so.beta1 = c.beta1;
    so.beta2 = c.beta2;
    so.tau = c.tau;
    ScaffoldReference ref, plain;
    ref.opt = make_server_optimizer(so, kDim);
    for (int round = 0; round < c.rounds; ++round) {
      ref.round(c, round);
      plain.round(c, round);
    }
    ASSERT_EQ(r.server.weights.size(), kDim);
    double off_plain = 0;
    for (size_t i = 0; i < kDim; ++i) {
      EXPECT_NEAR(r.server.weights[i], ref.w[i], 2e-5) << i;
      off_plain = std::max(off_plain, std::abs(ref.w[i] - plain.w[i]));
    }
    EXPECT_GT(off_plain, 1e-3) << "the optimizer did not change the rounds: the test would not notice it skipped";
  }
}

// Slow clients doing the steps that fit the deadline (FedProx's partial work) estimate their c_i from the K steps
// they took, not a full epoch's: the run matches the algorithm by hand given each client's step limit.
TEST(Federation, ScaffoldWithPartialWorkUsesTheStepsTaken) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.rounds = 4;
  c.batch_size = 4;  // several steps a client, so a limit cuts some
  c.speed_sigma = 1.0;
  c.deadline = 1.0;
  c.stragglers = "partial";
  {
    std::lock_guard<std::mutex> lk(g_limits_mu);
    g_limits.clear();
  }
  RunResult r = run(c);
  expect_ok(r);
  int partial = 0;
  for (auto& x : r.server.rounds) partial += x.partial;
  ASSERT_GT(partial, 0) << "no client did partial work: the test checks nothing";
  std::map<int, std::map<int, int64_t>> limits;  // round -> client -> limit
  std::map<int, std::set<int>> trained;          // round -> clients (a client too slow for one step is not)
  {
    std::lock_guard<std::mutex> lk(g_limits_mu);
    for (auto& [key, limit] : g_limits) {
      trained[key.first].insert(key.second);
      if (limit > 0) limits[key.first][key.second] = limit;
    }
  }
  ScaffoldReference ref;
  for (int round = 0; round < c.rounds; ++round) ref.round(c, round, 0, limits[round], &trained[round]);
  ASSERT_EQ(r.server.weights.size(), kDim);
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], ref.w[i], 2e-5) << i;
}

// Clients that take different numbers of local steps pull FedAvg towards the busier ones (client drift); SCAFFOLD
// converges to the optimum of the sample-weighted objective, sum_k p_k target_k on the toy.
TEST(Federation, ScaffoldRemovesTheClientDriftFedAvgKeeps) {
  FlConfig c = base_config();
  c.clients = 6;
  c.fraction = 1.0;
  c.partition = "dirichlet:0.3";
  c.batch_size = 32;  // 1 to a few steps a client: FedAvg's a_k = 1 - 0.9^K_k differ most
  c.rounds = 30;
  g_spread = 1.0;  // targets far apart: drift worth measuring
  struct Restore {
    ~Restore() { g_spread = 0.01; }
  } restore;
  ToyTrainer t(c);
  auto parts = partition(t.train_labels(), 10, c.clients, parse_partition(c.partition), c.seed);
  std::vector<double> optimum(kDim, 0.0);
  std::set<size_t> sizes;
  for (auto& p : parts) {
    sizes.insert(p.size());
    for (size_t i = 0; i < kDim; ++i) optimum[i] += double(p.size()) / kSamples * target(p.front(), i);
  }
  ASSERT_GE(sizes.size(), 3u) << "the partition's sizes barely differ: no drift to remove";
  auto error = [&](const std::vector<float>& w) {
    double e = 0;
    for (size_t i = 0; i < kDim; ++i) e = std::max(e, std::abs(double(w[i]) - optimum[i]));
    return e;
  };
  RunResult fedavg = run(c);
  c.scaffold = true;
  RunResult scaffold = run(c);
  expect_ok(fedavg);
  expect_ok(scaffold);
  std::printf("drift: fedavg %.3g scaffold %.3g\n", error(fedavg.server.weights), error(scaffold.server.weights));
  EXPECT_GT(error(fedavg.server.weights), 5e-3);
  EXPECT_LT(error(scaffold.server.weights), 1e-4);
}

TEST(Federation, ScaffoldUnderSecureAggregationMatchesItsPlainRun) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.secagg = true;
  c.secagg_clip = 4.0;
  RunResult masked = run(c);
  expect_ok(masked);
  ScaffoldReference ref;
  for (int round = 0; round < c.rounds; ++round) ref.round(c, round);
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(masked.server.weights[i], ref.w[i], 1e-5) << i;
  EXPECT_EQ(masked.server.rounds[2].clipped, 0u);
}

// Secure aggregation clips the control variates' changes too: the server adds the clipped values, and the clients
// must keep those (the ones they computed would leave c off the mean of the c_i for good). The clipped count covers
// both parts of the vector.
TEST(Federation, ScaffoldClientsKeepTheClippedChangeTheServerAdds) {
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.secagg = true;
  c.secagg_clip = 0.05;  // below many of the weighted deltas and control changes
  c.rounds = 4;
  RunResult r = run(c);
  expect_ok(r);
  ScaffoldReference ref;
  for (int round = 0; round < c.rounds; ++round) {
    ref.round(c, round, c.secagg_clip);
    ASSERT_GT(ref.clipped, 0u) << "round " << round << ": nothing clipped, the test checks nothing";
    EXPECT_EQ(r.server.rounds[size_t(round)].clipped, ref.clipped) << "round " << round;
  }
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], ref.w[i], 1e-5) << i;
}

// A round secure aggregation abandons changes neither c nor any c_i: the clients that trained in it keep their old
// control variates (with t = all sampled, every round with a dropout is abandoned).
TEST(Federation, ScaffoldClientsKeepTheirControlVariatesWhenTheRoundIsAbandoned) {
  FlConfig c = base_config();
  c.clients = 6;
  c.fraction = 1.0;
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.secagg = true;
  c.secagg_clip = 4.0;
  c.secagg_threshold = 1.0;
  c.dropout = 0.12;
  c.rounds = 8;
  RunResult r = run(c);
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 8u);
  ScaffoldReference ref;
  int abandoned = 0, applied = 0;
  for (int round = 0; round < c.rounds; ++round) {
    if (r.server.rounds[size_t(round)].abandoned) {
      ++abandoned;
      continue;
    }
    ++applied;
    ref.round(c, round);
  }
  ASSERT_GT(abandoned, 0) << "the seed abandoned no round: the test checks nothing";
  ASSERT_GT(applied, 1) << "the seed applied too few rounds: the test checks little";
  for (size_t i = 0; i < kDim; ++i) EXPECT_NEAR(r.server.weights[i], ref.w[i], 1e-5) << i;
}

// A temporary folder, removed with what it holds at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/conduit-fl-test-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

// A checkpoint's weights and control variates are finite when written: a damaged file holding a nan or inf is named
// at resume (it read in and surfaced as "local training diverged"), a sound one reads back as written.
TEST(Checkpoint, AValueThatIsNotFiniteIsNamedAtResume) {
  for (float bad : {std::nanf(""), INFINITY, 0.5f}) {
    TempDir d;
    ServerCheckpoint s;
    s.round = 1;
    s.config_json = "{}";
    s.weights = {1.0f, bad, 3.0f};
    write_server_checkpoint(d.path, s);
    if (std::isfinite(bad)) {
      EXPECT_EQ(read_latest_checkpoint(d.path).weights, s.weights);
      continue;
    }
    const std::string e = conduit::test::error_of<ProtocolError>([&] { read_latest_checkpoint(d.path); });
    EXPECT_NE(e.find("server-1.bin' holds a value that is not finite"), std::string::npos) << e;
    EXPECT_NE(e.find("float 1 of a block of 3"), std::string::npos) << e;
  }
}

// Rounds 1-3 with checkpoints, then 4-5 resumed from the last: the weights are those of 5 rounds straight, bit for bit
// (the server optimizer's moments, SCAFFOLD's c and every client's c_i, and under secure aggregation the exact sums,
// all carried over).
TEST(Federation, AResumedRunRepeatsTheUninterruptedOneExactly) {
  for (bool scaffold : {false, true}) {
    TempDir d;
    FlConfig c = base_config();
    c.partition = "dirichlet:0.5";
    c.server_opt = "fedadam";  // state that a resume must restore
    c.server_lr = 0.05;
    c.scaffold = scaffold;
    c.secagg = scaffold;
    c.secagg_clip = 4.0;
    c.rounds = 5;
    c.output = d.path + "/whole";
    RunResult whole = run(c);
    c.rounds = 3;
    c.checkpoint_every = 2;  // after rounds 2 and 3 (the last)
    c.output = d.path + "/first";
    RunResult first = run(c);
    c.rounds = 5;
    c.checkpoint_every = 0;
    c.resume = d.path + "/first";
    c.output = d.path + "/second";
    if (scaffold) c.workers = 4;  // the clients' c_i regrouped on three hosts (secure aggregation's sums are exact)
    RunResult second = run(c);
    expect_ok(whole);
    expect_ok(first);
    expect_ok(second);
    ASSERT_EQ(second.server.rounds.size(), 2u) << "scaffold " << scaffold;
    EXPECT_EQ(second.server.rounds[0].round, 4);
    EXPECT_EQ(second.server.rounds_applied, 5);
    EXPECT_EQ(second.server.weights, whole.server.weights) << "scaffold " << scaffold;
    EXPECT_NE(first.server.weights, whole.server.weights);  // (the test would not see a resume that did nothing)
    EXPECT_EQ(std::filesystem::exists(d.path + "/first/checkpoints/host-1-3.bin"), scaffold);
  }
}

// A resumed run that checkpoints in turn, resumed again: rounds 1-2, 3-4, 5-6 give the weights (and, under DP, the
// privacy spent) of 6 rounds straight, so nothing a resume restores is lost when it is saved again.
TEST(Federation, AResumeOfAResumedRunRepeatsTheUninterruptedOneExactly) {
  for (bool dp : {false, true}) {
    SCOPED_TRACE(dp ? "dp + secagg" : "scaffold + secagg + fedadam");
    TempDir d;
    FlConfig c = base_config();
    c.partition = "dirichlet:0.5";
    c.secagg = true;
    c.secagg_clip = 4.0;
    if (dp) {
      c.dp_clip = 0.5;
      c.dp_noise = 1.0;
      c.dp_secret_seed_for_testing = 7;
    } else {
      c.server_opt = "fedadam";
      c.server_lr = 0.05;
      c.scaffold = true;
    }
    c.rounds = 6;
    RunResult whole = run(c);
    c.checkpoint_every = 1;
    std::vector<RunResult> legs;
    for (int leg = 0; leg < 3; ++leg) {
      c.rounds = 2 * (leg + 1);
      c.resume = leg ? d.path + "/leg" + std::to_string(leg - 1) : "";
      c.output = d.path + "/leg" + std::to_string(leg);
      legs.push_back(run(c));
      expect_ok(legs.back());
      ASSERT_EQ(legs.back().server.rounds.size(), 2u) << "leg " << leg;
      EXPECT_EQ(legs.back().server.rounds[0].round, 2 * leg + 1) << "leg " << leg;
    }
    expect_ok(whole);
    ASSERT_EQ(whole.server.rounds.size(), 6u);
    EXPECT_EQ(legs[2].server.weights, whole.server.weights);
    if (dp) {
      EXPECT_DOUBLE_EQ(legs[2].server.rounds[1].epsilon, whole.server.rounds[5].epsilon);
    }
  }
}

// A generation that lacks a host file (a run killed between the server's write and a host's) is passed over for the
// one before; a checkpoint that is not one stops the run naming the file.
TEST(Federation, ResumeTakesTheNewestCompleteCheckpointAndRefusesBadOnes) {
  TempDir d;
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c.rounds = 5;
  RunResult whole = run(c);
  c.rounds = 4;
  c.checkpoint_every = 1;  // the two newest kept: after rounds 3 and 4
  c.output = d.path + "/first";
  expect_ok(run(c));
  const std::string ck = d.path + "/first/checkpoints";
  EXPECT_FALSE(std::filesystem::exists(ck + "/server-1.bin"));  // (pruned once 3 or 2 was complete)
  ASSERT_TRUE(std::filesystem::exists(ck + "/server-3.bin"));
  ASSERT_TRUE(std::filesystem::exists(ck + "/host-2-3.bin"));
  std::filesystem::remove(ck + "/host-2-4.bin");
  c.rounds = 5;
  c.checkpoint_every = 0;
  c.resume = d.path + "/first";
  c.output = d.path + "/second";
  RunResult second = run(c);
  expect_ok(second);
  ASSERT_EQ(second.server.rounds.size(), 2u);
  EXPECT_EQ(second.server.rounds[0].round, 4);
  EXPECT_EQ(second.server.weights, whole.server.weights);

  // Not a checkpoint; another setting; too few rounds; no checkpoint at all: the server's error names each.
  auto error_of_resume = [&](const std::function<void(FlConfig&)>& change) {
    FlConfig b = c;
    b.output = "";
    change(b);
    RunResult r = run(b);
    EXPECT_NE(r.errors[1], "");  // (the hosts stop too)
    return r.errors[0];
  };
  EXPECT_NE(error_of_resume([](FlConfig& b) { b.lr = 0.1; }).find("resume: lr is 0.1 here"), std::string::npos);
  EXPECT_NE(error_of_resume([](FlConfig& b) { b.rounds = 3; }).find("after round 3 and --rounds is 3"),
            std::string::npos);
  EXPECT_NE(error_of_resume([&](FlConfig& b) { b.resume = d.path + "/none"; }).find("is not a folder of checkpoints"),
            std::string::npos);
  std::ofstream(ck + "/server-3.bin") << "not a checkpoint";
  EXPECT_NE(error_of_resume([](FlConfig&) {}).find("server-3.bin' is not a server checkpoint"), std::string::npos);
  std::filesystem::remove(ck + "/server-3.bin");
  EXPECT_NE(error_of_resume([](FlConfig&) {}).find("holds no complete checkpoint"), std::string::npos);
}

// A resumed SCAFFOLD host reads its clients' c_i before the ranks meet, under start-up's deadline: read at the first
// round's header, it held up the server's send of the weights, which has a step's deadline (in-process, as over MPI,
// a send completes only once its receive is posted), and a large file's read failed the run. A read slower than a
// step (a delay standing in for a large file) no longer does.
TEST(Federation, AResumedScaffoldHostReadsItsControlVariatesOutsideTheRoundsDeadlines) {
  TempDir d;
  FlConfig c = base_config();
  c.partition = "dirichlet:0.5";
  c.scaffold = true;
  c = resuming_after_two_rounds(c, d.path, 3);
  c.timeout_s = 1;
  set_host_checkpoint_read_delay_for_testing(2.5);
  RunResult r = run(c);
  set_host_checkpoint_read_delay_for_testing(0);
  expect_ok(r);
  ASSERT_EQ(r.server.rounds.size(), 1u);
  EXPECT_EQ(r.server.rounds[0].round, 3);
}

// Under DP the accountant goes on from the checkpoint's rounds: epsilon after 2 + 2 rounds is that of 4.
TEST(Federation, AResumedDpRunAccountsForTheRoundsBeforeTheCheckpoint) {
  TempDir d;
  FlConfig c = base_config();
  c.dp_clip = 1.0;
  c.dp_noise = 1.0;
  c.dp_secret_seed_for_testing = 5;  // (the secret does not matter here; with the OS's, 2 rounds sample nobody 2^-24)
  c.rounds = 4;
  RunResult whole = run(c);
  c.rounds = 2;
  c.checkpoint_every = 2;
  c.output = d.path + "/first";
  RunResult first = run(c);
  c.rounds = 4;
  c.checkpoint_every = 0;
  c.resume = d.path + "/first";
  c.output = "";
  RunResult second = run(c);
  expect_ok(whole);
  expect_ok(first);
  expect_ok(second);
  ASSERT_EQ(second.server.rounds.size(), 2u);
  EXPECT_GT(second.server.rounds.back().epsilon, first.server.rounds.back().epsilon);
  EXPECT_DOUBLE_EQ(second.server.rounds.back().epsilon, whole.server.rounds.back().epsilon);
  // A run that stopped after releasing rounds its last checkpoint does not hold (its round-4 checkpoint lost: it had
  // released 4 rounds, the checkpoint left holds 2): the resume releases rounds 3 and 4 again with new noise, and
  // counts both releases, from the ledger: epsilon after 6 rounds (it reported 4's).
  c.resume = "";
  c.rounds = 4;
  c.checkpoint_every = 2;
  c.output = d.path + "/stopped";
  expect_ok(run(c));
  const std::string ck = d.path + "/stopped/checkpoints";
  EXPECT_EQ(read_dp_ledger(ck), 4);
  std::filesystem::remove(ck + "/server-4.bin");
  c.resume = d.path + "/stopped";
  c.checkpoint_every = 0;
  c.output = "";
  RunResult again = run(c);
  expect_ok(again);
  FlConfig six = base_config();
  six.dp_clip = 1.0;
  six.dp_noise = 1.0;
  six.dp_secret_seed_for_testing = 5;
  six.rounds = 6;
  RunResult longer = run(six);
  expect_ok(longer);
  ASSERT_EQ(again.server.rounds.size(), 2u);
  EXPECT_DOUBLE_EQ(again.server.rounds.back().epsilon, longer.server.rounds.back().epsilon);
  EXPECT_GT(again.server.rounds.back().epsilon, whole.server.rounds.back().epsilon);
  // The resume raised the ledger it resumed from: a second resume from the same checkpoint counts its releases too.
  EXPECT_EQ(read_dp_ledger(ck), 6);
  // A ledger that is not one is refused naming it.
  std::ofstream(ck + "/dp-ledger.bin") << "not a ledger";
  try {
    read_dp_ledger(ck);
    ADD_FAILURE() << "a bad ledger was read";
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find("dp-ledger.bin' is not a differential privacy ledger"), std::string::npos)
        << e.what();
  }
}

// A DP resume raises the ledger of the folder it resumed from after every round: a folder it cannot write (a read-only
// copy) stopped the run after its first round's model was released. It is refused before round 1, naming the folder.
// (In a child process that cannot write there: mode 0555, and root, whom the mode does not bind, becomes nobody.)
TEST(Federation, ADpResumeFromAFolderItCannotWriteStopsBeforeRoundOne) {
  TempDir d;
  FlConfig c = base_config();
  c.dp_clip = 1.0;
  c.dp_noise = 1.0;
  c.dp_secret_seed_for_testing = 5;
  c = resuming_after_two_rounds(c, d.path, 3);
  const std::string ck = d.path + "/first/checkpoints";
  ASSERT_EQ(::chmod(d.path.c_str(), 0755), 0);  // (mkdtemp's 0700: nobody could not reach the checkpoints)
  ASSERT_EQ(::chmod(ck.c_str(), 0555), 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    if (::geteuid() == 0 && ::setuid(65534) != 0) ::_exit(3);
    RunResult r = run(c);
    const std::string out = fmt::format("{} records; {}", r.records.size(), r.errors[0]);
    ::_exit(::write(fds[1], out.data(), out.size()) == ssize_t(out.size()) ? 0 : 4);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t k; (k = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(k));
  ::close(fds[0]);
  int st = 0;
  ::waitpid(pid, &st, 0);
  ::chmod(ck.c_str(), 0755);
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "the child could not run: " << st;
  EXPECT_NE(out.find("0 records; fl: resume: cannot write in '" + ck +
                     "' (Permission denied): a resume under "
                     "differential privacy raises the privacy ledger"),
            std::string::npos)
      << out;
  EXPECT_EQ(read_dp_ledger(ck), 2);
}

TEST(FlConfig, BadValuesAreRejectedWithTheFieldNamed) {
  auto bad = [](std::function<void(FlConfig&)> f, const std::string& field) {
    FlConfig c = base_config();
    f(c);
    try {
      check_config(c);
      ADD_FAILURE() << "accepted a bad " << field;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  bad([](FlConfig& c) { c.fraction = 0; }, "fraction");
  bad([](FlConfig& c) { c.fraction = 1.5; }, "fraction");
  bad([](FlConfig& c) { c.min_clients = 13; }, "min_clients");
  bad([](FlConfig& c) { c.model = "vgg"; }, "model");
  bad([](FlConfig& c) { c.model = "resnet"; }, "model");
  bad([](FlConfig& c) { c.workers = 14; }, "workers");
  bad([](FlConfig& c) { c.stragglers = "wait"; }, "stragglers");
  bad([](FlConfig& c) { c.dropout = 1; }, "dropout");
  bad([](FlConfig& c) { c.dp_noise = 1; }, "dp_noise");
  bad([](FlConfig& c) { c.workers = 1; }, "workers");
  // (a switched-off feature's settings are recorded, and a resume compares them: checked all the same)
  bad([](FlConfig& c) { c.secagg_bits = 99; }, "secagg_bits");
  bad([](FlConfig& c) { c.secagg_threshold = 2; }, "secagg_threshold");
  bad([](FlConfig& c) { c.secagg_neighbors = 3; }, "secagg_neighbors");
  bad([](FlConfig& c) { c.stragglers = "partial"; },
      "stragglers: partial cuts a client's work to the steps that fit "
      "the deadline, and there is none");
  bad([](FlConfig& c) { c.lr = std::nan(""); }, "lr");
  bad(
      [](FlConfig& c) {
        c.scaffold = true;
        c.momentum = 0.9;
      },
      "momentum");
  bad(
      [](FlConfig& c) {
        c.scaffold = true;
        c.dp_clip = 1.0;
      },
      "scaffold");
  bad([](FlConfig& c) { c.checkpoint_every = 2; }, "checkpoint_every");  // (no output folder)
  bad(
      [](FlConfig& c) {
        c.secagg = true;
        c.secagg_bits = 40;
      },
      "secagg_bits");
  bad(
      [](FlConfig& c) {
        c.secagg = true;
        c.secagg_threshold = 0.4;
      },
      "secagg_threshold");
  {  // too few bits for the clients a round: the flag and the bits that would do, named (it named the codec)
    FlConfig c = base_config();
    c.secagg = true;
    c.secagg_bits = 8;
    c.clients = 100;
    c.fraction = 1;
    EXPECT_EQ(conduit::test::error_of<ConfigError>([&] { check_config(c); }),
              "fl: secagg_bits: 8 bits cannot sum 100 clients a round without wrapping (each needs 2 integer levels "
              "of 2^(bits-1) - 1); allowed: secagg_bits 9 to 32 for 100 clients a round, or fewer clients a round "
              "(--fraction, --clients)");
    c.secagg_bits = 9;
    EXPECT_NO_THROW(check_config(c));
  }
  for (int k : {-2, 3, 65536})
    bad(
        [k](FlConfig& c) {
          c.secagg = true;
          c.secagg_neighbors = k;
        },
        "secagg_neighbors");
  for (double v : {-0.1, 0.5})
    bad(
        [v](FlConfig& c) {
          c.secagg = true;
          c.secagg_max_corrupt = v;
        },
        "secagg_max_corrupt");
  bad(
      [](FlConfig& c) {
        c.secagg = true;
        c.secagg_max_dropout = 1;
      },
      "secagg_max_dropout");
  bad(
      [](FlConfig& c) {  // auto would choose a graph for fewer dropouts than the run simulates
        c.secagg = true;
        c.secagg_neighbors = -1;
        c.dropout = 0.3;
        c.secagg_max_dropout = 0.2;
      },
      "secagg_max_dropout: 0.2 is below --dropout 0.3");
  {
    FlConfig c;
    set_config_value(c, "secagg_neighbors", "auto");
    EXPECT_EQ(c.secagg_neighbors, -1);
    EXPECT_THROW(set_config_value(c, "rounds", "auto"), ConfigError);  // (auto is secagg_neighbors' word only)
    try {
      set_config_value(c, "secagg_neighbors", "autox");
      ADD_FAILURE() << "accepted autox";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("fl: secagg_neighbors: 'autox' is not 0 (every pair), an even integer in "
                                           "2..65534, or auto (or -1)"),
                std::string::npos)
          << e.what();
    }
  }
  bad(
      [](FlConfig& c) {
        c.secagg = true;
        c.clients = 10;
        c.fraction = 0.1;
        c.min_clients = 1;
      },
      "secagg");
  EXPECT_THROW(
      {
        FlConfig c;
        set_config_value(c, "rounds", "3x");
      },
      ConfigError);
  EXPECT_THROW(
      {
        FlConfig c;
        set_config_value(c, "no_such_key", "1");
      },
      ConfigError);
}

// Every pair of 65,535 clients a round would relay 4.3e9 key shares (terabytes): refused before a round, naming
// SecAgg+; its k keeps the relay linear in the clients, and without secure aggregation nothing is relayed.
TEST(FlConfig, ASecureAggregationWhoseShareRelayCannotFitIsRefused) {
  FlConfig c = base_config();
  c.clients = 65535;  // (the protocol's most: 4.3e9 shares, terabytes)
  c.fraction = 1;
  c.secagg = true;
  c.secagg_neighbors = 0;
  check_config(c);
  const std::string e = conduit::test::error_of<ConfigError>([&] { check_secagg_memory(c, 1.0); });
  EXPECT_NE(e.find("fl: secagg: 65535 clients a round with every pair sharing keys would relay 4.29e+09 key shares"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("allowed: --secagg-neighbors auto"), std::string::npos) << e;
  c.secagg_neighbors = -1;  // auto: a k of tens
  EXPECT_NO_THROW(check_secagg_memory(c, 1.0));
  c.secagg_neighbors = 0;
  c.secagg = false;
  EXPECT_NO_THROW(check_secagg_memory(c, 1.0));
  c.secagg = true;
  c.clients = 100;  // every pair of 100: 9,900 shares
  EXPECT_NO_THROW(check_secagg_memory(c, 1.0));
}

TEST(FlConfig, JsonRoundTripsEveryKeyAndRefusesUnknownOnes) {
  FlConfig c = base_config();
  c.partition = "shards:2";
  c.secagg_bits = 16;
  c.secagg_neighbors = 8;
  c.secagg_max_corrupt = 0.1;
  c.secagg_max_dropout = 0.25;
  c.dp_delta = 1e-6;
  c.seed = 7;
  FlConfig back = config_from_json(config_to_json(c), "test");
  EXPECT_EQ(back.secagg_neighbors, 8);
  EXPECT_EQ(back.secagg_max_corrupt, 0.1);
  EXPECT_EQ(back.secagg_max_dropout, 0.25);
  EXPECT_EQ(config_to_json(back), config_to_json(c));
  EXPECT_EQ(back.partition, "shards:2");
  EXPECT_EQ(back.secagg_bits, 16);
  EXPECT_THROW(config_from_json(R"({"rounds": 3, "roundz": 4})", "test"), ConfigError);
  EXPECT_THROW(config_from_json(R"({"rounds": "three"})", "test"), ConfigError);
  EXPECT_THROW(config_from_json(R"({"rounds": 2.7})", "test"), ConfigError);
  EXPECT_THROW(config_from_json(R"({"seed": -1})", "test"), ConfigError);
  EXPECT_THROW(config_from_json(R"({"secagg": 1})", "test"), ConfigError);
  EXPECT_EQ(config_from_json(R"({"seed": 18446744073709551615})", "test").seed, 18446744073709551615ull);
  FlConfig big;
  set_config_value(big, "seed", "18446744073709551615");
  EXPECT_EQ(big.seed, 18446744073709551615ull);
  EXPECT_THROW(set_config_value(big, "rounds", "-3000000000"), ConfigError);
  EXPECT_THROW(config_from_json("[1]", "test"), ConfigError);
  // Every flag is a key: secagg_neighbors' auto too (it was refused as a string, where the flag took it).
  EXPECT_EQ(config_from_json(R"({"secagg_neighbors": "auto"})", "test").secagg_neighbors, -1);
  EXPECT_EQ(config_from_json(R"({"secagg_neighbors": -1})", "test").secagg_neighbors, -1);
  EXPECT_EQ(config_from_json(R"({"secagg_neighbors": 8})", "test").secagg_neighbors, 8);
  EXPECT_EQ(error_of<ConfigError>([] { config_from_json(R"({"secagg_neighbors": "autox"})", "test"); }),
            "fl: test: key 'secagg_neighbors' has a value of the wrong type (\"autox\"); allowed: 0 (every pair), an "
            "even integer in 2..65534, or auto (or -1)");
  EXPECT_EQ(error_of<ConfigError>([] { config_from_json(R"({"rounds": 2.7})", "test"); }),
            "fl: test: key 'rounds' has a value of the wrong type (2.7); allowed: an integer in [1, 1000000]");
}

// A value that is not an integer is refused naming the key's own range (it named int's: -2147483648 to 2147483647).
TEST(FlConfig, AnIntegerKeyNamesItsOwnRange) {
  FlConfig c;
  auto refused = [&](const std::string& key, const std::string& value) {
    return error_of<ConfigError>([&] { set_config_value(c, key, value); });
  };
  EXPECT_EQ(refused("rounds", "2.5"), "fl: rounds: '2.5' is not an integer in [1, 1000000]");
  EXPECT_EQ(refused("clients", "abc"), "fl: clients: 'abc' is not an integer in [1, 1000000]");
  EXPECT_EQ(refused("secagg_bits", "16.0"), "fl: secagg_bits: '16.0' is not an integer in [8, 32]");
  EXPECT_EQ(refused("workers", "99999999999"), "fl: workers: '99999999999' is not an integer in [2, 4096]");
  EXPECT_EQ(refused("min_clients", "x"), "fl: min_clients: 'x' is not an integer in [1, clients]");
  EXPECT_EQ(refused("seed", " -1"), "fl: seed: ' -1' is not an integer in [0, 18446744073709551615]");
  // (the range named is the one check_config holds the key to)
  set_config_value(c, "rounds", "1000001");
  EXPECT_EQ(error_of<ConfigError>([&] { check_config(c); }),
            "fl: rounds: 1000001 is out of range; allowed: an integer in [1, 1000000]");
}

// The server optimizer's settings are named as the keys (and flags) spell them, as every other fl check names its
// own ("server optimizer: lr is 0" named no flag).
TEST(FlConfig, ServerOptimizerSettingsAreNamedAsTheirKeys) {
  auto refused = [](const std::function<void(FlConfig&)>& f) {
    FlConfig c = base_config();
    f(c);
    return error_of<ConfigError>([&] { check_config(c); });
  };
  EXPECT_EQ(refused([](FlConfig& c) { c.server_lr = 0; }),
            "fl: server_lr: 0 is out of range; allowed: a finite number > 0");
  EXPECT_EQ(refused([](FlConfig& c) { c.server_momentum = 1; }),
            "fl: server_momentum: 1 is out of range; allowed: a number in [0, 1)");
  EXPECT_EQ(refused([](FlConfig& c) { c.beta1 = -0.1; }),
            "fl: beta1: -0.1 is out of range; allowed: a number in [0, 1)");
  EXPECT_EQ(refused([](FlConfig& c) { c.beta2 = 1.5; }), "fl: beta2: 1.5 is out of range; allowed: a number in [0, 1)");
  EXPECT_EQ(refused([](FlConfig& c) { c.tau = std::nan(""); }),
            "fl: tau: nan is out of range; allowed: a finite number > 0");
  EXPECT_EQ(refused([](FlConfig& c) { c.server_opt = "sgd"; }),
            "fl: server_opt: 'sgd' is not known; allowed: fedavg, fedavgm, fedadagrad, fedadam, fedyogi");
  // (the optimizer's own validation, outside fl's keys, names its fields)
  ServerOptConfig oc;
  oc.lr = 0;
  EXPECT_EQ(error_of<ConfigError>([&] { validate(oc); }),
            "server optimizer: lr: 0 is out of range; allowed: a finite number > 0");
}

// Under DP every client is sampled on its own (Poisson sampling, what the accountant assumes): a --min-clients,
// ignored before, is refused naming both; the default passes.
TEST(FlConfig, MinClientsIsRefusedUnderDifferentialPrivacy) {
  FlConfig c = base_config();
  c.dp_clip = 1.0;
  c.min_clients = 4;
  EXPECT_EQ(error_of<ConfigError>([&] { check_config(c); }),
            "fl: min_clients: 4 does not apply under differential privacy (each client is sampled on its own with "
            "probability --fraction, as the accountant assumes: no floor); allowed: min_clients 2 (the default) with "
            "--dp-clip/--dp-noise, and a larger --fraction for more clients a round");
  c.dp_clip = 0;
  EXPECT_NO_THROW(check_config(c));  // (without DP it is a floor)
  c.dp_clip = 1.0;
  c.min_clients = FlConfig{}.min_clients;
  EXPECT_NO_THROW(check_config(c));
}

}  // namespace
}  // namespace conduit::fl
