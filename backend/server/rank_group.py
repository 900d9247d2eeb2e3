"""The processes of a tensor-parallel backend (`kumo backend --tp N`), and each rank's engine.

Rank 0, the backend process, starts ranks 1..N−1 as `python -m backend.server.rank_group` (`RankGroup`:
their settings on stdin, so the secret never reaches a command line; each one killed by the
kernel if rank 0 dies), and every rank builds the same engine over its slice of the checkpoint
(`build_engine`). Ranks > 0 then follow rank 0's steps (backend/engine/ranks.py) until it sends stop.

When a rank dies (`RankGroup`'s watcher) or a collective fails or times out (`StepChannel`),
`RankFailure` ends every request in flight with `RanksDown` (503, "busy": the gateway retries),
stops the other ranks and exits with `RANKS_DOWN_EXIT`; the supervisor (`kumo serve`'s) then starts
the whole group again. Serving on with a rank missing is not possible: the others would wait in a
collective.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch
import torch.distributed as dist

from backend.engine import heap
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.ranks import StepChannel, follow_steps, join_group, meet, rank_store
from backend.errors import CheckpointError, RanksDown
from backend.models.loader import load_model, num_mtp_layers_in, prepare_model
from backend.server.settings import BackendSettings
from schemas.child_process import die_with_parent

if TYPE_CHECKING:
    from backend.engine.async_engine import AsyncEngine

RANKS_DOWN_EXIT = 3  # the exit status after a rank of the group failed


def build_engine(
    settings: BackendSettings,
    *,
    rank: int = 0,
    device: torch.device | None = None,
    on_rank_failure: Callable[[str], None] | None = None,
    store: dist.Store | None = None,  # type: ignore[name-defined]
) -> Engine:
    """Load rank `rank`'s slice of the checkpoint (all of it with `--tp 1`) and build its engine.
    Every rank of a tensor-parallel group builds the same engine (backend/engine/ranks.py); rank 0's
    steps reach the others through its `StepChannel`, whose failure calls `on_rank_failure`. With
    `--tp N` the ranks meet in the group's `store` once loaded, before the engine's first collective."""
    device = device if device is not None else torch.device(settings.device)
    if device.type == "cuda":  # before any kernel launches or graph captures (triton: CUDA only)
        from kernels.triton_lib import set_pdl

        set_pdl(settings.pdl)
    dtype = getattr(torch, settings.dtype)
    draft = settings.speculative_draft
    num_mtp = num_mtp_layers_in(settings.model, draft) if settings.speculative else 0
    if settings.speculative and not num_mtp:
        raise CheckpointError(
            "--speculative mtp:K needs a checkpoint with MTP layers (num_nextn_predict_layers > 0)"
        )
    loaded = load_model(
        settings.model,
        dtype=dtype,
        device=device,
        rank=rank,
        world_size=settings.tp,
        ep=settings.ep,
        dcp=settings.dcp,
        num_mtp_layers=num_mtp,
        draft=draft if num_mtp else None,
    )
    context_window = settings.context_window or loaded.config.max_position_embeddings
    config = EngineConfig.build(
        page_size=settings.page_size * settings.dcp,  # a block-manager page: page_size on each DCP rank
        num_pages=settings.max_pages,
        kv_dtype=settings.engine_kv_dtype,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        context_window=context_window,
        cuda_graphs=settings.cuda_graphs,  # under --tp N too: the collectives are captured
        tenant_share=settings.tenant_share,
        num_speculative_tokens=settings.speculative,
        speculative_max_seqs=settings.speculative_max_seqs,
        speculative_adaptive=settings.speculative_adaptive,
        speculative_saturation_rows=settings.speculative_saturation_rows,
        speculative_graphs=settings.speculative_graphs,
    )
    # with an FP8 cache: the checkpoint's calibrated scales, else calibrated now with a warning
    prepared = prepare_model(loaded, config, model_dtype=dtype)
    ranks = None
    if settings.tp > 1:
        assert store is not None, "a rank of a group builds its engine with the group's store"
        meet(settings, rank, store, "built")
        ranks = StepChannel(rank, settings.tp, device, on_rank_failure, timeout_s=settings.rank_timeout_s)
    return Engine(
        prepared.model,
        config,
        vocab_size=prepared.vocab_size,
        context_window=context_window,
        model_dtype=dtype,
        device=device,
        kv_scales=prepared.kv_scales,
        ranks=ranks,
    )


class _Launch(msgspec.Struct, frozen=True):
    """What `python -m backend.server.rank_group` reads on stdin (the secret never reaches a command line)."""

    settings: BackendSettings
    rank: int
    port: int


class RankGroup:
    """Rank 0's children, ranks 1..N−1: started together, watched, stopped together.

    A child that exits while the group runs calls `on_lost(rank, exit code)` once (from a watcher
    thread); rank 0 then fails its requests in flight and exits (`RankFailure`)."""

    def __init__(self, settings: BackendSettings, port: int, on_lost: Callable[[int, int], None]) -> None:
        self.on_lost = on_lost
        self._is_stopping = False
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, settings.tp):
            process = subprocess.Popen(
                [sys.executable, "-m", "backend.server.rank_group"],
                stdin=subprocess.PIPE,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
            assert process.stdin is not None
            process.stdin.write(msgspec.json.encode(_Launch(settings, rank, port)))
            process.stdin.close()
            self.processes.append(process)
        self._watcher = threading.Thread(target=self._watch, name="kumo-ranks", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._is_stopping:
            time.sleep(0.1)
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._is_stopping:
                    self._is_stopping = True
                    self.on_lost(rank, code)
                    return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the children to leave (after rank 0 sent None), killing any that does not."""
        self._is_stopping = True
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill(self) -> None:
        self._is_stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()


class RankFailure:
    """What rank 0 does when a rank of its group dies or hangs, or its own engine thread dies
    (`AsyncEngine.on_death`): end every request in flight with `RanksDown` (retryable), give the
    event loop a moment to send those events, stop the other ranks and exit, so that the supervisor
    starts the whole group again. Once, from any thread."""

    GRACE_S = 1.0

    def __init__(self) -> None:
        self.async_engine: AsyncEngine | None = None
        self.group: RankGroup | None = None
        self._lock = threading.Lock()
        self._is_down = False

    def __call__(self, reason: str = "a collective failed") -> None:
        with self._lock:
            if self._is_down:
                return
            self._is_down = True
        threading.Thread(target=self._go_down, args=(reason,), name="kumo-ranks-down", daemon=True).start()

    def _go_down(self, reason: str) -> None:
        what = reason if reason.startswith("the engine thread") else f"the rank group failed ({reason})"
        print(f"kumo backend: {what}; exiting", file=sys.stderr, flush=True)
        if self.async_engine is not None:
            self.async_engine.fail_streams(
                RanksDown("A rank of this backend failed; it restarts, please retry.")
            )
            time.sleep(self.GRACE_S)
        if self.group is not None:
            self.group.kill()
        os._exit(RANKS_DOWN_EXIT)


def _main() -> int:
    """A rank > 0: join the group, load its slice, build the engine, follow rank 0's steps."""
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=_Launch)
    store = rank_store(launch.settings, launch.port)
    device = join_group(launch.settings, launch.rank, store)
    engine = build_engine(launch.settings, rank=launch.rank, device=device, store=store)
    assert engine.runner.ranks is not None
    heap.freeze()  # start-up's heap out of every later full collection (backend/engine/heap.py)
    try:
        follow_steps(engine.runner, engine.runner.ranks)
    except RanksDown:
        return 1
    # NCCL destroys a communicator only once every CUDA graph that captured its collectives is
    # gone (the H200 pair, 2026-12-04: `destroy_process_group` waited forever with them alive)
    del engine
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
