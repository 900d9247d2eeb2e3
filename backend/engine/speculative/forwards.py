"""The forwards of a speculative step, as every rank runs them (backend/engine/speculative/decoder.py
decides them).

A speculative step is several forwards: the verify (the target over every chunk and the drafts) and
the draft depths (the MTP layer). Rank 0 plans each one as a `HostBatch` and sends it to the other
tensor-parallel ranks as `StepInputs` whose `spec` says which forward it is (backend/engine/ranks.py);
every rank then runs it here, through `ModelRunner.forward_step` like a plain step (tag flags OR-reduced
over the ranks). The hidden states a draft depth reads stay on each rank's device: a draft names
their rows, never ships them (under tensor parallelism every rank holds the whole hidden state).

Verify steps where every sequence verifies the same number of drafts k replay a CUDA graph of their
(k, batch-size bucket, page-table width) when the runner captures graphs (backend/engine/speculative/
verify_graphs.py; every kind of graph here is captured at the decode graphs' widths, a narrow one
for a model with a cheaper path at short contexts: GLM-5's DSA); any other verify runs eagerly. Depth 0 after such a verify has the same layout: each sequence's k + 1 verify
rows, the tokens after its accepted ones padded (rows past them write MTP KV at positions that are
rewritten before any query reads them, as rejected drafts' are), so it replays a graph of the same
kind over the MTP layer (`propose_graphs`) and keeps each sequence's row of its last accepted token.
Draft depths 1 … K−1 (one row per sequence: decode-shaped) replay decode graphs of the MTP layer
(`DecodeGraphs` over a forward that reads its hidden states from a static buffer and writes the new
ones to another). A depth d > 0 whose `SpecForward.chain` is set reads its input tokens from the
previous depth's argmax on the device, not from the host batch, so a step's draft depths run back
to back without a round trip to the host; `drafted` holds each depth's tokens until rank 0 reads them.

`SpecForward(GREEDY)` is a whole greedy step (backend/engine/speculative/greedy.py), or a whole sampled
one when its batch carries draw rows (backend/engine/speculative/sampled.py): from the verify graphs'
graph of its kind and (k, bucket), else eagerly, on every rank alike. Either way its inputs and
the step's page-tag updates (and its token guards' rows) cross in one copy (the runner's staging
buffer) and the host reads one tensor back, as in a plain decode step.

Shape letters: T tokens of a forward, N logits rows, V vocabulary, H hidden, P proposing sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import numpy as np
import torch

from backend.engine.decode_graphs import Capture, DecodeGraphs
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import ForwardBatch, HostBatch, ImageEmbeds, KVCache
from backend.engine.host_staging import (
    NUM_HOST_BUFFERS,
    StagingBuffer,
    array_to_device,
    stage_batch,
    staged_batch,
    to_device,
)
from backend.engine.ranks import GREEDY, VERIFY, SpecForward, StepInputs
from backend.engine.speculative.greedy import greedy_step
from backend.engine.speculative.sampled import sampled_step
from backend.engine.speculative.verify_graphs import VerifyGraphs
from schemas.backend import MAX_DRAFT_TOKENS

log = logging.getLogger("kumo.engine")


class SpecForwards:
    """Runs a speculative step's forwards on one rank, and keeps the hidden states between them."""

    def __init__(
        self,
        model: Any,
        kv_cache: KVCache,
        *,
        check_tags: bool,
        page_size: int,
        graphs: VerifyGraphs | None = None,
        staging: StagingBuffer | None = None,
    ) -> None:
        """`page_size`: the block manager's (the unit of the host's slots and page tables).
        `staging`: the buffer an eager greedy step's inputs cross in, in one copy (the runner's, as
        the verify graphs'; None: one of its own)."""
        self.model, self.kv_cache, self.check_tags = model, kv_cache, check_tags
        self.page_size = page_size
        self.graphs = graphs
        self.device = kv_cache.page_tags.device
        self.staging = staging or StagingBuffer(self.device)
        self.draft_graphs: list[DecodeGraphs] = []  # per MTP layer: depths 1 … K−1 (`capture_drafts`)
        self.propose_graphs: VerifyGraphs | None = (
            None  # depth 0 after a uniform verify (`capture_proposals`)
        )
        self._propose_hidden = torch.empty(0)  # [n·(K+1), H] the propose graphs' static input
        self._hidden_in = self._hidden_out = torch.empty(0)  # [n, H] the draft graphs' static buffers
        self.hidden: torch.Tensor | None = None  # the verify's [T, H]
        self._last: torch.Tensor | None = None  # the last depth's proposing rows [P, H]
        self._ids: torch.Tensor | None = None  # [P] each proposing row's newest draft (argmax)
        self.drafted: list[torch.Tensor] = []  # this step's draft tokens, per depth: [P], then [live]
        # pages allocated by plain steps, their MTP KV not cleared yet (`defer_clear`) [num_pages]
        self._stale = np.zeros(kv_cache.num_pages, dtype=np.bool_)
        self._has_stale = False

    @classmethod
    def build(
        cls,
        model: Any,
        kv_cache: KVCache,
        config: EngineConfig,
        *,
        capture: Capture | None,
        max_seq_len: int | None,
        ranks: Any = None,
        staging: StagingBuffer | None = None,
    ) -> SpecForwards:
        """With verify and draft graphs when the runner captures decode graphs (`capture`): k = 1 … K,
        the decode graphs' batch sizes up to `speculative_max_seqs`, page tables as wide as theirs
        (`max_seq_len` tokens; None: the whole pool). `ranks` (a StepChannel): the tensor-parallel ranks
        agree on each kind of graph, as on the decode graphs: one rank replaying a captured step beside
        another running it eagerly would pair collectives of different sizes. `staging`: the runner's
        staging buffer, which the verify graphs' steps cross in (None: their own)."""
        S = config.page_size
        max_pages = min(-(-(max_seq_len or config.num_pages * S) // S), config.num_pages)
        # a model with a cheaper path at short contexts (GLM-5's DSA) gets narrow graphs of every
        # kind, as the decode graphs (backend/engine/model_runner.py)
        dense_context = getattr(model, "dense_context", None)
        narrow = dense_context // S if dense_context else None
        sizes = [s for s in config.graph_batch_sizes() if s <= config.speculative_max_seqs]
        graphs = None
        if not config.speculative_graphs:
            capture = None
        if capture is not None and sizes:
            with torch.inference_mode():
                graphs = VerifyGraphs(
                    model.forward_spec,
                    kv_cache,
                    max_drafts=config.num_speculative_tokens,
                    batch_sizes=sizes,
                    max_pages=max_pages,
                    check_tags=config.check_page_tags,
                    capture=capture,
                    greedy=functools.partial(_greedy, model, S),
                    sampled=functools.partial(_sampled, model, S),
                    staging=staging,
                    narrow_pages=narrow,
                )
            if ranks is not None and not ranks.agree(graphs.is_enabled):
                graphs.disable("verify graphs failed to capture on another rank")
            if ranks is not None and graphs.is_enabled and not ranks.agree(graphs.has_greedy):
                graphs.disable_greedy("greedy step graphs failed to capture on another rank")
            if ranks is not None and graphs.is_enabled and not ranks.agree(graphs.has_sampled):
                graphs.disable_sampled("sampled step graphs failed to capture on another rank")
            if graphs.disabled_reason is not None:  # at start-up, once
                log.warning("verify steps run eagerly, not from CUDA graphs: %s", graphs.disabled_reason)
            elif graphs.greedy_disabled_reason is not None:
                log.warning("greedy speculative steps run eagerly: %s", graphs.greedy_disabled_reason)
            elif graphs.sampled_disabled_reason is not None:
                log.warning(
                    "sampled speculative steps take the host path: %s", graphs.sampled_disabled_reason
                )
        forwards = cls(
            model, kv_cache, check_tags=config.check_page_tags, page_size=S, graphs=graphs, staging=staging
        )
        if capture is not None and graphs is not None and graphs.is_enabled:
            forwards.capture_proposals(sizes, max_pages, capture, config, narrow)
            if ranks is not None and not ranks.agree(forwards.propose_graphs is not None):
                if forwards.propose_graphs is not None:
                    log.warning("depth-0 drafts run eagerly: their graphs failed to capture on another rank")
                forwards.propose_graphs = None
        if capture is not None and sizes and config.num_speculative_tokens > 1 and hasattr(model, "config"):
            forwards.capture_drafts(sizes, max_pages, capture, narrow)
            if ranks is not None and not ranks.agree(bool(forwards.draft_graphs)):
                if forwards.draft_graphs:
                    log.warning("draft steps run eagerly: their graphs failed to capture on another rank")
                forwards.draft_graphs = []
        return forwards

    def capture_proposals(
        self,
        batch_sizes: list[int],
        max_pages: int,
        capture: Capture,
        config: EngineConfig,
        narrow_pages: int | None = None,
    ) -> None:
        """Graphs of depth 0 over a uniform verify's rows, one per (k, bucket, width) as the verify's."""
        K, H = config.num_speculative_tokens, self.model.config.hidden_size
        rows = max(batch_sizes) * (K + 1)
        self._propose_hidden = torch.zeros(rows, H, dtype=self.model.dtype, device=self.device)
        with torch.inference_mode():
            graphs = VerifyGraphs(
                self._propose_step,
                self.kv_cache,
                max_drafts=K,
                batch_sizes=batch_sizes,
                max_pages=max_pages,
                check_tags=self.check_tags,
                capture=capture,
                narrow_pages=narrow_pages,
            )
        if graphs.disabled_reason is not None:
            log.warning("depth-0 drafts run eagerly, not from CUDA graphs: %s", graphs.disabled_reason)
            return
        self.propose_graphs = graphs

    def _propose_step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A captured depth 0: every row a logits row, hidden states in through the static buffer."""
        T = batch.input_ids.shape[0]
        out: tuple[torch.Tensor, torch.Tensor] = self.model.forward_mtp(batch, self._propose_hidden[:T], 0)
        return out

    def capture_drafts(
        self, batch_sizes: list[int], max_pages: int, capture: Capture, narrow_pages: int | None = None
    ) -> None:
        """Decode graphs of each MTP layer, for draft depths d > 0 (layer d mod L), at the decode
        graphs' widths (`narrow_pages`)."""
        n, H = max(batch_sizes), self.model.config.hidden_size
        self._hidden_in = torch.zeros(n, H, dtype=self.model.dtype, device=self.device)
        self._hidden_out = torch.zeros_like(self._hidden_in)
        with torch.inference_mode():
            for layer in range(self.model.num_mtp_layers):
                # depths 1 ... K-1 of a step replay one layer's graphs back to back: a host buffer
                # each, so that none waits for an earlier depth's copy (backend/engine/host_staging.py)
                staging = StagingBuffer(
                    self.device, num_host_buffers=max(NUM_HOST_BUFFERS, MAX_DRAFT_TOKENS - 1)
                )
                graphs = DecodeGraphs(
                    functools.partial(self._draft_step, layer),
                    self.kv_cache,
                    batch_sizes=batch_sizes,
                    max_pages=max_pages,
                    check_tags=self.check_tags,
                    capture=capture,
                    narrow_pages=narrow_pages,
                    staging=staging,
                )
                if graphs.disabled_reason is not None:
                    log.warning("draft steps run eagerly, not from CUDA graphs: %s", graphs.disabled_reason)
                    self.draft_graphs = []
                    return
                self.draft_graphs.append(graphs)

    def _draft_step(self, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """A captured draft depth: hidden states in and out through the static buffers."""
        B = batch.num_seqs
        logits, g = self.model.forward_mtp(batch, self._hidden_in[:B], layer)  # [B, V], [B, H]
        self._hidden_out[:B].copy_(g)
        out: torch.Tensor = logits
        return out

    def clear_draft_kv(self, pages: torch.Tensor) -> None:
        """Zero the MTP layers' cache slots of newly allocated `pages` (each speculative step's tag
        updates, and those `defer_clear` kept from plain steps; on every rank). A position computed
        in a step without drafts gets no MTP KV until its sequence catches up (backend/engine/
        speculative/book.py; a gap given up stays zeros); a draft never reads what an earlier owner
        of the page left (the tag check cannot tell: the page is the sequence's own by then).
        `pages` [U] on the device."""
        for layer in self.kv_cache.layers[len(self.kv_cache.layers) - self.model.num_mtp_layers :]:
            for cache in layer.values():  # as bytes: FP8 caches have no index_fill; zero bits are 0.0
                cache.view(torch.uint8).index_fill_(0, pages, 0)

    def defer_clear(self, pages: np.ndarray) -> None:
        """The newly allocated `pages` [U] (host) of a step without drafts: the next speculative
        forward clears their MTP KV (`clear_draft_kv`), before any MTP layer runs. Until then no MTP
        layer reads or writes a page (a plain step runs none), so the clear comes in time, and a step
        that drafts nothing launches nothing a step with speculation off would not."""
        self._stale[pages] = True
        self._has_stale = True

    def _take_deferred(self) -> np.ndarray | None:
        """The pages `defer_clear` kept since the last speculative forward [D] int64, now forgotten."""
        if not self._has_stale:
            return None
        pages = np.flatnonzero(self._stale).astype(np.int64)
        self._stale[pages] = False
        self._has_stale = False
        return pages

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, V], tag_mismatch [B]) of the forward `inputs.spec` names."""
        spec, host = inputs.spec, inputs.host
        assert spec is not None, "a speculative forward names its kind"
        if spec.depth == GREEDY:
            return self._greedy(host, inputs.tag_updates)
        self._update_tags(inputs.tag_updates)
        if spec.depth == VERIFY:
            replayed = self.graphs.run(host) if self.graphs is not None else None
            if replayed is not None:
                logits, self.hidden, mismatch = replayed
                return logits, mismatch
            batch = self.batch(host)
            logits, self.hidden = self.model.forward_spec(batch)  # [N, V], [T, H]
            return logits, batch.tag_mismatch
        assert spec.rows is not None, "a draft names the hidden-state rows it reads"
        index = array_to_device(spec.rows, self.device)
        if spec.depth == 0:
            logits, mismatch = self._depth0(host, index)
        else:
            logits, mismatch = self._chained(host, index, spec)
        ids = logits.argmax(dim=-1)  # [P] or [live]: the next depth's input, and the drafts
        if spec.depth == 0:
            self._ids, self.drafted = ids, [ids]
        else:
            assert self._ids is not None
            self._ids = self._ids.index_copy(0, index, ids)
            self.drafted.append(ids)
        return logits, mismatch

    def _update_tags(self, tag_updates: np.ndarray | None) -> None:
        """Write the step's [U, 2] (page, tag) pairs into the cache before any page is read; clear
        the MTP KV of its fresh pages and of those deferred by plain steps. One copy."""
        deferred = self._take_deferred()
        parts = [a.reshape(-1) for a in (tag_updates, deferred) if a is not None]
        if not parts:
            return
        sent = array_to_device(np.concatenate(parts), self.device)  # [2U + D]
        U = 0 if tag_updates is None else len(tag_updates)
        if U:
            updates = sent[: 2 * U].view(U, 2)
            self.kv_cache.page_tags.index_copy_(0, updates[:, 0], updates[:, 1])
            self.clear_draft_kv(updates[:, 0])  # fresh pages: no stale MTP KV
        if deferred is not None:
            self.clear_draft_kv(sent[2 * U :])

    def _greedy(self, host: HostBatch, tag_updates: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole greedy step, or sampled one (`host.draws`): (`[B, 3 + 2k]` int64, tag_mismatch
        [B]), from its graph when one fits, else eagerly (the same function); its inputs and the tag
        updates in one copy."""
        B, S, graphs = host.num_seqs, self.page_size, self.graphs
        k = len(host.input_ids) // B - 1
        assert host.guards is not None, "a greedy step carries its guard rows"
        shape = graphs.shape_of(host, greedy=True) if graphs is not None else None
        st = graphs.staging if graphs is not None and shape is not None else self.staging
        st.start()
        tags = (st.add(tag_updates[:, 0]), st.add(tag_updates[:, 1])) if tag_updates is not None else None
        deferred = self._take_deferred()
        stale = st.add(deferred) if deferred is not None else None
        if graphs is not None and shape is not None:
            num_pages = (host.seq_lens.astype(np.int64) + k - 1 + S - 1) // S  # the chained drafts' too
            graphs.stage(host, shape, num_pages)
        else:
            handles = stage_batch(st, host)
            guards = st.add(host.guards)
            draws = st.add(host.draws) if host.draws is not None else None
        st.send()  # the step's one copy to the device
        if tags is not None:
            pages = st.view(tags[0])
            self.kv_cache.page_tags.index_copy_(0, pages, st.view(tags[1]))
            self.clear_draft_kv(pages)  # fresh pages: no stale MTP KV
        if stale is not None:
            self.clear_draft_kv(st.view(stale))
        if graphs is not None and shape is not None:
            return graphs.replay_greedy(shape, B, is_sampled=host.draws is not None)
        batch = staged_batch(st, host, handles, self.kv_cache, check_tags=self.check_tags)
        if draws is not None:
            return sampled_step(self.model, batch, st.view(guards), st.view(draws), k, S), batch.tag_mismatch
        return greedy_step(self.model, batch, st.view(guards), k, S), batch.tag_mismatch

    def _depth0(self, host: HostBatch, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth 0 over the verify's hidden rows `index`: from a propose graph when the rows are a
        uniform verify's (every row given, `host.logits_indices` picking each sequence's last)."""
        assert self.hidden is not None, "a draft follows the verify"
        source = self.hidden[index]  # [T, H]
        if self.propose_graphs is not None:
            T = len(host.input_ids)
            whole = dataclasses.replace(host, logits_indices=np.arange(T, dtype=np.int64))
            if self.propose_graphs.shape_of(whole) is not None:
                self._propose_hidden[:T].copy_(source)
                replayed = self.propose_graphs.run(whole)
                assert replayed is not None
                logits, g, mismatch = replayed
                pick = array_to_device(host.logits_indices, self.device)
                self._last = g[pick]
                return logits[pick], mismatch
        batch = self.batch(host)
        logits, g = self.model.forward_mtp(batch, source, 0)  # [P, V], [T, H]
        self._last = g[batch.logits_indices]
        return logits, batch.tag_mismatch

    def _chained(
        self, host: HostBatch, index: torch.Tensor, spec: SpecForward
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depth d > 0: one row per live sequence, reading its previous depth's hidden state (and,
        with `spec.chain`, its previous draft as the input token)."""
        assert self._last is not None and self._ids is not None, "depth d > 0 follows depth d - 1"
        ids = self._ids[index] if spec.chain else None
        if self.draft_graphs:
            graphs = self.draft_graphs[spec.depth % len(self.draft_graphs)]
            P = len(spec.rows) if spec.rows is not None else 0
            if graphs.bucket_for(P) is not None:
                self._hidden_in[:P].copy_(self._last[index])
                drafted = graphs.run(host, input_ids=ids)  # (logits [P, V], tag_mismatch [P]), or None
                if drafted is not None:
                    self._last = self._last.index_copy(0, index, self._hidden_out[:P])
                    return drafted
        batch = self.batch(host)
        if ids is not None:
            batch.input_ids = ids
        logits, g = self.model.forward_mtp(batch, self._last[index], spec.depth)  # [P, V], [P, H]
        self._last = self._last.index_copy(0, index, g)  # its new hidden state replaces its last one
        return logits, batch.tag_mismatch

    def batch(self, h: HostBatch) -> ForwardBatch:
        """An eager ForwardBatch over `h` (each field copied to the device)."""
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return array_to_device(a, dev)

        image_embeds = None
        if h.image_rows:
            image_embeds = ImageEmbeds(
                token_indices=to_device(h.image_rows, torch.int64, dev),
                embeds=torch.cat(h.image_parts).to(dev),
            )
        return ForwardBatch(
            input_ids=t(h.input_ids),
            positions=t(h.positions),
            query_start=t(h.query_start),
            seq_lens=t(h.seq_lens),
            page_table=t(h.page_table),
            expected_tags=t(h.expected_tags),
            slot_mapping=t(h.slots),
            logits_indices=t(h.logits_indices),
            kv_cache=self.kv_cache,
            tag_mismatch=torch.zeros(h.num_seqs, dtype=torch.bool, device=dev),
            is_decode_only=len(h.input_ids) == h.num_seqs,
            check_tags=self.check_tags,
            image_embeds=image_embeds,
            seq_index=t(h.seq_index),
        )


def _greedy(model: Any, page_size: int, batch: ForwardBatch, guards: torch.Tensor, k: int) -> torch.Tensor:
    """`greedy_step` as the verify graphs capture it: (batch, guard rows, k)."""
    return greedy_step(model, batch, guards, k, page_size)


def _sampled(
    model: Any, page_size: int, batch: ForwardBatch, guards: torch.Tensor, draws: torch.Tensor, k: int
) -> torch.Tensor:
    """`sampled_step` as the verify graphs capture it: (batch, guard rows, draw rows, k)."""
    return sampled_step(model, batch, guards, draws, k, page_size)
