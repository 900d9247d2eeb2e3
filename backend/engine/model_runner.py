"""Owns the KV cache tensors; turns a scheduled step into a `ForwardBatch`, runs the model, samples.

The only module on the scheduler side that touches tensors (`backend.engine.step_planner` builds the step's
host arrays). Before each step it copies the block manager's new page tags into
`KVCache.page_tags`, so the tag check inside the attention ops sees
exactly the allocator's state. The ops check tags on both sides: a write whose destination page no
longer carries the expected tag is dropped, a read of such a page contributes nothing, and either
sets `tag_mismatch`; that request's sampled token is then discarded and the engine aborts it.

Pure-decode steps replay a CUDA graph of their batch-size bucket (`backend.engine.decode_graphs`; on a CUDA
device with `EngineConfig.cuda_graphs`), under tensor parallelism too, the collectives captured
(backend/engine/ranks.py); prefill and mixed steps run eagerly. Either way the step's
host inputs (and the page tags allocated since the last step) cross to the device in one copy
(`backend.engine.host_staging`), and the step reads back one small tensor: the sampled tokens and the
tag-mismatch flags together.

Shape letters: T = new tokens this step, B = sequences, Mp = most pages of one sequence, V = vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from backend.engine.decode_graphs import Capture, CudaGraphCapture, DecodeGraphs
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import CacheSpec, ForwardBatch, KVCache
from backend.engine.host_staging import StagingBuffer, stage_batch, staged_batch, to_device
from backend.engine.page_table import PageTables
from backend.engine.ranks import StepChannel, StepInputs
from backend.engine.sampler import Sampler, SampleRow, TokenScore
from backend.engine.scheduler import SchedulerOutput
from backend.engine.sequence import Sequence
from backend.engine.speculative.forwards import SpecForwards
from backend.engine.step_planner import StepPlanner
from schemas.backend import MAX_DRAFT_TOKENS

log = logging.getLogger("kumo.engine")


class PagedModel(Protocol):
    def cache_specs(self) -> list[list[CacheSpec]]: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(slots=True)
class SeqResult:
    seq: Sequence
    num_new_tokens: int
    is_tag_mismatch: bool
    sample: TokenScore | None = None
    accepted: list[TokenScore] = field(default_factory=list)  # speculative: accepted drafts, before sample
    prompt_scores: list[TokenScore] = field(default_factory=list)  # next-token scores, in order


class ModelRunner:
    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig,
        *,
        model_dtype: torch.dtype,
        vocab_size: int,
        device: torch.device | str = "cpu",
        kv_scales: list[dict[str, float]] | None = None,
        max_seq_len: int | None = None,
        graph_capture: Capture | None = None,
        page_tables: PageTables,
        ranks: StepChannel | None = None,
    ) -> None:
        """`max_seq_len`: the longest sequence admitted (sizes the decode graphs' page tables; None:
        the whole pool). `graph_capture`: how decode graphs are captured; None: CUDA graphs on a CUDA
        device when `config.cuda_graphs`, else none (`decode_graphs.eager_capture` in CPU tests).
        `page_tables`: the block manager's pool, whose rows are the sequences' page tables.
        `ranks`: the other tensor-parallel ranks (backend/engine/ranks.py); under DCP (`model.parallel`) a
        block-manager page of `config.page_size` tokens is page_size/dcp tokens on each rank."""
        self.model = model
        self.ranks = ranks
        parallel = getattr(model, "parallel", None)
        dcp = parallel.dcp if parallel is not None else 1
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.planner = StepPlanner(config.page_size, page_tables)
        self.staging = StagingBuffer(self.device)
        self.sampler = Sampler()
        if graph_capture is None and config.cuda_graphs and self.device.type == "cuda":
            graph_capture = CudaGraphCapture(self.device)
        prepare_cos_sin = getattr(model, "prepare_cos_sin", None)
        if prepare_cos_sin is not None and self.device.type == "cuda":
            # every position a step may compute (the context window, and a speculative step's verify
            # rows and chained drafts past it) from a table: one launch a forward where six were
            # (on the CPU, where launches are free, computed as before)
            prepare_cos_sin((max_seq_len or config.num_pages * config.page_size) + 2 * MAX_DRAFT_TOKENS + 1)
        self.kv_cache = KVCache.allocate(
            model.cache_specs(),
            config.num_pages + (graph_capture is not None),  # the decode graphs' scratch page last
            config.page_size // dcp,
            dtype=config.torch_kv_dtype(model_dtype),
            model_dtype=model_dtype,
            device=self.device,
            scales=kv_scales,
        )
        self.graphs: DecodeGraphs | None = None
        if graph_capture is not None and config.graph_batch_sizes():
            S = config.page_size
            # a model with a cheaper path at short contexts (GLM-5's DSA: `dense_context`) gets a
            # graph per bucket over the pages a context that short spans
            dense_context = getattr(model, "dense_context", None)
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    model.forward,
                    self.kv_cache,
                    batch_sizes=config.graph_batch_sizes(),
                    max_pages=min(-(-(max_seq_len or config.num_pages * S) // S), config.num_pages),
                    check_tags=config.check_page_tags,
                    capture=graph_capture,
                    staging=self.staging,
                    narrow_pages=dense_context // S if dense_context else None,
                )
            # the ranks replay together or not at all: their captured collectives pair up
            if ranks is not None and not ranks.agree(self.graphs.is_enabled):
                self.graphs.disable("decode graphs failed to capture on another rank")
            if self.graphs.disabled_reason is not None:  # at start-up, once: every step runs eagerly
                log.warning("decode steps run eagerly, not from CUDA graphs: %s", self.graphs.disabled_reason)
        # speculative decoding's verify and draft forwards (backend/engine/speculative/forwards.py)
        self.spec_forwards = (
            SpecForwards.build(
                model,
                self.kv_cache,
                config,
                # no decode graphs (none captured, or a rank failed them): no verify or draft graphs either
                capture=graph_capture if self.graphs is not None and self.graphs.is_enabled else None,
                max_seq_len=max_seq_len,
                ranks=ranks,
                staging=self.staging,
            )
            if config.num_speculative_tokens
            else None
        )

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        """Write (page, new tag) pairs into the cache now, outside a step's own copy (tests)."""
        if updates:
            pages, tags = zip(*updates, strict=True)
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.kv_cache.page_tags[index] = torch.tensor(tags, dtype=torch.int64, device=self.device)
            if self.spec_forwards is not None:  # fresh pages: their MTP KV cleared before a draft
                self.spec_forwards.defer_clear(np.array(pages, dtype=np.int64))

    @torch.inference_mode()
    def run(
        self,
        out: SchedulerOutput,
        tag_updates: list[tuple[int, int]] | None = None,
        while_device: Callable[[], None] | None = None,
    ) -> list[SeqResult]:
        """Run one step. `tag_updates`: the block manager's (page, new tag) pairs since the last
        step, written into `KVCache.page_tags` before the model reads a page (one copy with the
        step's inputs). `while_device`: host work to do once the step is launched, before its
        result is read back (on a GPU it overlaps the step's device time)."""
        host, rows = self.planner.plan(out.scheduled)
        inputs = StepInputs(host, np.array(tag_updates, dtype=np.int64) if tag_updates else None)
        if self.ranks is not None:  # the other ranks run the same step (backend/engine/ranks.py)
            self.ranks.send(inputs)
        logits, mismatch = self.forward_step(inputs)
        # every row that wants a token is sampled, flagged or not (a flagged one's token is dropped),
        # so the tokens and the flags come back in one copy
        n = len(rows.sampled)
        sample_rows = [self.sample_row(out.scheduled[b].seq) for b in rows.sampled]
        if rows.is_sample_rows_first:
            picked = logits[:n]
        else:
            picked = logits[to_device(rows.sample_rows, torch.int64, logits.device)]
        chosen = self.sampler.draw(picked, sample_rows) if n else mismatch.new_zeros(0, dtype=torch.int64)
        packed = torch.cat([chosen, mismatch])  # flags promoted to int64
        if while_device is not None:
            while_device()
        back = packed.tolist()  # the step's one copy back
        tokens, flags = back[:n], back[n:]
        results = [
            SeqResult(s.seq, s.num_new_tokens, f != 0) for s, f in zip(out.scheduled, flags, strict=True)
        ]
        if n:
            scores = self.sampler.scores(picked, sample_rows, chosen, tokens)
            for b, score in zip(rows.sampled, scores, strict=True):
                if not results[b].is_tag_mismatch:
                    results[b].sample = score
        for b, (prompt_rows, targets) in rows.prompt.items():
            r = results[b]
            if not r.is_tag_mismatch:
                index = torch.tensor(prompt_rows, dtype=torch.int64, device=logits.device)
                r.prompt_scores = self.sampler.score(
                    logits[index], targets, r.seq.request.sampling.top_logprobs
                )
        return results

    @torch.inference_mode()
    def forward_step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the step, copy it to the device once, run the model: (logits [N, V], tag_mismatch
        [B], OR-reduced over the ranks). Every rank runs this for every step, and for each forward
        of a speculative step (`inputs.spec`)."""
        forward = self._forward
        if inputs.spec is not None:
            assert self.spec_forwards is not None, "speculative forwards need num_speculative_tokens > 0"
            forward = self.spec_forwards.run
        if self.ranks is None:
            return forward(inputs)
        with self.ranks.guard():  # a step failed on one rank leaves the others in a collective
            logits, mismatch = forward(inputs)
            return logits, self.ranks.reduce_flags(mismatch)

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        host, st, graphs, updates = inputs.host, self.staging, self.graphs, inputs.tag_updates
        st.start()
        tags = None
        if updates is not None:  # [U, 2] (page, tag)
            tags = st.add(updates[:, 0]), st.add(updates[:, 1])
        bucket = graphs.stage(host) if graphs is not None and host.is_pure_decode else None
        staged = stage_batch(st, host) if bucket is None else []
        st.send()  # the step's one copy to the device
        if updates is not None and tags is not None:
            self.kv_cache.page_tags.index_copy_(0, st.view(tags[0]), st.view(tags[1]))
            if self.spec_forwards is not None:  # fresh pages: their MTP KV cleared before a draft
                self.spec_forwards.defer_clear(updates[:, 0])
        if graphs is not None and bucket is not None:
            logits, mismatch = graphs.replay(host.num_seqs)
        else:
            batch = staged_batch(st, host, staged, self.kv_cache, check_tags=self.config.check_page_tags)
            logits, mismatch = self.model.forward(batch), batch.tag_mismatch  # [N, V], [B]
        return logits, mismatch

    def synchronize(self) -> None:
        """Wait until nothing launched on the device can still write into the cache."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def find_mismatch(self, seq: Sequence) -> tuple[int, int, int] | None:
        """(page, expected tag, found tag) of the first page of `seq` that changed owner (for logs)."""
        found = self.kv_cache.page_tags.tolist()
        for ref in seq.page_table:
            if not 0 <= ref.page_id < len(found) or found[ref.page_id] != ref.tag:
                got = found[ref.page_id] if 0 <= ref.page_id < len(found) else -1
                return ref.page_id, ref.tag, got
        return None

    def sample_row(self, seq: Sequence) -> SampleRow:
        """`seq`'s sample row, with this step's grammar mask and token guard's bans where it has them."""
        row = seq.sample_row
        if seq.constraint is not None:  # this step's mask
            row.allowed = seq.constraint.allowed_tokens(self.vocab_size)
        if seq.guard is not None:
            row.banned_ids = seq.guard.banned_ids()
        return row
