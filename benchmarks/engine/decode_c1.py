"""`kumo bench engine decode-c1`: one sequence's decode step against the bytes it reads (issue 24).

    decode_c1_bytes_ratio = step time / (bytes a token reads / device-to-device copy bandwidth)

per weight format (FP8 and INT4, routed experts only and every Linear; BF16, shallower, where it
fits), the summary key the worst format's. The bytes a token reads at concurrency 1: every weight
outside the routed experts (attention with MLA's dense kv_b_proj and the DSA indexer, the dense
layers' MLPs, shared experts, routers, norms, lm_head; the embedding's one row), the `top_k` routed
experts it touches per MoE layer (their share of the experts' bytes: random routers pick near
uniformly and one token's k experts are distinct), and its KV cache at the mean context of the timed
steps (every cached tensor of every layer: MLA latents and the indexer's keys). The copy bandwidth
is a 1 GiB `copy_` (read + write counted, as `benchmarks/kernels/common.py` counts it), measured in
the same rounds.

Method (`benchmarks.engine.method`): per format, a warm-up of the timed workload (the same prompt and
output lengths: every step shape, every CUDA-graph bucket) and of the copy, then rounds of
A, B, B, A with A the format's decode run (its median pure-decode step, `decode_step_ms_p50`) and B
the copy (the bytes over its bandwidth): a round's ratio is (a1 + a2) / (b1 + b2).

`--rank-of N`: rank 0's slice of N ranks (benchmarks/engine/rank_of.py), at the full depth unless
`--layers` truncates it, alone on one device with its collectives local. Its bytes are rank 0's: 1/N
of the attention heads (q_b / kv_b / o_proj; q_a, kv_a and the indexer replicated), of the dense and
shared MLPs and of lm_head's vocabulary, the replicated routers and norms, one embedding row, and its
whole KV (the MLA latent and indexer keys are replicated per rank: no DCP here). The routed experts
are split by contiguous id range, E/N whole experts a rank (ep = N), and the fused MoE kernels skip
other ranks' pairs without reading a weight, so rank 0 reads the token's experts that fall in its
range: with the k experts distinct and near uniform over all E (random routers), k·(E/N)/E of them a
MoE layer on average (GLM 5.2 at N = 8: 1 of its 32), counted as that share of its experts' bytes; the
record gives the share its routers picked in the collective probe's step beside it. Beside the ratio,
the collectives' time at c=1 as `collective_probe` models it (ring over NVLink, labelled modelled),
and the ratio with it added to the step. The summary key is `decode_c1_bytes_ratio_rank_of_N`; a
format whose slice leaves no room on one H200 by `kumo plan` (BF16 at full depth) is skipped, said so.

`--pdl-ab`: after a format's rounds, A/B/B/A rounds of its step with Programmatic Dependent Launch
(`kernels/triton_lib.py`: the Triton kernels overlap each other's launch and tail) against the same
step without (a second engine on the same weights, its graphs captured with PDL off), recorded under
the format's `pdl_ab`: `step_ratio` = on / off (< 1: PDL saves time), each side's median step beside.
The format's own rounds run with PDL as `--pdl/--no-pdl` sets it (on by default; off where the GPU
predates sm_90), recorded as `options.pdl` and `pdl_active`.

    kumo bench engine decode-c1 [--layers 10] [--bf16-layers 6] [--formats int4,fp8,int4-all,fp8-all,bf16]
                                [--no-fuse-projections]   (the before side of the same-input fusion)
                                [--no-pdl | --pdl-ab]     (PDL off, or on against off)
    kumo bench engine decode-c1 --rank-of 8 --formats int4-all,fp8-all   (rank 0 of 8, 78 of 78 layers)
    kumo bench engine decode-c1 --merge A.json B.json --out X.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the planner, only where a command needs them
    from benchmarks.engine.geometry import Geometry
    from benchmarks.engine.rank_of import LocalCollectives

RESULTS = Path(__file__).resolve().parents[1] / "results"
SUMMARY_KEY = "decode_c1_bytes_ratio"
GOAL = "<= 1.3x at 10 layers"
GOAL_RANK_OF = "<= 2.5x at rank-of-8"
FORMATS = ("int4", "fp8", "int4-all", "fp8-all", "bf16")
COPY_BYTES = 2**30  # each way; the tiny CPU run copies 8 MiB


@dataclass(frozen=True, slots=True)
class Options:
    device: str
    formats: tuple[str, ...]
    layers: int
    bf16_layers: int
    input_len: int
    output_len: int
    num_rounds: int
    page_size: int
    chunk: int
    deadline: float  # time.monotonic() after which no round starts
    tiny: bool = False
    fp8_method: str = "fp8-block"
    cuda_graphs: bool = True
    fuse_projections: bool = True
    seed: int = 0
    copy_bytes: int = COPY_BYTES
    rank_of: int = 1  # > 1: rank 0's slice of `rank_of` ranks (its collectives local, their time modelled)
    pdl: bool = True  # the kernels' PDL switch for the format's rounds (`kernels/triton_lib.py`)
    pdl_ab: bool = False  # then A/B/B/A rounds of the step with PDL on against off

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def summary_key(rank_of: int) -> str:
    """`decode_c1_bytes_ratio`, or for rank 0 of N `decode_c1_bytes_ratio_rank_of_N` (never the same key)."""
    return SUMMARY_KEY if rank_of == 1 else f"{SUMMARY_KEY}_rank_of_{rank_of}"


def goal(rank_of: int) -> str:
    return GOAL if rank_of == 1 else GOAL_RANK_OF


def token_bytes(model: Any, top_k: int, num_experts: int) -> dict[str, int]:
    """Weight bytes one token reads at concurrency 1, by part (see the module docstring). The routed
    experts: `top_k / num_experts` of the local experts' bytes, the expected share of the token's
    experts that are this rank's (all k on one rank; k·El/E on a rank of El of the E experts)."""
    from backend.models.layers.moe import Experts
    from backend.quant.experts import QuantExperts

    routed = {name for name, m in model.named_modules() if isinstance(m, Experts | QuantExperts)}
    parts: dict[str, int] = {}
    for name, t in model.state_dict().items():
        if name.endswith("weight_shape"):  # checkpoint metadata, never read by a step
            continue
        nbytes = t.numel() * t.element_size()
        owner = name.rpartition(".")[0]
        if owner in routed:
            part, nbytes = "routed_experts_touched", nbytes * top_k // num_experts
        elif "embed_tokens" in name:
            part, nbytes = "embedding_row", t.shape[-1] * t.element_size()
        elif "lm_head" in name:
            part = "lm_head"
        elif ".self_attn." in name:
            part = "attention"
        elif ".shared_experts." in name:
            part = "shared_experts"
        elif ".mlp.gate." in name:
            part = "router"
        elif "norm" in name:
            part = "norms"
        elif ".mlp." in name:
            part = "dense_mlp"
        else:
            part = "other"
        parts[part] = parts.get(part, 0) + nbytes
    return parts


def kv_bytes_per_token(engine: Any) -> float:
    """Bytes of every cached tensor of every layer, per token of context."""
    kv = engine.runner.kv_cache
    total = sum(t.numel() * t.element_size() for layer in kv.layers for t in layer.values())
    return total / (kv.num_pages * kv.page_size)


class CopyProbe:
    """Device-to-device copy bandwidth: `dst.copy_(src)` of `nbytes`, read + write counted."""

    def __init__(self, device: str, nbytes: int) -> None:
        import torch

        self.device = torch.device(device)
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        self.dst = torch.empty_like(self.src)
        self.nbytes = nbytes

    def bandwidth(self, reps: int = 20) -> float:
        """Bytes per second, the median of `reps` timed copies."""
        import statistics

        import torch

        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.dst.copy_(self.src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                self.dst.copy_(self.src)
                times.append(time.perf_counter() - t0)
        return 2 * self.nbytes / statistics.median(times)


def no_room(geometry: Geometry, fmt: str, fp8_method: str) -> str | None:
    """Why rank 0's slice in `fmt` cannot run on this GPU (an H200 off CUDA): `kumo plan` at tp =
    rank_of, this depth, leaves no KV pool (BF16 at GLM 5.2's full depth, 190 GB; FP8 every Linear,
    ~96 GB, on an 80 GB H100), else None; the tiny geometry always runs."""
    if geometry.is_tiny or geometry.rank_of == 1:
        return None
    import torch

    from backend.tools.plan import make_plan
    from benchmarks.engine.geometry import H200_MEM, plan_weights

    gpu_mem = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else H200_MEM
    weights, all_linear = plan_weights(fmt, fp8_method)  # type: ignore[arg-type]
    plan = make_plan(
        geometry.text, model=geometry.kind, gpu_mem=gpu_mem, tp=geometry.rank_of, weights=weights,  # type: ignore[arg-type]
        all_linear=all_linear,
    )  # fmt: skip
    if plan.kv_tokens > 0:
        return None
    return (
        f"skipped: rank 0 of {geometry.rank_of} in {fmt} at {geometry.num_layers} of {geometry.full_num_layers} "
        f"layers holds {plan.weights_per_gpu / 1e9:.0f} GB of weights (kumo plan): no room on "
        f"one {gpu_mem / 1e9:.0f} GB GPU; "
        "--layers / --bf16-layers truncate it"
    )


def modelled_collectives(
    model: Any, collectives: LocalCollectives, config: Any, device: str
) -> dict[str, Any]:
    """`rank_of.collective_probe` at c = 1 (the NVLink time modelled), and beside it how many of the
    routed experts its step picked were rank 0's (the bytes count the expected share, El / E)."""
    from backend.models.layers.moe import Experts
    from backend.quant.experts import QuantExperts
    from benchmarks.engine.rank_of import collective_probe

    experts = [m for m in model.modules() if isinstance(m, Experts | QuantExperts)]
    picks: list[tuple[Any, int]] = []  # (rank 0's picks as a tensor: no host sync in the step, all picks)

    def count(m: Any, args: tuple[Any, ...]) -> None:
        ids = args[2]  # forward(x, weights, ids [T, k])
        picks.append((((ids >= m.e0) & (ids < m.e1)).sum(), ids.numel()))

    hooks = [m.register_forward_pre_hook(count) for m in experts]
    try:
        probe = collective_probe(
            model, collectives, vocab=config.vocab_size, context_window=config.max_position_embeddings,
            concurrency=1, device=device,
        )  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    local = experts[0].e1 - experts[0].e0 if experts else 0
    return probe | {
        "routed_local_share_assumed": local / config.num_routed_experts,
        "routed_local_share_in_probe": sum(int(n) for n, _ in picks) / max(sum(t for _, t in picks), 1),
        "modelled_ms": probe["per_decode_step"]["c1"]["total"]["modelled_s"] * 1e3,
    }


def with_nvlink(rounds: list[dict[str, Any]], modelled_ms: float) -> list[float]:
    """Each round's ratio with the modelled collective time added to each A step."""
    from benchmarks.engine import method

    ratios = []
    for r in rounds:
        a = [run["step_ms"] + modelled_ms for run in r["runs"] if run["side"] == "A"]
        b = [run["bytes_ms"] for run in r["runs"] if run["side"] == "B"]
        r["ratio_with_modelled_nvlink"] = method.round_ratio(a, b)
        ratios.append(r["ratio_with_modelled_nvlink"])
    return ratios


def measure_format(
    fmt: str, opts: Options, probe: CopyProbe, deadline: float, collectives: LocalCollectives | None = None
) -> dict[str, Any]:
    """One format: build, warm, A/B/B/A rounds; its entry (summary over the complete rounds). With
    `collectives` (`--rank-of`): the collectives' modelled time and the ratio with it beside."""
    import torch

    from backend.engine.engine import Engine
    from benchmarks.engine import method
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.offline import engine_config, run_offline
    from benchmarks.engine.weights import build_random_model

    start = time.perf_counter()
    layers = opts.bf16_layers if fmt == "bf16" else opts.layers
    geometry = make_geometry("glm-5.2", layers, tiny=opts.tiny, rank_of=opts.rank_of)
    if reason := no_room(geometry, fmt, opts.fp8_method):
        print(f"decode-c1 {fmt}: {reason}")
        return {"weights": fmt, "layers": layers, "geometry": geometry.describe(), "skipped": reason,
                "rounds": [], "summary": None}  # fmt: skip
    config = geometry.model_config
    model = build_random_model(
        geometry, fmt, device=opts.device, seed=opts.seed, fp8_method=opts.fp8_method,  # type: ignore[arg-type]
        fuse_projections=opts.fuse_projections,
    )  # fmt: skip
    num_pages = -(-(opts.input_len + opts.output_len) // opts.page_size) + 1

    def build() -> Engine:
        return Engine(
            model,  # type: ignore[arg-type]
            engine_config(num_pages, opts.page_size, "bf16", 1, opts.chunk, cuda_graphs=opts.cuda_graphs),
            vocab_size=config.vocab_size,
            context_window=config.max_position_embeddings,
            model_dtype=torch.bfloat16,
            device=opts.device,
        )

    engine = build()
    top_k = config.num_experts_per_tok
    weights = token_bytes(model, top_k, config.num_routed_experts)
    context = opts.input_len + opts.output_len / 2  # the mean context of the decode steps
    kv_per_token = kv_bytes_per_token(engine)
    kv = kv_per_token * context
    read = sum(weights.values()) + kv
    modelled = modelled_collectives(model, collectives, config, opts.device) if collectives else None
    count = iter(range(1 << 30))
    # with --pdl-ab, about half the format's time for the step-over-bytes rounds, the rest for PDL's
    rounds_deadline = deadline - (deadline - time.monotonic()) / 2 if opts.pdl_ab else deadline

    def decode(on: Engine) -> dict[str, Any]:
        r = run_offline(
            on, variant=f"{fmt}/{next(count)}", concurrency=1, input_len=opts.input_len,
            output_len=opts.output_len, vocab_size=config.vocab_size, seed=1,
            time_limit_s=max(deadline - time.monotonic(), 1.0),
        ).to_dict()  # fmt: skip
        r["is_complete"] = r["output_tokens"] == opts.output_len and r["extra"].get("decode_steps", 0) > 0
        r["step_ms"] = r["extra"].get("decode_step_ms_p50", float("nan"))
        return r

    def run(side: str) -> dict[str, Any]:
        if side == "B":
            bw = probe.bandwidth()
            return {"copy_GBps": bw / 1e9, "bytes_ms": read / bw * 1e3, "is_complete": True}
        return decode(engine)

    warm_start = time.perf_counter()
    warm = {"A": run("A"), "B": run("B")}
    warm_s = time.perf_counter() - warm_start
    rounds = method.interleave(
        run,
        lambda r: float(r["step_ms"] if "step_ms" in r else r["bytes_ms"]),
        num_rounds=opts.num_rounds,
        time_left=lambda: rounds_deadline - time.monotonic(),
        first_round_s=2.0 * warm_s,
    )
    complete = [r for r in rounds if all(run["is_complete"] for run in r["runs"])]
    timed = [
        s for r in rounds for run in r["runs"] if run["side"] == "A" for s in run["extra"]["step_shapes"]
    ]
    missed = method.missing_shapes(warm["A"]["extra"]["step_shapes"], timed)
    for run in [run for r in rounds for run in r["runs"]] + [warm["A"]]:
        if "extra" in run:
            run["extra"]["num_step_shapes"] = len(run["extra"].pop("step_shapes"))
    entry = {
        "weights": fmt,
        "layers": layers,
        "geometry": geometry.describe(),
        "build_s": time.perf_counter() - start,
        "token_weight_bytes": weights,
        "kv_bytes": kv,
        "kv_bytes_per_token": kv_per_token,
        "context_tokens": context,
        "bytes_read": read,
        "warm_up": {"s": warm_s, "A": warm["A"], "B": warm["B"]},
        "warm_up_missed_shapes": missed,
        "order": method.order(len(rounds)),
        "rounds": rounds,
        "rounds_incomplete": len(rounds) - len(complete),
        "rounds_skipped": opts.num_rounds - len(rounds),
        "summary": method.summary_entry([r["ratio"] for r in complete]) if complete else None,
    }
    if opts.pdl_ab:
        entry["pdl_ab"] = pdl_ab(engine, build, decode, opts.num_rounds, deadline)
    if modelled is not None:
        nvlink = with_nvlink(complete, modelled["modelled_ms"])
        entry |= {
            "routed_experts_per_moe_layer": top_k * modelled["routed_local_share_assumed"],
            "collectives": modelled,
            "summary_with_modelled_nvlink": method.summary_entry(nvlink) if nvlink else None,
        }
    return entry


def pdl_ab(
    on: Any,
    build: Callable[[], Any],
    decode: Callable[[Any], dict[str, Any]],
    num_rounds: int,
    deadline: float,
) -> dict[str, Any]:
    """`--pdl-ab`: A = the format's engine (its graphs captured with PDL), B = `build()` run with PDL
    off from its capture on; a warm run of each, then A/B/B/A rounds of `decode` until `deadline`.
    The switch is set before each run, so each side's eager steps (the prefill) launch as its graphs
    were captured; it is back on after."""
    from benchmarks.engine import method
    from kernels.triton_lib import set_pdl

    engines = {"A": on}

    def run(side: str) -> dict[str, Any]:
        set_pdl(side == "A")
        r = decode(engines[side])
        r["extra"]["num_step_shapes"] = len(r["extra"].pop("step_shapes"))
        return r

    try:
        set_pdl(False)
        engines["B"] = build()
        warm_start = time.perf_counter()
        warm = {"A": run("A"), "B": run("B")}
        rounds = method.interleave(
            run, lambda r: float(r["step_ms"]), num_rounds=num_rounds, time_left=lambda: deadline - time.monotonic(),
            first_round_s=2.0 * (time.perf_counter() - warm_start),
        )  # fmt: skip
    finally:
        set_pdl(True)
    complete = [r for r in rounds if all(run["is_complete"] for run in r["runs"])]
    steps = {
        side: [run["step_ms"] for r in complete for run in r["runs"] if run["side"] == side] for side in "AB"
    }
    return {
        "A": "PDL on",
        "B": "PDL off (its decode graphs captured without it)",
        "warm_up": warm,
        "order": method.order(len(rounds)),
        "rounds": rounds,
        "rounds_incomplete": len(rounds) - len(complete),
        "rounds_skipped": num_rounds - len(rounds),
        "step_ms": {side: _median(v) for side, v in steps.items()},
        "step_ratio": method.summary_entry([r["ratio"] for r in complete]) if complete else None,
    }


def measure(
    opts: Options,
    on_format: Callable[[dict[str, Any]], None] | None = None,
    collectives: LocalCollectives | None = None,
) -> dict[str, Any]:
    """Every format in turn (each gets an even share of the time left), then the summary entry;
    `on_format` sees the formats measured so far after each (the CLI writes them: a call cut off by
    its device time keeps what it finished). `collectives`: the `--rank-of` group (rank_of.join_alone)."""
    import gc

    import torch

    probe = CopyProbe(opts.device, opts.copy_bytes)
    formats: dict[str, Any] = {}
    for i, fmt in enumerate(opts.formats):
        share = opts.time_left() / (len(opts.formats) - i)
        formats[fmt] = measure_format(fmt, opts, probe, time.monotonic() + share, collectives)
        gc.collect()  # the format's model, engine and CUDA graphs, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if on_format is not None:
            on_format(summarize(formats, opts.rank_of))
    return summarize(formats, opts.rank_of)


def summarize(formats: dict[str, Any], rank_of: int = 1) -> dict[str, Any]:
    """The formats' entries and the summary key (`summary_key(rank_of)`): the worst (largest) ratio's
    entry; beside it the worst quantized format's (BF16's routed experts have no fused kernel: a
    captured decode step runs every expert, `Experts.forward_every_expert`, so BF16 reads E / k times
    its experts' bytes); for rank 0 of N also the worst ratio with the modelled NVLink time added."""
    key = summary_key(rank_of)
    measured = {f: e["summary"] for f, e in formats.items() if e["summary"]}
    worst = max(measured, key=lambda f: measured[f]["value"]) if measured else None
    quantized = [f for f in measured if f != "bf16"]
    worst_quantized = max(quantized, key=lambda f: measured[f]["value"]) if quantized else None
    out = {
        "rank_of": rank_of,
        "formats": formats,
        "worst_format": worst,
        "worst_quantized_format": worst_quantized,
        "worst_quantized": measured[worst_quantized] if worst_quantized else None,
        "summary": {key: measured[worst] if worst else None},
        "summary_detail": {
            key: "decode step at concurrency 1 / (bytes a token reads / copy bandwidth), the worst of "
            + ", ".join(f"{f} {e['value']:.2f}x" for f, e in measured.items())
            + (f"; rank 0 of {rank_of}, its collectives local" if rank_of > 1 else "")
        },
        "goal": goal(rank_of),
    }
    if rank_of > 1:  # modelled, not measured: beside the summary, never in it
        nvlink = {
            f: e["summary_with_modelled_nvlink"]
            for f, e in formats.items()
            if e.get("summary_with_modelled_nvlink")
        }
        worst_nvlink = max(nvlink, key=lambda f: nvlink[f]["value"]) if nvlink else None
        out["with_modelled_nvlink"] = {
            "label": "modelled: each step plus the collectives' time by rank_of.collective_probe (ring over NVLink)",
            "worst_format": worst_nvlink,
            f"{key}_with_modelled_nvlink": nvlink[worst_nvlink] if worst_nvlink else None,
        }  # fmt: skip
    return out


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Records of several calls (formats split over 10-minute device calls) as one: every format's
    entry (a later record's wins), the summary over them all, each call under `sources`."""
    ranks = {r.get("rank_of", 1) for r in records}
    if len(ranks) > 1:
        raise SystemExit(
            f"kumo bench engine decode-c1 --merge: records of different --rank-of {sorted(ranks)}"
        )
    formats = {f: e for r in records for f, e in r["formats"].items()}
    sources = [{k: r[k] for k in ("command", "date", "device", "machine", "wall_s")} for r in records]
    return dict(records[-1]) | {"sources": sources} | summarize(formats, ranks.pop())


def markdown(record: dict[str, Any]) -> str:
    rank_of = record.get("rank_of", 1)
    key = summary_key(rank_of)
    where = ""
    if rank_of > 1:
        g = record["geometry"]
        where = f" at rank 0 of {rank_of}, {g['layers']} of {g['full_num_layers']} layers (collectives local)"
    lines = [
        f"# Decode step at concurrency 1 against its bytes{where} ({record['date']}, {record['device']})",
        "",
        f"`{key}` = {_entry_text(record['summary'][key])} (worst format: "
        f"{record['worst_format']}; goal {goal(rank_of)}); worst quantized format "
        f"{record.get('worst_quantized_format')}: {_entry_text(record.get('worst_quantized'))}.",
    ]
    if rank_of > 1:
        nvlink = record["with_modelled_nvlink"]
        lines.append(
            f"With the collectives' time modelled (NVLink, `rank_of.collective_probe`): "
            f"{_entry_text(nvlink[f'{key}_with_modelled_nvlink'])} (worst format: {nvlink['worst_format']})."
        )
    extra = " modelled NVLink ms | ratio with it |" if rank_of > 1 else ""
    lines += [
        "",
        f"| weights | layers | step ms | bytes read MB | copy GB/s | ratio [spread] | rounds |{extra}",
        "|---|---|---|---|---|---|---|" + "---|---|" * (rank_of > 1),
    ]
    for fmt, e in record["formats"].items():
        if "skipped" in e:
            lines.append(f"| {fmt} | {e['layers']} | {e['skipped']} |")
            continue
        runs = [run for r in e["rounds"] for run in r["runs"]]
        steps = [run["step_ms"] for run in runs if run["side"] == "A"]
        bws = [run["copy_GBps"] for run in runs if run["side"] == "B"]
        row = (
            f"| {fmt} | {e['layers']} | {_median(steps):.3f} | {e['bytes_read'] / 1e6:.1f} | {_median(bws):.0f} "
            f"| {_entry_text(e['summary'])} | {len(e['rounds'])} |"
        )
        if rank_of > 1:
            row += (
                f" {e['collectives']['modelled_ms']:.3f} | {_entry_text(e['summary_with_modelled_nvlink'])} |"
            )
        lines.append(row)
    for fmt, e in record["formats"].items():
        if "pdl_ab" in e:
            ab = e["pdl_ab"]
            lines.append(
                f"\nPDL on / off ({fmt}, `--pdl-ab`): step {ab['step_ms']['A']:.3f} / {ab['step_ms']['B']:.3f} ms, "
                f"{_entry_text(ab['step_ratio'])} over {len(ab['rounds'])} rounds."
            )
    return "\n".join(lines) + "\n"


def _entry_text(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['value']:.2f}x [{entry['spread'][0]:.2f}, {entry['spread'][1]:.2f}]"


def _median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else float("nan")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench engine decode-c1", description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of " + ", ".join(FORMATS))
    ap.add_argument(
        "--layers", type=int, default=None,
        help="truncated depth of the quantized formats (default 10; with --rank-of the full depth)",
    )  # fmt: skip
    ap.add_argument(
        "--bf16-layers", type=int, default=None,
        help="truncated depth of BF16, what fits one GPU (default 6; with --rank-of as --layers)",
    )  # fmt: skip
    ap.add_argument(
        "--rank-of", type=int, default=1,
        help="rank 0's slice of N ranks, collectives local (their time modelled beside)",
    )  # fmt: skip
    ap.add_argument("--input-len", type=int, default=2048, help="the context the decode steps run at")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="A/B/B/A rounds per format")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument("--fp8-method", choices=("fp8-block", "fp8-channel"), default="fp8-block")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--fuse-projections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Linears reading the same input as one product (backend/models/layers/fused.py); "
        "--no-fuse-projections: each its own, to measure what the fusion saves",
    )
    ap.add_argument(
        "--pdl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Programmatic Dependent Launch of the Triton kernels (kernels/triton_lib.py; Hopper and later)",
    )
    ap.add_argument(
        "--pdl-ab", action="store_true", help="then per format the step with PDL on against off, A/B/B/A"
    )
    ap.add_argument("--tiny", action="store_true", help="small geometry and lengths (CPU tests)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--budget-s", type=float, default=500.0, help="no round starts that would end after this")
    ap.add_argument(
        "--compile-cache", type=Path, default=None, help="Triton's cache (default ~/.triton/cache)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="record path (.json); .md beside it")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="records of several calls to merge")
    return ap


def main(argv: list[str]) -> int:
    from benchmarks.engine import method

    a = parser().parse_args(argv)
    if a.merge:
        return _write(merge([json.loads(p.read_text()) for p in a.merge]), a.out or a.merge[0])
    start = time.monotonic()
    cache_dir = a.compile_cache or method.default_cache_dir()
    method.compile_cache_env(cache_dir)  # before anything can compile
    machine = method.machine_state(cache_dir)
    import torch

    from benchmarks.engine.report import device_name
    from kernels.triton_lib import pdl_args, set_pdl

    formats = tuple(f for f in a.formats.split(",") if f)
    if a.pdl_ab and not a.pdl:
        raise SystemExit(
            "kumo bench engine decode-c1: --pdl-ab measures PDL on against off, not with --no-pdl"
        )
    if unknown := set(formats) - set(FORMATS):
        raise SystemExit(f"unknown formats {sorted(unknown)}: choose from {', '.join(FORMATS)}")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    layers, bf16_layers, full_depth = depths(a)
    collectives = None
    if a.rank_of > 1:  # before any model is built: the slice's layers take the group's size
        from benchmarks.engine.rank_of import join_alone

        collectives = join_alone(a.rank_of)
    opts = Options(
        device=device, formats=formats, layers=layers, bf16_layers=bf16_layers,
        input_len=24 if a.tiny and a.input_len == 2048 else a.input_len,
        output_len=6 if a.tiny and a.output_len == 128 else a.output_len, num_rounds=a.rounds,
        page_size=a.page_size, chunk=32 if a.tiny and a.chunk == 2048 else a.chunk, deadline=start + a.budget_s,
        tiny=a.tiny, fp8_method=a.fp8_method, cuda_graphs=a.cuda_graphs,
        fuse_projections=a.fuse_projections, seed=a.seed,
        copy_bytes=8 * 2**20 if a.tiny else COPY_BYTES, rank_of=a.rank_of, pdl=a.pdl, pdl_ab=a.pdl_ab,
    )  # fmt: skip
    set_pdl(a.pdl)  # before any engine captures its graphs
    record = {
        "command": "kumo bench engine decode-c1 " + " ".join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "machine": machine,
        "options": {k: v for k, v in asdict(opts).items() if k != "deadline"},
        "pdl_active": pdl_args(torch.device(device))["PDL"],  # launches use it: the switch, CUDA, sm_90+
        "definition": __doc__.split("\n\n")[1].strip(),
        "geometry": {"kind": "glm-5.2", "rank_of": a.rank_of, "layers": layers, "bf16_layers": bf16_layers,
                     "full_num_layers": full_depth, "is_tiny": a.tiny},
    }  # fmt: skip
    if a.rank_of > 1:
        record["parallel"] = {
            "rank_of": a.rank_of, "tp": a.rank_of, "ep": a.rank_of, "dcp": 1,
            "layout": f"rank 0 of {a.rank_of}, alone (collectives local)",
        }  # fmt: skip
        record["rank_of_bytes"] = next(p for p in __doc__.split("\n\n") if p.startswith("`--rank-of N`"))
    rank = f"-rank-of-{a.rank_of}" if a.rank_of > 1 else ""
    out = (
        a.out
        or RESULTS / f"{datetime.date.today().isoformat()}-decode-c1{rank}{'-tiny' if a.tiny else ''}.json"
    )

    def write_so_far(measured: dict[str, Any]) -> None:
        _write(record | measured | {"wall_s": time.monotonic() - start}, out, quiet=True)

    record |= measure(opts, write_so_far, collectives)
    record["wall_s"] = time.monotonic() - start
    return _write(record, out)


def depths(a: argparse.Namespace) -> tuple[int, int, int]:
    """(quantized formats' depth, BF16's, the full depth): the flags, else 10 and 6 (tiny: 2); with
    `--rank-of` the full depth (tiny: 2) and BF16 at the quantized formats' depth (so a full-depth BF16
    slice is skipped: `no_room`)."""
    from benchmarks.engine.geometry import make_geometry

    full = make_geometry("glm-5.2", None, tiny=a.tiny, rank_of=a.rank_of).num_layers
    layers = a.layers if a.layers is not None else 2 if a.tiny else full if a.rank_of > 1 else 10
    bf16 = a.bf16_layers if a.bf16_layers is not None else layers if a.rank_of > 1 else 2 if a.tiny else 6
    return layers, bf16, full


def _write(record: dict[str, Any], out: Path, *, quiet: bool = False) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(record))
    if not quiet:
        print(markdown(record))
        print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0
