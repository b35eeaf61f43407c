#include "sim/units.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace conduit::sim {
namespace {

struct Split {
  double value;
  std::string unit;
};

Split split_number(std::string_view text, std::string_view field, std::string_view allowed) {
  std::string s(text);
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  const char* begin = s.c_str() + i;
  char* end = nullptr;
  double v = std::strtod(begin, &end);
  if (end == begin || !std::isfinite(v) || v < 0) {
    throw ConfigError(
        fmt::format("{}: '{}' is not a non-negative number with a unit (allowed units: {})", field, text, allowed));
  }
  std::string unit;
  for (const char* p = end; *p; ++p) {
    if (!std::isspace(static_cast<unsigned char>(*p))) unit.push_back(*p);
  }
  return {v, unit};
}

double scale_prefix(char c) {
  switch (c) {
    case 'K':
    case 'k':
      return 1e3;
    case 'M':
      return 1e6;
    case 'G':
      return 1e9;
    case 'T':
      return 1e12;
    case 'P':
      return 1e15;
    default:
      return 0;
  }
}

// A parsed quantity above `most` (or overflowing to inf) is a typo or a unit mix-up, not hardware.
double at_most(double v, double most, const char* unit, std::string_view text, std::string_view field) {
  if (!(v <= most))
    throw ConfigError(
        fmt::format("{}: '{}' is above the largest value this simulator takes ({:g} {})", field, text, most, unit));
  return v;
}

}  // namespace

double parse_bandwidth(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "b/s, Kb/s, Mb/s, Gb/s, Tb/s, B/s, KB/s, MB/s, GB/s, TB/s";
  auto [v, u] = split_number(text, field, kAllowed);
  if (u.size() >= 3 && u.substr(u.size() - 2) == "/s") {
    std::string base = u.substr(0, u.size() - 2);
    double mult = 1;
    if (base.size() == 2) {
      mult = scale_prefix(base[0]);
      base = base.substr(1);
    }
    if (mult != 0 && (base == "b" || base == "B"))
      return at_most(v * mult * (base == "b" ? 0.125 : 1.0), 1e15, "B/s", text, field);
  }
  throw ConfigError(fmt::format("{}: unit '{}' in '{}' is not a bandwidth (allowed: {})", field, u, text, kAllowed));
}

double parse_duration(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "ns, us, ms, s";
  auto [v, u] = split_number(text, field, kAllowed);
  constexpr double kMost = 1e6;  // 11.6 days: a step, a latency or a kernel
  if (u == "ns") return at_most(v * 1e-9, kMost, "s", text, field);
  if (u == "us") return at_most(v * 1e-6, kMost, "s", text, field);
  if (u == "ms") return at_most(v * 1e-3, kMost, "s", text, field);
  if (u == "s") return at_most(v, kMost, "s", text, field);
  throw ConfigError(fmt::format("{}: unit '{}' in '{}' is not a duration (allowed: {})", field, u, text, kAllowed));
}

double parse_size(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)";
  auto [v, u] = split_number(text, field, kAllowed);
  constexpr double kMost = 1e18;  // an exabyte
  if (u == "B") return at_most(v, kMost, "B", text, field);
  if (u.size() == 2 && u[1] == 'B' && scale_prefix(u[0]) != 0)
    return at_most(v * scale_prefix(u[0]), kMost, "B", text, field);
  if (u.size() == 3 && u.substr(1) == "iB") {
    double p = scale_prefix(u[0]);
    if (p != 0) return at_most(v * std::pow(1024.0, std::round(std::log10(p) / 3)), kMost, "B", text, field);
  }
  throw ConfigError(fmt::format("{}: unit '{}' in '{}' is not a size (allowed: {})", field, u, text, kAllowed));
}

double parse_flops(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "FLOP/s, GFLOP/s, TFLOP/s, PFLOP/s";
  auto [v, u] = split_number(text, field, kAllowed);
  constexpr double kMost = 1e18;  // an exaFLOP/s per accelerator
  if (u == "FLOP/s") return at_most(v, kMost, "FLOP/s", text, field);
  if (u.size() == 7 && u.substr(1) == "FLOP/s" && scale_prefix(u[0]) != 0)
    return at_most(v * scale_prefix(u[0]), kMost, "FLOP/s", text, field);
  throw ConfigError(fmt::format("{}: unit '{}' in '{}' is not a compute rate (allowed: {})", field, u, text, kAllowed));
}

std::string format_seconds(double s) {
  if (s >= 1) return fmt::format("{:.3f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

std::string format_bandwidth(double bps) {
  if (bps >= 1e9) return fmt::format("{:.1f} GB/s", bps / 1e9);
  return fmt::format("{:.1f} MB/s", bps / 1e6);
}

std::string format_gb(double bytes) { return fmt::format("{:.1f} GB", bytes / 1e9); }

}  // namespace conduit::sim
