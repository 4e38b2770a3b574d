"""Real multi-rank Horovod jobs (mpirun --oversubscribe), two or three simulated nodes."""
import json
import os
import shutil

import numpy as np
import pytest

from deepfreeze import Config
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load

from _util import WORKERS, mpirun

# the first test of the module waits for all the module's jobs (:func:`jobs`): about 2 minutes
# alone, several times that beside other work
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(1500)]
TRAIN, RESTORE = f"{WORKERS}/train.py", f"{WORKERS}/restore.py"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, module_runtime_dir):
    """The module's Horovod jobs (all but VeloC's), each run once, each test reading its own job's
    directory: one TensorFlow and Horovod start-up per process serves several jobs (about 8 CPU-s
    a rank). ``retention`` (2 ranks, write_once = off as its test's scratch_files mark says),
    ``sync3`` (3 ranks), ``xor`` then ``sinks`` (one 2-rank run: tests/workers/train.py runs
    ``+``-separated jobs one after the other); then node 1 of ``xor`` is lost (its scratch removed)
    and the restores run, each a new job: at 2 ranks ``retention`` (its oldest committed version),
    ``sync3`` (v12) and ``xor`` (newest) one after another, at 3 ranks ``retention``
    (tests/workers/restore.py: each target's lines in OUT/restore-np<N>-r<rank>.txt). A job that
    fails fails its own tests (:func:`ran`), not the others'."""
    root = tmp_path_factory.mktemp("mpi")
    d = {k: str(root / k) for k in ("retention", "sync3", "xor", "sinks")}
    ps = {}
    ps["retention"] = mpirun(2, TRAIN, d["retention"], "async", "every=3", "max_versions=3", "scratch_versions=2",
                             env={"VELOC_WRITE_ONCE": "off"}, check=False)
    ps["sync3"] = mpirun(3, TRAIN, d["sync3"], "sync", "every=4", "epochs=1", "samples=192", "min_shard_bytes=0",
                         check=False)
    ps["xor"] = ps["sinks"] = mpirun(
        2, TRAIN, d["xor"], "async", "every=5", "epochs=1", "scratch_versions=2", "ec_interval=0",
        "persistent_interval=-1", "+", d["sinks"], "async", "every=3", "epochs=1", "second=other", "every2=4",
        timeout=600, check=False)
    if ps["xor"].returncode == 0:
        shutil.rmtree(f"{d['xor']}/node1")  # node 1 is lost
    oldest = PersistentLevel(f"{d['retention']}/persistent").committed_versions("job")[:1]
    targets = {2: [(d["retention"], str(v)) for v in oldest if ps["retention"].returncode == 0], 3: []}
    targets[3] = list(targets[2])
    if ps["sync3"].returncode == 0:
        targets[2].append((d["sync3"], "12"))
    if ps["xor"].returncode == 0:
        targets[2].append((d["xor"], "newest"))
    for n, ts in targets.items():
        args = [a for i, (out, v) in enumerate(ts) for a in ([] if i == 0 else ["+"]) + [out, v]]
        if args:
            ps[f"restore{n}"] = mpirun(n, RESTORE, *args, timeout=600, check=False)
    return d, ps


def ran(jobs, key):
    """The directory of job ``key`` of :func:`jobs`; fails the test with the job's output if it failed."""
    d, ps = jobs
    p = ps[key]
    if p.returncode != 0:
        pytest.fail(f"{' '.join(p.args)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                    f"stderr:\n{p.stderr[-6000:]}")
    return d[key]


def restored(jobs, out, n):
    """What the ranks of the n-rank restore job printed for the checkpoint of ``out`` (its lines)."""
    d, ps = jobs
    p = ps.get(f"restore{n}")
    assert p is not None, f"no {n}-rank restore ran"
    texts = [open(f"{out}/restore-np{n}-r{r}.txt").read() for r in range(n)
             if os.path.exists(f"{out}/restore-np{n}-r{r}.txt")]
    return "".join(texts) + ("" if p.returncode == 0 else f"[restore job exited {p.returncode}]\n{p.stderr[-4000:]}")


def expected(out, v):
    with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def node_cfg(out, node):
    return Config.load(None, mode="async", scratch=f"{out}/node{node}/scratch", persistent=f"{out}/persistent")


def check_job(out, world, versions_expected):
    infos = [json.load(open(f"{out}/rank{r}.json")) for r in range(world)]
    assert all(i["optimizer_class"] == "SGD" for i in infos)  # Horovod's class keeps the name
    taken = infos[0]["versions"]
    assert all(i["versions"] == taken for i in infos)
    committed = PersistentLevel(f"{out}/persistent").committed_versions("job")
    assert committed == versions_expected(taken)
    for v in committed:  # every committed version equals what the ranks had after that batch
        ck = load(node_cfg(out, 0), "job", v)
        assert ck.level == "persistent" and ck.manifest["world_size"] == world
        got = [a.tobytes() for a in ck.model_arrays().values()]
        assert got == [e.tobytes() for e in expected(out, v)], f"version {v} differs"
    # each node's scratch holds exactly its own rank's shard of the retained versions
    for r in range(world):
        s = ScratchLevel(f"{out}/node{r}/scratch")
        for v in s.versions("job"):
            assert sorted(os.listdir(s.version_dir("job", v))) == ["manifest.json", f"r{r:06d}.dfs"]
    return taken, committed


@pytest.mark.scratch_files("retention of scratch versions on each node")
def test_two_ranks_async_retention_and_restore_at_1_2_3(jobs):
    out = ran(jobs, "retention")
    taken, committed = check_job(out, 2, lambda t: t[-3:])
    assert taken == [3, 6, 9, 12, 15, 16, 18, 21, 24, 27, 30, 32]  # 16 steps per epoch, + epoch ends
    for r in range(2):
        assert ScratchLevel(f"{out}/node{r}/scratch").versions("job") == taken[-2:]
    # restore at 1 rank (this process, no MPI), then at 2 and 3 ranks
    assert load(node_cfg(out, 0), "job").version == 32
    for n in (2, 3):  # the n-rank restore job of the module's checkpoints restored committed[0] of this one
        stdout = restored(jobs, out, n)
        assert stdout.count("bitexact=True") == n, stdout


def test_three_ranks_sync_every_version_bit_exact(jobs):
    out = ran(jobs, "sync3")
    taken, committed = check_job(out, 3, lambda t: t)
    assert taken == [4, 8, 12]  # 12 steps
    m = load(node_cfg(out, 0), "job").manifest
    assert [s["domain"] for s in m["shards"]] == ["node0", "node1", "node2"]
    ranks_per_tensor = {}
    from deepfreeze.tiers.base import plan_of
    for tid, rank, start, stop in ((p.tensor_id, p.rank, p.start, p.stop) for p in plan_of(m).pieces):
        ranks_per_tensor.setdefault(tid, set()).add(rank)
    names = [t["name"] for t in m["tensors"]]
    for tid, ranks in ranks_per_tensor.items():
        if "moving_" in names[tid] or names[tid] == "optimizer/iteration":  # not updated in the graph:
            # whole, from rank 0
            assert ranks == {0}
        else:  # min_shard_bytes=0: every trainable tensor and its optimizer slot split over 3 ranks
            assert ranks == {0, 1, 2}
    stdout = restored(jobs, out, 2)  # the 2-rank restore job restored v12 of this checkpoint
    assert stdout.count("bitexact=True") == 2


def test_horovod_job_with_xor_protection_survives_a_lost_node(jobs):
    """ec_interval = 0, persistent off: the writer threads exchange over MPI while Horovod trains;
    node 1's scratch is wiped and the restarted 2-rank job restores the newest version from
    node 0's shards and node 0's parity block (groups of 2: a copy of rank 1's shard). The job,
    the wipe and the restore are the module's (:func:`jobs`): node 0's files are the same after it."""
    out = ran(jobs, "xor")
    assert PersistentLevel(f"{out}/persistent").committed_versions("job") == []
    m = ScratchLevel(f"{out}/node0/scratch").read_manifest("job", 16)
    assert m["redundancy"] == {"scheme": "xor", "groups": [[0, 1]], "unprotected": []}
    assert sorted(os.listdir(f"{out}/node0/scratch/job/v000000000016")) == [
        "manifest.json", "r000000.dfs", "x000000.dfx"]
    stdout = restored(jobs, out, 2)
    assert stdout.count("v16 step 16 bitexact=True") == 2, stdout


@pytest.mark.xdist_group("veloc")  # the one VeloC daemon of a user on this machine
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_horovod_job_on_real_veloc(tmp_path, mode, write_once):
    """engine="veloc": the same callback and hook; VeloC writes scratch and flushes, DeepFreeze
    assembles; every committed version equals the weights after that batch. write_once (the
    fixture: auto and off) is the built-in engine's: VeloC writes its scratch file either way."""
    from deepfreeze.bindings.veloc import available
    why = available()
    if why:
        pytest.skip(f"VeloC not found: {why}")
    from deepfreeze.veloc_daemon import stop_backend
    stop_backend()
    out = str(tmp_path)
    try:
        mpirun(2, f"{WORKERS}/train.py", out, mode, "engine=veloc", "every=5", "epochs=1", "max_versions=2")
    finally:
        stop_backend()
    committed = PersistentLevel(f"{out}/persistent").committed_versions("job")
    assert committed == [15, 16]
    for v in committed:
        ck = load(node_cfg(out, 0), "job", v)
        assert [a.tobytes() for a in ck.model_arrays().values()] == [e.tobytes() for e in expected(out, v)]
    assert os.path.exists(f"{out}/node0/scratch/job-1-16.dat")  # VeloC's own scratch file


def test_two_checkpoint_sinks_in_one_horovod_fit_each_bit_exact(jobs):
    """Two callbacks on the one hook (native and graph capture, other names and schedules) in a
    2-rank Horovod job: every committed version of each equals the weights after its step."""
    out = ran(jobs, "sinks")
    check_job(out, 2, lambda taken: taken)
    taken = [json.load(open(f"{out}/second{r}.json"))["versions"] for r in range(2)]
    assert taken[0] == taken[1] and taken[0] == [4, 8, 12, 16]
    assert PersistentLevel(f"{out}/persistent").committed_versions("other") == taken[0]
    for v in taken[0]:
        got = [a.tobytes() for a in load(node_cfg(out, 0), "other", v).model_arrays().values()]
        with np.load(f"{out}/expected2/v{v}.npz", allow_pickle=False) as z:
            assert got == [z[f"arr_{i}"].tobytes() for i in range(len(z.files))], f"other v{v} differs"
