"""What the peers' launchers and the benchmark scripts share: the CPU order their ranks are bound in (as Conduit's
launcher orders CPUs), the wait for their ranks, and a run with a deadline."""
import math
import signal
import subprocess
import time


def timeout_arg(text):
    """argparse type of a --timeout: seconds, finite and above 0."""
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(text)
    return v


def run_with_deadline(cmd, timeout, **popen_kwargs):
    """subprocess.run(cmd, timeout=...) that stops a run past its deadline with SIGTERM first (Conduit's launcher then
    stops its workers and removes their shared memory; run()'s SIGKILL skipped that), SIGKILL 30 s later. Returns the
    CompletedProcess; raises subprocess.TimeoutExpired once the run is stopped."""
    with subprocess.Popen(cmd, **popen_kwargs) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
            raise
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def cores_first(cpus):
    """The CPUs with one of every core before any core's second (and so on), as the launcher orders them
    (src/core/cpus.cc: cores_first): sorted by number, two ranks on a host that numbers SMT siblings side by side
    shared a core where Conduit's did not. Unknown topology keeps the order."""
    def core(c):
        try:
            base = f"/sys/devices/system/cpu/cpu{c}/topology/"
            with open(base + "physical_package_id") as f1, open(base + "core_id") as f2:
                return (f1.read().strip(), f2.read().strip())
        except OSError:
            return ("cpu", str(c))
    seen, out = {}, []
    for c in cpus:
        k = core(c)
        out.append((seen.get(k, 0), c))
        seen[k] = seen.get(k, 0) + 1
    return [c for _, c in sorted(out, key=lambda t: t[0])]


def wait_ranks(procs):
    """Waits for the ranks (subprocess.Popen); the first to fail stops the others. Returns 0, the first failing exit
    code (128 + the signal's number for a rank a signal killed, as a shell reports it), or 130 on Ctrl-C. Every rank is
    polled each pass: waited for in turn (or polled until the first still running), a later rank's failure went unseen
    while an earlier one sat in gloo until its timeout, 300 s."""
    code = 0
    try:
        while True:
            states = [p.poll() for p in procs]
            failed = next((c for c in states if c not in (None, 0)), 0)
            if failed:
                code = failed
                break
            if all(c is not None for c in states):
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        code = 130
    # (a second Ctrl-C or SIGTERM during the clean-up escaped with a traceback and left ranks unreaped)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        codes = [p.wait() for p in procs]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    code = code or next((c for c in codes if c != 0), 0)
    return code if code >= 0 else 128 - code
