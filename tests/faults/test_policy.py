"""Scratch full (ENOSPC) or unusable during fit: on_error='warn' goes on, 'raise' stops; nothing
partial. Unusable directories at train begin; the decision file's temporary file."""
import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from deepfreeze import list_versions  # noqa: E402
from deepfreeze.errors import CheckpointWriteError, ConfigError  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.tiers.scratch import ScratchLevel  # noqa: E402

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
@pytest.mark.scratch_files("the full disk is injected in the scratch write (scratch_cls)")
def test_warn_keeps_training(tmp_path, mode):
    model, ckpt, run = fit(tmp_path, "warn", mode)
    history = run()
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations.numpy()) == 10
    assert ckpt.failures and all("No space left" in f for f in ckpt.failures)
    ckpt.close()
    assert list(list_versions(ckpt.config, "k")) == [2, 4]  # nothing partial


@pytest.mark.parametrize("mode,max_inflight", [("sync", 2), ("async", 1), ("async", 2)])
@pytest.mark.scratch_files("the full disk is injected in the scratch write (scratch_cls)")
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
    try:
        ckpt.close()
    except CheckpointWriteError as e:  # with a queue, a later version handed off before fit stopped failed too
        assert mode == "async" and max_inflight > 1 and "No space left" in str(e)
    assert ckpt.engine is None and ckpt.run_id is None  # closed all the same


class FileInTheWay(ScratchLevel):
    """From v6 on a file stands where a directory must be: ``where = "name"``: the checkpoint's
    directory ``<scratch>/k`` was replaced by a file (creating the version directory fails);
    ``where = "version"``: a file named like a version directory (retention fails)."""

    where = "name"

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        if version == 6:
            if self.where == "name":
                os.rename(self.name_dir(name), self.name_dir(name) + ".moved")
                path = self.name_dir(name)
            else:
                path = self.version_dir(name, 3)
            with open(path, "wb") as f:
                f.write(b"not a directory")
        return super().write_shard(name, version, rank, plan, arrays, **kw)


class VersionFileInTheWay(FileInTheWay):
    where = "version"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.scratch_files("the file is planted by the scratch write (scratch_cls) and retention of scratch passes over it")
def test_a_file_named_like_a_version_is_left_alone(tmp_path, mode):
    """Retention passes over a file where a version directory would be (not its to remove):
    no error, training and checkpoints go on."""
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode=mode, on_error="raise",
                                scratch_cls=VersionFileInTheWay, scratch=str(tmp_path / "s"),
                                persistent=str(tmp_path / "p"), scratch_versions=1)
    r = np.random.default_rng(0)
    x, y = r.random((160, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 160)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.wait()
    ckpt.close()
    assert not ckpt.failures and sorted(list_versions(ckpt.config, "k"))[-1] == 10
    assert (tmp_path / "s" / "k" / "v000000000003").read_bytes() == b"not a directory"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("level", [FileInTheWay])
@pytest.mark.scratch_files("the file is planted by the scratch write (scratch_cls)")
def test_warn_catches_scratch_directory_errors(tmp_path, mode, level):
    """A NotADirectoryError from creating a version directory is a CheckpointWriteError naming
    scratch and where its value came from: 'warn' goes on."""
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode=mode, on_error="warn",
                                scratch_cls=level, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                                scratch_versions=1)
    r = np.random.default_rng(0)
    x, y = r.random((160, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 160)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    ckpt.wait()  # async: the backend's flush of v4 may fail too (its shard moved away): also a warning
    ckpt.close()
    # in async mode the flushes and retention run in the backend, whose errors are reported as BackendError
    ours = [f for f in ckpt.failures if "background flush" not in f]
    assert ours, ckpt.failures
    assert mode == "async" or ours == ckpt.failures, ckpt.failures
    for f in ours:  # v6 on: the writer thread's own error, named with the key's source
        assert "Not a directory on scratch" in f and "(keyword override)" in f, f
    for f in ckpt.failures:  # a flush still pending when v6's write moved <scratch>/k away (how many depends on
        # how far the backend had come: a loaded machine) fails on the path: a file there, or nothing yet
        assert "Not a directory" in f or "No such file or directory" in f, f
    if level is FileInTheWay:  # nothing from v6 on could be written (async: v4's, even v2's, shard moved away too)
        from deepfreeze.tiers.persistent import PersistentLevel
        committed = PersistentLevel(ckpt.config.persistent).committed_versions("k")
        assert committed == [2, 4] if mode == "sync" else committed in ([], [2], [2, 4])


@pytest.mark.scratch_files("the file is planted by the scratch write (scratch_cls)")
def test_raise_is_a_checkpoint_write_error_in_sync_mode(tmp_path):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode="sync",
                                scratch_cls=FileInTheWay, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    r = np.random.default_rng(0)
    x, y = r.random((160, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 160)
    with pytest.raises(CheckpointWriteError, match=r"k' v6 failed: Not a directory on scratch") as e:
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    assert e.value.errno == errno.ENOTDIR
    assert int(model.optimizer.iterations.numpy()) == 6
    ckpt.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("key", ["scratch", "persistent"])
def test_unusable_directory_is_a_config_error_at_train_begin(tmp_path, mode, key):
    """A file where the scratch (or persistent) directory, or one of its parents, should be:
    one ConfigError when fit begins, naming the key, the file and the INI line."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    paths = {"scratch": str(tmp_path / "s"), "persistent": str(tmp_path / "p")}
    for bad in (str(blocker), str(blocker / "sub")):
        paths[key] = bad
        cfg = tmp_path / "c.cfg"
        cfg.write_text(f"mode = {mode}\nscratch = {paths['scratch']}\npersistent = {paths['persistent']}\n")
        model = build()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        ckpt = DeepFreezeCheckpoint(str(cfg), name="k", every_n_batches=2)
        line = 2 if key == "scratch" else 3
        with pytest.raises(ConfigError, match=rf"c\.cfg:{line}: {key} = {bad} is unusable: {blocker} exists and "
                                              "is not a directory"):
            model.fit(np.zeros((32, 12, 12, 1), np.float32), np.zeros(32), batch_size=16, verbose=0,
                      callbacks=[ckpt])
        ckpt.close()
        assert not os.path.exists(tmp_path / "s" / "k")  # nothing was written


def test_decision_temporary_file_is_owner_only_and_removed_after_a_write_error(tmp_path):
    """The decision file is created exclusively from a 0600 temporary file; when writing that
    file fails (here a real EFBIG from RLIMIT_FSIZE, as ENOSPC would), nothing is left behind."""
    from deepfreeze.tiers.persistent import PersistentLevel
    level = PersistentLevel(str(tmp_path / "p"))
    assert level.decide("k", 1, 0)
    path = tmp_path / "p" / "k" / "v000000000001" / "decision"
    assert json.loads(path.read_bytes())["decision"] == "flush" and (path.stat().st_mode & 0o777) == 0o600
    code = ("import resource, signal, sys\n"
            "from deepfreeze.tiers.persistent import PersistentLevel\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (2, 2))\n"
            "try:\n"
            "    PersistentLevel(sys.argv[1]).decide('k', 2, 0)\n"
            "except OSError as e:\n"
            "    print('errno', e.errno)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and f"errno {errno.EFBIG}" in p.stdout, p.stderr
    assert sorted(os.listdir(tmp_path / "p" / "k" / "v000000000002")) == []  # no decision, no decision.tmp*


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any directory whatever its mode (and the "
                    "unprivileged account 'nobody' cannot run this venv's Python, which lives under /root)")
def test_directory_without_write_permission_is_a_config_error(tmp_path):
    from deepfreeze import Config
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        cfg = Config.load(None, env={}, mode="sync", scratch=str(locked / "s"), persistent=str(tmp_path / "p"))
        with pytest.raises(ConfigError, match=rf"keyword override: scratch = {locked}/s is unusable: no permission "
                                              rf"to create {locked}/s in {locked} \(owner uid \d+, mode 0500"):
            cfg.check_directories()
    finally:
        locked.chmod(0o700)


@pytest.mark.scratch_files("the file is planted by the scratch write (scratch_cls)")
def test_sync_warn_catches_persistent_directory_errors(tmp_path):
    """In sync mode the flush runs in the training process: a file where the persistent
    checkpoint directory should be is a CheckpointWriteError naming persistent; 'warn' goes on."""
    pfs = tmp_path / "p"

    class PersistentInTheWay(ScratchLevel):
        def write_shard(self, name, version, rank, plan, arrays, **kw):
            if version == 6:
                os.rename(pfs / name, pfs / f"{name}.moved")
                (pfs / name).write_bytes(b"not a directory")
            return super().write_shard(name, version, rank, plan, arrays, **kw)

    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode="sync", on_error="warn",
                                scratch_cls=PersistentInTheWay, scratch=str(tmp_path / "s"), persistent=str(pfs))
    r = np.random.default_rng(0)
    x, y = r.random((160, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 160)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    ckpt.close()
    assert len(ckpt.failures) == 3  # v6, v8, v10: each on scratch, none on persistent
    assert all("Not a directory on persistent" in f and f"persistent = {pfs} (keyword override)" in f
               for f in ckpt.failures), ckpt.failures
