"""Flush at disk speed: the scratch write and the flush to persistent against raw writes of the same bytes.

    python -m experiments.flush [--label after] [--sizes 1,16,64,256,512] [--repeat 10]
                                [--out experiments/results/flush.json]

For each shard size (one rank, ``--tensors`` float32 tensors splitting the size, checksums on) and each
of ``--repeat`` repetitions, in this order, in one process on this machine's disk (scratch and persistent
are directories of the same file system here):

* ``raw_scratch``: write the shard's byte count to a new file in the scratch directory, no fsync (the
  scratch level is not fsynced either), the way :func:`experiments.bench.write_rates` writes;
* ``scratch_write``: :meth:`deepfreeze.levels.ScratchLevel.write_shard` of the shard (header, index,
  CRCs, data, rename), fed with the engine's input (``--input``: a :class:`deepfreeze.fused.FusedShard`
  when this version of the code accepts one, else the list of flat arrays);
* (untimed) ``fdatasync`` of the scratch shard and of the scratch raw file, so their write-back does
  not compete with what follows (in a run it happens in the background, 30 s later), and ``sync``
  before each timed disk write (raw, flush) and after each removal, so deferred work (the discards
  of removed files: this ext4 is mounted with ``discard``) falls on no timed series;
* ``raw``: sequential write of the same byte count + fsync into the persistent directory
  (:func:`experiments.bench.write_rates`' way: one ``write`` of the whole buffer, then fsync);
* ``flush``: :func:`deepfreeze.levels.flush_job` of the shard to persistent (decision, CRC-checked
  copy into the partial, fsync, done marker, finalize, manifest; world size 1).

Statistics per size: medians of each series; efficiency = median raw time / median flush time (= flush
bandwidth / raw bandwidth), its standard error by bootstrap (2000 resamples of both series); the target
(flush >= 90 % of raw for shards >= 256 MiB) "holds" only if efficiency - 0.9 > one standard error,
"missed" if 0.9 - efficiency > one standard error, else "not resolvable". The fixed cost per version is
the intercept of a least-squares line of flush time against bytes over every sample of the small
sizes (<= 64 MiB), with its standard error; the same for raw, and their difference.

``--label`` names the code measured (``before``: the unchanged code; ``after``); the JSON keeps the
other labels already in ``--out``, so one file holds before and after. A PNG beside the JSON plots both.
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

HERE = os.path.dirname(os.path.abspath(__file__))


def _raw_write(path: str, view: memoryview, fsync: bool) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
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
    from deepfreeze.engine import build_manifest
    from deepfreeze.levels import ScratchLevel, flush_job
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
    series: dict[str, list[float]] = {"raw_scratch_s": [], "scratch_write_s": [], "raw_s": [], "flush_s": []}
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
        job = {"name": "job", "version": 1, "rank": 0, "scratch": f"{d}/s", "persistent": f"{d}/p",
               "persistent_interval": 0, "keep_scratch": 0, "keep_persistent": 0, "manifest": m}
        t0 = time.perf_counter()
        if not flush_job(job)["committed"]:
            raise RuntimeError("the flush did not commit")
        series["flush_s"].append(time.perf_counter() - t0)
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
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="after", help="which code is measured (before/after)")
    ap.add_argument("--sizes", default="1,16,64,256,512", help="shard sizes in MiB, comma separated")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=16, help="tensors splitting each shard (default 16)")
    ap.add_argument("--input", choices=("auto", "list", "fused"), default="auto",
                    help="what write_shard gets: a FusedShard when supported (auto), or the list of arrays")
    ap.add_argument("--work", default=os.path.join(os.path.dirname(HERE), "_work", "flush"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "flush.json"))
    args = ap.parse_args()
    import numpy as np
    os.makedirs(args.work, exist_ok=True)
    fused_ok = False
    if args.input != "list":
        try:
            import inspect
            from deepfreeze import levels
            fused_ok = "FusedShard" in inspect.getsource(levels.write_shard_file)
        except (ImportError, OSError):
            fused_ok = False
        if args.input == "fused" and not fused_ok:
            raise SystemExit("this version of write_shard_file does not take a FusedShard")
    sizes = [float(x) for x in args.sizes.split(",")]
    results = []
    for mib in sizes:
        r = measure(mib, args, fused_ok)
        results.append(r)
        print(f"{args.label} {mib:g} MiB ({r['input']}): flush {r['flush_GBps']:.2f} GB/s vs raw "
              f"{r['raw_GBps']:.2f} GB/s = {100 * r['flush_efficiency']:.0f} ± "
              f"{100 * r['flush_efficiency_stderr']:.0f} %; scratch write {r['scratch_write_GBps']:.2f} vs raw "
              f"{r['raw_scratch_GBps']:.2f} GB/s = {100 * r['scratch_efficiency']:.0f} ± "
              f"{100 * r['scratch_efficiency_stderr']:.0f} %", flush=True)
    small = [r for r in results if r["mib"] <= 64]
    fixed: dict[str, Any] = {}
    if len(small) >= 2:
        xs = [r["bytes"] for r in small for _ in r["samples"]["flush_s"]]
        for key in ("flush_s", "raw_s", "scratch_write_s", "raw_scratch_s"):
            ys = [1e3 * t for r in small for t in r["samples"][key]]
            a, se, b = _intercept(xs, ys)
            fixed[key.replace("_s", "") + "_ms"] = {"intercept": a, "stderr": se, "ms_per_GB": b * 1e9}
        fixed["flush_over_raw_ms"] = fixed["flush_ms"]["intercept"] - fixed["raw_ms"]["intercept"]
        fixed["sizes_mib"] = [r["mib"] for r in small]
    target = []
    for r in results:
        if r["mib"] >= 256:
            e, se = r["flush_efficiency"], r["flush_efficiency_stderr"]
            verdict = "holds" if e - 0.9 > se else "missed" if 0.9 - e > se else "not resolvable"
            target.append({"mib": r["mib"], "efficiency": e, "stderr": se, "verdict": verdict})
    doc: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            doc = json.load(f)
    doc["settings"] = {"repeat": args.repeat, "tensors": args.tensors, "checksums": True,
                       "statistic": "median over repetitions; efficiency = median raw time / median flush time, "
                                    "standard error by bootstrap; fixed cost = intercept of time vs bytes "
                                    "(least squares over all samples of sizes <= 64 MiB)",
                       "machine": {"cpus": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())}}
    doc[args.label] = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "sizes": results,
                       "fixed_cost": fixed, "target_flush_ge_90pct": target}
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


def _plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [k for k in ("before", "after") if k in doc] + [k for k in doc if k not in ("before", "after", "settings")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    styles = {"before": "--", "after": "-"}
    for lab in labels:
        rs = doc[lab]["sizes"]
        x = [r["mib"] for r in rs]
        ls = styles.get(lab, ":")
        ax1.plot(x, [r["flush_GBps"] for r in rs], "o" + ls, color="tab:blue", label=f"flush ({lab})")
        ax1.plot(x, [r["raw_GBps"] for r in rs], "s" + ls, color="grey", label=f"raw write+fsync ({lab} run)")
        ax1.plot(x, [r["scratch_write_GBps"] for r in rs], "^" + ls, color="tab:orange",
                 label=f"scratch write ({lab})")
        ax2.errorbar(x, [100 * r["flush_efficiency"] for r in rs], yerr=[100 * r["flush_efficiency_stderr"] for r in rs],
                     fmt="o" + ls, color="tab:blue", label=f"flush/raw ({lab})", capsize=3)
        ax2.errorbar(x, [100 * r["scratch_efficiency"] for r in rs],
                     yerr=[100 * r["scratch_efficiency_stderr"] for r in rs], fmt="^" + ls, color="tab:orange",
                     label=f"scratch/raw ({lab})", capsize=3)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shard MiB")
    ax1.set_ylabel("GB/s (median)")
    ax2.set_ylabel("% of raw bandwidth (median ± s.e.)")
    ax2.axhline(90, color="red", lw=0.8, ls=":")
    ax1.legend(fontsize=6)
    ax2.legend(fontsize=6)
    n = doc.get("settings", {}).get("repeat", "?")
    fig.suptitle(f"scratch write and flush vs raw write of the same bytes (checksums on, n={n} per size)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
