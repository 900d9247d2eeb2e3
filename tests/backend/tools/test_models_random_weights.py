"""Random checkpoints written by our own code (for `kumo serve`'s first start) are real checkpoints:
transformers loads them with no missing or unexpected tensor and computes the same logits, our loader
loads them, and they keep the published architecture's choices at a small shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.models.checkpoint import iter_tensors
from backend.models.loader import load_model
from backend.models.model_config import ModelConfig
from backend.models.moonvit import MoonViT, VisionConfig
from backend.tools.random_checkpoint import KINDS, PUBLISHED_CONFIGS, main, write_random_checkpoint
from tests.backend.paged_driver import PagedDriver


@pytest.fixture(scope="module", params=KINDS)
def kind_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    kind = request.param
    return kind, write_random_checkpoint(kind, tmp_path_factory.mktemp("rw") / kind, dtype=torch.float32)


def _transformers_class(kind: str) -> type:
    import transformers as tf

    if kind == "kimi-k2.6":
        from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

        return Kimi_K25ForConditionalGeneration
    return tf.GlmMoeDsaForCausalLM if kind == "glm-5.2" else tf.Glm4MoeForCausalLM


def test_transformers_loads_every_tensor_and_agrees(kind_path: tuple[str, Path]) -> None:
    kind, path = kind_path
    ref, info = _transformers_class(kind).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    ours = load_model(path, dtype=torch.float32)
    tokens = list(range(10, 60))
    _, logits = PagedDriver(ours.model).prefill([tokens], 16)
    with torch.no_grad():
        expected = ref.eval()(input_ids=torch.tensor([tokens])).logits[0]
    assert float((logits[0] - expected).abs().max()) <= 1e-4


def test_published_choices_survive_the_shrink(kind_path: tuple[str, Path]) -> None:
    kind, path = kind_path
    published = ModelConfig.from_dict(json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text()))
    small = ModelConfig.from_pretrained(path)
    assert small.architecture == published.architecture and small.model_type == published.model_type
    assert (small.rope.rope_type, small.rope.theta, small.rope.factor) == (
        published.rope.rope_type,
        published.rope.theta,
        published.rope.factor,
    )
    assert small.routed_scaling_factor == published.routed_scaling_factor
    assert (small.use_qk_norm, small.attention_bias) == (published.use_qk_norm, published.attention_bias)
    assert small.hidden_size < published.hidden_size
    tokenizer_ids = json.loads((path / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert all(str(i) in tokenizer_ids for i in small.eos_token_ids)
    assert max(int(i) for i in tokenizer_ids) < small.vocab_size


def test_k26_vision_tower_loads(kind_path: tuple[str, Path]) -> None:
    kind, path = kind_path
    if kind != "kimi-k2.6":
        pytest.skip("only Kimi K2.6 has a vision tower")
    raw = json.loads((path / "config.json").read_text())
    tower = MoonViT(VisionConfig.from_config(raw, raw["text_config"]["hidden_size"]))
    tower.load_weights(iter_tensors(path))  # raises on any missing or unexpected vision tensor


def test_command_line_writes_a_bf16_checkpoint(tmp_path: Path) -> None:
    assert main(["glm-4.5", str(tmp_path / "g"), "--seed", "3"]) == 0
    loaded = load_model(tmp_path / "g", dtype=torch.bfloat16)
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
