"""Which stored forms an accuracy budget allows, from `kvtier eval --kv-forms` figures.

A figures file (JSON, written by `kvtier eval ... --kv-forms int8,int4 --out DIR` as
DIR/forms.json) says, for the models it names, how many points of `kvtier eval`'s average
score each quantized form lost against full precision on the same samples:

    {"models": ["smollm2-135m", ...], "metric": "...", "full_score": 54.3,
     "forms": {"int8": {"score": 54.3, "loss": 0.0}, "int4": {"score": 50.1, "loss": 4.2}},
     "settings": {...}, "command": "kvtier eval ..."}

`[policy] max_accuracy_loss` (points, default 0) allows a form whose measured loss is at most
the budget; full precision is always allowed. With a budget but no figures for the model,
only full precision is allowed (`FormBudget.note` says why), so nothing is stored lossy on
an unmeasured model. kvtier ships figures for the embedded model (data/accuracy/).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError
from kvtier.vocab import FORM_PRECISION, FULL

FIGURES_FILE = "forms.json"  # what `kvtier eval --kv-forms` writes into --out


@dataclass(frozen=True)
class AccuracyFigures:
    models: tuple[str, ...]  # names the figures apply to (geometry names, model folders)
    loss: dict[str, float]  # form -> points of eval score lost against full precision
    source: str  # where they came from (a path, or "bundled: NAME")

    def applies_to(self, model: str) -> bool:
        name = Path(model).name.lower()
        return any(name == m.lower() for m in self.models)


def parse_figures(data: Any, source: str) -> AccuracyFigures:
    """Validate a figures document; a clear error naming `source` otherwise."""
    if not isinstance(data, dict):
        raise KvtierError(f"accuracy figures {source}: expected a JSON object")
    models = data.get("models")
    forms = data.get("forms")
    if (
        not isinstance(models, list)
        or not models
        or not all(isinstance(m, str) and m for m in models)
    ):
        raise KvtierError(f"accuracy figures {source}: 'models' must be a list of model names")
    if not isinstance(forms, dict) or not forms:
        raise KvtierError(f"accuracy figures {source}: 'forms' must map int8/int4 to figures")
    loss: dict[str, float] = {}
    for form, entry in forms.items():
        if form not in FORM_PRECISION or form == FULL:
            raise KvtierError(
                f"accuracy figures {source}: unknown form {form!r}; expected int8 or int4"
            )
        value = entry.get("loss") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KvtierError(f"accuracy figures {source}: forms.{form}.loss must be a number")
        if not math.isfinite(value):
            raise KvtierError(f"accuracy figures {source}: forms.{form}.loss must be finite")
        loss[form] = float(value)
    return AccuracyFigures(tuple(models), loss, source)


def load_figures(path: str | Path) -> AccuracyFigures:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KvtierError(
            f"accuracy figures {path}: no such file (write one with kvtier eval --kv-forms "
            "int8,int4 --out DIR: DIR/forms.json)"
        ) from None
    except (OSError, ValueError) as exc:
        raise KvtierError(f"accuracy figures {path}: cannot read it as JSON ({exc})") from None
    return parse_figures(data, str(path))


def bundled_figures(model: str) -> AccuracyFigures | None:
    """The figures kvtier ships that name `model`, or None."""
    folder = resources.files("kvtier") / "data" / "accuracy"
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            figures = parse_figures(json.loads(entry.read_text()), f"bundled: {entry.name}")
            if figures.applies_to(model):
                return figures
    return None


@dataclass(frozen=True)
class FormBudget:
    """The forms a chunk may be stored in, most precise first (always starts with full)."""

    allowed: tuple[str, ...] = (FULL,)
    note: str = ""  # why the budget allows no more than it does, for the command's output


def form_budget(
    max_loss: float, model: str | None, figures_path: str | Path | None = None
) -> FormBudget:
    """What `max_loss` points allow for `model`: the forms whose measured loss is within it.
    An explicit figures file applies as given (its owner vouches for it); else kvtier's
    bundled figures for the model, if any."""
    if not (math.isfinite(max_loss) and max_loss >= 0):
        raise KvtierError(f"max_accuracy_loss must be a number >= 0, got {max_loss}")
    if max_loss == 0:  # the default: full precision only, whatever the figures say
        return FormBudget()
    figures = load_figures(figures_path) if figures_path is not None else None
    if figures is None and model is not None:
        figures = bundled_figures(model)
    if figures is None:
        return FormBudget(
            note=f"max_accuracy_loss {max_loss:g}: no accuracy figures for model "
            f"{model or '(unknown)'}, so only full precision is stored; measure them with "
            "kvtier eval --kv-forms int8,int4 and set [policy] accuracy_file"
        )
    allowed = [f for f, loss in figures.loss.items() if loss <= max_loss]
    allowed.sort(key=FORM_PRECISION.__getitem__, reverse=True)
    return FormBudget((FULL, *allowed), f"accuracy figures: {figures.source}")
