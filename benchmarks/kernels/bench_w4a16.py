"""W4A16 GEMM on the GPU: correctness on random bf16 data, then time against the peers.

Peers, same run, same shapes: cuBLAS bf16 (`x @ w.T`), tinygemm (`torch._weight_int4pack_mm`) at the
same group size, and `torch._scaled_mm` with FP8 e4m3 weights and activations (M padded to 16).
Ours is timed with the launcher's own config choice and with a few alternative tile shapes, so the
heuristic can be checked against the best one measured.

    python3 -m benchmarks.kernels.bench_w4a16 --out results.json
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import triton

from benchmarks.kernels.common import num_copies, rel_err, rotating, run_cases
from kernels.w4a16_gemm import W4A16Config, pick_config, repack_int4, w4a16_gemm, w4a16_gemm_ref, with_split_k

SHAPES = [  # name, N, K, group
    ("dense", 8192, 8192, 128),
    ("dense", 8192, 8192, 32),
    ("kimi-expert-gate-up", 4096, 7168, 32),
    ("kimi-expert-down", 7168, 2048, 32),
]
MS = [1, 16, 64, 256, 2048]


def variants(M: int) -> list[W4A16Config]:
    """Alternatives timed beside the default; split_k=0 means 'the launcher's split for this shape'."""
    G = D = W4A16Config
    if M <= 2:
        return [
            G(0, 64, 256, 0, prefetch=False),
            G(0, 32, 256, 0),
            G(0, 32, 256, 0, prefetch=False),
            G(0, 128, 256, 0),
            G(0, 64, 256, 3),
            G(0, 32, 512, 0),
            G(0, 64, 256, 0, num_warps=8),
        ]
    if M <= 64:
        bm = min(64, max(16, triton.next_power_of_2(M)))
        return [
            D(bm, 64, 256, 0, num_stages=3),
            D(bm, 32, 256, 0, num_warps=2, num_stages=4),
            D(bm, 64, 128, 0, num_warps=2, num_stages=4),
            D(bm, 128, 128, 0, num_warps=8, num_stages=4),
            D(0, 32, 256, dense=True),
        ]
    return [
        D(0, 64, 256, dense=True),
        D(0, 32, 512, num_warps=8, dense=True),
        D(128, 128, 64, 1, num_warps=8, num_stages=3),
        D(128, 128, 64, 1, num_warps=4, num_stages=4),
    ]


def tinygemm_weights(
    packed: torch.Tensor, scale: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint words -> tinygemm's `[N, K/2] uint8` input, packed, and `[K/G, N, 2]` scale+zero."""
    N = packed.shape[0]
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = ((packed[..., None] >> shifts) & 0xF).reshape(N, -1)  # [N, K] unsigned q+8
    u8 = (nib[:, ::2] << 4 | nib[:, 1::2]).to(torch.uint8)
    w = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
    sz = torch.stack([scale.t().to(torch.bfloat16), torch.zeros_like(scale.t(), dtype=torch.bfloat16)], -1)
    return w, sz.contiguous()


def bench_shape(
    name: str, N: int, K: int, group: int, ceil: dict[str, float], sms: int
) -> list[dict[str, Any]]:
    dev = "cuda"
    int4_bytes = N * K // 2 + N * (K // group) * 2
    copies = []
    for _ in range(num_copies(int4_bytes)):
        packed = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), dtype=torch.int32, device=dev)
        scale = (torch.rand(N, K // group, device=dev) * 0.02 + 0.002).to(torch.bfloat16)
        copies.append((packed, scale))
    repacked = [repack_int4(p, s)[:2] for p, s in copies]
    w_ref = [(p, s) for p, s in copies[:1]]
    bf16 = []
    for _ in range(num_copies(N * K * 2)):
        bf16.append(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02)
    fp8 = [
        (w.to(torch.float8_e4m3fn).t(),)
        for w in (torch.randn(N, K, device=dev) for _ in range(num_copies(N * K)))
    ]
    try:
        tiny = [tinygemm_weights(p, s, group) for p, s in copies]
    except RuntimeError as exc:
        tiny, tiny_err = [], repr(exc)
    one = torch.ones((), device=dev)
    rows = []
    for M in MS:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        # correctness: fresh data, poisoned output, fp32 reference on the checkpoint layout
        p0, s0 = w_ref[0]
        ref = w4a16_gemm_ref(x.float(), p0, s0.float())
        cfg0 = pick_config(M, N, K, sms)
        trials = [cfg0, *[with_split_k(v, M, N, K, sms) if v.split_k == 0 else v for v in variants(M)]]
        errs, times = [], []
        for cfg in trials:
            out = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            w4a16_gemm(x, *repacked[0], group, config=cfg, out=out)
            errs.append(rel_err(out.float(), ref))
            times.append(rotating(lambda w, s, c=cfg, x=x: w4a16_gemm(x, w, s, group, config=c), repacked))
        peers = {"cublas_bf16": (rotating(lambda w, x=x: x @ w.t(), [(w,) for w in bf16]))}
        m16 = -(-M // 16) * 16
        x8 = torch.randn(m16, K, device=dev).to(torch.float8_e4m3fn)
        peers["scaled_mm_fp8"] = rotating(
            lambda b, x8=x8: torch._scaled_mm(x8, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            fp8,
        )
        if tiny:
            peers["tinygemm_int4"] = rotating(
                lambda w, sz, x=x: torch.ops.aten._weight_int4pack_mm(x, w, group, sz), tiny
            )
        ms = times[0]
        best = min(range(len(times)), key=times.__getitem__)
        bytes_moved = int4_bytes + M * K * 2 + M * N * 2
        flops = 2 * M * N * K
        floor_ms = max(bytes_moved / ceil["copy_GBps"] / 1e6, flops / ceil["bf16_TFLOPs"] / 1e9)
        goal = None
        if name == "dense" and M in (1, 16, 64):
            goal = "w4a16-decode"
        elif M >= 2048:
            goal = "w4a16-prefill"
        rows.append(
            {
                "kernel": "w4a16",
                "case": f"M={M} N={N} K={K} g={group} {name}",
                "goal": goal,
                "ms": ms,
                "fraction_of_ceiling": floor_ms / ms,
                "peers": peers,
                "GBps": bytes_moved / ms / 1e6,
                "TFLOPs": flops / ms / 1e9,
                "rel_err": errs[0],
                "max_rel_err_all_variants": max(errs),
                "ok": all(e < 1e-2 for e in errs),  # NaN (an unwritten output) fails too
                "config": asdict(cfg0),
                "best_variant": {"ms": times[best], "config": asdict(trials[best])},
                "variants": [
                    {"ms": t, "rel_err": e, "config": asdict(c)}
                    for t, e, c in zip(times, errs, trials, strict=True)
                ],
                **({"tinygemm_error": tiny_err} if not tiny else {}),
            }
        )
        r = rows[-1]
        print(
            f"{r['case']:<44} ours {ms * 1e3:8.1f}us best {times[best] * 1e3:8.1f}us "
            f"frac {r['fraction_of_ceiling']:.2f} err {max(errs):.1e} {'ok' if r['ok'] else 'FAIL'} | "
            + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in peers.items()),
            flush=True,
        )
    return rows


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def bench_case(name: str, N: int, K: int, group: int, ceil: dict[str, float]) -> list[dict[str, Any]]:
        return bench_shape(name, N, K, group, ceil, sms)

    run_cases(
        bench_case,
        SHAPES,
        "ms = median do_bench of a CUDA-graph replay over rotating weight copies (> 4x L2), per call",
    )


if __name__ == "__main__":
    main()
