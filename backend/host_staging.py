"""A step's host inputs, packed into one preallocated (pinned, on CUDA) buffer and copied to the
device in one transfer.

Every small `torch.tensor(list, device=...)` is an allocation and a transfer of its own, several per
step; here the step's numpy arrays are copied into one host buffer, sent with one non-blocking copy
into its device twin, and read back there as typed views (64-byte aligned, so kernels see aligned
pointers). Both buffers are reused by every step: safe, because a step ends in the host read of its
sampled tokens, after which its copy has landed and nothing reads its views any more. They grow
(doubling) when a step needs more.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


class StagingBuffer:
    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.num_sends = 0
        self._segments: list[tuple[int, np.ndarray]] = []  # (byte offset, array), this step
        self._used = 0
        self._views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._allocate(capacity)

    def start(self) -> None:
        """Begin a step: forget the previous step's segments."""
        self._segments.clear()
        self._used = 0

    def add(self, array: np.ndarray) -> int:
        """Stage `array` (copied now); returns its handle for `view` after `send`."""
        assert array.dtype in _TORCH_DTYPES, f"no staging for {array.dtype}"
        offset = self._used
        self._used = offset + -(-array.nbytes // ALIGN) * ALIGN
        self._segments.append((offset, array))
        return len(self._segments) - 1

    def send(self) -> None:
        """Pack every staged array and copy them to the device at once."""
        if self._used > self._host.numel():
            self._allocate(max(self._used, 2 * self._host.numel()))
        typed = self._typed
        for offset, array in self._segments:
            start = offset // array.itemsize
            typed[array.dtype][start : start + array.size] = array.reshape(-1)
        self._device[: self._used].copy_(self._host[: self._used], non_blocking=True)
        self.num_sends += 1

    def view(self, handle: int) -> torch.Tensor:
        """The device tensor of staged array `handle` (valid until the next `send`)."""
        offset, array = self._segments[handle]
        key = (offset, _TORCH_DTYPES[array.dtype], array.shape)
        view = self._views.get(key)
        if view is None:  # steps repeat their layout: views are made once per (offset, dtype, shape)
            if len(self._views) > 1024:  # eager steps' shapes vary: keep the cache bounded
                self._views.clear()
            flat = self._device[offset : offset + array.nbytes].view(key[1])
            view = self._views[key] = flat.view(array.shape)
        return view

    def _allocate(self, capacity: int) -> None:
        is_pinned = self.device.type == "cuda"
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=is_pinned)
        host = self._host.numpy()
        self._typed = {dtype: host.view(dtype) for dtype in _TORCH_DTYPES}  # the whole buffer, per type
        self._device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._views.clear()
