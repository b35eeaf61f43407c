#pragma once
// Two connected transports in one process for tests: tcp over loopback, shm or inproc.
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

// Built by two threads that meet in an in-memory allgather; usable from any thread afterwards. Throws the first
// rank's error when either could not be built.
inline std::vector<TransportPtr> make_transport_pair(const std::string& kind) {
  if (kind == "inproc") return make_inproc_world(2);
  setenv("CONDUIT_SOCKET_IFNAME", "lo", 1);
  std::vector<std::string> slots(2);
  std::map<int, std::vector<std::string>> results;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0, round = 0;
  std::vector<TransportPtr> out(2);
  std::vector<std::string> errors(2);
  static int serial = 0;
  const std::string job = "pair" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] {
      AllgatherFn ag = [&, r](const std::string& mine) {
        std::unique_lock<std::mutex> lk(mu);
        slots[r] = mine;
        const int my_round = round;
        if (++arrived == 2) {
          arrived = 0;
          results[my_round] = slots;  // a fast rank may write its next round's value before this one reads
          ++round;
          cv.notify_all();
        } else if (!cv.wait_for(lk, std::chrono::seconds(20), [&] { return round != my_round; })) {
          throw TimeoutError("the other rank never reached the rendezvous");
        }
        return results[my_round];
      };
      try {
        out[r] = kind == "tcp" ? make_tcp_transport(r, 2, {0, 0}, ag, Deadline::after(10))
                               : make_shm_transport(r, 2, {0, 0}, job, ag);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (const auto& e : errors)
    if (!e.empty()) throw Error(kind + " pair: " + e);
  return out;
}

}  // namespace conduit::net::test_util
