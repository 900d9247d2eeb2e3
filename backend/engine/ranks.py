"""The ranks of a tensor-parallel backend: rank 0 serves, ranks 1..N−1 follow its steps.

`kumo backend --tp N` is N processes, one per device (NCCL on CUDA, gloo on the CPU). Rank 0 is the
backend process: HTTP server, scheduler, block manager, sampler and detokenizer, and rank 0's slice
of the model. It starts ranks 1..N−1 (`python -m backend.server.rank_group`, their settings on stdin, each
killed by the kernel if rank 0 dies), and each of them loads its slice of the checkpoint and builds
the same `Engine` (the same KV pool and step planner), then runs `follow_steps`:

    rank 0 (ModelRunner.run)                       rank r > 0 (follow_steps)
    plan the step (host arrays)
    StepChannel.send(StepInputs)  ── broadcast ──▶  inputs = StepChannel.recv()   (None: stop)
    forward (collectives inside the model)  ◀────▶  forward
    StepChannel.reduce_flags(tag_mismatch)  ◀────▶  StepChannel.reduce_flags(tag_mismatch)
    sample, detokenize

One broadcast per step carries everything the other ranks need: `StepInputs`, the step's host
batch (token ids, positions, page tables with the tags each page must carry, slots, image
embeddings from rank 0's vision tower) and the page tags the block manager changed since the last
step, as one pickled object (`broadcast_object_list`). Sampling metadata stays on rank 0: the
logits are full on every rank (vocab all-gather), and only rank 0 samples. The tag flags are
OR-reduced (all-reduce MAX) before rank 0 samples, so a stale page on any rank aborts that
request, and only it, on every rank (the other ranks hold no per-request state).

Failure: a step that fails on a rank (a peer died, or a collective got no answer within
`--rank-timeout-s`: the process group's timeout) raises `RanksDown`, a retryable error (503,
"busy"); rank 0 also watches its children (backend/server/rank_group.py). Either way rank 0 ends every
request in flight with `RanksDown`, stops the other ranks and exits, and the supervisor (`kumo
serve`'s) starts the whole group again. The other ranks wait for the next step in such a
collective: an idle rank 0 broadcasts a `KeepAlive` every quarter of the timeout, and the ranks meet
in the group's store (`meet`, with the start-up's timeout) before the first one, however much
longer rank 0's set-up takes than theirs.

CUDA graphs (issue 22, deliverable 4): pure-decode steps replay a graph per batch-size bucket on
every rank (backend/engine/decode_graphs.py), the model forward's collectives (the embedding, o_proj
and MoE all-reduces, the logits all-gather, DCP's gathers and reduce-scatters) captured inside it as
NCCL kernels. Outside the graph, eager: the `StepChannel` broadcast (a pickled object) and the flags
all-reduce. Every rank must launch the same collectives in the same order, so
- capture: every rank builds the same engine, so it captures the same buckets, largest first, each
  after one eager warm-up of that bucket (which also creates the NCCL communicators before any
  capture); then `StepChannel.agree` ANDs the ranks' outcomes, and a capture that failed on any rank
  leaves every rank eager. (A failure is a host sync on the decode path: the same code and shapes on
  every rank, so it stops every rank at the same op, none left waiting in a collective);
- replay: whether a step replays, and which bucket, is a function of the broadcast `StepInputs`
  alone (`HostBatch.is_pure_decode`, the number of sequences, the page-table width) and of the
  engine's config, so every rank decides the same, and a padded bucket runs its padding rows
  through the collectives on every rank alike.
Prefill and mixed steps run eagerly, collectives included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from backend.engine.forward_batch import HostBatch
from backend.errors import RanksDown
from backend.server.settings import BackendSettings

VERIFY = -1  # SpecForward.depth of a speculative step's verify forward
GREEDY = -2  # SpecForward.depth of a whole greedy speculative step (backend/engine/speculative/greedy.py)


@dataclass(frozen=True, slots=True)
class SpecForward:
    """Which forward of a speculative step a `StepInputs` is (backend/engine/speculative/forwards.py).
    `depth` GREEDY: the whole step (verify, acceptance and drafts) on the device; VERIFY: the
    target, keeping every row's hidden state; 0: the MTP layer over `rows` of the
    verify's hidden states (the positions just accepted); d > 0: over `rows` of the previous depth's
    proposing rows; with `chain`, its input tokens are the previous depth's drafts, on the device
    (the host batch's are placeholders)."""

    depth: int
    rows: np.ndarray | None = None  # [T] int64 (drafts only)
    chain: bool = False


@dataclass(slots=True)
class StepInputs:
    """One step, as every rank runs it: the planned host batch and the page tags changed since the
    last step ([U, 2] (page, tag), or None). Generic: whatever the step kind, a `HostBatch`; `spec`
    names a speculative step's verify or draft forward (backend/engine/speculative/forwards.py)."""

    host: HostBatch
    tag_updates: np.ndarray | None = None
    spec: SpecForward | None = None


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """Rank 0's broadcast while it has no step to send (`StepChannel.keep_alive`): the others wait
    for the next step in a collective, which fails after `--rank-timeout-s` like any other, so an
    idle group would go down (and restart) once per timeout without it."""


KEEP_ALIVES_PER_TIMEOUT = 4  # an idle rank 0 broadcasts a `KeepAlive` this often per `--rank-timeout-s`


class StepChannel:
    """The per-step collectives of the runtime: rank 0's broadcast of `StepInputs`, and the OR of
    the tag-mismatch flags over all ranks. A failed collective raises `RanksDown` (retryable) and
    calls `on_failure` once, so the backend goes down rather than serve with a missing rank.
    `keep_alive_s`: how long rank 0 may go without a broadcast (`keep_alive_in`: its engine thread's
    longest idle wait, a `KeepAlive` after it), a fraction of the group's collective timeout."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        on_failure: Callable[[str], None] | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.on_failure = on_failure
        self.keep_alive_s = timeout_s / KEEP_ALIVES_PER_TIMEOUT
        self._last_broadcast = time.monotonic()

    def keep_alive_in(self) -> float:
        """Seconds until rank 0 must broadcast again (0: now), counted from its last broadcast: the
        others have waited since then (after the warm-up's last step, through the server's start)."""
        return max(0.0, self._last_broadcast + self.keep_alive_s - time.monotonic())

    def send(self, inputs: StepInputs | None) -> None:
        """Rank 0: the step's inputs to every other rank (None: they stop). Image embeddings go as
        host tensors: a pickled CUDA tensor would come out on rank 0's device in the other ranks."""
        if inputs is not None and inputs.host.image_parts:
            host = dataclasses.replace(inputs.host, image_parts=[p.cpu() for p in inputs.host.image_parts])
            inputs = dataclasses.replace(inputs, host=host)
        box: list[StepInputs | KeepAlive | None] = [inputs]
        self._broadcast(box)

    def recv(self) -> StepInputs | None:
        """Ranks > 0: the next step's inputs, or None to stop (past rank 0's keep-alives)."""
        while True:
            box: list[StepInputs | KeepAlive | None] = [None]
            self._broadcast(box)
            if not isinstance(box[0], KeepAlive):
                return box[0]

    def keep_alive(self) -> None:
        """Rank 0, idle: the others' wait for the next step starts again (`KeepAlive`)."""
        self._broadcast([KeepAlive()])

    def reduce_flags(self, mismatch: torch.Tensor) -> torch.Tensor:
        """[B] bool on each rank → [B] bool, set where any rank set it."""
        flags = mismatch.to(torch.int32)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        return flags.bool()

    def agree(self, is_ok: bool) -> bool:
        """True on every rank when `is_ok` is true on every rank (an all-reduce MIN; start-up only)."""
        flag = torch.tensor([int(is_ok)], dtype=torch.int32, device=self.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        return bool(flag.item())

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Any failure inside is the group's: the other ranks wait in a collective that will not
        complete, so it raises `RanksDown` (and the backend restarts the group)."""
        try:
            yield
        except RanksDown:
            raise
        except Exception as exc:
            raise self._failed(exc) from exc

    def _broadcast(self, box: list[StepInputs | KeepAlive | None]) -> None:
        self._last_broadcast = time.monotonic()
        try:
            dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: Exception) -> RanksDown:
        if self.on_failure is not None:
            self.on_failure(f"{type(exc).__name__}: {exc}")
        return RanksDown(f"A rank of this backend failed ({type(exc).__name__}); it restarts, please retry.")


def rank_device(settings: BackendSettings, rank: int) -> torch.device:
    """Rank r's device: cuda:r (one process per GPU; `--device cuda` or `cuda:0`), or the CPU."""
    device = torch.device(settings.device)
    return torch.device("cuda", rank) if device.type == "cuda" and settings.tp > 1 else device


STARTUP_TIMEOUT_S = 600.0  # the ranks meet once each has imported torch and found its device


def _startup_timeout(settings: BackendSettings) -> timedelta:
    """How long the ranks' start-up may take (`STARTUP_TIMEOUT_S`, or the collectives' if longer)."""
    return timedelta(seconds=max(STARTUP_TIMEOUT_S, settings.rank_timeout_s))


def rank_store(settings: BackendSettings, port: int | None = None) -> dist.TCPStore:  # type: ignore[name-defined]
    """The rank group's store. Rank 0 (`port` None) hosts it on a port the kernel picks, bound here,
    before any rank > 0 is started (`store.port` is what they are given): a port chosen free and
    bound later could be taken in between (schemas/listen.py). Ranks > 0 connect to it on loopback."""
    return dist.TCPStore(  # type: ignore[attr-defined]  # torch re-exports it without __all__
        "127.0.0.1",
        port or 0,
        settings.tp,
        is_master=port is None,
        timeout=_startup_timeout(settings),
        wait_for_workers=False,  # rank 0's: the others start after it (`join_group` waits for them)
    )


def meet(settings: BackendSettings, rank: int, store: dist.Store, stage: str) -> None:  # type: ignore[name-defined]
    """Every rank waits until every rank has reached `stage`, through the group's store, for as long as
    start-up may take (`STARTUP_TIMEOUT_S`): the ranks' set-up differs (rank 0 alone loads the
    tokenizer and the vision tower), and the first collective after it would time out after the
    shorter `--rank-timeout-s` (build_engine meets at "built", before the first)."""
    store.set(f"kumo/{stage}/{rank}", b"")
    keys = [f"kumo/{stage}/{r}" for r in range(settings.tp)]
    store.wait(keys, _startup_timeout(settings))


def join_group(settings: BackendSettings, rank: int, store: dist.Store) -> torch.device:  # type: ignore[name-defined]
    """Join the rank group through `store` (`rank_store`; every rank calls this): NCCL on CUDA, gloo
    on the CPU. Collectives time out after `--rank-timeout-s`, so that a hung rank fails the group
    rather than stall it forever; the meeting at start-up waits longer (`STARTUP_TIMEOUT_S`: rank 0
    is there first, the others import torch before they come), and only then joins the group,
    whose own set-up is bound by the shorter timeout."""
    device = rank_device(settings, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if rank == 0:
        arrived = [f"kumo/arrived/{r}" for r in range(1, settings.tp)]
        store.wait(arrived, _startup_timeout(settings))
    else:
        store.set(f"kumo/arrived/{rank}", b"")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=settings.tp,
        timeout=timedelta(seconds=settings.rank_timeout_s),
    )
    return device


class StepRunner(Protocol):
    def forward_step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]: ...


def follow_steps(runner: StepRunner, channel: StepChannel) -> int:
    """Ranks > 0: run rank 0's steps until it says stop; the number of steps run."""
    num_steps = 0
    while (inputs := channel.recv()) is not None:
        runner.forward_step(inputs)
        num_steps += 1
    return num_steps
