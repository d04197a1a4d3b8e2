"""What `bf16_drift.py` and `decode_drift.py` share: the float32 transformers reference, the
random prompts, the observer that sends the engine down its other path, and the report line.
Imported by them as a sibling module (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from kvtier.models import resolve_model_dir


class NoOpObserver:
    """Sees nothing; attached only because an attention observer takes the engine off its
    fast path (the split prefill, the paged decode kernel) onto the gathered one."""

    needs_weights = False

    def observe(self, *args: object) -> None:
        pass


def reference_model() -> torch.nn.Module:
    """The embedded model in transformers, float32."""
    return AutoModelForCausalLM.from_pretrained(
        str(resolve_model_dir(None)), dtype=torch.float32
    ).eval()


def random_prompt(seed: int, tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49152, (tokens,), generator=generator).tolist()


def report(seed: int, path: str, got: torch.Tensor, want: torch.Tensor, extra: str = "") -> None:
    """Mean and max |logit difference| and top-1 agreement of `got` against `want`."""
    diff = (got - want).abs()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(
        f"seed {seed} {path:6s}: mean |diff| {diff.mean():.4f}  max {diff.max():.2f}  "
        f"top-1 agreement {100 * agree:.1f}%{extra}",
        flush=True,
    )
