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
  std::lock_guard<std::mutex> lk(mu_);
  events_.push_back(std::move(e));
}

void Trace::instant(const std::string& name, int tid, double at_s, nlohmann::json args) {
  if (!on_) return;
  nlohmann::json e = {{"name", name}, {"ph", "i"}, {"s", "t"}, {"pid", rank_}, {"tid", tid}, {"ts", at_s * 1e6}};
  if (!args.is_null()) e["args"] = std::move(args);
  std::lock_guard<std::mutex> lk(mu_);
  events_.push_back(std::move(e));
}

size_t Trace::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_.size();
}

std::vector<nlohmann::json> Trace::events() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_;
}

void Trace::write(const std::string& path) const {
  nlohmann::json out;
  out["displayTimeUnit"] = "ms";
  auto& ev = out["traceEvents"];
  ev = nlohmann::json::array();
  ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_}, {"args", {{"name", fmt::format("rank {}", rank_)}}}});
  ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 0}, {"args", {{"name", "compute"}}}});
  ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 1}, {"args", {{"name", "communication"}}}});
  ev.push_back(
      {{"name", "thread_name"}, {"ph", "M"}, {"pid", rank_}, {"tid", 2}, {"args", {{"name", "parameter gathers"}}}});
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& e : events_) ev.push_back(e);
  }
  write_json_file(path, out);
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
