"""What the gateway's own /metrics say during an overload run: its pool's concurrency limit, admitted
requests in flight and queue depth (sampled a few times a second), and the mean wait in its
admission queue per priority (from the kvgate_queue_wait_seconds histogram, before vs after)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Sequence

import httpx

from loadtest.prometheus_text import parse_samples

GAUGES = {"limit": "kvgate_concurrency_limit", "in_flight": "kvgate_admitted_in_flight",
          "queued": "kvgate_queue_depth"}


def gauge_values(text: str) -> dict[str, float]:
    """The admission gauges summed over pools (and priorities, for the queue)."""
    return {key: sum(value for _, value in parse_samples(text, name)) for key, name in GAUGES.items()}


def queue_wait_by_priority(before: str, after: str) -> dict[str, dict[str, float | None]]:
    """priority -> {count, mean_ms} of the admission queue waits between two scrapes."""
    def totals(text: str, suffix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in parse_samples(text, f"kvgate_queue_wait_seconds_{suffix}"):
            out[labels.get("priority", "")] = out.get(labels.get("priority", ""), 0.0) + value
        return out

    counts = {p: n - totals(before, "count").get(p, 0.0) for p, n in totals(after, "count").items()}
    sums = {p: s - totals(before, "sum").get(p, 0.0) for p, s in totals(after, "sum").items()}
    return {p: {"count": n, "mean_ms": sums.get(p, 0.0) / n * 1000 if n else None} for p, n in sorted(counts.items())}


def summarize_gauges(samples: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float] | None]:
    """min / mean / max of each gauge over the samples (None without samples)."""
    out: dict[str, dict[str, float] | None] = {}
    for key in GAUGES:
        values = [s[key] for s in samples if key in s]
        out[key] = {"min": min(values), "mean": sum(values) / len(values), "max": max(values)} if values else None
    return out


class GaugeSampler:
    """Scrapes metrics_url every interval_s in a thread between start() and stop()."""

    def __init__(self, metrics_url: str, interval_s: float = 0.5, fetch: Callable[[str], str] | None = None) -> None:
        self.metrics_url, self.interval_s = metrics_url, interval_s
        self.fetch = fetch or (lambda url: httpx.get(url, timeout=5.0).text)
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gauge-sampler", daemon=True)

    def start(self) -> "GaugeSampler":
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _run(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            try:
                self.samples.append({"t_s": time.monotonic() - start, **gauge_values(self.fetch(self.metrics_url))})
            except httpx.HTTPError:
                pass
            self._stop.wait(self.interval_s)
