"""``deepfreeze memtier`` (create, view, dump, repack), run for real as subprocesses on real devices:
models put in by the standalone API (:mod:`deepfreeze.memtier.api`), dumps compared bit-exact
with the recorded arrays, an .h5 dump loaded by Keras ``model.load_weights``, an ACTIVE slot left
by an interrupted write (a real ``begin`` without ``finish``) refused, and repack freeing it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepfreeze.memtier import api
from deepfreeze.memtier import device as mdev
from deepfreeze.lease import Version

from _util import ROOT
from test_cli import read_safetensors

MiB = 1 << 20


def cli(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "deepfreeze", "memtier", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def state(seed, n=3):
    rng = np.random.default_rng(seed)
    return {"dense/kernel": rng.standard_normal((64, 32)).astype(np.float32),
            "dense/bias": rng.standard_normal(32).astype(np.float32),
            "emb/embeddings": rng.integers(-2 ** 31, 2 ** 31, (n * 100, 8), dtype=np.int64),
            "scale": np.array(seed * 1.5, np.float64)}


def filled(path, name="mlp", versions=(1, 2, 3)):
    """A device holding ``name`` with ``versions`` checkpointed (slots keep the newest two); the
    recorded arrays of every version."""
    dev = mdev.create(path, 16 * MiB, force=True)
    recorded = {}
    model = api.register(dev, name, state(0))
    for step in versions:
        recorded[step] = state(step)
        api.checkpoint(model, recorded[step], step)
    return dev, model, recorded


def test_create_sizes_and_errors(tmp_path):
    path = str(tmp_path / "a.tier")
    p = cli("create", path, "--size", "8M")
    assert p.returncode == 0, p.stderr
    assert os.path.getsize(path) == 8 * MiB and os.stat(path).st_mode & 0o777 == 0o600
    assert "created" in p.stdout and path in p.stdout
    p = cli("create", path, "--size", "8M")  # exists
    assert p.returncode == 1 and "already exists" in p.stderr and "--force" in p.stderr
    p = cli("create", path, "--size", "1.5MiB", "--force", "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["size"] == 1536 * 1024 == os.path.getsize(path) and 0 < info["free"] < info["size"]
    for bad in ("8X", "-3M", "0", "M"):
        p = cli("create", str(tmp_path / "b.tier"), "--size", bad)
        assert p.returncode == 2 and "--size" in p.stderr and "Traceback" not in p.stderr, (bad, p.stderr)
    p = cli("create", str(tmp_path / "b.tier"), "--size", "4K")  # smaller than superblock + table
    assert p.returncode == 2 and "too small" in p.stderr and not (tmp_path / "b.tier").exists()


def test_create_beyond_memory_on_tmpfs_is_refused():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/dftest-{os.getpid()}-huge.tier"
    p = cli("create", path, "--size", "64T")
    assert p.returncode == 1, p.stderr
    assert "64" in p.stderr or "bytes" in p.stderr
    assert "smaller --size" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(path)


def test_view_text_and_json(tmp_path):
    path = str(tmp_path / "v.tier")
    dev, model, _ = filled(path)
    try:
        p = cli("view", path, "--json")
        assert p.returncode == 0, p.stderr
        info = json.loads(p.stdout)
        assert info["size"] == 16 * MiB and info["free"] == dev.free_bytes()
        (m,) = info["models"]
        assert m["name"] == "mlp" and m["standalone"] and not m["finished"] and m["world_size"] == 1
        (sh,) = m["shards"]
        assert sh["newest"]["version"] == 3
        assert sorted((s["version"], s["state"], s["valid"]) for s in sh["slots"]) == [(2, "DONE", True),
                                                                                      (3, "DONE", True)]
        p = cli("view", path)
        assert p.returncode == 0, p.stderr
        assert "mlp" in p.stdout and "v3" in p.stdout and "v2" in p.stdout and "DONE" in p.stdout
        assert "free" in p.stdout
        # an interrupted write: the oldest DONE slot goes ACTIVE (v4) and is never finished
        region = model.region
        k = region.choose_slot()
        w = region.begin(k, Version(0, 4))
        w.data[:16] = b"\xff" * 16
        info = json.loads(cli("view", path, "--json").stdout)
        slots = info["models"][0]["shards"][0]["slots"]
        active = [s for s in slots if s["state"] == "ACTIVE"]
        assert len(active) == 1 and not active[0]["valid"] and active[0]["version"] == 4
        assert info["models"][0]["shards"][0]["newest"]["version"] == 3  # ACTIVE is never trusted
        p = cli("view", path)
        assert "ACTIVE" in p.stdout and "v4" in p.stdout
        w.release()
    finally:
        model.close()
        dev.close()


def test_view_refuses_what_is_not_a_device(tmp_path):
    bad = tmp_path / "junk.tier"
    bad.write_bytes(os.urandom(64 * 1024))
    p = cli("view", str(bad))
    assert p.returncode == 1 and "Traceback" not in p.stderr and str(bad) in p.stderr
    p = cli("view", str(tmp_path / "missing.tier"))
    assert p.returncode == 1 and "missing.tier" in p.stderr


def test_dump_npz_and_safetensors_bit_exact(tmp_path):
    path = str(tmp_path / "d.tier")
    dev, model, rec = filled(path)
    try:
        out = str(tmp_path / "m.npz")
        p = cli("dump", path, "mlp", "-o", out)
        assert p.returncode == 0, p.stderr
        with np.load(out) as z:
            assert sorted(z.files) == sorted(rec[3])
            for n, a in rec[3].items():
                assert z[n].dtype == a.dtype and z[n].shape == a.shape and z[n].tobytes() == a.tobytes()
        p = cli("dump", path, "mlp", "-o", out)  # exists
        assert p.returncode == 2 and "exists" in p.stderr
        p = cli("dump", path, "mlp", "-o", out, "--version", "2", "--force")
        assert p.returncode == 0, p.stderr
        with np.load(out) as z:
            assert all(z[n].tobytes() == a.tobytes() for n, a in rec[2].items())
        st = str(tmp_path / "m.safetensors")
        p = cli("dump", path, "mlp", "-o", st)
        assert p.returncode == 0, p.stderr
        meta, order, got = read_safetensors(st)  # the format parsed by hand
        assert meta["name"] == "mlp" and meta["version"] == "v3" and meta["verified"] == "true"
        assert sorted(order) == sorted(rec[3])  # the safetensors library orders tensors (dtype size, then name)
        for n, a in rec[3].items():
            assert got[n].dtype == a.dtype and got[n].shape == a.shape and got[n].tobytes() == a.tobytes()
        try:
            from safetensors.numpy import load_file
        except ImportError:
            pass
        else:
            assert all(load_file(st)[n].tobytes() == a.tobytes() for n, a in rec[3].items())
        p = cli("dump", path, "mlp", "-o", str(tmp_path / "m.txt"))
        assert p.returncode == 2 and ".npz" in p.stderr and not (tmp_path / "m.txt").exists()
        p = cli("dump", path, "nosuch", "-o", str(tmp_path / "n.npz"))
        assert p.returncode == 1 and "nosuch" in p.stderr and not (tmp_path / "n.npz").exists()
        p = cli("dump", path, "mlp", "-o", str(tmp_path / "v1.npz"), "--version", "1")  # overwritten by v3
        assert p.returncode == 1 and "1" in p.stderr and not (tmp_path / "v1.npz").exists()
    finally:
        model.close()
        dev.close()


@pytest.mark.parametrize("whose", ["nobody", "world-writable"])
def test_dump_refuses_an_output_directory_another_user_controls(tmp_path, whose):
    """Issue 41, item 2: ``memtier dump -o`` into a directory of another user (or one every user
    may write in) is refused naming the directory, its owner and mode, nothing written there.
    Before: dumped there."""
    from test_cli import unsafe_output_dir
    path = str(tmp_path / "d.tier")
    d, names = unsafe_output_dir(tmp_path, whose)
    dev, model, rec = filled(path, versions=(1,))
    try:
        p = cli("dump", path, "mlp", "-o", os.path.join(d, "m.npz"))
        assert p.returncode == 1 and names in p.stderr and f"{d} (owned by " in p.stderr, p.stderr
        assert "breaks the rule for output directories" in p.stderr, p.stderr
        assert os.listdir(d) == []
    finally:
        model.close()
        dev.close()


def test_dump_refuses_active_slot_unless_forced(tmp_path):
    path = str(tmp_path / "a.tier")
    dev, model, rec = filled(path, versions=(1, 2))
    try:
        region = model.region
        k = region.choose_slot()
        w = region.begin(k, Version(0, 3))  # a write interrupted here: ACTIVE, half the new bytes
        w.data[: len(w.data) // 2] = b"\x00" * (len(w.data) // 2)
        out = str(tmp_path / "v3.npz")
        for extra in ((), ("--version", "3")):  # the newest version named by any slot is v3: ACTIVE
            p = cli("dump", path, "mlp", "-o", out, *extra)
            assert p.returncode == 1 and "ACTIVE" in p.stderr and "--force" in p.stderr, p.stderr
            assert "--version 2" in p.stderr or extra, p.stderr  # names the newest valid version
            assert not os.path.exists(out)
        p = cli("dump", path, "mlp", "-o", out, "--version", "3", "--force")
        assert p.returncode == 0, p.stderr
        assert "UNVERIFIED" in p.stdout and os.path.exists(out)
        out2 = str(tmp_path / "v2.npz")
        p = cli("dump", path, "mlp", "-o", out2, "--version", "2")  # the previous version: DONE, exact
        assert p.returncode == 0, p.stderr
        with np.load(out2) as z:
            assert all(z[n].tobytes() == a.tobytes() for n, a in rec[2].items())
        w.release()
    finally:
        model.close()
        dev.close()


def test_repack_frees_invalid_slot_keeps_newest(tmp_path):
    path = str(tmp_path / "r.tier")
    dev, model, rec = filled(path, versions=(1, 2))
    region = model.region
    k = region.choose_slot()
    w = region.begin(k, Version(0, 3))  # interrupted: the slot stays ACTIVE
    w.release()
    free_before = dev.free_bytes()
    p = cli("repack", path, "--json")  # the model is live (not closed, owner alive): untouched
    assert p.returncode == 1 and "nothing to free" in p.stderr  # freed nothing: says so, exit 1 (issue 24)
    assert json.loads(p.stdout) == {"retired": 0, "moved": 0, "freed_bytes": 0}
    model.close()  # finished: repack may compact it
    dev.close()
    p = cli("repack", path, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["moved"] == 1 and out["freed_bytes"] > 0, out
    info = json.loads(cli("view", path, "--json").stdout)
    (m,) = info["models"]
    (sh,) = m["shards"]
    assert [(s["state"], s["version"], s["valid"]) for s in sh["slots"]] == [("DONE", 2, True)]
    assert info["free"] > free_before
    with mdev.open(path, writable=False) as d:
        got, v = api.restore(d, "mlp")
    assert v == Version(0, 2) and all(got[n].tobytes() == a.tobytes() for n, a in rec[2].items())
    p = cli("repack", path)  # again: nothing left to do
    assert p.returncode == 1 and "retired 0" in p.stdout and "nothing to free" in p.stderr


def test_dump_h5_loads_into_keras_bit_exact(tmp_path):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = pytest.importorskip("tensorflow")
    from deepfreeze.keras.state_loader import model_tensors

    def build():
        tf.keras.utils.set_random_seed(5)
        return tf.keras.Sequential([tf.keras.Input((12,)), tf.keras.layers.Dense(16, activation="relu"),
                                    tf.keras.layers.BatchNormalization(), tf.keras.layers.Dense(3)])

    src = build()
    names = [n for n, _, _ in model_tensors(src)]
    rng = np.random.default_rng(9)
    arrays = {n: rng.standard_normal(w.shape).astype(w.dtype.as_numpy_dtype) for n, w in zip(names, src.weights)}
    path = str(tmp_path / "k.tier")
    with mdev.create(path, 8 * MiB) as dev:
        model = api.register(dev, "keras_mlp", arrays)
        api.checkpoint(model, arrays, 7)
        model.close()
    out = str(tmp_path / "w.h5")
    p = cli("dump", path, "keras_mlp", "-o", out)
    assert p.returncode == 0, p.stderr
    dst = build()
    dst.load_weights(out)
    for n, w in zip(names, dst.weights):
        got = w.numpy()
        assert got.dtype == arrays[n].dtype and got.tobytes() == arrays[n].tobytes(), n
