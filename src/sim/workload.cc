#include "sim/workload.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <initializer_list>

#include "core/env.h"
#include "core/error.h"

namespace conduit::sim {

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::kNone;
  if (s == "selective") return Recompute::kSelective;
  if (s == "full") return Recompute::kFull;
  throw ConfigError(fmt::format("--recompute = '{}' (allowed: none, selective, full)", s));
}

Schedule parse_schedule(const std::string& s) {
  if (s == "gpipe") return Schedule::kGpipe;
  if (s == "1f1b") return Schedule::k1F1B;
  if (s == "interleaved") return Schedule::kInterleaved;
  throw ConfigError(fmt::format("--schedule = '{}' (allowed: gpipe, 1f1b, interleaved)", s));
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kGpipe:
      return "gpipe";
    case Schedule::k1F1B:
      return "1f1b";
    case Schedule::kInterleaved:
      return "interleaved";
  }
  return "?";
}

void GptModel::validate() const {
  // Sizes stay below 2^31, so sums such as vocab + seq or a padded vocabulary cannot overflow.
  constexpr long long kMax = (1LL << 31) - 1;
  auto check = [kMax](const char* flag, long long v) {
    if (v < 1 || v > kMax) throw ConfigError(fmt::format("{} = {} (allowed: 1 to {})", flag, v, kMax));
  };
  // (a million layers, 10^4 times the deepest published model: the step model keeps a few hundred bytes per layer
  // for ZeRO's per-layer calls, so 2^31 of them needed ~560 GB)
  if (layers < 1 || layers > 1000000) throw ConfigError(fmt::format("--layers = {} (allowed: 1 to 1000000)", layers));
  check("--hidden", hidden);
  check("--heads", heads);
  if (hidden % heads != 0) throw ConfigError(fmt::format("--heads = {} must divide --hidden = {}", heads, hidden));
  if (kv_heads < 0 || kv_heads > heads || (kv_heads > 0 && heads % kv_heads != 0))
    throw ConfigError(
        fmt::format("--kv-heads = {} does not divide --heads = {} (allowed: --kv-heads a divisor of --heads, such as "
                    "--kv-heads {}; a named model's own key/value heads count until it is given)",
                    kv_heads, heads, heads));
  check("--seq", seq);
  check("--vocab", vocab);
  if (ffn_hidden != 0) check("--ffn-hidden", ffn_hidden);
}

double kv_heads_per_rank(const GptModel& m, int t) {
  const long long kv = m.kv();
  if (kv % t != 0 && t % kv != 0)
    throw ConfigError(
        fmt::format("--tp = {} and --kv-heads = {}: one must divide the other (each rank holds kv/tp "
                    "heads, or one head replicated when tp exceeds them)",
                    t, kv));
  return kv >= t ? static_cast<double>(kv / t) : 1.0;
}

double kv_width_per_rank(const GptModel& m, int t) {
  return static_cast<double>(m.hidden) / static_cast<double>(m.heads) * kv_heads_per_rank(m, t);
}

void check_ffn_split(const GptModel& m, int t) {
  const auto f = static_cast<long long>(m.ffn());
  if (f % t != 0) throw ConfigError(fmt::format("--tp = {} must divide the MLP's width, {} (--ffn-hidden)", t, f));
}

double qkv_width_per_rank(const GptModel& m, int t) {
  return static_cast<double>(m.hidden) / t + 2 * kv_width_per_rank(m, t);
}

namespace {
struct NamedModel {
  const char* name;
  int layers;
  long long hidden, heads, seq, vocab;
  long long kv_heads = 0, ffn_hidden = 0;
  bool gated_mlp = false;
};
constexpr NamedModel kModels[] = {
    {"gpt2-small", 12, 768, 12, 1024, 50304},
    {"gpt2-xl", 48, 1600, 25, 1024, 50304},
    {"gpt-1.7b", 24, 2304, 24, 2048, 51200},
    {"gpt-7.5b", 36, 4096, 32, 2048, 51200},
    {"gpt-18.4b", 40, 6144, 48, 2048, 51200},
    {"gpt-39b", 48, 8192, 64, 2048, 51200},
    {"gpt3-175b", 96, 12288, 96, 2048, 51200},
    {"gpt-530b", 105, 20480, 128, 2048, 51200},
    {"gpt-1t", 128, 25600, 160, 2048, 51200},
    // Llama 2 (Touvron et al. 2023, table 1 and the released configs): SwiGLU MLPs of 11008 and 28672, 70B's 8 KV
    // heads. "-like": GPT's learned positions, biases and tied embeddings stand in for RoPE, none and untied ones
    // (1.7% and 0.3% fewer parameters than the 6.74B and 68.98B released).
    {"llama2-7b-like", 32, 4096, 32, 4096, 32000, 0, 11008, true},
    {"llama2-70b-like", 80, 8192, 64, 4096, 32000, 8, 28672, true},
};
}  // namespace

bool named_gpt(const std::string& name, GptModel& out) {
  for (const auto& n : kModels) {
    if (name == n.name) {
      out.name = n.name;
      out.layers = n.layers;
      out.hidden = n.hidden;
      out.heads = n.heads;
      out.seq = n.seq;
      out.vocab = n.vocab;
      out.kv_heads = n.kv_heads;
      out.ffn_hidden = n.ffn_hidden;
      out.gated_mlp = n.gated_mlp;
      return true;
    }
  }
  return false;
}

std::vector<std::string> named_gpt_names() {
  std::vector<std::string> v;
  for (const auto& n : kModels) v.emplace_back(n.name);
  return v;
}

double gpt_layer_parameters(const GptModel& m) {
  const double h = static_cast<double>(m.hidden);
  // QKV (h + 2w)h + h + 2w with w = kv heads x head size (w = h: 3h^2+3h), projection h^2+h, MLP up u*h + u (u = f,
  // or 2f gated) and down f*h + h, two layer norms 4h (multi-head, f = 4h: 12h^2 + 13h).
  const double w = h / static_cast<double>(m.heads) * static_cast<double>(m.kv());
  const double u = m.mlp_up_width(), f = m.ffn();
  return (h + 2 * w) * (h + 1) + h * h + h + u * (h + 1) + f * h + h + 4 * h;
}

double gpt_layer_parameters_per_rank(const GptModel& m, int t) {
  const double h = static_cast<double>(m.hidden);
  const double w = h / static_cast<double>(m.heads) * static_cast<double>(m.kv());  // all K (or V) columns
  return (gpt_layer_parameters(m) - 2 * w * (h + 1)) / t + 2 * kv_width_per_rank(m, t) * (h + 1);
}

GptModel vocab_padded(const GptModel& m, int tp) {
  GptModel out = m;
  if (tp > 1) out.vocab = (m.vocab + tp - 1) / tp * tp;
  return out;
}

double gpt_parameters(const GptModel& m) {
  const double h = static_cast<double>(m.hidden);
  return m.layers * gpt_layer_parameters(m) + static_cast<double>(m.vocab + m.seq) * h;
}

std::vector<NamedGemm> gpt_layer_gemms(const GptModel& m, double b, int t) {
  const double s = static_cast<double>(m.seq), h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads);
  const double bs = b * s;
  return {
      {"qkv", {bs, qkv_width_per_rank(m, t), h, 1}, false},  {"attention scores", {s, s, h / a, b * a / t}, true},
      {"attention context", {s, h / a, s, b * a / t}, true}, {"projection", {bs, h, h / t, 1}, false},
      {"mlp up", {bs, m.mlp_up_width() / t, h, 1}, false},   {"mlp down", {bs, h, m.ffn() / t, 1}, false},
  };
}

GemmShape gpt_logits_gemm(const GptModel& m, double b, int t) {
  return {b * m.seq, static_cast<double>(m.vocab) / t, static_cast<double>(m.hidden), 1};
}

double gpt_iteration_flops(const GptModel& m, double global_batch, Recompute r) {
  double fwd = 0, core = 0;
  for (const auto& g : gpt_layer_gemms(m, 1, 1)) {
    fwd += g.shape.flops();
    if (g.attention_core) core += g.shape.flops();
  }
  double passes_layer = 3 * fwd;  // forward + backward (2x)
  if (r == Recompute::kFull) passes_layer += fwd;
  if (r == Recompute::kSelective) passes_layer += core;
  const double logits = 3 * gpt_logits_gemm(m, 1, 1).flops();
  return global_batch * (m.layers * passes_layer + logits);
}

double megatron_flops_formula(const GptModel& m, double B, bool full_recompute) {
  const double s = static_cast<double>(m.seq), l = m.layers, h = static_cast<double>(m.hidden),
               V = static_cast<double>(m.vocab);
  if (full_recompute) return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h));
  return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h));
}

ModelState zero_model_state(double psi, long long dp, int stage, double grad_bytes) {
  if (stage < 0 || stage > 3) throw ConfigError(fmt::format("--zero = {} (allowed: 0, 1, 2, 3)", stage));
  const double n = static_cast<double>(std::max<long long>(1, dp));
  ModelState s;
  s.params = 2 * psi / (stage >= 3 ? n : 1);
  s.grads = grad_bytes * psi / (stage >= 2 ? n : 1);
  s.optimizer = 12 * psi / (stage >= 1 ? n : 1);
  return s;
}

AttentionKernels parse_attention_kernels(const std::string& s) {
  if (s == "fused") return AttentionKernels::kFused;
  if (s == "eager") return AttentionKernels::kEager;
  if (s == "flash") return AttentionKernels::kFlash;
  if (s == "flash2") return AttentionKernels::kFlash2;
  if (s == "flash3") return AttentionKernels::kFlash3;
  throw ConfigError(fmt::format(
      "--attention-kernels = '{}' (allowed: fused, Megatron-LM's scale-mask-softmax; eager, PyTorch's scale, mask, "
      "softmax and dropout one kernel each; flash, FlashAttention's, the scores never in memory; flash2 or flash3, "
      "FlashAttention-2 or -3 at the rates the cluster file's attention_calibration gives)",
      s));
}

const char* attention_kernels_name(AttentionKernels k) {
  switch (k) {
    case AttentionKernels::kEager:
      return "eager";
    case AttentionKernels::kFlash:
      return "flash";
    case AttentionKernels::kFlash2:
      return "flash2";
    case AttentionKernels::kFlash3:
      return "flash3";
    case AttentionKernels::kFused:
      break;
  }
  return "fused";
}

double gpt_layer_activation_bytes(const GptModel& m, double b, int t, bool sp, Recompute r, bool flash) {
  const double s = static_cast<double>(m.seq), h = static_cast<double>(m.hidden), a = static_cast<double>(m.heads);
  const double sbh = s * b * h;
  if (r == Recompute::kFull) return 2 * sbh / (sp ? t : 1);
  // In units of sbh: replicated over the tensor-parallel ranks unless sequence parallel, the layer norms' inputs 4,
  // the QKV and MLP inputs 2 + 2 and two dropout masks 1 + 1; split, Q 2, K and V 2 each at their width per rank
  // (h/t multi-head), the projection's input 2 and the MLP's 4f/h (6f/h gated); the scores' 5as/(ht) unless
  // recomputed.
  const double replicated = 10.0 / (sp ? t : 1);
  const double split = (4 + (m.gated_mlp ? 6 : 4) * m.ffn() / h) / t + 4 * kv_width_per_rank(m, t) / h;
  const double scores = r == Recompute::kSelective ? 0 : flash ? 4 * a / (h * t) : 5 * a * s / (h * t);
  return sbh * (replicated + split + scores);
}

double pipeline_bubble_fraction(int p, long long m, int v) {
  if (p < 1 || m < 1 || v < 1) throw InvalidArgument("pipeline_bubble_fraction: p, m and v must be positive");
  return static_cast<double>(p - 1) / (static_cast<double>(v) * static_cast<double>(m));
}

double Layer::params() const {
  if (kind == "pool") return 0;
  if (kind == "conv") return in * out * kernel * kernel + out;
  return in * out + out;
}

GemmShape Layer::forward_gemm(double batch) const {
  if (kind == "pool") return {0, 0, 0, 0};  // no GEMM (zero time, zero FLOPs)
  if (kind == "conv") return {batch * height * width, out, in * kernel * kernel, 1};
  return {batch, out, in, 1};
}

std::vector<GemmShape> layer_step_gemms(const LayerModel& m, double batch) {
  std::vector<GemmShape> out;
  for (const auto& l : m.layers) {
    if (l.kind == "pool") continue;
    GemmShape f = l.forward_gemm(batch);
    out.push_back(f);
    out.push_back({f.m, f.k, f.n, f.batch});  // input gradient (as step.cc's dgrad)
    out.push_back({f.k, f.n, f.m, f.batch});  // weight gradient (as step.cc's wgrad)
  }
  return out;
}

double LayerModel::params() const {
  double p = 0;
  for (const auto& l : layers) p += l.params();
  return p;
}

LayerModel parse_layer_model(const std::string& spec) {
  LayerModel m;
  m.name = "layers";
  for (const std::string& item : split(spec, ',')) {
    std::string it = trim(item);
    if (it.empty()) continue;
    auto colon = it.find(':');
    auto bad = [&]() {
      return ConfigError(fmt::format(
          "--layers-spec: '{}' is not a layer (allowed: dense:INxOUT, conv:INxOUTkK@HxW, pool:CkK@HxW with whole "
          "numbers 1..10^7, e.g. conv:3x64k3@32x32)",
          it));
    };
    if (colon == std::string::npos) throw bad();
    Layer l;
    l.kind = it.substr(0, colon);
    std::string rest = it.substr(colon + 1);
    // Whole numbers from 1 to 10^7, separated exactly as the form says, nothing after.
    auto fields = [&](const std::string& seps, std::initializer_list<double*> out) {
      size_t at = 0, k = 0;
      for (double* v : out) {
        if (k > 0) {
          if (at >= rest.size() || rest[at] != seps[k - 1]) throw bad();
          ++at;
        }
        size_t start = at;
        double x = 0;
        while (at < rest.size() && std::isdigit(static_cast<unsigned char>(rest[at])) && at - start < 9)
          x = 10 * x + (rest[at++] - '0');
        if (at == start || x < 1 || x > 1e7 || (at < rest.size() && std::isdigit(static_cast<unsigned char>(rest[at]))))
          throw bad();
        *v = x;
        ++k;
      }
      if (at != rest.size()) throw bad();
    };
    if (l.kind == "dense") {
      fields("x", {&l.in, &l.out});
    } else if (l.kind == "conv") {
      fields("xk@x", {&l.in, &l.out, &l.kernel, &l.height, &l.width});
    } else if (l.kind == "pool") {
      fields("k@x", {&l.in, &l.kernel, &l.height, &l.width});
      l.out = l.in;
      if (l.kernel > l.height || l.kernel > l.width) throw bad();
    } else {
      throw bad();
    }
    if (l.in <= 0 || l.out <= 0 || l.kernel <= 0 || l.height <= 0 || l.width <= 0) throw bad();
    m.layers.push_back(l);
  }
  if (m.layers.empty()) throw ConfigError("--layers-spec: no layers given");
  // Each layer takes what the one before gives: a dense layer the features (a map flattened: channels x height x
  // width), a convolution or pooling the channels and the map (a convolution's HxW is its output map: the map before
  // or, strided, a smaller one; a pooling's is its input map, divided by its window, rounding down).
  auto spec_of = [](const Layer& l) {
    return l.kind == "dense"  ? fmt::format("dense:{}x{}", l.in, l.out)
           : l.kind == "conv" ? fmt::format("conv:{}x{}k{}@{}x{}", l.in, l.out, l.kernel, l.height, l.width)
                              : fmt::format("pool:{}k{}@{}x{}", l.in, l.kernel, l.height, l.width);
  };
  for (size_t i = 1; i < m.layers.size(); ++i) {
    const Layer &a = m.layers[i - 1], &b = m.layers[i];
    const double h = a.kind == "pool" ? std::floor(a.height / a.kernel) : a.height;
    const double w = a.kind == "pool" ? std::floor(a.width / a.kernel) : a.width;
    std::string why;
    if (b.kind == "dense") {
      const double given = a.kind == "dense" ? a.out : a.out * h * w;
      if (b.in != given) why = fmt::format("takes {} features where the one before gives {}", b.in, given);
    } else if (a.kind == "dense") {
      why = "takes a map where the dense layer before gives flat features";
    } else if (b.in != a.out || (b.kind == "pool" ? b.height != h || b.width != w : b.height > h || b.width > w)) {
      why = fmt::format("takes {} channels of {}x{} where the one before gives {} of {}x{}", b.in, b.height, b.width,
                        a.out, h, w);
    }
    if (!why.empty())
      throw ConfigError(fmt::format(
          "--layers-spec: layer {} ({}) {}; allowed: layers that connect (a dense layer's IN the features before, a "
          "convolution's or pooling's channels the ones before, a pooling's HxW the map before and a convolution's no "
          "larger, e.g. conv:3x32k3@28x28,pool:32k2@28x28,"
          "dense:6272x10)",
          i + 1, spec_of(b), why));
  }
  return m;
}

}  // namespace conduit::sim
