"""`kumo backend --speculative mtp:2` end to end: the same greedy text, usage and log-probs as a
backend without it, over the same tiny GLM-5 checkpoint given MTP layers, and acceptance counters
on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from schemas.backend import Usage
from tests.backend.server.test_server import body, generate, scrape, text_of, wait_idle
from tests.backend.server_checkpoints import make_served_checkpoint
from tests.backend.server_process import RunningBackend, run_backend
from tests.backend.tiny_checkpoints import add_mtp_layers

pytestmark = pytest.mark.slow  # real `kumo backend` processes: `make test-fast` leaves them out

PROMPTS = ["Hello", "Write a haiku about paging.", "1, 2, 3, 4,", "def add(a, b):"]
# always K drafts: these check exactness while drafting; the adaptive policy (the default) drafts only
# where it measures drafting faster, which on the CPU it seldom is (tests/backend/engine/test_draft_policy.py)
ALWAYS = ("--no-speculative-adaptive",)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_layers(make_served_checkpoint("glm_moe_dsa", tmp_path_factory.mktemp("served-mtp")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[RunningBackend]:
    yield from run_backend(tmp_path_factory, model_dir=checkpoint)


@pytest.fixture(scope="module")
def speculative(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[RunningBackend]:
    yield from run_backend(
        tmp_path_factory, model_dir=checkpoint, extra_args=("--speculative", "mtp:2", *ALWAYS)
    )


async def test_speculative_backend_matches_the_plain_one(
    plain: RunningBackend, speculative: RunningBackend
) -> None:
    sampling = {"max_tokens": 24, "temperature": 0.0, "logprobs": True, "top_logprobs": 1}
    async with (
        httpx.AsyncClient(base_url=plain.url, timeout=60) as a,
        httpx.AsyncClient(base_url=speculative.url, timeout=60) as b,
    ):
        for i, prompt in enumerate(PROMPTS):
            payload = body(f"p{i}", prompt, sampling=sampling, reasoning={"enabled": False})
            want, got = await generate(a, payload), await generate(b, payload)
            assert text_of(got) == text_of(want)
            assert [u for u in got if isinstance(u, Usage)] == [u for u in want if isinstance(u, Usage)]
        metrics = await scrape(b)
        assert metrics["kumo_backend_spec_draft_tokens_total"] > 0
        assert metrics["kumo_backend_spec_verifies_total"] > 0
        assert "kumo_backend_spec_accepted_tokens_total" in metrics
        assert metrics["kumo_backend_spec_draft_length"] == 2  # always K: --no-speculative-adaptive
        assert 1 <= metrics["kumo_backend_spec_acceptance_length"] <= 3  # tokens per verify, EWMA
        off = await scrape(a)
        assert off["kumo_backend_spec_draft_tokens_total"] == 0
        assert off["kumo_backend_spec_draft_length"] == off["kumo_backend_spec_acceptance_length"] == 0
        assert (await wait_idle(b, speculative.num_pages)).free_pages == speculative.num_pages


@pytest.fixture(scope="module")
def plain_fp8(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[RunningBackend]:
    yield from run_backend(tmp_path_factory, model_dir=checkpoint, extra_args=("--kv-dtype", "fp8"))


@pytest.fixture(scope="module")
def speculative_fp8(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[RunningBackend]:
    args = ("--kv-dtype", "fp8", "--speculative", "mtp:3", *ALWAYS)
    yield from run_backend(tmp_path_factory, model_dir=checkpoint, extra_args=args)


async def test_speculation_with_an_fp8_cache_matches_fp8_decoding(
    plain_fp8: RunningBackend, speculative_fp8: RunningBackend
) -> None:
    """The embedded default's cache (`kumo serve`: FP8 KV, scales calibrated at load for the target
    and the MTP layer alike): the same greedy text with and without 3 drafts, and drafts verified."""
    sampling = {"max_tokens": 24, "temperature": 0.0}
    async with (
        httpx.AsyncClient(base_url=plain_fp8.url, timeout=60) as a,
        httpx.AsyncClient(base_url=speculative_fp8.url, timeout=60) as b,
    ):
        for i, prompt in enumerate(PROMPTS):
            payload = body(f"p{i}", prompt, sampling=sampling, reasoning={"enabled": False})
            assert text_of(await generate(b, payload)) == text_of(await generate(a, payload))
        assert (await scrape(b))["kumo_backend_spec_verifies_total"] > 0
