"""Device launches of a plain decode step and of a whole greedy speculative step, estimated on the CPU
(issue 28):

    python3 -m lab.diagnostics.spec_launches [--models glm,kimi] [--ks 1,2,3] [--batch 1] [--out FILE.json]

A replayed CUDA graph costs the device about one node per kernel it holds (launch gaps of ~1-2 µs
each at the nano models' sizes, next to kernels of a few µs), so a step's node count is most of its
device time. This counts, on the CPU, the kernels the step's graph would hold on CUDA: the engines
capture through `eager_capture` (lab/diagnostics/spec_host.py's `Meter`), and while a replay runs a
dispatch mode counts every aten op that launches (views, allocations and metadata do not), except
inside the kernel ops' public entries, each of which counts what it launches on CUDA (`KERNELS`:
the Triton kernel, and the split-K merge of MLA) and hides its torch reference. Counts are split
by phase (the verify forward, each MTP depth, the guard's masking, the acceptance, the layers'
parts), inclusive: a phase's count holds those of the phases inside it.

Calibration (H100, 2026-12-05, lab/results/2026-12-05-r12/spec_profile-*.txt): the profiler's device
events per plain step were 192 (GLM nano) and 174 (Kimi nano), about 6 of them outside the graph.
Since 2026-12-07 (`KERNELS` holds every kernel entry the models call): GLM nano plain 113 in the
replay on the CPU, 111 eager launches on the H100 (`lab/diagnostics/step_kernels.py`, which names
each launch by source line); the CPU still computes cos/sin (6 launches) where a CUDA runner gathers
them (1).
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lab.diagnostics.spec_host import MODELS

# aten ops that launch nothing on the device (views, metadata, allocations)
NO_LAUNCH = {
    "view", "_unsafe_view", "slice", "select", "alias", "as_strided", "unsqueeze", "squeeze", "expand",
    "t", "transpose", "permute", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "resolve_conj", "resolve_neg", "diagonal", "unfold", "lift_fresh", "empty", "empty_strided",
    "empty_like", "new_empty", "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "_reshape_alias", "reshape", "view_as", "expand_as", "contiguous", "_local_scalar_dense", "promote_types",
    "numpy_T",
}  # fmt: skip
# kernel entries as the model modules import them: (module, name, launches on CUDA)
KERNELS = (
    ("backend.models.layers.norm", "rms_norm", 1),
    ("backend.models.layers.rotary", "rope", 1),
    ("backend.models.layers.step", "kv_write", 1),
    ("backend.models.layers.moe", "route", 1),
    ("backend.models.deepseek_v3", "mla_attention", 2),  # the paged kernel and the split-K merge
    ("backend.models.glm_moe_dsa", "dsa_indexer", 3),  # scores, top-k (radix select), its fix-up
    ("backend.models.glm4_moe", "paged_attention", 2),
    ("backend.models.deepseek_v3", "row_norms", 1),
    ("backend.models.mtp", "row_norms", 1),
    ("backend.models.layers.moe", "act_mul", 1),
    ("backend.models.layers.moe", "router_logits", 1),
    ("backend.engine.speculative.greedy", "draft_rows", 1),
    ("backend.engine.speculative.greedy", "verify_accept", 2),  # the rows' argmax, the acceptance
)


class Launches(TorchDispatchMode):
    """Counts launches into every label on its stack (while `active`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.active = False
        self.hidden = 0  # > 0 inside a kernel entry: its reference's ops are not the device's
        self.counts: collections.Counter[str] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self.mtp_depth = 0  # the next MTP forward's depth within the replay

    def capture(self, step: Callable[[], Any]) -> Callable[[], Any]:
        """`eager_capture`, each replay counted under "replay"."""

        def replay() -> Any:
            self.mtp_depth = 0
            with self.label("replay"):
                return step()

        return replay

    def add(self, n: int, op: str) -> None:
        for label in {*self.stack}:
            self.counts[label] += n
        if self.stack:
            self.ops[f"{self.stack[-1]}:{op}"] += n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        out = func(*args, **(kwargs or {}))
        # a `to` that changes nothing returns its input: no copy, no launch
        is_noop = name in ("to", "_to_copy") and args and out is args[0]
        if self.active and self.hidden == 0 and name not in NO_LAUNCH and not is_noop:
            self.add(1, name)
        return out

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()


def instrument(counter: Launches, engine: Any) -> Callable[[], None]:
    """Wrap the kernel entries and the phases; returns the undo."""
    import importlib

    from backend.engine.speculative import greedy
    from backend.models.layers import moe, step

    undo: list[tuple[Any, str, Any]] = []

    def wrap(obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        fn = getattr(obj, name)
        undo.append((obj, name, fn))
        setattr(obj, name, make(fn))

    def kernel(label: str, n: int) -> Callable[[Any], Any]:
        def make(fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                if counter.active and counter.hidden == 0:
                    counter.add(n, label)
                counter.hidden += 1
                try:
                    return fn(*args, **kw)
                finally:
                    counter.hidden -= 1

            return wrapper

        return make

    def phase(label: str) -> Callable[[Any], Any]:
        def make(fn: Any) -> Any:
            def wrapper(*args: Any, **kw: Any) -> Any:
                with counter.label(label):
                    return fn(*args, **kw)

            return wrapper

        return make

    for module, name, n in KERNELS:
        try:
            wrap(importlib.import_module(module), name, kernel(name, n))
        except (ImportError, AttributeError):
            continue
    model = engine.runner.model
    wrap(model, "forward", phase("forward"))
    wrap(model, "forward_spec", phase("verify"))

    def mtp(fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            label = f"mtp depth {counter.mtp_depth}"
            counter.mtp_depth += 1
            with counter.label(label):
                return fn(*args, **kw)

        return wrapper

    wrap(model, "forward_mtp", mtp)
    wrap(greedy, "verify_accept", phase("verify tail"))
    wrap(step.Step, "build", phase("Step.build"))
    wrap(model.rotary, "cos_sin", phase("cos_sin"))
    wrap(moe.MoE, "forward", phase("moe"))
    wrap(moe.Router, "forward", phase("router"))
    wrap(model, "_logits", phase("lm_head"))
    attentions = [layer.self_attn for layer in [*model.layers, *model.mtp]]
    for attn in attentions:
        wrap(attn, "forward", phase("attention"))
    owned = {id(model), id(model.rotary), *map(id, attentions)}  # instance attributes: deleted

    def restore() -> None:
        while undo:
            obj, name, fn = undo.pop()
            if id(obj) in owned:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)

    return restore


def engines(
    checkpoint: Path, counter: Launches, ks: list[int], batch: int, dtype: torch.dtype
) -> dict[str, Any]:
    """Engines over one loaded copy (CPU, `dtype`): plain, and one per fixed draft length k."""
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model

    loaded = load_model(checkpoint, dtype=dtype, device="cpu", num_mtp_layers=num_mtp_layers_in(checkpoint))
    out = {}
    for k in [0, *ks]:
        config = EngineConfig.build(
            num_pages=256, page_size=16, max_num_batched_tokens=4096, max_num_seqs=max(batch, 1),
            enable_prefix_cache=False, num_speculative_tokens=k, speculative_max_seqs=max(batch, 1),
            speculative_adaptive=False, cuda_graph_batch_sizes=tuple(sorted({1, 2, 4, batch})),
        )  # fmt: skip
        prepared = prepare_model(loaded, config, model_dtype=dtype)
        out["plain" if k == 0 else f"greedy k={k}"] = Engine.from_prepared(
            prepared, config, graph_capture=counter.capture
        )
    return out


def measure(engine: Any, counter: Launches, prompt: list[int], batch: int, steps: int) -> dict[str, Any]:
    """`batch` greedy requests; per kept step (a plain engine's decode steps, a speculative one's
    whole greedy steps) the launches by phase, averaged."""
    from schemas.backend import EngineRequest, SamplingParams

    sampling = SamplingParams(temperature=0.0, max_tokens=4 * steps + 8, ignore_eos=True)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=prompt, tenant_salt="a" * 32, sampling=sampling)
        )
    kept: list[collections.Counter[str]] = []
    ops: collections.Counter[str] = collections.Counter()
    while engine.has_unfinished and len(kept) < steps:
        greedy0 = engine.spec.num_greedy_steps if engine.spec is not None else 0
        computed0 = engine.stats.computed_tokens
        counter.counts.clear()
        counter.ops.clear()
        counter.active = True
        with counter.label("engine step"):
            engine.step()
        counter.active = False
        if engine.spec is not None:
            keep = engine.spec.num_greedy_steps > greedy0
        else:
            keep = engine.stats.computed_tokens - computed0 == batch and engine.stats.steps > 1
        if keep:
            kept.append(collections.Counter(counter.counts))
            ops.update(counter.ops)
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    n = max(len(kept), 1)
    labels = sorted({k for c in kept for k in c})
    per_step = {k: round(sum(c[k] for c in kept) / n, 1) for k in labels}
    per_step["outside replays"] = round(per_step.get("engine step", 0) - per_step.get("replay", 0), 1)
    return {
        "steps": len(kept),
        "launches_per_step": per_step,
        "ops": {k: round(v / n, 1) for k, v in sorted(ops.items())},
    }


def main(argv: list[str] | None = None) -> int:
    from backend.models.layers import step as step_module

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="glm,kimi")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16: the GPU's casts launch as there")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ks = [int(k) for k in args.ks.split(",")]
    report: dict[str, Any] = {}
    for name in args.models.split(","):
        counter = Launches()
        built = engines(MODELS[name], counter, ks, args.batch, getattr(torch, args.dtype))
        vocab = built["plain"].runner.vocab_size
        prompt = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(0)).tolist()
        for side, engine in built.items():
            restore = instrument(counter, engine)
            try:
                with counter:
                    row = measure(engine, counter, prompt, args.batch, args.steps)
            finally:
                restore()
            report[f"{name}/{side}/B={args.batch}"] = row
            cells = ", ".join(f"{k} {v}" for k, v in row["launches_per_step"].items())
            print(
                f"== {name} {side} B={args.batch}: {row['steps']} steps; launches per step: {cells}",
                flush=True,
            )
    del step_module
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
