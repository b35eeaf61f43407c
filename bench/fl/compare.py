#!/usr/bin/python3
"""Federated-learning benchmark (`conduit fl`): the CNN on Fashion-MNIST, 100 clients, 10 a round.

Runs `conduit fl` once per configuration with the same model, data, seed, sampling and local settings, and prints a
markdown table of the final test accuracy (and its mean over the last 5 rounds: one round's accuracy moves by a point
or two on a non-IID split), wall time, modelled round time on the client links, bytes uploaded, and
each as a ratio to the baseline row of the same command (by default the first: FedAvg on the same non-IID partition
without secure aggregation).

  /usr/bin/python3 bench/fl/compare.py [--conduit build/bin/conduit] [--out runs/fl-compare] [--rounds 20] [--timeout 3600]
                                       [--only 'NAME;NAME'] [--seeds 42,43,44] [--baseline NAME] [--reuse]

With several seeds (each changes the partition, the sampling and the initial weights), every row runs once per seed
and the table gives the mean and sample standard deviation over the seeds, and each row's paired difference to the
baseline row (per seed, then mean and standard deviation): a difference smaller than its spread is not a result; a
second table gives every seed's figures. --baseline names the row the others are compared with (default: the first;
it always runs). --reuse takes the runs already in --out (their summary.json) instead of running them again, to
tabulate one set of runs against another baseline.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from peer_procs import run_with_deadline, timeout_arg  # noqa: E402

CONFIGS = [
    ("fedavg, dirichlet:0.5", ["--secagg", "false"]),
    ("fedavg, iid", ["--secagg", "false", "--partition", "iid"]),
    ("fedavg + secagg 32-bit", []),
    ("fedavg + secagg 16-bit", ["--secagg-bits", "16"]),
    ("fedavg + secagg, stragglers dropped", ["--speed-sigma", "1", "--deadline", "1"]),
    ("fedavg, stragglers dropped", ["--secagg", "false", "--speed-sigma", "1", "--deadline", "1"]),
    ("fedprox + secagg, partial work", ["--speed-sigma", "1", "--deadline", "1", "--stragglers", "partial",
                                        "--mu", "0.01"]),
    ("fedavg + secagg, 20% dropouts", ["--dropout", "0.2"]),
    ("scaffold, dirichlet:0.5", ["--secagg", "false", "--scaffold", "true"]),
    ("scaffold + secagg 32-bit", ["--scaffold", "true"]),
    ("fedavg, dirichlet:0.1", ["--secagg", "false", "--partition", "dirichlet:0.1"]),
    ("scaffold, dirichlet:0.1", ["--secagg", "false", "--scaffold", "true", "--partition", "dirichlet:0.1"]),
]


def mean_sd(xs):
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return m, sd


def run_one(a, i, seed):
    """One run of row i with `seed` (or its --reuse): its summary (with the last 5 rounds' mean accuracy), and the
    clients aggregated and sampled over its rounds."""
    name, flags = CONFIGS[i]
    out = os.path.join(a.out, f"{i}-seed{seed}")
    cmd = [a.conduit, "fl", "--rounds", str(a.rounds), "--progress", "false", "--seed", str(seed), "--output",
           out] + flags
    settings = " ".join(cmd[2:])  # (the binary may move between a run and its --reuse)
    if a.reuse:
        try:
            with open(os.path.join(out, "command.txt")) as f:
                ran = f.read().strip()
        except OSError:
            sys.exit(f"fl compare: --reuse: '{out}' holds no run of '{name}' (seed {seed}); allowed: the --out "
                     "of an earlier run of this script with these rows, rounds and seeds")
        if ran != settings:
            sys.exit(f"fl compare: --reuse: '{out}' ran 'fl {ran}', not 'fl {settings}'")
    else:
        shutil.rmtree(out, ignore_errors=True)
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        try:
            r = run_with_deadline(cmd, a.timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:  # (a hang outside the run's own deadlines waited forever)
            sys.exit(f"fl compare: '{name}' (seed {seed}) ran past --timeout {a.timeout} s")
        if r.returncode != 0:
            sys.exit(f"fl compare: '{name}' (seed {seed}) failed ({r.returncode}):\n{r.stdout[-2000:]}")
        with open(os.path.join(out, "command.txt"), "w") as f:
            f.write(settings + "\n")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    agg = sampled = 0
    accs = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            agg += m["aggregated"]
            sampled += m["sampled"]
            if m["test_accuracy"] is not None:
                accs.append(m["test_accuracy"])
    s["last5"] = sum(accs[-5:]) / len(accs[-5:]) if accs else float("nan")
    return s, agg, sampled


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conduit", default="build/bin/conduit")
    ap.add_argument("--out", default="runs/fl-compare")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", default="", help="';'-separated row names (the baseline row is always run)")
    ap.add_argument("--seeds", default="42", help="','-separated seeds (each row runs once per seed)")
    ap.add_argument("--baseline", default=CONFIGS[0][0], help="the row the others are compared with")
    ap.add_argument("--reuse", action="store_true", help="take the runs already in --out instead of running them")
    ap.add_argument("--timeout", type=timeout_arg, default=3600,
                    help="seconds a run may take before it is stopped (SIGTERM, then SIGKILL 30 s later)")
    a = ap.parse_args()
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        sys.exit(f"fl compare: --seeds '{a.seeds}': allowed: ','-separated integers, e.g. 42,43,44")
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        sys.exit(f"fl compare: --seeds '{a.seeds}': allowed: distinct non-negative integers")
    names = [n for n, _ in CONFIGS]
    only = [s.strip() for s in a.only.split(";") if s.strip()]
    unknown = [s for s in only + [a.baseline] if s not in names]
    if unknown:
        sys.exit(f"fl compare: --only/--baseline: unknown row(s) {unknown}; allowed: {names}")
    order = [names.index(a.baseline)] + [i for i in range(len(CONFIGS)) if names[i] != a.baseline]
    order = [i for i in order if not only or names[i] == a.baseline or names[i] in only]
    # Seed by seed, the rows in the table's order for the first seed and reversed for the next, and so on: the
    # baseline, every ratio's reference, always ran first (and every seed of a row one after another) on a machine
    # whose speed drifts.
    results = {}
    for k, seed in enumerate(seeds):
        for i in (order if k % 2 == 0 else order[::-1]):
            results[(i, seed)] = run_one(a, i, seed)
    rows = [(CONFIGS[i][0], [results[(i, seed)] for seed in seeds]) for i in order]
    if len(seeds) > 1:
        print_seeds_table(a.rounds, seeds, rows)
        return
    rows = [(name, runs[0][0], runs[0][1], runs[0][2]) for name, runs in rows]
    base = rows[0][1]
    print(f"| configuration ({a.rounds} rounds) | test accuracy | last 5 rounds | aggregated | rounds applied "
          "| wall s (x first) | modelled s (x first) | MB up (x first) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s, agg, sampled in rows:
        print(f"| {name} | {100 * s['final_test_accuracy']:.2f}% | {100 * s['last5']:.2f}% | {agg}/{sampled} "
              f"| {s['rounds_applied']} "
              f"| {s['wall_time_s']:.1f} "
              f"({s['wall_time_s'] / base['wall_time_s']:.2f}) | {s['modelled_time_s']:.1f} "
              f"({s['modelled_time_s'] / base['modelled_time_s']:.2f}) | {s['bytes_up'] / 1e6:.1f} "
              f"({s['bytes_up'] / base['bytes_up']:.2f}) |")


def print_seeds_table(rounds, seeds, rows):
    def pct(xs):
        m, sd = mean_sd([100 * x for x in xs])
        return f"{m:.2f} ± {sd:.2f}"

    base = rows[0][1]
    print(f"| configuration ({rounds} rounds, seeds {','.join(map(str, seeds))}) | test accuracy % | last 5 rounds % "
          f"| last 5, paired difference to '{rows[0][0]}' (points) | wall s (x first) | MB up (x first) |")
    print("|---|---|---|---|---|---|")
    for name, runs in rows:
        final = [s["final_test_accuracy"] for s, _, _ in runs]
        last5 = [s["last5"] for s, _, _ in runs]
        diff = [s["last5"] - b["last5"] for (s, _, _), (b, _, _) in zip(runs, base)]
        wall = sum(s["wall_time_s"] for s, _, _ in runs) / len(runs)
        wall0 = sum(s["wall_time_s"] for s, _, _ in base) / len(base)
        up = sum(s["bytes_up"] for s, _, _ in runs) / len(runs)
        up0 = sum(s["bytes_up"] for s, _, _ in base) / len(base)
        print(f"| {name} | {pct(final)} | {pct(last5)} | {pct(diff)} | {wall:.1f} ({wall / wall0:.2f}) "
              f"| {up / 1e6:.1f} ({up / up0:.2f}) |")
    print()
    print("| configuration | " + " | ".join(f"seed {s}: test accuracy / last 5 %" for s in seeds) + " |")
    print("|---|" + "---|" * len(seeds))
    for name, runs in rows:
        print(f"| {name} | " + " | ".join(f"{100 * s['final_test_accuracy']:.2f} / {100 * s['last5']:.2f}"
                                          for s, _, _ in runs) + " |")


if __name__ == "__main__":
    main()
