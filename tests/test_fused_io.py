"""The shard file path at disk speed: a FusedShard written as is, chunked CRC+write, the flush's grouped
reads and early write-back (deepfreeze.tiers.shardbytes.write_shard_file, _copy_checked, _start_writeback)."""
import dataclasses
import os

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.tiers import shardbytes as levels
from deepfreeze.config import Config
from deepfreeze.format import build_manifest
from deepfreeze.errors import CorruptCheckpointError
from deepfreeze.fused import FusedLayout, FusedShard
from deepfreeze.tiers.flush import flush_job
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.tiers.shardbytes import write_shard_file
from deepfreeze.loader import load
from deepfreeze.shardplan import ShardPlan, TensorSpec

RNG = np.random.default_rng(12)
ARRAYS = [RNG.standard_normal((40, 30)).astype(np.float32), RNG.integers(0, 9, (7,), dtype=np.int64),
          np.array(True), np.zeros((0, 4), np.float16), RNG.standard_normal(1000),
          RNG.standard_normal(75_013).astype(np.float32),  # ~300 KB: several chunks when chunks are small
          RNG.integers(-5, 5, (3, 11), dtype=np.int8)]
WORLD = 2


def plan_for(world: int = WORLD) -> ShardPlan:
    ts = [TensorSpec(i, f"t{i}", fmt.dtype_name(a.dtype), a.shape) for i, a in enumerate(ARRAYS)]
    return ShardPlan.build(ts, world, min_shard_bytes=256)


def pieces(plan: ShardPlan, rank: int) -> list[np.ndarray]:
    return [ARRAYS[p.tensor_id].reshape(-1)[p.start:p.stop] for p in plan.for_rank(rank)]


def fused(plan: ShardPlan, rank: int, step: int = 3) -> FusedShard:
    return FusedShard.from_arrays(FusedLayout.build(plan, rank), pieces(plan, rank), step)


@pytest.fixture(params=["default", "tiny"])
def chunk(request, monkeypatch):
    """Default chunking, and chunks so small (an odd size) that pieces straddle many chunk borders."""
    if request.param == "tiny":
        monkeypatch.setattr(levels, "_CHUNK", 1000)
        monkeypatch.setattr(levels, "_WRITEBACK_BATCH", 3000)
    return request.param


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("chksum", [True, False])
def test_fused_and_list_paths_write_the_same_file(tmp_path, chunk, rank, chksum):
    plan = plan_for()
    a_path, b_path = str(tmp_path / "fused.dfs"), str(tmp_path / "list.dfs")
    write_shard_file(a_path, 7, rank, plan, fused(plan, rank), chksum=chksum)
    write_shard_file(b_path, 7, rank, plan, pieces(plan, rank), chksum=chksum)
    with open(a_path, "rb") as fa, open(b_path, "rb") as fb:
        a, b = fa.read(), fb.read()
    assert a == b  # byte for byte: header, index (CRCs included), data and padding
    with open(a_path, "rb") as f:
        idx = fmt.read_index(f, a_path)
        assert (idx.rank, idx.version, idx.has_crc, idx.file_size) == (rank, 7, chksum, len(a))
        assert [dataclasses.replace(e, crc=0) for e in idx.entries] == list(FusedLayout.build(plan, rank).entries)
        for e, want in zip(idx.entries, pieces(plan, rank)):
            got = fmt.read_entry(f, e, verify=chksum, path=a_path)  # verify: the CRC of the bytes on disk
            assert got.tobytes() == np.ascontiguousarray(want).tobytes()
            assert e.crc == (fmt.crc32(np.ascontiguousarray(want)) if chksum else 0)
    assert sorted(os.listdir(tmp_path)) == ["fused.dfs", "list.dfs"]  # no temporary file left


def test_fused_shard_of_another_rank_or_plan_is_rejected_and_nothing_is_left(tmp_path):
    plan = plan_for()
    level = ScratchLevel(str(tmp_path))
    with pytest.raises(ValueError, match="another shard plan or rank"):
        level.write_shard("m", 1, 0, plan, fused(plan, 1), chksum=True)
    other = plan_for(world=3)
    with pytest.raises(ValueError, match="another shard plan or rank"):
        level.write_shard("m", 1, 0, plan, fused(other, 0), chksum=True)
    vdir = level.version_dir("m", 1)
    assert not os.path.exists(level.shard_path("m", 1, 0))
    assert [n for n in os.listdir(vdir)] == []


def _write_version(tmp_path, plan: ShardPlan, version: int = 5) -> tuple[Config, dict]:
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      persistent_interval=0)
    scratch = ScratchLevel(cfg.scratch)
    for r in range(plan.world_size):
        scratch.write_shard("job", version, r, plan, fused(plan, r, step=version), chksum=True)
    m = build_manifest("job", version, version, 0, plan, ["node"] * plan.world_size)
    scratch.write_manifest("job", version, m)
    return cfg, m


def _flush(cfg: Config, m: dict, version: int, rank: int) -> dict:
    return flush_job({"name": "job", "version": version, "rank": rank, "scratch": cfg.scratch,
                      "persistent": cfg.persistent, "persistent_interval": 0, "keep_scratch": 0,
                      "keep_persistent": 0, "manifest": m})


def _assert_restored(cfg: Config, level: str) -> None:
    ck = load(cfg, "job", verify=True)
    assert ck.level == level and ck.version == 5
    assert list(ck.arrays) == [f"t{i}" for i in range(len(ARRAYS))]
    for i, a in enumerate(ARRAYS):
        got = ck.arrays[f"t{i}"]
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()


def test_fused_shards_flush_and_restore_bit_exact(tmp_path, chunk):
    plan = plan_for()
    cfg, m = _write_version(tmp_path, plan)
    _assert_restored(cfg, "scratch")
    results = [_flush(cfg, m, 5, r) for r in range(WORLD)]
    assert [r["committed"] for r in results] == [False, True]
    vdir = os.path.join(cfg.persistent, "job", f"v{5:012d}")
    assert sorted(n for n in os.listdir(vdir) if not n.startswith("commit.lock")) == \
        ["decision", "manifest.json", "model.dfz"]
    with open(os.path.join(vdir, "model.dfz"), "rb") as f:  # the assembled file's CRCs are the flushed bytes'
        idx = fmt.read_index(f)
        assert idx.has_crc
        for e in idx.entries:
            want = ARRAYS[e.tensor_id].reshape(-1)[e.start:e.stop]
            assert e.crc == fmt.crc32(np.ascontiguousarray(want))
            assert fmt.read_entry(f, e).tobytes() == want.tobytes()
    for r in range(WORLD):  # restore from persistent alone
        os.unlink(ScratchLevel(cfg.scratch).shard_path("job", 5, r))
    _assert_restored(cfg, "persistent")


@pytest.mark.parametrize("where", ["small piece in a grouped read", "large piece, a later chunk"])
def test_flush_detects_a_damaged_byte_in_grouped_and_chunked_reads(tmp_path, monkeypatch, where):
    monkeypatch.setattr(levels, "_CHUNK", 4096)
    plan = plan_for(world=1)
    cfg, m = _write_version(tmp_path, plan)
    path = ScratchLevel(cfg.scratch).shard_path("job", 5, 0)
    with open(path, "rb") as f:
        idx = fmt.read_index(f)
    if where.startswith("small"):
        e = next(e for e in idx.entries if e.tensor_id == 1)  # 56 bytes, read with its neighbours
        at = e.offset + 3
    else:
        e = max(idx.entries, key=lambda e: e.length)
        at = e.offset + 3 * 4096 + 17
    with open(path, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in tensor {e.tensor_id} "):
        _flush(cfg, m, 5, 0)
    assert not os.path.exists(os.path.join(cfg.persistent, "job", f"v{5:012d}", "manifest.json"))


def test_flush_without_sync_file_range_falls_back_to_fadvise(tmp_path, monkeypatch):
    """Where libc has no sync_file_range, the write-back hint is posix_fadvise; the flush is the same."""
    monkeypatch.setattr(levels, "_sync_file_range", None)
    monkeypatch.setattr(levels, "_WRITEBACK_BATCH", 4096)
    calls = []
    real = os.posix_fadvise

    def fadvise(fd, off, length, advice):
        calls.append(advice)
        return real(fd, off, length, advice)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    plan = plan_for(world=1)
    cfg, m = _write_version(tmp_path, plan)
    assert _flush(cfg, m, 5, 0)["committed"]
    # the kicks (fadvise, the fallback), then the drop after fsync (adjacent pieces in one call)
    assert calls.count(os.POSIX_FADV_DONTNEED) >= 2
    os.unlink(ScratchLevel(cfg.scratch).shard_path("job", 5, 0))
    _assert_restored(cfg, "persistent")


def test_sync_file_range_kicks_are_hints_on_a_file_that_refuses_them(tmp_path):
    """A descriptor sync_file_range refuses (a pipe: ESPIPE) takes the fadvise fallback, which fails
    quietly too: a hint never fails the flush."""
    r, w = os.pipe()
    try:
        levels._start_writeback(w, 0, 4096)
    finally:
        os.close(r)
        os.close(w)


def test_flush_of_a_shard_whose_index_puts_a_piece_inside_another(tmp_path, monkeypatch):
    """A piece inside another (a crafted index with valid checksums) is never grouped into the other's
    read (which would end the read early): each gets its own bytes and CRC, the flush copies what the
    index says."""
    monkeypatch.setattr(levels, "_CHUNK", 4096)
    same = [RNG.standard_normal(600).astype(np.float32), RNG.standard_normal(300).astype(np.float32)]
    plan = ShardPlan.build([TensorSpec(i, f"t{i}", "float32", a.shape) for i, a in enumerate(same)], 1)
    cfg = Config.load(None, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"),
                      persistent_interval=0)
    scratch = ScratchLevel(cfg.scratch)
    path = scratch.write_shard("job", 5, 0, plan, same, chksum=True)
    with open(path, "rb") as f:
        idx = fmt.read_index(f, path)
    e0, e1 = idx.entries
    with open(path, "rb") as f:  # what t1 now points at: bytes inside t0
        f.seek(e0.offset + 64)
        shifted = f.read(e1.length)
    crafted = [e0, dataclasses.replace(e1, offset=e0.offset + 64, crc=fmt.crc32(shifted))]
    with open(path, "r+b") as f:
        f.write(fmt.encode_index(fmt.KIND_SHARD, 0, 1, 5, crafted, idx.data_offset, idx.file_size, True, idx.run
                                 or levels.ANONYMOUS_RUN))
    m = build_manifest("job", 5, 5, 0, plan, ["node"])
    scratch.write_manifest("job", 5, m)
    assert _flush(cfg, m, 5, 0)["committed"]
    os.unlink(path)
    ck = load(cfg, "job", verify=True)
    assert ck.level == "persistent"
    assert ck.arrays["t0"].tobytes() == same[0].tobytes()
    assert ck.arrays["t1"].tobytes() == shifted
