// PowerSGD on one worker: orthonormal P, exact recovery of rank-r matrices, error feedback, warm start, start
// iteration and uncompressed 1-D tensors. (Linearity across workers: collectives_test.cc and below.)
#include "compress/powersgd.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>

#include "compress/collectives.h"
#include "core/error.h"
#include "ranks.h"

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

// n x m matrix of rank r: A (n x r) B^T (r x m).
std::vector<float> low_rank(size_t n, size_t m, size_t r, uint64_t seed) {
  auto a = gaussian(n * r, seed), b = gaussian(m * r, seed + 1);
  std::vector<float> x(n * m, 0.0f);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < m; ++j)
      for (size_t k = 0; k < r; ++k) x[i * m + j] += a[i * r + k] * b[j * r + k];
  return x;
}

// Address space that is never touched: MAP_NORESERVE commits no memory until written (null when refused).
struct Untouched {
  explicit Untouched(size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data = p == MAP_FAILED ? nullptr : p;
  }
  ~Untouched() {
    if (data) ::munmap(data, bytes);
  }
  Untouched(const Untouched&) = delete;
  Untouched& operator=(const Untouched&) = delete;
  size_t bytes;
  void* data;
};

}  // namespace

// plan() sends a matrix with a side past INT_MAX uncompressed (BLAS takes int dimensions), so no encoder writes P and
// Q for one; decompress took the shape from the state and cast its sides to int, and a payload of exactly P's and Q's
// size (2 x 2^31: P 2 x 1, Q 2^31 x 1) became a product with a negative dimension, which OpenBLAS refused, leaving
// the output as it was. Refused with the bound named, before the payload or the output is read.
TEST(PowerSgd, FactorsOfAMatrixPastBlasIntAreRefused) {
  auto c = make_compressor("powersgd", {{"rank", "1"}, {"min_ratio", "0"}, {"wire", "f16"}});
  const size_t n = 2, m = size_t{1} << 31, d = n * m;
  ASSERT_GT(m, static_cast<size_t>(std::numeric_limits<int>::max()));
  TensorState st;  // (make_state would do the same; no buffers are allocated either way)
  st.shape = {n, m};
  EXPECT_EQ(c->wire_bytes(d, st), 2 * d);  // the encoder's plan: uncompressed, 2 bytes an element
  const size_t pq = 2 * (n + m);           // P and Q of rank 1 in f16
  Untouched out_mem(4 * d), pay_mem(pq);
  if (!out_mem.data || !pay_mem.data) GTEST_SKIP() << "no 20 GiB of address space for an untouched 2 x 2^31 tensor";
  std::span<float> out(static_cast<float*>(out_mem.data), d);
  std::span<const uint8_t> payload(static_cast<const uint8_t*>(pay_mem.data), pq);
  try {
    c->decompress(payload, st, out);
    ADD_FAILURE() << "P and Q of a 2 x 2^31 matrix were decoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("sides up to 2147483647 (BLAS's int)"), std::string::npos) << e.what();
  }
  // The 2 x 2^31 - 1 matrix fits: its payload size is checked as before (here: one element short).
  st.shape = {n, m - 1};
  try {
    c->decompress(payload.first(pq - 4), st, out.first(d - 2));
    ADD_FAILURE() << "a short payload was decoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos) << e.what();
  }
}

// A shape whose product wraps past 2^64 to the tensor's size (3 x 12297829382473034414 = 2^65 + 10) was taken as a
// 3 x 3 matrix of a 10-element tensor: its last element never decoded.
TEST(PowerSgd, AShapeWhoseProductWrapsIsRefused) {
  auto c = make_compressor("powersgd", {{"rank", "1"}, {"min_ratio", "0"}});
  auto st = c->make_state(std::vector<size_t>{3, 12297829382473034414ull});
  std::vector<float> x(10, 1.0f);
  try {
    c->compress(x, st);
    ADD_FAILURE() << "compressed";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("more than 2^64"), std::string::npos) << e.what();
  }
  // A zero dimension is refused too (skipped in the overflow check, it divided by zero).
  auto zero = c->make_state(std::vector<size_t>{0, 5});
  EXPECT_THROW(c->compress(std::vector<float>(5, 1.0f), zero), InvalidArgument);
}

TEST(PowerSgd, PIsOrthonormal) {
  auto c = make_compressor("powersgd", {{"rank", "4"}});
  const size_t n = 40, m = 60, r = 4;
  auto st = c->make_state({n, m}, 1, 0);
  Bytes p = c->compress(gaussian(n * m, 2), st);
  ASSERT_EQ(p.size(), 4 * r * (n + m));
  const float* pt = reinterpret_cast<const float*>(p.data());  // r rows of length n
  for (size_t i = 0; i < r; ++i)
    for (size_t j = 0; j < r; ++j) {
      double dot = 0;
      for (size_t k = 0; k < n; ++k) dot += double(pt[i * n + k]) * pt[j * n + k];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-5) << i << "," << j;
    }
}

TEST(PowerSgd, RecoversRankRMatricesExactly) {
  for (size_t r : {1, 2, 5}) {
    const size_t n = 60, m = 80;
    auto x = low_rank(n, m, r, 10 + r);
    auto c = make_compressor("powersgd", {{"rank", std::to_string(r)}});
    auto st = c->make_state({n, m}, 3, 0);
    Bytes p = c->compress(x, st);
    std::vector<float> y(n * m);
    c->decompress(p, st, y);
    double scale = 0;
    for (float v : x) scale = std::max(scale, double(std::fabs(v)));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-4 * scale) << "r=" << r;
    for (float e : st.buffers.at("psgd.residual")) ASSERT_NEAR(e, 0.0, 1e-4 * scale);
  }
  // A full-rank matrix is not recovered by rank 1 (the check can fail).
  auto c = make_compressor("powersgd", {{"rank", "1"}});
  auto x = gaussian(60 * 80, 1);
  auto st = c->make_state({60, 80}, 3, 0);
  std::vector<float> y(x.size());
  c->decompress(c->compress(x, st), st, y);
  double err = 0;
  for (size_t i = 0; i < x.size(); ++i) err = std::max(err, double(std::fabs(y[i] - x[i])));
  EXPECT_GT(err, 0.5);
}

TEST(PowerSgd, ErrorFeedbackWarmStartAndStartIteration) {
  const size_t n = 32, m = 48;
  auto c = make_compressor("powersgd", {{"rank", "1"}, {"start_iter", "2"}});
  auto st = c->make_state({n, m}, 3, 0);
  auto g = gaussian(n * m, 5);
  std::vector<float> y(n * m), sum(n * m, 0.0f);
  // Before start_iter: uncompressed, no residual.
  for (int t = 0; t < 2; ++t) {
    Bytes p = c->compress(g, st);
    EXPECT_EQ(p.size(), 4 * n * m);
    c->decompress(p, st, y);
    EXPECT_EQ(y, g);
  }
  EXPECT_FALSE(st.buffers.count("psgd.residual"));
  EXPECT_TRUE(c->residual(st).empty());
  // Then: sent + residual = inputs (error feedback), and Q is carried over (warm start), at unit length.
  double worst = 0;
  std::vector<double> sent(n * m, 0), given(n * m, 0);
  const int steps = 300;
  for (int t = 0; t < steps; ++t) {
    Bytes p = c->compress(g, st);
    EXPECT_EQ(p.size(), 4 * (n + m));
    c->decompress(p, st, y);
    for (size_t i = 0; i < y.size(); ++i) sent[i] += y[i], given[i] += g[i];
    const float* q = reinterpret_cast<const float*>(p.data()) + n;
    double qq = 0;
    for (size_t k = 0; k < m; ++k) qq += double(q[k]) * q[k];
    const auto& kept = st.buffers.at("psgd.q");
    ASSERT_EQ(kept.size(), m);
    for (size_t k = 0; k < m; ++k) ASSERT_NEAR(kept[k], q[k] / std::sqrt(qq), 1e-6) << t << " " << k;
  }
  // (Compressor::residual returns it, as for the other methods with error feedback: it returned nothing.)
  const auto e = c->residual(st);
  ASSERT_EQ(e, st.buffers.at("psgd.residual"));
  for (size_t i = 0; i < e.size(); ++i) worst = std::max(worst, std::fabs(sent[i] + e[i] - given[i]));
  EXPECT_LT(worst, 1e-3);
  auto plain = make_compressor("powersgd", {{"rank", "1"}, {"error_feedback", "0"}});
  auto ps = plain->make_state({n, m}, 3, 0);
  plain->compress(g, ps);
  EXPECT_TRUE(plain->residual(ps).empty());
  // With error feedback, the average of what was sent approaches g although each step is rank 1.
  double err = 0;
  for (size_t i = 0; i < g.size(); ++i) err = std::max(err, std::fabs(sent[i] / steps - g[i]));
  EXPECT_LT(err, 0.5) << "after " << steps << " steps";
}

// Linearity across workers: PowerSGD of W workers' matrices equals single-worker PowerSGD of their sum.
TEST(PowerSgd, LinearAcrossWorkers) {
  for (int w : {2, 3, 5}) {
    const size_t n = 24, m = 36;
    auto c = make_compressor("powersgd", {{"rank", "3"}, {"error_feedback", "0"}});
    std::vector<float> total(n * m, 0.0f), dist(n * m);
    for (int r = 0; r < w; ++r) {
      auto x = gaussian(n * m, 70 + r);
      for (size_t i = 0; i < x.size(); ++i) total[i] += x[i];
    }
    conduit::compress::testing::on_ranks(w, [&](coll::Communicator& comm) {
      auto st = c->make_state({n, m}, 9, comm.rank());
      auto x = gaussian(n * m, 70 + comm.rank());
      compressed_allreduce(comm, *c, st, x);
      if (comm.rank() == 0) dist = x;
    });
    auto st = c->make_state({n, m}, 9, 0);
    std::vector<float> y(n * m);
    c->decompress(c->compress(total, st), st, y);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(dist[i], y[i], 1e-3) << "w=" << w;
  }
}

TEST(PowerSgd, RankBelowRIsStillRecovered) {
  const size_t n = 40, m = 50;
  std::vector<float> x(n * m);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 7);  // rank 7
  auto c = make_compressor("powersgd", {{"rank", "8"}});
  auto st = c->make_state({n, m}, 1, 0);
  std::vector<float> y(x.size());
  c->decompress(c->compress(x, st), st, y);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-3) << i;
  // The dependent eighth column of P is zero, the other seven orthonormal.
  const float* pt = nullptr;
  Bytes p = c->compress(x, st);
  pt = reinterpret_cast<const float*>(p.data());
  for (size_t i = 0; i < 8; ++i) {
    double nn = 0;
    for (size_t k = 0; k < n; ++k) nn += double(pt[i * n + k]) * pt[i * n + k];
    EXPECT_NEAR(nn, i < 7 ? 1.0 : 0.0, 1e-5) << i;
  }
  c->decompress(p, st, y);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 1e-3) << i;
}

// A column of P that came out zero has its Q column redrawn for the next step, not stuck at zero: after an all-zero
// gradient (every column of P zero, so Q = M^T P is zero too) a rank-1 gradient is still recovered, with and without
// the warm start. (The test above could not tell: seven of its eight columns rebuilt a rank-7 matrix either way.)
TEST(PowerSgd, AZeroColumnOfPHasItsQColumnRedrawn) {
  const size_t n = 40, m = 50;
  for (const char* warm : {"1", "0"}) {
    auto c = make_compressor("powersgd", {{"rank", "1"}, {"warm_start", warm}});
    auto st = c->make_state({n, m}, 1, 0);
    std::vector<float> zero(n * m, 0.0f), y(n * m);
    c->decompress(c->compress(zero, st), st, y);
    for (float v : y) ASSERT_EQ(v, 0.0f);
    const auto x = low_rank(n, m, 1, 5);
    c->decompress(c->compress(x, st), st, y);
    double err = 0, norm = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      err += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      norm += double(x[i]) * x[i];
    }
    EXPECT_LT(std::sqrt(err / norm), 1e-4) << "warm_start " << warm;
  }
}

// The warm start keeps Q's columns at unit length, so P and Q stay the size of the gradient and a 16-bit wire
// carries them at any scale: a rank-1 gradient of 2 workers is recovered at every step with f16 whether its singular
// value is 1000 or 1e-3 (an unnormalised Q made P scale with its square: 1000 overflowed f16, sending zeros and
// twice the gradient in turn; 1e-3 underflowed to 30-40% error).
TEST(PowerSgd, SixteenBitWireKeepsAccuracyAtAnyScale) {
  const size_t n = 128, m = 96;
  std::mt19937_64 g(1);
  std::normal_distribution<double> nd;
  std::vector<double> u(n), v(m);
  double nu = 0, nv = 0;
  for (auto& x : u) {
    x = nd(g);
    nu += x * x;
  }
  for (auto& x : v) {
    x = nd(g);
    nv += x * x;
  }
  for (double sigma : {1e3, 1.0, 1e-3}) {
    std::vector<float> grad(n * m);
    for (size_t i = 0; i < n; ++i)
      for (size_t j = 0; j < m; ++j) grad[i * m + j] = float(sigma * u[i] * v[j] / std::sqrt(nu * nv));
    std::vector<double> worst(2, 0);
    conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
      auto c = make_compressor("powersgd", {{"rank", "1"}, {"wire", "f16"}});
      auto st = c->make_state({n, m}, 3, comm.rank());
      for (int step = 0; step < 6; ++step) {
        auto x = grad;
        compressed_allreduce(comm, *c, st, x, {true});
        double err = 0, norm = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          err += double(x[i] - grad[i]) * (x[i] - grad[i]);
          norm += double(grad[i]) * grad[i];
        }
        worst[comm.rank()] = std::max(worst[comm.rank()], std::sqrt(err / norm));
      }
    });
    EXPECT_LT(worst[0], 0.01) << "singular value " << sigma;
    EXPECT_LT(worst[1], 0.01) << "singular value " << sigma;
  }
}

// Factors beyond f16's range (65504) arrive as inf: every rank stops with one error naming the wire (orthonormalising
// zeroed the column, the layer sent nothing and its residual grew without end while the run went on).
TEST(PowerSgd, FactorsBeyondTheWireRangeAreAnErrorNotASilentZero) {
  const size_t n = 64, m = 48;
  std::vector<float> grad(n * m);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < m; ++j)
      grad[i * m + j] = float(1e6 * std::sin(0.1 * double(i) + 1) * std::cos(0.2 * double(j)));
  std::vector<std::string> errors(2);
  conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
    auto c = make_compressor("powersgd", {{"rank", "1"}, {"wire", "f16"}});
    auto st = c->make_state({n, m}, 3, comm.rank());
    auto x = grad;
    try {
      compressed_allreduce(comm, *c, st, x, {true});
    } catch (const InvalidArgument& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("outgrew the wire's range"), std::string::npos) << e;
}

// Averaged over an f16 wire, a round whose sum leaves the range is sent again with each rank's part divided by W
// first, as the fp16 compressor's is: 4 ranks of 20,000 summed to 80,000, past f16's 65504, and every rank stopped
// with "outgrew the wire's range" although the mean fitted. Every element 20,000, in a 1-D tensor (sent uncompressed)
// and a 4 x 4 matrix of rank 1 (its P and Q, 40,000 on each rank, summed past the range too; seed 1 draws a first Q
// that makes P 42,599, another's fresh Q can make it exceed f16 on one rank), one call each and batched, over three
// steps (the warm start and the residual follow from the mean). A step whose sums fit is not divided first (7e-8,
// rounded to f16's smallest subnormal, arrives; its quarter, below half of it, flushed to zero), and summed instead
// of averaged, 80,000 is beyond the wire: still refused.
TEST(PowerSgd, SixteenBitWireAveragesAMeanWithinRangeWhateverTheSum) {
  auto c = make_compressor("powersgd", {{"rank", "1"}, {"wire", "f16"}});
  ReduceOptions avg;
  avg.average = true;
  for (bool batched : {false, true}) {
    conduit::compress::testing::on_ranks(4, [&](coll::Communicator& comm) {
      auto sv = c->make_state({8}, 1, comm.rank()), sm = c->make_state({4, 4}, 1, comm.rank());
      for (int step = 0; step < 3; ++step) {
        std::vector<float> v(8, 20000.0f), m(16, 20000.0f);
        if (batched) {
          compressed_allreduce_many(comm, *c, {&sv, &sm}, {std::span<float>(v), std::span<float>(m)}, avg);
        } else {
          EXPECT_EQ(compressed_allreduce(comm, *c, sv, v, avg), 2u * 2 * 8);  // (sent twice)
          compressed_allreduce(comm, *c, sm, m, avg);
        }
        for (float x : v) ASSERT_EQ(x, 20000.0f) << "batched " << batched << " step " << step;  // (20000/4 exact)
        for (float x : m) ASSERT_NEAR(x, 20000.0f, 20000.0f * 0x1p-9f) << "batched " << batched << " step " << step;
        for (float e : sm.buffers.at("psgd.residual")) ASSERT_LT(std::fabs(e), 20000.0f * 0x1p-9f) << step;
      }
    });
  }
  conduit::compress::testing::on_ranks(4, [&](coll::Communicator& comm) {
    auto st = c->make_state({8}, 1, comm.rank());
    std::vector<float> v(8, 7e-8f);
    EXPECT_EQ(compressed_allreduce(comm, *c, st, v, avg), 2u * 8);
    for (float x : v) ASSERT_EQ(x, 0x1p-24f);  // (f16's smallest subnormal)
  });
  std::vector<std::string> errors(4);
  conduit::compress::testing::on_ranks(4, [&](coll::Communicator& comm) {
    auto st = c->make_state({8}, 1, comm.rank());
    std::vector<float> v(8, 20000.0f);
    try {
      compressed_allreduce(comm, *c, st, v);
    } catch (const InvalidArgument& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("element 0 of the summed P factors and uncompressed tensors is inf (f16 wire)"), std::string::npos)
        << e;
}

// An uncompressed payload (w x d bytes) holding a nan or inf (a corrupt one, or a value past f16's range at its
// sender) is refused, as the factors' decoder refuses theirs, not passed on.
TEST(PowerSgd, AnUncompressedPayloadWithANanIsRefused) {
  auto c = make_compressor("powersgd", {{"rank", "1"}});
  auto st = c->make_state({10}, 3, 0);
  std::vector<float> raw(10, 1.0f);
  raw[7] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> payload(40);
  std::memcpy(payload.data(), raw.data(), 40);
  std::vector<float> out(10);
  try {
    c->decompress(payload, st, out);
    ADD_FAILURE() << "a nan was decoded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("element 7 of an uncompressed payload of 10 elements is nan (f32 wire)"),
              std::string::npos)
        << e.what();
  }
}

// wire=f16 / bf16: half the bytes (P, Q and uncompressed tensors), the same result as wire=f32 up to the 16-bit
// rounding, and error feedback that absorbs the rounding (what was reconstructed plus the residual is the input).
TEST(PowerSgd, SixteenBitWireHalvesTheBytesAndFeedsBackTheRounding) {
  const size_t n = 48, m = 64, r = 4;
  for (std::string wire : {"f16", "bf16"}) {
    auto c32 = make_compressor("powersgd", {{"rank", "4"}});
    auto c16 = make_compressor("powersgd", {{"rank", "4"}, {"wire", wire}});
    auto s32 = c32->make_state({n, m}, 3, 0), s16 = c16->make_state({n, m}, 3, 0);
    auto x = gaussian(n * m, 5);
    EXPECT_EQ(c16->wire_bytes(n * m, s16), 2 * r * (n + m));
    EXPECT_EQ(c32->wire_bytes(n * m, s32), 4 * r * (n + m));
    Bytes p16 = c16->compress(x, s16), p32 = c32->compress(x, s32);
    ASSERT_EQ(p16.size(), 2 * r * (n + m));
    std::vector<float> y16(n * m), y32(n * m);
    c16->decompress(p16, s16, y16);
    c32->decompress(p32, s32, y32);
    double tol = wire == "f16" ? 5e-3 : 4e-2, scale = 0;
    for (float v : y32) scale = std::max(scale, double(std::fabs(v)));
    double diff = 0;
    for (size_t i = 0; i < y16.size(); ++i) {
      ASSERT_NEAR(y16[i], y32[i], tol * scale) << wire << " " << i;
      diff = std::max(diff, double(std::fabs(y16[i] - y32[i])));
    }
    EXPECT_GT(diff, 0.0) << wire << ": the 16-bit wire rounds something";
    // Error feedback: reconstruction + residual == input (to f32 rounding), although the payload was rounded.
    const auto& e = s16.buffers.at("psgd.residual");
    for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y16[i] + e[i], x[i], 1e-5) << wire << " " << i;
    // A 1-D tensor goes uncompressed, as 16-bit values.
    auto b = c16->make_state({10}, 3, 0);
    std::vector<float> v = {1.0f, -2.5f, 3.25f, 1e-3f, 0, 7, 8, 9, 10, 11.5f}, w(10);
    Bytes pb = c16->compress(v, b);
    ASSERT_EQ(pb.size(), 20u);
    c16->decompress(pb, b, w);
    for (size_t i = 0; i < 10; ++i) EXPECT_NEAR(w[i], v[i], 1e-2 * std::fabs(v[i]) + 1e-6) << wire;
  }
  // Across workers the collective sends half the bytes and stays close to the f32-wire result.
  for (int w : {2, 4}) {
    std::vector<std::vector<float>> out32(w), out16(w);
    std::vector<size_t> bytes32(w), bytes16(w);
    for (std::string wire : {"f32", "f16"}) {
      auto c = make_compressor("powersgd", {{"rank", "4"}, {"wire", wire}});
      conduit::compress::testing::on_ranks(w, [&](coll::Communicator& comm) {
        auto st = c->make_state({n, m}, 9, comm.rank());
        auto x = gaussian(n * m, 70 + comm.rank());
        size_t sent = compressed_allreduce(comm, *c, st, x);
        (wire == "f32" ? out32 : out16)[comm.rank()] = x;
        (wire == "f32" ? bytes32 : bytes16)[comm.rank()] = sent;
      });
    }
    for (int k = 0; k < w; ++k) {
      EXPECT_EQ(bytes16[k] * 2, bytes32[k]) << "w=" << w;
      EXPECT_EQ(out16[k], out16[0]) << "every rank ends with the same result";
      double scale = 0;
      for (float v : out32[k]) scale = std::max(scale, double(std::fabs(v)));
      for (size_t i = 0; i < n * m; ++i) ASSERT_NEAR(out16[k][i], out32[k][i], 1e-2 * scale) << "w=" << w;
    }
  }
  EXPECT_THROW(make_compressor("powersgd", {{"wire", "f8"}}), ConfigError);
}
