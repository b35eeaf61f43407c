#pragma once
// Conversions between the kernel timings of `conduit bench gemm` (train::ConvTiming, train::PoolTiming: integer
// shapes, filled in by libtorch) and the simulator's calibration samples (sim::ConvSample, sim::PoolSample), so the
// two commands that time kernels (`bench gemm`, `sim calibrate`) share one mapping. Needs both modules.
#include <cstdint>

#include "sim/cluster.h"
#include "torch/gemm_bench.h"  // torch-free interface

namespace conduit::cli {

// The shape to time for a sample's shape (times left zero).
inline train::ConvTiming conv_shape(const sim::ConvSample& c) {
  train::ConvTiming t;
  t.batch = int64_t(c.batch);
  t.in = int64_t(c.in);
  t.out = int64_t(c.out);
  t.height = int64_t(c.height);
  t.width = int64_t(c.width);
  t.kernel = int64_t(c.kernel);
  t.stride = int64_t(c.stride);
  t.padding = int64_t(c.padding);
  return t;
}

// A measured convolution as a calibration sample.
inline sim::ConvSample conv_sample(const train::ConvTiming& t) {
  sim::ConvSample c;
  c.batch = double(t.batch);
  c.in = double(t.in);
  c.out = double(t.out);
  c.height = double(t.height);
  c.width = double(t.width);
  c.kernel = double(t.kernel);
  c.stride = double(t.stride);
  c.padding = double(t.padding);
  c.forward_s = t.forward_s;
  c.input_grad_s = t.input_grad_s;
  c.weight_grad_s = t.weight_grad_s;
  return c;
}

inline train::PoolTiming pool_shape(const sim::PoolSample& p) {
  train::PoolTiming t;
  t.batch = int64_t(p.batch);
  t.channels = int64_t(p.channels);
  t.height = int64_t(p.height);
  t.width = int64_t(p.width);
  t.kernel = int64_t(p.kernel);
  return t;
}

inline sim::PoolSample pool_sample(const train::PoolTiming& t) {
  sim::PoolSample p;
  p.batch = double(t.batch);
  p.channels = double(t.channels);
  p.height = double(t.height);
  p.width = double(t.width);
  p.kernel = double(t.kernel);
  p.forward_s = t.forward_s;
  p.backward_s = t.backward_s;
  return p;
}

}  // namespace conduit::cli
