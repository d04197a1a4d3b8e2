"""`kvtier simulate --validate`: the simulator against a real `kvtier bench` run.

`kvtier.results.compare` gives per policy the relative error `(simulated - measured) /
measured` of each compared figure; this module adds the issue's targets (means and medians
within 10%, p99 within 25%, bytes moved per tier within 5%; throughput is held to the means'
10%), says which rows miss, and checks first that the simulation was set up like the bench
run (same pool, tier budgets, scheduler knobs, workload), since a mismatch there would make
every error meaningless.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.workload.model import Request

MEAN_TARGET, P99_TARGET, BYTES_TARGET = 0.10, 0.25, 0.05
SMOLLM2 = "smollm2-135m"  # what `kvtier bench` runs without --model


def target_of(field: str) -> float:
    """The largest relative error the issue accepts for a compared figure."""
    if field.startswith("p99_"):
        return P99_TARGET
    if field.endswith(("_bytes_read", "_bytes_written")):
        return BYTES_TARGET
    return MEAN_TARGET  # mean_*, median_*, throughputs


def judge(comparison: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison with, per row, its `target` and `within` (None when the error is
    undefined), and per policy the count of rows within target."""
    policies = {}
    for policy, rows in comparison["policies"].items():
        judged = {}
        for field, row in rows.items():
            target = target_of(field)
            error = row["relative_error"]
            within = None if error is None else abs(error) <= target
            judged[field] = {**row, "target": target, "within": within}
        policies[policy] = judged
    return {
        **comparison,
        "policies": policies,
        "targets": {"mean_and_median": MEAN_TARGET, "p99": P99_TARGET, "bytes": BYTES_TARGET},
    }


def report_lines(judged: Mapping[str, Any]) -> list[str]:
    """A table per policy: simulated, measured, error, target and a verdict."""
    lines = []
    for policy, rows in judged["policies"].items():
        checked = [r for r in rows.values() if r["within"] is not None]
        hits = sum(1 for r in checked if r["within"])
        lines.append(f"{policy}: simulated vs measured ({hits} of {len(checked)} within target)")
        for field, row in rows.items():
            error, within = row["relative_error"], row["within"]
            shown = "n/a" if error is None else f"{error:+.1%}"
            verdict = {True: "ok", False: "MISS", None: "-"}[within]
            lines.append(
                f"  {field:26s} {_number(row['simulated']):>14} {_number(row['measured']):>14} "
                f"{shown:>8}  (±{row['target']:.0%}) {verdict}"
            )
    if not judged["policies"]:
        lines.append("no policy in common with the measured run")
    return lines


def other_workload(workload: str, seed: int, measured: Any) -> str | None:
    """Why the measured run (its results `config`) replayed other requests than the
    simulation of `workload` at `seed` would: another workload, or another seed of the same
    generator preset (a trace replays the same requests whatever the seed). None when they
    are the same, or the run does not say."""
    from kvtier.workload.flags import PRESET_NAMES

    if not isinstance(measured, Mapping):
        return None
    recorded = measured.get("workload")
    if isinstance(recorded, Mapping):  # `kvtier bench`: {name, seed, ...}
        name, their_seed = recorded.get("name"), recorded.get("seed")
    else:  # `kvtier simulate`: the name, and the seed beside it
        name, their_seed = recorded, measured.get("seed")
    if not isinstance(name, str):
        return None
    if not _same_workload(workload, name):
        return f"it replayed workload {name!r}, not {workload!r}"
    if workload in PRESET_NAMES and isinstance(their_seed, int) and their_seed != seed:
        return f"it replayed workload {name!r} with --seed {their_seed}, not {seed}"
    return None


def _same_workload(a: str, b: str) -> bool:
    if a == b:
        return True
    return Path(a).is_file() and Path(b).is_file() and Path(a).resolve() == Path(b).resolve()


def setup_mismatches(simulated: Mapping[str, Any], measured: Mapping[str, Any]) -> list[str]:
    """Where the simulation's configuration (results.json `config` of `kvtier simulate`)
    differs from the bench run's (`kvtier bench`'s): one line per difference."""
    engine = measured.get("engine")
    if not isinstance(engine, Mapping):
        return ["the measured results were not written by `kvtier bench` (no engine config)"]
    tiers = engine.get("tiers") or {}
    sim_tiers = simulated.get("tier_bytes") or {}
    workload = measured.get("workload") or {}
    pairs = [
        ("device KV pool", simulated.get("device_kv_bytes"), engine.get("kv_cache_bytes")),
        ("host tier bytes", sim_tiers.get("host", 0), measured.get("host_bytes", 0)),
        ("disk tier bytes", sim_tiers.get("disk", 0), measured.get("disk_bytes", 0)),
        ("max running requests", simulated.get("max_num_seqs"), engine.get("max_num_seqs")),
        (
            "tokens per step",
            simulated.get("max_batched_tokens"),
            engine.get("max_num_batched_tokens"),
        ),
        (
            "resume-after seconds",
            simulated.get("resume_after_s"),
            engine.get("session_resume_after_s"),
        ),
        ("chunk tokens", simulated.get("chunk_tokens"), tiers.get("chunk_tokens", 256)),
        (
            "write-through",
            simulated.get("write_through", False),
            tiers.get("write_through", False),
        ),
        ("kept pages", simulated.get("keep_moved", False), tiers.get("keep_moved", False)),
        ("workload", simulated.get("workload"), workload.get("name")),
        ("workload seed", simulated.get("seed"), workload.get("seed")),
        ("workload settings", list(simulated.get("workload_set") or []),
         list(workload.get("workload_set") or [])),
        ("policy settings", list(simulated.get("policy_set") or []),
         list(measured.get("policy_set") or [])),
    ]  # fmt: skip
    problems = [
        f"{what}: simulated {sim!r}, measured {real!r}" for what, sim, real in pairs if sim != real
    ]
    model = simulated.get("model")
    if engine.get("model_dir") is None and model != SMOLLM2:
        problems.append(f"model: simulated {model!r}, measured the embedded {SMOLLM2}")
    if not simulated.get("timer_after_steps", True):
        problems.append(
            "policy timer: simulated on its clock, measured after engine steps only "
            "(give --timer-after-steps)"
        )
    if not simulated.get("shared_prefixes", True):
        problems.append(
            "shared prefixes: simulated per conversation, the engine's prefix cache shares "
            "blocks across conversations (give --shared-prefixes)"
        )
    if simulated.get("replicas", 1) != 1:
        problems.append(f"replicas: simulated {simulated.get('replicas')}, measured 1 engine")
    return problems


def setup_from(measured: Any, results: str | Path) -> dict[str, Any]:
    """The `kvtier simulate` settings (argparse dests) of the `kvtier bench` run whose results
    `config` this is: one engine on this machine (`local-cpu`), its model, pool, tiers,
    scheduler knobs, workload and policies, its engine's prefix cache and after-step policy
    timer, and its recorded lengths (`results`' request files) when they are there. Values of
    the wrong type are left out, for the set-up check to name."""
    if not isinstance(measured, Mapping) or not isinstance(measured.get("engine"), Mapping):
        return {}
    engine = measured["engine"]
    tiers = engine.get("tiers") if isinstance(engine.get("tiers"), Mapping) else {}
    workload = measured.get("workload") if isinstance(measured.get("workload"), Mapping) else {}
    policies = measured.get("policies")
    setup = {
        "hardware": "local-cpu",
        "gpus": 1,
        "tp": 1,
        "model": engine.get("model_dir") or SMOLLM2,
        "device_kv_bytes": _whole(engine.get("kv_cache_bytes")),
        "host_bytes": _whole(measured.get("host_bytes")),
        "disk_bytes": _whole(measured.get("disk_bytes")),
        "chunk_tokens": tiers.get("chunk_tokens", 256),
        "max_num_seqs": engine.get("max_num_seqs"),
        "max_num_batched_tokens": engine.get("max_num_batched_tokens"),
        "session_resume_after_s": engine.get("session_resume_after_s"),
        "write_through": tiers.get("write_through", False),
        "keep_moved": tiers.get("keep_moved", False),
        "timer_after_steps": True,
        "shared_prefixes": True,
        "workload": workload.get("name"),
        "seed": workload.get("seed"),
        "workload_set": workload.get("workload_set"),
        "policy_set": measured.get("policy_set"),
        "policies": ",".join(policies) if policies and _strings(policies) else None,
        "lengths_from": str(results)
        if any(Path(results).parent.glob("requests-*.jsonl"))
        else None,
    }
    kinds = {
        "model": str, "chunk_tokens": int, "max_num_seqs": int, "max_num_batched_tokens": int,
        "session_resume_after_s": int | float, "write_through": bool, "keep_moved": bool,
        "workload": str, "seed": int,
    }  # fmt: skip
    for key, kind in kinds.items():
        value = setup[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            setup[key] = None
    for key in ("workload_set", "policy_set"):
        if not _strings(setup[key]):
            setup[key] = None
    return {key: value for key, value in setup.items() if value is not None}


def _whole(value: Any) -> str | None:
    """A byte count as the SIZE text the flags take."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    return None


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def measured_lengths(results: str | Path) -> dict[str, tuple[int, int, int]]:
    """Request id -> (prompt, output, history) tokens as a `kvtier bench` run recorded them
    (its requests-<policy>.jsonl files next to results.json; the first policy's record of a
    request wins). History is the prompt's prefix, in whole blocks, that the session had
    computed before (the bench's restored + recomputed tokens).

    The bench renders a text workload's turns with the model's chat template and resends the
    answers the model really gave, so its prompts are not the generator's estimated lengths,
    and the previous answer, re-tokenized inside the template, is mostly not a prefix match;
    replaying these lengths makes the simulator serve the requests the engine served."""
    folder = Path(results).parent
    files = sorted(folder.glob("requests-*.jsonl"))
    if not files:
        raise KvtierError(f"no requests-<policy>.jsonl next to {results} to take lengths from")
    lengths: dict[str, tuple[int, int, int]] = {}
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
                key = str(record["request_id"])
                history = sum(int(n) for n in (record.get("restored_tokens") or {}).values())
                value = (int(record["prompt_tokens"]), int(record["output_tokens"]), history)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                raise KvtierError(f"{file}:{number} is not a request record") from None
            if not record.get("failed") and value[0] > 0 and value[1] > 0:
                lengths.setdefault(key, value)
    return lengths


def with_lengths(
    requests: Sequence[Request], lengths: Mapping[str, tuple[int, int, int]]
) -> list[Request]:
    """The requests with the measured prompt and output lengths where a record has them, and
    prefix block ids that share exactly the measured history with the session's previous
    turn (fresh ids after it)."""
    fresh = itertools.count(-1, -1)  # ids no generator hands out
    previous: dict[str, tuple[int, ...]] = {}
    changed: dict[str, Request] = {}
    for request in sorted(requests, key=lambda r: (r.session_id, r.turn_index)):
        found = lengths.get(request.request_id)
        if found is None:
            previous.pop(request.session_id, None)  # unknown: the next turn starts afresh
            continue
        prompt, output, history = found
        block = request.block_tokens or 16
        # a first turn's history is what other sessions computed (a shared system prompt):
        # it keeps the generator's ids, which sessions of one app share
        before = previous.get(request.session_id, request.hash_ids)
        shared = before[: int(history // block)]
        blocks = math.ceil(prompt / block)
        hash_ids = shared + tuple(next(fresh) for _ in range(blocks - len(shared)))
        previous[request.session_id] = hash_ids
        changed[request.request_id] = replace(
            request, prompt_tokens=prompt, output_tokens=output, hash_ids=hash_ids
        )
    return [changed.get(r.request_id, r) for r in requests]


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) < 1e6:
        return f"{value:,.3f}"
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)
