"""Repository data safety (issue 24): gc trusts no stored count and acts on no damaged row, delete
frees space on a full disk, a huge declared shape is refused before anything is allocated.

Real repositories, a real SQLite database tampered with through ``sqlite3``, a real full tmpfs
(mounted here; needs root) and the real ``deepfreeze repo`` command."""
import os
import sqlite3
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import deepfreeze.repo.store as store
from deepfreeze.errors import CorruptCheckpointError, DeepFreezeError, RepositoryDatabaseError, RepositoryError
from deepfreeze.repo.maintenance import RESERVE_BYTES, RESERVE_FILE
from deepfreeze.repo.store import EmbeddedRepository

from _util import ROOT


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def db(repo):
    return sqlite3.connect(os.path.join(repo.directory, "meta.db"), isolation_level=None)


def packs(repo):
    return sorted(os.listdir(os.path.join(repo.directory, "packs")))


def fill_models(repo, seed=0):
    """Models sharing tensors (de-duplicated), each with tensors of its own: name -> what was put."""
    rng = np.random.default_rng(seed)
    trunk = {f"trunk{i}": rng.standard_normal(3000 + i).astype(np.float32) for i in range(3)}
    put = {}
    for m in ("a@1", "a@2", "b", "c@x"):
        t = dict(trunk, head=rng.standard_normal(500), bias=rng.integers(-9, 9, 40, dtype=np.int16))
        repo.put(m, t)
        put[m] = t
    return put


def check_all(repo, put):
    for name, tensors in put.items():
        got = repo.get(name)
        assert set(got) == set(tensors), name
        for k, v in tensors.items():
            assert same_bits(got[k], v), (name, k)


def raw_delete(repo, name):
    """A deletion recorded the old way (tensors released, blobs and packs left for gc)."""
    with db(repo) as c:
        (mid,) = c.execute("SELECT id FROM models WHERE name=?", (name,)).fetchone()
        c.execute("DELETE FROM tensors WHERE model=?", (mid,))
        c.execute("UPDATE models SET deleted=1, graph=NULL WHERE id=?", (mid,))


# --------------------------------------------------------------------------- gc with tampered counts


@pytest.mark.parametrize("refs", [0, -5, 1 << 62])
def test_gc_with_tampered_counts_keeps_every_live_model(tmp_path, refs):
    with EmbeddedRepository(tmp_path / "r") as repo:
        put = fill_models(repo)
        gone = put.pop("b")
        raw_delete(repo, "b")  # b's own head and bias are now unreferenced; its pack holds nothing else
        with db(repo) as c:
            c.execute("UPDATE blobs SET refs=?", (refs,))
            n_blobs = c.execute("SELECT count(*) FROM blobs").fetchone()[0]
        before = packs(repo)
        res = repo.gc(grace=0)
        check_all(repo, put)  # no live model lost a byte
        assert res["damaged"] == []
        assert res["blobs_removed"] == 2 and res["packs_removed"] == 1 and res["quarantined"] > 0
        assert res["refs_repaired"] == (n_blobs - 2 if refs == 0 else n_blobs)  # (0 is right for b's two)
        assert len(packs(repo)) == len(before) - 1
        with db(repo) as c:  # the counts now say what the rows say
            assert c.execute("SELECT count(*) FROM blobs WHERE refs != (SELECT count(*) FROM tensors t "
                             "WHERE t.blob=blobs.id)").fetchone()[0] == 0
        assert repo.put("b2", gone)["written"] == sum(gone[k].nbytes for k in ("head", "bias"))  # trunk shared
        again = repo.gc(grace=0)
        assert again == {"freed": 0, "blobs_removed": 0, "packs_removed": 0, "packs_rewritten": 0,
                         "orphans_removed": 0, "refs_repaired": 0, "warnings": [], "damaged": [], "quarantined": 0,
                         "purged": 0, "quarantine": res["quarantine"]}
        check_all(repo, dict(put, b2=gone))


def test_gc_with_dangling_rows_removes_nothing_and_says_so(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as repo:
        put = fill_models(repo, seed=1)
        raw_delete(repo, "c@x")  # something gc could otherwise remove
        with db(repo) as c:
            mid = dict(c.execute("SELECT name, id FROM models"))
            # a@2's head points to a blob row that does not exist
            c.execute("UPDATE tensors SET blob=999999 WHERE model=? AND key='head'", (mid["a@2"],))
            # a@1's head blob points to a pack row that does not exist
            c.execute("UPDATE blobs SET pack=424242 WHERE id=(SELECT blob FROM tensors WHERE model=? AND key='head')",
                      (mid["a@1"],))
            c.execute("UPDATE blobs SET refs=0")  # and every count says 'unused'
            blobs_before = c.execute("SELECT id, pack, offset, length FROM blobs ORDER BY id").fetchall()
        files = packs(repo)
        res = repo.gc(grace=0)
        text = "\n".join(res["damaged"])
        assert "'a@2'" in text and "'a@1'" in text and "'head'" in text and "removed nothing" in text
        assert all("restore" in m or "delete" in m for m in res["damaged"])  # each says what to do
        assert (res["blobs_removed"], res["packs_removed"], res["orphans_removed"], res["freed"]) == (0, 0, 0, 0)
        assert res["refs_repaired"] > 0
        with db(repo) as c:
            assert c.execute("SELECT id, pack, offset, length FROM blobs ORDER BY id").fetchall() == blobs_before
        assert packs(repo) == files
        for name, keys in (("a@1", ["trunk0", "bias"]), ("a@2", ["trunk1", "bias"]), ("b", list(put["b"]))):
            got = repo.get(name, keys)  # the healthy tensors still read back bit-exact
            assert all(same_bits(got[k], put[name][k]) for k in keys)
        # once the damaged models are deleted, gc frees what nothing reaches any more
        repo.delete("a@1")
        repo.delete("a@2")
        res = repo.gc(grace=0)
        assert res["damaged"] == [] and res["blobs_removed"] >= 2 and res["quarantined"] > 0
        check_all(repo, {"b": put["b"]})


def test_gc_reports_a_blob_outside_its_pack_and_keeps_it(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as repo:
        put = fill_models(repo, seed=3)
        raw_delete(repo, "c@x")
        with db(repo) as c:
            (bid,) = c.execute("SELECT t.blob FROM tensors t JOIN models m ON m.id=t.model WHERE m.name='b' AND "
                               "t.key='bias'").fetchone()
            c.execute("UPDATE blobs SET offset=offset+100000000, refs=-1 WHERE id=?", (bid,))
            row = c.execute("SELECT * FROM blobs WHERE id=?", (bid,)).fetchone()
        files = packs(repo)
        res = repo.gc(grace=0)
        assert len(res["damaged"]) == 2 and "'b'" in res["damaged"][0] and "disagree" in res["damaged"][0]
        assert "removed no pack" in res["damaged"][1]  # (c@x's pack too: the damage may be a swapped pack row)
        assert res["blobs_removed"] == 2 and res["packs_removed"] == 0 and packs(repo) == files
        with db(repo) as c:
            assert c.execute("SELECT * FROM blobs WHERE id=?", (bid,)).fetchone()[:-1] == row[:-1]
        with pytest.raises(CorruptCheckpointError):
            repo.get("b", ["bias"])
        got = repo.get("b", ["head", "trunk2"])
        assert same_bits(got["head"], put["b"]["head"]) and same_bits(got["trunk2"], put["b"]["trunk2"])
        del put["b"], put["c@x"]
        check_all(repo, put)


def test_gc_reports_a_missing_pack_and_keeps_its_rows(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as repo:
        put = fill_models(repo, seed=2)
        with db(repo) as c:
            (file,) = c.execute("SELECT p.file FROM models m JOIN tensors t ON t.model=m.id JOIN blobs b ON "
                                "b.id=t.blob JOIN packs p ON p.id=b.pack WHERE m.name='b' AND t.key='head'").fetchone()
            rows = c.execute("SELECT count(*) FROM blobs b JOIN packs p ON p.id=b.pack WHERE p.file=?",
                             (file,)).fetchone()[0]
        os.unlink(os.path.join(repo.directory, "packs", file))
        res = repo.gc(grace=0)
        assert len(res["damaged"]) == 2 and "'b'" in res["damaged"][0] and "missing" in res["damaged"][0]
        assert "removed no pack" in res["damaged"][1]
        assert res["blobs_removed"] == 0 and res["packs_removed"] == 0
        with db(repo) as c:
            assert c.execute("SELECT count(*) FROM blobs b JOIN packs p ON p.id=b.pack WHERE p.file=?",
                             (file,)).fetchone()[0] == rows
        del put["b"]
        check_all(repo, put)


# --------------------------------------------------------------------------- huge declared shapes


@pytest.mark.parametrize("shape", ["16777216,16777216", "1099511627776,1099511627776", "1000000", "1000,1001"])
def test_huge_declared_shape_is_corrupt_before_any_allocation(tmp_path, shape):
    with EmbeddedRepository(tmp_path / "r") as repo:
        w = np.arange(1000, dtype=np.float32)
        repo.put("m", {"w": w, "ok": np.ones(3)})
        with db(repo) as c:
            c.execute("UPDATE blobs SET shape=? WHERE id=(SELECT blob FROM tensors WHERE key='w')", (shape,))
        tracemalloc.start()
        try:
            for call in (lambda: repo.get("m"), lambda: repo.get("m", ["w"]), lambda: repo.specs("m")):
                with pytest.raises(CorruptCheckpointError, match="damaged or was tampered"):
                    call()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20  # nothing of the declared size (numpy reports its buffers to tracemalloc)
        assert same_bits(repo.get("m", ["ok"])["ok"], np.ones(3))  # the model's other tensors still read


# --------------------------------------------------------------------------- a full disk

FS_BYTES = 8 << 20


@pytest.fixture
def small_fs(tmp_path):
    """A fresh 8 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)])


def free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill_disk(path):
    """Write a file until not one more byte fits."""
    fd = os.open(os.path.join(path, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for bs in (1 << 20, 65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, bytes(bs))
            except OSError:
                pass
    finally:
        os.close(fd)
    assert free(path) == 0


def models_for_fs(path):
    rng = np.random.default_rng(7)
    put = {f"m@{i}": {"w": rng.standard_normal(120_000), "b": rng.standard_normal(10)} for i in range(4)}
    with EmbeddedRepository(os.path.join(path, "r")) as repo:
        for name, t in put.items():
            repo.put(name, t)
    return os.path.join(path, "r"), put


def test_delete_on_a_full_disk_frees_space(small_fs):
    root, put = models_for_fs(small_fs)
    with EmbeddedRepository(root) as repo:  # opened before the disk fills: a live connection
        repo.get("m@0")
        fill_disk(small_fs)
        with pytest.raises(DeepFreezeError) as ei:  # a store cannot succeed, and says so
            repo.put("new", {"x": np.ones(1000)})
        assert "nothing was stored" in str(ei.value)
        assert repo.list() == {"m": sorted(put)}
        res = repo.delete("m@1")
        assert res["freed"] >= put["m@1"]["w"].nbytes and res["packs_removed"] == 1
        assert free(small_fs) > 0.5 * put["m@1"]["w"].nbytes  # the reserve is back, the rest is free
        assert os.path.isfile(os.path.join(root, RESERVE_FILE))
        repo.put("new", {"x": np.arange(50_000.0)})  # later stores work
        del put["m@1"]
        check_all(repo, dict(put, new={"x": np.arange(50_000.0)}))
        assert repo.gc(grace=0)["damaged"] == []


def cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "deepfreeze", "repo", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_repo_rm_on_a_full_disk_frees_space(small_fs):
    root, put = models_for_fs(small_fs)  # closed: the next process finds no WAL and no shared memory
    fill_disk(small_fs)
    p = cli("rm", root, "m@2")
    assert p.returncode == 0, p.stderr
    assert "deleted m@2" in p.stdout and "freed" in p.stdout and "Traceback" not in p.stderr
    assert free(small_fs) > 0.5 * put["m@2"]["w"].nbytes
    p = cli("ls", root, "--json")
    assert p.returncode == 0, p.stderr
    del put["m@2"]
    with EmbeddedRepository(root) as repo:
        assert repo.list() == {"m": sorted(put)}
        repo.put("later", {"x": np.full(40_000, 3.0)})
        check_all(repo, dict(put, later={"x": np.full(40_000, 3.0)}))


def test_database_failure_is_a_repository_error_saying_what_to_do(tmp_path):
    with EmbeddedRepository(tmp_path / "r") as repo:
        repo.put("m", {"w": np.ones(4)})
        holder = db(repo)
        holder.execute("BEGIN EXCLUSIVE")  # another connection keeps the database locked
        old = store._BUSY_TIMEOUT
        try:
            store._BUSY_TIMEOUT = 0.2
            repo._drop_conn()  # the next connection waits 0.2 s, not 60
            with pytest.raises(RepositoryDatabaseError, match="locked.*retry") as ei:
                repo.delete("m")
        finally:
            store._BUSY_TIMEOUT = old
            holder.execute("ROLLBACK")
            holder.close()
        assert isinstance(ei.value.__cause__, sqlite3.Error) and "'m'" in str(ei.value)
        assert "Traceback" not in str(ei.value) and repo.list() == {"m": ["m"]}  # nothing was deleted


def test_gc_on_a_full_disk_warns_and_loses_nothing(small_fs):
    rng = np.random.default_rng(11)
    big, small = rng.standard_normal(150_000), rng.standard_normal(1000)
    with EmbeddedRepository(os.path.join(small_fs, "r")) as repo:
        repo.put("x", {"big": big, "small": small})
        repo.put("y", {"s": small.copy()})  # shares x's small tensor, so x's pack stays when x goes
        repo.put("z", {"w": rng.standard_normal(120_000)})
        assert repo.delete("x")["freed"] == 0  # x's pack is now mostly dead: a gc would compact it
        fill_disk(small_fs)
        res = repo.gc(grace=0)
        assert res["packs_rewritten"] == 0 and res["damaged"] == [] and len(res["warnings"]) == 1
        assert "not compacted" in res["warnings"][0] and "nothing was lost" in res["warnings"][0]
        assert same_bits(repo.get("y")["s"], small)
        assert not [f for f in packs(repo) if f.startswith("tmp-")]  # the half-written replacement is gone
        repo.delete("z")  # room again
        res = repo.gc(grace=0)
        assert res["packs_rewritten"] == 1 and res["warnings"] == [] and res["quarantined"] > big.nbytes
        assert res["freed"] == 0 and res["quarantine"][-1]["bytes"] == res["quarantined"]  # kept a while
        res = repo.gc(grace=0, quarantine_period=0)  # an operator short of space: the quarantine is purged
        assert res["purged"] == 1 and res["freed"] > big.nbytes and res["quarantine"] == []
        assert same_bits(repo.get("y")["s"], small)


def test_a_full_disk_never_costs_a_file_that_is_not_the_reserve(small_fs):
    plain = os.path.join(small_fs, "notes")
    os.mkdir(plain)
    with open(os.path.join(plain, RESERVE_FILE), "wb") as f:  # a user's file that happens to have the name
        f.write(bytes(RESERVE_BYTES))
    fill_disk(small_fs)
    with pytest.raises(RepositoryError, match="not a repository"):
        EmbeddedRepository(plain, create=False)
    assert os.path.getsize(os.path.join(plain, RESERVE_FILE)) == RESERVE_BYTES
