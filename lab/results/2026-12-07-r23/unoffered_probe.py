"""Session 23: which everyday prompts, offered no tools, make the nano models open a tool call when
its markers are not banned (`PYTHONPATH=. python unoffered_probe.py kimi-k2.6-nano glm-5.2-nano`)."""

import sys
from pathlib import Path
from typing import Any

import msgspec

from backend.server.generation import Serving
from backend.server.model_card import ServedModel
from backend.server.rank_group import build_engine
from backend.server.settings import BackendSettings
from schemas.backend import EngineRequest, GenerateRequest, Message, SamplingParams
from tests.backend.engine_helpers import run_all

PROMPTS = [
    "What's the weather in Paris?", "Set a timer for 5 minutes.", "Convert 100 dollars to euros.",
    "What is the weather like in Tokyo today?", "Remind me to call mom at 6pm.", "How hot is it in Berlin?",
    "Send an email to Bob saying hi.", "What time is it in London?", "Book a table for two tonight.", "Hi!",
    "Is it raining in Madrid?", "Please set an alarm for 7am.", "Translate hello to Spanish.", "What is 12 times 4?",
]  # fmt: skip


def prepared(name: str, prompts: list[str], **fields: Any) -> tuple[ServedModel, Any, list[EngineRequest]]:
    """The nano model `name` (fp32, CPU), its engine, and greedy chat requests of `prompts`."""
    path = Path(f"models/{name}")
    served = ServedModel.from_checkpoint(path)
    engine = build_engine(BackendSettings(model=str(path), port=1, secret="x" * 32, dtype="float32"))
    serving = Serving(served, engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=64)
    reqs = [
        serving.prepare(GenerateRequest(request_id=f"p{i}", tenant_salt="a" * 32, sampling=sampling,
                                        messages=[Message(role="user", content=t)], **fields)).engine_request
        for i, t in enumerate(prompts)
    ]  # fmt: skip
    return served, engine, reqs


def main(names: list[str]) -> None:
    for name in names:
        served, engine, reqs = prepared(name, PROMPTS)
        ban = set(reqs[0].banned_token_ids)
        print(name, "banned", sorted(ban))
        before = run_all(engine, [msgspec.structs.replace(r, banned_token_ids=[]) for r in reqs])
        after = run_all(engine, reqs)
        for r, t in zip(reqs, PROMPTS, strict=True):
            b, a = before[r.request_id], after[r.request_id]
            hit = bool(ban & set(b.token_ids))
            print(
                f"{t!r}: leak_before={hit} leak_after={bool(ban & set(a.token_ids))} same={b.token_ids == a.token_ids}"
            )
            if hit:
                print("   before:", served.tokenizer.decode(b.token_ids)[:150].replace("\n", "\\n"))
                print("   after: ", served.tokenizer.decode(a.token_ids)[:150].replace("\n", "\\n"))


if __name__ == "__main__":
    main(sys.argv[1:])
