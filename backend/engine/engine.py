"""The engine: requests in, token events out, one `step()` at a time (DESIGN.md §2 steps 5–7).

`step()` is schedule → run → postprocess. Aborts requested between steps take effect at the start
of the next one. A request whose pages failed the tag check is aborted alone, with an
`integrity_abort` error, a counter and one log line; the token sampled for it in that step is
dropped. Stop strings are matched here only when the engine was given a `detokenize` callable;
otherwise the serving layer matches them on its own detokenized text and calls `abort`. Either way
the serving layer trims the stop string from the text it returns.

With speculative decoding (`EngineConfig.num_speculative_tokens`, backend/engine/speculative/decoder.py)
a step may return several tokens for a request; they are checked for stops one by one, and those
after a stop are dropped.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from backend.engine.block_manager import BlockManager
from backend.engine.constraint import TokenConstraint, TokenGuard
from backend.engine.decode_graphs import Capture
from backend.engine.engine_config import EngineConfig
from backend.engine.model_runner import ModelRunner, PagedModel, SeqResult
from backend.engine.ranks import StepChannel
from backend.engine.sampler import TokenScore
from backend.engine.scheduler import Scheduler
from backend.engine.sequence import Sequence
from backend.engine.speculative.decoder import SpecDecoder
from backend.errors import Aborted, EngineError, IntegrityAbort, InvalidRequest
from schemas.backend import EngineOutput, EngineRequest, FinishReason, LoadReport, TokenLogprob, TopLogprob

log = logging.getLogger("kumo.engine")


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A model ready to serve and what the engine must know of it: its weights already in their
    serving form (quantized modules set up for `EngineConfig.int4_prefill`) and, for an FP8 cache,
    the per-layer KV scales (never a silent 1.0). Built by `backend.models.loader.prepare_model`."""

    model: PagedModel
    vocab_size: int
    context_window: int
    model_dtype: torch.dtype
    device: torch.device
    kv_scales: list[dict[str, float]] | None


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    checked_seqs: int = 0  # (sequence, step) pairs whose pages went through the tag checks
    computed_tokens: int = 0  # tokens run through the model (prefill, recompute and decode)
    generated_tokens: int = 0
    tag_check_aborts: int = 0
    aborts: int = 0
    preemptions: int = 0
    prefix_hits: int = 0  # pages
    prefix_misses: int = 0  # lookups that stopped at an uncached page
    prefix_evictions: int = 0
    cached_tokens: int = 0
    last_step_s: float = 0.0
    total_step_s: float = 0.0
    spec_verifies: int = 0  # speculative: (sequence, step) pairs that verified drafts
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_length: int = 0  # the draft policy's last choice (0 … K)
    spec_acceptance_length: float = 0.0  # tokens per verify expected at K, from the measured acceptance


class Engine:
    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig,
        *,
        vocab_size: int,
        context_window: int,
        model_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_scales: list[dict[str, float]] | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        graph_capture: Capture | None = None,
        ranks: StepChannel | None = None,
    ) -> None:
        """`graph_capture`: the CPU tests' seam into the decode graphs (see `ModelRunner`). `ranks`:
        the other tensor-parallel ranks, which run each step with this one (backend/engine/ranks.py)."""
        if config.kv_dtype == "float8_e4m3fn" and kv_scales is None:
            raise ValueError("an FP8 KV cache needs per-layer scales (never a silent 1.0): see prepare_model")
        self.config = config
        self.block_manager = BlockManager(
            config.num_pages, config.page_size, enable_prefix_cache=config.enable_prefix_cache
        )
        self.scheduler = Scheduler(
            config, self.block_manager, context_window=context_window, vocab_size=vocab_size
        )
        self.runner = ModelRunner(
            model,
            config,
            model_dtype=model_dtype,
            vocab_size=vocab_size,
            device=device,
            kv_scales=kv_scales,
            max_seq_len=self.scheduler.context_window,
            graph_capture=graph_capture,
            page_tables=self.block_manager.page_tables,
            ranks=ranks,
        )
        self.spec = None
        if config.num_speculative_tokens:
            self.spec = SpecDecoder(self.runner, self.block_manager, can_match_stops=detokenize is not None)
            self.scheduler.draft_rows = self.spec.book.num_pending_rows
        self.detokenize = detokenize
        self._stats = EngineStats()
        self._seqs: dict[str, Sequence] = {}
        self._abort_ids: set[str] = set()
        self._seeds = random.Random(config.seed)

    @classmethod
    def from_prepared(
        cls,
        prepared: PreparedModel,
        config: EngineConfig,
        *,
        detokenize: Callable[[list[int]], str] | None = None,
        graph_capture: Capture | None = None,
    ) -> Engine:
        """An engine over a checkpoint made ready by `backend.models.loader.prepare_model`."""
        return cls(
            prepared.model,
            config,
            vocab_size=prepared.vocab_size,
            context_window=prepared.context_window,
            model_dtype=prepared.model_dtype,
            device=prepared.device,
            kv_scales=prepared.kv_scales,
            detokenize=detokenize,
            graph_capture=graph_capture,
        )

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request: EngineRequest,
        *,
        constraint: TokenConstraint | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> None:
        """Queue a request; raise the `EngineError` that refuses it (bad input, too big, busy)."""
        if request.request_id in self._seqs:
            raise InvalidRequest(f"Request id {request.request_id!r} is already running.")
        seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(63)
        seq = Sequence(
            request=request,
            generator=torch.Generator(device=self.runner.device).manual_seed(seed),
            constraint=constraint,
            guard=TokenGuard.of(request),
            image_embeds=image_embeds,
        )
        num_image_tokens = sum(s.length for s in request.image_spans)
        if image_embeds is not None and image_embeds.shape[0] != num_image_tokens:
            raise InvalidRequest(
                f"{image_embeds.shape[0]} image embeddings for {num_image_tokens} image placeholder tokens."
            )
        self.scheduler.add(seq)
        if self.spec is not None:
            self.spec.add(seq)
        self._seqs[request.request_id] = seq

    def abort(self, request_id: str) -> None:
        """End a request at the start of the next step (its pages are freed then)."""
        if request_id in self._seqs:
            self._abort_ids.add(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def keep_alive_in(self) -> float | None:
        """With other ranks: how much longer this rank may go without a step (`keep_alive` then);
        None: as long as it likes."""
        ranks = self.runner.ranks
        return ranks.keep_alive_in() if ranks is not None else None

    def keep_alive(self) -> None:
        """Idle with other ranks: they wait for the next step in a collective that must not time out
        (backend/engine/ranks.py `KeepAlive`). `RanksDown` if one of them is gone."""
        if self.runner.ranks is not None:
            self.runner.ranks.keep_alive()

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        start = time.perf_counter()
        outputs = self._apply_aborts()
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return outputs
        spec = self.spec
        if spec is not None:
            for seq in scheduled.preempted:
                spec.preempted(seq.request_id)
        drafting = spec.drafting(scheduled, self._num_requests()) if spec is not None else []
        is_drafting = spec is not None and spec.k > 0 and any(drafting)
        tag_updates = self.block_manager.take_tag_updates()
        try:
            if spec is not None and (is_drafting or spec.fills_draft_kv):
                results = spec.run(scheduled, drafting, tag_updates)
            else:
                results = self.runner.run(
                    scheduled, tag_updates, spec.while_plain_step if spec is not None else None
                )
        except Exception:
            # a failed step is over too, once the device is idle; else its pages stay quarantined
            # forever and a request needing them waits while the engine spins on empty steps
            self.runner.synchronize()
            self.runner.apply_tag_updates(tag_updates)  # it may have failed before its copy: tags must land
            self.block_manager.complete_step(scheduled.step)
            raise
        self.block_manager.complete_step(scheduled.step)
        num_generated = self._stats.generated_tokens
        outputs += [o for r in results if (o := self._postprocess(r)) is not None]
        elapsed = time.perf_counter() - start
        if spec is not None and scheduled.num_tokens == len(results):  # decode only: measure the step
            if is_drafting:  # a verify emits its accepted run and one more, a stop inside it or not
                emitted = sum([len(r.accepted) + 1 for r in results if r.sample is not None])
            else:  # one token a sampled sequence, each counted as generated: no pass over them
                emitted = self._stats.generated_tokens - num_generated
            spec.measured(len(results), sum(drafting) if is_drafting else 0, emitted, elapsed)
        self._stats.steps += 1
        self._stats.checked_seqs += len(results) if self.config.check_page_tags else 0
        self._stats.last_step_s = elapsed
        self._stats.total_step_s += elapsed
        return outputs

    def _num_requests(self) -> int:
        """The load about to run, for the draft policy: a burst still being admitted counts whole (as
        many as can run), but not a queue the pool cannot admit from now (its requests wait for pages
        while the same sequences run: counted, they kept drafting off for as long as it lasted)."""
        scheduler = self.scheduler
        num_running, waiting = len(scheduler.running), scheduler.waiting
        room = self.config.max_num_seqs - num_running
        if room <= 0 or not waiting or not self.block_manager.can_admit(waiting[0]):
            return num_running
        return num_running + min(len(waiting), room)

    def fail_all(self, error: EngineError) -> list[EngineOutput]:
        """End every request with `error` (after a step raised) and free all their pages."""
        return [self._finish(seq, "abort", error) for seq in list(self._seqs.values())]

    def load(self) -> LoadReport:
        return LoadReport(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            free_pages=self.block_manager.num_available_pages,
            total_pages=self.block_manager.num_pages,
        )

    @property
    def stats(self) -> EngineStats:
        s = self._stats
        s.preemptions = self.scheduler.num_preemptions
        cache = self.block_manager.prefix_cache
        if cache is not None:
            s.prefix_hits, s.prefix_misses = cache.stats.hits, cache.stats.misses
            s.prefix_evictions, s.cached_tokens = cache.stats.evictions, cache.stats.hit_tokens
        if self.spec is not None:
            spec = self.spec.stats
            s.spec_verifies, s.spec_drafted_tokens = spec.verifies, spec.drafted_tokens
            s.spec_accepted_tokens = spec.accepted_tokens
            s.spec_draft_length = self.spec.policy.last_k
            s.spec_acceptance_length = self.spec.policy.acceptance_length
        return s

    # ---- postprocess ---------------------------------------------------------------------------
    def _apply_aborts(self) -> list[EngineOutput]:
        outputs = []
        for request_id in sorted(self._abort_ids):
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._stats.aborts += 1
                error = Aborted(f"Request {request_id} was aborted.")
                outputs.append(self._finish(seq, "abort", error))
        self._abort_ids.clear()
        return outputs

    def _postprocess(self, r: SeqResult) -> EngineOutput | None:
        seq = r.seq
        if r.is_tag_mismatch:
            found_here = self.runner.find_mismatch(seq)  # None: the mismatch was on another rank
            page, expected, found = found_here or (-1, -1, -1)
            self._stats.tag_check_aborts += 1
            log.warning(  # the tenant as its salt's prefix: enough to correlate, never the whole key
                "kv page tag mismatch: request=%s page=%d expected=%d found=%d tenant=%s",
                seq.request_id,
                page,
                expected,
                found,
                seq.request.tenant_salt[:12],
            )
            where = (
                f"KV page {page} carries tag {found}, expected {expected}"
                if found_here is not None
                else "a KV page on another rank carries a tag other than expected"
            )
            self.block_manager.distrust(seq)
            return self._finish(
                seq, "abort", IntegrityAbort(f"Request {seq.request_id} was aborted: {where}.")
            )
        seq.num_computed_tokens += r.num_new_tokens
        self._stats.computed_tokens += r.num_new_tokens
        for score in r.prompt_scores:
            seq.prompt_logprobs.append(self._logprob(score, score.token_id))
        if r.sample is None:
            self.block_manager.publish_full_pages(seq)
            return None
        sampling, is_first = seq.request.sampling, seq.num_emitted_tokens == 0
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        reason: FinishReason | None = None
        for score in [*r.accepted, r.sample]:  # one token, or a speculative step's accepted run
            token = score.token_id
            seq.token_ids.append(token)
            tokens.append(token)
            if sampling.logprobs:
                logprobs.append(self._logprob(score, token))
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if seq.guard is not None:
                seq.guard.accept(token)
            reason = self._stop_reason(seq, token, len(seq.token_ids) - seq.num_prompt_tokens)
            if reason is not None:
                break
        self._stats.generated_tokens += len(tokens)
        # a stop inside an accepted run: the KV past the kept tokens is not theirs to publish
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
        seq.clamp_draft_kv(seq.num_computed_tokens)
        self.block_manager.publish_full_pages(seq)  # after the tokens: their KV is computed
        out = EngineOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            logprobs=logprobs if sampling.logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if is_first and sampling.prompt_logprobs else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.token_ids) - seq.num_prompt_tokens,
        )
        seq.num_emitted_tokens += len(tokens)
        if reason is not None:
            self._retire(seq)
            out.finish_reason = reason
            # the grammar stopped the output unfinished (a schema with no finite value, a limit)
            failed = getattr(seq.constraint, "error", None) if seq.constraint is not None else None
            if failed is not None:
                out.finish_reason, out.error = "abort", InvalidRequest(failed).to_event()
                seq.finish_reason, seq.error = out.finish_reason, out.error
        return out

    def _stop_reason(self, seq: Sequence, token: int, num_output: int) -> FinishReason | None:
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids or (
            not sampling.ignore_eos and token in seq.request.eos_token_ids
        ):
            return "stop"
        if seq.constraint is not None and seq.constraint.is_finished():
            return "stop"
        if sampling.stop and self.detokenize is not None:
            window = max(len(s) for s in sampling.stop) + 8
            tail = self.detokenize(seq.output_token_ids[-window:])
            if any(s in tail for s in sampling.stop):
                return "stop"
        if num_output >= sampling.max_tokens:
            return "length"
        return None

    def _logprob(self, score: TokenScore, token: int) -> TokenLogprob:
        text = self.detokenize or (lambda ids: "")
        assert score.logprob is not None, "log-probs are computed for every row that asks for them"
        return TokenLogprob(
            token=text([token]),
            token_id=token,
            logprob=score.logprob,
            top=[TopLogprob(token=text([t]), token_id=t, logprob=lp) for t, lp in score.top],
        )

    def _finish(self, seq: Sequence, reason: FinishReason, error: EngineError) -> EngineOutput:
        self._retire(seq)
        seq.finish_reason, seq.error = reason, error.to_event()
        return EngineOutput(
            request_id=seq.request_id,
            finish_reason=reason,
            error=seq.error,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.forget(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        self._abort_ids.discard(seq.request_id)
