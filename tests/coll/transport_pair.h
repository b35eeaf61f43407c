#pragma once
// Connected transports in one process for tests: tcp over loopback, shm or inproc (a pair, or n).
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "net/inproc.h"
#include "net/shm.h"
#include "net/tcp.h"

namespace conduit::net::test_util {

// Built by n threads that meet in an in-memory allgather; usable from any thread afterwards. Throws a rank's error
// when any could not be built (one that failed itself before one that waited for it at the rendezvous).
inline std::vector<TransportPtr> make_transport_world(const std::string& kind, int n) {
  if (kind == "inproc") return make_inproc_world(n);
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  std::vector<std::string> slots(static_cast<size_t>(n));
  std::map<int, std::vector<std::string>> results;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, round = 0;
  std::vector<TransportPtr> out(static_cast<size_t>(n));
  std::vector<std::string> errors(static_cast<size_t>(n));
  static int serial = 0;
  const std::string job = "pair" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      AllgatherFn ag = [&, r](const std::string& mine) {
        std::unique_lock<std::mutex> lk(mu);
        slots[r] = mine;
        const int my_round = round;
        if (++arrived == n) {
          arrived = 0;
          results[my_round] = slots;  // a fast rank may write its next round's value before this one reads
          ++round;
          cv.notify_all();
        } else if (!cv.wait_for(lk, std::chrono::seconds(20), [&] { return round != my_round; })) {
          throw TimeoutError("another rank never reached the rendezvous");
        }
        return results[my_round];
      };
      try {
        const std::vector<int> hosts(static_cast<size_t>(n), 0);
        out[r] = kind == "tcp" ? make_tcp_transport(r, n, hosts, ag, Deadline::after(10))
                               : make_shm_transport(r, n, hosts, job, ag);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  // The cause first: a rank that failed (shm's segments not fitting /dev/shm) leaves the others timing out at the
  // rendezvous, and the first rank's timeout hid it.
  for (const bool waiting : {false, true})
    for (const auto& e : errors)
      if (!e.empty() && (waiting || e.find("never reached the rendezvous") == std::string::npos))
        throw Error(kind + " world: " + e);
  return out;
}

inline std::vector<TransportPtr> make_transport_pair(const std::string& kind) { return make_transport_world(kind, 2); }

}  // namespace conduit::net::test_util
