"""Producer worker of the stream tests (run under mpirun).

    python tests/workers/stream_producer.py OUT [key=value ...] [+ OUT2 [key=value ...] ...]

Each ``+`` starts another job of the same ranks after the one before it (a fresh model and
callbacks, Keras' session cleared; one TensorFlow and Horovod start-up for several jobs).

Each rank simulates its own node's scratch (OUT/node<rank>/scratch); persistent is
OUT/persistent. A PublishCallback publishes channel ``name`` (schedule ``every`` steps); with
``ckpt=N`` a DeepFreezeCheckpoint on the same name checkpoints every N steps in the same fit.
Rank 0 saves the model's weights right after every published step to OUT/expected/v<step>.npz
(and after every checkpointed step to OUT/expected_ckpt/v<step>.npz): the references.
``sleep`` seconds per batch slow training down (a consumer has time to follow);
``hold`` seconds at the end keep the publisher serving before it closes; with ``hold_until=PATH``
it closes as soon as PATH exists (``hold`` is then the most it waits: the test says when it is done
with the live publisher, however slow the machine).
``slow_write=S`` (fault injection by subclassing): the last rank's scratch writer takes S more
seconds per shard, so only that rank's writer is busy; each rank records, per publish-only capture,
its own vote (writer busy) and the shared decision in producer<rank>.json ("votes").
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jobargs  # noqa: E402
from models import build  # noqa: E402
from deepfreeze.keras import DeepFreezeCheckpoint, PublishCallback  # noqa: E402
from deepfreeze.stream import StreamOptions  # noqa: E402


class Record(tf.keras.callbacks.Callback):
    """Rank 0: save the weights after every step ``want(step)`` accepts (once per step)."""

    def __init__(self, want, rank, path_of):
        super().__init__()
        self.want, self.rank, self.path_of, self.done = want, rank, path_of, set()

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step not in self.done and self.want(step):
            self.done.add(step)
            if self.rank == 0:
                path = self.path_of(step)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                np.savez(path, *self.model.get_weights())

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_batch_end(0)


class Sleep(tf.keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def dying_ring(step: int) -> type:
    """Fault injection: this rank dies by SIGKILL in the middle of copying ``step`` into its slot
    (after the slot was marked as being written, before its header is complete)."""
    from deepfreeze.stream import slots

    class DyingRing(slots.SlotRing):
        def write(self, version, data, **kw):
            self._dying = version.step == step
            return super().write(version, data, **kw)

        def _copied(self, slot, done, total):
            if getattr(self, "_dying", False):
                import signal
                os.kill(os.getpid(), signal.SIGKILL)

    return DyingRing


def slow_scratch(seconds: float) -> type:
    """Fault injection: a scratch level whose shard writes take ``seconds`` longer."""
    from deepfreeze.tiers.scratch import ScratchLevel

    class SlowScratch(ScratchLevel):
        def write_shard(self, *a, **kw):
            time.sleep(seconds)
            return super().write_shard(*a, **kw)

    return SlowScratch


class VotingPublish(PublishCallback):
    """Records this rank's vote (writer busy) and the step it was cast for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.votes = []  # [step, this rank's writer busy, time.time()]

    def _writer_busy(self):
        busy = super()._writer_busy()
        self.votes.append([self._last_capture, bool(busy), time.time()])
        return busy


def main() -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    for i, job in enumerate(jobargs.split(sys.argv[1:], "+")):
        if i:
            tf.keras.backend.clear_session()  # the next job's layers are named as in a fresh process
        run_job(job)


def run_job(argv: list[str]) -> None:
    out = argv[0]
    opts = dict(a.split("=", 1) for a in argv[1:])
    rank = hvd.rank()
    if "die_at" in opts and rank == hvd.size() - 1:
        from deepfreeze.stream import slots
        slots.SlotRing = dying_ring(int(opts["die_at"]))  # the Publisher makes its ring from this name
    model = build(opts.get("model", "small"))
    rng = np.random.default_rng(100 + rank)
    x = rng.random((int(opts.get("samples", 256)),) + tuple(model.input_shape[1:]), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss="sparse_categorical_crossentropy")
    name = opts.get("name", "chan")
    common = dict(mode="async", scratch=f"{out}/node{rank}/scratch", persistent=f"{out}/persistent",
                  failure_domain=f"node{rank}", min_shard_bytes=int(opts.get("min_shard_bytes", 256)),
                  persistent_interval=float(opts.get("persistent_interval", 0)))
    stream = StreamOptions(shm_dir=opts.get("shm_dir", "/dev/shm"))
    schedule = opts.get("schedule", "3")
    plan_kw = {}
    if schedule in ("fixed", "adaptive"):
        plan_kw = dict(warmup_epochs=int(opts.get("warmup", 1)), horizon_s=float(opts.get("horizon", 5)),
                       inference_interval_s=float(opts.get("interval", 0.01)))
    if "slow_write" in opts and rank == hvd.size() - 1:
        common["scratch_cls"] = slow_scratch(float(opts["slow_write"]))
    pub = VotingPublish(name, schedule=int(schedule) if schedule.isdigit() else schedule, stream=stream, **plan_kw,
                          overwrite=opts.get("overwrite") == "1", resume=opts.get("resume") == "1", **common)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    ckpt = None
    if "ckpt" in opts:
        ckpt = DeepFreezeCheckpoint(name=name, every_n_batches=int(opts["ckpt"]), at_epoch_end=False,
                                    **{k: v for k, v in common.items() if k != "scratch_cls"})
    pair = [pub, ckpt] if opts.get("order", "pub") == "pub" else [ckpt, pub]
    callbacks += [c for c in pair if c is not None]
    callbacks.append(Record(lambda s: bool(pub.published) and pub.published[-1].step == s, rank,
                            lambda v: f"{out}/expected/v{v}.npz"))
    if ckpt is not None:
        n = int(opts["ckpt"])
        callbacks.append(Record(lambda s: s % n == 0, rank, lambda v: f"{out}/expected_ckpt/v{v}.npz"))
    if "sleep" in opts:
        callbacks.append(Sleep(float(opts["sleep"])))
    model.fit(x, y, batch_size=16, epochs=int(opts.get("epochs", 2)), verbose=0, callbacks=callbacks)
    pub.wait()
    p = pub.publisher
    report = {"published": [v.step for v in pub.published], "generation": pub.published[-1].generation
              if pub.published else None, "bytes_sent": p.bytes_sent, "prefix": p.prefix, "coalesced": pub.coalesced,
              "ring_skipped": p.ring.skipped, "run": pub.run_id,
              "plan": pub.publish_plan.to_json() if pub.publish_plan is not None else None,
              "votes": pub.votes, "written": sorted((pub._owner or pub).engine.write_times),
              "steps_per_epoch": int(model.optimizer.iterations.numpy()) // int(opts.get("epochs", 2))}
    with open(f"{out}/producer{rank}.json", "w") as f:
        json.dump(report, f)
    held = time.monotonic() + float(opts.get("hold", 0))
    while time.monotonic() < held and not ("hold_until" in opts and os.path.exists(opts["hold_until"])):
        time.sleep(0.1)
    if ckpt is not None:
        ckpt.close()
    pub.close()


if __name__ == "__main__":
    main()
