"""The MoE gate's product at decode: cast + cuBLAS fp32 GEMV (`F.linear(x.float(), w)`, two launches) against
`kernels/router_logits_triton.py` (one), GLM-5's router (E = 256, H = 6144), T = 1 and 2. Each side is
captured in a CUDA graph of 78 back-to-back calls (distinct weights, so L2 holds none of them, as in a
step), timed by CUDA events over replays; prints µs a call and the weight's GB/s.

    python -m lab.diagnostics.router_gemv_ab
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.router_logits_triton import router_logits_triton

E, H, LAYERS, REPLAYS = 256, 6144, 78, 50


def time_graph(fn, xs: list[torch.Tensor], ws: list[torch.Tensor]) -> float:
    """µs a call: a graph of one call per layer, replayed."""
    for x, w in zip(xs, ws, strict=True):
        fn(x, w)  # compile / warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w in zip(xs, ws, strict=True):
            fn(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * LAYERS)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(E, H, device="cuda", generator=g) * H**-0.5 for _ in range(LAYERS)]
    for T in (1, 2):
        xs = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(LAYERS)]
        torch_us = time_graph(lambda x, w: F.linear(x.float(), w), xs, ws)
        kernel_us = time_graph(router_logits_triton, xs, ws)
        err = max(
            float((router_logits_triton(x, w) - F.linear(x.float(), w)).abs().max())
            for x, w in zip(xs, ws, strict=True)
        )
        gb = E * H * 4 / 1e3
        print(
            f"T={T}: cast+cuBLAS {torch_us:.2f} us ({gb / torch_us:.0f} GB/s), router_logits {kernel_us:.2f} us "
            f"({gb / kernel_us:.0f} GB/s), ratio {kernel_us / torch_us:.2f}, max |diff| {err:.2e}"
        )


if __name__ == "__main__":
    main()
