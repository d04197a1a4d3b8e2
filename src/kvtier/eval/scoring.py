"""RULER's string-match metrics (Hsieh et al. 2024), per sample in [0, 1].

`all`: the share of reference strings found in the prediction (every needle value, every
variable name, every common word must be there for a full point). `part`: 1 if any reference
is found. Matching is case-insensitive substring search, as in RULER.

Standard library only: the kvpress side-by-side imports this file from its own venv.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def normalize(prediction: str) -> str:
    """RULER's post-processing: control characters become spaces; compare lower-case."""
    return _CONTROL.sub(" ", prediction).strip().lower()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    text = normalize(prediction)
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    text = normalize(prediction)
    return float(any(ref.lower() in text for ref in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    if not references:
        raise ValueError("a sample needs at least one reference answer")
    return METRICS[metric](prediction, references)
