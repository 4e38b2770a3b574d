"""Every adapter path on both write paths of a version (the ``write_once`` fixture of conftest.py):
``auto``, the shipped default, where one disk holds scratch and persistent and every version goes
from memory straight into persistent, and ``off``, through a scratch file. Each test is one small
real job; it checks that the path it asked for is the one taken (a flushed version has a scratch
shard exactly when ``off``) and that every committed version equals the state the job recorded.

The default path went untested for years of a suite that forced ``off`` for every test, and every
FSDP2 checkpoint it wrote was unreadable (issue 40). Other pairs: tests/test_stream_core.py
(the stream's persistent fallback), tests/test_memtier_engine.py (the memory tier),
tests/test_mpi.py (VeloC, where present).
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from _util import WORKERS, mpirun


def scratch_shards(out: str) -> list[str]:
    """The rank shard files under any scratch directory of a job's output."""
    return sorted(p for p in glob.glob(os.path.join(out, "**", "r[0-9]*.dfs"), recursive=True)
                  if "persistent" not in os.path.relpath(p, out).split(os.sep))


def assert_path_taken(out: str, write_once: str) -> None:
    shards = scratch_shards(out)
    if write_once == "auto":
        assert not shards, f"write_once = auto on one disk wrote scratch files: {shards[:4]}"
    else:
        assert shards, "write_once = off wrote no scratch file"


@pytest.fixture(scope="module")
def keras_jobs(tmp_path_factory, module_runtime_dir):
    """The Keras job on each write path (the write_once fixture's: ``auto`` without VELOC_WRITE_ONCE,
    ``off`` with VELOC_WRITE_ONCE=off in the job's environment), one after the other in one 2-rank
    mpirun (tests/workers/train.py: '+'-separated jobs, env.KEY=VALUE a job's own): one TensorFlow
    and Horovod start-up for both."""
    root = tmp_path_factory.mktemp("keras")
    job = ["sync", "every=2", "epochs=1", "samples=64"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VELOC_WRITE_ONCE", raising=False)  # auto: the environment as the user gets it
        p = mpirun(2, f"{WORKERS}/train.py", str(root / "auto"), *job, "+", str(root / "off"), *job,
                   "env.VELOC_WRITE_ONCE=off", timeout=600, check=False)
    return {"auto": str(root / "auto"), "off": str(root / "off")}, p


@pytest.mark.mpi
@pytest.mark.timeout(1200)  # the first of the two waits for both jobs (:func:`keras_jobs`)
def test_keras_horovod(keras_jobs, write_once):
    from test_mpi import check_job
    outs, p = keras_jobs
    if p.returncode != 0:
        pytest.fail(f"{' '.join(p.args)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                    f"stderr:\n{p.stderr[-6000:]}")
    out = outs[write_once]  # the job on this write path (write_once names it)
    taken, committed = check_job(out, 2, lambda t: t)  # every version committed, each bit-exact
    assert len(taken) >= 2 and committed == taken
    assert_path_taken(out, write_once)


torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")
from test_torch import TRAIN, assert_same, loaded, npz, torchrun  # noqa: E402


def test_torch_ddp(tmp_path, write_once):
    out = str(tmp_path)
    torchrun(2, TRAIN, out, "steps=6")
    for v in (3, 6):
        want = npz(os.path.join(out, "r0", f"v{v}.npz"))
        assert_same(loaded(out, v), want, f"DDP v{v} ({write_once})", lr=False)
    assert_path_taken(out, write_once)


def test_torch_fsdp2(tmp_path, write_once):
    from test_torch_fsdp import FSDP, load, recorded
    out = str(tmp_path)
    torchrun(2, FSDP, "train", out, "steps=6")
    for v in (3, 6):
        assert_same(load(out, v), recorded(out, 0, v), f"FSDP2 v{v} ({write_once})", lr=False)
    assert_path_taken(out, write_once)


def test_lightning(tmp_path, write_once):
    """One epoch of 6 steps, a checkpoint every 6: v6 is the state the fit ends with."""
    pytest.importorskip("pytorch_lightning", reason="Lightning is not installed (scripts/setup.sh installs it)")
    import deepfreeze.torch as dft
    out = str(tmp_path)
    torchrun(2, os.path.join(WORKERS, "lightning_train.py"), out, "epochs=1", "every=6")
    with open(os.path.join(out, "r0", "final.json")) as f:
        assert json.load(f)["last_version"] == 6
    got = dft.load(name="lt", version=6, mode="sync", scratch=os.path.join(out, "scratch0"),
                   persistent=os.path.join(out, "persistent"))
    final = npz(os.path.join(out, "r0", "final.npz"))
    model = {k: v.numpy() for k, v in got.items() if f"model.{k}" in final}
    assert len(model) >= 2, sorted(got)[:6]
    assert_same(model, {k: final[f"model.{k}"] for k in model}, f"Lightning v6 ({write_once})", lr=False)
    assert_path_taken(out, write_once)


def test_hugging_face_trainer(tmp_path, write_once):
    """Six steps of a Trainer with DeepFreezeCallback every 6: v6 is the model the training ends with."""
    pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it)")
    import deepfreeze.torch as dft
    out = str(tmp_path)
    torchrun(2, os.path.join(WORKERS, "hf_train.py"), out, "first", "steps=6", "every=6", timeout=400)
    got = dft.load(name="hf", version=6, mode="sync", scratch=os.path.join(out, "scratch"),
                   persistent=os.path.join(out, "persistent"))
    want = torch.load(os.path.join(out, "first_rank0.pt"), weights_only=True)["model"]
    common = [k for k in want if k in got]
    assert len(common) >= 4
    assert_same({k: got[k].numpy() for k in common}, {k: want[k].numpy() for k in common},
                f"Trainer v6 ({write_once})", lr=False)
    assert_path_taken(out, write_once)
