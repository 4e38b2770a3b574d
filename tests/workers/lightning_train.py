"""A PyTorch Lightning fit with DeepFreezeCallback (one rank of ``torchrun``; Lightning's ``ddp`` on CPU).

    torchrun --standalone --nproc-per-node 2 tests/workers/lightning_train.py OUT [key=value ...]
    torchrun ... tests/workers/lightning_train.py OUT [key=value ...] -- OUT2 [key=value ...] ...

keys: name, epochs (max_epochs), every (every_n_train_steps), accum (accumulate_grad_batches), resume=1, kill_at=S (rank
kill_rank, default 1, SIGKILLs itself when global step S starts), mode, plain=1 (no DeepFreeze
callback: Lightning alone), workers=N (the loader's num_workers, default 0), aug= the items' noise:
``global`` (default: torch, numpy and Python's global RNGs), ``none``, or ``gen`` (a
``torch.Generator`` the dataset keeps in its ``state_dict()``: the pattern that is exact with workers),
sampler=plain (torch's ``RandomSampler``, for which Lightning injects a plain ``DistributedSampler``
into the loader's batch sampler: ``use_distributed_sampler=True``).

A hand-written LightningModule (Linear, BatchNorm, dropout, Linear), AdamW with a StepLR stepped
every optimizer step; the data: torchdata's ``StatefulDataLoader`` with its
``StatefulDistributedSampler`` (shuffling; ``use_distributed_sampler=False``) over a dataset
whose items add torch, numpy and Python random noise (a random transform: the RNG states
matter; ``aug=`` picks another). Deterministic on CPU. Per rank it writes (no
pickles):

  OUT/r<rank>/final.npz     model state dict, optimizer state tensors (opt.<fqn>.<key>), torch's RNG state
  OUT/r<rank>/final.json    global step, epoch, batch progress, scheduler state, lrs, resumed_from, last_version
  OUT/r<rank>/loss<S>.txt   per global step S this run trained: the loss's bytes (hex)

Each ``-- OUT2 [key=value ...]``: one more fit in this job, after the one before (a new Trainer,
module and callback, seeded as the first; the torch and Lightning imports and the process group
paid once), written under OUT2.
"""
import json
import os
import random
import signal
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import pytorch_lightning as pl  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler  # noqa: E402

from deepfreeze.torch.lightning import DeepFreezeCallback  # noqa: E402
import jobargs  # noqa: E402
from torch_train import quiet_gloo  # noqa: E402

IN, HID, OUT_F, N, BATCH = 16, 64, 4, 48, 4  # 2 ranks: 24 samples, 6 batches per rank and epoch


class Noisy(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, IN, generator=g), torch.randn(N, OUT_F, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        noise = 0.01 * torch.rand(IN) + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        return self.x[i] + noise, self.y[i]


class Plain(Noisy):
    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class GenNoisy(Noisy):
    """Noise from a generator the dataset keeps in its ``state_dict()``: StatefulDataLoader saves each
    worker's dataset state with every batch and loads it into the restarted worker (exact with workers).
    Seeded in the worker from the worker's seed (base seed + worker id, the base seed a loader state
    carries), so the workers draw different noise."""

    def __init__(self) -> None:
        super().__init__()
        self.gen: "torch.Generator | None" = None

    def _gen(self) -> torch.Generator:
        if self.gen is None:
            info = torch.utils.data.get_worker_info()
            self.gen = torch.Generator().manual_seed(info.seed if info is not None else torch.initial_seed())
        return self.gen

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.rand(IN, generator=self._gen()), self.y[i]

    def state_dict(self) -> dict:
        return {"gen": self._gen().get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self._gen().set_state(sd["gen"])


class Module(pl.LightningModule):
    def __init__(self, workers: int = 0, aug: str = "global", plain_sampler: bool = False) -> None:
        super().__init__()
        self.workers, self.dataset_cls = workers, {"global": Noisy, "none": Plain, "gen": GenNoisy}[aug]
        self.plain_sampler = plain_sampler
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.BatchNorm1d(HID), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.3), torch.nn.Linear(HID, OUT_F))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        d = os.path.join(self.trainer.default_root_dir, f"r{self.trainer.global_rank}")
        with open(os.path.join(d, f"loss{self.trainer.global_step}.txt"), "w") as f:
            f.write(loss.detach().numpy().tobytes().hex())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        ds = self.dataset_cls()  # the sampler restores its own position; its epoch is set before the first item
        if self.plain_sampler:
            return StatefulDataLoader(ds, batch_size=BATCH, sampler=torch.utils.data.RandomSampler(ds),
                                      num_workers=self.workers)
        return StatefulDataLoader(ds, batch_size=BATCH, sampler=StatefulDistributedSampler(ds, shuffle=True, seed=0),
                                  num_workers=self.workers)


class Kill(pl.Callback):
    def __init__(self, at: int, rank: int) -> None:
        self.at, self.rank = at, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def record(trainer: "pl.Trainer", module: Module, cb, mydir: str) -> None:
    opt = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    arrays = {f"model.{k}": v.detach().numpy() for k, v in module.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            arrays[f"opt.{names[id(p)]}.{k}"] = v.detach().numpy()
    arrays["rng.torch"] = torch.get_rng_state().numpy()
    np.savez(os.path.join(mydir, "final.npz"), **arrays)
    sched = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    info = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "batch_progress": trainer.fit_loop.epoch_loop.batch_progress.state_dict(),
            "sched": {k: v for k, v in sched.items() if isinstance(v, (int, float, list))},
            "lr": [g["lr"] for g in opt.param_groups], "rng.numpy": int(np.random.randint(1 << 30)),
            "rng.python": random.random(),
            "resumed_from": cb.resumed_from if cb else None,
            "last_version": cb.checkpointer.last_version if cb else None,
            "timings": cb.checkpointer.timings if cb else []}
    with open(os.path.join(mydir, "final.json"), "w") as f:
        json.dump(info, f)


def main() -> None:
    os.register_at_fork(before=quiet_gloo)  # the loaders' workers are forked (torch_train.quiet_gloo)
    for args in jobargs.split(sys.argv[1:], "--"):  # OUT [key=value ...] [-- OUT2 [key=value ...] ...]: one fit each
        fit(args[0], dict(a.split("=", 1) for a in args[1:]))


def fit(out: str, kw: dict) -> None:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    cb = None
    callbacks: list = []
    if kw.get("plain") != "1":
        cb = DeepFreezeCallback(name=kw.get("name", "lt"), every_n_train_steps=int(kw.get("every", 4)),
                                resume=kw.get("resume") == "1", mode=kw.get("mode", "async"),
                                scratch=os.path.join(out, f"scratch{rank}"), persistent=os.path.join(out, "persistent"),
                                min_shard_bytes=4096)
        callbacks.append(cb)
    if "kill_at" in kw:
        callbacks.append(Kill(int(kw["kill_at"]), int(kw.get("kill_rank", 1))))
    trainer = pl.Trainer(strategy="ddp" if world > 1 else "auto", accelerator="cpu", devices=world, num_nodes=1,
                         max_epochs=int(kw.get("epochs", 3)), callbacks=callbacks, default_root_dir=out,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=kw.get("sampler") == "plain",
                         deterministic=True, accumulate_grad_batches=int(kw.get("accum", 1)))
    module = Module(int(kw.get("workers", 0)), kw.get("aug", "global"), kw.get("sampler") == "plain")
    trainer.fit(module)
    record(trainer, module, cb, mydir)


if __name__ == "__main__":
    main()
