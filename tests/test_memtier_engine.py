"""The memory tier in the checkpoint engine and the node backend (issue 16, points 3-5).

Real parts only: a real device under /dev/shm, the real backend process (it reads this process's
memory with process_vm_readv), real files on persistent, real processes killed with SIGKILL.
What the tier holds is read from the device directly (region slots -> format.py images)."""
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from _util import memtier_device, WORKERS, mpirun
from deepfreeze import Config
from deepfreeze.node import process_state
from deepfreeze import format as fmt
from deepfreeze.engine import Engine
from deepfreeze.run import make_engine
from deepfreeze.errors import ConfigError, MemtierCorruptError, MemtierFullError
from deepfreeze.fused import FusedLayout, FusedShard
from deepfreeze.tiers.base import plan_of
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.memtier import device as mdev
from deepfreeze.memtier.device import SlotState
from deepfreeze.loader import load
from deepfreeze.shardplan import ShardPlan, TensorSpec

sys.path.insert(0, WORKERS)
import memtier_numpy  # noqa: E402


def model_arrays(seed, big=False):
    r = np.random.default_rng(seed)
    out = [r.standard_normal((64, 50)).astype(np.float32), r.standard_normal(50).astype(np.float32),
           r.integers(0, 100, (3, 3), dtype=np.int32), r.standard_normal((5000,))]
    if big:
        out.append(r.standard_normal(1_500_000))  # 12 MB: three copy chunks
    return out


def make_plan(world, big=False):
    ts = [TensorSpec(i, f"layer{i}/w", a.dtype.name, a.shape) for i, a in enumerate(model_arrays(0, big))]
    return ShardPlan.build(ts, world, min_shard_bytes=1024)


def pieces(arrays, plan, rank):
    return [arrays[p.tensor_id].reshape(-1)[p.start:p.stop].copy() for p in plan.for_rank(rank)]


def expected_pieces(arrays, plan, rank):
    return {(p.tensor_id, p.start): a.tobytes() for p, a in zip(plan.for_rank(rank), pieces(arrays, plan, rank))}


@pytest.fixture
def device():
    with memtier_device("h2", "96M") as path:
        yield path


def config(tmp_path, device, mode="async", **kw):
    return Config.load(None, mode=mode, scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "pfs"),
                       memtier=device, **kw)


def tier(path, name):
    """{version: {rank: {(tensor_id, start): bytes}}} of every DONE slot (images verified), and
    {rank: [slot state or None (invalid header), ...]}."""
    out, states = {}, {}
    with mdev.open(path, writable=False) as dev:
        for r in dev.find(name):
            states[r.rank] = [None if h is None else (h.state, h.version.step)
                              for h in (r.slot_header(k) for k in range(r.nslots))]
            for k, h in r.restorable():
                try:
                    img = r.read_image(k)  # verifies header, index and every piece's CRC
                except MemtierCorruptError:
                    if r.slot_header(k) is None or r.slot_header(k).raw != h.raw:
                        continue  # rewritten by the backend since it was listed (a seqlock miss): not held now
                    raise
                idx = fmt.read_index(img)
                assert idx.version == h.version.step and idx.rank == r.rank
                out.setdefault(h.version.step, {})[r.rank] = {(e.tensor_id, e.start): fmt.entry_view(img, e).tobytes()
                                                              for e in idx.entries}
    return out, states


def assert_persistent(cfg, version, arrays):
    ck = load(Config.load(None, mode=cfg.mode, scratch=cfg.scratch + "-elsewhere", persistent=cfg.persistent),
              "job", version)  # neither this node's scratch nor its memory tier
    assert ck.level == "persistent" and ck.version == version
    for a, b in zip(ck.arrays.values(), arrays):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- configuration

def test_config_errors(tmp_path, device):
    with pytest.raises(ConfigError, match="ec_interval"):
        config(tmp_path, device, ec_interval=0)
    cfg = config(tmp_path, device)
    assert cfg.memtier == device and cfg.where("memtier") == "keyword override"
    plan = make_plan(1)
    with pytest.raises(ConfigError, match="built-in engine"):  # decided before VeloC is even looked for
        make_engine("veloc", cfg, "job", 0, plan)
    with pytest.raises(ConfigError, match="does not exist|No such file"):
        Engine(config(tmp_path, str(tmp_path / "missing")), "job", 0, plan)
    with pytest.raises(ConfigError, match="not a regular file"):
        Engine(config(tmp_path, str(tmp_path)), "job", 0, plan)
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 8192)
    with pytest.raises(MemtierCorruptError):
        Engine(config(tmp_path, str(junk)), "job", 0, plan)
    with pytest.raises(ConfigError, match="memtier"):
        Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), memtier=" ")


def test_device_too_small_is_refused_before_training(tmp_path):
    path = f"/dev/shm/deepfreeze-test-h2-{uuid.uuid4().hex[:10]}"
    mdev.create(path, "4M").close()
    try:
        with pytest.raises(MemtierFullError, match="no room"):
            Engine(config(tmp_path, path), "job", 0, make_plan(1, big=True))  # 2 slots of 12 MB
        assert not os.path.exists(tmp_path / "scratch")  # refused before the backend was started
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("mode", ["async", "sync"])
def test_round_trip_two_ranks(tmp_path, device, mode, write_once):
    """Rank 0 hands fused capture buffers, rank 1 flat pieces; every version is on persistent and the
    tier holds the two newest, bit-exact; no shard file on scratch; the backend (async) or the rank
    (sync) did the copy, with the exact byte count. On both write paths (the write_once fixture):
    with a memory tier, auto is off (the tier already writes each version once)."""
    world = 2
    plan = make_plan(world)
    cfg = config(tmp_path, device, mode)
    assert cfg.write_once == write_once
    engines = [Engine(cfg, "job", r, plan) for r in range(world)]
    assert not any(e.write_once for e in engines)
    layouts = [FusedLayout.build(plan, r) for r in range(world)]
    for v in (2, 4, 6):
        arrays = model_arrays(v)
        engines[0].checkpoint(v, FusedShard.from_arrays(layouts[0], pieces(arrays, plan, 0), v), step=v, epoch=0)
        engines[1].checkpoint(v, pieces(arrays, plan, 1), step=v, epoch=0)
    for e in engines:
        e.close()
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4, 6]
    for v in (2, 4, 6):
        assert_persistent(cfg, v, model_arrays(v))
    held, states = tier(device, "job")
    assert sorted(held) == [4, 6]
    for v in held:
        for r in range(world):
            assert held[v][r] == expected_pieces(model_arrays(v), plan, r)
    assert all(s[0] == SlotState.DONE for r in range(world) for s in states[r])
    for root, _, files in os.walk(tmp_path / "scratch"):
        assert not [f for f in files if f.endswith(".dfs") or f == "manifest.json"], (root, files)
    for e in engines:
        for v in (2, 4, 6):
            st = e.memtier_stats[v]
            assert st["bytes"] == layouts[e.rank].data_bytes and st["calls"] >= 1
            assert st["copier"] == ("backend" if mode == "async" else "rank")


def test_keras_two_ranks_every_version_in_tier_and_persistent(tmp_path, device):
    """Keras fit on 2 Horovod ranks, a checkpoint every batch: every version on persistent equals
    the weights recorded at that step, and so do the tier's newest versions (all ranks' slots)."""
    out = str(tmp_path)
    mpirun(2, os.path.join(WORKERS, "memtier_keras.py"), out, device, timeout=240)
    versions = sorted(int(n[1:-4]) for n in os.listdir(f"{out}/expected"))
    assert versions == list(range(2, 13))  # the first batch is skipped (before Horovod's broadcast)
    cfg = Config.load(None, mode="async", scratch=f"{out}/nowhere", persistent=f"{out}/persistent")
    expected = {}
    for v in versions:
        with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as z:
            expected[v] = [z[f"arr_{i}"] for i in range(len(z.files))]
        assert [a.tobytes() for a in load(cfg, "mt", v).model_arrays().values()] == \
            [a.tobytes() for a in expected[v]], v
    held, _ = tier(device, "mt")
    assert sorted(held) == [11, 12]
    plan = plan_of(load(cfg, "mt", 12).manifest)
    for v, by_rank in held.items():
        assert sorted(by_rank) == [0, 1]
        for tid, want in enumerate(expected[v]):
            got = np.empty(want.size, want.dtype)
            for p in plan.pieces:
                if p.tensor_id == tid:
                    got[p.start:p.stop] = np.frombuffer(by_rank[p.rank][(tid, p.start)], want.dtype)
            assert got.tobytes() == want.tobytes(), (v, tid)
    for r in (0, 1):
        with open(f"{out}/stats.r{r}.json") as f:
            st = json.load(f)
        assert sorted(int(v) for v in st["memtier_stats"]) == versions
        assert all(s["copier"] == "backend" and s["bytes"] == st["data_bytes"] for s in st["memtier_stats"].values())


# ----------------------------------------------------------------------------- async correctness

def test_buffer_held_until_acknowledged(tmp_path, device, monkeypatch):
    """The caller drops its only reference to the capture buffer while the (slowed) backend copies
    it; the memory is then reused for other bytes: the tier must still hold the recorded bytes."""
    monkeypatch.setenv("DEEPFREEZE_MEMTIER_COPY_DELAY", "0.3")  # per 4 MiB chunk: about 1 s per version
    plan = make_plan(1, big=True)
    layout = FusedLayout.build(plan, 0)
    cfg = config(tmp_path, device)
    engine = Engine(cfg, "job", 0, plan)
    engine.checkpoint(3, FusedShard.from_arrays(layout, pieces(model_arrays(3, True), plan, 0), 3), step=3, epoch=0)
    gc.collect()  # the engine's references are the only ones left
    garbage = [np.full(layout.nbytes, 0xAB, np.uint8) for _ in range(8)]  # reuses freed memory, if any
    engine.close()
    held, _ = tier(device, "job")
    assert held[3][0] == expected_pieces(model_arrays(3, True), plan, 0)
    assert engine.memtier_stats[3]["copy_s"] >= 0.6  # the copy was slow: the drop came while it ran
    del garbage


def test_async_every_step_for_30_steps_with_waits_counted(tmp_path, device, monkeypatch):
    """A checkpoint at every step for 30 steps with a slowed copy and one version in flight: the
    training thread waits for the copies (counted), every version is flushed, and every version
    the tier can restore equals the step it claims, exactly."""
    # slow enough to wait for (hand-off at normal priority): 0.08 s was not, once, beside 3 loaded
    # helpers (fewer than 15 waits: the loop's own work and tier reads outlasted the copy)
    monkeypatch.setenv("DEEPFREEZE_MEMTIER_COPY_DELAY", "0.3")
    plan = make_plan(1, big=True)
    cfg = config(tmp_path, device, max_inflight=1)
    engine = Engine(cfg, "job", 0, plan)
    seen = {}
    for v in range(1, 31):
        arrays = model_arrays(v, True)
        engine.checkpoint(v, pieces(arrays, plan, 0), step=v, epoch=0)
        held, states = tier(device, "job")  # what a restore could read at this moment
        for hv, by_rank in held.items():
            assert by_rank[0] == expected_pieces(model_arrays(hv, True), plan, 0), f"at {v}: v{hv} is not step {hv}"
            seen[hv] = True
    engine.close()
    assert engine.write_waits >= 15, engine.write_waits  # checkpoints waited for the previous copy
    assert sorted(engine.memtier_stats) == list(range(1, 31))
    assert engine.memtier_waits == sum(1 for s in engine.memtier_stats.values() if s["waited_s"] > 0)
    assert PersistentLevel(cfg.persistent).committed_versions("job") == list(range(1, 31))
    assert_persistent(cfg, 30, model_arrays(30, True))
    assert len(seen) >= 10


def test_slot_waits_when_flushes_lag(tmp_path, device):
    """Fast copies, slower flushes (fsync on persistent), two slots: a new version finds the older
    slot still waiting for its flush, waits for it (counted), and nothing is lost or mixed."""
    plan = make_plan(1, big=True)
    cfg = config(tmp_path, device, max_inflight=4)
    versions = {v: pieces(model_arrays(v, True), plan, 0) for v in range(1, 13)}  # made first: the versions
    engine = Engine(cfg, "job", 0, plan)  # then come back to back (making 12 MB of random numbers between
    for v in range(1, 13):                # them gave the flushes time to finish: a wait was not certain)
        engine.checkpoint(v, versions[v], step=v, epoch=0)
    engine.close()
    assert engine.memtier_waits >= 1
    assert PersistentLevel(cfg.persistent).committed_versions("job") == list(range(1, 13))
    for v in (1, 6, 12):
        assert_persistent(cfg, v, model_arrays(v, True))
    held, _ = tier(device, "job")
    assert sorted(held) == [11, 12]


def test_rank_copies_itself_when_the_backend_may_not_read(tmp_path, device, caplog):
    """The kernel refusing the backend's read (Yama; injected by subclassing: the first answer
    says so): one warning, then the rank copies into the slot the backend reserved for it."""
    class Refused(Engine):
        refused = 0

        def _memtier_request(self, backend, req, wait):
            if not req.get("self_copy") and not self.refused:
                self.refused += 1
                return {"ok": False, "kind": "permission", "error": "injected: ptrace_scope refused the read"}
            return super()._memtier_request(backend, req, wait)

    plan = make_plan(1)
    cfg = config(tmp_path, device)
    engine = Refused(cfg, "job", 0, plan)
    with caplog.at_level(logging.WARNING, "deepfreeze"):
        for v in (2, 4, 6):
            engine.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
        engine.close()
    assert sum("copies its shards into the memory tier itself" in r.getMessage() for r in caplog.records) == 1
    assert [engine.memtier_stats[v]["copier"] for v in (2, 4, 6)] == ["rank"] * 3
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [2, 4, 6]
    held, _ = tier(device, "job")
    for v in (4, 6):
        assert held[v][0] == expected_pieces(model_arrays(v), plan, 0)


# ----------------------------------------------------------------------------- kills

def _start(out, device, versions, delay):
    env = dict(os.environ, DEEPFREEZE_MEMTIER_COPY_DELAY=str(delay), PYTHONPATH=os.getcwd())
    return subprocess.Popen([sys.executable, os.path.join(WORKERS, "memtier_numpy.py"), out, device,
                             ",".join(map(str, versions))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _line(proc, prefix, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.split()
        if not line and proc.poll() is not None:
            pytest.fail(f"worker exited {proc.returncode} before {prefix!r}: {proc.stderr.read()[-3000:]}")
    pytest.fail(f"no {prefix!r} line within {timeout}s")


def _wait_active(device, timeout=30):
    """Poll the device until a slot of 'job' rank 0 is ACTIVE (a copy in progress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with mdev.open(device, writable=False) as dev:
            for r in dev.find("job"):
                hs = [r.slot_header(k) for k in range(r.nslots)]
                if any(h is not None and h.state == SlotState.ACTIVE for h in hs):
                    return
        time.sleep(0.02)
    pytest.fail("no slot became ACTIVE")


def _gone(pid, timeout=10):
    """The process exited (or is a zombie: its parent, the frozen rank, has not reaped it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state is None or state[0] in "ZX":
            return True
        time.sleep(0.05)
    return False


def _v_pieces(v):
    return {(p.tensor_id, p.start): a.tobytes() for p, a in
            zip(memtier_numpy.plan().for_rank(0), [a.reshape(-1) for a in memtier_numpy.arrays(v)])}


def test_backend_killed_mid_copy_previous_version_restorable_then_recovered(tmp_path, device):
    """kill -9 of the backend while it copies v2 (the rank frozen meanwhile): one slot ACTIVE, v1
    restorable bit-exact from the device. Then the rank goes on: a new backend takes the version
    again, and v1 and v2 end up committed and in the tier."""
    out = str(tmp_path)
    proc = _start(out, device, [1, 2], delay=0.5)
    try:
        _line(proc, "committed 1")
        backend = int(_line(proc, "sent 2")[2].split("=")[1])
        _wait_active(device)
        os.kill(proc.pid, signal.SIGSTOP)  # the engine must not re-send before we looked
        os.kill(backend, signal.SIGKILL)
        assert _gone(backend)
        held, states = tier(device, "job")
        assert sorted(held) == [1] and held[1][0] == _v_pieces(1)
        assert sorted(s[0] for s in states[0] if s) == [SlotState.ACTIVE, SlotState.DONE]
        os.kill(proc.pid, signal.SIGCONT)
        _line(proc, "done")
        assert proc.wait(30) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    held, _ = tier(device, "job")
    assert sorted(held) == [1, 2] and held[2][0] == _v_pieces(2)
    cfg = Config.load(None, mode="async", scratch=f"{out}/nowhere", persistent=f"{out}/pfs")
    assert PersistentLevel(cfg.persistent).committed_versions("job") == [1, 2]
    ck = load(cfg, "job", 2)
    assert [a.tobytes() for a in ck.arrays.values()] == [a.tobytes() for a in memtier_numpy.arrays(2)]


def test_backend_and_job_killed_mid_copy_view_restore_repack(tmp_path, device):
    """kill -9 of the backend in the middle of a copy, then of the job (the node's jobs die): view
    shows the slot ACTIVE and never restorable, restore returns the previous version bit-exact,
    and repack (the job is finished) frees the invalid slot, keeping that version restorable."""
    from deepfreeze import memtier
    out = str(tmp_path)
    proc = _start(out, device, [1, 2], delay=0.5)
    try:
        _line(proc, "committed 1")
        backend = int(_line(proc, "sent 2")[2].split("=")[1])
        _wait_active(device)
        os.kill(backend, signal.SIGKILL)
        proc.kill()
        proc.wait()
        assert _gone(backend)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (model,) = [m for m in memtier.view(device)["models"] if m["name"] == "job"]
    slots = [s for shard in model["shards"] for s in shard["slots"]]
    assert sorted(s["state"] for s in slots) == ["ACTIVE", "DONE"], slots
    assert [s["version"] for s in slots if s["valid"]] == [1], slots
    arrays, version = memtier.restore(device, "job")
    assert version.step == 1 and [a.tobytes() for a in arrays.values()] == [a.tobytes() for a in memtier_numpy.arrays(1)]
    with memtier.open(device) as dev:
        freed = dev.repack(live=mdev.default_live)
    assert freed["freed_bytes"] > 0, freed
    (model,) = [m for m in memtier.view(device)["models"] if m["name"] == "job"]
    slots = [s for shard in model["shards"] for s in shard["slots"]]
    assert [(s["state"], s["version"]) for s in slots] == [("DONE", 1)], slots
    arrays, version = memtier.restore(device, "job")
    assert version.step == 1 and [a.tobytes() for a in arrays.values()] == [a.tobytes() for a in memtier_numpy.arrays(1)]


def test_rank_killed_mid_checkpoint(tmp_path, device):
    """kill -9 of the rank while the backend copies its v2: the slot is left ACTIVE (never DONE with
    a half copy), v1 stays restorable and committed, the backend serves the next job, which reuses
    the registration and writes on."""
    out = str(tmp_path)
    proc = _start(out, device, [1, 2], delay=0.5)
    try:
        _line(proc, "committed 1")
        backend = int(_line(proc, "sent 2")[2].split("=")[1])
        _wait_active(device)
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(1.5)  # the backend's copy fails (the process is gone) within a chunk's delay
    held, states = tier(device, "job")
    assert sorted(held) == [1] and held[1][0] == _v_pieces(1)
    assert sorted(s[0] for s in states[0] if s) == [SlotState.ACTIVE, SlotState.DONE]
    proc = _start(out, device, [3, 4], delay=0)  # the same backend if still up (it is idle for 2 s)
    try:
        _line(proc, "committed 3", timeout=120)
        _line(proc, "done", timeout=120)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    held, _ = tier(device, "job")
    assert sorted(held) == [3, 4] and held[4][0] == _v_pieces(4)
    assert PersistentLevel(f"{out}/pfs").committed_versions("job") == [1, 3, 4]
    del backend


@pytest.mark.parametrize("point", ["memtier.slot.active", "memtier.slot.data", "memtier.slot.done",
                                   "memtier.table.valid"])
def test_kill_at_memtier_crash_point_then_recover(tmp_path, device, point):
    """SIGKILL right before each step of the slot protocol (in the backend, copying v2) or of the
    registration (in the rank): the job, or its rerun, recovers; the tier and persistent hold
    exactly the recorded versions."""
    out = str(tmp_path)
    once = str(tmp_path / "crashed")
    env = dict(DEEPFREEZE_CRASH_AT=f"{point}:{1 if point == 'memtier.table.valid' else 2}", DEEPFREEZE_CRASH_ONCE=once)
    os.environ.update(env)
    try:
        proc = _start(out, device, [1, 2], delay=0)
    finally:
        for k in env:
            del os.environ[k]
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert os.path.exists(once), f"{point} was not reached: {stderr[-3000:]}"
    if point == "memtier.table.valid":  # the rank died registering: the entry stays WRITING, never read
        assert proc.returncode == -signal.SIGKILL
        with mdev.open(device, writable=False) as dev:
            assert dev.find("job") == []
        proc = _start(out, device, [1, 2], delay=0)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "done" in stdout, stderr[-3000:]  # a new backend took v2 again
    held, _ = tier(device, "job")
    assert sorted(held) == [1, 2] and all(held[v][0] == _v_pieces(v) for v in (1, 2))
    assert PersistentLevel(f"{out}/pfs").committed_versions("job") == [1, 2]


# ----------------------------------------------------------------------------- slots and space

def test_memtier_slots_key_keeps_that_many_versions(tmp_path, device):
    """memtier_slots = 3: the tier holds the three newest versions, each bit-exact."""
    plan = make_plan(1)
    cfg = config(tmp_path, device, memtier_slots=3)
    engine = Engine(cfg, "job", 0, plan)
    for v in (2, 4, 6, 8):
        engine.checkpoint(v, pieces(model_arrays(v), plan, 0), step=v, epoch=0)
    engine.close()
    held, states = tier(device, "job")
    assert len(states[0]) == 3 and sorted(held) == [4, 6, 8]
    for v in held:
        assert held[v][0] == expected_pieces(model_arrays(v), plan, 0)


def test_full_device_repacks_finished_models_at_registration(tmp_path, caplog):
    """A device with room for one model's two slots: a second model registers after the first one's
    job finished by compacting the first to its newest version (which stays restorable)."""
    path = f"/dev/shm/deepfreeze-test-h2-{uuid.uuid4().hex[:10]}"
    mdev.create(path, "40M").close()  # 1 MB of table; one model of 2 x 12 MB slots; not two
    try:
        plan = make_plan(1, big=True)
        cfg = config(tmp_path, path)
        first = Engine(cfg, "first", 0, plan)
        for v in (2, 4):
            first.checkpoint(v, pieces(model_arrays(v, big=True), plan, 0), step=v, epoch=0)
        first.close()  # no lease is held on "first" any more: its job is finished
        with caplog.at_level(logging.WARNING, "deepfreeze"):
            second = Engine(cfg, "second", 0, plan)
        assert "repacked" in caplog.text
        second.checkpoint(2, pieces(model_arrays(7, big=True), plan, 0), step=2, epoch=0)
        second.close()
        held, states = tier(path, "first")
        assert sorted(held) == [4] and len(states[0]) == 1
        assert held[4][0] == expected_pieces(model_arrays(4, big=True), plan, 0)
        assert tier(path, "second")[0][2][0] == expected_pieces(model_arrays(7, big=True), plan, 0)
    finally:
        os.unlink(path)
