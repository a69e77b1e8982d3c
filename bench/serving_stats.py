"""Latency statistics of bench/serving.py: per-request timings in, one summary per run out (JSON),
a printed table, and the latency-throughput plot."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    """One streamed request as the client saw it (perf_counter seconds)."""

    num_prompt_tokens: int
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None
    num_output_tokens: int = 0
    # Per output token after the first: the gap between the deltas that brought it, divided by the
    # tokens of that delta (a delta of n tokens after a gap g counts n gaps of g / n).
    inter_token_latencies: list[float] = field(default_factory=list)
    error: str | None = None  # a gRPC status code name

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.sent

    @property
    def e2e(self) -> float:
        assert self.done is not None
        return self.done - self.sent

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        if self.num_output_tokens < 2:
            return 0.0
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """What counts as a good request for goodput."""

    ttft_ms: float
    tpot_ms: float

    def met_by(self, timing: RequestTiming) -> bool:
        return timing.ttft * 1e3 <= self.ttft_ms and timing.tpot * 1e3 <= self.tpot_ms


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    values = np.asarray(values_s) * 1e3
    return {"mean": round(float(values.mean()), 3),
            **{f"p{p}": round(float(np.percentile(values, p)), 3) for p in PERCENTILES}}


def summarize(timings: list[RequestTiming], duration_s: float, slo: Slo) -> dict:
    """One run's figures: counts, throughput, TTFT / ITL / TPOT / e2e distributions and goodput."""
    done = [t for t in timings if t.error is None and t.first_token is not None]
    failures: dict[str, int] = {}
    for timing in timings:
        if timing.error is not None:
            failures[timing.error] = failures.get(timing.error, 0) + 1
    num_good = sum(slo.met_by(t) for t in done)
    return {
        "num_requests": len(timings),
        "num_completed": len(done),
        "num_failed": len(timings) - len(done),
        "failures": failures,
        "duration_s": round(duration_s, 4),
        "input_tokens": sum(t.num_prompt_tokens for t in done),
        "output_tokens": sum(t.num_output_tokens for t in done),
        "request_throughput": round(len(done) / duration_s, 4) if duration_s else None,
        "output_throughput": round(sum(t.num_output_tokens for t in done) / duration_s, 2) if duration_s else None,
        "ttft_ms": distribution_ms([t.ttft for t in done]),
        "itl_ms": distribution_ms([gap for t in done for gap in t.inter_token_latencies]),
        "tpot_ms": distribution_ms([t.tpot for t in done if t.num_output_tokens > 1]),
        "e2e_ms": distribution_ms([t.e2e for t in done]),
        "goodput_rps": round(num_good / duration_s, 4) if duration_s else None,
        "goodput_fraction": round(num_good / len(timings), 4) if timings else None,
    }


def table(runs: list[dict], single_stream: list[dict]) -> str:
    """The results as Markdown tables (also what bench/results/*.md keep)."""
    lines = ["| rate (req/s) | max conc. | done | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
             "| e2e p50 / p99 s | goodput req/s |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        ttft, itl, e2e = run["ttft_ms"], run["itl_ms"], run["e2e_ms"]
        lines.append(
            f"| {run['request_rate']} | {run['max_concurrency'] or '-'} | {run['num_completed']}/{run['num_requests']} "
            f"| {run['output_throughput']} | {_three(ttft)} | {_three(itl)} "
            f"| {_seconds(e2e['p50'])} / {_seconds(e2e['p99'])} | {run['goodput_rps']} |")
    if single_stream:
        lines += ["", "| single stream: prompt tokens | output tokens | TTFT p50 ms | ITL p50 ms | ITL p90 ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {s['prompt_len']} | {s['output_len']} | {s['ttft_ms']['p50']} | {s['itl_ms']['p50']} "
                  f"| {s['itl_ms']['p90']} |" for s in single_stream]
    return "\n".join(lines)


def _three(distribution: dict) -> str:
    return " / ".join(str(distribution[f"p{p}"]) for p in PERCENTILES)


def _seconds(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1e3:.2f}"


def plot(runs: list[dict], path: Path, title: str) -> None:
    """TTFT, ITL and e2e (p50 and p99) against output throughput, one point per request rate."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = [run for run in runs if run["num_completed"]]
    throughput = [run["output_throughput"] for run in points]
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for axis, key, label in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("TTFT", "inter-token latency", "e2e"),
                                strict=True):
        for percentile, style in (("p50", "o-"), ("p99", "s--")):
            axis.plot(throughput, [run[key][percentile] for run in points], style, label=percentile)
        for run, x in zip(points, throughput, strict=True):
            axis.annotate(f"{run['request_rate']}/s", (x, run[key]["p50"]), textcoords="offset points",
                          xytext=(4, 4), fontsize=8)
        axis.set_xlabel("output throughput (tokens/s)")
        axis.set_ylabel(f"{label} (ms)")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
