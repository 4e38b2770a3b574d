"""Worker of tests/test_torch_checks.py (one rank of ``torchrun``): the resume checks, the
Checkpointer built before ``init_process_group``, tied weights under DDP.

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_checks.py MODE OUT [SRC]

MODE:
  mismatch  first build a Checkpointer *before* dist.init_process_group (the error, type and
            message: OUT/r<rank>/preinit.json); then, with the process group, resume SRC, a
            finished tests/workers/torch_train.py run, with SGD in place of its AdamW (strict: the
            error, and whether the model, the optimizers and the state= objects are unchanged
            after it), then with strict=False (what was skipped; OUT/r<rank>/result.json, and the
            model as restored, OUT/r<rank>/model.npz)
  tied      train a model with tied weights (lm_head.weight is wte.weight) under DDP, a checkpoint
            every 2 steps (OUT/r<rank>/v<step>.npz: the state right after), then restore the newest
            version into a fresh tied model (OUT/r<rank>/restored.npz, result.json: still tied?)
"""
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_train import Data, build, snapshot  # noqa: E402
import deepfreeze.torch  # noqa: E402
from deepfreeze.errors import DeepFreezeError  # noqa: E402


class Tied(torch.nn.Module):
    """A tiny language model whose output projection is its embedding (GPT-2's weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(50, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mid(self.wte(x))))


def where(root: str, rank: int) -> dict:
    return {"mode": "sync", "scratch": os.path.join(root, f"scratch{rank}"),
            "persistent": os.path.join(root, "persistent")}


def state_bytes(net, opts, state) -> bytes:
    """Every tensor and number of the model, the optimizers and the state= objects, as bytes."""
    parts = [t.detach().numpy().tobytes() for t in net.state_dict().values()]
    for o in opts:
        sd = o.state_dict()
        parts.append(repr(sd["param_groups"]).encode())
        for kv in sd["state"].values():
            parts += [v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode() for v in kv.values()]
    parts += [repr(o.state_dict()).encode() for o in state.values()]
    return b"".join(parts)


def write(out: str, rank: int, name: str, obj: dict) -> None:
    d = os.path.join(out, f"r{rank}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "w") as f:
        json.dump(obj, f)


def preinit(out: str) -> None:
    rank = int(os.environ["RANK"])
    net, opts = build(seed=7)
    try:
        ck = deepfreeze.torch.Checkpointer(net, opts, name="pre", **where(out, rank))
        ck.close()
        res = {"error": None}
    except DeepFreezeError as e:
        res = {"error": type(e).__name__, "message": str(e)}
    write(out, rank, "preinit.json", res)


def mismatch(out: str, src: str) -> None:
    preinit(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net, opts = build(seed=123)
    opts[0] = torch.optim.SGD(net.body.parameters(), lr=3e-3, momentum=0.9)  # the checkpoint's is AdamW
    model = torch.nn.parallel.DistributedDataParallel(net)
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.7), torch.optim.lr_scheduler.ExponentialLR(opts[1], 0.95)]
    state = {"data": Data(rank), "sched0": scheds[0], "sched1": scheds[1]}
    before = state_bytes(net, opts, state)
    res = {}
    try:
        deepfreeze.torch.Checkpointer(model, opts, name="tt", resume=True, state=state, **where(src, rank)).close()
        res["strict"] = None
    except DeepFreezeError as e:
        res["strict"] = [type(e).__name__, str(e)]
    res["unchanged"] = state_bytes(net, opts, state) == before
    ck = deepfreeze.torch.Checkpointer(model, opts, name="tt", resume=True, state=state, strict=False,
                                       **where(src, rank))
    res.update(resumed_from=ck.resumed_from, skipped=ck.skipped, data_it=state["data"].it,
               sgd_state=len(opts[0].state), head_state=len(opts[1].state))
    ck.close()
    write(out, rank, "result.json", res)
    np.savez(os.path.join(out, f"r{rank}", "model.npz"),
             **{k: v.detach().numpy() for k, v in net.state_dict().items()})
    dist.destroy_process_group()


def tied(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Tied()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model = torch.nn.parallel.DistributedDataParallel(net)
    ck = deepfreeze.torch.Checkpointer(model, opt, name="tied", every_n_steps=2, **where(out, rank))
    os.makedirs(os.path.join(out, f"r{rank}"), exist_ok=True)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randint(0, 50, (8, 5), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ck.step % 2 == 0:
            snapshot(net, [opt], os.path.join(out, f"r{rank}", f"v{ck.step}.npz"))
    ck.close()
    torch.manual_seed(99)
    fresh = Tied()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    version, step = deepfreeze.torch.restore(torch.nn.parallel.DistributedDataParallel(fresh), fopt, name="tied",
                                             **where(out, rank))
    snapshot(fresh, [fopt], os.path.join(out, f"r{rank}", "restored.npz"))
    write(out, rank, "result.json", {"version": version, "tied": fresh.lm_head.weight is fresh.wte.weight,
                                     "state_keys": sorted(fopt.state_dict()["state"])})
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "mismatch":
        mismatch(out, sys.argv[3])
    else:
        tied(out)
