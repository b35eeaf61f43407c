#pragma once
// Where pipeline parallelism cuts the mlp, cnn and resnet into stages (torch/models.h builds them): between their
// units, balanced by the units' forward work, as GPipe balances its partitions. No libtorch here: the config
// resolver checks a stage count without building a model.
#include <string>
#include <vector>

#include "core/partition.h"  // partition_units

namespace conduit::train {

// The units' forward multiply-adds per sample, in forward order: the mlp's 3 linear layers; the cnn's 2 convolutions
// (with their pooling) and 2 linear layers; the resnet's stem, 3 blocks and classifier. A stage's model file holds
// its units' modules, so checkpoints record the cut these give (a resume under other costs is refused). ConfigError for
// another model.
std::vector<double> unit_costs(const std::string& model);
// partition_units(unit_costs(model), stages); ConfigError (one line) for more stages than the model has units.
std::vector<int> stage_bounds(const std::string& model, int stages);
// Each stage's forward multiply-adds a sample under that cut (the unit costs of its run summed).
std::vector<double> stage_costs(const std::string& model, int stages);

}  // namespace conduit::train
