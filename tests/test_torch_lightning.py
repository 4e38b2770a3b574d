"""DeepFreeze in PyTorch Lightning: ``deepfreeze.torch.lightning.DeepFreezeCallback`` in real
2-rank ``ddp`` fits on CPU under torchrun (tests/workers/lightning_train.py), and in 1-rank fits in
this process for what needs no second rank (the loader workers' warnings and refusal).

Every check is against state the runs recorded per rank (final.npz / final.json, loss<S>.txt),
never stdout. torchrun, not Lightning's own launcher: Lightning's ``ddp`` launches the other
ranks itself as children of rank 0, and a SIGKILLed child leaves rank 0 blocked in a gloo
collective until the process-group timeout; torchrun's agent sees the death and ends the job.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
from importlib.util import find_spec

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")
# found, not imported: every pytest-xdist worker collects this module, one runs its tests (Lightning's
# import is 2-3 CPU-s; the tests import it where they use it, or run it in their jobs)
pytestmark = [pytest.mark.skipif(find_spec("pytorch_lightning") is None,
                                 reason="PyTorch Lightning is not installed (scripts/setup.sh installs 2.6.6)"),
              pytest.mark.skipif(find_spec("torchdata") is None,
                                 reason="torchdata is not installed (scripts/setup.sh installs 0.11.0)")]

from _util import ROOT, WORKERS, as_in_a_test  # noqa: E402
from test_torch import torchrun  # noqa: E402

TRAIN = os.path.join(WORKERS, "lightning_train.py")


def _final(out: str, rank: int) -> tuple[dict, dict]:
    with np.load(os.path.join(out, f"r{rank}", "final.npz"), allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    with open(os.path.join(out, f"r{rank}", "final.json")) as f:
        return arrays, json.load(f)


def _losses(out: str, rank: int) -> dict[int, str]:
    got = {}
    for p in glob.glob(os.path.join(out, f"r{rank}", "loss*.txt")):
        with open(p) as f:
            got[int(os.path.basename(p)[4:-4])] = f.read()
    return got


def assert_equal_runs(got: str, want: str) -> None:
    """Every rank's final model, optimizer state, RNG states, loop and scheduler state, and the
    loss of every global step the resumed run trained, bit for bit."""
    for r in (0, 1):
        a, ja = _final(got, r)
        b, jb = _final(want, r)
        assert sorted(a) == sorted(b)
        bad = [k for k in b if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]
        assert not bad, f"rank {r}: {len(bad)} of {len(b)} arrays differ from the uninterrupted run: {bad[:6]}"
        for k in ("global_step", "epoch", "batch_progress", "sched", "lr", "rng.numpy", "rng.python"):
            assert ja[k] == jb[k], f"rank {r}: {k}: {ja[k]} vs {jb[k]}"
        la, lb = _losses(got, r), _losses(want, r)
        assert la and all(la[s] == lb[s] for s in la), f"rank {r}: the loss of a resumed step differs"


#: the two fits the kill tests below take apart: the default loader, and 2 loader workers over items
#: without random noise
FITS = {"default": ("epochs=2",), "workers": ("epochs=2", "workers=2", "aug=none")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each fit of :data:`FITS` killed in a job of its own (rank 1 SIGKILLs itself when global step 10
    starts); then one job (tests/workers/lightning_train.py ``--``) relaunches both with
    resume=True and then runs both uninterrupted fits (2 epochs of 6 batches per rank, a checkpoint
    every 4 steps), one fit after the other. {fit: (the uninterrupted fit's OUT, the killed fit's
    OUT, the killed job's return code, whether rank 0 had written final.json before the relaunch)}."""
    base = tmp_path_factory.mktemp("lightning")
    got, relaunch = {}, []
    with as_in_a_test(tmp_path_factory):
        for f, args in FITS.items():
            ref, out = str(base / f"{f}_ref"), str(base / f)
            p = torchrun(2, TRAIN, out, *args, "kill_at=10", check=False)
            got[f] = (ref, out, p.returncode, os.path.exists(os.path.join(out, "r0", "final.json")))
            relaunch += [out, *args, "resume=1", "--"]
        uninterrupted = [a for f, args in FITS.items() for a in ("--", got[f][0], *args)][1:]
        torchrun(2, TRAIN, *relaunch, *uninterrupted, timeout=600)
    return got


@pytest.mark.timeout(1200)  # the first of the two runs the fixture's 3 jobs (6 fits)
def test_kill9_mid_epoch_then_resume_equals_uninterrupted(runs):
    """Rank 1 SIGKILLs itself when global step 10 starts (epoch 1, batch 4); the relaunch with
    resume=True continues from v8 (epoch 1, batch 2: mid-epoch) and ends bit-identical to the
    uninterrupted fit on both ranks."""
    reference, out, returncode, final_before_relaunch = runs["default"]  # epochs=2, kill_at=10, then resume=1
    assert returncode != 0 and not final_before_relaunch
    _, info = _final(out, 0)
    assert info["resumed_from"] in (4, 8), info["resumed_from"]  # v4 if v8 was not on scratch yet: both mid-epoch
    assert min(_losses(out, 0)) == 0 and 8 in _losses(out, 0)
    assert info["last_version"] == 12
    assert_equal_runs(out, reference)


@pytest.mark.timeout(1200)  # the first of the two runs the fixture's 3 jobs (6 fits)
def test_kill9_mid_epoch_with_loader_workers_then_resume_equals_uninterrupted(runs):
    """The loader with 2 worker processes (items without random noise): rank 1 SIGKILLs itself at
    step 10, the relaunch resumes from v8 (epoch 1, batch 2) and ends bit-identical to the
    uninterrupted fit. The restored iterator's workers prefetch indices before Lightning sets the
    sampler's epoch: without the callback's ``on_train_start`` the rest of epoch 1 was epoch 0's
    permutation."""
    ref, out, returncode, final_before_relaunch = runs["workers"]  # epochs=2 workers=2 aug=none; kill_at=10, resume=1
    assert returncode != 0 and not final_before_relaunch
    _, info = _final(out, 0)
    assert info["resumed_from"] in (4, 8), info["resumed_from"]
    assert_equal_runs(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("args,kill_at,kill_rank,versions", [
    (("mode=async",), 13, 0, (12, 8)),
    (("mode=sync",), 5, 1, (4,)),
    (("accum=2", "every=2"), 6, 1, (4, 2)),
    (("workers=2", "aug=gen"), 10, 1, (8, 4)),
    (("workers=2", "aug=gen"), 13, 0, (12, 8)),
    (("workers=2", "aug=gen", "sampler=plain"), 10, 1, (8, 4)),
    (("aug=gen",), 10, 1, (8, 4)),
], ids=["epoch-end", "sync", "accumulation", "workers-augment", "workers-augment-epoch-end", "workers-plain-sampler",
        "augment-no-workers"])
def test_kill9_other_points_then_resume(tmp_path, args, kill_at, kill_rank, versions):
    """Slow, 3 epochs each: rank 0 killed at step 13 (the newest version, v12, is the last batch of
    epoch 1: a resume at an epoch's end); rank 1 killed at step 5 in epoch 0 (sync mode); gradient
    accumulation over 2 batches (3 optimizer steps per epoch, a checkpoint every 2), rank 1 killed
    at step 6 (v4 is epoch 1, batch 2). With 2 loader workers and items whose noise comes from a
    ``torch.Generator`` the dataset keeps in its ``state_dict()`` (the documented pattern): killed
    mid-epoch 1 and at the epoch-end version v12; and over Lightning's injected plain
    ``DistributedSampler`` (``use_distributed_sampler=True``), whose permutation is computed when
    the iterator is made; the same generator without workers (the loader's own dataset state). Each
    bit-identical to its uninterrupted fit."""
    ref = str(tmp_path / "ref")
    torchrun(2, TRAIN, ref, "epochs=3", *args)
    out = str(tmp_path / "crash")
    p = torchrun(2, TRAIN, out, "epochs=3", f"kill_at={kill_at}", f"kill_rank={kill_rank}", *args, check=False)
    assert p.returncode != 0
    torchrun(2, TRAIN, out, "epochs=3", "resume=1", *args)
    _, info = _final(out, 0)
    assert info["resumed_from"] in versions, info["resumed_from"]
    assert_equal_runs(out, ref)


def test_import_deepfreeze_torch_does_not_import_lightning():
    code = ("import sys, deepfreeze.torch; bad = [m for m in ('pytorch_lightning', 'lightning', 'lightning_fabric') "
            "if m in sys.modules]; assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]


def test_fsdp1_and_deepspeed_refused_and_bad_arguments():
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    from deepfreeze.errors import ConfigError
    from deepfreeze.torch.lightning import DeepFreezeCallback, check_strategy
    with pytest.raises(ConfigError, match="FSDPStrategy"):
        check_strategy(FSDPStrategy())
    # DeepSpeedStrategy's constructor needs the deepspeed package (not installed): an instance without it
    with pytest.raises(ConfigError, match="DeepSpeedStrategy"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))
    check_strategy(DDPStrategy())
    for kw, what in [({"every_n_train_steps": 0}, "every_n_train_steps"),
                     ({"every_n_train_steps": True}, "every_n_train_steps"),
                     ({"resume": True, "overwrite": True}, "contradict"),
                     ({"state": {"lightning": object()}}, "lightning"),
                     ({"every_n_steps": 3}, "every_n_train_steps")]:
        with pytest.raises(ConfigError, match=what):
            DeepFreezeCallback(name="x", **kw)


def test_resume_and_ckpt_path_together_refused(tmp_path):
    """fit(ckpt_path=...) with DeepFreezeCallback(resume=True): two restores, a ConfigError at
    on_fit_start, before the checkpointer is built (nothing written under scratch or persistent)."""
    import pytorch_lightning as pl
    import torch

    from deepfreeze.errors import ConfigError
    from deepfreeze.torch.lightning import DeepFreezeCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)

    module = Tiny()
    path = str(tmp_path / "lightning.ckpt")
    torch.save({"pytorch-lightning_version": pl.__version__, "state_dict": module.state_dict()}, path)
    cb = DeepFreezeCallback(name="both", every_n_train_steps=1, resume=True, mode="sync",
                            scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "persistent"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="ckpt_path"):
        trainer.fit(module, ckpt_path=path)
    assert cb.checkpointer is None and not os.path.exists(tmp_path / "persistent")


def test_tested_lightning_and_torchdata_versions():
    """DeepFreezeCallback's resume with loader workers (``_remake_iterator``) relies on private
    attributes and on the order of Lightning's ``FitLoop.setup_data``: pinned to what was tested."""
    import pytorch_lightning
    import torchdata
    got = (pytorch_lightning.__version__, torchdata.__version__.split("+")[0])
    assert got == ("2.6.6", "0.11.0"), (
        f"pytorch_lightning {got[0]}, torchdata {got[1]}: tested with 2.6.6 and 0.11.0. Re-check "
        "deepfreeze/torch/lightning.py's DeepFreezeCallback._remake_iterator against the new versions: that "
        "FitLoop.setup_data still calls train_dataloader(), _load_combined_loader_states() and iter(_data_fetcher) "
        "with no hook between and on_advance_start sets the samplers' epoch after on_train_start; that "
        "FitLoop._combined_loader, FitLoop._data_fetcher, CombinedLoader._load_state_dicts/reset, "
        "epoch_progress.current.processed, StatefulDataLoader._iterator and its _shutdown_workers() exist as used; "
        "that StatefulDataLoader still saves each worker's dataset.state_dict() with every batch (the worker "
        "generator pattern of docs/torch.md). Then run this file with -m slow and update these versions")


class _Items(object):
    """8 items of 2 features (a map-style dataset without state_dict())."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import torch
        return torch.full((2,), float(i))


class _ItemsWithState(_Items):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _one_rank_fit(tmp_path, dataset, *, max_steps: int, resume: bool = False, sampler_cls=None, workers: int = 1):
    """A 1-rank in-process fit (4 batches of 2 per epoch, a sync checkpoint every step) over a
    StatefulDataLoader with ``workers`` workers and torchdata's StatefulDistributedSampler (or ``sampler_cls``)."""
    import pytorch_lightning as pl
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    from deepfreeze.torch.lightning import DeepFreezeCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            sampler = (sampler_cls or StatefulDistributedSampler)(dataset, num_replicas=1, rank=0, shuffle=True)
            return StatefulDataLoader(dataset, batch_size=2, sampler=sampler, num_workers=workers)

    cb = DeepFreezeCallback(name="tiny", every_n_train_steps=1, resume=resume, mode="sync",
                            scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "persistent"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny())
    return cb


def _worker_rng_warnings(caplog) -> list:
    return [r for r in caplog.records if r.name == "deepfreeze" and "no state_dict()" in r.getMessage()]


def test_loader_workers_over_a_dataset_without_state_dict_warn_once_per_fit(tmp_path, caplog):
    """num_workers > 0 over a dataset without state_dict(): what its workers draw from their global
    RNGs is in no checkpoint: one warning per fit (at the first checkpoint of 3), naming the dataset;
    none over a dataset with state_dict(), none without workers."""
    caplog.set_level(logging.WARNING, logger="deepfreeze")
    _one_rank_fit(tmp_path / "a", _Items(), max_steps=3)
    got = _worker_rng_warnings(caplog)
    assert len(got) == 1 and "_Items" in got[0].getMessage() and "num_workers=1" in got[0].getMessage(), got
    caplog.clear()
    _one_rank_fit(tmp_path / "b", _ItemsWithState(), max_steps=3)
    _one_rank_fit(tmp_path / "c", _Items(), max_steps=3, workers=0)
    assert not _worker_rng_warnings(caplog)


def test_resume_with_workers_refuses_a_sampler_whose_epoch_cannot_be_set(tmp_path):
    """A mid-epoch resume (v6: epoch 1, batch 2) whose loader has workers and a sampler that ignores
    set_epoch once it has been iterated (the restored iterator iterated it before on_train_start):
    its workers would get epoch 0's permutation, so on_train_start raises a ConfigError naming the
    line for train_dataloader(); a sampler that takes it resumes."""
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    from deepfreeze.errors import ConfigError

    class FrozenOnIter(StatefulDistributedSampler):
        iterated = False

        def __iter__(self):
            self.iterated = True
            return super().__iter__()

        def set_epoch(self, epoch: int) -> None:
            if not self.iterated:
                super().set_epoch(epoch)

    _one_rank_fit(tmp_path, _ItemsWithState(), max_steps=6)
    with pytest.raises(ConfigError, match=r"FrozenOnIter.* at epoch 0 after set_epoch\(1\).*"
                                          r"sampler\.set_epoch\(self\.current_epoch\)"):
        _one_rank_fit(tmp_path, _ItemsWithState(), max_steps=8, resume=True, sampler_cls=FrozenOnIter)
    cb = _one_rank_fit(tmp_path, _ItemsWithState(), max_steps=8, resume=True)
    assert cb.resumed_from == 6 and cb.checkpointer.last_version == 8


def test_mid_epoch_resume_over_lightnings_sampler_wrapper_warns(tmp_path, caplog):
    """Lightning's DistributedSamplerWrapper (what use_distributed_sampler=True puts over
    StatefulDataLoader(shuffle=True)'s torchdata RandomSampler) is not in the loader's saved state:
    the wrapped sampler draws the rest of the epoch's permutation anew: one warning on a mid-epoch resume."""
    from lightning_fabric.utilities.distributed import DistributedSamplerWrapper
    from torchdata.stateful_dataloader.sampler import RandomSampler

    def wrapped(ds, **kw):
        return DistributedSamplerWrapper(RandomSampler(ds), **kw)

    caplog.set_level(logging.WARNING, logger="deepfreeze")
    _one_rank_fit(tmp_path, _ItemsWithState(), max_steps=6, sampler_cls=wrapped)
    assert not [r for r in caplog.records if "DistributedSamplerWrapper" in r.getMessage()]
    _one_rank_fit(tmp_path, _ItemsWithState(), max_steps=8, resume=True, sampler_cls=wrapped)
    got = [r for r in caplog.records if r.name == "deepfreeze" and "DistributedSamplerWrapper" in r.getMessage()]
    assert len(got) == 1 and "resumed epoch 1" in got[0].getMessage(), got


def test_teardown_keeps_the_last_step_and_an_exception_does_not(tmp_path):
    """Issue 42, finding 4 under Lightning: a fit of 5 steps at every 3 ends with v3 and, through
    teardown's normal close (save_last, the default), v5 holding the trained weights; a fit whose
    training_step raises at step 5 keeps v3 only (on_exception closes without the last step)."""
    import pytorch_lightning as pl
    import torch

    from deepfreeze import Config, list_versions
    from deepfreeze.torch import load
    from deepfreeze.torch.lightning import DeepFreezeCallback

    class Tiny(pl.LightningModule):
        def __init__(self, fail_at: int = -1) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.fail_at = torch.nn.Linear(2, 1), fail_at

        def training_step(self, batch, batch_idx):
            if self.global_step == self.fail_at:
                raise RuntimeError("the step failed")
            return self.lin(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=2)

    for name, fail_at, want in (("ok", -1, [3, 5]), ("fails", 4, [3])):
        kw = dict(scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "persistent"))
        cb = DeepFreezeCallback(name=name, every_n_train_steps=3, **kw)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[cb], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=str(tmp_path))
        module = Tiny(fail_at)
        if fail_at < 0:
            trainer.fit(module)
        else:
            with pytest.raises(RuntimeError, match="the step failed"):
                trainer.fit(module)
        assert sorted(list_versions(Config.resolve(None, **kw), name)) == want, name
        if fail_at < 0:
            got = load(name=name, **kw)
            for k, v in module.lin.state_dict().items():
                assert got[f"lin.{k}"].numpy().tobytes() == v.detach().numpy().tobytes(), k
