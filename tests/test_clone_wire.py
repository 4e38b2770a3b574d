"""The clone wire's receiving side (:class:`deepfreeze.clone.wire.CloneListener`) against real
source-side :class:`~deepfreeze.clone.wire.Sender` instances over authenticated loopback TCP, one
thread per source rank; faults are injected by subclassing ``Sender`` (numpy only, no framework)."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from deepfreeze.clone.plan import ClonePlan
from deepfreeze.clone.relay import Forwarder
from deepfreeze.clone.wire import CloneListener, Sender
from deepfreeze.errors import CloneError, CloneTimeoutError, DeepFreezeError, ProviderError
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


def _relay_run(plan, listeners, senders, buffers, accept):
    """Every listener's receive (a thread each, with every listener as a peer) beside every
    sender's send; returns (receive outcomes, send outcomes): None or the error."""
    peers = [x.address for x in listeners]
    got: dict = {}
    sent: dict = {}

    def recv(j: int) -> None:
        try:
            listeners[j].receive(len(senders), accept(j), peers=peers)
            got[j] = None
        except DeepFreezeError as e:
            got[j] = e

    def send(r: int) -> None:
        try:
            senders[r].send(buffers, b"record%d" % r, {"step": 3})
            sent[r] = None
        except DeepFreezeError as e:
            sent[r] = e
    threads = [threading.Thread(target=recv, args=(j,), daemon=True) for j in range(len(listeners))]
    threads += [threading.Thread(target=send, args=(r,), daemon=True) for r in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a receive or a send did not end"
    return got, sent


def _relay_plan():
    specs = [TensorSpec(0, "big", "float32", (5000,)), TensorSpec(1, "mid", "int64", (700,)),
             TensorSpec(2, "small", "float64", (3,)), TensorSpec(3, "tiny", "uint8", (5,)),
             TensorSpec(4, "empty", "float32", (0,))]
    plan = ClonePlan(specs, 2, 3, threshold=256)
    rng = np.random.default_rng(5)
    buffers = {t.id: rng.integers(0, 256, t.size * np.dtype(t.dtype).itemsize, dtype=np.uint8) for t in specs}
    return plan, buffers


def test_relay_every_clone_rank_ends_with_every_tensor_in_its_own_buffers():
    """Issue 44, item 2 (numpy only): 2 source ranks -> 3 clone ranks; each route lands in the
    buffer the adapter gave (its final tensor) and is forwarded to the other clone ranks as it
    lands: every clone rank holds every tensor bit for bit in those very buffers, each byte
    received once per rank (from a source or from the clone rank that received it), and the
    sources sent every byte once in all."""
    plan, buffers = _relay_plan()
    listeners = [CloneListener(j, TOKEN, timeout=30.0) for j in range(3)]
    senders = [Sender(r, plan, [x.address for x in listeners], TOKEN, timeout=30.0) for r in range(2)]
    targets = {j: {t.id: np.zeros(t.size * np.dtype(t.dtype).itemsize, np.uint8) for t in plan.tensors}
               for j in range(3)}
    try:
        got, sent = _relay_run(plan, listeners, senders, buffers, lambda j: lambda p, h: targets[j])
        assert got == {0: None, 1: None, 2: None} and sent == {0: None, 1: None}, (got, sent)
        for j, lst in enumerate(listeners):
            for t in plan.tensors:
                assert lst.buffers[t.id] is targets[j][t.id], (j, t.name)  # landed in the given buffer
                assert lst.buffers[t.id].tobytes() == buffers[t.id].tobytes(), (j, t.name)
            assert lst.records == {0: b"record0", 1: b"record1"}, j
            assert lst.bytes_received + lst.bytes_relayed == plan.nbytes, j
            assert lst.bytes_forwarded == 2 * lst.bytes_received, j
        assert sum(x.bytes_received for x in listeners) == plan.nbytes == sum(s.bytes_sent for s in senders)
    finally:
        for s in senders:
            s.close()
        for x in listeners:
            x.finish(None)
            x.close()


class _DeadForwarder(Forwarder):
    """A clone rank whose forwarding dies after its first frame: its connection to the peer is
    cut, as a killed process's would be (fault injected by subclassing)."""

    def send_batch(self, ch, routes, views, deadline):
        super().send_batch(ch, routes, views, deadline)
        ch.shutdown()
        raise ProviderError("killed (test)")


def test_relay_a_clone_rank_that_dies_while_forwarding_is_named_by_the_others():
    """The other clone ranks' receives end at once (well within their timeout) with a CloneError
    naming the rank whose forwards stopped; no receive hangs."""
    plan, buffers = _relay_plan()
    listeners = [CloneListener(j, TOKEN, timeout=30.0, forwarder_cls=_DeadForwarder if j == 1 else Forwarder)
                 for j in range(3)]
    senders = [Sender(r, plan, [x.address for x in listeners], TOKEN, timeout=30.0) for r in range(2)]
    try:
        t0 = time.monotonic()
        got, _ = _relay_run(plan, listeners, senders, buffers, lambda j: lambda p, h: None)
        assert time.monotonic() - t0 < 25  # bounded: nothing waited for the timeout
        for j in (0, 2):
            assert isinstance(got[j], CloneError), got
            assert "clone rank 1" in str(got[j]), got[j]
        assert isinstance(got[1], CloneError), got
    finally:
        for s in senders:
            s.close()
        for x in listeners:
            x.close()
