"""Which Triton kernels a workload still compiles after `warm_up` (issue 25's warm-before-ready): the
setup of tests/backend/server/test_warmup.py's CUDA test, printing each new cache entry's kernel name,
constants and specialisation instead of only failing.

    TRITON_CACHE_DIR=/tmp/tc python -m lab.diagnostics.warmup_new_kernels
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.server.warmup import warm_up
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.offline import run_offline
from benchmarks.engine.weights import build_random_model


def entries(cache: Path) -> dict[str, dict]:
    found = {}
    for p in cache.rglob("*.json"):
        if p.name.startswith("__grp__"):
            continue
        with contextlib.suppress(OSError, ValueError):
            found[str(p.relative_to(cache))] = json.loads(p.read_text())
    return found


def main() -> None:
    cache = Path(os.environ.get("TRITON_CACHE_DIR", "/tmp/tc-warm"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    geometry = make_geometry("kimi-k2.6", 2, tiny=True)
    vocab = geometry.model_config.vocab_size
    config = EngineConfig.build(page_size=16, num_pages=512, max_num_seqs=16, max_num_batched_tokens=256)
    engine = Engine(build_random_model(geometry, "int4", device="cuda"), config, vocab_size=vocab,  # type: ignore[arg-type]
                    context_window=4096, model_dtype=torch.bfloat16, device="cuda")  # fmt: skip
    warm_up(engine, is_full=True)
    torch.cuda.synchronize()
    before = entries(cache)
    run_offline(engine, variant="v", concurrency=12, input_len=300, output_len=40, vocab_size=vocab)
    torch.cuda.synchronize()
    after = entries(cache)
    new = {k: v for k, v in after.items() if k not in before}
    print(f"warm-up compiled {len(before)} kernels; the workload {len(new)} more")
    for k, meta in new.items():
        print(
            "NEW",
            k,
            {
                key: meta.get(key)
                for key in ("name", "constants", "attrs", "signature", "num_warps", "num_stages")
            },
        )
        same = [m for m in before.values() if m.get("name") == meta.get("name")]
        for m in same:
            print(
                "   warm variant:",
                {key: m.get(key) for key in ("constants", "attrs", "signature", "num_warps")},
            )


if __name__ == "__main__":
    main()
