"""An FSDP2 job that checkpoints with DCP (no DeepFreeze): 3 steps of tests/workers/torch_fsdp.py's
model (uneven and empty shards), then ``dcp.save({"model", "optim"} of get_state_dict)`` to
OUT/dcp (``dedup_save_to_lowest_rank``: rank 0's buffers) and the full state (as
torch_fsdp.full_state) to OUT/r<rank>/v3.npz.

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_fsdp_dcp_save.py OUT
"""
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_fsdp import IN, build, full_state, optimizers, shard  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    net = build()
    shard(net, world)
    opts = optimizers(net)
    for it in range(3):
        g = torch.Generator().manual_seed(1000 * it + rank)
        x, y = torch.randn(16, IN, generator=g), torch.randn(16, 1, generator=g)
        torch.nn.functional.mse_loss(net(x), y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    np.savez(os.path.join(mydir, "v3.npz"), **full_state(net, opts, True))
    m, o = get_state_dict(net, opts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": m, "optim": o}, checkpoint_id=os.path.join(out, "dcp"),
                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
