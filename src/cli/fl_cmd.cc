// `conduit fl [--config FILE.json] [--clients N] [--rounds R] ...`: federated learning (fl/federation.h) on libtorch.
// Under mpirun, torchrun or `conduit launch` (WORLD_SIZE) this process is one rank (rank 0 the server: it writes
// <output>/config.json and prints the summary); otherwise it starts `workers` local processes through the launcher,
// each running `conduit fl --config <output>/config.json`, and prints the summary when they are done.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "cli/launcher.h"
#include "cli/registry.h"
#include "coll/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "core/files.h"
#include "fl/checkpoint.h"
#include "fl/federation.h"
#include "net/mpi_transport.h"

#ifdef CONDUIT_WITH_TORCH
#include "cli/torch_plugin.h"
#include "torch/data.h"
#endif

namespace conduit::cli {
namespace {

namespace fs = std::filesystem;

// Set for the ranks this command's own launcher starts: the parent wrote config.json and prints the summary.
constexpr const char* kParentEnv = "CONDUIT_FL_PARENT";

struct FlArgs {
  std::string config;
  std::map<std::string, std::string> flags;
};

bool under_outer_launcher() { return net::mpi_launched() || env_world_size() > 0; }

std::string read_text(const std::string& path) { return read_input_file(path, "fl: --config", "a JSON file"); }

std::string default_output() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  // (with the pid: two runs started in one second would share a folder)
  return fmt::format("runs/fl-{}-{}", buf, ::getpid());
}

// A folder that holds an earlier run's records would have them replaced.
void refuse_used_output(const std::string& out) {
  for (const char* f : {"metrics.jsonl", "summary.json"}) {
    std::error_code ec;
    if (fs::exists(fs::path(out) / f, ec))
      throw ConfigError(
          fmt::format("fl: output: '{}' holds an earlier run's {}; allowed: another --output, or remove "
                      "the folder first",
                      out, f));
  }
  if (fl::holds_checkpoints(fl::checkpoint_dir(out)))
    throw ConfigError(fmt::format(
        "fl: output: '{}' holds an earlier run's checkpoints; allowed: another --output (--resume reads them from "
        "there)",
        out));
}

void print_summary(const std::string& out) {
  const fs::path p = fs::path(out) / "summary.json";
  std::ifstream f(p);
  if (!f) return;
  nlohmann::json s;
  try {
    s = nlohmann::json::parse(f);
  } catch (const std::exception&) {
    return;
  }
  const std::string secagg =
      s.value("secagg", false) ? fmt::format(", secure aggregation ({} bits)", s.value("secagg_bits", 32)) : "";
  const std::string dp = s["epsilon"].is_number() ? fmt::format("; ({:.2f}, {:g})-differentially private",
                                                                s["epsilon"].get<double>(), s.value("dp_delta", 0.0))
                                                  : "";
  std::printf(
      "conduit fl: %s on %s, %d clients (%s, label TV distance %.2f), %d rounds, %s%s: test accuracy %.2f%% in %.1f s "
      "(modelled %.1f s on %.0f/%.0f Mbit/s client links); %d of %d sampled updates aggregated, %d of %d rounds "
      "applied; %.1f MB down, %.1f MB up%s; output %s\n",
      s.value("model", std::string()).c_str(), s.value("dataset", std::string()).c_str(), s.value("clients", 0),
      s.value("partition", std::string()).c_str(), s.value("label_tv_distance", 0.0), s.value("rounds", 0),
      s.value("server_opt", std::string()).c_str(), secagg.c_str(), 100 * s.value("final_test_accuracy", 0.0),
      s.value("wall_time_s", 0.0), s.value("modelled_time_s", 0.0), s.value("downlink_mbps", 0.0),
      s.value("uplink_mbps", 0.0), s.value("aggregated", 0), s.value("sampled", 0), s.value("rounds_applied", 0),
      s.value("rounds", 0), s.value("bytes_down", 0.0) / 1e6, s.value("bytes_up", 0.0) / 1e6, dp.c_str(), out.c_str());
  if (s.value("first_round", 1) > 1)
    std::printf("conduit fl: resumed at round %d: the counts, times and bytes are of rounds %d-%d\n",
                s.value("first_round", 1), s.value("first_round", 1), s.value("rounds", 0));
}

#ifdef CONDUIT_WITH_TORCH
// Every rank must run the same federation: rank 0's configuration (its output folder included, where the others
// defaulted theirs from their own clocks) is broadcast and compared, and rank 0 checks its output folder and the files
// a resume reads; then every rank learns whether any refused, so all stop (each with its own line, or naming the ranks
// that refused).
void agree_on_config(coll::Communicator& comm, fl::FlConfig& c, bool output_given, bool writes_output) {
  // (under start-up's deadline, as the ranks' meeting after it: a rank still starting is not a failed step)
  coll::CollOptions meet;
  meet.timeout_s = startup_timeout_seconds(c.timeout_s);
  std::string why;
  if (comm.rank() == 0 && writes_output) {
    try {
      refuse_used_output(c.output);
      // (what a resume reads, before the output folder is written: a retry into it is not refused)
      if (!c.resume.empty()) fl::check_resume_files(c);
    } catch (const Error& e) {
      why = e.what();
    }
  }
  std::string mine = fl::config_to_json(c);
  int64_t len = int64_t(mine.size());
  comm.broadcast(&len, 1, DType::i64, 0, meet).wait();
  if (len < 2 || len > (1 << 24)) throw ProtocolError(fmt::format("fl: rank 0's configuration is {} bytes", len));
  std::string root = comm.rank() == 0 ? mine : std::string(size_t(len), '\0');
  comm.broadcast(root.data(), root.size(), DType::u8, 0, meet).wait();
  if (comm.rank() != 0) {
    fl::FlConfig theirs = fl::config_from_json(root, "rank 0's configuration");
    if (!output_given) c.output = theirs.output;
    const nlohmann::json a = nlohmann::json::parse(fl::config_to_json(c)), b = nlohmann::json::parse(root);
    for (auto& [k, v] : b.items())
      if (why.empty() && a.at(k) != v)
        why = fmt::format("fl: {}: rank {} has {}, rank 0 has {}; allowed: the same settings on every rank", k,
                          comm.rank(), a.at(k).dump(), v.dump());
  }
  std::vector<int32_t> refused(size_t(comm.size()), 0);
  refused[size_t(comm.rank())] = why.empty() ? 0 : 1;
  comm.allreduce(refused.data(), refused.size(), DType::i32, ReduceOp::sum, meet).wait();
  std::string who;
  for (size_t r = 0; r < refused.size(); ++r)
    if (refused[r]) who += (who.empty() ? "" : ", ") + std::to_string(r);
  if (who.empty()) return;
  if (why.empty()) why = fmt::format("fl: rank(s) {} refused the settings (their lines say why)", who);
  throw ConfigError(why);
}
#endif

// workers_given: --workers or the config file set it; otherwise the world found in the environment is taken.
void run_rank(fl::FlConfig c, bool workers_given, bool output_given) {
#ifdef CONDUIT_WITH_TORCH
  const bool parent = std::getenv(kParentEnv) != nullptr;
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  cc.transport = c.transport == "auto" ? "" : c.transport;
  auto comm = coll::Communicator::from_env(cc);
  if (!workers_given) c.workers = comm->size();
  fl::check_config(c);
  if (comm->size() != c.workers)
    throw ConfigError(
        fmt::format("fl: workers: {} does not match the {} ranks found in the environment", c.workers, comm->size()));
  agree_on_config(*comm, c, output_given, !parent);
  std::unique_ptr<fl::LocalTrainer> trainer;
  try {
    if (comm->rank() == 0 && !parent) {
      make_output_dir(c.output, "--output");
      write_text_file((fs::path(c.output) / "config.json").string(), fl::config_to_json(c) + "\n");
    }
    trainer = torch_api().make_fl_trainer(c);
  } catch (const std::exception& e) {
    // (the others would wait for this rank until their deadline)
    comm->transport().abort(fmt::format("fl: rank {} failed: {}", comm->rank(), e.what()));
    throw;
  }
  auto on_round = [&](const fl::RoundRecord& r) {
    if (!c.progress) return;
    std::string acc = r.test_accuracy >= 0 ? fmt::format(", test accuracy {:.2f}%", 100 * r.test_accuracy) : "";
    std::string loss = r.train_loss >= 0 ? fmt::format(", train loss {:.4f}", r.train_loss) : "";
    std::string extra = r.epsilon >= 0 ? fmt::format(", epsilon {:.2f}", r.epsilon) : "";
    if (r.clipped > 0) extra += fmt::format(", {} elements clipped", r.clipped);
    std::printf(
        "round %d/%d: %d sampled, %d aggregated (%d stragglers, %d dropouts, %d partial)%s%s%s%s, %.2f MB up, "
        "%.1f s\n",
        r.round, c.rounds, r.sampled, r.aggregated, r.stragglers, r.dropouts, r.partial,
        r.abandoned ? fmt::format(" [abandoned: {}]", r.abandon_reason).c_str() : "", loss.c_str(), acc.c_str(),
        extra.c_str(), double(r.bytes_up) / 1e6, r.wall_s);
    std::fflush(stdout);
  };
  fl::run_federation(c, comm, *trainer, on_round);
  if (comm->rank() == 0 && !parent) print_summary(c.output);
#else
  (void)c;
  (void)workers_given;
  (void)output_given;
  throw UnsupportedError("fl: this conduit was built without libtorch (Debian: libtorch-dev)");
#endif
}

// check: all checks now (a launcher's parent); an outer launcher's rank checks once it knows its world size.
fl::FlConfig resolve(const FlArgs& a, bool* workers_given, bool* output_given, bool check) {
  fl::FlConfig c;
  *workers_given = a.flags.count("workers") > 0;
  *output_given = a.flags.count("output") > 0;
  bool server_lr_given = a.flags.count("server_lr") > 0;
  if (!a.config.empty()) {
    const std::string text = read_text(a.config);
    c = fl::config_from_json(text, a.config);
    const auto j = nlohmann::json::parse(text);
    *workers_given = *workers_given || j.contains("workers");
    *output_given = *output_given || (j.contains("output") && !c.output.empty());
    server_lr_given = server_lr_given || j.contains("server_lr");
  }
  for (auto& [k, v] : a.flags) fl::set_config_value(c, k, v);
  // The adaptive server optimizers step by about lr per element whatever the update's size: FedAdam at FedAvg's 1
  // diverged within 3 rounds on the defaults (the loss at its cap). 0.01 unless given, as Reddi et al.'s tuned rates
  // and the docs' example.
  // A resume continues at its checkpoint's rate (one written before this default, at 1, was refused as another
  // setting); its own errors are check_resume's.
  if (!server_lr_given && !c.resume.empty()) {
    try {
      const auto j = nlohmann::json::parse(fl::read_latest_checkpoint(fl::resume_checkpoint_dir(c.resume)).config_json);
      if (j.contains("server_lr") && j["server_lr"].is_number()) c.server_lr = j["server_lr"].get<double>();
    } catch (const std::exception&) {
    }
  } else if (!server_lr_given &&
             (c.server_opt == "fedadagrad" || c.server_opt == "fedadam" || c.server_opt == "fedyogi")) {
    c.server_lr = 0.01;
  }
  // Another data set named on the command line does not keep a config file's folder of the old one.
  if (a.flags.count("dataset") && !a.flags.count("data_dir")) c.data_dir.clear();
  if (c.output.empty()) c.output = default_output();
  fl::fill_defaults(c);
  if (check) fl::check_config(c);
  return c;
}

void run_fl(const FlArgs& a) {
  bool workers_given = false, output_given = false;
  const bool outer = under_outer_launcher();
  fl::FlConfig c = resolve(a, &workers_given, &output_given, !outer);
  if (outer) {
    run_rank(c, workers_given, output_given);
    return;
  }
#ifdef CONDUIT_WITH_TORCH
  // What the data allows, before any process starts (the labels file's header, 8 bytes).
  int64_t samples = c.synthetic_samples;
  if (c.dataset != "synthetic") {
    samples = train::mnist_format_train_count(c.data_dir);
    if (samples < 0)
      throw ConfigError(fmt::format("fl: data_dir: '{}' holds no MNIST-format training labels", c.data_dir));
  }
  fl::check_sample_count(c, samples);
#endif
  fl::check_secagg_memory(c, 1.0);  // (every host on this machine)
  refuse_used_output(c.output);
  // (a checkpoint that is missing, damaged or of other settings, its host files included, stops here rather than in
  // the started ranks, before the output folder is made: a retry into it is not refused)
  if (!c.resume.empty()) fl::check_resume_files(c);
  // Start the ranks: they read the resolved configuration from the output folder.
  make_output_dir(c.output, "--output");
  const fs::path cfg_path = fs::path(c.output) / "config.json";
  write_text_file(cfg_path.string(), fl::config_to_json(c) + "\n");
  std::error_code ec;
  auto exe = fs::read_symlink("/proc/self/exe", ec);
  LaunchSpec spec;
  spec.nprocs = c.workers;
  spec.command = {ec ? std::string("conduit") : exe.string(), "fl", "--config", cfg_path.string()};
  spec.name = "conduit fl";
  spec.extra_env = {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}, {kParentEnv, "1"}};
  if (c.transport != "auto") spec.extra_env.push_back({"CONDUIT_TRANSPORT", c.transport});
  const int rc = run_local_workers(spec);
  if (rc == 0) print_summary(c.output);
  set_exit_code(rc);
}

const bool kRegistered = register_command(60, [](CLI::App& app) {
  auto args = std::make_shared<FlArgs>();
  auto* c = app.add_subcommand(
      "fl",
      "Federated learning on libtorch: a server and N virtual clients hosted by worker processes; FedAvg, FedProx, "
      "SCAFFOLD, FedAvgM, FedAdagrad, FedAdam, FedYogi; checkpoints and resume; non-IID partitions, client speeds, "
      "deadlines and dropouts; secure "
      "aggregation and differential privacy. With no arguments: the CNN on Fashion-MNIST, 100 clients split by "
      "Dirichlet(0.5), 10 a round, 30 rounds, secure aggregation, 3 processes.");
  c->add_option("--config", args->config, "JSON file of key: value (the keys below, with _); flags win over it");
  auto values = std::make_shared<std::map<std::string, std::string>>();
  for (auto& [key, help] : fl::config_keys()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    auto* o = c->add_option_function<std::string>(
                   flag,
                   [values, key = key](const std::string& v) {
                     // (a bare boolean flag is true; an empty value of any other key stays empty, which its check
                     // names: it said 'true')
                     const bool flag_only = key == "secagg" || key == "progress" || key == "scaffold";
                     (*values)[key] = v.empty() && flag_only ? "true" : v;
                   },
                   help)
                  ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    if (key == "secagg" || key == "progress" || key == "scaffold") o->expected(0, 1);  // bare --secagg: true
  }
  c->footer(
      "Example: conduit fl --partition dirichlet:0.1 --mu 0.01 --speed-sigma 1 --deadline 1.5 --stragglers partial\n"
      "         conduit fl --server-opt fedadam --server-lr 0.01 --dropout 0.2 --secagg-bits 16\n"
      "         conduit fl --dp-clip 1 --dp-noise 1.0 --clients 1000 --fraction 0.05\n"
      "Outputs: <output>/config.json, metrics.jsonl (a line a round), summary.json (docs/federated.md).");
  c->callback([args, values]() {
    FlArgs a = *args;
    a.flags = *values;
    run_fl(a);
  });
});

}  // namespace
}  // namespace conduit::cli
