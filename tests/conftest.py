import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Every tmp_path puts scratch and persistent on one file system, where the shipped default
# (write_once = auto) writes versions straight into persistent and no scratch file: the suite's
# scratch-level tests (restore from scratch, scratch retention, a failing scratch write,
# redundancy) run the scratch path. Set for the whole session, module-scoped fixtures included
# (they are set up before the function-scoped fixture below). tests/test_writeonce.py, the
# crash-point suite's write-once scenario and the torch loops suite (tests/workers/torch_loops.py)
# set write_once themselves (a keyword beats the environment).
os.environ["VELOC_WRITE_ONCE"] = "off"


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    """Each test session gets its own backend socket directory."""
    d = tmp_path_factory.getbasetemp() / "run"
    d.mkdir(mode=0o700, exist_ok=True)
    monkeypatch.setenv("DEEPFREEZE_RUNTIME_DIR", str(d))
    monkeypatch.setenv("DEEPFREEZE_BACKEND_IDLE", "2")
    monkeypatch.setenv("VELOC_WRITE_ONCE", "off")  # (again: a test that changed it gets it back)


@pytest.fixture
def shared_dir():
    """A sticky, world-writable directory (like /tmp or /dev/shm) every user can reach."""
    d = tempfile.mkdtemp(prefix="df-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)
