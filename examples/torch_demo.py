"""DeepFreeze for PyTorch demo: a 2-process torchrun DDP training with checkpoints, then a restore.

    torchrun --standalone --nproc-per-node 2 examples/torch_demo.py train OUT   # checkpoints every 10 steps
    python examples/torch_demo.py restore OUT                                   # plain process: restore + compare

Each rank simulates its own node: its own scratch directory and failure domain (partner copies
go to the other one), hence its own backend process. The persistent directory is shared. Rank
0 saves the state it had at the newest checkpoint (numpy, no pickle) as the reference the
restore is compared with, bit for bit.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import deepfreeze.torch  # noqa: E402
from deepfreeze.torch import Checkpointer  # noqa: E402

NAME = "torchdemo"
CFG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "veloc_cfg", "local.cfg")
STEPS, EVERY = 40, 10


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Dropout(0.2), torch.nn.Linear(16 * 16 * 16, 10))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def dirs(out: str, rank: int) -> dict[str, str]:
    return {"scratch": os.path.join(out, f"node{rank}", "scratch"), "persistent": os.path.join(out, "persistent"),
            "failure_domain": f"node{rank}"}


def state_arrays(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    from deepfreeze.torch._state import train_state
    st = train_state(net, [opt])
    return {s.name: t.detach().clone().reshape(s.shape).numpy() for s, t in zip(st.specs, st.tensors)}


def train(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, opt = build()
    model = torch.nn.parallel.DistributedDataParallel(net)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    ckpt = Checkpointer(model, opt, config=CFG, name=NAME, every_n_steps=EVERY, state={"sched": sched},
                        ec_interval=0, ec_scheme="partner", **dirs(out, rank))
    t0 = time.perf_counter()
    for step in range(ckpt.start_step, STEPS):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(64, 1, 16, 16, generator=g), torch.randint(0, 10, (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if rank == 0 and ckpt.step % EVERY == 0:
            np.savez(os.path.join(out, "reference.npz"), **state_arrays(net, opt), __version__=np.int64(ckpt.step))
    ckpt.close()  # waits for the flushes to persistent
    if rank == 0:
        t = [1e3 * (x["post_hook_s"] + x["wait_s"] + x["handoff_s"]) for x in ckpt.timings]
        print(f"demo: rank 0 trained {STEPS} steps in {time.perf_counter() - t0:.1f} s; {len(t)} checkpoints, ms in "
              f"the steps (capture, wait, hand-off): {', '.join(f'{x:.1f}' for x in t)} (the first builds the shard "
              f"plan and starts the engine); newest v{ckpt.last_version}")
    dist.destroy_process_group()


def restore(out: str) -> None:
    net, opt = build()
    torch.manual_seed(1)
    for p in net.parameters():  # other values: everything must come from the checkpoint
        torch.nn.init.normal_(p)
    version, step = deepfreeze.torch.restore(net, opt, CFG, name=NAME, **dirs(out, 0))
    with np.load(os.path.join(out, "reference.npz"), allow_pickle=False) as f:
        ref = {k: f[k] for k in f.files}
    assert int(ref.pop("__version__")) == version, (version, "reference")
    got = state_arrays(net, opt)
    bad = [k for k in ref if got[k].tobytes() != ref[k].tobytes()]
    if bad or set(got) != set(ref):
        sys.exit(f"demo: restore differs from the training state at v{version}: {bad[:5]}")
    print(f"demo: restored {NAME!r} v{version} (step {step}) in a plain process: {len(ref)} tensors (model and "
          "AdamW state) bit-identical to the training state")


if __name__ == "__main__":
    {"train": train, "restore": restore}[sys.argv[1]](sys.argv[2])
