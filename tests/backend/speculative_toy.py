"""A Markov toy with an MTP head, for the speculative-decoding tests that need a known distribution.

The target's next-token logits depend only on the current token: `target[x]` (`[V]`). The MTP head,
given the token after a position, proposes the one after that from `draft[x]`; with `draft` equal
to `target` its greedy drafts are exactly the target's greedy tokens, so every draft is accepted.
It keeps no KV (its cache slots exist, one for the model and one for the MTP layer, but nothing
reads them), so the exact distribution of any output is a product of `softmax(target[x])` rows.
Shape letters: T tokens, N logits rows, V vocabulary.
"""

from __future__ import annotations

import torch

from backend.engine.forward_batch import CacheSpec, ForwardBatch


class MarkovModel(torch.nn.Module):
    def __init__(self, target: torch.Tensor, draft: torch.Tensor) -> None:
        super().__init__()
        self.target, self.draft = target.float(), draft.float()  # [V, V] logits of the next token
        self.vocab_size = target.shape[0]
        self.num_mtp_layers = 1

    def cache_specs(self) -> list[list[CacheSpec]]:
        return [[CacheSpec("k", (1,))], [CacheSpec("k", (1,))]]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.target[batch.input_ids[batch.logits_indices]]  # [N, V]

    def forward_spec(self, batch: ForwardBatch, step: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.nn.functional.one_hot(batch.input_ids, self.vocab_size).float()  # [T, V]
        return self.forward(batch), hidden

    def forward_mtp(
        self, batch: ForwardBatch, hidden: torch.Tensor, depth: int, step: object = None, **_: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft[batch.input_ids[batch.logits_indices]], hidden

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No rotary: zero-width cos, sin `[T, 0]` (the whole steps slice them per draft depth)."""
        empty = positions.new_zeros(positions.shape[0], 0, dtype=torch.float32)
        return empty, empty

    def build_step(self, batch: ForwardBatch, cos_sin: object = None, expected_tags: object = None) -> None:
        """No layers read a step's facts."""
        return None
