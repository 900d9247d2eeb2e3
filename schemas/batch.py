"""Workers AI async batch (`?queueRequest=true`), reference §1.6: submit, poll, and the results.

Policy: the inputs and outputs follow `schemas.workers_ai` (`WireIn` rejects unknown fields,
`WireOut` emits every field but `UNSET` ones). Each queued request is the model's own input plus
an optional `external_reference`, validated with the model's decoder at submit time.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.workers_ai import ErrorItem, WireIn, WireOut

MAX_BATCH_REQUESTS = 10_000  # and the body stays under the 10 MB body limit
ExternalReference = Annotated[str, Meta(max_length=1024)]
BatchRequestId = Annotated[str, Meta(min_length=1, max_length=64)]


class BatchSubmit(WireIn, kw_only=True):
    """`POST …/ai/run/{model}?queueRequest=true`: each item is the model's input (an object)."""

    requests: Annotated[list[msgspec.Raw], Meta(min_length=1, max_length=MAX_BATCH_REQUESTS)]


class BatchPoll(WireIn, kw_only=True):
    """`POST …/ai/run/{model}` with only `request_id`: the job's state or its results."""

    request_id: BatchRequestId


class BatchStatus(WireOut, kw_only=True):
    """A job not finished yet (and the answer to a submit)."""

    status: Literal["queued", "running"]
    request_id: str
    model: str


class BatchItem(WireOut, kw_only=True):
    """One request's outcome: `result` as `/ai/run` would answer it, or `errors`."""

    id: int
    result: Any
    success: bool
    external_reference: ExternalReference | None = None
    errors: list[ErrorItem] | UnsetType = UNSET


class BatchUsage(WireOut, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class BatchDone(WireOut, kw_only=True):
    responses: list[BatchItem]
    usage: BatchUsage
