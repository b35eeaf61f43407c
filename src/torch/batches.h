#pragma once
// Batches and evaluation shared by the training loops that run on libtorch (trainer.cc, fl_client.cc).
#include <torch/types.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "coll/communicator.h"
#include "torch/data.h"
#include "torch/models.h"

namespace conduit::train {

// The samples `idx` of `s` as a normalised (B, 1, rows, cols) float batch and its labels.
void make_batch(const ImageSet& s, const std::vector<int64_t>& idx, torch::Tensor& x, torch::Tensor& y);

// Accuracy and mean loss on the test set: sharded over the ranks and summed (comm), or on this rank alone (nullptr).
// With a pipeline (model its stage, comm the ranks of this stage in every pipeline) through the stages, every stage
// returning the result. Error when the loss is not finite (the run diverged).
class Pipeline;
std::pair<double, double> evaluate(Net& model, const ImageSet& test, coll::Communicator* comm,
                                   Pipeline* pipe = nullptr);

}  // namespace conduit::train
