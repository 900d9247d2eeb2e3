"""Quantized Linears, the walker's scope, and checkpoints written by compressed-tensors itself."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.utils import match_named_modules
from torch import nn

from backend.quant.linear import Fp8Linear, Int4Linear
from backend.quant.scheme import QuantScheme, config_dict, parse_config, scheme_from_config
from backend.quant.walker import prepare_for_checkpoint, quantize_model

H, I = 128, 256


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            nn.Linear(H, I, bias=False),
            nn.Linear(H, I, bias=False),
            nn.Linear(I, H, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, 2, bias=False)
        self.experts = nn.ModuleList([_Mlp(), _Mlp()])
        self.shared_experts = _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gate(x).softmax(-1)
        return sum(w[..., e : e + 1] * ex(x) for e, ex in enumerate(self.experts)) + self.shared_experts(x)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_a_proj(x)))


class _Layer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp = _Attn(), (_Moe() if moe else _Mlp())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.mlp(x)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, H)
        self.layers = nn.ModuleList([_Layer(False), _Layer(True)])


class TinyKimiShaped(nn.Module):
    """Module names as in DeepSeek-V3 / Kimi K2 checkpoints: dense layer 0, MoE layer 1."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = nn.Linear(H, 50, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


def _model() -> TinyKimiShaped:
    torch.manual_seed(0)
    return TinyKimiShaped().eval()


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 7, 3, 49, 0, 22]])


def test_default_scope_is_routed_experts_only() -> None:
    model = _model()
    swapped = quantize_model(model, QuantScheme.build("int4"))
    assert sorted(swapped) == sorted(
        f"model.layers.1.mlp.experts.{e}.{p}_proj" for e in (0, 1) for p in ("gate", "up", "down")
    )
    assert isinstance(model.model.layers[1].mlp.experts[0].down_proj, Int4Linear)
    assert type(model.model.layers[1].mlp.shared_experts.up_proj) is nn.Linear


def test_all_linear_keeps_router_embeddings_and_lm_head() -> None:
    model = _model()
    swapped = quantize_model(model, QuantScheme.build("int4", all_linear=True))
    assert "model.layers.1.mlp.gate" not in swapped and "lm_head" not in swapped
    assert "model.layers.0.self_attn.o_proj" in swapped and "model.layers.0.mlp.gate_proj" in swapped
    assert len(swapped) == 2 * 2 + 3 + 3 * 3
    assert type(model.model.embed_tokens) is nn.Embedding


@pytest.mark.parametrize(
    ("method", "group_size", "tol"),
    [("int4", 32, 0.06), ("int4", 128, 0.06), ("fp8-channel", 32, 0.025), ("fp8-block", 32, 0.025)],
)
def test_quantized_model_logits_close(method: str, group_size: int, tol: float) -> None:
    """Relative L2 logit error of an all-linear quantized model vs float32 (INT4 ~ 2^-4 per weight)."""
    ref_model = _model()
    with torch.no_grad():
        ref = ref_model(_ids())
        model = _model()
        quantize_model(model, QuantScheme.build(method, group_size=group_size, all_linear=True))  # type: ignore[arg-type]
        out = model(_ids())
    rel = float((out - ref).norm() / ref.norm())
    assert 0 < rel < tol


def test_our_config_is_valid_compressed_tensors_and_selects_the_same_modules() -> None:
    for all_linear in (False, True):
        scheme = QuantScheme.build("int4", all_linear=all_linear)
        ct = QuantizationConfig.model_validate(config_dict(scheme))
        model = _model()
        theirs = {n for n, _ in match_named_modules(model, ["Linear"], ct.ignore)}
        ours = set(prepare_for_checkpoint(model, scheme))
        assert ours == theirs


KIMI_K2_THINKING_BLOCK = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "version": "0.11.0",
}


def test_reads_kimi_k2_thinking_block() -> None:
    scheme = scheme_from_config(parse_config(KIMI_K2_THINKING_BLOCK))
    assert scheme.method == "int4" and scheme.group_size == 32
    assert scheme.applies_to("model.layers.5.mlp.experts.17.down_proj")
    assert not scheme.applies_to("model.layers.5.mlp.shared_experts.down_proj")
    assert not scheme.applies_to("model.layers.0.mlp.up_proj")
    assert not scheme.applies_to("model.layers.5.self_attn.kv_b_proj")


@pytest.mark.parametrize("group_size", [32, 128])
def test_checkpoint_compressed_by_compressed_tensors_loads_unmodified(group_size: int) -> None:
    """compressed-tensors quantizes and packs a model; Kumo loads its state dict as is and computes
    what compressed-tensors' own decompression computes."""
    scheme = QuantScheme.build("int4", group_size=group_size, all_linear=True)
    cfg = QuantizationConfig.model_validate({**config_dict(scheme), "quantization_status": "frozen"})
    theirs = _model()
    apply_quantization_config(theirs, cfg, show_progress=False)
    for _, module in match_named_modules(theirs, ["Linear"], cfg.ignore):
        g = module.weight.detach().view(module.out_features, -1, group_size)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), module.quantization_scheme.weights)
        module.weight_scale.data = scale.to(torch.bfloat16)
    compressor = ModelCompressor(quantization_config=cfg)
    compressor.compress_model(theirs)
    state = {k: v.clone() for k, v in theirs.state_dict().items()}
    assert any(k.endswith("weight_packed") for k in state)

    ours = _model()
    prepare_for_checkpoint(ours, scheme_from_config(parse_config(config_dict(scheme))))
    ours.load_state_dict(state, strict=True)
    compressor.decompress_model(theirs)
    plain = _model()  # the float model with compressed-tensors' decompressed weights put in
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, Int4Linear):
                ref = theirs.get_submodule(name).weight
                assert torch.equal(module.dequantized_weight(ref.dtype), ref)
                plain.get_submodule(name).weight.copy_(ref.float())
        out, ref_out, float_out = ours(_ids()), plain(_ids()), _model()(_ids())
    # compressed-tensors rounds q * scale to BF16; Kumo keeps it exact in the float32 activation dtype
    assert float((out - ref_out).norm() / ref_out.norm()) < 2e-3
    assert float((out - float_out).norm() / float_out.norm()) > 1e-2


def test_fp8_block_module_names_its_tensors_as_deepseek() -> None:
    mod = Fp8Linear.from_weight(nn.Linear(200, 130, bias=False).weight, block=(128, 128))
    assert set(mod.state_dict()) == {"weight", "weight_scale_inv"}
    assert mod.weight_scale_inv.shape == (2, 2)


def _fp8_block_config() -> QuantizationConfig:
    """compressed-tensors' FP8_BLOCK preset as llm-compressor writes it (e.g. a Kimi K2.6 FP8-BLOCK
    conversion): `float-quantized`, strategy block, and the block scale named `weight_scale`."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_BLOCK", ["Linear"])},
        ignore=["lm_head", r"re:.*mlp\.gate$"],
        format="float-quantized",
        quantization_status="frozen",
    )


def test_fp8_block_checkpoint_compressed_by_compressed_tensors_loads_unmodified() -> None:
    """Its block scales are `weight_scale` [N/128, K/128], not DeepSeek's `weight_scale_inv`: Kumo
    refused every one as an unexpected tensor."""
    from kernels.formats.fp8 import quantize_fp8_block

    cfg = _fp8_block_config()
    theirs = _model()
    apply_quantization_config(theirs, cfg, show_progress=False)
    for _, module in match_named_modules(theirs, ["Linear"], cfg.ignore):
        module.weight_scale.data = quantize_fp8_block(module.weight.detach())[1].to(module.weight_scale.dtype)
    compressor = ModelCompressor(quantization_config=cfg)
    compressor.compress_model(theirs)
    state = {k: v.clone() for k, v in theirs.state_dict().items()}
    scheme = scheme_from_config(parse_config(cfg.model_dump()))
    assert scheme.method == "fp8-block"
    ours = _model()
    prepare_for_checkpoint(ours, scheme)
    ours.load_state_dict(state, strict=True)
    compressor.decompress_model(theirs)
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, Fp8Linear):
                ref = theirs.get_submodule(name).weight
                assert torch.equal(module.dequantized_weight(ref.dtype), ref)


def test_fp8_block_experts_take_the_compressed_tensors_scale_name() -> None:
    from backend.quant.experts import QuantExperts

    scheme = scheme_from_config(parse_config(_fp8_block_config().model_dump()))
    experts = QuantExperts(scheme, e0=0, e1=2, hidden=H, intermediate=I, act=nn.functional.silu)
    assert experts.load_expert_part(1, "down_proj", "weight_scale", torch.full((1, 2), 0.5))[1] == 1
    with pytest.raises(Exception, match="weight_scale_inv"):
        experts.load_expert_part(1, "down_proj", "weight_scale_inv", torch.full((1, 2), 0.5))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"actorder": "group"}, "actorder"),  # GPTQ's weight_g_idx permutation: not served
        ({"group_size": None}, "group_size"),  # was read as 32
        ({"symmetric": False}, "unsupported"),
        ({"num_bits": 8}, "unsupported"),
    ],
)
def test_unsupported_compressed_tensors_weights_are_refused_by_name(change: dict, words: str) -> None:
    import copy

    raw = copy.deepcopy(KIMI_K2_THINKING_BLOCK)
    raw["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(ValueError, match=words):
        scheme_from_config(parse_config(raw))


def _float32_layers(gen: torch.Generator) -> list[nn.Module]:
    """The DSA indexer's `weights_proj` shape class: a float32 layer, dense and quantized."""
    from backend.models.layers.linear import Linear

    w = torch.randn(32, H, generator=gen) * 0.05
    dense = Linear(H, 32, dtype=torch.float32)
    dense.weight.data.copy_(w)
    # as the walker builds them for a float32 Linear (`_empty_linear`): the dense dtype is the bias's
    int4, fp8 = Int4Linear.from_weight(w, group_size=32), Fp8Linear.from_weight(w)
    int4_32 = Int4Linear(H, 32, group_size=32, bias_dtype=torch.float32)
    int4_32.weight_packed.copy_(int4.weight_packed)
    int4_32.weight_scale.copy_(int4.weight_scale)
    fp8_32 = Fp8Linear(H, 32, bias_dtype=torch.float32)
    fp8_32.weight.copy_(fp8.weight)
    fp8_32.weight_scale.copy_(fp8.weight_scale)
    return [dense, int4_32, fp8_32]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_float32_layer_widens_a_bf16_x_as_x_float_would(index: int) -> None:
    """The indexer hands its bf16 hidden state to the float32 `weights_proj`: the product is x.float()'s,
    to the bit, in float32 (on CUDA the INT4 decode GEMV widens x in its loads: no cast launch)."""
    gen = torch.Generator().manual_seed(index)
    layer = _float32_layers(gen)[index]
    x = torch.randn(1, H, generator=gen).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.float32 and torch.equal(y, layer(x.float()))


@pytest.mark.gpu
def test_int4_float32_layer_widens_in_the_decode_gemv_on_gpu() -> None:
    gen = torch.Generator().manual_seed(5)
    layer = _float32_layers(gen)[1].cuda()
    for M in (1, 2, 5, 80):  # GEMV rows, tiles, prefill
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).cuda()
        y = layer(x)
        assert y.dtype == torch.float32 and torch.equal(y, layer(x.float()))
