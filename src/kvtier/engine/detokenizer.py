"""Incremental detokenization with stop strings, for streaming and offline output alike.

Decoding the whole output every token is quadratic; decoding token by token breaks
multi-byte characters and word-initial spaces. So, like vLLM and TGI, we decode a short
window (`prefix_offset`..end) and emit what it adds over the already-emitted part of the
window, waiting while the tail is an incomplete UTF-8 sequence ("\\ufffd").

Stop strings: text that could still become a stop string is held back (at most
`len(longest stop) - 1` characters), so a stream never shows text that is then trimmed.
The full text is therefore exactly the concatenation of the deltas.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens used as decoding context, so the first output token is decoded as it would
# be mid-text (SentencePiece drops a leading space at the start of a decode).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0

    def add_token(self, token_id: int) -> bool:
        """Append one generated token; True when the text now contains a stop string."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True
        )
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # no complete character yet
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not self.stop:
            return False
        # Only a stop string overlapping the new text can be new.
        search_from = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back a possible stop-string start."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
