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

    kumo bench engine decode-c1 [--layers 10] [--bf16-layers 6] [--formats int4,fp8,int4-all,fp8-all,bf16]
                                [--no-fuse-projections]   (the before side of the same-input fusion)
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
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
SUMMARY_KEY = "decode_c1_bytes_ratio"
GOAL = "<= 1.3x at 10 layers"
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

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def token_bytes(model: Any, top_k: int) -> dict[str, int]:
    """Weight bytes one token reads at concurrency 1, by part (see the module docstring)."""
    from backend.models.layers.moe import Experts
    from backend.quant.experts import QuantExperts

    routed = {name for name, m in model.named_modules() if isinstance(m, Experts | QuantExperts)}
    local = {name: m.e1 - m.e0 for name, m in model.named_modules() if isinstance(m, Experts | QuantExperts)}
    parts: dict[str, int] = {}
    for name, t in model.state_dict().items():
        if name.endswith("weight_shape"):  # checkpoint metadata, never read by a step
            continue
        nbytes = t.numel() * t.element_size()
        owner = name.rpartition(".")[0]
        if owner in routed:
            part, nbytes = "routed_experts_touched", nbytes * min(top_k, local[owner]) // local[owner]
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


def measure_format(fmt: str, opts: Options, probe: CopyProbe, deadline: float) -> dict[str, Any]:
    """One format: build, warm, A/B/B/A rounds; its entry (summary over the complete rounds)."""
    import torch

    from backend.engine.engine import Engine
    from benchmarks.engine import method
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.offline import engine_config, run_offline
    from benchmarks.engine.weights import build_random_model

    start = time.perf_counter()
    layers = opts.bf16_layers if fmt == "bf16" else opts.layers
    geometry = make_geometry("glm-5.2", layers, tiny=opts.tiny)
    config = geometry.model_config
    model = build_random_model(
        geometry, fmt, device=opts.device, seed=opts.seed, fp8_method=opts.fp8_method,  # type: ignore[arg-type]
        fuse_projections=opts.fuse_projections,
    )  # fmt: skip
    num_pages = -(-(opts.input_len + opts.output_len) // opts.page_size) + 1
    engine = Engine(
        model,  # type: ignore[arg-type]
        engine_config(num_pages, opts.page_size, "bf16", 1, opts.chunk, cuda_graphs=opts.cuda_graphs),
        vocab_size=config.vocab_size,
        context_window=config.max_position_embeddings,
        model_dtype=torch.bfloat16,
        device=opts.device,
    )
    weights = token_bytes(model, int(geometry.text["num_experts_per_tok"]))
    context = opts.input_len + opts.output_len / 2  # the mean context of the decode steps
    kv_per_token = kv_bytes_per_token(engine)
    kv = kv_per_token * context
    read = sum(weights.values()) + kv
    count = iter(range(1 << 30))

    def run(side: str) -> dict[str, Any]:
        if side == "B":
            bw = probe.bandwidth()
            return {"copy_GBps": bw / 1e9, "bytes_ms": read / bw * 1e3, "is_complete": True}
        r = run_offline(
            engine, variant=f"{fmt}/{next(count)}", concurrency=1, input_len=opts.input_len,
            output_len=opts.output_len, vocab_size=config.vocab_size, seed=1,
            time_limit_s=max(deadline - time.monotonic(), 1.0),
        ).to_dict()  # fmt: skip
        r["is_complete"] = r["output_tokens"] == opts.output_len and r["extra"].get("decode_steps", 0) > 0
        r["step_ms"] = r["extra"].get("decode_step_ms_p50", float("nan"))
        return r

    warm_start = time.perf_counter()
    warm = {"A": run("A"), "B": run("B")}
    warm_s = time.perf_counter() - warm_start
    rounds = method.interleave(
        run,
        lambda r: float(r["step_ms"] if "step_ms" in r else r["bytes_ms"]),
        num_rounds=opts.num_rounds,
        time_left=lambda: deadline - time.monotonic(),
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
    return {
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


def measure(opts: Options, on_format: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every format in turn (each gets an even share of the time left), then the summary entry;
    `on_format` sees the formats measured so far after each (the CLI writes them: a call cut off by
    its device time keeps what it finished)."""
    import gc

    import torch

    probe = CopyProbe(opts.device, opts.copy_bytes)
    formats: dict[str, Any] = {}
    for i, fmt in enumerate(opts.formats):
        share = opts.time_left() / (len(opts.formats) - i)
        formats[fmt] = measure_format(fmt, opts, probe, time.monotonic() + share)
        gc.collect()  # the format's model, engine and CUDA graphs, before the next one is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if on_format is not None:
            on_format(summarize(formats))
    return summarize(formats)


def summarize(formats: dict[str, Any]) -> dict[str, Any]:
    """The formats' entries and the summary key: the worst (largest) ratio's entry; beside it the
    worst quantized format's (BF16's routed experts have no fused kernel: a captured decode step runs
    every expert, `Experts.forward_every_expert`, so BF16 reads E / k times its experts' bytes)."""
    measured = {f: e["summary"] for f, e in formats.items() if e["summary"]}
    worst = max(measured, key=lambda f: measured[f]["value"]) if measured else None
    quantized = [f for f in measured if f != "bf16"]
    worst_quantized = max(quantized, key=lambda f: measured[f]["value"]) if quantized else None
    return {
        "formats": formats,
        "worst_format": worst,
        "worst_quantized_format": worst_quantized,
        "worst_quantized": measured[worst_quantized] if worst_quantized else None,
        "summary": {SUMMARY_KEY: measured[worst] if worst else None},
        "summary_detail": {
            SUMMARY_KEY: "decode step at concurrency 1 / (bytes a token reads / copy bandwidth), the worst of "
            + ", ".join(f"{f} {e['value']:.2f}x" for f, e in measured.items())
        },
    }


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Records of several calls (formats split over 10-minute device calls) as one: every format's
    entry (a later record's wins), the summary over them all, each call under `sources`."""
    formats = {f: e for r in records for f, e in r["formats"].items()}
    sources = [{k: r[k] for k in ("command", "date", "device", "machine", "wall_s")} for r in records]
    return dict(records[-1]) | {"sources": sources} | summarize(formats)


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# Decode step at concurrency 1 against its bytes ({record['date']}, {record['device']})",
        "",
        f"`{SUMMARY_KEY}` = {_entry_text(record['summary'][SUMMARY_KEY])} (worst format: "
        f"{record['worst_format']}; goal {GOAL}); worst quantized format "
        f"{record.get('worst_quantized_format')}: {_entry_text(record.get('worst_quantized'))}.",
        "",
        "| weights | layers | step ms | bytes read MB | copy GB/s | ratio [spread] | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt, e in record["formats"].items():
        runs = [run for r in e["rounds"] for run in r["runs"]]
        steps = [run["step_ms"] for run in runs if run["side"] == "A"]
        bws = [run["copy_GBps"] for run in runs if run["side"] == "B"]
        lines.append(
            f"| {fmt} | {e['layers']} | {_median(steps):.3f} | {e['bytes_read'] / 1e6:.1f} | {_median(bws):.0f} "
            f"| {_entry_text(e['summary'])} | {len(e['rounds'])} |"
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
    ap.add_argument("--layers", type=int, default=10, help="truncated depth of the quantized formats")
    ap.add_argument("--bf16-layers", type=int, default=6, help="truncated depth of BF16 (what fits one GPU)")
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

    formats = tuple(f for f in a.formats.split(",") if f)
    if unknown := set(formats) - set(FORMATS):
        raise SystemExit(f"unknown formats {sorted(unknown)}: choose from {', '.join(FORMATS)}")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    opts = Options(
        device=device, formats=formats, layers=2 if a.tiny and a.layers == 10 else a.layers,
        bf16_layers=2 if a.tiny and a.bf16_layers == 6 else a.bf16_layers,
        input_len=24 if a.tiny and a.input_len == 2048 else a.input_len,
        output_len=6 if a.tiny and a.output_len == 128 else a.output_len, num_rounds=a.rounds,
        page_size=a.page_size, chunk=32 if a.tiny and a.chunk == 2048 else a.chunk, deadline=start + a.budget_s,
        tiny=a.tiny, fp8_method=a.fp8_method, cuda_graphs=a.cuda_graphs,
        fuse_projections=a.fuse_projections, seed=a.seed,
        copy_bytes=8 * 2**20 if a.tiny else COPY_BYTES,
    )  # fmt: skip
    record = {
        "command": "kumo bench engine decode-c1 " + " ".join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "machine": machine,
        "options": {k: v for k, v in asdict(opts).items() if k != "deadline"},
        "definition": __doc__.split("\n\n")[1].strip(),
    }
    out = a.out or RESULTS / f"{datetime.date.today().isoformat()}-decode-c1{'-tiny' if a.tiny else ''}.json"

    def write_so_far(measured: dict[str, Any]) -> None:
        _write(record | measured | {"wall_s": time.monotonic() - start}, out, quiet=True)

    record |= measure(opts, write_so_far)
    record["wall_s"] = time.monotonic() - start
    return _write(record, out)


def _write(record: dict[str, Any], out: Path, *, quiet: bool = False) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(record))
    if not quiet:
        print(markdown(record))
        print(f"wrote {out}, {out.with_suffix('.md')}")
    return 0
