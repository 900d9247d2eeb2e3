"""Fused INT4 MoE on the GPU: Kimi K2 routed experts (384 experts, top-8, H 7168, I 2048, group 32) at
M = 1, 8, 64, 512, 4096 tokens; GLM-5 (256 experts, H 6144, I 2048) and GLM-4.5-Air (128, H 4096,
I 1408) at M = 1 and 64, the `moe-decode` goal's other two shapes (issue 6).

For each M, random top-8 routing: correctness against `fused_moe_ref`
(fp32), determinism (two calls bit-identical), then time against the peers a user would reach for,
all with the routing known in advance and captured in one CUDA graph per case:
- `bf16_loop`: per selected expert, `x[tok] @ gate_up.T`, SiLU·mul, `@ down.T`, `index_add_` (the CPU
  layer's loop) over bf16 copies of the same weights (34 GB for 384 experts);
- `tinygemm_loop`: the same loop with `torch.ops.aten._weight_int4pack_mm` (group 32) per projection;
- at the `moe-decode` batches (M = 1 and 64): `fp8` and `fp8_channel`, the FP8 version of the same
  kernel (`kernels/fused_moe_fp8.py`) on random e4m3 experts of the same shape with 128×128 block
  and per-channel scales (the issue-9 "INT4 vs FP8 weights" pair); their errors against
  `fused_moe_fp8_ref` and their GB/s on the FP8 bytes of the selected experts sit in the row too.
The peers get their token lists per expert precomputed on the host, which a real layer pays for
with a device-to-host sync; ours needs no sync. Each graph replays several routings in turn, so the
selected experts' weights (24.8 MB each) come from HBM, not the 60 MB L2.

Achieved GB/s counts the bytes of the experts actually selected (packed words and scales, each
read once) plus activations; `fraction_of_ceiling` is the roofline time
`max(bytes / copy, flops / bf16)` over ours, with both ceilings measured in the same run. The launcher's
own config is timed beside alternative tiles (GEMV vs tensor-core blocks) so the switch in
`pick_moe_config` can be checked against the best one measured. Also timed: the align step alone.

    python3 -m benchmarks.kernels.bench_fused_moe [--out results.json] [--quick]   (default: $OUT/fused_moe.json)

`--quick` (~70 s): M = 1 and 64 on the three shapes, the launcher's pick, the GEMV candidates
(`QUICK_GEMVS`) and a tile variant, the FP8 peers, the align step; ends with a table and the values
for `kernels/moe_routing.py`'s launcher table (`GEMV_CONFIG`, `GEMV_PROGRAMS_PER_SM`,
`GEMV_MAX_PAIRS_PER_EXPERT`).
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_w4a16 import tinygemm_weights
from benchmarks.kernels.common import graph_ms, measure_ceilings, rel_err, write_record
from kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, moe_align, pick_moe_config
from kernels.fused_moe_fp8 import FP8, fused_moe_fp8, fused_moe_fp8_ref
from kernels.int4_dequant import int4_dequant_triton
from kernels.moe_routing import GEMV_CONFIG, GEMV_PROGRAMS_PER_SM, TILE_CONFIGS

G = 32
ExpertTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # w13, s13, w2, s2
FP8_MS = (1, 64)  # the moe-decode goal's batches: where the FP8 kernel is timed as a peer
ROUTINGS = 4  # routings per graph replay: at M=1 that is up to 32 experts (Kimi: 0.8 GB, >> L2)


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    num_experts: int
    hidden: int
    inter: int
    top_k: int
    ms: tuple[int, ...]

    @property
    def expert_bytes(self) -> int:
        """Packed words and bf16 scales of one expert's gate, up and down (Kimi: 24.8 MB)."""
        H, I = self.hidden, self.inter
        return 2 * I * H // 2 + 2 * I * (H // G) * 2 + H * I // 2 + H * (I // G) * 2


SHAPES = [
    Shape("kimi-k2", 384, 7168, 2048, 8, (1, 8, 64, 512, 4096)),
    Shape("glm-5", 256, 6144, 2048, 8, (1, 64)),
    Shape("glm-4.5-air", 128, 4096, 1408, 8, (1, 64)),
]
# the GEMV candidates `--quick` times at every M (beside the launcher's pick; also compiled by
# `python -m tests.kernels.sm90_compile_int4 --all`), then the full run's extra GEMVs and tiles
QUICK_GEMVS = [
    GEMV_CONFIG,
    MoEConfig(0, 64, 256),
    MoEConfig(0, 64, 128, lift=True),
    MoEConfig(0, 64, 256, programs_per_sm=6, lift=True),
    MoEConfig(0, 64, 256, programs_per_sm=24, lift=True),
    MoEConfig(0, 64, 256, loop_stages=3, programs_per_sm=4),  # the pipelined K loop (issue 24)
    MoEConfig(0, 64, 256, loop_stages=3, programs_per_sm=8),
]
QUICK_GROUPED = [  # timed from one pair per expert up (M = 64 in --quick)
    MoEConfig(2, 32, 256, lift=True, grouped=True),
    MoEConfig(4, 32, 256, lift=True, grouped=True),
]
QUICK_TILES = [MoEConfig(16, 64, 128, num_stages=4)]
VARIANTS = [
    *QUICK_GEMVS,
    MoEConfig(0, 64, 256, split_k=1, lift=True),
    MoEConfig(0, 32, 256, num_warps=2, lift=True),
    MoEConfig(0, 64, 128),
    MoEConfig(8, 32, 128, lift=True, grouped=True),
    MoEConfig(0, 64, 128, num_warps=8),
    MoEConfig(16, 64, 128, num_stages=4),
    MoEConfig(16, 64, 64, num_stages=4),
    MoEConfig(16, 32, 128, num_stages=4),
    MoEConfig(32, 64, 128, num_stages=4),
    MoEConfig(32, 32, 128, num_stages=4),
    MoEConfig(64, 64, 128, num_stages=3),
    MoEConfig(64, 128, 64, num_warps=8, num_stages=3),
    MoEConfig(128, 128, 64, num_warps=8, num_stages=3),
]


def make_experts(shape: Shape) -> ExpertTensors:
    """Random words (every nibble value) and bf16 scales sized so activations stay O(1)."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device="cuda")
    s13 = (torch.rand(E, 2 * I, H // G, device="cuda") * 0.004 + 0.001).bfloat16()
    w2 = torch.randint(-(2**31), 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device="cuda")
    s2 = (torch.rand(E, H, I // G, device="cuda") * 0.004 + 0.001).bfloat16()
    return w13, s13, w2, s2


def routing(shape: Shape, M: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [M, H] bf16, ids [M, k] distinct experts per token, weights [M, k] fp32 summing to 2.827)."""
    x = torch.randn(M, shape.hidden, device="cuda", dtype=torch.bfloat16)
    ids = torch.rand(M, shape.num_experts, device="cuda").topk(shape.top_k, dim=-1).indices
    wts = torch.rand(M, shape.top_k, device="cuda") + 0.1
    return x, ids, wts / wts.sum(-1, keepdim=True) * 2.827


def make_fp8_experts(shape: Shape) -> dict[str, tuple[Any, ...]]:
    """Random e4m3 experts (|w| up to 440, one expert's fp32 draw at a time) with both scale formats,
    sized so activations stay O(1): peer name -> (w13, w2, gate, up, down scales, block)."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    w13 = torch.empty(E, 2 * I, H, dtype=FP8, device="cuda")
    w2 = torch.empty(E, H, I, dtype=FP8, device="cuda")
    for e in range(E):
        w13[e] = (torch.randn(2 * I, H, device="cuda") * 64).clamp(-440, 440).to(FP8)
        w2[e] = (torch.randn(H, I, device="cuda") * 64).clamp(-440, 440).to(FP8)
    formats: dict[str, tuple[Any, ...]] = {}
    for name, block in (("fp8", (128, 128)), ("fp8_channel", None)):
        scales = []
        for n, k in ((I, H), (I, H), (H, I)):
            s_shape = (E, n, 1) if block is None else (E, -(-n // 128), -(-k // 128))
            scales.append((torch.rand(s_shape, device="cuda") + 0.5) / (64 * k**0.5))
        formats[name] = (w13, w2, *scales, block)
    return formats


def fp8_expert_bytes(shape: Shape, block: tuple[int, int] | None) -> int:
    """e4m3 weights and fp32 scales of one expert's gate, up and down (Kimi: 44 MB)."""
    H, I = shape.hidden, shape.inter
    scales = 2 * I + H if block is None else 3 * -(-H // 128) * -(-I // 128)
    return 3 * H * I + 4 * scales


def bench_fp8(
    shape: Shape, sets: list[tuple[torch.Tensor, ...]], fp8_w: dict[str, tuple[Any, ...]], row: dict[str, Any]
) -> None:
    """The FP8 kernel as peers of the INT4 row: time, error against its reference, achieved GB/s."""
    x0, ids0, wts0 = sets[0]
    M = x0.shape[0]
    for name, (*w, block) in fp8_w.items():

        def run(s: tuple[torch.Tensor, ...], w: list[Any] = w, block: Any = block) -> torch.Tensor:
            return fused_moe_fp8(s[0], s[1], s[2], *w, block=block)

        try:
            err = rel_err(run(sets[0]).float(), fused_moe_fp8_ref(x0.float(), ids0, wts0, *w, block=block))
            ms = graph_ms([functools.partial(run, s) for s in sets])
        except Exception as exc:  # recorded, and the INT4 row still stands
            row["failures"][name] = repr(exc)[:300]
            err, ms = float("nan"), float("inf")
        row["peers"][name] = ms
        row["peer_rel_err"][name] = err
        row[f"{name}_GBps"] = (
            (row["experts_touched"] * fp8_expert_bytes(shape, block) + 4 * M * shape.hidden) / ms / 1e6
        )
        row["ok"] = row["ok"] and err < 1.5e-2
    print(
        "    fp8 peers: "
        + " ".join(
            f"{n} {row['peers'][n] * 1e3:.1f}us {row[f'{n}_GBps']:.0f} GB/s err {row['peer_rel_err'][n]:.1e}"
            for n in fp8_w
        ),
        flush=True,
    )


Plan = list[tuple[int, torch.Tensor, torch.Tensor]]


def host_plan(ids: torch.Tensor) -> Plan:
    """Per selected expert: (e, token ids, slots), found on the host before timing."""
    plan = []
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        plan.append((e, tok, slot))
    return plan


def expert_loop(
    x: torch.Tensor, wts: torch.Tensor, plan: Plan, project: Callable[[torch.Tensor, int, int], torch.Tensor]
) -> torch.Tensor:
    """What a user writes: one gate/up product, SiLU·mul, one down product and an index_add per expert."""
    out = torch.zeros_like(x)
    for e, tok, slot in plan:
        h = project(x[tok], e, 0)  # [n, 2I]
        I = h.shape[1] // 2
        y = project(F.silu(h[:, :I]) * h[:, I:], e, 1)  # [n, H]
        out.index_add_(0, tok, y * wts[tok, slot, None].to(y.dtype))
    return out


def bench_m(
    shape: Shape,
    M: int,
    experts: ExpertTensors,
    peers_w: dict[str, Any],
    ceil: dict[str, float],
    fp8_w: dict[str, tuple[Any, ...]] | None = None,
    variants: list[MoEConfig] = VARIANTS,
) -> dict[str, Any]:
    E, H, I, TOP_K = shape.num_experts, shape.hidden, shape.inter, shape.top_k
    sets = [routing(shape, M) for _ in range(ROUTINGS)]

    def run(s: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cfg: MoEConfig) -> torch.Tensor:
        return fused_moe(s[0], s[1], s[2], *experts, G, config=cfg)

    plans = [host_plan(ids) for _, ids, _ in sets]
    x0, ids0, wts0 = sets[0]
    ref = fused_moe_ref(x0.float(), ids0, wts0, *experts, G)
    cfg0 = pick_moe_config(M * TOP_K, E)

    def fits(v: MoEConfig) -> bool:  # the GEMVs up to M = 512, the grouped ones from one pair per expert
        return (v.block_m > 0 or M <= 512) and (not v.grouped or M * TOP_K >= E)

    trials = [cfg0, *[v for v in variants if v != cfg0 and fits(v)]]
    errs, times, failures = [], [], {}
    for cfg in trials:
        try:
            out = fused_moe(x0, ids0, wts0, *experts, G, config=cfg)
            errs.append(rel_err(out.float(), ref))
            times.append(graph_ms([functools.partial(run, s, cfg) for s in sets]))
        except Exception as exc:  # a tile shape that does not compile is a result too, not the end of the run
            failures[str(asdict(cfg))] = repr(exc)[:300]
            errs.append(float("nan"))
            times.append(float("inf"))
    try:
        first = fused_moe(x0, ids0, wts0, *experts, G, config=cfg0)
        deterministic = torch.equal(first, fused_moe(x0, ids0, wts0, *experts, G, config=cfg0))
    except Exception:  # recorded in failures above
        deterministic = False
    align_bm = cfg0.block_m or TILE_CONFIGS[0][1].block_m  # what the tiles would use at this M
    align_ms = graph_ms([functools.partial(moe_align, s[1], E, align_bm) for s in sets])
    peers: dict[str, float] = {}
    peer_errs: dict[str, float] = {}
    for name, project in peers_w.items():
        peer_errs[name] = rel_err(expert_loop(x0, wts0, plans[0], project).float(), ref)
        peers[name] = graph_ms(
            [functools.partial(expert_loop, s[0], s[2], p, project) for s, p in zip(sets, plans, strict=True)]
        )
    touched = sum(len(p) for p in plans) / len(plans)
    bytes_moved = touched * shape.expert_bytes + 2 * M * H * 2
    flops = 2 * M * TOP_K * 3 * H * I
    ms = times[0]
    best = min(range(len(times)), key=times.__getitem__)
    floor_ms = max(bytes_moved / ceil["copy_GBps"] / 1e6, flops / ceil["bf16_TFLOPs"] / 1e9)
    row = {
        "kernel": "fused-moe",
        "case": f"M={M} E={E} k={TOP_K} H={H} I={I} g={G} int4 {shape.name}",
        "goal": "moe-decode" if M in (1, 64) else None,  # issue 6: batch 1 and 64, all three shapes
        "ms": ms,
        "fraction_of_ceiling": floor_ms / ms,
        "peers": peers,
        "GBps": bytes_moved / ms / 1e6,
        "copy_fraction": bytes_moved / ms / 1e6 / ceil["copy_GBps"],
        "TFLOPs": flops / ms / 1e9,
        "experts_touched": touched,
        "bytes_touched": bytes_moved,
        "align_ms": align_ms,
        "rel_err": errs[0],
        "peer_rel_err": peer_errs,
        "deterministic": deterministic,
        "ok": all(e < 1.5e-2 for e in errs) and deterministic,  # NaN (a failed variant too) fails
        "config": asdict(cfg0),
        "best_variant": {"ms": times[best], "config": asdict(trials[best]), "label": label(trials[best])},
        "best_GBps": bytes_moved / times[best] / 1e6,
        "pairs_per_expert": M * TOP_K / E,
        "variants": [
            {"ms": t, "rel_err": e, "config": asdict(c), "label": label(c)}
            for t, e, c in zip(times, errs, trials, strict=True)
        ],
        "failures": failures,
    }
    print(
        f"{row['case']:<48} ours {ms * 1e3:9.1f}us best {times[best] * 1e3:9.1f}us "
        f"[{label(trials[best])}] {row['GBps']:.0f} GB/s "
        f"frac {row['fraction_of_ceiling']:.2f} align {align_ms * 1e3:.1f}us err {max(errs):.1e} "
        f"{'ok' if row['ok'] else 'FAIL'} | " + " ".join(f"{k} {v * 1e3:.1f}us" for k, v in peers.items()),
        flush=True,
    )
    if fp8_w:
        bench_fp8(shape, sets, fp8_w, row)
    return row


def label(cfg: MoEConfig) -> str:
    if cfg.grouped:
        return f"grouped{cfg.block_m} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps}"
    if cfg.block_m:
        return f"bm{cfg.block_m} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    split = f"split{cfg.split_k}" if cfg.split_k else f"{cfg.programs_per_sm or GEMV_PROGRAMS_PER_SM}/SM"
    stages = f" s{cfg.loop_stages}" if cfg.loop_stages > 1 else ""
    return f"gemv {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} {split}{' lift' if cfg.lift else ''}{stages}"


def summary(rows: list[dict[str, Any]], copy_GBps: float) -> None:
    """The compact table and the values for `kernels/moe_routing.py`'s launcher table."""
    print(
        f"\n{'case':<46} {'default':>8} {'best':>8} {'GB/s':>5} {'copy':>5} {'fp8':>7} {'fp8ch':>7} {'align':>6}  best"
    )
    for r in rows:
        b, fp8 = r["best_variant"], r["peers"]
        print(
            f"{r['case']:<46} {r['ms'] * 1e3:8.1f} {b['ms'] * 1e3:8.1f} {r['best_GBps']:5.0f} "
            f"{r['best_GBps'] / copy_GBps:5.2f} {fp8.get('fp8', float('nan')) * 1e3:7.1f} "
            f"{fp8.get('fp8_channel', float('nan')) * 1e3:7.1f} {r['align_ms'] * 1e3:6.1f}  {b['label']}"
        )
    totals: dict[str, float] = {}
    for r in rows:
        if r["case"].startswith("M=1 "):
            for v in r["variants"]:
                totals[v["label"]] = totals.get(v["label"], 0.0) + v["ms"]
    if totals:
        pick = min(totals, key=totals.__getitem__)
        print(
            f"M=1: least total {totals[pick] * 1e3:.1f}us over the shapes: {pick} -> GEMV_CONFIG, GEMV_PROGRAMS_PER_SM"
        )
    kinds = {"gemv": "GEMV_MAX_PAIRS_PER_EXPERT", "grouped": "GROUPED_CONFIGS", "bm": "TILE_CONFIGS"}
    for r in rows:
        if not r["case"].startswith("M=1 "):
            best = {k: min((v for v in r["variants"] if v["label"].startswith(k)), key=lambda v: v["ms"], default=None)
                    for k in kinds}  # fmt: skip
            text = ", ".join(f"{v['label']} {v['ms'] * 1e3:.1f}us" for v in best.values() if v)
            win = min((k for k in kinds if best[k]), key=lambda k: best[k]["ms"])
            print(f"{r['case']}: {r['pairs_per_expert']:.2f} pairs/expert: {text} -> {kinds[win]} covers it")


def peer_weights(
    shape: Shape, experts: ExpertTensors
) -> dict[str, Callable[[torch.Tensor, int, int], torch.Tensor]]:
    """bf16 copies of the same experts (dequantized by the Triton pass) and tinygemm's packing of them."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    w13, s13, w2, s2 = experts
    gu = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    dn = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16)
    tiny: list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = []
    for e in range(E):
        gu[e] = int4_dequant_triton(w13[e], s13[e], G, torch.bfloat16)
        dn[e] = int4_dequant_triton(w2[e], s2[e], G, torch.bfloat16)
        tiny.append((tinygemm_weights(w13[e], s13[e], G), tinygemm_weights(w2[e], s2[e], G)))
    bf16_w = (gu, dn)

    def bf16(a: torch.Tensor, e: int, which: int) -> torch.Tensor:
        return a @ bf16_w[which][e].t()

    def tinygemm(a: torch.Tensor, e: int, which: int) -> torch.Tensor:
        w, sz = tiny[e][which]
        return torch.ops.aten._weight_int4pack_mm(a.contiguous(), w, G, sz)

    return {"bf16_loop": bf16, "tinygemm_loop": tinygemm}


NOTES = (
    "ms = median do_bench of a CUDA-graph replay over 4 routings, per call; peers get host-precomputed "
    "per-expert token lists; fp8 / fp8_channel: the FP8 fused kernel (block / per-channel scales) on random "
    "e4m3 experts of the same shape"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/fused_moe.json when OUT is set)")
    ap.add_argument("--ms", default=None, help="token counts, comma-separated (default: each shape's own)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES), help="shape names, comma-separated")
    ap.add_argument("--quick", action="store_true", help="M=1, 64; the GEMV candidates and FP8 peers only")
    args = ap.parse_args()
    out = args.out or (os.path.join(os.environ["OUT"], "fused_moe.json") if os.environ.get("OUT") else None)
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    rows = []
    for shape in SHAPES:
        if shape.name not in args.shapes.split(","):
            continue
        experts = make_experts(shape)
        peers_w = {} if args.quick else peer_weights(shape, experts)
        ms = [int(m) for m in args.ms.split(",")] if args.ms else (list(FP8_MS) if args.quick else shape.ms)
        fp8_w = make_fp8_experts(shape) if set(ms) & set(FP8_MS) else None
        variants = QUICK_GEMVS + QUICK_GROUPED + QUICK_TILES if args.quick else VARIANTS + QUICK_GROUPED
        for M in ms:
            rows.append(bench_m(shape, M, experts, peers_w, ceil, fp8_w if M in FP8_MS else None, variants))
            torch.cuda.empty_cache()
            if out:  # after every row: a timeout keeps what ran
                write_record(out, rows, ceil, {"notes": NOTES})
        del experts, peers_w, fp8_w
        torch.cuda.empty_cache()
    summary(rows, ceil["copy_GBps"])


if __name__ == "__main__":
    main()
