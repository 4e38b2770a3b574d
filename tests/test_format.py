import json
import os
import pickle
import struct

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.errors import CorruptCheckpointError
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.shardplan import ShardPlan, TensorSpec

RNG = np.random.default_rng(3)
ARRAYS = [RNG.standard_normal((40, 30)).astype(np.float32), RNG.integers(0, 9, (7,), dtype=np.int64),
          np.array(True), np.zeros((0, 4), np.float16), RNG.standard_normal(1000)]


def plan_for(world=2):
    ts = [TensorSpec(i, f"t{i}", fmt.dtype_name(a.dtype), a.shape) for i, a in enumerate(ARRAYS)]
    return ShardPlan.build(ts, world, min_shard_bytes=256)


def write(tmp_path, rank=0, chksum=True, world=2):
    plan = plan_for(world)
    arrays = [ARRAYS[p.tensor_id].reshape(-1)[p.start:p.stop] for p in plan.for_rank(rank)]
    return plan, ScratchLevel(str(tmp_path)).write_shard("m", 7, rank, plan, arrays, chksum=chksum)


@pytest.mark.parametrize("chksum", [True, False])
def test_round_trip_each_piece_alone(tmp_path, chksum):
    plan, path = write(tmp_path, chksum=chksum)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    with open(path, "rb") as f:
        idx = fmt.read_index(f, path)
        assert (idx.kind, idx.rank, idx.world_size, idx.version, idx.has_crc) == (1, 0, 2, 7, chksum)
        assert idx.data_offset % 4096 == 0
        for e in reversed(idx.entries):  # any order: each entry is read alone
            got = fmt.read_entry(f, e, verify=chksum)
            assert got.tobytes() == ARRAYS[e.tensor_id].reshape(-1)[e.start:e.stop].tobytes()
            assert list(e.shape) == list(ARRAYS[e.tensor_id].shape)


def damage(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_flipped_data_byte_detected(tmp_path):
    plan, path = write(tmp_path)
    with open(path, "rb") as f:
        e = max(fmt.read_index(f).entries, key=lambda e: e.length)
    with open(path, "rb") as f:
        f.seek(e.offset + 5)
        byte = f.read(1)[0]
    damage(path, e.offset + 5, bytes([byte ^ 0xFF]))
    with open(path, "rb") as f:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor"):
            # by tensor id: a zero-length piece may share the damaged piece's offset
            fmt.read_entry(f, next(x for x in fmt.read_index(f, path).entries if x.tensor_id == e.tensor_id))


@pytest.mark.parametrize("how, needle", [
    ("magic", "wrong magic"),
    ("header", "header checksum"),
    ("index", "index checksum"),
    ("truncate", "truncated or padded"),
    ("empty", "shorter than"),
    ("pickle", "wrong magic"),
])
def test_corrupt_files_rejected(tmp_path, how, needle):
    plan, path = write(tmp_path)
    if how == "magic":
        damage(path, 0, b"X")
    elif how == "header":
        damage(path, 20, b"\x01")
    elif how == "index":
        damage(path, 80, b"\x7f")
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) - 1)
    elif how == "empty":
        os.truncate(path, 10)
    elif how == "pickle":
        class Boom:
            def __reduce__(self):
                return (os.system, ("touch " + str(tmp_path / "pwned"),))
        with open(path, "wb") as f:
            f.write(pickle.dumps(Boom()) + b"\0" * 100)
    with open(path, "rb") as f:
        with pytest.raises(CorruptCheckpointError, match=needle):
            fmt.read_index(f, path)
    assert not (tmp_path / "pwned").exists()


def forged(entries_raw, n=None, data_offset=4096, file_size=8192, index_bytes=None):
    """A file with a valid header/index checksum but hostile contents."""
    index = b"".join(entries_raw)
    head = struct.pack("<8sHHIIIQIIQQII", fmt.MAGIC, 1, 1, 0, 0, 1, 1, len(entries_raw) if n is None else n,
                       len(index) if index_bytes is None else index_bytes, data_offset, file_size,
                       fmt.crc32(index), 0)
    head = head[:-4] + struct.pack("<I", fmt.crc32(head[:-4]))
    body = head + index
    return body + b"\0" * (file_size - len(body))


def entry(tid=0, code=1, ndim=1, start=0, stop=4, off=4096, length=16, shape=(4,)):
    return struct.pack("<IBBHQQQQII", tid, code, ndim, 0, start, stop, off, length, 0, 0) + \
        struct.pack(f"<{len(shape)}Q", *shape)


@pytest.mark.parametrize("raw, needle", [
    (forged([entry(off=8190)]), "do not fit"),                     # runs past the end
    (forged([entry(length=1 << 62)]), "do not fit"),               # oversized length
    (forged([entry(stop=5)]), "do not fit"),                       # range beyond the shape
    (forged([entry(off=10)]), "do not fit"),                       # inside the header
    (forged([entry(code=99)]), "dtype code"),                      # unknown dtype
    (forged([entry(shape=(1 << 60,), stop=4)]), "absurd shape"),   # shape overflow
    (forged([entry()], n=1 << 30), "impossible"),                  # absurd entry count
    (forged([entry()], data_offset=1 << 40), "data offset"),       # data offset outside
])
def test_hostile_index_rejected(tmp_path, raw, needle):
    path = tmp_path / "evil.dfs"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        with pytest.raises(CorruptCheckpointError, match=needle):
            fmt.read_index(f, str(path))


def test_manifest_validation():
    good = {"format": "deepfreeze-manifest", "format_version": 1, "name": "m", "version": 1, "step": 1,
            "epoch": 0, "world_size": 1, "tensors": [{"id": 0, "name": "a", "dtype": "float32", "shape": [2]}],
            "plan": {}, "shards": [{"rank": 0, "file": "r000000.dfs"}]}
    assert fmt.decode_manifest(json.dumps(good).encode())["name"] == "m"
    for bad in [dict(good, format="x"), dict(good, shards=[{"rank": 0, "file": "../../etc/passwd"}]),
                dict(good, assembled={"file": "/abs/model.dfz"}), dict(good, version="1"),
                dict(good, tensors=[{"id": 0, "name": "a", "dtype": "object", "shape": [2]}]),
                dict(good, tensors=[{"id": 0, "name": "a", "dtype": "float32", "shape": [-2]}])]:
        with pytest.raises(CorruptCheckpointError):
            fmt.decode_manifest(json.dumps(bad).encode())
    with pytest.raises(CorruptCheckpointError, match="not JSON"):
        fmt.decode_manifest(pickle.dumps(good))


def test_bfloat16_round_trip(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.arange(1000, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(10, 100)
    plan = ShardPlan.build([TensorSpec(0, "bf", "bfloat16", a.shape)], 2, min_shard_bytes=0)
    level = ScratchLevel(str(tmp_path))
    for r in range(2):
        p = plan.for_rank(r)[0]
        path = level.write_shard("m", 1, r, plan, [a.reshape(-1)[p.start:p.stop]], chksum=True)
        with open(path, "rb") as f:
            e = fmt.read_index(f).entries[0]
            assert fmt.read_entry(f, e).tobytes() == a.reshape(-1)[p.start:p.stop].tobytes()


def test_crc_record_round_trip_and_refusals():
    """A rank's piece CRCs travel and are kept as one base64 record, decoded and checked once:
    exactly the count the plan gives, nothing else (a list, another count, a character outside the
    alphabet, missing padding) is a record."""
    from deepfreeze.format import crc_record_ok, decode_crcs, encode_crcs
    crcs = [0, 1, 0xFFFFFFFF, 123456789, 77]
    text = encode_crcs(crcs)
    assert crc_record_ok(text) and decode_crcs(text, 5).tolist() == crcs
    assert encode_crcs([]) == "" and decode_crcs("", 0).tolist() == []
    assert decode_crcs(text, 4) is None and decode_crcs(text, 6) is None
    assert decode_crcs([[0, 0, 1]], 1) is None and not crc_record_ok([[0, 0, 1]])
    bad = text[:-2] + "!="
    assert not crc_record_ok(bad) and decode_crcs(bad, 5) is None
    assert not crc_record_ok(text[:-1]) and decode_crcs(text[:-1], 5) is None
    assert not crc_record_ok(encode_crcs([1] * 10), max_count=9)
