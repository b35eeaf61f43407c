// Statistical properties from the papers, with fixed seeds and stated tolerances:
//  - unbiasedness of QSGD, TernGrad (no clipping), scaled random-k and natural compression: for every element the
//    mean over T draws is within 5.5 standard errors of x_i (the test fails for a bias of a few percent);
//  - QSGD's variance bound E||Q(v)-v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 (mean over T draws, +3 standard errors);
//  - natural compression's second moment E[C(x)^2] <= 9/8 x^2 (including x = 4/3 * 2^e, where it is tight).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "compress/compressor.h"

using namespace conduit;
using namespace conduit::compress;

namespace {

std::vector<float> gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

// Max over elements of |mean - x| / standard error, over T independent compressions (the step advances the RNG).
double worst_z(const Compressor& c, const std::vector<float>& x, int trials, uint64_t stream = 0) {
  size_t d = x.size();
  std::vector<double> s(d, 0), s2(d, 0);
  std::vector<float> y(d);
  auto st = c.make_state(d, 42, stream);
  for (int t = 0; t < trials; ++t) {
    Bytes p = c.compress(x, st);
    c.decompress(p, st, y);
    for (size_t i = 0; i < d; ++i) s[i] += y[i], s2[i] += double(y[i]) * y[i];
  }
  double worst = 0;
  for (size_t i = 0; i < d; ++i) {
    double mean = s[i] / trials;
    double var = std::max(s2[i] / trials - mean * mean, 0.0);
    double se = std::sqrt(var / trials) + 1e-7 * std::fabs(x[i]) + 1e-30;
    worst = std::max(worst, std::fabs(mean - x[i]) / se);
  }
  return worst;
}

}  // namespace

TEST(Unbiased, QsgdTernGradRandKNatural) {
  auto x = gaussian(64, 9);
  const int T = 4000;
  EXPECT_LT(worst_z(*make_compressor("qsgd", {{"levels", "2"}}), x, T), 5.5);
  EXPECT_LT(worst_z(*make_compressor("qsgd", {{"levels", "1"}, {"bucket", "16"}}), x, T), 5.5);
  EXPECT_LT(worst_z(*make_compressor("terngrad", {{"clip", "0"}}), x, T), 5.5);
  EXPECT_LT(worst_z(*make_compressor("randk", {{"ratio", "0.25"}}), x, T), 5.5);
  EXPECT_LT(worst_z(*make_compressor("natural"), x, T), 5.5);
  // The check has power: an unscaled random-k is biased by a factor k/d and fails it.
  EXPECT_GT(worst_z(*make_compressor("randk", {{"ratio", "0.25"}, {"unbiased", "0"}}), x, T), 20.0);
  // Different streams (ranks) draw different noise.
  auto c = make_compressor("qsgd", {{"levels", "2"}});
  auto a = c->make_state(64, 1, 0), b = c->make_state(64, 1, 1);
  EXPECT_NE(c->compress(x, a), c->compress(x, b));
}

TEST(Qsgd, VarianceBound) {
  const int T = 1000;
  for (size_t d : {size_t(16), size_t(1024)}) {
    auto v = gaussian(d, d);
    double vn = 0;
    for (float x : v) vn += double(x) * x;
    for (int s : {1, 2, 8, 127}) {
      auto c = make_compressor("qsgd", {{"levels", std::to_string(s)}});
      auto st = c->make_state(d, 3, 0);
      std::vector<float> y(d);
      double sum = 0, sum2 = 0;
      for (int t = 0; t < T; ++t) {
        Bytes p = c->compress(v, st);
        c->decompress(p, st, y);
        double e = 0;
        for (size_t i = 0; i < d; ++i) e += double(y[i] - v[i]) * (y[i] - v[i]);
        sum += e, sum2 += e * e;
      }
      double mean = sum / T, se = std::sqrt(std::max(sum2 / T - mean * mean, 0.0) / T);
      double bound = std::min(double(d) / (double(s) * s), std::sqrt(double(d)) / s) * vn;
      EXPECT_LE(mean, bound + 3 * se) << "d=" << d << " s=" << s;
      EXPECT_GT(mean, 0.0);
    }
  }
}

TEST(Natural, SecondMomentAtMostNineEighths) {
  std::vector<float> x = {4.0f / 3, -4.0f / 3 * 1024, 1.5f, 1.1f, 1.9f, 3e-3f, -7.7f, 1.0f, 2.0f};
  auto c = make_compressor("natural");
  auto st = c->make_state(x.size(), 5, 0);
  const int T = 20000;
  std::vector<double> m2(x.size(), 0), m4(x.size(), 0);
  std::vector<float> y(x.size());
  for (int t = 0; t < T; ++t) {
    Bytes p = c->compress(x, st);
    c->decompress(p, st, y);
    for (size_t i = 0; i < x.size(); ++i) {
      double r = double(y[i]) * y[i] / (double(x[i]) * x[i]);
      m2[i] += r, m4[i] += r * r;
    }
  }
  for (size_t i = 0; i < x.size(); ++i) {
    double mean = m2[i] / T, se = std::sqrt(std::max(m4[i] / T - mean * mean, 0.0) / T);
    EXPECT_LE(mean, 9.0 / 8 + 4 * se) << x[i];
  }
  // Powers of two are represented exactly.
  EXPECT_DOUBLE_EQ(m2[7] / T, 1.0);
  EXPECT_DOUBLE_EQ(m2[8] / T, 1.0);
  // At x = 4/3 the bound is tight: the mean ratio is close to 9/8, not far below.
  EXPECT_GT(m2[0] / T, 9.0 / 8 - 0.02);
}
