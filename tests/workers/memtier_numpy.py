"""A one-rank numpy job on the memory tier, for the kill tests of tests/test_memtier_engine.py.

    python tests/workers/memtier_numpy.py OUT DEVICE V1,V2,...

Async engine (scratch OUT/scratch, persistent OUT/pfs, memtier DEVICE), rank 0 of 1. For each
version V it checkpoints ``arrays(V)`` (flat pieces), then waits until V is flushed to
persistent, except for the last one, and prints ``committed V backend=PID`` (flushed) or
``sent V backend=PID`` (the last: handed to the writer thread, then it waits for everything and
prints ``done``). The test reads these lines to know when to kill what.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import numpy as np  # noqa: E402

from deepfreeze import Config  # noqa: E402
from deepfreeze.engine import Engine  # noqa: E402
from deepfreeze.shardplan import ShardPlan, TensorSpec  # noqa: E402


def arrays(v: int) -> list:
    """Version ``v``'s state: 12 MB over three tensors (three 4 MiB copy chunks and more)."""
    r = np.random.default_rng(1000 + v)
    return [r.standard_normal(1_000_000), r.standard_normal((1000, 1000)).astype(np.float32),
            r.integers(0, 1 << 30, 777, dtype=np.int32)]


def plan() -> ShardPlan:
    ts = [TensorSpec(i, f"t{i}", a.dtype.name, a.shape) for i, a in enumerate(arrays(0))]
    return ShardPlan.build(ts, 1)


def main() -> None:
    out, device, versions = sys.argv[1], sys.argv[2], [int(v) for v in sys.argv[3].split(",")]
    cfg = Config.load(None, mode="async", scratch=f"{out}/scratch", persistent=f"{out}/pfs", memtier=device)
    p = plan()
    engine = Engine(cfg, "job", 0, p)
    for i, v in enumerate(versions):
        engine.checkpoint(v, [a.reshape(-1) for a in arrays(v)], step=v, epoch=0)
        if i < len(versions) - 1:
            engine.wait()
            print(f"committed {v} backend={engine._backend.pid}", flush=True)
        else:
            print(f"sent {v} backend={engine._backend.pid}", flush=True)
    engine.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
