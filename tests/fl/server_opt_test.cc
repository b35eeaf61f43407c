// Server optimizers (FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi): the update rules against hand-computed values,
// checkpoint round trips, and rejection of bad configs and non-finite pseudo-gradients.
#include "fl/server_opt.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../error_of.h"
#include "core/error.h"

using namespace conduit;
using namespace conduit::fl;

namespace {

ServerOptConfig config(const std::string& name, double lr = 1.0) {
  ServerOptConfig c;
  c.name = name;
  c.lr = lr;
  return c;
}

using conduit::test::error_of;

}  // namespace

TEST(FlServerOpt, FedAvgWithUnitLrIsTheWeightedAverage) {
  const std::vector<float> global = {1.0f, -2.0f, 0.5f};
  const std::vector<std::vector<float>> clients = {{2.0f, -1.0f, 0.0f}, {0.0f, -4.0f, 1.5f}, {1.0f, 0.0f, 0.5f}};
  const std::vector<double> samples = {10, 30, 60};
  std::vector<float> delta(3, 0.0f), average(3, 0.0f);
  for (size_t k = 0; k < clients.size(); ++k) {
    for (size_t i = 0; i < 3; ++i) {
      delta[i] += static_cast<float>(samples[k] / 100 * (clients[k][i] - global[i]));
      average[i] += static_cast<float>(samples[k] / 100 * clients[k][i]);
    }
  }
  auto opt = make_server_optimizer(config("fedavg"), 3);
  EXPECT_EQ(opt->name(), "fedavg");
  auto w = global;
  opt->step(w.data(), delta.data(), w.size());
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(w[i], average[i], 1e-5) << i;
  EXPECT_EQ(opt->rounds(), 1u);

  auto half = make_server_optimizer(config("fedavg", 0.5), 3);
  w = global;
  half->step(w.data(), delta.data(), w.size());
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(w[i], global[i] + 0.5 * delta[i], 1e-5) << i;
}

TEST(FlServerOpt, FedAvgMomentumAccumulates) {
  ServerOptConfig c = config("fedavgm");
  c.momentum = 0.9;
  auto opt = make_server_optimizer(c, 2);
  std::vector<float> w = {0.0f, 1.0f};
  const std::vector<float> d = {1.0f, -0.5f};
  opt->step(w.data(), d.data(), 2);  // v = d
  EXPECT_NEAR(w[0], 1.0, 1e-6);
  EXPECT_NEAR(w[1], 0.5, 1e-6);
  opt->step(w.data(), d.data(), 2);  // v = 1.9 d
  EXPECT_NEAR(w[0], 2.9, 1e-6);
  EXPECT_NEAR(w[1], 1.0 - 0.5 * 2.9, 1e-6);
  opt->step(w.data(), d.data(), 2);  // v = 2.71 d
  EXPECT_NEAR(w[0], 5.61, 1e-5);
  EXPECT_NEAR(opt->state()[0][0], 2.71, 1e-6);
}

// Two rounds of Reddi et al.'s Algorithm 2 with lr 0.1, beta1 0.9, beta2 0.99, tau 1e-3, w0 = (1, -2),
// delta1 = (0.5, -1), delta2 = (0.1, 2), m0 = 0, v0 = tau^2. Expected values were computed by hand from the paper's
// formulas at 60 significant digits (mpmath), e.g. FedAdam round 1, coordinate 0: m = 0.05, v = 0.99e-6 + 0.0025
// = 0.00250099, w = 1 + 0.1 * 0.05 / (sqrt(0.00250099) + 0.001) = 1.09802019.
struct AdaptiveCase {
  const char* name;
  double w1[2], w2[2], v2[2];
};

class FlServerOptAdaptive : public ::testing::TestWithParam<AdaptiveCase> {};

TEST_P(FlServerOptAdaptive, MatchesAlgorithm2ByHand) {
  const AdaptiveCase& k = GetParam();
  ServerOptConfig c = config(k.name, 0.1);
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.tau = 1e-3;
  auto opt = make_server_optimizer(c, 2);
  ASSERT_EQ(opt->state().size(), 2u);
  EXPECT_FLOAT_EQ(opt->state()[1][0], 1e-6f);  // v0 = tau^2
  std::vector<float> w = {1.0f, -2.0f};
  const std::vector<float> d1 = {0.5f, -1.0f}, d2 = {0.1f, 2.0f};
  opt->step(w.data(), d1.data(), 2);
  EXPECT_NEAR(w[0], k.w1[0], 2e-6);
  EXPECT_NEAR(w[1], k.w1[1], 2e-6);
  opt->step(w.data(), d2.data(), 2);
  EXPECT_NEAR(w[0], k.w2[0], 2e-6);
  EXPECT_NEAR(w[1], k.w2[1], 2e-6);
  EXPECT_NEAR(opt->state()[0][0], 0.055, 1e-7);  // m = 0.9 * 0.05 + 0.1 * 0.1
  EXPECT_NEAR(opt->state()[0][1], 0.11, 1e-7);   // m = 0.9 * -0.1 + 0.1 * 2
  // v is kept in f32: a few units in the last place of its value.
  EXPECT_NEAR(opt->state()[1][0], k.v2[0], 4e-7 * k.v2[0]);
  EXPECT_NEAR(opt->state()[1][1], k.v2[1], 4e-7 * k.v2[1]);
}

INSTANTIATE_TEST_SUITE_P(
    Reddi2021, FlServerOptAdaptive,
    ::testing::Values(
        // v += delta^2
        AdaptiveCase{"fedadagrad", {1.00998002, -2.009990005}, {1.02074527433, -2.00507285496}, {0.260001, 5.000001}},
        // v = 0.99 v + 0.01 delta^2
        AdaptiveCase{
            "fedadam", {1.09802019012, -2.09900504888}, {1.20429193477, -2.04998222371}, {0.0025759801, 0.0499009801}},
        // v -= 0.01 delta^2 sign(v - delta^2): here v < delta^2 throughout, so v grows by 0.01 delta^2 each round
        AdaptiveCase{"fedyogi", {1.098019998, -2.09900499988}, {1.20378922877, -2.05003101244}, {0.002601, 0.050001}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(FlServerOpt, YogiShrinksVWhenItExceedsDeltaSquared) {
  // After a large delta, a small one makes sign(v - delta^2) = +1: v decreases additively (Adam would decay it
  // multiplicatively).
  ServerOptConfig c = config("fedyogi", 0.1);
  auto opt = make_server_optimizer(c, 1);
  float w = 0;
  const float big = 10.0f, small = 0.1f;
  opt->step(&w, &big, 1);
  const double v1 = opt->state()[1][0];  // 1e-6 + 0.01 * 100 = 1.000001
  EXPECT_NEAR(v1, 1.000001, 1e-6);
  opt->step(&w, &small, 1);
  EXPECT_NEAR(opt->state()[1][0], v1 - 0.01 * 0.01, 1e-6);
}

TEST(FlServerOpt, SaveLoadContinuesIdentically) {
  for (const auto& name : server_optimizer_names()) {
    SCOPED_TRACE(name);
    const size_t n = 5;
    auto a = make_server_optimizer(config(name, 0.3), n);
    std::vector<float> w = {0.1f, -0.2f, 0.3f, 0.0f, 1.0f};
    for (int r = 0; r < 3; ++r) {
      std::vector<float> d(n);
      for (size_t i = 0; i < n; ++i) d[i] = 0.05f * static_cast<float>((r + 1) * (int(i) - 2));
      a->step(w.data(), d.data(), n);
    }
    const auto bytes = a->save_state();
    auto b = make_server_optimizer(config(name, 0.3), n);
    b->load_state(bytes);
    EXPECT_EQ(b->rounds(), 3u);
    EXPECT_EQ(b->state(), a->state());
    auto wa = w, wb = w;
    const std::vector<float> d = {0.2f, -0.1f, 0.0f, 0.4f, -0.3f};
    a->step(wa.data(), d.data(), n);
    b->step(wb.data(), d.data(), n);
    EXPECT_EQ(wa, wb);
    EXPECT_EQ(a->save_state(), b->save_state());
  }
}

TEST(FlServerOpt, LoadRejectsForeignOrDamagedState) {
  auto adam = make_server_optimizer(config("fedadam"), 4);
  const auto bytes = adam->save_state();
  EXPECT_THROW(make_server_optimizer(config("fedyogi"), 4)->load_state(bytes), ConfigError);
  EXPECT_THROW(make_server_optimizer(config("fedadam"), 5)->load_state(bytes), ConfigError);
  auto truncated = bytes;
  truncated.pop_back();
  EXPECT_THROW(make_server_optimizer(config("fedadam"), 4)->load_state(truncated), ProtocolError);
  auto longer = bytes;
  longer.push_back(0);
  EXPECT_THROW(make_server_optimizer(config("fedadam"), 4)->load_state(longer), ProtocolError);
  auto bad_magic = bytes;
  bad_magic[0] ^= 0xFF;
  EXPECT_THROW(make_server_optimizer(config("fedadam"), 4)->load_state(bad_magic), ProtocolError);
  EXPECT_THROW(make_server_optimizer(config("fedadam"), 4)->load_state({}), ProtocolError);
  // A failed load leaves the state as it was.
  auto keep = make_server_optimizer(config("fedadam"), 4);
  const auto before = keep->save_state();
  EXPECT_ANY_THROW(keep->load_state(longer));
  EXPECT_EQ(keep->save_state(), before);
}

// A checkpoint's state is what step() leaves: finite buffers, and the adaptive rules' second moment v >= 0. A
// damaged one (a nan, an infinity, a negative v, whose square root is nan) is refused naming the element, and the
// optimizer keeps its state; FedAdam's first moment and FedAvgM's velocity may be negative.
TEST(FlServerOpt, LoadRejectsANonFiniteStateOrANegativeSecondMoment) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const auto& name : server_optimizer_names()) {
    SCOPED_TRACE(name);
    auto src = make_server_optimizer(config(name), 3);
    const auto bytes = src->save_state();
    const size_t buffers = src->state().size(), first = bytes.size() - buffers * 3 * sizeof(float);
    // Element 2 of buffer k set to x (buffer 1 of an adaptive rule is v).
    auto with = [&](size_t k, float x) {
      auto b = bytes;
      std::memcpy(b.data() + first + (k * 3 + 2) * sizeof(float), &x, sizeof x);
      return b;
    };
    for (size_t k = 0; k < buffers; ++k) {
      const bool moment = k == 1;
      for (const float bad : {nan, inf, -inf}) {
        auto dst = make_server_optimizer(config(name), 3);
        const auto before = dst->save_state();
        const std::string msg = error_of<ProtocolError>([&] { dst->load_state(with(k, bad)); });
        EXPECT_NE(msg.find(fmt::format("element 2 of state buffer {} is", k)), std::string::npos) << msg;
        EXPECT_EQ(dst->save_state(), before);
      }
      auto dst = make_server_optimizer(config(name), 3);
      if (moment) {
        const std::string msg = error_of<ProtocolError>([&] { dst->load_state(with(k, -0.5f)); });
        EXPECT_NE(msg.find("element 2 of state buffer 1 is -0.5; allowed: finite and >= 0 (a second moment)"),
                  std::string::npos)
            << msg;
      } else {
        dst->load_state(with(k, -0.5f));
        EXPECT_EQ(dst->state()[k][2], -0.5f);
      }
    }
  }
}

TEST(FlServerOpt, NonFiniteDeltaIsRejectedWithoutTouchingWeightsOrState) {
  for (const auto& name : server_optimizer_names()) {
    SCOPED_TRACE(name);
    auto opt = make_server_optimizer(config(name, 0.5), 4);
    std::vector<float> w = {1, 2, 3, 4};
    const std::vector<float> ok = {0.1f, 0.1f, 0.1f, 0.1f};
    opt->step(w.data(), ok.data(), 4);
    const auto w_before = w;
    const auto state_before = opt->save_state();
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
      std::vector<float> d = {0.1f, 0.2f, 0.3f, bad};
      EXPECT_THROW(opt->step(w.data(), d.data(), 4), InvalidArgument);
      const std::string msg = error_of([&] { opt->step(w.data(), d.data(), 4); });
      EXPECT_NE(msg.find("delta[3]"), std::string::npos) << msg;
      EXPECT_EQ(w, w_before);
      EXPECT_EQ(opt->save_state(), state_before);
    }
    EXPECT_EQ(opt->rounds(), 1u);
  }
}

TEST(FlServerOpt, StepChecksItsArguments) {
  auto opt = make_server_optimizer(config("fedavg"), 3);
  std::vector<float> w(4, 0.0f), d(4, 0.0f);
  EXPECT_THROW(opt->step(w.data(), d.data(), 4), InvalidArgument);
  EXPECT_THROW(opt->step(nullptr, d.data(), 3), InvalidArgument);
  EXPECT_THROW(opt->step(w.data(), nullptr, 3), InvalidArgument);
  auto empty = make_server_optimizer(config("fedadam"), 0);
  EXPECT_NO_THROW(empty->step(nullptr, nullptr, 0));
}

TEST(FlServerOpt, ConfigsAreValidatedWithOneClearLine) {
  const std::string unknown = error_of([] { make_server_optimizer(config("sgd"), 1); });
  EXPECT_NE(unknown.find("'sgd'"), std::string::npos) << unknown;
  for (const auto& name : server_optimizer_names()) EXPECT_NE(unknown.find(name), std::string::npos) << unknown;
  EXPECT_THROW(make_server_optimizer(config("sgd"), 1), ConfigError);

  auto expect_bad = [](const char* field, auto set) {
    ServerOptConfig c = config("fedadam");
    set(c);
    EXPECT_THROW(validate(c), ConfigError) << field;
    EXPECT_NE(error_of([&] { make_server_optimizer(c, 1); }).find(field), std::string::npos) << field;
  };
  expect_bad("lr", [](ServerOptConfig& c) { c.lr = 0; });
  expect_bad("lr", [](ServerOptConfig& c) { c.lr = std::numeric_limits<double>::infinity(); });
  expect_bad("momentum", [](ServerOptConfig& c) { c.momentum = 1.0; });
  expect_bad("momentum", [](ServerOptConfig& c) { c.momentum = -0.1; });
  expect_bad("beta1", [](ServerOptConfig& c) { c.beta1 = 1.0; });
  expect_bad("beta2", [](ServerOptConfig& c) { c.beta2 = std::nan(""); });
  expect_bad("tau", [](ServerOptConfig& c) { c.tau = 0; });
  EXPECT_NO_THROW(validate(config("fedyogi")));
}

TEST(FlServerOpt, ParsesNamedFields) {
  const auto c = parse_server_opt("fedadam", {{"lr", "0.01"}, {"beta2", "0.999"}, {"tau", "1e-4"}});
  EXPECT_EQ(c.name, "fedadam");
  EXPECT_DOUBLE_EQ(c.lr, 0.01);
  EXPECT_DOUBLE_EQ(c.beta2, 0.999);
  EXPECT_DOUBLE_EQ(c.tau, 1e-4);
  EXPECT_DOUBLE_EQ(c.beta1, 0.9);
  EXPECT_THROW(parse_server_opt("fedadam", {{"eta", "0.1"}}), ConfigError);
  EXPECT_THROW(parse_server_opt("fedadam", {{"lr", "fast"}}), ConfigError);
  EXPECT_THROW(parse_server_opt("fedadam", {{"lr", ""}}), ConfigError);
  EXPECT_THROW(parse_server_opt("fedavgm", {{"momentum", "1"}}), ConfigError);
  EXPECT_THROW(parse_server_opt("adam"), ConfigError);
}
