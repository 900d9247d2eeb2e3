"""Pure-decode steps replayed from CUDA graphs, one graph per batch-size bucket (engine-anchors §4).

A step where every sequence has one new token and one logits row (`HostBatch.is_pure_decode`) runs
in the smallest captured bucket Bk >= B. A graph reads only static buffers: before a replay the step's
values are copied into their first B rows and rows B..Bk get padding values — token 0 at position
0, `seq_len` 1, its one page the scratch page, whose tag it expects, and its slot in that page. The
values cross in the runner's one staged copy (`backend.engine.host_staging`, shared with the step's page-tag
updates), already padded to the bucket, then three device copies fill the buffers (input ids,
positions and slots are rows of one buffer); `seq_lens` is computed inside the graph as position + 1,
what it is for every decode row, padding included. The
scratch page is the KV cache's last page, one past the block manager's pool: never allocated, so it
keeps tag `SCRATCH_TAG` (0, which no allocation ever gets). A padding row therefore writes and reads
only the scratch page and never trips the tag check; its logits and flag are ignored.

The page-table buffers are `max_pages` wide (the longest sequence the engine admits); a row's columns
past its pages hold the scratch page under `PAST_TAG` (-1, as `ForwardBatch` pads them), never a real
(page, tag) pair of an earlier, wider step: every op reads only the `ceil(seq_len / S)` pages a
sequence uses, and a kernel that read past them would see only the scratch page, and flag the row
(issue 27; the kernels never walk past the table's width either: the bound in `kernels/triton_lib.py`).
A padding row's one page, column 0, expects `SCRATCH_TAG` (a whole speculative step's padding
rows read up to position 2k - 1: `pad_cols` columns). The columns are scrubbed
when a step is narrower than the widest written since the last scrub (two fills, not one a step). Kernels size their grids and split counts from that width, known on the
host at capture, never from a device read. The tag-mismatch flags are zeroed inside the graph; the
logits `[Bk, V]` stay in the graph's memory and sampling runs outside.

Narrow graphs (`narrow_pages`): each bucket is also captured over the buffers' first `narrow_pages`
columns only, and a step no wider replays that graph. A model whose path depends on the longest
context bakes its short path into it and its long path into the full width's: GLM-5's DSA runs
dense MLA and no indexer where every sequence is within `index_topk` tokens (`Step.table_tokens`).
The split counts of the short graph's kernels then follow its width too.

Capture (`CudaGraphCapture`): largest bucket first, every graph in one memory pool. Each bucket
first runs once eagerly with torch's sync debug mode at "error", so a host sync anywhere in the
forward (`.item()`, `.tolist()`, `int(tensor)`, a data-dependent shape) raises there, before any
capture; the runner then runs every step eagerly and `disabled_reason` says why (the start-up
warning). Routed quantized experts (INT4, FP8 per channel or in blocks) run as one fused MoE kernel
and capture; a quantized layer with no fused kernel (a non-SiLU activation, INT4 with partial groups)
raises inside `sync_free()` on CUDA, naming its scheme, so the warning says which layer kept decode
eager. Warm-up and capture run inside `backend.engine.sync_free.sync_free()`, where layers take their
fixed-shape paths. A graph reads what its step read by address: every such tensor is a buffer its
owner keeps (a tensor made for one capture and dropped would hand its memory to the next tensor made,
and replays would index with that one's values), and the replay holds the step as well.
`capture` is injectable: `eager_capture` keeps the static buffers and padding but no graph, which is
how the CPU tests check bucketing and padding against the plain eager path.

Tensor parallel (backend/engine/ranks.py): every rank captures the same buckets in the same order,
the model's collectives inside (NCCL kernels in the graph; `--rank-of N`'s local stand-ins as the
plain ops they are); each bucket's eager warm-up runs the collectives first, so the communicators
exist before a capture. The runner then `disable`s the graphs on every rank unless every rank
captured them all. A step's bucket depends only on its `HostBatch` (broadcast to every rank), the
buckets and `max_pages`, so the ranks replay the same graph, padding rows included.

Shapes: B sequences this step, Bk bucket, Mp = max_pages, S page size, V vocab.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from backend.engine.forward_batch import ForwardBatch, HostBatch, KVCache
from backend.engine.host_staging import StagingBuffer
from backend.engine.sync_free import sync_free

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # what CUDAGraph.pool() returns, a tuple[int, int]

SCRATCH_TAG = 0  # the tag of a page never allocated (the block manager's tags start at 1)
PAST_TAG = -1  # what a row expects past its pages: no page carries it, so a read there is a tag fault

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]  # step -> replay returning step's output


def stage_page_tables(
    staging: StagingBuffer,
    host: HostBatch,
    bucket: int,
    num_pages: np.ndarray,
    scratch_page: int,
    pad_cols: int = 1,
) -> tuple[int, int, int]:
    """Stage `host`'s page tables and expected tags as `bucket` rows, at least `pad_cols` wide: the
    columns past each sequence's first `num_pages` [B] hold the scratch page under `PAST_TAG`; the
    padding rows hold it under `SCRATCH_TAG` in their first `pad_cols` columns (those they read: a
    decode's one page, a whole speculative step's chained drafts up to position 2k - 1), `PAST_TAG`
    past them. Returns the staging handles (pages [bucket, W] int32, tags [bucket, W] int64) and W."""
    B, w = host.num_seqs, host.page_table.shape[1]
    width = max(w, pad_cols)
    past = np.arange(width)[None, :] >= num_pages[:, None] if num_pages.min() < width else None
    h_pages, pages = staging.reserve(np.int32, (bucket, width))
    pages[:B, :w], pages[:B, w:], pages[B:] = host.page_table, scratch_page, scratch_page
    if past is not None:  # columns past a row's pages: the scratch page too
        pages[:B][past] = scratch_page
    h_tags, tags = staging.reserve(np.int64, (bucket, width))
    tags[:B, :w], tags[:B, w:] = host.expected_tags, PAST_TAG
    tags[B:, :pad_cols], tags[B:, pad_cols:] = SCRATCH_TAG, PAST_TAG
    if past is not None:
        tags[:B][past] = PAST_TAG
    return h_pages, h_tags, width


def padding_tags(rows: int, max_pages: int, pad_cols: int, device: torch.device) -> torch.Tensor:
    """[rows, max_pages] int64 expected tags of padding rows: `SCRATCH_TAG` in the first `pad_cols`
    columns (the scratch page they read and write), `PAST_TAG` past them."""
    tags = torch.full((rows, max_pages), PAST_TAG, dtype=torch.int64, device=device)
    tags[:, :pad_cols] = SCRATCH_TAG
    return tags


def eager_capture(step: Callable[[], torch.Tensor]) -> Replay:
    """No graph: every replay runs `step` eagerly over the static buffers (the CPU tests' capture)."""
    return step


@contextmanager
def no_collection() -> Iterator[None]:
    """No garbage collection inside: one during a CUDA graph capture may run a finalizer that frees a
    CUDA resource mid-capture, and the process aborts (seen on an H100: a verify-graph capture died in
    a collection inside a Triton launch); torch no longer collects before a capture by default. The
    collector is on again afterwards, exceptions included, unless it was off before."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


class CudaGraphCapture:
    """Sync-checked warm-up, then capture into the pool shared by every bucket captured so far."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: _POOL_HANDLE | None = None

    def __call__(self, step: Callable[[], torch.Tensor]) -> Replay:
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves Stream unannotated
        side.wait_stream(torch.cuda.current_stream(self.device))
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):  # warm-up: compiles kernels, and any host sync raises here
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        if self.pool is None:
            self.pool = graph.pool()
        return CudaGraphReplay(graph, step, out)


class CudaGraphReplay:
    """A captured step. Its graph reads the tensors the step read at capture by their addresses, so
    it keeps the step (and through it those tensors) alive: freed, their memory would go to the next
    tensor the allocator makes, and every replay would read that one."""

    def __init__(
        self, graph: torch.cuda.CUDAGraph, step: Callable[[], torch.Tensor], out: torch.Tensor
    ) -> None:
        self.graph, self.step, self.out = graph, step, out

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class DecodeGraphs:
    """Static input buffers for the largest bucket, and one replay per bucket over their prefixes."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        kv_cache: KVCache,
        *,
        batch_sizes: list[int],
        max_pages: int,
        check_tags: bool,
        capture: Capture,
        staging: StagingBuffer | None = None,
        narrow_pages: int | None = None,
    ) -> None:
        """`staging`: the buffer the step's inputs cross to the device in (the runner's, shared
        with the page-tag updates of the same step; None: one of its own). `narrow_pages`: a second
        graph per bucket over that many columns (None, or not under `max_pages`: none)."""
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(batch_sizes)
        self.max_pages = max_pages
        self.check_tags = check_tags
        self.scratch_page = kv_cache.num_pages - 1
        self.num_replays = 0
        self.disabled_reason: str | None = None
        n, dev = self.batch_sizes[-1], kv_cache.page_tags.device
        S = kv_cache.page_size
        i64, i32 = torch.int64, torch.int32
        self.staging = staging or StagingBuffer(dev)
        # input ids, positions and slots: rows of one buffer, so that they take one copy
        self._vectors = torch.tensor([[0], [0], [self.scratch_page * S]], dtype=i64, device=dev).repeat(1, n)
        self.input_ids, self.positions, self.slot_mapping = self._vectors.unbind(0)  # [n] each
        self.seq_lens = torch.ones(n, dtype=i32, device=dev)  # [n]
        self.page_table = torch.full((n, max_pages), self.scratch_page, dtype=i32, device=dev)  # [n, Mp]
        self.expected_tags = padding_tags(n, max_pages, 1, dev)  # [n, Mp]
        self.tag_mismatch = torch.zeros(n, dtype=torch.bool, device=dev)  # [n]
        self.rows = torch.arange(n, dtype=i64, device=dev)  # logits rows, and the sequence of each row
        self.query_start = torch.arange(n + 1, dtype=i32, device=dev)  # one token per sequence
        # the captured widths, narrowest first: a step replays the first that holds its table
        self.widths = [max_pages]
        if narrow_pages is not None and 0 < narrow_pages < max_pages:
            self.widths.insert(0, narrow_pages)
        self._replays: dict[tuple[int, int], Replay] = {}  # (bucket, width) -> replay
        self._staged: tuple[int, int, list[int]] = (0, 0, [])  # (bucket, width, staging handles)
        self._written_width = 0  # columns [0, this) of some row may hold a real (page, tag) pair
        try:
            for size in reversed(self.batch_sizes):  # largest first: the pool is sized by the first
                for width in reversed(self.widths):
                    batch = self._batch(size, width)
                    self._replays[size, width] = capture(partial(self._step, forward, batch))
        except Exception as exc:  # a capture-unsafe op on the decode path: every step stays eager
            self._replays.clear()
            self.disabled_reason = f"{type(exc).__name__}: {exc}"

    @property
    def is_enabled(self) -> bool:
        return bool(self._replays)

    def disable(self, reason: str) -> None:
        """Every step eager from now on (the ranks did not all capture: `reason` says why)."""
        self._replays.clear()
        self.disabled_reason = self.disabled_reason or reason

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((s for s in self.batch_sizes if s >= num_seqs), None) if self.is_enabled else None

    def run(
        self, host: HostBatch, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(logits [B, V], tag_mismatch [B])` of a pure-decode step, or None when no bucket fits
        (more sequences than the largest bucket, or a sequence wider than the page-table buffers).
        `stage`, the staging buffer's send and `replay` in one (the runner sends once per step, the
        page-tag updates with it). `input_ids` [B] on the device, if given, replace the host's.
        The flags are a copy: the next replay clears the graph's own (a speculative step's chained
        draft depths read theirs only after the last depth ran: a depth's flag was lost, or landed on
        the next depth's row of another sequence)."""
        self.staging.start()
        if self.stage(host) is None:
            return None
        self.staging.send()
        logits, flags = self.replay(host.num_seqs, input_ids)
        return logits, flags.clone()

    def stage(self, host: HostBatch) -> int | None:
        """Stage the step's rows, padded to its bucket (rows B..bucket get the padding values);
        returns the bucket, or None when no bucket fits (nothing staged)."""
        B = host.num_seqs
        bucket = self.bucket_for(B)
        width = host.page_table.shape[1]
        if bucket is None or width > self.max_pages:
            return None
        scratch, S, st = self.scratch_page, self.kv_cache.page_size, self.staging
        h_vectors, vectors = st.reserve(np.int64, (3, bucket))  # ids, positions, slots
        vectors[0, :B], vectors[1, :B], vectors[2, :B] = host.input_ids, host.positions, host.slots
        if bucket > B:
            vectors[:2, B:], vectors[2, B:] = 0, scratch * S
        h_pages, h_tags, _ = stage_page_tables(st, host, bucket, (host.seq_lens + (S - 1)) // S, scratch)
        self._staged = (bucket, width, [h_vectors, h_pages, h_tags])
        return bucket

    def replay(
        self, num_seqs: int, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the static buffers from the sent staging buffer (`stage`), replay the bucket's graph.
        `input_ids` [num_seqs] on the device, if given, replace the staged ones."""
        bucket, width, handles = self._staged
        vectors, pages, tags = (self.staging.view(h) for h in handles)
        self._vectors[:, :bucket].copy_(vectors)
        if input_ids is not None:
            self.input_ids[:num_seqs].copy_(input_ids)
        if self._written_width > width:  # an earlier, wider step's pairs: the scratch page in their place
            self.page_table[:, width : self._written_width].fill_(self.scratch_page)
            self.expected_tags[:, width : self._written_width].fill_(PAST_TAG)
        self._written_width = width
        self.page_table[:bucket, :width].copy_(pages)
        self.expected_tags[:bucket, :width].copy_(tags)
        logits = self._replays[bucket, next(w for w in self.widths if w >= width)]()
        self.num_replays += 1
        return logits[:num_seqs], self.tag_mismatch[:num_seqs]

    def _batch(self, size: int, width: int) -> ForwardBatch:
        """The ForwardBatch a bucket's graph reads: views of the buffers' first `size` rows (and
        `width` columns)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start=self.query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            page_table=self.page_table[:size, :width],
            expected_tags=self.expected_tags[:size, :width],
            slot_mapping=self.slot_mapping[:size],
            logits_indices=self.rows[:size],
            kv_cache=self.kv_cache,
            tag_mismatch=self.tag_mismatch[:size],
            is_decode_only=True,
            logits_are_rows=True,
            check_tags=self.check_tags,
            seq_index=self.rows[:size],
        )

    @staticmethod
    def _step(forward: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        with sync_free():
            batch.tag_mismatch.zero_()
            torch.add(batch.positions, 1, out=batch.seq_lens)  # a decode row's length: its position + 1
            return forward(batch)
