// Collective helpers over any Store. Keys (under `prefix`):
//   allgather: "<prefix>/<rank>" holds each rank's value.
//   barrier:   "<prefix>/arrived" counts arrivals (add); the last rank to arrive sets "<prefix>/done", which every
//              rank gets (blocking in the store, no polling loop here).
#include "net/store.h"

#include <fmt/format.h>

#include "core/env.h"
#include "core/error.h"

namespace conduit::net {
namespace {

void check_rank(const char* what, const std::string& prefix, int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw InvalidArgument(fmt::format("{} '{}': rank {} / size {} is invalid: expected size >= 1 and 0 <= rank < size",
                                      what, prefix, rank, size));
  }
}

}  // namespace

std::vector<std::string> store_allgather(Store& store, const std::string& prefix, int rank, int size,
                                         const std::string& value, const Deadline& deadline,
                                         const std::function<void(int, const std::string&)>& on_value) {
  check_rank("store_allgather", prefix, rank, size);
  store.set(fmt::format("{}/{}", prefix, rank), value, deadline);
  std::vector<std::string> out(size);
  out[rank] = value;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    try {
      out[r] = store.get(fmt::format("{}/{}", prefix, r), deadline);
    } catch (const TimeoutError& e) {
      throw TimeoutError(fmt::format("store_allgather '{}' (rank {} of {}): rank {} has not published its value: {}",
                                     prefix, rank, size, r, e.what()));
    }
    if (on_value) on_value(r, out[r]);
  }
  return out;
}

Deadline Store::default_deadline() { return Deadline::after(default_timeout_seconds()); }

void store_barrier(Store& store, const std::string& prefix, int rank, int size, const Deadline& deadline) {
  check_rank("store_barrier", prefix, rank, size);
  const std::string arrived = prefix + "/arrived";
  const std::string done = prefix + "/done";
  int64_t n = store.add(arrived, 1, deadline);
  if (n > size) {
    throw InvalidArgument(
        fmt::format("store_barrier '{}': {} arrivals for a group of {} (was the prefix reused?)", prefix, n, size));
  }
  if (n == size) {
    store.set(done, "1", deadline);
    return;
  }
  try {
    store.get(done, deadline);
  } catch (const TimeoutError& e) {
    // How many arrived, asked with a short deadline of its own: the store may be what hangs (it then waited another
    // whole CONDUIT_TIMEOUT), and the timeout, not a failure to count, is the error to report.
    std::string seen = "fewer";
    try {
      seen = fmt::format("only {}", store.add(arrived, 0, Deadline::after(2.0)));
    } catch (const Error&) {
    }
    throw TimeoutError(fmt::format("store_barrier '{}' (rank {}): {} of {} ranks arrived before the deadline ({})",
                                   prefix, rank, seen, size, e.what()));
  }
}

}  // namespace conduit::net
