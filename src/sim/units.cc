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

// A decimal number (digits, an optional fraction and exponent: strtod alone also took 0x10, inf and nan), spaces, and
// a unit written without spaces ("1 G b / s" was read as 1 Gb/s).
Split split_number(std::string_view text, std::string_view field, std::string_view allowed) {
  std::string s(text);
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  size_t j = i, digits = 0;
  while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j, ++digits;
  if (j < s.size() && s[j] == '.')
    for (++j; j < s.size() && std::isdigit(static_cast<unsigned char>(s[j])); ++j) ++digits;
  if (digits > 0 && j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
    size_t k = j + 1;
    if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
    if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
      j = k;
      while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    }
  }
  if (digits == 0)
    throw ConfigError(
        fmt::format("{}: '{}' is not a non-negative number with a unit (allowed units: {})", field, text, allowed));
  const std::string number = s.substr(i, j - i);
  const double v = std::strtod(number.c_str(), nullptr);
  if (!std::isfinite(v))
    throw ConfigError(fmt::format("{}: '{}' is above the largest value this simulator takes", field, text));
  // (a non-zero number that underflows: latency 1e-400 us became 0 without a word)
  const size_t mantissa_end = number.find_first_of("eE");
  if (v == 0 && number.substr(0, mantissa_end).find_first_of("123456789") != std::string::npos)
    throw ConfigError(fmt::format("{}: '{}' is below the smallest value this simulator takes", field, text));
  size_t u = j;
  while (u < s.size() && std::isspace(static_cast<unsigned char>(s[u]))) ++u;
  size_t e = s.size();
  while (e > u && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  std::string unit = s.substr(u, e - u);
  for (char c : unit)
    if (std::isspace(static_cast<unsigned char>(c)))
      throw ConfigError(
          fmt::format("{}: '{}': the unit is written without spaces (allowed units: {})", field, text, allowed));
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

// A parsed quantity above `most` (or overflowing to inf) is a typo or a unit mix-up, not hardware; so is a rate
// above 0 but below `least` (1e-300 B/s made every time inf).
double at_most(double v, double most, const char* unit, std::string_view text, std::string_view field,
               double least = 0) {
  if (!(v <= most))
    throw ConfigError(
        fmt::format("{}: '{}' is above the largest value this simulator takes ({:g} {})", field, text, most, unit));
  if (v > 0 && v < least)
    throw ConfigError(
        fmt::format("{}: '{}' is below the smallest value this simulator takes ({:g} {})", field, text, least, unit));
  return v;
}

}  // namespace

double parse_bandwidth(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "b/s, Kb/s, Mb/s, Gb/s, Tb/s, Pb/s, B/s, KB/s, MB/s, GB/s, TB/s, PB/s";
  auto [v, u] = split_number(text, field, kAllowed);
  if (u.size() >= 3 && u.substr(u.size() - 2) == "/s") {
    std::string base = u.substr(0, u.size() - 2);
    double mult = 1;
    if (base.size() == 2) {
      mult = scale_prefix(base[0]);
      base = base.substr(1);
    }
    if (mult != 0 && (base == "b" || base == "B"))
      return at_most(v * mult * (base == "b" ? 0.125 : 1.0), 1e15, "B/s", text, field, 1);  // 1 B/s at least
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
  constexpr std::string_view kAllowed =
      "B, KB, MB, GB, TB, PB (powers of 1000), KiB, MiB, GiB, TiB, PiB (powers of 1024)";
  auto [v, u] = split_number(text, field, kAllowed);
  constexpr double kMost = 1e18;  // an exabyte
  // (a size is whole bytes: memory 0.5 B was taken)
  if (u == "B") return at_most(v, kMost, "B", text, field, 1);
  if (u.size() == 2 && u[1] == 'B' && scale_prefix(u[0]) != 0)
    return at_most(v * scale_prefix(u[0]), kMost, "B", text, field, 1);
  if (u.size() == 3 && u.substr(1) == "iB") {
    double p = scale_prefix(u[0]);
    if (p != 0) return at_most(v * std::pow(1024.0, std::round(std::log10(p) / 3)), kMost, "B", text, field, 1);
  }
  throw ConfigError(fmt::format("{}: unit '{}' in '{}' is not a size (allowed: {})", field, u, text, kAllowed));
}

double parse_flops(std::string_view text, std::string_view field) {
  constexpr std::string_view kAllowed = "FLOP/s, KFLOP/s, MFLOP/s, GFLOP/s, TFLOP/s, PFLOP/s";
  auto [v, u] = split_number(text, field, kAllowed);
  constexpr double kMost = 1e18;  // an exaFLOP/s per accelerator
  constexpr double kLeast = 1;
  if (u == "FLOP/s") return at_most(v, kMost, "FLOP/s", text, field, kLeast);
  if (u.size() == 7 && u.substr(1) == "FLOP/s" && scale_prefix(u[0]) != 0)
    return at_most(v * scale_prefix(u[0]), kMost, "FLOP/s", text, field, kLeast);
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
