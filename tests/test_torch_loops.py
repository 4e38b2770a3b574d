"""Resume matches the uninterrupted run for the loops users write (tests/workers/torch_loops.py).

Each shape: an uninterrupted 2-rank torchrun job, then a job whose rank 1 SIGKILLs itself
mid-run, relaunched with ``resume=True``; every leaf of the final state (model, optimizers,
schedulers, GradScaler, RNG states of torch/numpy/Python, the loop's counters) of each rank must
equal the uninterrupted run's, bit for bit.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import WORKERS, as_in_a_test  # noqa: E402
from test_torch import npz, torchrun  # noqa: E402

LOOPS = os.path.join(WORKERS, "torch_loops.py")

# shape -> (every_n_steps, iterations, kill rank 1 when this many iterations are done)
SHAPES = {
    "end": (3, 16, 11),       # position advanced at the end of the iteration, end_iteration()
    "dl": (3, 16, 11),        # iterate(DataLoader + DistributedSampler, 2 workers, random transforms)
    "sdl": (3, 16, 11),       # iterate(StatefulDataLoader, 2 workers, transforms from the dataset's state)
    "accum": (2, 24, 19),     # gradient accumulation, GradScaler skips, OneCycleLR
    "plateau": (4, 16, 10),   # checkpoint on an epoch's last step, validation + ReduceLROnPlateau after it
    "end_hooks": (3, 16, 11),  # the 'end' loop without end_iteration(): the hooks' timing
    "fsdp": (3, 16, 11),      # FSDP2, the 'end' loop
    "closure": (3, 16, 11),   # the 'end' loop, optimizer.step(closure) runs forward and backward
}
FAST = ["end", "dl", "sdl", "accum", "plateau"]
SLOW = ["fsdp", "end_hooks", "closure"]  # (the closure path runs in make test under Lightning)


def _args(shape: str) -> list[str]:
    every, steps, _ = SHAPES[shape]
    return [f"every_{shape}={every}", f"steps_{shape}={steps}"]


def _info(out: str, shape: str, rank: int) -> dict:
    with open(os.path.join(out, shape, f"r{rank}", "info.json")) as f:
        return json.load(f)


def _differ(got: str, want: str) -> list[str]:
    a, b = npz(got), npz(want)
    assert set(a) == set(b), f"leaves differ: {sorted(set(a) ^ set(b))[:5]}"
    return [k for k in sorted(b) if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or a[k].tobytes() != b[k].tobytes()]


def _kill_and_resume(out: str, shape: str) -> dict:
    _, _, kill = SHAPES[shape]
    p = torchrun(2, LOOPS, out, f"shape={shape}", *_args(shape), f"kill_at={kill}", check=False)
    assert p.returncode != 0, f"{shape}: the job was not killed"
    assert not os.path.exists(os.path.join(out, shape, "r0", "final.npz"))
    torchrun(2, LOOPS, out, f"shape={shape}", *_args(shape), "resume=1")
    i0 = _info(out, shape, 0)
    assert i0["resumed_from"] is not None and 0 < i0["resumed_from"] < i0["step"], i0
    return i0


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """Each fast shape killed in a job of its own (rank 1 SIGKILLs itself); then one job runs the
    uninterrupted runs of the fast shapes one after the other, and then the relaunches with
    ``resume=True`` of the killed ones, one after the other (tests/workers/torch_loops.py ``--``):
    what :func:`_kill_and_resume` does per shape, with one relaunch instead of five, beside the
    uninterrupted runs. Returns the uninterrupted runs' output directory, the killed runs', and, per
    shape, the killed job's return code and whether rank 0 had written its final.npz before the
    relaunch (each test asserts on its own shape's)."""
    ref = str(tmp_path_factory.mktemp("loops_ref"))
    out = str(tmp_path_factory.mktemp("loops_killed"))
    killed = {}
    with as_in_a_test(tmp_path_factory):
        for shape in FAST:
            _, _, kill = SHAPES[shape]
            p = torchrun(2, LOOPS, out, f"shape={shape}", *_args(shape), f"kill_at={kill}", check=False)
            killed[shape] = (p.returncode, os.path.exists(os.path.join(out, shape, "r0", "final.npz")))
        every_shape = ["shape=" + ",".join(FAST), *[a for s in FAST for a in _args(s)]]
        torchrun(2, LOOPS, ref, *every_shape, "--", out, *every_shape, "resume=1", timeout=600)
    return ref, out, killed


@pytest.mark.timeout(1200)  # the first of these runs the fixture's 6 jobs (7 jobs took 417 s at load 19 on 2 cores)
@pytest.mark.parametrize("shape", FAST)
def test_kill9_and_resume_equals_uninterrupted(killed_and_resumed, shape):
    uninterrupted, out, killed = killed_and_resumed
    returncode, final_before_relaunch = killed[shape]
    assert returncode != 0, f"{shape}: the job was not killed"
    assert not final_before_relaunch
    i0 = _info(out, shape, 0)
    assert i0["resumed_from"] is not None and 0 < i0["resumed_from"] < i0["step"], i0
    if shape in ("dl", "sdl"):
        assert i0["start_epoch"] == 2, i0  # resumed mid-epoch (v9: the 2nd batch of epoch 2)
    if shape == "plateau":
        assert i0["resumed_from"] == 8 and i0["start_epoch"] == 1, i0  # the last step of epoch 1, before validation
    for r in (0, 1):
        bad = _differ(os.path.join(out, shape, f"r{r}", "final.npz"),
                      os.path.join(uninterrupted, shape, f"r{r}", "final.npz"))
        assert not bad, f"{shape}: rank {r}: {len(bad)} leaves differ from the uninterrupted run: {bad[:6]}"


@pytest.mark.slow
@pytest.mark.parametrize("shape", SLOW)
def test_kill9_and_resume_slow_shapes(tmp_path, shape):
    ref = str(tmp_path / "ref")
    torchrun(2, LOOPS, ref, f"shape={shape}", *_args(shape))
    _kill_and_resume(str(tmp_path / "run"), shape)
    bad = [(r, _differ(os.path.join(tmp_path, "run", shape, f"r{r}", "final.npz"),
                       os.path.join(ref, shape, f"r{r}", "final.npz"))) for r in (0, 1)]
    if shape == "end_hooks":
        # documented: without a boundary, state= objects are taken in the optimizer's post-hook, so
        # a position advanced after it resumes one iteration behind
        assert all(b for _, b in bad), "the hooks' timing no longer differs: update docs/torch.md"
    else:
        assert not any(b for _, b in bad), f"{shape}: {bad}"


def test_iterate_refuses_a_shorter_loader_on_resume(tmp_path):
    """A resumed pass whose iterable has fewer items than the checkpoint's pass had fetched is a
    ModelMismatchError, not a silent restart of the epoch."""
    import torch

    from deepfreeze.errors import ModelMismatchError
    from deepfreeze.torch import Checkpointer

    net = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    kw = dict(scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"), mode="sync")
    # save_last=False: the newest version must be v4, taken mid-pass (4 of 5 items fetched), not the final step's
    with Checkpointer(net, opt, name="short", every_n_steps=2, save_last=False, **kw) as ck:
        for x in ck.iterate(range(5)):
            net(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert ck.last_version == 4
    net2 = torch.nn.Linear(2, 1)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
    with Checkpointer(net2, opt2, name="short", resume=True, **kw) as ck2:
        assert ck2.start_step == 4 and ck2.start_epoch == 0
        assert list(ck2.iterate(range(10))) == [4, 5, 6, 7, 8, 9]  # the pass resumes after the 4 items seen
    with Checkpointer(net2, opt2, name="short", resume=True, **kw) as ck3:
        with pytest.raises(ModelMismatchError, match="had fetched 4 items, this iterable has 2"):
            list(ck3.iterate(range(2)))
    assert np.isfinite(net2.weight.detach().numpy()).all()


@pytest.mark.parametrize("ending", ["noclose", "destroy", "close_after_destroy"])
def test_a_forgotten_close(tmp_path, ending):
    """No close(): the pending v8 is handed off at exit (bit-exact); after destroy_process_group()
    it is lost with one warning per rank naming it, and close() then is a one-line ConfigError."""
    import deepfreeze.torch as dft
    out = str(tmp_path)
    p = torchrun(2, LOOPS, out, "shape=end", "every=4", "steps=8", f"exit={ending}")
    infos = [_info(out, "end", r) for r in (0, 1)]
    assert all(i["pending"] == 8 and i["last_version"] == 4 for i in infos), infos
    kw = dict(name="end", mode="sync", scratch=os.path.join(out, "end", "scratch0"),
              persistent=os.path.join(out, "end", "persistent"))
    if ending == "noclose":
        # rank 0 says "flushed (committed)" when it saw v8 committed, else that its part was flushed (the
        # other rank may commit v8 after rank 0 looked): which one depends on which rank flushed last
        assert ("v8 was handed off and flushed at exit (committed)" in p.stderr
                or "this rank's part of v8 was handed off and flushed at exit" in p.stderr), p.stderr[-3000:]
        got = dft.load(version=8, **kw)
        want = npz(os.path.join(out, "end", "r0", "final.npz"))
        for fqn, t in got.items():
            if not fqn.startswith("optim."):
                assert t.numpy().tobytes() == want[f"model.{fqn}"].tobytes(), fqn
        return
    assert p.stderr.count("'end' v8 was captured but not written") == (2 if ending == "destroy" else 0), p.stderr[-3000:]
    from deepfreeze.errors import CheckpointNotFoundError
    with pytest.raises(CheckpointNotFoundError):
        dft.load(version=8, **kw)
    if ending == "close_after_destroy":
        for i in infos:
            assert i["close_error"].startswith("ConfigError: Checkpointer.close() after "
                                               "torch.distributed.destroy_process_group(): 'end' v8 was captured "
                                               "but not written"), i
            assert "\n" not in i["close_error"]


@pytest.mark.parametrize("loop", [[], {"pass": -1, "yielded": 0}, {"pass": 0, "yielded": "3"},
                                  {"pass": True, "yielded": 0}, {"pass": 0, "yielded": 1 << 70},
                                  {"pass": 0, "yielded": 2}, {"pass": 0, "yielded": 2, "rng": {"process": {}}},
                                  {"pass": 0, "yielded": 2, "rng": {"process": {"torch": 1, "numpy": 2, "python": 3},
                                                                    "generator": "x"}}])
def test_a_damaged_loop_record_is_a_clear_error(loop):
    """The loop position of a state record (a hostile or damaged one) is type-checked before use."""
    from deepfreeze.errors import CorruptCheckpointError
    from deepfreeze.torch._loop import Passes
    with pytest.raises(CorruptCheckpointError, match="loop position is damaged"):
        Passes().resume_from(loop, "checkpoint 'x' v3")


def test_rng_states_that_cannot_be_set_are_a_clear_error():
    import torch

    from deepfreeze.errors import CorruptCheckpointError
    from deepfreeze.torch import _state
    from deepfreeze.torch._loop import Passes
    before = _state.rng_state()
    passes = Passes()
    passes.resume_from({"pass": 1, "yielded": 2, "rng": {"process": {"torch": torch.zeros(3, dtype=torch.uint8),
                                                                     "numpy": 0, "python": 0}}}, "v3")
    with pytest.raises(CorruptCheckpointError, match="RNG states of its pass's start cannot be set"):
        next(passes.iterate(range(4), lambda: None, "x"))
    assert torch.equal(torch.get_rng_state(), before["torch"])
