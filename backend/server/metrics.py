"""The backend's Prometheus metrics, in a registry owned by the app (no process-global state).

Request and token counters are counted from the events the server sends; engine figures (pages,
prefix hits, tag-check aborts, steps and step time) are read from the engine when scraped, so the
engine's loop does no metrics work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from schemas.backend import Error, Event, Finish, LoadReport, Usage


class EngineFigures(Protocol):
    steps: int
    generated_tokens: int
    tag_check_aborts: int
    aborts: int
    preemptions: int
    prefix_hits: int
    prefix_misses: int
    cached_tokens: int
    total_step_s: float
    last_step_s: float
    spec_verifies: int
    spec_drafted_tokens: int
    spec_accepted_tokens: int
    spec_draft_length: int
    spec_acceptance_length: float


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineFigures], load: Callable[[], LoadReport]) -> None:
        self._stats, self._load = stats, load

    def collect(self) -> Iterator[Metric]:
        s, load = self._stats(), self._load()
        yield GaugeMetricFamily(
            "kumo_backend_pages_used", "KV pages in use", value=load.total_pages - load.free_pages
        )
        yield GaugeMetricFamily("kumo_backend_pages_total", "KV pages in the pool", value=load.total_pages)
        yield GaugeMetricFamily("kumo_backend_running", "requests decoding", value=load.running)
        yield GaugeMetricFamily("kumo_backend_waiting", "requests queued", value=load.waiting)
        for name, doc, value in [
            ("kumo_backend_engine_steps", "engine steps run", s.steps),
            ("kumo_backend_engine_step_seconds", "time spent in engine steps", s.total_step_s),
            ("kumo_backend_prefix_hits", "KV pages served from the prefix cache", s.prefix_hits),
            ("kumo_backend_prefix_misses", "prefix-cache lookups that missed", s.prefix_misses),
            (
                "kumo_backend_tag_check_aborts",
                "requests aborted by a KV page tag mismatch",
                s.tag_check_aborts,
            ),
            ("kumo_backend_engine_aborts", "requests aborted in the engine", s.aborts),
            ("kumo_backend_preemptions", "requests preempted for recompute", s.preemptions),
            (
                "kumo_backend_spec_verifies",
                "drafts verified, per request and step (tokens per verify: 1 + accepted / verifies)",
                s.spec_verifies,
            ),
            (
                "kumo_backend_spec_draft_tokens",
                "draft tokens verified (speculative decoding)",
                s.spec_drafted_tokens,
            ),
            (
                "kumo_backend_spec_accepted_tokens",
                "draft tokens accepted (speculative decoding)",
                s.spec_accepted_tokens,
            ),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "kumo_backend_last_step_seconds", "duration of the last engine step", value=s.last_step_s
        )
        yield GaugeMetricFamily(
            "kumo_backend_spec_draft_length",
            "drafts per sequence the draft policy chose for the last step that could draft (0: off)",
            value=s.spec_draft_length,
        )
        yield GaugeMetricFamily(
            "kumo_backend_spec_acceptance_length",
            "tokens per verify step expected with the longest draft, from the measured acceptance (EWMA)",
            value=s.spec_acceptance_length,
        )


class BackendMetrics:
    def __init__(self, stats: Callable[[], EngineFigures], load: Callable[[], LoadReport]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kumo_backend_requests", "generate requests by outcome", ["outcome"], registry=self.registry
        )
        self.finished = Counter(
            "kumo_backend_finished", "requests finished, by reason", ["reason"], registry=self.registry
        )
        self.errors = Counter(
            "kumo_backend_errors", "requests ended by an error event", ["code"], registry=self.registry
        )
        self.prompt_tokens = Counter("kumo_backend_prompt_tokens", "prompt tokens", registry=self.registry)
        self.cached_tokens = Counter(
            "kumo_backend_cached_tokens", "prompt tokens from the prefix cache", registry=self.registry
        )
        self.completion_tokens = Counter(
            "kumo_backend_completion_tokens", "generated tokens", registry=self.registry
        )
        self.disconnects = Counter(
            "kumo_backend_disconnects", "clients gone before the end", registry=self.registry
        )
        self.registry.register(_EngineCollector(stats, load))

    def refused(self, code: str) -> None:
        self.requests.labels(outcome=code).inc()

    def observe(self, event: Event) -> None:
        if isinstance(event, Usage):
            self.prompt_tokens.inc(event.prompt_tokens)
            self.cached_tokens.inc(event.cached_tokens)
            self.completion_tokens.inc(event.completion_tokens)
        elif isinstance(event, Finish):
            self.finished.labels(reason=event.reason).inc()
        elif isinstance(event, Error):
            self.errors.labels(code=event.code).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
