#pragma once
// Compressed collectives: each compressor's payloads travel by the collective that suits it.
//
//   allreduce      linear payloads (none, fp16, bf16, randk): allreduce the payload as its linear dtype (sum),
//                  then decode once.                        bytes per rank: one payload through the allreduce
//   allgather      non-linear payloads: allgatherv the payloads (sizes exchanged first when they vary), decode
//                  each and sum in rank order (identical on every rank).
//                                                            bytes per rank: (W-1) payloads received
//   majority_vote  1-bit signs, allgathered; out_i = sign(sum_r s_ri) in {-1, 0, +1} (0 on a tie).
//   powersgd       allreduce P, orthonormalise, allreduce Q (see powersgd.h); the batched form packs every
//                  tensor's P (and the raw tensors) in one allreduce and every Q in a second.
//
// The quantized ring (Alistarh-style re-quantization, as in e.g. "ring allreduce with compression"): a ring
// reduce-scatter whose partial sums are re-encoded (fp16, bf16, int8 or uint8 per 256-element chunk) at every hop,
// so a large tensor is never allgathered: rank r sends chunk (r-s-1) mod W at step s and adds the decoded chunk
// (r-s-2) mod W it receives: 2(W-1) messages per rank, each of codec_bytes(d/W). The allreduce then circulates
// each owner's encoded final chunk (encoded once, forwarded unchanged), so every rank ends bit-identical.
// Its messages use the communicator's transport directly with user tags 0xFFF00000 and above (reserved), so run one
// quantized ring at a time per communicator (like any collective, in the same order on every rank).
//
// Everything works on any Communicator (sub-communicators from split included) and on every transport.
#include <span>
#include <string>
#include <vector>

#include "coll/communicator.h"
#include "compress/compressor.h"

namespace conduit::compress {

struct ReduceOptions {
  bool average = false;  // divide by the number of ranks (majority vote ignores it)
  // One deadline for the whole call, each inner collective (PowerSGD's allreduces, the tensors of
  // compressed_allreduce_many, the ring's hops) given what is left; 0: the communicator's timeout. Negative, nan or
  // positive under 0.001 s: InvalidArgument, as coll::checked_timeout refuses the communicator's own.
  double timeout_s = 0;
  // When set, the allgathered methods add the payload bytes this rank received (the other ranks' payloads, whose
  // sizes differ for threshold and DGC); the allreduced ones add nothing (their traffic follows from the payload).
  uint64_t* received = nullptr;
  // When set, the allgathered methods add the payload bytes this rank sent (as the allgather that ran forwards
  // them: the ring every payload but its successor's); the allreduced ones add nothing.
  uint64_t* sent = nullptr;
};

// check_finite_input for a compressed exchange over `comm`: a refusal aborts the communicator's transport first, so
// the other ranks, already waiting in the exchange, fail at once with this reason instead of at their deadline.
void check_finite_or_abort(coll::Communicator& comm, std::span<const float> in, const std::string& compressor,
                           const char* what);

// Replaces `data` (this rank's tensor) by the combination of every rank's compressed tensor; returns the payload
// bytes this rank contributed. When it throws, error feedback's state is as follows: a compressor that refuses its
// input (ErrorFeedback around any method) leaves the residual as it was, so the same gradient may be passed again;
// PowerSGD folds the gradient into its residual before the exchange, so after a refused exchange (factor sums
// beyond the wire's range, on every rank alike) the residual holds it, as for a step that sent nothing: go on with
// the next gradient, not this one again. (A transport failure ends the communicator either way.)
size_t compressed_allreduce(coll::Communicator& comm, const Compressor& c, TensorState& st, std::span<float> data,
                            const ReduceOptions& o = {});
// Many tensors; for PowerSGD this is the batched variant (two allreduces in all), else one call per tensor.
size_t compressed_allreduce_many(coll::Communicator& comm, const Compressor& c, const std::vector<TensorState*>& states,
                                 const std::vector<std::span<float>>& data, const ReduceOptions& o = {});

// Majority vote over `n` sign payloads of ceil(d/8) bytes each, laid end to end.
void majority_vote(std::span<const uint8_t> payloads, int n, std::span<float> out);

// Element range [offset, offset+count) of chunk c when d elements are split over n ranks (first d%n get one more).
struct Chunk {
  size_t offset = 0, count = 0;
};
Chunk ring_chunk(size_t d, int n, int c);
// Codecs of the quantized ring: none (f32), fp16, bf16, int8, uint8 (256 elements per scale).
CompressorPtr make_ring_codec(const std::string& name);
const char* ring_codecs_allowed();
// out = this rank's chunk (ring_chunk(in.size(), W, rank)) of the sum, re-encoded at each hop.
void quantized_ring_reduce_scatter(coll::Communicator& comm, std::span<const float> in, std::span<float> out,
                                   const std::string& codec, const ReduceOptions& o = {});
void quantized_ring_allreduce(coll::Communicator& comm, std::span<float> data, const std::string& codec,
                              const ReduceOptions& o = {});

// The int8 (or int4) reduce-scatter by all-to-all (ZeRO++'s quantized gradients, qgZ): out = this rank's slice of
// the sum of every rank's `in`, the slices laid in rank order with `counts` elements each. Every contribution is
// rounded once to blocks of `bits` 8 or 4 (kIntBlock elements, a f32 scale each: quantize_block_int) and sent
// straight to the rank that sums it, which adds the decoded parts and its own exact slice in rank order (the same
// result however the messages arrive). Each rank sends (W-1)/W of its input in those blocks, about 0.254x a f32
// reduce-scatter's bytes at 8 bits (0.129x at 4), and
// nothing is re-quantized on the way, as a ring's partial sums would be at every hop. Over several hosts, some holding
// several ranks (IntReduceGroups::hierarchical), it goes in two hops, as ZeRO++'s hierarchical all-to-all: a host's
// K ranks first sum each other's parts (on the host's own links), each rank for its own slice and a K-th share of
// the other hosts' ranks' slices, then each partial sum goes, re-quantized once, to its owner on the other hosts:
// 1/K of what a flat all-to-all sends across a host of K, for one more rounding. Hosts of K ranks each share out
// the other hosts' slices by their owners' local index (ZeRO++'s), and the partial sums cross among the ranks of a
// local index (IntReduceGroups::cross); hosts of different counts share them out in turn (the owners' positions
// host by host, modulo K) and the partial sums cross over the whole communicator (an all-to-all whose other
// messages are empty). A non-finite element arrives non-finite (NaN for every
// element of a block another rank rounded; the owner's own part as it was): passed on, as a float wire passes it,
// not refused as the other int8 exchanges refuse it. Returns the bytes this rank sent; ReduceOptions::received adds the
// bytes it received.
// With `residual` (error feedback; as long as `in`, zeros at first, kept by the caller between calls): each call adds
// it to `in` first and leaves in it what this call's rounding took off what this rank sent: in each part it sent in
// the first hop, and in the partial sums it sent across in the second (DeepSpeed's compressed allreduce keeps such a
// worker and server error); zero where nothing of this rank's was rounded (its own slice, the parts it summed). The
// sum over calls of every owner's result then differs from the exact one by what the residuals hold at the end, not by
// a rounding a call. Non-finite errors are dropped (zero), not carried into later calls: a block holding a non-finite
// element decodes to NaN, so the errors of its whole block go.
inline constexpr size_t kIntBlock = 256;
struct IntReduceGroups {
  coll::CommPtr local;  // this rank's host's ranks (null: one hop over the whole communicator)
  // Hosts of equal counts: the ranks of this rank's local index, one a host, in host order (hop 2 among them); null
  // otherwise (hop 2 over the whole communicator).
  coll::CommPtr cross;
  // sums[j]: the communicator's ranks whose slices this host's local rank j sums in hop 1, in host order (hosts by
  // their first rank), then by local index: rank j's own and its share of the other hosts' ranks.
  std::vector<std::vector<int>> sums;
  // from[g]: the rank of host g that sends it this rank's slice's partial sum in hop 2 (this rank on its own host).
  std::vector<int> from;
  bool hierarchical() const { return local != nullptr; }
};
// Collective when the hierarchy applies (two splits; every rank computes the same from the host map).
IntReduceGroups int_reduce_groups(coll::Communicator& comm);
// `bounds` (ascending offsets into `in`): where a block must start, besides each slice's first element. Tensor
// parallelism passes its parameters' starts, so that a replicated parameter, equal on the ranks of a tensor-parallel
// group, never shares a block (its scale) with a split one, different on each: its rounding stays alike.
uint64_t int_reduce_scatter(coll::Communicator& comm, const IntReduceGroups& groups, std::span<const float> in,
                            const std::vector<size_t>& counts, std::span<float> out, int bits = 8,
                            const ReduceOptions& o = {}, std::span<float> residual = {},
                            std::span<const size_t> bounds = {});

}  // namespace conduit::compress
