"""Pinned host buffers reused from step to step for the step's one host-to-device upload.

``host_batch.upload`` packs a step's int lists into one ``array`` and sends it to the device in
one asynchronous copy, which needs its bytes in pinned (page-locked) memory. Taking a fresh
pinned tensor every step goes through PyTorch's caching host allocator (its lock, the events of
the blocks freed earlier, an event recorded when the tensor dies) and then a tensor-to-tensor
copy from the array's buffer. :class:`PinnedStaging` instead keeps a small ring of pinned
buffers: the array's bytes go in with one ``memmove``, the copy to the device is queued, and a
CUDA event recorded behind it tells when that buffer may be written again (checked, cheaply,
when the ring comes back to it a few steps later; a step whose copy has not run yet waits).
"""

from __future__ import annotations

import ctypes
from array import array

import torch

NUM_BUFFERS = 4
"""Buffers in the ring: more than the steps in flight (async scheduling keeps one)."""
MIN_ELEMENTS = 1 << 14
"""Smallest buffer, in int64 elements (128 KiB): a 256-row decode step needs ~2k."""


class PinnedStaging:
    """A ring of pinned int64 buffers that carry packed step inputs to ``device`` (CUDA)."""

    def __init__(self, device: torch.device, num_buffers: int = NUM_BUFFERS) -> None:
        if num_buffers < 2:
            raise ValueError(f"a staging ring needs at least 2 buffers, got {num_buffers}")
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0

    def to_device(self, flat: array) -> torch.Tensor:
        """``flat`` (an ``array('q')``) as an int64 tensor on the device; the copy is queued on
        the current stream and ``flat`` may be reused as soon as this returns."""
        return self._send(flat, None)

    def copy_into(self, flat: array, dst: torch.Tensor) -> None:
        """``to_device`` into the first ``len(flat)`` elements of ``dst`` (int64, on the
        device): no allocation (a static buffer that a CUDA graph reads)."""
        self._send(flat, dst)

    def _send(self, flat: array, dst: torch.Tensor | None) -> torch.Tensor:
        if flat.typecode != "q":
            raise ValueError(f"staging takes array('q'), got typecode {flat.typecode!r}")
        n = len(flat)
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run (normally long ago)
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            size = max(n, MIN_ELEMENTS, 0 if buf is None else 2 * buf.numel())
            buf = self._buffers[i] = self._new_buffer(size)
        if n:
            ctypes.memmove(buf.data_ptr(), flat.buffer_info()[0], n * flat.itemsize)
        if dst is None:
            out = buf[:n].to(self.device, non_blocking=True)
        else:
            out = dst[:n]
            out.copy_(buf[:n], non_blocking=True)
        if event is None:
            event = self._events[i] = self._new_event()
        event.record()
        return out

    @staticmethod
    def _new_buffer(size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int64, pin_memory=True)

    @staticmethod
    def _new_event() -> torch.cuda.Event:
        return torch.cuda.Event()


class HostIdBuffers:
    """Pinned buffers, each with its CUDA event, for a step's sampled ids on their way to the
    host (``StepHandle``): taken when the step is launched and given back once the host has
    read the ids, so that a step neither allocates pinned memory nor creates an event. A
    buffer is reused only after its reader gave it back; a handle dropped unread keeps its
    buffer (freed with it), and an empty pool allocates."""

    def __init__(self) -> None:
        self._free: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def take(self, num: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer of at least ``num`` elements of ``dtype`` and its event."""
        free = self._free
        while free:
            buf, event = free.pop()
            if buf.dtype == dtype and buf.numel() >= num:
                return buf, event
        return self._new(max(num, 256), dtype)

    @staticmethod
    def _new(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        return torch.empty(size, dtype=dtype, pin_memory=True), torch.cuda.Event()

    def give_back(self, slot: tuple[torch.Tensor, torch.cuda.Event]) -> None:
        """Return a buffer whose contents the host has read (its event has fired)."""
        self._free.append(slot)
