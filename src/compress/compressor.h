#pragma once
// One interface for every gradient compressor. A Compressor is configuration only (built by make_compressor from a
// name and string parameters); everything that changes from step to step lives in a TensorState the caller owns,
// one per tensor: residuals, momentum, PowerSGD's Q, the step counter and the RNG stream. A TensorState saves to
// and restores from bytes, so a run resumed from a checkpoint continues bit for bit.
//
// compress() turns f32 input into a packed payload whose size is the exact number of bytes that travel on the
// wire (no header: sizes are known from the configuration or, for variable-size methods, from the payload length).
// decompress() turns a payload back into f32 (it only reads the state, so a rank can decompress its peers'
// payloads). collective() says how payloads of several ranks are combined (see compress/collectives.h).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace conduit::compress {

using Params = std::map<std::string, std::string>;
using Bytes = std::vector<uint8_t>;

enum class Collective : uint8_t {
  allreduce,      // linear: payloads are arrays of linear_dtype() that sum element-wise
  allgather,      // non-linear: allgatherv the payloads, decompress each and sum
  majority_vote,  // 1-bit signs, allgathered, combined by majority vote (sign of the sum of signs)
  powersgd,       // two allreduces (P then Q) with an orthogonalisation in between
};
const char* collective_name(Collective c);

struct TensorState {
  std::vector<size_t> shape;  // the tensor's shape (PowerSGD views it as shape[0] x rest); empty: 1-D
  uint64_t step = 0;          // number of compress() calls so far
  uint64_t seed = 0;          // shared by every rank (random-k indices, PowerSGD's initial Q)
  uint64_t stream = 0;        // differs per rank (stochastic rounding noise), e.g. the rank
  std::map<std::string, std::vector<float>> buffers;  // residual, momentum, Q, ...

  // Created zero-filled on first use; InvalidArgument when it exists with another size.
  std::vector<float>& buffer(const std::string& name, size_t n);
  Bytes save() const;
  static TensorState load(std::span<const uint8_t> bytes);  // InvalidArgument when the bytes are not a state
  bool operator==(const TensorState& o) const = default;
};

class Compressor;
// The most bytes a payload of n elements may take, checked before anything is allocated for one a peer announces:
// the method's payload (uint8 with chunk 1 takes 9 bytes an element) or a sparsifier's indices and values (8 bytes
// an element; a variable-size payload such as threshold's is no more), plus 64. Each decoder checks the exact length.
uint64_t max_payload_bytes(const Compressor& c, size_t n, const TensorState& st);

class Compressor {
 public:
  virtual ~Compressor() = default;
  virtual std::string name() const = 0;
  virtual Collective collective() const = 0;
  bool linear() const { return collective() == Collective::allreduce; }
  // For linear compressors: the element type the payload is summed as (f32, f16 or bf16).
  virtual DType linear_dtype() const { return DType::f32; }
  // False when the payload size depends on the data (threshold): then only the payload's length tells it.
  virtual bool fixed_size() const { return true; }
  // compress() calls before the method compresses as it will from then on (PowerSGD's start_iter, DGC's warm-up
  // stages): what a benchmark of its steady state runs first.
  virtual uint64_t warmup_calls() const { return 0; }
  // Bytes on the wire for the next compress() of a tensor of `numel` elements with this state (fixed-size methods).
  virtual size_t wire_bytes(size_t numel, const TensorState& st) const = 0;
  double ratio(size_t numel, const TensorState& st) const;  // 4*numel / wire_bytes

  // Compresses `in` into `out` (resized to the exact wire size) and advances the state (step += 1).
  virtual void compress(std::span<const float> in, TensorState& st, Bytes& out) const = 0;
  // Decodes a payload produced by the last compress() on this rank or on any rank in step with it.
  virtual void decompress(std::span<const uint8_t> payload, const TensorState& st, std::span<float> out) const = 0;
  // out += decode(payload); the default decodes into a temporary.
  virtual void decompress_add(std::span<const uint8_t> payload, const TensorState& st, std::span<float> acc) const;
  // acc -= decode(payload) (error feedback's residual update); sparse and sign methods override it.
  virtual void decompress_sub(std::span<const uint8_t> payload, const TensorState& st, std::span<float> acc) const;
  // Error feedback's step fused into fewer passes: e += in, compress e into out (step += 1), e -= decode(out), with
  // the same results as those three calls. False (and nothing done) when the method has no fused form.
  virtual bool compress_feedback(std::span<const float> in, std::span<float> e, TensorState& st, Bytes& out) const {
    return false;
  }

  // The error-feedback residual st holds (what was given but not sent yet); empty for methods without one.
  virtual std::vector<float> residual(const TensorState&) const { return {}; }

  Bytes compress(std::span<const float> in, TensorState& st) const {
    Bytes b;
    compress(in, st, b);
    return b;
  }
  // A fresh state for a tensor (the parameters decide which buffers it will hold).
  TensorState make_state(std::vector<size_t> shape, uint64_t seed = 0, uint64_t stream = 0) const;
  TensorState make_state(size_t numel, uint64_t seed = 0, uint64_t stream = 0) const {
    return make_state(std::vector<size_t>{numel}, seed, stream);
  }
  // Whether compress() changes anything but the step counter (EF residuals, momentum, Q).
  virtual bool stateful() const { return false; }
};

using CompressorPtr = std::unique_ptr<Compressor>;

// Names: none fp16 bf16 int8 uint8 qsgd terngrad natural signsgd signum scaled_sign efsignsgd onebit topk randk
// threshold dgc powersgd, and "ef:<name>" (error feedback around any of them). Unknown names or parameters raise
// ConfigError with one line listing what is allowed; bad values name the parameter and the allowed range.
CompressorPtr make_compressor(const std::string& name, const Params& params = {});
std::vector<std::string> compressor_names();
// The parameters `name` accepts with their defaults, e.g. {"ratio","0.01"} for topk.
Params compressor_defaults(const std::string& name);
// "topk:ratio=0.01,sample=0.01" -> make_compressor("topk", {{"ratio","0.01"},{"sample","0.01"}}).
CompressorPtr parse_compressor(const std::string& spec);

// Why a compressor's error can exceed its input (E||x - D(C(x))||^2 >= ||x||^2), which error feedback and
// CHOCO-gossip cannot work with, and the setting that avoids it; nullopt when it shrinks its input. `name` is the
// compressor as written (the examples use it), `inner` the method, `params` its parameters, already checked.
struct Growth {
  std::string why, fix;
};
std::optional<Growth> input_growth(const std::string& name, const std::string& inner, const Params& params);
// The same for a spec "name:key=value,..." (after parse_compressor accepted it).
std::optional<Growth> input_growth(const std::string& spec);

// A compressed exchange's input must be finite: most methods cannot carry a nan or an inf (top-k and threshold
// select by comparisons a nan fails, the 8-bit and ternary scales take the largest finite magnitude or turn an inf
// into zeros), so the result would be finite and silently wrong. Throws InvalidArgument naming the first bad
// element, the compressor and what it means (a diverged run). One pass over the data, as the compressors make.
// none, fp16 and bf16 pass nan and inf on and are not checked.
void check_finite_input(std::span<const float> in, const std::string& compressor, const char* what);

}  // namespace conduit::compress
