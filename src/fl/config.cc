// FlConfig: checks and JSON (federation.h).
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/env.h"
#include "core/error.h"
#include "fl/federation.h"
#include "fl/partition.h"
#include "fl/secagg.h"
#include "fl/server_opt.h"

namespace conduit::fl {
namespace {

// Every field by name, for JSON both ways (C is FlConfig or const FlConfig).
template <class C, class F>
void fields(C& c, F&& f) {
  f("model", c.model);
  f("dataset", c.dataset);
  f("data_dir", c.data_dir);
  f("train_limit", c.train_limit);
  f("test_limit", c.test_limit);
  f("synthetic_samples", c.synthetic_samples);
  f("seed", c.seed);
  f("clients", c.clients);
  f("fraction", c.fraction);
  f("min_clients", c.min_clients);
  f("rounds", c.rounds);
  f("partition", c.partition);
  f("local_epochs", c.local_epochs);
  f("batch_size", c.batch_size);
  f("lr", c.lr);
  f("momentum", c.momentum);
  f("weight_decay", c.weight_decay);
  f("mu", c.mu);
  f("scaffold", c.scaffold);
  f("server_opt", c.server_opt);
  f("server_lr", c.server_lr);
  f("server_momentum", c.server_momentum);
  f("beta1", c.beta1);
  f("beta2", c.beta2);
  f("tau", c.tau);
  f("speed_sigma", c.speed_sigma);
  f("deadline", c.deadline);
  f("stragglers", c.stragglers);
  f("dropout", c.dropout);
  f("uplink_mbps", c.uplink_mbps);
  f("downlink_mbps", c.downlink_mbps);
  f("secagg", c.secagg);
  f("secagg_bits", c.secagg_bits);
  f("secagg_clip", c.secagg_clip);
  f("secagg_threshold", c.secagg_threshold);
  f("secagg_neighbors", c.secagg_neighbors);
  f("secagg_max_corrupt", c.secagg_max_corrupt);
  f("secagg_max_dropout", c.secagg_max_dropout);
  f("dp_clip", c.dp_clip);
  f("dp_noise", c.dp_noise);
  f("dp_delta", c.dp_delta);
  f("workers", c.workers);
  f("transport", c.transport);
  f("timeout_s", c.timeout_s);
  f("eval_every", c.eval_every);
  f("output", c.output);
  f("checkpoint_every", c.checkpoint_every);
  f("resume", c.resume);
  f("progress", c.progress);
}

void real_in(const char* field, double v, double lo, double hi, bool lo_open, bool hi_open) {
  const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  if (!ok)
    throw ConfigError(fmt::format("fl: {}: {} is out of range; allowed: a number in {}{}, {}{}", field, v,
                                  lo_open ? "(" : "[", lo, hi, hi_open ? ")" : "]"));
}

void int_in(const char* field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    throw ConfigError(fmt::format("fl: {}: {} is out of range; allowed: an integer in [{}, {}]", field, v, lo, hi));
}

// The integer keys' fixed ranges: check_config holds each key to its own, and a value that is no integer at all (a
// flag's '2.5', a JSON file's "abc") is refused naming the same range, not the C++ type's.
struct IntRange {
  const char* key;
  int64_t lo, hi;
};
constexpr IntRange kIntRanges[] = {
    {"train_limit", 0, int64_t(1) << 40},
    {"test_limit", 0, int64_t(1) << 40},
    {"synthetic_samples", 1, int64_t(1) << 22},  // (784 bytes each, on every rank)
    {"clients", 1, 1000000},
    {"rounds", 1, 1000000},
    {"local_epochs", 1, 100000},
    {"batch_size", 1, 1 << 20},
    {"secagg_bits", 8, 32},
    {"workers", 2, 4096},
    {"eval_every", 0, 1000000},
    {"checkpoint_every", 0, 1000000},
};

const IntRange* int_range(const std::string& key) {
  for (const IntRange& r : kIntRanges)
    if (key == r.key) return &r;
  return nullptr;
}

void int_key(const char* key, int64_t v) {
  const IntRange* r = int_range(key);
  if (!r) throw std::logic_error(fmt::format("fl: no integer range for key '{}'", key));
  int_in(key, v, r->lo, r->hi);
}

// What an integer key allows, in words (the values no range holds: min_clients' top is the clients, seed takes any
// 64-bit value, secagg_neighbors is 0, even, or auto).
std::string int_allowed(const std::string& key, int64_t lo, uint64_t hi) {
  if (const IntRange* r = int_range(key)) return fmt::format("an integer in [{}, {}]", r->lo, r->hi);
  if (key == "min_clients") return "an integer in [1, clients]";
  if (key == "secagg_neighbors")
    return fmt::format("0 (every pair), an even integer in 2..{}, or auto (or -1)", kMaxClients - 1);
  return fmt::format("an integer in [{}, {}]", lo, hi);
}

void one_of(const char* field, const std::string& v, std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  throw ConfigError(fmt::format("fl: {}: '{}' is not known; allowed: {}", field, v, list));
}

}  // namespace

void fill_defaults(FlConfig& c) {
  if (c.data_dir.empty())
    c.data_dir = c.dataset == "mnist" ? "/usr/share/datasets/mnist" : "/usr/share/datasets/fashion-mnist";
}

int clients_per_round(const FlConfig& c) {
  return int(sample_clients(c.clients, c.fraction, c.min_clients, c.seed, 0).size());  // the same every round
}

int dp_max_sampled(const FlConfig& c) {
  const double mean = c.fraction * c.clients, sd = std::sqrt(mean * (1 - c.fraction));
  return int(std::min<double>(c.clients, std::ceil(mean + 6 * sd) + 1));
}

void check_sample_count(const FlConfig& c, int64_t samples) {
  if (c.train_limit > 0) samples = std::min(samples, c.train_limit);
  if (samples < c.clients)
    throw ConfigError(
        fmt::format("fl: clients: {} clients for {} training samples; allowed: at most one client a "
                    "sample (fewer --clients, or more data)",
                    c.clients, samples));
  const PartitionSpec p = parse_partition(c.partition);
  if (p.kind == "shards" && int64_t(p.shards_per_client) * c.clients > samples)
    throw ConfigError(
        fmt::format("fl: partition: {} shards of {} clients need {} samples, the data has {}; allowed: "
                    "fewer shards or clients",
                    p.shards_per_client, c.clients, int64_t(p.shards_per_client) * c.clients, samples));
}

ServerOptConfig server_opt_config(const FlConfig& c) {
  ServerOptConfig oc;
  oc.name = c.server_opt;
  oc.lr = c.server_lr;
  oc.momentum = c.server_momentum;
  oc.beta1 = c.beta1;
  oc.beta2 = c.beta2;
  oc.tau = c.tau;
  return oc;
}

void check_config(const FlConfig& c) {
  // (resnet's BatchNorm statistics are buffers, not weights: averaging, clipping and noising them as weights breaks
  // them; FedBN-style local statistics are not built)
  one_of("model", c.model, {"mlp", "cnn"});
  one_of("dataset", c.dataset, {"fashion-mnist", "mnist", "synthetic"});
  int_key("train_limit", c.train_limit);
  int_key("test_limit", c.test_limit);
  int_key("synthetic_samples", c.synthetic_samples);
  int_key("clients", c.clients);
  real_in("fraction", c.fraction, 0, 1, true, false);
  int_in("min_clients", c.min_clients, 1, c.clients);
  int_key("rounds", c.rounds);
  parse_partition(c.partition);
  int_key("local_epochs", c.local_epochs);
  int_key("batch_size", c.batch_size);
  real_in("lr", c.lr, 0, 1e6, true, false);
  real_in("momentum", c.momentum, 0, 1, false, true);
  real_in("weight_decay", c.weight_decay, 0, 1e6, false, false);
  real_in("mu", c.mu, 0, 1e6, false, false);
  if (c.scaffold && c.momentum > 0)
    throw ConfigError(fmt::format(
        "fl: momentum: {} with scaffold (its control variates are estimated from plain SGD steps); allowed: "
        "--momentum 0 with --scaffold true",
        c.momentum));
  validate(server_opt_config(c), {"fl: ", "server_opt", "server_lr", "server_momentum", "beta1", "beta2", "tau"});
  real_in("speed_sigma", c.speed_sigma, 0, 4, false, false);
  real_in("deadline", c.deadline, 0, 1e6, false, false);
  one_of("stragglers", c.stragglers, {"drop", "partial"});
  if (c.stragglers == "partial" && c.deadline == 0)
    throw ConfigError(
        "fl: stragglers: partial cuts a client's work to the steps that fit the deadline, and there is none; "
        "allowed: --deadline D > 0 with it, or stragglers drop");
  real_in("dropout", c.dropout, 0, 1, false, true);
  real_in("uplink_mbps", c.uplink_mbps, 0, 1e9, true, false);
  real_in("downlink_mbps", c.downlink_mbps, 0, 1e9, true, false);
  real_in("dp_clip", c.dp_clip, 0, 1e9, false, false);
  real_in("dp_noise", c.dp_noise, 0, 1e6, false, false);
  real_in("dp_delta", c.dp_delta, 0, 1, true, true);
  if (c.dp_noise > 0 && c.dp_clip == 0)
    throw ConfigError("fl: dp_noise: noise needs a sensitivity bound; allowed: dp_clip > 0 with it");
  const bool dp = c.dp_noise > 0 || c.dp_clip > 0;
  if (dp && c.scaffold)
    throw ConfigError(
        "fl: scaffold: its control-variate updates are not clipped or noised, so differential privacy would not "
        "cover them; allowed: --scaffold false with --dp-clip/--dp-noise");
  // Under DP every client is drawn on its own with probability fraction (Poisson sampling, which the accountant
  // assumes): a floor on the round's clients would change the mechanism the epsilon is for, so a min_clients other
  // than the default, which was ignored, is refused (the value cannot tell a given default from the default).
  if (dp && c.min_clients != FlConfig{}.min_clients)
    throw ConfigError(fmt::format(
        "fl: min_clients: {} does not apply under differential privacy (each client is sampled on its own with "
        "probability --fraction, as the accountant assumes: no floor); allowed: min_clients {} (the default) with "
        "--dp-clip/--dp-noise, and a larger --fraction for more clients a round",
        c.min_clients, FlConfig{}.min_clients));
  // Under DP each client is sampled independently: about fraction * clients a round; the codec is sized for the
  // most a round may have.
  const int sampled = dp ? dp_max_sampled(c) : clients_per_round(c);
  // (the ranges whether or not secure aggregation is on: the values are recorded, and a resume compares them)
  int_key("secagg_bits", c.secagg_bits);
  real_in("secagg_clip", c.secagg_clip, 1e-20, 1e30, false, false);  // (the codec's scale is levels / clip)
  real_in("secagg_threshold", c.secagg_threshold, 0.5, 1, false, false);
  if (c.secagg_neighbors < -1 || (c.secagg_neighbors > 0 && c.secagg_neighbors % 2 != 0) ||
      c.secagg_neighbors > kMaxClients - 1)
    throw ConfigError(
        fmt::format("fl: secagg_neighbors: {} is not allowed; allowed: 0 (every pair of a round's clients), an "
                    "even number in 2..{} (SecAgg+'s graph: k/2 on each side of a ring) or auto (or -1)",
                    c.secagg_neighbors, kMaxClients - 1));
  real_in("secagg_max_corrupt", c.secagg_max_corrupt, 0, 0.5, false, true);
  real_in("secagg_max_dropout", c.secagg_max_dropout, 0, 1, false, true);
  if (c.secagg) {
    if (dp && c.fraction * c.clients < 2)
      throw ConfigError(
          fmt::format("fl: fraction: {} of {} clients is {:.2g} a round on average, and secure "
                      "aggregation abandons rounds of fewer than 2; allowed: fraction * clients >= 2",
                      c.fraction, c.clients, c.fraction * c.clients));
    if (c.secagg_neighbors == -1 && c.dropout > c.secagg_max_dropout)
      throw ConfigError(fmt::format(
          "fl: secagg_max_dropout: {} is below --dropout {}: the graph chosen for it would abandon rounds; allowed: "
          "secagg_max_dropout at least dropout",
          c.secagg_max_dropout, c.dropout));
    if (sampled < 2)
      throw ConfigError(
          fmt::format("fl: secagg: {} client(s) a round cannot hide one another's update; allowed: "
                      "fraction and min_clients giving at least 2, or --secagg off",
                      sampled));
    if (sampled > kMaxClients)
      throw ConfigError(
          fmt::format("fl: secagg: up to {} clients a round; allowed: at most {} (the protocol's "
                      "client ids), a smaller --fraction or --secagg false",
                      sampled, kMaxClients));
    // The codec keeps at least 2 integer levels a client below half the modulus: (2^(bits-1) - 1) / clients >= 2.
    int need = 8;
    while (need < 32 && ((int64_t{1} << (need - 1)) - 1) / sampled < 2) ++need;
    if (c.secagg_bits < need)
      throw ConfigError(fmt::format(
          "fl: secagg_bits: {} bits cannot sum {} clients a round without wrapping (each needs 2 integer levels "
          "of 2^(bits-1) - 1); allowed: secagg_bits {} to 32 for {} clients a round, or fewer clients a round "
          "(--fraction, --clients)",
          c.secagg_bits, sampled, need, sampled));
    FixedPointCodec(c.secagg_bits, c.secagg_clip, sampled);  // (the codec's own checks, as a backstop)
  }
  int_key("workers", c.workers);
  if (c.workers - 1 > c.clients)
    throw ConfigError(
        fmt::format("fl: workers: {} processes host {} clients (one host would have none); allowed: at "
                    "most clients + 1 = {}",
                    c.workers, c.clients, c.clients + 1));
  one_of("transport", c.transport, {"auto", "tcp", "shm", "mpi"});
  real_in("timeout_s", c.timeout_s, 0.001, 1e7, false, false);  // (as train's)
  int_key("eval_every", c.eval_every);
  int_key("checkpoint_every", c.checkpoint_every);
  if (c.checkpoint_every > 0 && c.output.empty())
    throw ConfigError("fl: checkpoint_every: checkpoints go to the output folder; allowed: an --output with it");
}

const std::vector<std::pair<std::string, std::string>>& config_keys() {
  static const std::vector<std::pair<std::string, std::string>> keys = {
      {"model", "mlp | cnn"},
      {"dataset", "fashion-mnist | mnist | synthetic"},
      {"data_dir", "folder of the MNIST-format files (default /usr/share/datasets/<dataset>)"},
      {"train_limit", "use the first N training samples (0: all)"},
      {"test_limit", "evaluate on the first N test samples (0: all)"},
      {"synthetic_samples", "training samples of the synthetic data set"},
      {"seed", "seed of the model, partition, sampling, speeds and dropouts"},
      {"clients", "N: virtual clients"},
      {"fraction", "fraction of the clients sampled each round, in (0, 1]"},
      {"min_clients", "at least this many sampled each round"},
      {"rounds", "communication rounds"},
      {"partition", "iid | dirichlet:ALPHA (label skew) | shards:K (K label-sorted shards a client)"},
      {"local_epochs", "epochs a client trains on its partition each round"},
      {"batch_size", "local batch size"},
      {"lr", "local SGD learning rate"},
      {"momentum", "local SGD momentum (reset every round)"},
      {"weight_decay", "local SGD weight decay"},
      {"mu", "FedProx proximal term (0: FedAvg)"},
      {"scaffold", "SCAFFOLD control variates correct client drift (true | false; plain local SGD)"},
      {"server_opt", "fedavg | fedavgm | fedadagrad | fedadam | fedyogi"},
      {"server_lr",
       "server learning rate (default 1, fedavg's plain weighted average; 0.01 for fedadagrad, fedadam and fedyogi)"},
      {"server_momentum", "fedavgm's momentum"},
      {"beta1", "fedadam/fedyogi/fedadagrad first-moment decay"},
      {"beta2", "fedadam/fedyogi second-moment decay"},
      {"tau", "adaptive server optimizers' epsilon"},
      {"speed_sigma", "client speed factors exp(N(0, sigma^2)) (0: all equal)"},
      {"deadline", "round deadline in units of a speed-1 client's full local work (0: none)"},
      {"stragglers", "drop | partial (FedProx: the steps that fit the deadline)"},
      {"dropout", "probability a sampled client leaves after the key exchange"},
      {"uplink_mbps", "client uplink of the modelled round time"},
      {"downlink_mbps", "client downlink of the modelled round time"},
      {"secagg", "secure aggregation (true | false)"},
      {"secagg_bits", "bits of secure aggregation's arithmetic (8..32): the upload's bytes per element"},
      {"secagg_clip", "secure aggregation clips each weighted update element to [-clip, clip]"},
      {"secagg_threshold",
       "secure aggregation threshold t = floor(x * group) + 1 (2 to group), x in [0.5, 1]; group: the sampled "
       "clients, or each client and its neighbours"},
      {"secagg_neighbors",
       "SecAgg+: each client pairs with this many others (even; 0: all) of a random graph, in rounds of more than "
       "this + 1 clients (every pair in smaller ones); auto: the smallest k the bounds below allow, per round"},
      {"secagg_max_corrupt", "SecAgg+ auto: fraction of a round's clients that may collude with the server, [0, 0.5)"},
      {"secagg_max_dropout", "SecAgg+ auto: fraction of a round's clients that may drop out, [0, 1)"},
      {"dp_clip", "differential privacy: clip each update to this L2 norm (0: off)"},
      {"dp_noise", "differential privacy: noise multiplier z (noise std z * dp_clip on the sum; 0: off)"},
      {"dp_delta", "differential privacy: the delta epsilon is reported at"},
      {"workers", "processes: the server and workers-1 client hosts"},
      {"transport", "auto | tcp | shm | mpi"},
      {"timeout_s", "deadline of one step of a peer (seconds; waits spanning a host's clients get that many more)"},
      {"eval_every", "rounds between test evaluations (0: the last only)"},
      {"output", "folder of config.json, metrics.jsonl and summary.json (empty: runs/fl-<time>-<pid>)"},
      {"checkpoint_every", "write <output>/checkpoints after every K rounds and the last (0: none)"},
      {"resume", "continue the run whose output (or checkpoints) folder this is, from its newest checkpoint"},
      {"progress", "print a line per round (true | false)"},
  };
  return keys;
}

void set_config_value(FlConfig& c, const std::string& key, const std::string& value) {
  bool found = false;
  fields(c, [&](const char* k, auto& v) {
    if (key != k) return;
    found = true;
    using T = std::remove_reference_t<decltype(v)>;
    auto bad = [&](const char* allowed) {
      return ConfigError(fmt::format("fl: {}: '{}' is not {}", key, value, allowed));
    };
    if constexpr (std::is_same_v<T, std::string>) {
      v = value;
    } else if (key == "secagg_neighbors" && value == "auto") {
      if constexpr (std::is_same_v<T, int>) v = -1;
    } else if constexpr (std::is_same_v<T, bool>) {
      if (value == "true" || value == "1" || value == "on" || value == "yes")
        v = true;
      else if (value == "false" || value == "0" || value == "off" || value == "no")
        v = false;
      else
        throw bad("a boolean (true | false)");
    } else if constexpr (std::is_floating_point_v<T>) {
      // (as a person writes it: stod also took hex floats, inf and leading spaces)
      if (value.empty() || value[0] == '+' || !is_decimal(value, true)) throw bad("a number");
      size_t pos = 0;
      try {
        v = std::stod(value, &pos);
      } catch (const std::exception&) {
        throw bad("a number");
      }
      if (pos != value.size()) throw bad("a number");
    } else {
      const std::string range =
          int_allowed(key, int64_t(std::numeric_limits<T>::min()), uint64_t(std::numeric_limits<T>::max()));
      size_t pos = 0;
      try {
        // (digits, a leading - where signed: stoull skipped the spaces of ' -1' and wrapped it to 2^64 - 1)
        // (a leading + as the numbers take it)
        const size_t digits =
            !value.empty() && (value[0] == '+' || (value[0] == '-' && !std::is_unsigned_v<T>)) ? 1 : 0;
        if (value.size() <= digits || value.find_first_not_of("0123456789", digits) != std::string::npos)
          throw std::invalid_argument("not decimal digits");
        if constexpr (std::is_unsigned_v<T>) {
          const unsigned long long x = std::stoull(value, &pos);
          if (x > std::numeric_limits<T>::max()) throw std::out_of_range("range");
          v = T(x);
        } else {
          const long long x = std::stoll(value, &pos);
          if (x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max()) throw std::out_of_range("range");
          v = T(x);
        }
      } catch (const std::exception&) {
        throw bad(range.c_str());
      }
      if (pos != value.size()) throw bad(range.c_str());
    }
  });
  if (!found) throw ConfigError(fmt::format("fl: unknown key '{}'", key));
}

std::string config_to_json(const FlConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  fields(c, [&](const char* k, const auto& v) { j[k] = v; });
  return j.dump(2);
}

FlConfig config_from_json(const std::string& text, const std::string& what) {
  nlohmann::json j;
  // A key given twice in one object is refused (the parser kept the last), as the YAML inputs refuse it.
  std::vector<std::set<std::string>> open;  // the keys of each object being read
  std::string twice;
  const auto seen = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& parsed) {
    if (ev == nlohmann::json::parse_event_t::object_start) open.emplace_back();
    if (ev == nlohmann::json::parse_event_t::object_end && !open.empty()) open.pop_back();
    if (ev == nlohmann::json::parse_event_t::key && !open.empty() && twice.empty() &&
        !open.back().insert(parsed.get<std::string>()).second)
      twice = parsed.get<std::string>();
    return true;
  };
  try {
    j = nlohmann::json::parse(text, seen);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("fl: {}: not JSON ({})", what, e.what()));
  }
  if (!twice.empty()) throw ConfigError(fmt::format("fl: {}: key '{}' is given twice; give it once", what, twice));
  if (!j.is_object()) throw ConfigError(fmt::format("fl: {}: not a JSON object", what));
  FlConfig c;
  size_t known = 0;
  fields(c, [&](const char* k, auto& v) {
    if (!j.contains(k)) return;
    ++known;
    using T = std::remove_reference_t<decltype(v)>;
    const nlohmann::json& x = j.at(k);
    // secagg_neighbors' auto, as its flag takes it (every flag is a key): -1, which config_to_json writes
    if constexpr (std::is_same_v<T, int>) {
      if (std::string_view(k) == "secagg_neighbors" && x.is_string() && x.get<std::string>() == "auto") {
        v = -1;
        return;
      }
    }
    // No coercion: 2.7 is not a number of rounds, -1 not a seed, "3" not a number.
    bool ok = false;
    if constexpr (std::is_same_v<T, std::string>)
      ok = x.is_string();
    else if constexpr (std::is_same_v<T, bool>)
      ok = x.is_boolean();
    else if constexpr (std::is_floating_point_v<T>)
      ok = x.is_number();
    else if constexpr (std::is_unsigned_v<T>)
      ok = x.is_number_unsigned();
    else
      ok = x.is_number_integer() && !(x.is_number_unsigned() && x.get<uint64_t>() > uint64_t(INT64_MAX)) &&
           x.get<int64_t>() >= std::numeric_limits<T>::min() && x.get<int64_t>() <= std::numeric_limits<T>::max();
    // (an array or object named by its kind: dumping a deeply nested one overflowed the stack, and a large one made
    // the line megabytes long)
    auto shown = [](const nlohmann::json& v) {
      if (v.is_structured()) return std::string("an ") + v.type_name();
      const std::string s = v.dump();
      return s.size() > 80 ? s.substr(0, 77) + "..." : s;
    };
    if (!ok) {
      std::string allowed = std::is_same_v<T, std::string> ? "a string"
                            : std::is_same_v<T, bool>      ? "true or false"
                                                           : "a number";
      if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
        allowed = int_allowed(k, int64_t(std::numeric_limits<T>::min()), uint64_t(std::numeric_limits<T>::max()));
      throw ConfigError(
          fmt::format("fl: {}: key '{}' has a value of the wrong type ({}); allowed: {}", what, k, shown(x), allowed));
    }
    v = x.get<T>();
  });
  if (known != j.size()) {
    FlConfig probe;
    for (auto& [k, v] : j.items()) {
      bool found = false;
      fields(probe, [&](const char* name, auto&) { found = found || k == name; });
      if (!found) throw ConfigError(fmt::format("fl: {}: unknown key '{}'", what, k));
    }
  }
  return c;
}

}  // namespace conduit::fl
