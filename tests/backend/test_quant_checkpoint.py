"""`kumo quantize` end to end on tiny checkpoints: what it writes, what the loader makes of it, and
how close the quantized model stays to the original.

Tolerances, on the tiny random Kimi-K2-shaped model (initializer 0.02, 40 random tokens, logits at
every position; relative L2 error, top-1 agreement): BF16 weights alone give 0.7% / 100%, which is
the noise floor of this model. Measured: INT4 g32 routed experts 2.7% / 97.5%; INT4 --all-linear
16% / 82% (random Gaussian weights lose ~8% per weight at 4 bits, and 3 layers compound it);
FP8 KV with calibrated scales 1.3%, with scale 1.0 2.4%.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from backend.checkpoint import INDEX_FILE
from backend.errors import CheckpointError
from backend.loader import load_model
from backend.quant import kv_scales
from backend.quant.cli import REPORT_FILE, main
from backend.quant.experts import QuantExperts
from backend.quant.int4 import dequantize_int4
from backend.quant.prompt_runner import PromptRunner
from backend.quant.scheme import QuantScheme
from backend.quant.walker import quantize_model
from tests.backend.tiny_checkpoints import make_tiny

ROOT = Path(__file__).resolve().parents[2]
IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny("kimi_k2", tmp_path_factory.mktemp("kimi") / "src", initializer_range=0.02)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def _logits(path_or_model: Path | torch.nn.Module, **kw: object) -> torch.Tensor:
    model = (
        load_model(path_or_model, dtype=torch.float32).model
        if isinstance(path_or_model, Path)
        else path_or_model
    )
    return PromptRunner(model, model_dtype=torch.float32, **kw).logits(IDS)  # type: ignore[arg-type]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())


def _top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def test_int4_routed_experts_checkpoint(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "int4"
    assert main([str(src), str(dst), "--weights", "int4-g32"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert (dst / "tokenizer_config.json").exists() and (dst / "generation_config.json").exists()
    index = json.loads((dst / INDEX_FILE).read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in index
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in index
    assert "model.layers.1.self_attn.o_proj.weight" in index and "model.layers.1.mlp.gate.weight" in index

    loaded = load_model(dst, dtype=torch.float32)
    assert isinstance(loaded.model.model.layers[1].mlp.experts, QuantExperts)
    ref, out = _logits(src), _logits(loaded.model)
    assert _rel(ref, out) < 0.05 and _top1(ref, out) >= 0.9

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
    from_disk = _logits(tmp_path / "dst")
    method = {"int4-g32": "int4", "fp8-block": "fp8-block", "fp8-channel": "fp8-channel"}[weights]
    model = load_model(src, dtype=torch.float32).model
    quantize_model(model, QuantScheme.build(method, all_linear=True))  # type: ignore[arg-type]
    assert torch.equal(from_disk, _logits(model))
    ref = _logits(src)
    assert 0 < _rel(ref, from_disk) < 0.3


def test_fp8_kv_scales_calibrated_stored_and_better_than_one(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "kv"
    assert main(["--src", str(src), "--dst", str(dst), "--scheme", "int4", "--kv-scales"]) == 0
    with safe_open(str(dst / kv_scales.KV_SCALE_FILE), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"} <= names
    assert "model.layers.0.self_attn.k_scale" in json.loads((dst / INDEX_FILE).read_text())["weight_map"]
    assert (
        json.loads((dst / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"]
        == 8
    )
    model = load_model(dst, dtype=torch.float32).model  # the scales do not disturb weight loading
    scales = kv_scales.read(dst, [[s.name for s in layer] for layer in model.cache_specs()])
    assert scales is not None and all(0 < layer["latent"] < 1 for layer in scales)

    original = load_model(src, dtype=torch.float32).model
    ref = _logits(original)
    fp8 = _logits(original, kv_dtype=torch.float8_e4m3fn, scales=scales)
    ones = _logits(original, kv_dtype=torch.float8_e4m3fn, scales=[{"latent": 1.0} for _ in scales])
    assert _rel(ref, fp8) < 0.02 and _top1(ref, fp8) >= 0.95
    assert _rel(ref, fp8) < _rel(ref, ones)


def test_serving_fp8_without_scales_calibrates_and_warns(src: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = load_model(src, dtype=torch.float32).model
    with caplog.at_level(logging.WARNING, logger="backend.quant.kv_scales"):
        scales = kv_scales.scales_for_serving(src, model, model_dtype=torch.float32, vocab_size=256)
    assert any(
        str(src) in r.getMessage() and "no FP8 KV-cache scales" in r.getMessage() for r in caplog.records
    )
    assert len(scales) == 3 and all(s["latent"] != 1.0 for s in scales)


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
            "import resource, sys, torch, safetensors.torch, tqdm; from backend.quant.cli import main; "
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


@pytest.mark.parametrize(
    ("arch", "names"),
    [("glm_moe_dsa", {"latent", "index_k"}), ("glm4_moe", {"k", "v"})],
)
def test_kv_scales_per_cached_tensor_with_vllm_names(arch: str, names: set[str], tmp_path: Path) -> None:
    """DSA index keys get their own scale beside the MLA latent (layers that reuse another layer's
    indexer cache none); GQA gets one for K and one for V."""
    src = make_tiny(arch, tmp_path / "src", initializer_range=0.02)
    model = load_model(src, dtype=torch.float32).model
    scales = kv_scales.calibrate(model, [IDS], model_dtype=torch.float32)
    assert set(scales[0]) == names and all(set(layer) <= names for layer in scales)
    runner = PromptRunner(model, model_dtype=torch.float32)
    runner.logits(IDS)
    amax = runner.cache_amax(len(IDS))
    for layer, seen in zip(scales, amax, strict=True):
        for name in layer:  # the calibration set's extreme maps exactly onto e4m3's 448
            assert layer[name] * 448 == pytest.approx(seen[name], rel=1e-6)
    kv_scales.save(src, scales)
    with safe_open(str(src / kv_scales.KV_SCALE_FILE), framework="pt") as f:
        stored = set(f.keys())
    expected = {
        "index_k": "self_attn.indexer.k_scale",
        "latent": "self_attn.v_scale",
        "k": "self_attn.k_scale",
        "v": "self_attn.v_scale",
    }
    assert {f"model.layers.0.{expected[n]}" for n in names} <= stored
    specs = [[s.name for s in layer] for layer in model.cache_specs()]
    assert kv_scales.read(src, specs) == [{n: pytest.approx(v) for n, v in layer.items()} for layer in scales]
    load_model(src, dtype=torch.float32)  # the index now lists the scales; loading still works


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
    ref, via_fp8 = _logits(src), _logits(dst)
    print(f"FP8 -> INT4 experts: rel {_rel(ref, via_fp8):.4f}, top-1 {_top1(ref, via_fp8):.3f}")
    assert _rel(ref, via_fp8) < 0.06 and _top1(ref, via_fp8) >= 0.9
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


def test_k25_layout_scales_carry_the_language_model_prefix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = make_tiny("kimi_k25", tmp_path / "src", initializer_range=0.02)
    dst = tmp_path / "int4"
    main([str(src), str(dst), "--weights", "int4-g32", "--kv-scales"])
    with safe_open(str(dst / kv_scales.KV_SCALE_FILE), framework="pt") as f:
        assert "language_model.model.layers.0.self_attn.k_scale" in set(f.keys())
    model = load_model(dst, dtype=torch.float32).model
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="backend.quant.kv_scales"):
        scales = kv_scales.scales_for_serving(dst, model, model_dtype=torch.float32, vocab_size=256)
    assert not caplog.records and len(scales) == 3  # read back, not recalibrated


def test_quantized_checkpoint_serves_through_the_engine_with_fp8_kv(src: Path, tmp_path: Path) -> None:
    """The engine (paged batches, chunked prefill, FP8 cache with the stored scales) decodes what the
    prompt runner decodes from the same INT4 checkpoint."""
    from backend.engine import Engine
    from backend.engine_config import EngineConfig
    from tests.backend.engine_helpers import request, run_all

    dst = tmp_path / "int4"
    main([str(src), str(dst), "--weights", "int4-g32", "--kv-scales"])
    loaded = load_model(dst, dtype=torch.float32)
    config = EngineConfig.build(
        num_pages=32, max_num_batched_tokens=16, max_num_seqs=4, kv_dtype="float8_e4m3fn"
    )
    engine = Engine.from_loaded(loaded, config)
    prompts = [IDS[:20], IDS[5:33]]
    results = run_all(
        engine, [request(f"r{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
    )
    scales = kv_scales.read(dst, [[s.name for s in layer] for layer in loaded.model.cache_specs()])
    for i, p in enumerate(prompts):
        runner = PromptRunner(
            loaded.model, model_dtype=torch.float32, kv_dtype=torch.float8_e4m3fn, scales=scales
        )
        assert results[f"r{i}"].token_ids == runner.greedy(p, 6)


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
    full = load_model(dst, dtype=torch.float32).model
    ranks = [load_model(dst, dtype=torch.float32, rank=r, world_size=2).model for r in (0, 1)]
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
    with pytest.raises(CheckpointError, match="split a group of 32"):
        load_model(tmp_path / "q", dtype=torch.float32, rank=0, world_size=2)


def test_kv_calibrate_from_a_prompt_file(src: Path, tmp_path: Path) -> None:
    """`--kv-calibrate FILE` tokenizes the operator's prompts (plain lines or JSONL `text`) with the
    checkpoint's tokenizer; the scales are those prompts' amax / 448."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.save(str(folder / "tokenizer.json"))
    lines = ["The cache holds keys and values.", json.dumps({"text": "def f(x): return x * 2"})]
    (tmp_path / "prompts.txt").write_text("\n".join(lines))
    dst = tmp_path / "q"
    assert (
        main(
            [str(folder), str(dst), "--weights", "int4-g32", "--kv-calibrate", str(tmp_path / "prompts.txt")]
        )
        == 0
    )
    model = load_model(folder, dtype=torch.float32).model
    stored = kv_scales.read(dst, [[s.name for s in layer] for layer in model.cache_specs()])
    ids = [tok.encode(t).ids for t in ("The cache holds keys and values.", "def f(x): return x * 2")]
    expected = kv_scales.calibrate(model, ids, model_dtype=torch.float32)
    assert stored == [{k: pytest.approx(v) for k, v in layer.items()} for layer in expected]
