"""A step's host inputs, packed into one preallocated (pinned, on CUDA) buffer and copied to the
device in one transfer.

Every small `torch.tensor(list, device=...)` is an allocation and a transfer of its own, several per
step; here the step's numpy arrays are copied into one host buffer, sent with one non-blocking copy
into its device twin, and read back there as typed views (64-byte aligned, so kernels see aligned
pointers). The device buffer is reused by every send: its readers and the next send's copy are
ordered on the stream. The host side is not: a non-blocking copy from pinned memory reads it when
the stream reaches the copy, so a send's host bytes must not be rewritten before then. A step ends in
the host read of its sampled tokens, but one step may send more than once (a speculative step's
chained draft depths replay one set of decode graphs, back to back with no read between them, and
the second depth's inputs once landed in the first depth's copy: its rows ran with another
sequence's pages and tags, which passed the check). So the host side is `NUM_HOST_BUFFERS` pinned
buffers taken in turn, each with an event recorded at its send: `start` waits for the event of the
buffer it takes (never, in practice: two sends of one step use two buffers, and the step's read back
has drained the ones before). The buffers grow (doubling) when a send needs more.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from backend.engine.forward_batch import ForwardBatch, HostBatch, ImageEmbeds, KVCache

ALIGN = 64  # bytes
NUM_HOST_BUFFERS = 2  # on CUDA, taken in turn (the module docstring); on the CPU a copy is synchronous: 1
_TORCH_DTYPES: dict[np.dtype[Any], torch.dtype] = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}


class StagingBuffer:
    def __init__(
        self, device: torch.device, capacity: int = 1 << 16, num_host_buffers: int | None = None
    ) -> None:
        """`num_host_buffers`: default `NUM_HOST_BUFFERS` on CUDA, 1 elsewhere (copies synchronous)."""
        self.device = device
        self.num_sends = 0
        self._segments: list[tuple[int, np.dtype, tuple[int, ...]]] = []  # (byte offset, dtype, shape)
        self._used = 0
        self._views: dict[tuple[int, np.dtype, tuple[int, ...]], torch.Tensor] = {}
        is_cuda = device.type == "cuda"
        num_host = num_host_buffers or (NUM_HOST_BUFFERS if is_cuda else 1)
        self._hosts = [torch.empty(0, dtype=torch.uint8) for _ in range(num_host)]  # pinned on CUDA
        # per host buffer, the event its last send's copy recorded (None: not sent since made)
        self._sent: list[torch.cuda.Event | None] = [None] * num_host
        self._events = [torch.cuda.Event() for _ in range(num_host)] if is_cuda else []  # type: ignore[no-untyped-call]
        self._typeds: list[dict[Any, np.ndarray]] = [{} for _ in range(num_host)]
        self._device = torch.empty(0, dtype=torch.uint8, device=device)
        for self._current in reversed(range(num_host)):  # each at `capacity`, the first current
            self._host = self._hosts[self._current]
            self._allocate(capacity)
        self.num_waits = 0  # `start`s that found their buffer's copy still queued (and waited)

    def start(self) -> None:
        """Begin a send: forget the last one's segments, and take the next host buffer once its last
        copy has left it (the module docstring)."""
        self._segments.clear()
        self._used = 0
        if len(self._hosts) > 1:
            self._current = (self._current + 1) % len(self._hosts)
            self._host, self._typed = self._hosts[self._current], self._typeds[self._current]
            event = self._sent[self._current]
            if event is not None and not event.query():  # type: ignore[no-untyped-call]
                self.num_waits += 1
                event.synchronize()
            self._sent[self._current] = None

    def reserve(self, dtype: type, shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """Room for one array: (its handle for `view` after `send`, the host view to fill). Fill it
        before the next `reserve` or `add`: growing the buffer keeps what was written until then."""
        dt = np.dtype(dtype)
        assert dt in _TORCH_DTYPES, f"no staging for {dt}"
        offset, size = self._used, math.prod(shape)
        self._used = offset + -(-size * dt.itemsize // ALIGN) * ALIGN
        if self._used > self._host.numel():
            self._allocate(max(self._used, 2 * self._host.numel()), keep=offset)
        self._segments.append((offset, dt, shape))
        start = offset // dt.itemsize
        return len(self._segments) - 1, self._typed[dt][start : start + size].reshape(shape)

    def add(self, array: np.ndarray) -> int:
        """Stage a copy of `array`; returns its handle for `view` after `send`."""
        handle, view = self.reserve(array.dtype.type, array.shape)
        view[...] = array
        return handle

    def send(self) -> None:
        """Copy everything staged this step to the device at once."""
        self._device[: self._used].copy_(self._host[: self._used], non_blocking=True)
        if self._events:
            event = self._events[self._current]
            event.record()
            self._sent[self._current] = event
        self.num_sends += 1

    def view(self, handle: int) -> torch.Tensor:
        """The device tensor of staged array `handle` (valid until the next `send`)."""
        key = self._segments[handle]
        view = self._views.get(key)
        if view is None:  # steps repeat their layout: views are made once per (offset, dtype, shape)
            if len(self._views) > 1024:  # eager steps' shapes vary: keep the cache bounded
                self._views.clear()
            offset, dt, shape = key
            flat = self._device[offset : offset + math.prod(shape) * dt.itemsize].view(_TORCH_DTYPES[dt])
            view = self._views[key] = flat.view(shape)
        return view

    def _allocate(self, capacity: int, keep: int = 0) -> None:
        """The current host buffer at `capacity` bytes, its first `keep` carried over, and the device
        buffer at least as large. (A replaced pinned block is recycled by torch only once its queued
        copies have completed; a replaced device block only by later work on the stream.)"""
        is_pinned = self.device.type == "cuda"
        host = torch.empty(capacity, dtype=torch.uint8, pin_memory=is_pinned)
        if keep:
            host[:keep] = self._host[:keep]
        self._host = self._hosts[self._current] = host
        host_np = host.numpy()
        self._typed = {dt: host_np.view(dt) for dt in _TORCH_DTYPES}  # the whole buffer, per type
        self._typeds[self._current] = self._typed
        if capacity > self._device.numel():
            self._device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            self._views.clear()


def stage_batch(staging: StagingBuffer, h: HostBatch) -> list[int]:
    """Stage every ForwardBatch field of an eager step (page tables as wide as its widest sequence):
    their handles for `staged_batch`, after the buffer's send."""
    fields = (h.input_ids, h.positions, h.query_start, h.seq_lens, h.page_table, h.expected_tags)
    return [staging.add(a) for a in (*fields, h.slots, h.logits_indices, h.seq_index)]


def staged_batch(
    staging: StagingBuffer, h: HostBatch, handles: list[int], kv_cache: KVCache, *, check_tags: bool
) -> ForwardBatch:
    """The eager step's ForwardBatch: views of the sent staging buffer (`stage_batch`'s `handles`)."""
    v = [staging.view(i) for i in handles]
    dev = staging.device
    image_embeds = None
    if h.image_rows:
        image_embeds = ImageEmbeds(
            token_indices=torch.tensor(h.image_rows, dtype=torch.int64, device=dev),
            embeds=torch.cat(h.image_parts).to(dev),
        )
    B = h.num_seqs
    return ForwardBatch(
        input_ids=v[0],
        positions=v[1],
        query_start=v[2],
        seq_lens=v[3],
        page_table=v[4],
        expected_tags=v[5],
        slot_mapping=v[6],
        logits_indices=v[7],
        kv_cache=kv_cache,
        tag_mismatch=torch.zeros(B, dtype=torch.bool, device=dev),
        is_decode_only=len(h.input_ids) == B,
        logits_are_rows=h.is_pure_decode,
        check_tags=check_tags,
        image_embeds=image_embeds,
        seq_index=v[8],
    )


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of host values on `device`. On CUDA through pinned memory, non-blocking: a
    plain `torch.tensor(values, device=...)` copies from pageable memory and synchronizes the
    stream, so one made after a step's graph launch (sampling parameters) would wait for the graph
    instead of overlapping it. (The pinned block is recycled only once its copy has completed.)"""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def array_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`; on CUDA through pinned memory, non-blocking (`to_device`'s reason)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
