"""A DCP user's loop, then the same loop continued with DeepFreeze from an imported DCP checkpoint.

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_dcp_import.py OUT mode=save steps=N save_at=S
    torchrun ... tests/workers/torch_dcp_import.py OUT mode=resume src=SAVE_OUT steps=N [every=3] [name=imp]
                 [import_step=S]
    python tests/workers/torch_dcp_import.py OUT mode=resume ...      (one plain process)

The loop of tests/workers/torch_train.py (its model, two optimizers, two LR schedulers, the
Stateful data position, BatchNorm, dropout and numpy/Python noise), without the GradScaler.

mode=save (no DeepFreeze): after iteration S it saves, as a DCP user does, with
``dcp.save`` of ``{"model", "optim"}`` from ``get_state_dict`` plus ``sched0``, ``sched1`` and
``data`` (the schedulers' and data position's dicts) to OUT/dcp, and the same model and optimizer
behind DCP's ``{"app": AppState}`` wrapper to OUT/dcp_app (``dedup_save_to_lowest_rank``: the
buffers saved are rank 0's, which DDP broadcasts at the next forward). It records
OUT/r<rank>/v<S>.npz (the state then, as torch_train.snapshot), OUT/r<rank>/rng<S>.npz (this
rank's RNG states: the user's own file, as DCP holds none) and, at the end, final.npz.

mode=resume: ``Checkpointer(..., resume=True, state={data, sched0, sched1}, every_n_steps=every)``
on the name the test imported, or (import_step=S) that every rank imports from SRC/dcp first with
``import_dcp`` (collective) (scratch/persistent under OUT, or scratch=/persistent= given); the
RNG states from SRC/r<rank>/rng<S>.npz when src= is given and the world size is the same (the
user's own restore of what DCP does not hold). Writes OUT/r<rank>/start.npz (the state right after
the Checkpointer was built), final.npz and info.json {start_step, resumed_from, last_version, step, it}.
"""
import json
import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torch_train import Data, begin, build, optimize, snapshot  # noqa: E402


class AppState:
    """DCP's tutorial wrapper: a Stateful whose state_dict is {"model", "optim"}."""

    def __init__(self, model, opts) -> None:
        self.model, self.opts = model, opts

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        m, o = get_state_dict(self.model, self.opts)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict) -> None:  # (not used: the test imports it instead)
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.opts, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def save_rng(path: str) -> None:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    np.savez(path, torch=torch.get_rng_state().numpy(), np_keys=keys, np_rest=np.array([pos, has_gauss], np.int64),
             np_cached=np.array(cached, np.float64), py=np.array(internal, np.int64))


def load_rng(path: str) -> None:
    with np.load(path, allow_pickle=False) as f:
        torch.set_rng_state(torch.from_numpy(f["torch"].copy()))
        np.random.set_state(("MT19937", f["np_keys"], int(f["np_rest"][0]), int(f["np_rest"][1]),
                             float(f["np_cached"])))
        random.setstate((3, tuple(int(x) for x in f["py"]), None))


def step(model, opts, scheds, data) -> None:
    x, y = data.next()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimize(opts, scheds)


def main() -> None:
    out, kw, distributed, rank, size = begin()
    net, opts = build(seed=0 if kw["mode"] == "save" else 123)  # resume: everything must come from the import
    model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    scheds = [torch.optim.lr_scheduler.StepLR(opts[0], 3, 0.7), torch.optim.lr_scheduler.ExponentialLR(opts[1], 0.95)]
    data = Data(rank)
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    steps = int(kw["steps"])
    if kw["mode"] == "save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict import get_state_dict
        save_at = int(kw["save_at"])
        while data.it < steps:
            step(model, opts, scheds, data)
            if data.it == save_at:
                snapshot(net, opts, os.path.join(mydir, f"v{save_at}.npz"))
                save_rng(os.path.join(mydir, f"rng{save_at}.npz"))
                m, o = get_state_dict(model, opts)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.save({"model": m, "optim": o, "sched0": scheds[0].state_dict(),
                              "sched1": scheds[1].state_dict(), "data": data.state_dict()},
                             checkpoint_id=os.path.join(out, "dcp"),
                             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
                    dcp.save({"app": AppState(model, opts)}, checkpoint_id=os.path.join(out, "dcp_app"),
                             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
        snapshot(net, opts, os.path.join(mydir, "final.npz"))
    else:
        from deepfreeze.torch import Checkpointer, import_dcp
        levels = {"mode": "sync", "scratch": kw.get("scratch", os.path.join(out, f"scratch{rank}")),
                  "persistent": kw.get("persistent", os.path.join(out, "persistent"))}
        if "import_step" in kw:  # every rank imports SRC/dcp first (collective)
            import_dcp(os.path.join(kw["src"], "dcp"), None, kw.get("name", "imp"), int(kw["import_step"]),
                       optimizer_groups=[1, 1], state={"data": "data", "sched0": "sched0", "sched1": "sched1"},
                       **levels)
        ckpt = Checkpointer(model, opts, name=kw.get("name", "imp"), resume=True, every_n_steps=int(kw.get("every", 3)),
                            state={"data": data, "sched0": scheds[0], "sched1": scheds[1]}, **levels)
        snapshot(net, opts, os.path.join(mydir, "start.npz"))
        src = kw.get("src")
        if src and size == int(kw.get("src_size", 2)):
            load_rng(os.path.join(src, f"r{rank}", f"rng{ckpt.start_step}.npz"))
        while data.it < steps:
            step(model, opts, scheds, data)
        snapshot(net, opts, os.path.join(mydir, "final.npz"))
        ckpt.close()
        with open(os.path.join(mydir, "info.json"), "w") as f:
            json.dump({"start_step": ckpt.start_step, "resumed_from": ckpt.resumed_from, "step": ckpt.step,
                       "last_version": ckpt.last_version, "it": data.it}, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
