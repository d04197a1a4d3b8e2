"""Filler text that needles hide in: real prose from the package, or RULER's noise sentences.

A haystack is a list of sentences so needles can be inserted at sentence boundaries and the
length can be fitted one sentence at a time.
"""

from __future__ import annotations

import itertools
import re
from functools import cache

import numpy as np

from kvtier.workload.text import load_corpus

# RULER's "noise" haystack: the same five sentences over and over.
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

HAYSTACKS = ("prose", "noise")


@cache
def prose_sentences() -> tuple[str, ...]:
    """Every sentence of the packaged prose, in corpus order."""
    corpus = load_corpus()
    bounds = [*corpus.sentence_starts, len(corpus.words)]
    return tuple(" ".join(corpus.words[start:end]) for start, end in itertools.pairwise(bounds))


@cache
def prose_vocabulary() -> tuple[str, ...]:
    """Distinct lower-case words (4+ letters) of the prose, sorted: word lists for CWE."""
    words = {re.sub(r"[^a-z]", "", w.lower()) for w in load_corpus().words}
    return tuple(sorted(w for w in words if len(w) >= 4))


def filler(kind: str, start: int, n_sentences: int) -> list[str]:
    """`n_sentences` sentences of `kind` from sentence `start`, wrapping around the corpus.

    The prose is only ~4,700 tokens, so an 8K haystack reads part of it twice (RULER repeats
    its essays the same way).
    """
    source = prose_sentences() if kind == "prose" else NOISE_SENTENCES
    return [source[(start + i) % len(source)] for i in range(n_sentences)]


def random_start(kind: str, rng: np.random.Generator) -> int:
    source = prose_sentences() if kind == "prose" else NOISE_SENTENCES
    return int(rng.integers(len(source)))


def insert_at_depths(sentences: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Sentences with each needle placed at its relative depth (0 = start, 1 = end)."""
    out = list(sentences)
    # Insert deepest first so earlier positions are not shifted by later insertions.
    for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda p: -p[1]):
        out.insert(round(depth * len(sentences)), needle)
    return out
