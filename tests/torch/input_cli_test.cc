// Bad input to `conduit train` found by a review, end to end through the binary (no libtorch headers here, so this
// file compiles in a second): a diverged run whose test loss is nan, image files of the wrong shape, an images file
// where the labels belong, a checkpoint with a missing, corrupt or incomplete rank file, a key given twice, and a
// bad CONDUIT_LOG_LEVEL under several ranks. Each must end with exit code 2 and one line naming what is wrong.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "temp_dirs.h"

namespace {

namespace fs = std::filesystem;

struct Result {
  int code;
  std::string out;
};

Result run(const std::string& args, const std::string& binary = CONDUIT_BINARY) {
  const std::string cmd = "timeout 120 " + binary + " " + args + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p.get())) > 0) out.append(buf.data(), n);
  return {WEXITSTATUS(pclose(p.release())), out};
}

fs::path temp_dir(const std::string& name) { return conduit::test::temp_dir("conduit-input-test", name); }

const std::string kTrain =
    "train --dataset synthetic --model mlp --workers 2 --synthetic-samples 1280 --test-limit 64 --progress false "
    "--compressor none";

// An uncompressed IDX file of unsigned bytes with these dimensions (and zeros).
void write_idx(const fs::path& p, const std::vector<uint32_t>& dims) {
  std::ofstream f(p, std::ios::binary);
  const unsigned char head[4] = {0, 0, 0x08, static_cast<unsigned char>(dims.size())};
  f.write(reinterpret_cast<const char*>(head), 4);
  size_t total = 1;
  for (uint32_t d : dims) {
    const unsigned char be[4] = {static_cast<unsigned char>(d >> 24), static_cast<unsigned char>(d >> 16),
                                 static_cast<unsigned char>(d >> 8), static_cast<unsigned char>(d)};
    f.write(reinterpret_cast<const char*>(be), 4);
    total *= d;
  }
  f << std::string(total, '\0');
}

TEST(TrainInputProcesses, ADivergedRunFailsEvenWhenOnlyItsTestLossIsNan) {
  // Three steps at lr 1000: the training losses stay finite (2.3, 1.6e7, 6.3e22), the outputs on the test set
  // overflow. This used to exit 0 with "test_loss": null.
  const fs::path dir = temp_dir("diverged");
  auto r = run(kTrain + " --epochs 1 --max-steps 3 --lr 1000 --output " + (dir / "o").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("(the model's outputs overflowed): the run diverged; allowed: a smaller lr"), std::string::npos)
      << r.out;
  fs::remove_all(dir);
}

// A worker whose sync state is corrupt (found by its scheme's own loading, between the workers' meetings) is named by
// the others in one line: they waited at the next barrier for their deadline, naming no file.
TEST(TrainInputProcesses, ACorruptSyncStateOfOneWorkerIsNamedByTheOthers) {
  const fs::path dir = temp_dir("syncstate");
  auto r = run(kTrain + " --batch-size 32 --sync local:period=4 --max-steps 6 --checkpoint-every 6 --output " +
               (dir / "a").string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(dir / "a" / "checkpoint" / "rank-1" / "sync.bin") << "corrupt";
  r = run(kTrain + " --batch-size 32 --max-steps 8 --resume " + (dir / "a" / "checkpoint").string() + " --output " +
          (dir / "b").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("rank-1/sync.bin' cannot be read"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 0] conduit: error: config: resume: worker 1 cannot load its saved sync state"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("failed after"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

// A bsp run that --max-steps stops after its last checkpoint (an epoch end) keeps that checkpoint and says which step
// it holds (the run reported its last step, the checkpoint an earlier one, without a word).
TEST(TrainInputProcesses, ABspRunStoppedPastItsCheckpointSaysWhichStepItHolds) {
  const fs::path dir = temp_dir("past");
  // 1280 samples, 2 workers, batch 32: 20 steps an epoch
  auto r = run(kTrain + " --batch-size 32 --epochs 2 --max-steps 25 --output " + (dir / "o").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train: note: the checkpoint holds step 20 (bsp keeps its last epoch end or checkpoint_every "
                       "step): the 5 step(s) after it are not in it, and a resume continues from step 20"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(fs::read_symlink(dir / "o" / "checkpoint"), fs::path("checkpoint-20"));
  fs::remove_all(dir);
}

// A folder without the dataset's files names how to get them: Debian's package for Fashion-MNIST, which holds no
// MNIST (the hint named it for both).
TEST(TrainInputProcesses, AMissingDatasetSaysWhereItsFilesComeFrom) {
  const fs::path dir = temp_dir("nodata");
  const std::string flags = " --model mlp --workers 1 --epochs 1 --progress false --output " + (dir / "o").string() +
                            " --data-dir " + (dir / "empty").string();
  auto r = run("train --dataset fashion-mnist" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has no train-images-idx3-ubyte[.gz]; allowed: a folder with the four MNIST-format IDX files "
                       "(Debian: apt-get install dataset-fashion-mnist)"),
            std::string::npos)
      << r.out;
  r = run("train --dataset mnist" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("(MNIST's train- and t10k- images and labels, gzipped or not)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("dataset-fashion-mnist"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

TEST(TrainInputProcesses, ImageFilesOfTheWrongShapeAreNamed) {
  const fs::path dir = temp_dir("shapes");
  for (const char* pre : {"train", "t10k"}) {
    write_idx(dir / (std::string(pre) + "-images-idx3-ubyte"), {4, 10, 10});
    write_idx(dir / (std::string(pre) + "-labels-idx1-ubyte"), {4});
  }
  const std::string flags =
      " --model mlp --workers 1 --epochs 1 --batch-size 2 --progress false --compressor none "
      "--output " +
      (dir / "o").string() + " --data-dir " + dir.string();
  auto r = run("train" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("train-images-idx3-ubyte' has 10x10 images; allowed: 28x28"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("frame #"), std::string::npos) << r.out;  // no libtorch stack
  // An images file where the labels belong: its dimensions say so, not a count mismatch.
  for (const char* pre : {"train", "t10k"}) {
    write_idx(dir / (std::string(pre) + "-images-idx3-ubyte"), {4, 28, 28});
    write_idx(dir / (std::string(pre) + "-labels-idx1-ubyte"), {4, 28, 28});
  }
  r = run("train" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("train-labels-idx1-ubyte' is not a label file: it has 3 dimensions, labels have 1"),
            std::string::npos)
      << r.out;
  // A batch the folder's 4 training images cannot fill is refused before any worker starts, from the labels file's
  // header (the check took MNIST's 60,000 for every folder: the workers refused it, each without an allowed value).
  for (const char* pre : {"train", "t10k"}) {
    write_idx(dir / (std::string(pre) + "-images-idx3-ubyte"), {4, 28, 28});
    write_idx(dir / (std::string(pre) + "-labels-idx1-ubyte"), {4});
  }
  r = run("train" + flags + " --batch-size 3 --workers 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: batch_size: 3 per worker x 2 workers is more than the 4 training samples; allowed: "
                       "at most 2"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("[rank 0]"), std::string::npos) << r.out;  // no worker started
  // An empty test set (it reported 0% accuracy and exited 0), and a gzip file cut short (zlib reads a missing
  // trailer as a quiet end of file: it trained on what was there).
  write_idx(dir / "train-labels-idx1-ubyte", {4});
  write_idx(dir / "t10k-images-idx3-ubyte", {0, 28, 28});
  write_idx(dir / "t10k-labels-idx1-ubyte", {0});
  r = run("train" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("t10k-images-idx3-ubyte' holds 0 images; allowed: at least 1 (test set)"), std::string::npos)
      << r.out;
  write_idx(dir / "t10k-images-idx3-ubyte", {4, 28, 28});
  write_idx(dir / "t10k-labels-idx1-ubyte", {4});
  const std::string img = (dir / "train-images-idx3-ubyte").string();
  ASSERT_EQ(std::system(("gzip -c " + img + " | head -c 40 > " + img + ".gz && rm " + img).c_str()), 0);
  r = run("train" + flags);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("train-images-idx3-ubyte.gz' is corrupt (unexpected end of file)"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

TEST(TrainInputProcesses, CheckpointFilesThatAreMissingCorruptOrIncompleteAreNamed) {
  const fs::path dir = temp_dir("checkpoint");
  auto r = run(kTrain + " --epochs 1 --output " + (dir / "run").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path ck = dir / "run" / "checkpoint";
  ASSERT_TRUE(fs::exists(ck / "rank-1" / "model.pt")) << r.out;
  struct Case {
    const char* name;
    const char* file;
    const char* content;  // nullptr: delete the file
    const char* expect;
  };
  // The other rank says which rank cannot read its files (it failed in its next collective, naming no file).
  for (const Case& c : {Case{"missing", "rank-1/model.pt", nullptr, "rank-1/model.pt' is missing; allowed:"},
                        Case{"corrupt", "rank-0/optimizer.pt", "not a zip archive",
                             "rank-0/optimizer.pt' cannot be read: PytorchStreamReader failed"},
                        Case{"totals", "rank-0/totals.json", "{}", "rank-0/totals.json' has no compute_s"},
                        Case{"compressor", "rank-1/compressor.bin", "",
                             "rank-1/compressor.bin' cannot be read: checkpoint: compressor"}}) {
    const fs::path copy = dir / c.name;
    fs::copy(ck, copy, fs::copy_options::recursive);
    if (c.content)
      std::ofstream(copy / c.file) << c.content;
    else
      fs::remove(copy / c.file);
    r = run(kTrain + " --epochs 2 --resume " + copy.string() + " --output " +
            (dir / (std::string("o-") + c.name)).string());
    EXPECT_EQ(r.code, 2) << c.name << ": " << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.name << ": " << r.out;
    EXPECT_EQ(r.out.find("Exception raised from"), std::string::npos) << c.name << ": " << r.out;
    const int bad = c.file[5] - '0';
    EXPECT_NE(r.out.find("[rank " + std::to_string(1 - bad) + "] conduit: error: config: resume: rank " +
                         std::to_string(bad) + " cannot read its"),
              std::string::npos)
        << c.name << ": " << r.out;
    EXPECT_EQ(r.out.find("failed after"), std::string::npos) << c.name << ": " << r.out;
  }
  // A checkpoint.json of a negative epoch: one line from the launching process (each worker said it, and the
  // launcher that a rank exited: three lines).
  {
    const fs::path copy = dir / "epoch";
    fs::copy(ck, copy, fs::copy_options::recursive);
    std::ifstream in(copy / "checkpoint.json");
    nlohmann::json meta = nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(in), {}));
    meta["epoch"] = -3;
    std::ofstream(copy / "checkpoint.json") << meta.dump();
    r = run(kTrain + " --epochs 2 --resume " + copy.string() + " --output " + (dir / "o-epoch").string());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("checkpoint.json has no whole number 'epoch' (-3)"), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
  // --transport mpi without mpirun: one line before any worker starts (each worker failed after loading libtorch).
  {
    r = run(kTrain + " --transport mpi --output " + (dir / "o-mpi").string());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(r.out,
              "conduit: error: config: transport: mpi needs the workers started by mpirun, and this run starts its own "
              "2 workers; allowed: auto, tcp or shm, or the run under mpirun (mpirun -n 2 conduit train ...)\n");
  }
  // A truncated checkpoint.json: one line that says it is the resume's and what is allowed (it said only that the
  // file was not valid JSON).
  {
    const fs::path copy = dir / "truncated";
    fs::copy(ck, copy, fs::copy_options::recursive);
    fs::resize_file(copy / "checkpoint.json", 20);
    r = run(kTrain + " --epochs 2 --resume " + copy.string() + " --output " + (dir / "o-truncated").string());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(
        r.out.rfind("conduit: error: config: resume: '" + (copy / "checkpoint.json").string() + "' is not valid JSON: ",
                    0),
        0u)
        << r.out;
    EXPECT_NE(r.out.find("; allowed: a checkpoint directory written by conduit train"), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
  // Bytes after the last tensor's compressor state (not checked), named with the file (the message named none).
  {
    const fs::path copy = dir / "state";
    fs::copy(ck, copy, fs::copy_options::recursive);
    std::ofstream(copy / "rank-1" / "compressor.bin", std::ios::binary | std::ios::app) << 'x';
    r = run(kTrain + " --epochs 2 --resume " + copy.string() + " --output " + (dir / "o-state").string());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("rank-1/compressor.bin' cannot be read: checkpoint: compressor state has 1 bytes after"),
              std::string::npos)
        << r.out;
  }
  // A compressor state of another rank (another noise stream) is refused at load, naming the tensor (it was taken).
  {
    r = run(kTrain + " --compressor ef:topk --epochs 1 --output " + (dir / "ef").string());
    ASSERT_EQ(r.code, 0) << r.out;
    const fs::path copy = dir / "swapped";
    fs::copy(dir / "ef" / "checkpoint", copy, fs::copy_options::recursive);
    fs::copy_file(copy / "rank-0" / "compressor.bin", copy / "rank-1" / "compressor.bin",
                  fs::copy_options::overwrite_existing);
    r = run(kTrain + " --compressor ef:topk --epochs 2 --resume " + copy.string() + " --output " +
            (dir / "o-swapped").string());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("compressor state of tensor 0 is for shape"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("on stream 0, this run's is"), std::string::npos) << r.out;
  }
  fs::remove_all(dir);
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// --resume alone continues the run: the settings the checkpoint must agree with come from it (docs/training.md's
// example failed: the defaults' 4 workers and cnn met a 2-worker mlp checkpoint); a flag given still wins, and a
// contradicting one is still refused.
// A run stopped inside an epoch by max_steps says so (its epoch line said "done" and its summary "after 0 epochs");
// one worker puts nothing on the wire, and its summary says so (it reported a compression ratio of 1 and 93% of
// its communication hidden).
TEST(TrainInputProcesses, AStoppedEpochAndARunThatSentNothingSaySo) {
  const fs::path dir = temp_dir("stopped");
  auto r =
      run("train --dataset synthetic --model mlp --workers 2 --synthetic-samples 1280 --test-limit 64 "
          "--compressor none --max-steps 3 --output " +
          (dir / "a").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("epoch 1/3 stopped at step 3 of "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("done:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("after 3 steps (0 complete epochs)"), std::string::npos) << r.out;
  r =
      run("train --dataset synthetic --model mlp --workers 1 --synthetic-samples 1280 --test-limit 64 --progress false "
          "--max-steps 2 --output " +
          (dir / "b").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("communication hidden none (nothing sent)"), std::string::npos) << r.out;
  const std::string summary = slurp(dir / "b" / "summary.json");
  EXPECT_NE(summary.find("\"compression_ratio\": null"), std::string::npos) << summary;
  EXPECT_NE(summary.find("\"hidden_comm_fraction\": null"), std::string::npos) << summary;
  fs::remove_all(dir);
}

TEST(TrainInputProcesses, ResumeTakesTheCheckpointsSettings) {
  const fs::path dir = temp_dir("resume-defaults");
  auto r =
      run("train --dataset synthetic --model mlp --workers 2 --synthetic-samples 640 --test-limit 64 "
          "--progress false --compressor topk:ratio=0.1 --sync ps-ssp:staleness=1 --batch-size 32 --epochs 1 "
          "--lr 0.05 --lr-schedule constant --momentum 0.5 --weight-decay 0.001 --eval-every 7 --output " +
          (dir / "a").string());
  ASSERT_EQ(r.code, 0) << r.out;
  // A new run into the folder is refused while it holds this run's checkpoint (its metrics were replaced and the
  // checkpoint kept, so a later resume continued run a under the new run's records).
  auto again =
      run("train --dataset synthetic --model mlp --workers 2 --synthetic-samples 640 --progress false "
          "--epochs 1 --output " +
          (dir / "a").string());
  EXPECT_EQ(again.code, 2) << again.out;
  EXPECT_NE(again.out.find("holds an earlier run's checkpoint"), std::string::npos) << again.out;
  EXPECT_TRUE(fs::exists(dir / "a" / "checkpoint" / "checkpoint.json"));
  // Given nothing but --resume, the schedule, the evaluation and the rest come from the checkpoint too (they were
  // the defaults: 3 cosine epochs on the whole test set after 1 constant one on 64 images).
  r = run("train --progress false --resume " + (dir / "a" / "checkpoint").string() + " --output " +
          (dir / "d").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string taken = slurp(dir / "d" / "config.yaml");
  for (const char* want : {"lr: 0.05", "lr_schedule: constant", "momentum: 0.5", "weight_decay: 0.001", "epochs: 1",
                           "test_limit: 64", "eval_every: 7"})
    EXPECT_NE(taken.find(want), std::string::npos) << want << "\n" << taken;
  r = run("train --progress false --test-limit 64 --epochs 2 --resume " + (dir / "a" / "checkpoint").string() +
          " --output " + (dir / "b").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string cfg = slurp(dir / "b" / "config.yaml");
  for (const char* want : {"model: mlp", "workers: 2", "compressor: topk:ratio=0.1", "batch_size: 32",
                           "dataset: synthetic", "synthetic_samples: 640"})
    EXPECT_NE(cfg.find(want), std::string::npos) << want << "\n" << cfg;
  EXPECT_NE(cfg.find("staleness=1"), std::string::npos) << cfg;
  EXPECT_NE(slurp(dir / "b" / "summary.json").find("\"epochs\": 2"), std::string::npos)
      << slurp(dir / "b" / "summary.json");
  // A resume into another run's folder is refused, its records left as they were (its metrics were trimmed at this
  // run's step and this run's appended after them, and its checkpoint stages removed): d continued a (its metrics
  // only: a finished at its one epoch), b's checkpoint is another run's, and a holds its own. Resuming a's checkpoint
  // into d again is a retried job redoing its work: it runs.
  const std::string d_metrics = slurp(dir / "d" / "metrics.jsonl");
  r = run("train --progress false --resume " + (dir / "b" / "checkpoint").string() + " --output " +
          (dir / "d").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: output: '" + (dir / "d").string() + "' holds another run's records (its metrics"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("allowed: --output " + (dir / "b").string() + " (the resumed run's own folder)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(slurp(dir / "d" / "metrics.jsonl"), d_metrics);
  r = run("train --progress false --resume " + (dir / "b" / "checkpoint").string() + " --output " +
          (dir / "a").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("allowed: --resume " + (dir / "a" / "checkpoint").string() + " (that folder's own run)"),
            std::string::npos)
      << r.out;
  r = run("train --progress false --resume " + (dir / "a" / "checkpoint").string() + " --output " +
          (dir / "d").string());
  EXPECT_EQ(r.code, 0) << r.out;
  // A scheme parameter given on its own (--staleness) keeps the checkpoint's scheme (it fell back to bsp, which has
  // no staleness); the same value resumes.
  r = run("train --progress false --test-limit 64 --epochs 2 --staleness 1 --resume " +
          (dir / "a" / "checkpoint").string() + " --output " + (dir / "s").string());
  EXPECT_EQ(r.code, 0) << r.out;
  r = run("train --progress false --test-limit 64 --epochs 2 --model cnn --resume " +
          (dir / "a" / "checkpoint").string() + " --output " + (dir / "c").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(
      r.out.find("config: resume: the checkpoint was written with model mlp, this run has cnn; allowed: model mlp "
                 "(leave --model out to take the checkpoint's)"),
      std::string::npos)
      << r.out;
  // Said once, by the launching process, before any worker starts (every worker said it, then the launcher's lines
  // on each one's exit followed).
  EXPECT_EQ(r.out.rfind("conduit: error: config: resume:", 0), 0u) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  r = run("train --progress false --test-limit 64 --epochs 2 --workers 3 --resume " +
          (dir / "a" / "checkpoint").string() + " --output " + (dir / "w").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out,
            "conduit: error: config: resume: the checkpoint was written by 2 ranks, this run has 3; allowed: 2 "
            "ranks\n");
  // A checkpoint without its world says so (the launching process's check read it as "0 ranks").
  {
    const fs::path meta = dir / "a" / "checkpoint" / "checkpoint.json";
    auto j = nlohmann::json::parse(std::ifstream(meta));
    j.erase("world");
    std::ofstream(meta) << j.dump();
  }
  r = run("train --progress false --test-limit 64 --epochs 2 --resume " + (dir / "a" / "checkpoint").string() +
          " --output " + (dir / "nw").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'world'"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0 ranks"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

// Under local SGD worker 0 evaluates alone at an epoch's end (about 3 s here for 6,000 test images on the ResNet):
// the other worker met it at its next exchange under the 1 s collective deadline and failed; it now waits for it
// without one.
TEST(TrainInputProcesses, WorkerZerosLongEvaluationDoesNotTimeTheOthersOut) {
  const fs::path dir = temp_dir("long-eval");
  auto r =
      run("train --model resnet --dataset synthetic --synthetic-samples 24000 --train-limit 64 --batch-size 16 "
          "--workers 2 --sync local:period=1 --epochs 1 --timeout-s 1 --progress false --output " +
          (dir / "run").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("before the deadline"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

// Under an outer launcher every rank names the default output directory from its own clock; ranks whose clocks read
// differently (here: other time zones, as two sides of a second would) wrote to two directories, and rank 0's
// checkpoint had no rank-1 files. Rank 0's name is taken by all.
TEST(TrainInputProcesses, RanksOfAnOuterLauncherShareRankZerosDefaultOutput) {
  const fs::path dir = temp_dir("default-output");
  auto r = run("launch -n 2 -- sh -c 'cd " + dir.string() + " && TZ=UTC+$((RANK * 5)) exec " + CONDUIT_BINARY + " " +
               kTrain + " --epochs 1 --checkpoint-every 5'");
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(dir / "runs")) runs.push_back(e.path());
  ASSERT_EQ(runs.size(), 1u) << r.out;
  EXPECT_TRUE(fs::exists(runs[0] / "checkpoint" / "rank-0" / "model.pt"));
  EXPECT_TRUE(fs::exists(runs[0] / "checkpoint" / "rank-1" / "model.pt"));
  fs::remove_all(dir);
}

// --max-steps reached exactly at an epoch's end wrote a second, empty epoch (train loss 0, taken as the final one);
// a diloco run shorter than its period exchanged nothing (it now warns, and synchronizes once at the end).
TEST(TrainInputProcesses, EpochBoundariesAndPeriodsLongerThanTheRun) {
  const fs::path dir = temp_dir("bounds");
  auto r = run(kTrain + " --epochs 3 --max-steps 10 --output " + (dir / "ms").string());  // 10 steps an epoch
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string metrics = slurp(dir / "ms" / "metrics.jsonl");
  size_t epochs = 0;
  for (size_t at = metrics.find("\"kind\":\"epoch\""); at != std::string::npos;
       at = metrics.find("\"kind\":\"epoch\"", at + 1))
    ++epochs;
  EXPECT_EQ(epochs, 1u) << metrics;
  EXPECT_EQ(slurp(dir / "ms" / "summary.json").find("\"final_train_loss\": 0.0,"), std::string::npos);
  // Resumed where it stopped, the run trains nothing: no loss of its own (it reported 0), and it says so (it said
  // nothing).
  r = run(kTrain + " --epochs 3 --max-steps 10 --resume " + (dir / "ms" / "checkpoint").string() + " --output " +
          (dir / "ms2").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: the checkpoint is at step 10, where this run (epochs 3, max_steps 10) ends already: "
                       "nothing is left to run"),
            std::string::npos)
      << r.out;
  EXPECT_NE(slurp(dir / "ms2" / "summary.json").find("\"final_train_loss\": null,"), std::string::npos)
      << slurp(dir / "ms2" / "summary.json");
  // One data-parallel replica (a pipeline of 2 on 2 workers): no gradient exchange, no ratio (it read 1.0, its
  // stages' activations on the wire).
  r = run(kTrain + " --pp 2 --max-steps 3 --output " + (dir / "pp").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(slurp(dir / "pp" / "summary.json").find("\"compression_ratio\": null,"), std::string::npos)
      << slurp(dir / "pp" / "summary.json");
  r = run(kTrain + " --epochs 1 --sync diloco --output " + (dir / "dl").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("sync diloco synchronizes every 100 steps, but this run has 10"), std::string::npos) << r.out;
  // A warm-up longer than a max_steps run (the lr never reached lr, silently), and bsp's bucket settings under another
  // scheme (taken without a word).
  r = run(kTrain + " --epochs 1 --max-steps 5 --warmup-epochs 1 --output " + (dir / "wm").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: warmup_epochs: 1 is 10 steps, more than this run's 5 (max_steps)"), std::string::npos)
      << r.out;
  r = run(kTrain + " --epochs 1 --sync local --bucket-cap-mb 1 --output " + (dir / "bk").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: bucket_cap_mb set bsp's gradient buckets; sync local has none and ignores it"),
            std::string::npos)
      << r.out;
  // adam under the launcher: the workers read the config.yaml the parent wrote, which had sgd's momentum in it (and
  // a momentum with adam is refused).
  r = run(kTrain + " --epochs 1 --max-steps 2 --optimizer adam --lr 0.001 --output " + (dir / "adam").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(dir / "adam" / "config.yaml").find("momentum"), std::string::npos);
  // Data and compressor settings this run does not use (taken without a word).
  r = run(kTrain +
          " --epochs 1 --max-steps 2 --compress-min-bytes 4096 --data-dir /nonexistent --zero 1 --zero-prefetch false "
          "--zero-allgather-mb 4 --output " +
          (dir / "unused").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: zero_allgather_mb is set, but zero_prefetch is false: the allgather after each step "
                       "is one call per bucket: it is ignored"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("warning: compress_min_bytes is set, but the compressor is none: it is ignored"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("warning: data_dir is set, but the dataset is synthetic: it is ignored"), std::string::npos)
      << r.out;
  // ZeRO-3's buckets are its units (the caps were taken and recorded), and one micro-batch leaves a pipeline nothing
  // to recompute.
  r = run(kTrain + " --epochs 1 --max-steps 2 --zero 3 --bucket-cap-mb 8 --output " + (dir / "z3").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: bucket_cap_mb is set, but zero 3 reduces and gathers a layer (unit) at a time, one "
                       "bucket each: it is ignored"),
            std::string::npos)
      << r.out;
  r = run(kTrain + " --epochs 1 --max-steps 2 --pp 2 --recompute true --output " + (dir / "rc").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: recompute is set, but with one micro-batch every stage's backward follows its "
                       "forward: nothing is kept to recompute: it is ignored"),
            std::string::npos)
      << r.out;
  r = run(kTrain + " --epochs 1 --max-steps 2 --pp 2 --output " + (dir / "pp1").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: pp 2 with one micro-batch runs the stages one after another"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("warning: zero"), std::string::npos) << r.out;
  // ZeRO with one data-parallel rank (2 workers as 2 stages) is kept, and named as partitioning nothing.
  r = run(kTrain + " --epochs 1 --max-steps 2 --pp 2 --micro-batches 2 --zero 1 --output " + (dir / "pp2").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("with one micro-batch"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("warning: zero 1 runs with one data-parallel rank (workers 2 / (tp 1 x pp 2)): it partitions "
                       "nothing"),
            std::string::npos)
      << r.out;
  // A compressor asked for with one data-parallel rank is kept, and named as saving nothing.
  r = run(kTrain + " --epochs 1 --max-steps 2 --workers 1 --compressor fp16 --output " + (dir / "one").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning: compressor fp16 runs with one data-parallel rank (workers 1 / (tp 1 x pp 1)): it "
                       "changes the gradients but sends nothing"),
            std::string::npos)
      << r.out;
  EXPECT_NE(slurp(dir / "one" / "summary.json").find("\"compressor\": \"fp16\""), std::string::npos);
  // Local SGD's warm-up averages every step: a warm-up as long as the run is no run without exchanges (it warned
  // that nothing was exchanged), and a shorter one is named.
  r = run(kTrain + " --epochs 1 --sync local:period=8,warmup=200 --output " + (dir / "lw").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("warning: sync local"), std::string::npos) << r.out;
  r = run(kTrain + " --epochs 1 --sync local:period=9,warmup=2 --output " + (dir / "lw2").string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("but this run has 10, 2 of them warm-up steps that average every step: the workers exchange "
                       "nothing after the warm-up before the end"),
            std::string::npos)
      << r.out;
  // It still ends with one model: diloco's finish() takes the outer step of the partial round (one allreduce).
  EXPECT_EQ(slurp(dir / "dl" / "summary.json").find("\"bytes_on_wire\": 0,"), std::string::npos);
  fs::remove_all(dir);
}

// The whole run's deadline (time_limit_s): kept by conduit train's own launcher, for one worker too, and refused in a
// worker of another launcher, which has its own. The workers it stopped keep their traces (written as the events
// came; a run that did not end normally wrote none): the Trace Event Format's array without its closing "]".
TEST(TrainInputProcesses, ATimeLimitStopsTheWholeRunWithExitCode124) {
  const fs::path dir = temp_dir("time-limit");
  // (1280 samples a worker: 10000 epochs take hours)
  auto r = run(kTrain + " --epochs 10000 --time-limit-s 4 --trace true --output " + (dir / "two").string());
  for (int rank = 0; rank < 2; ++rank) {
    std::string text = slurp(dir / "two" / fmt::format("trace-rank{}.json", rank));
    ASSERT_EQ(text.rfind("[\n", 0), 0u) << text.substr(0, 200);
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    if (text.back() != ']') text += "]";  // (killed: as a viewer reads it)
    const auto events = nlohmann::json::parse(text);
    size_t forward = 0;
    for (const auto& e : events) forward += e["name"] == "forward";
    EXPECT_GT(forward, 10u) << "rank " << rank;
  }
  EXPECT_EQ(r.code, 124) << r.out;
  EXPECT_NE(r.out.find("conduit train: 2 workers still running at time_limit_s 4 s; stopping them"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("conduit train: mlp"), std::string::npos) << r.out;  // (no summary)
  // (the workers' config.yaml does not hold it: rerun under another launcher, it would be refused there)
  {
    std::ifstream in(dir / "two" / "config.yaml");
    const std::string yaml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(yaml.find("timeout_s"), std::string::npos) << yaml;
    EXPECT_EQ(yaml.find("time_limit_s"), std::string::npos) << yaml;
  }
  // One worker keeps its own deadline, in this process (its output as without one: no rank prefix).
  r = run(kTrain + " --workers 1 --epochs 10000 --time-limit-s 4 --output " + (dir / "one").string());
  EXPECT_EQ(r.code, 124) << r.out;
  EXPECT_NE(r.out.find("conduit train: 1 worker still running at time_limit_s 4 s; stopping it"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("[rank 0]"), std::string::npos) << r.out;
  // One worker that ends in time: its summary once, as without a limit.
  r = run(kTrain + " --workers 1 --epochs 1 --time-limit-s 600 --output " + (dir / "done").string());
  EXPECT_EQ(r.code, 0) << r.out;
  const size_t first = r.out.find("conduit train: mlp on synthetic, 1 worker, sync bsp");
  EXPECT_NE(first, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("conduit train: mlp on synthetic", first + 1), std::string::npos) << r.out;
  r = run("launch -n 2 -- " + std::string(CONDUIT_BINARY) + " " + kTrain + " --epochs 1 --time-limit-s 60 --output " +
          (dir / "outer").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: time_limit_s: 60 s is kept by conduit train's own launcher, and this process is one "
                       "worker of another"),
            std::string::npos)
      << r.out;
  for (const char* bad : {"0.0001", "-1", "1e8", "inf"}) {
    r = run(kTrain + " --time-limit-s " + bad + " --output " + (dir / "bad").string());
    EXPECT_EQ(r.code, 2) << bad << ": " << r.out;
    EXPECT_NE(r.out.find("allowed: 0 (none) or seconds from 0.001 to 10000000"), std::string::npos) << r.out;
  }
  fs::remove_all(dir);
}

// A compressor set to send more than the gradient (a top-k keeping 60%: each value with its index; uint8 with a scale
// every element) was taken without a word.
TEST(TrainInputProcesses, ACompressorThatSendsMoreThanTheGradientIsWarnedOf) {
  const fs::path dir = temp_dir("inflating");
  const std::string one =
      "train --dataset synthetic --model mlp --workers 2 --synthetic-samples 256 --test-limit 64 "
      "--progress false --epochs 1 ";
  auto r = run(one + "--compressor topk:ratio=0.6 --output " + (dir / "a").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("train: warning: compressor topk:ratio=0.6 sends 5.03 MB for a 1024 x 1024 f32 gradient, more "
                       "than its 4.19 MB uncompressed (compressor none)"),
            std::string::npos)
      << r.out;
  r = run(one + "--compressor topk:ratio=0.4 --output " + (dir / "b").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("more than its"), std::string::npos) << r.out;
  // A payload whose size depends on the data is measured on Gaussian values: QSGD's Elias codes of a level of 32767
  // in every element (buckets of one) take 4 bytes of norm and 3 of codes an element.
  r = run(one + "--compressor qsgd:levels=32767,bucket=1,coding=elias --output " + (dir / "c").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(
      r.out.find("sends 7.34 MB for a 1024 x 1024 f32 gradient of Gaussian values (sd 0.001), more than its 4.19 MB"),
      std::string::npos)
      << r.out;
  fs::remove_all(dir);
}

TEST(TrainInputProcesses, KeysGivenTwiceAndABadLogLevelAreOneLine) {
  auto r = run(kTrain + " --epochs 1 --compressor topk:ratio=0.1,ratio=0.2 --output /tmp/unused-conduit-input");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'ratio' is given twice in 'ratio=0.1,ratio=0.2'; give each key once"), std::string::npos)
      << r.out;
  const fs::path dir = temp_dir("twice");
  std::ofstream(dir / "c.yaml") << "lr: 0.1\nepochs: 1\nlr: 0.2\n";
  r = run("train --config " + (dir / "c.yaml").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: lr is given twice in"), std::string::npos) << r.out;
  r = run("train --config " + dir.string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is a directory; allowed: a YAML file"), std::string::npos) << r.out;
  // A second YAML document was never read (its bad values and keys passed); a repeated name in a compressor's mapping
  // kept the last; a pipe blocked the run for ever.
  std::ofstream(dir / "two.yaml") << "lr: 0.1\n---\nlr: abc\nbogus_key: 1\n";
  r = run("train --config " + (dir / "two.yaml").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("two.yaml' holds 2 YAML documents; allowed: one (a YAML file)"), std::string::npos) << r.out;
  // Nested past yaml-cpp's depth guard: said so (its message was "bad file").
  std::ofstream(dir / "deep.yaml") << "lr: " << std::string(5000, '[') << std::string(5000, ']') << "\n";
  r = run("train --config " + (dir / "deep.yaml").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("deep.yaml' nests values more than 499 levels deep (line 1, column "), std::string::npos)
      << r.out;
  // (a trailing --- is an empty document, none: the file is read, and its unknown key named)
  std::ofstream(dir / "trailing.yaml") << "lr: 0.1\nbogus_key: 1\n---\n";
  r = run("train --config " + (dir / "trailing.yaml").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: unknown key 'bogus_key'"), std::string::npos) << r.out;
  std::ofstream(dir / "name.yaml") << "compressor: {name: '', name: fp16}\n";
  r = run("train --config " + (dir / "name.yaml").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: compressor in " + (dir / "name.yaml").string() + " (line 1): 'name' is given twice"),
            std::string::npos)
      << r.out;
  // An --output below a file: one line naming the flag (a raw filesystem error, exit 1).
  std::ofstream(dir / "afile") << "x";
  r = run(kTrain + " --epochs 1 --output " + (dir / "afile" / "sub").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--output: cannot create the directory '" + (dir / "afile" / "sub").string() +
                       "' (Not a directory); allowed: a directory that exists or can be made"),
            std::string::npos)
      << r.out;
  ASSERT_EQ(::mkfifo((dir / "pipe").c_str(), 0600), 0);
  r = run("train --config " + (dir / "pipe").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("is not a regular file (a pipe, device or socket); allowed: a YAML file"), std::string::npos)
      << r.out;
  // Keys and nested values that are not single values name the file and the key (yaml-cpp's "bad conversion" named
  // neither, exit 1).
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"? [a, b]\n: 1\n", "line 1: a key that is not a name"},
           {"compressor: {name: topk, ratio: [1, 2]}\n", "config: compressor in"},
           {"sync: {name: [x]}\n", "config: sync in"}}) {
    std::ofstream(dir / "n.yaml") << text;
    r = run("train --config " + (dir / "n.yaml").string());
    EXPECT_EQ(r.code, 2) << text << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << text << r.out;
  }
  // eval_every keeps a model copy every so many steps until the next checkpoint: bounded before training (the CNN
  // at batch 1 kept 60,000 copies of 1.7 MB an epoch).
  r = run("train --workers 1 --model cnn --batch-size 1 --eval-every 1 --epochs 1 --progress false --output " +
          (dir / "ev").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: eval_every: 1 keeps up to 60001 copies of the model"), std::string::npos) << r.out;
  r = run(kTrain + " --epochs 1 --compressor ''");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("config: compressor: '' is not allowed; allowed: a compressor spec"), std::string::npos)
      << r.out;
  fs::remove_all(dir);
  // The level used to be checked inside the first log call, on a worker thread of rank 0: terminate, SIGABRT.
  r = run("launch -n 2 -- env CONDUIT_LOG_LEVEL=loud " + std::string(CONDUIT_BINARY) + " bench coll -b 8 -e 8");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("CONDUIT_LOG_LEVEL='loud' is invalid: expected trace, debug, info, warn (warning), error (err), "
                       "critical or off"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("SIGABRT"), std::string::npos) << r.out;
}

}  // namespace

// libtorch lives in libconduit-torch.so beside the binary and is loaded only by the commands that need it
// (torch/plugin.h): a binary without the module still runs everything else, and `conduit train` and `conduit bench
// gemm` say which file they could not load (exit 2, one line) instead of failing to start.
TEST(TrainInputProcesses, CommandsWithoutLibtorchRunWithoutTheModule) {
  const fs::path dir = temp_dir("no-module");
  fs::copy_file(CONDUIT_BINARY, dir / "conduit");
  auto run_copy = [&](const std::string& args) { return run(args, (dir / "conduit").string()); };
  auto sim = run_copy("sim step --cluster dgx-a100 --gpus 64 --model gpt-1.7b --global-batch 64 --json");
  EXPECT_EQ(sim.code, 0) << sim.out;
  EXPECT_NE(sim.out.find("\"breakdown_s\""), std::string::npos) << sim.out;
  for (const std::string& args : {kTrain + " --max-steps 1", std::string("bench gemm --shapes 8x8x8")}) {
    auto r = run_copy(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find("this command needs libtorch, which conduit loads from libconduit-torch.so"),
              std::string::npos)
        << args << ": " << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
  // The built binary has the module beside it and loads it.
  auto ok = run("bench gemm --shapes 8x8x8 --min-time 0.01");
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("GFLOP/s"), std::string::npos) << ok.out;
  fs::remove_all(dir);
}
