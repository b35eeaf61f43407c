#!/usr/bin/env bash
# Top-k at density R of SIZE bytes of f32: Conduit's sampled-threshold top-k vs libtorch's topk, one thread each,
# in the same run. Prints both JSON records and the ratio (libtorch time / Conduit time; above 1: Conduit faster).
# Usage: bench/peers/compare_topk.sh [RATIO=0.001] [SIZE=100000000] [CONDUIT=build/bin/conduit]
set -euo pipefail
ratio=${1:-0.001}
size=${2:-100000000}
# (run from the repository root whatever the caller's directory: the peer's paths are relative to it; a CONDUIT given
# relative to the caller's directory is resolved there first, the default is the root's build)
root=$(cd "$(dirname "$0")/../.." && pwd)
conduit=${3:-$root/build/bin/conduit}
if [[ "$conduit" == */* ]]; then conduit=$(realpath -- "$conduit"); fi
cd "$root"
case "$size" in
  ''|*[!0-9]*) echo "compare_topk.sh: SIZE '$size': allowed: a whole number of bytes (no suffixes)" >&2; exit 2 ;;
esac
# Built when missing or older than its source.
[ build-peers/torch_topk -nt bench/peers/torch_topk.cc ] || bench/peers/build_torch_topk.sh >&2
c=$("$conduit" bench compress --method "topk:ratio=$ratio" --size "$size" --min-time 1 --json)
t=$(OMP_NUM_THREADS=1 build-peers/torch_topk --ratio "$ratio" --size "$size" --min-time 1)
echo "$c"
echo "$t"
/usr/bin/python3 - "$c" "$t" <<'PY'
import json, sys
c, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if c['elements'] != t['elements']:
    sys.exit(f"compare_topk.sh: conduit timed {c['elements']} elements, libtorch {t['elements']}: not comparable")
print(f"topk ratio {c['method']} on {c['elements']} f32: conduit {c['compress_s']*1e3:.2f} ms, "
      f"libtorch abs+topk+gather {t['compress_s']*1e3:.2f} ms (topk alone {t['topk_only_s']*1e3:.2f} ms): "
      f"libtorch/conduit = {t['compress_s']/c['compress_s']:.2f}x (topk alone {t['topk_only_s']/c['compress_s']:.2f}x)")
PY
