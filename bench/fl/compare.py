#!/usr/bin/python3
"""Federated-learning benchmark (`conduit fl`): the CNN on Fashion-MNIST, 100 clients, 10 a round.

Runs `conduit fl` once per configuration with the same model, data, seed, sampling and local settings, and prints a
markdown table of the final test accuracy (and its mean over the last 5 rounds: one round's accuracy moves by a point
or two on a non-IID split), wall time, modelled round time on the client links, bytes uploaded, and
each as a ratio to the first row of the same command (FedAvg on the same non-IID partition without secure
aggregation).

  /usr/bin/python3 bench/fl/compare.py [--conduit build/bin/conduit] [--out runs/fl-compare] [--rounds 20]
                                       [--only 'NAME;NAME']
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

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
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conduit", default="build/bin/conduit")
    ap.add_argument("--out", default="runs/fl-compare")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", default="", help="';'-separated row names (the first row is always run)")
    a = ap.parse_args()
    only = [s.strip() for s in a.only.split(";") if s.strip()]
    unknown = [s for s in only if s not in [n for n, _ in CONFIGS]]
    if unknown:
        sys.exit(f"fl compare: --only: unknown row(s) {unknown}; allowed: {[n for n, _ in CONFIGS]}")
    rows = []
    for i, (name, flags) in enumerate(CONFIGS):
        if only and i > 0 and name not in only:
            continue
        out = os.path.join(a.out, f"{i}")
        shutil.rmtree(out, ignore_errors=True)
        cmd = [a.conduit, "fl", "--rounds", str(a.rounds), "--progress", "false", "--output", out] + flags
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            sys.exit(f"fl compare: '{name}' failed ({r.returncode}):\n{r.stdout[-2000:]}")
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
        rows.append((name, s, agg, sampled))
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


if __name__ == "__main__":
    main()
