"""Paged MLA decode on the GPU: BF16 vs FP8 latent, the tag check on vs off, dense vs DSA sparse, peers.

Shapes are Kimi K2's attention (64 heads, 512 + 64 latent, page 16; GLM-5 is the same with 2048
top-k tokens in sparse mode), and its tensor-parallel shards (16 heads at TP4, 8 at TP8: the latent
is replicated, so each rank reads all of it for fewer heads). Pages are handed out shuffled, as a
long-running pool would. Achieved bandwidth counts the latent bytes read (576 B/token FP8, 1152 BF16)
against the device-to-device copy ceiling measured in the same run; TFLOP/s counts 2·(576 + 512)
FLOPs per head and token, because at 64 heads MLA decode is near the tensor-core limit rather than
HBM (242 FLOP per FP8 byte: 4.27 TB/s would need ~1,030 TFLOP/s of 16-bit MMA).

Peer: what a user would write without a paged kernel — the absorbed MQA as two batched matmuls
(cuBLAS) and a softmax over a contiguous BF16 copy of each sequence's latent. The reference op
(`mla_decode_ref`) checks correctness on the first sequences of each case (fp32, gathered tokens).
The first case sweeps tile configs (block_h / block_n / warps) per KV dtype; later cases use the best.
The tag check's cost is interleaved A/B pairs of the same kernel compiled with and without it.
Prefill rows (`mla-prefill`): a chunk after a cached prefix through the same kernel with tiles of
several queries, in causal TFLOP/s against the bf16 GEMM ceiling; the peer is the same two-bmm
formulation with a causal mask over a contiguous copy.

    python3 -m benchmarks.kernels.bench_mla_decode [--out results.json] [--no-sweep] [--parts decode]
    (JSON to $OUT/mla_decode.json when --out is not given and OUT is set)
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import torch

from benchmarks.kernels.common import (
    bench_ms,
    graph_ms,
    measure_ceilings,
    overhead_text,
    rel_err,
    tag_check_row,
    write_record,
)
from kernels.mla_decode import mla_decode, mla_decode_ref
from kernels.mla_prefill import mla_attention_ref, mla_prefill

R, DR, PAGE = 512, 64, 16
SOFTMAX_SCALE = 0.1447  # (128 + 64)^-0.5 · mscale² for YaRN factor 64 (engine-anchors §1d)
# heads, batch, context, top-k (None = dense)
CASES = [
    (64, 64, 32768, None),  # the sweep case
    (64, 64, 8192, None),
    (64, 64, 131072, None),
    (64, 8, 32768, None),
    (16, 64, 32768, None),  # TP4 shard
    (8, 64, 32768, None),  # TP8 shard
    (64, 64, 32768, 2048),  # GLM-5 DSA sparse
]
SWEEP = [  # block_h, block_n, num_warps, num_stages, masked_loads
    (32, 16, 8, 2, False),  # the bf16 default
    (32, 32, 8, 2, False),  # the fp8 default
    (32, 32, 8, 2, True),
    (16, 16, 4, 2, False),
    (16, 32, 4, 2, False),
    (16, 32, 4, 2, True),
    (64, 16, 8, 2, False),
    (32, 16, 8, 3, False),
]
AB_PAIRS = 7
AB_CASES = {(64, 64, 32768, None), (8, 64, 32768, None), (64, 64, 32768, 2048)}  # tag check on vs off
FP8 = torch.float8_e4m3fn


def make_case(H: int, B: int, ctx: int, topk: int | None) -> dict[str, Any]:
    dev = "cuda"
    pages_per = ctx // PAGE
    P = B * pages_per
    lines = torch.randn(P, PAGE, R + DR, device=dev, dtype=torch.bfloat16)
    scale = float(lines.abs().amax()) / 448
    page_table = torch.randperm(P, device=dev).to(torch.int32).reshape(B, pages_per)
    page_tags = torch.randint(0, 2**40, (P,), device=dev)
    case = dict(
        q=torch.randn(B, H, R + DR, device=dev, dtype=torch.bfloat16),
        bf16=lines, fp8=(lines / scale).to(FP8), scale=scale,
        seq_lens=torch.full((B,), ctx, dtype=torch.int32, device=dev), page_table=page_table,
        expected_tags=page_tags[page_table.long()], page_tags=page_tags,
        flags=torch.zeros(B, dtype=torch.bool, device=dev), topk=None,
    )  # fmt: skip
    if topk is not None:
        case["topk"] = torch.stack([torch.randperm(ctx, device=dev)[:topk] for _ in range(B)])
    return case


def run(
    case: dict[str, Any], kv: str, check: bool = True, cfg: tuple[int, ...] | None = None
) -> torch.Tensor:
    kw: dict[str, Any] = {}
    if cfg is not None:
        kw = dict(block_h=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3], masked_loads=cfg[4])
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    return mla_decode(
        case["q"], cache, scale, R, case["seq_lens"], case["page_table"], case["expected_tags"],
        case["page_tags"], case["flags"], SOFTMAX_SCALE, case["topk"], check_tags=check, **kw,
    )  # fmt: skip


def check_error(case: dict[str, Any], kv: str, out: torch.Tensor, num: int = 2) -> float:
    """Relative error of the first `num` sequences against the reference op (fp32, gathered)."""
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    flags = torch.zeros(num, dtype=torch.bool, device="cuda")
    ref = mla_decode_ref(
        case["q"][:num].float(), cache, scale, R, case["seq_lens"][:num], case["page_table"][:num],
        case["expected_tags"][:num], case["page_tags"], flags, SOFTMAX_SCALE,
        None if case["topk"] is None else case["topk"][:num],
    )  # fmt: skip
    assert not flags.any()
    return rel_err(out[:num].float(), ref)


def peer_ms(case: dict[str, Any]) -> float | None:
    """Two cuBLAS bmm and a softmax over a contiguous BF16 copy: [B, L, 576]."""
    B, ctx = case["page_table"].shape[0], int(case["seq_lens"][0])
    if case["topk"] is not None:
        return None
    try:
        kv = case["bf16"][case["page_table"].long()].reshape(B, ctx, R + DR)
        q = case["q"]

        def peer() -> torch.Tensor:
            s = torch.bmm(q, kv.transpose(1, 2)).float() * SOFTMAX_SCALE  # [B, H, L]
            return torch.bmm(torch.softmax(s, dim=-1).to(kv.dtype), kv[:, :, :R])

        return graph_ms([peer])
    except torch.OutOfMemoryError as exc:
        print("peer out of memory:", repr(exc)[:200], flush=True)
        return None


def bench_case(
    H: int, B: int, ctx: int, topk: int | None, ceil: dict[str, float], best: dict, sweep: list[tuple]
) -> list[dict]:
    case = make_case(H, B, ctx, topk)
    tokens_read = B * (topk or ctx)
    name = f"batch={B} context={ctx} heads={H} d=512+64 page={PAGE}" + (f" topk={topk}" if topk else "")
    peer = peer_ms(case)
    ref_ms = None
    if B == 8:  # the reference op itself, once (host loops: not graph-capturable)
        ref_ms = bench_ms(
            lambda: mla_decode_ref(
                case["q"],
                case["fp8"],
                case["scale"],
                R,
                case["seq_lens"],
                case["page_table"],
                case["expected_tags"],
                case["page_tags"],
                case["flags"],
                SOFTMAX_SCALE,
            ),  # fmt: skip
            warmup_ms=5,
            rep_ms=50,
        )
    rows: list[dict[str, Any]] = []
    times: dict[str, float] = {}
    for kv in ("bf16", "fp8"):
        variants: dict[tuple[int, ...], float] = {}
        if kv not in best:  # first case: sweep the tile configs
            for cfg in sweep:
                try:
                    variants[cfg] = graph_ms([functools.partial(run, case, kv, cfg=cfg)])
                except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                    print(f"config {cfg} failed: {repr(exc)[:200]}", flush=True)
            best[kv] = min(variants, key=variants.__getitem__)
        cfg = best[kv]
        out = run(case, kv, cfg=cfg)
        err = check_error(case, kv, out)
        assert not case["flags"].any(), "no page was reallocated: no sequence may be flagged"
        ms = graph_ms([functools.partial(run, case, kv, cfg=cfg)])
        times[kv] = ms
        nbytes = tokens_read * (R + DR) * (1 if kv == "fp8" else 2)
        peers = {"torch_bmm_bf16_contiguous": peer} if peer is not None else {}
        if kv == "fp8":
            peers["ours_bf16_kv"] = times["bf16"]
            if ref_ms is not None:
                peers["reference_op"] = ref_ms
        rows.append(
            {
                "kernel": "mla-decode" + ("-sparse" if topk else ""),
                "case": f"kv={kv} {name}",
                "goal": "attention-fp8" if kv == "fp8" and B == 64 and not topk and H == 64 else None,
                "ms": ms,
                "fraction_of_ceiling": nbytes / ms / 1e6 / ceil["copy_GBps"],
                "GBps": nbytes / ms / 1e6,
                "TFLOPs": tokens_read * H * 2 * (R + DR + R) / ms / 1e9,
                "peers": peers,
                "config": dict(
                    zip(("block_h", "block_n", "num_warps", "num_stages", "masked_loads"), cfg, strict=True)
                ),
                "variants": {str(k): v for k, v in variants.items()},
                "rel_err": err,
                "ok": err < 1e-2,
            }
        )
    if (H, B, ctx, topk) in AB_CASES:
        label = f"mla-decode{'-sparse' if topk else ''} kv=fp8 {name}"
        on, off = (
            (lambda: run(case, "fp8", True, best["fp8"])),
            (lambda: run(case, "fp8", False, best["fp8"])),
        )
        rows.append(tag_check_row(label, on, off, AB_PAIRS))  # interleaved A/B pairs
    for r in rows:
        if "overhead" in r:
            extra = overhead_text(r)
        else:
            extra = (
                f"{r['GBps']:.0f} GB/s frac {r['fraction_of_ceiling']:.2f} {r['TFLOPs']:.0f} TFLOP/s "
                f"err {r['rel_err']:.1e} cfg {tuple(r['config'].values())}"
            )
        peer_text = " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items())
        print(f"{r['kernel']:<17} {r['case']:<66} {r['ms'] * 1e3:9.1f}us {extra} | {peer_text}", flush=True)
    return rows


PREFILL_CASES = [(64, 8192, 4096), (64, 0, 4096), (8, 8192, 4096)]  # heads, cached tokens, new tokens
PREFILL_SWEEP = [  # block_q, block_h, block_n, num_warps, masked_loads
    (2, 16, 32, 8, False),  # the default for 64 heads
    (2, 16, 32, 8, True),
    (4, 16, 16, 8, False),
    (1, 32, 32, 8, False),
    (4, 8, 32, 8, False),
    (4, 16, 32, 8, False),
]


def bench_prefill(H: int, cached: int, new: int, ceil: dict[str, float], sweep: list[tuple]) -> list[dict]:
    """One sequence: `new` queries after `cached` tokens, all in the paged cache."""
    dev, L = "cuda", cached + new
    case = make_case(H, 1, L, None)
    q = torch.randn(new, H, R + DR, device=dev, dtype=torch.bfloat16)
    qs = torch.tensor([0, new], dtype=torch.int32, device=dev)
    flops = H * 2 * (R + DR + R) * (new * cached + new * (new + 1) // 2)  # causal
    name = f"heads={H} cached={cached} new={new} d=512+64 page={PAGE}"

    def ours(kv: str, cfg: tuple[int, ...]) -> torch.Tensor:
        cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
        return mla_prefill(
            q, cache, scale, R, qs, case["seq_lens"], case["page_table"], case["expected_tags"],
            case["page_tags"], case["flags"], SOFTMAX_SCALE,
            block_q=cfg[0], block_h=cfg[1], block_n=cfg[2], num_warps=cfg[3], masked_loads=bool(cfg[4]),
        )  # fmt: skip

    kv_all = case["bf16"][case["page_table"][0].long()].reshape(L, R + DR)
    causal = torch.arange(L, device=dev)[None, :] <= torch.arange(cached, L, device=dev)[:, None]  # [new, L]

    def peer() -> torch.Tensor:
        s = torch.einsum("qhc,lc->hql", q, kv_all).float() * SOFTMAX_SCALE
        p = torch.softmax(s.masked_fill(~causal[None], float("-inf")), dim=-1).to(kv_all.dtype)
        return torch.einsum("hql,lr->qhr", p, kv_all[:, :R])

    peers = {}
    try:
        peers["torch_einsum_bf16_contiguous"] = graph_ms([peer])
    except torch.OutOfMemoryError as exc:
        print("prefill peer out of memory:", repr(exc)[:200], flush=True)
    rows: list[dict[str, Any]] = []
    for kv in ("bf16", "fp8"):
        variants: dict[tuple[int, ...], float] = {}
        for cfg in sweep:
            try:
                variants[cfg] = graph_ms([functools.partial(ours, kv, cfg)])
            except Exception as exc:  # reported, not fatal
                print(f"prefill config {cfg} failed: {repr(exc)[:200]}", flush=True)
        cfg = min(variants, key=variants.__getitem__)
        out = ours(kv, cfg)
        cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
        num_checked = min(64, new)
        rows_checked = slice(new - num_checked, new)  # the last queries see the whole context
        flags = torch.zeros(1, dtype=torch.bool, device=dev)
        ref = mla_attention_ref(
            q[rows_checked].float(), cache, scale, R, torch.tensor([0, num_checked], dtype=torch.int32, device=dev),
            case["seq_lens"], case["page_table"], case["expected_tags"], case["page_tags"], flags, SOFTMAX_SCALE,
        )  # fmt: skip
        err = rel_err(out[rows_checked].float(), ref)
        ms = variants[cfg]
        rows.append(
            {
                "kernel": "mla-prefill",
                "case": f"kv={kv} {name}",
                "goal": None,
                "ms": ms,
                "fraction_of_ceiling": flops / ms / 1e9 / ceil["bf16_TFLOPs"],
                "TFLOPs": flops / ms / 1e9,
                "peers": peers,
                "config": dict(
                    zip(("block_q", "block_h", "block_n", "num_warps", "masked_loads"), cfg, strict=True)
                ),
                "variants": {str(k): v for k, v in variants.items()},
                "rel_err": err,
                "ok": err < 1e-2 and not bool(case["flags"].any()),
            }
        )
        print(
            f"mla-prefill kv={kv} {name:<48} {ms * 1e3:9.1f}us {flops / ms / 1e9:.0f} TFLOP/s err {err:.1e} "
            f"cfg {cfg} | " + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in peers.items()),
            flush=True,
        )
    return rows


NOTES = "latent caches are GBs (>> L2): one call per graph replay"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/mla_decode.json when OUT is set)")
    ap.add_argument(
        "--no-sweep", action="store_true", help="only the first (default) tile config of each sweep"
    )
    ap.add_argument("--parts", default="decode,prefill", help="comma-separated: decode, prefill")
    args = ap.parse_args()
    sweep, prefill_sweep = (SWEEP[:1], PREFILL_SWEEP[:1]) if args.no_sweep else (SWEEP, PREFILL_SWEEP)
    parts = set(args.parts.split(","))
    out = args.out or (os.path.join(os.environ["OUT"], "mla_decode.json") if os.environ.get("OUT") else None)
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    rows: list[dict] = []
    best: dict[str, tuple[int, ...]] = {}
    for H, B, ctx, topk in CASES if "decode" in parts else []:
        rows += bench_case(H, B, ctx, topk, ceil, best, sweep)
        torch.cuda.empty_cache()
        if out:  # after every case: a timeout keeps what ran
            write_record(out, rows, ceil, {"notes": NOTES})
    for H, cached, new in PREFILL_CASES if "prefill" in parts else []:
        rows += bench_prefill(H, cached, new, ceil, prefill_sweep)
        torch.cuda.empty_cache()
        if out:
            write_record(out, rows, ceil, {"notes": NOTES})


if __name__ == "__main__":
    main()
