#pragma once
// Calibration: fit alpha (per-step latency), beta (seconds per byte) and gamma (seconds per reduced byte) of a
// transport from measured collective times (`conduit bench coll --json` lines), using the simulator's own
// patterns: every measured (op, algorithm, ranks, bytes) has time = A alpha + B n beta + C n gamma, where A, B and C
// are read off the pattern on a flat network; non-negative least squares over all lines. The fitted values
// and a measured memory bandwidth (a STREAM-like copy) and GEMM samples (`conduit bench gemm --json`, libtorch) or a
// peak rate make a cluster file that `conduit sim
// step --cluster FILE` uses to predict runs on this machine.
#include <string>
#include <vector>

#include "sim/cluster.h"
#include "sim/collective.h"
#include "sim/compute.h"

namespace conduit::sim {

struct BenchSample {
  std::string op, algo, transport;
  long long world = 1;
  double bytes = 0;
  double seconds = 0;
  double stagger = 0;  // seconds the last rank arrived after the others (`bench coll --stagger-us`); 0: back to back
  // The runtime's CONDUIT_RING_SEGMENT_BYTES in that run ("segment_bytes"): its chain broadcast's segments. Records
  // without it (written before 2026-12-06) ran with the default, 1 MiB.
  double segment = 1024.0 * 1024;
};

// Parses JSON lines of `conduit bench coll --json`. Lines without a JSON object and other tools' records (no "op")
// are passed over; a malformed line or a bench record with a missing, mistyped or out-of-range field, or one whose
// run gave wrong results, is a ConfigError naming origin:line and the field; records of another implementation (a
// peer's "impl"), of one rank or of 0 bytes are skipped, and `skipped` (when given) says how many of each.
std::vector<BenchSample> parse_bench_lines(const std::string& text, const std::string& origin,
                                           std::string* skipped = nullptr);

// The simulator's collective and algorithm for a bench record's op and algo (the runtime's names per operation, and
// the simulator's), for a group of `world` ranks; false when the simulator does not model it.
bool bench_collective(const std::string& op, Collective& c);
bool bench_algorithm(Collective c, std::string algo, long long world, Algorithm& a);

struct AlphaBetaGamma {
  double alpha = 0, beta = 0, gamma = 0;
  double wake = 0;  // per call, from fit_wake_latency (0 when not measured)
  size_t samples = 0;
  double rms_relative_error = 0;  // of the fit over the samples
  // Every sample reduces bytes in the same proportion to those it moves (allreduce alone, say): beta and gamma
  // cannot be told apart, so gamma is 0 and beta carries both (right for those collectives, too slow for ones that
  // move bytes without reducing them).
  bool gamma_inseparable = false;
  double pipeline_segment = 1024.0 * 1024;  // the samples' segment (the cluster file's pipeline_segment)
};

// Fits one transport's back-to-back samples. Samples whose algorithm the simulator does not model are skipped
// (counted); staggered samples are left to fit_wake_latency.
AlphaBetaGamma fit_alpha_beta_gamma(const std::vector<BenchSample>& samples, int* unmodelled = nullptr);
// Whether fit_alpha_beta_gamma uses the sample: back to back, of an operation and algorithm the simulator models.
bool fit_uses(const BenchSample& s);

// The time a collective call takes beyond `fit` when its peers arrived first and stopped spinning while they waited
// (`bench coll --stagger-us`: their wake-up and return to the call): the median over the staggered samples of the
// measured time minus the fit's prediction for the same operation, algorithm, world and bytes, at least 0. `used`
// receives how many staggered samples there were (0: none, and the result is 0).
double fit_wake_latency(const std::vector<BenchSample>& samples, const AlphaBetaGamma& fit, size_t* used = nullptr);

// Measured bytes/s of a large copy (a + b -> c, three streams), `bytes` per array.
double measure_memory_bandwidth(size_t bytes = 64 << 20, int repeats = 3);

// Parses JSON lines of measured GEMMs, {"m", "n", "k", "gflops"} as `conduit bench gemm --json` writes them.
// The same shape measured several times (e.g. by each of N concurrent ranks) becomes one sample of the median rate;
// likewise for convolutions (per pass) and poolings below.
// Lines without '{' and records of another "kind" are skipped; a GEMM record whose m, n, k or gflops is missing or
// not a positive number is a ConfigError naming the file, line and field; no GEMM record at all is one too.
std::vector<GemmSample> parse_gemm_lines(const std::string& text, const std::string& origin);

// Parses the convolution records of the same lines, {"kind": "bench.conv", "batch", "in", "out", "height", "width",
// "kernel", "stride", "padding", "forward_us", "input_grad_us", "weight_grad_us"} (input size; stride defaults to 1,
// padding to 0); other records are skipped. A convolution record with a missing or non-positive field (padding:
// negative), or whose kernel does not fit the padded input, is a ConfigError naming the file, line and field. None
// at all is not an error (the GEMM model then costs convolutions).
std::vector<ConvSample> parse_conv_lines(const std::string& text, const std::string& origin);

// Parses the pooling records, {"kind": "bench.pool", "batch", "channels", "height", "width", "kernel", "forward_us",
// "backward_us"} (max pooling in kernel x kernel windows, stride kernel); other records are skipped. A pooling record
// with a missing or non-positive field, or a kernel larger than the map, is a ConfigError naming the file, line and
// field. None at all is not an error (pooling is then costed as memory-bound).
std::vector<PoolSample> parse_pool_lines(const std::string& text, const std::string& origin);

// The measured training steps of layer-list models, {"kind": "bench.model_step", "layers", "batch", "step_samples_s"}
// (`conduit bench gemm --model mlp,cnn --json`): the step samples of every record with the same layers and batch are
// pooled (under `conduit launch -n N` each of the N ranks writes one record) and summarized as 21 quantiles (0, 0.05,
// ..., 1). Records without "layers" (a model that is no layer list, e.g. resnet) are skipped; a record whose batch or
// samples are missing or not positive is a ConfigError naming the file, line and field. None at all is not an error.
std::vector<ModelStepSample> parse_model_step_lines(const std::string& text, const std::string& origin);

// How many processes timed the records of `text` at the same time (their "concurrent" field, written by `conduit
// bench gemm` under `conduit launch -n N`; 1 when absent). Records that disagree are a ConfigError naming the file.
long long bench_concurrency(const std::string& text, const std::string& origin);

// The poolings of `conduit train`'s CNN at `batch` samples per worker.
std::vector<PoolSample> calibration_pool_shapes(double batch);

// The convolutions `conduit bench gemm` and `conduit sim calibrate` time by default: every convolution layer of
// `conduit train`'s CNN at `batch` samples per worker (stride 1, padding kernel / 2, as models.cc builds them).
std::vector<ConvSample> calibration_conv_shapes(double batch);

// The GEMM shapes `conduit bench gemm` and `conduit sim calibrate` time by default: every GEMM of a training step
// (forward, input and weight gradients) of `conduit train`'s CNN and MLP at `batch` samples per worker, and a
// square sweep 32..1024, without duplicates.
std::vector<GemmShape> calibration_gemm_shapes(double batch);

// A cluster file for this machine: one node of `ranks` workers joined by the fitted transport. `memory_bandwidth`,
// `peak_flops` and the GEMMs are measured by one thread; each rank gets `share` of that speed (the fraction of a
// core it runs on: cores / ranks when ranks outnumber the cores, else 1). Measured convolutions (one thread)
// become the conv_calibration table, measured poolings the pool_calibration table and measured model steps the
// model_calibration table, their times divided by `share`.
std::string calibrated_cluster_yaml(const std::string& name, int ranks, const AlphaBetaGamma& fit,
                                    double memory_bandwidth, double memory_bytes, double peak_flops,
                                    const std::vector<GemmSample>& gemms, const std::string& transport,
                                    double share = 1.0, const std::vector<ConvSample>& convs = {},
                                    const std::vector<PoolSample>& pools = {},
                                    const std::vector<ModelStepSample>& models = {});

}  // namespace conduit::sim
