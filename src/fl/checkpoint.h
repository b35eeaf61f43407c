#pragma once
// Checkpoints of a federation (`conduit fl --checkpoint-every K`, `--resume DIR`), torch-free.
//
// <output>/checkpoints/ holds, after every K-th round and the last:
//   server-<R>.bin         the server's state after R rounds: the global weights, SCAFFOLD's c, the server
//                          optimizer's state, the DP accountant's rounds, the last measured step time, the rounds
//                          applied and the run's settings (JSON)
//   host-<rank>-<R>.bin    with SCAFFOLD, each client host's c_i of the clients it hosts (written by the host)
// Each file is written whole under a temporary name, synced and renamed into place. The server keeps its newest file
// and the newest complete generation before it (hosts may still be writing the newest one's files); a host removes
// its files below the oldest server file left. So a run killed at any point leaves a complete generation. A resume
// takes the newest R whose server file and every host file (as many as the server file says) are there. Every other
// input a round needs (partition, speeds, sampling without DP, dropouts, batch order) is a function of the seed and the
// round, so a resumed run repeats an uninterrupted one exactly (under DP the secret sampling and noise seeds are new).
// Native byte order. Every file ends with the CRC-32 of its bytes (format version 2; version 1 had none and is
// refused), checked before its fields are read.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fl/federation.h"

namespace conduit::fl {

struct ServerCheckpoint {
  int64_t round = 0;        // rounds completed
  std::string config_json;  // the settings of the run that wrote it
  std::vector<float> weights, control;
  std::vector<uint8_t> optimizer;  // ServerOptimizer::save_state()
  int64_t accountant_steps = 0;
  double step_s = 0;
  int64_t rounds_applied = 0;
  int64_t host_files = 0;  // host-<rank>-<round>.bin files of this round (ranks 1..host_files)
  int64_t samples = 0;     // the training samples the partition split
  uint64_t data_hash = 0;  // a checksum of their labels (data_dir may move, the data may not change)
};

// The folder of a run's checkpoints.
std::string checkpoint_dir(const std::string& output);
// The checkpoints --resume names: a run's output folder (its checkpoints/ inside) or the checkpoints folder itself.
std::string resume_checkpoint_dir(const std::string& resume);

// Writes server-<round>.bin and removes the server files older than the newest complete generation before it.
// Error naming the path.
void write_server_checkpoint(const std::string& dir, const ServerCheckpoint& s);
// Writes host-<rank>-<round>.bin (client id and its n floats for each entry) and removes this rank's files below the
// oldest server file in dir.
void write_host_checkpoint(const std::string& dir, int rank, int64_t round,
                           const std::map<int, std::vector<float>>& control, size_t n);

// The newest complete generation in dir. ConfigError naming dir when it holds none (or no such folder);
// ProtocolError naming the file when one is not a checkpoint (bad magic, version, checksum, lengths, a value that is
// not finite).
ServerCheckpoint read_latest_checkpoint(const std::string& dir);
// Reads the host files of `round` (host-1-<round>.bin, host-2-..., as many as there are) and keeps the entries
// `keep` accepts (each model-sized: n; client ids below `clients`). Every file is read whole and checked (checksum,
// header, width, clients, finite values) whatever `keep` says.
std::map<int, std::vector<float>> read_host_checkpoints(const std::string& dir, int64_t round, size_t n, int clients,
                                                        const std::function<bool(int)>& keep);
// Everything a resume will read, checked before anything starts or is written (conduit fl's parent before it starts
// the ranks, or rank 0 under an outer launcher before the output folder is written), so that a bad file stops the
// command with one line rather than a rank mid-start: the newest complete generation in c.resume against the
// settings (check_resume), its server optimizer state as the server will load it, and with SCAFFOLD every host file
// of it as the hosts will read them (read_host_checkpoints: header, width, clients, checksum, finite values; they are
// read twice, here and by the hosts), and under DP noise that the folder's ledger can be written
// (check_dp_ledger_writable). Returns the generation. Errors as those functions', naming the file.
ServerCheckpoint check_resume_files(const FlConfig& c);
// Tests only: read_host_checkpoints first waits this many seconds (a slow disk, a large file; 0: none).
void set_host_checkpoint_read_delay_for_testing(double seconds);
// Differential privacy's ledger, dp-ledger.bin: the accountant's rounds once a round's noisy model is made, written
// (synced, renamed into place) before that model leaves the server. A run that stops between checkpoints released
// rounds the checkpoint does not count; its resume repeats them with new noise, a second release of each, so it
// starts the accountant at the ledger's count, not the checkpoint's (the re-run rounds then count twice, as they
// were released twice).
void write_dp_ledger(const std::string& dir, int64_t accountant_steps);
// The ledger's count; 0 without one. ProtocolError naming the file when it is not a ledger.
int64_t read_dp_ledger(const std::string& dir);
// A resume under DP noise raises the ledger of the checkpoints it resumed from (after each round: another resume from
// them then counts its releases too). ConfigError with one line naming dir when no file can be made there (a
// read-only copy, another user's folder): checked before round 1, not found once the first round's model is out.
void check_dp_ledger_writable(const std::string& dir);

// Whether dir holds a server checkpoint (a new run's folder must not: its pruning would take the old files for its
// own).
bool holds_checkpoints(const std::string& dir);

// A resumed run must be the same federation: ConfigError naming the first setting that differs from the checkpoint's
// (all but rounds, output, resume, checkpoint_every, progress, eval_every, timeout_s, transport, workers, data_dir),
// or when the checkpoint is at or past `rounds`.
void check_resume(const FlConfig& c, const ServerCheckpoint& s);

}  // namespace conduit::fl
