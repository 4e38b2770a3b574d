"""experiments/repo.py's helpers: the page-cache drop, the synthetic models' 25 % prefix, the verdicts."""
from __future__ import annotations

import numpy as np
import pytest

from experiments import repo as ex


def _fs_type(path: str) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def test_drop_cache_makes_the_next_read_of_a_tree_cold(tmp_path):
    if ex.read_bytes() is None:
        pytest.skip("no /proc/self/io read_bytes here")
    if _fs_type(str(tmp_path)) in ("tmpfs", "ramfs", ""):
        pytest.skip(f"{tmp_path} is on a memory file system: nothing to read from storage")
    nbytes = 8 << 20
    sub = tmp_path / "packs"
    sub.mkdir()
    paths = [str(tmp_path / "meta.db"), str(sub / "a.dfz")]
    for p in paths:
        with open(p, "wb") as f:
            f.write(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes())

    def read_all() -> int:
        before = ex.read_bytes()
        for p in paths:
            with open(p, "rb") as f:
                while f.read(1 << 20):
                    pass
        return ex.read_bytes() - before

    read_all()  # cached (just written); dirty pages are written back by drop_cache itself
    assert ex.drop_cache(str(tmp_path)) == 2 * nbytes
    assert read_all() >= 2 * nbytes  # every byte came from storage again
    assert read_all() < nbytes  # and is cached now


def test_drop_cache_skips_missing_files_and_takes_a_file(tmp_path):
    p = tmp_path / "x.h5"
    p.write_bytes(b"x" * 4096)
    assert ex.drop_cache(str(p), str(tmp_path / "gone")) == 4096


@pytest.mark.parametrize("model", ["dense10-8m", "dense100-8m"])
def test_synthetic_partial_model_is_the_first_quarter_of_the_bytes(model):
    pytest.importorskip("tensorflow")
    src, part = ex.build(model, "source"), ex.build(model, "partial")
    kern = [v for v in src.weights if "kernel" in v.name]
    pkern = [v for v in part.weights if "kernel" in v.name]
    total = sum(int(np.prod(v.shape)) for v in kern)
    prefix = sum(int(np.prod(v.shape)) for v in pkern)
    assert prefix * 4 == total  # kernels: exactly 25 %
    sw, pw = ex.layer_weights(src), ex.layer_weights(part)
    assert list(pw) == list(sw)[:len(pw)]  # the prefix: same names, same shapes
    assert all([tuple(a.shape) for a in pw[n]] == [tuple(b.shape) for b in sw[n]] for n in pw)
    assert abs(ex.model_bytes(src) - ex.MODELS[model][2]) / ex.MODELS[model][2] < 0.02


def _st(values: list[float]) -> dict:
    return ex.stats(values)


def test_targets_say_holds_missed_and_not_resolvable():
    hdf5 = {"store_load_warm_s": _st([10.0, 10.2, 9.8]), "store_load_cold_s": _st([10.0, 10.0, 10.0]),
            "load_partial_cold_s": _st([5.0, 5.5, 4.5])}
    emb = {"store_load_warm_s": _st([2.0, 2.1, 1.9]),  # 5x: holds
           "store_load_cold_s": _st([9.0, 9.0, 9.0]),  # 1.1x: missed
           "load_partial_cold_s": _st([0.4, 0.6, 0.5]),  # 10x within one standard error: not resolvable
           "load_partial_cold_read_fraction": _st([0.26, 0.26])}
    doc = {"settings": {"mode": "full"},
           "models": [dict(model="dense10-1g", approach="keras-hdf5", **hdf5),
                      dict(model="dense10-1g", approach="embedded", **emb)],
           "graph": [{"layers": 500, "graph_bytes": 100, "to_json_bytes": 999, "ratio": 9.99, "layer_meta_bytes": 1}]}
    got = {(t.get("metric"), t.get("approach")): t for t in ex.targets(doc)}
    assert got[("store_load_warm_s", "embedded")]["verdict"] == "holds"
    assert got[("store_load_cold_s", "embedded")]["verdict"] == "missed"
    assert got[("load_partial_cold_s", "embedded")]["verdict"] == "not resolvable"
    assert got[("load_partial_cold_read_fraction", "embedded")]["verdict"] == "holds"
    assert got[(None, None)]["verdict"] == "missed"  # the graph: 9.99x < 10x
    assert all(t["headline"] for t in got.values())
    assert "| 500 | 100 | 999 |" in ex.table(dict(doc, targets=ex.targets(doc)))
