"""How every engine comparison is measured (issue 25): warm, interleaved, repeated, and honest about
the machine it ran on.

    warm-up   before any timing, each side runs the timed workload once untimed (same lengths, same
              concurrency, so the scheduler takes the same steps): every step shape the timed runs
              take — prefill chunk sizes, prefill chunks beside each count of decode rows, decode at
              each batch width (each CUDA-graph bucket) — compiles there. The step shapes of the
              warm pass and of the timed runs are both recorded, and the record says which timed
              shape (if any) the warm pass missed.
    order     rounds of A, B, B, A: a side that goes first absorbs whatever is still cold, and
              drift over a round (clocks, heat) weighs on both sides alike.
    repeats   `rounds` rounds (3 by default); each gives one ratio, (a1 + a2) / (b1 + b2), where a
              linear drift over the round cancels exactly.
    summary   `{"value": median of the ratios, "samples": [ratio per round], "spread": [min, max]}`;
              each round also records `same_side_spread`, how far its two A runs and its two B
              runs differ (max / min − 1): the round's own noise floor.
    machine   `is_fresh`: this is the first benchmark process to use this compile cache (no marker
              file in it yet); the Triton cache's entry count at start beside it.

A step shape is `(prefill tokens, decode rows)`: the tokens of the prompt chunks the step ran and the
sequences it ran one new token for, as the benchmark's loop counts them around `Engine.step()`.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROUND = ("A", "B", "B", "A")
MARKER = "kumo-bench-first-run"
Shape = tuple[int, int]  # (prefill tokens, decode rows) of one step


def order(num_rounds: int) -> list[str]:
    """The sides in the order they run: A, B, B, A per round."""
    return [side for _ in range(num_rounds) for side in ROUND]


def round_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """One round's A / B: (a1 + a2) / (b1 + b2), in which a drift linear in time cancels."""
    return sum(a) / sum(b)


def summary_entry(samples: Sequence[float]) -> dict[str, Any]:
    """The summary's form of one key: the median of the per-round ratios, the ratios, their range."""
    values = list(samples)
    return {"value": statistics.median(values), "samples": values, "spread": [min(values), max(values)]}


def interleave(
    run: Callable[[str], dict[str, Any]],
    metric: Callable[[dict[str, Any]], float],
    *,
    num_rounds: int,
    time_left: Callable[[], float],
    first_round_s: float = 0.0,
) -> list[dict[str, Any]]:
    """`num_rounds` rounds of `run("A")`, `run("B")`, `run("B")`, `run("A")`, each with its ratio of
    `metric`. A round starts only when it would still fit in `time_left()`: the first by the estimate
    `first_round_s`, every later one by the time the round before it took."""
    rounds: list[dict[str, Any]] = []
    last_s, left = first_round_s, time_left()
    while len(rounds) < num_rounds and left > last_s:
        runs = [dict(run(side), side=side) for side in ROUND]
        a = [metric(r) for r in runs if r["side"] == "A"]
        b = [metric(r) for r in runs if r["side"] == "B"]
        rounds.append(
            {
                "order": list(ROUND),
                "runs": runs,
                "ratio": round_ratio(a, b),
                "same_side_spread": same_side_spread(a, b),
            }
        )
        now = time_left()
        last_s, left = left - now, now
    return rounds


def same_side_spread(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """How far a round's two runs of one side differ, max / min − 1 per side: the round's own noise
    floor (on a machine that flips between states mid-round, a ratio no further from 1 than this says
    nothing; the H100s of 2026-12-07 ran the same plain step at 0.43 and 0.71 ms within one call)."""
    return {side: (max(v) / min(v) - 1.0) if min(v) > 0 else float("inf") for side, v in (("A", a), ("B", b))}


def missing_shapes(warm: Iterable[Sequence[int]], timed: Iterable[Sequence[int]]) -> list[list[int]]:
    """The timed step shapes the warm-up never ran, sorted (empty: the warm-up covered them all)."""
    seen = {tuple(s) for s in warm}
    return sorted([list(s) for s in {tuple(s) for s in timed} - seen])


def machine_state(cache_dir: Path) -> dict[str, Any]:
    """Whether this is the first benchmark process on this compile cache, then marks it as used.

    `cache_dir` is the Triton cache the process compiles into (`compile_cache_env`); a fresh machine
    has no marker there, and usually no entries either."""
    marker = cache_dir / MARKER
    is_fresh = not marker.exists()
    entries = sum(1 for _ in cache_dir.iterdir()) - (not is_fresh) if cache_dir.is_dir() else 0
    state = {
        "compile_cache_dir": str(cache_dir),
        "is_fresh": is_fresh,
        "compile_cache_entries_at_start": entries,
        "first_run": marker.read_text().strip() if not is_fresh else None,
    }
    cache_dir.mkdir(parents=True, exist_ok=True)
    if is_fresh:
        marker.write_text(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds") + "\n")
    return state


def compile_cache_env(cache_dir: Path) -> None:
    """Point Triton's compile cache at `cache_dir` (read when the first kernel compiles, so this runs
    before any model is built)."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)


def default_cache_dir() -> Path:
    """Triton's own default cache folder, which a process that sets nothing compiles into."""
    return Path.home() / ".triton" / "cache"
