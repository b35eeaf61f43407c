// Step statistics, Chrome trace, JSON lines, progress bar (torch-free).
#include "torch/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace conduit::train {

StepStats& StepStats::operator+=(const StepStats& s) {
  compute_s += s.compute_s;
  comm_s += s.comm_s;
  exposed_comm_s += s.exposed_comm_s;
  step_s += s.step_s;
  bytes_sent += s.bytes_sent;
  bytes_recv += s.bytes_recv;
  raw_bytes += s.raw_bytes;
  payload_bytes += s.payload_bytes;
  grad_bytes += s.grad_bytes;
  buckets += s.buckets;
  return *this;
}

nlohmann::json StepStats::to_json() const {
  return {{"compute_s", compute_s},   {"comm_s", comm_s},         {"exposed_comm_s", exposed_comm_s},
          {"step_s", step_s},         {"bytes_sent", bytes_sent}, {"bytes_recv", bytes_recv},
          {"raw_bytes", raw_bytes},   {"payload_bytes", payload_bytes}, {"grad_bytes", grad_bytes},
          {"ratio", ratio()},         {"buckets", buckets}};
}

double now_s() {
  static const auto t0 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Trace::complete(const std::string& name, int tid, double start_s, double end_s, nlohmann::json args) {
  if (!on_) return;
  nlohmann::json e = {{"name", name}, {"ph", "X"},  {"pid", rank_}, {"tid", tid},
                      {"ts", start_s * 1e6}, {"dur", std::max(0.0, end_s - start_s) * 1e6}};
  if (!args.is_null()) e["args"] = std::move(args);
  record(std::move(e));
}

void Trace::instant(const std::string& name, int tid, double at_s, nlohmann::json args) {
  if (!on_) return;
  nlohmann::json e = {{"name", name}, {"ph", "i"}, {"s", "t"}, {"pid", rank_}, {"tid", tid}, {"ts", at_s * 1e6}};
  if (!args.is_null()) e["args"] = std::move(args);
  record(std::move(e));
}

void Trace::record(nlohmann::json e) {
  std::lock_guard<std::mutex> lk(mu_);
  ++count_;
  if (f_)
    put(e);
  else
    events_.push_back(std::move(e));
}

void Trace::put(const nlohmann::json& e) {
  if (!failed_.empty()) return;
  pending_ += ",\n";
  pending_ += e.dump();
  if (pending_.size() >= (1u << 20)) flush();  // (else the flusher's, within 0.5 s)
}

void Trace::flush() {
  // Whole events only, in one write (an unbuffered stream): a run killed between two leaves no event cut in half
  // (stdio's 4 KiB buffer went out mid-event, and the file did not parse).
  if (failed_.empty() && !pending_.empty() && std::fwrite(pending_.data(), 1, pending_.size(), f_) != pending_.size())
    failed_ = std::strerror(errno);
  pending_.clear();
}

void Trace::open(const std::string& path) {
  std::lock_guard<std::mutex> lk(mu_);
  if (f_) return;
  f_ = std::fopen(path.c_str(), "w");
  if (!f_) throw ConfigError(fmt::format("output: cannot write the trace '{}': {}", path, std::strerror(errno)));
  std::setvbuf(f_, nullptr, _IONBF, 0);
  path_ = path;
  // (the metadata first: each event after it starts with its comma)
  const nlohmann::json process = {
      {"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", fmt::format("rank {}", rank_)}}}};
  pending_ = "[\n" + process.dump();
  const char* threads[] = {"compute", "communication", "parameter gathers"};
  for (int tid = 0; tid < 3; ++tid)
    pending_ +=
        ",\n" +
        nlohmann::json{
            {"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", tid}, {"args", {{"name", threads[tid]}}}}
            .dump();
  for (const auto& e : events_) put(e);
  events_.clear();
  events_.shrink_to_fit();
  flush();
  // Every 0.5 s what came since, also while the run waits (a stall's last events are what a timeline is for).
  stop_ = false;
  flusher_ = std::thread([this] {
    std::unique_lock<std::mutex> lk(mu_);
    while (!stop_) {
      cv_.wait_for(lk, std::chrono::milliseconds(500));
      if (f_ && !pending_.empty()) flush();
    }
  });
}

void Trace::close() {
  if (flusher_.joinable()) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    flusher_.join();
  }
  std::string failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!f_) return;
    pending_ += "\n]\n";
    flush();
    if (std::fclose(f_) != 0 && failed_.empty()) failed_ = std::strerror(errno);
    f_ = nullptr;
    failed = failed_;
  }
  // A full disk is an error, not a trace that silently stops.
  if (!failed.empty()) throw Error(fmt::format("output: writing the trace '{}' failed: {}", path_, failed));
}

Trace::~Trace() {
  try {
    close();
  } catch (const Error&) {
    // (unwinding already: the run's own error is the one reported)
  }
}

size_t Trace::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return count_;
}

std::vector<nlohmann::json> Trace::events() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_;
}

JsonlWriter::JsonlWriter(const std::string& path, bool append) : path_(path) {
  f_ = std::fopen(path.c_str(), append ? "a" : "w");
  if (!f_) throw ConfigError(fmt::format("output: cannot write '{}'", path));
}

JsonlWriter::~JsonlWriter() {
  if (f_) std::fclose(f_);
}

void JsonlWriter::write(const nlohmann::json& j) {
  if (!f_) return;
  std::string s = j.dump();
  s += '\n';
  // A full disk is an error, not metrics that silently stop.
  if (std::fwrite(s.data(), 1, s.size(), f_) != s.size() || std::fflush(f_) != 0)
    throw Error(fmt::format("output: writing '{}' failed: {}", path_, std::strerror(errno)));
}

ProgressBar::ProgressBar(int epoch, int epochs, int64_t total_steps, bool enabled)
    : epoch_(epoch), epochs_(epochs), total_(std::max<int64_t>(total_steps, 1)), on_(enabled),
      tty_(isatty(STDOUT_FILENO)) {}

std::string ProgressBar::line(int64_t step, double loss, double acc, double sps, double mb) const {
  const int width = 20;
  int filled = int(width * step / total_);
  std::string bar(size_t(filled), '#');
  bar += std::string(size_t(width - filled), '-');
  return fmt::format("epoch {}/{} [{}] {:3d}% loss {:.4f} acc {:.1f}% {:.0f} samples/s {:.1f} MB sent", epoch_,
                     epochs_, bar, int(100 * step / total_), loss, 100 * acc, sps, mb);
}

void ProgressBar::update(int64_t step, double loss, double acc, double sps, double mb) {
  if (!on_) return;
  if (tty_) {
    double t = now_s();
    if (t - last_draw_ < 0.1 && step < total_) return;
    last_draw_ = t;
    std::printf("\r%s", line(step, loss, acc, sps, mb).c_str());
    std::fflush(stdout);
    return;
  }
  int decile = int(10 * step / total_);
  if (decile == last_decile_ || decile == 0) return;
  last_decile_ = decile;
  std::printf("%s\n", line(step, loss, acc, sps, mb).c_str());
  std::fflush(stdout);
}

void ProgressBar::finish(const std::string& tail) {
  if (!on_) return;
  std::printf("%s%s\n", tty_ ? "\n" : "", tail.c_str());
  std::fflush(stdout);
}

void write_json_file(const std::string& path, const nlohmann::json& j) { write_text_file(path, j.dump(2) + "\n"); }

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw ConfigError(fmt::format("cannot read '{}'", path));
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("'{}' is not valid JSON: {}", path, e.what()));
  }
}

}  // namespace conduit::train
