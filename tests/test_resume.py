"""Exact resume: uninterrupted vs killed mid-epoch and relaunched with resume=True, bit-identical."""
import os
import subprocess
import sys

import numpy as np
import pytest

from _util import WORKERS, mpirun

pytest.importorskip("tensorflow")


def run(*args, expect_kill=False):
    p = subprocess.run([sys.executable, f"{WORKERS}/resume.py", *args], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if expect_kill:
        assert p.returncode == -9, p.stderr[-3000:]
    else:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def final(out):
    with np.load(f"{out}/final.npz", allow_pickle=False) as z:
        return [z[f"arr_{i}"].tobytes() for i in range(len(z.files))]


def test_killed_mid_epoch_then_relaunched_ends_bit_identical(tmp_path):
    a, b = str(tmp_path / "straight"), str(tmp_path / "killed")
    assert "resumed_from=None iterations=18" in run(a)
    run(b, "kill_at=10", expect_kill=True)  # epoch 1, step 4 of 6; newest checkpoint v8
    assert not os.path.exists(f"{b}/final.npz")
    assert "resumed_from=8 iterations=18" in run(b, "resume=1")  # the relaunch, same command + resume
    assert final(a) == final(b)  # weights, optimizer slots and iteration counter


def test_resume_without_checkpoint_starts_fresh_and_at_epoch_boundary(tmp_path):
    a, b = str(tmp_path / "straight"), str(tmp_path / "killed")
    run(a)
    assert "resumed_from=None iterations=18" in run(b, "resume=1")  # nothing to resume: fresh
    assert final(a) == final(b)
    c = str(tmp_path / "boundary")
    run(c, "kill_at=13", expect_kill=True)  # newest checkpoint v12 = end of epoch 1
    assert "resumed_from=12 iterations=18" in run(c, "resume=1")
    assert final(a) == final(c)


@pytest.mark.mpi
def test_two_ranks_killed_and_resumed_bit_identical(tmp_path):
    a, b = str(tmp_path / "straight"), str(tmp_path / "killed")
    mpirun(2, f"{WORKERS}/resume.py", a, "hvd=1")
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "kill_at=10", check=False)
    assert p.returncode != 0 and not os.path.exists(f"{b}/final.npz")
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "resume=1")
    assert "resumed_from=8 iterations=18" in p.stdout
    assert final(a) == final(b)
