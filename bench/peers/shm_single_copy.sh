#!/bin/bash
# Conduit's shm transport with single copy (CONDUIT_SHM_SINGLE_COPY_BYTES, default 256K) against the same binary with
# it off (every message through the rings), alternated ROUNDS times in one command (this VM's speed drifts between
# runs), 2 ranks bound to a core each: the median per size of each side's mean time per call, and their ratio.
#
#   bench/peers/shm_single_copy.sh [OP] [ROUNDS] [MIN] [MAX]      (defaults: allreduce 7 256K 64M)
set -euo pipefail
op=${1:-allreduce}
rounds=${2:-7}
min=${3:-256K}
max=${4:-64M}
here=$(cd "$(dirname "$0")" && pwd)
conduit=${CONDUIT:-$here/../../build/bin/conduit}
[ -x "$conduit" ] || { echo "shm_single_copy.sh: no conduit binary at $conduit (build first, or set CONDUIT)" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "shm_single_copy.sh: ROUNDS must be a positive integer, got '$rounds'" >&2; exit 2; }
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
for ((r = 1; r <= rounds; r++)); do
  for setting in off 256K; do
    CONDUIT_SHM_SINGLE_COPY_BYTES=$setting timeout 600 "$conduit" launch -n 2 --bind core -- "$conduit" bench coll \
      --op "$op" --transport shm -b "$min" -e "$max" -n 20 -w 3 --json 2>"$err" |
      sed -n 's/^\[rank 0\] //p' | sed "s/^/$setting /" >>"$out" || {
      echo "shm_single_copy.sh: round $r with CONDUIT_SHM_SINGLE_COPY_BYTES=$setting failed:" >&2
      cat "$err" >&2
      exit 1
    }
  done
done
/usr/bin/python3 - "$out" "$op" "$rounds" <<'EOF'
import collections, json, statistics, sys
path, op, rounds = sys.argv[1:]
times, wrong = collections.defaultdict(list), 0
for line in open(path):
    setting, _, rec = line.partition(" ")
    try:
        j = json.loads(rec)
    except ValueError:
        continue
    times[(j["bytes"], setting)].append(j["time_us"])
    wrong += int(j.get("wrong", 0) or 0)
sizes = sorted({b for b, _ in times})
if not sizes:
    sys.exit("shm_single_copy.sh: no results (did the runs fail? run one by hand)")
print(f"{op}, 2 ranks over shm, median of {rounds} alternated runs of the mean time per call")
print(f"{'bytes':>10} {'rings us':>10} {'single copy us':>15} {'speed-up':>9}")
for b in sizes:
    off, on = times.get((b, "off")), times.get((b, "256K"))
    if not off or not on:
        continue
    a, c = statistics.median(off), statistics.median(on)
    print(f"{b:>10} {a:>10.1f} {c:>15.1f} {a / c:>8.2f}x")
print(f"wrong elements: {wrong}")
EOF
