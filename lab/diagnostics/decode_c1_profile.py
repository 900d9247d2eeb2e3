"""Where a c=1 decode step's device time goes (issue 24): GLM 5.2 geometry, one sequence at a 2k
context, CUDA graphs as served; `torch.profiler` over N decode steps after a warm run.

    python -m lab.diagnostics.decode_c1_profile --formats int4-all,fp8 --layers 10 --steps 20
    python -m lab.diagnostics.decode_c1_profile --formats int4-all --pdl on,off   (one model, two engines)
    python -m lab.diagnostics.decode_c1_profile --formats int4-all --layers 78 --rank-of 8   # rank 0 of 8

Prints, per format (and PDL setting: `kernels/triton_lib.py`, set before each engine is built): wall ms per step, device ms per step (sum of kernel time), kernels per step, and
the top kernels by own device time with their count per step. A gap between wall and device time is
host or launch time; device time far above the bytes is a slow kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time

import torch

from backend.engine.engine import Engine
from backend.models.model_config import ModelConfig
from benchmarks.engine.decode_c1 import token_bytes
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.offline import engine_config, run_offline
from benchmarks.engine.weights import build_random_model
from kernels.selection_triton import set_select_method
from kernels.triton_lib import pdl_args, set_pdl


def profile_format(
    fmt: str,
    model: torch.nn.Module,
    config: ModelConfig,
    steps: int,
    input_len: int,
    graphs: bool,
    device: str = "cuda",
    rank_of: int = 1,
) -> dict:
    out_len = 64 + steps
    engine = Engine(
        model,
        engine_config(-(-(input_len + out_len) // 16) + 1, 16, "bf16", 1, 2048, cuda_graphs=graphs),
        vocab_size=config.vocab_size, context_window=config.max_position_embeddings,
        model_dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    weights = sum(token_bytes(model, config.num_experts_per_tok, config.num_routed_experts).values())
    run_offline(engine, variant="warm", concurrency=1, input_len=input_len, output_len=32,
                vocab_size=config.vocab_size)  # fmt: skip

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    state = {"prof": None, "t0": 0.0}
    first, last = 40, 40 + steps

    @contextlib.contextmanager
    def around(step: int, rows: int):
        if step == first:
            sync()
            state["prof"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        yield
        if step == last - 1:
            sync()
            state["wall"] = (time.perf_counter() - state["t0"]) * 1e3 / steps
            state["prof"].__exit__(None, None, None)

    r = run_offline(engine, variant="prof", concurrency=1, input_len=input_len, output_len=out_len,
                    vocab_size=config.vocab_size, around_step=around).to_dict()  # fmt: skip
    prof = state["prof"]
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
               or (e.self_device_time_total > 0 and e.cpu_time_total == 0)]  # fmt: skip
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    device_total = sum(e.self_device_time_total for e in events) / 1e3 / steps
    num_kernels = sum(e.count for e in kernels) / steps
    top = [
        {"name": e.key[:100], "per_step": e.count / steps, "ms_per_step": e.self_device_time_total / 1e3 / steps}
        for e in events[:30] if e.self_device_time_total > 0
    ]  # fmt: skip
    result = {
        "format": fmt, "layers": config.num_hidden_layers, "rank_of": rank_of, "graphs": graphs,
        "pdl": pdl_args(torch.device(device))["PDL"], "wall_ms_per_step": state["wall"],
        "decode_step_ms_p50": r["extra"]["decode_step_ms_p50"], "device_ms_per_step": device_total,
        "kernels_per_step": num_kernels, "weight_bytes": weights, "top": top,
    }  # fmt: skip
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="int4-all,fp8")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--graphs", default="1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--select", choices=("radix", "topk"), default="radix", help="the DSA selection's path")
    ap.add_argument("--pdl", default="on", help="PDL settings to profile in turn: on, off or on,off")
    ap.add_argument("--top", type=int, default=30, help="kernels listed per profile")
    ap.add_argument(
        "--rank-of", type=int, default=1, help="> 1: rank 0's slice of N ranks, collectives local"
    )
    args = ap.parse_args()
    set_select_method(args.select)
    if args.rank_of > 1:
        from benchmarks.engine.rank_of import join_alone

        join_alone(args.rank_of)
    results = []
    for fmt in args.formats.split(","):
        geometry = make_geometry("glm-5.2", args.layers, tiny=args.device == "cpu", rank_of=args.rank_of)
        model = build_random_model(geometry, fmt, device=args.device, seed=0, fp8_method="fp8-block")
        for g in args.graphs.split(","):
            for pdl in args.pdl.split(","):
                set_pdl(pdl == "on")  # before the engine captures its graphs
                res = profile_format(
                    fmt, model, geometry.model_config, args.steps, args.input_len, g == "1", args.device,
                    args.rank_of,
                )  # fmt: skip
                results.append(res)
                print(f"== {fmt} graphs={g} pdl={pdl} (active {res['pdl']}): wall {res['wall_ms_per_step']:.3f} ms/step, "
                      f"p50 {res['decode_step_ms_p50']:.3f}, device {res['device_ms_per_step']:.3f} ms/step, "
                      f"kernels/step {res['kernels_per_step']:.0f}, weights {res['weight_bytes'] / 1e6:.0f} MB")  # fmt: skip
                for t in res["top"][: args.top]:
                    print(f"   {t['ms_per_step']:8.3f} ms  x{t['per_step']:6.1f}  {t['name']}")
        del model
        gc.collect()
    set_pdl(True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
