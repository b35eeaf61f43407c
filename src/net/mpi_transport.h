#pragma once
// OpenMPI transport: the path to many hosts when a job is started by mpirun. Messages are MPI_Isend/MPI_Irecv on
// private duplicates of MPI_COMM_WORLD; requests progress when a waiter calls MPI_Test (there is no progress
// thread). Conduit's 64-bit tags are spread over 64 communicators and folded into MPI's tag range, see
// mpi_transport.cc for the mapping and its collision bound.
#include <cstdint>
#include <string>
#include <vector>

#include "net/transport.h"

namespace conduit::net {

// True when this process was started by mpirun/mpiexec (OMPI_COMM_WORLD_RANK, PMIX_RANK or PMI_RANK is set).
bool mpi_launched();
// MPI_Init_thread(MPI_THREAD_MULTIPLE) once per process (a no-op when the program already initialized MPI);
// registers MPI_Finalize with atexit. When the library provides less than MULTIPLE a warning is logged and every
// MPI call Conduit makes is serialized by one mutex (env CONDUIT_MPI_SERIALIZE=1 forces that mode, for tests).
void mpi_init_once();
// The process is about to exit with `code` after an error: when MPI is initialized, the exit calls MPI_Abort instead
// of MPI_Finalize (OpenMPI's MPI_Finalize waits for every rank, and ranks still inside an MPI collective of the
// start-up never come: the job hung with its error printed).
void mpi_exit_after_error(int code);
int mpi_world_rank();
int mpi_world_size();
// Every rank's string, in rank order (MPI_Allgather + MPI_Allgatherv on MPI_COMM_WORLD). Collective.
std::vector<std::string> mpi_allgather_strings(const std::string& mine);

// A transport over a duplicate of MPI_COMM_WORLD; collective (every rank calls it). `hosts` is the host index of
// every rank (empty: derived from the host names). Errors are returned, not fatal (MPI_ERRORS_RETURN).
TransportPtr make_mpi_transport(std::vector<int> hosts);

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
