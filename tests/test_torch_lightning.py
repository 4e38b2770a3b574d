"""DeepFreeze in PyTorch Lightning: ``deepfreeze.torch.lightning.DeepFreezeCallback`` in real
2-rank ``ddp`` fits on CPU under torchrun (tests/workers/lightning_train.py).

Every check is against state the runs recorded per rank (final.npz / final.json, loss<S>.txt),
never stdout. torchrun, not Lightning's own launcher: Lightning's ``ddp`` launches the other
ranks itself as children of rank 0, and a SIGKILLed child leaves rank 0 blocked in a gloo
collective until the process-group timeout; torchrun's agent sees the death and ends the job.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")
pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed (scripts/setup.sh installs 2.6.6)")
pytest.importorskip("torchdata", reason="torchdata is not installed (scripts/setup.sh installs 0.11.0)")

from _util import ROOT, WORKERS  # noqa: E402
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank fit (2 epochs of 6 batches per rank, a checkpoint every 4 steps)."""
    out = str(tmp_path_factory.mktemp("lightning_ref"))
    torchrun(2, TRAIN, out, "epochs=2")
    return out


def test_kill9_mid_epoch_then_resume_equals_uninterrupted(reference, tmp_path):
    """Rank 1 SIGKILLs itself when global step 10 starts (epoch 1, batch 4); the relaunch with
    resume=True continues from v8 (epoch 1, batch 2: mid-epoch) and ends bit-identical to the
    uninterrupted fit on both ranks."""
    out = str(tmp_path)
    p = torchrun(2, TRAIN, out, "epochs=2", "kill_at=10", check=False)
    assert p.returncode != 0 and not os.path.exists(os.path.join(out, "r0", "final.json"))
    torchrun(2, TRAIN, out, "epochs=2", "resume=1")
    _, info = _final(out, 0)
    assert info["resumed_from"] in (4, 8), info["resumed_from"]  # v4 if v8 was not on scratch yet: both mid-epoch
    assert min(_losses(out, 0)) == 0 and 8 in _losses(out, 0)
    assert info["last_version"] == 12
    assert_equal_runs(out, reference)


def test_kill9_mid_epoch_with_loader_workers_then_resume_equals_uninterrupted(tmp_path):
    """The loader with 2 worker processes (items without random noise): rank 1 SIGKILLs itself at
    step 10, the relaunch resumes from v8 (epoch 1, batch 2) and ends bit-identical to the
    uninterrupted fit. The restored iterator's workers prefetch indices before Lightning sets the
    sampler's epoch: without the callback's ``on_train_start`` the rest of epoch 1 was epoch 0's
    permutation."""
    args = ("epochs=2", "workers=2", "aug=none")
    ref = str(tmp_path / "ref")
    torchrun(2, TRAIN, ref, *args)
    out = str(tmp_path / "crash")
    p = torchrun(2, TRAIN, out, *args, "kill_at=10", check=False)
    assert p.returncode != 0 and not os.path.exists(os.path.join(out, "r0", "final.json"))
    torchrun(2, TRAIN, out, *args, "resume=1")
    _, info = _final(out, 0)
    assert info["resumed_from"] in (4, 8), info["resumed_from"]
    assert_equal_runs(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("args,kill_at,kill_rank,versions", [
    (("mode=async",), 13, 0, (12, 8)),
    (("mode=sync",), 5, 1, (4,)),
    (("accum=2", "every=2"), 6, 1, (4, 2)),
], ids=["epoch-end", "sync", "accumulation"])
def test_kill9_other_points_then_resume(tmp_path, args, kill_at, kill_rank, versions):
    """Slow, 3 epochs each: rank 0 killed at step 13 (the newest version, v12, is the last batch of
    epoch 1: a resume at an epoch's end); rank 1 killed at step 5 in epoch 0 (sync mode); gradient
    accumulation over 2 batches (3 optimizer steps per epoch, a checkpoint every 2), rank 1 killed
    at step 6 (v4 is epoch 1, batch 2)."""
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
