#!/usr/bin/python3
"""PyTorch DistributedDataParallel peer of `conduit train` (Debian's python3-torch, gloo backend).

The same model (the CNN or MLP of src/torch/models.cc), data (Fashion-MNIST IDX files, pixels scaled to [0, 1] and
standardised with the training set's mean and std), per-worker batch size, learning rate for the global batch,
SGD with momentum 0.9, schedule (cosine/step/constant, per step) and epochs as `conduit train`, with one of DDP's
communication hooks: none (allreduce of f32 buckets), fp16 (fp16_compress_hook) or powersgd (powerSGD_hook with
error feedback and warm start, rank --powersgd-rank, start_powerSGD_iter=2: steps 1 and 2 plain allreduce,
compression from the third).

    /usr/bin/python3 bench/peers/ddp_train.py -n 4 --hook powersgd --powersgd-rank 4 --epochs 1 --output runs/ddp

With -n it starts N local processes itself (127.0.0.1, a free port). Under a launcher that sets torchrun's
variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), e.g. `conduit cluster run -- /usr/bin/python3
bench/peers/ddp_train.py ...`, each process is one rank (GLOO_SOCKET_IFNAME follows CONDUIT_SOCKET_IFNAME).

Rank 0 writes <output>/metrics.jsonl (one {"kind":"epoch",...} record per epoch: test_accuracy, time_s,
bytes_sent and bytes_payload of rank 0, samples_per_s) and <output>/summary.json with the keys of conduit train's summary (final_test_accuracy,
wall_time_s, time_to_target_s, bytes_on_wire, ...). bytes_on_wire is what all ranks' interfaces sent during training
(/proc/net/dev of each rank's network namespace, summed; on loopback every rank reads the one machine-wide lo
counter, so it is that counter's mean reading over the ranks: all ranks' traffic plus TCP/IP headers and anything
else on lo, once — it was the sum of the ranks' readings, world size times too much), plus the hook's own count of
payload bytes in bytes_payload. The epoch records' and copies' bytes_sent are rank 0's interface, on loopback the
machine's counter over the world size (the ranks of a ring send alike).

Each rank fixes glibc's malloc thresholds as `conduit` does (CONDUIT_MALLOC_TUNING=0 turns it off on both sides).
"""
import argparse
import gzip
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

from peer_procs import cores_first, wait_ranks



def finite_json(obj, **kw):
    """JSON with nan and inf as null, as conduit's records write them (json.dumps wrote a bare NaN, which no JSON
    reader takes: a diverged run's records were dropped by the sweep, conduit's kept)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(obj), allow_nan=False, **kw)

def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch DDP peer of conduit train")
    p.add_argument("-n", "--nprocs", type=int, default=4, help="processes to start when not under a launcher")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--hook", choices=["none", "fp16", "powersgd"], default="none")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate for the global batch")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                   help="sgd (with --momentum) or adam (torch's defaults), as conduit train's")
    p.add_argument("--zero", action="store_true",
                   help="PyTorch's ZeroRedundancyOptimizer around it: each rank steps and keeps the state of a "
                        "share of the parameters, which it then broadcasts (DDP still allreduces every gradient)")
    p.add_argument("--lr-schedule", choices=["cosine", "step", "constant"], default="cosine")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--train-limit", type=int, default=0, help="first N training samples (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="first N test samples (0: all)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--target-accuracy", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=0,
                   help="rank 0 copies the model every N steps; the copies are evaluated after training (as conduit "
                        "train does), so evaluating does not stop the timed run")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--output", default="runs/ddp")
    p.add_argument("--bind", choices=["auto", "core", "none"], default="auto",
                   help="processes started here (-n): worker k on CPU k mod C, as `conduit train`'s launcher binds "
                        "its workers (auto: core when the workers divide evenly over the CPUs or fit them, else none)")
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args(argv)
    if a.nprocs < 1 or a.epochs < 1 or a.batch_size < 1 or a.lr <= 0 or a.powersgd_rank < 1:
        p.error("-n, --epochs, --batch-size, --powersgd-rank must be at least 1 and --lr positive")
    return a


def read_idx(path):
    import numpy as np

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(dirname, base):
    for name in (base, base + ".gz"):
        path = os.path.join(dirname, name)
        if os.path.exists(path):
            return path
    sys.exit(f"ddp_train: {base}[.gz] not found in {dirname}")


def load(dirname, train, limit):
    pre = "train" if train else "t10k"
    x = read_idx(find(dirname, f"{pre}-images-idx3-ubyte"))
    y = read_idx(find(dirname, f"{pre}-labels-idx1-ubyte"))
    if limit > 0:
        x, y = x[:limit], y[:limit]
    return x, y


def make_model(kind):
    import torch.nn as nn

    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                             nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def netdev_tx_bytes():
    """Bytes sent by this rank's interface: CONDUIT_SOCKET_IFNAME inside an emulated host, else lo."""
    try:
        with open("/proc/net/dev") as f:
            rows = f.read().splitlines()[2:]
    except OSError:
        return 0
    tx = {}
    for row in rows:
        name, rest = row.split(":", 1)
        tx[name.strip()] = int(rest.split()[8])
    ifname = os.environ.get("CONDUIT_SOCKET_IFNAME") if os.environ.get("CONDUIT_CLUSTER_HOST") else None
    return tx.get(ifname or "lo", 0)


def lr_at(a, step, total):
    t = min(max(step / total if total > 0 else 1.0, 0.0), 1.0)
    if a.lr_schedule == "cosine":
        return a.lr * 0.5 * (1 + math.cos(math.pi * t))
    if a.lr_schedule == "step":
        return a.lr * (1.0 if t < 0.5 else 0.1 if t < 0.75 else 0.01)
    return a.lr


def worker(a):
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    if os.environ.get("CONDUIT_SOCKET_IFNAME") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["CONDUIT_SOCKET_IFNAME"]
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    xtr, ytr = load(a.data_dir, True, a.train_limit)
    xte, yte = load(a.data_dir, False, a.test_limit)
    mean = float(xtr.mean()) / 255.0
    std = float((xtr.astype(np.float64) / 255.0).std())
    to_x = lambda arr: (torch.from_numpy(arr.astype(np.float32) / 255.0).unsqueeze(1) - mean) / std
    Xtr, Ytr = to_x(xtr), torch.from_numpy(ytr.astype(np.int64))
    Xte, Yte = to_x(xte), torch.from_numpy(yte.astype(np.int64))

    if a.hook == "powersgd":
        # powerSGD_hook chains several allreduces per bucket from future callbacks; with more than one bucket
        # those of different buckets reach gloo in a different order on different ranks (gloo then fails with
        # "op.preamble.length <= op.nbytes"). One bucket for the whole model keeps the order fixed.
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1 << 30
        a.bucket_cap_mb = 1024.0
    model = DDP(make_model(a.model), bucket_cap_mb=a.bucket_cap_mb)
    payload = [0]
    if a.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            payload[0] += bucket.buffer().numel() * 2
            return default_hooks.fp16_compress_hook(state, bucket)

        model.register_comm_hook(None, hook)
    elif a.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=a.powersgd_rank,
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)

        def hook(st, bucket):
            # Payload estimate: P and Q of every >= 2-D tensor the hook compresses (its _should_compress: only when
            # P and Q are under 1/min_compression_rate of the matrix), the rest uncompressed, as the hook does.
            n = 0
            for t in bucket.gradients():
                m = t.view(t.shape[0], -1) if t.dim() > 1 else None
                r = min(a.powersgd_rank, *m.shape) if m is not None else 0
                pq = (m.shape[0] + m.shape[1]) * r if m is not None else 0
                if (m is not None and st.iter >= st.start_powerSGD_iter
                        and pq * st.min_compression_rate < m.shape[0] * m.shape[1]):
                    n += pq * 4
                else:
                    n += t.numel() * 4
            payload[0] += n
            return psgd.powerSGD_hook(st, bucket)

        model.register_comm_hook(state, hook)
    else:
        def hook(state, bucket):
            payload[0] += bucket.buffer().numel() * 4
            fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)

    opt_class, opt_args = ((torch.optim.SGD, {"lr": a.lr, "momentum": a.momentum}) if a.optimizer == "sgd"
                           else (torch.optim.Adam, {"lr": a.lr}))
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=opt_class, **opt_args)
    else:
        opt = opt_class(model.parameters(), **opt_args)
    n = Xtr.shape[0]
    per_rank = n // world
    steps_per_epoch = per_rank // a.batch_size
    total = steps_per_epoch * a.epochs
    if a.max_steps > 0:
        total = min(total, a.max_steps)
    metrics = None
    if rank == 0:
        os.makedirs(a.output, exist_ok=True)
        metrics = open(os.path.join(a.output, "metrics.jsonl"), "w")
    dist.barrier()
    # On loopback every rank reads the machine's one lo counter (all ranks' traffic), not its own interface's.
    shared_lo = not os.environ.get("CONDUIT_CLUSTER_HOST")
    lo_share = world if shared_lo else 1
    tx0 = netdev_tx_bytes()
    t0 = time.time()
    untimed = [0.0]  # evaluations: the clock below (as conduit train's) leaves them out

    def clock():
        return time.time() - t0 - untimed[0]

    def evaluate(net, shard, nshards):
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            # Chunks of 200: activations of 500 images (50 MB) are above glibc's mmap threshold, and mapping and
            # faulting them in again for every chunk made an evaluation 5x slower.
            for i in range(shard * 200, Xte.shape[0], 200 * nshards):
                out = net(Xte[i:i + 200])
                sums[0] += float((out.argmax(1) == Yte[i:i + 200]).sum())
                sums[1] += float(F.cross_entropy(out, Yte[i:i + 200], reduction="sum"))
                sums[2] += out.shape[0]
        return sums

    snapshots = []
    step = 0
    reached = None
    acc = 0.0
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(a.seed + epoch)
        perm = torch.randperm(n, generator=g)[rank * per_rank:(rank + 1) * per_rank]
        te = time.time()
        seen = 0
        loss_sum = 0.0
        model.train()
        for s in range(steps_per_epoch):
            if a.max_steps > 0 and step >= a.max_steps:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(a, step, total)
            idx = perm[s * a.batch_size:(s + 1) * a.batch_size]
            x, y = Xtr[idx], Ytr[idx]
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            loss_sum += float(loss) * len(idx)
            seen += len(idx)
            step += 1
            if rank == 0 and a.eval_every > 0 and step % a.eval_every == 0 and s + 1 < steps_per_epoch:
                snapshots.append((epoch, step, clock(),
                                  {k: v.detach().clone() for k, v in model.module.state_dict().items()},
                                  (netdev_tx_bytes() - tx0) / lo_share))
        model.eval()
        elapsed = clock()
        ev0 = time.time()
        sums = evaluate(model.module, rank, world)
        dist.all_reduce(sums)
        untimed[0] += time.time() - ev0
        acc = float(sums[0] / sums[2])
        if a.target_accuracy > 0 and reached is None and acc >= a.target_accuracy:
            reached = elapsed
        # The epoch's training loss over every rank's samples, as conduit train's bsp epoch records.
        ls = torch.tensor([loss_sum, float(seen)], dtype=torch.float64)
        dist.all_reduce(ls)
        train_loss = float(ls[0] / max(ls[1], 1))
        # Per epoch, rank 0's own counters (as conduit train's epoch records); the summary sums over ranks.
        tx = torch.tensor([(netdev_tx_bytes() - tx0) / lo_share, payload[0]], dtype=torch.float64)
        if metrics:
            metrics.write(finite_json({"kind": "epoch", "impl": "pytorch-ddp", "hook": a.hook, "epoch": epoch + 1,
                                      "train_loss": train_loss, "test_accuracy": acc,
                                      "test_loss": float(sums[1] / sums[2]),
                                      "samples_per_s": seen * world / max(ev0 - te, 1e-9),  # training only
                                      "time_s": elapsed, "bytes_sent": int(tx[0]), "bytes_payload": int(tx[1])})
                          + "\n")
            metrics.flush()
            print(f"epoch {epoch + 1}/{a.epochs}: test acc {100 * acc:.2f}%, {elapsed:.1f} s, "
                  f"{tx[0] / 1e6:.1f} MB sent", flush=True)
        if a.max_steps > 0 and step >= a.max_steps:
            break
    wall = clock()
    tx = torch.tensor([netdev_tx_bytes() - tx0, payload[0]], dtype=torch.float64)  # training's bytes, not the copies'
    # Every rank evaluates every copy on its share of the test set (as conduit train does): rank 0 alone took ~8 s a
    # copy and kept the others waiting past gloo's timeout with 35 copies.
    count = torch.tensor([len(snapshots)], dtype=torch.int64)
    dist.broadcast(count, 0)
    if int(count) > 0:
        final_state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        recv = {k: torch.empty_like(v) for k, v in final_state.items()}
        for i in range(int(count)):
            state = snapshots[i][3] if rank == 0 else recv
            for k in final_state:
                dist.broadcast(state[k], 0)
            model.module.load_state_dict(state)
            sums = evaluate(model.module, rank, world)
            dist.all_reduce(sums)
            if rank != 0:
                continue
            ep, st, at, _, sent = snapshots[i]
            sacc = float(sums[0] / sums[2])
            if a.target_accuracy > 0 and sacc >= a.target_accuracy and (reached is None or at < reached):
                reached = at
            metrics.write(finite_json({"kind": "eval", "impl": "pytorch-ddp", "epoch": ep + 1, "global_step": st,
                                      "test_accuracy": sacc, "test_loss": float(sums[1] / sums[2]),
                                      "time_s": at, "bytes_sent": sent}) + "\n")
        model.module.load_state_dict(final_state)
    dist.all_reduce(tx)
    if shared_lo:
        tx[0] /= world  # (every rank read the one machine-wide counter)
    # What ZeRO partitions: the optimizer's state tensors on rank 0 (momentum, Adam's moments; not its step counts).
    inner = opt.optim if a.zero else opt
    state_bytes = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                      if torch.is_tensor(t) and t.dim() > 0)
    if rank == 0:
        summary = {"impl": "pytorch-ddp", "model": a.model, "hook": a.hook, "optimizer": a.optimizer,
                   "zero": 1 if a.zero else 0, "optimizer_state_bytes_rank0": state_bytes,
                   "compressor": {"none": "none", "fp16": "fp16",
                                  "powersgd": f"powersgd:rank={a.powersgd_rank}"}[a.hook],
                   "workers": world, "epochs": a.epochs, "steps": step, "batch_size": a.batch_size,
                   "final_test_accuracy": acc, "wall_time_s": wall,
                   "target_accuracy": a.target_accuracy or None, "time_to_target_s": reached,
                   "bytes_on_wire": int(tx[0]), "bytes_payload": int(tx[1])}
        with open(os.path.join(a.output, "summary.json"), "w") as f:
            f.write(finite_json(summary, indent=2))
        metrics.close()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tune_malloc():
    """The glibc malloc thresholds `conduit` fixes at start (src/core/malloc_tuning.h), so the comparison is not
    between allocators: mmap threshold 32 MiB, trim threshold 256 MiB. Skipped as `conduit` skips it: when
    CONDUIT_MALLOC_TUNING is off or the environment sets malloc parameters of its own."""
    if os.environ.get("CONDUIT_MALLOC_TUNING", "1") in ("0", "false", "no", "off"):
        return
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
            v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                                      "MALLOC_MMAP_MAX_")):
        return
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    if libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 or libc.mallopt(M_TRIM_THRESHOLD, 256 << 20) != 1:
        sys.exit("ddp_train.py: mallopt refused the malloc thresholds")


def main(argv):
    a = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        tune_malloc()  # before torch allocates anything
        worker(a)
        return 0
    # One intra-op thread per worker, as `conduit train` gives its workers: torch.set_num_threads(1) does not reach
    # the pthread OpenBLAS, which read its own variable when it was loaded (2 threads a rank on 2 cores otherwise).
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(a.nprocs),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # Bound as `conduit train`'s launcher binds its workers (launcher.h: auto, rank k on CPU k mod C), so that a
    # comparison of the two runs both alike (the ZeRO table's DDP ran unbound beside bound Conduit workers).
    # (auto leaves a single worker every CPU, as the launcher does)
    cpus = cores_first(sorted(os.sched_getaffinity(0))) if a.bind != "none" else []
    bind = a.bind == "core" or (a.bind == "auto" and a.nprocs > 1 and
                                (a.nprocs <= len(cpus) or a.nprocs % len(cpus) == 0))
    # A SIGTERM (a script's deadline) stops the ranks as Ctrl-C does, and the run ends with 143: by default it ended
    # this process alone and left them running, loading the cores later runs measured on.
    terminated = []

    def stop(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, stop)
    procs = []
    try:
        for r in range(a.nprocs):
            procs.append(subprocess.Popen(
                [sys.executable, __file__] + argv, env=dict(env, RANK=str(r)),
                preexec_fn=(lambda c=cpus[r % len(cpus)]: os.sched_setaffinity(0, {c})) if bind else None))
        code = wait_ranks(procs)
    except KeyboardInterrupt:  # (while the ranks were starting: those started go)
        code = 130
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()
    return 128 + signal.SIGTERM if terminated else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
