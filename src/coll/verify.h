#pragma once
// Runs one collective on deterministic per-rank data and counts the elements that differ from a simple reference
// computed locally in double precision. Used by the test suite (every op, algorithm, dtype and count), by
// `conduit selftest` over real processes, and by `conduit bench coll` for its #wrong column.
#include <cstddef>
#include <string>

#include "coll/communicator.h"

namespace conduit::coll {

struct VerifyCase {
  std::string op;         // allreduce, reduce_scatter, reduce_scatterv, allgather, allgatherv, broadcast, reduce,
                          // gather, scatter, alltoall, alltoallv, barrier, sendrecv (the v forms: uneven blocks)
  std::string algorithm;  // empty: tuner
  DType dtype = DType::f32;
  ReduceOp reduce = ReduceOp::sum;
  size_t count = 0;       // elements per rank (per block for gather-like ops)
  int root = 0;
  double timeout_s = 0;
  bool blocking = false;  // CollOptions::blocking (its default): a benchmark checks the path it timed
  bool in_place = false;  // reduce only: the root passes its input as the output (out == in, communicator.h)
};

const char* verify_ops_allowed();
// Returns the number of wrong elements on this rank (0 when correct). Throws on communication errors.
size_t run_and_verify(Communicator& c, const VerifyCase& vc);
// The input of element i on rank `rank` (exposed for tests of the pattern itself).
double verify_input(int rank, size_t i, DType t, ReduceOp op);

}  // namespace conduit::coll
