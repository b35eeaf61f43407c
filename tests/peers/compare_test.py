#!/usr/bin/python3
"""bench/peers/compare.py refuses records that are not the sweep it asked for (ratios against them compare
nothing) and keeps the ones that are."""
import argparse
import json
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "peers"))
import compare  # noqa: E402


def args(nprocs=2, iters=20, lo=8, hi=32):
    return argparse.Namespace(nprocs=nprocs, iters=iters, min_bytes_n=lo, max_bytes_n=hi)


def rec(b, **over):
    r = {"impl": "x", "op": "allreduce", "dtype": "f32", "world": 2, "bytes": b, "count": b // 4, "iters": 20,
         "time_us": 5.0, "median_us": 4.0, "busbw_gbs": 1.0, "wrong": 0}
    r.update(over)
    return r


def lines(*recs):
    return "\n".join("[rank 0] " + json.dumps(r) for r in recs) + "\n"


class RecordChecks(unittest.TestCase):
    def test_the_sweep_asked_for_passes(self):
        recs, problem = compare.parse_records(lines(rec(8), rec(16), rec(32)))
        self.assertIsNone(problem)
        self.assertEqual(sorted(recs), [8, 16, 32])
        self.assertIsNone(compare.check_records(recs, args()))

    def test_a_missing_size_is_named(self):
        recs, _ = compare.parse_records(lines(rec(8), rec(32)))
        self.assertEqual(compare.check_records(recs, args()), "no record for 16 bytes")

    def test_a_size_outside_the_sweep_is_named(self):
        recs, _ = compare.parse_records(lines(rec(8), rec(16), rec(32), rec(64)))
        self.assertIn("outside the sweep: 64", compare.check_records(recs, args()))

    def test_other_work_is_refused(self):
        for field, value in (("op", "allgather"), ("dtype", "f64"), ("world", 4), ("count", 3), ("iters", 5),
                             ("time_us", float("nan")), ("median_us", None), ("time_us", -1.0)):
            recs, _ = compare.parse_records(lines(rec(8), rec(16, **{field: value}), rec(32)))
            problem = compare.check_records(recs, args())
            self.assertIsNotNone(problem, field)
            self.assertIn(f"16 bytes has {field}", problem)

    def test_duplicate_and_garbled_records(self):
        _, problem = compare.parse_records(lines(rec(8), rec(8, time_us=9.0)))
        self.assertEqual(problem, "two records for 8 bytes")
        _, problem = compare.parse_records(lines(rec(8, bytes="eight")))
        self.assertIn("not a number", problem)
        recs, problem = compare.parse_records("not json\n{broken\n" + lines(rec(8)))
        self.assertIsNone(problem)
        self.assertEqual(list(recs), [8])


class Rounds(unittest.TestCase):
    def test_the_median_round_is_kept_and_a_wrong_round_marks_the_size(self):
        def run(t8, t16, wrong16=0, err=None):
            return ({8: rec(8, time_us=t8, median_us=t8), 16: rec(16, time_us=t16, median_us=t16, wrong=wrong16)},
                    err, "cmd", 1.0)
        recs, err, _, secs = compare.median_rounds([run(5, 30), run(9, 10, wrong16=2), run(7, 20)], "median")
        self.assertIsNone(err)
        self.assertEqual(secs, 3.0)
        self.assertEqual(recs[8]["time_us"], 7)
        self.assertEqual(recs[16]["time_us"], 20)
        self.assertEqual(recs[16]["wrong"], 2)  # another round's wrong elements are not hidden by the median
        self.assertEqual(recs[8]["wrong"], 0)
        _, err, _, _ = compare.median_rounds([run(5, 30), run(9, 10, err="exit 1: boom")], "mean")
        self.assertEqual(err, "exit 1: boom")


class Transports(unittest.TestCase):
    def test_each_sides_transport_comes_from_its_records(self):
        self.assertEqual(compare.record_transport({8: rec(8, transport="tcp"), 16: rec(16, transport="tcp")}), "tcp")
        self.assertEqual(compare.record_transport({8: rec(8, transport="tcp"), 16: rec(16, transport="shm")}),
                         "shm, tcp")
        self.assertIsNone(compare.record_transport({8: rec(8)}))

    def test_ratios_across_transports_are_marked(self):
        """OpenMPI's "mpi" is shared memory on one host: against Conduit over tcp it is marked (it never was)."""
        self.assertEqual(compare.different_transports({"conduit": "tcp", "openmpi": "mpi", "gloo": "tcp"}),
                         {"openmpi"})
        self.assertEqual(compare.different_transports({"conduit": "shm", "openmpi": "mpi", "gloo": "tcp"}), {"gloo"})
        self.assertEqual(compare.different_transports({"conduit": None, "openmpi": "mpi"}), set())


class Timeouts(unittest.TestCase):
    def test_a_timed_out_runs_records_are_checked(self):
        """The sizes a run finished before its timeout are kept when they are the sweep's work, dropped when not (a
        timed-out run's records fed the table unchecked)."""
        saved = compare.conduit_command
        a = argparse.Namespace(timeout=1, nprocs=2, iters=20, min_bytes_n=8, max_bytes_n=32)
        try:
            for r8, kept in ((rec(8), [8]), (rec(8, world=3), [])):
                out = lines(r8).replace("\n", "\\n").replace("'", "")
                compare.conduit_command = lambda _a, out=out: (
                    ["sh", "-c", f"printf '{out}'; exec sleep 30"], dict(os.environ))
                recs, err, _, _ = compare.run_peer("conduit", a)
                self.assertEqual(sorted(recs), kept)
                self.assertTrue(err.startswith("timed out after 1 s"), err)
                if not kept:
                    self.assertIn("world 3, expected 2", err)
        finally:
            compare.conduit_command = saved


class Ranks(unittest.TestCase):
    def test_the_first_failing_rank_stops_the_others(self):
        """Any rank's failure is seen at once, the others stopped, its code returned (a signal as 128 + its number): the
        loop polled only the first rank still running, so rank 1's failure waited for rank 0's sleep."""
        import subprocess
        import time
        import peer_procs
        for failing, code in ((["sh", "-c", "sleep 0.3; exit 3"], 3), (["sh", "-c", "sleep 0.3; kill -9 $$"], 137)):
            procs = [subprocess.Popen(["sleep", "30"]), subprocess.Popen(failing), subprocess.Popen(["sleep", "30"])]
            try:
                t0 = time.time()
                self.assertEqual(peer_procs.wait_ranks(procs), code)
                self.assertLess(time.time() - t0, 10)
                self.assertTrue(all(p.returncode is not None for p in procs))
            finally:  # (a failure here left the sleeps running)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        self.assertEqual(peer_procs.wait_ranks([subprocess.Popen(["true"]), subprocess.Popen(["true"])]), 0)

    def test_cores_first_takes_one_cpu_of_every_core_first(self):
        import peer_procs
        self.assertEqual(peer_procs.cores_first([]), [])
        cpus = sorted(os.sched_getaffinity(0))
        self.assertEqual(sorted(peer_procs.cores_first(cpus)), cpus)
        # A host that numbers SMT siblings side by side (CPUs 0 and 1 on core 0, 2 and 3 on core 1, one package):
        # one CPU of each core first, as the launcher orders them.
        import io
        import re

        def fake_open(path, *args, **kwargs):
            m = re.search(r"cpu(\d+)/topology/(physical_package_id|core_id)$", path)
            if not m:
                raise OSError(path)
            return io.StringIO("0" if m.group(2) == "physical_package_id" else str(int(m.group(1)) // 2))

        peer_procs.open = fake_open  # (the module's open: the builtin is looked up after its globals)
        try:
            self.assertEqual(peer_procs.cores_first([0, 1, 2, 3]), [0, 2, 1, 3])
            self.assertEqual(peer_procs.cores_first([1, 3, 0]), [1, 3, 0])
        finally:
            del peer_procs.open


class Interrupts(unittest.TestCase):
    def test_an_interrupt_stops_the_benchmark_it_was_running(self):
        """Ctrl-C (or a stop signal) while a benchmark runs stops its whole process group: in a session of its own it
        does not get the terminal's SIGINT, and left running it loaded the cores later measurements used."""
        import signal
        import tempfile
        import time
        scratch = tempfile.TemporaryDirectory()  # (mkdtemp's folders were left behind, one a run)
        self.addCleanup(scratch.cleanup)
        pidfile = os.path.join(scratch.name, "pid")

        def fake(a):
            # (a member that ignores SIGTERM: the leader goes at once, the group stays until SIGKILL)
            return ["sh", "-c", f"echo $$ > {pidfile}; (trap '' TERM; exec sleep 30) & sleep 30"], dict(os.environ)

        saved = compare.conduit_command
        compare.conduit_command = fake

        def interrupt(signum, frame):
            # (not before the group has written its leader's pid: a loaded machine started sh later than the alarm)
            deadline = time.time() + 10
            while time.time() < deadline and not (os.path.exists(pidfile) and os.path.getsize(pidfile) > 0):
                time.sleep(0.02)
            raise KeyboardInterrupt()

        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with self.assertRaises(KeyboardInterrupt):
                compare.run_peer("conduit", argparse.Namespace(timeout=60))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            compare.conduit_command = saved
        with open(pidfile) as f:
            group = int(f.read())
        deadline = time.time() + 5
        while time.time() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with self.assertRaises(ProcessLookupError):
            os.killpg(group, 0)


if __name__ == "__main__":
    unittest.main()
