// The training loop: data, model, DistributedOptimizer, evaluation, metrics, checkpoints.
#include "torch/trainer.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <numbers>
#include <random>
#include <set>
#include <tuple>

#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#ifdef CONDUIT_WITH_COMPRESS
#include "compress/compressor.h"
#include "compress/powersgd.h"
#endif
#include "sync/straggler.h"
#include "sync/strategy.h"
#include "torch/batches.h"
#include "torch/data.h"
#include "torch/dgc_sgd.h"
#include "torch/distributed_optimizer.h"
#include "torch/metrics.h"
#include "torch/models.h"
#include "torch/pipeline.h"
#include "torch/scheme_optimizer.h"
#include "torch/stages.h"
#include "torch/tensor_parallel.h"

namespace conduit::train {
namespace fs = std::filesystem;

namespace {

TrainTestSets load_data(const TrainConfig& c) {
  return load_train_test(c.dataset, c.data_dir, c.train_limit, c.test_limit, c.synthetic_samples, c.seed, c.timeout_s);
}

// What identifies the training samples a sampler position counts: their number and a 64-bit FNV-1a hash of their
// labels and pixels (taken 8 bytes at a time, folded down after each, as loaded: train_limit applied). Two data sets of
// one size (MNIST and Fashion-MNIST have the same files' sizes) differ here; the same files at another path do not.
uint64_t data_hash(const ImageSet& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](const std::vector<uint8_t>& bytes) {
    size_t i = 0;
    for (; i + 8 <= bytes.size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, bytes.data() + i, 8);
      h = (h ^ w) * 0x100000001b3ull;
      h ^= h >> 32;  // (a product carries bits only upwards: a word's top byte reached only the hash's top bits)
    }
    for (; i < bytes.size(); ++i) h = (h ^ bytes[i]) * 0x100000001b3ull;
    h = (h ^ bytes.size()) * 0x100000001b3ull;
  };
  mix(s.labels);
  mix(s.pixels);
  return h;
}
std::string train_data_id(const ImageSet& s, uint64_t hash) {
  return fmt::format("{} samples of {}x{}, fnv1a-64 {:016x}", s.n, s.rows, s.cols, hash);
}

// c.data_dir as an absolute path (what a checkpoint records beside data_dir as given, which may be relative to
// another working directory).
std::string resolved_data_dir(const std::string& dir) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  return ec ? dir : p.string();
}

}  // namespace

void make_batch(const ImageSet& s, const std::vector<int64_t>& idx, torch::Tensor& x, torch::Tensor& y) {
  const int64_t b = int64_t(idx.size()), px = s.rows * s.cols;
  x = torch::empty({b, 1, s.rows, s.cols}, torch::kFloat);
  y = torch::empty({b}, torch::kLong);
  float* xp = x.data_ptr<float>();
  int64_t* yp = y.data_ptr<int64_t>();
  const float scale = 1.0f / (255.0f * s.stddev), shift = s.mean / s.stddev;
  for (int64_t i = 0; i < b; ++i) {
    const uint8_t* src = s.pixels.data() + idx[size_t(i)] * px;
    for (int64_t k = 0; k < px; ++k) xp[i * px + k] = float(src[k]) * scale - shift;
    yp[i] = s.labels[size_t(idx[size_t(i)])];
  }
}

namespace {

std::shared_ptr<torch::optim::Optimizer> make_optimizer(const TrainConfig& c, Net& model) {
  if (c.optimizer == "adam")
    return std::make_shared<torch::optim::Adam>(model.parameters(),
                                                torch::optim::AdamOptions(c.lr).weight_decay(c.weight_decay));
  // Decoupled weight decay (Loshchilov & Hutter): DiLoCo's inner optimizer.
  if (c.optimizer == "adamw")
    return std::make_shared<torch::optim::AdamW>(model.parameters(),
                                                 torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
  // (dgc, signum: weight decay with a momentum of its own, as DGC's reference optimizer; dgc_sgd.h)
  if (!momentum_compressor(c.compressor).empty())
    return std::make_shared<DgcSgd>(model.parameters(), torch::optim::SGDOptions(c.lr).weight_decay(c.weight_decay),
                                    c.momentum);
  return std::make_shared<torch::optim::SGD>(
      model.parameters(), torch::optim::SGDOptions(c.lr).momentum(optimizer_momentum(c)).weight_decay(c.weight_decay));
}

void set_lr(torch::optim::Optimizer& opt, const std::string& kind, double lr) {
  for (auto& g : opt.param_groups()) {
    if (kind == "adam")
      static_cast<torch::optim::AdamOptions&>(g.options()).lr(lr);
    else if (kind == "adamw")
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    else
      static_cast<torch::optim::SGDOptions&>(g.options()).lr(lr);
  }
}

double lr_at(const TrainConfig& c, int64_t step, int64_t total, int64_t warmup) {
  if (warmup > 0 && step < warmup) return c.lr * double(step + 1) / double(warmup);
  double t = total > warmup ? double(step - warmup) / double(total - warmup) : 1.0;
  t = std::clamp(t, 0.0, 1.0);
  if (c.lr_schedule == "cosine") return c.lr * 0.5 * (1 + std::cos(std::numbers::pi * t));
  if (c.lr_schedule == "step") return c.lr * (t < 0.5 ? 1.0 : t < 0.75 ? 0.1 : 0.01);
  return c.lr;
}

}  // namespace

std::pair<double, double> evaluate(Net& model, const ImageSet& test, coll::Communicator* comm, Pipeline* pipe) {
  torch::NoGradGuard ng;
  model.eval();
  double sums[3] = {0, 0, 0};  // correct, loss sum, count
  std::vector<int64_t> idx;
  // 200 images a forward: the CNN's activations for 500 (50 MB) were above glibc's mmap threshold, so every chunk
  // mapped and faulted them in again and an evaluation took 5x longer (6 s instead of 1.2 s, 4 ranks on 2 cores).
  const int64_t chunk = 200;
  const int rank = comm ? comm->rank() : 0, size = comm ? comm->size() : 1;
  for (int64_t i = rank; i < test.n; i += size) {
    idx.push_back(i);
    if (int64_t(idx.size()) == chunk || i + size >= test.n) {
      torch::Tensor x, y;
      make_batch(test, idx, x, y);
      // (through a pipeline, only its last stage has the logits)
      auto out = pipe ? pipe->infer(x, int64_t(idx.size())) : model.forward(x);
      if (out.defined()) {
        sums[0] += double(out.argmax(1).eq(y).sum().item<int64_t>());
        sums[1] += double(torch::nn::functional::cross_entropy(
                              out, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                              .item<float>());
      }
      sums[2] += double(idx.size());
      idx.clear();
    }
  }
  if (pipe) pipe->flush();
  if (size > 1) comm->allreduce(sums, 3, DType::f64, ReduceOp::sum).wait();
  if (pipe) pipe->from_last(sums, 2);  // the last stages' sums (every stage counted the samples)
  model.train();
  // A run whose last steps blew the weights up ends with a finite training loss and a nan test loss: that is a
  // failed run, not a result. Under bsp every rank evaluated and sees the same sums, so all stop here together;
  // under other schemes worker 0 evaluates alone and stops here, and the others then fail on its absence.
  if (!std::isfinite(sums[1]))
    throw Error(
        fmt::format("train: the test loss is {} (the model's outputs overflowed): the run diverged; allowed: "
                    "a smaller lr, a warm-up (warmup_epochs) or a less aggressive compressor",
                    sums[1]));
  return {sums[2] > 0 ? sums[0] / sums[2] : 0.0, sums[2] > 0 ? sums[1] / sums[2] : 0.0};
}

namespace {

std::vector<uint8_t> read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw ConfigError(fmt::format("checkpoint: cannot read '{}'", p.string()));
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary);
  f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  f.close();  // (a failure to flush, a full disk, shows here)
  if (!f) throw ConfigError(fmt::format("checkpoint: cannot write '{}'", p.string()));
}

nlohmann::json totals_json(const StepStats& s) { return s.to_json(); }

// A checkpoint's totals.json: every counter StepStats::to_json writes, as a number (a missing one would restart
// that counter from 0 without a word, and the run's byte counts would be wrong).
StepStats totals_from_json(const nlohmann::json& j, const std::string& path) {
  auto num = [&](const char* key) {
    if (!j.is_object() || !j.contains(key) || !j[key].is_number() || j[key].get<double>() < 0)
      throw ConfigError(
          fmt::format("checkpoint: '{}' has no {} (a non-negative number); allowed: the totals.json a "
                      "checkpoint of this version wrote",
                      path, key));
    return j[key];
  };
  StepStats s;
  s.compute_s = num("compute_s").get<double>();
  s.comm_s = num("comm_s").get<double>();
  s.exposed_comm_s = num("exposed_comm_s").get<double>();
  s.step_s = num("step_s").get<double>();
  s.bytes_sent = num("bytes_sent").get<uint64_t>();
  s.bytes_recv = num("bytes_recv").get<uint64_t>();
  s.raw_bytes = num("raw_bytes").get<uint64_t>();
  s.payload_bytes = num("payload_bytes").get<uint64_t>();
  s.grad_bytes = num("grad_bytes").get<uint64_t>();
  s.buckets = num("buckets").get<int>();
  return s;
}

// The running epoch's sums a checkpoint inside an epoch saves (JSON has no NaN: a diverged loss is null).
nlohmann::json epoch_sums_json(double loss_sum, double correct, double seen, double trained_s) {
  auto num = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); };
  return {{"loss_sum", num(loss_sum)}, {"correct", correct}, {"seen", seen}, {"trained_s", trained_s}};
}

// False when there are none (a checkpoint of before 2026-12-06): the epoch's report covers the steps after a resume.
bool epoch_sums_from_json(const nlohmann::json& j, const std::string& path, double out[4]) {
  const char* keys[4] = {"loss_sum", "correct", "seen", "trained_s"};
  if (j.is_object() && !j.contains("epoch")) return false;
  const nlohmann::json* e = j.is_object() ? &j["epoch"] : nullptr;
  for (int k = 0; k < 4; ++k) {
    const bool null_loss = k == 0 && e != nullptr && e->is_object() && e->contains(keys[k]) && (*e)[keys[k]].is_null();
    if (null_loss) {
      out[k] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    if (e == nullptr || !e->is_object() || !e->contains(keys[k]) || !(*e)[keys[k]].is_number() ||
        !((*e)[keys[k]].get<double>() >= 0))
      throw ConfigError(
          fmt::format("checkpoint: '{}' has no epoch.{} (a non-negative number: the checkpoint is inside an "
                      "epoch); allowed: the totals.json a checkpoint of this version wrote",
                      path, keys[k]));
    out[k] = (*e)[keys[k]].get<double>();
  }
  return true;
}

// Loads a libtorch archive of a checkpoint into `into` (a module or an optimizer); a missing or unreadable file is
// one line naming it, not libtorch's exception with its stack.
template <typename T>
void load_checkpoint_archive(const fs::path& p, T& into) {
  if (!fs::is_regular_file(p))
    throw ConfigError(
        fmt::format("checkpoint: '{}' is missing; allowed: a checkpoint directory whose rank-N "
                    "directories each hold model.pt, optimizer.pt and totals.json",
                    p.string()));
  try {
    torch::serialize::InputArchive a;
    a.load_from(p.string());
    into.load(a);
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    throw ConfigError(fmt::format("checkpoint: '{}' cannot be read: {}", p.string(), why.substr(0, why.find('\n'))));
  }
}

// This process's largest resident set so far, in MB (Linux reports KiB).
double max_rss_mb() {
  rusage u{};
  if (getrusage(RUSAGE_SELF, &u) != 0) return 0;
  return double(u.ru_maxrss) * 1024 / 1e6;
}

// What shares out the data, for messages: the workers, or the model replicas (pipelines, tensor-parallel groups).
const char* data_sharers(const TrainConfig& c) {
  return c.pp > 1 ? "pipelines" : c.tp > 1 ? "tensor-parallel groups" : "workers";
}

}  // namespace

bool agree_partner_sums(coll::Communicator& dp, const std::vector<int>& host_of, int tp, int mp) {
  if (tp_partners_split_alike(host_of, tp, mp)) return false;
  auto tuner = std::make_shared<coll::Tuner>(dp.tuner());
  tuner->force(coll::CollOp::allreduce, {{"ring"}});
  tuner->force(coll::CollOp::reduce_scatter, {{"ring"}});
  dp.set_tuner(std::move(tuner));
  return true;
}

bool tp_partners_split_alike(const std::vector<int>& host_of, int tp, int mp) {
  if (tp <= 1 || mp <= 1) return true;
  const int w = int(host_of.size());
  // A group's hosts numbered by first appearance, rank by rank: what compress::int_reduce_groups builds from.
  auto layout = [&](int key) {
    std::vector<int> hosts, seq;
    for (int r = key; r < w; r += mp) {
      auto it = std::find(hosts.begin(), hosts.end(), host_of[size_t(r)]);
      seq.push_back(int(it - hosts.begin()));
      if (it == hosts.end()) hosts.push_back(host_of[size_t(r)]);
    }
    return seq;
  };
  for (int k = 0; k < mp; ++k)
    if (layout(k) != layout(k - k % tp)) return false;
  return true;
}

void check_model_config(const TrainConfig& c, int world, bool notes) {
  torch::NoGradGuard ng;
  // The ranks that share out the data: a tensor-parallel group's ranks, and a pipeline's, see the same samples.
  world /= std::max(1, c.tp) * std::max(1, c.pp);
#ifdef CONDUIT_WITH_COMPRESS
  auto [name, params] = split_compressor_spec(c.compressor);
  if (name == "powersgd") {
    // Each rank compresses the matrices it holds, a tensor-parallel rank's shares and a pipeline stage's layers, and
    // only those whose ratio n m / (r (n + m)) reaches min_ratio (PowerSgd::plan). The whole model's sides let rank
    // 60 pass at tp 4, where every matrix went uncompressed (and the sides let rank 49 pass, which compresses none).
    const int tp = std::max(1, c.tp), pp = std::max(1, c.pp);
    const int chunks = c.model == "vit" && c.pp_schedule == "interleaved" ? kVitBlocks / pp : 1;
    std::vector<std::vector<std::vector<size_t>>> stages(static_cast<size_t>(pp));  // each stage's matrices' shapes
    size_t widest = 1;
    for (int s = 0; s < pp; ++s) {
      auto model = c.model == "vit" ? make_vit_layout(tp, s, pp, chunks)
                   : pp > 1         ? make_model_stage(c.model, s, pp)
                                    : make_model(c.model);
      for (auto& p : model->parameters()) {
        if (p.dim() < 2) continue;
        std::vector<size_t> shape(p.sizes().begin(), p.sizes().end());
        stages[size_t(s)].push_back(shape);
        widest = std::max(widest, std::min<size_t>(shape[0], size_t(p.numel()) / shape[0]));
      }
    }
    // Whether rank r compresses some matrix of a stage (the compressor's own rule; its bad parameters are refused
    // here with its own line).
    auto compresses = [&, &params = params](size_t r, const std::vector<std::vector<size_t>>& shapes) {
      auto with = params;
      with["rank"] = std::to_string(r);
      const auto comp = compress::make_compressor("powersgd", with);
      const auto* psgd = dynamic_cast<const compress::PowerSgd*>(comp.get());
      if (!psgd) return true;
      for (const auto& shape : shapes) {
        compress::TensorState st = psgd->make_state(shape);
        st.step = psgd->warmup_calls();
        size_t numel = 1;
        for (size_t d : shape) numel *= d;
        if (psgd->plan(numel, st).compressed) return true;
      }
      return false;
    };
    // The largest rank that compresses something of `shapes` (0: none does), by bisection: a larger rank's ratio is
    // smaller.
    auto largest = [&](const std::vector<std::vector<size_t>>& shapes) {
      size_t lo = 0, hi = widest;
      while (lo < hi) {
        const size_t mid = (lo + hi + 1) / 2;
        if (compresses(mid, shapes))
          lo = mid;
        else
          hi = mid - 1;
      }
      return lo;
    };
    compress::make_compressor("powersgd", params);  // (bad parameters: its own one-line refusal)
    // A parameter as given, or the compressor's default.
    auto param = [&, &params = params](const char* key) {
      const auto given = params.find(key);
      return given != params.end() ? given->second : compress::compressor_defaults("powersgd").at(key);
    };
    const size_t rank = std::stoull(param("rank"));
    std::vector<std::vector<size_t>> all;
    for (const auto& st : stages) all.insert(all.end(), st.begin(), st.end());
    const std::string where = tp > 1 ? fmt::format(" split over tp {}", tp) : "";
    const std::string min_ratio = param("min_ratio");
    if (!compresses(rank, all)) {
      const size_t most = largest(all);
      throw ConfigError(fmt::format(
          "config: compressor: powersgd rank {} compresses no matrix of model {}{} (each needs n x m / (rank x (n + "
          "m)) of at least min_ratio {}, and every gradient would go uncompressed); allowed: {}",
          rank, c.model, where, min_ratio,
          most > 0 ? fmt::format("rank 1 to {}", most)
                   : fmt::format("a smaller min_ratio (no rank reaches {}), or another compressor", min_ratio)));
    }
    for (int s = 0; notes && pp > 1 && s < pp; ++s)
      if (!compresses(rank, stages[size_t(s)])) {
        const size_t most = largest(stages[size_t(s)]);
        fmt::print(stderr,
                   "train: note: powersgd rank {} compresses no matrix of pipeline stage {} of {}{} ({} at min_ratio "
                   "{}): that stage's gradients go uncompressed\n",
                   rank, s, pp, where, most > 0 ? fmt::format("at most rank {} would", most) : "no rank would",
                   min_ratio);
      }
  }
#endif
  int64_t train_n = c.dataset == "synthetic" ? c.synthetic_samples : 0;
  if (c.dataset != "synthetic") {
    // From the labels file's header (it took 60,000, MNIST's count, for any folder: a larger one's valid batch was
    // refused here, a smaller one's bad batch passed to every worker).
    train_n = mnist_format_train_count(c.data_dir);
    if (train_n < 0) return;  // (the workers' reader names what is wrong with the file)
    if (c.train_limit > 0) train_n = std::min(train_n, c.train_limit);
  } else if (c.train_limit > 0) {
    train_n = std::min(train_n, c.train_limit);
  }
  const char* sharers = data_sharers(c);
  if (train_n < world)
    throw ConfigError(
        fmt::format("config: the training set has {} samples, fewer than the {} {} that share it; "
                    "allowed: at least one sample each (train_limit, synthetic_samples, data_dir)",
                    train_n, world, sharers));
  if (int64_t(c.batch_size) * world > train_n)
    throw ConfigError(
        fmt::format("config: batch_size: {} per worker x {} {} is more than the {} training "
                    "samples; allowed: at most {}",
                    c.batch_size, world, sharers, train_n, train_n / world));
}

// Keeps the records of `path` (metrics.jsonl) up to a checkpoint at `global_step`, `epoch` epochs complete: steps
// and evaluations up to that step, epoch records up to that epoch; the rest (and a final record) are dropped.
static void trim_metrics_after(const fs::path& path, int64_t global_step, int epoch) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      continue;  // a line cut short by the interruption
    }
    const std::string kind = j.value("kind", std::string());
    const bool keep = (kind == "step" || kind == "eval") ? j.value("global_step", int64_t{0}) <= global_step
                      : kind == "epoch"                  ? j.value("epoch", 0) <= epoch
                                                         : false;
    if (keep) kept += line + "\n";
  }
  in.close();
  write_text_file(path.string(), kept);  // whole or failing: a full disk left a cut file in place of the records
}

// Points <out>/checkpoint at <out>/<stage> (a complete checkpoint) with one atomic rename of a symbolic link. A
// `checkpoint` that is a real directory (written before checkpoints were staged) is moved aside (and removed with the
// old stages by remove_old_stages). `rank` names the temporary link, so two ranks that both took themselves for their
// file system's first (a network file system slow to show another node's files) do not rename each other's.
static void switch_checkpoint(const fs::path& out, const std::string& stage, int rank) {
  const fs::path link = out / "checkpoint", tmp = out / fmt::format("checkpoint.switching-{}", rank);
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_directory_symlink(stage, tmp, ec);
  if (ec) {
    // A file system without symbolic links (exFAT, some SMB mounts): the complete stage takes the name itself, the
    // previous checkpoint removed first (a kill between the two leaves only the staged directory). A stage already
    // gone was renamed by another rank that declares on this file system: `checkpoint` is it.
    if (!fs::exists(out / stage, ec)) return;
    fs::remove_all(link);
    fs::rename(out / stage, link);
    sync_path(out.string());  // the rename on disk too
    return;
  }
  if (fs::is_directory(fs::symlink_status(link))) {
    fs::remove_all(out / "checkpoint-unstaged", ec);
    fs::rename(link, out / "checkpoint-unstaged", ec);
    if (ec && fs::is_directory(fs::symlink_status(link)))
      throw ConfigError(
          fmt::format("checkpoint: cannot move the old directory '{}' aside: {}", link.string(), ec.message()));
  }
  fs::rename(tmp, link);    // rename(2) replaces the old link atomically
  sync_path(out.string());  // the new link is on disk before the checkpoint it replaces goes
}

// The stage of `step` in `out` to resume from: the one `checkpoint` points at when it is of that step, else the
// declared one (with its checkpoint.json) of checkpoint-<step> and checkpoint-<step>.<k> written last (the highest k).
static fs::path older_stage(const fs::path& out, int64_t step) {
  const std::string base = fmt::format("checkpoint-{}", step);
  std::error_code ec;
  const std::string linked = fs::read_symlink(out / "checkpoint", ec).filename().string();
  if (!ec && (linked == base || linked.rfind(base + ".", 0) == 0)) return out / linked;
  fs::path found = out / base;
  long long best = -1;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string n = e.path().filename().string();
    long long k = -1;
    if (n == base)
      k = 0;
    else if (n.rfind(base + ".", 0) == 0 && n.size() > base.size() + 1 && n.size() < base.size() + 12 &&
             n.find_first_not_of("0123456789", base.size() + 1) == std::string::npos)
      k = std::stoll(n.substr(base.size() + 1));
    std::error_code jec;
    if (k > best && fs::exists(e.path() / "checkpoint.json", jec)) best = k, found = e.path();
  }
  return found;
}

// Removes the checkpoint-<step> stages of <out> other than `stage` (the one `checkpoint` now points at), the
// moved-aside `checkpoint-unstaged`, and what runs killed at a checkpoint left: temporary links and file-system probes.
static void remove_old_stages(const fs::path& out, const std::string& stage) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string name = e.path().filename().string();
    // Only the stages this scheme writes (checkpoint-<step>, checkpoint-<step>.<k> where that was taken) and the
    // moved-aside directory: a user's copy named checkpoint-best is not ours to remove.
    const size_t digits =
        name.size() > 11 && name.rfind("checkpoint-", 0) == 0 ? name.find_first_not_of("0123456789", 11) : 0;
    const bool staged = digits > 11 && (digits == std::string::npos ||
                                        (name[digits] == '.' && digits + 1 < name.size() &&
                                         name.find_first_not_of("0123456789", digits + 1) == std::string::npos));
    std::error_code lec;
    const bool link = fs::is_symlink(e.symlink_status(lec));
    if ((staged || name == "checkpoint-unstaged") && name != stage && !link) fs::remove_all(e.path(), lec);
    if ((name.rfind("checkpoint.switching", 0) == 0 && link) ||
        (name.rfind(".checkpoint-probe-", 0) == 0 && e.is_regular_file(lec)))
      fs::remove(e.path(), lec);
  }
}

static nlohmann::json cost_model_json(const coll::CostModel& m) {
  return {{"intra", {m.intra.alpha, m.intra.beta, m.intra.gamma}},
          {"inter", {m.inter.alpha, m.inter.beta, m.inter.gamma}}};
}

// checkpoint.json's cost_model ({"intra": [alpha, beta, gamma], "inter": [...]}, written exactly), or a one-line
// ConfigError naming the field.
static coll::CostModel checkpoint_cost_model(const nlohmann::json& v, const fs::path& dir) {
  coll::CostModel m;
  m.source = "checkpoint";
  auto link = [&](const char* name, coll::LinkCost& l) {
    const auto it = v.is_object() ? v.find(name) : v.end();
    bool ok = it != v.end() && it->is_array() && it->size() == 3;
    for (size_t k = 0; ok && k < 3; ++k)
      ok = (*it)[k].is_number() && std::isfinite((*it)[k].get<double>()) && (*it)[k].get<double>() >= 0;
    if (!ok)
      throw ConfigError(fmt::format(
          "config: resume: {}: cost_model is {}; allowed: {{\"intra\": [alpha, beta, gamma], \"inter\": [...]}} of "
          "finite numbers 0 or more, as conduit train writes it",
          (dir / "checkpoint.json").string(), v.dump()));
    l = {(*it)[0].get<double>(), (*it)[1].get<double>(), (*it)[2].get<double>()};
  };
  link("intra", m.intra);
  link("inter", m.inter);
  return m;
}

TrainResult train_worker(const TrainConfig& given, coll::CommPtr comm_ptr, const WorkerOptions& wo) {
  TrainConfig c = given;  // (ZeRO-3's `node` groups resolved below)
  const SyncSpec spec = effective_sync(c);
  const int global_rank = comm_ptr->rank();
  const bool outputs = wo.write_outputs;
  torch::set_num_threads(1);
  // Tensor parallelism: groups of tp consecutive ranks split each layer of the vit; data parallelism runs over the
  // ranks at one position of their groups (dp_comm), which share the data and average gradients.
  Trace trace(global_rank);  // (before the model, whose tensor-parallel collectives record into it)
  trace.enable(c.trace && outputs);
  // Pipeline parallelism: pp consecutive groups of tp (a model replica of tp x pp ranks) hold its stages in order;
  // pp_comm joins the ranks at one tensor-parallel position of a replica's stages, dp_comm the ranks at one position
  // of every replica.
  const int tp = std::max(1, c.tp), pp = std::max(1, c.pp), mp = tp * pp;
  std::shared_ptr<TpGroup> tpg;
  coll::CommPtr dp_comm = comm_ptr, pp_comm;
  // The mlp's, cnn's or resnet's cut into stages (stage_bounds; null: the vit's blocks, or no pipeline): checked
  // against a resumed checkpoint's and recorded in checkpoints and the summary.
  nlohmann::json cut;
  // (all of resolve_config's refusals of the interleaved schedule: at pp 4 the vit's chunks came out one a stage
  // and the Pipeline refused them with an InvalidArgument after the collective set-up, and micro-batches that are
  // not a multiple of pp failed at the first step; found by an audit; also at pp 1, which has no pipeline at all)
  if (c.pp_schedule == "interleaved" && (pp != 2 || c.model != "vit"))
    throw ConfigError(
        fmt::format("config: pp_schedule: interleaved gives each stage 2 or more chunks of the vit's 4 "
                    "blocks, this run has model {} and pp {}; allowed: model vit and pp 2, or gpipe or 1f1b",
                    c.model, pp));
  if (c.pp_schedule == "interleaved" && c.micro_batches % pp != 0)
    throw ConfigError(
        fmt::format("config: micro_batches: {} is not a multiple of pp ({}): the interleaved schedule "
                    "takes micro-batches in groups of the stages; allowed: a multiple of {}",
                    c.micro_batches, pp, pp));
  if (pp > 1 || c.micro_batches > 1) {
    // (resolve_config refuses these with the same words; a caller of train_worker may not have run it)
    if (!spec.bsp())
      throw ConfigError(
          fmt::format("config: pp: {} and micro_batches: {} need sync bsp, this run is under sync {}; allowed with "
                      "them: pp 1 and micro_batches 1",
                      pp, c.micro_batches, spec.name));
    if (pp > 1 && c.model != "vit") cut = stage_bounds(c.model, pp);  // (more stages than units: its one line)
    if (comm_ptr->size() % mp != 0 || c.micro_batches < 1 || c.micro_batches > c.batch_size)
      throw ConfigError(
          fmt::format("config: pp: {} stages of {} ranks with {} micro-batches of a batch of {} on {} ranks; "
                      "allowed: tp x pp dividing the ranks, micro_batches 1 to batch_size",
                      pp, tp, c.micro_batches, c.batch_size, comm_ptr->size()));
  }
  if (c.recompute && pp < 2)
    throw ConfigError(
        "config: recompute: recomputes the forward of a pipeline stage's micro-batches, this run has no pipeline; "
        "allowed with pp 1: recompute false");
  check_pipeline_pairs(c);
  if (c.sequence_parallel && (tp < 2 || pp > 1))  // (as resolve_config refuses it)
    throw ConfigError(fmt::format(
        "config: sequence_parallel: splits the tokens over a tensor-parallel group between its split layers, this "
        "run has tp {} and pp {}; allowed: tp 2 or 4 with pp 1, or sequence_parallel false",
        tp, pp));
  if (tp > 1) {
    // (resolve_config refuses these with the same words; a caller of train_worker may not have run it)
    if (c.model != "vit" || !spec.bsp())
      throw ConfigError(
          fmt::format("config: tp: {} splits the vit under sync bsp, this run is of model {} under "
                      "sync {}; allowed with them: tp 1",
                      tp, c.model, spec.name));
    if (comm_ptr->size() % tp != 0)
      throw ConfigError(
          fmt::format("config: tp: {} ranks a group do not divide the {} ranks; allowed: a multiple of "
                      "tp",
                      tp, comm_ptr->size()));
    tpg = std::make_shared<TpGroup>();
    tpg->comm = comm_ptr->split(global_rank / tp, global_rank % tp);
    tpg->timeout_s = c.timeout_s;
    tpg->sequence_parallel = c.sequence_parallel;
    tpg->trace = &trace;
  }
  if (pp > 1) pp_comm = comm_ptr->split(global_rank / mp * tp + global_rank % tp, global_rank / tp % pp);
  if (mp > 1) dp_comm = comm_ptr->split(global_rank % mp, global_rank / mp);
  std::vector<int> host_of;  // every rank's host (the tensor-parallel partners' groups are compared by it)
  if (tp > 1)
    for (int r = 0; r < comm_ptr->size(); ++r) host_of.push_back(comm_ptr->host_of(r));
  if (tp > 1 && dp_comm->size() > 1) {
    if (agree_partner_sums(*dp_comm, host_of, tp, mp) && global_rank == 0)
      std::fprintf(
          stderr,
          "train: note: the tensor-parallel partners' data-parallel groups span the hosts "
          "differently: their gradients' allreduce and reduce-scatter go by ring (over any CONDUIT_ALLREDUCE or "
          "CONDUIT_REDUCE_SCATTER), whose sums follow the "
          "ranks alone (the replicated parameters' copies would drift apart by rounding otherwise)\n");
  }
  // ZeRO's groups given as `node`: the data-parallel workers of one host (with tp and pp every (tp x pp)-th: a host's
  // workers / (tp x pp)), from the whole job's host map so that every rank comes to the same number: the hosts must
  // hold as many workers each, in consecutive ranks, a multiple of tp x pp (or a model replica spans hosts: no groups);
  // none (over all, for shards) where a host's form no two groups or more of two or more (one host holds them all, or
  // one data-parallel worker a host, or none), with a note, as the simulator's node.
  for (auto [group, key, none] : {std::tuple{&c.zero_hpz, "zero_hpz", "none used"},
                                  std::tuple{&c.zero_shard_group, "zero_shard_group", "sharded over all"}}) {
    if (*group != kHostGroup || (group == &c.zero_hpz ? c.zero != 3 : c.zero == 0)) continue;
    const int per_host = comm_ptr->consecutive_host_ranks(), d = dp_comm->size();
    if (per_host == 0 || (per_host % mp != 0 && mp % per_host != 0)) {
      std::map<int, int> counts;
      for (int r = 0; r < comm_ptr->size(); ++r) ++counts[comm_ptr->host_of(r)];
      std::string held;
      for (auto [h, n] : counts) held += (held.empty() ? "" : ", ") + std::to_string(n);
      throw ConfigError(fmt::format(
          "config: {}: node: the hosts hold {} of the {} workers{}; allowed with node: as many workers on every host "
          "in consecutive ranks{}; or a group size, or 0",
          key, held, comm_ptr->size(), per_host == 0 ? ", not as many each in consecutive ranks" : "",
          mp > 1 ? fmt::format(", a multiple or a divisor of tp x pp = {}", mp) : ""));
    }
    const int k = per_host % mp == 0 ? per_host / mp : 0;  // (a replica spanning hosts: none a host)
    *group = k >= 2 && k < d ? k : 0;
    if (*group == 0 && global_rank == 0 && wo.write_outputs)
      fmt::print(stderr, "train: note: {} node: {} data-parallel worker(s) a host form no groups of the {}; {}\n", key,
                 k, d, none);
  }
  std::shared_ptr<Net> model;
  {
    // torch's generator is global: ranks that are threads of one process (tests) must not interleave their draws.
    static std::mutex init_mu;
    std::lock_guard<std::mutex> lk(init_mu);
    torch::manual_seed(c.seed);
    // (the interleaved schedule's stages hold kVitBlocks / pp chunks of one block each)
    const int chunks = c.pp_schedule == "interleaved" ? kVitBlocks / pp : 1;
    if (c.model == "vit")
      model = make_vit(tpg.get(), pp > 1 ? pp_comm->rank() : 0, pp, chunks);
    else
      model = pp > 1 ? make_model_stage(c.model, pp_comm->rank(), pp) : make_model(c.model);
  }
  auto optimizer = make_optimizer(c, *model);

  // Resume: the model and optimizer state first (SchemeOptimizer re-seats the parameters afterwards).
  fs::path rd(c.resume);
  // A rank's own checkpoint files, read by `load`, and whether every rank could read its own: the rank that cannot
  // throws its error naming the file; the others one line naming that rank (they failed in their next collective
  // with the transport's nested errors, naming no file).
  auto agree_on_files = [&](const char* what, const std::function<void()>& load) {
    std::exception_ptr err;
    try {
      load();
    } catch (const std::exception&) {  // (a filesystem_error of an unreadable folder too)
      err = std::current_exception();
    }
    if (const int failed = coll::agree_on_failure(*comm_ptr, err); failed >= 0)
      throw ConfigError(
          fmt::format("config: resume: rank {} cannot read its {} (its error names the file); allowed: "
                      "a complete checkpoint",
                      failed, what));
  };
  nlohmann::json meta;
  if (!c.resume.empty()) {
    // Read on every rank (nodes may have their own copies): a rank that cannot read its copy tells the others in the
    // step exchange below, so they stop with it instead of waiting for it until their deadline.
    std::exception_ptr unreadable;
    int64_t my_step = 0;
    try {
      meta = read_checkpoint_json(rd);
      check_checkpoint_fields(meta, rd);
      my_step = checkpoint_int(meta, "global_step", rd);
    } catch (const std::exception&) {
      unreadable = std::current_exception();
    }
    // Every rank resumes from one checkpoint. Nodes without a shared file system have a `checkpoint` link each, and a
    // run stopped while they switched them leaves some at the previous checkpoint, which every node still holds
    // (older stages go only once every link has moved).
    if (comm_ptr->size() > 1) {
      int64_t range[3] = {my_step, -my_step,
                          unreadable ? 1 : 0};  // the largest step, minus the smallest, any unreadable
      comm_ptr->allreduce(range, 3, DType::i64, ReduceOp::max).wait();
      if (unreadable) std::rethrow_exception(unreadable);
      if (range[2] != 0)
        throw ConfigError(
            fmt::format("config: resume: another rank cannot read its copy of '{}' (its error names "
                        "what is wrong); allowed: a complete checkpoint on every node",
                        rd.string()));
      if (range[0] != -range[1]) {
        fs::path dir = rd;
        if (!dir.has_filename()) dir = dir.parent_path();  // (a trailing '/')
        throw ConfigError(fmt::format(
            "config: resume: the ranks' checkpoints are of different steps ({} to {}; rank {} read step {} from '{}'): "
            "the run stopped while its nodes switched their checkpoint links; allowed: --resume {} (step {}, "
            "which every node keeps)",
            -range[1], range[0], global_rank, my_step, rd.string(), older_stage(dir.parent_path(), -range[1]).string(),
            -range[1]));
      }
    }
    if (unreadable) std::rethrow_exception(unreadable);
    check_resume_against(meta, c, comm_ptr->size());
    // The links' cost model the checkpointed run chose its collective algorithms by: measured again at start-up, it
    // can choose others, whose sums of 3 or more ranks' floats differ in the last bits (a resume was not bit for bit
    // once in ten). A model given by CONDUIT_COST_MODEL still wins.
    // (the data-parallel group's own copy too, where agree_partner_sums gave it one)
    if (meta.contains("cost_model") && !env_string("CONDUIT_COST_MODEL").has_value()) {
      const coll::CostModel saved = checkpoint_cost_model(meta["cost_model"], rd);
      comm_ptr->tuner().set_model(saved);
      if (&dp_comm->tuner() != &comm_ptr->tuner()) dp_comm->tuner().set_model(saved);
    }
    // The mlp's, cnn's and resnet's cut (stage_bounds): a stage's model file holds its units' modules only.
    if (!cut.is_null() && meta.contains("stage_bounds") && !meta["stage_bounds"].is_null() &&
        meta["stage_bounds"] != cut)
      throw ConfigError(fmt::format(
          "config: resume: the checkpoint's stages begin at units {}, this version cuts model {} at {}; allowed: "
          "resume with the version that wrote it",
          meta["stage_bounds"].dump(), c.model, cut.dump()));
    // ZeRO's slices are cut over the shard group (checkpoints before it: over all ranks, 0).
    const int saved_group = meta.contains("zero_shard_group") && meta["zero_shard_group"].is_number_integer()
                                ? meta["zero_shard_group"].get<int>()
                                : 0;
    if (c.zero > 0 && std::max(saved_group, 1) != std::max(c.zero_shard_group, 1))
      throw ConfigError(fmt::format(
          "config: resume: the checkpoint was written with zero_shard_group = {}, this run has {}{}; allowed: the same "
          "zero_shard_group (each rank's optimizer state is of its slices cut over that group)",
          saved_group, c.zero_shard_group, given.zero_shard_group == kHostGroup ? " (node, from the host map)" : ""));
    fs::path mine = rd / fmt::format("rank-{}", global_rank);
    agree_on_files("model.pt or optimizer.pt", [&] {
      load_checkpoint_archive(mine / "model.pt", *model);
      // (ZeRO: once the DistributedOptimizer has given it this rank's slices, below)
      if (c.zero == 0) load_checkpoint_archive(mine / "optimizer.pt", *optimizer);
    });
  }

  // bsp: the bucketed, overlapped, compressed DistributedOptimizer; any other scheme: a sync::Strategy.
  std::unique_ptr<DistributedOptimizer> dopt;
  bool sync_buffers = false;  // bsp: the model has buffers (BatchNorm statistics) to keep equal across ranks
  std::unique_ptr<SchemeOptimizer> sopt;
  coll::CommPtr wcomm = comm_ptr;
  if (spec.bsp()) {
    DistOptions dopts;
    dopts.bucket_cap_bytes = size_t(c.bucket_cap_mb * 1024 * 1024);
    dopts.first_bucket_bytes = size_t(c.first_bucket_mb * 1024 * 1024);
    dopts.compress_min_bytes = size_t(c.compress_min_bytes);
    // dgc and signum hold the momentum (resolve_config wrote it into their spec); the layers that skip them need
    // theirs too (there are some only below a compress_min_bytes, and at stage 0).
    if (auto [cname, cparams] = split_compressor_spec(c.compressor);
        !momentum_compressor(cname).empty() && cparams.count("momentum") && c.compress_min_bytes > 0 && c.zero == 0)
      dopts.dense_momentum = std::stod(cparams.at("momentum"));
    dopts.overlap = c.overlap;
    dopts.compressor = c.compressor;
    dopts.seed = c.seed;
    dopts.timeout_s = c.timeout_s;
    dopts.trace = &trace;
    dopts.zero_stage = c.zero;
    // (ZeRO-1/2 with zero_prefetch: the allgather after each step goes on behind the next forward, unit by unit)
    if (c.zero > 0) dopts.units = model->units();
    dopts.zero_prefetch = c.zero_prefetch;
    dopts.zero_gather_dtype = c.zero_gather == "bf16"   ? DType::bf16
                              : c.zero_gather == "fp16" ? DType::f16
                              : c.zero_gather == "int8" ? DType::i8
                                                        : DType::f32;
    dopts.zero_allgather_bytes = size_t(c.zero_allgather_mb * 1024 * 1024);
    dopts.zero_secondary_ranks = c.zero_hpz;
    dopts.zero_shard_ranks = c.zero_shard_group;
    // (the int wires' blocks never mix a replicated parameter, equal across the tensor-parallel group, with a split
    // one)
    dopts.blocks_per_parameter = c.tp > 1;
    if (c.tp > 1 && c.zero > 0 && zero_int_wire(c.compressor).bits > 0) {
      dopts.zero_int_hierarchy = tp_partners_split_alike(host_of, c.tp, c.tp * c.pp);
    }
    dopts.backward_passes = c.micro_batches;
    dopts.zero_reduce_each_pass = c.zero_reduce == "micro-batch";
    dopt = std::make_unique<DistributedOptimizer>(model, optimizer, dp_comm, dopts);
    model->set_unit_hooks(dopt->unit_hooks());
    if (c.zero > 0 && !c.resume.empty())
      agree_on_files("optimizer.pt", [&] {
        load_checkpoint_archive(rd / fmt::format("rank-{}", global_rank) / "optimizer.pt", *optimizer);
      });
    sync_buffers = comm_ptr->size() > 1 && !model->buffers().empty();
  } else {
    sopt = std::make_unique<SchemeOptimizer>(model, optimizer, comm_ptr, spec, c.lr, &trace);
    if (!sopt->is_worker()) {  // a dedicated parameter server (ps-* with colocate=0)
      sopt->serve();
      return {};
    }
    wcomm = sopt->worker_comm();
    sopt->setup(!c.resume.empty());
  }
  // ZeRO-3: the whole parameters, gathered for what reads them outside a training step (evaluations, copies,
  // checkpoints); collective over the data-parallel ranks, so every rank takes them at the same points.
  auto whole_model = [&] { return dopt ? dopt->whole_parameters() : std::shared_ptr<void>(); };
  // From here on: the workers only (dedicated servers returned above).
  coll::Communicator& comm = *wcomm;
  const int rank = comm.rank(), world = comm.size();
  const bool lead = rank == 0;
  // The ranks that share out the data: every worker, or with tp the data-parallel ranks (the ranks of one
  // tensor-parallel group train on the same samples and evaluate the same share of the test set together).
  coll::Communicator& data_comm = mp > 1 ? *dp_comm : comm;
  // The micro-batches' schedule over the stages (with pp 1: gradient accumulation on this rank).
  std::unique_ptr<Pipeline> pipe;
  int pipe_peak = 0;  // most micro-batches whose activations this rank held at once
  if (dopt && (pp > 1 || c.micro_batches > 1)) {
    pipe = std::make_unique<Pipeline>(pp_comm, model, parse_pipe_schedule(c.pp_schedule), c.timeout_s, &trace,
                                      c.recompute);
  }
  const int data_rank = data_comm.rank(), data_world = data_comm.size();
  const bool data_lead = data_rank == 0;  // holds the model copies of eval_every (every rank of the first group)
  // Schemes other than bsp keep replicas that may differ: worker 0 evaluates its own, alone, so no evaluation makes
  // the workers wait for each other.
  coll::Communicator* eval_comm = spec.bsp() ? &data_comm : nullptr;
  const bool evaluates = spec.bsp() || lead;
  TrainTestSets data = load_data(c);
  // The workers load their data at their own pace (another disk, a busier CPU): they meet here under start-up's
  // deadline (core/env.h), so that a short collective deadline does not fail the first exchange behind a slow loader.
  // (The workers' communicator: dedicated servers returned.)
  if (world > 1) {
    coll::CollOptions meet;
    meet.timeout_s = startup_timeout_seconds(c.timeout_s);
    comm.barrier(meet).wait();
  }
  // The training data's identity and absolute folder (file data sets; the synthetic one is its seed and
  // synthetic_samples, compared with the checkpoint's above).
  const bool file_data = c.dataset != "synthetic";
  // (hashed once: the workers' comparison below takes it too)
  const uint64_t train_hash = file_data || world > 1 ? data_hash(data.train) : 0;
  const std::string data_id = file_data ? train_data_id(data.train, train_hash) : std::string();
  const std::string data_dir_resolved = file_data ? resolved_data_dir(c.data_dir) : std::string();
  // Mid-epoch, the sampler position counts this data's samples: resumed on other data (another data_dir, or its
  // files replaced), the rest of the epoch ran over other samples without a word. Compared by content, so the same
  // files at another path (another node's copy, a moved folder) resume; a checkpoint written before the content was
  // recorded compares the resolved data_dir instead.
  // Each rank checks its own copy; the others learn of a mismatch in one allreduce and stop with it (a rank whose
  // copy differed stopped alone, and the others waited in their first gradient exchange until the deadline).
  std::string other_data;
  if (file_data && !c.resume.empty() && checkpoint_int(meta, "step", rd) != 0) {
    const std::string saved_dir = meta.value("data_dir", std::string());
    const std::string saved_resolved = meta.value("data_dir_resolved", resolved_data_dir(saved_dir));
    const bool has_id = meta.contains("train_data");
    const std::string saved_id = has_id ? meta["train_data"].get<std::string>() : std::string();
    if (has_id ? saved_id != data_id : meta.contains("data_dir") && saved_resolved != data_dir_resolved)
      other_data = fmt::format(
          "config: resume: the checkpoint was written mid-epoch on the training data of data_dir '{}'{}, this run's "
          "data_dir is '{}'{}; allowed: the same training data (the sampler position counts its samples; at an "
          "epoch's end it may change)",
          saved_resolved, has_id ? " (" + saved_id + ")" : std::string(), data_dir_resolved,
          has_id ? " (" + data_id + ")" : std::string());
  }
  if (!c.resume.empty()) {
    int32_t any = other_data.empty() ? 0 : 1;
    if (world > 1) comm.allreduce(&any, 1, DType::i32, ReduceOp::max).wait();
    if (!other_data.empty()) throw ConfigError(other_data);
    if (any != 0)
      throw ConfigError(
          "config: resume: another worker's training data is not the data the checkpoint was written on mid-epoch "
          "(its error names both); allowed: the same training data on every node");
  }
  // The workers compare what they loaded (after a resume's own check, whose error says more where it applies): nodes
  // with copies of their own may hold other files, and the samplers shard by each rank's own count: other counts of
  // steps waited in an exchange until the deadline, equal ones trained on overlapping shards and scored other test
  // sets.
  if (world > 1) {
    const std::array<int64_t, 4> mine{data.train.n, static_cast<int64_t>(train_hash), data.test.n,
                                      static_cast<int64_t>(data_hash(data.test))};
    std::vector<int64_t> all(4 * static_cast<size_t>(world));
    comm.allgather(mine.data(), all.data(), 4, DType::i64).wait();
    for (int r = 1; r < world; ++r)
      for (int k = 0; k < 4; k += 2) {
        const int64_t* a = &all[k];
        const int64_t* b = &all[4 * static_cast<size_t>(r) + k];
        if (a[0] != b[0] || a[1] != b[1])
          throw ConfigError(fmt::format(
              "data: the workers loaded different {} sets: worker 0 {} samples (fnv1a-64 {:016x}), worker {} {} "
              "samples (fnv1a-64 {:016x}); allowed: the same data on every worker (each node's copy of data_dir "
              "holding the same files, with the same train_limit/test_limit)",
              k == 0 ? "training" : "test", a[0], static_cast<uint64_t>(a[1]), r, b[0], static_cast<uint64_t>(b[1])));
      }
  }
  sync::Straggler straggler(sync::parse_slow(c.slow, comm_ptr->size()), global_rank, uint64_t(c.seed));

  DistributedSampler sampler(data.train.n, data_world, data_rank, c.seed);
  const int64_t spe = sampler.steps_per_epoch(c.batch_size);
  if (spe < 1)
    throw ConfigError(fmt::format(
        "config: batch_size: {} per worker x {} {} is more than the {} training "
        "samples; allowed: at most {}",
        c.batch_size, data_world, data_sharers(c), data.train.n, std::max<int64_t>(data.train.n / data_world, 1)));
  // Steps of the whole run: those before the epoch it starts in (counted in the batches of the run that took them:
  // a resume at an epoch's end may change the batch size) and this run's steps per epoch for the rest.
  const int64_t steps_before_epoch =
      c.resume.empty() ? 0 : checkpoint_int(meta, "global_step", rd) - checkpoint_int(meta, "step", rd);
  const int start_epoch_at = c.resume.empty() ? 0 : static_cast<int>(checkpoint_int(meta, "epoch", rd));
  int64_t total_steps = steps_before_epoch + int64_t(c.epochs - std::min(start_epoch_at, c.epochs)) * spe;
  if (c.max_steps > 0) total_steps = std::min(total_steps, c.max_steps);
  // A resume with nothing left to run takes no step and ends (as Lightning does past max_epochs), which is said: it
  // ended without a word, and a null final loss.
  const int64_t resumed_at = c.resume.empty() ? 0 : checkpoint_int(meta, "global_step", rd);
  if (!c.resume.empty() && total_steps <= resumed_at && lead && outputs)
    fmt::print(stderr,
               "train: warning: the checkpoint is at step {}, where this run (epochs {}, max_steps {}) ends already: "
               "nothing is left to run (give more epochs, or max_steps 0 or above {}, to train on)\n",
               resumed_at, c.epochs, c.max_steps, resumed_at);
  // The warm-up's steps run at lr (k+1)/warmup, its last at the full lr: under two steps it is none at all. Its length
  // in steps is rounded to the nearest (truncated, 0.29 of 100 steps was 28, and the least length the error below
  // names, 0.2857 of 7 steps, was refused as one step).
  // A resume that keeps the checkpoint's warm-up (the same warmup_epochs and steps an epoch) keeps its length in
  // steps as the checkpoint recorded it: a checkpoint of before the rounding (2026-12-06) has none, and ran with the
  // truncated length, which the schedule's remaining steps depend on.
  const int64_t warmup = [&]() -> int64_t {
    const int64_t rounded = std::llround(c.warmup_epochs * double(spe));
    if (c.resume.empty() || !meta.contains("warmup_epochs") || !meta["warmup_epochs"].is_number() ||
        meta["warmup_epochs"].get<double>() != c.warmup_epochs)
      return rounded;
    // The same steps an epoch (recorded since 2026-12-06; before, the batch size: the data could change only at an
    // epoch's end, and rarely did).
    const bool same_epochs = meta.contains("steps_per_epoch") ? meta.value("steps_per_epoch", int64_t{-1}) == spe
                                                              : meta.value("batch_size", int64_t{-1}) == c.batch_size;
    if (!same_epochs) return rounded;
    if (!meta.contains("warmup_steps")) return int64_t(c.warmup_epochs * double(spe));
    if (!meta["warmup_steps"].is_number_integer() || meta["warmup_steps"].get<int64_t>() < 0)
      throw ConfigError(fmt::format("checkpoint: '{}' has warmup_steps {}; allowed: a whole number of steps, 0 or more",
                                    (rd / "checkpoint.json").string(), meta["warmup_steps"].dump()));
    return meta["warmup_steps"].get<int64_t>();
  }();
  // (max_steps shortened the run below the warm-up: the lr never reached lr; a resume, whose earlier steps may have
  // had another batch size, is not judged here)
  if (c.max_steps > 0 && c.resume.empty() && warmup > total_steps)
    throw ConfigError(
        fmt::format("config: warmup_epochs: {} is {} steps, more than this run's {} (max_steps); "
                    "allowed: a warm-up that ends within the run",
                    c.warmup_epochs, warmup, total_steps));
  if (c.warmup_epochs > 0 && warmup < 2)
    throw ConfigError(
        fmt::format("config: warmup_epochs: {} is {} step(s) at {} steps an epoch, which warms nothing "
                    "up (a warm-up's last step is at the full lr); allowed: 0, or at least {:.4g} "
                    "epochs (two steps)",
                    c.warmup_epochs, warmup, spe, 2.0 / double(spe)));
  // eval_every: worker 0 holds a copy of the model every eval_every steps until the next checkpoint (bsp: every
  // epoch end; checkpoint_every) or the end of the run. Bounded here: a small eval_every on a long run ran out of
  // memory (the CNN at eval_every 1 and batch 1: 60,000 copies of 1.7 MB an epoch).
  if (c.eval_every > 0) {
    constexpr uint64_t kMaxCopiesBytes = uint64_t{4} << 30;
    int64_t span = total_steps - resumed_at;
    if (outputs && dopt) span = std::min(span, spe);
    if (outputs && c.checkpoint_every > 0) span = std::min<int64_t>(span, c.checkpoint_every);
    const uint64_t copies = uint64_t(std::max<int64_t>(span, 0) / c.eval_every) + 1;
    uint64_t bytes = 0;
    for (const auto& t : model->parameters()) bytes += uint64_t(t.nbytes());
    for (const auto& t : model->buffers()) bytes += uint64_t(t.nbytes());
    if (bytes > 0 && copies > kMaxCopiesBytes / bytes)
      throw ConfigError(fmt::format(
          "config: eval_every: {} keeps up to {} copies of the model ({:.1f} MB each, {:.1f} GB) until they are "
          "evaluated at the next checkpoint; allowed: at most 4 GiB of copies (eval_every {} or more{})",
          c.eval_every, copies, double(bytes) / 1e6, double(copies) * double(bytes) / 1e9,
          int64_t(double(span) * double(bytes) / double(kMaxCopiesBytes)) + 1,
          outputs ? ", or a smaller checkpoint_every" : ""));
  }
  // The scheme's parameter `key` as given, else its default ("" when it has none).
  auto scheme_param = [&](const char* key) -> std::string {
    if (spec.bsp()) return {};
    if (auto it = spec.params.find(key); it != spec.params.end()) return it->second;
    const auto d = sync::strategy_defaults(spec.name);
    auto dt = d.find(key);
    return dt != d.end() ? dt->second : std::string();
  };
  const std::string period_text = scheme_param("period"), warmup_text = scheme_param("warmup");
  // bsp's bucket settings do nothing under another scheme (they were taken without a word).
  if (!spec.bsp() && lead && outputs) {
    const TrainConfig defaults;
    std::vector<std::string> unused;
    if (c.bucket_cap_mb != defaults.bucket_cap_mb) unused.push_back("bucket_cap_mb");
    if (c.first_bucket_mb != defaults.first_bucket_mb) unused.push_back("first_bucket_mb");
    if (c.overlap != defaults.overlap) unused.push_back("overlap");
    if (!unused.empty())
      fmt::print(stderr, "train: warning: {} set bsp's gradient buckets; sync {} has none and ignores {}\n",
                 join(unused, ", "), spec.name, unused.size() > 1 ? "them" : "it");
  }
  // Settings of the data or the compressor this run does not use (taken without a word).
  if (lead && outputs) {
    const TrainConfig defaults;
    auto warn = [](const char* key, const std::string& why) {
      fmt::print(stderr, "train: warning: {} is set, but {}: it is ignored\n", key, why);
    };
    if (c.dataset != "synthetic" && c.synthetic_samples != defaults.synthetic_samples)
      warn("synthetic_samples", fmt::format("the dataset is {}", c.dataset));
    if (c.dataset == "synthetic" && c.data_dir != defaults.data_dir) warn("data_dir", "the dataset is synthetic");
    if (c.compressor == "none" && c.compress_min_bytes != defaults.compress_min_bytes)
      warn("compress_min_bytes", "the compressor is none");
    else if (c.zero > 0 && c.compress_min_bytes != defaults.compress_min_bytes)
      warn("compress_min_bytes", fmt::format("zero {} puts every gradient on the reduce-scatter's wire", c.zero));
    if (c.zero_allgather_mb > 0 && !c.zero_prefetch)
      warn("zero_allgather_mb", "zero_prefetch is false: the allgather after each step is one call per bucket");
    // (found by an audit: taken and recorded, changing nothing)
    for (const auto& [key, given, fallback] :
         {std::tuple{"bucket_cap_mb", c.bucket_cap_mb, defaults.bucket_cap_mb},
          std::tuple{"first_bucket_mb", c.first_bucket_mb, defaults.first_bucket_mb}})
      if (c.zero == 3 && given != fallback)
        warn(key, "zero 3 reduces and gathers a layer (unit) at a time, one bucket each");
    if (c.recompute && c.micro_batches == 1)
      warn("recompute",
           "with one micro-batch every stage's backward follows its forward: nothing is kept to recompute");
    if (c.pp > 1 && c.micro_batches == 1)  // (found by an audit)
      fmt::print(stderr,
                 "train: warning: pp {} with one micro-batch runs the stages one after another, each waiting for "
                 "the others (no pipelining; the schedule changes nothing): --micro-batches M > 1 overlaps them\n",
                 c.pp);
    // (ZeRO's int8 all-to-all keeps a rank's own part exact: with one rank nothing changes)
    if (spec.bsp() && c.compressor != "none" && !(c.zero > 0 && zero_int_wire(c.compressor).bits > 0) &&
        c.workers / (c.tp * c.pp) == 1)
      fmt::print(stderr,
                 "train: warning: compressor {} runs with one data-parallel rank (workers {} / (tp {} x pp {})): "
                 "it changes the gradients but sends nothing (its default gives way to none here)\n",
                 c.compressor, c.workers, c.tp, c.pp);
    if (c.zero > 0 && c.workers / (c.tp * c.pp) == 1)  // (found by an audit: it reported zero N, sharding nothing)
      fmt::print(stderr,
                 "train: warning: zero {} runs with one data-parallel rank (workers {} / (tp {} x pp {})): it "
                 "partitions nothing, every rank holds its whole optimizer state\n",
                 c.zero, c.workers, c.tp, c.pp);
  }
  if (!period_text.empty() && lead && outputs) {
    const int64_t period = std::strtoll(period_text.c_str(), nullptr, 10);
    // Local SGD's warm-up steps average every step (a warm-up as long as the run synchronizes throughout).
    const int64_t warm = warmup_text.empty() ? 0 : std::strtoll(warmup_text.c_str(), nullptr, 10);
    if (period > total_steps - std::min(warm, total_steps) && warm < total_steps)
      fmt::print(stderr,
                 // The schemes with a period (local, diloco, easgd) all synchronize once more in finish().
                 "train: warning: sync {} synchronizes every {} steps, but this run has {}{}: the workers exchange "
                 "nothing {}before the end (it synchronizes once there)\n",
                 spec.name, period, total_steps,
                 warm > 0 ? fmt::format(", {} of them warm-up steps that average every step", warm) : std::string(),
                 warm > 0 ? "after the warm-up " : "");
  }

  fs::path out(c.output), ckdir = out / "checkpoint";
  if (outputs) {
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec || !fs::is_directory(out))
      throw ConfigError(fmt::format("config: output: cannot create the directory '{}' ({}); allowed: a writable path",
                                    c.output, ec ? ec.message() : "a file is in the way"));
    // (written as the events come from here on: flat memory, and a run stopped mid-way keeps its timeline)
    if (c.trace) trace.open((out / fmt::format("trace-rank{}.json", global_rank)).string());
  }

  int start_epoch = 0;
  int64_t start_step = 0, global_step = 0, start_global_step = 0;
  double wall_before = 0, time_to_target = -1, last_acc = 0;
  // The epoch's training loss sum, correct predictions, samples and training seconds up to a checkpoint inside it
  // (totals.json's "epoch"): a run resumed there reports the whole epoch, where it reported its remainder alone.
  double resumed_epoch[4] = {0, 0, 0, 0};
  if (!c.resume.empty()) {
    fs::path mine = rd / fmt::format("rank-{}", global_rank);
    const fs::path state_file = mine / (dopt ? "compressor.bin" : "sync.bin");
    auto state_error = [&](const InvalidArgument& e) {  // (the message named no file)
      return ConfigError(
          fmt::format("config: resume: '{}' cannot be read: {}; allowed: a checkpoint written by "
                      "conduit train",
                      state_file.string(), e.what()));
    };
    const std::string totals = (mine / "totals.json").string();
    std::vector<uint8_t> state;
    StepStats restored;
    bool has_epoch_sums = true;
    start_step = checkpoint_int(meta, "step", rd);
    const std::string files = state_file.filename().string() + " or totals.json";
    agree_on_files(files.c_str(), [&] {
      state = read_bytes(state_file);
      try {
        if (dopt) dopt->load_compressor_state(state);
      } catch (const InvalidArgument& e) {
        throw state_error(e);
      }
      const nlohmann::json tot = read_json_file(totals);
      restored = totals_from_json(tot, totals);  // (added below, once every rank has read its own)
      if (start_step > 0) has_epoch_sums = epoch_sums_from_json(tot, totals, resumed_epoch);
    });
    if (sopt) {
      try {
        sopt->resume(state);  // (collective over the workers)
      } catch (const InvalidArgument& e) {
        throw state_error(e);
      }
    }
    start_epoch = start_epoch_at;
    global_step = start_global_step = checkpoint_int(meta, "global_step", rd);
    straggler.skip(start_global_step);  // the draws of the steps taken before the checkpoint
    wall_before = meta.value("wall_s", 0.0);
    time_to_target = meta.value("time_to_target_s", -1.0);
    last_acc = meta.value("test_accuracy", 0.0);
    if (dopt)
      dopt->add_to_totals(restored);
    else
      sopt->add_to_totals(restored);
    if (start_step > 0 && !has_epoch_sums && lead && outputs)
      fmt::print(stderr,
                 "train: warning: the checkpoint holds no running sums of its epoch (written before 2026-12-06): "
                 "this epoch's training loss, accuracy and samples/s cover the steps after the resume\n");
  }
  auto last_stats = [&]() -> const StepStats& { return dopt ? dopt->last_stats() : sopt->last_stats(); };
  auto total_stats = [&]() -> const StepStats& { return dopt ? dopt->total_stats() : sopt->total_stats(); };

  std::unique_ptr<JsonlWriter> metrics;
  if (outputs && lead) {
    // Resumed into a directory that holds the interrupted run's records: those past the checkpoint are about to be
    // written again, so they go (they appeared twice, the first copies from the run that did not finish).
    if (!c.resume.empty())
      trim_metrics_after(out / "metrics.jsonl", meta.value("global_step", int64_t{0}), meta.value("epoch", 0));
    metrics = std::make_unique<JsonlWriter>((out / "metrics.jsonl").string(), !c.resume.empty());
    write_text_file((out / "config.yaml").string(), config_to_yaml(c));
  }

  // The training clock: wall time without the evaluations (under bsp every worker waits for them; elsewhere only
  // worker 0 does, and epoch ends are snapshots when eval_every is set) and the checkpoints (barriers, fsyncs: the
  // DDP peer of the benchmarks writes none, and its runs were compared against a clock that held them), so time to
  // accuracy is the training's.
  const double t_start = now_s();
  double untimed_s = 0;
  double checkpoint_s = 0;  // seconds spent writing checkpoints, without the evaluations inside them
  auto elapsed = [&] { return wall_before + now_s() - t_start - untimed_s - checkpoint_s; };

  // eval_every: worker 0 copies its model (parameters and buffers) every eval_every steps and the copies are
  // evaluated after training (and before checkpoints), so evaluating does not perturb what is timed (an evaluation
  // of the full test set takes seconds, during which asynchronous workers would go on and synchronous ones wait).
  struct Snapshot {
    int epoch;
    int64_t global_step;
    double time_s;
    uint64_t bytes_sent;
    std::vector<torch::Tensor> state;
  };
  std::vector<Snapshot> snapshots;
  auto model_state = [&] {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> st;
    for (auto& p : model->parameters()) st.push_back(p.detach().clone());
    for (auto& b : model->buffers()) st.push_back(b.detach().clone());
    return st;
  };
  auto set_model_state = [&](const std::vector<torch::Tensor>& st) {
    torch::NoGradGuard ng;
    size_t i = 0;
    for (auto& p : model->parameters()) p.copy_(st[i++]);
    for (auto& b : model->buffers()) b.copy_(st[i++]);
  };
  // Every rank calls this at the same points (checkpoints, the end): the copies, held by worker 0, are evaluated by
  // all ranks together, one at a time (worker 0 broadcasts each; every rank evaluates its share of the test set), so
  // no rank waits for worker 0 longer than one copy's share: with many copies, worker 0 evaluating them alone kept
  // the others waiting past the communication deadline (70 copies, ~4 s each, against the 300 s default).
  // (With tp each group's rank at position q receives the copies of the first group's rank at q: its share.)
  coll::Communicator* snap_comm = data_world > 1 ? &data_comm : nullptr;
  auto evaluate_snapshots = [&] {
    if (c.eval_every <= 0) return;  // no copies are taken (the same on every rank)
    int64_t n = data_lead ? int64_t(snapshots.size()) : 0;
    if (snap_comm) snap_comm->broadcast(&n, 1, DType::i64, 0).wait();
    if (n == 0) return;
    const double t0 = now_s();
    auto whole = whole_model();
    auto now = model_state();
    std::vector<torch::Tensor> recv;  // the other ranks receive every copy into the same buffers
    if (!data_lead)
      for (auto& t : now) recv.push_back(torch::empty_like(t, torch::MemoryFormat::Contiguous));
    for (int64_t k = 0; k < n; ++k) {
      // Worker 0 sends the copy; only it writes the record and keeps the time to target, as before.
      std::vector<torch::Tensor> st = recv;
      if (data_lead)
        for (auto& t : snapshots[size_t(k)].state) st.push_back(t.contiguous());
      if (snap_comm)
        for (auto& t : st)
          snap_comm->broadcast(static_cast<uint8_t*>(t.data_ptr()), size_t(t.nbytes()), DType::u8, 0).wait();
      set_model_state(st);
      auto [acc, loss] = evaluate(*model, data.test, snap_comm, pipe.get());
      if (!lead) continue;
      const Snapshot& sn = snapshots[size_t(k)];
      if (c.target_accuracy > 0 && acc >= c.target_accuracy && (time_to_target < 0 || sn.time_s < time_to_target))
        time_to_target = sn.time_s;
      if (metrics)
        metrics->write({{"kind", "eval"},
                        {"epoch", sn.epoch + 1},
                        {"global_step", sn.global_step},
                        {"test_accuracy", acc},
                        {"test_loss", loss},
                        {"time_s", sn.time_s},
                        {"bytes_sent", sn.bytes_sent}});
    }
    set_model_state(now);
    snapshots.clear();
    untimed_s += now_s() - t0;
  };

  // Whether this rank declares the checkpoints (writes checkpoint.json, switches the `checkpoint` link, removes the
  // older stages) on its file system: the lowest rank whose files that file system shows. Where the ranks share one,
  // that is rank 0 alone, as before; on nodes without a shared one, the lowest rank of each node (rank 0 alone
  // declared: the other nodes' stages piled up, one per checkpoint, with no link to resume from). Found once, at the
  // first checkpoint: every rank leaves an empty file named with rank 0's random token (a killed run's files do
  // not count) and looks for those of the ranks below it.
  int declarer = -1;  // -1: not found yet; 0: no; 1: yes
  auto declares_checkpoints = [&]() -> bool {
    if (declarer >= 0) return declarer == 1;
    int64_t token = 0;
    if (lead) {
      std::random_device rd_token;
      token = int64_t((uint64_t(rd_token()) << 32) | uint64_t(rd_token()));
    }
    if (world > 1) comm.broadcast(&token, 1, DType::i64, 0).wait();
    auto probe = [&](int r) { return out / fmt::format(".checkpoint-probe-{:016x}-rank-{}", uint64_t(token), r); };
    {
      std::ofstream f(probe(global_rank));
      if (!f) throw ConfigError(fmt::format("checkpoint: cannot write '{}'", probe(global_rank).string()));
    }
    comm.barrier().wait();
    std::error_code ec;
    bool first = true;
    for (int k = 0; k < global_rank && first; ++k) first = !fs::exists(probe(k), ec);
    comm.barrier().wait();  // every rank has looked before any file goes
    fs::remove(probe(global_rank), ec);
    declarer = first ? 1 : 0;
    return first;
  };
  int64_t checkpointed_at = -1;  // global step of the last checkpoint written
  // The running epoch's sums (reset at each epoch's start) and its training time, without the evaluations and
  // checkpoints inside it; a resumed epoch starts from what its checkpoint saved.
  double loss_sum = 0, correct = 0, seen = 0;
  double epoch_t0 = 0, paused0 = 0, epoch_trained_before = 0;
  auto trained_s = [&] { return epoch_trained_before + now_s() - epoch_t0 - (untimed_s + checkpoint_s - paused0); };
  auto save_checkpoint = [&](int epoch, int64_t step, double acc) {
    if (!outputs) return;
    // Asynchronous schemes: nothing is in flight once every worker is here (pushes and pairwise averages complete
    // inside a step), so the saved server shards and replicas are one consistent state.
    // Their workers may be far apart (asynchronous schemes: a straggler's remaining steps), so they meet first with
    // the drift timeout (drift_timeout_s) as the deadline: before any collective with one (the copies' evaluation below
    // ran first, and a straggler's lag counted against timeout_s). The wait is training time, as a synchronous scheme's
    // wait for its straggler is (it was counted as the checkpoint's, and a run under --slow reported a fraction of its
    // time). Periodic schemes (local, diloco, easgd) too: their workers are up to a period apart between syncs (a
    // checkpoint mid-period met them at a barrier of one timeout, and a straggler bsp waits for failed it; a review).
    if (sopt && world > 1) sopt->await_workers();
    const double epoch_trained = trained_s();
    const double clock_at = elapsed();  // (what the checkpoint declares: the training clock, without this checkpoint)
    const double ck0 = now_s(), untimed0 = untimed_s;
    checkpointed_at = global_step;
    if (sopt) comm.barrier().wait();
    evaluate_snapshots();  // their accuracies and time to target belong to the checkpoint
    // Written whole into its own directory (checkpoint-<global step>), then `checkpoint` is switched to it by one
    // rename of a symbolic link: a run killed at any moment leaves `checkpoint` at a complete checkpoint, the last or
    // the one before (files overwritten in place could mix two steps or lose the only good one).
    // Always a directory of its own: a stage of this step already there (a run resumed from an older stage into the
    // same output reaches the step of the one `checkpoint` points at) was rewritten in place, the link at it all the
    // while, and a kill meanwhile left the link at a half-written checkpoint. The ranks agree on the name.
    std::string stage_name = fmt::format("checkpoint-{}", global_step);
    for (int k = 1;; ++k) {
      std::error_code ec;
      int64_t taken = fs::exists(fs::symlink_status(out / stage_name, ec)) ? 1 : 0;
      if (world > 1) comm.allreduce(&taken, 1, DType::i64, ReduceOp::max).wait();
      if (taken == 0) break;
      stage_name = fmt::format("checkpoint-{}.{}", global_step, k);
    }
    const fs::path stage = out / stage_name;
    fs::path mine = stage / fmt::format("rank-{}", global_rank);
    fs::create_directories(mine);
    {
      auto whole = whole_model();
      torch::serialize::OutputArchive a;
      model->save(a);
      a.save_to((mine / "model.pt").string());
    }
    {
      torch::serialize::OutputArchive a;
      optimizer->save(a);
      a.save_to((mine / "optimizer.pt").string());
    }
    if (dopt)
      write_bytes(mine / "compressor.bin", dopt->save_compressor_state());
    else
      write_bytes(mine / "sync.bin", sopt->save_state());
    nlohmann::json totals = totals_json(total_stats());
    if (step > 0) totals["epoch"] = epoch_sums_json(loss_sum, correct, seen, epoch_trained);
    write_json_file((mine / "totals.json").string(), totals);
    sync_tree(mine.string());  // on disk, not only in the page cache, before the checkpoint is declared
    comm.barrier().wait();     // every rank's files are complete before the checkpoint is declared
    // The checkpoint is declared on every file system that holds ranks' files, by the lowest rank there (rank 0 on
    // one the ranks share; one rank a node where nodes have their own), all with the same checkpoint.json: worker 0's
    // clock, time to target and accuracy (under schemes other than bsp worker 0 alone evaluates).
    double declared[3] = {clock_at, time_to_target, acc};
    if (world > 1) comm.broadcast(declared, 3, DType::f64, 0).wait();
    const bool declares = declares_checkpoints();
    if (declares) {
      nlohmann::json declaration = {{"epoch", epoch},
                                    {"step", step},
                                    {"global_step", global_step},
                                    {"world", comm_ptr->size()},
                                    // (the model the algorithms were chosen by, exactly: a resume chooses the same)
                                    {"cost_model", cost_model_json(comm_ptr->tuner().model())},
                                    {"model", c.model},
                                    {"compressor", c.compressor},
                                    {"sync", spec.name},
                                    {"sync_params", scheme_params(spec)},
                                    {"batch_size", c.batch_size},
                                    {"seed", c.seed},
                                    {"dataset", c.dataset},
                                    {"train_limit", c.train_limit},
                                    {"synthetic_samples", c.synthetic_samples},
                                    {"optimizer", c.optimizer},
                                    // (0 where the compressor owns the momentum; absent from checkpoints of before)
                                    {"optimizer_momentum", optimizer_momentum(c)},
                                    {"compress_min_bytes", c.compress_min_bytes},
                                    {"target_accuracy", c.target_accuracy},
                                    // the rest of the run's settings, a resume's defaults
                                    {"lr", c.lr},
                                    {"momentum", c.momentum},
                                    {"weight_decay", c.weight_decay},
                                    {"lr_schedule", c.lr_schedule},
                                    {"warmup_epochs", c.warmup_epochs},
                                    {"warmup_steps", warmup},  // (as this run rounded it: a resume keeps it)
                                    {"steps_per_epoch", spe},
                                    {"epochs", c.epochs},
                                    {"test_limit", c.test_limit},
                                    {"data_dir", c.data_dir},
                                    {"checkpoint_every", c.checkpoint_every},
                                    {"eval_every", c.eval_every},
                                    {"bucket_cap_mb", c.bucket_cap_mb},
                                    {"first_bucket_mb", c.first_bucket_mb},
                                    {"overlap", c.overlap},
                                    {"zero", c.zero},
                                    {"tp", c.tp},
                                    {"pp", c.pp},
                                    {"stage_bounds", cut},
                                    {"micro_batches", c.micro_batches},
                                    {"pp_schedule", c.pp_schedule},
                                    {"recompute", c.recompute},
                                    {"sequence_parallel", c.sequence_parallel},
                                    {"wall_s", declared[0]},
                                    {"time_to_target_s", declared[1]},
                                    {"test_accuracy", declared[2]}};
      // What a mid-epoch resume must train on (data_dir above is the folder as given, maybe relative).
      if (file_data) {
        declaration["data_dir_resolved"] = data_dir_resolved;
        declaration["train_data"] = data_id;
      }
      if (c.zero > 0) declaration["zero_prefetch"] = c.zero_prefetch;  // (a setting of stages 1-3 only)
      if (c.zero == 3) declaration["zero_gather"] = c.zero_gather;
      if (c.zero == 3) declaration["zero_hpz"] = c.zero_hpz;
      if (c.zero > 0) declaration["zero_shard_group"] = c.zero_shard_group;
      if (c.zero == 1 || c.zero == 2) declaration["zero_allgather_mb"] = c.zero_allgather_mb;
      if (c.zero >= 2 && c.micro_batches > 1) declaration["zero_reduce"] = c.zero_reduce;
      write_json_file((stage / "checkpoint.json").string(), declaration);
      sync_path((stage / "checkpoint.json").string());
      sync_path(stage.string());
      switch_checkpoint(out, stage_name, global_rank);
    }
    // Every file system's link is at this checkpoint before any removes its older stages: a run stopped in between
    // leaves every node the previous checkpoint (a resume whose ranks find links at two steps names it).
    comm.barrier().wait();
    if (declares) remove_old_stages(out, stage_name);
    checkpoint_s += now_s() - ck0 - (untimed_s - untimed0);  // the copies' evaluation counts as evaluation
  };

  TrainResult res;
  res.test_accuracy = last_acc;
  // Evaluates (collectively under bsp, on worker 0 alone otherwise) and times the first reach of the target.
  auto run_eval = [&]() -> std::pair<double, double> {
    if (!evaluates) return {0, 0};
    const double t0 = now_s(), at = elapsed();
    auto whole = whole_model();
    auto r = evaluate(*model, data.test, eval_comm, pipe.get());
    untimed_s += now_s() - t0;
    if (c.target_accuracy > 0 && time_to_target < 0 && r.first >= c.target_accuracy) time_to_target = at;
    return r;
  };
  bool stop = global_step >= total_steps;
  int epoch = start_epoch;
  int64_t end_epoch_pos = start_epoch, end_step_pos = start_step;  // where training stopped (final checkpoint)
  for (; epoch < c.epochs && !stop; ++epoch) {
    // max_steps reached exactly at the end of the last epoch: no epoch of zero steps (its record said train loss 0,
    // and summary.json took it as the final one).
    if (global_step >= total_steps) {
      stop = true;
      break;
    }
    sampler.set_epoch(epoch);
    ProgressBar bar(epoch + 1, c.epochs, spe, lead && c.progress && outputs);
    const bool resumed_inside = epoch == start_epoch && start_step > 0;
    loss_sum = resumed_inside ? resumed_epoch[0] : 0;
    correct = resumed_inside ? resumed_epoch[1] : 0;
    seen = resumed_inside ? resumed_epoch[2] : 0;
    epoch_trained_before = resumed_inside ? resumed_epoch[3] : 0;
    epoch_t0 = now_s();
    paused0 = untimed_s + checkpoint_s;  // evaluations and checkpoints inside the epoch: not training
    int64_t step = epoch == start_epoch ? start_step : 0;
    for (; step < spe; ++step) {
      if (global_step >= total_steps) {
        stop = true;
        break;
      }
      const double lr = lr_at(c, global_step, total_steps, warmup);
      set_lr(*optimizer, c.optimizer, lr);
      if (dopt)
        dopt->zero_grad();
      else
        sopt->zero_grad();
      if (tpg) tpg->payload_bytes = 0, tpg->comm_ns = 0;  // (evaluations between steps are not training's bytes)
      if (pipe) pipe->take_stats();                       // (nor are their activations)
      torch::Tensor x, y;
      make_batch(data.train, sampler.batch(step, c.batch_size), x, y);
      straggler.begin();
      const double f0 = now_s();
      double l = 0, corr = 0;  // the batch's mean loss and correct predictions
      double f1 = f0;
      if (pipe) {
        const auto r = pipe->train_step(x, y, c.micro_batches);
        l = r.loss;
        corr = r.correct;
        f1 = now_s();
      } else {
        auto logits = model->forward(x);
        auto loss = torch::nn::functional::cross_entropy(logits, y);
        f1 = now_s();
        loss.backward();
        l = loss.item<float>();
        corr = double(logits.argmax(1).eq(y).sum().item<int64_t>());
      }
      const double f2 = now_s();
      const double slept = straggler.end();
      if (pipe) {  // (its micro-batches' forward and backward events are its own)
        trace.complete("pipeline step", 0, f0, f2, {{"step", global_step}, {"micro_batches", c.micro_batches}});
      } else {
        trace.complete("forward", 0, f0, f1, {{"step", global_step}});
        trace.complete("backward", 0, f1, f2, {{"step", global_step}});
      }
      // Every slowed step, also when waiting for a core already took its whole slowdown (a 0 s sleep).
      if (straggler.slowed())
        trace.complete("straggler sleep", 0, f2, f2 + slept, {{"factor", straggler.factor()}});
      StepStats mp_step;  // this step's tensor-parallel collectives and pipeline transfers (on this thread)
      if (tpg) {
        const uint64_t b = tpg->payload_bytes.exchange(0);
        const double s = double(tpg->comm_ns.exchange(0)) * 1e-9;
        // Ring-equivalent volume, as the gradient exchange counts; sent whatever the compressor, so in raw_bytes too.
        mp_step.bytes_sent = mp_step.bytes_recv = mp_step.raw_bytes = uint64_t(2.0 * (tp - 1) / tp * double(b) + 0.5);
        mp_step.comm_s = mp_step.exposed_comm_s = s;
        mp_step.compute_s = -s;  // (inside forward and backward, which the step's compute time spans)
      }
      if (pipe) {
        // What this stage sent and received, and its time blocked on the other stages (transfers and the bubble).
        const PipeStats ps = pipe->take_stats();
        StepStats pst;
        pst.bytes_sent = pst.raw_bytes = ps.bytes_sent;
        pst.bytes_recv = ps.bytes_recv;
        pst.comm_s = pst.exposed_comm_s = ps.wait_s;
        pst.compute_s = -ps.wait_s;
        mp_step += pst;
        pipe_peak = std::max(pipe_peak, ps.peak_in_flight);
      }
      if (dopt) {
        dopt->step();
        // Buffers that the forward updates (BatchNorm's running statistics) follow each rank's own data: rank 0's
        // are sent to the others after every step (PyTorch DDP sends them before every forward; after the step, the
        // ranks also evaluate and checkpoint one model). Without this, ResNet's ranks drifted apart: the test
        // accuracy mixed their statistics and resume was not bit for bit on ranks > 0. Counted as the step's
        // traffic, all of it exposed (it was left out, 43% of a compressed ResNet step's bytes): (W-1)/W of it
        // each way a rank, as the allreduce's ring-equivalent volume, so that the ranks' sum is the (W-1) copies a
        // broadcast moves (each rank counted the whole: one copy a step too many, 18% of a 2-rank top-k ResNet's).
        if (sync_buffers) {
          const double b0 = now_s();
          StepStats bst;
          const uint64_t w = uint64_t(dopt->comm().size());
          bst.bytes_sent = bst.bytes_recv = bst.raw_bytes = broadcast_buffers(*model, dopt->comm()) * (w - 1) / w;
          bst.comm_s = bst.exposed_comm_s = now_s() - b0;
          mp_step += bst;
        }
        if (tpg || pipe || sync_buffers) dopt->add_to_totals(mp_step);
      } else {
        sopt->step(uint64_t(global_step), lr);
      }
      ++global_step;
      if (!std::isfinite(l))
        throw Error(
            fmt::format("train: the training loss is {} at step {} on rank {}: the run diverged; allowed: a "
                        "smaller lr, a warm-up (warmup_epochs) or a less aggressive compressor",
                        l, global_step, global_rank));
      loss_sum += l * double(x.size(0));
      correct += corr;
      seen += double(x.size(0));
      StepStats st = last_stats();
      st += mp_step;
      const double dt = trained_s();
      const double sps = dt > 0 ? seen * data_world / dt : 0;  // (the epoch's, a resumed part included)
      if (metrics) {
        nlohmann::json j = {{"kind", "step"}, {"epoch", epoch + 1}, {"step", step + 1},   {"global_step", global_step},
                            {"loss", l},      {"lr", lr},           {"time_s", elapsed()}};
        j.update(st.to_json());
        metrics->write(j);
      }
      bar.update(step + 1, loss_sum / seen, correct / seen, sps, double(total_stats().bytes_sent) / 1e6);
      if (c.eval_every > 0 && global_step % c.eval_every == 0 && step + 1 < spe && global_step < total_steps) {
        const double g0 = now_s();
        auto whole = whole_model();  // (every rank: a collective at stage 3; not training time)
        untimed_s += now_s() - g0;
        if (data_lead) snapshots.push_back({epoch, global_step, elapsed(), total_stats().bytes_sent, model_state()});
      }
      if (c.checkpoint_every > 0 && global_step % c.checkpoint_every == 0 && step + 1 < spe)
        save_checkpoint(epoch, step + 1, res.test_accuracy);
    }
    const bool epoch_done = step >= spe;
    end_epoch_pos = epoch_done ? epoch + 1 : epoch;
    end_step_pos = epoch_done ? 0 : step;
    // Schemes other than bsp with eval_every: a snapshot, so worker 0 does not stop while the others go on.
    const bool snapshot_epoch = sopt && c.eval_every > 0;
    // The epoch's training throughput, before the evaluation below (which took part of it: 16,405 samples/s reported
    // against 30,355 trained), without the checkpoints and copy evaluations inside it (8,611 against 41,672).
    const double dt = trained_s();
    // bsp: the epoch's training loss and accuracy over every rank's samples (they were rank 0's half alone); the
    // other schemes' workers are not in step here, so theirs stay the worker's own.
    // (Reported from copies: the rank's own sums stay, for a checkpoint after the loop that ends inside the epoch.)
    double ep_loss = loss_sum, ep_correct = correct, ep_seen = seen;
    if (dopt && world > 1) {
      double sums[3] = {loss_sum, correct, seen};
      comm.allreduce(sums, 3, DType::f64, ReduceOp::sum).wait();
      ep_seen = sums[2] / world;  // samples per rank, as the throughput below multiplies by world
      ep_loss = sums[0] / world;
      ep_correct = sums[1] / world;
    }
    double acc = std::numeric_limits<double>::quiet_NaN(), test_loss = acc;
    if (!snapshot_epoch) {
      std::tie(acc, test_loss) = run_eval();
      res.test_accuracy = acc;
      // Worker 0 evaluated alone: the others, in step with it, met it at their next exchange under the collectives'
      // deadline, which a long evaluation outlasts (--timeout-s). They meet it here, up to drift_timeout_s. (Drifting
      // schemes' workers are not in step; they meet at checkpoints and the end.)
      if (sopt && world > 1 && !sopt->workers_drift()) sopt->await_workers();
    } else if (data_lead && (snapshots.empty() || snapshots.back().global_step != global_step)) {
      snapshots.push_back({epoch, global_step, elapsed(), total_stats().bytes_sent, model_state()});
    }
    res.train_loss = ep_seen > 0 ? ep_loss / ep_seen : 0;
    const auto& tot = total_stats();
    if (metrics) {
      metrics->write({{"kind", "epoch"},
                      {"epoch", epoch + 1},
                      {"complete", epoch_done},
                      {"train_loss", res.train_loss},
                      {"train_accuracy", ep_seen > 0 ? ep_correct / ep_seen : 0},
                      {"test_accuracy", acc},
                      {"test_loss", test_loss},
                      {"samples_per_s", dt > 0 ? ep_seen * data_world / dt : 0},
                      {"time_s", elapsed()},
                      {"bytes_sent", tot.bytes_sent},
                      {"raw_bytes", tot.raw_bytes},
                      {"comm_s", tot.comm_s},
                      {"exposed_comm_s", tot.exposed_comm_s},
                      {"compute_s", tot.compute_s}});
    }
    // (a run stopped inside the epoch by max_steps said "done" too)
    bar.finish(
        fmt::format("epoch {}/{} {}: train loss {:.4f} acc {:.1f}%, test acc {}, {:.0f} samples/s, "
                    "{:.1f} MB sent, {:.1f} s",
                    epoch + 1, c.epochs, epoch_done ? "done" : fmt::format("stopped at step {} of {}", step, spe),
                    res.train_loss, ep_seen > 0 ? 100 * ep_correct / ep_seen : 0,
                    std::isnan(acc) ? std::string("after training (snapshot)") : fmt::format("{:.2f}%", 100 * acc),
                    dt > 0 ? ep_seen * data_world / dt : 0, double(tot.bytes_sent) / 1e6, elapsed()));
    // bsp checkpoints at every epoch end; other schemes only where asked (a checkpoint is a barrier) and at the end.
    if (epoch_done && dopt) save_checkpoint(epoch + 1, 0, acc);
    if (epoch_done && sopt && c.checkpoint_every > 0 && global_step % c.checkpoint_every == 0)
      save_checkpoint(epoch + 1, 0, res.test_accuracy);
    if (epoch_done) res.epochs = epoch + 1;
  }
  // Epochs completed, counting those before a resume (a run stopped inside its first epoch reported 1).
  res.epochs = int(end_epoch_pos);
  // bsp checkpoints at epoch ends (and every checkpoint_every steps); a run that wrote none (--max-steps stopped it in
  // its first epoch) ends with one, so it can be resumed. One that did keeps its last: a later one would overwrite
  // the epoch-end state a resume with the same schedule continues from.
  if (dopt && checkpointed_at < 0 && global_step > start_global_step)
    save_checkpoint(int(end_epoch_pos), end_step_pos, res.test_accuracy);
  // (said: the run reported its last step while its checkpoint held an earlier one, without a word)
  else if (dopt && outputs && lead && checkpointed_at >= 0 && checkpointed_at < global_step)
    fmt::print(stderr,
               "train: note: the checkpoint holds step {} (bsp keeps its last epoch end or checkpoint_every step): "
               "the {} step(s) after it are not in it, and a resume continues from step {}\n",
               checkpointed_at, global_step - checkpointed_at, checkpointed_at);
  if (sopt) {
    // The state to continue from is the one before the scheme's last word (local SGD's final average, the servers'
    // stop): a resumed run goes on exactly as an uninterrupted one would have.
    if (checkpointed_at != global_step && global_step > start_global_step)
      save_checkpoint(int(end_epoch_pos), end_step_pos, res.test_accuracy);
    // Then the scheme's last word and worker 0's final accuracy for all. Asynchronous workers end apart (a
    // straggler's remaining steps, which the collectives' timeout does not bound): they meet first, up to
    // drift_timeout_s.
    if (sopt->workers_drift()) sopt->await_workers();
    sopt->finish();
    double acc[2] = {0, 0};
    if (lead) std::tie(acc[0], acc[1]) = run_eval();
    if (world > 1) sopt->await_workers();  // (as at an epoch's end: worker 0's evaluation, up to drift_timeout_s)
    if (world > 1) comm.broadcast(acc, 2, DType::f64, 0).wait();
    res.test_accuracy = acc[0];
    if (metrics)
      metrics->write({{"kind", "final"}, {"test_accuracy", acc[0]}, {"test_loss", acc[1]}, {"time_s", elapsed()}});
  }

  const double wall = elapsed();
  evaluate_snapshots();
  const auto& tot = total_stats();
  res.wall_s = wall;
  res.time_to_target_s = time_to_target;
  res.steps = global_step;
  res.bytes_sent = tot.bytes_sent;
  res.bytes_recv = tot.bytes_recv;
  res.raw_bytes = tot.raw_bytes;
  res.payload_bytes = tot.payload_bytes;
  res.grad_bytes = tot.grad_bytes;
  res.compute_s = tot.compute_s;
  res.comm_s = tot.comm_s;
  res.exposed_comm_s = tot.exposed_comm_s;
  // Bytes on the wire, summed over the workers: what they sent, plus for parameter servers what the servers sent
  // them (the pulls; a server's sends are its workers' receives, and co-located shards' own traffic never leaves).
  uint64_t sums[2] = {tot.bytes_sent + (spec.parameter_server() ? tot.bytes_recv : 0), tot.raw_bytes};
  if (world > 1) comm.allreduce(sums, 2, DType::i64, ReduceOp::sum).wait();
  res.world_bytes_sent = sums[0];
  res.world_raw_bytes = sums[1];
  if (dopt) res.buckets = dopt->bucket_layout();
  res.optimizer_state_bytes = optimizer_state_bytes(*optimizer);
  res.pipeline_peak_micro_batches = pipe_peak;
  if (dopt) {
    res.optimizer_elements = dopt->optimizer_elements();
    res.gradient_bytes_held = dopt->gradient_bytes_held();
    res.parameter_bytes_held = dopt->parameter_bytes_held();
  }
  auto whole = wo.keep_params ? whole_model() : nullptr;
  // (of the parameters bucket_layout() indexes: a frozen or tied one offset every index after it)
  for (auto& [name, p] : trainable_parameters(*model)) res.param_numel.push_back(size_t(p.numel()));
  if (wo.keep_params) {
    for (auto& p : model->parameters()) {
      auto f = p.detach().contiguous().view(-1);
      res.params.insert(res.params.end(), f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
    }
    for (auto& b : model->buffers()) {
      if (!b.is_floating_point()) continue;
      auto f = b.detach().to(torch::kFloat).contiguous().view(-1);
      res.buffers.insert(res.buffers.end(), f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
    }
  }
  if (outputs && c.trace) trace.close();
  if (outputs && lead) {
    write_json_file(
        (out / "summary.json").string(),
        {{"model", c.model},
         {"dataset", c.dataset},
         {"compressor", c.compressor},
         {"sync", spec.to_string()},
         {"slow", c.slow},
         {"workers", world},
         {"tp", tp},  // ranks a tensor-parallel group; pp of them a pipeline; the replicas, data_parallel, share
         {"pp", pp},  // out the data
         // the first unit of each stage of the mlp, cnn or resnet, then their count (null: the vit, or pp 1)
         {"stage_bounds", cut},
         {"micro_batches", c.micro_batches},
         {"pp_schedule", c.pp_schedule},
         {"recompute", c.recompute},
         {"sequence_parallel", c.sequence_parallel},
         {"zero_prefetch", c.zero > 0 ? nlohmann::json(c.zero_prefetch) : nlohmann::json()},
         {"zero_gather", c.zero == 3 ? nlohmann::json(c.zero_gather) : nlohmann::json()},
         {"zero_hpz", c.zero == 3 ? nlohmann::json(c.zero_hpz) : nlohmann::json()},
         {"zero_shard_group", c.zero > 0 ? nlohmann::json(c.zero_shard_group) : nlohmann::json()},
         {"zero_allgather_mb", c.zero == 1 || c.zero == 2 ? nlohmann::json(c.zero_allgather_mb) : nlohmann::json()},
         {"zero_reduce", c.zero >= 2 && c.micro_batches > 1 ? nlohmann::json(c.zero_reduce) : nlohmann::json()},
         // the most micro-batches whose activations rank 0 (the first stage: it holds the most) kept at once
         {"pipeline_peak_micro_batches_rank0",
          pipe ? nlohmann::json(res.pipeline_peak_micro_batches) : nlohmann::json()},
         {"data_parallel", data_world},
         {"ranks", comm_ptr->size()},
         {"epochs", res.epochs},
         {"steps", res.steps},
         {"batch_size", c.batch_size},
         {"final_test_accuracy", res.test_accuracy},
         // null when this run trained no step (a resume of a finished run): there is no loss of its own to report
         {"final_train_loss", global_step > start_global_step ? nlohmann::json(res.train_loss) : nlohmann::json()},
         {"wall_time_s", res.wall_s},
         {"evaluation_s", untimed_s},
         {"checkpoint_s", checkpoint_s},
         {"target_accuracy", c.target_accuracy > 0 ? nlohmann::json(c.target_accuracy) : nlohmann::json()},
         {"time_to_target_s", time_to_target >= 0 ? nlohmann::json(time_to_target) : nlohmann::json()},
         {"bytes_on_wire", res.world_bytes_sent},
         {"uncompressed_bytes", res.world_raw_bytes},
         {"bytes_on_wire_rank0", res.bytes_sent},
         // Rank 0's gradient bytes over the compressed payloads it sent (for parameter servers: its pushes; the
         // pulls are in bytes_on_wire); null when it sent none (e.g. a period longer than the run).
         // (and null with nothing on the wire: one worker reported 1.0 for an exchange that never happened; and with
         // one data-parallel replica, whose model-parallel traffic made the wire non-empty: tp 2 or pp 2 on 2 workers)
         {"compression_ratio", res.payload_bytes && res.world_bytes_sent && data_world > 1
                                   ? nlohmann::json(double(res.grad_bytes) / double(res.payload_bytes))
                                   : nlohmann::json()},
         {"compute_s", res.compute_s},
         {"comm_s", res.comm_s},
         {"exposed_comm_s", res.exposed_comm_s},
         {"zero", c.zero},
         // rank 0's: what ZeRO partitions (sgd's momentum, adam's moments) and the gradient memory it keeps
         {"optimizer_state_bytes_rank0", res.optimizer_state_bytes},
         {"optimizer_elements_rank0", dopt ? nlohmann::json(res.optimizer_elements) : nlohmann::json()},
         {"gradient_bytes_held_rank0", dopt ? nlohmann::json(res.gradient_bytes_held) : nlohmann::json()},
         {"parameter_bytes_held_rank0", dopt ? nlohmann::json(res.parameter_bytes_held) : nlohmann::json()},
         // rank 0's process at its largest (resident set): with pp, what its schedule and recompute keep
         {"max_rss_mb_rank0", max_rss_mb()},
         // null with nothing on the wire (one worker's local bookkeeping read as 93% hidden)
         {"hidden_comm_fraction", res.comm_s > 0 && res.world_bytes_sent
                                      ? nlohmann::json(std::clamp(1.0 - res.exposed_comm_s / res.comm_s, 0.0, 1.0))
                                      : nlohmann::json()}});
  }
  return res;
}

}  // namespace conduit::train
