# shellcheck shell=bash
# Sourced by the bench scripts: alternate_rounds ROUNDS FUNCTION CONFIG... calls FUNCTION CONFIG-words ROUND for every
# configuration, ROUNDS times, each round in the previous one's order reversed (no configuration always runs first
# on a machine whose speed drifts).
alternate_rounds() {
  local rounds=$1 fn=$2
  shift 2
  local order=("$@") reversed i r cfg
  for r in $(seq 1 "$rounds"); do
    for cfg in "${order[@]}"; do
      # shellcheck disable=SC2086  # a configuration is words
      "$fn" $cfg "$r"
      echo "round $r: $cfg done" >&2
    done
    reversed=()
    for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[i]}"); done
    order=("${reversed[@]}")
  done
}

# bench_out_dir GIVEN DEFAULT: sets OUT to the run's folder, emptied and marked: GIVEN (a path from the caller's
# directory, where the script was started) or else DEFAULT (from the repository root, the current directory). A folder
# holding anything a bench run did not write is refused, not emptied (a mistyped OUT_DIR must not cost anyone their
# files): every run's folder carries a .conduit-bench marker.
bench_out_dir() {
  if [ -n "$1" ]; then OUT=$(cd "$OLDPWD" && realpath -m -- "$1"); else OUT=$(realpath -m -- "$2"); fi
  if [ -e "$OUT" ] && [ ! -e "$OUT/.conduit-bench" ] && { [ ! -d "$OUT" ] || [ -n "$(ls -A "$OUT")" ]; }; then
    echo "$(basename "$0"): OUT_DIR $OUT holds files no marked bench run wrote (runs before 2026-12-06 carry no .conduit-bench marker); allowed: a new or empty folder, or a marked earlier run's: remove it, or name another" >&2
    exit 2
  fi
  rm -rf "$OUT"
  mkdir -p "$OUT"
  touch "$OUT/.conduit-bench"
}
