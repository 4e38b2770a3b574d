"""What the integrity protocol costs: the flush of a large shard against raw write, and the fixed cost
of one version's commit.

    python -m experiments.commit_cost [--repeat 7] [--out experiments/results/commit_cost.json]

Issue 11 changed the commit path: a decision with a nonce created under ``commit.lock`` after a
fence check, the flush copying each piece through a buffer while computing its CRC32 (before:
``copy_file_range`` without reading the bytes), nonce-named markers, the finalizer's fence check.
Measured in one process, on this machine's local disk, alternating so drift hits all series alike:

* ``raw_write``: write the shard's bytes to a new file and fsync it (the disk's limit);
* ``flush``: :func:`deepfreeze.tiers.flush.flush_job` of one rank's shard (checksums on), i.e. decision,
  CRC-checked copy into the partial, fsync, marker, finalize, manifest (world size 1);
* ``fixed``: a sync-mode checkpoint of a 256-byte shard (write to scratch + flush + commit), the
  per-version cost that does not depend on the size; the median of 40 per repetition.

Each series: median and standard error over ``--repeat`` repetitions; efficiency = raw / flush time.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from experiments.bench import write_doc

HERE = os.path.dirname(os.path.abspath(__file__))


def timed_flush(d: str, manifest: dict) -> float:
    """Seconds of one ``flush_job`` of rank 0's shard of ``job`` v1 from ``<d>/s`` to ``<d>/p`` (every
    version kept, flushed at once); raises if it did not commit."""
    job = {"name": "job", "version": 1, "rank": 0, "scratch": f"{d}/s", "persistent": f"{d}/p",
           "persistent_interval": 0, "keep_scratch": 0, "keep_persistent": 0, "manifest": manifest}
    from deepfreeze.tiers.flush import flush_job
    t0 = time.perf_counter()
    if not flush_job(job)["committed"]:
        raise RuntimeError("the flush did not commit")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--mib", type=int, default=256, help="shard size in MiB (default 256)")
    ap.add_argument("--work", default=os.path.join(os.path.dirname(HERE), "_work", "commit_cost"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "commit_cost.json"))
    args = ap.parse_args()
    import numpy as np
    from deepfreeze.config import Config
    from deepfreeze.engine import Engine
    from deepfreeze.format import build_manifest
    from deepfreeze.tiers.scratch import ScratchLevel
    from deepfreeze.shardplan import ShardPlan, TensorSpec

    os.makedirs(args.work, exist_ok=True)
    a = np.random.default_rng(0).standard_normal(args.mib * 2**20 // 4).astype(np.float32)
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", a.shape)], 1)
    small = ShardPlan.build([TensorSpec(0, "w", "float32", (64,))], 1)
    series: dict[str, list[float]] = {"raw_write_s": [], "flush_s": [], "fixed_ms": []}
    for _ in range(args.repeat):
        d = tempfile.mkdtemp(dir=args.work)
        # raw write + fsync of the same bytes
        t0 = time.perf_counter()
        fd = os.open(f"{d}/raw", os.O_WRONLY | os.O_CREAT, 0o600)
        view, done = memoryview(a.view(np.uint8)), 0
        while done < len(view):
            done += os.write(fd, view[done:done + (64 << 20)])
        os.fsync(fd)
        os.close(fd)
        series["raw_write_s"].append(time.perf_counter() - t0)
        os.unlink(f"{d}/raw")
        # flush of a shard already on scratch
        s = ScratchLevel(f"{d}/s")
        s.write_shard("job", 1, 0, plan, [a], chksum=True)
        m = build_manifest("job", 1, 1, 0, plan, ["node"])
        s.write_manifest("job", 1, m)
        series["flush_s"].append(timed_flush(d, m))
        # fixed cost per version
        cfg = Config.load(None, mode="sync", scratch=f"{d}/s2", persistent=f"{d}/p2", persistent_interval=0)
        e = Engine(cfg, "small", 0, small)
        ts = []
        for v in range(1, 41):
            t0 = time.perf_counter()
            e.checkpoint(v, [np.zeros(64, np.float32)], step=v, epoch=0)
            ts.append(time.perf_counter() - t0)
        e.close()
        series["fixed_ms"].append(1e3 * float(np.median(ts)))
        shutil.rmtree(d)

    def stat(xs: list[float]) -> dict[str, float]:
        x = np.asarray(xs)
        return {"median": float(np.median(x)), "mean": float(x.mean()),
                "stderr": float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0, "samples": xs}

    doc = {"settings": {"repeat": args.repeat, "shard_bytes": int(a.nbytes), "statistic": "median (and mean ± "
                        "standard error) over repetitions; fixed_ms: each sample the median of 40 checkpoints"},
           **{k: stat(v) for k, v in series.items()}}
    raw, fl = doc["raw_write_s"], doc["flush_s"]
    doc["flush_efficiency"] = raw["median"] / fl["median"]
    doc["flush_GBps"] = a.nbytes / fl["median"] / 1e9
    doc["raw_GBps"] = a.nbytes / raw["median"] / 1e9
    diff, se = fl["mean"] - raw["mean"], float(np.hypot(fl["stderr"], raw["stderr"]))
    doc["flush_minus_raw_s"] = {"mean": diff, "stderr": se, "resolvable": abs(diff) > se}
    write_doc(doc, args.out)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
    ax1.bar(["raw write+fsync", "flush+commit"], [raw["median"], fl["median"]],
            yerr=[raw["stderr"], fl["stderr"]], color=["grey", "tab:blue"])
    ax1.set_ylabel("seconds")
    ax1.set_title(f"{a.nbytes / 2**20:.0f} MiB shard (median, ±s.e., n={args.repeat})", fontsize=9)
    ax2.bar(["per version"], [doc["fixed_ms"]["median"]], yerr=[doc["fixed_ms"]["stderr"]], color="tab:orange")
    ax2.set_ylabel("ms")
    ax2.set_title("fixed cost of a sync checkpoint (256 B)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=110)
    print(f"flush {fl['median']:.3f} s ({doc['flush_GBps']:.2f} GB/s) vs raw write {raw['median']:.3f} s "
          f"({doc['raw_GBps']:.2f} GB/s): efficiency {100 * doc['flush_efficiency']:.0f} %; flush - raw = "
          f"{diff:.3f} ± {se:.3f} s{'' if abs(diff) > se else ' (not resolvable)'}; fixed cost per version "
          f"{doc['fixed_ms']['median']:.2f} ms (median)")


if __name__ == "__main__":
    main()
