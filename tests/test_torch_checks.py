"""Issue 31, items 3, 4 and 7: resume checks before anything is loaded (optimizer classes, groups,
state= keys; strict=False), a Checkpointer built before init_process_group under torchrun, tied
weights stored once and restored tied, load without a config file, the EPOCH column for torch.

Plain-process tests write their checkpoints in this process (one rank); the torchrun tests
(2 ranks, gloo) read per-rank result files written by tests/workers/torch_checks.py.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import WORKERS  # noqa: E402
from test_torch import TRAIN, npz, torchrun  # noqa: E402

import deepfreeze.torch as dft  # noqa: E402
from deepfreeze.errors import ConfigError, ModelMismatchError  # noqa: E402

CHECKS = os.path.join(WORKERS, "torch_checks.py")
sys.path.insert(0, WORKERS)
from torch_checks import Tied, state_bytes  # noqa: E402


def where(d) -> dict:
    return {"mode": "sync", "scratch": str(d / "s"), "persistent": str(d / "p")}


def train(model, opts, ck, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 6), generator=g)
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward()
        for o in opts:
            o.step()
            o.zero_grad()


def results(out: str, n: int = 2) -> list[dict]:
    out_ = []
    for r in range(n):
        with open(os.path.join(out, f"r{r}", "result.json")) as f:
            out_.append(json.load(f))
    return out_


# ---------------------------------------------------------------------------- resume checks

class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A version written by one process: the Tied model, AdamW in two groups (weight decay off for
    the mid layer's bias), a state= counter; the model and optimizer right after."""
    d = tmp_path_factory.mktemp("written")
    torch.manual_seed(0)
    net = Tied()
    opts = [torch.optim.AdamW([{"params": [net.wte.weight, net.mid.weight]},
                               {"params": [net.mid.bias], "weight_decay": 0.0}], lr=1e-2)]
    counter = Counter()
    ck = dft.Checkpointer(net, opts, name="w", every_n_steps=3, state={"c": counter}, **where(d))
    counter.n = 7
    train(net, opts, ck, 3)
    ck.close()
    return d, net, opts


def fresh(optimizer: str = "adamw"):
    torch.manual_seed(5)
    net = Tied()
    if optimizer == "adamw":
        opt = torch.optim.AdamW([{"params": [net.wte.weight, net.mid.weight]},
                                 {"params": [net.mid.bias], "weight_decay": 0.0}], lr=1e-2)
    else:
        opt = torch.optim.SGD([{"params": [net.wte.weight, net.mid.weight]},
                               {"params": [net.mid.bias], "weight_decay": 0.0}], lr=1e-2, momentum=0.9)
    return net, opt


def test_optimizer_class_recorded_and_mismatch_refused_before_anything_changes(written, tmp_path):
    """Finding 3: SGD on an AdamW checkpoint. Before: accepted, then KeyError 'momentum' at the
    first step. After: ModelMismatchError naming both classes; model, optimizer and state= objects
    unchanged (compared as bytes before and after the failed call)."""
    d, _, _ = written
    st = dft.load_state(name="w", **where(d))
    assert st.records[0]["a"]["optimizers"] == ["torch.optim.adamw.AdamW"]
    net, opt = fresh("sgd")
    c = Counter()
    before = state_bytes(net, [opt], {"c": c})
    with pytest.raises(ModelMismatchError, match=r"torch\.optim\.adamw\.AdamW in the checkpoint, "
                                                 r"torch\.optim\.sgd\.SGD in this run"):
        dft.restore(net, opt, name="w", state={"c": c}, **where(d))
    assert state_bytes(net, [opt], {"c": c}) == before
    # resume=True: the same check, before the Checkpointer loads anything
    with pytest.raises(ModelMismatchError, match="optimizer 0 does not match"):
        dft.Checkpointer(net, opt, name="w", resume=True, state={"c": c}, **where(d))
    assert state_bytes(net, [opt], {"c": c}) == before


@pytest.mark.parametrize("case", ["groups", "params", "count", "state_keys"])
def test_structure_mismatch_names_both_sides(written, case):
    """Parameter groups (number, params of each), optimizer count, state= keys: each a
    ModelMismatchError naming the checkpoint's side and this run's, nothing written."""
    d, _, _ = written
    torch.manual_seed(5)
    net = Tied()
    state = {"c": Counter()}
    if case == "groups":
        opts = [torch.optim.AdamW(net.parameters(), lr=1e-2)]
        want = r"2 parameter group\(s\) in the checkpoint, 1 in this run"
    elif case == "params":
        opts = [torch.optim.AdamW([{"params": [net.wte.weight]}, {"params": [net.mid.bias]}], lr=1e-2)]
        want = r"group 0 holds 2 parameter\(s\) in the checkpoint .*, 1 in this run"
    elif case == "count":
        opts = [torch.optim.AdamW([{"params": [net.wte.weight, net.mid.weight]}, {"params": [net.mid.bias]}]),
                torch.optim.SGD(net.mid.parameters(), lr=0.1)]
        want = r"holds 1 optimizer\(s\) \['torch.optim.adamw.AdamW'\], this run gives 2"
    else:
        opts = [torch.optim.AdamW([{"params": [net.wte.weight, net.mid.weight]}, {"params": [net.mid.bias]}])]
        state = {"c": Counter(), "data": Counter()}
        want = r"the checkpoint holds \['c'\], this run gives \['c', 'data'\]"
    before = state_bytes(net, opts, state)
    with pytest.raises(ModelMismatchError, match=want):
        dft.restore(net, opts, name="w", state=state, **where(d))
    assert state_bytes(net, opts, state) == before


def test_strict_false_loads_what_matches(written, caplog):
    """strict=False: the model's tensors, not the optimizer of another class; skipped listed
    (return value and one warning); Checkpointer(strict=False) lists it in .skipped."""
    d, trained, _ = written
    net, opt = fresh("sgd")
    c = Counter()
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        r = dft.restore(net, opt, name="w", state={"c": c, "x": Counter()}, strict=False, **where(d))
    version, step = r
    assert (version, step) == (3, 3) and r.version == 3
    assert any("optimizer 0's state" in s and "SGD" in s for s in r.skipped), r.skipped
    assert any("'x'" in s for s in r.skipped) and c.n == 7
    assert "strict=False" in caplog.text and "left out" in caplog.text
    want = dft.load(name="w", **where(d))
    for k, v in net.state_dict().items():
        assert v.numpy().tobytes() == want[k].numpy().tobytes(), k
    assert not opt.state  # not loaded
    net2, opt2 = fresh("sgd")
    ck = dft.Checkpointer(net2, opt2, name="w", resume=True, strict=False, state={"c": Counter()}, **where(d))
    try:
        assert ck.resumed_from == 3 and ck.skipped and "optimizer 0" in ck.skipped[0]
        assert net2.lm_head.weight is net2.wte.weight
    finally:
        ck.close()


def test_strict_false_model_tensors(written):
    """A model with a layer the checkpoint lacks: strict, ModelMismatchError naming it and
    nothing written; strict=False, every other tensor loaded and the two listed."""
    d, trained, _ = written
    torch.manual_seed(5)
    net = Tied()
    net.extra = torch.nn.Linear(2, 2)
    before = state_bytes(net, [], {})
    with pytest.raises(ModelMismatchError, match=r"not in the checkpoint: \['extra.bias', 'extra.weight'\]"):
        dft.restore(net, name="w", **where(d))
    assert state_bytes(net, [], {}) == before
    r = dft.restore(net, name="w", strict=False, **where(d))
    assert r.skipped == ["model tensor 'extra.bias'", "model tensor 'extra.weight'"]
    for k, v in trained.state_dict().items():
        assert net.state_dict()[k].numpy().tobytes() == v.numpy().tobytes(), k
    assert net.lm_head.weight is net.wte.weight


def test_version_without_classes_checked_by_groups(tmp_path, monkeypatch):
    """A version written before classes were recorded (its record has no 'optimizers'; written
    here by a Checkpointer subclass that leaves it out) is still refused for SGD on AdamW: the
    saved groups lack SGD's hyperparameters (momentum, dampening, nesterov)."""

    from deepfreeze.torch.capture import StateRecords

    class Old(StateRecords):
        def part(self, phase, st=None):
            rec = super().part(phase, st)
            if phase == "a":
                del rec["optimizers"]
            return rec
    monkeypatch.setattr(dft.Checkpointer, "records_cls", Old)

    torch.manual_seed(0)
    net = Tied()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    ck = dft.Checkpointer(net, opt, name="o", every_n_steps=2, **where(tmp_path))
    train(net, [opt], ck, 2)
    ck.close()
    assert "optimizers" not in dft.load_state(name="o", **where(tmp_path)).records[0]["a"]
    net2 = Tied()
    sgd = torch.optim.SGD(net2.parameters(), lr=1e-2, momentum=0.9)
    before = state_bytes(net2, [sgd], {})
    with pytest.raises(ModelMismatchError, match=r"lacks the hyperparameters \['dampening', 'momentum', 'nesterov'\]"
                                                 r".*its class: \(class not recorded\)"):
        dft.restore(net2, sgd, name="o", **where(tmp_path))
    assert state_bytes(net2, [sgd], {}) == before
    dft.restore(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2), name="o", **where(tmp_path))  # the right one


@pytest.fixture(scope="module")
def ddp_checks(tmp_path_factory):
    """A 2-rank DDP run (tests/workers/torch_train.py: AdamW + SGD, a checkpoint at step 6), then
    one 2-rank job of tests/workers/torch_checks.py 'mismatch' over it (one torchrun start for
    the two findings: the Checkpointer before init_process_group, then the resume checks)."""
    d = tmp_path_factory.mktemp("ddpchecks")
    src, out = str(d / "src"), str(d / "out")
    torchrun(2, TRAIN, src, "steps=6", "mode=sync")
    torchrun(2, CHECKS, "mismatch", out, src)
    return src, out


def test_resume_with_sgd_on_adamw_ddp(ddp_checks):
    """Finding 3 under torchrun: resuming the 2-rank run with SGD as its first optimizer. Strict:
    ModelMismatchError on every rank, nothing changed; strict=False: the model and the second
    optimizer (which matches) restored, the first listed as skipped."""
    src, out = ddp_checks
    for r, res in enumerate(results(out)):
        assert res["strict"][0] == "ModelMismatchError", res
        assert "AdamW in the checkpoint, torch.optim.sgd.SGD in this run" in res["strict"][1]
        assert res["unchanged"], f"rank {r}: the failed resume changed the model or the optimizers"
        assert res["resumed_from"] == 6 and res["data_it"] == 6
        assert len(res["skipped"]) == 1 and "optimizer 0's state" in res["skipped"][0]
        assert res["sgd_state"] == 0 and res["head_state"] == 2  # SGD's momentum buffers: loaded for the head
        # (buffers are rank 0's: DDP broadcasts them from rank 0 at the next forward)
        got, want = npz(os.path.join(out, f"r{r}", "model.npz")), npz(os.path.join(src, "r0", "v6.npz"))
        for k, v in got.items():
            assert v.tobytes() == want[k].tobytes(), k


# ---------------------------------------------------------------------------- init_process_group

def test_checkpointer_before_init_process_group(ddp_checks):
    """Finding 4: under torchrun (WORLD_SIZE=2) a Checkpointer built before init_process_group.
    Before: each rank acted as rank 0 of a one-process job on the same name (no error here, where
    the two closed at once; LeaseHeldError about two jobs when they overlap). After: ConfigError
    naming init_process_group on every rank, nothing written."""
    _, out = ddp_checks
    for r in range(2):
        with open(os.path.join(out, f"r{r}", "preinit.json")) as f:
            res = json.load(f)
        assert res["error"] == "ConfigError", res
        assert "before torch.distributed.init_process_group" in res["message"]
        assert f"rank {r} of a job of WORLD_SIZE=2" in res["message"]
    assert not os.path.exists(os.path.join(out, "persistent", "pre"))


def test_restore_before_init_process_group(tmp_path, monkeypatch):
    """The same check in restore (WORLD_SIZE set as torchrun sets it, no process group)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError, match="deepfreeze.torch.restore in rank 1 of a job of WORLD_SIZE=2 came before .*init_process_group"):
        dft.restore(Tied(), name="w", **where(tmp_path))


# ---------------------------------------------------------------------------- tied weights

def test_tied_weights_stored_once_restored_tied(written, tmp_path):
    """lm_head.weight is wte.weight: one tensor in the checkpoint, the record names the alias;
    load gives both keys; restore into a fresh tied model (plain and torch.compile-wrapped) keeps
    the Parameter shared, bit-exact, and the optimizer state keyed right."""
    d, trained, opts = written
    st = dft.load_state(name="w", **where(d))
    names = [t["name"] for t in st.manifest["tensors"]]
    assert "wte.weight" in names and "lm_head.weight" not in names
    assert st.records[0]["a"]["aliases"] == {"lm_head.weight": "wte.weight"}
    flat = dft.load(name="w", **where(d))
    assert flat["lm_head.weight"] is flat["wte.weight"]
    assert flat["wte.weight"].numpy().tobytes() == trained.wte.weight.detach().numpy().tobytes()
    assert "optim.state.wte.weight.exp_avg" in flat and "optim.state.lm_head.weight.exp_avg" not in flat
    for wrap in (lambda m: m, torch.compile):
        net, opt = fresh()
        model = wrap(net)
        dft.restore(model, opt, name="w", **where(d))
        assert net.lm_head.weight is net.wte.weight
        for k, v in trained.state_dict().items():
            assert net.state_dict()[k].numpy().tobytes() == v.numpy().tobytes(), k
        got, want = opt.state_dict(), opts[0].state_dict()
        assert got["param_groups"] == want["param_groups"]
        for i, kv in want["state"].items():
            for key, v in kv.items():
                assert got["state"][i][key].numpy().tobytes() == v.numpy().tobytes(), (i, key)


def test_tied_weights_dcp_load_through_reader(written):
    """dcp.load of a tied model's get_state_dict (both FQNs asked for) through the Reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    d, trained, opts = written
    net, opt = fresh()
    train(net, [opt], None, 1)  # creates the optimizer state (get_state_dict's keys for DCP)
    msd, osd = get_state_dict(net, opt)
    assert "lm_head.weight" in msd and "wte.weight" in msd
    sd = {**msd, "optim": osd}
    dcp.load(sd, storage_reader=dft.Reader(name="w", **where(d)), no_dist=True)
    set_state_dict(net, opt, model_state_dict={k: v for k, v in sd.items() if k != "optim"},
                   optim_state_dict=sd["optim"])
    assert net.lm_head.weight is net.wte.weight
    for k, v in trained.state_dict().items():
        assert net.state_dict()[k].numpy().tobytes() == v.numpy().tobytes(), k
    want = opts[0].state_dict()["state"]
    for i, kv in opt.state_dict()["state"].items():
        assert kv["exp_avg"].numpy().tobytes() == want[i]["exp_avg"].numpy().tobytes()


def test_tied_weights_stored_twice_still_restore(tmp_path):
    """A version written before the dedupe held a tied tensor under both FQNs and no alias. Made
    here the same way: an untied twin (same FQNs, the same groups: its lm_head.weight is frozen,
    out of the optimizer, set equal to wte.weight before the checkpoint). It restores into a tied
    model, tied and bit-exact."""
    torch.manual_seed(0)
    twin = Tied()
    twin.lm_head.weight = torch.nn.Parameter(twin.wte.weight.detach().clone(), requires_grad=False)
    opt = torch.optim.AdamW([twin.wte.weight, twin.mid.weight, twin.mid.bias], lr=1e-2)
    ck = dft.Checkpointer(twin, opt, name="old", **where(tmp_path))
    train(twin, [opt], ck, 2)
    with torch.no_grad():
        twin.lm_head.weight.copy_(twin.wte.weight)
    ck.checkpoint()
    ck.close()
    st = dft.load_state(name="old", **where(tmp_path))
    assert st.records[0]["a"]["aliases"] == {}
    assert {"wte.weight", "lm_head.weight"} <= {t["name"] for t in st.manifest["tensors"]}
    net, fopt = fresh()
    fopt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    dft.restore(net, fopt, name="old", **where(tmp_path))
    assert net.lm_head.weight is net.wte.weight
    assert net.wte.weight.detach().numpy().tobytes() == twin.wte.weight.detach().numpy().tobytes()
    assert fopt.state_dict()["state"][0]["exp_avg"].numpy().tobytes() == \
        opt.state_dict()["state"][0]["exp_avg"].numpy().tobytes()


@pytest.mark.slow
def test_tied_weights_under_ddp(tmp_path):
    """A tied model under DDP (2 ranks): stored once, restored tied and bit-exact on every rank."""
    out = str(tmp_path / "t")
    torchrun(2, CHECKS, "tied", out)
    for r, res in enumerate(results(out)):
        assert res["tied"] and res["version"] == 4
        got, want = npz(os.path.join(out, f"r{r}", "restored.npz")), npz(os.path.join(out, f"r{r}", "v4.npz"))
        assert set(got) == set(want) and "lm_head.weight" not in got  # (train_state's list: stored once)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), k


# ---------------------------------------------------------------------------- lesser items

def test_load_without_a_config_file_needs_no_mode(written, monkeypatch):
    """Finding 7: load(name=..., scratch=..., persistent=...) without mode. Before: ConfigError
    "'mode' is mandatory". After: the version (mode says how versions are written, not read)."""
    d, trained, _ = written
    monkeypatch.delenv("VELOC_MODE", raising=False)
    got = dft.load(name="w", scratch=str(d / "s"), persistent=str(d / "p"))
    assert got["mid.weight"].numpy().tobytes() == trained.mid.weight.detach().numpy().tobytes()
    got = dft.load(name="w", persistent=str(d / "p"), scratch=str(d / "nothing-here"))  # persistent alone
    assert got["mid.weight"].numpy().tobytes() == trained.mid.weight.detach().numpy().tobytes()


def test_ls_epoch_column_for_torch(written, capsys):
    """Finding 7: `deepfreeze ls` showed EPOCH 1 for every torch version; now '-'; inspect says
    no epoch either."""
    from deepfreeze.cli import main
    d, _, _ = written
    args = ["--name", "w", "--set", "mode=sync", "--set", f"scratch={d / 's'}", "--set", f"persistent={d / 'p'}"]
    assert main(["ls", *args]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("scratch", "persistent"))]
    assert rows and all(r[3] == "-" for r in rows), out  # LEVEL VERSION STEP EPOCH
    assert main(["inspect", *args]) == 0
    out = capsys.readouterr().out
    assert "step 3" in out and "epoch" not in out.splitlines()[0], out


def test_no_keras_words_in_torch_paths():
    """Finding 7: the torch adapter's errors and the CLI help name no Keras concept."""
    import glob
    import re
    from deepfreeze.cli import build_parser
    for path in glob.glob(os.path.join(os.path.dirname(dft.__file__), "*.py")):
        if os.path.basename(path) in ("lightning.py", "hf.py"):
            continue  # the frameworks' own word: their integrations are callbacks
        with open(path) as f:
            text = f.read()
        assert not re.search(r"\bKeras\b|\bcallback\b|\bbatches\b", text), path
    help_ = build_parser().format_help()
    for sub in ("ls", "export"):
        help_ += build_parser()._subparsers._group_actions[0].choices[sub].format_help()
    assert "as the Keras callback" not in help_ and "as Keras prints it" not in help_
