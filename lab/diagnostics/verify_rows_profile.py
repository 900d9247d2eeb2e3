"""Issue 28: why a verify step over k + 1 rows costs so much more than a plain step at rank 0 of 8.

The GLM 5.2 projection (benchmarks/results/2026-12-05-mtp-gpu.json, H100) fitted 0.109 ms a layer for
a plain c=1 step, 0.153 for k = 1 (a verify over 2 rows, one draft) and 0.171 for k = 3 (4 rows, three
drafts): the second row costs +40% a layer, the next two +12% together. Random routing puts ~1 more
routed expert a row on a rank (~19 MB of INT4 at 6144 x 2048 x 3, ~6 us of copy), which explains a few
percent, not 40%. This names the kernels that grow.

Per kind of step (plain, spec_k1, spec_k3) on the projection's engine (`benchmarks.engine.mtp_gpu`'s
build: GLM 5.2 rank-0-of-8 slice at `--depth` layers, random INT4 experts, one random MTP layer, CUDA
graphs, c = 1): two warm-up runs, then one run with a few steady steps under `torch.profiler`; printed
per kind: device ms a step and the top kernels by device time a step; then each kernel's growth from
plain to spec_k1 and spec_k3 (device us a step), largest first.

    python3 -m lab.diagnostics.verify_rows_profile --depth 8 --out verify_rows.json
    python3 -m lab.diagnostics.verify_rows_profile --tiny --device cpu   # CPU smoke (own CPU time)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import torch

PROFILED_STEPS = 4  # steady steps profiled per kind (after the first few of the run)
SKIP_STEPS = 6  # steps of the profiled run left alone first (prefill, first decode steps)


def _kernel_key(name: str) -> str:
    """A kernel's name without template arguments and launch-config suffixes (a Triton kernel's
    specialisation, cuBLAS's tile names), so the same kernel groups across kinds."""
    name = re.sub(r"<.*>", "", name)
    return name[:90]


class _Profiled:
    """`around_step` for `run_offline`: profiles PROFILED_STEPS steady steps after SKIP_STEPS."""

    def __init__(self, is_cuda: bool, k: int, engine: Any) -> None:
        self.is_cuda, self.k, self.engine = is_cuda, k, engine
        self.steps = 0
        self.per_kernel: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.total_us = 0.0

    @contextlib.contextmanager
    def __call__(self, step: int, decode_rows: int) -> Iterator[None]:
        steady = decode_rows == 1 and step >= SKIP_STEPS
        if not steady or self.steps >= PROFILED_STEPS:
            yield
            return
        greedy0 = self.engine.spec.num_greedy_steps if self.k else 0
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.is_cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            yield
            if self.is_cuda:
                torch.cuda.synchronize()
        if self.k and self.engine.spec.num_greedy_steps == greedy0:
            return  # not a whole speculative step
        self.steps += 1
        for e in prof.key_averages():
            if self.is_cuda:  # the device's own events only (kernels, copies): an op's time is its kernels'
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                us = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
            else:
                us = float(e.self_cpu_time_total)
            if us <= 0:
                continue
            key = _kernel_key(e.key)
            self.per_kernel[key] = self.per_kernel.get(key, 0.0) + us
            self.count[key] = self.count.get(key, 0) + e.count
            self.total_us += us

    def table(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        return {
            "steps_profiled": self.steps,
            "us_per_step": self.total_us / n,
            "kernels": {
                k: {"us_per_step": v / n, "calls_per_step": self.count[k] / n}
                for k, v in sorted(self.per_kernel.items(), key=lambda kv: -kv[1])
            },
        }


def profile_kinds(
    depth: int, ks: list[int], device: str, tiny: bool, rank_of: int, tokens: int
) -> dict[str, Any]:
    from backend.engine.engine import Engine
    from backend.engine.engine_config import EngineConfig
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.offline import run_offline
    from benchmarks.engine.rank_of import join_alone
    from benchmarks.engine.weights import build_random_model

    join_alone(rank_of)
    geometry = make_geometry("glm-5.2", depth, tiny=tiny, rank_of=rank_of)
    config = geometry.model_config
    model = build_random_model(geometry, "int4", device=device, num_mtp_layers=1)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    input_len = 16 if tiny else 512
    out: dict[str, Any] = {}
    for k in ks:
        engine_config = EngineConfig.build(
            num_pages=-(-(input_len + tokens + 8) // 16) + 1, page_size=16,
            max_num_batched_tokens=max(input_len, 64), max_num_seqs=1, enable_prefix_cache=False,
            cuda_graph_batch_sizes=(1,), num_speculative_tokens=k, speculative_adaptive=False,
        )  # fmt: skip
        engine = Engine(
            model, engine_config, vocab_size=config.vocab_size,
            context_window=config.max_position_embeddings,  # type: ignore[arg-type]
            model_dtype=dtype, device=device,
        )  # fmt: skip
        kw = {"concurrency": 1, "input_len": input_len, "output_len": tokens, "vocab_size": config.vocab_size}
        for seed in (101, 102):
            run_offline(engine, variant=f"warm-k{k}-{seed}", seed=seed, **kw)
        prof = _Profiled(device.startswith("cuda"), k, engine)
        run_offline(engine, variant=f"prof-k{k}", seed=1, around_step=prof, **kw)
        out["plain" if k == 0 else f"spec_k{k}"] = prof.table()
        del engine
    return out


def growth(kinds: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kernel: device us a step in each speculative kind minus plain's, largest growth first."""
    plain = kinds.get("plain", {}).get("kernels", {})
    rows: dict[str, dict[str, float]] = {}
    for kind, t in kinds.items():
        if kind == "plain":
            continue
        for name, v in t["kernels"].items():
            rows.setdefault(name, {})[kind] = v["us_per_step"] - plain.get(name, {}).get("us_per_step", 0.0)
        for name, v in plain.items():
            rows.setdefault(name, {}).setdefault(kind, -v["us_per_step"])
    return dict(sorted(rows.items(), key=lambda kv: -max(kv[1].values(), default=0.0)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--ks", default="0,1,3")
    ap.add_argument("--rank-of", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps a run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.tiny:
        a.rank_of, a.tokens = min(a.rank_of, 2), min(a.tokens, 14)
    ks = [int(x) for x in a.ks.split(",")]
    kinds = profile_kinds(a.depth, ks, a.device, a.tiny, a.rank_of, a.tokens)
    unit = "device" if a.device.startswith("cuda") else "CPU"
    for kind, t in kinds.items():
        print(f"== {kind}: {t['us_per_step']:.1f} us {unit} a step over {t['steps_profiled']} steps")
        for name, v in list(t["kernels"].items())[: a.top]:
            print(f"  {v['us_per_step']:9.1f} us  x{v['calls_per_step']:6.1f}  {name}")
    g = growth(kinds)
    print(f"== growth over plain (us {unit} a step), largest first")
    for name, d in list(g.items())[: a.top]:
        print("  " + "  ".join(f"{kind} {v:+8.1f}" for kind, v in d.items()) + f"  {name}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"depth": a.depth, "rank_of": a.rank_of, "kinds": kinds, "growth": g}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
