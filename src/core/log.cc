#include "core/log.h"

#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/env.h"
#include "core/error.h"

namespace conduit {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  auto l = spdlog::stderr_color_mt("conduit");
  auto level = env_string("CONDUIT_LOG_LEVEL").value_or("warn");
  auto lv = spdlog::level::from_str(level);
  if (lv == spdlog::level::off && level != "off") {
    throw ConfigError("environment variable CONDUIT_LOG_LEVEL='" + level +
                      "' is invalid: expected trace, debug, info, warn, error or off");
  }
  l->set_level(lv);
  l->set_pattern("[conduit %^%l%$] %v");
  return l;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = make_logger();
  return *l;
}

void set_log_rank(int rank) {
  logger().set_pattern("[conduit rank " + std::to_string(rank) + " %^%l%$] %v");
}

}  // namespace conduit
