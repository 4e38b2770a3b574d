"""deepfreeze.fused: the fused capture buffer's layout, views and pool (framework-neutral)."""
import os

import numpy as np
import pytest

from deepfreeze import format as fmt
from deepfreeze.fused import STAMP_BYTES, BufferPool, FusedLayout, FusedShard
from deepfreeze.shardplan import ShardPlan, TensorSpec

TENSORS = [TensorSpec(0, "w", "float32", (1000, 300)), TensorSpec(1, "b", "float16", (7,)),
           TensorSpec(2, "i", "int64", (70001,)), TensorSpec(3, "m", "bool", (33,)), TensorSpec(4, "e", "float32", (0,))]


def arrays_for(plan, rank, seed=0):
    r = np.random.default_rng(seed)
    out = []
    for p in plan.for_rank(rank):
        t = plan.tensors[p.tensor_id]
        out.append((r.random(p.count) * 100).astype(fmt.numpy_dtype(t.dtype)))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_layout_is_the_shard_files_data_region(world):
    plan = ShardPlan.build(TENSORS, world, min_shard_bytes=0)
    for rank in range(world):
        layout = FusedLayout.build(plan, rank)
        assert layout.nbytes == STAMP_BYTES + layout.file_size - layout.data_offset
        for s, e in zip(layout.segments, layout.entries):
            assert s.offset - STAMP_BYTES == e.offset - layout.data_offset and s.nbytes == e.length
            assert s.offset % fmt.PIECE_ALIGN == 0
        gaps = layout.gaps()
        assert all(0 <= n < fmt.PIECE_ALIGN for _, n in gaps)  # padding only
        covered = sum(s.nbytes for s in layout.segments) + sum(n for _, n in gaps)
        assert covered == layout.nbytes - STAMP_BYTES


def test_from_arrays_round_trip_and_stamp():
    plan = ShardPlan.build(TENSORS, 2, min_shard_bytes=0)
    layout = FusedLayout.build(plan, 1)
    arrays = arrays_for(plan, 1)
    shard = FusedShard.from_arrays(layout, arrays, step=42)
    assert shard.step == 42
    assert [a.tobytes() for a in shard.pieces()] == [a.tobytes() for a in arrays]
    assert shard.data.size == layout.file_size - layout.data_offset
    with pytest.raises(ValueError, match="holds"):
        FusedShard.from_arrays(layout, arrays[:-1], step=1)
    with pytest.raises(ValueError, match="needs"):
        FusedShard.from_arrays(layout, [a.astype(np.float64) for a in arrays], step=1)
    with pytest.raises(ValueError, match="must be"):
        FusedShard(layout, np.zeros(layout.nbytes - 1, np.uint8))


def test_pool_hands_out_only_buffers_nothing_refers_to():
    pool = BufferPool(3 * 4096 + 100, 2)
    a = pool.acquire()
    assert BufferPool.address(a) % 4096 == 0 and not a.any()
    view = a[5000:5010]  # a consumer's view keeps the buffer held
    del a
    b = pool.acquire()
    assert BufferPool.address(b) != BufferPool.address(view.base if view.base is not None else view)
    assert pool.held() == 2
    del view
    assert pool.held() == 1
    c = pool.acquire()  # the first one is free again
    assert c is pool.buffers[0] and pool.grown == 0
    d = pool.acquire()  # both held: one more is allocated
    assert pool.grown == 1 and len(pool.buffers) == 3 and d is pool.buffers[2]
    with pytest.raises(ValueError):
        BufferPool(10, 1)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_pool_not_prefaulted_takes_memory_only_where_a_copy_writes():
    """Issue 45, item 3: the torch capture's pool (built inside the first checkpoint's step) maps its
    buffers without touching them; a buffer's pages are faulted by the copy into it, and its padding
    stays zero. The pre-faulted pool (Keras's native capture) takes all of it at once."""
    n = 64 << 20
    r0 = _rss()
    lazy = BufferPool(n, 3, prefault=False)
    r1 = _rss()
    assert r1 - r0 < 8 << 20, (r1 - r0)   # three 64 MiB buffers mapped, none of it resident
    a, b = lazy.acquire(), lazy.acquire()
    assert len({BufferPool.address(x) for x in (a, b)}) == 2 and all(BufferPool.address(x) % 4096 == 0 for x in (a, b))
    a[: n // 2] = 7   # a copy writes half of one buffer: that half is faulted in, the rest stays zero
    r2 = _rss()
    assert (n // 2) - (4 << 20) <= r2 - r1 <= (n // 2) + (8 << 20), (r2 - r1)
    assert not a[n // 2:].any() and not b.any() and lazy.grown == 0
    del a, b
    eager = BufferPool(n, 2)
    assert _rss() - r2 >= 2 * n - (8 << 20)   # faulted in when built
    assert not eager.acquire().any()

def test_a_pool_populated_in_the_background_faults_its_buffers_in_without_changing_a_byte():
    """Issue 45, item 3: the torch capture's pool faults its buffers in ahead of use from a thread at
    the background priority (MADV_POPULATE_WRITE), while a copy may already write into one of them:
    that copy's bytes survive, the other buffers stay zero, and the thread holds no buffer."""
    n = 64 << 20
    r0 = _rss()
    pool = BufferPool(n, 3, prefault=False, populate=True)
    a = pool.acquire()   # the first capture's copy, at the same time as the thread
    want = np.arange(n // 8, dtype=np.int64)
    a.view(np.int64)[:] = want
    assert pool.populating is not None
    pool.populating.join()
    assert _rss() - r0 >= 3 * n - (8 << 20)   # every page faulted in
    assert np.array_equal(a.view(np.int64), want)
    b, c = pool.acquire(), pool.acquire()
    assert pool.grown == 0 and not b.any() and not c.any()
