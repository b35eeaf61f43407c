#include "core/env.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "core/error.h"

namespace conduit {

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<long long> env_int(const char* name, long long lo, long long hi) {
  auto s = env_string(name);
  if (!s) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s->c_str(), &end, 10);
  // Digits with an optional '-' only (strtoll also skips leading spaces and takes a '+').
  const char c0 = (*s)[0];
  const bool plain = std::isdigit(static_cast<unsigned char>(c0)) || (c0 == '-' && s->size() > 1);
  if (!plain || errno != 0 || end == s->c_str() || *end != '\0' || v < lo || v > hi) {
    throw ConfigError(fmt::format("environment variable {}='{}' is invalid: expected an integer in [{}, {}]", name,
                                  *s, lo, hi));
  }
  return v;
}

std::optional<double> env_seconds(const char* name, double max) {
  auto s = env_string(name);
  if (!s) return std::nullopt;
  // A decimal number, optionally with an exponent (strtod alone also took 0x10, " 5" and "infinity"), from a
  // millisecond (a timeout of 1e-300 s failed every wait at once) to ~30 years.
  const bool decimal = is_decimal(*s);
  char* end = nullptr;
  double v = decimal ? std::strtod(s->c_str(), &end) : 0;
  if (!decimal || end == s->c_str() || *end != '\0' || !(v >= 1e-3) || !(v <= max)) {
    throw ConfigError(
        fmt::format("environment variable {}='{}' is invalid: expected a decimal number of seconds in [0.001, {:g}]",
                    name, *s, max));
  }
  return v;
}

bool is_decimal(std::string_view t, bool sign) {
  size_t i = 0, digits = 0;
  auto digit = [&](size_t k) { return k < t.size() && std::isdigit(static_cast<unsigned char>(t[k])); };
  if (sign && i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
  for (; digit(i); ++i) ++digits;
  if (i < t.size() && t[i] == '.')
    for (++i; digit(i); ++i) ++digits;
  if (digits == 0) return false;
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
    if (!digit(i)) return false;
    while (digit(i)) ++i;
  }
  return i == t.size();
}

bool env_flag(const char* name) {
  auto s = env_string(name);
  if (!s) return false;
  std::string v;
  for (char c : *s) v += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw ConfigError(fmt::format("environment variable {}='{}' is invalid: expected 1/0, true/false, yes/no or on/off",
                                name, *s));
}

uint64_t parse_bytes(std::string_view text, std::string_view what, std::string_view allowed) {
  try {
    return parse_bytes(text, what);
  } catch (const ConfigError& e) {
    // One "allowed" clause, the caller's: the general one a message carries (up to 10^18, a size in bytes) read
    // beside it as a second, contradictory range.
    std::string_view msg = e.what();
    msg = msg.substr(0, msg.find("; allowed: "));
    throw ConfigError(fmt::format("{}; allowed: {}", msg, allowed));
  }
}

uint64_t parse_bytes(std::string_view text, std::string_view what) {
  std::string t = trim(text);
  auto bad = [&]() {
    return ConfigError(
        fmt::format("{} '{}' is not a size: expected a non-negative number with an optional K, M, G or "
                    "T suffix (powers of 1024), e.g. 4096, 64K, 4M, 1G",
                    what, text));
  };
  if (t.empty()) throw bad();
  // Decimal digits with an optional fraction (strtod alone also took 0x10, 1e3, inf).
  size_t digits = 0;
  while (digits < t.size() && (std::isdigit(static_cast<unsigned char>(t[digits])) || t[digits] == '.')) ++digits;
  // (a fraction needs digits on both sides of its point: "1." and "1.K" were taken)
  if (digits == 0 || std::count(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(digits), '.') > 1 || t[0] == '.' ||
      t[digits - 1] == '.')
    throw bad();
  // (a lowercase b is bits where bandwidths are written, as cluster files read it: "64Mb" was taken as 64 MiB)
  if (digits < t.size() && t.back() == 'b')
    throw ConfigError(
        fmt::format("{} '{}' ends in a lowercase b, which reads as bits; allowed: a size in bytes, "
                    "e.g. 64M, 64MB or 64MiB",
                    what, text));
  std::string suffix;
  for (size_t i = digits; i < t.size(); ++i)
    suffix += static_cast<char>(std::toupper(static_cast<unsigned char>(t[i])));
  uint64_t mult = 1;
  if (suffix.empty() || suffix == "B") mult = 1;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB")
    mult = uint64_t{1} << 10;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB")
    mult = uint64_t{1} << 20;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB")
    mult = uint64_t{1} << 30;
  else if (suffix == "T" || suffix == "TB" || suffix == "TIB")
    mult = uint64_t{1} << 40;
  else throw bad();
  constexpr uint64_t kLimit = 1000000000000000000ull;  // 10^18 bytes
  auto too_big = [&]() {
    return ConfigError(
        fmt::format("{} '{}' is more than 10^18 bytes; allowed: up to 10^18 (about 909494T)", what, text));
  };
  const std::string_view num(t.data(), digits);
  if (num.find('.') == std::string_view::npos) {
    // Whole numbers exactly (through a double, values above 2^53 were rounded).
    uint64_t n = 0;
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), n);
    if (ec == std::errc::result_out_of_range || (ec == std::errc() && n > kLimit / mult)) throw too_big();
    if (ec != std::errc() || ptr != num.data() + num.size()) throw bad();
    return n * mult;
  }
  const double v = std::strtod(std::string(num).c_str(), nullptr);
  if (!(v >= 0) || !std::isfinite(v)) throw bad();
  const double bytes = v * static_cast<double>(mult);
  if (bytes > static_cast<double>(kLimit)) throw too_big();
  if (bytes != std::floor(bytes))
    throw ConfigError(fmt::format("{} '{}' is {} bytes, not a whole number; allowed: whole bytes, e.g. 4096, 64K, 1.5M",
                                  what, text, bytes));
  return static_cast<uint64_t>(bytes);
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", bytes);
  if (bytes == std::floor(bytes)) return fmt::format("{:.0f} {}", bytes, units[u]);
  return fmt::format("{:.2f} {}", bytes, units[u]);
}

double default_timeout_seconds() {
  auto v = env_seconds("CONDUIT_TIMEOUT");
  return v ? *v : 300.0;
}

double startup_timeout_seconds(double timeout_s) { return std::max(timeout_s, default_timeout_seconds()); }

std::vector<std::string> split(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = text.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(text.substr(start));
      break;
    }
    out.emplace_back(text.substr(start, pos - start));
    start = pos + 1;
  }
  return out;
}

// Whether `value` is one pair of brackets around the rest ("[a,b]"; not "[a],[b]" or "[a]b").
static bool in_one_bracket_pair(std::string_view value) {
  if (value.size() < 2 || value.front() != '[' || value.back() != ']') return false;
  int depth = 0;
  for (size_t i = 0; i < value.size(); ++i) {
    depth += value[i] == '[' ? 1 : value[i] == ']' ? -1 : 0;
    if (depth == 0 && i + 1 < value.size()) return false;
  }
  return true;
}

std::map<std::string, std::string> parse_key_values(
    std::string_view text, const std::function<std::string(const std::string&)>& bad_item) {
  std::map<std::string, std::string> out;
  if (text.empty()) return out;
  // Items end at commas outside brackets.
  std::vector<std::string> items(1);
  int depth = 0;
  for (char ch : text) {
    if (ch == '[') ++depth;
    if (ch == ']' && --depth < 0)
      throw ConfigError(fmt::format("'{}' closes a bracket it never opened; allowed: key=[value, with commas]", text));
    if (ch == ',' && depth == 0)
      items.emplace_back();
    else
      items.back() += ch;
  }
  if (depth != 0)
    throw ConfigError(fmt::format("'{}' leaves a bracket '[' unclosed; allowed: key=[value, with commas]", text));
  for (const auto& kv : items) {
    size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw ConfigError(bad_item(kv));
    std::string value = kv.substr(eq + 1);
    const bool bracketed = in_one_bracket_pair(value);
    if (!bracketed && value.find('[') != std::string::npos)
      throw ConfigError(
          fmt::format("'{}' has a bracket inside its value; allowed: key=[value, with commas], the whole "
                      "value in one pair of brackets",
                      kv));
    if (bracketed) value = value.substr(1, value.size() - 2);
    if (!out.emplace(kv.substr(0, eq), value).second)
      throw ConfigError(fmt::format("'{}' is given twice in '{}'; give each key once", kv.substr(0, eq), text));
  }
  return out;
}

std::string key_value(std::string_view key, std::string_view value) {
  // (a value already in one pair of brackets, as a YAML mapping may give it, is kept: bracketed twice, it was
  // refused; "[a],[b]" is two pairs, and bracketed again)
  if (in_one_bracket_pair(value) || value.find(',') == std::string_view::npos) return fmt::format("{}={}", key, value);
  return fmt::format("{}=[{}]", key, value);
}

std::string trim(std::string_view text) {
  size_t b = 0, e = text.size();
  while (b < e && std::isspace(static_cast<unsigned char>(text[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(text[e - 1]))) --e;
  return std::string(text.substr(b, e - b));
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

}  // namespace conduit
