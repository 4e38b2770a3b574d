"""The CUDA capture of :class:`deepfreeze.torch.Checkpointer`: device-to-host copies on a side
stream into page-locked pool buffers.

Protocol of one checkpoint step on a rank whose tensors live on one CUDA device (CPU tensors of
the same rank keep the CPU path of :mod:`deepfreeze.torch.checkpointer`):

1. **Post-hook of the checkpoint step** (training thread, :meth:`CudaCapture.start`): the side
   stream waits for the device's current stream (the optimizer's kernels, queued there, finish
   before any copy reads a tensor). On the side stream every CUDA piece is copied with
   ``non_blocking=True`` into its slice of the pinned buffer (a DMA by the copy engine) and each
   source tensor is marked used by the side stream (``record_stream``: the caching allocator does
   not hand its memory to another tensor before the copy has read it). What the CPU path copies
   synchronously (module buffers, which the next forward changes; everything with
   ``overlap=False``) is queued first and the host waits for its event before the hook returns;
   the rest is queued after it and an event ``done`` is recorded; the hook does not wait for it.
2. The next forward and backward run on the current stream while the copies run (they read the
   parameters and write activations and gradients, none of the captured tensors; a tensor changed
   in place meanwhile is caught by its ``_version``, exactly as on CPU: the version is *torn*).
3. **Next** ``optimizer.step()`` **pre-hook** (or ``wait``/``close``/``checkpoint``), before the
   optimizer queues a kernel (:meth:`InFlight.wait`): the current stream waits on ``done`` (no
   kernel queued from then on can write a tensor before its copy has read it) and the host
   synchronizes on ``done`` (the buffer is complete before the engine reads it). Then the
   ``_version`` check, the state record and the hand-off to the engine follow as on CPU.

Pinned buffers (:class:`PinnedBufferPool`): the pool's own buffers (anonymous ``mmap``: exact
size, page-aligned, pre-faulted) registered with ``cudaHostRegister`` (portable flag) through
``torch.cuda.cudart()``, so the numpy buffer the engine writes *is* the page-locked memory
(``torch.empty(pin_memory=True)`` would round every buffer up to a power of two). A buffer is
unregistered before its mapping can go away: :meth:`PinnedBufferPool.release` unregisters the
buffers nothing else holds and keeps the others (in a class-level list, which keeps their
mapping alive) until a later release finds them free.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable

import numpy as np
import torch

from ..errors import ConfigError
from ..fused import BufferPool

__all__ = ["CudaCapture", "InFlight", "PinnedBufferPool", "capture_for", "check_devices"]

_NO_CUDA = ("torch.cuda.is_available() is False (a CPU build of torch, or no usable GPU): move the model to the "
            "CPU, or run where CUDA works")


def check_devices(tensors: Iterable[torch.Tensor], what: str = "model") -> "torch.device | None":
    """The one CUDA device of ``tensors`` (None: all on the CPU); ConfigError for another device
    type (``meta``, ``mps`` ...), several CUDA devices, or CUDA tensors without a usable CUDA."""
    cuda: set[torch.device] = set()
    for t in tensors:
        d = t.device
        if d.type == "cuda":
            cuda.add(torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device()))
        elif d.type != "cpu":
            raise ConfigError(f"{what} has tensors on device {d}: DeepFreeze captures CPU and CUDA tensors "
                              "(materialize and move the model to 'cpu' or 'cuda' before building the Checkpointer)")
    if not cuda:
        return None
    if len(cuda) > 1:
        raise ConfigError(f"{what} has tensors on {len(cuda)} CUDA devices ({', '.join(sorted(map(str, cuda)))}): "
                          "DeepFreeze captures one CUDA device per rank")
    if not torch.cuda.is_available():
        raise ConfigError(f"{what} has CUDA tensors but {_NO_CUDA}")
    return next(iter(cuda))


def capture_for(tensors: Iterable[torch.Tensor], current: "CudaCapture | None" = None) -> "CudaCapture | None":
    """The CUDA capture for ``tensors`` (``current`` when it serves the same device), or None
    when every tensor is on the CPU."""
    dev = check_devices(tensors, "the training state")
    if dev is None:
        return None
    if current is not None and current.device == dev:
        return current
    return CudaCapture(dev)


class InFlight:
    """The copies of one capture still running on the side stream."""

    __slots__ = ("event", "device")

    def __init__(self, event: "torch.cuda.Event", device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        """The current stream waits on the copies (no kernel queued after this runs before them),
        then the host does (the buffer is complete)."""
        torch.cuda.current_stream(self.device).wait_event(self.event)
        self.event.synchronize()


class CudaCapture:
    """Device-to-host copies of CUDA pieces on a side stream of ``device`` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(f"a CUDA capture on {device}: {_NO_CUDA}")
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def pool(nbytes: int, count: int) -> "PinnedBufferPool":
        return PinnedBufferPool(nbytes, count)

    def start(self, sync: list, background: list, buf: np.ndarray) -> tuple[list, list, "InFlight | None"]:
        """Queue the CUDA items of ``sync`` and ``background`` (``(tensor, segment)`` pairs) on the
        side stream into ``buf`` (a pinned pool buffer); wait for the ``sync`` ones. Returns the CPU
        items of each list (for the CPU path) and the copies in flight (None: nothing queued)."""
        gsync = [it for it in sync if it[0].device.type == "cuda"]
        gback = [it for it in background if it[0].device.type == "cuda"]
        if not gsync and not gback:
            return sync, background, None
        dest = torch.from_numpy(buf)  # the pool's page-locked memory: the copies are asynchronous DMAs
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the optimizer's kernels first
        inflight = None
        with torch.cuda.stream(self.stream):
            for t, seg in gsync:
                self._enqueue(t, seg, dest)
            if gsync:
                first = torch.cuda.Event()
                first.record(self.stream)
            for t, seg in gback:
                self._enqueue(t, seg, dest)
            if gback:
                done = torch.cuda.Event()
                done.record(self.stream)
                inflight = InFlight(done, self.device)
        if gsync:
            first.synchronize()  # as on the CPU: taken when the hook returns
        return ([it for it in sync if it[0].device.type != "cuda"],
                [it for it in background if it[0].device.type != "cuda"], inflight)

    def _enqueue(self, t: torch.Tensor, seg: Any, dest: torch.Tensor) -> None:
        piece = seg.piece
        src = t.detach()
        src.record_stream(self.stream)  # its memory is not reused before the side stream has read it
        src = src.reshape(-1)[piece.start:piece.stop]  # (a copy only for a non-contiguous tensor: on this stream)
        if src.dtype != torch.uint8:
            src = src.contiguous().view(torch.uint8)
        out = dest[seg.offset:seg.offset + seg.nbytes]
        if out.numel() != src.numel():
            raise ConfigError(f"a CUDA piece of {src.numel()} bytes does not fit its {out.numel()}-byte segment")
        out.copy_(src, non_blocking=True)


# -- page-locked pool buffers

class PinnedBufferPool(BufferPool):
    """A :class:`~deepfreeze.fused.BufferPool` whose buffers are page-locked (``cudaHostRegister``
    of the pool's own mappings, portable flag). Call :meth:`release` when the pool is replaced or
    closed. Registration is :meth:`_pin`/:meth:`_unpin` (a subclass may record it instead)."""

    #: buffers of released pools still held (by the write queue): unregistered once nothing holds them
    _linger: list[np.ndarray] = []
    _lock = threading.Lock()

    def __init__(self, nbytes: int, count: int) -> None:
        self._made: "list[np.ndarray] | None" = []  # pinned while the pool is built (undone if that fails)
        try:
            super().__init__(nbytes, count)
        except BaseException:
            for buf in self._made:
                self._unpin(buf)
            raise
        finally:
            self._made = None  # (a list would keep every buffer held: never free again)

    def _pin(self, buf: np.ndarray) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(f"pinned capture buffers: {_NO_CUDA}")
        err = int(torch.cuda.cudart().cudaHostRegister(BufferPool.address(buf), buf.nbytes, 1))  # 1: portable
        if err != 0:
            raise ConfigError(f"cudaHostRegister of a {buf.nbytes}-byte capture buffer failed (cudaError {err}): "
                              "not enough lockable memory (ulimit -l, or the GPU driver's limit)")

    def _unpin(self, buf: np.ndarray) -> None:
        torch.cuda.cudart().cudaHostUnregister(BufferPool.address(buf))

    def _allocate(self) -> np.ndarray:
        buf = super()._allocate()  # (kept mapped by ``buf`` itself: unpinned before it can be unmapped)
        self._pin(buf)
        if self._made is not None:
            self._made.append(buf)
        return buf

    def release(self) -> None:
        """Unregister every buffer of this pool (and of pools released before) that nothing holds;
        the others stay registered (and mapped) until a later release finds them free."""
        with self._lock:
            linger = self._linger
            linger.extend(self.buffers)
            self.buffers = []
            keep = []
            for i in range(len(linger)):
                if sys.getrefcount(linger[i]) <= 2:  # the list's reference and getrefcount's argument
                    self._unpin(linger[i])
                else:
                    keep.append(linger[i])
            linger[:] = keep


def pin_host(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``address`` (``cudaHostRegister``, portable flag), so
    device-to-host copies land in it at full speed (the stream's shared-memory slots): True when
    registered (undo with :func:`unpin_host` before the memory is unmapped), False without CUDA or
    when the driver refuses (``ulimit -l``): the copies then go through the driver's staging."""
    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)) == 0


def unpin_host(address: int) -> None:
    """Undo :func:`pin_host` of the memory at ``address``."""
    torch.cuda.cudart().cudaHostUnregister(address)


def release_pool(pool: Any) -> None:
    """Release ``pool`` if it is pinned (a plain pool needs nothing)."""
    if isinstance(pool, PinnedBufferPool):
        pool.release()
