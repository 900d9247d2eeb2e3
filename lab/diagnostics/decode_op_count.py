"""Leaf aten ops per c=1 decode step on the CPU (a proxy for CUDA kernels per step, issue 24):
GLM 5.2 tiny geometry, one sequence, the Engine's decode path without graphs.

    python -m lab.diagnostics.decode_op_count --layers 2 --format bf16

Counts the profiler's leaf `aten::` ops (those with no aten child: what would be a kernel each)
over N decode steps, printed per step and by name; views and metadata ops launch nothing and are
not counted. The ops whose CPU path is a torch reference of a CUDA kernel (MLA attention, the DSA
indexer's scoring and selection, the KV write, linear layers, routed experts, the fused RMSNorm,
rotary and routing ops) are counted as one op each under their own name: on the H200 they are one to a few fixed kernels, and their CPU references' many
small ops would drown the model code's count.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from backend.engine.engine import Engine
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.offline import engine_config, run_offline
from benchmarks.engine.weights import build_random_model

NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
    "aten::transpose", "aten::t", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute",
    "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::empty", "aten::empty_strided",
    "aten::detach", "aten::alias", "aten::lift_fresh", "aten::unbind", "aten::chunk", "aten::resize_",
    "aten::_unsafe_view", "aten::empty_like", "aten::item", "aten::_local_scalar_dense", "aten::is_nonzero",
    "aten::result_type", "aten::view_as", "aten::unflatten", "aten::flatten", "aten::contiguous",
    "aten::expand_as", "aten::to", "aten::_to_copy", "aten::clone", "aten::linear", "aten::matmul",
    "aten::resolve_conj", "aten::resolve_neg",
}  # fmt: skip
OPAQUE = "kernel-op::"


def opaque(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(OPAQUE + name):
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def kernel_ops_opaque() -> Iterator[None]:
    """Wrap the kernel-backed ops where the model code calls them."""
    import backend.models.deepseek_v3 as mla
    import backend.models.layers.moe as moe
    import backend.models.layers.norm as norm
    import backend.models.layers.rotary as rotary
    import backend.models.layers.step as step
    import kernels.dsa_indexer as indexer
    from backend.models.layers.linear import Linear
    from backend.models.layers.moe import Experts
    from backend.quant.experts import QuantExperts
    from backend.quant.linear import _QuantLinear

    patches = [
        (mla, "mla_attention"), (indexer, "dsa_indexer_ref"), (step, "kv_write"),
        (Linear, "forward"), (_QuantLinear, "forward"), (Experts, "forward"), (QuantExperts, "forward"),
        (norm, "rms_norm"), (rotary, "rope"), (moe, "route"), (moe, "act_mul"), (moe, "router_logits"),  # one Triton launch each on CUDA (absent before issue 24's fusions)
    ]  # fmt: skip
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches if hasattr(obj, name)]
    for obj, name, fn in saved:
        setattr(obj, name, opaque(f"{getattr(obj, '__name__', '')}.{name}", fn))
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def under_opaque(e: Any) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(OPAQUE):
            return True
        p = p.cpu_parent
    return False


# to/_to_copy/clone/linear/matmul: composite, their kernel is the leaf below them


def count(fmt: str, layers: int, steps: int, input_len: int) -> Counter[str]:
    geometry = make_geometry("glm-5.2", layers, tiny=True)
    config = geometry.model_config
    model = build_random_model(geometry, fmt, device="cpu", seed=0)
    out_len = 8 + steps
    engine = Engine(
        model, engine_config(-(-(input_len + out_len) // 16) + 1, 16, "bf16", 1, 2048, cuda_graphs=False),
        vocab_size=config.vocab_size, context_window=config.max_position_embeddings,
        model_dtype=torch.bfloat16, device="cpu",
    )  # fmt: skip
    state: dict = {}
    first, last = 4, 4 + steps

    @contextlib.contextmanager
    def around(step: int, rows: int):
        if step == first:
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"].__enter__()
        yield
        if step == last - 1:
            state["prof"].__exit__(None, None, None)

    with kernel_ops_opaque():
        run_offline(engine, variant="count", concurrency=1, input_len=input_len, output_len=out_len,
                    vocab_size=config.vocab_size, around_step=around)  # fmt: skip
    ops: Counter[str] = Counter()
    for e in state["prof"].events():
        if e.name.startswith(OPAQUE) and not under_opaque(e):
            ops[e.name] += 1
            continue
        if not e.name.startswith("aten::") or e.name in NO_KERNEL or under_opaque(e):
            continue
        if any(c.name.startswith("aten::") and c.name not in NO_KERNEL for c in e.cpu_children):
            continue  # composite: counted at its leaves
        ops[e.name] += 1
    return Counter({k: v / steps for k, v in ops.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    args = ap.parse_args()
    ops = count(args.format, args.layers, args.steps, args.input_len)
    print(f"== {args.format}, {args.layers} layers: {sum(ops.values()):.0f} leaf aten ops per decode step")
    for name, n in ops.most_common():
        print(f"  {n:6.1f}  {name}")


if __name__ == "__main__":
    main()
