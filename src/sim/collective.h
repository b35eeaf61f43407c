#pragma once
// Collective cost models mapped onto a topology.
//
// Every algorithm is written as a pattern: a list of steps, each a set of concurrent transfers (source rank,
// destination rank, fraction of the message n), repeated `repeat` times, with `reduce` bytes summed per rank.
// A step costs   latency (path latency + software overhead) + max over links of (bytes on link / bandwidth)
//                + reduced bytes * gamma,
// and a collective costs the sum of its steps. On a flat network (every rank one link of bandwidth 1/beta,
// latency alpha) the patterns reproduce the MPICH closed forms (Thakur, Rabenseifner & Gropp, IJHPCA 2005):
//   ring allreduce               2(p-1)a + 2(p-1)/p nb + (p-1)/p ng
//   Rabenseifner allreduce       2 log p a + 2(p-1)/p nb + (p-1)/p ng            (p a power of two)
//   recursive-doubling allreduce log p (a + nb + ng)
//   ring / recursive-halving reduce-scatter   (p-1)a or log p a, + (p-1)/p nb + (p-1)/p ng
//   ring / recursive-doubling allgather       (p-1)a or log p a, + (p-1)/p nb
//   binomial broadcast           ceil(log p)(a + nb);   binomial reduce  ceil(log p)(a + nb + ng)
//   reduce-scatter-gather reduce (p-1)a + (p-1)/p n(b + g), then ceil(log p)a + (p-1)/p nb into the root
//   chain broadcast (ring)       (p-1+S-1)(a + n/S b), S = ceil(n / segment) (reduce: + (p-1+S-1) n/S g)
//   double binary tree allreduce 2 depth a + 2 nb + ng   (pipelined, NCCL's two complementary trees)
//   in-network aggregation       2a + nb                 (each rank sends n up and receives n down once)
//   hierarchical allreduce       intra ring reduce-scatter, inter allreduce of n/k, intra ring allgather; the
//                                inter phase a ring (hierarchical), halving-doubling (hierarchical-hd: 2 log m
//                                latencies instead of 2(m-1) over m nodes) or a double binary tree (hierarchical-tree)
//
// Two evaluations:
//   symmetric   the representative group (the one holding rank `first`) is routed; a link's load is that group's
//               load times the number of concurrent groups sharing it (accelerators behind the link / the
//               group's ranks behind it). Linear in n (a chain's segments aside), cached: O(group size) once, then O(1)
//               per message size. That count holds while the copies sharing a link load it alike; where they straddle
//               nodes or leaves differently, and on a torus, every copy is routed and the most loaded link taken (up to
//               a bound on the transfers; past it the result is flagged approximate). Each other placement of the group
//               (node kind, rail) is evaluated as well and the slowest kept.
//   full        every concurrent group's transfers are routed and share links max-min fairly (flow.h); exact
//               for any placement, O(total transfers) per step. Used to validate the symmetric mode.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "sim/topology.h"

namespace conduit::sim {

enum class Collective { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kAllToAll, kShift };
enum class Algorithm {
  kAuto,
  kRing,
  kHalvingDoubling,  // Rabenseifner allreduce; recursive halving reduce-scatter; recursive doubling allgather
  kRecursiveDoubling,
  kBinomialTree,
  kDoubleBinaryTree,
  kHierarchical,         // intra-node ring reduce-scatter, inter-node ring allreduce, intra-node ring allgather
  kHierarchicalHd,       // the same with the inter-node phase by halving-doubling (the runtime's tuner may pick it)
  kHierarchicalTree,     // the same with the inter-node allreduce by a double binary tree (as NCCL's tree)
  kInNetwork,            // switch aggregation (SHARP); hierarchical when a group has several ranks per node
  kDirect,               // all-to-all pairwise exchange; pipeline shift
  kReduceScatterGather,  // reduce: a ring reduce-scatter, then every block to the root (the runtime's rsg)
};

const char* collective_name(Collective c);
const char* algorithm_name(Algorithm a);
// ConfigError naming `flag` and the allowed values (--dp-algorithm's error said --algorithm).
Algorithm parse_algorithm(const std::string& s, const std::string& flag = "--algorithm");

// Ranks first + i * stride, i in [0, size).
struct Group {
  long long size = 1;
  long long stride = 1;
  long long first = 0;
};

struct Transfer {
  long long src = 0, dst = 0;  // global accelerator ids
  double frac = 0;             // bytes = frac * n
  int link = -1;               // a fixed link (in-network aggregation), else routed src -> dst
  double latency = -1;         // with a fixed link: the latency of this leg (else the route's)
};

struct Step {
  std::vector<Transfer> transfers;
  double repeat = 1;        // identical steps in a row
  double latency_hops = 1;  // latencies paid per repeat (pipelined algorithms pay their depth once)
  double reduce = 0;        // fraction of n each rank reduces per repeat
  bool chain = false;       // a pipelined chain: its transfers forward segments hop by hop (CollectiveCost::segment)
  std::string phase;        // "reduce-scatter", "inter allreduce", ...
};

// The pattern of one group (global ids). Throws UnsupportedError when the algorithm does not apply.
std::vector<Step> make_pattern(const Topology& topo, Collective c, Algorithm a, const Group& g);

struct CollectiveCost {
  double latency = 0;      // seconds, independent of n
  double per_byte = 0;     // seconds per byte of n on the wire
  double reduce_frac = 0;  // bytes reduced per byte of n (times gamma)
  double gamma = 0;        // seconds per reduced byte
  double steps = 0;        // latencies paid (a pipelined step pays its depth; a chain's further segments not counted)
  std::string bottleneck;  // the link kind that bounds most of the bandwidth term
  bool all_copies_routed = false;  // every concurrent copy's transfers were routed (torus, uneven placements)
  // The copies share links unevenly (they straddle nodes or leaves differently) and were too many to route, or ran
  // different patterns: the time is each placement's own with the shares scaled, which can be well under full
  // detail's (check with full mode).
  bool approximate = false;
  Algorithm algorithm = Algorithm::kRing;
  // A pipelined chain (broadcast and reduce over `ring`, the runtime's chain broadcast) forwards `segment` bytes at
  // a time, each hop waiting for a whole one: on top of the pattern's (p-1) latencies and n at the slowest hop's
  // pace, a latency per further segment and the pipeline's fill, the first segment through every other hop:
  // (p - 1 + S - 1)(alpha + n/S beta) on a flat network, S = ceil(n / segment). 0: no segments.
  double segment = 0;
  double segment_latency = 0;  // seconds per further segment (the slowest hop's latency)
  double fill_per_byte = 0;    // seconds per byte of the first segment: every hop's per-byte time but the slowest's
  double fill_reduce = 0;      // bytes reduced per byte of the first segment on the way (p - 2 for a reduce)
  double time(double n) const {
    if (n <= 0) return 0.0;
    return latency + n * per_byte + n * reduce_frac * gamma + segmentation(n);
  }
  double segmentation(double n) const {
    if (segment <= 0 || n <= 0) return 0.0;
    return (std::ceil(n / segment) - 1) * segment_latency +
           std::min(n, segment) * (fill_per_byte + fill_reduce * gamma);
  }
};

enum class EvalMode { kSymmetric, kFull };

// One step of a pattern as mapped onto the topology (symmetric mode): the links it uses and the one that bounds it.
struct StepReport {
  std::string phase;
  double repeat = 1;
  size_t transfers = 0;  // in the representative group
  size_t links_used = 0;
  std::string bottleneck;  // link kind
  int bottleneck_link = -1;
  double bottleneck_bytes = 0;  // on that link per repeat (all concurrent groups)
  double time = 0;              // per repeat, seconds, for the given n
};

// Caches symmetric profiles per (collective, algorithm, group shape).
class CollectiveModel {
 public:
  explicit CollectiveModel(const Topology& topo) : topo_(topo) {}
  const Topology& topology() const { return topo_; }

  // Symmetric profile (linear in n). kAuto picks the fastest applicable algorithm for `n_hint` bytes.
  CollectiveCost profile(Collective c, Algorithm a, const Group& g, double n_hint = 1e8);
  double time(Collective c, Algorithm a, const Group& g, double n) { return profile(c, a, g, n).time(n); }
  // Full-detail time: every group that tiles the cluster like `g` runs at once, sharing links max-min fairly.
  double time_full(Collective c, Algorithm a, const Group& g, double n);

  // Step by step: which links each step uses and which one bounds it, for message size n, routed as symmetric mode
  // routes (every copy of the group on a torus). On a cluster of several node kinds, the steps of the slowest of the
  // copies profile() evaluates (its first rank in `*copy_first`); profile() keeps each term's largest over those
  // copies, so there the steps' sum may fall short of time() when different copies are slowest in different terms.
  std::vector<StepReport> explain(Collective c, Algorithm a, const Group& g, double n, long long* copy_first = nullptr);

  size_t cache_size() const { return cache_.size(); }

  // The concurrent copies of g that symmetric mode routes: on a torus every copy (as offsets of g's own transfers
  // when the pattern shifts exactly, else built), elsewhere g alone.
  struct CopySet {
    bool route_all = false, shift = false;
    bool approximate = false;  // copies share links unevenly but were not all routed (see CollectiveCost)
    std::vector<std::vector<Step>> patterns;
    std::vector<long long> offsets;
    // With shift, an in-network allreduce's: each copy's aggregation step is built for its ranks (fixed links)
    struct Rebuild {
      const Topology* topo = nullptr;
      Group group;
      long long ranks_per_node = 1;
    } rebuild;
  };

 private:
  // (alone: g's transfers only, each link's load unscaled: a lower bound on every term of profile()'s cost where g's
  // own transfers are among those it routes; see auto_profile())
  CollectiveCost evaluate_symmetric(Collective c, Algorithm a, const Group& g, bool alone = false);
  CollectiveCost auto_profile(Collective c, const Group& g, double n_hint);
  // (*all_routed: whether every concurrent copy was routed, so that no other placement needs its own report)
  std::vector<StepReport> explain_copy(Collective c, Algorithm a, const Group& g, double n, bool* all_routed = nullptr);
  // The first ranks of copies of g placed otherwise than g (and than each other), which profile() and explain()
  // also evaluate: another node kind, another way of straddling nodes and leaves, a part-full leaf (at most 16).
  // Sets *uneven when some copy straddles nodes or leaves otherwise than g (copies then share links unevenly).
  std::set<long long> distinct_copies(const Group& g, bool* uneven = nullptr) const;
  std::vector<std::vector<Step>> group_copies(Collective c, Algorithm a, const Group& g, const std::vector<Step>* have);
  CopySet copy_set(Collective c, Algorithm a, const Group& g, const std::vector<Step>& steps);
  const Topology& topo_;
  std::map<std::tuple<int, int, long long, long long, long long>, CollectiveCost> cache_;
  // evaluated alone (nullopt: the pattern does not apply)
  std::map<std::tuple<int, int, long long, long long, long long>, std::optional<CollectiveCost>> bounds_;
  // Symmetric mode routes every copy of a group whose copies share links unevenly when they make at most this many
  // transfers (over the pattern's distinct steps); beyond it, it approximates (CollectiveCost::approximate).
  static constexpr double kRouteAllTransfers = 1 << 21;
  // (size, stride, -1 or a first off the tiling) -> the copies straddle unevenly
  std::map<std::tuple<long long, long long, long long>, bool> uneven_;
  // A step's latency, bandwidth term (seconds per byte of n) and bounding link kind where every copy of the group was
  // routed as its transfers shifted, per (group, the step's transfers as a 128-bit hash): steps alike in transfers
  // cost alike, and many are (a ring allreduce's reduce-scatter and allgather steps and those of the reduce-scatter
  // and allgather profiles; the halving and doubling steps; a hierarchical pattern's intra-node rings, and its
  // inter-node ring with a rank a node is the plain ring's step).
  struct StepCost {
    double latency = 0, per_byte = 0;
    LinkKind worst = LinkKind::kGpuOut;
  };
  std::map<std::tuple<long long, long long, long long, uint64_t, uint64_t>, StepCost> step_cache_;
  std::vector<double> load_;  // scratch, per link
  std::vector<int> ranks_behind_;
};

// Algorithms worth trying for a collective (the tuner's candidate list).
std::vector<Algorithm> candidate_algorithms(Collective c, const Topology& topo);

}  // namespace conduit::sim
