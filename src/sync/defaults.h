#pragma once
// Defaults of the synchronization layer that configurations above it (torch/config.h) share, without its headers.

namespace conduit::sync {

// How long a rank waits where the workers may rightly drift apart by more than a step (drift_timeout_s): an
// asynchronous scheme's waits for slower workers and for their next request, the workers' meetings at checkpoints
// and at the end, and (as a cap on period x timeout) a periodic scheme's sync. PyTorch's default collective timeout.
inline constexpr double kDefaultDriftTimeoutS = 1800;

}  // namespace conduit::sync
