"""Framework-neutral clone transfer (numpy + mpi4py):

    python clone_numpy.py OUT SIZES [mismatch|abort|timeout|dead=source|dead=clone]

SIZES: comma-separated group sizes (the first is the source). Every source rank holds the
same replicated arrays and its own "whole" array (rank-dependent: only rank 0's may
arrive); every clone rank checks it received exactly source rank 0's arrays. Every rank
writes its outcome to OUT/g<group>r<rank>.json (tests read these, never the interleaved
stdout of mpirun): ``sent``/``received`` facts, and ``errors`` as [type, message, seconds
since the transfer began].

``dead=source``/``dead=clone`` (run under ``mpirun --enable-recovery``, so the job outlives
a dead rank): rank 1 of that group kills itself (SIGKILL) after the hello, before any data
moves; the survivors must end DeepFreeze's waits within their timeout with a clear error
and exit (``os._exit``: MPI_Finalize and the job's final barrier would wait for the dead rank).
"""
import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import deepfreeze.clone as dfc
from deepfreeze.errors import CloneError, ModelMismatchError
from deepfreeze.shardplan import TensorSpec

out = sys.argv[1]
sizes = tuple(int(s) for s in sys.argv[2].split(","))
mode = sys.argv[3] if len(sys.argv) > 3 else ""
group = dfc.split(sizes=sizes)
shapes = [("big", "float32", (300, 1001)), ("prime", "float64", (100003,)), ("small", "int32", (7,)),
          ("empty", "float32", (0, 3)), ("scalar", "int64", ()), ("bn_mean", "float32", (50000,))]
if mode == "mismatch" and not group.is_source:
    shapes[1] = ("prime", "float64", (100004,))
specs = [TensorSpec(i, n, d, s) for i, (n, d, s) in enumerate(shapes)]
whole = [5]
result = {"group": group.index, "rank": group.rank, "errors": []}
t0 = time.monotonic()


def save() -> None:
    path = f"{out}/g{group.index}r{group.rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def arrays(rank):
    rng = np.random.default_rng(7)
    out = [rng.standard_normal(s).astype(d) if d.startswith("float") else rng.integers(-9, 9, s).astype(d)
           for _, d, s in shapes]
    out[5] = out[5] + rank  # not replicated: differs per source rank
    return out


class DieAfterHello(dfc.Sender):
    """Fault injection: this source rank dies once the hellos are exchanged."""

    def wait_hello(self, timeout=None):
        super().wait_hello(timeout)
        os.kill(os.getpid(), signal.SIGKILL)


class DieAfterHelloClone(dfc.Receiver):
    """Fault injection: this clone rank dies once the hellos are exchanged."""

    def hello(self, info=None):
        super().hello(info)
        os.kill(os.getpid(), signal.SIGKILL)


try:
    if mode == "timeout":  # the clones show up late, then the source never sends: both sides time out
        try:
            if group.is_source:
                dfc.send(group, specs, arrays(0), dfc.CloneInfo(1, 0, 1, False, ""), whole=whole, timeout=2)
            else:
                time.sleep(3)
                dfc.receive(group, specs, whole=whole, timeout=2)
        except CloneError as e:
            result["errors"].append([type(e).__name__, str(e), time.monotonic() - t0])
        if group.is_source:
            time.sleep(4)  # alive, but never sending: the clones' own timeout must fire
    elif mode.startswith("dead="):
        who = mode.split("=", 1)[1]
        dying = group.rank == 1 and (group.is_source if who == "source" else not group.is_source)
        if group.is_source:
            snd = dfc.send(group, specs, arrays(group.rank), dfc.CloneInfo(12, 1, 4, False, "abcd"), whole=whole,
                           timeout=4, sender_cls=DieAfterHello if dying else dfc.Sender)
            result["sent"] = snd.bytes_sent
        else:
            dfc.receive(group, specs, whole=whole, timeout=4,
                        receiver_cls=DieAfterHelloClone if dying else dfc.Receiver)
            result["received"] = True
    elif group.is_source:
        if mode == "abort":
            s = dfc.Sender(group, dfc.plans_for(group, specs, whole=whole), timeout=30)
            s.abort("test: the source's fit ended at step 3, before the clone step 10")
            s.close()
        else:
            snd = dfc.send(group, specs, arrays(group.rank), dfc.CloneInfo(12, 1, 4, False, "abcd"), whole=whole,
                           timeout=60)
            result["sent"] = snd.bytes_sent
    else:
        got, info = dfc.receive(group, specs, whole=whole, timeout=60)
        want = arrays(0)
        result["bitexact"] = all(g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()
                                 for g, w in zip(got, want))
        result["info"] = {"step": info.step, "epoch": info.epoch, "run": info.source_run}
except (ModelMismatchError, CloneError) as e:
    result["errors"].append([type(e).__name__, str(e), time.monotonic() - t0])
result["seconds"] = time.monotonic() - t0
save()
if mode.startswith("dead="):
    os._exit(0)  # a peer died: MPI_Finalize (and any collective) would wait for it
MPI.COMM_WORLD.Barrier()
