#pragma once
// Helpers shared by the training tests: in-process ranks, a tiny configuration, the `conduit train` binary.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "coll/communicator.h"
#include "core/error.h"
#include "temp_dirs.h"
#include "torch/config.h"
#include "torch/trainer.h"

namespace conduit::train::test_util {

namespace fs = std::filesystem;

inline fs::path temp_dir(const std::string& name) { return conduit::test::temp_dir("conduit-train-test", name); }

// The one-line ConfigError message of resolve_config(raw); empty when it passes.
inline std::string config_error(const RawConfig& raw, int env_world = 0) {
  try {
    resolve_config(raw, env_world, raw.count("workers") > 0);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// The one-line ConfigError message fn() throws; empty when it passes.
inline std::string config_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

inline void expect_one_line(const std::string& msg, const std::string& field) {
  EXPECT_FALSE(msg.empty()) << "no error for " << field;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NE(msg.find(field), std::string::npos) << msg;
  EXPECT_NE(msg.find("allowed"), std::string::npos) << msg;
}

// Runs train_worker on `world` in-process ranks (threads) and returns every rank's result; `cfg` sets the
// communicators' options (as `conduit train` sets their deadline from timeout_s).
// (ranks_per_host: rank r on host r / ranks_per_host; 0: one host; model: the links' cost model the ranks' tuner
// chooses algorithms by, where not the defaults)
inline std::vector<TrainResult> train_inproc(const TrainConfig& c, int world, bool outputs = false,
                                             const coll::CommConfig& cfg = {}, int ranks_per_host = 0,
                                             const coll::CostModel* model = nullptr) {
  auto comms = coll::Communicator::inproc(world, ranks_per_host, cfg);
  if (model != nullptr)
    for (auto& comm : comms) comm->tuner().set_model(*model);
  std::vector<TrainResult> res(static_cast<size_t>(world));
  std::vector<std::exception_ptr> errs(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) {
    ts.emplace_back([&, r] {
      try {
        WorkerOptions o;
        o.keep_params = true;
        o.write_outputs = outputs;
        res[size_t(r)] = train_worker(c, comms[size_t(r)], o);
      } catch (...) {
        errs[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  return res;
}

// Runs `c` on `world` ranks straight (into dir/straight), then stopped at step `stop_at` with a checkpoint there
// (dir/part) and resumed from it to c's end (dir/rest): the straight run's and the resumed run's results.
inline std::pair<std::vector<TrainResult>, std::vector<TrainResult>> straight_and_resumed(
    const TrainConfig& c, int world, int64_t stop_at, const std::filesystem::path& dir) {
  TrainConfig straight = c;
  straight.output = (dir / "straight").string();
  auto whole = train_inproc(straight, world, true);
  TrainConfig part = c;
  part.max_steps = stop_at;
  part.checkpoint_every = stop_at;
  part.output = (dir / "part").string();
  train_inproc(part, world, true);
  TrainConfig rest = c;
  rest.resume = (dir / "part" / "checkpoint").string();
  rest.output = (dir / "rest").string();
  return {whole, train_inproc(rest, world, true)};
}

inline TrainConfig tiny(const std::string& model) {
  TrainConfig c;
  c.model = model;
  c.compressor = "none";
  c.dataset = "synthetic";
  c.synthetic_samples = 384;
  c.test_limit = 64;
  c.epochs = 1;
  c.batch_size = 8;
  c.lr = 0.05;
  c.lr_schedule = "constant";
  c.progress = false;
  c.seed = 3;
  c.bucket_cap_mb = 0.05;  // several buckets
  c.first_bucket_mb = 0.01;
  return c;
}

inline double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, std::abs(double(a[i]) - double(b[i])) / (1e-3 + std::abs(double(b[i]))));
  return m;
}

// The `conduit train` binary.
struct CliRun {
  int code;
  std::string out;
};

inline CliRun run_conduit(const std::string& args) {
  std::string cmd = std::string(CONDUIT_BINARY) + " train " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128, out};
}

}  // namespace conduit::train::test_util
