"""Writes a model family's tokenizer and chat template into a checkpoint folder.

No real tokenizer can be downloaded here, so tiny checkpoints carry a byte-level BPE trained with the
`tokenizers` library on a small built-in corpus. What matters for serving is kept real: the family's
special tokens (as single ids, after the BPE vocabulary, as in the published checkpoints), its
pre-tokenizer split pattern, where it keeps its template, and templates that follow the published
Kimi K2.5 and GLM-4.5 / GLM-5 formats (`engine-anchors.md` §1i).

Kimi ships `tiktoken.model` + `tokenizer_config.json`; `fmt="tiktoken"` writes exactly that layout so
the tiktoken loading path is exercised. GLM ships `tokenizer.json`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATES = Path(__file__).parent / "chat_templates"

Family = Literal["kimi", "glm"]
TokenizerFormat = Literal["tokenizer.json", "tiktoken"]

# The split pattern Kimi's `tokenization_kimi.py` declares (Han runs, cased words, 1-3 digits, …).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# GLM-4.5's tokenizer.json pre-tokenizer split (the GPT-4 style pattern).
GLM_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

KIMI_SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<think>",
    "</think>",
]
GLM_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]
# GLM keeps `/nothink` as an added but non-special token: it is typed by users and rendered as text.
GLM_PLAIN_ADDED_TOKENS = ["/nothink"]

CORPUS = """\
The quick brown fox jumps over the lazy dog. A user asks a question and the assistant answers it.
What is the weather like in Paris today? It is sunny with a light breeze and 21 degrees Celsius.
Please call the get_weather function with the city name and the unit of temperature.
{"city": "Paris", "unit": "celsius", "days": 3, "hourly": true, "tags": ["a", "b"], "limit": null}
{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
def add(a: int, b: int) -> int:
    return a + b

for i in range(10):
    print(i * 2, "hello world")
Let me think step by step. First, we note that 12 * 7 = 84. Then 84 + 16 = 100. So the answer is 100.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 -17 1e-5 2026
Punctuation and symbols: ( ) [ ] { } < > / \\ | : ; , . ! ? ' " ` ~ @ # $ % ^ & * - + = _
你好，世界。今天天气很好。我们一起学习机器学习和自然语言处理。
こんにちは世界。Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. 안녕하세요 세계
Emoji: 🙂 🚀 🌧️ ☀️ 🎉 👍🏽 — café naïve résumé façade coöperate Ωmega µ ß
The tenant sends a request, the gateway routes it to a backend, and the backend streams tokens back.
"""


def _bpe_tokenizer(pat_str: str, vocab_size: int, corpus: Iterable[str] | None = None) -> Tokenizer:
    """A byte-level BPE (no special tokens yet) trained on `corpus` (default: `CORPUS`), split by
    `pat_str` first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS] * 4 if corpus is None else corpus, trainer=trainer)
    return tok


def byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes→unicode table, used by byte-level BPE vocabularies."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _mergeable_ranks(tok: Tokenizer) -> dict[bytes, int]:
    """tiktoken ranks from a trained byte-level BPE: the 256 bytes, then each merge in training order."""
    decoder = byte_decoder()
    vocab = tok.get_vocab(with_added_tokens=False)
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        raw = bytes(decoder[ch] for ch in token)
        if raw not in ranks:
            ranks[raw] = len(ranks)
    return ranks


def _special_config(
    specials: list[str], plain: list[str], first_id: int, **extra: object
) -> dict[str, object]:
    decoder = {
        str(first_id + i): {
            "content": t,
            "special": t not in plain,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for i, t in enumerate(specials + plain)
    }
    return {"added_tokens_decoder": decoder, **extra}


def write_tokenizer_files(
    family: Family,
    path: str | Path,
    *,
    fmt: TokenizerFormat = "tokenizer.json",
    glm_generation: Literal["4.5", "5"] = "5",
    vocab_size: int = 1024,
    corpus: Iterable[str] | None = None,
    max_digits: int = 3,
) -> int:
    """Write the family's tokenizer, tokenizer config and chat template into `path`. The BPE is
    trained on `corpus` (texts without special tokens), else on the small built-in `CORPUS`.
    `max_digits` is the longest run of digits one token may hold: 3 in both families' published
    patterns; 1 splits numbers into single digits (the small trained models: arithmetic then works
    digit by digit over ten well-trained ids, not over a thousand rare ones).

    Returns the number of token ids the tokenizer uses (the model's vocab must be at least that).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    pat_str = KIMI_PAT_STR if family == "kimi" else GLM_PAT_STR
    if max_digits != 3:
        pat_str = pat_str.replace(
            r"\p{N}{1,3}", r"\p{N}" if max_digits == 1 else rf"\p{{N}}{{1,{max_digits}}}"
        )
    bpe = _bpe_tokenizer(pat_str, vocab_size, corpus)
    specials = KIMI_SPECIAL_TOKENS if family == "kimi" else GLM_SPECIAL_TOKENS
    plain = [] if family == "kimi" else GLM_PLAIN_ADDED_TOKENS
    if family == "kimi":
        names = {"bos_token": "[BOS]", "eos_token": "<|im_end|>", "pad_token": "[EOS]", "unk_token": "[EOS]"}
        template = (TEMPLATES / "kimi_k25.jinja").read_text()
    else:
        names = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
        template = (TEMPLATES / ("glm5.jinja" if glm_generation == "5" else "glm45.jinja")).read_text()

    if fmt == "tiktoken":
        if family != "kimi":
            raise ValueError("the tiktoken layout is Kimi's; GLM ships tokenizer.json")
        ranks = _mergeable_ranks(bpe)
        lines = [
            f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
        ]
        (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
        first_id = len(ranks)
        config = _special_config(
            specials,
            plain,
            first_id,
            pat_str=pat_str,
            tokenizer_class="TikTokenTokenizer",
            model_max_length=262144,
            chat_template=template,
            **names,
        )
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        return first_id + len(specials)

    first_id = bpe.get_vocab_size(with_added_tokens=True)
    bpe.add_special_tokens(specials)
    bpe.add_tokens(plain)
    bpe.save(str(out / "tokenizer.json"))
    config = _special_config(
        specials, plain, first_id, tokenizer_class="PreTrainedTokenizerFast", model_max_length=202752, **names
    )
    if family == "kimi":
        config["chat_template"] = template
    else:
        # current transformers saves the template beside the config; keep both layouts exercised
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return bpe.get_vocab_size(with_added_tokens=True)
