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
