#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cctype>
#include <cstdio>
#include <mutex>

#include "core/env.h"
#include "core/error.h"

namespace conduit {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  // The level is checked before the logger is registered: a throw after registering left a half-made logger, and
  // the next use (often on a background thread, where a throw terminates) tried to register it again.
  // A bad level is the CLI's to refuse up front (cli/main.cc); a library user's first log line (often on a
  // background thread, where a throw terminates the process) warns once and logs at warn.
  spdlog::level::level_enum lv = spdlog::level::warn;
  try {
    lv = log_level_from_env();
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "[conduit warning] %s; logging at warn\n", e.what());
  }
  auto l = spdlog::stderr_color_mt("conduit");
  l->set_level(lv);
  l->set_pattern("[conduit %^%l%$] %v");
  return l;
}

}  // namespace

spdlog::level::level_enum log_level_from_env() {
  const auto given = env_string("CONDUIT_LOG_LEVEL").value_or("warn");
  std::string level = given;  // any case (INFO was refused)
  for (char& ch : level) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  auto lv = spdlog::level::from_str(level);
  if (lv == spdlog::level::off && level != "off") {
    throw ConfigError("environment variable CONDUIT_LOG_LEVEL='" + given +
                      "' is invalid: expected trace, debug, info, warn (warning), error (err), critical or off");
  }
  return lv;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = make_logger();
  return *l;
}

void set_log_rank(int rank) {
  logger().set_pattern("[conduit rank " + std::to_string(rank) + " %^%l%$] %v");
}

}  // namespace conduit
