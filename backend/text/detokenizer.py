"""Incremental detokenization: text deltas for a growing list of token ids.

A byte-level BPE token can end in the middle of a multi-byte character (an emoji is often three
tokens). Decoding each token alone would emit U+FFFD garbage, and re-decoding the whole sequence each
step costs O(n²). This keeps a short window instead (the method of text-generation-inference and
vLLM): decode `ids[prefix:read]` and `ids[prefix:]`; the new text is the difference, held back while
it ends in an incomplete character. The window restarts at each emitted boundary, so decoding works
on a few tokens at a time whatever the output length.
"""

from __future__ import annotations

from backend.text.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Turns token ids pushed one batch at a time into text that never splits a character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this have been emitted as text

    def push(self, token_ids: list[int]) -> str:
        """Append ids; return the text they complete (may be empty while a character is unfinished)."""
        self._ids.extend(token_ids)
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (at the end of the output an unfinished character is U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]

    @property
    def pending(self) -> bool:
        """True while some pushed ids have not been emitted as text."""
        return self._read < len(self._ids)
