"""`kumo eval`: the same prompts through several variants of a checkpoint, compared with the first.

    kumo eval --variant ref=DIR --variant int4=DIR2 --variant q=DIR:weights=int4-g32:kv=fp8 \
              --data mmlu.jsonl --data gsm.jsonl --text wiki.txt --out eval.json

A variant is a checkpoint folder plus options: `kv=fp8|bf16` (FP8 KV uses the checkpoint's stored
scales, else calibrates with a warning), `weights=int4-g32|int4-g128|fp8-channel|fp8-block` and
`all-linear` (quantize the loaded weights in memory, to try a format before writing it), and
`int4-prefill=w4a16|w4a8|expand-fp8` (CUDA only: how the INT4 Linears multiply; here every product,
decode steps included, so the accuracy cost measured bounds serving's, which uses it only for
prefill chunks of `PREFILL_MIN_TOKENS`+ tokens), and `mla=exact|fp8-dot` (with `kv=fp8`, CUDA only: MLA
reads the FP8 latent cache by e4m3 dots, q and the softmax weights rounded to e4m3, in prefill and
decode alike, so multiple-choice tasks, which only prefill, measure it too; issue 24's accuracy gate). All
variants are held in memory together; items run in batches (`--batch-size` sequences over one page
pool, prefill steps of at most `--step-tokens` tokens, greedy decoding of the whole batch at once),
every batch through each variant (`backend/engine/prompt_runner.py`), on `--device` (CUDA when there
is one).

Task files are JSONL: multiple choice (log-likelihood), generation (exact match) and tool calls
(the family's parser on greedy output); their schema is in `backend/tools/eval_tasks.py`. Chat mode, the
default when the checkpoint ships a chat template, runs every prompt as serving does: the template
with its generation prompt, serving's image path, serving's reasoning split and tool-call parser
(`backend/tools/eval_prompts.py`); `--raw` scores plain text instead. `--text FILE` adds a perplexity task
over the file, in windows of `--window` tokens.

A multiple-choice file gives two tasks: NAME picks each item's choice by summed log-likelihood
(lm-evaluation-harness's acc), NAME:norm by log-likelihood per byte of the choice (its acc_norm).
Per task and variant: accuracy with a 95% bootstrap interval, the paired bootstrap interval of its
difference from the first variant, mean KL(first ‖ variant) of the next-token distributions at
every scored position (the choices' tokens; for generation and tool calls, the first variant's
greedy output, teacher-forced), top-1 agreement with the first variant, and perplexity for text
tasks. The JSON report is `EvalReport` below.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeGuard, get_args

import msgspec
import torch
import torch.nn.functional as F

from backend.engine.engine_config import Int4Prefill
from backend.engine.prompt_runner import Prompt, PromptRunner
from backend.errors import CheckpointError, EngineError
from backend.tools.eval_heldout import write_sets
from backend.tools.eval_prompts import EvalPrompts, Request
from backend.tools.eval_tasks import GenItem, McItem, ToolItem, call_matches, generation_correct, load_items

NUM_BOOTSTRAP = 1000


class VariantResult(msgspec.Struct, kw_only=True):
    variant: str
    accuracy: float | None = None
    accuracy_ci: tuple[float, float] | None = None
    delta_vs_first: float | None = None  # accuracy − first variant's accuracy, paired
    delta_ci: tuple[float, float] | None = None
    mean_kl: float  # nats, KL(first ‖ this) averaged over scored positions
    top1_agreement: float
    perplexity: float | None = None


class TaskResult(msgspec.Struct, kw_only=True):
    task: str
    kind: str  # "multiple_choice" | "multiple_choice_norm" | "generation" | "tool_call" | "perplexity"
    num_items: int
    results: list[VariantResult]


class EvalReport(msgspec.Struct, kw_only=True):
    variants: dict[str, str]  # name -> spec as given
    mode: Literal["chat", "raw"] = "raw"
    tasks: list[TaskResult]


EvalKv = Literal["fp8", "bf16"]
EvalMla = Literal["exact", "fp8-dot"]


def _is_kv(value: str) -> TypeGuard[EvalKv]:
    return value in get_args(EvalKv)


def _is_mla(value: str) -> TypeGuard[EvalMla]:
    return value in get_args(EvalMla)


def _is_int4_prefill(value: str) -> TypeGuard[Int4Prefill]:
    return value in get_args(Int4Prefill)


class VariantOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What follows a variant's folder: `:kv=fp8|bf16`, `:weights=FORMAT`, `:all-linear`,
    `:int4-prefill=w4a16|w4a8|expand-fp8`, `:mla=exact|fp8-dot`, `:device=cpu|cuda` (default `--device`:
    a CPU variant beside CUDA ones compares the GPU kernels with the CPU path's torch references, same
    dtype)."""

    kv: EvalKv = "bf16"
    weights: str | None = None  # one of `kumo quantize --weights`
    all_linear: bool = False
    int4_prefill: Int4Prefill = "w4a16"
    mla: EvalMla = "exact"
    device: str | None = None


def parse_variant(spec: str) -> tuple[str, VariantOptions]:
    """`DIR[:kv=fp8|bf16][:weights=FORMAT][:all-linear][:int4-prefill=MODE][:mla=MODE][:device=DEV]` ->
    (DIR, options); ValueError naming what is wrong (an option ignored would run a variant other than the
    one asked for)."""
    from backend.tools.quantize import WEIGHTS

    path, *opts = spec.split(":")
    kv: EvalKv = "bf16"
    prefill: Int4Prefill = "w4a16"
    mla: EvalMla = "exact"
    weights, all_linear, device = None, False, None
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "kv" and _is_kv(value):
            kv = value
        elif key == "weights" and value in WEIGHTS:
            weights = value
        elif opt == "all-linear":
            all_linear = True
        elif key == "int4-prefill" and _is_int4_prefill(value):
            prefill = value
        elif key == "mla" and _is_mla(value):
            mla = value
        elif key == "device" and value in ("cpu", "cuda"):
            device = value
        else:
            raise ValueError(
                f"variant {spec!r}: unknown option {opt!r} (kv=fp8|bf16, weights={'|'.join(WEIGHTS)}, "
                f"all-linear, int4-prefill={'|'.join(get_args(Int4Prefill))}, "
                f"mla={'|'.join(get_args(EvalMla))}, device=cpu|cuda)"
            )
    if all_linear and weights is None:
        raise ValueError(f"variant {spec!r}: all-linear needs weights=FORMAT")
    if mla != "exact" and kv != "fp8":
        raise ValueError(f"variant {spec!r}: mla={mla} reads an FP8 latent cache: it needs kv=fp8")
    return path, VariantOptions(
        kv=kv, weights=weights, all_linear=all_linear, int4_prefill=prefill, mla=mla, device=device
    )


class Variant:
    def __init__(
        self, name: str, spec: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        from backend.models.deepseek_v3 import set_mla_fp8_dot
        from backend.models.layers.fused import fuse_projections
        from backend.models.loader import load_model
        from backend.quant import kv_scales
        from backend.quant.linear import set_int4_prefill
        from backend.quant.scheme import QuantScheme
        from backend.quant.walker import quantize_model
        from backend.tools.quantize import WEIGHTS

        self.name, self.spec = name, spec
        path, options = parse_variant(spec)
        device = options.device or device
        # fused once quantized (below): each Linear quantized on its own, as `kumo quantize` writes it
        loaded = load_model(path, dtype=dtype, device=device, fuse_projections=False)
        self.dtype, self.device = dtype, device
        self.model, self.path, self.config = loaded.model, Path(path), loaded.config
        self.kv_dtype, self.scales = None, None
        if options.kv == "fp8":
            self.kv_dtype = torch.float8_e4m3fn
            self.scales = kv_scales.scales_for_serving(
                path,
                self.model,
                model_dtype=dtype,
                vocab_size=loaded.config.vocab_size,
                prefix=loaded.config.weight_prefix,
            )
        # after the KV scales, which come from the unquantized model as `kumo quantize --kv-scales`'s do
        if options.weights is not None:
            method, group = WEIGHTS[options.weights]
            quantize_model(
                self.model, QuantScheme.build(method, group_size=group, all_linear=options.all_linear)
            )
        fuse_projections(self.model)
        if options.int4_prefill != "w4a16":
            if not str(device).startswith("cuda"):
                raise ValueError(f"variant {spec!r}: int4-prefill={options.int4_prefill} runs only on CUDA")
            if not set_int4_prefill(self.model, options.int4_prefill, min_tokens=1):
                raise ValueError(
                    f"variant {spec!r}: int4-prefill needs INT4 Linears (weights=int4-*:all-linear)"
                )
        if options.mla != "exact":
            if not str(device).startswith("cuda"):
                raise ValueError(f"variant {spec!r}: mla={options.mla} runs only on CUDA")
            if not set_mla_fp8_dot(self.model, True):
                raise ValueError(f"variant {spec!r}: mla={options.mla} needs an MLA model")

    def runner(self, step_tokens: int) -> PromptRunner:
        """Whole prompts per prefill step (chunk None), as the engine prefills prompts under its budget."""
        return PromptRunner(
            self.model,
            model_dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            scales=self.scales,
            chunk=None,
            step_tokens=step_tokens,
        )


def bootstrap_ci(values: torch.Tensor, generator: torch.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean of `values` [N] (paired differences when given those)."""
    idx = torch.randint(0, values.numel(), (NUM_BOOTSTRAP, values.numel()), generator=generator)
    means = values[idx].float().mean(dim=1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def _compare(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(sum of KL(ref ‖ other), count of matching argmax) over rows of two log-prob tensors [N, V]."""
    kl = (ref.exp() * (ref - other)).sum(-1)
    return float(kl.sum()), float((ref.argmax(-1) == other.argmax(-1)).sum())


def pick_choice(loglik: torch.Tensor, num_bytes: list[int], *, normalise: bool) -> int:
    """The chosen index among choices with summed log-likelihoods `loglik` [C]; normalised: per byte."""
    scores = loglik / torch.tensor(num_bytes, dtype=loglik.dtype) if normalise else loglik
    return int(scores.argmax())


class Evaluator:
    def __init__(
        self,
        variants: list[Variant],
        max_new_tokens: int = 128,
        window: int = 128,
        *,
        is_chat: bool | None = None,
        batch_size: int = 256,
        step_tokens: int = 8192,
    ) -> None:
        """`is_chat` None: chat mode iff the first variant's checkpoint ships a chat template."""
        from backend.text.jinja_sandbox import template_source

        first = variants[0]
        self.is_chat = template_source(first.path) is not None if is_chat is None else is_chat
        self.variants, self.max_new_tokens, self.window = variants, max_new_tokens, window
        self.batch_size = batch_size
        self.runners = [v.runner(step_tokens) for v in variants]
        self.prompts = EvalPrompts(
            [v.path for v in variants],
            is_chat=self.is_chat,
            max_new_tokens=max_new_tokens,
            dtype=first.dtype,
            devices=[v.device for v in variants],
        )
        self.generator = torch.Generator().manual_seed(0)

    def _score(
        self, seqs: list[tuple[list[Request], list[int]]]
    ) -> tuple[list[torch.Tensor], list[float], list[float], int]:
        """Each (prompt per variant, target ids) through every variant, teacher-forced -> per variant:
        summed log-likelihood of the targets per sequence [S], summed KL vs the first, top-1 matches;
        and the count of scored positions."""
        loglik = [torch.zeros(len(seqs)) for _ in self.variants]
        kl, top1, count = [0.0] * len(self.variants), [0.0] * len(self.variants), 0
        for g in range(0, len(seqs), self.batch_size):
            group = seqs[g : g + self.batch_size]
            lengths = [len(t) for _, t in group]
            ref: torch.Tensor | None = None
            for v, runner in enumerate(self.runners):
                prompts = [_extended(r[v].prompt, t) for r, t in group]
                starts = [len(r[v].prompt.token_ids) - 1 for r, _ in group]
                rows = torch.cat([x[:-1] for x in runner.score(prompts, starts)])  # [N, V] predicting targets
                logp = F.log_softmax(rows, -1)
                targets = torch.tensor([i for _, t in group for i in t], device=logp.device)
                per_token = logp.gather(1, targets[:, None])[:, 0].cpu()
                loglik[v][g : g + len(group)] = torch.stack(
                    [x.sum() for x in torch.split(per_token, lengths)]
                )
                ref = logp if ref is None else ref
                k, t = _compare(ref, logp.to(ref.device))  # a CPU variant beside CUDA ones
                kl[v] += k
                top1[v] += t
            count += sum(lengths)
        return loglik, kl, top1, count

    def _results(
        self,
        correct: list[torch.Tensor] | None,
        kl: list[float],
        top1: list[float],
        count: int,
        perplexity: list[float] | None = None,
    ) -> list[VariantResult]:
        out = []
        for v, variant in enumerate(self.variants):
            r = VariantResult(
                variant=variant.name,
                mean_kl=kl[v] / max(count, 1),
                top1_agreement=top1[v] / max(count, 1),
                perplexity=perplexity[v] if perplexity else None,
            )
            if correct is not None:
                r.accuracy = float(correct[v].float().mean())
                r.accuracy_ci = bootstrap_ci(correct[v], self.generator)
                r.delta_vs_first = r.accuracy - float(correct[0].float().mean())
                r.delta_ci = bootstrap_ci(correct[v].float() - correct[0].float(), self.generator)
            out.append(r)
        return out

    def multiple_choice(self, name: str, items: list[McItem]) -> list[TaskResult]:
        """Two results: `name` picks by summed log-likelihood (acc), `name:norm` by log-likelihood
        per byte of the choice (lm-evaluation-harness's acc_norm, which longer choices need)."""
        seqs: list[tuple[list[Request], list[int]]] = []
        offsets: list[int] = []
        num_bytes: list[list[int]] = []
        for item in items:
            requests, choices = self.prompts.multiple_choice(item)
            offsets.append(len(seqs))
            seqs += [(requests, c.target_ids) for c in choices]
            num_bytes.append([c.num_bytes for c in choices])
        loglik, kl, top1, count = self._score(seqs)
        results = []
        for normalise, task, kind in (
            (False, name, "multiple_choice"),
            (True, f"{name}:norm", "multiple_choice_norm"),
        ):
            correct = [
                torch.tensor(
                    [
                        pick_choice(ll[o : o + len(it.choices)], nb, normalise=normalise) == it.answer
                        for o, nb, it in zip(offsets, num_bytes, items, strict=True)
                    ]
                )
                for ll in loglik
            ]
            results.append(
                TaskResult(
                    task=task,
                    kind=kind,
                    num_items=len(items),
                    results=self._results(correct, kl, top1, count),
                )
            )
        return results

    def generation(self, name: str, items: Sequence[GenItem | ToolItem]) -> TaskResult:
        """Greedy decoding of every item per variant, in batches; exact match of the answer (the
        content after the reasoning, read as serving reads it) or of the first tool call."""
        is_tool = bool(items) and isinstance(items[0], ToolItem)
        correct = [torch.zeros(len(items), dtype=torch.bool) for _ in self.variants]
        continuations: list[tuple[list[Request], list[int]]] = []
        for g in range(0, len(items), self.batch_size):
            group = items[g : g + self.batch_size]
            requests = [self.prompts.generation(it) for it in group]
            for v, runner in enumerate(self.runners):
                outs = runner.generate(
                    [r[v].prompt for r in requests], self.max_new_tokens, self.prompts.stop_ids
                )
                for i, (item, r, out) in enumerate(zip(group, requests, outs, strict=True)):
                    answer = self.prompts.read(r[v], out)
                    if isinstance(item, ToolItem):
                        correct[v][g + i] = call_matches(answer.calls, item.expected)
                    else:
                        correct[v][g + i] = generation_correct(answer.content, item)
                    if v == 0:  # the first variant's output, with its stop token: KL is measured on it
                        continuations.append(
                            (r, out.token_ids + ([out.stop_id] if out.stop_id is not None else []))
                        )
        _, kl, top1, count = self._score([c for c in continuations if c[1]])
        return TaskResult(
            task=name,
            kind="tool_call" if is_tool else "generation",
            num_items=len(items),
            results=self._results(correct, kl, top1, count),
        )

    def perplexity(self, name: str, text: str) -> TaskResult:
        ids = self.prompts.tokenizer.encode(text, allow_special=False)
        windows = [ids[i : i + self.window] for i in range(0, len(ids) - 1, self.window)]
        seqs = [([Request(Prompt(w[:1]))] * len(self.variants), w[1:]) for w in windows if len(w) > 1]
        loglik, kl, top1, count = self._score(seqs)
        ppl = [math.exp(-float(ll.sum()) / count) for ll in loglik]
        return TaskResult(
            task=name,
            kind="perplexity",
            num_items=len(seqs),
            results=self._results(None, kl, top1, count, ppl),
        )


def _extended(prompt: Prompt, ids: list[int]) -> Prompt:
    return Prompt(prompt.token_ids + ids, prompt.image_positions, prompt.image_embeds)


def _task_name(path: Path) -> str:
    """`mmlu.jsonl` -> `mmlu`; `mmlu-nano.test.jsonl` (as `models.recipes.build` names them) -> `mmlu-nano`."""
    return path.stem.removesuffix(".test")


def render(report: EvalReport) -> str:
    lines = [
        f"{'task':<24}{'variant':<12}{'acc':>7} {'95% CI':>15}{'Δ vs first':>12} {'Δ 95% CI':>17}{'KL':>10}{'top1':>7}{'ppl':>9}"
    ]
    for task in report.tasks:
        for r in task.results:
            acc = f"{r.accuracy:7.3f}" if r.accuracy is not None else f"{'-':>7}"
            ci = f"[{r.accuracy_ci[0]:.2f}, {r.accuracy_ci[1]:.2f}]" if r.accuracy_ci else "-"
            d = f"{r.delta_vs_first:+.3f}" if r.delta_vs_first is not None else "-"
            dci = f"[{r.delta_ci[0]:+.2f}, {r.delta_ci[1]:+.2f}]" if r.delta_ci else "-"
            ppl = f"{r.perplexity:9.3f}" if r.perplexity is not None else f"{'-':>9}"
            lines.append(
                f"{task.task[:23]:<24}{r.variant[:11]:<12}{acc} {ci:>15}{d:>12} {dci:>17}{r.mean_kl:10.2e}{r.top1_agreement:7.3f}{ppl}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="kumo eval", description="Compare variants of a checkpoint on the same prompts."
    )
    ap.add_argument(
        "--variant", action="append", required=True, help="NAME=DIR[:kv=fp8|bf16][:weights=FMT][:all-linear]"
    )
    ap.add_argument(
        "--data",
        action="append",
        default=[],
        type=Path,
        help="JSONL task file (multiple choice, generation or tool call)",
    )
    ap.add_argument("--text", action="append", default=[], type=Path, help="plain text for perplexity")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="generation limit (the nano test sets' longest answer turn, reasoning included, is ~60 tokens)",
    )
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument(
        "--raw",
        action="store_true",
        help="score plain text, no chat template (chat mode is the default when the checkpoint has one)",
    )
    ap.add_argument("--batch-size", type=int, default=256, help="sequences run together over one page pool")
    ap.add_argument("--step-tokens", type=int, default=8192, help="most tokens of one prefill step")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="model dtype of every variant (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument(
        "--heldout",
        choices=["kimi", "glm"],
        help="add the held-out everyday sets of this family (backend/tools/eval_heldout.py); one variant is enough",
    )
    ap.add_argument("--heldout-items", type=int, default=40, help="items per held-out set")
    ap.add_argument(
        "--heldout-dir", type=Path, help="where the held-out sets are written (default: a temp dir)"
    )
    a = ap.parse_args(argv)
    if a.heldout:
        folder = a.heldout_dir or Path(tempfile.mkdtemp(prefix="kumo-heldout-"))
        a.data += write_sets(folder, a.heldout, a.heldout_items)
    if len(a.variant) < (1 if a.heldout else 2) or not (a.data or a.text):
        ap.error("give at least two --variant (one with --heldout) and one --data or --text")
    specs: dict[str, str] = {}
    for v in a.variant:
        name, eq, spec = v.partition("=")
        if not eq or not name or name in specs:
            ap.error(f"--variant {v!r}: give NAME=DIR with a name no other variant has")
        try:
            parse_variant(spec)
        except ValueError as exc:
            ap.error(str(exc))
        specs[name] = spec
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32"))
    try:
        files = [(path, *load_items(path)) for path in a.data]  # checked before any model loads
        texts = [(path, path.read_text()) for path in a.text]
        variants = [Variant(n, s, dtype=dtype, device=a.device) for n, s in specs.items()]
        ev = Evaluator(
            variants,
            a.max_new_tokens,
            a.window,
            is_chat=False if a.raw else None,
            batch_size=a.batch_size,
            step_tokens=a.step_tokens,
        )
        tasks = []
        for path, kind, items in files:
            started = time.perf_counter()
            if kind == "multiple_choice":
                tasks += ev.multiple_choice(_task_name(path), items)
            else:
                tasks.append(ev.generation(_task_name(path), items))
            # progress on stderr (the table comes at the end): a run cut by a timeout still says how far it got
            print(
                f"kumo eval: {_task_name(path)}: {len(items)} items, {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        tasks += [ev.perplexity(path.stem, text) for path, text in texts]
    except (CheckpointError, EngineError, OSError, ValueError) as exc:
        print(f"kumo eval: error: {exc}", file=sys.stderr)
        return 2
    report = EvalReport(variants=specs, mode="chat" if ev.is_chat else "raw", tasks=tasks)
    print(render(report))
    if a.out:
        a.out.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
