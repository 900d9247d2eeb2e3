"""The Hugging Face transformers peer on the same truncated geometry: bf16, SDPA, random weights.

Modes, each tried and reported (an error is recorded as that mode's result, never hidden):

    generate          `model.generate`, dynamic cache, SDPA, the batch padded to one length
    generate-static   the same with `cache_implementation="static"` (transformers compiles the decode
                      forward with torch.compile when the cache is static)
    generate_batch    continuous batching (`model.generate_batch`, paged attention), where it exists

For `generate` modes the batch finishes together: TTFT is a `max_new_tokens=1` call on the same
batch, TPOT = (wall − TTFT) / (output − 1). `generate_batch` reports wall-clock throughput only.
A `generate` run that runs out of memory is tried again with transformers' own chunked prefill
(`prefill_chunk_size`, the chunks of PREFILL_CHUNKS in turn): at concurrency 64 on Kimi's 3-layer geometry the
whole batch's prefill asked for 28 GiB more than the H200 had left beside 73 GB of bf16 weights
(2026-12-02). The row records the chunk it ran with and each attempt that ran out of memory. The retry
runs outside the `except` block: inside it the failed attempt's frames still hold their tensors (the
first try at this, 2026-12-02, ran out of memory again with 32 GB of them alive).
Weights: transformers' own initialisation (normal, std `initializer_range` = 0.02), so routing is
near uniform as in Kumo's random models; the tensors themselves are not Kumo's.
"""

from __future__ import annotations

import gc
import inspect
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.engine.geometry import Geometry
from benchmarks.engine.offline import random_prompts

MODES = ("generate", "generate-static", "generate_batch")
PREFILL_CHUNKS = (None, 512, 128)  # None: the whole prefill in one forward
MODEL_TYPES = {"DeepseekV3ForCausalLM": "deepseek_v3", "GlmMoeDsaForCausalLM": "glm_moe_dsa"}


def hf_config(geometry: Geometry) -> Any:
    import transformers

    text = dict(geometry.text)
    model_type = MODEL_TYPES[text["architectures"][0]]
    cls = transformers.AutoConfig.for_model(model_type).__class__
    accepted = set(inspect.signature(cls.__init__).parameters)
    kwargs = {
        k: v for k, v in text.items() if k in accepted and k not in ("architectures", "dtype", "torch_dtype")
    }
    rope = text.get("rope_parameters")
    if rope is None:  # checkpoint-style keys (Kimi): rope_theta + rope_scaling
        rope = {"rope_theta": text.get("rope_theta", 10000.0), "rope_type": "default"}
        scaling = dict(text.get("rope_scaling") or {})
        if scaling:
            rope |= scaling | {"rope_type": scaling.pop("type", scaling.get("rope_type", "yarn"))}
            rope.pop("type", None)
    if "rope_parameters" in accepted:
        kwargs["rope_parameters"] = rope
    kwargs |= {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0, "use_cache": True}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def build_hf_model(geometry: Geometry, device: str) -> Any:
    import transformers

    config = hf_config(geometry)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def _generate(
    model: Any, ids: torch.Tensor, new: int, static: bool, prefill_chunk: int | None = None
) -> torch.Tensor:
    kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    if prefill_chunk is not None:
        kwargs["prefill_chunk_size"] = prefill_chunk
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_mode(
    model: Any,
    mode: str,
    *,
    concurrency: int,
    input_len: int,
    output_len: int,
    vocab: int,
    device: str,
    first_chunk: int | None = None,
) -> dict[str, Any]:
    """One timed run of `mode`. `first_chunk`: the prefill chunk to try first (a repeat of a run that
    ran out of memory with a larger one starts where that run succeeded)."""
    prompts = random_prompts(concurrency, input_len, vocab, seed=1)
    row: dict[str, Any] = {
        "mode": mode,
        "concurrency": concurrency,
        "input_len": input_len,
        "output_len": output_len,
    }
    if mode == "generate_batch":
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        cb: dict[str, Any] = {}
        if device == "cpu":  # transformers would size its cache to 60% of the RAM: size it to the batch
            from transformers import ContinuousBatchingConfig

            blocks = concurrency * -(-(input_len + output_len) // ContinuousBatchingConfig.page_size)
            cb["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=2 * blocks)
        _sync(device)
        t0 = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config, **cb)
        _sync(device)
        wall = time.perf_counter() - t0
        errors = {str(o.error) for o in outputs.values() if getattr(o, "error", None)}
        if errors:  # failed requests come back with an error, not an exception
            raise RuntimeError(f"generate_batch requests failed: {sorted(errors)[0]}")
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        return row | {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}
    ids = torch.tensor(prompts, device=device)
    static = mode == "generate-static"
    timing, chunk = None, None
    # the whole prefill at once first, then transformers' own chunking
    for chunk in PREFILL_CHUNKS[PREFILL_CHUNKS.index(first_chunk) :]:
        oom = None
        try:
            timing = _timed_generate(model, ids, output_len, static, device, chunk)
        except torch.OutOfMemoryError as exc:
            oom = f"prefill_chunk_size={chunk}: {str(exc)[:160]}"
        if timing is not None:
            break
        # outside the except block: the failed attempt's frames (and their tensors) are gone only now
        row.setdefault("out_of_memory", []).append(oom)
        _free()
    if timing is None:
        raise torch.OutOfMemoryError("; ".join(row["out_of_memory"]))
    ttft, wall = timing
    if chunk is not None:
        row["prefill_chunk_size"] = chunk
    tpot = (wall - ttft) / max(output_len - 1, 1)
    tokens = concurrency * output_len
    return row | {
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "output_tok_s_per_user": 1.0 / tpot if tpot > 0 else None,
        "ttft_ms_p50": ttft * 1e3,
        "tpot_ms_p50": tpot * 1e3,
    }


def _timed_generate(
    model: Any, ids: torch.Tensor, output_len: int, static: bool, device: str, prefill_chunk: int | None
) -> tuple[float, float]:
    """(TTFT, wall) in seconds: a one-token call, then the whole generation, on the same batch."""
    _sync(device)
    t0 = time.perf_counter()
    _generate(model, ids, 1, static, prefill_chunk)
    _sync(device)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    _generate(model, ids, output_len, static, prefill_chunk)
    _sync(device)
    return ttft, time.perf_counter() - t0


def measure_transformers(
    geometry: Geometry,
    *,
    device: str,
    concurrencies: tuple[int, ...],
    input_len: int,
    output_len: int,
    modes: tuple[str, ...],
    deadline: float,
    on_mode: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every mode at every concurrency while time remains; errors and skips recorded per mode.

    `on_mode(result so far)` is called after each mode (the caller saves it: a compile that outlasts
    the device call's limit then loses only its own mode)."""
    import transformers

    out: dict[str, Any] = {"transformers_version": transformers.__version__, "modes": {}}
    try:
        model = build_hf_model(geometry, device)
    except Exception as exc:  # the whole peer is unavailable: say why
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    vocab = geometry.model_config.vocab_size
    for mode in modes:
        entry: dict[str, Any] = {"runs": [], "skipped": []}
        out["modes"][mode] = entry
        if mode == "generate_batch" and not hasattr(model, "generate_batch"):
            entry["error"] = f"transformers {transformers.__version__} has no generate_batch"
            continue
        try:
            t0 = time.perf_counter()  # warm-up: compilation and allocation outside the timed runs
            run_mode(
                model,
                mode,
                concurrency=1,
                input_len=min(input_len, 64),
                output_len=4,
                vocab=vocab,
                device=device,
            )
            entry["warmup_s"] = time.perf_counter() - t0
        except Exception as exc:  # the mode does not run here at all
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
            _free()
            if on_mode is not None:
                on_mode(out)
            continue
        for c in concurrencies:
            if time.monotonic() > deadline:
                entry["skipped"].append({"concurrency": c, "why": "command deadline reached before this run"})
                continue
            try:
                entry["runs"].append(
                    run_mode(
                        model,
                        mode,
                        concurrency=c,
                        input_len=input_len,
                        output_len=output_len,
                        vocab=vocab,
                        device=device,
                    )
                )
            except Exception as exc:  # out of memory at this batch, say: recorded, the next one tried
                entry["skipped"].append({"concurrency": c, "why": f"{type(exc).__name__}: {str(exc)[:300]}"})
                _free()
        _free()
        if on_mode is not None:
            on_mode(out)
    del model
    _free()
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
