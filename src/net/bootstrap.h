#pragma once
// How a process finds its peers, without flags:
//   - started by mpirun/mpiexec (OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK set): MPI's own ranks;
//   - RANK and WORLD_SIZE set (torchrun, `conduit launch`): a TCP store at MASTER_ADDR:MASTER_PORT served by rank 0,
//     or a file store in CONDUIT_STORE_PATH when MASTER_ADDR is not set;
//   - otherwise: a single rank.
// Then a transport: CONDUIT_TRANSPORT=auto (default: shm to peers on the same host, tcp to the others), tcp, shm
// or mpi.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "net/store.h"
#include "net/tcp.h"
#include "net/transport.h"

namespace conduit::net {

// The defaults of two settings the ranks must agree on (make_transport compares them, unset as its default):
// CONDUIT_SHM_RING_BYTES (each shm ring) and CONDUIT_RING_SEGMENT_BYTES (the ring algorithms' segments, coll/ring.cc).
inline constexpr uint64_t kDefaultShmRingBytes = uint64_t{2} << 20;
inline constexpr uint64_t kDefaultRingSegmentBytes = uint64_t{1} << 20;

struct Bootstrap {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string method;       // "single", "tcp-store", "file-store", "mpi"
  std::string job;          // unique id of this job (names shared-memory segments)
  std::vector<int> hosts;   // host index of every rank
  StorePtr store;           // null under mpi and single
  AllgatherFn allgather;    // exchanges one string per rank
  // Set once the first exchange has checked every rank's value: this process is one of the job's ranks. A file
  // store's rank publishes a failure only then (a process refused as a second RANK, or as a rank of a larger job,
  // stopped the job it was refused from, found by a review).
  std::shared_ptr<std::atomic<bool>> met = std::make_shared<std::atomic<bool>>(false);
  // Rank 0 serving the TCP store: waits, at most `seconds`, until every rank has read the last exchange, before an
  // error ends the process and the store with it (the ranks still reading lost the connection and said "did rank 0
  // exit?", not the error they would each have found). Empty elsewhere.
  std::function<void(double seconds)> wait_readers;
};

// ConfigError when the environment is inconsistent (e.g. RANK >= WORLD_SIZE, RANK without MASTER_ADDR or
// CONDUIT_STORE_PATH). Waits at most `timeout_s` for the peers.
std::shared_ptr<Bootstrap> bootstrap_from_env(double timeout_s);

// Whether a master address (MASTER_ADDR, `conduit launch --master-addr`: a host name or address, an IPv6 one maybe in
// brackets or with a zone) is the any-address, 0.0.0.0 in any form the resolver takes ("0" among them), :: or
// ::ffff:0.0.0.0: a store can listen there, but it names no host for the other ranks to meet at.
bool is_any_address(const std::string& addr);
// The refusal of the any-address, one line: `given` says where it was given ("MASTER_ADDR='0.0.0.0'").
std::string any_address_refusal(const std::string& given);

// kind: "auto", "tcp", "shm", "mpi". ConfigError for anything else, or for shm across hosts, or mpi without mpirun.
TransportPtr make_transport(const Bootstrap& b, const std::string& kind, double timeout_s);
const char* transport_kinds_allowed();

}  // namespace conduit::net
