// Every compressor on one rank: factory errors, round trips with each method's stated error bound, bytes on the wire
// equal to each method's formula, top-k exactness and contraction, the error-feedback identity, and state
// save/restore continuing bit for bit. Fixed seeds throughout.
#include "compress/compressor.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "compress/detail.h"
#include "compress/methods.h"
#include "core/error.h"

using namespace conduit;
using namespace conduit::compress;

namespace {

std::vector<float> gaussian(size_t n, uint64_t seed, float sd = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

std::vector<float> decode(const Compressor& c, const Bytes& p, const TensorState& st, size_t n) {
  std::vector<float> out(n, 123.0f);
  c.decompress(p, st, out);
  return out;
}

double norm2(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double(x) * x;
  return s;
}

const size_t kSizes[] = {1, 7, 1000, 4099};

}  // namespace

TEST(Factory, RejectsUnknownNamesAndParametersWithOneLine) {
  try {
    make_compressor("topq");
    FAIL();
  } catch (const ConfigError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("unknown compressor 'topq'"), std::string::npos) << m;
    EXPECT_NE(m.find("topk"), std::string::npos) << m;
    EXPECT_NE(m.find("powersgd"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos);
  }
  try {
    make_compressor("topk", {{"ratoi", "0.1"}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown parameter 'ratoi'; allowed: ratio, sample"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_compressor("topk", {{"ratio", "2"}}), ConfigError);
  EXPECT_THROW(make_compressor("topk", {{"ratio", "abc"}}), ConfigError);
  EXPECT_THROW(make_compressor("qsgd", {{"levels", "0"}}), ConfigError);
  EXPECT_THROW(make_compressor("terngrad", {{"clip", "maybe"}}), ConfigError);
  EXPECT_THROW(make_compressor("ef:efsignsgd"), ConfigError);
  EXPECT_EQ(parse_compressor("topk:ratio=0.5")->wire_bytes(10, {}), 8u * 5);
  EXPECT_EQ(parse_compressor("ef:randk:ratio=0.5,unbiased=0")->name(), "ef:randk");
  EXPECT_THROW(parse_compressor("topk:ratio"), ConfigError);
  EXPECT_THROW(parse_compressor("topk:"), ConfigError);  // a ':' with nothing after it (was taken as the defaults)
  EXPECT_THROW(parse_compressor("ef:topk:"), ConfigError);
  EXPECT_NO_THROW(parse_compressor("ef:topk"));
  for (const auto& n : compressor_names()) EXPECT_NO_THROW(make_compressor(n)) << n;
}

// A spec's refusals name the spec and what is allowed: "ef:" with no method after it was "unknown compressor ''", a
// key given twice named only the parameters.
TEST(Factory, MalformedSpecsAreNamedWithTheirAllowedForm) {
  const auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  for (const char* spec : {"ef:", "ef:ef:"}) {
    EXPECT_EQ(message([&] { parse_compressor(spec); }),
              fmt::format("compressor spec '{}' names no method after 'ef:'; allowed: ef:<method>, e.g. "
                          "ef:topk:ratio=0.01",
                          spec));
    EXPECT_EQ(message([&] { make_compressor(spec); }), message([&] { parse_compressor(spec); })) << spec;
    EXPECT_EQ(message([&] { compressor_defaults(spec); }), message([&] { parse_compressor(spec); })) << spec;
  }
  EXPECT_EQ(message([] { parse_compressor("topk:ratio=0.1,ratio=0.2"); }),
            "compressor spec 'topk:ratio=0.1,ratio=0.2': 'ratio' is given twice in 'ratio=0.1,ratio=0.2'; give each "
            "key once (form: name:key=value,...)");
  EXPECT_EQ(message([] { parse_compressor("ef:topk:ratio"); }),
            "compressor spec 'ef:topk:ratio': 'ratio' is not key=value (form: name:key=value,...)");  // (as before)
}

// Bytes on the wire equal each method's formula (see the comment blocks in src/compress/*.cc).
TEST(WireBytes, EqualEachMethodsFormula) {
  auto ceil8 = [](size_t d) { return (d + 7) / 8; };
  auto k_of = [](double r, size_t d) { return std::max<size_t>(1, size_t(std::ceil(r * d - 1e-9))); };
  struct Case {
    std::string name;
    Params p;
    std::function<size_t(size_t)> formula;
  };
  std::vector<Case> cases = {
      {"none", {}, [](size_t d) { return 4 * d; }},
      {"fp16", {}, [](size_t d) { return 2 * d; }},
      {"bf16", {}, [](size_t d) { return 2 * d; }},
      {"int8", {}, [](size_t d) { return d + 4 * ((d + 255) / 256); }},
      {"uint8", {{"chunk", "100"}}, [](size_t d) { return d + 8 * ((d + 99) / 100); }},
      {"qsgd", {{"levels", "127"}}, [](size_t d) { return 4 + d; }},                       // 1 + 7 bits
      {"qsgd", {{"levels", "1"}}, [](size_t d) { return 4 + (2 * d + 7) / 8; }},           // 2 bits
      {"qsgd", {{"levels", "4"}, {"bucket", "10"}}, [](size_t d) { return 4 * ((d + 9) / 10) + (4 * d + 7) / 8; }},
      {"qsgd", {{"levels", "2"}, {"bucket", "3"}}, [](size_t d) { return 4 * ((d + 2) / 3) + (3 * d + 7) / 8; }},
      {"terngrad", {}, [](size_t d) { return 4 + (d + 3) / 4; }},
      {"natural", {}, [&](size_t d) { return d + ceil8(d); }},
      {"signsgd", {}, [&](size_t d) { return ceil8(d); }},
      {"signum", {}, [&](size_t d) { return ceil8(d); }},
      {"scaled_sign", {}, [&](size_t d) { return 4 + ceil8(d); }},
      {"efsignsgd", {}, [&](size_t d) { return 4 + ceil8(d); }},
      {"onebit", {}, [&](size_t d) { return 8 + ceil8(d); }},
      {"topk", {{"ratio", "0.01"}}, [&](size_t d) { return 8 * k_of(0.01, d); }},
      {"randk", {{"ratio", "0.1"}}, [&](size_t d) { return 4 * k_of(0.1, d); }},
      {"dgc", {{"ratio", "0.01"}}, [&](size_t d) { return 8 * k_of(0.01, d); }},
      {"ef:fp16", {}, [](size_t d) { return 2 * d; }},
  };
  for (const auto& c : cases) {
    auto comp = make_compressor(c.name, c.p);
    for (size_t d : kSizes) {
      auto st = comp->make_state(d, 1, 0);
      auto x = gaussian(d, d);
      EXPECT_EQ(comp->wire_bytes(d, st), c.formula(d)) << c.name << " d=" << d;
      Bytes p = comp->compress(x, st);
      EXPECT_EQ(p.size(), c.formula(d)) << c.name << " d=" << d;
      EXPECT_NEAR(comp->ratio(d, comp->make_state(d)), 4.0 * d / c.formula(d), 1e-12);
    }
  }
  // threshold: 8 bytes per entry with |x| >= t.
  auto th = make_compressor("threshold", {{"threshold", "1.5"}});
  auto x = gaussian(4099, 3);
  size_t n = 0;
  for (float v : x) n += std::fabs(v) >= 1.5f;
  auto st = th->make_state(x.size());
  EXPECT_EQ(th->compress(x, st).size(), 8 * n);
  EXPECT_GT(n, 0u);
  // 1-bit = d/8 bytes + scale; 2-bit = d/4 + scale, for d a multiple of 8.
  EXPECT_EQ(make_compressor("scaled_sign")->wire_bytes(8000, {}), 1000u + 4);
  EXPECT_EQ(make_compressor("terngrad")->wire_bytes(8000, {}), 2000u + 4);
  // PowerSGD: 4 r (n + m) for a compressed matrix, 4 d for 1-D tensors and below min_ratio.
  auto ps = make_compressor("powersgd", {{"rank", "2"}});
  EXPECT_EQ(ps->wire_bytes(64 * 100, ps->make_state({64, 100})), 4u * 2 * (64 + 100));
  EXPECT_EQ(ps->wire_bytes(6400, ps->make_state({6400})), 4u * 6400);
  EXPECT_EQ(ps->wire_bytes(12, ps->make_state({3, 4})), 4u * 12);  // ratio 12/14 < 2
}

TEST(RoundTrip, EachMethodWithinItsBound) {
  for (size_t d : kSizes) {
    auto x = gaussian(d, 100 + d);
    float amax = 0;
    double l1 = 0;
    for (float v : x) amax = std::max(amax, std::fabs(v)), l1 += std::fabs(v);
    auto run = [&](const std::string& name, Params p = {}) {
      auto c = make_compressor(name, p);
      auto st = c->make_state(d, 7, 1);
      Bytes pl = c->compress(x, st);
      return std::make_pair(decode(*c, pl, st, d), std::move(c));
    };
    {
      auto [y, c] = run("none");
      EXPECT_EQ(y, x);
    }
    {
      auto [y, c] = run("fp16");
      for (size_t i = 0; i < d; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) * (1.0f / 2048) + 6e-8f);
    }
    {
      auto [y, c] = run("bf16");
      for (size_t i = 0; i < d; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) * (1.0f / 256));
    }
    {
      auto [y, c] = run("int8", {{"chunk", "64"}});
      for (size_t i = 0; i < d; ++i) {
        float cm = 0;
        for (size_t j = i / 64 * 64; j < std::min(d, i / 64 * 64 + 64); ++j) cm = std::max(cm, std::fabs(x[j]));
        EXPECT_LE(std::fabs(y[i] - x[i]), cm / 254 * 1.0001f + 1e-7f) << i;
      }
    }
    {
      auto [y, c] = run("uint8");
      for (size_t i = 0; i < d; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), 2 * amax / 510 * 1.0001f + 1e-6f) << i;
    }
    {
      auto [y, c] = run("qsgd", {{"levels", "15"}});
      float norm = std::sqrt(norm2(x));
      for (size_t i = 0; i < d; ++i) EXPECT_LE(std::fabs(y[i] - x[i]), norm / 15 * 1.0001f) << i;
    }
    {
      auto [y, c] = run("terngrad");
      for (size_t i = 0; i < d; ++i) {
        EXPECT_TRUE(y[i] == 0 || std::fabs(y[i]) == amax) << y[i];
        if (y[i] != 0) {
          EXPECT_EQ(y[i] < 0, x[i] < 0);
        }
      }
    }
    {
      auto [y, c] = run("natural");
      for (size_t i = 0; i < d; ++i) {
        int e;
        std::frexp(std::fabs(x[i]), &e);  // |x| in [2^(e-1), 2^e)
        float lo = std::ldexp(1.0f, e - 1), hi = std::ldexp(1.0f, e);
        EXPECT_TRUE(std::fabs(y[i]) == lo || std::fabs(y[i]) == hi) << x[i] << " -> " << y[i];
        EXPECT_EQ(y[i] < 0, x[i] < 0);
      }
    }
    {
      auto [y, c] = run("signsgd");
      for (size_t i = 0; i < d; ++i) EXPECT_EQ(y[i], x[i] < 0 ? -1.0f : 1.0f);
    }
    {
      auto [y, c] = run("scaled_sign");
      float s = float(l1 / d);
      for (size_t i = 0; i < d; ++i) EXPECT_FLOAT_EQ(y[i], x[i] < 0 ? -s : s);
    }
    {
      auto [y, c] = run("topk", {{"ratio", "0.1"}});
      size_t k = std::max<size_t>(1, size_t(std::ceil(0.1 * d - 1e-9)));
      std::vector<float> a(d);
      for (size_t i = 0; i < d; ++i) a[i] = std::fabs(x[i]);
      std::sort(a.rbegin(), a.rend());
      size_t nz = 0;
      for (size_t i = 0; i < d; ++i)
        if (y[i] != 0) {
          ++nz;
          EXPECT_EQ(y[i], x[i]);
          EXPECT_GE(std::fabs(x[i]), a[k - 1]);
        }
      EXPECT_EQ(nz, k);
    }
    {
      auto [y, c] = run("randk", {{"ratio", "0.25"}});
      size_t k = std::max<size_t>(1, size_t(std::ceil(0.25 * d - 1e-9)));
      size_t nz = 0;
      for (size_t i = 0; i < d; ++i)
        if (y[i] != 0) {
          ++nz;
          EXPECT_FLOAT_EQ(y[i], x[i] * float(double(d) / k));
        }
      EXPECT_EQ(nz, k);
    }
    {
      auto [y, c] = run("threshold", {{"threshold", "1"}});
      for (size_t i = 0; i < d; ++i) EXPECT_EQ(y[i], std::fabs(x[i]) >= 1 ? x[i] : 0.0f);
    }
  }
}

// A chunk whose range exceeds FLT_MAX (max - min = 6e38): the scale was inf and every value decoded as NaN.
TEST(RoundTrip, Uint8OverARangeWiderThanTheLargestFloat) {
  for (size_t d : {size_t(3), size_t(100)}) {
    std::vector<float> x(d);
    for (size_t i = 0; i < d; ++i) x[i] = static_cast<float>(-3e38 + 6e38 * double(i) / double(d - 1));
    auto c = make_compressor("uint8", {});
    auto st = c->make_state(d, 7, 1);
    Bytes pl = c->compress(x, st);
    auto y = decode(*c, pl, st, d);
    for (size_t i = 0; i < d; ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << i << " of " << d;
      EXPECT_LE(std::fabs(double(y[i]) - double(x[i])), 6e38 / 255 * 0.51 + 1e33) << i;
    }
  }
}

TEST(RoundTrip, PayloadOfTheWrongSizeIsRejected) {
  auto c = make_compressor("int8");
  auto st = c->make_state(100);
  Bytes p = c->compress(gaussian(100, 1), st);
  std::vector<float> out(101);
  EXPECT_THROW(c->decompress(p, st, out), InvalidArgument);
  auto t = make_compressor("topk");
  std::vector<float> small(3);
  Bytes bad(8, 0);
  bad[0] = 9;  // index 9 of 3 elements
  EXPECT_THROW(t->decompress(bad, st, small), InvalidArgument);
}

TEST(TopK, SampledSelectionEqualsExactAndContracts) {
  for (uint64_t seed : {1, 2, 3}) {
    auto x = gaussian(1 << 20, seed);
    for (size_t k : {size_t(100), size_t(1000), size_t(10000)}) {
      std::vector<uint32_t> sampled, exact;
      detail::topk_select(x, k, 0.01, seed, sampled);
      detail::topk_select(x, k, 0.0, seed, exact);
      ASSERT_EQ(sampled.size(), k);
      EXPECT_EQ(sampled, exact) << "k=" << k;
      EXPECT_TRUE(std::is_sorted(sampled.begin(), sampled.end()));
      // ||x - top_k(x)||^2 <= (1 - k/d) ||x||^2
      double kept = 0;
      for (auto i : sampled) kept += double(x[i]) * x[i];
      double all = norm2(x);
      EXPECT_LE(all - kept, (1.0 - double(k) / x.size()) * all);
    }
  }
  // Ties at the k-th value: exactly k, lowest indices first.
  std::vector<float> t(100, 1.0f);
  std::vector<uint32_t> idx;
  detail::topk_select(t, 10, 0.0, 0, idx);
  ASSERT_EQ(idx.size(), 10u);
  EXPECT_EQ(idx.back(), 9u);
  // A heavy-tailed input where the sampled threshold falls short still gets the exact answer (fallback).
  std::vector<float> spiky(1 << 18, 0.0f);
  for (size_t i = 0; i < 3000; ++i) spiky[i * 87] = float(i + 1);
  detail::topk_select(spiky, 2000, 0.01, 5, idx);
  ASSERT_EQ(idx.size(), 2000u);
  for (auto i : idx) EXPECT_GT(spiky[i], 1000.0f);
  // NaN (a diverged gradient) still gives exactly k indices, sampled or exact: every rank's payload keeps the size
  // receivers expect.
  for (double sample : {0.01, 0.0}) {
    auto g = gaussian(1 << 18, 9);
    for (size_t i = 0; i < g.size(); i += 1000) g[i] = std::numeric_limits<float>::quiet_NaN();
    detail::topk_select(g, 2000, sample, 5, idx);
    ASSERT_EQ(idx.size(), 2000u) << sample;
    EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    auto tk = make_compressor("topk", {{"ratio", "0.01"}});
    TensorState st;
    EXPECT_EQ(tk->compress(g, st).size(), tk->wire_bytes(g.size(), st));
  }
}

// QSGD's norm of a bucket with finite values too large to square in f32 (above ~1.8e19) is still finite: it was inf,
// and the whole bucket decoded as nan.
TEST(Qsgd, HugeFiniteValuesKeepAFiniteNorm) {
  auto c = make_compressor("qsgd", {{"levels", "127"}});
  std::vector<float> x(100, 1.0f);
  x[3] = 3e19f;
  x[50] = -1e20f;
  TensorState st;
  std::vector<float> y(x.size());
  c->decompress(c->compress(x, st), st, y);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y[i])) << i << " " << y[i];
  EXPECT_LT(std::fabs(y[50] - x[50]), 0.02f * std::fabs(x[50]));  // the largest element survives the quantization
}

// The extremes of the floats: a bucket of values near FLT_MAX has a norm above it (sent as inf: every value decoded
// as NaN), and one of values ~1e-23 has squares that flush to zero in f32 (its norm was 0: the bucket decoded as
// zeros, and QSGD was biased). Both now decode finite, the tiny one unbiased on average.
TEST(Qsgd, NormsBeyondTheFloatsRangeStayFiniteAndUnbiased) {
  auto c = make_compressor("qsgd", {{"levels", "127"}});
  std::vector<float> huge{3e38f, 3e38f, -3e38f};
  TensorState st;
  std::vector<float> y(huge.size());
  c->decompress(c->compress(huge, st), st, y);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << i;
    EXPECT_EQ(std::signbit(y[i]), std::signbit(huge[i])) << i;
  }
  std::vector<float> tiny(64, 1e-23f), sum(64, 0.0f);
  const int trials = 400;
  for (int t = 0; t < trials; ++t) {
    c->decompress_add(c->compress(tiny, st), st, sum);  // a new draw each step
  }
  double mean = 0;
  for (float v : sum) mean += v;
  mean /= double(sum.size()) * trials;
  EXPECT_NEAR(mean, 1e-23, 0.05e-23);
}

// Norms (QSGD) and scales (TernGrad) so small that s / norm or 1 / s overflows: zeros stay zero and the estimate
// stays unbiased (QSGD coded every element, zeros too, as +-norm; TernGrad sent all zeros).
TEST(Qsgd, NormsWhoseInverseOverflowsStayUnbiased) {
  for (const char* name : {"qsgd", "terngrad"}) {
    auto c = make_compressor(name, {});
    std::vector<float> x(16, 0.0f), sum(16, 0.0f);
    x[0] = std::strcmp(name, "qsgd") == 0 ? 1e-37f : 1e-40f;
    x[5] = -x[0] / 2;
    auto st = c->make_state(x.size(), 3, 0);
    const int trials = 2000;
    for (int t = 0; t < trials; ++t) c->decompress_add(c->compress(x, st), st, sum);
    for (size_t i = 0; i < x.size(); ++i) {
      const double mean = double(sum[i]) / trials;
      if (x[i] == 0)
        EXPECT_EQ(sum[i], 0.0f) << name << " " << i;
      else
        EXPECT_NEAR(mean / double(x[i]), 1.0, 0.15) << name << " " << i;
    }
  }
}

// A norm so small that norm / s falls below the normal floats: each element is decoded in double (a unit of f32 kept
// too few bits and scaled the whole bucket by its rounding: +0.86% at 1e-41, +92% at 1e-43).
TEST(Qsgd, TinyNormsDecodeUnbiased) {
  auto c = make_compressor("qsgd", {{"levels", "127"}});
  for (double scale : {1e-41, 1e-30}) {
    std::vector<float> x;
    for (double v : {0.3, -0.7, 0.11, 0.5}) x.push_back(static_cast<float>(v * scale));
    auto st = c->make_state(x.size(), 3, 0);
    std::vector<double> sum(x.size(), 0.0);
    std::vector<float> out(x.size());
    const int trials = 20000;
    for (int t = 0; t < trials; ++t) {
      c->decompress(c->compress(x, st), st, out);
      for (size_t i = 0; i < x.size(); ++i) sum[i] += out[i];
    }
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(sum[i] / trials / double(x[i]), 1.0, 2e-3) << scale << " " << i;
  }
}

// PowerSGD's factors from a peer, refused before anything is written where they are not finite or their product could
// leave the floats (they decoded to inf and NaN).
TEST(PowerSgd, FactorsThatDecodePastTheFloatsAreRefused) {
  auto ps = make_compressor("powersgd", {{"rank", "2"}, {"wire", "f32"}});
  const auto x = gaussian(64 * 100, 5);
  auto st = ps->make_state({64, 100});
  const Bytes good = ps->compress(x, st);
  ASSERT_EQ(good.size(), 4u * 2 * (64 + 100));
  std::vector<float> out(x.size(), 7.0f);
  ps->decompress(good, st, out);
  EXPECT_NE(out[0], 7.0f);
  auto refused = [&](size_t at, float v) {
    Bytes bad = good;
    std::memcpy(bad.data() + 4 * at, &v, 4);
    std::fill(out.begin(), out.end(), 7.0f);
    std::string why;
    try {
      ps->decompress(bad, st, out);
    } catch (const InvalidArgument& e) {
      why = e.what();
    }
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float y) { return y == 7.0f; })) << at;
    return why;
  };
  EXPECT_NE(refused(3, std::numeric_limits<float>::quiet_NaN()).find("element 3 of the payload's factors is nan"),
            std::string::npos);
  EXPECT_NE(refused(200, std::numeric_limits<float>::infinity()).find("is inf"), std::string::npos);
  EXPECT_NE(refused(5, 3e38f).find("can multiply past the floats"), std::string::npos);  // (P's element, Q's ~1)
}

// A code no encoder writes (a QSGD level above s, TernGrad's code 3) is refused with the element named, in the
// bytes read whole and in the last byte's codes alike; bits after the last code are not looked at.
TEST(RoundTrip, CodesNoEncoderWritesAreRefused) {
  const auto x = gaussian(101, 4);
  struct Case {
    const char* name;
    Params opts;
    size_t header;
    int bits;
    uint32_t bad;
  };
  const Case cases[] = {{"qsgd", {{"levels", "5"}}, 4, 4, 0xe},  // level 7 of 5, 4-bit codes read a word at a time
                        {"qsgd", {{"levels", "2"}}, 4, 3, 0x7},  // level 3 of 2, 3-bit codes
                        {"terngrad", {}, 4, 2, 0x3}};
  for (const auto& k : cases) {
    auto c = make_compressor(k.name, k.opts);
    auto st = c->make_state(x.size(), 3, 0);
    const Bytes good = c->compress(x, st);
    ASSERT_EQ(good.size(), k.header + (x.size() * k.bits + 7) / 8) << k.name;
    std::vector<float> out(x.size());
    for (size_t e : {size_t{3}, size_t{100}}) {
      Bytes p = good;
      for (int b = 0; b < k.bits; ++b) {
        const size_t bit = e * k.bits + b;
        uint8_t& byte = p[k.header + bit / 8];
        byte = static_cast<uint8_t>((byte & ~(1u << (bit % 8))) | (((k.bad >> b) & 1u) << (bit % 8)));
      }
      for (bool add : {false, true}) {
        try {
          add ? c->decompress_add(p, st, out) : c->decompress(p, st, out);
          ADD_FAILURE() << k.name << " " << k.bits << ": code " << k.bad << " at " << e << " was decoded";
        } catch (const InvalidArgument& err) {
          const std::string what = err.what();
          EXPECT_NE(what.find("element " + std::to_string(e) + " of the payload has "), std::string::npos) << what;
          EXPECT_NE(what.find("; allowed: "), std::string::npos) << what;
        }
      }
    }
    Bytes tail = good;  // the last byte's unused bits
    const size_t used = x.size() * k.bits % 8;
    if (used) tail.back() = static_cast<uint8_t>(tail.back() | (0xffu << used));
    EXPECT_NO_THROW(c->decompress(tail, st, out)) << k.name << " " << k.bits;
  }
}

// A scale on the wire that no encoder writes (NaN) is refused, not decoded as a chunk of NaN; a DGC payload outside
// the counts its schedule sends (cut short, or empty) too.
TEST(RoundTrip, NanScalesAndDgcPayloadsOfAnotherCountAreRefused) {
  const auto x = gaussian(100, 9);
  for (const char* name : {"int8", "uint8", "qsgd", "terngrad", "scaled_sign"}) {
    auto c = make_compressor(name, {});
    auto st = c->make_state(x.size(), 3, 0);
    Bytes p = c->compress(x, st);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(p.data(), &nan, 4);
    std::vector<float> out(x.size());
    try {
      c->decompress(p, st, out);
      ADD_FAILURE() << name << ": a NaN scale was decoded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("allowed: finite scales"), std::string::npos) << e.what();
    }
  }
  auto d = make_compressor("dgc", {{"ratio", "0.1"}});
  auto st = d->make_state(x.size(), 3, 0);
  Bytes p = d->compress(x, st);
  ASSERT_EQ(p.size(), 80u);
  std::vector<float> out(x.size());
  EXPECT_NO_THROW(d->decompress(p, st, out));
  Bytes one(p.begin(), p.begin() + 4);
  one.insert(one.end(), p.begin() + 40, p.begin() + 44);
  EXPECT_THROW(d->decompress(one, st, out), InvalidArgument);
  EXPECT_THROW(d->decompress(Bytes{}, st, out), InvalidArgument);
}

// Values no encoder writes in a payload's header or codes: a negative magnitude (int8's scale, uint8's range,
// QSGD's norm, TernGrad's scale, scaled sign's positive mean; a positive mean for signum_ef's negatives), int8's
// -128 and natural compression's exponent 255 (inf or NaN). They decoded as flipped signs, -128 * scale outside
// the encoder's range, and infinities.
TEST(RoundTrip, HeadersAndCodesNoEncoderWritesAreRefused) {
  const auto x = gaussian(100, 9);
  std::vector<float> out(x.size());
  auto refused = [&](const char* name, const Params& opts, const std::function<void(Bytes&)>& spoil,
                     const std::string& want) {
    auto c = make_compressor(name, opts);
    auto st = c->make_state(x.size(), 3, 0);
    Bytes p = c->compress(x, st);
    EXPECT_NO_THROW(c->decompress(p, st, out)) << name;
    spoil(p);
    for (bool add : {false, true}) {
      try {
        add ? c->decompress_add(p, st, out) : c->decompress(p, st, out);
        ADD_FAILURE() << name << ": decoded";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << name << ": " << e.what();
      }
    }
  };
  auto negate_float = [](size_t at) {
    return [at](Bytes& p) {
      float v;
      std::memcpy(&v, p.data() + 4 * at, 4);
      v = -std::fabs(v) - 1.0f;
      std::memcpy(p.data() + 4 * at, &v, 4);
    };
  };
  refused("int8", {{"chunk", "50"}}, negate_float(1), "scale 1 of the payload is -");
  refused("uint8", {{"chunk", "50"}}, negate_float(3), "scale 3 of the payload is -");  // chunk 1's (min, scale)
  refused("qsgd", {}, negate_float(0), "scale 0 of the payload is -");
  refused("terngrad", {}, negate_float(0), "allowed: a magnitude (0 or more)");
  refused("scaled_sign", {}, negate_float(0), "allowed: a value of 0 or more for the positive signs");
  refused(
      "int8", {}, [](Bytes& p) { p[4 + 42] = 0x80; }, "element 42 of the payload is -128; allowed: -127..127");
  refused(
      "natural", {}, [](Bytes& p) { p[13 + 57] = 0xff; }, "element 57 of the payload has exponent 255");
  // uint8's minimum may be negative: that is a value, not a magnitude.
  auto u = make_compressor("uint8", {});
  auto st = u->make_state(x.size(), 3, 0);
  EXPECT_NO_THROW(u->decompress(u->compress(x, st), st, out));
}

// Parameters that f32 cannot hold as given: a threshold that rounds to 0 kept every element (8 bytes each); a DGC
// clip norm below f32's normal range made the clipping factor 0 and DGC sent zeros.
TEST(Spec, ParametersF32CannotHoldAreRefused) {
  try {
    make_compressor("threshold", {{"threshold", "1e-46"}});
    ADD_FAILURE() << "threshold=1e-46 taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("threshold='1e-46' rounds to 0 in f32"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(make_compressor("threshold", {{"threshold", "0"}}));
  EXPECT_NO_THROW(make_compressor("threshold", {{"threshold", "1e-45"}}));
  try {
    make_compressor("dgc", {{"clip_norm", "1e-300"}});
    ADD_FAILURE() << "clip_norm=1e-300 taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("clip_norm='1e-300' is below f32's normal range"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(make_compressor("dgc", {{"clip_norm", "0"}}));
}

// A state belongs to one tensor: a buffer asked for with another size is an error (it was re-zeroed, dropping the
// residual or momentum it held).
TEST(State, ABufferOfAnotherSizeIsRefusedNotReset) {
  auto ef = make_compressor("ef:topk", {{"ratio", "0.1"}});
  auto st = ef->make_state(100, 3, 0);
  const auto x = gaussian(100, 5);
  ef->compress(x, st);
  const auto held = st.buffers.at("ef.residual");
  const auto y = gaussian(50, 6);
  try {
    ef->compress(y, st);
    ADD_FAILURE() << "a 50-element tensor used a 100-element state";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("buffer 'ef.residual' holds 100 values, this call needs 50"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(st.buffers.at("ef.residual"), held);
}

// The one-pass sign form keeps the last decode pending in "ef.pending": a call refused for its size dropped it (the
// pending erase came before the residual's size check), so the next step sent the last one's amount again.
TEST(State, ARefusedCallLeavesTheSignMethodsPendingDecode) {
  auto ef = make_compressor("efsignsgd", {});
  auto st = ef->make_state(100, 3, 0);
  auto ref = ef->make_state(100, 3, 0);
  ef->compress(gaussian(100, 5), st);
  ef->compress(gaussian(100, 5), ref);
  EXPECT_THROW(ef->compress(gaussian(50, 6), st), InvalidArgument);
  EXPECT_EQ(ef->residual(st), ef->residual(ref));
  EXPECT_EQ(ef->compress(gaussian(100, 7), st), ef->compress(gaussian(100, 7), ref));
  EXPECT_EQ(ef->residual(st), ef->residual(ref));
}

// Error feedback builds p = g + e in a per-thread scratch buffer: copied back, not swapped into the state (swapped,
// the largest tensor's buffer moved on into the residuals of small ones, one more copy of it held each step).
TEST(State, ErrorFeedbackScratchStaysOutOfTheStates) {
  auto ef = make_compressor("ef:topk", {{"ratio", "0.1"}});
  auto big = ef->make_state(100000), small = ef->make_state(100);
  for (int step = 0; step < 3; ++step) {
    ef->compress(gaussian(100000, 1 + step), big);
    ef->compress(gaussian(100, 10 + step), small);
  }
  EXPECT_LT(small.buffers.at("ef.residual").capacity(), 1000u);
}

// The sign methods summed magnitudes in f32 lanes: finite values of 1e36 overflowed the sum, the scale went out as
// inf and every receiver refused the payload. Summed again in double, the scale is the mean magnitude.
TEST(RoundTrip, SignMethodsScaleHugeFiniteValues) {
  std::vector<float> x(4096);
  for (size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 == 0 ? -2e36f : 1e36f);
  for (const char* name : {"scaled_sign", "onebit", "efsignsgd"}) {
    auto c = make_compressor(name, {});
    auto st = c->make_state(x.size());
    Bytes p = c->compress(x, st);
    std::vector<float> out(x.size());
    ASSERT_NO_THROW(c->decompress(p, st, out)) << name;
    for (size_t i : {size_t{0}, size_t{1}, size_t{4095}}) {
      EXPECT_TRUE(std::isfinite(out[i])) << name << " " << i;
      EXPECT_EQ(std::signbit(out[i]), std::signbit(x[i])) << name << " " << i;
    }
    // scaled_sign's one scale is the mean magnitude: (2e36 + 2 x 1e36) / 3 (1366 negatives of 4096).
    if (std::string(name) == "scaled_sign") {
      EXPECT_NEAR(out[1], (1366 * 2e36 + 2730 * 1e36) / 4096, 1e30);
    }
    if (std::string(name) == "onebit") {  // the positives' mean and the negatives' mean
      EXPECT_NEAR(out[1], 1e36, 1e30);
      EXPECT_NEAR(out[0], -2e36, 1e30);
    }
  }
}

// Scales no encoder writes, which decoded past the floats: an int8 scale of 1e38 (127 x 1e38 = inf), a uint8 chunk of
// min 3e38 and scale 1e36.
TEST(RoundTrip, ByteQuantizerScalesThatDecodeToInfinityAreRefused) {
  auto i8 = make_compressor("int8", {});
  auto st = i8->make_state(5);
  Bytes p = i8->compress(std::vector<float>{1, 2, 3, 4, 5}, st);
  const float huge = 1e38f;
  std::memcpy(p.data(), &huge, 4);
  std::vector<float> out(5);
  try {
    i8->decompress(p, st, out);
    ADD_FAILURE() << "a scale of 1e38 decoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("decodes past the floats"), std::string::npos) << e.what();
  }
  auto u8 = make_compressor("uint8", {});
  auto su = u8->make_state(5);
  p = u8->compress(std::vector<float>{1, 2, 3, 4, 5}, su);
  const float lo = 3e38f, scale = 1e36f;
  std::memcpy(p.data(), &lo, 4);
  std::memcpy(p.data() + 4, &scale, 4);
  EXPECT_THROW(u8->decompress(p, su, out), InvalidArgument);
  // Inside a gathered buffer a payload need not be 4-byte aligned: decoded from an odd offset, the same values.
  auto sa = i8->make_state(5);
  Bytes good = i8->compress(std::vector<float>{1, -2, 3, 4, 5}, sa);
  Bytes shifted(good.size() + 1);
  std::memcpy(shifted.data() + 1, good.data(), good.size());
  std::vector<float> a(5), b(5);
  i8->decompress(good, sa, a);
  i8->decompress(std::span<const uint8_t>(shifted.data() + 1, good.size()), sa, b);
  EXPECT_EQ(a, b);
}

// int8 and uint8 chunks whose largest magnitude is subnormal-scale (255 zeros and one 1e-38): 1 / scale was inf and
// 0 * inf coded the zeros as -128 (decoded -1.008 max).
TEST(RoundTrip, Int8ChunksOfTinyValuesKeepTheirZeros) {
  for (const char* name : {"int8", "uint8"}) {
    std::vector<float> x(256, 0.0f);
    x[17] = 1e-38f;
    x[200] = -4e-39f;
    auto c = make_compressor(name, {});
    auto st = c->make_state(x.size(), 7, 1);
    auto y = decode(*c, c->compress(x, st), st, x.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-40) << name << " " << i;
  }
}

// Chunks whose values reach the largest float: uint8's min + 255 x scale (min 6.5e37 to 8.5e37, max FLT_MAX: a scale
// just under the wide ones) and int8's 127 x scale (max|x| = FLT_MAX) rounded up to inf in f32, so the decoder refused
// the encoder's own payload; QSGD's norm / s x s did too (levels 127 and 32767), and its saturated element decoded as
// inf. Each now round-trips within half a step (QSGD: a level), and the decoders still refuse such scales from a peer.
TEST(RoundTrip, ValuesNextToTheLargestFloatRoundTrip) {
  const float kMax = std::numeric_limits<float>::max();
  for (float lo : {6.5e37f, 7.5e37f, 8.5e37f}) {
    const std::vector<float> x{lo, kMax, 1e38f, 2e38f, 3e38f, std::nextafter(kMax, 0.0f)};
    auto c = make_compressor("uint8", {});
    auto st = c->make_state(x.size(), 7, 1);
    const Bytes p = c->compress(x, st);
    float scale;
    std::memcpy(&scale, p.data() + 4, 4);
    std::vector<float> y(x.size());
    ASSERT_NO_THROW(c->decompress(p, st, y)) << lo;
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << lo << " " << i;
      EXPECT_LE(std::fabs(double(y[i]) - double(x[i])), 0.5 * double(scale) * 1.001) << lo << " " << i;
    }
  }
  {
    const std::vector<float> x{kMax, -1.0f, 0.5f, 3e38f, -kMax};
    auto c = make_compressor("int8", {});
    auto st = c->make_state(x.size(), 7, 1);
    const Bytes p = c->compress(x, st);
    float scale;
    std::memcpy(&scale, p.data(), 4);
    std::vector<float> y(x.size());
    ASSERT_NO_THROW(c->decompress(p, st, y));
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << i;
      EXPECT_LE(std::fabs(double(y[i]) - double(x[i])), 0.5 * double(scale) * 1.001) << i;
    }
  }
  for (const char* levels : {"127", "32767"}) {
    auto c = make_compressor("qsgd", {{"levels", levels}});
    const std::vector<float> x{kMax, 0.0f, 0.0f, 0.0f};
    auto st = c->make_state(x.size(), 7, 1);
    Bytes p = c->compress(x, st);
    std::vector<float> y(x.size());
    ASSERT_NO_THROW(c->decompress(p, st, y)) << levels;
    ASSERT_TRUE(std::isfinite(y[0])) << levels;
    EXPECT_GT(y[0], 0.999f * kMax) << levels;  // the top level: the norm, one ulp less
    for (size_t i = 1; i < x.size(); ++i) EXPECT_EQ(y[i], 0.0f) << levels << " " << i;
    // A peer's norm of FLT_MAX, whose top level decodes past the floats, is refused.
    std::memcpy(p.data(), &kMax, 4);
    try {
      c->decompress(p, st, y);
      ADD_FAILURE() << levels << ": a norm of FLT_MAX decoded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("decodes past the floats"), std::string::npos) << e.what();
    }
  }
}

// A top-k payload is exactly k entries with ascending indices: one missing its last entry, or with an index twice
// (added twice), is refused (they decoded as k - 1 entries, or summed).
TEST(TopK, PayloadsOfAnotherCountOrRepeatedIndicesAreRefused) {
  auto t = make_compressor("topk", {{"ratio", "0.1"}});
  auto x = gaussian(100, 4);
  TensorState st;
  Bytes p = t->compress(x, st);
  ASSERT_EQ(p.size(), 80u);
  std::vector<float> out(100);
  EXPECT_NO_THROW(t->decompress(p, st, out));
  Bytes short_p;  // 9 entries: indices then values
  short_p.insert(short_p.end(), p.begin(), p.begin() + 36);
  short_p.insert(short_p.end(), p.begin() + 40, p.begin() + 76);
  EXPECT_THROW(t->decompress(short_p, st, out), InvalidArgument);
  Bytes twice = p;
  std::memcpy(twice.data() + 4, twice.data(), 4);  // entry 1 repeats entry 0's index
  try {
    t->decompress_add(twice, st, out);
    ADD_FAILURE() << "a repeated index was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("ascending indices, each once"), std::string::npos) << e.what();
  }
}

// Gathered sparse payloads (top-k, threshold, DGC) carry values a peer computed: an inf or NaN among them (a sender
// whose input diverged) is refused with the entry named, before anything is written, as the quantizers refuse a
// non-finite scale (it was summed into every rank's result). Random-k is linear: its decoder gets the sum an allreduce
// made and passes a NaN on at its own index only, as an uncompressed allreduce does. Indices out of range are refused.
TEST(Sparse, NonFiniteValuesFromPeersAreRefusedRandomKPassesThemOn) {
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  const auto x = gaussian(100, 21);
  for (const auto& [name, params] : std::vector<std::pair<std::string, Params>>{
           {"topk", {{"ratio", "0.1"}}}, {"threshold", {{"threshold", "1"}}}, {"dgc", {{"ratio", "0.1"}}}}) {
    auto c = make_compressor(name, params);
    auto st = c->make_state(x.size(), 3, 0);
    const Bytes good = c->compress(x, st);
    const size_t n = good.size() / 8;
    ASSERT_GE(n, 3u) << name;
    for (float bad : {kNan, kInf, -kInf}) {
      Bytes p = good;
      std::memcpy(p.data() + 4 * n + 8, &bad, 4);  // entry 2's value
      std::vector<float> acc(x.size(), 7.0f);
      try {
        c->decompress_add(p, st, acc);
        ADD_FAILURE() << name << ": a value of " << bad << " was added";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(name + ": entry 2 (index "), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("allowed: finite values"), std::string::npos) << e.what();
      }
      EXPECT_EQ(acc, std::vector<float>(x.size(), 7.0f)) << name;  // nothing written
      EXPECT_THROW(c->decompress(p, st, acc), InvalidArgument) << name;
      EXPECT_THROW(c->decompress_sub(p, st, acc), InvalidArgument) << name;
    }
    std::vector<float> out(x.size());
    EXPECT_NO_THROW(c->decompress(good, st, out)) << name;
    Bytes far = good;
    const uint32_t past = 100;
    std::memcpy(far.data() + 4 * (n - 1), &past, 4);  // the last index: one past the end
    try {
      c->decompress(far, st, out);
      ADD_FAILURE() << name << ": index 100 of 100 elements was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("allowed: indices below 100"), std::string::npos) << e.what();
    }
  }
  auto rk = make_compressor("randk", {{"ratio", "0.1"}});
  auto st = rk->make_state(x.size(), 3, 0);
  Bytes p = rk->compress(x, st);
  ASSERT_EQ(p.size(), 40u);
  std::vector<float> clean(x.size()), got(x.size());
  rk->decompress(p, st, clean);
  std::memcpy(p.data() + 12, &kNan, 4);  // value 3 of 10
  ASSERT_NO_THROW(rk->decompress(p, st, got));
  size_t nans = 0, sent = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sent += clean[i] != 0.0f;
    if (std::isnan(got[i])) {
      ++nans;
      EXPECT_NE(clean[i], 0.0f) << i;  // at one of the drawn indices
    } else {
      EXPECT_EQ(got[i], clean[i]) << i;
    }
  }
  EXPECT_EQ(nans, 1u);
  EXPECT_EQ(sent, 10u);
}

// Random-k's positions come from the seed and the step, never the rank (stream): the ranks' values at the same
// positions are what a compressed allreduce sums. A new seed or step draws others.
TEST(RandK, EveryRankDrawsTheSamePositionsForASeedAndStep) {
  auto rk = make_compressor("randk", {{"ratio", "0.05"}});
  const size_t d = 4000;
  auto positions = [&](uint64_t seed, uint64_t stream, int steps) {
    auto st = rk->make_state(d, seed, stream);
    std::vector<float> out(d);
    for (int t = 0; t < steps; ++t) rk->decompress(rk->compress(gaussian(d, 10 * stream + t), st), st, out);
    std::vector<size_t> at;
    for (size_t i = 0; i < d; ++i)
      if (out[i] != 0.0f) at.push_back(i);
    EXPECT_EQ(at.size(), 200u);
    return at;
  };
  for (int steps : {1, 3}) EXPECT_EQ(positions(5, 0, steps), positions(5, 1, steps)) << steps << " steps";
  EXPECT_NE(positions(5, 0, 1), positions(6, 0, 1));
  EXPECT_NE(positions(5, 0, 1), positions(5, 0, 2));
}

// TernGrad's clip=1 clips at 2.5 standard deviations, computed without cancellation (E[x^2] - mean^2 in f32 gave
// 0.52 for x = 1000 + 0.01 N(0,1), whose 2.5 sigma is 0.025), also for values so small that their deviations square
// below FLT_MIN in f32 (scaled by 1e-23 the clip was 0.86 sigma; by 1e-25 it was 0 and clipped nothing), and a
// tensor with no spread (constant, or one element) is not clipped to zero.
TEST(TernGrad, ClipUsesTheStandardDeviationAndLeavesConstantTensors) {
  auto c = make_compressor("terngrad", {{"clip", "1"}});
  const size_t d = 4096;
  for (double by : {1.0, 1e-23, 1e-25}) {
    auto g = gaussian(d, 11);
    double mean = 0, ss = 0;
    for (auto& v : g) mean += (v = static_cast<float>(by * (1000.0 + 0.01 * v)));
    mean /= d;
    for (float v : g) ss += (v - mean) * (v - mean);
    const double clip = 2.5 * std::sqrt(ss / d);
    TensorState st;
    Bytes p = c->compress(g, st);
    float scale;
    std::memcpy(&scale, p.data(), 4);
    EXPECT_NEAR(scale, clip, 1e-3 * clip) << "values scaled by " << by;  // the scale is max|g| clipped at 2.5 sigma
  }
  for (std::vector<float> x : {std::vector<float>(100, 0.25f), std::vector<float>{0.5f}}) {
    TensorState s1;
    std::vector<float> y(x.size());
    c->decompress(c->compress(x, s1), s1, y);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], x[i]) << x.size();  // |x| = max: kept with probability 1
  }
}

// The clip of a large tensor: its squares summed in f32 partials over the whole tensor came out low (-1.8e-3 of the
// clip at 64M elements, each partial past 4M squares); blocks of them summed in double keep it to f32 rounding.
TEST(TernGrad, ClipOfALargeTensorIsAccurate) {
  auto c = make_compressor("terngrad", {{"clip", "1"}});
  const size_t d = size_t{1} << 24;
  auto g = gaussian(d, 12);
  double ss = 0, mean = 0;
  for (float v : g) mean += v;
  mean /= static_cast<double>(d);
  for (float v : g) ss += (v - mean) * (v - mean);
  const double clip = 2.5 * std::sqrt(ss / static_cast<double>(d));
  TensorState st;
  Bytes p = c->compress(g, st);
  float scale;
  std::memcpy(&scale, p.data(), 4);
  EXPECT_NEAR(scale, clip, 2e-6 * clip);
}

// Deviations whose squares overflow f32 (|x - mean| above ~1.8e19, a diverging run's gradient) still clip: the f32
// partial sums became inf, and so did the clip (the scale was max|g|, no clipping at all); so do values whose sum
// overflows f32.
TEST(TernGrad, ClipOfHugeValuesIsStillTheStandardDeviation) {
  auto c = make_compressor("terngrad", {{"clip", "1"}});
  std::vector<float> g(1000, 0.0f);
  for (size_t i = 0; i < g.size(); ++i) g[i] = (i % 2 ? 1.0f : -1.0f) * 1e20f * static_cast<float>(1 + i % 7);
  g[0] = g[64] = 3e38f;  // the outliers the clip is for (in one f32 lane of the sums: their sum overflows it)
  double mean = 0, ss = 0;
  for (float v : g) mean += v;
  mean /= static_cast<double>(g.size());
  for (float v : g) ss += (v - mean) * (v - mean);
  const double clip = 2.5 * std::sqrt(ss / static_cast<double>(g.size()));
  ASSERT_LT(clip, 3e38);
  TensorState st;
  Bytes p = c->compress(g, st);
  float scale;
  std::memcpy(&scale, p.data(), 4);
  EXPECT_NEAR(scale, clip, 1e-5 * clip);
}

// Error feedback: sum_t D(C(g_t + e_t)) + e_T = sum_t g_t.
TEST(ErrorFeedback, SentPlusResidualEqualsSumOfInputs) {
  // (Random-k unscaled and QSGD in small buckets: with the d/k scaling, or buckets of s^2 elements or more, error
  // feedback is not contractive and the residual grows; those are refused, see the next test.)
  // (DGC without momentum: its accumulation v is then the inputs not sent yet.)
  for (std::string name : {"ef:topk", "efsignsgd", "onebit", "ef:qsgd", "ef:int8", "ef:randk", "ef:natural", "dgc"}) {
    auto c = make_compressor(name, name == "ef:randk"  ? Params{{"unbiased", "0"}}
                                   : name == "ef:qsgd" ? Params{{"bucket", "1024"}}
                                   : name == "dgc"     ? Params{{"momentum", "0"}, {"ratio", "0.01"}}
                                                       : Params{});
    const size_t d = 3001;
    auto st = c->make_state(d, 4, 2);
    std::vector<double> sent(d, 0), given(d, 0);
    std::vector<float> y(d);
    for (int t = 0; t < 20; ++t) {
      auto g = gaussian(d, 1000 + t);
      for (size_t i = 0; i < d; ++i) given[i] += g[i];
      Bytes p = c->compress(g, st);
      c->decompress(p, st, y);
      for (size_t i = 0; i < d; ++i) sent[i] += y[i];
    }
    const auto e = c->residual(st);
    ASSERT_EQ(e.size(), d) << name;
    double worst = 0;
    for (size_t i = 0; i < d; ++i) worst = std::max(worst, std::fabs(sent[i] + e[i] - given[i]));
    EXPECT_LT(worst, 1e-4) << name << " (largest |sent + residual - given|)";
    // And the residual is not trivially zero (the method compresses).
    EXPECT_GT(norm2(std::vector<float>(e.begin(), e.end())), 0.0) << name;
  }
}

// Error feedback around a compressor that does not shrink its input diverges: those specs are refused with what is
// allowed, and what is allowed stays bounded. Random-k with the d/k scaling, here as a check of the reason: its
// residual grows by orders of magnitude within 40 steps, while unbiased=0's stays the size of the gradients.
TEST(ErrorFeedback, RefusesCompressorsWhoseResidualGrows) {
  auto message = [](const std::string& spec) {
    try {
      parse_compressor(spec);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message("ef:randk").find("allowed: ef:randk:unbiased=0"), std::string::npos) << message("ef:randk");
  EXPECT_NE(message("ef:randk:ratio=0.1,unbiased=1").find("diverges"), std::string::npos) << message("ef:randk:ratio=0.1,unbiased=1");
  EXPECT_NE(message("ef:qsgd").find("the whole tensor"), std::string::npos) << message("ef:qsgd");
  EXPECT_NE(message("ef:qsgd:levels=1,bucket=128").find("more levels"), std::string::npos)
      << message("ef:qsgd:levels=1,bucket=128");
  // The example it gives passes (it suggested bucket=1024 for levels=4, which it refuses).
  const std::string four = message("ef:qsgd:levels=4,bucket=1024");
  EXPECT_NE(four.find("a bucket below s^2 = 16 (e.g. ef:qsgd:levels=4,bucket=8)"), std::string::npos) << four;
  EXPECT_NO_THROW(parse_compressor("ef:qsgd:levels=4,bucket=8"));
  // The example keeps a coding that was given.
  const std::string elias = message("ef:qsgd:levels=4,bucket=1024,coding=elias");
  EXPECT_NE(elias.find("(e.g. ef:qsgd:levels=4,bucket=8,coding=elias)"), std::string::npos) << elias;
  // Every spelling of the boolean the inner compressor takes (stod threw on "false").
  EXPECT_NO_THROW(parse_compressor("ef:randk:unbiased=false"));
  EXPECT_NE(message("ef:randk:unbiased=true").find("diverges"), std::string::npos);
  EXPECT_NE(message("ef:terngrad").find("or terngrad without ef:"), std::string::npos) << message("ef:terngrad");
  // Signs decoded to +-1 (the docs said these were refused; they ran with a residual near 1 a coordinate).
  EXPECT_NE(message("ef:signsgd").find("allowed: efsignsgd or ef:scaled_sign"), std::string::npos)
      << message("ef:signsgd");
  EXPECT_NE(message("ef:signum:momentum=0.5").find("signum without ef:"), std::string::npos);
  EXPECT_NO_THROW(parse_compressor("ef:scaled_sign"));
  EXPECT_NE(message("ef:ef:topk").find("already has error feedback"), std::string::npos) << message("ef:ef:topk");
  EXPECT_NE(message("ef:dgc").find("allowed: dgc without ef:"), std::string::npos) << message("ef:dgc");
  EXPECT_NO_THROW(parse_compressor("ef:qsgd:levels=127,bucket=16000"));
  EXPECT_NO_THROW(parse_compressor("ef:natural"));

  const size_t d = 1000;
  auto largest_residual = [&](Params p) {
    auto c = methods::make_error_feedback(make_compressor("randk", p), "ef:randk");
    auto st = c->make_state(d, 4, 2);
    std::vector<float> y(d);
    for (int t = 0; t < 40; ++t) {
      auto g = gaussian(d, 2000 + t);
      c->decompress(c->compress(g, st), st, y);
    }
    double worst = 0;
    for (float e : c->residual(st)) worst = std::max(worst, double(std::fabs(e)));
    return worst;
  };
  EXPECT_GT(largest_residual({{"ratio", "0.1"}, {"unbiased", "1"}}), 1e6);
  EXPECT_LT(largest_residual({{"ratio", "0.1"}, {"unbiased", "0"}}), 100);
}

// EF-signSGD's one-pass error feedback (the decode left pending until the next step reads the residual) gives the
// payloads and residual of the plain sequence e += g; send scaled_sign(e); e -= decode, bit for bit.
TEST(ErrorFeedback, OnePassSignFeedbackEqualsThePlainSteps) {
  for (size_t d : {size_t(1), size_t(7), size_t(1000), size_t(4099)}) {
    auto ef = make_compressor("efsignsgd", {});
    auto inner = make_compressor("scaled_sign", {});
    auto st = ef->make_state(d, 4, 2), ist = inner->make_state(d, 4, 2);
    std::vector<float> e(d, 0.0f);
    for (int t = 0; t < 6; ++t) {
      auto g = gaussian(d, 300 + t);
      for (size_t i = 0; i < d; ++i) e[i] += g[i];
      Bytes want = inner->compress(e, ist);
      inner->decompress_sub(want, ist, e);
      EXPECT_EQ(ef->compress(g, st), want) << "d=" << d << " step " << t;
      EXPECT_EQ(ef->residual(st), e) << "d=" << d << " step " << t;
    }
  }
}

// A state carried from a one-pass sign method (its residual's buffer holds p with the last decode pending in
// "ef.pending") to the generic error feedback of another method: the generic path read the buffer as it was, adding
// the last decode back into p, and left it pending, so residual() applied it once more. It now applies the pending
// decode first and drops it: the same payloads and residual as a state holding the applied residual.
TEST(ErrorFeedback, AStateFromAOnePassSignMethodHasItsPendingDecodeApplied) {
  for (const char* from : {"efsignsgd", "onebit", "ef:scaled_sign"}) {
    auto sign = make_compressor(from, {});
    auto topk = make_compressor("ef:topk", {{"ratio", "0.1"}});
    auto st = sign->make_state(1000, 4, 1);
    for (int t = 0; t < 3; ++t) sign->compress(gaussian(1000, 40 + t), st);
    ASSERT_NE(st.buffers.at("ef.pending")[2], 0.0f) << from;
    auto ref = topk->make_state(1000, 4, 1);
    ref.buffers["ef.residual"] = sign->residual(st);
    ASSERT_NE(ref.buffers["ef.residual"], st.buffers.at("ef.residual")) << from;  // (the decode is pending)
    for (int t = 0; t < 2; ++t) {
      const auto g = gaussian(1000, 90 + t);
      EXPECT_EQ(topk->compress(g, st), topk->compress(g, ref)) << from << " step " << t;
      EXPECT_EQ(topk->residual(st), topk->residual(ref)) << from << " step " << t;
    }
    EXPECT_FALSE(st.buffers.count("ef.pending")) << from;
  }
}

// Finite g and e whose sum passes the floats: qsgd clamped the norm and sent a finite payload, randk sent the inf, and
// both kept an inf or nan residual for good (int8 and top-k threw, with the state kept). Every inner method now
// refuses it naming the element, and the state stays as it was.
TEST(ErrorFeedback, AGradientPlusResidualPastTheFloatsIsRefusedAndTheStateKept) {
  const size_t d = 64;
  for (const auto& [name, params] :
       std::vector<std::pair<std::string, Params>>{{"ef:qsgd", {{"levels", "127"}, {"bucket", "1024"}}},
                                                   {"ef:randk", {{"ratio", "1"}, {"unbiased", "0"}}},
                                                   {"ef:int8", {}}}) {
    auto ef = make_compressor(name, params);
    auto st = ef->make_state(d, 4, 2);
    ef->compress(gaussian(d, 1), st);  // (a residual of this size)
    st.buffers.at("ef.residual")[5] = 3e38f;
    const TensorState before = st;
    auto g = gaussian(d, 2);
    g[5] = 3e38f;
    try {
      ef->compress(g, st);
      ADD_FAILURE() << name << ": a sum past the floats was compressed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("the gradient plus its error-feedback residual: element 5 of 64 is inf"),
                std::string::npos)
          << name << ": " << e.what();
    }
    EXPECT_TRUE(st == before) << name;
    g[5] = -3e38f;  // (back within the floats with the residual)
    EXPECT_NO_THROW(ef->compress(g, st)) << name;
    for (float x : ef->residual(st)) EXPECT_TRUE(std::isfinite(x)) << name;
  }
}

// Error feedback's generic call is all or nothing: one whose g + e has an inf or NaN (ef:topk's decoder refuses the
// non-finite value its payload carried, after which the residual had already taken p) throws and leaves the state as
// it was. The one-pass sign form finds out after overwriting the residual with p: it takes g out again, applies its
// pending decode and restarts the lost elements from 0 (it kept the pending decode, applied a second time by the next
// step, and the inf or NaN stayed in the residual). A fresh state stays fresh in both.
TEST(ErrorFeedback, AStepThatThrowsLeavesAUsableState) {
  const float kNan = std::numeric_limits<float>::quiet_NaN(), kInf = std::numeric_limits<float>::infinity();
  const size_t d = 1000;
  for (const auto& [name, params] : std::vector<std::pair<std::string, Params>>{
           {"efsignsgd", {}}, {"onebit", {}}, {"ef:topk", {{"ratio", "0.1"}}}}) {
    const bool one_pass = name != "ef:topk";
    auto ef = make_compressor(name, params);
    auto st = ef->make_state(d, 4, 2), ref = ef->make_state(d, 4, 2);
    for (int t = 0; t < 3; ++t)
      EXPECT_EQ(ef->compress(gaussian(d, 40 + t), st), ef->compress(gaussian(d, 40 + t), ref)) << name;
    // (Top-k selects an inf always, a NaN only when its comparisons fall short of k: ef:topk is given infs.)
    const std::vector<float> bads = one_pass ? std::vector<float>{kNan, kInf, -kInf} : std::vector<float>{kInf, -kInf};
    for (float bad : bads) {
      auto g = gaussian(d, 50);
      g[123] = bad;
      const TensorState before = st;
      const std::vector<float> residual = ef->residual(st);
      try {
        ef->compress(g, st);
        ADD_FAILURE() << name << ": a gradient with " << bad << " was compressed";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("123"), std::string::npos) << name << ": " << e.what();
      }
      EXPECT_EQ(st.step, before.step) << name;
      if (!one_pass) {
        EXPECT_TRUE(st == before) << name << " " << bad;
      } else {
        // The same residual up to one more rounding (a pending decode applied twice moved it by the scale, ~0.8),
        // but element 123, whose old value is lost, at 0.
        const std::vector<float> now = ef->residual(st);
        ASSERT_EQ(now.size(), d);
        for (size_t i = 0; i < d; ++i)
          if (i == 123)
            EXPECT_EQ(now[i], 0.0f) << name;
          else
            EXPECT_NEAR(now[i], residual[i], 1e-5f * (1 + std::fabs(residual[i]))) << name << " " << i;
        ref = st;  // continues from here
      }
      // A fresh state stays fresh.
      auto fresh = ef->make_state(d, 4, 2);
      const TensorState empty = fresh;
      EXPECT_THROW(ef->compress(g, fresh), InvalidArgument) << name;
      EXPECT_TRUE(fresh == empty) << name << " " << bad;
    }
    for (int t = 0; t < 2; ++t) {
      EXPECT_EQ(ef->compress(gaussian(d, 60 + t), st), ef->compress(gaussian(d, 60 + t), ref)) << name;
      EXPECT_EQ(ef->residual(st), ef->residual(ref)) << name;
    }
    for (float x : ef->residual(st)) EXPECT_TRUE(std::isfinite(x)) << name;
  }
  // Finite gradients whose sum with the residual overflows: after [3e38, 1, 1, 1] the residual holds 2.25e38 (the
  // scale, the mean magnitude, is 7.5e37), and 2e38 more is past FLT_MAX.
  for (const char* name : {"efsignsgd", "onebit"}) {
    auto ef = make_compressor(name, {});
    auto st = ef->make_state(4, 4, 2);
    const std::vector<float> first{3e38f, 1.0f, 1.0f, 1.0f}, over{2e38f, 0.0f, 0.0f, 0.0f},
        next{1.0f, -2.0f, 3.0f, 0.5f};
    ef->compress(first, st);
    const std::vector<float> residual = ef->residual(st);
    ASSERT_NEAR(residual[0], 2.25e38f, 1e33f) << name;
    try {
      ef->compress(over, st);
      ADD_FAILURE() << name << ": a step past FLT_MAX was compressed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("element 0 of 4 is inf"), std::string::npos) << name << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("residuals restart from 0"), std::string::npos) << e.what();
    }
    const std::vector<float> now = ef->residual(st);
    EXPECT_EQ(now[0], 0.0f) << name;
    for (size_t i = 1; i < 4; ++i) EXPECT_NEAR(now[i], residual[i], 1e-6 * (1 + std::fabs(residual[i]))) << name;
    ef->compress(next, st);
    for (float x : ef->residual(st)) EXPECT_TRUE(std::isfinite(x)) << name;
  }
}

TEST(State, SaveRestoreContinuesBitForBit) {
  struct C {
    std::string name;
    Params p;
    std::vector<size_t> shape;
  };
  std::vector<C> cs = {{"dgc", {{"ratio", "0.01"}, {"warmup_steps", "4"}, {"clip_norm", "10"}}, {5000}},
                       {"powersgd", {{"rank", "2"}}, {50, 100}},
                       {"signum", {}, {5000}},
                       {"efsignsgd", {}, {5000}},
                       {"onebit", {}, {5000}},
                       {"ef:topk", {}, {5000}},
                       {"qsgd", {}, {5000}},
                       {"natural", {}, {5000}},
                       {"randk", {}, {5000}},
                       {"terngrad", {}, {5000}}};
  for (const auto& c : cs) {
    auto comp = make_compressor(c.name, c.p);
    auto a = comp->make_state(c.shape, 11, 3);
    size_t d = 1;
    for (auto s : c.shape) d *= s;
    for (int t = 0; t < 3; ++t) comp->compress(gaussian(d, 50 + t), a);
    Bytes saved = a.save();
    TensorState b = TensorState::load(saved);
    EXPECT_EQ(a, b) << c.name;
    for (int t = 3; t < 6; ++t) {
      auto g = gaussian(d, 50 + t);
      EXPECT_EQ(comp->compress(g, a), comp->compress(g, b)) << c.name << " step " << t;
    }
    EXPECT_EQ(a, b) << c.name;
    if (comp->stateful()) {
      EXPECT_FALSE(a.buffers.empty()) << c.name;
    }
  }
  Bytes junk = {1, 2, 3};
  EXPECT_THROW(TensorState::load(junk), InvalidArgument);
  Bytes truncated = make_compressor("dgc")->make_state(10).save();
  truncated.pop_back();
  EXPECT_THROW(TensorState::load(truncated), InvalidArgument);
  // A buffer named twice is refused (the second was dropped without a word).
  TensorState two;
  two.buffers["qa"] = {1.0f};
  two.buffers["qb"] = {2.0f};
  Bytes dup = two.save();
  auto at = std::search(dup.begin(), dup.end(), std::begin("qb"), std::begin("qb") + 2);
  ASSERT_NE(at, dup.end());
  at[1] = 'a';
  try {
    TensorState::load(dup);
    ADD_FAILURE() << "a buffer named twice was loaded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("buffer 'qa' appears twice"), std::string::npos) << e.what();
  }
}

TEST(Dgc, WarmupMomentumCorrectionAndFactorMasking) {
  // A warm-up shorter than its four stages would skip some (2 steps: 25% then 1.5625%): refused.
  for (const char* w : {"1", "2", "3"})
    EXPECT_THROW(make_compressor("dgc", {{"warmup_steps", w}}), ConfigError) << w;
  auto c = make_compressor("dgc", {{"ratio", "0.001"}, {"warmup_steps", "8"}, {"momentum", "0.5"}});
  const size_t d = 10000;
  auto st = c->make_state(d);
  // Densities 25%, 25%, 6.25%, 6.25%, 1.5625%, 1.5625%, 0.4%, 0.4%, then 0.1%.
  const size_t ks[] = {2500, 2500, 625, 625, 157, 157, 40, 40, 10, 10};
  for (size_t t = 0; t < 10; ++t) {
    EXPECT_EQ(c->wire_bytes(d, st), 8 * ks[t]) << t;
    auto g = gaussian(d, t);
    auto before_u = st.buffer("dgc.u", d);
    auto before_v = st.buffer("dgc.v", d);
    Bytes p = c->compress(g, st);
    ASSERT_EQ(p.size(), 8 * ks[t]);
    std::vector<float> y(d);
    c->decompress(p, st, y);
    const auto& u = st.buffers.at("dgc.u");
    const auto& v = st.buffers.at("dgc.v");
    float least_sent = std::numeric_limits<float>::infinity(), most_kept = 0;
    for (size_t i = 0; i < d; ++i) {
      float uu = 0.5f * before_u[i] + g[i];
      float vv = before_v[i] + uu;
      if (y[i] != 0) {
        EXPECT_EQ(y[i], vv);  // sent the accumulated, momentum-corrected value
        EXPECT_EQ(u[i], 0.0f);
        EXPECT_EQ(v[i], 0.0f);
        least_sent = std::min(least_sent, std::fabs(vv));
      } else {
        EXPECT_EQ(u[i], uu);
        EXPECT_EQ(v[i], vv);
        most_kept = std::max(most_kept, std::fabs(vv));
      }
    }
    // The k largest of the accumulation v (not of the gradient or the momentum u).
    EXPECT_GE(least_sent, most_kept) << t;
  }
  // Local gradient clipping: the momentum after one step from zero is the clipped gradient.
  auto cl = make_compressor("dgc", {{"clip_norm", "1"}, {"momentum", "0"}, {"ratio", "0.5"}});
  auto s2 = cl->make_state(4);
  std::vector<float> g = {3, 4, 0, 0};  // norm 5
  cl->compress(g, s2);
  std::vector<float> y(4);
  EXPECT_NEAR(s2.buffers.at("dgc.u")[0] + s2.buffers.at("dgc.u")[1], 0.0, 1e-7);  // both sent
  Bytes p2 = cl->compress(std::vector<float>{0, 0, 3, 4}, s2);
  cl->decompress(p2, s2, y);
  EXPECT_NEAR(y[2], 0.6, 1e-6);
  EXPECT_NEAR(y[3], 0.8, 1e-6);
}

// QSGD's coding=elias sends the levels the fixed coding sends (the same random stream), so both decode to the same
// floats bit for bit, at every size, bucket and level count, for decompress and decompress_add, except the sign of
// zero: a negative element whose level is 0 decodes as -0 from the fixed codes (which carry its sign) and as +0 from
// the Elias codes (which send only nonzero levels).
TEST(QsgdElias, DecodesToWhatTheFixedCodingDecodesTo) {
  for (const char* levels : {"1", "3", "127", "32767"})
    for (const char* bucket : {"0", "7", "64"})
      for (size_t d : {size_t{0}, size_t{1}, size_t{9}, size_t{1000}, size_t{4099}}) {
        const Params fixed_p = {{"levels", levels}, {"bucket", bucket}};
        Params elias_p = fixed_p;
        elias_p["coding"] = "elias";
        auto fixed = make_compressor("qsgd", fixed_p), elias = make_compressor("qsgd", elias_p);
        EXPECT_FALSE(elias->fixed_size());
        auto fs = fixed->make_state(d, 11, 2), es = elias->make_state(d, 11, 2);
        std::vector<float> x = gaussian(d, d + 5);
        if (d > 4) x[3] = 0.0f;
        for (int step = 0; step < 3; ++step) {
          const Bytes fp = fixed->compress(x, fs), ep = elias->compress(x, es);
          const std::string where = fmt::format("levels {} bucket {} d {} step {}", levels, bucket, d, step);
          if (d == 0) {
            EXPECT_TRUE(ep.empty()) << where;
          }
          const auto want = decode(*fixed, fp, fs, d), got = decode(*elias, ep, es, d);
          auto bits = [](float v) { return std::bit_cast<uint32_t>(v); };
          for (size_t i = 0; i < d; ++i)
            ASSERT_EQ(bits(got[i]), want[i] == 0.0f ? 0u : bits(want[i])) << where << " element " << i;
          std::vector<float> acc_f(d, 0.5f), acc_e(d, 0.5f);
          fixed->decompress_add(fp, fs, acc_f);
          elias->decompress_add(ep, es, acc_e);
          for (size_t i = 0; i < d; ++i) ASSERT_EQ(bits(acc_e[i]), bits(acc_f[i])) << where << " element " << i;
        }
        EXPECT_EQ(es.step, 3u);
      }
}

// The codes of one input, bit by bit: d = 10, s = 1, one element -2 at position 3 (level 1 exactly, the rest 0):
// omega(1 nonzero + 1) = 100, omega(gap 4) = 10 100 0, sign 1, omega(level 1) = 0, then zero bits to the byte.
TEST(QsgdElias, WritesTheCountThenGapSignAndLevelOfEachNonzeroAsEliasOmegaCodes) {
  auto c = parse_compressor("qsgd:levels=1,coding=elias");
  std::vector<float> x(10, 0.0f);
  x[3] = -2.0f;
  auto st = c->make_state(x.size(), 1, 0);
  const Bytes p = c->compress(x, st);
  ASSERT_EQ(p.size(), 6u);
  float norm;
  std::memcpy(&norm, p.data(), 4);
  EXPECT_EQ(norm, 2.0f);
  EXPECT_EQ(p[4], 0x94);  // 1001 0100
  EXPECT_EQ(p[5], 0x40);  // 010 then five zero bits
  const auto y = decode(*c, p, st, x.size());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], x[i]) << i;
  EXPECT_THROW(c->wire_bytes(10, st), InvalidArgument);  // (the size is the payload's)

  // Gaps of 256 and more take the coder's general path (its table holds the codes below 256, the decoder's below 64);
  // buckets of one make every nonzero level s, exactly, and at s = 1 each decodes to its element.
  auto wide = parse_compressor("qsgd:levels=1,bucket=1,coding=elias");
  std::vector<float> sparse(70000, 0.0f);
  for (size_t i : {size_t{0}, size_t{63}, size_t{64}, size_t{320}, size_t{65000}, size_t{69999}})
    sparse[i] = (i % 2 ? -1.0f : 1.0f) * static_cast<float>(i + 1);
  auto wst = wide->make_state(sparse.size(), 1, 0);
  const Bytes wp = wide->compress(sparse, wst);
  const auto wy = decode(*wide, wp, wst, sparse.size());
  for (size_t i = 0; i < sparse.size(); ++i) ASSERT_EQ(wy[i], sparse[i]) << i;
}

// At one level most of a large bucket's levels are 0 (in expectation at most sqrt(d) are not): the fixed coding sends
// 2 bits an element, the Elias codes a few bits a nonzero. At 127 levels almost every level is nonzero, and the codes
// stay near the fixed coding's 8 bits an element.
TEST(QsgdElias, SendsFarFewerBytesThanTheFixedCodingAtFewLevels) {
  const size_t d = 100000;
  const auto x = gaussian(d, 9);
  auto bytes = [&](const std::string& spec) {
    auto c = parse_compressor(spec);
    auto st = c->make_state(d, 4, 1);
    return c->compress(x, st).size();
  };
  const size_t fixed1 = bytes("qsgd:levels=1"), elias1 = bytes("qsgd:levels=1,coding=elias");
  EXPECT_EQ(fixed1, 4 + d / 4);
  EXPECT_LT(elias1 * 20, fixed1) << elias1;
  EXPECT_GT(elias1, 4 + 200u * 2) << elias1;  // about 0.8 sqrt(d) = 252 nonzeros of 10+ bits each
  const size_t fixed127 = bytes("qsgd:levels=127,bucket=128"),
               elias127 = bytes("qsgd:levels=127,bucket=128,coding=elias");
  EXPECT_LT(elias127, fixed127 * 16 / 10) << elias127;
  EXPECT_GT(elias127, fixed127 * 7 / 10) << elias127;
  // Within max_payload_bytes at the widest codes: a level of 32767 in every element of buckets of one.
  auto widest = parse_compressor("qsgd:levels=32767,bucket=1,coding=elias");
  auto st = widest->make_state(d, 1, 0);
  EXPECT_LE(widest->compress(x, st).size(), max_payload_bytes(*widest, d, st));
}

// Codes no encoder writes are refused naming what is wrong, by decompress and decompress_add alike.
TEST(QsgdElias, RefusesCodesNoEncoderWrites) {
  auto c = parse_compressor("qsgd:levels=1,coding=elias");
  auto st = c->make_state(4, 1, 0);
  auto payload = [](std::initializer_list<uint8_t> codes) {
    Bytes p(4);
    const float norm = 1.0f;
    std::memcpy(p.data(), &norm, 4);
    p.insert(p.end(), codes);
    return p;
  };
  auto refused = [&](const Bytes& p, size_t d, const std::string& want) {
    for (bool add : {false, true}) {
      std::vector<float> out(d);
      try {
        add ? c->decompress_add(p, st, out) : c->decompress(p, st, out);
        ADD_FAILURE() << want << ": decoded";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
        EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      }
    }
  };
  refused(payload({0x84}), 4, "element 0 of the payload has a level above 1");            // 100 0 0 100: level 2
  refused(payload({0x95, 0x00}), 4, "lies at position 4, past the tensor's 4 elements");  // gap 5
  refused(payload({0xB0}), 4, "announces 5 nonzero elements of 4");                       // count 6 - 1
  refused(payload({0xFF, 0xFF, 0xFF, 0xFF}), 4, "wider than 40 bits");
  refused(payload({0x94}), 4, "end inside nonzero element 0's gap");  // 100 10100: gap 4's code cut short
  refused(payload({0x94, 0x41}), 4, "exactly those bytes");           // a padding bit set
  refused(payload({0x94, 0x40, 0x00}), 4, "exactly those bytes");     // a byte after the codes
  refused(payload({}), 4, "shorter than its 1 bucket norms and codes");
  refused(payload({0x96, 0x80}), 100, "end inside nonzero element 0's sign");  // 100 | omega(64), 13 bits
  refused(payload({0x87}), 4, "end inside nonzero element 0's level");         // 100 0 0 | 111: cut
  // A level's code whose groups grow past 40 bits: 100 0 0 then 1 1 1 111 1 <15 ones> 1 ...
  refused(payload({0x87, 0xFF, 0xFF, 0xFF, 0xFF}), 4, "nonzero element 0's level is an Elias code wider than 40 bits");
  refused(payload({0x00}), 0, "payload of 5 bytes, expected 0");  // no elements, no bytes
  EXPECT_NO_THROW(decode(*c, payload({0x94, 0x40}), st, 4));
  EXPECT_EQ(decode(*c, payload({0x94, 0x40}), st, 4)[3], -1.0f);
  // decompress_add leaves the elements no code names as they were, -0 too, whether the codes are read twice (one
  // nonzero of 16) or decoded into a buffer first (three): 100 | 000 (element 0), and 101000 | 000 | 000 | 000.
  for (const Bytes& p : {payload({0x80}), payload({0xA0, 0x00})}) {
    auto sixteen = parse_compressor("qsgd:levels=1,bucket=16,coding=elias");
    std::vector<float> acc(16, -0.0f);
    sixteen->decompress_add(p, sixteen->make_state(16), acc);
    EXPECT_EQ(std::bit_cast<uint32_t>(acc[15]), 0x80000000u) << p.size();
    EXPECT_EQ(acc[0], 1.0f);
  }
  // Every code is checked before anything is written: a payload refused at its second element (level 2 of 1) left
  // its first in the output, and the zeros before it. (Of 4 elements most are nonzero, decoded into a buffer first;
  // of 100 few, read twice.)
  for (size_t d : {size_t{4}, size_t{100}})
    for (bool add : {false, true}) {
      std::vector<float> out(d, 7.0f);
      // 110 (2 nonzeros + 1 = 3) | 0 0 0 (gap 1, +, level 1) | 0 0 100 (gap 1, +, level 2)
      const Bytes bad = payload({0xC0, 0x80});
      EXPECT_THROW(add ? c->decompress_add(bad, st, out) : c->decompress(bad, st, out), InvalidArgument);
      EXPECT_EQ(out, std::vector<float>(d, 7.0f)) << (add ? "decompress_add" : "decompress") << " of " << d;
    }
  try {
    parse_compressor("qsgd:coding=huffman");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("coding='huffman' must be one of fixed"), std::string::npos) << e.what();
  }
}
