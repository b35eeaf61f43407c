// Hierarchical two-level allreduce (intra-host, inter-host, intra-host), for L ranks on each of H hosts.
//   1. reduce-scatter inside each host (ring over the fast local links): local rank i owns 1/L of the vector;
//   2. allreduce of that 1/L across hosts among the ranks with the same local index (L concurrent allreduces, one per
//      local rank, so every NIC is busy; each runs the tuner's pick for n/L bytes among H ranks, a ring for large
//      vectors);
//   3. allgather inside each host.
//   time ≈ (L-1)α_l + (L-1)/L·n(β_l+γ) + cross + (L-1)α_l + (L-1)/L·nβ_l, cross the picked algorithm's time on the
//   inter-host link (a ring: 2(H-1)α_x + 2(H-1)/H·(n/L)β_x + (H-1)/H·(n/L)γ).
//   The inter-host bytes per rank drop L-fold compared with a flat ring.
// Hosts with different rank counts: reduce to each host's leader, allreduce among leaders, broadcast inside hosts.
#include "coll/algorithms.h"

namespace conduit::coll {

void hier_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op) {
  if (c.size() == 1 || count == 0) return;
  auto& g = c.comm().host_groups();
  const Deadline& d = c.deadline();
  if (g.uniform && g.cross) {
    const int L = g.local->size();
    Blocks lb(count, L);
    char* w = static_cast<char*>(buf);
    const size_t esz = dtype_size(dt);
    g.local->run_reduce_scatter(d, w, nullptr, lb.count, dt, op, "ring", true);
    const int i = g.local->rank();
    std::string cross_algo = g.cross->tuner().choose(CollOp::allreduce, lb.count[i] * esz, g.cross->size(),
                                                     g.cross->num_hosts(), false);
    if (cross_algo == "hier") cross_algo = "ring";
    g.cross->run_allreduce(d, w + lb.offset[i] * esz, lb.count[i], dt, op, cross_algo);
    g.local->run_allgatherv(d, nullptr, w, lb.count, dt, "ring");
    return;
  }
  g.local->run_reduce(d, buf, buf, count, dt, op, 0, "tree");
  if (g.leaders) g.leaders->run_allreduce(d, buf, count, dt, op, "ring");
  g.local->run_broadcast(d, buf, count, dt, 0, "tree");
}

}  // namespace conduit::coll
