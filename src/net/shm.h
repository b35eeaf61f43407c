#pragma once
// Shared-memory transport for ranks on one host. Each rank owns a segment (/dev/shm, unlinked as soon as every
// peer has mapped it, so a crash after that leaves nothing behind; one before it leaves the segment, which `conduit
// launch` removes and other launchers do not) holding one single-producer/single-consumer byte
// ring per sending peer (CONDUIT_SHM_RING_BYTES, default 2 MiB). Frames are the tcp frames (net/wire.h), checked
// the same way. Progress happens in the waiting thread (no helper thread competes for cores): a waiter moves
// data, spins briefly, then sleeps on a futex doorbell that peers ring when they write or free ring space.
// Receives that reduce read straight out of the ring. A dead peer is detected by its pid while waiting. Messages
// that arrive before their receive is posted are buffered up to CONDUIT_SHM_UNEXPECTED_BYTES per peer (default
// 64 MiB, 0 to 1T, as tcp's); past that they wait in the ring (the sender waits for space) until a receive is posted.
#include <string>
#include <vector>

#include "net/tcp.h"
#include "net/transport.h"

namespace conduit::net {

// `job` names the segments (unique per job); `serve` marks the peers reached through shared memory (empty: all).
TransportPtr make_shm_transport(int rank, int size, std::vector<int> hosts, const std::string& job,
                                const AllgatherFn& allgather, std::vector<char> serve = {});

// The name of rank `rank`'s segment of job `job` (in /dev/shm while the ranks meet, unlinked once all have mapped it).
std::string shm_segment_name(const std::string& job, int rank);

// Removes the segments of ranks [0, ranks) of `job` that are still there: a rank killed while the ranks met leaves
// its segment (conduit launch calls this once its workers have exited). Returns how many it removed.
int remove_shm_segments(const std::string& job, int ranks);
// Checks the shm settings (CONDUIT_SHM_RING_BYTES, CONDUIT_SHM_SINGLE_COPY_BYTES, CONDUIT_SHM_UNEXPECTED_BYTES,
// CONDUIT_SHM_SPIN_US, CONDUIT_LOCAL_CPUS): ConfigError naming the variable and what is allowed. Called at start-up
// whatever the transport (read only where shm runs, they passed unchecked in a tcp job or one rank a host).
void check_shm_environment();

}  // namespace conduit::net
