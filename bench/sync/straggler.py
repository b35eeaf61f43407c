#!/usr/bin/python3
"""Straggler benchmark of the synchronization schemes (issue 5): Fashion-MNIST CNN, 4 workers, one 3x slower.

Runs `conduit train` once per scheme with the same data, model, seed and learning rate, worker 3 slowed by --slow,
worker 0 evaluating every --eval-every steps; prints time to the target accuracy, final accuracy, wall time and
bytes on the wire, each also as a ratio to bsp of the same command.

  /usr/bin/python3 bench/sync/straggler.py [--conduit build/bin/conduit] [--out runs/straggler] [--epochs 3]
                                           [--schemes bsp,ps-asp] [--seeds 42,7,1] [--timeout 3600]

Every scheme gets the same learning-rate warm-up (--warmup-epochs, default none).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from peer_procs import run_with_deadline, timeout_arg  # noqa: E402

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
    ap.add_argument("--timeout", type=timeout_arg, default=3600,
                    help="seconds a run may take before it is stopped (SIGTERM, then SIGKILL 30 s later)")
    ap.add_argument("--warmup-epochs", default="0", help="learning-rate warm-up, the same for every scheme")
    ap.add_argument("--seeds", default="42",
                    help="comma-separated seeds; each runs every scheme (in the table's order for the first seed, "
                         "reversed for the next, and so on), and the summary gives each scheme's time to target "
                         "against bsp's of the same seed")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="an extra row: NAME=conduit train flags (e.g. 'asp lr0.5=--sync ps-asp:lr=0.5'); "
                         "repeatable, listed after the --schemes rows")
    a = ap.parse_args()
    for v in a.variant:
        name, eq, flags = v.partition("=")
        if not eq or not name.strip() or not flags.split():
            sys.exit(f"straggler.py: --variant '{v}' is not NAME=FLAGS (a name, '=', then conduit train flags)")
        SCHEMES.append((name.strip(), flags.split()))
    wanted = [s.strip() for s in a.schemes.split(",")] + [v.partition("=")[0].strip() for v in a.variant]
    names = [s for s, _ in SCHEMES]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # (rows are keyed by name: two of one name showed one run's numbers)
        sys.exit(f"straggler.py: row name(s) {twice} given twice; allowed: a --variant name of its own")
    known = {s for s, _ in SCHEMES}
    for w in wanted:
        if w not in known:
            sys.exit(f"straggler.py: unknown scheme '{w}'; allowed: {', '.join(s for s, _ in SCHEMES)}")
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
    except ValueError:
        sys.exit(f"straggler.py: --seeds '{a.seeds}' is not a comma-separated list of integers")
    # scheme -> [(seed, time to target / bsp's, or why there is none)]: a run that failed, or a seed whose bsp run
    # failed or missed the target, is named as such (a failed run read as "not reached", and a seed without a bsp
    # time dropped from the row without a mark)
    ratios = {}
    for index, seed in enumerate(seeds):
        rows = run_seed(a, wanted, seed, len(seeds) > 1, index)
        base = dict(rows).get("bsp")
        print_table(a, rows, base, seed)
        bsp_t = base.get("time_to_target_s") if base and "failed" not in base else None
        for name, s in rows:
            if name == "bsp":
                continue
            tta = s.get("time_to_target_s")
            entry = ("failed" if "failed" in s else "no bsp time" if not bsp_t
                     else tta / bsp_t if tta else float("inf"))
            ratios.setdefault(name, []).append((seed, entry))
    if len(seeds) > 1 and ratios:
        print(f"\nTime to target against bsp of the same seed ({', '.join(map(str, seeds))}):\n")
        print("| scheme | per seed | median | sooner than bsp |")
        print("|---|---|---|---|")
        for name, rs in ratios.items():
            per = ", ".join(f"{seed}: " + (r if isinstance(r, str) else "not reached" if r == float("inf")
                                           else f"{r:.2f}x") for seed, r in rs)
            nums = [r for _, r in rs if not isinstance(r, str)]
            med = f"{statistics.median(nums):.2f}x" if nums else "-"
            print(f"| {name} | {per} | {med} | {sum(r < 1 for r in nums)} of {len(nums)} |")


def run_seed(a, wanted, seed, tag, index):
    """Every wanted scheme once with `seed`, in the table's order for the first seed and reversed for the next, and so
    on (on a machine whose speed drifts, bsp, every ratio's reference, always ran first); rows in the table's order."""
    chosen = [(name, flags) for name, flags in SCHEMES if name in wanted]
    order = chosen if index % 2 == 0 else chosen[::-1]
    results = {}
    for name, flags in order:
        out = os.path.join(a.out, "".join(c if c.isalnum() or c in "-_." else "_" for c in name) +
                           (f"_seed{seed}" if tag else ""))
        cmd = [a.conduit, "train", "--model", "cnn", "--workers", str(a.workers), "--epochs", str(a.epochs),
               "--target-accuracy", str(a.target), "--eval-every", str(a.eval_every), "--slow", a.slow,
               "--transport", a.transport, "--warmup-epochs", a.warmup_epochs, "--seed", str(seed),
               "--progress", "false", "--output", out] + flags
        print("+", " ".join(cmd), flush=True)
        shutil.rmtree(out, ignore_errors=True)  # a re-run's; train refuses a folder with a checkpoint
        try:
            code = run_with_deadline(cmd, a.timeout).returncode
        except subprocess.TimeoutExpired:  # (a hang outside the collectives' deadlines waited forever)
            print(f"straggler.py: {name} (seed {seed}) ran past --timeout {a.timeout} s; stopped", file=sys.stderr)
            code = "timed out"
        if code != 0:  # e.g. a diverged run: a row that never reached the target, not the end of the table
            print(f"straggler.py: {name} (seed {seed}) failed: {code}", file=sys.stderr)
            results[name] = {"failed": code if isinstance(code, str) else f"exit {code}"}
            if name == "bsp":  # (the seed's other runs, done first on every second seed, are still shown)
                print_table(a, [(n, results[n]) for n, _ in chosen if n in results], None, seed)
                sys.exit("straggler.py: bsp is the reference of every ratio; stopping")
            continue
        with open(os.path.join(out, "summary.json")) as f:
            results[name] = json.load(f)
    return [(name, results[name]) for name, _ in chosen]


def print_table(a, rows, base, seed):
    print(f"\n{a.workers} workers, --slow {a.slow}, target {100 * a.target:.0f}%, seed {seed} (worker 0 evaluates "
          f"every {a.eval_every} steps)\n")
    print("| scheme | time to target (s) | time vs bsp | final acc | training time (s) | GB on wire | bytes vs bsp |")
    print("|---|---|---|---|---|---|---|")
    for name, s in rows:
        if "failed" in s:
            print(f"| {name} | failed ({s['failed']}) | - | - | - | - | - |")
            continue
        tta = s.get("time_to_target_s")
        rel_t = f"{tta / base['time_to_target_s']:.2f}x" if base and tta and base.get("time_to_target_s") else "-"
        rel_b = f"{s['bytes_on_wire'] / base['bytes_on_wire']:.2f}x" if base and base["bytes_on_wire"] else "-"
        print(f"| {name} | {'not reached' if tta is None else f'{tta:.1f}'} | {rel_t} | "
              f"{100 * s['final_test_accuracy']:.2f}% | {s['wall_time_s']:.1f} | {s['bytes_on_wire'] / 1e9:.2f} | "
              f"{rel_b} |")


if __name__ == "__main__":
    main()
