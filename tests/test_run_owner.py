"""Issue 33, item 2: one owner of a run. :class:`deepfreeze.run.Run` checks the arguments both
adapters take (one wording each), applies ``on_error``, owns the engine, the lease check before a
hand-off, ``wait``/``close`` and the exit hand-off; the torch Checkpointer gained the checks only the
Keras callback made (``scratch_cls``, ``trust_owners``) and Keras gained the exit hand-off.

Plain-process tests (one rank); the exit tests run a real interpreter to its exit.
"""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from _util import WORKERS
from deepfreeze.errors import CheckpointWriteError, ConfigError, DeepFreezeError
from deepfreeze.tiers.scratch import ScratchLevel
from deepfreeze.run import Run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def where(d) -> dict:
    return {"mode": "sync", "scratch": str(d / "s"), "persistent": str(d / "p")}


#: bad arguments both adapters take, and a piece of the one message each gets
BAD = [({"on_error": "ignore"}, "on_error = 'ignore'"),
       ({"scratch_cls": dict}, "scratch_cls must be a subclass of deepfreeze.tiers.scratch.ScratchLevel"),
       ({"scratch_cls": ScratchLevel(".")}, "scratch_cls must be a subclass"),
       ({"trust_owners": ["no-such-user-df33"]}, "no user named 'no-such-user-df33'"),
       ({"trust_owners": [1.5]}, "1.5 is neither a user name nor a uid"),
       ({"resume": True, "overwrite": True}, "contradict each other: resume continues the name's newest version"),
       ({"lease_wait": -1}, "lease_wait = -1 must be >= 0"),
       ({"engine": "nope"}, "engine = 'nope'")]


@pytest.mark.parametrize("kw,what", BAD, ids=[f"{next(iter(k))}-{i}" for i, (k, _) in enumerate(BAD)])
def test_run_checks_arguments_before_anything_is_written(tmp_path, kw, what):
    with pytest.raises(ConfigError, match=re.escape(what)):
        Run(None, "x", **where(tmp_path), **kw)
    assert not os.listdir(tmp_path)


def test_guard_applies_on_error(tmp_path):
    def fail() -> None:
        raise CheckpointWriteError(errno.ENOSPC, "disk full (injected)")
    warn = Run(None, "x", on_error="warn", **where(tmp_path))
    assert warn.guard(fail) is False and warn.guard(lambda: None) is True
    assert warn.failures == ["[Errno 28] disk full (injected)"]
    strict = Run(None, "x", **where(tmp_path))
    cleaned = []
    strict.before_raise = lambda: cleaned.append(True)
    with pytest.raises(CheckpointWriteError, match="disk full"):
        strict.guard(fail)
    assert cleaned == [True] and strict.failures == []
    with pytest.raises(ValueError):  # not a DeepFreezeError: never swallowed, whatever on_error says
        warn.guard(int, "x")


def test_run_owns_engine_and_lease(tmp_path):
    """begin -> new_engine -> hand_off -> close: the engine numbers on from last_version across a new
    plan, close() ends both the engine and the lease; a run can begin again after close."""
    import numpy as np

    from deepfreeze import list_versions
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    run = Run(None, "x", **where(tmp_path))
    run.begin()
    assert run.begun and run.lease is not None
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", (4,))], 1)
    run.new_engine(plan)
    a = np.arange(4, dtype=np.float32)
    assert run.hand_off(3, [a], step=3, epoch=0, extra={})
    run.last_version = 3
    first = run.engine
    run.new_engine(ShardPlan.build([TensorSpec(0, "w", "float32", (8,))], 1))
    assert run.engine is not first and run.engine.last_version == 3
    with pytest.raises(DeepFreezeError):  # versions keep growing within the run, through the new engine
        run.engine.checkpoint(2, [np.zeros(8, np.float32)], step=2, epoch=0, extra={})
    run.close()
    assert run.engine is None and run.lease is None and not run.begun
    assert sorted(list_versions(run.config, "x")) == [3]
    again = Run(None, "x", resume=True, **where(tmp_path))
    again.begin()  # the lease was released
    again.close()


def test_exit_hand_off_says_flushed_only_for_a_version_this_rank_saw_committed(tmp_path, caplog):
    """Issue 41, item 6: rank 0 of a 2-rank job hands v4 off at exit, its peer never does (killed
    5 ms into the hand-off): rank 0's part is flushed, v4 is not committed. The exit hand-off says
    so (this rank's part flushed; committed only if every rank's part was), not "v4 was handed
    off and flushed". A version this rank sees committed (v2: both ranks' parts) is "flushed at
    exit (committed)". Before: "v4 was handed off and flushed at exit" for the version the next
    resume retired."""
    import numpy as np

    from deepfreeze import Config, list_versions
    from deepfreeze.engine import Engine
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    plan = ShardPlan.build([TensorSpec(0, "w", "float32", (4096,))], 2, min_shard_bytes=1024)
    assert all(plan.for_rank(r) for r in (0, 1))

    def part(r: int, v: int) -> list:
        return [np.full(p.stop - p.start, v, np.float32) for p in plan.for_rank(r)]
    run = Run(None, "x", rank=0, size=2, **where(tmp_path))  # rank 0 of two (rank 1: an engine of its own)
    run.begin()
    run.new_engine(plan)
    peer = Engine(Config.resolve(None, **where(tmp_path)), "x", 1, plan, run=run.info)
    assert run.hand_off(2, part(0, 2), step=2, epoch=0, extra={})
    peer.checkpoint(2, part(1, 2), step=2, epoch=0, extra={})
    peer.close()
    assert run.hand_off(4, part(0, 4), step=4, epoch=0, extra={})  # the peer's part of v4 never comes
    caplog.set_level("WARNING", logger="deepfreeze")
    run.close_at_exit(lambda: None, 30.0, who="Checkpointer.close()", pending=2, hint="ckpt.close()")
    assert "'x': Checkpointer.close() was not called: v2 was handed off and flushed at exit (committed)" in caplog.text
    caplog.clear()
    run.close_at_exit(run.close, 30.0, who="Checkpointer.close()", pending=4, hint="ckpt.close()")
    assert "not called: v4 was handed off" not in caplog.text, caplog.text
    assert ("(rank 0): 'x': Checkpointer.close() was not called: this rank's part of v4 was handed off and flushed at "
            "exit, but this rank did not see v4 committed: it is committed only if every rank's part was flushed"
            in caplog.text), caplog.text
    assert sorted(list_versions(run.config, "x")) == [2]


# ---------------------------------------------------------------------------- torch
def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


@pytest.mark.parametrize("kw,what", BAD, ids=[f"{next(iter(k))}-{i}" for i, (k, _) in enumerate(BAD)])
def test_torch_checkpointer_makes_the_same_checks(tmp_path, kw, what):
    """The torch adapter used to skip scratch_cls and trust_owners (and worded others its own way)."""
    torch = _torch()
    from deepfreeze.torch import Checkpointer
    net = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError) as want:
        Run(None, "x", **where(tmp_path), **kw)
    with pytest.raises(ConfigError) as got:
        Checkpointer(net, torch.optim.SGD(net.parameters(), lr=0.1), name="x", **where(tmp_path), **kw)
    assert str(got.value) == str(want.value)
    assert not os.listdir(tmp_path)


class FullFrom4(ScratchLevel):
    """The node-local disk is full from step 4 on (fault injected by subclassing)."""

    def write_shard(self, name, version, rank, plan, arrays, **kw):
        if version >= 4:
            raise CheckpointWriteError(errno.ENOSPC, f"No space left on device writing v{version} (injected)")
        return super().write_shard(name, version, rank, plan, arrays, **kw)


@pytest.mark.parametrize("on_error", ["warn", "raise"])
@pytest.mark.scratch_files("the failure is injected in the scratch write (scratch_cls)")
def test_torch_scratch_cls_and_on_error(tmp_path, on_error):
    torch = _torch()
    from deepfreeze import list_versions
    from deepfreeze.torch import Checkpointer
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ck = Checkpointer(net, opt, name="f", every_n_steps=2, on_error=on_error, scratch_cls=FullFrom4,
                      trust_owners="root", **where(tmp_path))
    assert ck.scratch_cls is FullFrom4 and ck.trust_owners == ["root"] and ck.on_error == on_error
    raised = None
    for _ in range(6):
        net(torch.ones(2, 3)).sum().backward()
        try:
            opt.step()
        except CheckpointWriteError as e:
            raised = e
            break
    try:
        ck.close()
    except DeepFreezeError:
        pass
    if on_error == "warn":
        assert raised is None and ck.failures and all("(injected)" in f for f in ck.failures), ck.failures
    else:
        assert raised is not None and "v4" in str(raised) and ck.failures == []
    assert sorted(list_versions(ck.config, "f")) == [2]  # nothing partial


# ---------------------------------------------------------------------------- the exit hand-off
RUN_AT_EXIT = """
import multiprocessing, os, sys
from deepfreeze.run import Run

out = sys.argv[1]

class Owner:
    def __init__(self, tag):
        self.tag = tag

    def at_exit(self):
        with open(os.path.join(out, f"{self.tag}.{os.getpid()}"), "w") as f:
            f.write("called")

run = Run(None, "x", mode="sync", scratch=os.path.join(out, "s"), persistent=os.path.join(out, "p"))
kept, dropped = Owner("kept"), Owner("dropped")
run.at_exit(kept.at_exit)
run.at_exit(dropped.at_exit)
del dropped  # held weakly: gone, never called
child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
child.start()
child.join()
print(os.getpid())
"""


def test_run_at_exit_calls_once_in_the_process_that_registered(tmp_path):
    p = subprocess.run([sys.executable, "-c", RUN_AT_EXIT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    pid = p.stdout.split()[-1]
    assert sorted(f for f in os.listdir(tmp_path) if "." in f) == [f"kept.{pid}"]  # not in the forked child


KERAS_EXIT = """
import atexit, json, os, sys
sys.path.insert(0, sys.argv[2])
out = sys.argv[1]
state = {}

def report():  # registered before the run's lease handler: runs after it and after threading's exit hooks
    ck = state["ck"]
    with open(os.path.join(out, "at_atexit.json"), "w") as f:
        json.dump({"engine_closed": ck.engine is None, "run_id": ck.run_id, "last": ck.last_version}, f)

atexit.register(report)
import numpy as np
from deepfreeze.keras import DeepFreezeCheckpoint
from models import build

model = build()
model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
ck = state["ck"] = DeepFreezeCheckpoint(name="k", every_n_batches=2, at_epoch_end=False, mode="async",
                                        scratch=os.path.join(out, "s"), persistent=os.path.join(out, "p"))
r = np.random.default_rng(0)
x, y = r.random((96, 12, 12, 1), dtype=np.float32), r.integers(0, 10, 96)
model.fit(x, y, batch_size=16, epochs=1, callbacks=[ck], verbose=0)
assert ck.engine is not None and ck.run_id is not None  # not closed by the script
"""


def test_keras_callback_not_closed_is_closed_at_exit(tmp_path):
    """Keras gained the exit hand-off: by the time atexit handlers run, a callback the script never
    closed is closed (its flushes waited for, engine and lease released), and its newest version is
    on persistent."""
    pytest.importorskip("tensorflow")
    from deepfreeze import list_versions
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(KERAS_EXIT), str(tmp_path), WORKERS],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    assert p.returncode == 0, p.stderr[-3000:]
    with open(tmp_path / "at_atexit.json") as f:
        seen = json.load(f)
    assert seen == {"engine_closed": True, "run_id": None, "last": 6}, seen
    assert "was not called" not in p.stderr, p.stderr[-2000:]  # closed cleanly: nothing to report
    from deepfreeze import Config
    got = list_versions(Config.resolve(None, mode="async", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p")),
                        "k")
    assert {v: "persistent" in where_ for v, where_ in got.items()} == {2: True, 4: True, 6: True}, got


# ---------------------------------------------------------------------------- one torch capture, many sinks
def test_torch_step_hook_shared_by_sinks(tmp_path):
    """Two checkpointers of one model and optimizer (two names) and a third sink share one set of
    torch hooks; both names get the same bit-exact versions; the hooks go with the last sink."""
    torch = _torch()
    from deepfreeze.torch import Checkpointer, load
    from deepfreeze.torch.hook import Sink, hook_for

    class Steps(Sink):
        def __init__(self) -> None:
            self.n = 0

        def after_step(self, optimizer) -> None:
            self.n += 1

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    a = Checkpointer(net, opt, name="a", every_n_steps=2, **where(tmp_path))
    b = Checkpointer(net, opt, name="b", every_n_steps=2, **where(tmp_path))
    steps = Steps()
    hook = hook_for(net, [opt])
    hook.subscribe(steps)
    assert a.hook is b.hook is hook and hook.sinks == [a, b, steps]
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert len(net._forward_pre_hooks) == 1
    want = {}
    for i in range(4):
        net(torch.ones(2, 3) * i).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    assert steps.n == 4 and a.step == b.step == 4
    a.close()
    b.close()
    assert hook.sinks == [steps] and len(opt._optimizer_step_pre_hooks) == 1
    hook.unsubscribe(steps)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks and not net._forward_pre_hooks
    assert hook_for(net, [opt]) is not hook  # a new one once the last sink left
    for name in ("a", "b"):
        got = load(name=name, version=4, **where(tmp_path))
        for k, v in want.items():
            assert got[k].numpy().tobytes() == v.numpy().tobytes(), (name, k)
