"""`kumo quantize` end to end on tiny checkpoints: what it writes, what the loader makes of it, and
how close the quantized model stays to the original (tolerances: tests/backend/quant_helpers.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from backend.errors import CheckpointError
from backend.models.checkpoint import INDEX_FILE
from backend.models.loader import load_model
from backend.quant.experts import QuantExperts
from backend.quant.scheme import QuantScheme
from backend.quant.walker import quantize_model
from backend.tools.quantize import REPORT_FILE, main
from kernels.formats.int4 import dequantize_int4
from tests.backend.quant_helpers import logits, make_src, rel, top1
from tests.backend.tiny_checkpoints import make_tiny

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_src(tmp_path_factory.mktemp("kimi") / "src")


def test_int4_routed_experts_checkpoint(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "int4"
    assert main([str(src), str(dst), "--weights", "int4-g32"]) == 0
    config = json.loads((dst / "config.json").read_text())
    block = config["quantization_config"]
    assert block["format"] == "pack-quantized" and block["quant_method"] == "compressed-tensors"
    (group,) = block["config_groups"].values()  # Kimi K2 Thinking's block (engine-anchors §1f)
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")} == {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, "dynamic": False
    }  # fmt: skip
    assert block["ignore"][:4] == [
        "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"
    ]  # fmt: skip
    assert block["kv_cache_scheme"] is None
    assert (dst / "tokenizer_config.json").exists() and (dst / "generation_config.json").exists()
    full_index = json.loads((dst / INDEX_FILE).read_text())
    index = full_index["weight_map"]
    on_disk = load_file(str(dst / "model.safetensors"))
    assert set(index) == set(on_disk) and set(index.values()) == {"model.safetensors"}
    assert full_index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in on_disk.values())
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in index
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in index
    assert "model.layers.1.self_attn.o_proj.weight" in index and "model.layers.1.mlp.gate.weight" in index

    loaded = load_model(dst, dtype=torch.float32)
    assert isinstance(loaded.model.model.layers[1].mlp.experts, QuantExperts)
    ref, out = logits(src), logits(loaded.model)
    assert rel(ref, out) < 0.05 and top1(ref, out) >= 0.9

    report = json.loads((dst / REPORT_FILE).read_text())
    assert report["classes"]["routed_experts"]["num_quantized"] == 2 * 8 * 3
    assert report["classes"]["attention"]["num_quantized"] == 0
    assert report["dest_bytes"] == sum(c["dest_bytes"] for c in report["classes"].values())
    # fp32 experts [32, 64] at g32 → 4 bits + a bf16 scale per 32 = 4.5 bits of 32
    experts = report["classes"]["routed_experts"]
    assert experts["dest_bytes"] / experts["source_bytes"] == pytest.approx(4.5 / 32, rel=0.02)


def test_written_int4_tensors_decompress_with_compressed_tensors(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "int4"
    main([str(src), str(dst), "--weights", "int4-g32"])
    out = load_file(str(dst / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    for proj in ("gate_proj", "down_proj"):
        p = f"model.layers.2.mlp.experts.5.{proj}"
        state = {k: out[f"{p}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        theirs = PackedQuantizationCompressor.decompress(
            state, QuantizationScheme(targets=["Linear"], weights=args)
        )["weight"]
        n, k = state["weight_shape"].tolist()
        assert torch.equal(dequantize_int4(state["weight_packed"], state["weight_scale"], k), theirs)
        step = state["weight_scale"].float().repeat_interleave(32, 1)
        ours = dequantize_int4(state["weight_packed"], state["weight_scale"], k, dtype=torch.float32)
        assert bool(((ours - original[f"{p}.weight"]).abs() <= step * 0.53).all())


@pytest.mark.parametrize(
    ("arch", "weights"), [("glm_moe_dsa", "int4-g32"), ("glm4_moe", "fp8-block"), ("kimi_k2", "fp8-channel")]
)
def test_checkpoint_on_disk_equals_quantizing_in_memory(arch: str, weights: str, tmp_path: Path) -> None:
    """Every architecture, --all-linear: loading the written checkpoint gives the very model that
    quantizing the float model in memory gives (the loader puts every tensor where it belongs)."""
    src = make_tiny(arch, tmp_path / "src", initializer_range=0.02)
    main([str(src), str(tmp_path / "dst"), "--weights", weights, "--all-linear"])
    from_disk = logits(tmp_path / "dst")
    method = {"int4-g32": "int4", "fp8-block": "fp8-block", "fp8-channel": "fp8-channel"}[weights]
    model = load_model(src, dtype=torch.float32, fuse_projections=False).model  # as quantized: unfused
    quantize_model(model, QuantScheme.build(method, all_linear=True))  # type: ignore[arg-type]
    assert torch.equal(from_disk, logits(model))
    ref = logits(src)
    assert 0 < rel(ref, from_disk) < 0.3


def test_streaming_peak_memory_is_about_one_shard(tmp_path: Path) -> None:
    """A 4-shard, 96 MB checkpoint converts with peak RSS <= baseline + 1.5 x the largest shard."""
    src, num_shards, per_shard = tmp_path / "src", 4, 24
    src.mkdir()
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    for s in range(num_shards):
        tensors = {
            f"model.layers.{s}.mlp.experts.{e}.gate_proj.weight": torch.randn(256, 1024, generator=g)
            for e in range(per_shard)
        }  # 1 MiB each
        name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(src / name))
        weight_map.update({k: name for k in tensors})
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    shard_bytes = max(f.stat().st_size for f in src.glob("*.safetensors"))

    def peak(call: str) -> int:
        code = (
            "import resource, sys, torch, safetensors.torch, tqdm; from backend.tools.quantize import main; "
            f"{call}; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
        )
        res = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        return int(res.stdout.strip().splitlines()[-1]) * 1024

    baseline = peak("torch.randn(256, 1024) @ torch.randn(1024, 8)")
    used = peak(f"main(['{src}', '{tmp_path / 'dst'}', '--weights', 'int4-g32'])") - baseline
    assert len(list((tmp_path / "dst").glob("*.safetensors"))) == num_shards
    print(f"peak over baseline {used / 2**20:.1f} MiB, largest shard {shard_bytes / 2**20:.1f} MiB")
    assert used <= 1.5 * shard_bytes, (
        f"peak {used / 2**20:.1f} MiB over baseline, shard {shard_bytes / 2**20:.1f} MiB"
    )
    # the index lists every written tensor in the shard that holds it, and their total size
    from safetensors import safe_open

    index = json.loads((tmp_path / "dst" / INDEX_FILE).read_text())
    held, total = {}, 0
    for shard in sorted((tmp_path / "dst").glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                held[k] = shard.name
                t = f.get_slice(k)
                total += math.prod(t.get_shape()) * {"I32": 4, "BF16": 2, "F32": 4}[t.get_dtype()]
    assert index["weight_map"] == held and index["metadata"]["total_size"] == total


def test_fp8_block_source_converts_to_int4(src: Path, tmp_path: Path) -> None:
    """A DeepSeek/Kimi-K2-Instruct-style FP8 checkpoint is dequantized on the way: experts become
    INT4, everything else BF16, and the model stays as close to the original as FP8 + INT4 allow."""
    fp8 = tmp_path / "fp8"
    main([str(src), str(fp8), "--weights", "fp8-block", "--all-linear"])
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    dst = tmp_path / "int4"
    assert main([str(fp8), str(dst), "--weights", "int4-g32"]) == 0
    out = load_file(str(dst / "model.safetensors"))
    assert not any(k.endswith("weight_scale_inv") for k in out)
    assert out["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.1.mlp.experts.0.up_proj.weight_packed" in out
    ref, via_fp8 = logits(src), logits(dst)
    print(f"FP8 -> INT4 experts: rel {rel(ref, via_fp8):.4f}, top-1 {top1(ref, via_fp8):.3f}")
    assert rel(ref, via_fp8) < 0.06 and top1(ref, via_fp8) >= 0.9
    report = json.loads((dst / REPORT_FILE).read_text())
    assert report["classes"]["routed_experts"]["num_quantized"] == 2 * 8 * 3


class _Allocations(TorchDispatchMode):
    """Shapes of every tensor an aten op creates off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.shapes.add(tuple(out.shape))
        return out


def test_loading_a_quantized_checkpoint_never_allocates_the_dense_experts(src: Path, tmp_path: Path) -> None:
    main([str(src), str(tmp_path / "int4"), "--weights", "int4-g32"])
    dense_gate_up, dense_down = (8, 2 * 32, 64), (8, 64, 32)  # [E, 2I, H], [E, H, I] of the tiny model
    with _Allocations() as seen_dense:
        load_model(src, dtype=torch.float32)
    assert {dense_gate_up, dense_down} <= seen_dense.shapes  # the probe sees the dense build
    with _Allocations() as seen:
        load_model(tmp_path / "int4", dtype=torch.float32)
    assert dense_gate_up not in seen.shapes and dense_down not in seen.shapes
    assert (8, 2 * 32, 64 // 8) in seen.shapes  # gate_up_packed


@pytest.mark.parametrize("weights", ["int4-g32", "fp8-channel"])
def test_tensor_parallel_ranks_hold_their_slices_of_the_quantized_weights(
    weights: str, tmp_path: Path
) -> None:
    """Two ranks' quantized layers, dequantized and put side by side, are the one-rank layer."""
    from backend.quant.linear import Fp8Linear, Int4Linear

    # every row-parallel input (o_proj 4 x 32, MLPs 128 and 64) splits into whole groups of 32
    src = make_tiny(
        "glm4_moe",
        tmp_path / "src",
        initializer_range=0.02,
        head_dim=32,
        intermediate_size=128,
        moe_intermediate_size=64,
    )
    dst = tmp_path / "q"
    main([str(src), str(dst), "--weights", weights, "--all-linear"])
    # the checkpoint's modules (fused ones stack each rank's own rows: no longer slices of one tensor)
    full = load_model(dst, dtype=torch.float32, fuse_projections=False).model
    ranks = [
        load_model(dst, dtype=torch.float32, rank=r, world_size=2, fuse_projections=False).model
        for r in (0, 1)
    ]
    checked = 0
    for name, m in full.named_modules():
        if not isinstance(m, Int4Linear | Fp8Linear):
            continue
        parts = [r.get_submodule(name) for r in ranks]
        dim = 1 if parts[0].is_row_parallel else 0
        if parts[0].out_range == m.out_range and not parts[0].is_row_parallel:
            joined = parts[0].dequantized_weight(torch.float32)  # replicated on every rank
        else:
            joined = torch.cat([p.dequantized_weight(torch.float32) for p in parts], dim=dim)
        assert torch.equal(joined, m.dequantized_weight(torch.float32)), name
        checked += 1
    assert checked > 10
    experts = [r.model.layers[1].mlp.experts for r in ranks]
    assert (experts[0].e0, experts[0].e1, experts[1].e0, experts[1].e1) == (0, 4, 4, 8)
    whole = full.model.layers[1].mlp.experts
    for e in range(8):
        part = experts[e // 4]
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                part.expert_weights(e % 4, torch.float32), whole.expert_weights(e, torch.float32), strict=True
            )
        )


def test_a_rank_split_inside_an_int4_group_is_refused(tmp_path: Path) -> None:
    src = make_tiny("glm4_moe", tmp_path / "src", initializer_range=0.02)  # dense MLP 96: 48 per rank
    main([str(src), str(tmp_path / "q"), "--weights", "int4-g32", "--all-linear"])
    with pytest.raises(
        CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.weight_scale: .*split a group of 32"
    ):
        load_model(tmp_path / "q", dtype=torch.float32, rank=0, world_size=2)


def test_a_quantized_tensor_of_the_wrong_shape_is_named_in_full(src: Path, tmp_path: Path) -> None:
    """The error named only the leaf (`weight_scale: checkpoint shape ...`), not which of the
    model's hundreds of Linears it was."""
    dst = tmp_path / "q"
    main([str(src), str(dst), "--weights", "int4-g32", "--all-linear"])
    shard = next(dst.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}: checkpoint shape"):
        load_model(dst, dtype=torch.float32)


def test_shard_writer_files_read_back_with_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    from backend.tools.shard_writer import ShardWriter

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "a.weight_scale_inv": torch.rand(1, 1, generator=g),
        "b.weight": (torch.randn(3, 9, generator=g) * 50).to(torch.float8_e4m3fn),
        "b.weight_shape": torch.tensor([3, 9], dtype=torch.int32),
        "c.bias": torch.randn(3, generator=g).to(torch.float16),
    }
    writer = ShardWriter(
        tmp_path / "x.safetensors",
        [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
        {"format": "pt"},
    )
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    bad = ShardWriter(tmp_path / "y.safetensors", [("a", torch.float32, (2,))], {})
    with pytest.raises(ValueError, match="expected a"):
        bad.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="never written"):
        bad.close()


def test_quantizing_a_folder_onto_itself_is_refused_and_leaves_it_whole(tmp_path: Path) -> None:
    """dst == src truncated each shard while reading it (safetensors maps the file it opened)."""
    src = make_tiny("glm4_moe", tmp_path / "src", initializer_range=0.02)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for dst in (src, tmp_path / "." / "src"):
        assert main([str(src), str(dst), "--weights", "int4-g32"]) == 2
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_cli_errors_are_one_line_not_a_traceback(
    src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    int4 = tmp_path / "int4"
    assert main([str(src), str(int4), "--weights", "int4-g32"]) == 0
    assert main([str(int4), str(tmp_path / "again"), "--weights", "fp8-channel"]) == 2
    err = capsys.readouterr().err
    assert "kumo quantize: error:" in err and "pack-quantized" in err and "Traceback" not in err
