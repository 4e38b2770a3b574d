"""The shared suite every engine must pass: built-in and VeloC, sync and async.

Each case is a real multi-rank job (tests/workers/numpy_job.py under mpirun: numpy
tensors, no TensorFlow) followed by checks on the files and restores in this process
and in other world sizes. VeloC cases skip with the reason when no VeloC is found
(point DEEPFREEZE_VELOC_PREFIX to an install). VeloC runs one backend per user and
machine with one configuration, so its jobs put all ranks on one simulated node and
the backend is stopped after each case.
"""
import json
import os

import pytest

import deepfreeze
from deepfreeze import Config
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel

from _util import WORKERS, mpirun

JOB = os.path.join(WORKERS, "numpy_job.py")
pytestmark = pytest.mark.mpi


def _veloc_missing():
    try:
        from deepfreeze.bindings.veloc import available
    except ImportError as e:  # an install without the bindings package: reinstall
        return str(e)
    return available()


@pytest.fixture(params=["builtin", pytest.param("veloc", marks=pytest.mark.xdist_group("veloc"))])  # one VeloC daemon per user
def engine(request):
    if request.param == "veloc":
        why = _veloc_missing()
        if why:
            pytest.skip(f"VeloC not found: {why}")
        from deepfreeze.veloc_daemon import stop_backend
        stop_backend()
        yield "veloc"
        stop_backend()
    else:
        yield "builtin"


@pytest.fixture(params=["sync", "async"])
def mode(request):
    return request.param


def run(root, engine, mode, versions="1,2,3", ranks=2, **keys):
    opts = {"engine": engine, "mode": mode, "persistent_interval": 0, "ec_interval": -1,
            "max_versions": 0, "scratch_versions": 2, **keys}
    mpirun(ranks, JOB, "write", str(root), "1", versions, *[f"{k}={v}" for k, v in opts.items()])


def restore(root, ranks, *args):
    mpirun(ranks, JOB, "restore", str(root), "1", *args)
    return json.load(open(root / "restored.json"))


def cfg(root):
    return Config.load(None, mode="async", scratch=f"{root}/node0/scratch", persistent=f"{root}/persistent")


def expected(version):
    import importlib.util
    spec = importlib.util.spec_from_file_location("numpy_job", JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job.arrays(version)


def assert_bit_exact(ck):
    assert [a.tobytes() for a in ck.arrays.values()] == [e.tobytes() for e in expected(ck.version)]


@pytest.mark.scratch_files("lists every version on both levels")
def test_every_version_assembled_on_persistent_bit_exact(tmp_path, engine, mode):
    run(tmp_path, engine, mode)
    pfs = PersistentLevel(f"{tmp_path}/persistent")
    assert pfs.committed_versions("job") == [1, 2, 3]
    for v in (1, 2, 3):
        files = set(os.listdir(pfs.version_dir("job", v)))
        assert {"manifest.json", "model.dfz"} <= files <= {"manifest.json", "model.dfz", "decision"}
    assert deepfreeze.list_versions(cfg(tmp_path), "job") == {1: ["persistent"], 2: ["scratch", "persistent"],
                                                              3: ["scratch", "persistent"]}
    ck = deepfreeze.load(cfg(tmp_path), "job", 1)
    assert ck.level == "persistent" and ck.manifest["world_size"] == 2
    assert_bit_exact(ck)
    if engine == "veloc":  # the scratch shards are VeloC's own scratch files (hard links)
        for r in (0, 1):
            assert os.path.samefile(f"{tmp_path}/node0/scratch/job/v000000000003/r{r:06d}.dfs",
                                    f"{tmp_path}/node0/scratch/job-{r}-3.dat")


@pytest.mark.scratch_files("restores from scratch")
def test_restore_from_scratch_at_any_world_size(tmp_path, engine, mode):
    run(tmp_path, engine, mode)
    ck = deepfreeze.load(cfg(tmp_path), "job")  # one process, no MPI
    assert (ck.version, ck.level) == (3, "scratch")
    assert_bit_exact(ck)
    for ranks in (2, 3):
        assert restore(tmp_path, ranks) == {"version": 3, "level": "scratch", "bit_exact": True, "size": ranks}


@pytest.mark.scratch_files("retention of scratch versions")
def test_retention_on_both_levels(tmp_path, engine, mode):
    run(tmp_path, engine, mode, versions="1,2,3,4", max_versions=2, scratch_versions=1)
    assert PersistentLevel(f"{tmp_path}/persistent").committed_versions("job") == [3, 4]
    assert ScratchLevel(f"{tmp_path}/node0/scratch").versions("job") == [4]
    assert_bit_exact(deepfreeze.load(cfg(tmp_path), "job", 3))


def test_persistent_level_disabled(tmp_path, engine, mode):
    run(tmp_path, engine, mode, versions="1,2", persistent_interval=-1)
    assert PersistentLevel(f"{tmp_path}/persistent").committed_versions("job") == []
    ck = deepfreeze.load(cfg(tmp_path), "job")
    assert (ck.version, ck.level) == (2, "scratch")


@pytest.mark.scratch_files("damages a scratch shard")
def test_damaged_scratch_shard_falls_back_to_persistent(tmp_path, engine, mode, caplog):
    run(tmp_path, engine, mode, versions="1,2")
    path = f"{tmp_path}/node0/scratch/job/v000000000002/r000001.dfs"
    with open(path, "r+b") as f:  # flip a byte in the data of the last piece
        f.seek(-50, os.SEEK_END)
        b = f.read(1)
        f.seek(-50, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    ck = deepfreeze.load(cfg(tmp_path), "job")
    assert (ck.version, ck.level) == (2, "persistent")
    assert_bit_exact(ck)
    assert "checksum mismatch" in caplog.text
