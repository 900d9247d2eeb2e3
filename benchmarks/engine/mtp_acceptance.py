"""MTP acceptance length on the nano models' held-out prompts: tokens emitted per verify step.

    python -m benchmarks.engine.mtp_acceptance --model models/glm-5.2-nano --tasks chat,tool-call \
        --prompts 100 --speculative mtp:3 --out benchmarks/results/2026-12-04-mtp.json

The prompts are the recipe's test-split items (`models.recipes.build.split_seeds("test", …)`: odd
seeds, never trained on), rendered as serving renders them (`models.recipes.render`, the checkpoint's
own template and tokenizer), up to the first assistant turn. Each runs alone through the engine with
`--speculative mtp:K` drafting K on every step (the draft head's quality, not the draft policy's
choices: `speculative_adaptive` off), greedy, until a stop token or `--max-tokens`; its acceptance length is
1 + accepted drafts / verify steps (1 … K + 1, the bonus token included), read from the engine's
counters. Per task: the mean over all verify steps (pooled), and the spread of the per-prompt values.
The same prompts decoded without speculation must give the same tokens (checked on every prompt).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
from models.recipes.build import item, split_seeds
from models.recipes.render import Renderer
from models.recipes.world import make_world
from schemas.backend import EngineRequest, SamplingParams, parse_speculative


def held_out_prompts(checkpoint: Path, task: str, count: int) -> list[list[int]]:
    """The first `count` test items of `task`, each rendered up to its first assistant turn."""
    renderer, world = Renderer(checkpoint), make_world(0)
    out = []
    for seed in split_seeds("test", task, count):
        ex = renderer.examples(item(task, seed, world))[0]
        out.append(ex.token_ids[: ex.loss_mask.index(True)])
    return out


def stop_ids(checkpoint: Path) -> list[int]:
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    return list(eos) if isinstance(eos, list) else [eos]


def run_one(
    engine: Engine, prompt: list[int], stops: list[int], max_tokens: int
) -> tuple[list[int], int, int]:
    """Greedy tokens of one request, and the verify steps and accepted drafts it took."""
    s = engine.stats
    verifies, accepted = s.spec_verifies, s.spec_accepted_tokens
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    engine.add_request(
        EngineRequest(request_id="p", prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
    )
    tokens: list[int] = []
    while engine.has_unfinished:
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"the engine failed the request: {out.error}")
            tokens += out.token_ids
    s = engine.stats
    return tokens, s.spec_verifies - verifies, s.spec_accepted_tokens - accepted


def measure(
    checkpoint: Path, tasks: list[str], count: int, k: int, max_tokens: int, kv_dtype: str, draft: Path | None
) -> dict[str, Any]:
    loaded = load_model(
        checkpoint, dtype=torch.float32, num_mtp_layers=num_mtp_layers_in(checkpoint, draft), draft=draft
    )
    engines = {}
    for drafts in (0, k):
        config = EngineConfig.build(num_pages=256, page_size=16, max_num_batched_tokens=2048, max_num_seqs=4,
                                    num_speculative_tokens=drafts, speculative_max_seqs=4, kv_dtype=kv_dtype,
                                    speculative_adaptive=False)  # fmt: skip
        engines[drafts] = Engine.from_prepared(prepare_model(loaded, config), config)
    stops = stop_ids(checkpoint)
    out: dict[str, Any] = {}
    for task in tasks:
        per_prompt, verifies, accepted, mismatches, num_tokens = [], 0, 0, 0, 0
        start = time.monotonic()
        for prompt in held_out_prompts(checkpoint, task, count):
            tokens, v, a = run_one(engines[k], prompt, stops, max_tokens)
            plain, _, _ = run_one(engines[0], prompt, stops, max_tokens)
            mismatches += tokens != plain
            num_tokens += len(tokens)
            if v:
                per_prompt.append(1 + a / v)
                verifies, accepted = verifies + v, accepted + a
        q = statistics.quantiles(per_prompt, n=10) if len(per_prompt) > 1 else per_prompt * 9
        out[task] = {
            "prompts": count,
            "prompts_with_verifies": len(per_prompt),
            "output_tokens": num_tokens,
            "verify_steps": verifies,
            "accepted_drafts": accepted,
            "acceptance_length": round(1 + accepted / max(verifies, 1), 4),
            "per_prompt": {
                "mean": round(statistics.fmean(per_prompt), 4),
                "stdev": round(statistics.stdev(per_prompt), 4) if len(per_prompt) > 1 else 0.0,
                "min": round(min(per_prompt), 4),
                "p10": round(q[0], 4),
                "median": round(statistics.median(per_prompt), 4),
                "p90": round(q[-1], 4),
                "max": round(max(per_prompt), 4),
            },
            "greedy_outputs_differing_from_plain_decoding": mismatches,
            "wall_s": round(time.monotonic() - start, 1),
        }
        print(f"{checkpoint.name} {task}: acceptance_length {out[task]['acceptance_length']} "
              f"(per prompt {out[task]['per_prompt']}), {mismatches} outputs differ", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", required=True, help="a checkpoint with MTP layers")
    p.add_argument("--draft", type=Path, action="append", default=None, help="its draft folder, per --model")
    p.add_argument("--tasks", default="chat,tool-call")
    p.add_argument("--prompts", type=int, default=100, help="held-out prompts per task")
    p.add_argument("--speculative", default="mtp:3")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-dtype", default="auto", help="auto (the model's dtype) or float8_e4m3fn")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    k = parse_speculative(a.speculative)
    drafts = a.draft or [None] * len(a.model)
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m benchmarks.engine.mtp_acceptance " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), float32 weights",
        "metric": "acceptance_length: tokens emitted per verify step, the bonus token included (1 … K + 1)",
        "speculative": a.speculative,
        "kv_dtype": a.kv_dtype,
        "decoding": "greedy",
        "models": {},
    }
    for model, draft in zip(a.model, drafts, strict=True):
        record["models"][model.name] = measure(
            model, a.tasks.split(","), a.prompts, k, a.max_tokens, a.kv_dtype, draft
        )
    a.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
