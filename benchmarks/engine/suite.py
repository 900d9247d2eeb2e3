"""One variant (weight format × KV dtype) measured end to end, and the interleaved tag-check A/B.

A variant builds its random model on the device, sizes the page pool from `kumo plan`
(`Geometry.kv_sizing`), builds an `Engine` over it, warms up, then measures the long-prompt
prefill and the offline runs at each concurrency (plus the largest that fits the pool, capped),
and frees everything before the next variant. Runs that would start past the command's deadline
are recorded as skipped, never estimated.

This is a sweep (throughput against concurrency, for the plots): one sample a point, variants one
after the other, so it gives no summary ratio; those come from `benchmarks.engine.scenarios`, warm
and A/B/B/A. Its warm-up is the method's all the same: each level's timed run once, untimed.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from backend.engine.engine import Engine
from backend.quant.kv_scales import calibrate
from benchmarks.engine.geometry import Geometry, KvDtype, WeightFormat
from benchmarks.engine.method import missing_shapes
from benchmarks.engine.offline import (
    engine_config,
    random_prompts,
    run_offline,
    run_prefill,
    warm_up,
)
from benchmarks.engine.step_profile import StepProfiler
from benchmarks.engine.weights import build_random_model, weight_bytes


@dataclass(frozen=True, slots=True)
class Options:
    device: str
    input_len: int
    output_len: int
    prefill_len: int
    concurrencies: tuple[int, ...]
    max_concurrency_cap: int  # the "largest that fits" run is capped here (0: no such run)
    chunk: int
    page_size: int
    fp8_method: str
    deadline: float  # time.monotonic() after which no run starts
    seed: int = 0
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (EngineConfig.cuda_graphs)
    profile_concurrency: int = 0  # after the timed runs, one more at this concurrency, three steps profiled
    speculative: int = 0  # draft tokens per step (`--speculative mtp:K`), with one random MTP layer

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def variant_name(fmt: WeightFormat, kv_dtype: KvDtype) -> str:
    return f"{fmt}-weights/{kv_dtype}-kv"


class Variant:
    """A built model + engine of one format; `close()` frees the device memory."""

    def __init__(self, geometry: Geometry, fmt: WeightFormat, kv_dtype: KvDtype, opts: Options) -> None:
        self.name, self.fmt, self.kv_dtype = variant_name(fmt, kv_dtype), fmt, kv_dtype
        self.config = geometry.model_config
        device = torch.device(opts.device)
        mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        self.model = build_random_model(
            geometry,
            fmt,
            device=device,
            seed=opts.seed,
            fp8_method=opts.fp8_method,
            num_mtp_layers=1 if opts.speculative else 0,
        )
        self.build_s = time.perf_counter() - t0
        self.weight_bytes = weight_bytes(self.model)
        self.weight_mem_allocated = (
            (torch.cuda.memory_allocated(device) - mem0) if device.type == "cuda" else None
        )
        self.sizing = geometry.kv_sizing(fmt, kv_dtype, page_size=opts.page_size, fp8_method=opts.fp8_method)
        self.tokens_per_request = opts.input_len + opts.output_len
        self.max_concurrency = self.sizing.max_concurrency(self.tokens_per_request)
        self.scales = None
        if kv_dtype == "fp8":  # calibrated on seeded random ids, as a checkpoint without scales is
            prompts = random_prompts(2, 64, self.config.vocab_size, seed=opts.seed + 5)
            self.scales = calibrate(self.model, prompts, model_dtype=torch.bfloat16)
        self.device, self.opts = device, opts
        self.engine = self.build_engine()
        self.kv_bytes = sum(
            t.numel() * t.element_size()
            for layer in self.engine.runner.kv_cache.layers
            for t in layer.values()
        )

    def build_engine(self, *, check_page_tags: bool = True) -> Engine:
        """An engine over this variant's model with its own page pool of the planned size."""
        opts = self.opts
        top = max([*opts.concurrencies, min(self.max_concurrency, opts.max_concurrency_cap), 1])
        config = engine_config(
            self.sizing.num_pages,
            opts.page_size,
            self.kv_dtype,
            top,
            opts.chunk,
            check_page_tags=check_page_tags,
            cuda_graphs=opts.cuda_graphs,
            num_speculative_tokens=opts.speculative,
        )
        return Engine(
            self.model,  # type: ignore[arg-type]
            config,
            vocab_size=self.config.vocab_size,
            context_window=self.config.max_position_embeddings,
            model_dtype=torch.bfloat16,
            device=self.device,
            kv_scales=self.scales,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "variant": self.name,
            "weights": self.fmt,
            "kv_dtype": self.kv_dtype,
            "build_s": self.build_s,
            "weight_bytes": self.weight_bytes,
            "weight_mem_allocated": self.weight_mem_allocated,
            "kv_bytes": self.kv_bytes,
            "kv_capacity_tokens": self.sizing.num_pages * self.sizing.page_size,
            "kv_sizing": asdict(self.sizing),
            "tokens_per_request": self.tokens_per_request,
            "max_concurrency": self.max_concurrency,
        }

    def close(self) -> None:
        del self.engine, self.model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_variant(
    geometry: Geometry, fmt: WeightFormat, kv_dtype: KvDtype, opts: Options
) -> dict[str, Any]:
    v = Variant(geometry, fmt, kv_dtype, opts)
    try:
        vocab = v.config.vocab_size
        warm_up(v.engine, vocab_size=vocab, prompt_len=min(opts.chunk, opts.prefill_len, opts.input_len * 4))
        out = v.describe()
        out["prefill"] = run_prefill(v.engine, variant=v.name, prefill_len=opts.prefill_len, vocab_size=vocab)
        largest = min(v.max_concurrency, opts.max_concurrency_cap)
        levels = sorted(
            {c for c in opts.concurrencies if c <= v.max_concurrency} | ({largest} if largest > 0 else set())
        )
        out["largest_run_concurrency"] = largest
        out["warmup_s"], warm_shapes = warm_up_levels(v.engine, levels, opts, vocab_size=vocab)
        out["runs"], out["skipped"] = [], []
        for c in levels:
            if opts.time_left() <= 0:
                out["skipped"].append({"concurrency": c, "why": "command deadline reached before this run"})
                continue
            r = run_offline(
                v.engine, variant=v.name, concurrency=c, input_len=opts.input_len, output_len=opts.output_len,
                vocab_size=vocab, time_limit_s=max(opts.time_left(), 1.0),
            )  # fmt: skip
            r.extra["is_largest"] = c == largest
            r.extra["is_complete"] = r.finished == c and r.output_tokens == c * opts.output_len
            out["runs"].append(r.to_dict())
        timed_shapes = [s for r in out["runs"] for s in r["extra"].pop("step_shapes", [])]
        out["warmup_missed_shapes"] = missing_shapes(warm_shapes, timed_shapes)
        for c in opts.concurrencies:
            if c > v.max_concurrency:
                out["skipped"].append({"concurrency": c, "why": f"pool holds {v.max_concurrency} requests"})
        c = opts.profile_concurrency
        if 0 < c <= v.max_concurrency and opts.time_left() > 0:  # untimed: the profiler slows what it watches
            profiler = StepProfiler(c, device=opts.device)
            run_offline(
                v.engine, variant=v.name, concurrency=c, input_len=opts.input_len, output_len=opts.output_len,
                vocab_size=vocab, time_limit_s=max(opts.time_left(), 1.0), around_step=profiler, seed=2,
            )  # fmt: skip
            out["step_profile"] = {"concurrency": c, "steps": profiler.steps}
        return out
    finally:
        v.close()


def warm_up_levels(
    engine: Engine, levels: list[int], opts: Options, *, vocab_size: int
) -> tuple[float, list[list[int]]]:
    """One untimed pass of each level's timed run, whole (`benchmarks.engine.method`): every step shape
    the level's steps take — prefill chunks beside each count of decode rows, decode as the batch
    narrows — compiles here and not inside a timed run. With 8 output tokens instead (until
    2026-12-04) the mixed steps of a c=64 run first appeared in its timed run (issue 25).
    Returns the seconds it took and the step shapes it ran."""
    start = time.monotonic()
    shapes: list[list[int]] = []
    for c in levels:
        if opts.time_left() <= 0:
            break
        r = run_offline(
            engine, variant="warmup", concurrency=c, input_len=opts.input_len, output_len=opts.output_len,
            vocab_size=vocab_size, seed=7, time_limit_s=max(opts.time_left(), 1.0),
        )  # fmt: skip
        shapes += r.extra["step_shapes"]
    return time.monotonic() - start, shapes


def measure_integrity(
    geometry: Geometry, fmt: WeightFormat, kv_dtype: KvDtype, opts: Options, *, concurrency: int, repeats: int
) -> dict[str, Any]:
    """Tag check on vs off (`EngineConfig.check_page_tags`): two engines over one model, each with its
    own pool of the planned size, each warmed up (compile, then one untimed run of the workload), then
    up to `repeats` rounds of on, off (A/B/A/B…) of the same workload (the same prompts every run). A
    round starts only if the previous one would still fit before the deadline."""
    opts = dataclasses.replace(opts, concurrencies=(concurrency,), max_concurrency_cap=0)
    v = Variant(geometry, fmt, kv_dtype, opts)  # v.engine checks the tags
    engines = {"on": v.engine}
    try:
        engines["off"] = v.build_engine(check_page_tags=False)
        vocab = v.config.vocab_size

        def run(state: str) -> dict[str, Any]:
            r = run_offline(
                engines[state], variant=f"{v.name}/tags-{state}", concurrency=concurrency,
                input_len=opts.input_len, output_len=opts.output_len, vocab_size=vocab, seed=100,
            )  # fmt: skip
            return r.to_dict()

        for state in engines:
            warm_up(
                engines[state],
                vocab_size=vocab,
                prompt_len=min(opts.chunk, opts.prefill_len, opts.input_len * 4),
            )
            run(state)
        rounds: list[dict[str, dict[str, Any]]] = []
        round_s = 0.0
        while len(rounds) < repeats and opts.time_left() > round_s:
            start = time.monotonic()
            rounds.append({state: run(state) for state in ("on", "off")})
            round_s = time.monotonic() - start
        return (
            v.describe()
            | {
                "concurrency": concurrency,
                "switched": SWITCHED,
                "order": "on, off in every round (A/B/A/B...), after an untimed run of each",
                "rounds_skipped": repeats - len(rounds),
            }
            | ab_summary(rounds)
        )
    finally:
        engines.clear()
        v.close()


SWITCHED = (
    "EngineConfig.check_page_tags: every op that checks (kv_write, attention, DSA indexer; "
    "GPU kernels and CPU references alike)"
)


def ab_summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per state: the runs and their TPOT median/min/max/stdev; the overhead = the median over rounds
    of TPOT on / TPOT off - 1 within the round, with its min, max and stdev."""
    out: dict[str, Any] = {"samples": {state: [r[state] for r in rounds] for state in ("on", "off")}}
    for state in ("on", "off"):
        tpot = [r[state]["tpot_ms_p50"] for r in rounds if r[state]["tpot_ms_p50"] is not None]
        tput = [r[state]["output_tok_s"] for r in rounds]
        out[state] = {
            "n": len(tpot),
            "tpot_ms_median": statistics.median(tpot) if tpot else None,
            "tpot_ms_min": min(tpot) if tpot else None,
            "tpot_ms_max": max(tpot) if tpot else None,
            "tpot_ms_stdev": statistics.stdev(tpot) if len(tpot) > 1 else 0.0,
            "output_tok_s_median": statistics.median(tput) if tput else None,
        }
    diffs = [
        r["on"]["tpot_ms_p50"] / r["off"]["tpot_ms_p50"] - 1.0
        for r in rounds
        if r["on"]["tpot_ms_p50"] and r["off"]["tpot_ms_p50"]
    ]
    out["overhead_per_round"] = diffs
    out["overhead"] = statistics.median(diffs) if diffs else None
    out["overhead_min"] = min(diffs) if diffs else None
    out["overhead_max"] = max(diffs) if diffs else None
    out["overhead_stdev"] = statistics.stdev(diffs) if len(diffs) > 1 else None
    return out
