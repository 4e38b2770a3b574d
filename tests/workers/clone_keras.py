"""Keras + Horovod clone worker (run under mpirun):

    python clone_keras.py OUT SIZES K [key=value ...] [+ OUT2 SIZES2 K2 [key=value ...] ...]

Each ``+`` starts another job of the same ranks after the one before it ended, in the same
processes (one TensorFlow and Horovod start-up for several jobs): a new split (new communicators:
nothing of the job before reaches it), Horovod shut down and initialized again over the new
group, Keras' session cleared; each job writes its results under its own OUT.

SIZES: group sizes, e.g. 2,2 (the first group is the source). The source group trains
EPOCHS x 6 steps and clones at global step K (``K=e2`` clones at the end of epoch 2);
every clone group receives, saves what it got, then (``continue=1``) trains on to the
same final step with the same data and hyperparameters. Every rank saves its full
training state (weights, then optimizer variables) as OUT/<who>_r<rank>_<when>.npz.

Options: ``bad=1`` (the source first tries invalid clone steps), ``threshold=`` (clone split threshold, bytes), ``epochs=``, ``ckpt=1`` (a
DeepFreezeCheckpoint in the source's fit and, for clones continuing, in theirs; each
rank a node), ``mismatch=1`` (clone groups build another model), ``kill=clone|source``
(a rank dies mid-transfer), ``timeout=`` (clone_timeout), ``hvd=world`` (the mistake:
``hvd.init()`` without ``comm=group.comm``), ``late=source|clone`` (that group reaches the
clone late: ``late=source`` once the clone gave up, ``late=clone`` ``timeout`` + 4 s after the
source's end of step K - 1), ``stall=clone`` (the clone ranks take the hello, then no data until
the source gave up), ``unbuilt=1`` (a Sequential model without Input: the source's fit
builds it, the clones pass ``input_spec=``), ``env.KEY=VALUE`` (the job runs with ``KEY=VALUE``
in its environment, as if the job had been started with it: e.g. ``env.VELOC_WRITE_ONCE=off``).

Every rank writes OUT/<who>_r<rank>.json: ``error`` ("Type: message" of what the clone call
or fit raised, any exception), ``configerrors`` (bad=1), ``info``, ``timings``, ``ok``.
"""
import glob
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import jobargs  # noqa: E402
import deepfreeze.clone as dfc  # noqa: E402
from deepfreeze.errors import CloneTimeoutError, ConfigError  # noqa: E402

STEPS, BATCH = 6, 8
ENVIRON = dict(os.environ)  # each job starts from the process's environment, plus its own env.KEY=VALUE
JOB_ENV: list[str] = []  # the keys the current job set


def start(argv: list[str]) -> None:
    """One job's arguments (``OUT SIZES K [key=value ...]``): its groups (a new split) and Horovod."""
    global out, sizes, at, opts, group, hvd, CloneCallback, DeepFreezeCheckpoint, receive_clone, train_state
    global EPOCHS, THRESHOLD, TIMEOUT, who
    out, sizes, at = argv[0], tuple(int(s) for s in argv[1].split(",")), argv[2]
    opts = dict(a.split("=", 1) for a in argv[3:])
    for k in JOB_ENV:  # the job before's own settings undone (only those keys: other threads read the environment)
        if k in ENVIRON:
            os.environ[k] = ENVIRON[k]
        else:
            os.environ.pop(k, None)
    JOB_ENV[:] = [k[4:] for k in opts if k.startswith("env.")]
    os.environ.update({k[4:]: v for k, v in opts.items() if k.startswith("env.")})  # this job's
    group = dfc.split(sizes=sizes)

    import horovod.tensorflow.keras as hvd

    if opts.get("hvd") == "world":
        hvd.init()  # the mistake: Horovod over every group
    else:
        hvd.init(comm=group.comm)
    from deepfreeze.keras import CloneCallback, DeepFreezeCheckpoint, receive_clone
    from deepfreeze.keras._state import train_state

    EPOCHS = int(opts.get("epochs", 3))
    THRESHOLD = int(opts.get("threshold", 1024))
    TIMEOUT = float(opts.get("timeout", 120))
    who = "source" if group.is_source else f"clone{group.index}"


def build(mismatch: bool = False) -> tf.keras.Model:
    """Conv1D, BatchNormalization, Dense, a bias of 10007 elements (prime), a trainable layer
    that gets no gradient (stop_gradient) and a frozen one."""
    tf.keras.utils.set_random_seed(3)
    inp = tf.keras.Input((16, 4))
    h = tf.keras.layers.Conv1D(8, 3)(inp)
    h = tf.keras.layers.BatchNormalization()(h)
    h = tf.keras.layers.ReLU()(h)
    flat = tf.keras.layers.Flatten()(h)
    h = tf.keras.layers.Dense(64 if not mismatch else 65, activation="relu")(flat)
    p = tf.keras.layers.Dense(10007, activation="relu")(h)
    o = tf.keras.layers.Dense(3)(p)
    nograd = tf.keras.layers.Dense(3, name="nograd")(flat)
    frozen = tf.keras.layers.Dense(3, name="frozen", trainable=False)(h)
    o = o + 0.0 * tf.stop_gradient(nograd) + 0.1 * frozen
    return tf.keras.Model(inp, tf.keras.layers.Softmax()(o))


def build_unbuilt() -> tf.keras.Model:
    """A Sequential model without Input, as in Horovod's examples: built from the data."""
    tf.keras.utils.set_random_seed(3)
    return tf.keras.Sequential([tf.keras.layers.Conv1D(8, 3), tf.keras.layers.BatchNormalization(),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(3), tf.keras.layers.Softmax()])


def save_state(model, when: str) -> None:
    arrays = [np.asarray(v.value()) for v in train_state(model).variables]
    np.savez(f"{out}/{who}_r{group.rank}_{when}.npz", *arrays)


class Record(tf.keras.callbacks.Callback):
    """Saves the state after step K (source) and the weights after every step (rank 0: the
    reference for checkpoints)."""

    def __init__(self, k=None, prefix="expected"):
        super().__init__()
        self.k, self.prefix = k, prefix

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step == self.k:
            save_state(self.model, "K")
        if group.rank == 0:
            os.makedirs(f"{out}/{self.prefix}", exist_ok=True)
            np.savez(f"{out}/{self.prefix}/v{step}.npz", *self.model.get_weights())


def checkpoint(name: str) -> "DeepFreezeCheckpoint":
    node = f"g{group.index}r{group.rank}"
    return DeepFreezeCheckpoint(name=name, every_n_batches=2, mode="async", scratch=f"{out}/{node}/scratch",
                                persistent=f"{out}/persistent", failure_domain=node, min_shard_bytes=1024)


def wait_for_result(pattern: str, limit: float = 240.0) -> None:
    """Wait (bounded) until the other side's result file (OUT/<who>_r<rank>.json) exists: it has
    given up. The faults below count from that, not from this process's clock: under load the
    other side may start seconds later, and a fixed ``timeout + 4`` s was then not late enough."""
    deadline = time.monotonic() + limit
    while not glob.glob(os.path.join(out, pattern)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"test: no {pattern} within {limit} s")
        time.sleep(0.05)


class Stall(dfc.Receiver):
    """Fault injection: a clone rank that took the hello, then takes no data until the source gave
    up (its clone_timeout passed: it wrote its result), and at least timeout + 4 s."""

    def receive(self, buffers):
        t0 = time.monotonic()
        wait_for_result(f"source_r{group.rank}.json")
        time.sleep(max(0.0, TIMEOUT + 4 - (time.monotonic() - t0)))
        raise CloneTimeoutError("test: this clone rank stalled")


class Began(tf.keras.callbacks.Callback):
    """At train begin, after CloneCallback's (which posts the source's hello), marks
    OUT/source_r<rank>.hello. With ``late=source`` and ``stall=clone`` the clone calls receive_clone
    after that mark, so its clone_timeout counts what the test is about (the data that does not
    come, the data it does not take), never the source's start-up: under load the source's fit may
    begin more than clone_timeout after the clone's call."""

    def on_train_begin(self, logs=None):
        open(f"{out}/source_r{group.rank}.hello", "w").close()


def waits_for_source_hello() -> bool:
    return opts.get("late") == "source" or opts.get("stall") == "clone"


class Late(tf.keras.callbacks.Callback):
    """The source reaches the clone step K late: after step K - 1 it waits until the clone gave up
    (the clone's result file), and at least timeout + 4 s."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.k - 1:
            t0 = time.monotonic()  # late for certain: the clone gave up (wrote its result) first
            wait_for_result(f"clone*_r{group.rank}.json")
            time.sleep(max(0.0, TIMEOUT + 4 - (time.monotonic() - t0)))


class AtStepK(tf.keras.callbacks.Callback):
    """Marks (OUT/source_r<rank>.at_k) that the source ends step K - 1: its wait for the clones'
    hello starts at the next batch. ``late=clone`` counts its lateness from this mark, not from
    its own start (under load the source may take seconds to reach K)."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.k - 1:
            open(f"{out}/source_r{group.rank}.at_k", "w").close()


class DieMidTransfer(dfc.Receiver):
    """Fault injection: this clone rank dies by SIGKILL once the first data message arrived."""

    def _check_abort(self):
        if self.first_data_at is not None:
            open(f"{out}/{who}_r{group.rank}.killed", "w").close()  # "mid-transfer": read by the test
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._check_abort()


def data(rank: int):
    rng = np.random.default_rng(50 + rank)
    x = rng.standard_normal((STEPS * BATCH, 16, 4)).astype(np.float32)
    y = rng.integers(0, 3, STEPS * BATCH)
    return x, y


def run() -> None:
    """One job: train, clone or receive; OUT/<who>_r<rank>.json says how it ended."""
    model = build_unbuilt() if opts.get("unbuilt") == "1" else build(mismatch=opts.get("mismatch") == "1" and
                                                                      not group.is_source)
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)),
                  loss="sparse_categorical_crossentropy")
    x, y = data(group.rank)
    result = {"who": who, "rank": group.rank}
    try:
        if group.is_source and opts.get("bad") == "1":  # configuration errors, before the real clone
            result["configerrors"] = []
            for bad in ({"at_step": 0}, {"at_step": 3, "at_epoch_end": 1}, {}):
                try:
                    CloneCallback(group, **bad)
                except ConfigError as e:
                    result["configerrors"].append([str(bad), str(e)])
            try:  # step 1 is the first step of this fit: before Horovod's broadcast made the ranks identical
                model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[CloneCallback(group, at_step=1)])
            except ConfigError as e:
                result["configerrors"].append(["first-step", str(e)])
        if group.is_source:
            kw = {"at_epoch_end": int(at[1:])} if at.startswith("e") else {"at_step": int(at)}
            clone = CloneCallback(group, clone_timeout=TIMEOUT, threshold=THRESHOLD, **kw)
            callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), clone]
            if waits_for_source_hello():
                callbacks.append(Began())
            if opts.get("ckpt") == "1":
                ck = checkpoint("src")
                callbacks.append(ck)

            class DieAfterPosting(tf.keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    if clone.done and group.rank == int(opts.get("kill_rank", 1)):
                        open(f"{out}/{who}_r{group.rank}.killed", "w").close()
                        os.kill(os.getpid(), signal.SIGKILL)
            if opts.get("kill") == "source":
                callbacks.append(DieAfterPosting())
            if opts.get("late") == "source":
                callbacks.append(Late(clone.at_step))
            if opts.get("late") == "clone":
                callbacks.append(AtStepK(clone.at_step))
            callbacks.append(Record(k=None))  # K recorded by step below (at_epoch_end: known after fit)
            k_step = clone.at_step if clone.at_step else (int(at[1:]) + 1) * STEPS
            callbacks[-1].k = k_step
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
            save_state(model, "final")
            result["timings"] = {k: v for k, v in clone.timings.items()}
            if opts.get("ckpt") == "1":
                ck.wait()
                ck.close()
        else:
            cls = DieMidTransfer if opts.get("kill") == "clone" and group.rank == int(opts.get("kill_rank", 0)) \
                else Stall if opts.get("stall") == "clone" else dfc.Receiver
            if opts.get("late") == "clone":
                wait_for_result(f"source_r{group.rank}.at_k")  # the source ended step K - 1
                time.sleep(TIMEOUT + 4)
            if waits_for_source_hello():
                wait_for_result(f"source_r{group.rank}.hello")  # the source posted its hello (fit began)
            spec = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH) if opts.get("unbuilt") == "1" else None
            t0 = time.time()
            info = receive_clone(model, group, clone_timeout=TIMEOUT, threshold=THRESHOLD, receiver_cls=cls,
                                 input_spec=spec)
            result["info"] = {"step": info.step, "epoch": info.epoch, "epoch_step": info.epoch_step,
                              "epoch_complete": info.epoch_complete, "source_run": info.source_run,
                              "source_name": info.source_name}
            result["timings"] = dict(info.timings, called=t0)
            save_state(model, "K")
            if opts.get("continue") == "1":
                callbacks = [Record(prefix=f"expected_{who}")]
                if opts.get("ckpt") == "1":
                    ck = checkpoint(who)
                    callbacks.append(ck)
                model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, initial_epoch=info.epoch, shuffle=False, verbose=0,
                          callbacks=callbacks)
                save_state(model, "final")
                if opts.get("ckpt") == "1":
                    ck.wait()
                    ck.close()
        result["ok"] = True
    except Exception as e:  # any type: a test checks it is DeepFreeze's (not TensorFlow's wrapper)
        result["error"] = f"{type(e).__name__}: {e}"
    with open(f"{out}/{who}_r{group.rank}.json.tmp", "w") as f:
        json.dump(result, f, default=float)
    os.replace(f"{out}/{who}_r{group.rank}.json.tmp", f"{out}/{who}_r{group.rank}.json")


for i, job in enumerate(jobargs.split(sys.argv[1:], "+")):
    if i:  # the next job: Horovod again over its own group, Keras' layer names as in a fresh process
        hvd.shutdown()
        tf.keras.backend.clear_session()
    start(job)
    run()
