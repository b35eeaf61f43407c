// Compressed collectives; see collectives.h.
#include "compress/collectives.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "compress/detail.h"
#include "compress/powersgd.h"
#include "core/clock.h"
#include "core/dtype.h"
#include "core/error.h"
#include "net/tags.h"

namespace conduit::compress {

namespace {

// One deadline for a whole public call (ReduceOptions.timeout_s, 0: the communicator's), each inner collective
// given the time left: each had the full timeout, so PowerSGD's up to four allreduces (and a refusal's vote) could
// wait four times it, while the quantized ring shared one. A negative or nan timeout is refused as the communicator
// refuses its own (it quietly became the default).
class CallDeadline {
 public:
  CallDeadline(const coll::Communicator& comm, const ReduceOptions& o)
      : at_(Deadline::after(coll::checked_timeout(o.timeout_s, "ReduceOptions.timeout_s") > 0 ? o.timeout_s
                                                                                              : comm.timeout_s())) {}
  const Deadline& deadline() const { return at_; }
  // For the next collective (computed as it is submitted; each is waited for before the next).
  coll::CollOptions opts() const {
    coll::CollOptions c;
    c.timeout_s = std::max(at_.remaining_seconds(), 1e-3);  // (spent: fails at once, naming the operation)
    return c;
  }

 private:
  Deadline at_;
};

void scale(std::span<float> x, float f) {
  for (auto& v : x) v *= f;
}

// Sums x over the communicator, sent as `wire` (f32, or f16/bf16 converted here and summed in f32 at each hop).
void allreduce_wire(coll::Communicator& comm, DType wire, std::vector<float>& x, const coll::CollOptions& co) {
  if (x.empty()) return;
  if (wire == DType::f32) {
    comm.allreduce(x.data(), x.size(), DType::f32, ReduceOp::sum, co).wait();
    return;
  }
  std::vector<uint16_t> h(x.size());
  if (wire == DType::f16) convert_f32_to_f16(x.data(), h.data(), x.size());
  else convert_f32_to_bf16(x.data(), h.data(), x.size());
  comm.allreduce(h.data(), h.size(), wire, ReduceOp::sum, co).wait();
  if (wire == DType::f16) convert_f16_to_f32(h.data(), x.data(), x.size());
  else convert_bf16_to_f32(h.data(), x.data(), x.size());
}

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
}

// The sums of P or Q as every rank received them (bit-identical on all ranks, so all throw together): a sum beyond a
// 16-bit wire's range arrives as inf, and orthonormalising silently zeroed that column, the layer then sent nothing
// and its residual grew without end while the run went on. `averaged`: each rank's part was divided by W first.
void check_factor_sums(const std::vector<float>& x, DType wire, bool averaged, const char* what) {
  for (size_t i = 0; i < x.size(); ++i)
    if (!std::isfinite(x[i]))
      throw InvalidArgument(fmt::format(
          "powersgd: element {} of the {} {} is {} ({} wire): the factors outgrew the wire's range or the run "
          "diverged; allowed: finite {} — {}, a smaller learning rate, or a warm-up",
          i, averaged ? "averaged" : "summed", what, x[i], dtype_name(wire), averaged ? "means" : "sums",
          wire == DType::f16    ? "wire=bf16 (f32's exponent range, up to about 3.39e38) or f32"
          : wire == DType::bf16 ? "wire=f32 (bf16 tops out at about 3.39e38)"
                                : "values within f32's range"));
}

size_t powersgd_allreduce(coll::Communicator& comm, const PowerSgd& ps, const std::vector<TensorState*>& states,
                          const std::vector<std::span<float>>& data, const ReduceOptions& o, const CallDeadline& dl) {
  const int w = comm.size();
  // Averaged over f16, a round whose sum left the range (4 ranks of 20,000: every rank stopped, although the mean
  // fitted) is sent again with each rank's part divided by W before it is narrowed, as the fp16 compressor's avg
  // divides it: the mean crosses. Only then: divided at every step, small values (biases, the factors of small
  // gradients) fell W times further below f16's normal range on the default training path. The sums are the same
  // on every rank, so all send again together. P's scale drops out when it is orthonormalised; a Q sent as the mean
  // is not divided again, nor are the uncompressed tensors.
  const bool may_divide = o.average && ps.wire() == DType::f16 && w > 1;
  const float part = 1.0f / static_cast<float>(w);
  std::vector<PowerSgd::Plan> plans;
  size_t p_total = 0, raw_total = 0, q_total = 0;
  for (size_t t = 0; t < data.size(); ++t) {
    plans.push_back(ps.plan(data[t].size(), *states[t]));
    if (plans.back().compressed) {
      p_total += plans.back().p_len();
      q_total += plans.back().q_len();
    } else {
      raw_total += data[t].size();
    }
  }
  // Round 1: every P and every uncompressed tensor in one buffer.
  std::vector<float> buf1(p_total + raw_total);
  auto put_raw = [&] {
    size_t ro = p_total;
    for (size_t t = 0; t < data.size(); ++t) {
      if (plans[t].compressed) continue;
      if (!data[t].empty()) std::memcpy(buf1.data() + ro, data[t].data(), 4 * data[t].size());
      ro += data[t].size();
    }
  };
  size_t po = 0;
  for (size_t t = 0; t < data.size(); ++t) {
    if (!plans[t].compressed) continue;
    ps.phase_p(data[t], *states[t], std::span<float>(buf1).subspan(po, plans[t].p_len()));
    po += plans[t].p_len();
  }
  put_raw();
  // (kept to send again: this rank's P, small beside the tensors; the uncompressed tensors are still in data)
  std::vector<float> mine;
  if (may_divide) mine.assign(buf1.begin(), buf1.begin() + static_cast<std::ptrdiff_t>(p_total));
  allreduce_wire(comm, ps.wire(), buf1, dl.opts());
  const bool p_divided = may_divide && !all_finite(buf1);
  if (p_divided) {
    std::copy(mine.begin(), mine.end(), buf1.begin());
    put_raw();
    scale(buf1, part);
    allreduce_wire(comm, ps.wire(), buf1, dl.opts());
  }
  check_factor_sums(buf1, ps.wire(), p_divided, "P factors and uncompressed tensors");
  // Round 2: every Q.
  std::vector<float> buf2(q_total);
  po = 0;
  size_t qo = 0;
  for (size_t t = 0; t < data.size(); ++t) {
    if (!plans[t].compressed) continue;
    ps.phase_q(data[t], *states[t], std::span<float>(buf1).subspan(po, plans[t].p_len()),
               std::span<float>(buf2).subspan(qo, plans[t].q_len()));
    po += plans[t].p_len();
    qo += plans[t].q_len();
  }
  if (may_divide) mine = buf2;
  allreduce_wire(comm, ps.wire(), buf2, dl.opts());
  const bool q_divided = may_divide && !all_finite(buf2);
  if (q_divided) {
    buf2 = mine;
    scale(buf2, part);
    allreduce_wire(comm, ps.wire(), buf2, dl.opts());
  }
  check_factor_sums(buf2, ps.wire(), q_divided, "Q factors");
  po = 0;
  qo = 0;
  size_t ro = p_total;
  for (size_t t = 0; t < data.size(); ++t) {
    if (plans[t].compressed) {
      ps.finish(data[t], *states[t], std::span<const float>(buf1).subspan(po, plans[t].p_len()),
                std::span<const float>(buf2).subspan(qo, plans[t].q_len()), q_divided ? 1 : w, o.average, data[t]);
      po += plans[t].p_len();
      qo += plans[t].q_len();
    } else {
      if (!data[t].empty()) std::memcpy(data[t].data(), buf1.data() + ro, 4 * data[t].size());
      ro += data[t].size();
      if (o.average && !p_divided) scale(data[t], 1.0f / static_cast<float>(w));
      ps.skip(*states[t]);
    }
  }
  return ps.wire_size() * ((p_divided ? 2 : 1) * buf1.size() + (q_divided ? 2 : 1) * buf2.size());
}

}  // namespace

void majority_vote(std::span<const uint8_t> payloads, int n, std::span<float> out) {
  size_t d = out.size(), per = detail::ceil_div(d, 8);
  if (payloads.size() != per * static_cast<size_t>(n))
    throw InvalidArgument(fmt::format("majority_vote: {} bytes for {} ranks of {} elements (want {})",
                                      payloads.size(), n, d, per * n));
  std::vector<int32_t> neg(d, 0);
  for (int r = 0; r < n; ++r) {
    const uint8_t* p = payloads.data() + r * per;
    for (size_t i = 0; i < d; ++i) neg[i] += (p[i / 8] >> (i % 8)) & 1;
  }
  for (size_t i = 0; i < d; ++i) {
    int32_t s = n - 2 * neg[i];  // (#positive - #negative)
    out[i] = s > 0 ? 1.0f : (s < 0 ? -1.0f : 0.0f);
  }
}

void check_finite_or_abort(coll::Communicator& comm, std::span<const float> in, const std::string& compressor,
                           const char* what) {
  try {
    check_finite_input(in, compressor, what);
  } catch (const InvalidArgument& e) {
    comm.transport().abort(fmt::format("rank {}: {}", comm.rank(), e.what()));
    throw;
  }
}

// This rank's payload. A compressor that refuses (error feedback whose residual plus the gradient passed the floats)
// does so on this rank alone: the transport is aborted with its line first, so the peers waiting in the exchange stop
// with it instead of at their deadline.
static Bytes compress_or_abort(coll::Communicator& comm, const Compressor& c, std::span<const float> data,
                               TensorState& st) {
  try {
    return c.compress(data, st);
  } catch (const std::exception& e) {
    comm.transport().abort(fmt::format("rank {}: {}", comm.rank(), e.what()));
    throw;
  }
}

static size_t first_nonfinite(std::span<const float> x) {
  size_t i = 0;
  while (i < x.size() && std::isfinite(x[i])) ++i;
  return i;
}

// fp16 and bf16 pass nan and inf on, as an uncompressed allreduce does; but finite values beyond their range (a
// rank's own above fp16's 65504, or a sum, or averaged a mean, beyond it; bf16's largest is about 3.39e38, and f32
// values from about 3.3962e38 round to inf) turned into inf on the way, where f32 would have carried them, without a
// word. The result is the same on every rank, so every rank sees one and asks whether any rank's input held a nan or
// inf: if none did, each stops with the same line. `per_rank`: each rank holds another block (a reduce-scatter), so
// every rank takes part whether or not its own block overflowed, and all stop together.
static void refuse_half_overflow(coll::Communicator& comm, const Compressor& c, bool input_nonfinite,
                                 std::span<const float> result, const coll::CollOptions& co, bool per_rank = false) {
  const size_t i = first_nonfinite(result);
  if (i == result.size() && !per_rank) return;
  int64_t flags[2] = {i < result.size() ? 1 : 0, input_nonfinite ? 1 : 0};  // (an overflow somewhere, any input's)
  if (comm.size() > 1) comm.allreduce(flags, 2, DType::i64, ReduceOp::max, co).wait();
  if (!flags[0] || flags[1]) return;
  const bool bf = c.linear_dtype() == DType::bf16;
  throw InvalidArgument(fmt::format(
      "{}: {} came out {} from finite values on all {} ranks: {} (one rank's value, or their sum or mean); allowed: "
      "{}",
      c.name(), i < result.size() ? fmt::format("element {} of {}", i, result.size()) : "another rank's block",
      i < result.size() ? result[i] : std::numeric_limits<float>::infinity(), comm.size(),
      bf ? "beyond bf16's largest, about 3.39e38 (f32 values from about 3.3962e38 round to inf)"
         : "beyond f16's largest, 65504",
      bf ? "values within +-3.39e38 (f32, `none`, carries up to 3.4e38; or a smaller learning rate)"
         : "values within +-65504 (bf16 keeps f32's exponent range, up to about 3.39e38; or a smaller learning "
           "rate)"));
}

static size_t allreduce_one(coll::Communicator& comm, const Compressor& c, TensorState& st, std::span<float> data,
                            const ReduceOptions& o, const CallDeadline& dl) {
  check_finite_or_abort(comm, data, c.name(), "compressed allreduce");
  const int w = comm.size();
  switch (c.collective()) {
    case Collective::powersgd: {
      const auto* ps = dynamic_cast<const PowerSgd*>(&c);
      if (!ps) throw InvalidArgument(fmt::format("compressor {} claims the powersgd collective", c.name()));
      return powersgd_allreduce(comm, *ps, {&st}, {data}, o, dl);
    }
    case Collective::allreduce: {
      const bool f16 = c.linear_dtype() == DType::f16;
      const bool half = f16 || c.linear_dtype() == DType::bf16;
      const bool input_nonfinite = half && first_nonfinite(data) < data.size();
      Bytes payload = compress_or_abort(comm, c, data, st);
      size_t es = dtype_size(c.linear_dtype());
      if (payload.size() % es)
        throw InvalidArgument(fmt::format("{}: linear payload of {} bytes is not a whole number of {}", c.name(),
                                          payload.size(), dtype_name(c.linear_dtype())));
      // Averaged in f16, each rank's part is divided before the sum (the communicator's avg, as NCCL's): a mean
      // within f16's range is carried whatever the sum (4 ranks of 20,000).
      const bool pre_divided = f16 && o.average;
      if (!payload.empty())
        comm.allreduce(payload.data(), payload.size() / es, c.linear_dtype(),
                       pre_divided ? ReduceOp::avg : ReduceOp::sum, dl.opts())
            .wait();
      c.decompress(payload, st, data);
      if (half) refuse_half_overflow(comm, c, input_nonfinite, data, dl.opts());
      if (o.average && !pre_divided) scale(data, 1.0f / static_cast<float>(w));
      return payload.size();
    }
    case Collective::allgather:
    case Collective::majority_vote: {
      Bytes payload = compress_or_abort(comm, c, data, st);
      std::vector<size_t> counts(w, payload.size());
      if (!c.fixed_size()) {
        std::vector<uint64_t> sizes(w);
        uint64_t mine = payload.size();
        comm.allgather(&mine, sizes.data(), 1, DType::i64, dl.opts()).wait();
        // Before anything is allocated for them: a size no encoder writes (a corrupt or foreign peer) was allocated
        // as announced, or wrapped the total.
        const uint64_t most = max_payload_bytes(c, data.size(), st);
        for (int r = 0; r < w; ++r) {
          if (sizes[r] > most) {
            const std::string why =
                fmt::format("{}: rank {} announced a payload of {} bytes for {} elements (at most {})", c.name(), r,
                            sizes[r], data.size(), most);
            comm.transport().abort(why);
            throw ProtocolError(why);
          }
          counts[r] = sizes[r];
        }
      }
      size_t total = 0;
      for (auto n : counts) total += n;
      Bytes all(total);
      coll::Work gather = comm.allgatherv(payload.data(), all.data(), counts, DType::u8, dl.opts());
      gather.wait();
      if (o.received) *o.received += total - payload.size();
      if (o.sent) *o.sent += coll::allgatherv_sent(gather.algorithm(), counts, comm.rank());
      if (c.collective() == Collective::majority_vote) {
        majority_vote(all, w, data);
        return payload.size();
      }
      std::fill(data.begin(), data.end(), 0.0f);
      size_t off = 0;
      for (int r = 0; r < w; ++r) {
        try {  // (every rank decodes every payload alike: each names the same sender)
          c.decompress_add(std::span<const uint8_t>(all).subspan(off, counts[r]), st, data);
        } catch (const InvalidArgument& e) {
          throw InvalidArgument(fmt::format("rank {}'s payload of {} bytes refused: {}", r, counts[r], e.what()));
        }
        off += counts[r];
      }
      if (o.average) scale(data, 1.0f / static_cast<float>(w));
      return payload.size();
    }
  }
  return 0;
}

size_t compressed_allreduce(coll::Communicator& comm, const Compressor& c, TensorState& st, std::span<float> data,
                            const ReduceOptions& o) {
  const CallDeadline dl(comm, o);
  return allreduce_one(comm, c, st, data, o, dl);
}

size_t compressed_allreduce_many(coll::Communicator& comm, const Compressor& c, const std::vector<TensorState*>& states,
                                 const std::vector<std::span<float>>& data, const ReduceOptions& o) {
  if (states.size() != data.size())
    throw InvalidArgument(fmt::format("compressed_allreduce_many: {} states for {} tensors", states.size(),
                                      data.size()));
  const CallDeadline dl(comm, o);  // (one for all the tensors)
  if (c.collective() == Collective::powersgd) {
    const auto* ps = dynamic_cast<const PowerSgd*>(&c);
    if (!ps) throw InvalidArgument(fmt::format("compressor {} claims the powersgd collective", c.name()));
    for (size_t t = 0; t < data.size(); ++t)
      check_finite_or_abort(comm, data[t], c.name(), fmt::format("compressed allreduce, tensor {}", t).c_str());
    return powersgd_allreduce(comm, *ps, states, data, o, dl);
  }
  size_t bytes = 0;
  for (size_t t = 0; t < data.size(); ++t) bytes += allreduce_one(comm, c, *states[t], data[t], o, dl);
  return bytes;
}

Chunk ring_chunk(size_t d, int n, int c) {
  size_t base = d / n, extra = d % n, uc = static_cast<size_t>(c);
  Chunk ch;
  ch.count = base + (uc < extra ? 1 : 0);
  ch.offset = uc * base + std::min(uc, extra);
  return ch;
}

const char* ring_codecs_allowed() { return "none, fp16, bf16, int8, uint8"; }

CompressorPtr make_ring_codec(const std::string& name) {
  if (name == "none" || name == "fp16" || name == "bf16" || name == "int8" || name == "uint8")
    return make_compressor(name);
  throw ConfigError(fmt::format("quantized ring: unknown codec '{}'; allowed: {}", name, ring_codecs_allowed()));
}

namespace {

constexpr uint32_t kRingTagBase = 0xFFF00000u;

struct Ring {
  coll::Communicator& comm;
  const Compressor& codec;
  Deadline deadline;
  int w, r, right, left;
  bool byte_codec;  // int8, uint8: a scale per chunk, which cannot carry an inf

  Ring(coll::Communicator& c, const Compressor& cd, const Deadline& d) : comm(c), codec(cd), deadline(d) {
    w = c.size();
    r = c.rank();
    right = (r + 1) % w;
    left = (r - 1 + w) % w;
    byte_codec = cd.name() == "int8" || cd.name() == "uint8";
  }
  // This rank's own encoding and decoding (the owner's final chunk): an error ends the collective on every rank, as
  // a refused payload does (it threw on this rank alone, and the others waited for their deadline).
  template <typename F>
  void own_or_abort(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      comm.transport().abort(fmt::format("rank {}: quantized ring: {}", r, e.what()));
      throw;
    }
  }
  // The partial sums a hop's add left in `x` (elements [offset, offset + x.size()) of d), before they are encoded
  // for the next hop or kept: the input was checked finite, so a non-finite one is a sum of finite values past
  // f32's range. int8 and uint8 wrote its chunk an inf scale: the next rank refused that payload as corrupt,
  // blaming its sender, or the owner's own decode threw on it alone while the others waited for their deadline.
  // This rank stops every rank at once with one line (in a reduce-scatter, a rank already holding its own finished,
  // finite block may return it first; its next operation fails with the line). (fp16 and bf16 carry the inf on, and
  // refuse_half_overflow answers it at the end on every rank together.)
  void check_sums(std::span<const float> x, size_t offset, size_t d) {
    if (!byte_codec) return;
    const size_t i = first_nonfinite(x);
    if (i == x.size()) return;
    const std::string why = fmt::format(
        "{} ring: a partial sum overflowed f32 from finite inputs: element {} of {} came out {} on rank {}, which "
        "{} cannot encode; allowed: inputs whose sum stays within +-3.4e38 (or average, which divides each rank's "
        "part before the ring; or a smaller learning rate)",
        codec.name(), offset + i, d, x[i], r, codec.name());
    comm.transport().abort(fmt::format("rank {}: {}", r, why));
    throw InvalidArgument(why);
  }
  // A payload the codec refuses ends the collective on every rank (only this one would see it; the others waited
  // for their deadline).
  template <typename F>
  void decode_or_abort(F&& decode) {
    try {
      decode();
    } catch (const InvalidArgument& e) {
      comm.transport().abort(fmt::format("rank {}: quantized ring: {}", r, e.what()));
      throw ProtocolError(fmt::format("quantized ring: rank {} sent a payload rank {} refuses: {}", left, r, e.what()));
    }
  }
  void exchange(const Bytes& send, Bytes& recv, uint32_t tag) {
    auto& t = comm.transport();
    uint64_t full = net::make_tag(net::kUser, comm.id(), kRingTagBase + tag);
    auto rq = t.irecv(comm.transport_rank(left), full, recv.data(), recv.size());
    auto sq = t.isend(comm.transport_rank(right), full, send.data(), send.size());
    net::wait_all_or_give_up(t, {rq, sq}, deadline);  // the caller's buffers go away if this throws
  }
  int mod(int x) const { return ((x % w) + w) % w; }
};

// Leaves the fully reduced chunk `rank` in data (the others hold partial sums).
void ring_reduce_scatter_inplace(Ring& ring, const Compressor& codec, std::span<float> data) {
  size_t d = data.size();
  TensorState st;
  Bytes send, recv;
  for (int s = 0; s < ring.w - 1; ++s) {
    Chunk sc = ring_chunk(d, ring.w, ring.mod(ring.r - s - 1));
    Chunk rc = ring_chunk(d, ring.w, ring.mod(ring.r - s - 2));
    codec.compress(data.subspan(sc.offset, sc.count), st, send);
    recv.resize(codec.wire_bytes(rc.count, st));
    ring.exchange(send, recv, static_cast<uint32_t>(s));
    ring.decode_or_abort([&] { codec.decompress_add(recv, st, data.subspan(rc.offset, rc.count)); });
    ring.check_sums(data.subspan(rc.offset, rc.count), rc.offset, d);
  }
}

}  // namespace

// The byte codecs' scale of a chunk with an inf is inf and a NaN encodes as a code (finite and wrong, int8's -128):
// their input is refused on every rank as the compressed collectives refuse theirs. fp16/bf16 carry inf and NaN
// through as an uncompressed allreduce does.
void check_ring_input(coll::Communicator& comm, std::span<const float> in, const std::string& codec_name) {
  if (codec_name == "int8" || codec_name == "uint8") check_finite_or_abort(comm, in, codec_name, "quantized ring");
}

void quantized_ring_reduce_scatter(coll::Communicator& comm, std::span<const float> in, std::span<float> out,
                                   const std::string& codec_name, const ReduceOptions& o) {
  const CallDeadline dl(comm, o);
  auto codec = make_ring_codec(codec_name);
  check_ring_input(comm, in, codec_name);
  Chunk mine = ring_chunk(in.size(), comm.size(), comm.rank());
  if (out.size() != mine.count)
    throw InvalidArgument(fmt::format("quantized_ring_reduce_scatter: output of {} elements, rank {} owns {} of {}",
                                      out.size(), comm.rank(), mine.count, in.size()));
  const bool half = codec_name == "fp16" || codec_name == "bf16";
  const bool input_nonfinite = half && first_nonfinite(in) < in.size();
  std::vector<float> work(in.begin(), in.end());
  // Averaging: each rank's part divided before the ring (as the communicator's avg), whose partial sums are encoded
  // at every hop. Divided after, a sum past the codec's range where the mean fitted came out inf: fp16's past 65504,
  // without a word; int8's and uint8's past f32's 3.4e38, whose scales cannot carry it. The division's own rounding
  // (half an f32 ulp) is far below the codecs' (int8: half of 1/127 of a chunk's largest).
  if (o.average) scale(work, 1.0f / static_cast<float>(comm.size()));
  if (comm.size() > 1) {
    Ring ring(comm, *codec, dl.deadline());
    ring_reduce_scatter_inplace(ring, *codec, work);
  }
  std::copy(work.begin() + mine.offset, work.begin() + mine.offset + mine.count, out.begin());
  if (half) refuse_half_overflow(comm, *codec, input_nonfinite, out, dl.opts(), true);
}

void quantized_ring_allreduce(coll::Communicator& comm, std::span<float> data, const std::string& codec_name,
                              const ReduceOptions& o) {
  const CallDeadline dl(comm, o);
  auto codec = make_ring_codec(codec_name);
  check_ring_input(comm, data, codec_name);
  const bool half = codec_name == "fp16" || codec_name == "bf16";
  const bool input_nonfinite = half && first_nonfinite(data) < data.size();
  if (o.average) scale(data, 1.0f / static_cast<float>(comm.size()));  // (before the ring: as reduce-scatter's)
  if (comm.size() > 1) {
    Ring ring(comm, *codec, dl.deadline());
    ring_reduce_scatter_inplace(ring, *codec, data);
    size_t d = data.size();
    TensorState st;
    // Allgather of encoded final chunks: encode mine once, decode it too so that every rank holds the same values.
    Bytes cur, next;
    Chunk mine = ring_chunk(d, ring.w, ring.r);
    ring.own_or_abort([&] {
      codec->compress(data.subspan(mine.offset, mine.count), st, cur);
      codec->decompress(cur, st, data.subspan(mine.offset, mine.count));
    });
    for (int s = 0; s < ring.w - 1; ++s) {
      Chunk rc = ring_chunk(d, ring.w, ring.mod(ring.r - s - 1));
      next.resize(codec->wire_bytes(rc.count, st));
      ring.exchange(cur, next, 0x8000u + static_cast<uint32_t>(s));
      ring.decode_or_abort([&] { codec->decompress(next, st, data.subspan(rc.offset, rc.count)); });
      std::swap(cur, next);
    }
  }
  if (half) refuse_half_overflow(comm, *codec, input_nonfinite, data, dl.opts());
}

namespace {

// A part of a hop's message, and where its rounding error goes (error feedback; null: nowhere).
struct Part {
  std::span<const float> x;
  float* error = nullptr;
  size_t size() const { return x.size(); }
};
using Spans = std::vector<Part>;

size_t int_bytes(const Spans& spans, int bits) {
  size_t b = 0;
  for (const auto& s : spans) b += block_int_bytes(s.size(), kIntBlock, bits);
  return b;
}

// One all-to-all over c: to each other rank d it sends to[d] (each span rounded to int8 blocks of its own); every
// rank's to[me] has the same lengths (the spans this rank sums), and `sum` becomes their sum over c's ranks in rank
// order, this rank's own exact. With `senders`: only the ranks it marks send this rank anything (the others' to[me]
// empty), and the sum is over them and this rank. By `deadline`: the hops of one reduce-scatter share it.
void int_hop(coll::Communicator& c, const std::vector<Spans>& to, std::vector<float>& sum, int bits,
             const ReduceOptions& o, const Deadline& deadline, uint64_t& sent,
             const std::vector<char>* senders = nullptr) {
  const int w = c.size(), me = c.rank();
  const Spans& mine = to[size_t(me)];
  const size_t rb = int_bytes(mine, bits);
  std::vector<size_t> scount(size_t(w), 0), rcount(size_t(w), 0);
  size_t stotal = 0, rtotal = 0;
  for (int d = 0; d < w; ++d) {
    if (d == me) continue;
    scount[size_t(d)] = int_bytes(to[size_t(d)], bits);
    rcount[size_t(d)] = !senders || (*senders)[size_t(d)] ? rb : 0;
    stotal += scount[size_t(d)];
    rtotal += rcount[size_t(d)];
  }
  std::vector<uint8_t> sbuf(stotal), rbuf(rtotal);
  uint8_t* p = sbuf.data();
  for (int d = 0; d < w; ++d) {
    if (d == me) continue;
    for (const auto& s : to[size_t(d)]) {
      if (s.size() > 0) {
        quantize_block_int(s.x.data(), s.size(), kIntBlock, bits, p);
        if (s.error) {  // what the peer will decode, taken off what was meant
          dequantize_block_int(p, s.size(), kIntBlock, bits, s.error);
          for (size_t i = 0; i < s.size(); ++i) {
            const float e = s.x[i] - s.error[i];
            s.error[i] = std::isfinite(e) ? e : 0.0f;
          }
        }
      }
      p += block_int_bytes(s.size(), kIntBlock, bits);
    }
  }
  if (w > 1) {
    coll::CollOptions co;
    co.timeout_s = std::max(deadline.remaining_seconds(), 1e-3);  // (spent: fails at once, naming the hop)
    c.alltoallv(sbuf.data(), scount, rbuf.data(), rcount, DType::u8, co).wait();
  }
  size_t n = 0;
  for (const auto& s : mine) n += s.size();
  sum.assign(n, 0.0f);
  std::vector<float> part(n);
  const uint8_t* q = rbuf.data();
  for (int r = 0; r < w; ++r) {
    if (r != me && senders && !(*senders)[size_t(r)]) continue;
    size_t at = 0;
    for (const auto& s : mine) {
      if (r == me) {
        std::copy(s.x.begin(), s.x.end(), part.begin() + std::ptrdiff_t(at));
      } else {
        if (s.size() > 0) dequantize_block_int(q, s.size(), kIntBlock, bits, part.data() + at);
        q += block_int_bytes(s.size(), kIntBlock, bits);
      }
      at += s.size();
    }
    for (size_t k = 0; k < n; ++k) sum[k] += part[k];
  }
  sent += stotal;
  if (o.received) *o.received += rtotal;
}

}  // namespace

IntReduceGroups int_reduce_groups(coll::Communicator& comm) {
  IntReduceGroups g;
  if (comm.num_hosts() <= 1) return g;
  // Hosts numbered by their first rank, each rank's local index by its order among its host's ranks.
  const int w = comm.size();
  std::vector<int> host_index(static_cast<size_t>(w)), local_index(static_cast<size_t>(w));
  std::vector<int> hosts;               // host ids in order of first appearance
  std::vector<std::vector<int>> ranks;  // each host's ranks, ascending
  for (int r = 0; r < w; ++r) {
    const int h = comm.host_of(r);
    const auto it = std::find(hosts.begin(), hosts.end(), h);
    const size_t gi = size_t(it - hosts.begin());
    if (it == hosts.end()) hosts.push_back(h), ranks.emplace_back();
    host_index[size_t(r)] = int(gi);
    local_index[size_t(r)] = int(ranks[gi].size());
    ranks[gi].push_back(r);
  }
  bool several = false, alike = true;
  for (const auto& rs : ranks) several = several || rs.size() > 1, alike = alike && rs.size() == ranks[0].size();
  if (!several) return g;  // (one rank a host: nothing to sum on a host)
  // Each rank's position host by host; the local index of host `h` that sums rank r's slice: r itself on its own
  // host, else its position modulo the host's count (its local index where the hosts hold as many).
  std::vector<int> position(static_cast<size_t>(w));
  int at = 0;
  for (const auto& rs : ranks)
    for (int r : rs) position[size_t(r)] = at++;
  auto summer = [&](size_t h, int r) {
    return size_t(host_index[size_t(r)]) == h ? local_index[size_t(r)] : position[size_t(r)] % int(ranks[h].size());
  };
  const int me = comm.rank();
  const size_t mh = size_t(host_index[size_t(me)]);
  g.sums.resize(ranks[mh].size());
  for (const auto& rs : ranks)
    for (int r : rs) g.sums[size_t(summer(mh, r))].push_back(r);
  for (size_t h = 0; h < ranks.size(); ++h) g.from.push_back(ranks[h][size_t(summer(h, me))]);
  g.local = comm.split(int(mh), me);
  if (alike) g.cross = comm.split(local_index[size_t(me)], int(mh));
  return g;
}

uint64_t int_reduce_scatter(coll::Communicator& comm, const IntReduceGroups& groups, std::span<const float> in,
                            const std::vector<size_t>& counts, std::span<float> out, int bits, const ReduceOptions& o,
                            std::span<float> residual, std::span<const size_t> bounds) {
  if (bits != 8 && bits != 4) throw InvalidArgument(fmt::format("int_reduce_scatter: {} bits; allowed: 8 or 4", bits));
  const CallDeadline dl(comm, o);
  const int w = comm.size(), me = comm.rank();
  size_t total = 0;
  for (size_t c : counts) total += c;
  if (counts.size() != size_t(w) || total != in.size() || out.size() != counts[size_t(me)])
    throw InvalidArgument(fmt::format(
        "int_reduce_scatter: {} counts summing to {} for an input of {} and an output of {} over {} ranks; allowed: "
        "one count a rank, summing to the input's elements, this rank's the output's",
        counts.size(), total, in.size(), out.size(), w));
  if (groups.hierarchical()) {
    size_t summed = 0;
    bool across = true;  // (hosts alike: a slice of each host for every local rank, one a rank of cross)
    for (const auto& s : groups.sums) {
      summed += s.size();
      across = across && (!groups.cross || s.size() == size_t(groups.cross->size()));
    }
    if (groups.sums.size() != size_t(groups.local->size()) || summed != size_t(w) || !across ||
        groups.from.size() != size_t(comm.num_hosts()) ||
        (groups.cross && groups.cross->size() != int(groups.from.size())))
      throw InvalidArgument(
          fmt::format("int_reduce_scatter: host groups summing {} slices among {} ranks for {} ranks; allowed: "
                      "int_reduce_groups of this communicator",
                      summed, groups.local->size(), w));
  }
  for (size_t i = 0; i < bounds.size(); ++i)
    if (bounds[i] > in.size() || (i > 0 && bounds[i] <= bounds[i - 1]))
      throw InvalidArgument(fmt::format(
          "int_reduce_scatter: block bound {} = {} for an input of {}; allowed: ascending offsets within the input", i,
          bounds[i], in.size()));
  if (!residual.empty() && residual.size() != in.size())
    throw InvalidArgument(
        fmt::format("int_reduce_scatter: a residual of {} elements for an input of {}; allowed: as many, or none",
                    residual.size(), in.size()));
  // Error feedback: the carried errors added to the input, then cleared; each rounding writes its own back.
  std::vector<float> compensated;
  if (!residual.empty()) {
    compensated.resize(in.size());
    for (size_t i = 0; i < in.size(); ++i) compensated[i] = in[i] + residual[i];
    std::fill(residual.begin(), residual.end(), 0.0f);
    in = compensated;
  }
  std::vector<size_t> offset(size_t(w) + 1, 0);
  for (int r = 0; r < w; ++r) offset[size_t(r) + 1] = offset[size_t(r)] + counts[size_t(r)];
  // The elements [begin, begin + x.size()) of `in` (error at `error`), as parts cut at the bounds inside them: each
  // part's blocks start at its first element.
  auto cut = [&](std::span<const float> x, size_t begin, float* error, Spans& into) {
    size_t at = 0;
    for (size_t len : cut_at_bounds(begin, x.size(), bounds)) {
      into.push_back(Part{x.subspan(at, len), error ? error + at : nullptr});
      at += len;
    }
  };
  auto slice = [&](int r, Spans& into) {
    cut(in.subspan(offset[size_t(r)], counts[size_t(r)]), offset[size_t(r)],
        residual.empty() ? nullptr : residual.data() + offset[size_t(r)], into);
  };
  uint64_t sent = 0;
  std::vector<float> sum;
  const Deadline& deadline = dl.deadline();
  if (!groups.hierarchical()) {
    std::vector<Spans> to(static_cast<size_t>(w));
    for (int r = 0; r < w; ++r) slice(r, to[size_t(r)]);
    int_hop(comm, to, sum, bits, o, deadline, sent);
  } else {
    // Hop 1, within the host: local rank j sums the slices groups.sums[j] lists (its own and its share of the other
    // hosts' ranks').
    const int k = groups.local->size();
    std::vector<Spans> to(static_cast<size_t>(k));
    for (int j = 0; j < k; ++j)
      for (int owner : groups.sums[size_t(j)]) slice(owner, to[size_t(j)]);
    std::vector<float> partial;
    int_hop(*groups.local, to, partial, bits, o, deadline, sent);
    // Hop 2, across hosts: each partial sum to its slice's owner; this rank's own stays (exact).
    const std::vector<int>& mine = groups.sums[size_t(groups.local->rank())];
    std::vector<Spans> parts(mine.size());
    size_t at = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const int owner = mine[i];
      const size_t n = counts[size_t(owner)];
      cut(std::span<const float>(partial.data() + at, n), offset[size_t(owner)],
          residual.empty() || owner == me ? nullptr : residual.data() + offset[size_t(owner)], parts[i]);
      at += n;
    }
    if (groups.cross) {
      // Hosts alike: one owner a host in host order, cross rank g the rank of host g.
      int_hop(*groups.cross, parts, sum, bits, o, deadline, sent);
    } else {
      // Hosts of different counts: over the whole communicator, each owner receiving from groups.from alone.
      std::vector<Spans> across(static_cast<size_t>(w));
      for (size_t i = 0; i < mine.size(); ++i) across[size_t(mine[i])] = std::move(parts[i]);
      std::vector<char> sends(static_cast<size_t>(w), 0);
      for (int r : groups.from) sends[size_t(r)] = 1;
      int_hop(comm, across, sum, bits, o, deadline, sent, &sends);
    }
  }
  const float f = o.average ? 1.0f / float(w) : 1.0f;
  for (size_t i = 0; i < sum.size(); ++i) out[i] = sum[i] * f;
  return sent;
}

}  // namespace conduit::compress
