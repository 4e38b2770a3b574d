"""Flush at disk speed: the scratch write and the flush to persistent against raw writes of the same bytes.

    python -m experiments.flush [--label after] [--sizes 1,16,64,256,512] [--repeat 10]
                                [--out experiments/results/flush.json]

For each shard size (one rank, ``--tensors`` float32 tensors splitting the size, checksums on) and each
of ``--repeat`` repetitions, in this order, in one process on this machine's disk (scratch and persistent
are directories of the same file system here):

* ``raw_scratch``: write the shard's byte count to a new file in the scratch directory, no fsync (the
  scratch level is not fsynced either), the way :func:`experiments.bench.write_rates` writes;
* ``scratch_write``: :meth:`deepfreeze.tiers.scratch.ScratchLevel.write_shard` of the shard (header, index,
  CRCs, data, rename), fed with the engine's input (``--input``: a :class:`deepfreeze.fused.FusedShard`
  when this version of the code accepts one, else the list of flat arrays);
* (untimed) ``fdatasync`` of the scratch shard and of the scratch raw file, so their write-back does
  not compete with what follows (in a run it happens in the background, 30 s later), and ``sync``
  before each timed disk write (raw, flush) and after each removal, so deferred work (the discards
  of removed files: this ext4 is mounted with ``discard``) falls on no timed series;
* ``raw``: sequential write of the same byte count + fsync into the persistent directory
  (:func:`experiments.bench.write_rates`' way: one ``write`` of the whole buffer, then fsync): the
  reference of the target;
* ``raw_best``: the same bytes written the fastest way found here (``--strategies``): 1 MiB writes, the
  write-back of every 8 MiB started at once (``sync_file_range``), fsync: a stricter reference, since
  one huge ``write`` is itself slow here;
* ``flush``: :func:`deepfreeze.tiers.flush.flush_job` of the shard to persistent (decision, CRC-checked
  copy into the partial, fsync, done marker, finalize, manifest; world size 1).

Statistics per size: medians of each series; efficiency = median raw time / median flush time (= flush
bandwidth / raw bandwidth; also against ``raw_best``), its standard error by bootstrap (2000 resamples of
both series); the target
(flush >= 90 % of raw for shards >= 256 MiB) "holds" only if efficiency - 0.9 > one standard error,
"missed" if 0.9 - efficiency > one standard error, else "not resolvable". The fixed cost per version is
the intercept of a least-squares line of flush time against bytes over every sample of the small
sizes (<= 64 MiB), with its standard error; the same for raw, and their difference.

``--label`` names the code measured (``before``: the unchanged code; ``after``); the JSON keeps the
other labels already in ``--out``, so one file holds before and after; runs labelled ``before_2``,
``after_2``, ... are repeats, pooled with ``before``/``after`` under ``pooled`` (every sample of the
runs of one code; the PNG beside the JSON plots the pooled statistics).
To measure other code, run from a directory whose ``deepfreeze`` package is that code (``python -m``
puts the current directory first on ``sys.path``), e.g. ``git archive <commit> deepfreeze | tar -x -C
/tmp/before && cd /tmp/before && PYTHONPATH=.:<repo> python -m experiments.flush --label before
--out <repo>/experiments/results/flush.json``; ``levels_module`` in the JSON records which code ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

from experiments.bench import write_doc
from experiments.commit_cost import timed_flush

HERE = os.path.dirname(os.path.abspath(__file__))


def _raw_write(path: str, view: memoryview, fsync: bool) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return time.perf_counter() - t


def _kicker() -> Any:
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` through ctypes (self-contained, so the
    experiment runs against code without :func:`deepfreeze.tiers.shardbytes._start_writeback`), else fadvise."""
    try:
        import ctypes
        import ctypes.util
        f = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
        f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return lambda fd, off, n: f(fd, off, n, 2)
    except (OSError, AttributeError):
        return lambda fd, off, n: os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)


_KICK = _kicker()


def _raw_write_best(path: str, view: memoryview) -> float:
    """The fastest raw way found here (``--strategies``): 1 MiB writes, the write-back of every 8 MiB
    started at once, fsync."""
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pos = last = 0
        while pos < len(view):
            pos += os.pwrite(fd, view[pos:pos + (1 << 20)], pos)
            if pos - last >= 8 << 20 or pos == len(view):
                _KICK(fd, last, pos - last)
                last = pos
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _datasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _bootstrap_ratio(num: Any, den: Any, rng: Any, n: int = 2000) -> float:
    """Standard error of median(num) / median(den) by resampling both series."""
    import numpy as np
    a = rng.choice(num, size=(n, len(num)))
    b = rng.choice(den, size=(n, len(den)))
    return float(np.std(np.median(a, axis=1) / np.median(b, axis=1), ddof=1))


def fixed_costs(small: list[dict]) -> dict[str, Any]:
    """Intercept (fixed cost, ms), its standard error and slope (ms per GB) of each series' time
    against bytes over the small sizes (none with fewer than two sizes)."""
    fixed: dict[str, Any] = {}
    if len(small) >= 2:
        xs = [r["bytes"] for r in small for _ in r["samples"]["flush_s"]]
        for key in ("flush_s", "raw_s", "raw_best_s", "scratch_write_s", "raw_scratch_s"):
            ys = [1e3 * t for r in small for t in r["samples"][key]]
            a, se, b = _intercept(xs, ys)
            fixed[key[:-2] + "_ms"] = {"intercept": a, "stderr": se, "ms_per_GB": b * 1e9}
    return fixed


def _intercept(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(intercept, its standard error, slope) of the least-squares line y = a + b x."""
    import numpy as np
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    A = np.vstack([np.ones_like(x), x]).T
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    resid = y - A @ coef
    dof = max(1, len(x) - 2)
    cov = (resid @ resid / dof) * np.linalg.inv(A.T @ A)
    return float(coef[0]), float(np.sqrt(cov[0, 0])), float(coef[1])


def measure(mib: float, args: argparse.Namespace, fused_ok: bool) -> dict[str, Any]:
    import numpy as np
    from deepfreeze.format import build_manifest
    from deepfreeze.tiers.scratch import ScratchLevel
    from deepfreeze.shardplan import ShardPlan, TensorSpec

    total = int(mib * 2**20) // 4
    k = args.tensors
    counts = [total // k + (1 if i < total % k else 0) for i in range(k)]
    counts = [c - (i % 3) for i, c in enumerate(counts)]  # odd sizes: pieces need padding between them
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(c).astype(np.float32) for c in counts]
    plan = ShardPlan.build([TensorSpec(i, f"t{i}", "float32", (c,)) for i, c in enumerate(counts)], 1)
    nbytes = sum(a.nbytes for a in arrays)
    payload: Any = arrays
    if fused_ok and args.input != "list":
        from deepfreeze.fused import FusedLayout, FusedShard
        payload = FusedShard.from_arrays(FusedLayout.build(plan, 0), arrays, step=1)
    raw_buf = rng.integers(0, 255, nbytes, dtype=np.uint8)  # incompressible, like weights
    view = memoryview(raw_buf)
    m = build_manifest("job", 1, 1, 0, plan, ["node"])
    series: dict[str, list[float]] = {"raw_scratch_s": [], "scratch_write_s": [], "raw_s": [], "raw_best_s": [],
                                      "flush_s": []}
    for _ in range(args.repeat):
        d = tempfile.mkdtemp(dir=args.work)
        os.makedirs(f"{d}/s")
        os.makedirs(f"{d}/p")
        series["raw_scratch_s"].append(_raw_write(f"{d}/s/raw", view, fsync=False))
        s = ScratchLevel(f"{d}/s")
        t0 = time.perf_counter()
        path = s.write_shard("job", 1, 0, plan, payload, chksum=True)
        series["scratch_write_s"].append(time.perf_counter() - t0)
        s.write_manifest("job", 1, m)
        _datasync(path)
        _datasync(f"{d}/s/raw")
        os.sync()
        series["raw_s"].append(_raw_write(f"{d}/p/raw", view, fsync=True))
        os.unlink(f"{d}/p/raw")
        os.sync()
        series["raw_best_s"].append(_raw_write_best(f"{d}/p/raw", view))
        os.unlink(f"{d}/p/raw")
        os.sync()
        series["flush_s"].append(timed_flush(d, m))
        shutil.rmtree(d)
        os.sync()
    med = {k: float(np.median(v)) for k, v in series.items()}
    boot = np.random.default_rng(1)
    out: dict[str, Any] = {
        "mib": mib, "bytes": int(nbytes), "tensors": k,
        "input": "fused" if payload is not arrays else "list",
        "samples": series, "median_s": med,
        "flush_GBps": nbytes / med["flush_s"] / 1e9, "raw_GBps": nbytes / med["raw_s"] / 1e9,
        "scratch_write_GBps": nbytes / med["scratch_write_s"] / 1e9,
        "raw_scratch_GBps": nbytes / med["raw_scratch_s"] / 1e9,
        "flush_efficiency": med["raw_s"] / med["flush_s"],
        "flush_efficiency_stderr": _bootstrap_ratio(series["raw_s"], series["flush_s"], boot),
        "scratch_efficiency": med["raw_scratch_s"] / med["scratch_write_s"],
        "scratch_efficiency_stderr": _bootstrap_ratio(series["raw_scratch_s"], series["scratch_write_s"], boot),
        "flush_minus_raw_ms": 1e3 * (med["flush_s"] - med["raw_s"]),
        "raw_best_GBps": nbytes / med["raw_best_s"] / 1e9,
        "flush_efficiency_vs_best": med["raw_best_s"] / med["flush_s"],
        "flush_efficiency_vs_best_stderr": _bootstrap_ratio(series["raw_best_s"], series["flush_s"], boot),
    }
    return out


def strategies(nbytes: int, repeat: int, directory: str) -> dict[str, Any]:
    """GB/s of write + fsync of ``nbytes`` into ``directory`` by each way of writing, interleaved, with
    ``sync`` between samples: what the flush's copy should do on this machine.

    * ``single``: one ``write`` of the whole buffer, then fsync (``write_rates``' way: the reference);
    * ``chunked``: 1 MiB ``pwrite`` calls, then fsync (the flush before this change, in 8 MiB calls);
    * ``chunked_writeback``: the same, starting the write-back of every 8 MiB written at once
      (``sync_file_range(SYNC_FILE_RANGE_WRITE)``: what :func:`deepfreeze.tiers.shardbytes._copy_checked` does);
    * ``o_direct``: ``O_DIRECT`` writes of 8 MiB from a page-aligned staging buffer (``mmap``), the
      bytes copied into it first (the flush must CRC them anyway), then fsync."""
    import mmap
    import numpy as np
    buf = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    src = memoryview(buf)
    stage = mmap.mmap(-1, 8 << 20)
    sview = memoryview(stage)

    def single(fd: int) -> None:
        done = 0
        while done < nbytes:
            done += os.write(fd, src[done:])

    def chunked(fd: int, kick: bool = False) -> None:
        pos = last = 0
        while pos < nbytes:
            pos += os.pwrite(fd, src[pos:pos + (1 << 20)], pos)
            if kick and pos - last >= 8 << 20:
                _KICK(fd, last, pos - last)
                last = pos
        if kick:
            _KICK(fd, last, pos - last)

    def direct(fd: int) -> None:
        pos = 0
        while pos < nbytes:
            n = min(8 << 20, nbytes - pos)
            sview[:n] = src[pos:pos + n]
            m = (n + 4095) // 4096 * 4096  # whole blocks; the tail is cut by ftruncate below
            if m > n:
                sview[n:m] = bytes(m - n)
            os.pwrite(fd, sview[:m], pos)
            pos += n
        os.ftruncate(fd, nbytes)

    ways: dict[str, Any] = {"single": (single, 0), "chunked": (chunked, 0),
                            "chunked_writeback": (lambda fd: chunked(fd, True), 0),
                            "o_direct": (direct, getattr(os, "O_DIRECT", 0))}
    out: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeat):
        for k, (fn, flag) in ways.items():
            path = os.path.join(directory, f"strategy.{k}")
            os.sync()
            t = time.perf_counter()
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
            except OSError:  # O_DIRECT refused by this file system: nothing to compare
                out[k].append(float("nan"))
                continue
            try:
                fn(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
            out[k].append(nbytes / (time.perf_counter() - t) / 1e9)
            os.unlink(path)
    sview.release()
    stage.close()
    return {"bytes": nbytes, "repeat": repeat, "GBps_samples": out,
            "median_GBps": {k: float(np.nanmedian(v)) for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="which code is measured (before/after)")
    ap.add_argument("--sizes", default="1,16,64,256,512", help="shard sizes in MiB, comma separated")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=16, help="tensors splitting each shard (default 16)")
    ap.add_argument("--input", choices=("auto", "list", "fused"), default="auto",
                    help="what write_shard gets: a FusedShard when supported (auto), or the list of arrays")
    ap.add_argument("--replot", action="store_true", help="only recompute 'pooled' and the PNG from --out")
    ap.add_argument("--strategies", type=float, default=0, metavar="MIB",
                    help="also compare ways of writing MIB MiB + fsync (single write, chunked, chunked with "
                         "early write-back, O_DIRECT), --repeat samples each; stored as 'io_strategies'")
    ap.add_argument("--work", default=os.path.join(os.path.dirname(HERE), "_work", "flush"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "flush.json"))
    args = ap.parse_args()
    import numpy as np
    if args.replot:
        with open(args.out) as f:
            doc = json.load(f)
        doc["pooled"] = pooled(doc)
        write_doc(doc, args.out)
        _plot(doc, os.path.splitext(args.out)[0] + ".png")
        return
    os.makedirs(args.work, exist_ok=True)
    fused_ok = False
    if args.input != "list":
        try:
            import inspect
            from deepfreeze.tiers import shardbytes as levels
            fused_ok = "FusedShard" in inspect.getsource(levels.write_shard_file)
        except (ImportError, OSError):
            fused_ok = False
        if args.input == "fused" and not fused_ok:
            raise SystemExit("this version of write_shard_file does not take a FusedShard")
    doc: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    if args.strategies:
        st = strategies(int(args.strategies * 2**20), args.repeat, args.work)
        doc["io_strategies"] = st
        print("write + fsync of %g MiB, median GB/s: %s" % (args.strategies, ", ".join(
            f"{k} {v:.2f}" for k, v in st["median_GBps"].items())), flush=True)
    sizes = [float(x) for x in args.sizes.split(",") if x]
    load_before = list(os.getloadavg())
    results = []
    for mib in sizes:
        r = measure(mib, args, fused_ok)
        results.append(r)
        print(f"{args.label} {mib:g} MiB ({r['input']}): flush {r['flush_GBps']:.2f} GB/s vs raw "
              f"{r['raw_GBps']:.2f} GB/s = {100 * r['flush_efficiency']:.0f} ± "
              f"{100 * r['flush_efficiency_stderr']:.0f} % (vs best raw {r['raw_best_GBps']:.2f} GB/s: "
              f"{100 * r['flush_efficiency_vs_best']:.0f} ± {100 * r['flush_efficiency_vs_best_stderr']:.0f} %); "
              f"scratch write {r['scratch_write_GBps']:.2f} vs raw "
              f"{r['raw_scratch_GBps']:.2f} GB/s = {100 * r['scratch_efficiency']:.0f} ± "
              f"{100 * r['scratch_efficiency_stderr']:.0f} %", flush=True)
    small = [r for r in results if r["mib"] <= 64]
    fixed = fixed_costs(small)
    if fixed:
        fixed["flush_over_raw_ms"] = fixed["flush_ms"]["intercept"] - fixed["raw_ms"]["intercept"]
        fixed["sizes_mib"] = [r["mib"] for r in small]
    target = []
    for r in results:
        if r["mib"] >= 256:
            e, se = r["flush_efficiency"], r["flush_efficiency_stderr"]
            verdict = "holds" if e - 0.9 > se else "missed" if 0.9 - e > se else "not resolvable"
            target.append({"mib": r["mib"], "efficiency": e, "stderr": se, "verdict": verdict})
    if not results:
        write_doc(doc, args.out)
        return
    doc["settings"] = {"repeat": args.repeat, "tensors": args.tensors, "checksums": True,
                       "statistic": "median over repetitions; efficiency = median raw time / median flush time, "
                                    "standard error by bootstrap; fixed cost = intercept of time vs bytes "
                                    "(least squares over all samples of sizes <= 64 MiB)",
                       "machine": {"cpus": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())}}
    from deepfreeze.tiers import shardbytes as code
    doc[args.label] = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "levels_module": os.path.relpath(code.__file__, os.path.dirname(HERE)),
                       "load_avg_before": load_before, "load_avg_after": list(os.getloadavg()), "sizes": results,
                       "fixed_cost": fixed, "target_flush_ge_90pct": target}
    doc["pooled"] = pooled(doc)
    write_doc(doc, args.out)
    _plot(doc, os.path.splitext(args.out)[0] + ".png")
    if fixed:
        print(f"{args.label}: fixed cost per version: flush {fixed['flush_ms']['intercept']:.1f} ± "
              f"{fixed['flush_ms']['stderr']:.1f} ms, raw {fixed['raw_ms']['intercept']:.1f} ± "
              f"{fixed['raw_ms']['stderr']:.1f} ms")
    for t in target:
        print(f"{args.label}: target flush >= 90 % of raw at {t['mib']:g} MiB: {100 * t['efficiency']:.0f} ± "
              f"{100 * t['stderr']:.0f} % -> {t['verdict']}")
    del np


def _summary(mib: float, nbytes: int, series: dict[str, list[float]], rng: Any) -> dict[str, Any]:
    import numpy as np
    med = {k: float(np.median(v)) for k, v in series.items()}
    out: dict[str, Any] = {"mib": mib, "bytes": nbytes, "n": len(series["flush_s"]), "median_s": med}
    for k in ("flush", "raw", "raw_best", "scratch_write", "raw_scratch"):
        out[f"{k}_GBps"] = nbytes / med[f"{k}_s"] / 1e9
    for name, num, den in (("flush_efficiency", "raw_s", "flush_s"),
                           ("flush_efficiency_vs_best", "raw_best_s", "flush_s"),
                           ("scratch_efficiency", "raw_scratch_s", "scratch_write_s")):
        out[name] = med[num] / med[den]
        out[name + "_stderr"] = _bootstrap_ratio(series[num], series[den], rng)
    return out


def pooled(doc: dict[str, Any]) -> dict[str, Any]:
    """Runs of the same code (labels ``x``, ``x_2``, ...) pooled: per size, every sample of those runs,
    the same statistics as one run (medians, efficiencies with bootstrap standard errors, the fixed
    cost per version as the intercept over sizes <= 64 MiB), and the target's verdicts."""
    import numpy as np
    groups: dict[str, list[str]] = {}
    for k, v in doc.items():
        if isinstance(v, dict) and "sizes" in v:
            groups.setdefault(k.split("_")[0], []).append(k)
    rng = np.random.default_rng(3)
    out: dict[str, Any] = {}
    for g, labels in groups.items():
        sizes = []
        for i, r0 in enumerate(doc[labels[0]]["sizes"]):
            runs = [doc[lab]["sizes"][i] for lab in labels if i < len(doc[lab]["sizes"])
                    and doc[lab]["sizes"][i]["mib"] == r0["mib"] and "raw_best_s" in doc[lab]["sizes"][i]["samples"]]
            series = {k: [t for r in runs for t in r["samples"][k]] for k in runs[0]["samples"]}
            sizes.append(dict(_summary(r0["mib"], r0["bytes"], series, rng), samples=series))
        fixed = fixed_costs([r for r in sizes if r["mib"] <= 64])
        target = []
        for r in sizes:
            if r["mib"] >= 256:
                for ref in ("flush_efficiency", "flush_efficiency_vs_best"):
                    e, se = r[ref], r[ref + "_stderr"]
                    verdict = "holds" if e - 0.9 > se else "missed" if 0.9 - e > se else "not resolvable"
                    target.append({"mib": r["mib"], "against": "raw" if ref == "flush_efficiency" else "raw_best",
                                   "efficiency": e, "stderr": se, "verdict": verdict})
        for r in sizes:
            del r["samples"]
        out[g] = {"runs": labels, "sizes": sizes, "fixed_cost": fixed, "target_flush_ge_90pct": target}
    return out


def _plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pool = doc.get("pooled") or {}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    styles = {"before": ("tab:red", "--"), "after": ("tab:blue", "-")}
    for g, res in pool.items():
        color, ls = styles.get(g, ("tab:green", ":"))
        rs = res["sizes"]
        x = [r["mib"] for r in rs]
        n = sum(1 for _ in res["runs"])
        axes[0].plot(x, [r["flush_GBps"] for r in rs], "o" + ls, color=color, label=f"flush, {g} ({n} runs)")
        axes[0].plot(x, [r["raw_GBps"] for r in rs], "s" + ls, color="grey", alpha=0.7,
                     label=f"raw: one write + fsync ({g} runs)")
        axes[0].plot(x, [r["raw_best_GBps"] for r in rs], "D" + ls, color="black", alpha=0.7,
                     label=f"raw: early write-back ({g} runs)")
        axes[1].errorbar(x, [100 * r["flush_efficiency"] for r in rs],
                         yerr=[100 * r["flush_efficiency_stderr"] for r in rs],
                         fmt="o" + ls, color=color, capsize=3, label=f"vs one write ({g})")
        axes[1].errorbar(x, [100 * r["flush_efficiency_vs_best"] for r in rs],
                         yerr=[100 * r["flush_efficiency_vs_best_stderr"] for r in rs], fmt="D" + ls, color=color,
                         alpha=0.6, capsize=3, label=f"vs early write-back ({g})")
        axes[2].errorbar(x, [100 * r["scratch_efficiency"] for r in rs],
                         yerr=[100 * r["scratch_efficiency_stderr"] for r in rs], fmt="^" + ls, color=color, capsize=3,
                         label=f"scratch write ({g})")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shard MiB")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("GB/s (median)")
    axes[0].set_title("flush and raw write + fsync to persistent", fontsize=9)
    axes[1].set_ylabel("% of raw bandwidth (median ± s.e.)")
    axes[1].set_title("flush efficiency", fontsize=9)
    axes[1].axhline(90, color="red", lw=0.8, ls=":")
    axes[2].set_ylabel("% of raw page-cache write (median ± s.e.)")
    axes[2].set_title("scratch write (write_shard) vs raw write, no fsync", fontsize=9)
    fig.suptitle("checksums on; samples of runs of the same code pooled "
                 f"(n={doc.get('settings', {}).get('repeat', '?')} per size and run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
