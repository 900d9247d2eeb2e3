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

A step where every sequence verifies this step's k drafts greedily (argmax sampling, no logprobs,
pages for the chained drafts: `_is_greedy`) runs as ONE device function instead, verify to next
drafts (backend/engine/speculative_greedy.py; one CUDA graph per (k, bucket)), and the host reads one
small tensor back: the accepted counts, tokens, next drafts and tag flags. Every other step (sampled
rows, logprobs, chunks, a row with fewer drafts) takes the host path above.

The draft length k (0 … K) is chosen per step by the draft policy (backend/engine/draft_policy.py)
from the step's load and the measured acceptance; a step verifies at most k of the drafts proposed
the step before (a prefix of them: exact whatever k was then) and proposes k. With k = 0 nobody
drafts and the step is a plain one (graph-replayed decode). Plain and drafting sequences share one
verify forward: a plain decode is a one-row chunk beside them. Every forward of the step goes to
every tensor-parallel rank (backend/engine/speculative_forwards.py).

Pages: before the step a drafting sequence gets pages for every position the step may write (the
verify rows and the chained drafts). It keeps those past its accepted tokens while it drafts, under
their tags (its spare pages, `BlockManager.reserve_tokens`): the next step needs them again, and a
page given back and reserved anew would carry a new tag and a tag update into that step. It gives
them back when a step does not draft it (`drafting`), when it finishes or is preempted, or when the
pool runs short. KV written at rejected positions is never read: a position's KV is always
rewritten (verify for the target, propose for the MTP layer) before any query can see it.
The prefix cache only takes pages below `num_computed_tokens`, which counts accepted tokens only.
Every forward here reads and writes through the tag-checked ops, so a draft or verify read of a
page that changed owner flags its sequence, which the engine then aborts alone.

Shape letters: T tokens of a forward, N logits rows, V vocabulary, H hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.draft_policy import DraftPolicy, StepLoad
from backend.engine.forward_batch import HostBatch
from backend.engine.host_staging import to_device
from backend.engine.model_runner import ModelRunner, SeqResult
from backend.engine.ranks import GREEDY, VERIFY, SpecForward, StepInputs
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
    """Decides which sequences draft, reserves and gives back their draft pages, runs the step."""

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
        num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0)
        self.policy = DraftPolicy(
            self.K,
            saturation_rows=config.speculative_saturation_rows,
            draft_cost=config.speculative_draft_cost or 1.0 / max(num_layers, 1),
            is_adaptive=config.speculative_adaptive,
            is_calibrated=config.speculative_draft_cost is None,  # None: measured from step times
        )
        # past this many running sequences no draft length can pay (the cost model, every draft
        # accepted): those steps are plain ones, the policy not even asked (no probes either)
        self.max_drafting_seqs = self.policy.max_paying_seqs(self.max_seqs)
        self.k = 0  # this step's draft length (the policy's choice)
        self.did_verify = False  # the last `run` verified drafts (a step after a plain one only proposes)
        self._draft_rows: list[int] = []  # this step's draft forwards' rows (for the policy's timing)
        # whole greedy steps on the device where they apply: from their graphs, or eagerly where
        # nothing is captured (the CPU); never eagerly beside captured verify graphs (tests: off)
        graphs = runner.spec_forwards.graphs if runner.spec_forwards is not None else None
        self.is_greedy_enabled = graphs is None or not graphs.is_enabled or graphs.has_greedy
        self.num_greedy_steps = 0
        # request id -> (its number of tokens when they were proposed, the drafts)
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    # ---- around the step -----------------------------------------------------------------------
    def drafting(self, out: SchedulerOutput, num_running: int) -> list[bool]:
        """Which scheduled sequences draft this step (their pages reserved), and with how many
        drafts (`self.k`, the draft policy's choice for this step's load); all False past
        `max_drafting_seqs` running (`speculative_max_seqs` or fewer), or when the policy says
        drafting does not pay."""
        flags = [False] * len(out.scheduled)
        self.k = 0
        if num_running <= self.max_drafting_seqs:
            self._reserve(out, flags)
        spares = self.block_manager.spare_holders
        if spares:  # a sequence that does not draft this step gives its draft pages back
            keep = {s.seq.request_id for s, d in zip(out.scheduled, flags, strict=True) if d}
            for seq in [seq for rid, seq in spares.items() if rid not in keep]:
                self.block_manager.drop_spare_pages(seq)
        return flags

    def _reserve(self, out: SchedulerOutput, flags: list[bool]) -> None:
        """Choose this step's k and set `flags` for the sequences whose draft pages fit."""
        can_draft = [
            s.needs_sample
            and s.seq.constraint is None
            and not (s.seq.request.sampling.stop and not self.can_match_stops)
            for s in out.scheduled
        ]  # a grammar masks each position by the accepted text (not drafted); a mid-prompt chunk
        # samples nothing and proposes nothing (its MTP KV is filled when its prompt ends)
        num_samples = sum(s.needs_sample for s in out.scheduled)
        load = StepLoad(out.num_tokens, sum(can_draft), num_samples - sum(can_draft))
        k = self.k = self.policy.choose(load)
        if k == 0:
            return
        budget = self.runner.config.max_num_batched_tokens - out.num_tokens  # the verify rows count
        for b, s in enumerate(out.scheduled):
            seq = s.seq
            if not can_draft[b]:
                continue
            num_drafts = len(self.drafts_for(seq)[:k]) if seq.num_uncomputed_tokens == 1 else 0
            if num_drafts > budget:
                continue
            # verify rows reach n-1+k; chained drafts after up to k+1 accepted reach n+2k-2
            window = seq.num_prompt_tokens + seq.request.sampling.max_tokens
            flags[b] = self.block_manager.reserve_tokens(seq, min(seq.num_tokens + 2 * k - 1, window))
            budget -= num_drafts if flags[b] else 0

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, is_drafting: list[bool], tag_updates: list[tuple[int, int]]
    ) -> list[SeqResult]:
        runner = self.runner
        start = time.perf_counter()
        rows = [self._row(s, d) for s, d in zip(out.scheduled, is_drafting, strict=True)]
        self.did_verify = any(r.drafts for r in rows)
        if self.is_greedy_enabled and self._is_greedy(rows):
            return self._run_greedy(rows, tag_updates)
        host, prompt = self._plan_target(rows)
        updates = np.array(tag_updates, dtype=np.int64) if tag_updates else None
        logits, flags = self._forward(StepInputs(host, updates, SpecForward(VERIFY)))  # [N, V], [B]
        results = [SeqResult(r.sched.seq, r.sched.num_new_tokens, False) for r in rows]
        emitted = self._choose(rows, logits)  # tokens per sequence (host), [] when none
        mismatch = flags.tolist()
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
                self.policy.observe(len(r.drafts), len(tokens) - 1)
            scores = self._scores(logits, r, tokens)
            res.accepted, res.sample = scores[:-1], scores[-1]
        for b, (prompt_rows, targets) in prompt.items():
            if not results[b].is_tag_mismatch:
                index = to_device(prompt_rows, torch.int64, logits.device)
                results[b].prompt_scores = runner.sampler.score(
                    logits[index], targets, out.scheduled[b].seq.request.sampling.top_logprobs
                )
        verified = time.perf_counter()  # the verify's flags and tokens came back: its forward is done
        self._draft_rows = []
        self._propose(rows, results, emitted)
        self.policy.observe_timing(
            verified - start, len(host.input_ids), time.perf_counter() - verified, self._draft_rows
        )
        return results

    # ---- a whole greedy step on the device (backend/engine/speculative_greedy.py) ---------------
    def _is_greedy(self, rows: list[_Row]) -> bool:
        """Every sequence verifies this step's k drafts greedily, wants no logprobs, and has pages
        for the chained drafts after any accepted run (its window not cut by `max_tokens`)."""
        k = self.k
        for r in rows:
            seq = r.sched.seq
            row = seq.sample_row
            if (
                len(r.drafts) != k
                or not row.is_argmax
                or row.params.logprobs
                or seq.wants_prompt_logprobs
                or seq.num_tokens + 2 * k - 1 > seq.num_prompt_tokens + seq.request.sampling.max_tokens
            ):
                return False
        return k > 0

    def _run_greedy(self, rows: list[_Row], tag_updates: list[tuple[int, int]]) -> list[SeqResult]:
        """The step as one device function: verify, accept, propose; one copy back."""
        k, L = self.k, self.k + 1
        host = self._plan_greedy(rows)
        updates = np.array(tag_updates, dtype=np.int64) if tag_updates else None
        packed, flags = self._forward(StepInputs(host, updates, SpecForward(GREEDY)))  # [B, 3 + 2k], [B]
        if self.runner.ranks is not None:  # the flags OR-reduced over the ranks, for this rank's own
            packed[:, -1].copy_(flags)
        values = packed.tolist()  # the step's one copy back
        self.num_greedy_steps += 1
        results = []
        for r, (a, *rest, flag) in zip(rows, values, strict=True):
            seq = r.sched.seq
            self._drafts.pop(seq.request_id, None)
            res = SeqResult(seq, 1, bool(flag))
            results.append(res)
            if res.is_tag_mismatch:
                continue
            tokens, drafts = rest[: a + 1], rest[L:]
            res.num_new_tokens = a + 1  # the verify rows of the accepted tokens hold valid KV
            self.stats.verifies += 1
            self.stats.drafted_tokens += k
            self.stats.accepted_tokens += a
            self.policy.observe(k, a)
            scores = [TokenScore(t, None, []) for t in tokens]
            res.accepted, res.sample = scores[:-1], scores[-1]
            remaining = seq.request.sampling.max_tokens - (seq.num_output_tokens + a + 1)
            if min(k, remaining - 1) > 0:
                self._drafts[seq.request_id] = (seq.num_tokens + a + 1, drafts[: min(k, remaining - 1)])
        return results

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the step, on every rank: (logits [N, V], tag flags [B])."""
        if self.runner.ranks is not None:
            self.runner.ranks.send(inputs)
        return self.runner.forward_step(inputs)

    def drafts_for(self, seq: Sequence) -> list[int]:
        """The drafts proposed for `seq`'s newest token, if they are still for it."""
        entry = self._drafts.get(seq.request_id)
        if entry is None or entry[0] != seq.num_tokens:
            return []
        return entry[1]

    def _row(self, s: ScheduledSeq, is_drafting: bool) -> _Row:
        seq = s.seq
        is_decode = s.num_new_tokens == 1 and seq.num_uncomputed_tokens == 1
        drafts = self.drafts_for(seq)[: self.k] if is_drafting and is_decode else []
        return _Row(s, is_drafting, list(drafts))

    # ---- planning --------------------------------------------------------------------------------
    def _plan_greedy(self, rows: list[_Row]) -> HostBatch:
        """A greedy step's verify, vectorised: each sequence's newest token and its k drafts at
        positions n-1 … n-1+k, its page table as wide as the chained drafts need (n + 2k - 1
        tokens)."""
        k, L, S, B = self.k, self.k + 1, self.block_manager.page_size, len(rows)
        seqs = [r.sched.seq for r in rows]
        tokens = np.array(
            [[seq.token_ids[-1], *r.drafts] for seq, r in zip(seqs, rows, strict=True)], dtype=np.int64
        )  # [B, L]
        # per sequence: its first position n-1, its table's row and length, its pages for n + 2k - 1 tokens
        starts, table_rows, lengths, num_pages = np.array(
            [
                (
                    seq.num_computed_tokens,
                    seq.page_table.row,
                    seq.page_table.length,
                    (seq.num_computed_tokens + L + k - 2) // S + 1,
                )
                for seq in seqs
            ],
            dtype=np.int64,
        ).T  # [B] each
        positions = starts[:, None] + np.arange(L)  # [B, L]
        ids, tags = self.block_manager.page_tables.gather(table_rows, lengths, num_pages)
        slots = ids[np.arange(B)[:, None], positions // S] * np.int64(S) + positions % S  # [B, L]
        rows_of = np.arange(B * L)  # [B·L] every row a logits row
        return HostBatch(
            input_ids=tokens.reshape(-1),
            positions=positions.reshape(-1),
            slots=slots.reshape(-1),
            seq_index=rows_of // L,
            query_start=np.arange(0, B * L + 1, L, dtype=np.int32),
            seq_lens=(starts + L).astype(np.int32),
            logits_indices=rows_of,
            page_table=ids,
            expected_tags=tags,
            rows_per_seq=L,
        )

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

    def _host(
        self, items: list[tuple[Sequence, int, list[int]]], logits_indices: list[int], extra_tokens: int = 0
    ) -> HostBatch:
        """A HostBatch of `(sequence, first position, tokens)` chunks over the sequences' pages (and
        the pages of `extra_tokens` more in its page tables: a greedy step's chained drafts)."""
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
            np.array([t.row for t in tables]),
            np.array([t.length for t in tables]),
            -(-(seq_lens + extra_tokens) // S),
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

    # ---- accept ----------------------------------------------------------------------------------
    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sequence emits this step: one sampled, or its accepted drafts and the
        target's next token."""
        emitted: list[list[int]] = [[] for _ in rows]
        plain = [b for b, r in enumerate(rows) if r.logits_rows and not r.drafts]
        if plain:
            sample_rows = [self._sample_row(rows[b].sched.seq) for b in plain]
            index = to_device([rows[b].logits_rows[0] for b in plain], torch.int64, logits.device)
            for b, t in zip(
                plain, self.runner.sampler.draw(logits[index], sample_rows).tolist(), strict=True
            ):
                emitted[b] = [t]
        greedy = [b for b, r in enumerate(rows) if r.drafts and r.sched.seq.sample_row.is_argmax]
        if greedy:  # one argmax over every verify row of the greedy sequences, one copy back
            index = to_device([i for b in greedy for i in rows[b].logits_rows], torch.int64, logits.device)
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
        if not row.params.logprobs:  # nothing to compute: no copies to the device either
            return [TokenScore(t, None, []) for t in tokens]
        rows = [row] * len(tokens)
        index = to_device(r.logits_rows[: len(tokens)], torch.int64, logits.device)
        chosen = to_device(tokens, torch.int64, logits.device)
        return self.runner.sampler.scores(logits[index], rows, chosen, tokens)

    # ---- propose ---------------------------------------------------------------------------------
    def _propose(self, rows: list[_Row], results: list[SeqResult], emitted: list[list[int]]) -> None:
        """Run the MTP layer over each drafting sequence's new positions and chain its drafts: depth 0
        over the accepted positions (every verify row, padded, when each sequence verified k drafts:
        one graph's shape), depths 1 … k−1 one row each, their input tokens the previous depth's
        drafts on the device; then one copy back of every depth's drafts and tag flags."""
        accepted = []  # (b, first position, m: target rows whose next token is now known, the tokens after)
        for b, r in enumerate(rows):
            seq, tokens = r.sched.seq, emitted[b]
            self._drafts.pop(seq.request_id, None)
            if not r.is_drafting or results[b].is_tag_mismatch or not tokens:
                continue
            start, m = seq.num_computed_tokens, results[b].num_new_tokens
            # the tokens after positions start … start+m-1: the chunk's own, then what was emitted
            accepted.append((b, start, m, (seq.token_ids[start + 1 : start + m] + tokens)[:m]))
        if not accepted:
            return
        # each verified k drafts: its k + 1 verify rows exist, and depth 0 runs over all of them
        width = self.k + 1 if self.k and all(len(rows[b].drafts) == self.k for b, *_ in accepted) else 0
        items: list[tuple[Sequence, int, list[int]]] = []
        owners: list[int] = []
        hidden_rows: list[int] = []
        logits_indices: list[int] = []
        proposing = []  # (b, drafts to propose, the last position the MTP layer ran at)
        for b, start, m, after in accepted:
            r = rows[b]
            seq = r.sched.seq
            remaining = seq.request.sampling.max_tokens - (seq.num_output_tokens + len(emitted[b]))
            num_drafts = min(self.k, remaining - 1)
            if num_drafts > 0:
                proposing.append((b, num_drafts, start + m - 1))
                logits_indices.append(len(hidden_rows) + m - 1)
            n = width or m
            items.append((seq, start, after + [0] * (n - m)))  # padding rows: rewritten before read
            owners.append(b)
            hidden_rows += range(r.base, r.base + n)
        host = self._host(items, logits_indices)
        self._draft_rows.append(len(hidden_rows))
        _, flags = self._forward(StepInputs(host, spec=SpecForward(0, np.array(hidden_rows, dtype=np.int64))))
        flagged = [(owners, flags)]  # (sequences, their flags [n]) per forward
        depth_rows = [list(range(len(proposing)))]  # per depth, the proposing rows it drafted for
        for depth in range(1, self.k):
            live = [i for i, (_, n, _) in enumerate(proposing) if n > depth]
            if not live:
                break
            chain = [(rows[proposing[i][0]].sched.seq, proposing[i][2] + depth, [0]) for i in live]
            host_k = self._host(chain, list(range(len(live))))  # input tokens: on the device
            self._draft_rows.append(len(live))
            spec = SpecForward(depth, np.array(live, dtype=np.int64), chain=True)
            _, flags_k = self._forward(StepInputs(host_k, spec=spec))
            flagged.append(([proposing[i][0] for i in live], flags_k))
            depth_rows.append(live)
        assert self.runner.spec_forwards is not None
        drafted = self.runner.spec_forwards.drafted  # per depth [len(depth_rows[d])], on this rank
        values = torch.cat([t.to(torch.int64) for t in (*drafted, *(f for _, f in flagged))]).tolist()
        drafts: list[list[int]] = [[] for _ in proposing]
        at = 0
        for live in depth_rows:
            for i in live:
                drafts[i].append(values[at])
                at += 1
        for seqs, _ in flagged:
            for b in seqs:
                results[b].is_tag_mismatch |= bool(
                    values[at]
                )  # a draft read or write of a page that changed owner
                at += 1
        for i, (b, _, _) in enumerate(proposing):
            if not results[b].is_tag_mismatch:
                seq = rows[b].sched.seq
                self._drafts[seq.request_id] = (seq.num_tokens + len(emitted[b]), drafts[i])
