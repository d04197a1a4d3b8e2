"""Aggregation tasks of RULER (Hsieh et al. 2024): common-word extraction (CWE: the most
common words of a long numbered list) and frequent-word extraction (FWE: the most frequent
coded words of a Zipf-distributed text). Every token matters a little, so these show what
eviction loses when no single needle carries the answer.
"""

from __future__ import annotations

import string

import numpy as np

from kvtier.eval.haystack import prose_vocabulary
from kvtier.eval.sample import Builder

CWE_NUM_COMMON = 10
CWE_FREQ_COMMON = 12
CWE_FREQ_UNCOMMON = 3

FWE_VOCAB = 100
FWE_ALPHA = 2.0
FWE_TOP = 3


def make_common_words(rng: np.random.Generator) -> tuple[Builder, int]:
    """CWE builder and its filler cap (the number of distinct uncommon words available)."""
    vocab = list(prose_vocabulary())
    order = rng.permutation(len(vocab))
    common = [vocab[i] for i in order[:CWE_NUM_COMMON]]
    uncommon = [vocab[i] for i in order[CWE_NUM_COMMON:]]
    shuffle_seed = int(rng.integers(2**31))
    header = (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n"
    )
    question = f"\nQuestion: What are the {CWE_NUM_COMMON} most common words in the above list?"
    answer_prefix = (
        f"Answer: The top {CWE_NUM_COMMON} words that appear most often in the list are:"
    )

    def build(n: int):
        words = common * CWE_FREQ_COMMON + uncommon[:n] * CWE_FREQ_UNCOMMON
        words = [words[i] for i in np.random.default_rng([shuffle_seed, n]).permutation(len(words))]
        listing = " ".join(f"{i}. {w}" for i, w in enumerate(words, start=1))
        details = {"list_length": len(words), "num_uncommon": n}
        return header + listing + "\n", question, answer_prefix, list(common), details

    return build, len(uncommon)


def _coded_word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), int(rng.integers(3, 7))))


def make_frequent_words(rng: np.random.Generator) -> Builder:
    """FWE builder: `n` words with exact Zipf counts, so the top three are never tied."""
    vocab: list[str] = []
    while len(vocab) < FWE_VOCAB:
        word = _coded_word(rng)
        if word not in vocab:
            vocab.append(word)
    weights = 1.0 / np.arange(1, FWE_VOCAB + 1) ** FWE_ALPHA
    weights /= weights.sum()
    shuffle_seed = int(rng.integers(2**31))
    header = (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words.\n"
    )
    question = (
        "\nQuestion: Do not provide any explanation. What are the three most frequently "
        "appeared words in the above coded text?"
    )
    answer_prefix = (
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )

    def build(n: int):
        counts = _exact_counts(weights, n)
        words = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        words = [words[i] for i in np.random.default_rng([shuffle_seed, n]).permutation(len(words))]
        top = [vocab[i] for i in np.argsort(-counts, kind="stable")[:FWE_TOP]]
        details = {"num_words": n, "top_counts": sorted(counts.tolist(), reverse=True)[:4]}
        return header + " ".join(words) + "\n", question, answer_prefix, top, details

    return build


def _exact_counts(weights: np.ndarray, n: int) -> np.ndarray:
    """Integer counts summing to `n`, proportional to `weights` (largest remainder)."""
    raw = weights * n
    counts = np.floor(raw).astype(int)
    remainder = n - counts.sum()
    counts[np.argsort(-(raw - counts), kind="stable")[:remainder]] += 1
    return counts
