"""One run's figures: vLLM's `vllm bench serve` fields with its definitions, then kvtier's own.

vLLM (`vllm/benchmarks/serve.py`, `calculate_metrics`), over the requests that succeeded:

- `completed`, `failed`, `duration` (s), `total_input_tokens` (prompt tokens),
  `total_output_tokens`; `request_throughput` = completed / duration, `output_throughput` =
  output tokens / duration, `total_token_throughput` = (input + output tokens) / duration;
- TTFT = first token - sent; E2EL = last token - sent; TPOT = (E2EL - TTFT) / (output - 1) for
  requests with more than one output token; ITL = every inter-token gap of every request, pooled;
- for each of ttft, tpot, itl, e2el: `mean_`, `median_`, `std_` (population, numpy's default),
  `p90_`, `p99_` + `<name>_ms` (numpy's linear percentiles), in milliseconds; an empty list
  counts as [0], as in vLLM.

kvtier's own (same requests):

- `ttft_by_turn_kind`, `ttft_resumed_by_source` (resumed turns by where most of their history
  came from), `resume_latency_by_context` (resumed-turn TTFT in power-of-two prompt-length
  bins): each a count with mean / median / p90 / p99 in ms;
- stall = a request's longest inter-token gap; `mean_/median_/std_/p90_/p99_stall_ms` over
  requests with at least one gap (p99 stall is what a user notices as a freeze);
- `tokens_recomputed`, `restored_tokens` per source, `hit_rate` per source (share of history
  tokens each source supplied; `recomputed` is the miss rate);
- `tier_bytes` (the run's TierTraffic per tier) and `policy_decisions` (kind -> tier -> count);
- `job_completion`: per session whose requests all completed, its job completion time (first
  request sent to last answer, as Continuum, arXiv 2511.02230, measures agent jobs; it
  includes the tool runs and think times between turns, which are the workload's) and its
  time on the server (the sum of its turns' E2EL: what a policy changes), each a count with
  mean / median / p90 / p99 in ms;
- `failed_by_reason`: the failed requests grouped by their error with its numbers blanked
  ("prompt has # tokens, ..."), each `{count, example}` (the first such error in full).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvtier.results.records import (
    RESTORE_SOURCES,
    SCHEMA,
    TURN_KINDS,
    RequestRecord,
    RunRecords,
)

PERCENTILES = (90, 99)
_MS = 1000.0
_FIRST_BIN_TOKENS = 1024  # resume-latency bins: [0, 1K), [1K, 2K), [2K, 4K), ...
_NUMBER = re.compile(r"\b\d[\d,.]*\b")  # whole numbers only: "bf16" keeps its digits


def resumed_turns(records: RunRecords) -> list[RequestRecord]:
    """The run's completed resumed turns, in record order: what every resumed-turn figure is
    taken over (`summarize`'s, and the pooled ones of `kvtier simulate seeds`)."""
    return [r for r in records.requests if not r.failed and r.turn_kind == "resumed"]


def job_times(records: RunRecords) -> tuple[list[float], list[float]]:
    """Per session whose requests all completed, in first-seen order: (job completion time,
    time on the server) in seconds (`summarize`'s `job_completion`)."""
    jobs: dict[str, list[RequestRecord]] = {}
    for r in records.requests:
        jobs.setdefault(r.session_id, []).append(r)
    completion, served = [], []
    for turns in jobs.values():
        if any(r.failed for r in turns):
            continue
        completion.append(max(r.finish_s for r in turns) - min(r.arrival_s for r in turns))
        served.append(sum(r.e2el_s for r in turns))
    return completion, served


def summarize(records: RunRecords, duration: float | None = None) -> dict[str, Any]:
    """The summary of one run; `duration` defaults to the run's own (first send to last token)."""
    duration = records.duration_s if duration is None else duration
    ok = [r for r in records.requests if not r.failed]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "policy": records.policy,
        "duration": duration,
        "completed": len(ok),
        "failed": len(records.requests) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _rate(len(ok), duration),
        "output_throughput": _rate(output_tokens, duration),
        "total_token_throughput": _rate(input_tokens + output_tokens, duration),
    }
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2el = [r.e2el_s for r in ok]
    itl_values, itl_counts = records.itl_samples()
    summary |= _stats("ttft", np.array(ttft, dtype=float))
    summary |= _stats("tpot", np.array(tpot, dtype=float))
    summary |= _stats("itl", itl_values, itl_counts)
    summary |= _stats("e2el", np.array(e2el, dtype=float))
    stalls = [s for s in (_stall(r) for r in ok) if s is not None]
    summary |= _stats("stall", np.array(stalls, dtype=float))

    summary["ttft_by_turn_kind"] = {
        kind: latency_group([r.ttft_s for r in ok if r.turn_kind == kind]) for kind in TURN_KINDS
    }
    resumed = resumed_turns(records)
    summary["ttft_resumed_by_source"] = {
        source: latency_group([r.ttft_s for r in resumed if r.restore_source == source])
        for source in RESTORE_SOURCES
    }
    summary["resume_latency_by_context"] = _by_context(resumed)
    restored = {s: sum(r.restored_tokens.get(s, 0) for r in ok) for s in RESTORE_SOURCES}
    history = sum(restored.values())
    summary["tokens_recomputed"] = restored["recomputed"]
    summary["restored_tokens"] = restored
    summary["hit_rate"] = {s: n / history if history else 0.0 for s, n in restored.items()}
    summary["tier_bytes"] = {tier: t.to_dict() for tier, t in records.tiers.items()}
    summary["policy_decisions"] = records.decisions
    completion, served = job_times(records)
    summary["job_completion"] = {
        "completion": latency_group(completion),
        "on_server": latency_group(served),
    }
    summary["failed_by_reason"] = failed_by_reason(records.requests)
    return summary


def failed_by_reason(requests: Iterable[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Failed requests per kind of error, most frequent first: the same error about different
    lengths ("prompt has 3,012 tokens" / "2,990 tokens") is one kind."""
    groups: dict[str, dict[str, Any]] = {}
    for r in requests:
        if r.failed:
            error = r.error or "no error given"
            group = groups.setdefault(_NUMBER.sub("#", error), {"count": 0, "example": error})
            group["count"] += 1
    return dict(sorted(groups.items(), key=lambda item: -item[1]["count"]))


def _rate(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def _stall(record: RequestRecord) -> float | None:
    if record.max_itl_s is not None:
        return record.max_itl_s
    return max(record.itl_s) if record.itl_s else None


def _stats(name: str, values: np.ndarray, counts: np.ndarray | None = None) -> dict[str, float]:
    """vLLM's mean/median/std/percentiles in ms; `counts` weights each value (pooled gaps)."""
    if counts is None or len(values) == 0:
        data = values if len(values) else np.zeros(1)  # vLLM: np.mean(x or 0)
        points = [np.mean(data), np.median(data), np.std(data)]
        points += [np.percentile(data, p) for p in PERCENTILES]
    else:
        points = _weighted(values, counts)
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    return {f"{key}_{name}_ms": float(v) * _MS for key, v in zip(keys, points, strict=True)}


def _weighted(values: np.ndarray, counts: np.ndarray) -> list[float]:
    """Mean, median, std and PERCENTILES of the list in which each value appears `count` times,
    without building it (the simulator pools millions of gaps into a few thousand values).
    Percentiles interpolate linearly between order statistics, as numpy's default does."""
    order = np.argsort(values, kind="stable")
    v, w = values[order], counts[order]
    total = w.sum()
    mean = float((v * w).sum() / total)
    std = math.sqrt(float((w * (v - mean) ** 2).sum() / total))
    ends = np.cumsum(w)  # the sorted expanded list holds v[i] at positions [ends[i-1], ends[i])

    def percentile(q: float) -> float:
        h = (total - 1) * q / 100
        lo = math.floor(h)
        a = v[np.searchsorted(ends, lo, side="right")]
        b = v[min(np.searchsorted(ends, lo + 1, side="right"), len(v) - 1)]
        return float(a + (h - lo) * (b - a))

    return [mean, percentile(50), std, *(percentile(p) for p in PERCENTILES)]


def latency_group(seconds: Iterable[float]) -> dict[str, float | int]:
    """How many, and their mean / median / percentiles in ms, of latencies in seconds."""
    values = np.array(list(seconds), dtype=float)
    out: dict[str, float | int] = {"count": len(values)}
    if len(values):
        out["mean_ms"] = float(values.mean()) * _MS
        out["median_ms"] = float(np.median(values)) * _MS
        for p in PERCENTILES:
            out[f"p{p}_ms"] = float(np.percentile(values, p)) * _MS
    return out


def _by_context(resumed: list[RequestRecord]) -> list[dict[str, Any]]:
    """Resumed-turn TTFT per prompt-length bin [0, 1K), [1K, 2K), [2K, 4K), ..."""
    bins: dict[int, list[float]] = {}
    for r in resumed:
        index = max(0, math.floor(math.log2(max(r.prompt_tokens, 1) / _FIRST_BIN_TOKENS)) + 1)
        bins.setdefault(index, []).append(r.ttft_s)
    rows = []
    for index in sorted(bins):
        low = 0 if index == 0 else _FIRST_BIN_TOKENS << (index - 1)
        stats = latency_group(bins[index])
        rows.append({"min_tokens": low, "max_tokens": _FIRST_BIN_TOKENS << index, **stats})
    return rows
