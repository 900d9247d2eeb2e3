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
The tag check's cost is interleaved A/B pairs of the same kernel compiled with and without it.
Prefill rows (`mla-prefill`): a chunk after a cached prefix through the same kernel with tiles of
several queries, in causal TFLOP/s against the bf16 GEMM ceiling; the peer is the same two-bmm
formulation with a causal mask over a contiguous copy.

`--sweep` (one device call, under ~120 s): every main case with the default tiles and the
`kernels.mla_tiles.VARIANTS` of its table entry (compiled side by side in threads first), a compact
table, and the entries to paste into `kernels.mla_tiles.TILES` (the variant with the lowest geometric
mean of time over default across the entry's cases). Without it: the default tiles on every case.
`--tag-check [--pairs N]`: the tag-check rows of `TAG_CHECK_CASES` alone (sparse first), nothing else.

    python3 -m benchmarks.kernels.bench_mla_decode [--sweep | --tag-check [--pairs N]] [--out results.json]
        [--parts decode,prefill]
    (JSON to $OUT/mla_decode.json when --out is not given and OUT is set)
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.kernels.common import (
    TAG_CHECK_PAIRS,
    bench_ms,
    graph_ms,
    measure_ceilings,
    overhead_text,
    rel_err,
    tag_check_row,
    write_record,
)
from kernels.mla_attention import mla_attention_ref, mla_decode_ref
from kernels.mla_decode import mla_decode
from kernels.mla_prefill import mla_prefill
from kernels.mla_tiles import TILES, VARIANTS, MlaTiles, pick_mla_splits, slice_cost_items, tile_rows
from kernels.split_k_merge import num_sms

R, DR, PAGE = 512, 64, 16
SOFTMAX_SCALE = 0.1447  # (128 + 64)^-0.5 · mscale² for YaRN factor 64 (engine-anchors §1d)
CASES = [  # heads, batch, context, top-k (None = dense)
    (64, 64, 32768, None),
    (64, 64, 8192, None),
    (64, 64, 131072, None),
    (64, 8, 32768, None),
    (16, 64, 32768, None),  # TP4 shard
    (8, 64, 32768, None),  # TP8 shard
    (64, 64, 32768, 2048),  # GLM-5 DSA sparse
]
SWEEP_CASES = [CASES[i] for i in (0, 4, 6, 1, 2, 5)]  # batch 64; first those that compile new tiles
# tag check on vs off; --tag-check times them in this order (GLM-5's sparse mode was +4.6% on 2026-12-01)
TAG_CHECK_CASES = [(64, 64, 32768, 2048), (64, 64, 32768, None), (8, 64, 32768, None)]
AB_CASES = set(TAG_CHECK_CASES)
PREFILL_CASES = [(64, 8192, 4096), (64, 0, 4096), (8, 8192, 4096)]  # heads, cached tokens, new tokens
SWEEP_PREFILL = PREFILL_CASES[:1]
SWEEP_BUDGET_S = 100  # past this, a sweep times only the default tiles
FP8 = torch.float8_e4m3fn
DEV = "cuda"
NOTES = "latent caches are GBs (>> L2): one call per graph replay"


def entry(mode: str, heads: int, kv: str) -> tuple[str, int, bool]:
    """The `TILES` key a case uses (prefill: 64-row tiles)."""
    return (mode, 64 if mode == "prefill" else tile_rows(heads), kv == "fp8")


def label(t: MlaTiles) -> str:
    return t.label()


def case_name(H: int, B: int, ctx: int, topk: int | None) -> str:
    return f"batch={B} context={ctx} heads={H}" + (f" topk={topk}" if topk else "")


def make_case(H: int, B: int, ctx: int, topk: int | None) -> dict[str, Any]:
    dev = DEV
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


def tile_kwargs(
    t: MlaTiles | None, num_tiles: int, heads: int, items: int, line_bytes: int
) -> dict[str, Any]:
    """The launcher's knobs for tiles `t` (None: its defaults), slices as it would pick them for t."""
    if t is None:
        return {}
    splits = pick_mla_splits(
        num_tiles, -(-heads // t.block_h), items, num_sms(torch.device("cuda")), t.ctas_per_sm,
        slice_cost_items(t.block_h, R, line_bytes), t.block_n,
    )  # fmt: skip
    return dict(tiles=t, num_splits=splits)


def run(case: dict[str, Any], kv: str, check: bool = True, tiles: MlaTiles | None = None) -> torch.Tensor:
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    B, H = case["q"].shape[:2]
    items = case["topk"].shape[1] if case["topk"] is not None else case["page_table"].shape[1] * PAGE
    return mla_decode(
        case["q"], cache, scale, R, case["seq_lens"], case["page_table"], case["expected_tags"],
        case["page_tags"], case["flags"], SOFTMAX_SCALE, case["topk"], check_tags=check,
        **tile_kwargs(tiles, B, H, items, cache.shape[2] * cache.element_size()),
    )  # fmt: skip


def reference(case: dict[str, Any], kv: str, num: int = 2) -> torch.Tensor:
    """The reference op (fp32, gathered tokens) on the first `num` sequences: [num, H, R]."""
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    flags = torch.zeros(num, dtype=torch.bool, device="cuda")
    ref = mla_decode_ref(
        case["q"][:num].float(), cache, scale, R, case["seq_lens"][:num], case["page_table"][:num],
        case["expected_tags"][:num], case["page_tags"], flags, SOFTMAX_SCALE,
        None if case["topk"] is None else case["topk"][:num],
    )  # fmt: skip
    assert not flags.any()
    return ref


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


def time_tiles(
    call: Any, variants: list[MlaTiles | None], deadline: float, error: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """`call(tiles)` timed per variant (None = the defaults, always timed), and `error(output)` of each;
    the variants are compiled side by side in threads first (Triton compiles outside the GIL); one
    that fails is reported and left out."""
    todo = [variants[0]] + (variants[1:] if time.monotonic() < deadline else [])
    with ThreadPoolExecutor(len(todo)) as pool:
        warm = {label_of(t): pool.submit(call, t) for t in todo}
    times, errors = {}, {}
    for t in todo:
        try:
            try:
                out = warm[label_of(t)].result()
            except Exception:  # once more on this thread, in case it was the threads
                out = call(t)
            errors[label_of(t)] = error(out)
            times[label_of(t)] = graph_ms([functools.partial(call, t)])
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            # a CompilationError's message is the kernel's source, then the error: print its end
            print(f"tiles {label_of(t)} failed: {type(exc).__name__}: ...{str(exc)[-700:]}", flush=True)
    return times, errors


def label_of(t: MlaTiles | None) -> str:
    return "default" if t is None else label(t)


def print_row(r: dict[str, Any]) -> None:
    if "overhead" in r:
        extra = overhead_text(r)
    else:
        rate = f"{r['GBps']:6.0f} GB/s {r['fraction_of_ceiling']:.2f}" if "GBps" in r else ""
        best = min(r["variants"], key=r["variants"].__getitem__)
        extra = (
            f"{rate} {r['TFLOPs']:4.0f} TFLOP/s err {r['rel_err']:.1e} "
            f"[{r['tiles']}] best {best} {r['variants'][best] * 1e3:.1f}us"
        )
    peer_text = " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items())
    print(f"{r['kernel']:<17} {r['case']:<60} {r['ms'] * 1e3:9.1f}us {extra} | {peer_text}", flush=True)


def bench_case(
    H: int, B: int, ctx: int, topk: int | None, ceil: dict[str, float], sweep: bool, deadline: float
) -> list[dict]:
    case = make_case(H, B, ctx, topk)
    tokens_read = B * (topk or ctx)
    name = case_name(H, B, ctx, topk)
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
        key = entry("sparse" if topk else "decode", H, kv)
        variants: list[MlaTiles | None] = [None, *(VARIANTS.get(key, []) if sweep else [])]
        ref = reference(case, kv)
        measured, errors = time_tiles(
            lambda t, kv=kv: run(case, kv, tiles=t), variants, deadline,  # tiles by name: run's third is `check`
            lambda out, ref=ref: rel_err(out[: ref.shape[0]].float(), ref),
        )  # fmt: skip
        assert not case["flags"].any(), "no page was reallocated: no sequence may be flagged"
        ms = times[kv] = measured["default"]
        err = errors["default"]
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
                "tiles": label(TILES[key]),
                "table_entry": list(key),
                "variants": measured,
                "variant_errors": errors,
                "rel_err": err,
                "ok": err < 1e-2,
            }
        )
    if (H, B, ctx, topk) in AB_CASES and (not sweep or time.monotonic() < deadline + 15):
        rows.append(ab_row(case, name, 3 if sweep else 7))
    for r in rows:
        print_row(r)
    return rows


def ab_row(case: dict[str, Any], name: str, pairs: int) -> dict[str, Any]:
    """The tag-check row of `case` (FP8 latent, default tiles): `pairs` interleaved A/B pairs."""
    label_ab = f"mla-decode{'-sparse' if case['topk'] is not None else ''} kv=fp8 {name}"
    on, off = (lambda: run(case, "fp8", True)), (lambda: run(case, "fp8", False))
    return tag_check_row(label_ab, on, off, pairs)


def tag_check_case(H: int, B: int, ctx: int, topk: int | None, pairs: int) -> list[dict[str, Any]]:
    """`--tag-check`: the case's tag-check row alone."""
    case = make_case(H, B, ctx, topk)
    row = ab_row(case, case_name(H, B, ctx, topk), pairs)
    assert not case["flags"].any(), "no page was reallocated: no sequence may be flagged"
    print_row(row)
    return [row]


def bench_prefill(
    H: int, cached: int, new: int, ceil: dict[str, float], sweep: bool, deadline: float
) -> list[dict]:
    """One sequence: `new` queries after `cached` tokens, all in the paged cache."""
    dev, L = "cuda", cached + new
    case = make_case(H, 1, L, None)
    q = torch.randn(new, H, R + DR, device=dev, dtype=torch.bfloat16)
    qs = torch.tensor([0, new], dtype=torch.int32, device=dev)
    flops = H * 2 * (R + DR + R) * (new * cached + new * (new + 1) // 2)  # causal
    name = f"heads={H} cached={cached} new={new}"

    def ours(kv: str, t: MlaTiles | None) -> torch.Tensor:
        cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
        kw: dict[str, Any] = {}
        if t is not None:  # 64-row tiles: 64 // block_h queries each
            kw = dict(block_q=64 // t.block_h, block_h=t.block_h, block_n=t.block_n, block_rc=t.block_rc,
                      num_warps=t.num_warps, num_stages=t.num_stages)  # fmt: skip
        return mla_prefill(
            q, cache, scale, R, qs, case["seq_lens"], case["page_table"], case["expected_tags"],
            case["page_tags"], case["flags"], SOFTMAX_SCALE, **kw,
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
    num_checked = min(64, new)
    rows_checked = slice(new - num_checked, new)  # the last queries see the whole context
    rows: list[dict[str, Any]] = []
    for kv in ("bf16", "fp8"):
        key = entry("prefill", H, kv)
        variants: list[MlaTiles | None] = [None, *(VARIANTS.get(key, []) if sweep else [])]
        cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
        flags = torch.zeros(1, dtype=torch.bool, device=dev)
        ref = mla_attention_ref(
            q[rows_checked].float(), cache, scale, R, torch.tensor([0, num_checked], dtype=torch.int32, device=dev),
            case["seq_lens"], case["page_table"], case["expected_tags"], case["page_tags"], flags, SOFTMAX_SCALE,
        )  # fmt: skip
        measured, errors = time_tiles(
            functools.partial(ours, kv), variants, deadline,
            lambda out, ref=ref: rel_err(out[rows_checked].float(), ref),
        )  # fmt: skip
        ms, err = measured["default"], errors["default"]
        rows.append(
            {
                "kernel": "mla-prefill",
                "case": f"kv={kv} {name}",
                "goal": None,
                "ms": ms,
                "fraction_of_ceiling": flops / ms / 1e9 / ceil["bf16_TFLOPs"],
                "TFLOPs": flops / ms / 1e9,
                "peers": peers,
                "tiles": label(TILES[key]) if H > 32 else "default",
                "table_entry": list(key),
                "variants": measured,
                "variant_errors": errors,
                "rel_err": err,
                "ok": err < 1e-2 and not bool(case["flags"].any()),
            }
        )
        print_row(rows[-1])
    return rows


def suggest_tiles(rows: list[dict[str, Any]]) -> None:
    """Per table entry, the variant with the lowest geometric mean of time / default time."""
    ratios: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for r in rows:
        if "variants" not in r or "default" not in r["variants"]:
            continue
        per = ratios.setdefault(tuple(r["table_entry"]), {})
        for name, ms in r["variants"].items():
            # a wrong config is never suggested, nor an FP8-dot one (other numerics: `kumo eval` first)
            if r["variant_errors"][name] < 1e-2 and not name.endswith(" dot8"):
                per.setdefault(name, []).append(ms / r["variants"]["default"])
    print("suggested kernels.mla_tiles.TILES entries (geometric mean of time / default):", flush=True)
    for key, per in ratios.items():
        full = {n: v for n, v in per.items() if len(v) == len(per["default"])}
        gm = {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in full.items()}
        best = min(gm, key=gm.__getitem__)
        t = TILES[key] if best == "default" else next(v for v in VARIANTS[key] if label(v) == best)
        others = " ".join(f"{n} {g:.3f}" for n, g in sorted(gm.items(), key=lambda kv: kv[1]))
        print(f"    {key}: {t},  # {others}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/mla_decode.json when OUT is set)")
    ap.add_argument("--sweep", action="store_true", help="time kernels.mla_tiles.VARIANTS as well")
    ap.add_argument("--no-sweep", action="store_true", help="the default tiles only (the default; kept)")
    ap.add_argument("--parts", default="decode,prefill", help="comma-separated: decode, prefill")
    ap.add_argument(
        "--tag-check", action="store_true", help="only the tag check's A/B rows (TAG_CHECK_CASES)"
    )
    ap.add_argument("--pairs", type=int, default=TAG_CHECK_PAIRS, help="A/B pairs per --tag-check row")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    out = args.out or (os.path.join(os.environ["OUT"], "mla_decode.json") if os.environ.get("OUT") else None)
    deadline = time.monotonic() + SWEEP_BUDGET_S
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    rows: list[dict] = []
    if args.tag_check:
        notes = NOTES + f"; --tag-check: interleaved A/B pairs only ({args.pairs} per row)"
        for H, B, ctx, topk in TAG_CHECK_CASES:
            rows += tag_check_case(H, B, ctx, topk, args.pairs)
            torch.cuda.empty_cache()
            if out:
                write_record(out, rows, ceil, {"notes": notes})
        print(f"done in {time.monotonic() - deadline + SWEEP_BUDGET_S:.0f} s", flush=True)
        return
    decode_cases = SWEEP_CASES if args.sweep else CASES
    for H, B, ctx, topk in decode_cases if "decode" in parts else []:
        rows += bench_case(H, B, ctx, topk, ceil, args.sweep, deadline)
        torch.cuda.empty_cache()
        if out:  # after every case: a timeout keeps what ran
            write_record(out, rows, ceil, {"notes": NOTES})
    for H, cached, new in (SWEEP_PREFILL if args.sweep else PREFILL_CASES) if "prefill" in parts else []:
        rows += bench_prefill(H, cached, new, ceil, args.sweep, deadline)
        torch.cuda.empty_cache()
        if out:
            write_record(out, rows, ceil, {"notes": NOTES})
    if args.sweep:
        suggest_tiles(rows)
    print(f"done in {time.monotonic() - deadline + SWEEP_BUDGET_S:.0f} s", flush=True)


if __name__ == "__main__":
    main()
