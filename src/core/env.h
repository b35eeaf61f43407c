#pragma once
// Environment and size/duration parsing shared by every layer. Parse failures are ConfigErrors naming the
// variable and what is allowed.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace conduit {

std::optional<std::string> env_string(const char* name);
// Integer env var; nullopt when unset; ConfigError when set but not a decimal integer (optional '-') in [lo, hi].
std::optional<long long> env_int(const char* name, long long lo, long long hi);
// Seconds: a decimal number (fraction and exponent allowed) in [0.001, 1e9]; ConfigError when not.
std::optional<double> env_seconds(const char* name, double max = 1e9);
bool env_flag(const char* name);  // 1/true/yes/on -> true; 0/false/no/off/unset -> false; else ConfigError

// "4096", "4K", "4KiB", "1.5M", "2G" -> bytes (powers of 1024). `what` names the field in errors.
uint64_t parse_bytes(std::string_view text, std::string_view what);
// The same, its error ending in "; allowed: <allowed>" (an environment variable's range, for one line that says all).
uint64_t parse_bytes(std::string_view text, std::string_view what, std::string_view allowed);
// Whether `text` is a decimal number as a person writes one: digits with an optional fraction and exponent (and,
// with `sign`, a leading + or -); strtod alone also takes hex, inf, nan and leading spaces.
bool is_decimal(std::string_view text, bool sign = false);
std::string format_bytes(double bytes);  // 4 MiB, 512 B, 1.5 GiB

// The default timeout of blocking collectives: CONDUIT_TIMEOUT seconds, else 300.
double default_timeout_seconds();
// Start-up's deadline, given the collectives' timeout (<= 0: the default): the longer of the two. Meeting the other
// ranks waits for the slowest process to come up (libraries and data loaded), which a collective's deadline does not
// bound: under a 1 s deadline a rank that started a second after another failed the job.
double startup_timeout_seconds(double timeout_s);

std::vector<std::string> split(std::string_view text, char sep);
// Parses "key=value,key=value" (empty text: no pairs). An item without '=' or with an empty key is a ConfigError
// whose message is bad_item(item). A value in brackets may hold commas, and is taken without them:
// "pull_compressor=[qsgd:levels=127,bucket=64],lr=0.1" (a compressor spec with parameters, inside a scheme's).
std::map<std::string, std::string> parse_key_values(std::string_view text,
                                                    const std::function<std::string(const std::string&)>& bad_item);
// "key=value" as parse_key_values reads it back: a value holding a comma is bracketed.
std::string key_value(std::string_view key, std::string_view value);
std::string trim(std::string_view text);
std::string join(const std::vector<std::string>& parts, std::string_view sep);

}  // namespace conduit
