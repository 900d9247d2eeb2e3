"""`kumo plan` on the shipped published-shape configs, against the seed's figures and transformers.

Seed figures (issue 5): Kimi K2.6 on 8×H200 with native INT4 experts ≈ 686k KV tokens at BF16 and
about twice that at FP8; GLM 5.2 FP8 ≈ 705 GB → ≈ 421 GB INT4 --all-linear, ≈ 88 → ≈ 52 GB per GPU
at 8 GPUs. The seed's "GB" for GLM matches Kumo's GiB for FP8 (+0.4%); see each tolerance below.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from backend.quant.scheme import QuantScheme
from backend.tools.plan import GIB, main, make_plan, parse_bytes, scheme_for, stored_bytes
from backend.tools.tensor_inventory import TensorSpec, checkpoint_tensors, layer_index, text_config

CONFIGS = Path(__file__).resolve().parents[3] / "models" / "configs"
H200 = parse_bytes("141GB")


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_kimi_k26_kv_tokens_match_seed_and_fp8_doubles_them() -> None:
    bf16 = make_plan(_config("kimi-k2.6"), gpu_mem=H200, tp=8, kv_dtype="bf16")
    fp8 = make_plan(_config("kimi-k2.6"), gpu_mem=H200, tp=8, kv_dtype="fp8")
    assert bf16.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert abs(bf16.kv_tokens / 686_000 - 1) < 0.03  # Kumo: 682,368 (-0.5%)
    assert abs(fp8.kv_tokens / bf16.kv_tokens - 2) < 0.001
    assert abs(fp8.kv_tokens / 1_370_000 - 1) < 0.03
    # the native checkpoint: INT4 routed experts, BF16 rest ≈ 594 GB (engine-anchors §7)
    assert abs(bf16.checkpoint_bytes / 594e9 - 1) < 0.01


def test_glm52_fp8_to_int4_all_linear_matches_seed() -> None:
    fp8 = make_plan(_config("glm-5.2"), gpu_mem=H200, tp=8, weights="fp8-block", all_linear=True)
    int4 = make_plan(_config("glm-5.2"), gpu_mem=H200, tp=8, weights="int4-g32", all_linear=True)
    assert abs(fp8.checkpoint_bytes / GIB / 705 - 1) < 0.01  # 707.7 (+0.4%)
    assert abs(fp8.weights_per_gpu / GIB / 88 - 1) < 0.02  # 89.0 (+1.1%)
    assert (
        abs(int4.checkpoint_bytes / GIB / 421 - 1) < 0.06
    )  # 401.2 (-4.7%): the seed keeps attention BF16 (see the report)
    assert abs(int4.weights_per_gpu / GIB / 52 - 1) < 0.05  # 50.6 (-2.7%)
    assert int4.kv_tokens > fp8.kv_tokens * 1.5


def test_glm45_gqa_kv_is_split_by_heads() -> None:
    tp1 = make_plan(_config("glm-4.5"), gpu_mem=H200, tp=1, weights="int4-g128", all_linear=True)
    tp8 = make_plan(_config("glm-4.5"), gpu_mem=H200, tp=8, weights="int4-g128", all_linear=True)
    assert tp1.kv_bytes_per_token == 92 * 2 * 8 * 128 * 2
    assert tp8.kv_bytes_per_token == tp1.kv_bytes_per_token // 8


@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.6", "glm-4.5"])
def test_tensor_inventory_matches_transformers_parameter_count(name: str) -> None:
    """Every tensor the plan counts exists, with the same total size, in transformers' own model
    (built on the meta device: no memory), which has no MTP layer and no vision tower."""
    import transformers

    cls = {"glm-5.2": "GlmMoeDsa", "kimi-k2.6": "DeepseekV3", "glm-4.5": "Glm4Moe"}[name]
    cfg = _config(name)
    tc = {k: v for k, v in text_config(cfg).items() if not k.startswith("_")}
    with torch.device("meta"):
        model = getattr(transformers, f"{cls}ForCausalLM")(getattr(transformers, f"{cls}Config")(**tc))
    theirs = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    ours = sum(
        s.numel
        for s in checkpoint_tensors(cfg)
        if not s.name.startswith(("vision_tower.", "mm_projector."))
        and (layer_index(s.name) is None or layer_index(s.name) < tc["num_hidden_layers"])
    )
    assert ours == theirs


def test_stored_bytes_per_format() -> None:
    spec = TensorSpec("model.layers.3.mlp.experts.0.down_proj.weight", (7168, 2048), is_linear=True)
    assert stored_bytes(spec, None) == 7168 * 2048 * 2
    assert stored_bytes(spec, QuantScheme.build("int4")) == 7168 * 256 * 4 + 7168 * 64 * 2 + 8
    assert stored_bytes(spec, QuantScheme.build("fp8-block")) == 7168 * 2048 + 56 * 16 * 4
    attn = TensorSpec("model.layers.3.self_attn.o_proj.weight", (7168, 8192), is_linear=True)
    assert stored_bytes(attn, QuantScheme.build("int4")) == 7168 * 8192 * 2


def test_cli_prints_every_term_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(
        [
            "--model",
            str(CONFIGS / "kimi-k2.6"),
            "--gpu-mem",
            "141GB",
            "--tp",
            "8",
            "--kv-dtype",
            "fp8",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    for word in (
        "usable memory",
        "weights",
        "activations: MoE",
        "activations: logits",
        "KV bytes per token",
        "KV tokens that fit",
    ):
        assert word in text
    plan = json.loads(out.read_text())
    assert plan["kv_bytes_per_token"] == 35_136 and plan["kv_tokens"] > 1_300_000


def test_does_not_fit() -> None:
    assert make_plan(_config("glm-5.2"), gpu_mem=parse_bytes("80GB"), tp=8, weights="bf16").kv_tokens == 0


def test_plan_predicts_the_bytes_kumo_quantize_writes(tmp_path: Path) -> None:
    """The plan's INT4 expert bytes for a checkpoint equal what `kumo quantize` actually writes, and
    its tensor inventory names every tensor of a real (tiny) checkpoint."""
    from safetensors import safe_open

    from backend.tools.quantize import main as quantize
    from tests.backend.tiny_checkpoints import make_tiny

    src = make_tiny("glm_moe_dsa", tmp_path / "src")
    quantize([str(src), str(tmp_path / "dst"), "--weights", "int4-g32"])
    report = json.loads((tmp_path / "dst" / "quantize_report.json").read_text())
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    plan = make_plan(config, gpu_mem=parse_bytes("1GiB"), tp=1, weights="native")
    assert (
        plan.weights_per_gpu_by_class["routed_experts"] == report["classes"]["routed_experts"]["dest_bytes"]
    )
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    predicted = {s.name: s.shape for s in checkpoint_tensors(json.loads((src / "config.json").read_text()))}
    assert predicted == written


def test_kimi_k26_native_keeps_lm_head_and_router_bf16() -> None:
    """Kimi's shipped ignore list says `lm_head`, which the loader matches on the model's own name
    (the K2.5 layout's `language_model.` prefix stripped), and its router is not a Linear: both are
    served in BF16, so the plan must count them so (it counted them as INT4, ~0.4 GiB/GPU short)."""
    plan = make_plan(_config("kimi-k2.6"), gpu_mem=H200, tp=8)
    by_class = plan.weights_per_gpu_by_class
    assert by_class["lm_head"] == 163_840 * 7168 * 2 // 8  # BF16, split by tp
    # replicated, held in fp32 (backend/models/layers/moe.py Router) though stored BF16, + the fp32 bias
    assert by_class["router"] == 60 * (384 * 7168 * 4 + 384 * 4)
    assert by_class["embeddings"] == by_class["lm_head"]


def test_native_scheme_matches_names_without_the_weight_prefix() -> None:
    kimi = _config("kimi-k2.6")
    head = TensorSpec("language_model.lm_head.weight", (163_840, 7168), is_linear=True)
    expert = TensorSpec(
        "language_model.model.layers.3.mlp.experts.0.down_proj.weight", (7168, 2048), is_linear=True
    )
    scheme = scheme_for(kimi, "native", False)
    assert stored_bytes(head, scheme) == 163_840 * 7168 * 2
    assert stored_bytes(expert, scheme) == 7168 * 256 * 4 + 7168 * 64 * 2 + 8


def test_cli_errors_are_one_line_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "kumo plan: error:" in capsys.readouterr().err
    cfg = _config("glm-4.5")
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "kumo plan: error:" in err and "hidden_size" in err


def test_dcp8_shards_the_kimi_latent_cache_to_over_ten_million_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--dcp 8` at tp 8: each GPU keeps 1/8 of every sequence's latents (backend/models/layers/
    context_parallel.py), so its bytes per token are 61 × 576 / 8; the DCP prefill's gathered queries
    (all 64 heads) cost activation memory the plan subtracts first."""
    tp8 = make_plan(_config("kimi-k2.6"), gpu_mem=parse_bytes("141GiB"), tp=8, kv_dtype="fp8")
    dcp8 = make_plan(_config("kimi-k2.6"), gpu_mem=parse_bytes("141GiB"), tp=8, kv_dtype="fp8", dcp=8)
    assert dcp8.kv_bytes_per_token == 61 * 576 // 8 == 4_392
    assert dcp8.weights_per_gpu == tp8.weights_per_gpu
    attention = {t.name: -t.bytes for t in dcp8.terms}["activations: attention"]
    assert attention == 8192 * 64 * (576 * 2 + 2 * 512 * 4)
    assert dcp8.kv_pool_bytes == tp8.kv_pool_bytes - attention + 8192 * 8 * (2 * 192 + 2 * 128) * 2
    # pages of 16 tokens per rank: the group's tokens come in 16 × 8
    assert dcp8.kv_tokens == dcp8.kv_pool_bytes // (35_136 * 16) * 16 * 8
    assert 10_000_000 <= dcp8.kv_tokens < 8 * tp8.kv_tokens
    rc = main(
        [
            "--model",
            str(CONFIGS / "kimi-k2.6"),
            "--gpu-mem",
            "141GiB",
            "--tp",
            "8",
            "--dcp",
            "8",
            "--kv-dtype",
            "fp8",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert f"KV tokens that fit  {dcp8.kv_tokens:,}" in out and "/ dcp 8 = 4,392 B" in out


def test_dcp_needs_mla_and_a_divisor_of_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(CONFIGS / "glm-4.5"), "--tp", "8", "--dcp", "2"]) == 2
    assert "MLA" in capsys.readouterr().err
    assert main(["--model", str(CONFIGS / "glm-5.2"), "--tp", "8", "--dcp", "3"]) == 2
    assert "must divide" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["glm-5.2", "glm-4.5"])
def test_speculative_counts_the_mtp_layers_kumo_loads(name: str) -> None:
    """With --speculative the MTP tensors the plan counts are exactly the state of Kumo's own MTP
    layers (built on the meta device), and each adds a KV layer slot."""
    from backend.models import ARCHITECTURES
    from backend.models.model_config import ModelConfig

    cfg = _config(name)
    off = make_plan(cfg, gpu_mem=H200, tp=8, weights="int4-g128", all_linear=True)
    on = make_plan(cfg, gpu_mem=H200, tp=8, weights="int4-g128", all_linear=True, mtp=True)
    num_mtp = text_config(cfg)["num_nextn_predict_layers"]
    assert num_mtp >= 1
    assert on.kv_layers_per_tensor == {k: v + num_mtp for k, v in off.kv_layers_per_tensor.items()}
    assert on.weights_per_gpu > off.weights_per_gpu and on.kv_tokens < off.kv_tokens
    config = ModelConfig.from_pretrained(CONFIGS / name)
    with torch.device("meta"):
        model = ARCHITECTURES[config.architecture](config, dtype=torch.bfloat16, num_mtp_layers=num_mtp)
    ours = sum(t.numel() for n, t in model.state_dict().items() if n.startswith("mtp."))
    n = text_config(cfg)["num_hidden_layers"]
    counted = sum(
        s.numel
        for s in checkpoint_tensors(cfg)
        if (layer_index(s.name) or 0) >= n and not re.search(r"\.(embed_tokens|shared_head\.head)\.", s.name)
    )
    assert ours == counted
