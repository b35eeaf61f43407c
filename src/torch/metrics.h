#pragma once
// Measurement and reporting for training (torch-free): per-step statistics of the DistributedOptimizer, a
// Chrome-trace timeline (chrome://tracing, Perfetto), JSON-lines metrics and rank 0's progress bar.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/files.h"

namespace conduit::train {

// What one optimizer step cost. Times in seconds.
struct StepStats {
  double compute_s = 0;        // from the previous step's end to step() (forward + backward + data)
  double comm_s = 0;           // communication thread busy time (compress + collective + decompress)
  double exposed_comm_s = 0;   // time step() waited for communication (not hidden behind backward)
  double step_s = 0;           // the optimizer update itself
  uint64_t bytes_sent = 0;     // payload bytes this rank put on the wire (collective algorithm's count)
  uint64_t bytes_recv = 0;
  uint64_t raw_bytes = 0;      // what an uncompressed f32 allreduce would have sent
  uint64_t payload_bytes = 0;  // compressed payload bytes of this rank (before the collective)
  uint64_t grad_bytes = 0;     // f32 bytes of the gradients exchanged (each pass's when ZeRO reduces every pass)
  int buckets = 0;
  double ratio() const { return payload_bytes ? double(grad_bytes) / double(payload_bytes) : 1.0; }
  StepStats& operator+=(const StepStats& s);  // sums every field (totals over steps)
  nlohmann::json to_json() const;
};

// Monotonic seconds since the first call in this process.
double now_s();

// Complete events ("ph":"X") on named threads of one process (= one rank). Held in memory until open(path); from
// then on written to that file as they come (the Trace Event Format's JSON array: "[", the events, "]"), whole events
// at a time at most 0.5 s after each (a thread writes what came every 0.5 s, also while the run waits), so that memory
// stays flat however long the run and a run killed (time_limit_s, a signal) keeps what it traced: the array without its
// closing "]", which chrome://tracing and Perfetto read. (Until 2026-12-08 every event stayed in memory, ~0.25 MB a
// step of the vit at tp 2 x pp 2, and the file was written only by a run that ended normally.)
class Trace {
 public:
  explicit Trace(int rank = 0) : rank_(rank) {}
  ~Trace();  // closes the file's array (an exception unwinding the run too)
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  void enable(bool on) { on_ = on; }
  bool enabled() const { return on_; }
  // tid: 0 main (forward/backward/step), 1 communication thread, 2 ZeRO's parameter gathers in flight behind compute
  // (from their start to their wait).
  void complete(const std::string& name, int tid, double start_s, double end_s, nlohmann::json args = {});
  void instant(const std::string& name, int tid, double at_s, nlohmann::json args = {});
  // Starts the file (ConfigError when it cannot be written) with the process's and threads' names and the events held.
  void open(const std::string& path);
  // Ends the array and the file; Error naming the file when a write failed (a full disk), here rather than on the
  // thread that recorded the event.
  void close();
  size_t size() const;                         // events recorded
  std::vector<nlohmann::json> events() const;  // (a copy of those held: before open(), or without a file)

 private:
  void record(nlohmann::json e);      // (with mu_ not held)
  void put(const nlohmann::json& e);  // (mu_ held, file open)
  void flush();                       // (mu_ held, file open)
  int rank_;
  bool on_ = false;
  mutable std::mutex mu_;
  std::vector<nlohmann::json> events_;
  size_t count_ = 0;
  std::FILE* f_ = nullptr;
  std::string path_, failed_, pending_;  // (pending_: whole events not yet written)
  std::thread flusher_;                  // (writes pending_ every 0.5 s while the file is open)
  std::condition_variable cv_;
  bool stop_ = false;
};

// Appends one JSON object per line; flushes every line so a killed run keeps what it measured.
class JsonlWriter {
 public:
  JsonlWriter() = default;
  explicit JsonlWriter(const std::string& path, bool append = false);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;
  void write(const nlohmann::json& j);
  bool open() const { return f_ != nullptr; }

 private:
  std::FILE* f_ = nullptr;
  std::string path_;
};

// "epoch 2/5 [########------------] 40% loss 0.4123 acc 85.3% 2310 samples/s 12.4 MB sent"
// On a terminal it redraws one line; otherwise (under a launcher) it prints a line every 10% of the epoch.
class ProgressBar {
 public:
  ProgressBar(int epoch, int epochs, int64_t total_steps, bool enabled);
  void update(int64_t step, double loss, double acc, double samples_per_s, double mb_sent);
  void finish(const std::string& tail);

 private:
  std::string line(int64_t step, double loss, double acc, double sps, double mb) const;
  int epoch_, epochs_;
  int64_t total_;
  bool on_, tty_;
  int last_decile_ = -1;
  double last_draw_ = 0;
};

using conduit::write_text_file;  // core/files.h
void write_json_file(const std::string& path, const nlohmann::json& j);
nlohmann::json read_json_file(const std::string& path);

}  // namespace conduit::train
