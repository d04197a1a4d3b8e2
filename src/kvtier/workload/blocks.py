"""Prefix block ids for prompts given as text segments, so prefix sharing is known without a
tokenizer.

A prompt is a list of segments (system prompt, then user and assistant messages), each with a
content key and a token count. Block `i` covers tokens `[i*B, (i+1)*B)`; its id is interned from
its parent block's id and the (segment key, start, end) slices it covers, which is how a prefix
cache keys blocks: two prompts share block `i` exactly when their first `(i+1)*B` tokens are the
same. Ids are small ints handed out in order of first use, stable across runs (keys are content
digests, never Python's salted `hash`). A partial last block gets its own id, as in traces.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# (content key, tokens): the key stands for the segment's text
Segment = tuple[bytes, int]


def content_key(*parts: str) -> bytes:
    """A digest of text that is equal for equal texts across processes and machines."""
    digest = hashlib.blake2b(digest_size=12)
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00")
    return digest.digest()


class BlockHasher:
    """Hands out block ids for one workload; equal prefixes get equal ids."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be at least 1 token, not {block_size}")
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[tuple[bytes, int, int], ...]], int] = {}

    def block_ids(self, segments: Sequence[Segment], known: Sequence[int] = ()) -> tuple[int, ...]:
        """Ids of every block of the prompt. `known` are the ids of leading blocks the caller
        already knows to be unchanged (the previous turn's prompt), which are not rehashed."""
        size = self.block_size
        ids = list(known)
        parent = ids[-1] if ids else -1
        skip = len(ids) * size
        content: list[tuple[bytes, int, int]] = []
        filled = 0
        for key, tokens in segments:
            start = min(skip, tokens)
            skip -= start
            while start < tokens:
                take = min(tokens - start, size - filled)
                content.append((key, start, start + take))
                start += take
                filled += take
                if filled == size:
                    parent = self._intern(parent, content)
                    ids.append(parent)
                    content = []
                    filled = 0
        if content:
            ids.append(self._intern(parent, content))
        return tuple(ids)

    def _intern(self, parent: int, content: list[tuple[bytes, int, int]]) -> int:
        return self._ids.setdefault((parent, tuple(content)), len(self._ids))


def common_full_blocks(a: Sequence[Segment], b: Sequence[Segment], block_size: int) -> int:
    """How many whole leading blocks two segment lists share (their run of equal segments)."""
    tokens = 0
    for seg_a, seg_b in zip(a, b, strict=False):
        if seg_a != seg_b:
            break
        tokens += seg_a[1]
    return tokens // block_size
