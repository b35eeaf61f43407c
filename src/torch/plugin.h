#pragma once
// The libtorch half of the `conduit` binary, loaded on demand. Loading libtorch costs ~0.7 s of static
// initialisation per process; the commands that do not train or time kernels (launch, bench coll, sim, cluster,
// sweep) should not pay it. So the code that calls libtorch (trainer, models, optimizers) is linked into the module
// libconduit-torch.so beside the binary (compiled once, also for the tests' static library), and the binary reaches
// it only through this table. The module
// takes everything else (transports, collectives, compressors, schemes, config) from the binary, which exports its
// symbols: one copy of each in the process. Torch-free.
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "coll/communicator.h"
#include "fl/federation.h"
#include "torch/config.h"
#include "torch/gemm_bench.h"
#include "torch/trainer.h"

namespace conduit::train {

struct TorchApi {
  int abi = 0;                              // kTorchApiAbi of the module; the binary refuses another
  const char* token = "";                   // the build's fingerprint of this interface's headers (CMake); must match
  size_t config_size = 0, result_size = 0;  // sizeof(TrainConfig), sizeof(TrainResult) in the module
  TrainResult (*train_worker)(const TrainConfig&, coll::CommPtr, const WorkerOptions&) = nullptr;
  void (*check_model_config)(const TrainConfig&, int world, bool notes) = nullptr;
  std::vector<GemmTiming> (*time_gemms)(const std::vector<std::array<int64_t, 3>>&, int threads,
                                        double min_seconds) = nullptr;
  std::vector<ConvTiming> (*time_convs)(const std::vector<ConvTiming>&, int threads, double min_seconds) = nullptr;
  std::vector<PoolTiming> (*time_pools)(const std::vector<PoolTiming>&, int threads, double min_seconds) = nullptr;
  ModelStepTiming (*time_model_step)(const std::string& name, int batch, int threads, int steps,
                                     const std::function<void()>& after_step) = nullptr;
  std::unique_ptr<fl::LocalTrainer> (*make_fl_trainer)(const fl::FlConfig&) = nullptr;  // `conduit fl`
};

// Bumped whenever TorchApi or a type it passes changes layout.
inline constexpr int kTorchApiAbi = 2;
// The module's one exported entry point: extern "C" const TorchApi* conduit_torch_api();
inline constexpr const char* kTorchApiSymbol = "conduit_torch_api";
inline constexpr const char* kTorchModuleName = "libconduit-torch.so";

}  // namespace conduit::train
