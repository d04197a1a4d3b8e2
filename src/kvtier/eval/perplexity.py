"""Long-text perplexity with a cache bounded by StreamingLLM, through the engine's decode path.

StreamingLLM (Xiao et al. 2023, arXiv:2309.17453) reports perplexity on long text with the
cache capped at N tokens (attention sinks + a recent window) while decoding. The engine's
bounded decoding (a `streaming_llm@N` pipeline, docs/compression.md) does exactly that for
generated tokens, so this module feeds the text through it by teacher forcing: the request
decodes one token per step with its cache compacted back to N slots once a block's worth
piles up past N, and each step's "sampled" token is replaced by the text's next token after
its log-probability is read from the step's logits.

The first `prefix_tokens` tokens (at most the smallest budget) are prefilled instead of
decoded: no eviction happens within the first N tokens, so their predictions are the same
under every budget, and prefilling them is quicker. Their logits come from `Engine.score`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import KvtierError

NUM_SINKS = 4  # StreamingLLM's attention sinks, as its paper and our press default
DEFAULT_BUDGETS = (256, 512, 1024)
DEFAULT_LENGTH = 2048


@dataclass(frozen=True)
class PerplexityRun:
    spec: str  # "full" or "streaming_llm@<budget>"
    budget: int | None  # KV tokens kept while decoding (None: the full cache)
    num_tokens: int  # length of the text fed
    num_scored: int  # predictions scored: every token but the first
    nll: float  # mean negative log-likelihood per scored token (nats)
    perplexity: float  # exp(nll)
    peak_kv_blocks: int  # most pool blocks held at once while the text was fed
    peak_kv_bytes: int  # that x bytes per block: what the pool really held
    mean_kv_bytes: float  # mean over the steps of the teacher-forced request
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def long_text(tokenizer: Any, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of the prose shipped in kvtier/data/text (files in name
    order, a blank line between them: ~4,200 SmolLM2 tokens in all)."""
    folder = resources.files("kvtier") / "data" / "text"
    names = sorted(item.name for item in folder.iterdir() if item.name.endswith(".txt"))
    text = "\n\n".join((folder / name).read_text(encoding="utf-8").strip() for name in names)
    token_ids = list(tokenizer.encode(text))
    if num_tokens > len(token_ids):
        raise KvtierError(
            f"perplexity length {num_tokens} is longer than the shipped prose "
            f"({len(token_ids)} tokens with this tokenizer); give a shorter --lengths"
        )
    return token_ids[:num_tokens]


def check_budgets(budgets: Sequence[int], num_tokens: int) -> list[int]:
    """Budgets in ascending order; each must hold the sinks plus one recent token."""
    if not budgets:
        raise KvtierError("give at least one cache budget, e.g. --budgets 256,512")
    for budget in budgets:
        if budget <= NUM_SINKS:
            raise KvtierError(
                f"cache budget must exceed the {NUM_SINKS} attention sinks, got {budget}"
            )
    if num_tokens < 2:
        raise KvtierError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    return sorted(set(budgets))


def run_perplexity(
    engine: Any,
    token_ids: Sequence[int],
    budgets: Sequence[int],
    *,
    prefix_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[PerplexityRun]:
    """Full cache first, then one StreamingLLM run per budget, all over the same tokens.

    `prefix_tokens` (default: the smallest budget, at most the text minus one) are prefilled
    with `Engine.score`; every later token is teacher-forced through decode steps.
    """
    budgets = check_budgets(budgets, len(token_ids))
    wanted = budgets[0] if prefix_tokens is None else prefix_tokens
    prefix = min(wanted, budgets[0], len(token_ids) - 1)
    if prefix < 1:
        raise KvtierError(f"prefix_tokens must be at least 1, got {prefix_tokens}")
    from kvtier.compress import CompressionConfig, PressSpec

    runs: list[PerplexityRun] = []
    plans: list[tuple[str, int | None]] = [("full", None)]
    plans += [(f"streaming_llm@{b}", b) for b in budgets]
    try:
        for spec, budget in plans:
            compression = None
            if budget is not None:
                press = PressSpec(
                    name="streaming_llm", keep_tokens=budget, options={"num_sinks": NUM_SINKS}
                )
                compression = CompressionConfig(presses=[press])
            engine.set_compression(compression)
            runs.append(_score_text(engine, list(token_ids), prefix, spec, budget))
            if progress is not None:
                run = runs[-1]
                progress(
                    f"{spec}: perplexity {run.perplexity:.3f}, "
                    f"peak KV {run.peak_kv_bytes / 2**20:.2f} MiB, {run.wall_s:.1f} s"
                )
    finally:
        engine.set_compression(None)
    return runs


def _score_text(
    engine: Any, token_ids: list[int], prefix: int, spec: str, budget: int | None
) -> PerplexityRun:
    from kvtier.engine import SamplingParams

    started = time.perf_counter()
    bytes_per_block = engine.kv_pool.bytes_per_block
    engine.reset_prefix_cache()  # an earlier run's blocks would leave prefix rows uncomputed
    (scored,) = engine.score([token_ids[:prefix]])
    # Row i predicts token i + 1; the last row (predicting token `prefix`) is the decode
    # request's first sampled row below, so it is not counted twice.
    targets = torch.tensor(token_ids[1:prefix])
    nll = (-_log_probs(scored.logits[: prefix - 1], targets)).tolist()
    forced = token_ids[prefix:]
    params = SamplingParams(temperature=0, max_tokens=len(forced), ignore_eos=True)
    forcing = _TeacherForcing(engine.sampler, params, forced)
    engine.sampler = forcing
    blocks: list[int] = []
    try:
        engine.add_request(token_ids[:prefix], params)
        while engine.has_unfinished_requests():
            engine.step()
            blocks.append(engine.stats().kv_blocks_used)
    finally:
        engine.sampler = forcing.inner
    if len(forcing.nll) != len(forced):
        raise KvtierError(f"{spec}: {len(forcing.nll)} of {len(forced)} tokens were scored")
    nll += forcing.nll
    mean_nll = math.fsum(nll) / len(nll)
    return PerplexityRun(
        spec=spec,
        budget=budget,
        num_tokens=len(token_ids),
        num_scored=len(nll),
        nll=mean_nll,
        perplexity=math.exp(mean_nll),
        peak_kv_blocks=max(blocks),
        peak_kv_bytes=max(blocks) * bytes_per_block,
        mean_kv_bytes=sum(blocks) / len(blocks) * bytes_per_block,
        wall_s=round(time.perf_counter() - started, 3),
    )


class _TeacherForcing:
    """Stands in for the engine's sampler while one request is fed a known text: that
    request's next token is the text's, after the log-probability the model gave it is
    recorded. Other requests (none while perplexity runs) are sampled as usual."""

    def __init__(self, inner: Any, params: Any, targets: Sequence[int]) -> None:
        self.inner, self.params, self.targets = inner, params, targets
        self.nll: list[float] = []

    def __call__(self, logits: torch.Tensor, params: list[Any], generators: list[Any]) -> list[int]:
        next_ids = self.inner(logits, params, generators)
        for row, row_params in enumerate(params):
            if row_params is self.params:  # the identity of the request's own params object
                target = self.targets[len(self.nll)]
                self.nll.append(-_log_probs(logits[row : row + 1], torch.tensor([target])).item())
                next_ids[row] = target
        return next_ids


def _log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row, in float64 so long sums do not drift."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1)


def markdown_table(runs: Sequence[PerplexityRun]) -> str:
    """One row per run; "vs full" compares with the full-cache run of the same text."""
    full = {r.num_tokens: r for r in runs if r.budget is None}
    lines = [
        "| method | tokens | budget | perplexity | vs full | peak KV MiB | KV vs full "
        "| mean KV MiB | wall s | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        base = full.get(run.num_tokens)
        ratio = f"{run.perplexity / base.perplexity:.3f}x" if base else "-"
        held = f"{run.peak_kv_bytes / base.peak_kv_bytes:.0%}" if base else "-"
        lines.append(
            f"| {run.spec} | {run.num_tokens:,} | {run.budget or 'all'} | {run.perplexity:.3f} "
            f"| {ratio} | {run.peak_kv_bytes / 2**20:.2f} | {held} "
            f"| {run.mean_kv_bytes / 2**20:.2f} | {run.wall_s:.1f} "
            f"| {run.num_tokens / run.wall_s:.0f} |"
        )
    return "\n".join(lines)


def write_json(path: Path, settings: dict[str, Any], runs: Sequence[PerplexityRun]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"settings": settings, "runs": [run.to_dict() for run in runs]}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path
