"""Cloudflare's scenarios, each named by the summary key it measures (issue 25), run by the method of
`benchmarks.engine.method`: both sides built and warmed, then rounds of A, B, B, A.

    fp8kv_vs_bf16kv_long_c64  Kimi K2.6, 64 requests of 16,384 prompt / 4,096 output tokens at once:
                              output tok/s end to end, FP8 KV / BF16 KV (BF16's pool holds fewer of
                              them: it queues or preempts the rest); the steady-decode ratio beside
    fp8kv_vs_bf16kv_c1        Kimi K2.6, one request: tok/s per user, FP8 KV / BF16 KV
    int4_vs_fp8_decode_c1     GLM 5.2, one request: tok/s per user, INT4 / FP8 weights (every Linear
                              but routers and lm_head; `experts_only`: the routed experts only), the
                              bytes ceiling (FP8 weight bytes / INT4's) beside
    int4_vs_fp8_prefill       GLM 5.2, one 8,192-token prompt: prefill tok/s, INT4 / FP8
    integrity_overhead        Kimi K2.6 at 64: wall time with the page-tag check on / off, minus 1
    vs_transformers_c64       Kimi K2.6 at 64: output tok/s, Kumo (INT4 experts, FP8 KV) / the
                              transformers peer (bf16, SDPA) in one mode
    capacity_fp8_over_bf16    Kimi K2.6: the KV tokens held when the pool first preempts, filled with
                              long requests, FP8 / BF16 (a count, not a timing)

Every size is a parameter (`ScenarioOptions`), so the CPU tests run each scenario at a tiny scale;
the defaults are the scenarios' own. Pools are the full deployment's per-GPU pool (`Geometry.kv_sizing`)
times `pool_scale`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from backend.engine import heap
from backend.engine.engine import Engine
from backend.quant.kv_scales import calibrate
from benchmarks.engine import method, warm_plan
from benchmarks.engine.geometry import Geometry, Kind, KvDtype, WeightFormat
from benchmarks.engine.offline import SALT, engine_config, random_prompts, run_offline
from benchmarks.engine.weights import build_random_model, weight_bytes
from schemas.backend import EngineRequest, SamplingParams


@dataclass(frozen=True, slots=True)
class Side:
    label: str
    weights: WeightFormat
    kv_dtype: KvDtype
    check_page_tags: bool = True
    is_transformers: bool = False  # the transformers peer (bf16 weights, its own cache)


@dataclass(frozen=True, slots=True)
class Scenario:
    kind: Kind
    a: Side
    b: Side
    concurrency: int
    input_len: int
    output_len: int
    metric: str  # the run's field the ratio divides ("kv_tokens_held": a fill of the pool, `Bench.fill`)
    definition: str
    layers: int = 4
    num_rounds: int = 3
    is_overhead: bool = False  # value = ratio - 1
    beside: tuple[str, ...] = ()  # run fields whose A / B ratio is recorded beside the value


FP8KV, BF16KV = Side("fp8-kv", "int4", "fp8"), Side("bf16-kv", "int4", "bf16")
INT4, FP8 = Side("int4", "int4-all", "bf16"), Side("fp8", "fp8-all", "bf16")
SCENARIOS: dict[str, Scenario] = {
    "fp8kv_vs_bf16kv_long_c64": Scenario(
        "kimi-k2.6", FP8KV, BF16KV, 64, 16384, 4096, "output_tok_s",
        "output tok/s end to end, 64 requests of 16,384 / 4,096 at once, FP8 KV / BF16 KV "
        "(BF16 queues or preempts what its pool cannot hold)",
        beside=("steady_decode_tok_s",),
    ),
    "fp8kv_vs_bf16kv_c1": Scenario(
        "kimi-k2.6", FP8KV, BF16KV, 1, 2048, 256, "output_tok_s_per_user",
        "output tok/s per user at concurrency 1, FP8 KV / BF16 KV",
    ),
    "int4_vs_fp8_decode_c1": Scenario(
        "glm-5.2", INT4, FP8, 1, 2048, 256, "output_tok_s_per_user",
        "output tok/s per user at concurrency 1, INT4 / FP8 weights",
    ),
    "int4_vs_fp8_prefill": Scenario(
        "glm-5.2", INT4, FP8, 1, 8192, 1, "prefill_tok_s", "prefill tok/s of one 8,192-token prompt, INT4 / FP8"
    ),
    "integrity_overhead": Scenario(
        "kimi-k2.6", Side("tags-on", "int4", "fp8"), Side("tags-off", "int4", "fp8", check_page_tags=False),
        64, 2048, 256, "wall_s",
        "wall time of 64 requests of 2,048 / 256, page-tag check on / off, minus 1 "
        "(EngineConfig.check_page_tags: every op that checks)",
        is_overhead=True,
    ),
    "vs_transformers_c64": Scenario(
        "kimi-k2.6", FP8KV, Side("transformers", "bf16", "bf16", is_transformers=True),
        64, 2048, 256, "output_tok_s",
        "output tok/s total at concurrency 64, Kumo (INT4 experts, FP8 KV) / the transformers peer",
        layers=3,
    ),
    "capacity_fp8_over_bf16": Scenario(
        "kimi-k2.6", FP8KV, BF16KV, 64, 16384, 4096, "kv_tokens_held",
        "KV tokens held when the pool first preempts, filled with 16,384-token prompts that keep decoding, "
        "FP8 / BF16",
        num_rounds=1,
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ScenarioOptions:
    device: str
    concurrency: int
    input_len: int
    output_len: int
    num_rounds: int
    chunk: int
    page_size: int
    deadline: float  # time.monotonic() after which no round starts
    pool_scale: float = 1.0  # the planned pools times this (CPU tests: a pool a tiny run can fill)
    is_warm_up: bool = True  # False only to show what a cold timed run looks like
    experts_only: bool = False  # the weights scenarios: int4 / fp8 experts, the rest BF16
    hf_mode: str = "generate"
    fp8_method: str = "fp8-block"
    cuda_graphs: bool = True
    seed: int = 0
    collectives: Any = None  # `--rank-of N`: the LocalCollectives group (benchmarks/engine/rank_of.py)
    tp: int = 1  # > 1: a real group of `tp` ranks, this process rank `rank` (benchmarks/engine/tp_group.py)
    rank: int = 0
    ep: int = 0  # expert groups (0: = tp or rank_of)
    only: str | None = None  # "A" or "B": that side alone (sides that do not fit one device together)
    profile: bool = False  # with `only`: one more run, untimed, its prefill / mixed / decode steps profiled
    warm_input_len: int | None = None  # with `only`: a shorter warm-up (None: the workload's own)
    warm_output_len: int | None = None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def sides_of(scenario: Scenario, opts: ScenarioOptions) -> dict[str, Side]:
    a, b = scenario.a, scenario.b
    if opts.experts_only and a.weights == "int4-all":
        a, b = dataclasses.replace(a, weights="int4"), dataclasses.replace(b, weights="fp8")
    return {k: side for k, side in (("A", a), ("B", b)) if opts.only in (None, k)}


class Bench:
    """The built sides of one scenario: a model per weight format, an engine (or the peer) per side."""

    def __init__(self, geometry: Geometry, sides: dict[str, Side], opts: ScenarioOptions) -> None:
        self.geometry, self.sides, self.opts = geometry, sides, opts
        self.vocab = geometry.model_config.vocab_size
        self.models: dict[WeightFormat, torch.nn.Module] = {}
        self.engines: dict[str, Engine] = {}
        self.peer: Any = None
        self.peer_chunk: int | None = None  # the peer's prefill chunk that fit (None: the whole prefill)
        self.described: dict[str, dict[str, Any]] = {}
        for key, side in sides.items():
            start = time.perf_counter()
            if side.is_transformers:
                from benchmarks.engine.hf_peer import build_hf_model

                self.peer = build_hf_model(geometry, opts.device)
                self.described[key] = dataclasses.asdict(side) | {"build_s": time.perf_counter() - start}
                continue
            self.engines[key] = self._engine(key, side)
            self.described[key] = self._describe(side, self.engines[key], time.perf_counter() - start)
        heap.freeze()  # as a backend does once started: the built models out of full collections

    def _engine(self, key: str, side: Side) -> Engine:
        opts = self.opts
        if side.weights not in self.models:
            self.models[side.weights] = build_random_model(
                self.geometry, side.weights, device=opts.device, seed=opts.seed + opts.rank,
                fp8_method=opts.fp8_method, rank=opts.rank, ep=opts.ep,
            )  # fmt: skip
        model = self.models[side.weights]
        scales = None
        if side.kv_dtype == "fp8":  # calibrated on seeded random ids, as a checkpoint without scales is
            prompts = random_prompts(2, 64, self.vocab, seed=opts.seed + 5)
            scales = calibrate(model, prompts, model_dtype=torch.bfloat16)
        sizing = self.geometry.kv_sizing(
            side.weights, side.kv_dtype, page_size=opts.page_size, fp8_method=opts.fp8_method
        )
        config = engine_config(
            max(int(sizing.num_pages * opts.pool_scale), 1), sizing.page_size, side.kv_dtype, opts.concurrency,
            opts.chunk, check_page_tags=side.check_page_tags, cuda_graphs=opts.cuda_graphs,
        )  # fmt: skip
        ranks = None
        if opts.tp > 1:  # rank 0's steps reach the other ranks tagged with this side's key
            from benchmarks.engine.tp_group import SideChannel

            ranks = SideChannel(key, opts.rank, opts.tp, torch.device(opts.device))
        return Engine(
            model,  # type: ignore[arg-type]
            config,
            vocab_size=self.vocab,
            context_window=self.geometry.model_config.max_position_embeddings,
            model_dtype=torch.bfloat16,
            device=opts.device,
            kv_scales=scales,
            ranks=ranks,
        )

    def _describe(self, side: Side, engine: Engine, build_s: float) -> dict[str, Any]:
        sizing = self.geometry.kv_sizing(
            side.weights, side.kv_dtype, page_size=self.opts.page_size, fp8_method=self.opts.fp8_method
        )
        num_pages = engine.config.num_pages
        described = dataclasses.asdict(side) | {
            "build_s": build_s,
            "weight_bytes": weight_bytes(self.models[side.weights]),
            "full_depth_weight_bytes_per_gpu": sizing.plan_weights_per_gpu,
            "kv_capacity_tokens": num_pages * engine.config.page_size,
            "requests_that_fit": num_pages
            // -(-(self.opts.input_len + self.opts.output_len) // engine.config.page_size),
            "decode_graphs": _graphs_state(engine),
        }
        if self.opts.collectives is not None:  # --rank-of N: what the real collectives would move
            from benchmarks.engine.rank_of import collective_probe

            described["collectives"] = collective_probe(
                self.models[side.weights], self.opts.collectives, vocab=self.vocab,
                context_window=self.geometry.model_config.max_position_embeddings,
                concurrency=self.opts.concurrency, device=self.opts.device,
            )  # fmt: skip
        return described

    def run(
        self,
        key: str,
        *,
        variant: str,
        seed: int = 1,
        around_step: Any = None,
        input_len: int | None = None,
        output_len: int | None = None,
    ) -> dict[str, Any]:
        """One run of the scenario's workload on side `key` (a fill, for the capacity scenario);
        `input_len` / `output_len`: other lengths than the workload's (a shorter warm-up)."""
        opts = self.opts
        if input_len is not None or output_len is not None:
            opts = dataclasses.replace(
                opts, input_len=input_len or opts.input_len, output_len=output_len or opts.output_len
            )
        if self.sides[key].is_transformers:
            from benchmarks.engine.hf_peer import run_mode

            r = run_mode(
                self.peer, opts.hf_mode, concurrency=opts.concurrency, input_len=opts.input_len,
                output_len=opts.output_len, vocab=self.vocab, device=opts.device, first_chunk=self.peer_chunk,
            )  # fmt: skip
            self.peer_chunk = r.get("prefill_chunk_size")  # later runs start where this one fit
            return r | {"variant": variant, "is_complete": True}
        graphs = self.engines[key].runner.graphs
        replays0 = graphs.num_replays if graphs is not None else 0  # the decode steps replayed: the delta
        with heap.Collections() as collections:
            r = run_offline(
                self.engines[key], variant=variant, concurrency=opts.concurrency, input_len=opts.input_len,
                output_len=opts.output_len, vocab_size=self.vocab, seed=seed,
                time_limit_s=max(opts.time_left(), 1.0), around_step=around_step,
            ).to_dict()  # fmt: skip
        r["gc"] = collections.summary()  # a slow run with a full collection in it says so
        r["graph_replays"] = graphs.num_replays - replays0 if graphs is not None else 0
        r["is_complete"] = r["output_tokens"] == opts.concurrency * opts.output_len
        if opts.output_len == 1 and r["ttft_ms_p50"]:  # one prompt: its prefill rate
            r["prefill_tok_s"] = opts.input_len * opts.concurrency / (r["ttft_ms_max"] / 1e3)
        return r

    def fill(self, key: str, *, variant: str) -> dict[str, Any]:
        """Requests of the workload's prompt length, more than the pool holds, each asking for as many
        output tokens as the pool could hold beside its prompt (so none finishes first), stepped until
        the scheduler first preempts: the most tokens the running requests held in the cache at once."""
        engine, opts = self.engines[key], self.opts
        capacity = engine.config.num_pages * engine.config.page_size
        num_requests = capacity // opts.input_len + 2
        window = engine.scheduler.context_window
        max_tokens = min(capacity, window) - opts.input_len
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"{variant}-{i}" for i in range(num_requests)]
        for rid, prompt in zip(
            ids, random_prompts(num_requests, opts.input_len, self.vocab, seed=3), strict=True
        ):
            engine.add_request(
                EngineRequest(request_id=rid, prompt_token_ids=prompt, tenant_salt=SALT, sampling=sampling)
            )
        preempt0, held, steps = engine.scheduler.num_preemptions, 0, 0
        start = time.perf_counter()
        while engine.has_unfinished and engine.scheduler.num_preemptions == preempt0:
            engine.step()
            steps += 1
            held = max(held, sum(s.num_computed_tokens for s in engine.scheduler.running))
        is_full = engine.scheduler.num_preemptions > preempt0
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished:
            engine.step()
        return {
            "variant": variant, "kv_tokens_held": held, "pool_tokens": capacity, "is_complete": is_full,
            "steps": steps, "wall_s": time.perf_counter() - start, "requests": num_requests,
        }  # fmt: skip

    def close(self) -> None:
        self.engines.clear()
        self.models.clear()
        self.peer = None
        heap.thaw()  # collects: the next scenario's models replace these
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _graphs_state(engine: Engine) -> str:
    """The buckets when pure-decode steps replay CUDA graphs, else why they run eagerly."""
    graphs = engine.runner.graphs
    if graphs is None:
        return "off"
    return f"buckets {graphs.batch_sizes}" if graphs.is_enabled else f"eager: {graphs.disabled_reason}"


def measure(name: str, geometry: Geometry, opts: ScenarioOptions) -> dict[str, Any] | None:
    """The scenario's record entry: its sides, warm-up, rounds, the ratio's summary entry and what is
    beside (`opts.only`: one side's runs, `measure_side`). On a rank > 0 of a group (`opts.tp`) it
    builds the same sides, follows rank 0's steps and returns None."""
    scenario = SCENARIOS[name]
    sides = sides_of(scenario, opts)
    bench = Bench(geometry, sides, opts)
    if opts.tp > 1:
        from benchmarks.engine.tp_group import follow, stop_channel

        channel = stop_channel(opts.rank, opts.tp, torch.device(opts.device))
        if opts.rank > 0:
            try:
                follow(bench.engines, channel)
            finally:
                bench.close()
            return None
    try:
        if opts.only is not None:
            return measure_side(name, scenario, opts, bench, opts.only)
        go: Callable[[str, str], dict[str, Any]] = (
            (lambda key, variant: bench.fill(key, variant=variant))
            if scenario.metric == "kv_tokens_held"
            else (lambda key, variant: bench.run(key, variant=variant))
        )
        warm: dict[str, Any] = {}
        for key in ("A", "B") if opts.is_warm_up else ():  # the same run untimed: the same step shapes
            warm[key] = _warm_up(name, scenario, opts, bench, key)
        count = iter(range(1 << 30))
        rounds = method.interleave(
            lambda key: go(key, f"{name}/{sides[key].label}/{next(count)}"),
            lambda r: float(r[scenario.metric]),
            num_rounds=opts.num_rounds,
            time_left=opts.time_left,
            # each side twice, as warmed (a shorter warm-up: the round starts; its deadline cuts it)
            first_round_s=0.0
            if _is_short_warm_up(scenario, opts)
            else 2.0 * sum(w["s"] for w in warm.values()),
        )
        return _entry(name, scenario, opts, bench, warm, rounds)
    finally:
        if opts.tp > 1:
            channel.stop()
        bench.close()


def measure_side(
    name: str, scenario: Scenario, opts: ScenarioOptions, bench: Bench, key: str
) -> dict[str, Any]:
    """Side `key` alone: warmed, then `num_rounds` timed runs, the metric's summary entry (not a
    ratio). Two such entries, A and B from separate processes run A, B, B, A, give the ratio
    (`benchmarks.engine.x8.combine`): for the sides that do not fit one device together."""
    side = bench.sides[key]
    is_fill = scenario.metric == "kv_tokens_held"
    go: Callable[[str], dict[str, Any]] = (
        (lambda variant: bench.fill(key, variant=variant))
        if is_fill
        else (lambda variant: bench.run(key, variant=variant))
    )
    warm = _warm_up(name, scenario, opts, bench, key) if opts.is_warm_up else None
    is_short_warm_up = _is_short_warm_up(scenario, opts)
    runs: list[dict[str, Any]] = []
    # the first run starts if two warm-ups' time is left (a shorter warm-up: it starts; its deadline cuts it)
    last_s = 2.0 * warm["s"] if warm and not is_short_warm_up else 0.0
    while len(runs) < opts.num_rounds and opts.time_left() > last_s:
        start = time.perf_counter()
        runs.append(dict(go(f"{name}/{side.label}/{len(runs)}"), side=key))
        last_s = time.perf_counter() - start
    timed = [s for run in runs for s in run.get("extra", {}).get("step_shapes", [])]
    missed = method.missing_shapes(warm["step_shapes"], timed) if warm else []
    if warm:
        _check_plan(warm, runs)
    for extra in [run.get("extra", {}) for run in runs] + ([warm] if warm else []):
        if "step_shapes" in extra:
            extra["num_step_shapes"] = len(extra.pop("step_shapes"))
    values = [float(r[scenario.metric]) for r in runs if r["is_complete"]]
    profile = None
    if opts.profile and scenario.metric != "kv_tokens_held":
        from benchmarks.engine.step_profile import StepProfiler

        profiler = StepProfiler(opts.concurrency, device=opts.device)
        bench.run(key, variant=f"{name}/{side.label}/profiled", around_step=profiler)
        profile = profiler.steps
    return {
        "scenario": name,
        "definition": scenario.definition,
        "side": key,
        "metric": scenario.metric,
        "workload": {"concurrency": opts.concurrency, "input_len": opts.input_len, "output_len": opts.output_len,
                     "chunk": opts.chunk, "page_size": opts.page_size, "pool_scale": opts.pool_scale},
        "sides": {key: bench.described[key]},
        "warm_up": warm,
        "warm_up_missed_shapes": missed,
        "runs": runs,
        "runs_incomplete": len(runs) - len(values),
        "summary": method.summary_entry(values) if values else None,
        "step_profile": profile,
    }  # fmt: skip


def _is_short_warm_up(scenario: Scenario, opts: ScenarioOptions) -> bool:
    return scenario.metric != "kv_tokens_held" and (opts.warm_input_len or opts.warm_output_len) is not None


def _warm_up(name: str, scenario: Scenario, opts: ScenarioOptions, bench: Bench, key: str) -> dict[str, Any]:
    """Side `key` run once untimed: the workload itself, or (`opts.warm_input_len` / `warm_output_len`)
    the workload at those lengths, then a probe of each step shape the scheduler plans for the timed
    run that this shorter pass did not run (`benchmarks.engine.warm_plan`)."""
    side = bench.sides[key]
    variant = f"{name}/{side.label}/warm-up"
    start = time.perf_counter()
    if scenario.metric == "kv_tokens_held":
        bench.fill(key, variant=variant)
        return {"s": time.perf_counter() - start, "step_shapes": []}
    r = bench.run(key, variant=variant, input_len=opts.warm_input_len, output_len=opts.warm_output_len)
    shapes = [list(s) for s in r.get("extra", {}).get("step_shapes", [])]
    warm: dict[str, Any] = {"step_shapes": shapes}
    if _is_short_warm_up(scenario, opts):
        warm["lengths"] = [opts.warm_input_len or opts.input_len, opts.warm_output_len or opts.output_len]
    if _is_short_warm_up(scenario, opts) and not side.is_transformers:
        config = bench.engines[key].config
        plan = warm_plan.planned_shapes(
            num_pages=config.num_pages, page_size=config.page_size, concurrency=opts.concurrency,
            chunk=config.max_num_batched_tokens, input_len=opts.input_len, output_len=opts.output_len,
        )  # fmt: skip
        probed = method.missing_shapes(shapes, plan)
        for num_prefill, num_decode in probed:
            shapes += [
                list(s)
                for s in warm_plan.probe(bench.engines[key], (num_prefill, num_decode), variant=variant)
            ]
        warm |= {"planned_shapes": plan, "probed_shapes": probed}
    return {"s": time.perf_counter() - start} | warm


def _check_plan(warm: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """A planned warm-up: whether every complete timed run took exactly the planned step shapes."""
    plan = warm.pop("planned_shapes", None)
    if plan is not None:
        timed = [
            {tuple(x) for x in run.get("extra", {}).get("step_shapes", [])}
            for run in runs
            if run["is_complete"]
        ]
        warm["plan_matched_timed"] = all(t == {tuple(x) for x in plan} for t in timed)


def _entry(
    name: str,
    scenario: Scenario,
    opts: ScenarioOptions,
    bench: Bench,
    warm: dict[str, Any],
    rounds: list[dict[str, Any]],
) -> dict[str, Any]:
    complete = [r for r in rounds if all(run["is_complete"] for run in r["runs"])]
    ratios = [r["ratio"] - 1.0 if scenario.is_overhead else r["ratio"] for r in complete]
    missed: dict[str, list[list[int]]] = {}
    for key in ("A", "B"):
        timed = [
            s
            for r in rounds
            for run in r["runs"]
            if run["side"] == key
            for s in run.get("extra", {}).get("step_shapes", [])
        ]
        missed[key] = method.missing_shapes(warm.get(key, {}).get("step_shapes", []), timed)
    for key, w in warm.items():
        _check_plan(w, [run for r in rounds for run in r["runs"] if run["side"] == key])
    for run in [run for r in rounds for run in r["runs"]] + list(warm.values()):
        extra = run.get("extra", run)  # the shapes are compared above; the record keeps their count
        if "step_shapes" in extra:
            extra["num_step_shapes"] = len(extra.pop("step_shapes"))
    beside: dict[str, Any] = {}
    for field in scenario.beside:
        per_round = [
            method.round_ratio(
                *[[run["extra"][field] for run in r["runs"] if run["side"] == k] for k in ("A", "B")]
            )
            for r in complete
        ]
        beside[f"{field}_ratio"] = method.summary_entry(per_round) if per_round else None
    a, b = bench.described["A"], bench.described["B"]
    beside |= weights_beside(scenario, a, b)
    return {
        "scenario": name,
        "definition": scenario.definition,
        "workload": {"concurrency": opts.concurrency, "input_len": opts.input_len, "output_len": opts.output_len,
                     "chunk": opts.chunk, "page_size": opts.page_size, "pool_scale": opts.pool_scale},
        "sides": {"A": a, "B": b},
        "warm_up": warm if opts.is_warm_up else None,
        "warm_up_missed_shapes": missed,
        "order": method.order(len(rounds)),
        "rounds": rounds,
        "rounds_incomplete": len(rounds) - len(complete),
        "rounds_skipped": opts.num_rounds - len(rounds),
        "summary": method.summary_entry(ratios) if ratios else None,
        "beside": beside,
    }  # fmt: skip


def weights_beside(scenario: Scenario, a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Where the sides differ in weight format: B's weight bytes over A's (what a decode step reads),
    at this depth and at full depth, and A's checkpoint as a share of B's; else nothing."""
    if scenario.a.weights == scenario.b.weights or scenario.b.is_transformers:
        return {}
    full = b["full_depth_weight_bytes_per_gpu"] / a["full_depth_weight_bytes_per_gpu"]
    return {
        "bytes_ceiling": b["weight_bytes"] / a["weight_bytes"],
        "bytes_ceiling_full_depth": full,
        "int4_checkpoint_over_fp8": 1.0 / full,
    }
