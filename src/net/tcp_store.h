#pragma once
// Extras of the TCP store beyond the Store interface (net/store.h).
#include <cstddef>
#include <string>

#include "net/store.h"

namespace conduit::net {

// The port a TCP store talks to: for the server (rank 0) the port it actually bound, which is how a caller that
// passed port 0 (any free port) learns it. Throws InvalidArgument when `store` is not a TCP store.
int tcp_store_port(const Store& store);

// Where rank 0's store server listens for MASTER_ADDR: on that address when it is a loopback one (a job kept on
// this machine), else on every interface ("*"), as torch's TCPStore: MASTER_ADDR may reach this host without being
// one of its addresses (a Kubernetes service, NAT, a floating IP), or be a name that resolves to loopback here and
// to the network address on the other hosts.
std::string store_listen_host(const std::string& master_addr);
// "localhost" or a name under it (RFC 6761): the server listens everywhere, as for a name, but serves loopback peers
// only.
bool names_localhost(const std::string& master_addr);
// A connected TCP socket whose own address is its peer's: a connect to a port with no listener that the kernel gave
// that same port as its source (simultaneous open).
bool connected_to_itself(int fd);

// The key under which rank 0 publishes why it failed (net/bootstrap.cc), before it keeps serving a few seconds: the
// server answers every get waiting for a key, and every later get of a key not set, with PeerError "rank 0 failed:
// <its value>" (the other ranks were told only "connection to the server lost ... did rank 0 exit?").
inline constexpr const char* kTcpStoreErrorKey = "conduit/job/error";
// The most of its error a failing rank writes there (or under the file store's failure key): the store takes up to
// 64 KiB of that key past CONDUIT_STORE_MAX_BYTES.
inline constexpr size_t kStoredFailureBytes = 16 << 10;

// Test hook: servers started after it drop a client mid-request that sends nothing for `stall_seconds` (30 s by
// default) and keep at most `max_clients` connections (8 a rank of WORLD_SIZE, at least 1024, within the open-file
// limit); 0 restores a default.
void set_tcp_store_server_limits_for_testing(double stall_seconds, size_t max_clients);

}  // namespace conduit::net
