"""Speculative decoding with the checkpoint's MTP layers (`--speculative mtp:K`).

One speculative step, for every drafting sequence (one with no grammar, while at most
`EngineConfig.speculative_max_seqs` sequences run, and whose draft pages fit the pool):

1. Verify: the target runs `[newest token, d_1 … d_k]` (the drafts proposed last step) at positions
   n-1 … n-1+k in ONE forward, batched with every other sequence's decode or prefill chunk. Row i's
   logits give the target's next token after `d_1 … d_i`.
2. Accept (backend/engine/speculative_accept.py): the first rejected draft is replaced by the target's
   token; with all k accepted row k gives one more (the bonus token). So a step emits 1 … k+1
   tokens, distributed exactly as decoding one at a time, with the target's raw log-probs.
3. Propose: the MTP layer runs over the positions just accepted (their target hidden states and the
   tokens that follow them), which also keeps its own KV complete, and its last row's argmax is the
   next d_1; depths 2 … K chain one token each on the MTP's own hidden state.

Pages: before the step a drafting sequence gets pages for every position the step may write (the
verify rows and the chained drafts); after it, the pages past its accepted tokens are dropped
(`BlockManager.truncate`). KV written at rejected positions is never read: a position's KV is
always rewritten (verify for the target, propose for the MTP layer) before any query can see it.
The prefix cache only takes pages below `num_computed_tokens`, which counts accepted tokens only.
Every forward here reads and writes through the tag-checked ops, so a draft or verify read of a
page that changed owner flags its sequence, which the engine then aborts alone.

Shape letters: T tokens of a forward, N logits rows, V vocabulary, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.forward_batch import ForwardBatch, HostBatch, ImageEmbeds
from backend.engine.model_runner import ModelRunner, SeqResult
from backend.engine.sampler import SampleRow, TokenScore
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.engine.sequence import Sequence
from backend.engine.speculative_accept import accept_greedy, accept_sampled
from backend.engine.step_planner import StepPlanner


@dataclass(slots=True)
class SpecStats:
    verifies: int = 0  # (sequence, step) pairs that verified drafts
    drafted_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of which accepted: tokens per verify = 1 + accepted / verifies


@dataclass(slots=True)
class _Row:
    """One scheduled sequence's part of a speculative step."""

    sched: ScheduledSeq
    is_drafting: bool
    drafts: list[int] = field(default_factory=list)  # verified this step
    base: int = 0  # its first row of T
    logits_rows: list[int] = field(default_factory=list)  # verify rows, or [sample row]


class SpecDecoder:
    """Decides which sequences draft, reserves and trims their pages, runs the speculative step."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, *, can_match_stops: bool) -> None:
        """`can_match_stops`: the engine matches stop strings itself, token by token (it was given a
        detokenizer); otherwise a request with stop strings does not draft, since the serving layer
        could only cut its text, not the tokens and usage, inside a step's accepted run."""
        model: Any = runner.model
        if not getattr(model, "num_mtp_layers", 0):
            raise ValueError(
                "speculative decoding needs a model loaded with its MTP layers (num_mtp_layers > 0)"
            )
        self.runner, self.block_manager = runner, block_manager
        config = runner.config
        self.K, self.max_seqs = config.num_speculative_tokens, config.speculative_max_seqs
        self.can_match_stops = can_match_stops
        self.stats = SpecStats()
        # request id -> (its number of tokens when they were proposed, the drafts)
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    # ---- around the step -----------------------------------------------------------------------
    def drafting(self, out: SchedulerOutput, num_running: int) -> list[bool]:
        """Which scheduled sequences draft this step (their pages reserved); all False past the
        concurrency where drafting stops paying."""
        flags = [False] * len(out.scheduled)
        if num_running > self.max_seqs:
            return flags
        budget = self.runner.config.max_num_batched_tokens - out.num_tokens  # the verify rows count
        for b, s in enumerate(out.scheduled):
            seq = s.seq
            if (
                seq.constraint is not None
                or not s.needs_sample
                or (seq.request.sampling.stop and not self.can_match_stops)
            ):
                # a grammar masks each position by the accepted text (not drafted); a mid-prompt
                # chunk samples nothing and proposes nothing (its MTP KV is filled when it ends)
                continue
            num_drafts = len(self.drafts_for(seq)) if seq.num_uncomputed_tokens == 1 else 0
            if num_drafts > budget:
                continue
            # verify rows reach n-1+K; chained drafts after up to K+1 accepted reach n+2K-2
            window = seq.num_prompt_tokens + seq.request.sampling.max_tokens
            flags[b] = self.block_manager.reserve_tokens(seq, min(seq.num_tokens + 2 * self.K - 1, window))
            budget -= num_drafts if flags[b] else 0
        return flags

    def trim(self, seqs: list[Sequence]) -> None:
        """After the step: drop the drafting sequences' pages past their tokens."""
        for seq in seqs:
            if not seq.is_finished and seq.page_table:
                self.block_manager.truncate(seq, self.block_manager.num_pages_for(seq.num_tokens))

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, is_drafting: list[bool], tag_updates: list[tuple[int, int]]
    ) -> list[SeqResult]:
        runner = self.runner
        runner.apply_tag_updates(tag_updates)
        rows = [self._row(s, d) for s, d in zip(out.scheduled, is_drafting, strict=True)]
        host, prompt = self._plan_target(rows)
        batch = self._forward_batch(host)
        logits, hidden = runner.model.forward_spec(batch)  # type: ignore[attr-defined]  # [N, V], [T, H]
        results = [SeqResult(r.sched.seq, r.sched.num_new_tokens, False) for r in rows]
        emitted = self._choose(rows, logits)  # tokens per sequence (host), [] when none
        mismatch = batch.tag_mismatch.tolist()
        for b, r in enumerate(rows):
            res = results[b]
            res.is_tag_mismatch = bool(mismatch[b])
            tokens = emitted[b]
            if res.is_tag_mismatch or not tokens:
                continue
            if r.is_drafting and r.drafts:
                res.num_new_tokens = len(tokens)  # the verify rows of the accepted tokens hold valid KV
                self.stats.verifies += 1
                self.stats.drafted_tokens += len(r.drafts)
                self.stats.accepted_tokens += len(tokens) - 1
            scores = self._scores(logits, r, tokens)
            res.accepted, res.sample = scores[:-1], scores[-1]
        for b, (prompt_rows, targets) in prompt.items():
            if not results[b].is_tag_mismatch:
                index = torch.tensor(prompt_rows, dtype=torch.int64, device=logits.device)
                results[b].prompt_scores = runner.sampler.score(
                    logits[index], targets, out.scheduled[b].seq.request.sampling.top_logprobs
                )
        self._propose(rows, results, emitted, hidden)
        return results

    def drafts_for(self, seq: Sequence) -> list[int]:
        """The drafts proposed for `seq`'s newest token, if they are still for it."""
        entry = self._drafts.get(seq.request_id)
        if entry is None or entry[0] != seq.num_tokens:
            return []
        return entry[1]

    def _row(self, s: ScheduledSeq, is_drafting: bool) -> _Row:
        seq = s.seq
        is_decode = s.num_new_tokens == 1 and seq.num_uncomputed_tokens == 1
        drafts = self.drafts_for(seq) if is_drafting and is_decode else []
        return _Row(s, is_drafting, list(drafts))

    # ---- planning --------------------------------------------------------------------------------
    def _plan_target(self, rows: list[_Row]) -> tuple[HostBatch, dict[int, tuple[list[int], list[int]]]]:
        """The verify forward's inputs: each sequence's chunk, a drafting decode's drafts after its
        newest token; the logits rows of every verify position, sample row and prompt row."""
        items: list[tuple[Sequence, int, list[int]]] = []
        logits_indices: list[int] = []
        prompt: dict[int, tuple[list[int], list[int]]] = {}
        image_rows: list[int] = []
        image_parts: list[torch.Tensor] = []
        T = 0
        for b, r in enumerate(rows):
            seq, n = r.sched.seq, r.sched.num_new_tokens
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n] + r.drafts
            r.base = T
            if seq.wants_prompt_logprobs:
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    prompt[b] = (
                        list(range(len(logits_indices), len(logits_indices) + last - first)),
                        seq.token_ids[first + 1 : last + 1],
                    )
                    logits_indices += range(T + first - start, T + last - start)
            if r.sched.needs_sample:
                r.logits_rows = list(range(len(logits_indices), len(logits_indices) + len(tokens) - n + 1))
                logits_indices += range(T + n - 1, T + len(tokens))
            StepPlanner._gather_image_rows(seq, start, n, T, image_rows, image_parts)
            items.append((seq, start, tokens))
            T += len(tokens)
        host = self._host(items, logits_indices)
        host.image_rows, host.image_parts = image_rows, image_parts
        return host, prompt

    def _host(self, items: list[tuple[Sequence, int, list[int]]], logits_indices: list[int]) -> HostBatch:
        """A HostBatch of `(sequence, first position, tokens)` chunks over the sequences' pages."""
        S = self.block_manager.page_size
        counts = np.array([len(t) for _, _, t in items], dtype=np.int64)  # [B]
        starts = np.array([p for _, p, _ in items], dtype=np.int64)
        B = len(items)
        seq_index = np.repeat(np.arange(B), counts)  # [T]
        query_start = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start[1:])
        positions = np.arange(int(counts.sum())) - query_start[seq_index] + starts[seq_index]
        seq_lens = starts + counts
        tables = [seq.page_table for seq, _, _ in items]
        ids, tags = self.block_manager.page_tables.gather(
            np.array([t.row for t in tables]), np.array([t.length for t in tables]), -(-seq_lens // S)
        )
        return HostBatch(
            input_ids=np.array([x for _, _, t in items for x in t], dtype=np.int64),
            positions=positions,
            slots=ids[seq_index, positions // S].astype(np.int64) * S + positions % S,
            seq_index=seq_index,
            query_start=query_start,
            seq_lens=seq_lens.astype(np.int32),
            logits_indices=np.array(logits_indices, dtype=np.int64),
            page_table=ids,
            expected_tags=tags,
        )

    def _forward_batch(self, h: HostBatch) -> ForwardBatch:
        runner = self.runner
        dev = runner.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        image_embeds = None
        if h.image_rows:
            image_embeds = ImageEmbeds(
                token_indices=torch.tensor(h.image_rows, dtype=torch.int64, device=dev),
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
            kv_cache=runner.kv_cache,
            tag_mismatch=torch.zeros(h.num_seqs, dtype=torch.bool, device=dev),
            is_decode_only=len(h.input_ids) == h.num_seqs,
            check_tags=runner.config.check_page_tags,
            image_embeds=image_embeds,
            seq_index=t(h.seq_index),
        )

    # ---- accept ----------------------------------------------------------------------------------
    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sequence emits this step: one sampled, or its accepted drafts and the
        target's next token."""
        emitted: list[list[int]] = [[] for _ in rows]
        plain = [b for b, r in enumerate(rows) if r.logits_rows and not r.drafts]
        if plain:
            sample_rows = [self._sample_row(rows[b].sched.seq) for b in plain]
            index = torch.tensor([rows[b].logits_rows[0] for b in plain], device=logits.device)
            for b, t in zip(
                plain, self.runner.sampler.draw(logits[index], sample_rows).tolist(), strict=True
            ):
                emitted[b] = [t]
        greedy = [b for b, r in enumerate(rows) if r.drafts and r.sched.seq.sample_row.is_argmax]
        if greedy:  # one argmax over every verify row of the greedy sequences, one copy back
            index = torch.tensor([i for b in greedy for i in rows[b].logits_rows], device=logits.device)
            targets = logits[index].argmax(dim=-1).tolist()
            at = 0
            for b in greedy:
                drafts = rows[b].drafts
                emitted[b] = accept_greedy(drafts, targets[at : at + len(drafts) + 1])
                at += len(drafts) + 1
        for b, r in enumerate(rows):
            if r.drafts and not r.sched.seq.sample_row.is_argmax:
                emitted[b] = accept_sampled(logits[r.logits_rows], r.drafts, r.sched.seq.sample_row)
        return emitted

    def _sample_row(self, seq: Sequence) -> SampleRow:
        row = seq.sample_row
        if seq.constraint is not None:
            row.allowed = seq.constraint.allowed_tokens(self.runner.vocab_size)
        return row

    def _scores(self, logits: torch.Tensor, r: _Row, tokens: list[int]) -> list[TokenScore]:
        row = r.sched.seq.sample_row
        rows = [row] * len(tokens)
        index = torch.tensor(r.logits_rows[: len(tokens)], device=logits.device)
        chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        return self.runner.sampler.scores(logits[index], rows, chosen, tokens)

    # ---- propose ---------------------------------------------------------------------------------
    def _propose(
        self, rows: list[_Row], results: list[SeqResult], emitted: list[list[int]], hidden: torch.Tensor
    ) -> None:
        """Run the MTP layer over each drafting sequence's new positions and chain its drafts."""
        model: Any = self.runner.model
        items: list[tuple[Sequence, int, list[int]]] = []
        owners: list[int] = []
        hidden_rows: list[int] = []
        logits_indices: list[int] = []
        proposing = []  # (b, drafts to propose, the last position the MTP layer ran at)
        for b, r in enumerate(rows):
            seq, tokens = r.sched.seq, emitted[b]
            self._drafts.pop(seq.request_id, None)
            if not r.is_drafting or results[b].is_tag_mismatch or not tokens:
                continue
            start = seq.num_computed_tokens
            m = results[b].num_new_tokens  # target rows whose next token is now known
            # the tokens after positions start … start+m-1: the chunk's own, then what was emitted
            after = (seq.token_ids[start + 1 : start + m] + tokens)[:m]
            remaining = seq.request.sampling.max_tokens - (seq.num_output_tokens + len(tokens))
            num_drafts = min(self.K, remaining - 1)
            if num_drafts > 0:
                proposing.append((b, num_drafts, start + m - 1))
                logits_indices.append(len(hidden_rows) + m - 1)
            items.append((seq, start, after))
            owners.append(b)
            hidden_rows += range(r.base, r.base + m)
        if not items:
            return
        host = self._host(items, logits_indices)
        batch = self._forward_batch(host)
        h = hidden[torch.tensor(hidden_rows, device=hidden.device)]
        draft_logits, g = model.forward_mtp(batch, h, 0)  # [P, V], [T, H]
        drafts = [[t] for t in draft_logits.argmax(dim=-1).tolist()]
        g_last = g[batch.logits_indices]  # [P, H]
        for b, bad in zip(owners, batch.tag_mismatch.tolist(), strict=True):
            if bad:  # a draft read or write of a page that changed owner
                results[b].is_tag_mismatch = True
        for depth in range(1, self.K):
            live = [i for i, (_, n, _) in enumerate(proposing) if n > depth]
            if not live:
                break
            chain = [
                (rows[proposing[i][0]].sched.seq, proposing[i][2] + depth, [drafts[i][-1]]) for i in live
            ]
            step_batch = self._forward_batch(self._host(chain, list(range(len(live)))))
            index = torch.tensor(live, device=g_last.device)
            logits_k, g_k = model.forward_mtp(step_batch, g_last[index], depth)
            for i, t in zip(live, logits_k.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(t)
            g_last = g_last.clone()
            g_last[index] = g_k
            for j, bad in zip(live, step_batch.tag_mismatch.tolist(), strict=True):
                if bad:
                    results[proposing[j][0]].is_tag_mismatch = True
        for i, (b, _, _) in enumerate(proposing):
            if not results[b].is_tag_mismatch:
                seq = rows[b].sched.seq
                self._drafts[seq.request_id] = (seq.num_tokens + len(emitted[b]), drafts[i])
