#pragma once
// Workload models: GPT-style transformers (FLOPs per layer from their GEMMs, parameters, memory per GPU) and
// models given as a list of layers (MLP, CNN).
//
// GPT layer, micro-batch b, sequence s, hidden h, heads a, tensor parallel t (per GPU):
//   QKV (bs x h)(h x 3h/t), scores (s x h/a)(h/a x s) x ba/t, context (s x s)(s x h/a) x ba/t,
//   projection (bs x h/t)(h/t x h), MLP up (bs x h)(h x 4h/t), MLP down (bs x 4h/t)(4h/t x h)
//   (grouped-query attention narrows the QKV GEMM, a gated MLP of width f has up (h x 2f/t) and down (f/t x h))
//   -> forward 24bsh^2 + 4bs^2h FLOPs per layer (t = 1); backward twice the forward (input and weight gradients);
//   logits (bs x h)(h x V/t): 2bshV forward.
//   Recompute none: 3 passes; selective: + the attention core (scores, softmax, context) forward again
//   (Korthikanti et al. 2022); full: + the whole layer forward again. With full recompute a GPT iteration is
//   Megatron's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs (Narayanan et al. 2021, eq. 3).
// Parameters: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) (Narayanan et al. 2021, eq. 2).
// Model state, mixed-precision Adam (ZeRO paper, Rajbhandari et al. 2020): 2 (fp16 params) + 2 (fp16 grads)
// + 12 (fp32 params, momentum, variance) bytes per parameter; stage 1 shards the 12, stage 2 also the grads,
// stage 3 also the params over the data-parallel ranks.
// Activations per layer (Korthikanti et al. 2022, bytes): sbh(34 + 5as/h) without parallelism;
//   tensor parallel sbh(10 + 24/t + 5as/(ht)); + sequence parallel sbh(34/t + 5as/(ht));
//   selective recompute drops the 5as/h term; full recompute keeps only the layer input 2sbh (/t with SP).
//   Of the 24/t, the MLP's 16 is 4f/h (its activation's input and output), 6f/h gated (the gate and up outputs and
//   their product, as Megatron-LM's fused SwiGLU keeps them); K and V's 2 + 2 shrink with grouped-query attention.
#include <string>
#include <vector>

#include "sim/compute.h"

namespace conduit::sim {

enum class Recompute { kNone, kSelective, kFull };
enum class AttentionKernels { kFused, kEager, kFlash, kFlash2, kFlash3 };
// "fused", "eager", "flash", "flash2", "flash3"
AttentionKernels parse_attention_kernels(const std::string& s);
// FlashAttention, any version: the scores stay on chip (none in memory, none stored, recomputed in the backward).
inline bool scores_on_chip(AttentionKernels k) {
  return k == AttentionKernels::kFlash || k == AttentionKernels::kFlash2 || k == AttentionKernels::kFlash3;
}
const char* attention_kernels_name(AttentionKernels k);
enum class Schedule { kGpipe, k1F1B, kInterleaved };
Recompute parse_recompute(const std::string& s);
Schedule parse_schedule(const std::string& s);
const char* recompute_name(Recompute r);
const char* schedule_name(Schedule s);

struct GptModel {
  std::string name = "gpt";
  int layers = 1;
  long long hidden = 1, heads = 1, seq = 1, vocab = 1;
  // Key/value heads: 0 or `heads` is multi-head attention; fewer (dividing heads) grouped-query attention (Ainslie et
  // al. 2023; Llama 2 70B has 8): the K and V projections and the KV cache shrink by heads / kv_heads.
  long long kv_heads = 0;
  // The MLP's hidden width: 0 is GPT's 4 x hidden. Gated (SwiGLU, Shazeer 2020; Llama) projects the input twice to
  // this width, a gate and an up projection, and multiplies them: 3 x hidden x width weights against GPT's 2.
  long long ffn_hidden = 0;
  bool gated_mlp = false;
  void validate() const;  // ConfigError naming the field
  long long kv() const { return kv_heads > 0 ? kv_heads : heads; }
  double ffn() const { return ffn_hidden > 0 ? static_cast<double>(ffn_hidden) : 4.0 * static_cast<double>(hidden); }
  // The up projection's output width: the gate and up halves together when gated.
  double mlp_up_width() const { return (gated_mlp ? 2 : 1) * ffn(); }
};

// Per tensor-parallel rank of `t`: the key/value heads it holds (kv/t, or one, replicated, when t exceeds kv, as
// Megatron-LM does), their width (heads x the head size: the width of its K, and of its V), and the width of its Q,
// K and V projections' output (h/t + 2 x that). ConfigError when neither of t and kv divides the other.
double kv_heads_per_rank(const GptModel& m, int t);
double kv_width_per_rank(const GptModel& m, int t);
double qkv_width_per_rank(const GptModel& m, int t);
// ConfigError unless `t` divides the MLP's width (Megatron-LM splits it evenly over the tensor-parallel ranks).
void check_ffn_split(const GptModel& m, int t);

// Named shapes: Megatron-LM's table 1 rows, GPT-2/GPT-3 (vocabularies padded to a multiple of 128).
// Returns false when `name` is not one of them.
bool named_gpt(const std::string& name, GptModel& out);
std::vector<std::string> named_gpt_names();

// The model as `tp` tensor-parallel ranks hold it: the vocabulary padded up to a multiple of tp, so that the
// embedding and the output layer split evenly (Megatron-LM pads to a multiple of 128·tp for its kernels too; the
// least padding is modelled, which leaves every vocabulary that tp already divides as it is).
GptModel vocab_padded(const GptModel& m, int tp);

double gpt_parameters(const GptModel& m);
double gpt_layer_parameters(const GptModel& m);  // 12h^2 + 13h (multi-head, 4h MLP)
// One layer's parameters on each of t tensor-parallel ranks: a t-th of them, except that with more ranks than KV
// heads (t > kv_heads) each rank holds the whole K and V weights of the head it replicates, not kv/t of one.
double gpt_layer_parameters_per_rank(const GptModel& m, int t);

struct NamedGemm {
  const char* name;
  GemmShape shape;
  bool attention_core;  // recomputed by selective recompute
};

// The forward GEMMs of one transformer layer on one GPU (micro-batch b, tensor parallel t).
std::vector<NamedGemm> gpt_layer_gemms(const GptModel& m, double b, int t);
GemmShape gpt_logits_gemm(const GptModel& m, double b, int t);

// FLOPs of one iteration (global batch B) counted from the GEMMs above, including recomputation.
double gpt_iteration_flops(const GptModel& m, double global_batch, Recompute r);
// Megatron's closed forms: 96 B s l h^2 (1 + s/6h + V/(16 l h)) with full recompute, 72 B s l h^2 (1 + s/6h +
// V/(12 l h)) without.
double megatron_flops_formula(const GptModel& m, double global_batch, bool full_recompute);

// ZeRO model-state bytes per GPU for `params` parameters over `dp` ranks (mixed-precision Adam, K = 12), with
// gradients of `grad_bytes` each (2: fp16/bf16; 4: fp32, --grad-bytes 4).
struct ModelState {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
ModelState zero_model_state(double params, long long dp, int stage, double grad_bytes = 2);

// Activation bytes of one layer for one micro-batch (flash: FlashAttention's, the scores' log-sum-exp in fp32 in
// place of the scores and their dropout mask).
double gpt_layer_activation_bytes(const GptModel& m, double b, int t, bool sequence_parallel, Recompute r,
                                  bool flash = false);

// Pipeline bubble as a fraction of the ideal (bubble-free) time: (p-1)/m, or (p-1)/(v m) interleaved.
double pipeline_bubble_fraction(int p, long long m, int v);

// A model given as a list of layers, for data-parallel training (MLPs, CNNs).
struct Layer {
  std::string kind;                          // dense | conv | pool
  double in = 0, out = 0;                    // dense: features; conv: channels
  double kernel = 1, height = 1, width = 1;  // conv: kernel size and output feature map; pool: window, input map
  double params() const;
  GemmShape forward_gemm(double batch) const;  // conv as implicit GEMM (M = batch*H*W, N = out, K = in*k*k)
  ConvShape conv_shape(double batch) const {   // conv layers
    return {batch, in, out, height, width, kernel};
  }
  PoolShape pool_shape(double batch) const { return {batch, in, height, width, kernel}; }  // pool layers
};
struct LayerModel {
  std::string name;
  std::vector<Layer> layers;
  double params() const;
};
// Parses "dense:784x1024,dense:1024x10" or "conv:3x64k3@32x32,pool:64k2@32x32,...,dense:4096x10" (pool:CkK@HxW:
// max pooling of C channels of an HxW map in KxK windows, stride K; no parameters, no GEMM).
LayerModel parse_layer_model(const std::string& spec);

// `conduit train`'s models (src/torch/models.cc) as layer lists: the CNN (conv 3x3 32 on 28x28, max pool 2, conv 3x3
// 64 on 14x14, max pool 2, fc 3136-128, fc 128-10; ReLU is element-wise) and the MLP (784-256-128-10).
inline constexpr const char* kTrainCnnLayers =
    "conv:1x32k3@28x28,pool:32k2@28x28,conv:32x64k3@14x14,pool:64k2@14x14,dense:3136x128,dense:128x10";
inline constexpr const char* kTrainMlpLayers = "dense:784x256,dense:256x128,dense:128x10";

// The GEMMs of one training step of a layer model at `batch` samples, the shapes simulate_layer_step times: per
// layer the forward (M x K)(K x N), the input gradient (M x N)(N x K) and the weight gradient (K x M)(M x N).
// Pooling layers have none.
std::vector<GemmShape> layer_step_gemms(const LayerModel& m, double batch);

}  // namespace conduit::sim
