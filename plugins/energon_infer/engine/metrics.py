"""The engine's metrics, kept and rendered by ``prometheus_client`` (``/metrics``), every series labelled by model.

Histograms (so Prometheus computes any quantile over any window, and ``_sum`` / ``_count`` give means):
time to first token, inter-token latency (one observation per generated token after the first),
end-to-end latency of requests that finished, and how long a structured-output request waited for its grammar
(``energon_grammar_wait_seconds``: held out of the batch while the rank that samples compiles it). Counters: prompt and generation tokens, finished
requests by status (``ok``, ``error``, ``aborted``, ``rejected``), steps, worker failures and restarts, and with
speculative decoding the tokens proposed and accepted (and their ratio).
Gauges, read from the engine when scraped: waiting and running requests (and of the waiting, those waiting for
their grammar), KV-cache blocks in use and
their share, whether the worker group serves. Process metrics (CPU seconds, resident memory, open
files) come from ``prometheus_client``'s process collector. Rates (tokens per second) are
Prometheus's job: ``rate(energon_generation_tokens_total[1m])``.

Each :class:`EngineMetrics` has its own registry, so several engines in one process do not collide.
Thread-safe: the controller thread records, the server thread renders.

Example:
    >>> m = EngineMetrics(model_name="tiny")
    >>> m.record_finished(latency_s=0.5, ttft_s=0.1, tokens=4, status="ok")
    >>> 'energon_e2e_request_latency_seconds_count{model_name="tiny"} 1.0' in m.render()
    True
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["EngineMetrics", "CONTENT_TYPE", "TTFT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS", "PART_BUCKETS"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Buckets span a tiny CPU model (ms) to a large model under load (minutes); vLLM uses similar ranges.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
# The time account's parts (energon_infer.engine.account): from a few microseconds (a step's hand-off) to a queue.
PART_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 120.0)
STATUSES = ("ok", "error", "aborted", "rejected")


class EngineMetrics:
    """What ``/metrics`` and ``Engine.health()`` report (see the module docstring).

    Args:
        model_name: the ``model_name`` label of every series.
        state: called at each scrape for the gauges: a dict with ``waiting``, ``running``, ``kv_blocks_used``,
            ``kv_blocks_total`` and ``up`` (any may be missing); :meth:`bind` sets it later.
        process: also export this process's CPU, memory and file descriptors.
    """

    def __init__(self, model_name: str = "model", *, state: Callable[[], dict[str, float]] | None = None,
                 process: bool = True):
        self._lock = threading.Lock()
        self.model_name = model_name
        self._state = state
        self._override: dict[str, float] = {}
        self._render_lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by final status, for quick reads (tests, the exit line)
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.steps = 0
        self.spec_proposed = self.spec_accepted = 0  # speculative decoding: tokens proposed, and of those accepted
        self.worker_failures = 0
        self.restarts = 0
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.ttft = Histogram("energon_time_to_first_token_seconds", "Time from arrival to the first generated "
                              "token.", labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("energon_inter_token_latency_seconds", "Time between two consecutive generated tokens "
                             "of a request.", labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.grammar_wait = Histogram("energon_grammar_wait_seconds", "Time a structured-output request was held "
                                      "while its grammar compiled (one whose grammar was ready is not counted).", labels,
                                      buckets=PART_BUCKETS, registry=self.registry)
        self.e2e = Histogram("energon_e2e_request_latency_seconds", "Time from arrival to the last token, requests "
                             "that finished (ok).", labels, buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_counter = PromCounter("energon_prompt_tokens", "Prompt tokens of accepted requests.", labels,
                                          registry=self.registry)
        self.generation_counter = PromCounter("energon_generation_tokens", "Generated tokens.", labels,
                                              registry=self.registry)
        self.request_counter = PromCounter("energon_requests", "Finished requests by status (ok, error, aborted, "
                                           "rejected).", [*labels, "status"], registry=self.registry)
        self.parts = {kind: Histogram(f"energon_{kind}_part_seconds", f"The time account of each {kind}: seconds in "
                                      "each part (energon_infer.engine.account).", [*labels, "part"],
                                      buckets=PART_BUCKETS, registry=self.registry) for kind in ("request", "step")}
        self._part_children: dict[tuple[str, str], Any] = {}
        self._touch()
        self.registry.register(_EngineCollector(self))
        if process:
            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)

    def bind(self, *, model_name: str | None = None, state: Callable[[], dict[str, float]] | None = None) -> None:
        """Set the model label and the gauges' source (the engine does, once it knows them)."""
        if model_name is not None and model_name != self.model_name:
            for metric in (self.ttft, self.itl, self.e2e, self.grammar_wait, self.prompt_counter,
                           self.generation_counter):
                metric.clear()
            self.request_counter.clear()
            for hist in self.parts.values():
                hist.clear()
            self._part_children = {}
            self.model_name = model_name
            self._touch()
        if state is not None:
            self._state = state

    def _touch(self) -> None:
        # Every series exists from the start (at 0), so rate() and absent() work before the first request.
        for metric in (self.ttft, self.itl, self.e2e, self.grammar_wait, self.prompt_counter, self.generation_counter):
            metric.labels(self.model_name)
        for status in STATUSES:
            self.request_counter.labels(self.model_name, status)

    # ------------------------------------------------------------------ recording (controller thread)

    def record_step(self, n_tokens: int, n_generated: int) -> None:
        with self._lock:
            self.steps += 1
            self.generated_tokens += n_generated
        self.generation_counter.labels(self.model_name).inc(n_generated)

    def record_speculation(self, proposed: int, accepted: int) -> None:
        """A step verified ``proposed`` proposed tokens, of which ``accepted`` were kept."""
        with self._lock:
            self.spec_proposed += proposed
            self.spec_accepted += accepted

    def record_submitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
        self.prompt_counter.labels(self.model_name).inc(prompt_tokens)

    def record_grammar_wait(self, seconds: float) -> None:
        """A request held for its grammar was released (or failed with it) after ``seconds``."""
        self.grammar_wait.labels(self.model_name).observe(seconds)

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)

    def record_token_gap(self, seconds: float) -> None:
        """One inter-token latency: the time since the same request's previous token."""
        self.itl.labels(self.model_name).observe(seconds)

    def record_finished(self, *, latency_s: float, ttft_s: float | None, tokens: int, status: str,
                        first_token_recorded: bool = False) -> None:
        """A request left the engine; ``first_token_recorded``: its TTFT was observed at its first token."""
        with self._lock:
            self.requests[status] += 1
        self.request_counter.labels(self.model_name, status).inc()
        if status == "ok":
            self.e2e.labels(self.model_name).observe(latency_s)
            if ttft_s is not None and not first_token_recorded:
                self.ttft.labels(self.model_name).observe(ttft_s)

    def observe_part(self, kind: str, part: str, seconds: float) -> None:
        """One part of a request's or a step's time account (``kind``: ``"request"`` or ``"step"``)."""
        child = self._part_children.get((kind, part))
        if child is None:
            child = self._part_children[(kind, part)] = self.parts[kind].labels(self.model_name, part)
        child.observe(seconds)

    def record_rejected(self) -> None:
        with self._lock:
            self.requests["rejected"] += 1
        self.request_counter.labels(self.model_name, "rejected").inc()

    # ------------------------------------------------------------------ rendering (any thread)

    def render(self, *, queue_depth: int | None = None, running: int | None = None, up: bool | None = None,
               extra: dict[str, float] | None = None) -> str:
        """The Prometheus text exposition format (version 0.0.4). Values given here override the bound state."""
        given = {"waiting": queue_depth, "running": running, "up": None if up is None else float(up), **(extra or {})}
        with self._render_lock:  # one render at a time: the overrides hold for this render only
            self._override = {k: float(v) for k, v in given.items() if v is not None}
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._override = {}

    def gauges(self) -> dict[str, float]:
        state = dict(self._state() if self._state is not None else {})
        state.update(self._override)
        return state


class _EngineCollector(Collector):
    """Series read at scrape time: gauges from the engine's state, counters the controller increments."""

    GAUGES = (("waiting", "energon_num_requests_waiting", "Requests waiting to be admitted."),
              ("grammar_waiting", "energon_num_requests_waiting_for_grammar", "Waiting requests held until the rank "
               "that samples has compiled their grammar."),
              ("running", "energon_num_requests_running", "Requests in the running batch."),
              ("kv_blocks_used", "energon_kv_cache_blocks_used", "KV-cache blocks reserved by running requests."),
              ("kv_blocks_total", "energon_kv_cache_blocks_total", "KV-cache blocks of each worker."),
              ("kv_usage", "energon_kv_cache_usage_ratio", "Share of the KV-cache blocks in use (0 to 1)."),
              ("up", "energon_up", "1 while the worker group is serving."))

    def __init__(self, metrics: EngineMetrics):
        self.m = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())  # series appear only once there is a value; nothing to check for collisions

    def collect(self) -> Iterator[Metric]:
        m = self.m
        state = m.gauges()
        if state.get("kv_blocks_total") and "kv_blocks_used" in state and "kv_usage" not in state:
            state["kv_usage"] = state["kv_blocks_used"] / state["kv_blocks_total"]
        for key, name, help_text in self.GAUGES:
            if key in state:
                g = GaugeMetricFamily(name, help_text, labels=["model_name"])
                g.add_metric([m.model_name], state[key])
                yield g
        for key, value in state.items():  # anything else the engine reports
            if key not in {k for k, _, _ in self.GAUGES}:
                g = GaugeMetricFamily(f"energon_{key}", f"{key} (engine state)", labels=["model_name"])
                g.add_metric([m.model_name], value)
                yield g
        for name, help_text, value in (("energon_steps", "Batched steps run by the workers.", m.steps),
                                       ("energon_worker_failures", "Worker group failures.", m.worker_failures),
                                       ("energon_worker_restarts", "Worker group restarts.", m.restarts)):
            c = CounterMetricFamily(name, help_text, labels=["model_name"])
            c.add_metric([m.model_name], value)
            yield c
        if m.spec_proposed:  # speculative decoding: from its first verified step on
            for name, help_text, value in (
                    ("energon_spec_proposed_tokens", "Tokens proposed by speculative decoding.", m.spec_proposed),
                    ("energon_spec_accepted_tokens", "Proposed tokens the model accepted.", m.spec_accepted)):
                c = CounterMetricFamily(name, help_text, labels=["model_name"])
                c.add_metric([m.model_name], value)
                yield c
            g = GaugeMetricFamily("energon_spec_acceptance_ratio", "Accepted over proposed tokens, since the start.",
                                  labels=["model_name"])
            g.add_metric([m.model_name], m.spec_accepted / m.spec_proposed)
            yield g
