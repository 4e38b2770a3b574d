"""deepfreeze._native: every C-library wrapper called for real, and its errno path (OSError
carrying the errno and what was being done)."""
from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from deepfreeze import _native as nat

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux system calls")


class Iovec(ctypes.Structure):  # struct iovec, the layout process_vm_readv reads
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _iov(arr: np.ndarray) -> Iovec:
    return Iovec(arr.ctypes.data, arr.nbytes)


def _absent_pid() -> int:
    """A pid no process can have: pid_max itself (pids go up to pid_max - 1)."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def test_available_names_the_functions():
    assert nat.available("memcmp") is True
    for name in ("sync_file_range", "process_vm_readv", "process_vm_writev", "prctl"):
        assert nat.available(name) is sys.platform.startswith("linux")
    for name in ("ioprio_set", "ioprio_get"):  # through syscall(2), where the numbers are known
        assert nat.available(name) is (sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64"))
    with pytest.raises(ValueError, match="not one of"):
        nat.available("system")


def test_memcmp_orders_bytes():
    a = np.frombuffer(b"deepfreeze\x00\x01", np.uint8).copy()
    b = a.copy()
    assert nat.memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
    b[-1] = 2
    assert nat.memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) < 0
    assert nat.memcmp(b.ctypes.data, a.ctypes.data, a.nbytes) > 0
    assert nat.memcmp(a.ctypes.data, b.ctypes.data, a.nbytes - 1) == 0  # the differing byte left out


def test_memmove_copies_and_overlaps():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    nat.memmove(dst.ctypes.data, src.ctypes.data, 64)
    assert np.array_equal(dst, src)
    nat.memmove(dst.ctypes.data + 1, dst.ctypes.data, 63)  # overlapping: memmove, not memcpy
    assert dst[0] == 0 and np.array_equal(dst[1:], src[:63])


@linux
def test_sync_file_range_on_a_file_and_its_errors(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        nat.sync_file_range(fd, 0, 8192, nat.SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as e:
            nat.sync_file_range(r, 0, 1, nat.SYNC_FILE_RANGE_WRITE)
        assert e.value.errno == errno.ESPIPE
        assert f"sync_file_range of descriptor {r}" in str(e.value)
    finally:
        os.close(r)
        os.close(w)


@linux
def test_process_vm_readv_and_writev_of_this_process():
    src = np.arange(1000, dtype=np.int32)
    dst = np.zeros(1000, np.int32)
    local, remote = _iov(dst), _iov(src)
    got = nat.process_vm_readv(os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1)
    assert got == src.nbytes and np.array_equal(dst, src)
    back = np.full(1000, 7, np.int32)
    local, remote = _iov(back), _iov(src)
    got = nat.process_vm_writev(os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1)
    assert got == src.nbytes and np.all(src == 7)


@linux
def test_process_vm_readv_of_a_pid_that_does_not_exist_raises_esrch():
    dst = np.zeros(16, np.uint8)
    local = remote = _iov(dst)
    pid = _absent_pid()
    with pytest.raises(OSError) as e:
        nat.process_vm_readv(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1)
    assert e.value.errno == errno.ESRCH and isinstance(e.value, ProcessLookupError)
    assert f"process_vm_readv of process {pid}" in str(e.value)
    with pytest.raises(ProcessLookupError, match="process_vm_writev"):
        nat.process_vm_writev(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1)


@linux
def test_process_vm_readv_of_an_unmapped_address_raises_efault():
    dst = np.zeros(16, np.uint8)
    local, remote = _iov(dst), Iovec(8, 16)  # nobody maps address 8
    with pytest.raises(OSError) as e:
        nat.process_vm_readv(os.getpid(), ctypes.addressof(local), 1, ctypes.addressof(remote), 1)
    assert e.value.errno == errno.EFAULT


@linux
def test_prctl_returns_its_result_and_raises_einval():
    PR_GET_DUMPABLE = 3
    assert nat.prctl(PR_GET_DUMPABLE) in (0, 1, 2)
    with pytest.raises(OSError) as e:
        nat.prctl(0x7FFF_FFFF)  # no such option
    assert e.value.errno == errno.EINVAL and "prctl(0x7fffffff" in str(e.value)


ioprio = pytest.mark.skipif(not nat.available("ioprio_set"), reason="ioprio_set: Linux x86_64/aarch64")
WHO = nat.IOPRIO_WHO_PROCESS


@ioprio
def test_ioprio_of_one_thread_and_back():
    """Setting a thread's I/O priority by its id changes that thread only; it reads back."""
    me = threading.get_native_id()
    mine = nat.ioprio_get(WHO, me)
    got, go = {}, threading.Event()

    def other():
        tid = threading.get_native_id()
        nat.ioprio_set(WHO, tid, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 7))
        got["other"] = nat.ioprio_get(WHO, tid)
        nat.ioprio_set(WHO, tid, nat.ioprio_value(nat.IOPRIO_CLASS_IDLE))
        got["idle"] = nat.ioprio_get(WHO, tid)
        nat.ioprio_set(WHO, tid, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 4))  # the idle class is left again
        got["back"] = nat.ioprio_get(WHO, tid)
        go.set()

    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert go.is_set()
    assert nat.ioprio_parts(got["other"]) == (nat.IOPRIO_CLASS_BE, 7)
    assert nat.ioprio_parts(got["idle"]) == (nat.IOPRIO_CLASS_IDLE, 0)
    assert nat.ioprio_parts(got["back"]) == (nat.IOPRIO_CLASS_BE, 4)
    assert nat.ioprio_get(WHO, me) == mine  # this thread: unchanged


@ioprio
def test_ioprio_errors_carry_the_errno():
    with pytest.raises(OSError) as e:  # classes are 0-3
        nat.ioprio_set(WHO, threading.get_native_id(), nat.ioprio_value(7, 0))
    assert e.value.errno == errno.EINVAL and "class 7 level 0" in str(e.value)
    pid = _absent_pid()
    with pytest.raises(ProcessLookupError, match=f"ioprio_get of {pid}"):
        nat.ioprio_get(WHO, pid)
    with pytest.raises(ProcessLookupError, match=f"ioprio_set of {pid}"):
        nat.ioprio_set(WHO, pid, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 7))


NOBODY_IOPRIO = textwrap.dedent("""
    import os, threading
    from deepfreeze import _native as nat
    if os.geteuid() == 0:
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    tid, W = threading.get_native_id(), nat.IOPRIO_WHO_PROCESS
    nat.ioprio_set(W, tid, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 7))
    nat.ioprio_set(W, tid, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 4))  # raised back: allowed, same user
    print("BE", nat.ioprio_parts(nat.ioprio_get(W, tid)))
    for what, who, value in (("RT", tid, nat.ioprio_value(nat.IOPRIO_CLASS_RT, 4)),
                             ("INIT", 1, nat.ioprio_value(nat.IOPRIO_CLASS_BE, 7))):
        try:
            nat.ioprio_set(W, who, value)
            print(what, "ALLOWED")
        except PermissionError as e:
            print(what, "EPERM", e.errno)
""")


@ioprio
def test_ioprio_as_an_unprivileged_user():
    """As a user without privileges (root drops to nobody; another user runs as itself): the
    best-effort level goes down and up again; the real-time class and another user's process
    are refused with PermissionError."""
    if os.geteuid() == 0:
        import pwd
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            pytest.skip("no 'nobody' account")
    out = subprocess.run([sys.executable, "-c", NOBODY_IOPRIO], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert "BE (2, 4)" in out.stdout and "RT EPERM" in out.stdout and "INIT EPERM" in out.stdout, out.stdout
