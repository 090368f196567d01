"""The admission benchmark's harness (`kvgate bench admission-overload`): scenarios and their arithmetic
(scenarios.py), the sim fleet behind a recording proxy and two gateways (fleet.py), the client that drives
a run (probe.py), what the gateway's /metrics say meanwhile (metrics.py), and the judgement and section
(report.py)."""
