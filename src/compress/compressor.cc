// The factory, parameter checking, state (de)serialisation and the bit-packing helpers every method shares.
#include "compress/compressor.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstring>
#include <functional>

#include "compress/detail.h"
#include "compress/kernels.h"
#include "compress/methods.h"
#include "core/env.h"
#include "core/error.h"

namespace conduit::compress {

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::allreduce: return "allreduce";
    case Collective::allgather: return "allgather";
    case Collective::majority_vote: return "majority_vote";
    case Collective::powersgd: return "powersgd";
  }
  return "?";
}

uint64_t max_payload_bytes(const Compressor& c, size_t n, const TensorState& st) {
  const uint64_t sparse = 8 * static_cast<uint64_t>(n);
  return (c.fixed_size() ? std::max<uint64_t>(c.wire_bytes(n, st), sparse) : sparse) + 64;
}

std::vector<float>& TensorState::buffer(const std::string& name, size_t n) {
  auto [it, created] = buffers.try_emplace(name);
  if (created) {
    it->second.assign(n, 0.0f);
  } else if (it->second.size() != n) {
    // Re-zeroing it dropped what the buffer held (a residual, a momentum) without a word.
    throw InvalidArgument(
        fmt::format("compressor state: buffer '{}' holds {} values, this call needs {} (a state "
                    "belongs to one tensor of one shape: give each tensor its own, or clear "
                    "its buffers to start over)",
                    name, it->second.size(), n));
  }
  return it->second;
}

namespace {
constexpr uint32_t kStateMagic = 0x53544443;  // "CDTS"
constexpr uint32_t kStateVersion = 1;

void put_u64(Bytes& out, uint64_t v) {
  size_t o = out.size();
  out.resize(o + 8);
  std::memcpy(out.data() + o, &v, 8);
}

struct Reader {
  std::span<const uint8_t> in;
  size_t pos = 0;
  void need(size_t n) {
    if (pos + n > in.size() || pos + n < pos)
      throw InvalidArgument(fmt::format("compressor state: truncated at byte {} of {} (need {} more)", pos,
                                        in.size(), n));
  }
  uint64_t u64() {
    need(8);
    uint64_t v;
    std::memcpy(&v, in.data() + pos, 8);
    pos += 8;
    return v;
  }
};
}  // namespace

Bytes TensorState::save() const {
  Bytes out;
  put_u64(out, (static_cast<uint64_t>(kStateVersion) << 32) | kStateMagic);
  put_u64(out, shape.size());
  for (auto s : shape) put_u64(out, s);
  put_u64(out, step);
  put_u64(out, seed);
  put_u64(out, stream);
  put_u64(out, buffers.size());
  for (const auto& [name, v] : buffers) {
    put_u64(out, name.size());
    size_t o = out.size();
    out.resize(o + name.size());
    if (!name.empty()) std::memcpy(out.data() + o, name.data(), name.size());
    put_u64(out, v.size());
    o = out.size();
    out.resize(o + 4 * v.size());
    if (!v.empty()) std::memcpy(out.data() + o, v.data(), 4 * v.size());
  }
  return out;
}

TensorState TensorState::load(std::span<const uint8_t> bytes) {
  Reader r{bytes};
  uint64_t head = r.u64();
  if ((head & 0xffffffffu) != kStateMagic || (head >> 32) != kStateVersion)
    throw InvalidArgument("compressor state: bad magic or version (not bytes from TensorState::save, version 1)");
  TensorState st;
  uint64_t nd = r.u64();
  if (nd > 64) throw InvalidArgument(fmt::format("compressor state: {} dimensions (at most 64)", nd));
  for (uint64_t i = 0; i < nd; ++i) st.shape.push_back(r.u64());
  st.step = r.u64();
  st.seed = r.u64();
  st.stream = r.u64();
  uint64_t nb = r.u64();
  for (uint64_t i = 0; i < nb; ++i) {
    uint64_t len = r.u64();
    r.need(len);
    std::string name(reinterpret_cast<const char*>(bytes.data() + r.pos), len);
    r.pos += len;
    uint64_t n = r.u64();
    if (n > (bytes.size() - r.pos) / 4) throw InvalidArgument("compressor state: buffer longer than the bytes left");
    std::vector<float> v(n);
    if (n > 0) std::memcpy(v.data(), bytes.data() + r.pos, n * 4);
    r.pos += n * 4;
    if (!st.buffers.emplace(name, std::move(v)).second)
      throw InvalidArgument(fmt::format("compressor state: buffer '{}' appears twice", name));
  }
  if (r.pos != bytes.size())
    throw InvalidArgument(fmt::format("compressor state: {} trailing bytes", bytes.size() - r.pos));
  return st;
}

double Compressor::ratio(size_t numel, const TensorState& st) const {
  size_t w = wire_bytes(numel, st);
  return w == 0 ? 0.0 : 4.0 * static_cast<double>(numel) / static_cast<double>(w);
}

void Compressor::decompress_add(std::span<const uint8_t> payload, const TensorState& st,
                                std::span<float> acc) const {
  std::vector<float> tmp(acc.size());
  decompress(payload, st, tmp);
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += tmp[i];
}

void Compressor::decompress_sub(std::span<const uint8_t> payload, const TensorState& st,
                                std::span<float> acc) const {
  thread_local std::vector<float> tmp;
  tmp.resize(acc.size());
  decompress(payload, st, tmp);
  kernels::get().sub_from(acc.data(), tmp.data(), acc.size());
}

TensorState Compressor::make_state(std::vector<size_t> shape, uint64_t seed, uint64_t stream) const {
  TensorState st;
  st.shape = std::move(shape);
  st.seed = seed;
  st.stream = stream;
  return st;
}

namespace detail {

ParamReader::ParamReader(std::string compressor, const Params& defaults, const Params& given)
    : name_(std::move(compressor)), values_(defaults) {
  for (const auto& [k, v] : given) {
    if (!defaults.count(k)) {
      std::string allowed;
      for (const auto& [dk, dv] : defaults) allowed += (allowed.empty() ? "" : ", ") + dk;
      throw ConfigError(fmt::format("compressor {}: unknown parameter '{}'; allowed: {}", name_, k,
                                    allowed.empty() ? "(none)" : allowed));
    }
    values_[k] = v;
  }
}

double ParamReader::real(const std::string& key, double lo, double hi) const {
  const std::string& s = values_.at(key);
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || !(v >= lo && v <= hi))
    throw ConfigError(fmt::format("compressor {}: parameter {}='{}' must be a number in [{}, {}]", name_, key, s, lo,
                                  hi));
  return v;
}

int64_t ParamReader::integer(const std::string& key, int64_t lo, int64_t hi) const {
  const std::string& s = values_.at(key);
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v < lo || v > hi)
    throw ConfigError(fmt::format("compressor {}: parameter {}='{}' must be an integer in [{}, {}]", name_, key, s,
                                  lo, hi));
  return v;
}

bool ParamReader::boolean(const std::string& key) const {
  const std::string& s = values_.at(key);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return false;
  throw ConfigError(fmt::format("compressor {}: parameter {}='{}' must be one of 1, 0, true, false, on, off, yes, no",
                                name_, key, s));
}

const std::string& ParamReader::text(const std::string& key) const { return values_.at(key); }

void check_payload(const std::string& who, size_t got, size_t want) {
  if (got != want)
    throw InvalidArgument(fmt::format("{}: payload of {} bytes, expected {} (compressed with another configuration "
                                      "or tensor size?)",
                                      who, got, want));
}

void check_scales(const std::string& who, const uint8_t* p, size_t count, size_t magnitude_stride,
                  size_t magnitude_first) {
  for (size_t i = 0; i < count; ++i) {
    const float v = get_f32(p + 4 * i);
    if (!std::isfinite(v))
      throw InvalidArgument(fmt::format("{}: scale {} of the payload is {}; allowed: finite scales", who, i, v));
    if (v < 0 && magnitude_stride > 0 && i >= magnitude_first && (i - magnitude_first) % magnitude_stride == 0)
      throw InvalidArgument(
          fmt::format("{}: scale {} of the payload is {}; allowed: a magnitude (0 or more)", who, i, v));
  }
}

size_t first_code_above(const uint8_t* in, size_t n, int bits, uint32_t max_code) {
  const uint32_t mask = (1u << bits) - 1;
  if (max_code >= mask) return n;
  auto code = [&](size_t i) {
    size_t bit = i * static_cast<size_t>(bits);
    uint32_t w = in[bit / 8];
    for (size_t k = 1; bit % 8 + static_cast<size_t>(bits) > 8 * k; ++k) w |= uint32_t{in[bit / 8 + k]} << (8 * k);
    return (w >> (bit % 8)) & mask;
  };
  size_t first = 0;  // the codes before this one are not above max_code
  if (8 % bits == 0) {
    // Per field of a 64-bit word: its low bits (below the top bit T) plus K set T exactly when they exceed
    // max_code's (no carry leaves the field); then a code with T set is above max_code if max_code lacks T,
    // and one with T set and its low bits above max_code's if it has it.
    uint64_t ones = 0;
    for (int f = 0; f < 64; f += bits) ones |= uint64_t{1} << f;
    const uint32_t top = 1u << (bits - 1), low = max_code & (top - 1);
    const uint64_t t = ones * top, k = ones * (top - 1 - low);
    const bool has_top = (max_code & top) != 0;
    const size_t per = 64 / static_cast<size_t>(bits), words = n / per;
    size_t w = 0;
    for (; w < words; ++w) {
      uint64_t x;
      std::memcpy(&x, in + 8 * w, 8);
      const uint64_t above_low = ((x & ~t) + k) & t;
      if ((has_top ? above_low & x : above_low | (x & t)) != 0) break;
    }
    first = w * per;
  }
  for (size_t i = first; i < n; ++i)
    if (code(i) > max_code) return i;
  return n;
}

void check_out(const std::string& who, size_t got, size_t want) {
  if (got != want) throw InvalidArgument(fmt::format("{}: output of {} elements, expected {}", who, got, want));
}

void check_u32_elements(const std::string& who, size_t d, const char* what) {
  if (d > 0xffffffffull)
    throw InvalidArgument(fmt::format("{}: tensor of {} elements; {} allow at most 4294967295", who, d, what));
}

void pack_codes(const uint16_t* codes, size_t n, int bits, uint8_t* out) {
  if (bits == 8) {
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(codes[i]);
    return;
  }
  if (bits == 4) {
    size_t full = n / 2;
    for (size_t j = 0; j < full; ++j) out[j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
    if (n & 1) out[full] = static_cast<uint8_t>(codes[n - 1]);
    return;
  }
  if (bits == 2) {
    size_t full = n / 4;
    for (size_t j = 0; j < full; ++j)
      out[j] = static_cast<uint8_t>(codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) |
                                    (codes[4 * j + 3] << 6));
    if (n % 4) {
      uint8_t b = 0;
      for (size_t i = full * 4; i < n; ++i) b |= static_cast<uint8_t>(codes[i] << (2 * (i - full * 4)));
      out[full] = b;
    }
    return;
  }
  uint64_t acc = 0;
  int have = 0;
  size_t o = 0;
  for (size_t i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i]) << have;
    have += bits;
    while (have >= 8) {
      out[o++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
  if (have > 0) out[o++] = static_cast<uint8_t>(acc);
}

void unpack_codes(const uint8_t* in, size_t n, int bits, uint16_t* codes) {
  if (bits == 8) {
    for (size_t i = 0; i < n; ++i) codes[i] = in[i];
    return;
  }
  if (bits == 4) {
    for (size_t j = 0; j < n / 2; ++j) {
      uint8_t b = in[j];
      codes[2 * j] = b & 0xf;
      codes[2 * j + 1] = b >> 4;
    }
    if (n & 1) codes[n - 1] = in[n / 2] & 0xf;
    return;
  }
  if (bits == 2) {
    for (size_t j = 0; j < n / 4; ++j) {
      uint8_t b = in[j];
      for (int t = 0; t < 4; ++t) codes[4 * j + t] = (b >> (2 * t)) & 0x3;
    }
    for (size_t i = n / 4 * 4; i < n; ++i) codes[i] = (in[i / 4] >> (2 * (i & 3))) & 0x3;
    return;
  }
  uint64_t acc = 0;
  int have = 0;
  size_t p = 0;
  const uint64_t mask = (1ull << bits) - 1;
  for (size_t i = 0; i < n; ++i) {
    while (have < bits) {
      acc |= static_cast<uint64_t>(in[p++]) << have;
      have += 8;
    }
    codes[i] = static_cast<uint16_t>(acc & mask);
    acc >>= bits;
    have -= bits;
  }
}

void pack_signs(const float* x, size_t n, uint8_t* out) { kernels::get().pack_signs(x, n, out); }

void unpack_signs(const uint8_t* in, size_t n, float pos, float neg, float* out) {
  kernels::get().unpack_signs(in, n, pos, neg, out, false);
}

}  // namespace detail

namespace {

struct Entry {
  const char* name;
  const char* summary;
  Params defaults;
  std::function<CompressorPtr(const detail::ParamReader&)> make;
};

const std::vector<Entry>& registry() {
  using detail::ParamReader;
  static const std::vector<Entry> kEntries = {
      {"none", "f32 as is (4 bytes/element)", {}, methods::make_none},
      {"fp16", "IEEE half precision, allreduced as f16", {}, methods::make_fp16},
      {"bf16", "bfloat16, allreduced as bf16", {}, methods::make_bf16},
      {"int8", "symmetric 8-bit with an f32 scale per chunk", {{"chunk", "256"}}, methods::make_int8},
      {"uint8", "min-max 8-bit with f32 min and scale per chunk", {{"chunk", "256"}}, methods::make_uint8},
      {"qsgd",
       "QSGD: norm + stochastic levels 0..s with sign",
       {{"levels", "127"}, {"bucket", "0"}, {"coding", "fixed"}},
       methods::make_qsgd},
      {"terngrad", "TernGrad: scale max|g| + 2-bit ternary", {{"clip", "0"}}, methods::make_terngrad},
      {"natural", "natural compression: stochastic power of two, 9 bits", {}, methods::make_natural},
      {"signsgd", "sign bits, majority vote", {}, methods::make_signsgd},
      {"signum", "sign of momentum, majority vote", {{"momentum", "0.9"}}, methods::make_signum},
      {"scaled_sign", "||x||_1/d * sign(x) (no error feedback)", {}, methods::make_scaled_sign},
      {"efsignsgd", "EF-signSGD: scaled sign with error feedback", {}, methods::make_efsignsgd},
      {"onebit", "1-bit SGD: sign + two reconstruction means, error feedback", {}, methods::make_onebit},
      {"topk",
       "top-k by magnitude: u32 indices + f32 values",
       {{"ratio", "0.01"}, {"sample", "0.01"}},
       methods::make_topk},
      {"randk",
       "random-k with shared seed: f32 values only",
       {{"ratio", "0.01"}, {"unbiased", "1"}},
       methods::make_randk},
      {"threshold",
       "every |x| >= threshold: u32 indices + f32 values",
       {{"threshold", "0.001"}},
       methods::make_threshold},
      {"dgc",
       "deep gradient compression",
       {{"ratio", "0.001"}, {"momentum", "0.9"}, {"clip_norm", "0"}, {"warmup_steps", "0"}, {"sample", "0.01"}},
       methods::make_dgc},
      {"powersgd",
       "PowerSGD low rank with error feedback",
       {{"rank", "1"},
        {"start_iter", "0"},
        {"min_ratio", "2"},
        {"error_feedback", "1"},
        {"warm_start", "1"},
        {"wire", "f32"}},
       methods::make_powersgd},
  };
  return kEntries;
}

std::string names_line() {
  std::string s;
  for (const auto& e : registry()) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s + ", ef:<name>";
}

}  // namespace

// Error feedback keeps e = p - D(C(p)) and adds it to the next gradient; it stays bounded only when the compressor
// shrinks what it is given (E||p - D(C(p))||^2 < ||p||^2), and CHOCO-gossip's public copies converge under the same
// condition. The unbiased stochastic methods have E||p - D(C(p))||^2 = w ||p||^2 with w >= 1 unless their buckets
// are small: random-k scaled by d/k (w = d/k - 1), QSGD over buckets of b elements with s levels (w = min(b/s^2,
// sqrt(b)/s)) and TernGrad (w up to sqrt(d) - 1, d the tensor's size). With w >= 1 the residual grows every step
// (ef:randk: 1e11 after 40 steps, NaN loss in training). signSGD and Signum decode to +-1 whatever the input's size:
// ||p - sign(p)||^2 > ||p||^2 once |p_i| < 1/2, the usual case.
std::optional<Growth> input_growth(const std::string& name, const std::string& inner, const Params& params) {
  // The compressor was built from these parameters already, so they parse; read them as it did.
  const detail::ParamReader p(inner, compressor_defaults(inner), params);
  if (inner == "randk" && p.boolean("unbiased"))
    return Growth{"random-k's d/k scaling makes its error larger than its input", name + ":unbiased=0"};
  if (inner == "qsgd") {
    const double s = static_cast<double>(p.integer("levels", 1, INT64_MAX)),
                 b = static_cast<double>(p.integer("bucket", 0, INT64_MAX));
    const double w = b > 0 ? std::min(b / (s * s), std::sqrt(b) / s) : 0;
    // (the example keeps a coding that was given)
    const std::string coding = p.text("coding") == "fixed" ? "" : ",coding=" + p.text("coding");
    if (b == 0 || w >= 1) {
      // An example that passes: the largest power of two below s^2 (none when s = 1: more levels are needed).
      double example = 1;
      while (example * 2 < s * s) example *= 2;
      return Growth{
          fmt::format("QSGD's variance bound min(b/s^2, sqrt(b)/s) is not below 1 (b = bucket = {}{}, s = levels = {})",
                      b, b == 0 ? ": the whole tensor" : "", s),
          s * s > 1
              ? fmt::format("a bucket below s^2 = {} (e.g. {}:levels={},bucket={}{})", s * s, name, s, example, coding)
              : fmt::format("more levels (e.g. {}:levels=127,bucket=1024{})", name, coding)};
    }
  }
  if (inner == "signsgd" || inner == "signum")
    return Growth{fmt::format("{} decodes to +-1 whatever the input's size", inner),
                  name.rfind("ef:", 0) == 0
                      ? "efsignsgd or ef:scaled_sign (signs scaled by the mean magnitude, Karimireddy et al. 2019)"
                      : "scaled_sign (signs scaled by the mean magnitude)"};
  if (inner == "terngrad")
    return Growth{"TernGrad's variance grows with the tensor size, up to sqrt(d) times its input's",
                  "a compressor that shrinks its input (topk, int8, qsgd with small buckets, ...)"};
  return std::nullopt;
}

namespace {

void refuse_divergent_feedback(const std::string& name, const std::string& inner, const Params& params) {
  if (auto g = input_growth(name, inner, params))
    throw ConfigError(
        fmt::format("compressor '{}': error feedback diverges: {} (the residual grows every step); "
                    "allowed: {}, or {} without ef:",
                    name, g->why, g->fix, inner));
}

// "ef:" alone names no method to wrap: without this, the empty rest was looked up and refused as "unknown
// compressor ''", which named nothing the user had typed ("ef:ef:" as already having error feedback).
void refuse_bare_ef(const std::string& name) {
  size_t at = 0;
  while (name.compare(at, 3, "ef:") == 0) at += 3;
  if (at > 0 && at == name.size())
    throw ConfigError(
        fmt::format("compressor spec '{}' names no method after 'ef:'; allowed: ef:<method>, e.g. "
                    "ef:topk:ratio=0.01",
                    name));
}

}  // namespace

std::vector<std::string> compressor_names() {
  std::vector<std::string> v;
  for (const auto& e : registry()) v.push_back(e.name);
  return v;
}

Params compressor_defaults(const std::string& name) {
  refuse_bare_ef(name);
  if (name.rfind("ef:", 0) == 0) return compressor_defaults(name.substr(3));
  for (const auto& e : registry())
    if (name == e.name) return e.defaults;
  throw ConfigError(fmt::format("unknown compressor '{}'; allowed: {}", name, names_line()));
}

CompressorPtr make_compressor(const std::string& name, const Params& params) {
  refuse_bare_ef(name);
  if (name.rfind("ef:", 0) == 0) {
    std::string inner = name.substr(3);
    if (inner.rfind("ef:", 0) == 0 || inner == "efsignsgd" || inner == "onebit" || inner == "dgc" ||
        inner == "powersgd")
      throw ConfigError(fmt::format("compressor '{}': {} already has error feedback (or momentum) of its own; "
                                    "allowed: {}",
                                    name, inner, inner.rfind("ef:", 0) == 0 ? inner : inner + " without ef:"));
    auto c = make_compressor(inner, params);  // checks the parameters first
    refuse_divergent_feedback(name, inner, params);
    return methods::make_error_feedback(std::move(c), name);
  }
  for (const auto& e : registry())
    if (name == e.name) return e.make(detail::ParamReader(name, e.defaults, params));
  throw ConfigError(fmt::format("unknown compressor '{}'; allowed: {}", name, names_line()));
}

namespace {
// name[:k=v,k=v]; "ef:" is part of the name.
std::pair<std::string, Params> split_spec(const std::string& spec) {
  size_t start = 0;
  while (spec.compare(start, 3, "ef:") == 0) start += 3;
  size_t colon = spec.find(':', start);
  Params p;
  if (colon != std::string::npos && colon + 1 == spec.size())
    throw ConfigError(
        fmt::format("compressor spec '{}' ends with ':' and no parameters (form: name or "
                    "name:key=value,...)",
                    spec));
  if (colon != std::string::npos) {
    try {
      p = parse_key_values(spec.substr(colon + 1), [&](const std::string& kv) {
        return fmt::format("compressor spec '{}': '{}' is not key=value (form: name:key=value,...)", spec, kv);
      });
    } catch (const ConfigError& e) {
      // The parser's other refusals (a key given twice, an unmatched bracket) name only the parameters: the whole
      // spec and its form are added, as for a malformed item.
      const std::string what = e.what();
      if (what.rfind("compressor spec ", 0) == 0) throw;
      throw ConfigError(fmt::format("compressor spec '{}': {} (form: name:key=value,...)", spec, what));
    }
  }
  return {spec.substr(0, colon), std::move(p)};
}
}  // namespace

CompressorPtr parse_compressor(const std::string& spec) {
  (void)kernels::get();  // checks CONDUIT_COMPRESS_KERNELS once, also for methods that use no kernel table
  auto [name, p] = split_spec(spec);
  return make_compressor(name, p);
}

std::optional<Growth> input_growth(const std::string& spec) {
  auto [name, p] = split_spec(spec);
  std::string inner = name;
  while (inner.rfind("ef:", 0) == 0) inner = inner.substr(3);
  return input_growth(name, inner, p);
}

void check_finite_input(std::span<const float> in, const std::string& compressor, const char* what) {
  // The casts pass nan and inf on, as an uncompressed exchange does (the trainer then reports the divergence).
  if (compressor == "none" || compressor == "fp16" || compressor == "bf16") return;
  // Exponent bits all set: inf or nan. A branch-free OR over the bits vectorizes; the position is found only when
  // something is wrong.
  uint32_t bad = 0;
  const size_t n = in.size();
  const float* x = in.data();
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
  }
  if (!bad) return;
  size_t i = 0;
  while (i < n && std::isfinite(x[i])) ++i;
  throw InvalidArgument(
      fmt::format("{}: element {} of {} is {} and compressor '{}' cannot carry it (the run "
                  "diverged; allowed: finite values — a smaller learning rate, a warm-up, or an "
                  "uncompressed exchange, which passes nan and inf on)",
                  what, i, n, x[i], compressor));
}

}  // namespace conduit::compress
