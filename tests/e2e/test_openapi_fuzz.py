# ruff: noqa: F811  (pytest fixtures imported by name)
"""Schemathesis against the live embedded gateway (`kumo serve`, real CPU backends), with its
checks on: no 5xx, status codes, content types, headers and bodies as documented in
`/openapi.json`, schema-violating requests rejected. Bounded: a fixed number of examples per
operation, derandomized (the same cases on every run), and every generation cut at 1.5 s by the
per-request wall-clock limit (`cf-aig-request-timeout`), which answers a documented 408/3046.

One check is off: `positive_data_acceptance` (a schema-valid request must get 2xx/401/403/404/409/
429). The 400s it reports are the API working as Workers AI does, for constraints JSON Schema
cannot state: an input valid for one model family but not the other, input + max tokens over the
model's context window, a token expiry in the past, `since` after `until`, and JSON integers
written as `1.0` (msgspec's integers are strict). `ignored_auth` is replaced by a direct probe
(`test_every_secured_operation_refuses_a_missing_or_wrong_token`): the fuzzer sends every case with
the real token so it reaches the handlers, which the check takes for generated credentials.
Every other check runs, negative data included.
"""

from __future__ import annotations

import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode
from schemathesis.generation.case import Case
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import ignored_auth, positive_data_acceptance

from tests.e2e.serve_process import Kumo

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 12
HEX32 = re.compile(r"^[0-9a-f]{32}$")


def test_the_live_gateway_conforms_to_its_openapi_document(kumo: Kumo) -> None:
    schema = schemathesis.openapi.from_url(f"{kumo.url}/openapi.json")
    failures: list[str] = []
    operations = [loaded.ok() for loaded in schema.get_all_operations()]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode, kumo)
            except Unsatisfiable:
                # nothing to make invalid: an operation without parameters or body
                assert (
                    mode is GenerationMode.NEGATIVE and not operation.path_parameters and not operation.query
                )
            except BaseException as exc:  # every operation is run; all failures are reported together
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                failures.append(f"{operation.label} ({mode.value}): {exc}")
    assert len(operations) >= 20
    assert not failures, "\n\n".join(failures)


def fuzz(operation: APIOperation, mode: GenerationMode, kumo: Kumo) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the report has the case
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Case) -> None:
        call(case, kumo, mode)

    check()


def call(case: Case, kumo: Kumo, mode: GenerationMode) -> None:
    # a well-formed account id is the tenant's own, so cases get past authorization to the handler
    if HEX32.match(str((case.path_parameters or {}).get("account_id", ""))):
        case.path_parameters = {**(case.path_parameters or {}), "account_id": kumo.account}
    token = kumo.admin_token if case.path.startswith("/admin/") else kumo.token
    headers = dict(case.headers or {})
    # a negative case may carry deliberately wrong credentials: those stay; every other case gets
    # the real token, on the case itself (not as call arguments) so `ignored_auth` can remove it
    if mode is GenerationMode.POSITIVE or not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {token}"
    case.headers = {**headers, "cf-aig-request-timeout": "1500"}
    case.call_and_validate(
        base_url=kumo.url, timeout=60, excluded_checks=[positive_data_acceptance, ignored_auth]
    )


def test_every_secured_operation_refuses_a_missing_or_wrong_token(kumo: Kumo) -> None:
    doc = httpx.get(f"{kumo.url}/openapi.json", timeout=30).json()
    values = {"account_id": kumo.account, "tenant_id": "0" * 32, "token_id": "0" * 32, "model": "@cf/x/y"}
    num_secured = 0
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            if not operation["security"]:
                continue
            num_secured += 1
            url = kumo.url + re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
            for headers in ({}, {"authorization": "Bearer kumo_" + "f" * 32 + "_wrong"}):
                r = httpx.request(method.upper(), url, headers=headers, json={}, timeout=30)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.json()["success"] is False
    assert num_secured >= 20
