"""Splits generated tokens into reasoning and answer (DESIGN.md §2 step 7).

Both families reason inside `<think>…</think>`, and both tokenizers hold those markers as single
token ids, so the split is made on ids: a marker can never arrive half-way through a streamed chunk,
and a literal "<think>" typed in the answer (ordinary tokens) is not mistaken for one.

Templates differ in who opens the block: Kimi K2.5 and GLM-5 end the generation prompt with `<think>`
(the model starts inside it), GLM-4.5 lets the model write `<think>` itself. The parser therefore
starts from the prompt: inside reasoning iff the prompt's last marker is an opening one.

With reasoning switched off no reasoning is produced: whatever the model still writes inside the
markers is dropped, never shown as answer text.

When tools are offered, the family's call-opening marker ends an open block and goes to the answer
(`call_start_id`): Kimi K2 Thinking and GLM-5 call tools from inside their reasoning, and read as
reasoning the call was shown as markup in `reasoning_content` and never parsed (or, with reasoning
off, dropped), the turn ending "stop". The engine's reasoning guard reads the marker the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from backend.text.tokenizer import Tokenizer

Channel = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    start_id: int
    end_id: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ThinkMarkers | None:
        """The tokenizer's `<think>` / `</think>` ids, or None when it has no reasoning markers."""
        start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
        return None if start is None or end is None else cls(start, end)

    def is_open_after(self, token_ids: list[int]) -> bool:
        """True iff the last marker in `token_ids` opens a reasoning block."""
        for token_id in reversed(token_ids):
            if token_id == self.start_id:
                return True
            if token_id == self.end_id:
                return False
        return False


class ReasoningParser:
    """Routes each generated id to the reasoning or the content channel; markers themselves go to
    neither."""

    def __init__(
        self,
        markers: ThinkMarkers,
        *,
        prompt_token_ids: list[int],
        enabled: bool,
        call_start_id: int | None = None,
    ) -> None:
        """`call_start_id`: the tool-call opening marker, when tools are offered (module docstring)."""
        self._markers = markers
        self._enabled = enabled
        self._call_start_id = call_start_id
        self._in_reasoning = markers.is_open_after(prompt_token_ids)
        self.num_reasoning_tokens = 0  # ids inside the block (shown or not), for usage
        # per id of the last `split`: its channel, None for a marker (or reasoning left out)
        self.channels: list[Channel | None] = []

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def split(self, token_ids: list[int]) -> list[tuple[Channel, list[int]]]:
        """Consecutive runs of ids by channel, in order. Reasoning runs are left out when disabled."""
        runs: list[tuple[Channel, list[int]]] = []
        channels = self.channels = []
        for token_id in token_ids:
            if token_id == self._markers.start_id:
                self._in_reasoning = True
                channels.append(None)
                continue
            if token_id == self._markers.end_id:
                self._in_reasoning = False
                channels.append(None)
                continue
            if token_id == self._call_start_id:  # a call ends the block; the marker is the call's
                self._in_reasoning = False
            channel: Channel = "reasoning" if self._in_reasoning else "content"
            self.num_reasoning_tokens += channel == "reasoning"
            if channel == "reasoning" and not self._enabled:
                channels.append(None)
                continue
            channels.append(channel)
            if runs and runs[-1][0] == channel:
                runs[-1][1].append(token_id)
            else:
                runs.append((channel, [token_id]))
        return runs
