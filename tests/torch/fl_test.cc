// `conduit fl`'s libtorch side: local training of a client (FedProx, partial work), a federation of real models on
// in-process ranks, and the command end to end.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "coll/communicator.h"
#include "core/error.h"
#include "fl/federation.h"
#include "torch/fl_client.h"

namespace conduit::train {
namespace {

namespace fs = std::filesystem;

fl::FlConfig synthetic_config() {
  fl::FlConfig c;
  c.model = "mlp";
  c.dataset = "synthetic";
  c.synthetic_samples = 1024;
  c.clients = 8;
  c.fraction = 0.5;
  c.rounds = 4;
  c.partition = "iid";
  c.batch_size = 16;
  c.lr = 0.05;
  c.workers = 3;
  c.progress = false;
  c.timeout_s = 120;
  c.eval_every = 1;
  c.secagg = true;
  c.secagg_clip = 1.0;
  return c;
}

double norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return std::sqrt(s);
}

TEST(FlClient, ProximalTermKeepsTheLocalModelCloserAndPartialWorkStopsEarly) {
  fl::FlConfig c = synthetic_config();
  auto plain = make_fl_trainer(c);
  c.mu = 5.0;
  auto prox = make_fl_trainer(c);
  const std::vector<float> w = plain->initial_weights();
  EXPECT_EQ(w, prox->initial_weights());  // the same seed: the same model everywhere
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < 128; ++i) idx.push_back(i);
  fl::LocalWork work;
  work.seed = 3;
  fl::LocalResult a = plain->train(w, idx, work);
  fl::LocalResult b = prox->train(w, idx, work);
  EXPECT_EQ(a.steps, 8);  // 128 samples in batches of 16
  EXPECT_EQ(a.examples, 128);
  EXPECT_LT(norm(b.delta), 0.9 * norm(a.delta));
  EXPECT_GT(norm(a.delta), 0);
  work.max_steps = 3;
  fl::LocalResult p = plain->train(w, idx, work);
  EXPECT_EQ(p.steps, 3);
  EXPECT_LT(norm(p.delta), norm(a.delta));
  // Training twice from the same weights and seed is deterministic.
  work.max_steps = 0;
  fl::LocalResult again = plain->train(w, idx, work);
  EXPECT_EQ(again.delta, a.delta);
}

// SCAFFOLD's correction is added to every parameter's gradient: one plain SGD step from the same weights on the same
// batch moves each parameter by -lr * correction more than without it.
TEST(FlClient, ScaffoldsCorrectionShiftsAnSgdStepByLrTimesIt) {
  fl::FlConfig c = synthetic_config();
  c.scaffold = true;
  auto t = make_fl_trainer(c);
  const std::vector<float> w = t->initial_weights();
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < 16; ++i) idx.push_back(i);
  fl::LocalWork work;
  work.seed = 5;
  work.max_steps = 1;
  fl::LocalResult plain = t->train(w, idx, work);
  std::vector<float> corr(w.size());
  for (size_t i = 0; i < corr.size(); ++i) corr[i] = 0.5f * std::sin(float(i));
  work.correction = &corr;
  fl::LocalResult corrected = t->train(w, idx, work);
  ASSERT_EQ(corrected.delta.size(), w.size());
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i)
    worst = std::max(worst, std::abs(double(corrected.delta[i] - plain.delta[i]) + c.lr * corr[i]));
  EXPECT_LT(worst, 1e-6);
  std::vector<float> wrong(w.size() + 1);
  work.correction = &wrong;
  EXPECT_THROW(t->train(w, idx, work), InvalidArgument);
}

// SCAFFOLD's correction and FedProx's proximal term both add to the gradient: over two plain SGD steps the proximal
// term changes only the second, by -lr mu (w1 - w0), where w1 - w0 is the first step (the loss's gradient at w1 is
// the same with and without it, and the correction's share is the same in both runs).
TEST(FlClient, ScaffoldsCorrectionAndTheProximalTermAddUp) {
  fl::FlConfig c = synthetic_config();
  c.scaffold = true;
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < 32; ++i) idx.push_back(i);  // two batches of 16
  auto without = make_fl_trainer(c);
  const std::vector<float> w = without->initial_weights();
  std::vector<float> corr(w.size());
  for (size_t i = 0; i < corr.size(); ++i) corr[i] = 0.5f * std::sin(float(i));
  fl::LocalWork work;
  work.seed = 5;
  work.correction = &corr;
  work.max_steps = 1;
  const fl::LocalResult one = without->train(w, idx, work);
  work.max_steps = 2;
  const fl::LocalResult two = without->train(w, idx, work);
  c.mu = 0.5;
  auto with = make_fl_trainer(c);
  const fl::LocalResult prox = with->train(w, idx, work);
  ASSERT_EQ(prox.steps, 2);
  double worst = 0, moved = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    const double want = double(two.delta[i]) - c.lr * c.mu * double(one.delta[i]);
    worst = std::max(worst, std::abs(double(prox.delta[i]) - want));
    moved = std::max(moved, std::abs(double(prox.delta[i] - two.delta[i])));
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(moved, 1e-5);  // (the proximal term did change the second step)
}

fl::FlResult run_real_federation(const fl::FlConfig& c) {
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  cc.measure_cost_model = false;
  auto comms = coll::Communicator::inproc(c.workers, 0, cc);
  fl::FlResult server;
  std::vector<std::string> errors(size_t(c.workers));
  std::vector<std::thread> ts;
  for (int r = 0; r < c.workers; ++r)
    ts.emplace_back([&, r] {
      try {
        auto t = make_fl_trainer(c);
        auto res = fl::run_federation(c, comms[size_t(r)], *t);
        if (r == 0) server = std::move(res);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
        comms[size_t(r)]->transport().abort(e.what());  // (a trainer that failed to build: the others stop now)
      }
    });
  for (auto& t : ts) t.join();
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return server;
}

TEST(FlClient, AScaffoldFederationOfRealModelsLearnsUnderSecureAggregation) {
  fl::FlConfig c = synthetic_config();
  c.scaffold = true;
  c.partition = "dirichlet:0.3";
  fl::FlResult server = run_real_federation(c);
  ASSERT_EQ(server.rounds.size(), 4u);
  EXPECT_GT(server.final_accuracy, 0.9);  // 10 classes: chance is 0.1
  EXPECT_LT(server.rounds[3].test_loss, 0.8 * server.rounds[0].test_loss);
}

TEST(FlClient, AFederationOfRealModelsLearnsUnderSecureAggregation) {
  fl::FlResult server = run_real_federation(synthetic_config());
  ASSERT_EQ(server.rounds.size(), 4u);
  EXPECT_GT(server.final_accuracy, 0.9);  // 10 classes: chance is 0.1
  EXPECT_LT(server.rounds[3].test_loss, 0.8 * server.rounds[0].test_loss);
  for (auto& r : server.rounds) EXPECT_EQ(r.aggregated, 4);
}

std::string run_cli(const std::string& args, int* rc) {
  // (as a launcher: an outer launcher's variables would make it one rank)
  std::string cmd = "env -u WORLD_SIZE -u RANK -u OMPI_COMM_WORLD_SIZE -u PMI_SIZE -u PMIX_SIZE " +
                    std::string(CONDUIT_BINARY) + " fl " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

TEST(FlProcess, TheCommandRunsAFederationOfProcessesAndWritesItsRecords) {
  const fs::path out = fs::temp_directory_path() / ("conduit-fl-" + std::to_string(::getpid()));
  fs::remove_all(out);
  int rc = 0;
  std::string o = run_cli(
      "--model mlp --dataset synthetic --synthetic-samples 1024 --clients 6 --fraction 0.5 "
      "--rounds 3 --batch-size 16 --partition shards:2 --dropout 0.2 --secagg-bits 16 "
      "--output " +
          out.string(),
      &rc);
  ASSERT_EQ(rc, 0) << o;
  EXPECT_NE(o.find("conduit fl: mlp on synthetic, 6 clients (shards:2"), std::string::npos) << o;
  EXPECT_NE(o.find("secure aggregation (16 bits)"), std::string::npos) << o;
  std::ifstream m(out / "metrics.jsonl");
  std::string line;
  int lines = 0, abandoned = 0;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["kind"], "round");
    EXPECT_EQ(j["round"].get<int>(), lines + 1);
    EXPECT_EQ(j["sampled"].get<int>(), 3);
    EXPECT_GT(j["bytes_up"].get<uint64_t>(), 0u);
    abandoned += j["abandoned"].get<bool>() ? 1 : 0;
    if (!j["abandoned"].get<bool>()) {
      EXPECT_EQ(j["aggregated"].get<int>() + j["dropouts"].get<int>() + j["stragglers"].get<int>(), 3) << line;
    }
    ++lines;
  }
  EXPECT_EQ(lines, 3);
  std::ifstream s(out / "summary.json");
  auto j = nlohmann::json::parse(s);
  EXPECT_EQ(j["kind"], "summary");
  EXPECT_GT(j["final_test_accuracy"].get<double>(), 0.3);  // 10 classes (chance 0.1), label-skewed clients
  EXPECT_EQ(j["secagg_bits"].get<int>(), 16);
  EXPECT_EQ(j["rounds_applied"].get<int>() + 0, 3 - abandoned) << j.dump();
  EXPECT_GT(j["label_tv_distance"].get<double>(), 0.5);  // two label-sorted shards a client
  EXPECT_GT(j["modelled_time_s"].get<double>(), 0);
  // The output folder now holds a run: a second one into it is refused before anything starts.
  o = run_cli("--model mlp --dataset synthetic --output " + out.string(), &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("holds an earlier run's metrics.jsonl"), std::string::npos) << o;
  fs::remove_all(out);
}

// The warning that epsilon does not cover rounds secure aggregation abandons comes with noise only: clipping alone
// accounts no epsilon (it warned about one that did not exist).
TEST(FlProcess, TheEpsilonWarningComesWithNoiseOnly) {
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-dpw-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  for (const char* noise : {"0", "1"}) {
    int rc = 0;
    const std::string o = run_cli(
        // (Poisson sampling from the operating system's secret: 20 clients at 0.5 leave a round under 2 sampled,
        // abandoned, 2e-5 of the time, and both rounds so 4e-10; 10 at 0.4 and one round failed a run in the suite)
        "--model mlp --dataset synthetic --synthetic-samples 256 --clients 20 --fraction 0.5 --rounds 2 "
        "--batch-size 32 --dropout 0.1 --dp-clip 1 --dp-noise " +
            std::string(noise) + " --progress false --output " + (dir / noise).string(),
        &rc);
    EXPECT_EQ(rc, 0) << o;
    EXPECT_EQ(o.find("epsilon does not cover rounds") != std::string::npos, std::string(noise) == "1") << o;
  }
  fs::remove_all(dir);
}

// The adaptive server optimizers' rate defaults to 0.01 (FedAdam at FedAvg's 1 diverged within 3 rounds); a given
// one is kept, and FedAvg keeps 1.
TEST(FlProcess, AdaptiveServerOptimizersDefaultToASmallServerRate) {
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-slr-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto server_lr = [&](const std::string& flags, const std::string& name) {
    int rc = 0;
    const std::string o = run_cli(
        "--model mlp --dataset synthetic --synthetic-samples 256 --clients 4 --rounds 1 "
        "--batch-size 32 --secagg false --progress false --output " +
            (dir / name).string() + " " + flags,
        &rc);
    EXPECT_EQ(rc, 0) << o;
    std::ifstream f(dir / name / "config.json");
    return nlohmann::json::parse(f).value("server_lr", -1.0);
  };
  EXPECT_EQ(server_lr("--server-opt fedadam", "adam"), 0.01);
  EXPECT_EQ(server_lr("--server-opt fedyogi --server-lr 0.3", "yogi"), 0.3);
  EXPECT_EQ(server_lr("", "avg"), 1.0);
  // A resume keeps its checkpoint's rate (one written at 1 before this default was refused as another setting).
  EXPECT_EQ(server_lr("--server-opt fedadam --server-lr 1 --checkpoint-every 1", "one"), 1.0);
  EXPECT_EQ(server_lr("--server-opt fedadam --rounds 2 --resume " + (dir / "one").string(), "two"), 1.0);
  fs::remove_all(dir);
}

TEST(FlProcess, RanksOfAnOuterLauncherWithOtherSettingsAllStopNamingTheKey) {
  const fs::path out = fs::temp_directory_path() / ("conduit-fl-mismatch-" + std::to_string(::getpid()));
  fs::remove_all(out);
  // Under `conduit launch` each process is one rank; rank r asks for r + 2 rounds.
  const std::string cmd = std::string(CONDUIT_BINARY) + " launch -n 3 -- sh -c 'exec " + CONDUIT_BINARY +
                          " fl --model mlp --dataset synthetic --synthetic-samples 512 --clients 6 --rounds "
                          "$((RANK+2)) --output " +
                          out.string() + "' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string o;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) o.append(buf, n);
  const int st = pclose(p);
  // Every rank stops with its line; the launcher stops the others once the first has exited, so only the first
  // line is sure to be printed.
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << o;
  EXPECT_TRUE(o.find("fl: rounds: rank 1 has 3, rank 0 has 2") != std::string::npos ||
              o.find("fl: rounds: rank 2 has 4, rank 0 has 2") != std::string::npos ||
              o.find("fl: rank(s) 1, 2 refused the settings") != std::string::npos)
      << o;
  EXPECT_EQ(o.find("Timeout"), std::string::npos) << o;
  EXPECT_FALSE(fs::exists(out)) << "rank 0 wrote into the output folder of a run that never started";
  fs::remove_all(out);
}

TEST(FlProcess, TheCommandResumesFromItsCheckpointsAndRefusesOtherSettingsBeforeStarting) {
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-resume-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string flags =
      "--model mlp --dataset synthetic --synthetic-samples 1024 --clients 4 --fraction 0.5 --batch-size 16 "
      "--scaffold --progress false ";
  int rc = 0;
  std::string o = run_cli(flags + "--rounds 2 --checkpoint-every 1 --output " + (dir / "a").string(), &rc);
  ASSERT_EQ(rc, 0) << o;
  EXPECT_TRUE(fs::exists(dir / "a" / "checkpoints" / "server-2.bin"));
  EXPECT_TRUE(fs::exists(dir / "a" / "checkpoints" / "host-2-2.bin"));
  o = run_cli(flags + "--rounds 3 --resume " + (dir / "a").string() + " --output " + (dir / "b").string(), &rc);
  ASSERT_EQ(rc, 0) << o;
  std::ifstream m(dir / "b" / "metrics.jsonl");
  std::string line;
  std::vector<int> rounds;
  while (std::getline(m, line)) rounds.push_back(nlohmann::json::parse(line)["round"].get<int>());
  EXPECT_EQ(rounds, std::vector<int>{3});
  std::ifstream s(dir / "b" / "summary.json");
  EXPECT_EQ(nlohmann::json::parse(s)["first_round"].get<int>(), 3);
  // Other settings, or a folder without checkpoints: one line, before any process starts.
  o = run_cli(flags + "--lr 0.1 --rounds 3 --resume " + (dir / "a").string() + " --output " + (dir / "c").string(),
              &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("fl: resume: lr is 0.1 here"), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  o = run_cli(flags + "--rounds 3 --resume " + (dir / "b").string() + " --output " + (dir / "d").string(), &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("holds no complete checkpoint"), std::string::npos) << o;
  fs::remove_all(dir);
}

TEST(FlProcess, BadFlagsStopBeforeAnyProcessStartsWithOneLine) {
  int rc = 0;
  std::string o = run_cli("--partition dirichlet:0", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("dirichlet:0"), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  o = run_cli("--rounds 0", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("fl: rounds: 0 is out of range"), std::string::npos) << o;
  o = run_cli("--secagg-neighbors 5", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("fl: secagg_neighbors: 5 is not allowed; allowed: 0 (every pair"), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  o = run_cli("--config /nonexistent/fl.json", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("cannot read '/nonexistent/fl.json'"), std::string::npos) << o;
  // From a bad-input audit: a deeply nested value of a known key (its dump overflowed the stack: a segfault), a key
  // given twice (the last won), ' -1' as an unsigned seed (wrapped to 2^64 - 1), an empty value (named 'true'), a
  // hexadecimal float, and a pipe named as a checkpoint (read for ever).
  const fs::path dir = fs::temp_directory_path() / ("conduit-fl-bad-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "ck");
  std::ofstream(dir / "deep.json") << "{\"model\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  std::ofstream(dir / "twice.json") << R"({"rounds": 1, "rounds": 2})";
  ASSERT_EQ(::mkfifo((dir / "ck" / "server-1.bin").c_str(), 0600), 0);
  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"--config " + (dir / "deep.json").string(), "key 'model' has a value of the wrong type (an array)"},
           {"--config " + (dir / "twice.json").string(), "key 'rounds' is given twice; give it once"},
           {"--seed ' -1'", "fl: seed: ' -1' is not an integer in [0, 18446744073709551615]"},
           // (a key's own range, not int's)
           {"--rounds 2.5", "fl: rounds: '2.5' is not an integer in [1, 1000000]"},
           {"--server-lr 0", "fl: server_lr: 0 is out of range; allowed: a finite number > 0"},
           {"--dp-clip 1 --min-clients 5", "fl: min_clients: 5 does not apply under differential privacy"},
           {"--fraction ''", "fl: fraction: '' is not a number"},
           {"--lr 0x1p-3", "fl: lr: '0x1p-3' is not a number"},
           {"--dataset synthetic --resume " + (dir / "ck").string() + " --output " + (dir / "out").string(),
            "server-1.bin' is not a regular file"}}) {
    o = run_cli(args, &rc);
    EXPECT_EQ(rc, 2) << args << ": " << o;
    EXPECT_NE(o.find(want), std::string::npos) << args << ": " << o;
    EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << args << ": " << o;
  }
  fs::remove_all(dir);
  // What the data cannot hold is found from its size before any process starts.
  o = run_cli("--dataset synthetic --synthetic-samples 64 --clients 100", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("fl: clients: 100 clients for 64 training samples"), std::string::npos) << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
  // And a secure aggregation whose share relay would not fit the machine (every pair of 65,535 clients a round).
  o = run_cli("--dataset synthetic --synthetic-samples 65535 --clients 65535 --fraction 1 --secagg-neighbors 0", &rc);
  EXPECT_EQ(rc, 2);
  EXPECT_NE(o.find("fl: secagg: 65535 clients a round with every pair sharing keys would relay"), std::string::npos)
      << o;
  EXPECT_EQ(std::count(o.begin(), o.end(), '\n'), 1) << o;
}

}  // namespace
}  // namespace conduit::train
