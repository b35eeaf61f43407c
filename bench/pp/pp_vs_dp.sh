#!/bin/bash
# Pipeline parallelism in `conduit train` (--pp 2 and --pp 4: the vit's 4 blocks cut into stages, MICRO micro-batches
# a batch, under gpipe, 1f1b and (pp 2) interleaved, and gpipe with --recompute) against data parallelism alone; with
# MODEL=cnn or resnet in the environment that model, cut between its layers or blocks (no interleaved rows); 4 local workers on the
# same global batch (64 a data-parallel rank x 4 = 256 samples a step with pp 1; with pp 2 each pipeline of 2 takes
# 128, pp 4 one pipeline takes 256), Adam (lr 0.002), EPOCHS epochs, ROUNDS rounds in alternating order. The table
# gives the median training time (wall_time_s: evaluations left out) with every round's, and the last round's
# accuracy, bytes on the wire (the gradients' allreduce and the activations and their gradients between stages),
# exposed communication (rank 0's waits on other stages count: transfers and the bubble), the most micro-batches rank
# 0 held at once for their backward (interleaved: micro-batch chunks), rank 0's largest resident set (the process: libtorch, data, model and
# activations) and the ideal bubble (p - 1) / m (interleaved: / v) of an idle-free schedule, for reference.
#   [MODEL=vit|cnn|resnet] [TIME_LIMIT=seconds] bash bench/pp/pp_vs_dp.sh [EPOCHS] [ROUNDS] [MICRO] [OUT_DIR]
# (TIME_LIMIT: what each conduit train run may take, its --time-limit-s; default 3600)
set -euo pipefail
# (a CONDUIT given relative to the caller's directory, before the cd to the repository root)
if [ -n "${CONDUIT:-}" ]; then CONDUIT=$(realpath "$CONDUIT"); fi
cd "$(dirname "$0")/../.."
EPOCHS=${1:-1}
ROUNDS=${2:-2}
MICRO=${3:-8}
CONDUIT=${CONDUIT:-build/bin/conduit}
TIME_LIMIT=${TIME_LIMIT:-3600}
MODEL=${MODEL:-vit}
source bench/alternate_rounds.sh
bench_out_dir "${4:-}" runs/pp-bench
run() {  # pp batch micro-batches schedule recompute round
  local name="pp$1-$4-$5-r$6"
  local sched=()
  [ "$1" -gt 1 ] && sched=(--pp-schedule "$4" --recompute "$5")
  "$CONDUIT" train --model "$MODEL" --workers 4 --pp "$1" --batch-size "$2" --micro-batches "$3" \
    "${sched[@]}" --optimizer adam --lr 0.002 --compressor none \
    --epochs "$EPOCHS" --progress false --time-limit-s "$TIME_LIMIT" --output "$OUT/$name" > "$OUT/$name.log" 2>&1
}
configs=("1 64 1 1f1b false" "2 128 $MICRO 1f1b false" "2 128 $MICRO gpipe false")
[ "$MODEL" = vit ] && configs+=("2 128 $MICRO interleaved false")
configs+=("4 256 $MICRO 1f1b false" "4 256 $MICRO gpipe false" "4 256 $MICRO gpipe true")
alternate_rounds "$ROUNDS" run "${configs[@]}"
/usr/bin/python3 - "$OUT" "$ROUNDS" "$MODEL" <<'PY'
import json, os, statistics, sys
out, rounds, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print(f"{'run':<24}{'accuracy':>10}{'wall s':>9}{'(rounds)':>16}{'x pp 1':>8}{'MB on wire':>12}{'x pp 1':>8}"
      f"{'exposed s':>11}{'peak mb':>9}{'RSS MB':>8}{'(p-1)/m':>9}")
base = None
for pp, sched, rc in ((1, "1f1b", "false"), (2, "1f1b", "false"), (2, "gpipe", "false"), (2, "interleaved", "false"),
                      (4, "1f1b", "false"), (4, "gpipe", "false"), (4, "gpipe", "true")):
    if sched == "interleaved" and model != "vit":
        continue
    ss = [json.load(open(os.path.join(out, f"pp{pp}-{sched}-{rc}-r{r}", "summary.json")))
          for r in range(1, rounds + 1)]
    each = [s["wall_time_s"] for s in ss]
    wall = statistics.median(each)
    s = ss[-1]
    mb = s["bytes_on_wire"] / 1e6
    if base is None:
        base = (wall, mb)
    name = "pp 1" if pp == 1 else f"pp {pp} {sched}" + (" recompute" if rc == "true" else "")
    peak = s["pipeline_peak_micro_batches_rank0"]
    bubble = (pp - 1) / s["micro_batches"] / (4 // pp if sched == "interleaved" else 1)
    print(f"{name:<24}{100 * s['final_test_accuracy']:>9.2f}%{wall:>9.1f}"
          f"{' ' + '/'.join(f'{w:.1f}' for w in each):>16}{wall / base[0]:>8.2f}"
          f"{mb:>12.1f}{mb / base[1]:>8.2f}{s['exposed_comm_s']:>11.1f}{peak if peak is not None else '-':>9}"
          f"{s['max_rss_mb_rank0']:>8.0f}{bubble:>9.2f}")
PY
