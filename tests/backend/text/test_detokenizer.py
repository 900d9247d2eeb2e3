"""Streaming detokenization never emits half a character and adds up to the full decode."""

from __future__ import annotations

import pytest

from backend.text.detokenizer import REPLACEMENT, Detokenizer
from tests.backend.server_tokenizers import load

TEXT = "Emoji 🙂🚀🌧️ then 你好，世界 and 👍🏽 café — done"


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "glm"])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_never_splits_a_character(
    tmp_path_factory: pytest.TempPathFactory, layout: str, chunk: int
) -> None:
    tok = load(tmp_path_factory, layout)
    ids = tok.encode(TEXT)
    # the test only means something if some token ends inside a character
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    detok = Detokenizer(tok)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_unfinished_character_at_the_end_is_flushed(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    ids = tok.encode("ok 🦀")  # not in the training corpus: one token per byte
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith(REPLACEMENT))
    detok = Detokenizer(tok)
    streamed = "".join(detok.push([i]) for i in ids[:cut])
    assert REPLACEMENT not in streamed
    assert detok.pending
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT)
    assert streamed + tail == tok.decode(ids[:cut])
    assert not detok.pending
