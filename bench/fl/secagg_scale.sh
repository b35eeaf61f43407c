#!/bin/bash
# Secure aggregation's cost at 100 clients a round: none, every pair (Bonawitz et al.) and SecAgg+ with k = 16
# neighbours (Bell et al.), one command, the same seed and dropouts. Local work is kept small (12000 training images
# over 200 clients, one epoch) so the protocol's share of the round shows. ROUNDS rounds run the three configurations
# one after the other, each round in the previous one's order reversed (no configuration always runs first); the
# table gives each one's median wall time with every round's, the overhead (median wall time over the run without
# it, and the median of the per-round differences), and the last round's accuracy and bytes. ROUNDS repeats the
# whole comparison (each `conduit fl` run trains its own 3 federated rounds).
#   bash bench/fl/secagg_scale.sh [OUT_DIR] [K] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
source bench/alternate_rounds.sh
k=${2:-16}
rounds=${3:-3}
# (as conduit fl: SecAgg+'s k/2 neighbours on each side of the ring of a round's 100 clients; an odd or larger K
# failed in the first run's log)
if ! [[ $k =~ ^[1-9][0-9]*$ ]] || ((k % 2 != 0 || k > 98)); then
  echo "secagg_scale.sh: K '$k'; allowed: an even number of neighbours from 2 to 98 (100 clients a round)" >&2
  exit 2
fi
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "secagg_scale.sh: ROUNDS '$rounds'; allowed: 1 or more" >&2; exit 2; }
conduit=build/bin/conduit
[ -x "$conduit" ] || { echo "secagg_scale.sh: $conduit is missing; build first (cmake --build build)" >&2; exit 2; }
bench_out_dir "${1:-}" /tmp/conduit-secagg-scale  # (after the checks: a typo does not cost the last run's results)
common=(--clients 200 --fraction 0.5 --rounds 3 --train-limit 12000 --dropout 0.05 --seed 42)
declare -a names=("none" "every pair" "SecAgg+ k=$k")
declare -a flags=("--secagg false" "--secagg true --secagg-neighbors 0" "--secagg true --secagg-neighbors $k")
run() {  # configuration round
  local dir="$OUT/run$1-r$2"
  # shellcheck disable=SC2086
  "$conduit" fl "${common[@]}" ${flags[$1]} --output "$dir" > "$dir.log" 2>&1 ||
    { echo "secagg_scale.sh: run '${names[$1]}' (round $2) failed; see $dir.log" >&2; exit 1; }
}
alternate_rounds "$rounds" run 0 1 2
/usr/bin/python3 - "$OUT" "$rounds" "${names[@]}" <<'PY'
import json, statistics, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = [[json.load(open(f"{out}/run{i}-r{r}/summary.json")) for r in range(1, rounds + 1)] for i in range(3)]
walls = [[r["wall_time_s"] for r in rs] for rs in runs]
base = statistics.median(walls[0])
print(f"medians of {rounds} rounds (the ratio to the run without secure aggregation in brackets); accuracy and MB: the last round's")
print("| secure aggregation | wall s (x none) | rounds' wall s | overhead s (median of rounds') | test accuracy | MB down | MB up |")
print("|---|---|---|---|---|---|---|")
for name, rs, w in zip(names, runs, walls):
    m = statistics.median(w)
    over = statistics.median([a - b for a, b in zip(w, walls[0])])
    last = rs[-1]
    print(f"| {name} | {m:.1f} ({m / base:.2f}) | {', '.join(f'{x:.1f}' for x in w)} | {over:+.1f} "
          f"| {100 * last['final_test_accuracy']:.2f}% | {last['bytes_down'] / 1e6:.1f} | {last['bytes_up'] / 1e6:.1f} |")
PY
