"""Producer of the torch stream tests: one rank of ``torchrun`` (gloo, DDP) or a plain process.

    torchrun --standalone --nproc-per-node 2 tests/workers/torch_stream_pub.py OUT [key=value ...]

keys: steps (optimizer steps), every (publish every n steps), sync_at=STEP[,STEP...] (rank 0 waits,
bounded, until the consumer reports having served version STEP: OUT/seen holds the newest step it
served; the other rank waits in a barrier), watch=DIR[,DIR...] (the consumers' output directories
sync_at waits on, each DIR/seen; default OUT), gate_at=STEP[,STEP...] (rank 0 waits, bounded,
for the file OUT/gate<STEP> the test writes; the other rank in a barrier),
kill_at=STEP (rank 1 SIGKILLs itself right after publishing STEP, once the consumer served it),
die_mid=STEP (rank 1 dies by SIGKILL in the middle of copying STEP into its shared-memory slot:
after the slot was marked as being written, before its record is complete; injected by
subclassing the ring; a Checkpointer without a schedule runs beside the Publisher, so STEP is
never written to persistent: only the stream could deliver it),
shm_dir (the producer's rings), ck=N (a deepfreeze.torch.Checkpointer checkpointing every N steps
runs, and the Publisher rides on it: Publisher(..., checkpointer=ck)), tcp=1 (listen on
loopback TCP as well: StreamOptions(port=0) is the default; kept for the consumers' tier=tcp),
fsdp=1 (FSDP2 instead of DDP: ``fully_shard`` on each submodule, then the root, on a 1-D CPU mesh
of every rank; each rank publishes its local rows of every parameter).

Per rank it writes (numpy .npz, no pickles), right after each published step's optimizer.step():
  OUT/r<rank>/v<step>.npz   the module's state dict (FQNs without DDP's prefix; under fsdp=1 the
                            full state gathered with get_model_state_dict(full_state_dict=True))
  OUT/r<rank>/o<step>.npz   the optimizer's state tensors as optim.state.<fqn>.<key> (with ck=N)
  OUT/r<rank>/info.json     published versions, coalesced, step, captures (how many the Checkpointer took),
                            torn (versions not published: a tensor changed during their copy)
"""
import json
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from deepfreeze.stream import StreamOptions  # noqa: E402
from deepfreeze.torch import Checkpointer, Publisher  # noqa: E402

CHANNEL = "tstream"


class Net(torch.nn.Module):
    """A small hand-written model: two linear layers and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def inputs(n: int = 6) -> torch.Tensor:
    """The consumer's requests (the same in every process)."""
    g = torch.Generator().manual_seed(99)
    return torch.randn(n, 8, generator=g)


def save_state(net: torch.nn.Module, path: str, sharded: bool = False) -> None:
    """The module's full state dict (``sharded``: FSDP2, gathered by get_model_state_dict: collective)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    else:
        sd = net.state_dict()
    np.savez(path, **{k: v.detach().numpy().copy() for k, v in sd.items()})


def save_optim(net: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    """The optimizer's state tensors keyed as deepfreeze.torch.load names them."""
    fqn = {id(p): n for n, p in net.named_parameters()}
    np.savez(path, **{f"optim.state.{fqn[id(p)]}.{k}": v.detach().numpy().copy()
                      for p, st in opt.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)})


def seen(out: str) -> int:
    try:
        with open(os.path.join(out, "seen")) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def wait_seen(out: str, step: int, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while seen(out) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"test: the consumer did not serve version {step} within {limit} s")
        time.sleep(0.05)


def wait_file(path: str, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"test: {path} did not appear within {limit} s")
        time.sleep(0.05)


def dying_ring(step: int, out: str) -> type:
    """Fault injection: this rank dies by SIGKILL in the middle of copying ``step`` into its slot
    (after a chunk of its bytes was copied into a slot marked as being written, before the slot's
    record is complete; OUT/died_mid<step> holds the bytes copied / the total, written first)."""
    from deepfreeze.stream import slots

    class DyingRing(slots.SlotRing):
        def write_with(self, version, nbytes, fill):  # (write() goes through it too)
            self._dying = version.step == step
            return super().write_with(version, nbytes, fill)

        def _copied(self, slot, done, total):
            if getattr(self, "_dying", False):
                with open(os.path.join(out, f"died_mid{step}"), "w") as f:
                    f.write(f"{done}/{total}")
                os.kill(os.getpid(), signal.SIGKILL)

    return DyingRing


def main() -> None:
    out = sys.argv[1]
    kw = dict(a.split("=", 1) for a in sys.argv[2:])
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    if kw.get("die_mid") and rank == 1:
        from deepfreeze.stream import slots
        slots.SlotRing = dying_ring(int(kw["die_mid"]), out)  # the core Publisher makes its ring from this name
    torch.set_num_threads(1)
    torch.manual_seed(5)  # the same initial weights on every rank
    net = Net()
    fsdp = kw.get("fsdp") == "1"
    if fsdp:  # FSDP2: parameters become DTensors sharded by rows (fc2.weight: 3 rows, 2 + 1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in (net.fc1, net.norm, net.fc2):
            fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
        model = net
    else:
        model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    every = int(kw.get("every", 1))
    mydir = os.path.join(out, f"r{rank}")
    os.makedirs(mydir, exist_ok=True)
    dirs = dict(overwrite=True, mode="async", scratch=os.path.join(out, f"scratch{rank}"),
                persistent=os.path.join(out, "persistent"),
                min_shard_bytes=256)  # a small model, still split across the ranks
    stream = StreamOptions(shm_dir=kw["shm_dir"]) if kw.get("shm_dir") else None
    ck_every, die_mid = int(kw.get("ck", 0)), int(kw.get("die_mid", -1))
    ck = None
    if ck_every or die_mid >= 0:  # a Checkpointer runs; the Publisher rides on it (its run, its fallback tier)
        ck = Checkpointer(model, opt, name=CHANNEL, every_n_steps=ck_every or None, **dirs)
        pub = Publisher(model, opt, checkpointer=ck, schedule=every, stream=stream)
    else:
        pub = Publisher(model, opt, channel=CHANNEL, schedule=every, stream=stream, **dirs)
    g = torch.Generator().manual_seed(1000 + rank)
    steps, kill_at = int(kw.get("steps", 10)), int(kw.get("kill_at", -1))
    sync_at = {int(s) for s in kw.get("sync_at", "").split(",") if s}
    gate_at = {int(s) for s in kw.get("gate_at", "").split(",") if s}
    watch = [d for d in kw.get("watch", out).split(",") if d]
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if pub.step % every == 0 or (ck_every and pub.step % ck_every == 0):
            save_state(net, os.path.join(mydir, f"v{pub.step}.npz"), fsdp)  # what version pub.step holds
            if ck_every:
                save_optim(net, opt, os.path.join(mydir, f"o{pub.step}.npz"))
        pub.end_iteration()  # publishes the step's version now
        if pub.step in sync_at or pub.step in gate_at or pub.step == kill_at:
            if rank == 0 and pub.step in gate_at:
                wait_file(os.path.join(out, f"gate{pub.step}"))
            elif rank == 0:
                for d in watch:
                    wait_seen(d, pub.step)
            if distributed:
                dist.barrier()
            if pub.step == kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
    prefix = pub.publisher.prefix  # bytes of this rank's share of each version
    pub.close()
    owner = pub.checkpointer
    info = {"published": [v.step for v in pub.published], "coalesced": pub.coalesced, "step": pub.step,
            "torn": pub.torn, "stalls": pub.publish_timings,
            "prefix": prefix, "captures": len(owner.timings),
            "sinks": len(owner.hook.sinks), "owner_open_after_publisher": not owner._closed}
    if ck is not None:
        ck.close()
    with open(os.path.join(mydir, "info.json"), "w") as f:
        json.dump(info, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
