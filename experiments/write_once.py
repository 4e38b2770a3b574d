"""Where the CPU of a gpt2-sized checkpoint goes, write_once = off (scratch, read back, copy) against on.

    python -m experiments.write_once --out /tmp/write_once.json [--versions 3] [--dir /var/tmp/wo]

One rank, numpy only (no torch): the state is GPT-2 small's parameters and AdamW's two moments in
its shapes (124 M parameters, 3 x 148 tensors, 1.49 GB of float32), new bytes every version, scratch
and persistent two directories of one disk (``--dir``). Per mode and version, two runs:

* ``sync``: the engine in sync mode under ``cProfile`` with the thread's CPU clock
  (``time.thread_time``): the same functions the writer thread and the backend's flusher run, in one
  thread, so the profile splits the CPU-seconds into CRC32, data writes (``pwrite``), fsync, page
  dropping, decision/marker/manifest and the rest;
* ``async``: the engine in async mode (the default): CPU-seconds of the writer thread
  (``Engine.writer_cpu``) and of the backend process (``/proc/<pid>/stat``, utime + stime) per
  version, measured until the version is committed, and the wall time to durable (noisy on a shared
  machine: judge CPU-seconds).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepfreeze import Config  # noqa: E402
from deepfreeze.engine import Engine  # noqa: E402
from deepfreeze.shardplan import ShardPlan, TensorSpec  # noqa: E402


def gpt2_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """GPT-2 small's parameters (tied embedding counted once): 124,439,808 values."""
    d, v, ctx, ff = 768, 50257, 1024, 3072
    out = [("wte", (v, d)), ("wpe", (ctx, d))]
    for i in range(12):
        out += [(f"h{i}.ln1.w", (d,)), (f"h{i}.ln1.b", (d,)), (f"h{i}.attn.w", (d, 3 * d)), (f"h{i}.attn.b", (3 * d,)),
                (f"h{i}.proj.w", (d, d)), (f"h{i}.proj.b", (d,)), (f"h{i}.ln2.w", (d,)), (f"h{i}.ln2.b", (d,)),
                (f"h{i}.fc.w", (d, ff)), (f"h{i}.fc.b", (ff,)), (f"h{i}.fc2.w", (ff, d)), (f"h{i}.fc2.b", (d,))]
    return out + [("lnf.w", (d,)), ("lnf.b", (d,))]


def state_specs() -> list[TensorSpec]:
    specs = []
    for what in ("param", "exp_avg", "exp_avg_sq"):
        for n, shape in gpt2_shapes():
            specs.append(TensorSpec(len(specs), f"{what}/{n}", "float32", shape))
    return specs


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def committed(persistent: str, version: int) -> bool:
    return os.path.exists(os.path.join(persistent, "gpt2", f"v{version:012d}", "manifest.json"))


GROUPS = [("crc32", ("crc32",)), ("pwrite (data, meta)", ("write_all", "pwrite", "pwritev")),
          ("read (scratch read back)", ("preadv", "pread", "_read_full")), ("fsync", ("fsync",)),
          ("drop cache / writeback hint", ("posix_fadvise", "sync_file_range", "_start_writeback")),
          ("open/rename/unlink/stat/listdir", ("open", "replace", "rename", "unlink", "link", "stat", "lstat",
                                               "listdir", "scandir", "rmdir", "mkdir", "close", "ftruncate"))]


def breakdown(prof: cProfile.Profile) -> dict[str, float]:
    """CPU-seconds by leaf (tottime of builtins and functions), grouped."""
    st = pstats.Stats(prof)
    out = {g: 0.0 for g, _ in GROUPS}
    out["other (Python: plan, manifest, JSON, decision)"] = 0.0
    total = 0.0
    for (_, _, fn), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
        total += tt
        name = fn.strip("<>").split(" ")[-1].split(".")[-1]
        for g, keys in GROUPS:
            if name in keys:
                out[g] += tt
                break
        else:
            out["other (Python: plan, manifest, JSON, decision)"] += tt
    out["total"] = total
    res: dict = {k: round(v, 3) for k, v in out.items()}
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:8]  # type: ignore[attr-defined]
    res["top"] = [[f"{os.path.basename(f)}:{ln}:{fn}", kv[0], round(kv[2], 3)] for (f, ln, fn), kv in top]
    return res


def run(mode: str, write_once: str, root: str, versions: int, arrays: list[np.ndarray], plan: ShardPlan) -> list[dict]:
    d = os.path.join(root, f"{mode}-{write_once}")
    shutil.rmtree(d, ignore_errors=True)
    cfg = Config.load(None, mode=mode, scratch=f"{d}/scratch", persistent=f"{d}/persistent", write_once=write_once,
                      max_versions=1, scratch_versions=1)
    eng = Engine(cfg, "gpt2", 0, plan)
    rows = []
    try:
        for v in range(1, versions + 1):
            for a in arrays:  # new bytes every version (one value per tensor changes)
                a.reshape(-1)[:1] += 1
            if mode == "sync":
                prof = cProfile.Profile(time.thread_time)
                t0 = time.perf_counter()
                prof.enable()
                eng.checkpoint(v, arrays, step=v, epoch=0)
                prof.disable()
                rows.append({"version": v, "wall_s": round(time.perf_counter() - t0, 3), "cpu": breakdown(prof)})
            else:
                b0 = cpu_of(eng._backend.pid)
                t0 = time.perf_counter()
                eng.checkpoint(v, arrays, step=v, epoch=0)
                while not committed(cfg.persistent, v):
                    time.sleep(0.005)
                durable = time.perf_counter() - t0
                eng.wait()
                rows.append({"version": v, "durable_s": round(durable, 3),
                             "writer_cpu_s": round(eng.writer_cpu[v], 3),
                             "backend_cpu_s": round(cpu_of(eng._backend.pid) - b0, 3)})
    finally:
        eng.close()
        shutil.rmtree(d, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temp dir in /var/tmp)")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="write_once-", dir="/var/tmp")
    specs = state_specs()
    plan = ShardPlan.build(specs, 1)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(int(np.prod(s.shape)), dtype=np.float32) for s in specs]
    print(f"state: {sum(a.nbytes for a in arrays) / 1e9:.2f} GB in {len(arrays)} tensors", flush=True)
    result = {"bytes": sum(a.nbytes for a in arrays), "tensors": len(arrays), "runs": {}}
    try:
        for mode in args.modes.split(","):
            for wo in ("off", "on"):
                rows = run(mode, wo, root, args.versions, arrays, plan)
                result["runs"][f"{mode}/write_once={wo}"] = rows
                print(mode, wo, json.dumps(rows, indent=None), flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
