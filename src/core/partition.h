#pragma once
// Cutting a sequence of units (layers, blocks) into consecutive runs of balanced cost: how `conduit train --pp` cuts
// the mlp, cnn and resnet into pipeline stages (torch/stages.h) and how the simulator cuts a layer-list model the
// same way (sim/step.h).
#include <vector>

namespace conduit {

// The cut of consecutive units with costs `costs` into `parts` non-empty runs whose largest sum is the least (of
// equally good cuts, the one whose first run ends earliest, the rest cut so again): each run's first unit, then
// costs.size(). InvalidArgument unless 1 <= parts <= costs.size() and the costs are finite, at least 0, with a
// finite sum.
std::vector<int> partition_units(const std::vector<double>& costs, int parts);

}  // namespace conduit
