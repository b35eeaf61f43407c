// Training on libtorch through the torch-free interface (config, data, sampler, trainer): BSP with N workers equals
// one worker with an N-times batch, checkpoint-resume continues bit for bit, configuration errors are one line.
// Tests named Slow* start real processes (select with ctest -R Slow, skip with ctest -E Slow).
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "coll/communicator.h"
#include "core/error.h"
#include "torch/config.h"
#include "torch/data.h"
#include "torch/metrics.h"
#include "torch/stages.h"
#include "torch/trainer.h"
#include "train_util.h"

namespace conduit::train {
namespace {

namespace fs = std::filesystem;
using namespace test_util;


TEST(TrainConfig, DefaultsAreTheCnnOnFashionMnistWithFourWorkers) {
  TrainConfig c = resolve_config({});
  EXPECT_EQ(c.model, "cnn");
  EXPECT_EQ(c.dataset, "fashion-mnist");
  EXPECT_EQ(c.workers, 4);
  EXPECT_FALSE(c.output.empty());
#ifdef CONDUIT_WITH_COMPRESS
  EXPECT_EQ(c.compressor, "powersgd:rank=4,wire=f16");
#endif
}

// One data-parallel rank exchanges nothing: the default compressor gives way to none (whether the world is one worker,
// or workers launched by mpirun/torchrun, or tp x pp ranks of one replica); one asked for is kept; two data-parallel
// ranks keep the default.
TEST(TrainConfig, OneDataParallelRankDropsTheDefaultCompressor) {
#ifdef CONDUIT_WITH_COMPRESS
  const std::string def = TrainConfig().compressor;
  ASSERT_NE(def, "none");
  EXPECT_EQ(resolve_config({{"workers", "1"}}).compressor, "none");
  EXPECT_EQ(resolve_config({}, 1, false).compressor, "none");
  EXPECT_EQ(resolve_config({}, 2, false).compressor, def);
  EXPECT_EQ(resolve_config({{"workers", "2"}, {"model", "cnn"}, {"pp", "2"}}).compressor, "none");
  EXPECT_EQ(resolve_config({{"workers", "4"}, {"model", "cnn"}, {"pp", "2"}}).compressor, def);
  EXPECT_EQ(resolve_config({{"workers", "4"}, {"model", "vit"}, {"tp", "2"}, {"pp", "2"}}).compressor, "none");
  EXPECT_EQ(resolve_config({{"workers", "1"}, {"compressor", "fp16"}}).compressor, "fp16");
  // The directory named after the compressor names the one that runs.
  EXPECT_NE(resolve_config({{"workers", "1"}}).output.find("-none-"), std::string::npos);
#endif
}

// DGC's momentum correction replaces the optimizer's momentum: the compressor takes the trainer's momentum unless its
// spec names one, the optimizer runs without, and schemes or optimizers it cannot serve are refused.
// A resume takes the checkpoint's data directory with its dataset only: resumed with another dataset, the other
// one's default directory stays (a Fashion-MNIST run's directory replaced mnist's).
TEST(TrainConfig, AResumeTakesTheDataDirectoryWithItsDatasetOnly) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("conduit-resume-dir-{}", ::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "checkpoint.json") << R"({"dataset": "fashion-mnist", "data_dir": "/x/fm", "lr": 0.05})";
  RawConfig same{{"resume", dir.string()}};
  apply_resume_defaults(same, false);
  EXPECT_EQ(same["data_dir"], "/x/fm");
  EXPECT_EQ(same["lr"], "0.05");
  RawConfig other{{"resume", dir.string()}, {"dataset", "mnist"}};
  apply_resume_defaults(other, false);
  EXPECT_EQ(other.count("data_dir"), 0u);
  EXPECT_EQ(other["lr"], "0.05");
  std::filesystem::remove_all(dir);
}

// A pipeline's schedule and recomputation go with its pp (a resume with pp 1 given, or of a pp 1 checkpoint that
// recorded a schedule, does not take them: they were refused, or reported instead of the pp mismatch); its
// micro-batches go with a batch size they fit in.
TEST(TrainConfig, AResumeTakesThePipelineSettingsThatStillApply) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("conduit-resume-pp-{}", ::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "checkpoint.json")
      << R"({"model": "vit", "pp": 2, "pp_schedule": "gpipe", "recompute": true, "micro_batches": 8, "batch_size": 64})";
  RawConfig all{{"resume", dir.string()}};
  apply_resume_defaults(all, false);
  EXPECT_EQ(all["pp"], "2");
  EXPECT_EQ(all["pp_schedule"], "gpipe");
  EXPECT_EQ(all["recompute"], "true");
  EXPECT_EQ(all["micro_batches"], "8");
  // (pp 1 however spelled: pp 01 took the schedule, which the run then refused naming pp_schedule, set by nobody)
  for (const char* pp1 : {"1", "01"}) {
    RawConfig one{{"resume", dir.string()}, {"pp", pp1}};
    apply_resume_defaults(one, false);
    EXPECT_EQ(one.count("pp_schedule"), 0u) << pp1;
    EXPECT_EQ(one.count("recompute"), 0u) << pp1;
  }
  RawConfig fits{{"resume", dir.string()}, {"batch_size", "8"}},
      too_small{{"resume", dir.string()}, {"batch_size", "4"}};
  apply_resume_defaults(fits, false);
  apply_resume_defaults(too_small, false);
  EXPECT_EQ(fits["micro_batches"], "8");
  EXPECT_EQ(too_small.count("micro_batches"), 0u);
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "pp": 1, "pp_schedule": "gpipe"})";
  RawConfig old{{"resume", dir.string()}};
  apply_resume_defaults(old, false);
  EXPECT_EQ(old.count("pp_schedule"), 0u);
  EXPECT_EQ(config_error(old), "");
  // Sequence parallelism comes with its tp, and not where the run cannot have it (its mismatch is reported instead).
  std::ofstream(dir / "checkpoint.json") << R"({"model": "vit", "tp": 2, "sequence_parallel": true, "world": 4})";
  RawConfig sp{{"resume", dir.string()}};
  apply_resume_defaults(sp, false);
  EXPECT_EQ(sp["sequence_parallel"], "true");
  EXPECT_EQ(sp["tp"], "2");
  for (const RawConfig& given :
       {RawConfig{{"tp", "1"}}, RawConfig{{"tp", "01"}}, RawConfig{{"pp", "2"}}, RawConfig{{"model", "cnn"}}}) {
    RawConfig r = given;
    r["resume"] = dir.string();
    apply_resume_defaults(r, false);
    EXPECT_EQ(r.count("sequence_parallel"), 0u) << given.begin()->first;
  }
  // ZeRO's prefetch setting comes with its stage (a resume turned a run's prefetch back on); a stage the checkpoint
  // cannot resume at is refused first, before the settings it takes could be refused with the given stage (a zero-0
  // powersgd checkpoint resumed with --zero 1 was refused for its compressor, and with --compressor none for that).
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 3, "zero_prefetch": false})";
  RawConfig z{{"resume", dir.string()}};
  apply_resume_defaults(z, false);
  EXPECT_EQ(z["zero_prefetch"], "false");
  EXPECT_FALSE(resolve_config(z).zero_prefetch);
  RawConfig z2{{"resume", dir.string()}, {"zero", "0"}};
  EXPECT_EQ(config_error_of([&] { apply_resume_defaults(z2, false); }),
            "config: resume: the checkpoint was written with zero = 3, this run has 0; allowed: zero 3 (its optimizer "
            "state is each rank's slices of every layer)");
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 0, "compressor": "powersgd:rank=2"})";
  RawConfig zc{{"resume", dir.string()}, {"zero", "1"}};
  EXPECT_NE(config_error_of([&] {
              apply_resume_defaults(zc, false);
            }).find("the checkpoint was written with zero = 0, this run has 1; allowed: zero 0"),
            std::string::npos);
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 2, "zero_prefetch": false})";
  RawConfig z1{{"resume", dir.string()}, {"zero", "2"}};
  apply_resume_defaults(z1, false);
  EXPECT_EQ(z1["zero_prefetch"], "false");
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 3, "zero_prefetch": false})";
  // ZeRO-3's gather wire likewise, with stage 3 only.
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 3, "zero_gather": "bf16"})";
  RawConfig g{{"resume", dir.string()}};
  apply_resume_defaults(g, false);
  EXPECT_EQ(g["zero_gather"], "bf16");
  RawConfig g2{{"resume", dir.string()}, {"zero", "2"}};
  EXPECT_NE(config_error_of([&] { apply_resume_defaults(g2, false); }).find("written with zero = 3, this run has 2"),
            std::string::npos);
  // ZeRO-3's secondary partition likewise, and not into a run given other workers or tp than the checkpoint's.
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 3, "zero_hpz": 2, "world": 4, "tp": 1})";
  for (auto [key, value, taken] :
       {std::tuple{"workers", "4", true}, {"workers", "04", true}, {"workers", "8", false}, {"tp", "2", false}}) {
    RawConfig h{{"resume", dir.string()}, {key, value}};
    apply_resume_defaults(h, false);
    EXPECT_EQ(h.count("zero_hpz"), taken ? 1u : 0u) << key << " " << value;
  }
  // The deferred allgather's call size with stages 1 and 2 only.
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 2, "zero_allgather_mb": 4})";
  RawConfig a{{"resume", dir.string()}};
  apply_resume_defaults(a, false);
  EXPECT_EQ(a["zero_allgather_mb"], "4");
  EXPECT_EQ(resolve_config(a).zero_allgather_mb, 4);
  for (const char* stage : {"1", "01", "2"}) {  // (the number, not its text)
    RawConfig a2{{"resume", dir.string()}, {"zero", stage}};
    apply_resume_defaults(a2, false);
    EXPECT_EQ(a2.count("zero_allgather_mb"), 1u) << stage;
  }
  // When zero 2 or 3 reduces, not into a run given another stage, one micro-batch or overlap off.
  std::ofstream(dir / "checkpoint.json")
      << R"({"model": "cnn", "zero": 2, "micro_batches": 2, "zero_reduce": "micro-batch"})";
  for (auto [key, value, taken] : {std::tuple{"epochs", "1", true},
                                   {"zero", "1", false},
                                   {"zero", "2", true},
                                   {"micro_batches", "1", false},
                                   {"micro_batches", "01", false},  // (as text, taken, then refused)
                                   {"micro_batches", "4", true},
                                   {"overlap", "false", false},
                                   {"overlap", "no", false},
                                   {"overlap", "0", false}}) {
    RawConfig zr{{"resume", dir.string()}, {key, value}};
    apply_resume_defaults(zr, false);
    EXPECT_EQ(zr.count("zero_reduce"), taken ? 1u : 0u) << key << " " << value;
  }
  std::ofstream(dir / "checkpoint.json") << R"({"model": "cnn", "zero": 3, "zero_prefetch": false})";
  RawConfig z3{{"resume", dir.string()}, {"zero", "03"}};  // (the number, not its text)
  apply_resume_defaults(z3, false);
  EXPECT_EQ(z3["zero_prefetch"], "false");
  std::filesystem::remove_all(dir);
}

// A run started in the same second as another (same model and compressor) took its default directory and wrote over
// its files; it now takes the next free name.
TEST(TrainConfig, TheDefaultOutputDirectoryIsOneNoOtherRunHas) {
  const fs::path dir = temp_dir("default-name");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir);
  const TrainConfig c = resolve_config({});
  fs::create_directories(c.output);
  const std::string next = default_output_dir(c);
  fs::current_path(cwd);
  EXPECT_NE(next, c.output);
  EXPECT_FALSE(fs::exists(dir / next)) << next;
  fs::remove_all(dir);
}

// adam and adamw have no momentum setting (their betas are their own): a momentum given with them was dropped without
// a word. A resume of an adam run does not take the momentum its checkpoint records (sgd's default, never used).
TEST(TrainConfig, MomentumIsRefusedWithAdamAndEmptyPathsAreRefused) {
  expect_one_line(config_error({{"optimizer", "adam"}, {"momentum", "0.5"}}), "momentum");
  expect_one_line(config_error({{"optimizer", "adamw"}, {"momentum", "0"}}), "momentum");
  EXPECT_NO_THROW(resolve_config({{"optimizer", "adam"}}));
  // The learning rate's default is the optimizer's: sgd 0.1, adam and adamw 0.001 (PyTorch's Adam default); one given
  // is kept.
  EXPECT_EQ(resolve_config({}).lr, 0.1);
  EXPECT_EQ(resolve_config({{"optimizer", "adam"}}).lr, 0.001);
  EXPECT_EQ(resolve_config({{"optimizer", "adamw"}}).lr, 0.001);
  EXPECT_EQ(resolve_config({{"optimizer", "adam"}, {"lr", "0.01"}}).lr, 0.01);
  EXPECT_NO_THROW(resolve_config({{"optimizer", "sgd"}, {"momentum", "0.5"}}));
  const fs::path dir = temp_dir("adam-resume");
  std::ofstream(dir / "checkpoint.json") << R"({"optimizer": "adam", "momentum": 0.9, "lr": 0.01})";
  RawConfig adam{{"resume", dir.string()}};
  apply_resume_defaults(adam, false);
  EXPECT_EQ(adam.count("momentum"), 0u);
  EXPECT_EQ(adam["optimizer"], "adam");
  std::ofstream(dir / "checkpoint.json") << R"({"optimizer": "sgd", "momentum": 0.5})";
  RawConfig sgd{{"resume", dir.string()}};
  apply_resume_defaults(sgd, false);
  EXPECT_EQ(sgd["momentum"], "0.5");
  fs::remove_all(dir);
  // An empty output or resume fell back to the default directory, or to a fresh run.
  expect_one_line(config_error({{"output", ""}}), "output");
  expect_one_line(config_error({{"resume", ""}}), "resume");
}

TEST(TrainConfig, DgcTakesOverTheMomentum) {
#ifdef CONDUIT_WITH_COMPRESS
  TrainConfig c = resolve_config({{"compressor", "dgc:ratio=0.01"}, {"momentum", "0.8"}});
  EXPECT_EQ(c.compressor, "dgc:ratio=0.01,momentum=0.8");
  EXPECT_EQ(optimizer_momentum(c), 0.0);
  EXPECT_EQ(resolve_config({{"compressor", "dgc"}}).compressor, "dgc:momentum=0.9");
  EXPECT_EQ(resolve_config({{"compressor", "dgc:momentum=0.5"}}).compressor, "dgc:momentum=0.5");
  // Dedicated parameter servers hold no share of the training set: the batch check counts the training workers.
  EXPECT_EQ(training_workers(resolve_config({{"workers", "4"}, {"sync", "ps-asp:colocate=0,servers=1"}})), 3);
  EXPECT_EQ(training_workers(resolve_config({{"workers", "4"}, {"sync", "ps-asp"}})), 4);
  EXPECT_EQ(training_workers(resolve_config({{"workers", "4"}, {"sync", "ps-asp:colocate=0"}})), 3);  // 1 server
  EXPECT_EQ(training_workers(resolve_config({{"workers", "4"}, {"sync", "ps-asp:colocate=false,servers=2"}})), 2);
  EXPECT_EQ(training_workers(resolve_config({{"workers", "4"}})), 4);
  // Both given: the same value is taken, two values are refused (the spec's won without a word).
  EXPECT_EQ(resolve_config({{"compressor", "dgc:momentum=0.50"}, {"momentum", "0.5"}}).compressor, "dgc:momentum=0.50");
  expect_one_line(config_error({{"compressor", "dgc:momentum=0.5"}, {"momentum", "0.8"}}), "momentum");
  // The run's momentum is the spec's, so that the configuration the workers read back (and a checkpoint) holds one
  // value: the trainer's default 0.9 written beside dgc:momentum=0.5 was read by each worker as a second one.
  const TrainConfig spec_m = resolve_config({{"compressor", "dgc:momentum=0.5"}});
  EXPECT_EQ(spec_m.momentum, 0.5);
  const auto yaml = std::filesystem::temp_directory_path() / fmt::format("conduit-dgc-{}.yaml", ::getpid());
  std::ofstream(yaml) << config_to_yaml(spec_m);
  EXPECT_NO_THROW(resolve_config(read_yaml_config(yaml.string())));
  std::filesystem::remove(yaml);
  // A checkpoint of a dgc run written before (momentum 0.9 beside dgc:momentum=0.5) resumes: its momentum is the
  // compressor's.
  const auto ck = std::filesystem::temp_directory_path() / fmt::format("conduit-dgc-ck-{}", ::getpid());
  std::filesystem::create_directories(ck);
  std::ofstream(ck / "checkpoint.json") << R"({"compressor": "dgc:momentum=0.5", "momentum": 0.9, "lr": 0.05})";
  RawConfig resumed{{"resume", ck.string()}};
  apply_resume_defaults(resumed, false);
  EXPECT_EQ(resumed.count("momentum"), 0u);
  EXPECT_EQ(resumed["compressor"], "dgc:momentum=0.5");
  // A signum checkpoint from before signum took over the momentum (no optimizer_momentum recorded), whether its spec
  // named a momentum or not, is refused up front, naming why (it was refused after the workers started, as another
  // compressor than the one given, or its momentum buffers were read as the weight decay's); one since is taken.
  for (const char* spec : {"signum", "signum:momentum=0.9"}) {
    std::ofstream(ck / "checkpoint.json")
        << fmt::format(R"({{"compressor": "{}", "momentum": 0.9, "lr": 0.05}})", spec);
    RawConfig old_signum{{"resume", ck.string()}};
    try {
      apply_resume_defaults(old_signum, false);
      ADD_FAILURE() << "an old signum checkpoint was taken: " << spec;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    fmt::format("compressor '{}' was trained before signum took over the momentum", spec)),
                std::string::npos)
          << e.what();
    }
  }
  std::ofstream(ck / "checkpoint.json")
      << R"({"compressor": "signum:momentum=0.9", "momentum": 0.9, "optimizer_momentum": 0, "lr": 0.05})";
  RawConfig new_signum{{"resume", ck.string()}};
  EXPECT_NO_THROW(apply_resume_defaults(new_signum, false));
  std::filesystem::remove_all(ck);
  EXPECT_EQ(optimizer_momentum(resolve_config({{"compressor", "ef:topk"}})), 0.9);
  expect_one_line(config_error({{"compressor", "dgc"}, {"optimizer", "adam"}}), "optimizer");
  expect_one_line(config_error({{"compressor", "dgc"}, {"sync", "ps-asp"}}), "compressor");
  expect_one_line(config_error({{"compressor", "dgc"}, {"sync", "dpsgd"}}), "compressor");
  expect_one_line(config_error({{"compress_min_bytes", "-1"}}), "compress_min_bytes");
  expect_one_line(config_error({{"compress_min_bytes", "4096"}, {"sync", "local"}}), "compress_min_bytes");
  // Signum votes on the signs of each rank's momentum and steps by lr times the vote: the optimizer's momentum was
  // stacked on it (ten times the step at 0.9, lagged twice), and Adam ran over the signs.
  const TrainConfig s = resolve_config({{"compressor", "signum"}, {"momentum", "0.8"}});
  EXPECT_EQ(s.compressor, "signum:momentum=0.8");
  EXPECT_EQ(optimizer_momentum(s), 0.0);
  EXPECT_EQ(resolve_config({{"compressor", "signum:momentum=0.5"}}).momentum, 0.5);
  expect_one_line(config_error({{"compressor", "signum:momentum=0.5"}, {"momentum", "0.8"}}), "momentum");
  const std::string adam = config_error({{"compressor", "signum"}, {"optimizer", "adam"}});
  expect_one_line(adam, "optimizer");
  EXPECT_NE(adam.find("adam with compressor signum, which applies SGD momentum itself (signs of the momentum)"),
            std::string::npos)
      << adam;
  EXPECT_EQ(optimizer_momentum(resolve_config({{"compressor", "signsgd"}})), 0.9);  // (no momentum of its own)
  // Servers own the momentum and sum pushes: a voted or momentum compressor pushed to them is refused, whether given
  // as the compressor or in the scheme's spec (push_compressor=dgc passed the dgc check above).
  for (const auto& [compressor, sync] : std::vector<std::pair<std::string, std::string>>{
           {"signum", "ps-bsp"}, {"signsgd", "ps-asp"}, {"none", "ps-bsp:push_compressor=dgc"}}) {
    std::string e;
    try {
      check_sync_config(resolve_config({{"compressor", compressor}, {"sync", sync}}));
    } catch (const ConfigError& x) {
      e = x.what();
    }
    expect_one_line(e, "sync");
    EXPECT_NE(e.find("which servers that sum pushes and own the momentum do not take"), std::string::npos) << e;
  }
#endif
}

TEST(TrainConfig, BadValuesGiveOneLineNamingTheField) {
  expect_one_line(config_error({{"model", "vgg"}}), "model");
  expect_one_line(config_error({{"lr", "-0.1"}}), "lr");
  expect_one_line(config_error({{"lr", "abc"}}), "lr");
  // Numbers as a person writes them (stod took a hex float, leading blanks and a '+').
  for (const char* v : {"0x1p-3", " 0.1", "+0.1", "0.1 "}) expect_one_line(config_error({{"lr", v}}), "lr");
  EXPECT_EQ(config_error({{"lr", "1e-2"}}), "");
  expect_one_line(config_error({{"epochs", "0"}}), "epochs");
  expect_one_line(config_error({{"batch_size", "-3"}}), "batch_size");
  expect_one_line(config_error({{"workers", "0"}}), "workers");
  expect_one_line(config_error({{"transport", "udp"}}), "transport");
  expect_one_line(config_error({{"optimizer", "lbfgs"}}), "optimizer");
  expect_one_line(config_error({{"target_accuracy", "90"}}), "target_accuracy");
  expect_one_line(config_error({{"compressor", "zip"}}), "compressor");
  expect_one_line(config_error({{"overlap", "maybe"}}), "overlap");
  expect_one_line(config_error({{"resume", "/nonexistent/ckpt"}}), "resume");
  // Below CONDUIT_TIMEOUT's least (0.0001 s was taken, and every rank then failed at rendezvous).
  expect_one_line(config_error({{"timeout_s", "0.0001"}}), "timeout_s");
  EXPECT_EQ(config_error({{"timeout_s", "0.001"}}), "");
  // The drift timeout is at least the collectives' (where workers drift apart they wait at least as long as in step);
  // left out, it follows a longer timeout_s.
  expect_one_line(config_error({{"drift_timeout_s", "100"}}), "drift_timeout_s");
  expect_one_line(config_error({{"drift_timeout_s", "20"}, {"timeout_s", "30"}}), "drift_timeout_s");
  EXPECT_EQ(config_error({{"drift_timeout_s", "30"}, {"timeout_s", "30"}}), "");
  EXPECT_EQ(resolve_config({{"timeout_s", "3600"}}).drift_timeout_s, 3600);
  EXPECT_EQ(resolve_config({}).drift_timeout_s, 1800);
  EXPECT_EQ(effective_sync(resolve_config({{"drift_timeout_s", "400"}})).drift_timeout_s, 400);
  // A warm-up longer than the run (the learning rate never reached lr).
  expect_one_line(config_error({{"warmup_epochs", "4"}, {"epochs", "3"}}), "warmup_epochs");
  EXPECT_EQ(config_error({{"warmup_epochs", "3"}, {"epochs", "3"}}), "");
  // A bucket cap under one byte (it passed here, then failed in every worker naming the wrong field).
  expect_one_line(config_error({{"first_bucket_mb", "1e-9"}}), "first_bucket_mb");
  expect_one_line(config_error({{"bucket_cap_mb", "1e-7"}}), "bucket_cap_mb");
  EXPECT_EQ(config_error({{"bucket_cap_mb", "1e-6"}}), "");
  // An inconsistent world size: 4 workers asked for under a launcher of 2.
  expect_one_line(config_error({{"workers", "4"}}, 2), "workers");
  EXPECT_EQ(config_error({{"workers", "2"}}, 2), "");
  EXPECT_EQ(resolve_config({}, 3).workers, 3);
}

// ZeRO partitions bsp's optimizer over plain gradients: the default compressor gives way to none, one asked for and
// another sync scheme are refused.
TEST(TrainConfig, ZeroTakesStagesZeroToThreeUnderBspWithoutACompressor) {
  expect_one_line(config_error({{"zero", "4"}}), "zero");
  EXPECT_EQ(resolve_config({{"zero", "3"}}, 0, false).zero, 3);
  const std::string pp = config_error({{"zero", "3"}, {"model", "vit"}, {"pp", "2"}, {"workers", "4"}});
  expect_one_line(pp, "zero");
  EXPECT_NE(pp.find("allowed with pp 2: zero 0, 1 or 2; or pp 1"), std::string::npos) << pp;
  expect_one_line(config_error({{"zero", "-1"}}), "zero");
  const std::string comp = config_error({{"zero", "1"}, {"compressor", "ef:topk:ratio=0.01"}});
  expect_one_line(comp, "zero");
  EXPECT_NE(comp.find("compressor ef:topk:ratio=0.01 cannot go with it"), std::string::npos) << comp;
  EXPECT_EQ(config_error({{"zero", "1"}, {"compressor", "bf16"}}), "");
  EXPECT_EQ(config_error({{"zero", "2"}, {"compressor", "fp16"}}), "");
  EXPECT_EQ(config_error({{"zero", "3"}, {"compressor", "int8"}}), "");  // (ZeRO++'s qgZ)
  const std::string int8_params = config_error({{"zero", "1"}, {"compressor", "int8:chunk=64"}});
  EXPECT_NE(int8_params.find("allowed with zero 1: compressor none, fp16, bf16, int8 or int4 (without parameters"),
            std::string::npos)
      << int8_params;
  EXPECT_NE(int8_params.find("ef:int8 or ef:int4 (with error feedback)"), std::string::npos) << int8_params;
  // With error feedback: ef:int8 and ef:int4 at any stage; ef:int4 is ZeRO's only (ef:int8 without ZeRO is the
  // allreduce's int8 compressor with error feedback).
  for (const char* stage : {"1", "2", "3"})
    for (const char* comp : {"ef:int8", "ef:int4"})
      EXPECT_EQ(config_error({{"zero", stage}, {"compressor", comp}}), "") << stage << " " << comp;
  EXPECT_EQ(config_error({{"compressor", "ef:int8"}}), "");
  const std::string ef_int4 = config_error({{"compressor", "ef:int4"}});
  expect_one_line(ef_int4, "compressor");
  EXPECT_NE(ef_int4.find("ef:int4 is ZeRO's reduce-scatter wire"), std::string::npos) << ef_int4;
  // int4 is ZeRO's wire only: taken with zero, refused without it (not an unknown compressor).
  EXPECT_EQ(config_error({{"zero", "2"}, {"compressor", "int4"}}), "");
  const std::string int4 = config_error({{"compressor", "int4"}});
  expect_one_line(int4, "compressor");
  EXPECT_NE(int4.find("int4 is ZeRO's reduce-scatter wire"), std::string::npos) << int4;
  EXPECT_NE(int4.find("or zero 1, 2 or 3"), std::string::npos) << int4;
  const std::string sync = config_error({{"zero", "2"}, {"sync", "local"}});
  expect_one_line(sync, "zero");
  EXPECT_NE(sync.find("allowed with sync local: zero 0"), std::string::npos) << sync;
  const TrainConfig c = resolve_config({{"zero", "2"}}, 0, false);
  EXPECT_EQ(c.zero, 2);
  EXPECT_EQ(c.compressor, "none");
  EXPECT_EQ(resolve_config({{"zero", "1"}, {"compressor", "none"}}, 0, false).zero, 1);
  EXPECT_EQ(resolve_config({{"zero", "0"}}, 0, false).compressor, TrainConfig().compressor);
  // zero_prefetch: on by default, with stages 1 to 3.
  for (const char* stage : {"1", "2", "3"}) {
    EXPECT_TRUE(resolve_config({{"zero", stage}}, 0, false).zero_prefetch) << stage;
    EXPECT_FALSE(resolve_config({{"zero", stage}, {"zero_prefetch", "false"}}, 0, false).zero_prefetch) << stage;
  }
  const std::string pf = config_error({{"zero", "0"}, {"zero_prefetch", "true"}});
  expect_one_line(pf, "zero_prefetch");
  EXPECT_NE(pf.find("allowed with zero 0: leave it unset"), std::string::npos) << pf;
  expect_one_line(config_error({{"zero", "3"}, {"zero_prefetch", "sometimes"}}), "zero_prefetch");
  // zero_gather: the wire of ZeRO-3's gathers.
  EXPECT_EQ(resolve_config({{"zero", "3"}}, 0, false).zero_gather, "f32");
  EXPECT_EQ(resolve_config({{"zero", "3"}, {"zero_gather", "bf16"}}, 0, false).zero_gather, "bf16");
  EXPECT_EQ(resolve_config({{"zero", "2"}, {"zero_gather", "f32"}}, 0, false).zero_gather, "f32");
  const std::string zg = config_error({{"zero", "2"}, {"zero_gather", "fp16"}});
  expect_one_line(zg, "zero_gather");
  EXPECT_NE(zg.find("fp16 is the wire of ZeRO-3's parameter gathers, this run has zero 2"), std::string::npos) << zg;
  EXPECT_EQ(resolve_config({{"zero", "3"}, {"zero_gather", "int8"}}, 0, false).zero_gather, "int8");
  const std::string zi = config_error({{"zero", "3"}, {"zero_gather", "int4"}});
  EXPECT_NE(zi.find("zero_gather: 'int4' (allowed: f32, bf16, fp16 or int8)"), std::string::npos) << zi;
  // zero_hpz: ZeRO-3's secondary partition, groups dividing the data-parallel workers.
  EXPECT_EQ(resolve_config({{"zero", "3"}, {"workers", "4"}, {"zero_hpz", "2"}}, 0, false).zero_hpz, 2);
  const std::string zh = config_error({{"zero", "2"}, {"workers", "4"}, {"zero_hpz", "2"}});
  expect_one_line(zh, "zero_hpz");
  EXPECT_NE(zh.find("this run has zero 2; allowed with zero 2: 0 or 1 (none), or leave it unset"), std::string::npos)
      << zh;
  for (const char* k : {"3", "4"}) {
    const std::string zd = config_error({{"zero", "3"}, {"workers", "4"}, {"zero_hpz", k}});
    expect_one_line(zd, "zero_hpz");
    EXPECT_NE(zd.find("do not divide the 4 data-parallel workers (workers 4 / tp 1) into two or more"),
              std::string::npos)
        << zd;
  }
  // zero_shard_group: ZeRO sharded within groups dividing the data-parallel workers (at stages 1-3), not with hpZ.
  for (const char* stage : {"1", "2", "3"})
    EXPECT_EQ(resolve_config({{"zero", stage}, {"workers", "4"}, {"zero_shard_group", "2"}}, 0, false).zero_shard_group,
              2)
        << stage;
  const std::string zs = config_error({{"zero", "0"}, {"workers", "4"}, {"zero_shard_group", "2"}});
  expect_one_line(zs, "zero_shard_group");
  EXPECT_NE(zs.find("this run has zero 0; allowed with zero 0: 0 or 1 (shard over all), or leave it unset; or zero 1, "
                    "2 or 3"),
            std::string::npos)
      << zs;
  for (const char* k : {"3", "4"}) {
    const std::string zd = config_error({{"zero", "3"}, {"workers", "4"}, {"zero_shard_group", k}});
    expect_one_line(zd, "zero_shard_group");
    EXPECT_NE(zd.find("do not divide the 4 data-parallel workers (workers 4 / (tp 1 x pp 1)) into two or more"),
              std::string::npos)
        << zd;
  }
  // (with pp the data-parallel workers are workers / (tp x pp): 8 / 2 = 4 take groups of 2, not of 4)
  EXPECT_EQ(resolve_config({{"zero", "1"}, {"workers", "8"}, {"pp", "2"}, {"model", "mlp"}, {"zero_shard_group", "2"}},
                           0, false)
                .zero_shard_group,
            2);
  EXPECT_NE(config_error({{"zero", "1"}, {"workers", "8"}, {"pp", "2"}, {"model", "mlp"}, {"zero_shard_group", "4"}})
                .find("groups of 4 do not divide the 4 data-parallel workers"),
            std::string::npos);
  const std::string zsh = config_error({{"zero", "3"}, {"workers", "4"}, {"zero_hpz", "2"}, {"zero_shard_group", "2"}});
  expect_one_line(zsh, "zero_shard_group");
  EXPECT_NE(zsh.find("with zero_hpz 2: the gathers run within the shard group already"), std::string::npos) << zsh;
  // node: a host's data-parallel workers, resolved by the trainer (so not checked against the workers here).
  for (const char* key : {"zero_hpz", "zero_shard_group"}) {
    const TrainConfig n = resolve_config({{"zero", "3"}, {"workers", "4"}, {key, "node"}}, 0, false);
    EXPECT_EQ(std::string(key) == "zero_hpz" ? n.zero_hpz : n.zero_shard_group, kHostGroup) << key;
    EXPECT_NE(config_to_yaml(n).find(std::string(key) + ": node"), std::string::npos) << config_to_yaml(n);
    const char* refusing = std::string(key) == "zero_hpz" ? "1" : "0";
    const std::string z1 = config_error({{"zero", refusing}, {"workers", "4"}, {key, "node"}});
    expect_one_line(z1, key);
    EXPECT_NE(z1.find(": node "), std::string::npos) << z1;
    EXPECT_NE(z1.find(fmt::format("this run has zero {}", refusing)), std::string::npos) << z1;
    const std::string bad = config_error({{"zero", "3"}, {"workers", "4"}, {key, "nodes"}});
    expect_one_line(bad, key);
    EXPECT_NE(bad.find("'nodes' is not allowed; allowed: node (the data-parallel workers of one host), 0 or 1"),
              std::string::npos)
        << bad;
  }
  const std::string zboth =
      config_error({{"zero", "3"}, {"workers", "4"}, {"zero_hpz", "node"}, {"zero_shard_group", "node"}});
  EXPECT_NE(zboth.find("zero_shard_group: node with zero_hpz node: the gathers run within the shard group already"),
            std::string::npos)
      << zboth;
  // zero_allgather_mb: the calls of zero 1 and 2's allgather behind the forward.
  EXPECT_EQ(resolve_config({{"zero", "1"}}, 0, false).zero_allgather_mb, 0);
  EXPECT_EQ(resolve_config({{"zero", "2"}, {"zero_allgather_mb", "4.5"}}, 0, false).zero_allgather_mb, 4.5);
  EXPECT_EQ(resolve_config({{"zero", "3"}, {"zero_allgather_mb", "0"}}, 0, false).zero_allgather_mb, 0);
  for (const char* stage : {"0", "3"}) {
    const std::string za = config_error({{"zero", stage}, {"zero_allgather_mb", "4"}});
    expect_one_line(za, "zero_allgather_mb");
    EXPECT_NE(za.find(fmt::format("this run has zero {}; allowed with zero {}: 0, or leave it unset", stage, stage)),
              std::string::npos)
        << za;
  }
  const std::string zn = config_error({{"zero", "1"}, {"zero_allgather_mb", "-1"}});
  expect_one_line(zn, "zero_allgather_mb");
  EXPECT_NE(zn.find("allowed: a size in MiB >= 0"), std::string::npos) << zn;
  // zero_reduce: when zero 2 or 3 reduces a step's micro-batches; refused where it changes nothing, and without
  // overlap.
  EXPECT_EQ(resolve_config({{"zero", "2"}, {"micro_batches", "4"}}, 0, false).zero_reduce, "step");
  for (const char* zero : {"2", "3"})
    EXPECT_EQ(
        resolve_config({{"zero", zero}, {"micro_batches", "4"}, {"zero_reduce", "micro-batch"}}, 0, false).zero_reduce,
        "micro-batch")
        << zero;
  for (const char* mode : {"micro-batch", "step"})
    for (const auto& [zero, mb] : {std::pair{"1", "4"}, {"0", "4"}, {"2", "1"}, {"3", "1"}}) {
      const std::string zr = config_error({{"zero", zero}, {"micro_batches", mb}, {"zero_reduce", mode}});
      expect_one_line(zr, "zero_reduce");
      EXPECT_NE(zr.find(fmt::format("this run has zero {} and micro_batches {}; allowed with them: leave it unset",
                                    zero, mb)),
                std::string::npos)
          << zr;
    }
  const std::string zp = config_error(
      {{"model", "mlp"}, {"zero", "2"}, {"pp", "2"}, {"micro_batches", "2"}, {"zero_reduce", "micro-batch"}});
  EXPECT_NE(zp.find("zero_reduce: micro-batch with pp 2: not with pipelines"), std::string::npos) << zp;
  const std::string zo =
      config_error({{"zero", "2"}, {"micro_batches", "2"}, {"overlap", "false"}, {"zero_reduce", "micro-batch"}});
  EXPECT_NE(zo.find("allowed: overlap true, or zero_reduce step"), std::string::npos) << zo;
  const std::string zb = config_error({{"zero", "2"}, {"micro_batches", "2"}, {"zero_reduce", "pass"}});
  EXPECT_NE(zb.find("allowed: step, micro-batch"), std::string::npos) << zb;
}

// Tensor parallelism splits the vit only, in groups that divide the workers and its 4 heads, under bsp.
TEST(TrainConfig, TpSplitsTheVitInGroupsThatDivideTheWorkersUnderBsp) {
  const std::string cnn = config_error({{"tp", "2"}});
  expect_one_line(cnn, "tp");
  EXPECT_NE(cnn.find("model cnn has none"), std::string::npos) << cnn;
  expect_one_line(config_error({{"tp", "3"}, {"model", "vit"}, {"workers", "3"}}), "tp");
  expect_one_line(config_error({{"tp", "8"}, {"model", "vit"}, {"workers", "8"}}), "tp");
  const std::string uneven = config_error({{"tp", "2"}, {"model", "vit"}, {"workers", "3"}});
  expect_one_line(uneven, "tp");
  EXPECT_NE(uneven.find("do not divide the 3 workers"), std::string::npos) << uneven;
  expect_one_line(config_error({{"tp", "2"}, {"model", "vit"}, {"workers", "4"}, {"sync", "local"}}), "tp");
  const TrainConfig c = resolve_config({{"tp", "2"}, {"model", "vit"}, {"workers", "4"}}, 0, true);
  EXPECT_EQ(c.tp, 2);
  EXPECT_FALSE(c.sequence_parallel);
  EXPECT_EQ(config_error({{"tp", "4"}, {"model", "vit"}, {"workers", "4"}}), "");
  // Sequence parallelism: within a tensor-parallel group, without a pipeline.
  EXPECT_TRUE(resolve_config({{"tp", "2"}, {"model", "vit"}, {"workers", "4"}, {"sequence_parallel", "true"}}, 0, true)
                  .sequence_parallel);
  const std::string alone = config_error({{"model", "vit"}, {"sequence_parallel", "true"}});
  expect_one_line(alone, "sequence_parallel");
  EXPECT_NE(alone.find("allowed with tp 1: sequence_parallel false"), std::string::npos) << alone;
  const std::string piped =
      config_error({{"tp", "2"}, {"pp", "2"}, {"model", "vit"}, {"workers", "4"}, {"sequence_parallel", "true"}});
  expect_one_line(piped, "sequence_parallel");
  EXPECT_NE(piped.find("allowed with pp 2: sequence_parallel false"), std::string::npos) << piped;
  expect_one_line(config_error({{"tp", "2"}, {"model", "vit"}, {"workers", "4"}, {"sequence_parallel", "maybe"}}),
                  "sequence_parallel");
}

// Pipeline stages cut the vit's 4 blocks (1, 2 or 4 stages; tp x pp dividing the workers) under bsp; micro-batches
// go with any model (gradient accumulation), 1 to batch_size, under bsp.
TEST(TrainConfig, PpCutsTheModelsIntoStagesAndMicroBatchesSplitTheBatch) {
  // The mlp, cnn and resnet are cut between their 3, 4 and 5 units; the vit's 4 blocks into 1, 2 or 4 stages.
  EXPECT_EQ(config_error({{"pp", "2"}}), "");  // (the cnn on 4 workers)
  EXPECT_EQ(config_error({{"pp", "4"}, {"model", "cnn"}}), "");
  EXPECT_EQ(config_error({{"pp", "5"}, {"model", "resnet"}, {"workers", "5"}}), "");
  EXPECT_EQ(config_error({{"pp", "3"}, {"model", "mlp"}, {"workers", "3"}}), "");
  const std::string mlp = config_error({{"pp", "4"}, {"model", "mlp"}});
  expect_one_line(mlp, "pp");
  EXPECT_NE(mlp.find("4 stages of model mlp, whose 3 units are its finest cut; allowed: pp 1 to 3"), std::string::npos)
      << mlp;
  expect_one_line(config_error({{"pp", "5"}, {"workers", "5"}}), "pp");  // (the cnn's 4 units)
  expect_one_line(config_error({{"pp", "0"}}), "pp");
  const std::string cnn_il = config_error({{"pp", "2"}, {"pp_schedule", "interleaved"}, {"micro_batches", "2"}});
  expect_one_line(cnn_il, "pp_schedule");
  EXPECT_NE(cnn_il.find("allowed: model vit and pp 2, or gpipe or 1f1b"), std::string::npos) << cnn_il;
  expect_one_line(config_error({{"pp", "3"}, {"model", "vit"}, {"workers", "3"}}), "pp");
  const std::string uneven = config_error({{"pp", "2"}, {"tp", "2"}, {"model", "vit"}, {"workers", "6"}});
  expect_one_line(uneven, "pp");
  EXPECT_NE(uneven.find("do not divide the 6 workers"), std::string::npos) << uneven;
  expect_one_line(config_error({{"pp", "2"}, {"model", "vit"}, {"workers", "4"}, {"sync", "local"}}), "pp");
  const std::string local = config_error({{"micro_batches", "2"}, {"sync", "diloco"}});
  expect_one_line(local, "micro_batches");
  EXPECT_NE(local.find("allowed with sync diloco: micro_batches 1"), std::string::npos) << local;
  expect_one_line(config_error({{"micro_batches", "0"}}), "micro_batches");
  const std::string many = config_error({{"micro_batches", "65"}});
  expect_one_line(many, "micro_batches");
  EXPECT_NE(many.find("allowed: 1 to batch_size (64)"), std::string::npos) << many;
  expect_one_line(config_error({{"pp_schedule", "interleaved"}}), "pp_schedule");
  expect_one_line(config_error({{"pp_schedule", "gpipe"}}), "pp_schedule");  // (no pipeline: pp 1)
  const std::string il4 = config_error({{"pp", "4"}, {"model", "vit"}, {"pp_schedule", "interleaved"}});
  expect_one_line(il4, "pp_schedule");
  EXPECT_NE(il4.find("this run has model vit and pp 4"), std::string::npos) << il4;
  const std::string il3 = config_error(
      {{"pp", "2"}, {"model", "vit"}, {"workers", "2"}, {"pp_schedule", "interleaved"}, {"micro_batches", "3"}});
  expect_one_line(il3, "micro_batches");
  EXPECT_NE(il3.find("allowed: a multiple of 2"), std::string::npos) << il3;
  EXPECT_EQ(
      config_error(
          {{"pp", "2"}, {"model", "vit"}, {"workers", "2"}, {"pp_schedule", "interleaved"}, {"micro_batches", "4"}}),
      "");
  const std::string recompute = config_error({{"recompute", "true"}, {"micro_batches", "4"}});
  expect_one_line(recompute, "recompute");
  EXPECT_NE(recompute.find("allowed with pp 1: recompute false"), std::string::npos) << recompute;
  EXPECT_TRUE(
      resolve_config({{"pp", "2"}, {"model", "vit"}, {"workers", "2"}, {"recompute", "true"}}, 0, true).recompute);
  const TrainConfig c = resolve_config(
      {{"pp", "2"}, {"tp", "2"}, {"model", "vit"}, {"workers", "8"}, {"micro_batches", "8"}, {"pp_schedule", "gpipe"}},
      0, true);
  EXPECT_EQ(c.pp, 2);
  EXPECT_EQ(c.micro_batches, 8);
  EXPECT_EQ(c.pp_schedule, "gpipe");
  EXPECT_EQ(resolve_config({{"micro_batches", "4"}}, 0, false).micro_batches, 4);
  EXPECT_EQ(TrainConfig().pp_schedule, "1f1b");
}

TEST(TrainConfig, MissingDatasetAndModelLimitsAreCaughtBeforeTraining) {
  TrainConfig c = resolve_config({{"data_dir", "/nonexistent/fashion"}});
  try {
    check_dataset(c);
    FAIL() << "no error for a missing dataset";
  } catch (const ConfigError& e) {
    expect_one_line(e.what(), "data_dir");
  }
  TrainConfig p;
  p.model = "mlp";
  p.compressor = "powersgd:rank=1000";
  try {
    check_model_config(p, 1);
    FAIL() << "no error for a PowerSGD rank larger than every layer";
  } catch (const ConfigError& e) {
    expect_one_line(e.what(), "rank");
  }
  // A tensor-parallel rank compresses its shares, a pipeline stage its layers, and only matrices whose ratio
  // n m / (r (n + m)) reaches min_ratio 2: the vit's QKV (192 x 64) up to rank 24, its shares at tp 4 (48 x 64, and
  // the 49 x 64 position table) up to 13. (The sides passed rank 49 at tp 4 and 64 at tp 1: nothing compressed.)
  auto powersgd_check = [](int tp, int pp, int rank) -> std::string {
    TrainConfig v;
    v.model = "vit";
    v.tp = tp;
    v.pp = pp;
    v.dataset = "synthetic";
    v.synthetic_samples = 1000;
    v.batch_size = 8;
    v.compressor = fmt::format("powersgd:rank={}", rank);
    try {
      check_model_config(v, tp * pp, true);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(powersgd_check(1, 1, 24), "");
  std::string err = powersgd_check(1, 1, 25);
  expect_one_line(err, "rank 25");
  EXPECT_NE(err.find("of at least min_ratio 2, and"), std::string::npos) << err;
  EXPECT_NE(err.find("allowed: rank 1 to 24"), std::string::npos) << err;
  EXPECT_EQ(powersgd_check(4, 1, 13), "");
  err = powersgd_check(4, 1, 14);
  expect_one_line(err, "rank 14");
  EXPECT_NE(err.find("split over tp 4"), std::string::npos) << err;
  EXPECT_NE(err.find("allowed: rank 1 to 13"), std::string::npos) << err;
  EXPECT_EQ(powersgd_check(4, 2, 13), "");
  EXPECT_NE(powersgd_check(4, 2, 49).find("allowed: rank 1 to 13"), std::string::npos);
  {
    TrainConfig v;
    v.model = "mlp";
    v.dataset = "synthetic";
    v.synthetic_samples = 1000;
    v.compressor = "powersgd:rank=1,min_ratio=1000000";
    try {
      check_model_config(v, 1);
      ADD_FAILURE() << "a min_ratio no rank reaches passed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("allowed: a smaller min_ratio (no rank reaches 1000000)"), std::string::npos)
          << e.what();
    }
  }
  // A pipeline stage whose matrices all go uncompressed at that rank is named once, by the process asked for notes
  // (the run goes on: the other stages compress). Each of the vit's 4 stages at tp 4 holds a block, whose QKV share
  // compresses at 13: no note. The mlp's last of 3 stages holds only its 10-wide classifier, at most rank 4.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(powersgd_check(4, 4, 13), "");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  TrainConfig mp;
  mp.model = "mlp";
  mp.pp = 3;
  mp.dataset = "synthetic";
  mp.synthetic_samples = 1000;
  mp.batch_size = 8;
  mp.compressor = "powersgd:rank=5";
  for (bool notes : {true, false}) {
    ::testing::internal::CaptureStderr();
    EXPECT_NO_THROW(check_model_config(mp, 3, notes));
    const std::string noted = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(noted.find("powersgd rank 5 compresses no matrix of pipeline stage 2 of 3 (at most rank 4 would at "
                         "min_ratio 2)") != std::string::npos,
              notes)
        << noted;
  }
  TrainConfig b;
  b.dataset = "synthetic";
  b.synthetic_samples = 100;
  b.batch_size = 64;
  try {
    check_model_config(b, 4);
    FAIL() << "no error for a batch larger than the data";
  } catch (const ConfigError& e) {
    expect_one_line(e.what(), "batch_size");
  }
}

TEST(TrainConfig, YamlKeysAndUnknownKeys) {
  auto dir = temp_dir("yaml");
  {
    std::ofstream f(dir / "a.yaml");
    f << "model: mlp\nbatch-size: 32\nlr: 0.1\ncompressor: none\n";
  }
  auto raw = read_yaml_config((dir / "a.yaml").string());
  TrainConfig c = resolve_config(raw);
  EXPECT_EQ(c.model, "mlp");
  EXPECT_EQ(c.batch_size, 32);
  EXPECT_DOUBLE_EQ(c.lr, 0.1);
  // What config_to_yaml writes reads back to the same configuration.
  {
    std::ofstream f(dir / "b.yaml");
    f << config_to_yaml(c);
  }
  TrainConfig d = resolve_config(read_yaml_config((dir / "b.yaml").string()));
  EXPECT_EQ(config_to_yaml(c), config_to_yaml(d));
  {
    std::ofstream f(dir / "c.yaml");
    f << "modle: mlp\n";
  }
  try {
    read_yaml_config((dir / "c.yaml").string());
    FAIL();
  } catch (const ConfigError& e) {
    expect_one_line(e.what(), "modle");
  }
  fs::remove_all(dir);
}

TEST(Data, IdxReaderReadsGzippedAndPlainFiles) {
  auto dir = temp_dir("idx");
  std::vector<uint8_t> file = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3};
  for (int i = 0; i < 12; ++i) file.push_back(uint8_t(i * 10));
  gzFile g = gzopen((dir / "x.gz").string().c_str(), "wb");
  gzwrite(g, file.data(), unsigned(file.size()));
  gzclose(g);
  std::ofstream(dir / "y", std::ios::binary).write(reinterpret_cast<char*>(file.data()), std::streamsize(file.size()));
  for (auto name : {"x.gz", "y"}) {
    IdxArray a = read_idx((dir / name).string());
    EXPECT_EQ(a.dims, (std::vector<uint32_t>{2, 2, 3}));
    ASSERT_EQ(a.data.size(), 12u);
    EXPECT_EQ(a.data[11], 110);
  }
  file[2] = 0x0D;  // floats: not supported
  std::ofstream(dir / "z", std::ios::binary).write(reinterpret_cast<char*>(file.data()), std::streamsize(file.size()));
  EXPECT_THROW(read_idx((dir / "z").string()), InvalidArgument);
  file[2] = 8;
  file.pop_back();  // truncated
  std::ofstream(dir / "w", std::ios::binary).write(reinterpret_cast<char*>(file.data()), std::streamsize(file.size()));
  EXPECT_THROW(read_idx((dir / "w").string()), InvalidArgument);
  EXPECT_THROW(read_idx((dir / "missing").string()), ConfigError);
  // A file longer than its header says is refused once the header is in and its size passed, without reading (and
  // holding, and copying) the rest: a small gzip file inflating towards 4 GiB was read whole first. Here 64 MiB of
  // zeros after a 2 x 2 x 3 header; the message gives the size the header allows.
  file.push_back(110);
  {
    gzFile big = gzopen((dir / "long.gz").string().c_str(), "wb");
    gzwrite(big, file.data(), unsigned(file.size()));
    std::vector<uint8_t> zeros(1 << 20, 0);
    for (int i = 0; i < 64; ++i) gzwrite(big, zeros.data(), unsigned(zeros.size()));
    gzclose(big);
  }
  try {
    read_idx((dir / "long.gz").string());
    ADD_FAILURE() << "a longer file passed";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is longer than its header says: more than the 28 bytes of header and data"),
              std::string::npos)
        << e.what();
  }
  // A header that promises more than the file holds is named as truncated (what the promised size no longer
  // allocates: the reader takes at most 64 MiB ahead of the data).
  std::vector<uint8_t> bad = {0, 0, 8, 1, 0xff, 0xff, 0xff, 0xff};
  std::ofstream(dir / "v", std::ios::binary).write(reinterpret_cast<char*>(bad.data()), std::streamsize(bad.size()));
  try {
    read_idx((dir / "v").string());
    ADD_FAILURE() << "a truncated file passed";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("truncated: 0 data bytes, the header says 4294967295"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

TEST(Data, FashionMnistLoadsWhenInstalled) {
  const char* dir = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(dir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  ImageSet s = load_mnist_format(dir, false, 100);
  EXPECT_EQ(s.n, 100);
  EXPECT_EQ(s.rows, 28);
  EXPECT_EQ(s.pixels.size(), 100u * 784);
  ImageSet full = load_mnist_format(dir, false);
  EXPECT_EQ(full.n, 10000);
}

TEST(Data, SamplerShardsByRankAndReshufflesPerEpoch) {
  const int64_t n = 103;
  const int w = 4;
  for (int64_t epoch : {0, 1}) {
    std::set<int64_t> all;
    for (int r = 0; r < w; ++r) {
      DistributedSampler s(n, w, r, 7);
      s.set_epoch(epoch);
      EXPECT_EQ(s.per_rank(), 25);
      auto b = s.batch(0, 25);
      ASSERT_EQ(b.size(), 25u);
      for (auto i : b) EXPECT_TRUE(all.insert(i).second) << "index " << i << " on two ranks";
    }
    EXPECT_EQ(all.size(), 100u);
  }
  DistributedSampler a(n, w, 0, 7), b(n, w, 0, 7), c(n, w, 0, 8);
  EXPECT_EQ(a.batch(0, 10), b.batch(0, 10));
  EXPECT_NE(a.batch(0, 10), c.batch(0, 10));
  b.set_epoch(1);
  EXPECT_NE(a.batch(0, 10), b.batch(0, 10));
  // The ranks' k-th batches of size 3 together are the k-th batch of size 12 of one worker.
  DistributedSampler one(n, 1, 0, 7);
  for (int64_t k = 0; k < 2; ++k) {
    std::multiset<int64_t> u, ref;
    for (int r = 0; r < w; ++r)
      for (auto i : DistributedSampler(n, w, r, 7).batch(k, 3)) u.insert(i);
    for (auto i : one.batch(k, 12)) ref.insert(i);
    EXPECT_EQ(u, ref);
  }
}


TEST(Train, BspWithNWorkersEqualsOneWorkerWithNTimesTheBatch) {
  for (std::string model : {"mlp", "cnn"}) {
    for (int world : {2, 4}) {
      TrainConfig c = tiny(model);
      c.max_steps = 6;
      auto multi = train_inproc(c, world);
      TrainConfig one = c;
      one.batch_size = c.batch_size * world;
      auto single = train_inproc(one, 1);
      // Every rank holds the same model, and it matches the single worker's to float tolerance.
      for (int r = 1; r < world; ++r) EXPECT_EQ(multi[size_t(r)].params, multi[0].params);
      EXPECT_LT(max_rel_diff(multi[0].params, single[0].params), 2e-4) << model << " world " << world;
      // The training loss is over every rank's samples, as the single worker's is over its whole batch (it was
      // rank 0's share alone).
      EXPECT_NEAR(multi[0].train_loss, single[0].train_loss, 1e-4 * single[0].train_loss)
          << model << " world " << world << " rank 1 " << multi[1].train_loss;
      EXPECT_EQ(multi[0].steps, 6);
      // Bytes: a plain f32 allreduce sends 2 (W-1)/W of the gradient per step.
      EXPECT_EQ(multi[0].payload_bytes, multi[0].grad_bytes);
      EXPECT_NEAR(double(multi[0].bytes_sent), 2.0 * (world - 1) / world * double(multi[0].grad_bytes),
                  double(multi[0].grad_bytes) * 1e-6 + 64);
    }
  }
}

// BatchNorm's running statistics are updated by each rank's forward on its own data: rank 0's are sent to the others
// after every step, so every rank evaluates and checkpoints one model (they drifted apart: ResNet's test accuracy
// mixed the ranks' statistics and resume was not bit for bit on ranks > 0).
TEST(Train, BatchNormStatisticsAreEqualOnEveryRank) {
  TrainConfig c = tiny("resnet");
  c.max_steps = 3;
  c.compressor = "none";
  auto r = train_inproc(c, 2);
  ASSERT_FALSE(r[0].buffers.empty());
  EXPECT_EQ(r[1].buffers, r[0].buffers);
  EXPECT_EQ(r[1].params, r[0].params);
  // The statistics' broadcast after each step is counted as traffic (it was left out): on 2 ranks the f32 gradients'
  // allreduce sends their bytes once, and each step adds half of the float buffers (4 bytes each) and of BatchNorm's
  // step counters (8 bytes a layer, fewer than 64 layers here) on each rank, as the allreduce's (W-1)/W: the ranks'
  // sum is the one copy that went (each rank counted the whole: twice what moved).
  ASSERT_EQ(r[0].steps, 3);
  const uint64_t extra = r[0].bytes_sent - r[0].grad_bytes;
  EXPECT_GE(extra, 3 * 4 * r[0].buffers.size() / 2) << r[0].bytes_sent << " " << r[0].grad_bytes;
  EXPECT_LT(extra, 3 * (4 * r[0].buffers.size() + 8 * 64) / 2) << r[0].bytes_sent << " " << r[0].grad_bytes;
  EXPECT_EQ(r[1].bytes_sent, r[0].bytes_sent);
}

#ifdef CONDUIT_WITH_COMPRESS
// Received bytes are what arrived: with a compressor whose payloads differ in size between ranks (threshold), what
// rank 0 received is what rank 1 sent (it was (W-1) times rank 0's own payload).
TEST(Train, VariableSizePayloadsAreCountedAsReceived) {
  TrainConfig c = tiny("mlp");
  c.compressor = "ef:threshold:threshold=0.002";
  c.max_steps = 5;
  auto r = train_inproc(c, 2);
  ASSERT_NE(r[0].bytes_sent, r[1].bytes_sent);  // the payloads did differ
  EXPECT_EQ(r[0].bytes_recv, r[1].bytes_sent);
  EXPECT_EQ(r[1].bytes_recv, r[0].bytes_sent);
}
#endif

TEST(Train, BucketCapDoesNotChangeTheResult) {
  // One bucket per tensor (= per-tensor allreduce) and one bucket for everything give the same model; with two
  // ranks every element is a + b whatever the algorithm, so the match is exact.
  TrainConfig per_tensor = tiny("mlp");
  per_tensor.max_steps = 5;
  per_tensor.bucket_cap_mb = 1e-6;
  per_tensor.first_bucket_mb = 1e-6;
  TrainConfig fused = per_tensor;
  fused.bucket_cap_mb = 64;
  fused.first_bucket_mb = 64;
  TrainConfig serial = per_tensor;
  serial.overlap = false;
  auto a = train_inproc(per_tensor, 2), b = train_inproc(fused, 2), s = train_inproc(serial, 2);
  EXPECT_EQ(a[0].params, b[0].params);
  EXPECT_EQ(a[0].params, s[0].params);
}

TEST(Train, BucketsFollowGradientReadyOrderWithASmallFirstBucket) {
  TrainConfig c = tiny("cnn");  // conv1.w conv1.b conv2.w conv2.b fc1.w fc1.b fc2.w fc2.b
  c.max_steps = 2;
  c.bucket_cap_mb = 25;
  c.first_bucket_mb = 0.01;
  auto r = train_inproc(c, 2);
  ASSERT_EQ(r[0].param_numel.size(), 8u);
  std::vector<int> seen(8, 0);
  for (auto& b : r[0].buckets)
    for (int i : b) ++seen[size_t(i)];
  EXPECT_EQ(seen, std::vector<int>(8, 1));
  ASSERT_EQ(r[0].buckets.size(), 2u);
  // Backward produces fc2's gradients first: they fill the small first bucket; fc1.w (1.6 MB) starts the next.
  size_t first_bytes = 0;
  for (int i : r[0].buckets[0]) first_bytes += 4 * r[0].param_numel[size_t(i)];
  EXPECT_LE(first_bytes, size_t(0.01 * 1024 * 1024));
  std::set<int> first(r[0].buckets[0].begin(), r[0].buckets[0].end());
  EXPECT_TRUE(first.count(6) && first.count(7));
  EXPECT_EQ(r[0].buckets[1].front(), 4);
  EXPECT_EQ(r[0].buckets, r[1].buckets);
  // Rebuilt in the order the gradients came, the convolutions' weights before their biases: reverse registration order
  // (4 3 2 1 0), which passed every check above, is what a layout that was never rebuilt keeps.
  EXPECT_EQ(r[0].buckets[1], (std::vector<int>{4, 2, 3, 0, 1}));
}

std::vector<std::string> resume_compressors() {
  std::vector<std::string> v = {"none"};
#ifdef CONDUIT_WITH_COMPRESS
  v.push_back("ef:topk:ratio=0.1");
  v.push_back("powersgd:rank=2");
#endif
  return v;
}

TEST(Train, CheckpointResumeContinuesBitForBit) {
  // 24 steps per epoch; the epoch-end checkpoint (step 24) resumes into the second epoch up to step 30.
  for (const auto& comp : resume_compressors()) {
    auto dir = temp_dir("resume");
    TrainConfig c = tiny("mlp");
    c.compressor = comp;
    c.epochs = 2;
    c.max_steps = 30;
    c.lr_schedule = "cosine";
    c.output = (dir / "straight").string();
    auto straight = train_inproc(c, 2, true);
    ASSERT_TRUE(fs::exists(dir / "straight" / "summary.json"));
    auto meta = read_json_file((dir / "straight" / "checkpoint" / "checkpoint.json").string());
    EXPECT_EQ(meta["global_step"].get<int64_t>(), 24);
    EXPECT_EQ(meta["epoch"].get<int>(), 1);
    TrainConfig resumed = c;
    resumed.output = (dir / "resumed").string();
    resumed.resume = (dir / "straight" / "checkpoint").string();
    auto r = train_inproc(resumed, 2, true);
    EXPECT_EQ(r[0].params, straight[0].params) << comp;
    EXPECT_EQ(r[1].params, straight[1].params) << comp;
    EXPECT_EQ(r[0].steps, 30);
    EXPECT_EQ(r[0].bytes_sent, straight[0].bytes_sent) << comp;
    fs::remove_all(dir);
  }
}

// The buckets rebuilt from the first step's gradient order go with the checkpoint: a resumed run started on reverse
// registration order and rebuilt after its first step, and with 3 ranks that step's ring chunks (the cnn's conv2
// weight moved ahead of its bias) summed in another order: not bit for bit.
TEST(Train, AResumeKeepsTheRebuiltBucketLayoutWithThreeRanks) {
  auto dir = temp_dir("layout");
  TrainConfig c = tiny("cnn");
  c.first_bucket_mb = 0.01;
  c.bucket_cap_mb = 0.5;
  c.lr_schedule = "constant";
  c.max_steps = 4;
  const auto [straight, r] = straight_and_resumed(c, 3, 2, dir);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(r[k].params, straight[k].params) << "rank " << k;
  fs::remove_all(dir);
}

// A resume chooses its collective algorithms by the cost model its checkpoint was written with (checkpoint.json keeps
// it exactly): measured again at start-up, the model could choose other algorithms, whose sums of 3 ranks' floats
// differ in the last bits, and a resume was not bit for bit (once in ten runs, an audit). Here the checkpointed run's
// latency-bound model chooses recursive doubling, the resumed run's own (the defaults) the ring.
TEST(Train, AResumeChoosesItsAlgorithmsByItsCheckpointsCostModel) {
  auto dir = temp_dir("costmodel");
  TrainConfig c = tiny("cnn");
  c.lr_schedule = "constant";
  c.max_steps = 4;
  coll::CostModel slow;
  slow.intra = slow.inter = {1e-2, 1e-12, 1e-12};
  TrainConfig straight = c, part = c, rest = c;
  straight.output = (dir / "straight").string();
  const auto whole = train_inproc(straight, 3, true, {}, 0, &slow);
  part.max_steps = 2;
  part.checkpoint_every = 2;
  part.output = (dir / "part").string();
  train_inproc(part, 3, true, {}, 0, &slow);
  rest.resume = (dir / "part" / "checkpoint").string();
  rest.output = (dir / "rest").string();
  const auto resumed = train_inproc(rest, 3, true);  // (the default model)
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(resumed[k].params, whole[k].params) << "rank " << k;
  // The same resume choosing by its own model: other sums (what the test above tells apart).
  const fs::path ck = dir / "part" / "checkpoint" / "checkpoint.json";
  auto meta = read_json_file(ck.string());
  ASSERT_TRUE(meta.contains("cost_model")) << meta.dump();
  EXPECT_EQ(meta["cost_model"]["intra"][0].get<double>(), 1e-2);
  meta.erase("cost_model");
  std::ofstream(ck) << meta.dump();
  rest.output = (dir / "own").string();
  EXPECT_NE(train_inproc(rest, 3, true)[0].params, whole[0].params);
  // A damaged one is named.
  meta["cost_model"] = {{"intra", {1, 2}}};
  std::ofstream(ck) << meta.dump();
  rest.output = (dir / "bad").string();
  try {
    train_inproc(rest, 3, true);
    ADD_FAILURE() << "a damaged cost_model was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cost_model is {\"intra\":[1,2]}; allowed:"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// The warm-up's length in steps is rounded (0.29 of 24 steps: 7) and recorded in the checkpoint; a resume keeps the
// recorded length, and one of a checkpoint from before the rounding, which has none, the truncated length it ran
// with (6), so the cosine's remaining steps are those of the run that wrote it.
TEST(Train, AResumeKeepsTheWarmupLengthItsCheckpointRanWith) {
  auto dir = temp_dir("warm");
  TrainConfig c = tiny("mlp");  // 24 steps an epoch with 2 workers
  c.epochs = 2;
  c.max_steps = 30;
  c.lr_schedule = "cosine";
  c.warmup_epochs = 0.29;
  c.output = (dir / "straight").string();
  auto straight = train_inproc(c, 2, true);
  const fs::path ck = dir / "straight" / "checkpoint" / "checkpoint.json";
  auto meta = read_json_file(ck.string());
  EXPECT_EQ(meta["warmup_steps"].get<int64_t>(), 7);
  TrainConfig resumed = c;
  resumed.output = (dir / "resumed").string();
  resumed.resume = (dir / "straight" / "checkpoint").string();
  EXPECT_EQ(train_inproc(resumed, 2, true)[0].params, straight[0].params);
  // As a checkpoint of before: no warmup_steps. It resumes, on the truncated warm-up (another schedule from here).
  meta.erase("warmup_steps");
  std::ofstream(ck) << meta.dump();
  resumed.output = (dir / "old").string();
  EXPECT_NE(train_inproc(resumed, 2, true)[0].params, straight[0].params);
  fs::remove_all(dir);
}

// zero_reduce micro-batch (zero 2 and 3): each micro-batch's buckets reduce-scattered as they fill; the same training
// as reducing the step's sum once (to the float sums' order), the reduce-scatter's bytes once a micro-batch, and a
// resume takes the mode from the checkpoint and continues bit for bit.
TEST(Train, ZeroReducingEachMicroBatchTrainsAsReducingOnce) {
  auto dir = temp_dir("zero2reduce");
  TrainConfig c = tiny("mlp");  // 16 steps an epoch with 3 workers at batch 8
  c.lr = 0.05;
  c.epochs = 2;
  c.max_steps = 20;
  c.zero = 2;
  c.micro_batches = 2;
  c.output = (dir / "step").string();
  const auto once = train_inproc(c, 3, true);
  c.zero_reduce = "micro-batch";
  c.output = (dir / "micro").string();
  const auto each = train_inproc(c, 3, true);
  EXPECT_LT(max_rel_diff(each[0].params, once[0].params), 1e-3);
  EXPECT_GT(max_rel_diff(each[0].params, once[0].params), 0.0);  // (not the same code path)
  EXPECT_EQ(each[2].params, each[0].params);
  // The reduce-scatter's half of the exchange twice a step: 1.5 times the bytes.
  EXPECT_NEAR(double(each[0].world_bytes_sent), 1.5 * double(once[0].world_bytes_sent),
              1e-3 * double(once[0].world_bytes_sent));
  const auto summary = read_json_file((dir / "micro" / "summary.json").string());
  EXPECT_EQ(summary["zero_reduce"], "micro-batch");
  // (f32 on the wire: what an uncompressed run of this schedule moves; the earlier micro-batches' reduce-scatters were
  // counted as whole allreduces)
  EXPECT_EQ(summary["uncompressed_bytes"], summary["bytes_on_wire"]);
  EXPECT_EQ(read_json_file((dir / "micro" / "checkpoint" / "checkpoint.json").string())["zero_reduce"], "micro-batch");
  RawConfig raw{{"resume", (dir / "micro" / "checkpoint").string()}};
  apply_resume_defaults(raw, false);
  EXPECT_EQ(raw["zero_reduce"], "micro-batch");
  TrainConfig resumed = c;
  resumed.output = (dir / "resumed").string();
  resumed.resume = (dir / "micro" / "checkpoint").string();
  const auto r = train_inproc(resumed, 3, true);
  EXPECT_EQ(r[0].steps, 20);
  EXPECT_EQ(r[1].params, each[1].params);
  // ZeRO-3: both gather every layer forward and backward each micro-batch; reducing each one moves 3M/2 of the
  // allreduce's bytes against (2M + 1)/2 (M = 2: 3 against 2.5).
  c.zero = 3;
  c.max_steps = 6;
  c.zero_reduce = "step";
  c.output = (dir / "step3").string();
  const auto once3 = train_inproc(c, 3, true);
  c.zero_reduce = "micro-batch";
  c.output = (dir / "micro3").string();
  const auto each3 = train_inproc(c, 3, true);
  EXPECT_LT(max_rel_diff(each3[0].params, once3[0].params), 1e-3);
  EXPECT_EQ(each3[2].params, each3[0].params);
  EXPECT_NEAR(double(each3[0].world_bytes_sent), 1.2 * double(once3[0].world_bytes_sent),
              2e-3 * double(once3[0].world_bytes_sent));
  EXPECT_EQ(read_json_file((dir / "micro3" / "summary.json").string())["zero_reduce"], "micro-batch");
  std::filesystem::remove_all(dir);
}

// ZeRO-2 over 3 ranks: the weights of plain bsp (to the float sum's order), a third of the optimizer state, and a
// resume from its partitioned checkpoint continues bit for bit; resumed with another stage or other bucket caps
// (each rank's state is of its slices of those buckets) it is refused.
TEST(Train, ZeroTrainsAsPlainBspAndResumesBitForBit) {
  auto dir = temp_dir("zero");
  TrainConfig c = tiny("mlp");  // 16 steps an epoch with 3 workers at batch 8
  c.optimizer = "adam";
  c.lr = 0.002;
  c.epochs = 2;
  c.max_steps = 22;
  c.output = (dir / "plain").string();
  auto plain = train_inproc(c, 3, true);
  c.zero = 2;
  c.output = (dir / "straight").string();
  auto straight = train_inproc(c, 3, true);
  EXPECT_LT(max_rel_diff(straight[0].params, plain[0].params), 1e-3);
  {  // The allgather deferred into the next forward (the default) or done in the step: the same weights, bit for bit.
    TrainConfig blocking = c;
    blocking.zero_prefetch = false;
    blocking.output = (dir / "blocking").string();
    EXPECT_EQ(train_inproc(blocking, 3, true)[1].params, straight[1].params);
  }
  EXPECT_EQ(straight[1].params, straight[0].params);
  EXPECT_EQ(straight[2].params, straight[0].params);
  // Adam's two moments of every element on each plain rank, of a third of them on each ZeRO rank.
  uint64_t sum = 0;
  for (auto& r : straight) {
    sum += r.optimizer_state_bytes;
    EXPECT_LT(r.optimizer_state_bytes, plain[0].optimizer_state_bytes / 3 + 1000);
  }
  EXPECT_EQ(sum, plain[0].optimizer_state_bytes);
  // The reduce-scatter and the allgather move the allreduce's bytes (rounded per bucket and step).
  EXPECT_NEAR(double(straight[0].world_bytes_sent), double(plain[0].world_bytes_sent),
              1e-4 * double(plain[0].world_bytes_sent));
  auto summary = read_json_file((dir / "straight" / "summary.json").string());
  EXPECT_EQ(summary["zero"], 2);
  EXPECT_EQ(summary["optimizer_state_bytes_rank0"].get<uint64_t>(), straight[0].optimizer_state_bytes);
  auto meta = read_json_file((dir / "straight" / "checkpoint" / "checkpoint.json").string());
  EXPECT_EQ(meta["global_step"].get<int64_t>(), 16);
  EXPECT_EQ(meta["zero"], 2);
  TrainConfig resumed = c;
  resumed.output = (dir / "resumed").string();
  resumed.resume = (dir / "straight" / "checkpoint").string();
  auto r = train_inproc(resumed, 3, true);
  EXPECT_EQ(r[0].steps, 22);
  EXPECT_EQ(r[0].params, straight[0].params);
  EXPECT_EQ(r[2].params, straight[2].params);
  // int4 blocks with error feedback: the residuals go into the checkpoint with the compressor state, so the resume
  // continues bit for bit (restarted with zero residuals it would round step 17's gradients otherwise).
  {
    TrainConfig ef = c;
    ef.compressor = "ef:int4";
    ef.output = (dir / "ef").string();
    const auto ef_straight = train_inproc(ef, 3, true);
    EXPECT_GT(max_rel_diff(ef_straight[0].params, straight[0].params), 0.0);  // (rounded)
    TrainConfig ef_resumed = ef;
    ef_resumed.output = (dir / "ef-resumed").string();
    ef_resumed.resume = (dir / "ef" / "checkpoint").string();
    EXPECT_EQ(train_inproc(ef_resumed, 3, true)[1].params, ef_straight[1].params);
  }
  // Stage 1 cuts the same slices: it resumes stage 2's checkpoint as stage 2 would.
  // (with the allgather behind the forward joined up to 64 MiB a call: only within a bucket, so the tiny buckets,
  // from the back fc3 and fc2.bias | fc2.weight | fc1.bias | fc1.weight, leave one join: fc3 into fc2.bias's call)
  TrainConfig one = resumed;
  one.zero = 1;
  one.zero_allgather_mb = 64;
  one.trace = true;
  one.output = (dir / "one").string();
  EXPECT_EQ(train_inproc(one, 3, true)[1].params, straight[1].params);
  {
    std::ifstream in(dir / "one" / "trace-rank0.json");
    const nlohmann::json trace = nlohmann::json::parse(in);
    const std::pair<int, uint64_t> pieces[] = {{0, 4 * 256}, {0, 4 * 200704}, {1, 4 * (128 + 1290)}, {1, 4 * 32768}};
    size_t deferred = 0;
    for (auto& e : trace)
      if (e.contains("args") && e["args"].value("deferred", false)) {
        const auto& [unit, bytes] = pieces[deferred++ % 4];
        EXPECT_EQ(e["args"]["bytes"].get<uint64_t>(), bytes) << e.dump();
        EXPECT_EQ(e["args"]["unit"].get<int>(), unit) << e.dump();
      }
    EXPECT_EQ(deferred % 4, 0u);
    EXPECT_GE(deferred, 4 * 4u);  // (the steps after the first of the resumed run's six)
    EXPECT_EQ(read_json_file((dir / "one" / "summary.json").string())["zero_allgather_mb"], 64);
  }
  for (auto [zero, cap] : {std::pair{0, 0.05}, std::pair{2, 0.1}}) {
    TrainConfig other = resumed;
    other.zero = zero;
    other.bucket_cap_mb = cap;
    other.output = (dir / "other").string();
    try {
      train_inproc(other, 3, true);
      ADD_FAILURE() << "resumed with zero " << zero << " and bucket_cap_mb " << cap;
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(zero == 0 ? "written with zero = 2, this run has 0; allowed: zero 1 or 2"
                                   : "bucket_cap_mb = 0.05, this run has 0.1"),
                std::string::npos)
          << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  fs::remove_all(dir);
}

// The vit whole on 2 data-parallel ranks (24 steps an epoch at batch 8), 6 Adam steps with a checkpoint at step 3
// and eval_every copies at steps 2 and 4 (evaluated at the checkpoint): what the model-parallel runs are held to.
TrainConfig whole_vit(const fs::path& dir) {
  TrainConfig c = tiny("vit");
  c.optimizer = "adam";
  c.lr = 0.002;
  c.max_steps = 6;
  c.checkpoint_every = 3;
  c.eval_every = 2;
  c.output = (dir / "whole").string();
  return c;
}

// Trains `c` on `world` in-process ranks to its step-3 checkpoint (in dir/first) and returns `c` resuming from it
// (into dir/resumed).
TrainConfig stopped_at_step_3(const TrainConfig& c, const fs::path& dir, int world) {
  TrainConfig first = c;
  first.max_steps = 3;
  first.output = (dir / "first").string();
  train_inproc(first, world, true);
  TrainConfig resumed = c;
  resumed.resume = (dir / "first" / "checkpoint").string();
  resumed.output = (dir / "resumed").string();
  return resumed;
}

// The test accuracies of a run's evaluation records (its eval_every copies' and epoch ends'), in order; every step
// record's compute time checked non-negative on the way.
std::vector<double> eval_accuracies(const fs::path& run) {
  std::vector<double> acc;
  std::ifstream m(run / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "eval") acc.push_back(j["test_accuracy"].get<double>());
    if (j["kind"] == "step") {
      EXPECT_GE(j["compute_s"].get<double>(), 0.0) << line;
    }
  }
  return acc;
}

// A run's epoch records, in order.
std::vector<nlohmann::json> epoch_records(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream m(run / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "epoch") out.push_back(j);
  }
  return out;
}

// ZeRO-3 sharded within pairs of the 4 workers (zero_shard_group 2, FSDP's HYBRID_SHARD) trains the mlp as ZeRO-3
// over all 4 (to the float sum's order), each rank holding half of it instead of a quarter; its checkpoint resumes
// bit for bit with the same groups and is refused with others (the optimizer state is of slices cut over them).
TEST(Train, ZeroThreeShardGroupsTrainAsZeroThreeAndResumeWithTheirGroups) {
  auto dir = temp_dir("zero3-shard");
  TrainConfig c = tiny("mlp");
  c.zero = 3;
  c.workers = 4;
  c.max_steps = 6;
  c.checkpoint_every = 3;
  c.output = (dir / "all").string();
  auto all = train_inproc(c, 4, true);
  TrainConfig h = c;
  h.zero_shard_group = 2;
  h.output = (dir / "pairs").string();
  auto pairs = train_inproc(h, 4, true);
  double worst = 0;
  for (size_t i = 0; i < all[0].params.size(); ++i)
    worst = std::max(worst, double(std::abs(pairs[0].params[i] - all[0].params[i])));
  EXPECT_LT(worst, 1e-5);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(pairs[size_t(r)].params, pairs[0].params) << r;
    EXPECT_NEAR(double(pairs[size_t(r)].parameter_bytes_held), 2.0 * double(all[size_t(r)].parameter_bytes_held),
                4 * 8)
        << r;  // (each unit's odd float)
  }
  // node: the groups are the hosts' workers (2 a host: the pairs, bit for bit), or, on one host, all of them; hosts
  // that hold different numbers are refused with one line.
  TrainConfig n = h;
  n.zero_shard_group = kHostGroup;
  n.output = (dir / "node").string();
  const auto by_host = train_inproc(n, 4, true, {}, 2);
  EXPECT_EQ(by_host[0].params, pairs[0].params);
  EXPECT_EQ(by_host[0].parameter_bytes_held, pairs[0].parameter_bytes_held);
  EXPECT_NE(read_json_file((dir / "node" / "summary.json").string()).dump().find("\"zero_shard_group\":2"),
            std::string::npos);
  n.output = (dir / "node-one-host").string();
  EXPECT_EQ(train_inproc(n, 4, true)[0].params, all[0].params);
  // (one worker a host: no groups either)
  n.output = (dir / "node-one-a-host").string();
  EXPECT_EQ(train_inproc(n, 4, true, {}, 1)[0].params, all[0].params);
  EXPECT_EQ(read_json_file((dir / "node-one-a-host" / "summary.json").string())["zero_shard_group"], 0);
  // hpZ's node: the backward's gathers within each host's pair, the training ZeRO-3's bit for bit.
  TrainConfig hpz = c;
  hpz.zero_hpz = kHostGroup;
  hpz.output = (dir / "hpz-node").string();
  EXPECT_EQ(train_inproc(hpz, 4, true, {}, 2)[0].params, all[0].params);
  EXPECT_EQ(read_json_file((dir / "hpz-node" / "summary.json").string())["zero_hpz"], 2);
  try {
    n.output = (dir / "node-uneven").string();
    train_inproc(n, 4, true, {}, 3);
    ADD_FAILURE() << "hosts of 3 and 1 workers were taken as node groups";
  } catch (const ConfigError& e) {
    expect_one_line(e.what(), "zero_shard_group");
    EXPECT_NE(
        std::string(e.what()).find("node: the hosts hold 3, 1 of the 4 workers, not as many each in consecutive "
                                   "ranks; allowed with node: as many workers on every host in consecutive ranks; "
                                   "or a group size, or 0"),
        std::string::npos)
        << e.what();
  }
  // Stage 2 likewise (FSDP's _HYBRID_SHARD_ZERO2): the same training, resumed bit for bit, refused with other groups.
  {
    TrainConfig z2 = h;
    z2.zero = 2;
    z2.output = (dir / "zero2-pairs").string();
    const auto z2_pairs = train_inproc(z2, 4, true);
    double apart = 0;
    for (size_t i = 0; i < all[0].params.size(); ++i)
      apart = std::max(apart, double(std::abs(z2_pairs[0].params[i] - all[0].params[i])));
    EXPECT_LT(apart, 1e-5);
    EXPECT_EQ(read_json_file((dir / "zero2-pairs" / "summary.json").string())["zero_shard_group"], 2);
    TrainConfig z2_resumed = stopped_at_step_3(z2, dir / "zero2", 4);
    EXPECT_EQ(train_inproc(z2_resumed, 4, true)[3].params, z2_pairs[3].params);
    z2_resumed.zero_shard_group = 0;
    EXPECT_THROW(train_inproc(z2_resumed, 4, true), ConfigError);
  }
  TrainConfig resumed = stopped_at_step_3(h, dir, 4);
  EXPECT_EQ(train_inproc(resumed, 4, true)[0].params, pairs[0].params);
  resumed.zero_shard_group = 0;
  try {
    train_inproc(resumed, 4, true);
    ADD_FAILURE() << "a run sharded over all ranks resumed a checkpoint of pairs";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("written with zero_shard_group = 2, this run has 0; allowed: the same "
                                         "zero_shard_group"),
              std::string::npos)
        << e.what();
  }
  // (node resolved on one host to no groups: the message says where the 0 came from; on hosts of 2 it resumes)
  resumed.zero_shard_group = kHostGroup;
  try {
    train_inproc(resumed, 4, true);
    ADD_FAILURE() << "node on one host resumed a checkpoint of pairs";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("this run has 0 (node, from the host map)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(train_inproc(resumed, 4, true, {}, 2)[0].params, pairs[0].params);
  fs::remove_all(dir);
}

// ZeRO-3 over 2 ranks trains the vit as plain data parallelism does, bit for bit (a sum of two floats has one
// order), each rank holding half of the parameters between steps, for 1.5 times the allreduce's bytes but the
// classifier unit's backward gather. The checkpoint, the evaluations and the eval_every copies read the whole model
// (without counting its gathers); the checkpoint resumes bit for bit, and is refused at stages 1 and 2. ResNet's
// units (BatchNorm's parameters in them, its statistics whole) train likewise.
TEST(Train, ZeroThreeShardsTheParametersAndTrainsAsPlainBsp) {
  auto dir = temp_dir("zero3");
  TrainConfig c = whole_vit(dir);
  auto plain = train_inproc(c, 2, true);
  TrainConfig z = c;
  z.zero = 3;
  z.output = (dir / "zero3").string();
  auto three = train_inproc(z, 2, true);
  ASSERT_EQ(plain[0].params.size(), 138890u);
  const uint64_t all = 4 * 138890;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(three[size_t(r)].params, plain[0].params) << r;
    EXPECT_EQ(three[size_t(r)].train_loss, plain[size_t(r)].train_loss) << r;
    EXPECT_EQ(plain[size_t(r)].parameter_bytes_held, all);
    EXPECT_LE(three[size_t(r)].parameter_bytes_held, all / 2 + 4 * 6) << r;  // (each unit's odd float)
  }
  EXPECT_EQ(three[0].parameter_bytes_held + three[1].parameter_bytes_held, all);
  EXPECT_EQ(three[0].test_accuracy, plain[0].test_accuracy);
  // The classifier unit (final norm 128 floats, head 650) stays gathered from its forward to its backward.
  const double ratio = double(three[0].world_bytes_sent) / double(plain[0].world_bytes_sent);
  EXPECT_NEAR(ratio, 1.5 - 778.0 / (2 * 138890), 1e-5);
  // The eval_every copies (steps 2 and 4) give the plain run's accuracies.
  auto evals = [&](const char* run) { return eval_accuracies(dir / run); };
  EXPECT_EQ(evals("zero3").size(), 2u);
  EXPECT_EQ(evals("zero3"), evals("whole"));
  auto summary = read_json_file((dir / "zero3" / "summary.json").string());
  EXPECT_EQ(summary["parameter_bytes_held_rank0"].get<uint64_t>(), three[0].parameter_bytes_held);
  TrainConfig resumed = stopped_at_step_3(z, dir, 2);
  EXPECT_EQ(train_inproc(resumed, 2, true)[1].params, three[1].params);
  resumed.zero = 2;
  try {
    train_inproc(resumed, 2, true);
    ADD_FAILURE() << "zero 2 resumed a zero 3 checkpoint";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("written with zero = 3, this run has 2; allowed: zero 3 (its optimizer state is each rank's "
                       "slices of every layer)"),
              std::string::npos)
        << msg;
  }
  TrainConfig res = tiny("resnet");
  res.max_steps = 4;
  auto res_plain = train_inproc(res, 2);
  res.zero = 3;
  auto res_three = train_inproc(res, 2);
  EXPECT_EQ(res_three[1].params, res_plain[1].params);
  EXPECT_EQ(res_three[1].buffers, res_plain[1].buffers);
  EXPECT_LT(res_three[1].parameter_bytes_held, res_plain[1].parameter_bytes_held / 2 + 4 * 5);
  res.zero_prefetch = false;  // (each gather blocking its layer: the same training, the same bytes)
  auto res_blocking = train_inproc(res, 2);
  EXPECT_EQ(res_blocking[1].params, res_plain[1].params);
  EXPECT_EQ(res_blocking[0].world_bytes_sent, res_three[0].world_bytes_sent);
  // bf16 gathers: fewer bytes (the gathers' halved, the reduce-scatters' not), every rank's exact slices alike.
  res.zero_prefetch = true;
  res.zero_gather = "bf16";
  auto res_bf16 = train_inproc(res, 2);
  EXPECT_LT(res_bf16[0].world_bytes_sent, res_three[0].world_bytes_sent);
  EXPECT_GT(res_bf16[0].world_bytes_sent, res_three[0].world_bytes_sent / 2);
  EXPECT_EQ(res_bf16[0].params, res_bf16[1].params);
  EXPECT_NE(res_bf16[0].params, res_three[0].params);  // (trained on rounded weights)
  // int8 gathers (blocks of 256 with a scale each): fewer bytes again, the same on every rank, near f32 training.
  res.zero_gather = "int8";
  auto res_int8 = train_inproc(res, 2);
  EXPECT_LT(res_int8[0].world_bytes_sent, res_bf16[0].world_bytes_sent);
  EXPECT_EQ(res_int8[0].params, res_int8[1].params);
  EXPECT_NE(res_int8[0].params, res_three[0].params);
  auto max_abs = [](const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
    return m;
  };
  // (4 steps: 0.0038 from f32's weights, bf16's 0.0027; the loss within 0.06%)
  EXPECT_LT(max_abs(res_int8[0].params, res_three[0].params), 0.02);
  EXPECT_NEAR(res_int8[0].train_loss, res_three[0].train_loss, 0.002 * res_three[0].train_loss);
  // With tensor parallelism (stage 3 over the data-parallel ranks, the split blocks its units), and with 2
  // micro-batches accumulated (each gathers forward and backward): bit for bit each one's stage-0 run.
  for (auto [tp, micro] : {std::pair{2, 1}, std::pair{1, 2}}) {
    TrainConfig v = tiny("vit");
    v.optimizer = "adam";
    v.lr = 0.002;
    v.max_steps = 3;
    v.tp = tp;
    v.micro_batches = micro;
    const int world = 2 * tp;
    auto v_plain = train_inproc(v, world);
    v.zero = 3;
    auto v_three = train_inproc(v, world);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(v_three[size_t(r)].params, v_plain[size_t(r)].params) << "tp " << tp << " rank " << r;
      EXPECT_LE(v_three[size_t(r)].parameter_bytes_held, v_plain[size_t(r)].parameter_bytes_held / 2 + 4 * 6);
    }
    // Micro-batches: 2 gathers forward and 2 backward (but the last unit's) a step, one reduce-scatter.
    if (micro == 2) {
      EXPECT_NEAR(double(v_three[0].world_bytes_sent) / double(v_plain[0].world_bytes_sent),
                  2.5 - 2 * 778.0 / (2 * 138890), 1e-5);
    }
  }
  fs::remove_all(dir);
}

// Sequence parallelism (tp 2: 25 + 24 tokens a rank; tp 4: 13 + 12 + 12 + 12) trains the vit as the whole model
// trains: the same losses to the float sums' order, the replicated parameters (their partial gradients summed over
// the group) equal on every rank of a group and close to the whole model's. Its allgathers and reduce-scatters move
// the allreduces' bytes exactly, plus the embedding's token gradients gathered, the pooled sums and the partial
// gradients. Its checkpoint resumes bit for bit, and without sequence parallelism (the same parameters).
// The vit split over tp ranks (`sp`, a run on 2 tp ranks) against the whole model (`whole`): every replicated
// parameter equal on the ranks of a group and within abs + rel x |w| of the whole model's, every split one 1/tp of it.
void replicated_close(const std::vector<TrainResult>& sp, const std::vector<TrainResult>& whole, int tp, double abs,
                      double rel) {
  size_t off = 0, whole_off = 0, replicated = 0;
  for (size_t p = 0; p < sp[0].param_numel.size(); ++p) {
    const size_t n = sp[0].param_numel[p];
    if (n == whole[0].param_numel[p]) {
      replicated += n;
      for (size_t i = 0; i < n; ++i) {
        for (int q = 1; q < tp; ++q) ASSERT_EQ(sp[size_t(q)].params[off + i], sp[0].params[off + i]) << p;
        const float w = whole[0].params[whole_off + i];
        ASSERT_NEAR(sp[0].params[off + i], w, abs + rel * std::abs(w)) << "tp " << tp << " parameter " << p;
      }
    } else {
      EXPECT_EQ(size_t(tp) * n, whole[0].param_numel[p]) << "parameter " << p;
    }
    off += n;
    whole_off += whole[0].param_numel[p];
  }
  EXPECT_EQ(replicated, 5002u + 4 * (64 + 64 + 4 * 64));
}

TEST(Train, SequenceParallelGroupsTrainTheVitAsTheWholeModelTrains) {
  auto dir = temp_dir("sp");
  TrainConfig c = whole_vit(dir);
  auto whole = train_inproc(c, 2, true);
  for (int tp : {2, 4}) {
    TrainConfig s = c;
    s.tp = tp;
    s.sequence_parallel = true;
    s.output = (dir / fmt::format("sp{}", tp)).string();
    const int world = 2 * tp;
    auto sp = train_inproc(s, world, true);
    for (int r = 0; r < world; ++r)
      EXPECT_NEAR(sp[size_t(r)].train_loss, whole[size_t(r / tp)].train_loss, 1e-4 * std::abs(whole[0].train_loss))
          << "tp " << tp << " rank " << r;
    EXPECT_NEAR(sp[0].test_accuracy, whole[0].test_accuracy, 1.0 / 64 + 1e-9);
    replicated_close(sp, whole, tp, 1e-4, 1e-3);
    // A step: the gradients (among 2 data-parallel ranks: once their size), and among tp, counted as allreduced
    // payload (an allgather or reduce-scatter as half an allreduce of its whole tensor): 32 collectives of the
    // 8 x 49 x 64 activations (8 a block: 4 forward, 4 backward), as 16 allreduces; the embedding's token gradients
    // gathered, the pooled token sums (8 x 64) and the partial gradients of 4 blocks' 6 x 64 and the final norm's 128.
    const uint64_t x = 8 * 49 * 64 * 4;
    const uint64_t payload = 16 * x + x / 2 + 8 * 64 * 4 + (4 * 6 * 64 + 128) * 4;
    const double factor = 2.0 * (tp - 1) / tp;
    EXPECT_EQ(sp[0].bytes_sent, 6u * (sp[0].params.size() * 4 + uint64_t(factor * double(payload) + 0.5)))
        << "tp " << tp;
    auto summary = read_json_file((dir / fmt::format("sp{}", tp) / "summary.json").string());
    EXPECT_EQ(summary["sequence_parallel"], true);
    if (tp != 2) continue;
    // Plain SGD (Adam's first steps hide a gradient's scale: a partial gradient summed twice would pass above).
    TrainConfig sgd_whole = c, sgd_sp = s;
    sgd_whole.optimizer = sgd_sp.optimizer = "sgd";
    sgd_whole.output = (dir / "sgd-whole").string();
    sgd_sp.output = (dir / "sgd-sp").string();
    replicated_close(train_inproc(sgd_sp, world, true), train_inproc(sgd_whole, 2, true), tp, 1e-6, 1e-5);
    // ZeRO-3 over the data-parallel ranks (2: sums of two floats) changes nothing.
    TrainConfig z3 = s;
    z3.zero = 3;
    z3.output = (dir / "sp-zero3").string();
    auto sp_zero3 = train_inproc(z3, world, true);
    for (int r = 0; r < world; ++r) EXPECT_EQ(sp_zero3[size_t(r)].params, sp[size_t(r)].params) << r;
    TrainConfig resumed = stopped_at_step_3(s, dir, world);
    EXPECT_EQ(train_inproc(resumed, world, true)[1].params, sp[1].params);
    resumed.sequence_parallel = false;
    resumed.output = (dir / "resumed-tp").string();
    auto plain_tp = train_inproc(resumed, world, true);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(plain_tp[size_t(r)].params.size(), sp[size_t(r)].params.size());
      for (size_t i = 0; i < sp[size_t(r)].params.size(); ++i) {
        const float w = sp[size_t(r)].params[i];
        ASSERT_NEAR(plain_tp[size_t(r)].params[i], w, 1e-4 + 1e-3 * std::abs(w)) << "rank " << r << " element " << i;
      }
    }
  }
  fs::remove_all(dir);
}

// ZeRO's int reduce-scatter splits a data-parallel group at its host boundaries: tensor-parallel partners' groups must
// split alike, or their replicated parameters' partial sums are rounded at other points.
TEST(Train, TensorParallelPartnersGroupsSplitOverHostsAlikeOrTheIntWireGoesInOneHop) {
  // 2 hosts of 4, tp 2: groups {0,2 | 4,6} and {1,3 | 5,7}, alike.
  EXPECT_TRUE(tp_partners_split_alike({0, 0, 0, 0, 1, 1, 1, 1}, 2, 2));
  // 3 ranks a host, tp 2: {0,2 | 4} against {1 | 3,5}.
  EXPECT_FALSE(tp_partners_split_alike({0, 0, 0, 1, 1, 1}, 2, 2));
  // tp 2 x pp 2 on hosts of 4: each replica on a host of its own, every group {h0 | h1}.
  EXPECT_TRUE(tp_partners_split_alike({0, 0, 0, 0, 1, 1, 1, 1}, 2, 4));
  // One host, or no tensor parallelism: nothing to compare.
  EXPECT_TRUE(tp_partners_split_alike({0, 0, 0, 0, 0, 0}, 2, 2));
  EXPECT_TRUE(tp_partners_split_alike({0, 0, 0, 1, 1, 1}, 1, 1));
  // Hosts interleaved with the positions: {0,2} on hosts 0 then 0, {1,3} on 1 then 1: alike (one host each).
  EXPECT_TRUE(tp_partners_split_alike({0, 1, 0, 1}, 2, 2));
  // Stages differ between each other (pp 2, tp 2, hosts of 2): stage 0's groups {0 | 4} and {1 | 5} alike, as stage
  // 1's.
  EXPECT_TRUE(tp_partners_split_alike({0, 0, 1, 1, 2, 2, 3, 3}, 2, 4));
}

// The f32 sums too: where partners' data-parallel groups split over hosts otherwise, their allreduce and
// reduce-scatter go by ring (the tuner chose by each group's own host count and layout, hier on one and halving-
// doubling on the other, and the replicated parameters' copies drifted apart: 489 of 6,538 elements after 6 steps on
// hosts of 1 and 7); on a tuner of the group's own, so the parent's choices stay.
TEST(Train, TensorParallelPartnersSumByRingWhereTheirGroupsSplitOverHostsOtherwise) {
  auto comms = coll::Communicator::inproc(1);
  auto dp = comms[0]->split(0, 0);  // (sharing its parent's tuner)
  EXPECT_FALSE(agree_partner_sums(*dp, {0, 0, 0, 0, 1, 1, 1, 1}, 2, 2));
  EXPECT_FALSE(dp->tuner().forced_at(coll::CollOp::allreduce, 1 << 20));
  EXPECT_TRUE(agree_partner_sums(*dp, {0, 0, 0, 1, 1, 1}, 2, 2));
  for (size_t bytes : {size_t(8), size_t(1) << 20, size_t(1) << 30}) {
    EXPECT_EQ(dp->tuner().choose(coll::CollOp::allreduce, bytes, 8, 2, true), "ring") << bytes;
    EXPECT_EQ(dp->tuner().choose(coll::CollOp::reduce_scatter, bytes, 8, 2, true), "ring") << bytes;
  }
  EXPECT_FALSE(comms[0]->tuner().forced_at(coll::CollOp::allreduce, 1 << 20));
  EXPECT_NE(comms[0]->tuner().choose(coll::CollOp::allreduce, 8, 8, 2, true), "ring");
}

// Two groups of two tensor-parallel ranks train the vit as two data-parallel ranks train it whole: the same losses
// and accuracy to the float sums' order, every replicated parameter equal on both ranks of a group and close to the
// whole model's, each rank holding its share of the split ones; with ZeRO-1 over the groups too, and with PowerSGD
// on the groups' gradient exchange. The bytes on the wire are the gradients' and the activations' exactly (not the
// evaluations'). A checkpoint of the split run resumes bit for bit, and is refused with another tp.
TEST(Train, TensorParallelGroupsTrainTheVitAsTheWholeModelTrains) {
  auto dir = temp_dir("tp");
  TrainConfig c = whole_vit(dir);
  auto whole = train_inproc(c, 2, true);
  // Under plain SGD too, at tp 2 and 4 (Adam's first steps hide a gradient's scale: a split parameter's gradient
  // allreduced once too often would pass the Adam runs below; sequence parallelism had the only SGD check).
  {
    TrainConfig sgd = c;
    sgd.optimizer = "sgd";
    sgd.output = (dir / "sgd-whole").string();
    const auto sgd_whole = train_inproc(sgd, 2, true);
    for (int tp : {2, 4}) {
      TrainConfig s = sgd;
      s.tp = tp;
      s.output = (dir / fmt::format("sgd-tp{}", tp)).string();
      const auto split = train_inproc(s, 2 * tp, true);
      for (int r = 0; r < 2 * tp; ++r)
        EXPECT_NEAR(split[size_t(r)].train_loss, sgd_whole[size_t(r / tp)].train_loss,
                    1e-5 * std::abs(sgd_whole[0].train_loss))
            << "tp " << tp << " rank " << r;
      replicated_close(split, sgd_whole, tp, 1e-6, 1e-5);
    }
  }
  c.tp = 2;
  c.output = (dir / "split").string();
  c.trace = true;
  auto split = train_inproc(c, 4, true);
  c.trace = false;
  {
    // Every activation allreduce is on the timeline: 16 a training step, and those of the evaluations.
    std::ifstream t(dir / "split" / "trace-rank1.json");
    const std::string text((std::istreambuf_iterator<char>(t)), std::istreambuf_iterator<char>());
    size_t events = 0;
    for (size_t at = text.find("\"tp allreduce\""); at != std::string::npos; at = text.find("\"tp allreduce\"", at + 1))
      ++events;
    EXPECT_GE(events, 6u * 16);
  }
  TrainConfig zero = c;
  zero.zero = 1;
  zero.output = (dir / "split-zero").string();
  auto split_zero = train_inproc(zero, 4);
  TrainConfig psgd = c;
  psgd.compressor = "powersgd:rank=2";
  psgd.output = (dir / "split-psgd").string();
  auto split_psgd = train_inproc(psgd, 4);
  // The int wires (ZeRO++'s int8 gradients with error feedback, and int8 weight gathers at stage 3) round each
  // parameter in blocks of its own: a block holding a replicated parameter and a split one got another scale on each
  // rank of the group, and the replicated copies drifted apart (19-31 of them after 4-16 steps).
  TrainConfig qgz = c;
  qgz.zero = 2;
  qgz.compressor = "ef:int8";
  qgz.output = (dir / "split-qgz").string();
  auto split_qgz = train_inproc(qgz, 4);
  TrainConfig qwz = c;
  qwz.zero = 3;
  qwz.zero_gather = "int8";
  qwz.compressor = "int4";
  qwz.output = (dir / "split-qwz").string();
  auto split_qwz = train_inproc(qwz, 4);
  // Replicated parameters have the whole model's size; the split ones (QKV, the output projection's and MLP's
  // weights, the first MLP layer's bias) half of it.
  ASSERT_EQ(split[0].param_numel.size(), whole[0].param_numel.size());
  for (auto* run : {&split, &split_zero, &split_psgd, &split_qgz, &split_qwz}) {
    const auto& r = *run;
    const bool exact = run == &split || run == &split_zero;
    if (exact) {
      EXPECT_NEAR(r[0].train_loss, whole[0].train_loss, 1e-4 * std::abs(whole[0].train_loss));
      EXPECT_NEAR(r[2].train_loss, whole[1].train_loss, 1e-4 * std::abs(whole[1].train_loss));
      EXPECT_NEAR(r[0].test_accuracy, whole[0].test_accuracy, 1.0 / 64 + 1e-9);
    }
    // 4 blocks of 16,928 (of 33,472) and 5,002 replicated outside them.
    EXPECT_EQ(r[0].params.size(), 72714u);
    EXPECT_EQ(r[1].params.size(), 72714u);
    size_t off = 0, whole_off = 0, replicated = 0;
    for (size_t p = 0; p < r[0].param_numel.size(); ++p) {
      const size_t n = r[0].param_numel[p];
      if (n == whole[0].param_numel[p]) {
        replicated += n;
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(r[0].params[off + i], r[1].params[off + i]) << "parameter " << p;
          const float w = whole[0].params[whole_off + i];
          if (exact) {
            ASSERT_NEAR(r[0].params[off + i], w, 1e-4 + 1e-3 * std::abs(w)) << "parameter " << p;
          }
        }
      } else {
        EXPECT_EQ(2 * n, whole[0].param_numel[p]) << "parameter " << p;
      }
      off += n;
      whole_off += whole[0].param_numel[p];
    }
    EXPECT_EQ(replicated, 5002u + 4 * (64 + 64 + 4 * 64));
    // The data-parallel ranks at one position of their groups average their gradients: equal.
    EXPECT_EQ(r[0].params, r[2].params);
    EXPECT_EQ(r[1].params, r[3].params);
  }
  // A step sends each rank's gradients (72,714 floats, allreduced among 2: once their size) and 16 allreduces among
  // 2 of 8 x 49 x 64 activations (4 a block: two forward, two backward).
  EXPECT_EQ(split[0].bytes_sent, 6u * (72714 * 4 + 16 * 8 * 49 * 64 * 4));
  std::ifstream metrics(dir / "split" / "metrics.jsonl");
  int step_records = 0;
  for (std::string line; std::getline(metrics, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] != "step") continue;
    ++step_records;
    EXPECT_GE(j["compute_s"].get<double>(), 0.0) << line;
  }
  EXPECT_EQ(step_records, 6);
  auto summary = read_json_file((dir / "split" / "summary.json").string());
  EXPECT_EQ(summary["tp"], 2);
  EXPECT_EQ(summary["data_parallel"], 2);
  // Stopped after its step-3 checkpoint, then resumed to step 6 (a constant lr: the shorter run's schedule is the
  // same).
  TrainConfig resumed = stopped_at_step_3(c, dir, 4);
  ASSERT_EQ(read_json_file((dir / "first" / "checkpoint" / "checkpoint.json").string())["global_step"], 3);
  auto r = train_inproc(resumed, 4, true);
  EXPECT_EQ(r[0].params, split[0].params);
  EXPECT_EQ(r[1].params, split[1].params);
  resumed.tp = 1;
  resumed.output = (dir / "other").string();
  try {
    train_inproc(resumed, 4, true);
    ADD_FAILURE() << "resumed with tp 1";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("written with tp = 2, this run has 1"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Pipeline parallelism: 2 or 4 stages of the vit, with micro-batches under both schedules, alone and with tensor
// parallelism and ZeRO, train what the whole model trains on as many data-parallel replicas; the stages' parameters
// are the whole model's in order; 1F1B holds at most as many micro-batches as stages remain, GPipe all of them; the
// bytes are the gradients' and the activations'; a resume continues bit for bit.
TEST(Train, PipelineStagesTrainTheVitAsTheWholeModelTrains) {
  auto dir = temp_dir("pp");
  TrainConfig c = whole_vit(dir);
  auto whole = train_inproc(c, 2, true);
  TrainConfig p = c;
  p.pp = 2;
  p.micro_batches = 4;
  p.output = (dir / "pp").string();
  p.trace = true;
  auto pp = train_inproc(p, 4, true);
  p.trace = false;
  TrainConfig g = p;
  g.pp_schedule = "gpipe";
  g.recompute = true;
  g.output = (dir / "gpipe").string();
  auto gpipe = train_inproc(g, 4, true);
  TrainConfig il = p;
  il.pp_schedule = "interleaved";  // 2 stages of 2 chunks: blocks 0 and 2 on stage 0, 1 and 3 on stage 1
  il.output = (dir / "interleaved").string();
  auto inter = train_inproc(il, 4, true);
  // train_worker refuses what resolve_config refuses of the interleaved schedule (its callers may not run that): at pp
  // 4 the vit's chunks came out one a stage and the Pipeline refused them with an InvalidArgument after the collective
  // set-up; micro-batches that are not a multiple of pp failed at the first step.
  for (auto [stages, mbs, what] :
       {std::tuple{4, 4,
                   "config: pp_schedule: interleaved gives each stage 2 or more chunks of the vit's 4 blocks, "
                   "this run has model vit and pp 4"},
        std::tuple{2, 3, "config: micro_batches: 3 is not a multiple of pp (2)"},
        std::tuple{1, 1,
                   "config: pp_schedule: interleaved gives each stage 2 or more chunks of the vit's 4 blocks, "
                   "this run has model vit and pp 1"}}) {
    TrainConfig bad = il;
    bad.pp = stages;
    bad.micro_batches = mbs;
    bad.output = "";
    try {
      train_inproc(bad, 4);
      ADD_FAILURE() << "pp " << stages << " with " << mbs << " micro-batches was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).find(what), 0u) << e.what();
    }
  }
  TrainConfig tp = p;
  tp.tp = 2;
  tp.micro_batches = 3;  // (3, 3 and 2 samples)
  tp.output = (dir / "tp").string();
  auto tpp = train_inproc(tp, 8, true);
  TrainConfig four = p;
  four.pp = 4;
  four.micro_batches = 8;
  four.zero = 2;
  four.output = (dir / "four").string();
  auto pp4 = train_inproc(four, 8, true);
  ASSERT_EQ(whole[0].params.size(), 138890u);
  // The stages' parameters, in stage order, are the whole model's (registration order: the embedding, the blocks,
  // the final norm and the classifier).
  auto stages = [](const std::vector<TrainResult>& r, std::vector<int> ranks) {
    std::vector<float> all;
    for (int k : ranks) all.insert(all.end(), r[size_t(k)].params.begin(), r[size_t(k)].params.end());
    return all;
  };
  // (Relative to the whole parameter vector: Adam's normalised steps turn the micro-batches' other order of float
  // sums into whole-lr differences on the few elements whose gradient is near zero.)
  auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b) {
    EXPECT_EQ(a.size(), b.size());
    double d = 0, n = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      d += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
      n += double(b[i]) * double(b[i]);
    }
    return std::sqrt(d / n);
  };
  for (auto* run : {&pp, &gpipe, &pp4, &tpp, &inter}) {
    const auto& r = *run;
    for (const auto& x : r) EXPECT_NEAR(x.train_loss, whole[0].train_loss, 1e-4 * std::abs(whole[0].train_loss));
    EXPECT_NEAR(r[0].test_accuracy, whole[0].test_accuracy, 1.0 / 64 + 1e-9);
    // The replicas of one stage average their gradients: equal.
    const size_t replica = r.size() / 2;
    for (size_t k = 0; k < replica; ++k) EXPECT_EQ(r[k].params, r[k + replica].params) << "rank " << k;
  }
  for (auto* run : {&pp, &gpipe}) {
    EXPECT_EQ((*run)[0].params.size(), 71168u);  // the embedding (1,088), the positions (3,136), 2 blocks of 33,472
    EXPECT_LT(rel_l2(stages(*run, {0, 1}), whole[0].params), 1e-4);  // (1.2e-5 measured)
  }
  EXPECT_LT(rel_l2(stages(pp4, {0, 1, 2, 3}), whole[0].params), 1e-4);
  // Either schedule sums each parameter's micro-batch gradients in micro-batch order, and the forward recomputed in
  // the backward is the same computation: bit for bit the same training.
  for (size_t k = 0; k < 4; ++k) EXPECT_EQ(gpipe[k].params, pp[k].params) << "rank " << k;
  {
    // Plain SGD (Adam's steps ignore a gradient's scale) on uneven micro-batches (3, 3 and 2 samples): each one's
    // loss is weighted by its share of the batch.
    TrainConfig sgd = c;
    sgd.optimizer = "sgd";
    sgd.lr = 0.05;
    sgd.eval_every = 0;
    sgd.checkpoint_every = 0;
    sgd.output = (dir / "sgd-whole").string();
    auto plain = train_inproc(sgd, 2);
    sgd.pp = 2;
    sgd.micro_batches = 3;
    sgd.output = (dir / "sgd-pp").string();
    auto piped = train_inproc(sgd, 4);
    EXPECT_LT(rel_l2(stages(piped, {0, 1}), plain[0].params), 1e-6);  // (1.6e-8 measured)
  }
  EXPECT_EQ(pp4[1].params.size(), 33472u);
  {
    // The interleaved stages' parts in the model's order: stage 0's embedding and block 0, stage 1's block 1, stage
    // 0's block 2, stage 1's block 3 and head.
    const size_t e = 1088 + 3136, blk = 33472;
    ASSERT_EQ(inter[0].params.size(), e + 2 * blk);
    std::vector<float> all(inter[0].params.begin(), inter[0].params.begin() + std::ptrdiff_t(e + blk));
    all.insert(all.end(), inter[1].params.begin(), inter[1].params.begin() + std::ptrdiff_t(blk));
    all.insert(all.end(), inter[0].params.begin() + std::ptrdiff_t(e + blk), inter[0].params.end());
    all.insert(all.end(), inter[1].params.begin() + std::ptrdiff_t(blk), inter[1].params.end());
    EXPECT_LT(rel_l2(all, whole[0].params), 1e-4);
  }
  // The micro-batches whose activations a stage held at once: 1F1B at most the stages from it to the last, GPipe all.
  EXPECT_EQ(pp[0].pipeline_peak_micro_batches, 2);
  EXPECT_EQ(pp[1].pipeline_peak_micro_batches, 1);
  EXPECT_EQ(gpipe[0].pipeline_peak_micro_batches, 4);
  EXPECT_EQ(gpipe[1].pipeline_peak_micro_batches, 4);
  for (int s = 0; s < 4; ++s) EXPECT_EQ(pp4[size_t(s)].pipeline_peak_micro_batches, 4 - s) << "stage " << s;
  EXPECT_EQ(tpp[0].pipeline_peak_micro_batches, 2);
  // Interleaved: (p - d - 1) 2 + (v - 1) p chunk forwards first, then one more.
  EXPECT_EQ(inter[0].pipeline_peak_micro_batches, 5);
  EXPECT_EQ(inter[1].pipeline_peak_micro_batches, 3);
  // A step sends stage 0's gradients (allreduced among 2: once their size) and the 8 samples' activations forward;
  // the last stage sends its gradients and the activations' gradients back.
  const uint64_t act = 8 * 49 * 64 * 4;
  EXPECT_EQ(pp[0].bytes_sent, 6u * (71168 * 4 + act));
  EXPECT_EQ(pp[1].bytes_sent, 6u * ((138890 - 71168) * 4 + act));
  EXPECT_EQ(pp[2].bytes_sent, pp[0].bytes_sent);
  EXPECT_EQ(gpipe[0].bytes_sent, pp[0].bytes_sent);
  // Interleaved, each stage sends three activations a sample: stage 0 its two chunks' outputs and chunk 1's input
  // gradient, stage 1 its chunk 0's output and both chunks' input gradients.
  EXPECT_EQ(inter[0].bytes_sent, 6u * (71168 * 4 + 3 * act));
  EXPECT_EQ(inter[1].bytes_sent, pp[1].bytes_sent + 6u * 2 * act);
  // The evaluations through the pipeline, the copies' too, give the whole model's accuracies.
  auto evals = [&](const char* run) { return eval_accuracies(dir / run); };
  const auto whole_evals = evals("whole");
  ASSERT_EQ(whole_evals.size(), 2u);  // steps 2 and 4 (6 is the end's)
  for (const char* run : {"pp", "gpipe", "tp", "four", "interleaved"}) {
    const auto e = evals(run);
    ASSERT_EQ(e.size(), whole_evals.size()) << run;
    for (size_t k = 0; k < e.size(); ++k) EXPECT_NEAR(e[k], whole_evals[k], 1.0 / 64 + 1e-9) << run;
  }
  {
    // Each micro-batch's forward and backward, and every receive, on the timeline of the last stage: 4 of the
    // activations a step; one chunk of 32 test images a receive for each of the 3 evaluations (the copies of steps 2
    // and 4, the end's).
    const auto trace = read_json_file((dir / "pp" / "trace-rank1.json").string());
    std::map<std::string, int> events;
    for (const auto& e : trace) {
      std::string name = e["name"].get<std::string>();
      if (name == "pp recv") name += " " + e["args"]["kind"].get<std::string>();
      ++events[name];
    }
    EXPECT_EQ(events["pipeline step"], 6);
    EXPECT_EQ(events["forward"], 6 * 4);
    EXPECT_EQ(events["backward"], 6 * 4);
    EXPECT_EQ(events["pp recv forward"], 6 * 4);
    EXPECT_EQ(events["pp recv inference"], 3);
    EXPECT_EQ(events["pp recv backward"], 0);  // (the last stage starts from its loss)
  }
  auto summary = read_json_file((dir / "pp" / "summary.json").string());
  EXPECT_EQ(summary["pp"], 2);
  EXPECT_EQ(summary["micro_batches"], 4);
  EXPECT_EQ(summary["pp_schedule"], "1f1b");
  EXPECT_EQ(summary["data_parallel"], 2);
  EXPECT_EQ(summary["pipeline_peak_micro_batches_rank0"], 2);
  // Stopped after its step-3 checkpoint, then resumed to step 6.
  TrainConfig resumed = stopped_at_step_3(p, dir, 4);
  auto r = train_inproc(resumed, 4, true);
  for (size_t k = 0; k < 4; ++k) EXPECT_EQ(r[k].params, pp[k].params) << "rank " << k;
  resumed.pp_schedule = "gpipe";  // (the same blocks a stage: allowed)
  EXPECT_EQ(train_inproc(resumed, 4, true)[1].params, pp[1].params);
  resumed.pp_schedule = "interleaved";
  resumed.output = (dir / "other-schedule").string();
  try {
    train_inproc(resumed, 4, true);
    ADD_FAILURE() << "resumed interleaved";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("written with pp_schedule 1f1b, this run has interleaved"), std::string::npos)
        << e.what();
  }
  resumed.pp_schedule = "1f1b";
  resumed.pp = 1;
  resumed.output = (dir / "other").string();
  try {
    train_inproc(resumed, 4, true);
    ADD_FAILURE() << "resumed with pp 1";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("written with pp = 2, this run has 1"), std::string::npos) << e.what();
  }
  // With one stage, micro-batches are gradient accumulation, for any model.
  TrainConfig mlp = tiny("mlp");
  mlp.max_steps = 6;
  auto plain = train_inproc(mlp, 2);
  mlp.micro_batches = 4;
  auto accumulated = train_inproc(mlp, 2);
  EXPECT_LT(max_rel_diff(accumulated[0].params, plain[0].params), 1e-4);
  EXPECT_EQ(accumulated[0].params, accumulated[1].params);
  EXPECT_EQ(accumulated[0].bytes_sent, plain[0].bytes_sent);
  EXPECT_EQ(accumulated[0].pipeline_peak_micro_batches, 1);
  fs::remove_all(dir);
}

TEST(PipelineStages, TheUnitsAreCutWhereTheLargestStageWorksLeast) {
  EXPECT_EQ(partition_units({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(partition_units({5, 1, 1, 1}, 2), (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(partition_units({1, 1, 1, 5}, 2), (std::vector<int>{0, 3, 4}));
  EXPECT_EQ(partition_units({3, 1, 1, 3}, 3), (std::vector<int>{0, 1, 3, 4}));
  EXPECT_EQ(partition_units({1, 2, 3}, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(partition_units({1, 2, 3}, 1), (std::vector<int>{0, 3}));
  EXPECT_EQ(partition_units({2, 2, 2}, 2), (std::vector<int>{0, 1, 3}));  // (of 2|4 and 4|2, the earlier cut)
  // (least largest stage 4: 4 | 4 | 1 1 1)
  EXPECT_EQ(partition_units({4, 4, 1, 1, 1}, 3), (std::vector<int>{0, 1, 2, 5}));
  EXPECT_THROW(partition_units({1, 2}, 3), InvalidArgument);
  EXPECT_THROW(partition_units({1, 2}, 0), InvalidArgument);
  // The models: the mlp's first layer alone; the cnn's convolutions against its linear layers; the resnet's stem and
  // first block against the rest.
  EXPECT_EQ(stage_bounds("mlp", 2), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(stage_bounds("cnn", 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(stage_bounds("resnet", 2), (std::vector<int>{0, 2, 5}));
  EXPECT_EQ(stage_bounds("resnet", 4), (std::vector<int>{0, 1, 2, 3, 5}));
  EXPECT_EQ(unit_costs("cnn")[1], 14.0 * 14 * 64 * 32 * 9);
  EXPECT_THROW(stage_bounds("vit", 2), ConfigError);
  EXPECT_THROW(stage_bounds("cnn", 5), ConfigError);
}

// The mlp, cnn and resnet cut into 2 pipeline stages between their units train what each whole model trains with
// the same micro-batches on as many data-parallel replicas: the stages' parameters are the whole model's in order,
// the resnet's BatchNorm statistics too (with recomputation: each micro-batch counted once), the evaluations give
// the same accuracies, and a stage sends its gradients and its boundary's activations (or their gradients).
TEST(Train, PipelineStagesTrainTheMlpCnnAndResnetAsTheWholeModelsTrain) {
  auto dir = temp_dir("pp-units");
  struct Case {
    const char* model;
    size_t stage0_params;  // the units before the cut
    int64_t boundary;      // floats a sample at the cut
  };
  // mlp: fc1 | fc2 fc3; cnn: conv1 conv2 | fc1 fc2; resnet: stem layer1 | layer2 layer3 fc.
  for (const Case& k : {Case{"mlp", 784 * 256 + 256, 256}, Case{"cnn", 32 * 9 + 32 + 64 * 32 * 9 + 64, 64 * 7 * 7},
                        Case{"resnet", 16 * 9 + 2 * 16 + 2 * (16 * 16 * 9 + 2 * 16), 16 * 28 * 28}}) {
    SCOPED_TRACE(k.model);
    TrainConfig c = tiny(k.model);
    c.optimizer = "sgd";
    c.max_steps = 4;
    c.eval_every = 2;
    c.micro_batches = 4;
    c.output = (dir / k.model / "whole").string();
    auto whole = train_inproc(c, 2, true);
    TrainConfig p = c;
    p.pp = 2;
    p.output = (dir / k.model / "pp").string();
    auto pp = train_inproc(p, 4, true);
    TrainConfig g = p;
    g.pp_schedule = "gpipe";
    g.recompute = true;
    g.output = (dir / k.model / "gpipe").string();
    auto gpipe = train_inproc(g, 4, true);
    ASSERT_EQ(pp[0].params.size(), k.stage0_params);
    for (auto* run : {&pp, &gpipe}) {
      const auto& r = *run;
      std::vector<float> params = r[0].params, buffers = r[0].buffers;
      params.insert(params.end(), r[1].params.begin(), r[1].params.end());
      buffers.insert(buffers.end(), r[1].buffers.begin(), r[1].buffers.end());
      EXPECT_LT(max_rel_diff(params, whole[0].params), 1e-5);
      EXPECT_LT(max_rel_diff(buffers, whole[0].buffers), 1e-5);  // (the resnet's; empty for the others)
      for (const auto& x : r) EXPECT_NEAR(x.train_loss, whole[0].train_loss, 1e-5 * std::abs(whole[0].train_loss));
      EXPECT_NEAR(r[0].test_accuracy, whole[0].test_accuracy, 1.0 / 64 + 1e-9);
      EXPECT_EQ(r[2].params, r[0].params);  // the replicas of a stage average their gradients
      // 4 steps: stage 0 sends its gradients (allreduced among 2: once their size) and 8 samples' activations, the
      // last stage its gradients and the activations' gradients; each stage of the resnet also broadcasts its
      // BatchNorm statistics after each step (4 bytes a float buffer element, 8 a layer's step counter), half of
      // them counted on each of the stage's 2 replicas ((W-1)/W, as the allreduce's).
      const uint64_t act = 8 * uint64_t(k.boundary) * 4;
      for (int s = 0; s < 2; ++s) {
        const uint64_t grads = s == 0 ? k.stage0_params : whole[0].params.size() - k.stage0_params;
        const uint64_t base = 4 * (grads * 4 + act), floats = 4 * 4 * r[size_t(s)].buffers.size() / 2;
        EXPECT_GE(r[size_t(s)].bytes_sent, base + floats) << "stage " << s;
        EXPECT_LE(r[size_t(s)].bytes_sent, base + floats + (floats > 0 ? 4 * 8 * 32 / 2 : 0)) << "stage " << s;
      }
    }
    const auto summary = read_json_file((dir / k.model / "pp" / "summary.json").string());
    EXPECT_EQ(summary["stage_bounds"][1], std::string(k.model) == "mlp" ? 1 : 2);
    // The same float sums in the same order, the forward recomputed in the backward the same computation.
    for (size_t r = 0; r < 4; ++r) {
      EXPECT_EQ(gpipe[r].params, pp[r].params) << "rank " << r;
      EXPECT_EQ(gpipe[r].buffers, pp[r].buffers) << "rank " << r;
    }
    EXPECT_EQ(pp[0].pipeline_peak_micro_batches, 2);
    EXPECT_EQ(gpipe[0].pipeline_peak_micro_batches, 4);
    const auto whole_evals = eval_accuracies(dir / k.model / "whole");
    ASSERT_EQ(whole_evals.size(), 1u);  // step 2's copy (4 is the end's: test_accuracy)
    for (const char* run : {"pp", "gpipe"}) {
      const auto e = eval_accuracies(dir / k.model / run);
      ASSERT_EQ(e.size(), whole_evals.size()) << run;
      for (size_t i = 0; i < e.size(); ++i) EXPECT_NEAR(e[i], whole_evals[i], 1.0 / 64 + 1e-9) << run;
    }
  }
  // A resumed cnn pipeline continues bit for bit.
  TrainConfig c = tiny("cnn");
  c.max_steps = 6;
  c.checkpoint_every = 3;
  c.pp = 2;
  c.micro_batches = 2;
  c.output = (dir / "cnn-pp").string();
  auto straight = train_inproc(c, 2, true);
  TrainConfig again = stopped_at_step_3(c, dir / "cnn-resume", 2);
  const fs::path meta_path = fs::path(again.resume) / "checkpoint.json";
  auto meta = read_json_file(meta_path.string());
  EXPECT_EQ(meta["stage_bounds"], nlohmann::json({0, 2, 4}));
  auto resumed = train_inproc(again, 2, true);
  for (size_t r = 0; r < 2; ++r) EXPECT_EQ(resumed[r].params, straight[r].params) << "rank " << r;
  // A checkpoint cut elsewhere (other unit costs) holds other modules in each stage's file: refused with one line.
  meta["stage_bounds"] = {0, 1, 4};
  std::ofstream(meta_path) << meta.dump();
  again.output = (dir / "cnn-resume" / "recut").string();
  try {
    train_inproc(again, 2, true);
    ADD_FAILURE() << "resumed a checkpoint cut elsewhere";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("stages begin at units [0,1,4], this version cuts model cnn at [0,2,4]"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A warm-up under two steps warms nothing up (its last step is at the full lr): refused with the shortest allowed.
TEST(Train, AWarmupShorterThanTwoStepsIsRefused) {
  TrainConfig c = tiny("mlp");  // 24 steps an epoch with 2 workers
  c.max_steps = 3;
  c.warmup_epochs = 0.05;  // 1.2 steps
  try {
    train_inproc(c, 2);
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("at least 0.08333 epochs (two steps)"), std::string::npos) << e.what();
  }
  c.warmup_epochs = 0.1;  // 2 steps
  EXPECT_NO_THROW(train_inproc(c, 2));
  c.warmup_epochs = 0.08333;  // the least the error names: 1.99992 steps, rounded (truncated, it was 1 and refused)
  EXPECT_NO_THROW(train_inproc(c, 2));
}

// A resume at an epoch's end may change the batch size: the remaining epochs run with the new one (the run's length
// was counted in the new batches, with the checkpoint's steps in the old ones, and it stopped an epoch early).
TEST(Train, AnEpochEndResumeWithAnotherBatchSizeRunsTheRemainingEpochs) {
  auto dir = temp_dir("rebatch");
  TrainConfig c = tiny("mlp");  // 24 steps an epoch at batch 8 with 2 workers
  c.epochs = 1;
  c.output = (dir / "first").string();
  train_inproc(c, 2, true);
  TrainConfig more = c;
  more.epochs = 3;
  more.batch_size = 16;  // 12 steps an epoch
  more.resume = (dir / "first" / "checkpoint").string();
  more.output = (dir / "more").string();
  auto r = train_inproc(more, 2, true);
  EXPECT_EQ(r[0].epochs, 3);
  EXPECT_EQ(r[0].steps, 24 + 2 * 12);
  fs::remove_all(dir);
}

// What a checkpoint's state belongs to is compared on resume: the optimizer (adam's moments are not sgd's momentum;
// adam -> sgd failed inside libtorch, adam -> adamw went on silently) and the target accuracy (the time to it was
// judged against the checkpoint's: a run that never reached 100% reported a time to it). A damaged
// checkpoint.json names its field.
TEST(Train, ResumeRefusesAnotherOptimizerOrTargetAndNamesADamagedField) {
  auto dir = temp_dir("resume-refuse");
  TrainConfig c = tiny("mlp");
  c.max_steps = 6;
  c.optimizer = "adam";
  c.lr = 0.001;
  c.target_accuracy = 0.2;
  c.compressor = "ef:topk:ratio=0.1";  // compress_min_bytes is compared only with a compressor
  c.output = (dir / "first").string();
  train_inproc(c, 2, true);
  auto config_error_of = [&](TrainConfig x) -> std::string {
    x.resume = (dir / "first" / "checkpoint").string();
    x.max_steps = 8;
    x.output = (dir / "second").string();
    try {
      train_inproc(x, 2, true);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  TrainConfig adamw = c;
  adamw.optimizer = "adamw";
  EXPECT_NE(config_error_of(adamw).find("optimizer = \"adam\""), std::string::npos) << config_error_of(adamw);
  TrainConfig target = c;
  target.target_accuracy = 1.0;
  EXPECT_NE(config_error_of(target).find("target_accuracy"), std::string::npos) << config_error_of(target);
  // Another compress_min_bytes moves tensors between the compressor and the plain allreduce: their error feedback
  // residuals (and momentum) would be dropped or start empty (a review found the resume accepted, 3 steps of
  // residuals lost).
  TrainConfig min_bytes = c;
  min_bytes.compress_min_bytes = 1 << 30;
  EXPECT_NE(config_error_of(min_bytes).find("compress_min_bytes = 0, this run has 1073741824"), std::string::npos)
      << config_error_of(min_bytes);
  EXPECT_EQ(config_error_of(c), "");  // the same settings resume
  // A checkpoint.json without its epoch, or with a string for a number.
  const fs::path meta_path = fs::canonical(dir / "first" / "checkpoint") / "checkpoint.json";
  auto meta = read_json_file(meta_path.string());
  auto damaged = meta;
  damaged.erase("epoch");
  write_json_file(meta_path.string(), damaged);
  std::string e = config_error_of(c);
  EXPECT_NE(e.find("checkpoint.json has no whole number 'epoch' (missing)"), std::string::npos) << e;
  damaged = meta;
  damaged["wall_s"] = "soon";
  write_json_file(meta_path.string(), damaged);
  e = config_error_of(c);
  EXPECT_NE(e.find("'wall_s' is \"soon\", not a number"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(Train, MidEpochCheckpointResumesAtTheSamplerPosition) {
  for (const auto& comp : resume_compressors()) {
    auto dir = temp_dir("mid");
    TrainConfig c = tiny("cnn");
    c.compressor = comp;
    c.max_steps = 12;
    c.output = (dir / "straight").string();
    auto straight = train_inproc(c, 2, true);
    TrainConfig part = c;
    part.max_steps = 7;
    part.checkpoint_every = 7;
    part.output = (dir / "part").string();
    train_inproc(part, 2, true);
    auto meta = read_json_file((dir / "part" / "checkpoint" / "checkpoint.json").string());
    EXPECT_EQ(meta["step"].get<int64_t>(), 7);
    TrainConfig rest = c;
    rest.resume = (dir / "part" / "checkpoint").string();
    rest.output = (dir / "rest").string();
    auto r = train_inproc(rest, 2, true);
    EXPECT_EQ(r[0].params, straight[0].params) << comp;
    // The epoch's record and the final training loss cover the whole epoch (the resumed run's were of its 5 steps).
    const auto whole = epoch_records(dir / "straight"), resumed = epoch_records(dir / "rest");
    ASSERT_EQ(whole.size(), 1u);
    ASSERT_EQ(resumed.size(), 1u);
    for (const char* key : {"train_loss", "train_accuracy"})
      EXPECT_DOUBLE_EQ(resumed[0][key].get<double>(), whole[0][key].get<double>()) << comp << " " << key;
    EXPECT_DOUBLE_EQ(read_json_file((dir / "rest" / "summary.json").string())["final_train_loss"].get<double>(),
                     read_json_file((dir / "straight" / "summary.json").string())["final_train_loss"].get<double>());
    // A checkpoint of before the sums were saved resumes as it did: the epoch's report covers the steps after it.
    if (comp == resume_compressors().front()) {
      for (int rank = 0; rank < 2; ++rank) {
        const fs::path t = dir / "part" / "checkpoint" / fmt::format("rank-{}", rank) / "totals.json";
        auto j = read_json_file(t.string());
        j.erase("epoch");
        std::ofstream(t) << j.dump();
      }
      TrainConfig old = rest;
      old.output = (dir / "old").string();
      EXPECT_EQ(train_inproc(old, 2, true)[0].params, straight[0].params);
      EXPECT_NE(epoch_records(dir / "old")[0]["train_loss"], whole[0]["train_loss"]);
    }
    // The checkpoints' time is said apart from the training clock's.
    const auto part_summary = read_json_file((dir / "part" / "summary.json").string());
    EXPECT_GT(part_summary["checkpoint_s"].get<double>(), 0.0);
    EXPECT_GT(part_summary["wall_time_s"].get<double>(), 0.0);
    fs::remove_all(dir);
  }
}

// A run resumed from an older stage into the same output, while `checkpoint` points at a newer one (a kill between
// the switch and the old stages' removal leaves both), reaches the linked stage's step: its checkpoint goes into a
// directory of its own (it rewrote the linked one in place, where a kill left the link at a half-written checkpoint),
// and the stages it replaces go once it is declared.
TEST(Train, ACheckpointNeverRewritesTheStageTheLinkPointsAt) {
  auto dir = temp_dir("restage");
  TrainConfig c = tiny("mlp");
  c.max_steps = 10;
  auto straight = train_inproc(c, 2);
  TrainConfig part = c;
  part.max_steps = 5;
  part.output = (dir / "part").string();
  train_inproc(part, 2, true);
  fs::copy(dir / "part" / "checkpoint-5", dir / "saved-5", fs::copy_options::recursive);
  TrainConfig more = c;
  more.output = part.output;
  more.resume = (dir / "part" / "checkpoint").string();
  train_inproc(more, 2, true);
  ASSERT_EQ(fs::read_symlink(dir / "part" / "checkpoint"), fs::path("checkpoint-10"));
  fs::copy(dir / "saved-5", dir / "part" / "checkpoint-5", fs::copy_options::recursive);  // (the kill's leftover)
  TrainConfig again = more;
  again.resume = (dir / "part" / "checkpoint-5").string();
  auto r = train_inproc(again, 2, true);
  EXPECT_EQ(r[0].params, straight[0].params);
  EXPECT_EQ(fs::read_symlink(dir / "part" / "checkpoint"), fs::path("checkpoint-10.1"));
  std::vector<std::string> staged;
  for (const auto& e : fs::directory_iterator(dir / "part"))
    if (e.path().filename().string().rfind("checkpoint-", 0) == 0) staged.push_back(e.path().filename().string());
  EXPECT_EQ(staged, std::vector<std::string>{"checkpoint-10.1"});
  EXPECT_EQ(read_json_file((dir / "part" / "checkpoint" / "checkpoint.json").string())["global_step"], 10);
  fs::remove_all(dir);
}

// A bsp run that --max-steps stops inside its first epoch (no epoch-end checkpoint, no checkpoint_every) still ends
// with a checkpoint, and resuming it continues bit for bit (it wrote none and could not be resumed).
TEST(Train, RunStoppedInItsFirstEpochCanBeResumed) {
  auto dir = temp_dir("first");
  TrainConfig c = tiny("mlp");  // 24 steps an epoch
  c.max_steps = 12;
  auto straight = train_inproc(c, 2);
  TrainConfig part = c;
  part.max_steps = 10;
  part.output = (dir / "part").string();
  // A user's copy beside the stages is not one of them (every checkpoint-* directory was removed at each switch).
  fs::create_directories(dir / "part" / "checkpoint-best");
  train_inproc(part, 2, true);
  EXPECT_TRUE(fs::exists(dir / "part" / "checkpoint-best"));
  fs::remove_all(dir / "part" / "checkpoint-best");
  auto meta = read_json_file((dir / "part" / "checkpoint" / "checkpoint.json").string());
  EXPECT_EQ(meta["global_step"].get<int64_t>(), 10);
  EXPECT_EQ(read_json_file((dir / "part" / "summary.json").string())["epochs"], 0);  // none completed (it said 1)
  // `checkpoint` is a link switched in one rename to a complete checkpoint-<step> directory, the only one left.
  EXPECT_TRUE(fs::is_symlink(dir / "part" / "checkpoint"));
  EXPECT_EQ(fs::read_symlink(dir / "part" / "checkpoint"), fs::path("checkpoint-10"));
  int staged = 0;
  for (const auto& e : fs::directory_iterator(dir / "part"))
    staged += e.path().filename().string().rfind("checkpoint-", 0) == 0;
  EXPECT_EQ(staged, 1);
  // Resumed into its own directory with nothing left to train, a run writes no checkpoint (it rewrote the live one in
  // place, which a kill could corrupt).
  const auto written = fs::last_write_time(dir / "part" / "checkpoint-10" / "rank-0" / "model.pt");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  TrainConfig again = part;
  again.resume = (dir / "part" / "checkpoint").string();
  train_inproc(again, 2, true);
  EXPECT_EQ(fs::last_write_time(dir / "part" / "checkpoint-10" / "rank-0" / "model.pt"), written);
  TrainConfig rest = c;
  rest.resume = (dir / "part" / "checkpoint").string();
  rest.output = (dir / "rest").string();
  auto r = train_inproc(rest, 2, true);
  EXPECT_EQ(r[0].params, straight[0].params);
  EXPECT_EQ(r[0].steps, 12);
  // The sampler position counts batches of this size in this seed's shuffle: another batch size or seed is refused
  // (it resumed silently, repeating or skipping samples for the rest of the epoch).
  for (auto [key, change] : {std::pair<std::string, std::function<void(TrainConfig&)>>{
                                 "batch_size", [](TrainConfig& t) { t.batch_size *= 2; }},
                             {"seed", [](TrainConfig& t) { t.seed += 1; }}}) {
    TrainConfig other = rest;
    change(other);
    other.output = (dir / ("other-" + key)).string();
    try {
      train_inproc(other, 2, true);
      ADD_FAILURE() << key << ": resumed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("written with " + key + " = "), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// Resuming into the directory of the interrupted run: the records past the checkpoint are replaced, not repeated
// (steps 11 and 12 and the epoch appeared twice).
TEST(Train, ResumeIntoTheSameOutputDoesNotRepeatRecords) {
  auto dir = temp_dir("same-out");
  TrainConfig c = tiny("mlp");  // 24 steps an epoch
  c.max_steps = 12;
  c.checkpoint_every = 5;
  c.output = dir.string();
  train_inproc(c, 2, true);  // checkpoints at 5 and 10, records up to step 12
  TrainConfig again = c;
  again.resume = (dir / "checkpoint").string();
  train_inproc(again, 2, true);
  std::ifstream m(dir / "metrics.jsonl");
  std::string line;
  std::vector<int64_t> steps;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") steps.push_back(j["global_step"].get<int64_t>());
  }
  std::vector<int64_t> expected(12);
  for (int i = 0; i < 12; ++i) expected[size_t(i)] = i + 1;
  EXPECT_EQ(steps, expected);
  fs::remove_all(dir);
}

// An MNIST-format folder (plain IDX files) of `n` training and n / 4 test images, 28x28, pixels and labels drawn
// from `seed`: folders of other seeds have files of the same sizes and other contents.
void write_mnist_folder(const fs::path& dir, uint32_t n, uint32_t seed) {
  fs::create_directories(dir);
  std::mt19937 rng(seed);
  auto write = [&](const char* name, const std::vector<uint32_t>& dims, int values) {
    std::ofstream f(dir / name, std::ios::binary);
    f.put(0).put(0).put(0x08).put(char(dims.size()));
    size_t total = 1;
    for (uint32_t d : dims) {
      for (int shift : {24, 16, 8, 0}) f.put(char((d >> shift) & 0xff));
      total *= d;
    }
    for (size_t i = 0; i < total; ++i) f.put(char(rng() % uint32_t(values)));
  };
  write("train-images-idx3-ubyte", {n, 28, 28}, 256);
  write("train-labels-idx1-ubyte", {n}, 10);
  write("t10k-images-idx3-ubyte", {n / 4, 28, 28}, 256);
  write("t10k-labels-idx1-ubyte", {n / 4}, 10);
}

// A mid-epoch resume trains on the data its checkpoint was written on: another data_dir, or the folder's files
// replaced, is refused naming both folders and their contents (it resumed without a word, the rest of the epoch over
// other samples); the same files at another path resume; at an epoch's end the data may change.
TEST(Train, AMidEpochResumeRefusesOtherTrainingData) {
  auto dir = temp_dir("data-id");
  write_mnist_folder(dir / "a", 96, 1);  // 6 steps an epoch with 2 workers at batch 8
  write_mnist_folder(dir / "b", 96, 2);  // the same sizes, other images and labels
  fs::copy(dir / "a", dir / "a-copy", fs::copy_options::recursive);
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.data_dir = (dir / "a").string();
  c.max_steps = 4;
  c.output = (dir / "part").string();
  train_inproc(c, 2, true);
  auto meta = read_json_file((dir / "part" / "checkpoint" / "checkpoint.json").string());
  ASSERT_EQ(meta["step"].get<int64_t>(), 4);
  const std::string a = fs::canonical(dir / "a").string(), b = fs::canonical(dir / "b").string();
  EXPECT_EQ(meta["data_dir_resolved"], a);
  auto resume_on = [&](const fs::path& data, const std::string& name) -> std::string {
    TrainConfig r = c;
    r.data_dir = data.string();
    r.max_steps = 6;
    r.resume = (dir / "part" / "checkpoint").string();
    r.output = (dir / name).string();
    try {
      train_inproc(r, 2, true);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const std::string other = resume_on(dir / "b", "on-b");
  expect_one_line(other, "data_dir");
  EXPECT_NE(other.find("the training data of data_dir '" + a + "' (96 samples of 28x28, fnv1a-64 "), std::string::npos)
      << other;
  EXPECT_NE(other.find("this run's data_dir is '" + b + "' (96 samples of 28x28, fnv1a-64 "), std::string::npos)
      << other;
  EXPECT_EQ(resume_on(dir / "a-copy", "on-copy"), "");  // the same files under another name
  fs::remove_all(dir / "a-copy");
  fs::copy(dir / "b", dir / "a-copy", fs::copy_options::recursive);  // that folder's files replaced
  EXPECT_NE(resume_on(dir / "a-copy", "on-replaced").find("allowed: the same training data"), std::string::npos);
  // At an epoch's end the next epoch draws a new permutation of whatever data it has.
  TrainConfig epoch = c;
  epoch.max_steps = 0;
  epoch.output = (dir / "epoch").string();
  train_inproc(epoch, 2, true);
  TrainConfig more = epoch;
  more.epochs = 2;
  more.data_dir = (dir / "b").string();
  more.resume = (dir / "epoch" / "checkpoint").string();
  more.output = (dir / "more").string();
  EXPECT_EQ(train_inproc(more, 2, true)[0].steps, 12);
  fs::remove_all(dir);
}

// train_inproc with each rank's own configuration and outputs (ranks whose output folders differ stand for nodes
// that share no file system).
std::vector<TrainResult> train_inproc_each(const std::vector<TrainConfig>& cs) {
  auto comms = coll::Communicator::inproc(int(cs.size()));
  std::vector<TrainResult> res(cs.size());
  std::vector<std::exception_ptr> errs(cs.size());
  std::vector<std::thread> ts;
  for (size_t r = 0; r < cs.size(); ++r)
    ts.emplace_back([&, r] {
      try {
        WorkerOptions o;
        o.keep_params = true;
        res[r] = train_worker(cs[r], comms[r], o);
      } catch (...) {
        errs[r] = std::current_exception();
      }
    });
  for (auto& t : ts) t.join();
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  return res;
}

// An MNIST folder of 96 samples whose training images are a FIFO (returned).
fs::path mnist_folder_with_piped_images(const fs::path& folder) {
  write_mnist_folder(folder, 96, 1);
  const fs::path images = folder / "train-images-idx3-ubyte";
  fs::remove(images);
  EXPECT_EQ(::mkfifo(images.c_str(), 0600), 0) << std::strerror(errno);
  return images;
}

// One worker trained with CONDUIT_TIMEOUT at 1 s (start-up's deadline the longer of it and c.timeout_s): its error
// ("" for none) and the seconds it took.
std::string one_worker_error(const TrainConfig& c, double& took) {
  const char* set = std::getenv("CONDUIT_TIMEOUT");
  const std::string had = set ? set : "";
  setenv("CONDUIT_TIMEOUT", "1", 1);
  std::string error;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    train_inproc(c, 1);
  } catch (const std::exception& e) {
    error = e.what();
  }
  took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (set)
    setenv("CONDUIT_TIMEOUT", had.c_str(), 1);
  else
    unsetenv("CONDUIT_TIMEOUT");
  return error;
}

// A data file that is a pipe nobody writes to fails at start-up's deadline, naming it (reading it waited for a writer
// for ever); the labels, read twice (their count before the workers start), must be a regular file.
TEST(Train, ADataPipeNobodyWritesToFailsAtTheDeadline) {
  auto dir = temp_dir("pipe-data");
  const fs::path images = mnist_folder_with_piped_images(dir / "a");
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.data_dir = (dir / "a").string();
  c.max_steps = 2;
  c.timeout_s = 3;  // (start-up's deadline: the longer of it and CONDUIT_TIMEOUT, 1 here)
  double took = 0;
  const std::string error = one_worker_error(c, took);
  EXPECT_NE(error.find("data: '" + images.string() + "' is a pipe nothing wrote to in 3 s, by start-up's deadline"),
            std::string::npos)
      << error;
  EXPECT_GT(took, 2.5);  // (the run's own --timeout-s, passed down)
  EXPECT_LT(took, 30);
  const fs::path labels = dir / "a" / "train-labels-idx1-ubyte";
  fs::remove(labels);
  ASSERT_EQ(::mkfifo(labels.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_THROW(mnist_format_train_count((dir / "a").string()), ConfigError);
  fs::remove_all(dir);
}

// The write end of a FIFO once a reader opened it (retried: a writer's open without one fails), -1 when `stop` or
// 30 s came first (a blocking open waited for ever, and the test with it, when the reader never came).
int open_fifo_writer(const fs::path& fifo, const std::atomic<bool>& stop) {
  for (int i = 0; i < 3000 && !stop; ++i) {
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) {
      ::fcntl(fd, F_SETFL, 0);
      return fd;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// A pipe read at the data's level (read_idx): a writer that opened it and left without writing fails at the deadline
// (the pipe then reports a hang-up at once, which the wait never timed out on: the worker spun for ever). (A writer
// that writes without end is stopped by the same check on every turn; not run here: gigabytes a second.)
TEST(Data, APipeWhoseWriterLeftWithoutWritingFailsAtTheDeadline) {
  auto dir = temp_dir("pipe-writers");
  const fs::path fifo = dir / "images";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  {
    std::atomic<bool> done{false};
    std::thread writer([&] {
      const int fd = open_fifo_writer(fifo, done);
      if (fd >= 0) ::close(fd);
    });
    std::string error;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      read_idx(fifo.string(), t0 + std::chrono::seconds(2));
    } catch (const ConfigError& e) {
      error = e.what();
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    done = true;
    writer.join();
    EXPECT_NE(error.find("is a pipe nothing wrote to in 2 s"), std::string::npos) << error;
    EXPECT_LT(took, 15);
  }
  fs::remove_all(dir);
}

// A pipe whose writer sent part of the file and stalled, holding it open, fails at start-up's deadline too: handed to
// zlib once its first bytes came, it held the worker for as long as the writer held the pipe (for ever).
TEST(Train, ADataPipeWhoseWriterStallsFailsAtTheDeadline) {
  auto dir = temp_dir("pipe-stall");
  const fs::path images = mnist_folder_with_piped_images(dir / "a");
  std::atomic<bool> done{false};
  std::thread writer([&] {
    const int fd = open_fifo_writer(images, done);
    if (fd < 0) return;
    const std::vector<char> head(200, 0);
    (void)!::write(fd, head.data(), head.size());
    for (int i = 0; i < 600 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::close(fd);
  });
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.data_dir = (dir / "a").string();
  c.max_steps = 2;
  c.timeout_s = 2;
  double took = 0;
  const std::string error = one_worker_error(c, took);
  done = true;
  writer.join();
  EXPECT_NE(error.find("data: the pipe '" + images.string() + "' was not written whole in 2 s"), std::string::npos)
      << error;
  EXPECT_NE(error.find("200 bytes came"), std::string::npos) << error;
  EXPECT_LT(took, 20);  // (the writer held the pipe for 30 s)
  fs::remove_all(dir);
}

// The workers load their data at their own pace: one whose training images come 3 s late (a FIFO here, standing for
// a slow disk) failed the other's first gradient exchange under a 1 s collective deadline; they now meet after
// loading under start-up's deadline (CONDUIT_TIMEOUT).
TEST(Train, AWorkerSlowToLoadItsDataDoesNotTimeTheOthersOut) {
  auto dir = temp_dir("slow-load");
  write_mnist_folder(dir / "a", 96, 1);
  fs::create_directories(dir / "b");
  for (const char* f : {"train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"})
    fs::copy_file(dir / "a" / f, dir / "b" / f);
  const fs::path fifo = dir / "b" / "train-images-idx3-ubyte";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::string content;
  {
    std::ifstream f(dir / "a" / "train-images-idx3-ubyte", std::ios::binary);
    content.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  }
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::seconds(3));
    // (non-blocking until the reader is there, so that a run that never reads cannot hang the test)
    int fd = -1;
    for (int i = 0; i < 300 && fd < 0; ++i) {
      fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (fd < 0) return;
    ::fcntl(fd, F_SETFL, 0);
    for (size_t at = 0; at < content.size();) {
      const ssize_t n = ::write(fd, content.data() + at, content.size() - at);
      if (n <= 0) break;
      at += size_t(n);
    }
    ::close(fd);
  });
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.timeout_s = 1;
  c.max_steps = 4;
  std::vector<TrainConfig> cs(2, c);
  cs[0].data_dir = (dir / "a").string();
  cs[1].data_dir = (dir / "b").string();
  for (auto& x : cs) x.output = (dir / "run").string();
  const char* set = std::getenv("CONDUIT_TIMEOUT");
  const std::string had = set ? set : "";
  unsetenv("CONDUIT_TIMEOUT");  // start-up's 300 s
  std::string error;
  try {
    const auto res = train_inproc_each(cs);
    EXPECT_EQ(res[0].steps, 4);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (set) setenv("CONDUIT_TIMEOUT", had.c_str(), 1);
  writer.join();
  EXPECT_EQ(error, "");
  fs::remove_all(dir);
}

// One node's copy of the training data differs from the checkpoint's while the others' match: every rank stops with a
// line (the others went on and waited in their first gradient exchange until the deadline: a timeout, no reason).
TEST(Train, OneRanksOtherTrainingDataStopsEveryRank) {
  auto dir = temp_dir("data-one-rank");
  write_mnist_folder(dir / "a", 96, 1);
  write_mnist_folder(dir / "b", 96, 2);
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.data_dir = (dir / "a").string();
  c.max_steps = 4;  // mid-epoch (6 steps an epoch)
  c.output = (dir / "part").string();
  train_inproc(c, 2, true);
  std::vector<TrainConfig> cs(2, c);
  for (auto& r : cs) {
    r.max_steps = 6;
    r.resume = (dir / "part" / "checkpoint").string();
    r.output = (dir / "rest").string();
  }
  cs[1].data_dir = (dir / "b").string();
  try {
    train_inproc_each(cs);  // rank 0's error first
    ADD_FAILURE() << "resumed with rank 1 on other data";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    expect_one_line(m, "resume");
    EXPECT_NE(m.find("another worker's training data is not the data the checkpoint was written on"), std::string::npos)
        << m;
  }
  fs::remove_all(dir);
}

// A fresh run whose nodes hold other copies of the data stops at start-up on every rank, naming both (other counts of
// steps an epoch waited in a gradient exchange until the deadline; equal counts trained on overlapping shards
// without a word). The test sets are compared too.
TEST(Train, WorkersThatLoadedOtherDataStopAtStartUp) {
  auto dir = temp_dir("data-fresh");
  write_mnist_folder(dir / "a", 96, 1);
  write_mnist_folder(dir / "b", 96, 2);   // the same sizes, other samples
  write_mnist_folder(dir / "c", 64, 1);   // fewer samples
  write_mnist_folder(dir / "d", 96, 1);   // the same training set, another test set
  write_mnist_folder(dir / "e", 100, 1);  // (its test images, 25 of them, start as a's 24)
  for (const char* f : {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    fs::remove(dir / "d" / f);
    fs::copy_file(dir / "e" / f, dir / "d" / f);
  }
  TrainConfig c = tiny("mlp");
  c.dataset = "mnist";
  c.max_steps = 2;
  for (const auto& [other, what] :
       std::vector<std::pair<std::string, std::string>>{{"b", "training sets: worker 0 96 samples"},
                                                        {"c", "training sets: worker 0 96 samples"},
                                                        {"d", "test sets: worker 0 24 samples"}}) {
    std::vector<TrainConfig> cs(2, c);
    cs[0].data_dir = (dir / "a").string();
    cs[1].data_dir = (dir / other).string();
    for (auto& x : cs) x.output = (dir / ("run-" + other)).string();
    try {
      train_inproc_each(cs);
      ADD_FAILURE() << "trained with rank 1 on " << other;
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      expect_one_line(m, "data");
      EXPECT_NE(m.find("data: the workers loaded different " + what), std::string::npos) << m;
      EXPECT_NE(m.find("worker 1 " +
                       std::string(other == "c"   ? "64"
                                   : other == "d" ? "25"
                                                  : "96") +
                       " samples"),
                std::string::npos)
          << m;
    }
  }
  // The same files at another path train.
  fs::copy(dir / "a", dir / "a2");
  std::vector<TrainConfig> cs(2, c);
  cs[0].data_dir = (dir / "a").string();
  cs[1].data_dir = (dir / "a2").string();
  for (auto& x : cs) x.output = (dir / "run-same").string();
  EXPECT_EQ(train_inproc_each(cs)[0].steps, 2);
  fs::remove_all(dir);
}

// Nodes without a shared file system (here: ranks whose output folders differ): each node's lowest rank declares
// every checkpoint there too (checkpoint.json, the `checkpoint` link, the older stages removed). Only rank 0 did: the
// other nodes kept every stage, without a link or checkpoint.json to resume from. Resumed from each node's own link,
// the run continues bit for bit; ranks whose links are at different steps (a run stopped while the nodes switched
// theirs) are refused, naming the stage every node keeps.
TEST(Train, NodesWithoutASharedFileSystemEachKeepTheirCheckpoint) {
  auto dir = temp_dir("nodes");
  TrainConfig c = tiny("mlp");  // 24 steps an epoch
  c.max_steps = 12;
  auto straight = train_inproc(c, 2);
  auto per_node = [&](const TrainConfig& base, const std::string& name, const std::string& resume) {
    std::vector<TrainConfig> cs(2, base);
    for (int r = 0; r < 2; ++r) {
      cs[size_t(r)].output = (dir / fmt::format("{}-node{}", name, r)).string();
      if (!resume.empty()) cs[size_t(r)].resume = (dir / fmt::format("{}-node{}", resume, r) / "checkpoint").string();
    }
    return cs;
  };
  TrainConfig part = c;
  part.max_steps = 9;
  part.checkpoint_every = 3;  // checkpoints at steps 3, 6 and 9
  train_inproc_each(per_node(part, "part", ""));
  for (int r = 0; r < 2; ++r) {
    const fs::path node = dir / fmt::format("part-node{}", r);
    ASSERT_TRUE(fs::is_symlink(node / "checkpoint")) << node;
    EXPECT_EQ(fs::read_symlink(node / "checkpoint"), fs::path("checkpoint-9")) << node;
    std::vector<std::string> left;  // what a checkpoint leaves: the link and its stage (no probe, no older stage)
    for (const auto& e : fs::directory_iterator(node)) {
      const std::string name = e.path().filename().string();
      if (name.find("checkpoint") != std::string::npos) left.push_back(name);
    }
    std::sort(left.begin(), left.end());
    EXPECT_EQ(left, (std::vector<std::string>{"checkpoint", "checkpoint-9"})) << node;
    EXPECT_TRUE(fs::exists(node / "checkpoint" / fmt::format("rank-{}", r) / "model.pt")) << node;
  }
  // One declaration on both nodes (rank 0's clock and accuracy).
  EXPECT_EQ(read_json_file((dir / "part-node0" / "checkpoint" / "checkpoint.json").string()),
            read_json_file((dir / "part-node1" / "checkpoint" / "checkpoint.json").string()));
  auto rest = train_inproc_each(per_node(c, "rest", "part"));
  EXPECT_EQ(rest[0].params, straight[0].params);
  EXPECT_EQ(rest[1].params, straight[1].params);
  EXPECT_EQ(rest[0].steps, 12);
  // Rank 1's node still at step 6 (its link not yet switched when the run stopped).
  TrainConfig shorter = part;
  shorter.max_steps = 6;
  train_inproc_each(per_node(shorter, "short", ""));
  auto mixed = per_node(c, "mixed", "part");
  mixed[1].resume = (dir / "short-node1" / "checkpoint").string();
  try {
    train_inproc_each(mixed);
    ADD_FAILURE() << "resumed from checkpoints of steps 9 and 6";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    expect_one_line(m, "resume");
    EXPECT_NE(m.find("checkpoints are of different steps (6 to 9;"), std::string::npos) << m;
    EXPECT_NE(m.find("allowed: --resume " + (dir / "part-node0" / "checkpoint-6").string() +
                     " (step 6, which every node keeps)"),
              std::string::npos)
        << m;
  }
  // A node whose copy cannot be read stops the others with it (they waited in the step exchange until their
  // deadline, and failed with a timeout): rank 0's error, rethrown first here, says so.
  fs::copy(dir / "part-node1", dir / "broken-node1", fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  write_text_file((dir / "broken-node1" / "checkpoint" / "checkpoint.json").string(), "{");
  auto broken = per_node(c, "after-broken", "part");
  broken[1].resume = (dir / "broken-node1" / "checkpoint").string();
  try {
    train_inproc_each(broken);
    ADD_FAILURE() << "resumed with rank 1's checkpoint.json cut short";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    expect_one_line(m, "resume");
    EXPECT_NE(m.find("another rank cannot read its copy of"), std::string::npos) << m;
  }
  fs::remove_all(dir);
}

TEST(Train, WritesMetricsSummaryAndTrace) {
  auto dir = temp_dir("outputs");
  TrainConfig c = tiny("mlp");
  c.output = dir.string();
  c.trace = true;
  c.target_accuracy = 0.5;
  auto r = train_inproc(c, 2, true);
  auto s = read_json_file((dir / "summary.json").string());
  EXPECT_EQ(s["workers"], 2);
  EXPECT_EQ(s["epochs"], 1);
  EXPECT_GT(s["final_test_accuracy"].get<double>(), 0.5);  // the synthetic classes are easy
  EXPECT_FALSE(s["time_to_target_s"].is_null());
  EXPECT_EQ(s["bytes_on_wire"].get<uint64_t>(), 2 * r[0].bytes_sent);
  EXPECT_EQ(s["uncompressed_bytes"].get<uint64_t>(), 2 * r[0].raw_bytes);
  std::ifstream m(dir / "metrics.jsonl");
  std::string line;
  int steps = 0, epochs = 0;
  while (std::getline(m, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") {
      ++steps;
      EXPECT_TRUE(j.contains("exposed_comm_s"));
      EXPECT_TRUE(j.contains("bytes_sent"));
      EXPECT_TRUE(j.contains("ratio"));
    }
    if (j["kind"] == "epoch") ++epochs;
  }
  EXPECT_EQ(steps, 24);
  EXPECT_EQ(epochs, 1);
  for (int rank : {0, 1}) {
    auto t = read_json_file((dir / fmt::format("trace-rank{}.json", rank)).string());
    std::set<std::string> names;
    for (auto& e : t) names.insert(e["name"].get<std::string>());
    for (auto n : {"forward", "backward", "bucket ready", "communicate", "wait for communication", "step"})
      EXPECT_TRUE(names.count(n)) << n;
  }
  fs::remove_all(dir);
#ifdef CONDUIT_WITH_COMPRESS
  c.compressor = "ef:topk:ratio=0.05";
  c.max_steps = 3;
  train_inproc(c, 2, true);
  auto t = read_json_file((dir / "trace-rank1.json").string());
  std::set<std::string> names;
  for (auto& e : t) names.insert(e["name"].get<std::string>());
  for (auto n : {"compress", "communicate", "decompress"}) EXPECT_TRUE(names.count(n)) << n;
  fs::remove_all(dir);
#endif
}

#ifdef CONDUIT_WITH_COMPRESS
TEST(Train, CompressorsPlugIn) {
  for (std::string comp : {"fp16", "ef:topk:ratio=0.05", "powersgd:rank=2", "powersgd:rank=2,wire=f16",
                           "ef:scaled_sign", "qsgd", "dgc:ratio=0.05"}) {
    TrainConfig c = tiny("mlp");
    c.compressor = comp;
    c.max_steps = 20;
    auto r = train_inproc(c, 2);
    EXPECT_EQ(r[0].params, r[1].params) << comp;  // every rank applies the same update
    EXPECT_LT(r[0].payload_bytes, r[0].grad_bytes) << comp;
    EXPECT_GT(r[0].test_accuracy, 0.3) << comp;
  }
}

// compress_min_bytes: gradients below the size skip the compressor. Above every layer's size the run equals
// uncompressed training (2 ranks: a + b is exact, so bit for bit); in between, the small layers' bytes are the f32
// bytes and the large layers' the compressor's.
TEST(Train, SmallGradientsSkipTheCompressor) {
  TrainConfig c = tiny("mlp");
  c.max_steps = 12;
  c.compressor = "none";
  auto plain = train_inproc(c, 2);
  c.compressor = "ef:topk:ratio=0.01";
  auto topk = train_inproc(c, 2);
  c.compress_min_bytes = int64_t(1) << 30;
  auto all_dense = train_inproc(c, 2);
  EXPECT_EQ(all_dense[0].params, plain[0].params);
  EXPECT_EQ(all_dense[0].payload_bytes, plain[0].payload_bytes);
  EXPECT_NE(topk[0].params, plain[0].params);
  // The MLP's layers: 784x256, 256x128, 128x10 and their biases; below 200 KB: all but the first weight.
  c.compress_min_bytes = 200000;
  auto mixed = train_inproc(c, 2);
  EXPECT_EQ(mixed[0].params, mixed[1].params);
  const uint64_t small = 4 * (256 + 256 * 128 + 128 + 128 * 10 + 10);
  const uint64_t k_first = (784 * 256 + 99) / 100;  // top-k of the first weight: u32 index + f32 value each
  EXPECT_EQ(mixed[0].payload_bytes, uint64_t(c.max_steps) * (small + 8 * k_first));
  EXPECT_GT(mixed[0].payload_bytes, topk[0].payload_bytes);
  EXPECT_LT(mixed[0].payload_bytes, plain[0].payload_bytes);
}

// dgc and signum take over the optimizer's momentum (the optimizer runs plain SGD), so the layers that skip them must
// get their momentum from the distributed optimizer: with every layer below compress_min_bytes, such a run is
// momentum SGD on the averaged gradients, as uncompressed training with the optimizer's momentum is. Their weight
// decay keeps a momentum of its own (DGC's reference optimizer), so with decay too the sum is momentum SGD's (dgc's
// decay without momentum, as before, ran 10x weaker; so did signum's in a first version of this change).
TEST(Train, LayersThatSkipDgcKeepTheirMomentum) {
  TrainConfig c = tiny("mlp");
  c.max_steps = 12;
  c.momentum = 0.9;
  std::vector<float> plain_params;
  for (const auto& [spec, decay] : std::vector<std::pair<std::string, double>>{
           {"dgc:ratio=0.01,momentum=0.9", 0.05}, {"signum:momentum=0.9", 0.05}, {"signum:momentum=0.9", 0.0}}) {
    TrainConfig run = c;
    run.weight_decay = decay;
    auto plain = train_inproc(run, 2);
    run.compress_min_bytes = int64_t(1) << 30;
    run.compressor = spec;
    auto dense = train_inproc(run, 2);
    EXPECT_EQ(dense[0].params, dense[1].params) << spec;
    EXPECT_LT(max_rel_diff(dense[0].params, plain[0].params), 1e-4) << spec;
    if (decay == 0) plain_params = plain[0].params;
  }
  c.compress_min_bytes = int64_t(1) << 30;
  c.compressor = "dgc:ratio=0.01,momentum=0.9";
  TrainConfig none = c;  // the same run without any momentum is far from it
  none.compressor = "none";
  none.momentum = 0;
  EXPECT_GT(max_rel_diff(train_inproc(none, 2)[0].params, plain_params), 1e-2);
}
#endif


TEST(TrainCli, ConfigurationErrorsStopBeforeTrainingWithOneLine) {
  // (a folder of this process's own: a run that trained, had a case failed to be refused, left it for the next)
  const fs::path never = fs::temp_directory_path() / fmt::format("conduit-train-never-{}", ::getpid());
  fs::remove_all(never);
  for (auto [args, field] : std::vector<std::pair<std::string, std::string>>{
           {"--model vgg", "model"},
           {"--lr -1", "lr"},
           {"--compressor nosuch", "compressor"},
           {"--data-dir /nonexistent", "data_dir"},
           {"--workers 0", "workers"},
           {"--model mlp --compressor powersgd:rank=100000", "rank"},
           {"--model cnn --pp 5", "pp"},
           {"--model vit --pp 2 --micro-batches 0", "micro_batches"},
       }) {
    CliRun r = run_conduit(args + " --output " + never.string());
    EXPECT_NE(r.code, 0) << args;
    // One line: "conduit: error: config: <field>: ..."
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find("conduit: error: config: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(field), std::string::npos) << r.out;
  }
  EXPECT_FALSE(fs::exists(never / "metrics.jsonl"));
  fs::remove_all(never);
  // Under torchrun's environment, --workers must agree with WORLD_SIZE.
  std::string env = "env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 ";
  FILE* p = popen((env + CONDUIT_BINARY + " train --workers 4 --dataset synthetic 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  EXPECT_NE(WEXITSTATUS(st), 0);
  EXPECT_NE(out.find("workers: 4 does not match WORLD_SIZE=2"), std::string::npos) << out;
  // A torchrun worker (TORCHELASTIC_RUN_ID) under an outer MPI launch takes torchrun's WORLD_SIZE, as its bootstrap
  // does (it took OMPI_COMM_WORLD_SIZE, and its own workers were refused as "2 does not match the 1 ranks").
  p = popen(("env TORCHELASTIC_RUN_ID=t1 OMPI_COMM_WORLD_SIZE=3 OMPI_COMM_WORLD_RANK=1 " + env + CONDUIT_BINARY +
             " train --workers 4 --dataset synthetic 2>&1")
                .c_str(),
            "r");
  out.clear();
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  st = pclose(p);
  EXPECT_NE(WEXITSTATUS(st), 0);
  EXPECT_NE(out.find("workers: 4 does not match WORLD_SIZE=2"), std::string::npos) << out;
  // RANK set, WORLD_SIZE not: refused; an empty RANK is unset, as everywhere else (it was refused as set).
  for (const char* rank : {"1", ""}) {
    p = popen(("env -u WORLD_SIZE RANK=" + std::string(rank) + " " + CONDUIT_BINARY +
               " train --workers 1 --dataset synthetic --synthetic-samples 64 --epochs 1 --progress false --output " +
               never.string() + "-rank" + rank + " 2>&1")
                  .c_str(),
              "r");
    out.clear();
    while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    st = pclose(p);
    const bool refused = out.find("RANK is set but WORLD_SIZE is not") != std::string::npos;
    EXPECT_EQ(refused, *rank != '\0') << out;
    EXPECT_EQ(WEXITSTATUS(st) == 0, *rank == '\0') << out;
  }
  fs::remove_all(never.string() + "-rank");
  fs::remove_all(never.string() + "-rank1");
}

TEST(SlowTrainCli, TwoLocalWorkersTrainAndResume) {
  auto dir = temp_dir("cli");
  std::string common = "--model mlp --dataset synthetic --synthetic-samples 512 --batch-size 16 --workers 2 "
                       "--epochs 2 --progress false --transport tcp";
  CliRun r = run_conduit(common + " --output " + (dir / "a").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("conduit train: mlp on synthetic, 2 workers"), std::string::npos) << r.out;
  auto s = read_json_file((dir / "a" / "summary.json").string());
  EXPECT_EQ(s["epochs"], 2);
  EXPECT_GT(s["final_test_accuracy"].get<double>(), 0.5);
  // Resume from the epoch-1... (the last checkpoint is the end of epoch 2: nothing is left to train).
  CliRun again = run_conduit(common + " --epochs 3 --output " + (dir / "b").string() + " --resume " +
                          (dir / "a" / "checkpoint").string());
  ASSERT_EQ(again.code, 0) << again.out;
  auto s2 = read_json_file((dir / "b" / "summary.json").string());
  EXPECT_EQ(s2["epochs"], 3);
  fs::remove_all(dir);
}

// Pipeline stages as processes over tcp: 2 pipelines of 2 stages, 2 micro-batches a batch, GPipe with
// recomputation, trained, evaluated and summarised.
TEST(SlowTrainCli, FourProcessesPipelineTheVitOverTcp) {
  auto dir = temp_dir("cli-pp");
  CliRun r = run_conduit(
      "--model vit --dataset synthetic --synthetic-samples 256 --test-limit 64 --batch-size 16 --workers 4 --pp 2 "
      "--micro-batches 2 --pp-schedule gpipe --recompute true --compressor none --optimizer adam --lr 0.002 "
      "--epochs 1 --progress false --transport tcp --output " +
      (dir / "a").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("conduit train: vit on synthetic, 4 workers (pp 2: 2 pipelines), 2 micro-batches gpipe"),
            std::string::npos)
      << r.out;
  auto s = read_json_file((dir / "a" / "summary.json").string());
  EXPECT_EQ(s["pp"], 2);
  EXPECT_EQ(s["recompute"], true);
  EXPECT_EQ(s["steps"], 8);  // 256 samples / (16 x 2 pipelines)
  EXPECT_EQ(s["pipeline_peak_micro_batches_rank0"], 2);
  EXPECT_GT(s["final_test_accuracy"].get<double>(), 0.3);  // (10 classes; the synthetic prototypes are easy)
  EXPECT_GT(s["max_rss_mb_rank0"].get<double>(), 0.0);
  fs::remove_all(dir);
}

// The model-parallel settings as processes, where the collectives of ZeRO-3's gathers, the communication thread and
// the tensor-parallel group run on real transports: tensor-parallel groups with sequence parallelism and ZeRO-3
// over tcp; ZeRO-3 with the mlp over shm; 2 tensor-parallel ranks in each of 2 pipeline stages.
TEST(SlowTrainCli, FourProcessesShardTheModelOverTcpAndShm) {
  auto dir = temp_dir("cli-shard");
  const std::string common =
      "--dataset synthetic --synthetic-samples 256 --test-limit 64 --batch-size 16 --workers 4 --compressor none "
      "--optimizer adam --lr 0.002 --epochs 1 --progress false ";
  CliRun sp = run_conduit(common + "--model vit --tp 2 --sequence-parallel --zero 3 --transport tcp --output " +
                          (dir / "sp").string());
  ASSERT_EQ(sp.code, 0) << sp.out;
  EXPECT_NE(sp.out.find("conduit train: vit on synthetic, 4 workers (tp 2, sequence parallel: 2 groups), zero 3"),
            std::string::npos)
      << sp.out;
  auto s = read_json_file((dir / "sp" / "summary.json").string());
  EXPECT_EQ(s["sequence_parallel"], true);
  EXPECT_EQ(s["zero"], 3);
  // Each rank holds its half of its tensor-parallel share (72,714 floats; 6 units, each a float over at most).
  EXPECT_LE(s["parameter_bytes_held_rank0"].get<uint64_t>(), 4u * (72714 / 2 + 6));
  EXPECT_GT(s["final_test_accuracy"].get<double>(), 0.3);
  // (with a secondary partition in pairs: the backward's gathers within each pair)
  CliRun mlp = run_conduit(common + "--model mlp --zero 3 --zero-hpz 2 --trace true --transport shm --output " +
                           (dir / "mlp").string());
  ASSERT_EQ(mlp.code, 0) << mlp.out;
  EXPECT_NE(mlp.out.find("conduit train: mlp on synthetic, 4 workers, zero 3"), std::string::npos) << mlp.out;
  // 235,146 floats in 3 units, a quarter each (a float over in at most 3), and no secondary part between steps.
  const auto ms = read_json_file((dir / "mlp" / "summary.json").string());
  EXPECT_LE(ms["parameter_bytes_held_rank0"].get<uint64_t>(), 4u * (235146 / 4 + 3));
  EXPECT_EQ(ms["zero_hpz"], 2);
  {
    std::ifstream in(dir / "mlp" / "trace-rank0.json");
    size_t secondary = 0;
    const auto trace = nlohmann::json::parse(in);  // (kept: a range over a temporary's member dangles)
    for (auto& e : trace)
      if (e.contains("args") && e["args"].value("secondary", false)) {
        ++secondary;
        EXPECT_EQ(e["args"]["pass"], "backward") << e.dump();
      }
    EXPECT_GE(secondary, 2u * 4);  // (units 0 and 1 of each of the 4 steps)
  }
  CliRun tpp = run_conduit(common + "--model vit --tp 2 --pp 2 --micro-batches 2 --transport tcp --output " +
                           (dir / "tpp").string());
  ASSERT_EQ(tpp.code, 0) << tpp.out;
  EXPECT_NE(tpp.out.find("conduit train: vit on synthetic, 4 workers (tp 2 x pp 2: 1 pipeline), 2 micro-batches "
                         "1f1b"),
            std::string::npos)
      << tpp.out;
  fs::remove_all(dir);
}

// train_worker repeats resolve_config's refusals of pipelines with ZeRO-3 or per-micro-batch reduction for callers
// that did not run it (the in-process harness calls it directly): each would gather a stage's layers twice a
// micro-batch or stall its schedule.
TEST(Train, WorkersRefusePipelinesWithZeroThreeOrPerMicroBatchReduction) {
  TrainConfig c = tiny("mlp");
  c.pp = 2;
  c.micro_batches = 2;
  c.max_steps = 1;
  TrainConfig z3 = c;
  z3.zero = 3;
  TrainConfig mb = c;
  mb.zero = 2;
  mb.zero_reduce = "micro-batch";
  for (const auto& [bad, want] : {std::pair{z3, std::string("config: zero: 3 gathers each layer's parameters")},
                                  std::pair{mb, std::string("config: zero_reduce: micro-batch with pp 2")}}) {
    try {
      train_inproc(bad, 2);
      ADD_FAILURE() << want << ": taken";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace conduit::train
