"""The transformers peer's fallback when a batch's prefill does not fit: transformers' chunked prefill."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.engine import hf_peer
from benchmarks.engine.geometry import make_geometry


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    return hf_peer.build_hf_model(make_geometry("kimi-k2.6", 2, tiny=True), "cpu")


def _small_run(model: Any) -> dict[str, Any]:
    """`generate` at concurrency 2, 16 prompt tokens, 3 output tokens each."""
    return hf_peer.run_mode(
        model,
        "generate",
        concurrency=2,
        input_len=16,
        output_len=3,
        vocab=model.config.vocab_size,
        device="cpu",
    )


def test_chunked_prefill_generates_the_same_tokens(model: Any) -> None:
    ids = torch.randint(1, model.config.vocab_size, (2, 24))
    whole = hf_peer._generate(model, ids, 4, static=False)
    chunked = hf_peer._generate(model, ids, 4, static=False, prefill_chunk=8)
    assert torch.equal(whole, chunked)


@pytest.mark.parametrize("failing", [1, 2])
def test_an_out_of_memory_run_is_retried_with_chunked_prefill(
    model: Any, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    calls: list[int | None] = []
    real = hf_peer._generate
    too_big = set(hf_peer.PREFILL_CHUNKS[:failing])

    def short_of_memory(
        m: Any, ids: torch.Tensor, new: int, static: bool, prefill_chunk: int | None = None
    ) -> Any:
        calls.append(prefill_chunk)
        if prefill_chunk in too_big:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.00 GiB.")
        return real(m, ids, new, static, prefill_chunk)

    monkeypatch.setattr(hf_peer, "_generate", short_of_memory)
    row = _small_run(model)
    chunk = hf_peer.PREFILL_CHUNKS[failing]
    assert row["prefill_chunk_size"] == chunk
    assert calls == list(hf_peer.PREFILL_CHUNKS[:failing]) + [chunk, chunk]  # TTFT call, then the whole run
    assert len(row["out_of_memory"]) == failing and "28.00 GiB" in row["out_of_memory"][-1]
    assert row["output_tokens"] == 6


def test_a_run_that_never_fits_says_so_for_every_attempt(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(m: Any, ids: torch.Tensor, new: int, static: bool, prefill_chunk: int | None = None) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(hf_peer, "_generate", never)
    with pytest.raises(torch.OutOfMemoryError, match="prefill_chunk_size=128"):
        _small_run(model)


def test_a_run_that_fits_is_not_chunked(model: Any) -> None:
    row = _small_run(model)
    assert "prefill_chunk_size" not in row


def test_a_repeat_starts_at_the_chunk_that_fit(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scenario's later runs pass the chunk the first run fitted with: no attempt that runs out
    of memory again before each timed run."""
    calls: list[int | None] = []
    real = hf_peer._generate

    def spy(m: Any, ids: torch.Tensor, new: int, static: bool, prefill_chunk: int | None = None) -> Any:
        calls.append(prefill_chunk)
        return real(m, ids, new, static, prefill_chunk)

    monkeypatch.setattr(hf_peer, "_generate", spy)
    chunk = hf_peer.PREFILL_CHUNKS[1]
    row = hf_peer.run_mode(
        model, "generate", concurrency=2, input_len=16, output_len=3, vocab=model.config.vocab_size,
        device="cpu", first_chunk=chunk,
    )  # fmt: skip
    assert calls == [chunk, chunk] and row["prefill_chunk_size"] == chunk and "out_of_memory" not in row
