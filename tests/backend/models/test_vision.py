"""MoonViT (Kimi K2.5 vision tower + projector) against transformers' Kimi_K25 on tiny random weights."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from backend.models.image_processor import process_image, target_size
from backend.models.moonvit import MoonViT, VisionConfig

TEXT = dict(
    model_type="deepseek_v3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_group=1,
    topk_group=1,
)
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_hidden_layers=2,
    pos_emb_height=8,
    pos_emb_width=8,
    patch_size=14,
)


@pytest.fixture(scope="module")
def k25(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    torch.manual_seed(0)
    config = Kimi_K25Config(text_config=TEXT, vision_config=VISION, projection_hidden_size=32)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():  # random init leaves the position grid near zero; make it matter
        model.model.vision_tower.patch_embed.pos_emb.position_embeddings.normal_(0, 1.0)
    path = tmp_path_factory.mktemp("k25")
    model.save_pretrained(path)
    return model, path


def _ours(path: Path) -> MoonViT:
    raw = json.loads((path / "config.json").read_text())
    vit = MoonViT(VisionConfig.from_config(raw, text_hidden_size=raw["text_config"]["hidden_size"]))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        vit.load_weights((k, f.get_tensor(k)) for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return vit.eval()


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_two_images_of_different_sizes_match_transformers(k25) -> None:
    model, path = k25
    vit = _ours(path)
    images = [process_image(_png(70, 56, 1)), process_image(_png(150, 97, 2))]
    assert [(i.grid_h, i.grid_w) for i in images] == [(4, 6), (8, 12)]  # padded to multiples of 28
    pixels = torch.cat([i.patches for i in images])
    grid = torch.tensor([[1, i.grid_h, i.grid_w] for i in images])
    with torch.no_grad():
        expected = torch.cat(model.model.get_image_features(pixels, grid).pooler_output)
    got = vit(pixels, [(i.grid_h, i.grid_w) for i in images])
    assert got.shape == expected.shape == (4 * 6 // 4 + 8 * 12 // 4, TEXT["hidden_size"])
    assert (got - expected).abs().max().item() <= 1e-4


def test_resize_never_upscales_and_caps_the_side() -> None:
    assert target_size(56, 70, 14, 2, 16384, 512) == ((56, 70), (56, 84))
    (h, w), (ph, pw) = target_size(4000, 1000, 14, 2, 16384, 512)
    assert h <= 512 * 14 and w <= 512 * 14 and ph % 28 == 0 and pw % 28 == 0
    (h, w), _ = target_size(3000, 3000, 14, 2, 1024, 512)
    assert (h // 14) * (w // 14) <= 1024


def test_hash_depends_on_bytes() -> None:
    a, b = process_image(_png(30, 30, 1)), process_image(_png(30, 30, 2))
    assert a.image_hash != b.image_hash
    assert process_image(_png(30, 30, 1)).image_hash == a.image_hash


def test_undecodable_image_is_a_clear_error() -> None:
    from backend.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="could not be decoded"):
        process_image(b"not an image")


def test_huge_image_is_refused_before_decoding() -> None:
    from backend.errors import InvalidRequest

    buf = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buf, format="PNG")  # a few kB on disk, 81M pixels decoded
    with pytest.raises(InvalidRequest, match="more than"):
        process_image(buf.getvalue())


def test_large_jpeg_is_decoded_at_reduced_scale_and_fits_the_side_limit() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4000, 3000), (200, 10, 10)).save(buf, format="JPEG")
    image = process_image(buf.getvalue(), max_side=16)
    assert image.grid_h * 14 <= 16 * 14 + 28 and image.grid_w * 14 <= 16 * 14 + 28


@torch.no_grad()
def test_prompt_with_two_images_of_different_sizes_gives_transformers_logits(tmp_path: Path) -> None:
    """The whole K2.5 model, as a published checkpoint: MoonViT embeddings spliced at the placeholders,
    the paged MLA text model after them, against transformers' Kimi_K25 (float32, ≤ 1e-4)."""
    from backend.engine.forward_batch import ImageEmbeds
    from backend.models.image_encoder import VisionEncoder
    from backend.models.loader import load_model
    from tests.backend.paged_driver import PagedDriver, Seq
    from tests.backend.tiny_checkpoints import load_reference, make_tiny

    path = make_tiny("kimi_k25", tmp_path / "k25")
    image_token = json.loads((path / "config.json").read_text())["image_token_id"]
    images = [process_image(_png(70, 56, 3)), process_image(_png(150, 97, 4))]
    counts = [i.grid_h * i.grid_w // 4 for i in images]
    ids = [5, 6, 7] + [image_token] * counts[0] + [8, 9] + [image_token] * counts[1] + [10, 11, 12]
    grids = [(i.grid_h, i.grid_w) for i in images]
    pixels = torch.cat([i.patches for i in images])

    ref = load_reference("kimi_k25", path)
    theirs = ref(
        input_ids=torch.tensor([ids]),
        pixel_values=pixels,
        image_grid_thw=torch.tensor([[1, h, w] for h, w in grids]),
    ).logits[0]

    loaded = load_model(path, dtype=torch.float32)
    vision = VisionEncoder.from_checkpoint(path, pad_token_id=image_token, dtype=torch.float32)
    assert vision is not None
    slots = torch.tensor([t for t, tok in enumerate(ids) if tok == image_token])
    text_ids = [0 if tok == image_token else tok for tok in ids]  # the placeholder rows are replaced
    driver = PagedDriver(loaded.model, num_pages=8)
    batch = driver.batch([Seq(tokens=text_ids)], [len(ids)])
    batch.image_embeds = ImageEmbeds(token_indices=slots, embeds=vision._tower(pixels, grids))
    ours = loaded.model(batch)
    assert ours.shape == theirs.shape and not batch.tag_mismatch.any()
    assert (ours - theirs).abs().max().item() <= 1e-4
    # the images matter: without them the logits after the first image differ
    plain = PagedDriver(loaded.model, num_pages=8)
    without = loaded.model(plain.batch([Seq(tokens=text_ids)], [len(ids)]))
    assert (without[-1] - theirs[-1]).abs().max().item() > 1e-3
