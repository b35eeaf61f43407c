#pragma once
// Server-side optimizers of the FedAvg family, on one flat f32 weight buffer.
//
// Each round the server forms the pseudo-gradient delta = the weighted mean over the round's clients of
// (client weights - global weights) and calls step(weights, delta, n). With delta pointing towards the clients,
// every rule below adds to the weights:
//
//   fedavg      w += lr * delta                      (lr = 1: McMahan et al. 2017's plain weighted average)
//   fedavgm     v = momentum * v + delta; w += lr * v  (Hsu, Qi, Brown 2019, FedAvgM)
//   fedadagrad  m = b1 m + (1 - b1) delta;  v += delta^2                            } Reddi et al. 2021,
//   fedadam     m = b1 m + (1 - b1) delta;  v = b2 v + (1 - b2) delta^2             } "Adaptive Federated
//   fedyogi     m = b1 m + (1 - b1) delta;  v = v - (1 - b2) delta^2 sign(v - delta^2) } Optimization", Alg. 2
//               then, for all three: w += lr * m / (sqrt(v) + tau), with m_0 = 0, v_0 = tau^2 and no bias
//               correction, exactly as the paper's Algorithm 2.
//
// State (v, or m and v) is kept in f32 like the weights; each element's update is computed in double.
// A delta with a NaN or infinity is rejected (InvalidArgument naming the first such index) before anything changes.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace conduit::fl {

struct ServerOptConfig {
  std::string name = "fedavg";  // fedavg | fedavgm | fedadagrad | fedadam | fedyogi
  double lr = 1.0;              // server learning rate, finite > 0
  double momentum = 0.9;        // fedavgm, in [0, 1)
  double beta1 = 0.9;           // fedadagrad/fedadam/fedyogi, in [0, 1)
  double beta2 = 0.99;          // fedadam/fedyogi, in [0, 1)
  double tau = 1e-3;            // adaptivity (the paper's tau), finite > 0
};

// The names make_server_optimizer accepts, in a fixed order.
const std::vector<std::string>& server_optimizer_names();

// How a caller's messages name the fields: by default "server optimizer: lr: ..."; `conduit fl` names its own keys
// ("fl: server_lr: ..."), as its other checks do.
struct ServerOptKeys {
  const char* prefix = "server optimizer: ";
  const char* name = "name";
  const char* lr = "lr";
  const char* momentum = "momentum";
  const char* beta1 = "beta1";
  const char* beta2 = "beta2";
  const char* tau = "tau";
};

// ConfigError (one line naming the field as `keys` spell it, and what is allowed) for an unknown name or an
// out-of-range field.
void validate(const ServerOptConfig& config, const ServerOptKeys& keys = {});

// A config from a name and string fields (keys lr, momentum, beta1, beta2, tau; unset keys keep their defaults),
// validated. ConfigError for an unknown key, a value that is not a number, or anything validate() rejects.
ServerOptConfig parse_server_opt(const std::string& name, const std::map<std::string, std::string>& fields = {});

class ServerOptimizer {
 public:
  virtual ~ServerOptimizer();

  // Applies one round's pseudo-gradient. n must equal size(); InvalidArgument for another n, a null buffer, or a
  // non-finite delta element (the weights and the state are left unchanged).
  void step(float* weights, const float* delta, size_t n);

  // The optimizer's state (name, size, rounds taken and its f32 buffers) as bytes, for checkpoints. Native byte
  // order: a checkpoint moves between machines of the same endianness.
  std::vector<uint8_t> save_state() const;
  // Restores save_state()'s bytes. ProtocolError for bytes that are not such a state (bad magic, version, length, a
  // value that is not finite, a negative second moment); ConfigError for the state of another optimizer or of
  // another size. Nothing changes unless it succeeds.
  void load_state(const std::vector<uint8_t>& bytes);

  const std::string& name() const { return name_; }
  size_t size() const { return n_; }
  uint64_t rounds() const { return rounds_; }
  // State buffers (fedavgm: {v}; adaptive: {m, v}; fedavg: none), for inspection and tests.
  const std::vector<std::vector<float>>& state() const { return state_; }

 protected:
  ServerOptimizer(std::string name, size_t n, size_t num_buffers, float init);
  // The rule itself, called after the arguments were checked.
  virtual void apply(float* weights, const float* delta) = 0;
  // Whether state buffer k holds values that are never negative (the adaptive rules' second moment v).
  virtual bool nonnegative_buffer(size_t k) const { return false; }

  std::string name_;
  size_t n_;
  uint64_t rounds_ = 0;
  std::vector<std::vector<float>> state_;
};

// Validates the config (ConfigError) and builds the optimizer for n weights.
std::unique_ptr<ServerOptimizer> make_server_optimizer(const ServerOptConfig& config, size_t n);

}  // namespace conduit::fl
