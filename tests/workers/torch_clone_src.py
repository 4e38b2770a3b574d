"""Source job of the torch clone tests: one rank of ``torchrun`` (gloo, DDP) serving clones.

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_clone_src.py OUT [key=value ...]
    python tests/workers/torch_clone_src.py OUT [key=value ...]          (a job of one process)

keys: clones (stop once this many clones were started and 4 more steps ran), die=1 (rank 0's
sender ends the process after its first data frame: a source that dies mid-transfer),
max_steps (give up).

Rank 0 writes OUT/address (where clone jobs connect). Per rank, after every step's iteration
(optimizer.step() and scheduler.step()): OUT/src/s<step>_r<rank>.npz (:func:`flat_state`: no
pickles). At the end OUT/src/result_r<rank>.json: the steps clones were taken at, the agreement's
cost per step, every clone's outcome.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deepfreeze.clone.wire import Sender  # noqa: E402
from deepfreeze.torch import CloneServer  # noqa: E402


class Net(torch.nn.Module):
    """Linear, BatchNorm (buffers: taken whole from rank 0), dropout (RNG), linear."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def build(seed: int, world: int, hidden: int = 64):
    """(module, DDP-or-module, optimizer, scheduler) of a fresh model initialised with ``seed``."""
    torch.manual_seed(seed)
    net = Net(hidden)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    return net, model, opt, sched


def batches(rank: int, n: int) -> list:
    """This rank's batches, the same in every job (deterministic per rank and index)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


def train_step(model, opt, sched, x, y) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    sched.step()


def flat_state(net, opt, sched) -> dict:
    """The module's state dict, the optimizer's tensors (by parameter index and key) and the
    JSON of its param_groups, scalar state and the scheduler's state, as numpy arrays."""
    out = {f"m/{k}": v.detach().numpy().copy() for k, v in net.state_dict().items()}
    sd = opt.state_dict()
    scalars = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"o/{i}/{k}"] = v.detach().numpy().copy()
            else:
                scalars[f"{i}/{k}"] = v
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "sched": sched.state_dict()}
    out["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True, default=repr).encode(), np.uint8)
    return out


class DyingSender(Sender):
    """A source rank that dies right after its first data frame (fault injected by subclassing)."""

    def send_route(self, ch, route, data, deadline):
        super().send_route(ch, route, data, deadline)
        os._exit(3)


def main() -> None:
    out = sys.argv[1]
    kv = dict(a.split("=", 1) for a in sys.argv[2:])
    clones, die, max_steps = int(kv.get("clones", 1)), kv.get("die") == "1", int(kv.get("max_steps", 4000))
    if "WORLD_SIZE" in os.environ:  # torchrun; else a one-process job
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    net, model, opt, sched = build(7, world)
    server = CloneServer(model, opt, "127.0.0.1:0", state={"sched": sched}, timeout=20.0, threshold=256,
                         sender_cls=DyingSender if die and rank == 0 else Sender)
    os.makedirs(os.path.join(out, "src"), exist_ok=True)
    if rank == 0:
        with open(os.path.join(out, "address.tmp"), "w") as f:
            f.write(server.address)
        os.replace(os.path.join(out, "address.tmp"), os.path.join(out, "address"))
    data = batches(rank, max_steps)
    step, taken, stop_at = 0, [], None
    for x, y in server.iterate(data):
        train_step(model, opt, sched, x, y)
        step += 1
        np.savez(os.path.join(out, "src", f"s{step}_r{rank}.npz"), **flat_state(net, opt, sched))
        if server.last_clone_step == step:
            taken.append(step)
            if server.served >= clones:
                stop_at = step + 4
        if stop_at is not None and step >= stop_at:
            break
        # the pace of the source's steps while it waits for its clone jobs to start (each imports torch):
        # every step trains, records its state and agrees over gloo on both ranks, so a faster pace is
        # more CPU for the same wait (0.01 s: 2,753 steps, 85 CPU-s for test_torch_clone's first test on
        # a loaded machine)
        time.sleep(0.1)
    error = None
    try:
        server.wait()
    except Exception as e:  # recorded for the test
        error = f"{type(e).__name__}: {e}"
    n = server.agreements
    res = {"taken": taken, "steps": step, "agree_us_per_step": 1e6 * server.agree_s / max(n, 1), "agreements": n,
           "clones": server.clones, "error": error}
    with open(os.path.join(out, "src", f"result_r{rank}.json"), "w") as f:
        json.dump(res, f)
    server.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
