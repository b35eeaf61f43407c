#!/bin/bash
# ZeRO++'s three reductions where they matter: between hosts. ZeRO-3's secondary partition (--zero-hpz 2, hpZ), its
# int8 gathers (--zero-gather int8, qwZ) and its int8 gradients (--compressor int8 at zero 3: the reduce-scatter by
# all-to-all in two hops, qgZ). An emulated cluster of 2 hosts with 2 workers each (`conduit cluster run
# --ranks-per-host 2`: a host's workers reach each other off the shaped link), the hosts' links shaped to RATE; the
# cnn on Fashion-MNIST, Adam (lr 0.001), STEPS steps, ten configurations alternated over ROUNDS rounds: plain
# bsp, zero 3, zero 3 with hpZ, with int8 gathers, with both, with int8 gradients alone, with all three, and zero 3
# sharded within each host (--zero-shard-group 2, FSDP's HYBRID_SHARD: only each slice's gradient allreduce crosses
# hosts); then zero 2, and zero 2 sharded within each host (--zero-shard-group node, resolved from the emulated hosts:
# FSDP's _HYBRID_SHARD_ZERO2). The table gives the median training wall time over the rounds, rank 0's exposed communication (median), the bytes on the wire and the test accuracy of the last
# round, and the bytes that crossed the shaped links (both hosts' eth0 transmit counters, read with `ip -s` around
# each run; the workers' own counts include the traffic inside a host). Needs root (network namespaces, tc).
#   sudo [TIME_LIMIT=seconds] bash bench/zero/hpz_cluster.sh [RATE] [STEPS] [ROUNDS] [OUT_DIR]
# (TIME_LIMIT: what each run may take, its cluster run --timeout; default 3600)
set -euo pipefail
# (a CONDUIT given relative to the caller's directory, before the cd to the repository root)
if [ -n "${CONDUIT:-}" ]; then CONDUIT=$(realpath "$CONDUIT"); fi
cd "$(dirname "$0")/../.."
RATE=${1:-200mbit}
STEPS=${2:-60}
ROUNDS=${3:-2}
CONDUIT=$(realpath "${CONDUIT:-build/bin/conduit}")
TIME_LIMIT=${TIME_LIMIT:-3600}
NAME=hpz$$
source bench/alternate_rounds.sh
bench_out_dir "${4:-}" runs/hpz-bench
# (the clean-up first: an up that fails part-way leaves namespaces that only a down removes)
trap '"$CONDUIT" cluster down --name "$NAME" > /dev/null 2>&1 || true' EXIT
"$CONDUIT" cluster up -q --name "$NAME" --hosts 2 --bandwidth "$RATE"
tx() {  # bytes both hosts have sent on their shaped links
  local total=0 h
  for h in 0 1; do
    total=$((total + $(ip -s -j -n "conduit-$NAME-h$h" link show eth0 | /usr/bin/python3 -c \
      'import json, sys; print(json.load(sys.stdin)[0]["stats64"]["tx"]["bytes"])')))
  done
  echo "$total"
}
run() {  # configuration round
  local dir="$OUT/$1-r$2" extra="" comp=none before
  case $1 in
    z3) extra="--zero 3" ;;
    z3h) extra="--zero 3 --zero-hpz 2" ;;
    z3q) extra="--zero 3 --zero-gather int8" ;;
    z3qh) extra="--zero 3 --zero-gather int8 --zero-hpz 2" ;;
    z3g) extra="--zero 3" comp=int8 ;;
    z3all) extra="--zero 3 --zero-gather int8 --zero-hpz 2" comp=int8 ;;
    z3s) extra="--zero 3 --zero-shard-group 2" ;;
    z2) extra="--zero 2" ;;
    z2s) extra="--zero 2 --zero-shard-group node" ;;
  esac
  before=$(tx)
  # shellcheck disable=SC2086  # extra is words
  "$CONDUIT" cluster run --name "$NAME" --ranks-per-host 2 --timeout "$TIME_LIMIT" -- "$CONDUIT" train --model cnn --optimizer adam \
    --lr 0.001 --compressor "$comp" $extra --max-steps "$STEPS" --progress false --output "$dir" > "$dir.log" 2>&1
  echo $(($(tx) - before)) > "$dir.cross"
}
alternate_rounds "$ROUNDS" run plain z3 z3h z3q z3qh z3g z3all z3s z2 z2s
/usr/bin/python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
names = {"plain": "plain bsp", "z3": "--zero 3", "z3h": "--zero 3 --zero-hpz 2", "z3q": "--zero 3 --zero-gather int8",
         "z3qh": "--zero 3 --zero-gather int8 --zero-hpz 2", "z3g": "--zero 3 --compressor int8",
         "z3all": "--zero 3 --zero-gather int8 --zero-hpz 2 --compressor int8",
         "z3s": "--zero 3 --zero-shard-group 2", "z2": "--zero 2", "z2s": "--zero 2 --zero-shard-group node"}
base = None
print(f"{'run':<60}{'wall s':>8}{'(rounds)':>16}{'x plain':>8}{'exposed s':>10}{'MB on wire':>12}"
      f"{'MB across':>11}{'accuracy':>10}")
for key, label in names.items():
    ss = [json.load(open(os.path.join(out, f"{key}-r{r}", "summary.json"))) for r in range(1, rounds + 1)]
    walls = [s["wall_time_s"] for s in ss]
    wall = statistics.median(walls)
    base = base or wall
    exposed = statistics.median(s["exposed_comm_s"] for s in ss)
    s = ss[-1]
    across = int(open(os.path.join(out, f"{key}-r{rounds}.cross")).read())
    print(f"{label:<60}{wall:>8.1f}{'/'.join(f'{w:.1f}' for w in walls):>16}{wall / base:>8.2f}{exposed:>10.2f}"
          f"{s['bytes_on_wire'] / 1e6:>12.1f}{across / 1e6:>11.1f}{100 * s['final_test_accuracy']:>9.2f}%")
PY
