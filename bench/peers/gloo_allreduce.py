#!/usr/bin/python3
"""PyTorch gloo peer of `conduit bench coll --op allreduce`.

torch.distributed.all_reduce (f32, sum, gloo backend, over TCP) on a sweep of sizes, one JSON line per size in the
format of Conduit's benchmark records (printed by rank 0). Run it with Debian's python3-torch:

    /usr/bin/python3 bench/peers/gloo_allreduce.py -n 2 --min-bytes 8 --max-bytes 256M --iters 20

With -n it starts the N processes itself (a free port on 127.0.0.1). Under a launcher that sets torchrun's variables
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), e.g. `conduit launch -n 2 -- /usr/bin/python3 gloo_allreduce.py`,
each process is one rank and -n is ignored.

Sizes double from --min-bytes to --max-bytes (K/M/G suffixes, powers of 1024). Each size runs --warmup untimed
operations, then --iters timed ones; time_us is the mean time per operation, median_us and max_us the median and
slowest single operation, each the largest over the ranks.
algbw = bytes / time, busbw = algbw * 2(n-1)/n (as nccl-tests). all_reduce is in place, so the tensor is refilled
and reduced once more for the check; "wrong" counts wrong elements over all ranks.
"""
import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

from peer_procs import cores_first, wait_ranks


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGkmg]?)(i?B?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: expected e.g. 8, 64K, 4M or 1G")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]
    return int(round(float(m.group(1)) * mult))


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch gloo allreduce sweep (JSON lines)")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="processes to start when not under a launcher")
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=256 << 20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300, help="seconds for rendezvous and each collective")
    p.add_argument("--bind-core", action="store_true", help="bind rank r to the r-th CPU mod CPUs, one CPU of every core first (as compare.py --bind core)")
    a = p.parse_args(argv)
    if a.nprocs < 1 or a.iters < 1 or a.warmup < 0:
        p.error("-n and --iters must be at least 1, --warmup at least 0")
    # (0-3 bytes printed no records and exited 0; 6 or 1.5K were rounded down to whole elements)
    if a.min_bytes < 4 or a.min_bytes % 4 or a.max_bytes < 4 or a.max_bytes % 4:
        p.error("--min-bytes and --max-bytes: allowed: positive multiples of 4 bytes (whole f32 elements)")
    if a.max_bytes < a.min_bytes:
        p.error("--max-bytes is smaller than --min-bytes")
    return a


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args, argv):
    """Starts args.nprocs copies of this script with torchrun's variables; returns the first failing code."""
    env = dict(os.environ)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    env["WORLD_SIZE"] = str(args.nprocs)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    for rank in range(args.nprocs):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, env=env_r))
    return wait_ranks(procs)


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if os.environ["MASTER_ADDR"] in ("127.0.0.1", "localhost") else "")
    if not os.environ["GLOO_SOCKET_IFNAME"]:
        del os.environ["GLOO_SOCKET_IFNAME"]
    if args.bind_core:
        cpus = cores_first(sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, {cpus[int(os.environ["RANK"]) % len(cpus)]})
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    max_count = max(1, args.max_bytes // 4)
    # Element i of rank r holds (r + 1) * (i % 13 + 1): small integers, so every sum is exact in f32.
    pattern = (torch.arange(max_count, dtype=torch.int64) % 13 + 1).to(torch.float32)
    local = pattern * (rank + 1)
    expected = pattern * (world * (world + 1) // 2)
    buf = torch.empty(max_count, dtype=torch.float32)
    bytes_ = max(4, args.min_bytes)
    while bytes_ <= args.max_bytes:
        count = bytes_ // 4
        nbytes = count * 4
        t = buf[:count]
        t.copy_(local[:count])
        for _ in range(args.warmup):
            dist.all_reduce(t)
        dist.barrier()
        each = [0.0] * args.iters  # one clock read per operation (as Conduit's loop)
        t0 = prev = time.perf_counter()
        for i in range(args.iters):
            dist.all_reduce(t)
            now = time.perf_counter()
            each[i] = now - prev
            prev = now
        mean = (prev - t0) / args.iters
        # Mean, median and slowest single operation, each the largest over the ranks.
        slowest = torch.tensor([mean, statistics.median(each), max(each)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        t.copy_(local[:count])
        dist.all_reduce(t)
        wrong = torch.tensor([int((t != expected[:count]).sum())], dtype=torch.int64)
        dist.all_reduce(wrong)
        if rank == 0:
            time_s = float(slowest[0])
            algbw = nbytes / time_s / 1e9
            rec = {"impl": "gloo", "op": "allreduce", "algo": "gloo", "transport": "tcp", "world": world,
                   "dtype": "f32", "bytes": nbytes, "count": count, "iters": args.iters,
                   "time_us": round(time_s * 1e6, 3), "median_us": round(float(slowest[1]) * 1e6, 3),
                   "max_us": round(float(slowest[2]) * 1e6, 3), "algbw_gbs": float(f"{algbw:.6g}"),
                   "busbw_gbs": float(f"{algbw * 2 * (world - 1) / world:.6g}"), "wrong": int(wrong[0])}
            print(json.dumps(rec, separators=(",", ":")), flush=True)
        bytes_ *= 2
    dist.destroy_process_group()
    return 0


def main():
    argv = sys.argv[1:]
    args = parse_args(argv)
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return worker(args)
    return spawn(args, argv)


if __name__ == "__main__":
    sys.exit(main())
