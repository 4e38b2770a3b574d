"""The live capture's protocol (deepfreeze.torch.capture.LiveCapture, LiveSubscriber; issue 43 item 2).

One process, no network: a subscriber that records the calls it gets sees the documented call
order (``wants_live`` in every post-hook, ``on_live`` for a wanted step, ``on_release`` before the
next ``optimizer.step()`` changes a tensor, ``on_close`` once, last), a :class:`Live` whose
tensors are the live ones (no copy) and whose record is the Checkpointer's (the same
:class:`StateRecords`), taken with the Checkpointer's timing.
"""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch, CPU)")

from deepfreeze.errors import DeepFreezeError  # noqa: E402
from deepfreeze.torch import _loop, _state  # noqa: E402
from deepfreeze.torch.capture import Live, LiveCapture, StateRecords  # noqa: E402
from deepfreeze.torch.hook import sinks_of  # noqa: E402


class Recorder:
    """A LiveSubscriber that wants every ``every``-th step and logs every call."""

    def __init__(self, every: int) -> None:
        self.every, self.calls, self.lives = every, [], []
        self.params_at_release: list = []

    def wants_live(self, step: int) -> bool:
        self.calls.append(("wants", step))
        return step % self.every == 0

    def on_live(self, live: Live) -> None:
        self.calls.append(("live", live.step))
        self.lives.append(live)

    def on_release(self, live: Live) -> None:
        self.calls.append(("release", live.step))
        assert live.taken  # the record is taken before the tensors may change
        self.params_at_release.append(live.state.tensors[0].clone())

    def on_close(self) -> None:
        self.calls.append(("close",))


def _build():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    records = StateRecords(net, [opt], _state.statefuls({"sched": sched}), _loop.Passes(), rank=0, size=1,
                           sharded=False)
    return net, opt, sched, records


def _step(net, opt, sched) -> None:
    opt.zero_grad()
    net(torch.ones(4, 3)).sum().backward()
    opt.step()
    sched.step()


@pytest.mark.parametrize("boundary", [False, True])
def test_live_capture_call_order_live_tensors_and_record(boundary):
    net, opt, sched, records = _build()
    cap = LiveCapture(net, [opt], records=records)
    sub = Recorder(every=2)
    cap.subscribe(sub)
    assert cap in sinks_of(net)
    lrs = []
    for _ in range(4):
        _step(net, opt, sched)
        lrs.append(opt.param_groups[0]["lr"])
        if boundary:
            cap.end_iteration()
        if cap.live is not None:
            assert cap.live.state.tensors[0] is net.weight  # the live tensor, no copy
            assert cap.live.at_boundary == boundary and cap.live.taken == boundary
    assert cap.step == 4
    assert sub.calls == [("wants", 1), ("wants", 2), ("live", 2), ("release", 2), ("wants", 3), ("wants", 4),
                         ("live", 4)]
    live = cap.live
    assert live is sub.lives[-1]
    got: list = []
    reader = threading.Thread(target=lambda: got.append(live.record(30.0)))  # the record, from another thread
    reader.start()
    cap.release()  # (the owner's wait()): the record is taken, the holder releases
    reader.join(30)
    assert sub.calls[-1] == ("release", 4) and cap.live is None and live.taken
    rec = _state.decode_record(got[0])
    assert rec["a"]["world_size"] == 1 and rec["a"]["optimizers"] == ["torch.optim.sgd.SGD"]
    # part "b" after the loop's scheduler.step(): the step's learning rate as the loop left it
    assert rec["param_groups"][0][0]["lr"] == lrs[3] and rec["state"]["sched"]["last_epoch"] == 4
    # the live tensors of step 2 were held until the pre-hook of step 3: the values of step 2
    assert not torch.equal(sub.params_at_release[0], net.weight.detach())
    cap.close()
    assert sub.calls[-1] == ("close",) and cap not in sinks_of(net) and cap.subscribers == []


def test_live_record_waits_for_the_next_forward_and_unsubscribe():
    net, opt, sched, records = _build()
    cap = LiveCapture(net, [opt], records=records)
    sub = Recorder(every=1)
    cap.subscribe(sub)
    _step(net, opt, sched)
    assert cap.live.record(0.01) is None  # not taken yet: the loop has not reached its next forward
    net(torch.ones(1, 3))  # the next forward's pre-hook takes part "b"
    assert cap.live.taken and cap.live.record(0.0)
    cap.unsubscribe(sub)  # the lent state is released first, then on_close
    assert sub.calls[-2:] == [("release", 1), ("close",)]
    cap.close()
    assert sinks_of(net) == []


class Unencodable:
    def state_dict(self):
        return {"x": object()}

    def load_state_dict(self, sd):
        pass


def test_live_record_that_cannot_be_encoded_raises_its_error():
    net, opt, sched, _ = _build()
    records = StateRecords(net, [opt], _state.statefuls({"bad": Unencodable()}), _loop.Passes(), rank=0, size=1,
                           sharded=False)
    cap = LiveCapture(net, [opt], records=records)
    sub = Recorder(every=1)
    cap.subscribe(sub)
    _step(net, opt, sched)  # part "a" holds the state= object: it fails in the post-hook
    live = cap.live
    assert live.taken and isinstance(live.error, DeepFreezeError)
    with pytest.raises(DeepFreezeError):
        live.record(0.0)
    cap.close()
