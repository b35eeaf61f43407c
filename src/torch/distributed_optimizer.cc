// DistributedOptimizer: gradient hooks, buckets, the communication thread, step statistics and trace.
#include "torch/distributed_optimizer.h"

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include "core/clock.h"
#include "core/error.h"
#include "torch/config.h"
#ifdef CONDUIT_WITH_COMPRESS
#include "compress/collectives.h"
#include "compress/compressor.h"
#endif

namespace conduit::train {

namespace {

// Marks the bucket layout after the compressor states in save_compressor_state's bytes ("BKLAYOUT").
constexpr uint64_t kLayoutMagic = 0x54554F59414C4B42ull;

// f32 to a 16-bit wire (f16 or bf16) and back: the gathers', the kept parts' and the reduce-scatter's.
bool is_16bit(DType wire) { return wire == DType::f16 || wire == DType::bf16; }
void narrow16(DType wire, const float* in, void* out, size_t n) {
  (wire == DType::f16 ? convert_f32_to_f16 : convert_f32_to_bf16)(in, static_cast<uint16_t*>(out), n);
}
void widen16(DType wire, const void* in, float* out, size_t n) {
  (wire == DType::f16 ? convert_f16_to_f32 : convert_bf16_to_f32)(static_cast<const uint16_t*>(in), out, n);
}

#ifdef CONDUIT_WITH_COMPRESS
// Forwards to a compressor and puts its compress() and decompress() calls on the timeline (communication thread).
class TracedCompressor : public compress::Compressor {
 public:
  TracedCompressor(const compress::Compressor& inner, Trace* trace) : inner_(inner), trace_(trace) {}
  std::string name() const override { return inner_.name(); }
  compress::Collective collective() const override { return inner_.collective(); }
  DType linear_dtype() const override { return inner_.linear_dtype(); }
  bool fixed_size() const override { return inner_.fixed_size(); }
  size_t wire_bytes(size_t numel, const compress::TensorState& st) const override {
    return inner_.wire_bytes(numel, st);
  }
  bool stateful() const override { return inner_.stateful(); }
  void compress(std::span<const float> in, compress::TensorState& st, compress::Bytes& out) const override {
    const double t0 = now_s();
    inner_.compress(in, st, out);
    trace_->complete("compress", 1, t0, now_s(), {{"elements", in.size()}, {"bytes", out.size()}});
  }
  void decompress(std::span<const uint8_t> payload, const compress::TensorState& st,
                  std::span<float> out) const override {
    const double t0 = now_s();
    inner_.decompress(payload, st, out);
    trace_->complete("decompress", 1, t0, now_s(), {{"elements", out.size()}});
  }
  void decompress_add(std::span<const uint8_t> payload, const compress::TensorState& st,
                      std::span<float> acc) const override {
    const double t0 = now_s();
    inner_.decompress_add(payload, st, acc);
    trace_->complete("decompress", 1, t0, now_s(), {{"elements", acc.size()}});
  }

 private:
  const compress::Compressor& inner_;
  Trace* trace_;
};
#endif

// ZeRO stage 2: after autograd has accumulated a parameter's gradient into .grad (its hook has copied it into the
// bucket already), .grad is dropped, so no full gradient outlives its backward pass.
struct DropGradient : torch::autograd::FunctionPostHook {
  explicit DropGradient(torch::Tensor p) : param(std::move(p)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    param.mutable_grad().reset();
    return outputs;
  }
  torch::Tensor param;
};

}  // namespace

struct DistributedOptimizer::Core {
  struct Bucket {
    std::vector<int> params;      // parameter indices
    std::vector<size_t> offsets;  // element offset of each in flat
    std::vector<float> flat;      // (ZeRO stage 2: empty between its reduce-scatter and the next gradient)
    size_t n = 0;                 // elements
    // ZeRO: where the bucket starts in flat_params, its W slices and this rank's slice (a leaf view of flat_params
    // that the optimizer steps; undefined when the slice is empty) with the averaged gradient in its .grad.
    size_t base = 0;
    std::vector<size_t> counts;
    size_t mine = 0;  // offset of this rank's slice in the bucket
    torch::Tensor shard;
    // ZeRO-3: the unit's whole parameters (its parameters are views of it; its storage holds no data while the unit
    // is released), and the gradients of the current backward pass that have arrived.
    torch::Tensor full;
    bool resident = true;
    bool rounded = false;  // gathered on a narrow wire (gather_wire): its weights rounded, not the slices' own
    size_t pass_got = 0;
    // ZeRO-3 with a secondary partition (sec_comm): the unit cut into its group's K parts, and this rank's part of
    // the weights its last training forward ran, kept from that forward to the unit's backward gather (within the
    // group), then freed.
    std::vector<size_t> sec_counts;
    size_t sec_mine = 0;
    std::vector<uint8_t> secondary;  // (on sec_wire(); one element's zeros for an empty part)
  };

  coll::CommPtr comm;  // the buckets' (split off the caller's with find_unused_parameters)
  DistOptions opt;
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;  // as named_parameters() gives them (indices skip frozen and tied parameters)
  std::vector<size_t> numel;
  std::vector<std::vector<size_t>> shapes;
#ifdef CONDUIT_WITH_COMPRESS
  compress::CompressorPtr compressor;
  std::vector<compress::TensorState> states;
  compress::IntReduceGroups int_groups;  // ZeRO with the int8 wire: over several hosts, the two hops' groups
#endif
  bool compressed = false;
  int zero = 0;
  // ZeRO: the reduce-scatter's element type (fp16 or bf16 halve its bytes; i8: int8 blocks by all-to-all, qgZ)
  DType zero_wire = DType::f32;
  int zero_bits = 8;  // (i8: the int blocks' bits, 8 or 4)
  // (i8 with ef:int8 / ef:int4: error feedback, each parameter's residual in states[i]'s "qgz.residual")
  bool zero_ef = false;
  // ZeRO-3: the training gathers' element type (DistOptions::zero_gather_dtype); whole_parameters() gathers f32.
  DType gather_wire = DType::f32;
  torch::Tensor flat_params;  // ZeRO: every trainable parameter's storage, bucket after bucket
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // ZeRO-2: kept alive, they carry DropGradient
  std::vector<std::vector<float>> spare;  // ZeRO-2: released bucket buffers, reused by the next step's buckets
  // ZeRO-3 (the gathers run on the thread of forward and backward, which alone touches `full` and `resident`).
  coll::CommPtr gather_comm;     // the gathers' own (also ZeRO-1/2's deferred allgathers')
  // ZeRO-3's secondary partition (DistOptions::zero_secondary_ranks, ZeRO++'s hpZ): the group of consecutive ranks
  // the backward gathers run in (null: none).
  coll::CommPtr sec_comm;
  // ZeRO sharded within groups (DistOptions::zero_shard_ranks, stages 1-3): the reduce-scatter's group (this rank's K
  // consecutive ranks; the gathers, and stages 1-2's deferred allgathers, run on a split of their own, gather_comm)
  // and the ranks of this rank's index in every group, over which each slice's gradients are then averaged (null:
  // none).
  coll::CommPtr shard_comm, replica_comm;
  // The communicator a bucket's slices are cut over (its rank owns slice rank()).
  coll::Communicator& slice_comm() const { return shard_comm ? *shard_comm : *comm; }
  // A slice averaged within its group: its average over the groups too (nothing without replicas), on the
  // reduce-scatter's 16-bit wire when it has one (as FSDP's reduce_dtype), else in f32 (after int blocks too: no
  // allreduce re-encodes them).
  void average_replicas(float* slice, size_t len, const coll::CollOptions& co) {
    if (!replica_comm || replica_comm->size() < 2) return;
    if (is_16bit(zero_wire)) {
      std::vector<uint16_t> wire(len);
      narrow16(zero_wire, slice, wire.data(), len);
      replica_comm->allreduce(wire.data(), len, zero_wire, ReduceOp::avg, co).wait();
      widen16(zero_wire, wire.data(), slice, len);
      return;
    }
    replica_comm->allreduce(slice, len, DType::f32, ReduceOp::sum, co).wait();
    const float inv = 1.0f / float(replica_comm->size());
    for (size_t j = 0; j < len; ++j) slice[j] *= inv;
  }
  std::vector<std::vector<uint8_t>> abandoned_secondary;  // send buffers of failed secondary gathers
  std::vector<int> unit_bucket;  // bucket of each unit (-1: no trainable parameter)
  int pinned = 0;                // whole_parameters() handles alive
  double gather_s = 0;           // this step's time blocked in gathers (under mu)
  // Allocations a failed gather's collective may still write into (an aborted transport): kept, not freed (the
  // units' storage, and a narrow gather's staging buffer).
  std::vector<at::DataPtr> abandoned;
  std::vector<std::vector<uint8_t>> abandoned_staged;
  // ZeRO-3's prefetch (DistOptions::zero_prefetch): the one gather started ahead of its unit, in flight on the
  // gathers' communicator's thread while the unit before it computes (bucket -1: none).
  struct Ahead {
    int b = -1;
    coll::Work work;
    double t0 = 0;
    bool counted = false;
    const char* pass = "";
    DType wire = DType::f32;
    std::vector<uint8_t> staged;  // a narrow gather's buffer (widened into the unit at its wait)
    bool secondary = false;       // within the secondary group, from sent (the unit's secondary part)
    std::vector<uint8_t> sent;
  };
  Ahead ahead;
  // ZeRO-1/2 with units and zero_prefetch (defer_slices): the allgather of the stepped slices, started by step() on the
  // gathers' communicator as one allgather per piece (a unit's parameters within one bucket: each rank contributes
  // the part of its slice that falls in it), in the order the next forward needs them, and finished piece by piece as
  // that forward's units begin (unit_needs: each unit's pieces), or by whatever reads the parameters first
  // (synchronize, whole_parameters, ~Core).
  bool defer_slices = false;
  struct Piece {
    int bucket = 0;
    size_t begin = 0, end = 0;   // in the bucket
    std::vector<size_t> counts;  // each rank's part of it (its slice's overlap with [begin, end))
    size_t src = 0;              // where this rank's part starts, in the bucket
    bool on = false;
    coll::Work work;
    double t0 = 0;
  };
  std::vector<Piece> deferred;
  double outside_comm_s = 0;  // under mu: the seconds of deferred pieces finished outside a step
  std::vector<std::vector<int>> unit_needs;
  std::vector<std::vector<int>> unit_params;  // each unit's parameter indices

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Bucket> buckets;
  size_t second_bucket_n = 0;  // the second-largest bucket's elements, set where buckets are built (ZeRO-2's spares)
  std::vector<int> param_bucket;    // bucket of each parameter
  std::vector<int> param_slot;      // position inside its bucket
  std::vector<int> got;             // gradients arrived this step (up to opt.backward_passes)
  std::vector<uint8_t> used;        // find_unused_parameters: which any rank had a gradient for, known at the flush
  std::vector<int> pending;         // gradients still missing per bucket
  std::vector<int> ready;           // backward passes whose gradients have all reached the bucket (0 or 1 unless
                                    // each_pass())
  int next = 0;                     // next task the thread communicates (task t: bucket t % B, backward pass t / B)
  bool flush = false, stop = false, alive = true;
  bool synced = false;  // synchronize() wrote .grad and step() has not run: no gradient may arrive now
  std::exception_ptr error;
  std::vector<int> ready_order;     // parameter order observed during the first step
  bool record_order = true;
  StepStats step;                   // accumulated by the thread for the current step
  std::thread thread;

  void build_buckets(const std::vector<int>& order) {
    buckets.clear();
    param_bucket.assign(params.size(), -1);
    param_slot.assign(params.size(), -1);
    Bucket cur;
    size_t bytes = 0;
    auto close = [&] {
      if (cur.params.empty()) return;
      cur.n = cur.offsets.back() + numel[size_t(cur.params.back())];
      cur.flat.assign(cur.n, 0.f);
      buckets.push_back(std::move(cur));
      cur = Bucket{};
      bytes = 0;
    };
    for (int i : order) {
      size_t cap = buckets.empty() ? opt.first_bucket_bytes : opt.bucket_cap_bytes;
      size_t b = numel[size_t(i)] * sizeof(float);
      if (!cur.params.empty() && bytes + b > cap) close();
      param_bucket[size_t(i)] = int(buckets.size());
      param_slot[size_t(i)] = int(cur.params.size());
      cur.offsets.push_back(cur.params.empty() ? 0 : cur.offsets.back() + numel[size_t(cur.params.back())]);
      cur.params.push_back(i);
      bytes += b;
    }
    close();
    note_second_largest_bucket();
    reset_step_locked();
  }

  // ZeRO-3: one bucket per unit, the last unit's first (the order backward reaches them).
  void build_unit_buckets(const std::vector<std::vector<int>>& units) {
    buckets.clear();
    param_bucket.assign(params.size(), -1);
    param_slot.assign(params.size(), -1);
    unit_bucket.assign(units.size(), -1);
    for (size_t u = units.size(); u-- > 0;) {
      if (units[u].empty()) continue;
      Bucket bk;
      for (int i : units[u]) {
        param_bucket[size_t(i)] = int(buckets.size());
        param_slot[size_t(i)] = int(bk.params.size());
        bk.offsets.push_back(bk.n);
        bk.params.push_back(i);
        bk.n += numel[size_t(i)];
      }
      bk.flat.assign(bk.n, 0.f);
      unit_bucket[u] = int(buckets.size());
      buckets.push_back(std::move(bk));
    }
    note_second_largest_bucket();
    reset_step_locked();
  }

  // ZeRO-3: the unit's storage without data (its allocation freed, or moved into `keep`).
  static void release(Bucket& bk, std::vector<at::DataPtr>* keep = nullptr) {
    if (!bk.resident) return;
    auto* st = bk.full.storage().unsafeGetStorageImpl();
    at::DataPtr old = st->set_data_ptr(at::DataPtr(nullptr, at::Device(at::kCPU)));
    if (keep) keep->push_back(std::move(old));
    st->set_nbytes(0);
    bk.resident = false;
    bk.rounded = false;
  }
  // Bucket b's whole parameters get storage again (released units hold none).
  void allocate(Bucket& bk) {
    if (bk.resident) return;
    const size_t bytes = bk.n * sizeof(float);
    auto* st = bk.full.storage().unsafeGetStorageImpl();
    st->set_data_ptr_noswap(c10::GetCPUAllocator()->allocate(bytes));
    st->set_nbytes(bytes);
    bk.resident = true;
  }
  const float* slice_of(Bucket& bk) {
    static const float dummy = 0;
    return bk.shard.defined() ? bk.shard.data_ptr<float>() : &dummy;
  }
  // Bytes of a part of n elements on a gathers' wire: f32, a 16-bit float, or i8 (blocks of kQuantBlock elements, a
  // f32 scale each, then the elements' int8 values).
  static constexpr size_t kQuantBlock = 256;
  static size_t wire_bytes(DType wire, size_t n) {
    return wire == DType::i8 ? block_i8_bytes(n, kQuantBlock) : n * dtype_size(wire);
  }
  // Where the int wires' blocks must start inside the bucket besides each slice's first element: every parameter's
  // start with opt.blocks_per_parameter (ascending), else nowhere.
  std::vector<size_t> block_bounds(const Bucket& bk) const {
    if (!opt.blocks_per_parameter) return {};
    std::vector<size_t> b(bk.offsets.begin(), bk.offsets.end());
    std::sort(b.begin(), b.end());
    b.erase(std::unique(b.begin(), b.end()), b.end());
    return b;
  }
  // The lengths of rank r's slice cut at those bounds, each quantized in blocks of its own; `begin`: where the
  // slice starts in the bucket, when the caller has it (walking the ranks in order).
  std::vector<size_t> slice_pieces(const Bucket& bk, int r, size_t begin = SIZE_MAX) const {
    if (begin == SIZE_MAX) begin = std::accumulate(bk.counts.begin(), bk.counts.begin() + r, size_t{0});
    return cut_at_bounds(begin, bk.counts[size_t(r)], block_bounds(bk));
  }
  // Rank r's slice on a wire: the int8 pieces' blocks, or the elements.
  size_t slice_wire_bytes(const Bucket& bk, DType wire, int r) const {
    if (wire != DType::i8 || !opt.blocks_per_parameter) return wire_bytes(wire, bk.counts[size_t(r)]);
    size_t total = 0;
    for (size_t n : slice_pieces(bk, r)) total += wire_bytes(wire, n);
    return total;
  }
  // The whole unit's bytes on the wire (every rank's part).
  size_t unit_wire_bytes(const Bucket& bk, DType wire) const {
    size_t total = 0;
    for (size_t r = 0; r < bk.counts.size(); ++r) total += slice_wire_bytes(bk, wire, int(r));
    return total;
  }
  // A gather's bytes (the ring allgather's (W-1)/W of the unit a rank, on its wire), time in communication and time
  // blocked.
  void count_gather(const Bucket& bk, double comm_s, double blocked_s, DType wire, bool secondary = false) {
    const int w = secondary ? sec_comm->size() : gather_comm ? gather_comm->size() : 1;
    const uint64_t moved = uint64_t(double(w - 1) / w * double(unit_wire_bytes(bk, wire)) + 0.5);
    std::lock_guard<std::mutex> lk(mu);
    step.comm_s += comm_s;
    step.bytes_sent += moved;
    step.bytes_recv += moved;
    gather_s += blocked_s;
  }
  // A narrow gather (gather_wire f16, bf16 or i8): each rank's part of `staged` is its slice on the wire (in rank
  // order, wire_bytes each); stage() writes this rank's, the allgather (of bytes: stage_counts) fills the others, and
  // widen() writes the whole unit's rounded weights from every part (this rank's too, so every rank runs the same
  // ones). i8 is ZeRO++'s quantized weights (qwZ): per block of kQuantBlock elements of a slice, scale = max|x| / 127
  // and the values round(x / scale) in [-127, 127].
  std::vector<size_t> stage_counts(const Bucket& bk) const {
    std::vector<size_t> out;
    for (size_t r = 0; r < bk.counts.size(); ++r) out.push_back(slice_wire_bytes(bk, gather_wire, int(r)));
    return out;
  }
  size_t stage_offset(const Bucket& bk, int rank) const {
    size_t off = 0;
    for (int r = 0; r < rank; ++r) off += slice_wire_bytes(bk, gather_wire, r);
    return off;
  }
  void stage(Bucket& bk, std::vector<uint8_t>& staged, int rank) {
    staged.resize(unit_wire_bytes(bk, gather_wire));
    const size_t len = bk.shard.defined() ? size_t(bk.shard.numel()) : 0;
    if (len == 0) return;
    uint8_t* part = staged.data() + stage_offset(bk, rank);
    const float* x = slice_of(bk);
    if (is_16bit(gather_wire)) {
      narrow16(gather_wire, x, part, len);
      return;
    }
    for (size_t n : slice_pieces(bk, rank)) {
      if (n > 0) quantize_block_i8(x, n, kQuantBlock, part);
      x += n;
      part += wire_bytes(gather_wire, n);
    }
  }
  void widen(Bucket& bk, const std::vector<uint8_t>& staged) {
    float* const first = bk.full.data_ptr<float>();
    float* dst = first;
    const uint8_t* part = staged.data();
    for (size_t r = 0; r < bk.counts.size(); ++r) {
      if (is_16bit(gather_wire)) {
        const size_t n = bk.counts[r];
        widen16(gather_wire, part, dst, n);
        part += wire_bytes(gather_wire, n);
        dst += n;
        continue;
      }
      for (size_t n : slice_pieces(bk, int(r), size_t(dst - first))) {
        if (n > 0) dequantize_block_i8(part, n, kQuantBlock, dst);
        part += wire_bytes(gather_wire, n);
        dst += n;
      }
    }
    bk.rounded = true;
  }
  // Starts a narrow training gather of the unit into `staged` (widen() once it is done).
  coll::Work start_narrow(Bucket& bk, std::vector<uint8_t>& staged, const coll::CollOptions& co) {
    const int rank = gather_comm->rank();
    stage(bk, staged, rank);
    return gather_comm->allgatherv(staged.data() + stage_offset(bk, rank), staged.data(), stage_counts(bk), DType::u8,
                                   co);
  }
  // Starts the group gather of the unit's kept parts (this rank's in `sent`) on sec_wire(): into the unit in f32, or
  // into `staged` in 16 bits (widen() once it is done: a 16-bit wire's parts are contiguous elements, any cut of them
  // widens alike).
  coll::Work start_secondary(Bucket& bk, const std::vector<uint8_t>& sent, std::vector<uint8_t>& staged,
                             const coll::CollOptions& co) {
    const DType sw = sec_wire();
    void* out = bk.full.data_ptr<float>();
    if (sw != DType::f32) {
      staged.resize(bk.n * dtype_size(sw));
      out = staged.data();
    }
    return sec_comm->allgatherv(sent.data(), out, bk.sec_counts, sw, co);
  }
  // Every rank's slices of bucket b into its whole parameters (allocated again if released). counted: a training
  // step's (its bytes and its time, which blocked forward or backward). A prefetched gather of another bucket is
  // finished first (the ranks' gathers stay in one order; its unit stays gathered until released as usual).
  // A training gather (counted) travels on gather_wire; the others (whole_parameters(), a refresh) in f32, and gather
  // a unit again that a narrow gather left resident with rounded weights.
  void gather(int b, bool counted, const char* pass, bool refresh = false) {
    if (ahead.b >= 0) finish_ahead();
    Bucket& bk = buckets[size_t(b)];
    if (bk.resident && !refresh && (counted || !bk.rounded)) return;
    const double t0 = now_s();
    allocate(bk);
    if (counted && from_secondary(bk, pass)) {
      // ZeRO++'s hpZ: the weights the forward ran, gathered within the group on sec_wire() (exact: what the forward's
      // wire rounded stays as it was).
      coll::CollOptions co;
      co.timeout_s = opt.timeout_s;
      co.blocking = true;
      const DType sw = sec_wire();
      std::vector<uint8_t> staged;
      try {
        start_secondary(bk, bk.secondary, staged, co).wait();
        if (sw != DType::f32) widen(bk, staged);
      } catch (...) {
        release(bk, &abandoned);
        abandoned_secondary.push_back(std::move(bk.secondary));
        if (!staged.empty()) abandoned_staged.push_back(std::move(staged));
        throw;
      }
      bk.rounded = gather_wire != DType::f32;
      std::vector<uint8_t>().swap(bk.secondary);
      const double t1 = now_s();
      count_gather(bk, t1 - t0, t1 - t0, sw, true);
      if (opt.trace)
        opt.trace->complete("gather", 0, t0, t1,
                            {{"bucket", b},
                             {"bytes", unit_wire_bytes(bk, sw)},
                             {"op", "allgather"},
                             {"pass", pass},
                             {"secondary", true},
                             {"dtype", dtype_name(sw)}});
      return;
    }
    float* dst = bk.full.data_ptr<float>();
    const float* src = slice_of(bk);
    const int w = gather_comm ? gather_comm->size() : 1;
    const DType wire = counted && w > 1 ? gather_wire : DType::f32;
    if (w > 1) {
      coll::CollOptions co;
      co.timeout_s = opt.timeout_s;
      co.blocking = true;
      std::vector<uint8_t> staged;
      try {
        if (wire == DType::f32) {
          gather_comm->allgatherv(src, dst, bk.counts, DType::f32, co).wait();
          bk.rounded = false;
        } else {
          start_narrow(bk, staged, co).wait();
          widen(bk, staged);
        }
      } catch (...) {
        release(bk, &abandoned);  // half gathered: its allocation kept rather than freed under the transport
        if (!staged.empty()) abandoned_staged.push_back(std::move(staged));
        throw;
      }
    } else {
      std::copy(src, src + bk.counts[0], dst);
      bk.rounded = false;
    }
    const double t1 = now_s();
    if (!counted) return;
    count_gather(bk, t1 - t0, t1 - t0, wire);
    if (opt.trace)
      opt.trace->complete("gather", 0, t0, t1,
                          {{"bucket", b},
                           {"bytes", unit_wire_bytes(bk, wire)},
                           {"op", "allgather"},
                           {"pass", pass},
                           {"dtype", dtype_name(wire)}});
  }
  // Starts the gather of bucket b in the background (the unit after the running one, in the pass's order), unless
  // it is gathered already or another is in flight. Every rank runs the same units in the same order, so every rank
  // starts the same prefetches.
  void start_ahead(int b, bool counted, const char* pass) {
    if (b < 0 || ahead.b >= 0 || !opt.zero_prefetch || !gather_comm || gather_comm->size() < 2) return;
    Bucket& bk = buckets[size_t(b)];
    if (bk.resident) return;
    allocate(bk);
    coll::CollOptions co;
    co.timeout_s = opt.timeout_s;
    ahead.t0 = now_s();
    const DType wire = counted ? gather_wire : DType::f32;
    try {
      if (counted && from_secondary(bk, pass)) {
        ahead.secondary = true;
        ahead.sent = std::move(bk.secondary);
        bk.secondary.clear();
        ahead.work = start_secondary(bk, ahead.sent, ahead.staged, co);
      } else if (wire == DType::f32) {
        ahead.work = gather_comm->allgatherv(slice_of(bk), bk.full.data_ptr<float>(), bk.counts, DType::f32, co);
      } else {
        ahead.work = start_narrow(bk, ahead.staged, co);
      }
    } catch (...) {
      release(bk, &abandoned);
      if (!ahead.staged.empty()) abandoned_staged.push_back(std::move(ahead.staged));
      if (!ahead.sent.empty()) abandoned_secondary.push_back(std::move(ahead.sent));
      ahead = Ahead{};
      throw;
    }
    ahead.b = b;
    ahead.wire = ahead.secondary ? sec_wire() : wire;
    ahead.counted = counted;
    ahead.pass = pass;
  }
  // Waits for the prefetched gather; only the wait blocked forward or backward (exposed).
  void finish_ahead() {
    Ahead a = std::move(ahead);
    ahead = Ahead{};
    Bucket& bk = buckets[size_t(a.b)];
    const double t0 = now_s();
    try {
      a.work.wait();
    } catch (...) {
      release(bk, &abandoned);
      if (!a.staged.empty()) abandoned_staged.push_back(std::move(a.staged));
      if (!a.sent.empty()) abandoned_secondary.push_back(std::move(a.sent));
      throw;
    }
    const DType wire = a.wire;
    if (a.secondary) {
      if (wire != DType::f32) widen(bk, a.staged);
      bk.rounded = gather_wire != DType::f32;  // (the forward's weights, as its wire left them)
    } else if (wire == DType::f32)
      bk.rounded = false;
    else
      widen(bk, a.staged);
    const double t1 = now_s();
    if (!a.counted) return;
    count_gather(bk, a.work.seconds(), t1 - t0, wire, a.secondary);
    if (opt.trace)
      opt.trace->complete("gather", 2, a.t0, t1,
                          {{"bucket", a.b},
                           {"bytes", unit_wire_bytes(bk, wire)},
                           {"op", "allgather"},
                           {"pass", a.pass},
                           {"prefetched", true},
                           {"secondary", a.secondary},
                           {"blocked_s", t1 - t0},
                           {"dtype", dtype_name(wire)}});
  }
  // The secondary parts' element type: the forward's 16-bit wire (its weights are exact in it, as ZeRO++ keeps them in
  // 16 bits), else f32 (int8 blocks follow the primary slices, not the group's parts).
  DType sec_wire() const { return is_16bit(gather_wire) ? gather_wire : DType::f32; }
  // ZeRO-3 with a secondary partition: a backward gather of a unit whose forward kept its part comes from the group.
  bool from_secondary(const Bucket& bk, const char* pass) const {
    return sec_comm && std::strcmp(pass, "backward") == 0 && !bk.secondary.empty();
  }
  // After a training forward of the unit (whose backward will gather it again): this rank's part of the weights it
  // ran, for that gather within the group.
  void keep_secondary(Bucket& bk) {
    if (!sec_comm || !bk.resident) return;
    const size_t len = bk.sec_counts[size_t(sec_comm->rank())];
    const float* w = bk.full.data_ptr<float>() + bk.sec_mine;
    const DType sw = sec_wire();
    // (an empty part is one element of zeros: non-empty, so the group's gather still runs on this rank)
    bk.secondary.assign(std::max<size_t>(len, 1) * dtype_size(sw), 0);
    if (len == 0) return;
    if (is_16bit(sw))
      narrow16(sw, w, bk.secondary.data(), len);
    else
      std::memcpy(bk.secondary.data(), w, len * sizeof(float));
  }
  // The pieces of every unit (units: parameter indices, in forward order), once the buckets are cut into slices. A
  // unit's range that touches the last piece of its bucket joins it while that piece carries fewer than
  // opt.zero_allgather_bytes (the unit then waits for that piece, which an earlier unit may have waited for already).
  void build_pieces(const std::vector<std::vector<int>>& units, int rank, int w) {
    std::map<int, int> last;  // each bucket's latest piece
    for (auto& u : units) {
      // The unit's parameters' ranges, bucket by bucket, merged where they touch.
      std::vector<std::tuple<int, size_t, size_t>> ranges;
      for (int i : u) {
        const int b = param_bucket[size_t(i)];
        const size_t at = buckets[size_t(b)].offsets[size_t(param_slot[size_t(i)])];
        ranges.emplace_back(b, at, at + numel[size_t(i)]);
      }
      std::sort(ranges.begin(), ranges.end());
      unit_needs.emplace_back();
      for (size_t k = 0; k < ranges.size(); ++k) {
        auto [b, begin, end] = ranges[k];
        while (k + 1 < ranges.size() && std::get<0>(ranges[k + 1]) == b && std::get<1>(ranges[k + 1]) == end)
          end = std::get<2>(ranges[++k]);
        if (auto it = last.find(b); it != last.end()) {
          Piece& q = deferred[size_t(it->second)];
          if ((q.end - q.begin) * sizeof(float) < opt.zero_allgather_bytes && (q.end == begin || end == q.begin)) {
            q.begin = std::min(q.begin, begin);
            q.end = std::max(q.end, end);
            if (unit_needs.back().empty() || unit_needs.back().back() != it->second)
              unit_needs.back().push_back(it->second);
            continue;
          }
        }
        Piece p;
        p.bucket = b;
        p.begin = begin;
        p.end = end;
        last[b] = int(deferred.size());
        unit_needs.back().push_back(int(deferred.size()));
        deferred.push_back(std::move(p));
      }
    }
    // Each rank's part of each piece (its slice's overlap with it).
    for (Piece& p : deferred) {
      const Bucket& bk = buckets[size_t(p.bucket)];
      size_t off = 0;
      for (int r = 0; r < w; ++r) {
        const size_t lo = std::max(p.begin, off), hi = std::min(p.end, off + bk.counts[size_t(r)]);
        p.counts.push_back(hi > lo ? hi - lo : 0);
        if (r == rank) p.src = hi > lo ? lo : p.begin;
        off += bk.counts[size_t(r)];
      }
    }
  }
  // Waits for piece k's deferred allgather, if it is in flight. counted: in a training step (forward, synchronize),
  // whose exposed communication is the wait; unit: the unit whose forward waits (-1: none).
  void finish_deferred(int k, bool counted, int unit = -1) {
    Piece& d = deferred[size_t(k)];
    if (!d.on) return;
    d.on = false;
    const double t0 = now_s();
    d.work.wait();
    const double t1 = now_s();
    {
      std::lock_guard<std::mutex> lk(mu);
      // (its bytes were counted as it started; one finished outside a step, by whole_parameters(), goes to the
      // totals: the last step's went nowhere, no step following)
      (counted ? step.comm_s : outside_comm_s) += d.work.seconds();
      if (counted) gather_s += t1 - t0;
    }
    if (opt.trace && counted)
      opt.trace->complete("communicate", 2, d.t0, t1,
                          {{"bucket", d.bucket},
                           {"bytes", (d.end - d.begin) * sizeof(float)},
                           {"op", "allgather"},
                           {"deferred", true},
                           {"unit", unit},
                           {"blocked_s", t1 - t0}});
  }
  void finish_all_deferred(bool counted) {
    for (size_t k = 0; k < deferred.size(); ++k) finish_deferred(int(k), counted);
  }
  // The first bucket with parameters after unit u (forward) or before it (backward); -1: none.
  int next_bucket(int u, int dir) const {
    for (int k = u + dir; k >= 0 && k < int(unit_bucket.size()); k += dir)
      if (unit_bucket[size_t(k)] >= 0) return unit_bucket[size_t(k)];
    return -1;
  }
  ~Core() {
    // A gather in flight writes into a unit's storage (which the model's parameters share, and `buckets` here): it
    // ends first (a failed one's allocation is kept in `abandoned`, freed after the communicator's thread stopped).
    if (ahead.b >= 0) {
      try {
        finish_ahead();
      } catch (...) {
      }
    }
    // (ZeRO-1/2: a deferred allgather writes into flat_params, which the model's parameters are views of)
    for (auto& d : deferred) {
      if (!d.on) continue;
      d.on = false;
      try {
        d.work.wait();
      } catch (...) {
      }
    }
    gather_comm.reset();  // (its thread stopped before the storages and `abandoned` go)
    sec_comm.reset();
  }

  // ZeRO-2: a released bucket buffer back (lk holds mu): a spare that holds it (zero_spares::pick), resized within
  // its capacity (only a grown part is zeroed), or else a new one, allocated and zeroed with mu released (the other
  // threads leave a bucket that is not full alone; the communication thread only needs mu to take the next one).
  void ensure_flat(Bucket& bk, std::unique_lock<std::mutex>& lk) {
    if (!bk.flat.empty() || bk.n == 0) return;
    const size_t best = zero_spares::pick(spare_capacities(), bk.n, second_bucket_n);
    if (best < spare.size()) {
      bk.flat.swap(spare[best]);
      spare.erase(spare.begin() + std::ptrdiff_t(best));
      bk.flat.resize(bk.n);
      return;
    }
    lk.unlock();
    std::vector<float> fresh(bk.n);
    lk.lock();
    if (bk.flat.empty()) bk.flat.swap(fresh);
  }

  // second_bucket_n: the elements of the second-largest bucket (the largest's where two share the largest size; 0
  // for one bucket).
  void note_second_largest_bucket() {
    size_t first = 0, second = 0;
    for (const auto& b : buckets)
      if (b.n > first)
        second = first, first = b.n;
      else if (b.n > second)
        second = b.n;
    second_bucket_n = second;
  }

  std::vector<size_t> spare_capacities() const {
    std::vector<size_t> caps;
    for (const auto& s : spare) caps.push_back(s.capacity());
    return caps;
  }

  // ZeRO: re-seats the parameters as views of flat_params, bucket after bucket, and cuts every bucket into W slices.
  // Returns this rank's non-empty slices, the optimizer's new parameters.
  std::vector<torch::Tensor> seat_zero(int rank, int w) {
    torch::NoGradGuard ng;
    if (zero >= 3) {  // each unit's flat tensor of its own, released once this rank's slice is copied out of it
      std::vector<torch::Tensor> slices;
      for (auto& bk : buckets) {
        bk.full = torch::empty({int64_t(bk.n)}, torch::kFloat);
        for (size_t k = 0; k < bk.params.size(); ++k) {
          torch::Tensor& p = params[size_t(bk.params[k])];
          auto view = bk.full.narrow(0, int64_t(bk.offsets[k]), p.numel()).view(p.sizes());
          view.copy_(p);
          p.set_data(view);
        }
        cut(bk, rank, w);
        const size_t len = bk.counts[size_t(rank)];
        if (len > 0) {
          bk.shard = bk.full.narrow(0, int64_t(bk.mine), int64_t(len)).clone();
          bk.shard.set_requires_grad(true);
          bk.shard.mutable_grad() = torch::zeros({int64_t(len)}, torch::kFloat);
          slices.push_back(bk.shard);
        }
        release(bk);
      }
      return slices;
    }
    size_t total = 0;
    for (auto& bk : buckets) bk.base = total, total += bk.n;
    flat_params = torch::empty({int64_t(total)}, torch::kFloat);
    std::vector<torch::Tensor> slices;
    for (auto& bk : buckets) {
      for (size_t k = 0; k < bk.params.size(); ++k) {
        torch::Tensor& p = params[size_t(bk.params[k])];
        auto view = flat_params.narrow(0, int64_t(bk.base + bk.offsets[k]), p.numel()).view(p.sizes());
        view.copy_(p);
        p.set_data(view);
      }
      cut(bk, rank, w);
      const size_t len = bk.counts[size_t(rank)];
      if (len == 0) continue;
      bk.shard = flat_params.narrow(0, int64_t(bk.base + bk.mine), int64_t(len)).detach();
      bk.shard.set_requires_grad(true);
      // Stage 1 keeps every bucket's buffer, which never moves (no re-bucketing): the slice's averaged gradient is
      // reduce-scattered into the bucket's own block of it. Stage 2 releases the buffers: a tensor of its own.
      bk.shard.mutable_grad() = zero >= 2 ? torch::zeros({int64_t(len)}, torch::kFloat)
                                          : torch::from_blob(bk.flat.data() + bk.mine, {int64_t(len)},
                                                             torch::TensorOptions().dtype(torch::kFloat));
      slices.push_back(bk.shard);
    }
    return slices;
  }

  // A bucket's W near-equal slices, the first ones a float longer.
  static void cut(Bucket& bk, int rank, int w) {
    bk.counts.assign(size_t(w), bk.n / size_t(w));
    for (size_t r = 0; r < bk.n % size_t(w); ++r) bk.counts[r] += 1;
    bk.mine = 0;
    for (int r = 0; r < rank; ++r) bk.mine += bk.counts[size_t(r)];
  }

  // ZeRO-2 or 3 reducing every backward pass (DistOptions::zero_reduce_each_pass): a step's tasks are each bucket
  // once per pass, in pass order; otherwise each bucket once.
  bool each_pass() const { return zero >= 2 && opt.zero_reduce_each_pass && opt.backward_passes > 1; }
  int tasks() const { return int(buckets.size()) * (each_pass() ? opt.backward_passes : 1); }
  // A task of this pass ends the step's reduction: its last pass's (or its only one).
  bool last_pass(int pass) const { return !each_pass() || pass == opt.backward_passes - 1; }
  // Whether task t's gradients have all reached its bucket.
  bool task_ready(int t) const {
    const int nb = int(buckets.size());
    return ready[size_t(t % nb)] > t / nb;
  }

  void reset_step_locked() {
    // A step's observed order goes with its gradients (a backward discarded by zero_grad() recorded every parameter
    // once, and the next backward again: duplicate slots in the rebuilt buckets, twice the bytes every step).
    if (record_order) ready_order.clear();
    got.assign(params.size(), 0);
    used.clear();
    pending.resize(buckets.size());
    for (size_t b = 0; b < buckets.size(); ++b) pending[b] = int(buckets[b].params.size());
    ready.assign(buckets.size(), 0);
    for (auto& bk : buckets) bk.pass_got = 0;
    next = 0;
    flush = false;
  }

  static void accumulate(float* dst, const torch::Tensor& g, size_t n) {
    const float* src = g.data_ptr<float>();
    for (size_t k = 0; k < n; ++k) dst[k] += src[k];
  }

  // Autograd hook: runs on the thread doing backward.
  void on_grad(int i, const torch::Tensor& grad) {
    if (grad.scalar_type() != torch::kFloat || grad.layout() != torch::kStrided)
      throw InvalidArgument(fmt::format(
          "DistributedOptimizer: parameter '{}' got a {} {} gradient; allowed: float32 "
          "dense gradients (an Embedding with sparse=false)",
          names[size_t(i)], c10::toString(grad.scalar_type()), grad.layout() == torch::kStrided ? "dense" : "sparse"));
    torch::Tensor g = grad.contiguous();
    std::unique_lock<std::mutex> lk(mu);
    if (!alive) return;
    if (synced)
      throw InvalidArgument(fmt::format(
          "DistributedOptimizer: parameter '{}' got a gradient after synchronize() and before step(); allowed: "
          "backward, then synchronize() and step()",
          names[size_t(i)]));
    int b = param_bucket[size_t(i)];
    Bucket& bk = buckets[size_t(b)];
    // ZeRO-3: every node that used the unit's parameters has run once each of them has its gradient of this pass.
    if (zero >= 3 && ++bk.pass_got == bk.params.size()) {
      bk.pass_got = 0;
      // (A unit being gathered ahead cannot have had its backward: its gather hook finishes the gather first. Were
      // one ever released here, the transfer would write into freed storage; it stays, released at the step.)
      if (!pinned && ahead.b != b) release(bk);
    }
    const int passes = opt.backward_passes;
    if (each_pass() && got[size_t(i)] > 0 && got[size_t(i)] < passes) {
      // Pass p's gradient goes into a buffer of its own once the bucket's exchange of pass p - 1 is over (it reads the
      // buffer, then releases it). The exchanges go in order, so every one up to it must have had all its gradients
      // (one that never fills would keep this wait from ending).
      const int p = got[size_t(i)], nb = int(buckets.size());
      const int task = (p - 1) * nb + b;
      for (int t = next; t <= task; ++t) {
        const Bucket& waiting = buckets[size_t(t % nb)];
        if (task_ready(t)) continue;
        std::string missing;
        for (int j : waiting.params)
          if (got[size_t(j)] <= t / nb) missing = names[size_t(j)];
        throw InvalidArgument(fmt::format(
            "DistributedOptimizer: parameter '{}' got its gradient of backward pass {} while '{}' has none of pass {} "
            "(with zero_reduce_each_pass each pass's buckets are reduced as they fill, in order); allowed: backward "
            "passes that each reach every trainable parameter, or zero_reduce_each_pass off",
            names[size_t(i)], p + 1, missing, t / nb + 1));
      }
      if (next <= task) {
        // (blocked backward: exposed communication, as a gather's wait, not compute)
        const double w0 = now_s();
        cv.wait(lk, [&] { return next > task || !alive; });
        const double w1 = now_s();
        gather_s += w1 - w0;
        if (opt.trace) opt.trace->complete("wait for bucket", 0, w0, w1, {{"bucket", b}, {"pass", p + 1}});
      }
      if (!alive) return;
    }
    if (!got[size_t(i)] || each_pass()) {
      ensure_flat(bk, lk);
      if (!alive) return;
    }
    float* dst = bk.flat.data() + bk.offsets[size_t(param_slot[size_t(i)])];
    if (got[size_t(i)] >= passes) {
      // One gradient more than the step's backward passes: with overlap its bucket may be averaged already, or being
      // averaged (the sum would mix the average with this rank's own gradient, differently on every rank); without,
      // it accumulates.
      if (opt.overlap)
        throw InvalidArgument(fmt::format(
            "DistributedOptimizer: parameter '{}' got gradient {} before step(), with backward_passes = {} (its "
            "bucket may be exchanged already); allowed: backward_passes backward calls per step, or overlap off to "
            "accumulate any number",
            names[size_t(i)], got[size_t(i)] + 1, passes));
      accumulate(dst, g, numel[size_t(i)]);
      return;
    }
    if (got[size_t(i)] == 0 || each_pass())
      std::memcpy(dst, g.data_ptr<float>(), numel[size_t(i)] * sizeof(float));
    else  // an earlier micro-batch's gradient is in the bucket: this one adds to it
      accumulate(dst, g, numel[size_t(i)]);
    if (++got[size_t(i)] < passes && !each_pass()) return;  // (ready, and its bucket may go, with the last pass's)
    if (record_order && got[size_t(i)] == passes) ready_order.push_back(i);
    if (--pending[size_t(b)] == 0) {
      ready[size_t(b)] += 1;
      if (each_pass()) pending[size_t(b)] = int(bk.params.size());  // (the next pass's)
      if (opt.trace) opt.trace->instant("bucket ready", 0, now_s(), {{"bucket", b}});
      if (opt.overlap) cv.notify_all();
    }
  }

  // flushed: synchronize() had begun when the thread took the bucket (so `used` is set and stays until the step ends).
  // pass: the backward pass whose gradients the bucket holds (each_pass(); else 0, the passes' sum).
  void communicate(int b, int pass, bool flushed) {
    Bucket& bk = buckets[size_t(b)];
    const int w = comm->size();
    const size_t n = bk.n;
    const double t0 = now_s();
    uint64_t payload = n * sizeof(float);
    double factor_sent = w > 1 ? 2.0 * (w - 1) / w : 0.0;  // ring-equivalent allreduce volume per rank
    double factor_recv = factor_sent;
    if (zero) {
      // This rank's slice of the sum, averaged, into its slice's .grad; the allgather of the stepped slices in
      // step() moves the other half of the allreduce's bytes.
      float dummy = 0;
      float* out = bk.shard.defined() ? bk.shard.mutable_grad().data_ptr<float>() : &dummy;
      // Reducing every backward pass (each_pass()): a later pass's slice goes into `acc` and is added to the earlier
      // passes' in `out`; the replicas' allreduce (and f32's division) wait for the last pass, as MiCS's accumulation
      // steps leave the cross-group exchange to the accumulation boundary.
      const bool each = each_pass(), last = last_pass(pass);
      float* const grad_out = out;
      std::vector<float> acc;
      coll::CollOptions co;
      co.timeout_s = opt.timeout_s;
      co.blocking = true;
      // (sharded within groups: the reduce-scatter within this rank's group, then the replicas' allreduce below, by
      // what is left of one deadline: a bucket's exchange fails within the timeout, not twice it)
      coll::Communicator& rs = slice_comm();
      const int k = rs.size();
      const size_t mine = bk.counts[size_t(rs.rank())];
      if (each && pass > 0) {
        acc.assign(mine, 0.f);
        out = acc.data();
      }
      // The pass's slice into the earlier passes' sum, then (at the last) across the replicas.
      auto finish_slice = [&](auto&& across) {
        if (out != grad_out)
          for (size_t j = 0; j < mine; ++j) grad_out[j] += out[j];
        out = grad_out;
        if (last) across();
      };
      const Deadline due = Deadline::after(opt.timeout_s > 0 ? opt.timeout_s : rs.timeout_s());
      auto replica_co = [&] {
        coll::CollOptions left = co;
        left.timeout_s = std::max(due.remaining_seconds(), 1e-3);
        return left;
      };
      double t1;
      if (zero_wire == DType::i8) {
#ifdef CONDUIT_WITH_COMPRESS
        // int8 (int4) blocks by all-to-all (ZeRO++'s qgZ, compress::int_reduce_scatter): every contribution rounded
        // once, summed by the slice's owner; over several hosts in two hops. Into a buffer first: `out` may lie inside
        // the input at stage 1.
        std::vector<float> slice(mine);
        compress::ReduceOptions ro;
        ro.average = true;
        ro.timeout_s = opt.timeout_s;
        uint64_t received = 0;
        ro.received = &received;
        // Error feedback: the bucket's parameters' residuals laid out as the bucket, and back (each parameter keeps
        // its own, whatever buckets it is in from step to step).
        std::vector<float> residual(zero_ef ? n : 0);
        if (zero_ef)
          for (size_t q = 0; q < bk.params.size(); ++q) {
            const int i = bk.params[q];
            auto& r = states[size_t(i)].buffer("qgz.residual", numel[size_t(i)]);
            std::copy(r.begin(), r.end(), residual.begin() + std::ptrdiff_t(bk.offsets[q]));
          }
        const std::vector<size_t> bounds = block_bounds(bk);
        const uint64_t sent = compress::int_reduce_scatter(rs, int_groups, std::span<const float>(bk.flat.data(), n),
                                                           bk.counts, slice, zero_bits, ro, residual, bounds);
        if (zero_ef)
          for (size_t q = 0; q < bk.params.size(); ++q) {
            const int i = bk.params[q];
            auto& r = states[size_t(i)].buffer("qgz.residual", numel[size_t(i)]);
            std::copy_n(residual.begin() + std::ptrdiff_t(bk.offsets[q]), r.size(), r.begin());
          }
        std::copy(slice.begin(), slice.end(), out);
        finish_slice([&] { average_replicas(out, mine, replica_co()); });
        t1 = now_s();
        // The payload as the other wires count it (every rank's slice on the wire), what moved exactly.
        payload = 0;
        size_t begin = 0;
        for (size_t r = 0; r < bk.counts.size(); begin += bk.counts[r], ++r)
          for (size_t c : slice_pieces(bk, int(r), begin))
            payload += block_int_bytes(c, compress::kIntBlock, zero_bits);
        factor_sent = payload > 0 ? double(sent) / double(payload) : 0.0;
        factor_recv = payload > 0 ? double(received) / double(payload) : 0.0;
#else
        t1 = now_s();
        throw InvalidArgument(
            "DistributedOptimizer: compressor int8 or int4 needs src/compress; allowed: none, fp16, bf16");
#endif
      } else if (zero_wire != DType::f32) {
        // 16-bit floats on the wire: each rank's gradients cast, averaged in the collective (f16 divides before it
        // adds, as NCCL does), this rank's slice widened back. One rank casts too, so its rounding is the same.
        std::vector<uint16_t> wire(n), slice(mine);
        narrow16(zero_wire, bk.flat.data(), wire.data(), n);
        if (k > 1)
          rs.reduce_scatter(wire.data(), slice.data(), bk.counts, zero_wire, ReduceOp::avg, co).wait();
        else
          std::copy(wire.begin(), wire.end(), slice.begin());
        widen16(zero_wire, slice.data(), out, mine);
        finish_slice([&] { average_replicas(out, mine, replica_co()); });
        t1 = now_s();
        payload = n * sizeof(uint16_t);
      } else {
        if (k > 1)
          rs.reduce_scatter(bk.flat.data(), out, bk.counts, DType::f32, ReduceOp::sum, co).wait();
        else if (out != bk.flat.data())  // (out may lie inside the input at stage 1: the collective copies it first)
          std::copy(bk.flat.begin(), bk.flat.begin() + std::ptrdiff_t(n), out);
        // (summed over the replicas too, then divided by every rank once)
        finish_slice([&] {
          if (replica_comm && replica_comm->size() > 1)
            replica_comm->allreduce(out, mine, DType::f32, ReduceOp::sum, replica_co()).wait();
        });
        t1 = now_s();
        if (last) {
          const float inv = 1.0f / float(w);
          for (size_t j = 0; j < mine; ++j) out[j] *= inv;
        }
      }
      if (zero_wire != DType::i8) factor_sent = factor_recv = k > 1 ? double(k - 1) / k : 0.0;
      if (replica_comm && replica_comm->size() > 1 && payload > 0 && last) {
        // The replicas' allreduce of this rank's slice (a ring's 2(G-1)/G of its bytes: 16-bit on a 16-bit wire,
        // else f32), as one factor with the reduce-scatter's.
        const size_t element = is_16bit(zero_wire) ? sizeof(uint16_t) : sizeof(float);
        const double g = replica_comm->size(), ar = 2.0 * (g - 1) / g * double(mine * element);
        factor_sent = (factor_sent * double(payload) + ar) / double(payload);
        factor_recv = (factor_recv * double(payload) + ar) / double(payload);
      }
      if (zero >= 2) {
        std::lock_guard<std::mutex> lk(mu);
        spare.emplace_back().swap(bk.flat);  // (kept at its size: a reuse zeroes only what it grows by)
        std::vector<std::vector<float>> keep;
        for (size_t k : zero_spares::kept(spare_capacities(), second_bucket_n, zero >= 3 ? 1 : 2))
          keep.push_back(std::move(spare[k]));
        spare.swap(keep);
      }
      if (opt.trace) {
        // (qgZ: an all-to-all of int blocks; `bytes` every rank's slice on the wire; the replicas' allreduce of this
        // rank's slice, on the 16-bit wire or f32, as its own bytes)
        nlohmann::json args = {{"bucket", b},
                               {"bytes", payload},
                               {"op", zero_wire == DType::i8 ? "int_reduce_scatter" : "reduce_scatter"},
                               {"wire", zero_wire != DType::i8 ? dtype_name(zero_wire)
                                        : zero_bits == 8       ? "int8"
                                                               : "int4"}};
        if (zero_ef) args["error_feedback"] = true;
        if (each) args["pass"] = pass + 1;
        if (replica_comm && replica_comm->size() > 1 && last)
          args["replica_allreduce_bytes"] = mine * (is_16bit(zero_wire) ? sizeof(uint16_t) : sizeof(float));
        opt.trace->complete("communicate", 1, t0, t1, std::move(args));
        opt.trace->complete("average", 1, t1, now_s(), {{"bucket", b}});
      }
    } else if (!compressed) {
      coll::CollOptions co;
      co.timeout_s = opt.timeout_s;
      co.blocking = true;
      if (w > 1) comm->allreduce(bk.flat.data(), n, DType::f32, ReduceOp::sum, co).wait();
      const double t1 = now_s();
      const float inv = 1.0f / float(w);
      for (float& x : bk.flat) x *= inv;
      if (opt.trace) {
        opt.trace->complete("communicate", 1, t0, t1, {{"bucket", b}, {"bytes", payload}, {"op", "allreduce"}});
        opt.trace->complete("average", 1, t1, now_s(), {{"bucket", b}});
      }
    } else {
#ifdef CONDUIT_WITH_COMPRESS
      std::vector<compress::TensorState*> st;
      std::vector<std::span<float>> data;
      std::vector<std::span<float>> dense;  // below compress_min_bytes: plain allreduce
      size_t dense_n = 0;
      for (size_t k = 0; k < bk.params.size(); ++k) {
        int i = bk.params[k];
        // No rank's gradient: its zeros would still drive the compressor's state (error feedback would send its
        // residual, then the optimizer would drop the result) and momentum; every rank knows it, so all skip it.
        if (flushed && !used.empty() && !used[size_t(i)]) continue;
        std::span<float> g(bk.flat.data() + bk.offsets[k], numel[size_t(i)]);
        if (numel[size_t(i)] * sizeof(float) < opt.compress_min_bytes) {
          if (opt.dense_momentum > 0) {
            auto& u = states[size_t(i)].buffer("dense.momentum", g.size());
            const float m = float(opt.dense_momentum);
            for (size_t j = 0; j < g.size(); ++j) g[j] = u[j] = m * u[j] + g[j];
          }
          dense.push_back(g);
          dense_n += g.size();
        } else {
          st.push_back(&states[size_t(i)]);
          data.push_back(g);
        }
      }
      payload = 0;
      if (dense_n > 0) {
        std::vector<float> buf(dense_n);
        size_t o = 0;
        for (auto g : dense) std::copy(g.begin(), g.end(), buf.begin() + std::ptrdiff_t(o)), o += g.size();
        coll::CollOptions co;
        co.timeout_s = opt.timeout_s;
        if (w > 1) comm->allreduce(buf.data(), dense_n, DType::f32, ReduceOp::sum, co).wait();
        const float inv = 1.0f / float(w);
        o = 0;
        for (auto g : dense) {
          for (size_t j = 0; j < g.size(); ++j) g[j] = buf[o + j] * inv;
          o += g.size();
        }
        payload += dense_n * sizeof(float);
      }
      uint64_t comp_payload = 0, comp_received = 0, comp_sent = 0;
      if (!data.empty()) {
        compress::ReduceOptions ro;
        ro.average = true;
        ro.timeout_s = opt.timeout_s;
        ro.received = &comp_received;
        ro.sent = &comp_sent;
        // PowerSGD's collective needs the PowerSgd object itself: its phases stay inside one "communicate" event.
        if (opt.trace && opt.trace->enabled() && compressor->collective() != compress::Collective::powersgd) {
          TracedCompressor traced(*compressor, opt.trace);
          comp_payload = compress::compressed_allreduce_many(*comm, traced, st, data, ro);
        } else {
          comp_payload = compress::compressed_allreduce_many(*comm, *compressor, st, data, ro);
        }
      }
      payload += comp_payload;
      const bool gathered = compressor->collective() == compress::Collective::allgather ||
                            compressor->collective() == compress::Collective::majority_vote;
      // Dense part at the allreduce factor, compressed part at its collective's; as one effective factor. The
      // allgathered methods report what actually left and arrived (the ranks' payloads differ in size for threshold
      // and DGC: (W-1) times this rank's own was off by their difference, both ways).
      if (payload > 0) {
        const double dense_part = factor_sent * double(dense_n * sizeof(float));
        const double comp_part = gathered ? double(comp_sent) : factor_sent * double(comp_payload);
        factor_recv = gathered ? (dense_part + double(comp_received)) / double(payload)
                               : (dense_part + comp_part) / double(payload);
        factor_sent = (dense_part + comp_part) / double(payload);
      }
      if (opt.trace)
        opt.trace->complete("communicate", 1, t0, now_s(),
                            {{"bucket", b}, {"bytes", payload}, {"compressor", compressor->name()},
                             {"collective", compress::collective_name(compressor->collective())},
                             {"uncompressed_bytes", dense_n * sizeof(float)}});
#endif
    }
    const double t2 = now_s();
    std::lock_guard<std::mutex> lk(mu);
    step.comm_s += t2 - t0;
    step.payload_bytes += payload;
    // (reducing every pass: the step's buckets counted once, at the last pass; the gradient bytes each pass, as the
    // payload: an uncompressed --zero-reduce micro-batch run reported a compression ratio of 1 / micro-batches)
    const bool step_last = last_pass(pass);
    step.grad_bytes += n * sizeof(float);
    step.bytes_sent += uint64_t(factor_sent * double(payload) + 0.5);
    step.bytes_recv += uint64_t(factor_recv * double(payload) + 0.5);
    // (reducing every pass: the earlier passes' reduce-scatters the f32 wire's half of an allreduce each; the last
    // pass's with the step's allgather a whole one)
    const double raw = w > 1 ? (step_last ? 2.0 : 1.0) * (w - 1) / w : 0.0;
    step.raw_bytes += uint64_t(raw * double(n * sizeof(float)) + 0.5);
    if (step_last) step.buckets += 1;
  }

  void loop() {
    for (;;) {
      int task, b, pass;
      bool flushed;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || (next < tasks() && (flush || (opt.overlap && task_ready(next)))); });
        if (stop) return;
        task = next;
        b = task % int(buckets.size());
        pass = task / int(buckets.size());
        flushed = flush;
        if (error) {  // (the unused-parameter flags failed: no bucket may go)
          next = tasks();
          lk.unlock();
          cv.notify_all();
          continue;
        }
        if (flush && ready[size_t(b)] <= pass) {  // parameters without a gradient this pass contribute zeros
          Bucket& bk = buckets[size_t(b)];
          ensure_flat(bk, lk);
          for (size_t k = 0; k < bk.params.size(); ++k)
            if (got[size_t(bk.params[k])] <= pass)
              std::fill_n(bk.flat.data() + bk.offsets[k], numel[size_t(bk.params[k])], 0.f);
        }
      }
      try {
        communicate(b, pass, flushed);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!error) error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        next = task + 1;
        if (error) next = tasks();
      }
      cv.notify_all();
    }
  }
};

DistributedOptimizer::DistributedOptimizer(std::shared_ptr<torch::nn::Module> model,
                                           std::shared_ptr<torch::optim::Optimizer> optimizer, coll::CommPtr comm,
                                           DistOptions options)
    : model_(std::move(model)), optimizer_(std::move(optimizer)), comm_(std::move(comm)),
      core_(std::make_shared<Core>()) {
  if (!model_ || !optimizer_ || !comm_) throw InvalidArgument("DistributedOptimizer: model, optimizer and comm are required");
  coll::checked_timeout(options.timeout_s, "DistOptions.timeout_s");  // (before the first collective names CollOptions)
  if (options.bucket_cap_bytes == 0 || options.first_bucket_bytes == 0)
    throw InvalidArgument(
        fmt::format("DistributedOptimizer: bucket_cap_bytes = {} and first_bucket_bytes = {}; "
                    "allowed: 1 byte or more each",
                    options.bucket_cap_bytes, options.first_bucket_bytes));
  if (comm_->size() > 1) {
    // The ranks must be given the same options: other stages, wires, bucket caps or compressors issue other
    // collectives (a hang to the deadline, or sizes that do not match). Agreed first, with one line naming the
    // option that differs.
    const std::pair<const char*, int64_t> given[] = {
        {"zero_stage", options.zero_stage},
        {"zero_prefetch", options.zero_prefetch},
        {"zero_gather_dtype", int64_t(options.zero_gather_dtype)},
        {"zero_allgather_bytes", int64_t(options.zero_allgather_bytes)},
        {"zero_secondary_ranks", options.zero_secondary_ranks},
        {"zero_shard_ranks", options.zero_shard_ranks},
        {"overlap", options.overlap},
        // (a rank that rebuilds broadcasts rank 0's order after the first step, one that does not sends nothing: its
        // next bucket's allreduce met that broadcast)
        {"rebuild_buckets", options.rebuild_buckets},
        {"find_unused_parameters", options.find_unused_parameters},
        {"backward_passes", options.backward_passes},
        {"zero_reduce_each_pass", options.zero_reduce_each_pass},
        {"bucket_cap_bytes", int64_t(options.bucket_cap_bytes)},
        {"first_bucket_bytes", int64_t(options.first_bucket_bytes)},
        {"compress_min_bytes", int64_t(options.compress_min_bytes)},
        {"units", int64_t(options.units.size())},
        // (random-k draws its positions from it: ranks seeded apart sent values at different positions, and each
        // wrote the sum back at its own, the replicas drifting apart without a word)
        {"seed", int64_t(options.seed)},
        {"blocks_per_parameter", options.blocks_per_parameter},
        {"zero_int_hierarchy", options.zero_int_hierarchy},
        {"compressor", int64_t(std::hash<std::string>{}(options.compressor))}};
    const size_t n = std::size(given);
    std::vector<int64_t> lo(n), hi(n);
    for (size_t k = 0; k < n; ++k) lo[k] = hi[k] = given[k].second;
    coll::CollOptions co;
    co.timeout_s = options.timeout_s;
    comm_->allreduce(lo.data(), n, DType::i64, ReduceOp::min, co).wait();
    comm_->allreduce(hi.data(), n, DType::i64, ReduceOp::max, co).wait();
    for (size_t k = 0; k < n; ++k) {
      if (lo[k] == hi[k]) continue;
      const std::string name = given[k].first;
      const std::string values =
          name == "compressor"          ? std::string("two specs, this rank's '") + options.compressor + "'"
          : name == "zero_gather_dtype" ? fmt::format("{} and {}", dtype_name(DType(lo[k])), dtype_name(DType(hi[k])))
                                        : fmt::format("{} to {}", lo[k], hi[k]);
      throw InvalidArgument(fmt::format(
          "DistributedOptimizer: the ranks were given different {} ({}); allowed: the same DistOptions on every rank",
          name, values));
    }
  }
  Core& c = *core_;
  // With find_unused_parameters the per-step flags go over `comm` while buckets may still be in flight: the buckets
  // then get a communicator of their own. Otherwise they stay on `comm`, whose shared-memory fast path (the world
  // communicator's) serves the small allreduces.
  c.comm = options.find_unused_parameters && comm_->size() > 1 ? comm_->split(0, comm_->rank()) : comm_;
  c.opt = options;
  for (auto& [name, p] : trainable_parameters(*model_)) {
    if (p.scalar_type() != torch::kFloat || !p.device().is_cpu() || p.layout() != torch::kStrided)
      throw InvalidArgument(fmt::format(
          "DistributedOptimizer: parameter '{}' is {} {} on {}; allowed: float32 dense "
          "CPU parameters",
          name, c10::toString(p.scalar_type()), p.layout() == torch::kStrided ? "dense" : "sparse", p.device().str()));
    c.params.push_back(p);
    c.names.push_back(name);
    c.numel.push_back(size_t(p.numel()));
    std::vector<size_t> shape;
    for (auto d : p.sizes()) shape.push_back(size_t(d));
    c.shapes.push_back(shape);
  }
  c.compressed = options.compressor != "none" && !options.compressor.empty();
  // It applies where a compressed exchange at stage 0 sends a layer uncompressed (below compress_min_bytes); anywhere
  // else nothing read it, and those layers trained without the momentum asked for, without a word.
  if (options.dense_momentum != 0 && (!(options.dense_momentum > 0 && options.dense_momentum < 1) || !c.compressed ||
                                      options.zero_stage != 0 || options.compress_min_bytes == 0))
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: dense_momentum = {} with compressor '{}', zero_stage {} and compress_min_bytes {}; "
        "allowed: 0, or a momentum in (0, 1) for the layers a compressor at zero_stage 0 sends uncompressed (below "
        "compress_min_bytes > 0)",
        options.dense_momentum, options.compressor, options.zero_stage, options.compress_min_bytes));
  const ZeroIntWire int_wire = zero_int_wire(options.compressor);
  if (int_wire.bits == 4 && options.zero_stage == 0)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: compressor '{}' is ZeRO's reduce-scatter wire (int4 blocks by all-to-all) and "
        "zero_stage 0 has none; allowed with zero_stage 0: a compressor spec such as int8 or powersgd:rank=4; or "
        "zero_stage 1, 2 or 3",
        options.compressor));
#ifdef CONDUIT_WITH_COMPRESS
  if (options.zero_stage > 0 && int_wire.error_feedback) {
    // ZeRO's int blocks with error feedback: no compressor object, a residual per parameter (its state, checkpointed
    // as the compressors' are)
    for (size_t i = 0; i < c.params.size(); ++i) {
      compress::TensorState s;
      s.shape = c.shapes[i];
      s.seed = options.seed + 1000003 * i;
      s.stream = uint64_t(comm_->rank());
      c.states.push_back(std::move(s));
    }
  } else if (c.compressed && !(options.zero_stage > 0 && int_wire.bits == 4)) {
    // (int4 is only ZeRO's reduce-scatter wire, no compressor of its own)
    c.compressor = compress::parse_compressor(options.compressor);
    for (size_t i = 0; i < c.params.size(); ++i)
      c.states.push_back(c.compressor->make_state(c.shapes[i], options.seed + 1000003 * i, uint64_t(comm_->rank())));
  }
#else
  if (c.compressed)
    throw ConfigError(fmt::format("config: compressor: '{}' is not available (built without src/compress); allowed: none",
                                  options.compressor));
#endif
  if (options.backward_passes < 1)
    throw InvalidArgument(
        fmt::format("DistributedOptimizer: backward_passes = {}; allowed: 1 or more (backward calls each step)",
                    options.backward_passes));
  c.zero = options.zero_stage;
  if (c.zero < 0 || c.zero > 3)
    throw InvalidArgument(fmt::format("DistributedOptimizer: zero_stage {}; allowed: 0, 1, 2 or 3", c.zero));
  if (options.zero_reduce_each_pass) {
    // (a pass's buckets are exchanged as they fill, which the thread does with overlap only; a parameter some pass
    // leaves out would keep its bucket's exchange, and every later one, from starting)
    std::string why;
    if (c.zero != 2 && c.zero != 3)
      why = fmt::format("zero_stage {} (the passes' reduce-scatters are ZeRO-2's and 3's)", c.zero);
    else if (options.backward_passes < 2)
      why = fmt::format("backward_passes {} (one pass is one reduce-scatter either way)", options.backward_passes);
    else if (!options.overlap)
      why = "overlap off (a pass's buckets are exchanged as they fill)";
    else if (options.find_unused_parameters)
      why = "find_unused_parameters (each pass must reach every parameter)";
    if (!why.empty())
      throw InvalidArgument(
          fmt::format("DistributedOptimizer: zero_reduce_each_pass with {}; allowed with it: zero_stage 2 or 3, "
                      "backward_passes 2 or "
                      "more, overlap on and find_unused_parameters off",
                      why));
  }
  if (options.zero_gather_dtype != DType::f32 && options.zero_gather_dtype != DType::bf16 &&
      options.zero_gather_dtype != DType::f16 && options.zero_gather_dtype != DType::i8)
    throw InvalidArgument(
        fmt::format("DistributedOptimizer: zero_gather_dtype {}; allowed: f32, bf16, f16 or i8 (int8 blocks with a "
                    "scale each)",
                    dtype_name(options.zero_gather_dtype)));
  if (options.zero_gather_dtype != DType::f32 && c.zero != 3)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_gather_dtype {} is ZeRO-3's parameter gathers' wire, this optimizer has zero_stage "
        "{}; allowed: f32, or zero_stage 3",
        dtype_name(options.zero_gather_dtype), c.zero));
  c.gather_wire = options.zero_gather_dtype;
  if (options.zero_secondary_ranks > 1 && (c.zero != 3 || comm_->size() % options.zero_secondary_ranks != 0 ||
                                           options.zero_secondary_ranks >= comm_->size()))
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_secondary_ranks {} with zero_stage {} over {} ranks; allowed: 0 or 1 (none), or "
        "with zero_stage 3 a group size that divides the ranks and is smaller than their number",
        options.zero_secondary_ranks, c.zero, comm_->size()));
  const int shard = options.zero_shard_ranks;
  if (shard < 0 || (shard > 1 && (c.zero == 0 || comm_->size() % shard != 0 || shard >= comm_->size())))
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_shard_ranks {} with zero_stage {} over {} ranks; allowed: 0 or 1 (shard over all "
        "ranks), or with zero_stage 1, 2 or 3 a group size of 2 or more that divides the ranks and is smaller than "
        "their number",
        shard, c.zero, comm_->size()));
  if (shard > 1 && options.zero_secondary_ranks > 1)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_shard_ranks {} with zero_secondary_ranks {}: the gathers run within the shard "
        "group already; allowed: one of them",
        shard, options.zero_secondary_ranks));
  if (options.zero_secondary_ranks < 0)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_secondary_ranks {}; allowed: 0 or 1 (none), or a group size of 2 or more",
        options.zero_secondary_ranks));
  if (options.zero_allgather_bytes > 0 && (c.zero == 0 || c.zero == 3))
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_allgather_bytes {} sizes the calls of ZeRO-1/2's allgather behind the next "
        "forward, this optimizer has zero_stage {}; allowed: 0, or zero_stage 1 or 2",
        options.zero_allgather_bytes, c.zero));
  if (c.zero) check_zero_optimizer();
  // Every trainable parameter in one unit (frozen ones stay whole on every rank): each unit's parameter indices.
  auto check_units = [&] {
    std::map<const void*, int> index;
    for (size_t i = 0; i < c.params.size(); ++i) index[c.params[i].unsafeGetTensorImpl()] = int(i);
    std::vector<std::vector<int>> units;
    std::vector<int> unit_of(c.params.size(), -1);
    for (auto& u : options.units) {
      units.emplace_back();
      for (auto& p : u) {
        if (!p.defined() || !p.requires_grad()) continue;
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end())
          throw InvalidArgument(fmt::format(
              "DistributedOptimizer: zero_stage {}: unit {} holds a tensor that is not a trainable parameter of the "
              "model; allowed: units of the model's parameters (Net::units())",
              c.zero, units.size() - 1));
        if (unit_of[size_t(it->second)] >= 0)
          throw InvalidArgument(fmt::format(
              "DistributedOptimizer: zero_stage {}: parameter '{}' is in unit {} and in unit {}; allowed: each "
              "parameter in one unit",
              c.zero, c.names[size_t(it->second)], unit_of[size_t(it->second)], units.size() - 1));
        unit_of[size_t(it->second)] = int(units.size() - 1);
        units.back().push_back(it->second);
      }
    }
    for (size_t i = 0; i < c.params.size(); ++i)
      if (unit_of[i] < 0)
        throw InvalidArgument(fmt::format(
            "DistributedOptimizer: zero_stage {}: parameter '{}' is in no unit ({} given); allowed: units covering "
            "every trainable parameter, run through unit_hooks() (a Net's units()){}",
            c.zero, c.names[i], options.units.size(),
            c.zero >= 3 ? ", or zero_stage 0, 1 or 2" : ", or no units (the allgather after step() then blocks)"));
    return units;
  };
  // ZeRO's int8 reduce-scatter over several hosts: its groups, made before the model is re-seated on its slices
  // (collective: two splits over several hosts, which every rank sees alike; made after, a failure of theirs left the
  // model of a failed constructor without its parameters' storage at stage 3).
  bool int_groups_made = false;
  auto make_int_groups = [&] {
    if (int_groups_made) return;
    int_groups_made = true;
#ifdef CONDUIT_WITH_COMPRESS
    if (c.zero_wire == DType::i8 && options.zero_int_hierarchy)
      c.int_groups = compress::int_reduce_groups(c.slice_comm());
#endif
  };
  if (c.zero >= 3) {
    const auto units = check_units();
    c.build_unit_buckets(units);
    // (before the parameters become slices: then only this rank's would be there to broadcast)
    broadcast_initial_state();
    const int me = comm_->rank();
    if (shard > 1) {
      // Groups of `shard` consecutive ranks: the gathers' (their own split), the reduce-scatter's, and across the
      // groups the ranks of one index, which average each slice.
      c.gather_comm = comm_->split(me / shard, me);
      c.shard_comm = comm_->split(me / shard, me);
      c.replica_comm = comm_->split(me % shard, me);
    } else if (comm_->size() > 1) {
      c.gather_comm = comm_->split(0, me);
    }
    if (options.zero_secondary_ranks > 1) {
      // ZeRO++'s hpZ: groups of consecutive ranks (the ranks of a node, as launchers number them), each unit cut
      // into the group's parts.
      const int k = options.zero_secondary_ranks;
      c.sec_comm = comm_->split(comm_->rank() / k, comm_->rank());
      for (auto& bk : c.buckets) {
        Core::Bucket cut_k;
        cut_k.n = bk.n;
        Core::cut(cut_k, c.sec_comm->rank(), k);
        bk.sec_counts = cut_k.counts;
        bk.sec_mine = cut_k.mine;
      }
    }
    c.opt.rebuild_buckets = false;
    make_int_groups();
    optimizer_->param_groups()[0].params() = c.seat_zero(c.slice_comm().rank(), c.slice_comm().size());
  } else {
    // Reverse registration order approximates the order backward produces gradients.
    std::vector<int> order;
    for (int i = int(c.params.size()) - 1; i >= 0; --i) order.push_back(i);
    c.build_buckets(order);
    // ZeRO-1/2 with units and zero_prefetch: the allgather after step() goes on behind the next forward, each unit
    // waiting for its own parameters (units are checked whenever given: before the model is re-seated).
    std::vector<std::vector<int>> units;
    if (c.zero && !options.units.empty()) units = check_units();
    c.defer_slices = c.zero && !units.empty() && options.zero_prefetch && comm_->size() > 1;
    const int me = comm_->rank();
    if (c.zero) {
      c.opt.rebuild_buckets = false;  // the slices hold the optimizer's state
      if (shard > 1) {
        // Sharded within groups of `shard` consecutive ranks (FSDP's _HYBRID_SHARD_ZERO2): the buckets' slices cut
        // over the group, reduce-scattered within it and averaged across the groups, the stepped slices gathered
        // within it.
        c.shard_comm = comm_->split(me / shard, me);
        c.replica_comm = comm_->split(me % shard, me);
      }
      make_int_groups();
      optimizer_->param_groups()[0].params() = c.seat_zero(c.slice_comm().rank(), c.slice_comm().size());
    }
    broadcast_initial_state();
    if (c.defer_slices) {
      c.build_pieces(units, c.slice_comm().rank(), c.slice_comm().size());
      c.unit_params = units;
      c.gather_comm = comm_->split(shard > 1 ? me / shard : 0, me);
    }
  }
  make_int_groups();  // (where no stage above made them)
  std::weak_ptr<Core> weak = core_;
  for (size_t i = 0; i < c.params.size(); ++i) {
    c.params[i].register_hook([weak, i](torch::Tensor grad) {
      if (auto core = weak.lock()) core->on_grad(int(i), grad);
    });
    if (c.zero >= 2) {
      auto acc = torch::autograd::impl::grad_accumulator(c.params[i]);
      acc->add_post_hook(std::make_unique<DropGradient>(c.params[i]));
      c.accumulators.push_back(std::move(acc));
      c.params[i].mutable_grad().reset();
    }
  }
  c.thread = std::thread([&c] { c.loop(); });
}

void DistributedOptimizer::check_zero_optimizer() {
  Core& c = *core_;
  // The reduce-scatter's wire: f32, a 16-bit float (fp16 or bf16, stateless casts) or int8/int4 blocks (by
  // all-to-all, ZeRO++'s qgZ; as there without error feedback, or with it: ef:int8, ef:int4); the slices stay f32.
  const ZeroIntWire int_wire = zero_int_wire(c.opt.compressor);
  if (c.opt.compressor == "fp16" || c.opt.compressor == "bf16")
    c.zero_wire = c.opt.compressor == "fp16" ? DType::f16 : DType::bf16;
  else if (int_wire.bits > 0)
    c.zero_wire = DType::i8, c.zero_bits = int_wire.bits, c.zero_ef = int_wire.error_feedback;
  else if (c.compressed)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_stage {} reduce-scatters the gradients, compressor '{}' cannot go with it; "
        "allowed: compressor none, fp16, bf16, int8 or int4 (without parameters: the reduce-scatter's wire), ef:int8 "
        "or ef:int4 (with error feedback), or zero_stage 0",
        c.zero, c.opt.compressor));
  if (c.opt.find_unused_parameters)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_stage {} steps slices that span several parameters, so a parameter no rank used "
        "cannot be left out; allowed: find_unused_parameters false, or zero_stage 0",
        c.zero));
  // Each rank steps its slice alone: right for an optimizer whose update of an element reads only that element's
  // gradient and state (an audit: LBFGS, whose line search spans the whole parameter vector, stepped each slice on
  // its own and was taken, silently wrong).
  torch::optim::Optimizer* o = optimizer_.get();
  // (Adagrad is element-wise too, but libtorch's makes its state for the whole parameters when constructed: the
  // state check below refuses it)
  if (!dynamic_cast<torch::optim::SGD*>(o) && !dynamic_cast<torch::optim::Adam*>(o) &&
      !dynamic_cast<torch::optim::AdamW*>(o) && !dynamic_cast<torch::optim::RMSprop*>(o))
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_stage {} steps each rank's slice of the parameters alone, which only an "
        "element-wise optimizer does right; allowed: SGD, Adam, AdamW or RMSprop, or zero_stage 0",
        c.zero));
  auto& groups = optimizer_->param_groups();
  std::set<const void*> trainable, given;
  for (auto& p : c.params) trainable.insert(p.unsafeGetTensorImpl());
  for (auto& g : groups)
    for (auto& p : g.params())
      if (p.requires_grad()) given.insert(p.unsafeGetTensorImpl());  // (frozen ones never step)
  if (groups.size() != 1 || given != trainable)
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_stage {} needs an optimizer of one parameter group over exactly the model's {} "
        "trainable parameters; it has {} group(s) over {} trainable ones, {} of them the model's; allowed: one group "
        "of model->parameters(), or zero_stage 0",
        c.zero, trainable.size(), groups.size(), given.size(),
        std::count_if(given.begin(), given.end(), [&](const void* p) { return trainable.count(p) > 0; })));
  if (!optimizer_->state().empty())
    throw InvalidArgument(fmt::format(
        "DistributedOptimizer: zero_stage {} gives the optimizer this rank's slices as parameters, and it has state "
        "for the whole parameters already; allowed: an optimizer that has not stepped (load a checkpoint's optimizer "
        "state after constructing the DistributedOptimizer)",
        c.zero));
}

DistributedOptimizer::~DistributedOptimizer() {
  {
    Core& c = *core_;
    std::unique_lock<std::mutex> lk(c.mu);
    // The buckets the backward made ready go before the thread stops: every rank's backward made the same ones ready,
    // while each rank's thread had got to a bucket of its own (stopping there left a peer whose thread had begun a
    // later one waiting for its deadline, 300 s by default, its communicator then aborted). (Without overlap none
    // went before a flush, which synchronize() waits out; after a failed one the thread exchanges no more. With
    // find_unused_parameters the ranks that used a parameter no other did have its bucket ready alone, and wait.)
    if (c.opt.overlap) c.cv.wait(lk, [&] { return c.error || c.next >= c.tasks() || !c.task_ready(c.next); });
    c.stop = true;
    core_->alive = false;
  }
  core_->cv.notify_all();
  if (core_->thread.joinable()) core_->thread.join();
}

namespace {

// The element type a broadcast moves `t` as: a broadcast copies bits, so a type the collectives do not name goes as
// one of its size (bool as u8, int16 as f16's two bytes, complex64 as i64). (Bool, half and bf16 buffers, a mask or a
// frozen half-precision embedding, were refused, and such a model could not be wrapped on more than one rank.)
DType to_dtype(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat: return DType::f32;
    case torch::kDouble: return DType::f64;
    case torch::kLong: return DType::i64;
    case torch::kInt: return DType::i32;
    case torch::kByte: return DType::u8;
    case torch::kChar: return DType::i8;
    case torch::kHalf:
      return DType::f16;
    case torch::kBFloat16:
      return DType::bf16;
    default:
      break;
  }
  switch (t.element_size()) {
    case 1:
      return DType::u8;
    case 2:
      return DType::f16;
    case 4:
      return DType::i32;
    case 8:
      return DType::i64;
    default:
      throw InvalidArgument(
          fmt::format("train: tensors of type {} ({} bytes an element) cannot be broadcast; allowed: "
                      "elements of 1, 2, 4 or 8 bytes",
                      c10::toString(t.scalar_type()), t.element_size()));
  }
}

}  // namespace

// Broadcasts `tensors` from rank 0, coalesced: one collective per element type and up to 64 MiB (a broadcast per
// tensor paid its latency 27 times a step for ResNet-18's BatchNorm buffers, 62 times at start-up for its
// parameters; the cap bounds the staging copy for a model of billions of parameters: a tensor over it goes alone, in
// place). Returns the bytes broadcast.
static uint64_t broadcast_coalesced(const std::vector<torch::Tensor>& tensors, coll::Communicator& comm,
                                    double timeout_s) {
  if (comm.size() == 1) return 0;
  torch::NoGradGuard ng;
  coll::CollOptions co;
  co.timeout_s = timeout_s;
  constexpr int64_t kChunkBytes = int64_t(64) << 20;
  uint64_t bytes = 0;
  auto flush = [&](std::vector<torch::Tensor>& group) {
    if (group.empty()) return;
    if (group.size() == 1 && group[0].is_contiguous()) {  // (one tensor, over the cap or alone: in place, no copy)
      torch::Tensor& t = group[0];
      comm.broadcast(t.data_ptr(), size_t(t.numel()), to_dtype(t), 0, co).wait();
      bytes += uint64_t(t.numel()) * uint64_t(t.element_size());
      group.clear();
      return;
    }
    std::vector<torch::Tensor> flat;
    for (auto& t : group) flat.push_back(t.reshape(-1));
    torch::Tensor all = torch::cat(flat).contiguous();
    comm.broadcast(all.data_ptr(), size_t(all.numel()), to_dtype(all), 0, co).wait();
    bytes += uint64_t(all.numel()) * uint64_t(all.element_size());
    int64_t off = 0;
    for (auto& t : group) {
      t.copy_(all.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
    group.clear();
  };
  std::map<int, std::pair<std::vector<torch::Tensor>, int64_t>> groups;  // scalar type -> tensors, their bytes
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    to_dtype(t);  // (refused before anything is sent)
    auto& [group, held] = groups[static_cast<int>(t.scalar_type())];
    const int64_t b = t.numel() * int64_t(t.element_size());
    if (!group.empty() && held + b > kChunkBytes) {
      flush(group);
      held = 0;
    }
    group.push_back(t);
    held += b;
  }
  for (auto& [type, g] : groups) flush(g.first);
  return bytes;
}

uint64_t broadcast_buffers(torch::nn::Module& model, coll::Communicator& comm, double timeout_s) {
  return broadcast_coalesced(model.buffers(), comm, timeout_s);
}

void average_buffers(torch::nn::Module& model, coll::Communicator& comm) {
  if (comm.size() == 1) return;
  torch::NoGradGuard ng;
  std::vector<torch::Tensor> floats;
  for (auto& b : model.buffers())
    if (b.scalar_type() == torch::kFloat && b.numel() > 0) floats.push_back(b);
  if (floats.empty()) return;
  std::vector<torch::Tensor> flat;
  for (auto& b : floats) flat.push_back(b.reshape(-1));
  torch::Tensor all = torch::cat(flat);
  coll::CollOptions o;
  o.blocking = true;
  comm.allreduce(all.data_ptr(), size_t(all.numel()), DType::f32, ReduceOp::avg, o).wait();
  int64_t off = 0;
  for (auto& b : floats) {
    b.copy_(all.narrow(0, off, b.numel()).view_as(b));
    off += b.numel();
  }
}

std::vector<std::pair<std::string, torch::Tensor>> trainable_parameters(torch::nn::Module& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  std::set<const void*> seen;
  for (auto& named : model.named_parameters())
    if (named.value().requires_grad() && seen.insert(named.value().unsafeGetTensorImpl()).second)
      out.emplace_back(named.key(), named.value());
  return out;
}

void broadcast_module(torch::nn::Module& model, coll::Communicator& comm, Broadcast parameters, double timeout_s) {
  std::vector<torch::Tensor> params;
  std::set<const void*> seen;  // (a tied weight is listed twice)
  if (parameters != Broadcast::kNoParameters)
    for (auto& p : model.parameters())
      if ((parameters == Broadcast::kAllParameters || !p.requires_grad()) &&
          seen.insert(p.unsafeGetTensorImpl()).second)
        params.push_back(p);
  broadcast_coalesced(params, comm, timeout_s);
  broadcast_buffers(model, comm, timeout_s);
}

void DistributedOptimizer::broadcast_initial_state() {
  broadcast_module(*model_, *comm_, Broadcast::kAllParameters, core_->opt.timeout_s);
}

void DistributedOptimizer::zero_grad() {
  {
    // Gradients of a backward not stepped yet: without overlap they are only in the buckets and go; with it some may
    // be in an exchange the other ranks take part in, which cannot be withdrawn.
    std::lock_guard<std::mutex> lk(core_->mu);
    const bool arrived = std::any_of(core_->got.begin(), core_->got.end(), [](int g) { return g != 0; });
    if (arrived && core_->opt.overlap)
      throw InvalidArgument(
          "DistributedOptimizer: zero_grad() after a backward whose gradients are being exchanged; allowed: step() "
          "(or synchronize()) first");
    if (arrived) core_->reset_step_locked();
    core_->synced = false;
  }
  last_step_end_ = now_s();  // compute time counts from here to step()
  {
    std::lock_guard<std::mutex> lk(core_->mu);
    core_->gather_s = 0;  // (gathers before it, an evaluation's, were not in this step's compute time)
  }
  for (auto& p : core_->params) {
    if (p.grad().defined()) {
      p.mutable_grad().detach_();
      p.mutable_grad().zero_();
    }
  }
}

void DistributedOptimizer::synchronize() {
  Core& c = *core_;
  if (c.ahead.b >= 0) c.finish_ahead();  // a unit gathered ahead that no pass ran: counted in this step
  if (c.sec_comm)
    for (auto& bk : c.buckets) std::vector<uint8_t>().swap(bk.secondary);  // (a forward no backward followed)
  if (!c.deferred.empty()) {
    // ZeRO-1/2: the slices of a unit no forward ran (the optimizer steps them). A unit whose parameters got gradients
    // with their allgather still in flight was read before its hook waited: stale parameters, refused.
    int stale = -1;
    {
      std::lock_guard<std::mutex> lk(c.mu);
      for (size_t u = 0; u < c.unit_needs.size() && stale < 0; ++u)
        for (int k : c.unit_needs[u])
          if (c.deferred[size_t(k)].on)
            for (int i : c.unit_params[u])
              if (c.got[size_t(i)]) stale = int(u);
    }
    c.finish_all_deferred(true);
    if (stale >= 0)
      throw InvalidArgument(fmt::format(
          "DistributedOptimizer: zero_stage {}: unit {}'s parameters got gradients while their allgather after the "
          "last step was in flight (the model read them before the unit's hook: Net::set_unit_hooks(unit_hooks()) "
          "not called, or a parameter used outside its unit); allowed: a model that runs every unit through the "
          "hooks, or no DistOptions::units",
          c.zero, stale));
  }
  const double t0 = now_s();
  std::unique_lock<std::mutex> lk(c.mu);
  if (c.synced) return;  // averaged into .grad already: a second call leaves them (it averaged zeros into them)
  // Which parameters any rank had a gradient for, agreed before the buckets still waiting go (the backward is over:
  // `got` is final). On the caller's communicator while the thread may still be exchanging full buckets on its own;
  // a bucket holding a parameter no rank used was full on no rank, so it is among those still waiting everywhere.
  std::exception_ptr flags_error;
  if (c.opt.find_unused_parameters) {
    std::vector<uint8_t> used(c.got.size());
    for (size_t k = 0; k < used.size(); ++k) used[k] = c.got[k] != 0;
    lk.unlock();
    const int w = comm_->size();
    try {
      coll::CollOptions co;
      co.timeout_s = c.opt.timeout_s;
      if (w > 1) comm_->allreduce(used.data(), used.size(), DType::u8, ReduceOp::max, co).wait();
    } catch (...) {
      flags_error = std::current_exception();
    }
    lk.lock();
    // Without the agreement this rank would exchange the waiting buckets whole while the others skip what no rank
    // used: the thread stops instead, and the step fails with the cause.
    if (flags_error && !c.error) c.error = flags_error;
    if (!flags_error) {
      c.used = std::move(used);
      const double f = w > 1 ? 2.0 * (w - 1) / w : 0.0;  // counted as the buckets are: ring-equivalent volume
      c.step.payload_bytes += c.used.size();
      c.step.bytes_sent += uint64_t(f * double(c.used.size()) + 0.5);
      c.step.bytes_recv += uint64_t(f * double(c.used.size()) + 0.5);
    }
  }
  c.flush = true;
  c.cv.notify_all();
  c.cv.wait(lk, [&] { return c.next >= c.tasks(); });
  const double t1 = now_s();
  if (c.error || flags_error) {
    auto e = c.error ? c.error : flags_error;
    c.error = nullptr;
    c.reset_step_locked();
    std::rethrow_exception(e);
  }
  if (c.opt.trace) c.opt.trace->complete("wait for communication", 0, t0, t1);
  const std::vector<uint8_t> used = c.used;
  if (!c.zero) {  // (ZeRO: the averaged slices are in the slices' .grad already)
    torch::NoGradGuard ng;
    for (auto& bk : c.buckets) {
      for (size_t k = 0; k < bk.params.size(); ++k) {
        torch::Tensor& p = c.params[size_t(bk.params[k])];
        if (!used.empty() && !used[size_t(bk.params[k])]) {  // no rank's: the optimizer leaves it
          p.mutable_grad() = torch::Tensor();
          continue;
        }
        auto shape = p.sizes();
        torch::Tensor avg =
            torch::from_blob(bk.flat.data() + bk.offsets[k], shape, torch::TensorOptions().dtype(torch::kFloat));
        if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
        p.mutable_grad().copy_(avg);
      }
    }
  }
  last_ = c.step;
  // (ZeRO-3's gathers blocked forward and backward: communication, not compute)
  last_.compute_s = last_step_end_ >= 0 ? t0 - last_step_end_ - c.gather_s : 0;
  last_.exposed_comm_s = t1 - t0 + c.gather_s;
  c.step = StepStats{};
  c.gather_s = 0;
  bool rebuild = c.record_order;
  c.record_order = false;
  std::vector<int> order = c.ready_order;
  c.reset_step_locked();
  c.synced = true;
  // ZeRO-3 holds 1/W of the gradients between steps: the released bucket buffers kept for reuse go too (one unit
  // can be most of a model: two spares of the mlp's first layer were 1.7 times its whole gradient).
  if (c.zero >= 3) std::vector<std::vector<float>>().swap(c.spare);
  lk.unlock();
  if (rebuild && c.opt.rebuild_buckets) {
    // Agree on rank 0's observed order (parameters without a gradient keep reverse registration order at the end).
    std::vector<char> seen(c.params.size(), 0);
    for (int i : order) seen[size_t(i)] = 1;
    for (int i = int(c.params.size()) - 1; i >= 0; --i)
      if (!seen[size_t(i)]) order.push_back(i);
    std::vector<int64_t> o(order.begin(), order.end());
    coll::CollOptions co;
    co.timeout_s = c.opt.timeout_s;  // (the default's 300 s where a caller set its own deadline)
    if (comm_->size() > 1) comm_->broadcast(o.data(), o.size(), DType::i64, 0, co).wait();
    std::vector<int> agreed(o.begin(), o.end());
    std::vector<int> current;
    for (auto& bk : c.buckets) current.insert(current.end(), bk.params.begin(), bk.params.end());
    if (agreed != current) {
      lk.lock();
      c.build_buckets(agreed);
    }
  }
}

void DistributedOptimizer::step() {
  // After an explicit synchronize() the averaged gradients are in .grad already; a second pass would find no bucket
  // ready and average zeros into them.
  synchronize();  // returns at once after an explicit one
  // A gather ahead reads the slices the optimizer is about to step (one started after an explicit synchronize()).
  if (core_->ahead.b >= 0) core_->finish_ahead();
  {
    std::lock_guard<std::mutex> lk(core_->mu);
    core_->synced = false;
  }
  const double t0 = now_s();
  optimizer_->step();
  const double t1 = now_s();
  last_.step_s = t1 - t0;
  if (core_->opt.trace) core_->opt.trace->complete("step", 0, t0, t1);
  if (core_->zero == 1 || core_->zero == 2) allgather_slices();
  if (core_->zero >= 3) {
    // The slices moved: whole parameters still held are stale. Those of whole_parameters() are gathered again, the
    // others (a unit no backward reached) released.
    for (size_t b = 0; b < core_->buckets.size(); ++b) {
      auto& bk = core_->buckets[b];
      if (core_->pinned && bk.resident)
        core_->gather(int(b), false, "refresh", true);
      else
        Core::release(bk);
    }
  }
  add_to_totals(last_);
}

namespace {
// ZeRO-3's hooks around each unit of the model's forward.
class ZeroUnits : public UnitHooks {
 public:
  explicit ZeroUnits(std::weak_ptr<DistributedOptimizer::Core> core) : core_(std::move(core)) {}
  void before_forward(int unit) override;
  void after_forward(int unit, torch::Tensor& out) override;

 private:
  std::weak_ptr<DistributedOptimizer::Core> core_;
};
}  // namespace

void ZeroUnits::before_forward(int unit) {
  auto c = core_.lock();
  if (!c) return;
  const int units = int(c->zero >= 3 ? c->unit_bucket.size() : c->unit_needs.size());
  if (unit < 0 || unit >= units)
    throw InvalidArgument(
        fmt::format("DistributedOptimizer: zero_stage {}: unit {} ran; allowed: 0..{} (DistOptions::units)", c->zero,
                    unit, units - 1));
  if (c->zero < 3) {  // the deferred allgather of this unit's parameters
    for (int k : c->unit_needs[size_t(unit)]) c->finish_deferred(k, true, unit);
    return;
  }
  if (c->unit_bucket[size_t(unit)] >= 0) c->gather(c->unit_bucket[size_t(unit)], !c->pinned, "forward");
  c->start_ahead(c->next_bucket(unit, 1), !c->pinned, "forward");  // behind this unit's forward
}

void ZeroUnits::after_forward(int unit, torch::Tensor& out) {
  auto c = core_.lock();
  if (!c || c->zero < 3 || unit < 0 || unit >= int(c->unit_bucket.size())) return;
  const int b = c->unit_bucket[size_t(unit)];
  if (b < 0) return;
  if (torch::GradMode::is_enabled() && out.defined() && out.requires_grad()) {
    // Gathered again once the gradient of its output is known: before its own backward runs.
    std::weak_ptr<DistributedOptimizer::Core> weak = c;
    out.register_hook([weak, b, unit](const torch::Tensor&) {
      auto core = weak.lock();
      if (!core) return;
      // The unit's backward of this pass begins: its gradients count from here (a parameter that got none in an
      // earlier pass must not make a later one release the unit early).
      core->buckets[size_t(b)].pass_got = 0;
      core->gather(b, !core->pinned, "backward");
      core->start_ahead(core->next_bucket(unit, -1), !core->pinned, "backward");  // behind this unit's backward
    });
    if (unit == int(c->unit_bucket.size()) - 1) return;  // its backward comes next
    if (!c->pinned) c->keep_secondary(c->buckets[size_t(b)]);
  }
  if (!c->pinned) DistributedOptimizer::Core::release(c->buckets[size_t(b)]);
}

std::shared_ptr<UnitHooks> DistributedOptimizer::unit_hooks() {
  if (core_->zero < 3 && !core_->defer_slices) return nullptr;
  return std::make_shared<ZeroUnits>(core_);
}

namespace {
struct WholeParameters {
  std::shared_ptr<DistributedOptimizer::Core> core;
  ~WholeParameters() {
    if (--core->pinned > 0) return;
    for (auto& bk : core->buckets) DistributedOptimizer::Core::release(bk);
  }
};
}  // namespace

std::shared_ptr<void> DistributedOptimizer::whole_parameters() {
  if (core_->zero < 3) {
    core_->finish_all_deferred(false);  // (not a training step's)
    std::lock_guard<std::mutex> lk(core_->mu);
    total_.comm_s += std::exchange(core_->outside_comm_s, 0.0);
    return nullptr;
  }
  auto handle = std::make_shared<WholeParameters>();
  ++core_->pinned;
  handle->core = core_;  // (a gather that fails below releases every unit again)
  for (size_t b = 0; b < core_->buckets.size(); ++b) core_->gather(int(b), false, "whole");
  return handle;
}

uint64_t DistributedOptimizer::parameter_bytes_held() const {
  uint64_t n = 0, secondary = 0;
  if (core_->zero >= 3) {
    for (auto& bk : core_->buckets) {
      n += (bk.resident ? bk.n : 0) + (bk.shard.defined() ? size_t(bk.shard.numel()) : 0);
      if (!bk.secondary.empty())  // (not an empty part's stand-in)
        secondary += bk.sec_counts[size_t(core_->sec_comm->rank())] * dtype_size(core_->sec_wire());
    }
  } else {
    for (size_t k : core_->numel) n += k;
  }
  return n * sizeof(float) + secondary;
}

void DistributedOptimizer::allgather_slices() {
  // Every rank's stepped slices into every rank's parameters, in place: all buckets issued, then waited for (the
  // communicator runs them in order).
  Core& c = *core_;
  coll::Communicator& group = c.slice_comm();  // (sharded within groups: the group's)
  const int w = group.size();
  if (w == 1) return;
  const double t0 = now_s();
  coll::CollOptions co;
  co.timeout_s = c.opt.timeout_s;
  float* flat = c.flat_params.data_ptr<float>();
  const uint64_t n = uint64_t(c.flat_params.numel());
  const uint64_t bytes = uint64_t(double(w - 1) / w * double(n * sizeof(float)) + 0.5);
  if (c.defer_slices) {
    // Started in the order the next forward needs the buckets (on every rank the same), finished there: the bytes
    // are this step's, the time the next one's (what its forward waits is exposed). (step() synchronized first,
    // which finished the last step's.)
    for (auto& d : c.deferred) {
      float* bucket = flat + c.buckets[size_t(d.bucket)].base;
      d.t0 = now_s();
      d.work = c.gather_comm->allgatherv(bucket + d.src, bucket + d.begin, d.counts, DType::f32, co);
      d.on = true;
    }
    last_.bytes_sent += bytes;
    last_.bytes_recv += bytes;
    return;
  }
  std::vector<coll::Work> works;
  for (auto& bk : c.buckets)
    works.push_back(group.allgatherv(flat + bk.base + bk.mine, flat + bk.base, bk.counts, DType::f32, co));
  std::exception_ptr failed;
  for (auto& wk : works) {
    try {
      wk.wait();
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  const double t1 = now_s();
  last_.comm_s += t1 - t0;
  last_.exposed_comm_s += t1 - t0;
  last_.bytes_sent += bytes;
  last_.bytes_recv += bytes;
  if (c.opt.trace) c.opt.trace->complete("communicate", 0, t0, t1, {{"bytes", n * sizeof(float)}, {"op", "allgather"}});
}

void DistributedOptimizer::add_to_totals(const StepStats& s) {
  total_ += s;
}

std::vector<std::vector<int>> DistributedOptimizer::bucket_layout() const {
  std::lock_guard<std::mutex> lk(core_->mu);
  std::vector<std::vector<int>> out;
  for (auto& b : core_->buckets) out.push_back(b.params);
  return out;
}

size_t DistributedOptimizer::optimizer_elements() const {
  size_t n = 0;
  if (core_->zero) {
    for (auto& bk : core_->buckets) n += bk.counts[size_t(core_->slice_comm().rank())];
  } else {
    for (size_t k : core_->numel) n += k;
  }
  return n;
}

namespace zero_spares {

size_t pick(const std::vector<size_t>& capacities, size_t n, size_t second) {
  size_t best = capacities.size();
  for (size_t k = 0; k < capacities.size(); ++k)
    if (capacities[k] >= n && (n > second || capacities[k] <= second) &&
        (best == capacities.size() || capacities[k] < capacities[best]))
      best = k;
  return best;
}

std::vector<size_t> kept(const std::vector<size_t>& capacities, size_t second, int others) {
  std::vector<size_t> order(capacities.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return capacities[a] > capacities[b]; });
  std::vector<size_t> out;
  int large = 0, small = 0;
  for (size_t k : order)
    if (capacities[k] > second ? large++ < 1 : small++ < others) out.push_back(k);
  return out;
}

}  // namespace zero_spares

uint64_t DistributedOptimizer::gradient_bytes_held() const {
  std::lock_guard<std::mutex> lk(core_->mu);
  uint64_t bytes = 0;
  for (auto& bk : core_->buckets) {
    bytes += bk.flat.capacity() * sizeof(float);
    // (stage 1's slice gradients are views of the buckets)
    if (bk.shard.defined() && core_->zero >= 2) bytes += uint64_t(bk.shard.grad().numel()) * sizeof(float);
  }
  for (auto& s : core_->spare) bytes += s.capacity() * sizeof(float);
  for (auto& p : core_->params)
    if (p.grad().defined()) bytes += uint64_t(p.grad().numel()) * sizeof(float);
#ifdef CONDUIT_WITH_COMPRESS
  // (error feedback on ZeRO's int wire: every parameter's residual, whole on every rank)
  for (auto& s : core_->states)
    if (auto it = s.buffers.find("qgz.residual"); it != s.buffers.end()) bytes += it->second.size() * sizeof(float);
#endif
  return bytes;
}

uint64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  uint64_t bytes = 0;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) bytes += uint64_t(t.numel()) * uint64_t(t.element_size());
  };
  for (const auto& [key, st] : optimizer.state()) {
    if (auto* s = dynamic_cast<const torch::optim::SGDParamState*>(st.get())) {
      add(s->momentum_buffer());
    } else if (auto* a = dynamic_cast<const torch::optim::AdamParamState*>(st.get())) {
      add(a->exp_avg()), add(a->exp_avg_sq()), add(a->max_exp_avg_sq());
    } else if (auto* aw = dynamic_cast<const torch::optim::AdamWParamState*>(st.get())) {
      add(aw->exp_avg()), add(aw->exp_avg_sq()), add(aw->max_exp_avg_sq());
    }
  }
  return bytes;
}

std::string DistributedOptimizer::compressor_name() const {
  if (core_->zero_wire == DType::i8) return core_->opt.compressor;  // (int4 has no compressor object)
#ifdef CONDUIT_WITH_COMPRESS
  if (core_->compressor) return core_->compressor->name();
#endif
  return "none";
}

std::vector<uint8_t> DistributedOptimizer::save_compressor_state() const {
  std::vector<uint8_t> out;
  auto put64 = [&](uint64_t v) {
    for (int k = 0; k < 8; ++k) out.push_back(uint8_t(v >> (8 * k)));
  };
#ifdef CONDUIT_WITH_COMPRESS
  put64(core_->states.size());
  for (auto& s : core_->states) {
    auto b = s.save();
    put64(b.size());
    out.insert(out.end(), b.begin(), b.end());
  }
#else
  put64(0);
#endif
  // The bucket layout, once rebuilt from the first step's gradient order: a resumed run starts on it (it started on
  // reverse registration order and rebuilt after its first step, and with 3 or more ranks the buckets' different
  // ring chunks summed that step in another order: not bit for bit).
  std::lock_guard<std::mutex> lk(core_->mu);
  put64(kLayoutMagic);
  put64(!core_->record_order && core_->opt.rebuild_buckets ? 1 : 0);  // (1: rebuilt from the gradients' order)
  size_t count = 0;
  for (const auto& bk : core_->buckets) count += bk.params.size();
  put64(count);
  for (const auto& bk : core_->buckets)
    for (int i : bk.params) put64(uint64_t(i));
  return out;
}

void DistributedOptimizer::load_compressor_state(const std::vector<uint8_t>& bytes) {
  size_t pos = 0;
  auto get64 = [&]() {
    if (pos + 8 > bytes.size()) throw InvalidArgument("checkpoint: compressor state is truncated");
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= uint64_t(bytes[pos + size_t(k)]) << (8 * k);
    pos += 8;
    return v;
  };
  uint64_t n = get64();
#ifdef CONDUIT_WITH_COMPRESS
  if (n != core_->states.size())
    throw InvalidArgument(fmt::format("checkpoint: compressor state holds {} tensors, this run has {} (same "
                                      "compressor and model needed to resume)",
                                      n, core_->states.size()));
  std::vector<compress::TensorState> loaded;
  for (size_t i = 0; i < core_->states.size(); ++i) {
    uint64_t len = get64();
    // (pos + len wrapped for a length near 2^64 and the state was read past the buffer's end)
    if (len > bytes.size() - pos) throw InvalidArgument("checkpoint: compressor state is truncated");
    loaded.push_back(compress::TensorState::load(std::span<const uint8_t>(bytes.data() + pos, len)));
    pos += len;
    // Refused here, naming the tensor, not later on the communication thread (a model of as many tensors but
    // other shapes) or never (a state of another rank's stream).
    const auto& was = loaded.back();
    const auto& now = core_->states[i];
    if (was.shape != now.shape || was.stream != now.stream)
      throw InvalidArgument(fmt::format(
          "checkpoint: compressor state of tensor {} is for shape [{}] on stream {}, this run's is [{}] on stream {} "
          "(same model and rank needed to resume)",
          i, fmt::join(was.shape, ", "), was.stream, fmt::join(now.shape, ", "), now.stream));
  }
#else
  if (n != 0) throw InvalidArgument("checkpoint: it holds compressor state but this build has no compressors");
#endif
  // The bucket layout (absent from checkpoints of before 2026-12-06).
  std::vector<int> order;
  bool rebuilt = false;
  if (pos < bytes.size()) {
    if (get64() != kLayoutMagic)
      throw InvalidArgument(
          fmt::format("checkpoint: compressor state has {} bytes after its last tensor's that are not a bucket layout",
                      bytes.size() - pos + 8));
    rebuilt = get64() == 1;
    const uint64_t count = get64();
    if (count != core_->params.size() || count > (bytes.size() - pos) / 8)
      throw InvalidArgument(fmt::format("checkpoint: its bucket layout holds {} parameters, this run has {}", count,
                                        core_->params.size()));
    std::vector<char> seen(core_->params.size(), 0);
    for (uint64_t k = 0; k < count; ++k) {
      const uint64_t i = get64();
      if (i >= count || seen[i])
        throw InvalidArgument(fmt::format("checkpoint: its bucket layout names parameter {} twice or out of range", i));
      seen[i] = 1;
      order.push_back(int(i));
    }
    if (pos != bytes.size())
      throw InvalidArgument(
          fmt::format("checkpoint: compressor state has {} bytes after its bucket layout", bytes.size() - pos));
  }
#ifdef CONDUIT_WITH_COMPRESS
  core_->states = std::move(loaded);  // all or nothing
#endif
  std::lock_guard<std::mutex> lk(core_->mu);
  if (rebuilt && core_->record_order && core_->opt.rebuild_buckets) {
    core_->build_buckets(order);
    core_->record_order = false;
  }
}

}  // namespace conduit::train
