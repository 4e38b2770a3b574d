"""Standalone memory-tier API (deepfreeze/memtier/api.py) and dump (dump.py): bit-exact round
trips, kill -9 in the middle of a slot write (a real process, slowed by the test hook), full
device at registration, whole multi-rank models, view never trusting ACTIVE, dump refusals."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.format import build_manifest
from deepfreeze.errors import CheckpointNotFoundError, MemtierError, MemtierFullError
from deepfreeze.memtier import api
from deepfreeze.memtier import device as D
from deepfreeze.memtier import layout as mlayout
from deepfreeze.memtier.copy import LocalCopier
from deepfreeze.memtier.dumper import dump
from deepfreeze.lease import RunInfo, Version, new_run_id
from deepfreeze.shardplan import ShardPlan, TensorSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def path():
    p = f"/dev/shm/dftest-h1api-{os.getpid()}-{random.getrandbits(32):08x}.dev"
    yield p
    if os.path.lexists(p):
        os.unlink(p)


def _small(seed, n=300):
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.float64, np.int32, np.int64, np.float16, np.uint8, np.bool_, np.int8, np.complex64]
    out = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        shape = [(), (1,), (i % 17 + 1,), (3, i % 5 + 1), (2, 2, i % 3 + 1), (0, 4)][i % 6]
        a = rng.integers(-100, 100, size=shape).astype(dt) if dt != np.float64 else rng.standard_normal(shape)
        out[f"layer{i // 2}/w{i % 2}"] = a
    return out


def _plus(arrays: dict, v: int) -> dict:
    """Another version of ``arrays``: same dtypes and shapes, bytes changed (v added to every byte;
    bools flipped when v is odd)."""
    out = {}
    for k, a in arrays.items():
        b = np.array(a, copy=True)
        flat = b.reshape(-1).view(np.uint8)
        if b.dtype == np.bool_:
            flat ^= np.uint8(v & 1)
        else:
            flat += np.uint8(v % 256)
        out[k] = b
    return out


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                      and a[k].tobytes() == b[k].tobytes() for k in a)


def test_round_trip_300_small_and_one_300mb(path):
    arrays = _small(1)
    rng = np.random.default_rng(2)
    arrays["huge"] = rng.integers(0, 1 << 32, size=75_000_000, dtype=np.uint32).view(np.float32)  # 300 MB
    with D.create(path, "700M") as dev:
        with api.register(dev, "big", arrays) as model:
            assert api.checkpoint(model, arrays, 1) == Version(0, 1)
            arrays["huge"].view(np.uint32)[::1000] += 1  # a second version that differs
            arrays["layer0/w0"] = _plus({"x": arrays["layer0/w0"]}, 1)["x"]
            assert model.checkpoint(arrays, 2) == Version(0, 2)
        got, v = api.restore(dev, "big")
        assert v == Version(0, 2) and _same(got, arrays)
        # in place: the caller's arrays are filled (one copy), the dict keeps them
        out = {k: np.zeros_like(a) for k, a in arrays.items()}
        before = {k: a.ctypes.data for k, a in out.items()}
        got2, v2 = api.restore(path, "big", out=out)
        assert v2 == v and all(got2[k] is out[k] and out[k].ctypes.data == before[k] for k in out)
        assert _same(out, arrays)
        del got, got2, out


def test_checkpoint_checks_arrays_and_versions(path):
    arrays = _small(3, n=10)
    with D.create(path, "16M") as dev, api.register(dev, "m", arrays) as model:
        api.checkpoint(model, arrays, 5)
        with pytest.raises(ValueError, match="not newer"):
            api.checkpoint(model, arrays, 5)
        api.checkpoint(model, arrays, 1, generation=1)  # a new generation restarts the numbers
        with pytest.raises(ValueError, match="registered"):
            api.checkpoint(model, {**arrays, "layer0/w0": arrays["layer0/w0"].astype(np.float64)}, 9)
        with pytest.raises(ValueError, match="missing"):
            api.checkpoint(model, {k: arrays[k] for k in list(arrays)[1:]}, 9)
        api.checkpoint(model, list(arrays.values()), 2, generation=1)  # positional order works too
        got, v = api.restore(dev, "m")
        assert v == Version(1, 2) and _same(got, arrays)
        assert api.restore(dev, "m", version=1)[1] == Version(1, 1)  # two slots: v5 was overwritten
        assert api.restore(dev, "m", version=Version(1, 1))[1] == Version(1, 1)
        with pytest.raises(CheckpointNotFoundError, match="version 5"):
            api.restore(dev, "m", version=5)
    with pytest.raises(CheckpointNotFoundError):
        api.restore(path, "nobody")


def test_full_device_is_refused_at_registration(path):
    with D.create(path, "4M") as dev:
        with pytest.raises(MemtierFullError, match="needs"):
            api.register(dev, "m", {"w": np.zeros(2 << 20, np.float32)})
        with pytest.raises(MemtierFullError, match="needs"):  # given as (name, dtype, shape): nothing allocated
            api.register(dev, "m", [("w", "float32", (1 << 30,))])
        assert dev.shards() == []


VICTIM = textwrap.dedent("""
    import sys, numpy as np
    from deepfreeze.memtier import api, device

    def make(v):
        rng = np.random.default_rng(11)
        return {"small/a": rng.standard_normal((37, 3)).astype(np.float32) + v,
                "big": (rng.integers(0, 1 << 30, 10 << 20, dtype=np.int32) + v)}  # 40 MB: 10 chunks

    if __name__ == "__main__":
        dev = device.open(sys.argv[1])
        model = api.register(dev, "victim", make(0))
        api.checkpoint(model, make(1), 1)
        print("v1", flush=True)
        api.checkpoint(model, make(2), 2)  # killed in the middle (each 4 MiB chunk sleeps)
        print("v2", flush=True)
""")


def test_kill_9_in_the_middle_of_a_slot_write(path, tmp_path):
    D.create(path, "128M").close()
    script = tmp_path / "victim.py"
    script.write_text(VICTIM)
    env = dict(os.environ, DEEPFREEZE_MEMTIER_COPY_DELAY="0.1", PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, str(script), path], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "v1"
        # the kill lands in v2's copy (>= 1 s of sleeps): sent once its slot is being written (a fixed
        # 0.3 s after v1 came before the copy began on a loaded machine, still making v2's arrays)
        deadline = time.monotonic() + 60
        while not any(s["state"] == "ACTIVE" for s in api.view(path)["models"][0]["shards"][0]["slots"]):
            assert time.monotonic() < deadline and proc.poll() is None, "v2's copy never began"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert proc.stdout.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    ns: dict = {}
    exec(compile(VICTIM, "victim", "exec"), ns)
    v = api.view(path)
    (model,) = v["models"]
    slots = model["shards"][0]["slots"]
    assert sorted(s["state"] for s in slots) == ["ACTIVE", "DONE"]
    active = next(s for s in slots if s["state"] == "ACTIVE")
    assert active["valid"] is False and active["version"] == 2
    assert model["shards"][0]["newest"] == {"generation": 0, "version": 1}
    got, ver = api.restore(path, "victim")
    assert ver == Version(0, 1) and _same(got, ns["make"](1))
    with pytest.raises(MemtierError, match="ACTIVE"):
        dump(path, "victim", str(tmp_path / "x.npz"))
    with D.open(path) as dev:
        free0 = dev.free_bytes()
        got = dev.repack()  # the owner is dead: not live
        assert got["moved"] == 1 and got["freed_bytes"] > 0 and dev.free_bytes() == free0 + got["freed_bytes"]
    v = api.view(path)
    slots = v["models"][0]["shards"][0]["slots"]
    assert [(s["state"], s["version"], s["valid"]) for s in slots] == [("DONE", 1, True)]
    got, ver = api.restore(path, "victim")
    assert ver == Version(0, 1) and _same(got, ns["make"](1))


def test_view_never_trusts_active(path):
    """An ACTIVE slot holding a complete, checksummed image of a newer version (the crash hit just
    before the DONE header) is neither shown valid nor restored nor dumped."""
    arrays = _small(4, n=6)
    with D.create(path, "16M") as dev:
        model = api.register(dev, "m", arrays)
        api.checkpoint(model, arrays, 1)
        api.checkpoint(model, _plus(arrays, 1), 2)
        r = model.region
        k2, h2 = r.newest()
        raw = D._slot_header_bytes(mlayout.SlotState.ACTIVE, r.run, Version(0, 3), h2.meta_len, h2.image_len, 0, 0.0)
        dev.mm[r._slot_off(k2):r._slot_off(k2) + len(raw)] = raw  # v2's full image, header ACTIVE(v3)
        assert r.verify_slot(k2) == "not DONE"
        (shard,) = api.view(path)["models"][0]["shards"]
        assert [s["valid"] for s in shard["slots"]][k2] is False and shard["newest"]["version"] == 1
        got, v = api.restore(dev, "m")
        assert v == Version(0, 1) and _same(got, arrays)
        model.close()


def _engine_model(dev, arrays, world, versions, *, ranks=None):
    """Register an engine-like model (world ranks of one run) and write ``versions`` on each rank."""
    plan = ShardPlan.build([TensorSpec(i, n, fmt.dtype_name(a.dtype), a.shape) for i, (n, a) in
                            enumerate(arrays.items())], world, min_shard_bytes=256)
    run = new_run_id()
    regions = []
    for rank in ranks if ranks is not None else range(world):
        idx = mlayout.make_index(plan, rank, "eng", run, lease={"persistent": "/nonexistent/p", "timeout": 60})
        cap = mlayout.manifest_capacity(len(plan.tensors), len(plan.pieces), world)
        regions.append(dev.register_shard("eng", run, rank, world, index=idx, image_size=idx["file_size"],
                                          meta_cap=cap))
    for v in versions:
        for r in regions:
            data = {n: a + v for n, a in arrays.items()}
            pieces = plan.for_rank(r.rank)
            flat = [np.ascontiguousarray(data[plan.tensors[p.tensor_id].name]).reshape(-1)[p.start:p.stop]
                    for p in pieces]
            w = r.begin(r.choose_slot(), Version(0, v))
            st = LocalCopier().copy_in([(a.ctypes.data, a.nbytes) for a in flat], w.data, w.spans,
                                       dest_offsets=[e.offset - r.data_offset for e in r.entries])
            w.finish(st.crcs, build_manifest("eng", v, v, 0, plan, ["h"] * world, run=RunInfo(run)))
            w.release()
    return regions


def test_whole_multi_rank_model_restores_and_missing_ranks_are_named(path, tmp_path):
    rng = np.random.default_rng(5)
    arrays = {f"l{i}/k": rng.standard_normal((64, i + 8)).astype(np.float32) for i in range(6)}
    arrays["bias"] = np.arange(7, dtype=np.int64)
    with D.create(path, "32M") as dev:
        regions = _engine_model(dev, arrays, 3, [1, 2, 3])
        assert sum(len(r.entries) for r in regions) > len(arrays)  # really split across ranks
        got, v = api.restore(dev, "eng")
        assert v == Version(0, 3) and _same(got, {n: a + 3 for n, a in arrays.items()})
        # rank 2's newest slot damaged: version 3 is incomplete, version 2 is whole everywhere
        r2 = regions[2]
        k, _ = r2.newest()
        dev.mm[r2.image_offset(k) + r2.entries[0].offset] ^= 0x40
        got, v = api.restore(dev, "eng")
        assert v == Version(0, 2) and _same(got, {n: a + 2 for n, a in arrays.items()})
        out = dump(dev, "eng", str(tmp_path / "e.npz"), version=2)
        assert out["verified"] and out["version"] == "v2"
        with pytest.raises(MemtierError, match="damaged"):
            dump(dev, "eng", str(tmp_path / "e2.npz"))
        dev.retire(regions[1])
        with pytest.raises(CheckpointNotFoundError, match="ranks 1 of 3"):
            api.restore(dev, "eng")
        with pytest.raises(MemtierError, match="ranks 1 are not on.*deepfreeze export"):
            dump(dev, "eng", str(tmp_path / "e3.npz"))
    with D.create(path, "32M", force=True) as dev:  # only ranks 0 and 1 of 4 on this node
        _engine_model(dev, arrays, 4, [1], ranks=[0, 1])
        with pytest.raises(MemtierError, match="ranks 2-3 are not on"):
            dump(dev, "eng", str(tmp_path / "e4.npz"), force=True)


def test_dump_formats_and_refusals(path, tmp_path):
    arrays = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
              "dense/bias": np.array([1.5, -2.0, 3.25], np.float32), "step": np.array(7, np.int64)}
    with D.create(path, "16M") as dev:
        model = api.register(dev, "m", arrays)
        api.checkpoint(model, arrays, 1)
        newer = _plus(arrays, 1)
        api.checkpoint(model, newer, 2)
        out = dump(dev, "m", str(tmp_path / "m.npz"))
        assert out["verified"] and out["version"] == "v2" and out["tensors"] == 3
        with np.load(tmp_path / "m.npz", allow_pickle=False) as z:
            assert _same({k: z[k] for k in arrays}, newer)
        with zipfile.ZipFile(tmp_path / "m.npz") as zf:
            assert sorted(zf.namelist()) == sorted(k + ".npy" for k in arrays)
        if importlib.util.find_spec("safetensors") is not None:  # (the numpy-2 run of the core may lack it)
            dump(dev, "m", str(tmp_path / "m.safetensors"))
            raw = (tmp_path / "m.safetensors").read_bytes()
            n = int.from_bytes(raw[:8], "little")
            head = json.loads(raw[8:8 + n])
            for k, a in newer.items():
                s, e = head[k]["data_offsets"]
                assert raw[8 + n + s:8 + n + e] == a.tobytes() and head[k]["shape"] == list(a.shape)
            assert head["__metadata__"]["version"] == "v2"
        with pytest.raises(Exception, match="exists"):
            dump(dev, "m", str(tmp_path / "m.npz"))
        dump(dev, "m", str(tmp_path / "m.npz"), version=1, overwrite=True)
        with np.load(tmp_path / "m.npz", allow_pickle=False) as z:
            assert _same({k: z[k] for k in arrays}, arrays)
        # the next version crashed mid-write: refused, unless forced or an older one is asked for
        r = model.region
        w = r.begin(r.choose_slot(), Version(0, 3))
        w.data[:] = bytes(len(w.data))
        w.release()
        with pytest.raises(MemtierError, match=r"v3 is not complete and DONE.*ACTIVE.*version=2"):
            dump(dev, "m", str(tmp_path / "a.npz"))
        assert not (tmp_path / "a.npz").exists()
        forced = dump(dev, "m", str(tmp_path / "a.npz"), force=True)
        assert forced["verified"] is False and forced["version"] == "v3"
        with np.load(tmp_path / "a.npz", allow_pickle=False) as z:
            assert (z["dense/kernel"] == 0).all()
        assert dump(dev, "m", str(tmp_path / "b.npz"), version=2)["verified"]
        # a torn header might hide a newer version: refused unless a version is given
        dev.mm[r._slot_off(0) + 30] ^= 1
        with pytest.raises(MemtierError, match="checksum"):
            dump(dev, "m", str(tmp_path / "c.npz"))
        with pytest.raises(CheckpointNotFoundError):
            dump(dev, "nothere", str(tmp_path / "d.npz"))
        with pytest.raises(Exception, match="format"):
            dump(dev, "m", str(tmp_path / "d.txt"))
        model.close()


def test_dump_h5_layout(path, tmp_path):
    h5py = pytest.importorskip("h5py")
    arrays = {"dense/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
              "dense/bias": np.array([1.5, -2.0, 3.25], np.float32)}
    with D.create(path, "16M") as dev, api.register(dev, "m", arrays) as model:
        api.checkpoint(model, arrays, 1)
        dump(dev, "m", str(tmp_path / "m.h5"))
    with h5py.File(tmp_path / "m.h5", "r") as f:
        def text(xs):
            return [x.decode() if isinstance(x, bytes) else str(x) for x in xs]
        assert text(f.attrs["layer_names"]) == ["dense"]
        assert text(f["dense"].attrs["weight_names"]) == ["dense/kernel:0", "dense/bias:0"]
        assert f["dense/dense/kernel:0"][...].tobytes() == arrays["dense/kernel"].tobytes()
        assert f["dense/dense/bias:0"][...].tobytes() == arrays["dense/bias"].tobytes()


def test_closed_model_is_compacted_live_one_is_not(path):
    arrays = _small(6, n=4)
    with D.create(path, "16M") as dev:
        a = api.register(dev, "a", arrays)
        b = api.register(dev, "b", arrays)
        for m in (a, b):
            api.checkpoint(m, arrays, 1)
            api.checkpoint(m, arrays, 2)
        a.close()
        got = dev.repack()
        assert got["moved"] == 1
        assert [r.nslots for r in dev.find("a")] == [1] and [r.nslots for r in dev.find("b")] == [2]
        assert _same(api.restore(dev, "a")[0], arrays)
        with pytest.raises(MemtierError, match="closed"):
            api.checkpoint(a, arrays, 3)
        b.close()
