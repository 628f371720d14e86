"""Staging: small host-to-device copies that never make the host wait for the device.

Contract: `host(n, dtype)` hands out a host array of `n` values to fill; `copy(array)` sends
the array last handed out to the device without blocking and returns the device tensor;
`to_device(data, dtype)` does both for a list. On a CPU there is nothing to copy: `copy`
returns a tensor over the (fresh) host array itself.

Why it exists: overlap scheduling needs the host to prepare step N+1 while the device runs
step N. A copy from ordinary (pageable) host memory breaks that: CUDA synchronises the
stream before such a transfer, so the host would wait for step N at every
`torch.tensor(...).to("cuda", non_blocking=True)`. Copies from pinned (page-locked)
memory are truly asynchronous, but then the host must not refill a buffer that the device
has not read yet. So a `Staging` keeps a ring of pinned buffers, each with an event
recorded after its copy; a buffer is refilled only once its event has fired. The device
reads step N's copies before step N's kernels, so a buffer used while preparing step N is
free while preparing step N+1: the host waits only if one step makes more copies than half
the ring (`depth`), which no caller does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, depth: int = 64, min_bytes: int = 4096) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * depth  # uint8, pinned, grown
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._min_bytes = min_bytes
        self._next = 0
        self._last: tuple[int, np.ndarray] | None = None  # (buffer, array) of the last host()

    def host(self, n: int, dtype: torch.dtype) -> np.ndarray:
        """A host array of `n` values of `dtype`, to fill and then pass to `copy`."""
        np_dtype = _NUMPY[dtype]
        if not self._pinned:
            return np.empty(n, dtype=np_dtype)
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        if (event := self._events[i]) is not None:
            event.synchronize()  # the device has read what this buffer held before
        nbytes = n * np_dtype.itemsize
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, self._min_bytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffers[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        array = buffer[:nbytes].numpy().view(np_dtype)
        self._last = (i, array)
        return array

    def copy(self, array: np.ndarray) -> torch.Tensor:
        """The device copy of the array `host()` last handed out (filled since)."""
        if not self._pinned:
            return torch.from_numpy(array)
        assert self._last is not None and self._last[1] is array, "copy() the last host() array"
        i, _ = self._last
        self._last = None
        out = torch.empty(len(array), dtype=_TORCH[array.dtype], device=self.device)
        out.copy_(torch.from_numpy(array), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event
        return out

    def to_device(self, data: Sequence, dtype: torch.dtype) -> torch.Tensor:
        """A list (or array) of numbers as a device tensor of `dtype`."""
        array = self.host(len(data), dtype)
        array[:] = data
        return self.copy(array)


_NUMPY = {
    torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32),
    torch.float32: np.dtype(np.float32),
    torch.bool: np.dtype(np.bool_),
}
_TORCH = {v: k for k, v in _NUMPY.items()}
