"""Every device launch of a plain decode step and of a whole greedy speculative step, by source line
(issue 28), on the GPU:

    python3 -m lab.diagnostics.step_kernels [--models glm,kimi] [--k 3] [--steps 3] [--out FILE.json]

`spec_launches` estimates launches on the CPU, where several kernel entries run their torch
references (191 a plain GLM-nano step against the H100 profiler's 124). This runs the engines on CUDA
eagerly (no graphs: the graphs replay the same function's launches), under torch.profiler with Python
stacks, and names each kernel by the innermost frame of this repository that launched it (e.g.
`backend/models/layers/moe.py(192): forward_every_expert`), with the phase above it (the verify, each
MTP depth, the acceptance) for the greedy step. A graphed run of the same engines gives the device
events per step to check the eager count against. On the CPU (`--device cpu`) it counts top-level
aten ops instead: a smoke test of the parsing, not the GPU's launches.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from lab.diagnostics.spec_host import MODELS

PHASES = (  # outermost first: the first found names the phase
    ("greedy.py", "draft_on_device", "mtp drafts"),
    ("verify_accept", "verify_accept", "verify tail"),
    ("causal_lm.py", "forward_mtp", "mtp"),
    ("causal_lm.py", "forward_spec", "verify"),
    ("causal_lm.py", "forward", "target"),
)


def build(checkpoint: Path, k: int, device: str, graphs: bool) -> dict[str, Any]:
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(checkpoint, dtype=dtype, device=device, num_mtp_layers=num_mtp_layers_in(checkpoint))
    out = {}
    for side, kk in (("plain", 0), (f"greedy k={k}", k), ("spec engine's plain", k)):
        config = EngineConfig.build(
            num_pages=512, page_size=16, max_num_batched_tokens=4096, max_num_seqs=1,
            enable_prefix_cache=False, num_speculative_tokens=kk, speculative_max_seqs=1,
            speculative_adaptive=False, cuda_graphs=graphs, speculative_graphs=graphs,
        )  # fmt: skip
        out[side] = Engine.from_prepared(prepare_model(loaded, config, model_dtype=dtype), config)
        if side.startswith("spec engine"):  # a speculative engine held at k = 0: its plain steps
            out[side].spec.policy.forced_k = 0
    return out


def kept_steps(engine: Any, prompt: list[int], steps: int) -> list[int]:
    """One greedy request, each step in a `step N` profiler range; returns the N of its kept ones
    (decode steps of a plain engine, whole greedy steps of a speculative one; never the first)."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=8 * steps + 16, ignore_eos=True)
    engine.add_request(
        EngineRequest(request_id="r", prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
    )
    kept: list[int] = []
    i = 0
    while engine.has_unfinished and len(kept) < steps:
        greedy0 = engine.spec.num_greedy_steps if engine.spec is not None else 0
        tokens0 = engine.stats.computed_tokens
        is_first = bool(engine.scheduler.waiting)
        with torch.profiler.record_function(f"step {i}"):
            engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        if engine.spec is not None and engine.spec.policy.forced_k != 0:
            keep = engine.spec.num_greedy_steps > greedy0
        else:
            keep = engine.stats.computed_tokens - tokens0 == 1
        if keep and not is_first:
            kept.append(i)
        i += 1
    engine.abort("r")
    while engine.has_unfinished:
        engine.step()
    return kept


def parse(trace: dict[str, Any], is_cuda: bool, kept: list[int]) -> list[tuple[str, str, str]]:
    """(kernel name, innermost repository frame, phase) per device launch of the kept steps."""
    events = trace["traceEvents"]
    names = {f"step {i}" for i in kept}
    ranges = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("name") in names and e.get("cat") == "user_annotation"
    )

    def in_kept(ts: float) -> bool:
        i = bisect.bisect_right(ranges, (ts, float("inf")))
        return i > 0 and ranges[i - 1][1] >= ts

    frames = collections.defaultdict(list)  # tid -> [(ts, end, name)] python frames of the repository
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            name = e["name"]
            cut = [i for i in (name.find("/backend/"), name.find("/kernels/")) if i >= 0]
            if cut or name.startswith(("backend/", "kernels/")):
                short = name[min(cut) + 1 :] if cut else name  # relative to the repository
                if "site-packages" not in name:
                    frames[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), short))
    for fs in frames.values():
        fs.sort()
    starts = {tid: [f[0] for f in fs] for tid, fs in frames.items()}

    def enclosing(tid: Any, ts: float) -> list[str]:
        fs = frames.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), ts)
        return [f[2] for f in fs[:i] if f[1] >= ts]  # outermost first (sorted by start)

    def phase_of(chain: list[str]) -> str:
        for file, fn, label in PHASES:
            if any(file in c and c.endswith(f": {fn}") for c in chain):
                return label
        return "other"

    out = []
    if is_cuda:
        launches = {}
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = e
        for e in events:
            if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is None or not in_kept(launch["ts"]):
                continue
            chain = enclosing(launch["tid"], launch["ts"]) if launch is not None else []
            out.append((e["name"][:80], chain[-1] if chain else "?", phase_of(chain)))
    else:  # top-level aten ops
        ops = sorted(
            (e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"), key=lambda e: e["ts"]
        )
        end = -1.0
        for e in ops:
            if e["ts"] >= end and in_kept(e["ts"]):
                chain = enclosing(e["tid"], e["ts"])
                out.append((e["name"], chain[-1] if chain else "?", phase_of(chain)))
                end = e["ts"] + e.get("dur", 0)
    return out


def profiled(engine: Any, prompt: list[int], steps: int, is_cuda: bool, stacks: bool) -> Any:
    """(trace, kept steps) of one request's steps, after a warm-up request."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if is_cuda else [])
    kept_steps(engine, prompt, steps)  # warm
    with torch.profiler.profile(activities=acts, with_stack=stacks) as prof:
        kept = kept_steps(engine, prompt, steps)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text()), kept


def profile_side(engine: Any, prompt: list[int], steps: int, is_cuda: bool) -> dict[str, Any]:
    trace, kept = profiled(engine, prompt, steps, is_cuda, stacks=True)
    rows = parse(trace, is_cuda, kept)
    n = max(len(kept), 1)
    by_frame = collections.Counter((phase, frame) for _, frame, phase in rows)
    by_kernel = collections.Counter(name for name, _, _ in rows)
    by_phase = collections.Counter(phase for _, _, phase in rows)
    return {
        "steps": len(kept),
        "launches_per_step": round(len(rows) / n, 2),
        "by_phase": {p: round(c / n, 2) for p, c in by_phase.most_common()},
        "by_frame": {f"{p} | {f}": round(c / n, 2) for (p, f), c in by_frame.most_common()},
        "by_kernel": {k: round(c / n, 2) for k, c in by_kernel.most_common()},
    }


def graphed_events(engine: Any, prompt: list[int], steps: int) -> float:
    """Device events (kernels, copies) per kept step with the graphs on (the served path)."""
    trace, kept = profiled(engine, prompt, steps, True, stacks=False)
    return round(len(parse(trace, True, kept)) / max(len(kept), 1), 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    is_cuda = args.device.startswith("cuda")
    report: dict[str, Any] = {}
    for name in args.models.split(","):
        built = build(MODELS[name], args.k, args.device, graphs=False)
        vocab = built["plain"].runner.vocab_size
        prompt = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0)).tolist()
        for side, engine in built.items():
            row = profile_side(engine, prompt, args.steps, is_cuda)
            report[f"{name}/{side}/eager"] = row
            print(f"== {name} {side} (eager): {row['launches_per_step']} launches a step over {row['steps']}")
            print("   by phase: " + ", ".join(f"{p} {c}" for p, c in row["by_phase"].items()))
            for f, c in list(row["by_frame"].items())[: args.top]:
                print(f"   {c:6.2f}  {f}")
            for kname, c in list(row["by_kernel"].items())[:15]:
                print(f"   {c:6.2f}  kernel {kname}")
        del built
        if is_cuda:
            graphed = build(MODELS[name], args.k, args.device, graphs=True)
            for side, engine in graphed.items():
                ev = graphed_events(engine, prompt, args.steps)
                report[f"{name}/{side}/graphed"] = {"device_events_per_step": ev}
                print(f"== {name} {side} (graphed): {ev} device events a step")
            del graphed
        print(flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
