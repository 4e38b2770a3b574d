"""Clone a running torchrun job: time from the request to the state being ready on every rank of
the new job (before its first step), against checkpoint-to-disk then a restore, warm and cold
(issue 44, item 3). All new jobs are pre-started.

    python -m experiments.torch_clone --quick                      # a small pass (~8 MB model, 3 reps)
    python -m experiments.torch_clone --mb 40 --reps 8             # the lead's run (idle machine)
    python -m experiments.torch_clone --plot experiments/results/torch_clone.json
    # before/after in the same run: a fourth job importing another tree's deepfreeze
    git archive <commit> | tar -x -C /tmp/df-before && python -m experiments.torch_clone --before /tmp/df-before

One run, side by side: a source job (torchrun, 2 ranks, gloo, DDP, an MLP of ``--mb`` MB of
float32 weights, Adam: the state moved is about 3x that) trains continuously with both a
:class:`deepfreeze.torch.CloneServer` and a :class:`deepfreeze.torch.Checkpointer` (no
schedule: it writes only when asked), recording every step's start and end. Two more torchrun
jobs of 2 ranks each are started before any measurement, build their model and optimizer, take
one step (so every allocation is warm), then wait:

* ``clone``: at the request (a file the driver writes, holding ``time.time()``), every rank
  calls ``deepfreeze.torch.clone.receive``; ready when it returns (the state is in the model,
  the optimizer, and the RNG).
* ``clone_before`` (with ``--before TREE``): the same as ``clone`` in a job that imports TREE's
  DeepFreeze (the source is this tree's: the wire is the same), for a before/after pass.
* ``warm`` and ``cold`` (one job, the mode in the request): rank 0 asks the source for a
  checkpoint (a file; the source ranks agree on it with one broadcast per step,
  ``ckpt.checkpoint()`` then ``ckpt.wait()``: committed on persistent, durable), polls every
  5 ms for the source's "done" file; then (``cold`` only, not timed) every file of the
  checkpoint (persistent and the source's scratch) is ``fsync``ed and dropped from the page
  cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), and both ranks meet at a barrier; then every
  rank runs ``deepfreeze.torch.restore`` (from persistent: the new job's scratch is empty).
  Ready = (done seen - request) + the restore's duration, per rank.

Measured: request -> state ready on *every* rank (the largest of the ranks'). ``reps`` rounds
after one warm-up round (not counted), the approaches in an order rotated per round.
Reported: mean, standard error, n per approach; warm/clone and cold/clone (ratio of the means,
its standard error by the delta method); the source's step-time increase during each approach
(the steps that overlap the window from the request to ready on every rank, against the median
step outside every window: extra source seconds per clone, mean step time increase in %); the
clone's phases (request -> all bytes on the rank, -> loaded); the load average at the start.
The machine has 2 cores shared by 6 ranks: absolute times are pessimistic.
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
APPROACHES = ("clone", "warm", "cold")


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


def drop_cache(roots: list[str]) -> int:
    """``fsync`` every file under ``roots``, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` it: its
    pages leave the page cache (a cold read follows). Returns the bytes dropped."""
    total = 0
    for root in roots:
        for d, _, files in os.walk(root):
            for name in files:
                path = os.path.join(d, name)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue  # (a temporary file renamed meanwhile)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    total += os.fstat(fd).st_size
                finally:
                    os.close(fd)
    return total


def _source(args: argparse.Namespace, model, opt, rank: int) -> None:
    import torch
    import torch.distributed as dist
    import deepfreeze.torch as dft
    work = args.work
    server = dft.CloneServer(model, opt, "127.0.0.1:0", timeout=300.0)
    ckpt = dft.Checkpointer(model, opt, name="tc", mode="async", scratch=os.path.join(work, f"scratch{rank}"),
                            persistent=os.path.join(work, "persistent"))
    if rank == 0:
        _put(os.path.join(work, "address"), server.address)
    asked, steps = 0, []
    while True:
        t0 = time.time()
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
        steps.append((t0, time.time()))
    if rank == 0:
        _put(os.path.join(work, "steps.json"), json.dumps({"steps": steps, "clones": server.clones}))
    server.close()
    ckpt.close()


def _role(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, args.lib or ROOT)
    import deepfreeze.torch as dft
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = args.work
    net = _model(args.mb, 1 if args.role == "src" else 2)
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if args.role == "src":
        _source(args, model, opt, rank)
        dist.destroy_process_group()
        return
    _step(model, opt)  # warm: the first step's allocations, not the approach's
    tag = args.tag or args.role
    _put(os.path.join(work, f"ready_{tag}_r{rank}"), "1")
    n_ck = 0
    for i in range(args.rounds):
        for _ in range(1 if args.role == "clone" else 2):
            go = json.loads(_wait_file(os.path.join(work, f"go_{tag}_{i}_{_}")))
            t_req, mode = go["t"], go["mode"]
            res: dict = {"mode": mode}
            cpu0 = time.process_time()
            if args.role == "clone":
                addr = _wait_file(os.path.join(work, "address"))
                info = dft.clone.receive(model, opt, addr, timeout=300.0)
                res["ready"] = time.time() - t_req
                res["step"] = info.step
                res["phases"] = {k: round(v - t_req, 4) for k, v in info.timings.items()
                                 if k in ("requested", "first_data", "received", "loaded")}
                res["bytes"] = {k: v for k, v in info.timings.items() if k.startswith(("bytes_", "state_"))}
            else:
                if rank == 0:
                    _put(os.path.join(work, f"ckreq_{n_ck}"), "1")
                res["step"] = int(_wait_file(os.path.join(work, f"ckdone_{n_ck}")))
                n_ck += 1
                ck = time.time() - t_req
                if mode == "cold" and rank == 0:
                    roots = [os.path.join(work, "persistent")] + [os.path.join(work, f"scratch{r}") for r in range(2)]
                    res["dropped_bytes"] = drop_cache(roots)
                dist.barrier()
                t0 = time.time()
                dft.restore(model, opt, name="tc", mode="async", scratch=os.path.join(work, f"new{rank}"),
                            persistent=os.path.join(work, "persistent"))
                res["restore"] = time.time() - t0
                res["checkpoint"] = ck
                res["ready"] = ck + res["restore"]
            res["cpu_s"] = time.process_time() - cpu0  # this rank's CPU (every thread) for the approach
            _put(os.path.join(work, f"res_{mode}_{i}_r{rank}"), json.dumps(res))
    dist.destroy_process_group()


def _torchrun(*args: str) -> list[str]:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe or sys.executable, *([] if exe else ["-m", "torch.distributed.run"]), "--standalone",
            "--nproc-per-node", "2", os.path.abspath(__file__), *args]


def _stats(xs: list[float]) -> dict:
    n = len(xs)
    mean = sum(xs) / n if n else float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "se": sd / math.sqrt(n) if n else 0.0, "n": n, "min": min(xs, default=None),
            "max": max(xs, default=None), "values": xs}


def ratio(num: dict, den: dict) -> tuple[float, float]:
    """``num.mean / den.mean`` and its standard error by the delta method (independent means)."""
    r = num["mean"] / den["mean"]
    return r, r * math.sqrt((num["se"] / num["mean"]) ** 2 + (den["se"] / den["mean"]) ** 2)


def step_cost(steps: list[list[float]], windows: dict[str, list[tuple[float, float]]]) -> dict:
    """The source's step-time increase per approach: for each window (request -> ready on every
    rank), the steps that overlap it, their time above the median step outside every window
    (extra seconds) and their mean duration against that median (%)."""
    def overlaps(s: list[float], w: tuple[float, float]) -> bool:
        return s[0] < w[1] and s[1] > w[0]
    every = [w for ws in windows.values() for w in ws]
    quiet = sorted(s[1] - s[0] for s in steps if not any(overlaps(s, (a, b + 0.5)) for a, b in every))
    base = quiet[len(quiet) // 2] if quiet else float("nan")
    out: dict = {"baseline_step_s": base, "quiet_steps": len(quiet)}
    for name, ws in windows.items():
        extra, pct = [], []
        for w in ws:
            during = [s[1] - s[0] for s in steps if overlaps(s, w)]
            if during:
                extra.append(sum(during) - len(during) * base)
                pct.append(100.0 * (sum(during) / len(during) / base - 1.0))
        out[name] = {"extra_s": _stats(extra), "step_increase_pct": _stats(pct)}
    return out


def drive(args: argparse.Namespace) -> dict:
    work = tempfile.mkdtemp(prefix="df-torch-clone-", dir=args.tmp)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DEEPFREEZE_TOKEN=TOKEN, PYTHONWARNINGS="ignore")
    rounds = args.reps + 1
    common = ["--work", work, "--mb", str(args.mb), "--rounds", str(rounds)]
    load = os.getloadavg()
    procs = []
    approaches = APPROACHES + (("clone_before",) if args.before else ())
    got: dict[str, list[float]] = {a: [] for a in approaches}
    windows: dict[str, list[tuple[float, float]]] = {a: [] for a in approaches}
    detail: list[dict] = []
    clone_reqs: list[tuple[float, "dict | None"]] = []  # every clone's request (warm-up too), its detail
    try:
        jobs = [("src", "src", ROOT), ("clone", "clone", ROOT), ("disk", "disk", ROOT)]
        if args.before:  # the same clone job on another tree's DeepFreeze (the source is this tree's)
            jobs.append(("clone", "clone_before", os.path.abspath(args.before)))
        for role, tag, lib in jobs:
            log = open(os.path.join(work, f"{tag}.log"), "w")
            procs.append(subprocess.Popen(_torchrun("--role", role, "--tag", tag, "--lib", lib, *common),
                                          env={**env, "PYTHONPATH": lib}, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        _wait_file(os.path.join(work, "address"))
        for _r, tag, _l in jobs[1:]:
            for r in range(2):
                _wait_file(os.path.join(work, f"ready_{tag}_r{r}"))
        k = len(approaches)
        for i in range(rounds):
            order = approaches[i % k:] + approaches[:i % k]
            n_disk = 0
            for mode in order:
                role = mode if mode in ("clone", "clone_before") else "disk"
                idx = 0 if role != "disk" else n_disk
                n_disk += role == "disk"
                t_req = time.time()
                _put(os.path.join(work, f"go_{role}_{i}_{idx}"), json.dumps({"t": t_req, "mode": mode}))
                res = [json.loads(_wait_file(os.path.join(work, f"res_{mode}_{i}_r{r}"))) for r in range(2)]
                ready = max(x["ready"] for x in res)
                row = {"round": i, "approach": mode, "ready": ready, "ranks": res}
                if i:  # round 0: warm-up
                    got[mode].append(ready)
                    windows[mode].append((t_req, t_req + ready))
                    detail.append(row)
                if role != "disk":
                    clone_reqs.append((t_req, row if i else None))
                extra = {k: res[0][k] for k in ("phases", "checkpoint", "restore", "cpu_s") if k in res[0]}
                print(f"round {i} {mode}: ready on every rank {ready:.3f} s (step {res[0]['step']}) {extra}",
                      flush=True)
                time.sleep(args.gap)
        _put(os.path.join(work, "stop"), "1")
        for p in procs:
            p.wait(300)
        src = json.loads(_wait_file(os.path.join(work, "steps.json"), timeout=60))
        steps = src["steps"]
        for (t_req, row), c in zip(clone_reqs, src["clones"]):  # the source's sends began (its step K)
            if row is not None:
                if "at" in c:
                    row["source_sends_began"] = c["at"] - t_req
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    stats = {a: _stats(got[a]) for a in approaches}
    rw, rw_se = ratio(stats["warm"], stats["clone"])
    rc, rc_se = ratio(stats["cold"], stats["clone"])
    before = {}
    if args.before:
        rb, rb_se = ratio(stats["clone_before"], stats["clone"])
        before = {"before_tree": os.path.abspath(args.before), "ratio_before_over_clone": rb, "ratio_before_se": rb_se,
                  "ratio_warm_over_before": ratio(stats["warm"], stats["clone_before"]),
                  "ratio_cold_over_before": ratio(stats["cold"], stats["clone_before"])}
    return {"experiment": "torch_clone", "measure": "request -> state ready on every rank of the new job",
            "model_mb": args.mb, "state_mb": 3 * args.mb, "ranks": "2 -> 2", "reps": args.reps,
            "approaches": stats, "ratio_warm_over_clone": rw, "ratio_warm_se": rw_se,
            "ratio_cold_over_clone": rc, "ratio_cold_se": rc_se,
            "targets": {"warm_over_clone": ">= 1.0", "cold_over_clone": ">= 1.5"},
            "source_steps": step_cost(steps, windows), "rounds": detail,
            **before,
            "clone_phases": {k: _stats([r["ranks"][0]["phases"][k] for r in detail
                                        if r["approach"] == "clone" and k in r["ranks"][0]["phases"]])
                             for k in ("requested", "first_data", "received", "loaded")}
            | {"source_sends_began": _stats([r["source_sends_began"] for r in detail
                                            if r["approach"] == "clone" and "source_sends_began" in r])},
            "loadavg_at_start": list(load), "machine": f"{os.cpu_count()} cores",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plot(path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        doc = json.load(f)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = ["clone (TCP)", "checkpoint + restore\n(warm cache)", "checkpoint + restore\n(cold)"]
    keys = list(APPROACHES)
    if "clone_before" in doc["approaches"]:
        names.append("clone, before\n(flat buffers + rebuild)")
        keys.append("clone_before")
    vals = [doc["approaches"][a] for a in keys]
    ax.bar(names, [v["mean"] for v in vals], yerr=[v["se"] for v in vals], capsize=4,
           color=["#3a7", "#999", "#777", "#9cb"][:len(keys)])
    ax.set_ylabel("request -> state ready on every rank (s)")
    src = doc["source_steps"]
    ax.set_title(f"torch clone, {doc['model_mb']:g} MB model ({doc['state_mb']:g} MB state), 2 -> 2\n"
                 f"warm/clone {doc['ratio_warm_over_clone']:.2f} ± {doc['ratio_warm_se']:.2f}, "
                 f"cold/clone {doc['ratio_cold_over_clone']:.2f} ± {doc['ratio_cold_se']:.2f}; source step "
                 f"+{src['clone']['step_increase_pct']['mean']:.0f} % during a clone", fontsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=90)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["src", "clone", "disk"])
    ap.add_argument("--tag", help="(a job's name in the work directory; default: its role)")
    ap.add_argument("--lib", help="(the tree whose deepfreeze a job imports)")
    ap.add_argument("--before", metavar="TREE", help="also a clone job importing TREE's deepfreeze (e.g. "
                    "`git archive <commit> | tar -x -C TREE`), served by the same source, interleaved: before/after")
    ap.add_argument("--work")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mb", type=float, default=40.0)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between two measurements (quiet source steps)")
    ap.add_argument("--tmp", default=None, help="where the work directory goes (default: the system's temp)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
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
    a = doc["approaches"]
    print(f"clone {a['clone']['mean']:.3f} ± {a['clone']['se']:.3f} s, warm {a['warm']['mean']:.3f} ± "
          f"{a['warm']['se']:.3f}, cold {a['cold']['mean']:.3f} ± {a['cold']['se']:.3f}; warm/clone "
          f"{doc['ratio_warm_over_clone']:.2f} ± {doc['ratio_warm_se']:.2f}, cold/clone "
          f"{doc['ratio_cold_over_clone']:.2f} ± {doc['ratio_cold_se']:.2f}; load at start {doc['loadavg_at_start']}")
    if "clone_before" in a:
        print(f"clone before {a['clone_before']['mean']:.3f} ± {a['clone_before']['se']:.3f} s; before/after "
              f"{doc['ratio_before_over_clone']:.2f} ± {doc['ratio_before_se']:.2f}")
    print(json.dumps({k: v for k, v in doc["source_steps"].items()}, default=str)[:2000])
    print(plot(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
