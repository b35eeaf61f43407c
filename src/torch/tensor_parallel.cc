// Tensor parallelism: Megatron's f and g as autograd functions, and the vision transformer split over a group.
#include "torch/tensor_parallel.h"

#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/nn.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>

#include "core/error.h"
#include "torch/metrics.h"
#include "torch/models.h"

namespace conduit::train {
namespace {

namespace nn = torch::nn;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kPatch = 4, kTokens = 49, kPatchDim = 16, kWidth = 64, kMlp = 128, kBlocks = 4, kClasses = 10;

// Sums `t` (f32, contiguous) over the group in place.
void group_allreduce(TpGroup* g, torch::Tensor& t, const char* pass) {
  const auto t0 = std::chrono::steady_clock::now();
  const double s0 = now_s();
  coll::CollOptions o;
  o.timeout_s = g->timeout_s;
  try {
    g->comm->allreduce(t.data_ptr<float>(), size_t(t.numel()), DType::f32, ReduceOp::sum, o).wait();
  } catch (const Error& e) {  // (which group, which pass: the communicator names only a rank)
    rethrow_with_context(e, fmt::format("tensor parallelism, rank {} of its group of {}: the {} pass's allreduce",
                                        g->comm->rank(), g->comm->size(), pass));
  }
  const uint64_t bytes = uint64_t(t.numel()) * sizeof(float);
  g->payload_bytes += bytes;
  g->calls += 1;
  g->comm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  if (g->trace && g->trace->enabled())
    g->trace->complete("tp allreduce", 0, s0, now_s(), {{"bytes", bytes}, {"pass", pass}});
}

// The tokens each rank of the group holds under sequence parallelism: near-equal runs, the first ranks' a token
// longer (49 tokens: 25 + 24 on 2 ranks, 13 + 12 + 12 + 12 on 4).
std::vector<int64_t> token_counts(int64_t tokens, int ranks) {
  std::vector<int64_t> n(size_t(ranks), tokens / ranks);
  for (int64_t r = 0; r < tokens % ranks; ++r) n[size_t(r)] += 1;
  return n;
}
int64_t token_offset(int64_t tokens, int ranks, int rank) {
  const auto counts = token_counts(tokens, ranks);
  return std::accumulate(counts.begin(), counts.begin() + rank, int64_t{0});
}

// Sequence parallelism's collectives over the token dimension of (B, n, D) activations. Token-major buffers (n, B, D)
// make each rank's tokens one run, so the collectives concatenate and split runs. gather: the group's shards
// (B, n_r, D) -> (B, N, D); otherwise reduce-scatter: every rank's partial (B, N, D) summed, this rank's tokens kept.
// An allgather or reduce-scatter of n bytes moves half an allreduce's: counted as n/2 allreduced bytes.
torch::Tensor token_collective(TpGroup* g, const torch::Tensor& x, bool gather, const char* pass) {
  const auto t0 = std::chrono::steady_clock::now();
  const double s0 = now_s();
  const int t = g->comm->size();
  const int64_t b = x.size(0), d = x.size(2);
  const auto tokens = token_counts(kTokens, t);
  std::vector<size_t> counts;
  for (int64_t n : tokens) counts.push_back(size_t(n * b * d));
  torch::Tensor in = x.transpose(0, 1).contiguous();  // (n, B, D)
  const int64_t mine = tokens[size_t(g->comm->rank())];
  torch::Tensor out = torch::empty({gather ? kTokens : mine, b, d}, torch::kFloat);
  coll::CollOptions o;
  o.timeout_s = g->timeout_s;
  try {
    if (gather)
      g->comm->allgatherv(in.data_ptr<float>(), out.data_ptr<float>(), counts, DType::f32, o).wait();
    else
      g->comm->reduce_scatter(in.data_ptr<float>(), out.data_ptr<float>(), counts, DType::f32, ReduceOp::sum, o).wait();
  } catch (const Error& e) {
    rethrow_with_context(
        e, fmt::format("sequence parallelism, rank {} of its group of {}: the {} pass's {}", g->comm->rank(),
                       g->comm->size(), pass, gather ? "allgather" : "reduce-scatter"));
  }
  const uint64_t bytes = uint64_t(kTokens * b * d) * sizeof(float);
  g->payload_bytes += bytes / 2;
  g->calls += 1;
  g->comm_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  if (g->trace && g->trace->enabled())
    g->trace->complete(gather ? "tp allgather" : "tp reduce_scatter", 0, s0, now_s(),
                       {{"bytes", bytes}, {"pass", pass}});
  return out.transpose(0, 1);
}

// The group travels through autograd as an int64 (a Function's non-tensor arguments are IValues).
int64_t as_int(TpGroup* g) { return int64_t(reinterpret_cast<intptr_t>(g)); }
TpGroup* as_group(int64_t v) { return reinterpret_cast<TpGroup*>(static_cast<intptr_t>(v)); }
TpGroup* group_of(AutogradContext* ctx) { return as_group(ctx->saved_data["group"].toInt()); }

// f: the input of a column-parallel layer. Forward: as is; backward: the gradients of every rank's share summed.
struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    torch::Tensor g = grads[0].contiguous().clone();
    group_allreduce(group_of(ctx), g, "backward");
    return {g, torch::Tensor()};
  }
};

// g: the output of a row-parallel layer. Forward: every rank's partial product summed; backward: as is.
struct ReduceFromGroup : torch::autograd::Function<ReduceFromGroup> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    torch::Tensor y = x.contiguous().clone();
    group_allreduce(as_group(group), y, "forward");
    return y;
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], torch::Tensor()}; }
};

// Sequence parallelism's pair of collectives, each the other's backward. kGather (g-bar): this rank's tokens in,
// every token out (allgather); backward the partial gradients of every token summed and this rank's kept
// (reduce-scatter). Otherwise: every rank's partial sums of every token in, this rank's tokens of the sum out
// (reduce-scatter); backward the gradients of every token gathered (allgather).
template <bool kGather>
struct ExchangeTokens : torch::autograd::Function<ExchangeTokens<kGather>> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return token_collective(as_group(group), x, kGather, "forward");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {token_collective(group_of(ctx), grads[0], !kGather, "backward"), torch::Tensor()};
  }
};
using GatherTokens = ExchangeTokens<true>;
using ScatterTokens = ExchangeTokens<false>;

// Into the sequence-parallel region: every token in (computed alike on every rank), this rank's out; backward the
// ranks' token gradients gathered, so what came before gets every token's gradient on every rank.
struct SplitTokens : torch::autograd::Function<SplitTokens> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    TpGroup* g = as_group(group);
    const int t = g->comm->size(), r = g->comm->rank();
    return x.narrow(1, token_offset(kTokens, t, r), token_counts(kTokens, t)[size_t(r)]).clone();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {token_collective(group_of(ctx), grads[0], true, "backward"), torch::Tensor()};
  }
};

class Split {
 public:
  explicit Split(TpGroup* g) : group_(g && g->comm && g->comm->size() > 1 ? g : nullptr) {}
  // Layout only: rank `rank`'s share of a split over `size` ranks, with no group to run it (forward throws).
  Split(int size, int rank) : group_(nullptr), size_(size), rank_(rank) {}
  int size() const { return group_ ? group_->comm->size() : size_; }
  int rank() const { return group_ ? group_->comm->rank() : rank_; }
  // Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions each rank holds its share
  // of the tokens, and f and g become an allgather and a reduce-scatter of the tokens.
  bool sequence() const { return group_ && group_->sequence_parallel; }
  torch::Tensor f(const torch::Tensor& x) const {
    if (!group_) return unsplit(x);
    return sequence() ? GatherTokens::apply(x, as_int(group_)) : CopyToGroup::apply(x, as_int(group_));
  }
  torch::Tensor g(const torch::Tensor& x) const {
    if (!group_) return unsplit(x);
    return sequence() ? ScatterTokens::apply(x, as_int(group_)) : ReduceFromGroup::apply(x, as_int(group_));
  }
  // Every token to this rank's share (sequence parallelism), or as is.
  torch::Tensor split(const torch::Tensor& x) const { return sequence() ? SplitTokens::apply(x, as_int(group_)) : x; }
  // The sum over the group (allreduce forward, as is backward).
  torch::Tensor sum(const torch::Tensor& x) const {
    return group_ ? ReduceFromGroup::apply(x, as_int(group_)) : unsplit(x);
  }
  // Sequence parallelism: a replicated parameter used on this rank's tokens only gets a partial gradient; summed
  // over the group before anything else sees it (before a DistributedOptimizer's hooks, registered later).
  void sum_gradient(torch::Tensor& p) const {
    if (!sequence()) return;
    TpGroup* g = group_;
    p.register_hook([g](const torch::Tensor& grad) {
      torch::Tensor s = grad.contiguous().clone();
      group_allreduce(g, s, "backward");
      return s;
    });
  }

 private:
  // Without a group: x as is, unless this is a layout-only share (no group to sum it over).
  const torch::Tensor& unsplit(const torch::Tensor& x) const {
    if (size_ > 1) throw std::logic_error("tensor_parallel: a layout-only model (make_vit_layout) cannot run");
    return x;
  }
  TpGroup* group_;
  int size_ = 1, rank_ = 0;
};

// Pre-norm transformer block; this rank's heads and MLP units only.
class TpBlock : public nn::Module {
 public:
  explicit TpBlock(const Split& s) : s_(s) {
    const int64_t t = s.size(), r = s.rank();
    const int64_t dh = kWidth / kVitHeads;
    hl_ = kVitHeads / t;
    ml_ = kMlp / t;
    ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
    ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({kWidth})));
    // The whole block's layers, drawn in the same order at every T, then this rank's share of them.
    nn::Linear qkv(kWidth, 3 * kWidth), proj(kWidth, kWidth), fc1(kWidth, kMlp), fc2(kMlp, kWidth);
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> w, b;
    for (int64_t part = 0; part < 3; ++part) {  // rows: q of every head, then k, then v
      w.push_back(qkv->weight.narrow(0, part * kWidth + r * hl_ * dh, hl_ * dh));
      b.push_back(qkv->bias.narrow(0, part * kWidth + r * hl_ * dh, hl_ * dh));
    }
    qkv_w_ = register_parameter("qkv_weight", torch::cat(w).clone());
    qkv_b_ = register_parameter("qkv_bias", torch::cat(b).clone());
    proj_w_ = register_parameter("proj_weight", proj->weight.narrow(1, r * hl_ * dh, hl_ * dh).clone());
    proj_b_ = register_parameter("proj_bias", proj->bias.clone());
    fc1_w_ = register_parameter("fc1_weight", fc1->weight.narrow(0, r * ml_, ml_).clone());
    fc1_b_ = register_parameter("fc1_bias", fc1->bias.narrow(0, r * ml_, ml_).clone());
    fc2_w_ = register_parameter("fc2_weight", fc2->weight.narrow(1, r * ml_, ml_).clone());
    fc2_b_ = register_parameter("fc2_bias", fc2->bias.clone());
    // (applied to this rank's tokens under sequence parallelism)
    for (auto* p : {&ln1_->weight, &ln1_->bias, &ln2_->weight, &ln2_->bias, &proj_b_, &fc2_b_}) s.sum_gradient(*p);
  }

  // x: (B, 49, 64), or under sequence parallelism this rank's tokens of it.
  torch::Tensor forward(torch::Tensor x) {
    const int64_t bsz = x.size(0), n = kTokens, dh = kWidth / kVitHeads;
    auto h = s_.f(ln1_->forward(x));
    auto qkv = torch::nn::functional::linear(h, qkv_w_, qkv_b_).view({bsz, n, 3, hl_, dh}).permute({2, 0, 3, 1, 4});
    auto att = torch::softmax(qkv[0].matmul(qkv[1].transpose(-2, -1)) / std::sqrt(double(dh)), -1);
    auto o = att.matmul(qkv[2]).permute({0, 2, 1, 3}).reshape({bsz, n, hl_ * dh});
    x = x + s_.g(torch::nn::functional::linear(o, proj_w_)) + proj_b_;
    h = s_.f(ln2_->forward(x));
    h = torch::gelu(torch::nn::functional::linear(h, fc1_w_, fc1_b_));
    return x + s_.g(torch::nn::functional::linear(h, fc2_w_)) + fc2_b_;
  }

 private:
  Split s_;
  int64_t hl_ = 0, ml_ = 0;
  nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::Tensor qkv_w_, qkv_b_, proj_w_, proj_b_, fc1_w_, fc1_b_, fc2_w_, fc2_b_;
};

// The whole vit, or pipeline stage `stage` of `stages`, in `chunks` chunks (the interleaved schedule's): the model's
// blocks are cut into stages x chunks consecutive parts, and this stage's chunk j is part j x stages + stage. The
// first part also holds the embedding, the last the final norm and the classifier. Every stage draws the whole
// model's weights in the same order and registers (keeps) only its own, so the stages together are the unsplit model.
class Vit : public Net {
 public:
  Vit(const Split& s, int stage, int stages, int chunks) : s_(s), chunks_(chunks) {
    const bool first = stage == 0, last = stage == stages - 1;
    nn::Linear embed(kPatchDim, kWidth);
    torch::Tensor pos;
    {
      torch::NoGradGuard ng;
      pos = torch::randn({kTokens, kWidth}) * 0.02;
    }
    if (first) {
      embed_ = register_module("embed", embed);
      pos_ = register_parameter("pos", pos);
    }
    const int64_t per = kBlocks / (int64_t(stages) * chunks);
    blocks_.resize(size_t(chunks));
    for (int64_t i = 0; i < kBlocks; ++i) {
      auto b = std::make_shared<TpBlock>(s);
      const int64_t part = i / per;
      if (part % stages == stage)
        blocks_[size_t(part / stages)].push_back(register_module(fmt::format("block{}", i), b));
    }
    nn::LayerNorm ln(nn::LayerNormOptions({kWidth}));
    nn::Linear head(kWidth, kClasses);
    if (last) {
      ln_ = register_module("ln", ln);
      head_ = register_module("head", head);
      s.sum_gradient(ln_->weight);
      s.sum_gradient(ln_->bias);
    }
  }
  int chunks() const override { return chunks_; }
  std::vector<int64_t> chunk_input_shape(int) const override { return {kTokens, kWidth}; }
  std::vector<int64_t> chunk_output_shape(int) const override { return {kTokens, kWidth}; }
  // The first stage takes images (B, 1, 28, 28), the others the previous stage's (B, 49, 64); the last returns
  // logits (B, 10), the others (B, 49, 64). (A stage of several chunks: one at a time, forward_chunk.)
  torch::Tensor forward(torch::Tensor x) override {
    for (int j = 0; j < chunks_; ++j) x = forward_chunk(j, x);
    return x;
  }
  torch::Tensor forward_chunk(int j, torch::Tensor x) override {
    const int64_t bsz = x.size(0);
    // Units (ZeRO-3's): the embedding, each block, the final norm and classifier, in forward order.
    int u = embed_ ? 1 : 0;
    for (int k = 0; k < j; ++k) u += int(blocks_[size_t(k)].size());
    if (j == 0 && embed_) {
      // (B, 1, 28, 28) -> 7 x 7 patches of 4 x 4 pixels, row by row
      x = x.view({bsz, 7, kPatch, 7, kPatch}).permute({0, 1, 3, 2, 4}).reshape({bsz, kTokens, kPatchDim});
      x = unit(0, [&] { return s_.split(embed_->forward(x) + pos_); });
    }
    for (auto& b : blocks_[size_t(j)]) x = unit(u++, [&] { return b->forward(x); });
    if (j < chunks_ - 1 || !head_) return x;
    return unit(u, [&] {
      // Under sequence parallelism the mean of every rank's tokens: their sums, summed over the group.
      auto pooled = s_.sequence() ? s_.sum(ln_->forward(x).sum(1)) / double(kTokens) : ln_->forward(x).mean(1);
      return head_->forward(pooled);
    });
  }
  std::vector<std::vector<torch::Tensor>> units() override {
    std::vector<std::vector<torch::Tensor>> out;
    if (embed_) {
      out.push_back(embed_->parameters());
      out.back().push_back(pos_);
    }
    for (auto& chunk : blocks_)
      for (auto& b : chunk) out.push_back(b->parameters());
    if (head_) {
      out.push_back(ln_->parameters());
      for (auto& p : head_->parameters()) out.back().push_back(p);
    }
    return out;
  }

 private:
  Split s_;
  nn::Linear embed_{nullptr}, head_{nullptr};
  torch::Tensor pos_;
  int chunks_ = 1;
  std::vector<std::vector<std::shared_ptr<TpBlock>>> blocks_;  // of each chunk
  nn::LayerNorm ln_{nullptr};
};

}  // namespace

namespace {
std::shared_ptr<Net> make_vit_with(const Split& s, int stage, int stages, int chunks) {
  if (kVitHeads % s.size() != 0)
    throw ConfigError(fmt::format("config: tp: {} does not divide the vit's {} attention heads; allowed: 1, 2 or 4",
                                  s.size(), kVitHeads));
  if (stages < 1 || chunks < 1 || kBlocks % (int64_t(stages) * chunks) != 0 || stage < 0 || stage >= stages)
    throw ConfigError(
        fmt::format("config: pp: stage {} of {} in {} chunk(s) does not split the vit's {} blocks; "
                    "allowed: stages x chunks dividing the blocks, stage in [0, stages)",
                    stage, stages, chunks, kBlocks));
  return std::make_shared<Vit>(s, stage, stages, chunks);
}
}  // namespace

std::shared_ptr<Net> make_vit(TpGroup* group, int stage, int stages, int chunks) {
  return make_vit_with(Split(group), stage, stages, chunks);
}

std::shared_ptr<Net> make_vit_layout(int tp, int stage, int stages, int chunks) {
  if (tp < 1) throw ConfigError(fmt::format("config: tp: {} ranks; allowed: 1, 2 or 4", tp));
  return make_vit_with(Split(tp, 0), stage, stages, chunks);
}

}  // namespace conduit::train
