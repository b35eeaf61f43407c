#pragma once
// A transport that sends to each peer through the transport that serves it (shm on the same host, tcp across).
#include <vector>

#include "net/transport.h"

namespace conduit::net {

TransportPtr make_routed_transport(int rank, int size, std::vector<int> hosts, std::vector<TransportPtr> route,
                                   const std::string& description);

}  // namespace conduit::net
