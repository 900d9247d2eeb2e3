"""`EngineConfig.check_page_tags`: off, the engine reads no tag and detects nothing; on, it does.

For the engine test model and the tiny real checkpoints of each family (GQA, MLA, MLA + DSA): on
clean pages the unchecked engine's tokens equal the checked engine's, and a corrupted expected tag
(the pages themselves untouched) goes unnoticed with the check off, where the checked engine aborts
its victim. The fault-injection suite (test_faults.py) covers the check on in depth.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine.engine import Engine
from tests.backend.engine_faults import FaultInjector
from tests.backend.engine_helpers import MODELS, ModelShelf, Result, collect, make_engine, prompt_of, request

CORRUPT_AT_STEP = 4  # every request is decoding by then


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelShelf:
    return ModelShelf(Path(tmp_path_factory.mktemp("tag_switch_models")))


def run(engine: Engine, *, corrupt: bool) -> dict[str, Result]:
    """Four requests across page edges; with `corrupt`, r1's first expected tag is flipped mid-decode."""
    vocab = engine.scheduler.vocab_size
    for i, n in enumerate([18, 33, 9, 40]):
        engine.add_request(request(f"r{i}", prompt_of(200 + i, n, vocab), max_tokens=10))
    results: dict[str, Result] = {}
    injector = FaultInjector(engine)
    for step in range(200):
        if not engine.has_unfinished:
            return results
        if corrupt and step == CORRUPT_AT_STEP:
            injector.corrupt_expected_tag("r1")
        collect(results, engine.step())
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("model_name", MODELS)
def test_check_off_detects_nothing_and_changes_no_token(model_name: str, models: ModelShelf) -> None:
    model = models[model_name]
    checked = make_engine(model, num_pages=32, max_num_batched_tokens=128)
    unchecked = make_engine(model, num_pages=32, max_num_batched_tokens=128, check_page_tags=False)
    clean = run(checked, corrupt=False)
    assert all(r.error is None and len(r.token_ids) == 10 for r in clean.values())
    assert checked.stats.checked_seqs > 0

    assert {k: r.token_ids for k, r in run(unchecked, corrupt=False).items()} == {
        k: r.token_ids for k, r in clean.items()
    }
    corrupted = run(unchecked, corrupt=True)  # the same engine again: its pool is back to free
    assert {k: r.token_ids for k, r in corrupted.items()} == {k: r.token_ids for k, r in clean.items()}
    assert all(r.error is None for r in corrupted.values())
    assert unchecked.stats.tag_check_aborts == 0 and unchecked.stats.checked_seqs == 0

    caught = run(checked, corrupt=True)  # the contrast: on, the same corruption aborts r1
    assert caught["r1"].error is not None and caught["r1"].error.code == "integrity_abort"
    assert checked.stats.tag_check_aborts == 1
