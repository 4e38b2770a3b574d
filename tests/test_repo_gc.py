"""gc never destroys what a repair could reach (issue 32): a damaged pack row makes gc remove no
pack; what gc removes goes through the quarantine; every store or load failure a gc causes says so.

Real repositories, a real SQLite database damaged through ``sqlite3``, real files; concurrent gcs
injected by subclassing the repository at the racy point."""
import logging
import os
import shutil
import sqlite3
import tempfile
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepfreeze.errors import CheckpointWriteError, CorruptCheckpointError, RepositoryError
from deepfreeze.repo.quarantine import QUARANTINE_DIR
from deepfreeze.repo.store import EmbeddedRepository
from test_repo_store import GcDuringStore  # noqa: E402  (the injected concurrent gc, one definition)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def db(root):
    return sqlite3.connect(os.path.join(root, "meta.db"), isolation_level=None)


def packs(root):
    return sorted(os.listdir(os.path.join(root, "packs")))


def quarantine(root):
    q = os.path.join(root, QUARANTINE_DIR)
    return sorted(os.listdir(q)) if os.path.isdir(q) else []


def raw_delete(root, name):
    """A deletion recorded the old way: the tensor rows go, the blobs and packs are left for gc."""
    with db(root) as c:
        (mid,) = c.execute("SELECT id FROM models WHERE name=?", (name,)).fetchone()
        c.execute("DELETE FROM tensors WHERE model=?", (mid,))
        c.execute("UPDATE models SET deleted=1, graph=NULL WHERE id=?", (mid,))


def build(root):
    """Two models sharing a tensor, a sparse pack (gc would compact it), a dead pack (gc would
    remove it) and an orphan pack of a crashed store: name -> tensors of every live model."""
    rng = np.random.default_rng(32)
    shared = rng.standard_normal(4000)
    live = {"a@1": {"shared": shared, "own": rng.standard_normal(300).astype(np.float32)},
            "b@1": {"shared": shared.copy(), "own": rng.integers(-9, 9, 77, dtype=np.int16)}}
    small = rng.standard_normal(200)
    with EmbeddedRepository(root) as repo:
        for name, t in live.items():
            repo.put(name, t)
        repo.put("c@1", {"big": rng.standard_normal(30_000), "small": small})
        repo.put("keep@1", {"s": small.copy()})  # c@1's pack: mostly dead once c@1 goes
        repo.put("d@1", {"x": rng.standard_normal(2000)})  # its pack: dead once d@1 goes
    live["keep@1"] = {"s": small}
    raw_delete(root, "c@1")
    raw_delete(root, "d@1")
    with tempfile.TemporaryDirectory() as other:  # an orphan: a complete pack no row names
        with EmbeddedRepository(os.path.join(other, "r")) as o:
            o.put("z", {"z": rng.standard_normal(1500)})
        (orphan,) = packs(os.path.join(other, "r"))
        shutil.copy(os.path.join(other, "r", "packs", orphan), os.path.join(root, "packs", orphan))
    return live


def pack_row(root, name):
    """(id, file) of the pack holding ``name``'s tensor 'shared' (a@1) / first tensor."""
    with db(root) as c:
        return c.execute("SELECT p.id, p.file FROM models m JOIN tensors t ON t.model=m.id JOIN blobs b ON "
                         "b.id=t.blob JOIN packs p ON p.id=b.pack WHERE m.name=? ORDER BY t.pos", (name,)).fetchone()


def orphan_of(root):
    with db(root) as c:
        known = {r[0] for r in c.execute("SELECT file FROM packs")}
    (o,) = [f for f in packs(root) if f not in known]
    return o


def check_loads(repo, live):
    assert sorted(n for ns in repo.list().values() for n in ns) == sorted(live)
    for name, tensors in live.items():
        got = repo.get(name)
        assert set(got) == set(tensors), name
        for k, v in tensors.items():
            assert same_bits(got[k], v), (name, k)


OUTSIDE = "0123456789abcdef0123456789abcdef.dfz"


def damage(root, case, outside):
    """Damage a@1's pack row (or its file) as the probe did; returns the repair."""
    pid, file = pack_row(root, "a@1")
    if case == "missing":  # the file renamed aside: the row names a missing file, the file looks orphan
        aside = "fedcba9876543210fedcba9876543210.dfz"
        os.rename(os.path.join(root, "packs", file), os.path.join(root, "packs", aside))
        return lambda: os.rename(os.path.join(root, "packs", aside), os.path.join(root, "packs", file))
    new = {"other-name": OUTSIDE,
           "traversal": "../../../../etc/passwd",
           "traversal-to-a-pack-name": os.path.relpath(outside, os.path.join(root, "packs")),
           "wrong-size": orphan_of(root)}[case]
    with db(root) as c:
        c.execute("UPDATE packs SET file=? WHERE id=?", (new, pid))

    def repair():
        with db(root) as c:
            c.execute("UPDATE packs SET file=? WHERE id=?", (file, pid))
    return repair


CASES = ["other-name", "traversal", "traversal-to-a-pack-name", "missing", "wrong-size"]


@pytest.mark.parametrize("grace", ["zero", "repository's"])
@pytest.mark.parametrize("case", CASES)
def test_a_damaged_pack_row_makes_gc_remove_no_pack(tmp_path, case, grace, caplog):
    root = str(tmp_path / "r")
    live = build(root)
    outside = str(tmp_path / "elsewhere" / OUTSIDE)  # a file outside the repository a row could climb to
    os.makedirs(os.path.dirname(outside))
    with open(outside, "wb") as f:
        f.write(b"not yours")
    seen = {p: os.stat(p) for p in ("/etc/passwd", outside)}
    repair = damage(root, case, outside)
    before = packs(root)
    # "repository's": gc() with no grace given, the packs older than the repository's grace (as a
    # pack written an hour before is with the default grace)
    with EmbeddedRepository(root, orphan_grace=0.3) as repo:
        if grace != "zero":
            time.sleep(0.4)
        with caplog.at_level(logging.WARNING, logger="deepfreeze.repo"):
            res = repo.gc(grace=0) if grace == "zero" else repo.gc()
        assert res["packs_removed"] == res["orphans_removed"] == res["packs_rewritten"] == res["quarantined"] == 0
        assert packs(root) == before and quarantine(root) == []  # nothing moved, nothing unlinked
        assert "removed no pack" in res["damaged"][-1] and "'a@1'" in "\n".join(res["damaged"])
        assert any("removed no pack" in r.getMessage() for r in caplog.records)  # and a log line says it
        for p, s in seen.items():  # nothing outside the repository touched
            now = os.stat(p)
            assert (now.st_ino, now.st_size, now.st_mtime_ns) == (s.st_ino, s.st_size, s.st_mtime_ns)
        assert open(outside, "rb").read() == b"not yours"
        repair()
        check_loads(repo, live)  # the repaired database: every model bit-exact
        res = repo.gc(grace=0)  # and now gc does its work: the dead pack, the orphan, the compaction
        assert res["damaged"] == [] and res["packs_removed"] == 1 and res["orphans_removed"] == 1
        assert res["packs_rewritten"] == 1 and len(quarantine(root)) == 3
        check_loads(repo, live)


def test_quarantine_is_listed_restorable_and_purged_after_its_period(tmp_path):
    """An operator's mistake undone: a model deleted, gc run, the database restored from a backup;
    the load says gc quarantined the pack and how to restore it; the restore brings it back."""
    root = str(tmp_path / "r")
    rng = np.random.default_rng(5)
    t = {"w": rng.standard_normal(5000), "b": np.arange(9)}
    with EmbeddedRepository(root, quarantine_period=3600) as repo:
        repo.put("m@1", t)
        (file,) = [f for f in packs(root) if f == pack_row(root, "m@1")[1]]
        backup = sqlite3.connect(str(tmp_path / "backup.db"))
        with db(root) as c:
            c.backup(backup)
        raw_delete(root, "m@1")
        res = repo.gc(grace=0)
        assert res["packs_removed"] == 1 and res["freed"] == 0 and res["quarantined"] == os.path.getsize(
            os.path.join(root, QUARANTINE_DIR, res["quarantine"][0]["entry"]))
        (entry,) = res["quarantine"]
        assert entry["file"] == file and entry["purge_after"] == entry["since"] + 3600
        assert repo.quarantined() == [entry] and quarantine(root) == [entry["entry"]]
    with db(root) as c:  # the operator restores meta.db from the backup
        backup.backup(c)
    backup.close()
    with EmbeddedRepository(root, quarantine_period=3600) as repo:
        with pytest.raises(CorruptCheckpointError) as ei:
            repo.get("m@1")
        msg = str(ei.value)
        assert "a gc moved it into the quarantine" in msg and f"--restore {file}" in msg
        res = repo.gc(grace=0, quarantine_period=0)  # the row names a file in the quarantine: damage
        assert "quarantine" in res["damaged"][0] and "removed no pack" in res["damaged"][-1]
        assert res["purged"] == 0 and quarantine(root) == [entry["entry"]]  # not purged, period or not
        got = repo.restore_pack(file)
        assert got["referenced"] and got["entry"] == entry["entry"] and quarantine(root) == []
        assert all(same_bits(repo.get("m@1")[k], v) for k, v in t.items())
        with pytest.raises(RepositoryError, match="not in the quarantine"):
            repo.restore_pack(file)
        with pytest.raises(RepositoryError, match="neither a pack name"):
            repo.restore_pack("../meta.db")
        # purged by a LATER gc once the period is over, never by the gc that moved it
        repo.delete("m@1")
        raw_name = "abcdefabcdefabcdefabcdefabcdef00.dfz"
        with open(os.path.join(root, "packs", raw_name), "wb") as f:
            f.write(b"x" * 100)  # an orphan (not a valid pack: quarantined all the same, it is in packs/)
        res = repo.gc(grace=0, quarantine_period=0)
        assert res["orphans_removed"] == 1 and res["purged"] == 0 and quarantine(root)[0].endswith(raw_name)
        res = repo.gc(grace=0, quarantine_period=3600)
        assert res["purged"] == 0 and len(quarantine(root)) == 1
        res = repo.gc(grace=0, quarantine_period=0)
        assert res["purged"] == 1 and res["freed"] == 100 and quarantine(root) == []


def test_links_are_never_followed_in_packs_or_as_the_quarantine(tmp_path):
    """A link with a pack's name in packs/ is unlinked as a link; a quarantine directory that is a
    link is refused (no purge, no restore through it); the files they point to stay."""
    from deepfreeze.errors import UnsafePathError
    root = str(tmp_path / "r")
    out = tmp_path / "elsewhere"
    out.mkdir()
    target = out / ("1" * 32 + ".dfz")
    target.write_bytes(b"keep me")
    old_entry = out / ("1000-" + "1" * 32 + ".dfz")  # looks like a quarantine entry of 1970
    old_entry.write_bytes(b"keep me too")
    with EmbeddedRepository(root) as repo:
        repo.put("m", {"w": np.arange(10.0)})
        os.symlink(target, os.path.join(root, "packs", "2" * 32 + ".dfz"))
        res = repo.gc(grace=0)
        assert res["orphans_removed"] == 1 and res["quarantine"] == [] and target.read_bytes() == b"keep me"
        assert not os.path.lexists(os.path.join(root, "packs", "2" * 32 + ".dfz"))
        os.symlink(out, os.path.join(root, QUARANTINE_DIR))
        res = repo.gc(grace=0, quarantine_period=0)
        assert res["purged"] == 0 and any("not purged" in w for w in res["warnings"]) and res["quarantine"] == []
        with pytest.raises(UnsafePathError):
            repo.restore_pack(old_entry.name)
        assert old_entry.read_bytes() == b"keep me too" and target.read_bytes() == b"keep me"
        assert same_bits(repo.get("m")["w"], np.arange(10.0))


# --------------------------------------------------------------------------- gc named in the failures it causes


class GcDuringWrite(EmbeddedRepository):
    """Runs ``action`` (once) while the pack is being written: a concurrent gc."""
    action = None

    def _pwritev_all(self, fd, iovs, offset):
        action, GcDuringWrite.action = GcDuringWrite.action, None
        if action is not None:
            action()
        EmbeddedRepository._pwritev_all(fd, iovs, offset)


# runs ``action`` (once) between writing the pack and committing: a concurrent gc (test_repo_store's)
GcBeforeCommit = GcDuringStore


class GcAtEveryLookup(EmbeddedRepository):
    """Runs ``action`` after each lookup of a get's rows, before it opens the pack."""
    action = None

    def _rows(self, name, keys=None):
        rows = super()._rows(name, keys)
        if GcAtEveryLookup.action is not None:
            GcAtEveryLookup.action()
        return rows


def arrays(seed):
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(1000 + i) for i in range(3)}


def test_store_whose_pack_gc_removed_mid_write_says_gc(tmp_path):
    root = tmp_path / "r"
    with EmbeddedRepository(root) as other, GcDuringWrite(root) as repo:
        GcDuringWrite.action = lambda: other.gc(grace=0)  # the tmp- file is 0 s old: a crashed store's, for it
        with pytest.raises(CheckpointWriteError) as ei:
            repo.put("x@1", arrays(1))
        msg = str(ei.value)
        assert "gc" in msg and "removed while it was being written" in msg and "nothing was stored" in msg
        assert repo.list() == {} and packs(root) == []
        repo.put("x@1", arrays(1))
        assert all(same_bits(repo.get("x@1")[k], v) for k, v in arrays(1).items())


def test_store_whose_pack_gc_quarantined_before_the_commit_says_gc(tmp_path):
    root = tmp_path / "r"
    with EmbeddedRepository(root) as other, GcBeforeCommit(root) as repo:
        GcBeforeCommit.action = lambda: other.gc(grace=0)
        with pytest.raises(RepositoryError) as ei:
            repo.put("x@1", arrays(2))
        msg = str(ei.value)
        assert "a gc moved it into the quarantine" in msg and "nothing was stored" in msg
        assert repo.list() == {} and packs(root) == [] and len(quarantine(root)) == 1


def test_import_whose_pack_gc_quarantined_before_the_commit_says_gc(tmp_path):
    src = tmp_path / "src"
    with EmbeddedRepository(src) as s:
        s.put("m", {"w": np.arange(100.0)})
    (file,) = packs(src)
    root = tmp_path / "r"
    with EmbeddedRepository(root) as other, GcBeforeCommit(root) as repo:
        GcBeforeCommit.action = lambda: other.gc(grace=0)
        with pytest.raises(RepositoryError) as ei:
            repo.add_pack("imp", str(src / "packs" / file), {"w": [0]})
        assert "a gc moved it into the quarantine" in str(ei.value) and "nothing was stored" in str(ei.value)
        assert repo.list() == {} and packs(root) == []


def test_load_that_gc_keeps_moving_says_gc(tmp_path):
    root = tmp_path / "r"
    small = np.random.default_rng(3).standard_normal(500)
    with EmbeddedRepository(root) as other, GcAtEveryLookup(root) as repo:
        other.put("keep", {"s": small})

        def move():  # every pack rewritten at every lookup (rewrite_below above 1)
            assert other.gc(grace=0, rewrite_below=2.0)["packs_rewritten"] == 1
        GcAtEveryLookup.action = move
        try:
            with pytest.raises(CorruptCheckpointError) as ei:
                repo.get("keep")
        finally:
            GcAtEveryLookup.action = None
        assert "a gc moved it into the quarantine" in str(ei.value)
        assert same_bits(repo.get("keep")["s"], small)  # nothing lost: the rows name the newest copy


# --------------------------------------------------------------------------- the property


_TEMPLATE: dict = {}


def template():
    """One repository built per process (``build``), copied for each example."""
    if not _TEMPLATE:
        d = tempfile.mkdtemp(prefix="df-gc-template-")
        _TEMPLATE["root"] = os.path.join(d, "r")
        _TEMPLATE["live"] = build(_TEMPLATE["root"])
        with db(_TEMPLATE["root"]) as c:
            _TEMPLATE["rows"] = c.execute("SELECT id, file, size, data_bytes, created FROM packs ORDER BY id").fetchall()
        _TEMPLATE["orphan"] = orphan_of(_TEMPLATE["root"])
    return _TEMPLATE


HEX = st.text("0123456789abcdef", min_size=32, max_size=32)
FILES = st.one_of(
    HEX.map(lambda h: h + ".dfz"),  # a valid-looking name of no file
    st.sampled_from(["../../../../etc/passwd", "../meta.db", "/etc/passwd", "", ".", "..", "../packs",
                     "../" + OUTSIDE, "tmp-" + "0" * 32, "reserve"]),
    st.text(max_size=60),
    st.just("ORPHAN"), st.just("SWAP"), st.just("ASIDE"))
DAMAGE = st.one_of(
    st.tuples(st.just("file"), FILES),
    st.tuples(st.just("size"), st.one_of(st.integers(-2, 1 << 62), st.sampled_from(["12", b"\x00", 1.5, None]))),
    st.tuples(st.just("data_bytes"), st.one_of(st.integers(-2, 1 << 62), st.just("x"))),
    st.tuples(st.just("created"), st.floats(allow_nan=True)),
    st.tuples(st.just("id"), st.integers(100, 10_000)))


def damage_and_check(row, how, grace):
    """Damage pack row ``row`` of a copy of the template, gc, repair the row: every model loads."""
    t = template()
    with tempfile.TemporaryDirectory() as d:
        root = os.path.join(d, "r")
        shutil.copytree(t["root"], root)
        orig = t["rows"][row % len(t["rows"])]
        pid, file = orig[:2]
        col, value = how
        damaged = [(orig, pid, file)]  # (the row as it was, its id and file now)
        aside = None
        with db(root) as c:
            if (col, value) == ("file", "ASIDE"):  # the file renamed aside, to a name that looks orphan
                aside = "f" * 32 + ".dfz"
                os.rename(os.path.join(root, "packs", file), os.path.join(root, "packs", aside))
            elif (col, value) == ("file", "SWAP"):  # two rows' files exchanged
                other = [r for r in t["rows"] if r[0] != pid][row % (len(t["rows"]) - 1)]
                c.execute("UPDATE packs SET file='swap' WHERE id=?", (other[0],))
                c.execute("UPDATE packs SET file=? WHERE id=?", (other[1], pid))
                c.execute("UPDATE packs SET file=? WHERE id=?", (file, other[0]))
                damaged = [(orig, pid, other[1]), (other, other[0], file)]
            else:
                value = t["orphan"] if value == "ORPHAN" else value
                try:
                    c.execute(f"UPDATE packs SET {col}=? WHERE id=?", (value, pid))
                except sqlite3.IntegrityError:  # (NOT NULL, UNIQUE, a used id): not a state a row can be in
                    return
                damaged = [(orig, value if col == "id" else pid, value if col == "file" else file)]
        with EmbeddedRepository(root) as repo:
            res = repo.gc(grace=grace)
            assert isinstance(res["damaged"], list)
        with db(root) as c:  # the repair: the damaged rows put back, where they still exist (gc may have
            for i, (_o, cur, cur_file) in enumerate(damaged):  # removed one whose damage it cannot see)
                c.execute("UPDATE packs SET file=? WHERE id=? AND file IS ?", (f"repair-{i}", cur, cur_file))
            for i, (o, cur, _f) in enumerate(damaged):
                c.execute("UPDATE packs SET id=?, file=?, size=?, data_bytes=?, created=? WHERE id=? AND file=?",
                          (*o, cur, f"repair-{i}"))
        if aside is not None:
            os.rename(os.path.join(root, "packs", aside), os.path.join(root, "packs", file))
        with EmbeddedRepository(root) as repo:
            check_loads(repo, t["live"])
            assert repo.gc(grace=grace)["damaged"] == []
            check_loads(repo, t["live"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=st.integers(0, 4), how=DAMAGE, grace=st.sampled_from([0.0, None]))
def test_property_random_damage_gc_repair_loads_bit_exact(row, how, grace):
    damage_and_check(row, how, grace)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(row=st.integers(0, 4), how=DAMAGE, grace=st.sampled_from([0.0, None]))
def test_property_random_damage_gc_repair_loads_bit_exact_long(row, how, grace):
    damage_and_check(row, how, grace)
