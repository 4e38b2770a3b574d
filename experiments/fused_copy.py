"""The fused-copy op against one memcpy of the same bytes into pre-faulted memory.

    python -m experiments.fused_copy --out experiments/results/fused_copy.json

For the busiest rank of the real shard plans (:class:`deepfreeze.shardplan.ShardPlan` of the
app's weights) of ResNet-50 at 2 and 4 ranks (185 / 117 pieces of 0.01-2 MB, ~51 / ~26 MB)
and nt3-weights at 2 ranks (3 pieces, ~310 MB), with the pieces at the offsets of the fused
buffer (:class:`deepfreeze.fused.FusedLayout`), this times:

* ``op``: one ``tf.function`` call running ``DeepFreezeFusedCopy`` over the model's variables
  (their ``ReadVariableOp`` outputs) into a page-aligned, pre-faulted anonymous ``mmap``
  buffer that Python keeps alive: what the train step's capture costs (the function-call
  overhead included), with the kernel's default parallel copy (the CPU device's worker
  threads) and with ``DEEPFREEZE_FUSED_COPY_THREADS=1`` (the calling thread only);
* ``op_amortized``: the default op run 4 times in one ``tf.function`` call (one after the other,
  each on fresh reads of the variables), the time divided by 4: the capture as one node of a
  train step, where no function call of its own is paid;
* ``memcpy``: ``np.copyto`` of the same number of bytes from one array into another, both
  pre-faulted (the issue's reference: "one memcpy of the rank's shard into pre-faulted memory");
* ``memcpy_chunked``: the same copy as ``np.copyto`` calls of 2 MiB (the kernel's chunk size).
  This machine's L3 cache is 260 MiB: glibc's memcpy switches to non-temporal stores (which
  bypass the cache) for one large copy, while 2 MiB copies stay in the cache, so a copy of
  <= ~100 MB split into chunks can beat one ``np.copyto`` of it; this row shows how much.

All are interleaved, in a new random order each repetition (so drift of the shared machine hits
them alike); besides wall time, the process's CPU time of each run is kept (``cpu_median_s``,
``cpu_ratio_<variant>``: all threads, so not comparable for the parallel variants), which a
descheduled thread does not inflate;
the statistic is the median of ``--repeat`` (>= 15) repetitions after a warm-up, with the
standard error of the mean beside it; ``ratio_<variant>`` is the op's median over memcpy's
median, ``ratio_<variant>_se`` the standard error of the ratio of the means.

Last, the cost per value: the op over 10 to 1000 variables with 1 KiB pieces (one ``tf.function``
call each, the variables' reads included), beside ``reads_only``, the same call and reads without
the op; ``slope_s_per_tensor`` holds the least-squares slopes of the medians (the op's own cost
per value is the difference).
"""
from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import time

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"resnet50": [2, 4], "nt3-weights": [2]}
AMORTIZE = 4  # captures per call of op_amortized
SWEEP = [10, 100, 300, 1000]  # tensor counts of the per-value cost sweep
CHUNK = 2 << 20  # kChunkBytes of fused_copy.cc
# name: (DEEPFREEZE_FUSED_COPY_THREADS, DEEPFREEZE_FUSED_COPY_NT)
VARIANTS = {"op": ("1", "1"), "op_memcpy": ("1", "0"), "op_parallel": ("0", "1"),
            "op_parallel_memcpy": ("0", "0")}
OPS = [*VARIANTS, "op_amortized"]


def _stats(ts: list[float]) -> dict[str, float]:
    import numpy as np
    a = np.asarray(ts)
    return {"median_s": float(np.median(a)), "mean_s": float(a.mean()),
            "se_s": float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0}


def _ratio_se(a: dict[str, float], b: dict[str, float]) -> float:
    """Standard error of mean(a) / mean(b) (first-order propagation of both means' errors)."""
    r = a["mean_s"] / b["mean_s"]
    return r * math.sqrt((a["se_s"] / a["mean_s"]) ** 2 + (b["se_s"] / b["mean_s"]) ** 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--apps", default=",".join(CASES), help="comma list of apps (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fused_copy.json"))
    args = ap.parse_args()
    if args.repeat < 15:
        ap.error("--repeat must be >= 15")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf
    from deepfreeze import format as fmt
    from deepfreeze.fused import FusedLayout
    from deepfreeze.keras import native
    from deepfreeze.keras.state_loader import model_tensors
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    from experiments import models

    if native.load() is None:
        raise SystemExit(f"{native.unavailable_reason()}; build it with `python -m deepfreeze.keras.native build`")

    load_start = os.getloadavg()
    rows = []
    order = np.random.default_rng(0)  # of the variants within each repetition
    for app in args.apps.split(","):
        model = models.nt3_weights() if app == "nt3-weights" else models.resnet50()
        variables = model.weights
        tensors = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(model_tensors(model))]
        for n in CASES[app]:
            plan = ShardPlan.build(tensors, n)
            rank = int(np.argmax(plan.rank_bytes()))
            layout = FusedLayout.build(plan, rank)
            values = [variables[s.piece.tensor_id] for s in layout.segments]
            src = [s.piece.start * np.dtype(fmt.numpy_dtype(s.dtype)).itemsize for s in layout.segments]
            dst = [s.offset for s in layout.segments]
            lengths = [s.nbytes for s in layout.segments]
            mm = mmap.mmap(-1, layout.nbytes)
            buf = np.frombuffer(mm, dtype=np.uint8)
            buf[:] = 0  # pre-fault
            nbytes = sum(lengths)
            msrc, mdst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)

            fns = {}
            for name, (threads, nt) in VARIANTS.items():
                os.environ["DEEPFREEZE_FUSED_COPY_THREADS"] = threads  # read when the kernel is built
                os.environ["DEEPFREEZE_FUSED_COPY_NT"] = nt

                @tf.function
                def capture(step):
                    return native.fused_copy(buf, step, values, src, dst, lengths)

                capture(tf.constant(0, tf.int64))  # trace + build the kernel (with this variant's env)
                fns[name] = capture
            os.environ["DEEPFREEZE_FUSED_COPY_THREADS"] = "1"  # the defaults, set explicitly
            os.environ["DEEPFREEZE_FUSED_COPY_NT"] = "1"

            @tf.function
            def capture_x4(step):  # 4 captures in one call: the call's fixed cost amortized
                out = step
                for _ in range(AMORTIZE):
                    with tf.control_dependencies([out]):
                        out = native.fused_copy(buf, step, [tf.identity(v) for v in values], src, dst, lengths)
                return out

            capture_x4(tf.constant(0, tf.int64))
            os.environ.pop("DEEPFREEZE_FUSED_COPY_THREADS", None)
            os.environ.pop("DEEPFREEZE_FUSED_COPY_NT", None)
            # bit-exact check of the last variant's copy (the benchmark measures a correct copy)
            for s, v, o in zip(layout.segments, values, src):
                b = np.frombuffer(v.numpy().tobytes(), np.uint8)
                assert np.array_equal(buf[s.offset:s.offset + s.nbytes], b[o:o + s.nbytes]), s

            step = tf.constant(1, tf.int64)
            def chunked() -> None:
                for a in range(0, nbytes, CHUNK):  # the same bytes in the kernel's chunk size
                    np.copyto(mdst[a:a + CHUNK], msrc[a:a + CHUNK])

            runs = {**{k: (lambda f=f: f(step)) for k, f in fns.items()}, "op_x4": lambda: capture_x4(step),
                    "memcpy": lambda: np.copyto(mdst, msrc), "memcpy_chunked": chunked}
            times: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(args.repeat + 1):  # repetition 0 is the warm-up
                for name in order.permutation(list(runs)):  # a new order each repetition
                    c, t = time.process_time(), time.perf_counter()
                    runs[name]()
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    if r:
                        times[name].append(dt)
                        cpu[name].append(dc)
            times["op_amortized"] = [t / AMORTIZE for t in times.pop("op_x4")]
            cpu["op_amortized"] = [t / AMORTIZE for t in cpu.pop("op_x4")]
            st = {k: _stats(v) for k, v in times.items()}
            cpu_st = {k: _stats(v)["median_s"] for k, v in cpu.items()}
            row = {"app": app, "ranks": n, "rank": rank, "bytes": nbytes, "pieces": len(lengths),
                   "piece_bytes_min": min(lengths), "piece_bytes_max": max(lengths),
                   **{k: v for k, v in st.items()},
                   **{f"ratio_{k}": st[k]["median_s"] / st["memcpy"]["median_s"] for k in OPS},
                   **{f"ratio_{k}_se": _ratio_se(st[k], st["memcpy"]) for k in OPS},
                   "cpu_median_s": cpu_st,
                   **{f"cpu_ratio_{k}": cpu_st[k] / cpu_st["memcpy"] for k in OPS}}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("app", "ranks", "bytes", "pieces")} |
                             {k: round(v["median_s"] * 1e3, 3) for k, v in st.items()} |
                             {f"ratio_{k}": f"{row[f'ratio_{k}']:.3f}+-{row[f'ratio_{k}_se']:.3f}"
                              for k in OPS} |
                             {f"cpu_ratio_{k}": round(row[f"cpu_ratio_{k}"], 3) for k in OPS}), flush=True)
            del buf, fns, capture, mm, msrc, mdst  # the mmap goes with its last view
    # the op's cost per value: N variables of 1 KiB, 1 KiB pieces (tf.function call included)
    sweep = []
    for count in SWEEP:
        vs = [tf.Variable(tf.zeros([256], tf.float32)) for _ in range(count)]
        mm = mmap.mmap(-1, 64 + 1024 * count)
        buf = np.frombuffer(mm, dtype=np.uint8)
        buf[:] = 0

        @tf.function
        def many(step):
            return native.fused_copy(buf, step, vs, [0] * count, [64 + 1024 * i for i in range(count)],
                                     [1024] * count)

        @tf.function
        def reads(step):  # the baseline: the same function call and variable reads, no copy op
            with tf.control_dependencies([v.read_value() for v in vs]):
                return step + 1

        step = tf.constant(1, tf.int64)
        fs = {"op": many, "reads_only": reads}
        ts: dict[str, list[float]] = {k: [] for k in fs}
        for r in range(args.repeat + 1):
            for name in order.permutation(list(fs)):
                t = time.perf_counter()
                fs[name](step)
                if r:
                    ts[name].append(time.perf_counter() - t)
        sweep.append({"tensors": count, **{k: _stats(v) for k, v in ts.items()}})
        del buf, many, reads, fs, mm, vs
    x = np.array([r["tensors"] for r in sweep], float)
    slope = {k: float(np.polyfit(x, np.array([r[k]["median_s"] for r in sweep]), 1)[0]) for k in ("op", "reads_only")}
    print(json.dumps({"per_tensor_ms": {r["tensors"]: {k: round(r[k]["median_s"] * 1e3, 3) for k in slope}
                                        for r in sweep},
                      "slope_us_per_tensor": {k: round(v * 1e6, 2) for k, v in slope.items()}}), flush=True)
    doc = {"repeat": args.repeat, "statistic": "median of repeat runs after one warm-up (se: of the mean)",
           "cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "runs": rows, "per_tensor": sweep, "slope_s_per_tensor": slope}
    write_doc(doc, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
