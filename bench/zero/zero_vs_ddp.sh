#!/bin/bash
# ZeRO in `conduit train` (--zero 1, 2 and 3, each with --zero-prefetch false: "zero 1n", "2n", "3n", and 3 with
# --zero-gather bf16: "zero 3b", and int8: "zero 3q") against plain bsp, and PyTorch's ZeroRedundancyOptimizer over DDP
# (bench/peers/ddp_train.py --zero) against plain DDP: the CNN on Fashion-MNIST, 4 local workers, Adam (lr 0.001),
# EPOCHS epochs. ROUNDS rounds run the eleven configurations one after the other (each round in the order the
# previous one ended with reversed, so no configuration always runs first); the table gives the median training
# wall time over the rounds, the test accuracy, bytes on the wire, rank 0's optimizer state and (Conduit) the
# trainable parameters rank 0 held between steps, of the last round.
# Conduit counts the bytes its collectives move (docs/training.md); the DDP peer reads the loopback interface's
# counter (all ranks' traffic, with TCP/IP headers and anything else on lo), so compare each implementation's ZeRO
# with its own plain run. Both bind their 4 workers as `conduit train` does (worker k on CPU k mod C; the DDP peer
# ran unbound before 2026-12-05, and summed every rank's reading of the one lo counter: 4x the bytes).
#   [TIME_LIMIT=seconds] bash bench/zero/zero_vs_ddp.sh [EPOCHS] [ROUNDS] [OUT_DIR]
# (TIME_LIMIT: what each conduit train run may take, its --time-limit-s; default 3600)
set -euo pipefail
# (a CONDUIT given relative to the caller's directory, before the cd to the repository root)
if [ -n "${CONDUIT:-}" ]; then CONDUIT=$(realpath "$CONDUIT"); fi
cd "$(dirname "$0")/../.."
EPOCHS=${1:-1}
ROUNDS=${2:-3}
CONDUIT=${CONDUIT:-build/bin/conduit}
TIME_LIMIT=${TIME_LIMIT:-3600}
LR=0.001
source bench/alternate_rounds.sh
bench_out_dir "${3:-}" runs/zero-bench
run() {  # impl zero round
  local dir="$OUT/$1-zero$2-r$3"
  if [ "$1" = conduit ]; then
    local zero="--zero $2"
    [ "${2: -1}" = n ] && zero="--zero ${2%n} --zero-prefetch false"
    [ "$2" = 3b ] && zero="--zero 3 --zero-gather bf16"
    [ "$2" = 3q ] && zero="--zero 3 --zero-gather int8"
    # shellcheck disable=SC2086  # ($zero is several words on purpose)
    "$CONDUIT" train --model cnn --workers 4 --optimizer adam --lr "$LR" --compressor none $zero \
      --epochs "$EPOCHS" --progress false --time-limit-s "$TIME_LIMIT" --output "$dir" > "$dir.log" 2>&1
  else
    local flag=""
    [ "$2" = 1 ] && flag="--zero"
    # shellcheck disable=SC2086  # (an empty $flag is no word)
    /usr/bin/python3 bench/peers/ddp_train.py -n 4 --model cnn --optimizer adam --lr "$LR" --epochs "$EPOCHS" \
      $flag --output "$dir" > "$dir.log" 2>&1
  fi
}
alternate_rounds "$ROUNDS" run "conduit 0" "conduit 1" "conduit 1n" "conduit 2" "conduit 2n" "conduit 3" "conduit 3n" \
  "conduit 3b" "conduit 3q" "ddp 0" "ddp 1"
/usr/bin/python3 - "$OUT" "$ROUNDS" <<'PY'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = [("conduit", 0), ("conduit", 1), ("conduit", "1n"), ("conduit", 2), ("conduit", "2n"), ("conduit", 3),
        ("conduit", "3n"), ("conduit", "3b"), ("conduit", "3q"), ("ddp", 0), ("ddp", 1)]
walls = {}
# Ratios against the same implementation's plain run (x own), and times against Conduit's plain run (x conduit 0).
print(f"{'run':<16}{'accuracy':>10}{'wall s':>9}{'(rounds)':>20}{'x own':>7}{'x conduit 0':>12}{'MB on wire':>12}"
      f"{'x own':>7}{'opt state KB':>14}{'x own':>7}{'params KB':>11}{'exposed s':>10}")
base = {}
for impl, z in rows:
    ss = [json.load(open(os.path.join(out, f"{impl}-zero{z}-r{r}", "summary.json"))) for r in range(1, rounds + 1)]
    s = ss[-1]
    each = [x["wall_time_s"] for x in ss]
    wall = statistics.median(each)
    walls[(impl, z)] = wall
    mb, st = s["bytes_on_wire"] / 1e6, s["optimizer_state_bytes_rank0"] / 1e3
    base.setdefault(impl, (wall, mb, st))
    held = f"{s['parameter_bytes_held_rank0'] / 1e3:.1f}" if impl == "conduit" else "-"
    # (rank 0's communication that blocked its training thread, median over the rounds)
    exposed = f"{statistics.median(x['exposed_comm_s'] for x in ss):.2f}" if impl == "conduit" else "-"
    print(f"{impl + ' zero ' + str(z):<16}{100 * s['final_test_accuracy']:>9.2f}%{wall:>9.1f}"
          f"{' ' + '/'.join(f'{w:.1f}' for w in each):>20}{wall / base[impl][0]:>7.2f}"
          f"{wall / walls[('conduit', 0)]:>12.2f}{mb:>12.1f}{mb / base[impl][1]:>7.2f}{st:>14.1f}"
          f"{st / base[impl][2]:>7.2f}{held:>11}{exposed:>10}")
PY
