#pragma once
// The libtorch LocalTrainer of `conduit fl` (torch-free interface): the config's model and data set, local SGD with
// FedProx's proximal term, evaluation on the test set. Loads the data (ConfigError when its files are missing).
#include <memory>

#include "fl/federation.h"

namespace conduit::train {

std::unique_ptr<fl::LocalTrainer> make_fl_trainer(const fl::FlConfig& c);

}  // namespace conduit::train
