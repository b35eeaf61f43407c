// Ring algorithms (Patarasuk & Yuan 2009), segmented and pipelined.
//
// reduce-scatter: p-1 steps; at step s rank r sends block (r-s-1) to r+1 and reduces block (r-s-2) received from
//   r-1 straight into its buffer. Each block is cut into segments (CONDUIT_RING_SEGMENT_BYTES) and a segment is
//   forwarded as soon as it is reduced, so sending and reducing overlap. Receives are posted ahead: a block is
//   reduced into exactly once, so early posting is safe.
//   messages per rank: (p-1)·segments; bytes sent per rank: (p-1)/p·n; time (p-1)α + (p-1)/p·n(β+γ).
// allgather: p-1 steps; at step s rank r sends block (r-s) to r+1 and receives block (r-s-1) from r-1.
//   bytes sent per rank (p-1)/p·n; time (p-1)α + (p-1)/p·nβ.
// allreduce = reduce-scatter + allgather: 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ — bandwidth-optimal.
#include <fmt/format.h>

#include <algorithm>

#include "coll/algorithms.h"
#include "core/env.h"
#include "core/error.h"
#include "net/bootstrap.h"
#include "net/wire.h"

namespace conduit::coll {

Blocks::Blocks(const std::vector<size_t>& counts) : count(counts), offset(counts.size()) {
  size_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    offset[i] = off;
    off += counts[i];
  }
}

Blocks::Blocks(size_t total, int parts) : count(parts), offset(parts) {
  size_t base = total / parts, extra = total % parts, off = 0;
  for (int i = 0; i < parts; ++i) {
    count[i] = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    offset[i] = off;
    off += count[i];
  }
}

size_t ring_segment_bytes() {
  static const size_t v = [] {
    auto s = env_string("CONDUIT_RING_SEGMENT_BYTES");
    size_t b = s ? parse_bytes(*s, "CONDUIT_RING_SEGMENT_BYTES") : net::kDefaultRingSegmentBytes;
    // (0 was raised to 64 without a word: every megabyte then took 16,384 steps)
    if (b < 64 || b > (size_t{1} << 30))
      throw ConfigError(fmt::format("CONDUIT_RING_SEGMENT_BYTES='{}' is {} bytes (allowed: 64 bytes to 1G)", *s, b));
    // (checked at start-up: a ring failed mid-run on its first segment over the limit, which every receiver refuses)
    if (b > net::max_message_bytes())
      throw ConfigError(
          fmt::format("CONDUIT_RING_SEGMENT_BYTES='{}' is {} bytes, over CONDUIT_MAX_MESSAGE_BYTES = {}; "
                      "allowed: a segment up to the message limit",
                      s ? *s : std::string("1M"), b, net::max_message_bytes()));
    return b;
  }();
  return v;
}

namespace {

struct Segs {
  // segment j of block k: [seg_off(k,j), +seg_cnt(k,j)) elements
  const Blocks& b;
  size_t nseg;
  Segs(const Blocks& blocks, size_t esz) : b(blocks) {
    size_t maxc = *std::max_element(b.count.begin(), b.count.end());
    size_t per = std::max<size_t>(1, ring_segment_bytes() / esz);
    nseg = std::max<size_t>(1, (maxc + per - 1) / per);
  }
  size_t cnt(int k, size_t j) const {
    size_t base = b.count[k] / nseg, extra = b.count[k] % nseg;
    return base + (j < extra ? 1 : 0);
  }
  size_t off(int k, size_t j) const {
    size_t base = b.count[k] / nseg, extra = b.count[k] % nseg;
    return b.offset[k] + j * base + std::min(j, extra);
  }
};

inline int mod(int a, int p) { return ((a % p) + p) % p; }

}  // namespace

void ring_reduce_scatter_inplace(Ctx& c, char* work, const Blocks& b, DType dt, ReduceOp op) {
  const int p = c.size(), r = c.rank();
  if (p == 1) return;
  const size_t esz = dtype_size(dt);
  Segs sg(b, esz);
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  const int steps = p - 1;
  std::vector<std::vector<net::RequestPtr>> rr(steps);
  for (int s = 0; s < steps; ++s) {
    int k = mod(r - s - 2, p);
    for (size_t j = 0; j < sg.nseg; ++j)
      rr[s].push_back(c.recv_reduce(prev, work + sg.off(k, j) * esz, sg.cnt(k, j), dt, op));
  }
  std::vector<net::RequestPtr> sends;
  int k0 = mod(r - 1, p);
  for (size_t j = 0; j < sg.nseg; ++j)
    sends.push_back(c.send_reduced(next, work + sg.off(k0, j) * esz, sg.cnt(k0, j) * esz));
  for (int s = 0; s < steps; ++s) {
    int k = mod(r - s - 2, p);
    for (size_t j = 0; j < sg.nseg; ++j) {
      c.wait(rr[s][j]);
      if (s + 1 < steps) sends.push_back(c.send_reduced(next, work + sg.off(k, j) * esz, sg.cnt(k, j) * esz));
    }
  }
  c.wait_all(sends);
}

void ring_allgather_inplace(Ctx& c, char* buf, const Blocks& b, size_t esz) {
  const int p = c.size(), r = c.rank();
  if (p == 1) return;
  Segs sg(b, esz);
  const int next = mod(r + 1, p), prev = mod(r - 1, p);
  const int steps = p - 1;
  std::vector<std::vector<net::RequestPtr>> rr(steps);
  for (int s = 0; s < steps; ++s) {
    int k = mod(r - s - 1, p);
    for (size_t j = 0; j < sg.nseg; ++j) rr[s].push_back(c.recv(prev, buf + sg.off(k, j) * esz, sg.cnt(k, j) * esz));
  }
  std::vector<net::RequestPtr> sends;
  for (size_t j = 0; j < sg.nseg; ++j) sends.push_back(c.send(next, buf + sg.off(r, j) * esz, sg.cnt(r, j) * esz));
  for (int s = 0; s < steps; ++s) {
    int k = mod(r - s - 1, p);
    for (size_t j = 0; j < sg.nseg; ++j) {
      c.wait(rr[s][j]);
      if (s + 1 < steps) sends.push_back(c.send(next, buf + sg.off(k, j) * esz, sg.cnt(k, j) * esz));
    }
  }
  c.wait_all(sends);
}

void ring_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op) {
  const int p = c.size();
  if (p == 1 || count == 0) return;
  Blocks b(count, p);
  char* w = static_cast<char*>(buf);
  // The reduce-scatter's sends finish before the allgather's receives are posted (they overwrite the same blocks).
  ring_reduce_scatter_inplace(c, w, b, dt, op);
  ring_allgather_inplace(c, w, b, dtype_size(dt));
}

}  // namespace conduit::coll
