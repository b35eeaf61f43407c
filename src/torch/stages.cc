#include "torch/stages.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace conduit::train {

std::vector<double> unit_costs(const std::string& model) {
  // (the layer sizes of torch/models.cc)
  if (model == "mlp") return {784.0 * 256, 256.0 * 128, 128.0 * 10};
  if (model == "cnn") return {28.0 * 28 * 32 * 9, 14.0 * 14 * 64 * 32 * 9, 64.0 * 7 * 7 * 128, 128.0 * 10};
  if (model == "resnet") {
    // a block: two 3x3 convolutions at its output's size, the first from its input's channels, and a 1x1 shortcut
    // where the shape changes
    auto block = [](double in, double out, double side) {
      return side * side * out * 9 * (in + out) + (in != out ? side * side * out * in : 0);
    };
    return {28.0 * 28 * 16 * 9, block(16, 16, 28), block(16, 32, 14), block(32, 64, 7), 64.0 * 10};
  }
  throw ConfigError(
      fmt::format("config: pp: model '{}' is not cut into stages by its units; allowed: mlp, cnn or "
                  "resnet (the vit's stages are runs of its blocks)",
                  model));
}

std::vector<int> partition_units(const std::vector<double>& costs, int parts) {
  const int n = int(costs.size());
  if (parts < 1 || parts > n)
    throw InvalidArgument(fmt::format("partition_units: {} parts of {} units; allowed: 1 to {}", parts, n, n));
  std::vector<double> prefix(size_t(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[size_t(i) + 1] = prefix[size_t(i)] + costs[size_t(i)];
  // best[p][i]: the least largest sum cutting units [i, n) into p runs; end[p][i]: where its first run ends.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(size_t(parts) + 1, std::vector<double>(size_t(n) + 1, inf));
  std::vector<std::vector<int>> end(size_t(parts) + 1, std::vector<int>(size_t(n) + 1, n));
  best[0][size_t(n)] = 0;
  for (int p = 1; p <= parts; ++p)
    for (int i = n - p; i >= 0; --i)
      for (int e = i + 1; e <= n - (p - 1); ++e) {
        const double v = std::max(prefix[size_t(e)] - prefix[size_t(i)], best[size_t(p) - 1][size_t(e)]);
        if (v < best[size_t(p)][size_t(i)]) {  // (strictly: of equals, the earliest end)
          best[size_t(p)][size_t(i)] = v;
          end[size_t(p)][size_t(i)] = e;
        }
      }
  std::vector<int> bounds{0};
  for (int p = parts; p >= 1; --p) bounds.push_back(end[size_t(p)][size_t(bounds.back())]);
  return bounds;
}

std::vector<int> stage_bounds(const std::string& model, int stages) {
  const auto costs = unit_costs(model);
  if (stages < 1 || stages > int(costs.size()))
    throw ConfigError(
        fmt::format("config: pp: {} stages of model {}, whose {} units are its finest cut; allowed: pp "
                    "1 to {}",
                    stages, model, costs.size(), costs.size()));
  return partition_units(costs, stages);
}

}  // namespace conduit::train
