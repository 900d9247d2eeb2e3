import sys
from pathlib import Path

from backend.server.generation import Serving
from backend.server.model_card import ServedModel
from backend.server.rank_group import build_engine
from backend.server.settings import BackendSettings
from schemas.backend import GenerateRequest, Message, Reasoning, SamplingParams
from tests.backend.engine.test_reasoning_guard import EVERYDAY
from tests.backend.engine_helpers import run_all

PROMPTS = EVERYDAY + [
    "What's the weather in Paris?",
    "Explain why the sky is blue.",
    "Think step by step: what is 17+25?",
]
for name in sys.argv[1:]:
    path = Path(f"models/{name}")
    served = ServedModel.from_checkpoint(path)
    engine = build_engine(BackendSettings(model=str(path), port=1, secret="x" * 32, dtype="float32"))
    serving = Serving(served, engine)
    think = served.think
    print(name, "think", think)
    reqs = [
        serving.prepare(
            GenerateRequest(
                request_id=f"p{i}",
                tenant_salt="a" * 32,
                messages=[Message(role="user", content=t)],
                reasoning=Reasoning(enabled=False),
                sampling=SamplingParams(temperature=0.0, max_tokens=64),
            )
        ).engine_request
        for i, t in enumerate(PROMPTS)
    ]
    res = run_all(engine, reqs)
    n = 0
    for r, t in zip(reqs, PROMPTS, strict=False):
        ids = res[r.request_id].token_ids
        if think and (think.start_id in ids or think.end_id in ids):
            n += 1
            print(f"  {t!r}: {served.tokenizer.decode(ids)[:120]!r}")
    print(name, n, "of", len(PROMPTS), "wrote think markers with reasoning off")
