"""Structure-aware mutations for the decoder fuzz harness (tests/fuzz/test_fuzz_decoders.py).

Every mutation is drawn with hypothesis' ``data.draw`` from a *valid* input that a real
DeepFreeze writer produced, so the decoders see inputs that pass their first checks: the
callers recompute the CRCs and MACs over the mutated bytes before handing them over.

* :func:`mutate_json`: 1 to 4 edits of a JSON tree: a value swapped for another type, a huge or
  negative int, a deep nest, a key dropped or added, a list emptied or grown.
* :func:`mutate_bytes`: byte flips, a truncation, an insertion, an overwritten little-endian
  integer (sizes and offsets: 0, -1 as unsigned, 2**31, 2**63...).
* :class:`Bounded`: tracemalloc's peak per decoded input, checked against a bound (a decoder
  that trusted a size it read would allocate it).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import struct
import sys
import tracemalloc
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, given, settings, strategies as st

from deepfreeze.errors import DeepFreezeError

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

#: examples per decoder in `make test` (a few seconds each) and in the slow campaign
SHORT = int(os.environ.get("DEEPFREEZE_FUZZ_SHORT", "50"))
LONG = int(os.environ.get("DEEPFREEZE_FUZZ_LONG", "2000"))

#: how many inputs each decoder was fed in this process (the campaign prints it)
TRIED: dict[str, int] = {}


def fuzz_settings(n: int) -> settings:
    """Deterministic (``derandomize``: the same inputs on every run and machine), no example
    database, no deadline (a shared CI machine is slow), health checks that a structure-aware
    strategy trips on purpose turned off."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


def fuzz(body: Callable[..., Any], n: int, *args: Any) -> None:
    """Run ``body(*args, data)`` for ``n`` hypothesis examples (:func:`fuzz_settings`); ``data``
    draws the mutations."""
    def test(data: Any) -> None:
        body(*args, data)
    fuzz_settings(n)(given(data=st.data())(test))()


def corpus(decoder: str) -> list[bytes]:
    """The committed seed inputs of ``decoder`` (tests/fuzz/corpus/<decoder>/*), sorted by name."""
    d = os.path.join(CORPUS, decoder)
    if not os.path.isdir(d):
        return []
    out = []
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            out.append(f.read())
    return out


# (drawn values are deep-copied: a later edit must not change this list, or hypothesis' replays differ)
_HOSTILE_SCALARS = [None, True, False, 0, -1, 1, 2 ** 31, 2 ** 32 - 1, 2 ** 62, 2 ** 63, 2 ** 64, -2 ** 63,
                    10 ** 30, 1.5, -0.0, 1e308, "", "x", "nope", "save", "__builtins__", "../../etc/passwd",
                    "\u0000", "a" * 300, [], {}, [1, 2], {"a": 1}, ["x"], [-1], [2 ** 40, 2 ** 40]]


def _deep(depth: int, leaf: Any = 0) -> Any:
    v = leaf
    for i in range(depth):
        v = [v] if i % 2 else {"d": v}
    return v


def _paths(obj: Any) -> list[tuple]:
    """Paths (tuples of keys/indices) into ``obj``, the root first, at most 16 deep and 5000 in
    all (a deep nest an earlier edit made is not walked); deterministic (JSON objects keep their
    order)."""
    out, stack = [], [((), obj)]
    while stack and len(out) < 5000:
        p, v = stack.pop()
        out.append(p)
        if len(p) < 16 and isinstance(v, dict):
            stack.extend((p + (k,), x) for k, x in reversed(list(v.items())))
        elif len(p) < 16 and isinstance(v, list):
            stack.extend((p + (i,), x) for i, x in reversed(list(enumerate(v))))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def mutate_json(data: Any, obj: Any, label: str = "json") -> Any:
    """A copy of the JSON tree ``obj`` with 1 to 4 edits drawn from ``data`` (hypothesis' data)."""
    with deep_encoding():  # deepcopy of a deep nest an earlier edit made (the campaign hit the default limit)
        return _mutate_json(data, obj, label)


def _mutate_json(data: Any, obj: Any, label: str) -> Any:
    obj = copy.deepcopy(obj)
    for _ in range(data.draw(st.integers(1, 4), label=f"{label} edits")):
        paths = _paths(obj)
        path = paths[data.draw(st.integers(0, len(paths) - 1), label="path")]
        # the most hostile edits first: hypothesis draws the first choices of a list more often
        op = data.draw(st.sampled_from(["deep", "scalar", "int", "drop", "swap", "add", "grow", "str"]),
                       label="op")
        if op == "scalar":
            new = copy.deepcopy(data.draw(st.sampled_from(_HOSTILE_SCALARS)))
        elif op == "int":
            new = data.draw(st.one_of(st.integers(-2 ** 70, 2 ** 70), st.sampled_from([-1, 0, 2 ** 63, 2 ** 64])))
        elif op == "deep":
            new = _deep(data.draw(st.sampled_from([5000, 1500, 200, 101, 64, 33, 31, 5])))
        elif op == "str":
            new = data.draw(st.text(max_size=20))
        else:
            new = None
        if not path:  # the root
            obj = new if op in ("scalar", "int", "deep", "str") else ([obj] if op == "swap" else obj)
            continue
        parent, key = _get(obj, path[:-1]), path[-1]
        if op == "drop":
            del parent[key]
        elif op == "add":
            v = _get(obj, path)
            if isinstance(v, dict):
                v[data.draw(st.sampled_from(["x", "format", "shape", "d", "T", "dt", "mac", ""]))] = \
                    copy.deepcopy(data.draw(st.sampled_from(_HOSTILE_SCALARS)))
            elif isinstance(v, list):
                v.append(copy.deepcopy(data.draw(st.sampled_from(_HOSTILE_SCALARS))))
        elif op == "swap":
            v = parent[key]
            parent[key] = (list(v.values()) if isinstance(v, dict) else {str(i): x for i, x in enumerate(v)}
                           if isinstance(v, list) else [v])
        elif op == "grow":
            v = parent[key]
            if isinstance(v, list) and v:
                parent[key] = copy.deepcopy(v * data.draw(st.sampled_from([0, 2, 50])))  # no shared parts
            elif isinstance(v, str):
                parent[key] = v * 3
        else:
            parent[key] = new
    return obj


@contextlib.contextmanager
def deep_encoding() -> Iterator[None]:
    """A recursion limit that lets json.dumps encode the deep nests the mutations make."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 40000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def dumps(obj: Any) -> bytes:
    """``obj`` as compact JSON bytes (deep nests included)."""
    with deep_encoding():
        return json.dumps(obj, separators=(",", ":")).encode()


_INTS = [0, 1, 0xFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 31, 1 << 40, 1 << 62, (1 << 63) - 1, (1 << 64) - 1]


def mutate_bytes(data: Any, raw: bytes, label: str = "bytes", protect: int = 0) -> bytes:
    """``raw`` with 1 to 3 byte-level edits drawn from ``data``: flips, an overwritten u32/u64,
    a truncation, an insertion. ``protect``: the first bytes left alone (a magic)."""
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3), label=f"{label} edits")):
        if len(b) <= protect:
            break
        op = data.draw(st.sampled_from(["flip", "u32", "u64", "truncate", "insert"]), label="op")
        pos = data.draw(st.integers(protect, len(b) - 1), label="pos")
        if op == "flip":
            b[pos] ^= data.draw(st.integers(1, 255))
        elif op in ("u32", "u64"):
            size = 4 if op == "u32" else 8
            v = data.draw(st.sampled_from(_INTS)) & ((1 << (8 * size)) - 1)
            b[pos:pos + size] = struct.pack("<I" if size == 4 else "<Q", v)[:max(0, len(b) - pos)]
        elif op == "truncate":
            del b[pos:]
        else:
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    return bytes(b)


class Bounded:
    """Runs a decoder under tracemalloc: only :class:`DeepFreezeError` may come out, and the
    Python-visible allocation peak (numpy's buffers included) stays below ``limit(input size)``.

    tracemalloc traces the decoder's call only (started before it, stopped after it), not the
    hypothesis run around it: traced, hypothesis' own draws cost ~100x (test_fuzz_manifest's 50
    examples: 34 CPU-s traced throughout, 0.3 s traced per call). The peak then counts only what
    the call allocated (a free of an older object lowers nothing): never below the peak over the
    call measured from a trace running before it."""

    def __init__(self, name: str, limit: Callable[[int], int] = lambda n: (64 << 20) + 64 * n) -> None:
        self.name, self.limit = name, limit
        self.errors: dict[str, int] = {}

    def __enter__(self) -> "Bounded":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def __call__(self, fn: Callable[[], Any], size: int) -> Any:
        TRIED[self.name] = TRIED.get(self.name, 0) + 1
        ours = not tracemalloc.is_tracing()  # (a trace of the caller's own: measured as before, left running)
        if ours:
            tracemalloc.start()
        else:
            tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            try:
                out = fn()
            except DeepFreezeError as e:  # the only exception a decoder may raise on bad input
                self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1
                out = e
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if ours:
                tracemalloc.stop()
        assert peak <= self.limit(size), f"{self.name}: {peak} bytes allocated for a {size}-byte input"
        return out
