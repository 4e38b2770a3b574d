"""Memory tier (issue 16, Portus): the copy path's microbenchmarks, the standalone tier, and
DeepFreeze with the memory tier against file scratch, HDF5 and tf.train.Checkpoint.

    python -m experiments.memtier --quick                        # smoke check (~2-3 min): tiny model
    python -m experiments.memtier                                # full run (see "Wall time" below)
    python -m experiments.memtier --parts micro,standalone       # the parts that need no engine
    python -m experiments.memtier --parts engine --models nt3 --ranks 2 --resume

Writes ``experiments/results/memtier.json`` and ``memtier.png`` (``--out`` moves both).
Models (per-rank bytes follow the shard plan): ``resnet50`` (tf.keras.applications, 64x64 images:
the same 25.6 M weights, 102.6 MB, as at 224x224), ``vgg19`` (VGG19's exact 38 weight tensors,
143.7 M parameters, 574.7 MB, with little compute: the conv stack on 32x32 images and the dense
stack on a vector of VGG19's flatten width, as :func:`experiments.models.nt3_weights` does for
NT3), ``nt3`` (NT3's 10 weight tensors, 619.7 MB: :func:`experiments.models.nt3_weights`);
``--quick`` uses ``tiny`` (a dense model of ~8 MB). Every number is a median over ``--reps``
repetitions (default 10, ``--quick`` 3) with its standard error (of the mean, as a spread
indicator) and the samples.

**Part micro** (no TensorFlow; what the targets on the copy path are about). Per model and rank
count, the rank's shard size S (``S = bytes / ranks``, rounded to the page) as one buffer in a
*source process* (a child that allocated and touched S bytes and allowed this process as its
ptracer, the training rank's stand-in), and a device on /dev/shm with one standalone model of S
bytes (pre-faulted at registration):

- ``memcpy_s``: ``np.copyto`` of S bytes into pre-faulted memory (the reference: one memcpy);
- ``memcpy_crc_s``: the same in 4 MiB chunks with the CRC32 of each chunk (``format.crc32``, the
  one the copier uses: ISA-L when installed, else zlib): an in-process copy with checksums;
- ``readv_s``: :class:`deepfreeze.memtier.copy.VmReadvCopier` ``.copy_in`` from the source
  process straight into a slot's data region, CRC32 of the piece computed as the chunks land
  (the backend's copy); ``readv_bytes`` / ``readv_calls``: its byte count (must equal S) and
  number of ``process_vm_readv`` calls;
- ``done_s``: ``readv_s`` plus the slot's commit (image header, manifest, msync, header DONE):
  the time until the version is DONE in the tier once the backend starts;
- ``local_s``: :class:`~deepfreeze.memtier.copy.LocalCopier` (the fallback when the backend may
  not read the rank's memory: the rank copies into the mapping itself);
- ``rank_cpu_s``: CPU seconds the source process spends per checkpoint (``time.process_time``
  around sending the request and waiting for the acknowledgement): the rank's own share;
- targets: ``readv_s / memcpy_s <= 1.5`` (CRC included), ``rank_cpu_s / memcpy_s <= 0.10``,
  ``readv_bytes == S``.

**Part standalone** (no TensorFlow): :mod:`deepfreeze.memtier.api` with the model's tensor
list (names, shapes) as numpy arrays: ``checkpoint_s`` (``api.checkpoint``: an in-process copy into
the slot with CRCs, then DONE), ``restore_out_s`` (``api.restore(out=...)``: one copy into
existing arrays), ``restore_s`` (fresh arrays), and one ``dump`` per format (``.npz``,
``.safetensors``, ``.h5``; not repeated).

**Part engine** (TensorFlow + Horovod under ``mpirun --bind-to none``, 1 and 2 ranks, one
``mpirun`` per (model, ranks) running every variant in turn in the same processes; each rank is
its own simulated node: its own scratch directory, backend process and device). A checkpoint every
``every`` iterations, weights only (``save_optimizer=False``), the first checkpoint is warm-up;
then ``reps`` measured ones. Variants:

- ``df-scratch``: :class:`deepfreeze.keras.DeepFreezeCheckpoint`, async built-in engine, scratch on
  /dev/shm (the same memory as the tier);
- ``df-memtier``: the same with ``memtier = <device on /dev/shm>`` (the backend pulls the capture
  buffer with ``process_vm_readv``); run only when the installed DeepFreeze knows the key
  (``settings.skipped`` says why not);
- ``h5-fsync`` / ``h5-nofsync``: rank 0 ``model.save_weights`` to an .h5 file in ``--disk-dir``
  (default: a temporary directory under ``$TMPDIR`` or /tmp, a disk file system on this machine;
  the DeepFreeze variants' persistent level is there too), with and without ``fsync`` of the file;
- ``tf-ckpt``: rank 0 ``tf.train.Checkpoint(model=model).write`` (synchronous) into ``--disk-dir``.

Both DeepFreeze variants run with ``persistent_interval = -1`` by default (``--persistent-interval``
changes it): nothing is flushed to the persistent level, so the background CPU is the tier's (or
scratch's) own, not the flush both variants share. Measured per checkpoint:

- ``stall_s``: time in the checkpoint callback (DeepFreeze: ``timings[*].blocking_s``, the
  in-graph capture's hand-off; h5/tf: the whole save);
- ``done_s``: from the callback's start to the version DONE on its first level (``df-scratch``:
  the scratch manifest written, recorded by a :class:`~deepfreeze.tiers.scratch.ScratchLevel` subclass
  passed as ``scratch_cls``; ``df-memtier``: the engine's acknowledgement time when it records one,
  else the slot header's ``written`` time (exact: the headers are polled every 20 ms, so each
  version is seen before its slot is reused); h5/tf: the end of the save);
- ``rank_cpu_s``: the rank's writer-thread CPU for the version (``Engine.writer_cpu``);
  ``backend_cpu_s``: the backend process's CPU over the fit / checkpoints (warm-up included, mean);
  ``background_cpu_s``: their sum;
- ``restore_s`` (after the fit, ``reps`` times): DeepFreeze ``deepfreeze.keras.restore`` (the
  memory tier first, then scratch: both in memory by nature, no cache to drop); ``h5``:
  ``model.load_weights`` after ``posix_fadvise(DONTNEED)`` of the file (fsync'ed first, so no
  dirty page stays: a *cold* cache) and warm; ``tf-ckpt``: ``Checkpoint.read`` cold and warm.

Targets (``targets`` in the JSON; each with the numbers it compares): df-memtier vs df-scratch
``done_s`` >= 2x faster and ``background_cpu_s`` >= 2x less; df-memtier ``stall_s`` median <= 1 ms;
the micro targets above; df-memtier restore >= 3x faster than h5 cold.

Wall time (full, idle 2-vCPU machine, estimated): micro ~3 min, standalone ~2 min, engine
~6 min per (model, ranks) group, ~40 min in all. ``--resume`` keeps groups already in ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PAGE = 4096
CHUNK = 4 << 20
#: parameter bytes of each model (float32); the engine part records the real number it checkpoints
MODEL_BYTES = {"resnet50": 25_636_712 * 4, "vgg19": 143_667_240 * 4, "nt3": 154_922_918 * 4, "tiny": 2_099_210 * 4}
MODELS = ("resnet50", "vgg19", "nt3")
VARIANTS = ("df-scratch", "df-memtier", "h5-fsync", "h5-nofsync", "tf-ckpt")
BATCH = {"resnet50": 16, "vgg19": 8, "nt3": 8, "tiny": 32}
SHM = "/dev/shm"


# ============================================================================ statistics
def med(v: list[float]) -> float | None:
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def se(v: list[float]) -> float | None:
    v = [x for x in v if x is not None]
    return statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else None


def summary(v: list[float]) -> dict:
    """``{"median", "se", "n", "samples"}`` of a list of seconds (None entries dropped)."""
    v = [x for x in v if x is not None]
    return {"median": med(v), "se": se(v), "n": len(v), "samples": [round(x, 7) for x in v]}


def page_round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def drop_cache(path: str) -> None:
    """fsync then ``posix_fadvise(DONTNEED)`` every file under ``path`` (a file or a directory):
    its pages leave the page cache (clean pages only are dropped: hence the fsync first)."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prefix_files(prefix: str) -> list[str]:
    d, base = os.path.split(prefix)
    return [os.path.join(d, f) for f in os.listdir(d) if f.startswith(base)]


# ============================================================================ part micro
def source_child(nbytes: int) -> None:
    """The rank's stand-in (``--source-child N``): N touched bytes; serves copy requests on
    stdin/stdout: ``go`` -> prints ``addr length``, waits for ``ack``, prints its CPU seconds."""
    import numpy as np
    buf = np.arange(nbytes // 8 + 1, dtype=np.uint64).view(np.uint8)[:nbytes]
    buf[::4093] = 7  # not a plain ramp
    from deepfreeze.format import crc32
    crc = crc32(buf)
    try:
        from deepfreeze.memtier.copy import allow_ptracer
        allowed = allow_ptracer(os.getppid())
    except ImportError:
        allowed = False
    out = sys.stdout
    out.write(f"{os.getpid()} {buf.ctypes.data} {nbytes} {crc} {int(allowed)}\n")
    out.flush()
    for line in sys.stdin:
        if line.strip() != "go":
            break
        c0 = time.process_time()
        out.write(f"{buf.ctypes.data} {nbytes}\n")  # the request: where the bytes are
        out.flush()
        if sys.stdin.readline().strip() != "ack":
            break
        out.write(f"{time.process_time() - c0:.9f}\n")
        out.flush()


def micro(nbytes: int, reps: int, work: str) -> dict:
    """One shard size: memcpy, memcpy+CRC, readv into a slot (+ DONE), LocalCopier, rank CPU."""
    import numpy as np
    from deepfreeze import format as fmt
    from deepfreeze.memtier import api, device as mdev
    from deepfreeze.memtier.copy import LocalCopier, VmReadvCopier
    from deepfreeze.lease import RunInfo, Version

    row: dict = {"shard_bytes": nbytes}
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # pre-faulted
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t.append(time.perf_counter() - t0)
    row["memcpy_s"] = summary(t)
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        crc = 0
        for o in range(0, nbytes, CHUNK):
            np.copyto(dst[o:o + CHUNK], src[o:o + CHUNK])
            crc = fmt.crc32(dst[o:o + CHUNK], crc)
        t.append(time.perf_counter() - t0)
    row["memcpy_crc_s"] = summary(t)
    del src, dst

    path = os.path.join(SHM, f"dfmt-micro-{os.getpid()}.tier")
    child = subprocess.Popen([sys.executable, "-m", "experiments.memtier", "--source-child", str(nbytes)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        pid, addr, n, want_crc, allowed = (int(x) for x in child.stdout.readline().split())
        row["ptracer_allowed"] = bool(allowed)
        dev = mdev.create(path, page_round(nbytes) * 3 + (16 << 20), force=True)
        try:
            model = api.register(dev, "micro", [("x", "uint8", (nbytes,))], slots=2)
            region = model.region
            readv, done, local, rank_cpu, calls, nb, crc_ok = [], [], [], [], [], [], []
            copier = VmReadvCopier(pid)

            def commit(w, crcs, step):  # the slot's steps 2-3: image header, manifest, msync, DONE
                w.finish(crcs, api._manifest("micro", Version(0, step), step, model.plan, RunInfo(model.run)))
                w.release()

            for i in range(reps):
                child.stdin.write("go\n")
                child.stdin.flush()
                a, length = (int(x) for x in child.stdout.readline().split())
                k = region.choose_slot()
                t0 = time.perf_counter()
                w = region.begin(k, Version(0, i + 1))
                st = copier.copy_in([(a, length)], w.data, w.spans)
                t1 = time.perf_counter()
                commit(w, st.crcs, i + 1)
                t2 = time.perf_counter()
                child.stdin.write("ack\n")
                child.stdin.flush()
                rank_cpu.append(float(child.stdout.readline()))
                readv.append(t1 - t0)
                done.append(t2 - t0)
                calls.append(st.calls)
                nb.append(st.bytes)
                crc_ok.append(list(st.crcs) == [want_crc])
            row.update(readv_s=summary(readv), done_s=summary(done), rank_cpu_s=summary(rank_cpu),
                       readv_calls=max(calls), readv_bytes=min(nb), readv_bytes_ok=all(b == nbytes for b in nb),
                       crc_ok=all(crc_ok))
            # the fallback: this process copies from an address of its own (LocalCopier)
            local_src = np.ones(nbytes, np.uint8)
            lc = LocalCopier()
            for i in range(reps):
                k = region.choose_slot()
                t0 = time.perf_counter()
                w = region.begin(k, Version(0, reps + i + 1))
                st = lc.copy_in([(local_src.ctypes.data, nbytes)], w.data, w.spans)
                local.append(time.perf_counter() - t0)
                commit(w, st.crcs, reps + i + 1)
            row["local_s"] = summary(local)
            model.close()
        finally:
            dev.close()
    finally:
        try:
            child.stdin.close()
        except OSError:
            pass
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    m = row["memcpy_s"]["median"]
    row["readv_over_memcpy"] = row["readv_s"]["median"] / m
    row["rank_cpu_over_memcpy"] = row["rank_cpu_s"]["median"] / m
    return row


# ============================================================================ part standalone
def tensor_list(name: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the model's weights, from a TensorFlow child process (cached)."""
    cache = os.path.join(tempfile.gettempdir(), f"dfmt-tensors-{name}.json")
    if not os.path.exists(cache):
        code = ("import json,sys; sys.path.insert(0, %r); from experiments.memtier import build_model; "
                "from deepfreeze.keras.state_loader import model_tensors; "
                "json.dump(model_tensors(build_model(%r)), open(%r, 'w'))") % (ROOT, name, cache)
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES=""))
    with open(cache) as f:
        return [(n, d, tuple(s)) for n, d, s in json.load(f)]


def standalone(name: str, reps: int, work: str) -> dict:
    import numpy as np
    from deepfreeze.memtier import api, device as mdev
    from deepfreeze.memtier.dumper import dump

    tensors = tensor_list(name)
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(s).astype(d) for n, d, s in tensors}
    nbytes = sum(a.nbytes for a in arrays.values())
    row: dict = {"bytes": nbytes, "tensors": len(arrays)}
    path = os.path.join(SHM, f"dfmt-sa-{os.getpid()}.tier")
    dev = mdev.create(path, 3 * page_round(nbytes) + (64 << 20), force=True)
    try:
        model = api.register(dev, name, arrays)
        ck = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            api.checkpoint(model, arrays, i + 1)
            ck.append(time.perf_counter() - t0)
        row["checkpoint_s"] = summary(ck[1:])  # the first is warm-up
        out = {n: np.empty_like(a) for n, a in arrays.items()}
        r1, r2 = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            api.restore(dev, name, out=out)
            r1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got, _v = api.restore(dev, name)
            r2.append(time.perf_counter() - t0)
            del got
        row["restore_out_s"], row["restore_s"] = summary(r1), summary(r2)
        row["restore_bit_exact"] = all(np.array_equal(out[n].view(np.uint8), arrays[n].view(np.uint8))
                                       for n in arrays)
        row["dump_s"] = {}
        for ext in (".npz", ".safetensors", ".h5"):
            target = os.path.join(work, f"dump{ext}")
            t0 = time.perf_counter()
            dump(dev, name, target, force=True)
            row["dump_s"][ext] = time.perf_counter() - t0
            os.unlink(target)
        model.close()
    finally:
        dev.close()
        os.unlink(path)
    return row


# ============================================================================ part engine (TF workers)
def build_model(name: str):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    sys.path.insert(0, ROOT)
    from experiments import models
    if name == "resnet50":
        return models.resnet50()
    if name == "nt3":
        return models.nt3_weights()
    if name == "vgg19":
        return vgg19_weights()
    tf.keras.utils.set_random_seed(1)  # tiny
    return tf.keras.Sequential([tf.keras.Input((1024,)), tf.keras.layers.Dense(1024, activation="relu"),
                                tf.keras.layers.Dense(1024, activation="relu"), tf.keras.layers.Dense(10)])


def vgg19_weights():
    """VGG19's exact weight tensors (143,667,240 parameters) with little compute: the 16 conv
    layers on 32x32 images, the dense stack (fc1 25088 -> 4096, fc2, predictions 1000) on a
    vector of VGG19's flatten width; the conv path's mean is added to fc1's output so every
    tensor gets a gradient (as :func:`experiments.models.nt3_weights`)."""
    import tensorflow as tf
    tf.keras.utils.set_random_seed(1)
    img = tf.keras.Input((32, 32, 3), name="img")
    flat = tf.keras.Input((7 * 7 * 512,), name="flat")
    x = img
    for block, (n, f) in enumerate([(2, 64), (2, 128), (4, 256), (4, 512), (4, 512)], 1):
        for i in range(n):
            x = tf.keras.layers.Conv2D(f, 3, padding="same", activation="relu", name=f"block{block}_conv{i + 1}")(x)
        x = tf.keras.layers.MaxPooling2D(name=f"block{block}_pool")(x)
    c = tf.keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=[1, 2, 3])[:, None])(x)
    d = tf.keras.layers.Dense(4096, activation="relu", name="fc1")(flat)
    d = tf.keras.layers.Add()([d, c * tf.ones_like(d)])
    d = tf.keras.layers.Dense(4096, activation="relu", name="fc2")(d)
    out = tf.keras.layers.Dense(1000, activation="softmax", name="predictions")(d)
    return tf.keras.Model([img, flat], out)


def memtier_key_available() -> tuple[bool, str]:
    """Whether the installed DeepFreeze takes ``memtier = PATH`` (H2's config key)."""
    try:
        from deepfreeze.config import KEYS
        import deepfreeze.memtier.device  # noqa: F401
    except ImportError as e:
        return False, f"import: {e}"
    if "memtier" not in KEYS:
        return False, "deepfreeze.config has no 'memtier' key yet"
    return True, "ok"


def worker(a: argparse.Namespace) -> None:
    """One rank: every variant in turn; results to ``<work>/res/<variant>.r<rank>.json``."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import gc
    import tensorflow as tf
    import horovod.tensorflow.keras as hvd
    sys.path.insert(0, ROOT)
    from experiments.models import synthetic

    hvd.init()
    rank = hvd.rank()
    model = build_model(a.model)
    batch = BATCH[a.model]
    x, y = synthetic(model, batch * 2, seed=rank)
    ds = tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch).repeat()
    model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1e-5)),
                  loss="sparse_categorical_crossentropy")
    os.makedirs(f"{a.work}/res", exist_ok=True)
    for variant in a.variants.split(","):
        t0 = time.time()
        try:
            res = one_variant(a, variant, model, ds, tf, hvd)
        except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
            import traceback
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"[:2000]}
        res.update(rank=rank, variant=variant, wall_s=time.time() - t0)
        with open(f"{a.work}/res/{variant}.r{rank}.json.tmp", "w") as f:
            json.dump(res, f)
        os.replace(f"{a.work}/res/{variant}.r{rank}.json.tmp", f"{a.work}/res/{variant}.r{rank}.json")
        gc.collect()
        hvd.allreduce(tf.constant(0.0), name=f"barrier_{variant}")
        print(f"[memtier] {a.model} x{hvd.size()} {variant}: {time.time() - t0:.0f} s", flush=True)


def _memtier_done_times(path: str, name: str, rank: int, stop: threading.Event, out: dict) -> None:
    """Poll the device's slot headers every 20 ms; version -> the DONE header's ``written`` time
    (the fallback when the engine records no DONE time per version)."""
    from deepfreeze.memtier import device as mdev
    dev = None
    while not stop.is_set():
        try:
            if dev is None:
                dev = mdev.open(path, writable=False)
            for region in dev.find(name, rank=rank):
                for k in range(region.nslots):
                    h = region.slot_header(k)
                    if h is not None and int(h.state) == 2:
                        out.setdefault(h.version.step, h.written or time.time())
        except Exception:  # noqa: BLE001 - the region may not be registered yet; try again
            if dev is not None:
                dev.close()
                dev = None
        stop.wait(0.02)  # the header holds the exact DONE time; polling only has to see it before reuse
    if dev is not None:
        dev.close()


def one_variant(a: argparse.Namespace, variant: str, model, ds, tf, hvd) -> dict:
    from deepfreeze import Config
    from deepfreeze.keras import DeepFreezeCheckpoint, restore
    from deepfreeze.keras.state_loader import model_tensors
    from deepfreeze.tiers.scratch import ScratchLevel

    rank, size = hvd.rank(), hvd.size()
    every, reps = a.every, a.reps
    steps = (reps + 1) * every + 1
    due = {k * every - 1 for k in range(1, reps + 2)}
    shm = f"{a.shm}/{variant}"
    disk = f"{a.disk}/{variant}"
    os.makedirs(disk, exist_ok=True)
    model.optimizer.iterations.assign(0)
    total = sum(int(tf.size(w)) * w.dtype.size for w in model.weights)
    out: dict = {"bytes_total": total}
    name = f"mt{variant.replace('-', '')}"
    blocks: dict[int, dict] = {}
    restores: dict[str, list[float]] = {}
    last_due = max(due)
    snap: list = []  # the weights of the last checkpointed version (what every restore must give back)

    class Snap(tf.keras.callbacks.Callback):  # after the checkpoint callback; outside the timed part
        def on_train_batch_end(self, batch, logs=None):
            if batch == last_due:
                snap[:] = [w.numpy() for w in self.model.weights]

    def exact() -> "bool | None":
        # rank 0's weights are what every variant saves (DeepFreeze takes non-trained variables such
        # as BatchNorm statistics from rank 0; h5/tf are rank 0's files): the other ranks' own
        # statistics differ, so only rank 0 compares
        if rank != 0:
            return None
        return len(snap) == len(model.weights) and all(
            (w.numpy().view("u1") == f.view("u1")).all() for w, f in zip(model.weights, snap))

    if variant.startswith("df-"):
        done_at: dict[int, float] = {}

        class TimedScratch(ScratchLevel):
            def write_manifest(self, name_, version, manifest):  # the scratch version is complete here
                r = super().write_manifest(name_, version, manifest)
                done_at[int(version)] = time.time()
                return r

        kw = dict(mode="async", scratch=f"{shm}/node{rank}/scratch", persistent=f"{disk}/persistent",
                  failure_domain=f"node{rank}", max_versions=0, scratch_versions=2, ec_interval=-1,
                  persistent_interval=a.persistent_interval)
        poll_stop, poll = threading.Event(), None
        memtier_done: dict[int, float] = {}
        if variant == "df-memtier":
            kw["memtier"] = f"{shm}/node{rank}.tier"
            poll = threading.Thread(target=_memtier_done_times,
                                    args=(kw["memtier"], name, rank, poll_stop, memtier_done), daemon=True)
            poll.start()
        os.makedirs(f"{disk}/persistent", exist_ok=True)
        cfg = Config.load(None, **kw)
        df = DeepFreezeCheckpoint(cfg, name=name, every_n_batches=every, at_epoch_end=False, save_optimizer=False,
                                  overwrite=True, scratch_cls=TimedScratch)
        backend_cpu0 = None

        class Probe(tf.keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                nonlocal backend_cpu0
                eng = df.engine
                b = getattr(eng, "_backend", None) if eng is not None else None
                if backend_cpu0 is None and b is not None:
                    backend_cpu0 = (b.pid, process_cpu(b.pid))

        try:
            model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0,
                      callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), Probe(), df, Snap()])
            df.wait()
            eng = df.engine
            b = getattr(eng, "_backend", None) if eng is not None else None
            if b is not None and backend_cpu0 is not None and backend_cpu0[1] is not None:
                out["backend_cpu_total_s"] = process_cpu(b.pid) - backend_cpu0[1]
            out["writer_cpu_s"] = {str(v): c for v, c in getattr(eng, "writer_cpu", {}).items()}
            stats = getattr(eng, "memtier_stats", None) or {}  # version -> {"done_at": time.time(), ...} if recorded
            acks = {v: st["done_at"] for v, st in stats.items() if isinstance(st, dict) and st.get("done_at")}
            if variant == "df-memtier":
                out["memtier_waits"] = getattr(eng, "memtier_waits", None)
                out["memtier_stats"] = getattr(eng, "memtier_stats", None)
            for d in df.timings:
                v = int(d["version"])
                t_done = (acks or {}).get(v) if variant == "df-memtier" else done_at.get(v)
                if t_done is None and variant == "df-memtier":
                    t_done = memtier_done.get(v)
                blocks[v] = {"stall_s": d["blocking_s"], "capture_s": d.get("capture_s"),
                             "done_s": (t_done - d["time"]) if t_done is not None else None,
                             "rank_cpu_s": out["writer_cpu_s"].get(str(v))}
            out["done_source"] = ("scratch manifest" if variant == "df-scratch" else
                                  "engine ack" if acks else "slot header poll")
            out["shard_bytes"] = int(df.plan.rank_bytes()[rank]) if df.plan is not None else None
            # restore: the memory tier (or scratch) first; memory by nature: no cache state to set
            t = []
            try:
                for _ in range(reps):
                    for w in model.weights:
                        w.assign(tf.zeros_like(w))
                    t0 = time.perf_counter()
                    restore(model, cfg, name=name)
                    t.append(time.perf_counter() - t0)
                restores["memory"] = t
                out["restore_bit_exact"] = exact()
            except Exception as e:  # noqa: BLE001 - the checkpoint numbers stand without it
                out["restore_error"] = f"{type(e).__name__}: {e}"[:1000]
        finally:
            poll_stop.set()
            if poll is not None:
                poll.join(timeout=5)
            df.close()
    else:
        tfck = tf.train.Checkpoint(model=model) if variant == "tf-ckpt" else None
        h5 = f"{disk}/weights.h5"
        prefix = f"{disk}/tfck"

        class RankZero(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch not in due or rank != 0:
                    return
                t_wall, t0 = time.time(), time.perf_counter()
                if variant == "tf-ckpt":
                    tfck.write(prefix)
                else:
                    self.model.save_weights(h5)
                    if variant == "h5-fsync":
                        fd = os.open(h5, os.O_RDONLY)
                        try:
                            os.fsync(fd)
                        finally:
                            os.close(fd)
                dt = time.perf_counter() - t0
                blocks[batch + 1] = {"stall_s": dt, "done_s": dt, "rank_cpu_s": None, "t": t_wall}

        model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), RankZero(), Snap()])
        hvd.allreduce(tf.constant(0.0), name=f"saved_{variant}")
        if variant != "h5-nofsync":  # restores: from the h5-fsync file and the tf checkpoint (the same data)
            for state in ("cold", "warm"):
                t = []
                for _ in range(reps):
                    for w in model.weights:
                        w.assign(tf.zeros_like(w))
                    if state == "cold":
                        for f in ([h5] if tfck is None else prefix_files(prefix)):
                            drop_cache(f)
                    t0 = time.perf_counter()
                    if tfck is None:
                        model.load_weights(h5)
                    else:
                        tf.train.Checkpoint(model=model).read(prefix).expect_partial()
                    t.append(time.perf_counter() - t0)
                restores[state] = t
            out["restore_bit_exact"] = exact()
        out["shard_bytes"] = total if rank == 0 else 0
    warm = min(blocks) if blocks else None
    out["checkpoints"] = {str(v): b for v, b in sorted(blocks.items()) if v != warm}  # the first: warm-up
    out["restore_s"] = restores
    out["tensors"] = len(model_tensors(model))
    return out


# ============================================================================ driver
def run_group(model: str, ranks: int, variants: list[str], a: argparse.Namespace, base: str) -> dict:
    """Every variant of one (model, ranks) in one mpirun; returns {variant: row}."""
    work = tempfile.mkdtemp(prefix=f"{model}-{ranks}-", dir=base)
    shm = tempfile.mkdtemp(prefix=f"dfmt-{model}-{ranks}-", dir=SHM)
    if "df-memtier" in variants:
        from deepfreeze.memtier import device as mdev
        need = 3 * page_round(MODEL_BYTES[model] // ranks) + (64 << 20)  # 2 slots + index + table, spare
        os.makedirs(f"{shm}/df-memtier", exist_ok=True)
        for r in range(ranks):  # one device per simulated node (rank), as `deepfreeze memtier create` makes it
            mdev.create(f"{shm}/df-memtier/node{r}.tier", need, force=True).close()
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)]
    cmd += ["--allow-run-as-root"] if os.getuid() == 0 else []
    cmd += [sys.executable, "-m", "experiments.memtier", "--worker", "--model", model, "--variants",
            ",".join(variants), "--every", str(a.every), "--reps", str(a.reps), "--work", work, "--shm", shm,
            "--disk", work, "--persistent-interval", str(a.persistent_interval)]
    logpath = f"{base}/{model}-{ranks}.log"
    failure = None
    timeout = 600 + 120 * len(variants) * max(1, ranks) * (1 + a.reps / 5)
    with open(logpath, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT))
        try:
            if p.wait(timeout=timeout) != 0:
                failure = f"mpirun exited with {p.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if failure:
        print(f"[memtier] {model} x{ranks}: {failure}\n{open(logpath, errors='replace').read()[-4000:]}",
              file=sys.stderr, flush=True)
    rows = {}
    for v in variants:
        rs = []
        for r in range(ranks):
            try:
                with open(f"{work}/res/{v}.r{r}.json") as f:
                    rs.append(json.load(f))
            except (OSError, ValueError):
                pass
        rows[v] = summarize_variant(v, rs, ranks, failure)
        print(f"[memtier] {model} x{ranks} {v}: " + json.dumps({k: (x.get("median") if isinstance(x, dict) and
                                                                       "median" in x else x)
                                                                   for k, x in rows[v].items()
                                                                   if k not in ("errors",)})[:600], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    return rows


def summarize_variant(variant: str, rs: list[dict], ranks: int, failure: str | None) -> dict:
    errors = [r["error"] for r in rs if r.get("error")]
    ok = [r for r in rs if not r.get("error")]
    row: dict = {"ranks_reported": len(rs)}
    if errors or not ok:
        row["error"] = "; ".join(errors) or f"no results ({failure or 'unknown'})"
        if not ok:
            return row
    per = [c for r in ok for c in r.get("checkpoints", {}).values()]  # (checkpoint, rank) samples
    for key in ("stall_s", "done_s", "rank_cpu_s"):
        row[key] = summary([c.get(key) for c in per])
    nck = max(1, len(ok[0].get("checkpoints", {})) + 1)  # the warm-up's backend work included
    bcpu = [r["backend_cpu_total_s"] / nck for r in ok if r.get("backend_cpu_total_s") is not None]
    row["backend_cpu_s"] = summary(bcpu)  # per checkpoint, one sample per rank (its backend)
    if row["rank_cpu_s"]["median"] is not None and bcpu:
        row["background_cpu_s"] = row["rank_cpu_s"]["median"] + med(bcpu)
    for state in ("memory", "cold", "warm"):
        t = [x for r in ok for x in r.get("restore_s", {}).get(state, [])]
        if t:
            row[f"restore_{state}_s"] = summary(t)
    row["shard_bytes"] = max((r.get("shard_bytes") or 0) for r in ok)
    row["bytes_total"] = ok[0].get("bytes_total")
    if any(r.get("restore_bit_exact") is not None for r in ok):
        row["restore_bit_exact"] = all(r["restore_bit_exact"] for r in ok if r.get("restore_bit_exact") is not None)
    restore_errors = [r["restore_error"] for r in ok if r.get("restore_error")]
    if restore_errors:
        row["restore_error"] = restore_errors[0]
    for k in ("done_source", "memtier_waits"):
        if ok[0].get(k) is not None:
            row[k] = [r.get(k) for r in ok] if k == "memtier_waits" else ok[0][k]
    return row


def targets(doc: dict) -> dict:
    """Which targets hold, with the numbers compared."""
    out: dict = {}

    def verdict(key, ok, **nums):
        out[key] = {"holds": bool(ok) if ok is not None else None, **nums}

    for key, g in doc.get("engine", {}).items():
        mt, sc, h5 = g.get("df-memtier", {}), g.get("df-scratch", {}), g.get("h5-fsync", {})
        m = lambda r, k: (r.get(k) or {}).get("median") if isinstance(r.get(k), dict) else None  # noqa: E731
        if m(mt, "done_s") and m(sc, "done_s"):
            verdict(f"{key}: done 2x faster", m(sc, "done_s") / m(mt, "done_s") >= 2,
                    scratch_s=m(sc, "done_s"), memtier_s=m(mt, "done_s"), ratio=m(sc, "done_s") / m(mt, "done_s"))
        if mt.get("background_cpu_s") and sc.get("background_cpu_s"):
            r = sc["background_cpu_s"] / mt["background_cpu_s"]
            verdict(f"{key}: background CPU 2x less", r >= 2, scratch_s=sc["background_cpu_s"],
                    memtier_s=mt["background_cpu_s"], ratio=r)
        if m(mt, "stall_s") is not None:
            verdict(f"{key}: stall <= 1 ms", m(mt, "stall_s") <= 1e-3, memtier_s=m(mt, "stall_s"))
        if m(mt, "restore_memory_s") and m(h5, "restore_cold_s"):
            r = m(h5, "restore_cold_s") / m(mt, "restore_memory_s")
            verdict(f"{key}: restore 3x faster than h5 cold", r >= 3, h5_cold_s=m(h5, "restore_cold_s"),
                    memtier_s=m(mt, "restore_memory_s"), ratio=r)
    for key, r in doc.get("micro", {}).items():
        if r.get("error"):
            continue
        verdict(f"{key}: copy within 1.5x of memcpy (CRC incl.)", r["readv_over_memcpy"] <= 1.5,
                ratio=r["readv_over_memcpy"])
        verdict(f"{key}: rank CPU <= 10 % of one memcpy", r["rank_cpu_over_memcpy"] <= 0.10,
                ratio=r["rank_cpu_over_memcpy"])
        verdict(f"{key}: readv bytes == shard", r["readv_bytes_ok"], bytes=r["readv_bytes"], shard=r["shard_bytes"])
    return out


def table(doc: dict) -> str:
    ms = lambda x: "-" if x is None else f"{1e3 * x:.2f}"  # noqa: E731
    lines = ["| micro | shard MB | memcpy ms | memcpy+CRC ms | readv+CRC ms | until DONE ms | local ms | "
             "rank CPU ms | readv/memcpy | readv calls |", "|" + "---|" * 10]
    for key, r in doc.get("micro", {}).items():
        if r.get("error"):
            lines.append(f"| {key} | error: {r['error'][:80]} |")
            continue
        g = lambda k: r[k]["median"]  # noqa: E731
        lines.append(f"| {key} | {r['shard_bytes'] / 1e6:.1f} | {ms(g('memcpy_s'))} | {ms(g('memcpy_crc_s'))} | "
                     f"{ms(g('readv_s'))} | {ms(g('done_s'))} | {ms(g('local_s'))} | {ms(g('rank_cpu_s'))} | "
                     f"{r['readv_over_memcpy']:.2f} | {r['readv_calls']} |")
    lines += ["", "| standalone | MB | checkpoint ms | restore(out) ms | restore ms | dump npz/st/h5 s |",
              "|---|---|---|---|---|---|"]
    for key, r in doc.get("standalone", {}).items():
        if r.get("error"):
            lines.append(f"| {key} | error: {r['error'][:80]} |")
            continue
        d = r["dump_s"]
        lines.append(f"| {key} | {r['bytes'] / 1e6:.1f} | {ms(r['checkpoint_s']['median'])} | "
                     f"{ms(r['restore_out_s']['median'])} | {ms(r['restore_s']['median'])} | "
                     f"{d['.npz']:.2f}/{d['.safetensors']:.2f}/{d['.h5']:.2f} |")
    lines += ["", "| model x ranks | variant | stall ms | until DONE ms | rank CPU ms | backend CPU ms | "
              "restore ms (state) |", "|---|---|---|---|---|---|---|"]
    for key, g in doc.get("engine", {}).items():
        for v, r in g.items():
            if r.get("error") and "stall_s" not in r:
                lines.append(f"| {key} | {v} | error: {r['error'][:80]} |")
                continue
            m = lambda k: (r.get(k) or {}).get("median")  # noqa: E731
            rest = next(((s, m(f"restore_{s}_s")) for s in ("memory", "cold") if m(f"restore_{s}_s")), (None, None))
            lines.append(f"| {key} | {v} | {ms(m('stall_s'))} ± {ms((r.get('stall_s') or {}).get('se'))} | "
                         f"{ms(m('done_s'))} | {ms(m('rank_cpu_s'))} | {ms(m('backend_cpu_s'))} | "
                         f"{ms(rest[1])} ({rest[0] or '-'}) |")
    lines += ["", "| target | holds | numbers |", "|---|---|---|"]
    for k, t in doc.get("targets", {}).items():
        nums = ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in t.items() if a != "holds")
        lines.append(f"| {k} | {t['holds']} | {nums} |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    eng = doc.get("engine", {})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    groups = list(eng)
    for ax, (metric, title) in zip(axes, [("stall_s", "checkpoint stall (ms)"), ("done_s", "until DONE (ms)"),
                                         ("restore", "restore (ms)")]):
        for i, v in enumerate(VARIANTS):
            ys, es = [], []
            for g in groups:
                r = eng[g].get(v, {})
                if metric == "restore":
                    s = r.get("restore_memory_s") or r.get("restore_cold_s") or {}
                else:
                    s = r.get(metric) or {}
                ys.append(1e3 * (s.get("median") or 0))
                es.append(1e3 * (s.get("se") or 0))
            ax.bar([j + i * 0.16 for j in range(len(groups))], ys, 0.16, yerr=es, label=v)
        ax.set_xticks([j + 0.32 for j in range(len(groups))])
        ax.set_xticklabels(groups, rotation=20)
        ax.set_title(title)
        ax.set_yscale("symlog")
    axes[0].legend(fontsize=8)
    fig.suptitle("DeepFreeze memory tier vs file scratch (/dev/shm), HDF5, tf.train.Checkpoint: median ± SE")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(doc: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(out + ".tmp", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of engine-part variants")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--shm", default=SHM, help=argparse.SUPPRESS)
    ap.add_argument("--disk", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke check: the tiny model, 1 rank, 3 repetitions")
    ap.add_argument("--parts", default="micro,standalone,engine", help="comma list of micro,standalone,engine")
    ap.add_argument("--models", default=None, help="comma list of resnet50,vgg19,nt3 (default: all; --quick: tiny)")
    ap.add_argument("--ranks", default=None, help="comma list of rank counts (default 1,2; --quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 10; --quick 3)")
    ap.add_argument("--every", type=int, default=None, help="iterations between checkpoints (default 5; --quick 2)")
    ap.add_argument("--persistent-interval", type=float, default=-1.0,
                    help="DeepFreeze variants' persistent_interval (default -1: no flush to persistent)")
    ap.add_argument("--disk-dir", default=None, help="where h5/tf checkpoints and persistent go (default: a "
                                                     "temporary directory under $TMPDIR or /tmp, on disk here)")
    ap.add_argument("--resume", action="store_true", help="merge into --out; skip groups already there")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memtier.json"))
    a = ap.parse_args()
    if a.source_child:
        return source_child(a.source_child)
    a.reps = a.reps or (3 if a.quick else 10)
    a.every = a.every or (2 if a.quick else 5)
    if a.worker:
        return worker(a)
    sys.path.insert(0, ROOT)
    t_start = time.time()
    models = a.models.split(",") if a.models else (["tiny"] if a.quick else list(MODELS))
    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else ([1] if a.quick else [1, 2])
    parts = a.parts.split(",")
    doc: dict = {}
    if a.resume and os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("micro", {}), doc.setdefault("standalone", {}), doc.setdefault("engine", {})
    doc["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    settings = doc.setdefault("settings", {})
    settings.update(quick=a.quick, reps=a.reps, every=a.every, persistent_interval=a.persistent_interval,
                    statistic="median over repetitions; se = standard error of the mean",
                    restore_cache="DeepFreeze: memory tier / scratch on /dev/shm (memory, nothing to drop); "
                                  "h5 / tf-ckpt: files fsync'ed then posix_fadvise(DONTNEED) before each cold "
                                  "restore; warm: right after a read",
                    skipped=settings.get("skipped", {}))
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            settings["ptrace_scope"] = int(f.read())
    except (OSError, ValueError):
        settings["ptrace_scope"] = None
    base_parent = a.disk_dir or tempfile.gettempdir()
    os.makedirs(base_parent, exist_ok=True)
    base = tempfile.mkdtemp(prefix="memtier-", dir=base_parent)
    try:
        for m in models:
            for r in ranks:
                key = f"{m} x{r}"
                if "micro" in parts and not (a.resume and key in doc["micro"] and not doc["micro"][key].get("error")):
                    try:
                        doc["micro"][key] = micro(page_round(MODEL_BYTES[m] // r), a.reps, base)
                    except Exception as e:  # noqa: BLE001
                        doc["micro"][key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                    print(f"[memtier] micro {key}: {json.dumps(doc['micro'][key])[:400]}", flush=True)
                    write_doc(doc, a.out)
            if "standalone" in parts and not (a.resume and m in doc["standalone"]
                                              and not doc["standalone"][m].get("error")):
                try:
                    doc["standalone"][m] = standalone(m, a.reps, base)
                except Exception as e:  # noqa: BLE001
                    doc["standalone"][m] = {"error": f"{type(e).__name__}: {e}"[:1000]}
                print(f"[memtier] standalone {m}: {json.dumps(doc['standalone'][m])[:400]}", flush=True)
                write_doc(doc, a.out)
        if "engine" in parts:
            variants = [v for v in a.variants.split(",") if v]
            ok, why = memtier_key_available()
            if "df-memtier" in variants and not ok:
                variants.remove("df-memtier")
                settings["skipped"]["df-memtier"] = why
            else:
                settings["skipped"].pop("df-memtier", None)
            for m in models:
                for r in ranks:
                    key = f"{m} x{r}"
                    if a.resume and key in doc["engine"] and not any(
                            x.get("error") for x in doc["engine"][key].values()):
                        continue
                    doc["engine"][key] = run_group(m, r, variants, a, base)
                    write_doc(doc, a.out)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    doc["targets"] = targets(doc)
    settings["wall_s"] = round(time.time() - t_start, 1)
    doc["table_md"] = table(doc)
    write_doc(doc, a.out)
    plot(doc, os.path.splitext(a.out)[0] + ".png")
    print(doc["table_md"])
    print(f"wrote {a.out} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
