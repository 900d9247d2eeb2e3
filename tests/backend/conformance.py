"""Shared conformance check: our paged model vs transformers on the same tiny checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from backend.models.loader import load_model
from schemas.backend import TokenLogprob
from tests.backend.paged_driver import PagedDriver
from tests.backend.tiny_checkpoints import load_reference

# lengths straddle page boundaries (16) and exceed YaRN's original 32 positions
PROMPT_LENGTHS = (15, 16, 17, 33, 45)
MAX_ABS_DIFF = 1e-4


def prompts(vocab: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def reference_logits(ref: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return ref(input_ids=torch.tensor([tokens])).logits[0].float()  # [L, V]


@torch.no_grad()
def reference_greedy(ref: torch.nn.Module, tokens: list[int], num_steps: int) -> list[int]:
    """Greedy decoding by full recomputation: no cache on the reference side at all."""
    seq, out = list(tokens), []
    for _ in range(num_steps):
        nxt = int(reference_logits(ref, seq)[-1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


def step_logprob_diffs(
    ref: torch.nn.Module, prompt: list[int], logprobs: list[TokenLogprob], *, num_top: int
) -> list[float]:
    """Each generated step's largest |ours − transformers| log-prob, transformers running a full
    forward over the prompt and the tokens generated before that step (no cache on its side).

    A step compares the chosen token's log-prob, each reported top entry's, and the top values
    themselves (so a token missing from ours shows), which catches a step that greedy tokens hide.
    """
    tokens, diffs = list(prompt), []
    for lp in logprobs:
        expected = torch.log_softmax(reference_logits(ref, tokens)[-1], dim=-1)  # [V]
        assert len(lp.top) == num_top
        ours = torch.tensor([lp.logprob, *(t.logprob for t in lp.top)])
        theirs = expected[[lp.token_id, *(t.token_id for t in lp.top)]]
        top_values = torch.tensor(sorted((t.logprob for t in lp.top), reverse=True))
        diffs.append(
            max(
                float((ours - theirs).abs().max()),
                float((top_values - expected.topk(num_top).values).abs().max()),
            )
        )
        tokens.append(lp.token_id)
    return diffs


def prefill_max_diff(arch: str, path: Path, *, chunk: int = 16) -> float:
    """Max |ours − transformers| over every position of every prompt, prefilled in chunks."""
    loaded = load_model(path, dtype=torch.float32)
    ref = load_reference(arch, path)
    ps = prompts(loaded.config.vocab_size)
    driver = PagedDriver(loaded.model)
    _, ours = driver.prefill(ps, chunk)
    assert not driver.last_mismatch.any()
    return max(float((o - reference_logits(ref, p)).abs().max()) for o, p in zip(ours, ps, strict=True))


def greedy_matches(
    arch: str, path: Path, *, num_steps: int = 32, chunk: int = 16
) -> tuple[list[list[int]], list[list[int]]]:
    loaded = load_model(path, dtype=torch.float32)
    ref = load_reference(arch, path)
    ps = prompts(loaded.config.vocab_size, (17, 33))
    ours = PagedDriver(loaded.model).greedy(ps, num_steps, chunk)
    theirs = [reference_greedy(ref, p, num_steps) for p in ps]
    return ours, theirs
