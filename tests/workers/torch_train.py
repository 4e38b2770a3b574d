"""DeepFreeze-for-PyTorch training worker (one rank of ``torchrun``, or a plain process).

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_train.py OUT [key=value ...]

keys: name, steps (loop iterations), every (every_n_steps), mode, resume=1, kill_at=IT (rank
kill_rank SIGKILLs itself at the start of iteration IT, once a version is committed), overlap=0, scaler=1 (CPU GradScaler
whose first scales overflow, so steps are skipped), slow=SECONDS (the capture copy sleeps that
long per piece), mutate_at=IT (an in-place change of a parameter right after the checkpoint
step of iteration IT-1, while the capture copy runs), add_group_at=IT (add_param_group),
ec=1 (partner copies across simulated nodes node<rank>, exchanged over the checkpointer's gloo
group), memtier=PATH (shards go to that memory-tier device, ranks sharing it as one node's do),
scratch/persistent roots (default under OUT). ``OUT [key=value ...] -- OUT2 [key=value ...] ...``:
one run after the other in one job (each from a fresh model, seeded as the first; a kill_at ends
the job in its run).

The model has BatchNorm (buffers) and dropout (torch RNG); the data adds numpy and Python
random noise (their RNG states), and its position is a Stateful object. Two optimizers
(AdamW on the body, SGD with momentum on the head), an LR scheduler on each. Deterministic on
CPU. Per rank it writes (numpy .npz, no pickles):

  OUT/r<rank>/v<version>.npz   the state right after each checkpointed iteration (model, optimizer
                               state tensors by their checkpoint names, lr of every group)
  OUT/r<rank>/final.npz        the state at the end
  OUT/r<rank>/info.json        start_step, resumed_from, torn versions, failures, plans
"""
import faulthandler
import json
import os
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import deepfreeze.torch.checkpointer  # noqa: E402
from deepfreeze.torch import Checkpointer  # noqa: E402
from deepfreeze.torch.capture import Capture  # noqa: E402

IN, HID, OUT_F = 16, 192, 4


def committed_before_kill(ckpt, limit: float = 120.0) -> None:
    """Before ``kill_at`` kills this rank: wait (bounded) until some version is committed on
    persistent, so "the job resumes from a version taken before the kill" does not depend on
    how fast the first checkpoint's backend process started against how fast the loop runs (an
    idle machine reached the kill before anything was committed). The other rank waits in its
    collective meanwhile; nothing of this rank's state changes."""
    from deepfreeze.loader import list_versions
    deadline = time.monotonic() + limit
    while not any("persistent" in levels for levels in list_versions(ckpt.config, ckpt.name).values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"test: no version of {ckpt.name!r} committed within {limit} s before kill_at")
        time.sleep(0.05)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.BatchNorm1d(HID), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.3), torch.nn.Linear(HID, HID), torch.nn.ReLU())
        self.head = torch.nn.Linear(HID, OUT_F)
        self.extra = torch.nn.Linear(HID, OUT_F)  # joins the head's optimizer later (add_group_at)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + 0.1 * self.extra(h)


class Data:
    """The data position: a hand-written Stateful (state_dict/load_state_dict)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.it = rank, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.it + self.rank)
        x = torch.randn(32, IN, generator=g)
        y = torch.randn(32, OUT_F, generator=g)
        x = x + float(np.random.rand()) * 0.01 + random.random() * 0.01  # numpy and Python RNG
        self.it += 1
        return x, y

    def state_dict(self) -> dict:
        return {"it": self.it, "rank": self.rank}

    def load_state_dict(self, sd: dict) -> None:
        self.it = int(sd["it"])


def build(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    body = torch.optim.AdamW(net.body.parameters(), lr=3e-3, weight_decay=0.01)
    head = torch.optim.SGD(net.head.parameters(), lr=1e-2, momentum=0.9)
    return net, [body, head]


def snapshot(model: torch.nn.Module, opts, path: str) -> None:
    """Model state, optimizer state tensors (checkpoint names) and every group's lr."""
    from deepfreeze.torch._state import train_state
    st = train_state(model, opts)
    arrays = {s.name: t.detach().clone().reshape(s.shape).numpy() for s, t in zip(st.specs, st.tensors)}
    arrays["__lr__"] = np.array([g["lr"] for o in opts for g in o.param_groups], dtype=np.float64)
    np.savez(path, **arrays)


def optimize(opts, scheds, scaler=None) -> None:
    """Every optimizer's step (through the GradScaler if given, then its update), every
    optimizer's zero_grad, every scheduler's step."""
    for o in opts:
        if scaler is not None:
            scaler.step(o)
        else:
            o.step()
    if scaler is not None:
        scaler.update()
    for o in opts:
        o.zero_grad()
    for s in scheds:
        s.step()


def train_step(model, opts, scheds, data, ckpt, every: int, mydir: str, net, scaler=None) -> None:
    """One iteration of the test loop (forward, backward, every optimizer's step, through the
    GradScaler if given, zero_grad, every scheduler's step); the state right after a
    checkpointed step goes to ``mydir/v<step>.npz``."""
    before = ckpt.step
    x, y = data.next()
    loss = torch.nn.functional.mse_loss(model(x), y)
    if scaler is not None:
        scaler.scale(loss * 8).backward()  # x8: the first scales overflow, so steps are skipped
    else:
        loss.backward()
    optimize(opts, scheds, scaler)
    if ckpt.step != before and ckpt.step % every == 0:
        snapshot(net, opts, os.path.join(mydir, f"v{ckpt.step}.npz"))


def restore_setup():
    """The common start of the restore workers: ``(out, src, kw, distributed, rank, size, net,
    opts)``, the model built with other initial values (everything must come from the checkpoint)."""
    out, src = sys.argv[1], sys.argv[2]
    kw = dict(a.split("=", 1) for a in sys.argv[3:])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    size = dist.get_world_size() if distributed else 1
    net, opts = build(seed=123)
    return out, src, kw, distributed, rank, size, net, opts


def quiet_gloo(limit: float = 5.0) -> None:
    """Before a fork (a DataLoader starting its workers): wait until no gloo work thread of this
    process is running (at most ``limit`` seconds, the GIL released meanwhile).

    A gloo work thread destroys each finished collective's work and with it Python objects
    (``PyGILState_Ensure`` makes it a thread state, under the interpreter's thread-list lock and
    without the GIL); a child forked while it holds that lock hangs for ever inside ``os.fork()`` on
    CPython 3.11.7, this machine's Python (CPython gh-112275; seen in a plain DDP loop without
    DeepFreeze too: docs/torch.md). Such a thread is running while it holds the lock; once every one
    sleeps, one takes it again only for new work, which comes from the thread that is forking (or
    from a Checkpointer's writer thread where its group is in use: a window of microseconds left)."""
    me, deadline = threading.get_native_id(), time.monotonic() + limit
    while time.monotonic() < deadline:
        busy = False
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # (exited meanwhile)
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            if int(tid) != me and name.startswith("pt_gloo") and state in "RD":
                busy = True
                break
        if not busy:
            return
        time.sleep(0.001)


def begin() -> tuple[str, dict, bool, int, int]:
    """The common start of the torch test workers: ``(OUT, {key: value}, distributed, rank,
    size)``; torch.distributed (gloo) under torchrun, deterministic CPU algorithms on one
    thread, numpy's and Python's RNGs seeded per rank."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that times out asks where each rank is
    os.register_at_fork(before=quiet_gloo)  # the loaders' workers are forked (see quiet_gloo)
    out = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    size = dist.get_world_size() if distributed else 1
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    np.random.seed(7 + rank)
    random.seed(11 + rank)
    return out, kw, distributed, rank, size


def main() -> None:
    later = sys.argv[2:]
    sys.argv[2:], later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
    out, kw, distributed, rank, _ = begin()
    train(out, kw, distributed, rank)
    while later:  # -- OUT2 [key=value ...]: another run in this job, under OUT2, seeded as the first
        later = later[1:]
        this, later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
        np.random.seed(7 + rank)
        random.seed(11 + rank)
        train(this[0], dict(a.split("=", 1) for a in this[1:]), distributed, rank)
    if distributed:
        dist.destroy_process_group()


def train(out: str, kw: dict, distributed: bool, rank: int) -> None:
    net, opts = build()
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.7), torch.optim.lr_scheduler.ExponentialLR(opts[1], 0.95)]
    scaler = None
    state = {"data": Data(rank), "sched0": scheds[0], "sched1": scheds[1]}
    if kw.get("scaler") == "1":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=3)
        state["scaler"] = scaler
    cls = Checkpointer
    if float(kw.get("slow", 0)) > 0:
        delay = float(kw["slow"])

        class SlowCopy(Capture):  # fault injected by subclassing: a slowed capture copy
            def _copy(self, items, buf):
                time.sleep(delay * len(items))  # as slow as `delay` per piece
                super()._copy(items, buf)
        deepfreeze.torch.checkpointer.Capture = SlowCopy  # the Checkpointer's capture
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    ckpt = cls(model, opts, name=kw.get("name", "tt"), every_n_steps=int(kw.get("every", 3)),
               resume=kw.get("resume") == "1", state=state, overlap=kw.get("overlap", "1") == "1",
               on_error=kw.get("on_error", "raise"), mode=kw.get("mode", "async"),
               scratch=kw.get("scratch", os.path.join(out, f"scratch{rank}")),
               persistent=kw.get("persistent", os.path.join(out, "persistent")), min_shard_bytes=4096,
               **({"ec_interval": 0, "ec_scheme": "partner", "failure_domain": f"node{rank}"} if kw.get("ec") == "1"
                  else {}), **({"memtier": kw["memtier"]} if kw.get("memtier") else {}))
    data = state["data"]
    steps = int(kw.get("steps", 12))
    kill_at = int(kw.get("kill_at", -1))
    mutate_at = int(kw.get("mutate_at", -1))
    add_group_at = int(kw.get("add_group_at", -1))
    every = int(kw.get("every", 3))
    while data.it < steps:
        if data.it == kill_at and rank == int(kw.get("kill_rank", 1)):
            committed_before_kill(ckpt)
            os.kill(os.getpid(), signal.SIGKILL)
        if data.it == add_group_at:
            opts[1].add_param_group({"params": list(net.extra.parameters()), "lr": 5e-3})
        if data.it == mutate_at:
            with torch.no_grad():
                net.head.weight.mul_(1.0)  # bumps _version while the capture copies
        train_step(model, opts, scheds, data, ckpt, every, mydir, net, scaler)
    snapshot(net, opts, os.path.join(mydir, "final.npz"))
    ckpt.close()
    last = os.path.join(mydir, f"v{ckpt.step}.npz")
    if ckpt.last_version == ckpt.step and not os.path.exists(last):  # save_last's version at close: the final state
        shutil.copyfile(os.path.join(mydir, "final.npz"), last)
    info = {"start_step": ckpt.start_step, "resumed_from": ckpt.resumed_from, "torn": ckpt.torn,
            "failures": ckpt.failures, "plans": ckpt.plans, "step": ckpt.step, "it": data.it,
            "last_version": ckpt.last_version}
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
