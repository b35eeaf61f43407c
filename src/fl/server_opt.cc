#include "fl/server_opt.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <system_error>
#include <utility>

#include "core/error.h"

namespace conduit::fl {
namespace {

constexpr uint32_t kStateMagic = 0x4F534643;  // "CFSO" in little-endian bytes
constexpr uint32_t kStateVersion = 1;

std::string allowed_names() { return fmt::format("{}", fmt::join(server_optimizer_names(), ", ")); }

void check_unit(const char* prefix, const char* field, double v) {
  if (!(v >= 0 && v < 1))
    throw ConfigError(fmt::format("{}{}: {} is out of range; allowed: a number in [0, 1)", prefix, field, v));
}

void check_positive(const char* prefix, const char* field, double v) {
  if (!(std::isfinite(v) && v > 0))
    throw ConfigError(fmt::format("{}{}: {} is out of range; allowed: a finite number > 0", prefix, field, v));
}

class FedAvg final : public ServerOptimizer {
 public:
  FedAvg(const ServerOptConfig& c, size_t n) : ServerOptimizer("fedavg", n, 0, 0.0f), lr_(c.lr) {}

 protected:
  void apply(float* w, const float* d) override {
    for (size_t i = 0; i < n_; ++i) w[i] = static_cast<float>(double(w[i]) + lr_ * double(d[i]));
  }

 private:
  double lr_;
};

class FedAvgM final : public ServerOptimizer {
 public:
  FedAvgM(const ServerOptConfig& c, size_t n) : ServerOptimizer("fedavgm", n, 1, 0.0f), lr_(c.lr), mu_(c.momentum) {}

 protected:
  void apply(float* w, const float* d) override {
    float* v = state_[0].data();
    for (size_t i = 0; i < n_; ++i) {
      const double vi = mu_ * double(v[i]) + double(d[i]);
      v[i] = static_cast<float>(vi);
      w[i] = static_cast<float>(double(w[i]) + lr_ * vi);
    }
  }

 private:
  double lr_, mu_;
};

enum class Second { kAdagrad, kAdam, kYogi };

class Adaptive final : public ServerOptimizer {
 public:
  Adaptive(const ServerOptConfig& c, size_t n, Second kind)
      : ServerOptimizer(c.name, n, 2, static_cast<float>(c.tau * c.tau)),
        lr_(c.lr),
        b1_(c.beta1),
        b2_(c.beta2),
        tau_(c.tau),
        kind_(kind) {
    std::fill(state_[0].begin(), state_[0].end(), 0.0f);  // m_0 = 0; v_0 = tau^2 from the base
  }

 protected:
  bool nonnegative_buffer(size_t k) const override { return k == 1; }  // v
  void apply(float* w, const float* d) override {
    float* m = state_[0].data();
    float* v = state_[1].data();
    for (size_t i = 0; i < n_; ++i) {
      const double di = d[i], d2 = di * di;
      const double mi = b1_ * double(m[i]) + (1 - b1_) * di;
      double vi = v[i];
      switch (kind_) {
        case Second::kAdagrad:
          vi = vi + d2;
          break;
        case Second::kAdam:
          vi = b2_ * vi + (1 - b2_) * d2;
          break;
        case Second::kYogi: {
          const double diff = vi - d2;
          const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
          vi = vi - (1 - b2_) * d2 * sign;
          break;
        }
      }
      m[i] = static_cast<float>(mi);
      v[i] = static_cast<float>(vi);
      w[i] = static_cast<float>(double(w[i]) + lr_ * mi / (std::sqrt(vi) + tau_));
    }
  }

 private:
  double lr_, b1_, b2_, tau_;
  Second kind_;
};

void put(std::vector<uint8_t>& out, const void* p, size_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + bytes);
}

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& b) : b_(b) {}
  void get(void* p, size_t bytes, const char* what) {
    if (b_.size() - pos_ < bytes) {
      throw ProtocolError(
          fmt::format("server optimizer state: truncated at {} ({} bytes, {} needed at offset {}); "
                      "allowed: the bytes save_state() produced",
                      what, b_.size(), bytes, pos_));
    }
    std::memcpy(p, b_.data() + pos_, bytes);
    pos_ += bytes;
  }
  size_t left() const { return b_.size() - pos_; }

 private:
  const std::vector<uint8_t>& b_;
  size_t pos_ = 0;
};

}  // namespace

const std::vector<std::string>& server_optimizer_names() {
  static const std::vector<std::string> names = {"fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"};
  return names;
}

void validate(const ServerOptConfig& c, const ServerOptKeys& k) {
  bool known = false;
  for (const auto& n : server_optimizer_names()) known = known || n == c.name;
  if (!known)
    throw ConfigError(fmt::format("{}{}: '{}' is not known; allowed: {}", k.prefix, k.name, c.name, allowed_names()));
  check_positive(k.prefix, k.lr, c.lr);
  check_unit(k.prefix, k.momentum, c.momentum);
  check_unit(k.prefix, k.beta1, c.beta1);
  check_unit(k.prefix, k.beta2, c.beta2);
  check_positive(k.prefix, k.tau, c.tau);
}

ServerOptConfig parse_server_opt(const std::string& name, const std::map<std::string, std::string>& fields) {
  ServerOptConfig c;
  c.name = name;
  for (const auto& [key, value] : fields) {
    double* dst = key == "lr"         ? &c.lr
                  : key == "momentum" ? &c.momentum
                  : key == "beta1"    ? &c.beta1
                  : key == "beta2"    ? &c.beta2
                  : key == "tau"      ? &c.tau
                                      : nullptr;
    if (!dst) {
      throw ConfigError(
          fmt::format("server optimizer: unknown field '{}'; allowed: lr, momentum, beta1, beta2, tau", key));
    }
    double v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size()) {
      throw ConfigError(
          fmt::format("server optimizer: {}='{}' is not a number; allowed: a decimal number", key, value));
    }
    *dst = v;
  }
  validate(c);
  return c;
}

ServerOptimizer::ServerOptimizer(std::string name, size_t n, size_t num_buffers, float init)
    : name_(std::move(name)), n_(n), state_(num_buffers, std::vector<float>(n, init)) {}

ServerOptimizer::~ServerOptimizer() = default;

void ServerOptimizer::step(float* weights, const float* delta, size_t n) {
  if (n != n_) {
    throw InvalidArgument(
        fmt::format("{}: step with {} elements; allowed: {} (the size it was made for)", name_, n, n_));
  }
  if (n > 0 && (!weights || !delta)) {
    throw InvalidArgument(fmt::format("{}: step with a null {} buffer", name_, weights ? "delta" : "weights"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(delta[i])) {
      throw InvalidArgument(fmt::format("{}: delta[{}] is {} in round {}; allowed: finite values (weights unchanged)",
                                        name_, i, delta[i], rounds_));
    }
  }
  apply(weights, delta);
  ++rounds_;
}

std::vector<uint8_t> ServerOptimizer::save_state() const {
  std::vector<uint8_t> out;
  const auto name_len = static_cast<uint32_t>(name_.size());
  const auto n = static_cast<uint64_t>(n_);
  const auto buffers = static_cast<uint32_t>(state_.size());
  out.reserve(32 + name_.size() + state_.size() * n_ * sizeof(float));
  put(out, &kStateMagic, 4);
  put(out, &kStateVersion, 4);
  put(out, &name_len, 4);
  put(out, name_.data(), name_.size());
  put(out, &n, 8);
  put(out, &rounds_, 8);
  put(out, &buffers, 4);
  for (const auto& b : state_) put(out, b.data(), b.size() * sizeof(float));
  return out;
}

void ServerOptimizer::load_state(const std::vector<uint8_t>& bytes) {
  Reader r(bytes);
  uint32_t magic = 0, version = 0, name_len = 0, buffers = 0;
  uint64_t n = 0, rounds = 0;
  r.get(&magic, 4, "magic");
  if (magic != kStateMagic) {
    throw ProtocolError(
        fmt::format("{}: load_state: bad magic {:#010x}; allowed: the bytes save_state() produced", name_, magic));
  }
  r.get(&version, 4, "version");
  if (version != kStateVersion) {
    throw ProtocolError(fmt::format("{}: load_state: state version {}; allowed: {}", name_, version, kStateVersion));
  }
  r.get(&name_len, 4, "name length");
  if (name_len > r.left()) {
    throw ProtocolError(
        fmt::format("{}: load_state: name length {} exceeds the {} bytes left", name_, name_len, r.left()));
  }
  std::string name(name_len, '\0');
  r.get(name.data(), name_len, "name");
  if (name != name_) {
    throw ConfigError(
        fmt::format("{}: load_state: the state is of server optimizer '{}'; allowed: a {} state", name_, name, name_));
  }
  r.get(&n, 8, "size");
  if (n != n_) {
    throw ConfigError(
        fmt::format("{}: load_state: the state is for {} weights; allowed: {} (this optimizer's size)", name_, n, n_));
  }
  r.get(&rounds, 8, "rounds");
  r.get(&buffers, 4, "buffer count");
  if (buffers != state_.size()) {
    throw ProtocolError(fmt::format("{}: load_state: {} state buffers; allowed: {}", name_, buffers, state_.size()));
  }
  if (r.left() != static_cast<size_t>(buffers) * n_ * sizeof(float)) {
    throw ProtocolError(fmt::format("{}: load_state: {} bytes of buffers; allowed: exactly {}", name_, r.left(),
                                    static_cast<size_t>(buffers) * n_ * sizeof(float)));
  }
  std::vector<std::vector<float>> state(state_.size(), std::vector<float>(n_));
  for (size_t k = 0; k < state.size(); ++k) {
    r.get(state[k].data(), n_ * sizeof(float), "buffer");
    // (step() keeps them finite, and the adaptive second moments >= 0: a damaged state would move every weight it
    // touches to nan, or take the square root of a negative moment)
    const bool moment = nonnegative_buffer(k);
    for (size_t i = 0; i < n_; ++i)
      if (!std::isfinite(state[k][i]) || (moment && state[k][i] < 0))
        throw ProtocolError(fmt::format("{}: load_state: element {} of state buffer {} is {}; allowed: finite{}", name_,
                                        i, k, state[k][i], moment ? " and >= 0 (a second moment)" : ""));
  }
  // Everything checked: now overwrite.
  state_ = std::move(state);
  rounds_ = rounds;
}

std::unique_ptr<ServerOptimizer> make_server_optimizer(const ServerOptConfig& config, size_t n) {
  validate(config);
  if (config.name == "fedavg") return std::make_unique<FedAvg>(config, n);
  if (config.name == "fedavgm") return std::make_unique<FedAvgM>(config, n);
  if (config.name == "fedadagrad") return std::make_unique<Adaptive>(config, n, Second::kAdagrad);
  if (config.name == "fedadam") return std::make_unique<Adaptive>(config, n, Second::kAdam);
  return std::make_unique<Adaptive>(config, n, Second::kYogi);
}

}  // namespace conduit::fl
