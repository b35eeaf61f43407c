#include "sim/inference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace conduit::sim {

double kv_cache_bytes(const GptModel& m, int tp, int pp, long long tokens, long long batch) {
  return 2.0 * (static_cast<double>(m.layers) / pp) * (static_cast<double>(m.hidden) / tp) *
         static_cast<double>(tokens) * static_cast<double>(batch) * 2.0;
}

InferenceResult simulate_inference(CollectiveModel& net, const GptModel& m0, const InferenceConfig& c) {
  m0.validate();
  const Topology& topo = net.topology();
  const long long gpus = topo.gpus();
  if (c.tp < 1 || c.pp < 1 || gpus % (static_cast<long long>(c.tp) * c.pp) != 0)
    throw ConfigError(fmt::format("--tp ({}) x --pp ({}) must divide --gpus ({})", c.tp, c.pp, gpus));
  if (m0.heads % c.tp != 0) throw ConfigError(fmt::format("--tp = {} must divide --heads = {}", c.tp, m0.heads));
  if (m0.layers % c.pp != 0) throw ConfigError(fmt::format("--pp = {} must divide --layers = {}", c.pp, m0.layers));
  if (c.batch < 1) throw ConfigError(fmt::format("--batch = {} must be at least 1", c.batch));
  if (c.prompt < 1 || c.generate < 1) throw ConfigError("--prompt and --generate must be at least 1 token");
  if (c.prompt + c.generate > m0.seq)
    throw ConfigError(fmt::format("--prompt ({}) + --generate ({}) exceed the model's context of {} tokens (--seq)",
                                  c.prompt, c.generate, m0.seq));
  InferenceResult r;
  r.replicas = gpus / (static_cast<long long>(c.tp) * c.pp);
  const NodeKind& kind = topo.kind_of_node(0);
  const Accelerator& acc = kind.accelerator;
  const int t = c.tp, p = c.pp, lps = m0.layers / p;
  const double h = static_cast<double>(m0.hidden), a = static_cast<double>(m0.heads), b = c.batch;
  const double V = static_cast<double>(m0.vocab);
  const Group tg{t, 1, 0};
  const Group pg{p, t, 0};

  // Prefill: the forward pass over the prompt.
  GptModel pm = m0;
  pm.seq = c.prompt;
  double layer = 0;
  for (const auto& g : gpt_layer_gemms(pm, b, t)) layer += gemm_time(acc, g.shape);
  const double s = static_cast<double>(c.prompt);
  layer += memory_time(acc, 2 * (11 * b * s * h + 2 * b * (a / t) * s * s + 2 * b * s * 4 * h / t), 6);
  double tp_layer = t > 1 ? 2 * net.time(Collective::kAllReduce, Algorithm::kAuto, tg, b * s * h * 2) : 0;
  double p2p = p > 1 ? net.time(Collective::kShift, Algorithm::kDirect, pg, b * s * h * 2 / t) : 0;
  double logits = gemm_time(acc, {b, V / t, h, 1});
  r.prefill = p * lps * (layer + tp_layer) + (p - 1) * p2p + logits;

  // Decode at the average context length.
  const double ctx = static_cast<double>(c.prompt) + static_cast<double>(c.generate) / 2;
  double dlayer = 0, flops = 0, bytes = 0;
  const double d = h / a, f = m0.ffn_mult * h;
  const GemmShape shapes[] = {{b, 3 * h / t, h, 1}, {1, ctx, d, b * a / t}, {1, d, ctx, b * a / t},
                              {b, h, h / t, 1},     {b, f / t, h, 1},       {b, h, f / t, 1}};
  for (const auto& g : shapes) {
    dlayer += gemm_time(acc, g);
    flops += g.flops();
    bytes += 2 * (g.m * g.k + g.k * g.n + g.m * g.n) * g.batch;
  }
  dlayer += memory_time(acc, 2 * 11 * b * h, 6);
  double dtp = t > 1 ? 2 * net.time(Collective::kAllReduce, Algorithm::kAuto, tg, b * h * 2) : 0;
  double dp2p = p > 1 ? net.time(Collective::kShift, Algorithm::kDirect, pg, b * h * 2 / t) : 0;
  r.decode_per_token = p * lps * (dlayer + dtp) + (p - 1) * dp2p + gemm_time(acc, {b, V / t, h, 1});
  const double t_flops = flops / (acc.peak_flops * acc.gemm_efficiency);
  const double t_bytes = bytes / (acc.memory_bandwidth * acc.memory_efficiency);
  r.decode_bound = t_bytes >= t_flops ? "memory" : "compute";
  r.request_latency = r.prefill + static_cast<double>(c.generate) * r.decode_per_token;
  r.tokens_per_second = static_cast<double>(r.replicas) * b * static_cast<double>(c.generate) / r.request_latency;

  // Memory: weights, KV cache, and the prefill's largest transient: the MLP phase (up-projection output and QKV) or
  // the attention phase (QKV, the b (a/t) s^2 scores and their softmax, which the prefill timing above writes to
  // memory, so the two agree), plus the logits.
  r.weight_bytes = 2 * gpt_parameters(m0) / (static_cast<double>(t) * p);
  const long long tokens = c.prompt + c.generate;
  r.kv_bytes = kv_cache_bytes(m0, t, p, tokens, c.batch);
  const double act =
      std::max(2 * b * s * (f / t + 3 * h / t), 2 * b * s * 3 * h / t + 2 * 2 * b * (a / t) * s * s) + 4 * b * V / t;
  r.memory_total = r.weight_bytes + r.kv_bytes + act;
  r.memory_capacity = acc.memory_bytes;
  r.fits = r.memory_total <= r.memory_capacity;
  const double per_seq = kv_cache_bytes(m0, t, p, tokens, 1) + act / b;
  r.max_batch =
      std::max<long long>(0, static_cast<long long>(std::floor((r.memory_capacity - r.weight_bytes) / per_seq)));
  return r;
}

}  // namespace conduit::sim
