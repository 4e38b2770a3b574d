"""The memory tier as a restore level: load/list_versions/resume read memory tier -> scratch ->
persistent, pool the nodes' devices with run-identity checks, and ls/verify show the tier.

Real Horovod ranks, real node backends, one device per simulated node (distinct directories)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from _util import mpirun
from deepfreeze import format as fmt, load, list_versions, memtier
from deepfreeze.config import Config

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "memtier_resume.py")


def _expected(out):
    """{(run, version): weights} the first run recorded (the resume test's run records more)."""
    got = {}
    for n in os.listdir(f"{out}/expected_first"):
        run, v = n[:-4].rsplit("-v", 1)
        with np.load(f"{out}/expected_first/{n}", allow_pickle=False) as z:
            got[(run, int(v))] = [z[f"arr_{i}"] for i in range(len(z.files))]
    return got


def _cfg(out, node=None):
    kw = {} if node is None else {"memtier": f"{out}/node{node}/tier"}
    return Config.load(None, mode="sync", scratch=f"{out}/node{node if node is not None else 'x'}/scratch",
                       persistent=f"{out}/persistent", **kw)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "deepfreeze", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})


def _both(out, name):
    """A device holding both nodes' slots of 'mr' (as if the two ranks had run on one node)."""
    both = f"{out}/{name}"
    os.makedirs(both)
    memtier.create(f"{both}/tier", "32M").close()
    with memtier.open(f"{both}/tier") as dev:
        for node in (0, 1):
            with memtier.open(f"{out}/node{node}/tier", writable=False) as src:
                for region in src.find("mr"):
                    copy = dev.register_shard(region.name, region.run, region.rank, region.world_size,
                                              index=region.index, image_size=region.image_size,
                                              meta_cap=region.meta_cap, nslots=2)
                    for k, h in sorted(region.restorable(), key=lambda kh: kh[1].version):
                        image = region.read_image(k)
                        w = copy.begin(copy.choose_slot(), h.version)
                        w.data[:] = image[region.data_offset:].tobytes()
                        w.finish([e.crc for e in fmt.read_index(image).entries], region.manifest(k, h))
    return both


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mr"))
    for node in (0, 1):
        os.makedirs(f"{out}/node{node}")
        memtier.create(f"{out}/node{node}/tier", "32M").close()
    mpirun(2, WORKER, out, "first", timeout=300)
    shutil.copytree(f"{out}/expected", f"{out}/expected_first")
    return out


def test_tier_listed_and_read_first_on_its_node(trained):
    out = trained
    expected = _expected(out)
    (run,) = {r for r, _ in expected}
    newest = max(v for _, v in expected)
    # each node's device holds its own rank's shards only: alone, neither is a whole version
    for node in (0, 1):
        levels = list_versions(_cfg(out, node), "mr")
        assert all("memtier" not in lv for lv in levels.values()), levels
        ck = load(_cfg(out, node), "mr")
        assert ck.level == "persistent" and ck.version == newest
    # one device holding both ranks' slots (two ranks on one node): the tier is a level, read first
    both = _both(out, "both")
    cfg = Config.load(None, mode="sync", scratch=f"{both}/scratch", persistent=f"{out}/persistent",
                      memtier=f"{both}/tier")
    levels = list_versions(cfg, "mr")
    tier_versions = sorted(v for v, lv in levels.items() if "memtier" in lv)
    assert tier_versions[-1] == newest and len(tier_versions) == 2, levels
    for v in tier_versions:
        ck = load(cfg, "mr", v)
        assert ck.level == "memtier"
        # load() returns copies the caller owns, never views of a slot a writer may reuse later
        assert all(a.flags.writeable for a in ck.arrays.values())
        assert [a.tobytes() for a in ck.model_arrays().values()] == [a.tobytes() for a in expected[(run, v)]]
    # a damaged slot image: restore reads the next source (persistent's copy of that version)
    with memtier.open(f"{both}/tier") as dev:
        region = dev.find("mr", rank=1)[0]
        k, h = region.newest(verify=False)
        off = region.image_offset(k) + region.data_offset + 100
        dev.mm[off] ^= 0xFF
    ck = load(cfg, "mr", newest)
    assert ck.level == "persistent"
    assert [a.tobytes() for a in ck.model_arrays().values()] == [a.tobytes() for a in expected[(run, newest)]]


def test_ls_and_verify_show_the_tier(trained):
    out = trained
    sets = ["--set", f"scratch={out}/node0/scratch", "--set", f"persistent={out}/persistent",
            "--set", f"memtier={out}/node0/tier"]
    ls = _cli("ls", "--name", "mr", "--json", *sets)
    assert ls.returncode == 0, ls.stderr
    rep = json.loads(ls.stdout)
    tier = [c for c in rep["checkpoints"][0]["versions"] if c["level"] == "memtier"]
    assert tier and all(c["status"] == "partial" for c in tier), tier  # rank 1's slots are on node 1
    ver = _cli("verify", "--name", "mr", "--all", *sets)
    assert "memtier" in ver.stdout, ver.stdout + ver.stderr
    assert "PARTIAL" in ver.stdout


def test_apply_loaded_one_copy_from_the_slot_and_a_rewrite_is_detected(trained):
    """apply_loaded hands whole tensors as read-only views of the slot (one copy: apply's); a slot
    rewritten while apply runs is detected and the version is applied again from copies."""
    from deepfreeze.loader import apply_loaded
    out = trained
    expected = _expected(out)
    (run,) = {r for r, _ in expected}
    newest = max(v for _, v in expected)
    both = _both(out, "both2")
    cfg = Config.load(None, mode="sync", scratch=f"{both}/scratch", persistent=f"{out}/persistent",
                      memtier=f"{both}/tier")
    calls = []

    def apply(ck):
        views = [not a.flags.owndata and not a.flags.writeable for a in ck.model_arrays().values()]
        calls.append((ck.level, views, [a.copy() for a in ck.model_arrays().values()]))
        return ck.version

    assert apply_loaded(cfg, "mr", None, apply) == newest
    level, views, got = calls[0]
    assert level == "memtier" and any(views)  # whole tensors straight from the slot
    assert [a.tobytes() for a in got] == [a.tobytes() for a in expected[(run, newest)]]

    calls.clear()

    def rewriting_apply(ck):
        if not calls:  # a writer starts a new version in the slot apply is reading (rank 1's)
            with memtier.open(f"{both}/tier") as dev:
                region = dev.find("mr", rank=1)[0]
                k, h = region.newest()
                region.begin(k, h.version).release()  # header ACTIVE: the slot is being rewritten
        return apply(ck)

    assert apply_loaded(cfg, "mr", None, rewriting_apply) == newest
    assert len(calls) == 2 and calls[1][0] == "persistent"  # the rewritten slot is never trusted
    assert [a.tobytes() for a in calls[1][2]] == [a.tobytes() for a in expected[(run, newest)]]


def test_keras_restore_from_the_tier_is_bit_exact(trained):
    """deepfreeze.keras.restore into a fresh model reads the memory tier (views, one copy)."""
    sys.path.insert(0, os.path.join(HERE, "workers"))
    from models import build
    from deepfreeze.keras import restore
    out = trained
    expected = _expected(out)
    (run,) = {r for r, _ in expected}
    newest = max(v for _, v in expected)
    both = _both(out, "both3")
    model = build()
    version, step = restore(model, Config.load(None, mode="sync", scratch=f"{both}/scratch",
                                               persistent=f"{out}/persistent", memtier=f"{both}/tier"), name="mr")
    assert version == newest
    assert [w.tobytes() for w in model.get_weights()] == [a.tobytes() for a in expected[(run, newest)]]


# last: it adds a second run (newer versions on persistent and on the devices)
def test_resume_reads_the_tier_pooled_over_nodes(trained, tmp_path):
    """A relaunched job with resume=True pools both nodes' devices (each holds one rank's slot of
    the newest version) and resumes from the memory tier, bit-exact."""
    out = trained
    first = _expected(out)
    newest = max(v for _, v in first)
    res = mpirun(2, WORKER, out, "resume", timeout=300)
    assert f"resumed_from={newest}" in res.stdout, res.stdout[-2000:]
    assert "(memtier, step" in res.stderr, res.stderr[-3000:]
    with np.load(f"{out}/resumed.npz", allow_pickle=False) as z:
        got = [z[f"arr_{i}"] for i in range(len(z.files))]
    (want,) = [a for (r, v), a in first.items() if v == newest]
    assert [a.tobytes() for a in got] == [a.tobytes() for a in want]
