"""Serving-layer cost per generated token, on the CPU, for both tokenizer formats.

- output path: reasoning split + tool-call parser + incremental detokenizer + stop matching, one token
  per engine output (the decode case), per request;
- grammar mask: llguidance's allowed-token mask for a JSON schema, per token, and the cost of
  accepting a token.

    python -m benchmarks.serving.bench_output_path [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from backend.text.output_processor import OutputProcessor
from backend.text.reasoning import ReasoningParser, ThinkMarkers
from backend.text.structured import build_constraint, grammar_for
from backend.text.tokenizer import load_tokenizer
from backend.text.tokenizer_files import write_tokenizer_files
from backend.text.tool_parsers import parser_for
from schemas.backend import EngineOutput, GenerateRequest, ResponseFormat, Tool

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
                "required": ["name", "count"],
            },
        }
    },
    "required": ["items"],
}


def bench(family: str, fmt: str, folder: Path) -> dict[str, float]:
    write_tokenizer_files(family, folder, fmt=fmt)  # type: ignore[arg-type]
    tok = load_tokenizer(folder)
    think = ThinkMarkers.of(tok)
    assert think is not None
    ids = tok.encode(Path(__file__).read_text() * 4, allow_special=False)
    processor = OutputProcessor(
        tok,
        reasoning=ReasoningParser(think, prompt_token_ids=[], enabled=True),
        tools=parser_for(family, tok, [Tool(name="x")]),
        stops=["never-there"],
        skip_ids=frozenset(),
    )
    start = time.perf_counter()
    for token_id in ids:
        processor.process(EngineOutput(request_id="r", token_ids=[token_id]))
    output_us = (time.perf_counter() - start) / len(ids) * 1e6

    eos = tok.named_id("eos_token")
    assert eos is not None
    request = GenerateRequest(
        request_id="r",
        tenant_salt="0" * 16,
        prompt="x",
        response_format=ResponseFormat(type="json_schema", json_schema=SCHEMA),
    )
    grammar = grammar_for(request, family, {})
    assert grammar is not None
    constraint = build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos]))
    answer = tok.encode(
        json.dumps({"items": [{"name": f"thing {i}", "count": i} for i in range(12)]}, separators=(",", ":"))
    )
    mask_s = accept_s = 0.0
    for token_id in answer:
        t0 = time.perf_counter()
        mask = constraint.allowed_tokens(tok.vocab_size)
        t1 = time.perf_counter()
        assert mask is not None and bool(mask[token_id])
        constraint.accept(token_id)
        accept_s += time.perf_counter() - t1
        mask_s += t1 - t0
    return {
        "vocab": tok.vocab_size,
        "output_path_us_per_token": round(output_us, 2),
        "grammar_mask_us_per_token": round(mask_s / len(answer) * 1e6, 2),
        "grammar_accept_us_per_token": round(accept_s / len(answer) * 1e6, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, object] = {
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "note": "tiny test vocabularies (~840 ids): mask cost grows with the vocabulary (Kimi 163,840 ids)",
    }
    with tempfile.TemporaryDirectory() as tmp:
        for family, fmt in (("glm", "tokenizer.json"), ("kimi", "tiktoken")):
            results[f"{family}-{fmt}"] = bench(family, fmt, Path(tmp) / family)
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
