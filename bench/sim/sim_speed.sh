#!/bin/bash
# The simulator's own speed at scale: model time of `sim step` (the JSON's simulation_wall_s) and search time of
# `sim plan` (search_s), for one binary or two alternated in one run (a change against the binary before it; the VM's
# speed drifts, so only figures from the same run compare).
#   bench/sim/sim_speed.sh NEW [OLD] [ROUNDS]     e.g. bench/sim/sim_speed.sh build/bin/conduit /tmp/conduit_old 3
# Prints one line per run and, per case, the median of each binary and OLD's over NEW's.
set -euo pipefail
new=${1:?usage: sim_speed.sh NEW_BINARY [OLD_BINARY] [ROUNDS]}
old=${2:-}
rounds=${3:-3}
for b in "$new" ${old:+"$old"}; do
  if [[ ! -x "$b" ]]; then
    echo "sim_speed.sh: '$b' is not an executable conduit binary" >&2
    exit 2
  fi
done
if [[ ! "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "sim_speed.sh: ROUNDS = '$rounds' (allowed: a whole number from 1)" >&2
  exit 2
fi
# shellcheck source-path=SCRIPTDIR source=../alternate_rounds.sh
source "$(dirname "$0")/../alternate_rounds.sh"
out=$(mktemp)
trap 'rm -f "$out" "$out.json"' EXIT

# A case: step GPUS TP PP BATCH (GPT-3 175B on dgx-h100, selective recompute, sequence parallel: docs/sim.md §11's
# rows) or plan CLUSTER GPUS MODEL BATCH.
cases=("step 8192 8 4 8192" "step 100000 8 4 12500" "step 131072 8 8 131072"
  "plan dgx-a100 1536 gpt3-175b 1536" "plan dgx-a100 65536 gpt-1t 4096" "plan dgx-a100 131072 gpt-1t 4096"
  "plan dgx-a100 262144 gpt-1t 4096" "plan dgx-h100 262144 gpt-1t 4096")
run() {  # new|old CASE-WORDS... ROUND
  local who=$1 kind=$2 b=$new key field rc=0
  [[ $who == old ]] && b=$old
  if [[ $kind == step ]]; then
    key="step dgx-h100 $3 gpt3-175b t$4 p$5"
    field=simulation_wall_s
    # (exit 0 whether or not it fits: "fits" says)
    "$b" sim step --cluster dgx-h100 --gpus "$3" --model gpt3-175b --global-batch "$6" --tp "$4" --pp "$5" \
      --recompute selective --sp --json >"$out.json" || rc=$?
  else
    key="plan $3 $4 $5"
    field=search_s
    # (exit 1 with its JSON written: no plan fits)
    "$b" sim plan --cluster "$3" --gpus "$4" --model "$5" --global-batch "$6" --json >"$out.json" || rc=$?
    if ((rc == 1)) && [[ -s "$out.json" ]]; then rc=0; fi
  fi
  if ((rc != 0)); then  # (any other failure stops the script, naming the case)
    echo "sim_speed.sh: the $who binary's $key exited $rc" >&2
    return "$rc"
  fi
  /usr/bin/python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], round(1e3 * d[sys.argv[4]], 1), d.get("candidates", ""), sep="\t")' \
    "$out.json" "$who" "$key" "$field" | tee -a "$out"
}
configs=()
for c in "${cases[@]}"; do
  configs+=("new $c")
  if [[ -n "$old" ]]; then configs+=("old $c"); fi
done
alternate_rounds "$rounds" run "${configs[@]}"
echo
/usr/bin/python3 - "$out" <<'PY'
import statistics, sys
ms = {}
for line in open(sys.argv[1]):
    who, key, t, _ = line.rstrip("\n").split("\t")
    ms.setdefault(key, {}).setdefault(who, []).append(float(t))
print("case\tnew ms (median)\told ms (median)\told / new")
for key, by in ms.items():
    n = statistics.median(by["new"])
    o = statistics.median(by["old"]) if "old" in by else None
    print(f"{key}\t{n:.1f}\t" + (f"{o:.1f}\t{o / n:.2f}" if o is not None else "-\t-"))
PY
