"""Counters and histograms for the series every request updates, kept as plain numbers on the event
loop and exported at scrape time: prometheus_client's own take a lock and check their arguments on
every update (about 5% of a proxied request's instructions went there). The exposition is the same
as prometheus_client's Counter and Histogram (names, types, labels, buckets; no `_created` series).
Update them from the event loop only (they take no lock); a scrape runs there too."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import INF, floatToGoString


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Counted in the first bucket whose upper bound is >= value, as prometheus_client does."""
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LoopCounter:
    """A counter with labels: `counter.labels(*values).inc(amount)` (keep the child: the lookup is the dearer part)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            child = self._children[values] = CounterChild()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        yield family


class LoopHistogram:
    """A histogram, with labels (`histogram.labels(*values).observe(value)`) or without (`histogram.observe(value)`)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, tuple(labelnames)
        bounds = tuple(float(b) for b in buckets)
        self._bounds = bounds if bounds[-1] == INF else (*bounds, INF)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        if not self._labelnames:
            self._children[()] = HistogramChild(self._bounds)
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames) or not values:
                raise ValueError(f"{self._name}: expected labels {self._labelnames}, got {values}")
            child = self._children[values] = HistogramChild(self._bounds)
        return child

    def observe(self, value: float) -> None:
        """Only for a histogram without labels."""
        self._children[()].observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, child.counts):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))
            family.add_metric(values, buckets, child.sum)
        yield family
