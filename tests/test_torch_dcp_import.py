"""``deepfreeze.torch.import_dcp`` / ``deepfreeze import --format dcp`` and ``Checkpointer(start_step=)``.

A real 2-rank DDP job under torchrun trains as a DCP user does and saves with ``dcp.save`` at step
6, recording its state (tests/workers/torch_dcp_import.py); the test imports that directory and
resumes with the Checkpointer at 2 ranks and at 1 rank: everything is compared bit for bit with
the recorded state, and the 2-rank continuation with the uninterrupted run. Hostile and damaged
DCP directories are refused before anything in them runs.
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import WORKERS  # noqa: E402
from test_torch import _env, assert_same, info, npz, plain, torchrun  # noqa: E402

from deepfreeze.errors import ConfigError, CorruptCheckpointError, ExistingCheckpointError  # noqa: E402

WORKER = os.path.join(WORKERS, "torch_dcp_import.py")
S = 6
STATE = {"data": "data", "sched0": "sched0", "sched1": "sched1"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 ranks, 10 iterations, dcp.save after iteration 6 (OUT/dcp and OUT/dcp_app)."""
    out = str(tmp_path_factory.mktemp("dcpsave"))
    torchrun(2, WORKER, out, "mode=save", "steps=10", f"save_at={S}")
    return out


def _levels(root: str) -> dict[str, str]:
    return {"mode": "sync", "scratch": os.path.join(root, "scratch0"), "persistent": os.path.join(root, "persistent")}


def _cli(*args: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepfreeze", *args], capture_output=True, text=True, timeout=180,
                          env=_env(), cwd=cwd)


def test_import_then_resume_at_two_ranks_ends_as_the_uninterrupted_run(saved, tmp_path):
    """import_dcp (API) of {"model", "optim", "sched0", "sched1", "data"} as v6; a 2-rank
    Checkpointer(resume=True) starts at step 6 with every rank's model, optimizer state and lrs
    equal to rank 0's recorded state, writes v9 (and save_last's v10 at close), and (the RNG states restored by the user, as DCP
    holds none) ends bit-identical to the uninterrupted run on each rank."""
    import deepfreeze.torch as dft
    out = str(tmp_path)
    r = dft.import_dcp(os.path.join(saved, "dcp"), None, "imp", S, optimizer_groups=[1, 1], state=STATE,
                       **_levels(out))
    assert (r.version, r.param_groups, r.state, r.ignored) == (S, [1, 1], sorted(STATE), [])
    want = npz(os.path.join(saved, "r0", f"v{S}.npz"))
    got = {k: v.numpy() for k, v in dft.load(name="imp", version=S, **_levels(out)).items()}
    assert_same(got, want, "deepfreeze.torch.load of the import", lr=False)
    torchrun(2, WORKER, out, "mode=resume", f"src={saved}", "steps=10", f"persistent={out}/persistent")
    for rank in (0, 1):
        i = info(out, rank)
        assert (i["start_step"], i["resumed_from"], i["step"], i["last_version"], i["it"]) == (S, S, 10, 10, 10)  # v9, then save_last's v10
        assert_same(npz(os.path.join(out, f"r{rank}", "start.npz")), want, f"rank {rank} resumed")
        assert_same(npz(os.path.join(out, f"r{rank}", "final.npz")), npz(os.path.join(saved, f"r{rank}", "final.npz")),
                    f"rank {rank} at the end vs the uninterrupted run")
    st = dft.load_state(name="imp", version=9, mode="sync", scratch=os.path.join(out, "scratch0"),
                        persistent=os.path.join(out, "persistent"))
    assert st.step == 9 and st.world_size == 2


@pytest.mark.slow
def test_collective_import_under_torchrun(saved, tmp_path):
    """Every rank of a 2-rank job calls import_dcp (a version of 2 ranks), then resumes from it:
    as the single-process import, it ends bit-identical to the uninterrupted run; the version
    loads at 1 rank in this process."""
    import deepfreeze.torch as dft
    out = str(tmp_path)
    torchrun(2, WORKER, out, "mode=resume", f"src={saved}", "steps=10", f"import_step={S}")
    want = npz(os.path.join(saved, "r0", f"v{S}.npz"))
    for rank in (0, 1):
        i = info(out, rank)
        assert (i["start_step"], i["resumed_from"], i["last_version"]) == (S, S, 9)
        assert_same(npz(os.path.join(out, f"r{rank}", "start.npz")), want, f"rank {rank} resumed")
        assert_same(npz(os.path.join(out, f"r{rank}", "final.npz")), npz(os.path.join(saved, f"r{rank}", "final.npz")),
                    f"rank {rank} at the end vs the uninterrupted run")
    st = dft.load_state(name="imp", version=S, **_levels(out))
    assert st.world_size == 2
    got = {k: v.numpy() for k, v in dft.load(name="imp", version=S, **_levels(out)).items()}
    assert_same(got, want, "the collective import loaded at 1 rank", lr=False)


def test_cli_import_of_an_app_state_wrapper_resumes_at_one_rank(saved, tmp_path):
    """``deepfreeze import --format dcp`` of DCP's {"app": AppState} layout (the default prefixes
    first: the error names the keys found and the prefixes to pass); a Checkpointer(resume=True)
    in this plain process (1 rank) starts at step 6 with the model, optimizer state and lrs
    recorded, and numbers its next version 8 (every 2 steps)."""
    sys.path.insert(0, WORKERS)
    from torch_train import build, snapshot
    import deepfreeze.torch as dft
    out = str(tmp_path)
    src = os.path.join(saved, "dcp_app")
    with pytest.raises(ConfigError, match=r"top-level keys are \['app'\].*model_prefix='app.model', "
                                          r"optim_prefix='app.optim'"):
        dft.import_dcp(src, None, "app", S, **_levels(out))
    args = ["import", "--format", "dcp", src, "--name", "app", "--step", str(S), "--optimizer-groups", "1,1",
            "--model-prefix", "app.model", "--optim-prefix", "app.optim", "--set", f"scratch={out}/scratch0",
            "--set", f"persistent={out}/persistent"]
    p = _cli(*args, cwd=out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "'app' v6" in p.stdout and "param groups [1, 1]" in p.stdout
    net, opts = build(seed=123)
    with dft.Checkpointer(net, opts, None, "app", resume=True, every_n_steps=2, **_levels(out)) as ck:
        assert (ck.start_step, ck.resumed_from, ck.step) == (S, S, S)
        snapshot(net, opts, str(tmp_path / "start.npz"))
        assert_same(npz(str(tmp_path / "start.npz")), npz(os.path.join(saved, "r0", f"v{S}.npz")),
                    "resumed at 1 rank from the CLI import")
        for _ in range(2):
            net(torch.randn(8, 16)).sum().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert ck.last_version == S + 2
    assert dft.load_state(name="app", **_levels(out)).step == S + 2


def test_restore_lists_the_state_objects_an_import_lacks(saved, tmp_path, caplog):
    """restore() of an import holding no state objects: under strict=True an error naming the
    state= objects it did not find (nothing loaded); strict=False puts the model and optimizers in
    (bit-exact) and lists them; keys left out of the import are named."""
    sys.path.insert(0, WORKERS)
    from torch_train import Data, build, snapshot
    import deepfreeze.torch as dft
    out = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        r = dft.import_dcp(os.path.join(saved, "dcp"), None, "plain", S, optimizer_groups=[1, 1], **_levels(out))
    assert r.ignored == ["data", "sched0", "sched1"] and "['data', 'sched0', 'sched1']" in caplog.text
    caplog.clear()
    net, opts = build(seed=123)
    before = [t.detach().clone() for t in net.state_dict().values()]
    from deepfreeze.errors import ModelMismatchError
    with pytest.raises(ModelMismatchError, match=r"imported from dcp .*holds no state object \['data'\].*strict=False"):
        dft.restore(net, opts, name="plain", state={"data": Data(0)}, **_levels(out))  # strict=True: an error
    assert all(torch.equal(a, b) for a, b in zip(before, net.state_dict().values()))  # nothing loaded
    with caplog.at_level(logging.WARNING, logger="deepfreeze"):
        r = dft.restore(net, opts, name="plain", state={"data": Data(0)}, strict=False, **_levels(out))
    assert r == (S, S) and r.skipped == ["state object 'data' (not in the checkpoint)"], r.skipped
    assert "left out: state object 'data'" in caplog.text
    snapshot(net, opts, str(tmp_path / "restored.npz"))
    assert_same(npz(str(tmp_path / "restored.npz")), npz(os.path.join(saved, "r0", f"v{S}.npz")), "restore()")


# ---------------------------------------------------------------- hostile and damaged directories

class _Evil:
    """Unpickled, this runs ``touch <marker>``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _small_dcp(path: str, extra: dict | None = None, *, seed: int = 0, model_extra: dict | None = None
               ) -> dict[str, np.ndarray]:
    """``dcp.save`` of a small model and its SGD-momentum state into ``path`` (``extra``: more
    top-level keys; ``model_extra``: more entries of the model's dict); the model's tensors saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(5, 3)).sum().backward()
    opt.step()
    m, o = get_state_dict(net, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {**m, **(model_extra or {})}, "optim": o, **(extra or {})}, checkpoint_id=path,
                 no_dist=True)
    return {k: v.detach().numpy().copy() for k, v in m.items()}


def _same(got: dict, want: dict[str, np.ndarray]) -> bool:
    """Every tensor of ``want`` in ``got``, bit for bit."""
    return sorted(got) == sorted(want) and all(
        np.asarray(got[k]).tobytes() == want[k].tobytes() for k in want)


def _rewrite_metadata(path: str, change) -> None:
    """Edit the (trusted, self-made) metadata of ``path`` and write it back."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    change(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def test_hostile_metadata_is_refused_and_nothing_runs(tmp_path):
    """A .metadata that would call os.system is refused naming the callable (API and CLI, exit 1,
    one line); the marker it would create does not exist."""
    import deepfreeze.torch as dft
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    marker = tmp_path / "pwned"
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    with pytest.raises(CorruptCheckpointError, match=r"names posix\.system.*refused before anything ran"):
        dft.import_dcp(src, None, "x", 1, **_levels(str(tmp_path)))
    p = _cli("import", "--format", "dcp", src, "--name", "x", "--step", "1", "--set", f"scratch={tmp_path}/s",
             "--set", f"persistent={tmp_path}/p", cwd=str(tmp_path))
    assert p.returncode == 1 and "posix.system" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "p" / "x" / "lease"), "nothing is written for a refused import"


def test_hostile_bytes_item_is_refused_and_nothing_runs(tmp_path):
    """A bytes item that would call os.system (torch.save of it, as dcp.save writes any object) is
    refused by the weights_only load when asked for, and never read when it is not."""
    import deepfreeze.torch as dft
    marker = tmp_path / "pwned"
    src = str(tmp_path / "dcp")
    _small_dcp(src, {"evil": {"x": _Evil(str(marker))}})
    r = dft.import_dcp(src, None, "ok", 2, **_levels(str(tmp_path / "a")))
    assert r.ignored == ["evil"] and not marker.exists()
    with pytest.raises(CorruptCheckpointError, match=r"'evil\.x'.*weights_only"):
        dft.import_dcp(src, None, "bad", 2, state={"e": "evil"}, **_levels(str(tmp_path / "b")))
    assert not marker.exists()


@pytest.mark.parametrize("damage, match", [
    (lambda md: setattr(next(iter(md.storage_data.values())), "length", 10 ** 9), "outside its"),
    (lambda md: setattr(next(iter(md.storage_data.values())), "relative_path", "../etc"), "not a plain file name"),
    (lambda md: setattr(md.state_dict_metadata["model.0.weight"], "size", torch.Size([400, 300])), "cover"),
    (lambda md: md.state_dict_metadata["model.0.weight"].chunks.append(
        md.state_dict_metadata["model.0.weight"].chunks[0]), "overlap"),
    (lambda md: setattr(md, "storage_data", []), "not DCP metadata"),
])
def test_damaged_metadata_is_refused(tmp_path, damage, match):
    import deepfreeze.torch as dft
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    _rewrite_metadata(src, damage)
    with pytest.raises(CorruptCheckpointError, match=match):
        dft.import_dcp(src, None, "x", 1, **_levels(str(tmp_path)))


def test_bad_arguments(tmp_path):
    import deepfreeze.torch as dft
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    lv = _levels(str(tmp_path))
    with open(os.path.join(src, ".metadata"), "rb") as f:
        data = f.read()
    for bad, match in (({"step": -1}, "step = -1"), ({"optimizer_groups": [2]}, "adds up to 2"),
                       ({"optimizer_groups": [0]}, "positive group counts"), ({"model_prefix": "a..b"}, "model_prefix"),
                       ({"state": {"s": "nope"}}, r"no key under 'nope'.*\['model', 'optim'\]")):
        kw = {"step": 1, **bad}
        with pytest.raises(ConfigError, match=match):
            dft.import_dcp(src, None, "x", **kw, **lv)
    assert dft.import_dcp(src, None, "again", 1, **lv).version == 1
    with pytest.raises(ExistingCheckpointError, match=r"'again' already has committed versions.*overwrite=True"):
        dft.import_dcp(src, None, "again", 2, **lv)
    assert dft.import_dcp(src, None, "again", 2, overwrite=True, **lv).version == 2
    assert dft.load_state(name="again", **lv).step == 2
    with pytest.raises(ConfigError, match="no .metadata"):
        dft.import_dcp(str(tmp_path), None, "x", 1, **lv)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="not a readable DCP metadata pickle"):
        dft.import_dcp(src, None, "x", 1, **lv)


def test_start_step(tmp_path):
    """Checkpointer(start_step=S): steps and versions continue from S; with resume=True the resumed
    version's step wins, and S serves a name without versions; a bad value is refused."""
    from deepfreeze.torch import Checkpointer
    lv = _levels(str(tmp_path))

    def build():
        net = torch.nn.Linear(3, 2)
        return net, torch.optim.SGD(net.parameters(), lr=0.1)

    def train(net, opt, n):
        for _ in range(n):
            net(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    net, opt = build()
    for bad in (-1, "3", True, 2.0):
        with pytest.raises(ConfigError, match="start_step"):
            Checkpointer(net, opt, None, "s", start_step=bad, **lv)
    with Checkpointer(net, opt, None, "s", start_step=15, every_n_steps=2, **lv) as ck:
        assert ck.start_step == 15 and ck.step == 15
        train(net, opt, 3)
        assert ck.step == 18 and ck.last_version == 16  # (v18 is written at close)
    with Checkpointer(*build(), None, "s", resume=True, start_step=4, **lv) as ck:
        assert (ck.start_step, ck.resumed_from) == (18, 18)
    with Checkpointer(*build(), None, "fresh", resume=True, start_step=4, **lv) as ck:
        assert (ck.start_step, ck.resumed_from, ck.step) == (4, None, 4)


def test_top_level_model_and_flattened_optimizer_layout(tmp_path):
    """``{**model_sd, "optim": ...}`` with ``flatten_optimizer_state_dict=True`` (param_groups keyed
    by FQN; two groups of different lr) and a stray top-level value: model_prefix='' imports the
    tensors, leaves the value out (named), and restore() puts back both groups bit-exact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    import deepfreeze.torch as dft

    def build(lr):
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        return net, torch.optim.AdamW([{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.5}],
                                      lr=lr)
    torch.manual_seed(0)
    net, opt = build(1e-3)
    net(torch.randn(5, 3)).sum().backward()
    opt.step()
    m, o = get_state_dict(net, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert any(k.startswith("param_groups.1.weight.") for k in o), "not the flattened layout: the test does not test"
    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**m, "optim": o, "step": 7}, checkpoint_id=src, no_dist=True)
    r = dft.import_dcp(src, None, "flat", 1, model_prefix="", **_levels(str(tmp_path)))
    assert (r.model_tensors, r.param_groups, r.ignored) == (4, [2], ["step"])
    net2, opt2 = build(1.0)
    assert dft.restore(net2, opt2, name="flat", **_levels(str(tmp_path))) == (1, 1)
    for (k, a), (k2, b) in zip(net.state_dict().items(), net2.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert all(torch.equal(s1["state"][i][k], s2["state"][i][k]) for i in s1["state"] for k in s1["state"][i])


def test_mutated_metadata_never_escapes_as_another_error(tmp_path):
    """600 random byte mutations of a real .metadata (seeded): read_dcp_metadata either returns
    checked metadata or raises a DeepFreezeError (CorruptCheckpointError, ConfigError), never
    another exception; nothing the bytes could name runs."""
    import random
    from deepfreeze.errors import DeepFreezeError
    from deepfreeze.torch.dcp_import import read_dcp_metadata
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    with open(os.path.join(src, ".metadata"), "rb") as f:
        data = f.read()
    rng = random.Random(31)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(600):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(b))
            op = rng.random()
            if op < 0.6:
                b[pos] = rng.randrange(256)
            elif op < 0.8:
                del b[pos:pos + rng.randint(1, 8)]
            else:
                b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        with open(os.path.join(src, ".metadata"), "wb") as f:
            f.write(bytes(b))
        try:
            read_dcp_metadata(src)
            outcomes["ok"] += 1
        except DeepFreezeError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 500, outcomes


def test_mutated_data_file_is_refused_or_read_never_another_error(tmp_path):
    """100 seeded byte flips in a real data file (.distcp: torch.save zips of tensors and bytes
    items): reading either succeeds (a flip inside a tensor's bytes: DCP files carry no checksum)
    or raises a DeepFreezeError, never another exception."""
    import random
    from deepfreeze.errors import DeepFreezeError
    from deepfreeze.torch.dcp_import import _read
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    (name,) = [f for f in os.listdir(src) if f.endswith(".distcp")]
    with open(os.path.join(src, name), "rb") as f:
        data = f.read()
    rng = random.Random(5)
    refused = 0
    for _ in range(100):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        with open(os.path.join(src, name), "wb") as f:
            f.write(bytes(b))
        try:
            _read(src, "model", "optim", {})
        except DeepFreezeError:
            refused += 1
    assert refused > 20, refused


@pytest.mark.slow
def test_import_of_an_fsdp2_dcp_checkpoint(tmp_path):
    """A 2-rank FSDP2 job's dcp.save (parameters and optimizer state as DTensor chunks, uneven and
    empty shards) imports in one process: ``load`` gives the full tensors the job gathered, and
    ``restore`` puts them, with both optimizers' groups, into a plain model."""
    sys.path.insert(0, WORKERS)
    from torch_fsdp import build, optimizers
    import deepfreeze.torch as dft
    out = str(tmp_path)
    torchrun(2, os.path.join(WORKERS, "torch_fsdp_dcp_save.py"), out)
    r = dft.import_dcp(os.path.join(out, "dcp"), None, "fs", 3, optimizer_groups=[1, 1], **_levels(out))
    assert r.param_groups == [1, 1]
    want = npz(os.path.join(out, "r0", "v3.npz"))
    got = {k: v.numpy() for k, v in dft.load(name="fs", **_levels(out)).items()}
    assert_same(got, want, "the FSDP2 DCP import", lr=False)
    net = build(seed=5)
    opts = optimizers(net)
    dft.restore(net, opts, name="fs", **_levels(out))
    assert [g["lr"] for o in opts for g in o.param_groups] == list(want["__lr__"])
    for k, v in net.state_dict().items():
        assert v.numpy().tobytes() == want[k].tobytes(), k


# ---------------------------------------------------------------- one open per file (issue 41)

def _data_file(src: str) -> str:
    (name,) = [f for f in os.listdir(src) if f.endswith(".distcp")]
    return name


def test_data_file_replaced_by_a_link_after_the_check_is_never_read(tmp_path):
    """The directory's owner replaces the data file with a symlink to other weights (same layout)
    right after the metadata check (a reader subclass, the documented test seam of ``_read``):
    the import reads the file that was checked, the directory's own weights, bit for bit (before
    issue 41 DCP's reader opened the path again and imported the other weights). A fresh import
    of the directory as it now is refuses the link."""
    from deepfreeze.torch.dcp_import import SafeFileSystemReader, _read
    src, other = str(tmp_path / "dcp"), str(tmp_path / "other")
    own = _small_dcp(src)
    foreign = _small_dcp(other, seed=1)
    name = _data_file(src)
    assert name == _data_file(other) and not _same(own, foreign)

    class Swapping(SafeFileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = super().read_metadata(*args, **kwargs)
            if not os.path.islink(os.path.join(src, name)):
                os.rename(os.path.join(src, name), os.path.join(src, name + ".aside"))
                os.symlink(os.path.join(other, name), os.path.join(src, name))
            return md
    model, *_ = _read(src, "model", "optim", {}, reader=Swapping)
    assert os.path.islink(os.path.join(src, name)), "the hook did not run: the test does not test"
    assert _same({k: v.numpy() for k, v in model.items()}, own)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        _read(src, "model", "optim", {})


def test_a_file_of_a_third_user_and_a_linked_directory_are_refused(tmp_path):
    """A data file owned by neither the directory's owner, the importing user nor root (a hard
    link to a third user's file) is an UnsafePathError naming its owner (as root: the file given
    to ``daemon``); the directory given through a symlink is one too (never followed)."""
    import deepfreeze.torch as dft
    from deepfreeze.errors import UnsafePathError
    src = str(tmp_path / "dcp")
    _small_dcp(src)
    os.symlink(src, str(tmp_path / "link"))
    with pytest.raises(UnsafePathError, match="symbolic link"):
        dft.import_dcp(str(tmp_path / "link"), None, "x", 1, **_levels(str(tmp_path)))
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (the link case above ran)")
    os.chown(os.path.join(src, _data_file(src)), 1, 1)
    with pytest.raises(UnsafePathError, match=r"owned by daemon.*not imported"):
        dft.import_dcp(src, None, "x", 1, **_levels(str(tmp_path)))
    assert not os.path.exists(tmp_path / "persistent" / "x" / "lease"), "nothing is written for a refused import"


def _flip(d: str, name: str, keep: str, foreign: str, stop: str) -> None:
    """(A forked child, as the directory's owner) flip ``d/name`` between a symlink to
    ``foreign`` and a hard link of ``keep`` (the directory's own data), each by an atomic rename,
    until ``stop`` exists."""
    path, tmp = os.path.join(d, name), os.path.join(d, name + ".tmp")
    while not os.path.exists(stop):
        for make in (lambda: os.symlink(foreign, tmp), lambda: os.link(keep, tmp)):
            make()
            os.replace(tmp, path)


@pytest.mark.slow
def test_two_user_race_never_imports_a_third_users_weights(tmp_path):
    """The security test's race, for real: as root, a DCP directory owned by ``nobody``, whose
    process flips the data file between the directory's own (a regular file) and a symlink to a
    third user's (``daemon``'s, mode 0600) file of other weights, all through 30 imports. Each
    import is refused or commits the directory's own weights, bit for bit; none commits the
    third user's (before issue 41: 2 of 30 did)."""
    import pwd
    import tempfile
    import deepfreeze.torch as dft
    from deepfreeze.errors import DeepFreezeError
    if os.geteuid() != 0:
        pytest.skip("the two-user race needs root (to act as nobody and to own a third user's file)")
    nobody = pwd.getpwnam("nobody")
    base = tempfile.mkdtemp(prefix="df-race-", dir="/tmp")  # (pytest's tmp_path is 0700: nobody cannot enter)
    try:
        os.chmod(base, 0o755)
        src, other, private = (os.path.join(base, n) for n in ("dcp", "other", "private"))
        own = _small_dcp(src)
        foreign = _small_dcp(other, seed=1)
        name = _data_file(src)
        os.makedirs(private, mode=0o700)
        shutil.copy(os.path.join(other, name), os.path.join(private, name))
        for p in (private, os.path.join(private, name)):
            os.chown(p, 1, 1)  # daemon's: a third user
        os.chmod(os.path.join(private, name), 0o600)
        keep = os.path.join(src, name + ".keep")
        os.link(os.path.join(src, name), keep)
        for p in (src, *(os.path.join(src, f) for f in os.listdir(src))):
            os.chown(p, nobody.pw_uid, nobody.pw_gid)
        stop = os.path.join(base, "stop")
        pid = os.fork()  # (the venv's python may not be executable by nobody: a fork, not a new process)
        if pid == 0:
            code = 1
            try:
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                _flip(src, name, keep, os.path.join(private, name), stop)
                code = 0
            finally:
                os._exit(code)
        outcomes = {"own": 0, "refused": 0, "foreign": 0}
        try:
            for i in range(30):
                lv = _levels(str(tmp_path / f"i{i}"))
                try:
                    dft.import_dcp(src, None, "race", 1, **lv)
                except DeepFreezeError:
                    outcomes["refused"] += 1
                    continue
                got = {k: v.numpy() for k, v in dft.load(name="race", **lv).items() if k in own}
                kind = "own" if _same(got, own) else "foreign" if _same(got, foreign) else "other"
                outcomes[kind] = outcomes.get(kind, 0) + 1
        finally:
            open(stop, "w").close()
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the flipper (nobody) failed: the race was not run"
        print("two-user race, 30 imports:", outcomes)
        assert outcomes["foreign"] == 0 and set(outcomes) == {"own", "refused", "foreign"}, outcomes
        assert outcomes["own"] + outcomes["refused"] == 30, outcomes
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------- bounded imports, reserved names (issue 41)

def test_a_huge_list_index_in_planner_data_is_refused_before_anything_is_allocated(tmp_path):
    """The security test's 20-byte edit: a ``state=``-mapped key whose planner-data path ends in a
    list index of 2*10^7 (and 2^63 - 1) is a CorruptCheckpointError naming the key and the index,
    with under 64 MiB allocated meanwhile (before issue 41: +500 MB and 34 s, then a misleading
    ConfigError; with the larger index until memory ran out). A valid index imports."""
    import tracemalloc
    import deepfreeze.torch as dft
    src = str(tmp_path / "dcp")
    _small_dcp(src, {"sched": {"n": 3, "t": [torch.ones(2), torch.zeros(3)]}})
    with open(os.path.join(src, ".metadata"), "rb") as f:
        data = f.read()
    r = dft.import_dcp(src, None, "ok", 1, state={"s": "sched"}, **_levels(str(tmp_path / "ok")))
    assert r.state == ["s"]
    for index in (2 * 10 ** 7, 2 ** 63 - 1, -1):
        with open(os.path.join(src, ".metadata"), "wb") as f:
            f.write(data)
        _rewrite_metadata(src, lambda md: md.planner_data.__setitem__("sched.t.1", ("sched", "t", index)))
        tracemalloc.start()
        try:
            with pytest.raises(CorruptCheckpointError, match=rf"key 'sched\.t\.1'.*list index {index}\b"):
                dft.import_dcp(src, None, "x", 1, state={"s": "sched"}, **_levels(str(tmp_path)))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, peak


def test_a_reserved_tensor_name_is_refused_and_retires_nothing(tmp_path):
    """A DCP key ``model._deepfreeze/rank0`` (named like DeepFreeze's own state record) imported
    with overwrite=True over a name with a committed version: a ConfigError naming the key, and
    the older version is still the one readers find (before issue 41 the import "succeeded" into
    a version every reader ignored, after retiring the older one)."""
    import deepfreeze.torch as dft
    lv = _levels(str(tmp_path))
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    own = _small_dcp(good)
    _small_dcp(bad, model_extra={"_deepfreeze/rank0": torch.zeros(8, dtype=torch.uint8)})
    assert dft.import_dcp(good, None, "n", 1, **lv).version == 1
    with pytest.raises(ConfigError, match=r"'_deepfreeze/rank0'.*reserved"):
        dft.import_dcp(bad, None, "n", 2, overwrite=True, **lv)
    assert dft.load_state(name="n", **lv).step == 1
    got = {k: v.numpy() for k, v in dft.load(name="n", **lv).items() if k in own}
    assert _same(got, own)


def test_checkpointer_refuses_two_tensors_with_one_name(tmp_path):
    """A model whose module path spells an optimizer-state name (``optim.state.lin.weight.
    momentum_buffer``, the name the Checkpointer gives SGD's momentum of ``lin.weight``): the
    checkpoint is refused at plan time naming the key (before issue 41 a version was written
    that every reader refuses)."""
    from deepfreeze.torch import Checkpointer
    net = torch.nn.Module()
    net.lin = torch.nn.Linear(2, 2)
    holder = torch.nn.Module()
    holder.register_buffer("momentum_buffer", torch.zeros(2, 2))
    net.optim = torch.nn.Module()
    net.optim.state = torch.nn.Module()
    net.optim.state.lin = torch.nn.Module()
    net.optim.state.lin.weight = holder
    opt = torch.optim.SGD(net.lin.parameters(), lr=0.1, momentum=0.9)
    net.lin(torch.ones(1, 2)).sum().backward()
    opt.step()
    ck = Checkpointer(net, opt, None, "dup", **_levels(str(tmp_path)))
    try:
        with pytest.raises(ConfigError, match=r"two tensors are named 'optim\.state\.lin\.weight\.momentum_buffer'"):
            ck.checkpoint()
    finally:
        ck.close()
