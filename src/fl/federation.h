#pragma once
// Federated learning over Conduit's transports (torch-free): one server and the processes that host the clients.
//
// Rank 0 of the communicator is the server; ranks 1..W-1 host the virtual clients 0..N-1 (client c on rank
// 1 + c mod (W-1)), as a simulation of N devices on a few processes (Flower's simulation engine does the same). Each
// round the server samples a fraction of the clients, sends the global weights to the hosts of the sampled ones, the
// clients train locally on their own partition of the data (partition.h) and the server aggregates their updates,
// weighted by their sample counts, and applies them with its optimizer (server_opt.h).
//
// Heterogeneity: statistical through the partition (iid, Dirichlet label skew, shards); systems through a speed
// factor per client (lognormal), a round deadline in units of the work a speed-1 client does on a mean-sized
// partition, and a dropout probability. A client whose work does not fit the deadline drops out (FedAvg) or does
// the steps that fit (FedProx's partial work); a dropout leaves after the key exchange, before sending its update.
//
// Secure aggregation (secagg.h, Bonawitz et al. 2017): with it the server learns only the sum of the surviving
// clients' updates (and of their training losses and clipped-element counts, carried as more masked elements);
// the hosts route the protocol's messages through the server, as clients of one do. The clients' sample counts are
// known to the server (as Flower's clients report num_examples), so it divides by the exact summed weight. With
// secagg_neighbors = k (SecAgg+, Bell et al. 2020) each client shares keys and masks with k others of a random
// k-regular graph instead of every other client of the round: its work per round grows with k, not the round's size.
// Differential privacy (privacy.h, DP-FedAvg): clients sampled independently (Poisson, with a secret seed), each update
// clipped to an L2 norm, weights uniform, Gaussian noise from a secret seed added to the sum, divided by the expected
// count, and the privacy spent reported by an RDP accountant.
//
// Every message is framed (length, then bytes) and bounded by what its step can hold; every wait has a deadline: the
// communicator's timeout for one step of a peer, times the most clients a host runs where a wait spans their work
// (training, secure aggregation's key exchange); start-up waits at least CONDUIT_TIMEOUT (coll::CommConfig).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "coll/communicator.h"

namespace conduit::fl {

struct FlConfig {
  // Model and data (the torch side reads these).
  std::string model = "cnn";  // mlp | cnn (models without BatchNorm: its statistics are not averaged)
  std::string dataset = "fashion-mnist";
  std::string data_dir;  // empty: /usr/share/datasets/<dataset> (fill_defaults)
  int64_t train_limit = 0, test_limit = 0;
  int64_t synthetic_samples = 4096;
  uint64_t seed = 42;
  // Federation.
  int clients = 100;      // N virtual clients
  double fraction = 0.1;  // sampled per round
  int min_clients = 2;    // at least this many sampled
  int rounds = 30;
  std::string partition = "dirichlet:0.5";  // partition.h
  // Local training.
  int local_epochs = 1;
  int batch_size = 32;
  double lr = 0.05, momentum = 0.0, weight_decay = 0.0;
  double mu = 0.0;  // FedProx's proximal term (0: FedAvg)
  // SCAFFOLD (Karimireddy et al. 2020): control variates c (server) and c_i (each client) correct the local gradient
  // by c - c_i; option II's c_i update from the local progress (plain SGD: momentum 0; not with DP).
  bool scaffold = false;
  // Server optimizer (server_opt.h).
  std::string server_opt = "fedavg";
  double server_lr = 1.0, server_momentum = 0.9, beta1 = 0.9, beta2 = 0.99, tau = 1e-3;
  // Systems heterogeneity.
  double speed_sigma = 0.0;                         // client speed factors exp(N(0, sigma^2)) (0: all 1)
  double deadline = 0.0;                            // round deadline in units of a speed-1 client's full work (0: none)
  std::string stragglers = "drop";                  // drop | partial
  double dropout = 0.0;                             // probability a sampled client leaves after the key exchange
  double uplink_mbps = 10.0, downlink_mbps = 50.0;  // the modelled round time's client links
  // Secure aggregation.
  bool secagg = true;
  int secagg_bits = 32;
  double secagg_clip = 1.0;       // per element of a weighted update
  double secagg_threshold = 0.5;  // t = floor(secagg_threshold * group) + 1, in [2, group]
  // SecAgg+ (Bell et al. 2020): each client pairs with k others (even) of a random k-regular graph; 0, or k at least
  // the round's sampled - 1, pairs every two. group = k + 1 (or sampled): the clients t counts among. -1 (`auto`):
  // each round's k from choose_neighbors (secagg.h) for the round's clients, secagg_max_corrupt and
  // secagg_max_dropout.
  int secagg_neighbors = 0;
  double secagg_max_corrupt = 0.05;  // auto: the fraction of a round's clients that may collude with the server
  double secagg_max_dropout = 0.1;   // auto: the fraction of a round's clients that may drop out
  // Differential privacy (0: off).
  double dp_clip = 0.0, dp_noise = 0.0, dp_delta = 1e-5;
  // Tests only (no key, no flag): a fixed seed for DP's sampling and noise; 0 draws them from the OS.
  uint64_t dp_secret_seed_for_testing = 0;
  // Tests only: hosts send DP updates unclipped (a host that does not clip, which the server must refuse).
  bool dp_unclipped_for_testing = false;
  // Tests only: the bytes of updates a host keeps posted (0: 256 MiB).
  uint64_t host_window_bytes_for_testing = 0;
  // Running.
  int workers = 3;  // processes: the server and W-1 client hosts
  std::string transport = "auto";
  double timeout_s = 300;
  int eval_every = 1;  // rounds between evaluations of the global model (the last round always)
  std::string output;
  int checkpoint_every = 0;  // rounds between checkpoints in <output>/checkpoints (checkpoint.h; 0: none)
  std::string resume;        // a run's output or checkpoints folder to continue from (empty: start afresh)
  bool progress = true;
};

struct ServerOptConfig;  // server_opt.h
// The server optimizer's settings of the config (server_opt.h).
ServerOptConfig server_opt_config(const FlConfig& c);
// Fills what defaults from other fields (data_dir from the dataset).
void fill_defaults(FlConfig& c);
// Checks every field; ConfigError with one line naming the field and what is allowed.
void check_config(const FlConfig& c);
// Checks that `samples` training samples (after train_limit) can be split over the clients as the partition asks.
void check_sample_count(const FlConfig& c, int64_t samples);
// Clients sampled per round by fixed-size sampling (DP samples each client with probability `fraction` instead).
int clients_per_round(const FlConfig& c);
// Under DP (Poisson sampling) the most clients a round may have under secure aggregation: the mean plus six standard
// deviations plus one (exceeded about 2e-7 of rounds at a mean of 2, less for larger means; such a round is
// abandoned), at most all of them.
int dp_max_sampled(const FlConfig& c);
// The configuration as JSON text (written to <output>/config.json) and back.
std::string config_to_json(const FlConfig& c);
FlConfig config_from_json(const std::string& text, const std::string& what);
// Every key with a one-line description (the flags of `conduit fl`: --key-name), and setting one from text
// (ConfigError naming the key when unknown or not a value of its type; check_config checks ranges).
const std::vector<std::pair<std::string, std::string>>& config_keys();
void set_config_value(FlConfig& c, const std::string& key, const std::string& value);

// What the server's and the hosts' model code does (the torch side implements it).
struct LocalWork {
  int64_t max_steps = 0;  // > 0: stop after this many steps (partial work); 0: local_epochs epochs
  uint64_t seed = 0;      // the batches' shuffle
  // SCAFFOLD: added to the gradient of every step, in the weights' flattened order (elements of buffers are not
  // trained and ignore theirs); null: none.
  const std::vector<float>* correction = nullptr;
};
struct LocalResult {
  std::vector<float> delta;  // trained weights minus the global ones
  int64_t examples = 0;      // samples this client holds
  int64_t steps = 0;         // optimizer steps taken
  double loss = 0;           // mean training loss
  double compute_s = 0;      // wall time of the local training
};
struct EvalResult {
  double accuracy = 0, loss = 0;
};
class LocalTrainer {
 public:
  virtual ~LocalTrainer() = default;
  // Weights of the model (parameters and floating-point buffers, flattened), the same on every process for a seed.
  virtual std::vector<float> initial_weights() = 0;
  // Labels of the training samples (what the partition splits) and the number of classes.
  virtual std::vector<int64_t> train_labels() = 0;
  virtual int num_classes() = 0;
  // Trains from `global` on the samples `indices` with the config's local settings (FedProx's mu included).
  virtual LocalResult train(const std::vector<float>& global, const std::vector<int64_t>& indices,
                            const LocalWork& work) = 0;
  virtual EvalResult evaluate(const std::vector<float>& weights) = 0;
};

// One round's record (the server's metrics.jsonl line).
struct RoundRecord {
  int round = 0;  // 1-based
  // (partial: of the aggregated, those that did partial work; an abandoned round aggregates none)
  int sampled = 0, aggregated = 0, stragglers = 0, dropouts = 0, partial = 0;
  // secagg: nothing applied, as fewer than 2 were sampled, more than DP's codec holds, or fewer than the threshold
  // sent (in all, or near one client under SecAgg+); abandon_reason says which
  bool abandoned = false;
  std::string abandon_reason;
  int secagg_neighbors = 0;                   // secagg: the round's k (SecAgg+'s graph), 0 for every pair
  double train_loss = -1;                     // mean over the aggregated clients (-1: none, or withheld under DP)
  double test_accuracy = -1, test_loss = -1;  // -1: not evaluated this round
  double wall_s = 0;                          // this round's wall time
  double modelled_s = 0;                      // the round's time with the configured client links and speeds
  // Down: what the round's clients download (each its own copy of the weights and of secure aggregation's lists,
  // as a deployed federation sends them); up: what reached the server (framing included). wire_bytes_down: what the
  // server sent this simulation's host processes (one copy a host).
  uint64_t bytes_down = 0, bytes_up = 0, wire_bytes_down = 0;
  uint64_t clipped = 0;                       // secagg: elements clipped to secagg_clip
  double epsilon = -1;                        // DP: privacy spent so far at dp_delta (-1: off)
};

struct FlResult {
  std::vector<RoundRecord> rounds;
  std::vector<float> weights;  // the final global model (server)
  double final_accuracy = -1;
  double wall_s = 0;
  uint64_t bytes_down = 0, bytes_up = 0, wire_bytes_down = 0;  // (bytes_down: the rounds' own)
  double label_tv_distance = 0;  // the partition's mean total-variation distance from the global label mix
  int rounds_applied = 0;        // rounds whose aggregate was applied
  uint64_t host_peak_posted_bytes = 0;  // a host: the most bytes of updates it held posted at once
};

// Runs the federation on `comm` (every rank calls it with the same config; size >= 2). The server returns the
// rounds' records and the final weights; the hosts return only host_peak_posted_bytes. The server writes
// <output>/metrics.jsonl and summary.json when output is set. `on_round` (server) sees each record as it completes.
// Error (on the server, after the records are written) when no round applied an update: the run's settings leave
// nothing to learn from.
// Refuses (ConfigError) a secure aggregation whose share relay would not fit this machine's memory: every pair of
// m clients a round relays m (m - 1) key shares, held several times over by the server and the hosts (the fraction
// of them on this machine: local_host_fraction). SecAgg+'s k shares a client keep it m k.
void check_secagg_memory(const FlConfig& c, double local_host_fraction);

FlResult run_federation(const FlConfig& c, coll::CommPtr comm, LocalTrainer& trainer,
                        const std::function<void(const RoundRecord&)>& on_round = {});

}  // namespace conduit::fl
