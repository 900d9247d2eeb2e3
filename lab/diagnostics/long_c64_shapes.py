"""The step shapes and step counts of `fp8kv_vs_bf16kv_long_c64` on each side, from the real scheduler
with a null model on the CPU (the scheduler holds no tensors: its choices do not depend on the model).

    PYTHONPATH=$PWD python lab/diagnostics/long_c64_shapes.py [OUTPUT_LEN ...]

Prints, per side (pool tokens from the rank-of-8 record: FP8 1,364,736, BF16 682,368), the steps of
a 64 x 16,384 / 4,096 run (prefill-carrying, pure decode, preemptions) and, per candidate warm-up
output length, the timed step shapes that warm-up would miss: the warm-up plan of lab/device/r6_long.sh.
"""

from __future__ import annotations

import sys
import time

import torch

from backend.engine.engine import Engine
from benchmarks.engine.null_model import NullModel
from benchmarks.engine.offline import engine_config, run_offline

POOLS = {"fp8-kv": 1_364_736, "bf16-kv": 682_368}


def run(pool_tokens: int, output_len: int) -> dict:
    model = NullModel(vocab_size=64)
    config = engine_config(pool_tokens // 16, 16, "bf16", 64, 2048, cuda_graphs=False)
    engine = Engine(model, config, vocab_size=64, context_window=262_144)  # type: ignore[arg-type]
    r = run_offline(
        engine, variant="sim", concurrency=64, input_len=16384, output_len=output_len, vocab_size=64
    )
    return r.to_dict()


def main(warm_lens: list[int]) -> None:
    torch.set_num_threads(1)
    for side, pool in POOLS.items():
        start = time.perf_counter()
        timed = run(pool, 4096)
        e = timed["extra"]
        shapes = {tuple(s) for s in e["step_shapes"]}
        print(
            f"{side}: steps {timed['steps']}, decode-only {e['decode_steps']}, with prefill {e['prefill_steps']}, "
            f"preemptions {timed['preemptions']}, shapes {len(shapes)} ({time.perf_counter() - start:.0f} s)"
        )
        for n in warm_lens:
            w = run(pool, n)
            missed = sorted(shapes - {tuple(s) for s in w["extra"]["step_shapes"]})
            print(f"  warm-up 64 x 16384 / {n}: steps {w['steps']}, missed {len(missed)}: {missed[:12]}")


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [1024])
