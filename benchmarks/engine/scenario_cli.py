"""`kumo bench engine scenario NAME`: one of Cloudflare's scenarios (`benchmarks/engine/scenarios.py`)
measured warm, A/B/B/A, `--rounds` times; a record with its summary entry, Markdown and PNGs.

    kumo bench engine scenario fp8kv_vs_bf16kv_long_c64 [--layers 4] [--rounds 3] [--budget-s 540]
    kumo bench engine scenario fp8kv_vs_bf16kv_long_c64 --rank-of 8 --layers 2 --warm-up-lengths 16384 1024
    kumo bench engine scenario int4_vs_fp8_decode_c1 --rank-of 8   # rank 0 of 8, full depth
    kumo bench engine scenario integrity_overhead --tp 8           # a real group of 8 ranks, full depth
    kumo bench engine scenario int4_vs_fp8_decode_c1 --tp 8 --side A   # one side (they do not fit together)

Sizes default to the scenario's own; `--tiny` (the CPU tests) swaps in the small geometry and short
lengths. `--compile-cache DIR` is where Triton compiles to (default: Triton's own `~/.triton/cache`);
the record's `machine.is_fresh` says whether this was the first benchmark process on it. Records of
the same scenario from several calls merge with `kumo bench engine report A.json B.json --out X.json`
(their rounds pooled into one summary entry). One-side records (`--side`) run as processes A, B, B, A
combine into the scenario's record with `kumo bench engine combine` (benchmarks/engine/side_records.py).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

from benchmarks.engine import method, report
from benchmarks.engine.scenarios import SCENARIOS

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench engine scenario", description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(SCENARIOS))
    ap.add_argument("--layers", type=int, default=None, help="truncated depth (default: the scenario's)")
    ap.add_argument("--rounds", type=int, default=None, help="A/B/B/A rounds (default: the scenario's, 3)")
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument(
        "--chunk", type=int, default=2048, help="prefill tokens per step (max_num_batched_tokens)"
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-scale", type=float, default=1.0, help="the planned KV pools times this")
    ap.add_argument(
        "--warm-up", action=argparse.BooleanOptionalAction, default=True,
        help="one untimed run of the workload per side before any timing (--no-warm-up: to see a cold run)",
    )  # fmt: skip
    ap.add_argument(
        "--experts-only", action="store_true", help="weights scenarios: INT4 / FP8 routed experts only"
    )
    ap.add_argument("--hf-mode", default="generate", help="vs_transformers_c64: the peer's mode")
    ap.add_argument("--fp8-method", choices=("fp8-block", "fp8-channel"), default="fp8-block")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--tiny", action="store_true", help="small geometry and lengths (CPU tests)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--budget-s", type=float, default=540.0, help="no round starts that would end after this")
    ap.add_argument(
        "--compile-cache", type=Path, default=None, help="Triton's cache (default ~/.triton/cache)"
    )
    ap.add_argument(
        "--rank-of", type=int, default=1,
        help="rank 0's slice of N ranks at full depth, collectives local (their cost modelled)",
    )  # fmt: skip
    ap.add_argument(
        "--tp", type=int, default=1,
        help="a real group of N ranks, one process per device (NCCL; gloo on the CPU), full depth",
    )  # fmt: skip
    ap.add_argument("--ep", type=int, default=0, help="with --tp: expert groups (default: = --tp)")
    ap.add_argument(
        "--dcp", type=int, default=1, help="with --tp: ranks sharing one MLA latent cache by token"
    )
    ap.add_argument(
        "--side", choices=("A", "B"), default=None,
        help="that side alone, its runs and their summary (two processes give the ratio: benchmarks/engine/x8.py)",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="with --side: one more run, untimed, its prefill / mixed / decode steps profiled (rank 0)",
    )  # fmt: skip
    ap.add_argument(
        "--warm-up-lengths", type=int, nargs=2, metavar=("INPUT", "OUTPUT"), default=None,
        help="warm up on these lengths (a long workload's warm-up inside 10 minutes), then probe each "
        "step shape the scheduler plans for the timed runs that this pass missed (warm_plan.py)",
    )  # fmt: skip
    ap.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # the ranks > 0 (tp_group.py)
    ap.add_argument("--tp-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="record path (.json); .md and PNGs beside it")
    return ap


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.tp > 1 and a.rank_of > 1:
        raise SystemExit("kumo bench engine scenario: --tp and --rank-of exclude each other")
    if a.dcp > 1 and a.tp % a.dcp:
        raise SystemExit(f"kumo bench engine scenario: --dcp {a.dcp} must divide --tp {a.tp}")
    start, started_unix_s = time.monotonic(), time.time()
    cache_dir = a.compile_cache or method.default_cache_dir()
    method.compile_cache_env(cache_dir)  # before anything can compile
    machine = method.machine_state(cache_dir)
    import torch

    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.scenarios import ScenarioOptions, measure

    scenario = SCENARIOS[a.name]
    small = {"concurrency": min(scenario.concurrency, 4), "input_len": 64 if scenario.output_len == 1 else 24,
             "output_len": 1 if scenario.output_len == 1 else 6}  # fmt: skip
    sizes = {k: getattr(a, k) or (small[k] if a.tiny else getattr(scenario, k)) for k in small}
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    followers = []
    if a.tp > 1:  # every rank runs this; rank 0 starts the others (benchmarks/engine/tp_group.py)
        from benchmarks.engine import tp_group

        group_store = tp_group.store(a.tp_rank, a.tp, a.tp_port)
        if a.tp_rank == 0:
            followers = tp_group.start_followers(argv, a.tp, group_store.port)
        rank_device = tp_group.rank_device(device, a.tp_rank)
        tp_group.join(a.tp_rank, a.tp, group_store, rank_device)
        device = str(rank_device)
    # the one place a geometry is chosen: "one rank of N" (`--rank-of N`) is the full depth at 1/N width
    collectives = None
    if a.rank_of > 1:
        from benchmarks.engine.rank_of import join_alone

        collectives = join_alone(a.rank_of)
    width = max(a.rank_of, a.tp)
    depth = a.layers or (2 if a.tiny else None if width > 1 else scenario.layers)
    geometry = make_geometry(scenario.kind, depth, tiny=a.tiny, rank_of=width, dcp=a.dcp)
    opts = ScenarioOptions(
        device=device, num_rounds=a.rounds or scenario.num_rounds, chunk=32 if a.tiny and a.chunk == 2048 else a.chunk,
        page_size=a.page_size, deadline=start + a.budget_s, pool_scale=a.pool_scale, is_warm_up=a.warm_up,
        experts_only=a.experts_only, hf_mode=a.hf_mode, fp8_method=a.fp8_method, cuda_graphs=a.cuda_graphs,
        seed=a.seed, collectives=collectives, tp=a.tp, rank=a.tp_rank, ep=a.ep, only=a.side, profile=a.profile,
        warm_input_len=a.warm_up_lengths[0] if a.warm_up_lengths else None,
        warm_output_len=a.warm_up_lengths[1] if a.warm_up_lengths else None, **sizes,
    )  # fmt: skip
    if a.tp_rank > 0:  # a follower: builds its slice, runs rank 0's steps, writes nothing
        measure(a.name, geometry, opts)
        return 0
    record = report.new_record(
        "kumo bench engine scenario " + " ".join(argv), device, geometry.describe(),
        {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, f"scenario:{a.name}",
    )  # fmt: skip
    record["machine"] = machine
    record["started_unix_s"] = started_unix_s  # the order of one-side processes (side_records.py)
    record["parallel"] = {
        "tp": a.tp, "ep": a.ep or max(a.tp, a.rank_of), "dcp": a.dcp,
        "layout": f"a real group of {a.tp} ranks" if a.tp > 1
        else f"rank 0 of {a.rank_of}, alone (collectives local)" if a.rank_of > 1 else "one device",
    }  # fmt: skip
    record["scenarios"] = {a.name: measure(a.name, geometry, opts)}
    record["wall_s"] = time.monotonic() - start
    if followers:
        from benchmarks.engine.tp_group import SideChannel, wait_followers

        record["follower_exit_codes"] = wait_followers(followers)
        record["steps_sent_to_followers"] = SideChannel.num_sent
    out = (
        a.out
        or RESULTS / f"{datetime.date.today().isoformat()}-engine-{a.name}{'-tiny' if a.tiny else ''}.json"
    )
    side = f"-{a.side}" if a.side else ""
    out = out if a.out or not (a.tp > 1 or side) else out.with_name(f"{out.stem}-tp{a.tp}{side}.json")
    paths = report.write(report.finish(record), out)
    print(report.markdown(record))
    print("wrote " + ", ".join(paths))
    return 0
