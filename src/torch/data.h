#pragma once
// Data for training (torch-free): MNIST-format IDX files (gzipped or not, read through zlib), a synthetic dataset
// for tests, and the distributed sampler that shards an epoch's permutation by rank.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace conduit::train {

// One IDX array: unsigned-byte data (type 0x08) with its dimensions.
struct IdxArray {
  std::vector<uint32_t> dims;
  std::vector<uint8_t> data;
};
// Reads `path` (gzip-compressed or plain). ConfigError when missing, ProtocolError-free: a malformed file raises
// InvalidArgument naming the file and what is wrong. A pipe is read whole (until its writer closes it) by `until`
// (default: start-up's deadline, CONDUIT_TIMEOUT or 300 s, from now); other files that are not regular are refused.
IdxArray read_idx(const std::string& path, std::chrono::steady_clock::time_point until = {});

// Images as u8 pixels (n x rows x cols) with labels 0..classes-1.
struct ImageSet {
  int64_t n = 0, rows = 0, cols = 0;
  int classes = 10;
  std::vector<uint8_t> pixels;
  std::vector<uint8_t> labels;
  float mean = 0.5f, stddev = 0.5f;  // normalisation applied when batches are built
};

// <dir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]; `limit` > 0 keeps the first `limit` samples.
ImageSet load_mnist_format(const std::string& dir, bool train, int64_t limit = 0,
                           std::chrono::steady_clock::time_point until = {});
// The number of training samples in <dir>, from the labels file's IDX header alone (8 bytes read); -1 when that
// header is not a labels file's (read_idx then names what is wrong). ConfigError when the file is missing.
int64_t mnist_format_train_count(const std::string& dir);
// 28x28 images of 10 classes: a fixed random prototype per class (from `seed`) plus per-sample noise, learnable
// in a few hundred steps. Train and test sets share prototypes and differ in noise.
ImageSet make_synthetic(int64_t n, uint64_t seed, bool train);

// The training and test sets of a run: `dataset` synthetic (synthetic_samples for training, a quarter for testing,
// from `seed`) or MNIST-format files in data_dir (the test set normalised with the training set's mean and
// deviation); train_limit / test_limit > 0 keep the first samples. Files that are pipes are read whole by
// start-up's deadline from the call, all together (timeout_s: the run's --timeout-s, <= 0 its default).
struct TrainTestSets {
  ImageSet train, test;
};
TrainTestSets load_train_test(const std::string& dataset, const std::string& data_dir, int64_t train_limit,
                              int64_t test_limit, int64_t synthetic_samples, uint64_t seed, double timeout_s = 0);

// Shards an epoch: a permutation of [0, n) drawn from (seed, epoch) (the same on every rank); rank r takes
// positions r, r+W, r+2W, ... of its first W*floor(n/W) entries, so every rank has the same number of samples and
// the union of the ranks' k-th batches of size b is the k-th batch of size W*b of a single worker.
class DistributedSampler {
 public:
  DistributedSampler(int64_t n, int world, int rank, uint64_t seed, bool shuffle = true);
  void set_epoch(int64_t epoch);
  int64_t per_rank() const { return per_rank_; }
  int64_t steps_per_epoch(int64_t batch) const { return per_rank_ / batch; }  // partial last batch dropped
  // Sample indices of this rank's step `step` (batch `batch`) of the current epoch.
  std::vector<int64_t> batch(int64_t step, int64_t batch) const;

 private:
  int64_t n_, per_rank_;
  int world_, rank_;
  uint64_t seed_;
  bool shuffle_;
  std::vector<int64_t> perm_;
};

}  // namespace conduit::train
