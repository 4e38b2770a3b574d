"""The embedded repository (deepfreeze/repo/store.py): real files, a real SQLite database, real processes."""
import os
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.errors import (CorruptCheckpointError, ModelMismatchError, ModelNotFoundError, NameExistsError,
                               RepositoryError)
from deepfreeze.repo.graph import tensor_keys
from deepfreeze.repo.store import EmbeddedRepository, tensor_entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(15)


def arrays(seed=0, n=4, size=1000):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(size + i).astype(np.float32) for i in range(n)}


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def packs(root):
    return sorted(os.listdir(os.path.join(root, "packs")))


def pack_path(repo, name, key):
    return repo._pack_path(next(r[9] for r in repo._rows(name) if r[0] == key))


def blob_range(repo, name, key):
    r = next(r for r in repo._rows(name) if r[0] == key)
    return repo._pack_path(r[9]), r[6], r[7]


@pytest.fixture
def repo(tmp_path):
    with EmbeddedRepository(tmp_path / "repo") as r:
        yield r


# --------------------------------------------------------------------------- round trips


def test_round_trip_bit_exact_every_dtype(repo):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes (installed with TensorFlow)")
    t = {
        "f16": RNG.standard_normal((3, 5)).astype(np.float16),
        "f32": np.array([np.nan, -0.0, np.inf, 1e-45], np.float32),
        "f64": RNG.standard_normal((2, 3, 4)),
        "bf16": RNG.standard_normal(7).astype(ml_dtypes.bfloat16),
        "i8": np.array([-128, 127], np.int8), "i64": np.arange(-5, 5, dtype=np.int64),
        "u16": np.arange(9, dtype=np.uint16), "u64": np.array([2 ** 64 - 1], np.uint64),
        "bool": np.array([[True, False], [False, True]]),
        "c128": np.array([1 + 2j, np.nan * 1j]),
        "scalar": np.array(3.5, np.float64), "scalar_i": np.array(7, np.int32),
        "empty": np.zeros((0, 5), np.float32), "empty0": np.zeros(0, np.uint8),
        "strided": np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],  # not contiguous
        "bigendian": np.arange(6, dtype=">f4"),
    }
    res = repo.put("all@1", t)
    assert res["bytes"] == sum(a.nbytes for a in t.values()) and res["written"] == res["bytes"]
    got = repo.get("all@1")
    assert list(got) == list(t)  # the order they were given
    for k, a in t.items():
        want = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("=")) if not a.dtype.isnative else a
        assert got[k].dtype == want.dtype and got[k].shape == a.shape, k
        assert np.ascontiguousarray(want).tobytes() == got[k].tobytes(), k
    specs = repo.specs("all@1")
    assert specs["scalar"] == ("float64", ()) and specs["empty"] == ("float32", (0, 5))
    assert specs["bf16"] == ("bfloat16", (7,)) and specs["bigendian"] == ("float32", (6,))
    info = repo.info("all@1")
    assert info["bytes"] == res["bytes"] and info["tensors"] == len(t) and info["layers"] is None
    assert abs(info["created"] - time.time()) < 600


def test_unsupported_tensors_refused(repo):
    with pytest.raises(RepositoryError, match="not supported"):
        repo.put("x@1", {"s": np.array(["a", "b"])})
    with pytest.raises(RepositoryError, match="not supported"):
        repo.put("x@1", {"o": np.array([None, 1], dtype=object)})
    with pytest.raises(RepositoryError, match="tensor key"):
        repo.put("x@1", {"": np.zeros(1)})
    with pytest.raises(RepositoryError, match="mapping"):
        repo.put("x@1", [np.zeros(1)])
    assert repo.list() == {} and packs(repo.directory) == []


def test_partial_get_reads_only_those_bytes(repo):
    t = {"a": RNG.standard_normal(1 << 16), "b": RNG.standard_normal(1 << 16).astype(np.float32),
         "c": RNG.integers(0, 100, 50_000, dtype=np.int16), "d": RNG.standard_normal(1 << 15)}
    repo.put("m@1", t)
    repo.bytes_read = 0
    got = repo.get("m@1", ["c"])
    assert list(got) == ["c"] and same_bits(got["c"], t["c"])
    assert repo.bytes_read == t["c"].nbytes
    repo.bytes_read = 0
    got = repo.get("m@1", ["d", "a"])
    assert list(got) == ["d", "a"] and same_bits(got["a"], t["a"]) and same_bits(got["d"], t["d"])
    assert repo.bytes_read == t["a"].nbytes + t["d"].nbytes  # a and d are not adjacent: no gap read
    repo.bytes_read = 0
    repo.get("m@1")
    total = sum(a.nbytes for a in t.values())
    assert total <= repo.bytes_read < total + 64 * len(t)  # adjacent tensors: one call, < 64-byte gaps
    # the bytes of the tensors not asked for are not even looked at: damage one, read the others
    path, off, length = blob_range(repo, "m@1", "b")
    with open(path, "r+b") as f:
        f.seek(off + length // 2)
        byte = f.read(1)
        f.seek(off + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert same_bits(repo.get("m@1", ["a", "c", "d"])["c"], t["c"])
    with pytest.raises(CorruptCheckpointError):
        repo.get("m@1", ["b"])


def test_get_out_fills_in_place(repo):
    t = arrays(1)
    repo.put("m@1", t)
    out = {"t0": np.empty_like(t["t0"]), "t2": np.full_like(t["t2"], 7)}
    ids = {k: id(v) for k, v in out.items()}
    got = repo.get("m@1", out=out)
    assert set(got) == set(t)
    for k in out:
        assert got[k] is out[k] and id(got[k]) == ids[k] and same_bits(out[k], t[k])
    for k in t:
        assert same_bits(got[k], t[k])
    bad = [np.empty(t["t0"].shape, np.float64), np.empty(t["t0"].size + 1, np.float32),
           np.empty(2 * t["t0"].size, np.float32)[::2]]
    ro = np.empty_like(t["t0"])
    ro.flags.writeable = False
    for b in bad + [ro, [0.0] * t["t0"].size]:
        with pytest.raises(ModelMismatchError, match="t0"):
            repo.get("m@1", out={"t0": b})
    with pytest.raises(ModelNotFoundError):
        repo.get("m@1", out={"nope": np.empty(3)})
    with pytest.raises(RepositoryError, match="not among the requested"):
        repo.get("m@1", ["t1"], out={"t0": np.empty_like(t["t0"])})
    with pytest.raises(ModelNotFoundError, match="nope"):
        repo.get("m@1", ["t0", "nope"])


def test_names_write_once_and_never_reused(repo):
    repo.put("net@a", arrays(1))
    repo.put("net@b", arrays(2))
    repo.put("other", arrays(3))
    with pytest.raises(NameExistsError, match="already exists"):
        repo.put("net@a", arrays(4))
    assert same_bits(repo.get("net@a")["t0"], arrays(1)["t0"])  # the loser changed nothing
    assert repo.list() == {"net": ["net@a", "net@b"], "other": ["other"]}
    repo.delete("net@a")
    assert repo.list() == {"net": ["net@b"], "other": ["other"]}
    with pytest.raises(ModelNotFoundError, match="deleted"):
        repo.get("net@a")
    with pytest.raises(ModelNotFoundError):
        repo.delete("net@a")
    with pytest.raises(NameExistsError, match="deleted"):
        repo.put("net@a", arrays(1))
    with pytest.raises(ModelNotFoundError):
        repo.specs("never")
    assert repo.info()["deleted_names"] == 1 and repo.info()["names"] == 2


@pytest.mark.parametrize("name", ["", "../x", "a/b", "..", ".", "a@..", "a@", "@b", "a@b@c", "x" * 201,
                                  "a b", "a\0b", "/etc/passwd", None, 5, "naïve"])
def test_bad_names_refused(repo, name):
    for call in (lambda: repo.put(name, {"a": np.zeros(2)}), lambda: repo.get(name),
                 lambda: repo.delete(name), lambda: repo.graph(name), lambda: repo.specs(name),
                 lambda: repo.info(name) if name is not None else repo.info("a/b")):  # info(None): totals
        with pytest.raises(RepositoryError):
            call()
    assert repo.list() == {} and packs(repo.directory) == []
    assert sorted(set(os.listdir(repo.directory)) - {"meta.db-shm", "meta.db-wal"}) == ["meta.db", "packs", "reserve"]


def test_graph_and_layer_meta(repo):
    ids = [f"{i:032x}" for i in (1, 2, 3)]
    graph = {"scheme": 1, "layers": [{"id": ids[0], "inputs": [], "tensors": 2},
                                     {"id": ids[1], "inputs": [0], "tensors": 0},
                                     {"id": ids[2], "inputs": [0, 1], "tensors": 1}], "outputs": [2]}
    t = {k: RNG.standard_normal(5) for k in tensor_keys(graph)}
    meta = {ids[0]: {"class": "Dense", "config": {"units": 5}}, ids[2]: {"class": "Add"}}
    repo.put("g@1", t, graph=graph, meta=meta)
    assert repo.graph("g@1") == graph and repo.info("g@1")["layers"] == 3
    assert repo.layer_meta([ids[0], ids[1], ids[2], "f" * 32]) == meta
    # layer metadata is write-once: a second store cannot change it
    repo.put("g@2", t, graph=graph, meta={ids[0]: {"class": "Other"}})
    assert repo.layer_meta([ids[0]]) == {ids[0]: meta[ids[0]]}
    assert repo.info()["id_scheme"] == 1
    repo.put("plain", {"x": np.zeros(1)})
    assert repo.graph("plain") is None
    with pytest.raises(RepositoryError, match="do not match the layer graph"):
        repo.put("g@3", {**t, "extra": np.zeros(1)}, graph=graph)
    with pytest.raises(RepositoryError, match="do not match the layer graph"):
        repo.put("g@3", dict(list(t.items())[1:]), graph=graph)
    with pytest.raises(RepositoryError, match="invalid layer graph"):
        repo.put("g@3", t, graph={"scheme": 1, "layers": "x", "outputs": []})
    with pytest.raises(RepositoryError, match="scheme"):
        repo.put("g@3", t, graph={**graph, "scheme": 2})
    with pytest.raises(RepositoryError, match="layer id"):
        repo.put("g@3", t, graph=graph, meta={"../x": {}})
    with pytest.raises(RepositoryError, match="JSON"):
        repo.put("g@3", t, graph=graph, meta={ids[0]: {"x": object()}})
    assert "g@3" not in repo.list()["g"]


def test_settings_first_writer_wins(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as a, EmbeddedRepository(tmp_path / "r") as b:
        assert a.setting("providers") is None
        assert a.set_setting_once("providers", '["h1:1","h2:2"]') == '["h1:1","h2:2"]'
        assert b.set_setting_once("providers", '["other:3"]') == '["h1:1","h2:2"]'
        assert b.setting("providers") == '["h1:1","h2:2"]'
        assert b.info()["providers"] == ["h1:1", "h2:2"]
        assert a.setting("schema_version") == "1" and a.setting("format_version") == str(fmt.FORMAT_VERSION)


def test_directory_rules(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(RepositoryError, match="not empty and not a repository"):
        EmbeddedRepository(tmp_path / "busy")
    assert os.listdir(tmp_path / "busy") == ["notes.txt"]
    with pytest.raises(RepositoryError, match="no repository"):
        EmbeddedRepository(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(RepositoryError, match="not a directory"):
        EmbeddedRepository(tmp_path / "file")
    with EmbeddedRepository(tmp_path / "new") as r:
        assert os.stat(r.directory).st_mode & 0o777 == 0o700
    (tmp_path / "empty").mkdir()
    EmbeddedRepository(tmp_path / "empty").close()
    with EmbeddedRepository(tmp_path / "new", create=False) as r:  # reopening an existing one
        assert r.list() == {}
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "meta.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(RepositoryError, match="damaged or not"):
        EmbeddedRepository(tmp_path / "junk")


def test_threads_share_one_repository(repo):
    errors = []

    def work(i):
        try:
            for j in range(5):
                t = arrays(100 * i + j, n=3, size=200)
                repo.put(f"th{i}@{j}", t)
                got = repo.get(f"th{i}@{j}")
                assert all(same_bits(got[k], t[k]) for k in t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert sum(len(v) for v in repo.list().values()) == 20


# --------------------------------------------------------------------------- damage


def test_flipped_byte_in_a_tensor(repo):
    t = arrays(5)
    repo.put("m@1", t)
    path, off, length = blob_range(repo, "m@1", "t2")
    with open(path, "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=r"'t2'.*'m@1'") as ei:
        repo.get("m@1")
    assert path in str(ei.value)
    assert not same_bits(repo.get("m@1", verify=False)["t2"], t["t2"])  # verify=False: read as is
    assert same_bits(repo.get("m@1", ["t1"])["t1"], t["t1"])
    # de-duplication never shares a damaged copy: the same tensors stored again are written anew
    res = repo.put("m@2", t)
    assert res["written"] == t["t2"].nbytes
    assert same_bits(repo.get("m@2")["t2"], t["t2"])


def test_truncated_pack(repo):
    repo.put("m@1", arrays(6))
    path = pack_path(repo, "m@1", "t0")
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        repo.get("m@1", ["t0"])


def test_damaged_pack_index(repo):
    repo.put("m@1", arrays(7))
    path = pack_path(repo, "m@1", "t0")
    with open(path, "r+b") as f:
        f.seek(80)
        b = f.read(1)
        f.seek(80)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="index checksum"):
        repo.get("m@1", ["t1"])


def test_pack_index_offsets_out_of_bounds(repo):
    """An index whose checksums are right but whose offsets lie outside the file (or overlap
    another tensor) is refused before any read."""
    t = arrays(8)
    repo.put("m@1", t)
    path = pack_path(repo, "m@1", "t0")
    with open(path, "rb") as f:
        idx = fmt.read_index(f, path)
    import dataclasses
    for bad in (dataclasses.replace(idx.entries[1], offset=idx.file_size + 4096),
                dataclasses.replace(idx.entries[1], offset=idx.entries[0].offset)):
        entries = list(idx.entries)
        entries[1] = bad
        head = fmt.encode_index(idx.kind, 0, 1, 0, entries, idx.data_offset, idx.file_size, True, idx.run)
        with open(path, "r+b") as f:
            f.write(head)
        with pytest.raises(CorruptCheckpointError):
            repo.get("m@1", ["t1"])


@pytest.mark.parametrize("column,value,match", [
    ("offset", 10 ** 12, "disagree"), ("length", 10 ** 12, "disagree"), ("offset", -8, "disagree"),
    ("offset", 4096 + 64, "disagree"), ("entry", 99, "entries"), ("entry", -1, "entries"),
    ("n_entries", 3, "disagree"), ("shape", "1000000", "disagree"), ("dtype", "float64", "disagree"),
    ("dtype", "object", "invalid"), ("shape", "-1", "invalid"), ("shape", "x,y", "invalid"),
    ("crc", 12345, "CRC32"),
])
def test_tampered_database_row(repo, column, value, match):
    t = arrays(9)
    repo.put("m@1", t)
    blob = next(r[1] for r in repo._rows("m@1") if r[0] == "t1")
    with sqlite3.connect(os.path.join(repo.directory, "meta.db")) as db:
        db.execute(f"UPDATE blobs SET {column}=? WHERE id=?", (value, blob))
    with pytest.raises(CorruptCheckpointError, match=match):
        repo.get("m@1", ["t1"])
    assert same_bits(repo.get("m@1", ["t0"])["t0"], t["t0"])  # the other rows still work


@pytest.mark.parametrize("file", ["../../../etc/passwd", "/etc/passwd", "x.dfz", "0" * 32 + ".dfz/.."])
def test_tampered_pack_name_in_database(repo, file):
    repo.put("m@1", arrays(10))
    with sqlite3.connect(os.path.join(repo.directory, "meta.db")) as db:
        db.execute("UPDATE packs SET file=?", (file,))
    with pytest.raises(CorruptCheckpointError, match="pack file name"):
        repo.get("m@1")


def test_graph_layer_names_round_trip_and_are_bounded(repo):
    from deepfreeze.repo.graph import MAX_NAME_BYTES, decode_graph, encode_graph
    ids = [f"{i:032x}" for i in (1, 2, 3)]
    plain = {"scheme": 1, "layers": [{"id": ids[0], "inputs": [], "tensors": 1},
                                     {"id": ids[1], "inputs": [0], "tensors": 0},
                                     {"id": ids[2], "inputs": [1], "tensors": 1}], "outputs": [2]}
    named = {**plain, "layers": [{**plain["layers"][0], "name": "enc.0"}, plain["layers"][1],
                                 {**plain["layers"][2], "name": "h\u00e9ad"}]}
    # a graph without names is the bytes it always was (flags 0); names follow the outputs
    assert struct.unpack_from("<4sHHII", encode_graph(plain))[2] == 0
    data = encode_graph(named)
    assert data.startswith(encode_graph(plain)[:4]) and struct.unpack_from("<4sHHII", data)[2] == 1
    assert decode_graph(data) == named and decode_graph(encode_graph(plain)) == plain
    t = {k: RNG.standard_normal(3) for k in tensor_keys(named)}
    repo.put("named@1", t, graph=named)
    assert repo.graph("named@1") == named
    for bad in ("", "a\x00b", "x" * (MAX_NAME_BYTES + 1), "\ud800", 7):
        with pytest.raises(RepositoryError, match="name"):
            encode_graph({**plain, "layers": [{**plain["layers"][0], "name": bad}] + plain["layers"][1:]})
    with pytest.raises(RepositoryError, match="exactly"):
        encode_graph({**plain, "layers": [{**plain["layers"][0], "label": "x"}] + plain["layers"][1:]})
    for cut in (1, 3, 6):   # a truncated names section, and bytes after it
        with pytest.raises(CorruptCheckpointError, match="names|bytes"):
            decode_graph(data[:-cut])
    with pytest.raises(CorruptCheckpointError, match="after the names"):
        decode_graph(data + b"\0")
    with pytest.raises(CorruptCheckpointError, match="newer DeepFreeze"):
        decode_graph(data[:6] + struct.pack("<H", 3) + data[8:])
    long = bytearray(data)   # a name length past the end
    struct.pack_into("<H", long, len(encode_graph(plain)), 60000)
    with pytest.raises(CorruptCheckpointError, match="does not fit"):
        decode_graph(bytes(long))


def test_get_reads_a_shared_blob_once_and_only_the_asked_bytes_cold(tmp_path):
    from experiments.repo import drop_cache, read_bytes
    # on a disk (/var/tmp), not a tmpfs: only a disk's pages can be dropped and read again (a cold read)
    base = "/var/tmp" if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) else str(tmp_path)
    repo = EmbeddedRepository(os.path.join(base, f"dfcold-{os.getpid()}-{time.monotonic_ns()}"))
    try:
        rng = np.random.default_rng(3)
        t = {f"w{i:02d}": rng.standard_normal(1 << 18).astype(np.float32) for i in range(24)}   # 24 x 1 MiB
        t["copy"] = t["w00"].copy()   # equal bytes: one blob under two keys
        repo.put("m", t)
        # cold, the first read of the pack: the first 4 tensors' bytes, not a readahead window past them
        drop_cache(repo.directory)
        b0 = read_bytes()
        got = repo.get("m", [f"w{i:02d}" for i in range(4)])
        asked = sum(a.nbytes for a in got.values())
        assert all(same_bits(got[k], t[k]) for k in got)
        # (+ the database's pages; 2x before, the kernel's readahead past the last tensor)
        assert read_bytes() - b0 <= 1.1 * asked + (256 << 10), (read_bytes() - b0, asked)
        n0 = repo.bytes_read
        got = repo.get("m", ["w00", "copy", "w01"])
        assert same_bits(got["w00"], t["w00"]) and same_bits(got["copy"], t["w00"]) and same_bits(got["w01"], t["w01"])
        assert got["copy"] is not got["w00"] and repo.bytes_read - n0 == 2 * t["w00"].nbytes   # the blob read once
        got["copy"][0] += 1   # two arrays, not views of one
        assert not same_bits(got["copy"], got["w00"])
    finally:
        repo.close()
        shutil.rmtree(repo.directory, ignore_errors=True)


def test_tampered_graph_and_meta_in_database(repo):
    graph = {"scheme": 1, "layers": [{"id": "a" * 32, "inputs": [], "tensors": 1}], "outputs": [0]}
    repo.put("g@1", {"a" * 32 + "/0": np.zeros(3)}, graph=graph, meta={"a" * 32: {"c": 1}})
    with sqlite3.connect(os.path.join(repo.directory, "meta.db")) as db:
        db.execute("UPDATE models SET graph=?", (b"DFG1" + b"\xff" * 40,))
        db.execute("UPDATE layer_meta SET meta=?", ("{not json",))
    with pytest.raises(CorruptCheckpointError, match="graph"):
        repo.graph("g@1")
    with pytest.raises(CorruptCheckpointError, match="JSON"):
        repo.layer_meta(["a" * 32])


# --------------------------------------------------------------------------- processes

WORKER = r'''
import os, sys, time
import numpy as np
from deepfreeze.errors import NameExistsError
from deepfreeze.repo.store import EmbeddedRepository

mode, root, name, seed, flag = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

def data(seed):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(20000 + 7 * i).astype(np.float32) for i in range(5)}

class Paused(EmbeddedRepository):
    """Stops between writing the pack and committing (mode commit) or before the rename (mode write)."""
    def _before_commit(self, name):
        if mode == "commit":
            open(flag + ".ready", "w").close()
            time.sleep(120)
        elif mode == "race":
            open(flag + f".{seed}", "w").close()
            deadline = time.time() + 60
            while not os.path.exists(flag + ".go") and time.time() < deadline:
                time.sleep(0.01)

    def _pwritev_all(self, fd, iovs, offset):
        EmbeddedRepository._pwritev_all(fd, iovs, offset)
        if mode == "write":
            open(flag + ".ready", "w").close()
            time.sleep(120)

if mode == "mixed":
    with EmbeddedRepository(root) as repo:
        for j in range(3):
            t = data(seed * 10 + j)
            repo.put(f"{name}@{j}", t)
            got = repo.get(f"{name}@{j}")
            assert all(got[k].tobytes() == t[k].tobytes() for k in t)
            for other in sorted(n for ns in repo.list().values() for n in ns):
                m, tag = other.split("@")
                want = data(int(m[1:]) * 10 + int(tag))
                got = repo.get(other, ["t3"])
                assert got["t3"].tobytes() == want["t3"].tobytes(), other
    sys.exit(0)
repo = Paused(root)
try:
    repo.put(name, data(seed))
except NameExistsError as e:
    print("LOST", e)
    sys.exit(3)
print("WON")
'''


def spawn(tmp_path, *args):
    script = tmp_path / "worker.py"
    if not script.exists():
        script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path, proc, timeout=60):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"worker exited {proc.returncode}: {proc.communicate()}")
        assert time.time() < deadline, f"worker never reached {path}"
        time.sleep(0.02)


def worker_data(seed):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(20000 + 7 * i).astype(np.float32) for i in range(5)}


@pytest.mark.parametrize("stage", ["write", "commit"])
def test_store_killed_midway_leaves_nothing(tmp_path, stage):
    root = tmp_path / "repo"
    with EmbeddedRepository(root) as repo:
        repo.put("kept", worker_data(1))
        before = packs(root)
        flag = tmp_path / "flag"
        p = spawn(tmp_path, stage, root, "victim@1", 2, flag)
        wait_for(f"{flag}.ready", p)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert repo.list() == {"kept": ["kept"]}
        with pytest.raises(ModelNotFoundError):
            repo.get("victim@1")
        orphans = sorted(set(packs(root)) - set(before))
        assert len(orphans) == 1 and orphans[0].startswith("tmp-" if stage == "write" else "")
        assert repo.gc()["orphans_removed"] == 0  # within the grace period: maybe a store still running
        assert packs(root) == sorted(before + orphans)
        size = os.path.getsize(root / "packs" / orphans[0])
        res = repo.gc(grace=0)
        assert res["orphans_removed"] == 1 and res["freed" if stage == "write" else "quarantined"] == size
        assert packs(root) == before
        # the name was never taken; the repository works
        repo.put("victim@1", worker_data(2))
        got = repo.get("victim@1")
        assert all(same_bits(got[k], v) for k, v in worker_data(2).items())
        assert all(same_bits(repo.get("kept")[k], v) for k, v in worker_data(1).items())


def test_two_processes_store_one_name_exactly_one_wins(tmp_path):
    root = tmp_path / "repo"
    EmbeddedRepository(root).close()
    flag = tmp_path / "flag"
    procs = [spawn(tmp_path, "race", root, "same@1", seed, flag) for seed in (11, 12)]
    for seed, p in zip((11, 12), procs):
        wait_for(f"{flag}.{seed}", p)
    assert len(packs(root)) == 2  # both wrote their pack and wait to commit
    open(f"{flag}.go", "w").close()
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 3], outs
    winner = (11, 12)[[p.returncode for p in procs].index(0)]
    loser_out = outs[[p.returncode for p in procs].index(3)][0]
    assert "already exists" in loser_out
    with EmbeddedRepository(root) as repo:
        assert repo.list() == {"same": ["same@1"]}
        got = repo.get("same@1")
        assert all(same_bits(got[k], v) for k, v in worker_data(winner).items())
        assert len(packs(root)) == 1  # the loser left nothing behind
        assert repo.gc(grace=0)["freed"] == 0


def test_four_processes_store_and_load_concurrently(tmp_path):
    root = tmp_path / "repo"
    EmbeddedRepository(root).close()
    procs = [spawn(tmp_path, "mixed", root, f"w{i}", i, "-") for i in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    with EmbeddedRepository(root) as repo:
        assert sorted(repo.list()) == [f"w{i}" for i in range(4)]
        for i in range(4):
            for j in range(3):
                got = repo.get(f"w{i}@{j}")
                assert all(same_bits(got[k], v) for k, v in worker_data(i * 10 + j).items())


# --------------------------------------------------------------------------- de-duplication, gc


def crc_collision():
    """Two different 8-byte values with the same CRC32 (birthday search, ~2**16 tries)."""
    seen = {}
    rng = np.random.default_rng(0)
    for v in rng.integers(0, 2 ** 63, 1 << 20, dtype=np.int64):
        b = struct.pack("<q", v)
        c = zlib.crc32(b)
        if c in seen and seen[c] != b:
            return np.frombuffer(seen[c], np.int64).copy(), np.frombuffer(b, np.int64).copy()
        seen[c] = b
    raise AssertionError("no collision found")


def test_dedup_is_confirmed_byte_for_byte(repo):
    a, b = crc_collision()
    assert fmt.crc32(a) == fmt.crc32(b) and a.tobytes() != b.tobytes()
    repo.put("c@1", {"x": a})
    res = repo.put("c@2", {"x": b})  # same CRC32, dtype and shape: only the bytes differ
    assert res["written"] == 8 and res["deduplicated"] == 0
    assert same_bits(repo.get("c@1")["x"], a) and same_bits(repo.get("c@2")["x"], b)


def test_dedup_shares_blobs_and_refcounts(repo):
    root = repo.directory
    t = arrays(20, n=5, size=50_000)
    total = sum(a.nbytes for a in t.values())
    assert repo.put("a@1", t) == {"bytes": total, "written": total, "deduplicated": 0}
    n_packs = len(packs(root))
    res = repo.put("b@1", t)
    assert res == {"bytes": total, "written": 0, "deduplicated": total}
    assert len(packs(root)) == n_packs  # no new pack at all
    half = dict(t, t0=np.zeros_like(t["t0"]))
    res = repo.put("c@1", half)
    assert res["written"] == t["t0"].nbytes and res["deduplicated"] == total - t["t0"].nbytes
    info = repo.info()
    assert info["logical_bytes"] == 3 * total and info["stored_bytes"] == total + t["t0"].nbytes
    assert info["savings"] == 2 * total - t["t0"].nbytes
    assert repo.info("b@1")["deduplicated"] == total
    twins = repo.put("twins", {"x": t["t1"], "y": t["t1"].copy(), "z": np.ones(3)})  # within one put
    assert twins["written"] == 24 and twins["deduplicated"] == t["t1"].nbytes * 2
    assert repo.delete("a@1") == {"freed": 0, "blobs_removed": 0, "packs_removed": 0}  # all used by b@1
    assert all(same_bits(repo.get("b@1")[k], v) for k, v in t.items())
    assert repo.gc(grace=0)["freed"] == 0
    sizes = sum(os.path.getsize(os.path.join(root, "packs", p)) for p in packs(root))
    freed = 0
    for name in ("b@1", "c@1", "twins"):  # each delete frees the packs only it still used
        freed += repo.delete(name)["freed"]
    assert repo.info()["stored_bytes"] == 0
    assert freed == sizes and freed >= total + t["t0"].nbytes
    assert packs(root) == [] and repo.info()["pack_bytes"] == 0
    assert repo.gc(grace=0)["freed"] == 0
    with pytest.raises(NameExistsError):
        repo.put("b@1", t)


def test_gc_rewrites_a_mostly_dead_pack(repo):
    big = {"big0": RNG.standard_normal(200_000), "big1": RNG.standard_normal(100_000)}
    small = {"s0": RNG.standard_normal(1000).astype(np.float32), "s1": np.arange(77, dtype=np.int16)}
    repo.put("first", {**big, **small})
    old = packs(repo.directory)
    repo.put("keeper", {"k0": small["s0"].copy(), "k1": small["s1"].copy()})  # shares the small ones
    assert packs(repo.directory) == old
    assert repo.delete("first") == {"freed": 0, "blobs_removed": 2, "packs_removed": 0}  # the pack is shared
    old_size = os.path.getsize(os.path.join(repo.directory, "packs", old[0]))
    res = repo.gc(grace=0)
    assert res["packs_rewritten"] == 1 and res["blobs_removed"] == 0
    new = packs(repo.directory)
    assert len(new) == 1 and new != old
    assert res["quarantined"] == old_size and res["freed"] == 0  # the old copy waits in the quarantine
    assert [(e["file"], e["bytes"]) for e in res["quarantine"]] == [(old[0], old_size)]
    got = repo.get("keeper")
    assert same_bits(got["k0"], small["s0"]) and same_bits(got["k1"], small["s1"])
    # the moved blobs still de-duplicate, and a second gc has nothing left to do
    assert repo.put("again", {"x": small["s0"]})["written"] == 0
    assert repo.gc(grace=0) == {"freed": 0, "blobs_removed": 0, "packs_removed": 0, "packs_rewritten": 0,
                                "orphans_removed": 0, "refs_repaired": 0, "warnings": [], "damaged": [],
                                "quarantined": 0, "purged": 0, "quarantine": res["quarantine"]}


# --------------------------------------------------------------------------- import of a DeepFreeze file


def write_dfz(path, tensors, pieces=3):
    """A DeepFreeze-format assembled file with each tensor split into ``pieces`` contiguous pieces."""
    entries, data = [], []
    for tid, a in enumerate(tensors):
        flat = a.reshape(-1)
        cuts = np.linspace(0, flat.size, pieces + 1).astype(int)
        for s, e in zip(cuts[:-1], cuts[1:]):
            entries.append(fmt.Entry(tid, fmt.dtype_name(a.dtype), a.shape, int(s), int(e),
                                     crc=fmt.crc32(flat[s:e])))
            data.append(flat[s:e])
    entries, data_offset, size = fmt.layout(entries, contiguous_tensors=True)
    head = fmt.encode_index(fmt.KIND_ASSEMBLED, 0, 1, 5, entries, data_offset, size, True, "0" * 16)
    with open(path, "wb") as f:
        f.write(head)
        for e, d in zip(entries, data):
            f.seek(e.offset)
            f.write(d.tobytes())
        f.truncate(size)
    return entries


def test_add_pack_imports_without_reserializing(repo, tmp_path):
    ts = [RNG.standard_normal((30, 20)).astype(np.float32), RNG.integers(0, 9, 1000, dtype=np.int64),
          RNG.standard_normal(4)]
    src = str(tmp_path / "model.dfz")
    write_dfz(src, ts)
    mapping = {"w": [0, 1, 2], "b": [3, 4, 5]}  # the third tensor (an optimizer slot, say) is left out
    res = repo.add_pack("imp@1", src, mapping)
    assert res["bytes"] == ts[0].nbytes + ts[1].nbytes and res["how"] == "linked"
    got = repo.get("imp@1")
    assert same_bits(got["w"], ts[0]) and same_bits(got["b"], ts[1])
    new = [p for p in packs(repo.directory)]
    assert len(new) == 1 and os.stat(os.path.join(repo.directory, "packs", new[0])).st_ino == os.stat(src).st_ino
    repo.bytes_read = 0
    assert same_bits(repo.get("imp@1", ["b"])["b"], ts[1]) and repo.bytes_read == ts[1].nbytes
    for bad in ({"w": [0, 2]}, {"w": [1, 2]}, {"w": [0, 1, 2, 3]}, {"w": [2, 1, 0]}, {"w": [0, 1, 99]},
                {"w": []}, {"w": [0, 1, 2], "b": [2, 3, 4, 5]}, {"w": "012"}, {}):
        with pytest.raises(RepositoryError):
            repo.add_pack("imp@2", src, bad)
    assert packs(repo.directory) == new and "imp@2" not in repo.list()["imp"]
    with pytest.raises(NameExistsError):
        repo.add_pack("imp@1", src, mapping)
    res = repo.delete("imp@1")  # the dead pack is unlinked, but the checkpoint keeps its bytes: nothing freed
    assert res["packs_removed"] == 1 and res["freed"] == 0 and os.path.exists(src) and packs(repo.directory) == []
    new = []
    # a damaged source is refused and nothing is stored
    with open(src, "r+b") as f:
        f.seek(os.path.getsize(src) - 5)
        f.write(b"\xff")
    with pytest.raises(CorruptCheckpointError):
        repo.add_pack("imp@3", src, {"x": [6, 7, 8]})
    assert packs(repo.directory) == new


def test_add_pack_refuses_what_is_not_a_deepfreeze_file(repo, tmp_path):
    junk = tmp_path / "junk.dfz"
    junk.write_bytes(b"x" * 5000)
    with pytest.raises(CorruptCheckpointError):
        repo.add_pack("j", str(junk), {"a": [0]})
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        repo.add_pack("j", str(tmp_path / "fifo"), {"a": [0]})
    assert packs(repo.directory) == []


class GcDuringStore(EmbeddedRepository):
    """Runs ``action`` (once) between writing the pack and committing: a concurrent gc."""
    action = None

    def _before_commit(self, name):
        action, GcDuringStore.action = GcDuringStore.action, None
        if action is not None:
            action()


def test_store_retries_when_gc_drops_the_blobs_it_shares(tmp_path):
    t = arrays(30)
    with EmbeddedRepository(tmp_path / "r") as other, GcDuringStore(tmp_path / "r") as repo:
        other.put("a@1", t)

        def drop():
            assert other.delete("a@1")["blobs_removed"] == len(t)
        GcDuringStore.action = drop
        res = repo.put("b@1", t)  # planned to share a@1's blobs; they vanished: stored anew
        assert res["written"] == sum(a.nbytes for a in t.values())
        got = repo.get("b@1")
        assert all(same_bits(got[k], v) for k, v in t.items())
        assert len(packs(repo.directory)) == 1


def test_gc_removing_a_pending_pack_makes_the_store_fail_cleanly(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as other, GcDuringStore(tmp_path / "r") as repo:
        GcDuringStore.action = lambda: other.gc(grace=0)  # a grace period shorter than the store
        with pytest.raises(RepositoryError, match="disappeared"):
            repo.put("x@1", arrays(31))
        assert repo.list() == {} and packs(repo.directory) == []
        repo.put("x@1", arrays(31))
        assert same_bits(repo.get("x@1")["t1"], arrays(31)["t1"])


def test_gc_keeps_a_damaged_pack_and_says_so(repo):
    t = {"small": RNG.standard_normal(1000), "big": RNG.standard_normal(100_000)}
    repo.put("a", t)
    repo.put("c", {"y": t["small"]})  # shares a's small tensor
    repo.delete("a")  # a's pack is now mostly dead: gc would rewrite it
    path, off, _ = blob_range(repo, "c", "y")
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 4]))
    res = repo.gc(grace=0)
    assert res["packs_rewritten"] == 0 and len(res["damaged"]) == 1 and "checksum" in res["damaged"][0]
    assert packs(repo.directory) == [os.path.basename(path)]  # kept; the half-written new pack is gone
    with pytest.raises(CorruptCheckpointError):
        repo.get("c")


def test_tensors_as_a_string_is_refused(repo):
    repo.put("m", arrays(33))
    with pytest.raises(RepositoryError, match="iterable"):
        repo.get("m", "t0")


def test_reads_survive_concurrent_gc_rewrites(tmp_path):
    """A reader thread loads models while gc moves their tensors to new packs and unlinks the old."""
    root = tmp_path / "r"
    smalls = {i: np.random.default_rng(i).standard_normal(2000) for i in range(6)}
    stop = threading.Event()
    errors, loads = [], [0]
    with EmbeddedRepository(root) as repo:
        def reader():
            try:
                while not stop.is_set():
                    for names in repo.list().values():
                        for n in names:
                            if n.startswith("keep"):
                                got = repo.get(n)["s"]
                                assert same_bits(got, smalls[int(n.split("@")[1])])
                                loads[0] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        th = threading.Thread(target=reader)
        th.start()
        try:
            rewritten = 0
            for i in range(6):
                repo.put(f"x@{i}", {"big": np.random.default_rng(100 + i).standard_normal(200_000), "s": smalls[i]})
                repo.put(f"keep@{i}", {"s": smalls[i]})  # shares x@i's pack
                repo.delete(f"x@{i}")
                rewritten += repo.gc(grace=0)["packs_rewritten"]
        finally:
            stop.set()
            th.join()
        assert not errors, errors
        assert rewritten == 6 and loads[0] > 0
        assert len(packs(root)) == 6


def test_fsync_mode(tmp_path):
    with EmbeddedRepository(tmp_path / "r", fsync=True) as repo:
        assert repo._conn().execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        t = arrays(40)
        repo.put("d@1", t)
        assert all(same_bits(repo.get("d@1")[k], v) for k, v in t.items())
    with EmbeddedRepository(tmp_path / "r") as repo:
        assert repo._conn().execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        assert repo._conn().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


class GcAfterLookup(EmbeddedRepository):
    """Runs ``action`` (once) after get() looked the rows up and before it opens the pack."""
    action = None

    def _rows(self, name, keys=None):
        rows = super()._rows(name, keys)
        action, GcAfterLookup.action = GcAfterLookup.action, None
        if action is not None:
            action()
        return rows


def test_get_looks_again_when_gc_moved_the_tensors(tmp_path):
    small = RNG.standard_normal(500)
    with EmbeddedRepository(tmp_path / "r") as other, GcAfterLookup(tmp_path / "r") as repo:
        other.put("x", {"big": RNG.standard_normal(100_000), "s": small})
        other.put("keep", {"s": small})
        other.delete("x")
        old = packs(repo.directory)

        def move():
            assert other.gc(grace=0)["packs_rewritten"] == 1
        GcAfterLookup.action = move
        assert same_bits(repo.get("keep")["s"], small)  # its rows named the old pack, now gone
        assert packs(repo.directory) != old and GcAfterLookup.action is None


class DiskFull(EmbeddedRepository):
    def _pwritev_all(self, fd, iovs, offset):
        EmbeddedRepository._pwritev_all(fd, iovs[:1], offset)  # a part, then the disk is full
        raise OSError(28, "No space left on device")


def test_write_failure_leaves_nothing(tmp_path):
    from deepfreeze.errors import CheckpointWriteError
    with DiskFull(tmp_path / "r") as repo:
        with pytest.raises(CheckpointWriteError, match="nothing was stored") as ei:
            repo.put("x@1", arrays(50))
        assert isinstance(ei.value, OSError) and ei.value.errno == 28
        assert repo.list() == {} and packs(repo.directory) == []
    with EmbeddedRepository(tmp_path / "r") as repo:
        repo.put("x@1", arrays(50))
        assert same_bits(repo.get("x@1")["t3"], arrays(50)["t3"])


def test_missing_pack_is_a_clear_error(repo):
    repo.put("m", arrays(60))
    path = pack_path(repo, "m", "t0")
    os.unlink(path)
    with pytest.raises(CorruptCheckpointError, match="missing") as ei:
        repo.get("m")
    assert path in str(ei.value)


def test_gc_rewrites_an_imported_pack_of_pieces(repo, tmp_path):
    ts = [RNG.standard_normal((10, 10)).astype(np.float32), RNG.standard_normal(50_000), RNG.standard_normal(50_000)]
    src = str(tmp_path / "ckpt.dfz")
    write_dfz(src, ts, pieces=4)
    assert tensor_entries(src) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11]}
    before = open(src, "rb").read()
    repo.add_pack("imp", src, {"w": [0, 1, 2, 3]})  # the two big tensors (optimizer slots) are not taken
    # while the checkpoint's own link exists, a rewrite would only add a copy: gc leaves it
    assert repo.gc(grace=0) == {"freed": 0, "blobs_removed": 0, "packs_removed": 0, "packs_rewritten": 0,
                                "orphans_removed": 0, "refs_repaired": 0, "warnings": [], "damaged": [],
                                "quarantined": 0, "purged": 0, "quarantine": []}
    assert open(src, "rb").read() == before  # the checkpoint file itself is untouched
    os.unlink(src)  # the checkpoint's retention removes it: now the repository's link is the only one
    res = repo.gc(grace=0)
    assert res["packs_rewritten"] == 1 and res["quarantined"] > 2 * ts[1].nbytes
    assert same_bits(repo.get("imp")["w"], ts[0])
    assert repo.put("dup", {"x": ts[0].copy()})["written"] == 0  # its whole-tensor CRC de-duplicates


def test_add_pack_copies_across_file_systems(repo, tmp_path):
    """A file on another file system (/dev/shm, a tmpfs) cannot be hard-linked: it is copied."""
    import tempfile
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(repo.directory).st_dev:
        pytest.skip("needs /dev/shm on another file system than the repository")
    ts = [RNG.standard_normal(3000), RNG.integers(0, 5, 77, dtype=np.int8)]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        src = os.path.join(shm, "other.dfz")
        write_dfz(src, ts, pieces=2)
        res = repo.add_pack("cp", src, {"a": [0, 1], "b": [2, 3]})
    assert res["how"] == "copied"
    (pack,) = packs(repo.directory)
    assert os.path.getsize(os.path.join(repo.directory, "packs", pack)) == res["written"]
    got = repo.get("cp")  # the source is gone: the copy is the repository's own
    assert same_bits(got["a"], ts[0]) and same_bits(got["b"], ts[1])


def test_a_repository_directory_others_may_write_to_is_refused(tmp_path):
    """SQLite opens meta.db and its -wal/-shm/-journal by name after DeepFreeze's lstat check: in
    a directory others may write to, even a sticky one (which the root rule accepts), another
    user could put their own file there in between. Such a repository directory is an
    UnsafePathError naming the mode (issue 41's audit; before, a sticky 1777 directory was used)."""
    from deepfreeze.errors import UnsafePathError
    d = tmp_path / "repo"
    d.mkdir()
    os.chmod(d, 0o1777)
    with pytest.raises(UnsafePathError, match=r"writable by others \(mode 1777\).*SQLite opens meta\.db"):
        EmbeddedRepository(d)
    assert os.listdir(d) == []
    os.chmod(d, 0o700)
    with EmbeddedRepository(d) as r:
        r.put("m@1", arrays())
