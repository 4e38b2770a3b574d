"""Framework-neutral clone transfer (numpy + mpi4py): python clone_numpy.py SIZES [mismatch|abort|timeout]

SIZES: comma-separated group sizes (the first is the source). Every source rank holds the
same replicated arrays and its own "whole" array (rank-dependent: only rank 0's may
arrive); every clone rank checks it received exactly source rank 0's arrays."""
import sys

import numpy as np
from mpi4py import MPI

import deepfreeze.clone as dfc
from deepfreeze.errors import CloneError, ModelMismatchError
from deepfreeze.shardplan import TensorSpec

sizes = tuple(int(s) for s in sys.argv[1].split(","))
mode = sys.argv[2] if len(sys.argv) > 2 else ""
group = dfc.split(sizes=sizes)
shapes = [("big", "float32", (300, 1001)), ("prime", "float64", (100003,)), ("small", "int32", (7,)),
          ("empty", "float32", (0, 3)), ("scalar", "int64", ()), ("bn_mean", "float32", (50000,))]
if mode == "mismatch" and not group.is_source:
    shapes[1] = ("prime", "float64", (100004,))
specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(shapes)]
whole = [5]


def arrays(rank):
    rng = np.random.default_rng(7)
    out = [rng.standard_normal(s).astype(d) if d.startswith("float") else rng.integers(-9, 9, s).astype(d)
           for _, d, s in shapes]
    out[5] = out[5] + rank  # not replicated: differs per source rank
    return out


try:
    if mode == "timeout":  # the clones show up late, then the source never sends: both sides time out
        import time
        from deepfreeze.errors import CloneTimeoutError
        try:
            if group.is_source:
                dfc.send(group, specs, arrays(0), dfc.CloneInfo(1, 0, 1, False, ""), whole=whole, timeout=2)
            else:
                time.sleep(3)
                dfc.receive(group, specs, whole=whole, timeout=2)
        except CloneTimeoutError as e:
            print(f"TIMEOUT group={group.index} rank={group.rank} {type(e).__name__}: {e}", flush=True)
        if group.is_source:
            time.sleep(4)  # alive, but never sending: the clones' own timeout must fire
    elif group.is_source:
        if mode == "abort":
            s = dfc.Sender(group, dfc.plans_for(group, specs, whole=whole), timeout=30)
            s.abort("test: the source's fit ended at step 3, before the clone step 10")
            s.close()
        else:
            snd = dfc.send(group, specs, arrays(group.rank), dfc.CloneInfo(12, 1, 4, False, "abcd"), whole=whole,
                           timeout=60)
            print(f"SENT rank={group.rank} bytes={snd.bytes_sent}", flush=True)
    else:
        got, info = dfc.receive(group, specs, whole=whole, timeout=60)
        want = arrays(0)
        ok = all(g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes() for g, w in zip(got, want))
        print(f"RECV group={group.index} rank={group.rank} bitexact={ok} step={info.step} epoch={info.epoch} "
              f"run={info.source_run}", flush=True)
except (ModelMismatchError, CloneError) as e:
    print(f"ERROR group={group.index} rank={group.rank} {type(e).__name__}: {e}", flush=True)
MPI.COMM_WORLD.Barrier()
