"""How far one seed's verdict holds: the same generator preset, deployment and policies run at
several workload seeds, then per policy the spread of its figures over the seeds, how many
seeds it is the best on each resumed-TTFT figure, and per seed `cost` over the best fixed
policy (`sweep.versus`, the rule docs/policy.md states).

Why it is needed: a preset's resumed-TTFT p99 over a few hundred resumed turns is set by its
five or six slowest turns, and the workload is a closed loop (a session's next turn arrives a
think time after its previous one finished), so a policy that finishes a turn sooner also moves
when the next one arrives against the queue. Two policies can then differ on one seed's p99 by
a turn that waited behind the same long prefill for a different time. Several seeds tell such
a difference from one that holds.

The preset's own verdict is `pooled`: every resumed turn of all the seeds taken together, as
one sample of the preset as many times the size as there are seeds, so its p99 is set by that
many times as many turns, and its p50 does not jump between the device-hit and the restore mode
of a bimodal latency as one seed's can. Per seed, the counts say how often a single run of the
preset would have shown each verdict.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.policy.config import PolicyConfig
from kvtier.results.records import RunRecords
from kvtier.results.summary import job_times, latency_group, resumed_turns
from kvtier.sim.deployment import Deployment
from kvtier.sim.simulator import simulate
from kvtier.sim.sweep import FIXED_POLICIES, RESUMED_FIELDS, metrics_row, same, versus
from kvtier.workload.model import Request

SCHEMA = "kvtier.seeds/1"
WITHIN = 1.05  # the rule: never behind the best fixed policy by more than 5% ...
AHEAD = 0.85  # ... and, where the workload carries a signal, ahead by 15% (mean or p99)
SPREAD_FIELDS = (*RESUMED_FIELDS, "resumed_on_device", "bytes_moved")
ORACLE = "oracle"  # knows the future: shown, but not counted among the best


def parse_seeds(text: str) -> list[int]:
    """ "0-9", "0,3,7" or both ("0-2,9") -> the seeds in the order given, each once."""
    problem = f"--seeds takes seeds like 0-9 or 0,3,7, not {text!r}"
    seeds: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise KvtierError(problem) from None
        if first < 0 or last < first:
            raise KvtierError(problem)
        seeds += range(first, last + 1)
    if len(set(seeds)) != len(seeds):
        raise KvtierError(f"{problem} (a seed is given twice)")
    return seeds


def run_seeds(
    seeds: Sequence[int],
    requests: Callable[[int], list[Request]],
    deployment: Deployment,
    policies: Sequence[str],
    policy: Callable[[str], PolicyConfig],
    progress: Callable[[str], None] = lambda line: None,
    keep: Callable[[int, list[RunRecords]], None] = lambda seed, runs: None,
) -> dict[str, Any]:
    """Simulate every policy on `requests(seed)` for each seed; `keep(seed, runs)` is handed
    each seed's runs (to write them out) before the next seed starts."""
    rows = []
    resumed: dict[str, list[float]] = {name: [] for name in policies}  # TTFT s, every seed's
    jobs: dict[str, list[float]] = {name: [] for name in policies}  # job completion s, likewise
    for seed in seeds:
        workload = requests(seed)
        runs = []
        for name in policies:
            result = simulate(workload, deployment, policy(name))
            rows.append({"seed": seed, **metrics_row(name, result.run)})
            resumed[name] += [r.ttft_s for r in resumed_turns(result.run)]
            jobs[name] += job_times(result.run)[0]
            runs.append(result.run)
            progress(f"seed {seed} {name}: {result.events:,} events in {result.wall_s:.1f} s")
        keep(seed, runs)
    against = versus(rows, cell=("seed",))
    return {
        "schema": SCHEMA,
        "seeds": list(seeds),
        "policies": list(policies),
        "rows": rows,
        "spread": spread(rows, policies),
        "best": best_counts(rows, policies),
        "versus": against,
        "rule": rule(against),
        "pooled": pooled(rows, resumed, jobs),
    }


def pooled(
    rows: Sequence[Mapping[str, Any]],
    resumed: Mapping[str, Sequence[float]],
    jobs: Mapping[str, Sequence[float]] | None = None,
) -> dict:
    """The preset's verdict on every resumed turn of all the seeds at once (`resumed`: each
    policy's resumed TTFTs in seconds): per policy its resumed mean / p50 / p99 over them,
    `cost` over the best fixed policy on those (`versus`), and the rule on that one sample
    (`rule`, whose `within` and `ahead` are then 0 or 1). With `jobs` (each policy's job
    completion times, s), also their mean, and `cost` over the best fixed policy's and over
    the oracle's on it (`jobs_versus`); `oracle` holds `cost`'s resumed figures over the
    oracle's."""
    jobs = jobs or {}
    out_rows = []
    for name, ttfts in resumed.items():
        mine = [r for r in rows if r["policy"] == name]
        group = latency_group(ttfts)
        out_rows.append(
            {
                "seed": "pooled",
                "policy": name,
                "resumed_turns": group["count"],
                "failed": sum(r["failed"] for r in mine),
                # 0 without resumed turns, as in `metrics_row`
                "resumed_mean_ms": group.get("mean_ms", 0.0),
                "resumed_p50_ms": group.get("median_ms", 0.0),
                "resumed_p99_ms": group.get("p99_ms", 0.0),
                "jct_mean_s": statistics.fmean(jobs[name]) if jobs.get(name) else 0.0,
                "bytes_moved": sum(r["bytes_moved"] for r in mine),
            }
        )
    against = versus(out_rows, cell=("seed",))
    by_name = {row["policy"]: row for row in out_rows}
    return {
        "rows": out_rows,
        "versus": against[0] if against else None,
        "rule": rule(against),
        "jobs_versus": _jobs_versus(by_name),
        "oracle": _over(by_name, ORACLE, (*RESUMED_FIELDS, "jct_mean_s")),
    }


def _jobs_versus(by_name: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """`cost`'s mean job completion time over the best fixed policy's (and which that is)."""
    fixed = [by_name[name] for name in FIXED_POLICIES if name in by_name]
    cost = by_name.get("cost")
    if cost is None or not fixed or not cost["jct_mean_s"]:
        return None
    best = min(fixed, key=lambda row: (row["failed"], row["jct_mean_s"]))
    return {"ratio": cost["jct_mean_s"] / best["jct_mean_s"], "best": best["policy"]}


def _over(
    by_name: Mapping[str, Mapping[str, Any]], baseline: str, fields: Sequence[str]
) -> dict[str, float] | None:
    """`cost`'s figures over `baseline`'s, field by field; None without both."""
    cost, base = by_name.get("cost"), by_name.get(baseline)
    if cost is None or base is None:
        return None
    return {f: cost[f] / base[f] if base[f] else 1.0 for f in fields}


def spread(rows: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy and figure: the median over the seeds, and the lowest and highest seed's."""
    out = {}
    for name in policies:
        mine = [r for r in rows if r["policy"] == name]
        out[name] = {
            field: {
                "median": statistics.median(r[field] for r in mine),
                "min": min(r[field] for r in mine),
                "max": max(r[field] for r in mine),
            }
            for field in SPREAD_FIELDS
        }
    return out


def best_counts(rows: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy and resumed-TTFT figure: on how many seeds it is the best of the policies that
    do not know the future (ties within half a percent count for each; fewer failed requests
    first, as in the sweep's winners)."""
    counts = {name: dict.fromkeys(RESUMED_FIELDS, 0) for name in policies}
    for seed in dict.fromkeys(r["seed"] for r in rows):
        group = [r for r in rows if r["seed"] == seed and r["policy"] != ORACLE]
        for field in RESUMED_FIELDS:
            best = min(group, key=lambda r: (r["failed"], r[field]))
            for r in group:
                if r["failed"] == best["failed"] and same(r[field], best[field]):
                    counts[r["policy"]][field] += 1
    return counts


def rule(against: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over the seeds of `versus`: where the challenger is within `WITHIN` of the best fixed
    policy on all three resumed figures, where it is `AHEAD` on mean or p99, and the median and
    worst ratio of each figure. Empty when there is nothing to compare."""
    if not against:
        return {}
    return {
        "seeds": len(against),
        "within": sum(all(v[f] <= WITHIN for f in RESUMED_FIELDS) for v in against),
        "ahead": sum(
            v["resumed_mean_ms"] <= AHEAD or v["resumed_p99_ms"] <= AHEAD for v in against
        ),
        "median": {f: statistics.median(v[f] for v in against) for f in RESUMED_FIELDS},
        "worst": {f: max(v[f] for v in against) for f in RESUMED_FIELDS},
    }


def markdown(document: Mapping[str, Any]) -> str:
    seeds, policies = document["seeds"], document["policies"]
    lines = [
        f"### Over {len(seeds)} seeds ({_seed_list(seeds)}): resumed TTFT ms, share of resumed "
        "turns served from the device and bytes moved, median over the seeds [lowest - highest "
        "seed]",
        "",
        "| policy | mean | p50 | p99 | resumed on device | GB read+written "
        "| best on mean / p50 / p99 (seeds) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in policies:
        s = document["spread"][name]
        cells = [name]
        for field in RESUMED_FIELDS:
            cells.append(
                f"{s[field]['median']:,.1f} [{s[field]['min']:,.1f} - {s[field]['max']:,.1f}]"
            )
        device = s["resumed_on_device"]
        cells.append(f"{device['median']:.1%} [{device['min']:.1%} - {device['max']:.1%}]")
        moved = s["bytes_moved"]
        cells.append(
            f"{moved['median'] / 1e9:,.1f} [{moved['min'] / 1e9:,.1f} - {moved['max'] / 1e9:,.1f}]"
        )
        best = document["best"][name]
        cells.append(
            "knows the future"
            if name == ORACLE
            else " / ".join(str(best[field]) for field in RESUMED_FIELDS)
        )
        lines.append("| " + " | ".join(cells) + " |")
    if document["versus"]:
        lines += [
            "",
            f"### cost over the best fixed policy ({', '.join(FIXED_POLICIES)}) per seed: "
            "resumed TTFT",
            "",
            "| seed | mean | p50 | p99 | bytes / offload's |",
            "|---|---|---|---|---|",
        ]
        for v in document["versus"]:
            cells = [str(v["seed"])]
            cells += [f"{v[f]:.2f} ({v[f'{f}_best']})" for f in RESUMED_FIELDS]
            ratio = v.get("bytes_vs_offload")
            cells.append("-" if ratio is None else f"{ratio:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        r = document["rule"]
        figures = ("mean", "p50", "p99")
        lines += [
            "",
            f"cost within {WITHIN - 1:.0%} of the best fixed policy on mean, p50 and p99: "
            f"{r['within']} of {r['seeds']} seeds; ahead by {1 - AHEAD:.0%} or more on mean or "
            f"p99: {r['ahead']} of {r['seeds']}",
            "median ratio: "
            + ", ".join(
                f"{n} {r['median'][f]:.2f}" for n, f in zip(figures, RESUMED_FIELDS, strict=True)
            )
            + "; worst seed: "
            + ", ".join(
                f"{n} {r['worst'][f]:.2f}" for n, f in zip(figures, RESUMED_FIELDS, strict=True)
            ),
        ]
    return "\n".join(lines + _pooled_lines(document["pooled"], len(seeds))) + "\n"


def _pooled_lines(pool: Mapping[str, Any], seeds: int) -> list[str]:
    lines = [
        "",
        f"### Pooled: the resumed turns of the {seeds} seeds as one sample (the preset's verdict)",
        "",
        "| policy | resumed turns | mean | p50 | p99 | job completion mean s "
        "| GB read+written, all seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in pool["rows"]:
        cells = [row["policy"], f"{row['resumed_turns']:,}"]
        cells += [f"{row[f]:,.1f}" for f in RESUMED_FIELDS]
        cells.append(f"{row.get('jct_mean_s', 0.0):,.2f}")
        cells.append(f"{row['bytes_moved'] / 1e9:,.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    v, r = pool["versus"], pool["rule"]
    if v is not None:
        ratios = ", ".join(
            f"{n} {v[f]:.2f} ({v[f'{f}_best']})"
            for n, f in zip(("mean", "p50", "p99"), RESUMED_FIELDS, strict=True)
        )
        lines += [
            "",
            f"cost over the best fixed policy, pooled: {ratios}; within {WITHIN - 1:.0%} on all "
            f"three: {'yes' if r['within'] else 'no'}; ahead by {1 - AHEAD:.0%} or more on mean "
            f"or p99: {'yes' if r['ahead'] else 'no'}",
        ]
    jobs = pool.get("jobs_versus")
    if jobs is not None:
        lines.append(
            f"cost's mean job completion time over the best fixed policy's ({jobs['best']}): "
            f"{jobs['ratio']:.3f}"
        )
    oracle = pool.get("oracle")
    if oracle is not None:
        lines.append(
            "cost over the oracle, pooled: "
            + ", ".join(
                f"{n} {oracle[f]:.2f}"
                for n, f in zip(("mean", "p50", "p99", "job completion"), oracle, strict=True)
            )
        )
    return lines


def write_seeds(document: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "seeds.json", out / "seeds.md"]
    paths[0].write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(document), encoding="utf-8")
    return paths


def _seed_list(seeds: Sequence[int]) -> str:
    """0-9 for a run of consecutive seeds, else the seeds one by one."""
    if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))
