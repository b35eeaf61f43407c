#!/bin/bash
# The cluster scheduler's own speed on an overloaded trace: `sim cluster`'s model time (the JSON's
# simulation_wall_s) under fifo, las and srtf, for one binary or two alternated in one run (a change against the
# binary before it; the VM's speed drifts, so only figures from the same run compare). With two binaries it also
# checks that they schedule alike: their JSON, less simulation_wall_s, must match byte for byte.
#   bench/sim/sched_speed.sh NEW [OLD] [ROUNDS] [JOBS]     e.g. bench/sim/sched_speed.sh build/bin/conduit /tmp/old 1
# The trace: JOBS (20,000) gpt2-small jobs of 1, 2, 4, 8 or 16 GPUs and 100 to 5,000 iterations, one every 0.5 s
# (seed 1), on 64 dgx-a100 accelerators: a backlog of thousands of jobs. Prints one line per run and, per
# scheduler, the median of each binary and OLD's over NEW's.
set -euo pipefail
new=${1:?usage: sched_speed.sh NEW_BINARY [OLD_BINARY] [ROUNDS] [JOBS]}
old=${2:-}
rounds=${3:-1}
njobs=${4:-20000}
for b in "$new" ${old:+"$old"}; do
  if [[ ! -x "$b" ]]; then
    echo "sched_speed.sh: '$b' is not an executable conduit binary" >&2
    exit 2
  fi
done
for v in "$rounds" "$njobs"; do
  if [[ ! "$v" =~ ^[1-9][0-9]*$ ]]; then
    echo "sched_speed.sh: ROUNDS and JOBS must be whole numbers from 1 (got '$v')" >&2
    exit 2
  fi
done
# shellcheck source-path=SCRIPTDIR source=../alternate_rounds.sh
source "$(dirname "$0")/../alternate_rounds.sh"
out=$(mktemp)
trap 'rm -f "$out" "$out".*' EXIT
/usr/bin/python3 - "$njobs" >"$out.csv" <<'PY'
import random, sys
r = random.Random(1)
print("id,submit_s,gpus,model,iterations")
for i in range(int(sys.argv[1])):
    print(f"j{i},{0.5 * i:g},{r.choice([1, 2, 4, 8, 16])},gpt2-small,{r.randint(100, 5000)}")
PY
# shellcheck disable=SC2317  # (alternate_rounds calls it)
run() {  # new|old SCHEDULER ROUND
  local who=$1 s=$2 b=$new
  [[ $who == old ]] && b=$old
  if ! "$b" sim cluster --cluster dgx-a100 --gpus 64 --jobs "$out.csv" --scheduler "$s" --json >"$out.json"; then
    echo "sched_speed.sh: the $who binary's $s run failed" >&2
    return 1
  fi
  sed 's/"simulation_wall_s":[^,}]*//' "$out.json" >"$out.$who.$s"
  /usr/bin/python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], round(d["simulation_wall_s"], 3), sep="\t")' "$out.json" "$who" "$s" | tee -a "$out"
}
configs=()
for s in fifo las srtf; do
  configs+=("new $s")
  if [[ -n "$old" ]]; then configs+=("old $s"); fi
done
alternate_rounds "$rounds" run "${configs[@]}"
echo
status=0
if [[ -n "$old" ]]; then
  for s in fifo las srtf; do
    if ! cmp -s "$out.new.$s" "$out.old.$s"; then
      echo "sched_speed.sh: $s: the two binaries' schedules differ" >&2
      status=1
    fi
  done
  ((status == 0)) && echo "schedules: identical JSON (less simulation_wall_s) under fifo, las and srtf"
fi
/usr/bin/python3 - "$out" <<'PY'
import statistics, sys
s = {}
for line in open(sys.argv[1]):
    who, key, t = line.rstrip("\n").split("\t")
    s.setdefault(key, {}).setdefault(who, []).append(float(t))
print("scheduler\tnew s (median)\told s (median)\told / new")
for key, by in s.items():
    n = statistics.median(by["new"])
    o = statistics.median(by["old"]) if "old" in by else None
    print(f"{key}\t{n:.3f}\t" + (f"{o:.3f}\t{o / n:.1f}" if o is not None else "-\t-"))
PY
exit "$status"
