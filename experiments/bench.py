"""The paper's evaluation (DeepFreeze, section V, Fig. 5/6) side by side, in one run.

    python -m experiments.bench --quick --out /tmp/quick.json            # smoke check, < 3 min
    python -m experiments.bench --out experiments/results/bench.json     # the full grid
    python -m experiments.bench --apps nt3 --ranks 2 --resume --redo --out experiments/results/bench.json
    python -m experiments.plot experiments/results/bench.json

Apps: ``nt3`` (CANDLE NT3, batch 20), ``nt3-weights`` (NT3's 10 weight tensors, 620 MB, little
compute), ``resnet50`` (tf.keras.applications, 64x64 images, batch 32; the same 25.6 M weights as
at 224x224). Approaches (section V-B of the paper):

* ``none``: no checkpoint (the baseline iteration time);
* ``keras-default``: rank 0 ``model.save_weights`` to HDF5 on the persistent directory;
* ``veloc-single``: rank 0 ``get_weights`` then the engine (a one-rank plan);
* ``veloc-sharded``: every rank ``get_weights``, numpy slices of the shard plan, the engine;
* ``deepfreeze``: the graph hook (:class:`deepfreeze.keras.DeepFreezeCheckpoint`);
* ``deepfreeze-veloc``: the same with ``engine="veloc"`` (a site's VeloC through
  ``deepfreeze.bindings``); run only when that library is found, else listed in
  ``settings.skipped`` with the reason;
* ``tf-async``: rank 0 ``tf.train.Checkpoint.write`` with
  ``CheckpointOptions(experimental_enable_async_checkpoint=True)``.

How a run works. One ``mpirun`` per (app, rank count) runs every approach in turn in the same
processes (``none`` first, ``tf-async`` last): the model is built, compiled and traced once, and
each approach is one ``model.fit`` of its own (a fresh Horovod broadcast callback, the optimizer's
iteration counter reset to 0, its own scratch/persistent directories). The engine approaches run
the built-in engine in async mode, each rank its own simulated node (scratch directory and
backend process), weights only (``save_optimizer=False``) as in the paper, every version kept
on persistent (``max_versions=0``) and the newest two on scratch (``scratch_versions=2``: scratch
is node-local space used as a cache; a version deleted from it before the kernel's writeback
never costs disk time there), all deleted after the approach. Ranks are not bound to cores
(``mpirun --bind-to none``): with the default binding a 2-rank job gets one core per rank for
its TensorFlow threads, the DeepFreeze writer thread and the backend, and nt3-weights' step is
twice as long.

Schedule of every checkpointing approach: a checkpoint after every ``every``-th iteration
(iteration indices ``every-1, 2*every-1, ...``); the first is warm-up (buffers, files, the backend,
TF's CPU copies) and excluded; then ``measured`` checkpoints, each followed by one more iteration;
``steps = (measured + 1) * every + 1``. ``none`` runs ``none_steps`` iterations first, and again
after the last approach (``none-end``): the baseline is the mean of both (iteration times drift
by +-15 % over a run on this VM; ``baseline_start_s``/``baseline_end_s`` show by how much). Iterations 0
and 1 (trace, Horovod broadcast) are never used. Defaults (full mode), as short as a clean
measurement allows on this 2-vCPU machine (measured steps: nt3 11 s at 1 rank, ~40 s at 2 ranks, ~50 s at 3 ranks;
nt3-weights 0.45 / 1.2 / ~2 s; resnet50 0.5 / ~1 / 2 s at 1 / 2 / 4 ranks):

==============  ==========  =====  ========  ==========  =====
app             ranks       every  measured  none_steps  steps
==============  ==========  =====  ========  ==========  =====
nt3-weights     1, 2, 3     5      3         10          21
resnet50        1, 2, 4     5      3         10          21
nt3             1, 2, 3     2      1         4           5
==============  ==========  =====  ========  ==========  =====

(the paper checkpoints every 15 iterations; nt3 is too slow here for more than one measured
checkpoint per approach, so its runtime overhead is one pair of ~10-50 s iterations against two
baseline ones: read it with its standard error, and nt3-weights for the resolved number).
Expected wall time of the full grid on this machine, idle: nt3-weights ~12 min, resnet50 ~13 min,
nt3 ~60 min (7 min at 1 rank, 23 at 2, 29 at 3: NT3's step is 11 s at 1 rank and 35-50 s at 2-3
ranks on the 2 vCPUs), ~85 min in all; the minimum clean nt3 schedule (warm-up, one measured
checkpoint, the iteration after it) cannot be shortened further, so a 45-minute budget holds
nt3-weights + resnet50 + nt3 at 1 rank, and nt3 at 2 and 3 ranks take another ~50 min
(``--apps nt3 --ranks 2,3 --resume``). ``--quick``: nt3-weights at 2 ranks, ``every=3``, one
measured checkpoint, all approaches (about 2-2.5 minutes on the idle machine; a smoke check:
one checkpoint per approach, and the warm-up's background write may still run during the
measured one; with ``every=2`` DeepFreeze's blocking phase was 1.3 s of waiting for it).

Metrics (per app, rank count and approach), averaged over the measured checkpoints and the
ranks, warm-up excluded. Every iteration is timed from the first callback's
``on_train_batch_begin`` to the last callback's ``on_train_batch_end``, so the window holds the
train step (with DeepFreeze's in-graph shard copy, and the copy TF makes for an async save,
in ``write`` or as a copy-on-write in the next update) and all checkpoint work done in callbacks; an iteration's time is the mean over ranks.

* ``preparation_s``: ``get_weights`` + slicing (veloc-single/sharded only);
* ``blocking_s``: time in the checkpoint callback (ranks that checkpoint);
* ``runtime_overhead_s``: mean over {each measured checkpoint iteration, the iteration after
  it} minus ``baseline_iter_s``, the mean iteration of the ``none`` runs (before and after) of the same process
  (iterations away from checkpoints when there is no ``none`` run); extra fields:
  ``runtime_overhead_se_s`` (its standard error), ``runtime_overhead_away_s`` (against the
  iterations of the same fit away from checkpoints), ``extra_per_checkpoint_s`` (the total
  extra time of the two iterations, 2x the overhead), ``ckpt_iter_s``, ``after_iter_s`` and
  ``away_iter_s``; ``extra_per_interval_s``: ``every`` x (mean of every iteration from the first
  to the last measured checkpoint - the baseline), i.e. the whole training time a checkpoint
  costs, background work spread over the interval included (what the two-iteration window of
  the paper's metric misses when the background work outlasts it);
* ``time_to_durable_s``: from the start of the checkpoint callback to the version committed on
  persistent (engine approaches: the manifest's commit time; tf-async: the end of its writer
  thread; keras-default: the end of ``save_weights``, which neither it nor tf-async fsyncs,
  while the engine fsyncs);
* ``flush_GBps``: checkpoint bytes / (persistent commit - scratch commit) for the engine
  approaches (the background flush), bytes / time to durable for keras-default and tf-async
  (their direct write); ``durable_GBps``: bytes / time to durable for all;
* ``bytes_per_rank``: bytes the busiest rank captures; ``memcpy_shard_s``: that / memcpy limit
  (``memcpy_alloc_shard_s``: / the fresh-allocation memcpy rate);
* ``iter_s``: the rank-averaged time of every iteration (diagnostics);
* ``checkpoints``: measured checkpoint versions; ``checkpoint_samples``: (checkpoint, rank)
  blocking samples; ``iterations``; ``error`` when the approach failed.

Limits, measured by the driver (no run going on): ``memcpy_GBps`` (``np.copyto`` of a
256 MiB buffer into a preallocated one, best of 5) with ``memcpy_alloc_GBps`` (the same into a
fresh allocation, page faults included, as an in-graph copy pays), and ``write_GBps``
(sequential 512 MiB writes of random bytes + fsync into the persistent directory's file system,
3 at the start and 3 at the end of the invocation, the best; all in ``write_samples_GBps``). On
this VM the start samples are ~0.3 GB/s and the end ones ~1.5 GB/s: at the start the page cache
lands on guest memory that has not been touched for a while (kdamond is on), and touching such
memory the first time runs at ~0.43 GB/s against ~6.8 GB/s for recently freed pages (``np.ones``
of 1 GiB in two processes one after the other); ``memcpy_alloc_GBps`` is measured on warm
pages. The same cost can hit any fresh large allocation (``get_weights``, an in-graph copy into a
new tensor, the scratch write) and makes iteration times noisy.

Results are written after every (app, rank count) group; ``--resume`` merges into an existing
``--out`` (groups already there are skipped unless ``--redo``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APPS = {"nt3": ("nt3", 20), "nt3-weights": ("nt3_weights", 20), "resnet50": ("resnet50", 32)}
APPROACHES = ["none", "keras-default", "veloc-single", "veloc-sharded", "deepfreeze", "deepfreeze-veloc",
              "tf-async"]
ENGINE_APPROACHES = ("veloc-single", "veloc-sharded", "deepfreeze", "deepfreeze-veloc")
FULL = {  # app -> schedule; see the module docstring
    "nt3-weights": {"ranks": [1, 2, 3], "every": 5, "measured": 3, "none_steps": 10, "expected_min": 12},
    "resnet50": {"ranks": [1, 2, 4], "every": 5, "measured": 3, "none_steps": 10, "expected_min": 13},
    "nt3": {"ranks": [1, 2, 3], "every": 2, "measured": 1, "none_steps": 4, "expected_min": 60},
}
QUICK = {"nt3-weights": {"ranks": [2], "every": 3, "measured": 1, "none_steps": 4, "expected_min": 2.3}}
FIRST_USED = 2  # iterations 0 (trace) and 1 (after Horovod's broadcast) are not used
SCRATCH_VERSIONS = 2  # engine approaches keep every version on persistent, the newest 2 on scratch


def steps_of(every: int, measured: int) -> int:
    return (measured + 1) * every + 1


def ckpt_batches(every: int, measured: int) -> list[int]:
    """Iteration indices after which a checkpoint is taken; the first is warm-up."""
    return [k * every - 1 for k in range(1, measured + 2)]


def veloc_available() -> tuple[bool, str]:
    """Whether ``deepfreeze-veloc`` can run: the VeloC bindings import, find the library, and
    ``DeepFreezeCheckpoint`` takes ``engine=``. Returns (ok, reason)."""
    sys.path.insert(0, ROOT)
    try:
        import importlib
        mod = None
        for name in ("deepfreeze.bindings.veloc", "deepfreeze.bindings"):
            try:
                mod = importlib.import_module(name)
                break
            except ImportError as e:
                err = f"import {name}: {e}"
        if mod is None:
            return False, err
        f = getattr(mod, "available", None)
        if callable(f):  # deepfreeze.bindings.veloc: None when VeloC loads, else why not
            res = f()
            if isinstance(res, str) or res is False:
                return False, f"{mod.__name__}.available(): {res}"
        elif callable(getattr(mod, "find_library", None)):
            if not mod.find_library():
                return False, f"{mod.__name__}.find_library() found no VeloC library"
        else:
            return False, f"{mod.__name__} has no availability check (available()/find_library())"
        import inspect
        from deepfreeze.config import KEYS
        from deepfreeze.keras import DeepFreezeCheckpoint
        if "engine" not in inspect.signature(DeepFreezeCheckpoint.__init__).parameters and "engine" not in KEYS:
            return False, "DeepFreezeCheckpoint takes no engine= argument yet"
        return True, f"{mod.__name__}"
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:  # one rank; every approach in turn
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import gc
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    sys.path.insert(0, ROOT)
    from experiments import models

    hvd.init()
    rank = hvd.rank()
    builder, batch = APPS[args.app]
    model = getattr(models, builder)()
    x, y = models.synthetic(model, batch * 2, seed=rank)  # two batches, repeated: content does not matter
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1e-5)),
                  loss="sparse_categorical_crossentropy")
    os.makedirs(f"{args.work}/res", exist_ok=True)
    for approach in args.approaches.split(","):
        t0 = time.time()
        try:
            res = one_approach(args, approach, model, ds, tf, hvd)
        except Exception as e:  # noqa: BLE001 - recorded; the next approach still runs
            import traceback
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res.update(rank=rank, approach=approach, wall_s=time.time() - t0)
        with open(f"{args.work}/res/{approach}.r{rank}.json.tmp", "w") as f:
            json.dump(res, f)
        os.replace(f"{args.work}/res/{approach}.r{rank}.json.tmp", f"{args.work}/res/{approach}.r{rank}.json")
        gc.collect()
        hvd.allreduce(tf.constant(0.0), name=f"barrier_{approach}")  # every rank done before the next
        if rank == 0:
            if approach == "deepfreeze-veloc":  # VeloC's daemon outlives the job: stop it
                from deepfreeze.veloc_daemon import stop_backend
                stop_backend()
            shutil.rmtree(f"{args.work}/{approach}", ignore_errors=True)
        print(f"[bench] {args.app} x{hvd.size()} {approach}: {time.time() - t0:.0f} s", flush=True)


def one_approach(args, approach: str, model, ds, tf, hvd) -> dict:
    import threading
    from deepfreeze import Config
    from deepfreeze.engine import Engine
    from deepfreeze.keras import DeepFreezeCheckpoint
    from deepfreeze.keras.state_loader import model_tensors
    from deepfreeze.shardplan import ShardPlan, TensorSpec

    rank, size = hvd.rank(), hvd.size()
    every, measured = args.every, args.measured
    baseline_run = approach in ("none", "none-end")
    steps = args.none_steps if baseline_run else steps_of(every, measured)
    due = set() if baseline_run else set(ckpt_batches(every, measured))
    work = f"{args.work}/{approach}"
    # each rank its own simulated node; VeloC runs one backend per user and machine with one
    # configuration, so with it every rank shares one node
    node = 0 if approach == "deepfreeze-veloc" else rank
    cfg = Config.load(None, mode="async", scratch=f"{work}/node{node}/scratch", persistent=f"{work}/persistent",
                      failure_domain=f"node{node}", max_versions=0, scratch_versions=SCRATCH_VERSIONS,
                      ec_interval=-1)
    os.makedirs(f"{work}/persistent", exist_ok=True)
    model.optimizer.iterations.assign(0)  # versions = batch + 1 in every approach
    begin, end, ckpts, durable = {}, {}, [], {}
    tensors = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
    total = int(sum(t.nbytes for t in tensors))
    out = {"bytes_total": total, "bytes_rank": total if rank == 0 else 0}

    # machine CPU at the start of the iterations that bound the measured window (rank 0 reads
    # /proc/stat: ~20 us, only at these iterations)
    marks = ({FIRST_USED, steps - 1} if baseline_run else set(ckpt_batches(every, measured)[1:])) if rank == 0 else set()
    cpu_at: dict[int, dict] = {}

    class First(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch in marks:
                cpu_at[batch] = machine_cpu()
            begin[batch] = time.perf_counter()

    class Last(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            end[batch] = time.perf_counter()

    ckpt_cb, engine, df, tfck, watchers = None, None, None, None, []
    if approach in ("veloc-single", "veloc-sharded"):
        world = 1 if approach == "veloc-single" else size
        plan = ShardPlan.build(tensors, world)
        writes = world > 1 or rank == 0
        engine = Engine(cfg, "bench", rank if world > 1 else 0, plan) if writes else None
        out["bytes_rank"] = plan.rank_bytes()[rank if world > 1 else 0] if writes else 0
        mine = plan.for_rank(rank if world > 1 else 0)

        class Manual(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch not in due or engine is None:
                    return
                t0 = time.perf_counter()
                weights = self.model.get_weights()
                pieces = [weights[p.tensor_id].reshape(-1)[p.start:p.stop] for p in mine]
                t1 = time.perf_counter()
                engine.checkpoint(batch + 1, pieces, step=batch + 1, epoch=0)
                t2 = time.perf_counter()
                ckpts.append({"version": batch + 1, "t": time.time() - (t2 - t0), "prep": t1 - t0, "block": t2 - t0})
        ckpt_cb = Manual()
    elif approach in ("deepfreeze", "deepfreeze-veloc"):
        kw = {"engine": "veloc"} if approach == "deepfreeze-veloc" else {}
        df = DeepFreezeCheckpoint(cfg, name="bench", every_n_batches=every, at_epoch_end=False,
                                  save_optimizer=False, overwrite=True, **kw)  # each measurement: a new run
        ckpt_cb = df
    elif approach in ("keras-default", "tf-async"):
        tfck = tf.train.Checkpoint(model=model) if approach == "tf-async" else None
        opts = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=True)

        def watch(version: int) -> None:
            helper = getattr(tfck, "_async_checkpointer", None)
            (helper().sync if callable(helper) else tfck.sync)()  # waits for the writer thread
            durable[str(version)] = time.time()

        class RankZero(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch not in due or rank != 0:
                    return
                t0 = time.perf_counter()
                if approach == "keras-default":
                    self.model.save_weights(f"{work}/persistent/weights-v{batch + 1}.h5")
                else:
                    tfck.write(f"{work}/persistent/tfck-v{batch + 1}", options=opts)
                t2 = time.perf_counter()
                t = time.time() - (t2 - t0)
                ckpts.append({"version": batch + 1, "t": t, "prep": None, "block": t2 - t0})
                if approach == "keras-default":
                    durable[str(batch + 1)] = t + (t2 - t0)
                else:
                    w = threading.Thread(target=watch, args=(batch + 1,), daemon=True)
                    w.start()
                    watchers.append(w)
        ckpt_cb = RankZero()
    cbs = [First(), hvd.callbacks.BroadcastGlobalVariablesCallback(0)] + ([ckpt_cb] if ckpt_cb else []) + [Last()]
    try:
        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)
        if len(cpu_at) >= 2:  # whole machine, per iteration of the window between the first and last mark
            a, b = min(cpu_at), max(cpu_at)
            out["machine_cpu_per_iter"] = {k: (cpu_at[b][k] - cpu_at[a][k]) / (b - a) for k in cpu_at[a]}
    finally:
        if df is not None:
            df.wait()
            ckpts = [{"version": d["version"], "t": d["time"], "prep": None, "block": d["blocking_s"],
                      "capture": d.get("capture_s")} for d in df.timings]
            if df.plan is not None:
                out["bytes_rank"] = int(df.plan.rank_bytes()[rank])
            out["quiet_s"] = list(df.quiet_times)
            eng = df.engine
            if eng is not None:
                out["writer_cpu_s"] = {str(v): c for v, c in getattr(eng, "writer_cpu", {}).items()}
                backend = getattr(eng, "_backend", None)
                out["backend_cpu_s"] = process_cpu(backend.pid) if backend is not None else None
            df.close()
        if engine is not None:
            engine.close()
        for w in watchers:
            w.join()
        if tfck is not None:
            tfck.sync()
    if approach in ENGINE_APPROACHES:
        durable.update(commit_times(f"{work}/persistent/bench"))
        out["scratch_done"] = scratch_times(f"{work}/node{rank}/scratch/bench")
    iters = {b: end[b] - begin[b] for b in begin if b in end}
    import resource
    out["peak_rss_B"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak so far
    out.update(iters=[[b, iters[b]] for b in sorted(iters)], ckpts=ckpts, durable=durable)
    return out


def machine_cpu() -> dict[str, float]:
    """CPU seconds of the whole machine so far (/proc/stat): busy (user+nice+system+irq+softirq)
    and kernel (system+irq+softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    hz = os.sysconf("SC_CLK_TCK")
    return {"busy_s": (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, "kernel_s": (v[2] + v[5] + v[6]) / hz}


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def commit_times(root: str) -> dict[str, float]:
    """version -> commit time on persistent (manifest's ``committed``)."""
    out = {}
    for d in os.listdir(root) if os.path.isdir(root) else []:
        try:
            with open(f"{root}/{d}/manifest.json") as f:
                m = json.load(f)
            out[str(m["version"])] = float(m["committed"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return out


def scratch_times(root: str) -> dict[str, float]:
    """version -> when this rank's scratch copy was complete (mtime of the newest file there)."""
    out = {}
    for d in os.listdir(root) if os.path.isdir(root) else []:
        vdir = f"{root}/{d}"
        try:
            m = json.load(open(f"{vdir}/manifest.json"))
            out[str(m["version"])] = max(os.stat(f"{vdir}/{n}").st_mtime for n in os.listdir(vdir))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return out


# ---------------------------------------------------------------------------------------------- driver
def write_rates(directory: str, n: int = 3, nbytes: int = 512 << 20) -> list[float]:
    """GB/s of ``n`` sequential writes of ``nbytes`` + fsync into ``directory``."""
    import numpy as np
    os.makedirs(directory, exist_ok=True)
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)  # incompressible, like weights
    out = []
    for i in range(n):
        path = os.path.join(directory, f"bw{i}.tmp")
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(buf))
            f.flush()
            os.fsync(f.fileno())
        out.append(round(nbytes / (time.perf_counter() - t) / 1e9, 3))
    for i in range(n):
        os.unlink(os.path.join(directory, f"bw{i}.tmp"))
    return out


def limits(persistent_dir: str) -> dict[str, float]:
    import numpy as np
    n = 256 << 20
    src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
    np.copyto(dst, src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    best_alloc = math.inf
    for _ in range(3):
        t = time.perf_counter()
        fresh = src.copy()
        best_alloc = min(best_alloc, time.perf_counter() - t)
        del fresh
    del dst
    rates = write_rates(persistent_dir)
    return {"memcpy_GBps": n / best / 1e9, "memcpy_alloc_GBps": n / best_alloc / 1e9, "write_GBps": max(rates),
            "write_samples_GBps": rates, "memcpy_bytes": n, "write_bytes": 512 << 20}


def mean(v):
    v = [x for x in v if x is not None]
    return sum(v) / len(v) if v else None


def var(v):
    m = mean(v)
    return sum((x - m) ** 2 for x in v) / (len(v) - 1) if len(v) > 1 else None


def rank_means(per_rank: list[list]) -> dict[int, float]:
    """iteration -> its time averaged over the ranks, from each rank's ``[[iteration, seconds], ...]``."""
    per_b: dict[int, list[float]] = {}
    for iters in per_rank:
        for b, t in iters:
            per_b.setdefault(int(b), []).append(t)
    return {b: sum(v) / len(v) for b, v in per_b.items()}


def read_results(work: str, approach: str, ranks: int) -> list[dict]:
    """The per-rank result files of ``approach`` that a job left in ``work`` (missing ones skipped)."""
    out = []
    for r in range(ranks):
        try:
            with open(f"{work}/res/{approach}.r{r}.json") as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            pass
    return out


def summarize(app: str, ranks: int, approach: str, rs: list[dict], sched: dict, baseline: float | None,
              lim: dict) -> dict:
    """One row of ``runs`` from the per-rank records of one approach."""
    every, measured = sched["every"], sched["measured"]
    row = {"app": app, "ranks": ranks, "approach": approach, "preparation_s": None, "blocking_s": None,
           "runtime_overhead_s": None, "time_to_durable_s": None, "flush_GBps": None,
           "baseline_iter_s": baseline, "bytes_per_rank": None}
    errors = sorted({r["error"] for r in rs if r.get("error")})
    if len(rs) < ranks:
        errors.append(f"results of {ranks - len(rs)} of {ranks} ranks missing (process died?)")
    ok = [r for r in rs if not r.get("error")]
    if errors:
        row["error"] = "; ".join(errors)
    if not ok:
        return row
    it = rank_means([r["iters"] for r in ok])
    row["iterations"] = len(it)
    nbytes = ok[0]["bytes_total"]
    row["bytes_per_rank"] = max(r["bytes_rank"] for r in ok)
    if lim.get("memcpy_GBps"):
        row["memcpy_shard_s"] = row["bytes_per_rank"] / (lim["memcpy_GBps"] * 1e9)
    if lim.get("memcpy_alloc_GBps"):
        row["memcpy_alloc_shard_s"] = row["bytes_per_rank"] / (lim["memcpy_alloc_GBps"] * 1e9)
    row["iter_s"] = [round(it[b], 4) for b in sorted(it)]  # rank-averaged, iteration 0 first
    if all(r.get("peak_rss_B") for r in ok):  # the process's peak so far (approaches run in order)
        row["peak_rss_max_GB"] = max(r["peak_rss_B"] for r in ok) / 1e9
    cpu = [r["machine_cpu_per_iter"] for r in ok if r.get("machine_cpu_per_iter")]  # rank 0's
    if cpu:  # machine-wide CPU per iteration over the measured intervals
        row["machine_busy_per_iter_s"] = cpu[0]["busy_s"]
        row["machine_kernel_per_iter_s"] = cpu[0]["kernel_s"]
    if approach == "none":
        base = [t for b, t in it.items() if b >= FIRST_USED]
        if all("iters_end" in r for r in ok):
            end = [t for b, t in sorted(rank_means([r["iters_end"] for r in ok]).items()) if b >= FIRST_USED]
            row["baseline_start_s"], row["baseline_end_s"] = mean(base), mean(end)
            base = base + end
        row["baseline_iter_s"] = mean(base)
        row["baseline_sd_s"] = math.sqrt(var(base)) if var(base) is not None else None
        row["_var"], row["_n"] = var(base), len(base)
        return row
    cks = ckpt_batches(every, measured)
    meas = cks[1:]
    near = set(cks) | {b + 1 for b in cks}
    ck_it = [it[b] for b in meas if b in it]
    after_it = [it[b + 1] for b in meas if b + 1 in it]
    around = ck_it + after_it
    away = [t for b, t in it.items() if b >= FIRST_USED and b not in near]
    row["ckpt_iter_s"], row["after_iter_s"] = mean(ck_it), mean(after_it)
    row["away_iter_s"] = mean(away)
    base, base_var, base_n = baseline, sched.get("baseline_var"), sched.get("baseline_n", 0)
    if base is None and away:
        base, base_var, base_n = mean(away), var(away), len(away)
        row["baseline_iter_s"] = base
        row["baseline_from"] = "away"
    if around and base is not None:
        row["runtime_overhead_s"] = mean(around) - base
        row["extra_per_checkpoint_s"] = 2 * row["runtime_overhead_s"]
        va = var(around)
        if va is not None and base_var is not None and base_n:
            row["runtime_overhead_se_s"] = math.sqrt(va / len(around) + base_var / base_n)
    if around and away:
        row["runtime_overhead_away_s"] = mean(around) - mean(away)
    whole = [it[b] for b in range(meas[0], meas[-1]) if b in it] if len(meas) > 1 else []
    if whole and base is not None:  # every iteration of the complete intervals: background work included
        row["extra_per_interval_s"] = every * (mean(whole) - base)
        vw = var(whole)
        if vw is not None and base_var is not None and base_n:
            row["extra_per_interval_se_s"] = every * math.sqrt(vw / len(whole) + base_var / base_n)
        row["interval_iterations"] = len(whole)
    warm = cks[0] + 1  # version of the warm-up checkpoint
    samples = [(r, c) for r in ok for c in r["ckpts"] if c["version"] > warm]
    row["checkpoints"] = len({c["version"] for _, c in samples})
    taken = sorted({c["version"] for r in ok for c in r["ckpts"]})
    if taken != [b + 1 for b in cks]:
        row["note"] = f"checkpoint versions {taken}, expected {[b + 1 for b in cks]}"
    row["checkpoint_samples"] = len(samples)
    row["preparation_s"] = mean([c["prep"] for _, c in samples])
    row["blocking_s"] = mean([c["block"] for _, c in samples])
    blocks = sorted(c["block"] for _, c in samples if c["block"] is not None)
    if blocks:
        row["blocking_median_s"] = blocks[len(blocks) // 2] if len(blocks) % 2 else \
            (blocks[len(blocks) // 2 - 1] + blocks[len(blocks) // 2]) / 2
        row["blocking_p90_s"] = blocks[min(len(blocks) - 1, math.ceil(0.9 * len(blocks)) - 1)]
    if approach in ("deepfreeze", "deepfreeze-veloc"):
        row["capture_s"] = mean([c.get("capture") for _, c in samples])
        quiet = sorted(q for r in ok for q in r.get("quiet_s", [])[FIRST_USED:])
        if quiet:
            row["quiet_median_s"] = quiet[len(quiet) // 2]
            row["quiet_samples"] = len(quiet)
        wcpu = [c for r in ok for v, c in r.get("writer_cpu_s", {}).items() if int(v) > warm]
        row["writer_cpu_per_ckpt_s"] = sum(wcpu) / max(1, row["checkpoints"]) if wcpu else None  # all ranks
        bcpu = [r["backend_cpu_s"] for r in ok if r.get("backend_cpu_s") is not None]
        n_all = len({c["version"] for r in ok for c in r["ckpts"]})
        row["backend_cpu_per_ckpt_s"] = sum(bcpu) / max(1, n_all) if bcpu else None  # all backends, warm-up incl.
    durable = {}
    for r in ok:
        durable.update(r.get("durable", {}))
    dts = [durable[str(c["version"])] - c["t"] for _, c in samples if str(c["version"]) in durable]
    row["time_to_durable_s"] = mean(dts)
    if row["time_to_durable_s"]:
        row["durable_GBps"] = nbytes / row["time_to_durable_s"] / 1e9
    if approach in ENGINE_APPROACHES:
        flush = []
        for v in {c["version"] for _, c in samples}:
            sc = [r["scratch_done"][str(v)] for r in ok if str(v) in r.get("scratch_done", {})]
            if sc and str(v) in durable:
                flush.append(durable[str(v)] - max(sc))
        if flush and mean(flush) > 0:
            row["flush_s"] = mean(flush)
            row["flush_GBps"] = nbytes / row["flush_s"] / 1e9
    elif row.get("durable_GBps"):
        row["flush_GBps"] = row["durable_GBps"]
    return row


def run_group(app: str, ranks: int, approaches: list[str], sched: dict, base: str, lim: dict,
              timeout: float) -> list[dict]:
    """All ``approaches`` of one (app, rank count) in one mpirun. If the job dies (a rank killed,
    e.g. out of memory, or the timeout), the approaches without results run once more in a
    fresh job, again after a ``none`` run of their own."""
    t0 = time.time()
    rows: dict[str, dict] = {}
    todo = list(approaches) + (["none-end"] if len(approaches) > 1 else [])
    for attempt in range(2):
        work = tempfile.mkdtemp(prefix=f"{app}-{ranks}-", dir=base)
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)]
        cmd += ["--allow-run-as-root"] if os.getuid() == 0 else []
        cmd += [sys.executable, "-m", "experiments.bench", "--worker", "--app", app, "--approaches", ",".join(todo),
                "--every", str(sched["every"]), "--measured", str(sched["measured"]),
                "--none-steps", str(sched["none_steps"]), "--work", work]
        failure = None
        logpath = f"{base}/{app}-{ranks}-{attempt}.log"
        with open(logpath, "w") as log:
            p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
            try:
                if p.wait(timeout=timeout) != 0:
                    failure = f"mpirun exited with {p.returncode}"
            except subprocess.TimeoutExpired:
                failure = f"timed out after {timeout:.0f} s"
                import signal
                os.killpg(p.pid, signal.SIGTERM)  # mpirun and the ranks it started (its own session)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        if failure:
            tail = open(logpath, errors="replace").read()[-4000:]
            print(f"[bench] {app} x{ranks} (attempt {attempt + 1}): {failure}\n{tail}", file=sys.stderr, flush=True)
        sch = dict(sched)
        ends = read_results(work, "none-end", ranks)
        for approach in [a for a in todo if a != "none-end"]:
            rs = read_results(work, approach, ranks)
            if not rs:
                rows.setdefault(approach, dict(summarize(app, ranks, approach, [], sched, None, {}),
                                               error=f"not run: {failure}"))
                continue
            if approach == "none" and len(ends) == len(rs) and not any(e.get("error") for e in ends + rs):
                # the baseline from a 'none' run before and one after all approaches (drift, noise)
                for r, e in zip(sorted(rs, key=lambda x: x["rank"]), sorted(ends, key=lambda x: x["rank"])):
                    r["iters_end"] = e["iters"]
            row = summarize(app, ranks, approach, rs, sch, sch.get("baseline"), lim)
            bvar, bn = row.pop("_var", None), row.pop("_n", 0)
            if approach == "none" and row.get("baseline_iter_s") is not None:
                sch.update(baseline=row["baseline_iter_s"], baseline_var=bvar, baseline_n=bn)
            row["wall_s"] = max((r.get("wall_s", 0) for r in rs), default=None)
            if attempt:
                row["attempt"] = attempt + 1
            if approach != "none" or "none" not in rows or rows["none"].get("error"):
                rows[approach] = row
            print(json.dumps({k: v for k, v in row.items() if k != "iter_s"}), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        missing = [a for a in approaches if a != "none" and any(
            m in rows.get(a, {}).get("error", "") for m in ("not run", "process died"))]
        if not failure or not missing or attempt == 1:
            break
        todo = ["none"] + missing + ["none-end"]
        for a in missing:
            rows.pop(a, None)
    print(f"[bench] {app} x{ranks}: {time.time() - t0:.0f} s", flush=True)
    return [rows[a] for a in approaches if a in rows]


def write_doc(doc: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(out + ".tmp", out)


def finish_doc(doc: dict, out: str, t_start: float, table: "Callable[[dict], str]",
               plot: "Callable[[dict, str], None]") -> None:
    """The end of an experiment run: wall time, the markdown tables, the JSON and the PNG beside it."""
    doc["settings"]["wall_s"] = round(time.time() - t_start, 1)
    doc["table_md"] = table(doc)
    write_doc(doc, out)
    plot(doc, os.path.splitext(out)[0] + ".png")
    print(doc["table_md"])
    print(f"wrote {out} ({time.time() - t_start:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--app", default="nt3-weights", choices=sorted(APPS), help=argparse.SUPPRESS)
    ap.add_argument("--approaches", default=",".join(APPROACHES),
                    help="comma list of approaches to run (default: all; 'none' always runs)")
    ap.add_argument("--every", type=int, default=None, help="iterations between checkpoints (default: per app)")
    ap.add_argument("--measured", type=int, default=None, help="measured checkpoints (default: per app)")
    ap.add_argument("--none-steps", type=int, default=None, help="iterations of the 'none' run (default: per app)")
    ap.add_argument("--work", default="", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke check (< 3 min): nt3-weights at 2 ranks, all approaches")
    ap.add_argument("--apps", default=None, help="comma list of apps (default: nt3-weights,resnet50,nt3)")
    ap.add_argument("--ranks", default=None, help="comma list of rank counts to keep (default: per app)")
    ap.add_argument("--resume", action="store_true", help="merge into an existing --out; skip groups already there")
    ap.add_argument("--redo", action="store_true", help="with --resume: re-run selected groups already there")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench.json"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    t_start = time.time()
    table = {a: dict(s) for a, s in (QUICK if args.quick else FULL).items()}
    apps = args.apps.split(",") if args.apps else list(table)
    for a in apps:
        if a not in APPS:
            raise SystemExit(f"unknown app {a!r}: use {', '.join(APPS)}")
        table.setdefault(a, dict(FULL[a]))
        for key in ("every", "measured", "none_steps"):
            if getattr(args, key) is not None:
                table[a][key] = getattr(args, key)
        table[a]["steps"] = steps_of(table[a]["every"], table[a]["measured"])
    keep_ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
    approaches = [a for a in args.approaches.split(",") if a]
    for a in approaches:
        if a not in APPROACHES:
            raise SystemExit(f"unknown approach {a!r}: use {', '.join(APPROACHES)}")
    if "none" not in approaches:
        approaches.insert(0, "none")  # the baseline of the same process
    approaches = [a for a in APPROACHES if a in approaches]  # fixed order: none first, tf-async last
    skipped = {}
    if "deepfreeze-veloc" in approaches:
        ok, why = veloc_available()
        if not ok:
            approaches.remove("deepfreeze-veloc")
            skipped["deepfreeze-veloc"] = f"no VeloC: {why}"

    doc = None
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    if doc is None:
        doc = {"machine": {}, "limits": {}, "settings": {}, "runs": []}
    doc["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                      "mem_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
                      "quick": args.quick}
    settings = doc.setdefault("settings", {})
    settings.setdefault("schedule", {}).update({a: table[a] for a in apps})
    settings.update({"mode": "quick" if args.quick else "full", "approaches": approaches, "skipped": {**settings.get("skipped", {}), **skipped},
                     "first_used_iteration": FIRST_USED, "warmup_checkpoints": 1,
                     "engine": "built-in, async, one simulated node per rank, max_versions=0, scratch_versions=2, chksum on, max_inflight=2",
                     "mpirun": "--oversubscribe --bind-to none",
                     "images": {"resnet50": "64x64"}, "batch": {a: APPS[a][1] for a in APPS}})
    if "deepfreeze-veloc" in approaches:
        settings["skipped"].pop("deepfreeze-veloc", None)
    base = tempfile.mkdtemp(prefix="dfbench-")
    lim = limits(os.path.join(base, "persistent-bw"))
    doc["limits"] = lim
    settings.setdefault("invocations", []).append({"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                   "argv": sys.argv[1:], "limits": lim})
    print(f"[bench] limits {json.dumps(lim)}", flush=True)
    write_doc(doc, args.out)
    good: dict[tuple, set] = {}
    for r in doc["runs"]:
        if not r.get("error"):
            good.setdefault((r["app"], r["ranks"]), set()).add(r["approach"])
    done = {k for k, v in good.items() if set(approaches) <= v}
    per_step = {"nt3": 45.0, "nt3-weights": 2.5, "resnet50": 2.0}  # generous, for the timeout only
    for app in apps:
        sched = table[app]
        for ranks in sched["ranks"]:
            if keep_ranks is not None and ranks not in keep_ranks:
                continue
            if args.resume and not args.redo and (app, ranks) in done:
                print(f"[bench] {app} x{ranks}: already in {args.out}, skipped (--redo to re-run)", flush=True)
                continue
            n_steps = sched["none_steps"] + (len(approaches) - 1) * sched["steps"]
            timeout = 600 + 3 * n_steps * per_step[app] * max(1, ranks / 2)
            rows = run_group(app, ranks, approaches, sched, base, lim, timeout)
            keys = {(r["app"], r["ranks"], r["approach"]) for r in rows}
            doc["runs"] = [r for r in doc["runs"] if (r["app"], r["ranks"], r["approach"]) not in keys] + rows
            doc["runs"].sort(key=lambda r: (list(APPS).index(r["app"]), r["ranks"], APPROACHES.index(r["approach"])))
            write_doc(doc, args.out)
    rates = write_rates(os.path.join(base, "persistent-bw"))  # the disk is shared: sample it again at the end
    lim["write_samples_GBps"] += rates
    lim["write_GBps"] = max(lim["write_samples_GBps"])
    doc["limits"] = lim
    shutil.rmtree(base, ignore_errors=True)
    settings["invocations"][-1]["wall_s"] = round(time.time() - t_start, 1)
    write_doc(doc, args.out)
    print(f"wrote {args.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
