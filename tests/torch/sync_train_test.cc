// `conduit train --sync`: the synchronization schemes of src/sync driving real libtorch training. Schemes that
// are mathematically BSP (local SGD with period 1, parameter servers in BSP mode) match the DistributedOptimizer;
// every scheme trains; checkpoints resume; configuration errors are one line; straggler injection slows one rank.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "sync/straggler.h"
#include "torch/config.h"
#include "torch/metrics.h"
#include "torch/scheme_optimizer.h"
#include "torch/trainer.h"
#include "train_util.h"

namespace conduit::train {
namespace {

namespace fs = std::filesystem;
using namespace test_util;

TrainConfig tiny_sync(const std::string& sync) {
  TrainConfig c = tiny("mlp");
  c.sync = sync;
  c.momentum = 0.9;
  return c;
}

TEST(TrainSync, LocalSgdWithPeriodOneEqualsBsp) {
  // Averaging the parameters after every momentum step is averaging the gradients (the update is linear in them).
  TrainConfig bsp = tiny_sync("bsp");
  bsp.max_steps = 10;
  TrainConfig local = bsp;
  local.sync = "local:period=1";
  auto a = train_inproc(bsp, 2), b = train_inproc(local, 2);
  EXPECT_EQ(b[0].params, b[1].params);  // replicas agree after an average
  EXPECT_LT(max_rel_diff(b[0].params, a[0].params), 1e-4);
  // Uncompressed either way: the payload is the gradient's size (it was the ring's 2(W-1)/W volume: ratio 0.67 with
  // 4 workers).
  EXPECT_EQ(a[0].payload_bytes, a[0].grad_bytes);
  EXPECT_EQ(b[0].payload_bytes, b[0].grad_bytes);
  auto four = train_inproc(local, 4);
  EXPECT_EQ(four[0].payload_bytes, four[0].grad_bytes);
  EXPECT_EQ(four[0].bytes_sent * 2, four[0].grad_bytes * 3);  // the ring's volume: 2(W-1)/W = 1.5x
  // ... and a longer period does not.
  TrainConfig h4 = bsp;
  h4.sync = "local:period=4";
  h4.max_steps = 10;  // the last average was at step 8; finish() averages once more
  auto c = train_inproc(h4, 2);
  EXPECT_EQ(c[0].params, c[1].params);
  EXPECT_GT(max_rel_diff(c[0].params, a[0].params), 1e-3);
  // Bytes: one parameter allreduce every 4 steps plus the final one, 2 (W-1)/W * 4d each.
  const double per = double(c[0].grad_bytes) / 10;  // 4d
  EXPECT_NEAR(double(c[0].bytes_sent), 3 * per, 64);
  EXPECT_NEAR(double(c[0].payload_bytes), 3 * per, 64);  // three averages' payloads: compression ratio 10/3
}

// Co-located servers' byte counts: a worker receives its pulls only (the final allreduce of the shards was counted
// as received too, and the trainer adds a parameter server worker's receives to the bytes on the wire: 7.7% over),
// and an uncompressed push is a payload of the gradient's size plus its header, its own shard's too (the ratio
// read W/(W-1) with nothing compressed).
TEST(TrainSync, ColocatedServersCountTheirBytesOnce) {
  TrainConfig c = tiny_sync("ps-asp:colocate=1");
  c.max_steps = 10;
  auto r = train_inproc(c, 2);
  const uint64_t d4 = r[1].grad_bytes / 10;  // 4d bytes a step
  // Rank 1 pulls the shard on rank 0 every step, the same bytes each time: ten pulls and nothing else (the final
  // allreduce added 2(W-1)/W 4d = 4d to them).
  EXPECT_EQ(r[1].bytes_recv % 10, 0u) << r[1].bytes_recv;
  EXPECT_LT(r[1].bytes_recv, 10 * (16 + d4)) << r[1].bytes_recv;
  EXPECT_GT(r[1].bytes_recv, 10 * (16 + d4 / 3)) << r[1].bytes_recv;
  for (int k = 0; k < 2; ++k)
    EXPECT_NEAR(double(r[k].grad_bytes) / double(r[k].payload_bytes), 1.0, 0.001) << "rank " << k;
}

TEST(TrainSync, ParameterServersInBspModeEqualBsp) {
  // The servers own SGD with momentum: the same update as the workers' torch::optim::SGD on averaged gradients.
  TrainConfig bsp = tiny_sync("bsp");
  bsp.max_steps = 8;
  auto ref = train_inproc(bsp, 2);
  for (std::string spec : {"ps-bsp", "ps-bsp:servers=3"}) {
    TrainConfig c = bsp;
    c.sync = spec;
    auto r = train_inproc(c, 2);
    EXPECT_EQ(r[0].params, r[1].params) << spec;
    EXPECT_LT(max_rel_diff(r[0].params, ref[0].params), 1e-4) << spec;
  }
  // Dedicated servers: 3 ranks are 2 workers and 1 server; the server rank returns an empty result.
  TrainConfig ded = bsp;
  ded.sync = "ps-bsp:colocate=0";
  auto r = train_inproc(ded, 3);
  EXPECT_LT(max_rel_diff(r[0].params, ref[0].params), 1e-4);
  EXPECT_EQ(r[2].steps, 0);
  EXPECT_TRUE(r[2].params.empty());
  // Pushes and pulls are counted: 4d (+ header) each way per step.
  EXPECT_GT(r[0].bytes_sent, 8 * uint64_t(r[0].grad_bytes / 8));
  EXPECT_GT(r[0].bytes_recv, 8 * uint64_t(r[0].grad_bytes / 8));
}

// A clock's pushes are summed in worker order, not as they arrive: runs of 4 workers are bit-identical (float addition
// is not associative: with 3 or more workers each run's model differed), with a straggler reordering arrivals.
TEST(TrainSync, ParameterServersInBspModeRepeatBitForBitWithFourWorkers) {
  TrainConfig c = tiny_sync("ps-bsp");
  c.max_steps = 8;
  auto first = train_inproc(c, 4);
  c.slow = "0:3";  // (rank 0's pushes come last now; the sums must not notice)
  for (int run = 0; run < 2; ++run) {
    auto again = train_inproc(c, 4);
    for (size_t k = 0; k < 4; ++k) EXPECT_EQ(again[k].params, first[k].params) << "run " << run << " rank " << k;
  }
}

TEST(TrainSync, LearningRateScheduleReachesTheServers) {
  // With a cosine schedule the servers' steps shrink with the trainer's: ps-bsp with momentum 0 equals bsp (SGD
  // without momentum scales the step and the gradient alike).
  TrainConfig bsp = tiny_sync("bsp");
  bsp.momentum = 0;
  bsp.lr_schedule = "cosine";
  bsp.max_steps = 12;
  auto ref = train_inproc(bsp, 2);
  TrainConfig ps = bsp;
  ps.sync = "ps-bsp";
  auto r = train_inproc(ps, 2);
  EXPECT_LT(max_rel_diff(r[0].params, ref[0].params), 1e-4);
  // SSP with s = 0 applies each clock's mean once, as BSP (with momentum too: sync/ps_test.cc).
  TrainConfig ssp0 = ps;
  ssp0.sync = "ps-ssp:staleness=0";
  auto s0 = train_inproc(ssp0, 2);
  EXPECT_LT(max_rel_diff(s0[0].params, ref[0].params), 1e-4);
  TrainConfig constant = ps;
  constant.lr_schedule = "constant";
  auto k = train_inproc(constant, 2);
  EXPECT_GT(max_rel_diff(k[0].params, ref[0].params), 1e-3);
}

// The trainer's drift_timeout_s reaches the scheme (through SyncSpec), raised to the communicator's timeout where
// below.
TEST(TrainSync, TheDriftTimeoutReachesTheScheme) {
  coll::CommConfig cfg;
  cfg.timeout_s = 2;
  cfg.measure_cost_model = false;
  auto comms = coll::Communicator::inproc(1, 0, cfg);
  auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
  auto opt = std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  SyncSpec spec = effective_sync(tiny_sync("local:period=2"));
  EXPECT_EQ(spec.drift_timeout_s, 1800);
  spec.drift_timeout_s = 42;
  EXPECT_EQ(SchemeOptimizer(model, opt, comms[0], spec, 0.1).drift_timeout_s(), 42);
  spec.drift_timeout_s = 1;
  EXPECT_EQ(SchemeOptimizer(model, opt, comms[0], spec, 0.1).drift_timeout_s(), 2);
}

// |a - b| / |b| (Euclidean norms).
double rel_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    n += double(b[i]) * b[i];
  }
  EXPECT_EQ(a.size(), b.size());
  return std::sqrt(d / std::max(n, 1e-30));
}

TEST(TrainSync, EverySchemeTrains) {
  for (std::string spec : {"local:period=4", "local:period=2,warmup=6", "local:adaptive=1,period=2", "diloco:period=4",
                           "easgd:period=2", "dpsgd", "dpsgd:graph=exponential", "sgp", "adpsgd", "ps-asp",
                           "ps-ssp:staleness=2", "ps-ssp:servers=2,colocate=0"}) {
    TrainConfig c = tiny_sync(spec);
    const bool dedicated = spec.find("colocate=0") != std::string::npos;
    auto r = train_inproc(c, dedicated ? 5 : 3);  // 3 workers (+ 2 server ranks)
    for (int w = 0; w < 3; ++w) {
      EXPECT_EQ(r[size_t(w)].steps, 16) << spec;  // 384 samples / (3 workers x 8)
      EXPECT_GT(r[size_t(w)].bytes_sent + r[size_t(w)].bytes_recv, 0u) << spec << " rank " << w;
      EXPECT_DOUBLE_EQ(r[size_t(w)].test_accuracy, r[0].test_accuracy) << spec;  // worker 0's, for everyone
      // One model at the end where the scheme ends with one (an average, the servers' or the center's); gossip
      // without a final average (D-PSGD, SGP) near consensus: with 3 workers D-PSGD's ring averages all three every
      // step (f32 rounding apart); SGP's replicas ended 1% apart (0.0098 on 2026-12-07).
      if (spec.rfind("sgp", 0) == 0 || spec.rfind("dpsgd", 0) == 0)
        EXPECT_LT(rel_distance(r[size_t(w)].params, r[0].params), spec == "sgp" ? 0.05 : 1e-6) << spec << " rank " << w;
      else
        EXPECT_EQ(r[size_t(w)].params, r[0].params) << spec << " rank " << w;
    }
    EXPECT_GT(r[0].test_accuracy, 0.5) << spec;  // the synthetic classes are easy; chance is 0.1
  }
  // DiLoCo with its published inner optimizer, AdamW (decoupled weight decay), and no inner momentum to stack.
  TrainConfig c = tiny_sync("diloco:period=4");
  c.optimizer = "adamw";
  c.lr = 0.01;
  c.weight_decay = 0.01;
  auto r = train_inproc(c, 3);
  EXPECT_EQ(r[0].steps, 16);
  EXPECT_GT(r[0].test_accuracy, 0.5);
  EXPECT_EQ(r[0].params, r[1].params);  // one model after the final outer step
}

// BatchNorm's running statistics follow each worker's own data under schemes other than bsp; the model a run ends
// with takes their mean as it takes the parameters' (worker 0 evaluated averaged parameters with its own statistics).
TEST(TrainSync, BatchNormStatisticsEndAveragedWithTheModel) {
  TrainConfig c = tiny_sync("local:period=2");
  c.model = "resnet";
  c.max_steps = 3;
  auto r = train_inproc(c, 2);
  ASSERT_FALSE(r[0].buffers.empty());
  EXPECT_EQ(r[1].params, r[0].params);    // local SGD's final average
  EXPECT_EQ(r[1].buffers, r[0].buffers);  // and the statistics' mean
  // Asynchronous pairwise gossip, and parameter servers on ranks of their own (the mean is over the workers only).
  c.sync = "adpsgd";
  r = train_inproc(c, 2);
  EXPECT_EQ(r[1].buffers, r[0].buffers);
  c.sync = "ps-asp:colocate=0";
  r = train_inproc(c, 3);  // 2 workers + 1 server
  ASSERT_FALSE(r[1].buffers.empty());
  EXPECT_EQ(r[1].buffers, r[0].buffers);
}

TEST(TrainSync, CompressorsGoWhereTheSchemeCompresses) {
  TrainConfig c = tiny_sync("ps-asp");
  c.compressor = "ef:topk:ratio=0.1";
  auto spec = effective_sync(c);
  EXPECT_EQ(spec.params.at("push_compressor"), "ef:topk:ratio=0.1");
  // ps-asp: one momentum per worker with the look-ahead (dana), at the trainer's lr and momentum.
  EXPECT_EQ(spec.params.at("dana"), "1");
  EXPECT_EQ(spec.params.at("momentum"), "0.9");
  EXPECT_EQ(spec.params.at("lr"), "0.05");
  // dana=0 (one shared momentum): momentum at most 0.5, with half the trainer's lr / (1 - momentum).
  auto shared = effective_sync(tiny_sync("ps-asp:dana=0"));
  EXPECT_EQ(shared.params.at("momentum"), "0.5");
  EXPECT_NEAR(std::stod(shared.params.at("lr")), 0.5 * 0.05 * 0.5 / 0.1, 1e-12);
  // ps-ssp with s > 0 (its default 3) is asynchronous within the bound and takes the same; s = 0 is bsp.
  TrainConfig ssp = tiny_sync("ps-ssp");
  EXPECT_EQ(effective_sync(ssp).params.at("dana"), "1");
  EXPECT_EQ(effective_sync(ssp).params.at("momentum"), "0.9");
  EXPECT_EQ(effective_sync(tiny_sync("ps-ssp:dana=0")).params.at("momentum"), "0.5");
  ssp.staleness = 0;
  EXPECT_EQ(effective_sync(ssp).params.count("dana") ? effective_sync(ssp).params.at("dana") : "0", "0");
  EXPECT_EQ(effective_sync(ssp).params.at("momentum"), "0.9");
  EXPECT_EQ(effective_sync(ssp).params.at("lr"), "0.05");
  // s = 0 written another way is still bsp (the check compared the text with "0").
  TrainConfig ssp00 = tiny_sync("ps-ssp:staleness=00");
  EXPECT_EQ(effective_sync(ssp00).params.count("dana") ? effective_sync(ssp00).params.at("dana") : "0", "0");
  TrainConfig given = tiny_sync("ps-asp:momentum=0.9");  // what the spec gives stays
  EXPECT_EQ(effective_sync(given).params.at("lr"), "0.05");
  EXPECT_EQ(spec.params.at("colocate"), "1");
  EXPECT_EQ(spec.params.at("servers"), "4");  // one shard per worker (resolve_config's default of 4 workers)
  // ... written as true too (it left servers at 1: every worker's traffic and all the servers' work on rank 0), and
  // colocate=false is refused at a resume as colocate=0 is (it failed later, naming a missing checkpoint).
  EXPECT_EQ(effective_sync(tiny_sync("ps-asp:colocate=true")).params.at("servers"), "4");
  TrainConfig resumed = tiny_sync("ps-asp:colocate=false");
  resumed.resume = "/nonexistent/checkpoint";
  try {
    effective_sync(resumed);
    ADD_FAILURE() << "colocate=false resumed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("dedicated server ranks (colocate=0)"), std::string::npos) << e.what();
  }
  auto dense = train_inproc(tiny_sync("ps-asp"), 2);
  auto r = train_inproc(c, 2);
  EXPECT_LT(r[1].bytes_sent * 3, dense[1].bytes_sent);  // top-10% pushes (values + indices) from worker 1
  EXPECT_GT(r[0].test_accuracy, 0.5);
  TrainConfig g = tiny_sync("dpsgd");
  g.compressor = "topk:ratio=0.25";
  EXPECT_EQ(effective_sync(g).params.at("compressor"), "topk:ratio=0.25");  // CHOCO gossip
  auto rg = train_inproc(g, 3);
  EXPECT_GT(rg[0].test_accuracy, 0.5);
}

TEST(TrainSync, CheckpointResumeContinues) {
  // local SGD checkpointed between two averages (replicas differ) and parameter servers with co-located shards
  // (server parameters and momentum) resume where they were: bit for bit with 2 workers.
  for (std::string spec : {"local:period=4", "ps-bsp", "dpsgd"}) {
    auto dir = temp_dir("sync-resume");
    TrainConfig c = tiny_sync(spec);
    c.max_steps = 14;
    c.output = (dir / "straight").string();
    auto straight = train_inproc(c, 2, true);
    TrainConfig part = c;
    part.max_steps = 6;
    part.checkpoint_every = 6;
    part.output = (dir / "part").string();
    train_inproc(part, 2, true);
    auto meta = read_json_file((dir / "part" / "checkpoint" / "checkpoint.json").string());
    EXPECT_EQ(meta["step"].get<int64_t>(), 6) << spec;
    EXPECT_EQ(meta["sync"], spec.substr(0, spec.find(':'))) << spec;
    TrainConfig rest = c;
    rest.resume = (dir / "part" / "checkpoint").string();
    rest.output = (dir / "rest").string();
    auto r = train_inproc(rest, 2, true);
    EXPECT_EQ(r[0].params, straight[0].params) << spec;
    EXPECT_EQ(r[1].params, straight[1].params) << spec;
    EXPECT_EQ(r[0].steps, 14);
    // Another scheme cannot resume this checkpoint.
    TrainConfig other = rest;
    other.sync = spec == "dpsgd" ? "local" : "dpsgd";
    EXPECT_THROW(train_inproc(other, 2, true), ConfigError) << spec;
    // Nor the same scheme with other parameters (local SGD kept the checkpoint's period over the new one).
    if (spec == "local:period=4") {
      TrainConfig changed = rest;
      changed.sync = "local:period=8";
      std::string msg;
      try {
        train_inproc(changed, 2, true);
      } catch (const ConfigError& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find("written with sync local {"), std::string::npos) << msg;
      EXPECT_NE(msg.find("\"period\":\"8\""), std::string::npos) << msg;
      // The same parameters written differently, and a learning rate of the trainer's, resume (a flag or a number
      // spelled otherwise than recorded was another scheme).
      for (const char* spelled : {"local:period=4,warmup=0", "local:period=04,adaptive=false,target=0.010"}) {
        TrainConfig same = rest;
        same.sync = spelled;
        same.output = (dir / "same").string();
        EXPECT_NO_THROW(train_inproc(same, 2, true)) << spelled;
        fs::remove_all(dir / "same");
      }
    }
    if (spec == "ps-bsp") {
      TrainConfig lr = rest;
      lr.lr = 0.5 * c.lr;
      lr.output = (dir / "lr").string();
      EXPECT_NO_THROW(train_inproc(lr, 2, true));
    }
    fs::remove_all(dir);
  }
}

// adpsgd's passive ranks count the requests they answered at their next step: those answered after a passive rank's
// last step before a checkpoint go with the checkpoint and count in the resumed run (they were lost: 4 workers
// resumed at step 6 counted 7 replies fewer than an uninterrupted run).
TEST(TrainSync, AResumedAdpsgdRunCountsEveryReply) {
  auto dir = temp_dir("adpsgd-resume");
  TrainConfig c = tiny_sync("adpsgd");
  c.max_steps = 14;
  c.slow = "0:4,2:4";  // the initiating ranks: their last requests come after the answering ranks' last step
  const auto [straight, r] = straight_and_resumed(c, 4, 6, dir);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(r[k].bytes_sent, straight[k].bytes_sent) << "rank " << k;
    EXPECT_EQ(r[k].bytes_recv, straight[k].bytes_recv) << "rank " << k;
  }
  fs::remove_all(dir);
}

// The scheme's own parameters that share a name with the trainer's (DiLoCo's outer momentum) were dropped from the
// checkpoint with the trainer's: a resume given only --resume ran at the default momentum, and another momentum was
// accepted. Those the trainer derives (the servers' lr) may still change, as the ps-bsp case above checks.
TEST(TrainSync, AResumeKeepsTheSchemesOwnMomentum) {
  auto dir = temp_dir("diloco-resume");
  TrainConfig part = tiny_sync("diloco:momentum=0.5,period=2");
  part.max_steps = 4;
  part.checkpoint_every = 4;
  part.output = (dir / "part").string();
  train_inproc(part, 2, true);
  const std::string ck = (dir / "part" / "checkpoint").string();
  auto meta = read_json_file(ck + "/checkpoint.json");
  EXPECT_EQ(meta["sync_params"]["momentum"], "0.5") << meta["sync_params"].dump();
  RawConfig raw{{"resume", ck}};
  apply_resume_defaults(raw, false);
  EXPECT_NE(raw["sync"].find("momentum=0.5"), std::string::npos) << raw["sync"];
  for (const char* other : {"diloco:period=2", "diloco:momentum=0.95,period=2"}) {
    TrainConfig rest = part;
    rest.sync = other;
    rest.max_steps = 6;
    rest.resume = ck;
    rest.output = (dir / "rest").string();
    std::string msg;
    try {
      train_inproc(rest, 2, true);
    } catch (const ConfigError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("\"momentum\":\"0.5\""), std::string::npos) << other << ": " << msg;
  }
  TrainConfig same = part;
  same.max_steps = 6;
  same.resume = ck;
  same.output = (dir / "same").string();
  EXPECT_NO_THROW(train_inproc(same, 2, true));
  fs::remove_all(dir);
}

TEST(TrainSync, StragglerSleepsOnlyOnItsRankAndOutputsNameTheScheme) {
  auto dir = temp_dir("straggler");
  TrainConfig c = tiny_sync("adpsgd");
  c.slow = "1:2";
  c.trace = true;
  c.max_steps = 6;
  c.eval_every = 3;
  c.target_accuracy = 0.2;
  c.output = dir.string();
  train_inproc(c, 2, true);
  auto names = [&](int rank) {
    std::set<std::string> n;
    auto t = read_json_file((dir / fmt::format("trace-rank{}.json", rank)).string());
    for (auto& e : t) n.insert(e["name"].get<std::string>());
    return n;
  };
  EXPECT_FALSE(names(0).count("straggler sleep"));
  EXPECT_TRUE(names(1).count("straggler sleep"));
  EXPECT_TRUE(names(0).count("sync after_step"));
  auto s = read_json_file((dir / "summary.json").string());
  EXPECT_EQ(s["sync"], "adpsgd");
  EXPECT_EQ(s["slow"], "1:2");
  EXPECT_FALSE(s["time_to_target_s"].is_null());
  int evals = 0, finals = 0;
  std::ifstream m(dir / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    evals += j["kind"] == "eval";
    finals += j["kind"] == "final";
  }
  EXPECT_EQ(evals, 2);  // copies at step 3 and at the (partial) epoch's end, step 6
  EXPECT_EQ(finals, 1);
  fs::remove_all(dir);
}

TEST(TrainSync, AsynchronousWorkersMeetAStragglerPastTheirTimeout) {
  // Under ps-asp and adpsgd a fast worker finishes long before a straggler: at the end-of-run checkpoint it waited
  // in a barrier with the normal deadline and failed ("barrier ... did not complete before the deadline") after
  // training had succeeded. Worker 1 here is 600x slow (seconds behind), the timeout 1 s (0.5 s with 300x failed
  // once in a loaded run: a collective of the fast worker's own outlasted it).
  for (std::string sync : {"adpsgd", "ps-asp"}) {
    auto dir = temp_dir("async-end-" + sync);
    TrainConfig c = tiny_sync(sync);
    c.slow = "1:600";
    c.max_steps = 8;
    c.timeout_s = 1.0;
    // With copies to evaluate too: their evaluation ran before the workers met, under the short deadline.
    c.eval_every = 2;
    c.output = dir.string();
    c.trace = true;
    coll::CommConfig cc;
    cc.timeout_s = c.timeout_s;
    auto res = train_inproc(c, 2, true, cc);
    EXPECT_EQ(res[0].steps, 8) << sync;
    EXPECT_EQ(res[1].steps, 8) << sync;
    EXPECT_TRUE(fs::exists(dir / "checkpoint" / "checkpoint.json")) << sync;
    // Worker 1 really slept, for longer than the deadline in all (the slowed steps' trace events alone were
    // counted before: a trainer that never slept passed this test without a straggler to meet).
    double slept_us = 0;
    auto t = read_json_file((dir / "trace-rank1.json").string());
    for (auto& e : t)
      if (e["name"] == "straggler sleep") slept_us += e["dur"].get<double>();
    EXPECT_GT(slept_us, 2 * c.timeout_s * 1e6) << sync;
    // The fast worker's run lasts until the straggler's last step: its wait at the end-of-run checkpoint is training
    // time, as under bsp (it was the checkpoint's: 0.15 s of wall time reported for an 18 s run).
    EXPECT_GT(res[0].wall_s, 0.8 * slept_us / 1e6) << sync;
    fs::remove_all(dir);
  }
  // A periodic scheme's workers are up to a period apart between its syncs: a checkpoint mid-period met them at a
  // barrier of one timeout, which a straggler that bsp waits for failed (a review: local and diloco, period 20, a
  // 150x straggler, --checkpoint-every 25, "barrier #3 ... failed after 1.0 s").
  for (std::string sync : {"local:period=6", "diloco:period=6"}) {
    auto dir = temp_dir("periodic-checkpoint");
    TrainConfig c = tiny_sync(sync);
    c.slow = "1:100";  // (~0.6 s a step behind here: 3 steps apart at the checkpoint)
    c.max_steps = 6;
    c.checkpoint_every = 3;
    c.timeout_s = 1.0;
    c.output = dir.string();
    coll::CommConfig cc;
    cc.timeout_s = c.timeout_s;
    auto res = train_inproc(c, 2, true, cc);
    EXPECT_EQ(res[0].steps, 6) << sync;
    EXPECT_EQ(res[1].steps, 6) << sync;
    EXPECT_TRUE(fs::exists(dir / "checkpoint" / "checkpoint.json")) << sync;
    fs::remove_all(dir);
  }
}

TEST(TrainSync, TransientStragglersSlowTheStepsTheirSeedDrawsOnEveryRank) {
  auto dir = temp_dir("transient-straggler");
  TrainConfig c = tiny_sync("ps-ssp");
  c.slow = "*:2@0.5";
  c.seed = 11;
  c.trace = true;
  c.max_steps = 20;
  c.eval_every = 0;
  c.output = dir.string();
  train_inproc(c, 2, true);
  for (int rank = 0; rank < 2; ++rank) {
    int traced = 0;
    auto t = read_json_file((dir / fmt::format("trace-rank{}.json", rank)).string());
    for (auto& e : t) traced += e["name"] == "straggler sleep";
    // The trainer slows exactly the steps that this rank's draws from the run's seed select (about half of 20).
    sync::Straggler replay(sync::parse_slow(c.slow), rank, c.seed);
    for (int i = 0; i < 20; ++i) replay.begin();
    EXPECT_EQ(traced, replay.slowed_steps()) << "rank " << rank;
    EXPECT_GT(traced, 0) << "rank " << rank;
    EXPECT_LT(traced, 20) << "rank " << rank;
  }
  fs::remove_all(dir);
}

TEST(TrainSync, ManyModelCopiesAreEvaluatedWithoutKeepingTheOtherWorkersPastTheirDeadline) {
  // 80 copies of worker 0's model over a 4000-image test set take worker 0 ~4 s to evaluate alone; the other
  // worker, waiting for it at the end of training, would fail its 2 s deadline. Evaluated by both workers one copy
  // at a time, no wait is longer than one copy's share (~30 ms).
  auto dir = temp_dir("many-copies");
  TrainConfig c = tiny_sync("ps-ssp");
  c.synthetic_samples = 16000;  // a test set of 4000
  c.test_limit = 0;
  c.train_limit = 1280;
  c.max_steps = 80;
  c.eval_every = 1;
  c.timeout_s = 2;
  c.output = dir.string();
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  train_inproc(c, 2, true, cc);
  int evals = 0;
  std::ifstream m(dir / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] != "eval") continue;
    ++evals;
    EXPECT_EQ(j["global_step"].get<int64_t>(), evals);
    EXPECT_GT(j["test_accuracy"].get<double>(), 0.0);
  }
  EXPECT_EQ(evals, 80);
  fs::remove_all(dir);
}

TEST(TrainSync, ConfigurationErrorsAreOneLine) {
  expect_one_line(config_error({{"sync", "gossip"}}), "sync");
  expect_one_line(config_error({{"sync", "local:perod=3"}}), "perod");
  expect_one_line(config_error({{"sync", "ps-asp"}, {"sync_period", "4"}}), "sync_period");
  expect_one_line(config_error({{"sync", "local"}, {"staleness", "2"}}), "staleness");
  expect_one_line(config_error({{"sync", "local:period=4"}, {"sync_period", "8"}}), "sync_period");
  expect_one_line(config_error({{"sync", "local"}, {"compressor", "fp16"}}), "compressor");
  expect_one_line(config_error({{"sync", "ps-ssp"}, {"optimizer", "adam"}}), "optimizer");
  expect_one_line(config_error({{"slow", "9:3"}, {"workers", "4"}}), "slow");
  expect_one_line(config_error({{"slow", "1"}}), "slow");
  expect_one_line(config_error({{"staleness", "-2"}}), "staleness");
  // Values only the scheme can check are caught before any worker starts.
  TrainConfig c = resolve_config({{"sync", "dpsgd:graph=star"}, {"workers", "3"}});
  try {
    check_sync_config(c);
    FAIL() << "no error for an unknown graph";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("graph"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
  TrainConfig ok = resolve_config({{"sync", "ps-ssp"}, {"staleness", "0"}, {"workers", "3"}});
  EXPECT_NO_THROW(check_sync_config(ok));
  EXPECT_EQ(effective_sync(ok).params.at("staleness"), "0");
  // Schemes other than bsp drop the default gradient compressor; bsp keeps it.
  EXPECT_EQ(resolve_config({{"sync", "local"}}).compressor, "none");
  // (an audit) A dedicated server's rank takes no training steps to slow: refused, where it did nothing while the
  // summary said the rank was slowed; a training rank and * pass. The period clash is judged by value (period=08
  // and sync_period 8 agree, as a resume compares them).
  const std::string served = config_error({{"sync", "ps-asp:colocate=0"}, {"workers", "3"}, {"slow", "2:50"}});
  expect_one_line(served, "slow");
  EXPECT_NE(served.find("rank 2 is a parameter server"), std::string::npos) << served;
  EXPECT_NE(served.find("allowed: a training rank 0 to 1, or *"), std::string::npos) << served;
  EXPECT_NO_THROW(resolve_config({{"sync", "ps-asp:colocate=0"}, {"workers", "3"}, {"slow", "1:50,*:2"}}));
  EXPECT_NO_THROW(resolve_config({{"sync", "ps-asp"}, {"workers", "3"}, {"slow", "2:50"}}));  // (co-located)
  EXPECT_NO_THROW(resolve_config({{"sync", "local:period=08"}, {"sync_period", "8"}}));
  expect_one_line(config_error({{"sync", "local:period=08"}, {"sync_period", "9"}}), "sync_period");
}

// Found by an audit: a trainer setting the parameter servers take from the trainer, inside the trainer's range and
// outside theirs, was refused naming the scheme's parameter, which the user never set ("config: sync: ps-bsp:
// parameter 'momentum' = '0.99995' must be a number in [0, 0.9999]" for --momentum 0.99995); and the trainer's own
// momentum refusal said [0, 1) where 0.9999996 is refused.
TEST(TrainSync, ATrainerSettingOutsideTheServersRangeIsNamedAsSet) {
  std::string m = config_error({{"sync", "ps-bsp"}, {"workers", "3"}, {"momentum", "0.99995"}});
  expect_one_line(m,
                  "config: momentum: 0.99995 with sync ps-bsp: the parameter servers' momentum is at most 0.9999; "
                  "allowed with ps-bsp: a momentum in [0, 0.9999]");
  m = config_error({{"sync", "ps-asp"}, {"workers", "3"}, {"lr", "1e-10"}});
  expect_one_line(m,
                  "config: lr: 1e-10 with sync ps-asp: the parameter servers' lr is at least 1e-09; allowed with "
                  "ps-asp: an lr in [1e-09, 1000]");
  // dana=0's rule for stale gradients scales the lr it gives the servers (here by 0.25 / 1e-6).
  m = config_error({{"sync", "ps-asp:dana=0"}, {"workers", "3"}, {"lr", "1000"}, {"momentum", "0.999999"}});
  expect_one_line(m,
                  "config: lr: 1000 with momentum 0.999999 under sync ps-asp (dana=0) gives the parameter servers "
                  "lr 2.5e+08");
  // The servers' own values, given in the spec, are theirs: the trainer's are not held to their range then.
  TrainConfig own = resolve_config(
      {{"sync", "ps-bsp:momentum=0.9,lr=0.1"}, {"workers", "3"}, {"momentum", "0.99995"}, {"lr", "1e-10"}});
  EXPECT_NO_THROW(check_sync_config(own));
  EXPECT_NO_THROW(check_sync_config(resolve_config({{"sync", "ps-bsp"}, {"workers", "3"}, {"momentum", "0.9999"}})));
  // The trainer's own bound, as it is.
  expect_one_line(config_error({{"momentum", "0.9999996"}}),
                  "'0.9999996' is not allowed; allowed: a number in [0, 0.999999]");
  EXPECT_EQ(config_error({{"momentum", "0.999999"}}), "");
}

// A scheme parameter holding a compressor spec with parameters, in brackets (its second parameter was read as the
// scheme's and refused); YAML mappings, the spec written back and a resume's spec bracket it themselves.
TEST(TrainSync, ACompressorSpecWithParametersGoesInBrackets) {
  TrainConfig c =
      resolve_config({{"sync", "ps-asp:pull_compressor=[qsgd:levels=127,bucket=64],lr=0.05"}, {"workers", "3"}});
  const SyncSpec s = effective_sync(c);
  EXPECT_EQ(s.params.at("pull_compressor"), "qsgd:levels=127,bucket=64");
  EXPECT_EQ(s.params.at("lr"), "0.05");
  EXPECT_NO_THROW(check_sync_config(c));
  // Written back and read again: the same parameters.
  TrainConfig again = c;
  again.sync = s.to_string();
  EXPECT_NE(again.sync.find("pull_compressor=[qsgd:levels=127,bucket=64]"), std::string::npos) << again.sync;
  EXPECT_EQ(effective_sync(again).params, s.params);
  // dpsgd takes --compressor as its own: two parameters went into the spec unbracketed and failed on re-reading.
  TrainConfig d = resolve_config({{"sync", "dpsgd"}, {"workers", "3"}, {"compressor", "qsgd:levels=127,bucket=64"}});
  TrainConfig d2 = d;
  d2.sync = effective_sync(d).to_string();
  EXPECT_EQ(effective_sync(d2).params.at("compressor"), "qsgd:levels=127,bucket=64");
  auto dir = temp_dir("sync-brackets");
  {
    std::ofstream f(dir / "a.yaml");
    f << "sync: {name: ps-asp, pull_compressor: \"qsgd:levels=127,bucket=64\"}\nworkers: 3\n";
  }
  TrainConfig y = resolve_config(read_yaml_config((dir / "a.yaml").string()));
  EXPECT_EQ(effective_sync(y).params.at("pull_compressor"), "qsgd:levels=127,bucket=64");
  std::string bad = config_error({{"sync", "ps-asp:pull_compressor=[qsgd:levels=127,bucket=64"}});
  expect_one_line(bad, "[");
  EXPECT_EQ(bad.rfind("config: sync: ", 0), 0u) << bad;
  expect_one_line(config_error({{"sync", "ps-asp:pull_compressor=qsgd]"}}), "bracket");
  bad = config_error({{"sync", "ps-asp:pull_compressor=[qsgd:levels=127,bucket=64]x"}});
  EXPECT_NE(bad.find("'pull_compressor=[qsgd:levels=127,bucket=64]x' has a bracket inside its value"),
            std::string::npos)
      << bad;
  // A YAML value already in brackets is kept as it is (bracketed twice, it was refused).
  {
    std::ofstream f(dir / "b.yaml");
    f << "sync: {name: ps-asp, pull_compressor: \"[qsgd:levels=127,bucket=64]\"}\nworkers: 3\n";
  }
  EXPECT_EQ(effective_sync(resolve_config(read_yaml_config((dir / "b.yaml").string()))).params.at("pull_compressor"),
            "qsgd:levels=127,bucket=64");
  fs::remove_all(dir);
}

TEST(TrainSync, YamlTakesTheSchemeAsAMapping) {
  auto dir = temp_dir("sync-yaml");
  {
    std::ofstream f(dir / "a.yaml");
    f << "sync: {name: local, period: 8, warmup: 100}\nslow: \"3:3\"\neval-every: 50\n";
  }
  TrainConfig c = resolve_config(read_yaml_config((dir / "a.yaml").string()));
  EXPECT_EQ(effective_sync(c).to_string(), "local:period=8,warmup=100");
  EXPECT_EQ(c.slow, "3:3");
  EXPECT_EQ(c.eval_every, 50);
  {
    std::ofstream f(dir / "b.yaml");
    f << config_to_yaml(c);
  }
  EXPECT_EQ(config_to_yaml(resolve_config(read_yaml_config((dir / "b.yaml").string()))), config_to_yaml(c));
  fs::remove_all(dir);
}

TEST(SlowTrainCli, SyncSchemesRunAsProcesses) {
  auto dir = temp_dir("sync-cli");
  std::string common =
      "--model mlp --dataset synthetic --synthetic-samples 480 --batch-size 16 --epochs 1 "
      "--progress false --transport tcp";
  // 3 processes: 2 workers and a dedicated parameter server; worker 1 twice as slow.
  CliRun r = run_conduit(common + " --workers 3 --sync ps-ssp:colocate=0 --staleness 1 --slow 1:2 --output " +
                         (dir / "ps").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("2 workers, sync ps-ssp:colocate=0"), std::string::npos) << r.out;
  auto s = read_json_file((dir / "ps" / "summary.json").string());
  EXPECT_EQ(s["ranks"], 3);
  EXPECT_GT(s["final_test_accuracy"].get<double>(), 0.5);
  CliRun g = run_conduit(common + " --workers 2 --sync adpsgd --output " + (dir / "gossip").string());
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("sync adpsgd"), std::string::npos) << g.out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace conduit::train
