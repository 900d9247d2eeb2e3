"""Paged decode GQA attention on the GPU: BF16 vs FP8 KV, the tag check on vs off, and SDPA as the peer.

Shapes are GLM-4.5-Air's attention (96 query heads, 8 KV heads, head dim 128), page size 16, pages
handed out in a shuffled order as a long-running pool would. The peer is
flash `F.scaled_dot_product_attention` over a contiguous BF16 copy of the same K/V (`enable_gqa`).
Correctness: the first sequences of each case against an fp32 softmax over their gathered tokens. The tag check's cost is measured as interleaved A/B
pairs of the same kernel with the check compiled in and out.

    python3 -m benchmarks.kernels.bench_paged_decode --out results.json
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernels.common import (
    graph_ms,
    overhead_text,
    rel_err,
    run_cases,
    tag_check_row,
)
from kernels.paged_decode_gqa import paged_decode_gqa

HQ, HKV, D, PAGE = 96, 8, 128, 16
CASES = [(64, 8192), (64, 32768), (64, 131072), (8, 32768)]  # batch, context
AB_PAIRS = 7


def bench_case(B: int, ctx: int, ceil: dict[str, float]) -> list[dict[str, Any]]:
    dev = "cuda"
    pages_per = ctx // PAGE
    P = B * pages_per
    k16 = torch.randn(P, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn(P, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    page_table = torch.randperm(P, device=dev, dtype=torch.int64).to(torch.int32).reshape(B, pages_per)
    page_tags = torch.randint(0, 2**40, (P,), device=dev)
    expected = page_tags[page_table.long()]
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    flags = torch.zeros(B, dtype=torch.bool, device=dev)
    q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16)
    scale = D**-0.5
    k_scale, v_scale = float(k16.abs().amax()) / 448, float(v16.abs().amax()) / 448
    k8 = (k16 / k_scale).to(torch.float8_e4m3fn)
    v8 = (v16 / v_scale).to(torch.float8_e4m3fn)

    def ours(
        kc: torch.Tensor, vc: torch.Tensor, ks: float, vs: float, check: bool = True, block_n: int = 32
    ) -> torch.Tensor:
        return paged_decode_gqa(
            q, kc, vc, ks, vs, seq_lens, page_table, expected, page_tags, flags, scale,
            check_tags=check, block_n=block_n,
        )  # fmt: skip

    order = page_table.long()  # [B, pages] each sequence's pages in token order

    def reference(b: int, kc: torch.Tensor, vc: torch.Tensor, ks: float, vs: float) -> torch.Tensor:
        """fp32 softmax attention of sequence b over its gathered tokens: [Hq, D]."""
        k = kc[order[b]].float().reshape(ctx, HKV, D).repeat_interleave(HQ // HKV, dim=1) * ks  # [L, Hq, D]
        v = vc[order[b]].float().reshape(ctx, HKV, D).repeat_interleave(HQ // HKV, dim=1) * vs
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k) * scale, dim=-1)
        return torch.einsum("hl,lhd->hd", p, v)

    checked = range(min(B, 3))
    out16, out8 = ours(k16, v16, 1.0, 1.0), ours(k8, v8, k_scale, v_scale)
    err16 = max(rel_err(out16[b].float(), reference(b, k16, v16, 1.0, 1.0)) for b in checked)
    err8 = max(rel_err(out8[b].float(), reference(b, k8, v8, k_scale, v_scale)) for b in checked)
    assert not flags.any(), "no page was reallocated: no sequence may be flagged"
    t16 = graph_ms([lambda: ours(k16, v16, 1.0, 1.0)])
    t8 = graph_ms([lambda: ours(k8, v8, k_scale, v_scale)])
    variants = {
        "bf16 block_n=64": graph_ms([lambda: ours(k16, v16, 1.0, 1.0, block_n=64)]),
        "fp8 block_n=64": graph_ms([lambda: ours(k8, v8, k_scale, v_scale, block_n=64)]),
        "fp8 block_n=128": graph_ms([lambda: ours(k8, v8, k_scale, v_scale, block_n=128)]),
    }
    peers: dict[str, float] = {}
    try:  # the peer: flash attention over contiguous [B, Hkv, L, D] BF16 copies
        kc = k16[order].reshape(B, ctx, HKV, D).transpose(1, 2).contiguous()
        vc = v16[order].reshape(B, ctx, HKV, D).transpose(1, 2).contiguous()
        qs = q[:, :, None, :]  # [B, Hq, 1, D]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            peers["sdpa_flash_bf16_contiguous"] = graph_ms(
                [lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)]
            )
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        print("sdpa peer failed:", repr(exc)[:300], flush=True)
    kv_elems = B * ctx * HKV * 2 * D
    rows = []
    for kv, ms, err, nbytes in (("bf16", t16, err16, 2 * kv_elems), ("fp8", t8, err8, kv_elems)):
        rows.append(
            {
                "kernel": "paged-decode-gqa",
                "case": f"kv={kv} batch={B} context={ctx} heads={HQ}/{HKV} d={D} page={PAGE}",
                "goal": "attention-fp8" if kv == "fp8" and B == 64 else None,
                "ms": ms,
                "fraction_of_ceiling": nbytes / ms / 1e6 / ceil["copy_GBps"],
                "GBps": nbytes / ms / 1e6,
                "peers": {**peers, **({"ours_bf16_kv": t16} if kv == "fp8" else {})},
                "rel_err": err,
                "variants": {k: v for k, v in variants.items() if k.startswith(kv)},
                "ok": err < (1e-2 if kv == "bf16" else 2e-2),
            }
        )
    rows.append(
        tag_check_row(
            f"kv=fp8 batch={B} context={ctx} heads={HQ}/{HKV} d={D} page={PAGE}",
            lambda: ours(k8, v8, k_scale, v_scale, True),
            lambda: ours(k8, v8, k_scale, v_scale, False),
            AB_PAIRS,
        )
    )
    for r in rows:
        extra = overhead_text(r) if "overhead" in r else \
            f"{r['GBps']:.0f} GB/s frac {r['fraction_of_ceiling']:.2f} err {r['rel_err']:.1e}"  # fmt: skip
        print(f"{r['kernel']:<17} {r['case']:<52} {r['ms'] * 1e3:9.1f}us {extra} | "
              + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items()), flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    run_cases(bench_case, CASES, "KV caches are GBs (>> L2): one call per graph replay")
