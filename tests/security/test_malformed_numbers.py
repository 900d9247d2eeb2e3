"""Security review, item 3: malformed numbers and nesting were 500s. `str.isdigit` takes Unicode
digits such as '²' that `int` refuses (and `int` refuses more than 4,300 digits), so a request
timeout header, `?page=` or `?source=` (on the unauthenticated `/models` page too) crashed the
handler; a queued batch item nested 900 deep escaped its check as a RecursionError. Each is now
the API's own 400, or for the timeout header (documented as ignored when malformed) no error."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import KIMI, LEGACY, Harness

SUPERSCRIPT_TWO = "\u00b2"
TOO_MANY_DIGITS = "1" * 4400


def _error(r: httpx.Response) -> tuple[int, str]:
    envelope = r.json()
    assert envelope["success"] is False and envelope["result"] is None, r.text
    [error] = envelope["errors"]
    return r.status_code, error["message"]


@pytest.mark.parametrize("value", [SUPERSCRIPT_TWO, TOO_MANY_DIGITS])
async def test_a_malformed_request_timeout_header_is_ignored(harness: Harness, value: str) -> None:
    headers = [(k.encode(), v.encode()) for k, v in harness.auth().items()]
    headers.append((b"cf-aig-request-timeout", value.encode("latin-1")))
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"),
        headers=headers,
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    print(f"tried cf-aig-request-timeout of {value[:8]!r} ({len(value)} chars): got {r.status_code}")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", [SUPERSCRIPT_TWO, TOO_MANY_DIGITS, "--5", "-" + SUPERSCRIPT_TWO])
async def test_a_malformed_page_is_a_400(harness: Harness, value: str) -> None:
    r = await harness.http.get(
        harness.path("/ai/models/search"), headers=harness.auth(), params={"page": value}
    )
    print(f"tried ?page={value[:8]!r}: got {r.status_code} {r.text[:120]}")
    status, message = _error(r)
    assert status == 400 and "'page' must be an integer from 1 to" in message


@pytest.mark.parametrize("value", [SUPERSCRIPT_TWO, TOO_MANY_DIGITS])
async def test_a_malformed_source_is_a_400_on_the_api_and_the_page(harness: Harness, value: str) -> None:
    r = await harness.http.get(
        harness.path("/ai/models/search"), headers=harness.auth(), params={"source": value}
    )
    status, message = _error(r)
    assert status == 400 and "'source' must be a number" in message
    r = await harness.http.get(f"{harness.url}/models", params={"source": value})  # no credentials
    print(f"tried /models?source={value[:8]!r}: got {r.status_code} {r.text[:120]}")
    assert r.status_code == 400 and "'source' must be a number" in r.text


async def test_a_deeply_nested_batch_item_is_a_400(harness: Harness) -> None:
    for depth, expected in (
        (900, "Expected `int`, got `array` - at `$.requests[1].max_tokens`"),  # msgspec reads it: typed
        (5000, "Bad input: the body is nested too deeply"),  # past msgspec's depth limit: the body's decode
    ):
        deep = "[" * depth + "1.0" + "]" * depth
        raw = '{"requests":[{"prompt":"x"},{"prompt":"x","max_tokens":' + deep + "}]}"
        r = await harness.http.post(
            harness.path(f"/ai/run/{LEGACY}"),
            params={"queueRequest": "true"},
            headers={**harness.auth(), "content-type": "application/json"},
            content=raw,
        )
        print(f"tried a batch item nested {depth} deep: got {r.status_code} {r.text[:160]}")
        status, message = _error(r)
        assert status == 400 and expected in message
    # the gateway is fine afterwards
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"prompt": "hi"}
    )
    assert r.status_code == 200, r.text
