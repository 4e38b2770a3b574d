"""Cross-rank error records over a real communicator (tests/test_errors_xrank.py).

    errors_xrank.py torch OUT    under torchrun (TorchComm: DeepFreeze's gloo group)
    errors_xrank.py mpi OUT      under mpirun (MPIComm)

Three rounds of :func:`deepfreeze.comm.allgather_failures` on every rank: nobody failed; rank 0
and rank 1 failed with typed errors carrying fields; rank 0 failed with an OSError-based error
while rank 1 is a faulty peer whose communicator sends junk instead of a record (injected by
subclassing the communicator). Each rank writes what it decoded to OUT/r<rank>.json.
"""
import json
import os
import sys

from deepfreeze.comm import allgather_failures
from deepfreeze.errors import ChangedInPlaceError, CheckpointWriteError, PeerClosedError

JUNK = b'{"type": "ChangedInPlaceError", "message": "x", "fields": {"count": {"nested": [1, 2]}}}'


def faulty(base: type) -> type:
    """``base`` whose ``allgather`` sends :data:`JUNK` while ``junk`` is set (a broken or hostile peer)."""
    class Faulty(base):
        junk = False

        def allgather(self, data: bytes) -> list:
            return super().allgather(JUNK if self.junk else data)
    return Faulty


def described(failures: dict) -> dict:
    return {str(r): {"type": type(e).__name__, "message": str(e), "sender_type": e.sender_type,
                     "fields": {k: getattr(e, k) for k in type(e).record_fields},
                     "errno": getattr(e, "errno", None), "classes": [c.__name__ for c in type(e).__mro__]}
            for r, e in failures.items()}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    if kind == "torch":
        import torch.distributed as dist
        from deepfreeze.torch import TorchComm
        dist.init_process_group("gloo")
        comm = faulty(TorchComm)(timeout=120)
    else:
        from deepfreeze.comm import MPIComm
        comm = faulty(MPIComm)()
    r = comm.rank
    rounds = [described(allgather_failures(comm, None))]
    mine = (ChangedInPlaceError(f"rank {r}: 2 tensor(s) changed in place", count=2, first="fc.weight") if r == 0 else
            PeerClosedError(f"rank {r}: closed (0 of 24 bytes)", received=0, expected=24, between_messages=True)
            if r == 1 else None)
    rounds.append(described(allgather_failures(comm, mine)))
    comm.junk = r == 1
    mine = CheckpointWriteError(28, "checkpoint 'x' v3 failed: No space left on device") if r == 0 else None
    rounds.append(described(allgather_failures(comm, mine)))
    comm.junk = False
    with open(os.path.join(out, f"r{r}.json"), "w") as f:
        json.dump({"size": comm.size, "rounds": rounds}, f)
    comm.close()
    if kind == "torch":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
