#!/bin/bash
# Secure aggregation's cost at 100 clients a round: none, every pair (Bonawitz et al.) and SecAgg+ with k = 16
# neighbours (Bell et al.), one command, the same seed and dropouts. Local work is kept small (12000 training images
# over 200 clients, one epoch) so the protocol's share of the round shows. Prints each run's wall time, accuracy and
# bytes, and the secure-aggregation overhead (wall time over the run without it).
#   bash bench/fl/secagg_scale.sh [OUT_DIR] [K]
set -euo pipefail
out=$(realpath -m "${1:-/tmp/conduit-secagg-scale}")
k=${2:-16}
cd "$(dirname "$0")/../.."
conduit=build/bin/conduit
[ -x "$conduit" ] || { echo "secagg_scale.sh: $conduit is missing; build first (cmake --build build)" >&2; exit 2; }
mkdir -p "$out"
common=(--clients 200 --fraction 0.5 --rounds 3 --train-limit 12000 --dropout 0.05 --seed 42)
declare -a names=("none" "every pair" "SecAgg+ k=$k")
declare -a flags=("--secagg false" "--secagg true --secagg-neighbors 0" "--secagg true --secagg-neighbors $k")
for i in 0 1 2; do
  rm -rf "$out/run$i"  # (conduit fl refuses a folder holding an earlier run)
  # shellcheck disable=SC2086
  "$conduit" fl "${common[@]}" ${flags[$i]} --output "$out/run$i" > "$out/run$i.log" 2>&1 ||
    { echo "secagg_scale.sh: run '${names[$i]}' failed; see $out/run$i.log" >&2; exit 1; }
done
/usr/bin/python3 - "$out" "${names[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
runs = [json.load(open(f"{out}/run{i}/summary.json")) for i in range(3)]
base = runs[0]["wall_time_s"]
print("| secure aggregation | wall s (x none) | overhead s | test accuracy | MB down | MB up |")
print("|---|---|---|---|---|---|")
for name, r in zip(names, runs):
    w = r["wall_time_s"]
    print(f"| {name} | {w:.1f} ({w / base:.2f}) | {w - base:+.1f} | {100 * r['final_test_accuracy']:.2f}% "
          f"| {r['bytes_down'] / 1e6:.1f} | {r['bytes_up'] / 1e6:.1f} |")
PY
