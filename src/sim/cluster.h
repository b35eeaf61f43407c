#pragma once
// A cluster description: kinds of nodes (accelerator, intra-node fabric, NICs) and the inter-node network.
// Loaded from YAML (configs/clusters/*.yaml; the same text is embedded as presets). All values are SI.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace conduit::sim {

// A measured GEMM: shape and achieved FLOP/s. A calibration table overrides the analytical efficiency model for
// shapes near a measured one (see compute.h).
struct GemmSample {
  double m = 0, n = 0, k = 0;
  double flops = 0;  // achieved FLOP/s
};

// A measured 2-D convolution (`conduit bench gemm --json` "bench.conv" records): input batch x in x height x width,
// `out` filters of kernel x kernel, stride and zero padding; the seconds of its forward, its input gradient and its
// weight (and bias) gradient as the framework runs them (CPU libtorch: oneDNN direct kernels, not im2col GEMMs).
// A conv calibration table replaces the implicit-GEMM model for convolution layers near a measured one.
struct ConvSample {
  double batch = 0, in = 0, out = 0, height = 0, width = 0, kernel = 0, stride = 1, padding = 0;
  double forward_s = 0, input_grad_s = 0, weight_grad_s = 0;
  double out_height() const { return std::floor((height + 2 * padding - kernel) / stride) + 1; }
  double out_width() const { return std::floor((width + 2 * padding - kernel) / stride) + 1; }
};

// A measured max pooling (`conduit bench gemm --json` "bench.pool" records): kernel x kernel windows with stride
// `kernel` over batch x channels x height x width; the seconds of its forward (with indices, as training runs it) and
// backward. CPU libtorch's pooling is compute-bound (~10x its memory time), so the element-wise model misses it.
struct PoolSample {
  double batch = 0, channels = 0, height = 0, width = 0, kernel = 0;
  double forward_s = 0, backward_s = 0;
};

// A measured (or published) FlashAttention kernel: its forward and backward over causal attention of `seq` tokens and
// heads `head_dim` wide reached `achieved` FLOP/s, counted as FlashAttention's benchmarks count them (the forward
// 4 s^2 d FLOPs a head and sequence, halved by the causal mask; the backward, which recomputes the scores, 2.5 times
// the forward: 3.5 times in all). `kernel`: flash2 or flash3 (`--attention-kernels`).
struct AttentionSample {
  std::string kernel;
  double seq = 0, head_dim = 0, achieved = 0;
};

// A measured training step of a layer-list model (`conduit bench gemm --model` "bench.model_step" records, through
// `conduit sim calibrate`): what one worker does from zeroing its gradients to the gradient exchange (zero grads,
// build the batch, forward with the loss, backward with the hooks that copy gradients into the exchange buffer), at
// `batch` samples, as the seconds at evenly spaced quantiles 0, 1/(n-1), ..., 1 of the measured steps (pooled over
// the ranks that timed it together). The step model takes from it the framework's time beyond the layers' kernels
// (median step minus the modelled layers at that batch) and the wait for the slowest of N ranks: measured at a
// barrier when the file's ranks timed the steps together, else from the quantiles (see step.h).
struct ModelStepSample {
  std::string layers;  // parse_layer_model syntax
  double batch = 0;
  std::vector<double> quantiles;  // seconds, non-decreasing, at least two
  // Measured with each step ending in a barrier among `wait_ranks` ranks (0: not measured): the median of step +
  // barrier minus the median step, i.e. the wait for the slowest rank.
  double wait_ranks = 0, slowest_wait = 0;
  double optimizer = 0;  // median optimizer step (SGD with momentum) over the model's parameters; 0: not measured
  // The slowest record's median step over the fastest's (records: the processes that timed the model together); far
  // above 1 when one process ran slower for the whole bench, which makes slowest_wait that process's lag. Not saved.
  double rank_spread = 1;
  double quantile(double q) const;  // linear interpolation, q in [0, 1]
  double median() const { return quantile(0.5); }
};

struct Accelerator {
  std::string name;
  double peak_flops = 0;       // dense BF16/FP16 tensor FLOP/s
  double peak_flops_fp32 = 0;  // FP32 FLOP/s (non-tensor)
  double memory_bytes = 0;
  double memory_bandwidth = 0;  // bytes/s
  int sm_count = 1;
  // The SMs (compute units) a collective's kernels hold while they run (NCCL: one CTA a channel, each on an SM of its
  // own): compute that overlaps a collective runs on the others, slower by comm_sms / sm_count. 0: collectives take
  // none of the compute (CPU sockets, copy engines).
  int comm_sms = 0;
  int tile_m = 128, tile_n = 128;
  double gemm_efficiency = 0.8;     // fraction of peak reached by large, well-shaped GEMMs
  double memory_efficiency = 0.85;  // fraction of memory bandwidth reached by streaming kernels
  double kernel_overhead = 4e-6;    // seconds per kernel launch
  std::vector<GemmSample> calibration;
  std::vector<ConvSample> conv_calibration;
  std::vector<PoolSample> pool_calibration;
  std::vector<AttentionSample> attention_calibration;
  std::vector<ModelStepSample> model_calibration;
};

struct LinkSpec {
  double bandwidth = 0;  // bytes/s per direction
  double latency = 0;    // seconds
};

struct NodeKind {
  std::string name;
  int count = 0;  // nodes of this kind in the described cluster (0: as many as --gpus needs)
  int gpus = 1;   // accelerators per node
  Accelerator accelerator;
  std::string intra_kind = "nvswitch";  // nvswitch | pcie | none
  LinkSpec intra;
  int nics = 1;
  LinkSpec nic;
};

enum class TopologyKind { kFatTree, kRailOptimized, kTorus, kFlat };

struct NetworkSpec {
  TopologyKind topology = TopologyKind::kFatTree;
  int nodes_per_leaf = 1;
  double oversubscription = 1;        // leaf downlink capacity / uplink capacity
  double switch_latency = 0;          // seconds per switch traversed
  std::vector<int> torus_dims;        // torus: nodes along each dimension
  LinkSpec torus_link;                // torus: each neighbour link
  double software_overhead = 0;       // seconds per collective step (alpha's software part)
  // Seconds per collective call for waking peers that arrived first and stopped polling while they waited (CPU
  // transports that spin, then sleep: a futex wake-up and an idle core's return). The step model charges it once
  // per data-parallel call (gradient buckets, ZeRO's gathers, compressed exchanges), which training's ranks reach
  // apart; the collective model itself (sim coll, tensor- and pipeline-parallel calls in lockstep) does not. 0 for
  // accelerators' collectives, which poll (`conduit sim calibrate` measures it).
  double wake_latency = 0;
  double reduction_bandwidth = 1e12;  // bytes/s reduced (gamma = 1 / this)
  // Bytes a pipelined chain (broadcast and reduce over `ring`) forwards at a time, each hop waiting for a whole one:
  // NCCL's step, NCCL_BUFFSIZE (4 MiB) over NCCL_STEPS (8); a calibrated cluster writes the runtime's
  // CONDUIT_RING_SEGMENT_BYTES (1 MiB by default) that its benchmark ran with. YAML `pipeline_segment`.
  double pipeline_segment = 512.0 * 1024;
  bool in_network_reduction = false;
  // A leaf's uplink: false, its switch's (nodes_per_leaf nodes' NICs over the oversubscription, a part-full leaf
  // too); true, the attached nodes' share of it (a job's view of a loaded cluster in `sim cluster`; no YAML key).
  bool uplink_share_of_attached = false;
};

struct ClusterSpec {
  std::string name;
  std::string description;
  std::vector<NodeKind> node_kinds;
  NetworkSpec network;

  bool heterogeneous() const { return node_kinds.size() > 1; }
  int gpus_per_node() const { return node_kinds.front().gpus; }
  // Total accelerators described when every kind has a count; 0 when the cluster scales with --gpus.
  long long described_gpus() const;
};

// Parses a cluster YAML text; `origin` names the file or preset in errors.
// The largest dimension (m, n, k, batch, channels, map sizes) and kernel or stride a calibration sample may give.
constexpr double kMaxCalibratedDim = 1e9, kMaxCalibratedKernel = 1e4;
ClusterSpec parse_cluster_yaml(const std::string& text, const std::string& origin);
// A preset name (dgx-a100, dgx-h100, ethernet-25g, edge) or a path to a YAML file.
ClusterSpec load_cluster(const std::string& preset_or_file);
std::vector<std::string> preset_names();
// The embedded YAML text of a preset; ConfigError naming the presets when unknown.
const char* preset_yaml(const std::string& name);

// A cluster whose every link is the same alpha-beta link (for closed-form checks): `gpus` endpoints, one per
// node, each with one link of `bandwidth` and a per-message latency `alpha`; reductions at `gamma` s/byte.
ClusterSpec flat_cluster(double alpha, double bandwidth, double gamma, double peak_flops = 100e12);

}  // namespace conduit::sim
