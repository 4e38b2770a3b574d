"""DeepFreeze for PyTorch FSDP2 (``fully_shard``): 2-rank jobs under torchrun (gloo, CPU).

Every check is against state the run itself recorded: tests/workers/torch_fsdp.py gathers the
full state with ``get_state_dict(full_state_dict=True)`` right after each checkpointed
iteration, per rank. The model shards unevenly (5 rows on 2 ranks: 3 + 2; on 3 ranks: 2 + 2 +
1) and, for some ranks, emptily (``head.weight`` has one row).
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import WORKERS, as_in_a_test  # noqa: E402
from test_torch import assert_same, info, npz, plain, torchrun  # noqa: E402

FSDP = os.path.join(WORKERS, "torch_fsdp.py")
BUFFERS = ("body.3.running_mean", "body.3.running_var", "body.3.num_batches_tracked")


def load(out: str, version: int, rank: int = 0, **kw) -> dict[str, np.ndarray]:
    """``deepfreeze.torch.load`` in this (plain) process, as numpy arrays."""
    import deepfreeze.torch as dft
    got = dft.load(name="ff", version=version, mode="sync", scratch=os.path.join(out, f"scratch{rank}"),
                   persistent=os.path.join(out, "persistent"), **kw)
    return {k: v.numpy() for k, v in got.items()}


def recorded(out: str, rank: int, version: int, buffers: bool = True) -> dict[str, np.ndarray]:
    want = npz(os.path.join(out, f"r{rank}", f"v{version}.npz"))
    return {k: a for k, a in want.items() if buffers or k not in BUFFERS}


#: test_fsdp_kill9_at_a_write_once_crash_point_then_resume's cases: (crash point, mode)
CRASH_CASES = [("persistent.direct.write", "async"), ("persistent.direct.fsync", "sync")]


@pytest.fixture(scope="module")
def fsdp_and_crashed(tmp_path_factory):
    """The run of :func:`fsdp_run`, and the runs test_fsdp_kill9_at_a_write_once_crash_point_then_resume
    kills: each killed at its crash point in a job of its own, what the test checks before the
    relaunch recorded; then one job relaunches both with resume=True and then makes the
    uninterrupted run (tests/workers/torch_fsdp.py ``train ... --``). Returns (the uninterrupted
    run's OUT, {(point, mode): {"out", "returncode", "crashed", "stderr", "committed", "scratch_files"}})."""
    from deepfreeze.config import Config
    from deepfreeze.loader import list_versions
    crashed, relaunch = {}, []
    for point, mode in CRASH_CASES:
        d = tmp_path_factory.mktemp("fsdp_crash")
        out = str(d / "job")
        with as_in_a_test(tmp_path_factory), pytest.MonkeyPatch.context() as mp:
            mp.setenv("DEEPFREEZE_CRASH_AT", f"{point}:3")  # the third version written: v9 (v3, v6 before)
            mp.setenv("DEEPFREEZE_CRASH_ONCE", str(d / "crashed"))
            p = torchrun(2, FSDP, "train", out, "steps=10", f"mode={mode}", check=False)
        cfg = Config.resolve(None, mode="sync", scratch=os.path.join(out, "scratch0"),
                             persistent=os.path.join(out, "persistent"))
        crashed[point, mode] = {
            "out": out, "returncode": p.returncode, "crashed": os.path.exists(d / "crashed"), "stderr": p.stderr,
            "committed": sorted(v for v, where in list_versions(cfg, "ff").items() if "persistent" in where),
            "scratch_files": glob.glob(os.path.join(out, "scratch*", "ff", "v*", "r*.dfs"))}
        relaunch += [out, "steps=10", f"mode={mode}", "resume=1", "--"]
    out = str(tmp_path_factory.mktemp("fsdp"))
    with as_in_a_test(tmp_path_factory):
        torchrun(2, FSDP, "train", *relaunch, out, "steps=10", "mutate_at=3", "on_error=warn", timeout=480)
    return out, crashed


@pytest.fixture(scope="module")
def fsdp_run(fsdp_and_crashed):
    """One uninterrupted 2-rank FSDP2 run: two optimizers (AdamW, SGD with momentum), a
    scheduler, BatchNorm buffers, dropout; a checkpoint every 3 steps, asynchronous; a sharded
    parameter changed in place (by 1.0: values unchanged) while v3 is captured (torn, not written)."""
    return fsdp_and_crashed[0]


#: the restores of the tests below, one job per world size: n -> the layouts (and versions) it restores, one
#: after the other (tests/workers/torch_fsdp.py ``layouts=``), each into a fresh model, under OUT/<layout>/;
#: the 2-rank job then makes test_hsdp_and_tensor_parallel_are_refused's two Checkpointers (OUT/refuse/)
RESTORES = {1: ["layouts=fsdp:6"], 2: ["layouts=fsdp:6,fsdp-dcp:6,ddp:9", "then_refuse=1"],
            3: ["layouts=fsdp:6,fsdp-dcp:6"]}


@pytest.fixture(scope="module")
def restored(fsdp_run, tmp_path_factory):
    """``restored(n, layout)``: the directory of that restore of the run at n ranks (the job of
    :data:`RESTORES` at n ranks runs once, when a test first asks for one of its restores)."""
    jobs: dict[int, str] = {}

    def get(n: int, layout: str) -> str:
        if n not in jobs:
            out = str(tmp_path_factory.mktemp(f"fsdp_restored{n}"))
            with as_in_a_test(tmp_path_factory):
                torchrun(n, FSDP, "restore", out, fsdp_run, *RESTORES[n])
            jobs[n] = out
        return os.path.join(jobs[n], layout)
    return get


# -- the plan and the chunking rule (no processes)

def test_given_bounds_make_the_plan():
    from deepfreeze.shardplan import ShardPlan, TensorSpec
    ts = [TensorSpec(0, "w", "float32", (5, 4)), TensorSpec(1, "h", "float32", (1, 3)),
          TensorSpec(2, "step", "float32", ()), TensorSpec(3, "z", "float32", (0, 2)),
          TensorSpec(4, "big", "float32", (4096,))]
    plan = ShardPlan.build(ts, 2, min_shard_bytes=1024, given={0: [0, 12, 20], 1: [0, 3, 3], 3: [0, 0, 0]})
    by = {t: [(p.rank, p.start, p.stop) for p in plan.pieces if p.tensor_id == t] for t in range(5)}
    assert by[0] == [(0, 0, 12), (1, 12, 20)]  # as given, not the plan's own 64-byte split
    assert by[1] == [(0, 0, 3)]  # the empty shard of rank 1 makes no piece
    assert len(by[3]) == 1 and by[3][0][1:] == (0, 0)  # zero-size: whole, to one rank
    assert by[4] == [(0, 0, 2048), (1, 2048, 4096)]  # not given: split as before
    again = ShardPlan.from_json(ts, json.loads(json.dumps(plan.to_json())))  # the manifest's plan validates
    assert again.pieces == plan.pieces
    for bad in ({0: [0, 12]}, {0: [0, 13, 12, 20][:3]}, {0: [1, 12, 20]}, {0: [0, 12, 21]}, {9: [0, 0, 0]}):
        with pytest.raises(ValueError):
            ShardPlan.build(ts, 2, given=bad)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dim0_rows_is_torch_chunk(world):
    from deepfreeze.torch._state import dim0_rows
    for n in range(0, 11):
        b = dim0_rows(n, world)
        chunks = torch.arange(n).chunk(world) if n else ()
        want = [len(c) for c in chunks] + [0] * (world - len(chunks))  # chunk gives fewer pieces: empty shards
        assert [b[r + 1] - b[r] for r in range(world)] == want and b[0] == 0 and b[-1] == n


def test_received_ranges_are_bounds_checked():
    """What a participant receives in the ranged scratch exchange is checked against what it
    asked for and against the buffer's length before a byte is used."""
    from deepfreeze.errors import CorruptCheckpointError
    from deepfreeze.loader import _frame, _unpack_ranges
    manifest = {"tensors": [{"id": 0, "name": "w", "dtype": "float32", "shape": [10]}]}
    want = {0: (0, 10)}
    ok = _unpack_ranges(_frame([[0, 2, 5]], [np.arange(3, dtype=np.float32)]), want, manifest, 1)
    assert [(t, a, b, x.view(np.float32).tolist()) for t, a, b, x in ok] == [(0, 2, 5, [0.0, 1.0, 2.0])]
    for head, data, match in (([[0, 8, 12]], np.zeros(4, np.float32), "not asked for"),
                              ([[1, 0, 1]], np.zeros(1, np.float32), "not asked for"),
                              ([[0, 3, 3]], np.zeros(0, np.float32), "not asked for"),
                              ([[0, 0, 10]], np.zeros(8, np.float32), "runs past")):
        with pytest.raises(CorruptCheckpointError, match=match):
            _unpack_ranges(_frame(head, [data]), want, manifest, 1)
    with pytest.raises(CorruptCheckpointError, match="header"):
        _unpack_ranges(_frame([[0, 0, 1]], [])[:6], want, manifest, 1)
    # what arrives must tile what was asked for: a gap or a range sent twice is refused
    from deepfreeze.loader import _assemble_ranges
    manifest.update(name="x", version=1, step=1, epoch=0)
    x = np.arange(10, dtype=np.float32).view(np.uint8)
    whole = _assemble_ranges(manifest, [(0, 0, 4, x[:16]), (0, 4, 10, x[16:])], None, None, 1)
    assert whole.arrays["w"].tolist() == list(range(10))
    for got in ([(0, 0, 4, x[:16])], [(0, 0, 4, x[:16]), (0, 4, 10, x[16:]), (0, 4, 10, x[16:])]):
        with pytest.raises(CorruptCheckpointError, match="asked for|hold only"):
            _assemble_ranges(manifest, got, None, None, 1)


# -- a 2-rank FSDP2 job

def test_fsdp_versions_bit_exact(fsdp_run):
    out = fsdp_run
    i0, i1 = info(out, 0), info(out, 1)
    assert i0["step"] == i1["step"] == 10 and i0["plans"] == 1 and i0["sharded"] == 10
    # the in-place change of mid.weight (a DTensor) during the capture of v3 tore it: v3 is not written
    assert i0["torn"] == i1["torn"] == [3] and "changed in place" in i0["failures"][0]
    from deepfreeze.config import Config
    from deepfreeze.loader import list_versions
    cfg = Config.resolve(None, mode="sync", scratch=os.path.join(out, "scratch0"),
                         persistent=os.path.join(out, "persistent"))
    assert sorted(list_versions(cfg, "ff")) == [6, 9]
    # uneven and empty local shards, as FSDP2 cut them
    assert i0["rows"]["body.0.weight"] == [0, [3, 8]] and i1["rows"]["body.0.weight"] == [1, [2, 8]]
    assert i0["rows"]["head.weight"] == [0, [1, 3]] and i1["rows"]["head.weight"] == [1, [0, 3]]
    versions = sorted(int(os.path.basename(p)[1:-4]) for p in glob.glob(os.path.join(out, "r0", "v*.npz")))
    assert versions == [3, 6, 9]
    for v in (6, 9):
        for r in (0, 1):  # from each rank's scratch (pooled: a plain process reads its own, then persistent)
            got = load(out, v, r)
            assert_same(got, recorded(out, 0, v), f"v{v} (scratch{r}) vs rank 0", lr=False)
            # parameters and optimizer state equal every rank's gathered view; buffers are rank 0's
            assert_same(got, recorded(out, 1, v, buffers=False), f"v{v} vs rank 1", lr=False)
        # the keys are get_state_dict's FQNs exactly
        assert set(load(out, v)) == set(recorded(out, 0, v)) - {"__lr__"}


def test_manifest_records_global_shapes_and_offsets(fsdp_run, tmp_path):
    """The manifest holds global tensors and every piece's global flat offsets (rank 1's empty
    shard of head.weight makes no piece); ``deepfreeze ls/inspect/verify`` read it as any other."""
    import subprocess
    import sys
    from deepfreeze.tiers.persistent import PersistentLevel
    from test_torch import _env
    m = PersistentLevel(os.path.join(fsdp_run, "persistent")).read_manifest("ff", 9)
    tensors = {t["name"]: t for t in m["tensors"]}
    assert tensors["body.0.weight"]["shape"] == [5, 8] and tensors["optim.state.mid.weight.exp_avg"]["shape"] == [3, 64]
    pieces = {}
    from deepfreeze.tiers.base import plan_of
    assert m["plan"]["algorithm"] == "flat-v1" and m["plan"]["given"]  # FSDP2's bounds: recorded as given
    for tid, rank, start, stop in ((p.tensor_id, p.rank, p.start, p.stop) for p in plan_of(m).pieces):
        pieces.setdefault(m["tensors"][tid]["name"], []).append((rank, start, stop))
    assert pieces["body.0.weight"] == [(0, 0, 24), (1, 24, 40)]
    assert pieces["optim.state.body.0.weight.exp_avg_sq"] == [(0, 0, 24), (1, 24, 40)]
    assert pieces["mid.weight"] == [(0, 0, 128), (1, 128, 192)]
    assert pieces["head.weight"] == [(0, 0, 3)] and pieces["optim.state.head.weight.momentum_buffer"] == [(0, 0, 3)]
    assert pieces["body.3.running_mean"] == [(0, 0, 64)]  # a buffer: whole, from rank 0
    common = ["--name", "ff", "--set", "mode=sync", "--set", f"scratch={tmp_path}",  # (rank 0's scratch: half of it)
              "--set", f"persistent={fsdp_run}/persistent"]

    def cli(*args: str) -> str:
        p = subprocess.run([sys.executable, "-m", "deepfreeze", *args, *common], capture_output=True, text=True,
                           timeout=120, env=_env(), cwd=str(tmp_path))
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout
    assert "committed" in cli("ls")
    shown = cli("inspect", "--version", "9")
    assert any("body.0.weight" in line and "[5, 8]" in line for line in shown.splitlines()), shown
    assert "OK" in cli("verify", "--version", "9")


def test_ranged_read_reads_only_the_rows(fsdp_run, monkeypatch):
    """The core's ``rows=`` read from persistent (a plain process, no scratch): arrays of those
    rows only, equal to the recorded rows, and the bytes read from the assembled file are the
    rows' (plus its header and index), not the tensors'."""
    from deepfreeze.loader import load as core_load
    from deepfreeze.config import Config
    from deepfreeze.errors import ConfigError
    cfg = Config.resolve(None, mode="sync", scratch=os.path.join(fsdp_run, "empty"),
                         persistent=os.path.join(fsdp_run, "persistent"))
    os.makedirs(cfg.scratch, exist_ok=True)
    want = recorded(fsdp_run, 0, 6)

    def rows(name, shape):
        return (2, 5) if len(shape) and shape[0] == 5 else (1, 3) if len(shape) and shape[0] == 64 else None
    read = []
    real = os.preadv

    def counting(fd, bufs, offset, *a):
        n = real(fd, bufs, offset, *a)
        read.append(n)
        return n
    monkeypatch.setattr(os, "preadv", counting)
    ck = core_load(cfg, "ff", 6, rows=rows)
    monkeypatch.undo()
    expected = 0
    for t in ck.manifest["tensors"]:
        a, full = ck.arrays[t["name"]], want.get(t["name"])
        r = rows(t["name"], tuple(t["shape"]))
        if full is None:  # a state record
            continue
        part = full if r is None else full[r[0]:r[1]]
        assert a.shape == part.shape and a.tobytes() == part.tobytes(), t["name"]
        expected += part.nbytes
    records = sum(ck.arrays[k].nbytes for k in ck.arrays if k.startswith("_deepfreeze/"))
    assert expected + records <= sum(read) <= expected + records + 65536, (sum(read), expected)
    with pytest.raises(ConfigError, match="not a .start, stop. range"):
        core_load(cfg, "ff", 6, rows=lambda name, shape: (0, 99) if len(shape) else None)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_restore_into_fsdp_at_other_world_sizes(fsdp_run, restored, n):
    """A fresh FSDP2 model (other initial values) at n ranks: every rank reads its own rows
    (pooled scratch: each receives only the bytes of its rows), and the gathered state equals
    the run's, bit for bit."""
    out = restored(n, "fsdp")  # layout=fsdp, version=6
    for r in range(n):
        i = info(out, r)
        assert i["version"] == 6 and i["world_size"] == n
        # buffers: at the run's world size each rank's own (FSDP2 does not broadcast them), else rank 0's
        want = recorded(fsdp_run, r if n == 2 else 0, 6)
        assert_same(npz(os.path.join(out, f"r{r}", "restored.npz")), want, f"FSDP at {n} ranks, rank {r}")
    if n == 3:  # 5 rows on 3 ranks: 2 + 2 + 1; one row: 1 + 0 + 0
        assert [info(out, r)["rows"]["body.0.weight"][1][0] for r in range(3)] == [2, 2, 1]
        assert [info(out, r)["rows"]["head.weight"][1][0] for r in range(3)] == [1, 0, 0]


@pytest.mark.parametrize("n", [2, 3])
def test_dcp_load_through_the_reader_into_fsdp_reads_each_ranks_rows(fsdp_run, restored, n):
    """DCP's own ``dcp.load`` of a fresh FSDP2 model's sharded state dict (DTensors) through
    ``deepfreeze.torch.Reader`` at n ranks: the gathered state equals the run's, bit for bit, and
    each rank got from the checkpoint only the bytes of its own shards (plus the unsharded
    scalars), not whole tensors."""
    out = restored(n, "fsdp-dcp")  # layout=fsdp-dcp, version=6
    want = recorded(fsdp_run, 0, 6)  # buffers: rank 0's (unsharded, as the checkpoint holds them)
    whole = sum(a.nbytes for k, a in want.items() if k != "__lr__")
    for r in range(n):
        i = info(out, r)
        assert i["version"] == 6 and i["world_size"] == n
        assert_same(npz(os.path.join(out, f"r{r}", "restored.npz")), want, f"dcp.load into FSDP at {n} ranks, rank {r}")
        assert i["bytes_loaded"] == i["local_bytes"] < whole, (i, whole)


def test_restore_into_ddp_and_a_plain_process(fsdp_run, restored, tmp_path):
    want = recorded(fsdp_run, 0, 9)
    ddp = restored(2, "ddp")  # layout=ddp, version=9
    for r in range(2):  # at the run's world size each rank gets its own buffers (DDP broadcasts rank 0's)
        assert_same(npz(os.path.join(ddp, f"r{r}", "restored.npz")), recorded(fsdp_run, r, 9),
                    f"into DDP, rank {r}")
    plain(FSDP, "restore", str(tmp_path / "plain"), fsdp_run, "layout=plain")  # the newest: v9
    assert info(str(tmp_path / "plain"), 0)["version"] == 9
    assert_same(npz(os.path.join(tmp_path, "plain", "r0", "restored.npz")), want, "into a plain process")


@pytest.mark.slow
def test_restore_at_three_ranks_from_persistent_only(fsdp_run, tmp_path):
    """No scratch at all: each of 3 ranks reads its rows from the assembled file (ranged reads)."""
    src = str(tmp_path / "src")
    os.makedirs(src)
    shutil.copytree(os.path.join(fsdp_run, "persistent"), os.path.join(src, "persistent"))
    out = str(tmp_path / "out")
    torchrun(3, FSDP, "restore", out, src, "layout=fsdp", "version=9")
    for r in range(3):
        assert_same(npz(os.path.join(out, f"r{r}", "restored.npz")), recorded(fsdp_run, 0, 9),
                    f"from persistent at 3 ranks, rank {r}")


def test_hsdp_and_tensor_parallel_are_refused(restored):
    out = restored(2, "refuse")  # what tests/workers/torch_fsdp.py refuse does, in the 2-rank restore job
    for r in range(2):
        with open(os.path.join(out, f"r{r}", "refused.json")) as f:
            got = json.load(f)
        assert got["hsdp"]["type"] == "ConfigError" and "2-D device mesh" in got["hsdp"]["message"] \
            and "1-D mesh" in got["hsdp"]["message"]
        assert got["tp"]["type"] == "ConfigError" and "Shard(dim=1)" in got["tp"]["message"] \
            and "fully_shard alone" in got["tp"]["message"]
    assert not glob.glob(os.path.join(out, "persistent", "ff", "v*"))


@pytest.mark.slow
def test_fsdp_kill9_then_resume(fsdp_run, tmp_path):
    """Rank 1 SIGKILLs itself at iteration 8; the relaunch resumes from v6 and ends as the
    uninterrupted run: rank 0 bit for bit, rank 1 but for its BatchNorm statistics (FSDP2 does
    not synchronize buffers; a checkpoint holds rank 0's, as DCP does)."""
    out = str(tmp_path)
    p = torchrun(2, FSDP, "train", out, "steps=10", "kill_at=8", check=False)
    assert p.returncode != 0
    torchrun(2, FSDP, "train", out, "steps=10", "resume=1")
    i0 = info(out, 0)
    assert i0["resumed_from"] == 6 and i0["start_step"] == 6 and i0["last_version"] == 10  # v9, then save_last's v10
    assert_same(npz(os.path.join(out, "r0", "final.npz")), npz(os.path.join(fsdp_run, "r0", "final.npz")),
                "rank 0 after kill -9 and resume")
    r1 = {k: a for k, a in npz(os.path.join(fsdp_run, "r1", "final.npz")).items() if k not in BUFFERS[:2]}
    assert_same(npz(os.path.join(out, "r1", "final.npz")), r1, "rank 1 after kill -9 and resume")
    assert_same(load(out, 9), recorded(fsdp_run, 0, 9), "v9 after resume", lr=False)


@pytest.mark.parametrize("point, mode", CRASH_CASES)
def test_fsdp_kill9_at_a_write_once_crash_point_then_resume(fsdp_run, fsdp_and_crashed, point, mode):
    """The shipped default on one disk writes each version once, from the ranks' buffers straight into
    persistent: a rank SIGKILLed at v9's ``persistent.direct.write`` (its writer thread, the first run
    of its rows written) or ``persistent.direct.fsync`` (sync mode: the rank fsyncs its own part) leaves
    v9 uncommitted; the relaunch resumes from v6, the newest committed version, and ends bit for bit
    as the uninterrupted run (rank 1 but for its own BatchNorm statistics, as in the kill test above)."""
    c = fsdp_and_crashed[1][point, mode]  # killed at `point`, checked as below, then relaunched with resume=1
    out = c["out"]
    assert c["returncode"] != 0 and c["crashed"], c["stderr"][-3000:]
    assert c["committed"] == [3, 6]  # the versions on persistent after the kill, before the relaunch
    assert not c["scratch_files"]  # written once: no scratch file
    i0 = info(out, 0)
    assert i0["resumed_from"] == 6 and i0["start_step"] == 6 and i0["last_version"] == 10  # v9, then save_last's v10
    assert_same(npz(os.path.join(out, "r0", "final.npz")), npz(os.path.join(fsdp_run, "r0", "final.npz")),
                f"rank 0 after kill -9 at {point} and resume")
    r1 = {k: a for k, a in npz(os.path.join(fsdp_run, "r1", "final.npz")).items() if k not in BUFFERS[:2]}
    assert_same(npz(os.path.join(out, "r1", "final.npz")), r1, f"rank 1 after kill -9 at {point} and resume")
    for v in (6, 9):
        assert_same(load(out, v), recorded(fsdp_run, 0, v), f"v{v} after resume", lr=False)
