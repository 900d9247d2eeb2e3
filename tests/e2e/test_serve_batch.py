# ruff: noqa: F811  (pytest fixtures imported by name)
"""Async batch through `kumo serve`: queued, run by real CPU backends, polled to its results."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.serve_process import GLM, LEGACY, Kumo

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model", [LEGACY, GLM])
def test_a_batch_runs_on_real_backends(kumo: Kumo, model: str) -> None:
    item = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 1}
    body = {"requests": [{**item, "external_reference": "a"}, {**item, "external_reference": "b"}]}
    r = httpx.post(kumo.path(f"/ai/run/{model}?queueRequest=true"), headers=kumo.auth, json=body, timeout=60)
    assert r.status_code == 200, r.text
    job_id = r.json()["result"]["request_id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        polled = httpx.post(
            kumo.path(f"/ai/run/{model}"), headers=kumo.auth, json={"request_id": job_id}, timeout=60
        )
        assert polled.status_code == 200, polled.text
        result = polled.json()["result"]
        if "responses" in result:
            break
        assert result["status"] in ("queued", "running")
        time.sleep(0.2)
    responses = result["responses"]
    assert [x["external_reference"] for x in responses] == ["a", "b"] and all(x["success"] for x in responses)
    assert result["usage"]["completion_tokens"] == 6
    direct = httpx.post(kumo.path(f"/ai/run/{model}"), headers=kumo.auth, json=item, timeout=60).json()[
        "result"
    ]
    # same seed, same answer, queued or not
    assert text(responses[0]["result"]) == text(responses[1]["result"]) == text(direct)


def text(result: dict) -> str:  # type: ignore[type-arg]
    return str(result["response"] if "response" in result else result["choices"][0]["message"]["content"])
