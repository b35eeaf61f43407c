#include "torch/stages.h"

#include <fmt/format.h>

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

std::vector<int> stage_bounds(const std::string& model, int stages) {
  const auto costs = unit_costs(model);
  if (stages < 1 || stages > int(costs.size()))
    throw ConfigError(
        fmt::format("config: pp: {} stages of model {}, whose {} units are its finest cut; allowed: pp "
                    "1 to {}",
                    stages, model, costs.size(), costs.size()));
  return partition_units(costs, stages);
}

std::vector<double> stage_costs(const std::string& model, int stages) {
  const auto costs = unit_costs(model);
  const auto bounds = stage_bounds(model, stages);
  std::vector<double> out(size_t(stages), 0.0);
  for (int s = 0; s < stages; ++s)
    for (int u = bounds[size_t(s)]; u < bounds[size_t(s) + 1]; ++u) out[size_t(s)] += costs[size_t(u)];
  return out;
}

}  // namespace conduit::train
