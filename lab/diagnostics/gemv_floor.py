"""Issue 24: where a rank-of-8 W4A16 GEMV's time goes, against floors measured in the same run.

The c=1 step at rank 0 of 8 spends ~3.4 ms in 546 W4A16 GEMVs of 0.9-10 MB (lab/results/2026-12-05-r13/
sweep: 0.26-0.38 of the copy bandwidth, ~6-9 us each) and no tile or split config the sweep tried
moved them by more than 10%. Before redesigning the kernel, this says which floor it sits on. Per
shape (GLM 5.2's rank-0-of-8 decode Linears, the sweep's list), each a CUDA graph of back-to-back
launches over weight copies spanning 4x the L2 (`benchmarks.kernels.common.graph_ms`):

- `gemv`: the launcher (`w4a16_gemm`, M = 1, PDL on as in the step);
- `stream`: a Triton kernel that only reads the same bytes (the packed words and the scales) with
  16-byte loads and sums them, `PROGRAMS` per SM, persistent over the words, no PDL: what reading
  them costs at this size, with no dots, no split-K finish and no dependency on a previous kernel;
- `noop`: a Triton kernel of the launcher's grid that reads nothing: the launch-and-retire floor of
  that many programs in a graph;
- `memcpy`: `copy_` of the packed words into a buffer (the driver's copy: reads and writes them).

`gemv - stream` is what the GEMV's structure costs beyond reading its bytes; `stream - noop` what
reading them costs beyond launching. Printed per shape and weighted by calls a step.

    python3 -m lab.diagnostics.gemv_floor --out gemv_floor.json
    python3 -m lab.diagnostics.gemv_floor --smoke   # CPU, TRITON_INTERPRET=1: the stream sum checked
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (N, K, calls a 78-layer step, what) at rank 0 of 8, group 32 (the sweep's list, session 13)
SHAPES = [
    (2752, 6144, 78, "fused q_a | kv_a | indexer wk"),
    (6144, 2048, 78, "o_proj"),
    (6144, 2048, 78, "q_b | indexer wq_b (r14-qfuse: 2048 + 4096 rows)"),
    (512, 6144, 75, "shared experts gate | up"),
    (6144, 256, 75, "shared experts down"),
    (32, 6144, 78, "indexer weights_proj (float32 out)"),
]
GROUP = 32
PROGRAMS = (2, 4, 8)  # stream programs per SM tried; the best is reported
REPEATS = 5


@triton.jit
def _stream_kernel(w_ptr, s_ptr, out_ptr, n_words, n_scales, BLOCK: tl.constexpr):
    """Each program sums words [pid·BLOCK + i·grid·BLOCK …) and the same stride of the scales: every
    byte read once, 16-byte loads (BLOCK int32 a step), the sum written so nothing is dead code."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in tl.range(pid * BLOCK, n_words, grid * BLOCK, num_stages=3):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_first")
    sacc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in tl.range(pid * BLOCK, n_scales, grid * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        sacc += tl.load(s_ptr + offs, mask=offs < n_scales, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0).to(tl.float32) + tl.sum(sacc, axis=0))


@triton.jit
def _noop_kernel(out_ptr):
    if tl.program_id(0) < 0:  # never: a program that launches, reads nothing, retires
        tl.store(out_ptr, 0.0)


def stream(w: torch.Tensor, s: torch.Tensor, out: torch.Tensor, block: int = 1024) -> None:
    _stream_kernel[(out.numel(),)](w, s, out, w.numel(), s.numel(), BLOCK=block)


def noop(grid: int, out: torch.Tensor) -> None:
    _noop_kernel[(grid,)](out)


def smoke() -> None:
    """The stream kernel reads every word and scale once (its per-program sums add up to the total)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-(2**20), 2**20, (64, 96), generator=gen, dtype=torch.int32)
    s = torch.rand(64, 12, generator=gen).to(torch.bfloat16)
    out = torch.zeros(3)
    stream(w, s, out, block=128)
    want = float(w.sum()) + float(s.float().sum())
    assert abs(float(out.sum()) - want) <= 1e-3 * abs(want) + 1.0, (float(out.sum()), want)
    noop(5, out)
    print("smoke ok: the stream kernel's sums match; the no-op launches")


def case(N: int, K: int, out_dtype: torch.dtype, sms: int) -> dict[str, Any]:
    from benchmarks.kernels.common import graph_ms, num_copies
    from kernels.triton_lib import set_pdl
    from kernels.w4a16_config import pick_config
    from kernels.w4a16_gemm import w4a16_gemm

    dev = "cuda"
    words, scales = N * K // 8 * 4, N * K // GROUP * 2
    copies = num_copies(words + scales)
    ws = [
        torch.randint(-(2**31), 2**31 - 1, (N, K // 8), dtype=torch.int32, device=dev) for _ in range(copies)
    ]
    ss = [torch.rand(N, K // GROUP, device=dev).to(torch.bfloat16) * 0.01 for _ in range(copies)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    cfg = pick_config(1, N, K, sms, GROUP)  # what the launcher picks (config None below)
    set_pdl(True)
    out = torch.empty(1, N, device=dev, dtype=out_dtype)
    sink = torch.empty(max(PROGRAMS) * sms, device=dev)
    dst = torch.empty_like(ws[0])
    grid = triton.cdiv(N, cfg.block_n) * cfg.split_k  # the launcher's grid: (N/BN, M = 1, splits of K)
    pairs = list(zip(ws, ss, strict=True))
    arms: dict[str, Any] = {
        "gemv": [lambda w=w, s=s: w4a16_gemm(x, w, s, GROUP, out=out, out_dtype=out_dtype) for w, s in pairs]
    }
    for p in PROGRAMS:
        arms[f"stream {p}/SM"] = [lambda w=w, s=s, p=p: stream(w, s, sink[: p * sms]) for w, s in pairs]
    arms["noop"] = [lambda: noop(grid, sink)] * copies
    arms["memcpy"] = [lambda w=w: dst.copy_(w) for w in ws]
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(REPEATS):  # alternating order: A B .. B A
        for k in arms if r % 2 == 0 else reversed(arms):
            times[k].append(graph_ms(arms[k]) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    best_stream = min((k for k in med if k.startswith("stream")), key=lambda k: med[k])
    return {
        "N": N, "K": K, "bytes": words + scales, "config": repr(cfg), "grid": grid,
        "us": med, "spread": {k: [min(v), max(v)] for k, v in times.items()}, "best_stream": best_stream,
        "gemv_over_stream": med["gemv"] / med[best_stream], "stream_over_noop": med[best_stream] / med["noop"],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        smoke()
        return
    from kernels.split_k_merge import num_sms

    sms = num_sms(torch.device("cuda"))
    print(
        torch.cuda.get_device_name(), f"{sms} SMs; us per call, median of {REPEATS} alternating graph replays"
    )
    rows, step = [], {"gemv": 0.0, "stream": 0.0, "noop": 0.0}
    for N, K, calls, what in SHAPES:
        out_dtype = torch.float32 if "float32" in what else torch.bfloat16
        r = case(N, K, out_dtype, sms) | {"calls": calls, "what": what}
        rows.append(r)
        u = r["us"]
        step["gemv"] += calls * u["gemv"] / 1e3
        step["stream"] += calls * u[r["best_stream"]] / 1e3
        step["noop"] += calls * u["noop"] / 1e3
        print(f"N={N:5d} K={K:5d} {r['bytes'] / 1e6:6.2f} MB x{calls}  gemv {u['gemv']:6.2f}  {r['best_stream']} "
              f"{u[r['best_stream']]:6.2f}  noop {u['noop']:5.2f}  memcpy {u['memcpy']:6.2f}  "
              f"gemv/stream {r['gemv_over_stream']:.2f}  {what}")  # fmt: skip
    print("per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in step.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "step_ms": step}, f, indent=1)


if __name__ == "__main__":
    main()
