"""Which path each step of a c=1 speculative generation takes, and its host work, on the CPU (issue 28):

    python3 -m lab.diagnostics.spec_paths [--models glm,kimi] [--max-tokens 48] [--out FILE.json]

One nano model loaded once (fp32, CPU); engines as served with `--speculative mtp:3` (the adaptive
draft policy, its draft cost measured; and the policy fixed at K = 3 for comparison), their graphs
captured through a counting `eager_capture` (lab/diagnostics/spec_host.py's `Meter`), so every step
takes the path it takes on the GPU, a replay standing for one `cudaGraphLaunch`. Requests go through
the serving layer's `prepare` (chat template; GLM's prompt opens `<think>`, so its requests carry a
reasoning guard), one at a time, in these modes:

- `greedy`: temperature 0 (with the template's reasoning guard where the model has one);
- `greedy-noguard`: the same without the guard's markers;
- `sampled`: temperature 0.7, top-p 0.95, seeded;
- `json`: greedy under `response_format: json_object` (a grammar: such requests never draft);
- `logprobs`: greedy asking for log-probs.

Each step is classified by the path it took: `device-graph` (a whole speculative step replayed from
one graph: backend/engine/speculative/greedy.py), `device-eager` (the same function run eagerly),
`host` (verify forward, acceptance on the host, then the draft depths' forwards), `plain` (a decode
step without drafts), `prefill`. Per path, per step: `reads` (`.tolist()`, `.item()`, `.cpu()`,
`.numpy()`: each a device-to-host sync on CUDA), `h2d` (host-to-device copies), `aten_ops` (torch ops
dispatched outside graph replays and model forwards: launches on the device), `replays` and
`eager_forwards`.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import msgspec
import torch

from lab.diagnostics.spec_host import MODELS, AtenCounter, Meter, instrument

MODES = ("greedy", "greedy-noguard", "sampled", "json", "logprobs")
PROMPTS = ("Tell me a short joke.", "How do I boil an egg?", "What is the capital of France?")


def build(checkpoint: Path, meter: Meter) -> dict[str, Any]:
    """Engines over one loaded copy: `served` (adaptive policy, as `--speculative mtp:3` serves) and
    `fixed` (always 3 drafts)."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    loaded = load_model(
        checkpoint, dtype=torch.float32, device="cpu", num_mtp_layers=num_mtp_layers_in(checkpoint)
    )
    out = {}
    for side, adaptive in (("served", True), ("fixed", False)):
        config = EngineConfig.build(
            num_pages=512, page_size=16, max_num_batched_tokens=4096, max_num_seqs=4,
            cuda_graph_batch_sizes=(1, 2, 4), num_speculative_tokens=3, speculative_max_seqs=4,
            speculative_adaptive=adaptive,
        )  # fmt: skip
        prepared = prepare_model(loaded, config, model_dtype=torch.float32)
        out[side] = Engine.from_prepared(prepared, config, graph_capture=meter.capture)
    return out


def request(serving: Any, mode: str, text: str, rid: str, max_tokens: int) -> Any:
    from schemas.backend import GenerateRequest, Message, ResponseFormat, SamplingParams

    temperature = 0.7 if mode == "sampled" else 0.0
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=0.95 if mode == "sampled" else 1.0, seed=7,
        logprobs=mode == "logprobs",
    )  # fmt: skip
    fmt = ResponseFormat(type="json_object") if mode == "json" else None
    req = GenerateRequest(
        request_id=rid, tenant_salt="a" * 32, messages=[Message(role="user", content=text)],
        sampling=sampling, response_format=fmt,
    )  # fmt: skip
    p = serving.prepare(req)
    if mode == "greedy-noguard":
        p.engine_request = msgspec.structs.replace(p.engine_request, reasoning_markers=None)
    return p


def classify(engine: Any, probe: dict[str, int], num_scheduled_tokens: int, num_seqs: int) -> str:
    if probe["greedy"]:
        return "device-graph" if probe["replays"] else "device-eager"
    if probe["spec"]:
        return "host"
    return "plain" if num_scheduled_tokens == num_seqs else "prefill"


def trace(engine: Any, serving: Any, meter: Meter, mode: str, max_tokens: int, counting: bool) -> list[dict]:
    """One request at a time over `PROMPTS`: per step, its path and (with `counting`) its counts."""
    spec = engine.spec
    graphs = engine.runner.spec_forwards.graphs if engine.runner.spec_forwards is not None else None
    probe = {"greedy": 0, "spec": 0, "replays": 0}
    scheduled_tokens = [0, 0]
    undo = []

    def wrap(obj: Any, name: str, key: str | None, after: Any = None) -> None:
        fn = getattr(obj, name)
        undo.append((obj, name, fn))

        def wrapper(*args: Any, **kw: Any) -> Any:
            if key is not None:
                probe[key] += 1
            out = fn(*args, **kw)
            if after is not None:
                after(out)
            return out

        setattr(obj, name, wrapper)

    def scheduled(out: Any) -> None:
        scheduled_tokens[:] = [out.num_tokens, len(out.scheduled)]

    wrap(spec, "_run_greedy", "greedy")
    wrap(spec, "run", "spec")
    wrap(engine.scheduler, "schedule", None, scheduled)
    if graphs is not None:
        wrap(graphs, "replay_greedy", "replays")
    steps = []
    try:
        for i, text in enumerate(PROMPTS):
            p = request(serving, mode, text, f"{mode}-{i}-{len(steps)}", max_tokens)
            engine.add_request(p.engine_request, constraint=p.constraint)
            while engine.has_unfinished:
                probe.update(greedy=0, spec=0, replays=0)
                meter.counts.clear()
                meter.counting = counting
                engine.step()
                meter.counting = False
                if scheduled_tokens[1] == 0:
                    continue
                path = classify(engine, probe, *scheduled_tokens)
                steps.append({"path": path, "counts": dict(meter.counts)})
    finally:
        for obj, name, fn in reversed(undo):
            if obj is spec or obj is graphs or obj is engine.scheduler:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)
    return steps


def summarize(steps: list[dict]) -> dict[str, Any]:
    by_path: dict[str, list[dict]] = collections.defaultdict(list)
    for s in steps:
        by_path[s["path"]].append(s["counts"])
    out: dict[str, Any] = {}
    for path, counted in sorted(by_path.items()):
        labels = sorted({k for c in counted for k in c})
        out[path] = {"steps": len(counted)} | {
            k: round(sum(c.get(k, 0) for c in counted) / len(counted), 2) for k in labels
        }
    return out


def main(argv: list[str] | None = None) -> int:
    from backend.server.generation import Serving
    from backend.server.model_card import ServedModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--sides", default="served,fixed")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for name in args.models.split(","):
        meter = Meter()
        engines = build(MODELS[name], meter)
        served = ServedModel.from_checkpoint(str(MODELS[name]))
        for side in args.sides.split(","):
            engine = engines[side]
            serving = Serving(served, engine)
            restore = instrument(meter, [engine.runner.model])
            try:
                with AtenCounter(meter):
                    for mode in args.modes.split(","):
                        summary = summarize(trace(engine, serving, meter, mode, args.max_tokens, True))
                        report[f"{name}/{side}/{mode}"] = summary
                        print(f"== {name} {side} {mode}", flush=True)
                        for path, row in summary.items():
                            cells = ", ".join(f"{k} {v}" for k, v in row.items() if k != "steps")
                            print(f"   {path:13} {row['steps']:4d} steps; per step: {cells}", flush=True)
            finally:
                restore()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
