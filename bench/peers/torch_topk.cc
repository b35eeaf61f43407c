// Peer for `conduit bench compress --method topk`: libtorch's topk of |x| on one thread, on the same kind of input
// (N(0,1) f32). Prints one JSON line per size in the record format of `conduit bench compress --json`:
//   {"bench":"compress","impl":"libtorch","method":"topk:ratio=R","bytes":..,"elements":..,"compress_s":..,
//    "compress_gbs":..,"topk_only_s":..}
// compress_s times torch::topk(x.abs(), k) (what a top-k compressor must do); topk_only_s times topk of a
// precomputed |x|. Build: bench/peers/build_torch_topk.sh. Usage: torch_topk [--ratio R] [--size BYTES]...
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

template <typename F>
double best_time(double min_time, F f) {
  double best = 1e30, total = 0;
  for (int i = 0; i < 1000 && (i < 3 || total < min_time); ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t);
    total += t;
  }
  return best;
}

int main(int argc, char** argv) {
  double ratio = 0.001, min_time = 0.5;
  std::vector<long> sizes;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--ratio" && i + 1 < argc) {
      ratio = std::atof(argv[++i]);
    } else if (a == "--size" && i + 1 < argc) {
      char* end = nullptr;
      const long v = std::strtol(argv[++i], &end, 10);
      if (*argv[i] == '\0' || *end != '\0' || v < 4) {
        std::fprintf(stderr, "torch_topk: --size %s: allowed: a whole number of bytes, 4 or more (no suffixes)\n",
                     argv[i]);
        return 2;
      }
      sizes.push_back(v);
    } else if (a == "--min-time" && i + 1 < argc) {
      min_time = std::atof(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: torch_topk [--ratio R] [--size BYTES]... [--min-time S]\n");
      return 2;
    }
  }
  if (sizes.empty()) sizes.push_back(100000000);  // 25M f32
  torch::set_num_threads(1);
  torch::manual_seed(12345);
  for (long bytes : sizes) {
    long n = bytes / 4;
    long k = std::max<long>(1, static_cast<long>(std::ceil(ratio * n - 1e-9)));
    auto x = torch::randn({n});
    auto ax = x.abs();
    torch::Tensor vals, idx;
    // What Conduit's top-k produces: the k largest magnitudes' indices and their signed values, in no order
    // (sorted=false: Conduit does not sort by magnitude either).
    double t_all = best_time(min_time, [&] {
      std::tie(vals, idx) = torch::topk(x.abs(), k, -1, /*largest=*/true, /*sorted=*/false);
      vals = x.index_select(0, idx);
    });
    double t_topk = best_time(min_time, [&] { std::tie(vals, idx) = torch::topk(ax, k, -1, true, false); });
    std::printf(
        "{\"bench\":\"compress\",\"impl\":\"libtorch\",\"torch\":\"%s\",\"method\":\"topk:ratio=%g\",\"bytes\":%ld,"
        "\"elements\":%ld,\"k\":%ld,\"compress_s\":%.6g,\"compress_gbs\":%.6g,\"topk_only_s\":%.6g}\n",
        TORCH_VERSION, ratio, n * 4, n, k, t_all, n * 4.0 / t_all / 1e9, t_topk);
    std::fflush(stdout);
  }
  return 0;
}
