"""Variable tracking (RULER, Hsieh et al. 2024): follow a chain of assignments
`VAR A = 12345`, `VAR B = VAR A`, ... scattered through noise, and name every variable that
ends up holding the value. Tests multi-hop tracing, which eviction can break at any hop.
"""

from __future__ import annotations

import itertools
import string

import numpy as np

from kvtier.eval.haystack import filler, insert_at_depths, random_start
from kvtier.eval.sample import Builder

HEADER = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"


def _name(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_uppercase), 5))


def make_variable_tracking(
    rng: np.random.Generator, haystack: str = "noise", num_hops: int = 4
) -> Builder:
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = _name(rng)
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10_000, 100_000)))
    statements = [f"VAR {names[0]} = {value}."]
    statements += [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    # Sorted depths keep the chain in reading order, as RULER does.
    depths = sorted(float(d) for d in rng.uniform(0.0, 1.0, len(statements)))
    start = random_start(haystack, rng)
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    )
    answer_prefix = (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{len(names)} variables are assigned the value {value}, they are:"
    )
    details = {"haystack": haystack, "depths": depths, "needles": statements}

    def build(n: int):
        sentences = insert_at_depths(filler(haystack, start, n), statements, depths)
        return HEADER + " ".join(sentences) + "\n", question, answer_prefix, list(names), details

    return build
