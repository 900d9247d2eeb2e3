"""`kumo bench engine host`: the engine's host (Python) time per pure-decode step, model excluded.

The real `Engine` runs on the CPU over `NullModel` (a forward of one table lookup) or, with
`--model kimi-tiny`, the small random Kimi K2.6 geometry; either way the forward is timed by
`TimedModel` and subtracted, so what is left is scheduling, page bookkeeping, building the step's
inputs, sampling bookkeeping and output records. Decode steps go through `DecodeGraphs` over
`eager_capture` (the static buffers and padding the CUDA graphs use, without a graph), as a decode
step on the GPU does.

Per batch size B: B requests of `--prompt-len`/2 to `--prompt-len` seeded random tokens are admitted and prefilled
(untimed), then `--steps` pure-decode steps are timed, `--repeats` times over fresh requests.
Reported per B and sampling mode: host ms per step (median, p10, p90 over every timed step), the
forward's ms, Python function calls per step and aten ops dispatched outside the forward per step
(both deterministic: they do not depend on machine load), and a cProfile breakdown at one B.

    kumo bench engine host [--batch-sizes 1,8,64,256] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from benchmarks.engine.host_async import measure_async
from benchmarks.engine.null_model import NullModel, OpCounter, TimedModel
from schemas.backend import EngineRequest, SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},  # seeded per request
}


def build(args: argparse.Namespace, batch_size: int) -> tuple[Engine, TimedModel, int]:
    if args.model == "null":
        inner: torch.nn.Module = NullModel(args.vocab)
        vocab = args.vocab
    else:
        from benchmarks.engine.geometry import make_geometry
        from benchmarks.engine.weights import build_random_model

        geometry = make_geometry("kimi-k2.6", 4, tiny=True)
        inner = build_random_model(geometry, "bf16", device="cpu", dtype=torch.float32)
        vocab = geometry.model_config.vocab_size
    model = TimedModel(inner)
    S = args.page_size
    pages_per_seq = -(-(args.prompt_len + args.steps + 8) // S)
    config = EngineConfig.build(
        page_size=S,
        num_pages=batch_size * pages_per_seq + 16,
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(batch_size * args.prompt_len, 256),  # every prefill in one step
        enable_prefix_cache=not args.no_prefix_cache,
        seed=0,
    )
    engine = Engine(
        model,
        config,
        vocab_size=vocab,
        context_window=args.prompt_len + args.steps + 8,
        graph_capture=eager_capture,
    )
    return engine, model, vocab


def random_prompts(args: argparse.Namespace, batch_size: int, vocab: int, *, seed: int) -> list[list[int]]:
    """Seeded random prompts of `--prompt-len / 2` to `--prompt-len` tokens: sequences of a batch end
    on different pages, as they do in serving (the step's page tables are ragged)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(args.prompt_len // 2, 1), args.prompt_len + 1, (batch_size,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


def decode_steps(
    engine: Engine,
    model: TimedModel,
    vocab: int,
    args: argparse.Namespace,
    batch_size: int,
    mode: str,
    rep: int,
    around: Callable[..., Any] | None = None,
) -> tuple[list[float], list[float], int]:
    """Admit and prefill `batch_size` requests, then time `--steps` pure-decode steps, each run
    through `around(engine.step)` when given (a profiler, an op counter): (host seconds per step,
    forward seconds per step, decode steps replayed from the graph buffers)."""
    for i, prompt in enumerate(random_prompts(args, batch_size, vocab, seed=1000 * rep + batch_size)):
        sampling = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, seed=i, **SAMPLING[mode])
        engine.add_request(
            EngineRequest(
                request_id=f"{mode}-{rep}-{i}",
                prompt_token_ids=prompt,
                tenant_salt="0" * 16,
                sampling=sampling,
            )
        )
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # prefill, untimed
    graphs = engine.runner.graphs
    replays0 = graphs.num_replays if graphs is not None else 0
    host, forward = [], []
    for _ in range(args.steps):
        f0 = model.clock.forward_s
        t0 = time.perf_counter()
        around(engine.step) if around is not None else engine.step()
        elapsed = time.perf_counter() - t0
        forward.append(model.clock.forward_s - f0)
        host.append(elapsed - forward[-1])
    while engine.has_unfinished:
        engine.step()
    replays = (graphs.num_replays if graphs is not None else 0) - replays0
    return host, forward, replays


def counted(args: argparse.Namespace, batch_size: int, mode: str, *, top: int) -> dict[str, Any]:
    """Python calls and aten ops per pure-decode step, and the cProfile table of those steps
    (`top` rows, by own time): one profiled pass, then one counted pass, over fresh requests."""
    engine, model, vocab = build(args, batch_size)
    decode_steps(engine, model, vocab, args, batch_size, mode, rep=90)  # warm
    profile, counter = cProfile.Profile(), OpCounter(model)
    decode_steps(engine, model, vocab, args, batch_size, mode, rep=91, around=profile.runcall)
    decode_steps(engine, model, vocab, args, batch_size, mode, rep=92, around=counter.run)
    stats = pstats.Stats(profile)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    n = args.steps
    table = [
        {
            "function": f"{Path(fn[0]).name}:{fn[1]}({fn[2]})",
            "calls_per_step": round(v[1] / n, 2),
            "tottime_us_per_step": round(v[2] / n * 1e6, 2),
            "cumtime_us_per_step": round(v[3] / n * 1e6, 2),
        }
        for fn, v in sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    ]
    return {
        "python_calls_per_step": round(sum(v[1] for v in raw.values()) / n, 1),
        "aten_ops_per_step": round(sum(counter.counts.values()) / n, 2),
        "aten_ops": {k: round(v / n, 2) for k, v in counter.counts.most_common()},
        "profile": table,
    }


def measure(args: argparse.Namespace, batch_size: int, mode: str) -> dict[str, Any]:
    engine, model, vocab = build(args, batch_size)
    decode_steps(engine, model, vocab, args, batch_size, mode, rep=0)  # warm-up
    host: list[float] = []
    forward: list[float] = []
    replays = 0
    for rep in range(1, args.repeats + 1):
        h, f, r = decode_steps(engine, model, vocab, args, batch_size, mode, rep)
        host += h
        forward += f
        replays += r
    q = statistics.quantiles(host, n=10)
    return {
        "batch_size": batch_size,
        "sampling": mode,
        "timed_steps": len(host),
        "graph_replays": replays,
        "host_ms_median": round(statistics.median(host) * 1e3, 4),
        "host_ms_p10": round(q[0] * 1e3, 4),
        "host_ms_p90": round(q[-1] * 1e3, 4),
        "host_us_per_seq_median": round(statistics.median(host) * 1e6 / batch_size, 2),
        "forward_ms_median": round(statistics.median(forward) * 1e3, 4),
    }


def machine() -> dict[str, Any]:
    cpu = ""
    if Path("/proc/cpuinfo").exists():
        cpu = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            "",
        )
    import backend

    tree = Path(backend.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {
        "backend_tree": str(tree),
        "backend_commit": commit.stdout.strip() or None,  # the code measured (untracked edits not shown)
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench engine host", description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--sampling", default="greedy,sampled", help=f"comma-separated of {','.join(SAMPLING)}")
    ap.add_argument("--model", choices=("null", "kimi-tiny"), default="null")
    ap.add_argument(
        "--vocab",
        type=int,
        default=128,
        help="null model vocabulary (small: the sampler's own tensor math stays negligible)",
    )
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument(
        "--profile-batch", type=int, default=64, help="the B whose cProfile table is kept (0: none)"
    )
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument(
        "--async-loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also through AsyncEngine + OutputProcessor on an event loop (benchmarks/engine/host_async.py)",
    )
    ap.add_argument("--label", default="", help="suffix of the default record name")
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)  # the host work is single-threaded; keep the model's forward off other cores
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    modes = [m for m in args.sampling.split(",") if m]
    record: dict[str, Any] = {
        "benchmark": "engine-host-overhead",
        "command": " ".join(["kumo bench engine host", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [],
    }
    for mode in modes:
        for B in sizes:
            run = measure(args, B, mode)
            run |= counted(args, B, mode, top=args.profile_top if args.profile_batch == B else 0)
            if args.async_loop:
                async_run = measure_async(args, B, mode, SAMPLING[mode], build, random_prompts)
                run |= {k: v for k, v in async_run.items() if k.startswith("async_")}
            record["runs"].append(run)
            print(
                f"{mode:8s} B={B:4d}  host {run['host_ms_median']:.3f} ms/step "
                f"(p10 {run['host_ms_p10']:.3f}, p90 {run['host_ms_p90']:.3f}; {run['host_us_per_seq_median']:.1f} us/seq)  "
                f"forward {run['forward_ms_median']:.3f} ms  calls/step {run['python_calls_per_step']}  "
                f"aten ops/step {run['aten_ops_per_step']}  "
                f"async loop {run.get('async_host_ms_mean')} ms/step (mean)",
                flush=True,
            )
            for row in run["profile"][:12]:
                print(
                    f"    {row['tottime_us_per_step']:9.1f} us {row['calls_per_step']:8.1f} calls  {row['function']}"
                )
    record["machine"]["load_average_at_end"] = list(os.getloadavg())
    out = (
        args.out
        or RESULTS
        / f"{datetime.date.today().isoformat()}-engine-host-overhead{('-' + args.label) if args.label else ''}.json"
    )
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
