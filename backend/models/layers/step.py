"""Per-step facts every layer needs, derived once from the ForwardBatch.

Shapes: T new tokens, B sequences, S page size, Dr rotary dims / 2 per cos/sin row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.forward_batch import ForwardBatch
from backend.models.layers.context_parallel import local_writes
from backend.models.layers.parallel import DcpGroup
from kernels.kv_write import KvWriteArgs, kv_write
from kernels.op_args import KvLines
from kernels.paged_gather import PagedBatch


@dataclass(slots=True)
class Step:
    batch: ForwardBatch
    token_seq: torch.Tensor  # [T] int64 sequence of each new token
    token_expected_tags: torch.Tensor | None  # [T] int64 tag each destination page must carry; None: off
    cos: torch.Tensor  # [T, Dr]
    sin: torch.Tensor  # [T, Dr]
    pages: PagedBatch  # what every page-reading kernel op reads of this step
    # tokens the page table's columns span, known on the host: no sequence of the step is longer (a
    # graph's table is its capture's width, an eager step's its widest sequence's)
    table_tokens: int
    topk_indices: torch.Tensor | None = None  # DSA: the last full indexer layer's choice, [T, K]
    # the MLA cache sharded by token over a DCP group (backend/models/layers/context_parallel.py)
    dcp: DcpGroup | None = None
    slot_mapping: torch.Tensor | None = None  # [T] this rank's destinations under DCP; None: the batch's

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dcp: DcpGroup | None = None,
        expected_tags: torch.Tensor | None = None,
    ) -> Step:
        """`expected_tags` [T] int64: the tag each new token's destination page carries, when the
        caller has it (gathered once for several forwards); None, or under DCP (each rank's own
        writes): derived from the batch here."""
        T = batch.num_tokens
        if batch.seq_index.numel() == T:
            token_seq = batch.seq_index.long()
        else:
            qs = batch.query_start.long()
            q_lens = qs[1:] - qs[:-1]  # [B]
            token_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=qs.device), q_lens)
        pages = PagedBatch(
            query_start=batch.query_start,
            seq_lens=batch.seq_lens,
            page_table=batch.page_table,
            expected_tags=batch.expected_tags,
            page_tags=batch.kv_cache.page_tags,
            tag_mismatch=batch.tag_mismatch,
            is_decode=batch.is_decode_only,
            check_tags=batch.check_tags,
        )
        # a column stands for a page of S tokens, or under DCP for S on each rank of the group
        table_tokens = batch.page_table.shape[1] * batch.kv_cache.page_size * (dcp.size if dcp else 1)
        if dcp is not None:  # each rank writes only its own tokens, at its own slots
            slots, expected = local_writes(batch, token_seq, dcp.rank, dcp.size)
            return cls(batch, token_seq, expected, cos, sin, pages, table_tokens, dcp=dcp, slot_mapping=slots)
        expected = None  # the tag check off: no tag is read
        if batch.check_tags and expected_tags is not None:
            expected = expected_tags
        elif batch.check_tags:
            # a token's position is its index in its sequence: its page is column position // S, the
            # one its slot is in (three launches; a graph node each)
            page_col = batch.positions // batch.kv_cache.page_size
            expected = batch.expected_tags[token_seq, page_col.clamp(max=batch.expected_tags.shape[1] - 1)]
        return cls(batch, token_seq, expected, cos, sin, pages, table_tokens)

    def write(
        self, layer_idx: int, name: str, values: torch.Tensor, also: tuple[str, torch.Tensor] | None = None
    ) -> None:
        """Store this step's new `values [T, *shape]` for `layer_idx`/`name` into the paged cache; and
        `also` = (name2, values2 [T, *shape2]), another of the layer's caches, in the same launch (a DSA
        layer's latent and indexer keys, GQA's K and V)."""
        kv = self.batch.kv_cache
        second = None
        if also is not None:
            second = KvLines(kv.layers[layer_idx][also[0]], also[1], kv.scales[layer_idx][also[0]])
        kv_write(
            KvWriteArgs(
                kv.layers[layer_idx][name],
                values,
                self.batch.slot_mapping if self.slot_mapping is None else self.slot_mapping,
                kv.scales[layer_idx][name],
                kv.page_tags,
                self.token_expected_tags,
                self.token_seq,
                self.batch.tag_mismatch,
                second,
            )
        )
