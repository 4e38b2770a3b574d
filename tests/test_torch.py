"""DeepFreeze for PyTorch: 2-rank DDP jobs under torchrun (gloo) and plain processes.

Every check is against state the run itself recorded (tests/workers/torch_train.py writes the
model and optimizer state right after each checkpointed iteration, per rank).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

from _util import ROOT, WORKERS, as_in_a_test  # noqa: E402

TRAIN = os.path.join(WORKERS, "torch_train.py")
RESTORE = os.path.join(WORKERS, "torch_restore.py")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="",
                PYTHONWARNINGS="ignore")


def torchrun(n: int, script: str, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node n script args`` (gloo; a free port each time)."""
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [exe or sys.executable, *([] if exe else ["-m", "torch.distributed.run"]), "--standalone",
           "--nproc-per-node", str(n), script, *args]
    p = run_or_dump(cmd, timeout, _env(), script)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}")
    return p


def run_or_dump(cmd: list[str], timeout: float, env: dict, script: str) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, its output captured. Past ``timeout`` the test fails with
    where each process running ``script`` was: they are sent SIGUSR1 (the workers' ``begin()``
    registers :mod:`faulthandler` on it: every thread's Python stack to stderr), then the whole
    session is killed (no worker left behind) and the end of stderr goes into the failure."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in set(_session(proc.pid)) - {proc.pid}:  # the ranks (and their loaders' workers), not torchrun
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if script.encode() in f.read():
                        os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(3)  # the stacks written
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout:g}s: killed; where its ranks were (SIGUSR1, faulthandler):\n"
                    f"stderr:\n{err[-20000:]}\nstdout:\n{out[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (from /proc)."""
    from deepfreeze.node import _stat_fields
    pids = []
    for name in os.listdir("/proc"):
        fields = _stat_fields(name) if name.isdigit() else None
        if fields is not None and int(fields[3]) == sid:  # (state ppid pgrp session ...)
            pids.append(int(name))
    return pids


def plain(script: str, *args: str) -> None:
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=240, env=_env())
    if p.returncode != 0:
        pytest.fail(f"{script} exited {p.returncode}\n{p.stderr[-6000:]}")


def npz(path: str) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def info(out: str, rank: int) -> dict:
    with open(os.path.join(out, f"r{rank}", "info.json")) as f:
        return json.load(f)


def assert_same(got: dict, want: dict, what: str, lr: bool = True) -> None:
    keys = set(want) - ({"__lr__"} if not lr else set())
    assert set(got) >= keys, f"{what}: missing {sorted(keys - set(got))[:5]}"
    for k in sorted(keys):
        a, b = np.asarray(got[k]), want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{what}: {k} differs"


def loaded(out: str, version: int, rank: int = 0) -> dict[str, np.ndarray]:
    """``deepfreeze.torch.load`` in this (plain) process, as numpy arrays."""
    import deepfreeze.torch as dft
    got = dft.load(name="tt", version=version, mode="sync", scratch=os.path.join(out, f"scratch{rank}"),
                   persistent=os.path.join(out, "persistent"))
    return {k: v.numpy() for k, v in got.items()}


@pytest.fixture(scope="module")
def ddp_and_killed(tmp_path_factory):
    """The run of :func:`ddp_run`, and the run test_kill9_then_resume_equals_uninterrupted kills:
    killed in a job of its own (rank 1 SIGKILLs itself at iteration 11), then one job relaunches it
    with resume=True and then makes the uninterrupted run (tests/workers/torch_train.py ``--``).
    Returns (the uninterrupted run's OUT, (the killed run's OUT, the killed job's return code,
    whether rank 0 had written final.npz before the relaunch))."""
    out, killed = str(tmp_path_factory.mktemp("ddp")), str(tmp_path_factory.mktemp("killed"))
    with as_in_a_test(tmp_path_factory):
        p = torchrun(2, TRAIN, killed, "steps=14", "scaler=1", "kill_at=11", check=False)
        final_before_relaunch = os.path.exists(os.path.join(killed, "r0", "final.npz"))
        torchrun(2, TRAIN, killed, "steps=14", "scaler=1", "resume=1", "--", out, "steps=14", "scaler=1", "ec=1",
                 timeout=480)
    return out, (killed, p.returncode, final_before_relaunch)


@pytest.fixture(scope="module")
def ddp_run(ddp_and_killed):
    """One uninterrupted 2-rank DDP run: BatchNorm, dropout, two optimizers and schedulers, a CPU
    GradScaler that skips steps, a Stateful data position; a checkpoint every 3 steps."""
    return ddp_and_killed[0]


def test_ddp_versions_bit_exact(ddp_run):
    out = ddp_run
    i0, i1 = info(out, 0), info(out, 1)
    assert i0["it"] == 14 and i0["step"] < 14, "the GradScaler skipped no step: the test does not test skipping"
    assert i0["step"] == i1["step"] and i0["plans"] == 1
    versions = sorted(int(os.path.basename(p)[1:-4]) for p in glob.glob(os.path.join(out, "r0", "v*.npz")))
    assert versions == [v for v in range(3, i0["step"] + 1, 3)] and len(versions) >= 2
    for v in versions:
        want = npz(os.path.join(out, "r0", f"v{v}.npz"))
        for r in (0, 1):  # each rank's recorded state (parameters and optimizer state are replicated)
            rec = npz(os.path.join(out, f"r{r}", f"v{v}.npz"))
            assert_same(loaded(out, v, r), {k: a for k, a in rec.items() if "running" not in k and
                                            "num_batches" not in k}, f"v{v} vs rank {r}", lr=False)
        assert_same(loaded(out, v), want, f"v{v}", lr=False)  # buffers: rank 0's (DDP broadcasts them)


def test_load_keys_are_get_state_dict_fqns(ddp_run):
    sys.path.insert(0, WORKERS)
    from torch_train import build
    from torch.distributed.checkpoint.state_dict import get_state_dict
    net, opts = build()
    got = loaded(ddp_run, 3)
    model_sd, optim_sd = get_state_dict(net, opts)  # (initializes the optimizers' state)
    want = set(model_sd) | {f"optim.state.{fqn}.{k}" for fqn, kv in optim_sd["state"].items() for k in kv}
    assert set(got) == want


@pytest.fixture(scope="module")
def restored_at_2(ddp_run, tmp_path_factory):
    """The 2-rank restores of two tests in one job (tests/workers/torch_restore.py ``--``): v6 of the
    run (test_restore_at_other_world_sizes[2]) and v6 of a copy of the run whose rank 1's own shard
    of v6 is gone and whose persistent holds no v6 (test_partner_copy_restores_a_lost_shard).
    Returns {"run": OUT, "partner": OUT, "vdirs": rank 1's v6 directories of the copy, "copy": rank
    0's partner copies of rank 1's v6 shard, "persistent": the copy's persistent v6 directories}, the
    last three as found before the damage (the partner test asserts them)."""
    base = tmp_path_factory.mktemp("restored_at_2")
    src = str(base / "src")
    shutil.copytree(ddp_run, src)
    vdirs = glob.glob(os.path.join(src, "scratch1", "tt", "v*6"))
    copy = glob.glob(os.path.join(src, "scratch0", "tt", "v*6", "h000000.r000001.dfs"))
    persistent = glob.glob(os.path.join(src, "persistent", "tt", "v*6"))
    if len(vdirs) == 1 and copy and persistent:  # else the partner test fails on its assertion of them
        os.unlink(os.path.join(vdirs[0], "r000001.dfs"))
        shutil.rmtree(persistent[0])
    out = {"run": str(base / "run"), "partner": str(base / "partner"), "vdirs": vdirs, "copy": copy,
           "persistent": persistent}
    with as_in_a_test(tmp_path_factory):
        torchrun(2, RESTORE, out["run"], ddp_run, "version=6", "--", out["partner"], src, "version=6")
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_restore_at_other_world_sizes(ddp_run, tmp_path, n, request):
    if n == 2:
        out = request.getfixturevalue("restored_at_2")["run"]  # version=6, in one job with the partner test's
    else:
        out = str(tmp_path)
        torchrun(n, RESTORE, out, ddp_run, "version=6")
    want = npz(os.path.join(ddp_run, "r0", "v6.npz"))
    for r in range(n):
        assert info(out, r)["version"] == 6
        assert_same(npz(os.path.join(out, f"r{r}", "restored.npz")), want, f"restored at {n} ranks, rank {r}")


def test_partner_copy_restores_a_lost_shard(ddp_run, restored_at_2):
    """The run exchanged partner copies over TorchComm (each rank its own failure domain): with
    rank 1's own shard of v6 gone and nothing on persistent, a 2-rank restore reads the copy
    rank 0 holds."""
    vdirs = restored_at_2["vdirs"]  # the copy of the run, before its shard and persistent v6 were removed
    assert len(vdirs) == 1 and restored_at_2["copy"]
    assert restored_at_2["persistent"]  # (was: the IndexError of removing it)
    out = restored_at_2["partner"]  # its 2-rank restore of v6
    want = npz(os.path.join(ddp_run, "r0", "v6.npz"))
    for r in range(2):
        assert_same(npz(os.path.join(out, f"r{r}", "restored.npz")), want, f"rank {r} restored from a partner copy")


def test_memory_tier_with_torch_bit_exact_and_resume(tmp_path):
    """The memory tier under the torch adapter: a 2-rank DDP job whose shards go to one memory-tier
    device (the node's), every version flushed from it to persistent. Each version loads
    bit-exact from the device (the newest) and from persistent (all); a job killed at iteration
    8 resumes from the device's newest version and ends equal to the uninterrupted run."""
    import deepfreeze.torch as dft
    from _util import memtier_device
    with memtier_device("torch", "64M") as device, memtier_device("torch2", "64M") as device2:
        out, ref, crashed = str(tmp_path / "run"), str(tmp_path / "ref"), str(tmp_path / "crashed")
        p = torchrun(2, TRAIN, crashed, "steps=11", "kill_at=8", f"memtier={device2}", check=False)
        assert p.returncode != 0
        # one job: the killed run relaunched, then the uninterrupted reference (both on device2), then
        # the run whose versions are checked first (on device) (tests/workers/torch_train.py ``--``)
        torchrun(2, TRAIN, crashed, "steps=11", "resume=1", f"memtier={device2}",
                 "--", ref, "steps=11", f"memtier={device2}", "name=ref", "--", out, "steps=9", f"memtier={device}",
                 timeout=600)
        i0 = info(out, 0)
        versions = sorted(int(os.path.basename(p)[1:-4]) for p in glob.glob(os.path.join(out, "r0", "v*.npz")))
        assert versions == [3, 6, 9] and i0["failures"] == []
        for v in versions:
            want = npz(os.path.join(out, "r0", f"v{v}.npz"))
            assert_same(loaded(out, v), want, f"v{v} from persistent", lr=False)
        st = dft.load_state(name="tt", mode="sync", scratch=os.path.join(out, "scratch0"),
                            persistent=os.path.join(out, "persistent"), memtier=device)
        assert (st.version, st.level) == (9, "memtier"), (st.version, st.level)
        assert len(st.model) >= 8  # every parameter and buffer of the model, compared below
        assert_same({k: v.numpy() for k, v in st.model.items()},
                    {k: a for k, a in npz(os.path.join(out, "r0", "v9.npz")).items() if k in st.model},
                    "the newest from the memory tier", lr=False)
        i0 = info(crashed, 0)
        assert i0["resumed_from"] in (3, 6) and i0["start_step"] == i0["resumed_from"], i0
        for r in (0, 1):
            assert_same(npz(os.path.join(crashed, f"r{r}", "final.npz")), npz(os.path.join(ref, f"r{r}", "final.npz")),
                        f"rank {r} resumed vs uninterrupted")


def test_restore_in_a_plain_process(ddp_run, tmp_path):
    out = str(tmp_path)
    plain(RESTORE, out, ddp_run)  # the newest version
    newest = max(int(os.path.basename(p)[1:-4]) for p in glob.glob(os.path.join(ddp_run, "r0", "v*.npz")))
    assert info(out, 0)["version"] == newest
    assert_same(npz(os.path.join(out, "r0", "restored.npz")), npz(os.path.join(ddp_run, "r0", f"v{newest}.npz")),
                "restored in a plain process")


def test_kill9_then_resume_equals_uninterrupted(ddp_run, ddp_and_killed):
    """Rank 1 SIGKILLs itself at iteration 11; the relaunch resumes from the newest committed
    version and ends bit-identical to the uninterrupted run (and writes the same versions)."""
    out, returncode, final_before_relaunch = ddp_and_killed[1]  # steps=14 scaler=1 kill_at=11, then resume=1
    assert returncode != 0
    assert not final_before_relaunch
    i0 = info(out, 0)
    assert i0["resumed_from"] is not None and i0["resumed_from"] >= 3 and i0["start_step"] == i0["resumed_from"]
    for r in (0, 1):
        assert_same(npz(os.path.join(out, f"r{r}", "final.npz")), npz(os.path.join(ddp_run, f"r{r}", "final.npz")),
                    f"final state of rank {r} after kill -9 and resume")
    last = i0["last_version"]
    assert last > i0["resumed_from"]
    assert_same(loaded(out, last), npz(os.path.join(ddp_run, "r0", f"v{last}.npz")), f"v{last} after resume",
                lr=False)


def test_plan_change_slow_copy_and_torn_capture(tmp_path):
    """A plain process: add_param_group mid-run (a new plan, said once; later versions still
    exact), a capture copy slowed while the next forward and backward run (the next step waits:
    still exact), and an in-place change of a parameter during a capture (that version is torn:
    not written, the others are)."""
    out = str(tmp_path)
    plain(TRAIN, out, "steps=13", "add_group_at=4", "slow=0.002", "mutate_at=9", "on_error=warn", "mode=sync")
    i0 = info(out, 0)
    assert i0["plans"] == 2, i0
    assert i0["torn"] == [9] and len(i0["failures"]) == 1 and "changed in place" in i0["failures"][0]
    from deepfreeze.loader import list_versions
    from deepfreeze.config import Config
    cfg = Config.resolve(None, mode="sync", scratch=os.path.join(out, "scratch0"),
                         persistent=os.path.join(out, "persistent"))
    assert sorted(list_versions(cfg, "tt")) == [3, 6, 12]
    for v in (3, 6, 12):
        assert_same(loaded(out, v), npz(os.path.join(out, "r0", f"v{v}.npz")), f"v{v}", lr=False)


def test_state_record_round_trip_and_bounds():
    import random
    from deepfreeze.errors import ConfigError, CorruptCheckpointError
    from deepfreeze.torch import _state
    obj = {"a": (1, 2.5, float("inf"), None, True), 3: [torch.arange(5, dtype=torch.bfloat16), np.arange(3)],
           "rng": _state.rng_state(), "b": b"\x00\x01", "s": "x", "dt": torch.float16}
    data = _state.encode(obj)
    back = _state.decode(data + b"\0" * 100)
    assert back["a"] == (1, 2.5, float("inf"), None, True) and back["b"] == b"\x00\x01" and back["dt"] == torch.float16
    assert torch.equal(back[3][0], obj[3][0]) and back[3][0].dtype == torch.bfloat16
    assert np.array_equal(back[3][1], obj[3][1])
    assert torch.equal(back["rng"]["torch"], obj["rng"]["torch"]) and back["rng"]["python"] == random.getstate()
    with pytest.raises(ConfigError, match="no pickling"):
        _state.encode({"f": lambda: 0})
    with pytest.raises(CorruptCheckpointError, match="magic"):
        _state.decode(b"x" * 32)
    bad = bytearray(data)
    bad[8:16] = (10 ** 9).to_bytes(8, "little")  # a JSON length beyond the record
    with pytest.raises(CorruptCheckpointError, match="exceeds"):
        _state.decode(bytes(bad))
    js = data[16:16 + int.from_bytes(data[8:16], "little")].replace(b'"T":["bfloat16",[5],0,10]',
                                                                    b'"T":["bfloat16",[5],0,99999]')
    with pytest.raises(CorruptCheckpointError, match="outside the record"):
        _state.decode(data[:8] + len(js).to_bytes(8, "little") + js + data[16 + int.from_bytes(data[8:16], "little"):])


def test_cli_on_torch_checkpoints(ddp_run, tmp_path):
    """``deepfreeze ls/inspect/verify`` read torch checkpoints; ``export --format torch`` writes the
    get_state_dict layout for ``torch.load(weights_only=True)``; safetensors leaves out the
    per-rank state records."""
    common = ["--name", "tt", "--set", "mode=sync", "--set", f"scratch={ddp_run}/scratch0",
              "--set", f"persistent={ddp_run}/persistent"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "deepfreeze", *args, *common], capture_output=True, text=True,
                           timeout=120, env=_env(), cwd=str(tmp_path))
        assert p.returncode == 0, p.stdout + p.stderr
        return p

    assert "committed" in cli("ls").stdout
    assert "optim.state.body.0.weight.exp_avg" in cli("inspect", "--version", "6").stdout
    assert "OK" in cli("verify", "--version", "6").stdout
    cli("export", "--version", "6", "--format", "torch", "-o", str(tmp_path / "v6.pt"))
    d = torch.load(str(tmp_path / "v6.pt"), weights_only=True)
    want = npz(os.path.join(ddp_run, "r0", "v6.npz"))
    flat = {**{k: v.numpy() for k, v in d["model"].items()},
            **{f"optim.state.{f}.{k}": v.numpy() for f, kv in d["optim"]["state"].items() for k, v in kv.items()
               if isinstance(v, torch.Tensor)}}
    assert_same(flat, want, "export --format torch", lr=False)
    assert [g["lr"] for g in d["optim"]["param_groups"]] == list(want["__lr__"])
    assert d["deepfreeze"]["version"] == 6
    cli("export", "--version", "6", "-o", str(tmp_path / "v6.safetensors"))
    from safetensors.numpy import load_file
    st = load_file(str(tmp_path / "v6.safetensors"))
    assert not any(k.startswith("_deepfreeze/") for k in st)
    assert_same(st, want, "export safetensors", lr=False)


def test_unstorable_state_is_a_clear_error(tmp_path):
    """A state object whose state_dict holds something that cannot be stored without pickling:
    on_error='raise' raises ConfigError from optimizer.step naming it; 'warn' skips that version
    and training goes on."""
    from deepfreeze.errors import ConfigError
    from deepfreeze.torch import Checkpointer

    class Bad:
        def state_dict(self):
            return {"fn": print}

        def load_state_dict(self, sd):
            pass

    for on_error in ("raise", "warn"):
        net = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        d = tmp_path / on_error
        ck = Checkpointer(net, opt, name="bad", every_n_steps=1, state={"bad": Bad()}, on_error=on_error,
                          mode="sync", scratch=str(d / "s"), persistent=str(d / "p"))
        net(torch.ones(1, 4)).sum().backward()
        if on_error == "raise":
            with pytest.raises(ConfigError, match=r"record\['state'\]\['bad'\]\['fn'\] is a builtin_function_or_method"):
                opt.step()
        else:
            opt.step()
            assert ck.failures and ck.last_version is None
        ck.close()


# -- the crash-point suite on the torch path (deepfreeze.crashpoints: SIGKILL right before the
# n-th file-system operation at a named point of the commit protocol), one plain process, sync mode,
# the shipped default (scratch and persistent on one disk: each version written once, so the points
# passed are write once's, persistent.direct.*, not the scratch path's; tests/faults/test_crashpoints.py
# kills the engine at every point of both paths)
CRASH_ARGS = ("steps=10", "every=2", "mode=sync")
QUICK_POINTS = ["persistent.direct.write", "persistent.marker.rename", "persistent.manifest.rename"]
SLOW_POINTS = ["persistent.direct.fsync", "persistent.decision.link",
               "persistent.marker.fsync", "persistent.marker.dirsync", "persistent.final.fsync",
               "persistent.final.rename", "persistent.manifest.fsync", "persistent.manifest.dirsync",
               "persistent.cleanup.unlink", "persistent.lock.link", "persistent.lock.unlink", "run.lease.link"]


@pytest.fixture(scope="module")
def crash_reference(tmp_path_factory):
    """An uninterrupted run, tracing the crash points it passes (and how often)."""
    out = str(tmp_path_factory.mktemp("crashref"))
    trace = os.path.join(out, "trace")
    p = subprocess.run([sys.executable, TRAIN, out, *CRASH_ARGS], capture_output=True, text=True, timeout=240,
                       env=dict(_env(), DEEPFREEZE_CRASH_TRACE=trace))
    assert p.returncode == 0, p.stderr[-3000:]
    with open(trace) as f:
        counts: dict[str, int] = {}
        for line in f:
            counts[line.strip()] = counts.get(line.strip(), 0) + 1
    return out, counts


@pytest.mark.parametrize("point", QUICK_POINTS + [pytest.param(p, marks=pytest.mark.slow) for p in SLOW_POINTS])
def test_crash_point_then_resume(crash_reference, tmp_path, point):
    """Killed (SIGKILL) at the middle occurrence of ``point``, then relaunched with resume=True:
    the newest restorable version is one the run recorded, bit for bit, and the resumed run
    ends bit-identical to the uninterrupted one."""
    ref, counts = crash_reference
    assert point in counts, f"the torch run never passes {point} (passes {sorted(counts)})"
    out = str(tmp_path)
    env = dict(_env(), DEEPFREEZE_CRASH_AT=f"{point}:{(counts[point] + 1) // 2}",
               DEEPFREEZE_CRASH_ONCE=os.path.join(out, "crashed"))
    p = subprocess.run([sys.executable, TRAIN, out, *CRASH_ARGS], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == -9, f"not killed at {point}: rc {p.returncode}\n{p.stderr[-2000:]}"
    from deepfreeze.config import Config
    from deepfreeze.loader import list_versions
    cfg = Config.resolve(None, mode="sync", scratch=os.path.join(out, "scratch0"),
                         persistent=os.path.join(out, "persistent"))
    versions = list_versions(cfg, "tt")
    if versions:
        newest = max(versions)
        assert_same(loaded(out, newest), npz(os.path.join(ref, "r0", f"v{newest}.npz")), f"v{newest} after {point}",
                    lr=False)
    plain(TRAIN, out, *CRASH_ARGS, "resume=1")
    assert_same(npz(os.path.join(out, "r0", "final.npz")), npz(os.path.join(ref, "r0", "final.npz")),
                f"resumed after a crash at {point}")


def test_resume_without_a_checkpoint_starts_fresh(tmp_path):
    from deepfreeze.torch import Checkpointer
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    ck = Checkpointer(net, opt, name="fresh", every_n_steps=2, resume=True, mode="sync",
                      scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    assert ck.start_step == 0 and ck.resumed_from is None
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    for _ in range(2):
        net(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    ck.close()
    assert ck.last_version == 2
