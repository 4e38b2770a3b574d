"""Helpers shared by the test modules (importable from any test directory)."""
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def stop_process(pid: int, timeout: float = 60.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped. ``kill`` returns before that:
    the kernel wakes one thread to take the signal, and until it runs (late, on a loaded machine)
    another thread may still answer a request."""
    from deepfreeze.node import process_state  # (/proc/<tid>/stat: a thread's own state)
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = {tid: process_state(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        states = {tid: st for tid, st in states.items() if st is not None}  # None: a thread that ended
        if states and all(st[0] in "Tt" for st in states.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} not stopped {timeout:g}s after SIGSTOP: thread states {states}")
        time.sleep(0.01)


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


def nobody_ids() -> tuple[int, int]:
    """(uid, gid) of ``nobody``, the other user of the tests; skips unless root (only root can give
    files away or become nobody) or when the account does not exist (tests never create users)."""
    if os.getuid() != 0:
        pytest.skip("another user's files and processes need root (chown / setuid to 'nobody'); running as uid "
                    f"{os.getuid()}")
    try:
        pw = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account on this host (tests never create OS users)")
    return pw.pw_uid, pw.pw_gid


@contextlib.contextmanager
def memtier_device(tag: str, size: str):
    """A fresh memory-tier device in /dev/shm (``size`` as ``deepfreeze memtier create``), removed after."""
    from deepfreeze.memtier import device as mdev
    path = f"/dev/shm/deepfreeze-test-{tag}-{uuid.uuid4().hex[:10]}"
    mdev.create(path, size).close()
    try:
        yield path
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def reseal_shard(b: bytearray) -> None:
    """Recompute the index CRC and the header CRC of a (mutated) shard file, when the header
    is long enough to hold them (format 2: 72 bytes)."""
    import struct
    import zlib
    if len(b) < 72:
        return
    index_len = struct.unpack_from("<I", b, 36)[0]
    b[64:68] = struct.pack("<I", zlib.crc32(bytes(b[72:72 + index_len])))
    b[68:72] = struct.pack("<I", zlib.crc32(bytes(b[:68])))


def replace_record(path: str, record: bytes) -> None:
    """Put ``record`` (zero-padded to the same length) in place of rank 0's state record in the
    assembled file ``path`` (its version's manifest beside it names the tensor), its entry's,
    the index's and the header's CRCs recomputed: only the record's decoder can refuse it
    (what an attacker who can write the file does)."""
    import json
    import struct
    import zlib
    from deepfreeze import format as fmt
    with open(os.path.join(os.path.dirname(path), "manifest.json"), "rb") as f:
        tid = [t["id"] for t in json.loads(f.read())["tensors"] if t["name"] == "_deepfreeze/rank0"][0]
    b = bytearray(open(path, "rb").read())
    si = fmt.read_index(bytes(b), path)
    pos, hit = 72, None
    for e in si.entries:
        if e.tensor_id == tid:
            hit = (pos, e)
        pos += 48 + 8 * len(e.shape)
    assert hit is not None and hit[1].start == 0
    if not record[hit[1].length:].strip(b"\0"):  # longer only by the reserve's zero padding
        record = record[:hit[1].length]
    assert hit[1].length >= len(record)
    epos, e = hit
    b[e.offset:e.offset + e.length] = record + b"\0" * (e.length - len(record))
    b[epos + 40:epos + 44] = struct.pack("<I", zlib.crc32(bytes(b[e.offset:e.offset + e.length])))
    reseal_shard(b)
    with open(path, "wb") as f:
        f.write(b)


#: what tests/conftest.py's autouse ``_private_runtime_dir`` gives every test and the processes it starts
BACKEND_IDLE = "2"


def runtime_dir(tmp_path_factory) -> str:
    """This test session's backend socket directory (one per pytest-xdist worker), created 0700."""
    d = tmp_path_factory.getbasetemp() / "run"
    d.mkdir(mode=0o700, exist_ok=True)
    return str(d)


@contextlib.contextmanager
def as_in_a_test(tmp_path_factory):
    """For the jobs a module-scoped fixture starts in place of tests: the environment
    tests/conftest.py's autouse ``_private_runtime_dir`` gives a test and the processes it starts
    (this session's backend socket directory, a 2 s backend idle time). A module-scoped fixture is
    set up before the test's function-scoped fixtures, so it runs without them. Yields the directory."""
    with pytest.MonkeyPatch.context() as mp:
        d = runtime_dir(tmp_path_factory)
        mp.setenv("DEEPFREEZE_RUNTIME_DIR", d)
        mp.setenv("DEEPFREEZE_BACKEND_IDLE", BACKEND_IDLE)
        yield d


def lines_of(conn, bufsize: int = 1 << 16, stop=None):
    """The newline-terminated lines that arrive on the socket ``conn`` (bytes, without the newline)
    until the peer closes it, a receive fails, or ``stop`` (a threading.Event) is set: the reader of
    the tests' stand-in backends (tests/workers/old_backend.py, test_hung_backend's SilentPeer)."""
    buf = b""
    while stop is None or not stop.is_set():
        try:
            chunk = conn.recv(bufsize)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line
