"""Needle in a haystack, RULER-style (Hsieh et al. 2024, "RULER: What's the Real Context Size
of Your Long-Context Language Models?"), and the classic passkey retrieval (Mohtashami &
Jaggi 2023, "Landmark Attention").

Answer prefixes end with a colon: SmolLM2-135M then answers with the number, where after a
bare "The pass key is" it often rambles ("... the pass key that is used to").

Needles read "One of the special magic numbers for {key} is: {value}." with 7-digit values;
keys are two words of the shipped prose joined by a hyphen. Variants: one needle; several
keys of which one is asked (the others distract); several values for one key (all asked);
several keys all asked.
"""

from __future__ import annotations

import numpy as np

from kvtier.eval.haystack import filler, insert_at_depths, prose_vocabulary, random_start
from kvtier.eval.sample import Builder

HEADER = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.\n"
)


def needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _distinct(rng: np.random.Generator, n: int, draw) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        item = draw()
        if item not in out:
            out.append(item)
    return out


def _key(rng: np.random.Generator) -> str:
    vocab = prose_vocabulary()
    return f"{vocab[rng.integers(len(vocab))]}-{vocab[rng.integers(len(vocab))]}"


def _value(rng: np.random.Generator) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def make_niah(
    rng: np.random.Generator,
    haystack: str,
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
) -> Builder:
    """A builder for one NIAH sample; its needles and depths are drawn once, here."""
    keys = _distinct(rng, num_keys, lambda: _key(rng))
    values = {k: _distinct(rng, num_values, lambda: _value(rng)) for k in keys}
    queries = keys[:num_queries]  # keys are already in random order
    needles = [needle(k, v) for k in keys for v in values[k]]
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    depths = sorted(float(d) for d in rng.uniform(0.0, 1.0, len(needles)))
    start = random_start(haystack, rng)
    answers = [v for k in queries for v in values[k]]
    asked = ", ".join(queries[:-1]) + f" and {queries[-1]}" if len(queries) > 1 else queries[0]
    if len(answers) > 1:
        question = (
            f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text?"
        )
        answer_prefix = f"The special magic numbers for {asked} mentioned in the provided text are:"
    else:
        question = f"\nWhat is the special magic number for {asked} mentioned in the provided text?"
        answer_prefix = f"The special magic number for {asked} mentioned in the provided text is:"
    details = {"haystack": haystack, "depths": depths, "needles": needles}

    def build(n: int):
        sentences = insert_at_depths(filler(haystack, start, n), needles, depths)
        return HEADER + " ".join(sentences) + "\n", question, answer_prefix, answers, details

    return build


def make_passkey(rng: np.random.Generator, haystack: str = "noise") -> Builder:
    """The passkey task: a 5-digit key hidden once in repeated noise sentences."""
    passkey = str(int(rng.integers(10_000, 100_000)))
    depth = float(rng.uniform(0.0, 1.0))
    start = random_start(haystack, rng)
    header = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.\n"
    )
    line = f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    details = {"haystack": haystack, "depths": [depth], "needles": [line]}

    def build(n: int):
        sentences = insert_at_depths(filler(haystack, start, n), [line], [depth])
        context = header + " ".join(sentences) + "\n"
        return context, "\nWhat is the pass key?", "The pass key is:", [passkey], details

    return build
