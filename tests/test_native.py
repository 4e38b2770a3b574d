"""deepfreeze._native: every C-library wrapper called for real, and its errno path (OSError
carrying the errno and what was being done)."""
from __future__ import annotations

import ctypes
import errno
import os
import sys

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
