"""Issue 41, item 5 (case 4 of "Why"): typed all the way to the optimizer.

A state record that decodes can still hold values torch cannot use: a learning rate of
``"0.01"``, None or a dtype; a scheduler state with an extra ``optimizer`` entry; a GradScaler
state of the wrong kind. Before the fix ``restore``, the Checkpointer's resume and ``export
--format torch|dcp`` reported success and the next ``opt.step()``/``sched.step()`` raised a raw
TypeError or AttributeError from inside torch. Now each is a CorruptCheckpointError naming the
object, the key and both kinds, before anything is set.

Each hostile version is a real checkpoint (a Checkpointer in this process, one rank, sync) whose
rank-0 state record an attacker rewrote in the persistent file, the CRCs recomputed
(:func:`_util.replace_record`): only DeepFreeze's own checks can refuse it.
"""
from __future__ import annotations

import copy
import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import replace_record  # noqa: E402

import deepfreeze.torch as dft  # noqa: E402
from deepfreeze.config import Config  # noqa: E402
from deepfreeze.errors import CorruptCheckpointError  # noqa: E402
from deepfreeze.loader import load as core_load  # noqa: E402
from deepfreeze.torch import _state  # noqa: E402

NAME = "kinds"


def build(seed: int):
    """A model, Adam (lr 0.01), a StepLR and an (enabled, CPU) GradScaler, after one step."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    scaler = torch.amp.GradScaler("cpu")
    return net, opt, sched, scaler


def step(net, opt, sched, scaler) -> None:
    opt.zero_grad()
    scaler.scale(net(torch.ones(5, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A version of ``NAME`` (its persistent directory) and its rank-0 state record, decoded."""
    d = tmp_path_factory.mktemp("kinds")
    objs = build(0)
    net, opt, sched, scaler = objs
    ck = dft.Checkpointer(net, opt, name=NAME, every_n_steps=2, state={"sched": sched, "scaler": scaler},
                          mode="sync", scratch=str(d / "s"), persistent=str(d / "p"))
    for _ in range(2):
        step(*objs)
    ck.close()
    got = core_load(Config.load(None, mode="sync", scratch=str(d / "s"), persistent=str(d / "p")), NAME)
    return d / "p", got.version, _state.decode_record(got.arrays["_deepfreeze/rank0"])


def hostile(written, tmp_path, edit) -> dict:
    """A copy of the written version whose state record ``edit(record)`` rewrote; the keywords
    that read it (an empty scratch: the persistent file is the one read)."""
    src, version, rec = written
    rec = copy.deepcopy(rec)
    edit(rec)
    shutil.copytree(src, tmp_path / "p")
    replace_record(str(tmp_path / "p" / NAME / f"v{version:012d}" / "model.dfz"), _state.encode(rec))
    return {"mode": "sync", "scratch": str(tmp_path / "s"), "persistent": str(tmp_path / "p")}


def snapshot(net, opt, sched, scaler) -> dict:
    return copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                          "scaler": scaler.state_dict()})


def same(a, b, path="") -> None:
    """Bit-exact equality of two snapshots (tensors by torch.equal, dtype included)."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def set_lr(value):
    def edit(rec):
        rec["param_groups"][0][0]["lr"] = value
    return edit


def sched_optimizer(rec):
    rec["state"]["sched"]["optimizer"] = {"param_groups": []}  # load_state_dict: __dict__.update


def scaler_scale(rec):
    rec["state"]["scaler"]["scale"] = "65536.0"


GROUP_CASES = {"lr_str": (set_lr("0.01"), "'lr' is a str ('0.01') in the checkpoint, a number (0.01) in"),
               "lr_none": (set_lr(None), "'lr' is None in the checkpoint, a number (0.01) in"),
               "lr_dtype": (set_lr(torch.float32), "'lr' is a torch dtype (torch.float32) in the checkpoint, a "
                                                   "number (0.01) in")}
STATE_CASES = {"sched_optimizer": (sched_optimizer, "state object 'sched' (torch.optim.lr_scheduler.StepLR): "
                                                    "its state['optimizer'] is a dict in the checkpoint and not a "
                                                    "key of this run's state_dict()"),
               "scaler_scale": (scaler_scale, "state object 'scaler' (torch.amp.grad_scaler.GradScaler): its "
                                              "state['scale'] is a str ('65536.0') in the checkpoint, a number")}


def live_beside_hostile(written, tmp_path, case):
    """The checkpoint edited as ``case`` says (its keywords), the message expected, live objects
    after one step, and their snapshot to compare with after a refusal."""
    edit, message = {**GROUP_CASES, **STATE_CASES}[case]
    kw = hostile(written, tmp_path, edit)
    objs = build(1)
    step(*objs)
    return kw, message, objs, snapshot(*objs)


@pytest.mark.parametrize("case", [*GROUP_CASES, *STATE_CASES])
def test_restore_refuses_a_value_of_another_kind_before_anything_is_set(written, tmp_path, case):
    """Before: restore returned, and the next opt.step() (TypeError: unsupported operand type(s)
    for /: 'str' and 'float', NoneType, torch.dtype) or sched.step() (AttributeError: 'dict'
    object has no attribute 'param_groups') failed inside torch; the scaler's "scale" raised
    TypeError from GradScaler.load_state_dict's fill_() halfway through the restore, the model
    already set (a scaler never used yet: the next scaler.scale()). After: refused, nothing set,
    with strict=False too."""
    kw, message, objs, before = live_beside_hostile(written, tmp_path, case)
    net, opt, sched, scaler = objs
    with pytest.raises(CorruptCheckpointError, match="Nothing was changed: restore another version") as e:
        dft.restore(net, opt, name=NAME, state={"sched": sched, "scaler": scaler}, **kw)
    assert message in str(e.value) and f"checkpoint {NAME!r} v" in str(e.value)
    same(before, snapshot(*objs))
    # strict=False loads it no more
    with pytest.raises(CorruptCheckpointError, match="Nothing was changed: restore another version"):
        dft.restore(net, opt, name=NAME, state={"sched": sched, "scaler": scaler}, strict=False, **kw)
    same(before, snapshot(*objs))


@pytest.mark.parametrize("case", ["lr_str", "sched_optimizer"])
def test_checkpointer_resume_refuses_before_anything_is_set(written, tmp_path, case):
    """The callbacks' resume (Checkpointer(resume=True): the HF and Lightning callbacks build one)."""
    kw, message, objs, before = live_beside_hostile(written, tmp_path, case)
    net, opt, sched, scaler = objs
    with pytest.raises(CorruptCheckpointError) as e:
        dft.Checkpointer(net, opt, name=NAME, resume=True, state={"sched": sched, "scaler": scaler}, **kw)
    assert message in str(e.value)
    same(before, snapshot(*objs))


@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_export_torch_and_dcp_refuse_against_the_class_defaults(written, tmp_path, case):
    """Before: export wrote a file whose param_groups broke opt.step() after load_state_dict (and
    the DCP reader served the value). After: checked against a fresh Adam's defaults; no output."""
    from deepfreeze.torch.dcp import Reader, write_dcp
    from deepfreeze.torch.export import write_torch
    edit, _ = GROUP_CASES[case]
    kw = hostile(written, tmp_path, edit)
    ck = core_load(Config.load(None, **kw), NAME)
    message = "optimizer 0 (torch.optim.adam.Adam), parameter group 0: 'lr' is "
    for write, out in ((write_torch, tmp_path / "out.pt"), (write_dcp, tmp_path / "out.dcp")):
        with pytest.raises(CorruptCheckpointError, match="Nothing was written: use another version") as e:
            write(ck, str(out))
        assert message in str(e.value) and "a fresh optimizer of its class (its default)" in str(e.value)
        assert not out.exists()
    with pytest.raises(CorruptCheckpointError, match="'lr' is "):
        Reader(name=NAME, collective=False, **kw).read_metadata()


def test_hf_checkpoint_dir_refuses_against_the_class_defaults(tmp_path):
    """hf.checkpoint_dir of a version whose lr a record edit made "0.01": refused before a file is
    written (before: optimizer.pt held it and Trainer's first step raised a TypeError)."""
    pytest.importorskip("transformers")
    from deepfreeze.torch import hf

    class TrainerState:  # the callback's own state= object, as far as checkpoint_dir reads it
        def state_dict(self):
            return {"trainer_state": '{"global_step": 2}\n'}

        def load_state_dict(self, sd):
            pass
    d = tmp_path / "w"
    net, opt, sched, scaler = build(0)
    ck = dft.Checkpointer(net, opt, name=NAME, every_n_steps=2, state={hf.TRAINER_STATE: TrainerState()},
                          mode="sync", scratch=str(d / "s"), persistent=str(d / "p"))
    for _ in range(2):
        step(net, opt, sched, scaler)
    ck.close()
    got = core_load(Config.load(None, mode="sync", scratch=str(d / "s"), persistent=str(d / "p")), NAME)
    kw = hostile((d / "p", got.version, _state.decode_record(got.arrays["_deepfreeze/rank0"])), tmp_path,
                 set_lr("0.01"))
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match="'lr' is a str"):
        hf.checkpoint_dir(name=NAME, output_dir=str(out), **kw)
    assert not out.exists() or not list(out.iterdir())


def test_what_torch_takes_as_it_is_passes(written, tmp_path):
    """Not refused: the unedited version (restored bit-exact); a saved key the live group lacks;
    an optional flag saved as None where this run gives a bool (foreach); a tuple saved where the
    live value is a list of the same length; an int where the live value is a float; the
    export of a tensor learning rate (torch's optimizers take one)."""
    def edit(rec):
        g = rec["param_groups"][0][0]
        g["custom"], g["foreach"], g["betas"], g["eps"] = "mine", None, (0.9, 0.999), 0
    kw = hostile(written, tmp_path, edit)
    net, opt, sched, scaler = build(1)
    opt.param_groups[0]["foreach"], opt.param_groups[0]["betas"] = False, [0.8, 0.9]
    dft.restore(net, opt, name=NAME, state={"sched": sched, "scaler": scaler}, **kw)
    g = opt.param_groups[0]
    assert (g["custom"], g["foreach"], g["betas"], g["eps"]) == ("mine", None, (0.9, 0.999), 0)
    step(net, opt, sched, scaler)  # torch takes them
    _, version, rec = written
    rec = copy.deepcopy(rec)
    rec["param_groups"][0][0]["lr"] = torch.tensor(0.01)
    _state.check_recorded_groups(rec, "a tensor lr")
    with pytest.raises(CorruptCheckpointError, match=r"'betas'\[1\] is a str"):
        rec["param_groups"][0][0]["betas"] = (0.9, "0.999")
        _state.check_recorded_groups(rec, "a str beta")


def test_lightning_resume_refuses_a_scheduler_state_with_an_optimizer_entry(tmp_path):
    """The Lightning callback's schedulers travel inside its own state object: an ``optimizer``
    entry added to one is refused at the Checkpointer's resume, before the model is set (before:
    the fit resumed and Lightning's first scheduler step raised AttributeError)."""
    pl = pytest.importorskip("pytorch_lightning")
    from deepfreeze.torch.lightning import DeepFreezeCallback

    class Module(pl.LightningModule):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                       "interval": "step"}}

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 4)), batch_size=2)
    where = {"mode": "sync", "scratch": str(tmp_path / "w" / "s"), "persistent": str(tmp_path / "w" / "p")}

    def fit(module, cb, steps):
        pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[cb]).fit(module, data)
    fit(Module(0), DeepFreezeCallback(name=NAME, every_n_train_steps=2, **where), 2)
    got = core_load(Config.load(None, **where), NAME)

    def edit(rec):
        rec["a"]["state"]["lightning"]["lr_schedulers"][0]["optimizer"] = {"param_groups": []}
    kw = hostile((tmp_path / "w" / "p", got.version, _state.decode_record(got.arrays["_deepfreeze/rank0"])),
                 tmp_path, edit)
    module = Module(1)
    before = copy.deepcopy(module.state_dict())
    with pytest.raises(CorruptCheckpointError, match=r"state object 'lightning': LR scheduler 0 "
                                                     r"\(torch.optim.lr_scheduler.StepLR\): its state\['optimizer'\]"):
        fit(module, DeepFreezeCallback(name=NAME, every_n_train_steps=2, resume=True, **kw), 4)
    same(before, module.state_dict())


def test_clone_receive_refuses_a_hostile_source_record(monkeypatch):
    """clone.receive puts what the source sends through restore's checks: a source whose record
    carries a learning rate of "0.01" is refused before the clone's model is set (before: the
    clone took it, and its first opt.step() raised a TypeError)."""
    from deepfreeze.torch.clone import CloneServer, receive
    monkeypatch.setenv("DEEPFREEZE_TOKEN", "7" * 64)

    class Hostile(CloneServer):  # the source job, its record edited as a hostile source sends it
        def _take_record(self, c, both):
            super()._take_record(c, both)
            if c.record:
                rec = _state.decode_record(c.record)
                rec["param_groups"][0][0]["lr"] = "0.01"
                c.record = _state.encode(rec)
    dst = build(1)
    step(*dst)  # (before the source's hooks exist)
    before = snapshot(*dst)
    src = build(0)
    server = Hostile(src[0], src[1], "127.0.0.1:0", state={"sched": src[2], "scaler": src[3]}, timeout=30)
    stop = threading.Event()

    def train():
        while not stop.is_set():
            step(*src)
            server.end_iteration()
            time.sleep(0.002)
    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"optimizer 0 \(torch.optim.adam.Adam\), parameter group "
                                                         r"0: 'lr' is a str \('0.01'\) in the checkpoint"):
            receive(dst[0], dst[1], server.address, state={"sched": dst[2], "scaler": dst[3]}, timeout=30)
    finally:
        stop.set()
        t.join(60)
        server.close()
    same(before, snapshot(*dst))
