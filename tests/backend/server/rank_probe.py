"""Test-only probes into the ranks of a running `kumo backend --tp N`, installed at start-up by
rank_hook/sitecustomize.py when `environment()` put that folder on the backend's PYTHONPATH.

- `dump`: each rank writes what its KV pool holds when the group stops cleanly (rank 0 sends the
  ranks stop on SIGTERM): rank 0 `rank-0.json` with its block manager's tags and reference
  counts, the tags in its KV cache, its free and total pages and the number of steps it ran; rank
  r > 0 `rank-r.json` with the tags in its KV cache and the number of steps it followed. Every
  rank's pool is then observable, not only rank 0's `/v1/load`.
- `fault_seq_len`: rank 1 gets one stale page, as a bug in it would leave: before the first
  pure-decode step in which a sequence has that many tokens or more, the sequence's last page (the
  one it is filling: never shared through the prefix cache) gets a tag in rank 1's cache that the
  block manager never gave it (as `_FaultOnFirstDecode` in
  tests/backend/engine/test_ranks_engine.py does in-process). Rank 0's pages stay as they are.
- `build_delay_s`: rank 0 starts building its engine this much later than it would (as a large
  tokenizer or vision tower, which rank 0 alone loads, makes it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
HOOK = Path(__file__).resolve().parent / "rank_hook"
DUMP = "KUMO_TEST_RANK_DUMP"
FAULT = "KUMO_TEST_RANK_FAULT_SEQ_LEN"
DELAY = "KUMO_TEST_RANK0_BUILD_DELAY_S"
STALE = 1_000_003  # added to the page's tag: a tag the block manager never handed out


def environment(
    *, dump: Path | None = None, fault_seq_len: int | None = None, build_delay_s: float | None = None
) -> dict[str, str]:
    """Environment variables for a backend with the probes (on top of the test's own)."""
    env = {"PYTHONPATH": f"{HOOK}{os.pathsep}{ROOT}"}
    if build_delay_s is not None:
        env[DELAY] = str(build_delay_s)
    if dump is not None:
        env[DUMP] = str(dump)
    if fault_seq_len is not None:
        env[FAULT] = str(fault_seq_len)
    return env


def read_dumps(dump: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((dump / f"rank-{r}.json").read_text()) for r in range(world_size)]


class _StaleTag:
    """Rank 1's step runner with the fault (see the module docstring)."""

    def __init__(self, runner: Any, seq_len: int) -> None:
        self.runner, self.seq_len, self.is_done = runner, seq_len, False

    def forward_step(self, inputs: Any) -> Any:
        host = inputs.host
        if not self.is_done and host.is_pure_decode and (host.seq_lens >= self.seq_len).any():
            self.is_done = True
            row = int((host.seq_lens >= self.seq_len).nonzero()[0][0])
            last = (int(host.seq_lens[row]) - 1) // self.runner.kv_cache.page_size  # (without DCP)
            self.runner.kv_cache.page_tags[int(host.page_table[row, last])] += STALE
        return self.runner.forward_step(inputs)


def install(rank: int | None) -> None:
    """Wrap the rank's step loop (ranks > 0) or its engine and stop message (rank 0)."""
    import backend.engine.ranks as ranks

    dump = Path(os.environ[DUMP]) if os.environ.get(DUMP) else None
    fault = int(os.environ[FAULT]) if os.environ.get(FAULT) else None
    if rank is None:  # before the rank's main module imports `follow_steps`
        follow = ranks.follow_steps

        def follow_steps(runner: Any, channel: Any) -> int:
            is_faulty = fault is not None and channel.rank == 1
            num_steps = follow(_StaleTag(runner, fault) if is_faulty else runner, channel)  # type: ignore[arg-type]
            if dump is not None:
                tags = runner.kv_cache.page_tags.tolist()
                (dump / f"rank-{channel.rank}.json").write_text(
                    json.dumps({"page_tags": tags, "num_steps": num_steps})
                )
            return num_steps

        ranks.follow_steps = follow_steps
        return
    import backend.server.rank_group as rank_group  # before backend.server.app imports `build_engine`

    engines: list[Any] = []
    build, send = rank_group.build_engine, ranks.StepChannel.send

    def build_engine(*args: Any, **kwargs: Any) -> Any:
        time.sleep(float(os.environ.get(DELAY) or 0))
        engines.append(build(*args, **kwargs))
        return engines[-1]

    def send_or_stop(channel: Any, inputs: Any) -> None:
        if inputs is None and dump is not None and engines:
            engine = engines[0]
            bm = engine.block_manager
            load = engine.load()
            state = {
                "page_tags": engine.runner.kv_cache.page_tags.tolist(),
                "block_tags": bm.tags,
                "refcounts": bm.refcounts,
                "load": [load.free_pages, load.total_pages],
                "num_steps": engine.stats.steps,
            }
            (dump / "rank-0.json").write_text(json.dumps(state))
        send(channel, inputs)

    rank_group.build_engine = build_engine
    ranks.StepChannel.send = send_or_stop  # type: ignore[method-assign]
