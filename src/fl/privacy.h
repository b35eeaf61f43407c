#pragma once
// Client-level differential privacy for federated averaging (DP-FedAvg, McMahan, Ramage, Talwar, Zhang 2018,
// "Learning Differentially Private Recurrent Language Models"):
//
//   each sampled client:  delta_k = client weights - global weights;  clip_l2(delta_k, S)
//   server:               sum the clipped deltas, divide by the expected number of clients q*N (the paper's
//                         fixed-denominator estimator), add_gaussian_noise(.., dp_fedavg_noise_stddev(z, S, q*N)),
//                         then hand the result to a ServerOptimizer.
//   accounting:           RdpAccountant(z, q).step() once per round; epsilon(delta) for reports.
//
// The accountant is the sampled Gaussian mechanism's Renyi DP (Mironov, Talwar, Zhang 2019, "Renyi Differential
// Privacy of the Sampled Gaussian Mechanism", Section 3.3): for an integer order a >= 2,
//
//   A_a = sum_{k=0}^{a} C(a,k) (1-q)^{a-k} q^k exp((k^2 - k) / (2 z^2)),   RDP(a) = log(A_a) / (a - 1),
//
// computed as log A_a = log1p(sum_{k>=2} C(a,k) (1-q)^{a-k} q^k expm1((k^2 - k) / (2 z^2))) (the binomial
// weights sum to 1 and the k = 0, 1 exponents are 0, so those parts are exact; every remaining term is >= 0 and is
// summed in log space), so it neither overflows at large orders nor loses a small q's tiny RDP to cancellation. q = 1
// is the plain Gaussian mechanism, RDP(a) = a / (2 z^2). Orders kMinOrder..kMaxOrder (integers only: no fractional
// orders), composed over steps by multiplication, converted with the classic bound (Mironov 2017, Proposition 3)
//   epsilon = min_a  steps * RDP(a) + log(1/delta) / (a - 1).
// Integer orders and the classic conversion give a slightly larger (more conservative) epsilon than TF-Privacy's
// or Opacus' fractional orders and improved conversion.
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace conduit::fl {

// Scales x[0..n) so that its L2 norm is at most `clip` (unchanged if already within) and returns the norm before
// clipping (accumulated in double). InvalidArgument: clip not finite > 0, a null x with n > 0, or a non-finite
// element (named by index; x unchanged).
double clip_l2(float* x, size_t n, double clip);

// A 256-bit secret key. DP's noise and Poisson sampling are drawn from ChaCha20 keystreams (libsodium) under keys
// derived from one such secret per run: a generator whose state its outputs reveal (std::mt19937_64's is linear in
// them) would let an observer of released models rebuild the noise and take it off.
using SecretKey = std::array<uint8_t, 32>;
// A fresh secret from the operating system's randomness; Error when libsodium cannot start.
SecretKey random_secret();
// A secret derived from a 64-bit seed (BLAKE2b): for tests, where runs must repeat.
SecretKey secret_from_seed(uint64_t seed);
// The key of one use of the secret: BLAKE2b keyed with it over (purpose, index), e.g. (noise, round).
SecretKey derive_key(const SecretKey& secret, uint64_t purpose, uint64_t index);

// Uniform 64-bit words of the ChaCha20 keystream under `key` (nonce 0), in order.
class KeyStream {
 public:
  explicit KeyStream(const SecretKey& key) : key_(key) {}
  uint64_t next();
  double unit();  // uniform in [0, 1), the word's top 53 bits

 private:
  SecretKey key_;
  std::array<uint64_t, 512> words_{};
  size_t at_ = 512;
  uint64_t block_ = 0;  // the keystream's next 64-byte block
};

// Adds independent N(0, stddev^2) noise to each of x[0..n): Box-Muller on KeyStream(key), the same on every platform.
// stddev 0 leaves x unchanged. InvalidArgument: stddev not finite >= 0, or a null x with n > 0.
void add_gaussian_noise(float* x, size_t n, double stddev, const SecretKey& key);

// The noise standard deviation DP-FedAvg adds to the average of clipped updates: z * clip / expected_clients
// (McMahan et al. 2018, Algorithm 1 with the fixed denominator W = q*N). InvalidArgument for non-positive or
// non-finite arguments (z may be 0).
double dp_fedavg_noise_stddev(double noise_multiplier, double clip, double expected_clients);

// The Renyi DP of one step of the sampled Gaussian mechanism at integer order >= 2 (see the top of this file).
// InvalidArgument: noise_multiplier not finite > 0, sampling_rate outside (0, 1], order < 2.
double sampled_gaussian_rdp(double noise_multiplier, double sampling_rate, int order);

class RdpAccountant {
 public:
  static constexpr int kMinOrder = 2;
  static constexpr int kMaxOrder = 256;

  // InvalidArgument: noise_multiplier not finite > 0, sampling_rate outside (0, 1].
  RdpAccountant(double noise_multiplier, double sampling_rate);

  // Records n more steps (rounds) of the mechanism. InvalidArgument for n < 0.
  void step(int64_t n = 1);
  int64_t steps() const { return steps_; }

  // The smallest epsilon over the orders at which the steps so far are (epsilon, delta)-DP; 0 before any step.
  // InvalidArgument for delta outside (0, 1).
  double epsilon(double delta) const;
  // The order that attains epsilon(delta) (kMinOrder before any step).
  int best_order(double delta) const;
  // The composed RDP at `order` (steps * per-step RDP). InvalidArgument outside [kMinOrder, kMaxOrder].
  double rdp(int order) const;

  double noise_multiplier() const { return sigma_; }
  double sampling_rate() const { return q_; }

 private:
  double sigma_, q_;
  int64_t steps_ = 0;
  std::vector<double> rdp_per_step_;  // index order - kMinOrder
};

}  // namespace conduit::fl
