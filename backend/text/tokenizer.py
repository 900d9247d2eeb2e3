"""The checkpoint's tokenizer, loaded without running any code the checkpoint ships.

Two on-disk formats are served:
- `tokenizer.json` (GLM, most checkpoints) through the `tokenizers` library;
- Kimi's `tiktoken.model` (base64 token + rank per line) through the `tiktoken` library, with the
  special tokens declared in `tokenizer_config.json` (`added_tokens_decoder`; the ids after the BPE
  ranks that it leaves undeclared are reserved) and the split pattern it declares (`pat_str`), or, as
  in the published Kimi checkpoints whose pattern lives in `tokenization_kimi.py`, Kimi's pattern.

Both expose the same small surface the serving layer needs, plus an `llguidance.LLTokenizer` for
constrained decoding.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tiktoken
import tiktoken.load
import tokenizers

from backend.errors import CheckpointError
from backend.text.tokenizer_files import KIMI_PAT_STR, byte_decoder

# llguidance is imported when constrained decoding first needs it (the training recipe runs without it)
if TYPE_CHECKING:
    import llguidance


class Tokenizer(ABC):
    """Token ids ↔ text for one checkpoint. `special_ids` are ids never produced from plain text."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config  # tokenizer_config.json as written by the checkpoint
        self._ll_cache: dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer] = {}
        self._plain: dict[str, list[int]] = {}  # `plain_ids`

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids in use (the model's embedding may be larger)."""

    @abstractmethod
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token spellings in it map to their ids iff `allow_special`."""

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, special tokens allowed: the pieces of a rendered prompt."""
        return [self.encode(text) for text in texts]

    def plain_ids(self, spelling: str) -> list[int]:
        """A special token's spelling as plain text (`encode(spelling, allow_special=False)`), kept
        once computed: a prompt may quote the same few spellings hundreds of thousands of times."""
        found = self._plain.get(spelling)
        if found is None:
            found = self._plain[spelling] = self.encode(spelling, allow_special=False)
        return found

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes an ordinary (not special) token stands for: a text of C characters is at
        least C / max_token_bytes tokens, whatever its tokenization (each character one byte or more)."""
        specials = self.special_ids
        return max((len(self.token_bytes(i)) for i in range(self.vocab_size) if i not in specials), default=1)

    @abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens spelled out; incomplete UTF-8 becomes U+FFFD. Ids past
        the tokenizer (a model's padded embedding rows) have no text."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for, even where they are only part of a character (what
        `decode([token_id])` turns into U+FFFD); a special token's are its spelling's. An id past the
        tokenizer has none."""

    @abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of a whole token (special or not), or None."""

    @property
    @abstractmethod
    def special_ids(self) -> frozenset[int]: ...

    @property
    @abstractmethod
    def special_spellings(self) -> tuple[str, ...]:
        """Every text that `encode` turns into one special or added token when specials are allowed."""

    @abstractmethod
    def _build_ll_tokenizer(self, n_vocab: int, eos_ids: list[int]) -> llguidance.LLTokenizer: ...

    def ll_tokenizer(self, n_vocab: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
        """The llguidance view of this tokenizer (built once per (n_vocab, eos) — it costs ~1 s)."""
        key = (n_vocab, tuple(eos_ids))
        if key not in self._ll_cache:
            self._ll_cache[key] = self._build_ll_tokenizer(n_vocab, eos_ids)
        return self._ll_cache[key]

    def named_id(self, key: str) -> int | None:
        """The id of a token named in tokenizer_config.json (`bos_token`, `eos_token`, …)."""
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return self.token_to_id(value) if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """`tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        # tokens declared only in tokenizer_config.json (older checkpoints) are added as transformers does
        declared = config.get("added_tokens_decoder", {})
        missing = [
            tokenizers.AddedToken(v["content"], special=v.get("special", True), normalized=False)
            for k, v in sorted(declared.items(), key=lambda kv: int(kv[0]))
            if self._tok.token_to_id(v["content"]) is None
        ]
        if missing:
            self._tok.add_special_tokens(missing)
        # a byte-level BPE spells each byte of a token as one character of GPT-2's byte alphabet
        self._byte_of = byte_decoder() if _is_byte_level(self._tok.decoder) else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        # spelled as plain text, the pieces between special-token spellings are encoded apart
        pieces = [text] if allow_special else _split_keep(text, self._spellings_longest_first)
        return [i for ids in self.encode_many(pieces) for i in ids]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """One `encode_batch_fast` call: `tokenizers` holds the GIL through `encode` (a 9 MB prompt
        stopped the backend's event loop, its health checks with it, for 10 s) and releases it
        through `encode_batch`."""
        filled = [t for t in texts if t]
        encoded = iter(self._tok.encode_batch_fast(filled, add_special_tokens=False) if filled else ())
        return [list(next(encoded).ids) if t else [] for t in texts]

    @cached_property
    def max_token_bytes(self) -> int:
        """As the base class says, times 4 where a normalizer runs first: one that composes
        characters (NFC: a letter and two marks become one) shortens the text the tokens cover; and
        one more where tokens are not byte-level (a Metaspace decoder drops a token's leading `▁`)."""
        longest = super().max_token_bytes + (0 if self._byte_of is not None else 1)
        return longest * (1 if self._tok.normalizer is None else 4)

    @cached_property
    def _spellings_longest_first(self) -> list[str]:
        return sorted({s for s in self.special_spellings if len(s) >= 2}, key=len, reverse=True)

    def decode(self, token_ids: list[int]) -> str:
        known = [i for i in token_ids if 0 <= i < self.vocab_size]
        return str(self._tok.decode(known, skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        added = self._added_spellings.get(token_id)
        if added is not None:  # added tokens are stored as their text, not in the byte alphabet
            return added.encode()
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_of is not None and all(ch in self._byte_of for ch in piece):
            return bytes(self._byte_of[ch] for ch in piece)
        return self.decode([token_id]).encode()  # not byte-level: the token's text is all there is

    def token_to_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def special_spellings(self) -> tuple[str, ...]:
        # the library matches every added token in text, special-flagged or not
        return tuple(self._added_spellings.values())

    @cached_property
    def _added_spellings(self) -> dict[int, str]:
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}

    def _build_ll_tokenizer(self, n_vocab: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
        import llguidance

        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        tok.no_padding()
        tok.no_truncation()
        return llguidance.LLTokenizer(tok.to_str(), n_vocab=n_vocab, eos_token=eos_ids)


class TiktokenTokenizer(Tokenizer):
    """Kimi's `tiktoken.model` + the specials and split pattern of its tokenizer config."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        super().__init__(config)
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
        num_base = len(ranks)
        declared = {int(k): v["content"] for k, v in config.get("added_tokens_decoder", {}).items()}
        if any(i < num_base for i in declared):
            raise CheckpointError(f"{path}: a declared special token id collides with a BPE rank")
        num_special = int(config.get("num_reserved_special_tokens", 0)) or (
            max(declared, default=num_base - 1) + 1 - num_base
        )
        specials = {
            declared.get(num_base + i, f"<|reserved_token_{i}|>"): num_base + i for i in range(num_special)
        }
        self._enc = tiktoken.Encoding(
            name=path.parent.name or "kimi",
            pat_str=config.get("pat_str", KIMI_PAT_STR),
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._specials = specials

    @property
    def vocab_size(self) -> int:
        return int(self._enc.n_vocab)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, token_ids: list[int]) -> str:
        known = [i for i in token_ids if 0 <= i < self.vocab_size]
        return self._enc.decode(known, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        try:
            return self._enc.decode_single_token_bytes(token_id)  # a special token's: its spelling's
        except KeyError:
            return b""

    def token_to_id(self, token: str) -> int | None:
        if token in self._specials:
            return self._specials[token]
        try:
            return int(self._enc.encode_single_token(token.encode()))
        except KeyError:
            return None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._specials.values())

    @cached_property
    def special_spellings(self) -> tuple[str, ...]:
        return tuple(self._specials)

    def _build_ll_tokenizer(self, n_vocab: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(self._enc, n_vocab=n_vocab, eos_token=eos_ids)


def _is_byte_level(decoder: tokenizers.decoders.Decoder | None) -> bool:
    """Whether the decoder maps GPT-2's byte alphabet back to bytes (alone or inside a sequence)."""
    if decoder is None:
        return False
    state = json.loads(decoder.__getstate__())
    return "ByteLevel" in {state.get("type"), *(d.get("type") for d in state.get("decoders", []))}


def _split_keep(text: str, spellings: list[str]) -> list[str]:
    """Split `text` at every occurrence of any spelling (longest first, as given), keeping each
    spelling as its own piece split in two so the tokenizer cannot match it whole."""
    pieces = [text]
    for s in spellings:
        nxt: list[str] = []
        for p in pieces:
            parts = p.split(s)
            for i, part in enumerate(parts):
                if i:
                    nxt.extend([s[: len(s) // 2], s[len(s) // 2 :]])
                nxt.append(part)
        pieces = nxt
    return pieces


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return config


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder: `tokenizer.json` if present, else Kimi's `tiktoken.model`."""
    folder = Path(model_dir)
    config = read_tokenizer_config(folder)
    if (folder / "tokenizer.json").exists():
        return HFTokenizer(folder / "tokenizer.json", config)
    if (folder / "tiktoken.model").exists():
        return TiktokenTokenizer(folder / "tiktoken.model", config)
    raise CheckpointError(f"{folder}: no tokenizer.json or tiktoken.model")
