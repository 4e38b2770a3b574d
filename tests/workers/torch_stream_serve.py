"""Consumer of the torch stream tests: a plain process (no torch.distributed) serving predictions.

    python tests/workers/torch_stream_serve.py OUT until=STEP [dead=1] [tier=auto|shm|tcp|persistent]
        [pdir=DIR] [stall=1]

It subscribes to the producer's channel (PDIR/persistent; PDIR: the producer's OUT, default OUT),
then answers requests
(``inputs()``, one row each, round robin) under ``with sub.current() as m:`` and records
(version step, input row, output) for each; OUT/seen holds the newest step served (the producer
waits on it). It stops once it served version ``until``. With ``dead=1`` (the producer was killed
after ``until``) it then checks that no newer version becomes live within a bounded wait (a
StreamTimeoutError) and that it still serves ``until``. Writes OUT/serve.npz (steps, rows,
outputs) and OUT/serve.json.

With ``stall=1`` (fault injection by subclassing the shared-memory ring it reads) the consumer's
first read of a version from a producer's ring pins the slot, copies half of it (into the idle
replica's tensors, or a receive buffer), writes OUT/stalled and stops there, holding the pin,
until the test SIGKILLs it mid-transfer.
"""
import json
import logging
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepfreeze.errors import StreamTimeoutError  # noqa: E402
from deepfreeze.torch import Subscriber  # noqa: E402
from torch_stream_pub import CHANNEL, Net, inputs  # noqa: E402


def stalling_ring(outdir: str) -> type:
    from deepfreeze.stream import slots

    class StallingRing(slots.SlotRing):
        def read(self, version=None, out=None, *, verify=True):
            with self.pinned(version) as (ver, crc, view):  # the slot pinned, as a read holds it
                half = np.frombuffer(view, dtype=np.uint8)[:len(view) // 2].copy()  # noqa: F841 (copying)
                with open(os.path.join(outdir, f"stalled.{os.getpid()}.{ver.step}"), "w") as f:
                    f.write(str(ver.step))
                time.sleep(600)  # SIGKILLed here, the pin held
            raise AssertionError("not reached")

        def read_into(self, version, pieces, *, verify=True):
            # the copy straight into the idle replica's tensors: half of them written, the pin held
            with self.pinned(version) as (ver, crc, view):
                src = np.frombuffer(view, dtype=np.uint8)
                for off, dst in pieces[:len(pieces) // 2]:
                    dst[:] = src[off:off + dst.size]
                with open(os.path.join(outdir, f"stalled.{os.getpid()}.{ver.step}"), "w") as f:
                    f.write(str(ver.step))
                time.sleep(600)  # SIGKILLed here, the pin held
            raise AssertionError("not reached")

    return StallingRing


def main() -> None:
    out = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    if kw.get("stall") == "1":
        from deepfreeze.stream import slots
        slots.SlotRing = stalling_ring(out)  # the core Subscriber opens rings under this name
    until = int(kw["until"])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # into consumer.log
    torch.set_num_threads(1)
    x = inputs()
    steps, rows, outputs = [], [], []
    info = {}
    with Subscriber(Net().eval(), channel=CHANNEL, persistent=os.path.join(kw.get("pdir", out), "persistent"),
                    tier=kw.get("tier", "auto"), warn_after=60.0) as sub:
        sub.wait(0, timeout=180)
        deadline = time.monotonic() + 180
        i = 0
        while True:
            with sub.current() as m, torch.no_grad():
                row = i % len(x)
                y = m(x[row:row + 1])
                steps.append(m.step)
                rows.append(row)
                outputs.append(y.numpy()[0].copy())
            i += 1
            if steps[-1] > max(steps[:-1], default=-1):
                with open(os.path.join(out, "seen.tmp"), "w") as f:
                    f.write(str(steps[-1]))
                os.replace(os.path.join(out, "seen.tmp"), os.path.join(out, "seen"))
            if steps[-1] >= until:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"test: version {until} not served within 180 s (serving {steps[-1]})")
            time.sleep(0.002)
        if kw.get("dead") == "1":
            t0 = time.monotonic()
            try:
                sub.wait(None, timeout=3)
                info["after_death"] = "a newer version became live"
            except StreamTimeoutError as e:
                info["after_death"] = type(e).__name__
            info["waited_s"] = time.monotonic() - t0
            for row in range(len(x)):  # still serving, the last complete version
                with sub.current() as m, torch.no_grad():
                    steps.append(m.step)
                    rows.append(row)
                    outputs.append(m(x[row:row + 1]).numpy()[0].copy())
        info["tiers"] = sorted({u["tier"] for u in sub.updates})
        info["updates"] = [[u["version"].step, u["tier"]] for u in sub.updates]
    np.savez(os.path.join(out, "serve.npz"), steps=np.array(steps), rows=np.array(rows),
             outputs=np.stack(outputs))
    with open(os.path.join(out, "serve.json"), "w") as f:
        json.dump(info, f)


if __name__ == "__main__":
    main()
