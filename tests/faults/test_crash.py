"""Crashes in real multi-rank Horovod jobs: a rank killed mid-write, a node's scratch lost."""
import glob
import os
import re
import shutil
import time

import numpy as np
import pytest

from deepfreeze import Config
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load

from _util import WORKERS, mpirun

pytestmark = pytest.mark.mpi


def cfg(out, node=0):
    return Config.load(None, mode="async", scratch=f"{out}/node{node}/scratch", persistent=f"{out}/persistent")


def expected(out, v):
    with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as z:
        return [z[f"arr_{i}"].tobytes() for i in range(len(z.files))]


def backend_pids(out):
    pids = []
    for log in glob.glob(f"{out}/node*/scratch/.deepfreeze-backend.log"):
        pids += [int(p) for p in re.findall(r"backend (\d+) listening", open(log).read())]
    return pids


def wait_gone(pids, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


@pytest.mark.scratch_files("the rank is killed inside its scratch shard write")
def test_rank_killed_while_writing_its_shard(tmp_path):
    out = str(tmp_path)
    t0 = time.monotonic()
    p = mpirun(2, f"{WORKERS}/train.py", out, "async", "every=3", "kill=1:9", check=False, timeout=240)
    assert p.returncode != 0  # the job died (Horovod/mpirun take the other rank down)
    assert time.monotonic() - t0 < 240
    assert wait_gone(backend_pids(out)) == []  # the backends finish what they have and exit: no hang
    committed = PersistentLevel(f"{out}/persistent").committed_versions("job")
    assert committed == [3, 6]  # v9 was never committed anywhere
    for v in committed:
        assert [a.tobytes() for a in load(cfg(out), "job", v).model_arrays().values()] == expected(out, v)
    ck = load(cfg(out, 1), "job")  # restore gets the previous version
    assert ck.version == 6
    assert not os.path.exists(ScratchLevel(f"{out}/node1/scratch").shard_path("job", 9, 1))


def test_lost_node_scratch_restores_from_persistent(tmp_path):
    out = str(tmp_path)
    mpirun(2, f"{WORKERS}/train.py", out, "async", "every=4", "epochs=1")
    shutil.rmtree(f"{out}/node1/scratch")  # node 1 is gone with its local disk
    newest = PersistentLevel(f"{out}/persistent").committed_versions("job")[-1]
    p = mpirun(2, f"{WORKERS}/restore.py", out, str(newest))
    assert p.stdout.count("bitexact=True") == 2
