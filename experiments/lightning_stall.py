"""The stall of a DeepFreeze checkpoint step under PyTorch Lightning against a plain loop.

    python -m experiments.lightning_stall --out experiments/results/lightning_stall.json
    python -m experiments.lightning_stall --reps 1 --steps 30 --out /tmp/q.json        # smoke

One process, CPU, one thread (``torch.set_num_threads(1)``), the same model (an MLP of ``--layers``
Linear(width, width) layers; AdamW: weights + 2 moments), optimizer, data and checkpoint
schedule in both:

* ``lightning``: ``pl.Trainer(accelerator="cpu", devices=1, max_steps=steps)`` with
  ``DeepFreezeCallback(every_n_train_steps=every)``; a timer callback after it stamps every
  ``on_train_batch_end``;
* ``plain``: ``for x, y in loader: loss.backward(); opt.step(); opt.zero_grad(); sched.step();
  ckpt.end_iteration()`` with ``Checkpointer(every_n_steps=every)``, stamped at the same point.

Iteration i's time is the gap between the stamps of i-1 and i. A checkpoint at step s is captured
in the optimizer's post-hook of iteration s-1 and finished (copy waited for, record added, handed
to the engine) at the next ``optimizer.step()``'s pre-hook, in iteration s: its **stall** is
``t[s-1] + t[s] - 2 * median(plain iterations of that run)``, where plain iterations are those
next to no checkpoint (the first 3 of a run excluded). ``in_hooks`` is the training thread's own
time in DeepFreeze per checkpoint (``post_hook_s + wait_s + handoff_s`` of
``Checkpointer.timings``): the stall without the background threads' and processes' contention,
which on a loaded machine dominates the iteration-time difference. The first checkpoint of a run (plan,
pooled buffers, engine start) and the last (finished by ``close``) are excluded. The two loops
alternate, ``--reps`` runs each. Lightning calls ``optimizer.step(closure)`` with the forward and
backward inside the closure: the Checkpointer finishes a pending capture after the closure, before
the update (earlier versions waited for the copy in the pre-hook, before the forward: 43 ms per
checkpoint at load 8-10, ``results/lightning_stall_load10.json``). The JSON holds every sample,
the median and quartiles, and each run's ``Checkpointer.timings``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _loader(width: int, steps: int, batch: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, width, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(1)), batch_size=batch)


def _dirs(root: str, tag: str) -> dict:
    return {"mode": "async", "scratch": os.path.join(root, tag, "scratch"),
            "persistent": os.path.join(root, tag, "persistent")}


def run_plain(a: argparse.Namespace, root: str, tag: str) -> tuple[list[float], list[dict]]:
    from deepfreeze.torch import Checkpointer
    net = _model(a.width, a.layers)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10, 0.9)
    ckpt = Checkpointer(net, opt, name="stall", every_n_steps=a.every, **_dirs(root, tag))
    stamps = [time.perf_counter()]
    for x, y in _loader(a.width, a.steps, a.batch):
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ckpt.end_iteration()
        stamps.append(time.perf_counter())
    ckpt.close()
    return list(np.diff(stamps)), ckpt.timings


def run_lightning(a: argparse.Namespace, root: str, tag: str) -> tuple[list[float], list[dict]]:
    import pytorch_lightning as pl

    from deepfreeze.torch.lightning import DeepFreezeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(a.width, a.layers)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-4)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 10, 0.9),
                                                       "interval": "step"}}

    class Stamp(pl.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_start(self, trainer, pl_module):
            self.stamps = [time.perf_counter()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.stamps.append(time.perf_counter())

    cb = DeepFreezeCallback(name="stall", every_n_train_steps=a.every, **_dirs(root, tag))
    stamp = Stamp()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=a.steps,
                         callbacks=[cb, stamp], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Module(), train_dataloaders=_loader(a.width, a.steps, a.batch))
    return list(np.diff(stamp.stamps)), cb.checkpointer.timings


def stalls(times: list[float], every: int) -> tuple[list[float], float]:
    """The stall of each measured checkpoint (seconds) and the run's median plain iteration."""
    ck = [s for s in range(every, len(times) + 1, every)][1:]  # steps checkpointed, the first excluded
    ck = [s for s in ck if s < len(times)]  # the last one's finish is in close()
    near = {i for s in ck + [every] for i in (s - 1, s)}
    base = statistics.median(t for i, t in enumerate(times) if i >= 3 and i not in near)
    return [times[s - 1] + times[s] - 2 * base for s in ck], base


KINDS = ("lightning", "plain")


def _q(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    q = np.percentile(xs, [25, 50, 75]) * 1e3
    return {"n": len(xs), "p25_ms": round(q[0], 2), "median_ms": round(q[1], 2), "p75_ms": round(q[2], 2)}


def main(argv: "list[str] | None" = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    import logging
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    state_mb = sum(m.numel() for m in _model(a.width, a.layers).parameters()) * 4 * 3 / 1e6
    res: dict = {"config": {**vars(a), "state_mb": round(state_mb, 1), "torch": torch.__version__,
                            "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="df-lstall-") as root:
        for r in range(a.reps):
            for kind, fn in (("lightning", run_lightning), ("plain", run_plain)):
                times, timings = fn(a, root, f"{kind}{r}")
                st, base = stalls(times, a.every)
                res["runs"].append({"kind": kind, "rep": r, "iter_s": times, "median_iter_s": base, "stalls_s": st,
                                    "timings": timings})
                print(f"{kind} rep {r}: median iteration {base * 1e3:.1f} ms, stalls "
                      f"{', '.join(f'{s * 1e3:.1f}' for s in st)} ms", file=sys.stderr)
    res["load_avg_end"] = os.getloadavg()[0]
    for kind in KINDS:
        runs = [x for x in res["runs"] if x["kind"] == kind]
        res[kind] = {"stall": _q([s for x in runs for s in x["stalls_s"]]),
                     "iteration": _q([x["median_iter_s"] for x in runs]),
                     "wait_in_pre_hook": _q([t["wait_s"] for x in runs for t in x["timings"][1:-1]]),
                     "post_hook": _q([t["post_hook_s"] for x in runs for t in x["timings"][1:-1]]),
                     "in_hooks": _q([t["post_hook_s"] + t["wait_s"] + t["handoff_s"] for x in runs
                                     for t in x["timings"][1:-1]])}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in KINDS}, indent=1))


if __name__ == "__main__":
    main()
