"""`kvtier eval --kv-forms`: the accuracy a stored form (INT8 / INT4) costs, as policy figures.

Each form runs the same samples on an engine whose KV pool is packed in that form
(`EngineConfig.kv_quant`) with the tier codecs' value groups (`compress.codecs`: keys per
channel over each 16-token block, values per token over groups of 64 channels), so every full
block the model attends to was quantized exactly the way a chunk stored in that form on
disk or remote is. That is an upper bound on a restored chunk's loss: there only the history
comes back quantized, here the question's own blocks are quantized too.

The figures (forms.json in --out: the loss of each form in points of the average score
against the full-cache run of the same samples) are what `[policy] accuracy_file` reads
(`kvtier.policy.accuracy`).
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.compress.codecs import Int8Codec
from kvtier.errors import KvtierError
from kvtier.eval.methods import FULL, MethodRun
from kvtier.eval.report import summarize
from kvtier.eval.runner import RunnerConfig, make_engine, run_eval
from kvtier.eval.sample import Sample
from kvtier.vocab import FORMS
from kvtier.vocab import FULL as FULL_FORM

STORED_FORMS = tuple(f for f in FORMS if f != FULL_FORM)  # int8, int4
METRIC = "kvtier eval average score (points, 0-100) over the tasks"


def check_forms(forms: Sequence[str]) -> list[str]:
    unknown = [f for f in forms if f not in STORED_FORMS]
    if unknown or not forms:
        raise KvtierError(
            f"--kv-forms takes a comma list of {', '.join(STORED_FORMS)}, got {','.join(forms)!r}"
        )
    return list(dict.fromkeys(forms))


def run_forms(
    samples: Sequence[Sample],
    forms: Sequence[str],
    config: RunnerConfig,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One summary row per form (spec "kv:int8", ...), each on its own packed-pool engine."""
    rows = []
    for form in forms:
        engine = make_engine(replace(config, kv_quant=form, kv_quant_group=Int8Codec().value_group))
        (row,) = summarize(run_eval(samples, [MethodRun(FULL, None, FULL)], config, engine))
        row["spec"] = row["method"] = f"kv:{form}"
        rows.append(row)
        if progress is not None:
            progress(f"kv:{form}: average {row['average']:.1f}")
        del engine
    return rows


def figures(
    full_row: dict[str, Any],
    form_rows: Sequence[dict[str, Any]],
    models: Sequence[str],
    settings: dict[str, Any],
) -> dict[str, Any]:
    base = full_row["average"]
    return {
        "models": list(models),
        "metric": METRIC,
        "full_score": round(base, 3),
        "forms": {
            row["spec"].removeprefix("kv:"): {
                "score": round(row["average"], 3),
                "loss": round(base - row["average"], 3),
                "scores": row["scores"],
            }
            for row in form_rows
        },
        "full_scores": full_row["scores"],
        "settings": settings,
        "command": shlex.join(["kvtier", *sys.argv[1:]]),
    }


def write_figures(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path
