"""Speculative decoding with the checkpoint's MTP layers (`--speculative mtp:K`).

One speculative step, for every drafting sequence (one with no grammar, while at most
`EngineConfig.speculative_max_seqs` sequences run, and whose draft pages fit the pool):

1. Verify: the target runs `[newest token, d_1 … d_k]` (the drafts proposed last step) at positions
   n-1 … n-1+k in ONE forward, batched with every other sequence's decode or prefill chunk. Row i's
   logits give the target's next token after `d_1 … d_i`.
2. Accept (backend/engine/speculative/accept.py): the first rejected draft is replaced by the target's
   token; with all k accepted row k gives one more (the bonus token). So a step emits 1 … k+1
   tokens, distributed exactly as decoding one at a time, with the target's raw log-probs.
3. Propose (backend/engine/speculative/propose.py): the MTP layer runs over the positions just
   accepted (their target hidden states and the tokens that follow them), which also keeps its own
   KV complete (a sequence that plain steps left behind catches up first, its gap recomputed in
   the verify: backend/engine/speculative/book.py), and its last row's argmax is the next d_1;
   depths 2 … K chain one token each on the MTP's own hidden state. The drafts wait in the draft
   book (backend/engine/speculative/book.py) for the next step.

The forwards' host inputs are planned in backend/engine/speculative/plan.py.

A step where every sequence verifies this step's k drafts, samples without penalties or logprobs and
has pages for the chained drafts (`_is_whole`) runs as ONE device function instead, verify to next
drafts (backend/engine/speculative/greedy.py, or sampled.py when any sequence samples: rejection
sampling on the device, its uniforms drawn on the host and sent with the step's inputs; one CUDA
graph per (k, bucket)), and the host reads one small tensor back: the accepted counts, tokens, next
drafts and tag flags. A token guard's bans go with it: the device masks each verify row along
the drafts as the host path does. Every other step (penalties, logprobs, chunks, a row with fewer
drafts, a guard banning more ids than the device's rows hold, a window cut by `max_tokens`) takes the host path above, which masks each
verify row as the sampler would (accept.py `banned_rows`).

The draft length k (0 … K) is chosen per step by the draft policy (backend/engine/speculative/policy.py)
from the step's load and the measured acceptance; a step verifies at most k of the drafts proposed
the step before (a prefix of them: exact whatever k was then) and proposes k. With k = 0 nobody
drafts and the step is a plain one (graph-replayed decode). While a plain decode step runs on the
device, the policy is told the steps' times and chooses k for the next steps at this load
(`while_plain_step`), and a plain decode stream asks it once every `PLAIN_REASK` steps, the choice
standing in between (`_holds`: on the H100 the work beside the device was on the critical path all
the same, 20 µs of a 0.42 ms step). What is left on a step asks no sequence anything in a step of
decodes alone (a few cheap walks remain: the drafting ids when 1-8 may draft, the refused
catch-ups, the pages touched): its load comes from the scheduler's count of decodes
(`SchedulerOutput.is_decodes_only`) and the book's requests that may never draft, and the book is
empty once a load has stopped drafting (issue 28: at 16-64 sequences those passes were most of what
a plain step with speculation on cost over one with it off, lab/diagnostics/spec_plain_host.py). Plain and drafting sequences share one verify forward: a
plain decode is a one-row chunk beside them. Every forward of the step goes to every
tensor-parallel rank (backend/engine/speculative/forwards.py).

Pages: before the step a drafting sequence gets pages for every position the step may write (the
verify rows and the chained drafts), and keeps them while it drafts (backend/engine/speculative/book.py
says when they go back, and why KV written at rejected positions is never read). Every forward here
reads and writes through the tag-checked ops, so a draft or verify read of a page that changed owner
flags its sequence, which the engine then aborts alone.

Shape letters: T tokens of a forward, N logits rows, V vocabulary, H hidden.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.host_staging import to_device
from backend.engine.model_runner import ModelRunner, SeqResult
from backend.engine.ranks import GREEDY, VERIFY, SpecForward, StepInputs
from backend.engine.sampler import TokenScore
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.engine.sequence import Sequence
from backend.engine.speculative.accept import choose_tokens, token_scores
from backend.engine.speculative.book import DraftBook
from backend.engine.speculative.greedy import MAX_BANNED
from backend.engine.speculative.load_rates import load_bucket
from backend.engine.speculative.plan import SpecRow, plan_greedy, plan_target
from backend.engine.speculative.policy import OWN_MAX_SEQS, DraftPolicy, StepLoad
from backend.engine.speculative.propose import propose
from backend.engine.speculative.sampled import can_sample_on_device, draw_rows

# steps a refused catch-up stands at the same load before the sequence is asked again: a refusal
# only turns while the load's rates or acceptance move (the gap grows, the tokens left shrink), and
# asking each sequence every step cost a c = 64 burst's tail ~0.1 ms a step on the H100 (2026-12-06)
CATCH_UP_REASK = 16
# a plain decode stream (an unchanged load and requests) asks the draft policy once every this many
# steps: its choice of k = 0 stands for the steps between (a probe, a starved run or an exploration
# starts up to PLAIN_REASK - 1 steps later), and their measurements are told in one pass before the
# next ask. Asked and told every step, a c = 1 plain step on the H100 (2026-12-07,
# lab/diagnostics/spec_plain_gpu.py) spent 20 µs of its 0.42 ms on it: run between the step's launch
# and its read back, it was on the critical path all the same (the graph's launch returns late)
PLAIN_REASK = 8
# a request's host generator for its drafts' uniforms, on either path (its own generator lives on the
# device) is seeded with its seed XOR this: a stream apart from the device generator's, reproducible
HOST_SEED_SALT = 0x5DEECE66D


@dataclass(slots=True)
class SpecStats:
    verifies: int = 0  # (sequence, step) pairs that verified drafts
    drafted_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # of which accepted: tokens per verify = 1 + accepted / verifies


class SpecDecoder:
    """Decides which sequences draft and with how many drafts, and runs the speculative step."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, *, can_match_stops: bool) -> None:
        """`can_match_stops`: the engine matches stop strings itself (see `DraftBook`)."""
        model: Any = runner.model
        if not getattr(model, "num_mtp_layers", 0):
            raise ValueError(
                "speculative decoding needs a model loaded with its MTP layers (num_mtp_layers > 0)"
            )
        self.runner, self.block_manager = runner, block_manager
        config = runner.config
        self.K, self.max_seqs = config.num_speculative_tokens, config.speculative_max_seqs
        self.book = DraftBook(
            block_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            can_match_stops=can_match_stops,
        )
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
        self.num_verified = 0
        self.num_gap_rows = 0  # the positions the last step's verify recomputed (MTP KV caught up)
        self.did_draft = False  # the last step drafted (after a plain one, drafting catches up first)
        self.fills_draft_kv = False  # this step drafts nothing but runs the MTP layer over prompt chunks
        # whole greedy steps on the device where they apply: from their graphs, or eagerly where
        # nothing is captured (the CPU); never eagerly beside captured verify graphs (tests: off)
        graphs = runner.spec_forwards.graphs if runner.spec_forwards is not None else None
        self.is_greedy_enabled = graphs is None or not graphs.is_enabled or graphs.has_greedy
        self.is_sampled_enabled = graphs is None or not graphs.is_enabled or graphs.has_sampled
        self.num_greedy_steps = 0  # whole steps on the device, greedy or sampled
        self.num_sampled_steps = 0  # of which sampled
        self._host_generators: dict[str, torch.Generator] = {}
        self._loads: dict[tuple[int, int, int], StepLoad] = {}  # `_load`
        # request id -> (load bucket, step) of its last refused catch-up (`_catch_up_worth`)
        self._refused: dict[str, tuple[int, int]] = {}
        self._num_steps = 0
        # the policy's per-step work moved into a plain step's device time (`while_plain_step`):
        # the steps' measurements not yet told, the load of a plain step and the draft length
        # chosen for the next step at that load, and the steps that choice has stood for since
        self._measured: list[tuple[int, int, bool, int, int, float, int]] = []
        self._plain_load: tuple[StepLoad, tuple[str, ...]] | None = None
        self._ahead: tuple[StepLoad, tuple[str, ...], int] | None = None
        self._held = 0

    def policy_state(self) -> dict[str, Any]:
        """A copy of what the draft policy has learned (acceptance, m, each load's rates)."""
        return copy.deepcopy(self.policy.__dict__)

    def restore_policy(self, state: dict[str, Any]) -> None:
        """The policy as `state` found it, and no measurement of a step since left to tell it: the
        warm-up's steps (random prompts, forced draft lengths, compiles) must not be what serving's
        first choices start from."""
        self.policy.__dict__.update(copy.deepcopy(state))
        self._measured = []
        self._ahead = self._plain_load = None
        self._held = 0
        self.did_draft = self.fills_draft_kv = False

    @property
    def did_catch_up(self) -> bool:
        """The last step's verify recomputed a gap (MTP KV caught up)."""
        return self.num_gap_rows > 0

    # ---- around the step -----------------------------------------------------------------------
    def drafting(self, out: SchedulerOutput, num_requests: int) -> list[bool]:
        """Which scheduled sequences draft this step (their pages reserved), and with how many
        drafts (`self.k`, the draft policy's choice for this step's load); all False past
        `max_drafting_seqs` requests (running and waiting, at most as many as can run: a burst's
        first steps admit a few prompts at a time, and a probe at the few running then measured a
        load about to grow, a third of a c=64 bench run on the H100 in 2026-12), or when the policy
        says drafting does not pay; none for a sequence whose catch-up does not pay
        (`_catch_up_worth`). A sequence that does not draft gives its draft pages back. A step at
        such a load that drafts nothing but holds prompt chunks runs the MTP layer over them
        (`fills_draft_kv`): their MTP KV written as the prompt is, so drafting starts without a
        catch-up (a second prefill of the prompt), and a prompt longer than a step's budget does not
        leave a gap too long to ever catch up; unless the load the prompts join is one where the
        policy's measured step costs say drafting does not pay (`DraftPolicy.may_draft`: on the
        H100 a prompt's fill step cost 1.5x its prefill, and a c = 64 burst paid it for every prompt)
        and every prompt could still be caught up later (`DraftBook.has_chunk_to_fill(must=True)`:
        a longer one skipped would be a hole for good)."""
        flags = [False] * len(out.scheduled)
        self.k, self.num_gap_rows, self.fills_draft_kv = 0, 0, False
        ahead, self._ahead, self._plain_load = self._ahead, None, None
        self._num_steps += 1
        if ahead is not None and self._holds(ahead, out, num_requests):
            self._ahead, self._held = ahead, self._held + 1  # the plain stream's choice stands
            self.did_draft = False
            return flags
        if num_requests <= self.max_drafting_seqs:
            # a step of decodes alone (a decode stream's) counts its load with no pass over them
            num_tokens, can_draft = out.num_tokens, self.book.can_draft(out)
            if self._refused:
                self._skip_refused(out, can_draft)
            num_drafting = can_draft.count(True)
            load = self._load(num_tokens, num_drafting, out.num_samples - num_drafting)
            ids = self._drafting_ids(out, can_draft, num_drafting)
            if ahead is not None and ahead[0] is load and ahead[1] == ids and self.policy.forced_k is None:
                self.k = ahead[2]  # chosen while a recent step ran, for this load and these requests
            else:
                # held steps of a stream this step broke count too (acceptance-starved probing)
                num_steps, ahead, self._held = self._held + 1, None, 0
                self.settle()
                self.k = self.policy.choose(
                    load, ids, not self._has_drafts(out, can_draft), num_steps=num_steps
                )
            if self.k:
                self._catch_up_worth(out, can_draft)
                flags = self.book.reserve(out, can_draft, self.k)
                if not any(flags):  # every sequence refused: a plain step (and counted as one)
                    self.k = 0
                    self.policy.drafted_nothing()
            elif self.policy.is_adaptive and num_drafting and num_tokens == len(out.scheduled):
                # a plain decode step: the choice made ahead stands for the next step too, up to
                # `PLAIN_REASK` steps; then the next one's choice is made while this one runs
                if ahead is not None and self._held < PLAIN_REASK - 1:
                    self._ahead, self._held = ahead, self._held + 1
                else:
                    self._plain_load = (load, ids)
            self.fills_draft_kv = (
                not any(flags)
                and self.policy.forced_k != 0
                and self.book.has_chunk_to_fill(out)
                and (self.policy.may_draft(num_requests) or self.book.has_chunk_to_fill(out, must=True))
            )
        is_drafting = any(flags)
        if is_drafting:
            self.settle()  # a drafting step's device waits are its own
        self.book.release_spares(out, flags)
        self.did_draft = is_drafting
        return flags

    def _holds(
        self, ahead: tuple[StepLoad, tuple[str, ...], int], out: SchedulerOutput, num_requests: int
    ) -> bool:
        """This step is the next of a plain decode stream whose choice (k = 0, made ahead) stands
        (`PLAIN_REASK`): decodes alone, the same requests as the choice's, each able to draft, none
        refused a catch-up and no spare draft pages to give back. What `drafting`'s full path
        would decide then, without its passes (each a few µs of a step's host time)."""
        load, ids, k = ahead
        n = len(out.scheduled)
        if (
            k
            or self._held >= PLAIN_REASK - 1
            or self.policy.forced_k is not None
            or num_requests > self.max_drafting_seqs
            or not out.is_decodes_only
            or load.num_rows != n
            or load.num_drafting != n
            or load.num_other_samples
            or self._refused
            or self.book.never_drafting_ids
            or self.block_manager.spare_holders
        ):
            return False
        if not ids:  # more than OWN_MAX_SEQS: the load decides alone
            return n > OWN_MAX_SEQS
        return len(ids) == n and all([s.seq.request_id == r for s, r in zip(out.scheduled, ids, strict=True)])

    def measured(self, num_seqs: int, num_drafting: int, num_tokens: int, seconds: float) -> None:
        """A decode-only step of `num_seqs` sequences, `num_drafting` of them drafting, emitted
        `num_tokens` in `seconds`: for the policy, told at the next `settle` (see `while_plain_step`)."""
        is_drafting = num_drafting > 0
        self._measured.append(
            (
                num_seqs,
                num_drafting,
                is_drafting and self.did_verify,
                self.num_gap_rows,
                num_tokens,
                seconds,
                self.k if self.num_verified == self.k else 0,  # a step of one k throughout, else unpriced
            )
        )

    def settle(self) -> None:
        """Tell the policy the measurements of the steps since it was last told, in their order."""
        pending, self._measured = self._measured, []
        policy = self.policy
        plain: list[tuple[int, float]] = []  # a run of plain steps of one load, told at once
        plain_seqs = 0
        for num_seqs, num_drafting, is_verified, num_gap_rows, num_tokens, seconds, k in pending:
            if not num_drafting:
                if plain and num_seqs != plain_seqs:
                    policy.observe_plain(plain_seqs, plain)
                    plain = []
                plain_seqs = num_seqs
                plain.append((num_tokens, seconds))
                continue
            if plain:
                policy.observe_plain(plain_seqs, plain)
                plain = []
            if num_gap_rows:  # mostly a prefill of MTP KV: a probe's price
                policy.observe_catch_up(num_seqs, seconds, num_gap_rows)
            else:
                policy.observe_step(num_seqs, True, is_verified, num_tokens, seconds, k, num_drafting)
        if plain:
            policy.observe_plain(plain_seqs, plain)

    def while_plain_step(self) -> None:
        """The policy's work while a plain step runs on the device (`ModelRunner.run`), once every
        `PLAIN_REASK` steps of a decode stream: the measurements of the steps since it was last told,
        and the draft length for the next steps, used while their load is this one's (a decode
        stream's is, but for arrivals and finishes; else the next step chooses anew), standing for
        the steps since the last choice. Past the loads the policy is asked at, the measurements
        are told every `PLAIN_REASK` steps. A choice made ahead has not seen the measurement of the
        step it runs beside: the policy's view lags a step."""
        if self._plain_load is not None:
            self.settle()
            load, ids = self._plain_load
            num_steps, self._held = self._held + 1, 0
            self._ahead = (load, ids, self.policy.choose(load, ids, num_steps=num_steps))
        elif len(self._measured) >= PLAIN_REASK:
            self.settle()

    def _has_drafts(self, out: SchedulerOutput, can_draft: list[bool]) -> bool:
        """Some sequence that could draft has drafts from the last step (drafting goes on, rather
        than starting with a step that only proposes)."""
        if not self.book.proposed:
            return False
        return any([self.book.num_pending(s.seq) for s, c in zip(out.scheduled, can_draft, strict=True) if c])

    @staticmethod
    def _drafting_ids(out: SchedulerOutput, can_draft: list[bool], num_drafting: int) -> tuple[str, ...]:
        """The requests that could draft this step, whose own acceptance the policy prices it at
        (`DraftPolicy.choose`); none past `OWN_MAX_SEQS` (the shared estimate then)."""
        if not num_drafting or num_drafting > OWN_MAX_SEQS:
            return ()
        return tuple([s.seq.request_id for s, c in zip(out.scheduled, can_draft, strict=True) if c])

    def _load(self, num_rows: int, num_drafting: int, num_other_samples: int) -> StepLoad:
        """The step's load, one object per distinct load: a decode stream repeats a few, and a frozen
        dataclass's construction (a setattr per field) was ~1 us of every plain step."""
        key = (num_rows, num_drafting, num_other_samples)
        load = self._loads.get(key)
        if load is None:
            if len(self._loads) > 4096:  # loads vary with prefill chunks: keep it bounded
                self._loads.clear()
            load = self._loads[key] = StepLoad(num_rows, num_drafting, num_other_samples)
        return load

    def _catch_up_worth(self, out: SchedulerOutput, can_draft: list[bool]) -> None:
        """Clear `can_draft` for sequences whose catch-up would cost more than drafting can still
        save them (`DraftPolicy.pays_to_catch_up`; not under a forced draft length). Asked on every
        step that would draft, not once: the answer depends on the load's measured rates too, which
        change (a refresh's plain step once left every sequence of a winning load a one-position gap
        while its measured saving read nothing, and a refusal kept for good then stopped them all)."""
        if self.policy.forced_k is not None:
            return
        num_seqs = len(out.scheduled)
        for b, s in enumerate(out.scheduled):
            if not can_draft[b]:
                continue
            seq = s.seq
            gap = self.book.gap(seq)
            if gap:
                left = seq.request.sampling.max_tokens - seq.num_output_tokens
                can_draft[b] = self.policy.pays_to_catch_up(num_seqs, gap, left)
                if not can_draft[b]:
                    self._refused[seq.request_id] = (load_bucket(num_seqs), self._num_steps)

    def _skip_refused(self, out: SchedulerOutput, can_draft: list[bool]) -> None:
        """Clear `can_draft` for sequences refused a catch-up fewer than `CATCH_UP_REASK` steps ago
        at this load: not priced as drafting (`choose`), nor asked again yet."""
        bucket, now, refused = load_bucket(len(out.scheduled)), self._num_steps, self._refused
        for b, s in enumerate(out.scheduled):
            if can_draft[b]:
                rid = s.seq.request_id
                got = refused.get(rid)
                if got is not None:
                    if got[0] == bucket and now - got[1] < CATCH_UP_REASK:
                        can_draft[b] = False
                    else:
                        del refused[rid]

    def add(self, seq: Sequence) -> None:
        """`seq` was queued (the book notes whether it may ever draft)."""
        self.book.add(seq)

    def forget(self, request_id: str) -> None:
        self.book.finish(request_id)
        self._refused.pop(request_id, None)
        self.policy.forget(request_id)
        self._host_generators.pop(request_id, None)

    def preempted(self, request_id: str) -> None:
        """The request lost its pages and will recompute: its drafts are for KV that is gone (its
        host generator stays: the draws its recompute makes continue the stream)."""
        self.book.forget(request_id)
        self._refused.pop(request_id, None)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, out: SchedulerOutput, is_drafting: list[bool], tag_updates: list[tuple[int, int]]
    ) -> list[SeqResult]:
        runner = self.runner
        start = time.perf_counter()
        rows = [self._row(s, d) for s, d in zip(out.scheduled, is_drafting, strict=True)]
        self.did_verify = any(r.drafts for r in rows)
        # drafts verified a sequence: a step after a shorter k verifies only the ones proposed then
        self.num_verified = max((len(r.drafts) for r in rows), default=0)
        self.num_gap_rows = sum(r.gap for r in rows)
        if self._is_whole(rows):
            return self._run_greedy(rows, tag_updates)
        host, prompt = plan_target(rows, self.block_manager)
        updates = np.array(tag_updates, dtype=np.int64) if tag_updates else None
        logits, flags = self._forward(StepInputs(host, updates, SpecForward(VERIFY)))  # [N, V], [B]
        results = [SeqResult(r.sched.seq, r.sched.num_new_tokens, False) for r in rows]
        emitted = choose_tokens(rows, logits, runner, self._host_generator)  # per sequence, [] when none
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
                if not self.book.has_hole(r.sched.seq):  # drafts over a given-up gap's zeros: not the load's
                    self.policy.observe(len(r.drafts), len(tokens) - 1, r.sched.seq.request_id)
            scores = token_scores(logits, r, tokens, runner.sampler)
            res.accepted, res.sample = scores[:-1], scores[-1]
        for b, (prompt_rows, targets) in prompt.items():
            if not results[b].is_tag_mismatch:
                index = to_device(prompt_rows, torch.int64, logits.device)
                results[b].prompt_scores = runner.sampler.score(
                    logits[index], targets, out.scheduled[b].seq.request.sampling.top_logprobs
                )
        verified = time.perf_counter()  # the verify's flags and tokens came back: its forward is done
        for r in rows:
            self.book.forget(r.sched.seq.request_id)
        proposed, draft_rows = propose(
            rows,
            results,
            emitted,
            self.k,
            runner=runner,
            block_manager=self.block_manager,
            forward=self._forward,
            keeps_draft_kv=[self.book.can_ever_draft(r.sched.seq) for r in rows],
        )
        for b, drafts in proposed.items():
            seq = rows[b].sched.seq
            self.book.keep(seq, seq.num_tokens + len(emitted[b]), drafts)
        # m is a decode step's ratio: neither a gap's prefill nor a step that only fills prompt chunks
        if any(is_drafting) and not self.did_catch_up:
            self.policy.observe_timing(
                verified - start, len(host.input_ids), time.perf_counter() - verified, draft_rows
            )
        return results

    # ---- a whole step on the device (backend/engine/speculative/greedy.py, sampled.py) -----------
    def _is_whole(self, rows: list[SpecRow]) -> bool:
        """Every sequence verifies this step's k drafts, samples without penalties (greedy, or
        sampled where `is_sampled_enabled`), wants no logprobs, has a token guard the device can
        apply (at most `MAX_BANNED` ids) or none, has pages for the chained drafts after any accepted
        run (its window not cut by `max_tokens`) and no MTP KV to catch up."""
        k = self.k
        for r in rows:
            seq = r.sched.seq
            row = seq.sample_row
            if (
                len(r.drafts) != k
                or r.gap
                or not can_sample_on_device(row)
                or not (self.is_greedy_enabled if row.is_argmax else self.is_sampled_enabled)
                or seq.wants_prompt_logprobs
                or seq.num_tokens + 2 * k - 1 > seq.num_prompt_tokens + seq.request.sampling.max_tokens
                or (seq.guard is not None and seq.guard.max_banned > MAX_BANNED)
            ):
                return False
        return k > 0

    def _run_greedy(self, rows: list[SpecRow], tag_updates: list[tuple[int, int]]) -> list[SeqResult]:
        """The step as one device function: verify, accept, propose; one copy back."""
        k, L = self.k, self.k + 1
        host = plan_greedy(rows, k, self.block_manager, self.runner.vocab_size)
        seqs = [r.sched.seq for r in rows]
        if not all(seq.sample_row.is_argmax for seq in seqs):
            gens = [self._host_generator(seq) for seq in seqs]
            host.draws = draw_rows([seq.sample_row for seq in seqs], gens, k)
            self.num_sampled_steps += 1
        updates = np.array(tag_updates, dtype=np.int64) if tag_updates else None
        packed, flags = self._forward(StepInputs(host, updates, SpecForward(GREEDY)))  # [B, 3 + 2k], [B]
        if self.runner.ranks is not None:  # the flags OR-reduced over the ranks, for this rank's own
            packed[:, -1].copy_(flags)
        values = packed.tolist()  # the step's one copy back
        self.num_greedy_steps += 1
        results = []
        for r, (a, *rest, flag) in zip(rows, values, strict=True):
            seq = r.sched.seq
            self.book.forget(seq.request_id)
            res = SeqResult(seq, 1, bool(flag))
            results.append(res)
            if res.is_tag_mismatch:
                continue
            tokens, drafts = rest[: a + 1], rest[L:]
            res.num_new_tokens = a + 1  # the verify rows of the accepted tokens hold valid KV
            seq.wrote_draft_kv(seq.num_computed_tokens + a + 1)  # depth 0 ran over them
            self.stats.verifies += 1
            self.stats.drafted_tokens += k
            self.stats.accepted_tokens += a
            if not self.book.has_hole(seq):
                self.policy.observe(k, a, seq.request_id)
            scores = [TokenScore(t, None, []) for t in tokens]
            res.accepted, res.sample = scores[:-1], scores[-1]
            remaining = seq.request.sampling.max_tokens - (seq.num_output_tokens + a + 1)
            if min(k, remaining - 1) > 0:
                self.book.keep(seq, seq.num_tokens + a + 1, drafts[: min(k, remaining - 1)])
        return results

    def _host_generator(self, seq: Sequence) -> torch.Generator:
        """Where the uniforms of `seq`'s drafts are drawn (whole step or host path alike): its own
        generator when that is on the host, else one of the host's seeded from it (`HOST_SEED_SALT`)."""
        if seq.generator.device.type == "cpu":
            return seq.generator
        gen = self._host_generators.get(seq.request_id)
        if gen is None:
            seed = seq.generator.initial_seed() ^ HOST_SEED_SALT
            gen = self._host_generators[seq.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def _forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the step, on every rank: (logits [N, V], tag flags [B])."""
        if self.runner.ranks is not None:
            self.runner.ranks.send(inputs)
        return self.runner.forward_step(inputs)

    def _row(self, s: ScheduledSeq, is_drafting: bool) -> SpecRow:
        seq = s.seq
        is_decode = s.num_new_tokens == 1 and seq.num_uncomputed_tokens == 1
        drafts = self.book.drafts_for(seq)[: self.k] if is_drafting and is_decode else []
        return SpecRow(s, is_drafting, list(drafts), gap=self.book.gap(seq) if is_drafting else 0)
