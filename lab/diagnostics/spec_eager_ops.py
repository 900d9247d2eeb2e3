"""Which aten ops a speculative step issues OUTSIDE its graphs (issue 28), on the CPU:

    python3 -m lab.diagnostics.spec_eager_ops [--model models/glm-5.2-nano] [--prompts 2] [--max-tokens 48]

The F engine of `spec_profile` (always 3 drafts, greedy), its graphs "captured" with
`eager_capture` wrapped so that a replay runs inside a marker: every aten op is recorded by a
TorchDispatchMode, split into in-graph (what a CUDA graph replays) and eager (what the host would
launch one by one on CUDA, and where a nonzero or .tolist() is a host sync). Per step: its kind
(plain, prefill, greedy whole step, host path) and the eager ops; totals by kind.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_IN_GRAPH = [0]


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.eager: collections.Counter[str] = collections.Counter()
        self.graph: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        (self.graph if _IN_GRAPH[0] else self.eager)[name] += 1
        return func(*args, **(kwargs or {}))


def marked_capture(step: Any) -> Any:
    def replay() -> Any:
        _IN_GRAPH[0] += 1
        try:
            return step()
        finally:
            _IN_GRAPH[0] -= 1

    return replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/glm-5.2-nano"))
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--side", default="F", choices=("B", "F"))
    args = ap.parse_args(argv)
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
    from benchmarks.engine.mtp_acceptance import held_out_prompts, stop_ids
    from schemas.backend import EngineRequest, SamplingParams

    loaded = load_model(
        args.model, dtype=torch.float32, device="cpu", num_mtp_layers=num_mtp_layers_in(args.model)
    )
    k = 3 if args.side == "F" else 0
    config = EngineConfig.build(
        num_pages=64, page_size=16, max_num_batched_tokens=4096, max_num_seqs=1, enable_prefix_cache=False,
        num_speculative_tokens=k, speculative_max_seqs=1, speculative_adaptive=False,
        cuda_graph_batch_sizes=(1,), speculative_graphs=True,
    )  # fmt: skip
    engine = Engine.from_prepared(prepare_model(loaded, config), config, graph_capture=marked_capture)
    prompts = held_out_prompts(args.model, "chat", args.prompts)
    sampling = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=stop_ids(args.model)
    )
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    steps_by_kind: collections.Counter[str] = collections.Counter()
    for i, p in enumerate(prompts):
        engine.add_request(
            EngineRequest(request_id=str(i), prompt_token_ids=p, tenant_salt="a" * 32, sampling=sampling)
        )
        n = 0
        while engine.has_unfinished:
            spec = engine.spec
            greedy0 = spec.num_greedy_steps if spec is not None else 0
            log = OpLog()
            t = time.perf_counter()
            with log:
                engine.step()
            dt = time.perf_counter() - t
            if spec is not None and spec.num_greedy_steps > greedy0:
                kind = "greedy"
            elif n == 0:
                kind = "prefill"
            elif spec is not None and spec.k:
                kind = "host path"
            else:
                kind = "plain"
            n += 1
            steps_by_kind[kind] += 1
            by_kind[kind].update(log.eager)
            eager = sum(log.eager.values())
            print(
                f"prompt {i} step {n:3d} {kind:9s} {dt * 1e3:7.1f} ms eager ops {eager:5d} "
                f"in-graph {sum(log.graph.values()):5d}  "
                + " ".join(f"{o}:{c}" for o, c in sorted(log.eager.items()) if o in WATCH)
            )
    for kind, ops in by_kind.items():
        print(f"== {kind}: {steps_by_kind[kind]} steps, eager ops per step")
        for o, c in ops.most_common():
            print(f"   {o:32s} {c / steps_by_kind[kind]:8.2f}")
    return 0


WATCH = {"nonzero", "index_add_", "silu", "mm", "bmm", "_local_scalar_dense", "unique", "_unique2", "where"}

if __name__ == "__main__":
    raise SystemExit(main())
