#pragma once
// The collective algorithms. Each runs synchronously in a Ctx (the communicator's worker thread) over group
// ranks; each file starts with a comment block giving its steps, messages, bytes on the wire and cost.
// Reductions here treat avg as sum; the caller divides once at the end.
#include <cstddef>
#include <vector>

#include "coll/communicator.h"

namespace conduit::coll {

// Splits `count` elements into `parts` near-equal blocks: counts and offsets (elements).
struct Blocks {
  std::vector<size_t> count, offset;
  explicit Blocks(const std::vector<size_t>& counts);
  Blocks(size_t total, int parts);
  size_t total() const { return offset.empty() ? 0 : offset.back() + count.back(); }
};

size_t ring_segment_bytes();  // CONDUIT_RING_SEGMENT_BYTES, default 1 MiB

// world.cc: ping-pong between group ranks a and b on a control tag (the start-up measurement); one-way seconds for
// `bytes`: a warm-up round trip (unless warm_up is false), then `iters` timed ones, or with a budget_s > 0 (and
// bytes > 0) fewer once they would take longer than it (two at least), rank a deciding and telling b. Exposed for
// tests.
double ping_pong(Communicator& c, int a, int b, size_t bytes, int iters, const Deadline& d, double budget_s = 0,
                 bool warm_up = true);
// world.cc: the start-up measurement of the cost model (alpha and beta of an intra-host and an inter-host pair of
// rank 0's, gamma on rank 0), given to every rank's tuner; `start_up_s` bounds it (and at most 60 s). Every rank
// calls it. Exposed for tests.
void measure_cost_model(Communicator& c, double start_up_s);

// ring.cc
void ring_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op);
// Reduce-scatter in place on `work` (sum(counts) elements); block r ends reduced at rank r.
void ring_reduce_scatter_inplace(Ctx& c, char* work, const Blocks& b, DType dt, ReduceOp op);
// Allgather in place: block r of `buf` is this rank's; the others are filled.
void ring_allgather_inplace(Ctx& c, char* buf, const Blocks& b, size_t esz);

// halving_doubling.cc
void rhd_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op);
void rd_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op);
void rh_reduce_scatter_inplace(Ctx& c, char* work, const Blocks& b, DType dt, ReduceOp op);
void rd_allgather_inplace(Ctx& c, char* buf, const Blocks& b, size_t esz);

// tree.cc
void tree_broadcast(Ctx& c, void* buf, size_t bytes, int root);
void chain_broadcast(Ctx& c, void* buf, size_t bytes, int root);
// Reduces `work` (count elements, clobbered on non-roots) to the root.
void tree_reduce_inplace(Ctx& c, void* work, size_t count, DType dt, ReduceOp op, int root);
void tree_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op);
void linear_gather(Ctx& c, const void* in, void* out, size_t bytes, int root);
void linear_scatter(Ctx& c, const void* in, void* out, size_t bytes, int root);

// hierarchical.cc
void hier_allreduce(Ctx& c, void* buf, size_t count, DType dt, ReduceOp op);

// alltoall.cc
void pairwise_alltoallv(Ctx& c, const char* in, const std::vector<size_t>& send_bytes, char* out,
                        const std::vector<size_t>& recv_bytes);
void dissemination_barrier(Ctx& c);

}  // namespace conduit::coll
