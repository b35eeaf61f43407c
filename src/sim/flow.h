#pragma once
// Flow-level network model: concurrent transfers share every link max-min fairly (progressive filling), and
// rates are recomputed whenever a flow finishes. Congestion-aware, unlike the per-link alpha-beta model.
#include <vector>

namespace conduit::sim {

struct Flow {
  std::vector<int> path;  // link ids
  double bytes = 0;
  double start = 0;    // seconds; the flow joins at this time
  double latency = 0;  // added to its completion (propagation + software), not sharing bandwidth
};

// Max-min fair rates of flows that share links of the given capacities (bytes/s). Flows with an empty path get
// +infinity. O(rounds * (links + sum of path lengths)).
std::vector<double> max_min_rates(const std::vector<std::vector<int>>& paths, const std::vector<double>& capacity);

struct FlowResult {
  std::vector<double> finish;  // per flow, seconds (including its latency)
  double makespan = 0;
};

// Simulates the flows to completion (event-driven; rates recomputed at every arrival and completion).
FlowResult simulate_flows(const std::vector<Flow>& flows, const std::vector<double>& capacity);

}  // namespace conduit::sim
