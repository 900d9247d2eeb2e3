"""Paged GQA prefill attention on the GPU: BF16 vs FP8 KV, tile variants, the tag check on vs off, and
flash SDPA over a contiguous BF16 copy as the peer.

Shapes are GLM-4.5-Air's attention (96 query heads, 8 KV heads, head dim 128), page size 16, pages
handed out in a shuffled order. Cases: whole prompts from scratch, a chunk after a long cached
prefix, and a mixed step (one chunk plus 63 decode rows). FLOPs count the causal work only
(`4 · Hq · D` per visible (query, token) pair); `fraction_of_ceiling` is against the bf16 GEMM
ceiling measured in the same run. Correctness: the last 32 queries of the first sequence against an
fp32 softmax over its gathered tokens. The tag check's cost: interleaved A/B pairs.

    python3 -m benchmarks.kernels.bench_paged_prefill --out results.json
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmarks.kernels.common import bench_ms, graph_ms, overhead_text, rel_err, run_cases, tag_check_row
from kernels.paged_prefill_gqa import paged_prefill_gqa

DEV = "cuda"
HQ, HKV, D, PAGE = 96, 8, 128, 16
# name, per sequence (context incl. the chunk, new tokens)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("prompt 1x8k", [(8192, 8192)]),
    ("prompt 4x4k", [(4096, 4096)] * 4),
    ("chunk 2k after 30k", [(32768, 2048)]),
    ("mixed 2k chunk + 63 decodes at 8k", [(4096, 2048)] + [(8192, 1)] * 63),
]
VARIANTS = {"block_m=64 block_n=64 warps=4": (64, 64, 4), "block_m=64 block_n=64 warps=8": (64, 64, 8),
            "block_m=128 block_n=64 warps=8": (128, 64, 8)}  # fmt: skip
AB_PAIRS = 5


def bench_case(name: str, seqs: list[tuple[int, int]], ceil: dict[str, float]) -> list[dict[str, Any]]:
    dev = DEV
    B = len(seqs)
    pages_per = [-(-L // PAGE) for L, _ in seqs]
    P = sum(pages_per)
    perm = torch.randperm(P, device=dev).to(torch.int32)
    table = torch.zeros(B, max(pages_per), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n]
        used += n
    k16 = torch.randn(P, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v16 = torch.randn(P, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    page_tags = torch.randint(0, 2**40, (P,), device=dev)
    expected = page_tags[table.long()]
    seq_lens = torch.tensor([L for L, _ in seqs], dtype=torch.int32, device=dev)
    num_q = [n for _, n in seqs]
    query_start = torch.tensor([0, *torch.tensor(num_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    T = sum(num_q)
    flags = torch.zeros(B, dtype=torch.bool, device=dev)
    q = torch.randn(T, HQ, D, device=dev, dtype=torch.bfloat16)
    scale = D**-0.5
    k_scale, v_scale = float(k16.abs().amax()) / 448, float(v16.abs().amax()) / 448
    k8, v8 = (k16 / k_scale).to(torch.float8_e4m3fn), (v16 / v_scale).to(torch.float8_e4m3fn)
    caches = {"bf16": (k16, v16, 1.0, 1.0), "fp8": (k8, v8, k_scale, v_scale)}

    def ours(kv: str, check: bool = True, **kw: Any) -> torch.Tensor:
        kc, vc, ks, vs = caches[kv]
        return paged_prefill_gqa(
            q, kc, vc, ks, vs, query_start, seq_lens, table, expected, page_tags, flags, scale,
            check_tags=check, **kw,
        )  # fmt: skip

    def reference(out: torch.Tensor, kv: str) -> float:
        """fp32 softmax attention of the first sequence's last 32 queries over its gathered tokens."""
        kc, vc, ks, vs = caches[kv]
        L, n = seqs[0]
        pages = table[0, : pages_per[0]].long()
        k = (kc[pages].float().reshape(-1, HKV, D)[:L] * ks).repeat_interleave(HQ // HKV, dim=1)  # [L, Hq, D]
        v = (vc[pages].float().reshape(-1, HKV, D)[:L] * vs).repeat_interleave(HQ // HKV, dim=1)
        rows = range(max(0, n - 32), n)
        pos = torch.tensor([L - n + i for i in rows], device=dev)
        s = torch.einsum("qhd,lhd->hql", q[list(rows)].float(), k) * scale
        s = s.masked_fill(torch.arange(L, device=dev)[None, None, :] > pos[None, :, None], float("-inf"))
        want = torch.einsum("hql,lhd->qhd", torch.softmax(s, dim=-1), v)
        return rel_err(out[list(rows)].float(), want)

    flops = sum(4 * HQ * D * (n * (L - n) + n * (n + 1) // 2) for L, n in seqs)
    peers: dict[str, float] = {}
    try:  # the peer: flash attention per sequence over contiguous [1, Hkv, L, D] BF16 copies
        order = [table[b, : pages_per[b]].long() for b in range(B)]
        kc = [
            k16[o].reshape(-1, HKV, D)[:L].transpose(0, 1)[None].contiguous()
            for o, (L, _) in zip(order, seqs, strict=True)
        ]
        vc = [
            v16[o].reshape(-1, HKV, D)[:L].transpose(0, 1)[None].contiguous()
            for o, (L, _) in zip(order, seqs, strict=True)
        ]
        qs = [
            q[s0 : s0 + n].transpose(0, 1)[None]
            for s0, n in zip(query_start.tolist()[:-1], num_q, strict=True)
        ]
        masks = [causal_lower_right(n, L) for L, n in seqs]

        def sdpa() -> None:
            for qi, ki, vi, mask in zip(qs, kc, vc, masks, strict=True):
                F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            peers["sdpa_bf16_contiguous_per_seq"] = bench_ms(sdpa)  # not captured: the bias may not be
    except (RuntimeError, torch.OutOfMemoryError, TypeError) as exc:
        print("sdpa peer failed:", repr(exc)[:300], flush=True)
    rows = []
    times = {}
    for kv in ("bf16", "fp8"):
        out = ours(kv)
        err = reference(out, kv)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        times[kv] = graph_ms([lambda kv=kv: ours(kv)])
        variants = {}
        for vname, (bm, bn, w) in VARIANTS.items():
            try:
                variants[vname] = graph_ms(
                    [lambda kv=kv, bm=bm, bn=bn, w=w: ours(kv, block_m=bm, block_n=bn, num_warps=w)]
                )
            except Exception as exc:  # noqa: BLE001 (a variant that does not compile is reported, not fatal)
                print(f"{name} {kv} {vname} failed: {repr(exc)[:200]}", flush=True)
        rows.append(
            {
                "kernel": "paged-prefill-gqa",
                "case": f"kv={kv} {name} batch={B} context={max(L for L, _ in seqs)} tokens={T} "
                f"heads={HQ}/{HKV} d={D} page={PAGE}",
                "goal": None,
                "ms": times[kv],
                "fraction_of_ceiling": flops / times[kv] / 1e9 / ceil["bf16_TFLOPs"],
                "TFLOPs": flops / times[kv] / 1e9,
                "peers": {**peers, **({"ours_bf16_kv": times["bf16"]} if kv == "fp8" else {})},
                "rel_err": err,
                "variants": variants,
                "ok": err < (1e-2 if kv == "bf16" else 3e-2),
            }
        )
    rows.append(
        tag_check_row(
            f"paged-prefill-gqa kv=fp8 {name} batch={B} heads={HQ}/{HKV} d={D} page={PAGE}",
            lambda: ours("fp8", True),
            lambda: ours("fp8", False),
            AB_PAIRS,
        )
    )
    for r in rows:
        extra = overhead_text(r) if "overhead" in r else \
            f"{r['TFLOPs']:.0f} TFLOP/s frac {r['fraction_of_ceiling']:.2f} err {r['rel_err']:.1e} ok {r['ok']}"  # fmt: skip
        print(f"{r['kernel']:<18} {r['case']:<80} {r['ms'] * 1e3:9.1f}us {extra} | "
              + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items())
              + "".join(f" | {k} {v * 1e3:.1f}us" for k, v in r.get("variants", {}).items()), flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    run_cases(bench_case, CASES, "prefill is compute-bound: fraction_of_ceiling is of bf16 TFLOP/s")
