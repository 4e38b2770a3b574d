"""Clone a running torchrun job: time from the request to the new job's first step, against
checkpoint-to-disk then a new job restoring it (issue 35, "Clone"). Both new jobs are pre-started.

    python -m experiments.torch_clone --quick                      # a small pass (~8 MB model)
    python -m experiments.torch_clone --mb 40 --reps 5             # the lead's run (idle machine)
    python -m experiments.torch_clone --plot experiments/results/torch_clone.json

One run, side by side: a source job (torchrun, 2 ranks, gloo, DDP, an MLP of ``--mb`` MB of
float32 weights, Adam: the state moved is about 3x that) trains continuously with both a
:class:`deepfreeze.torch.CloneServer` and a :class:`deepfreeze.torch.Checkpointer` (no
schedule: it writes only when asked). Two more torchrun jobs of 2 ranks each are started
before any measurement and build their model and optimizer, then wait:

* ``clone``: at the request (a file the driver writes, holding ``time.time()``), the job calls
  ``deepfreeze.torch.clone.receive`` and takes one training step.
* ``disk``: at the request, the new job's rank 0 asks the source for a checkpoint (a file; the
  source ranks agree on it with one all-reduce per step, ``ckpt.checkpoint()`` then
  ``ckpt.wait()``: committed on persistent, durable), polls every 5 ms for the source's "done"
  file, then ``deepfreeze.torch.restore`` (from persistent: the new job's scratch is empty) and
  one training step.

Measured: request -> end of the new job's first step, on its rank 0. ``reps`` rounds after one
warm-up round (not counted), the two approaches in an order rotated per round. Reported: mean,
standard error, n per approach, and disk/clone (ratio of the means, its standard error by the
delta method). The machine has 2 cores shared by 6 ranks: absolute times are pessimistic.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOKEN = "3" * 64


def _wait_file(path: str, timeout: float = 600.0, poll: float = 0.005) -> str:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(poll)
    with open(path) as f:
        return f.read()


def _put(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _model(mb: float, seed: int):
    import torch
    torch.manual_seed(seed)
    width = 1024
    layers = max(1, round(mb * (1 << 20) / 4 / (width * width)))
    return torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])


def _step(model, opt) -> None:
    import torch
    x = torch.randn(8, 1024)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _role(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, ROOT)
    import deepfreeze.torch as dft
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = args.work
    net = _model(args.mb, 1 if args.role == "src" else 2)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if args.role == "src":
        server = dft.CloneServer(model, opt, "127.0.0.1:0", timeout=300.0)
        ckpt = dft.Checkpointer(model, opt, name="tc", mode="async", scratch=os.path.join(work, f"scratch{rank}"),
                                persistent=os.path.join(work, "persistent"))
        if rank == 0:
            _put(os.path.join(work, "address"), server.address)
        asked = 0
        while True:
            _step(model, opt)
            ckpt.end_iteration()
            server.end_iteration()
            flag = torch.tensor([0], dtype=torch.int64)
            if rank == 0:
                flag[0] = 2 if os.path.exists(os.path.join(work, "stop")) else \
                    int(os.path.exists(os.path.join(work, f"ckreq_{asked}")))
            dist.broadcast(flag, 0)
            if flag.item() == 2:
                break
            if flag.item() == 1:
                ckpt.checkpoint()
                ckpt.wait()
                if rank == 0:
                    _put(os.path.join(work, f"ckdone_{asked}"), str(ckpt.step))
                asked += 1
        server.close()
        ckpt.close()
    else:
        _step(model, opt)  # warm: the first step's allocations, not the approach's
        _put(os.path.join(work, f"ready_{args.role}_r{rank}"), "1")
        for i in range(args.rounds):
            phases: dict = {}
            t_req = float(_wait_file(os.path.join(work, f"go_{args.role}_{i}")))
            if args.role == "clone":
                addr = _wait_file(os.path.join(work, "address"))
                info = dft.clone.receive(model, opt, addr, timeout=300.0)
                step = info.step
                phases = {k: round(v - t_req, 4) for k, v in info.timings.items() if k != "bytes_received"}
            else:
                if rank == 0:
                    _put(os.path.join(work, f"ckreq_{i}"), "1")
                step = int(_wait_file(os.path.join(work, f"ckdone_{i}")))
                dft.restore(model, opt, name="tc", mode="async", scratch=os.path.join(work, f"new{rank}"),
                            persistent=os.path.join(work, "persistent"))
            _step(model, opt)
            t = time.time() - t_req
            if rank == 0:
                _put(os.path.join(work, f"res_{args.role}_{i}"), json.dumps({"seconds": t, "step": step, "phases": phases}))
    dist.destroy_process_group()


def _torchrun(*args: str) -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe or sys.executable, *([] if exe else ["-m", "torch.distributed.run"]), "--standalone",
            "--nproc-per-node", "2", os.path.abspath(__file__), *args]


def _stats(xs: list[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "se": sd / math.sqrt(n) if n else 0.0, "n": n, "min": min(xs), "max": max(xs),
            "values": xs}


def drive(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="df-torch-clone-")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DEEPFREEZE_TOKEN=TOKEN, PYTHONWARNINGS="ignore")
    rounds = args.reps + 1
    common = ["--work", work, "--mb", str(args.mb), "--rounds", str(rounds)]
    procs = []
    try:
        for role in ("src", "clone", "disk"):
            log = open(os.path.join(work, f"{role}.log"), "w")
            procs.append(subprocess.Popen(_torchrun("--role", role, *common), env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        _wait_file(os.path.join(work, "address"))
        for role in ("clone", "disk"):
            for r in range(2):
                _wait_file(os.path.join(work, f"ready_{role}_r{r}"))
        got: dict[str, list[float]] = {"clone": [], "disk": []}
        for i in range(rounds):
            for role in (["clone", "disk"] if i % 2 == 0 else ["disk", "clone"]):
                _put(os.path.join(work, f"go_{role}_{i}"), repr(time.time()))
                res = json.loads(_wait_file(os.path.join(work, f"res_{role}_{i}")))
                if i:  # round 0: warm-up
                    got[role].append(res["seconds"])
                print(f"round {i} {role}: {res['seconds']:.3f} s (step {res['step']}) {res.get('phases') or ''}",
                      flush=True)
        _put(os.path.join(work, "stop"), "1")
        for p in procs:
            p.wait(300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    c, d = _stats(got["clone"]), _stats(got["disk"])
    r = d["mean"] / c["mean"]
    r_se = r * math.sqrt((d["se"] / d["mean"]) ** 2 + (c["se"] / c["mean"]) ** 2)
    return {"experiment": "torch_clone", "model_mb": args.mb, "state_mb": 3 * args.mb, "ranks": "2 -> 2",
            "reps": args.reps, "clone": c, "disk": d, "ratio_disk_over_clone": r, "ratio_se": r_se,
            "target": 3.0, "machine": f"{os.cpu_count()} cores, shared", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                              time.gmtime())}


def plot(path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        doc = json.load(f)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["clone (TCP)", "checkpoint + restore"]
    vals = [doc["clone"], doc["disk"]]
    ax.bar(names, [v["mean"] for v in vals], yerr=[v["se"] for v in vals], capsize=4, color=["#3a7", "#999"])
    ax.set_ylabel("request -> first step (s)")
    ax.set_title(f"torch clone, {doc['model_mb']} MB model, 2 -> 2: {doc['ratio_disk_over_clone']:.1f}x "
                 f"± {doc['ratio_se']:.1f}", fontsize=9)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=90)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["src", "clone", "disk"])
    ap.add_argument("--work")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mb", type=float, default=40.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="an 8 MB model, 3 reps")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "torch_clone.json"))
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.role:
        _role(args)
        return 0
    if args.quick:
        args.mb, args.reps = 8.0, 3
    doc = drive(args)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("ratio_disk_over_clone", "ratio_se")}), doc["clone"]["mean"],
          doc["disk"]["mean"])
    print(plot(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
