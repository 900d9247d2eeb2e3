"""GLM-5's DSA indexer on the GPU: Triton scoring over paged FP8 / BF16 keys + torch.topk, against a
plain torch version over contiguous BF16 keys (einsum, relu, weighted head sum, topk).

Shapes: 32 indexer heads × 128, top 2048, page size 16, pages shuffled. Decode rows (batch 64 at
8k / 32k / 128k) are key-read bound: `fraction_of_ceiling` is key bytes over the copy ceiling;
each row also gives the scoring kernel alone and `torch.topk` alone (which dominates tells whether a
Triton top-k is worth writing). Correctness: recall of `dsa_indexer_ref`'s choice for the first
sequences (bf16 rounding may swap near-ties), and the flags. The tag check's cost: A/B pairs of the
default FP8 entry (`--tag-check`: those rows alone).

    python3 -m benchmarks.kernels.bench_dsa_indexer --out results.json [--quick | --tag-check [--pairs N]]
"""

from __future__ import annotations

import statistics
from functools import partial
from typing import Any

import torch

from benchmarks.kernels.common import (
    graph_ms,
    overhead_text,
    rel_err,
    run_cases,
    tag_check_rows,
    time_entries,
)
from kernels.dsa_indexer import dsa_indexer_ref
from kernels.dsa_indexer_triton import (
    DEFAULT_TILES,
    INDEXER_TILES,
    dsa_indexer_scores,
    dsa_indexer_triton,
    indexer_tiles,
)

DEV = "cuda"
HI, DI, TOPK, PAGE = 32, 128, 2048, 16
CASES = [
    ("decode", 64, 8192, 1),
    ("decode", 64, 32768, 1),
    ("decode", 64, 131072, 1),
    ("prefill", 1, 32768, 4096),
]
QUICK_CASES = [CASES[0], CASES[2], CASES[3]]
AB_PAIRS = 5
TAG_CHECK_CASES = QUICK_CASES  # the cases of kernels-h200.json's tag-check rows


def bench_case(
    kind: str,
    B: int,
    ctx: int,
    chunk: int,
    ceil: dict[str, float],
    quick: bool = False,
    tag_check_pairs: int = 0,
) -> list[dict[str, Any]]:
    """The case's rows; with `tag_check_pairs`, only its tag-check row (that many A/B pairs)."""
    dev, rep_ms = DEV, 50 if quick else 100
    pages_per = ctx // PAGE
    P = B * pages_per
    table = torch.randperm(P, device=dev).to(torch.int32).reshape(B, pages_per)
    keys16 = torch.randn(P, PAGE, DI, device=dev, dtype=torch.bfloat16)
    k_scale = float(keys16.abs().amax()) / 448
    keys = {"bf16": (keys16, 1.0), "fp8": ((keys16 / k_scale).to(torch.float8_e4m3fn), k_scale)}
    page_tags = torch.randint(0, 2**40, (P,), device=dev)
    expected = page_tags[table.long()]
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
    query_start = torch.arange(B + 1, dtype=torch.int32, device=dev) * chunk
    T = B * chunk
    q = torch.randn(T, HI, DI, device=dev, dtype=torch.bfloat16)
    w = torch.randn(T, HI, device=dev) * HI**-0.5
    flags = torch.zeros(B, dtype=torch.bool, device=dev)
    scale = DI**-0.5

    def args(kv: str) -> tuple[Any, ...]:
        kc, ks = keys[kv]
        return (q, w, kc, ks, query_start, seq_lens, table, expected, page_tags, flags, scale)

    def ours(kv: str, check: bool = True, config: str | None = None) -> torch.Tensor:
        return dsa_indexer_triton(*args(kv), TOPK, check_tags=check, config=config)

    c = DEFAULT_TILES[("fp8", kind)]  # the default FP8 entry's check
    case = f"dsa-indexer kv=fp8 tiles={c} {kind} batch={B} context={ctx} queries={T}"
    ops = {case: partial(ours, "fp8", config=c)}
    if tag_check_pairs:
        rows = tag_check_rows(ops, tag_check_pairs, rep_ms)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        print_rows(rows)
        return rows

    def scores(kv: str, config: str) -> tuple[torch.Tensor, torch.Tensor]:
        return dsa_indexer_scores(*args(kv), tiles=tiles, config=config)

    def score_err(result: tuple[torch.Tensor, torch.Tensor], kv: str) -> float:
        """The scores of sequence 0's first and last query against plain torch on its gathered keys."""
        buf, q_row = result
        k = keys[kv][0][table[0].long()].float().reshape(-1, DI)[:ctx] * keys[kv][1]  # [L, Di]
        worst = 0.0
        for t in (0, chunk - 1):
            want = torch.relu(k @ q[t].float().T * scale) @ w[t]  # [L]
            got = buf[int((q_row == t).nonzero()[0])][: ctx - chunk + t + 1]  # the visible ones
            worst = max(worst, rel_err(got, want[: ctx - chunk + t + 1]))
        return worst

    rows, times = [], {}
    tiles = indexer_tiles(query_start, T, B, HI)
    for kv in ("bf16", "fp8"):
        entries = [n for n in INDEXER_TILES if n.startswith(f"{kv}/{kind}/")]
        variants, errors, failed = time_entries(
            entries, partial(scores, kv), partial(score_err, kv=kv), rep_ms
        )
        idx = ours(kv)
        assert not flags.any(), "no page was reallocated: no sequence may be flagged"
        # the reference on the last m queries of the first sequences (the same positions: they are
        # the sequences' last tokens either way)
        n_check, m = min(B, 2), min(chunk, 64)
        rows_ref = torch.tensor(
            [b * chunk + chunk - m + i for b in range(n_check) for i in range(m)], device=dev
        )
        ref = dsa_indexer_ref(
            q[rows_ref], w[rows_ref], keys[kv][0], keys[kv][1],
            torch.arange(n_check + 1, dtype=torch.int32, device=dev) * m, seq_lens[:n_check], table[:n_check],
            expected[:n_check], page_tags, flags[:n_check].clone(), scale, TOPK,
        )  # fmt: skip
        recall = statistics.mean(
            len(set(idx[int(t)].tolist()) & (set(ref[i].tolist()) - {-1})) / max(1, int((ref[i] >= 0).sum()))
            for i, t in enumerate(rows_ref)
        )
        times[kv] = graph_ms([lambda kv=kv: ours(kv)], rep_ms)
        scores_ms = variants.get(DEFAULT_TILES[(kv, kind)], float("nan"))
        buf, _ = dsa_indexer_scores(*args(kv), tiles=tiles)
        topk_ms = graph_ms([lambda buf=buf: buf.topk(min(TOPK, buf.shape[1]), dim=1)], rep_ms)
        key_bytes = B * ctx * DI * keys[kv][0].element_size()
        rows.append(
            {
                "kernel": "dsa-indexer",
                "case": f"kv={kv} {kind} batch={B} context={ctx} queries={T} heads={HI} d={DI} topk={TOPK} page={PAGE}",
                "goal": None,
                "ms": times[kv],
                "fraction_of_ceiling": key_bytes / times[kv] / 1e6 / ceil["copy_GBps"]
                if kind == "decode"
                else None,
                "peers": {},
                "tiles": DEFAULT_TILES[(kv, kind)],
                "parts": {"scores_ms": scores_ms, "topk_ms": topk_ms},
                "variants": variants,  # the scoring kernel alone
                "variant_fractions": {
                    n: key_bytes / t / 1e6 / ceil["copy_GBps"] for n, t in variants.items()
                },
                "errors": errors,
                "failed": failed,
                "recall_vs_ref": recall,
                "ok": not failed and recall > 0.98 and max(errors.values()) < 2e-2,
            }
        )
    try:  # the peer: the plain torch version over contiguous bf16 keys [B, L, Di]
        kc = keys16[table.long()].reshape(B, ctx, DI)
        qb, wb = q.view(B, chunk, HI, DI), w.view(B, chunk, HI)
        pos = torch.arange(ctx, device=dev)
        visible = pos[None, :] <= (ctx - chunk + torch.arange(chunk, device=dev))[:, None]  # [chunk, L]

        def torch_peer() -> torch.Tensor:
            s = torch.relu(torch.einsum("bqhd,bld->bqhl", qb, kc).float() * scale)
            s = torch.einsum("bqh,bqhl->bql", wb, s).masked_fill(~visible, float("-inf"))
            return s.topk(TOPK, dim=-1).indices

        if B * chunk * HI * ctx * 6 < 40 * 2**30:  # the peer's intermediates must fit
            peer_ms = graph_ms([torch_peer], rep_ms)
            for r in rows:
                r["peers"]["torch_bf16_contiguous"] = peer_ms
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        print("torch peer failed:", repr(exc)[:300], flush=True)
    rows += tag_check_rows(ops, 3 if quick else AB_PAIRS, rep_ms)
    print_rows(rows)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        if "overhead" in r:
            extra = overhead_text(r)
        else:
            frac = r["fraction_of_ceiling"]
            extra = (
                f"scores {r['parts']['scores_ms'] * 1e3:.1f}us topk {r['parts']['topk_ms'] * 1e3:.1f}us "
                f"frac {frac if frac is None else round(frac, 2)} recall {r['recall_vs_ref']:.3f} ok {r['ok']}"
            )
        peers = " ".join(f"{k} {v * 1e3:.1f}us" for k, v in r["peers"].items())
        print(f"{r['kernel']:<12} {r['case']:<84} {r['ms'] * 1e3:9.1f}us {extra} | {peers}", flush=True)
        for n, t in r.get("variants", {}).items():
            print(f"{'':<14}scores {n:<20} {t * 1e3:9.1f}us frac {r['variant_fractions'][n]:.2f} "
                  f"err {r['errors'][n]:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    run_cases(
        bench_case,
        CASES,
        "decode rows: fraction_of_ceiling is key bytes over copy GB/s",
        QUICK_CASES,
        TAG_CHECK_CASES,
    )
