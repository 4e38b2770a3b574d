"""DeepClone's evaluation (paper section VI-B): runtime overhead, standby, readiness of three ways
to fork a running Horovod group into a clone group, side by side in one run.

    python -m experiments.clone --quick --out /tmp/clone-quick.json      # smoke check (small model)
    python -m experiments.clone                                          # the full grid (see below)
    python -m experiments.clone --apps nt3-weights --sizes 2 --runs 5 --resume --out experiments/results/clone.json
    python -m experiments.clone --table experiments/results/clone.json   # the targets table (markdown)
    python -m experiments.clone --plot experiments/results/clone.json    # clone.png beside the JSON

Apps: ``nt3-weights`` (CANDLE NT3's 10 weight tensors, 620 MB, little compute, batch 20),
``resnet50`` (tf.keras.applications, 64x64 images, 320 tensors of 25.6 M parameters, batch
32), ``small`` (``--quick`` only: Conv1D, BatchNormalization, Dense, a tensor with a prime element
count; about 2 MB). Sizes: N = 1 and 2, i.e. "1+1" and "2+2" ranks (one ``mpirun -np 2N``;
``deepfreeze.clone.split(groups=2)``; each group its own Horovod world,
``hvd.init(comm=group.comm)``). The machine has 2 cores: a 2+2 job runs 4 ranks on them
(``--oversubscribe --bind-to none``, TensorFlow intra/inter-op threads 1,
``--mca mpi_yield_when_idle 1``), so after the clone step the clones' training shares the cores
with the source's remaining steps, as in the paper's setting where both groups train after K
(here on the same cores, there on other nodes).

Approaches:

* ``pfs-hdf5``: at the end of step K, source rank 0 ``model.save_weights(<persistent>/x.h5)``,
  fsyncs the file and its directory, then sends a release message to the clone leader, which
  forwards it to the other clone ranks (the paper's barrier, without spinning); every clone rank
  then ``load_weights``. The other source ranks go on and meet rank 0 at the next all-reduce.
* ``mpi4py-p2p``: at the end of step K, every source rank ``model.get_weights()`` (called once at
  train begin, untimed, to warm it) and ``Send``s each array (raw bytes, tag = its index) to its
  counterpart clone rank (same group rank) over a duplicate of the parent communicator; each clone
  rank has posted an ``Irecv`` per array into preallocated, touched arrays, then ``set_weights``.
  Weights only (as in the paper); each clone rank gets its counterpart's non-replicated tensors
  (BatchNormalization moving statistics), not rank 0's.
* ``deepclone``: ``deepfreeze.keras.CloneCallback(group, at_step=K)`` on the source,
  ``deepfreeze.keras.receive_clone(model, group)`` on the clones (weights, optimizer state,
  counters; shards sent from inside the train step, all-gathers on the clones).

How a run works. One ``mpirun`` per (app, size) runs ``runs + 1`` rounds; a round runs every
approach once, in an order rotated by the round index (drift spreads evenly). Round 0 is warm-up
(first traces, first MPI connections between the ranks, first HDF5 file) and the correctness
check; it is not in the statistics. In each (round, approach) the source group trains ``steps``
steps (SGD, lr 1e-5; optimizer iterations reset to 0, a fresh Horovod broadcast callback) and
clones at global optimizer step K (the state after the K-th update: the end of batch K-1, 0-based);
the clone group (after its untimed preparation: mpi4py-p2p's receive arrays allocated and
touched, the verification round's zeroing; both groups then start at a sleeping barrier) waits
(polling every 5 ms, as ``receive_clone`` does, then every 0.5 ms once data
flows: clones do not spin), receives, then trains ``clone_steps`` steps on its own data. Both
groups meet at a sleeping barrier before the next approach. Default schedule: steps 20, K 10,
clone steps 10, warm-up steps 3 (``--quick``: 10, 5, 3, 2 and one timed round).

Expected wall time of the full grid (5 runs + warm-up, 3 approaches) on this 2-core machine when
nothing else runs: roughly an hour (per job: resnet50 1+1 ~10 min, 2+2 ~15 min; nt3-weights 1+1
~8 min, 2+2 ~20 min; extrapolated from one-run smoke jobs on a loaded machine); run it in parts
with ``--apps``/``--sizes`` and ``--resume``. Memory: nt3-weights 2+2 peaks at ~5 GB RSS per
source rank and ~6 GB per clone rank; the machine's MemAvailable fell to ~2.7 GiB of 24 (job
field ``min_mem_available_GiB``): run nothing else large beside it.

Metrics (per round; all clocks are ``time.time()``/``perf_counter`` of one node):

* ``overhead_s`` (runtime overhead, source): t(K) + t(K+1) - 2 x mean(t(warm) .. t(K-1)), where
  t(i) is step i's duration (1-based step numbers; 0-based batch K-1 and K), from the first
  callback's ``on_train_batch_begin`` to the last callback's ``on_train_batch_end`` (so it holds
  the clone work done in callbacks), averaged over the source ranks; the first ``warm`` steps
  (trace, broadcast) are not used. Step K+1 runs while the clones start training on the same
  cores (the paper's setting): ``next_step_s`` shows by how much.
* ``readiness_s``: from the end of step K on source rank 0 (its first ``on_train_batch_end``
  callback, before any clone work) until the last clone rank has the state set in its model
  (after ``load_weights`` / ``set_weights`` / ``receive_clone`` returned).
* ``standby_s`` (the paper's definition, section VI-B: how long clones must be alive but
  unproductive): from the moment the approach needs the clones alive until the last clone rank
  has the state set: ``pfs-hdf5`` from the release (the file is durable: clones need not be alive
  while rank 0 writes), ``mpi4py-p2p`` from the first ``Send`` of any source rank (right after
  ``get_weights``), ``deepclone`` from the start of step K on the source (``CloneCallback`` waits
  for the clones' hello at the start of step K, so they must be alive then;
  ``standby_from_posted_s`` starts at the first shard posted instead, the paper's "after the
  back-propagation started", from ``CloneCallback.timings['posted_first']``). Per clone rank:
  time set minus max(that moment, the rank's own ready time); the field is the maximum over
  clone ranks. ``alive_wait_s``: how long the clones of this emulation actually waited (they
  start with the job, so it includes the source's first K steps).
* Diagnostics: ``before_step_s`` (mean step before K), ``clone_step_s``, ``next_step_s``;
  ``save_s``/``fsync_s`` (pfs-hdf5 rank 0), ``get_weights_s``/``send_s`` (mpi4py-p2p, source
  ranks' max), ``transfer_s`` (clone: from the first data (pfs-hdf5: the release) until the
  whole state is in memory: received (mpi4py-p2p), all-gathered (deepclone), loaded into the
  model (pfs-hdf5: ``load_weights`` does both)) and ``set_s`` (from there into the model:
  ``set_weights``; deepclone: the all-gathers' end to ``receive_clone``'s return; 0 for pfs-hdf5),
  ``readiness_from_cb_step_end_s`` and ``sends_done_after_step_end_s`` (deepclone, from
  ``CloneCallback.timings``), ``deepclone_timings`` (the callback's own, per source rank).
  ``state_bytes``: the model's weights and the optimizer's variables; ``bytes_moved_per_clone``:
  what one clone rank ends up holding from the transfer: the baselines move weights only,
  deepclone also the optimizer's variables (Keras' SGD has a momentum slot per weight even
  with momentum 0, so deepclone moves twice the bytes).

Summary per (app, size, approach) over the timed rounds: for each metric its ``median``, ``min``,
``max``, ``p10``, ``p90``, ``mean``, ``se`` (standard error of the mean) and ``n``. ``ratios``:
per app and size, for overhead and readiness, baseline mean / deepclone mean with its standard
error (delta method) and the medians' ratio. A target "holds" when baseline - se >= factor x
(deepclone + se), is "missed" when baseline + se < factor x (deepclone - se), else it is "not
resolvable". ``correctness``: round 0's check: every clone rank's ``model.weights`` (and for
deepclone the optimizer's variables) compared bit for bit (SHA-1 of the bytes of each tensor)
with source rank 0's at the end of step K (taken after the step's timing window) and with its
counterpart source rank's; ``--verify-all`` checks every round (the snapshot then delays step
K+1 of the timed rounds too).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from deepfreeze.clone.transfer import ACTIVE_POLL as ACTIVE_POLL_S  # the baselines' clones poll as the Receiver does
from deepfreeze.clone.transfer import STANDBY_POLL as STANDBY_POLL_S
from experiments.bench import finish_doc, mean, var, write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APPS = {"nt3-weights": ("nt3_weights", 20), "resnet50": ("resnet50", 32), "small": ("small", 16)}
APPROACHES = ["pfs-hdf5", "mpi4py-p2p", "deepclone"]
BASELINES = ["pfs-hdf5", "mpi4py-p2p"]
FULL = {"apps": ["nt3-weights", "resnet50"], "sizes": [1, 2], "steps": 20, "at_step": 10, "clone_steps": 10,
        "warm": 3, "runs": 5}
QUICK = {"apps": ["small"], "sizes": [1, 2], "steps": 10, "at_step": 5, "clone_steps": 3, "warm": 2, "runs": 1}
# issue 13's targets, for nt3-weights at 2+2: (metric, baseline, factor); None: reported only
TARGETS = [("overhead_s", "pfs-hdf5", 5.0), ("readiness_s", "pfs-hdf5", 5.0), ("overhead_s", "mpi4py-p2p", 2.0),
           ("readiness_s", "mpi4py-p2p", None)]
TARGET_CASE = ("nt3-weights", 2)
METRICS = ["overhead_s", "standby_s", "readiness_s"]
EXTRA = ["standby_from_posted_s", "readiness_from_cb_step_end_s", "sends_done_after_step_end_s", "alive_wait_s",
         "before_step_s", "clone_step_s", "next_step_s", "transfer_s", "set_s", "save_s", "fsync_s", "get_weights_s",
         "send_s"]
TAG_RELEASE = 7


def small_model():
    """A ~2 MB model for smoke runs: Conv1D, BatchNormalization (non-replicated moving
    statistics), Dense, and a bias with a prime element count (43)."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(3)
    return tf.keras.Sequential([
        tf.keras.Input((64, 4)),
        tf.keras.layers.Conv1D(32, 5, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(256, activation="relu"),
        tf.keras.layers.Dense(43, activation="relu"),
        tf.keras.layers.Dense(2, activation="softmax"),
    ])


# ---------------------------------------------------------------------------------------------- worker
def sleeping_wait(req, poll: float = 0.005, timeout: float = 3600.0, what: str = "peer") -> None:
    """Wait for an mpi4py request without spinning (the ranks share 2 cores)."""
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(poll)


def poll_all(reqs: list, timeout: float) -> float | None:
    """Wait for every request: a test every 2 ms until the first completes, then every 0.1 ms.
    Returns when the first completed (time.time()), or None for no requests."""
    from mpi4py import MPI
    first, left, sleep = None, len(reqs), STANDBY_POLL_S
    deadline = time.monotonic() + timeout
    while left:
        done = MPI.Request.Testsome(reqs)
        if done:
            left -= len(done)
            if first is None:
                first, sleep = time.time(), ACTIVE_POLL_S
        if not left:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} of {len(reqs)} receives still pending after {timeout:.0f} s")
        time.sleep(sleep)
    return first


def digests(model, optimizer: bool) -> list[list[str]]:
    """[name, sha1 of the bytes] of every model weight (and optimizer variable)."""
    import hashlib
    import numpy as np
    out = []
    vs = list(model.weights) + (list(model.optimizer.variables) if optimizer else [])
    for i, v in enumerate(vs):
        a = np.ascontiguousarray(v.numpy())
        out.append([f"{i}:{v.name}", hashlib.sha1(a.view(np.uint8).reshape(-1)).hexdigest()])
    return out


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def worker(args: argparse.Namespace) -> None:  # one rank of a 2N-rank job
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import gc
    import resource
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from mpi4py import MPI
    sys.path.insert(0, ROOT)
    import deepfreeze.clone as dfc
    import horovod.tensorflow.keras as hvd
    from experiments import models

    group = dfc.split(groups=2)
    hvd.init(comm=group.comm)
    xcomm = group.bridge.Dup()  # the baselines' own traffic, apart from deepclone's tags
    source, rank, n = group.is_source, group.rank, group.size
    peer = group.members(1 if source else 0)[rank]  # the counterpart rank (parent communicator)
    builder, batch = APPS[args.app]
    model = small_model() if builder == "small" else getattr(models, builder)()
    x, y = models.synthetic(model, batch * 2, seed=group.world_rank + (0 if source else 1000))
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1e-5)),
                  loss="sparse_categorical_crossentropy")
    res_dir = f"{args.work}/res"
    os.makedirs(res_dir, exist_ok=True)
    os.makedirs(f"{args.work}/persistent", exist_ok=True)
    approaches = args.approaches.split(",")
    for rnd in range(args.runs + 1):
        shift = rnd % len(approaches)
        for approach in approaches[shift:] + approaches[:shift]:
            verify = rnd == 0 or args.verify_all
            t0 = time.time()
            failed = False
            try:
                if source:
                    res = source_round(args, approach, rnd, verify, model, ds, group, xcomm, peer, hvd, tf)
                else:
                    # mpi4py-p2p: receive arrays allocated and touched before the clone is ready
                    # (untimed), freed after the round (memory: 4 NT3-size ranks share 24 GiB)
                    recv_bufs = ([np.ones(w.shape, w.dtype.as_numpy_dtype) for w in model.weights]
                                 if approach == "mpi4py-p2p" else None)
                    res = clone_round(args, approach, rnd, verify, model, ds, group, xcomm, peer, recv_bufs, tf)
                    recv_bufs = None
            except Exception as e:  # noqa: BLE001 - recorded, then the job ends (peers would wait)
                import traceback
                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {e}"[:2000]}
                failed = True
            res.update(group=group.index, rank=rank, world_rank=group.world_rank, approach=approach, round=rnd,
                       verify=verify, wall_s=time.time() - t0,
                       peak_rss_B=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            name = f"{res_dir}/{approach}.n{rnd}.g{group.index}.r{rank}.json"
            with open(name + ".tmp", "w") as f:
                json.dump(res, f)
            os.replace(name + ".tmp", name)
            if failed:  # the other ranks may wait for this one: end the job, earlier rounds are kept
                sys.stdout.flush()
                sys.stderr.flush()
                MPI.COMM_WORLD.Abort(3)
            gc.collect()
            sleeping_wait(xcomm.Ibarrier(), what="barrier after the round")
            if source and rank == 0:
                for p in os.listdir(f"{args.work}/persistent"):
                    os.unlink(f"{args.work}/persistent/{p}")
            if group.world_rank == 0:
                print(f"[clone] {args.app} {n}+{n} round {rnd} {approach}: {time.time() - t0:.1f} s", flush=True)


def source_round(args, approach: str, rnd: int, verify: bool, model, ds, group, xcomm, peer: int, hvd, tf) -> dict:
    import numpy as np
    K, rank = args.at_step, group.rank
    clone_batch = K - 1  # 0-based batch whose end is global optimizer step K
    begin, end, out = {}, {}, {"side": "source"}
    snap: dict = {}
    send_reqs: list = []

    class First(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            begin[batch] = time.perf_counter()
            if batch == clone_batch:
                out["step_begin_t"] = time.time()

        def on_train_batch_end(self, batch, logs=None):
            if batch == clone_batch:
                out["step_end_t"] = time.time()

    class Last(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            end[batch] = time.perf_counter()

    class Snapshot(tf.keras.callbacks.Callback):  # after Last: outside step K's window
        def on_train_batch_end(self, batch, logs=None):
            if batch == clone_batch and verify:
                snap["weights"] = digests(self.model, optimizer=False)
                snap["all"] = digests(self.model, optimizer=True)
                snap["iterations"] = int(self.model.optimizer.iterations.numpy())

    cb = None
    if approach == "pfs-hdf5":
        path = f"{args.work}/persistent/clone-n{rnd}.h5"

        class Hdf5(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch != clone_batch or rank != 0:
                    return
                t0 = time.perf_counter()
                self.model.save_weights(path)
                t1 = time.perf_counter()
                fsync_path(path)
                fsync_path(os.path.dirname(path))
                t2 = time.perf_counter()
                out.update(save_s=t1 - t0, fsync_s=t2 - t1, release_t=time.time(), file_bytes=os.path.getsize(path))
                msg = np.array([rnd, K], np.int64)
                send_reqs.append((xcomm.Isend(msg, dest=group.members(1)[0], tag=TAG_RELEASE), msg))
        cb = Hdf5()
    elif approach == "mpi4py-p2p":
        class P2P(tf.keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                self.model.get_weights()  # warm-up, untimed

            def on_train_batch_end(self, batch, logs=None):
                if batch != clone_batch:
                    return
                t0 = time.perf_counter()
                ws = self.model.get_weights()
                t1 = time.perf_counter()
                out["first_send_t"] = time.time()
                for i, a in enumerate(ws):
                    xcomm.Send([np.ascontiguousarray(a).reshape(-1).view(np.uint8), MPI_BYTE()], dest=peer, tag=i)
                t2 = time.perf_counter()
                out.update(get_weights_s=t1 - t0, send_s=t2 - t1, bytes_sent=int(sum(a.nbytes for a in ws)))
        cb = P2P()
    elif approach == "deepclone":
        from deepfreeze.keras import CloneCallback
        cb = CloneCallback(group, at_step=K)
    else:
        raise ValueError(f"unknown approach {approach!r}")
    model.optimizer.iterations.assign(0)  # global step K = the end of batch K-1 in every round
    # start together: the clones' untimed preparation (receive arrays, zeroing) is done and does
    # not share the cores with the steps before K
    sleeping_wait(xcomm.Ibarrier(), what="clones' preparation")
    cbs = [First(), hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb, Last(), Snapshot()]
    try:
        model.fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0, callbacks=cbs)
    finally:
        for req, _ in send_reqs:
            sleeping_wait(req, what="release message delivered")
    if approach == "deepclone":
        t = getattr(cb, "timings", None)
        if isinstance(t, dict):
            out["deepclone_timings"] = {k: v for k, v in t.items() if isinstance(v, (int, float, str, bool))}
        elif isinstance(t, list) and t and isinstance(t[-1], dict):
            out["deepclone_timings"] = {k: v for k, v in t[-1].items() if isinstance(v, (int, float, str, bool))}
    out["iters"] = [[b, end[b] - begin[b]] for b in sorted(begin) if b in end]
    nbytes = lambda vs: int(sum(int(np.prod(v.shape)) * v.dtype.size for v in vs))  # noqa: E731
    out["state_bytes"] = {"weights": nbytes(model.weights), "optimizer": nbytes(model.optimizer.variables)}
    out["iterations_after"] = int(model.optimizer.iterations.numpy())
    if snap:
        out["snapshot"] = snap
    return out


def MPI_BYTE():
    from mpi4py import MPI
    return MPI.BYTE


def clone_round(args, approach: str, rnd: int, verify: bool, model, ds, group, xcomm, peer: int, recv_bufs,
                tf) -> dict:
    import numpy as np
    out = {"side": "clone"}
    if verify:  # a transfer that does nothing must fail the check
        for v in model.weights:  # one tensor at a time (memory)
            v.assign(tf.zeros_like(v))
        for v in model.optimizer.variables:  # slots, once built: ones (SGD's momentum slots are zeros)
            v.assign(tf.ones_like(v))
        model.optimizer.iterations.assign(0)
    timeout = args.recv_timeout
    sleeping_wait(xcomm.Ibarrier(), what="the source's start")
    out["ready_t"] = time.time()
    if approach == "pfs-hdf5":
        leader = group.members(1)[0]
        msg = np.zeros(2, np.int64)
        src = group.source[0] if group.rank == 0 else leader
        poll_all([xcomm.Irecv(msg, source=src, tag=TAG_RELEASE)], timeout)
        out["first_t"] = time.time()
        if group.rank == 0:
            for w in group.members(1)[1:]:
                xcomm.Send(msg, dest=w, tag=TAG_RELEASE)
        if list(msg) != [rnd, args.at_step]:
            raise RuntimeError(f"release message {list(msg)} is not for round {rnd}, step {args.at_step}")
        t = time.time()
        model.load_weights(f"{args.work}/persistent/clone-n{rnd}.h5")
        out["arrived_t"] = out["set_t"] = time.time()
        out["load_s"] = out["set_t"] - t
    elif approach == "mpi4py-p2p":
        reqs = [xcomm.Irecv([b.reshape(-1).view(np.uint8), MPI_BYTE()], source=peer, tag=i)
                for i, b in enumerate(recv_bufs)]
        out["first_t"] = poll_all(reqs, timeout)
        out["arrived_t"] = time.time()
        model.set_weights(recv_bufs)
        out["set_t"] = time.time()
    elif approach == "deepclone":
        import inspect
        from deepfreeze.keras import receive_clone
        kw = {"position": False} if "position" in inspect.signature(receive_clone).parameters else {}
        info = receive_clone(model, group, **kw)
        out["arrived_t"] = out["set_t"] = time.time()
        try:
            import dataclasses
            out["info"] = json.loads(json.dumps(dataclasses.asdict(info), default=str))
        except TypeError:
            out["info"] = repr(info)
        t = getattr(info, "timings", None) or {}
        if isinstance(t.get("first_data"), (int, float)):
            out["first_t"] = t["first_data"]
        if isinstance(t.get("gathered"), (int, float)):
            out["arrived_t"] = t["gathered"]  # every tensor whole in the receive buffers
    else:
        raise ValueError(f"unknown approach {approach!r}")
    if verify:
        out["snapshot"] = {"weights": digests(model, optimizer=False), "all": digests(model, optimizer=True),
                           "iterations": int(model.optimizer.iterations.numpy())}
    begin, end = {}, {}

    class Timer(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            begin[batch] = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            end[batch] = time.perf_counter()
    model.fit(ds, steps_per_epoch=args.clone_steps, epochs=1, verbose=0, callbacks=[Timer()])
    out["iters"] = [[b, end[b] - begin[b]] for b in sorted(begin) if b in end]
    return out


# ---------------------------------------------------------------------------------------------- summary
def quantile(v: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    s = sorted(v)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(v: list[float]) -> dict | None:
    v = [x for x in v if x is not None]
    if not v:
        return None
    m, s2 = mean(v), var(v)
    se = math.sqrt(s2 / len(v)) if s2 is not None else None
    return {"median": quantile(v, 0.5), "min": min(v), "max": max(v), "p10": quantile(v, 0.1),
            "p90": quantile(v, 0.9), "mean": m, "se": se, "n": len(v), "values": [round(x, 6) for x in v]}


def one_round(recs: list[dict], approach: str, sched: dict) -> dict:
    """The metrics of one (round, approach) from the per-rank records of both groups."""
    K, warm = sched["at_step"], sched["warm"]
    src = sorted((r for r in recs if r["group"] == 0), key=lambda r: r["rank"])
    cln = sorted((r for r in recs if r["group"] != 0), key=lambda r: r["rank"])
    per_b: dict[int, list[float]] = {}
    for r in src:
        for b, t in r["iters"]:
            per_b.setdefault(int(b), []).append(t)
    it = {b: sum(v) / len(v) for b, v in per_b.items()}
    row: dict = {}
    before = [it[b] for b in range(warm, K - 1) if b in it]
    if before and K - 1 in it and K in it:
        row["before_step_s"] = mean(before)
        row["clone_step_s"], row["next_step_s"] = it[K - 1], it[K]
        row["overhead_s"] = it[K - 1] + it[K] - 2 * row["before_step_s"]
    row["source_iter_s"] = [round(it[b], 4) for b in sorted(it)]
    t_end = src[0].get("step_end_t")
    t_set = [c["set_t"] for c in cln]
    if t_end is not None and t_set:
        row["readiness_s"] = max(t_set) - t_end
    if approach == "pfs-hdf5":
        must = src[0].get("release_t")
        row["save_s"], row["fsync_s"] = src[0].get("save_s"), src[0].get("fsync_s")
    elif approach == "mpi4py-p2p":
        must = min((r["first_send_t"] for r in src if r.get("first_send_t")), default=None)
        row["get_weights_s"] = max((r.get("get_weights_s") or 0 for r in src), default=None)
        row["send_s"] = max((r.get("send_s") or 0 for r in src), default=None)
    else:
        def wall(r: dict, key: str) -> float | None:  # a wall-clock timestamp of the callback, else None
            v = (r.get("deepclone_timings") or {}).get(key)
            ok = isinstance(v, (int, float)) and r.get("step_end_t") and abs(v - r["step_end_t"]) < 3600
            return float(v) if ok else None
        # CloneCallback waits for the clones' hello at the start of step K: they must be alive then
        must = min((r["step_begin_t"] for r in src if r.get("step_begin_t")), default=None)
        posted = [p for p in (wall(r, "posted_first") for r in src) if p is not None]
        if posted and t_set:  # the paper's start: the first shard sent (back-propagation under way)
            row["standby_from_posted_s"] = max(c["set_t"] - max(c["ready_t"], min(posted)) for c in cln)
        row["deepclone_timings"] = [{k: v for k, v in (r.get("deepclone_timings") or {}).items()} for r in src]
        cb_end = wall(src[0], "step_end")
        if cb_end is not None and t_set:
            row["readiness_from_cb_step_end_s"] = max(t_set) - cb_end
        done = [p for p in (wall(r, "sent_done") for r in src) if p is not None]
        if done and t_end is not None:
            row["sends_done_after_step_end_s"] = max(done) - t_end
    if must is not None and t_set:
        row["standby_s"] = max(c["set_t"] - max(c["ready_t"], must) for c in cln)
    if t_set:
        row["alive_wait_s"] = max(c["set_t"] - c["ready_t"] for c in cln)
        firsts = [c["arrived_t"] - c["first_t"] for c in cln if c.get("first_t")]
        row["transfer_s"] = max(firsts) if firsts else None
        row["set_s"] = max((c["set_t"] - c["arrived_t"] for c in cln), default=None)
    return row


def check(recs: list[dict], approach: str) -> dict:
    """Round-0 correctness: clone digests against source rank 0's and the counterpart's."""
    src = {r["rank"]: r for r in recs if r["group"] == 0}
    cln = {r["rank"]: r for r in recs if r["group"] != 0}
    out: dict = {"round": recs[0]["round"], "ranks": {}}
    key = "all" if approach == "deepclone" else "weights"
    out["compared"] = ("model.weights and optimizer variables" if key == "all" else
                       "model.weights (this approach does not transfer optimizer state)")
    ok0, okp = True, True
    for r, c in sorted(cln.items()):
        cs = c.get("snapshot", {}).get(key)
        s0 = src.get(0, {}).get("snapshot", {}).get(key)
        sp = src.get(r, {}).get("snapshot", {}).get(key)
        if cs is None or s0 is None:
            out["ranks"][str(r)] = {"error": "snapshot missing"}
            ok0 = okp = False
            continue
        diff0 = [a[0] for a, b in zip(cs, s0) if a[1] != b[1]]
        diff0 += ["(tensor count differs)"] if len(cs) != len(s0) else []
        diffp = ([a[0] for a, b in zip(cs, sp) if a[1] != b[1]] + (["(tensor count differs)"] if len(cs) != len(sp) else [])
                 if sp else ["(no counterpart snapshot)"])
        out["ranks"][str(r)] = {"tensors": len(cs), "differ_from_rank0": diff0[:20], "n_differ_from_rank0": len(diff0),
                                "n_differ_from_counterpart": len(diffp), "iterations": c["snapshot"].get("iterations")}
        ok0 &= not diff0
        okp &= not diffp
    out["source_iterations_at_K"] = src.get(0, {}).get("snapshot", {}).get("iterations")
    out["bitexact_vs_rank0"], out["bitexact_vs_counterpart"] = ok0, okp
    return out


def ratio_of(b: dict | None, d: dict | None) -> dict | None:
    """baseline / deepclone of the means, its standard error (delta method), the medians' ratio."""
    if not b or not d or b.get("mean") is None or d.get("mean") is None:
        return None
    out = {"baseline_mean": b["mean"], "baseline_se": b.get("se"), "deepclone_mean": d["mean"],
           "deepclone_se": d.get("se")}
    if d["mean"] > 0:
        r = b["mean"] / d["mean"]
        out["ratio"] = r
        if b.get("se") is not None and d.get("se") is not None and b["mean"] != 0:
            out["ratio_se"] = abs(r) * math.sqrt((b["se"] / b["mean"]) ** 2 + (d["se"] / d["mean"]) ** 2)
    if d.get("median") and d["median"] > 0:
        out["median_ratio"] = b["median"] / d["median"]
    return out


def verdict(b: dict, d: dict, factor: float) -> str:
    if min(b.get("n", 0), d.get("n", 0)) < 2:
        return "not resolvable (fewer than 2 runs)"
    x, xse = d["mean"], d.get("se") or 0.0
    y, yse = b["mean"], b.get("se") or 0.0
    if y - yse >= factor * (x + xse):
        return "holds"
    if y + yse < factor * (x - xse):
        return "missed"
    return "not resolvable"


def summarize(app: str, size: int, approaches: list[str], work: str, sched: dict, runs: int) -> tuple[list, dict]:
    rows, ratios = [], {}
    for approach in approaches:
        row: dict = {"app": app, "size": size, "ranks": f"{size}+{size}", "approach": approach}
        per_round, errors = [], []
        for rnd in range(runs + 1):
            recs = []
            for g in (0, 1):
                for r in range(size):
                    try:
                        with open(f"{work}/res/{approach}.n{rnd}.g{g}.r{r}.json") as f:
                            recs.append(json.load(f))
                    except (OSError, ValueError):
                        errors.append(f"round {rnd}: group {g} rank {r}: no result (process died?)")
            errors += [f"round {rnd}: group {x['group']} rank {x['rank']}: {x['error']}" for x in recs if x.get("error")]
            if len(recs) < 2 * size or any(x.get("error") for x in recs):
                continue
            if rnd == 0:
                row["correctness"] = check(recs, approach)
                sb = next((x["state_bytes"] for x in recs if x.get("group") == 0 and x.get("rank") == 0), {})
                row["state_bytes"] = sb
                row["bytes_moved_per_clone"] = (sb.get("weights", 0) + sb.get("optimizer", 0)
                                                if approach == "deepclone" else sb.get("weights"))
                row["warmup_round"] = one_round(recs, approach, sched)
                continue
            m = one_round(recs, approach, sched)
            m["round"] = rnd
            if any(x.get("verify") for x in recs):
                row["correctness_round_%d" % rnd] = check(recs, approach)
            per_round.append(m)
        if errors:
            row["errors"] = errors[:20]
        for key in METRICS + EXTRA:
            s = stats([m.get(key) for m in per_round])
            if s is not None:
                row[key] = s
        row["rounds"] = per_round
        row["peak_rss_max_GB"] = None
        rows.append(row)
    by = {r["approach"]: r for r in rows}
    if "deepclone" in by:
        for base in BASELINES:
            if base in by:
                ratios[base] = {m: ratio_of(by[base].get(m), by["deepclone"].get(m)) for m in ("overhead_s", "readiness_s",
                                                                                             "standby_s")}
    return rows, ratios


def peak_rss(work: str) -> dict[str, float]:
    out = {}
    for name in os.listdir(f"{work}/res") if os.path.isdir(f"{work}/res") else []:
        try:
            with open(f"{work}/res/{name}") as f:
                r = json.load(f)
            k = f"g{r['group']}r{r['rank']}"
            out[k] = max(out.get(k, 0), r.get("peak_rss_B", 0) / 1e9)
        except (OSError, ValueError, KeyError):
            pass
    return out


class MemWatch(threading.Thread):
    """The machine's lowest MemAvailable while a job runs (sampled every second)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="memwatch")
        self.low = math.inf
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with open("/proc/meminfo") as f:
                    for line in f:
                        if line.startswith("MemAvailable:"):
                            self.low = min(self.low, int(line.split()[1]) * 1024 / 2 ** 30)
            except OSError:
                pass
            self.stop.wait(1.0)


def run_group(app: str, size: int, approaches: list[str], sched: dict, runs: int, base: str, timeout: float,
              verify_all: bool, recv_timeout: float = 600.0) -> tuple[list, dict, dict]:
    work = tempfile.mkdtemp(prefix=f"{app}-{size}+{size}-", dir=base)
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "-np", str(2 * size)]
    cmd += ["--allow-run-as-root"] if os.getuid() == 0 else []
    cmd += [sys.executable, "-m", "experiments.clone", "--worker", "--app", app, "--approaches", ",".join(approaches),
            "--runs", str(runs), "--steps", str(sched["steps"]), "--at-step", str(sched["at_step"]),
            "--clone-steps", str(sched["clone_steps"]), "--work", work, "--recv-timeout", str(recv_timeout)]
    cmd += ["--verify-all"] if verify_all else []
    logpath = f"{base}/{app}-{size}.log"
    t0 = time.time()
    failure = None
    mem = MemWatch()
    mem.start()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(logpath, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            if p.wait(timeout=timeout) != 0:
                failure = f"mpirun exited with {p.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
            os.killpg(p.pid, signal.SIGTERM)  # mpirun and its ranks (their own session)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    mem.stop.set()
    mem.join()
    if failure:
        tail = open(logpath, errors="replace").read()[-4000:]
        print(f"[clone] {app} {size}+{size}: {failure}\n{tail}", file=sys.stderr, flush=True)
    rows, ratios = summarize(app, size, approaches, work, sched, runs)
    rss = peak_rss(work)
    for r in rows:
        r["peak_rss_max_GB"] = max(rss.values()) if rss else None
        if failure:
            r.setdefault("errors", []).insert(0, failure)
    job = {"app": app, "size": size, "schedule": dict(sched, approaches=approaches),
           "wall_s": round(time.time() - t0, 1), "peak_rss_GB": rss,
           "min_mem_available_GiB": None if mem.low == math.inf else round(mem.low, 2), "failure": failure}
    shutil.rmtree(work, ignore_errors=True)
    print(f"[clone] {app} {size}+{size}: {job['wall_s']:.0f} s, lowest MemAvailable {job['min_mem_available_GiB']} GiB",
          flush=True)
    return rows, ratios, job


# ---------------------------------------------------------------------------------------------- report
def fmt(s: dict | None, unit: float = 1e3) -> str:
    if not s:
        return "–"
    return f"{s['median'] * unit:.1f} [{s['min'] * unit:.1f}, {s['max'] * unit:.1f}]"


def table(doc: dict) -> str:
    """Markdown: the three metrics per (app, size, approach), then the targets."""
    lines = [f"Median [min, max] over {doc['settings'].get('runs')} runs (ms); clone at step "
             f"{doc['settings'].get('at_step')} of {doc['settings'].get('steps')}; 2 cores for all 2N ranks.", "",
             "| app | ranks | approach | runtime overhead | standby | readiness | clone bit-exact (vs rank 0) |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        c = r.get("correctness", {})
        ok = {True: "yes", False: "no"}.get(c.get("bitexact_vs_rank0"), "–")
        if c.get("bitexact_vs_rank0") is False and c.get("bitexact_vs_counterpart"):
            ok = "counterpart's (non-replicated tensors)"
        lines.append(f"| {r['app']} | {r['ranks']} | {r['approach']} | {fmt(r.get('overhead_s'))} | "
                     f"{fmt(r.get('standby_s'))} | {fmt(r.get('readiness_s'))} | {ok} |"
                     + (f" errors: {len(r['errors'])}" if r.get("errors") else ""))
    lines += ["", "| target | measured (mean ± se) | ratio | verdict |", "|---|---|---|---|"]
    by = {(r["app"], r["size"], r["approach"]): r for r in doc["runs"]}
    for app in sorted({r["app"] for r in doc["runs"]}):
        for size in sorted({r["size"] for r in doc["runs"] if r["app"] == app}):
            d = by.get((app, size, "deepclone"))
            for metric, base, factor in TARGETS:
                b = by.get((app, size, base))
                if not d or not b or not d.get(metric) or not b.get(metric):
                    continue
                ds, bs = d[metric], b[metric]
                rt = ratio_of(bs, ds) or {}
                ratio = ("–" if "ratio" not in rt else f"{rt['ratio']:.1f}x" +
                         (f" ± {rt['ratio_se']:.1f}" if rt.get("ratio_se") is not None else ""))
                target = (app, size) == TARGET_CASE and factor is not None
                v = verdict(bs, ds, factor) if target else "reported"
                goal = (f">= {factor:g}x below {base}" if factor is not None else f"vs {base} (reported)")
                lines.append(f"| {metric[:-2].replace('_', ' ')}, {app} {size}+{size}: {goal} | deepclone "
                             f"{1e3 * ds['mean']:.1f} ± {1e3 * (ds.get('se') or 0):.1f} ms, {base} "
                             f"{1e3 * bs['mean']:.1f} ± {1e3 * (bs.get('se') or 0):.1f} ms | {ratio} | {v} |")
    return "\n".join(lines)


def plot(doc: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = doc["runs"]
    apps = [a for a in APPS if any(r["app"] == a for r in runs)]
    colors = {"pfs-hdf5": "#4c72b0", "mpi4py-p2p": "#dd8452", "deepclone": "#c44e52"}
    fig, axes = plt.subplots(len(apps), 3, figsize=(12, 3.6 * len(apps)), squeeze=False)
    for i, app in enumerate(apps):
        mine = [r for r in runs if r["app"] == app]
        sizes = sorted({r["size"] for r in mine})
        approaches = [a for a in APPROACHES if any(r["approach"] == a for r in mine)]
        w = 0.8 / max(1, len(approaches))
        for ax, metric, label in zip(axes[i], METRICS, ("runtime overhead (s)", "standby (s)", "readiness (s)")):
            vals = []
            for j, a in enumerate(approaches):
                xs, ys, lo, hi = [], [], [], []
                for k, n in enumerate(sizes):
                    r = next((r for r in mine if r["size"] == n and r["approach"] == a), None)
                    s = r.get(metric) if r else None
                    if not s:
                        continue
                    xs.append(k - 0.4 + w * (j + 0.5))
                    ys.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
                    vals.append(s["median"])
                if xs:
                    ax.bar(xs, ys, w, yerr=[lo, hi], capsize=2, label=a, color=colors.get(a))
            pos = [v for v in vals if v > 0]
            if pos and len(pos) == len(vals) and max(pos) / min(pos) > 20:
                ax.set_yscale("log")
            ax.axhline(0, color="black", lw=0.6)
            ax.set_xticks(range(len(sizes)), [f"{n}+{n}" for n in sizes])
            ax.set_xlabel("source + clone ranks")
            ax.set_title(f"{app}: {label}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        axes[i][0].legend(fontsize=8)
    s = doc.get("settings", {})
    fig.suptitle(f"DeepClone vs baselines: median over {s.get('runs')} runs (bars: min-max); clone at step "
                 f"{s.get('at_step')} of {s.get('steps')}; {doc.get('machine', {}).get('cpus')} cores", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    print(f"wrote {out}")


def deepclone_available() -> tuple[bool, str]:
    """Whether ``deepfreeze.keras`` has ``CloneCallback`` and ``receive_clone`` (in a subprocess:
    the driver does not import TensorFlow)."""
    code = "from deepfreeze.keras import CloneCallback, receive_clone"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode:
        return False, "deepfreeze.keras has no CloneCallback/receive_clone: " + (p.stderr.strip().splitlines() or ["?"])[-1]
    return True, ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--app", default="small", choices=sorted(APPS), help=argparse.SUPPRESS)
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--apps", default=None, help="comma list of apps (default: nt3-weights,resnet50; --quick: small)")
    ap.add_argument("--approaches", default=",".join(APPROACHES), help="comma list (default: all three)")
    ap.add_argument("--sizes", default=None, help="comma list of N (N source + N clone ranks; default: 1,2)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per approach, after one warm-up (default 5)")
    ap.add_argument("--steps", type=int, default=None, help="source steps per run (default 20)")
    ap.add_argument("--at-step", type=int, default=None, help="clone at this global optimizer step (default 10)")
    ap.add_argument("--clone-steps", type=int, default=None, help="steps the clones train after receiving (default 10)")
    ap.add_argument("--warm", type=int, default=None, help="first steps left out of the overhead baseline (default 3)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per mpirun job (default: from the schedule)")
    ap.add_argument("--recv-timeout", type=float, default=600.0,
                    help="seconds a clone waits for its state before the job is ended (default 600)")
    ap.add_argument("--verify-all", action="store_true", help="check bit-exactness in every run, not only the warm-up")
    ap.add_argument("--quick", action="store_true", help="smoke check: the small model, 1+1 and 2+2, one timed run")
    ap.add_argument("--resume", action="store_true", help="merge into an existing --out (replaces the groups re-run)")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    ap.add_argument("--plot", metavar="JSON", help="write the PNG of a results file (beside it) and exit")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "clone.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.table or args.plot:
        with open(args.table or args.plot) as f:
            doc = json.load(f)
        if args.table:
            print(table(doc))
        else:
            plot(doc, os.path.splitext(args.plot)[0] + ".png")
        return None
    sched = dict(QUICK if args.quick else FULL)
    for key in ("runs", "steps", "at_step", "clone_steps", "warm"):
        if getattr(args, key) is not None:
            sched[key] = getattr(args, key)
    if not 1 <= sched["warm"] < sched["at_step"] - 1 or sched["at_step"] + 1 > sched["steps"]:
        raise SystemExit(f"schedule {sched}: need 1 <= warm < at_step - 1 and at_step < steps (steps before the "
                         "clone step for the baseline, and the step after it)")
    apps = args.apps.split(",") if args.apps else sched["apps"]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else sched["sizes"]
    approaches = [a for a in args.approaches.split(",") if a]
    for a in apps:
        if a not in APPS:
            raise SystemExit(f"unknown app {a!r}: use {', '.join(APPS)}")
    for a in approaches:
        if a not in APPROACHES:
            raise SystemExit(f"unknown approach {a!r}: use {', '.join(APPROACHES)}")
    skipped = {}
    if "deepclone" in approaches:
        ok, why = deepclone_available()
        if not ok:
            approaches.remove("deepclone")
            skipped["deepclone"] = why
            print(f"[clone] deepclone skipped: {why}", file=sys.stderr, flush=True)
    if not approaches:
        raise SystemExit("no approach left to run")
    if args.quick and args.out == os.path.join(HERE, "results", "clone.json"):
        raise SystemExit("--quick results are not the repository's results: give --out (e.g. /tmp/clone-quick.json)")
    doc = None
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    if doc is None:
        doc = {"machine": {}, "settings": {}, "runs": [], "ratios": {}, "jobs": []}
    doc["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                      "mem_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)}
    doc["settings"] = {
        "mode": "quick" if args.quick else "full", "runs": sched["runs"], "warmup_rounds": 1,
        "steps": sched["steps"], "at_step": sched["at_step"], "clone_steps": sched["clone_steps"],
        "warm_steps_skipped": sched["warm"], "approaches": approaches, "optimizer": "SGD(1e-5), Horovod DistributedOptimizer",
        "batch": {a: APPS[a][1] for a in apps}, "images": {"resnet50": "64x64"},
        "mpirun": "--oversubscribe --bind-to none --mca mpi_yield_when_idle 1", "tf_threads": "intra 1, inter 1",
        "statistic": "median, min/max, p10/p90 over the timed runs; ratios of means with standard errors",
        "cores_note": "all 2N ranks share the machine's cores; after the clone step the clones train on the same "
                      "cores as the source's remaining steps",
        "skipped": skipped, "verify_all": args.verify_all, "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    per_step = {"nt3-weights": 3.0, "resnet50": 3.0, "small": 1.0}  # generous, for the timeout only
    base = tempfile.mkdtemp(prefix="dfclone-")
    t_start = time.time()
    try:
        for app in apps:
            for size in sizes:
                n_steps = (sched["runs"] + 1) * len(approaches) * (sched["steps"] + sched["clone_steps"])
                timeout = args.timeout or 300 + 3 * n_steps * per_step[app] * size
                rows, ratios, job = run_group(app, size, approaches, sched, sched["runs"], base, timeout,
                                              args.verify_all, args.recv_timeout)
                doc["runs"] = [r for r in doc["runs"] if (r["app"], r["size"]) != (app, size)] + rows
                doc["runs"].sort(key=lambda r: (list(APPS).index(r["app"]), r["size"], APPROACHES.index(r["approach"])))
                doc["ratios"][f"{app} {size}+{size}"] = ratios
                doc["jobs"] = [j for j in doc.get("jobs", []) if (j["app"], j["size"]) != (app, size)] + [job]
                write_doc(doc, args.out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    finish_doc(doc, args.out, t_start, table, plot)


if __name__ == "__main__":
    main()
