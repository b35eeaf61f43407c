#!/usr/bin/python3
"""Straggler benchmark of the synchronization schemes (issue 5): Fashion-MNIST CNN, 4 workers, one 3x slower.

Runs `conduit train` once per scheme with the same data, model, seed and learning rate, worker 3 slowed by --slow,
worker 0 evaluating every --eval-every steps; prints time to the target accuracy, final accuracy, wall time and
bytes on the wire, each also as a ratio to bsp of the same command.

  /usr/bin/python3 bench/sync/straggler.py [--conduit build/bin/conduit] [--out runs/straggler] [--epochs 3]

Every scheme gets the same learning-rate warm-up (--warmup-epochs, default none).
"""
import argparse
import json
import os
import subprocess
import sys

SCHEMES = [
    ("bsp", ["--sync", "bsp", "--compressor", "none"]),
    ("ps-ssp s=3", ["--sync", "ps-ssp", "--staleness", "3"]),
    ("ps-asp", ["--sync", "ps-asp"]),
    ("adpsgd", ["--sync", "adpsgd"]),
    ("local H=8", ["--sync", "local", "--sync-period", "8"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conduit", default="build/bin/conduit")
    ap.add_argument("--out", default="runs/straggler")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slow", default="3:3", help="RANK:FACTOR of the straggler")
    ap.add_argument("--target", type=float, default=0.88)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--schemes", default=",".join(s for s, _ in SCHEMES), help="comma-separated subset")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--warmup-epochs", default="0", help="learning-rate warm-up, the same for every scheme")
    a = ap.parse_args()
    wanted = [s.strip() for s in a.schemes.split(",")]
    known = {s for s, _ in SCHEMES}
    for w in wanted:
        if w not in known:
            sys.exit(f"straggler.py: unknown scheme '{w}'; allowed: {', '.join(s for s, _ in SCHEMES)}")
    rows = []
    for name, flags in SCHEMES:
        if name not in wanted:
            continue
        out = os.path.join(a.out, name.replace(" ", "_").replace("=", ""))
        cmd = [a.conduit, "train", "--model", "cnn", "--workers", str(a.workers), "--epochs", str(a.epochs),
               "--target-accuracy", str(a.target), "--eval-every", str(a.eval_every), "--slow", a.slow,
               "--transport", a.transport, "--warmup-epochs", a.warmup_epochs, "--progress", "false",
               "--output", out] + flags
        print("+", " ".join(cmd), flush=True)
        r = subprocess.run(cmd)
        if r.returncode != 0:
            sys.exit(f"straggler.py: {name} failed with exit code {r.returncode}")
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
        rows.append((name, s))
    base = dict(rows).get("bsp")
    print(f"\n{a.workers} workers, --slow {a.slow}, target {100 * a.target:.0f}% (worker 0 evaluates every "
          f"{a.eval_every} steps)\n")
    print("| scheme | time to target (s) | time vs bsp | final acc | training time (s) | GB on wire | bytes vs bsp |")
    print("|---|---|---|---|---|---|---|")
    for name, s in rows:
        tta = s.get("time_to_target_s")
        rel_t = f"{tta / base['time_to_target_s']:.2f}x" if base and tta and base.get("time_to_target_s") else "-"
        rel_b = f"{s['bytes_on_wire'] / base['bytes_on_wire']:.2f}x" if base and base["bytes_on_wire"] else "-"
        print(f"| {name} | {'not reached' if tta is None else f'{tta:.1f}'} | {rel_t} | "
              f"{100 * s['final_test_accuracy']:.2f}% | {s['wall_time_s']:.1f} | {s['bytes_on_wire'] / 1e9:.2f} | "
              f"{rel_b} |")


if __name__ == "__main__":
    main()
