"""The request limits and defaults that more than one schema shares, each named once here.

The public inputs (`schemas.workers_ai`, `schemas.openai`), the internal protocol
(`schemas.backend`) and the catalog (`schemas.catalog`) import them, so that a bound or a
default changes in one place; msgspec validates them at the edge.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

MaxTokens = Annotated[int, Meta(ge=1, le=1_048_576)]  # tokens generated per choice
DEFAULT_MAX_TOKENS = 256  # the legacy input's, the catalog's and the backend's default
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # frequency and presence penalties
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
