"""The overload benchmark's judgement and its docs/benchmarks.md section, from the result JSON alone:
each figure with admission and with admission off (same run), its target, and PASS/FAIL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from loadtest.slo import stats

ON, OFF = "admission", "no-admission"
TARGETS = {"goodput_x_c": 0.9, "refusal_p99_ms": 5.0, "critical_loss": 0.01, "fair_ratio": 0.9, "light_loss": 0.01,
           "at_arrival": 0.99, "late_arrivals": 0, "rss_growth_mib": 20.0}
# Refusals decided as a request arrives (the pool's prediction, a full queue, the tenant's own limits) and
# those decided after it waited in the queue (its allowed wait or deadline passed, or it was shed).
ARRIVAL_CODES = ("overloaded", "queue_full", "deadline_unmeetable", "requests_per_s", "tokens_per_min",
                 "max_concurrency")
AFTER_QUEUEING_CODES = ("queue_timeout", "shed", "deadline_exceeded")


@dataclass(frozen=True, slots=True)
class Row:
    """One judged (or reported) figure: its values with and without admission, target, verdict."""

    figure: str
    admission: str
    no_admission: str
    target: str = ""
    passed: bool | None = None

    @property
    def verdict(self) -> str:
        return "" if self.passed is None else ("PASS" if self.passed else "FAIL")


def find_run(result: Mapping[str, Any], scenario: str, variant: str) -> Mapping[str, Any] | None:
    return next((r for r in result["runs"] if r["scenario"] == scenario and r["variant"] == variant), None)


def judge(result: Mapping[str, Any]) -> list[Row]:
    """Every figure the issue asks for, in order; a scenario that did not run is left out."""
    rows: list[Row] = []
    c_rps = result["c_rps"]
    for level in result["settings"]["levels"]:
        rows += _level_rows(result, f"load-{level:g}x", level, c_rps)
    rows += _on_arrival_rows(result)
    rows += _critical_rows(result)
    rows += _fair_rows(result)
    rows += _light_rows(result)
    rows += _deadline_rows(result)
    rows += _rss_rows(result)
    return rows


def _tenant(result: Mapping[str, Any], scenario: str, variant: str, tenant: str) -> Mapping[str, Any] | None:
    run = find_run(result, scenario, variant)
    return None if run is None else run["tenants"].get(tenant)


def _level_rows(result: Mapping[str, Any], scenario: str, level: float, c_rps: float) -> list[Row]:
    on, off = (_tenant(result, scenario, v, "std-a") for v in (ON, OFF))
    if on is None:
        return []
    ratio = on["goodput_rps"] / c_rps
    server_p99 = on["refusal_server_ms"]["p99"]
    return [
        Row(f"goodput / C at {level:g}x C (one standard tenant)", f"{ratio:.2f}",
            _fmt(off and off["goodput_rps"] / c_rps, "{:.2f}"), f">= {TARGETS['goodput_x_c']}",
            ratio >= TARGETS["goodput_x_c"]),
        Row(f"{level:g}x C: refusal latency in the gateway (from the request's arrival at its endpoint to the "
            "refusal, every reason; its Server-Timing) p50 / p99 (ms)", _pair(on["refusal_server_ms"], "{:.2f}"), "-",
            f"p99 <= {TARGETS['refusal_p99_ms']:g} ms",
            None if server_p99 is None else server_p99 <= TARGETS["refusal_p99_ms"]),
        Row(f"{level:g}x C: refusal latency at the client p50 / p99 (ms; includes the load generator's lateness, "
            "p99 in the last column below)", _pair(on["refusal_ms"]), _pair(off and off["refusal_ms"])),
        Row(f"{level:g}x C: admitted TTFT p50 / p99 (ms)", _pair(on["ttft_ms"]), _pair(off and off["ttft_ms"])),
        Row(f"{level:g}x C: outcomes (status: count; refusals by code)", _outcomes(on), _outcomes(off)),
    ]


def _on_arrival_rows(result: Mapping[str, Any]) -> list[Row]:
    """Refusals decided as a request arrives (no wait in the queue), over every run: their share of all
    refusals and the decision's own speed."""
    on, off = (_refusals(result, v, warmup_s=result["settings"]["warmup_s"]) for v in (ON, OFF))
    if not on:
        return []
    share = _arrival_share(on)
    return [Row("refusals decided at arrival (overloaded, queue_full, deadline_unmeetable, tenant limits; every "
                "run, after its warm-up): share of all refusals; then count, p50 / p99 at the client (ms)", _share_text(on),
                _share_text(off), f">= {TARGETS['at_arrival']:.0%}", share >= TARGETS["at_arrival"])]


def _arrival_share(refusals: Sequence[tuple[str, float, float | None]]) -> float:
    return sum(1 for code, _, _ in refusals if code in ARRIVAL_CODES) / len(refusals)


def _share_text(refusals: Sequence[tuple[str, float, float | None]]) -> str:
    if not refusals:
        return "-"
    at_arrival = [e2e_ms for code, e2e_ms, _ in refusals if code in ARRIVAL_CODES]
    return f"{_arrival_share(refusals):.1%} of {len(refusals)}; {_count_pair(at_arrival)}"


def _refusals(result: Mapping[str, Any], variant: str, scenario: str | None = None,
              warmup_s: float | None = None) -> list[tuple[str, float, float | None]]:
    """(error.code, latency ms at the client, the gateway's own ms) of every refusal in the open-loop
    runs of one gateway (of one scenario, of the requests sent after warmup_s, when given), from the raw records."""
    return [(r["code"] or "none", r["e2e_ms"], r.get("server_ms")) for key, records in result.get("records", {}).items()
            if key.endswith(f"/{variant}") and not key.startswith("capacity")
            and (scenario is None or key == f"{scenario}/{variant}")
            for r in records if r["status"] in (429, 503) and r["e2e_ms"] is not None
            and (warmup_s is None or r["scheduled_s"] >= warmup_s)]


def _count_pair(values: Sequence[float]) -> str:
    if not values:
        return "-"
    figures = stats(values)
    return f"{len(values)}, {figures['p50']:.1f} / {figures['p99']:.1f}"


def _critical_rows(result: Mapping[str, Any]) -> list[Row]:
    on, off = (_tenant(result, "critical-beside-flood", v, "crit") for v in (ON, OFF))
    if on is None:
        return []
    return [Row("critical tenant at 0.4x C beside a standard flood at 5x C: lost (not answered within SLO)",
                _loss(on), _loss(off), f"< {TARGETS['critical_loss']:.0%}", on["loss"] < TARGETS["critical_loss"]),
            Row("critical tenant's TTFT p50 / p99 (ms) beside the flood", _pair(on["ttft_ms"]),
                _pair(off and off["ttft_ms"])),
            Row("mean wait in the gateway's admission queue, critical / standard (ms; from its /metrics)",
                _waits(find_run(result, "critical-beside-flood", ON)), "-")]


def fair_ratio(result: Mapping[str, Any], variant: str) -> float | None:
    """Tenant std-a's goodput beside the flood / its goodput alone (same gateway, same run)."""
    alone = _tenant(result, "fair-alone", variant, "std-a")
    flood = _tenant(result, "fair-beside-flood", variant, "std-a")
    if alone is None or flood is None or not alone["goodput_rps"]:
        return None
    return flood["goodput_rps"] / alone["goodput_rps"]


def _fair_rows(result: Mapping[str, Any]) -> list[Row]:
    on, off = fair_ratio(result, ON), fair_ratio(result, OFF)
    if on is None:
        return []
    flood_on, flood_off = (_tenant(result, "fair-beside-flood", v, "std-a") for v in (ON, OFF))
    return [Row("standard tenant at 0.4x C (fair share 0.5x C) beside another standard tenant's 5x C flood: "
                "its goodput / its goodput alone", f"{on:.2f}", _fmt(off, "{:.2f}"),
                f">= {TARGETS['fair_ratio']}", on >= TARGETS["fair_ratio"]),
            Row("that tenant's TTFT p50 / p99 (ms) beside the flood", _pair(flood_on and flood_on["ttft_ms"]),
                _pair(flood_off and flood_off["ttft_ms"]))]


LIGHT = "light-beside-flood"


def _light_rows(result: Mapping[str, Any]) -> list[Row]:
    """A standard tenant well within its fair share beside another's flood (issue #50): what it loses, and
    whether the refusals (nearly all the flood's) are decided at arrival, fast."""
    on, off = (_tenant(result, LIGHT, v, "std-a") for v in (ON, OFF))
    if on is None:
        return []
    run = find_run(result, LIGHT, ON)
    offered_x_c = dict(run["offers"])["std-a"] if run.get("offers") else on["offered_rps"] / result["c_rps"]
    flood_x_c = dict(run["offers"]).get("std-b") if run.get("offers") else None
    warmup_s = result["settings"]["warmup_s"]
    refused = {v: _refusals(result, v, LIGHT, warmup_s) for v in (ON, OFF)}
    server_ms = stats([ms for _, _, ms in refused[ON] if ms is not None])
    share = _arrival_share(refused[ON]) if refused[ON] else None
    flood = f"{flood_x_c:g}x C" if flood_x_c else "a"
    return [Row(f"standard tenant at {offered_x_c:g}x C (fair share 0.5x C) beside another standard tenant's "
                f"{flood} flood: lost (not answered within SLO)", _loss(on), _loss(off),
                f"<= {TARGETS['light_loss']:.0%}", on["loss"] <= TARGETS["light_loss"]),
            Row("that tenant's TTFT p50 / p99 (ms) beside the flood; its refusals by code",
                f"{_pair(on['ttft_ms'])}; {_codes_text(on)}", f"{_pair(off and off['ttft_ms'])}; {_codes_text(off)}"),
            Row("that run, both tenants, after its warm-up: refusals decided at arrival (overloaded, queue_full, "
                "deadline_unmeetable) as a share of all refusals; then count, p50 / p99 at the client (ms)",
                _share_text(refused[ON]),
                _share_text(refused[OFF]), f">= {TARGETS['at_arrival']:.0%}",
                None if share is None else share >= TARGETS["at_arrival"]),
            Row("that run, both tenants, after its warm-up: refusal latency in the gateway (every reason; its "
                "Server-Timing) p50 / p99 (ms)",
                _pair(server_ms, "{:.2f}"), "-", f"p99 <= {TARGETS['refusal_p99_ms']:g} ms",
                None if server_ms["p99"] is None else server_ms["p99"] <= TARGETS["refusal_p99_ms"])]


def _codes_text(figures: Mapping[str, Any] | None) -> str:
    if figures is None:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in figures["by_code"].items()) or "none refused"


def _deadline_rows(result: Mapping[str, Any]) -> list[Row]:
    runs = {v: find_run(result, "deadline-flood", v) for v in (ON, OFF)}
    on, off = (None if runs[v] is None else runs[v]["deadline"] for v in (ON, OFF))
    if on is None:
        return []
    deadline_ms = runs[ON]["deadline_ms"]
    return [Row(f"5x C, every request with x-request-deadline-ms: {deadline_ms:g}: arrivals at a worker after "
                "the deadline (counted from the client's send)", _late(on), _late(off), "0",
                on["late_arrivals"] == TARGETS["late_arrivals"]),
            Row("answered requests whose first token came after the deadline", _after(on), _after(off))]


def _rss_rows(result: Mapping[str, Any]) -> list[Row]:
    rss = result.get("rss") or {}
    if ON not in rss:
        return []
    growth_mib = rss[ON]["growth_kib"] / 1024
    return [Row("gateway RSS over the overload runs: growth, start -> end (peak)", _rss(rss[ON]),
                _rss(rss.get(OFF)), f"< {TARGETS['rss_growth_mib']:g} MiB growth",
                growth_mib < TARGETS["rss_growth_mib"])]


def _waits(run: Mapping[str, Any] | None) -> str:
    waits = (run or {}).get("queue_wait") or {}
    return " / ".join(_fmt((waits.get(p) or {}).get("mean_ms"), "{:.1f}") for p in ("critical", "standard"))


def _limit(run: Mapping[str, Any]) -> str:
    limit = (run.get("gauges") or {}).get("limit")
    if limit is None or limit["max"] >= 100000:
        return "-"
    return f"{limit['min']:.0f} / {limit['mean']:.1f} / {limit['max']:.0f}"


def _fmt(value: Any, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _pair(stats: Mapping[str, Any] | None, pattern: str = "{:.1f}") -> str:
    if not stats or stats.get("p50") is None:
        return "-"
    return f"{pattern.format(stats['p50'])} / {pattern.format(stats['p99'])}"


def _outcomes(figures: Mapping[str, Any] | None) -> str:
    if figures is None:
        return "-"
    text = ", ".join(f"{k}: {v}" for k, v in figures["by_status"].items())
    codes = ", ".join(f"{k} {v}" for k, v in figures["by_code"].items())
    return f"{text} ({codes})" if codes else text


def _loss(figures: Mapping[str, Any] | None) -> str:
    if figures is None or figures["loss"] is None:
        return "-"
    return f"{figures['loss']:.1%} ({figures['offered'] - figures['good']} of {figures['offered']})"


def _late(deadline: Mapping[str, Any] | None) -> str:
    if deadline is None:
        return "-"
    text = f"{deadline['late_arrivals']} of {deadline['arrivals']} arrivals ({deadline['sent']} sent)"
    return text + (f", latest {deadline['max_late_ms']:.1f} ms late" if deadline["max_late_ms"] is not None else "")


def _after(deadline: Mapping[str, Any] | None) -> str:
    if deadline is None:
        return "-"
    return f"{deadline['first_token_after_deadline']} of {deadline['answered']}"


def _rss(rss: Mapping[str, Any] | None) -> str:
    if rss is None:
        return "-"
    mib = 1024
    return (f"{rss['growth_kib'] / mib:+.1f} MiB ({rss['first_kib'] / mib:.1f} -> {rss['last_kib'] / mib:.1f}, "
            f"peak {rss['peak_kib'] / mib:.1f})")


def refusals_by_code(result: Mapping[str, Any], variant: str) -> dict[str, tuple[int, Any, Any, Any, Any]]:
    """code -> (count, p50, p99, max of refusal latency at the client, p99 of the gateway's own time)
    over every open-loop run of one gateway."""
    latencies: dict[str, list[float]] = {}
    server: dict[str, list[float]] = {}
    for code, e2e_ms, server_ms in _refusals(result, variant):
        latencies.setdefault(code, []).append(e2e_ms)
        if server_ms is not None:
            server.setdefault(code, []).append(server_ms)
    out = {}
    for code, values in sorted(latencies.items()):
        figures = stats(values)
        out[code] = (len(values), figures["p50"], figures["p99"], figures["max"], stats(server.get(code, []))["p99"])
    return out


def _stretched(result: Mapping[str, Any]) -> str:
    longer = sorted({(r["scenario"], r["duration_s"]) for r in result["runs"]
                     if r.get("duration_s", result["settings"]["duration_s"]) != result["settings"]["duration_s"]})
    if not longer:
        return "every scenario the same length"
    return ", ".join(f"{name}: {duration_s:g} s" for name, duration_s in longer) + ", to tell a loss under 1% apart"


def section_markdown(result: Mapping[str, Any], rows: Sequence[Row]) -> str:
    """The `admission-overload` section of docs/benchmarks.md."""
    s = result["settings"]
    cap = result["capacity"]
    load = result["load_average"]
    lines = [
        "### Admission under overload (`sim` executor)", "",
        f"Command: `{result['command']}`", "",
        f"Machine: {result['machine']}; run {result['date']}. Load average (1 min) {load['start'][0]:.2f} at the "
        f"start, {load['end'][0]:.2f} at the end (the machine is shared; the refusal-latency target is for a quiet one).",
        "",
        f"Fleet: {s['num_workers']} `sim` workers (timing: {s['sim_timing_name']}) behind a recording proxy, and two "
        f"kvgate gateways on them: `admission` (the pools' default admission settings) and `no-admission` "
        f"(`admission: {s['admission_off']}`: a fixed limit nothing reaches, as before admission control). "
        + ("Gateways pinned to one CPU; workers, proxy and load generator to the other(s). " if s["pin"] else "")
        + f"Requests: chat, {s['prompt_words']}-word prompts (unique, no cache hits), {s['max_tokens']} output "
        f"tokens, streamed with usage. SLO: TTFT <= {s['slo_ttft_ms']:g} ms; goodput = requests answered within it.",
        "",
        f"Capacity C = {result['c_rps']:.2f} req/s: answered req/s through the `admission` gateway, closed loop "
        f"at {s['capacity_concurrency']} in flight for {s['capacity_duration_s']:g} s (TTFT p50 / p99 "
        f"{_pair(cap[ON]['ttft_ms'])} ms, {cap[ON]['refused']} refusals re-sent at once). Through `no-admission`: "
        + (f"{cap[OFF]['rps']:.2f} req/s ({cap[OFF]['rps'] / result['c_rps']:.2f} C). " if OFF in cap else "not run. ")
        + f"Each scenario is an open-loop Poisson run of {s['duration_s']:g} s per gateway (their order alternates; "
        f"{_stretched(result)}); "
        f"figures count the requests sent after the first {s['warmup_s']:g} s; rates are ratios to C or to the same "
        "tenant's own run alone.", "",
        "| figure | admission | no admission | target | result |", "|---|---|---|---|---|",
    ]
    lines += [f"| {r.figure} | {r.admission} | {r.no_admission} | {r.target} | {r.verdict} |" for r in rows]
    lines += ["", "Every run, per tenant (goodput as a ratio to C; latencies count from when the load generator sent "
              "the request; late = its p99 lateness against its schedule, a sign of how busy it was, which also "
              "delays when it notices answers; limit = the pool's concurrency limit, min / mean / max of the "
              "gateway's /metrics sampled every 0.5 s):", "",
              "| scenario | gateway | tenant | offered (x C) | goodput / C | TTFT p50 / p99 ms | refused | "
              "refusal p50 / p99 ms | gateway's refusal p50 / p99 ms | late p99 ms | gateway CPU | limit |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for tenant, f in run["tenants"].items():
            lines.append(f"| {run['scenario']} | {run['variant']} | {tenant} | {f['offered_rps'] / result['c_rps']:.2f} "
                         f"| {f['goodput_rps'] / result['c_rps']:.2f} | {_pair(f['ttft_ms'])} | {f['refused']} | "
                         f"{_pair(f['refusal_ms'])} | {_pair(f.get('refusal_server_ms'), '{:.2f}')} | "
                         f"{_fmt(f['send_late_ms']['p99'], '{:.1f}')} | "
                         f"{run['gateway_cpu_share']:.0%} | {_limit(run)} |")
    lines += ["", "Refusal latency by `error.code` (the `admission` gateway, every run and tenant together; "
              "queue_timeout includes the wait in the queue; at the client, and the gateway's own p99 from its "
              "Server-Timing):", "", "| code | refusals | p50 ms | p99 ms | max ms | gateway p99 ms |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {code} | {n} | {_fmt(p50, '{:.1f}')} | {_fmt(p99, '{:.1f}')} | {_fmt(top, '{:.1f}')} | "
              f"{_fmt(server_p99, '{:.2f}')} |"
              for code, (n, p50, p99, top, server_p99) in refusals_by_code(result, ON).items()]
    lines += ["", f"Deadlines are checked from outside: each prompt carries a marker, the load generator notes when "
              "it sent each request and a proxy in front of the workers notes when it arrived (one monotonic clock), so "
              "an arrival after send + deadline is late (strict: the gateway's own clock starts a little later).",
              f"Raw figures: `{result['out_path']}`."]
    return "\n".join(lines)
