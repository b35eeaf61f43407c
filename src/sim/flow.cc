#include "sim/flow.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "core/error.h"

namespace conduit::sim {

std::vector<double> max_min_rates(const std::vector<std::vector<int>>& paths, const std::vector<double>& capacity) {
  const double kInf = std::numeric_limits<double>::infinity();
  const size_t nf = paths.size();
  std::vector<double> rate(nf, kInf);
  // Compact the links that are used.
  std::unordered_map<int, int> index;
  std::vector<double> cap;
  std::vector<std::vector<int>> flows_on;
  std::vector<std::vector<int>> fl(nf);
  for (size_t f = 0; f < nf; ++f) {
    for (int l : paths[f]) {
      if (l < 0 || static_cast<size_t>(l) >= capacity.size())
        throw InvalidArgument("max_min_rates: link id out of range");
      auto [it, fresh] = index.emplace(l, static_cast<int>(cap.size()));
      if (fresh) {
        cap.push_back(capacity[l]);
        flows_on.emplace_back();
      }
      flows_on[it->second].push_back(static_cast<int>(f));
      fl[f].push_back(it->second);
    }
  }
  const size_t nl = cap.size();
  std::vector<int> active(nl, 0);
  for (size_t l = 0; l < nl; ++l) active[l] = static_cast<int>(flows_on[l].size());
  std::vector<char> frozen(nf, 0);
  size_t left = 0;
  for (size_t f = 0; f < nf; ++f) {
    if (fl[f].empty())
      frozen[f] = 1;
    else
      ++left;
  }
  while (left > 0) {
    // The bottleneck: the link with the smallest fair share among links with unfrozen flows.
    double best = kInf;
    for (size_t l = 0; l < nl; ++l)
      if (active[l] > 0) best = std::min(best, cap[l] / active[l]);
    if (!(best < kInf)) break;
    const double tol = best * 1e-12;
    for (size_t l = 0; l < nl; ++l) {
      if (active[l] == 0 || cap[l] / active[l] > best + tol) continue;
      for (int f : flows_on[l]) {
        if (frozen[f]) continue;
        frozen[f] = 1;
        rate[f] = best;
        --left;
        for (int l2 : fl[f]) {
          cap[l2] = std::max(0.0, cap[l2] - best);
          --active[l2];
        }
      }
    }
  }
  return rate;
}

FlowResult simulate_flows(const std::vector<Flow>& flows, const std::vector<double>& capacity) {
  const size_t n = flows.size();
  FlowResult res;
  res.finish.assign(n, 0.0);
  std::vector<double> remaining(n);
  std::vector<char> done(n, 0);
  for (size_t i = 0; i < n; ++i) remaining[i] = flows[i].bytes;
  double now = 0;
  size_t left = n;
  // Flows with nothing to send finish at start + latency.
  for (size_t i = 0; i < n; ++i) {
    if (remaining[i] <= 0 || flows[i].path.empty()) {
      done[i] = 1;
      --left;
      res.finish[i] = flows[i].start + flows[i].latency;
    }
  }
  std::vector<int> ids;
  std::vector<std::vector<int>> paths;
  while (left > 0) {
    ids.clear();
    paths.clear();
    double next_arrival = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      if (flows[i].start <= now + 1e-18) {
        ids.push_back(static_cast<int>(i));
        paths.push_back(flows[i].path);
      } else {
        next_arrival = std::min(next_arrival, flows[i].start);
      }
    }
    if (ids.empty()) {
      now = next_arrival;
      continue;
    }
    std::vector<double> rate = max_min_rates(paths, capacity);
    double dt = next_arrival - now;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (rate[j] <= 0) continue;
      dt = std::min(dt, remaining[ids[j]] / rate[j]);
    }
    if (!(dt < std::numeric_limits<double>::infinity()))
      throw InvalidArgument("simulate_flows: a flow crosses a link of zero capacity and never finishes");
    now += dt;
    for (size_t j = 0; j < ids.size(); ++j) {
      int i = ids[j];
      remaining[i] -= rate[j] * dt;
      if (remaining[i] <= flows[i].bytes * 1e-12) {
        done[i] = 1;
        --left;
        res.finish[i] = now + flows[i].latency;
      }
    }
  }
  for (double f : res.finish) res.makespan = std::max(res.makespan, f);
  return res;
}

}  // namespace conduit::sim
