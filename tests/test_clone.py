"""DeepClone: the plan (pure), the numpy transfer and the Keras + Horovod clone (real MPI jobs).

Every clone is compared bit for bit with the state the source recorded at the clone step."""
import glob
import json
import os
import sys
import time

import numpy as np
import pytest

from deepfreeze.clone import ClonePlan
from deepfreeze.clone.plan import first_difference
from deepfreeze.shardplan import TensorSpec

from _util import WORKERS, mpirun

SPECS = [TensorSpec(0, "big", "float32", (300, 1001)), TensorSpec(1, "prime", "float64", (100003,)),
         TensorSpec(2, "small", "int32", (7,)), TensorSpec(3, "empty", "float32", (0, 3)),
         TensorSpec(4, "scalar", "int64", ()), TensorSpec(5, "bn", "float32", (50000,))]


@pytest.mark.parametrize("n,m", [(1, 1), (2, 2), (2, 1), (1, 2), (2, 3), (3, 2), (4, 4)])
def test_plan_routes_tile_every_tensor_once_and_partition_matches(n, m):
    p = ClonePlan(SPECS, n, m, whole=[5], threshold=1024)
    for t in SPECS:
        routes = [r for r in p.routes if r.tensor_id == t.id]
        cover = np.zeros(t.size, int)
        for r in routes:
            cover[r.start:r.stop] += 1
            assert 0 <= r.src < n and 0 <= r.dst < m
            # a clone rank receives exactly its own all-gather range
            assert p.partition[t.id][r.dst][0] <= r.start and r.stop <= p.partition[t.id][r.dst][1]
        assert (cover == 1).all(), t
        parts = np.zeros(t.size, int)
        for a, b in p.partition[t.id]:
            parts[a:b] += 1
        assert (parts == 1).all()
    assert all(r.src == 0 for r in p.routes if r.tensor_id == 5)  # not replicated: from source rank 0
    # large tensors: one message per (source range, clone range) intersection, each clone ~1/M
    big = [r for r in p.routes if r.tensor_id == 0]
    assert len(big) == n + m - 1 if n != m else len(big) == n
    total = sum(s.nbytes for s in SPECS)
    assert sum(p.dst_bytes) == total and max(p.dst_bytes) < total / m + 50000 * 4


def test_plan_digest_and_first_difference_name_the_tensor():
    a = ClonePlan(SPECS, 2, 2)
    b = ClonePlan(SPECS[:1] + [TensorSpec(1, "prime", "float64", (100004,))] + SPECS[2:], 2, 2)
    assert a.digest() == ClonePlan(list(SPECS), 2, 2).digest() and a.digest() != b.digest()
    assert "tensor #1" in first_difference(a.describe(), b.describe())
    assert "n_clone" in first_difference(a.describe(), ClonePlan(SPECS, 2, 1).describe())
    assert a.digest() != ClonePlan(SPECS, 2, 2, threshold=1).digest()


def _ranks(out, sizes):
    """Every rank's result file (OUT/g<group>r<rank>.json, written by the worker), by (group, rank)."""
    res = {}
    for g, n in enumerate(sizes):
        for r in range(n):
            with open(f"{out}/g{g}r{r}.json") as f:
                res[(g, r)] = json.load(f)
    return res


@pytest.mark.mpi
@pytest.mark.parametrize("np_,sizes", [(4, (2, 2)), (3, (2, 1)), (5, (2, 3)), (3, (1, 1, 1))])
def test_numpy_clone_is_bitexact_at_any_group_sizes(tmp_path, np_, sizes):
    mpirun(np_, f"{WORKERS}/clone_numpy.py", str(tmp_path), ",".join(map(str, sizes)), timeout=120)
    res = _ranks(tmp_path, sizes)
    assert all(not r["errors"] for r in res.values()), res
    clones = [r for (g, _), r in res.items() if g > 0]
    assert len(clones) == sum(sizes[1:]) and all(r["bitexact"] for r in clones), clones
    assert all(r["info"] == {"step": 12, "epoch": 1, "run": "abcd"} for r in clones)


@pytest.mark.mpi
def test_numpy_clone_mismatch_and_abort_fail_on_both_sides_quickly(tmp_path):
    for d in "ma":
        os.mkdir(tmp_path / d)
    mpirun(4, f"{WORKERS}/clone_numpy.py", str(tmp_path / "m"), "2,2", "mismatch", timeout=120)
    res = _ranks(tmp_path / "m", (2, 2))
    for r in res.values():  # both source ranks, both clone ranks
        (kind, msg, t), = r["errors"]
        assert kind == "ModelMismatchError" and t < 30, r
    msg = res[(0, 0)]["errors"][0][1]  # the source's view
    assert "tensor #1 is 'prime' float64 (100003,) here and 'prime' float64 (100004,) there" in msg, msg
    mpirun(3, f"{WORKERS}/clone_numpy.py", str(tmp_path / "a"), "1,2", "abort", timeout=120)
    res = _ranks(tmp_path / "a", (1, 2))
    for r in (res[(1, 0)], res[(1, 1)]):
        (kind, msg, t), = r["errors"]
        assert kind == "CloneError" and msg.startswith("the source group gave up the clone: test: the source's fit "
                                                       "ended at step 3") and t < 30, r  # never the 30 s timeout


@pytest.mark.mpi
def test_clone_timeout_is_a_clear_error_on_both_sides(tmp_path):
    mpirun(3, f"{WORKERS}/clone_numpy.py", str(tmp_path), "1,2", "timeout", timeout=120)
    res = _ranks(tmp_path, (1, 2))
    (kind, msg, _), = res[(0, 0)]["errors"]
    assert kind == "CloneTimeoutError" and "clone_timeout=2 s" in msg and "[1, 2]" in msg, msg
    for r in (res[(1, 0)], res[(1, 1)]):
        (kind, msg, _), = r["errors"]
        assert kind == "CloneTimeoutError" and "did not arrive within clone_timeout=2 s" in msg and "[0]" in msg, msg


@pytest.mark.mpi
@pytest.mark.parametrize("dead", ["source", "clone"])
def test_a_dead_rank_leaves_no_survivor_waiting_in_deepfreeze(tmp_path, dead):
    """Open MPI 4.1 has no fault-tolerant MPI; under ``--enable-recovery`` the job outlives a
    dead rank (rank 1 of one group, SIGKILLed after the hello). Every survivor ends its waits
    (timeout 4 s: the clone group's agreement waits at most 2 x that) with an error naming
    what it waited for, writes its result and exits: mpirun returns (its own timeout: 120 s).
    The surviving source rank learns it too (the source agreement), not only in Horovod's next
    all-reduce (issue 32 case 6)."""
    p = mpirun(4, f"{WORKERS}/clone_numpy.py", str(tmp_path), "2,2", f"dead={dead}", timeout=120, check=False,
               options=("--enable-recovery",))
    res = {k: json.load(open(f"{tmp_path}/g{k[0]}r{k[1]}.json")) for k in [(0, 0), (0, 1), (1, 0), (1, 1)]
           if os.path.exists(f"{tmp_path}/g{k[0]}r{k[1]}.json")}
    died = (0, 1) if dead == "source" else (1, 1)
    assert set(res) == {(0, 0), (0, 1), (1, 0), (1, 1)} - {died}, (res, p.stdout, p.stderr)
    assert all(r["seconds"] < 8 + 5 for r in res.values()), res  # bounded: 2 x timeout, plus slack
    if dead == "source":
        (kind, msg, _), = res[(0, 0)]["errors"]  # its own sends completed; the source agreement names the dead
        assert kind == "CloneTimeoutError" and "source rank(s) [1] did not finish the clone" in msg, msg
        (kind, msg, _), = res[(1, 1)]["errors"]  # waited for the dead source rank's data: names it
        assert kind == "CloneTimeoutError" and "source parent rank(s) [1]" in msg, msg
        (kind, msg, _), = res[(1, 0)]["errors"]  # had all its data; learns that its peer failed
        assert kind == "CloneError" and "clone rank(s) [1] of this clone group did not receive" in msg, msg
    else:
        (kind, msg, _), = res[(0, 1)]["errors"]  # its sends to the dead clone rank never complete
        assert kind == "CloneTimeoutError" and "clone sends not received within clone_timeout=4 s" in msg, msg
        (kind, msg, _), = res[(1, 0)]["errors"]  # the clone group's agreement: the dead rank never answers
        assert kind == "CloneTimeoutError" and "of this clone group" in msg and "2 x clone_timeout = 8 s" in msg, msg


def _load(path):
    with np.load(path, allow_pickle=False) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _same(a, b):
    return [i for i, (x, y) in enumerate(zip(a, b)) if x.dtype != y.dtype or x.tobytes() != y.tobytes()]


def _check_clone_equals_source_rank0(out, clone_group, ranks):
    src = _load(f"{out}/source_r0_K.npz")
    for r in range(ranks):
        got = _load(f"{out}/clone{clone_group}_r{r}_K.npz")
        assert len(got) == len(src) and not _same(got, src), f"clone {clone_group} rank {r} differs at {_same(got, src)}"


def _json(out, who, rank):
    with open(f"{out}/{who}_r{rank}.json") as f:
        return json.load(f)


def _jobs_in_one_run(root, np_, jobs, timeout):
    """Run ``jobs`` ({label: clone_keras.py arguments after OUT}) one after the other in one mpirun
    of ``np_`` ranks (tests/workers/clone_keras.py: ``+``-separated jobs, each with a new split and
    Horovod initialized again over its group), each in its own directory root/<label>: one
    TensorFlow and Horovod start-up for all of them (about 8 CPU-s a rank each). Returns
    ({label: directory}, the finished mpirun) for :func:`_ran`."""
    args, outs = [], {}
    for label, job in jobs.items():
        outs[label] = str(root / label)
        os.mkdir(outs[label])
        args += (["+"] if args else []) + [outs[label], *job]
    return outs, mpirun(np_, f"{WORKERS}/clone_keras.py", *args, timeout=timeout, check=False)


def _ran(jobs, label):
    """The directory of job ``label`` of a :func:`_jobs_in_one_run` fixture; fails the test with the
    run's output if the run failed (as ``mpirun(check=True)`` did in the test itself)."""
    outs, p = jobs
    if p.returncode != 0:
        pytest.fail(f"{' '.join(p.args)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                    f"stderr:\n{p.stderr[-6000:]}")
    return outs[label]


@pytest.fixture(scope="module")
def clone_2_to_2(tmp_path_factory, module_runtime_dir):
    """The 2 -> 2 job on each write path (the write_once fixture's: ``auto`` without
    VELOC_WRITE_ONCE, ``off`` with VELOC_WRITE_ONCE=off in the job's environment), one after the
    other in one 4-rank mpirun (:func:`_jobs_in_one_run`)."""
    job = ["2,2", "8", "continue=1", "ckpt=1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VELOC_WRITE_ONCE", raising=False)  # auto: the environment as the user gets it
        return _jobs_in_one_run(tmp_path_factory.mktemp("clone_2_to_2"), 4,
                                {"auto": job, "off": job + ["env.VELOC_WRITE_ONCE=off"]}, timeout=800)


@pytest.mark.mpi
@pytest.mark.timeout(1200)  # the first of the two waits for both jobs (:func:`clone_2_to_2`)
def test_keras_clone_2_to_2_bitexact_continues_identically_and_overlaps_backprop(clone_2_to_2, write_once):
    """Conv1D, BatchNormalization, Dense, a prime-sized bias, a layer without gradient and a
    frozen one; Adam (two slots per weight and the step counter); DeepFreezeCheckpoint in
    the source's fit and in the clones' continuation, on both write paths (the write_once fixture
    names the path, :func:`clone_2_to_2` ran its job)."""
    out = _ran(clone_2_to_2, write_once)
    _check_clone_equals_source_rank0(out, 1, 2)
    src_final = _load(f"{out}/source_r0_final.npz")
    # the clone trained on from step 8 with the same data and hyperparameters: bit for bit the source's
    assert not _same(_load(f"{out}/clone1_r0_final.npz"), src_final)
    src1_final = _load(f"{out}/source_r1_final.npz")
    rep = [i for i in range(len(src_final)) if src_final[i].tobytes() == src1_final[i].tobytes()]
    assert len(rep) >= len(src_final) - 2  # all but BatchNormalization's per-rank moving statistics
    c1 = _load(f"{out}/clone1_r1_final.npz")
    assert all(c1[i].tobytes() == src_final[i].tobytes() for i in rep)
    info = _json(out, "clone1", 0)["info"]
    assert info["step"] == 8 and (info["epoch"], info["epoch_step"], info["epoch_complete"]) == (1, 2, False)
    total = sum(a.nbytes for a in _load(f"{out}/source_r0_K.npz"))
    for r in range(2):
        src = _json(out, "source", r)["timings"]
        # the first send of step 8 was posted before that step's last variable update finished
        first_post = min(v[2] for v in src["variables"])
        last_update = max(v[1] for v in src["variables"])
        assert first_post < last_update, src["variables"]
        got = _json(out, "clone1", r)["timings"]["bytes_received"]
        assert abs(got - total / 2) < 0.2 * total / 2, (got, total)  # each clone rank receives ~1/M
    # both groups' checkpoints: every committed version equals the weights recorded in the run
    from deepfreeze import Config
    from deepfreeze.tiers.persistent import PersistentLevel
    from deepfreeze.loader import load
    cfg = Config.load(None, mode="async", scratch=f"{out}/g0r0/scratch", persistent=f"{out}/persistent")
    for name, ref in (("src", "expected"), ("clone1", "expected_clone1")):
        committed = PersistentLevel(f"{out}/persistent").committed_versions(name)
        assert committed, name
        for v in committed:
            ck = load(cfg, name, v)
            assert not _same(list(ck.model_arrays().values()), _load(f"{out}/{ref}/v{v}.npz")), (name, v)
    clone_ck = load(cfg, "clone1")
    assert min(PersistentLevel(f"{out}/persistent").committed_versions("clone1")) > 8
    # the clone's checkpoints name their parent: the source's checkpoint name and run, and the step
    src_run = load(cfg, "src").manifest["run"]["id"]
    assert info["source_name"] == "src" and info["source_run"] == src_run
    assert clone_ck.manifest.get("parent") == {"name": "src", "run": src_run, "step": 8}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory, module_runtime_dir):
    """The 3-rank jobs of the two tests below, one after the other in one mpirun (:func:`_jobs_in_one_run`)."""
    return _jobs_in_one_run(tmp_path_factory.mktemp("three_ranks"), 3,
                            {"2to1": ["2,1", "10", "bad=1"], "groups3": ["1,1,1", "e1"]}, timeout=600)


@pytest.mark.mpi
@pytest.mark.timeout(900)  # the first of the two waits for both jobs
def test_keras_clone_2_to_1_and_clone_step_errors(three_ranks):
    out = _ran(three_ranks, "2to1")
    _check_clone_equals_source_rank0(out, 1, 1)
    for r in range(2):  # on both source ranks
        errors = dict(_json(out, "source", r)["configerrors"])
        assert len(errors) == 4, errors
        assert "first step of this fit" in errors["first-step"], errors
        assert "exactly one of at_step" in errors["{'at_step': 3, 'at_epoch_end': 1}"], errors
    total = sum(a.nbytes for a in _load(f"{out}/source_r0_K.npz"))
    assert _json(out, "clone1", 0)["timings"]["bytes_received"] == total


@pytest.mark.mpi
@pytest.mark.timeout(900)  # the first of the two waits for both jobs
def test_keras_three_groups_at_epoch_end(three_ranks):
    out = _ran(three_ranks, "groups3")
    for g in (1, 2):
        _check_clone_equals_source_rank0(out, g, 1)
        info = _json(out, f"clone{g}", 0)["info"]
        assert info["step"] == 12 and info["epoch"] == 1 and info["epoch_complete"], info


@pytest.mark.mpi
def test_keras_model_mismatch_is_an_error_on_both_sides(tmp_path):
    out = str(tmp_path)
    t0 = time.monotonic()
    mpirun(2, f"{WORKERS}/clone_keras.py", out, "1,1", "8", "mismatch=1", timeout=300)
    for who in ("source", "clone1"):
        err = _json(out, who, 0).get("error", "")
        assert err.startswith("ModelMismatchError") and "(112, 64)" in err and "(112, 65)" in err, err
    assert time.monotonic() - t0 < 200  # well below the clone timeout (120 s) on both sides, plus start-up


@pytest.mark.mpi
def test_rank_killed_mid_transfer_ends_the_job_with_an_error_and_no_corrupt_checkpoint(tmp_path):
    out = str(tmp_path)
    t0 = time.monotonic()
    p = mpirun(2, f"{WORKERS}/clone_keras.py", out, "1,1", "8", "kill=clone", "ckpt=1", timeout=300,
               check=False)
    assert p.returncode != 0 and os.path.exists(f"{out}/clone1_r0.killed"), p.stdout + p.stderr
    assert time.monotonic() - t0 < 280
    # the source's checkpoints: whatever was committed is bit-exact what the run recorded
    from deepfreeze import Config
    from deepfreeze.tiers.persistent import PersistentLevel
    from deepfreeze.loader import load
    cfg = Config.load(None, mode="async", scratch=f"{out}/g0r0/scratch", persistent=f"{out}/persistent")
    for v in PersistentLevel(f"{out}/persistent").committed_versions("src"):
        assert not _same(list(load(cfg, "src", v).model_arrays().values()), _load(f"{out}/expected/v{v}.npz"))
    assert not glob.glob(f"{out}/clone1_r0_K.npz")
    assert os.path.exists(f"{out}/expected")


HVD_FIX = "hvd.init(comm=group.comm)"
MISTAKES = ["late=source", "late=clone", "stall=clone", "hvd=world"]  # hvd=world last: Horovod over the world


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, module_runtime_dir):
    """The 2-rank jobs (groups 1,1, clone at step 8) of the unbuilt-model test and of the mistakes
    (clone_timeout=6 s), one after the other in one mpirun (:func:`_jobs_in_one_run`); a mistake's
    job takes about 20 s alone (its timeouts: 6 + 4 s), several times that beside other work."""
    jobs = {"unbuilt": ["1,1", "8", "unbuilt=1", "ckpt=1"]}
    jobs.update({m: ["1,1", "8", "timeout=6", m] for m in MISTAKES})
    return _jobs_in_one_run(tmp_path_factory.mktemp("two_ranks"), 2, jobs, timeout=1200)


@pytest.mark.mpi
@pytest.mark.timeout(1500)  # the first test of the five waits for all five jobs (:func:`two_ranks`)
@pytest.mark.parametrize("mistake,source_error,clone_error", [
    # Horovod over every group instead of each group's communicator: deadlocked silently before
    ("hvd=world", ("ConfigError", "CloneCallback: Horovod's world is not this group's"),
     ("ConfigError", "receive_clone: Horovod's world is not this group's")),
    # the source reaches step K after the clone's clone_timeout: the clone tells it why
    ("late=source", ("CloneError", "clone group 1 rank 0 (parent rank 1) gave up the clone: CloneTimeoutError"),
     ("CloneTimeoutError", "the clone did not arrive within clone_timeout=6 s")),
    # the clone calls receive_clone after the source's clone_timeout: the source tells it why
    ("late=clone", ("CloneTimeoutError", "waiting for the clone groups' hello: no answer within clone_timeout=6 s"),
     ("CloneError", "the source group gave up the clone: source rank 0 failed: CloneTimeoutError")),
    # the clone takes no data: the source's wait inside the train step times out (was TensorFlow's UnknownError)
    ("stall=clone", ("CloneTimeoutError", "clone sends not received within clone_timeout=6 s"),
     ("CloneTimeoutError", "test: this clone rank stalled")),
])
def test_keras_clone_mistakes_leave_fit_and_receive_clone_with_deepfreeze_errors(two_ranks, mistake, source_error,
                                                                                  clone_error):
    """Each mistake ends both sides, within the timeouts, with DeepFreeze's own exception (its
    type and message as written by each rank, never TensorFlow's wrapper of it). The jobs are
    the module's (:func:`two_ranks`), this test reads its own."""
    out = _ran(two_ranks, mistake)
    for who, (kind, text) in (("source", source_error), ("clone1", clone_error)):
        err = _json(out, who, 0).get("error", "")
        assert err.startswith(f"{kind}: ") and text in err, (who, err)
        if mistake == "hvd=world":
            assert HVD_FIX in err, err
    assert not glob.glob(f"{out}/clone1_r0_K.npz")  # no clone state was taken for a received one


@pytest.mark.mpi
@pytest.mark.timeout(1500)  # the first test of the five waits for all five jobs (:func:`two_ranks`)
def test_keras_clone_of_an_unbuilt_model_is_built_from_the_input_spec(two_ranks):
    """A Sequential model without Input (Horovod's examples): the source's fit builds it at
    its first step (CloneCallback and DeepFreezeCheckpoint both set up there, each from the
    input's shape, by the one build function), the clone passes input_spec=dataset."""
    out = _ran(two_ranks, "unbuilt")
    _check_clone_equals_source_rank0(out, 1, 1)
    assert _json(out, "clone1", 0)["info"]["step"] == 8
    from deepfreeze.tiers.persistent import PersistentLevel
    assert PersistentLevel(f"{out}/persistent").committed_versions("src")  # the checkpoint was set up too


@pytest.mark.mpi
def test_clone_example_runs_as_documented():
    """examples/clone_example.py, run as docs/clone.md says (3 ranks: 2 source, 1 clone)."""
    p = mpirun(3, os.path.join(os.path.dirname(WORKERS), "..", "examples", "clone_example.py"), timeout=400)
    # each group's rank 0 prints one line; checked by substring (lines of two processes may share a line)
    assert "source: cloned at step 10 (" in p.stdout and ", trained to step 16, loss " in p.stdout, p.stdout
    assert "clone: received step 10 (epoch 1, batch 2) from run " in p.stdout, p.stdout
    assert "trained to step 16 with lr 0.0005" in p.stdout, p.stdout


@pytest.mark.mpi
def test_on_peer_loss_exit_ends_every_survivor_with_exit_code_75_within_the_bound(tmp_path):
    """Issue 32 case 6: under ``--enable-recovery`` a surviving source rank hung in Horovod's next
    all-reduce after a source rank died during the clone. With DEEPFREEZE_ON_PEER_LOSS=exit every
    rank that sees the loss ends its own process: exit code 75, within the wait's bound (the
    source agreement: clone_timeout = 4 s; the clone group's agreement: 2 x that), with the
    named error logged. A wrapper per rank (workers/exit_code.py) records how each ended."""
    from deepfreeze import peerloss
    p = mpirun(4, f"{WORKERS}/exit_code.py", str(tmp_path), sys.executable, f"{WORKERS}/clone_numpy.py",
               str(tmp_path), "2,2", "dead=source", timeout=120, check=False, options=("--enable-recovery",),
               env={"DEEPFREEZE_ON_PEER_LOSS": "exit"})
    ends = {}
    for w in range(4):
        path = tmp_path / f"exit{w}.json"
        assert path.exists(), (w, p.stdout[-3000:], p.stderr[-3000:])
        ends[w] = json.loads(path.read_text())
    assert ends[1]["rc"] == -9, ends  # source rank 1 SIGKILLed itself after the hello
    for w in (0, 2, 3):  # source rank 0 (source agreement), clone ranks 0 and 1 (the clone group's agreement)
        assert ends[w]["rc"] == peerloss.EXIT_CODE and ends[w]["seconds"] < 2 * 4 + 10, (w, ends)
        err = (tmp_path / f"stderr{w}.txt").read_text()
        assert "a peer is lost: Clone" in err and "DEEPFREEZE_ON_PEER_LOSS=exit" in err and "exit code 75" in err, err
    assert "source rank(s) [1] did not finish the clone" in (tmp_path / "stderr0.txt").read_text()
    # none of them got as far as writing its result: each ended inside DeepFreeze, at the loss
    assert not list(tmp_path.glob("g*r*.json")), list(tmp_path.glob("g*r*.json"))


def test_on_peer_loss_is_checked_when_a_transfer_starts(monkeypatch):
    from deepfreeze import peerloss
    from deepfreeze.errors import ConfigError
    monkeypatch.setenv(peerloss.ENV, "exit")
    assert peerloss.policy() == "exit"
    monkeypatch.setenv(peerloss.ENV, "")
    assert peerloss.policy() == "raise"
    monkeypatch.setenv(peerloss.ENV, "quit")
    with pytest.raises(ConfigError, match="DEEPFREEZE_ON_PEER_LOSS='quit'"):
        peerloss.policy()
