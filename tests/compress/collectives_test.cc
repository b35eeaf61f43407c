// Every compressed collective equals decompress-then-reduce, for 1 to 8 in-process ranks and on sub-communicators:
//  - allgather and majority-vote methods: bit for bit (payloads decoded and summed in rank order on every rank);
//  - linear methods (allreduce of the payload in its dtype): within the dtype's rounding of n additions;
//  - PowerSGD: equal to a local simulation of its two allreduces (f32 rounding), batched equal to per-tensor;
//  - the re-quantizing ring: bit for bit equal to a local simulation of the ring's hops.
#include "compress/collectives.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "../coll/counting_transport.h"
#include "compress/powersgd.h"
#include "core/dtype.h"
#include "core/error.h"
#include "net/inproc.h"
#include "ranks.h"

using namespace conduit;
using namespace conduit::compress;
using conduit::compress::testing::on_ranks;

namespace {

std::vector<float> gaussian(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

struct Method {
  std::string name;
  Params p;
};

const std::vector<Method> kMethods = {{"none", {}},
                                      {"fp16", {}},
                                      {"bf16", {}},
                                      {"int8", {}},
                                      {"uint8", {}},
                                      {"qsgd", {{"levels", "3"}}},
                                      {"terngrad", {}},
                                      {"natural", {}},
                                      {"signsgd", {}},
                                      {"signum", {}},
                                      {"scaled_sign", {}},
                                      {"efsignsgd", {}},
                                      {"onebit", {}},
                                      {"topk", {{"ratio", "0.05"}}},
                                      {"randk", {{"ratio", "0.1"}}},
                                      {"threshold", {{"threshold", "1.5"}}},
                                      {"dgc", {{"ratio", "0.05"}}},
                                      {"ef:topk", {{"ratio", "0.02"}}},
                                      {"qsgd", {{"levels", "3"}, {"coding", "elias"}}}};

// Tolerance of a linear method's allreduce against f32 decode-then-sum: n roundings to the payload dtype.
// Unit roundoff of a payload dtype's sums (round to nearest: half an ulp, relative).
double unit_roundoff(DType t) {
  if (t == DType::f16) return 1.0 / 2048;
  if (t == DType::bf16) return 1.0 / 256;
  return 1.0 / (1 << 24);
}

// The check of one method on one communicator. `members` are the world ranks of the group (their data seeds).
void check_method(coll::Communicator& c, const Method& m, const std::vector<int>& members, size_t d) {
  auto comp = make_compressor(m.name, m.p);
  const int n = c.size();
  TensorState st = comp->make_state(d, 77, members[c.rank()]);
  std::vector<TensorState> ref;
  for (int r = 0; r < n; ++r) ref.push_back(comp->make_state(d, 77, members[r]));
  for (int step = 0; step < 3; ++step) {
    auto mine = gaussian(d, 1000 * step + members[c.rank()]);
    std::vector<float> got = mine;
    size_t sent = compressed_allreduce(c, *comp, st, got);
    std::vector<Bytes> payloads;
    for (int r = 0; r < n; ++r) payloads.push_back(comp->compress(gaussian(d, 1000 * step + members[r]), ref[r]));
    EXPECT_EQ(sent, payloads[c.rank()].size());
    std::vector<float> want(d, 0.0f);
    if (comp->collective() == Collective::majority_vote) {
      Bytes all;
      for (auto& p : payloads) all.insert(all.end(), p.begin(), p.end());
      majority_vote(all, n, want);
      // The vote is the sign of the sum of decoded signs.
      std::vector<float> sum(d, 0.0f), one(d);
      for (int r = 0; r < n; ++r) {
        comp->decompress(payloads[r], ref[r], one);
        for (size_t i = 0; i < d; ++i) sum[i] += one[i];
      }
      for (size_t i = 0; i < d; ++i) ASSERT_EQ(want[i], sum[i] > 0 ? 1.0f : (sum[i] < 0 ? -1.0f : 0.0f));
    } else {
      // (each payload decoded with its sender's state: a method whose positions depended on the rank would not sum)
      for (int r = 0; r < n; ++r) comp->decompress_add(payloads[r], ref[r], want);
    }
    if (comp->linear()) {
      // The payloads' sum is rounded to the payload dtype once per reduction hop (at most n - 1 on any path), each
      // time by at most u times a partial sum, itself at most the sum of the decoded magnitudes; `want` summed in
      // f32 adds its own. (The bound was n/128 x (|want| + 4n) for bf16, ~10x that: a sum that truncated instead of
      // rounding passed it.)
      std::vector<float> mag(d, 0.0f), one(d);
      for (int r = 0; r < n; ++r) {
        comp->decompress(payloads[r], ref[r], one);
        for (size_t i = 0; i < d; ++i) mag[i] += std::fabs(one[i]);
      }
      const double u = unit_roundoff(comp->linear_dtype()) + 1.0 / (1 << 24);
      for (size_t i = 0; i < d; ++i) {
        ASSERT_NEAR(got[i], want[i], (n - 1) * u * mag[i] + 1e-6)
            << m.name << " n=" << n << " step " << step << " i=" << i;
      }
    } else {
      ASSERT_EQ(got, want) << m.name << " n=" << n << " step " << step;
    }
  }
  EXPECT_EQ(st, ref[c.rank()]) << m.name;  // the state advanced exactly as a local run's
}

}  // namespace

class Ranks : public ::testing::TestWithParam<int> {};

TEST_P(Ranks, EveryMethodEqualsDecompressThenReduce) {
  int n = GetParam();
  std::vector<int> members(n);
  for (int r = 0; r < n; ++r) members[r] = r;
  on_ranks(n, [&](coll::Communicator& c) {
    for (const auto& m : kMethods) check_method(c, m, members, 1003);
    check_method(c, kMethods[6], members, 0);  // empty tensors pass through
    check_method(c, kMethods[13], members, 1);
  });
}

// Local simulation of the quantized ring for chunk `ch`: the chain starts at rank ch+1 and ends at rank ch.
std::vector<float> simulate_ring_chunk(const std::vector<std::vector<float>>& data, Chunk ck, int owner,
                                       const Compressor& codec) {
  int n = static_cast<int>(data.size());
  TensorState st;
  int first = (owner + 1) % n;
  std::vector<float> acc(data[first].begin() + ck.offset, data[first].begin() + ck.offset + ck.count);
  for (int j = 2; j <= n; ++j) {
    int r = (owner + j) % n;
    std::vector<float> mine(data[r].begin() + ck.offset, data[r].begin() + ck.offset + ck.count);
    Bytes q = codec.compress(acc, st);
    codec.decompress_add(q, st, mine);
    acc = mine;
  }
  return acc;
}

TEST_P(Ranks, QuantizedRingEqualsItsSimulationBitForBit) {
  int n = GetParam();
  on_ranks(n, [&](coll::Communicator& c) {
    for (std::string codec : {"none", "fp16", "bf16", "int8", "uint8"}) {
      auto cd = make_ring_codec(codec);
      for (size_t d : {size_t(0), size_t(5), size_t(1003), size_t(40000)}) {
        std::vector<std::vector<float>> data;
        for (int r = 0; r < n; ++r) data.push_back(gaussian(d, 7 * r + d));
        // reduce-scatter
        Chunk mine = ring_chunk(d, n, c.rank());
        std::vector<float> out(mine.count);
        quantized_ring_reduce_scatter(c, data[c.rank()], out, codec);
        std::vector<float> want =
            n == 1 ? data[0] : simulate_ring_chunk(data, mine, c.rank(), *cd);
        ASSERT_EQ(out, want) << codec << " d=" << d << " n=" << n;
        // allreduce
        std::vector<float> all = data[c.rank()];
        quantized_ring_allreduce(c, all, codec);
        std::vector<double> exact(d, 0);
        for (int r = 0; r < n; ++r)
          for (size_t i = 0; i < d; ++i) exact[i] += data[r][i];
        for (int k = 0; k < n && n > 1; ++k) {
          Chunk ck = ring_chunk(d, n, k);
          auto acc = simulate_ring_chunk(data, ck, k, *cd);
          TensorState st;
          Bytes q = cd->compress(acc, st);
          std::vector<float> fin(ck.count);
          cd->decompress(q, st, fin);
          for (size_t i = 0; i < ck.count; ++i) ASSERT_EQ(all[ck.offset + i], fin[i]) << codec << " chunk " << k;
        }
        if (n == 1) {
          ASSERT_EQ(all, data[0]);
        }
        // And it is close to the exact sum (the codec's resolution times the hops).
        double tol = codec == "none" ? 1e-5 : codec == "fp16" ? 4e-3 : 0.05;
        for (size_t i = 0; i < d; ++i) ASSERT_NEAR(all[i], exact[i], tol * n * 3) << codec;
      }
    }
    std::vector<float> x(10), wrong(3);
    EXPECT_THROW(quantized_ring_allreduce(c, x, "int4"), ConfigError);
    if (n == 2) {
      EXPECT_THROW(quantized_ring_reduce_scatter(c, x, wrong, "fp16"), InvalidArgument);
    }
  });
}

// PowerSGD over n ranks equals a local simulation of its two allreduces; batched equals per-tensor.
TEST_P(Ranks, PowerSgdEqualsSimulationAndBatchedEqualsPerTensor) {
  int n = GetParam();
  auto comp = make_compressor("powersgd", {{"rank", "2"}, {"start_iter", "1"}});
  const auto& ps = dynamic_cast<const PowerSgd&>(*comp);
  const std::vector<std::vector<size_t>> shapes = {{30, 40}, {17}, {3, 4}, {64, 9}};
  on_ranks(n, [&](coll::Communicator& c) {
    std::vector<TensorState> a, b;
    std::vector<std::vector<TensorState>> ref(shapes.size());
    for (size_t t = 0; t < shapes.size(); ++t) {
      a.push_back(comp->make_state(shapes[t], 5, c.rank()));
      b.push_back(comp->make_state(shapes[t], 5, c.rank()));
      for (int r = 0; r < n; ++r) ref[t].push_back(comp->make_state(shapes[t], 5, r));
    }
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<float>> xa, xb;
      for (size_t t = 0; t < shapes.size(); ++t) {
        size_t d = 1;
        for (auto s : shapes[t]) d *= s;
        xa.push_back(gaussian(d, 100 * step + 10 * t + c.rank()));
      }
      xb = xa;
      // per tensor
      for (size_t t = 0; t < shapes.size(); ++t) compressed_allreduce(c, *comp, a[t], xa[t], {true, 0});
      // batched
      std::vector<TensorState*> sp;
      std::vector<std::span<float>> dp;
      for (size_t t = 0; t < shapes.size(); ++t) sp.push_back(&b[t]), dp.push_back(xb[t]);
      compressed_allreduce_many(c, *comp, sp, dp, {true, 0});
      for (size_t t = 0; t < shapes.size(); ++t) {
        size_t d = xa[t].size();
        // simulation
        std::vector<std::vector<float>> in(n);
        for (int r = 0; r < n; ++r) in[r] = gaussian(d, 100 * step + 10 * t + r);
        std::vector<float> want(d, 0.0f);
        auto plan = ps.plan(d, ref[t][0]);
        if (!plan.compressed) {
          for (int r = 0; r < n; ++r)
            for (size_t i = 0; i < d; ++i) want[i] += in[r][i];
          for (auto& v : want) v /= n;
          for (int r = 0; r < n; ++r) ps.skip(ref[t][r]);
        } else {
          std::vector<float> psum(plan.p_len(), 0.0f), qsum(plan.q_len(), 0.0f), p(plan.p_len()), q(plan.q_len());
          for (int r = 0; r < n; ++r) {
            ps.phase_p(in[r], ref[t][r], p);
            for (size_t i = 0; i < p.size(); ++i) psum[i] += p[i];
          }
          std::vector<float> pr;
          for (int r = 0; r < n; ++r) {
            pr = psum;
            ps.phase_q(in[r], ref[t][r], pr, q);
            for (size_t i = 0; i < q.size(); ++i) qsum[i] += q[i];
          }
          for (int r = 0; r < n; ++r) ps.finish(in[r], ref[t][r], pr, qsum, n, true, want);
        }
        double scale = 0;
        for (float v : want) scale = std::max(scale, double(std::fabs(v)));
        for (size_t i = 0; i < d; ++i) {
          ASSERT_NEAR(xa[t][i], want[i], 1e-4 * (scale + 1)) << "tensor " << t << " step " << step;
          ASSERT_NEAR(xb[t][i], want[i], 1e-4 * (scale + 1)) << "batched tensor " << t << " step " << step;
        }
        EXPECT_EQ(a[t].step, ref[t][c.rank()].step);
      }
    }
  });
}

// The int8 reduce-scatter by all-to-all, simulated: rank r's slices (counts, rank order) of every rank's data, each
// contribution but the owner's (or the summing rank's) rounded to int8 blocks once; over hosts of K consecutive ranks
// (the last host the rest) in two hops: on each host the rank that sums a slice (the owner on its own host; else
// local index owner % the host's count: its local index where the hosts are alike) adds its host's parts, then those
// partial sums, rounded again, go to their owners, which add them in host order.
int host_count(int n, int k, int g) { return std::min(k, n - g * k); }
int summer_of(int n, int k, int g, int owner) { return owner / k == g ? owner % k : owner % host_count(n, k, g); }
std::vector<float> dq(std::span<const float> x, int bits) {
  std::vector<uint8_t> q(block_int_bytes(x.size(), kIntBlock, bits));
  std::vector<float> out(x.size());
  if (!x.empty()) quantize_block_int(x.data(), x.size(), kIntBlock, bits, q.data());
  if (!x.empty()) dequantize_block_int(q.data(), x.size(), kIntBlock, bits, out.data());
  return out;
}

// The lengths of [begin, begin + n) cut at the bounds inside it.
std::vector<size_t> pieces(size_t begin, size_t n, const std::vector<size_t>& bounds) {
  std::vector<size_t> out;
  size_t at = begin;
  for (size_t b : bounds)
    if (b > at && b < begin + n) out.push_back(b - at), at = b;
  out.push_back(begin + n - at);
  return out;
}

// dq piece by piece: x holds the elements from `begin` of the whole input.
std::vector<float> dq_cut(std::span<const float> x, size_t begin, const std::vector<size_t>& bounds, int bits) {
  std::vector<float> out;
  size_t at = 0;
  for (size_t n : pieces(begin, x.size(), bounds)) {
    auto part = dq(x.subspan(at, n), bits);
    out.insert(out.end(), part.begin(), part.end());
    at += n;
  }
  return out;
}

std::vector<float> simulate_int_reduce_scatter(const std::vector<std::vector<float>>& data,
                                               const std::vector<size_t>& counts, int me, int k, bool hier, int bits,
                                               const std::vector<size_t>& bounds = {}) {
  const int n = int(data.size());
  size_t at = 0;
  for (int r = 0; r < me; ++r) at += counts[size_t(r)];
  auto slice = [&](int r) { return std::span<const float>(data[size_t(r)].data() + at, counts[size_t(me)]); };
  std::vector<float> sum(counts[size_t(me)], 0.0f);
  auto add = [](std::vector<float>& s, const std::vector<float>& x) {
    for (size_t i = 0; i < s.size(); ++i) s[i] += x[i];
  };
  if (!hier) {
    for (int r = 0; r < n; ++r) {
      auto x = slice(r);
      add(sum, r == me ? std::vector<float>(x.begin(), x.end()) : dq_cut(x, at, bounds, bits));
    }
    return sum;
  }
  // Host g's partial sum of my slice is summed by its rank summer_of(...): its own part exact.
  const int hosts = (n + k - 1) / k;
  for (int g = 0; g < hosts; ++g) {
    std::vector<float> partial(sum.size(), 0.0f);
    const int j = summer_of(n, k, g, me);
    for (int l = 0; l < host_count(n, k, g); ++l) {
      auto x = slice(g * k + l);
      add(partial, l == j ? std::vector<float>(x.begin(), x.end()) : dq_cut(x, at, bounds, bits));
    }
    add(sum, g == me / k ? partial : dq_cut(partial, at, bounds, bits));
  }
  return sum;
}

// Uneven slices over several blocks (one slice empty, one under a block) and a block of zeros.
std::vector<size_t> uneven_counts(int n) {
  std::vector<size_t> counts;
  for (int r = 0; r < n; ++r) counts.push_back(r == 1 ? 0 : r == 2 ? 100 : 300 + 13 * size_t(r));
  return counts;
}

void check_int_reduce_scatter(int n, int per_host, int bits, const std::vector<size_t>& bounds = {}) {
  const std::vector<size_t> counts = uneven_counts(n);
  size_t d = 0;
  for (size_t c : counts) d += c;
  std::vector<std::vector<float>> data;
  for (int r = 0; r < n; ++r) {
    data.push_back(gaussian(d, 31 * r + 5));
    std::fill(data.back().begin(), data.back().begin() + std::min<size_t>(d, 256), 0.0f);  // (a zero block)
  }
  on_ranks(
      n,
      [&](coll::Communicator& c) {
        const bool hier = n > per_host && per_host > 1;
        auto groups = int_reduce_groups(c);
        ASSERT_EQ(groups.hierarchical(), hier);
        const int me = c.rank();
        std::vector<float> out(counts[size_t(me)]);
        uint64_t received = 0;
        ReduceOptions o;
        o.received = &received;
        const uint64_t sent = int_reduce_scatter(c, groups, data[size_t(me)], counts, out, bits, o, {}, bounds);
        const std::string what =
            fmt::format("{} ranks, {} a host, rank {}, {} bits, {} bounds", n, per_host, me, bits, bounds.size());
        // Bit for bit the simulation: the parts go to the right ranks, each rounded as often as the hops say.
        ASSERT_EQ(out, simulate_int_reduce_scatter(data, counts, me, per_host, hier, bits, bounds)) << what;
        // Close to the exact sum: each part within half its block's scale (the gaussians' largest is under 5, so
        // under 5/254 at 8 bits, 5/14 at 4), a partial sum's under its own, up to K times larger.
        size_t at = 0;
        for (int r = 0; r < me; ++r) at += counts[size_t(r)];
        const double half = bits == 8 ? 5.0 / 254 : 5.0 / 14;
        const double tol = (n - 1) * half + (hier ? (n / per_host) * per_host * half : 0.0) + 1e-4;
        double worst = 0;
        for (size_t i = 0; i < out.size(); ++i) {
          double exact = 0;
          for (int r = 0; r < n; ++r) exact += data[size_t(r)][at + i];
          worst = std::max(worst, std::abs(out[i] - exact));
        }
        EXPECT_LT(worst, tol) << what;
        if (n > 1 && out.size() > 256) {
          EXPECT_GT(worst, 0.0) << what;  // (rounded: not a f32 sum)
        }
        // Bytes: each part in int8 blocks once per hop. Flat: every other rank's slice. Two hops: to each other rank
        // of the host, the slices it sums; across, the partial sums of the slices I sum to their owners, and from
        // every other host my slice's.
        auto b = [&](int r) {
          size_t begin = 0;
          for (int q = 0; q < r; ++q) begin += counts[size_t(q)];
          uint64_t bytes = 0;
          for (size_t len : pieces(begin, counts[size_t(r)], bounds)) bytes += block_int_bytes(len, kIntBlock, bits);
          return bytes;
        };
        uint64_t want_sent = 0, want_recv = 0;
        if (!hier) {
          for (int r = 0; r < n; ++r)
            if (r != me) want_sent += b(r), want_recv += b(me);
        } else {
          const int g0 = me / per_host, j = me % per_host, here = host_count(n, per_host, g0);
          for (int r = 0; r < n; ++r) {
            const int l = summer_of(n, per_host, g0, r);
            if (l != j) want_sent += b(r);
            if (l == j) want_recv += uint64_t(here - 1) * b(r);
            if (l == j && r / per_host != g0) want_sent += b(r);
          }
          want_recv += uint64_t((n + per_host - 1) / per_host - 1) * b(me);
        }
        EXPECT_EQ(sent, want_sent) << what;
        EXPECT_EQ(received, want_recv) << what;
        // Averaged: the sum over the ranks.
        std::vector<float> avg(out.size());
        o.average = true;
        o.received = nullptr;
        int_reduce_scatter(c, groups, data[size_t(me)], counts, avg, bits, o, {}, bounds);
        for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(avg[i], out[i] * (1.0f / float(n))) << what;
      },
      per_host);
}

// Blocks cut at given bounds (tensor parallelism's parameter starts): bit for bit the simulation that rounds each
// piece in blocks of its own, in one hop and two, its bytes the pieces' blocks; and a piece whose elements are
// alike in two runs comes out alike whatever its neighbours hold (a replicated parameter next to a split one: with
// one block over both, each tensor-parallel rank's scale differed, and so did the replicated sums).
TEST(IntReduceScatter, BlocksCutAtBoundsRoundEachPieceOnItsOwn) {
  const std::vector<size_t> bounds = {0, 40, 77, 333, 334, 700, 739};
  for (int bits : {8, 4}) {
    check_int_reduce_scatter(4, 2, bits, bounds);
    check_int_reduce_scatter(5, 1, bits, bounds);
    check_int_reduce_scatter(7, 4, bits, bounds);
  }
  const int n = 4;
  const std::vector<size_t> counts = uneven_counts(n);  // 300, 0, 100, 339: 739 elements
  size_t d = 0;
  for (size_t c : counts) d += c;
  // Elements [40, 77) and [333, 700) alike in both runs; the rest (larger, setting the scales) differ.
  std::vector<std::vector<float>> a, b;
  for (int r = 0; r < n; ++r) {
    a.push_back(gaussian(d, 7 * r + 1));
    b.push_back(gaussian(d, 7 * r + 2));
    for (size_t i = 0; i < d; ++i) {
      const bool alike = (i >= 40 && i < 77) || (i >= 333 && i < 700);
      if (alike)
        b.back()[i] = a.back()[i];
      else
        a.back()[i] *= 8, b.back()[i] *= 8;
    }
  }
  for (int per_host : {1, 2})
    for (bool cut : {true, false}) {
      std::vector<std::vector<float>> out_a(n), out_b(n);
      for (auto* run : {&a, &b})
        on_ranks(
            n,
            [&](coll::Communicator& c) {
              auto groups = int_reduce_groups(c);
              std::vector<float> out(counts[size_t(c.rank())]);
              int_reduce_scatter(c, groups, (*run)[size_t(c.rank())], counts, out, 8, {}, {},
                                 cut ? std::span<const size_t>(bounds) : std::span<const size_t>());
              (run == &a ? out_a : out_b)[size_t(c.rank())] = out;
            },
            per_host);
      size_t differ = 0;
      for (int r = 0, at = 0; r < n; at += int(counts[size_t(r)]), ++r)
        for (size_t i = 0; i < counts[size_t(r)]; ++i) {
          const size_t g = size_t(at) + i;
          if ((g >= 40 && g < 77) || (g >= 333 && g < 700)) differ += out_a[size_t(r)][i] != out_b[size_t(r)][i];
        }
      if (cut)
        EXPECT_EQ(differ, 0u) << per_host << " a host";
      else
        EXPECT_GT(differ, 0u) << per_host << " a host";  // (the test tells: one block over both rounds them apart)
    }
  // Bounds out of order or past the input are refused.
  on_ranks(2, [&](coll::Communicator& c) {
    std::vector<float> in(10, 1.0f), out(5);
    const std::vector<size_t> bad = {6, 3};
    EXPECT_THROW(int_reduce_scatter(c, int_reduce_groups(c), in, {5, 5}, out, 8, {}, {}, bad), InvalidArgument);
  });
}

// 1 to 8 ranks two a host: one host (2), two hops over 2, 3 and 4 hosts, and over hosts of uneven counts (3, 5, 7:
// the last host one rank); int8 and int4 blocks.
TEST_P(Ranks, IntReduceScatterEqualsItsSimulationBitForBit) {
  check_int_reduce_scatter(GetParam(), 2, 8);
  check_int_reduce_scatter(GetParam(), 2, 4);
}

// Other host sizes: three and four ranks a host (two hops), and one a host (one hop: nothing to sum on a host).
TEST(IntReduceScatter, HostsOfThreeAndFourRanksSumOnTheHostFirst) {
  for (int bits : {8, 4}) {
    check_int_reduce_scatter(6, 3, bits);
    check_int_reduce_scatter(8, 4, bits);
    check_int_reduce_scatter(12, 3, bits);
    check_int_reduce_scatter(4, 1, bits);
    // Hosts of different counts: 4 + 3 (each host's rank 0 sums two of the other host's slices), 4 + 4 + 1, 3 + 2.
    check_int_reduce_scatter(7, 4, bits);
    check_int_reduce_scatter(9, 4, bits);
    check_int_reduce_scatter(5, 3, bits);
  }
}

// Host maps the launchers do not make, as a sub-communicator of permuted ranks has them: hosts interleaved, alike
// (0 1 0 1) and not (0 1 0 1 0 0), a host of one rank first (1 0 0 0) and between others (2 0 0 1 1). Each is
// simulated from the map alone: hosts numbered by their first rank, each rank's position host by host, a slice
// summed on a host by its owner there, else by local index position % the host's count; the partial sums added in
// host order where hosts are alike (among one local index's ranks), else in the order of the ranks that send them.
TEST(IntReduceScatter, AnyHostMapSumsEachSliceOnceAHostBitForBit) {
  struct Map {
    int n, per_host;
    std::vector<int> order;  // order[i]: the world rank that is rank i of the sub-communicator
  };
  for (const Map& m :
       {Map{4, 2, {0, 2, 1, 3}}, Map{6, 4, {0, 4, 1, 5, 2, 3}}, Map{4, 3, {3, 0, 1, 2}}, Map{5, 2, {4, 0, 1, 2, 3}}})
    for (int bits : {8, 4}) {
      const int n = m.n;
      std::vector<int> host(static_cast<size_t>(n));  // the sub-communicator's host map
      for (int i = 0; i < n; ++i) host[size_t(i)] = m.order[size_t(i)] / m.per_host;
      std::vector<int> hosts;               // in order of first appearance
      std::vector<std::vector<int>> ranks;  // each host's ranks
      std::vector<int> hi(static_cast<size_t>(n)), li(static_cast<size_t>(n)), pos(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        auto it = std::find(hosts.begin(), hosts.end(), host[size_t(r)]);
        if (it == hosts.end()) hosts.push_back(host[size_t(r)]), ranks.emplace_back(), it = hosts.end() - 1;
        hi[size_t(r)] = int(it - hosts.begin());
        li[size_t(r)] = int(ranks[size_t(hi[size_t(r)])].size());
        ranks[size_t(hi[size_t(r)])].push_back(r);
      }
      int at = 0;
      bool alike = true;
      for (const auto& rs : ranks) {
        alike = alike && rs.size() == ranks[0].size();
        for (int r : rs) pos[size_t(r)] = at++;
      }
      auto summer = [&](int g, int r) {  // the local index of host g that sums r's slice
        return hi[size_t(r)] == g ? li[size_t(r)] : pos[size_t(r)] % int(ranks[size_t(g)].size());
      };
      const std::vector<size_t> counts = uneven_counts(n);
      size_t d = 0;
      for (size_t c : counts) d += c;
      std::vector<std::vector<float>> data;
      for (int r = 0; r < n; ++r) data.push_back(gaussian(d, 17 * r + 3));
      on_ranks(
          n,
          [&](coll::Communicator& world) {
            int key = 0;
            while (m.order[size_t(key)] != world.rank()) ++key;
            auto c = world.split(0, key);
            auto groups = int_reduce_groups(*c);
            ASSERT_TRUE(groups.hierarchical());
            ASSERT_EQ(groups.cross != nullptr, alike);
            const int me = c->rank(), g0 = hi[size_t(me)];
            const std::string what = fmt::format("map {}, rank {}, {} bits", fmt::join(host, " "), me, bits);
            std::vector<float> out(counts[size_t(me)]);
            uint64_t received = 0;
            ReduceOptions o;
            o.received = &received;
            const uint64_t sent = int_reduce_scatter(*c, groups, data[size_t(me)], counts, out, bits, o);
            size_t off = 0;
            for (int r = 0; r < me; ++r) off += counts[size_t(r)];
            // Each host's partial sum of my slice, then their sum in the order the owner adds them.
            std::vector<std::pair<int, std::vector<float>>> partials;  // (order key, partial as it arrives)
            for (int g = 0; g < int(ranks.size()); ++g) {
              const int j = summer(g, me);
              std::vector<float> partial(out.size(), 0.0f);
              for (int l = 0; l < int(ranks[size_t(g)].size()); ++l) {
                const int r = ranks[size_t(g)][size_t(l)];
                std::span<const float> x(data[size_t(r)].data() + off, out.size());
                const std::vector<float> part = l == j ? std::vector<float>(x.begin(), x.end()) : dq(x, bits);
                for (size_t i = 0; i < partial.size(); ++i) partial[i] += part[i];
              }
              partials.push_back({alike ? g : ranks[size_t(g)][size_t(j)], g == g0 ? partial : dq(partial, bits)});
            }
            std::sort(partials.begin(), partials.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
            std::vector<float> want(out.size(), 0.0f);
            for (const auto& [k, p] : partials)
              for (size_t i = 0; i < want.size(); ++i) want[i] += p[i];
            ASSERT_EQ(out, want) << what;
            // Bytes: my parts of the slices the host's other ranks sum, and the partial sums of those I sum for other
            // hosts' owners; in: my slices from the host's others, and my own slice's partial sum from each other host.
            auto b = [&](int r) { return uint64_t(block_int_bytes(counts[size_t(r)], kIntBlock, bits)); };
            uint64_t want_sent = 0, want_recv = uint64_t(ranks.size() - 1) * b(me);
            for (int r = 0; r < n; ++r) {
              const bool mine = summer(g0, r) == li[size_t(me)];
              if (!mine || hi[size_t(r)] != g0) want_sent += b(r);
              if (mine) want_recv += uint64_t(ranks[size_t(g0)].size() - 1) * b(r);
            }
            EXPECT_EQ(sent, want_sent) << what;
            EXPECT_EQ(received, want_recv) << what;
          },
          m.per_host);
    }
}

// A non-finite gradient arrives as NaN in its block (passed on, as a float wire passes it); counts that do not match
// the input are refused with one line.
TEST(IntReduceScatter, NonFiniteBlocksArriveAsNaNAndWrongCountsAreRefused) {
  on_ranks(4, [&](coll::Communicator& c) {
    auto groups = int_reduce_groups(c);
    // (127: every scale exact, 127 / 127 and then 254 / 127, so the finite blocks' sums are exact)
    std::vector<float> in(4 * 300, 127.0f), out(300);
    if (c.rank() == 3) in[5] = std::numeric_limits<float>::infinity();  // rank 0's slice, its first block
    int_reduce_scatter(c, groups, in, {300, 300, 300, 300}, out);
    if (c.rank() == 0) {
      for (size_t i = 0; i < 256; ++i) ASSERT_TRUE(std::isnan(out[i])) << i;
      for (size_t i = 256; i < 300; ++i) ASSERT_EQ(out[i], 508.0f) << i;
    } else {
      for (float v : out) ASSERT_EQ(v, 508.0f);
    }
    try {
      int_reduce_scatter(c, groups, in, {300, 300, 300}, out);
      ADD_FAILURE() << "three counts for four ranks were taken";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("3 counts summing to 900 for an input of 1200"), std::string::npos) << msg;
      EXPECT_NE(msg.find("allowed"), std::string::npos) << msg;
    }
  });
}

// Error feedback: over T calls with the same input, the owners' results add up to T times the exact sums less what
// every rank's residual holds at the end (telescoping: each call's rounding is carried into the next), so the running
// sum stays within a call's rounding of the exact one, where without it each call adds its rounding's bias again.
// One hop (4 ranks, 1 a host) and two (2 a host, and hosts of 3 and 1: the partial sums' errors kept by the ranks that
// sent them across); int8 and int4. The first call, with zero residuals, is the plain call bit for bit.
TEST(IntReduceScatter, ErrorFeedbackKeepsTheRunningSumWithinOneCallsRounding) {
  const int n = 4, calls = 40;
  const std::vector<size_t> counts = uneven_counts(n);
  size_t d = 0;
  for (size_t c : counts) d += c;
  std::vector<std::vector<float>> data;
  for (int r = 0; r < n; ++r) data.push_back(gaussian(d, 7 * r + 3));
  for (int per_host : {1, 2, 3})
    for (int bits : {8, 4}) {
      std::vector<std::vector<float>> residuals(n);
      std::vector<std::vector<double>> runs(n);
      std::vector<double> with(n), without(n);  // each rank's worst error of the running sum, with and without
      on_ranks(
          n,
          [&](coll::Communicator& c) {
            auto groups = int_reduce_groups(c);
            ASSERT_EQ(groups.hierarchical(), per_host > 1);
            const int me = c.rank();
            const std::string what = fmt::format("{} a host, {} bits, rank {}", per_host, bits, me);
            std::vector<float> residual(d, 0.0f), out(counts[size_t(me)]), plain(out.size());
            std::vector<double> run(out.size(), 0.0), run_plain(out.size(), 0.0);
            for (int t = 0; t < calls; ++t) {
              int_reduce_scatter(c, groups, data[size_t(me)], counts, out, bits, {}, residual);
              int_reduce_scatter(c, groups, data[size_t(me)], counts, plain, bits);
              if (t == 0) {
                ASSERT_EQ(out, plain) << what;
              }
              for (size_t i = 0; i < out.size(); ++i) run[i] += out[i], run_plain[i] += plain[i];
            }
            residuals[size_t(me)] = residual;
            runs[size_t(me)] = run;
            size_t at = 0;
            for (int r = 0; r < me; ++r) at += counts[size_t(r)];
            for (size_t i = 0; i < out.size(); ++i) {
              double exact = 0;
              for (int r = 0; r < n; ++r) exact += data[size_t(r)][at + i];
              with[size_t(me)] = std::max(with[size_t(me)], std::abs(run[i] - calls * exact));
              without[size_t(me)] = std::max(without[size_t(me)], std::abs(run_plain[i] - calls * exact));
            }
          },
          per_host);
      // The telescoped sum: the running sum plus every rank's final residual on the owner's slice is T x exact.
      size_t at = 0;
      for (int me = 0; me < n; ++me) {
        const std::string what = fmt::format("{} a host, {} bits, rank {}", per_host, bits, me);
        for (size_t i = 0; i < counts[size_t(me)]; ++i) {
          double exact = 0, held = 0;
          for (int r = 0; r < n; ++r) exact += data[size_t(r)][at + i], held += residuals[size_t(r)][at + i];
          // (to the float sums' rounding over 40 calls)
          ASSERT_NEAR(runs[size_t(me)][i] + held, calls * exact, 2e-3) << what << " element " << i;
          EXPECT_EQ(residuals[size_t(me)][at + i], 0.0f) << what << " (its own slice: nothing of it rounded)";
        }
        at += counts[size_t(me)];
        if (counts[size_t(me)] > 256) {
          EXPECT_GT(without[size_t(me)], 5 * with[size_t(me)]) << what;
          // a call's rounding: every other rank's part within half its block's scale (< 5/254 or 5/14), twice with
          // two hops
          const double half = bits == 8 ? 5.0 / 254 : 5.0 / 14;
          EXPECT_LT(with[size_t(me)], (n - 1) * half * (per_host > 1 ? 2 : 1) + 1e-3) << what;
        }
      }
    }
}

// Error feedback's edges: a residual of another length is refused with one line; averaged, the result is the summed
// one scaled (the residuals the same); a non-finite element's block decodes to NaN on its owner and leaves no
// non-finite error behind (the next call, finite again, comes out finite).
TEST(IntReduceScatter, ErrorFeedbackRefusesAResidualOfAnotherLengthAndCarriesNothingNonFinite) {
  on_ranks(4, [&](coll::Communicator& c) {
    auto groups = int_reduce_groups(c);
    const std::vector<size_t> counts = {300, 300, 300, 300};
    std::vector<float> in = gaussian(1200, 11 + c.rank()), out(300), avg(300);
    std::vector<float> short_residual(1199);
    try {
      int_reduce_scatter(c, groups, in, counts, out, 8, {}, short_residual);
      ADD_FAILURE() << "a residual of 1199 for an input of 1200 was taken";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(
          std::string(e.what()).find("a residual of 1199 elements for an input of 1200; allowed: as many, or none"),
          std::string::npos)
          << e.what();
    }
    std::vector<float> r1(1200, 0.01f), r2 = r1;
    int_reduce_scatter(c, groups, in, counts, out, 4, {}, r1);
    ReduceOptions o;
    o.average = true;
    int_reduce_scatter(c, groups, in, counts, avg, 4, o, r2);
    EXPECT_EQ(r1, r2);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(avg[i], out[i] * 0.25f) << i;
    // Rank 3's part of rank 0's first block not finite: rank 0's block NaN, every residual finite after.
    std::vector<float> bad = in;
    if (c.rank() == 3) bad[7] = std::numeric_limits<float>::infinity();
    int_reduce_scatter(c, groups, bad, counts, out, 4, {}, r1);
    if (c.rank() == 0) {
      EXPECT_TRUE(std::isnan(out[7]));
    }
    for (float e : r1) ASSERT_TRUE(std::isfinite(e));
    int_reduce_scatter(c, groups, in, counts, out, 4, {}, r1);
    for (float v : out) ASSERT_TRUE(std::isfinite(v));
  });
}

// The two hops share the call's deadline: a rank whose first hop ended late fails at its timeout, not a whole timeout
// after that hop. Ranks 0 and 1 (one host) never call; rank 3 joins its host's hop 3 s late, so rank 2's hop across
// (to rank 0) begins 3 s into a 4 s timeout: it fails at 4 s, where each hop's own deadline made it 7.
TEST(IntReduceScatter, ItsTwoHopsShareOneDeadline) {
  std::vector<double> failed_after(4, -1);
  std::vector<std::string> errors(4);
  on_ranks(4, [&](coll::Communicator& c) {
    auto groups = int_reduce_groups(c);
    ASSERT_TRUE(groups.hierarchical());
    const int me = c.rank();
    if (me < 2) return;
    const auto t0 = std::chrono::steady_clock::now();
    if (me == 3) std::this_thread::sleep_for(std::chrono::seconds(3));
    std::vector<float> in(4 * 300, 1.0f), out(300);
    ReduceOptions o;
    o.timeout_s = 4;
    try {
      int_reduce_scatter(c, groups, in, {300, 300, 300, 300}, out, 8, o);
    } catch (const Error& e) {  // (rank 2's timeout; rank 3's, or rank 2's abort reaching it first)
      errors[size_t(me)] = e.what();
    }
    failed_after[size_t(me)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  EXPECT_NE(errors[2].find("did not complete before the deadline"), std::string::npos) << errors[2];
  EXPECT_NE(errors[3], "") << "rank 3 was not stopped";
  EXPECT_GE(failed_after[2], 3.9);
  EXPECT_LT(failed_after[2], 5.5);  // (the hop across alone given 4 s: 7)
}

INSTANTIATE_TEST_SUITE_P(OneToEight, Ranks, ::testing::Range(1, 9));

// Two groups of four from one world of eight run at the same time on their sub-communicators.
TEST(SubCommunicators, MethodsRingAndPowerSgdOnSplitGroups) {
  on_ranks(8, [&](coll::Communicator& world) {
    int color = world.rank() % 2;
    auto sub = world.split(color, world.rank());
    ASSERT_TRUE(sub);
    ASSERT_EQ(sub->size(), 4);
    std::vector<int> members;
    for (int r = 0; r < 8; ++r)
      if (r % 2 == color) members.push_back(r);
    for (const auto& m : kMethods)
      if (m.name == "topk" || m.name == "fp16" || m.name == "signum" || m.name == "randk" || m.name == "qsgd")
        check_method(*sub, m, members, 777);
    std::vector<float> x = gaussian(1000, 3 + world.rank()), y = x;
    quantized_ring_allreduce(*sub, x, "int8");
    std::vector<double> exact(1000, 0);
    for (int r : members) {
      auto g = gaussian(1000, 3 + r);
      for (size_t i = 0; i < 1000; ++i) exact[i] += g[i];
    }
    for (size_t i = 0; i < 1000; ++i) ASSERT_NEAR(x[i], exact[i], 0.1);
    auto comp = make_compressor("powersgd", {{"rank", "8"}});
    auto st = comp->make_state({40, 50}, 1, sub->rank());
    std::vector<float> mtx(2000);
    for (size_t i = 0; i < 2000; ++i) mtx[i] = float(i % 7) * (1 + color);  // same on every member
    auto want = mtx;
    compressed_allreduce(*sub, *comp, st, mtx, {true, 0});
    for (size_t i = 0; i < 2000; ++i) ASSERT_NEAR(mtx[i], want[i], 1e-3);  // rank 7 <= 8: exact
  });
}

namespace {
// A variable-size method whose rank 1 announces more than any encoder writes (8 bytes an element + 64).
class Bloated : public Compressor {
 public:
  std::string name() const override { return "bloated"; }
  Collective collective() const override { return Collective::allgather; }
  bool fixed_size() const override { return false; }
  size_t wire_bytes(size_t, const TensorState&) const override { return 0; }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    out.assign(st.stream == 1 ? 8 * in.size() + 65 : 8, 0);
  }
  void decompress(std::span<const uint8_t>, const TensorState&, std::span<float> out) const override {
    std::fill(out.begin(), out.end(), 0.0f);
  }
};
}  // namespace

// A payload size a peer announces is bounded before anything is allocated for it (it was taken as announced: a
// corrupt size was a bad_alloc, or wrapped the total); every rank fails at once naming the rank and the size.
TEST(PeerInput, AnnouncedPayloadSizesAreBounded) {
  Bloated c;
  std::vector<std::string> errors(2);
  conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
    auto st = c.make_state({100}, 1, comm.rank());
    std::vector<float> x(100, 0.5f);
    try {
      compressed_allreduce(comm, c, st, x);
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(errors[r].find("rank 1 announced a payload of 865 bytes for 100 elements (at most 864)"),
              std::string::npos)
        << r << ": " << errors[r];
}

// Payloads of different sizes (threshold keeps what exceeds it: rank r's data has 10 + 40r such elements) on 3 ranks:
// the bytes reported sent are what left each rank (the ring forwards all but its successor's payload; (W-1) x its
// own was reported), received the others' payloads; both besides the 8-byte sizes each rank sends twice.
TEST(PeerInput, VaryingPayloadsReportTheBytesEachRankSentAndReceived) {
  const int n = 3;
  const size_t d = 1000;
  auto inner = net::make_inproc_world(n, 2);
  std::vector<std::shared_ptr<test_util::CountingTransport>> ts;
  for (auto& t : inner) ts.push_back(std::make_shared<test_util::CountingTransport>(t));
  auto comp = make_compressor("threshold", {{"threshold", "1.5"}});
  std::vector<uint64_t> wire(n), sent(n), received(n), own(n);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        coll::CommConfig cfg;
        cfg.timeout_s = 30;
        cfg.measure_cost_model = false;
        auto c = coll::Communicator::create(ts[size_t(r)], {0, 1, 2}, 0, cfg);
        TensorState st = comp->make_state(d, 7, r);
        std::vector<float> x(d, 0.0f);
        for (int i = 0; i < 10 + 40 * r; ++i) x[size_t(i)] = 2.0f + float(i);
        ReduceOptions o;
        o.sent = &sent[size_t(r)];
        o.received = &received[size_t(r)];
        ts[size_t(r)]->take();
        own[size_t(r)] = compressed_allreduce(*c, *comp, st, x, o);
        for (auto b : ts[size_t(r)]->take()) wire[size_t(r)] += b;
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  const uint64_t total = own[0] + own[1] + own[2];
  ASSERT_LT(own[0], own[1]);
  ASSERT_LT(own[1], own[2]);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[size_t(r)], "") << r;
    EXPECT_EQ(sent[size_t(r)] + 2 * 8, wire[size_t(r)]) << "rank " << r;
    EXPECT_EQ(sent[size_t(r)], total - own[size_t((r + 1) % n)]) << "rank " << r;
    EXPECT_EQ(received[size_t(r)], total - own[size_t(r)]) << "rank " << r;
  }
}

// The quantized ring with int8/uint8 refuses a nan or inf as the compressed exchanges do (int8 decoded a NaN as
// -128 x scale, finite and wrong; an inf made the scale inf and only the next rank failed while the others waited
// for their deadline); a payload a rank refuses aborts the ring on every rank.
TEST(NonFinite, QuantizedRingRefusesWhatItsByteCodecsCannotCarry) {
  for (const std::string codec : {"int8", "uint8"}) {
    for (bool reduce_scatter : {false, true}) {
      std::vector<std::string> errors(3);
      const auto t0 = std::chrono::steady_clock::now();
      conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
        std::vector<float> x(999, 0.25f), out(333);
        if (comm.rank() == 2) x[500] = std::numeric_limits<float>::quiet_NaN();
        try {
          if (reduce_scatter)
            quantized_ring_reduce_scatter(comm, x, out, codec);
          else
            quantized_ring_allreduce(comm, x, codec);
        } catch (const Error& e) {
          errors[comm.rank()] = e.what();
        }
      });
      EXPECT_NE(errors[2].find("element 500 of 999 is nan"), std::string::npos) << codec << ": " << errors[2];
      for (int r : {0, 1})
        EXPECT_NE(errors[r].find("rank 2: quantized ring: element 500"), std::string::npos)
            << codec << r << ": " << errors[r];
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10) << codec;
    }
  }
  // fp16's partial sums are encoded at every hop: averaged, each rank's value is divided first, so a mean within
  // its range is carried where a partial sum (80,000) is not; summed, every rank stops with one line (it came out
  // inf without a word), in both the allreduce and the reduce-scatter.
  for (bool average : {true, false})
    for (bool reduce_scatter : {false, true}) {
      std::vector<std::string> errors(3);
      std::vector<std::vector<float>> outs(3);
      conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
        std::vector<float> x(66, 40000.0f), out(22);
        ReduceOptions o;
        o.average = average;
        try {
          if (reduce_scatter)
            quantized_ring_reduce_scatter(comm, x, out, "fp16", o);
          else
            quantized_ring_allreduce(comm, x, "fp16", o);
        } catch (const InvalidArgument& e) {
          errors[comm.rank()] = e.what();
        }
        outs[comm.rank()] = reduce_scatter ? out : x;
      });
      for (int r = 0; r < 3; ++r) {
        if (average) {
          EXPECT_EQ(errors[r], "") << r << " " << reduce_scatter;
          for (float v : outs[r]) ASSERT_NEAR(v, 40000.0f, 40.0f) << r << " " << reduce_scatter;
        } else {
          EXPECT_NE(errors[r].find("came out inf from finite values on all 3 ranks"), std::string::npos)
              << r << " " << reduce_scatter << ": " << errors[r];
        }
      }
    }
  // fp16 carries a NaN through, as an uncompressed allreduce does.
  conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
    std::vector<float> x(64, 1.0f);
    if (comm.rank() == 1) x[3] = std::numeric_limits<float>::quiet_NaN();
    quantized_ring_allreduce(comm, x, "fp16");
    EXPECT_TRUE(std::isnan(x[3]));
    EXPECT_EQ(x[4], 2.0f);
  });
}

// int8 and uint8 cannot encode a partial sum of finite inputs past f32's range (3e38 + 3e38): its chunk's scale came
// out inf, the owner's own decode threw on that rank alone, and the others waited out their deadline (300 s by
// default); with 3 ranks the next rank refused the payload as a ProtocolError blaming its sender. Now the rank whose
// add overflowed aborts the ring, and every rank stops at once with one line. Averaged, each rank's part is divided
// before the ring, so a mean within range is carried. (A deadline of 5 s, which the waiting rank took before.)
TEST(NonFinite, QuantizedRingStopsEveryRankWhenAPartialSumOverflows) {
  for (const std::string codec : {"int8", "uint8"})
    for (auto [n, one] : {std::pair{2, false}, std::pair{2, true}, std::pair{3, true}})
      for (bool reduce_scatter : {false, true}) {
        std::vector<std::string> errors(size_t(n), "(none)");
        const auto t0 = std::chrono::steady_clock::now();
        conduit::compress::testing::on_ranks(n, [&](coll::Communicator& comm) {
          // Two ranks: every element overflows, or only element 0 (chunk 0, rank 0's: its own decode threw, and
          // rank 1 waited for the chunk until its deadline; a reduce-scatter returned inf without a word). Three:
          // only element 500 (chunk 1, whose first add is rank 0's), so ranks 1 and 2 learn it from the abort.
          std::vector<float> x(n == 2 ? 64 : 999, one ? 0.25f : 3e38f);
          x[n == 3 ? 500 : 0] = 3e38f;
          std::vector<float> out(ring_chunk(x.size(), n, comm.rank()).count);
          ReduceOptions o;
          o.timeout_s = 5;
          try {
            if (reduce_scatter)
              quantized_ring_reduce_scatter(comm, x, out, codec, o);
            else
              quantized_ring_allreduce(comm, x, codec, o);
          } catch (const Error& e) {
            errors[size_t(comm.rank())] = e.what();
            return;
          }
          // A reduce-scatter rank whose own block was done and finite before the abort reached it returns it (two
          // ranks, rank 1 there); its next operation fails with the line at once.
          EXPECT_TRUE(reduce_scatter) << "rank " << comm.rank();
          for (float v : out) ASSERT_TRUE(std::isfinite(v)) << "rank " << comm.rank();
          coll::CollOptions co;
          co.timeout_s = 5;
          try {
            comm.barrier(co).wait();
          } catch (const Error& e) {
            errors[size_t(comm.rank())] = e.what();
          }
        });
        const std::string what = codec + " ring: a partial sum overflowed f32 from finite inputs";
        for (int r = 0; r < n; ++r)
          EXPECT_NE(errors[size_t(r)].find(what), std::string::npos)
              << codec << " n=" << n << " one=" << one << " rs=" << reduce_scatter << " rank " << r << ": "
              << errors[size_t(r)];
        if (one) {
          EXPECT_NE(errors[0].find(n == 2 ? "element 0 of 64 came out inf on rank 0"
                                          : "element 500 of 999 came out inf on rank 0"),
                    std::string::npos)
              << errors[0];
        }
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 2.5)
            << codec << " n=" << n << " one=" << one << " rs=" << reduce_scatter;
      }
  // Averaged: the mean, 3e38, fits.
  for (const std::string codec : {"int8", "uint8"})
    for (int n : {2, 3})
      conduit::compress::testing::on_ranks(n, [&](coll::Communicator& comm) {
        std::vector<float> x(300, 3e38f);
        x[7] = -1e38f;
        ReduceOptions o;
        o.average = true;
        o.timeout_s = 5;
        quantized_ring_allreduce(comm, x, codec, o);
        for (size_t i = 0; i < x.size(); ++i)
          ASSERT_NEAR(x[i], i == 7 ? -1e38 : 3e38, 0.02 * 3e38) << codec << " n=" << n << " i=" << i;
      });
}

// ReduceOptions.timeout_s: a negative or nan value quietly became the default (the quantized ring's and the int8
// reduce-scatter's deadline), as the communicator refuses its own; and it is one deadline for the whole call, each
// inner collective given what is left (each had the whole timeout: PowerSGD's up to four allreduces, or the tensors
// of compressed_allreduce_many, could take that many times it).
TEST(Timeouts, ReduceOptionsTimeoutIsCheckedAndOneDeadlineForTheCall) {
  for (double bad : {-1.0, std::numeric_limits<double>::quiet_NaN(), 1e-9}) {
    conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
      ReduceOptions o;
      o.timeout_s = bad;
      std::vector<float> x(64, 1.0f), out(32);
      auto c = make_compressor("int8");
      auto st = c->make_state({64}, 1, comm.rank());
      std::vector<TensorState*> sts{&st};
      std::vector<std::span<float>> data{x};
      const auto groups = int_reduce_groups(comm);
      const std::vector<std::function<void()>> calls = {[&] { compressed_allreduce(comm, *c, st, x, o); },
                                                        [&] { compressed_allreduce_many(comm, *c, sts, data, o); },
                                                        [&] { quantized_ring_allreduce(comm, x, "int8", o); },
                                                        [&] { quantized_ring_reduce_scatter(comm, x, out, "int8", o); },
                                                        [&] {
                                                          int_reduce_scatter(comm, groups, x, {32, 32}, out, 8, o);
                                                        }};
      for (size_t k = 0; k < calls.size(); ++k) {
        try {
          calls[k]();
          ADD_FAILURE() << "call " << k << " took timeout_s = " << bad;
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("ReduceOptions.timeout_s = "), std::string::npos) << k << e.what();
          EXPECT_NE(std::string(e.what()).find("allowed: 0 (the default timeout) or a number of seconds from 0.001"),
                    std::string::npos)
              << k << e.what();
        }
      }
    });
  }
  // Three tensors, whose allgathers rank 1 joins 0.7 s apart (one call each): rank 0's one call of 1.5 s runs out
  // in the third (each allgather had 1.5 s of its own, and the call took 2.1 s).
  auto c = make_compressor("int8");
  std::vector<std::string> errors(2);
  conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
    std::vector<std::vector<float>> xs(3, std::vector<float>(64, 1.0f));
    std::vector<TensorState> sts(3, c->make_state({64}, 1, comm.rank()));
    ReduceOptions o;
    try {
      if (comm.rank() == 0) {
        o.timeout_s = 1.5;
        std::vector<TensorState*> ps;
        std::vector<std::span<float>> data;
        for (size_t t = 0; t < 3; ++t) ps.push_back(&sts[t]), data.emplace_back(xs[t]);
        compressed_allreduce_many(comm, *c, ps, data, o);
      } else {
        o.timeout_s = 3;
        for (size_t t = 0; t < 3; ++t) {
          std::this_thread::sleep_for(std::chrono::milliseconds(700));
          compressed_allreduce(comm, *c, sts[t], xs[t], o);
        }
      }
    } catch (const TimeoutError& e) {
      errors[size_t(comm.rank())] = std::string("timeout: ") + e.what();
    } catch (const Error& e) {
      errors[size_t(comm.rank())] = e.what();
    }
  });
  EXPECT_EQ(errors[0].rfind("timeout: ", 0), 0u) << errors[0];
}

// A nan or an inf in a compressed exchange's input is an error naming the element and the compressor: most methods
// cannot carry it and returned a finite, silently wrong result (TernGrad turned one inf into an all-zero tensor,
// top-k rarely selected a nan, int8 decoded it as a finite value). The casts pass them on, as an uncompressed
// exchange does.
TEST(NonFinite, CompressedExchangesRefuseWhatTheyCannotCarry) {
  const float kInf = std::numeric_limits<float>::infinity(), kNan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {kNan, kInf, -kInf}) {
    for (const std::string& name : compressor_names()) {
      auto c = make_compressor(name);
      std::string error = "no error";
      std::vector<float> out;
      conduit::compress::testing::on_ranks(1, [&](coll::Communicator& comm) {
        auto st = c->make_state({64, 64}, 1, 0);
        std::vector<float> x(64 * 64, 0.5f);
        x[1234] = bad;
        try {
          compressed_allreduce(comm, *c, st, x);
        } catch (const InvalidArgument& e) {
          error = e.what();
        }
        out = x;
      });
      if (name == "none" || name == "fp16" || name == "bf16") {
        EXPECT_EQ(error, "no error") << name;
        EXPECT_FALSE(std::isfinite(out[1234])) << name;
      } else {
        EXPECT_NE(error.find("element 1234 of 4096 is"), std::string::npos) << name << ": " << error;
        EXPECT_NE(error.find("compressor '" + name + "' cannot carry it"), std::string::npos) << name << ": " << error;
      }
    }
  }
  // Only one rank's gradient is bad: it aborts the transport, so the other rank, already in the exchange, fails at
  // once with the reason instead of waiting for its deadline.
  auto c = make_compressor("topk", {{"ratio", "0.1"}});
  std::vector<std::string> errors(2);
  const auto t0 = std::chrono::steady_clock::now();
  conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
    auto st = c->make_state({4096}, 1, comm.rank());
    std::vector<float> x(4096, 0.5f);
    if (comm.rank() == 1) x[7] = kNan;
    try {
      compressed_allreduce(comm, *c, st, x);
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
    }
  });
  EXPECT_NE(errors[1].find("element 7 of 4096 is nan"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("rank 1: compressed allreduce: element 7"), std::string::npos) << errors[0];
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10);
}

// fp16's range ends at 65504: a sum of finite values beyond it (or one rank's value) came out inf without a word,
// where f32 carried it. Every rank now stops with the same line; an inf or nan a rank put in still passes through,
// as in an uncompressed allreduce, and bf16 (f32's exponent range) carries the sum.
TEST(NonFinite, Fp16RefusesASumBeyondItsRangeButPassesNonFiniteInputsOn) {
  auto run = [](const std::string& name, float rank1, float others, bool average = false) {
    auto c = make_compressor(name);
    std::vector<std::string> errors(3);
    std::vector<std::vector<float>> out(3);
    conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
      auto st = c->make_state({256}, 1, comm.rank());
      std::vector<float> x(256, 1.0f);
      x[100] = comm.rank() == 1 ? rank1 : others;
      ReduceOptions o;
      o.average = average;
      try {
        compressed_allreduce(comm, *c, st, x, o);
      } catch (const InvalidArgument& e) {
        errors[comm.rank()] = e.what();
      }
      out[comm.rank()] = x;
    });
    return std::make_pair(errors, out);
  };
  for (float rank1 : {30000.0f, 70000.0f}) {  // the sum 90,000 / one rank's 70,000 beyond 65504
    auto [errors, out] = run("fp16", rank1, 30000.0f);
    for (int r = 0; r < 3; ++r)
      EXPECT_NE(errors[r].find("fp16: element 100 of 256 came out inf from finite values on all 3 ranks: beyond "
                               "f16's largest, 65504"),
                std::string::npos)
          << rank1 << " rank " << r << ": " << errors[r];
  }
  // Averaged (as the trainer averages), each rank's part is divided first: a mean within range is carried.
  auto [averaged, mean] = run("fp16", 30000.0f, 30000.0f, true);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(averaged[r], "") << r;
    EXPECT_NEAR(mean[r][100], 30000.0f, 32.0f) << r;
  }
  auto [beyond, unused] = run("fp16", 70000.0f, 30000.0f, true);  // one rank's own value beyond the range
  for (int r = 0; r < 3; ++r) EXPECT_NE(beyond[r].find("came out inf from finite values"), std::string::npos) << r;
  auto [fine, sum] = run("fp16", 2000.0f, 1000.0f);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(fine[r], "") << r;
    EXPECT_EQ(sum[r][100], 4000.0f) << r;
  }
  auto [passed, inf] = run("fp16", std::numeric_limits<float>::infinity(), 30000.0f);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(passed[r], "") << r;
    EXPECT_TRUE(std::isinf(inf[r][100])) << r;
  }
  auto [wide, bf] = run("bf16", 30000.0f, 30000.0f);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(wide[r], "") << r;
    EXPECT_NEAR(bf[r][100], 90000.0f, 1000.0f) << r;
  }
}

// bf16 keeps f32's exponent range but not its top: its largest is 0x7F7F, about 3.3895e38, and round to nearest even
// sends f32 values from 0x7F7F8000 (about 3.3962e38) to inf. Such a value, or a sum past it, went on as inf without a
// word (while the fp16 refusal's line suggested bf16 as keeping f32's range); it now stops every rank as fp16's
// overflow does, in compressed_allreduce and the quantized ring. PowerSGD's wire=bf16 refuses it too, and suggests
// wire=f32, not bf16.
TEST(NonFinite, Bf16RefusesWhatRoundsPastItsLargest) {
  uint16_t h;
  const float top = std::bit_cast<float>(0x7F7F8000u), below = std::nextafter(top, 0.0f);
  convert_f32_to_bf16(&top, &h, 1);
  ASSERT_EQ(h, 0x7F80) << top << " rounds to bf16's inf";
  convert_f32_to_bf16(&below, &h, 1);
  ASSERT_EQ(h, 0x7F7F) << below << " rounds to bf16's largest";
  const std::string line = "came out inf from finite values on all 3 ranks: beyond bf16's largest, about 3.39e38";
  auto run = [&](float rank1, float others) {
    auto c = make_compressor("bf16");
    std::vector<std::string> errors(3);
    std::vector<float> got;
    conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
      auto st = c->make_state({256}, 1, comm.rank());
      std::vector<float> x(256, 0.0f);
      x[100] = comm.rank() == 1 ? rank1 : others;
      try {
        compressed_allreduce(comm, *c, st, x);
      } catch (const InvalidArgument& e) {
        errors[size_t(comm.rank())] = e.what();
      }
      if (comm.rank() == 0) got = x;
    });
    return std::make_pair(errors, got);
  };
  for (auto [rank1, others] : {std::pair{top, 0.0f}, std::pair{2e38f, 1e38f}}) {  // one rank's value; a sum
    auto [errors, unused] = run(rank1, others);
    for (int r = 0; r < 3; ++r)
      EXPECT_NE(errors[size_t(r)].find("bf16: element 100 of 256 " + line), std::string::npos)
          << rank1 << " rank " << r << ": " << errors[size_t(r)];
  }
  auto [fine, sum] = run(below, 0.0f);  // bf16's largest, and below: carried
  for (int r = 0; r < 3; ++r) EXPECT_EQ(fine[size_t(r)], "") << r;
  EXPECT_NEAR(sum[100], 3.3895e38, 1e35);
  // The quantized ring with bf16: a partial sum past bf16's largest, in the allreduce and the reduce-scatter.
  for (bool reduce_scatter : {false, true}) {
    std::vector<std::string> errors(3);
    conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
      std::vector<float> x(66, 2e38f), out(22);
      try {
        if (reduce_scatter)
          quantized_ring_reduce_scatter(comm, x, out, "bf16");
        else
          quantized_ring_allreduce(comm, x, "bf16");
      } catch (const InvalidArgument& e) {
        errors[size_t(comm.rank())] = e.what();
      }
    });
    for (int r = 0; r < 3; ++r)
      EXPECT_NE(errors[size_t(r)].find(line), std::string::npos)
          << reduce_scatter << " " << r << ": " << errors[size_t(r)];
  }
  // PowerSGD over a bf16 wire: an uncompressed tensor's value that rounds to inf.
  auto ps = make_compressor("powersgd", {{"wire", "bf16"}});
  std::vector<std::string> errors(3);
  conduit::compress::testing::on_ranks(3, [&](coll::Communicator& comm) {
    auto st = ps->make_state({64}, 1, comm.rank());
    std::vector<float> x(64, 1.0f);
    if (comm.rank() == 2) x[5] = top;
    try {
      compressed_allreduce(comm, *ps, st, x);
    } catch (const InvalidArgument& e) {
      errors[size_t(comm.rank())] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[size_t(r)].find("element 5 of the summed P factors and uncompressed tensors is inf (bf16 wire)"),
              std::string::npos)
        << r << ": " << errors[size_t(r)];
    EXPECT_NE(errors[size_t(r)].find("wire=f32 (bf16 tops out at about 3.39e38)"), std::string::npos) << r;
  }
}

// Finite gradients that pass the input check can still fail one rank's compressor: error feedback whose residual
// plus the gradient passes the floats. That rank aborts the transport with its line, so the other, already in the
// exchange, stops with it (it waited until its deadline: 60 s here).
TEST(NonFinite, ACompressorThatRefusesOnOneRankStopsTheOthers) {
  for (const char* name : {"efsignsgd", "onebit"}) {
    auto c = make_compressor(name);
    std::vector<std::string> errors(2);
    const auto t0 = std::chrono::steady_clock::now();
    conduit::compress::testing::on_ranks(2, [&](coll::Communicator& comm) {
      auto st = c->make_state({4}, 1, comm.rank());
      std::vector<float> first{1.0f, 1.0f, 1.0f, 1.0f}, over{1.0f, 1.0f, 1.0f, 1.0f};
      if (comm.rank() == 1) {  // a residual of about 2.25e38, then 3e38 more
        first = {3e38f, 1.0f, 1.0f, 1.0f};
        over = {3e38f, 0.0f, 0.0f, 0.0f};
      }
      try {
        compressed_allreduce(comm, *c, st, first);
        compressed_allreduce(comm, *c, st, over);
      } catch (const Error& e) {
        errors[comm.rank()] = e.what();
      }
    });
    EXPECT_NE(errors[1].find("element 0 of 4"), std::string::npos) << name << ": " << errors[1];
    EXPECT_NE(errors[0].find("rank 1: "), std::string::npos) << name << ": " << errors[0];
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10) << name;
  }
}
