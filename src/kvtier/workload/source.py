"""One way for every command (`bench`, `simulate`, `analyze`) to turn `--workload SPEC` into a
Workload: SPEC is a generator preset (`kvtier.workload.presets`, with `KEY=VALUE` settings
on top), a trace file, or a trace bundled with kvtier by name (`kvtier.workload.traces`).
Keeping it in one place is what makes `kvtier simulate --workload demo` the very workload
`kvtier bench --workload demo` replays."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvtier.errors import KvtierError
from kvtier.workload.config import GeneratorConfig
from kvtier.workload.flags import PRESET_NAMES
from kvtier.workload.model import Workload
from kvtier.workload.presets import PRESETS


def preset_with_settings(name: str, settings: Sequence[str] = ()) -> GeneratorConfig:
    """A preset with `KEY=VALUE` settings applied; dotted keys reach into tables
    (`answer_tokens.mean=64`), values are JSON when they parse as JSON, else strings."""
    if name not in PRESETS:
        raise KvtierError(f"unknown workload preset {name!r}; choose one of {', '.join(PRESETS)}")
    values: dict[str, Any] = json.loads(json.dumps(PRESETS[name]))  # a deep copy
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not key.strip():
            raise KvtierError(
                f"--workload-set takes KEY=VALUE (e.g. sessions=1000), not {setting!r}"
            )
        *parents, last = key.strip().split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise KvtierError(f"--workload-set {key}: {part!r} is not a table")
        try:
            node[last] = json.loads(text)
        except json.JSONDecodeError:
            node[last] = text
    return GeneratorConfig.from_dict(values)


def load_workload(
    spec: str,
    *,
    settings: Sequence[str] = (),
    trace_format: str = "auto",
    seed: int = 0,
    scale_to: int | None = None,
    sessions: int | None = None,
    resume_after_s: float = 30.0,
) -> Workload:
    """The workload SPEC names; `sessions` keeps N sessions, those with turns resumed after
    `resume_after_s` first (`workload.subset`), then `scale_to` fits the kept lengths to that
    context."""
    if spec in PRESETS:
        from kvtier.workload.generator import generate

        workload = generate(preset_with_settings(spec, settings), seed=seed)
    else:
        from kvtier.workload.traces import bundled_trace_names, load_trace, trace_path

        if settings:
            raise KvtierError("--workload-set changes generator presets, not trace files")
        if not trace_path(spec).is_file():
            raise KvtierError(
                f"--workload {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}), "
                f"a bundled trace ({', '.join(bundled_trace_names())}) nor an existing trace file"
            )
        workload = load_trace(spec, trace_format, seed=seed)
    if sessions is not None:
        from kvtier.workload.subset import keep_sessions

        workload = keep_sessions(workload, sessions, resume_after_s)
    if scale_to is not None:
        from kvtier.workload.scale import scale_to_context

        workload = scale_to_context(workload, scale_to)
    return workload
