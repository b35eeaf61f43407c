// Recursive halving and doubling (Thakur, Rabenseifner & Gropp 2005).
//
// Non-power-of-two fix-up (for p = p' + r, p' the largest power of two <= p): among the first 2r ranks each even
// rank sends its whole vector to the odd rank above it, which reduces it and takes part; the even ranks sit out and
// get the result back at the end. Cost: α + nβ + nγ before, α + nβ after.
//
// rhd allreduce (Rabenseifner): reduce-scatter by recursive halving (log p' steps; at step k exchange half of the
//   remaining range with the partner at distance 2^k: the largest halves between neighbouring ranks, which a host
//   holds together, as MPICH orders it), then allgather by recursive doubling in the mirror order (the partner at
//   distance p'/2 first, with the smallest pieces).
//   time 2·log p'·α + 2(p'-1)/p'·nβ + (p'-1)/p'·nγ (+ fix-up) — bandwidth-optimal with log-many messages.
// rd allreduce: log p' steps exchanging the whole vector with the partner at distance 2^k and reducing.
//   time log p'·(α + nβ + nγ) (+ fix-up) — the latency-optimal choice for small vectors.
// rh reduce-scatter: the halving phase alone, on any block sizes (the fix-up as above, then each rank of the p'
//   group keeps the blocks of the ranks it stands for and sends the sat-out rank its block).
// rd allgather: log p' doubling steps on power-of-two groups; other sizes use the ring.
#include <cstring>

#include "coll/algorithms.h"

namespace conduit::coll {
namespace {

int pow2_floor(int p) {
  int q = 1;
  while (q * 2 <= p) q *= 2;
  return q;
}

// Group of p' participants after the fix-up.
struct Fold {
  int p, pp, rem, rank;
  int newrank;  // -1 when this rank sits out
  Fold(int size, int r) : p(size), pp(pow2_floor(size)), rem(size - pow2_floor(size)), rank(r) {
    if (rank < 2 * rem) newrank = (rank % 2 == 0) ? -1 : rank / 2;
    else newrank = rank - rem;
  }
  int real(int nr) const { return nr < rem ? nr * 2 + 1 : nr + rem; }
};

}  // namespace

void rd_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op) {
  const int p = c.size();
  if (p == 1 || count == 0) return;
  const size_t bytes = count * dtype_size(dt);
  Fold f(p, c.rank());
  if (f.rank < 2 * f.rem) {
    if (f.newrank < 0)
      c.wait(c.send_reduced(f.rank + 1, buf, bytes));
    else c.wait(c.recv_reduce(f.rank - 1, buf, count, dt, op));
  }
  if (f.newrank >= 0) {
    std::vector<char> tmp(bytes);
    for (int mask = 1; mask < f.pp; mask <<= 1) {
      int partner = f.real(f.newrank ^ mask);
      // Receive into a copy, and reduce the same way on both sides: the lower rank's data as the accumulator, the
      // higher's added into it (the higher rank then copies the result back). Written as op(partner, own) into
      // buf, the compiler may commute the operands, and sum or prod of two NaNs gives the first operand's NaN on
      // x86: the two ranks ended with different bits.
      auto rq = c.recv(partner, tmp.data(), bytes);
      auto sq = c.send(partner, buf, bytes);
      c.wait(rq);
      c.wait(sq);
      if (partner < c.rank()) {
        reduce_into(tmp.data(), buf, count, dt, op);
        std::memcpy(buf, tmp.data(), bytes);
      } else {
        reduce_into(buf, tmp.data(), count, dt, op);
      }
    }
  }
  if (f.rank < 2 * f.rem) {
    if (f.newrank < 0) c.wait(c.recv(f.rank + 1, buf, bytes));
    else c.wait(c.send(f.rank - 1, buf, bytes));
  }
}

void rh_reduce_scatter_inplace(Ctx& c, char* work, const Blocks& b, DType dt, ReduceOp op) {
  const int p = c.size();
  if (p == 1) return;
  const size_t esz = dtype_size(dt);
  const size_t total = b.total();
  Fold f(p, c.rank());
  if (f.rank < 2 * f.rem) {
    if (f.newrank < 0)
      c.wait(c.send_reduced(f.rank + 1, work, total * esz));
    else c.wait(c.recv_reduce(f.rank - 1, work, total, dt, op));
  }
  // Participant i of the p' group stands for the real ranks that fold into it: a sat-out even rank folds into the
  // odd rank above it. Its range covers the blocks of those real ranks, which are contiguous.
  auto first_block = [&](int nr) { return nr < f.rem ? nr * 2 : nr + f.rem; };
  auto end_block = [&](int nr) { return nr + 1 < f.pp ? first_block(nr + 1) : p; };
  auto span = [&](int lo_nr, int hi_nr) {  // element range of participants [lo_nr, hi_nr)
    size_t lo = b.offset[first_block(lo_nr)];
    int eb = end_block(hi_nr - 1);
    size_t hi = b.offset[eb - 1] + b.count[eb - 1];
    return std::make_pair(lo, hi);
  };
  if (f.newrank >= 0) {
    int lo = 0, hi = f.pp;
    for (int mask = f.pp / 2; mask >= 1; mask >>= 1) {
      int partner = f.real(f.newrank ^ mask);
      int mid = lo + (hi - lo) / 2;
      int keep_lo = (f.newrank & mask) ? mid : lo, keep_hi = (f.newrank & mask) ? hi : mid;
      int send_lo = (f.newrank & mask) ? lo : mid, send_hi = (f.newrank & mask) ? mid : hi;
      auto ks = span(keep_lo, keep_hi);
      auto ss = span(send_lo, send_hi);
      auto rq = c.recv_reduce(partner, work + ks.first * esz, ks.second - ks.first, dt, op);
      auto sq = c.send_reduced(partner, work + ss.first * esz, (ss.second - ss.first) * esz);
      c.wait(rq);
      c.wait(sq);
      lo = keep_lo;
      hi = keep_hi;
    }
  }
  if (f.rank < 2 * f.rem) {
    // The odd rank holds the reduced blocks of itself and of the even rank below: hand that one over.
    int even = f.newrank < 0 ? f.rank : f.rank - 1;
    if (f.newrank < 0) c.wait(c.recv(f.rank + 1, work + b.offset[even] * esz, b.count[even] * esz));
    else c.wait(c.send(even, work + b.offset[even] * esz, b.count[even] * esz));
  }
}

void rd_allgather_inplace(Ctx& c, char* buf, const Blocks& b, size_t esz) {
  const int p = c.size();
  if (p == 1) return;
  if ((p & (p - 1)) != 0) return ring_allgather_inplace(c, buf, b, esz);
  const int r = c.rank();
  int lo = r, hi = r + 1;  // blocks held: [lo, hi)
  for (int mask = 1; mask < p; mask <<= 1) {
    int partner = r ^ mask;
    int plo = (r & mask) ? lo - mask : hi;
    int phi = plo + mask;
    size_t my_off = b.offset[lo], my_end = b.offset[hi - 1] + b.count[hi - 1];
    size_t p_off = b.offset[plo], p_end = b.offset[phi - 1] + b.count[phi - 1];
    auto rq = c.recv(partner, buf + p_off * esz, (p_end - p_off) * esz);
    auto sq = c.send(partner, buf + my_off * esz, (my_end - my_off) * esz);
    c.wait(rq);
    c.wait(sq);
    lo = std::min(lo, plo);
    hi = std::max(hi, phi);
  }
}

void rhd_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op) {
  const int p = c.size();
  if (p == 1 || count == 0) return;
  const size_t esz = dtype_size(dt);
  char* w = static_cast<char*>(buf);
  Fold f(p, c.rank());
  if (f.rank < 2 * f.rem) {
    if (f.newrank < 0)
      c.wait(c.send_reduced(f.rank + 1, w, count * esz));
    else c.wait(c.recv_reduce(f.rank - 1, w, count, dt, op));
  }
  if (f.newrank >= 0) {
    Blocks b(count, f.pp);
    auto range = [&](int lo, int hi) {
      size_t a = b.offset[lo], e = b.offset[hi - 1] + b.count[hi - 1];
      return std::make_pair(a, e);
    };
    // (ranks differing in one bit share the range the lower bits have left them, so each pair splits one range;
    // a rank ends with the block of its bit-reversed index, which the doubling's mirror order undoes)
    int lo = 0, hi = f.pp;
    for (int mask = 1; mask < f.pp; mask <<= 1) {
      int partner = f.real(f.newrank ^ mask);
      int mid = lo + (hi - lo) / 2;
      bool upper = (f.newrank & mask) != 0;
      auto keep = upper ? range(mid, hi) : range(lo, mid);
      auto give = upper ? range(lo, mid) : range(mid, hi);
      auto rq = c.recv_reduce(partner, w + keep.first * esz, keep.second - keep.first, dt, op);
      auto sq = c.send_reduced(partner, w + give.first * esz, (give.second - give.first) * esz);
      c.wait(rq);
      c.wait(sq);
      if (upper) lo = mid;
      else hi = mid;
    }
    for (int mask = f.pp / 2; mask >= 1; mask >>= 1) {
      int partner = f.real(f.newrank ^ mask);
      bool upper = (f.newrank & mask) != 0;
      const int len = hi - lo;
      int plo = upper ? lo - len : hi, phi = plo + len;
      auto mine = range(lo, hi);
      auto theirs = range(plo, phi);
      auto rq = c.recv(partner, w + theirs.first * esz, (theirs.second - theirs.first) * esz);
      auto sq = c.send(partner, w + mine.first * esz, (mine.second - mine.first) * esz);
      c.wait(rq);
      c.wait(sq);
      lo = std::min(lo, plo);
      hi = std::max(hi, phi);
    }
  }
  if (f.rank < 2 * f.rem) {
    if (f.newrank < 0) c.wait(c.recv(f.rank + 1, w, count * esz));
    else c.wait(c.send(f.rank - 1, w, count * esz));
  }
}

}  // namespace conduit::coll
