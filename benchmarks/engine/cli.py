"""`kumo bench engine COMPARISON`: one comparison per command, a table printed, JSON + Markdown + PNGs.

    weights       INT4-expert vs FP8 weights        (default: GLM 5.2 geometry, BF16 KV)
    kv            BF16 vs FP8 KV cache              (default: Kimi K2.6 geometry, INT4-expert weights)
    integrity     tag check on vs off, interleaved  (default: Kimi K2.6, INT4 experts, FP8 KV)
    transformers  Kumo vs the transformers peer     (default: Kimi K2.6; Kumo int4/fp8-KV and bf16/bf16-KV)
    variant       any one variant (--weights, --kv-dtype)
    scenario      one of Cloudflare's scenarios, warm and A/B/B/A: the summary's ratios (`scenario_cli.py`)
    decode-c1     the decode step at concurrency 1 over its bytes, every weight format (`decode_c1.py`)
    report        merge records of several commands: `report A.json B.json … --out X.json`
    combine       one-side records (`scenario … --side A|B`), processes A, B, B, A: the scenario's record
    host          the engine's host time per decode step, model excluded (`benchmarks/engine/host_overhead.py`)
    mtp           speculative decoding: speedup at c=1, c=64 on vs off, GLM 5.2 projection (`mtp_gpu.py`)

Everything runs on `--device` (cuda when there is one). `--tiny` swaps in a small geometry and
short lengths so the pipeline runs on a CPU in seconds (the tests do). `--budget-s` bounds the
command: a run that would start after it is recorded as skipped, so one command fits a 10-minute
device call. Imports no msgspec itself; the engine it drives does (carry the wheel, see README).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.engine import report

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMPARISONS = ("weights", "kv", "integrity", "transformers", "variant")
DEFAULT_KIND = {
    "weights": "glm-5.2",
    "kv": "kimi-k2.6",
    "integrity": "kimi-k2.6",
    "transformers": "kimi-k2.6",
    "variant": "kimi-k2.6",
}
TINY = {"input_len": 16, "output_len": 4, "prefill_len": 64, "chunk": 256, "max_concurrency_cap": 16}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench engine", description=__doc__.splitlines()[0])
    ap.add_argument("comparison", choices=(*COMPARISONS, "report"))
    ap.add_argument("inputs", nargs="*", type=Path, help="report: the records to merge")
    ap.add_argument("--kind", choices=("glm-5.2", "kimi-k2.6"))
    ap.add_argument(
        "--layers", type=int, default=4, help="truncated depth: 1 dense + (layers-1) MoE (default 4)"
    )
    ap.add_argument("--tiny", action="store_true", help="small geometry and lengths (CPU tests)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=8192, help="the one long prompt of the prefill figure")
    ap.add_argument("--concurrency", type=_ints, default=(1, 8, 64), help="comma-separated (default 1,8,64)")
    ap.add_argument(
        "--max-concurrency-cap", type=int, default=256, help="cap on the 'largest that fits' run (0: none)"
    )
    ap.add_argument(
        "--chunk", type=int, default=2048, help="prefill tokens per step (max_num_batched_tokens)"
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--fp8-method", choices=("fp8-block", "fp8-channel"), default="fp8-block")
    ap.add_argument("--weights", choices=("bf16", "fp8", "int4", "int4-all", "fp8-all"), default="int4")
    ap.add_argument(
        "--all-linear", action="store_true",
        help="weights: int4-all vs fp8-all (every Linear but routers and lm_head) instead of the routed experts only",
    )  # fmt: skip
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default=None)
    ap.add_argument("--repeats", type=int, default=4, help="integrity: on/off pairs")
    ap.add_argument("--integrity-concurrency", type=int, default=64)
    ap.add_argument(
        "--kumo", default="int4:fp8,bf16:bf16", help="transformers: Kumo variants weights:kv, comma-separated"
    )
    ap.add_argument("--hf-modes", default="generate,generate_batch,generate-static")
    ap.add_argument(
        "--hf-concurrency", type=_ints, default=None, help="transformers runs (default: --concurrency)"
    )
    ap.add_argument("--budget-s", type=float, default=540.0, help="no run starts after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay decode steps from CUDA graphs (EngineConfig.cuda_graphs; CUDA only)",
    )
    ap.add_argument(
        "--profile-concurrency", type=int, default=0,
        help="after the timed runs, one untimed run at this concurrency with three steps profiled "
        "(prefill alone, prefill beside decode rows, pure decode; benchmarks/engine/step_profile.py)",
    )  # fmt: skip
    ap.add_argument(
        "--speculative", default="off", metavar="mtp:K",
        help="draft K = 1..3 tokens per step with a random MTP layer (its cost; acceptance needs trained weights)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="record path (.json); .md and PNGs beside it")
    return ap


def _defaults_for_tiny(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    for key, value in TINY.items():
        if getattr(a, key) == ap.get_default(key):
            setattr(a, key, value)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["host"]:  # its own options: a CPU measurement, no geometry or device
        from benchmarks.engine import host_overhead

        return host_overhead.main(args[1:])
    if args[:1] == ["decode-c1"]:  # its own options: every weight format at concurrency 1
        from benchmarks.engine import decode_c1

        return decode_c1.main(args[1:])
    if args[:1] == ["mtp"]:  # its own options: speculative decoding on the nano models, a projection
        from benchmarks.engine import mtp_gpu

        return mtp_gpu.main(args[1:])
    if args[:1] == ["combine"]:  # its own options: one-side records, processes A, B, B, A, into one
        from benchmarks.engine import side_records

        return side_records.main(args[1:])
    if args[:1] == ["scenario"]:  # its own options: the scenario's sizes
        from benchmarks.engine import scenario_cli

        return scenario_cli.main(args[1:])
    ap = parser()
    a = ap.parse_args(args)
    if a.comparison == "report":
        return _report(a)
    if a.tiny:
        _defaults_for_tiny(a, ap)
    import torch

    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.suite import Options, measure_integrity, measure_variant
    from schemas.backend import parse_speculative

    start = time.monotonic()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = a.kind or DEFAULT_KIND[a.comparison]
    geometry = make_geometry(kind, a.layers, tiny=a.tiny)
    opts = Options(
        device=device, input_len=a.input_len, output_len=a.output_len, prefill_len=a.prefill_len,
        concurrencies=a.concurrency, max_concurrency_cap=a.max_concurrency_cap, chunk=a.chunk,
        page_size=a.page_size, fp8_method=a.fp8_method, deadline=start + a.budget_s, seed=a.seed,
        cuda_graphs=a.cuda_graphs, profile_concurrency=a.profile_concurrency,
        speculative=parse_speculative(a.speculative),
    )  # fmt: skip
    options = {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(a).items() if k not in ("inputs", "out")
    }
    record = report.new_record(
        " ".join(["kumo bench engine", *args]), device, geometry.describe(), options, a.comparison
    )
    out = (
        a.out
        or RESULTS
        / f"{datetime.date.today().isoformat()}-engine-{a.comparison}-{kind}{'-tiny' if a.tiny else ''}.json"
    )

    def save() -> list[str]:  # after every phase: a call killed at its limit still leaves a record
        record["wall_s"] = time.monotonic() - start
        return report.write(report.finish(record), out)

    def share(phases_left: int) -> Options:  # each phase gets an equal part of the time left
        left = max(opts.deadline - time.monotonic(), 0.0)
        return dataclasses.replace(opts, deadline=time.monotonic() + left / phases_left)

    if a.comparison == "weights":
        for i, fmt in enumerate(("int4-all", "fp8-all") if a.all_linear else ("int4", "fp8")):
            report.add_variant(record, measure_variant(geometry, fmt, a.kv_dtype or "bf16", share(2 - i)))
            save()
    elif a.comparison == "kv":
        for i, kv in enumerate(("bf16", "fp8")):
            report.add_variant(record, measure_variant(geometry, a.weights, kv, share(2 - i)))
            save()
    elif a.comparison == "variant":
        report.add_variant(record, measure_variant(geometry, a.weights, a.kv_dtype or "bf16", opts))
    elif a.comparison == "integrity":
        record["integrity"] = measure_integrity(
            geometry,
            a.weights,
            a.kv_dtype or "fp8",
            opts,
            concurrency=a.integrity_concurrency,
            repeats=a.repeats,
        )
        for state in ("on", "off"):
            record["runs"] += [
                {"source": "kumo-integrity", "tags": state} | s for s in record["integrity"]["samples"][state]
            ]
    else:
        from benchmarks.engine.hf_peer import measure_transformers

        specs = [spec.split(":") for spec in a.kumo.split(",")]
        for i, (fmt, kv) in enumerate(specs):  # the transformers peer is the last phase
            report.add_variant(record, measure_variant(geometry, fmt, kv, share(len(specs) + 1 - i)))  # type: ignore[arg-type]
            save()
        hf_deadline = max(opts.deadline, time.monotonic() + 60)  # the peer always gets a minute

        def on_mode(hf: dict[str, Any]) -> None:
            report.add_transformers(record, hf)
            save()

        hf = measure_transformers(
            geometry, device=device, concurrencies=a.hf_concurrency or a.concurrency, input_len=a.input_len,
            output_len=a.output_len, modes=tuple(a.hf_modes.split(",")), deadline=hf_deadline, on_mode=on_mode,
        )  # fmt: skip
        report.add_transformers(record, hf)
    paths = save()
    print(report.markdown(record))
    print("wrote " + ", ".join(paths))
    return 0


def _report(a: argparse.Namespace) -> int:
    if not a.inputs or a.out is None:
        print("kumo bench engine report A.json [B.json …] --out MERGED.json", file=sys.stderr)
        return 2
    records: list[dict[str, Any]] = [json.loads(p.read_text()) for p in a.inputs]
    merged = report.merge(records)
    merged["command"] = "kumo bench engine report " + " ".join(str(p) for p in a.inputs)
    merged["projection_note"] = records[0].get("projection_note", "")
    paths = report.write(merged, a.out)
    print(report.markdown(merged))
    print("wrote " + ", ".join(paths))
    return 0
