import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import BACKEND_IDLE, as_in_a_test, runtime_dir  # noqa: E402

# Every mpirun the tests start (and its ranks) yields the CPU while it waits on MPI instead of
# polling: Open MPI polls unless it sees more ranks than cores, and the suite runs its jobs beside
# each other (pytest-xdist workers) and beside other work, where a polling rank burns the core its
# peer needs (a 2-rank Horovod job of tests/workers/train.py: 28 CPU-s polling, 18 yielding, same
# result). A setting of the caller's own wins.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# Every process the suite starts imports numpy, whose OpenBLAS starts one thread per core at import:
# 0.1 CPU-s of each start here (sys 0.14 -> 0.03 s), and the suite starts ~1,100 Python processes
# on 2 busy cores (measured: the machine had 0.3 % idle CPU during make test). None of them
# multiplies matrices large enough to use a second thread, and every bit-exact comparison is between
# processes of the same setting. A setting of the caller's own wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_itemcollected(item):
    """``make test`` runs on several pytest-xdist workers (``--dist loadgroup``). A test that uses a
    module-scoped fixture (one job or server whose results several tests read) joins its module's
    group, so the fixture runs once, on one worker, as in a serial run. Tests that share a
    machine-wide name (the one VeloC daemon of a user) carry their own ``xdist_group`` mark.

    Marked as each item is collected: pytest-xdist's worker reads the groups in its own
    ``pytest_collection_modifyitems``, which ran before a ``tryfirst`` one of this file (the groups
    were then never seen, and each worker ran such a fixture again: measured, three workers each
    ran test_mpi.py's jobs)."""
    defs = getattr(item, "_fixtureinfo", None)
    if defs is None or item.get_closest_marker("xdist_group") is not None:
        return
    if any(fd.scope in ("module", "package") for fds in defs.name2fixturedefs.values() for fd in fds):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path_factory, monkeypatch):
    """Each test session gets its own backend socket directory, and backends that stop 2 s after
    their last client (module-scoped fixtures' jobs: :func:`module_runtime_dir`)."""
    monkeypatch.setenv("DEEPFREEZE_RUNTIME_DIR", runtime_dir(tmp_path_factory))
    monkeypatch.setenv("DEEPFREEZE_BACKEND_IDLE", BACKEND_IDLE)


@pytest.fixture(scope="module")
def module_runtime_dir(tmp_path_factory):
    """For a module-scoped fixture that starts jobs (one job whose results several tests read):
    the environment :func:`_private_runtime_dir` gives each test (:func:`_util.as_in_a_test`)."""
    with as_in_a_test(tmp_path_factory) as d:
        yield d


@pytest.fixture(autouse=True)
def _scratch_files(request, monkeypatch):
    """A test marked ``@pytest.mark.scratch_files("why")`` runs with ``write_once = off`` (for itself and
    the processes it starts): it needs versions on scratch files (a scratch-level fault, partner/XOR
    copies, a scratch crash point, a damaged scratch file). Every other test runs the shipped default,
    where one disk holds scratch and persistent and a version is written once, into persistent."""
    mark = request.node.get_closest_marker("scratch_files")
    if mark is None:
        return
    if not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.scratch_files needs its reason, one line")
    monkeypatch.setenv("VELOC_WRITE_ONCE", "off")


@pytest.fixture
def shared_dir():
    """A sticky, world-writable directory (like /tmp or /dev/shm) every user can reach."""
    d = tempfile.mkdtemp(prefix="df-shared-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


#: the two write paths of a version decided 'flush' (INI write_once; docs/configuration.md)
WRITE_PATHS = {
    "auto": "the shipped default: scratch and persistent on one disk (every tmp_path), so each version is "
            "written once, from memory straight into persistent",
    "off": "every version through a scratch file, then copied into persistent",
}


@pytest.fixture(params=sorted(WRITE_PATHS))
def write_once(request, monkeypatch) -> str:
    """Runs a test once per write path (:data:`WRITE_PATHS`): ``auto``, the shipped default, leaves
    the environment as the user gets it; ``off`` sets ``VELOC_WRITE_ONCE=off`` for this test and
    every process it starts (mpirun, torchrun and their ranks read it). The one fixture of the
    write-once/scratch pairs (tests/test_write_paths.py and the tests that ask for it)."""
    if request.param == "auto":
        monkeypatch.delenv("VELOC_WRITE_ONCE", raising=False)
    else:
        monkeypatch.setenv("VELOC_WRITE_ONCE", request.param)
    return request.param
