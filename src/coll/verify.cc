#include "coll/verify.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "core/error.h"

namespace conduit::coll {
namespace {

double get(const std::vector<char>& b, size_t i, DType t) {
  const char* p = b.data() + i * dtype_size(t);
  switch (t) {
    case DType::f32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::f64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::f16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_f32(v); }
    case DType::bf16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_f32(v); }
    case DType::i8: return static_cast<int8_t>(*p);
    case DType::u8: return static_cast<uint8_t>(*p);
    case DType::i32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::i64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
  }
  return 0;
}

void put(std::vector<char>& b, size_t i, DType t, double x) {
  char* p = b.data() + i * dtype_size(t);
  switch (t) {
    case DType::f32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); break; }
    case DType::f64: std::memcpy(p, &x, 8); break;
    case DType::f16: { uint16_t v = f32_to_f16(static_cast<float>(x)); std::memcpy(p, &v, 2); break; }
    case DType::bf16: { uint16_t v = f32_to_bf16(static_cast<float>(x)); std::memcpy(p, &v, 2); break; }
    case DType::i8: *p = static_cast<char>(static_cast<int8_t>(x)); break;
    case DType::u8: *p = static_cast<char>(static_cast<uint8_t>(x)); break;
    case DType::i32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); break; }
    case DType::i64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p, &v, 8); break; }
  }
}

// The barrier case's tag for the tokens the late rank waits for (sendrecv uses 1 and 2).
constexpr uint32_t kBarrierTokenTag = 3;

bool is_unsigned(DType t) { return t == DType::u8; }

// A hash of (rank, element): the values have no short period in either (a pattern (7r + 3i) mod 11 repeated every 11
// elements and every 11 ranks, so a block moved to the wrong place, or two ranks' blocks swapped, could still check
// out: with 11 ranks every expected max was 5).
uint64_t mix(int rank, size_t i) {
  uint64_t x = (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(i) ^ 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Small integers, so that every sum, min, max and product stays exact in every dtype: rank r holds
// a(r+1, i) - a(r, i) for a hashed a in [0, 5] (plus 5 for unsigned types), so a sum over ranks telescopes to at most
// 5 in magnitude (5p + 5 unsigned, which u8 holds up to 50 ranks: past them its sums wrap, as unsigned arithmetic
// does, and reduced() expects them so), as the cyclic pattern's did, while the values themselves have no period.
// Except f16's average: large values of one sign, whose sum overflows f16 (65504 at most) from two ranks on while
// their average does not, so an average that sums before it divides shows inf (multiples of 2048 in [32768, 47104],
// exact in f16).
double value(int rank, size_t i, DType t, ReduceOp op) {
  if (op == ReduceOp::avg && t == DType::f16) return 32768.0 + 2048.0 * static_cast<double>((mix(rank, i) >> 8) % 8);
  if (op == ReduceOp::prod) {
    const uint64_t h = mix(rank, i);
    bool two = rank < 3 && (h & 1) == 0;
    bool neg = !is_unsigned(t) && (h >> 1) % 5 == 0;
    return (two ? 2.0 : 1.0) * (neg ? -1.0 : 1.0);
  }
  auto a = [&](int r) { return static_cast<double>((mix(r, i) >> 8) % 6); };
  const double v = a(rank + 1) - a(rank);
  return is_unsigned(t) ? v + 5 : v;
}

double combine(double a, double b, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return a + b;
    case ReduceOp::prod: return a * b;
    case ReduceOp::min: return std::min(a, b);
    case ReduceOp::max: return std::max(a, b);
  }
  return a;
}

double reduced(int p, size_t i, DType t, ReduceOp op) {
  double acc = value(0, i, t, op);
  for (int r = 1; r < p; ++r) acc = combine(acc, value(r, i, t, op), op);
  // (u8 sums of more than 50 ranks wrapped, and bench coll counted every element of a correct result wrong)
  if ((op == ReduceOp::sum || op == ReduceOp::avg) && is_unsigned(t))
    acc = std::fmod(acc, std::ldexp(1.0, 8 * static_cast<int>(dtype_size(t))));
  if (op == ReduceOp::avg) {
    if (is_floating(t)) acc /= p;
    else acc = std::trunc(acc / p);
  }
  return acc;
}

// How far a reduction of element i may be from the exact result. Only floating averages round: the inputs are
// integers whose every partial sum is exact in the dtype, except where avg divides each input first (f16). Then
// each of the p divisions and p - 1 additions rounds by at most the unit roundoff u times the mean magnitude S of the
// inputs, and the final division by u |want|: p u S + u |want|, with half again for the rounding of those
// bounds (it was 1e-2 relative for f16 and bf16, 20 and 2.5 times their u).
double tolerance(int p, size_t i, DType t, ReduceOp op, double want) {
  if (op != ReduceOp::avg || !is_floating(t)) return 0;
  const double u = t == DType::f16 ? 0x1p-11 : t == DType::bf16 ? 0x1p-8 : t == DType::f32 ? 0x1p-24 : 0x1p-53;
  double s = 0;
  for (int r = 0; r < p; ++r) s += std::fabs(value(r, i, t, op));
  return 1.5 * u * (s + std::fabs(want));
}

std::vector<char> make(size_t n, DType t) { return std::vector<char>(std::max<size_t>(n, 1) * dtype_size(t)); }

// A value no result of the pattern takes, for output buffers to start as: an element no algorithm wrote is then
// counted wrong (zeros passed wherever the expected value was 0, often at counts of 1 to 3). Inputs and their sums
// lie in [-5, 10], products in [-8, 8] and f16 averages in [32768, 47104], but unsigned sums of p ranks near 5p
// (wrapped): 99 (as broadcast's), or 77 where that window holds it (19 or 20 ranks). Exact in every dtype.
double unwritten(int p, DType t) {
  if (!is_unsigned(t)) return 99;
  const double wrap = std::ldexp(1.0, 8 * static_cast<int>(dtype_size(t)));
  const double d = std::fmod(std::fabs(5.0 * p - 99), wrap);  // (distance from 5p to 99 around the wrap)
  return std::min(d, wrap - d) <= 5 ? 77 : 99;
}

// An output buffer of n elements, each unwritten(p, t).
std::vector<char> make_out(size_t n, DType t, int p) {
  auto b = make(n, t);
  for (size_t i = 0; i < n; ++i) put(b, i, t, unwritten(p, t));
  return b;
}

// A rank's count in the v-variants: uneven, some zero.
size_t vcount(int r, size_t base) { return r % 3 == 1 ? 0 : base + static_cast<size_t>(r); }

}  // namespace

const char* verify_ops_allowed() {
  return "allreduce, reduce_scatter, reduce_scatterv, allgather, allgatherv, broadcast, reduce, gather, scatter, "
         "alltoall, alltoallv, barrier, sendrecv";
}

size_t run_and_verify(Communicator& c, const VerifyCase& vc) {
  const int p = c.size(), r = c.rank();
  if (vc.in_place && vc.op != "reduce")
    throw ConfigError(fmt::format("verify: in place applies to reduce, not to '{}'", vc.op));
  const DType t = vc.dtype;
  const size_t n = vc.count;
  CollOptions o;
  o.algorithm = vc.algorithm;
  o.timeout_s = vc.timeout_s;
  o.blocking = vc.blocking;
  size_t wrong = 0;
  auto expect = [&](const std::vector<char>& b, size_t at, double want) {
    if (get(b, at, t) != want) ++wrong;
  };
  // Element `at` of b against the reduction of everyone's element i.
  auto expect_reduced = [&](const std::vector<char>& b, size_t at, size_t i) {
    const double want = reduced(p, i, t, vc.reduce);
    if (!(std::fabs(get(b, at, t) - want) <= tolerance(p, i, t, vc.reduce, want))) ++wrong;
  };
  if (vc.op == "allreduce") {
    auto b = make(n, t);
    for (size_t i = 0; i < n; ++i) put(b, i, t, value(r, i, t, vc.reduce));
    c.allreduce(b.data(), n, t, vc.reduce, o).wait();
    for (size_t i = 0; i < n; ++i) expect_reduced(b, i, i);
  } else if (vc.op == "reduce_scatter" || vc.op == "reduce_scatterv") {
    // reduce_scatter: the equal-block form (as bench coll times it, and the tuner's even bounds assume);
    // reduce_scatterv: blocks of n and n + 1 elements by turns. (Only the uneven form was run with data.)
    const bool v = vc.op == "reduce_scatterv";
    std::vector<size_t> counts(p);
    for (int k = 0; k < p; ++k) counts[k] = n + (v ? static_cast<size_t>(k % 2) : 0);
    size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    auto in = make(total, t), out = make_out(counts[r], t, p);
    for (size_t i = 0; i < total; ++i) put(in, i, t, value(r, i, t, vc.reduce));
    if (v)
      c.reduce_scatter(in.data(), out.data(), counts, t, vc.reduce, o).wait();
    else
      c.reduce_scatter(in.data(), out.data(), n, t, vc.reduce, o).wait();
    size_t off = std::accumulate(counts.begin(), counts.begin() + r, size_t{0});
    for (size_t i = 0; i < counts[r]; ++i) expect_reduced(out, i, off + i);
  } else if (vc.op == "allgather" || vc.op == "allgatherv") {
    bool v = vc.op == "allgatherv";
    std::vector<size_t> counts(p);
    for (int k = 0; k < p; ++k) counts[k] = v ? vcount(k, n) : n;
    size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    auto in = make(counts[r], t), out = make_out(total, t, p);
    for (size_t i = 0; i < counts[r]; ++i) put(in, i, t, value(r, i, t, ReduceOp::sum));
    if (v) c.allgatherv(in.data(), out.data(), counts, t, o).wait();
    else c.allgather(in.data(), out.data(), n, t, o).wait();
    size_t off = 0;
    for (int k = 0; k < p; ++k) {
      for (size_t i = 0; i < counts[k]; ++i) expect(out, off + i, value(k, i, t, ReduceOp::sum));
      off += counts[k];
    }
  } else if (vc.op == "broadcast") {
    auto b = make(n, t);
    for (size_t i = 0; i < n; ++i) put(b, i, t, r == vc.root ? value(vc.root, i, t, ReduceOp::sum) : unwritten(p, t));
    c.broadcast(b.data(), n, t, vc.root, o).wait();
    for (size_t i = 0; i < n; ++i) expect(b, i, value(vc.root, i, t, ReduceOp::sum));
  } else if (vc.op == "reduce") {
    auto in = make(n, t), out = make_out(n, t, p);
    for (size_t i = 0; i < n; ++i) put(in, i, t, value(r, i, t, vc.reduce));
    auto copy = in;
    const bool in_place = vc.in_place && r == vc.root;  // (the other ranks have no output)
    c.reduce(in.data(), in_place ? in.data() : out.data(), n, t, vc.reduce, vc.root, o).wait();
    if (r == vc.root)
      for (size_t i = 0; i < n; ++i) expect_reduced(in_place ? in : out, i, i);
    if (!in_place && in != copy) wrong += 1;  // the input must not be clobbered
  } else if (vc.op == "gather") {
    auto in = make(n, t), out = make_out(n * p, t, p);
    for (size_t i = 0; i < n; ++i) put(in, i, t, value(r, i, t, ReduceOp::sum));
    c.gather(in.data(), out.data(), n, t, vc.root, o).wait();
    if (r == vc.root)
      for (int k = 0; k < p; ++k)
        for (size_t i = 0; i < n; ++i) expect(out, k * n + i, value(k, i, t, ReduceOp::sum));
  } else if (vc.op == "scatter") {
    auto in = make(n * p, t), out = make_out(n, t, p);
    if (r == vc.root)
      for (int k = 0; k < p; ++k)
        for (size_t i = 0; i < n; ++i) put(in, k * n + i, t, value(k, i, t, ReduceOp::sum));
    c.scatter(in.data(), out.data(), n, t, vc.root, o).wait();
    for (size_t i = 0; i < n; ++i) expect(out, i, value(r, i, t, ReduceOp::sum));
  } else if (vc.op == "alltoall" || vc.op == "alltoallv") {
    bool v = vc.op == "alltoallv";
    // Rank a sends cnt(a, b) elements to rank b; element i of that block is value(a * p + b, i).
    auto cnt = [&](int a, int b) { return v ? (a + 2 * b) % 3 == 0 ? 0 : n + static_cast<size_t>(a + b) : n; };
    std::vector<size_t> sc(p), rc(p);
    for (int k = 0; k < p; ++k) {
      sc[k] = cnt(r, k);
      rc[k] = cnt(k, r);
    }
    auto in = make(std::accumulate(sc.begin(), sc.end(), size_t{0}), t);
    auto out = make_out(std::accumulate(rc.begin(), rc.end(), size_t{0}), t, p);
    size_t off = 0;
    for (int k = 0; k < p; ++k)
      for (size_t i = 0; i < sc[k]; ++i) put(in, off++, t, value(r * p + k, i, t, ReduceOp::sum));
    // (alltoall itself, not alltoallv with equal counts: it was never run with data)
    if (v)
      c.alltoallv(in.data(), sc, out.data(), rc, t, o).wait();
    else
      c.alltoall(in.data(), out.data(), n, t, o).wait();
    off = 0;
    for (int k = 0; k < p; ++k)
      for (size_t i = 0; i < rc[k]; ++i) expect(out, off++, value(k * p + r, i, t, ReduceOp::sum));
  } else if (vc.op == "barrier") {
    // No rank may leave a barrier before every rank has entered it. The late rank (the root) first takes a token from
    // each other rank, sent just before that rank enters, then sleeps kLate before it enters itself: by causality
    // every other rank spends at least kLate in the barrier (its clock started before its token left), so a barrier
    // that lets ranks out early shows a shorter stay, and a correct one can never fail the check, however slow the
    // machine. (It was only run before: a barrier that returned at once passed.)
    if (p == 1) {
      c.barrier(o).wait();
      return 0;
    }
    constexpr auto kLate = std::chrono::milliseconds(10);
    const int late = (vc.root % p + p) % p;
    if (r == late) {
      std::vector<uint8_t> tokens(p);
      std::vector<Work> got;
      for (int k = 0; k < p; ++k)
        if (k != late) got.push_back(c.recv(&tokens[k], 1, DType::u8, k, kBarrierTokenTag, o));
      for (auto& w : got) w.wait();
      std::this_thread::sleep_for(kLate);
      c.barrier(o).wait();
    } else {
      const uint8_t token = 1;
      const auto entered = std::chrono::steady_clock::now();
      c.send(&token, 1, DType::u8, late, kBarrierTokenTag, o).wait();
      c.barrier(o).wait();
      if (std::chrono::steady_clock::now() - entered < kLate) ++wrong;
    }
  } else if (vc.op == "sendrecv") {
    if (p == 1) return 0;
    // A ring exchange with several tags in flight.
    int next = (r + 1) % p, prev = (r + p - 1) % p;
    auto a = make(n, t), b = make(n, t), ra = make_out(n, t, p), rb = make_out(n, t, p);
    for (size_t i = 0; i < n; ++i) {
      put(a, i, t, value(r, i, t, ReduceOp::sum));
      put(b, i, t, value(r + 1, i, t, ReduceOp::sum));
    }
    auto w1 = c.recv(rb.data(), n, t, prev, 2, o);
    auto w2 = c.recv(ra.data(), n, t, prev, 1, o);
    auto w3 = c.send(a.data(), n, t, next, 1, o);
    auto w4 = c.send(b.data(), n, t, next, 2, o);
    w1.wait(); w2.wait(); w3.wait(); w4.wait();
    for (size_t i = 0; i < n; ++i) {
      expect(ra, i, value(prev, i, t, ReduceOp::sum));
      expect(rb, i, value(prev + 1, i, t, ReduceOp::sum));
    }
  } else {
    throw ConfigError(fmt::format("unknown operation '{}': allowed are {}", vc.op, verify_ops_allowed()));
  }
  return wrong;
}

double verify_input(int rank, size_t i, DType t, ReduceOp op) { return value(rank, i, t, op); }

}  // namespace conduit::coll
