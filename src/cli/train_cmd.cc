// `conduit train [--config FILE.yaml] [--model M] [--workers N] ...`: data-parallel training on libtorch.
// Under mpirun or with torchrun's environment (RANK/WORLD_SIZE) this process is one worker; otherwise it starts
// `workers` local workers through the launcher (cli/launcher.h), each running `conduit train --config
// <output>/config.yaml`, and prints the summary when they are done.
#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli/launcher.h"
#include "cli/registry.h"
#include "cli/torch_plugin.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "core/expiry.h"
#include "core/files.h"
#include "net/mpi_transport.h"
#include "torch/config.h"
#ifdef CONDUIT_WITH_COMPRESS
#include "compress/compressor.h"
#endif
#include "torch/metrics.h"
#include "torch/stages.h"
#include "torch/trainer.h"

namespace conduit::cli {
namespace {

namespace tr = conduit::train;
namespace fs = std::filesystem;

struct TrainArgs {
  std::string config;
  std::map<std::string, std::string> flags;  // key -> value as given
};

std::string self_exe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("conduit") : p.string();
}

void print_summary(const std::string& out) {
  fs::path p = fs::path(out) / "summary.json";
  if (!fs::exists(p)) return;
  auto s = tr::read_json_file(p.string());
  std::string tta = s["target_accuracy"].is_null()    ? std::string("not set")
                    : s["time_to_target_s"].is_null() ? std::string("not reached")
                                                    : fmt::format("{:.1f} s", s["time_to_target_s"].get<double>());
  const std::string hidden = s.contains("hidden_comm_fraction") && s["hidden_comm_fraction"].is_number()
                                 ? fmt::format("{:.0f}%", 100 * s["hidden_comm_fraction"].get<double>())
                                 : std::string("none (nothing sent)");
  // Tensor-parallel groups, pipelines and the ZeRO stage, where the run has them.
  std::string layout;
  const int tp = s.value("tp", 1), pp = s.value("pp", 1), replicas = s.value("data_parallel", 0);
  const char* plural = replicas == 1 ? "" : "s";
  const std::string sp = s.value("sequence_parallel", false) ? ", sequence parallel" : "";
  if (tp > 1 && pp > 1)
    layout += fmt::format(" (tp {} x pp {}: {} pipeline{})", tp, pp, replicas, plural);
  else if (tp > 1)
    layout += fmt::format(" (tp {}{}: {} group{})", tp, sp, replicas, plural);
  else if (pp > 1)
    layout += fmt::format(" (pp {}: {} pipeline{})", pp, replicas, plural);
  if (s.value("micro_batches", 1) > 1)
    layout += fmt::format(", {} micro-batches{}", s.value("micro_batches", 1),
                          pp > 1 ? " " + s.value("pp_schedule", std::string()) : std::string());
  if (s.value("zero", 0) > 0) layout += fmt::format(", zero {}", s.value("zero", 0));
  std::printf(
      "conduit train: %s on %s, %d worker%s%s, sync %s, compressor %s: test accuracy %.2f%% after %lld steps (%d "
      "complete epoch%s) in %.1f s; time to target %s; %.1f MB on the wire (uncompressed %.1f MB); communication "
      "hidden %s; output %s\n",
      s.value("model", std::string()).c_str(), s.value("dataset", std::string()).c_str(), s.value("workers", 0),
      s.value("workers", 0) == 1 ? "" : "s", layout.c_str(), s.value("sync", std::string("bsp")).c_str(),
      s.value("compressor", std::string()).c_str(), 100 * s.value("final_test_accuracy", 0.0),
      static_cast<long long>(s.value("steps", 0LL)), s.value("epochs", 0), s.value("epochs", 0) == 1 ? "" : "s",
      s.value("wall_time_s", 0.0), tta.c_str(), s.value("bytes_on_wire", 0.0) / 1e6,
      s.value("uncompressed_bytes", 0.0) / 1e6, hidden.c_str(), out.c_str());
}

// One worker's time limit, kept in its own process: at the limit it says so on stderr (one write, not through stdio,
// whose lock a main thread blocked on a full stdout pipe holds) and ends the process with 124, as the launcher does
// for several workers (time stopped by Ctrl-Z does not count, as for the launcher). Said only where stderr has room
// within a second (a full pipe it shares with a blocked stdout would hold the write, and the exit, for ever);
// stdout's buffered lines are left.
[[noreturn]] void stop_single_worker(double limit_s) {
  const std::string line =
      fmt::format("conduit train: 1 worker still running at time_limit_s {:g} s; stopping it\n", limit_s);
  pollfd p{2, POLLOUT, 0};
  if (::poll(&p, 1, 1000) == 1 && (p.revents & POLLOUT) != 0) {
    [[maybe_unused]] const ssize_t w = ::write(2, line.data(), line.size());  // (under PIPE_BUF: whole)
  }
  std::_Exit(124);  // (as timeout(1); no checkpoint is written, as for the workers the launcher stops)
}

void run_train(const TrainArgs& a) {
  tr::RawConfig raw;
  if (!a.config.empty()) raw = tr::read_yaml_config(a.config);
  for (auto& [k, v] : a.flags) raw[k] = v;
  const int env_world = net::mpi_launched() ? std::max(env_world_size(), 1) : env_world_size();
  nlohmann::json resume_meta;  // (the checkpoint's checkpoint.json, read once)
  tr::apply_resume_defaults(raw, env_world > 0, &resume_meta);
  const bool workers_given = raw.count("workers") > 0;
  tr::TrainConfig cfg = tr::resolve_config(raw, env_world, workers_given);
  tr::check_dataset(cfg);
  tr::check_sync_config(cfg);
  // A new run into a folder that holds an earlier run's checkpoint: its metrics would be replaced while the
  // checkpoint stayed, and a later --resume of the folder would continue the earlier run under this one's records.
  if (cfg.resume.empty() && !cfg.output.empty()) {
    const fs::path ck = fs::path(cfg.output) / "checkpoint";
    std::error_code ec;
    if (fs::exists(fs::symlink_status(ck, ec)))
      throw ConfigError(
          fmt::format("config: output: '{}' holds an earlier run's checkpoint; allowed: resume it "
                      "(--resume {}), another --output, or remove the folder first",
                      cfg.output, ck.string()));
  }
  // A resume into another run's folder: its metrics were trimmed at this run's step and this run's appended after
  // them, and its checkpoint stages removed (an audit). The resumed run's own folder (the checkpoint's) continues, and
  // so does a folder an earlier resume from the same checkpoint wrote (a retried job redoes its work: its config.yaml
  // names that checkpoint).
  if (!cfg.resume.empty() && !cfg.output.empty()) {
    std::error_code own_ec, out_ec, ec;
    const fs::path own = fs::weakly_canonical(fs::path(cfg.resume), own_ec).parent_path();
    const fs::path out = fs::weakly_canonical(fs::path(cfg.output), out_ec);
    const fs::path ck = fs::path(cfg.output) / "checkpoint";
    const bool holds_checkpoint = fs::exists(fs::symlink_status(ck, ec));
    const bool holds_records = holds_checkpoint || fs::exists(fs::path(cfg.output) / "metrics.jsonl", ec);
    auto normal = [](const std::string& p) {
      std::string s = fs::absolute(fs::path(p)).lexically_normal().string();
      while (s.size() > 1 && s.back() == '/') s.pop_back();
      return s;
    };
    auto same_resume = [&] {
      try {
        const auto prior = tr::read_yaml_config((fs::path(cfg.output) / "config.yaml").string());
        const auto it = prior.find("resume");
        return it != prior.end() && !it->second.empty() && normal(it->second) == normal(cfg.resume);
      } catch (const std::exception&) {
        return false;  // (no config.yaml, or not one a run wrote)
      }
    };
    if (!own_ec && !out_ec && own != out && holds_records && !same_resume())
      throw ConfigError(fmt::format(
          "config: output: '{}' holds another run's records (its {}), and --resume continues the run in '{}'; "
          "allowed: {}--output {} (the resumed run's own folder), a new folder, or remove it first",
          cfg.output, holds_checkpoint ? "checkpoint" : "metrics.jsonl", own.string(),
          holds_checkpoint ? fmt::format("--resume {} (that folder's own run), ", ck.string()) : std::string(),
          own.string()));
  }
  // (the batch is per training worker: dedicated servers hold no share of the data; notes once: by a single process
  // or the first rank, not by a launching parent and every worker)
  const char* rank_text = net::mpi_launched() ? nullptr : std::getenv("RANK");  // (torchrun's workers: RANK)
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (!rank_text && net::mpi_launched()) rank_text = std::getenv(v);
  const bool notes = env_world > 0 ? rank_text && std::string(rank_text) == "0" : cfg.workers == 1;
  torch_api().check_model_config(cfg, tr::training_workers(cfg), notes);
  // A resume that its checkpoint refuses stops here once, not in every worker after each has loaded libtorch and its
  // data (the workers check their own copies again: under mpirun each node may hold one of its own).
  if (!cfg.resume.empty() && env_world == 0) {
    // (as the workers do: a missing world was "0 ranks")
    tr::check_checkpoint_fields(resume_meta, fs::path(cfg.resume), true);
    tr::check_resume_against(resume_meta, cfg, cfg.workers);
  }
  // (each worker loaded libtorch and its data, then failed saying only that mpi needs mpirun)
  if (cfg.transport == "mpi" && !net::mpi_launched())
    throw ConfigError(fmt::format(
        "config: transport: mpi needs the workers started by mpirun, and {}; allowed: auto, tcp or shm, or the run "
        "under mpirun (mpirun -n {} conduit train ...)",
        env_world > 0 ? "this worker was started by another launcher"
                      : fmt::format("this run starts its own {}",
                                    cfg.workers == 1 ? "worker" : fmt::format("{} workers", cfg.workers)),
        cfg.workers));
  // The whole run's deadline is kept by the process that starts the workers (its launcher, which does not write it
  // into the workers' config.yaml): a worker started by another launcher cannot stop its peers.
  if (cfg.time_limit_s > 0 && env_world > 0)
    throw ConfigError(fmt::format(
        "config: time_limit_s: {:g} s is kept by conduit train's own launcher, and this process is one worker of "
        "another (mpirun, torchrun, conduit launch); allowed: that launcher's own limit (mpirun --timeout, conduit "
        "launch --timeout), or time_limit_s 0",
        cfg.time_limit_s));
#ifdef CONDUIT_WITH_COMPRESS
  // A compressor set to send more than the gradient itself (a sparsifier keeping over half of the values, each with
  // its index; a quantizer with a scale every element or two) is legal but defeats its purpose: said once.
  // (after every refusal: a refused run says one line; and not with one data-parallel rank, which sends nothing and
  // is warned of that)
  const bool one_bsp_rank = tr::effective_sync(cfg).bsp() && cfg.workers / std::max(1, cfg.tp * cfg.pp) == 1;
  if (notes && !one_bsp_rank && cfg.compressor != "none" && tr::zero_int_wire(cfg.compressor).bits != 4) {
    const auto comp = compress::parse_compressor(cfg.compressor);
    compress::TensorState st;
    st.shape = {1024, 1024};
    const size_t n = size_t{1024} * 1024, plain = n * 4;
    // A payload whose size depends on the data (threshold, qsgd's Elias codes) is measured on Gaussian values of a
    // gradient's usual scale (standard deviation 0.001, a fixed seed).
    size_t wire = 0;
    if (comp->fixed_size()) {
      wire = comp->wire_bytes(n, st);
    } else {
      std::mt19937 g(1);
      std::normal_distribution<float> nd(0.0f, 0.001f);
      std::vector<float> x(n);
      for (auto& v : x) v = nd(g);
      wire = comp->compress(x, st).size();
    }
    if (wire > plain)
      std::fprintf(stderr,
                   "train: warning: compressor %s sends %.2f MB for a 1024 x 1024 f32 gradient%s, more than its %.2f "
                   "MB uncompressed (compressor none)\n",
                   cfg.compressor.c_str(), wire / 1e6, comp->fixed_size() ? "" : " of Gaussian values (sd 0.001)",
                   plain / 1e6);
  }
#endif
  // One worker runs in this process, and keeps its deadline itself (through the launcher it lost its terminal's
  // progress bar and gained a rank prefix and a TCP store); it ends with this function.
  std::optional<ExpiryThread> deadline;
  if (env_world == 0 && cfg.workers == 1 && cfg.time_limit_s > 0)
    deadline.emplace(cfg.time_limit_s, [limit_s = cfg.time_limit_s] { stop_single_worker(limit_s); });

  if (env_world > 0 || cfg.workers == 1) {
    // This process is one worker.
    coll::CommConfig cc;
    cc.timeout_s = cfg.timeout_s;
    cc.transport = cfg.transport == "auto" ? "" : cfg.transport;
    auto comm = coll::Communicator::from_env(cc);
    if (comm->size() != cfg.workers)
      throw ConfigError(fmt::format("config: workers: {} does not match the {} ranks found in the environment",
                                    cfg.workers, comm->size()));
    // Every rank named the default output directory from its own clock: rank 0's name is taken, so the ranks' files
    // meet (ranks started either side of a second wrote two directories, and a resume found rank 1's files missing).
    if (!raw.count("output") && comm->size() > 1) {
      int64_t n = static_cast<int64_t>(cfg.output.size());
      comm->broadcast(&n, 1, DType::i64, 0).wait();
      if (n < 1 || n > 4096)
        throw ProtocolError(fmt::format("config: output: rank 0's default directory name is {} bytes", n));
      std::string name = comm->rank() == 0 ? cfg.output : std::string(static_cast<size_t>(n), '\0');
      comm->broadcast(name.data(), name.size(), DType::u8, 0).wait();
      cfg.output = name;
    }
    torch_api().train_worker(cfg, comm, tr::WorkerOptions{});
    deadline.reset();  // (the run is over: its summary is not cut short)
    // Under mpirun/torchrun rank 0 prints the summary; under our own launcher the parent does.
    if (comm->rank() == 0 && !std::getenv("CONDUIT_TRAIN_PARENT")) print_summary(cfg.output);
    return;
  }

  // Start the workers: they read the resolved configuration from the output directory.
  make_output_dir(cfg.output, "--output");
  fs::path cfg_path = fs::path(cfg.output) / "config.yaml";
  // (whole or not at all, and its failure named: a full disk's failed flush went unnoticed, and the workers could read
  // a truncated file, taking defaults for the keys cut off)
  try {
    write_text_file(cfg_path.string(), tr::config_to_yaml(cfg));
  } catch (const Error& e) {
    throw ConfigError(fmt::format("config: {}", e.what()));  // (it names the file)
  }
  LaunchSpec spec;
  spec.nprocs = cfg.workers;
  spec.command = {self_exe(), "train", "--config", cfg_path.string()};
  spec.name = "conduit train";
  spec.timeout_seconds = cfg.time_limit_s;
  spec.timeout_name = "time_limit_s";
  // One intra-op thread per worker: the workers share the cores.
  spec.extra_env = {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}, {"CONDUIT_TRAIN_PARENT", "1"}};
  if (cfg.transport != "auto") spec.extra_env.push_back({"CONDUIT_TRANSPORT", cfg.transport});
  if (cfg.pp > 1 && cfg.model != "vit") {
    // The stages' forward work, for the binding: bound k mod C, 2 pipelines of the cnn on 2 cores put both heavy
    // first stages (the convolutions, 90% of the work) on one core and took 1.5x the unbound time. (The vit's stages
    // are near-equal.) Rank k is stage k mod pp (tp is 1 for these models).
    const auto work = tr::stage_costs(cfg.model, cfg.pp);
    for (int k = 0; k < cfg.workers; ++k) spec.work.push_back(work[size_t(k % cfg.pp)]);
  }
  int rc = run_local_workers(spec);
  if (rc == 0) print_summary(cfg.output);
  set_exit_code(rc);
}

const bool kRegistered = register_command(20, [](CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* c = app.add_subcommand(
      "train",
      "Data-parallel training on libtorch (MLP, CNN, ResNet or ViT on Fashion-MNIST, MNIST or synthetic data) with "
      "bucketed, overlapped and optionally compressed gradient averaging. With no arguments: the CNN on "
      "Fashion-MNIST with 4 local workers. Under mpirun or torchrun it is one worker and starts nothing.");
  c->add_option("--config", args->config,
                "YAML file of key: value (the keys below, with _); flags win over it, and a flag given twice counts as "
                "the last one (base flags, then overrides)");
  auto values = std::make_shared<std::map<std::string, std::string>>();
  for (auto& [key, help] : tr::config_keys()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (key == "overlap" || key == "trace" || key == "progress" || key == "recompute" || key == "sequence_parallel" ||
        key == "zero_prefetch") {
      c->add_option_function<std::string>(
           flag, [values, key = key](const std::string& v) { (*values)[key] = v.empty() ? "true" : v; }, help)
          ->expected(0, 1)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    } else {
      c->add_option_function<std::string>(
          flag, [values, key = key](const std::string& v) { (*values)[key] = v; }, help)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
  c->footer(
      "Example: conduit train --model cnn --workers 4 --compressor powersgd:rank=4 --epochs 3 --output runs/psgd\n"
      "         conduit train --sync ps-ssp --staleness 3 --slow 3:3    (parameter servers, one worker 3x slower)\n"
      "         conduit train --sync ps-ssp --slow '*:3@0.25'    (every worker 3x slower on a random quarter of its "
      "steps)\n"
      "Outputs: <output>/metrics.jsonl (per step and per epoch), summary.json, config.yaml, checkpoint/ (resume "
      "with --resume <output>/checkpoint), trace-rank<R>.json with --trace (chrome://tracing, Perfetto).");
  c->callback([args, values]() {
    TrainArgs a = *args;
    a.flags = *values;
    run_train(a);
  });
});

}  // namespace
}  // namespace conduit::cli
