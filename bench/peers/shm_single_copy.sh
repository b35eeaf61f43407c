#!/bin/bash
# Conduit's shm transport with single copy (CONDUIT_SHM_SINGLE_COPY_BYTES, default 256K) against the same binary with
# it off (every message through the rings), alternated ROUNDS times in one command (this VM's speed drifts between
# runs; each round in the previous one's order reversed, so neither side always runs first), 2 ranks bound to a core
# each: the median per size of each side's mean time per call, and their ratio. A run where single copy could not be
# used (its start-up probe failed, e.g. under Yama's ptrace_scope: every message then goes through the rings) stops
# the comparison, which would otherwise compare the rings with themselves.
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
# shellcheck source-path=SCRIPTDIR source=../alternate_rounds.sh
source "$here/../alternate_rounds.sh"
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
run() {  # setting round
  CONDUIT_LOG_LEVEL=info CONDUIT_SHM_SINGLE_COPY_BYTES=$1 timeout 600 "$conduit" launch -n 2 --bind core -- \
    "$conduit" bench coll --op "$op" --transport shm -b "$min" -e "$max" -n 20 -w 3 --json 2>"$err" |
    sed -n 's/^\[rank 0\] //p' | sed "s/^/$1 /" >>"$out" || {
    echo "shm_single_copy.sh: round $2 with CONDUIT_SHM_SINGLE_COPY_BYTES=$1 failed:" >&2
    cat "$err" >&2
    exit 1
  }
  if [ "$1" != off ] && grep -q "messages go through the rings only" "$err"; then
    echo "shm_single_copy.sh: single copy was off in round $2 (nothing to compare):" >&2
    grep "messages go through the rings only" "$err" >&2
    exit 1
  fi
}
alternate_rounds "$rounds" run off 256K
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
