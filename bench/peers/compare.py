#!/usr/bin/python3
"""Runs the same f32 allreduce sweep with Conduit, OpenMPI's MPI_Allreduce and PyTorch's gloo, one after the
other, and prints one table side by side per size: time and busbw of each, and the ratios conduit/openmpi and
conduit/gloo (peer time / conduit time, i.e. conduit busbw / peer busbw: above 1 means Conduit is faster).

    /usr/bin/python3 bench/peers/compare.py -n 2 --min-bytes 8 --max-bytes 256M --iters 20 [--rounds 3]

A peer that cannot be built, fails or times out is reported as failed in the table (with its reason below it);
the others still run. --json-out FILE keeps every record (JSON lines) for plots.
"""
import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PEERS = ("conduit", "openmpi", "gloo")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", type=int, default=2, help="world size (default 2)")
    p.add_argument("--min-bytes", default="8", help="smallest message (K/M/G suffixes; default 8)")
    p.add_argument("--max-bytes", default="256M", help="largest message (default 256M)")
    p.add_argument("--iters", type=int, default=20, help="timed operations per size (default 20)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed operations per size, for every implementation (default 5)")
    p.add_argument("--transport", default=None, help="Conduit's transport (tcp, shm, ...; default: its own choice)")
    p.add_argument("--algo", default=None, help="Conduit's allreduce algorithm (default: its tuner's choice)")
    p.add_argument("--conduit", default=os.path.join(ROOT, "build", "bin", "conduit"), help="conduit binary")
    p.add_argument("--peers", default=",".join(PEERS), help="which to run, comma-separated (default: all three)")
    p.add_argument("--build-dir", default=os.path.join(ROOT, "build-peers"), help="where mpi_allreduce is built")
    p.add_argument("--timeout", type=float, default=600, help="seconds each run may take (default 600)")
    p.add_argument("--bind", choices=("core", "none"), default="core",
                   help="process binding, the same for every implementation: core (default: rank r on the r-th CPU "
                        "mod CPUs, one CPU of every core first: conduit launch --bind core, mpirun --bind-to core --map-by core, gloo by "
                        "sched_setaffinity) or none")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every implementation this many times, rotating which goes first each round (the "
                        "machine's state drifts between runs), and keep per size the round with the median time "
                        "(default 1)")
    p.add_argument("--json-out", default=None, help="also write every record to this file (JSON lines)")
    p.add_argument("--stat", choices=("mean", "median"), default="mean",
                   help="which time per operation the table and ratios use: the mean over --iters (default) or the "
                        "median single operation (a run's one stall does not decide it); both are in every record")
    a = p.parse_args()
    if not 1 <= a.nprocs <= 1024:
        p.error("-n must be between 1 and 1024")
    # (conduit bench coll's own bounds: past them every peer ran in full before conduit refused)
    if not 1 <= a.iters <= 1000000:
        p.error(f"--iters {a.iters}: allowed: 1 to 1000000")
    if not 0 <= a.warmup <= 1000000:
        p.error(f"--warmup {a.warmup}: allowed: 0 to 1000000")
    if not 1 <= a.rounds <= 100:
        p.error(f"--rounds {a.rounds}: allowed: 1 to 100")
    # Sizes checked once, as every implementation reads them: whole f32 elements, K/M/G suffixes (the peers rounded
    # 6 bytes down to 4 where conduit refused it, and conduit alone took a T suffix).
    for flag in ("min_bytes", "max_bytes"):
        v = getattr(a, flag)
        m = re.fullmatch(r"([0-9]+)([KMG]?)", v.strip())
        if not m:
            p.error(f"--{flag.replace('_', '-')} {v}: allowed: a whole number of bytes with an optional K, M or G")
        n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]
        if n < 4 or n % 4:
            p.error(f"--{flag.replace('_', '-')} {v}: allowed: a positive multiple of 4 bytes (whole f32 elements)")
        setattr(a, flag + "_n", n)
    if a.max_bytes_n < a.min_bytes_n:
        p.error(f"--max-bytes {a.max_bytes} is below --min-bytes {a.min_bytes}")
    if not (math.isfinite(a.timeout) and a.timeout > 0):
        p.error(f"--timeout {a.timeout}: allowed: a finite number of seconds above 0")
    a.peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    if not a.peers:
        p.error(f"--peers names none; allowed: a comma-separated list of {', '.join(PEERS)}")
    for x in a.peers:
        if x not in PEERS:
            p.error(f"--peers: unknown peer '{x}'; allowed: {', '.join(PEERS)}")
    if os.path.exists(a.build_dir) and not os.path.isdir(a.build_dir):
        p.error(f"--build-dir {a.build_dir} is a file; allowed: a directory (made if missing)")
    a.json_file = None
    if a.json_out:
        try:  # opened now: a path that cannot be written fails before the runs, not after them
            a.json_file = open(a.json_out, "w")
        except OSError as e:
            p.error(f"--json-out {a.json_out}: {e.strerror}")
    return a


class PeerFailed(Exception):
    pass


def sweep_args(a):
    """The sweep every implementation runs: sizes, timed and untimed operations (the same warm-up for all)."""
    return ["--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes), "--iters", str(a.iters),
            "--warmup", str(a.warmup)]


def conduit_command(a):
    binary = os.path.abspath(a.conduit)
    if not os.access(binary, os.X_OK):
        raise PeerFailed(f"conduit binary not found: {binary} (build it, or give --conduit)")
    cmd = [binary, "launch", "-n", str(a.nprocs), "--bind", a.bind, "--", binary,
           "bench", "coll", "--op", "allreduce",
           "--dtype", "f32"] + sweep_args(a) + ["--json"]
    if a.transport:
        cmd += ["--transport", a.transport]
    if a.algo:
        cmd += ["--algo", a.algo]
    return cmd, None


def openmpi_command(a):
    src = os.path.join(HERE, "mpi_allreduce.c")
    binary = os.path.join(a.build_dir, "mpi_allreduce")
    if not shutil.which("mpicc") or not shutil.which("mpirun"):
        raise PeerFailed("mpicc/mpirun not found (install openmpi-bin and libopenmpi-dev)")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(src):
        os.makedirs(a.build_dir, exist_ok=True)
        r = subprocess.run(["mpicc", "-O2", "-o", binary, src, "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise PeerFailed("mpicc failed: " + last_line(r.stderr))
    env = dict(os.environ)
    cmd = ["mpirun", "-n", str(a.nprocs), "--oversubscribe"]
    # Rank r on core r mod cores, as the others (mpirun refuses more ranks than cores per core without overload).
    cmd += ["--bind-to", "core:overload-allowed", "--map-by", "core:OVERSUBSCRIBE"] if a.bind == "core" else \
        ["--bind-to", "none"]
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd += [binary] + sweep_args(a)
    return cmd, env


def gloo_command(a):
    python = "/usr/bin/python3"  # Debian's python3-torch, not a python3 earlier in PATH
    if not os.access(python, os.X_OK):
        raise PeerFailed(f"{python} not found (install python3-torch)")
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)  # gloo_allreduce.py starts its own processes
    cmd = [python, os.path.join(HERE, "gloo_allreduce.py"), "-n", str(a.nprocs)] + sweep_args(a)
    if a.bind == "core":
        cmd += ["--bind-core"]
    return cmd, env


def last_line(text):
    """The line that best says why a run failed: the first naming an error, else the last one."""
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    for l in lines:
        if re.search(r"error|not expected|required|invalid|cannot|failed|abort|unknown", l, re.IGNORECASE):
            return l[:240]
    return lines[-1][:240] if lines else "(no output)"


RANK_PREFIX = re.compile(r"^\[rank \d+\] ")


def parse_records(stdout):
    """Records by size, and the first problem found in them (or None)."""
    recs, problem = {}, None
    for line in stdout.splitlines():
        line = RANK_PREFIX.sub("", line.strip())
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and "bytes" in r and "time_us" in r:
            try:
                b = int(r["bytes"])
            except (TypeError, ValueError):
                problem = problem or f"a record's bytes is {r['bytes']!r}, not a number"
                continue
            if b in recs:
                problem = problem or f"two records for {b} bytes"
                continue
            recs[b] = r
    return recs, problem


def expected_sizes(a):
    """The sizes every implementation's sweep covers: --min-bytes doubling up to --max-bytes."""
    sizes, b = [], a.min_bytes_n
    while b <= a.max_bytes_n:
        sizes.append(b)
        b *= 2
    return sizes


def check_records(recs, a, whole=True):
    """The first way the records differ from the sweep asked for (what was run, or with `whole` a size missing), or
    None. Ratios of records that timed different operations, worlds or iteration counts would compare nothing."""
    for b in sorted(recs):
        r = recs[b]
        want = {"op": "allreduce", "dtype": "f32", "world": a.nprocs, "count": b // 4, "iters": a.iters}
        for k, v in want.items():
            if r.get(k) != v:
                return f"its record for {b} bytes has {k} {r.get(k)!r}, expected {v!r}"
        for k in ("time_us", "median_us"):
            t = r.get(k)
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
                return f"its record for {b} bytes has {k} {t!r}, expected a time in us"
    if not whole:
        return None
    sweep = expected_sizes(a)
    asked = set(sweep)
    missing = [fmt_size(b) for b in sweep if b not in recs]
    extra = [fmt_size(b) for b in sorted(recs) if b not in asked]
    if missing:
        return "no record for " + ", ".join(missing) + " bytes"
    if extra:
        return "records for sizes outside the sweep: " + ", ".join(extra) + " bytes"
    return None


def different_transports(transports):
    """The peers whose transport is not Conduit's ({name: transport or None}); OpenMPI's "mpi" is shared memory
    between the ranks of one host (it was never marked, against Conduit over tcp either)."""
    def medium(t):
        return "shm" if t == "mpi" else t
    mine = transports.get("conduit")
    return {n for n, t in transports.items() if n != "conduit" and mine and t and medium(t) != medium(mine)}


def record_transport(recs):
    """The transport a peer's records name (one for all of them), or None."""
    kinds = {r.get("transport") for r in recs.values() if isinstance(r, dict) and r.get("transport")}
    return kinds.pop() if len(kinds) == 1 else (", ".join(sorted(kinds)) if kinds else None)


def run_peer(name, a):
    """Returns (records by bytes, error or None, command line, seconds)."""
    try:
        cmd, env = {"conduit": conduit_command, "openmpi": openmpi_command, "gloo": gloo_command}[name](a)
    except PeerFailed as e:
        return {}, str(e), "", 0.0
    except OSError as e:  # the build folder cannot be made, mpicc cannot start, ...
        return {}, f"cannot prepare it: {e}", "", 0.0
    line = " ".join(shlex.quote(c) for c in cmd)
    print(f"# {name}: {line}", file=sys.stderr, flush=True)
    t0 = time.time()
    # In a session of its own: on the timeout its whole process tree goes (killing the direct child alone left the
    # gloo ranks, which have no parent-death signal, running).
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        return {}, f"cannot run: {e}", line, time.time() - t0
    try:
        stdout, stderr = proc.communicate(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, _ = proc.communicate()
        # The sizes it finished are kept (each timed whole), once checked as a finished run's are: records of another
        # operation or world fed the table and the medians of --rounds.
        recs, problem = parse_records(stdout or "")
        problem = problem or check_records(recs, a, whole=False)
        return ({} if problem else recs), f"timed out after {a.timeout:g} s" + (f"; {problem}" if problem else ""), \
            line, time.time() - t0
    except BaseException:
        # Ctrl-C or a stop signal (main() turns SIGTERM into SystemExit): the benchmark's session does not get the
        # terminal's SIGINT, and left running it loaded the cores every later measurement used.
        # (the whole group: its leader may go at once while members that ignore SIGTERM stay)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + 2
            while time.time() < deadline:
                proc.poll()  # (reaps the leader: a zombie still counts as the group's member)
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                continue
            break
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        raise
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    recs, problem = parse_records(r.stdout)
    err = None
    if r.returncode != 0:
        err = f"exit {r.returncode}: {last_line(r.stderr or r.stdout)}"
    elif not recs:
        err = f"no JSON records in its output: {last_line(r.stdout or r.stderr)}"
    elif problem := problem or check_records(recs, a):
        # Its records are not the sweep asked for: no ratio is computed against them.
        err = problem
        recs = {}
    return recs, err, line, time.time() - t0


def op_time_us(r, stat):
    """The record's time per operation in us for --stat (mean: time_us; median: median_us)."""
    return r["time_us"] if stat == "mean" else r.get("median_us")


def busbw_gbs(r, stat, world):
    t = op_time_us(r, stat)
    if stat == "mean" or not t:
        return r["busbw_gbs"]
    return r["bytes"] / t / 1e3 * (2 * (world - 1) / world)  # nccl-tests' allreduce factor (0 for one rank)


def fmt_size(b):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= div and b % div == 0:
            return f"{b // div}{unit}"
    return str(b)


def median_rounds(runs, stat):
    """One result from several rounds of a peer: per size the record of the round with the median time (the lower
    middle one for an even count), marked wrong when any round was; the first error, if any round had one."""
    err = next((e for _, e, _, _ in runs if e), None)
    sizes = set().union(*(recs.keys() for recs, _, _, _ in runs))
    recs = {}
    for b in sizes:
        have = [r[b] for r, _, _, _ in runs if b in r and op_time_us(r[b], stat)]
        if not have:
            continue
        have.sort(key=lambda r: op_time_us(r, stat))
        pick = dict(have[(len(have) - 1) // 2])
        if any(r.get("wrong") for r in have):
            pick["wrong"] = max(r.get("wrong") or 0 for r in have)
        recs[b] = pick
    return recs, err, runs[0][2], sum(t for _, _, _, t in runs)


def main():
    a = parse_args()
    # SIGTERM unwinds as SystemExit, so the running benchmark's process group is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    chosen = [n for n in PEERS if n in a.peers]
    runs = {n: [] for n in chosen}
    for k in range(a.rounds):
        # Round k starts with the k-th implementation (mod their count), so none is always first or last.
        for name in chosen[k % len(chosen):] + chosen[:k % len(chosen)]:
            runs[name].append(run_peer(name, a))
    results = {n: median_rounds(runs[n], a.stat) if a.rounds > 1 else runs[n][0] for n in chosen}
    names = list(results)

    sizes = sorted({b for recs, _, _, _ in results.values() for b in recs})
    what = "mean per op" if a.stat == "mean" else "median single op"
    print(f"allreduce f32 sum, world {a.nprocs}, iters {a.iters}, {os.cpu_count()} CPUs; time in us ({what}, "
          f"slowest rank{f', median of {a.rounds} rounds' if a.rounds > 1 else ''}), busbw in GB/s; "
          f"ratio = peer time / conduit time (>1: conduit faster)")
    # Each side's transport, from its records (a ratio of Conduit over tcp against OpenMPI over shared memory said
    # nothing of it): ratios across different transports are marked.
    transports = {n: record_transport(results[n][0]) for n in names}
    print("transports: " + ", ".join(f"{n} {transports[n] or '?'}" for n in names)
          + (" (OpenMPI picks its own: shared memory between ranks of one host)" if "openmpi" in names else ""))
    differs = different_transports(transports)
    if differs:
        print("~ = the ratio compares different transports (" + ", ".join(sorted(differs)) + " against conduit's)")
    head = f"{'bytes':>7} |" + "".join(f" {n + ' us':>12} {'busbw':>8} |" for n in names)
    peers_for_ratio = [n for n in names if n != "conduit"] if "conduit" in names else []
    head += "".join(f" {'c/' + ('ompi' if n == 'openmpi' else n):>7}" for n in peers_for_ratio)
    print(head)
    print("-" * len(head))
    wrong_any = False
    for b in sizes:
        row = f"{fmt_size(b):>7} |"
        for n in names:
            recs, err, _, _ = results[n]
            r = recs.get(b)
            if r is None or not op_time_us(r, a.stat):
                row += f" {'failed' if err else '-':>12} {'':>9}|"
            else:
                mark = "!" if r.get("wrong", 0) else ""
                wrong_any = wrong_any or bool(mark)
                row += f" {op_time_us(r, a.stat):>12.2f} {busbw_gbs(r, a.stat, a.nprocs):>8.3g}{mark or ' '}|"
        c = results.get("conduit", ({}, None, "", 0))[0].get(b)
        for n in peers_for_ratio:
            p = results[n][0].get(b)
            ct, pt = (op_time_us(c, a.stat) if c else None), (op_time_us(p, a.stat) if p else None)
            if ct and pt and not c.get("wrong", 0) and not p.get("wrong", 0):  # no ratio for wrong results
                row += f" {pt / ct:>5.3g}x{'~' if n in differs else ' '}"
            else:
                row += f" {'-':>7}"
        print(row)
    if not sizes:
        print("(no results)")
    if wrong_any:
        print("! = the correctness check found wrong elements at this size")
    for n in names:
        recs, err, line, secs = results[n]
        if err:
            print(f"{n}: FAILED: {err}")
    if a.json_file:
        with a.json_file as f:
            for n in names:
                for b in sorted(results[n][0]):
                    f.write(json.dumps(results[n][0][b], separators=(",", ":")) + "\n")
    # Wrong results fail the comparison whichever implementation had them (the peers exit 0 on them).
    return 0 if all(results[n][1] is None for n in names) and not wrong_any else 1


if __name__ == "__main__":
    sys.exit(main())
