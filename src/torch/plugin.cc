// The entry point of libconduit-torch.so (see torch/plugin.h). Built into the module only.
#include "torch/plugin.h"

#include "torch/fl_client.h"

namespace {

conduit::train::TrainResult train_worker(const conduit::train::TrainConfig& c, conduit::coll::CommPtr comm,
                                         const conduit::train::WorkerOptions& o) {
  return conduit::train::train_worker(c, std::move(comm), o);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const conduit::train::TorchApi* conduit_torch_api() {
  static const conduit::train::TorchApi api = [] {
    conduit::train::TorchApi a;
    a.abi = conduit::train::kTorchApiAbi;
    a.token = CONDUIT_TORCH_API_TOKEN;
    a.config_size = sizeof(conduit::train::TrainConfig);
    a.result_size = sizeof(conduit::train::TrainResult);
    a.train_worker = &train_worker;
    a.check_model_config = &conduit::train::check_model_config;
    a.time_gemms = &conduit::train::time_gemms;
    a.time_convs = &conduit::train::time_convs;
    a.time_pools = &conduit::train::time_pools;
    a.time_model_step = &conduit::train::time_model_step;
    a.make_fl_trainer = &conduit::train::make_fl_trainer;
    return a;
  }();
  return &api;
}
