"""Paged decode GQA attention on the GPU: every DECODE_TILES entry for BF16 and FP8 KV, the tag check on
vs off, and SDPA as the peer.

Shapes are GLM-4.5-Air's attention (96 query heads, 8 KV heads, head dim 128), page size 16, pages
handed out in a shuffled order as a long-running pool would. The peer is
flash `F.scaled_dot_product_attention` over a contiguous BF16 copy of the same K/V (`enable_gqa`).
Each row's `ms` is the launcher's default entry (`DEFAULT_TILES`); `variants` times every entry of that
cache dtype and `errors` gives each one's error on the first sequences against an fp32 softmax over
their gathered tokens. The tag check's cost: interleaved A/B pairs of the same entry with the check
compiled in and out, for the default entries (`--tag-check`: those rows alone).

    python3 -m benchmarks.kernels.bench_paged_decode --out results.json [--quick | --tag-check [--pairs N]]
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.kernels.common import (
    graph_ms,
    overhead_text,
    rel_err,
    run_cases,
    tag_check_rows,
    time_entries,
)
from kernels.paged_decode_gqa import DECODE_TILES, DEFAULT_TILES, paged_decode_gqa

DEV = "cuda"
HQ, HKV, D, PAGE = 96, 8, 128, 16
CASES = [(64, 8192), (64, 32768), (64, 131072), (8, 32768)]  # batch, context
QUICK_CASES = [(64, 8192), (64, 131072)]
AB_PAIRS = 7
TAG_CHECK_CASES = QUICK_CASES  # the cases of kernels-h200.json's tag-check rows


def bench_case(
    B: int, ctx: int, ceil: dict[str, float], quick: bool = False, tag_check_pairs: int = 0
) -> list[dict[str, Any]]:
    """The case's rows; with `tag_check_pairs`, only its tag-check rows (that many A/B pairs each)."""
    dev, rep_ms = DEV, 50 if quick else 100
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
    caches = {
        "bf16": (k16, v16, 1.0, 1.0),
        "fp8": (
            (k16 / k_scale).to(torch.float8_e4m3fn),
            (v16 / v_scale).to(torch.float8_e4m3fn),
            k_scale,
            v_scale,
        ),
    }

    def ours(kv: str, tiles: str, check: bool = True) -> torch.Tensor:
        kc, vc, ks, vs = caches[kv]
        return paged_decode_gqa(
            q, kc, vc, ks, vs, seq_lens, page_table, expected, page_tags, flags, scale, check_tags=check, tiles=tiles
        )  # fmt: skip

    ops = {
        f"kv={kv} tiles={name} batch={B} context={ctx} heads={HQ}/{HKV} d={D} page={PAGE}": partial(
            ours, kv, name
        )
        for kv, name in [("fp8", DEFAULT_TILES["fp8"]), ("bf16", DEFAULT_TILES["bf16"])]
    }
    if tag_check_pairs:
        rows = tag_check_rows(ops, tag_check_pairs, rep_ms)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        print_rows(rows)
        return rows
    order = page_table.long()  # [B, pages] each sequence's pages in token order

    def reference(kv: str, b: int) -> torch.Tensor:
        """fp32 softmax attention of sequence b over its gathered tokens: [Hq, D]."""
        kc, vc, ks, vs = caches[kv]
        k = kc[order[b]].float().reshape(ctx, HKV, D) * ks  # [L, Hkv, D]
        v = vc[order[b]].float().reshape(ctx, HKV, D) * vs
        s = torch.einsum("hgd,lhd->hgl", q[b].float().view(HKV, HQ // HKV, D), k) * scale  # [Hkv, G, L]
        return torch.einsum("hgl,lhd->hgd", torch.softmax(s, dim=-1), v).reshape(HQ, D)

    refs = {kv: [reference(kv, b) for b in range(min(B, 2))] for kv in caches}

    def error(out: torch.Tensor, kv: str) -> float:
        """The worst relative error of the first sequences' outputs."""
        return max(rel_err(out[b].float(), ref) for b, ref in enumerate(refs[kv]))

    def flash_peer() -> float:
        """Flash attention over contiguous [B, Hkv, L, D] BF16 copies (freed on return)."""
        kc = k16[order].reshape(B, ctx, HKV, D).transpose(1, 2).contiguous()
        vc = v16[order].reshape(B, ctx, HKV, D).transpose(1, 2).contiguous()
        qs = q[:, :, None, :]  # [B, Hq, 1, D]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return graph_ms(
                [lambda: F.scaled_dot_product_attention(qs, kc, vc, scale=scale, enable_gqa=True)], rep_ms
            )

    peers: dict[str, float] = {}
    try:
        peers["sdpa_flash_bf16_contiguous"] = flash_peer()
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        print("sdpa peer failed:", repr(exc)[:300], flush=True)
    kv_elems = B * ctx * HKV * 2 * D
    rows, times = [], {}
    for kv, nbytes in (("bf16", 2 * kv_elems), ("fp8", kv_elems)):
        names = [n for n in DECODE_TILES if n.startswith(kv + "/")]
        variants, errors, failed = time_entries(names, partial(ours, kv), partial(error, kv=kv), rep_ms)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        times[kv] = ms = variants.get(DEFAULT_TILES[kv], float("nan"))
        rows.append(
            {
                "kernel": "paged-decode-gqa",
                "case": f"kv={kv} batch={B} context={ctx} heads={HQ}/{HKV} d={D} page={PAGE}",
                "goal": "attention-fp8" if kv == "fp8" and B == 64 else None,
                "tiles": DEFAULT_TILES[kv],
                "ms": ms,
                "fraction_of_ceiling": nbytes / ms / 1e6 / ceil["copy_GBps"],
                "GBps": nbytes / ms / 1e6,
                "peers": {**peers, **({"ours_bf16_kv": times["bf16"]} if kv == "fp8" else {})},
                "variants": variants,
                "variant_fractions": {n: nbytes / t / 1e6 / ceil["copy_GBps"] for n, t in variants.items()},
                "errors": errors,
                "failed": failed,
                "rel_err": errors.get(DEFAULT_TILES[kv], float("nan")),
                "ok": not failed and max(errors.values()) < (1e-2 if kv == "bf16" else 2e-2),
            }
        )
    rows += tag_check_rows(ops, 5 if quick else AB_PAIRS, rep_ms)
    print_rows(rows)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "overhead" in r:
            print(f"{r['kernel']:<17} {r['case']:<72} {r['ms'] * 1e3:9.1f}us {overhead_text(r)}", flush=True)
            continue
        print(f"{r['kernel']:<17} {r['case']:<52} {r['ms'] * 1e3:9.1f}us frac {r['fraction_of_ceiling']:.2f} "
              f"ok {r['ok']} | " + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items()), flush=True)  # fmt: skip
        for name, t in r["variants"].items():
            print(f"{'':<19}{name:<16} {t * 1e3:9.1f}us frac {r['variant_fractions'][name]:.2f} "
                  f"err {r['errors'][name]:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    run_cases(
        bench_case,
        CASES,
        "KV caches are GBs (>> L2): one call per graph replay",
        QUICK_CASES,
        TAG_CHECK_CASES,
    )
