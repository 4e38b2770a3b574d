"""write_once: the mode chosen from real directories (a tmpfs and a disk directory), versions
written once into persistent restored bit-exact (flat arrays and a fused shard, sync and async),
and a flush job's write-once record checked before anything is committed."""
import logging
import os

import numpy as np
import pytest

import deepfreeze
from deepfreeze import Config
from deepfreeze.engine import Engine
from deepfreeze.errors import CheckpointWriteError, ConfigError
from deepfreeze.fused import FusedLayout, FusedShard
from deepfreeze.tiers.flush import flush_job
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load
from deepfreeze.tiers import write_once as choose
from deepfreeze.tiers.direct import same_file_system
from test_engine import make_plan, model_arrays, pieces

SHM = "/dev/shm"
needs_tmpfs = pytest.mark.skipif(not os.path.isdir(SHM) or not os.access(SHM, os.W_OK), reason="no writable /dev/shm")


@pytest.fixture(autouse=True)
def _shipped_default(monkeypatch):
    monkeypatch.delenv("VELOC_WRITE_ONCE", raising=False)  # conftest turns it off for the other tests


@pytest.fixture
def shm_dir():
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="df-writeonce-", dir=SHM)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def cfg(scratch, persistent, **kw):
    return Config.load(None, mode=kw.pop("mode", "sync"), scratch=str(scratch), persistent=str(persistent), **kw)


@needs_tmpfs
def test_mode_chosen_from_real_directories(tmp_path, shm_dir, caplog):
    disk_a, disk_b = tmp_path / "scratch", tmp_path / "pfs" / "not" / "yet"  # the nearest existing parent is judged
    disk_a.mkdir()
    same, why = same_file_system(str(disk_a), str(disk_b))
    assert same, why
    other, why2 = same_file_system(shm_dir, str(disk_b))
    if os.stat(shm_dir).st_dev != os.stat(tmp_path).st_dev:  # tmp_path itself may be on a tmpfs
        assert not other and "different devices" in why2
    with caplog.at_level(logging.INFO, logger="deepfreeze"):
        on, why = choose(cfg(disk_a, disk_b))  # auto: the shipped default
        assert on and why.startswith("write_once = auto"), why
        assert "straight into persistent" in caplog.text and "write_once = auto" in caplog.text
    assert choose(cfg(disk_a, disk_b, write_once="off"))[0] is False
    assert choose(cfg(shm_dir, disk_b, write_once="on"))[0] is True  # on: whatever the file systems
    assert choose(cfg(shm_dir, disk_b))[0] is other
    assert choose(cfg(disk_a, disk_b, ec_interval=0))[0] is False  # partner copies need scratch files
    assert choose(cfg(disk_a, disk_b, persistent_interval=-1))[0] is False


def test_never_by_device_number_alone(tmp_path):
    """Same st_dev but the mount table disagrees, or cannot be read: not the same file system."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    real = os.path.realpath(str(tmp_path))
    dev = os.stat(real).st_dev
    mi = tmp_path / "mountinfo"
    mi.write_text(f"1 0 {os.major(dev)}:{os.minor(dev)} / / rw - ext4 /dev/x rw\n"
                  f"2 1 {os.major(dev)}:{os.minor(dev)} / {real}/b rw - xfs /dev/y rw\n")
    same, why = same_file_system(str(a), str(b), mountinfo=str(mi))
    assert not same and "different mounts" in why
    mi.write_text(f"1 0 {os.major(dev)}:{os.minor(dev)} / / rw - ext4 /dev/x rw\n"
                  f"2 1 {os.major(dev)}:{os.minor(dev)} / {real}/with\\040space rw - ext4 /dev/x rw\n")
    assert same_file_system(str(a), str(b), mountinfo=str(mi))[0]
    assert not same_file_system(str(a), str(b), mountinfo=str(tmp_path / "absent"))[0]


def test_bad_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="write_once = 'sometimes' is invalid"):
        cfg(tmp_path / "s", tmp_path / "p", write_once="sometimes")
    with pytest.raises(ConfigError, match="ec_interval"):
        cfg(tmp_path / "s", tmp_path / "p", write_once="on", ec_interval=0)
    assert cfg(tmp_path / "s", tmp_path / "p", write_once=True).write_once == "on"
    assert Config.load(None, env={"VELOC_WRITE_ONCE": "OFF"}, mode="sync", scratch=str(tmp_path / "s"),
                       persistent=str(tmp_path / "p")).write_once == "off"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fused", [False, True])
def test_written_once_restores_bit_exact(tmp_path, mode, fused):
    """Two ranks on one node, write_once = auto on one disk: no scratch file of a flushed version,
    the assembled file committed by the usual protocol, every version restored bit-exact; with
    persistent_interval a version decided 'skip' goes to scratch as before."""
    world, versions = 2, (1, 2, 3)
    plan = make_plan(world)
    interval = 3600.0 if mode == "sync" else 0.0  # sync: v1 flushed, v2 and v3 skipped (to scratch)
    c = cfg(tmp_path / "node0", tmp_path / "pfs", mode=mode, write_once="auto", persistent_interval=interval)
    engines = [Engine(c, "job", r, plan) for r in range(world)]
    assert all(e.write_once for e in engines)
    layouts = [FusedLayout.build(plan, r) for r in range(world)]
    for v in versions:
        arrays = model_arrays(v)
        for r, e in enumerate(engines):
            p = pieces(arrays, plan, r)
            e.checkpoint(v, FusedShard.from_arrays(layouts[r], p, v) if fused else p, step=v, epoch=0)
    for e in engines:
        e.close()
    flushed = (1,) if interval else versions
    scratch = ScratchLevel(c.scratch)
    for v in versions:
        inv = scratch.inventory("job", v)
        assert (inv["shard"] == {}) is (v in flushed), f"v{v}: {inv}"
    listed = deepfreeze.list_versions(c, "job")
    for v in versions:
        assert ("persistent" in listed[v]) is (v in flushed)
        ck = load(c, "job", v)
        for a, b in zip(ck.arrays.values(), model_arrays(v)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    vdir = PersistentLevel(c.persistent).version_dir("job", flushed[-1])
    assert sorted(os.listdir(vdir)) == ["decision", "manifest.json", "model.dfz"]  # no partial, no marker left


def test_flush_checks_the_write_once_record(tmp_path):
    """A flush job whose write-once record does not match the rank's pieces, or names another
    nonce than the version's decision, fails and commits nothing."""
    plan = make_plan(1)
    c = cfg(tmp_path / "s", tmp_path / "p", write_once="on")
    level = PersistentLevel(c.persistent)
    d = level.decide("job", 1, 0)
    direct = level.write_direct("job", 1, 0, plan, pieces(model_arrays(1), plan, 0), d, chksum=True)
    from deepfreeze.format import build_manifest
    job = {"name": "job", "version": 1, "rank": 0, "scratch": c.scratch, "persistent": c.persistent,
           "persistent_interval": 0, "keep_scratch": 0, "keep_persistent": 0,
           "manifest": build_manifest("job", 1, 1, 0, plan, ["n"])}
    from deepfreeze.format import decode_crcs, encode_crcs
    got = decode_crcs(direct["crc32"], len(plan.for_rank(0)))
    assert got is not None
    bad = dict(direct, crc32=encode_crcs(got[:-1]))  # one CRC short of the rank's pieces
    with pytest.raises(CheckpointWriteError, match="malformed write-once record"):
        flush_job(dict(job, direct=bad))
    with pytest.raises(CheckpointWriteError, match="nonce"):
        flush_job(dict(job, direct=dict(direct, nonce="0" * 16)))
    assert level.committed_versions("job") == []
    assert flush_job(dict(job, direct=direct))["committed"]
    ck = load(c, "job", 1)
    for a, b in zip(ck.arrays.values(), model_arrays(1)):
        assert a.tobytes() == b.tobytes()


# -- FSDP2-shaped plans: a tensor's rows split unevenly, one rank's piece right after another's tail

ROW_SHAPES = [(5, 3), (5,), (1, 5), (1,), (7, 2), (3, 300)]  # 5 rows on 2 ranks: 3 + 2; one row: 1 + 0


def row_plan(world):
    """The plan an FSDP2 job makes: each tensor split by dim-0 rows as ``torch.chunk`` does."""
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    ts = [TensorSpec(i, f"t{i}", "float32", s) for i, s in enumerate(ROW_SHAPES)]
    given = {}
    for i, s in enumerate(ROW_SHAPES):
        per_row, chunk = int(np.prod(s[1:], dtype=np.int64)), -(-s[0] // world)
        given[i] = [min(s[0], chunk * r) * per_row for r in range(world + 1)]
    return ShardPlan.build(ts, world, given=given)


def row_arrays(seed):
    r = np.random.default_rng(seed)
    return [r.standard_normal(s).astype(np.float32) for s in ROW_SHAPES]


@pytest.mark.parametrize("order", ["rank 0 first", "last rank first"])
@pytest.mark.parametrize("world", [2, 3])
def test_uneven_rows_written_once_restore_bit_exact(tmp_path, order, world):
    """The FSDP2 case of issue 40: fused shards of a plan split by rows, written once in either order
    of the ranks, every version restored bit-exact (before the fix, a rank's run of writes carried its
    fused padding over the next rank's rows: checksum mismatch in tensor 0 elements [9,15))."""
    plan = row_plan(world)
    c = cfg(tmp_path / "node0", tmp_path / "pfs")  # the shipped default, one disk: written once
    engines = [Engine(c, "job", r, plan) for r in range(world)]
    assert all(e.write_once for e in engines)
    layouts = [FusedLayout.build(plan, r) for r in range(world)]
    ranks = list(range(world)) if order == "rank 0 first" else list(reversed(range(world)))
    for v in (1, 2):
        arrays = row_arrays(v)
        for r in ranks:
            engines[r].checkpoint(v, FusedShard.from_arrays(layouts[r], pieces(arrays, plan, r), v), step=v, epoch=0)
    for e in engines:
        e.close()
    for v in (1, 2):
        ck = load(c, "job", v)
        for a, b in zip(ck.arrays.values(), row_arrays(v)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


class _Equal:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


class _EverythingAdjacent(dict):
    def __getitem__(self, key):
        return _Equal()


class RunsOverOtherRanks(PersistentLevel):
    """The merging rule before the fix: a run goes on while destinations are as far apart as sources,
    whatever lies between them in the assembled file (another rank's rows)."""

    def direct_runs(self, entries, base, where, after):
        return super().direct_runs(entries, base, where, _EverythingAdjacent())


def test_a_write_over_another_rank_is_refused_before_a_byte(tmp_path):
    """A rank whose planned writes would cover another rank's piece gets a CheckpointWriteError naming
    the version, the tensor and the rank; nothing of it is written, the version is never committed,
    and the next version (written by the real rule) commits bit-exact."""
    plan = row_plan(2)
    c = cfg(tmp_path / "node0", tmp_path / "pfs")
    engines = [Engine(c, "job", 0, plan, persistent_cls=RunsOverOtherRanks), Engine(c, "job", 1, plan)]
    layouts = [FusedLayout.build(plan, r) for r in range(2)]
    arrays = row_arrays(1)
    shards = [FusedShard.from_arrays(layouts[r], pieces(arrays, plan, r), 1) for r in range(2)]
    engines[1].checkpoint(1, shards[1], step=1, epoch=0)
    with pytest.raises(CheckpointWriteError) as err:
        engines[0].checkpoint(1, shards[0], step=1, epoch=0)
        engines[0].wait()
    msg = str(err.value)
    assert "'job' v1 rank 0" in msg and "tensor 't0' elements [9,15) of rank 1" in msg, msg
    vdir = PersistentLevel(c.persistent).version_dir("job", 1)
    partial = [f for f in os.listdir(vdir) if f.startswith("model.dfz.partial.")]
    assert len(partial) == 1 and not [f for f in os.listdir(vdir) if f.startswith("done.r000000")]
    with open(os.path.join(vdir, partial[0]), "rb") as f:  # rank 1's rows are there, rank 0 wrote nothing
        data = f.read()
    at = {(e.tensor_id, e.start): e.offset for e in PersistentLevel(c.persistent).assembled_layout(plan)[0]}
    for p in plan.pieces:
        got = data[at[(p.tensor_id, p.start)]:at[(p.tensor_id, p.start)] + 4 * p.count]
        want = arrays[p.tensor_id].reshape(-1)[p.start:p.stop].tobytes()
        assert (got == want) if p.rank == 1 else (got.strip(b"\0") == b"" or len(got) == 0)
    assert 1 not in deepfreeze.list_versions(c, "job")
    engines[0] = Engine(c, "job", 0, plan)
    arrays = row_arrays(2)
    for r in (1, 0):
        engines[r].checkpoint(2, FusedShard.from_arrays(layouts[r], pieces(arrays, plan, r), 2), step=2, epoch=0)
    for e in engines:
        e.close()
    assert "persistent" in deepfreeze.list_versions(c, "job")[2]
    for a, b in zip(load(c, "job", 2).arrays.values(), arrays):
        assert a.tobytes() == b.tobytes()


class CountingRuns(PersistentLevel):
    """Records how many runs (one write each, or a few for a run past 1 MiB) each rank's pieces took."""

    runs: list = []

    def direct_runs(self, entries, base, where, after):
        out = super().direct_runs(entries, base, where, after)
        CountingRuns.runs.append(len(out))
        return out


def test_a_ranks_small_tensors_go_out_in_one_run(tmp_path):
    """Small tensors are whole on one rank each, alternating between the ranks (largest first to the
    rank with the fewest bytes). The assembled file lays each rank's whole tensors together
    (``assembled_order``), so write once writes a rank's 40 small tensors in one run (it was one a
    tensor: the other rank's tensors lay between them), the index stays in plan order, and the
    version restores bit-exact. The split tensor keeps its pieces back to back."""
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    from deepfreeze.tiers.shardbytes import assembled_order
    shapes = [(64, 300)] + [(7 + k % 5,) for k in range(80)]  # one split tensor (76.8 KB), 80 whole
    tensors = [TensorSpec(i, f"t{i}", "float32", s) for i, s in enumerate(shapes)]
    plan = ShardPlan.build(tensors, 2)
    whole = [p for p in plan.pieces if p.tensor_id > 0]
    assert {p.rank for p in whole} == {0, 1} and len(whole) == 80
    c = cfg(tmp_path / "node0", tmp_path / "pfs")
    CountingRuns.runs = []
    engines = [Engine(c, "job", r, plan, persistent_cls=CountingRuns) for r in range(2)]
    layouts = [FusedLayout.build(plan, r) for r in range(2)]
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for r in range(2):
        engines[r].checkpoint(1, FusedShard.from_arrays(layouts[r], pieces(arrays, plan, r), 1), step=1, epoch=0)
    for e in engines:
        e.close()
    assert CountingRuns.runs == [2, 2], CountingRuns.runs  # the split tensor's piece, then the 40 whole ones
    entries, _, _ = PersistentLevel(c.persistent).assembled_layout(plan)
    assert [(e.tensor_id, e.start) for e in entries] == [(p.tensor_id, p.start) for p in plan.pieces]
    order = assembled_order(plan)
    assert [plan.pieces[i].tensor_id for i in order[:2]] == [0, 0]  # the split tensor first, contiguous
    assert entries[order[1]].offset == entries[order[0]].offset + entries[order[0]].length
    for a, b in zip(load(c, "job", 1).arrays.values(), arrays):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_a_done_marker_with_a_damaged_crc_record_commits_nothing(tmp_path):
    """The finalize reads each rank's done marker: a CRC record one CRC short of its rank's pieces
    (or not base64) is a CorruptCheckpointError naming the marker, and the version is not committed;
    the intact markers commit it bit-exact."""
    import json
    from deepfreeze.errors import CorruptCheckpointError
    from deepfreeze.format import build_manifest, decode_crcs, encode_crcs
    plan = make_plan(2)
    c = cfg(tmp_path / "s", tmp_path / "p", write_once="on")
    level = PersistentLevel(c.persistent)
    d = level.decide("job", 1, 0)
    arrays = model_arrays(1)
    job = {"name": "job", "version": 1, "scratch": c.scratch, "persistent": c.persistent,
           "persistent_interval": 0, "keep_scratch": 0, "keep_persistent": 0,
           "manifest": build_manifest("job", 1, 1, 0, plan, ["a", "b"])}
    direct = [level.write_direct("job", 1, r, plan, pieces(arrays, plan, r), d, chksum=True) for r in range(2)]
    assert not flush_job(dict(job, rank=0, direct=direct[0]))["committed"]
    vdir = level.version_dir("job", 1)
    (marker,) = [os.path.join(vdir, f) for f in os.listdir(vdir) if f.startswith("done.r000000.")]
    with open(marker) as f:
        good = json.load(f)
    crcs = decode_crcs(good["crc32"], len(plan.for_rank(0)))
    for bad in (encode_crcs(crcs[:-1]), good["crc32"][:-4] + "!!!!", [[0, 0, 1]]):
        with open(marker, "w") as f:
            json.dump(dict(good, crc32=bad), f)
        with pytest.raises(CorruptCheckpointError, match="damaged done marker"):
            flush_job(dict(job, rank=1, direct=direct[1]))
        assert level.committed_versions("job") == []
    with open(marker, "w") as f:
        json.dump(good, f)
    assert flush_job(dict(job, rank=1, direct=direct[1]))["committed"]
    for a, b in zip(load(c, "job", 1).arrays.values(), arrays):
        assert a.tobytes() == b.tobytes()
