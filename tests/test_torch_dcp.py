"""``deepfreeze.torch.Reader`` (a DCP StorageReader) and ``deepfreeze export --format dcp``.

One 2-rank DDP run under torchrun (gloo) records its state after each checkpointed iteration
(tests/workers/torch_train.py); everything read through DCP is compared bit for bit with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import WORKERS  # noqa: E402
from test_torch import TRAIN, _env, assert_same, info, npz, plain, torchrun  # noqa: E402

LOAD = os.path.join(WORKERS, "torch_dcp_load.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 ranks, 7 steps, a checkpoint every 3 (v3, v6) and save_last's v7 at close (the final state,
    recorded as v7.npz), async flushes (closed: all on persistent)."""
    out = str(tmp_path_factory.mktemp("dcprun"))
    torchrun(2, TRAIN, out, "steps=7")
    return out


def _reader(run: str, **kw):
    from deepfreeze.torch import Reader
    return Reader(name=kw.pop("name", "tt"), mode="sync", scratch=os.path.join(run, "scratch0"),
                  persistent=os.path.join(run, "persistent"), **kw)


def _template():
    sys.path.insert(0, WORKERS)
    from torch_train import build
    from torch.distributed.checkpoint.state_dict import get_state_dict
    net, opts = build(seed=123)
    model_sd, optim_sd = get_state_dict(net, opts)
    return net, opts, {**model_sd, "optim": optim_sd}


def _flat(sd: dict) -> dict[str, np.ndarray]:
    """Model tensors by FQN, optimizer tensors as optim.state.<fqn>.<key>, lrs as __lr__."""
    out = {k: v.numpy() for k, v in sd.items() if k != "optim"}
    out.update({f"optim.state.{f}.{k}": v.numpy() for f, kv in sd["optim"]["state"].items() for k, v in kv.items()
                if isinstance(v, torch.Tensor)})
    out["__lr__"] = np.array([g["lr"] for g in sd["optim"]["param_groups"]], dtype=np.float64)
    return out


def _dcp_load(sd: dict, **kw) -> None:
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ...": one process, as intended
        dcp.load(sd, **kw)


def test_reader_in_a_plain_process(run):
    """dcp.load with no process group fills a get_state_dict state dict with v3 and v6 exactly
    (model, optimizer state, param_groups), and set_state_dict puts it into a fresh model."""
    for v in (3, 6):
        net, opts, sd = _template()
        reader = _reader(run, version=v)
        _dcp_load(sd, storage_reader=reader)
        assert reader.loaded_version == v
        want = npz(os.path.join(run, "r0", f"v{v}.npz"))
        assert_same(_flat(sd), want, f"dcp.load of v{v}")
        assert sd["optim"]["param_groups"][0]["params"][0] == "body.0.weight"
        assert sd["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    reader = _reader(run)  # version=None: the newest
    md = reader.read_metadata()
    assert reader.loaded_version == 7
    w = md.state_dict_metadata["body.0.weight"]
    assert len(w.chunks) == 1 and list(w.chunks[0].sizes) == list(w.size) and list(w.chunks[0].offsets) == [0, 0]
    assert not any(k.startswith("_deepfreeze") for k in md.state_dict_metadata)


def test_reader_under_torchrun(run, tmp_path):
    """Two ranks (DDP) each dcp.load through a collective reader: both equal the recorded v6 (the
    same plan on both ranks: one pooled read). Then rank 1 asks for the model only (other plans:
    each rank reads its own tensors), newest version (v7, save_last's)."""
    out = str(tmp_path / "same")
    # the two loads in one job (tests/workers/torch_dcp_load.py ``--``)
    torchrun(2, LOAD, out, run, "version=6", "--", str(tmp_path / "differ"), "model_only_rank=1")
    want = npz(os.path.join(run, "r0", "v6.npz"))
    for r in (0, 1):
        assert info(out, r) == {"version": 6, "world_size": 2}
        assert_same(npz(os.path.join(out, f"r{r}", "loaded.npz")), want, f"rank {r} loaded through DCP")
    out = str(tmp_path / "differ")  # the job's second load: model_only_rank=1
    assert info(out, 0)["version"] == info(out, 1)["version"] == 7
    want = npz(os.path.join(run, "r0", "v7.npz"))
    assert_same(npz(os.path.join(out, "r0", "loaded.npz")), want, "rank 0 (everything)")
    got1 = npz(os.path.join(out, "r1", "loaded.npz"))
    model_keys = [k for k in want if not k.startswith(("optim.", "__"))]
    assert_same({k: got1[k] for k in model_keys}, {k: want[k] for k in model_keys}, "rank 1 (the model only)")
    assert any(not np.array_equal(got1[k], want[k]) for k in want if k.startswith("optim.")), \
        "rank 1's optimizer state equals the checkpoint's though it did not load it: the test does not test"


def test_reader_newest_in_a_plain_worker(run, tmp_path):
    out = str(tmp_path)
    plain(LOAD, out, run)
    assert info(out, 0)["version"] == 7
    assert_same(npz(os.path.join(out, "r0", "loaded.npz")), npz(os.path.join(run, "r0", "v7.npz")), "plain worker")


def test_reader_bad_input(run):
    """A wrong name or version is DeepFreeze's CheckpointNotFoundError (quoted by dcp.load); read
    requests outside a tensor or its bytes are refused before anything is copied."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    from deepfreeze.errors import CheckpointNotFoundError, ConfigError
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint named 'nope'"):
        _reader(run, name="nope").read_metadata()
    with pytest.raises(CheckpointNotFoundError, match="version 99"):
        _reader(run, version=99).read_metadata()
    _, _, sd = _template()
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException)
    with pytest.raises(CheckpointException, match="version 99 of checkpoint 'tt' is not committed"):
        _dcp_load(sd, storage_reader=_reader(run, version=99))
    with pytest.raises(ConfigError, match="checkpoint_id"):
        _dcp_load(sd, storage_reader=_reader(run), checkpoint_id="/tmp/x")

    reader = _reader(run, version=6)
    md = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(sd, md, True)
    reader.set_up_storage_reader(md, True)
    before = sd["head.weight"].clone()

    def item(key, offsets, lengths, kind=LoadItemType.TENSOR):
        return ReadItem(kind, MetadataIndex(key), torch.Size([0] * len(lengths)), MetadataIndex(key),
                        torch.Size(offsets), torch.Size(lengths))
    for offs, lens in (([0, 190], [4, 3]), ([4, 0], [1, 192]), ([0], [4])):  # head.weight is 4 x 192
        with pytest.raises(ConfigError, match="head.weight"):
            reader.read_data(LoadPlan([item("head.weight", offs, lens)]), planner)
    assert torch.equal(sd["head.weight"], before)
    with pytest.raises(ConfigError, match="outside its"):
        reader.read_data(LoadPlan([item("optim.param_groups.0.lr", [10 ** 6], [0], LoadItemType.BYTE_IO)]), planner)
    with pytest.raises(ConfigError, match="does not hold"):
        reader.read_data(LoadPlan([item("no.such.key", [0], [1])]), planner)
    # a partial read inside the bounds is served exactly
    reader.read_data(LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex("head.weight"), torch.Size([1, 2]),
                                        MetadataIndex("head.weight"), torch.Size([1, 2]), torch.Size([2, 5]))]),
                     planner)
    want = npz(os.path.join(run, "r0", "v6.npz"))["head.weight"]
    assert sd["head.weight"][1:3, 2:7].numpy().tobytes() == want[1:3, 2:7].tobytes()


def test_export_dcp_round_trip(run, tmp_path):
    """``deepfreeze export --format dcp -o DIR`` writes a DCP directory that dcp.load reads back
    bit-exact; an existing output needs --force, and only a DCP directory is replaced."""
    common = ["--name", "tt", "--set", "mode=sync", "--set", f"scratch={run}/scratch0",
              "--set", f"persistent={run}/persistent"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deepfreeze", *args, *common], capture_output=True, text=True,
                              timeout=120, env=_env(), cwd=str(tmp_path))
    outdir = tmp_path / "v3.dcp"
    p = cli("export", "--version", "3", "--format", "dcp", "-o", str(outdir))
    assert p.returncode == 0, p.stdout + p.stderr
    assert (outdir / ".metadata").is_file()
    _, _, sd = _template()
    _dcp_load(sd, checkpoint_id=str(outdir))
    assert_same(_flat(sd), npz(os.path.join(run, "r0", "v3.npz")), "export --format dcp v3")
    p = cli("export", "--version", "6", "--format", "dcp", "-o", str(outdir))
    assert p.returncode != 0 and "--force" in p.stdout + p.stderr
    p = cli("export", "--version", "6", "--format", "dcp", "-o", str(outdir), "--force")
    assert p.returncode == 0, p.stdout + p.stderr
    _, _, sd = _template()
    _dcp_load(sd, checkpoint_id=str(outdir))
    assert_same(_flat(sd), npz(os.path.join(run, "r0", "v6.npz")), "export --format dcp v6 (--force)")
    other = tmp_path / "notdcp"
    other.mkdir()
    (other / "keep").write_text("x")
    p = cli("export", "--format", "dcp", "-o", str(other), "--force")
    assert p.returncode != 0 and "not a DCP checkpoint" in p.stdout + p.stderr and (other / "keep").exists()
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f or ".old-" in f]


@pytest.mark.parametrize("whose", ["nobody", "world-writable"])
def test_export_torch_and_dcp_refuse_an_output_directory_another_user_controls(tmp_path, whose):
    """Issue 41, item 2: ``write_torch`` and ``write_dcp`` (``deepfreeze export --format torch|dcp``)
    into a directory of another user (or one every user may write in) raise UnsafePathError naming
    the directory, its owner and mode, before a byte is written. Before: written there."""
    import deepfreeze.torch as dft
    from deepfreeze.errors import UnsafePathError
    from deepfreeze import Config
    from deepfreeze.loader import load
    from deepfreeze.torch.dcp import write_dcp
    from deepfreeze.torch.export import write_torch
    from test_cli import unsafe_output_dir
    kw = {"mode": "sync", "scratch": str(tmp_path / "s"), "persistent": str(tmp_path / "p")}
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with dft.Checkpointer(net, opt, name="out", every_n_steps=1, **kw):
        for _ in range(2):
            net(torch.ones(1, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    got = load(Config.load(None, **kw), "out")
    d, names = unsafe_output_dir(tmp_path, whose)
    with pytest.raises(UnsafePathError, match=f"{d} \\(owned by .*{names}"):
        write_torch(got, os.path.join(d, "m.pt"))
    with pytest.raises(UnsafePathError, match="breaks the rule for output directories"):
        write_dcp(got, os.path.join(d, "m.dcp"))
    assert os.listdir(d) == []
    mine = tmp_path / "mine"
    mine.mkdir()
    assert write_torch(got, str(mine / "m.pt")) > 0 and write_dcp(got, str(mine / "m.dcp")) > 0
    assert sorted(os.listdir(mine)) == ["m.dcp", "m.pt"]
