#include "sim/topology.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace conduit::sim {

const char* link_kind_name(LinkKind k) {
  switch (k) {
    case LinkKind::kGpuOut:
      return "gpu-out";
    case LinkKind::kGpuIn:
      return "gpu-in";
    case LinkKind::kNicOut:
      return "nic-out";
    case LinkKind::kNicIn:
      return "nic-in";
    case LinkKind::kLeafUp:
      return "leaf-up";
    case LinkKind::kLeafDown:
      return "leaf-down";
    case LinkKind::kTorus:
      return "torus";
  }
  return "?";
}

Topology::Topology(const ClusterSpec& spec, long long gpus) : spec_(spec), gpus_(gpus) {
  if (spec_.node_kinds.empty()) throw ConfigError("cluster: no node kinds");
  gpn_ = spec_.node_kinds.front().gpus;
  if (gpus < 1) throw ConfigError(fmt::format("--gpus = {} must be at least 1", gpus));
  if (spec_.network.topology == TopologyKind::kTorus &&
      (spec_.network.torus_dims.empty() || spec_.network.torus_dims.size() > 3))
    throw ConfigError(fmt::format("cluster '{}': a torus has 1 to 3 dimensions (torus_dims), not {}", spec_.name,
                                  spec_.network.torus_dims.size()));
  // (the limit first: 99999999999 was told to be a multiple of 8)
  if (gpus > kMaxSimulatedGpus)
    throw ConfigError(
        fmt::format("--gpus = {} is beyond the simulator's limit of {} accelerators", gpus, kMaxSimulatedGpus));
  if (gpus % gpn_ != 0)
    throw ConfigError(fmt::format("--gpus = {} must be a multiple of the {} accelerators per node of cluster '{}'",
                                  gpus, gpn_, spec_.name));
  nodes_ = gpus / gpn_;
  // Node kinds: a homogeneous cluster repeats its one kind; a heterogeneous one is scaled to `nodes_` keeping
  // the kinds' proportions (largest remainder), kinds laid out in the order the file lists them.
  node_kind_.resize(nodes_);
  if (spec_.node_kinds.size() == 1) {
    std::fill(node_kind_.begin(), node_kind_.end(), 0);
  } else {
    long long total = 0;
    for (const auto& k : spec_.node_kinds) total += k.count;
    std::vector<long long> share(spec_.node_kinds.size());
    std::vector<std::pair<double, size_t>> rem;
    long long assigned = 0;
    for (size_t i = 0; i < share.size(); ++i) {
      double exact = static_cast<double>(spec_.node_kinds[i].count) * nodes_ / total;
      share[i] = static_cast<long long>(std::floor(exact));
      assigned += share[i];
      rem.push_back({exact - share[i], i});
    }
    std::sort(rem.begin(), rem.end(),
              [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    for (size_t j = 0; assigned < nodes_; ++j, ++assigned) share[rem[j % rem.size()].second]++;
    long long pos = 0;
    for (size_t i = 0; i < share.size(); ++i)
      for (long long j = 0; j < share[i]; ++j) node_kind_[pos++] = static_cast<uint16_t>(i);
  }
  kind_counts_.assign(spec_.node_kinds.size(), 0);
  for (uint16_t k : node_kind_) kind_counts_[k]++;
  for (const auto& k : spec_.node_kinds) max_nics_ = std::max(max_nics_, k.nics);
  const NetworkSpec& net = spec_.network;
  const bool rail = net.topology == TopologyKind::kRailOptimized;
  long long pods = (nodes_ + net.nodes_per_leaf - 1) / net.nodes_per_leaf;
  leaves_ = rail ? pods * max_nics_ : pods;
  if (net.topology == TopologyKind::kTorus) {
    long long cap = 1;
    for (int d : net.torus_dims) cap *= d;
    if (cap != nodes_)
      throw ConfigError(
          fmt::format("network.torus_dims hold {} nodes but --gpus = {} needs {} nodes", cap, gpus, nodes_));
  }

  links_.reserve(2 * gpus_ + 2 * nodes_ * max_nics_ + 2 * leaves_);
  behind_.reserve(links_.capacity());
  for (int dir = 0; dir < 2; ++dir) {
    for (long long g = 0; g < gpus_; ++g) {
      const NodeKind& k = kind_of_gpu(g);
      links_.push_back({k.intra.bandwidth, k.intra.latency, dir == 0 ? LinkKind::kGpuOut : LinkKind::kGpuIn});
      behind_.push_back(1);
    }
  }
  nic_base_ = static_cast<long long>(links_.size());
  for (int dir = 0; dir < 2; ++dir) {
    for (long long n = 0; n < nodes_; ++n) {
      const NodeKind& k = kind_of_node(n);
      for (int i = 0; i < max_nics_; ++i) {
        double bw = i < k.nics ? k.nic.bandwidth : 0.0;
        links_.push_back({bw, k.nic.latency, dir == 0 ? LinkKind::kNicOut : LinkKind::kNicIn});
        behind_.push_back(k.gpus / k.nics);
      }
    }
  }
  leaf_base_ = static_cast<long long>(links_.size());
  // A leaf's uplink is its switch's: the NIC bandwidth of the nodes_per_leaf nodes it serves over the
  // oversubscription, never more than the NICs attached can send. A part-full leaf (the last, when the nodes do not
  // fill it) keeps its switch's uplinks: it was given its attached NICs' share of them, so one node on a 3:1 leaf
  // crossed the spine at a third of its NIC (each missing node counted at the attached nodes' mean).
  std::vector<double> leaf_nic(leaves_, 0.0);
  std::vector<long long> leaf_gpus(leaves_, 0), leaf_pod(leaves_, 0);
  for (long long n = 0; n < nodes_; ++n) {
    const NodeKind& k = kind_of_node(n);
    for (int i = 0; i < k.nics; ++i) {
      long long l = leaf_of(n, i);
      leaf_nic[l] += k.nic.bandwidth;
      leaf_gpus[l] += k.gpus / k.nics;
      leaf_pod[l] = n / net.nodes_per_leaf;
    }
  }
  std::vector<double> leaf_cap(leaves_, 0.0);
  for (long long l = 0; l < leaves_; ++l) {
    // (the pod's nodes, not the NICs on this leaf: a full pod's upper rails, which nodes with fewer NICs leave
    // short, keep the share they had)
    const long long in_pod = std::min<long long>(net.nodes_per_leaf, nodes_ - leaf_pod[l] * net.nodes_per_leaf);
    const double fill = net.uplink_share_of_attached ? 1.0 : static_cast<double>(net.nodes_per_leaf) / in_pod;
    leaf_cap[l] = std::min(leaf_nic[l], leaf_nic[l] * fill / net.oversubscription);
  }
  for (int dir = 0; dir < 2; ++dir) {
    for (long long l = 0; l < leaves_; ++l) {
      links_.push_back({leaf_cap[l], net.switch_latency * 2, dir == 0 ? LinkKind::kLeafUp : LinkKind::kLeafDown});
      behind_.push_back(leaf_gpus[l]);
    }
  }
  torus_base_ = static_cast<long long>(links_.size());
  if (net.topology == TopologyKind::kTorus) {
    for (long long n = 0; n < nodes_; ++n)
      for (size_t d = 0; d < net.torus_dims.size(); ++d)
        for (int dir = 0; dir < 2; ++dir) {
          links_.push_back({net.torus_link.bandwidth, net.torus_link.latency, LinkKind::kTorus});
          behind_.push_back(gpn_);
        }
  }
}

long long Topology::leaf_of(long long node, int nic) const {
  long long pod = node / spec_.network.nodes_per_leaf;
  return spec_.network.topology == TopologyKind::kRailOptimized ? pod * max_nics_ + nic : pod;
}

double Topology::route_torus(long long ns, long long nd, std::vector<int>& path) const {
  // Dimension-ordered: along dimension 0 the shorter way round, then 1, then 2; at exactly half way round, + from an
  // even coordinate and - from an odd one, so a shift by n/2 uses both directions' links (ties all went +, and the
  // - links sat idle: twice the time). At most three dimensions (the cluster file's check), so no allocation per
  // call: this runs for every transfer of every copy of a group.
  const auto& dims = spec_.network.torus_dims;
  const size_t nd_dims = dims.size();
  long long cs[3] = {0, 0, 0}, cd[3] = {0, 0, 0}, mul[3] = {1, 1, 1};
  long long a = ns, b = nd;
  for (size_t d = 0; d < nd_dims; ++d) {
    cs[d] = a % dims[d];
    cd[d] = b % dims[d];
    a /= dims[d];
    b /= dims[d];
    if (d > 0) mul[d] = mul[d - 1] * dims[d - 1];
  }
  double lat = 0;
  long long id = ns;
  for (size_t d = 0; d < nd_dims; ++d) {
    const long long n = dims[d];
    const long long fwd = ((cd[d] - cs[d]) % n + n) % n;
    const int dir = fwd < n - fwd || (fwd == n - fwd && cs[d] % 2 == 0) ? 0 : 1;
    const long long hops = dir == 0 ? fwd : n - fwd;
    long long c = cs[d];
    for (long long h = 0; h < hops; ++h) {
      path.push_back(
          static_cast<int>(torus_base_ + (id * static_cast<long long>(nd_dims) + static_cast<long long>(d)) * 2 + dir));
      lat += spec_.network.torus_link.latency;
      const long long next = dir == 0 ? (c + 1) % n : (c + n - 1) % n;
      id += (next - c) * mul[d];
      c = next;
    }
  }
  return lat;
}

double Topology::route(long long src, long long dst, std::vector<int>& path) const {
  const long long ns = node_of(src), nd = node_of(dst);
  const NodeKind& ks = kind_of_node(ns);
  const NodeKind& kd = kind_of_node(nd);
  if (ns == nd) {
    path.push_back(gpu_out(src));
    path.push_back(gpu_in(dst));
    return ks.intra.latency;
  }
  const NetworkSpec& net = spec_.network;
  if (net.topology == TopologyKind::kFlat) {  // every node's NICs straight to every other's: each GPU's own NIC
    path.push_back(nic_out(ns, nic_of_local(local_of(src), ks)));
    path.push_back(nic_in(nd, nic_of_local(local_of(dst), kd)));
    return ks.nic.latency;
  }
  if (net.topology == TopologyKind::kTorus) return route_torus(ns, nd, path);
  double lat = 0;
  int nic_s = nic_of_local(local_of(src), ks);
  int nic_d = nic_of_local(local_of(dst), kd);
  if (proxy_between(nic_s, nic_d, ks)) {
    // PXN: hop over NVLink to a GPU of the source node that sits on the destination's rail, the one at the source's
    // own place among its NIC's GPUs (always the rail's first GPU made the GPUs sharing a NIC send through one
    // proxy, whose port symmetric mode counted once: 2x off full detail with 2 GPUs a NIC and a slow intra link).
    const long long per_nic = std::max(1, ks.gpus / ks.nics);
    long long proxy = ns * gpn_ + static_cast<long long>(nic_d) * per_nic + local_of(src) % per_nic;
    if (proxy != src) {
      path.push_back(gpu_out(src));
      path.push_back(gpu_in(proxy));
      lat += ks.intra.latency;
    }
    nic_s = nic_d;
  }
  path.push_back(nic_out(ns, nic_s));
  lat += ks.nic.latency + net.switch_latency;
  long long ls = leaf_of(ns, nic_s), ld = leaf_of(nd, nic_d);
  if (ls != ld) {
    path.push_back(leaf_up(ls));
    path.push_back(leaf_down(ld));
    lat += 2 * net.switch_latency;
  }
  path.push_back(nic_in(nd, nic_d));
  return lat;
}

bool Topology::via_proxy(long long src, long long dst) const {
  const long long ns = node_of(src);
  if (ns == node_of(dst)) return false;
  return proxy_between(nic_of(src), nic_of(dst), kind_of_node(ns));
}

void Topology::links_behind(long long gpu, std::vector<int>& out) const {
  out.push_back(gpu_out(gpu));
  out.push_back(gpu_in(gpu));
  if (spec_.network.topology == TopologyKind::kTorus) {
    // A node's torus links carry the traffic of the node's accelerators.
    const long long node = node_of(gpu);
    const size_t dims = spec_.network.torus_dims.size();
    for (size_t d = 0; d < dims; ++d)
      for (int dir = 0; dir < 2; ++dir) out.push_back(static_cast<int>(torus_base_ + (node * dims + d) * 2 + dir));
    return;
  }
  long long n = node_of(gpu);
  const NodeKind& k = kind_of_node(n);
  int nic = nic_of_local(local_of(gpu), k);
  out.push_back(nic_out(n, nic));
  out.push_back(nic_in(n, nic));
  if (spec_.network.topology == TopologyKind::kFlat) return;
  long long l = leaf_of(n, nic);
  out.push_back(leaf_up(l));
  out.push_back(leaf_down(l));
}

}  // namespace conduit::sim
