"""Load a DeepFreeze-for-PyTorch checkpoint with ``torch.distributed.checkpoint.load`` through
``deepfreeze.torch.Reader`` into a fresh model and optimizers (any world size, or a plain process).

    torchrun --standalone --nproc-per-node N tests/workers/torch_dcp_load.py OUT SRC version=V [name=tt]
    python tests/workers/torch_dcp_load.py OUT SRC ...
    torchrun ... tests/workers/torch_dcp_load.py OUT SRC [key=value ...] -- OUT2 [key=value ...] ...

SRC is the training job's OUT (scratch<rank>, persistent). ``model_only_rank=R``: rank R loads
the model's entries only (its plan asks for other tensors than the other ranks'). Writes OUT/r<rank>/loaded.npz (the
state, as torch_train.snapshot) and OUT/r<rank>/info.json ({"version", "world_size"}). Each
``-- OUT2 [key=value ...]``: one more load of SRC in this job, into a fresh model, written under OUT2.
"""
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_train import build, restore_setup, snapshot  # noqa: E402
from deepfreeze.torch import Reader  # noqa: E402


def main() -> None:
    later = sys.argv[3:]
    sys.argv[3:], later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
    out, src, kw, distributed, rank, size, net, opts = restore_setup()
    load(out, src, kw, distributed, rank, size, net, opts)
    while later:  # -- OUT2 [key=value ...]: another load in this job, into a fresh model
        later = later[1:]
        this, later = (later[:later.index("--")], later[later.index("--"):]) if "--" in later else (later, [])
        net, opts = build(seed=123)
        load(this[0], src, dict(a.split("=", 1) for a in this[1:]), distributed, rank, size, net, opts)
    if distributed:
        dist.destroy_process_group()


def load(out, src, kw, distributed, rank, size, net, opts) -> None:
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    model_sd, optim_sd = get_state_dict(model, opts)
    model_only = int(kw.get("model_only_rank", -1)) == rank
    sd = {**model_sd} if model_only else {**model_sd, "optim": optim_sd}
    reader = Reader(name=kw.get("name", "tt"), version=int(kw["version"]) if "version" in kw else None,
                    mode="sync", scratch=os.path.join(src, f"scratch{rank}"), persistent=os.path.join(src, "persistent"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)
    if model_only:
        net.load_state_dict(sd)
    else:
        optim_sd = sd.pop("optim")
        set_state_dict(model, opts, model_state_dict=sd, optim_state_dict=optim_sd)
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    snapshot(net, opts, os.path.join(mydir, "loaded.npz"))
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump({"version": reader.loaded_version, "world_size": size}, f)
    reader.close()


if __name__ == "__main__":
    main()
