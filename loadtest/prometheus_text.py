"""Samples read from a Prometheus text page (a gateway's or a worker's /metrics), by metric name: what the
benchmarks read of the systems they measure, without a Prometheus server."""

from __future__ import annotations

import re

SAMPLE_RE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")

LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric in a Prometheus text page, as (labels, value)."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE_RE.match(line)
        if match and match.group(1) == name:
            samples.append((dict(LABEL_RE.findall(match.group(2) or "")), float(match.group(3))))
    return samples
