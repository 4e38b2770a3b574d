import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    """Each test session gets its own backend socket directory."""
    d = tmp_path_factory.getbasetemp() / "run"
    d.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("DEEPFREEZE_RUNTIME_DIR", str(d))
    monkeypatch.setenv("DEEPFREEZE_BACKEND_IDLE", "2")


@pytest.fixture
def shared_dir():
    """A sticky, world-writable directory (like /tmp or /dev/shm) every user can reach."""
    d = tempfile.mkdtemp(prefix="df-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)
