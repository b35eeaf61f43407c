#pragma once
// Runs a function on n in-process ranks (threads over the in-process transport) and collects errors.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "coll/communicator.h"

namespace conduit::compress::testing {

// Rank r on host r / ranks_per_host.
template <typename Fn>
void on_ranks(int n, Fn fn, int ranks_per_host = 2) {
  coll::CommConfig cfg;
  cfg.timeout_s = 60;
  cfg.measure_cost_model = false;
  auto comms = coll::Communicator::inproc(n, ranks_per_host, cfg);
  std::vector<std::string> errors(n);
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      try {
        fn(*comms[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << n;
}

}  // namespace conduit::compress::testing
