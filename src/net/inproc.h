#pragma once
// Ranks as threads of one process. A send is matched with its receive and copied (or reduced) straight from the
// sender's buffer into the receiver's: no staging. Used by tests and by simulations with many virtual ranks.
#include <memory>
#include <vector>

#include "net/transport.h"

namespace conduit::net {

class InprocWorld;

// Creates `size` connected transports; rank r lives on host r / ranks_per_host (for hierarchical algorithms).
std::vector<TransportPtr> make_inproc_world(int size, int ranks_per_host = 0);

}  // namespace conduit::net
