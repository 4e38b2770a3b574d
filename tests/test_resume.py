"""Exact resume: uninterrupted vs killed mid-epoch and relaunched with resume=True, bit-identical."""
import os
import subprocess
import sys

import numpy as np
import pytest

from _util import WORKERS, mpirun

pytest.importorskip("tensorflow")


def run(*args, expect_kill=False):
    p = subprocess.run([sys.executable, f"{WORKERS}/resume.py", *args], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if expect_kill:
        assert p.returncode == -9, p.stderr[-3000:]
    else:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def final(out):
    with np.load(f"{out}/final.npz", allow_pickle=False) as z:
        return [z[f"arr_{i}"].tobytes() for i in range(len(z.files))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, module_runtime_dir):
    """The uninterrupted single-process run (no arguments: the same run for every test that compares
    with it), run once for the module: its directory and what it printed."""
    a = str(tmp_path_factory.mktemp("resume") / "straight")
    return a, run(a)


def test_killed_mid_epoch_then_relaunched_ends_bit_identical(tmp_path, straight):
    (a, stdout), b = straight, str(tmp_path / "killed")
    assert "resumed_from=None iterations=18" in stdout
    run(b, "kill_at=10", expect_kill=True)  # epoch 1, step 4 of 6; newest checkpoint v8
    assert not os.path.exists(f"{b}/final.npz")
    assert "resumed_from=8 iterations=18" in run(b, "resume=1")  # the relaunch, same command + resume
    assert final(a) == final(b)  # weights, optimizer slots and iteration counter


def test_resume_without_checkpoint_starts_fresh_and_at_epoch_boundary(tmp_path, straight):
    (a, _), b = straight, str(tmp_path / "killed")
    assert "resumed_from=None iterations=18" in run(b, "resume=1")  # nothing to resume: fresh
    assert final(a) == final(b)
    c = str(tmp_path / "boundary")
    run(c, "kill_at=13", expect_kill=True)  # newest checkpoint v12 = end of epoch 1
    assert "resumed_from=12 iterations=18" in run(c, "resume=1")
    assert final(a) == final(c)


@pytest.mark.mpi
def test_two_ranks_killed_and_resumed_bit_identical(tmp_path):
    a, b = str(tmp_path / "straight"), str(tmp_path / "killed")
    mpirun(2, f"{WORKERS}/resume.py", a, "hvd=1")
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "kill_at=10", check=False)
    assert p.returncode != 0 and not os.path.exists(f"{b}/final.npz")
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "resume=1")
    assert "resumed_from=8 iterations=18" in p.stdout
    assert final(a) == final(b)


def test_resume_from_epoch_end_of_a_dataset_of_unknown_length(tmp_path):
    """Epoch-end checkpoints of a dataset Keras cannot count are taken eagerly at epoch end;
    resuming from one continues with the next epoch."""
    tf = pytest.importorskip("tensorflow")
    sys.path.insert(0, WORKERS)
    from models import build
    from deepfreeze.keras import DeepFreezeCheckpoint

    def data():
        r = np.random.default_rng(0)
        x, y = r.random((48, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 48)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        return ds.filter(keep_all)  # cardinality unknown to Keras

    @tf.autograph.experimental.do_not_convert
    def keep_all(a, b):
        return True

    def fit(out, epochs, resume):
        tf.config.experimental.enable_op_determinism()
        model = build()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
        ck = DeepFreezeCheckpoint(name="u", every_n_batches=100, mode="sync", resume=resume,
                                  scratch=f"{out}/s", persistent=f"{out}/p")
        model.fit(data(), epochs=epochs, verbose=0, callbacks=[ck])
        ck.close()
        return model, ck

    a, _ = fit(tmp_path / "a", 3, False)
    fit(tmp_path / "b", 2, False)  # "killed" after 2 epochs: newest checkpoint = end of epoch 2
    b, ck = fit(tmp_path / "b", 3, True)
    # 7, not 6: in the first epoch of a dataset of unknown length Keras makes one more train call,
    # which ends with OutOfRange after the optimizer's iteration counter was incremented
    assert ck.resumed_from == 7
    assert [w.tobytes() for w in a.get_weights()] == [w.tobytes() for w in b.get_weights()]


def expected_match_checkpoints(out):
    """Every version recorded in the run (OUT/expected) restores bit-exact from persistent."""
    from deepfreeze import Config, load
    cfg = Config.load(None, env={}, mode="sync", scratch=f"{out}/node0/scratch", persistent=f"{out}/persistent")
    versions = sorted(int(n[1:-4]) for n in os.listdir(f"{out}/expected"))
    assert versions
    for v in versions:
        with np.load(f"{out}/expected/v{v}.npz", allow_pickle=False) as z:
            expected = [z[f"arr_{i}"].tobytes() for i in range(len(z.files))]
        assert [a.tobytes() for a in load(cfg, "r", v).model_arrays().values()] == expected, v
    return versions


@pytest.mark.mpi
def test_two_ranks_unbuilt_model_checkpoints_and_resumes_bit_identical(tmp_path):
    """A Sequential without Input (Horovod's examples) is built from the first batch's spec and
    set up before the first step; with resume=True it is restored before that step runs."""
    a, b = str(tmp_path / "straight"), str(tmp_path / "killed")
    p = mpirun(2, f"{WORKERS}/resume.py", a, "hvd=1", "lazy=1")
    assert "resumed_from=None iterations=18" in p.stdout
    assert expected_match_checkpoints(a) == [4, 6, 8, 12, 16, 18]
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "lazy=1", "kill_at=10", check=False)
    assert p.returncode != 0 and not os.path.exists(f"{b}/final.npz")
    p = mpirun(2, f"{WORKERS}/resume.py", b, "hvd=1", "lazy=1", "resume=1")
    assert "resumed_from=8 iterations=18" in p.stdout
    # one resume line for the job (rank 0), epochs numbered as Keras prints them (v8 = epoch 2, batch 2)
    assert p.stderr.count("DeepFreeze: resumed 'r' from v8") == 1
    assert "continuing in epoch 2 after its first 2 batches" in p.stderr
    assert final(a) == final(b)  # weights, optimizer slots and iteration counter: no step before the restore
    assert expected_match_checkpoints(b) == [4, 6, 8, 12, 16, 18]  # the relaunch's own checkpoints too
