"""Cost of protecting scratch across failure domains: ec off vs partner vs XOR parity.

    python -m experiments.redundancy [--mb 100] [--versions 4] --out experiments/results/redundancy.json

For 2, 3 and 4 ranks (one simulated node each, numpy shards of ``--mb`` MB per rank,
built-in engine in sync mode so the whole scratch write + exchange is timed in the
rank), each scheme writes ``--versions`` versions; reported per scheme and world size:
mean time to commit a shard on scratch including the exchange (first version excluded),
bytes each node holds per version (own shards + partner copies / parity) relative to
its own shards, and the time of a collective restore after one node's scratch is wiped.
One run, side by side; results as JSON and a PNG.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCHEMES = ["off", "partner", "xor"]


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    import numpy as np
    from deepfreeze import Config, load
    from deepfreeze.engine import Engine
    from deepfreeze.comm import MPIComm
    from deepfreeze.shardplan import ShardPlan, TensorSpec

    comm = MPIComm()
    rank, size = comm.rank, comm.size
    n = args.mb * (1 << 20) // 4 * size
    tensors = [TensorSpec(0, "w", "float32", (n,))]
    plan = ShardPlan.build(tensors, size)
    cfg = Config.load(None, mode="sync", scratch=f"{args.work}/node{rank}", persistent=f"{args.work}/pfs",
                      failure_domain=f"node{rank}", persistent_interval=-1, scratch_versions=2,
                      ec_interval=-1 if args.scheme == "off" else 0,
                      ec_scheme="xor" if args.scheme == "off" else args.scheme)
    eng = Engine(cfg, "red", rank, plan, [f"node{r}" for r in range(size)], comm=comm)
    full = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    mine = [full[p.start:p.stop] for p in plan.for_rank(rank)]
    for v in range(1, args.versions + 1):
        eng.checkpoint(v, mine, step=v, epoch=0)
    eng.close()
    vdir = f"{args.work}/node{rank}/red/v{args.versions:012d}"
    own = sum(os.path.getsize(f"{vdir}/{f}") for f in os.listdir(vdir) if f.startswith("r"))
    held = sum(os.path.getsize(f"{vdir}/{f}") for f in os.listdir(vdir) if f.endswith((".dfs", ".dfx")))
    comm.allgather(b"")  # everyone has written
    if rank == 0 and args.scheme != "off":
        shutil.rmtree(f"{args.work}/node{size - 1}")
    comm.allgather(b"")
    t0 = time.perf_counter()
    restored = None
    try:
        ck = load(cfg, "red", comm=comm)
        restored = bool(ck.arrays["w"].tobytes() == full.tobytes())
    except Exception as e:  # ec off: nothing to restore from once a node is gone
        restored = f"{type(e).__name__}"
    t_restore = time.perf_counter() - t0
    writes = [eng.write_times[v] for v in range(2, args.versions + 1)]
    rows = comm.allgather(json.dumps({"write_s": sum(writes) / len(writes), "space": held / own,
                                      "restore_s": t_restore, "restored": restored}).encode())
    if rank == 0:
        rs = [json.loads(r) for r in rows]
        out = {"scheme": args.scheme, "ranks": size, "mb_per_rank": args.mb,
               "write_s": max(r["write_s"] for r in rs), "space_ratio": sum(r["space"] for r in rs) / size,
               "restore_after_node_loss_s": max(r["restore_s"] for r in rs) if args.scheme != "off" else None,
               "restored_bit_exact": all(r["restored"] is True for r in rs) if args.scheme != "off" else None}
        with open(args.result, "w") as f:
            json.dump(out, f)
    comm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--ranks", default="2,3,4")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "redundancy.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scheme", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    mpirun = [shutil.which("mpirun") or "mpirun", "--oversubscribe"] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    runs = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for scheme in SCHEMES:
            with tempfile.TemporaryDirectory(prefix="df-red-") as work:
                res = os.path.join(work, "result.json")
                cmd = mpirun + ["-np", str(ranks), sys.executable, "-m", "experiments.redundancy", "--worker",
                                "--scheme", scheme, "--work", work, "--result", res, "--mb", str(args.mb),
                                "--versions", str(args.versions)]
                subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                with open(res) as f:
                    runs.append(json.load(f))
                print(json.dumps(runs[-1]), flush=True)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "settings": {"mb_per_rank": args.mb, "versions": args.versions, "mode": "sync",
                        "note": "one simulated node per rank, all on one disk and 2 cores"}, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, args.out[:-5] + ".png")


def plot(doc: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ranks = sorted({r["ranks"] for r in doc["runs"]})
    for ax, key, title in zip(axes, ["write_s", "space_ratio", "restore_after_node_loss_s"],
                              ["scratch write + exchange per version (s)", "scratch bytes held / own shards",
                               "collective restore after losing a node (s)"]):
        for i, scheme in enumerate(SCHEMES):
            ys = [next((r[key] for r in doc["runs"] if r["ranks"] == n and r["scheme"] == scheme), None) for n in ranks]
            xs = [n + (i - 1) * 0.25 for n in ranks]
            ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], width=0.25,
                   label=scheme)
        ax.set_xticks(ranks)
        ax.set_xlabel("ranks (one simulated node each)")
        ax.set_title(title, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"Protecting scratch across failure domains, {doc['settings']['mb_per_rank']} MB per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
