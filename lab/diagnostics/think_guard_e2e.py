"""Empty answers of nano GLM with reasoning on, with and without the reasoning guard (issue 26).

An empty answer: the turn ended (eos / `<|user|>` …) with reasoning text but no answer text and no
tool call: what a caller of the API sees as `content: ""`. Each prompt runs through the serving
layer's `prepare` (chat template, reasoning on by default: the GLM prompt ends in `<think>`) and
output processor, on an in-process engine, in four modes: greedy, greedy with `--speculative mtp:2`
(every request drafting 2 every step), temperature 0.7 (seeded), and temperature 0.7 with mtp:2.
"before" drops the request's reasoning markers, so no guard is built. An empty answer can also be
a block closed and then nothing, or a turn cut by max_tokens while it reasons: counted apart.

OMP_NUM_THREADS=2 PYTHONPATH=. /work/main/.venv/bin/python lab/diagnostics/think_guard_e2e.py \
    [models/glm-5.2-nano] [max_tokens]
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import msgspec

from backend.engine.engine import Engine
from backend.server.generation import Prepared, Serving
from backend.server.model_card import ServedModel
from backend.server.rank_group import build_engine
from backend.server.settings import BackendSettings
from schemas.backend import (
    EngineOutput,
    GenerateRequest,
    Message,
    ReasoningDelta,
    SamplingParams,
    TextDelta,
    ToolCallDelta,
)

PROMPTS = [
    "Hi!", "Hello, how are you?", "Good morning!", "Hey there, what's up?", "Thanks for your help.",
    "Can you say hello in French?", "Nice to meet you.", "Good night!", "How's your day going?", "Bye!",
    "What is the capital of France?", "How many days are in a week?", "What color is the sky?",
    "Who wrote Romeo and Juliet?", "What is 2 + 2?", "What is the boiling point of water?",
    "How many legs does a spider have?", "What is the largest planet?", "What language is spoken in Brazil?",
    "What is the opposite of hot?", "Name a fruit that is yellow.", "How many hours are in a day?",
    "What is the square root of 81?", "Which animal says moo?", "What is the freezing point of water in Celsius?",
    "Spell the word cat backwards.", "What is 10 times 7?", "What month comes after March?",
    "Is a tomato a fruit?", "What do bees make?",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "Sara had 12 cookies and ate 4. How many are left?",
    "If a pen costs 2 dollars, how much do 6 pens cost?",
    "There are 4 boxes with 5 balls each. How many balls in total?",
    "A class has 30 students and 12 are girls. How many are boys?",
    "Mike reads 10 pages a day. How many pages does he read in a week?",
    "I have 20 dollars and spend 7. How much is left?",
    "A pizza has 8 slices shared by 4 friends. How many slices each?",
    "Anna is 9 and her brother is 4 years older. How old is he?",
    "A rectangle is 3 m by 5 m. What is its area?",
    "Half of 48 is what?", "If today is Monday, what day is it in 3 days?",
    "A shop sells 15 apples in the morning and 9 in the afternoon. How many in all?",
    "Ben runs 2 km every day for 5 days. How far does he run?",
    "Give me a tip for sleeping better.", "Suggest a name for a cat.", "What should I cook for dinner?",
    "Tell me a short joke.", "How do I boil an egg?", "Write one sentence about the sea.",
    "Recommend a book for a long flight.", "How can I stay focused while studying?",
    "What is a good way to start the morning?", "Give me a synonym for happy.",
    "Translate 'thank you' into Spanish.", "What's a healthy snack?", "How do I say good morning in German?",
    "Describe a sunset in five words.", "Why do leaves change color in autumn?",
]  # fmt: skip
MODES = {
    "greedy": (0, 0.0),
    "mtp2": (2, 0.0),
    "t0.7": (0, 0.7),
    "t0.7+mtp2": (2, 0.7),
}  # (drafts, temperature)


def engine_for(model: str, num_drafts: int) -> Engine:
    settings = BackendSettings(
        model=model, port=1, secret="x" * 32, dtype="float32", max_pages=2048, speculative=num_drafts,
        speculative_max_seqs=64, speculative_adaptive=False,  # all 60 draft K every step
    )  # fmt: skip
    return build_engine(settings)


def run(
    serving: Serving, engine: Engine, temperature: float, max_tokens: int, *, guard: bool
) -> tuple[Counter[str], dict[str, list[int]]]:
    prepared: dict[str, Prepared] = {}
    for i, text in enumerate(PROMPTS):
        request = GenerateRequest(
            request_id=f"p{i}",
            tenant_salt="a" * 32,
            messages=[Message(role="user", content=text)],
            sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i),
        )
        p = serving.prepare(request)
        if not guard:
            p.engine_request = msgspec.structs.replace(p.engine_request, reasoning_markers=None)
        prepared[request.request_id] = p
        engine.add_request(p.engine_request, constraint=p.constraint)
    answers = {rid: "" for rid in prepared}
    reasoning = {rid: "" for rid in prepared}
    calls = {rid: 0 for rid in prepared}
    tokens: dict[str, list[int]] = {rid: [] for rid in prepared}
    finish: dict[str, str] = {}
    while engine.has_unfinished:
        outputs: list[EngineOutput] = engine.step()
        for out in outputs:
            tokens[out.request_id] += out.token_ids
            for event in prepared[out.request_id].processor.process(out):
                if isinstance(event, TextDelta):
                    answers[out.request_id] += event.text
                elif isinstance(event, ReasoningDelta):
                    reasoning[out.request_id] += event.text
                elif isinstance(event, ToolCallDelta):
                    calls[out.request_id] += 1
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    think = serving.model.think
    assert think is not None
    counts: Counter[str] = Counter()
    for rid, p in prepared.items():
        is_empty = not answers[rid].strip() and not calls[rid]
        is_open = think.is_open_after(p.engine_request.prompt_token_ids + tokens[rid])
        counts[f"finish_{finish[rid]}"] += 1
        if is_empty:
            counts["empty"] += 1
            # the turn ended inside the block (the bug); closed it, then ended with no answer;
            # max_tokens cut it while it still reasoned
            kind = "inside" if finish[rid] == "stop" and is_open else "closed" if is_open is False else "cut"
            counts[f"empty_{kind}"] += 1
            if kind == "closed":
                print(f"    {rid} closed, no answer: {serving.model.tokenizer.decode(tokens[rid])[-120:]!r}")
    return counts, tokens


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "models/glm-5.2-nano"
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    served = ServedModel.from_checkpoint(model)
    print(f"{model}: {len(PROMPTS)} prompts, max_tokens {max_tokens}, eos {served.eos_token_ids}")
    outputs: dict[tuple[str, bool], dict[str, list[int]]] = {}
    for mode, (num_drafts, temperature) in MODES.items():
        engine = engine_for(model, num_drafts)
        serving = Serving(served, engine)  # type: ignore[arg-type]  # only `prepare` is used
        for guard in (False, True):
            start = time.perf_counter()
            greedy_steps = engine.spec.num_greedy_steps if engine.spec is not None else 0
            counts, outputs[mode, guard] = run(serving, engine, temperature, max_tokens, guard=guard)
            if engine.spec is not None:  # whole greedy steps on the device (greedy.py), this run's
                greedy_steps = engine.spec.num_greedy_steps - greedy_steps
            label = "after " if guard else "before"
            print(
                f"{mode:9s} {label}: empty answers {counts['empty']}/{len(PROMPTS)}: "
                f"turn ended inside <think> {counts['empty_inside']}, after </think> "
                f"{counts['empty_closed']}, cut by max_tokens {counts['empty_cut']}; "
                f"finish {dict(sorted((k, v) for k, v in counts.items() if k.startswith('finish')))}; "
                f"greedy device steps {greedy_steps} [{time.perf_counter() - start:.0f} s]",
                flush=True,
            )
        if num_drafts:
            s = engine.stats
            print(
                f"    drafts accepted {s.spec_accepted_tokens}/{s.spec_drafted_tokens} in {s.spec_verifies} verifies"
            )
    for guard in (False, True):
        same = sum(
            outputs["mtp2", guard][rid] == outputs["greedy", guard][rid] for rid in outputs["greedy", guard]
        )
        print(f"mtp2 == greedy token for token, guard {'on' if guard else 'off'}: {same}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
