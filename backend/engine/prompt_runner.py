"""Running whole prompts through a paged model outside the engine, for calibration and evaluation.

A call runs a group of sequences over one private page pool (each sequence its own pages, in
order). Prompts are fed in chunks of at most `chunk` tokens per sequence (whole when None), many
sequences per model step up to `step_tokens` tokens, as the engine batches chunked prefills; every
chunk after the first attends to KV read back from the cache (FP8 when asked), and every op checks
page tags as in the engine. `generate` then decodes one token per unfinished sequence per step from
that cache, greedily, as the engine's decode steps do. Image rows (serving's `image_encoder`
output) replace the placeholder tokens' embeddings, as the engine's `ImageEmbeds` do.
Shape letters: T tokens of a step, S page size, V vocab, H hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from backend.engine.forward_batch import ForwardBatch, ImageEmbeds, KVCache


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    image_positions: list[int] = field(default_factory=list)  # placeholder positions, in order
    image_embeds: torch.Tensor | None = None  # [len(image_positions), H]


@dataclass(frozen=True, slots=True)
class Generated:
    token_ids: list[int]  # without the stop token
    stop_id: int | None  # the stop token that ended it; None when it ran to the limit


@dataclass(slots=True)
class _Seq:
    prompt: Prompt
    token_ids: list[int]
    first_page: int
    num_pages: int


class PromptRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        model_dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        scales: list[dict[str, float]] | None = None,
        page_size: int = 16,
        chunk: int | None = 8,
        step_tokens: int = 8192,
    ) -> None:
        self.model, self.model_dtype = model, model_dtype
        self.kv_dtype = kv_dtype or model_dtype
        self.scales, self.page_size = scales, page_size
        self.chunk, self.step_tokens = chunk, step_tokens
        self.kv: KVCache | None = None
        self.device = next(model.parameters()).device

    # ---- one sequence --------------------------------------------------------------------------
    def logits(self, ids: list[int], *, reserve: int = 0) -> torch.Tensor:
        """float32 logits [T, V] (on the CPU) at every position of `ids`; `self.kv` keeps the filled
        cache, with room for `reserve` more tokens."""
        (logits,) = self.score([Prompt(list(ids))], [0], reserve=reserve)
        return logits.cpu()

    def greedy(
        self, ids: list[int], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()
    ) -> list[int]:
        """Argmax decoding after a chunked prefill; stops at a stop id (not returned) or the limit."""
        return self.generate([Prompt(list(ids))], max_new_tokens, stop_ids)[0].token_ids

    def cache_amax(self, num_tokens: int) -> list[dict[str, float]]:
        """Per layer, per cached tensor: max |value| over the first `num_tokens` slots just written."""
        assert self.kv is not None
        return [
            {name: float(t.flatten(0, 1)[:num_tokens].float().abs().amax()) for name, t in layer.items()}
            for layer in self.kv.layers
        ]

    # ---- a group of sequences --------------------------------------------------------------------
    @torch.no_grad()
    def score(self, prompts: list[Prompt], starts: list[int], *, reserve: int = 0) -> list[torch.Tensor]:
        """Per prompt: float32 logits [len - start, V] (on the model's device) at positions
        `start … len - 1`, i.e. predicting tokens `start + 1 …` and the one after the prompt."""
        seqs = self._start(prompts, reserve)
        parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in self._prefill_steps(seqs):
            want = [range(max(lo, starts[b]), hi) for b, lo, hi in step]
            logits = self._forward(seqs, step, want)
            row = 0
            for (b, _, _), w in zip(step, want, strict=True):
                parts[b].append(logits[row : row + len(w)])
                row += len(w)
        return [torch.cat(p) if p else torch.empty(0) for p in parts]

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()
    ) -> list[Generated]:
        """Greedy continuations of every prompt, decoded together; each stops at a stop id or the limit."""
        seqs = self._start(prompts, max_new_tokens)
        last: dict[int, torch.Tensor] = {}
        for step in self._prefill_steps(seqs):
            ends = [range(hi - 1, hi) if hi == len(seqs[b].token_ids) else range(0) for b, _, hi in step]
            logits = self._forward(seqs, step, ends)
            finished = [b for (b, _, _), r in zip(step, ends, strict=True) if len(r)]
            last.update({b: logits[k] for k, b in enumerate(finished)})
        out: list[list[int]] = [[] for _ in seqs]
        stopped: list[int | None] = [None] * len(seqs)
        active = list(range(len(seqs)))
        next_ids = torch.stack([last[b] for b in active]).argmax(-1).tolist() if seqs else []
        for _ in range(max_new_tokens):
            still = []
            for b, token in zip(active, next_ids, strict=True):
                if token in stop_ids:
                    stopped[b] = token
                    continue
                out[b].append(token)
                seqs[b].token_ids.append(token)
                still.append(b)
            active = still
            if not active or len(out[active[0]]) == max_new_tokens:
                break
            step = [(b, len(seqs[b].token_ids) - 1, len(seqs[b].token_ids)) for b in active]
            next_ids = self._forward(seqs, step, [range(lo, hi) for _, lo, hi in step]).argmax(-1).tolist()
        return [Generated(o, s) for o, s in zip(out, stopped, strict=True)]

    # ---- internals -----------------------------------------------------------------------------
    def _start(self, prompts: list[Prompt], reserve: int) -> list[_Seq]:
        """A fresh pool with room for every prompt plus `reserve` tokens each."""
        seqs, first = [], 0
        for p in prompts:
            n = max(1, math.ceil((len(p.token_ids) + reserve) / self.page_size))
            seqs.append(_Seq(p, list(p.token_ids), first, n))
            first += n
        self.kv = KVCache.allocate(
            self.model.cache_specs(),  # type: ignore[operator]
            max(first, 1),
            self.page_size,
            self.kv_dtype,
            self.model_dtype,
            device=self.device,
            scales=self.scales,
        )
        return seqs

    def _prefill_steps(self, seqs: list[_Seq]) -> list[list[tuple[int, int, int]]]:
        """The prompts' chunks `(seq, start, end)` packed into steps of at most `step_tokens` tokens;
        a sequence's chunks go in order, never two in one step."""
        chunks: list[tuple[int, int, int]] = []
        longest = max((len(s.token_ids) for s in seqs), default=0)
        size = self.chunk or max(longest, 1)
        for start in range(0, longest, size):  # round by round: chunk k of every sequence, then k + 1
            chunks += [
                (b, start, min(len(s.token_ids), start + size))
                for b, s in enumerate(seqs)
                if start < len(s.token_ids)
            ]
        steps: list[list[tuple[int, int, int]]] = []
        step: list[tuple[int, int, int]] = []
        num_tokens, members = 0, set[int]()
        for b, lo, hi in chunks:
            if step and (b in members or num_tokens + hi - lo > self.step_tokens):
                steps.append(step)
                step, num_tokens, members = [], 0, set[int]()
            step.append((b, lo, hi))
            num_tokens += hi - lo
            members.add(b)
        return steps + ([step] if step else [])

    def _forward(self, seqs: list[_Seq], step: list[tuple[int, int, int]], want: list[range]) -> torch.Tensor:
        """One model step over tokens `[start, end)` of each listed sequence (their prefixes already
        cached) -> float32 logits [sum of len(want), V] at the wanted positions, in order."""
        kv, S, dev = self.kv, self.page_size, self.device
        assert kv is not None
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_index: list[int] = []
        query_start, seq_lens, rows = [0], [], []
        image_rows: list[int] = []
        image_parts: list[torch.Tensor] = []
        for i, ((b, lo, hi), w) in enumerate(zip(step, want, strict=True)):
            s, base = seqs[b], len(input_ids)
            assert hi <= s.num_pages * S, "a sequence outgrew its pages"
            input_ids += s.token_ids[lo:hi]
            positions += range(lo, hi)
            slots += range(s.first_page * S + lo, s.first_page * S + hi)  # pages in order: slot = position
            seq_index += [i] * (hi - lo)
            query_start.append(len(input_ids))
            seq_lens.append(hi)
            rows += [base + p - lo for p in w]
            if s.prompt.image_embeds is not None:
                inside = [(k, p) for k, p in enumerate(s.prompt.image_positions) if lo <= p < hi]
                image_rows += [base + p - lo for _, p in inside]
                image_parts += [s.prompt.image_embeds[[k for k, _ in inside]]] if inside else []
        tables = [
            list(range(seqs[b].first_page, seqs[b].first_page + math.ceil(n / S)))
            for (b, _, _), n in zip(step, seq_lens, strict=True)
        ]
        width = max(len(t) for t in tables)
        page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        is_page = torch.tensor([[k < len(t) for k in range(width)] for t in tables], device=dev)
        expected = kv.page_tags[page_table.long()].masked_fill(~is_page, -1)  # [B, Mp], padded with -1
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=page_table,
            expected_tags=expected,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            kv_cache=kv,
            tag_mismatch=torch.zeros(len(step), dtype=torch.bool, device=dev),
            is_decode_only=all(hi - lo == 1 for _, lo, hi in step),
            image_embeds=ImageEmbeds(
                token_indices=torch.tensor(image_rows, dtype=torch.int64, device=dev),
                embeds=torch.cat(image_parts).to(dev),
            )
            if image_rows
            else None,
            seq_index=torch.tensor(seq_index, dtype=torch.int64, device=dev),
        )
        logits: torch.Tensor = self.model(batch)
        if bool(batch.tag_mismatch.any()):
            raise RuntimeError("page tag mismatch in a private page pool: the model misread its cache")
        return logits
