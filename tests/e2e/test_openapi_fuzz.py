"""Schemathesis against the live embedded gateway (`kumo serve`, real CPU backends), with every
check on: no 5xx, status codes, content types, headers and bodies as documented in `/openapi.json`,
schema-violating requests rejected, schema-valid ones accepted (`positive_data_acceptance`), and
credentials enforced (`ignored_auth`). Bounded: a fixed number of examples per operation and
mode, derandomized (the same cases on every run), and every generation cut at 1.5 s by the
per-request wall-clock limit (`cf-aig-request-timeout`), which answers a documented 408/3046.

The tokens are schemathesis' own auth (`[auth.openapi.<scheme>]`), so `ignored_auth` knows they
are real and re-sends each accepted request without them and with a wrong one. A schema-valid
request may still get a 4xx only where the operation documents that status: a `400` response
names what JSON Schema cannot state (a context window, `since` after `until`, an expiry in the
past), generations document the 408 of the wall-clock limit; that operation's
`positive_data_acceptance` then allows it, read from the document, not listed here.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.generation.case import Case
from schemathesis.schemas import APIOperation

from tests.e2e.serve_process import Kumo

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 12
HEX32 = re.compile(r"^[0-9a-f]{32}$")
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis' default


def fuzz_config(kumo: Kumo, doc: dict[str, Any]) -> SchemathesisConfig:
    """The tokens as schemathesis auth; valid data may get a 4xx only where the operation documents
    that status (a 400 for what JSON Schema cannot state, the 408 of the wall-clock limit)."""
    assert kumo.admin_token is not None
    documented_4xx = [
        {
            "include-name": f"{method.upper()} {path}",
            "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, *statuses]}},
        }
        for path, operations in doc["paths"].items()
        for method, operation in operations.items()
        if (statuses := [s for s in operation["responses"] if s.startswith("4")])
    ]
    return SchemathesisConfig.from_dict(
        {
            "auth": {"openapi": {"tenant": {"bearer": kumo.token}, "admin": {"bearer": kumo.admin_token}}},
            "operations": documented_4xx,
        }
    )


def test_the_live_gateway_conforms_to_its_openapi_document(kumo: Kumo) -> None:
    doc = httpx.get(f"{kumo.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc, config=fuzz_config(kumo, doc))
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
        call(case, kumo)

    check()


def call(case: Case, kumo: Kumo) -> None:
    # a well-formed account id is the tenant's own, so cases get past authorization to the handler
    if HEX32.match(str((case.path_parameters or {}).get("account_id", ""))):
        case.path_parameters = {**(case.path_parameters or {}), "account_id": kumo.account}
    # sent with the call, not set on the case (which would count the case's headers as edited)
    case.call_and_validate(base_url=kumo.url, timeout=60, headers={"cf-aig-request-timeout": "1500"})
