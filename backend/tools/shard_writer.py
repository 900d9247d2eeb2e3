"""A safetensors file written one tensor at a time, so a converted shard never sits in memory whole.

`safetensors.torch.save_file` takes every tensor at once; `kumo quantize` knows each output
tensor's name, dtype and shape before computing it (from the source header and the scheme), so it
writes the header first and then each tensor's bytes as they are produced. The layout is the
published format: an 8-byte little-endian header length, the JSON header (names → dtype, shape,
data_offsets; `__metadata__`) padded with spaces to 8 bytes, then the data in offset order. The
tests read every file back with the safetensors library.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
NAMES = {v: k for k, v in DTYPES.items()}


class ShardWriter:
    """`write(name, tensor)` in the order of `plan`; each must match its planned dtype and shape."""

    def __init__(
        self, path: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ) -> None:
        self.plan, self.next = plan, 0
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in plan:
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, dtype, shape = self.plan[self.next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want, dtype, shape):
            raise ValueError(
                f"expected {want} {dtype} {shape}, got {name} {tensor.dtype} {tuple(tensor.shape)}"
            )
        self.file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.plan):
            raise ValueError(f"{len(self.plan) - self.next} planned tensors were never written")
