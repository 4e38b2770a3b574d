"""The manifest's size against tensors T and ranks N, with the compact plan record (format version
3) and with the older record that lists every piece (format version 2), and the CPU time to build
it, encode it, decode it and derive its plan again.

    python -m experiments.manifest_size [--out experiments/results/manifest_size.json]

Each model is the one of docs/cluster.md's counts: T float32 tensors, every one split across all
N ranks (2**20 elements each), named like ``layer_017/kernel:0``, one failure domain per rank
(``node0017``); plus one mixed model (half of the tensors 256-element biases, placed whole). Sizes are the bytes :func:`deepfreeze.format.encode_manifest`
writes (``indent=1``, sorted keys) of :func:`deepfreeze.format.build_manifest`'s manifest; the
older form is the same manifest with ``plan`` replaced by every piece. Times are process CPU
seconds of one call each (small, and noisy on a busy machine: the sizes are the result).
"""
from __future__ import annotations

import argparse
import json
import time

from deepfreeze import format as fmt
from deepfreeze.tiers.base import plan_of
from deepfreeze.shardplan import ShardPlan, TensorSpec


def specs(t: int, mixed: bool) -> list[TensorSpec]:
    if not mixed:
        return [TensorSpec(i, f"layer_{i:03d}/kernel:0", "float32", (1024, 1024)) for i in range(t)]
    return [TensorSpec(i, f"layer_{i // 2:03d}/{'bias' if i % 2 else 'kernel'}:0", "float32",
                       (256,) if i % 2 else (1024, 1024)) for i in range(t)]


def cpu(fn):
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def measure(t: int, n: int, mixed: bool = False) -> dict:
    plan, build_s = cpu(lambda: ShardPlan.build(specs(t, mixed), n))
    m = fmt.build_manifest("model", 1, 1, 0, plan, [f"node{r:04d}" for r in range(n)])
    compact, enc_s = cpu(lambda: fmt.encode_manifest(m))
    legacy = dict(m, format_version=2, plan={"world_size": n, "min_shard_bytes": plan.min_shard_bytes,
                                              "pieces": [[p.tensor_id, p.rank, p.start, p.stop] for p in plan.pieces]})
    old = fmt.encode_manifest(legacy)
    back, dec_s = cpu(lambda: fmt.decode_manifest(compact))
    derived, derive_s = cpu(lambda: plan_of(back))
    assert derived == plan and plan_of(fmt.decode_manifest(old)) == plan
    _, old_s = cpu(lambda: plan_of(fmt.decode_manifest(old)))
    return {"tensors": t, "ranks": n, "mixed": mixed, "pieces": len(plan.pieces), "compact_bytes": len(compact),
            "pieces_bytes": len(old), "build_s": round(build_s, 4), "encode_s": round(enc_s, 4),
            "decode_s": round(dec_s, 4), "derive_s": round(derive_s, 4), "old_decode_and_plan_s": round(old_s, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [measure(t, n) for t, n in ((4, 1), (4, 8), (4, 1000), (200, 8), (200, 1000))]
    rows.append(measure(200, 1000, mixed=True))
    print("| T | N | pieces | compact (v3) bytes | every piece (v2) bytes | derive plan (CPU s) | v2 decode + plan (CPU s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tensors']}{' (mixed)' if r['mixed'] else ''} | {r['ranks']} | {r['pieces']} | {r['compact_bytes']} | {r['pieces_bytes']} | "
              f"{r['derive_s']} | {r['old_decode_and_plan_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
