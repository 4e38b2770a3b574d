"""Training loops as users write them, for the loop-boundary tests (one rank of ``torchrun``).

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_loops.py OUT shape=S [key=value ...]

shapes (each a loop a user writes; ``Checkpointer(every_n_steps=every)``):

  end       the data position (a Stateful) advanced at the END of the iteration, after
            ``sched.step()``, then ``ckpt.end_iteration()``
  end_hooks the same loop without ``end_iteration()`` (the hooks' timing: see docs/torch.md)
  dl        ``for x, y in ckpt.iterate(loader)``: a plain ``DataLoader`` with ``DistributedSampler``
            (shuffled), 2 workers, random transforms drawn in the workers (torch, numpy, Python)
  sdl       the same over torchdata's ``StatefulDataLoader``, its random transforms drawn from a
            generator the dataset keeps in its state_dict (torchdata restores that, not the
            workers' global RNGs)
  accum     ``iterate`` over the DataLoader, gradient accumulation (2 micro-batches a step), bf16
            autocast with a CPU GradScaler whose first steps overflow (skipped), OneCycleLR (a
            scheduler that raises when stepped past its total)
  plateau   ``iterate``, a validation pass after every epoch and ReduceLROnPlateau stepped on its
            loss; checkpoints land on the last step of an epoch (before validation)
  fsdp      FSDP2 (``fully_shard``) with the ``end`` loop
  closure   the ``end`` loop with ``optimizer.step(closure)`` running forward and backward

``shape=a,b,...`` runs several shapes one after the other in the same job (uninterrupted runs).
``OUT [key=value ...] -- OUT2 [key=value ...]``: then the runs of the second list of keys, written
under OUT2 (e.g. the uninterrupted runs, then the relaunches of killed ones: one job).
``exit=noclose|destroy|close_after_destroy``: the job ends without ``close()`` (after
``destroy_process_group()``, then ``close()``).
keys: steps (total training iterations), every (``steps_<shape>``, ``every_<shape>``: for one
shape of several), kill_at=IT (rank 1 SIGKILLs itself when IT
iterations are done, once the newest version handed off is committed), resume=1, name. Writes OUT/<shape>/r<rank>/final.npz: every leaf of the
model, optimizers, schedulers, GradScaler, RNG states and the loop's counters (exact: floats as
their repr), and info.json.
"""
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deepfreeze.torch import Checkpointer  # noqa: E402

from torch_train import IN, OUT_F, Net, begin, optimize  # noqa: E402  (the test model, the workers' common start)

BATCH = 4


class Noisy(torch.utils.data.Dataset):
    """Samples made from their index, plus a random transform drawn from the RNGs of the process
    that loads it (a DataLoader worker: seeded from the loader's base seed)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(IN, generator=g), torch.randn(OUT_F, generator=g)
        x = x * (1 + 0.1 * torch.rand(1)) + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return x, y


class StatefulNoisy(Noisy):
    """The same samples with the random transform drawn from a generator the dataset keeps in its
    ``state_dict`` (per worker): torchdata's StatefulDataLoader saves and restores each worker's
    dataset state, not the workers' global RNGs."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gen: "torch.Generator | None" = None

    def _gen(self) -> torch.Generator:
        if self.gen is None:
            info = torch.utils.data.get_worker_info()
            self.gen = torch.Generator().manual_seed(info.seed if info is not None else 5)
        return self.gen

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(IN, generator=g), torch.randn(OUT_F, generator=g)
        return x * (1 + 0.1 * torch.rand(1, generator=self._gen())), y

    def state_dict(self) -> dict:
        return {"gen": self._gen().get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self._gen().set_state(sd["gen"])


class Position:
    """The loop's own counters (a Stateful): iterations done, epoch, data position."""

    def __init__(self, rank: int) -> None:
        self.rank, self.it, self.epoch = rank, 0, 0

    def batch(self):
        g = torch.Generator().manual_seed(1000 * self.it + self.rank)
        x, y = torch.randn(BATCH * 2, IN, generator=g), torch.randn(BATCH * 2, OUT_F, generator=g)
        return x + float(np.random.rand()) * 0.01 + random.random() * 0.01, y

    def state_dict(self) -> dict:
        return {"it": self.it, "epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.it, self.epoch = int(sd["it"]), int(sd["epoch"])


def leaves(obj, prefix: str, out: dict) -> None:
    """Every leaf of a state tree as an array (tensors by their bytes, other values by repr)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        t = t.cpu().contiguous()
        out[prefix] = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy().copy()
    elif isinstance(obj, np.ndarray):
        out[prefix] = obj.copy()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            leaves(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            leaves(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = np.array(repr(obj))


def main() -> None:
    later = sys.argv[2:]
    sys.argv[2:], later = (later[:later.index("--")], later[later.index("--") + 1:]) if "--" in later else (later, [])
    out, kw, _, _, _ = begin()
    for shape in kw["shape"].split(","):  # several shapes one after the other (the uninterrupted runs)
        run(out, shape, kw)
    if later:  # -- OUT2 [key=value ...]: the runs of these keys, under OUT2 (each run seeds itself)
        kw2 = dict(a.split("=", 1) for a in later[1:])
        for shape in kw2["shape"].split(","):
            run(later[0], shape, kw2)
    dist.barrier()
    dist.destroy_process_group()


def run(out: str, shape: str, kw: dict) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    np.random.seed(7 + rank)
    random.seed(11 + rank)
    net = Net()
    if shape == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for m in net.body:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m)
        model = fully_shard(net)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    body = torch.optim.AdamW(net.body.parameters(), lr=3e-3, weight_decay=0.01)
    head = torch.optim.SGD(net.head.parameters(), lr=1e-2, momentum=0.9)
    opts = [body, head]
    steps = int(kw.get(f"steps_{shape}", kw.get("steps", 16)))
    every = int(kw.get(f"every_{shape}", kw.get("every", 4)))
    per_epoch = 4  # batches per rank and epoch (the loader shapes)
    accum = 2 if shape == "accum" else 1
    pos = Position(rank)
    state: dict = {"pos": pos}
    scheds: list = []
    scaler = None
    plateau = None
    if shape == "accum":
        scheds = [torch.optim.lr_scheduler.OneCycleLR(body, max_lr=1e-2, total_steps=steps // accum),
                  torch.optim.lr_scheduler.StepLR(head, 2, 0.7)]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=2)
        state["scaler"] = scaler
    elif shape == "plateau":
        scheds = [torch.optim.lr_scheduler.StepLR(body, 3, 0.7)]
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(head, factor=0.5, patience=0)
        state["plateau"] = plateau
    else:
        scheds = [torch.optim.lr_scheduler.StepLR(body, 3, 0.7), torch.optim.lr_scheduler.ExponentialLR(head, 0.95)]
    for k, s in enumerate(scheds):
        state[f"sched{k}"] = s
    loader = sampler = None
    if shape in ("dl", "sdl", "accum", "plateau"):
        ds = (StatefulNoisy if shape == "sdl" else Noisy)(per_epoch * BATCH * size)
        sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=3)
        if shape == "sdl":
            from torchdata.stateful_dataloader import StatefulDataLoader
            loader = StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)
        else:
            loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=2)
    name = kw.get("name", shape)
    mydir = os.path.join(out, shape, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    ckpt = Checkpointer(model, opts, name=name, every_n_steps=every, resume=kw.get("resume") == "1", state=state,
                        mode="async", scratch=os.path.join(out, shape, f"scratch{rank}"),
                        persistent=os.path.join(out, shape, "persistent"), min_shard_bytes=512,
                        write_once=kw.get("write_once", "auto"))  # the shipped default's path (conftest sets off)
    kill_at = int(kw.get("kill_at", -1))

    def maybe_die() -> None:
        if pos.it == kill_at and rank == 1:
            # the newest version handed off before the kill committed first (bounded): which version
            # the job resumes from must not depend on how fast this rank's writer and backend were
            # against the loop (a faster capture reached the kill before v9 was on scratch)
            from deepfreeze.loader import list_versions
            want, deadline = ckpt.last_version, time.monotonic() + 120
            while want is not None and not any(v >= want and "persistent" in levels
                                               for v, levels in list_versions(ckpt.config, ckpt.name).items()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"test: v{want} of {ckpt.name!r} not committed within 120 s before kill_at")
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    def step_on(x, y, micro: int) -> None:
        if shape == "closure":  # the first optimizer's step runs forward and backward (as Lightning, LBFGS)
            def closure():
                for o in opts:
                    o.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            opts[0].step(closure)
            opts[1].step()
            for s in scheds:
                s.step()
            return
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss * 8).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        if (micro + 1) % accum:
            return  # accumulating
        optimize(opts, scheds, scaler)

    if shape in ("end", "end_hooks", "fsdp", "closure"):
        while pos.it < steps:
            maybe_die()
            x, y = pos.batch()
            step_on(x, y, 0)
            pos.it += 1  # the data position, advanced at the end of the iteration
            if shape != "end_hooks":
                ckpt.end_iteration()
    else:
        epochs = steps // per_epoch
        for epoch in range(ckpt.start_epoch, epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in ckpt.iterate(loader):
                maybe_die()
                step_on(x, y, pos.it)
                pos.it += 1
            if plateau is not None:  # validation after the epoch, then the plateau scheduler
                model.eval()
                with torch.no_grad():
                    g = torch.Generator().manual_seed(99)
                    xv, yv = torch.randn(16, IN, generator=g), torch.randn(16, OUT_F, generator=g)
                    val = torch.nn.functional.mse_loss(model(xv), yv)
                    dist.all_reduce(val)
                plateau.step(float(val) + 0.05 * epoch)  # a loss that stops improving: lr cut
            pos.epoch = epoch + 1
    final: dict = {}
    if shape == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        msd, osd = get_state_dict(model, opts, options=StateDictOptions(full_state_dict=True))
        leaves(msd, "model", final)
        leaves(osd, "optim", final)
    else:
        leaves(net.state_dict(), "model", final)
        for k, o in enumerate(opts):
            leaves(o.state_dict(), f"optim{k}", final)
    for k, o in state.items():
        leaves(o.state_dict(), f"state.{k}", final)
    leaves(torch.get_rng_state(), "rng.torch", final)
    leaves(np.random.get_state(), "rng.numpy", final)
    leaves(random.getstate(), "rng.python", final)
    np.savez(os.path.join(mydir, "final.npz"), **final)
    ending = kw.get("exit", "close")
    if ending != "close":  # a run that forgets close(): exit=noclose|destroy|close_after_destroy
        info = {"last_version": ckpt.last_version, "pending": ckpt.capture.pending.step if ckpt.capture.pending else None}
        if ending in ("destroy", "close_after_destroy"):
            dist.barrier()
            dist.destroy_process_group()
        if ending == "close_after_destroy":
            try:
                ckpt.close()
            except Exception as e:  # the one-line error, recorded
                info["close_error"] = f"{type(e).__name__}: {e}"
        with open(os.path.join(mydir, "info.json"), "w") as f:
            json.dump(info, f)
        sys.exit(0)
    ckpt.close()
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump({"start_step": ckpt.start_step, "resumed_from": ckpt.resumed_from, "start_epoch": ckpt.start_epoch,
                   "step": ckpt.step, "it": pos.it, "last_version": ckpt.last_version,
                   "torn": ckpt.torn, "waits": [t["wait_s"] for t in ckpt.timings]}, f)


if __name__ == "__main__":
    main()
