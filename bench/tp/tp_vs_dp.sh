#!/bin/bash
# Tensor parallelism in `conduit train` (--tp 2 and --tp 4: the vit's heads and MLP split over each group) against
# data parallelism alone, 4 local workers on the same global batch (64 a data-parallel rank x 4 ranks = 256
# samples a step with tp 1; with tp 2 each group of 2 takes 128, tp 4 one group takes 256), Adam (lr 0.002), EPOCHS
# epochs, ROUNDS rounds in alternating order; the table gives the median training time (wall_time_s: evaluations
# left out) with every round's, and the last round's accuracy, bytes on the wire (the gradients' allreduce and the
# groups' activation allreduces, ring-equivalent volumes), exposed communication and rank 0's largest resident set.
# --tp 2 and 4 also run with --sequence-parallel (each rank holds its share of the tokens between the split layers).
#   [TIME_LIMIT=seconds] bash bench/tp/tp_vs_dp.sh [EPOCHS] [ROUNDS] [OUT_DIR]
# (TIME_LIMIT: what each conduit train run may take, its --time-limit-s; default 3600)
set -euo pipefail
# (a CONDUIT given relative to the caller's directory, before the cd to the repository root)
if [ -n "${CONDUIT:-}" ]; then CONDUIT=$(realpath "$CONDUIT"); fi
cd "$(dirname "$0")/../.."
EPOCHS=${1:-1}
ROUNDS=${2:-3}
CONDUIT=${CONDUIT:-build/bin/conduit}
TIME_LIMIT=${TIME_LIMIT:-3600}
source bench/alternate_rounds.sh
bench_out_dir "${3:-}" runs/tp-bench
run() {  # tp batch sequence_parallel round
  "$CONDUIT" train --model vit --workers 4 --tp "$1" --batch-size "$2" --sequence-parallel "$3" --optimizer adam \
    --lr 0.002 --compressor none --epochs "$EPOCHS" --progress false --time-limit-s "$TIME_LIMIT" \
    --output "$OUT/tp$1-sp$3-r$4" \
    > "$OUT/tp$1-sp$3-r$4.log" 2>&1
}
alternate_rounds "$ROUNDS" run "1 64 false" "2 128 false" "4 256 false" "2 128 true" "4 256 true"
/usr/bin/python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'run':<10}{'accuracy':>10}{'wall s':>9}{'(rounds)':>16}{'x tp 1':>8}{'MB on wire':>12}{'x tp 1':>8}"
      f"{'exposed comm s':>16}{'RSS MB':>8}")
base = None
for tp, sp in ((1, "false"), (2, "false"), (4, "false"), (2, "true"), (4, "true")):
    ss = [json.load(open(os.path.join(out, f"tp{tp}-sp{sp}-r{r}", "summary.json"))) for r in range(1, rounds + 1)]
    each = [s["wall_time_s"] for s in ss]
    wall = statistics.median(each)
    s = ss[-1]
    mb = s["bytes_on_wire"] / 1e6
    if base is None:
        base = (wall, mb)
    name = f"tp {tp}" + (" sp" if sp == "true" else "")
    print(f"{name:<10}{100 * s['final_test_accuracy']:>9.2f}%{wall:>9.1f}"
          f"{' ' + '/'.join(f'{w:.1f}' for w in each):>16}{wall / base[0]:>8.2f}"
          f"{mb:>12.1f}{mb / base[1]:>8.1f}{s['exposed_comm_s']:>16.1f}{s['max_rss_mb_rank0']:>8.0f}")
PY
