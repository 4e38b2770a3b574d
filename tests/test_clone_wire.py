"""The clone wire's receiving side (:class:`deepfreeze.clone.wire.CloneListener`) against real
source-side :class:`~deepfreeze.clone.wire.Sender` instances over authenticated loopback TCP, one
thread per source rank; faults are injected by subclassing ``Sender`` (numpy only, no framework)."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from deepfreeze.clone.plan import ClonePlan
from deepfreeze.clone.wire import CloneListener, Sender
from deepfreeze.errors import CloneTimeoutError, DeepFreezeError
from deepfreeze.shardplan import TensorSpec

TOKEN = "w" * 64


class HeldRecordSender(Sender):
    """A source rank that sends every route, then waits for ``release`` before its state record:
    the source takes the record at its next step, which a stuck rank of the source job holds up."""

    def __init__(self, *args, release: threading.Event, **kw) -> None:
        super().__init__(*args, **kw)
        self.release = release

    def send(self, buffers, record, header) -> None:
        def held() -> bytes:
            self.release.wait(30)
            return b"record"
        super().send(buffers, held, header)


def test_clone_timeout_names_only_the_source_ranks_whose_sends_did_not_complete():
    """Issue 41, item 6: of 3 source ranks, rank 0 sends everything, rank 1 every tensor but not
    its record (held), rank 2 never connects: the timeout names rank 2 as not having sent its
    tensors, rank 1 as missing only its record and end, and not rank 0. Before: "source rank(s)
    [1, 2] did not connect or finish sending", and a rank that finished just before the deadline
    could be listed too."""
    plan = ClonePlan([TensorSpec(0, "a", "float32", (1024,)), TensorSpec(1, "b", "float32", (8,))], 3, 1,
                     threshold=64)
    buffers = {t.id: np.arange(t.size * 4, dtype=np.uint64).astype(np.uint8) for t in plan.tensors}
    header = {"step": 3}
    release = threading.Event()
    listener = CloneListener(0, TOKEN, timeout=4.0)
    senders = [Sender(0, plan, [listener.address], TOKEN, timeout=30.0),
               HeldRecordSender(1, plan, [listener.address], TOKEN, timeout=30.0, release=release)]
    outcome: dict[int, BaseException | None] = {}

    def run(r: int) -> None:
        try:
            senders[r].send(buffers, b"record", header)
            outcome[r] = None
        except DeepFreezeError as e:  # rank 1, once the receiver gave up
            outcome[r] = e
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    try:
        with pytest.raises(CloneTimeoutError) as e:
            listener.receive(3, lambda p, h: None)
    finally:
        release.set()
        for t in threads:
            t.join(30)
        for s in senders:
            s.close()
        listener.close()
    msg = str(e.value)
    assert "within timeout=4 s" in msg and "nothing was loaded" in msg, msg
    assert re.search(r"source rank\(s\) \[2\] did not finish sending their tensors \(no hello from \[2\]\)", msg), msg
    assert "source rank(s) [1] sent every tensor but not their state record and end" in msg, msg
    assert not re.search(r"\[0[],]|, 0[],]", msg), msg  # rank 0 finished: never named
    assert outcome[0] is None, outcome
