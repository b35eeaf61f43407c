#include "sim/inference.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace conduit::sim {

double kv_cache_bytes(const GptModel& m, int tp, int pp, long long tokens, long long batch) {
  // K and V of this rank's key/value heads (h/t under multi-head attention; grouped-query attention keeps fewer).
  return 2.0 * (static_cast<double>(m.layers) / pp) * kv_width_per_rank(m, tp) * static_cast<double>(tokens) *
         static_cast<double>(batch) * 2.0;
}

InferenceResult simulate_inference(CollectiveModel& net, const GptModel& given, const InferenceConfig& c) {
  given.validate();
  const Topology& topo = net.topology();
  const long long gpus = topo.gpus();
  if (c.tp < 1 || c.pp < 1) throw ConfigError(fmt::format("--tp = {} and --pp = {} must be at least 1", c.tp, c.pp));
  if (gpus % (static_cast<long long>(c.tp) * c.pp) != 0)
    throw ConfigError(fmt::format("--tp ({}) x --pp ({}) must divide --gpus ({})", c.tp, c.pp, gpus));
  const GptModel m0 = vocab_padded(given, c.tp);  // as simulate_step: the output layer split evenly
  if (m0.heads % c.tp != 0) throw ConfigError(fmt::format("--tp = {} must divide --heads = {}", c.tp, m0.heads));
  kv_heads_per_rank(m0, c.tp);  // (refuses a tp that neither divides the key/value heads nor is a multiple of them)
  check_ffn_split(m0, c.tp);
  if (m0.layers % c.pp != 0) throw ConfigError(fmt::format("--pp = {} must divide --layers = {}", c.pp, m0.layers));
  if (c.batch < 1) throw ConfigError(fmt::format("--batch = {} must be at least 1", c.batch));
  if (c.prompt < 1 || c.generate < 1) throw ConfigError("--prompt and --generate must be at least 1 token");
  if (c.prompt > m0.seq || c.generate > m0.seq - c.prompt)  // (the sum of two huge values overflowed)
    throw ConfigError(
        fmt::format("--prompt ({}) + --generate ({}) exceed the model's context of {} tokens (--seq); "
                    "allowed: prompt + generate up to --seq, a context of at least 2 tokens",
                    c.prompt, c.generate, m0.seq));
  InferenceResult r;
  r.replicas = gpus / (static_cast<long long>(c.tp) * c.pp);
  const int t = c.tp, p = c.pp, lps = m0.layers / p;
  const double h = static_cast<double>(m0.hidden), a = static_cast<double>(m0.heads), b = c.batch;
  const double V = static_cast<double>(m0.vocab);
  const Group tg{t, 1, 0};
  const Group pg{p, t, 0};
  const double s = static_cast<double>(c.prompt);
  const double f = m0.ffn(), up = m0.mlp_up_width();

  // One replica on accelerators `acc`: prefill, decode per token, what bounds the decode, and each pipeline stage's
  // share of a request.
  struct Timing {
    double prefill = 0, decode = 0, latency = 0;
    // The busiest stage's time on one batch's request (its prefill and generate - 1 decode steps): with p batches in
    // flight it serves each of them in turn, so it sets the steady-state rate (b generate tokens per `interval`).
    double interval = 0;
    double decode_interval = 0;  // the busiest stage's time on one decode step of a batch
    std::string bound;
  };
  auto timing = [&](const Accelerator& acc, CollectiveModel& kind_net) {
    Timing tm;
    // Prefill: the forward pass over the prompt.
    GptModel pm = m0;
    pm.seq = c.prompt;
    double layer = 0;
    const bool measured_core = c.fused_attention && !c.flash_kernel.empty();
    for (auto g : gpt_layer_gemms(pm, b, t)) {
      if (measured_core && g.attention_core) continue;
      // (fused and causal: FlashAttention skips the blocks above the diagonal, half the scores and the context)
      if (c.fused_attention && g.attention_core)
        (std::string(g.name) == "attention scores" ? g.shape.n : g.shape.k) /= 2;
      layer += gemm_time(acc, g.shape);
    }
    // (FlashAttention-2 or -3 at its measured rate: the causal forward's 2 b (a/t) s^2 d FLOPs, as sim step counts
    // them)
    if (measured_core)
      layer += flash_attention_forward_flops(b, a / t, s, h / a) /
               flash_attention_rates(acc, c.flash_kernel, s, h / a,
                                     "--attention flash or fused (FlashAttention at the GEMM rate), unfused")
                   .forward;
    const double scores_traffic = c.fused_attention ? 0 : 2 * b * (a / t) * s * s;
    layer += memory_time(acc, 2 * (11 * b * s * h + scores_traffic) + 2 * b * s * (up + f) / t, 6);
    double tp_layer = t > 1 ? 2 * kind_net.time(Collective::kAllReduce, Algorithm::kAuto, tg, b * s * h * 2) : 0;
    double p2p = p > 1 ? kind_net.time(Collective::kShift, Algorithm::kDirect, pg, b * s * h * 2 / t) : 0;
    double logits = gemm_time(acc, {b, V / t, h, 1});
    // Megatron's vocab-parallel embedding: its output allreduced over the t ranks (first stage); the last token's
    // logits, a 1/t slice of the vocabulary on each rank, gathered whole for sampling (bf16; last stage); with
    // pipeline stages the sampled token (4 bytes a sequence) back from the last stage to the first, for the next step.
    auto embedding_exchange = [&](double tokens) {
      return t > 1 ? kind_net.time(Collective::kAllReduce, Algorithm::kAuto, tg, b * tokens * h * 2) : 0.0;
    };
    const double logits_gather = t > 1 ? kind_net.time(Collective::kAllGather, Algorithm::kAuto, tg, b * V * 2) : 0;
    const double token_back = p > 1 ? kind_net.time(Collective::kShift, Algorithm::kDirect, pg, b * 4) : 0;
    // Each stage's share: its layers, the first stage the embedding's exchange, every stage but the last its send to
    // the next, the last the logits, their gather and (decode) the sampled token's return. The shares add up to the
    // pass, so a request's latency is their sum.
    std::vector<double> stage_prefill(p, lps * (layer + tp_layer));
    for (int i = 0; i + 1 < p; ++i) stage_prefill[i] += p2p;
    stage_prefill.front() += embedding_exchange(s);
    stage_prefill.back() += logits + logits_gather;
    tm.prefill = p * lps * (layer + tp_layer) + (p - 1) * p2p + logits + embedding_exchange(s) + logits_gather;

    // Decode at the average context length. What bounds it: the time of the memory-bound kernels (their traffic),
    // of the arithmetic-bound ones, or of the launches and the tensor- and pipeline-parallel exchanges (`latency`),
    // whichever is the largest share of the step. (It compared the GEMMs' FLOPs at the peak rate with their bytes,
    // and called a batch-256 decode three times its traffic's time, and gpt2-small's launch-bound one, memory-bound.)
    const double ctx = static_cast<double>(c.prompt) + static_cast<double>(c.generate) / 2;
    double dlayer = 0, mem = 0, arith = 0, launches = 0;
    auto kernel = [&](const GemmShape& g) {
      bool memory_bound = false;
      const double k = gemm_time(acc, g, &memory_bound);
      (memory_bound ? mem : arith) += k - acc.kernel_overhead;
      launches += acc.kernel_overhead;
      return k;
    };
    const double d = h / a;
    // Attention over the cache: each key/value head's K and V read once for the g query heads that share it (one
    // under multi-head attention).
    const double kvh = kv_heads_per_rank(m0, t), g = a / t / kvh;
    const GemmShape shapes[] = {{b, qkv_width_per_rank(m0, t), h, 1},
                                {g, ctx, d, b * kvh},
                                {g, d, ctx, b * kvh},
                                {b, h, h / t, 1},
                                {b, up / t, h, 1},
                                {b, h, f / t, 1}};
    for (const auto& g : shapes) dlayer += kernel(g);
    const double elementwise = memory_time(acc, 2 * 11 * b * h, 6);
    dlayer += elementwise;
    mem += elementwise - 6 * acc.kernel_overhead;
    launches += 6 * acc.kernel_overhead;
    double dtp = t > 1 ? 2 * kind_net.time(Collective::kAllReduce, Algorithm::kAuto, tg, b * h * 2) : 0;
    double dp2p = p > 1 ? kind_net.time(Collective::kShift, Algorithm::kDirect, pg, b * h * 2 / t) : 0;
    const double layers = static_cast<double>(p) * lps;
    mem *= layers, arith *= layers;
    const double vocab = embedding_exchange(1) + logits_gather + token_back;
    launches = launches * layers + layers * dtp + (p - 1) * dp2p + vocab;
    const double dlogits = kernel({b, V / t, h, 1});
    tm.decode = layers * (dlayer + dtp) + (p - 1) * dp2p + dlogits + vocab;
    tm.bound = mem >= arith && mem >= launches ? "memory" : arith >= launches ? "compute" : "latency";
    std::vector<double> stage_decode(p, lps * (dlayer + dtp));
    for (int i = 0; i + 1 < p; ++i) stage_decode[i] += dp2p;
    stage_decode.front() += embedding_exchange(1);
    stage_decode.back() += dlogits + logits_gather + token_back;
    // The prefill gives each sequence its first token; the other generate - 1 take a decode step each (vLLM's
    // end-to-end latency: time to first token + (n - 1) time per output token).
    const double steps = static_cast<double>(c.generate - 1);
    tm.latency = tm.prefill + steps * tm.decode;
    // Steady state with p batches in flight: a batch's next step waits for its previous one to pass every stage (the
    // latency), and each stage serves the p batches in turn, so a stage with more than its 1/p share of the work
    // (the last, with a large vocabulary's logits) is busy all the time and the others wait on it. Its work per
    // request is at least latency / p (the shares add up to the latency), so p batches keep it busy: the throughput is
    // b generate tokens per its interval (p b generate over the latency only when the stages are equal; it was that
    // always, and a 256,000-token vocabulary's logits on the last of 4 stages served 1.5x what that stage can).
    for (int i = 0; i < p; ++i) {
      tm.interval = std::max(tm.interval, stage_prefill[i] + steps * stage_decode[i]);
      tm.decode_interval = std::max(tm.decode_interval, stage_decode[i]);
    }
    return tm;
  };

  // Clusters with several node kinds (edge): each replica runs at the pace of the slowest kind among its nodes and
  // must fit in the smallest memory; the reported latencies are the slowest replica's, the throughput the sum over
  // replicas. (Node 0's kind for all of them put 8 GB devices' replicas in 64 GB and at their speed.)
  // A kind's replicas exchange over that kind's links: their tensor- and pipeline-parallel groups are timed on a
  // cluster of that kind's nodes alone. (The whole cluster's model keeps the slowest placement of a group, which
  // gave the 10 GbE devices' replicas the 1 GbE devices' exchanges: 666 tokens/s where each kind alone sums to 790.)
  const auto& kinds = topo.spec().node_kinds;
  const long long width = static_cast<long long>(t) * p;
  std::vector<Timing> per_kind(kinds.size());
  std::vector<bool> present(kinds.size(), false);
  for (size_t k = 0; k < kinds.size(); ++k)
    if (topo.kind_counts()[k] > 0) {
      present[k] = true;
      if (kinds.size() == 1) {
        per_kind[k] = timing(kinds[k].accelerator, net);
        continue;
      }
      ClusterSpec alone = topo.spec();
      alone.node_kinds = {kinds[k]};
      const long long gpn = topo.gpus_per_node();
      const long long nodes = std::max(topo.kind_counts()[k], (width + gpn - 1) / gpn);
      alone.node_kinds[0].count = static_cast<int>(nodes);
      Topology kind_topo(alone, nodes * gpn);
      CollectiveModel kind_net(kind_topo);
      per_kind[k] = timing(kinds[k].accelerator, kind_net);
    }
  double capacity = 0;
  bool first = true;
  for (size_t k = 0; k < kinds.size(); ++k)
    if (present[k]) {
      capacity = first ? kinds[k].accelerator.memory_bytes : std::min(capacity, kinds[k].accelerator.memory_bytes);
      first = false;
    }
  Timing slowest;
  double throughput = 0;
  for (long long rep = 0; rep < r.replicas; ++rep) {
    const Timing* tm = nullptr;
    const long long n0 = topo.node_of(rep * width), n1 = topo.node_of((rep + 1) * width - 1);
    double interval = 0, decode_interval = 0;  // (the replica's busiest stage at its slowest kind's pace)
    for (long long n = n0; n <= n1; ++n) {
      const Timing& k = per_kind[static_cast<size_t>(&topo.kind_of_node(n) - kinds.data())];
      if (!tm || k.latency > tm->latency) tm = &k;
      interval = std::max(interval, k.interval);
      decode_interval = std::max(decode_interval, k.decode_interval);
    }
    throughput += b * static_cast<double>(c.generate) / interval;
    // At that throughput the p batches in flight each wait for their turn on the busiest stage: a request takes p of
    // its intervals (Little's law: p b sequences in flight, b requests an interval) and a decode step p of its steps,
    // the same as alone when the stages are equal (p max = sum), more when one is busier (a batch alone passed the
    // stages in their sum: 0.26 s a request where 4 in flight take 0.40 s, an audit).
    r.loaded_request_latency = std::max(r.loaded_request_latency, std::max(p * interval, tm->latency));
    r.loaded_decode_per_token = std::max(r.loaded_decode_per_token, std::max(p * decode_interval, tm->decode));
    if (tm->latency > slowest.latency) slowest = *tm;
  }
  r.prefill = slowest.prefill;
  r.decode_per_token = slowest.decode;
  r.decode_bound = slowest.bound;
  r.request_latency = slowest.latency;
  r.tokens_per_second = throughput;
  r.batches_in_flight = p;

  // Memory: weights, KV cache, and the prefill's largest transient: the MLP phase (up-projection output and QKV) or
  // the attention phase (QKV and its output; unfused, the b (a/t) s^2 scores and their softmax, which the prefill
  // timing above then writes to memory, so the two agree), plus the logits. (Unfused was the only model until
  // 2026-12-06: a 32,000-token prompt of a 7B model needed 162 GB a GPU, 132 GB of them scores no FlashAttention
  // kernel stores.)
  // The heaviest stage: its layers and the embeddings (the first stage holds the token and position embeddings, the
  // last a copy of the token embedding for the logits), the token embeddings split over tp, the position embeddings
  // whole on each rank (they were split too). Spread evenly over the stages, they
  // understated the first stage's memory for small models with pp > 1.
  // (a rank replicating a KV head holds its whole K and V weights: gpt_layer_parameters_per_rank)
  r.weight_bytes = 2 * (static_cast<double>(lps) * gpt_layer_parameters_per_rank(m0, t) +
                        static_cast<double>(m0.vocab) * static_cast<double>(m0.hidden) / t +
                        static_cast<double>(m0.seq) * static_cast<double>(m0.hidden));
  const long long tokens = c.prompt + c.generate;
  // (each stage holds the caches of the p batches in flight)
  r.kv_bytes = p * kv_cache_bytes(m0, t, p, tokens, c.batch);
  const double qkv = qkv_width_per_rank(m0, t);
  // The attention phase: QKV and its output (fused), or QKV and the scores with their softmax (unfused).
  const double attention =
      c.fused_attention ? 2 * b * s * (qkv + h / t) : 2 * b * s * qkv + 2 * 2 * b * (a / t) * s * s;
  const double act = std::max(2 * b * s * (up / t + qkv), attention) + 4 * b * V / t;
  r.memory_total = r.weight_bytes + r.kv_bytes + act;
  r.memory_capacity = capacity;
  r.fits = r.memory_total <= r.memory_capacity;
  const double per_seq = p * kv_cache_bytes(m0, t, p, tokens, 1) + act / b;
  // (at most what --batch takes, 2^20: a tiny model on a large memory fitted more sequences than an int holds, and
  // up to INT_MAX was printed, which --batch then refused)
  const double fitting = std::floor((r.memory_capacity - r.weight_bytes) / per_seq);
  r.max_batch = static_cast<long long>(std::clamp(fitting, 0.0, static_cast<double>(kMaxInferBatch)));
  r.max_batch_capped = fitting > static_cast<double>(kMaxInferBatch);
  return r;
}

}  // namespace conduit::sim
