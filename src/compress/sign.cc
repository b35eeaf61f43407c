// Sign methods: one bit per element (the sign bit: set for negatives and -0).
//
//   method       wire format                              bytes for d     collective      state
//   signsgd      sign bits                                ceil(d/8)       majority_vote   -
//   signum       sign bits of the momentum m              ceil(d/8)       majority_vote   momentum m
//   scaled_sign  f32 ||x||_1/d , sign bits                4 + ceil(d/8)   allgather       -
//   efsignsgd    scaled_sign of g + e                     4 + ceil(d/8)   allgather       residual e
//   onebit       f32 mean of x>=0 , f32 mean of x<0 , sign bits of g + e
//                                                          8 + ceil(d/8)   allgather       residual e
//
// signSGD / Signum (Bernstein et al. 2018): workers send sign(g) (Signum: sign of m = beta m + (1-beta) g); the
// server's majority vote is sign(sum of signs). EF-signSGD (Karimireddy et al. 2019): error feedback around the
// scaled sign ||p||_1/d sign(p). 1-bit SGD (Seide et al. 2014): error feedback around a 1-bit quantizer whose two
// reconstruction values are the means of the non-negative and of the negative entries.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "compress/kernels.h"
#include "compress/methods.h"
#include "core/error.h"

namespace conduit::compress::methods {
namespace {

using detail::ceil_div;
using detail::check_payload;
using detail::get_f32;
using detail::put_f32;

class SignSgd : public Compressor {
 public:
  explicit SignSgd(double momentum = -1) : beta_(static_cast<float>(momentum)) {}
  std::string name() const override { return beta_ >= 0 ? "signum" : "signsgd"; }
  Collective collective() const override { return Collective::majority_vote; }
  bool stateful() const override { return beta_ >= 0; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return ceil_div(d, 8); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    out.resize(ceil_div(in.size(), 8));
    if (beta_ >= 0) {
      auto& m = st.buffer("signum.momentum", in.size());
      kernels::get().momentum_signs(m.data(), in.data(), in.size(), beta_, out.data());
    } else {
      detail::pack_signs(in.data(), in.size(), out.data());
    }
    ++st.step;
  }
  void decompress(std::span<const uint8_t> p, const TensorState&, std::span<float> out) const override {
    check_payload(name(), p.size(), ceil_div(out.size(), 8));
    detail::unpack_signs(p.data(), out.size(), 1.0f, -1.0f, out.data());
  }

 private:
  float beta_;
};

// scaled_sign (one scale) and the 1-bit quantizer (two reconstruction values).
class ScaledSign : public Compressor {
 public:
  // `shown`: the name its messages give, the method the user asked for (efsignsgd and onebit wrap one in error
  // feedback; an error naming an inner "onebit_quantizer" named nothing they could type).
  explicit ScaledSign(bool two_values, std::string shown = "") : two_(two_values), shown_(std::move(shown)) {}
  std::string name() const override { return !shown_.empty() ? shown_ : two_ ? "onebit" : "scaled_sign"; }
  Collective collective() const override { return Collective::allgather; }
  size_t header() const { return two_ ? 8 : 4; }
  size_t wire_bytes(size_t d, const TensorState&) const override { return header() + ceil_div(d, 8); }
  void compress(std::span<const float> in, TensorState& st, Bytes& out) const override {
    encode(in.data(), nullptr, nullptr, in.size(), out);
    ++st.step;
  }
  // Error feedback in one pass over e and g. The residual buffer keeps p = e + g of the last step with its decode
  // not yet subtracted: "ef.pending" holds (-pos, -neg, 1), which this step adds by the sign bit of each element as
  // it reads the buffer: the same f32 additions as subtracting at the end of the last step, so payloads and
  // residuals are unchanged, with one pass instead of two (ErrorFeedback::residual applies it for readers).
  bool compress_feedback(std::span<const float> g, std::span<float> e, TensorState& st, Bytes& out) const override {
    auto& pend = st.buffer("ef.pending", 3);
    size_t d = e.size();
    out.resize(header() + ceil_div(d, 8));
    double a, b;
    size_t pn;
    kernels::get().sign_feedback(e.data(), g.data(), d, two_, pend[2] != 0, pend[0], pend[1], a, b, pn,
                                 out.data() + header());
    if (!std::isfinite(a) || !std::isfinite(b)) exact_sums(e.data(), nullptr, d, a, b);  // e holds p now
    if (!std::isfinite(a) || !std::isfinite(b)) undo_and_throw(g, e, pend);
    put_scales(out, d, a, b, pn);
    float pos, neg;
    values(out, pos, neg);
    pend = {-pos, -neg, 1.0f};
    ++st.step;
    return true;
  }
  // A p with an inf or NaN (a non-finite g, or e + g past the floats): the pass has overwritten e with p, which
  // the kernel's own sums show only afterwards (checking g and e first would be a second pass, 35-40% of the call's
  // throughput). g is taken out again: e then holds the last residual with its pending decode applied (rounded once
  // more; the pending decode is cleared), and each element whose p is not finite, whose old value is lost, starts
  // again from 0. The step is not counted. (It threw keeping the pending decode, which the next step applied to the
  // residual a second time, and the inf or NaN stayed in the residual for good.)
  [[noreturn]] void undo_and_throw(std::span<const float> g, std::span<float> e, std::vector<float>& pend) const {
    const size_t d = e.size();
    size_t first = d, lost = 0;
    float bad = 0, grad = 0;
    for (size_t i = 0; i < d; ++i) {
      const float p = e[i];
      if (std::isfinite(p)) {
        e[i] = p - g[i];
        if (std::isfinite(e[i])) continue;  // (p - g may round past the floats where e + correction was at their edge)
      }
      if (first == d) {
        first = i;
        bad = p;
        grad = g[i];
      }
      e[i] = 0.0f;
      ++lost;
    }
    pend[2] = 0.0f;
    throw InvalidArgument(fmt::format(
        "{} with error feedback: element {} of {} is {} once the gradient's {} is added to the residual ({} such); "
        "allowed: finite gradients whose sum with the residual stays within +-3.4e38 (the run diverged: a smaller "
        "learning rate or a warm-up); the step is not taken, those elements' residuals restart from 0",
        name(), first, d, bad, grad, lost));
  }
  // The payload of p = x (or x + g, stored to p) in one pass: the scale(s), then the sign bits.
  void encode(const float* x, const float* g, float* p, size_t d, Bytes& out) const {
    out.resize(header() + ceil_div(d, 8));
    double a, b;
    size_t pn;
    kernels::get().sign_stats(x, g, p, d, two_, a, b, pn, out.data() + header());
    if (!std::isfinite(a) || !std::isfinite(b)) exact_sums(x, g, d, a, b);
    put_scales(out, d, a, b, pn);
  }
  // The kernels sum magnitudes in f32 lanes: finite values from about 1e35 up overflow them (the scale went out as
  // inf, and every receiver refused it). Summed again in double (rare): sum |v|, or the positives' and negatives'
  // sums, of v = x (+ g, the f32 addition the kernel made).
  void exact_sums(const float* x, const float* g, size_t d, double& a, double& b) const {
    a = b = 0;
    for (size_t i = 0; i < d; ++i) {
      const float v = g ? x[i] + g[i] : x[i];
      if (!two_)
        a += std::fabs(static_cast<double>(v));
      else if (std::signbit(v))  // (as the kernels group them: by the sign bit sent)
        b += v;
      else
        a += v;
    }
  }
  // The means as f32. The mean of finite values is within the floats, but its double sum may round a little past
  // FLT_MAX: such a mean is sent as FLT_MAX (as an f32 cast it was inf, refused by every receiver and by
  // compress_feedback after its pass). A non-finite sum (an inf or NaN input, not through compress_feedback) stays
  // non-finite, and receivers refuse it.
  static float mean_f32(double sum, size_t count) {
    if (count == 0) return 0.0f;
    const double m = sum / static_cast<double>(count);
    return static_cast<float>(std::isfinite(m) ? std::clamp(m, -3.4028234663852886e38, 3.4028234663852886e38) : m);
  }
  void put_scales(Bytes& out, size_t d, double a, double b, size_t pn) const {
    if (two_) {
      put_f32(out.data(), mean_f32(a, pn));
      put_f32(out.data() + 4, mean_f32(b, d - pn));
    } else {
      put_f32(out.data(), mean_f32(a, d));
    }
  }
  void values(std::span<const uint8_t> p, float& pos, float& neg) const {
    detail::check_scales(name(), p.data(), two_ ? 2 : 1);
    pos = get_f32(p.data());
    neg = two_ ? get_f32(p.data() + 4) : -pos;
    // The encoder writes the mean magnitude (or the positives' mean) and the negatives' mean.
    if (pos < 0 || neg > 0)
      throw InvalidArgument(
          fmt::format("{}: the payload's values are +{} / {}; allowed: a value of 0 or more for "
                      "the positive signs and of 0 or less for the negative ones",
                      name(), pos, neg));
  }
  void decompress(std::span<const uint8_t> p, const TensorState& st, std::span<float> out) const override {
    check_payload(name(), p.size(), wire_bytes(out.size(), st));
    float pos, neg;
    values(p, pos, neg);
    detail::unpack_signs(p.data() + header(), out.size(), pos, neg, out.data());
  }
  void decompress_add(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    check_payload(name(), p.size(), wire_bytes(acc.size(), st));
    float pos, neg;
    values(p, pos, neg);
    kernels::get().unpack_signs(p.data() + header(), acc.size(), pos, neg, acc.data(), true);
  }
  void decompress_sub(std::span<const uint8_t> p, const TensorState& st, std::span<float> acc) const override {
    check_payload(name(), p.size(), wire_bytes(acc.size(), st));
    float pos, neg;
    values(p, pos, neg);
    kernels::get().unpack_signs(p.data() + header(), acc.size(), -pos, -neg, acc.data(), true);
  }

 private:
  bool two_;
  std::string shown_;
};

}  // namespace

CompressorPtr make_signsgd(const ParamReader&) { return std::make_unique<SignSgd>(); }
CompressorPtr make_signum(const ParamReader& p) { return std::make_unique<SignSgd>(p.real("momentum", 0, 0.999999)); }
CompressorPtr make_scaled_sign(const ParamReader&) { return std::make_unique<ScaledSign>(false); }
CompressorPtr make_efsignsgd(const ParamReader&) {
  return make_error_feedback(std::make_unique<ScaledSign>(false, "efsignsgd"), "efsignsgd");
}
CompressorPtr make_onebit(const ParamReader&) {
  return make_error_feedback(std::make_unique<ScaledSign>(true, "onebit"), "onebit");
}

}  // namespace conduit::compress::methods
