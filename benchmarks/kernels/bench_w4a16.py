"""W4A16 GEMM on the GPU: correctness on random bf16 data, then time against the peers.

Peers, same run, same shapes: cuBLAS bf16 (`x @ w.T`), tinygemm (`torch._weight_int4pack_mm`) at the
same group size (full run only), and `torch._scaled_mm` with FP8 e4m3 weights and activations (M
padded to 16). Ours is timed with the launcher's own config choice and with alternative tile shapes,
so the defaults in `kernels/w4a16_gemm.py` (`GEMV_DEFAULT`, `TMA_PROGRAMS_PER_SM`, `GEMV_MAX_M`,
`TILE_DEFAULTS`) can be set from the best; `--quick` (M = 1, 16, 64 on 8192² and Kimi's expert shapes, ~40 s) ends
with a table of the best candidates and the values to put there.

    python3 -m benchmarks.kernels.bench_w4a16 --out results.json [--quick]
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch
import triton

from benchmarks.kernels.common import num_copies, rel_err, rotating, run_cases
from kernels.formats.int4 import repack_int4
from kernels.w4a16_config import (
    GEMV_DEFAULT,
    GEMV_PROGRAMS_PER_SM,
    GEMV_TMA,
    TMA_PROGRAMS_PER_SM,
    W4A16Config,
    pick_config,
    with_split_k,
)
from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref

SHAPES = [  # name, N, K, group
    ("dense", 8192, 8192, 128),
    ("dense", 8192, 8192, 32),
    ("kimi-expert-gate-up", 4096, 7168, 32),
    ("kimi-expert-down", 7168, 2048, 32),
]
MS = [1, 16, 64, 256, 2048]
QUICK_MS = [1, 16, 64]
# the GEMV candidates at M <= 2 (split_k 0: the launcher's, at `GEMV_PROGRAMS_PER_SM`); also compiled
# by `python -m tests.kernels.sm90_compile_int4 --all`
QUICK_GEMVS = [
    GEMV_DEFAULT,  # the plain GEMV
    GEMV_TMA,  # the same tiles streamed by TMA (slower on the 2026-12-04 sweep)
    W4A16Config(0, 64, 256, lift=True),
    W4A16Config(0, 256, 256, num_warps=8, tma_stages=3),
    W4A16Config(0, 64, 256, tma_stages=4),
    W4A16Config(0, 128, 256, prefetch=True),  # the next K tile in registers
]
Trial = tuple[W4A16Config, int]  # split_k 0: `with_split_k` at that many programs per SM


def variants(M: int, quick: bool) -> list[Trial]:
    """Alternatives timed beside the default."""
    per_sm = GEMV_PROGRAMS_PER_SM
    if M <= 2:
        gemvs = [
            *QUICK_GEMVS,
            *([] if quick else [W4A16Config(0, 64, 256), W4A16Config(0, 128, 256, tma_stages=6)]),
        ]
        spread = [(GEMV_TMA, 2), (GEMV_TMA, 8)]  # the TMA GEMV at other programs per SM
        trials = [(c, TMA_PROGRAMS_PER_SM if c.tma_stages > 1 else per_sm) for c in gemvs] + spread
        return [(replace(c, split_k=0), n) for c, n in trials]
    D = W4A16Config
    if M <= 64:
        bm = min(64, max(16, triton.next_power_of_2(M)))
        tiles = [D(bm, 64, 256, 0, num_stages=3), D(bm, 64, 128, 0, num_warps=2, num_stages=4)]
        tiles.append(D(bm, 64, 128, 0, num_stages=4, swap_xw=True))  # w as wgmma's register operand
        more = [D(bm, 32, 256, 0, num_warps=2, num_stages=4), D(bm, 128, 128, 0, num_warps=8, num_stages=4)]
        gemv = [(replace(GEMV_DEFAULT, split_k=0), GEMV_PROGRAMS_PER_SM)] if M <= 16 else []  # GEMV_MAX_M
        return [(c, 4) for c in tiles + ([] if quick else [*more, D(0, 32, 256, dense=True)])] + gemv
    return [
        (c, 4)
        for c in (
            D(0, 64, 256, dense=True),
            D(0, 32, 512, num_warps=8, dense=True),
            D(128, 128, 64, 1, num_warps=8, num_stages=3),
            D(128, 128, 64, 1, num_warps=4, num_stages=4),
        )
    ]


def label(cfg: W4A16Config, per_sm: int) -> str:
    kind = "dense" if cfg.dense else ("gemv" if cfg.block_m == 0 else f"bm{cfg.block_m}")
    extra = (" lift" if cfg.lift else "") + (f" {per_sm}/SM" if cfg.block_m == 0 and not cfg.dense else "")
    extra += f" s{cfg.loop_stages}" if cfg.loop_stages > 1 else ""
    extra += f" tma{cfg.tma_stages}" if cfg.tma_stages > 1 else ""
    extra += " prefetch" if cfg.prefetch else ""
    extra += f" rows{cfg.gemv_rows}" if cfg.gemv_rows > 1 else ""
    extra += " swap" if cfg.swap_xw else ""
    return f"{kind} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} split{cfg.split_k}{extra}"


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
    name: str, N: int, K: int, group: int, quick: bool, ceil: dict[str, float], sms: int
) -> list[dict[str, Any]]:
    dev = "cuda"
    int4_bytes = N * K // 2 + N * (K // group) * 2
    copies = []
    for _ in range(num_copies(int4_bytes)):
        packed = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), dtype=torch.int32, device=dev)
        scale = (torch.rand(N, K // group, device=dev) * 0.02 + 0.002).to(torch.bfloat16)
        copies.append((packed, scale))
    repacked = [repack_int4(p, s)[:2] for p, s in copies]
    bf16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(num_copies(N * K * 2))]
    fp8 = [
        (w.to(torch.float8_e4m3fn).t(),)
        for w in (torch.randn(N, K, device=dev) for _ in range(num_copies(N * K)))
    ]
    tiny, tiny_err = [], "skipped (--quick)"
    if not quick:
        try:
            tiny = [tinygemm_weights(p, s, group) for p, s in copies]
        except RuntimeError as exc:
            tiny_err = repr(exc)
    one = torch.ones((), device=dev)
    rows = []
    for M in QUICK_MS if quick else MS:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        # correctness: fresh data, poisoned output, fp32 reference on the checkpoint layout
        ref = w4a16_gemm_ref(x.float(), copies[0][0], copies[0][1].float())
        picked = pick_config(M, N, K, sms, group)
        trials = [(picked, TMA_PROGRAMS_PER_SM if picked.tma_stages > 1 else GEMV_PROGRAMS_PER_SM)]
        trials += variants(M, quick)
        resolved = {}  # config -> label, the default first, each config once
        for c, per_sm in trials:
            c = c if c.split_k else with_split_k(c, M, N, K, sms, per_sm)
            resolved.setdefault(c, label(c, per_sm))
        cfgs, labels = list(resolved), list(resolved.values())
        errs, times = [], []
        for cfg in cfgs:
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
                "config": asdict(cfgs[0]),
                "best_variant": {"ms": times[best], "config": asdict(cfgs[best]), "label": labels[best]},
                "best_GBps": bytes_moved / times[best] / 1e6,
                "variants": [
                    {"ms": t, "rel_err": e, "config": asdict(c), "label": lb}
                    for t, e, c, lb in zip(times, errs, cfgs, labels, strict=True)
                ],
                **({"tinygemm_error": tiny_err} if not tiny else {}),
            }
        )
        r = rows[-1]
        print(
            f"{r['case']:<44} ours {ms * 1e3:8.1f}us best {times[best] * 1e3:8.1f}us [{labels[best]}] "
            f"frac {r['fraction_of_ceiling']:.2f} err {max(errs):.1e} {'ok' if r['ok'] else 'FAIL'} | "
            + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in peers.items()),
            flush=True,
        )
    return rows


def summary(rows: list[dict[str, Any]], copy_GBps: float) -> None:
    """The compact table, and per M the candidate with the least total time over the shapes."""
    print(
        f"\n{'case':<44} {'default':>8} {'best':>8} {'GB/s':>6} {'copy':>5} {'fp8':>7} {'fp8/best':>8}  best config"
    )
    for r in rows:
        fp8 = r["peers"]["scaled_mm_fp8"]
        b = r["best_variant"]
        print(
            f"{r['case']:<44} {r['ms'] * 1e3:8.1f} {b['ms'] * 1e3:8.1f} {r['best_GBps']:6.0f} "
            f"{r['best_GBps'] / copy_GBps:5.2f} {fp8 * 1e3:7.1f} {fp8 / b['ms']:8.2f}  {b['label']}"
        )
    for M in sorted({int(r["case"].split()[0][2:]) for r in rows}):
        same = [r for r in rows if r["case"].startswith(f"M={M} ")]
        totals: dict[str, float] = {}
        for r in same:
            for v in r["variants"]:
                totals[v["label"]] = totals.get(v["label"], 0.0) + v["ms"]
        pick = min(totals, key=totals.__getitem__)
        print(f"M={M}: least total {totals[pick] * 1e3:.1f}us over {len(same)} shapes: {pick}")
    print(
        "-> GEMV_DEFAULT, TMA_PROGRAMS_PER_SM (M=1), GEMV_MAX_M and TILE_DEFAULTS (M=16, 64) in kernels/w4a16_gemm.py"
    )


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def bench_case(
        name: str, N: int, K: int, group: int, ceil: dict[str, float], quick: bool = False
    ) -> list[dict[str, Any]]:
        return bench_shape(name, N, K, group, quick, ceil, sms)

    rows, ceil = run_cases(
        bench_case,
        list(SHAPES),
        "ms = median do_bench of a CUDA-graph replay over rotating weight copies (> 4x L2), per call",
        quick_cases=list(SHAPES),
    )
    summary(rows, ceil["copy_GBps"])


if __name__ == "__main__":
    main()
