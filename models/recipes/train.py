"""Train a nano Kimi K2.6-architecture or GLM 5.2-architecture model on the generated mixture.

    python -m models.recipes.train --family kimi --data DATA_DIR --out models/kimi-k2.6-nano

One command, seeded: builds the data if DATA_DIR has none (`models.recipes.build`), trains the
tokenizer on the training mixture (`models.recipes.nano.write_tokenizer`), renders every item with
the checkpoint's own template and tokenizer (`models.recipes.render`: each assistant turn on exactly
the prompt serving sends, loss on the turn only), trains transformers' own model class
(`Kimi_K25ForConditionalGeneration` with MoonViT, `GlmMoeDsaForCausalLM` with the DSA indexer) with
AdamW, linear warmup and cosine decay, in padded length-bucketed batches, bf16 autocast on CUDA; the
routed experts are balanced the DeepSeek-V3 way (the selection bias nudged toward equal load after
each step, no auxiliary loss). Saves the folder in the published layout (`models.recipes.nano`) and
the log beside it (`train.log`). Never imports msgspec (a test checks it): the training machine has none.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TextIO, get_args

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from backend.text.tokenizer_files import Family
from models.recipes.build import TEST_ITEMS, TRAIN_ITEMS, build
from models.recipes.nano import (
    MAX_MODEL_BYTES,
    SIZES,
    build_model,
    parameter_bytes,
    published_config,
    save_checkpoint,
    special_ids,
    write_tokenizer,
)
from models.recipes.render import Example, Renderer

IGNORE = -100
PROBE_STEPS = 20
# Padded lengths are rounded up to this, so a run sees at most max_len / PAD_MULTIPLE sequence lengths.
# The H200 profile of 2026-12-02 (steps 21-23 of the GLM nano, `--profile-steps 3`) had 769 ms of host time
# against 104 ms of GPU time, 459 ms of it inside cuDNN's SDPA forward/backward (18-20 ms a call: an
# execution plan built for each new shape); a batch padded to its own longest item gives nearly every
# batch a new length. The rounding costs at most 63 padded tokens per sequence; and attention runs on the
# flash / memory-efficient kernels, which build no plans (SDPA_BACKENDS). Measure: the log's ms per step.
PAD_MULTIPLE = 64
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MAX_AUTO_STEPS = 1_000_000


class Log:
    """Lines to stdout and to the checkpoint's train.log."""

    def __init__(self, file: TextIO | None) -> None:
        self.file, self.start = file, time.monotonic()

    def __call__(self, line: str) -> None:
        line = f"[{time.monotonic() - self.start:7.1f}s] {line}"
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()


class ExpertBalance:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, each router's selection bias moves
    by `rate` toward the experts chosen less often than average (`e_score_correction_bias`)."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
        self.counts = [torch.zeros_like(r.e_score_correction_bias, dtype=torch.float32) for r in self.routers]
        self.is_real: torch.Tensor | None = None  # [B·L] bool: the batch's tokens that are not padding
        for router, counts in zip(self.routers, self.counts, strict=True):
            router.register_forward_hook(self._hook(counts))

    def _hook(self, counts: torch.Tensor) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, ...]) -> None:
            chosen = output[2]  # [T, k] chosen experts, T = B·L
            # padding (one token repeated up to PAD_MULTIPLE - 1 times a row) would tell every router
            # that its experts are over-used; index_add, not bincount: no host sync on CUDA
            weight = torch.ones_like(chosen, dtype=counts.dtype)
            if self.is_real is not None:
                assert self.is_real.numel() == chosen.shape[0], "the router saw other tokens than the batch's"
                weight = weight * self.is_real[:, None]
            counts.index_add_(0, chosen.flatten(), weight.flatten())

        return hook

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Apply and reset; returns the worst layer's max/mean expert load before the update (a
        device scalar: read it only when logging, so a training step never waits on the GPU)."""
        worst = torch.ones((), device=self.counts[0].device) if self.counts else torch.ones(())
        for router, counts in zip(self.routers, self.counts, strict=True):
            mean = counts.mean()
            worst = torch.maximum(worst, counts.max() / mean.clamp_min(1e-9))
            router.e_score_correction_bias += self.rate * torch.sign(mean - counts)  # all zero: no change
            counts.zero_()
        return worst


class CentredGradients:
    """AdamW on the vision path's inputs as if they were mean-centred: after backward, each chosen layer's
    weight gradient Σ_t g_t x_tᵀ becomes Σ_t g_t (x_t − x̄)ᵀ, with x̄ the mean of the layer's input over
    the step's tokens. The model and its checkpoint stay as they are (the forward is untouched; the
    response to x̄ is left to the bias, whose gradient Σ_t g_t is the subtracted term's factor).

    Why (measured 2026-12-02 on the nano Kimi that answered every colour question alike): the drawings
    are mostly white, so every patch, and after the tower every image token, carries one large shared
    component x̄. At initialisation the rank-one term (Σ_t g_t) x̄ᵀ is 99–102% of the norm of the
    patch embedding's and the projector's weight gradients (the centred part 14–27%) and sets the
    sign of 85–93% of their elements, and AdamW's near-sign steps grow that one direction step after
    step. The trained `in_proj` had singular values 6.15, 1.90, … with the top input direction at
    |cos| 0.82 to x̄, |W x̄| 101 against |W (x − x̄)| 17 (`out_proj`: 169 against 24): a red and a blue
    square came out as parallel vectors (cosine 1.0000 on all 16 tokens, the colour only in the
    length, which the language model's RMSNorm drops), and it answered as with a blank picture.
    Micro Kimi on 4,000 image items, 800 steps, seeds 0–4, one-shape colour questions right out of
    91 held-out drawings: 25, 45, 25, 29, 19 without this; 91, 87, 91, 54, 21 with it (seed 3 at
    1,600 steps: 25 against 83; seed 4 still 35 against 45: its patch embedding dropped hue itself).
    A clear gain in three seeds of five, not a cure. `tests/models/test_train.py::
    test_the_projector_keeps_image_tokens_apart` checks the mechanism."""

    def __init__(self, modules: list[torch.nn.Linear | torch.nn.Conv2d]) -> None:
        self.sums: dict[torch.nn.Linear | torch.nn.Conv2d, tuple[torch.Tensor, int]] = {}
        for m in modules:
            assert m.bias is not None, "the mean response moves to the bias"
            if isinstance(m, torch.nn.Conv2d):  # one output per patch: the identity needs stride = kernel
                assert m.stride == m.kernel_size and m.padding in (0, (0, 0)), m
            m.register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
        if not (module.training and torch.is_grad_enabled()):
            return
        x = args[0].detach()
        if isinstance(module, torch.nn.Conv2d):
            assert tuple(x.shape[-2:]) == tuple(module.kernel_size), "patchified input: one patch per row"
        x = x.reshape(-1, *module.weight.shape[1:]).float()  # one row per token (patch)
        total, count = self.sums.get(module, (torch.zeros_like(x[0]), 0))
        self.sums[module] = (total + x.sum(0), count + x.shape[0])

    @torch.no_grad()
    def apply(self) -> None:
        """Centre the gradients of the last backward (call before clipping)."""
        for m, (total, count) in self.sums.items():
            weight_grad, bias_grad = m.weight.grad, m.bias.grad if m.bias is not None else None
            if weight_grad is not None and bias_grad is not None:
                per_output = bias_grad.reshape(-1, *[1] * (weight_grad.ndim - 1))
                weight_grad -= per_output * (total / count)[None]
        self.sums.clear()


TrainOnly = Literal["all", "vision", "language"]


def freeze_vision(model: torch.nn.Module) -> int:
    """Freeze the vision tower and the projector (none for a text-only model); returns the trained
    parameter count. A stage on the language model that keeps a trained vision path's features as
    they are, while image items in its mixture keep the language model reading them."""
    inner = getattr(model, "model", None)
    for part in (getattr(inner, "vision_tower", None), getattr(inner, "mm_projector", None)):
        if part is not None:
            part.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def freeze_all_but_vision(model: torch.nn.Module) -> int:
    """Freeze everything but the vision tower and the projector; returns the trained parameter count."""
    inner = getattr(model, "model", None)
    parts = [getattr(inner, "vision_tower", None), getattr(inner, "mm_projector", None)]
    if any(p is None for p in parts):
        raise ValueError("a vision stage needs a model with a vision tower and a projector (Kimi)")
    model.requires_grad_(False)
    for part in parts:
        part.requires_grad_(True)  # type: ignore[union-attr]
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def vision_inputs(model: torch.nn.Module) -> list[torch.nn.Linear | torch.nn.Conv2d]:
    """The layers `CentredGradients` centres: the patch embedding and the projector's two linears (Kimi);
    none for a text-only model. (Centring the tower's linears as well did worse: 85, 54, 72 of 91 on
    seeds 0–2; the projector alone: 88, 91, 29.)"""
    inner = getattr(model, "model", None)
    tower, projector = getattr(inner, "vision_tower", None), getattr(inner, "mm_projector", None)
    if tower is None or projector is None:
        return []
    return [tower.patch_embed.proj, projector.in_proj, projector.out_proj]  # type: ignore[union-attr]


_renderers: dict[str, Renderer] = {}  # per folder, in each rendering process


def _render_chunk(args: tuple[str, list[dict[str, Any]]]) -> list[list[Example]]:
    folder, items = args
    if folder not in _renderers:
        if multiprocessing.current_process().name != "MainProcess":
            torch.set_num_threads(1)  # many rendering processes share the cores with the training
        _renderers[folder] = Renderer(folder)
    return [_renderers[folder].examples(it) for it in items]


def render_all(
    folder: Path, items: list[dict[str, Any]], max_len: int, workers: int
) -> tuple[list[Example], int]:
    """Every item's examples in item order (rendered by `workers` processes), those longer than
    `max_len` dropped (counted)."""
    # strided chunks: the mixture is written task by task, and image items cost ~50× a text item
    num_chunks = max(1, len(items) // 500)
    chunks = [(str(folder), items[i::num_chunks]) for i in range(num_chunks)]
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            rendered = pool.map(_render_chunk, chunks)
    else:
        rendered = [_render_chunk(c) for c in chunks]
    # back in item order (an item gives one example per assistant turn)
    per_item: list[list[Example]] = [[] for _ in items]
    for i in range(num_chunks):
        for item_index, exs in zip(range(i, len(items), num_chunks), rendered[i], strict=True):
            per_item[item_index] = exs
    examples = [ex for exs in per_item for ex in exs]
    kept = [ex for ex in examples if len(ex.token_ids) <= max_len]
    return kept, len(examples) - len(kept)


def padded_length(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Length-bucketed batches of at most `batch_tokens` padded tokens, in a seeded random order."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].token_ids), i))
    out: list[list[Example]] = [[]]
    for i in order:
        ex = examples[i]
        if out[-1] and padded_length(len(ex.token_ids)) * (len(out[-1]) + 1) > batch_tokens:
            out.append([])
        out[-1].append(ex)
    rng.shuffle(out)
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without waiting for the GPU (pinned memory, asynchronous copy) on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def collate(
    batch: list[Example],
    pad_id: int,
    device: torch.device,
    *,
    prompt_weight: float = 0.0,
    unpredicted: frozenset[int] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Right-padded ids and next-token labels; images in order. With `prompt_weight` 0 the labels
    are the trained (assistant) tokens only, IGNORE elsewhere; above 0 every real next token is a
    label (but the `unpredicted` ids: image placeholders), `weights` gives the untrained ones that
    weight and `trained` marks the assistant tokens."""
    length = padded_length(max(len(ex.token_ids) for ex in batch))
    ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    weights = torch.zeros((len(batch), length))
    is_trained = torch.zeros((len(batch), length), dtype=torch.bool)
    is_real = torch.zeros((len(batch), length), dtype=torch.bool)
    for b, ex in enumerate(batch):
        n = len(ex.token_ids)
        ids[b, :n] = torch.tensor(ex.token_ids)
        is_real[b, :n] = True
        target = torch.tensor(ex.token_ids[1:])
        trained = torch.tensor(ex.loss_mask[1:])
        if prompt_weight > 0:
            keep = trained | ~torch.isin(target, torch.tensor(sorted(unpredicted), dtype=torch.long))
            labels[b, : n - 1] = torch.where(keep, target, IGNORE)
            weights[b, : n - 1] = torch.where(trained, 1.0, prompt_weight)
            is_trained[b, : n - 1] = trained
        else:
            labels[b, : n - 1] = torch.where(trained, target, IGNORE)
    out = {"input_ids": _to(ids, device), "labels": _to(labels, device), "is_real": _to(is_real, device)}
    if prompt_weight > 0:
        out["weights"], out["trained"] = _to(weights, device), _to(is_trained, device)
    images = [image for ex in batch for image in ex.images]
    if images:
        out["pixel_values"] = _to(torch.cat([i.patches for i in images]), device)
        out["image_grid_thw"] = torch.tensor([[1, i.grid_h, i.grid_w] for i in images], device=device)
    return out


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to train on, the mean loss over assistant tokens alone — the one the log reports).
    Without `weights` in the batch the two are the same."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "weights", "trained", "is_real")}
    logits = model(**inputs, use_cache=False).logits  # [B, L, V]
    labels = batch["labels"].flatten()
    if "weights" not in batch:
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels, ignore_index=IGNORE)
        return loss, loss
    per_token = F.cross_entropy(logits.float().flatten(0, 1), labels, ignore_index=IGNORE, reduction="none")
    weights = batch["weights"].flatten() * (labels != IGNORE)
    answer = batch["trained"].flatten().float()
    loss = (per_token * weights).sum() / weights.sum().clamp_min(1e-9)
    return loss, ((per_token * answer).sum() / answer.sum().clamp_min(1)).detach()


def endless(groups: list[list[Example]], rng: random.Random) -> Iterator[list[Example]]:
    while True:
        yield from groups
        rng.shuffle(groups)


def prepare(
    family: Family,
    data: Path,
    folder: Path,
    *,
    size: str,
    max_len: int,
    max_items: int | None,
    init: Path | None,
    rng: random.Random,
    workers: int,
    log: Callable[[str], None],
    tasks: frozenset[str] | None = None,
) -> tuple[dict[str, Any], list[Example], int]:
    """Tokenizer and config.json into `folder`; returns the config, the rendered examples and the pad id."""
    if not (data / "train.jsonl").exists():
        log(
            f"building data into {data}: {build(data, family=family, train_items=TRAIN_ITEMS, test_items=TEST_ITEMS)}"
        )
    with (data / "train.jsonl").open() as f:
        items = [json.loads(line) for line in f]
    if tasks is not None:  # a stage on some tasks only (e.g. the images of a vision stage)
        unknown = tasks - {it.get("task") for it in items}
        if unknown:
            raise ValueError(f"no training items of task {sorted(unknown)} in {data}")
        items = [it for it in items if it.get("task") in tasks]
    if max_items is not None:
        items = rng.sample(items, max_items)
    if init is not None:  # continue training: the earlier run's tokenizer and config; its logs kept
        earlier_logs = sorted(init.glob("train*.log"))
        num_runs = sum(
            1 for f in earlier_logs if re.fullmatch(r"train(\.\d+)?\.log", f.name)
        )  # not train_mtp
        for f in init.iterdir():  # not its MTP layer (mtp.safetensors): trained for the old target
            if f.is_file() and f.suffix not in (".log", ".safetensors") and not f.name.startswith("model"):
                shutil.copy(f, folder / f.name)
        for f in earlier_logs:  # train.log → train.1.log, train.1.log stays: one log per run, in order
            shutil.copy(f, folder / (f"train.{num_runs}.log" if f.name == "train.log" else f.name))
        config = json.loads((init / "config.json").read_text())
        (config.get("text_config") or config)["num_nextn_predict_layers"] = 0  # train_mtp.py again after
        num_ids = int((config.get("text_config") or config)["vocab_size"])
        log(f"continuing from {init} (its tokenizer and config)")
    else:
        num_ids = write_tokenizer(family, folder, items, SIZES[size]["vocab"])
        config = published_config(family, size, num_ids, special_ids(folder))
    num_bytes = parameter_bytes(family, config)
    log(f"{family} {size}: {num_ids} token ids, {num_bytes / 1e6:.2f} MB of bf16 weights")
    if size == "nano" and num_bytes > MAX_MODEL_BYTES:
        raise ValueError(f"{num_bytes} bytes over the {MAX_MODEL_BYTES} limit")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    examples, dropped = render_all(folder, items, max_len, workers)
    num_trained = sum(sum(ex.loss_mask) for ex in examples)
    log(f"{len(items)} items → {len(examples)} sequences ({dropped} over {max_len} dropped), "
        f"{num_trained} trained tokens")  # fmt: skip
    return config, examples, Renderer(folder).eos_id


def load_model(family: Family, folder: Path) -> torch.nn.Module:
    """A trained nano folder in float32 (transformers reads the published names back exactly)."""
    import transformers as tf

    if family == "glm":
        return tf.GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    from transformers.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    return Kimi_K25ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)


def fit(
    model: torch.nn.Module,
    examples: list[Example],
    pad_id: int,
    *,
    steps: int,
    batch_tokens: int,
    lr: float,
    warmup: int,
    minutes: float,
    balance_rate: float,
    rng: random.Random,
    log: Callable[[str], None],
    log_every: int,
    profile_steps: int = 0,
    prompt_weight: float = 0.0,
    unpredicted: frozenset[int] = frozenset(),
    centred_vision_grads: bool = True,
) -> list[float]:
    """The training loop; returns the loss averaged over each logging window.

    `centred_vision_grads`: train the vision path as on mean-centred inputs (`CentredGradients`).

    `steps` 0 lays the schedule over the wall-clock budget instead of a step count: linear warmup
    over `warmup` steps, then cosine decay over the time left until `minutes` runs out. Robust when
    the step time changes mid-run (two trainings sharing one GPU, one of them still rendering); the
    log records the steps taken."""
    from transformers import get_cosine_schedule_with_warmup

    dev = next(model.parameters()).device
    balance = ExpertBalance(model, rate=balance_rate)
    centred = CentredGradients(vision_inputs(model) if centred_vision_grads else [])
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # all but a frozen part
    is_decayed = {n: p.ndim >= 2 and "norm" not in n for n, p in trained}
    groups = [
        {"params": [p for n, p in trained if is_decayed[n]], "weight_decay": 0.1},
        {"params": [p for n, p in trained if not is_decayed[n]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    budget = minutes * 60
    clock: dict[str, float] = {}

    def by_time(step: int) -> float:
        """The learning-rate factor at `step` when the schedule follows the clock."""
        if step < warmup:
            return (step + 1) / warmup
        begin = clock.setdefault("decay_from", time.monotonic())
        frac = min(1.0, (time.monotonic() - begin) / max(1e-9, budget - (begin - clock["start"])))
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    total = steps or MAX_AUTO_STEPS
    if steps:
        schedule = get_cosine_schedule_with_warmup(opt, warmup, total)
    else:
        clock["start"] = time.monotonic()
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, by_time)
    stream = endless(batches(examples, batch_tokens, rng), rng)
    is_cuda = dev.type == "cuda"
    losses: list[float] = []
    window: list[torch.Tensor] = []  # device scalars: no host sync per step
    start = time.monotonic()
    step = 0
    profiler: torch.profiler.profile | None = None
    while step < total:
        step += 1
        if profile_steps and step == PROBE_STEPS + 1:  # after the warm-up steps
            kinds = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if is_cuda else []
            )
            profiler = torch.profiler.profile(activities=kinds)
            profiler.__enter__()
        batch = collate(next(stream), pad_id, dev, prompt_weight=prompt_weight, unpredicted=unpredicted)
        balance.is_real = batch["is_real"].flatten()
        # no cuDNN attention: its per-shape plans cost 18-20 ms of host time a call (PAD_MULTIPLE)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=is_cuda), sdpa_kernel(SDPA_BACKENDS):
            loss, answer_loss = loss_of(model, batch)
        loss.backward()
        centred.apply()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        load = balance.step()
        balance.is_real = None
        window.append(answer_loss.detach())
        if profiler is not None and step == PROBE_STEPS + profile_steps:
            profiler.__exit__(None, None, None)
            key = "self_cuda_time_total" if is_cuda else "self_cpu_time_total"
            log(
                f"profile of steps {PROBE_STEPS + 1}-{step}:\n{profiler.key_averages().table(sort_by=key, row_limit=20)}"
            )
            profiler = None
        if steps == 0 and step == PROBE_STEPS:
            log(f"{(time.monotonic() - start) / step * 1000:.0f} ms per step over the first {step}; "
                f"the cosine follows the clock to {minutes} minutes")  # fmt: skip
        if step % log_every == 0 or step == total:
            losses.append(float(torch.stack(window).mean()))
            window = []
            log(f"step {step}{f'/{total}' if steps else ''} loss {losses[-1]:.4f} lr {schedule.get_last_lr()[0]:.2e} "
                f"grad-norm {float(norm):.2f} expert-load max/mean {float(load):.2f}")  # fmt: skip
        if time.monotonic() - start > minutes * 60:
            if window:
                losses.append(float(torch.stack(window).mean()))
            log(f"stopped at step {step} by the {minutes}-minute limit, loss {losses[-1]:.4f}")
            break
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"the loss is not finite: {losses}")
    return losses


def train(
    family: Family,
    data: Path,
    out: Path,
    *,
    size: str = "nano",
    steps: int = 3000,
    batch_tokens: int = 32768,
    lr: float = 2e-3,
    warmup: int = 100,
    max_len: int = 1024,
    minutes: float = 9.0,
    seed: int = 0,
    device: str = "cuda" if torch.cuda.is_available() else "cpu",
    max_items: int | None = None,
    log_every: int = 25,
    profile_steps: int = 0,
    workers: int = min(16, os.cpu_count() or 1),
    balance_rate: float = 1e-3,
    init: Path | None = None,
    prompt_weight: float = 0.0,
    centred_vision_grads: bool = True,
    tasks: frozenset[str] | None = None,
    train_only: TrainOnly = "all",
) -> list[float]:
    """Prepare, train and save the checkpoint folder `out` (written beside it, then renamed into
    place); returns the logged losses. `minutes` bounds the training loop's wall time.

    `tasks`: train on the items of these tasks only. `train_only="vision"`: every parameter outside the
    vision tower and projector frozen, the experts' selection biases too (a vision stage from `init`:
    the language model, and so every text-only answer, stays exactly as it was)."""
    import transformers

    if train_only == "vision":
        balance_rate = 0.0  # the routers' selection biases belong to the language model too
    settings = dict(family=family, data=str(data), out=str(out), size=size, steps=steps, batch_tokens=batch_tokens,
                    lr=lr, warmup=warmup, max_len=max_len, minutes=minutes, seed=seed, device=device,
                    max_items=max_items, balance_rate=balance_rate, init=str(init) if init else None,
                    prompt_weight=prompt_weight, centred_vision_grads=centred_vision_grads,
                    tasks=sorted(tasks) if tasks else None, train_only=train_only)  # fmt: skip
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    random.seed(seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with (staging / "train.log").open("w") as log_file:
        log = Log(log_file)
        log(
            f"train {json.dumps(settings)}; torch {torch.__version__}, transformers {transformers.__version__}"
        )
        config, examples, pad_id = prepare(family, data, staging, size=size, max_len=max_len, max_items=max_items,
                                           init=init, rng=rng, workers=workers, log=log, tasks=tasks)  # fmt: skip
        model = load_model(family, init) if init is not None else build_model(family, config)
        model = model.to(torch.device(device)).train()
        if train_only == "vision":
            kept = freeze_all_but_vision(model)
            log(f"vision stage: {kept} parameters trained, the rest frozen")
        elif train_only == "language":
            kept = freeze_vision(model)
            log(f"language stage: {kept} parameters trained, the vision tower and projector frozen")
        losses = fit(model, examples, pad_id, steps=steps, batch_tokens=batch_tokens, lr=lr, warmup=warmup,
                     minutes=minutes, balance_rate=balance_rate, rng=rng, log=log, log_every=log_every,
                     profile_steps=profile_steps, prompt_weight=prompt_weight,
                     centred_vision_grads=centred_vision_grads,
                     unpredicted=frozenset(i for i in [Renderer(staging).pad_id] if i is not None))  # fmt: skip
        save_checkpoint(family, model.eval().float().cpu(), config, staging)
        log(f"saved {out}")
    staging.rename(out)
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["kimi", "glm"], required=True)
    p.add_argument(
        "--data", type=Path, required=True, help="built data (built here if it has no train.jsonl)"
    )
    p.add_argument("--out", type=Path, required=True, help="the checkpoint folder to create")
    p.add_argument("--size", choices=["nano", "micro"], default="nano")
    p.add_argument("--steps", type=int, default=3000, help="0: as many as fit in --minutes")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--minutes", type=float, default=9.0, help="wall-time bound of the training loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-items", type=int, default=None, help="train on a seeded sample of the mixture")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--balance-rate", type=float, default=1e-3, help="selection-bias step per training step")
    p.add_argument(
        "--init", type=Path, default=None, help="continue from this trained folder (its tokenizer too)"
    )
    p.add_argument(
        "--prompt-weight",
        type=float,
        default=0.0,
        help="loss weight of the other tokens (0: assistant turns only)",
    )
    p.add_argument(
        "--plain-vision-grads",
        action="store_true",
        help="no gradient centring on the patch embedding and projector (the recipe before 2026-12-02)",
    )
    p.add_argument(
        "--profile-steps", type=int, default=0, help="log a profiler table of N steps after the first 20"
    )
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="rendering processes")
    p.add_argument("--tasks", default=None, help="comma-separated: train on these tasks' items only")
    p.add_argument(
        "--train-only",
        choices=get_args(TrainOnly),
        default="all",
        help="vision: the vision tower and projector only, the language model frozen (a stage from --init); "
        "language: everything but them",
    )
    a = p.parse_args(argv)
    train(a.family, a.data, a.out, size=a.size, steps=a.steps, batch_tokens=a.batch_tokens, lr=a.lr,
          warmup=a.warmup, max_len=a.max_len, minutes=a.minutes, seed=a.seed, device=a.device,
          max_items=a.max_items, log_every=a.log_every, workers=a.workers,
          balance_rate=a.balance_rate, init=a.init, profile_steps=a.profile_steps,
          prompt_weight=a.prompt_weight, centred_vision_grads=not a.plain_vision_grads,
          tasks=frozenset(a.tasks.split(",")) if a.tasks else None, train_only=a.train_only)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
