"""One hook, many sinks (deepfreeze.keras.hook): several sinks of both kinds in one fit, each bit-exact."""
import os
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from deepfreeze.keras import DeepFreezeCheckpoint  # noqa: E402
from deepfreeze.keras import hook  # noqa: E402
from deepfreeze.keras.state_loader import model_tensors  # noqa: E402
from deepfreeze.loader import load  # noqa: E402
from deepfreeze.shardplan import ShardPlan, TensorSpec  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
from models import build  # noqa: E402


def data(n):
    r = np.random.default_rng(1)
    return r.random((n, 12, 12, 1), dtype=np.float32), r.integers(0, 10, n)


class Weights(tf.keras.callbacks.Callback):
    """The model's weights after every step (what every sink must have captured)."""

    def __init__(self):
        super().__init__()
        self.after = {}

    def on_train_batch_end(self, batch, logs=None):
        self.after[int(self.model.optimizer.iterations.numpy())] = [w.copy() for w in self.model.get_weights()]


class PieceProbe(tf.keras.callbacks.Callback):
    """A second, per-variable sink (as cloning uses): copies each variable's piece right after its
    update, at the steps in ``at``."""

    def __init__(self, at):
        super().__init__()
        self.at, self.got, self.sink = set(at), {}, None

    def on_train_begin(self, logs=None):
        weights = self.model.weights
        specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(self.model))]
        plan = ShardPlan.build(specs, 1, min_shard_bytes=0, pinned=[i for i, w in enumerate(weights) if not w.trainable])
        self.sink = hook.PieceCopySink("probe", self.model.optimizer, plan, 0, weights)
        hook.attach(self.model.optimizer, self.sink)
        self.model.make_train_function(force=True)

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy()) + 1
        if step in self.at:
            self.sink.arm(step)

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step in self.at:
            self.got[step] = {t: a.copy() for t, a in self.sink.pieces().items()}

    def on_train_end(self, logs=None):
        hook.detach(self.model.optimizer, self.sink)
        self.model.make_train_function(force=True)


def test_fused_and_per_variable_sinks_in_one_fit_each_bit_exact(tmp_path):
    model = build()
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), loss="sparse_categorical_crossentropy")
    ckpt = DeepFreezeCheckpoint(name="a", every_n_batches=2, at_epoch_end=False, mode="sync",
                                scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    ckpt2 = DeepFreezeCheckpoint(name="b", every_n_batches=3, at_epoch_end=False, mode="sync",
                                 scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), capture="graph")
    probe, weights = PieceProbe(at=[3, 5]), Weights()
    x, y = data(96)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[ckpt, ckpt2, probe, weights], verbose=0)  # 6 steps
    ckpt.close()
    ckpt2.close()
    assert [t["version"] for t in ckpt.timings] == [2, 4, 6]
    assert [t["version"] for t in ckpt2.timings] == [3, 6]
    for name, versions in (("a", [2, 4, 6]), ("b", [3, 6])):
        for v in versions:
            got = load(ckpt.config, name, v).model_arrays()
            assert [a.tobytes() for a in got.values()] == [w.tobytes() for w in weights.after[v]], (name, v)
    assert sorted(probe.got) == [3, 5]
    for step, pieces in probe.got.items():
        trainable = [i for i, w in enumerate(model.weights) if w.trainable]
        assert sorted(pieces) == trainable
        for tid in trainable:
            assert pieces[tid].tobytes() == weights.after[step][tid].reshape(-1).tobytes(), (step, tid)
    # every sink detached: the optimizer is as it was
    assert hook.registry_of(model.optimizer) is None
    assert "_update_step" not in model.optimizer.__dict__
    assert "_distributed_apply_gradients_fn" not in model.optimizer.__dict__


def test_registry_refuses_a_second_sink_of_the_same_name():
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
    plan = ShardPlan.build(specs, 1)
    a = hook.FusedSink("x", plan, 0, model.weights)
    b = hook.FusedSink("x", plan, 0, model.weights)
    reg = hook.attach(model.optimizer, a)
    assert hook.attach(model.optimizer, a) is reg and reg.sinks == [a]  # attaching twice is a no-op
    with pytest.raises(ValueError, match="already attached"):
        hook.attach(model.optimizer, b)
    hook.detach(model.optimizer, a)
    assert hook.registry_of(model.optimizer) is None and "_update_step" not in model.optimizer.__dict__


@pytest.mark.parametrize("capture", ["graph", "native"])
def test_a_step_the_hook_did_not_capture_is_an_error_not_stale_data(capture):
    from deepfreeze import CaptureMissedError
    from deepfreeze.keras import native
    if capture == "native" and native.load() is None:
        pytest.skip(f"DeepFreeze's TF op is not built: {native.unavailable_reason()}")
    model = build()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
    plan = ShardPlan.build(specs, 1)
    sink = hook.FusedSink("x", plan, 0, model.weights, native=native if capture == "native" else None)
    sink.arm(5)  # no train step runs: nothing is captured
    with pytest.raises(CaptureMissedError, match="did not capture step 5"):
        sink.read(5)
