"""Restore a DeepFreeze-for-PyTorch checkpoint into a fresh model and optimizers, at any world size.

    torchrun --standalone --nproc-per-node N tests/workers/torch_restore.py OUT SRC version=V [name=tt]
    python tests/workers/torch_restore.py OUT SRC ...          (a plain process)
    torchrun ... tests/workers/torch_restore.py OUT SRC [key=value ...] -- OUT2 SRC2 [key=value ...] ...

SRC is the training job's OUT (its scratch<rank> and persistent directories; a rank beyond the
training's world size has an empty scratch). Writes OUT/r<rank>/restored.npz (the state, as
torch_train.snapshot) and OUT/r<rank>/info.json ({"version", "step", "world_size"}). Each
``-- OUT2 SRC2 [key=value ...]``: one more restore in this job, of SRC2 into a fresh model and
optimizers, written under OUT2.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_train import build, restore_setup, snapshot  # noqa: E402
import deepfreeze.torch  # noqa: E402


def main() -> None:
    later = sys.argv[3:]
    sys.argv[3:], later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
    out, src, kw, distributed, rank, size, net, opts = restore_setup()
    restore(out, src, kw, distributed, rank, size, net, opts)
    while later:  # -- OUT2 SRC2 [key=value ...]: another restore in this job, into a fresh model
        later = later[1:]
        this, later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
        net, opts = build(seed=123)
        restore(this[0], this[1], dict(a.split("=", 1) for a in this[2:]), distributed, rank, size, net, opts)
    if distributed:
        dist.destroy_process_group()


def restore(out, src, kw, distributed, rank, size, net, opts) -> None:
    if kw.get("extra_group") == "1":
        opts[1].add_param_group({"params": list(net.extra.parameters()), "lr": 5e-3})
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    version, step = deepfreeze.torch.restore(
        model, opts, name=kw.get("name", "tt"), version=int(kw["version"]) if "version" in kw else None,
        mode="sync", scratch=os.path.join(src, f"scratch{rank}"), persistent=os.path.join(src, "persistent"))
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    snapshot(net, opts, os.path.join(mydir, "restored.npz"))
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump({"version": version, "step": step, "world_size": size}, f)


if __name__ == "__main__":
    main()
