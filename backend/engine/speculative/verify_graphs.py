"""Speculative verify steps replayed from CUDA graphs, one per (draft length k, batch-size bucket).

A verify step where each of B sequences runs k + 1 rows (its newest token and k drafts), all of them
logits rows, and no image rows, is uniform: it runs in the graph of (k, Bk), Bk the smallest
captured bucket >= B, as decode steps do (backend/engine/decode_graphs.py, whose scratch page and
padding this copies). Rows b·(k+1) … b·(k+1)+k are sequence b's; padding sequences B … Bk get
token 0 at positions 0 … k, their slots in the scratch page (so k + 1 must fit one page), its page
table only the scratch page, under `SCRATCH_TAG` in the columns a padding sequence reads (a whole
step's chained drafts reach position 2K − 1: `pad_cols`): they read and write nothing else and never
trip the tag check. `seq_lens` is computed inside the graph as the last position + 1. Page-table
columns past a real sequence's pages hold the scratch page under `PAST_TAG` (a read there is a tag
fault), scrubbed when a step is narrower than the widest written since (as decode graphs do). The graph returns the logits `[Bk·(k+1), V]` and the hidden
states `[Bk·(k+1), H]` the draft depths read; both stay in the graph's memory.

The k captured are 1 … K (the draft policy may pick any, backend/engine/speculative/policy.py), the buckets
the decode graphs' sizes up to `EngineConfig.speculative_max_seqs` (no drafts past it). As the decode
graphs, each (k, bucket) is also captured over the buffers' first `narrow_pages` columns when given
(GLM-5's DSA: every sequence within `index_topk` tokens runs dense MLA and no indexer, whose top-k
alone was 7 × 16 µs of a 3-draft greedy step's 1.4 ms on an H100); a step no wider replays that graph,
so its path is the decode graphs' at the same length. Replays are keyed (k, bucket, width). Capture goes
through the runner's `Capture` (the decode graphs' memory pool; `eager_capture` in the CPU tests); a
forward that cannot be captured leaves every verify eager and `disabled_reason` says why.

Beside each verify graph, a graph of the whole greedy step over the same buffers (`replay_greedy`:
backend/engine/speculative/greedy.py), when the caller gives one; its page tables' columns hold the
pages of the chained drafts too (`num_pages`), and it reads one more buffer, the ids each row's reasoning
guard bans (`guards`; padding sequences' none). Beside those, when the caller gives one,
a graph of the whole sampled step (backend/engine/speculative/sampled.py) that reads one buffer more,
each sequence's sampling parameters and uniforms (`draws`; padding sequences' greedy). All of a step's
host values cross in one copy.

Every tensor a graph reads is the object's own: the buffers refilled before each replay, and per k
the row layout no replay changes (each sequence's first row, each row's sequence, the logits rows).
A layout made afresh for each capture and dropped with its step was what the H200 replays read on
2026-12-04, after the allocator had reused its memory: an `IndexKernel.cu` index assert.

Shapes: B sequences, Bk bucket, L = k + 1 rows per sequence, Mp max pages, V vocab, H hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import numpy as np
import torch

from backend.engine.decode_graphs import PAST_TAG, Capture, padding_tags, stage_page_tables
from backend.engine.forward_batch import ForwardBatch, HostBatch, KVCache
from backend.engine.host_staging import StagingBuffer
from backend.engine.speculative.greedy import MAX_BANNED
from backend.engine.speculative.sampled import draw_width
from backend.engine.sync_free import sync_free

SpecOutput = tuple[torch.Tensor, torch.Tensor]  # (logits [N, V], hidden [T, H])
Shape = tuple[int, int, int]  # a captured graph's (k, bucket, page-table width)
VerifyReplay = Callable[[], SpecOutput]
# (verify batch, guard rows, k) -> [B, 3 + 2k] int64
GreedyStep = Callable[[ForwardBatch, torch.Tensor, int], torch.Tensor]
# (verify batch, guard rows, draw rows, k) -> [B, 3 + 2k] int64
SampledStep = Callable[[ForwardBatch, torch.Tensor, torch.Tensor, int], torch.Tensor]


class VerifyGraphs:
    """Static buffers sized for the largest (k, bucket), one replay per (k, bucket)."""

    def __init__(
        self,
        forward_spec: Callable[[ForwardBatch], SpecOutput],
        kv_cache: KVCache,
        *,
        max_drafts: int,
        batch_sizes: list[int],
        max_pages: int,
        check_tags: bool,
        capture: Capture,
        greedy: GreedyStep | None = None,
        sampled: SampledStep | None = None,
        staging: StagingBuffer | None = None,
        narrow_pages: int | None = None,
    ) -> None:
        """`greedy`: a whole greedy step over the verify's batch (backend/engine/speculative/greedy.py),
                captured too per (k, bucket) for `replay_greedy`; one that fails to capture leaves only that
                path eager (`greedy_disabled_reason`). `sampled`: a whole sampled step, likewise (`replay_greedy`
        with `sampled`; `sampled_disabled_reason`). `staging`: the buffer a step's host values cross in
                (the runner's, shared with its other inputs; None: one of its own). `narrow_pages`: a second
                graph of each kind per (k, bucket) over that many columns (None, or not under `max_pages`: none)."""
        self.kv_cache, self.max_pages, self.check_tags = kv_cache, max_pages, check_tags
        self.batch_sizes = sorted(batch_sizes)
        S = kv_cache.page_size
        self.draft_lengths = [k for k in range(1, max_drafts + 1) if k + 1 <= S]
        self.scratch_page = kv_cache.num_pages - 1
        self.num_replays = self.num_greedy_replays = 0
        self.disabled_reason: str | None = None
        self.greedy_disabled_reason: str | None = None if greedy is not None else "no greedy step"
        self.sampled_disabled_reason: str | None = None if sampled is not None else "no sampled step"
        n, L, dev = self.batch_sizes[-1], max_drafts + 1, kv_cache.page_tags.device
        i64, i32 = torch.int64, torch.int32
        # input ids, positions and slots: rows of one buffer
        self._vectors = torch.zeros((3, n * L), dtype=i64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self._vectors.unbind(0)  # [n·L] each
        self.seq_lens = torch.ones(n, dtype=i32, device=dev)  # [n]
        self.page_table = torch.full((n, max_pages), self.scratch_page, dtype=i32, device=dev)  # [n, Mp]
        # a padding sequence reads positions 0 … 2K − 1 of the scratch page (a whole step's chained drafts)
        self.pad_cols = min(max_pages, (2 * max_drafts - 1) // S + 1)
        self.expected_tags = padding_tags(n, max_pages, self.pad_cols, dev)  # [n, Mp]
        self.tag_mismatch = torch.zeros(n, dtype=torch.bool, device=dev)  # [n]
        # [n, L, MAX_BANNED] greedy.py's `guard_rows`: nothing banned until a step stages its own
        self.guards = torch.full((n, L, MAX_BANNED), -1, dtype=i64, device=dev)
        self.draws = torch.zeros(
            (n, draw_width(max_drafts)), dtype=torch.float64, device=dev
        )  # [n, W] greedy
        self.rows = torch.arange(n * L, dtype=i64, device=dev)  # [n·L] logits rows: every row is one
        # per k, what a replay never changes: each sequence's first row [n+1] and each row's sequence
        # [n·(k+1)]. Held here, not by the steps: a graph keeps only the addresses it read
        self._layouts = {
            k: (torch.arange(n + 1, dtype=i32, device=dev) * (k + 1), self.rows[: n * (k + 1)] // (k + 1))
            for k in self.draft_lengths
        }
        self._written_width = 0
        # the captured widths, narrowest first: a step replays the first that holds its table
        self.widths = [max_pages]
        # a padding sequence's chained drafts (a whole step's) reach position 2K − 1 of its table
        if narrow_pages is not None and 0 < narrow_pages < max_pages and narrow_pages * S >= 2 * max_drafts:
            self.widths.insert(0, narrow_pages)
        self.staging = staging or StagingBuffer(dev)
        # (rows, bucket, page-table width, (vectors, pages, tags), guards, draws): staging handles
        self._staged: tuple[int, int, int, tuple[int, int, int], int | None, int | None] = (
            0,
            0,
            0,
            (0, 0, 0),
            None,
            None,
        )
        self._replays: dict[Shape, VerifyReplay] = {}
        self._greedy_replays: dict[Shape, Callable[[], torch.Tensor]] = {}
        self._sampled_replays: dict[Shape, Callable[[], torch.Tensor]] = {}
        try:
            for k in reversed(self.draft_lengths):  # largest first: the pool is sized by the first
                self._fill_padding(k)  # a capture's warm-up runs: every row a valid padding row
                for size in reversed(self.batch_sizes):
                    for width in reversed(self.widths):
                        step = partial(self._step, forward_spec, self._batch(k, size, width), k)
                        self._replays[k, size, width] = cast(
                            VerifyReplay, capture(cast(Callable[[], torch.Tensor], step))
                        )
        except Exception as exc:  # a capture-unsafe op on the verify path: every verify stays eager
            self._replays.clear()
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
        if greedy is not None and self._replays:
            self.greedy_disabled_reason = self._capture_whole(
                lambda b, size, k: partial(greedy, b, self.guards[:size, : k + 1], k),
                self._greedy_replays,
                capture,
            )
        if sampled is not None and self._replays:
            self.sampled_disabled_reason = self._capture_whole(
                lambda b, size, k: partial(
                    sampled, b, self.guards[:size, : k + 1], self.draws[:size, : draw_width(k)], k
                ),
                self._sampled_replays,
                capture,
            )

    def _capture_whole(
        self,
        step_of: Callable[[ForwardBatch, int, int], Callable[[], torch.Tensor]],
        replays: dict[Shape, Callable[[], torch.Tensor]],
        capture: Capture,
    ) -> str | None:
        """Capture a whole step (`step_of(batch, size, k)`: its function over the buffers) per (k,
        bucket, width) into `replays`; the reason it failed (those steps then run eagerly), or None."""
        try:
            for k in reversed(self.draft_lengths):
                self._fill_padding(k)
                for size in reversed(self.batch_sizes):
                    for width in reversed(self.widths):
                        batch = self._batch(k, size, width)
                        replays[k, size, width] = capture(
                            partial(self._whole_step, step_of(batch, size, k), batch, k)
                        )
        except Exception as exc:  # the verify graphs stand; these steps run eagerly
            replays.clear()
            return f"{type(exc).__name__}: {exc}"
        return None

    def _fill_padding(self, k: int) -> None:
        """Every sequence of the buffers a padding one for k drafts: positions 0 … k of the scratch page."""
        n, L = self.batch_sizes[-1], k + 1
        pad = torch.arange(L, dtype=torch.int64, device=self._vectors.device).repeat(n)  # [n·L]
        self.input_ids[: n * L].zero_()
        self.positions[: n * L].copy_(pad)
        self.slot_mapping[: n * L].copy_(self.scratch_page * self.kv_cache.page_size + pad)
        self.seq_lens.fill_(L)

    @property
    def is_enabled(self) -> bool:
        return bool(self._replays)

    @property
    def has_greedy(self) -> bool:
        return bool(self._greedy_replays)

    @property
    def has_sampled(self) -> bool:
        return bool(self._sampled_replays)

    def disable(self, reason: str) -> None:
        """Every verify eager from now on (the ranks did not all capture: `reason` says why)."""
        self._replays.clear()
        self._greedy_replays.clear()
        self._sampled_replays.clear()
        self.disabled_reason = self.disabled_reason or reason

    def disable_greedy(self, reason: str) -> None:
        """Every greedy step eager from now on (another rank did not capture them)."""
        self._greedy_replays.clear()
        self.greedy_disabled_reason = self.greedy_disabled_reason or reason

    def disable_sampled(self, reason: str) -> None:
        """Every sampled whole step eager from now on (another rank did not capture them)."""
        self._sampled_replays.clear()
        self.sampled_disabled_reason = self.sampled_disabled_reason or reason

    def shape_of(self, host: HostBatch, *, greedy: bool = False) -> Shape | None:
        """(k, bucket, width) of a uniform verify step that fits a captured graph (with `greedy`, a
        whole step's: the sampled one's when `host.draws` is set), else None. `width`: the narrowest
        captured one that holds the step's page table."""
        B, T = host.num_seqs, len(host.input_ids)
        if not self.is_enabled or B == 0 or T % B or host.image_rows:
            return None
        k = T // B - 1
        bucket = next((s for s in self.batch_sizes if s >= B), None)
        width = next((w for w in self.widths if w >= host.page_table.shape[1]), None)
        if (
            bucket is None
            or width is None
            or (k, bucket, width) not in self._whole_replays(host.draws is not None if greedy else None)
        ):
            return None
        if host.rows_per_seq == k + 1:  # uniform by construction (the greedy planner's)
            return k, bucket, width
        if (
            len(host.logits_indices) != T
            or not np.array_equal(np.diff(host.query_start), np.full(B, k + 1))
            or not np.array_equal(host.logits_indices, np.arange(T))
        ):
            return None
        return k, bucket, width

    def run(self, host: HostBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(logits [T, V], hidden [T, H], tag_mismatch [B]) of a uniform verify step from its graph;
        None when it is not one (the caller runs it eagerly)."""
        shape = self.shape_of(host)
        if shape is None:
            return None
        k = shape[0]
        S = self.kv_cache.page_size
        self.staging.start()
        self.stage(host, shape, (host.seq_lens.astype(np.int64) + (S - 1)) // S)
        self.staging.send()
        self._fill()
        logits, hidden = self._replays[shape]()
        self.num_replays += 1
        B, L = host.num_seqs, k + 1
        return logits[: B * L], hidden[: B * L], self.tag_mismatch[:B]

    def _whole_replays(self, is_sampled: bool | None) -> dict[Shape, Callable[[], torch.Tensor]]:
        """The verify replays (None), the greedy steps' or the sampled steps'."""
        if is_sampled is None:
            return cast(dict[Shape, Callable[[], torch.Tensor]], self._replays)
        return self._sampled_replays if is_sampled else self._greedy_replays

    def replay_greedy(
        self, shape: Shape, num_seqs: int, *, is_sampled: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill the buffers from the sent staging buffer (`stage`), replay the whole-step graph of
        `shape` (k, bucket, width), the sampled one with `is_sampled`: (`[B, 3 + 2k]` int64,
        tag_mismatch [B])."""
        self._fill()
        out = self._whole_replays(is_sampled)[shape]()
        self.num_greedy_replays += 1
        return out[:num_seqs], self.tag_mismatch[:num_seqs]

    def stage(self, host: HostBatch, shape: Shape, num_pages: np.ndarray) -> None:
        """Write `host`'s rows, padded to the bucket of `shape` (k, bucket, width), into the staging buffer
        (sent by the caller, with whatever else its step stages); page table columns past each
        sequence's `num_pages` hold the scratch page. A whole step's guard rows too (`host.guards`),
        and a sampled one's draw rows (`host.draws`)."""
        k, bucket, _ = shape
        B, L, width = host.num_seqs, k + 1, host.page_table.shape[1]
        scratch, S, st = self.scratch_page, self.kv_cache.page_size, self.staging
        n = bucket * L
        h_vectors, vectors = st.reserve(np.int64, (3, n))  # ids, positions, slots
        vectors[0, : B * L], vectors[1, : B * L], vectors[2, : B * L] = (
            host.input_ids,
            host.positions,
            host.slots,
        )
        if bucket > B:  # padding sequences: token 0 at positions 0 … k of the scratch page
            pad = np.tile(np.arange(L), bucket - B)
            vectors[0, B * L :], vectors[1, B * L :], vectors[2, B * L :] = 0, pad, scratch * S + pad
        h_pages, h_tags, width = stage_page_tables(st, host, bucket, num_pages, scratch, self.pad_cols)
        h_guards = None
        if host.guards is not None:
            h_guards, guards = st.reserve(np.int64, (bucket, L, MAX_BANNED))
            guards[:B], guards[B:] = host.guards, -1  # padding sequences: nothing banned
        h_draws = None
        if host.draws is not None:
            h_draws, draws = st.reserve(np.float64, (bucket, host.draws.shape[1]))
            draws[:B], draws[B:] = host.draws, 0.0  # padding sequences: greedy
        self._staged = (n, bucket, width, (h_vectors, h_pages, h_tags), h_guards, h_draws)

    def _fill(self) -> None:
        """The static buffers from the staged rows (after the staging buffer's send)."""
        n, bucket, width, handles, h_guards, h_draws = self._staged
        vectors, pages, tags = (self.staging.view(h) for h in handles)
        if h_guards is not None:
            guards = self.staging.view(h_guards)  # [bucket, L, MAX_BANNED]
            self.guards[:bucket, : guards.shape[1]].copy_(guards)
        if h_draws is not None:
            draws = self.staging.view(h_draws)
            self.draws[:bucket, : draws.shape[1]].copy_(draws)
        self._vectors[:, :n].copy_(vectors)
        if self._written_width > width:  # an earlier, wider step's pairs: the scratch page in their place
            self.page_table[:, width : self._written_width].fill_(self.scratch_page)
            self.expected_tags[:, width : self._written_width].fill_(PAST_TAG)
        self._written_width = width
        self.page_table[:bucket, :width].copy_(pages)
        self.expected_tags[:bucket, :width].copy_(tags)

    def _batch(self, k: int, size: int, width: int) -> ForwardBatch:
        """The ForwardBatch the (k, size, width) graph reads: views of the buffers' first rows (and
        `width` columns), every one of them owned by `self` (the graph reads them at replay, long
        after this batch is gone)."""
        L = k + 1
        query_start, seq_index = self._layouts[k]
        return ForwardBatch(
            input_ids=self.input_ids[: size * L],
            positions=self.positions[: size * L],
            query_start=query_start[: size + 1],
            seq_lens=self.seq_lens[:size],
            page_table=self.page_table[:size, :width],
            expected_tags=self.expected_tags[:size, :width],
            slot_mapping=self.slot_mapping[: size * L],
            logits_indices=self.rows[: size * L],
            kv_cache=self.kv_cache,
            tag_mismatch=self.tag_mismatch[:size],
            is_decode_only=False,
            logits_are_rows=True,  # every row of a uniform verify is a logits row
            check_tags=self.check_tags,
            seq_index=seq_index[: size * L],
        )

    @staticmethod
    def _step(forward_spec: Callable[[ForwardBatch], SpecOutput], batch: ForwardBatch, k: int) -> SpecOutput:
        with sync_free():
            VerifyGraphs._prepare(batch, k)
            return forward_spec(batch)

    @staticmethod
    def _whole_step(step: Callable[[], torch.Tensor], batch: ForwardBatch, k: int) -> torch.Tensor:
        with sync_free():
            VerifyGraphs._prepare(batch, k)
            return step()

    @staticmethod
    def _prepare(batch: ForwardBatch, k: int) -> None:
        batch.tag_mismatch.zero_()
        last = batch.positions.view(-1, k + 1)[:, k]  # [Bk] each sequence's last row
        torch.add(last, 1, out=batch.seq_lens)  # its length after the step
