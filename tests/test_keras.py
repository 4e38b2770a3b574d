"""The Keras adapter in one process (no Horovod initialized: one rank)."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import deepfreeze  # noqa: E402
from deepfreeze import ConfigError, ModelMismatchError  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.tiers.persistent import PersistentLevel  # noqa: E402
from deepfreeze.tiers.scratch import ScratchLevel  # noqa: E402
from deepfreeze.fused import FusedLayout  # noqa: E402
from deepfreeze.loader import load  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from models import build  # noqa: E402


def data(n=96):
    r = np.random.default_rng(0)
    return r.random((n, 12, 12, 1), dtype=np.float32), r.integers(0, 10, n)


class Record(tf.keras.callbacks.Callback):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt, self.weights = ckpt, {}

    def on_train_batch_end(self, batch, logs=None):
        v = self.ckpt.last_version
        if v is not None and v not in self.weights:
            self.weights[v] = [w.copy() for w in self.model.get_weights()]

    on_epoch_end = on_train_batch_end


def dirs(tmp_path):
    return dict(scratch=str(tmp_path / "scratch"), persistent=str(tmp_path / "pfs"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fit_checkpoints_every_n_and_epoch_end_bit_exact(tmp_path, mode):
    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=4, mode=mode, min_shard_bytes=0, **dirs(tmp_path))
    rec = Record(ckpt)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[ckpt, rec], verbose=0)  # 6 steps per epoch
    assert [t["version"] for t in ckpt.timings] == [4, 6, 8, 12]  # every 4 steps + epoch ends (6, 12)
    ckpt.wait()
    cfg = ckpt.config
    assert PersistentLevel(cfg.persistent).committed_versions("k") == [4, 6, 8, 12]
    for v, expected in rec.weights.items():
        ck = load(cfg, "k", v)
        assert [a.tobytes() for a in ck.model_arrays().values()] == [e.tobytes() for e in expected]
        assert ck.manifest["epoch_complete"] == (v in (6, 12))
    # the hook is gone after fit; the optimizer kept its class and config
    assert type(model.optimizer).__name__ == "SGD" and "_update_step" not in model.optimizer.__dict__
    assert all("deepfreeze" not in v.name for v in model.optimizer.variables())
    # restore into a fresh model, in this process
    fresh = build()
    version, step = deepfreeze.restore(fresh, name="k", mode=mode, **dirs(tmp_path))
    assert (version, step) == (12, 12)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(fresh.get_weights(), rec.weights[12]))
    ckpt.close()


def capture_modes():
    from deepfreeze.keras import native
    why = native.unavailable_reason() if native.load() is None else None
    return ["graph", pytest.param("native", marks=pytest.mark.skipif(
        why is not None, reason=f"DeepFreeze's TF op is not built: {why}"))]


def test_unarmed_steps_capture_nothing_and_the_buffer_holds_its_step(tmp_path):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=3, at_epoch_end=False, mode="sync", capture="graph",
                                **dirs(tmp_path))
    x, y = data(64)
    seen = {}

    class Peek(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen[batch] = np.asarray(ckpt.sink.buffer.value()).copy()

    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, Peek()], verbose=0)  # steps 1..4, ckpt at step 3
    assert [t["version"] for t in ckpt.timings] == [3]
    assert seen[0].size == 0 and seen[1].size == 0  # not armed: the capture did not run
    layout = FusedLayout.build(ckpt.plan, 0)
    assert seen[2].size == layout.nbytes and int(seen[2][:8].view("<i8")[0]) == 3  # stamped step 3
    assert seen[2].tobytes() == seen[3].tobytes()  # and nothing changed the buffer after
    assert len(ckpt.quiet_times) == 3 and all(0 < t < 1 for t in ckpt.quiet_times)  # batches without a checkpoint
    ckpt.close()


class HoldingScratch(ScratchLevel):
    """Keeps every array list / capture buffer the writer was given (as a slow consumer would)
    and writes slowly, so the write queue is full while later steps capture."""
    held = []

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        HoldingScratch.held.append((version, arrays))
        time.sleep(0.05)
        return super().write_shard(name, version, rank, plan, arrays, **kw)


@pytest.mark.parametrize("capture", capture_modes())
@pytest.mark.scratch_files("the held captures are observed in the scratch write (scratch_cls)")
def test_held_captures_are_never_overwritten(tmp_path, capture):
    """Captures handed to the engine stay unchanged while the next steps capture: those go to
    other buffers (a fresh TF buffer, or a free pool buffer), never into a held one."""
    HoldingScratch.held = []
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=1, at_epoch_end=False, mode="async", max_inflight=3,
                                min_shard_bytes=0, capture=capture, scratch_cls=HoldingScratch, **dirs(tmp_path))
    rec = Record(ckpt)
    x, y = data(96)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, rec], verbose=0)  # 6 steps
    ckpt.wait()
    assert [v for v, _ in HoldingScratch.held] == [1, 2, 3, 4, 5, 6]
    plan = ckpt.plan
    for v, arrays in HoldingScratch.held:
        pieces = arrays.pieces() if hasattr(arrays, "pieces") else arrays
        expected = rec.weights[v]
        for p, a in zip(plan.for_rank(0), pieces):
            if p.tensor_id < len(expected):  # model weights (optimizer slots follow)
                assert a.tobytes() == expected[p.tensor_id].reshape(-1)[p.start:p.stop].tobytes(), (v, p)
    assert rec.weights[1][0].tobytes() != rec.weights[6][0].tobytes()  # the weights did change meanwhile
    for v, expected in rec.weights.items():
        assert [a.tobytes() for a in load(ckpt.config, "k", v).model_arrays().values()] == [e.tobytes() for e in expected]
    HoldingScratch.held = []
    ckpt.close()


def test_steps_per_execution(tmp_path):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", steps_per_execution=2)
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=3, at_epoch_end=False, mode="sync", **dirs(tmp_path))
    rec = Record(ckpt)
    x, y = data(128)  # 8 steps, executed 2 at a time: batch hooks at steps 2, 4, 6, 8
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, rec], verbose=0)
    assert [t["version"] for t in ckpt.timings] == [4, 6]  # groups crossing 3 and 6
    for v, expected in rec.weights.items():
        assert [a.tobytes() for a in load(ckpt.config, "k", v).model_arrays().values()] == [e.tobytes() for e in expected]
    ckpt.close()


def test_saved_model_loads_without_deepfreeze(tmp_path):
    model = build()
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, mode="sync", **dirs(tmp_path))

    class SaveMidTraining(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:  # hook installed right now
                assert "_update_step" in self.model.optimizer.__dict__
                self.model.save(str(tmp_path / "m.keras"))
                self.model.save(str(tmp_path / "m.h5"))

    x, y = data(64)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, SaveMidTraining()], verbose=0)
    ckpt.close()
    code = ("import sys, tensorflow as tf\n"
            "for p in sys.argv[1:]:\n"
            "    m = tf.keras.models.load_model(p)\n"
            "    assert type(m.optimizer).__name__ == 'Adam', type(m.optimizer)\n"
            "assert not any(k.startswith('deepfreeze') for k in sys.modules)\n"
            "print('loaded')\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.keras"), str(tmp_path / "m.h5")],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0 and "loaded" in p.stdout, p.stderr[-3000:]


def test_mismatching_model_is_a_clear_error(tmp_path):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, mode="sync", **dirs(tmp_path))
    x, y = data(32)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    with pytest.raises(ModelMismatchError, match=r"tensor #6 does not match.*\[800, 38\].*\[800, 37\]"):
        deepfreeze.restore(build("other"), name="k", mode="sync", **dirs(tmp_path))
    with pytest.raises(deepfreeze.CheckpointNotFoundError):
        deepfreeze.restore(build(), name="other_name", mode="sync", **dirs(tmp_path))


def test_legacy_optimizer_is_a_clear_error(tmp_path):
    model = build()
    model.compile(optimizer=tf.keras.optimizers.legacy.SGD(), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, mode="sync", **dirs(tmp_path))
    x, y = data(32)
    with pytest.raises(ConfigError, match="not a tf.keras.optimizers.legacy optimizer"):
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)


def test_callback_options_validated():
    for kw in (dict(every_n_batches=0), dict(every_n_batches=None, at_epoch_end=False), dict(min_shard_bytes=-1)):
        with pytest.raises(ConfigError):
            DeepFreezeCheckpoint(name="k", mode="sync", scratch="/tmp/a", persistent="/tmp/b", **kw)
    with pytest.raises(ConfigError, match="invalid checkpoint name"):
        DeepFreezeCheckpoint(name="../x", mode="sync", scratch="/tmp/a", persistent="/tmp/b")


def test_callback_argument_typo_suggests_the_argument():
    with pytest.raises(ConfigError, match=r"unknown argument 'every_n_batch'\. Did you mean 'every_n_batches'\?"):
        DeepFreezeCheckpoint(name="k", mode="sync", scratch="/tmp/a", persistent="/tmp/b", every_n_batch=10)
    with pytest.raises(ConfigError, match=r"unknown argument 'persistant'\. Did you mean 'persistent'"):
        DeepFreezeCheckpoint(name="k", mode="sync", scratch="/tmp/a", persistant="/tmp/b")
    with pytest.raises(ConfigError, match=r"unknown argument 'resum'\. Did you mean 'resume'"):
        DeepFreezeCheckpoint(name="k", mode="sync", scratch="/tmp/a", persistent="/tmp/b", resum=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_unbuilt_model_is_set_up_at_the_first_step(tmp_path, mode):
    """A Sequential without Input is built from fit's input spec before the first step; a
    checkpoint asked for in the very first batch is taken; every version is bit-exact."""
    model = build(lazy=True)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    assert not model.built
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=1, mode=mode, **dirs(tmp_path))
    rec = Record(ckpt)
    x, y = data(64)
    model.fit(x, y, batch_size=16, epochs=2, callbacks=[ckpt, rec], verbose=0)
    ckpt.wait()
    assert model.built and sorted(rec.weights) == list(range(1, 9))
    for v, expected in rec.weights.items():
        assert [a.tobytes() for a in load(ckpt.config, "k", v).model_arrays().values()] == [e.tobytes() for e in expected]
    assert "_update_step" not in model.optimizer.__dict__
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, rec], verbose=0)  # a second fit: built now
    assert ckpt.last_version == 12
    ckpt.close()


def test_unbuilt_model_resumes_before_its_first_step(tmp_path, caplog):
    """resume=True with an unbuilt model: the version is picked when fit begins (so fit starts
    at its epoch and batch), the model is built and restored before the first step: the result
    is bit-identical to an uninterrupted run."""
    tf.config.experimental.enable_op_determinism()
    x, y = data(96)  # 6 steps per epoch

    def fit(out, resume, stop_at=None):
        model = build(lazy=True)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
        ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=4, at_epoch_end=False, mode="sync", resume=resume,
                                    **dirs(out))

        class Stop(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(self.model.optimizer.iterations.numpy()) == stop_at:
                    self.model.stop_training = True  # the "crash": newest checkpoint is v8

        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=[ckpt, Stop()])
        ckpt.close()
        return model, ckpt

    a, _ = fit(tmp_path / "a", False)
    fit(tmp_path / "b", False, stop_at=10)
    caplog.clear()
    b, ck = fit(tmp_path / "b", True)
    assert ck.resumed_from == 8 and int(b.optimizer.iterations.numpy()) == 18
    resumed = [r.getMessage() for r in caplog.records if "resumed 'k'" in r.getMessage()]
    assert len(resumed) == 1 and "continuing in epoch 2 after its first 2 batches" in resumed[0]
    assert [w.tobytes() for w in a.get_weights()] == [w.tobytes() for w in b.get_weights()]
    assert [v.numpy().tobytes() for v in a.optimizer.variables()] == \
        [v.numpy().tobytes() for v in b.optimizer.variables()]


@pytest.mark.scratch_files("lists the version on both levels")
def test_load_and_list_versions_take_a_config_path(tmp_path):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    cfg = tmp_path / "c.cfg"
    cfg.write_text(f"mode = sync\nscratch = {tmp_path / 'scratch'}\npersistent = {tmp_path / 'pfs'}\n")
    ckpt = DeepFreezeCheckpoint(str(cfg), name="k", every_n_batches=2, at_epoch_end=False)
    x, y = data(32)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    assert deepfreeze.list_versions(str(cfg), "k") == {2: ["scratch", "persistent"]}
    assert deepfreeze.list_versions(cfg, "k") == deepfreeze.list_versions(ckpt.config, "k")  # PathLike too
    ck = deepfreeze.load(cfg, "k")
    assert ck.version == 2
    assert [a.tobytes() for a in ck.model_arrays().values()] == [w.tobytes() for w in model.get_weights()]


def test_restore_warns_once_when_tensor_names_differ(tmp_path, caplog):
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode="sync", **dirs(tmp_path))
    x, y = data(32)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    caplog.clear()
    deepfreeze.restore(build(), name="k", mode="sync", **dirs(tmp_path))  # Keras numbers the rebuilt layers: same
    assert not [r for r in caplog.records if "differ" in r.getMessage()]
    layers = [type(layer).from_config({**layer.get_config(), "name": f"other_{i}"})
              for i, layer in enumerate(build().layers)]  # same shapes and order, other names
    renamed = tf.keras.Sequential([tf.keras.Input((12, 12, 1))] + layers)
    deepfreeze.restore(renamed, name="k", mode="sync", **dirs(tmp_path))
    warned = [r.getMessage() for r in caplog.records if "differ" in r.getMessage()]
    assert len(warned) == 1 and "model 'other_0/kernel', checkpoint 'conv2d" in warned[0], warned
    assert [w.tobytes() for w in renamed.get_weights()] == [w.tobytes() for w in model.get_weights()]


def test_restore_builds_an_unbuilt_model_from_input_spec(tmp_path):
    """deepfreeze.restore(model, ..., input_spec=) builds a Sequential without Input from the
    data it will be fit on (the checkpoint callback's build function), then restores bit-exact;
    without input_spec the error says what to pass."""
    model = build(lazy=True)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="k", every_n_batches=2, mode="sync", **dirs(tmp_path))
    x, y = data(64)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    want = [w.tobytes() for w in model.get_weights()]
    fresh = build(lazy=True)
    with pytest.raises(ModelMismatchError, match="pass input_spec="):
        deepfreeze.restore(fresh, name="k", mode="sync", **dirs(tmp_path))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    for spec in (ds, ds.element_spec):
        fresh = build(lazy=True)
        assert deepfreeze.restore(fresh, name="k", mode="sync", input_spec=spec, **dirs(tmp_path)) == (4, 4)
        assert [w.tobytes() for w in fresh.get_weights()] == want
    with pytest.raises(ConfigError, match="restore: building the model from the input shape"):
        deepfreeze.restore(build(lazy=True), name="k", mode="sync", input_spec=tf.TensorSpec((None, 5)),
                           **dirs(tmp_path))


class _Chain(tf.keras.layers.Layer):
    """Weights named w, w, w_1 and w_1_1: the first two made distinct by renaming the second
    w_1, which the third takes, so one of them ends as a second twins/w_1_1."""

    def build(self, shape):
        self.ws = [self.add_weight(name=n, shape=(shape[-1], 2)) for n in ("w", "w", "w_1", "w_1_1")]

    def call(self, x):
        return tf.add_n([tf.matmul(x, w) for w in self.ws])


def test_two_tensors_with_one_name_are_refused_at_plan_time(tmp_path):
    """A model whose weight names collide after the callback's renaming: fit is refused before a
    checkpoint is written, naming the key (before issue 41 a version was written that every
    reader refuses for its duplicate name)."""
    model = tf.keras.Sequential([tf.keras.Input((4,)), _Chain(name="twins")])
    model.compile(optimizer="sgd", loss="mse")
    ckpt = DeepFreezeCheckpoint(name="dup", every_n_batches=1, mode="sync", **dirs(tmp_path))
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ConfigError, match=r"two tensors are named 'twins/w_1_1'"):
        model.fit(x, np.ones((8, 2), np.float32), batch_size=4, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    assert not [v for v in os.listdir(tmp_path / "pfs" / "dup") if v.startswith("v")], "no version is written"


def test_the_first_slow_checkpoint_says_why_once(tmp_path, caplog):
    """Issue 42, item 6: the run's first checkpoint that stalls the step over STALL_WARN logs one
    WARNING naming its parts; later slow ones log nothing (the slowness forced by a subclass)."""
    import logging
    from deepfreeze.run import STALL_WARN

    class SlowCapture(DeepFreezeCheckpoint):
        def _capture(self, step):
            time.sleep(STALL_WARN + 0.05)
            return super()._capture(step)

    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    ckpt = SlowCapture(name="k", every_n_batches=2, at_epoch_end=False, mode="sync", **dirs(tmp_path))
    x, y = data()  # 6 steps: v2, v4, v6, each slow
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt], verbose=0)
    ckpt.close()
    assert [t["version"] for t in ckpt.timings] == [2, 4, 6]
    lines = [r.getMessage() for r in caplog.records if "first checkpoint stalled" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("DeepFreeze: 'k' v2: the first checkpoint stalled the step "), lines
    assert "s capturing" in lines[0], lines
