"""The fused-copy op (deepfreeze/keras/_ops/fused_copy.cc, deepfreeze/keras/native.py).

Real op, real buffers: the library is built (or found up to date) by ``native.build()``,
loaded with ``tf.load_op_library``, and writes into page-aligned numpy buffers over
anonymous ``mmap`` memory; every check compares bytes with numpy slicing of the
variables' own bytes. Skipped, with the reason, only where the op cannot be built.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from deepfreeze.errors import NativeBuildError  # noqa: E402
from deepfreeze.keras import native  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTINEL = 0xA5


@pytest.fixture(scope="module")
def op():
    try:
        native.build()
    except NativeBuildError as e:
        pytest.skip(f"the fused-copy op cannot be built here: {e}")
    mod = native.load()
    if mod is None:
        pytest.skip(native.unavailable_reason())
    return mod


def _buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """A page-aligned, pre-faulted buffer filled with SENTINEL (keep the mmap alive with it)."""
    mm = mmap.mmap(-1, nbytes)
    buf = np.frombuffer(mm, dtype=np.uint8)
    assert buf.ctypes.data % mmap.PAGESIZE == 0
    buf[:] = SENTINEL
    return mm, buf


def _bytes(v) -> np.ndarray:
    return np.frombuffer(v.numpy().tobytes(), dtype=np.uint8)


def _expected(nbytes: int, step: int, variables, src, dst, lengths) -> np.ndarray:
    out = np.full(nbytes, SENTINEL, dtype=np.uint8)
    out[:8] = np.frombuffer(np.array(step, dtype="<i8").tobytes(), dtype=np.uint8)
    for v, s, d, n in zip(variables, src, dst, lengths):
        out[d:d + n] = _bytes(v)[s:s + n]
    return out


def _mixed_variables(rng: np.random.Generator) -> list:
    return [
        tf.Variable(rng.standard_normal(1000).astype(np.float32)),
        tf.Variable(rng.standard_normal(333).astype(np.float16)),
        tf.Variable(tf.cast(rng.standard_normal(257).astype(np.float32), tf.bfloat16)),
        tf.Variable(rng.integers(-2**62, 2**62, 100, dtype=np.int64)),
        tf.Variable(rng.integers(0, 2, 77).astype(bool)),
        tf.Variable(rng.integers(-128, 128, 129, dtype=np.int8)),
        tf.Variable(rng.standard_normal((17, 23)).astype(np.float32)),  # a piece of a 2-D variable
        tf.Variable(rng.standard_normal(10).astype(np.float32)),  # 0-length piece
    ]


# (src_offset, dst_offset, length) per variable above, in bytes; destinations not in order
MIXED = [(400, 64, 2400), (2, 2496, 660), (0, 3200, 514), (80, 3776, 720),
         (5, 4544, 72), (1, 4672, 127), (17 * 4 * 3, 4800, 23 * 4 * 5 + 4), (40, 5400, 0)]
MIXED_BYTES = 6000


def _mixed_setup(seed: int) -> tuple:
    """The MIXED variables, their (src, dst, length) lists, a sentinel buffer and its [address, capacity]."""
    vs = _mixed_variables(np.random.default_rng(seed))
    src, dst, lengths = (list(x) for x in zip(*MIXED))
    mm, buf = _buffer(MIXED_BYTES)
    return vs, src, dst, lengths, mm, buf, np.array(native.buffer_address(buf), dtype=np.int64)


def test_mixed_dtypes_bit_exact_in_tf_function(op):
    vs, src, dst, lengths, mm, buf, dest = _mixed_setup(1)

    @tf.function
    def capture(step):
        return native.fused_copy(dest, step, vs, src, dst, lengths)

    assert int(capture(tf.constant(41, tf.int64))) == 41
    np.testing.assert_array_equal(buf, _expected(MIXED_BYTES, 41, vs, src, dst, lengths))
    # the same traced function copies the values of its run, not those of the first one
    for v in vs:
        v.assign(tf.cast(tf.reverse(tf.reshape(v, [-1]), [0]), v.dtype) if v.shape.rank == 1 else v * 2)
    assert int(capture(tf.constant(-3, tf.int64))) == -3
    np.testing.assert_array_equal(buf, _expected(MIXED_BYTES, -3, vs, src, dst, lengths))
    del buf
    mm.close()


def test_copies_after_an_update_it_depends_on(op):
    """The hook's use: assign (the optimizer's update), then the copy under a control dependency."""
    rng = np.random.default_rng(2)
    v = tf.Variable(rng.standard_normal((64, 33)).astype(np.float32))
    w = tf.Variable(rng.integers(0, 1000, 50, dtype=np.int64))
    mm, buf = _buffer(mmap.PAGESIZE * 4)
    dest = np.array(native.buffer_address(buf), dtype=np.int64)
    new_v = rng.standard_normal((64, 33)).astype(np.float32)

    @tf.function
    def step(x, step):
        a = v.assign(x)
        b = w.assign_add(tf.ones_like(w))
        with tf.control_dependencies([a, b]):
            return native.fused_copy(dest, step, [v, w], [128, 0], [64, 8192], [4000, 400])

    before_w = w.numpy().copy()
    assert int(step(tf.constant(new_v), tf.constant(7, tf.int64))) == 7
    assert np.array_equal(np.frombuffer(buf[64:4064].tobytes(), np.float32), new_v.reshape(-1)[32:1032])
    assert np.array_equal(np.frombuffer(buf[8192:8592].tobytes(), np.int64), before_w + 1)
    del buf
    mm.close()


def test_vars_variant_reads_the_variables_itself_bit_exact_after_updates(op):
    """DeepFreezeFusedCopyVars (one node for N variables): the same bytes as the values variant,
    the variables' values after the updates it depends on, and its validation errors."""
    vs, src, dst, lengths, mm, buf, dest = _mixed_setup(3)

    @tf.function
    def capture(step):
        ups = [v.assign(tf.cast(tf.reverse(tf.reshape(v, [-1]), [0]), v.dtype)) if v.shape.rank == 1
               else v.assign(v * 2) for v in vs]
        with tf.control_dependencies(ups):
            return native.fused_copy_vars(dest, step, vs, src, dst, lengths)

    assert int(capture(tf.constant(9, tf.int64))) == 9
    np.testing.assert_array_equal(buf, _expected(MIXED_BYTES, 9, vs, src, dst, lengths))
    buf[:] = SENTINEL
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
        native.fused_copy_vars(dest, 1, vs[:1], [4000], [64], [8])
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside dest"):
        native.fused_copy_vars(dest, 1, vs[:1], [0], [MIXED_BYTES - 4], [8])
    assert (buf == SENTINEL).all()  # nothing written by a bad call
    del buf
    mm.close()


def test_in_a_cond_branch_copies_only_when_taken(op):
    """The hook's flag: the op in a ``tf.cond`` branch runs (and writes) only when the flag is on."""
    v = tf.Variable(np.arange(100, dtype=np.int64))
    flag = tf.Variable(False)
    mm, buf = _buffer(mmap.PAGESIZE)

    @tf.function
    def train_step(step):
        v.assign_add(tf.ones_like(v))
        return tf.cond(flag, lambda: native.fused_copy(buf, step, [v], [80], [64], [160]),
                       lambda: tf.constant(-1, tf.int64))

    assert int(train_step(tf.constant(1, tf.int64))) == -1
    assert (buf == SENTINEL).all()
    flag.assign(True)
    assert int(train_step(tf.constant(2, tf.int64))) == 2
    np.testing.assert_array_equal(buf, _expected(mmap.PAGESIZE, 2, [v], [80], [64], [160]))
    assert np.array_equal(np.frombuffer(buf[64:224].tobytes(), np.int64), np.arange(10, 30) + 2)
    # not `del buf`: the traced function reads ``buf`` from this scope's closure cell (it was resolved
    # when it was traced, above); emptying the cell drops that reference too, so the mmap can close
    buf = None
    mm.close()


@pytest.mark.parametrize("threads,stream", [("", ""), ("0", "1"), ("0", "0"), ("1", "0")],
                         ids=["default", "parallel-streaming", "parallel-memcpy", "serial-memcpy"])
def test_large_copy_bit_exact(op, monkeypatch, threads, stream):
    """64 MiB plus pieces at odd offsets: the kernel's streaming stores (unaligned heads and tails),
    its glibc memcpy path and its chunked parallel path (the environment is read when the kernel
    is built, i.e. on a new tf.function's first run)."""
    monkeypatch.setenv("DEEPFREEZE_FUSED_COPY_THREADS", threads)
    monkeypatch.setenv("DEEPFREEZE_FUSED_COPY_NT", stream)
    rng = np.random.default_rng(3)
    big = tf.Variable(rng.integers(0, 2**31, 16 << 20, dtype=np.int32))  # 64 MiB
    small = tf.Variable(rng.standard_normal(1000).astype(np.float32))
    values = [big, big, small, big, big]
    src = [0, 3, 0, 1, 5 << 20]
    lengths = [64 << 20, (3 << 20) + 1, 4000, 100_005, (17 << 20) + 3]  # 17 MiB: above the streaming range
    dst, pos = [], 8
    for n in lengths:  # in order, with odd gaps between the pieces
        dst.append(pos)
        pos += n + 13
    total = pos + 100
    mm, buf = _buffer(total)

    @tf.function
    def capture():  # the buffer itself as dest
        return native.fused_copy(buf, tf.constant(2**40, tf.int64), values, src, dst, lengths)

    assert int(capture()) == 2**40
    np.testing.assert_array_equal(buf, _expected(total, 2**40, values, src, dst, lengths))
    # not `del buf`: the traced function reads ``buf`` from this scope's closure cell (it was resolved
    # when it was traced, above); emptying the cell drops that reference too, so the mmap can close
    buf = None
    mm.close()


def _bad_calls(v, addr, cap):
    """(description, kwargs of the raw op, substring of the message) for every validation error."""
    good = dict(dest=[addr, cap], step=5, values=[v, v], src_offsets=[0, 4], dst_offsets=[64, 128],
                lengths=[8, 8])
    big = 2**63 - 8

    def bad(**kw):
        return {**good, **kw}
    return [
        ("list lengths differ", bad(lengths=[8]), "one entry per value"),
        ("null address", bad(dest=[0, cap]), "null"),
        ("capacity below the stamp", bad(dest=[addr, 7]), "below the 8-byte step stamp"),
        ("negative capacity", bad(dest=[addr, -1]), "below the 8-byte step stamp"),
        ("negative src_offset", bad(src_offsets=[0, -1]), "must be >= 0"),
        ("negative length", bad(lengths=[8, -8]), "must be >= 0"),
        ("piece beyond the value", bad(src_offsets=[0, 36]), "value 1 (float[10], 40 bytes): piece [36, 36 + 8)"),
        ("src_offset + length overflows", bad(src_offsets=[0, big], lengths=[8, 16]), "outside the value"),
        ("dst_offset inside the stamp", bad(dst_offsets=[64, 4]), "must be >= 8"),
        ("piece beyond dest", bad(dst_offsets=[64, cap - 7]), f"outside dest's {cap} bytes"),
        ("dst_offset + length overflows", bad(dst_offsets=[64, big], lengths=[8, 16]), "outside dest"),
        ("dest not [address, capacity]", bad(dest=[addr, cap, 0]), "(shape [2]), got shape [3]"),
        ("step not a scalar", bad(step=[5]), "scalar"),
        ("string value", bad(values=[v, tf.constant(["abc"])]), "dtype string"),
        ("resource value", bad(values=[v, v.handle]), "dtype resource"),
        ("variant value", bad(values=[v, tf.raw_ops.EmptyTensorList(
            element_shape=tf.constant([], tf.int32), max_num_elements=1, element_dtype=tf.float32)]),
         "dtype variant"),
    ]


def test_every_validation_error_raises_and_writes_nothing(op):
    v = tf.Variable(np.arange(10, dtype=np.float32))
    mm, buf = _buffer(mmap.PAGESIZE)
    addr, cap = native.buffer_address(buf)
    for what, kwargs, message in _bad_calls(v, addr, cap):
        with pytest.raises(tf.errors.InvalidArgumentError, match=None) as info:
            op.deep_freeze_fused_copy(**kwargs)
        assert message in info.value.message, (what, info.value.message)
        assert (buf == SENTINEL).all(), f"{what}: bytes were written"
    # the good call writes (so the sentinel checks above could fail)
    _, good, _ = _bad_calls(v, addr, cap)[0]
    good["lengths"] = [8, 8]
    assert int(op.deep_freeze_fused_copy(**good)) == 5
    assert not (buf == SENTINEL).all()
    del buf
    mm.close()


def test_runtime_error_inside_tf_function_writes_nothing(op):
    """Capacity known only when the function runs: the kernel's check, not the shape function's."""
    v = tf.Variable(np.arange(10, dtype=np.float32))
    mm, buf = _buffer(mmap.PAGESIZE)
    addr, _ = native.buffer_address(buf)

    @tf.function
    def capture(dest):
        return native.fused_copy(dest, 1, [v, v], [0, 0], [8, 100], [40, 40])

    with pytest.raises(TypeError, match="got a float32 array of shape"):
        native.fused_copy(np.zeros(2, np.float32), 1, [v], [0], [8], [4])

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"value 1: destination \[100, 100 \+ 40\) "
                                                            r"is outside dest's 120 bytes"):
        capture(tf.constant([addr, 120], tf.int64))
    assert (buf == SENTINEL).all()
    assert int(capture(tf.constant([addr, 140], tf.int64))) == 1
    assert np.array_equal(np.frombuffer(buf[100:140].tobytes(), np.float32), np.arange(10, dtype=np.float32))
    del buf
    mm.close()


def test_fused_copy_rejects_a_read_only_or_strided_numpy_dest(op):
    v = tf.Variable(np.arange(10, dtype=np.float32))
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writable, C-contiguous"):
        native.fused_copy(ro, 0, [v], [0], [8], [4])
    with pytest.raises(ValueError, match="writable, C-contiguous"):
        native.fused_copy(np.zeros(128, np.uint8)[::2], 0, [v], [0], [8], [4])


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=e, cwd=ROOT)


def test_load_without_the_library_returns_none_with_a_reason(tmp_path):
    missing, garbage = tmp_path / "missing.so", tmp_path / "garbage.so"
    garbage.write_bytes(b"not an ELF file" * 10)
    code = ("import deepfreeze.keras.native as n, sys\n"
            "n.LIBRARY = {lib!r}\n"
            "assert n.load() is None and n.load() is None\n"
            "print(n.unavailable_reason())\n"
            "try:\n    n.fused_copy([1, 64], 0, [], [], [], [])\n"
            "except n.NativeBuildError as e:\n    print('raised', e)\n")
    p = _run(code.format(lib=str(missing)))
    assert p.returncode == 0, p.stderr
    assert f"{missing} is missing (run `python -m deepfreeze.keras.native build`)" in p.stdout
    assert "raised fused-copy op unavailable: FileNotFoundError" in p.stdout
    p = _run(code.format(lib=str(garbage)))
    assert p.returncode == 0, p.stderr
    assert "fused-copy op unavailable" in p.stdout and str(garbage) in p.stdout


def test_build_is_idempotent_and_a_failed_build_keeps_the_library(op):
    before = os.stat(native.LIBRARY).st_mtime_ns
    assert native.build() == native.LIBRARY
    assert os.stat(native.LIBRARY).st_mtime_ns == before  # up to date: not rebuilt
    p = subprocess.run([sys.executable, "-m", "deepfreeze.keras.native", "build", "--force"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "CXX": "/nonexistent/g++"})
    assert p.returncode == 1 and "no C++ compiler found" in p.stderr, p.stdout + p.stderr
    assert os.stat(native.LIBRARY).st_mtime_ns == before
    assert not [f for f in os.listdir(os.path.dirname(native.LIBRARY)) if f.startswith("._fused_copy.")]
    p = subprocess.run([sys.executable, "-m", "deepfreeze.keras.native", "bulid"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2 and "usage:" in p.stderr


def test_a_compiler_error_raises_with_its_output_and_installs_nothing(tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text('#error deliberately broken source\n')
    code = ("import os, sys, deepfreeze.keras.native as n\n"
            "d = sys.argv[1]\n"
            "n._OPS_DIR, n.SOURCE = d, os.path.join(d, 'bad.cc')\n"
            "n.LIBRARY = os.path.join(d, 'lib.so'); n._BUILD_INFO = n.LIBRARY + '.json'\n"
            "try:\n    n.build()\n"
            "except n.NativeBuildError as e:\n    print('raised', e)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=240,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert p.returncode == 0, p.stderr
    assert "raised compiling the fused-copy op failed" in p.stdout and "deliberately broken source" in p.stdout
    assert sorted(os.listdir(tmp_path)) == ["bad.cc"]  # no library, no temporary left behind
