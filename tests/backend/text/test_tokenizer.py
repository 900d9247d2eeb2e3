"""Tokenizers load from both on-disk formats, keep special tokens whole, and agree with references."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import tiktoken.load
from transformers import PreTrainedTokenizerFast

from backend.errors import CheckpointError
from backend.text.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
from backend.text.tokenizer_files import GLM_SPECIAL_TOKENS, KIMI_SPECIAL_TOKENS, byte_decoder
from tests.backend.server_tokenizers import load, tokenizer_dir

MODELS = Path(__file__).resolve().parents[3] / "models"

TEXTS = [
    "Hello, world! It's 2026 and we're testing.",
    "你好，世界。今天天气很好。",
    "Emoji 🙂🚀 and accents café naïve — µ ß",
    '{"city": "Paris", "days": [1, 2, 3]}\n\n    def f(x):\n        return x',
]


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "kimi-json", "glm"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tmp_path_factory: pytest.TempPathFactory, layout: str, text: str) -> None:
    tok = load(tmp_path_factory, layout)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & tok.special_ids


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "kimi-json", "glm"])
def test_special_tokens_are_single_ids(tmp_path_factory: pytest.TempPathFactory, layout: str) -> None:
    tok = load(tmp_path_factory, layout)
    specials = KIMI_SPECIAL_TOKENS if layout.startswith("kimi") else GLM_SPECIAL_TOKENS
    for spelling in specials:
        token_id = tok.token_to_id(spelling)
        assert token_id is not None and token_id in tok.special_ids
        assert token_id in tok.encode(f"a {spelling} b")
        plain = tok.encode(spelling, allow_special=False)
        assert token_id not in plain and tok.decode(plain) == spelling
    # specials sit after the BPE vocabulary, as in the published checkpoints
    assert min(tok.special_ids) >= tok.vocab_size - len(specials) - 1


@pytest.mark.parametrize("text", TEXTS)
def test_json_layout_matches_transformers(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    folder = tokenizer_dir(tmp_path_factory, "glm")
    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ours = load_tokenizer(folder)
    spelled = text + "<|user|><think>x</think>"
    assert ours.encode(spelled) == reference.encode(spelled, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_tiktoken_layout_splits_like_the_bpe_it_came_from(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    """The tiktoken file holds the same merges as the tokenizer.json BPE, under Kimi's split pattern
    in both: the token byte strings must be identical."""
    tik = load(tmp_path_factory, "kimi-tiktoken")
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir(tmp_path_factory, "kimi-json") / "tokenizer.json")
    )
    byte_of = byte_decoder()
    assert isinstance(tik, TiktokenTokenizer)
    tik_pieces = [tik._enc.decode_single_token_bytes(i) for i in tik.encode(text)]
    hf_pieces = [
        bytes(byte_of[c] for c in t)
        for t in hf.convert_ids_to_tokens(hf.encode(text, add_special_tokens=False))
    ]
    assert tik_pieces == hf_pieces
    kimi_json = load(tmp_path_factory, "kimi-json")
    assert [kimi_json.token_bytes(i) for i in kimi_json.encode(text)] == tik_pieces


def split_characters(tok: Tokenizer) -> str:
    """The characters among a few candidates that `tok` splits over tokens: each of those tokens
    decodes alone to U+FFFD."""
    found = "".join(c for c in "🙂🚀你好€Ωéß" if any("\ufffd" in tok.decode([i]) for i in tok.encode(c)))
    assert found, "the candidates are all whole tokens: pick others"
    return found


@pytest.mark.parametrize(
    ("model", "kind"), [("glm-5.2-nano", HFTokenizer), ("kimi-k2.6-nano", TiktokenTokenizer)]
)
def test_token_bytes_join_into_characters_split_over_tokens(model: str, kind: type[Tokenizer]) -> None:
    """A token's bytes are its own (not those of U+FFFD, its text alone): joined over the tokens of a
    text they give the text's UTF-8, as OpenAI's logprob `bytes` do."""
    tok = load_tokenizer(MODELS / model)
    assert isinstance(tok, kind)
    text = f"Emoji {split_characters(tok)} and text"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    for spelling in tok.special_spellings:  # special tokens: their spelling
        token_id = tok.token_to_id(spelling)
        assert token_id is not None and tok.token_bytes(token_id) == spelling.encode()
    assert tok.token_bytes(tok.vocab_size + 3) == b""  # a padded embedding row: no text, no bytes


def test_tiktoken_without_declared_pattern_uses_kimis(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Published Kimi configs declare specials but keep the pattern in code: the loader must still load
    them, with Kimi's pattern, and reserve the undeclared ids."""
    src = tokenizer_dir(tmp_path_factory, "kimi-tiktoken")
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["pat_str"]
    config["num_reserved_special_tokens"] = 32
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tiktoken.model").write_bytes((src / "tiktoken.model").read_bytes())
    tok = load_tokenizer(tmp_path)
    base = len(tiktoken.load.load_tiktoken_bpe(str(src / "tiktoken.model")))
    assert tok.vocab_size == base + 32
    assert tok.token_to_id("<|im_end|>") == load(tmp_path_factory, "kimi-tiktoken").token_to_id("<|im_end|>")
    assert tok.token_to_id("<|reserved_token_31|>") == base + 31
    for text in TEXTS:
        assert tok.encode(text) == load(tmp_path_factory, "kimi-tiktoken").encode(text)


def test_missing_tokenizer_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        load_tokenizer(tmp_path)


def test_llguidance_view_agrees(tmp_path_factory: pytest.TempPathFactory) -> None:
    for layout in ("kimi-tiktoken", "glm"):
        tok = load(tmp_path_factory, layout)
        ll = tok.ll_tokenizer(tok.vocab_size + 7, [max(tok.special_ids)])
        assert ll.vocab_size == tok.vocab_size + 7
        ids = tok.encode(TEXTS[2])
        assert ll.decode_str(ids) == TEXTS[2]


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "kimi-json", "glm"])
def test_encoding_a_long_prompt_lets_the_event_loop_run(
    tmp_path_factory: pytest.TempPathFactory, layout: str
) -> None:
    """`tokenizers`' `encode` holds the GIL: a 9 MB prompt encoded in the backend's worker thread
    stopped its event loop, health checks included, and the gateway ejected the replica. While a
    long text is encoded, another thread keeps running (with the GIL held it ran once)."""
    tok = load(tmp_path_factory, layout)
    text = "word, " * 300_000 + "<|user|>" * 20_000
    for allow_special in (True, False):
        done = threading.Event()

        def encode(special: bool = allow_special, finished: threading.Event = done) -> None:
            tok.encode(text, allow_special=special)
            finished.set()

        worker = threading.Thread(target=encode)
        worker.start()
        ticks = 0
        while not done.is_set():
            time.sleep(0.001)
            ticks += 1
        worker.join()
        assert ticks >= 10


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "kimi-json", "glm"])
def test_many_texts_encode_as_each_alone_and_spellings_as_plain_text(
    tmp_path_factory: pytest.TempPathFactory, layout: str
) -> None:
    """A rendered prompt's pieces in one call, each as `encode` gives it alone; a client-typed
    special-token spelling as plain text, never its special id (kept once computed)."""
    tok = load(tmp_path_factory, layout)
    spelling = "<|im_end|>" if layout.startswith("kimi") else "<|user|>"
    texts = ["<|im_start|>system: hi", "", f"say {spelling}{spelling} now", spelling, TEXTS[1]]
    assert tok.encode_many(texts) == [tok.encode(t) for t in texts]
    plain = tok.plain_ids(spelling)
    assert plain == tok.encode(spelling, allow_special=False) and tok.decode(plain) == spelling
    assert tok.token_to_id(spelling) not in plain and tok.plain_ids(spelling) is plain
