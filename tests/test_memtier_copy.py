"""The memory tier's copiers (deepfreeze/memtier/copy.py): one suite over both.

VmReadvCopier reads a real child process (a Python that allocates numpy arrays with known
contents, prints their addresses and sleeps); LocalCopier reads this process's arrays. Both
must give the same bytes and the same CRCs as zlib over the recorded arrays.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zlib
import ctypes

import numpy as np
import pytest

from deepfreeze.errors import MemtierError, MemtierPermissionError
from deepfreeze.memtier import copy as mc

# sizes chosen to cross the batch boundaries: many small arrays (more than IOV_MAX in one
# call's worth), odd lengths, one array larger than a CHUNK, zero-length ones
SIZES = [0, 1, 7, 64, 4095, 4097] + [13] * 1100 + [mc.CHUNK + 12345, 3 * 1024 * 1024 + 1, 0, 100]

CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    sizes = json.loads(sys.argv[1])
    arrays = []
    for i, n in enumerate(sizes):
        a = (np.arange(n, dtype=np.uint64) * 2654435761 + i).astype(np.uint8)
        arrays.append(a)
    print(json.dumps([[int(a.ctypes.data) if a.size else 0, int(a.nbytes)] for a in arrays]), flush=True)
    sys.stdin.readline()  # stay alive until the test is done (closes stdin)
    out = [a.tobytes().hex() for a in arrays[:3]]
    print(json.dumps(out), flush=True)
""")


def _arrays(sizes):
    return [(np.arange(n, dtype=np.uint64) * 2654435761 + i).astype(np.uint8) for i, n in enumerate(sizes)]


class _Child:
    def __init__(self, sizes):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(sizes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, "the child died before printing its addresses"
        self.regions = [tuple(x) for x in json.loads(line)]

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stdin.close()


@pytest.fixture(params=["local", "vm_readv"])
def source(request):
    """(copier, regions, expected arrays, child or None) for the same SIZES."""
    expected = _arrays(SIZES)
    if request.param == "local":
        regions = [(int(a.ctypes.data) if a.size else 0, int(a.nbytes)) for a in expected]
        yield mc.LocalCopier(), regions, expected, None
    else:
        child = _Child(SIZES)
        try:
            yield mc.VmReadvCopier(child.proc.pid), child.regions, expected, child
        finally:
            child.close()


def test_back_to_back_bytes_and_crcs(source):
    copier, regions, expected, _ = source
    total = sum(a.nbytes for a in expected)
    dest = np.full(total + 100, 0xEE, dtype=np.uint8)
    spans, pos = [], 0
    for a in expected:
        spans.append((pos, a.nbytes))
        pos += a.nbytes
    stats = copier.copy_in(regions, memoryview(dest), spans)
    assert stats.bytes == total
    assert np.array_equal(dest[:total], np.concatenate(expected))
    assert (dest[total:] == 0xEE).all()  # nothing written past the regions
    assert stats.crcs == [zlib.crc32(a.tobytes()) for a in expected]
    # batches: at most CHUNK bytes and IOV_MAX pieces each, so at least this many calls
    assert stats.calls >= max(-(-total // mc.CHUNK), -(-len([a for a in expected if a.size]) // mc.IOV_MAX))


def test_placed_at_offsets_with_gaps_untouched(source):
    copier, regions, expected, _ = source
    offsets, pos = [], 0
    for a in expected:
        pos = (pos + 63) // 64 * 64
        offsets.append(pos)
        pos += a.nbytes
    dest = np.full(pos, 0xAB, dtype=np.uint8)
    spans = [(o, a.nbytes) for o, a in zip(offsets, expected)]
    stats = copier.copy_in(regions, dest, spans, dest_offsets=offsets)
    mask = np.ones(pos, dtype=bool)
    for o, a in zip(offsets, expected):
        assert np.array_equal(dest[o:o + a.nbytes], a)
        mask[o:o + a.nbytes] = False
    assert (dest[mask] == 0xAB).all()
    assert stats.crcs == [zlib.crc32(a.tobytes()) for a in expected]
    # a span over several pieces (no gaps between them) gets one CRC over all of them
    whole = copier.copy_in(regions[6:20], np.zeros(13 * 14, np.uint8), [(0, 13 * 14)])
    assert whole.crcs == [zlib.crc32(np.concatenate(expected[6:20]).tobytes())]


def test_copy_out_writes_the_target(source):
    copier, regions, expected, child = source
    src = np.concatenate(expected[:3]) ^ 0x5A
    stats = copier.copy_out(src, regions[:3])
    assert stats.bytes == src.nbytes
    if child is None:
        got = [a.tobytes() for a in expected[:3]]
    else:
        child.proc.stdin.write("\n")
        child.proc.stdin.flush()
        got = [bytes.fromhex(h) for h in json.loads(child.proc.stdout.readline())]
    assert b"".join(got) == src.tobytes()


def test_bad_arguments_are_refused(source):
    copier, regions, expected, _ = source
    n = expected[3].nbytes
    with pytest.raises(ValueError, match="run past"):
        copier.copy_in(regions[3:4], np.zeros(n - 1, np.uint8))
    with pytest.raises(ValueError, match="overlaps"):
        copier.copy_in(regions[3:5], np.zeros(10 ** 5, np.uint8), dest_offsets=[0, n - 1])
    with pytest.raises(ValueError, match="not inside"):
        copier.copy_in(regions[3:4], np.zeros(2 * n, np.uint8), [(0, n + 1)])
    with pytest.raises(ValueError, match="read-only"):
        copier.copy_in(regions[3:4], bytes(n))


class _ShortCopier(mc.VmReadvCopier):
    """Each call asks the kernel for at most 777 bytes of the first iovec: partial returns."""

    calls = 0

    def _syscall(self, fn, local, remote, count):
        first = mc._Iovec.from_address(local)
        rfirst = mc._Iovec.from_address(remote)
        one_l = mc._Iovec(first.iov_base, min(first.iov_len, 777))
        one_r = mc._Iovec(rfirst.iov_base, min(rfirst.iov_len, 777))
        self.calls += 1
        return super()._syscall(fn, ctypes.addressof(one_l), ctypes.addressof(one_r), 1)


def test_partial_returns_are_continued():
    """process_vm_readv stopping in the middle of an iovec (as it may) is resumed where it stopped."""
    sizes = [5000, 3, 70000]
    expected = _arrays(sizes)
    child = _Child(sizes)
    try:
        copier = _ShortCopier(child.proc.pid)
        dest = np.zeros(75003, np.uint8)
        stats = copier.copy_in(child.regions, dest, [(0, 5000), (5000, 3), (5003, 70000)])
        assert np.array_equal(dest, np.concatenate(expected))
        assert stats.crcs == [zlib.crc32(a.tobytes()) for a in expected]
        assert stats.calls == copier.calls >= 75003 // 777
    finally:
        child.close()


def test_peer_gone_and_unmapped_address():
    child = _Child([4096])
    regions = child.regions
    child.close()
    with pytest.raises(MemtierError, match="gone"):
        mc.VmReadvCopier(child.proc.pid).copy_in(regions, np.zeros(4096, np.uint8))
    with pytest.raises(MemtierError, match="not mapped"):  # our own pid, an address nobody maps
        mc.VmReadvCopier(os.getpid()).copy_in([(8, 4096)], np.zeros(4096, np.uint8))


NOBODY = textwrap.dedent("""
    import os, sys
    import numpy as np
    from deepfreeze.errors import MemtierPermissionError
    from deepfreeze.memtier.copy import VmReadvCopier
    if os.geteuid() == 0:  # drop to 'nobody' once everything is imported
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    try:
        VmReadvCopier(int(sys.argv[1])).copy_in([(int(sys.argv[2]), 8)], np.zeros(8, np.uint8))
    except MemtierPermissionError as e:
        print("EPERM-OK", e)
    else:
        print("READ")
""")


def test_permission_error_names_the_cause():
    """A process of another user may not read ours: MemtierPermissionError explaining why (the
    reader drops to user 'nobody' and reads this process; as a normal user, it reads pid 1)."""
    target = os.getpid() if os.geteuid() == 0 else 1
    buf = np.arange(8, dtype=np.uint8)
    out = subprocess.run([sys.executable, "-c", NOBODY, str(target), str(buf.ctypes.data)],
                         capture_output=True, text=True, timeout=60)
    assert "EPERM-OK" in out.stdout, out.stdout + out.stderr
    assert "same user" in out.stdout


def test_ptracer_helpers():
    scope = mc.ptrace_scope()
    assert scope is None or scope in (0, 1, 2, 3)
    assert mc.allow_ptracer(os.getppid()) is (scope is None or scope <= 1)
