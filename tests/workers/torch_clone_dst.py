"""Clone job of the torch clone tests: ``torchrun`` (gloo) of any size, or a plain process.

    torchrun --standalone --nproc-per-node M tests/workers/torch_clone_dst.py OUT TAG [continue=N] [hidden=H]
        [fuse_bytes=B] [timeout=S] [die_forwarding=R] [optim=sgd]
        [warm=1]

Waits for OUT/address, takes a clone (deepfreeze.torch.clone.receive) into a model initialised
differently, writes OUT/TAG/got_r<rank>.npz (the received state, :func:`flat_state`), then with
``continue=N`` trains N more steps on the source's batches from the clone's position, writing
OUT/TAG/s<step>_r<rank>.npz after each. OUT/TAG/result_r<rank>.json: the CloneInfo (with the
byte counts of its timings and ``model_moved``: whether every model tensor now lives elsewhere:
in the tensor the clone received it into),
or the error (type, message, seconds) when the clone failed. ``die_forwarding=R``: clone rank R's
forwards to the other clone ranks end the process after its first forward frame (a clone rank
killed while forwarding chunks). ``optim=sgd``: another optimizer than the source's (the error
result says whether the model, optimizer and scheduler are ``unchanged``). ``warm=1``: one
training step before the clone (the optimizer holds state: ``optim_before`` lists it).
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_clone_src import batches, build, flat_state, train_step  # noqa: E402

from deepfreeze.clone.relay import Forwarder  # noqa: E402
from deepfreeze.torch import clone  # noqa: E402


class DyingForwarder(Forwarder):
    """A clone rank that dies right after its first forward frame (fault injected by subclassing)."""

    def send_batch(self, ch, routes, views, deadline):
        super().send_batch(ch, routes, views, deadline)
        os._exit(3)


def pointers(net, opt) -> dict:
    """Where every model tensor and optimizer state tensor lives (data_ptr by name)."""
    out = {f"m/{k}": v.data_ptr() for k, v in net.state_dict(keep_vars=True).items()}
    for i, p in enumerate(opt.param_groups[0]["params"]):
        out.update({f"o/{i}/{k}": v.data_ptr() for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v)})
    return out


def main() -> None:
    out, tag = sys.argv[1], sys.argv[2]
    kv = dict(a.split("=", 1) for a in sys.argv[3:])
    steps = int(kv.get("continue", 0))
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    d = os.path.join(out, tag)
    os.makedirs(d, exist_ok=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "address")) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(os.path.join(out, "address")) as f:
        address = f.read().strip()
    # another init: everything must come from the source (hidden=N: another architecture)
    net, model, opt, sched = build(12345, world, int(kv.get("hidden", 64)))
    if kv.get("optim") == "sgd":  # another optimizer: refused at the hello, before a byte lands
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    if kv.get("warm") == "1":  # a job that trained a step: the optimizer holds state the clone lands in
        train_step(model, opt, sched, *batches(100 + rank, 1)[0])
    t0 = time.monotonic()
    before = pointers(net, opt)
    initial = flat_state(net, opt, sched)
    dying = kv.get("die_forwarding") == str(rank)
    try:
        info = clone.receive(model, opt, address, state={"sched": sched}, timeout=float(kv.get("timeout", 30)),
                             **({"fuse_bytes": int(kv["fuse_bytes"])} if "fuse_bytes" in kv else {}),  # (deprecated)
                             **({"forwarder_cls": DyingForwarder} if dying else {}))
    except Exception as e:
        with open(os.path.join(d, f"result_r{rank}.json"), "w") as f:
            now = flat_state(net, opt, sched)
            json.dump({"error_type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - t0,
                       "chain": [type(c).__name__ for c in (e.__cause__,) if c is not None],
                       "unchanged": sorted(now) == sorted(initial) and all(
                           now[k].tobytes() == initial[k].tobytes() for k in now)}, f)
        return
    np.savez(os.path.join(d, f"got_r{rank}.npz"), **flat_state(net, opt, sched))
    data = batches(rank, info.epoch_step + steps) if steps else []
    for k in range(steps):
        x, y = data[info.epoch_step + k]
        train_step(model, opt, sched, x, y)
        np.savez(os.path.join(d, f"s{info.step + k + 1}_r{rank}.npz"), **flat_state(net, opt, sched))
    with open(os.path.join(d, f"result_r{rank}.json"), "w") as f:
        after = pointers(net, opt)
        # the model's tensors are those the bytes landed in (not copied into the old memory)
        json.dump({"step": info.step, "epoch": info.epoch, "epoch_step": info.epoch_step,
                   "seconds": time.monotonic() - t0, "bytes": info.timings.get("bytes_received"),
                   "timings": {k: v for k, v in info.timings.items() if k.startswith(("bytes_", "state_"))},
                   "model_moved": all(after[k] != v for k, v in before.items() if k.startswith("m/")),
                   "optim_before": sorted(k for k in before if k.startswith("o/"))}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
