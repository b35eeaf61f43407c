#pragma once
// Logging through spdlog. CONDUIT_LOG_LEVEL=trace|debug|info|warn|error|off (default warn). Each line carries
// the rank once it is known.
#include <spdlog/spdlog.h>

namespace conduit {

spdlog::logger& logger();
// CONDUIT_LOG_LEVEL's level; ConfigError naming the variable and the allowed levels. `conduit` checks it at start,
// on the main thread, so a bad value is one line and not a throw inside a worker thread's first log call.
spdlog::level::level_enum log_level_from_env();
void set_log_rank(int rank);

}  // namespace conduit

#define CONDUIT_LOG_DEBUG(...) ::conduit::logger().debug(__VA_ARGS__)
#define CONDUIT_LOG_INFO(...) ::conduit::logger().info(__VA_ARGS__)
#define CONDUIT_LOG_WARN(...) ::conduit::logger().warn(__VA_ARGS__)
#define CONDUIT_LOG_ERROR(...) ::conduit::logger().error(__VA_ARGS__)
