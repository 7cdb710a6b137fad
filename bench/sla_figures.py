"""The SLA benchmark's figures: per system, level and tier, from the requests' outcomes; the
tables and the chart made of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from report import percentile
from sla_drivers import Outcome
from sla_trace import TIERS, Trace

STATUSES = ("completed", "timed_out", "refused", "failed")
SUMMARY_LEVEL = 2.0
LAG_WARNING_MS = 100.0
"""Requests sent later than this (p95) mean the client could not hold the trace's schedule."""


@dataclass
class LevelRun:
    """One level's trace replayed on one system: when it started and every request's outcome."""

    system: str
    trace: Trace
    start: float
    outcomes: list[Outcome]
    cpu_s: dict[str, float]
    """CPU seconds of the level by process role (`report.process_role`): the client is the
    `benchmark process`."""
    others_cpu_s: float
    """CPU seconds that processes outside the run took meanwhile."""

    def progress_line(self) -> str:
        """One line to print once the level has run."""
        figures = level_figures(self)
        every, premium = figures["all"], figures["premium"]
        cpu = ", ".join(f"{role} {seconds:.0f}" for role, seconds in self.cpu_s.items())
        line = (
            f"{self.system} {self.trace.level:g}x: {every['requests']} requests, "
            f"completed {every['completed_pct']:.0f}%, timed out {every['timed_out_pct']:.0f}%, "
            f"refused {every['refused_pct']:.0f}%; premium TTFT p95 "
            f"{_seconds(premium['ttft_p95_s'], premium['ttft_p95_censored'])} s; "
            f"{every['output_tokens_per_s']:.0f} tokens/s; send lag p95 "
            f"{every['send_lag_p95_ms']:.0f} ms; drained {every['drain_s']:.0f} s after arrivals"
            f"\n    CPU s: {cpu}; other processes {self.others_cpu_s:.0f}"
        )
        if every["send_lag_p95_ms"] > LAG_WARNING_MS:
            line += (
                f"\n    warning: requests went out up to {every['send_lag_p95_ms']:.0f} ms late "
                "(p95): the client or the machine did not keep up, and its timers ran late too"
            )
        return line


def censored_percentile(samples: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """The q-th percentile of (value, censored) samples, as `report.percentile` interpolates
    it; censored if it rests on a censored sample (a value that is only a lower bound)."""
    if not samples:
        return float("nan"), False
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    censored = ordered[low][1] or (rank > low and ordered[high][1])
    return percentile([value for value, _ in ordered], q), censored


def group_figures(outcomes: list[Outcome], start: float, duration_s: float) -> dict[str, Any]:
    """The figures of a group of requests of one level (its arrivals began at `start`)."""
    count = len(outcomes)
    shares = {
        f"{status}_pct": round(100 * sum(o.status == status for o in outcomes) / count, 2)
        if count
        else float("nan")
        for status in STATUSES
    }
    # Not refused, and not failed before a first token: a request that waited for one.
    waited = [
        o
        for o in outcomes
        if o.status != "refused" and not (o.status == "failed" and o.first_token is None)
    ]
    ttft = [(o.limit_s, True) if o.ttft_s is None else (o.ttft_s, False) for o in waited]
    p50, p50_censored = censored_percentile(ttft, 50)
    p95, p95_censored = censored_percentile(ttft, 95)
    tpot = [o.tpot_s for o in outcomes if o.tpot_s is not None]
    tokens = sum(o.tokens_between(start, start + duration_s) for o in outcomes)
    completed = sum(o.status == "completed" for o in outcomes)
    ends = [o.end for o in outcomes if o.end is not None]
    return {
        "requests": count,
        **shares,
        "ttft_p50_s": round(p50, 4),
        "ttft_p50_censored": p50_censored,
        "ttft_p95_s": round(p95, 4),
        "ttft_p95_censored": p95_censored,
        "no_first_token_in_time": sum(censored for _, censored in ttft),
        "tpot_p50_ms": round(percentile(tpot, 50) * 1000, 2),
        "tpot_p95_ms": round(percentile(tpot, 95) * 1000, 2),
        "output_tokens_per_s": round(tokens / duration_s, 1),
        "served_within_sla_per_s": round(completed / duration_s, 4),
        "arrivals_per_s": round(count / duration_s, 4),
        "overran": sum(o.overran for o in outcomes),
        "send_lag_p95_ms": round(percentile([o.lag_s for o in outcomes], 95) * 1000, 2),
        "drain_s": round(max(ends) - (start + duration_s), 2) if ends else 0.0,
        "failures": sorted({o.detail for o in outcomes if o.status == "failed"})[:5],
    }


def level_figures(run: LevelRun) -> dict[str, dict[str, Any]]:
    """Figures of every tier of a level's run, and of all tiers together (`all`)."""
    duration = run.trace.duration_s
    figures = {
        tier: group_figures([o for o in run.outcomes if o.tier == tier], run.start, duration)
        for tier in TIERS
    }
    figures["all"] = {
        **group_figures(run.outcomes, run.start, duration),
        "cpu_s": run.cpu_s,
        "others_cpu_s": run.others_cpu_s,
    }
    return figures


def _seconds(value: float, censored: bool) -> str:
    if value != value:  # NaN: no request to measure
        return "-"
    return f"{'>=' if censored else ''}{value:.2f}"


def _pct(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"


def aligned(rows: list[list[str]], left: int = 1) -> str:
    """Rows as plain-text columns (the first `left` left-aligned), a rule under the header."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if c < left else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_results(figures: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> str:
    """Every system, level and tier as one table."""
    header = [
        "system",
        "load",
        "tier",
        "jobs",
        "TTFT p50 s",
        "TTFT p95 s",
        "TPOT p50 ms",
        "done %",
        "timed out %",
        "429 %",
        "failed %",
        "tokens/s",
    ]
    rows = [header]
    for system, levels in figures.items():
        for level, tiers in levels.items():
            for tier in (*TIERS, "all"):
                f = tiers[tier]
                rows.append(
                    [
                        system,
                        f"{level}x",
                        tier,
                        str(f["requests"]),
                        _seconds(f["ttft_p50_s"], f["ttft_p50_censored"]),
                        _seconds(f["ttft_p95_s"], f["ttft_p95_censored"]),
                        "-" if f["tpot_p50_ms"] != f["tpot_p50_ms"] else f"{f['tpot_p50_ms']:.1f}",
                        _pct(f["completed_pct"]),
                        _pct(f["timed_out_pct"]),
                        _pct(f["refused_pct"]),
                        _pct(f["failed_pct"]),
                        f"{f['output_tokens_per_s']:.0f}",
                    ]
                )
    return aligned(rows, left=3)


def format_summary(
    figures: dict[str, dict[str, dict[str, dict[str, Any]]]], limits: dict[str, float]
) -> tuple[str, str, dict[str, Any]]:
    """The level nearest 2x, a Markdown table of its headline figures with one column per
    system (as the seed article's before/after table), and those rows as printed."""
    systems = list(figures)
    levels = list(next(iter(figures.values())))
    # The nearest level; of two as near, the higher (overload is what the summary is for).
    level = min(levels, key=lambda text: (abs(float(text) - SUMMARY_LEVEL), -float(text)))
    at = {system: figures[system][level] for system in systems}
    rows: dict[str, dict[str, str]] = {
        f"TTFT p95, premium (limit {limits['premium']:g} s)": {
            s: _seconds(at[s]["premium"]["ttft_p95_s"], at[s]["premium"]["ttft_p95_censored"])
            + " s"
            for s in systems
        },
        "TTFT p95, all tiers": {
            s: _seconds(at[s]["all"]["ttft_p95_s"], at[s]["all"]["ttft_p95_censored"]) + " s"
            for s in systems
        },
        "output tokens/s": {s: f"{at[s]['all']['output_tokens_per_s']:.0f}" for s in systems},
        "users served within SLA": {
            s: f"{at[s]['all']['served_within_sla_per_s']:.2f}/s of "
            f"{at[s]['all']['arrivals_per_s']:.2f}/s ({at[s]['all']['completed_pct']:.0f}%)"
            for s in systems
        },
        "premium served within SLA": {
            s: f"{at[s]['premium']['completed_pct']:.1f}%" for s in systems
        },
        "timeout rate": {s: f"{at[s]['all']['timed_out_pct']:.1f}%" for s in systems},
        "refused (429)": {s: f"{at[s]['all']['refused_pct']:.1f}%" for s in systems},
    }
    lines = [
        "| metric | " + " | ".join(systems) + " |",
        "|---|" + "---:|" * len(systems),
        *(
            f"| {name} | " + " | ".join(row[s] for s in systems) + " |"
            for name, row in rows.items()
        ),
    ]
    return level, "\n".join(lines), rows


def save_chart(
    figures: dict[str, dict[str, dict[str, dict[str, Any]]]],
    premium_limit_s: float,
    capacity: float,
    model: str,
    path: Path,
) -> None:
    """Premium TTFT p95 and premium completion % against load, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"inferq": "#4c72b0", "vllm-priority": "#dd8452", "vllm-fcfs": "#55a868"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    for system, levels in figures.items():
        loads = [float(level) for level in levels]
        premium = [levels[level]["premium"] for level in levels]
        color = colors.get(system)
        left.plot(loads, [f["ttft_p95_s"] for f in premium], marker="o", label=system, color=color)
        censored = [
            (x, f["ttft_p95_s"])
            for x, f in zip(loads, premium, strict=True)
            if f["ttft_p95_censored"]
        ]
        if censored:
            left.scatter(*zip(*censored, strict=True), s=90, facecolors="none", edgecolors=color)
        right.plot(
            loads, [f["completed_pct"] for f in premium], marker="o", label=system, color=color
        )
    left.axhline(premium_limit_s, color="gray", linestyle="--", linewidth=1)
    left.annotate(
        "premium limit",
        (0.01, premium_limit_s),
        xycoords=("axes fraction", "data"),
        va="bottom",
        color="gray",
    )
    left.set_xlabel("load, x capacity")
    left.set_ylabel("premium TTFT p95, s (ringed: at least)")
    left.set_title("Premium time to first token")
    left.legend()
    right.set_xlabel("load, x capacity")
    right.set_ylabel("premium requests completed within limit, %")
    right.set_ylim(0, 105)
    right.set_title("Premium completion")
    right.legend()
    figure.suptitle(f"SLA under load: {model}, capacity {capacity:.2f} jobs/s")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
