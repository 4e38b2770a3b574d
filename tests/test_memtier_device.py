"""The memory-tier device (deepfreeze/memtier/device.py): creation, model table, slot protocol,
seqlock reads, repack, and hostile device files (never a crash, always MemtierCorruptError)."""
from __future__ import annotations

import dataclasses
import os
import random
import stat
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.format import build_manifest
from deepfreeze.errors import MemtierBusyError, MemtierCorruptError, MemtierError, MemtierFullError
from deepfreeze.memtier import device as D
from deepfreeze.memtier import layout as mlayout
from deepfreeze.memtier import slot as mslot
from deepfreeze.memtier.copy import LocalCopier
from deepfreeze.lease import RunInfo, Version, new_run_id
from deepfreeze.shardplan import ShardPlan, TensorSpec


@pytest.fixture
def path():
    p = f"/dev/shm/dftest-h1-{os.getpid()}-{random.getrandbits(32):08x}.dev"
    yield p
    for q in (p,):
        if os.path.lexists(q):
            os.unlink(q)


def _plan(arrays, world=1):
    return ShardPlan.build([TensorSpec(i, n, fmt.dtype_name(a.dtype), a.shape) for i, (n, a) in
                            enumerate(arrays.items())], world, min_shard_bytes=1024)


def _arrays(seed=0, n=5):
    rng = np.random.default_rng(seed)
    out = {f"layer{i}/kernel": rng.standard_normal((i + 3, 7)).astype(np.float32) for i in range(n)}
    out["big"] = rng.integers(0, 1 << 30, 5000, dtype=np.int64)
    return out


def _register(dev, name="m", arrays=None, nslots=2, world=1, rank=0, run=None):
    arrays = arrays or _arrays()
    plan = _plan(arrays, world)
    run = run or new_run_id()
    idx = mlayout.make_index(plan, rank, name, run, standalone=world == 1)
    return dev.register_shard(name, run, rank, world, index=idx, image_size=idx["file_size"], nslots=nslots), plan


def _put(region, plan, arrays, version, finish=True):
    """Write a version of ``arrays`` (name -> full array) into a free slot; returns (slot, writer)."""
    k = region.choose_slot()
    w = region.begin(k, Version(0, version))
    pieces = plan.for_rank(region.rank)
    flat = [np.ascontiguousarray(arrays[plan.tensors[p.tensor_id].name]).reshape(-1)[p.start:p.stop] for p in pieces]
    stats = LocalCopier().copy_in([(a.ctypes.data, a.nbytes) for a in flat], w.data, w.spans,
                                  dest_offsets=[e.offset - region.data_offset for e in region.entries])
    if finish:
        w.finish(stats.crcs, build_manifest(region.name, version, version * 10, 0, plan, ["h"] * plan.world_size,
                                            run=RunInfo(region.run)))
    w.release()
    return k


def _bump(arrays, v):
    return {n: a + v for n, a in arrays.items()}


def _pieces(region, buf):
    si = fmt.read_index(buf)
    return [fmt.entry_view(buf, e).copy() for e in si.entries]


def _expect(region, plan, arrays):
    return [np.ascontiguousarray(arrays[plan.tensors[p.tensor_id].name]).reshape(-1)[p.start:p.stop]
            for p in plan.for_rank(region.rank)]


def _same(got, want):
    return len(got) == len(want) and all(g.dtype == w.dtype and g.tobytes() == w.tobytes() for g, w in zip(got, want))


# --------------------------------------------------------------------------- create / open

def test_parse_size():
    assert D.parse_size("8G") == 8 << 30 and D.parse_size("512M") == 512 << 20 and D.parse_size("64KiB") == 65536
    assert D.parse_size(4096) == 4096
    # issue 24: 10G = GiB (binary), 10GB = 10**9 units (decimal); case does not matter
    assert D.parse_size("10G") == D.parse_size("10GiB") == D.parse_size("10gib") == 10 << 30
    assert D.parse_size("10GB") == D.parse_size("10gb") == 10 * 10 ** 9 and D.parse_size("500MB") == 500 * 10 ** 6
    assert D.parse_size("1.5K") == 1536 and D.parse_size("100B") == 100 and D.parse_size("100") == 100
    for bad in ("", "8X", "-1", "0", "G", "10Gi", "10iB"):
        with pytest.raises(ValueError):
            D.parse_size(bad)


def test_create_reports_progress(path):
    seen = []
    D.create(path, "130M", progress=lambda phase, done, total: seen.append((phase, done, total))).close()
    assert seen[0] == ("allocating", 0, 130 << 20) and seen[-1] == ("pre-faulting", 130 << 20, 130 << 20)
    done = [d for p, d, _ in seen if p == "pre-faulting"]
    assert done == sorted(done) and len(done) == 4  # 0, 64 MiB, 128 MiB, all


def test_create_open_and_refusals(path):
    with D.create(path, "8M") as dev:
        assert dev.size == 8 << 20 and dev.shards() == [] and dev.free_bytes() == dev.size - dev.data_start
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(os.path.basename(path) + ".creating")]
    with pytest.raises(MemtierError, match="already exists"):
        D.create(path, "8M")
    with D.open(path) as dev:
        _register(dev)
    with D.create(path, "4M", force=True) as dev:  # replaced: empty again
        assert dev.size == 4 << 20 and dev.shards() == []
    with pytest.raises(MemtierFullError, match="available|free"):
        D.create(path + "2", "64T")
    assert not os.path.exists(path + "2")


def test_register_full_device_names_sizes(path):
    with D.create(path, "2M") as dev:
        big = {"w": np.zeros(1 << 20, np.float32)}
        with pytest.raises(MemtierFullError, match=r"needs \d+ bytes.*\d+ bytes free.*repack"):
            _register(dev, arrays=big)
        assert dev.shards() == []
        r, _ = _register(dev)  # a small one still fits
        assert dev.find("m") == [r] or [x.entry_no for x in dev.find("m")] == [r.entry_no]


def test_register_is_idempotent_and_regions_do_not_overlap(path):
    with D.create(path, "16M") as dev:
        run = new_run_id()
        r1, _ = _register(dev, "a", run=run)
        again, _ = _register(dev, "a", run=run)
        assert again.entry_no == r1.entry_no
        with pytest.raises(MemtierError, match="another layout"):
            _register(dev, "a", arrays=_arrays(n=2), run=run)
        r2, _ = _register(dev, "b")
        spans = sorted((r.region_off, r.region_off + r.region_len) for r in dev.shards())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and len(spans) == 2
        assert dev.free_bytes() == dev.size - dev.data_start - r1.region_len - r2.region_len


# --------------------------------------------------------------------------- slots

def test_slot_protocol_versions_and_choice(path):
    arrays = _arrays()
    with D.create(path, "16M") as dev:
        r, plan = _register(dev, nslots=3)
        assert [r.slot_header(k).state for k in range(3)] == [mlayout.SlotState.EMPTY] * 3
        assert r.newest() is None
        for v in (1, 2, 3, 4):
            _put(r, plan, _bump(arrays, v), v)
        done = {h.version.step: k for k, h in r.restorable()}
        assert sorted(done) == [2, 3, 4]
        k, h = r.newest()
        assert h.version == Version(0, 4) and k == done[4]
        assert _same(_pieces(r, r.read_image(k)), _expect(r, plan, _bump(arrays, 4)))
        assert r.manifest(k)["step"] == 40
        # never the newest, never a busy one; oldest DONE first
        assert r.choose_slot() == done[2]
        assert r.choose_slot(busy={done[2]}) == done[3]
        assert r.choose_slot(busy={done[2], done[3]}) is None
        # an ACTIVE slot is never restorable, and is the first choice for the next write
        _put(r, plan, _bump(arrays, 5), 5, finish=False)
        assert r.newest()[1].version == Version(0, 4)
        active = [k for k in range(3) if r.slot_header(k).state == mlayout.SlotState.ACTIVE]
        assert len(active) == 1 and r.choose_slot() == active[0]
    # everything is read back the same by a new opener
    with D.open(path, writable=False) as dev:
        (r2,) = dev.find("m")
        assert r2.newest()[1].version == Version(0, 4)
        with pytest.raises(MemtierError, match="read-only"):
            r2.begin(0, Version(0, 9))


def test_torn_header_and_damaged_image_fall_back(path):
    arrays = _arrays()
    with D.create(path, "16M") as dev:
        r, plan = _register(dev)
        k1 = _put(r, plan, _bump(arrays, 1), 1)
        k2 = _put(r, plan, _bump(arrays, 2), 2)
        # damage one data byte of v2's image: verify finds it, newest falls back to v1
        e = r.entries[-1]
        off = r.image_offset(k2) + e.offset + 5
        dev.mm[off] ^= 0xFF
        assert "checksum" in r.verify_slot(k2)
        assert r.newest(verify=False)[0] == k2
        assert r.newest()[0] == k1
        with pytest.raises(MemtierCorruptError, match="checksum"):
            r.read_image(k2)
        dev.mm[off] ^= 0xFF
        assert r.newest()[0] == k2
        # a torn header (any byte) reads as invalid
        hoff = r._slot_off(k2) + 40
        dev.mm[hoff] ^= 0x01
        assert r.slot_header(k2) is None and r.newest()[0] == k1
        assert r.choose_slot() == k2  # the invalid slot is reused first
        v = D.view(path)
        slots = v["models"][0]["shards"][0]["slots"]
        assert slots[k2]["state"] == "INVALID" and not slots[k2]["valid"] and slots[k1]["valid"]


class _RewritingRegion(mslot.ShardRegion):
    """Another writer rewrites the slot while a reader copies it (between header read and copy)."""

    def image(self, k):
        view = super().image(k)
        self.device.mm[self._slot_off(k):self._slot_off(k) + 4096] = bytes(4096)  # header gone
        return view


def test_read_image_detects_a_concurrent_rewrite(path):
    arrays = _arrays()
    with D.create(path, "16M") as dev:
        r, plan = _register(dev)
        k = _put(r, plan, arrays, 1)
        spy = _RewritingRegion(dev, r._e, r.index)
        with pytest.raises(MemtierCorruptError, match="rewritten while it was read"):
            spy.read_image(k)


def test_finish_checks_crcs_count_and_manifest(path):
    with D.create(path, "16M") as dev:
        r, plan = _register(dev)
        w = r.begin(0, Version(0, 1))
        m = build_manifest("m", 1, 1, 0, plan, ["h"], run=RunInfo(r.run))
        with pytest.raises(ValueError, match="CRCs"):
            w.finish([0], m)
        with pytest.raises(ValueError, match="is not 'm'"):
            w.finish([0] * len(r.entries), {**m, "version": 2})
        w.release()
        assert r.slot_header(0).state == mlayout.SlotState.ACTIVE


# --------------------------------------------------------------------------- lock

def test_lock_wait_is_bounded_and_names_the_holder(path):
    D.create(path, "4M").close()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({path!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with D.open(path) as dev:
            with pytest.raises(MemtierBusyError, match=f"pid {holder.pid}"):
                with dev.locked(timeout=0.3):
                    pass
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()
    with D.open(path) as dev, dev.locked(timeout=5):
        pass


# --------------------------------------------------------------------------- repack

def test_repack_compacts_dead_keeps_live_and_the_only_valid_version(path):
    arrays = _arrays()
    with D.create(path, "32M") as dev:
        dead, plan = _register(dev, "dead")
        _put(dead, plan, _bump(arrays, 1), 1)
        _put(dead, plan, _bump(arrays, 2), 2, finish=False)  # crashed mid-write: ACTIVE
        live, _ = _register(dev, "live")
        _put(live, plan, arrays, 7)
        _put(live, plan, arrays, 8, finish=False)
        empty, _ = _register(dev, "empty")  # nothing valid: dropped
        live_bytes = bytes(dev.mm[live.region_off:live.region_off + live.region_len])
        free0 = dev.free_bytes()
        got = dev.repack(live=lambda r: r.name == "live")
        assert got["retired"] == 2 and got["moved"] == 1 and got["freed_bytes"] > 0
        assert dev.free_bytes() == free0 + got["freed_bytes"]
        assert bytes(dev.mm[live.region_off:live.region_off + live.region_len]) == live_bytes
        assert dev.find("empty") == []
        (new,) = dev.find("dead")
        assert new.nslots == 1 and new.finished and new.entry_no != dead.entry_no
        k, h = new.newest()
        assert h.version == Version(0, 1)
        assert _same(_pieces(new, new.read_image(k)), _expect(new, plan, _bump(arrays, 1)))
        # nothing left to do
        assert dev.repack(live=lambda r: r.name == "live") == {"retired": 0, "moved": 0, "freed_bytes": 0}


class _DiesBeforeRetire(D.Device):
    """A repack that 'crashes' right after its copy is VALID, before the old entry is retired."""

    def _retire(self, region):
        raise KeyboardInterrupt("crash")


def test_repack_crash_between_copy_and_retire_leaves_two_copies(path):
    arrays = _arrays()
    with D.create(path, "32M") as dev:
        r, plan = _register(dev)
        _put(r, plan, arrays, 1)
        _put(r, plan, _bump(arrays, 1), 2)
    with _DiesBeforeRetire(path) as dev:
        with pytest.raises(KeyboardInterrupt):
            dev.repack(live=lambda r: False)
    with D.open(path) as dev:
        copies = dev.find("m")
        assert len(copies) == 2 and all(c.newest()[1].version == Version(0, 2) for c in copies)
        got = dev.repack(live=lambda r: False)
        (one,) = dev.find("m")
        assert got["moved"] == 0 and got["retired"] == 1 and one.nslots == 1
        assert _same(_pieces(one, one.read_image(one.newest()[0])), _expect(one, plan, _bump(arrays, 1)))


def test_writing_entry_left_by_a_crash_is_ignored_then_retired(path):
    with D.create(path, "16M") as dev:
        r, _ = _register(dev)
        dev._set_state(r.entry_no, D.WRITING)  # as if the process died before the VALID flip
        dev.refresh()
        assert dev.shards() == [] and dev.free_bytes() == dev.size - dev.data_start
        assert dev.repack()["retired"] == 1
        assert dev._state(r.entry_no) == D.RETIRED
        r2, _ = _register(dev, "again")  # the space and, once FREE ones run out, the entry are reusable
        assert r2.region_off == r.region_off


def test_default_live():
    """Standalone regions: live while the owner process runs; closed (FINISHED): not live."""
    class R:  # the two attributes default_live reads
        finished = False
        index = {"owner": D.owner_record(), "lease": None}
        name = "m"
        run = "0" * 16
    assert D.default_live(R)
    R.finished = True
    assert not D.default_live(R)
    R.finished = False
    R.index = {"owner": {**D.owner_record(), "start": D.owner_record()["start"] + 1}, "lease": None}
    assert not D.default_live(R)  # same pid, another process (start time differs)
    R.index = {"lease": None}
    assert D.default_live(R)  # unknown: assumed live


# --------------------------------------------------------------------------- hostile files

def _rewrite_entry(dev, no, **changes):
    """Rewrite table entry ``no`` with a *valid* body CRC (a hostile, not a damaged, file)."""
    off = dev._entry_off(no)
    e = D._parse_entry(no, bytes(dev.mm[off:off + D.ENTRY_SIZE]))
    e = dataclasses.replace(e, **changes)
    dev.mm[off + 4:off + 4 + D._BODY.size + 4] = e.pack_body()


def _rewrite_index(dev, region, data: bytes):
    dev.mm[region._e.index_off:region._e.index_off + len(data) + 4] = data + struct.pack("<I", fmt.crc32(data))
    _rewrite_entry(dev, region.entry_no, index_len=len(data))


HOSTILE = {
    "region past the end": lambda dev, r: _rewrite_entry(dev, r.entry_no, region_off=dev.size - 4096),
    "region in the table": lambda dev, r: _rewrite_entry(dev, r.entry_no, region_off=4096),
    "huge slot count": lambda dev, r: _rewrite_entry(dev, r.entry_no, nslots=1 << 30),
    "slots past the region": lambda dev, r: _rewrite_entry(dev, r.entry_no, slot_stride=r._e.slot_stride * 8),
    "stride too small": lambda dev, r: _rewrite_entry(dev, r.entry_no, slot_stride=4096),
    "index overlaps slots": lambda dev, r: _rewrite_entry(dev, r.entry_no, index_len=r._e.slot_off),
    "huge index": lambda dev, r: _rewrite_entry(dev, r.entry_no, index_len=1 << 40),
    "bad name": lambda dev, r: _rewrite_entry(dev, r.entry_no, name="../etc"),
    "rank >= world": lambda dev, r: _rewrite_entry(dev, r.entry_no, rank=3),
    "unaligned": lambda dev, r: _rewrite_entry(dev, r.entry_no, region_off=r.region_off + 8),
    "torn body": lambda dev, r: dev.mm.__setitem__(dev._entry_off(r.entry_no) + 20, 0x7F),
    "unknown state": lambda dev, r: dev.mm.__setitem__(
        slice(dev._entry_off(r.entry_no), dev._entry_off(r.entry_no) + 4), struct.pack("<I", 77)),
    "index crc": lambda dev, r: dev.mm.__setitem__(r._e.index_off + 3, dev.mm[r._e.index_off + 3] ^ 1),
    "index not json": lambda dev, r: _rewrite_index(dev, r, b"\x80\x81 not json"),
    "index deep": lambda dev, r: _rewrite_index(dev, r, b"[" * 5000 + b"]" * 5000),
    "index long int": lambda dev, r: _rewrite_index(dev, r, b'{"name": ' + b"9" * 5000 + b"}"),
    "index piece outside": lambda dev, r: _rewrite_index(dev, r, D.json.dumps(
        {**r.index, "tensors": [{**r.index["tensors"][0], "offset": 1 << 60}]}).encode()),
    "index pieces overlap": lambda dev, r: _rewrite_index(dev, r, D.json.dumps(
        {**r.index, "tensors": [r.index["tensors"][1], r.index["tensors"][0]]}).encode()),
    "index other model": lambda dev, r: _rewrite_index(dev, r, D.json.dumps({**r.index, "rank": 0,
                                                                               "name": "x"}).encode()),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_table_entries_are_rejected(path, case):
    """A damaged or hostile entry is quarantined (issue 24): that model is never read, every other
    model stays usable (restore, register, view), view names the entry; strict=True still refuses."""
    arrays = _arrays()
    with D.create(path, "16M") as dev:
        r, _ = _register(dev)
        o, oplan = _register(dev, "other")
        _put(o, oplan, arrays, 4)
        extent = (r.region_off, r.region_len)
        HOSTILE[case](dev, r)
    with pytest.raises(MemtierCorruptError, match=f"entry {r.entry_no}|not a valid memory-tier device"):
        D.Device(path, strict=True)
    with D.open(path) as dev:
        assert [q["entry"] for q in dev.quarantined] == [r.entry_no] and dev.problems
        assert [x.name for x in dev.shards()] == ["other"] and dev.find("m") == []
        (other,) = dev.find("other")
        k, h = other.newest()
        assert h.version.step == 4 and other.read_image(k) is not None
        new, _ = _register(dev, "third")  # the device stays writable; never on top of the damaged region
        if case in ("index crc", "index not json", "index deep", "index long int", "index piece outside",
                    "index pieces overlap", "index other model", "bad name", "rank >= world", "huge index",
                    "index overlaps slots", "stride too small", "slots past the region", "huge slot count"):
            assert not (new.region_off < extent[0] + extent[1] and extent[0] < new.region_off + new.region_len)
    v = D.view(path)  # view shows the problem and the intact models
    assert any(f"entry {r.entry_no}" in p for p in v["problems"])
    assert sorted(m["name"] for m in v["models"]) == ["other", "third"]
    assert [q["entry"] for q in v["quarantined"]] == [r.entry_no]


def test_overlapping_regions_are_rejected(path):
    with D.create(path, "16M") as dev:
        a, _ = _register(dev, "a")
        b, _ = _register(dev, "b")
        new = a.region_off + 4096  # b's region moved to start inside a's (index copied along)
        n = b._e.index_len + 4
        dev.mm[new:new + n] = dev.mm[b._e.index_off:b._e.index_off + n]
        _rewrite_entry(dev, b.entry_no, region_off=new, index_off=new, slot_off=b._e.slot_off - b.region_off + new)
    with pytest.raises(MemtierCorruptError, match="overlap"):
        D.Device(path, strict=True)
    with D.open(path) as dev:  # both quarantined, their space kept
        assert sorted(q["entry"] for q in dev.quarantined) == sorted([a.entry_no, b.entry_no])
        assert dev.shards() == [] and dev.free_bytes() < dev.size - dev.data_start - a.region_len
    v = D.view(path)
    assert any("overlap" in p for p in v["problems"]) and v["models"] == []


@pytest.mark.parametrize("case", ["magic", "crc", "size", "truncated", "empty", "fifo", "symlink"])
def test_bad_superblock_or_file(path, case):
    D.create(path, "4M").close()
    if case == "magic":
        with open(path, "r+b") as f:
            f.write(b"NOTADEV\0")
    elif case == "crc":
        with open(path, "r+b") as f:
            f.seek(30)
            f.write(b"\x55")
    elif case == "size":
        with open(path, "r+b") as f:
            f.truncate(8 << 20)
    elif case == "truncated":
        os.truncate(path, 100)
    elif case == "empty":
        os.truncate(path, 0)
    elif case == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    else:
        os.unlink(path)
        os.symlink("/dev/shm", path)
    with pytest.raises(MemtierCorruptError):
        D.open(path, writable=False)
    with pytest.raises(MemtierCorruptError):
        D.view(path)


def test_bad_slot_headers_never_crash(path):
    arrays = _arrays()
    with D.create(path, "16M") as dev:
        r, plan = _register(dev)
        k = _put(r, plan, arrays, 1)
        # a header with a valid CRC but absurd fields (meta_len past meta_cap, image_len wrong)
        raw = D._slot_header_bytes(mlayout.SlotState.DONE, r.run, Version(0, 9), r.meta_cap + 1, r.image_size, 0, 0.0)
        other = 1 - k
        dev.mm[r._slot_off(other):r._slot_off(other) + len(raw)] = raw
        assert r.slot_header(other) is None
        raw = D._slot_header_bytes(mlayout.SlotState.DONE, r.run, Version(0, 9), 10, r.image_size, 0, 0.0)
        dev.mm[r._slot_off(other):r._slot_off(other) + len(raw)] = raw  # DONE over garbage: fails verification
        assert r.newest()[0] == k
        v = D.view(path)["models"][0]["shards"][0]
        assert v["slots"][other]["valid"] is False and v["newest"] == {"generation": 0, "version": 1}


def test_random_damage_never_crashes(path):
    """Flip random bytes of the superblock, table, index and slot headers: open raises
    MemtierCorruptError or works; view, newest and read_image never raise anything else."""
    arrays = _arrays()
    with D.create(path, "8M") as dev:
        r, plan = _register(dev)
        _put(r, plan, arrays, 1)
        _put(r, plan, arrays, 2)
        hot = [(0, 64), (dev._entry_off(0), 400), (r._e.index_off, r._e.index_len + 4),
               (r._slot_off(0), 96), (r._slot_off(1), 96), (r.image_offset(0), 400)]
    pristine = open(path, "rb").read()
    rng = random.Random(7)
    outcomes = set()
    for _ in range(150):
        data = bytearray(pristine)
        for _ in range(rng.randint(1, 4)):
            off, n = rng.choice(hot)
            data[off + rng.randrange(n)] ^= 1 << rng.randrange(8)
        with open(path, "r+b") as f:
            f.write(data[:1 << 20])
            f.seek(r.region_off)
            f.write(data[r.region_off:r.region_off + r.region_len])
        try:
            with D.open(path, writable=False) as dev:
                for reg in dev.shards():
                    got = reg.newest()
                    if got is not None:
                        reg.read_image(got[0])
                outcomes.add("ok")
        except MemtierCorruptError:
            outcomes.add("corrupt")
        try:
            D.view(path)
        except MemtierCorruptError:
            pass
    assert outcomes == {"ok", "corrupt"}


@pytest.mark.parametrize("dtype", [["float32"], {"a": 1}, None, 3])
def test_index_with_an_unhashable_or_odd_dtype_is_malformed_not_a_crash(dtype):
    """Found by the fuzz campaign: a piece whose dtype was a JSON list raised TypeError
    (unhashable) in the index check instead of being refused as malformed."""
    from deepfreeze.memtier.layout import _index_problem
    idx = {"name": "m", "run": "0123456789abcdef", "rank": 0, "world_size": 1, "data_offset": 4096,
           "file_size": 8192, "standalone": False,
           "tensors": [{"name": "a", "dtype": dtype, "shape": [1], "size": 4, "offset": 4096, "tensor_id": 0,
                        "start": 0, "stop": 1}]}
    assert _index_problem(idx, None) == "piece 0 malformed"
    idx["tensors"][0]["dtype"] = "float32"
    assert _index_problem(idx, None) != "piece 0 malformed"  # the same index with a real dtype passes that check
