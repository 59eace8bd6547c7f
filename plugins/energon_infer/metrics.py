"""Engine counters and latency windows, rendered in the Prometheus text format (``/metrics``).

Latency percentiles come from the last ``window`` finished requests (a Prometheus *summary* with
quantiles 0.5 / 0.9 / 0.99); tokens per second from the tokens generated in the last
``rate_window_s`` seconds. Thread-safe: the controller thread records, the server thread renders.

Example:
    >>> m = EngineMetrics()
    >>> m.record_finished(latency_s=0.5, ttft_s=0.1, tokens=4, status="ok")
    >>> "energon_request_latency_seconds{quantile=\\"0.5\\"} 0.5" in m.render(queue_depth=0, running=0)
    True
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from typing import Any

__all__ = ["EngineMetrics", "percentile"]

QUANTILES = (0.5, 0.9, 0.99)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 1]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class EngineMetrics:
    """What ``/metrics`` and ``Engine.health()`` report.

    Args:
        window: finished requests kept for the latency percentiles.
        rate_window_s: seconds over which tokens per second is measured.
    """

    def __init__(self, window: int = 2048, rate_window_s: float = 10.0):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests: Counter[str] = Counter()  # by final status: ok, error, aborted, rejected
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.steps = 0
        self.step_tokens = 0
        self.worker_failures = 0
        self.restarts = 0
        self._latency: deque[float] = deque(maxlen=window)
        self._ttft: deque[float] = deque(maxlen=window)
        self._recent: deque[tuple[float, int]] = deque()
        self.rate_window_s = rate_window_s

    def record_step(self, n_tokens: int, n_generated: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.steps += 1
            self.step_tokens += n_tokens
            self.generated_tokens += n_generated
            self._recent.append((now, n_generated))
            while self._recent and self._recent[0][0] < now - self.rate_window_s:
                self._recent.popleft()

    def record_submitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def record_finished(self, *, latency_s: float, ttft_s: float | None, tokens: int, status: str) -> None:
        with self._lock:
            self.requests[status] += 1
            if status == "ok":
                self._latency.append(latency_s)
                if ttft_s is not None:
                    self._ttft.append(ttft_s)

    def record_rejected(self) -> None:
        with self._lock:
            self.requests["rejected"] += 1

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.rate_window_s]
        if not recent:
            return 0.0
        span = min(self.rate_window_s, max(now - self.started, 1e-9))
        return sum(n for _, n in recent) / span

    def latency_quantiles(self) -> dict[str, dict[float, float]]:
        with self._lock:
            lat, ttft = list(self._latency), list(self._ttft)
        return {"latency": {q: percentile(lat, q) for q in QUANTILES},
                "ttft": {q: percentile(ttft, q) for q in QUANTILES}}

    def snapshot(self) -> dict[str, Any]:
        q = self.latency_quantiles()
        with self._lock:
            return {"requests": dict(self.requests), "generated_tokens": self.generated_tokens,
                    "prompt_tokens": self.prompt_tokens, "steps": self.steps,
                    "mean_step_tokens": self.step_tokens / self.steps if self.steps else 0.0,
                    "worker_failures": self.worker_failures, "restarts": self.restarts,
                    "latency_p50_s": q["latency"][0.5], "latency_p99_s": q["latency"][0.99],
                    "ttft_p50_s": q["ttft"][0.5], "tokens_per_second": self.tokens_per_second()}

    def render(self, *, queue_depth: int, running: int, up: bool = True, extra: dict[str, float] | None = None) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        q = self.latency_quantiles()
        tps = self.tokens_per_second()
        with self._lock:
            lines = [
                "# HELP energon_up 1 while the worker group is serving.", "# TYPE energon_up gauge",
                f"energon_up {1 if up else 0}",
                "# HELP energon_queue_depth Requests waiting to be admitted.", "# TYPE energon_queue_depth gauge",
                f"energon_queue_depth {queue_depth}",
                "# HELP energon_running_requests Requests in the running batch.",
                "# TYPE energon_running_requests gauge", f"energon_running_requests {running}",
                "# HELP energon_requests_total Finished requests by status.", "# TYPE energon_requests_total counter",
            ]
            for status in sorted(set(self.requests) | {"ok", "error", "aborted", "rejected"}):
                lines.append(f'energon_requests_total{{status="{status}"}} {self.requests.get(status, 0)}')
            lines += [
                "# HELP energon_generated_tokens_total Tokens generated.",
                "# TYPE energon_generated_tokens_total counter", f"energon_generated_tokens_total {self.generated_tokens}",
                "# HELP energon_prompt_tokens_total Prompt tokens accepted.",
                "# TYPE energon_prompt_tokens_total counter", f"energon_prompt_tokens_total {self.prompt_tokens}",
                f"# HELP energon_tokens_per_second Generated tokens per second over the last {self.rate_window_s:g} s.",
                "# TYPE energon_tokens_per_second gauge", f"energon_tokens_per_second {tps:.6g}",
                "# HELP energon_steps_total Batched steps run by the workers.", "# TYPE energon_steps_total counter",
                f"energon_steps_total {self.steps}",
                "# HELP energon_worker_failures_total Worker group failures.",
                "# TYPE energon_worker_failures_total counter", f"energon_worker_failures_total {self.worker_failures}",
                "# HELP energon_worker_restarts_total Worker group restarts.",
                "# TYPE energon_worker_restarts_total counter", f"energon_worker_restarts_total {self.restarts}",
            ]
            for name, key, help_text in (("energon_request_latency_seconds", "latency", "End-to-end request latency."),
                                         ("energon_time_to_first_token_seconds", "ttft", "Time to the first token.")):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} summary"]
                lines += [f'{name}{{quantile="{qq}"}} {v:.6g}' for qq, v in q[key].items()]
            for name, value in (extra or {}).items():
                lines += [f"# TYPE {name} gauge", f"{name} {value:.6g}"]
        return "\n".join(lines) + "\n"
