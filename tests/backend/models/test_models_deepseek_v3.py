"""DeepSeek-V3 / Kimi K2 (MLA + noaux_tc MoE) on the paged cache vs transformers, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.forward_batch import ImageEmbeds
from backend.models.loader import load_model
from tests.backend.conformance import MAX_ABS_DIFF, greedy_matches, prefill_max_diff, prompts
from tests.backend.paged_driver import PagedDriver, Seq
from tests.backend.tiny_checkpoints import load_reference, make_tiny


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("ds") / "ckpt")


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("kimi_k2", tmp_path_factory.mktemp("kimi") / "ckpt")


@pytest.mark.parametrize("chunk", [16, 7])
def test_deepseek_v3_prefill_logits_match_transformers(ds_path: Path, chunk: int) -> None:
    diff = prefill_max_diff("deepseek_v3", ds_path, chunk=chunk)
    print(f"deepseek_v3 chunk={chunk} max abs diff {diff:.2e}")
    assert diff <= MAX_ABS_DIFF


def test_deepseek_v3_greedy_32_steps_match_transformers(ds_path: Path) -> None:
    ours, theirs = greedy_matches("deepseek_v3", ds_path)
    assert ours == theirs


def test_kimi_k2_published_config_matches_transformers(kimi_path: Path) -> None:
    diff = prefill_max_diff("kimi_k2", kimi_path, chunk=10)
    print(f"kimi_k2 max abs diff {diff:.2e}")
    assert diff <= MAX_ABS_DIFF
    ours, theirs = greedy_matches("kimi_k2", kimi_path)
    assert ours == theirs


def test_mla_cache_is_one_latent_line_per_token(ds_path: Path) -> None:
    loaded = load_model(ds_path, dtype=torch.float32)
    c = loaded.config
    specs = loaded.model.cache_specs()
    assert len(specs) == c.num_hidden_layers
    assert all(
        [(s.name, s.shape) for s in layer] == [("latent", (c.kv_lora_rank + c.qk_rope_head_dim,))]
        for layer in specs
    )


def test_quantized_kv_cache_stays_close_to_fp32(tmp_path: Path) -> None:
    # dense layers only: MoE routing flips would amplify any perturbation and hide the cache's own error
    path = make_tiny("deepseek_v3", tmp_path / "dense", first_k_dense_replace=3)
    loaded = load_model(path, dtype=torch.float32)
    ps = prompts(loaded.config.vocab_size, (17, 33))
    calib = PagedDriver(loaded.model)
    _, exact = calib.prefill(ps, 16)
    # per-layer scales calibrated on the fp32 run (amax / e4m3 max), as the quantize command will
    scales = [{"latent": float(layer["latent"].abs().max()) / 448.0} for layer in calib.kv.layers]
    _, fp8 = PagedDriver(loaded.model, kv_dtype=torch.float8_e4m3fn, scales=scales).prefill(ps, 16)
    _, bf16 = PagedDriver(loaded.model, kv_dtype=torch.bfloat16).prefill(ps, 16)
    for a, q8, q16 in zip(exact, fp8, bf16, strict=True):
        assert not torch.equal(a, q8)  # the cache really was quantized
        assert float((a - q8).norm() / a.norm()) < 0.1
        assert float((a - q16).norm() / a.norm()) < 0.01
        assert float((a.argmax(-1) == q8.argmax(-1)).float().mean()) >= 0.9


def test_image_embeds_replace_their_rows(ds_path: Path) -> None:
    loaded = load_model(ds_path, dtype=torch.float32)
    ref = load_reference("deepseek_v3", ds_path)
    tokens = prompts(loaded.config.vocab_size, (20,))[0]
    driver = PagedDriver(loaded.model)
    batch = driver.batch([Seq(tokens=tokens)], [len(tokens)])
    rows = torch.tensor([4, 5, 6, 7])
    embeds = torch.randn(len(rows), loaded.config.hidden_size)
    batch.image_embeds = ImageEmbeds(token_indices=rows, embeds=embeds)
    ours = loaded.model(batch)
    with torch.no_grad():
        inputs = ref.model.embed_tokens(torch.tensor([tokens]))
        inputs[0, rows] = embeds
        theirs = ref(inputs_embeds=inputs).logits[0]
    assert float((ours - theirs).abs().max()) <= MAX_ABS_DIFF


def test_bfloat16_model_tracks_float32(ds_path: Path, tmp_path: Path) -> None:
    assert (
        load_model(ds_path, dtype=torch.bfloat16).model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    )
    # dense layers only: MoE routing flips would amplify any perturbation (see the KV cache test)
    path = make_tiny("deepseek_v3", tmp_path / "dense", first_k_dense_replace=3)
    ps = prompts(256, (33,))
    _, exact = PagedDriver(load_model(path, dtype=torch.float32).model).prefill(ps, 16)
    _, approx = PagedDriver(load_model(path, dtype=torch.bfloat16).model).prefill(ps, 16)
    assert approx[0].dtype == torch.float32
    assert float((approx[0] - exact[0]).norm() / exact[0].norm()) < 0.03


@pytest.mark.parametrize(
    "overrides", [{"rope_interleave": False}, {"q_lora_rank": None}], ids=["neox-rope", "no-q-lora"]
)
def test_mla_variants_match_transformers(tmp_path: Path, overrides: dict[str, object]) -> None:
    path = make_tiny("deepseek_v3", tmp_path / "variant", **overrides)
    assert prefill_max_diff("deepseek_v3", path) <= MAX_ABS_DIFF
