"""The shared suite: every engine mode (and later every engine) must pass it."""
import errno
import os
import time

import numpy as np
import pytest

import deepfreeze
from deepfreeze import Config
from deepfreeze.backend import BackendClient, socket_path
from deepfreeze.engine import Engine
from deepfreeze.errors import (CheckpointNotFoundError, CheckpointWriteError, ConfigError,
                               CorruptCheckpointError)
from deepfreeze.tiers.persistent import PersistentLevel, lock_record
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load
from deepfreeze.shardplan import ShardPlan, TensorSpec

RNG = np.random.default_rng(11)


def model_arrays(seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal((64, 50)).astype(np.float32), r.standard_normal(50).astype(np.float32),
            r.integers(0, 100, (3, 3), dtype=np.int32), r.standard_normal((5000,))]


def make_plan(world):
    ts = [TensorSpec(i, f"layer{i}/w", a.dtype.name, a.shape) for i, a in enumerate(model_arrays(0))]
    return ShardPlan.build(ts, world, min_shard_bytes=1024)


def pieces(arrays, plan, rank):
    return [arrays[p.tensor_id].reshape(-1)[p.start:p.stop].copy() for p in plan.for_rank(rank)]


def run_job(tmp_path, mode, world=3, versions=(2, 4, 6), nodes=None, engine_kw=None, **cfg):
    """``world`` ranks in this process; rank r on node r % nodes (own scratch). Returns configs."""
    nodes = nodes or world
    plan = make_plan(world)
    cfgs = [Config.load(None, mode=mode, scratch=str(tmp_path / f"node{r % nodes}"),
                        persistent=str(tmp_path / "pfs"), failure_domain=f"node{r % nodes}", **cfg)
            for r in range(world)]
    engines = [Engine(cfgs[r], "job", r, plan, **(engine_kw or {})) for r in range(world)]
    for v in versions:
        arrays = model_arrays(v)
        for r, e in enumerate(engines):
            e.checkpoint(v, pieces(arrays, plan, r), step=v, epoch=0)
    for e in engines:
        e.close()
    return cfgs


def assert_version(cfg, version, level=None):
    ck = load(cfg, "job", version)
    assert ck.version == version and ck.step == version
    if level:
        assert ck.level == level
    for a, b in zip(ck.arrays.values(), model_arrays(version)):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return ck


@pytest.fixture(params=["sync", "async"])
def mode(request):
    return request.param


def test_every_version_assembled_bit_exact(tmp_path, mode):
    cfgs = run_job(tmp_path, mode)
    assert deepfreeze.list_versions(cfgs[0], "job") == {2: ["persistent"], 4: ["persistent"], 6: ["persistent"]}
    for v in (2, 4, 6):
        assert_version(cfgs[0], v, "persistent")
    pv = PersistentLevel(cfgs[0].persistent).version_dir("job", 6)
    assert sorted(os.listdir(pv)) == ["decision", "manifest.json", "model.dfz"]  # no leftovers


@pytest.mark.scratch_files("restores from scratch")
def test_single_node_restores_from_scratch(tmp_path, mode):
    cfgs = run_job(tmp_path, mode, world=2, nodes=1)
    assert deepfreeze.list_versions(cfgs[0], "job")[6] == ["scratch", "persistent"]
    assert_version(cfgs[0], 6, "scratch")


@pytest.mark.scratch_files("retention of scratch versions")
def test_retention_on_both_levels(tmp_path, mode):
    cfgs = run_job(tmp_path, mode, world=2, nodes=1, versions=(1, 2, 3, 4, 5), max_versions=3, scratch_versions=2)
    assert ScratchLevel(cfgs[0].scratch).versions("job") == [4, 5]
    assert PersistentLevel(cfgs[0].persistent).committed_versions("job") == [3, 4, 5]
    assert_version(cfgs[0], 3, "persistent")


def test_persistent_interval(tmp_path, mode):
    cfgs = run_job(tmp_path, mode, world=2, nodes=2, versions=(1, 2, 3), persistent_interval=3600)
    assert PersistentLevel(cfgs[0].persistent).committed_versions("job") == [1]  # first one only
    cfgs = run_job(tmp_path / "never", mode, world=2, nodes=1, versions=(1, 2), persistent_interval=-1)
    assert PersistentLevel(cfgs[0].persistent).committed_versions("job") == []
    assert_version(cfgs[0], 2, "scratch")


def test_skipped_versions_are_swept_at_the_next_commit(tmp_path, mode):
    plan = make_plan(2)
    cfg = Config.load(None, mode=mode, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      persistent_interval=2.0)
    engines = [Engine(cfg, "job", r, plan) for r in range(2)]
    for v in (1, 2, 3):
        if v == 3:
            time.sleep(2.2)
        for r, e in enumerate(engines):
            e.checkpoint(v, pieces(model_arrays(v), plan, r), step=v, epoch=0)
        for e in engines:
            e.wait()
    for e in engines:
        e.close()
    pfs = PersistentLevel(cfg.persistent)
    assert pfs.committed_versions("job") == [1, 3]
    assert pfs.versions("job") == [1, 3]  # v2 was decided "skip" and swept
    assert_version(cfg, 2, "scratch")


def test_backpressure_bounds_pending_flushes(tmp_path):
    plan = make_plan(1)
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    e = Engine(cfg, "job", 0, plan, max_pending_flushes=1)
    peak = 0
    for v in range(1, 30):
        e.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        e._drain()
        peak = max(peak, len(e._pending))
    e.close()
    assert peak <= 1
    assert PersistentLevel(cfg.persistent).committed_versions("job") == list(range(1, 30))


class GatedScratch(ScratchLevel):
    """A scratch level whose shard writes wait until the test opens the gate."""
    gate = None  # threading.Event, set by the test
    started = None  # threading.Semaphore, released when a write begins

    def write_shard(self, *args, **kwargs):
        type(self).started.release()
        assert type(self).gate.wait(60), "gate never opened"
        return super().write_shard(*args, **kwargs)


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
@pytest.mark.scratch_files("the queue is held by a gated scratch write (scratch_cls)")
def test_write_queue_holds_max_inflight_versions(tmp_path, max_inflight):
    """A checkpoint only waits once ``max_inflight`` versions are handed off and not on scratch."""
    import threading
    GatedScratch.gate, GatedScratch.started = threading.Event(), threading.Semaphore(0)
    plan = make_plan(1)
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      max_inflight=max_inflight)
    e = Engine(cfg, "job", 0, plan, scratch_cls=GatedScratch)
    try:
        for v in range(1, max_inflight + 1):  # these return while the writer is stuck in v1
            e.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        assert GatedScratch.started.acquire(timeout=30)
        assert len(e._inflight) == max_inflight
        blocked = threading.Thread(target=e.checkpoint, args=(max_inflight + 1, pieces(
            model_arrays(max_inflight + 1), plan, 0)), kwargs={"step": max_inflight + 1, "epoch": 0})
        blocked.start()
        blocked.join(0.5)
        assert blocked.is_alive(), "a checkpoint beyond max_inflight must wait"
        GatedScratch.gate.set()
        blocked.join(30)
        assert not blocked.is_alive()
    finally:
        GatedScratch.gate.set()
        e.close()
    n = max_inflight + 1
    assert PersistentLevel(cfg.persistent).committed_versions("job") == list(range(1, n + 1))
    for v in range(1, n + 1):  # every queued version committed with its own data, none mixed up
        assert_version(cfg, v)


def test_max_inflight_must_be_positive():
    with pytest.raises(ConfigError, match="max_inflight = 0 must be >= 1"):
        Config.load(None, mode="async", scratch="/tmp/a", persistent="/tmp/b", max_inflight=0)


def test_config_object_with_overrides():
    base = Config.load(None, mode="sync", scratch="/tmp/a", persistent="/tmp/b")
    c = Config.resolve(base, max_versions="4", chksum="false")
    assert (c.max_versions, c.chksum, c.scratch) == (4, False, "/tmp/a")
    with pytest.raises(ConfigError, match="unknown key"):
        Config.resolve(base, scrach="/x")


@pytest.mark.scratch_files("damages a scratch shard")
def test_damaged_scratch_falls_back_to_persistent(tmp_path, mode, caplog):
    cfgs = run_job(tmp_path, mode, world=2, nodes=1)
    shard = ScratchLevel(cfgs[0].scratch).shard_path("job", 6, 1)
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    assert_version(cfgs[0], 6, "persistent")
    assert "unreadable" in caplog.text


@pytest.mark.scratch_files("damages v6 on both levels, a scratch shard first")
def test_newest_readable_version_wins_never_partial(tmp_path, mode):
    cfgs = run_job(tmp_path, mode, world=2, nodes=1)
    # v6 damaged on both levels: the newest readable version is v4
    os.truncate(ScratchLevel(cfgs[0].scratch).shard_path("job", 6, 0), 100)
    p = os.path.join(PersistentLevel(cfgs[0].persistent).version_dir("job", 6), "model.dfz")
    os.truncate(p, os.path.getsize(p) - 8)
    assert load(cfgs[0], "job").version == 4
    with pytest.raises(CorruptCheckpointError):
        load(cfgs[0], "job", 6)


def test_one_tensor_read_alone(tmp_path, mode):
    cfgs = run_job(tmp_path, mode, world=2, nodes=1)
    for level_cfg in (cfgs[0], Config.resolve(cfgs[0], scratch=str(tmp_path / "elsewhere"))):  # scratch, persistent
        ck = load(level_cfg, "job", 6, tensors=["layer3/w"])
        assert list(ck.arrays) == ["layer3/w"]
        assert ck.arrays["layer3/w"].tobytes() == model_arrays(6)[3].tobytes()
    with pytest.raises(CheckpointNotFoundError, match="no tensor named 'nope'"):
        load(cfgs[0], "job", 6, tensors=["nope"])


def test_not_found_and_bad_names(tmp_path, mode):
    cfg = Config.load(None, mode=mode, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    with pytest.raises(CheckpointNotFoundError) as e:
        load(cfg, "nothing")
    assert isinstance(e.value, FileNotFoundError)
    for bad in ("../etc", "a/b", "..", "", "x y"):
        with pytest.raises(ConfigError):
            load(cfg, bad)
    cfgs = run_job(tmp_path, mode, world=1)
    with pytest.raises(CheckpointNotFoundError, match="committed versions: \\[2, 4, 6\\]"):
        load(cfgs[0], "job", 5)


class FullScratch(ScratchLevel):
    """Fault injection: the node-local disk fills up at the second version."""

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        if version >= 4:
            raise CheckpointWriteError(errno.ENOSPC, "No space left on device (injected)")
        return super().write_shard(name, version, rank, plan, arrays, **kw)


@pytest.mark.scratch_files("the full disk is injected in the scratch write (scratch_cls)")
def test_write_error_surfaces_once_and_nothing_partial(tmp_path, mode):
    plan = make_plan(2)
    cfg = Config.load(None, mode=mode, scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    engines = [Engine(cfg, "job", r, plan, scratch_cls=FullScratch) for r in range(2)]
    for r, e in enumerate(engines):
        e.checkpoint(2, pieces(model_arrays(2), plan, r), step=2, epoch=0)
    for r, e in enumerate(engines):
        if mode == "sync":  # blocking: the error is the call's own
            with pytest.raises(CheckpointWriteError, match="No space left"):
                e.checkpoint(4, pieces(model_arrays(4), plan, r), step=4, epoch=0)
        else:  # background: it surfaces at the next call (here wait), once
            e.checkpoint(4, pieces(model_arrays(4), plan, r), step=4, epoch=0)
            with pytest.raises(CheckpointWriteError, match="No space left"):
                e.wait()
        e.wait()
        e.close()
    assert deepfreeze.list_versions(cfg, "job") == {2: ["scratch", "persistent"]}


def test_backend_shared_per_node_and_stops_when_idle(tmp_path):
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    plan = make_plan(2)
    a, b = Engine(cfg, "job", 0, plan), Engine(cfg, "job", 1, plan)
    assert a._backend.pid == b._backend.pid != os.getpid()
    path = socket_path(cfg.scratch)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    pid = a._backend.pid
    a.close()
    b.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not os.path.exists(path)
    c = BackendClient(cfg.scratch)  # a new one starts on demand
    assert c.pid != pid
    c.close()


def test_spawned_backend_has_one_openblas_thread_and_the_ranks_environment(tmp_path, monkeypatch):
    """The backend a client spawns keeps the rank's environment but starts numpy's OpenBLAS with one
    thread (it multiplies no matrices; one thread per core costs each start CPU), whatever the rank set."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    monkeypatch.setenv("DEEPFREEZE_TEST_MARK", "from-the-rank")
    c = BackendClient(str(tmp_path / "s"))
    try:
        assert c.started == c.pid is not None  # spawned by this client
        with open(f"/proc/{c.pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env[b"OPENBLAS_NUM_THREADS"] == b"1"
        assert env[b"DEEPFREEZE_TEST_MARK"] == b"from-the-rank"
    finally:
        c.close()


def test_backend_killed_mid_job_is_restarted_and_flushes_are_resent(tmp_path):
    """kill -9 of the backend: the next exchange starts a new one and re-sends what was pending;
    persistent never holds a version that looks committed but is not."""
    import signal
    plan = make_plan(2)
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    engines = [Engine(cfg, "job", r, plan) for r in range(2)]
    engines[0].checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)  # only rank 0: v2 cannot commit
    engines[0]._drain()
    old = engines[0]._backend.pid
    os.kill(old, signal.SIGKILL)
    engines[1].checkpoint(2, pieces(model_arrays(2), plan, 1), step=2, epoch=0)  # hits the dead backend
    for e in engines:
        e.checkpoint(4, pieces(model_arrays(4), plan, e.rank), step=4, epoch=0)
    for e in engines:
        e.close()
    assert engines[0]._backend is None
    pfs = PersistentLevel(cfg.persistent)
    assert pfs.committed_versions("job") == [2, 4]
    for v in (2, 4):
        assert_version(Config.resolve(cfg, scratch=str(tmp_path / "elsewhere")), v, "persistent")


def test_stale_commit_lock_of_dead_process_is_broken(tmp_path):
    import subprocess
    import sys
    plan = make_plan(1)
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    pfs = PersistentLevel(cfg.persistent)
    vdir = pfs.version_dir("job", 2)
    os.makedirs(vdir)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with open(os.path.join(vdir, "commit.lock"), "w") as f:
        f.write(lock_record("0123456789abcdef").decode().replace(f" {os.getpid()} ", f" {int(dead.stdout)} "))
    e = Engine(cfg, "job", 0, plan)
    e.checkpoint(2, pieces(model_arrays(2), plan, 0), step=2, epoch=0)
    e.close()
    assert pfs.committed_versions("job") == [2]
    assert not os.path.exists(os.path.join(vdir, "commit.lock"))


@pytest.mark.scratch_files("waits for the scratch write alone, then for the flush (written once, both are one write)")
def test_wait_with_timeout_is_bounded_and_resumable(tmp_path):
    """A flush that takes longer than the timeout: wait(timeout) raises a clear error, the flush
    goes on, and a later wait() finds it committed."""
    big = np.random.default_rng(1).standard_normal(30_000_000)  # 240 MB: copy + fsync take a while
    plan = ShardPlan.build([TensorSpec(0, "big", "float64", big.shape)], 1)
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    e = Engine(cfg, "job", 0, plan)
    e.checkpoint(1, [big], step=1, epoch=0)
    with pytest.raises(CheckpointWriteError, match="did not finish within 0.0001s"):
        e.wait(timeout=0.0001)  # still writing the shard to scratch
    e.wait(persistent=False)
    t0 = time.monotonic()
    with pytest.raises(deepfreeze.BackendError, match="not finished within 0.001s"):
        e.wait(timeout=0.001)
    assert time.monotonic() - t0 < 30
    e.wait()
    e.close()
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [1]


def test_watchdog_reports_a_rank_that_stopped_checkpointing(tmp_path):
    """watchdog_interval (VeloC semantics): the backend logs, once, a client that has sent no
    checkpoint for longer than the interval, and `status` lists it; a live one is not reported."""
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      watchdog_interval=1)
    plan = make_plan(1)
    e = Engine(cfg, "job", 0, plan)
    e.checkpoint(1, pieces(model_arrays(1), plan, 0), step=1, epoch=0)
    e.wait()
    assert e._backend.request({"op": "status"})["overdue"] == []
    time.sleep(2.2)  # the "hung" rank: connected, silent
    overdue = e._backend.request({"op": "status"})["overdue"]
    assert len(overdue) == 1 and "rank 0 of 'job' sent no checkpoint" in overdue[0]
    e.close()
    with open(os.path.join(cfg.scratch, ".deepfreeze-backend.log")) as f:
        assert "watchdog: rank 0 of 'job'" in f.read()


def test_a_connections_jobs_send_the_manifest_once(tmp_path):
    """In async mode the backend gets a run's tensor list and plan with the first flush job of its
    connection only: later jobs name the unchanged entries (``manifest_same``, backend protocol 3)
    and the backend rebuilds them; every version commits a manifest equal to the engine's own and
    restores bit-exact."""
    from deepfreeze.tiers.base import plan_of
    sent = []

    class Recording(BackendClient):
        def request(self, obj, timeout=None, *, check=True):
            if obj.get("op") == "flush":
                sent.append((sorted(obj["job"].get("manifest_same", [])), "tensors" in obj["job"]["manifest"]))
            return super().request(obj, timeout, check=check)
    plan = make_plan(1)
    cfg = Config.load(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    e = Engine(cfg, "job", 0, plan)
    e._backend.__class__ = Recording  # the engine's own connection, recording what it sends
    for v in (1, 2, 3):
        e.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        e.wait()
    e.close()
    assert [s[1] for s in sent] == [True, False, False], sent
    assert all("tensors" in same and "plan" in same and "version" not in same for same, _ in sent[1:]), sent
    level = PersistentLevel(cfg.persistent)
    assert level.committed_versions("job") == [1, 2, 3]
    for v in (1, 2, 3):
        m = level.read_manifest("job", v)
        assert m["version"] == v and m["step"] == v and plan_of(m) == plan
        ck = load(cfg, "job", v)
        for a, b in zip(ck.arrays.values(), model_arrays(v)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
