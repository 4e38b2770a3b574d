"""``Checkpointer(save_last=True)`` (the default): a normal ``close()`` keeps the final step.

Issue 42, finding 4: 48 steps with ``every_n_steps=5`` left v45 as the newest version and
``deepfreeze export`` gave step 45's model. Now a normal close checkpoints step 48; a run ending in
an exception (``with`` exiting by one, ``close()`` in a ``finally`` while one propagates), the exit
hand-off of a run that never called ``close()``, and a run where a rank counted a checkpoint error
keep v45. One process (the rules are per rank; the vote of every rank is one allgather, which the
Lightning and HF suites run at 2 ranks).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import ROOT  # noqa: E402



def _net(seed: int = 0) -> "tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]":
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    return net, opt, torch.optim.lr_scheduler.StepLR(opt, 7, gamma=0.5)


def _train(net, opt, sched, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8)  # drawn from the global RNG: a resume must restore it
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
        sched.step()


def _state(net, opt, sched) -> dict[str, bytes]:
    out = {f"model.{k}": v.detach().numpy().tobytes() for k, v in net.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"opt.{pid}.{k}"] = v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode()
    out["sched"] = repr(sorted(sched.state_dict().items())).encode()
    out["rng"] = torch.get_rng_state().numpy().tobytes()
    return out


def _versions(d) -> list[int]:
    """The committed versions of 'm' on persistent (a version directory with its manifest)."""
    root = d / "p" / "m"
    return sorted(int(v.name[1:]) for v in root.iterdir()
                  if v.name[:1] == "v" and v.name[1:].isdigit() and (v / "manifest.json").exists())


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPFREEZE_SCRATCH", str(tmp_path / "s"))  # no file: mode async, this scratch
    return tmp_path


def _ckpt(where, net, opt, sched, **kw):
    from deepfreeze.torch import Checkpointer
    kw.setdefault("state", {"sched": sched})
    return Checkpointer(net, opt, name="m", every_n_steps=5, persistent=str(where / "p"), **kw)


def test_close_keeps_the_final_step_export_gives_it_and_the_resume_is_exact(where):
    net, opt, sched = _net()
    ck = _ckpt(where, net, opt, sched)
    _train(net, opt, sched, 48)
    ck.close()
    assert _versions(where)[-2:] == [45, 48]
    final = {k: v.detach().clone() for k, v in net.state_dict().items()}
    p = subprocess.run([sys.executable, "-m", "deepfreeze", "export", "--name", "m", "--format", "torch", "-o",
                        str(where / "last.pt"), "--set", f"persistent={where / 'p'}", "--set",
                        f"scratch={where / 's'}"], capture_output=True, text=True, timeout=120, cwd=str(where),
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout + p.stderr
    got = torch.load(str(where / "last.pt"), weights_only=True)
    assert got["deepfreeze"]["version"] == 48
    for k, v in final.items():
        assert got["model"][k].numpy().tobytes() == v.numpy().tobytes(), k

    # the resume from v48 continues exactly: 48 + 12 steps equal 60 uninterrupted ones
    net2, opt2, sched2 = _net(seed=1)  # other initial weights: the resume must replace them
    torch.manual_seed(99)  # another RNG state: the resume must set v48's
    ck = _ckpt(where, net2, opt2, sched2, resume=True)
    assert ck.resumed_from == 48 and ck.start_step == 48
    _train(net2, opt2, sched2, 12)
    ck.close()
    resumed = _state(net2, opt2, sched2)
    ref, ropt, rsched = _net()
    _train(ref, ropt, rsched, 60)
    want = _state(ref, ropt, rsched)
    assert set(resumed) == set(want)
    assert [k for k in want if resumed[k] != want[k]] == []


def test_an_exception_in_flight_keeps_v45(where):
    net, opt, sched = _net()
    with pytest.raises(RuntimeError, match="the loop failed"):
        with _ckpt(where, net, opt, sched):
            _train(net, opt, sched, 48)
            raise RuntimeError("the loop failed")
    assert _versions(where)[-1] == 45

    net, opt, sched = _net()
    ck = _ckpt(where, net, opt, sched, overwrite=True)
    with pytest.raises(KeyError):
        try:
            _train(net, opt, sched, 48)
            raise KeyError("late")
        finally:
            ck.close()  # in a finally while the KeyError propagates
    assert _versions(where)[-1] == 45


def test_a_normal_with_block_and_save_last_false(where):
    net, opt, sched = _net()
    with _ckpt(where, net, opt, sched):
        _train(net, opt, sched, 48)
    assert _versions(where)[-1] == 48
    net, opt, sched = _net()
    ck = _ckpt(where, net, opt, sched, overwrite=True, save_last=False)  # asks for the old behaviour: the test of it
    _train(net, opt, sched, 48)
    ck.close()
    assert _versions(where)[-1] == 45


def test_a_counted_checkpoint_error_keeps_v45(where):
    """on_error='warn': a version failed (counted in failures): close() does not add the last step."""
    class FailsOnce:
        calls = 0

        def state_dict(self):
            FailsOnce.calls += 1
            return {"fn": print} if FailsOnce.calls == 2 else {"n": FailsOnce.calls}  # v10's record: unstorable

        def load_state_dict(self, sd):
            pass

    net, opt, sched = _net()
    ck = _ckpt(where, net, opt, sched, on_error="warn", state={"sched": sched, "once": FailsOnce()})
    _train(net, opt, sched, 48)
    ck.close()
    assert len(ck.failures) == 1 and "v10" in ck.failures[0]
    assert 10 not in _versions(where) and _versions(where)[-1] == 45


def test_the_exit_hand_off_keeps_v45(where):
    """A script that never calls close(): the exit hand-off writes what was captured, not step 48."""
    script = where / "no_close.py"
    script.write_text(
        "import sys, torch\n"
        "sys.path.insert(0, %r)\n"
        "from test_torch_save_last import _ckpt, _net, _train\n"
        "import pathlib\n"
        "w = pathlib.Path(%r)\n"
        "net, opt, sched = _net()\n"
        "ck = _ckpt(w, net, opt, sched)\n"
        "_train(net, opt, sched, 48)\n" % (os.path.dirname(__file__), str(where)))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT, "DEEPFREEZE_SCRATCH": str(where / "s")})
    assert p.returncode == 0, p.stdout + p.stderr
    assert _versions(where)[-1] == 45
    assert np.all([v % 5 == 0 for v in _versions(where)])
