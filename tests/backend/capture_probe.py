"""A `Capture` for the CPU tests that checks what a CUDA graph of each step reads outlives the step.

A CUDA graph records the addresses its kernels read, not the tensors behind them: a tensor the step
read that nothing else keeps alive goes back to the caching allocator, which hands its memory to the
next tensor of that size, and every later replay reads whatever that one holds (on the H200,
2026-12-04, the verify graphs read their freed index tensors: an `IndexKernel.cu` assert at
`graph.replay()`). The graphs' owners (`DecodeGraphs`, `VerifyGraphs`, `SpecForwards`) hold every
tensor their steps read; `CudaGraphReplay` holds the step too, as a second guard. `eager_capture`
keeps the step, so on the CPU a step that breaks this still runs right; `AddressCapture` runs each
step once under a dispatch mode, keeps a weak reference to the storage of every tensor an op reads
that no op of the step made (its inputs from outside: static buffers, weights, the KV cache), and
after `release()` (the steps dropped) `freed()` names each of those whose memory is gone.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Step = Callable[[], Any]


class _Reads(TorchDispatchMode):
    """The storages a step's ops read that none of its ops made, by the storage's identity."""

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.inputs: dict[int, tuple[str, StorageWeakRef]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.made and ref.cdata not in self.inputs:
                    self.inputs[ref.cdata] = (f"{func}: {t.dtype} {tuple(t.shape)}", ref)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                cdata = StorageWeakRef(t.untyped_storage()).cdata
                if cdata not in self.inputs:  # not an in-place result or a view of an input
                    self.made.add(cdata)
        return out


class AddressCapture:
    """Runs each step once (a capture's warm-up), noting its inputs; replays run it eagerly, as
    `eager_capture` does, until `release()`."""

    def __init__(self) -> None:
        self.steps: list[Step | None] = []
        self.inputs: list[tuple[int, str, StorageWeakRef]] = []  # (capture, first read, storage)

    def __call__(self, step: Step) -> Step:
        with _Reads() as reads:
            step()
        index = len(self.steps)
        self.steps.append(step)
        self.inputs += [(index, what, ref) for what, ref in reads.inputs.values()]
        return lambda: self._replay(index)

    def _replay(self, index: int) -> Any:
        step = self.steps[index]
        assert step is not None, "released: a graph would replay over freed memory"
        return step()

    def release(self) -> None:
        """Drop every step, as a graph does once captured."""
        self.steps = [None] * len(self.steps)
        gc.collect()

    def read(self, tensor: torch.Tensor) -> bool:
        """Whether some captured step read `tensor`'s storage from outside itself."""
        cdata = StorageWeakRef(tensor.untyped_storage()).cdata
        return any(ref.cdata == cdata for _, _, ref in self.inputs)

    def freed(self) -> list[str]:
        """Each step input whose memory is gone: 'capture i, the op that first read it: dtype shape'."""
        return [f"capture {i}, {what}" for i, what, ref in self.inputs if ref.expired()]
