"""FP8 KV-cache scales: calibrated by `kumo quantize`, stored with vLLM's names, read back by the
loader and the engine, calibrated with a warning when a checkpoint ships none."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from backend.engine.prompt_runner import PromptRunner
from backend.errors import CheckpointError
from backend.models.checkpoint import INDEX_FILE
from backend.models.loader import load_model, prepare_model
from backend.quant import kv_scales
from backend.tools.quantize import main
from tests.backend.quant_helpers import IDS, logits, make_src, rel, top1
from tests.backend.tiny_checkpoints import make_tiny


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_src(tmp_path_factory.mktemp("kimi") / "src")


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
    ref = logits(original)
    fp8 = logits(original, kv_dtype=torch.float8_e4m3fn, scales=scales)
    ones = logits(original, kv_dtype=torch.float8_e4m3fn, scales=[{"latent": 1.0} for _ in scales])
    assert rel(ref, fp8) < 0.02 and top1(ref, fp8) >= 0.95
    assert rel(ref, fp8) < rel(ref, ones)


def test_serving_fp8_without_scales_calibrates_and_warns(src: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = load_model(src, dtype=torch.float32).model
    with caplog.at_level(logging.WARNING, logger="backend.quant.kv_scales"):
        scales = kv_scales.scales_for_serving(src, model, model_dtype=torch.float32, vocab_size=256)
    assert any(
        str(src) in r.getMessage() and "no FP8 KV-cache scales" in r.getMessage() for r in caplog.records
    )
    assert len(scales) == 3 and all(s["latent"] != 1.0 for s in scales)


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
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from tests.backend.engine_helpers import request, run_all

    dst = tmp_path / "int4"
    main([str(src), str(dst), "--weights", "int4-g32", "--kv-scales"])
    loaded = load_model(dst, dtype=torch.float32)
    config = EngineConfig.build(
        num_pages=32, max_num_batched_tokens=16, max_num_seqs=4, kv_dtype="float8_e4m3fn"
    )
    engine = Engine.from_prepared(prepare_model(loaded, config), config)
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


def _scales_in_a_weight_shard(src: Path, dst: Path, rename: dict[str, str] | None = None) -> list[list[str]]:
    """`dst`: `src` with calibrated scales stored as vLLM / llm-compressor checkpoints store them, in
    a shard of the weights listed by the index (no kv_scales.safetensors); returns the cache specs."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    model = load_model(src, dtype=torch.float32).model
    specs = [[s.name for s in layer] for layer in model.cache_specs()]
    kv_scales.save(dst, kv_scales.calibrate(model, [IDS], model_dtype=torch.float32))
    with safe_open(str(dst / kv_scales.KV_SCALE_FILE), framework="pt") as f:
        tensors = {(rename or {}).get(k, k): f.get_tensor(k).reshape(1) for k in f.keys()}  # noqa: SIM118
    (dst / kv_scales.KV_SCALE_FILE).unlink()
    save_file(tensors, str(dst / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = json.loads((dst / INDEX_FILE).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != kv_scales.KV_SCALE_FILE} | {
        k: "model-00002-of-00002.safetensors" for k in tensors
    }
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return specs


def test_scales_stored_in_the_weight_shards_are_read(
    src: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint that carries `self_attn.k_scale` in its own shards (vLLM's and llm-compressor's
    storage) was recalibrated with a warning that it shipped none, its scales dropped."""
    dst = tmp_path / "shipped"
    specs = _scales_in_a_weight_shard(src, dst)
    stored = kv_scales.read(dst, specs)
    assert stored is not None and all(0 < layer["latent"] < 1 for layer in stored)
    model = load_model(dst, dtype=torch.float32).model
    with caplog.at_level(logging.WARNING, logger="backend.quant.kv_scales"):
        served = kv_scales.scales_for_serving(dst, model, model_dtype=torch.float32, vocab_size=256)
    assert not caplog.records and served == stored


def test_legacy_kv_scale_name_stands_for_both(src: Path, tmp_path: Path) -> None:
    model = load_model(src, dtype=torch.float32).model
    names = {f"model.layers.{i}.self_attn.k_scale": f"model.layers.{i}.self_attn.kv_scale" for i in range(3)}
    names |= {
        f"model.layers.{i}.self_attn.v_scale": f"model.layers.{i}.self_attn.v_scale_unused" for i in range(3)
    }
    specs = _scales_in_a_weight_shard(src, tmp_path / "legacy", names)
    stored = kv_scales.read(tmp_path / "legacy", specs)
    assert stored is not None and len(stored) == len(model.cache_specs())
    assert all(0 < layer["latent"] < 1 for layer in stored)


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -1.0])
def test_a_stored_scale_that_is_not_positive_and_finite_is_refused(
    src: Path, tmp_path: Path, bad: float
) -> None:
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    model = load_model(src, dtype=torch.float32).model
    specs = [[s.name for s in layer] for layer in model.cache_specs()]
    scales = kv_scales.calibrate(model, [IDS], model_dtype=torch.float32)
    scales[1]["latent"] = bad
    kv_scales.save(dst, scales)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_scale"):
        kv_scales.read(dst, specs)


def test_a_stale_scale_file_from_an_earlier_run_is_not_read(src: Path, tmp_path: Path) -> None:
    """Re-running `kumo quantize` into the same folder without --kv-scales left the first run's
    kv_scales.safetensors beside an index that no longer lists it, and serving used those scales."""
    dst = tmp_path / "q"
    main([str(src), str(dst), "--weights", "int4-g32", "--kv-scales"])
    main([str(src), str(dst), "--weights", "fp8-channel"])
    assert kv_scales.KV_SCALE_FILE not in json.loads((dst / INDEX_FILE).read_text())["weight_map"].values()
    model = load_model(dst, dtype=torch.float32).model
    assert kv_scales.read(dst, [[s.name for s in layer] for layer in model.cache_specs()]) is None


def test_an_empty_calibration_prompt_is_skipped(src: Path) -> None:
    """A prompt-file line whose tokens all fall outside the vocabulary left an empty prompt, and
    the runner died on torch.cat of nothing."""
    model = load_model(src, dtype=torch.float32).model
    assert kv_scales.calibrate(model, [[], IDS], model_dtype=torch.float32) == kv_scales.calibrate(
        model, [IDS], model_dtype=torch.float32
    )
    with pytest.raises(ValueError, match="at least one"):
        kv_scales.calibrate(model, [[]], model_dtype=torch.float32)


def test_calibration_prompt_file_lines(tmp_path: Path) -> None:
    """JSONL lines give their `text`; any other line, JSON-looking or broken, is itself the text
    (a JSON line without `text` was dropped silently, a line starting with `{` that is no JSON raised)."""
    from backend.tools.quantize import read_prompts

    f = tmp_path / "p.txt"
    f.write_text('{"text": "hello"}\n\n{"name": "get_weather"}\n{not json\nplain words\n')
    assert read_prompts(f) == ["hello", '{"name": "get_weather"}', "{not json", "plain words"]


def test_saved_scales_keep_the_index_total_size_right(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    main([str(src), str(dst), "--weights", "int4-g32"])
    before = json.loads((dst / INDEX_FILE).read_text())["metadata"]["total_size"]
    scales = [{"latent": 0.01}] * 3
    for _ in range(2):  # saving again replaces, never double counts
        kv_scales.save(dst, scales)
        index = json.loads((dst / INDEX_FILE).read_text())
        assert index["metadata"]["total_size"] == before + 6 * 4  # 3 layers × k_scale, v_scale × fp32
        assert sum(v == kv_scales.KV_SCALE_FILE for v in index["weight_map"].values()) == 6


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_mtp_layers_get_measured_fp8_scales_and_speculate_with_fp8_kv(arch: str, tmp_path: Path) -> None:
    """Calibration runs the MTP layer as speculation's propose step does (the target's hidden state
    at p and token p + 1; after the prompt the target's greedy token): its slot's scales are the
    amax of what a paged run of that step writes / 448 (computed here without PromptRunner); then
    greedy decoding with an FP8 cache and 3 drafts gives the tokens that FP8 decoding without drafts gives."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from tests.backend.engine_helpers import request, run_all
    from tests.backend.paged_driver import PagedDriver, Seq
    from tests.backend.tiny_checkpoints import add_mtp_layers

    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, num_mtp_layers=1).model
    n = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist() for length in (9, 40, 23)
    ]
    scales = kv_scales.calibrate(model, prompts, model_dtype=torch.float32)
    assert len(scales) == n + 1
    expected: dict[str, float] = {}
    with torch.no_grad():
        for ids in prompts:
            driver = PagedDriver(model, page_size=16, num_pages=8)
            logits, h = model.forward_spec(driver.batch([Seq(tokens=list(ids))], [len(ids)]))
            after = [*ids[1:], int(logits[-1].argmax())]
            model.forward_mtp(driver.batch([Seq(tokens=after)], [len(ids)]), h, 0)
            for name, t in driver.kv.layers[n].items():
                # the draft batch's sequence took the pages after the target's
                pages = -(-len(ids) // 16)
                written = t[pages : 2 * pages].flatten(0, 1)[: len(ids)]
                expected[name] = max(expected.get(name, 0.0), float(written.float().abs().amax()) / 448)
    assert scales[n].keys() == expected.keys()
    for name, value in expected.items():
        assert value > 1e-6
        assert scales[n][name] == pytest.approx(value, rel=1e-6), name
    config = dict(
        num_pages=96, page_size=8, max_num_batched_tokens=64, max_num_seqs=8, kv_dtype="float8_e4m3fn"
    )
    runs = {}
    for k in (0, 3):
        engine_config = EngineConfig.build(  # always k drafts: this checks exactness while drafting
            **config, num_speculative_tokens=k, speculative_max_seqs=8, speculative_adaptive=False
        )
        loaded = load_model(path, dtype=torch.float32, num_mtp_layers=1)
        engine = Engine.from_prepared(prepare_model(loaded, engine_config), engine_config)
        reqs = [request(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
        runs[k] = run_all(engine, reqs)
        if k:
            assert engine.stats.spec_verifies > 0
    for rid, result in runs[3].items():
        assert result.error is None
        assert result.token_ids == runs[0][rid].token_ids, rid


def test_quantize_stores_the_mtp_layers_scales(tmp_path: Path) -> None:
    """`kumo quantize --kv-scales` (what `kumo serve` runs on the nano models) calibrates the MTP
    layers' slots too: the converted checkpoint serves speculation with an FP8 cache from stored
    scales, and without speculation reads the target's alone."""
    from tests.backend.tiny_checkpoints import add_mtp_layers

    src = add_mtp_layers(make_tiny("glm_moe_dsa", tmp_path / "src"))
    dst = tmp_path / "int4"
    main([str(src), str(dst), "--weights", "int4-g32", "--kv-scales"])
    with_mtp = load_model(dst, dtype=torch.float32, num_mtp_layers=1).model
    n = with_mtp.config.num_hidden_layers
    stored = kv_scales.read(dst, [[s.name for s in layer] for layer in with_mtp.cache_specs()])
    assert stored is not None and len(stored) == n + 1
    reference = kv_scales.calibrate(
        load_model(src, dtype=torch.float32, num_mtp_layers=1).model,
        kv_scales.builtin_prompt_ids(src, with_mtp.config.vocab_size),
        model_dtype=torch.float32,
    )
    assert stored[n] == pytest.approx(reference[n], rel=1e-6)
    plain = load_model(dst, dtype=torch.float32).model
    assert kv_scales.read(dst, [[s.name for s in layer] for layer in plain.cache_specs()]) == stored[:n]
