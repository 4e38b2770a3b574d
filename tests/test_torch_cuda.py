"""The CUDA capture of deepfreeze.torch (deepfreeze/torch/_cuda.py).

Without CUDA: the CPU path is unchanged (plain pool, no side stream, versions bit-exact) and
models on devices DeepFreeze cannot capture, or a CUDA capture without CUDA, are refused with a
clear error. With CUDA (skipped otherwise, with the reason): versions captured by side-stream
copies into pinned buffers equal the state recorded right after each checkpoint step, also when
the next step follows at once, and an in-place change during the copy makes the version torn.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (scripts/setup.sh installs torch==2.13.0, CPU)")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch.cuda.is_available() is False: no CUDA device (or a CPU build of torch)")


def _train(device: str, tmp_path, steps: int = 6, every: int = 2, mutate_at: int = -1, big: int = 0, **kw):
    """A small model (plus one ``big``-element parameter) with Adam, stepped back to back; the
    state right after each checkpoint step is recorded (copied to the CPU before the next step)."""
    from deepfreeze.torch import Checkpointer
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2)).to(device)
    if big:
        net.register_parameter("big", torch.nn.Parameter(torch.randn(big, device=device)))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    ck = Checkpointer(net, opt, name="cu", every_n_steps=every, mode="sync", scratch=str(tmp_path / "s"),
                      persistent=str(tmp_path / "p"), **kw)
    recorded = {}
    g = torch.Generator().manual_seed(1)
    for it in range(steps):
        if it == mutate_at:
            with torch.no_grad():
                net[0].weight.mul_(1.0)  # in place while the capture copies: the version is torn
        x = torch.randn(32, 8, generator=g).to(device)
        loss = net(x).square().mean() + (net.big.square().mean() if big else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ck.step % every == 0:
            sd = net.state_dict()
            rec = {k: v.detach().cpu().clone() for k, v in sd.items()}
            for p, fqn in zip(net.parameters(), [n for n, _ in net.named_parameters()]):
                for k, v in opt.state[p].items():
                    rec[f"optim.state.{fqn}.{k}"] = v.detach().cpu().clone()
            recorded[ck.step] = rec
    ck.pinned = [torch.from_numpy(b).is_pinned() for b in ck.capture.pool.buffers] if device == "cuda" else []
    ck.close()
    return ck, recorded


def _check(ck, recorded, tmp_path, versions):
    import deepfreeze.torch as dft
    for v in versions:
        got = dft.load(name="cu", version=v, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
        want = recorded[v]
        assert set(got) == set(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert got[k].numpy().tobytes() == want[k].numpy().tobytes(), f"v{v} {k} differs"


def test_cpu_path_unchanged(tmp_path):
    from deepfreeze.fused import BufferPool
    ck, rec = _train("cpu", tmp_path)
    assert ck.capture.cuda is None and type(ck.capture.pool) is BufferPool
    _check(ck, rec, tmp_path, [2, 4, 6])


def test_uncapturable_devices_are_refused(tmp_path):
    from deepfreeze.errors import ConfigError
    from deepfreeze.torch import Checkpointer, _cuda
    net = torch.nn.Linear(4, 2, device="meta")
    with pytest.raises(ConfigError, match="device meta: DeepFreeze captures CPU and CUDA tensors"):
        Checkpointer(net, torch.optim.SGD(net.parameters(), lr=0.1), name="m", mode="sync",
                     scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())  # refused before the run began
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="is_available"):
            _cuda.CudaCapture(torch.device("cuda", 0))
        with pytest.raises(ConfigError, match="is_available"):
            _cuda.PinnedBufferPool(4096, 1)


def test_pinned_pool_unregisters_only_free_buffers():
    """The lifetime rule of PinnedBufferPool, with registration recorded by a subclass (no CUDA
    needed): a released pool unregisters at once the buffers nothing holds; a buffer still held
    stays registered until a later release finds it free; each is unregistered exactly once; a
    pool whose construction fails unregisters what it registered."""
    from deepfreeze.fused import BufferPool
    from deepfreeze.torch._cuda import PinnedBufferPool

    class Recorded(PinnedBufferPool):
        _linger: list = []
        pinned: set = set()
        fail_at = -1

        def _pin(self, buf):
            if len(self.pinned) == self.fail_at:
                raise MemoryError("injected: no lockable memory")
            self.pinned.add(BufferPool.address(buf))

        def _unpin(self, buf):
            self.pinned.remove(BufferPool.address(buf))  # KeyError: unregistered twice

    pool = Recorded(8192, 2)
    assert len(Recorded.pinned) == 2
    held = pool.acquire()[:16]  # a view keeps its buffer held (as a FusedShard in the write queue)
    addr = BufferPool.address(held)
    pool.release()
    assert Recorded.pinned == {addr} and len(Recorded._linger) == 1
    grown = Recorded(8192, 1)
    one, two = grown.acquire(), grown.acquire()  # all held: one more allocated, registered too
    assert grown.grown == 1 and len(Recorded.pinned) == 3
    del held, one, two
    grown.release()
    assert Recorded.pinned == set() and Recorded._linger == []
    Recorded.fail_at = 1
    with pytest.raises(MemoryError, match="injected"):
        Recorded(8192, 3)
    assert Recorded.pinned == set()


@needs_cuda
def test_cuda_versions_bit_exact(tmp_path):
    """Side-stream copies into pinned buffers; a 64 MiB parameter keeps the copy in flight while the
    next step follows at once: its pre-hook must make the stream (and host) wait."""
    from deepfreeze.torch._cuda import PinnedBufferPool
    ck, rec = _train("cuda", tmp_path, steps=6, big=16 << 20)
    assert isinstance(ck.capture.pool, PinnedBufferPool) and ck.capture.cuda is not None
    assert ck.pinned and all(ck.pinned)  # the pool's own numpy buffers are page-locked
    import deepfreeze.torch as dft
    st = dft.load_state(name="cu", version=6, mode="sync", scratch=str(tmp_path / "s"), persistent=str(tmp_path / "p"))
    assert len(st.records[0]["a"]["rng"]["cuda"]) == torch.cuda.device_count()  # the CUDA RNG states too
    _check(ck, rec, tmp_path, [2, 4, 6])


@needs_cuda
def test_cuda_without_overlap_bit_exact(tmp_path):
    ck, rec = _train("cuda", tmp_path, steps=4, overlap=False)
    _check(ck, rec, tmp_path, [2, 4])


@needs_cuda
def test_cuda_in_place_change_is_torn(tmp_path):
    ck, rec = _train("cuda", tmp_path, steps=6, mutate_at=4, on_error="warn")
    assert ck.torn == [4] and "changed in place" in ck.failures[0]
    _check(ck, rec, tmp_path, [2, 6])
