"""Random checkpoints of a published geometry truncated to a few layers (`backend.tools.random_geometry`):
the plan of the full shapes, and at small shapes the written folder loads back value for value and serves."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from backend.models.checkpoint import INDEX_FILE, iter_tensors
from backend.models.loader import load_model
from backend.quant.experts import QuantExperts
from backend.tools import random_geometry as rg
from backend.tools.random_checkpoint import PUBLISHED_CONFIGS, small_config
from backend.tools.tensor_inventory import text_config
from kernels.formats.int4 import dequantize_int4
from schemas.backend import Event, Finish, Usage
from tests.backend.server_checkpoints import TENANT, served

FAMILY = {"kimi-k2.6": "kimi", "glm-5.2": "glm"}


def published(kind: str) -> dict:  # type: ignore[type-arg]
    return dict(json.loads((PUBLISHED_CONFIGS / kind / "config.json").read_text()))


@pytest.mark.parametrize(
    ("kind", "layers", "experts", "dense"), [("kimi-k2.6", 2, 384, 1), ("glm-5.2", 4, 256, 3)]
)
def test_the_full_geometry_keeps_every_published_shape_but_the_depth(
    kind: str, layers: int, experts: int, dense: int
) -> None:
    full = published(kind)
    raw = rg.truncated_config(full, layers)
    text, full_text = text_config(raw), text_config(full)
    assert text["num_hidden_layers"] == layers and text["num_nextn_predict_layers"] == 0
    for key in (
        "hidden_size",
        "vocab_size",
        "n_routed_experts",
        "moe_intermediate_size",
        "num_attention_heads",
    ):
        assert text[key] == full_text[key]
    scheme = rg.scheme_of(raw)
    assert (scheme.method, scheme.group_size) == ("int4", 32)
    if kind == "kimi-k2.6":  # the block Kimi K2.6 ships, not one of Kumo's
        assert raw["quantization_config"] == full["quantization_config"]
    planned = rg.planned_tensors(raw, scheme)
    quantized = [spec.name for spec, parts in planned if len(parts) == 3]
    assert len(quantized) == 3 * experts * (
        layers - dense
    )  # every routed expert's three Linears, nothing else
    assert all(".mlp.experts." in name for name in quantized)
    packed = next(parts[0] for spec, parts in planned if len(parts) == 3)
    h, i = full_text["hidden_size"], full_text["moe_intermediate_size"]
    assert packed[1:] == (torch.int32, (i, h // 8))  # gate_proj [I, H]: 8 nibbles a word
    with pytest.raises(ValueError, match="layers"):
        rg.truncated_config(full, full_text["num_hidden_layers"] + 1)


@pytest.mark.parametrize("kind", list(FAMILY))
async def test_a_small_one_loads_back_value_for_value_and_serves(tmp_path: Path, kind: str) -> None:
    """The same writer on the small shapes (a CPU runs them): the loader's INT4 experts dequantize to
    what the file's words and scales say, the BF16 tensors are the file's, and a backend generates."""
    raw = rg.truncated_config(small_config(published(kind), vocab_size=2048, bos=None, eos=[]), 2)
    if "vision_config" in raw:  # the small config sets the projector's width at the top level only
        raw["vision_config"]["projection_hidden_size"] = raw["projection_hidden_size"]
    path = tmp_path / kind
    path.mkdir()
    report = rg.write_random_geometry(raw, path, family=FAMILY[kind], seed=3)  # type: ignore[arg-type]
    on_disk = dict(iter_tensors(path))
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(on_disk) and report["tensors"] == len(on_disk)
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in on_disk.values())

    loaded = load_model(path, dtype=torch.float32)
    experts = next(m for m in loaded.model.modules() if isinstance(m, QuantExperts))
    prefix = next(n for n in on_disk if ".mlp.experts.1.down_proj." in n).split("experts.1.")[0]
    hidden, inter = experts.hidden, experts.intermediate
    gate_up, down = experts.expert_weights(1, torch.float32)
    file_down = dequantize_int4(
        on_disk[f"{prefix}experts.1.down_proj.weight_packed"], on_disk[f"{prefix}experts.1.down_proj.weight_scale"],
        inter, 32, torch.float32,
    )  # fmt: skip
    file_up = dequantize_int4(
        on_disk[f"{prefix}experts.1.up_proj.weight_packed"], on_disk[f"{prefix}experts.1.up_proj.weight_scale"],
        hidden, 32, torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(down, file_down, rtol=0, atol=0)
    torch.testing.assert_close(gate_up[inter:], file_up, rtol=0, atol=0)
    assert 0.015 < float(down.std()) < 0.025  # the INT4 weights have the Linears' std
    embed_name = next(n for n in on_disk if n.endswith("model.embed_tokens.weight"))
    state = loaded.model.state_dict()
    embed = next(v for k, v in state.items() if k.endswith("embed_tokens.weight"))
    torch.testing.assert_close(embed, on_disk[embed_name].float(), rtol=0, atol=0)
    norms = [t for n, t in on_disk.items() if n.endswith("input_layernorm.weight")]
    assert norms and all(bool((t == 1).all()) for t in norms)

    async with served(path) as client:
        response = await client.post(
            "/v1/generate",
            json={"request_id": "r", "tenant_salt": TENANT, "messages": [{"role": "user", "content": "Hi"}],
                  "sampling": {"max_tokens": 3, "temperature": 0.0}},
        )  # fmt: skip
        events = [msgspec.json.decode(line, type=Event) for line in response.text.splitlines()]
        assert isinstance(events[-2], Usage) and events[-2].completion_tokens == 3
        assert isinstance(events[-1], Finish) and events[-1].reason == "length"


def test_the_command_line_writes_the_folder_whole_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        rg.make_random_geometry("llama", tmp_path / "x", num_layers=1)
    (tmp_path / "there").mkdir()
    with pytest.raises(FileExistsError):
        rg.make_random_geometry("glm-5.2", tmp_path / "there", num_layers=1)
