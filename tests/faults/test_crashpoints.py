"""Crash-point suite: kill -9 at every file-system operation of the commit protocol, recover,
and check that what restore returns is a state some run recorded (never a mixture, never
zeros) and that every version whose commit finished before the crash is still there.

The job (tests/workers/crash_job.py) is framework-neutral: two ranks' engines in one process,
numpy arrays, no TensorFlow start-up per point. A first dry run traces which points it passes
and how often; each point is then killed at its middle occurrence. Points that only a recovery
from a crash passes (taking over a dead run's lease, breaking its lock, clearing what it left
above the resume point) are killed during a recovery from a first crash.
"""
import ast
import collections
import functools
import json
import os
import subprocess
import sys
import time

import pytest

import deepfreeze
from deepfreeze import crashpoints
from deepfreeze.config import Config
from deepfreeze.loader import list_versions, load

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workers"))
import crash_job  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "..", "workers", "crash_job.py")
PKG = os.path.dirname(os.path.abspath(deepfreeze.__file__))
#: modules whose file-system operations must all go through deepfreeze.crashpoints
PROTOCOL_MODULES = ["tiers/base.py", "tiers/scratch.py", "tiers/persistent.py", "tiers/shardbytes.py", "tiers/flush.py",
                    "tiers/memtier.py", "engine.py", "backend.py", "redundancy.py", "run.py", "tiers/direct.py"]
FS_OPS = {"replace", "rename", "link", "fsync", "unlink", "rmdir", "removedirs"}

# the crash to recover from, for points only a recovery passes: killed while rank 0 decides v3
# under its commit.lock (rank 0's v3 is on scratch, rank 1's is not: the recovery resumes from v2,
# takes over the dead run's lease, breaks its lock and clears v3 on both levels)
FIRST_CRASH = "persistent.decision.link:3"
SCENARIOS = {
    # point: phase and environment of the run to kill there (default: a first run, sync mode)
    "run.generation.fsync": ("overwrite", {}),
    "run.generation.rename": ("overwrite", {}),
    "run.generation.dirsync": ("overwrite", {}),
    "tmp.cleanup": ("first", {"JOB_FAIL_AT": "3"}),
    "backend.socket.unlink": ("first", {"JOB_MODE": "async"}),
}
#: the write-once path (INI write_once = on; the default where scratch and persistent share a file
#: system): its own points, and the commit protocol's points it passes too, killed on it as well
WRITE_ONCE = ("first", {"JOB_WRITE_ONCE": "on"})
SCENARIOS["write_once"] = WRITE_ONCE
WRITE_ONCE_POINTS = {"persistent.direct.write", "persistent.direct.fsync"}
WRITE_ONCE_SHARED = ["persistent.decision.link", "persistent.marker.rename", "persistent.final.rename",
                     "persistent.manifest.rename", "persistent.cleanup.unlink"]
RECOVERY_ONLY = {"run.lease.takeover", "run.lease.unlink", "run.clock.unlink", "persistent.lock.break",
                 "scratch.clear.unlink"}
MPI_ONLY = {"scratch.partner.rename", "scratch.parity.rename"}  # test_kill_in_redundancy_exchange


def _run(d, phase, env=None, crash=None):
    e = dict(os.environ, **(env or {}))
    e.pop("DEEPFREEZE_CRASH_AT", None)
    e.pop("DEEPFREEZE_CRASH_TRACE", None)
    if crash:
        e["DEEPFREEZE_CRASH_AT"] = crash
        e["DEEPFREEZE_CRASH_ONCE"] = os.path.join(d, "crashed")  # a restarted backend runs through
    return subprocess.run([sys.executable, JOB, d, phase], capture_output=True, text=True, timeout=120, env=e)


@functools.lru_cache(maxsize=None)
def _dry_trace(tmp_root: str, key: str) -> collections.Counter:
    """How often a clean run of each scenario passes each point."""
    d = os.path.join(tmp_root, f"dry-{key}")
    os.makedirs(d)
    phase, env = SCENARIOS.get(key, ("first", {}))
    trace = os.path.join(d, "trace")
    if phase == "overwrite":
        assert _run(d, "first").returncode == 0
    p = subprocess.run([sys.executable, JOB, d, phase], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DEEPFREEZE_CRASH_TRACE=trace, **env))
    assert p.returncode == 0, p.stderr[-3000:]
    if env.get("JOB_MODE") == "async":  # the backend passes its last point when it exits, idle
        _wait_for(lambda: "backend.socket.unlink" in open(trace).read())
    with open(trace) as f:
        return collections.Counter(line.strip() for line in f)


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def dry_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dry"))


def _logged(d):
    try:
        with open(os.path.join(d, "committed.log")) as f:
            return [(r, int(v)) for r, v in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []


def _cfg(d, scratch=None):
    return Config.load(None, mode="sync", scratch=scratch or f"{d}/scratch", persistent=f"{d}/persistent")


def _check(d, what):
    """Every version any level holds is a recorded state, bit-exact; the newest logged commit is
    restorable and nothing older is returned as the newest."""
    rec = crash_job.load_records(d)
    logged = _logged(d)
    for cfg, level in ((_cfg(d), "any level"), (_cfg(d, f"{d}/no-scratch"), "persistent")):
        versions = list_versions(cfg, "job")
        for v in versions:
            ck = load(cfg, "job", v)
            key = (ck.manifest["run"]["id"], v)
            assert key in rec, f"{what}: v{v} from {ck.level} is of run {key[0]}, which recorded no such version"
            for name, a in rec[key].items():
                assert ck.arrays[name].tobytes() == a.tobytes(), \
                    f"{what}: v{v} ({level}, {ck.level}) tensor {name} differs from what run {key[0]} recorded"
    if logged:
        newest = load(_cfg(d), "job")
        assert newest.version >= max(v for _, v in logged), \
            f"{what}: restore returned v{newest.version}, but v{max(v for _, v in logged)} had committed"
        run, v = logged[-1]
        ck = load(_cfg(d), "job", v)
        assert ck.manifest["run"]["id"] == run or v < newest.version


def _points_for_suite():
    return sorted(set(crashpoints.POINTS) - crashpoints.PERIPHERAL - crashpoints.RACE_ONLY - MPI_ONLY)


def test_every_call_site_goes_through_crashpoints():
    """No module of the commit protocol calls os.replace/rename/link/fsync/unlink/rmdir (or
    shutil.rmtree) directly; every point name used in the source is registered."""
    used = set()
    for mod in PROTOCOL_MODULES:
        src = open(os.path.join(PKG, mod)).read()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if isinstance(base, ast.Name) and base.id == "os" and node.func.attr in FS_OPS:
                    # tolerated: removing our own temporary files (no state of the protocol)
                    line = src.splitlines()[node.lineno - 1]
                    assert "tmp" in line, f"{mod}:{node.lineno}: direct os.{node.func.attr}: use deepfreeze.crashpoints"
                if isinstance(base, ast.Name) and base.id == "shutil":
                    pytest.fail(f"{mod}:{node.lineno}: shutil.{node.func.attr}: remove files one by one via crashpoints")
                if isinstance(base, ast.Name) and base.id == "cp":
                    for a in node.args:
                        if isinstance(a, ast.Constant) and isinstance(a.value, str) and "." in a.value:
                            used.add(a.value)
            if isinstance(node, ast.keyword) and node.arg == "point" and isinstance(node.value, ast.Constant):
                used.add(node.value.value + ".*")
    for p in used:
        if p.endswith(".*"):
            assert any(q.startswith(p[:-1]) for q in crashpoints.POINTS), f"point prefix {p} registered nowhere"
        else:
            assert p in crashpoints.POINTS, f"crash point {p!r} used in the source but not registered"


def test_every_point_is_covered(dry_root):
    """Each registered point is passed by a clean run of its scenario (or is recovery-only or
    MPI-only, covered by those tests)."""
    seen = set()
    for key in ["first"] + list(SCENARIOS):
        seen |= set(_dry_trace(dry_root, key))
    missing = (set(crashpoints.POINTS) - crashpoints.PERIPHERAL - crashpoints.RACE_ONLY - MPI_ONLY
               - RECOVERY_ONLY - seen)
    assert not missing, f"points no scenario passes: {sorted(missing)}"


@pytest.mark.parametrize("point", _points_for_suite())
def test_kill_at_point_then_recover(tmp_path, dry_root, point):
    _kill_and_recover(tmp_path, dry_root, point, "write_once" if point in WRITE_ONCE_POINTS else
                      point if point in SCENARIOS else "first")


@pytest.mark.parametrize("point", WRITE_ONCE_SHARED)
def test_kill_on_write_once_path(tmp_path, dry_root, point):
    """The commit protocol's steps after a version was written once into persistent (no scratch
    file): a kill at each leaves a recorded state or the previous one, and the recovery commits."""
    _kill_and_recover(tmp_path, dry_root, point, "write_once")


def _kill_and_recover(tmp_path, dry_root, point, key):
    d = str(tmp_path)
    phase, env = SCENARIOS.get(key, ("first", {}))
    if point in RECOVERY_ONLY:
        first = _run(d, "first", crash=FIRST_CRASH)
        assert first.returncode == -9, f"the first run was not killed at {FIRST_CRASH}: {first.stderr[-2000:]}"
        os.unlink(os.path.join(d, "crashed"))
        _check(d, f"after the kill at {FIRST_CRASH}")
        p = _run(d, "recover", crash=f"{point}:1")
        assert p.returncode == -9, f"recovery did not pass {point}: rc {p.returncode}\n{p.stderr[-3000:]}"
    else:
        count = _dry_trace(dry_root, key)[point]
        assert count, f"a clean {key} run never passes {point}"
        k = (count + 1) // 2
        if phase == "overwrite":
            assert _run(d, "first").returncode == 0
            os.rename(os.path.join(d, "committed.log"), os.path.join(d, "overwritten.log"))  # given up on purpose
        p = _run(d, phase, env, crash=f"{point}:{k}")
        if point == "backend.socket.unlink":  # the backend dies (when it exits, idle), not the job
            assert p.returncode == 0, p.stderr[-3000:]
            assert _wait_for(lambda: os.path.exists(os.path.join(d, "crashed")))
        else:
            assert p.returncode == -9, f"not killed at {point}:{k}: rc {p.returncode}\n{p.stderr[-3000:]}"
    assert os.path.exists(os.path.join(d, "crashed"))
    _check(d, f"after the kill at {point}")
    p = _run(d, "recover", env={"JOB_MODE": "async"} if point == "backend.socket.unlink" else
             {k: v for k, v in env.items() if k == "JOB_WRITE_ONCE"})
    assert p.returncode == 0, f"recovery after {point} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    _check(d, f"after recovering from {point}")
    newest = load(_cfg(d), "job")
    last_run, last_v = _logged(d)[-1]
    assert (newest.manifest["run"]["id"], newest.version) == (last_run, last_v)


@pytest.mark.parametrize("scheme,point", [("partner", "scratch.partner.rename"), ("xor", "scratch.parity.rename")])
def test_kill_in_redundancy_exchange(tmp_path, scheme, point):
    """A rank killed while publishing what it holds for another rank (partner copy, parity block)
    of v3 (real MPI job, 3 ranks on 3 simulated nodes): the relaunched job's collective restore
    returns a whole version, bit-exact, and the version before v3 is still there."""
    from _util import WORKERS, mpirun
    job = os.path.join(WORKERS, "numpy_job.py")
    env = {"DEEPFREEZE_CRASH_AT": f"{point}:3", "DEEPFREEZE_CRASH_ONCE": str(tmp_path / "crashed")}
    p = mpirun(3, job, "write", str(tmp_path), "3", "1,2,3,4", f"ec_scheme={scheme}", "mode=sync", env=env,
               check=False, timeout=120)
    assert p.returncode != 0 and (tmp_path / "crashed").exists(), p.stderr[-2000:]
    mpirun(3, job, "restore", str(tmp_path), "3", timeout=120)  # asserts bit-exact on every rank
    got = json.load(open(tmp_path / "restored.json"))
    assert got["bit_exact"] and got["version"] >= 2
    mpirun(3, job, "restore", str(tmp_path), "3", "2", timeout=120)
    assert json.load(open(tmp_path / "restored.json"))["version"] == 2
