#pragma once
// Reaching libtorch from the `conduit` binary: see torch/plugin.h.
#include "torch/plugin.h"

namespace conduit::cli {

// The table of libconduit-torch.so, loaded beside this binary on first use (and kept). Error naming the module's
// path and the loader's message when it cannot be loaded or is from another build.
const train::TorchApi& torch_api();

}  // namespace conduit::cli
