"""One engine step's input to the model, and the paged KV cache it reads and writes.

This is the seam between the scheduler side (block manager, model runner) and the model side
(layers, attention ops in `kernels/`). The scheduler side fills a `ForwardBatch`; the model reads it.

Shape letters: T = new tokens this step (all sequences, concatenated), B = sequences,
P = physical pages, S = page size (tokens per page), Mp = max pages of any sequence in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """One named per-token tensor a layer keeps in the paged cache.

    MLA: `("latent", (kv_lora_rank + qk_rope_head_dim,))`; GLM-5 also `("index_k", (index_head_dim,))`.
    GQA: `("k", (num_kv_heads, head_dim))` and `("v", (num_kv_heads, head_dim))`.
    `quantizable` is False for tensors that stay in the model dtype even with an FP8 cache.
    """

    name: str
    shape: tuple[int, ...]
    quantizable: bool = True


@dataclass(slots=True)
class KVCache:
    """The physical page pool shared by every request.

    `layers[l][name]` is `[P, S, *spec.shape]` of `dtype` (or the model dtype where the spec is not
    quantizable). `scales[l][name]` is the float scale used when `dtype` is float8 (value = stored *
    scale), 1.0 otherwise. `page_tags[p]` is the tag page p carries now: bumped by the block manager on
    every allocation, read by every op that touches a page.
    """

    layers: list[dict[str, torch.Tensor]]
    scales: list[dict[str, float]]
    page_tags: torch.Tensor  # [P] int64
    page_size: int
    dtype: torch.dtype

    @property
    def num_pages(self) -> int:
        return int(self.page_tags.shape[0])

    @classmethod
    def allocate(
        cls,
        specs: list[list[CacheSpec]],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        model_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        scales: list[dict[str, float]] | None = None,
    ) -> KVCache:
        layers = [
            {
                s.name: torch.zeros(
                    (num_pages, page_size, *s.shape),
                    dtype=dtype if s.quantizable else model_dtype,
                    device=device,
                )
                for s in layer_specs
            }
            for layer_specs in specs
        ]
        if scales is None:
            scales = [{s.name: 1.0 for s in layer_specs} for layer_specs in specs]
        page_tags = torch.zeros(num_pages, dtype=torch.int64, device=device)
        return cls(layers=layers, scales=scales, page_tags=page_tags, page_size=page_size, dtype=dtype)


@dataclass(slots=True)
class ImageEmbeds:
    """Rows of T whose input embedding is replaced by a vision-tower output."""

    token_indices: torch.Tensor  # [N] int64 indices into T
    embeds: torch.Tensor  # [N, hidden]


def _ints(dtype: type = np.int64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass(slots=True)
class HostBatch:
    """A step's inputs as host numpy arrays, before they become a `ForwardBatch` (or fill the static
    buffers of a captured decode step, `backend.engine.decode_graphs`). Field meanings, dtypes and padding
    as in ForwardBatch; `page_table` / `expected_tags` are as wide as the step's widest sequence."""

    input_ids: np.ndarray = field(default_factory=_ints)  # [T] int64
    positions: np.ndarray = field(default_factory=_ints)  # [T] int64
    slots: np.ndarray = field(default_factory=_ints)  # [T] int64
    seq_index: np.ndarray = field(default_factory=_ints)  # [T] int64
    query_start: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int32))  # [B+1] int32
    seq_lens: np.ndarray = field(default_factory=lambda: _ints(np.int32))  # [B] int32
    logits_indices: np.ndarray = field(default_factory=_ints)  # [N] int64
    page_table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))  # [B, Mp]
    expected_tags: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))  # [B, Mp]
    image_rows: list[int] = field(default_factory=list)  # rows of T that are image placeholders
    image_parts: list[torch.Tensor] = field(default_factory=list)  # their embeddings, in order
    # one new token and one logits row per sequence, in order, and no image rows (set by the planner)
    is_pure_decode: bool = False
    # every sequence runs this many rows, every row a logits row, in order, no image rows (a uniform
    # verify: set by the greedy speculative planner); 0: not known
    rows_per_seq: int = 0
    # a whole greedy speculative step's ids banned by token guards, [B, L, S] int64 -1 padded
    # (backend/engine/speculative/greedy.py `guard_rows`); None in every other step
    guards: np.ndarray | None = None
    # a whole sampled speculative step's sampling parameters and uniforms, [B, 3 + 2k + 1] float64
    # (backend/engine/speculative/sampled.py `draw_rows`); None in every other step
    draws: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(slots=True)
class ForwardBatch:
    """Everything the model needs for one step over B sequences.

    Sequence b's new tokens are rows `query_start[b]:query_start[b+1]` of T; they sit at absolute
    positions `positions[...]`, and after this step sequence b has `seq_lens[b]` tokens in the cache
    (its cached prefix plus these). Its pages are `page_table[b, :ceil(seq_lens[b] / S)]`, each
    expected to carry `expected_tags[b, i]`. New tokens' KV goes to `slot_mapping[t]` (= page * S +
    offset). Any op that finds a page whose tag differs from the expected one sets `tag_mismatch[b]`
    and lets that page contribute nothing; the engine then aborts sequence b. With `check_tags` False
    (`EngineConfig.check_page_tags`, for measuring the check's cost) no op reads a tag.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start: torch.Tensor  # [B+1] int32, cumulative
    seq_lens: torch.Tensor  # [B] int32
    page_table: torch.Tensor  # [B, Mp] int32, padded with 0 past each sequence's pages
    expected_tags: torch.Tensor  # [B, Mp] int64, padded with -1
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64 rows of T whose logits are computed
    kv_cache: KVCache
    tag_mismatch: torch.Tensor  # [B] bool, written by the ops
    is_decode_only: bool = False  # every sequence has exactly one new token
    # `logits_indices` is 0 … T − 1, every row in order (a decode graph's, a uniform verify's, a chained
    # draft depth's, a pure decode step's): the model takes the rows as they are, no gather launch
    logits_are_rows: bool = False
    check_tags: bool = True  # False: the ops skip the tag check (EngineConfig.check_page_tags)
    image_embeds: ImageEmbeds | None = None
    seq_index: torch.Tensor = field(
        default_factory=lambda: torch.empty(0, dtype=torch.int64)
    )  # [T] b of each row

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
