"""Checkpoint folders: single and sharded files, per-expert and fused expert tensors, MTP layers,
both config spellings, clear errors, and the slices a rank of a 2-way split keeps."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.errors import CheckpointError
from backend.models.loader import load_model
from backend.models.model_config import ModelConfig
from tests.backend.tiny_checkpoints import EOS_IDS, make_tiny

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("deepseek_v3", tmp_path_factory.mktemp("ckpt") / "ds")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _copy_folder(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _state(path: Path, **kwargs: int) -> dict[str, torch.Tensor]:
    return load_model(path, dtype=torch.float32, **kwargs).model.state_dict()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sharded_checkpoint_loads_like_the_single_file(ds_path: Path, tmp_path: Path) -> None:
    tensors = _tensors(ds_path)
    names = sorted(tensors)
    dst = tmp_path / "sharded"
    dst.mkdir()
    for name in ("config.json", "generation_config.json"):
        (dst / name).write_text((ds_path / name).read_text())
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(dst / file))
        weight_map |= {n: file for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same(_state(ds_path), _state(dst))


# one rank; rank 3 of 4 with 2 expert groups (each expert split by its intermediate dims over 2 ranks)
@pytest.mark.parametrize("layout", [{}, {"rank": 3, "world_size": 4, "ep": 2}])
def test_fused_expert_tensors_load_like_per_expert_ones(
    ds_path: Path, tmp_path: Path, layout: dict[str, int]
) -> None:
    tensors = _tensors(ds_path)
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := _EXPERT.match(name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            fused[name] = t
    for prefix, parts in experts.items():
        E = 1 + max(e for e, _ in parts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(E)]
        )  # [E, 2I, H]
        fused[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in range(E)])  # [E, H, I]
    _assert_same(
        _state(ds_path, **layout), _state(_copy_folder(ds_path, tmp_path / "fused", fused), **layout)
    )


def test_mtp_layers_are_skipped(ds_path: Path, tmp_path: Path) -> None:
    tensors = _tensors(ds_path)
    n = ModelConfig.from_pretrained(ds_path).num_hidden_layers
    extra = {
        f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4),
        f"model.layers.{n}.enorm.weight": torch.ones(4),
    }
    _assert_same(_state(ds_path), _state(_copy_folder(ds_path, tmp_path / "mtp", tensors | extra)))


@pytest.mark.parametrize(
    "missing", ["model.layers.1.mlp.experts.5.up_proj.weight", "model.norm.weight", "lm_head.weight"]
)
def test_a_missing_tensor_is_named(ds_path: Path, tmp_path: Path, missing: str) -> None:
    tensors = _tensors(ds_path)
    del tensors[missing]
    dst = _copy_folder(ds_path, tmp_path / "gap", tensors)
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        load_model(dst, dtype=torch.float32)


def test_an_unexpected_tensor_is_named(ds_path: Path, tmp_path: Path) -> None:
    tensors = _tensors(ds_path) | {"model.layers.0.self_attn.q_zz.weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="q_zz"):
        load_model(_copy_folder(ds_path, tmp_path / "odd", tensors), dtype=torch.float32)


def test_tied_embeddings_reuse_the_embedding(ds_path: Path, tmp_path: Path) -> None:
    tensors = _tensors(ds_path)
    del tensors["lm_head.weight"]
    dst = _copy_folder(ds_path, tmp_path / "tied", tensors)
    raw = json.loads((dst / "config.json").read_text()) | {"tie_word_embeddings": True}
    (dst / "config.json").write_text(json.dumps(raw))
    model = load_model(dst, dtype=torch.float32).model
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_unknown_architecture_is_named(ds_path: Path, tmp_path: Path) -> None:
    dst = _copy_folder(ds_path, tmp_path / "unknown", _tensors(ds_path))
    raw = json.loads((dst / "config.json").read_text()) | {"architectures": ["LlamaForCausalLM"]}
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        load_model(dst, dtype=torch.float32)


def test_missing_weights_file_is_an_error(tmp_path: Path, ds_path: Path) -> None:
    dst = tmp_path / "empty"
    dst.mkdir()
    (dst / "config.json").write_text((ds_path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(dst, dtype=torch.float32)


def test_rope_scaling_and_rope_parameters_read_the_same(tmp_path: Path) -> None:
    published = ModelConfig.from_pretrained(make_tiny("kimi_k2", tmp_path / "published"))
    current = ModelConfig.from_pretrained(
        make_tiny(
            "deepseek_v3",
            tmp_path / "current",
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        )
    )
    assert json.loads((tmp_path / "published" / "config.json").read_text()).get("rope_scaling")
    assert published.rope == current.rope
    assert published.model_type == "kimi_k2" and published.eos_token_ids == tuple(EOS_IDS)
    assert published.softmax_scale == pytest.approx(24**-0.5 * (0.1 * math.log(4.0) + 1) ** 2)


def test_world_size_2_ranks_keep_their_slices(ds_path: Path) -> None:
    full = _tensors(ds_path)
    c = ModelConfig.from_pretrained(ds_path)
    H, qk, kv, V = c.num_attention_heads, c.head_dim, c.qk_nope_head_dim + c.v_head_dim, c.v_head_dim
    for rank in (0, 1):
        m = load_model(ds_path, dtype=torch.float32, rank=rank, world_size=2, fuse_projections=False).model
        h = slice(rank * H // 2, (rank + 1) * H // 2)
        attn = m.model.layers[1].self_attn
        assert torch.equal(
            attn.q_b_proj.weight, full["model.layers.1.self_attn.q_b_proj.weight"][h.start * qk : h.stop * qk]
        )
        assert torch.equal(
            attn.kv_b_proj.weight,
            full["model.layers.1.self_attn.kv_b_proj.weight"][h.start * kv : h.stop * kv],
        )
        assert torch.equal(
            attn.o_proj.weight, full["model.layers.1.self_attn.o_proj.weight"][:, h.start * V : h.stop * V]
        )
        assert torch.equal(
            attn.kv_a_proj_with_mqa.weight, full["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
        )
        experts = m.model.layers[1].mlp.experts
        local = range(rank * 4, rank * 4 + 4)
        assert (experts.e0, experts.e1) == (local.start, local.stop)
        for i, e in enumerate(local):
            I = c.moe_intermediate_size
            assert torch.equal(
                experts.gate_up_proj[i, :I], full[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]
            )
            assert torch.equal(experts.down_proj[i], full[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
        vocab = slice(rank * c.vocab_size // 2, (rank + 1) * c.vocab_size // 2)  # vocab parallel
        assert torch.equal(m.model.embed_tokens.weight, full["model.embed_tokens.weight"][vocab])
        assert torch.equal(m.lm_head.weight, full["lm_head.weight"][vocab])
        dense = m.model.layers[0].mlp
        rows = slice(rank * c.intermediate_size // 2, (rank + 1) * c.intermediate_size // 2)
        assert torch.equal(dense.gate_proj.weight, full["model.layers.0.mlp.gate_proj.weight"][rows])
        assert torch.equal(dense.down_proj.weight, full["model.layers.0.mlp.down_proj.weight"][:, rows])


def test_world_size_2_gqa_ranks_keep_their_kv_heads(tmp_path: Path) -> None:
    path = make_tiny("glm4_moe", tmp_path / "glm4")
    full = _tensors(path)
    c = ModelConfig.from_pretrained(path)
    D = c.head_dim
    for rank in (0, 1):
        attn = load_model(path, dtype=torch.float32, rank=rank, world_size=2).model.model.layers[0].self_attn
        # 4 query heads over 2 kv heads: rank r keeps query heads 2r, 2r+1 and kv head r
        assert torch.equal(
            attn.q_proj.weight,
            full["model.layers.0.self_attn.q_proj.weight"][rank * 2 * D : (rank + 1) * 2 * D],
        )
        assert torch.equal(
            attn.k_proj.weight, full["model.layers.0.self_attn.k_proj.weight"][rank * D : (rank + 1) * D]
        )
        assert torch.equal(
            attn.k_proj.bias, full["model.layers.0.self_attn.k_proj.bias"][rank * D : (rank + 1) * D]
        )
        assert attn.cache_specs()[0].shape == (1, D)


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 2},
        {"index_topk_freq": 3, "index_skip_topk_offset": 1},
        {"index_topk_pattern": "FSSFFS"},
    ],
)
def test_dsa_indexer_types_are_derived_as_transformers_does(keys: dict[str, object]) -> None:
    from transformers import GlmMoeDsaConfig

    from tests.backend.tiny_checkpoints import config_dict

    cfg = config_dict("glm_moe_dsa", num_hidden_layers=6, indexer_types=None)
    raw = dict(cfg, architectures=["GlmMoeDsaForCausalLM"], **keys)
    assert list(ModelConfig.from_dict(raw).indexer_types) == GlmMoeDsaConfig(**cfg, **keys).indexer_types


def test_other_routing_schemes_are_refused(ds_path: Path) -> None:
    raw = json.loads((ds_path / "config.json").read_text()) | {
        "topk_method": "greedy",
        "scoring_func": "softmax",
    }
    with pytest.raises(CheckpointError, match="softmax"):
        ModelConfig.from_dict(raw)


def test_a_rank_does_not_read_other_ranks_experts(ds_path: Path) -> None:
    from backend.models.checkpoint import iter_tensors

    # unfused: loaded again below by the checkpoint's names
    model = load_model(ds_path, dtype=torch.float32, rank=1, world_size=2, fuse_projections=False).model
    names = [n for n, _ in iter_tensors(ds_path, keep=model.wants_tensor)]
    experts = [int(m.group(2)) for n in names if (m := _EXPERT.match(n))]
    assert experts and all(4 <= e < 8 for e in experts)
    assert len(names) == len(_tensors(ds_path)) - len(experts)
    model.load_weights(iter_tensors(ds_path, keep=model.wants_tensor))  # still complete for this rank
