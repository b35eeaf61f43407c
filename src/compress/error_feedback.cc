// Error feedback (Seide et al. 2014; Karimireddy et al. 2019) around any compressor C with decoder D:
//   p = g + e;  send C(p);  e = p - D(C(p))
// so that, summed over steps, what was sent plus the final residual equals what was given:
//   sum_t D(C(p_t)) + e_T = sum_t g_t   (exactly up to f32 rounding of the two subtractions per step).
// Wire format, bytes and collective are the inner compressor's; the state adds the residual "ef.residual" (and, for
// the sign methods' one-pass form, "ef.pending": the last decode, subtracted as the next step reads the residual).
#include <algorithm>
#include <cmath>
#include <vector>

#include "compress/kernels.h"
#include "compress/methods.h"

namespace conduit::compress::methods {
namespace {

class ErrorFeedback : public Compressor {
 public:
  ErrorFeedback(CompressorPtr inner, std::string name) : inner_(std::move(inner)), name_(std::move(name)) {}
  std::string name() const override { return name_; }
  Collective collective() const override { return inner_->collective(); }
  DType linear_dtype() const override { return inner_->linear_dtype(); }
  bool fixed_size() const override { return inner_->fixed_size(); }
  bool stateful() const override { return true; }
  size_t wire_bytes(size_t d, const TensorState& st) const override { return inner_->wire_bytes(d, st); }
  // A call that throws leaves the residual as it was (a non-finite g + e, a payload the inner decoder refuses; it was
  // left half-updated): a residual this call created is removed again and a stale pending decode it dropped is put
  // back; the step too is put back when the inner method keeps no other state (stateful() false), so such a call
  // changes nothing. (A stateful inner method, e.g. DGC's momentum, keeps what it did before throwing; the one-pass
  // sign methods' compress_feedback applies its pending decode and zeroes the elements it lost: sign.cc.)
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    size_t d = in.size();
    const bool fresh = !st.buffers.count("ef.residual");
    auto& e = st.buffer("ef.residual", d);  // (refuses a residual of another size before anything changes)
    std::vector<float> stale;
    bool had_stale = false;
    if (fresh)
      if (auto it = st.buffers.find("ef.pending"); it != st.buffers.end()) {
        stale = std::move(it->second);
        had_stale = true;
        st.buffers.erase(it);
      }
    const uint64_t step = st.step;
    try {
      if (inner_->compress_feedback(in, e, st, out)) return;  // all or nothing itself
      // p = g + e in a scratch buffer, its decode subtracted there too, copied into the residual once both
      // succeeded: a compressor that throws (a non-finite p, an index range, a payload its decoder refuses) leaves
      // the residual as it was, not with g added twice on a retry. (Copied, not swapped: swapping handed the largest
      // tensor's buffer on to the residuals of small ones.)
      thread_local std::vector<float> p;
      p.assign(e.begin(), e.end());
      // A state last used by a one-pass sign method (efsignsgd, onebit, ef:scaled_sign; a method changed between
      // steps) holds p with its decode still pending: applied here first, as residual() applies it, and dropped
      // once this step succeeds. (Read as it was, the last decode was added back, and left pending for the next
      // reader to apply again.)
      const auto pend = st.buffers.find("ef.pending");
      if (pend != st.buffers.end() && pend->second.size() == 3 && pend->second[2] != 0) {
        const float pos = pend->second[0], neg = pend->second[1];
        for (auto& v : p) v = v + (std::signbit(v) ? neg : pos);
      }
      kernels::get().add_to(p.data(), in.data(), d);
      const std::span<float> ps(p.data(), d);
      // A finite g and e can sum past the floats: qsgd clamped the norm and sent a finite payload, randk sent the
      // inf, and both kept an inf or nan residual for good. Refused here, as the gradient itself is, leaving the state
      // as it was; and a residual the decode's subtraction took past them likewise.
      check_finite_input(ps, name_, "the gradient plus its error-feedback residual");
      inner_->compress(ps, st, out);
      inner_->decompress_sub(out, st, ps);
      check_finite_input(ps, name_,
                         "the error-feedback residual after this step's decode (a value past the method's range, e.g. "
                         "fp16's 65504, or a diverged run)");
      std::copy(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(d), e.begin());
      st.buffers.erase("ef.pending");
    } catch (...) {
      if (fresh) {
        st.buffers.erase("ef.residual");
        st.buffers.erase("ef.pending");  // (one compress_feedback made)
      }
      if (had_stale) st.buffers["ef.pending"] = std::move(stale);
      if (!inner_->stateful()) st.step = step;
      throw;
    }
  }
  void decompress(std::span<const uint8_t> p, const TensorState& st, std::span<float> out) const override {
    inner_->decompress(p, st, out);
  }
  // "ef.residual" with the decode a sign method's compress_feedback left pending ("ef.pending" = value to add where
  // the element's sign bit is clear, where it is set, 1) applied: r = e + (sign bit ? [1] : [0]).
  std::vector<float> residual(const TensorState& st) const override {
    auto it = st.buffers.find("ef.residual");
    if (it == st.buffers.end()) return {};
    std::vector<float> r = it->second;
    auto pend = st.buffers.find("ef.pending");
    if (pend != st.buffers.end() && pend->second.size() == 3 && pend->second[2] != 0)
      for (auto& v : r) v = v + (std::signbit(v) ? pend->second[1] : pend->second[0]);
    return r;
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    inner_->decompress_add(p, st, acc);
  }
  void decompress_sub(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    inner_->decompress_sub(p, st, acc);
  }

 private:
  CompressorPtr inner_;
  std::string name_;
};

}  // namespace

CompressorPtr make_error_feedback(CompressorPtr inner, std::string name) {
  return std::make_unique<ErrorFeedback>(std::move(inner), std::move(name));
}

}  // namespace conduit::compress::methods
