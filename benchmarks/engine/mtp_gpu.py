"""`kumo bench engine mtp`: speculative decoding on the GPU (issue 28, deliverable 6).

    kumo bench engine mtp [--models models/glm-5.2-nano,models/kimi-k2.6-nano] [--budget-s 450]
        → benchmarks/results/<date>-mtp-gpu.json

Three parts, one command:

1. `speedup_c1`, per nano model and task: per-user decode tok/s at concurrency 1, speculation on
   (`--speculative mtp:K` as served: the adaptive draft policy) ÷ off. The prompts are the recipe's
   held-out test items (`benchmarks.engine.mtp_acceptance.held_out_prompts`), run one at a time,
   greedy, to a stop token or `--max-tokens`; a run's rate is Σ(tokens − 1) / Σ(last − first token
   time) over its prompts. Both sides give the same tokens (checked). Method
   (`benchmarks.engine.method`): each engine built as a GPU backend starts (its start-up warm-up,
   backend/server/warmup.py), each side warmed on the same prompts, then `--rounds` rounds of
   A, B, B, A (A = on); a round's ratio (a1 + a2) / (b1 + b2); median and spread.
2. c = 64 throughput, per nano model: `--c64` requests at once (the held-out prompts, cycled), output
   tok/s on ÷ off, A/B/B/A as above, `speculative_max_seqs` = 64 so that the draft policy, not the
   cap, decides (it should turn drafting down: the record counts the steps by draft length).
   `--c64-waves N`: each run N such bursts one after another (a burst lasts ~0.1 s on the H100).
   Beside the rounds of both parts, one run with the policy off (always K drafts: `fixed_k_run`),
   and in every run the policy's measured draft cost, to tell what it chose from.
3. A projection for GLM 5.2's full geometry at one rank of 8 (`--rank-of 8`: rank 0's slice, its
   collectives local, benchmarks/engine/rank_of.py), random INT4-expert weights and a random MTP
   layer: the median c = 1 step time of plain decoding and of a speculative step with k = 1 … K
   drafts (always k: random drafts are rejected, so each step verifies k and drafts k), at two or more
   truncated depths (`--depths`, default 8, 16, 24), a least-squares line through them extrapolated
   to the full depth; then
       projected speedup_c1(K) = E(K) · t_plain / t_spec(K)
   Each (depth, k) engine first runs the timed work twice (every step shape: the prompt, the first
   drafting step, the whole steps, the window's end), then `PROJECTION_RUNS` timed runs; its time is
   the median over those runs' steady steps (plain decode steps, or whole speculative steps), and the
   record says how its steps ran (graphs captured, or why not). A projection whose step times are not
   monotonic (more layers or more drafts costing less), grow per layer faster than k + 1 plain
   rows', cost per layer between neighbouring depths more than `SLOPE_TOLERANCE` apart (a step bound
   by the host at the shallow depths and by the device at the deep ones: its slope then understates
   the device's cost a layer), or whose speculative steps did not replay their graphs, is refused
   (`refusals`): the record keeps the times and says why, and projects nothing (2026-12-05: k = 3 at
   8 layers took 20.7 ms against 2.4 at 4, its verify graphs having failed to capture, and projected
   0.06x; session 13: at 4 and 8 layers k = 3 grew 0.195 ms a layer against k = 1's 0.242, its
   4-layer step bound by the host's ~2 ms).
   with E(K) the tokens per verify step, from the nano GLM's measured acceptance (per task, the
   record `--acceptance`) and from GLM 5.2's published MTP figure (2.69 with 3 drafts). Labelled a
   projection: acceptance is not measured on GLM 5.2's weights, the collectives are not run, and a
   trained draft's depth-0 forward runs over E(K) rows instead of 1.

`--tiny` runs it all on a CPU in seconds (small budgets, a tiny geometry at `--rank-of 2`): the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.engine import heap

RESULTS = Path(__file__).resolve().parents[1] / "results"
ROOT = Path(__file__).resolve().parents[2]
GLM52_PUBLISHED_ACCEPTANCE = 2.69  # GLM 5.2's MTP, 3 drafts (issue 28's anchor)
PROJECTION_RUNS = 3  # timed runs per (depth, k), after two warm-up runs
SLOPE_TOLERANCE = 0.25  # ms a layer between neighbouring depths differing this much (relative): refused


@dataclass(frozen=True, slots=True)
class Options:
    device: str
    models: tuple[Path, ...]
    tasks: tuple[str, ...]
    num_prompts: int
    max_tokens: int
    k: int
    num_rounds: int
    c64: int
    c64_rounds: int
    rank_of: int
    depths: tuple[int, ...]  # two or more, increasing
    projection_tokens: int
    acceptance_record: Path
    deadline: float
    tiny: bool
    calibrate: bool = True  # the warm-up's calibration passes (backend/server/warmup.py)
    c64_waves: int = 1  # bursts of `c64` requests a run, one after another

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


# ---- 1 and 2: the nano models ------------------------------------------------------------------------
def nano_engines(checkpoint: Path, opts: Options, concurrency: int) -> dict[str, Any]:
    """{"A": speculation on (as served: adaptive), "B": off, "F": always K drafts} over one loaded
    copy of `checkpoint`."""
    import torch

    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
    from backend.server.warmup import warm_up

    dtype = torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    loaded = load_model(
        checkpoint, dtype=dtype, device=opts.device, num_mtp_layers=num_mtp_layers_in(checkpoint)
    )
    engines = {}
    for side, k in (("A", opts.k), ("B", 0), ("F", opts.k)):
        config = EngineConfig.build(
            num_pages=max(64, concurrency * (-(-(2048 + opts.max_tokens) // 16))), page_size=16,
            max_num_batched_tokens=4096, max_num_seqs=max(concurrency, 1), enable_prefix_cache=False,
            num_speculative_tokens=k, speculative_max_seqs=max(concurrency, 1), speculative_adaptive=side != "F",
        )  # fmt: skip
        engines[side] = Engine.from_prepared(prepare_model(loaded, config, model_dtype=dtype), config)
        # as served: a GPU backend's start-up warm-up (every step shape and draft length it will take)
        warm_up(engines[side], is_full=opts.device.startswith("cuda"), calibrate=opts.calibrate)
    heap.freeze()  # as a backend does once started: the model out of full collections (`measure_nano` thaws)
    return engines


SLOWEST = 6  # steps a run's record names


def run_prompts(
    engine: Any, prompts: list[list[int]], stops: list[int], max_tokens: int, concurrency: int
) -> dict[str, Any]:
    """The prompts, `concurrency` at a time, greedy: tokens, per-user decode rate, throughput."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    s0 = engine.stats
    verifies, drafted, accepted, steps = (
        s0.spec_verifies,
        s0.spec_drafted_tokens,
        s0.spec_accepted_tokens,
        s0.steps,
    )
    probes = engine.spec.policy.num_probes if engine.spec is not None else 0
    greedy = engine.spec.num_greedy_steps if engine.spec is not None else 0
    allocations = engine.block_manager.stats.num_allocations
    first_drafting = -1  # the run's first step with drafts (-1: none)
    tokens: dict[int, list[int]] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    k_steps: dict[int, int] = {}  # steps by the draft length chosen
    kind_s: dict[str, list[float]] = {}  # each step's seconds (engine.step's own), by `step_kind`
    timeline: list[tuple[float, int, str]] = []  # (seconds, step index, kind): the slowest kept
    start = time.perf_counter()
    with heap.Collections() as collections:
        for at in range(0, len(prompts), concurrency):
            for i in range(at, min(at + concurrency, len(prompts))):
                engine.add_request(
                    EngineRequest(
                        request_id=str(i),
                        prompt_token_ids=prompts[i],
                        tenant_salt="a" * 32,
                        sampling=sampling,
                    )
                )
            while engine.has_unfinished:
                computed, generated = engine.stats.computed_tokens, engine.stats.generated_tokens
                outputs = engine.step()
                now = time.perf_counter()
                s = engine.stats
                kind = step_kind(engine, s.computed_tokens - computed, s.generated_tokens - generated)
                kind_s.setdefault(kind, []).append(s.last_step_s)
                timeline.append((s.last_step_s, len(timeline), kind))
                k = engine.spec.k if engine.spec is not None else 0
                if k and first_drafting < 0:
                    first_drafting = sum(k_steps.values())
                k_steps[k] = k_steps.get(k, 0) + 1
                for out in outputs:
                    if out.error is not None:
                        raise RuntimeError(f"the engine failed request {out.request_id}: {out.error}")
                    if out.token_ids:
                        i = int(out.request_id)
                        first.setdefault(i, now)
                        last[i] = now
                        tokens.setdefault(i, []).extend(out.token_ids)
    wall = time.perf_counter() - start
    decode_s = sum(last[i] - first[i] for i in tokens)
    num_tokens = sum(len(t) for t in tokens.values())
    s = engine.stats
    v = s.spec_verifies - verifies
    return {
        "tokens": [tokens[i] for i in sorted(tokens)],
        "output_tokens": num_tokens,
        "wall_s": wall,
        "output_tok_s": num_tokens / wall,
        "decode_tok_s_per_user": sum(len(t) - 1 for t in tokens.values()) / decode_s if decode_s else 0.0,
        "steps": s.steps - steps,
        "step_ms_mean": wall / max(s.steps - steps, 1) * 1e3,
        "drafting_steps": sum(n for k, n in k_steps.items() if k),
        "first_drafting_step": first_drafting,  # the draft policy's start (its prior, then rates)
        # pages reserved: each page of a request's window once, a drafting request's kept between steps
        "page_allocations": engine.block_manager.stats.num_allocations - allocations,
        "steps_by_draft_length": {str(k): n for k, n in sorted(k_steps.items())},
        "verify_steps": v,
        "acceptance_length": 1 + (s.spec_accepted_tokens - accepted) / v if v else None,
        "drafted_tokens": s.spec_drafted_tokens - drafted,
        # the draft policy's measured m after the run: one MTP forward's cost / one target forward's
        "policy_draft_cost": engine.spec.policy.draft_cost if engine.spec is not None else None,
        # probes of drafting the rate gate began in the run, and the load past which it never drafts
        "policy_probes": engine.spec.policy.num_probes - probes if engine.spec is not None else 0,
        "max_drafting_seqs": engine.spec.max_drafting_seqs if engine.spec is not None else 0,
        # steps run whole on the device (backend/engine/speculative/greedy.py)
        "greedy_steps": engine.spec.num_greedy_steps - greedy if engine.spec is not None else 0,
        "gc": collections.summary(),  # a slow run with a full collection in it says so
        # where a side's time goes: steps of each kind, their median and summed ms (`step_kind`)
        "step_ms_by_kind": {
            kind: {"steps": len(v), "median_ms": statistics.median(v) * 1e3, "sum_ms": sum(v) * 1e3}
            for kind, v in sorted(kind_s.items())
        },
        # the run's slowest steps (index in the run, kind, ms): where a run slower than its twin
        # with the same medians spent it (session 27: Kimi chat's first A of a round, +20-35 ms)
        "slowest_steps": [
            {"step": i, "kind": kind, "ms": round(sec * 1e3, 3)}
            for sec, i, kind in sorted(timeline, reverse=True)[:SLOWEST]
        ],
    }


def step_kind(engine: Any, num_computed: int, num_generated: int) -> str:
    """What the step just run was: "drafting" (it drafted or verified), "fill" (no drafts, the MTP
    layer over prompt chunks), "prompt" (prompt tokens, plain), or "decode" (one token a sequence,
    plain). A plain step's computed tokens beyond those it generated are prompt tokens."""
    spec = engine.spec
    if spec is not None and spec.did_draft:
        return "drafting"
    if spec is not None and spec.fills_draft_kv:
        return "fill"
    return "prompt" if num_computed > num_generated else "decode"


def ab_rounds(
    engines: dict[str, Any], work: Any, metric: str, num_rounds: int, opts: Options
) -> dict[str, Any]:
    """Warm both sides on `work`, then A/B/B/A rounds; the outputs of A and B must agree."""
    from benchmarks.engine import method

    warm_start = time.monotonic()
    warm = {side: work(engines[side]) for side in ("A", "B")}  # F warms just before its one run
    warm_s = time.monotonic() - warm_start
    is_same = warm["A"]["tokens"] == warm["B"]["tokens"]

    def run(side: str) -> dict[str, Any]:
        r = work(engines[side])
        return {k: v for k, v in r.items() if k != "tokens"}

    rounds = method.interleave(
        run,
        lambda r: float(r[metric]),
        num_rounds=num_rounds,
        time_left=opts.time_left,
        first_round_s=2.0 * warm_s,
    )
    fixed = None
    if "F" in engines and opts.time_left() > warm_s:  # beside the rounds: always K drafts, once
        work(engines["F"])
        fixed = run("F")
        b = [r[metric] for r in rounds[-1]["runs"] if r["side"] == "B"] if rounds else []
        fixed["over_B_of_last_round"] = fixed[metric] / statistics.fmean(b) if b else None
    return {
        "metric": metric,
        "warm_up_s": round(warm_s, 2),
        "fixed_k_run": fixed,
        "greedy_outputs_identical": is_same,
        "order": method.order(len(rounds)),
        "rounds": rounds,
        "rounds_skipped": num_rounds - len(rounds),
        "summary": method.summary_entry([r["ratio"] for r in rounds]) if rounds else None,
    }


def measure_nano(checkpoint: Path, opts: Options) -> dict[str, Any]:
    from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids

    stops = stop_ids(checkpoint)
    out: dict[str, Any] = {"speedup_c1": {}, "throughput_c64": None}
    engines = nano_engines(checkpoint, opts, 1)
    prompts = {task: held_out_prompts(checkpoint, task, opts.num_prompts) for task in opts.tasks}
    for task in opts.tasks:
        out["speedup_c1"][task] = ab_rounds(
            engines,
            lambda e, task=task: run_prompts(e, prompts[task], stops, opts.max_tokens, 1),
            "decode_tok_s_per_user",
            opts.num_rounds,
            opts,
        )
    del engines
    heap.thaw()
    if opts.c64 and opts.time_left() > 0:
        pool = [p for task in opts.tasks for p in prompts[task]]
        many = [pool[i % len(pool)] for i in range(opts.c64 * opts.c64_waves)]  # waves of c64
        engines = nano_engines(checkpoint, opts, opts.c64)
        out["throughput_c64"] = ab_rounds(
            engines, lambda e: run_prompts(e, many, stops, opts.max_tokens, opts.c64), "output_tok_s",
            opts.c64_rounds, opts,
        )  # fmt: skip
        del engines
        heap.thaw()
    return out


# ---- 3: the projection for GLM 5.2 --------------------------------------------------------------------
def step_times(depth: int, opts: Options) -> dict[str, dict[str, Any]]:
    """Per kind of step ("plain", "spec_k1" … "spec_kK": k drafts every step) at `depth` layers of
    rank 0 of `opts.rank_of`: `ms`, the median c = 1 steady step (ms) over `PROJECTION_RUNS` timed
    runs after two warm-up runs of the same work; `steps`, how many steps that median is over;
    `graphs`, "captured" or why its steps ran eagerly."""
    import torch

    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.weights import build_random_model

    geometry = make_geometry("glm-5.2", depth, tiny=opts.tiny, rank_of=opts.rank_of)
    config = geometry.model_config
    model = build_random_model(geometry, "int4", device=opts.device, num_mtp_layers=1)
    dtype = torch.bfloat16
    times: dict[str, dict[str, Any]] = {}
    input_len = 16 if opts.tiny else 512
    for k in range(opts.k + 1):
        engine_config = EngineConfig.build(
            num_pages=-(-(input_len + opts.projection_tokens + 8) // 16) + 1, page_size=16,
            max_num_batched_tokens=max(input_len, 64), max_num_seqs=1, enable_prefix_cache=False,
            cuda_graph_batch_sizes=(1,), num_speculative_tokens=k, speculative_adaptive=False,
        )  # fmt: skip
        engine = Engine(
            model, engine_config, vocab_size=config.vocab_size, context_window=config.max_position_embeddings,  # type: ignore[arg-type]
            model_dtype=dtype, device=opts.device,
        )  # fmt: skip
        times["plain" if k == 0 else f"spec_k{k}"] = timed_steps(
            engine, k, input_len, config.vocab_size, opts
        )
        del engine
    return times


def timed_steps(engine: Any, k: int, input_len: int, vocab_size: int, opts: Options) -> dict[str, Any]:
    """`step_times`' entry for one engine: warm-up runs, then the timed runs' steady steps (with k
    drafts, the whole speculative steps: verify, acceptance and drafts in one device function)."""
    from benchmarks.engine.offline import run_offline

    steady: list[float] = []

    def work(seed: int, timed: bool) -> None:
        def around(step: int, decode_rows: int) -> Any:
            return _StepTimer(engine, k, steady) if timed and decode_rows == 1 else contextlib.nullcontext()

        run_offline(
            engine, variant=f"k{k}-{seed}", concurrency=1, input_len=input_len,
            output_len=opts.projection_tokens, vocab_size=vocab_size, seed=seed, around_step=around,
        )  # fmt: skip

    for seed in (101, 102):  # every shape the timed runs take: compiles and first launches here
        work(seed, timed=False)
    for seed in range(1, PROJECTION_RUNS + 1):
        work(seed, timed=True)
    return {
        "ms": statistics.median(steady) if steady else None,
        "steps": len(steady),
        "graphs": _graph_status(engine, k),
    }


class _StepTimer:
    """Times one engine step into `steady` when it is a steady one: a plain decode step (k = 0), or
    a whole speculative step (`SpecDecoder.num_greedy_steps` counts it)."""

    def __init__(self, engine: Any, k: int, steady: list[float]) -> None:
        self.engine, self.k, self.steady = engine, k, steady

    def __enter__(self) -> None:
        self.greedy0 = self.engine.spec.num_greedy_steps if self.k else 0
        _synchronize(self.engine)
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        _synchronize(self.engine)
        ms = (time.perf_counter() - self.start) * 1e3
        if not self.k or self.engine.spec.num_greedy_steps > self.greedy0:
            self.steady.append(ms)


def _synchronize(engine: Any) -> None:
    import torch

    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def _graph_status(engine: Any, k: int) -> str:
    """The word "captured" when the engine's steady steps replay graphs (decode graphs; with drafts,
    the whole greedy steps'), else the reason they run eagerly (the start-up warning's)."""
    runner = engine.runner
    if runner.device.type != "cuda":
        return "eager: no CUDA graphs on the CPU"
    graphs = runner.graphs
    if graphs is None or not graphs.is_enabled:
        return f"eager decode: {graphs.disabled_reason if graphs is not None else 'no decode graphs'}"
    if not k:
        return "captured"
    verify = runner.spec_forwards.graphs if runner.spec_forwards is not None else None
    if verify is None or not verify.is_enabled:
        return f"eager verify: {verify.disabled_reason if verify is not None else 'no verify graphs'}"
    if not verify.has_greedy:
        return f"eager greedy steps: {verify.greedy_disabled_reason}"
    return "captured"


def fit_lines(ms: dict[int, dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Per kind of step, the least-squares line through its times at the measured depths: (ms per
    layer, ms at no layer)."""
    depths = sorted(ms)
    return {
        key: tuple(statistics.linear_regression(depths, [ms[d][key] for d in depths]))  # type: ignore[misc]
        for key in ms[depths[-1]]
    }


def extrapolate(measured: dict[int, dict[str, dict[str, Any]]], full: int) -> dict[str, float]:
    """Each kind's fitted line (`fit_lines`) at `full` layers; kinds with an untimed depth left out."""
    return {key: slope * full + at_zero for key, (slope, at_zero) in _lines(measured).items()}


def refusals(measured: dict[int, dict[str, dict[str, Any]]], extrapolated: dict[str, float]) -> list[str]:
    """Why a projection from these step times would mislead (none: it stands): a kind of step that
    did not replay its graphs or timed no step; times not monotonic, measured or extrapolated (more
    layers, or more drafts, costing less); a speculative step whose cost per layer grows faster
    than k + 1 plain rows' (its verify runs k + 1 rows through each layer, which never costs more
    than k + 1 one-row steps do: a faster growth is a fault of the measurement, not of the model);
    or, with three depths or more, a kind whose ms per layer between neighbouring depths differ by
    more than `SLOPE_TOLERANCE` (the slope of a step bound by the host at some depths is not the
    device's cost a layer)."""
    reasons = []
    for depth, kinds in measured.items():
        for key, t in kinds.items():
            if t["ms"] is None:
                reasons.append(f"{key} at {depth} layers: no steady step timed")
            elif t["graphs"] != "captured" and not t["graphs"].startswith("eager: no CUDA graphs"):
                reasons.append(f"{key} at {depth} layers ran eagerly ({t['graphs'][:160]})")
    if reasons:
        return reasons
    depths = sorted(measured)
    ms = {d: {key: t["ms"] for key, t in measured[d].items()} for d in depths}
    for d1, d2 in zip(depths, depths[1:], strict=False):
        for key in ms[d2]:
            if ms[d2][key] <= ms[d1][key]:
                reasons.append(
                    f"{key}: {ms[d2][key]:.3f} ms at {d2} layers, not above {ms[d1][key]:.3f} at {d1}"
                )
    order = list(extrapolated)  # plain, spec_k1, …: each costs more than the one before
    for name, times in (*((f"{d} layers", ms[d]) for d in depths), ("the full depth", extrapolated)):
        for a, b in zip(order, order[1:], strict=False):
            if times[b] <= times[a]:
                reasons.append(f"at {name}, {b} ({times[b]:.3f} ms) not above {a} ({times[a]:.3f} ms)")
    if len(depths) < 2:  # measured at the full depth: no line to check
        return reasons
    lines = fit_lines(ms)
    plain = lines["plain"][0]  # ms per layer
    for k, key in enumerate(order[1:], start=1):
        slope = lines[key][0]
        if plain > 0 and slope > (k + 1) * plain:
            reasons.append(
                f"{key}: {slope:.3f} ms per layer, over {k + 1} × plain's {plain:.3f} (its verify's {k + 1} rows)"
            )
    if len(depths) >= 3:
        for key in lines:
            slopes = [(ms[b][key] - ms[a][key]) / (b - a) for a, b in zip(depths, depths[1:], strict=False)]
            if min(slopes) > 0 and max(slopes) > (1 + SLOPE_TOLERANCE) * min(slopes):
                steps = ", ".join(
                    f"{x:.3f} from {a} to {b}" for x, a, b in zip(slopes, depths, depths[1:], strict=False)
                )
                reasons.append(
                    f"{key}: ms per layer {steps}: not one line (bound by the host at some depths?)"
                )
    return reasons


def _lines(measured: dict[int, dict[str, dict[str, Any]]]) -> dict[str, tuple[float, float]]:
    # plain, spec_k1, …: in the measured order (`refusals` compares neighbours)
    timed = [
        key for key in measured[max(measured)] if all(measured[d][key]["ms"] is not None for d in measured)
    ]
    return fit_lines({d: {key: kinds[key]["ms"] for key in timed} for d, kinds in measured.items()})


def nano_glm_acceptance(record: Path) -> dict[str, float]:
    if not record.exists():
        return {}
    models = json.loads(record.read_text()).get("models", {})
    return {
        f"glm-5.2-nano {task}": float(v["acceptance_length"])
        for task, v in models.get("glm-5.2-nano", {}).items()
    }


def project(opts: Options) -> dict[str, Any]:
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.rank_of import join_alone

    join_alone(opts.rank_of)
    full = make_geometry("glm-5.2", None, tiny=opts.tiny, rank_of=opts.rank_of).full_num_layers
    measured = {d: step_times(d, opts) for d in opts.depths}
    at_full = list(measured) == [full]  # measured at the full depth: its times as they are
    extrapolated = (
        {key: t["ms"] for key, t in measured[full].items() if t["ms"] is not None}
        if at_full
        else extrapolate(measured, full)
    )
    acceptance = nano_glm_acceptance(opts.acceptance_record) | {
        "GLM 5.2 published (3 drafts)": GLM52_PUBLISHED_ACCEPTANCE
    }
    refused = refusals(measured, extrapolated)
    projected = None
    if not refused:
        t_plain, t_spec = extrapolated["plain"], extrapolated[f"spec_k{opts.k}"]
        projected = {name: e * t_plain / t_spec for name, e in acceptance.items()}
    return {
        "label": "projection, not a measurement of GLM 5.2",
        "how": (
            f"step times measured at {'the full depth' if at_full else 'truncated depths'} of rank 0 of "
            "--rank-of (random INT4-expert weights, a random MTP layer, CUDA graphs), each the median steady "
            f"step of {PROJECTION_RUNS} runs after two warm-up runs of the same work"
            + ("" if at_full else ", a least-squares line through the depths extrapolated to the full depth")
            + "; speedup = E(K) · t_plain / t_spec(K); refused where "
            + (
                "the times are not monotonic in drafts, or a step ran eagerly"
                if at_full
                else "the times are not monotonic in depth and in drafts, grow per layer faster than k + 1 "
                "plain rows', change their cost per layer between depths by more than "
                f"{SLOPE_TOLERANCE:.0%}, or a step ran eagerly"
            )
        ),
        "rank_of": opts.rank_of,
        "full_depth": full,
        "depths_measured": list(opts.depths),
        "step_ms_measured": {str(d): {key: t["ms"] for key, t in v.items()} for d, v in measured.items()},
        "steps_timed": {str(d): {key: t["steps"] for key, t in v.items()} for d, v in measured.items()},
        "graphs": {str(d): {key: t["graphs"] for key, t in v.items()} for d, v in measured.items()},
        "step_ms_full_depth": extrapolated,
        "fitted_ms_per_layer": None if at_full else {key: line[0] for key, line in _lines(measured).items()},
        "draft_and_verify_over_plain": {k: v / extrapolated["plain"] for k, v in extrapolated.items()}
        if extrapolated.get("plain")
        else None,
        "acceptance_length_used": acceptance,
        "refused": refused,
        "projected_speedup_c1": projected,
        "caveats": [
            "acceptance from the nano GLM (undertrained MTP layer) or GLM 5.2's published figure, not measured on GLM 5.2",
            "collectives local (rank_of.py): NVLink time not included on either side",
            "random drafts are rejected, so the depth-0 draft forward ran over 1 row, not E(K)",
        ],
    }


# ---- the command ------------------------------------------------------------------------------------
def measure(opts: Options, record: dict[str, Any], save: Callable[[dict[str, Any]], None]) -> None:
    """Each part into `record`, saved after each (a call killed at its limit keeps what it finished)."""
    record["models"] = {}
    # the nano models share 70% of the budget (the projection takes the rest, its runs fixed and short)
    share = opts.time_left() * (0.7 if opts.rank_of else 1.0) / max(len(opts.models), 1)
    for checkpoint in opts.models:
        part = Options(**{**_fields(opts), "deadline": time.monotonic() + share})
        record["models"][checkpoint.name] = measure_nano(checkpoint, part)
        print(_nano_line(checkpoint.name, record["models"][checkpoint.name]), flush=True)
        save(record)
    if opts.rank_of:
        record["projection_glm_5.2"] = project(opts)
    save(record)


def _fields(opts: Options) -> dict[str, Any]:
    return {f: getattr(opts, f) for f in Options.__dataclass_fields__}


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, m in record["models"].items():
        for task, r in m["speedup_c1"].items():
            out[f"speedup_c1 {name} {task}"] = r["summary"]
        if m["throughput_c64"] is not None:
            out[f"c64_on_over_off {name}"] = m["throughput_c64"]["summary"]
    if "projection_glm_5.2" in record:
        p = record["projection_glm_5.2"]
        if p["projected_speedup_c1"] is None:
            out["projected speedup_c1 GLM 5.2"] = "refused: " + "; ".join(p["refused"])
        else:
            for name, v in p["projected_speedup_c1"].items():
                out[f"projected speedup_c1 GLM 5.2 ({name})"] = round(v, 3)
    return out


def _nano_line(name: str, m: dict[str, Any]) -> str:
    parts = [
        f"{task} {(r['summary'] or {}).get('value', float('nan')):.3f}x"
        for task, r in m["speedup_c1"].items()
    ]
    c64 = m["throughput_c64"]
    if c64 is not None and c64["summary"] is not None:
        parts.append(f"c64 {c64['summary']['value']:.3f}x")
    return f"{name}: speedup_c1 " + ", ".join(parts)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench engine mtp", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="models/glm-5.2-nano,models/kimi-k2.6-nano")
    ap.add_argument("--tasks", default="chat,tool-call")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per task (c = 1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative", default="mtp:3", metavar="mtp:K")
    ap.add_argument("--rounds", type=int, default=3, help="A/B/B/A rounds at c = 1")
    ap.add_argument(
        "--c64", type=int, default=64, help="concurrent requests of the throughput part (0: skip)"
    )
    ap.add_argument("--c64-rounds", type=int, default=2)
    ap.add_argument(
        "--c64-waves",
        type=int,
        default=1,
        help="bursts of --c64 requests a run, one after another (a burst of 64 nano requests lasts ~0.1 s on the H100)",
    )
    ap.add_argument("--rank-of", type=int, default=8, help="the projection's ranks (0: skip the projection)")
    ap.add_argument(
        "--depths",
        default="8,16,24",
        help="the projection's truncated depths (two or more, increasing), or full: the whole depth "
        "measured (rank 0 of --rank-of: GLM 5.2's INT4 experts need ~55 GB)",
    )
    ap.add_argument("--projection-tokens", type=int, default=64, help="decode steps per projection run")
    ap.add_argument("--acceptance", type=Path, default=RESULTS / "2026-12-05-mtp.json")
    ap.add_argument("--budget-s", type=float, default=450.0, help="no round starts after this many seconds")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument(
        "--tiny", action="store_true", help="CPU-sized: 2 prompts, 6 tokens, 1 round, --rank-of 2"
    )
    ap.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="warm up without the draft policy's calibration passes (backend/server/warmup.py)",
    )
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv: list[str]) -> int:
    import torch

    from schemas.backend import parse_speculative

    start = time.monotonic()
    a = parser().parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.tiny:
        a.prompts, a.max_tokens, a.rounds, a.c64, a.c64_rounds = (
            min(a.prompts, 2),
            min(a.max_tokens, 6),
            1,
            min(a.c64, 4),
            1,
        )
        # 12 tokens: a whole step of K = 3 drafts needs 2K − 1 tokens of window left
        a.rank_of, a.projection_tokens = min(a.rank_of, 2), min(a.projection_tokens, 12)
    if a.depths == "full":  # the step times measured where they apply: no line, no extrapolation
        from benchmarks.engine.geometry import make_geometry

        depths: tuple[int, ...] = (
            make_geometry("glm-5.2", None, tiny=a.tiny, rank_of=a.rank_of).full_num_layers,
        )
    else:
        items = [x.strip() for x in a.depths.split(",") if x.strip()]
        depths = tuple(int(x) for x in items) if all(x.isdigit() for x in items) else ()
        if len(depths) < 2 or list(depths) != sorted(set(depths)) or depths[0] < 1:
            raise SystemExit(
                "kumo bench engine mtp: --depths must be two or more increasing layer counts, or full, "
                f"not {a.depths!r}"
            )
    opts = Options(
        device=device, models=tuple(ROOT / m if not Path(m).is_absolute() else Path(m) for m in a.models.split(",") if m),
        tasks=tuple(a.tasks.split(",")), num_prompts=a.prompts, max_tokens=a.max_tokens,
        k=parse_speculative(a.speculative), num_rounds=a.rounds, c64=a.c64, c64_rounds=a.c64_rounds,
        rank_of=a.rank_of, depths=depths,
        projection_tokens=a.projection_tokens, acceptance_record=a.acceptance, deadline=start + a.budget_s,
        tiny=a.tiny, calibrate=a.calibrate, c64_waves=max(1, a.c64_waves),
    )  # fmt: skip
    if opts.k == 0:
        raise SystemExit("kumo bench engine mtp: --speculative must be mtp:K")
    record = {
        "date": datetime.date.today().isoformat(),
        "command": "kumo bench engine mtp " + " ".join(argv),
        "device": torch.cuda.get_device_name(device)
        if device.startswith("cuda")
        else f"{platform.machine()} CPU",
        "torch": torch.__version__,
        "speculative": a.speculative,
        "calibrated": a.calibrate,
        "method": "A = speculation on (adaptive draft policy, as served), B = off; warm-up of each side on the same "
        "work, then A/B/B/A rounds, ratio (a1 + a2) / (b1 + b2) per round, median and spread (benchmarks/engine/method.py)",
        "weights": "nano checkpoints as committed (bf16 on CUDA, fp32 on the CPU), KV cache in the model dtype",
    }
    out = a.out or RESULTS / f"{datetime.date.today().isoformat()}-mtp-gpu{'-tiny' if a.tiny else ''}.json"

    def save(record: dict[str, Any]) -> None:
        record["summary"] = summarize(record)
        record["wall_s"] = round(time.monotonic() - start, 1)
        out.write_text(json.dumps(record, indent=2) + "\n")

    measure(opts, record, save)
    print(json.dumps(record["summary"], indent=2))
    print(f"wrote {out}")
    return 0
