"""Paged GQA prefill attention on the GPU: every PREFILL_TILES entry for BF16 and FP8 KV, the tag check
on vs off, and flash SDPA over a contiguous BF16 copy as the peer.

Shapes are GLM-4.5-Air's attention (96 query heads, 8 KV heads, head dim 128), page size 16, pages
handed out in a shuffled order. Cases: whole prompts from scratch, a chunk after a long cached
prefix, and a mixed step (one chunk plus 63 decode rows). FLOPs count the causal work only
(`4 · Hq · D` per visible (query, token) pair); `fraction_of_ceiling` is against the bf16 GEMM
ceiling measured in the same run. Each row's `ms` is the default entry's (`DEFAULT_TILES`), `variants`
the others' (`--quick`: the entries in QUICK_TILES). Correctness: the last 32 queries of the
first sequence against an fp32 softmax over its gathered tokens, for every entry timed. The tag
check's cost: interleaved A/B pairs of the default entries (`--tag-check`: those rows alone, with
`bf16/v4` too, the BF16 default the 2026-12-01 +5.3% row timed).

    python3 -m benchmarks.kernels.bench_paged_prefill --out results.json [--quick | --tag-check [--pairs N]]
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmarks.kernels.common import (
    bench_ms,
    overhead_text,
    rel_err,
    run_cases,
    tag_check_rows,
    time_entries,
)
from kernels.paged_prefill_gqa import DEFAULT_TILES, PREFILL_TILES, paged_prefill_gqa

DEV = "cuda"
HQ, HKV, D, PAGE = 96, 8, 128, 16
# name, per sequence (context incl. the chunk, new tokens)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("prompt 1x8k", [(8192, 8192)]),
    ("prompt 4x4k", [(4096, 4096)] * 4),
    ("chunk 2k after 30k", [(32768, 2048)]),
    ("mixed 2k chunk + 63 decodes at 8k", [(4096, 2048)] + [(8192, 1)] * 63),
]
QUICK_CASES = [CASES[0], CASES[2]]  # one compile of each entry serves both (same specialisation)
QUICK_TILES = ["bf16/v4", "bf16/v4-m64", "fp8/v4"]  # the quick run's entries
AB_PAIRS = 5
TAG_CHECK_CASES = QUICK_CASES  # the cases of kernels-h200.json's tag-check rows
# entries --tag-check times beside the defaults: bf16/v4, the BF16 default of the 2026-12-01 runs (the
# +5.3% row); bf16/v4-m64 has been the default since
TAG_CHECK_EXTRA = [("bf16", "bf16/v4")]


def bench_case(
    name: str,
    seqs: list[tuple[int, int]],
    ceil: dict[str, float],
    quick: bool = False,
    tag_check_pairs: int = 0,
) -> list[dict[str, Any]]:
    """The case's rows; with `tag_check_pairs`, only its tag-check rows (that many A/B pairs each)."""
    dev, rep_ms = DEV, 50 if quick else 100
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

    def ours(kv: str, tiles: str, check: bool = True) -> torch.Tensor:
        kc, vc, ks, vs = caches[kv]
        return paged_prefill_gqa(
            q, kc, vc, ks, vs, query_start, seq_lens, table, expected, page_tags, flags, scale,
            check_tags=check, tiles=tiles,
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
    ab = [("fp8", DEFAULT_TILES["fp8"]), ("bf16", DEFAULT_TILES["bf16"])]
    ab += [e for e in TAG_CHECK_EXTRA if tag_check_pairs and e not in ab]
    ops = {
        f"paged-prefill-gqa kv={kv} tiles={t} {name} batch={B} heads={HQ}/{HKV} d={D} page={PAGE}": partial(
            ours, kv, t
        )
        for kv, t in ab
    }
    if tag_check_pairs:
        rows = tag_check_rows(ops, tag_check_pairs, rep_ms)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        print_rows(rows, flops)
        return rows
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
    rows: list[dict[str, Any]] = []
    times = {}
    for kv in ("bf16", "fp8"):
        names = [n for n in (QUICK_TILES if quick else PREFILL_TILES) if n.startswith(kv + "/")]
        variants, errors, failed = time_entries(names, partial(ours, kv), partial(reference, kv=kv), rep_ms)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        times[kv] = ms = variants.get(DEFAULT_TILES[kv], float("nan"))
        rows.append(
            {
                "kernel": "paged-prefill-gqa",
                "case": f"kv={kv} {name} batch={B} context={max(L for L, _ in seqs)} tokens={T} "
                f"heads={HQ}/{HKV} d={D} page={PAGE}",
                "goal": None,
                "tiles": DEFAULT_TILES[kv],
                "ms": ms,
                "fraction_of_ceiling": flops / ms / 1e9 / ceil["bf16_TFLOPs"],
                "TFLOPs": flops / ms / 1e9,
                "peers": {**peers, **({"ours_bf16_kv": times["bf16"]} if kv == "fp8" else {})},
                "variants": variants,
                "errors": errors,
                "failed": failed,
                "rel_err": errors.get(DEFAULT_TILES[kv], float("nan")),
                "ok": not failed and max(errors.values()) < (1e-2 if kv == "bf16" else 3e-2),
            }
        )
    rows += tag_check_rows(ops, 3 if quick else AB_PAIRS, rep_ms)
    print_rows(rows, flops)
    return rows


def print_rows(rows: list[dict[str, Any]], flops: int) -> None:
    for r in rows:
        extra = overhead_text(r) if "overhead" in r else \
            f"{r['TFLOPs']:.0f} TFLOP/s frac {r['fraction_of_ceiling']:.2f} ok {r['ok']}"  # fmt: skip
        print(f"{r['kernel']:<18} {r['case']:<80} {r['ms'] * 1e3:9.1f}us {extra} | "
              + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items()), flush=True)  # fmt: skip
        for tiles, t in r.get("variants", {}).items():
            print(
                f"{'':<20}{tiles:<14} {t * 1e3:9.1f}us {flops / t / 1e9:5.0f} TFLOP/s err {r['errors'][tiles]:.1e}"
            )


if __name__ == "__main__":
    run_cases(
        bench_case,
        CASES,
        "prefill is compute-bound: fraction_of_ceiling is of bf16 TFLOP/s",
        QUICK_CASES,
        TAG_CHECK_CASES,
    )
