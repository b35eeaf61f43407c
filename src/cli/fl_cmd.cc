// `conduit fl [--config FILE.json] [--clients N] [--rounds R] ...`: federated learning (fl/federation.h) on libtorch.
// Under mpirun or a launcher's environment (WORLD_SIZE) this process is one rank (rank 0 the server); otherwise it
// starts `workers` local processes through the launcher, each running `conduit fl --config <output>/config.json`,
// and prints the summary when they are done.
#include <fmt/format.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "cli/launcher.h"
#include "cli/registry.h"
#include "coll/communicator.h"
#include "core/error.h"
#include "core/files.h"
#include "fl/federation.h"
#include "net/mpi_transport.h"

#ifdef CONDUIT_WITH_TORCH
#include "cli/torch_plugin.h"
#endif

namespace conduit::cli {
namespace {

namespace fs = std::filesystem;

struct FlArgs {
  std::string config;
  std::map<std::string, std::string> flags;
};

bool under_outer_launcher() {
  if (net::mpi_launched()) return true;
  for (const char* v : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* s = std::getenv(v);
    if (s && *s) return true;
  }
  return false;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw ConfigError(fmt::format("fl: --config: cannot read '{}'", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string default_output() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return std::string("runs/fl-") + buf;
}

void print_summary(const fl::FlConfig& c, const fl::FlResult& r) {
  double modelled = 0;
  int aggregated = 0, sampled = 0;
  for (auto& x : r.rounds) {
    modelled += x.modelled_s;
    aggregated += x.aggregated;
    sampled += x.sampled;
  }
  std::printf(
      "conduit fl: %s on %s, %d clients (%s, label TV distance %.2f), %d rounds of %d sampled, %s%s: test accuracy "
      "%.2f%% in %.1f s (modelled %.1f s on %.0f/%.0f Mbit/s client links); %d of %d sampled updates aggregated; "
      "%.1f MB down, %.1f MB up%s; output %s\n",
      c.model.c_str(), c.dataset.c_str(), c.clients, c.partition.c_str(), r.label_tv_distance, c.rounds,
      r.rounds.empty() ? 0 : r.rounds[0].sampled, c.server_opt.c_str(),
      c.secagg ? fmt::format(", secure aggregation ({} bits)", c.secagg_bits).c_str() : "", 100 * r.final_accuracy,
      r.wall_s, modelled, c.downlink_mbps, c.uplink_mbps, aggregated, sampled, double(r.bytes_down) / 1e6,
      double(r.bytes_up) / 1e6,
      r.rounds.empty() || r.rounds.back().epsilon < 0
          ? ""
          : fmt::format("; (epsilon {:.2f}, delta {:g})-differentially private", r.rounds.back().epsilon, c.dp_delta)
                .c_str(),
      c.output.c_str());
}

void run_rank(const fl::FlConfig& c) {
#ifdef CONDUIT_WITH_TORCH
  coll::CommConfig cc;
  cc.timeout_s = c.timeout_s;
  cc.transport = c.transport == "auto" ? "" : c.transport;
  auto comm = coll::Communicator::from_env(cc);
  if (comm->size() != c.workers)
    throw ConfigError(
        fmt::format("fl: workers: {} does not match the {} ranks found in the environment", c.workers, comm->size()));
  auto trainer = torch_api().make_fl_trainer(c);
  auto on_round = [&](const fl::RoundRecord& r) {
    if (!c.progress) return;
    std::string acc = r.test_accuracy >= 0 ? fmt::format(", test accuracy {:.2f}%", 100 * r.test_accuracy) : "";
    std::string eps = r.epsilon >= 0 ? fmt::format(", epsilon {:.2f}", r.epsilon) : "";
    if (r.clipped > 0) eps += fmt::format(", {} elements clipped", r.clipped);
    std::printf(
        "round %d/%d: %d sampled, %d aggregated (%d stragglers, %d dropouts, %d partial)%s, train loss "
        "%.4f%s%s, %.2f MB up, %.1f s\n",
        r.round + 1, c.rounds, r.sampled, r.aggregated, r.stragglers, r.dropouts, r.partial,
        r.abandoned ? " [abandoned: fewer than the threshold]" : "", r.train_loss, acc.c_str(), eps.c_str(),
        double(r.bytes_up) / 1e6, r.wall_s);
    std::fflush(stdout);
  };
  fl::FlResult r = fl::run_federation(c, comm, *trainer, on_round);
  if (comm->rank() == 0) print_summary(c, r);
#else
  (void)c;
  throw UnsupportedError("fl: this conduit was built without libtorch (Debian: libtorch-dev)");
#endif
}

fl::FlConfig resolve(const FlArgs& a) {
  fl::FlConfig c;
  if (!a.config.empty()) c = fl::config_from_json(read_text(a.config), a.config);
  for (auto& [k, v] : a.flags) fl::set_config_value(c, k, v);
  if (c.output.empty()) c.output = default_output();
  fl::check_config(c);
  return c;
}

void run_fl(const FlArgs& a) {
  fl::FlConfig c = resolve(a);
  if (under_outer_launcher()) {
    run_rank(c);
    return;
  }
  // Start the ranks: they read the resolved configuration from the output folder.
  fs::create_directories(c.output);
  const fs::path cfg_path = fs::path(c.output) / "config.json";
  write_text_file(cfg_path.string(), fl::config_to_json(c) + "\n");
  std::error_code ec;
  auto exe = fs::read_symlink("/proc/self/exe", ec);
  LaunchSpec spec;
  spec.nprocs = c.workers;
  spec.command = {ec ? std::string("conduit") : exe.string(), "fl", "--config", cfg_path.string()};
  spec.name = "conduit fl";
  spec.extra_env = {{"OMP_NUM_THREADS", "1"}, {"OPENBLAS_NUM_THREADS", "1"}};
  if (c.transport != "auto") spec.extra_env.push_back({"CONDUIT_TRANSPORT", c.transport});
  set_exit_code(run_local_workers(spec));
}

const bool kRegistered = register_command(60, [](CLI::App& app) {
  auto args = std::make_shared<FlArgs>();
  auto* c = app.add_subcommand(
      "fl",
      "Federated learning on libtorch: a server and N virtual clients hosted by worker processes; FedAvg, FedProx, "
      "FedAvgM, FedAdagrad, FedAdam, FedYogi; non-IID partitions, client speeds, deadlines and dropouts; secure "
      "aggregation and differential privacy. With no arguments: the CNN on Fashion-MNIST, 100 clients split by "
      "Dirichlet(0.5), 10 a round, 30 rounds, secure aggregation, 3 processes.");
  c->add_option("--config", args->config, "JSON file of key: value (the keys below, with _); flags win over it");
  auto values = std::make_shared<std::map<std::string, std::string>>();
  for (auto& [key, help] : fl::config_keys()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    c->add_option_function<std::string>(
         flag, [values, key = key](const std::string& v) { (*values)[key] = v; }, help)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }
  c->footer(
      "Example: conduit fl --partition dirichlet:0.1 --mu 0.01 --speed-sigma 1 --deadline 2 --stragglers partial\n"
      "         conduit fl --server-opt fedadam --server-lr 0.01 --dropout 0.2 --secagg-bits 16\n"
      "         conduit fl --dp-clip 1 --dp-noise 1.0 --clients 1000 --fraction 0.05\n"
      "Outputs: <output>/config.json, metrics.jsonl (a line a round), summary.json.");
  c->callback([args, values]() {
    FlArgs a = *args;
    a.flags = *values;
    run_fl(a);
  });
});

}  // namespace
}  // namespace conduit::cli
