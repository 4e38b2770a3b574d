"""Integrity cases of issue 11 on the framework-neutral core: runs, the lease on a name,
generations, fencing, the commit protocol without checksums, clock skew.

Jobs are real processes (tests/workers/crash_job.py: two ranks' engines in one process) or
engines in this process; every check compares with the arrays the writing run recorded."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from deepfreeze.config import Config
from deepfreeze.engine import Engine
from deepfreeze.errors import LeaseHeldError
from deepfreeze.tiers.flush import flush_job
from deepfreeze.tiers.persistent import PersistentLevel, lock_record, read_decision
from deepfreeze.loader import list_versions, load
from deepfreeze.lease import Lease, RunInfo, new_run_id, read_generation, read_lease
from deepfreeze.run import Run
from deepfreeze.shardplan import ShardPlan, TensorSpec

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "workers", "crash_job.py")
sys.path.insert(0, os.path.join(HERE, "..", "workers"))
import crash_job  # noqa: E402


def job(d, phase, check=True, **env):
    p = subprocess.run([sys.executable, JOB, str(d), phase], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **env))
    if check:
        assert p.returncode == 0, p.stderr[-4000:]
    return p


def assert_all_recorded(d, cfg):
    """Every version restorable from any level is, bit-exact, what its run recorded."""
    rec = crash_job.load_records(d)
    vs = sorted(list_versions(cfg, "job"))
    assert vs
    for v in vs:
        ck = load(cfg, "job", v)
        key = (ck.manifest["run"]["id"], v)
        assert key in rec, f"v{v} from {ck.level} belongs to no recorded state"
        for n, a in rec[key].items():
            assert ck.arrays[n].tobytes() == a.tobytes(), f"v{v} ({ck.level}) {n} is a mixture or damaged"
    return vs


# --------------------------------------------------------------------------- case 3: two live jobs

def test_second_job_on_a_live_name_fails_naming_the_holder(tmp_path):
    first = subprocess.Popen([sys.executable, JOB, str(tmp_path), "first", "6"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, JOB_SLEEP="0.5"))
    try:
        deadline = time.monotonic() + 30
        while read_lease(f"{tmp_path}/persistent", "job") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        holder, _ = read_lease(f"{tmp_path}/persistent", "job")
        second = job(tmp_path, "first", check=False)
        assert second.returncode != 0
        assert "LeaseHeldError" in second.stderr and "in use by a live run" in second.stderr
        assert f"pid {first.pid}" in second.stderr and socket.gethostname() in second.stderr
        assert holder["run"] in second.stderr
        out, err = first.communicate(timeout=60)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
    assert assert_all_recorded(tmp_path, crash_job.config(str(tmp_path)))[-1] == 6


# --------------------------------------------------------------------------- case 4: re-run without resume

def test_rerun_without_resume_fails_and_overwrite_starts_a_new_generation(tmp_path):
    job(tmp_path, "first")
    cfg = crash_job.config(str(tmp_path))
    before = load(cfg, "job")
    p = job(tmp_path, "first", check=False)
    assert p.returncode != 0 and "ExistingCheckpointError" in p.stderr
    for way in ("resume=True", "another name", "overwrite=True"):
        assert way in p.stderr
    after = load(cfg, "job")  # the refused run changed nothing
    assert (after.manifest["run"]["id"], after.version) == (before.manifest["run"]["id"], before.version)
    job(tmp_path, "overwrite")
    assert read_generation(cfg.persistent, "job") == 1
    vs = assert_all_recorded(tmp_path, cfg)
    runs = {load(cfg, "job", v).manifest["run"]["id"] for v in vs}
    assert runs == {load(cfg, "job").manifest["run"]["id"]} != {before.manifest["run"]["id"]}
    # the old generation's versions are gone from persistent, not merely hidden
    pers = PersistentLevel(cfg.persistent)
    assert all(pers.read_manifest("job", v)["run"]["generation"] == 1 for v in pers.committed_versions("job"))


def test_run_refuses_resume_with_overwrite(tmp_path):
    with pytest.raises(ValueError, match="contradict"):
        Run(crash_job.config(str(tmp_path)), "job", 0, 1, resume=True, overwrite=True)


# --------------------------------------------------------------------------- the lease

def _fake_lease(pers, name, *, host, pid, run="feedfacefeedface", age=0.0, here=False):
    """A lease of ``host``/``pid``; ``here``: with this process's node id, boot and PID namespace
    (and its start time: a dead ``pid`` is gone whatever the start time)."""
    os.makedirs(os.path.join(pers, name), exist_ok=True)
    path = os.path.join(pers, name, "lease")
    rec = {"run": run, "host": host, "pid": pid, "seq": 0}
    if here:
        from deepfreeze import node
        rec.update(node.process_identity(), node=node.node_id(), pid=pid)
    with open(path + ".fake", "w") as f:  # replaced atomically, as DeepFreeze does (a heartbeat may read it)
        json.dump(rec, f)
    os.replace(path + ".fake", path)
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return path


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    pers = str(tmp_path)
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _fake_lease(pers, "n", host=socket.gethostname(), pid=int(p.stdout), here=True)
    lease = Lease(pers, "n", new_run_id(), timeout=3600)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "deepfreeze"):
        lease.acquire()
    try:
        assert time.monotonic() - t0 < 2 and read_lease(pers, "n")[0]["run"] == lease.run
        assert "which is gone" in caplog.text
    finally:
        lease.release()
    assert read_lease(pers, "n")[0]["released"]  # a tombstone naming the run, taken over at once next time


def test_live_lease_of_another_host_is_refused_then_stale_one_taken(tmp_path):
    pers = str(tmp_path)
    _fake_lease(pers, "n", host="other-node", pid=1)
    with pytest.raises(LeaseHeldError, match="other-node"):
        Lease(pers, "n", new_run_id(), timeout=30).acquire()
    _fake_lease(pers, "n", host="other-node", pid=1, age=120)  # heartbeat 2 minutes old
    lease = Lease(pers, "n", new_run_id(), timeout=30)
    lease.acquire()
    lease.release()


def test_resume_waits_for_a_silent_holder_on_another_host(tmp_path, caplog):
    pers = str(tmp_path)
    _fake_lease(pers, "n", host="other-node", pid=1)
    lease = Lease(pers, "n", new_run_id(), timeout=1.0)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "deepfreeze"):
        lease.acquire(resume=True)
    try:
        assert 0.9 < time.monotonic() - t0 < 10
        assert caplog.text.count("waiting up to") == 1  # said once
    finally:
        lease.release()


def test_lease_wait_lets_a_live_holder_go(tmp_path):
    pers = str(tmp_path)
    holder = Lease(pers, "n", new_run_id(), timeout=30)
    holder.acquire()
    import threading
    threading.Timer(0.5, holder.release).start()
    mine = Lease(pers, "n", new_run_id(), timeout=30)
    mine.acquire(wait=10)
    assert read_lease(pers, "n")[0]["run"] == mine.run
    mine.release()


def test_heartbeat_renews_and_notices_a_takeover(tmp_path):
    pers = str(tmp_path)
    lease = Lease(pers, "n", new_run_id(), timeout=0.3)
    lease.acquire()
    try:
        t0 = read_lease(pers, "n")[1]
        deadline = time.monotonic() + 10  # bounded waits: the heartbeat runs every 0.1 s
        while read_lease(pers, "n")[1] <= t0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_lease(pers, "n")[1] > t0  # the heartbeat touched it
        _fake_lease(pers, "n", host="other-node", pid=1)  # somebody took it over
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lease.lost and "other-node" in lease.lost
    finally:
        lease.release()
    assert read_lease(pers, "n")[0]["host"] == "other-node"  # a lost lease is not removed


# --------------------------------------------------------------------------- fencing

PLAN = ShardPlan.build([TensorSpec(0, "w", "float32", (256,)), TensorSpec(1, "b", "float64", (10,))], 2,
                       min_shard_bytes=64)


def _arrays(seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(256).astype(np.float32), r.standard_normal(10)]


def _pieces(arrays, rank):
    return [arrays[p.tensor_id][p.start:p.stop].copy() for p in PLAN.for_rank(rank)]


def test_flush_of_a_run_without_the_lease_is_abandoned(tmp_path, caplog):
    """A dead run's backend that keeps flushing cannot commit once another run holds the name."""
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      persistent_interval=-1)  # write scratch only, flush by hand below
    old = RunInfo(new_run_id())
    engines = [Engine(cfg, "job", r, PLAN, run=old) for r in (0, 1)]
    for r, e in enumerate(engines):
        e.checkpoint(8, _pieces(_arrays(8), r), step=8, epoch=0)
        e.close()
    new = Lease(cfg.persistent, "job", new_run_id(), timeout=30)
    os.makedirs(os.path.join(cfg.persistent, "job"), exist_ok=True)
    new.acquire()
    try:
        m = json.load(open(os.path.join(cfg.scratch, "job", f"v{8:012d}", "manifest.json")))
        with caplog.at_level(logging.WARNING, "deepfreeze"):
            for r in (0, 1):
                res = flush_job({"name": "job", "version": 8, "rank": r, "scratch": cfg.scratch,
                                 "persistent": cfg.persistent, "persistent_interval": 0, "keep_scratch": 0,
                                 "keep_persistent": 0, "manifest": m, "run": old.id})
                assert res["abandoned"] and not res["committed"]
        assert "abandoned" in caplog.text and new.run in caplog.text
        assert PersistentLevel(cfg.persistent).committed_versions("job") == []
    finally:
        new.release()


def test_versions_of_a_run_must_grow(tmp_path):
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    e = Engine(cfg, "job", 0, ShardPlan.build([TensorSpec(0, "w", "float32", (4,))], 1))
    e.checkpoint(5, [np.zeros(4, np.float32)], step=5, epoch=0)
    with pytest.raises(ValueError, match="must grow"):
        e.checkpoint(5, [np.zeros(4, np.float32)], step=5, epoch=0)
    e.close()


# --------------------------------------------------------------------------- case 2 without checksums

def test_backend_killed_between_model_rename_and_manifest_without_checksums(tmp_path, monkeypatch):
    """kill -9 of the backend after model.dfz.partial -> model.dfz and before the manifest, with
    chksum = false: the re-sent flush finishes that file (never reopens an empty partial) and the
    version commits bit-exact, not with a rank's region zeroed."""
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      chksum=False)
    monkeypatch.setenv("DEEPFREEZE_CRASH_AT", "persistent.manifest.rename:1")
    monkeypatch.setenv("DEEPFREEZE_CRASH_ONCE", str(tmp_path / "crashed"))
    run = RunInfo(new_run_id())
    engines = [Engine(cfg, "job", r, PLAN, run=run) for r in (0, 1)]
    a = _arrays(3)
    for r, e in enumerate(engines):
        e.checkpoint(3, _pieces(a, r), step=3, epoch=0)
    for e in engines:
        e.wait()  # the finalizing backend died; the engines re-send to a new one
        e.close()
    assert (tmp_path / "crashed").exists()
    ck = load(Config.load(None, mode="sync", scratch=str(tmp_path / "none"), persistent=cfg.persistent), "job", 3)
    assert ck.level == "persistent" and not ck.manifest["assembled"]["checksums"]
    assert ck.arrays["w"].tobytes() == a[0].tobytes() and ck.arrays["b"].tobytes() == a[1].tobytes()


# --------------------------------------------------------------------------- case 9: clock skew

def test_future_decision_mtime_is_due_and_warned_once(tmp_path, caplog):
    import deepfreeze.lease as runmod
    monkey = pytest.MonkeyPatch()
    monkey.setattr(runmod, "_skew_warned", False)
    pers = PersistentLevel(str(tmp_path))
    d1 = pers.decide("n", 1, 3600)
    assert d1["decision"] == "flush"
    assert pers.decide("n", 2, 3600)["decision"] == "skip"  # within the interval
    future = time.time() + 86400  # another node's clock, a day ahead
    os.utime(os.path.join(pers.version_dir("n", 1), "decision"), (future, future))
    with caplog.at_level(logging.WARNING, "deepfreeze"):
        assert pers.decide("n", 3, 3600)["decision"] == "flush"  # due, never "skip" for as long as the skew lasts
        t = time.time() + 86400
        os.utime(os.path.join(pers.version_dir("n", 3), "decision"), (t, t))
        assert pers.decide("n", 4, 3600)["decision"] == "flush"
    assert caplog.text.count("in the future") == 1
    assert read_decision(pers.version_dir("n", 4))["run"] == "0" * 16
    monkey.undo()


# --------------------------------------------------------------------------- case 1 on real Horovod ranks

@pytest.mark.scratch_files("rank 1 is killed inside its scratch shard write")
def test_crash_then_resume_with_shuffling_never_mixes_two_runs(tmp_path):
    """Rank 1 is killed while writing v6 (rank 0's v6 written and being flushed); the relaunched
    job resumes with shuffle=True. Every version any level returns is, bit-exact, the weights the
    run that wrote it recorded at that step: never BN statistics of one run and kernels of the
    other."""
    from _util import mpirun
    from deepfreeze.keras.state_loader import model_tensors  # noqa: F401  (TensorFlow present)
    worker = os.path.join(HERE, "..", "workers", "crash_resume.py")
    first = mpirun(2, worker, str(tmp_path), "first", "kill_at=6", check=False, timeout=300)
    assert first.returncode != 0  # rank 1 died
    second = mpirun(2, worker, str(tmp_path), "resume", timeout=300)
    assert "resumed_from=4" in second.stdout, second.stdout[-2000:]
    expected = {}
    for n in os.listdir(tmp_path / "expected"):
        run, v = n[:-4].rsplit("-v", 1)
        with np.load(tmp_path / "expected" / n) as z:
            expected[(run, int(v))] = [z[k] for k in sorted(z.files, key=lambda k: int(k.split("_")[1]))]
    runs = {r for r, _ in expected}
    assert len(runs) == 2
    checked = 0
    for node in (0, 1):
        for scratch in (f"{tmp_path}/node{node}/scratch", f"{tmp_path}/none"):
            cfg = Config.load(None, mode="async", scratch=scratch, persistent=f"{tmp_path}/persistent")
            for v in sorted(list_versions(cfg, "r")):
                ck = load(cfg, "r", v)
                key = (ck.manifest["run"]["id"], v)
                assert key in expected, f"v{v} ({ck.level}) is of no run that recorded it"
                got = list(ck.model_arrays().values())
                assert len(got) == len(expected[key])
                for a, b in zip(got, expected[key]):
                    assert a.tobytes() == b.tobytes(), f"v{v} ({ck.level}) is a mixture of two runs"
                checked += 1
    assert checked >= 4
    resumed = load(Config.load(None, mode="async", scratch=f"{tmp_path}/none",
                               persistent=f"{tmp_path}/persistent"), "r", 6)
    assert resumed.manifest["run"]["resumed_from"] == 4  # v6 on persistent is the second run's


def test_gc_never_touches_a_flush_of_the_live_run(tmp_path):
    """An uncommitted version older than the newest commit is gc's to remove, unless it is a flush
    of the run that holds a live lease on the name (it may still be in progress)."""
    from deepfreeze.inventory import plan_gc
    job(tmp_path, "first")
    cfg = crash_job.config(str(tmp_path))
    pers = PersistentLevel(cfg.persistent)
    lease = Lease(cfg.persistent, "job", new_run_id(), timeout=30)
    lease.acquire()
    try:
        for run, v in ((lease.run, 1), ("feedfacefeedface", 2)):  # v1 of the live run, v2 of a dead one
            vdir = pers.version_dir("job", v)
            pers._clear(vdir, keep=())  # retention removed it; now a leftover flush in progress
            os.makedirs(vdir)
            with open(os.path.join(vdir, "decision"), "w") as f:
                json.dump({"decision": "flush", "nonce": "0123456789abcdef", "run": run}, f)
            open(os.path.join(vdir, "model.dfz.partial.0123456789abcdef"), "wb").close()
        removals, _ = plan_gc(cfg, "job")
        gone = {r.version for r in removals if r.level == "persistent"}
        assert 2 in gone and 1 not in gone
    finally:
        lease.release()
    removals, _ = plan_gc(cfg, "job")  # the lease released: v1 is a leftover like any other
    assert 1 in {r.version for r in removals if r.level == "persistent"}


def test_commit_lock_of_a_live_holder_is_never_broken_and_release_keeps_a_foreign_lock(tmp_path):
    """A commit.lock held by a live process of this host is not broken however old it is; a holder
    releases only its own lock (its token), never one another process took after breaking it."""
    pers = PersistentLevel(str(tmp_path))
    vdir = pers.version_dir("n", 1)
    os.makedirs(vdir)
    lock = os.path.join(vdir, "commit.lock")
    with open(lock, "w") as f:
        f.write(lock_record("feedfacefeedface").decode())
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pers.locked(vdir, wait=0.2, stale_after=1.0) as taken:
        assert not taken  # alive here: never broken
    os.unlink(lock)
    with pers.locked(vdir, wait=0.2, stale_after=1.0) as taken:
        assert taken
        with open(lock, "w") as f:  # as if broken and retaken by another process meanwhile
            f.write("otherhost 1 0123456789abcdef")
    with open(lock) as f:
        assert f.read().startswith("otherhost")  # not removed by the first holder's release


def test_a_run_that_lost_the_lease_is_fenced_even_after_the_new_run_released_it(tmp_path):
    """Run A lost the name to run B; B finished and released it (a tombstone): A's backend, waking
    up, still cannot decide or commit a version."""
    from deepfreeze.lease import fence_holder
    pers = str(tmp_path)
    a, b = Lease(pers, "n", new_run_id(), timeout=30), Lease(pers, "n", new_run_id(), timeout=30)
    a.acquire()
    a._stop.set()  # A's heartbeat stops (a hung node)
    _fake = read_lease(pers, "n")[0]
    b._take_over(_fake)  # B takes the stale lease over and holds it
    assert b._create()
    b.release()
    assert read_lease(pers, "n")[0]["released"] and read_lease(pers, "n")[0]["run"] == b.run
    assert fence_holder(pers, "n", a.run)["run"] == b.run  # A stays fenced
    assert fence_holder(pers, "n", b.run) is None
    with pytest.raises(Exception, match="abandoned"):
        PersistentLevel(pers).decide("n", 8, 0, a.run)


def test_takeover_puts_back_a_lease_that_is_not_the_stale_one(tmp_path):
    """Two takers judged the same lease stale; the second must not remove the lease the first
    just created: it puts back what it moved aside."""
    pers = str(tmp_path)
    judged = json.loads(json.dumps({"run": "feedfacefeedface", "host": "other-node", "pid": 1, "seq": 0}))
    first = Lease(pers, "n", new_run_id(), timeout=30)
    os.makedirs(os.path.join(pers, "n"))
    assert first._create()  # the first taker already replaced the stale lease
    second = Lease(pers, "n", new_run_id(), timeout=30)
    second._take_over(judged)
    assert read_lease(pers, "n")[0]["run"] == first.run
