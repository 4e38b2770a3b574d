"""Restore a DeepFreeze-for-PyTorch checkpoint into a fresh model and optimizers, at any world size.

    torchrun --standalone --nproc-per-node N tests/workers/torch_restore.py OUT SRC version=V [name=tt]
    python tests/workers/torch_restore.py OUT SRC ...          (a plain process)

SRC is the training job's OUT (its scratch<rank> and persistent directories; a rank beyond the
training's world size has an empty scratch). Writes OUT/r<rank>/restored.npz (the state, as
torch_train.snapshot) and OUT/r<rank>/info.json ({"version", "step", "world_size"}).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_train import build, snapshot  # noqa: E402
import deepfreeze.torch  # noqa: E402


def main() -> None:
    out, src = sys.argv[1], sys.argv[2]
    kw = dict(a.split("=", 1) for a in sys.argv[3:])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    size = dist.get_world_size() if distributed else 1
    net, opts = build(seed=123)  # other initial values: everything must come from the checkpoint
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
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
