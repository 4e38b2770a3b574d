import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    """Each test session gets its own backend socket directory."""
    d = tmp_path_factory.getbasetemp() / "run"
    d.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("DEEPFREEZE_RUNTIME_DIR", str(d))
    monkeypatch.setenv("DEEPFREEZE_BACKEND_IDLE", "2")


def mpirun(np_: int, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``np_`` ranks; fail the test with the output on error."""
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.skip("mpirun not found: run 'make test' (its setup installs OpenMPI)")
    cmd = [exe, "--oversubscribe", "-np", str(np_)]
    if os.getuid() == 0:
        cmd.append("--allow-run-as-root")
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    for k in ("DEEPFREEZE_RUNTIME_DIR", "DEEPFREEZE_BACKEND_IDLE"):
        cmd += ["-x", k]
    cmd += [sys.executable, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}")
    return p
