#!/usr/bin/env bash
# Builds the libtorch top-k peer (bench/peers/torch_topk.cc) into build-peers/torch_topk.
# Needs Debian's libtorch-dev (apt-get install libtorch-dev libopenblas0-pthread); libtorch is not part of the
# main build. Run from the repository root.
set -euo pipefail
mkdir -p build-peers
g++ -O2 -std=c++17 -o build-peers/torch_topk bench/peers/torch_topk.cc \
  -I/usr/include/torch/csrc/api/include -ltorch -ltorch_cpu -lc10 -lpthread
echo "built build-peers/torch_topk"
