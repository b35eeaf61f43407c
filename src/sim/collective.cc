#include "sim/collective.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <unordered_map>

#include "core/env.h"
#include "core/error.h"
#include "sim/flow.h"

namespace conduit::sim {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "allreduce";
    case Collective::kReduceScatter:
      return "reduce-scatter";
    case Collective::kAllGather:
      return "allgather";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kReduce:
      return "reduce";
    case Collective::kAllToAll:
      return "all-to-all";
    case Collective::kShift:
      return "pipeline-shift";
  }
  return "?";
}

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kHalvingDoubling:
      return "halving-doubling";
    case Algorithm::kRecursiveDoubling:
      return "recursive-doubling";
    case Algorithm::kBinomialTree:
      return "binomial-tree";
    case Algorithm::kDoubleBinaryTree:
      return "double-binary-tree";
    case Algorithm::kHierarchical:
      return "hierarchical";
    case Algorithm::kHierarchicalHd:
      return "hierarchical-hd";
    case Algorithm::kHierarchicalTree:
      return "hierarchical-tree";
    case Algorithm::kInNetwork:
      return "in-network";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kReduceScatterGather:
      return "reduce-scatter-gather";
  }
  return "?";
}

Algorithm parse_algorithm(const std::string& s, const std::string& flag) {
  for (Algorithm a :
       {Algorithm::kAuto, Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kRecursiveDoubling,
        Algorithm::kBinomialTree, Algorithm::kDoubleBinaryTree, Algorithm::kHierarchical, Algorithm::kHierarchicalHd,
        Algorithm::kHierarchicalTree, Algorithm::kInNetwork, Algorithm::kDirect, Algorithm::kReduceScatterGather}) {
    if (s == algorithm_name(a)) return a;
  }
  throw ConfigError(
      fmt::format("{} = '{}' (allowed: auto, ring, halving-doubling, recursive-doubling, binomial-tree, "
                  "double-binary-tree, hierarchical, hierarchical-hd, hierarchical-tree, in-network, direct, "
                  "reduce-scatter-gather)",
                  flag, s));
}

namespace {

struct Builder {
  const Topology& topo;
  Group g;
  long long gid(long long i) const { return g.first + i * g.stride; }
};

long long floor_pow2(long long p) {
  long long q = 1;
  while (q * 2 <= p) q *= 2;
  return q;
}

int ceil_log2(long long p) {
  int k = 0;
  while ((1LL << k) < p) ++k;
  return k;
}

// Ring over relative ranks `idx` (in order), `repeat` steps of `frac` each.
Step ring_step(const Builder& b, const std::vector<long long>& idx, double frac, double repeat, double reduce,
               const char* phase) {
  Step s;
  s.repeat = repeat;
  s.latency_hops = 1;
  s.reduce = reduce;
  s.phase = phase;
  const size_t m = idx.size();
  s.transfers.reserve(m);
  for (size_t i = 0; i < m; ++i) s.transfers.push_back({b.gid(idx[i]), b.gid(idx[(i + 1) % m]), frac, -1, -1});
  return s;
}

void append_ring(const Builder& b, Collective c, const std::vector<std::vector<long long>>& rings, double frac_total,
                 std::vector<Step>& out, const char* phase_prefix) {
  // `rings` run concurrently; each has m ranks and works on frac_total of n.
  const size_t m = rings.front().size();
  if (m < 2) return;
  auto merged = [&](double frac, double reduce, const char* phase) {
    Step s;
    s.repeat = static_cast<double>(m - 1);
    s.reduce = reduce;
    s.phase = fmt::format("{}{}", phase_prefix, phase);
    for (const auto& r : rings) {
      Step one = ring_step(b, r, frac, 1, 0, "");
      s.transfers.insert(s.transfers.end(), one.transfers.begin(), one.transfers.end());
    }
    return s;
  };
  const double chunk = frac_total / static_cast<double>(m);
  if (c == Collective::kAllReduce || c == Collective::kReduceScatter)
    out.push_back(merged(chunk, chunk, "reduce-scatter"));
  if (c == Collective::kAllReduce || c == Collective::kAllGather) out.push_back(merged(chunk, 0, "allgather"));
}

std::vector<long long> iota(long long p) {
  std::vector<long long> v(p);
  for (long long i = 0; i < p; ++i) v[i] = i;
  return v;
}

// The runtime's treatment of non-powers of two (coll/halving_doubling.cc, as MPICH's): for p = q + r, q the largest
// power of two <= p, each even rank of the first 2r hands its data to the odd rank above it (usually on its node),
// which takes part as participant i / 2; the others are participants i - r. A participant stands for the blocks of
// the ranks folded into it (reduce-scatter).
struct Fold {
  long long p, q, rem;
  explicit Fold(long long size) : p(size), q(floor_pow2(size)), rem(size - floor_pow2(size)) {}
  long long real(long long nr) const { return nr < rem ? 2 * nr + 1 : nr + rem; }
  long long first_block(long long nr) const { return nr < rem ? 2 * nr : nr + rem; }
  long long end_block(long long nr) const { return nr + 1 < q ? first_block(nr + 1) : p; }
  // Fraction of the data in participants [lo, hi)'s blocks (blocks of 1/p each).
  double span(long long lo, long long hi) const {
    return static_cast<double>(end_block(hi - 1) - first_block(lo)) / static_cast<double>(p);
  }
};

void append_fold(const Builder& b, const Fold& f, std::vector<Step>& out) {
  if (f.rem == 0) return;
  Step s;
  s.phase = "fold extra ranks";
  s.reduce = 1;
  for (long long i = 0; i < f.rem; ++i) s.transfers.push_back({b.gid(2 * i), b.gid(2 * i + 1), 1.0, -1, -1});
  out.push_back(std::move(s));
}

// The folded ranks' result back: the whole vector (allreduce) or their block (reduce-scatter).
void append_unfold(const Builder& b, const Fold& f, double frac, std::vector<Step>& out) {
  if (f.rem == 0) return;
  Step s;
  s.phase = "return to extra ranks";
  for (long long i = 0; i < f.rem; ++i) s.transfers.push_back({b.gid(2 * i + 1), b.gid(2 * i), frac, -1, -1});
  out.push_back(std::move(s));
}

// Recursive halving and doubling as the runtime runs them (coll/halving_doubling.cc), over relative ranks 0..p-1:
// - allreduce (rhd, Rabenseifner's, as MPICH orders it): halving with the partner at distance 1, 2, 4, ... (the
//   largest halves between the nearest ranks, which a node holds together), then doubling in the mirror order;
// - reduce-scatter (rh): halving from the farthest partner in (the block a rank keeps decides the order), any size
//   (the fold, then each participant's range covers its ranks' blocks, then the folded ranks get their block);
// - allgather (rd): doubling from the nearest partner out, the pieces growing to n/2 at distance p/2; powers of two
//   only: the runtime runs the ring for other sizes, and so does this pattern.
void append_halving_doubling(const Builder& b, Collective c, long long p, std::vector<Step>& out) {
  const Fold f(p);
  const long long q = f.q;
  if (c == Collective::kAllGather) {
    if (f.rem > 0) {
      append_ring(b, c, {iota(p)}, 1.0, out, "ring (rd's fallback for a non-power of two) ");
      return;
    }
    for (long long d = 1; d < q; d <<= 1) {
      Step s;
      s.phase = "recursive doubling";
      const double frac = static_cast<double>(d) / static_cast<double>(q);
      for (long long i = 0; i < q; ++i) s.transfers.push_back({b.gid(i), b.gid(i ^ d), frac, -1, -1});
      out.push_back(std::move(s));
    }
    return;
  }
  append_fold(b, f, out);
  if (c == Collective::kAllReduce) {
    // (equal blocks over the q participants; each halving step keeps and reduces half of what is left)
    for (long long d = 1; d < q; d <<= 1) {
      Step s;
      s.phase = "recursive halving";
      const double frac = 1.0 / static_cast<double>(2 * d);
      s.reduce = frac;
      for (long long i = 0; i < q; ++i) s.transfers.push_back({b.gid(f.real(i)), b.gid(f.real(i ^ d)), frac, -1, -1});
      out.push_back(std::move(s));
    }
    for (long long d = q / 2; d >= 1; d >>= 1) {
      Step s;
      s.phase = "recursive doubling";
      const double frac = 1.0 / static_cast<double>(2 * d);
      for (long long i = 0; i < q; ++i) s.transfers.push_back({b.gid(f.real(i)), b.gid(f.real(i ^ d)), frac, -1, -1});
      out.push_back(std::move(s));
    }
    append_unfold(b, f, 1.0, out);
    return;
  }
  // Reduce-scatter: each participant's range of participants [lo, hi) halves, the far partner first; it sends the
  // half it gives up (that part of the blocks) and reduces the half it keeps.
  std::vector<long long> lo(static_cast<size_t>(q), 0), hi(static_cast<size_t>(q), q);
  for (long long d = q / 2; d >= 1; d >>= 1) {
    Step s;
    s.phase = "recursive halving";
    for (long long i = 0; i < q; ++i) {
      const size_t u = static_cast<size_t>(i);
      const long long mid = lo[u] + (hi[u] - lo[u]) / 2;
      const bool upper = (i & d) != 0;
      const double give = upper ? f.span(lo[u], mid) : f.span(mid, hi[u]);
      const double keep = upper ? f.span(mid, hi[u]) : f.span(lo[u], mid);
      s.transfers.push_back({b.gid(f.real(i)), b.gid(f.real(i ^ d)), give, -1, -1});
      s.reduce = std::max(s.reduce, keep);
      (upper ? lo[u] : hi[u]) = mid;
    }
    out.push_back(std::move(s));
  }
  append_unfold(b, f, 1.0 / static_cast<double>(p), out);
}

// Recursive doubling (rd allreduce): the whole vector exchanged and reduced with the partner at distance 1, 2, 4, ...
// after the runtime's fold.
void append_recursive_doubling_allreduce(const Builder& b, long long p, std::vector<Step>& out) {
  const Fold f(p);
  append_fold(b, f, out);
  for (long long d = 1; d < f.q; d <<= 1) {
    Step s;
    s.phase = "recursive doubling";
    s.reduce = 1;
    for (long long i = 0; i < f.q; ++i) s.transfers.push_back({b.gid(f.real(i)), b.gid(f.real(i ^ d)), 1.0, -1, -1});
    out.push_back(std::move(s));
  }
  append_unfold(b, f, 1.0, out);
}

// Binomial tree rooted at relative rank 0, as the runtime's (coll/tree.cc): the broadcast sends to the farthest
// half first (0 -> p/2, then 0 -> p/4 and p/2 -> 3p/4, ...: one transfer leaves the root's node in the first
// round), the reduce is its mirror (distance 1 first, reducing on the way up).
void append_binomial(const Builder& b, long long p, bool reduce, std::vector<Step>& out) {
  const int steps = ceil_log2(p);
  for (int k = 0; k < steps; ++k) {
    Step s;
    s.phase = reduce ? "binomial reduce" : "binomial broadcast";
    const long long d = reduce ? 1LL << k : 1LL << (steps - 1 - k);
    for (long long i = 0; i + d < p; i += 2 * d) {
      if (reduce)
        s.transfers.push_back({b.gid(i + d), b.gid(i), 1.0, -1, -1});
      else
        s.transfers.push_back({b.gid(i), b.gid(i + d), 1.0, -1, -1});
    }
    s.reduce = reduce ? 1.0 : 0.0;
    out.push_back(std::move(s));
  }
}

// In-order binary tree on positions 1..p; returns the parent position (0 for the root) and the depth.
long long inorder_parent(long long v, long long p) {
  long long root = floor_pow2(p);
  if (v == root) return 0;
  long long par = v;
  do {
    long long bit = par & -par;
    par = (par - bit) | (bit << 1);
  } while (par > p);
  return par;
}

int inorder_depth(long long p) {
  int depth = 0;
  for (long long v = 1; v <= p; ++v) {
    int d = 0;
    for (long long x = v; inorder_parent(x, p) != 0; x = inorder_parent(x, p)) ++d;
    depth = std::max(depth, d);
  }
  return depth;
}

void append_double_binary_tree(const Builder& b, long long p, std::vector<Step>& out) {
  Step s;
  s.phase = "double binary tree (pipelined reduce + broadcast)";
  s.reduce = 1;
  // Tree A: rank r at position r+1. Tree B, as NCCL's ncclGetDtree: with p even it mirrors A (position p-r), with p
  // odd it shifts A by one rank (rank r at rank r-1's position), so that A's inner nodes are B's leaves either way
  // (a mirror at odd p kept some ranks inner in both trees: 3n on their links instead of 2n).
  const bool odd = p % 2 == 1;
  for (int tree = 0; tree < 2; ++tree) {
    for (long long r = 0; r < p; ++r) {
      long long v = tree == 0 ? r + 1 : odd ? (r - 1 + p) % p + 1 : p - r;
      long long par = inorder_parent(v, p);
      if (par == 0) continue;
      long long pr = tree == 0 ? par - 1 : odd ? par % p : p - par;
      s.transfers.push_back({b.gid(r), b.gid(pr), 0.5, -1, -1});  // reduce up
      s.transfers.push_back({b.gid(pr), b.gid(r), 0.5, -1, -1});  // broadcast down
    }
  }
  int depth = p <= 64 ? inorder_depth(p) : static_cast<int>(std::floor(std::log2(static_cast<double>(p))));
  s.latency_hops = 2.0 * std::max(1, depth);
  out.push_back(std::move(s));
}

// Ranks of the group that share the first rank's node (the group is assumed to tile nodes uniformly).
long long ranks_per_node(const Builder& b, long long p) {
  long long node0 = b.topo.node_of(b.gid(0));
  long long k = 0;
  while (k < p && b.topo.node_of(b.gid(k)) == node0) ++k;
  if (p % k != 0) return 1;
  for (long long i = 0; i < p; ++i)
    if (b.topo.node_of(b.gid(i)) != b.topo.node_of(b.gid((i / k) * k))) return 1;
  return k;
}

void append_in_network(const Builder& b, const std::vector<long long>& members, double frac, std::vector<Step>& out,
                       const char* phase) {
  const Topology& t = b.topo;
  if (t.spec().network.topology == TopologyKind::kTorus)
    throw UnsupportedError("in-network aggregation needs a switched network (fat-tree, rail-optimized or flat)");
  // (a flat network's file says so too: false was taken as true there)
  if (!t.spec().network.in_network_reduction)
    throw UnsupportedError(
        fmt::format("cluster '{}' has no in-network reduction (network.in_network_reduction)", t.spec().name));
  Step s;
  s.phase = phase;
  s.latency_hops = 2;  // up to the aggregation root and back down
  s.transfers.reserve(2 * members.size());
  std::vector<int> behind;
  std::unordered_map<int, long long> leaves;  // leaf-up link -> a member behind it
  double nic_lat = 0;
  for (long long i : members) {
    long long r = b.gid(i);
    behind.clear();
    t.links_behind(r, behind);
    if (behind.size() < 4) throw UnsupportedError("in-network aggregation: no NIC links in this topology");
    const NodeKind& k = t.kind_of_gpu(r);
    // A way up (or down) passes the NIC and, behind a leaf switch, that switch (as a point-to-point route counts it).
    const double way = k.nic.latency + (behind.size() >= 6 ? t.spec().network.switch_latency : 0);
    s.transfers.push_back({r, r, frac, behind[2], way});
    s.transfers.push_back({r, r, frac, behind[3], way});
    nic_lat = std::max(nic_lat, k.nic.latency);
    if (behind.size() >= 6) leaves.emplace(behind[4], r);
  }
  if (leaves.size() > 1) {
    // Across leaves a way up (or down) passes the NIC, the leaf and the spine switch: the step's latency is the
    // slowest leg's, so the leaf legs carry the whole way (they carried the two switches alone, a NIC's short).
    const double way = nic_lat + t.spec().network.switch_latency * 2;
    for (auto [up, r] : leaves) {
      s.transfers.push_back({r, r, frac, up, way});
      s.transfers.push_back({r, r, frac, up + static_cast<int>(t.leaves()), way});
    }
  }
  out.push_back(std::move(s));
}

// The inter-node phase of a hierarchical pattern over a group of m nodes with k ranks each: the k groups of the ranks
// at position j of each node (relative ranks j, j + k, ...) run `inner` at once, each on 1/k of n, step by step.
void append_inter_node(const Builder& b, Collective c, Algorithm inner, long long k, std::vector<Step>& out) {
  const long long m = b.g.size / k;
  std::vector<Step> merged;
  for (long long j = 0; j < k; ++j) {
    const Builder bj{b.topo, Group{m, b.g.stride * k, b.g.first + j * b.g.stride}};
    std::vector<Step> one;
    if (inner == Algorithm::kDoubleBinaryTree)
      append_double_binary_tree(bj, m, one);
    else
      append_halving_doubling(bj, c, m, one);
    if (j == 0) {
      merged = std::move(one);
      continue;
    }
    for (size_t si = 0; si < merged.size(); ++si)
      merged[si].transfers.insert(merged[si].transfers.end(), one[si].transfers.begin(), one[si].transfers.end());
  }
  const double share = 1.0 / static_cast<double>(k);
  for (Step& s : merged) {
    s.phase = fmt::format("inter-node {}", s.phase);
    s.reduce *= share;
    for (Transfer& t : s.transfers) t.frac *= share;
    out.push_back(std::move(s));
  }
}

// The aggregation step of an in-network allreduce over a group of k ranks a node: the k aggregations (the ranks at
// position j of each node) run at once, as one step.
void append_in_network_allreduce(const Builder& b, long long k, std::vector<Step>& out) {
  const long long m = b.g.size / k;
  for (long long j = 0; j < k; ++j) {
    std::vector<long long> members;
    for (long long n = 0; n < m; ++n) members.push_back(n * k + j);
    append_in_network(b, members, 1.0 / k, out, "in-network allreduce");
  }
  if (k > 1) {
    Step merged = std::move(out[out.size() - k]);
    for (long long j = 1; j < k; ++j) {
      auto& s = out[out.size() - k + j];
      merged.transfers.insert(merged.transfers.end(), s.transfers.begin(), s.transfers.end());
    }
    out.resize(out.size() - k);
    out.push_back(std::move(merged));
  }
}

}  // namespace

std::vector<Step> make_pattern(const Topology& topo, Collective c, Algorithm a, const Group& g) {
  if (g.size < 1 || g.stride < 1 || g.first < 0 || g.first + (g.size - 1) * g.stride >= topo.gpus())
    throw InvalidArgument(fmt::format("collective group (first {}, size {}, stride {}) does not fit {} accelerators",
                                      g.first, g.size, g.stride, topo.gpus()));
  Builder b{topo, g};
  const long long p = g.size;
  std::vector<Step> out;
  if (p == 1) return out;
  if (a == Algorithm::kAuto) throw InvalidArgument("make_pattern: resolve kAuto first");
  // Point-to-point patterns have one way to run (a row labelled in-network was the direct pattern).
  if ((c == Collective::kShift || c == Collective::kAllToAll) && a != Algorithm::kDirect)
    throw UnsupportedError(fmt::format("{}: the algorithm {} does not apply; allowed: direct",
                                       c == Collective::kShift ? "shift" : "all-to-all", algorithm_name(a)));
  switch (c) {
    case Collective::kShift: {
      Step s;
      s.phase = "send to next stage";
      for (long long i = 0; i + 1 < p; ++i) s.transfers.push_back({b.gid(i), b.gid(i + 1), 1.0, -1, -1});
      out.push_back(std::move(s));
      return out;
    }
    case Collective::kAllToAll: {
      if (p > 4096) throw UnsupportedError(fmt::format("all-to-all over {} ranks: at most 4096 in this version", p));
      // The runtime posts every send and receive at once (coll/alltoall.cc), as NCCL's grouped send/recv: one step
      // whose transfers share the links, each rank paying a latency per peer. (Timed as p - 1 pairwise steps in lock
      // step, a node whose NICs a step loaded unevenly paid its busiest NIC every step: 16 dgx-a100 GPUs, 1 GiB,
      // 40.4 ms against the NICs' 21.5 ms.)
      Step s;
      s.phase = "every pair at once";
      s.latency_hops = static_cast<double>(p - 1);
      s.transfers.reserve(static_cast<size_t>(p * (p - 1)));
      for (long long k = 1; k < p; ++k)
        for (long long i = 0; i < p; ++i) s.transfers.push_back({b.gid(i), b.gid((i + k) % p), 1.0 / p, -1, -1});
      out.push_back(std::move(s));
      return out;
    }
    case Collective::kBroadcast:
    case Collective::kReduce: {
      if (a == Algorithm::kBinomialTree) {
        append_binomial(b, p, c == Collective::kReduce, out);
        return out;
      }
      if (a == Algorithm::kReduceScatterGather && c == Collective::kReduce) {
        // The runtime's rsg (coll/communicator.cc): a ring reduce-scatter, then every rank's reduced block of n/p to
        // the root at once (its link takes (p-1)/p n), the p - 1 arrivals charged ceil(log p) latencies as the
        // runtime's cost model charges them (docs/algorithms.md).
        append_ring(b, Collective::kReduceScatter, {iota(p)}, 1.0, out, "ring ");
        Step s;
        s.phase = "blocks to the root";
        s.latency_hops = ceil_log2(p);
        for (long long i = 1; i < p; ++i)
          s.transfers.push_back({b.gid(i), b.gid(0), 1.0 / static_cast<double>(p), -1, -1});
        out.push_back(std::move(s));
        return out;
      }
      if (a == Algorithm::kRing) {  // pipelined chain: (p-1) latencies, n over each link once
        Step s;
        s.phase = "pipelined chain";
        s.chain = true;
        s.latency_hops = static_cast<double>(p - 1);
        s.reduce = c == Collective::kReduce ? 1.0 : 0.0;
        for (long long i = 0; i + 1 < p; ++i) {
          if (c == Collective::kBroadcast)
            s.transfers.push_back({b.gid(i), b.gid(i + 1), 1.0, -1, -1});
          else
            s.transfers.push_back({b.gid(i + 1), b.gid(i), 1.0, -1, -1});
        }
        out.push_back(std::move(s));
        return out;
      }
      break;
    }
    case Collective::kAllReduce:
    case Collective::kReduceScatter:
    case Collective::kAllGather: {
      switch (a) {
        case Algorithm::kRing:
          append_ring(b, c, {iota(p)}, 1.0, out, "ring ");
          return out;
        case Algorithm::kHalvingDoubling:
          append_halving_doubling(b, c, p, out);
          return out;
        case Algorithm::kRecursiveDoubling:
          if (c != Collective::kAllReduce) break;
          append_recursive_doubling_allreduce(b, p, out);
          return out;
        case Algorithm::kBinomialTree:
          if (c != Collective::kAllReduce) break;
          append_binomial(b, p, true, out);
          append_binomial(b, p, false, out);
          return out;
        case Algorithm::kDoubleBinaryTree:
          if (c != Collective::kAllReduce) break;
          append_double_binary_tree(b, p, out);
          return out;
        case Algorithm::kHierarchical:
        case Algorithm::kHierarchicalHd:
        case Algorithm::kHierarchicalTree:
        case Algorithm::kInNetwork: {
          const long long k = ranks_per_node(b, p);
          const long long m = p / k;
          if ((a == Algorithm::kInNetwork || a == Algorithm::kHierarchicalTree) && c != Collective::kAllReduce) break;
          // Asked for by name on a cluster without switch aggregation: say so even when the group fits in a node
          // (it would otherwise run the intra-node rings under the in-network name).
          if (a == Algorithm::kInNetwork && !b.topo.spec().network.in_network_reduction)
            throw UnsupportedError(fmt::format(
                "cluster '{}' has no in-network reduction (network.in_network_reduction)", b.topo.spec().name));
          if (k > 1) {
            std::vector<std::vector<long long>> intra;
            for (long long n = 0; n < m; ++n) {
              std::vector<long long> r;
              for (long long j = 0; j < k; ++j) r.push_back(n * k + j);
              intra.push_back(r);
            }
            if (c != Collective::kAllGather) append_ring(b, Collective::kReduceScatter, intra, 1.0, out, "intra-node ");
          }
          if (m > 1) {
            if (a == Algorithm::kInNetwork) {
              append_in_network_allreduce(b, k, out);
            } else if (a == Algorithm::kHierarchicalHd) {
              append_inter_node(b, c, Algorithm::kHalvingDoubling, k, out);
            } else if (a == Algorithm::kHierarchicalTree) {
              append_inter_node(b, c, Algorithm::kDoubleBinaryTree, k, out);
            } else {
              std::vector<std::vector<long long>> inter;
              for (long long j = 0; j < k; ++j) {
                std::vector<long long> r;
                for (long long n = 0; n < m; ++n) r.push_back(n * k + j);
                inter.push_back(r);
              }
              append_ring(b, c, inter, 1.0 / k, out, "inter-node ");
            }
          }
          if (k > 1 && c != Collective::kReduceScatter) {
            std::vector<std::vector<long long>> intra;
            for (long long n = 0; n < m; ++n) {
              std::vector<long long> r;
              for (long long j = 0; j < k; ++j) r.push_back(n * k + j);
              intra.push_back(r);
            }
            append_ring(b, Collective::kAllGather, intra, 1.0, out, "intra-node ");
          }
          return out;
        }
        default:
          break;
      }
      break;
    }
  }
  throw UnsupportedError(fmt::format("algorithm {} does not implement {}", algorithm_name(a), collective_name(c)));
}

std::vector<Algorithm> candidate_algorithms(Collective c, const Topology& topo) {
  switch (c) {
    case Collective::kAllReduce: {
      std::vector<Algorithm> v{Algorithm::kRing,
                               Algorithm::kHalvingDoubling,
                               Algorithm::kDoubleBinaryTree,
                               Algorithm::kHierarchical,
                               Algorithm::kHierarchicalHd,
                               Algorithm::kHierarchicalTree,
                               Algorithm::kRecursiveDoubling};
      if (topo.spec().network.in_network_reduction) v.push_back(Algorithm::kInNetwork);
      return v;
    }
    case Collective::kReduceScatter:
    case Collective::kAllGather:
      return {Algorithm::kRing, Algorithm::kHalvingDoubling, Algorithm::kHierarchical, Algorithm::kHierarchicalHd};
    case Collective::kBroadcast:
      return {Algorithm::kRing, Algorithm::kBinomialTree};
    case Collective::kReduce:
      return {Algorithm::kRing, Algorithm::kBinomialTree, Algorithm::kReduceScatterGather};
    case Collective::kAllToAll:
    case Collective::kShift:
      return {Algorithm::kDirect};
  }
  return {Algorithm::kRing};
}

// Appends a transfer's links to `path` (the one the pattern fixed, else the topology's route) and returns their
// latency.
static double route_transfer(const Topology& topo, const Transfer& t, std::vector<int>& path) {
  if (t.link < 0) return topo.route(t.src, t.dst, path);
  path.push_back(t.link);
  return std::max(0.0, t.latency);
}

// The offsets (first rank - g.first) of every concurrent copy of group g: the tiling of the cluster in blocks of
// size x stride, shifted by 0..stride-1.
static std::vector<long long> copy_offsets(const Topology& topo, const Group& g) {
  const long long block = g.size * g.stride;
  std::vector<long long> out;
  for (long long bk = 0; bk < topo.gpus() / block; ++bk)
    for (long long j = 0; j < g.stride; ++j) out.push_back(bk * block + j - g.first);
  return out;
}

// Whether a copy of the pattern is the pattern with every rank shifted by the copy's offset: its transfers are routed
// by the topology (none carries a fixed link, as in-network aggregation's do) and its shape does not read where the
// group sits (a hierarchical pattern splits at node boundaries: below). Then copies need not be built, only routed
// (100,000 accelerators on a torus: 1.3 s of building and copying patterns).
static bool shifts_exactly(const Topology& topo, Algorithm a, const Group& g, const std::vector<Step>& steps) {
  // (An in-network allreduce's aggregation step holds fixed links, the NICs and leaf uplinks of its ranks: each copy's
  // is rebuilt for its own ranks, the rest of its pattern, intra-node rings, shifts as a hierarchical one's does.)
  if (a != Algorithm::kInNetwork)
    for (const Step& s : steps)
      for (const Transfer& t : s.transfers)
        if (t.link >= 0) return false;
  if (a != Algorithm::kHierarchical && a != Algorithm::kHierarchicalHd && a != Algorithm::kHierarchicalTree &&
      a != Algorithm::kInNetwork)
    return true;
  // A hierarchical pattern reads where its group sits only through how many of its ranks share a node (its rings run
  // over positions in the group): a copy whose ranks split over nodes as g's do runs g's pattern shifted. (Building
  // and routing every copy's pattern took a quarter of a 262,144-GPU plan's time.)
  const long long k = ranks_per_node(Builder{topo, g}, g.size);
  for (long long off : copy_offsets(topo, g))
    if (ranks_per_node(Builder{topo, Group{g.size, g.stride, g.first + off}}, g.size) != k) return false;
  return true;
}

// Every concurrent copy of group g's pattern (the tiling of the cluster in blocks of size x stride, shifted by
// 0..stride-1); `have` is g's own pattern, reused for its copy.
std::vector<std::vector<Step>> CollectiveModel::group_copies(Collective c, Algorithm a, const Group& g,
                                                             const std::vector<Step>* have) {
  const long long block = g.size * g.stride;
  std::vector<std::vector<Step>> all;
  for (long long bk = 0; bk < topo_.gpus() / block; ++bk)
    for (long long j = 0; j < g.stride; ++j) {
      const long long first = bk * block + j;
      all.push_back(have && first == g.first ? *have : make_pattern(topo_, c, a, Group{g.size, g.stride, first}));
    }
  return all;
}

// Whether two patterns run the same steps (so their copies can share links in lock step).
static bool same_steps(const std::vector<Step>& x, const std::vector<Step>& y) {
  if (x.size() != y.size()) return false;
  for (size_t si = 0; si < x.size(); ++si)
    if (x[si].phase != y[si].phase || x[si].repeat != y[si].repeat || x[si].latency_hops != y[si].latency_hops)
      return false;
  return true;
}

CollectiveModel::CopySet CollectiveModel::copy_set(Collective c, Algorithm a, const Group& g,
                                                   const std::vector<Step>& steps) {
  CopySet cs;
  const long long block = g.size * g.stride;
  if (block <= 0 || topo_.gpus() % block != 0) return cs;
  // On a torus every copy is routed (other copies' multi-hop routes cross this one's links). Elsewhere a link's load
  // is this copy's times the copies sharing it, which holds while the copies sharing a link load it alike; copies that
  // straddle nodes or leaves differently do not (16 ranks at stride 5 on dgx-a100: 8.1 ms against 14.4 ms in full
  // detail), nor does a transfer through a PXN proxy, whose NIC no rank of the group sits behind (2 ranks 10 apart
  // on 160 dgx-a100 GPUs: two copies' proxies shared a NIC, 2.77 ms against 5.45 ms), so they are all routed too, up
  // to a bound on the transfers that costs.
  if (topo_.spec().network.topology == TopologyKind::kTorus)
    cs.route_all = true;
  else {
    // Whether some copies straddle otherwise than others does not depend on which of the tiling's copies g is: once
    // per shape (a group placed off the tiling is compared on its own).
    const bool tiling = g.first >= 0 && g.first % block < g.stride;
    auto [it, fresh] = uneven_.try_emplace({g.size, g.stride, tiling ? -1 : g.first}, false);
    if (fresh) distinct_copies(g, &it->second);
    auto proxied = [&] {
      // (Ranks all on one rail never need a proxy: data-parallel and pipeline groups whose stride a node's size
      // divides; only then are the transfers looked at.)
      bool one_rail = true;
      for (long long i = 1; i < g.size && one_rail; ++i)
        one_rail = topo_.nic_of(g.first + i * g.stride) == topo_.nic_of(g.first);
      if (one_rail) return false;
      for (const Step& s : steps)
        for (const Transfer& t : s.transfers)
          if (t.link < 0 && topo_.via_proxy(t.src, t.dst)) return true;
      return false;
    };
    if (!it->second && (topo_.spec().network.topology != TopologyKind::kRailOptimized || !proxied())) return cs;
    size_t transfers = 0;
    for (const Step& s : steps) transfers += s.transfers.size();
    const double copies = static_cast<double>(topo_.gpus() / block) * static_cast<double>(g.stride);
    cs.route_all = copies * static_cast<double>(transfers) <= kRouteAllTransfers;
    // (one copy is the group itself, routed exactly either way: an all-to-all over the whole cluster was marked
    // approximate, its note saying copies straddle nodes unevenly)
    cs.approximate = copies > 1 && !cs.route_all;
  }
  if (!cs.route_all) return cs;
  cs.shift = shifts_exactly(topo_, a, g, steps);
  if (cs.shift) {
    cs.offsets = copy_offsets(topo_, g);
    if (a == Algorithm::kInNetwork) cs.rebuild = {&topo_, g, ranks_per_node(Builder{topo_, g}, g.size)};
    return cs;
  }
  cs.patterns = group_copies(c, a, g, &steps);
  // Copies that run different patterns (a hierarchical pattern splits where each copy's nodes are) have no common
  // steps: each placement is then timed apart (profile()), as when the copies are too many to route.
  for (const auto& pat : cs.patterns)
    if (!same_steps(pat, steps)) {
      cs.patterns.clear();
      cs.route_all = false;
      cs.approximate = true;
      break;
    }
  return cs;
}

// Two independent 64-bit hashes of a step's transfers (ranks, fractions, fixed links and latencies): what its cost
// depends on besides its group and the copies routed with it.
static std::pair<uint64_t, uint64_t> step_hash(const Step& s) {
  uint64_t a = 0xcbf29ce484222325ull, b = 0x9e3779b97f4a7c15ull;
  auto mix = [&](uint64_t v) {
    a = (a ^ v) * 0x100000001b3ull;  // FNV-1a over 64-bit words
    b += v + 0x9e3779b97f4a7c15ull;  // splitmix64's step and finalizer
    b = (b ^ (b >> 30)) * 0xbf58476d1ce4e5b9ull;
    b = (b ^ (b >> 27)) * 0x94d049bb133111ebull;
    b ^= b >> 31;
  };
  auto bits = [](double d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    return u;
  };
  mix(s.transfers.size());
  for (const Transfer& t : s.transfers) {
    mix(static_cast<uint64_t>(t.src));
    mix(static_cast<uint64_t>(t.dst));
    mix(bits(t.frac));
    mix(static_cast<uint64_t>(t.link));
    mix(bits(t.latency));
  }
  return {a, b};
}

// Calls f(step, offset) for step si of every copy in cs: g's own step shifted by each copy's offset, each built
// copy's step, or g's step alone.
template <class F>
static void for_each_copy(const CollectiveModel::CopySet& cs, const std::vector<Step>& steps, size_t si, F&& f) {
  const bool fixed = cs.rebuild.topo && std::any_of(steps[si].transfers.begin(), steps[si].transfers.end(),
                                                    [](const Transfer& t) { return t.link >= 0; });
  if (fixed) {
    // (each copy's in-network aggregation step, over its own ranks' links)
    const Group& g = cs.rebuild.group;
    std::vector<Step> own;
    for (long long off : cs.offsets) {
      own.clear();
      append_in_network_allreduce(Builder{*cs.rebuild.topo, Group{g.size, g.stride, g.first + off}},
                                  cs.rebuild.ranks_per_node, own);
      f(own.front(), 0);
    }
  } else if (cs.shift)
    for (long long off : cs.offsets) f(steps[si], off);
  else if (cs.route_all)
    for (const auto& pat : cs.patterns) f(pat[si], 0);
  else
    f(steps[si], 0);
}

CollectiveCost CollectiveModel::evaluate_symmetric(Collective c, Algorithm a, const Group& g, bool alone) {
  CollectiveCost cost;
  cost.algorithm = a;
  cost.gamma = 1.0 / topo_.spec().network.reduction_bandwidth;
  std::vector<Step> steps = make_pattern(topo_, c, a, g);
  if (steps.empty()) return cost;
  const size_t nl = topo_.num_links();
  if (load_.size() != nl) {
    load_.assign(nl, 0.0);
    ranks_behind_.assign(nl, 0);
  }
  // Which transfers load the links. Usually only the representative group's, each link's load then multiplied by
  // the concurrent groups sharing it (accelerators behind the link / the group's ranks behind it). On a torus a link
  // also carries other groups' traffic routed through it (dimension-ordered multi-hop routes), which that count does
  // not see: every concurrent copy is routed and the loads summed (equal flows on a symmetric pattern finish
  // together, so the most loaded link gives the max-min fair makespan full-detail mode finds).
  const CopySet cs = alone ? CopySet{} : copy_set(c, a, g, steps);
  const bool route_all = cs.route_all;
  cost.all_copies_routed = route_all;
  cost.approximate = cs.approximate;
  std::vector<int> behind_touched, behind;
  if (!route_all && !alone)
    for (long long i = 0; i < g.size; ++i) {
      behind.clear();
      topo_.links_behind(g.first + i * g.stride, behind);
      for (int l : behind) {
        if (ranks_behind_[l]++ == 0) behind_touched.push_back(l);
      }
    }
  const double overhead = topo_.spec().network.software_overhead;
  std::vector<int> touched, path;
  std::map<std::string, double> by_kind;
  // Looked up where every copy is routed as g's transfers shifted: hashing a step's transfers costs about what routing
  // them once does (g alone: no gain, 20-25% slower), and copies built one by one may differ from g's in any step.
  const bool cacheable = route_all && cs.shift;
  // Step si's latency, bandwidth term and bounding link kind, routed over the copies.
  auto route_step = [&](size_t si) {
    double lat = 0;
    auto load = [&](const Step& st, long long off) {
      for (const Transfer& t : st.transfers) {
        path.clear();
        lat = std::max(lat, off == 0 ? route_transfer(topo_, t, path) : topo_.route(t.src + off, t.dst + off, path));
        for (int id : path) {
          if (load_[id] == 0.0) touched.push_back(id);
          load_[id] += t.frac;
        }
      }
    };
    for_each_copy(cs, steps, si, load);
    double coeff = 0;
    LinkKind worst = LinkKind::kGpuOut;
    for (int id : touched) {
      const Link& L = topo_.link(id);
      const double share =
          route_all || alone ? 1.0 : static_cast<double>(topo_.gpus_behind(id)) / std::max(1, ranks_behind_[id]);
      double v = load_[id] * std::max(1.0, share) / L.bandwidth;
      if (v > coeff) {
        coeff = v;
        worst = L.kind;
      }
      load_[id] = 0.0;
    }
    touched.clear();
    return StepCost{lat, coeff, worst};
  };
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& s = steps[si];
    StepCost sc;
    if (cacheable) {
      const auto [h1, h2] = step_hash(s);
      const auto key = std::make_tuple(g.size, g.stride, g.first, h1, h2);
      // (kept once routed: a step that threw part way leaves no entry)
      if (auto it = step_cache_.find(key); it != step_cache_.end())
        sc = it->second;
      else
        sc = step_cache_.emplace(key, route_step(si)).first->second;
    } else {
      sc = route_step(si);
    }
    cost.latency += s.repeat * s.latency_hops * (sc.latency + overhead);
    cost.per_byte += s.repeat * sc.per_byte;
    cost.reduce_frac += s.repeat * s.reduce;
    cost.steps += s.repeat * s.latency_hops;  // (the latencies paid: a pipelined tree's depth, a chain's hops)
    by_kind[link_kind_name(sc.worst)] += s.repeat * sc.per_byte;
  }
  for (int l : behind_touched) ranks_behind_[l] = 0;
  double best = -1;
  for (auto& [k, v] : by_kind)
    if (v > best) {
      best = v;
      cost.bottleneck = k;
    }
  if (steps.size() == 1 && steps.front().chain) {
    // The chain's segments: each hop's per-byte time is its route's slowest link's (the copies' sharing is in the
    // steady pace, per_byte, and left out of the fill).
    const Step& s = steps.front();
    double sum = 0, slowest = 0;
    for (const Transfer& t : s.transfers) {
      path.clear();
      route_transfer(topo_, t, path);
      double hop = 0;
      for (int id : path) hop = std::max(hop, 1.0 / topo_.link(id).bandwidth);
      sum += hop;
      slowest = std::max(slowest, hop);
    }
    cost.segment = topo_.spec().network.pipeline_segment;
    cost.segment_latency = cost.latency / s.latency_hops;
    cost.fill_per_byte = sum - slowest;
    cost.fill_reduce = s.reduce * (s.latency_hops - 1);
  }
  return cost;
}

std::vector<StepReport> CollectiveModel::explain(Collective c, Algorithm a, const Group& g, double n,
                                                 long long* copy_first) {
  if (a == Algorithm::kAuto) a = profile(c, a, g, n).algorithm;
  bool all_routed = false;
  std::vector<StepReport> best = explain_copy(c, a, g, n, &all_routed);
  long long first = g.first;
  auto total = [](const std::vector<StepReport>& v) {
    double t = 0;
    for (const auto& s : v) t += s.repeat * s.time;
    return t;
  };
  // (When every copy was routed, each placement's steps are those already: 16 more routings of everything.)
  if (!all_routed)
    for (long long f : distinct_copies(g)) {
      auto other = explain_copy(c, a, Group{g.size, g.stride, f}, n);
      if (total(other) > total(best)) {
        best = std::move(other);
        first = f;
      }
    }
  if (copy_first) *copy_first = first;
  // (a chain's further segments and its fill, after the one step that moves n at the slowest hop's pace)
  if (const double seg = profile(c, a, g, n).segmentation(n); seg > 0) {
    StepReport r;
    r.phase = "segments and pipeline fill";
    r.time = seg;
    best.push_back(r);
  }
  return best;
}

std::set<long long> CollectiveModel::distinct_copies(const Group& g, bool* uneven) const {
  std::set<long long> firsts;
  if (uneven) *uneven = false;
  const long long block = g.size * g.stride;
  if (block <= 0 || topo_.gpus() % block != 0) return firsts;
  // What a copy's cost depends on besides its pattern: for each rank, whether it shares the previous rank's node and
  // leaf, how many nodes its leaf holds (the last leaf may be part full), its node's kind and (rail-optimized) its
  // NIC. Copies alike in all of these load alike links alike; one of each other kind is evaluated too (a group whose
  // copies straddle leaves or nodes differently, or sit on another node kind, was taken to cost what rank 0's does:
  // 86 ms against 129 ms in full detail for 2 ranks 96 apart across the 3:1 uplinks into a half-full leaf).
  const long long npl = std::max<long long>(1, topo_.spec().network.nodes_per_leaf);
  const bool rail = topo_.spec().network.topology == TopologyKind::kRailOptimized;
  int max_nics = 1;
  for (const NodeKind& k : topo_.spec().node_kinds) max_nics = std::max(max_nics, k.nics);
  std::vector<long long> first_on_nic;
  // The second hash keeps the straddling alone: copies that differ in it share links unevenly (*uneven).
  auto signature = [&](long long first) {
    uint64_t h = 1469598103934665603ull, straddle = h;
    auto mix = [](uint64_t& x, uint64_t v) { x = (x ^ v) * 1099511628211ull; };
    long long prev_node = -1, prev_leaf = -1;
    // How many nodes a leaf holds does not matter to a copy inside one node, which uses no NIC, leaf or uplink: it
    // costs the same in the last, part-full leaf (every tensor-parallel group of 262,144 dgx-a100 GPUs was routed, copy
    // by copy, because the last leaf holds 8 nodes of 20). A copy across nodes keeps it even inside one leaf: on a
    // rail-optimized network its transfers between rails (in-network legs, nodes with fewer NICs) climb to the spine,
    // and where node kinds differ this is what has every copy routed, which the placements' shares get wrong (a
    // review: 0.22 s against 0.42 s in full detail).
    const bool one_node = topo_.node_of(first) == topo_.node_of(first + (g.size - 1) * g.stride);
    // Rail-optimized, across nodes: which of the group's ranks share a rail (the first rank on each rank's NIC index).
    // With the pods above it says which share a rail leaf, whose load the shares scale by the ranks behind it: where
    // node kinds with different NIC counts share a pod, copies put unlike numbers of ranks behind one rail leaf (8
    // nodes of 4 NICs and 8 of 2, 6 a pod: 16 ranks 8 apart, in-network, 17.9 ms against 10.8 ms in full detail),
    // and a copy on one rail needs no PXN proxy where one across rails does.
    first_on_nic.assign(rail && !one_node ? max_nics : 0, -1);
    for (long long i = 0; i < g.size; ++i) {
      const long long gpu = first + i * g.stride, node = topo_.node_of(gpu), leaf = node / npl;
      const NodeKind& k = topo_.kind_of_node(node);
      mix(straddle, uint64_t(node == prev_node) | uint64_t(leaf == prev_leaf) << 1);
      if (!one_node) mix(straddle, uint64_t(std::min(npl, topo_.nodes() - leaf * npl)));
      mix(h, uint64_t(&k - topo_.spec().node_kinds.data()));
      if (rail) {
        const int nic = topo_.nic_of_local(topo_.local_of(gpu), k);
        mix(h, uint64_t(nic));
        if (!one_node) {
          long long& on_nic = first_on_nic[static_cast<size_t>(nic)];
          if (on_nic < 0) on_nic = i;
          mix(straddle, uint64_t(on_nic));
        }
      }
      prev_node = node;
      prev_leaf = leaf;
    }
    mix(h, straddle);
    return std::pair{h, straddle};
  };
  const auto own = signature(g.first);
  std::set<uint64_t> seen = {own.first};
  constexpr size_t kMaxExtra = 16;  // beyond that, the first 16 other placements (a bound on the time it takes)
  for (long long bk = 0; bk < topo_.gpus() / block && (firsts.size() < kMaxExtra || (uneven && !*uneven)); ++bk)
    for (long long j = 0; j < g.stride && (firsts.size() < kMaxExtra || (uneven && !*uneven)); ++j) {
      const long long first = bk * block + j;
      if (first == g.first) continue;
      const auto sig = signature(first);
      if (uneven && sig.second != own.second) *uneven = true;
      if (firsts.size() < kMaxExtra && seen.insert(sig.first).second) firsts.insert(first);
    }
  return firsts;
}

std::vector<StepReport> CollectiveModel::explain_copy(Collective c, Algorithm a, const Group& g, double n,
                                                      bool* all_routed) {
  std::vector<Step> steps = make_pattern(topo_, c, a, g);
  std::vector<StepReport> out;
  std::unordered_map<int, double> load;
  std::unordered_map<int, int> behind;
  std::vector<int> tmp;
  // As evaluate_symmetric: on a torus every concurrent copy is routed (other groups' multi-hop routes cross this
  // group's links), elsewhere the links' loads are scaled by the copies sharing them.
  const CopySet cs = copy_set(c, a, g, steps);
  const bool route_all = cs.route_all;
  if (all_routed) *all_routed = route_all;
  if (!route_all)
    for (long long i = 0; i < g.size; ++i) {
      tmp.clear();
      topo_.links_behind(g.first + i * g.stride, tmp);
      for (int l : tmp) behind[l]++;
    }
  const double overhead = topo_.spec().network.software_overhead;
  const double gamma = 1.0 / topo_.spec().network.reduction_bandwidth;
  std::vector<int> path;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& s = steps[si];
    load.clear();
    double lat = 0;
    auto add = [&](const Step& st, long long off) {
      for (const Transfer& t : st.transfers) {
        path.clear();
        lat = std::max(lat, off == 0 ? route_transfer(topo_, t, path) : topo_.route(t.src + off, t.dst + off, path));
        for (int id : path) load[id] += t.frac * n;
      }
    };
    for_each_copy(cs, steps, si, add);
    StepReport r;
    r.phase = s.phase;
    r.repeat = s.repeat;
    r.transfers = s.transfers.size();
    r.links_used = load.size();
    double worst = 0;
    for (auto [id, bytes] : load) {
      auto it = behind.find(id);
      double share =
          route_all ? 1.0
                    : static_cast<double>(topo_.gpus_behind(id)) / std::max(1, it == behind.end() ? 0 : it->second);
      double total = bytes * std::max(1.0, share);
      double t = total / topo_.link(id).bandwidth;
      if (t > worst || r.bottleneck_link < 0) {
        worst = t;
        r.bottleneck_link = id;
        r.bottleneck = link_kind_name(topo_.link(id).kind);
        r.bottleneck_bytes = total;
      }
    }
    r.time = s.latency_hops * (lat + overhead) + worst + s.reduce * n * gamma;
    out.push_back(r);
  }
  return out;
}

// The fastest candidate algorithm for n_hint bytes: the first in candidate_algorithms' order of those that take the
// least time. Each candidate's pattern is first routed for g alone, a bound below its profile (loads summed over more
// copies, scaled by shares >= 1, maxima over more placements: each term of the cost only grows; with g's own transfers
// routed among them: a copy off the cluster's tiling is not), candidates are profiled in the order of their bounds,
// and one whose bound the best so far beats is not profiled: on 262,144 GPUs the halving-doubling, recursive-doubling
// and tree patterns of large groups each took as long to route over every copy as the rest of a plan. The choice is the
// one profiling every candidate makes.
CollectiveCost CollectiveModel::auto_profile(Collective c, const Group& g, double n_hint) {
  const std::vector<Algorithm> cands = candidate_algorithms(c, topo_);
  const long long block = g.size * g.stride;
  // (a bound costs a routing of g: worth it only where some candidate may be skipped)
  const bool bounded =
      cands.size() > 1 && (block <= 0 || topo_.gpus() % block != 0 || (g.first >= 0 && g.first % block < g.stride));
  struct Entry {
    double bound;
    size_t index;
  };
  std::vector<Entry> order;
  for (size_t i = 0; i < cands.size(); ++i) {
    const auto key = std::make_tuple(static_cast<int>(c), static_cast<int>(cands[i]), g.size, g.stride, g.first);
    double bound = 0;
    if (auto it = cache_.find(key); it != cache_.end()) {
      bound = it->second.time(n_hint);
    } else if (bounded) {
      auto [b, fresh] = bounds_.try_emplace(key);
      if (fresh) {
        try {
          b->second = evaluate_symmetric(c, cands[i], g, true);
        } catch (const UnsupportedError&) {
          b->second.reset();  // the pattern does not apply: profile() would throw too
        }
      }
      if (!b->second) continue;
      bound = b->second->time(n_hint);
    }
    order.push_back({bound, i});
  }
  std::stable_sort(order.begin(), order.end(), [](const Entry& x, const Entry& y) { return x.bound < y.bound; });
  CollectiveCost best;
  double best_t = -1;
  size_t best_i = 0;
  for (const Entry& e : order) {
    if (best_t >= 0 && (e.bound > best_t || (e.bound == best_t && e.index > best_i))) continue;
    CollectiveCost cc;
    try {
      cc = profile(c, cands[e.index], g, n_hint);
    } catch (const UnsupportedError&) {
      continue;
    }
    const double t = cc.time(n_hint);
    if (best_t < 0 || t < best_t || (t == best_t && e.index < best_i)) {
      best_t = t;
      best = cc;
      best_i = e.index;
    }
  }
  if (best_t < 0) throw UnsupportedError(fmt::format("no algorithm implements {}", collective_name(c)));
  return best;
}

CollectiveCost CollectiveModel::profile(Collective c, Algorithm a, const Group& g, double n_hint) {
  if (a == Algorithm::kAuto) return auto_profile(c, g, n_hint);
  auto key = std::make_tuple(static_cast<int>(c), static_cast<int>(a), g.size, g.stride, g.first);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  CollectiveCost cost = evaluate_symmetric(c, a, g);
  // Symmetric mode simulates one group and takes every concurrent copy to see the same links. Copies placed
  // otherwise differ (a group of the slow kind behind 1 GbE uplinks next to one of NVLink nodes; one straddling a
  // part-full leaf), and the step waits for the slowest: one copy of each other placement is evaluated too and the
  // largest terms kept. (Copies tile the cluster in blocks of size x stride, shifted by 0..stride-1, as full-detail
  // mode lays them out.)
  // When every copy was routed, the most loaded link over all of them is already in.
  if (!cost.all_copies_routed)
    for (long long f : distinct_copies(g)) {
      CollectiveCost other = evaluate_symmetric(c, a, Group{g.size, g.stride, f});
      if (other.per_byte > cost.per_byte) cost.bottleneck = other.bottleneck;
      cost.latency = std::max(cost.latency, other.latency);
      cost.per_byte = std::max(cost.per_byte, other.per_byte);
      cost.reduce_frac = std::max(cost.reduce_frac, other.reduce_frac);
      cost.segment_latency = std::max(cost.segment_latency, other.segment_latency);
      cost.fill_per_byte = std::max(cost.fill_per_byte, other.fill_per_byte);
      cost.approximate = cost.approximate || other.approximate;
    }
  cache_.emplace(key, cost);
  return cost;
}

// The most flows (transfers over all copies and steps) full-detail mode builds for one collective: ~14 s and ~1.2 GB
// here (16.8 million, an all-to-all over 4,096 accelerators, took 58 s and 5.2 GB).
constexpr double kMaxFullFlows = 4e6;

double CollectiveModel::time_full(Collective c, Algorithm a, const Group& g, double n) {
  if (a == Algorithm::kAuto) a = profile(c, a, g, n).algorithm;
  const long long block = g.size * g.stride;
  if (topo_.gpus() % block != 0)
    throw InvalidArgument(fmt::format("full-detail mode: groups of {} ranks with stride {} do not tile {} accelerators",
                                      g.size, g.stride, topo_.gpus()));
  // Every copy's every transfer becomes a flow: bounded before they are built (an all-to-all over 4,096 accelerators
  // took 58 s and 5.2 GB, over 8,192 it ran out of memory).
  const std::vector<Step> one = make_pattern(topo_, c, a, g);
  // Nothing to move costs nothing, as CollectiveCost::time(0) (the group and algorithm still checked above; full
  // detail charged each step's latencies and overheads for n = 0).
  if (n <= 0) return 0.0;
  {
    double transfers = 0;
    for (const Step& s : one) transfers += static_cast<double>(s.transfers.size());
    const double flows = transfers * static_cast<double>(topo_.gpus() / block) * static_cast<double>(g.stride);
    if (flows > kMaxFullFlows)
      throw UnsupportedError(fmt::format(
          "full-detail mode: {} of {} ranks (stride {}) on {} accelerators is {:.3g} flows, over its budget of {:.3g}; "
          "use symmetric mode, which times the group's placements without them",
          algorithm_name(a), g.size, g.stride, topo_.gpus(), flows, kMaxFullFlows));
  }
  std::vector<std::vector<Step>> all = group_copies(c, a, g, &one);
  // Steps run in lock step across the copies: copies whose patterns differ (a hierarchical pattern splits where a
  // copy's nodes are, and a copy on part of a node falls back to a flat ring) have no common steps to share links
  // in. (Step si of the first copy was taken from every copy: a shorter one was read past its end.)
  for (const auto& pat : all) {
    if (!same_steps(pat, all.front()))
      throw UnsupportedError(fmt::format(
          "full-detail mode: the copies of this group of {} ranks (stride {}) run different {} patterns ({} steps "
          "and {}), which it cannot time in lock step; use symmetric mode, which times each placement",
          g.size, g.stride, algorithm_name(a), all.front().size(), pat.size()));
  }
  std::vector<double> cap(topo_.num_links());
  for (size_t i = 0; i < cap.size(); ++i) cap[i] = topo_.link(i).bandwidth;
  const double overhead = topo_.spec().network.software_overhead;
  const double gamma = 1.0 / topo_.spec().network.reduction_bandwidth;
  double total = 0;
  for (size_t si = 0; si < all.front().size(); ++si) {
    std::vector<Flow> flows;
    double max_lat = 0;
    const Step& s0 = all.front()[si];
    for (const auto& pat : all) {
      const Step& s = pat[si];
      for (const Transfer& t : s.transfers) {
        Flow f;
        f.latency = route_transfer(topo_, t, f.path);
        f.bytes = t.frac * n;
        max_lat = std::max(max_lat, f.latency);
        flows.push_back(std::move(f));
      }
    }
    FlowResult r = simulate_flows(flows, cap);
    double step = r.makespan + overhead + (s0.latency_hops - 1) * (max_lat + overhead) + s0.reduce * n * gamma;
    total += s0.repeat * step;
  }
  // (a chain's segments and fill, as symmetric mode's)
  return total + profile(c, a, g, n).segmentation(n);
}

}  // namespace conduit::sim
