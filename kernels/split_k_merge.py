"""Merging split-K attention slices by their log-sum-exp, and the device facts and split-K arrival
counters launchers share.

Split-K decode kernels (`paged_decode_gqa`, `mla_decode`) write, per (row, head, slice), the slice's
normalised partial output `[R]` and its LSE in the log2 domain (-inf for a slice with no visible
token). `merge_splits` combines them: `out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max) * v_scale`,
and 0 where no slice saw a token.

Shapes: B rows (sequences or query tokens), H heads, NS slices, R output width.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_enter

TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured earlier still use their address


def split_k_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for split-K GEMMs, one per output tile: the kernel's last program
    of a tile resets its counter, so the buffer stays zero between calls (and CUDA-graph replays)."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < n:
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(n, 1 << 18), dtype=torch.int32, device=device)  # 1 MB: decode never regrows it
        _COUNTERS[device] = cnt
    return cnt


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 stands in on the CPU, where the interpreter runs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pick_num_splits(batch: int, head_blocks: int, max_items: int, num_sms: int) -> int:
    """Slices per sequence: about two programs per SM, each slice at least 256 tokens, at most 64."""
    want = triton.cdiv(2 * num_sms, max(batch * head_blocks, 1))
    return max(1, min(want, triton.cdiv(max_items, 256), 64))


MERGE_BLOCK_S = 128  # LSEs the merge reads at once: every slice count a launcher picks (mla_tiles.MAX_SPLITS)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_o_ptr,  # [B, H, NS, R] fp32
    part_lse_ptr,  # [B, H, NS] fp32, log2 domain
    out_ptr,  # [B, H, R]
    v_scale,
    num_splits,
    R,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,  # >= num_splits: the LSEs at once (`MERGE_BLOCK_S`, see `merge_splits`)
    CHUNK_S: tl.constexpr,  # slices' outputs a step (registers: CHUNK_S x BLOCK_R fp32)
    BLOCK_R: tl.constexpr,  # output columns a program (grid axis 2)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    den = tl.sum(tl.exp2(lse - top), axis=0)  # 0 for empty slices
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        s = s0 + tl.arange(0, CHUNK_S)
        s_ok = s < num_splits
        w = tl.exp2(tl.load(part_lse_ptr + row * num_splits + s, mask=s_ok, other=float("-inf")) - top)
        o = tl.load(
            part_o_ptr + (row * num_splits + s)[:, None] * R + offs_r[None, :],
            mask=s_ok[:, None] & r_ok[None, :],
            other=0.0,
        )  # [CHUNK_S, R]
        acc += tl.sum(w[:, None] * o, axis=0)
    res = acc / tl.where(den > 0.0, den, 1.0) * v_scale  # no tokens: 0
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, res.to(out_ptr.dtype.element_ty), mask=r_ok)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, v_scale: float) -> None:
    """part_o `[B, H, NS, R]` fp32, part_lse `[B, H, NS]` fp32 → out `[B, H, R]` (written in place).

    One compiled kernel for every slice count up to `MERGE_BLOCK_S` (neither a block sized to NS nor
    NS itself specialises it): the slices follow the sequences' lengths, and a kernel per power of
    two compiled inside serving whenever a length crossed one (H100, 2026-12-06: a 230-260 ms stall
    inside GLM nano's speculative runs of 0.3-0.8 s). Reading 128 LSEs where a few are used costs a
    masked 512-byte load a row."""
    B, H, NS, R = part_o.shape
    if part_lse.shape != (B, H, NS) or out.shape[:2] != (B, H) or out.shape[-1] != R:
        raise ValueError(
            f"merge_splits: shapes {tuple(part_o.shape)}, {tuple(part_lse.shape)}, {tuple(out.shape)}"
        )
    if out.stride(-1) != 1 or not part_o.is_contiguous() or not part_lse.is_contiguous():
        raise ValueError("merge_splits: partials must be contiguous and out unit-stride in its last dim")
    block_r = min(128, triton.next_power_of_2(R))  # more programs at small batch (MLA: R = 512)
    _merge_kernel[(B, H, triton.cdiv(R, block_r))](
        part_o,
        part_lse,
        out,
        v_scale,
        NS,
        R,
        out.stride(0),
        out.stride(1),
        BLOCK_S=max(MERGE_BLOCK_S, triton.next_power_of_2(NS)),
        CHUNK_S=8,
        BLOCK_R=block_r,
        **pdl_args(out.device),
        num_warps=4,
    )
