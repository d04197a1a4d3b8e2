"""Real prose to build messages from, and how long a text is in tokens.

Messages are contiguous word spans of the prose in `kvtier/data/text/` (sources in its README):
a model under test then reads plausible English, whose attention patterns and compressibility
resemble real chats far more than random token ids do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

# BPE tokenizers of the Llama/Qwen families give about 1.2-1.4 tokens per English word.
TOKENS_PER_WORD = 1.3

LengthFn = Callable[[str], int]

_SENTENCE_END = re.compile(r"[.!?][\"')]*$")


def approx_tokens(text: str) -> int:
    """Tokens in `text` without a tokenizer: whitespace words x 1.3, rounded up."""
    return math.ceil(len(text.split()) * TOKENS_PER_WORD)


@dataclass(frozen=True)
class Corpus:
    """All words of the prose files in a fixed order, and where sentences start."""

    words: tuple[str, ...]
    sentence_starts: tuple[int, ...]

    @classmethod
    def from_texts(cls, texts: list[str]) -> Corpus:
        words: list[str] = []
        starts: list[int] = []
        for text in texts:
            new_sentence = True
            for word in text.split():
                if new_sentence:
                    starts.append(len(words))
                words.append(word)
                new_sentence = bool(_SENTENCE_END.search(word))
        if not words:
            raise ValueError("the corpus has no words")
        return cls(tuple(words), tuple(starts))

    def span(self, start: int, n_words: int) -> str:
        """`n_words` words from `start`, wrapping around the end of the corpus."""
        size = len(self.words)
        return " ".join(self.words[(start + i) % size] for i in range(n_words))

    def text_of_tokens(
        self, rng: np.random.Generator, tokens: int, length: LengthFn = approx_tokens
    ) -> tuple[str, int]:
        """A span starting at a random sentence that `length` measures at about `tokens`.

        The word count is first guessed at 1.3 tokens a word, then corrected by the measured
        ratio: a real tokenizer's rate varies from passage to passage.
        Returns the text and its measured length."""
        start = self.sentence_starts[int(rng.integers(len(self.sentence_starts)))]
        n_words = max(1, round(tokens / TOKENS_PER_WORD))
        text = self.span(start, n_words)
        measured = length(text)
        for _ in range(3):
            if abs(measured - tokens) <= max(1, tokens // 50):
                break
            n_words = max(1, round(n_words * tokens / max(measured, 1)))
            text = self.span(start, n_words)
            measured = length(text)
        return text, measured


@cache
def load_corpus() -> Corpus:
    """The packaged prose, files in name order (so generated text is the same everywhere)."""
    folder = resources.files("kvtier") / "data" / "text"
    names = sorted(item.name for item in folder.iterdir() if item.name.endswith(".txt"))
    return Corpus.from_texts([(folder / name).read_text(encoding="utf-8") for name in names])
