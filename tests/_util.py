"""Helpers shared by the test modules (importable from any test directory)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def mpirun(np_: int, *args: str, timeout: float = 300, env: dict | None = None,
           check: bool = True, options: tuple = ()) -> subprocess.CompletedProcess:
    """Run ``python args...`` on ``np_`` ranks; with ``check``, fail the test with the output on error.
    ``options``: more mpirun options (e.g. ``("--enable-recovery",)``)."""
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.skip("mpirun not found: run 'make test' (its setup installs OpenMPI)")
    cmd = [exe, "--oversubscribe", "-np", str(np_), *options]
    if os.getuid() == 0:
        cmd.append("--allow-run-as-root")
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    for k in ("DEEPFREEZE_RUNTIME_DIR", "DEEPFREEZE_BACKEND_IDLE"):
        cmd += ["-x", k]
    cmd += [sys.executable, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-6000:]}")
    return p
