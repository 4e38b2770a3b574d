"""Scratch full (ENOSPC) during fit: on_error='warn' goes on, 'raise' stops; nothing partial."""
import errno
import os
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from deepfreeze import list_versions  # noqa: E402
from deepfreeze.errors import CheckpointWriteError  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.levels import ScratchLevel  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "workers"))
from models import build  # noqa: E402


class FullAfter4(ScratchLevel):
    """The node-local disk is full from step 5 on (a real ENOSPC after a partial write)."""

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        if version > 4:
            vdir = self.version_dir(name, version)
            self.makedirs(vdir)
            with open(os.path.join(vdir, f".r{rank:06d}.dfs.tmp-full"), "wb") as f:
                f.write(b"partial")
            os.unlink(os.path.join(vdir, f".r{rank:06d}.dfs.tmp-full"))
            raise CheckpointWriteError(errno.ENOSPC, f"No space left on device writing v{version} (injected)")
        return super().write_shard(name, version, rank, plan, arrays, **kw)


def fit(tmp_path, on_error, mode, **kw):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode=mode, on_error=on_error,
                                scratch_cls=FullAfter4, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                                **kw)
    r = np.random.default_rng(0)
    x, y = r.random((160, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 160)
    return model, ckpt, lambda: model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_warn_keeps_training(tmp_path, mode):
    model, ckpt, run = fit(tmp_path, "warn", mode)
    history = run()
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations.numpy()) == 10
    assert ckpt.failures and all("No space left" in f for f in ckpt.failures)
    ckpt.close()
    assert list(list_versions(ckpt.config, "k")) == [2, 4]  # nothing partial


@pytest.mark.parametrize("mode,max_inflight", [("sync", 2), ("async", 1), ("async", 2)])
def test_raise_stops_training(tmp_path, mode, max_inflight):
    """The failed write of v6 raises in v6's call (sync), else at the first checkpoint call that
    finds it finished: with max_inflight = 1 that is v8's (which waits for v6); with a queue, a
    later one or the end of fit."""
    model, ckpt, run = fit(tmp_path, "raise", mode, max_inflight=max_inflight)
    with pytest.raises(CheckpointWriteError, match="No space left"):
        run()
    if mode == "sync":
        assert int(model.optimizer.iterations.numpy()) == 6  # the checkpoint call itself raised
    elif max_inflight == 1:
        assert int(model.optimizer.iterations.numpy()) == 8  # stopped at the next checkpoint
    else:
        assert int(model.optimizer.iterations.numpy()) <= 10
    assert list(list_versions(ckpt.config, "k")) == [2, 4]
    assert "_update_step" not in model.optimizer.__dict__  # the hook is removed even so
    ckpt.close()
