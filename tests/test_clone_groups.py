"""DeepFreeze inside the groups of a split job, and a clone's parent record.

* A 4-rank job split by :func:`deepfreeze.clone.split` into two Horovod worlds of 2 ranks
  (``hvd.init(comm=group.comm)``): each group's ``DeepFreezeCheckpoint`` runs over a
  communicator derived from its group's, never over COMM_WORLD: partner redundancy
  within the group, world size 2, collective restore and resume inside the group.
* Horovod initialized with a list of ranks keeps no communicator DeepFreeze can derive
  its own from: a clear ConfigError.
* ``model._deepfreeze_parent`` (set by ``receive_clone``) is recorded in every manifest as
  ``"parent"``, bounded when read back, and shown by ``deepfreeze ls``/``inspect``.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from deepfreeze import Config, ConfigError
from deepfreeze.errors import CorruptCheckpointError
from deepfreeze.format import decode_manifest, encode_manifest, parent_problem
from deepfreeze.tiers.persistent import PersistentLevel
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.loader import load

from _util import ROOT, WORKERS, mpirun

sys.path.insert(0, WORKERS)

JOB = os.path.join(WORKERS, "split_checkpoint.py")
PARENT = {"name": "g0", "run": "0123456789abcdef", "step": 3}


def expected(out, name, v):
    with np.load(f"{out}/{name}/expected/v{v}.npz", allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "deepfreeze.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


@pytest.mark.mpi
def test_split_groups_checkpoint_with_partner_copies_and_resume_inside_the_group(tmp_path):
    out = str(tmp_path)
    mpirun(4, JOB, out, "train", timeout=600)
    arrays = {}
    for g in (0, 1):
        name = f"g{g}"
        infos = [json.load(open(f"{out}/{name}/rank{r}.json")) for r in (0, 1)]
        for r, i in enumerate(infos):
            assert (i["world_rank"], i["rank"], i["hvd_size"], i["world_size"]) == (2 * g + r, r, 2, 4)
            # DeepFreeze's communicator is the group's (a duplicate), not COMM_WORLD
            assert (i["comm_rank"], i["comm_size"]) == (r, 2)
            assert i["first"] == [4, 6] and i["second"] == [8, 12]
            # each rank's scratch held its own shard and the partner copy of the other rank's
            for v in (4, 6):
                assert i["listing"][f"v{v:012d}"] == sorted([f"h{r:06d}.r{1 - r:06d}.dfs", "manifest.json",
                                                             f"r{r:06d}.dfs"]), i["listing"]
            # rank 1's scratch was wiped: the collective load inside the group still found v6 on
            # scratch (rank 0's node holds rank 1's partner copy), bit-exact
            assert i["load"] == {"version": 6, "level": "scratch", "bit_exact": True}
            assert i["restore"] == {"version_step": [6, 6], "bit_exact": True}  # deepfreeze.restore, too
            # resume=True restored v6 collectively before the second fit, which went on from there
            assert i["resumed_from"] == 6 and i["restored_iterations"] == 6 and i["restored_exact"]
        # the second run's versions are partner-protected too, on both nodes (rank 1's rebuilt)
        for r in (0, 1):
            s = ScratchLevel(f"{out}/node{2 * g + r}/scratch")
            for v in (8, 12):
                assert f"h{r:06d}.r{1 - r:06d}.dfs" in os.listdir(s.version_dir(name, v))
        committed = PersistentLevel(f"{out}/persistent").committed_versions(name)
        assert committed == [4, 6, 8, 12]
        cfg = Config.load(None, mode="async", scratch=f"{out}/node{2 * g}/scratch", persistent=f"{out}/persistent")
        for v in committed:
            ck = load(cfg, name, v)
            m = ck.manifest
            assert m["world_size"] == 2 and [s["domain"] for s in m["shards"]] == [f"node{2 * g}", f"node{2 * g + 1}"]
            assert m["redundancy"]["scheme"] == "partner" and m["redundancy"]["holder"] == {"0": 1, "1": 0}
            assert m.get("parent") == (PARENT if g == 1 else None)
            got = [a.tobytes() for a in ck.model_arrays().values()]
            assert got == [e.tobytes() for e in expected(out, name, v)], f"{name} v{v} differs"
            arrays[(g, v)] = got
        # a single process restores the group's newest version from the first node's scratch alone
        ck = load(cfg, name)
        assert (ck.version, ck.level) == (12, "scratch")
    # the groups trained independently (other learning rate, other data)
    assert all(arrays[(0, v)] != arrays[(1, v)] for v in (4, 6, 8, 12))


@pytest.mark.mpi
def test_horovod_over_a_list_of_ranks_is_refused(tmp_path):
    """``hvd.init(comm=[0, 1])`` in a 4-rank job: Horovod keeps no mpi4py communicator, so
    DeepFreeze cannot run its exchanges over Horovod's ranks: ConfigError, nothing written."""
    mpirun(4, JOB, str(tmp_path), "ranklist")
    for w in range(4):
        with open(tmp_path / f"ranklist_w{w}.json") as f:
            msg = json.load(f).get("refused", "")
        assert "Horovod has 2 ranks" in msg and "MPI_COMM_WORLD has 4" in msg, (w, msg)
        assert "deepfreeze.clone.split(...).comm" in msg, msg
    assert not os.path.exists(tmp_path / "persistent" / "l0") and not os.path.exists(tmp_path / "persistent" / "l1")


# -- a clone's parent record (one process)

def test_parent_record_is_bounded():
    assert parent_problem(PARENT) is None
    assert parent_problem({"name": None, "run": "", "step": 0}) is None
    for bad, why in [([1], "not an object"), ({**PARENT, "x": 1}, "unknown key"),
                     ({**PARENT, "name": "../etc"}, "'name'"), ({**PARENT, "name": "a" * 201}, "'name'"),
                     ({**PARENT, "name": 5}, "'name'"), ({**PARENT, "run": "xyz"}, "'run'"),
                     ({**PARENT, "run": "0" * 10_000}, "'run'"), ({**PARENT, "step": -1}, "'step'"),
                     ({**PARENT, "step": 1 << 62}, "'step'"), ({**PARENT, "step": True}, "'step'"),
                     ({**PARENT, "step": 3.0}, "'step'"), ({"name": "g0", "run": "0123456789abcdef"}, "'step'")]:
        assert why in parent_problem(bad), bad


def _manifest(parent):
    from deepfreeze.format import build_manifest
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", (3,))], 1)
    return build_manifest("c", 1, 1, 0, plan, ["n"], extra={"parent": parent})


def test_manifest_with_a_hostile_parent_is_not_a_manifest():
    assert decode_manifest(encode_manifest(_manifest(PARENT)))["parent"] == PARENT
    for bad in [{**PARENT, "name": "a/b"}, {**PARENT, "step": "3"}, "g0", {**PARENT, "extra": [1] * 100}]:
        with pytest.raises(CorruptCheckpointError, match="'parent' malformed"):
            decode_manifest(encode_manifest(_manifest(bad)))


@pytest.mark.scratch_files("reads the parent from the scratch manifests too")
def test_clone_parent_recorded_in_every_manifest_and_shown_by_ls_and_inspect(tmp_path):
    tf = pytest.importorskip("tensorflow")
    from deepfreeze.keras import DeepFreezeCheckpoint
    from models import build
    dirs = dict(scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "pfs"))
    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    model._deepfreeze_parent = dict(PARENT)
    ckpt = DeepFreezeCheckpoint(name="clone1", every_n_batches=2, mode="sync", **dirs)
    r = np.random.default_rng(0)
    model.fit(r.random((64, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 64), batch_size=16, epochs=1,
              verbose=0, callbacks=[ckpt])  # v2, v4
    ckpt.close()
    cfg = Config.load(None, mode="sync", **dirs)
    for v in (2, 4):
        assert load(cfg, "clone1", v).manifest["parent"] == PARENT
        assert ScratchLevel(dirs["scratch"]).read_manifest("clone1", v)["parent"] == PARENT
    sets = ["--set", f"scratch={dirs['scratch']}", "--set", f"persistent={dirs['persistent']}"]
    text = cli("inspect", "--name", "clone1", *sets)
    assert "cloned from 'g0' run 0123456789abcdef step 3" in text.splitlines()[1], text
    js = json.loads(cli("inspect", "--name", "clone1", "--json", *sets))
    assert js["parent"] == PARENT and js["version"] == 4
    text = cli("ls", "--name", "clone1", *sets)
    assert text.count("cloned from 'g0' run 0123456789abcdef step 3") == 4, text  # 2 versions x 2 levels
    js = json.loads(cli("ls", "--json", *sets))
    assert [c["parent"] for c in js["checkpoints"][0]["versions"]] == [PARENT] * 4


def test_malformed_parent_on_the_model_is_a_config_error(tmp_path):
    tf = pytest.importorskip("tensorflow")
    from deepfreeze.keras import DeepFreezeCheckpoint
    from models import build
    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    model._deepfreeze_parent = {"name": "g0", "run": "0123456789abcdef", "step": "3"}
    ckpt = DeepFreezeCheckpoint(name="clone2", every_n_batches=2, mode="sync", scratch=str(tmp_path / "s"),
                                persistent=str(tmp_path / "p"))
    r = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="_deepfreeze_parent .* malformed .*'step'"):
        model.fit(r.random((32, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 32), batch_size=16, epochs=1,
                  verbose=0, callbacks=[ckpt])
    ckpt.close()
    assert PersistentLevel(str(tmp_path / "p")).committed_versions("clone2") == []
