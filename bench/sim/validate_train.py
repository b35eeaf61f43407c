#!/usr/bin/python3
"""Predicted against measured `conduit train` step time on this machine (issue 7, docs/sim.md section 14).

Per round and worker count N: time the shm allreduce algorithms and the kernels and model steps with N ranks
together, calibrate a cluster file from them, predict the CNN's and the MLP's bsp step with `conduit sim step`, then
measure both with `conduit train` right after: the median over steps 11..--train-steps of compute + exposed
communication + optimizer step on rank 0, of the median of --train-runs runs (one 1.30 ms MLP run in three took
1.85 ms here). When `sim calibrate` warns that one of the processes timing the model steps together ran slower
throughout (its lag would be written as the rank wait), the kernels and model steps are timed again, up to
--retakes more times. Prints one
table row per (model, N, round) with how far its training runs spread (slowest / fastest - 1), the count within
the goal, the rows whose runs alone spread past the goal, and each (model, N)'s median error over the rounds.

  /usr/bin/python3 bench/sim/validate_train.py [--conduit build/bin/conduit] [--out /tmp/simval] [--rounds 3]
                                               [--workers 2,4] [--goal 0.10] [--retakes 2]
                                               [--train-runs 3] [--model-steps 160] [--train-steps 160]
                                               [--zero 0|1|2|3 [--zero-gather bf16|fp16|int8]]
                                               [--pp P --micro-batches M [--schedule 1f1b|gpipe]]
  /usr/bin/python3 bench/sim/validate_train.py --report /tmp/simval/rows.json     (the table of an earlier run again)
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
from peer_procs import run_with_deadline  # noqa: E402

MODELS = {
    "cnn": "conv:1x32k3@28x28,pool:32k2@28x28,conv:32x64k3@14x14,pool:64k2@14x14,dense:3136x128,dense:128x10",
    "mlp": "dense:784x256,dense:256x128,dense:128x10",
}
BATCH = 64  # conduit train's default per-worker batch


RUN_TIMEOUT_S = 3600  # a run's limit


def run(cmd, out=None, err=None):
    """Runs cmd (stdout to the file `out` if given) and returns its stdout; its stderr is appended to the list
    `err` if given, else dropped."""
    print("+", " ".join(cmd) + (f" > {out}" if out else ""), flush=True)
    # (a hang outside the run's own deadlines waited forever; past the limit conduit gets a SIGTERM, which stops its
    # workers, and a SIGKILL 30 s later)
    try:
        if out:
            with open(out, "w") as f:
                r = run_with_deadline(cmd, RUN_TIMEOUT_S, stdout=f, stderr=subprocess.PIPE, text=True)
        else:
            r = run_with_deadline(cmd, RUN_TIMEOUT_S, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        sys.exit(f"validate_train.py: `{' '.join(cmd)}` ran past {RUN_TIMEOUT_S} s; stopped")
    if r.returncode != 0:
        sys.exit(f"validate_train.py: `{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    if err is not None:
        err.append(r.stderr)
    return r.stdout


def load():
    return os.getloadavg()[0]


def measured(path, first, last):
    steps = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "step" and first <= rec.get("global_step", 0) <= last:
                steps.append(rec)
    if len(steps) < (last - first + 1) // 2:
        sys.exit(f"validate_train.py: {path} has {len(steps)} step records in {first}..{last}")
    med = lambda k: statistics.median(s[k] for s in steps)
    total = statistics.median(s["compute_s"] + s["exposed_comm_s"] + s["step_s"] for s in steps)
    return total, med("compute_s"), med("exposed_comm_s"), med("step_s")


def measure(a, workers):
    """Runs the rounds; returns one row per (model, workers, round)."""
    c = a.conduit
    rows = []
    for rnd in range(1, a.rounds + 1):
        for n in workers:
            d = os.path.join(a.out, f"round{rnd}-n{n}")
            os.makedirs(d, exist_ok=True)
            l0 = load()
            launch = [c, "launch", "-n", str(n), "--no-tag-output", "--", c]
            for algo in ("ring", "rhd", "rd", "tree"):
                run(launch + ["bench", "coll", "--op", "allreduce", "--algo", algo, "--transport", "shm", "-b", "1K",
                              "-e", "4M", "-n", "20", "-w", "2", "--json", "--no-check"],
                    os.path.join(d, f"ar_{algo}.jsonl"))
            # The same ring allreduces as training meets them: the last rank arrives 0.5 ms after the others, which
            # have stopped spinning by then (sim calibrate fits the time beyond the back-to-back fit: wake_latency).
            late = os.path.join(d, "ar_ring_late.jsonl")
            if a.stagger_us > 0:
                run(launch + ["bench", "coll", "--op", "allreduce", "--algo", "ring", "--transport", "shm", "-b",
                              "1K", "-e", "4M", "-n", "20", "-w", "2", "--json", "--no-check", "--stagger-us",
                              f"{a.stagger_us:g}"], late)
            elif os.path.exists(late):
                os.remove(late)
            cluster = os.path.join(d, f"here-{n}.yaml")
            for retake in range(a.retakes + 1):
                run(launch + ["bench", "gemm", "--model", "mlp,cnn", "--model-steps", str(a.model_steps), "--json"],
                    os.path.join(d, "gemm.jsonl"))
                warnings = []
                run([c, "sim", "calibrate", "--bench"] + sorted(glob.glob(os.path.join(d, "ar_*.jsonl"))) +
                    ["--gemm", os.path.join(d, "gemm.jsonl"), "--ranks", str(n), "--out", cluster], err=warnings)
                slowed = "one process ran slower throughout" in warnings[0]
                if slowed:
                    print(warnings[0].strip(), flush=True)
                if not slowed or retake == a.retakes:
                    break
            with open(cluster) as f:
                wake = [float(l.split()[1]) * 1e-6 for l in f if l.strip().startswith("wake_latency:")]
            wake = wake[0] if wake else 0.0
            for model, spec in MODELS.items():
                # With --pp, n / pp pipelines, each taking a batch of BATCH in --micro-batches parts.
                pipe = ["--pp", str(a.pp), "--schedule", a.schedule] if a.pp > 1 else []
                p = json.loads(run([c, "sim", "step", "--cluster", cluster, "--gpus", str(n), "--model", "layers",
                                    "--layers-spec", spec, "--global-batch", str(BATCH * n // a.pp), "--micro-batch",
                                    str(BATCH // a.micro_batches), "--grad-bytes", "4", "--compression", "none",
                                    "--sync", "bsp", "--zero", str(a.zero), "--json"] + pipe +
                                   (["--gather-bytes", "1" if a.zero_gather == "int8" else "2"]
                                    if a.zero_gather != "f32" else [])))
                runs = []
                for k in range(1, a.train_runs + 1):
                    out = os.path.join(d, f"train-{model}" + (f"-{k}" if a.train_runs > 1 else ""))
                    shutil.rmtree(out, ignore_errors=True)  # a re-run's; train refuses a folder with a checkpoint
                    run([c, "train", "--model", model, "--workers", str(n), "--transport", "shm", "--compressor",
                         "none", "--zero", str(a.zero), "--max-steps", str(a.train_steps), "--progress", "false",
                         "--output", out, "--micro-batches", str(a.micro_batches)] +
                        (["--zero-gather", a.zero_gather] if a.zero_gather != "f32" else []) +
                        (["--pp", str(a.pp), "--pp-schedule", a.schedule] if a.pp > 1 else []))
                    runs.append(measured(os.path.join(out, "metrics.jsonl"), 11, a.train_steps))
                # The run whose median step is the median of the runs' (the lower middle one for an even count).
                total, comp, exp, opt = sorted(runs)[(len(runs) - 1) // 2]
                b = p["breakdown_s"]
                rows.append(dict(model=model, n=n, zero=a.zero, pp=a.pp, micro_batches=a.micro_batches,
                                 schedule=a.schedule, round=rnd, load=(l0, load()), retakes=retake, slowed=slowed, pred=p["time_s"],
                                 p_comp=p["time_s"] - b["dp_exposed"] - b["zero3_exposed"] - b["optimizer"],
                                 p_exp=b["dp_exposed"] + b["zero3_exposed"], p_opt=b["optimizer"],
                                 framework=b["framework"], rank_wait=b["rank_wait"], wake=wake, meas=total, m_comp=comp,
                                 m_exp=exp, m_opt=opt, runs=[r[0] for r in runs]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conduit", default="build/bin/conduit")
    ap.add_argument("--out", default="/tmp/simval")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                    help="ZeRO stage of both the predictions and the training runs (default 0)")
    ap.add_argument("--zero-gather", default="f32", choices=["f32", "bf16", "fp16", "int8"],
                    help="with --zero 3: the gathers' wire on both sides (conduit train --zero-gather, sim --gather-bytes)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages (conduit train --pp: the layers cut by their work; needs --zero 0)")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches of each pipeline's batch of 64")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="the pipeline's schedule")
    ap.add_argument("--goal", type=float, default=0.10)
    ap.add_argument("--train-runs", type=int, default=3,
                    help="conduit train runs per model and round; the measured step is the median run's")
    ap.add_argument("--retakes", type=int, default=2,
                    help="times to time the kernels and model steps again when `sim calibrate` warns that one of the "
                         "processes timing them together ran slower throughout (its lag would be written as rank wait)")
    ap.add_argument("--model-steps", type=int, default=160,
                    help="model steps `bench gemm --model` times per rank (the rank wait is a median over them)")
    ap.add_argument("--train-steps", type=int, default=160,
                    help="steps per `conduit train` run; the measured step is the median over steps 11 to this")
    ap.add_argument("--report", metavar="ROWS_JSON",
                    help="measure nothing: print the table of an earlier run from the rows.json it wrote")
    ap.add_argument("--stagger-us", type=float, default=500,
                    help="how late the last rank calls the staggered allreduces (0: leave them out, no wake latency)")
    a = ap.parse_args()
    try:
        workers = [int(x) for x in a.workers.split(",")]
    except ValueError:
        sys.exit(f"validate_train.py: --workers '{a.workers}' is not a comma-separated list of integers")
    if a.rounds < 1 or a.train_runs < 1 or a.retakes < 0 or any(n < 2 for n in workers) or a.stagger_us < 0 or \
            a.model_steps < 1 or a.train_steps < 30 or a.pp < 1 or any(n % a.pp for n in workers) or \
            a.micro_batches < 1 or BATCH % a.micro_batches or (a.pp > 1 and a.zero) or \
            (a.pp == 1 and (a.micro_batches > 1 or a.schedule != "1f1b")) or (a.zero_gather != "f32" and a.zero != 3):
        sys.exit("validate_train.py: --rounds, --train-runs and --model-steps must be >= 1, --train-steps >= 30, "
                 "--retakes and --stagger-us >= 0, every --workers entry >= 2 and a multiple of --pp, "
                 f"--micro-batches dividing {BATCH}, --zero 0 with --pp above 1, --micro-batches and --schedule "
                 "only with --pp above 1, and --zero-gather only with --zero 3")
    if a.report:
        try:
            with open(a.report) as f:
                rows = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"validate_train.py: --report {a.report}: {e}")
    else:
        rows = measure(a, workers)
    ms = lambda s: f"{1e3 * s:.1f}"
    print("\n| model | workers | round (load avg.) | predicted step (compute / exposed comm / optimizer) | of which "
          "framework / rank wait / wake per call | measured step (compute / exposed comm / optimizer) | runs' spread "
          "| error |")
    print("|---|---|---|---|---|---|---|---|")
    within = 0
    # How far apart the training runs of one row came out (slowest / fastest - 1): where it exceeds the goal, the
    # measurement itself cannot tell a prediction within the goal from one outside it.
    spread = lambda r: max(r["runs"]) / min(r["runs"]) - 1
    for r in sorted(rows, key=lambda r: (r["model"], r["n"], r["round"])):
        err = r["pred"] / r["meas"] - 1
        ok = abs(err) <= a.goal
        within += ok
        e = f"{100 * err:+.1f}%"
        runs = f"; runs {', '.join(ms(t) for t in r['runs'])}" if len(r["runs"]) > 1 else ""
        again = f", timed {r['retakes'] + 1}x{' and still slowed' if r['slowed'] else ''}" if r["retakes"] else ""
        print(f"| {r['model']} | {r['n']} | {r['round']} ({r['load'][0]:.1f}-{r['load'][1]:.1f}{again}) | "
              f"{ms(r['pred'])} ms ({ms(r['p_comp'])} / {ms(r['p_exp'])} / {ms(r['p_opt'])}) | "
              f"{1e3 * r['framework']:+.1f} / {ms(r['rank_wait'])} / {1e3 * r['wake']:.2f} ms | "
              f"{ms(r['meas'])} ms ({ms(r['m_comp'])} / "
              f"{ms(r['m_exp'])} / {ms(r['m_opt'])}{runs}) | {100 * spread(r):.1f}% | {f'**{e}**' if ok else e} |")
    print(f"\n{within} of {len(rows)} rows within {100 * a.goal:.0f}%")
    noisy = [f"{r['model']} with {r['n']} workers, round {r['round']} ({100 * spread(r):.0f}%)"
             for r in rows if spread(r) > a.goal]
    if noisy:
        print(f"{len(noisy)} row(s) whose own training runs differed by more than {100 * a.goal:.0f}% (slowest / "
              f"fastest): {'; '.join(noisy)}")
    for key in sorted({(r["model"], r["n"]) for r in rows}):
        errs = [r["pred"] / r["meas"] - 1 for r in rows if (r["model"], r["n"]) == key]
        print(f"{key[0]} with {key[1]} workers: median error {100 * statistics.median(errs):+.1f}% over "
              f"{len(errs)} round{'s' if len(errs) > 1 else ''}")
    if not a.report:
        with open(os.path.join(a.out, "rows.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
