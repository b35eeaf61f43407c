#pragma once
// A cluster instantiated for a number of accelerators: every link (GPU<->NVSwitch/PCIe ports, NIC ports, leaf
// uplinks to the spine, torus links) with its bandwidth and latency, and the route between any two accelerators.
//
// Routing:
//   same node        GPU out port -> GPU in port (NVSwitch / PCIe switch; full bandwidth between any pair)
//   fat-tree         [GPU's NIC out] -> (leaf up -> spine -> leaf down, when the leaves differ) -> [NIC in]
//   rail-optimized   as fat-tree, but NIC r of every node of a pod hangs off rail switch r; traffic for another
//                    rail first crosses NVLink to the GPU on that rail (NCCL's PXN), then stays on the rail
//   torus            dimension-ordered shortest path over node-to-node links
//   flat             every accelerator has one out and one in link; nothing else (closed-form checks)
// A leaf's uplink aggregates its spine ports: capacity = sum of its NIC bandwidth / oversubscription; a part-full
// leaf's (its pod holds fewer than nodes_per_leaf nodes) is scaled up to its switch's, at most its NICs' bandwidth.
#include <cstdint>
#include <string>
#include <vector>

#include "sim/cluster.h"

namespace conduit::sim {

// The largest cluster the simulator takes (--gpus): 2^18, 2.6x the 100k-accelerator target. One data-parallel step
// of it simulates in ~4 s and 0.7 GB here; a million accelerators took minutes and gigabytes.
constexpr long long kMaxSimulatedGpus = 1LL << 18;

enum class LinkKind : uint8_t { kGpuOut, kGpuIn, kNicOut, kNicIn, kLeafUp, kLeafDown, kTorus };
const char* link_kind_name(LinkKind k);

struct Link {
  double bandwidth;
  double latency;
  LinkKind kind;
};

class Topology {
 public:
  Topology(const ClusterSpec& spec, long long gpus);

  const ClusterSpec& spec() const { return spec_; }
  long long gpus() const { return gpus_; }
  long long nodes() const { return nodes_; }
  int gpus_per_node() const { return gpn_; }
  long long node_of(long long gpu) const { return gpu / gpn_; }
  int local_of(long long gpu) const { return static_cast<int>(gpu % gpn_); }
  const NodeKind& kind_of_node(long long node) const { return spec_.node_kinds[node_kind_[node]]; }
  const NodeKind& kind_of_gpu(long long gpu) const { return kind_of_node(node_of(gpu)); }
  long long leaves() const { return leaves_; }
  // Nodes of each kind (index into spec().node_kinds) in this instance.
  const std::vector<long long>& kind_counts() const { return kind_counts_; }

  size_t num_links() const { return links_.size(); }
  const Link& link(size_t id) const { return links_[id]; }

  // Appends the links from src to dst to `path` (src != dst); returns the path's latency in seconds.
  double route(long long src, long long dst, std::vector<int>& path) const;

  // Links whose traffic is "owned" by one accelerator's side of the network, for symmetric sharing: the
  // accelerator's own ports, its NIC and its leaf. `gpus_behind(l)` counts the accelerators behind link l.
  void links_behind(long long gpu, std::vector<int>& out) const;
  long long gpus_behind(int link) const { return behind_[link]; }
  // The NIC of a node of kind k that its accelerator `local` sends through.
  int nic_of_local(int local, const NodeKind& k) const { return local / (k.gpus / k.nics); }
  int nic_of(long long gpu) const { return nic_of_local(local_of(gpu), kind_of_node(node_of(gpu))); }
  // Whether route(src, dst) leaves the source node through another accelerator's NIC (rail-optimized, the
  // destination on another rail: NCCL's PXN proxy). That proxy's ports and NIC carry traffic no rank behind them
  // owns, which symmetric sharing cannot scale.
  bool via_proxy(long long src, long long dst) const;

 private:
  long long leaf_of(long long node, int nic) const;
  // Between nodes: NIC nic_s of a node of kind ks sends to rail nic_d through a proxy.
  bool proxy_between(int nic_s, int nic_d, const NodeKind& ks) const {
    return spec_.network.topology == TopologyKind::kRailOptimized && nic_s != nic_d && nic_d < ks.nics;
  }
  int gpu_out(long long g) const { return static_cast<int>(g); }
  int gpu_in(long long g) const { return static_cast<int>(gpus_ + g); }
  int nic_out(long long node, int nic) const { return static_cast<int>(nic_base_ + node * max_nics_ + nic); }
  int nic_in(long long node, int nic) const {
    return static_cast<int>(nic_base_ + nodes_ * max_nics_ + node * max_nics_ + nic);
  }
  int leaf_up(long long leaf) const { return static_cast<int>(leaf_base_ + leaf); }
  int leaf_down(long long leaf) const { return static_cast<int>(leaf_base_ + leaves_ + leaf); }
  double route_torus(long long ns, long long nd, std::vector<int>& path) const;

  ClusterSpec spec_;
  long long gpus_ = 0, nodes_ = 0;
  int gpn_ = 1, max_nics_ = 1;
  long long leaves_ = 1;
  long long nic_base_ = 0, leaf_base_ = 0, torus_base_ = 0;
  std::vector<uint16_t> node_kind_;
  std::vector<long long> kind_counts_;
  std::vector<Link> links_;
  std::vector<long long> behind_;
};

}  // namespace conduit::sim
