"""The hook through which constrained decoding (JSON mode, forced tool calls) reaches the sampler.

The engine keeps one `TokenConstraint` per constrained request; the batched sampler asks each for the
allowed-token mask of the next step, so constrained and free requests share a batch.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TokenConstraint(Protocol):
    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """A `[vocab_size]` bool mask of tokens allowed next, or None when anything goes."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        ...

    def is_finished(self) -> bool:
        """True once the constrained output is complete; the request should then stop."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (preemption by recompute replays them)."""
        ...
