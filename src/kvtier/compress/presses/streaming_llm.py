"""StreamingLLM: keep a few attention-sink tokens and a window of the most recent ones.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453). The first tokens draw attention whatever their content ("sinks"), so
keeping them plus a recent window keeps the model stable on endless streams. Keys keep the
RoPE rotation of their original position (the engine stores keys after RoPE); the next token
is placed at its true position, not at the cache length.
"""

from __future__ import annotations

import torch

from kvtier.compress.presses.base import EvictionPress, LayerView


class StreamingLLMPress(EvictionPress):
    query_window = 0

    def __init__(
        self, ratio: float = 0.0, keep_tokens: int | None = None, num_sinks: int = 4
    ) -> None:
        super().__init__(ratio, keep_tokens)
        self.num_sinks = num_sinks

    def score(self, view: LayerView, budget: int) -> torch.Tensor:
        # Later slots score higher; sinks highest. Slots are in position order in every head.
        order = torch.arange(view.num_tokens, dtype=torch.float32)
        order[: min(self.num_sinks, budget)] = float("inf")
        return order.expand(view.keys.shape[0], -1)

    def decode_keep(self, num_slots: int) -> torch.Tensor | None:
        """Slots to keep while decoding once the cache holds `num_slots` (None: keep all).

        Only with an absolute `keep_tokens` budget: that is what bounds an endless session.
        """
        if self.keep_tokens is None or num_slots <= self.keep_tokens:
            return None
        sinks = min(self.num_sinks, self.keep_tokens)
        recent = self.keep_tokens - sinks
        return torch.cat((torch.arange(sinks), torch.arange(num_slots - recent, num_slots)))
