#pragma once
// OpenMPI transport: the path to many hosts when a job is started by mpirun. Messages are MPI_Isend/MPI_Irecv on
// private duplicates of MPI_COMM_WORLD, new ones for every transport; requests progress when a waiter calls MPI_Test
// (there is no progress thread). Conduit's 64-bit tags are spread over 64 communicators and folded into MPI's tag
// range, see mpi_transport.cc for the mapping and its collision bound.
#include <cstdint>
#include <string>
#include <vector>

#include "core/clock.h"
#include "net/transport.h"

namespace conduit::net {

// True when this process was started by mpirun/mpiexec (OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK is set).
bool mpi_launched();
// MPI_Init_thread(MPI_THREAD_MULTIPLE) once per process (a no-op when the program already initialized MPI);
// registers MPI_Finalize with atexit. When the library provides less than MULTIPLE a warning is logged and every
// MPI call Conduit makes is serialized by one mutex (env CONDUIT_MPI_SERIALIZE=1 forces that mode, for tests).
// `timeout_s` > 0: MPI_Init_thread waits for every rank of the job to start MPI, with no deadline of its own (a rank
// that never came hung the others there, silently): past timeout_s this process ends with one line and exit code 2,
// and mpirun then stops the job as for any rank that exits without MPI_Finalize.
void mpi_init_once(double timeout_s = 0);
// The process is about to exit with `code` after an error: when MPI is initialized, the exit calls MPI_Abort instead
// of MPI_Finalize (OpenMPI's MPI_Finalize waits for every rank, and ranks still inside an MPI collective of the
// start-up never come: the job hung with its error printed).
void mpi_exit_after_error(int code);
int mpi_world_rank();
int mpi_world_size();
// Every rank's string, in rank order (MPI_Iallgather + MPI_Iallgatherv on MPI_COMM_WORLD). Collective. A rank that
// does not come by `deadline` (without one: CONDUIT_TIMEOUT, else 300 s) is a TimeoutError; the collective given up
// on stays pending (MPI cannot withdraw it), so MPI_COMM_WORLD's collectives no longer line up: end the process.
std::vector<std::string> mpi_allgather_strings(const std::string& mine);
std::vector<std::string> mpi_allgather_strings(const std::string& mine, const Deadline& deadline);

// A transport over duplicates of MPI_COMM_WORLD; collective (every rank calls it). `hosts` is the host index of
// every rank (empty: derived from the host names). Errors are returned, not fatal (MPI_ERRORS_RETURN). The start-up
// (65 MPI_Comm_idup, and the host names' exchange) waits until `deadline` (without one: CONDUIT_TIMEOUT, else 300 s),
// then throws a TimeoutError naming the step, with MPI_COMM_WORLD left as mpi_allgather_strings leaves it. A
// transport never receives messages or abort notices of one destroyed before it (see mpi_transport.cc).
TransportPtr make_mpi_transport(std::vector<int> hosts);
TransportPtr make_mpi_transport(std::vector<int> hosts, const Deadline& deadline);

// Where a Conduit tag travels: which of the transport's kDataComms duplicated communicators, and which MPI tag
// (exposed for tests and docs; the mapping and its collision bound are described in mpi_transport.cc).
inline constexpr int kDataComms = 64;
struct MpiRoute {
  int comm;  // 0 .. kDataComms-1
  int tag;   // 0 .. tag_ub
};
MpiRoute mpi_route_for(uint64_t tag, int tag_ub);
// How many low bits of a Conduit tag's low 32 the MPI tag keeps (11 with OpenMPI's MPI_TAG_UB of 2^31 - 1): two
// tags of one communicator that agree in those bits share an MPI tag, so the transport refuses to have both in
// flight with one peer at once.
int mpi_route_low_bits(int tag_ub);

}  // namespace conduit::net
