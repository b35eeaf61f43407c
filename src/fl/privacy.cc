#include "fl/privacy.h"

#include <fmt/format.h>
#include <sodium.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include "core/error.h"
#include "fl/log_choose.h"

namespace conduit::fl {
namespace {

void check_mechanism(double sigma, double q) {
  if (!(std::isfinite(sigma) && sigma > 0)) {
    throw InvalidArgument(fmt::format("rdp accountant: noise_multiplier is {}; allowed: finite and > 0", sigma));
  }
  if (!(q > 0 && q <= 1)) {
    throw InvalidArgument(fmt::format("rdp accountant: sampling_rate is {}; allowed: (0, 1]", q));
  }
}

// log(exp(x) - 1) for x > 0, accurate for tiny and huge x.
double log_expm1(double x) { return x > 1 ? x + std::log1p(-std::exp(-x)) : std::log(std::expm1(x)); }

void start_sodium() {
  if (sodium_init() < 0) throw Error("fl: libsodium cannot start (no entropy source?): DP needs secret randomness");
}

double norm2(const float* x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return std::sqrt(s);
}

}  // namespace

double clip_l2(float* x, size_t n, double clip) {
  if (!(std::isfinite(clip) && clip > 0)) {
    throw InvalidArgument(fmt::format("clip_l2: clip is {}; allowed: finite and > 0", clip));
  }
  if (n > 0 && !x) throw InvalidArgument(fmt::format("clip_l2: a null buffer of {} elements", n));
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) {
      throw InvalidArgument(fmt::format("clip_l2: x[{}] is {}; allowed: finite values (x unchanged)", i, x[i]));
    }
  }
  const double before = norm2(x, n);
  double norm = before;
  if (norm <= clip) return before;
  const double s = clip / norm;
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(double(x[i]) * s);
  // Rounding each scaled element to f32 can leave the norm up to about 2^-24 (relative) above clip, and the clip is
  // the sensitivity the privacy guarantee rests on: move every element one ulp towards zero until it is within (each
  // pass shrinks the norm by at least 2^-24 relative; one pass suffices in practice).
  for (norm = norm2(x, n); norm > clip;) {
    for (size_t i = 0; i < n; ++i) x[i] = std::nextafter(x[i], 0.0f);
    norm = norm2(x, n);
  }
  return before;
}

SecretKey random_secret() {
  start_sodium();
  SecretKey k;
  randombytes_buf(k.data(), k.size());
  return k;
}

SecretKey secret_from_seed(uint64_t seed) {
  start_sodium();
  SecretKey k;
  crypto_generichash(k.data(), k.size(), reinterpret_cast<const unsigned char*>(&seed), sizeof seed, nullptr, 0);
  return k;
}

SecretKey derive_key(const SecretKey& secret, uint64_t purpose, uint64_t index) {
  start_sodium();
  const uint64_t in[2] = {purpose, index};
  SecretKey k;
  crypto_generichash(k.data(), k.size(), reinterpret_cast<const unsigned char*>(in), sizeof in, secret.data(),
                     secret.size());
  return k;
}

uint64_t KeyStream::next() {
  if (at_ == words_.size()) {
    static const std::array<uint8_t, sizeof words_> zeros{};
    static const std::array<uint8_t, crypto_stream_chacha20_NONCEBYTES> nonce{};
    auto* out = reinterpret_cast<unsigned char*>(words_.data());
    crypto_stream_chacha20_xor_ic(out, zeros.data(), zeros.size(), nonce.data(), block_, key_.data());
    block_ += sizeof words_ / 64;
    at_ = 0;
  }
  return words_[at_++];
}

double KeyStream::unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

void add_gaussian_noise(float* x, size_t n, double stddev, const SecretKey& key) {
  if (!(std::isfinite(stddev) && stddev >= 0)) {
    throw InvalidArgument(fmt::format("add_gaussian_noise: stddev is {}; allowed: finite and >= 0", stddev));
  }
  if (n > 0 && !x) throw InvalidArgument(fmt::format("add_gaussian_noise: a null buffer of {} elements", n));
  if (stddev == 0) return;
  KeyStream rng(key);
  for (size_t i = 0; i < n; i += 2) {
    // Box-Muller: u1 in (0, 1] keeps the logarithm finite.
    const double u1 = 1.0 - rng.unit();
    const double u2 = rng.unit();
    const double r = std::sqrt(-2.0 * std::log(u1)) * stddev;
    const double t = 2.0 * std::numbers::pi * u2;
    x[i] = static_cast<float>(double(x[i]) + r * std::cos(t));
    if (i + 1 < n) x[i + 1] = static_cast<float>(double(x[i + 1]) + r * std::sin(t));
  }
}

double dp_fedavg_noise_stddev(double noise_multiplier, double clip, double expected_clients) {
  if (!(std::isfinite(noise_multiplier) && noise_multiplier >= 0)) {
    throw InvalidArgument(fmt::format("dp-fedavg: noise_multiplier is {}; allowed: finite and >= 0", noise_multiplier));
  }
  if (!(std::isfinite(clip) && clip > 0)) {
    throw InvalidArgument(fmt::format("dp-fedavg: clip is {}; allowed: finite and > 0", clip));
  }
  if (!(std::isfinite(expected_clients) && expected_clients > 0)) {
    throw InvalidArgument(
        fmt::format("dp-fedavg: expected_clients is {}; allowed: finite and > 0 (q * clients)", expected_clients));
  }
  return noise_multiplier * clip / expected_clients;
}

double sampled_gaussian_rdp(double noise_multiplier, double sampling_rate, int order) {
  check_mechanism(noise_multiplier, sampling_rate);
  if (order < 2)
    throw InvalidArgument(fmt::format("sampled_gaussian_rdp: order is {}; allowed: an integer >= 2", order));
  const double a = order, two_var = 2.0 * noise_multiplier * noise_multiplier;
  if (sampling_rate == 1.0) return a / two_var;
  const double log_q = std::log(sampling_rate), log_1mq = std::log1p(-sampling_rate);
  // log of sum_{k>=2} C(a,k) (1-q)^{a-k} q^k expm1((k^2-k)/(2 sigma^2)), by a running log-sum-exp.
  double log_s = -std::numeric_limits<double>::infinity();
  for (int k = 2; k <= order; ++k) {
    const double term =
        log_choose(order, k) + (order - k) * log_1mq + k * log_q + log_expm1((double(k) * k - k) / two_var);
    if (std::isinf(log_s)) {
      log_s = term;
    } else {
      const double hi = std::max(log_s, term), lo = std::min(log_s, term);
      log_s = hi + std::log1p(std::exp(lo - hi));
    }
  }
  // log A = log(1 + S)
  const double log_a = log_s > 0 ? log_s + std::log1p(std::exp(-log_s)) : std::log1p(std::exp(log_s));
  return log_a / (a - 1.0);
}

RdpAccountant::RdpAccountant(double noise_multiplier, double sampling_rate)
    : sigma_(noise_multiplier), q_(sampling_rate) {
  check_mechanism(noise_multiplier, sampling_rate);
  rdp_per_step_.reserve(kMaxOrder - kMinOrder + 1);
  for (int a = kMinOrder; a <= kMaxOrder; ++a) rdp_per_step_.push_back(sampled_gaussian_rdp(sigma_, q_, a));
}

void RdpAccountant::step(int64_t n) {
  if (n < 0) throw InvalidArgument(fmt::format("rdp accountant: step({}); allowed: n >= 0", n));
  steps_ += n;
}

double RdpAccountant::rdp(int order) const {
  if (order < kMinOrder || order > kMaxOrder) {
    throw InvalidArgument(
        fmt::format("rdp accountant: order {}; allowed: an integer in [{}, {}]", order, kMinOrder, kMaxOrder));
  }
  return static_cast<double>(steps_) * rdp_per_step_[static_cast<size_t>(order - kMinOrder)];
}

int RdpAccountant::best_order(double delta) const {
  if (!(delta > 0 && delta < 1)) {
    throw InvalidArgument(fmt::format("rdp accountant: delta is {}; allowed: (0, 1)", delta));
  }
  if (steps_ == 0) return kMinOrder;
  const double log_inv_delta = -std::log(delta);
  int best = kMinOrder;
  double best_eps = std::numeric_limits<double>::infinity();
  for (int a = kMinOrder; a <= kMaxOrder; ++a) {
    const double eps = rdp(a) + log_inv_delta / (a - 1.0);
    if (eps < best_eps) {
      best_eps = eps;
      best = a;
    }
  }
  return best;
}

double RdpAccountant::epsilon(double delta) const {
  const int a = best_order(delta);
  if (steps_ == 0) return 0.0;
  return rdp(a) - std::log(delta) / (a - 1.0);
}

}  // namespace conduit::fl
