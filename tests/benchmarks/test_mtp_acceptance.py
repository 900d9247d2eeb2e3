"""The acceptance bench measures the draft head at K drafts on every step, whatever the draft policy
would choose (with the adaptive policy on, a short CPU run drafted on 3 of ~490 tokens and read
"1.67" where the head accepts ~3.4)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.engine import mtp_acceptance


def test_every_decode_step_is_a_verify_with_k_drafts(tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    argv = ["--model", "models/glm-5.2-nano", "--tasks", "tool-call", "--prompts", "2", "--max-tokens", "24"]
    assert mtp_acceptance.main([*argv, "--speculative", "mtp:2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["models"]["glm-5.2-nano"]["tool-call"]
    assert r["greedy_outputs_differing_from_plain_decoding"] == 0
    # each prompt's first token comes from its prefill, every later one from a verify step (its accepted
    # drafts plus the bonus); a step may overshoot max_tokens or a stop by up to K tokens
    emitted = r["verify_steps"] + r["accepted_drafts"]
    assert r["output_tokens"] - 2 <= emitted <= r["output_tokens"] - 2 + 2 * 2
    assert 1 <= r["acceptance_length"] <= 3
