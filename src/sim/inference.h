#pragma once
// LLM serving: prefill and decode of a GPT model with tensor and pipeline parallelism and a KV cache.
//   prefill   the prompt (batch x prompt tokens) runs through every layer as in training's forward pass, with
//             two tensor-parallel allreduces per layer and the pipeline stages one after another
//   decode    one token per sequence per step: the same GEMMs with M = batch (every step reads all weights:
//             memory-bound unless launches and exchanges, or a large batch's arithmetic, take longer), attention reads
//             the KV cache (kv_cache_bytes: K and V of the rank's key/value heads, 2 bytes each, per token of context
//             and sequence), two small allreduces per layer (latency-bound); the prefill makes each sequence's first
//             token, decode the other generate - 1; each pass (prefill, decode step) also allreduces the vocab-parallel
//             embedding's output and gathers the logits over the t ranks, and with p stages sends the sampled tokens
//             from the last stage back to the first
//   memory    the heaviest pipeline stage's weights (its layers and embeddings, 2 bytes/param, / t) + KV cache of
//             p batches x batch x (prompt + generate) tokens + the prefill's largest transient (activations, the
//             logits; with unfused attention the b (a/t) s^2 scores)
//   pipeline  p stages serve p batches at once (each stage another batch's step): a request's latency runs the p
//             stages one after another; each stage has its layers, the first also the embedding's exchange, the last
//             the logits, their gather and the sampled token's return, and the busiest stage sets the throughput (b
//             generate tokens per its time on one request; p batches over the latency when the stages are equal)
// Replicas: accelerators / (t p) independent copies serve requests in parallel.
#include <string>

#include "sim/collective.h"
#include "sim/workload.h"

namespace conduit::sim {

struct InferenceConfig {
  int tp = 1, pp = 1;
  int batch = 1;  // sequences in each batch in flight
  long long prompt = 1024, generate = 256;
  // Fused attention (FlashAttention, as vLLM, TGI and TensorRT-LLM serve): the prefill's b (a/t) s^2 scores never
  // reach memory, and the causal mask's upper half is skipped (half the attention FLOPs). Unfused: the scores and
  // their softmax written and read, the whole s x s computed.
  bool fused_attention = true;
  // FlashAttention-2 or -3 ("flash2", "flash3"; with fused_attention): the prefill's attention core at the
  // accelerator's attention_calibration forward rate (compute.h) instead of its causal half at the GEMM rate. Empty:
  // the GEMM rate.
  std::string flash_kernel;
};

// The largest batch `sim infer --batch` takes (and the largest that fits reports).
inline constexpr long long kMaxInferBatch = 1LL << 20;

struct InferenceResult {
  long long replicas = 1;
  double prefill = 0;           // seconds (time to first token)
  double decode_per_token = 0;  // seconds per generated token (whole batch)
  double request_latency = 0;   // prefill + (generate - 1) decode steps, a batch alone in the pipeline
  double tokens_per_second = 0;  // generated tokens/s over all replicas
  // A request's latency and a decode step's time at that throughput, the p batches in flight each waiting for its
  // turn on the busiest stage (p of its intervals); the same as alone with equal stages (and at p = 1). The slowest
  // replica's.
  double loaded_request_latency = 0, loaded_decode_per_token = 0;
  // Batches in flight per replica: with p pipeline stages each works on another batch (vLLM's pipeline-parallel
  // virtual engines), so p batches share the stages and each stage holds their KV caches.
  int batches_in_flight = 1;
  double weight_bytes = 0, kv_bytes = 0, memory_total = 0, memory_capacity = 0;
  bool fits = true;
  long long max_batch = 0;        // the largest batch that fits, at most kMaxInferBatch
  bool max_batch_capped = false;  // (more would fit)
  // What bounds a decode step: "memory" (memory-bound kernels' traffic), "compute" (arithmetic-bound kernels), or
  // "latency" (kernel launches and the tensor- and pipeline-parallel exchanges), whichever takes the most of it.
  std::string decode_bound;
};

// KV-cache bytes per GPU: 2 (K and V) x layers/p x the K columns on a rank (kv_width_per_rank: kv_heads x head size
// / t, or one head when t > kv_heads) x tokens x batch x 2 bytes.
double kv_cache_bytes(const GptModel& m, int tp, int pp, long long tokens, long long batch);

InferenceResult simulate_inference(CollectiveModel& net, const GptModel& m, const InferenceConfig& c);

}  // namespace conduit::sim
