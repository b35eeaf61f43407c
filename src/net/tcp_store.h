#pragma once
// Extras of the TCP store beyond the Store interface (net/store.h).
#include "net/store.h"

namespace conduit::net {

// The port a TCP store talks to: for the server (rank 0) the port it actually bound, which is how a caller that
// passed port 0 (any free port) learns it. Throws InvalidArgument when `store` is not a TCP store.
int tcp_store_port(const Store& store);

// Largest key or value the TCP store accepts (and the largest length field it trusts on the wire).
inline constexpr uint32_t kMaxStoreFieldBytes = 64u << 20;

}  // namespace conduit::net
