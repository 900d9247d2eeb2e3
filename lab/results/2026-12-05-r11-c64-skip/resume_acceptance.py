"""Accepted drafts per verify after drafting resumes (mtp:3 every step once let, Kimi nano, 8 held-out
prompts, 160 tokens, CPU fp32): from step 48 on, in a run drafting from its first step and in one whose
first 48 steps are plain (the prompts prefilled idle). Run from the repository root:
    OMP_NUM_THREADS=1 python lab/results/2026-12-05-r11-c64-skip/resume_acceptance.py
"""

from pathlib import Path

import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
from benchmarks.engine.mtp_acceptance import held_out_prompts
from schemas.backend import EngineRequest, SamplingParams

ck = Path("models/kimi-k2.6-nano")
m = load_model(ck, dtype=torch.float32, num_mtp_layers=num_mtp_layers_in(ck))
prompts = [p for t in ("chat", "tool-call") for p in held_out_prompts(ck, t, 4)]
IDLE = 48


def go(idle_steps):
    cfg = EngineConfig.build(
        num_pages=2048,
        page_size=16,
        max_num_batched_tokens=4096,
        max_num_seqs=8,
        enable_prefix_cache=False,
        num_speculative_tokens=3,
        speculative_max_seqs=8,
        speculative_adaptive=False,
    )
    e = Engine.from_prepared(prepare_model(m, cfg), cfg)
    choose = e.spec.policy.choose
    n = [0]

    def ch(load):
        n[0] += 1
        return 0 if n[0] <= idle_steps else choose(load)

    e.spec.policy.choose = ch
    for i, p in enumerate(prompts):
        e.add_request(
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=p,
                tenant_salt="a" * 32,
                sampling=SamplingParams(temperature=0.0, max_tokens=160),
            )
        )
    steps = 0
    base = None
    while e.has_unfinished:
        e.step()
        steps += 1
        if steps == IDLE:
            s = e.stats
            base = (s.spec_verifies, s.spec_accepted_tokens, s.spec_drafted_tokens)
    s = e.stats
    v, a, d = s.spec_verifies - base[0], s.spec_accepted_tokens - base[1], s.spec_drafted_tokens - base[2]
    print(
        idle_steps,
        "after step",
        IDLE,
        "verifies",
        v,
        "accepted/verify %.3f" % (a / v),
        "rate %.3f" % (a / d),
        flush=True,
    )


for idle in (0, IDLE):
    go(idle)
