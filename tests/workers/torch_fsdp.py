"""DeepFreeze-for-PyTorch FSDP2 worker (one rank of ``torchrun``, gloo, CPU; or a plain process).

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_fsdp.py train OUT [key=value ...]
    torchrun ... tests/workers/torch_fsdp.py train OUT [key=value ...] -- OUT2 [key=value ...] ...
    torchrun ... tests/workers/torch_fsdp.py restore OUT SRC layout=fsdp|fsdp-dcp|ddp|plain [version=V]
    torchrun ... tests/workers/torch_fsdp.py restore OUT SRC layouts=LAYOUT:V,LAYOUT:V,...
    torchrun ... tests/workers/torch_fsdp.py refuse OUT [kind=hsdp,tp]

``train``: a model sharded with ``fully_shard`` (per submodule, then the root) on a 1-D mesh of
every rank, whose parameters shard unevenly and, for some ranks, empty (``head.weight`` has one
row; ``body.0.weight`` five); keys steps, every, mode, resume=1, kill_at=IT (rank 1 SIGKILLs
itself at iteration IT), mutate_at=IT (an in-place change of a sharded parameter at the start
of iteration IT, while the capture of the step before copies), on_error; ``-- OUT2 ...``: another
run in this job after it (each seeds itself). Per rank it writes (numpy .npz, no pickles):

  OUT/r<rank>/v<version>.npz   the full state right after each checkpointed iteration, gathered
                               with get_state_dict(full_state_dict=True): model by FQN, optimizer
                               state as optim.state.<fqn>.<key>, lr of every group (__lr__);
                               buffers are this rank's own (FSDP2 does not synchronize them)
  OUT/r<rank>/final.npz        the same at the end
  OUT/r<rank>/info.json        start_step, resumed_from, plans, step, last_version, local shard rows

``restore``: a fresh model (other initial values) laid out as ``layout`` at this job's world size
restored with ``deepfreeze.torch.restore`` (``fsdp-dcp``: FSDP2, loaded with DCP's ``dcp.load``
through ``deepfreeze.torch.Reader``); writes OUT/r<rank>/restored.npz (as above) and
OUT/r<rank>/info.json ({"version", "step", "world_size", "rows": {fqn: [start, stop]}}, and for
``fsdp-dcp`` the reader's ``bytes_loaded`` and this rank's ``local_bytes``: the bytes of its
local shards of every tensor). ``layouts=``: several restores one after the other in this job (the
torch import and the process group paid once), each a fresh model laid out as its layout, of
version V, written under OUT/<layout>/ as above; with ``then_refuse=1``, then what ``refuse`` does,
under OUT/refuse/.

``refuse``: a Checkpointer of an HSDP model (a 2-D mesh) and of a tensor-parallel one
(RowwiseParallel: Shard(1)); writes OUT/r<rank>/refused.json: {kind: {"type", "message"}} of
the error each raised.
"""
import json
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
import jobargs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import deepfreeze.torch  # noqa: E402
from deepfreeze.torch import Checkpointer  # noqa: E402

IN, HID = 8, 64


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, 5), torch.nn.ReLU(), torch.nn.Linear(5, HID),
                                        torch.nn.BatchNorm1d(HID), torch.nn.ReLU(), torch.nn.Dropout(0.2))
        self.mid = torch.nn.Linear(HID, 3)
        self.head = torch.nn.Linear(3, 1)  # weight (1, 3), bias (1,): one row, empty on every rank but 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.body(x))))


def build(seed: int = 0):
    torch.manual_seed(seed)
    return Net()


def optimizers(net: Net):
    body = torch.optim.AdamW(list(net.body.parameters()) + list(net.mid.parameters()), lr=3e-3, weight_decay=0.01)
    head = torch.optim.SGD(net.head.parameters(), lr=1e-2, momentum=0.9)
    return [body, head]


def shard(net: Net, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for m in (net.body[0], net.body[2], net.mid, net.head):
        fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)


def full_state(net: torch.nn.Module, opts, sharded: bool) -> dict:
    """The full state: get_state_dict(full_state_dict=True) under FSDP2 (collective), the
    module's own otherwise; optimizer state flattened to optim.state.<fqn>.<key>."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    model_sd, optim_sd = get_state_dict(net, opts, options=StateDictOptions(full_state_dict=sharded))
    arrays = {k: v.detach().clone().numpy() for k, v in model_sd.items()}
    for fqn, kv in optim_sd["state"].items():
        for key, v in kv.items():
            if isinstance(v, torch.Tensor):
                arrays[f"optim.state.{fqn}.{key}"] = v.detach().clone().numpy()
    arrays["__lr__"] = np.array([g["lr"] for o in opts for g in o.param_groups], dtype=np.float64)
    return arrays


def local_rows(net: torch.nn.Module) -> dict:
    return {fqn: [int(t.device_mesh.get_local_rank()), list(t.to_local().shape)]
            for fqn, t in net.state_dict().items() if hasattr(t, "to_local")}


def train(out: str, kw: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    np.random.seed(7 + rank)
    random.seed(11 + rank)
    net = build()
    shard(net, world)
    opts = optimizers(net)
    sched = torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.7)
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    every = int(kw.get("every", 3))
    ckpt = Checkpointer(net, opts, name="ff", every_n_steps=every, resume=kw.get("resume") == "1",
                        state={"sched": sched}, mode=kw.get("mode", "async"), on_error=kw.get("on_error", "raise"),
                        scratch=os.path.join(out, f"scratch{rank}"), persistent=os.path.join(out, "persistent"),
                        min_shard_bytes=1024)
    steps = int(kw.get("steps", 10))
    kill_at = int(kw.get("kill_at", -1))
    mutate_at = int(kw.get("mutate_at", -1))
    it = ckpt.start_step
    while it < steps:
        if it == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if it == mutate_at:  # an in-place change of a sharded parameter while the capture of step `it` copies
            with torch.no_grad():
                net.mid.weight.mul_(1.0)
        g = torch.Generator().manual_seed(1000 * it + rank)
        x, y = torch.randn(16, IN, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        sched.step()
        it += 1
        if ckpt.step % every == 0:
            np.savez(os.path.join(mydir, f"v{ckpt.step}.npz"), **full_state(net, opts, True))
    np.savez(os.path.join(mydir, "final.npz"), **full_state(net, opts, True))
    ckpt.close()
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump({"start_step": ckpt.start_step, "resumed_from": ckpt.resumed_from, "plans": ckpt.plans,
                   "step": ckpt.step, "last_version": ckpt.last_version, "sharded": ckpt.sharded,
                   "rows": local_rows(net), "torn": ckpt.torn, "failures": ckpt.failures}, f)


def restore(out: str, src: str, kw: dict) -> None:
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    net = build(seed=123)  # other initial values: everything must come from the checkpoint
    layout = kw.get("layout", "fsdp")
    model = net
    if layout in ("fsdp", "fsdp-dcp"):
        shard(net, world)
    elif layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    opts = optimizers(net)
    where = dict(mode="sync", scratch=os.path.join(src, f"scratch{rank}"), persistent=os.path.join(src, "persistent"))
    version = int(kw["version"]) if "version" in kw else None
    extra = {}
    if layout == "fsdp-dcp":
        import warnings
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_sd, optim_sd = get_state_dict(net, opts)  # DTensors: each rank's own rows
        sd = {**model_sd, "optim": optim_sd}
        extra["local_bytes"] = sum((v.to_local() if hasattr(v, "to_local") else v).nbytes for v in model_sd.values()) \
            + sum((x.to_local() if hasattr(x, "to_local") else x).nbytes for kv in optim_sd["state"].values()
                  for x in kv.values() if isinstance(x, torch.Tensor))
        reader = deepfreeze.torch.Reader(name="ff", version=version, **where)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=reader)
        optim_sd = sd.pop("optim")
        set_state_dict(net, opts, model_state_dict=sd, optim_state_dict=optim_sd)
        version, step = reader.loaded_version, None
        extra["bytes_loaded"] = reader.bytes_loaded
        reader.close()
    else:
        version, step = deepfreeze.torch.restore(model, opts, name="ff", version=version, **where)
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    np.savez(os.path.join(mydir, "restored.npz"), **full_state(net, opts, layout in ("fsdp", "fsdp-dcp")))
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump({"version": version, "step": step, "world_size": world, "rows": local_rows(net), **extra}, f)


def refuse(out: str, kw: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    got = {}
    for kind in kw.get("kind", "hsdp,tp").split(","):
        net = build()
        if kind == "hsdp":
            mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
            fully_shard(net, mesh=mesh)
        else:
            from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
            mesh = init_device_mesh("cpu", (world,))
            parallelize_module(net, mesh, {"mid": RowwiseParallel()})
        try:
            Checkpointer(net, optimizers(net), name="ff", mode="sync", scratch=os.path.join(out, f"scratch{rank}"),
                         persistent=os.path.join(out, "persistent"))
            got[kind] = {"type": None, "message": ""}
        except Exception as e:
            got[kind] = {"type": type(e).__name__, "message": str(e)}
    with open(os.path.join(mydir, "refused.json"), "w") as f:
        json.dump(got, f)


def main() -> None:
    cmd, out = sys.argv[1], sys.argv[2]
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    if cmd == "train":  # OUT [key=value ...] [-- OUT2 [key=value ...] ...]: one run after the other
        for args in jobargs.split([out, *sys.argv[3:]], "--"):
            train(args[0], dict(a.split("=", 1) for a in args[1:]))
    elif cmd == "restore":
        kw = dict(a.split("=", 1) for a in sys.argv[4:])
        if "layouts" in kw:  # several restores in one job: OUT/<layout>/
            then_refuse = kw.pop("then_refuse", None) == "1"
            for item in kw.pop("layouts").split(","):
                layout, version = item.split(":")
                restore(os.path.join(out, layout), sys.argv[3], {**kw, "layout": layout, "version": version})
            if then_refuse:  # and then what ``refuse`` does, under OUT/refuse/
                refuse(os.path.join(out, "refuse"), {})
        else:
            restore(out, sys.argv[3], kw)
    else:
        refuse(out, dict(a.split("=", 1) for a in sys.argv[3:]))
    if dist.is_initialized():
        # both ranks past their last collective before either tears its groups down: ``refuse``
        # ends on one rank while the other may still be making a device mesh's groups, and gloo
        # aborts that rank ("terminate called without an active exception") when its peer's
        # connections close under it: 4 to 6 runs in 20 here without the barrier, 0 in 40 with it
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
