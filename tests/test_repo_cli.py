"""``deepfreeze repo`` and ``repo import``, run for real: a repository filled by the numpy core,
and a checkpoint written by a real 2-rank Horovod training imported and loaded bit-exact."""
import json
import os
import subprocess
import sys

import numpy as np

from deepfreeze.repo import Repository, tensor_key
from deepfreeze.repo.importer import checkpoint_layers
from deepfreeze.tiers.persistent import PersistentLevel

from _util import ROOT, WORKERS, mpirun


def cli(*args, env=None):
    e = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join([ROOT, WORKERS]), **(env or {}))
    return subprocess.run([sys.executable, "-m", "deepfreeze", "repo", *args], capture_output=True, text=True,
                          timeout=300, env=e)


def fill(path):
    rng = np.random.default_rng(3)
    a = {"w": rng.standard_normal((300, 200)).astype(np.float32), "b": np.arange(7, dtype=np.int64)}
    with Repository(path) as r:
        r.put("mlp@v1", a)
        r.put("mlp@v2", {"w": a["w"], "b": a["b"] + 1})  # shares "w": de-duplicated
        r.put("cnn", {"k": rng.standard_normal(10)})
    return a


def test_ls_info_rm_gc(tmp_path):
    repo = str(tmp_path / "repo")
    a = fill(repo)
    p = cli("ls", repo)
    assert p.returncode == 0, p.stderr
    assert "mlp@v1" in p.stdout and "mlp@v2" in p.stdout and "cnn" in p.stdout
    p = cli("ls", repo, "--json")
    assert json.loads(p.stdout)["models"] == {"cnn": ["cnn"], "mlp": ["mlp@v1", "mlp@v2"]}
    p = cli("info", repo, "--json")
    info = json.loads(p.stdout)
    assert info["savings"] == 300 * 200 * 4 and info["names"] == 3
    p = cli("info", repo, "mlp@v2", "--json")
    assert json.loads(p.stdout)["deduplicated"] == 300 * 200 * 4
    p = cli("rm", repo, "mlp@v1")
    assert p.returncode == 0 and "deleted mlp@v1: freed" in p.stdout
    p = cli("info", repo, "mlp@v1")
    assert p.returncode == 1 and "mlp@v1" in p.stderr and "Traceback" not in p.stderr
    p = cli("gc", repo, "--json")
    assert p.returncode == 0, p.stderr
    with Repository(repo) as r:  # the shared tensor survives its first owner's deletion
        assert r.get("mlp@v2")["w"].tobytes() == a["w"].tobytes()
    p = cli("info", repo, "../etc")
    assert p.returncode == 1 and "must match" in p.stderr
    p = cli("ls", str(tmp_path / "nothing-here"))  # read commands never create a repository
    assert p.returncode == 1 and "nothing-here" in p.stderr and not (tmp_path / "nothing-here").exists()
    assert "create=False" not in p.stderr and "check the path" in p.stderr
    p = cli("info", repo, "nope")
    assert p.returncode == 1 and "deepfreeze repo ls" in p.stderr and "list()" not in p.stderr


def test_gc_recounts_reports_what_it_removed_and_damage(tmp_path):
    """``repo gc`` with tampered reference counts keeps every live model; it prints only what it
    removed or repaired; damaged rows make it exit 1 saying what to do, with nothing removed."""
    import sqlite3
    repo = str(tmp_path / "repo")
    a = fill(repo)
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:
        db.execute("UPDATE blobs SET refs=0")  # every count says 'unused'
    p = cli("gc", repo)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["nothing to remove",
                                     "repaired 4 stored reference counts (recounted from the models' rows)"]
    with Repository(repo) as r:
        assert r.get("mlp@v1")["w"].tobytes() == a["w"].tobytes() and r.get("mlp@v2")["b"].tobytes() == \
            (a["b"] + 1).tobytes() and len(r.get("cnn")["k"]) == 10
    p = cli("gc", repo)
    assert p.returncode == 0 and p.stdout == "nothing to remove\n", p.stdout
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:  # a deletion recorded the old way: blobs left
        (mid,) = db.execute("SELECT id FROM models WHERE name='cnn'").fetchone()
        db.execute("DELETE FROM tensors WHERE model=?", (mid,))
        db.execute("UPDATE models SET deleted=1 WHERE id=?", (mid,))
    p = cli("gc", repo, "--json")
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["blobs_removed"] == 1 and out["packs_removed"] == 1 and out["damaged"] == []
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:  # mlp@v2's "b" points to no blob
        db.execute("UPDATE tensors SET blob=9999 WHERE key='b' AND model=(SELECT id FROM models WHERE "
                   "name='mlp@v2')")
        blobs = db.execute("SELECT id, pack, offset, length, crc FROM blobs ORDER BY id").fetchall()
    p = cli("gc", repo)
    assert p.returncode == 1 and "nothing to remove" in p.stdout
    assert "'mlp@v2'" in p.stderr and "removed nothing" in p.stderr and "deepfreeze repo rm" in p.stderr
    assert "Traceback" not in p.stderr and "{" not in p.stdout + p.stderr
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:  # the blob v2's row lost included: all kept
        assert db.execute("SELECT id, pack, offset, length, crc FROM blobs ORDER BY id").fetchall() == blobs
    with Repository(repo) as r:
        assert r.get("mlp@v1")["b"].tobytes() == a["b"].tobytes()
        assert r.get("mlp@v2", ["w"])["w"].tobytes() == a["w"].tobytes()


def test_gc_removes_no_pack_for_a_damaged_row_lists_the_quarantine_and_restores(tmp_path):
    """A pack row naming ../../../../etc/passwd: ``repo gc`` removes no pack, says why, exits 1;
    repaired, gc moves the dead pack into the quarantine and lists it; ``--restore`` takes it back."""
    import sqlite3
    repo = str(tmp_path / "repo")
    a = fill(repo)
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:
        (mid,) = db.execute("SELECT id FROM models WHERE name='cnn'").fetchone()
        db.execute("DELETE FROM tensors WHERE model=?", (mid,))  # cnn deleted the old way: its pack is dead
        db.execute("UPDATE models SET deleted=1 WHERE id=?", (mid,))
        (pid, file) = db.execute("SELECT p.id, p.file FROM packs p JOIN blobs b ON b.pack=p.id JOIN tensors t ON "
                                 "t.blob=b.id JOIN models m ON m.id=t.model WHERE m.name='mlp@v1'").fetchone()
        db.execute("UPDATE packs SET file='../../../../etc/passwd' WHERE id=?", (pid,))
    before = sorted(os.listdir(os.path.join(repo, "packs")))
    p = cli("gc", repo)
    assert p.returncode == 1 and "removed no pack" in p.stderr and "etc/passwd" in p.stderr
    assert "Traceback" not in p.stderr and sorted(os.listdir(os.path.join(repo, "packs"))) == before
    with sqlite3.connect(os.path.join(repo, "meta.db")) as db:
        db.execute("UPDATE packs SET file=? WHERE id=?", (file, pid))
    p = cli("gc", repo)
    assert p.returncode == 0, p.stderr
    assert "into the quarantine" in p.stdout and "quarantine: 1 pack" in p.stdout
    (dead,) = set(before) - set(os.listdir(os.path.join(repo, "packs")))
    assert dead in p.stdout
    p = cli("gc", repo, "--restore", dead)
    assert p.returncode == 0 and f"restored {dead}" in p.stdout and "no row" in p.stderr
    assert dead in os.listdir(os.path.join(repo, "packs")) and os.listdir(os.path.join(repo, "quarantine")) == []
    p = cli("gc", repo, "--restore", "../meta.db")
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    p = cli("gc", "dstore://127.0.0.1:9", "--restore", dead)
    assert p.returncode == 2 and "repository directory" in p.stderr
    with Repository(repo) as r:
        assert r.get("mlp@v1")["w"].tobytes() == a["w"].tobytes()


def test_import_checkpoint_and_load_bit_exact(tmp_path):
    """A real 2-rank fit with checkpoints; the newest version imports with no model at hand
    (the manifest records the layer graph) and loads bit-exact into a model built with other
    auto-names; an older-style checkpoint (no graph) imports with --model."""
    out, old = tmp_path / "job", tmp_path / "old"
    # both fits (the second one writes no graph, as DeepFreeze did before manifests recorded it) in one
    # 2-rank run, one after the other (tests/workers/train.py: '+'): one TensorFlow and Horovod start-up
    mpirun(2, os.path.join(WORKERS, "train.py"), str(out), "sync", "every=4", "epochs=1", "samples=128",
           "+", str(old), "sync", "every=4", "epochs=1", "samples=128", "no_layers=1")
    sets = ["--set", f"scratch={out}/node0/scratch", "--set", f"persistent={out}/persistent"]
    pers = PersistentLevel(f"{out}/persistent")
    v = max(pers.committed_versions("job"))
    m = pers.read_manifest("job", v)
    rec = checkpoint_layers(m)
    assert rec is not None and len(rec["tensors"]) == m["model_tensors"]
    repo = str(tmp_path / "repo")
    p = cli("import", repo, "small@ckpt", "--name", "job", *sets)
    assert p.returncode == 0, p.stderr
    assert f"v{v}" in p.stdout and "hard-linked" in p.stdout
    p = subprocess.run([sys.executable, os.path.join(WORKERS, "repo_load.py"), repo, "small@ckpt",
                        f"{out}/expected/v{v}.npz"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["missing"] == []
    # the same name again: refused, nothing changed
    p = cli("import", repo, "small@ckpt", "--name", "job", *sets)
    assert p.returncode == 1 and "small@ckpt" in p.stderr
    # a checkpoint written without the graph: refused with what to do, then imported with --model
    sets = ["--set", f"scratch={old}/node0/scratch", "--set", f"persistent={old}/persistent"]
    p = cli("import", repo, "small@old", "--name", "job", *sets)
    assert p.returncode == 1 and "--model" in p.stderr
    p = cli("import", repo, "small@old", "--name", "job", "--model", "models:build", *sets)
    assert p.returncode == 0, p.stderr
    v = max(PersistentLevel(f"{old}/persistent").committed_versions("job"))
    p = subprocess.run([sys.executable, os.path.join(WORKERS, "repo_load.py"), repo, "small@old",
                        f"{old}/expected/v{v}.npz"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    with Repository(repo) as r:
        g = r.graph("small@ckpt")
        assert tensor_key(g["layers"][-1]["id"], 0) in r.specs("small@ckpt")
