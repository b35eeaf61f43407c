#pragma once
// TCP transport: one connection per peer, one progress thread (epoll) per transport. Large messages are read
// straight into the posted receive buffer (no copy) and written straight from the send buffer; receives that
// reduce read through a small cache-resident staging block. Messages that arrive before their receive is
// posted are buffered up to CONDUIT_TCP_UNEXPECTED_BYTES per peer (default 64 MiB); past that the connection is
// not read until a receive is posted (back-pressure instead of unbounded memory).
#include <functional>
#include <string>
#include <vector>

#include "net/transport.h"

namespace conduit::net {

// Exchanges one string per rank (the bootstrap's allgather): returns every rank's value, indexed by rank.
using AllgatherFn = std::function<std::vector<std::string>(const std::string& mine)>;

// The IPv4 address to listen on: the interface named by CONDUIT_SOCKET_IFNAME, GLOO_SOCKET_IFNAME or
// NCCL_SOCKET_IFNAME (first set wins), else the first up, non-loopback interface, else 127.0.0.1. The choice
// and why it was made is logged at info level. ConfigError for a named interface that does not exist.
std::string tcp_listen_address(std::string* why = nullptr);
// CONDUIT_TCP_UNEXPECTED_BYTES (default 64M): 0 to 1T, else ConfigError naming it. (Checked at start-up whatever the
// transport, so that a bad value does not pass until a run over tcp.)
uint64_t tcp_unexpected_budget();

// The job a tcp hello names (wire version 3): a hash of every rank's published address, in rank order, as the
// bootstrap's allgather returned them (the same on every rank of one rendezvous, another for another job or run).
uint64_t tcp_job_fingerprint(const std::vector<std::string>& addresses);

// `serve` marks the peers this transport connects to (empty: all); the others are served by another transport.
TransportPtr make_tcp_transport(int rank, int size, std::vector<int> hosts, const AllgatherFn& allgather,
                                const Deadline& connect_deadline, std::vector<char> serve = {});

}  // namespace conduit::net
