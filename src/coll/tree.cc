// Trees and chains rooted anywhere (ranks renumbered relative to the root).
//
// binomial broadcast: ceil(log p) rounds; in round k ranks that have the data send it to the rank 2^k above.
//   time ceil(log p)·(α + nβ).
// chain broadcast: root -> 1 -> 2 -> ... in segments of CONDUIT_RING_SEGMENT_BYTES, each forwarded on arrival.
//   time (p - 1 + S - 1)·(α + (n/S)β) for S segments: bandwidth-optimal for large n.
// binomial reduce: the mirror of the broadcast, reducing on the way up. time ceil(log p)·(α + nβ + nγ).
// tree allreduce: binomial reduce to rank 0, then binomial broadcast: 2·ceil(log p)·(α + nβ) + ceil(log p)·nγ;
//   the choice for tiny vectors on many ranks.
// linear gather/scatter: the root posts p-1 receives (sends) at once. time (p-1)·(α + nβ) at the root.
#include <algorithm>
#include <cstring>

#include "coll/algorithms.h"

namespace conduit::coll {

void tree_broadcast(Ctx& c, void* buf, size_t bytes, int root) {
  const int p = c.size();
  if (p == 1) return;
  const int vr = (c.rank() - root + p) % p;
  int mask = 1;
  while (mask < p) {
    if (vr & mask) {
      c.wait(c.recv((vr - mask + root) % p, buf, bytes));
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  std::vector<net::RequestPtr> sends;
  while (mask > 0) {
    if (vr + mask < p) sends.push_back(c.send((vr + mask + root) % p, buf, bytes));
    mask >>= 1;
  }
  c.wait_all(sends);
}

void chain_broadcast(Ctx& c, void* buf, size_t bytes, int root) {
  const int p = c.size();
  if (p == 1) return;
  const int vr = (c.rank() - root + p) % p;
  const int next = vr + 1 < p ? (vr + 1 + root) % p : -1;
  const int prev = vr > 0 ? (vr - 1 + root) % p : -1;
  const size_t seg = ring_segment_bytes();
  const size_t nseg = std::max<size_t>(1, (bytes + seg - 1) / seg);
  char* b = static_cast<char*>(buf);
  auto seg_len = [&](size_t j) { return std::min(seg, bytes - std::min(bytes, j * seg)); };
  std::vector<net::RequestPtr> recvs, sends;
  if (prev >= 0)
    for (size_t j = 0; j < nseg; ++j) recvs.push_back(c.recv(prev, b + j * seg, seg_len(j)));
  for (size_t j = 0; j < nseg; ++j) {
    if (prev >= 0) c.wait(recvs[j]);
    if (next >= 0) sends.push_back(c.send(next, b + j * seg, seg_len(j)));
  }
  c.wait_all(sends);
}

void tree_reduce_inplace(Ctx& c, void* work, size_t count, DType dt, ReduceOp op, int root) {
  const int p = c.size();
  if (p == 1) return;
  const int vr = (c.rank() - root + p) % p;
  const size_t bytes = count * dtype_size(dt);
  for (int mask = 1; mask < p; mask <<= 1) {
    if (vr & mask) {
      c.wait(c.send_reduced((vr - mask + root) % p, work, bytes));
      return;
    }
    if (vr + mask < p) c.wait(c.recv_reduce((vr + mask + root) % p, work, count, dt, op));
  }
}

void tree_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op) {
  if (c.size() == 1 || count == 0) return;
  tree_reduce_inplace(c, buf, count, dt, op, 0);
  tree_broadcast(c, buf, count * dtype_size(dt), 0);
}

void linear_gather(Ctx& c, const void* in, void* out, size_t bytes, int root) {
  const int p = c.size();
  if (c.rank() != root) {
    c.wait(c.send(root, in, bytes));
    return;
  }
  char* o = static_cast<char*>(out);
  std::vector<net::RequestPtr> rs;
  for (int i = 0; i < p; ++i)
    if (i != root) rs.push_back(c.recv(i, o + i * bytes, bytes));
  if (o + root * bytes != in && bytes) std::memmove(o + root * bytes, in, bytes);
  c.wait_all(rs);
}

void linear_scatter(Ctx& c, const void* in, void* out, size_t bytes, int root) {
  const int p = c.size();
  if (c.rank() != root) {
    c.wait(c.recv(root, out, bytes));
    return;
  }
  const char* src = static_cast<const char*>(in);
  std::vector<net::RequestPtr> ss;
  for (int i = 0; i < p; ++i)
    if (i != root) ss.push_back(c.send(i, src + i * bytes, bytes));
  if (src + root * bytes != out && bytes) std::memmove(out, src + root * bytes, bytes);
  c.wait_all(ss);
}

}  // namespace conduit::coll
