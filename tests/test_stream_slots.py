"""deepfreeze.stream.slots: the shared-memory slot ring, with real processes (no mocks).

Producers and readers run as separate Python processes (subprocess) on real files in /dev/shm;
faults are real: SIGKILL, ``os._exit`` from a subclass hook in the middle of a copy, hostile
files written byte by byte. Framework-neutral: also run under the system python3 (numpy 2).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from deepfreeze.errors import ConfigError, StreamError, VersionGoneError
from deepfreeze.format import crc32
from deepfreeze.lease import Version
from deepfreeze.stream import slots as slots_mod
from deepfreeze.stream.slots import SlotRing, ring_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHM = "/dev/shm"


@pytest.fixture
def shm_path():
    """A fresh ring path in /dev/shm, removed afterwards."""
    path = os.path.join(SHM, f"deepfreeze-test-slots-{os.getpid()}-{secrets.token_hex(4)}")
    yield path
    if os.path.lexists(path):
        os.unlink(path)


def spawn(code: str, *args: str, python: str = sys.executable) -> subprocess.Popen:
    """A child Python process running ``code`` against this worktree's deepfreeze (unbuffered
    binary stdin/stdout pipes: a line read never pulls the next lines into a buffer ``select``
    cannot see; use :func:`send`, :func:`expect_line`, :func:`finish`)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([python, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, env=env, cwd=ROOT)


def send(proc: subprocess.Popen, line: str) -> None:
    proc.stdin.write(line.encode() + b"\n")


def expect_line(proc: subprocess.Popen, want: str, timeout: float = 60) -> str:
    """The child's next stdout line, which must start with ``want`` (bounded wait)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sel.select(left):
            proc.kill()
            raise AssertionError(f"no {want!r} from the child within {timeout} s; stderr: {proc.stderr.read()!r}")
        line = proc.stdout.readline().decode()     # raw pipe: reads up to the newline, not beyond
        if not line:
            proc.wait(10)
            raise AssertionError(f"child exited ({proc.returncode}) before {want!r}; stderr: {proc.stderr.read()!r}")
        if line.startswith(want):
            return line.strip()


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    """Close the child's stdin, wait (bounded) for it; its stdout; it must exit 0."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child did not finish within {timeout} s; stderr: {err}")
    assert proc.returncode == 0, f"child exited {proc.returncode}: {err.decode(errors='replace')}"
    return out.decode()


def pattern(step: int, nbytes: int) -> np.ndarray:
    """Version ``step``'s bytes: every uint32 equals step (so a mix of two versions shows)."""
    return np.full(nbytes // 4, step, dtype=np.uint32).view(np.uint8)


def random_bytes(step: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, 256, nbytes, dtype=np.uint8)


# ------------------------------------------------------------------------------------------ basics
def test_round_trip_bit_exact_producer_process(shm_path):
    """A producer process publishes versions of random bytes (sizes 0 .. capacity); another process
    (this one) reads the held versions bit for bit, with the CRC the producer computed."""
    cap = 3 * (1 << 20) + 123     # several copy chunks, not a multiple of a page
    sizes = {1: 5, 2: 0, 3: cap, 4: 1 << 20, 5: cap - 1}
    prod = spawn("""
        import sys, numpy as np
        from deepfreeze.lease import Version
        from deepfreeze.stream.slots import SlotRing
        path, cap, sizes = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3])
        with SlotRing.create(path, cap, 4, meta={"channel": "nt3", "rank": 1}) as ring:
            for step, n in sorted(sizes.items()):
                data = np.random.default_rng(step).integers(0, 256, n, dtype=np.uint8)
                print("slot", step, ring.write(Version(2, step), data), flush=True)
            print("ready", flush=True)
            sys.stdin.read()
    """, shm_path, str(cap), repr(sizes))
    try:
        expect_line(prod, "ready")
        with SlotRing.open(shm_path) as ring:
            assert (ring.slots, ring.capacity, ring.meta) == (4, cap, {"channel": "nt3", "rank": 1})
            held = ring.versions()
            assert [v for v, _, _ in held] == [Version(2, s) for s in (5, 4, 3, 2)]
            assert ring.latest() == held[0]
            for ver, n, c in held:
                want = random_bytes(ver.step, sizes[ver.step])
                assert n == want.size and c == crc32(want)
                got_ver, got_crc, got = ring.read(ver)
                assert got_ver == ver and got_crc == c and got.dtype == np.uint8
                assert np.array_equal(got, want)
                buf = bytearray(cap)                       # into a caller's buffer
                _, _, view = ring.read(ver, out=buf)
                assert view.size == n and bytes(buf[:n]) == want.tobytes()
                with ring.pinned(ver) as (pv, pc, mv):    # zero copy
                    assert (pv, pc, len(mv), mv.readonly) == (ver, c, n, True)
                    assert bytes(mv) == want.tobytes()
                with pytest.raises(ValueError):
                    len(mv)                                # the view is released at the end of the block
            assert ring.read()[0] == Version(2, 5)
            assert ring.writer_alive()
            with pytest.raises(VersionGoneError, match="no longer"):
                ring.read(Version(2, 1))                   # overwritten by version 5 (4 slots)
            with pytest.raises(StreamError, match="at least"):
                ring.read(Version(2, 3), out=np.empty(10, np.uint8))
            with pytest.raises(ValueError, match="writable"):
                ring.read(Version(2, 4), out=bytes(cap))
            with pytest.raises(StreamError, match="read-only"):
                ring.write(Version(2, 9), b"x")
            finish(prod)                                   # the producer closes its ring and exits
            assert not ring.writer_alive()
            assert ring.read()[0] == Version(2, 5)         # what it published stays readable
    finally:
        prod.kill()


def test_create_validates_and_write_order(shm_path, tmp_path):
    with pytest.raises(ConfigError, match="slots=2"):
        SlotRing.create(shm_path, 4096, 2)
    with pytest.raises(ConfigError, match="capacity"):
        SlotRing.create(shm_path, 0)
    with pytest.raises(ConfigError, match="meta"):
        SlotRing.create(shm_path, 4096, meta={"x": "y" * (70 * 1024)})
    with pytest.raises(ConfigError, match="meta"):
        SlotRing.create(shm_path, 4096, meta={"x": object()})
    assert not os.path.exists(shm_path)
    with SlotRing.create(shm_path, 4096, 3) as ring:
        st = os.stat(shm_path)
        assert st.st_mode & 0o777 == 0o600 and st.st_size == ring_bytes(4096, 3, 2)
        assert ring.latest() is None and ring.versions() == []
        with pytest.raises(VersionGoneError, match="no version"):
            ring.read()
        with pytest.raises(FileExistsError):
            SlotRing.create(shm_path, 4096, 3)
        assert ring.last_written is None
        assert ring.write(Version(0, 5), b"abc") is not None
        assert ring.last_written == (Version(0, 5), 3, crc32(b"abc")) == ring.latest()
        for bad in (Version(0, 5), Version(0, 4)):
            with pytest.raises(ValueError, match="must grow"):
                ring.write(bad, b"abc")
        with pytest.raises(ValueError, match="larger capacity"):
            ring.write(Version(0, 6), bytes(4097))
        assert ring.write(Version(1, 0), b"new generation") is not None   # a new generation restarts steps
        assert [v for v, _, _ in ring.versions()] == [Version(1, 0), Version(0, 5)]
        assert ring.read()[2].tobytes() == b"new generation"
        # a multi-dimensional array of another dtype is published as its bytes
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        ring.write(Version(1, 1), a, crc=crc32(a))
        assert np.array_equal(ring.read()[2].view(np.float32).reshape(3, 4), a)
        with pytest.raises(ValueError, match="C-contiguous"):
            ring.write(Version(1, 2), a[:, ::2])
    ring.unlink()
    assert not os.path.exists(shm_path)


def test_write_with_fills_a_slot_in_place_and_read_into_checks_it(shm_path):
    """write_with: the caller's fill copies straight into the slot and returns the CRC of what it
    wrote; a torn fill (None) or one that raises publishes nothing (the slot stays odd, the
    previous version is served, torn counted); read_into copies a slot straight into pieces of
    destination arrays (gaps left out), its CRC computed over every byte of the slot, so a slot
    whose bytes differ from its record's CRC is refused, and pieces outside the slot or
    overlapping are refused before they are written."""
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * slots_mod.CHUNK + 12345, dtype=np.uint8)
    calls = []

    def fill_with(payload, crc=None, torn=False):
        def fill(dst, copied):
            calls.append(dst.size)
            dst[:] = payload
            copied(dst.size)
            return None if torn else (crc32(dst) if crc is None else crc)
        return fill

    with SlotRing.create(shm_path, data.size, 3) as ring:
        assert ring.write_with(Version(0, 1), data.size, fill_with(data)) is not None
        assert ring.latest() == (Version(0, 1), data.size, crc32(data))
        assert ring.write_with(Version(0, 2), data.size, fill_with(data[::-1].copy(), torn=True)) is None
        assert ring.torn == 1 and ring.latest()[0] == Version(0, 1) and len(ring.versions()) == 1

        def boom(dst, copied):
            dst[:100] = 1
            raise RuntimeError("the source went away")
        with pytest.raises(RuntimeError, match="went away"):
            ring.write_with(Version(0, 3), data.size, boom)
        assert [v for v, _, _ in ring.versions()] == [Version(0, 1)]
        with pytest.raises(ValueError, match="larger capacity"):
            ring.write_with(Version(0, 4), data.size + 1, fill_with(data))
        # pieces of two destination arrays with gaps between them (and after the last one)
        a, b = np.zeros(2 * slots_mod.CHUNK + 7, np.uint8), np.zeros(5000, np.uint8)
        pieces = [(3, a), (3 + a.size + 100, b)]
        ver, crc = ring.read_into(None, pieces)
        assert ver == Version(0, 1) and crc == crc32(data)
        assert a.tobytes() == data[3:3 + a.size].tobytes() and b.tobytes() == data[a.size + 103:a.size + 5103].tobytes()
        for bad in ([(0, a), (10, b)], [(data.size - 10, b)]):
            with pytest.raises(StreamError, match="outside it or overlaps"):
                ring.read_into(None, bad)
        # a record whose CRC is not its bytes' (what a slot changed by someone else looks like)
        assert ring.write_with(Version(0, 5), data.size, fill_with(data, crc=crc32(data) ^ 1)) is not None
        with pytest.raises(StreamError, match="CRC32"):
            ring.read_into(None, [(0, np.zeros(16, np.uint8))])
        got = np.zeros(16, np.uint8)
        assert ring.read_into(None, [(0, got)], verify=False)[0] == Version(0, 5) and got.tobytes() == data[:16].tobytes()
    assert calls == [data.size] * 3  # v1, v2 (torn), v5: the refused size never reached a fill


def test_bandwidth_100mb_slot_info(shm_path):
    """Write and read throughput of one 100 MB slot (printed for the docs; never asserted)."""
    n = 100 * 10**6
    data = random_bytes(7, n)
    with SlotRing.create(shm_path, n, 3) as ring, SlotRing.open(shm_path) as reader:
        out = np.ones(n, np.uint8)                    # pre-faulted destination, as a consumer keeps one
        w, r, rv = [], [], []
        for step in range(1, 6):
            t0 = time.perf_counter()
            ring.write(Version(0, step), data)
            t1 = time.perf_counter()
            reader.read(out=out)
            t2 = time.perf_counter()
            reader.read(out=out, verify=False)
            t3 = time.perf_counter()
            w.append(t1 - t0), r.append(t2 - t1), rv.append(t3 - t2)
        assert np.array_equal(out, data)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"\n[info] 100 MB slot: write+crc {n / med(w) / 1e9:.2f} GB/s ({med(w) * 1e3:.1f} ms), "
          f"read+verify {n / med(r) / 1e9:.2f} GB/s ({med(r) * 1e3:.1f} ms), read without verify "
          f"{n / med(rv) / 1e9:.2f} GB/s ({med(rv) * 1e3:.1f} ms); crc32 via "
          f"{slots_mod.crc32.__module__}, numpy {np.__version__}")


# ------------------------------------------------------------------------------------ pinning
_PINNER = """
    import sys, time, numpy as np
    from deepfreeze.lease import Version
    from deepfreeze.stream.slots import SlotRing
    path, step = sys.argv[1], int(sys.argv[2])
    ring = SlotRing.open(path)
    with ring.pinned(Version(0, step)) as (ver, crc, view):
        print("pinned", ver.step, flush=True)
        sys.stdin.readline()                  # hold the pin until told (or killed)
        arr = np.frombuffer(view, dtype=np.uint32)
        print("intact", bool((arr == step).all()), arr.size, flush=True)
        del arr
"""


def test_writer_skips_pinned_slots_and_a_killed_reader_releases_its_pin(shm_path):
    """K=3: two reader processes pin the two older versions; the writer neither waits nor
    overwrites them (it skips, counted); SIGKILL of one reader frees its slot at once; the other
    reader's pinned bytes stay intact while the writer goes on."""
    n = 1 << 20
    ring = SlotRing.create(shm_path, n, 3)
    readers = []
    try:
        for step in (1, 2, 3):
            assert ring.write(Version(0, step), pattern(step, n)) == step - 1
        readers = [spawn(_PINNER, shm_path, "1"), spawn(_PINNER, shm_path, "2")]
        for r, step in zip(readers, (1, 2)):
            expect_line(r, f"pinned {step}")
        t0 = time.monotonic()
        assert ring.write(Version(0, 4), pattern(4, n)) is None        # every candidate pinned: skipped
        assert time.monotonic() - t0 < 5                                 # (it did not wait for a reader)
        assert ring.skipped == 1
        assert [v.step for v, _, _ in ring.versions()] == [3, 2, 1]     # nothing was overwritten
        readers[0].send_signal(signal.SIGKILL)
        readers[0].wait(30)
        assert ring.write(Version(0, 5), pattern(5, n)) == 0            # version 1's slot, freed by the kill
        assert ring.write(Version(0, 6), pattern(6, n)) == 2            # not 1 (pinned), not 0 (newest)
        assert ring.write(Version(0, 7), pattern(7, n)) == 0
        assert ring.skipped == 1
        send(readers[1], "check")
        assert expect_line(readers[1], "intact") == f"intact True {n // 4}"
        finish(readers[1])
        assert ring.write(Version(0, 8), pattern(8, n)) == 1            # released at the end of the block
        assert [v.step for v, _, _ in ring.versions()] == [8, 7, 6]
    finally:
        for r in readers:
            r.kill()
            r.wait(10)
        ring.close()


def test_pins_in_the_producers_own_process(shm_path):
    """A pin taken in the writer's process (its own ``pinned``, or a second, read-only ring object on
    the same file) keeps the writer off the slot as a pin from another process does."""
    n = 8192
    with SlotRing.create(shm_path, n, 3) as ring, SlotRing.open(shm_path) as reader:
        for step in (1, 2, 3):
            ring.write(Version(0, step), pattern(step, n))
        with ring.pinned(Version(0, 1)) as (_, _, v1), reader.pinned(Version(0, 2)) as (_, _, v2):
            assert ring.write(Version(0, 4), pattern(4, n)) is None
            assert ring.skipped == 1
            assert bytes(v1) == pattern(1, n).tobytes() and bytes(v2) == pattern(2, n).tobytes()
        # two pins of one slot by one object: the slot is free only after both ended
        with ring.pinned(Version(0, 1)):
            with ring.pinned(Version(0, 1)):
                pass
            assert ring.write(Version(0, 5), pattern(5, n)) == 1       # not slot 0 (still pinned)
        assert ring.write(Version(0, 6), pattern(6, n)) == 0
        reader.close()
        assert ring.write(Version(0, 7), pattern(7, n)) == 2


def test_threads_of_the_producer_process(shm_path):
    """In one process: a writer thread publishing while reader threads copy (through the writer's
    own object and a read-only one) and a zero-copy thread holds pins (as the rank's TCP server
    thread does): every read is exactly one version."""
    import threading
    n = 64 * 1024
    bad, counts, errors = [], {"copy": 0, "pinned": 0, "other": 0}, []
    stop = threading.Event()
    with SlotRing.create(shm_path, n, 3) as ring, SlotRing.open(shm_path) as other:
        ring.write(Version(0, 1), pattern(1, n))

        def copier(r, key):
            out = np.empty(n, np.uint8)
            try:
                while not stop.is_set():
                    ver, _, got = r.read(out=out, verify=False)
                    if not (got.view(np.uint32) == ver.step).all():
                        bad.append((key, ver.step))
                    counts[key] += 1
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        def pinner():
            try:
                while not stop.is_set():
                    with ring.pinned() as (ver, _, view):
                        arr = np.frombuffer(view, np.uint32)
                        time.sleep(0.002)
                        if not (arr == ver.step).all():
                            bad.append(("pinned", ver.step))
                        del arr
                    counts["pinned"] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=copier, args=(ring, "copy")),
                   threading.Thread(target=copier, args=(other, "other")), threading.Thread(target=pinner)]
        for t in threads:
            t.start()
        written = 0
        try:
            for step in range(2, 1500):
                written += ring.write(Version(0, step), pattern(step, n)) is not None
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert errors == [] and bad == []
    assert written > 0 and min(counts.values()) > 0, counts
    print(f"\n[info] threads: written {written}, skipped {1498 - written}, reads {counts}")


_WRITER = """
    import sys, time, json, numpy as np
    from deepfreeze.lease import Version
    from deepfreeze.stream.slots import SlotRing
    path, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    ring = SlotRing.create(path, n, 3)
    ring.write(Version(0, 1), np.full(n // 4, 1, np.uint32))
    print("ready", flush=True)
    sys.stdin.readline()
    step, t_end, longest = 1, time.monotonic() + seconds, 0.0
    while time.monotonic() < t_end:
        step += 1
        t0 = time.monotonic()
        ring.write(Version(0, step), np.full(n // 4, step, np.uint32))
        longest = max(longest, time.monotonic() - t0)
        time.sleep(0.0005)
    print("done", json.dumps({"last": step, "skipped": ring.skipped, "longest": longest}), flush=True)
    sys.stdin.read()
    ring.close()
"""

_READER = """
    import sys, time, json, numpy as np
    from deepfreeze.lease import Version
    from deepfreeze.stream.slots import SlotRing
    path, n, seconds, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    ring = SlotRing.open(path)
    out = np.empty(n // 4, np.uint32)
    reads, bad, lapped_while_pinned, seen = 0, [], 0, set()
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        if mode == "copy":
            ver, crc, got = ring.read(out=out, verify=False)      # the bytes, not the CRC, are checked
            arr = got.view(np.uint32)
            if not (arr == ver.step).all():
                bad.append(ver.step)
        else:                                                     # a slow zero-copy reader
            with ring.pinned() as (ver, crc, view):
                arr = np.frombuffer(view, dtype=np.uint32)
                first = bool((arr == ver.step).all())
                held_until = time.monotonic() + 1.0               # hold the pin while the writer goes on,
                while time.monotonic() < held_until:              # until 3 newer versions are out (<= 1 s)
                    time.sleep(0.005)
                    if ring.latest()[0].step >= ver.step + 3:
                        lapped_while_pinned += 1
                        break
                if not (first and (arr == ver.step).all()):
                    bad.append(ver.step)
                del arr
        reads += 1
        seen.add(ver.step)
    print("result", json.dumps({"reads": reads, "bad": bad, "distinct": len(seen),
                                "went_by": lapped_while_pinned}), flush=True)
"""


def test_fast_writer_never_laps_slow_readers(shm_path):
    """A writer publishing as fast as it can (each version filled with its own step) and two
    reader processes (a copying one and a slow zero-copy one that holds each pin until >= 3 newer
    versions are out): every read returns exactly one version's bytes, the writer never waits."""
    n, seconds = 256 * 1024, 2.0
    writer = spawn(_WRITER, shm_path, str(n), str(seconds))
    readers = []
    try:
        expect_line(writer, "ready")
        readers = [spawn(_READER, shm_path, str(n), str(seconds), mode) for mode in ("copy", "pinned")]
        time.sleep(0.3)                                   # readers are up and reading version 1
        send(writer, "go")
        stats = json.loads(expect_line(writer, "done").split(" ", 1)[1])
        results = [json.loads(expect_line(r, "result").split(" ", 1)[1]) for r in readers]
        for r in readers:
            finish(r)
        finish(writer)
    finally:
        for p in (writer, *readers):
            p.kill()
            p.wait(10)
    print(f"\n[info] writer: {stats}; readers (copy, pinned): {results}")
    copy, slow = results
    assert copy["bad"] == [] and slow["bad"] == []
    assert stats["last"] > 50 and copy["reads"] > 10 and slow["reads"] > 10
    assert copy["distinct"] > 5 and slow["distinct"] > 5
    # the pin held while the writer published >= 3 newer versions: it was passed, not lapped or waited for
    assert slow["went_by"] > 0


# ------------------------------------------------------------------------------------ crashes
_DYING_WRITER = """
    import os, sys, numpy as np
    from deepfreeze.lease import Version
    from deepfreeze.stream.slots import SlotRing

    class DyingRing(SlotRing):
        die = False
        def _copied(self, slot, done, total):
            if self.die and 2 * done >= total:
                os._exit(3)              # the producer dies with half of the new version copied

    path, n = sys.argv[1], int(sys.argv[2])
    ring = DyingRing.create(path, n, 3)
    ring.write(Version(0, 1), np.full(n // 4, 1, np.uint32))
    ring.write(Version(0, 2), np.full(n // 4, 2, np.uint32))
    ring.die = True
    ring.write(Version(0, 3), np.full(n // 4, 3, np.uint32))
    print("survived", flush=True)
"""


def test_writer_killed_mid_write_leaves_previous_version(shm_path):
    n = 8 << 20                                      # 4 copy chunks: it dies after the second
    proc = spawn(_DYING_WRITER, shm_path, str(n))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err.decode(errors="replace")
    with SlotRing.open(shm_path) as ring:
        assert not ring.writer_alive()
        assert [v.step for v, _, _ in ring.versions()] == [2, 1]       # the torn slot is invisible
        ver, _, got = ring.read()
        assert ver == Version(0, 2) and (got.view(np.uint32) == 2).all()
        with pytest.raises(VersionGoneError):
            ring.read(Version(0, 3))
    # the test is meaningful: the third slot really holds half of version 3, marked "being written"
    with open(shm_path, "rb") as f:
        raw = f.read()
    hdr = slots_mod._HDR.unpack_from(raw)
    records, data, stride = hdr[7], hdr[9], hdr[6]
    seq = struct.unpack_from("<Q", raw, records + 2 * 64)[0]
    assert seq % 2 == 1
    torn = np.frombuffer(raw, np.uint32, count=n // 4, offset=data + 2 * stride)
    assert (torn[: n // 8] == 3).all() and (torn[n // 8:] == 0).all()


def test_sweep_stale_removes_rings_of_dead_writers_only(shm_path):
    """A producer killed outright leaves its ring in /dev/shm: ``sweep_stale`` removes it (its
    writer's lock byte is free), never a live writer's ring, never one younger than ``min_age``."""
    dead, live = shm_path + "-dead", shm_path + "-live"
    proc = spawn("""
        import os, signal, sys
        from deepfreeze.lease import Version
        from deepfreeze.stream.slots import SlotRing
        ring = SlotRing.create(sys.argv[1], 4096, 3)
        ring.write(Version(0, 1), b"x" * 4096)
        print("written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, dead)
    try:
        expect_line(proc, "written")
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL and os.path.exists(dead)
        with SlotRing.create(live, 4096, 3):
            prefix = os.path.basename(shm_path)
            assert slots_mod.sweep_stale(SHM, prefix) == []                      # both too young
            assert slots_mod.sweep_stale(SHM, prefix, min_age=0) == [dead]       # not the live one
            assert os.path.exists(live) and not os.path.exists(dead)
        assert slots_mod.sweep_stale(SHM, prefix, min_age=0) == [live]           # closed, not unlinked
    finally:
        proc.kill()
        for p in (dead, live):
            if os.path.exists(p):
                os.unlink(p)


# ------------------------------------------------------------------------------------ hostile files
def _valid_ring_bytes(tmp_path, capacity=8192, slots=3) -> bytes:
    path = str(tmp_path / "valid")
    with SlotRing.create(path, capacity, slots, meta={"k": "v"}) as ring:
        ring.write(Version(0, 1), pattern(1, capacity))
    with open(path, "rb") as f:
        raw = f.read()
    os.unlink(path)
    return raw


def _with_header(raw: bytes, **fields) -> bytes:
    """``raw`` with header fields replaced and the header CRC recomputed (a well-formed lie)."""
    names = ["magic", "fmt", "flags", "slots", "meta_len", "capacity", "stride", "records", "locks", "data", "size"]
    vals = dict(zip(names, slots_mod._HDR.unpack_from(raw)))
    vals.update(fields)
    hdr = slots_mod._HDR.pack(*(vals[k] for k in names))
    meta = raw[128:128 + vals["meta_len"]]
    b = bytearray(raw)
    b[:64] = hdr
    b[64:68] = struct.pack("<I", crc32(meta, crc32(hdr)))
    return bytes(b)


def _with_record(raw: bytes, slot: int, **fields) -> bytes:
    """``raw`` with slot ``slot``'s record fields replaced and its record CRC recomputed."""
    records = slots_mod._HDR.unpack_from(raw)[7]
    off = records + slot * 64
    names = ["seq", "gen", "step", "nbytes", "crc", "rcrc"]
    vals = dict(zip(names, struct.unpack_from("<QQqQII", raw, off)))
    vals.update(fields)
    body = struct.pack("<QQqQI", *(vals[k] for k in names[:5]))
    b = bytearray(raw)
    b[off:off + 40] = body + struct.pack("<I", crc32(body))
    return bytes(b)


def _write(tmp_path, name: str, raw: bytes) -> str:
    path = str(tmp_path / name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return path


def test_hostile_ring_files_are_refused(tmp_path):
    raw = _valid_ring_bytes(tmp_path)
    with SlotRing.open(_write(tmp_path, "ok", raw)) as ring:     # the control: the untouched file reads
        assert ring.read()[2].tobytes() == pattern(1, 8192).tobytes()
    flipped_meta = bytearray(raw)
    flipped_meta[130] ^= 1
    cases = {
        "bad magic": (b"XXXX" + raw[4:], "magic"),
        "empty": (b"", "magic"),
        "header only": (raw[:100], "magic"),
        "header crc": (bytes(flipped_meta), "checksum"),
        "huge capacity": (_with_header(raw, capacity=1 << 60), "out of bounds"),
        "capacity beyond file": (_with_header(raw, capacity=1 << 30, stride=1 << 30,
                                              size=_with_header_size(raw, 1 << 30)), "truncated"),
        "offsets lie": (_with_header(raw, data=64), "offsets"),
        "two slots": (_with_header(raw, slots=2), "out of bounds"),
        "huge meta": (_with_header(raw, meta_len=1 << 30), "out of bounds"),
        "format": (_with_header(raw, fmt=9), "format 9"),
        "truncated": (raw[: len(raw) // 2], "truncated"),
        "meta not json": (_with_header(raw[:128] + b"{not json" + raw[137:]), "not JSON"),
        "meta not object": (_with_header(raw[:128] + b"[1,2,3,4]" + raw[137:]), "not a JSON object"),
    }
    assert raw[128:137] == b'{"k":"v"}'       # the 9 meta bytes the two "meta" cases replace
    for name, (data, match) in cases.items():
        path = _write(tmp_path, name.replace(" ", "_"), data)
        with pytest.raises(StreamError, match=match):
            SlotRing.open(path)
    # records that lie: refused when read, never an out-of-range read
    for name, data, match in (("nbytes", _with_record(raw, 0, nbytes=8193), "claims 8193 bytes"),
                              ("nbytes huge", _with_record(raw, 0, nbytes=1 << 62), "claims"),
                              ("record crc", _corrupt_record_crc(raw, 0), "record checksum"),
                              ("data crc", _corrupt_data(raw, 0), "CRC32")):
        with SlotRing.open(_write(tmp_path, "rec_" + name.replace(" ", "_"), data)) as ring:
            with pytest.raises(StreamError, match=match):
                ring.read()
    # not a regular file / a link / someone else's or group-writable file
    os.mkdir(tmp_path / "dir")
    with pytest.raises(StreamError, match="regular"):
        SlotRing.open(str(tmp_path / "dir"))
    os.symlink(tmp_path / "ok", tmp_path / "link")
    with pytest.raises(StreamError):
        SlotRing.open(str(tmp_path / "link"))
    gw = _write(tmp_path, "groupwritable", raw)
    os.chmod(gw, 0o620)
    with pytest.raises(StreamError, match="writable by nobody else"):
        SlotRing.open(gw)
    if os.getuid() == 0:
        other = _write(tmp_path, "other_user", raw)
        os.chown(other, 12345, -1)
        with pytest.raises(StreamError, match="uid 12345"):
            SlotRing.open(other)
    with pytest.raises(FileNotFoundError):
        SlotRing.open(str(tmp_path / "absent"))


def _with_header_size(raw: bytes, capacity: int) -> int:
    hdr = slots_mod._HDR.unpack_from(raw)
    return ring_bytes(capacity, hdr[3], hdr[4])


def _corrupt_record_crc(raw: bytes, slot: int) -> bytes:
    off = slots_mod._HDR.unpack_from(raw)[7] + slot * 64
    b = bytearray(raw)
    b[off + 36] ^= 0xFF
    return bytes(b)


def _corrupt_data(raw: bytes, slot: int) -> bytes:
    hdr = slots_mod._HDR.unpack_from(raw)
    b = bytearray(raw)
    b[hdr[9] + slot * hdr[6] + 100] ^= 0xFF
    return bytes(b)


# ------------------------------------------------------------------------------------ too small
def test_ring_larger_than_shm_is_a_clear_error(shm_path):
    free = os.statvfs(SHM).f_bavail * os.statvfs(SHM).f_frsize
    cap = free // 2 + (1 << 20)                      # 3 slots of more than half the free space
    with pytest.raises(StreamError) as ei:
        SlotRing.create(shm_path, cap, 3)
    msg = str(ei.value)
    assert str(ring_bytes(cap, 3, 2)) in msg and "fewer slots" in msg and SHM in msg
    assert not os.path.exists(shm_path)              # nothing left behind


def test_small_tmpfs_is_a_clear_error(tmp_path):
    """In a private mount namespace with a real 1 MiB tmpfs: a ring that does not fit is refused
    with the sizes and what to do; one that fits works."""
    unshare = shutil.which("unshare")
    if os.getuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = textwrap.dedent("""
        import os, sys
        from deepfreeze.errors import StreamError
        from deepfreeze.lease import Version
        from deepfreeze.stream.slots import SlotRing
        d = sys.argv[1]
        try:
            SlotRing.create(os.path.join(d, "big"), 512 * 1024, 3)
        except StreamError as e:
            print("refused", os.path.exists(os.path.join(d, "big")), e)
        with SlotRing.create(os.path.join(d, "small"), 64 * 1024, 3) as ring:
            ring.write(Version(0, 1), b"x" * 1000)
            print("fits", ring.read()[2].size)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([unshare, "-m", "--propagation", "private", "sh", "-c",
                           'mount -t tmpfs -o size=1m tmpfs "$1" && exec "$2" -c "$3" "$1"', "sh",
                           str(mnt), sys.executable, code], capture_output=True, text=True, env=env, timeout=120)
    if proc.returncode != 0 and "mount" in proc.stderr and "refused" not in proc.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused False slot ring") and "fewer slots" in lines[0], lines
    assert str(ring_bytes(512 * 1024, 3, 2)) in lines[0]
    assert lines[1] == "fits 1000"
    assert os.listdir(mnt) == []                     # the tmpfs was private to the child's namespace


# ------------------------------------------------------------------------------------ numpy 2
def _other_numpy_python() -> tuple[str, str] | None:
    """An interpreter whose numpy major version differs from this one's (``$DEEPFREEZE_OTHER_PYTHON``,
    else every ``python3`` on ``PATH``, else the usual places): (path, its numpy version)."""
    seen, cands = set(), [os.environ.get("DEEPFREEZE_OTHER_PYTHON", "")]
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cands.append(os.path.join(d, "python3"))
    cands += ["/usr/bin/python3", "/usr/local/bin/python3", os.path.expanduser("~/.pyenv/shims/python3")]
    for c in cands:
        if not c or not os.access(c, os.X_OK) or os.path.realpath(c) in seen:
            continue
        seen.add(os.path.realpath(c))
        try:
            probe = subprocess.run([c, "-c", "import numpy; print(numpy.__version__)"], capture_output=True,
                                   text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = probe.stdout.strip()
        if probe.returncode == 0 and version.split(".")[0] != np.__version__.split(".")[0]:
            return c, version
    return None


def test_reader_with_another_numpy(shm_path):
    """A ring written here is read bit-exactly by a reader under an interpreter with the other numpy
    major version (the system python3's numpy 2 when this is the project's numpy 1 venv): the format
    does not depend on numpy's version."""
    other = _other_numpy_python()
    if other is None:
        pytest.skip(f"no python3 with a numpy other than {np.__version__.split('.')[0]}.x found "
                    f"(set DEEPFREEZE_OTHER_PYTHON)")
    n = 3 << 20
    data = random_bytes(11, n)
    with SlotRing.create(shm_path, n, 3, meta={"numpy": np.__version__}) as ring:
        ring.write(Version(1, 11), data)
        proc = spawn("""
            import hashlib, sys, numpy
            from deepfreeze.stream.slots import SlotRing
            with SlotRing.open(sys.argv[1]) as ring:
                ver, crc, got = ring.read()
                print(numpy.__version__, ver.generation, ver.step, crc, hashlib.sha256(got).hexdigest())
        """, shm_path, python=other[0])
        out = finish(proc)
    np_version, gen, step, crc, digest = out.split()
    print(f"\n[info] reader {other[0]} numpy {np_version}, writer numpy {np.__version__}")
    assert np_version == other[1]
    assert (int(gen), int(step), int(crc), digest) == (1, 11, crc32(data), hashlib.sha256(data).hexdigest())
