"""One rank of a DDP job launched by ``torchrun`` across the test cluster's nodes
(tests/cluster/test_cluster_torch.py).

    torchrun --nnodes N --node-rank I --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint n1:PORT \\
        torch_job.py OUT SCRATCH PERSISTENT steps=S [resume=1] [persistent_interval=SECONDS]

The model, data, optimizers and schedulers are tests/workers/torch_train.py's (deterministic on
CPU; no GradScaler). deepfreeze.torch.Checkpointer every 3 steps, async mode (one backend per
node, on the node-local SCRATCH), partner copies across the nodes (ec_interval 0; the failure
domain is the default: the node's host name and torchrun's GROUP_RANK), PERSISTENT on the shared
directory. Per rank it writes OUT/r<rank>/v<step>.npz (the state right after each checkpointed
step), OUT/r<rank>/final.npz (the state at the end: with resume=1 and steps equal to the resumed
step, the state exactly as resumed) and OUT/r<rank>/info.json.
"""
import json
import os
import random
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "workers"))  # tests/workers

from torch_train import Data, build, snapshot, train_step  # noqa: E402

from deepfreeze.torch import Checkpointer  # noqa: E402


def main() -> None:
    out, scratch, persistent = sys.argv[1:4]
    kw = dict(a.split("=", 1) for a in sys.argv[4:])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    np.random.seed(7 + rank)
    random.seed(11 + rank)
    net, opts = build()
    model = torch.nn.parallel.DistributedDataParallel(net)
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.7), torch.optim.lr_scheduler.ExponentialLR(opts[1], 0.95)]
    state = {"data": Data(rank), "sched0": scheds[0], "sched1": scheds[1]}
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    every = 3
    ckpt = Checkpointer(model, opts, name="tt", every_n_steps=every, resume=kw.get("resume") == "1", state=state,
                        mode="async", scratch=scratch, persistent=persistent, min_shard_bytes=4096, ec_interval=0,
                        ec_scheme="partner", persistent_interval=float(kw.get("persistent_interval", 0)))
    data = state["data"]
    steps = int(kw["steps"])
    while data.it < steps:
        train_step(model, opts, scheds, data, ckpt, every, mydir, net)
    snapshot(net, opts, os.path.join(mydir, "final.npz"))
    ckpt.close()
    info = {"rank": rank, "size": dist.get_world_size(), "host": socket.gethostname(),
            "group_rank": os.environ.get("GROUP_RANK"), "domains": ckpt.domains, "start_step": ckpt.start_step,
            "resumed_from": ckpt.resumed_from, "step": ckpt.step, "it": data.it, "last_version": ckpt.last_version,
            "failures": ckpt.failures}
    with open(os.path.join(mydir, "info.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(mydir, "info.json.tmp"), os.path.join(mydir, "info.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
