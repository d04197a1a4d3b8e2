"""Run samples through the real engine for each method run and score the answers.

One engine serves every run: `Engine.set_compression` switches the pipeline between runs.
Prefix caching is off so every run prefills every prompt itself (presses such as SnapKV and
H2O score tokens from the attention seen during prefill, and timings stay comparable).
Samples are batched (greedy, short answers); the bytes each request's KV really held after
compression come from the engine (`RequestOutput.kv_bytes_held`, blocks held x block size).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.eval.methods import MethodRun, parse
from kvtier.eval.sample import Sample
from kvtier.eval.scoring import score

_GIB = 1 << 30


@dataclass
class SampleResult:
    sample_id: str
    task: str
    length: int
    method: str
    ratio: float | None
    spec: str
    prediction: str
    score: float
    num_prompt_tokens: int
    num_output_tokens: int
    kv_tokens_held: int | None
    kv_bytes_held: int | None
    ttft_s: float | None
    itl_s_mean: float | None


@dataclass
class RunTiming:
    spec: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass
class EvalRun:
    samples: list[SampleResult]
    timings: list[RunTiming]

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": [asdict(s) for s in self.samples],
            "timings": [asdict(t) for t in self.timings],
        }


@dataclass
class RunnerConfig:
    model: str | None = None  # None: the embedded SmolLM2
    dtype: str = "auto"  # EngineConfig.dtype
    num_threads: int | None = None
    kv_cache_bytes: int = _GIB
    max_batch_tokens: int = 16384  # prompt tokens in flight together
    max_num_batched_tokens: int = 1024  # the engine's per-step budget (chunked prefill)
    kv_quant: str | None = None  # the pool's storage form (EngineConfig.kv_quant)
    kv_quant_group: int = 32


def make_engine(config: RunnerConfig) -> Any:
    from kvtier.cache.setup import build_engine
    from kvtier.engine import EngineConfig

    return build_engine(
        EngineConfig(
            model_dir=config.model,
            dtype=config.dtype,  # type: ignore[arg-type]
            num_threads=config.num_threads,
            kv_cache_bytes=config.kv_cache_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=False,
            kv_quant=config.kv_quant,  # type: ignore[arg-type]
            kv_quant_group=config.kv_quant_group,
        )
    )


def run_eval(
    samples: Sequence[Sample],
    runs: Sequence[MethodRun],
    config: RunnerConfig,
    engine: Any = None,
    progress: Callable[[str], None] | None = None,
) -> EvalRun:
    from kvtier.lowrank.bases import with_fitted_bases

    engine = engine or make_engine(config)
    results: list[SampleResult] = []
    timings: list[RunTiming] = []
    try:
        for run in runs:
            engine.set_compression(with_fitted_bases(parse(run.spec)))
            started = time.perf_counter()
            run_results: list[SampleResult] = []
            for batch in _batches(samples, config.max_batch_tokens):
                run_results += _run_batch(engine, batch, run)
            timings.append(
                RunTiming(
                    run.spec,
                    round(time.perf_counter() - started, 3),
                    sum(r.num_prompt_tokens for r in run_results),
                    sum(r.num_output_tokens for r in run_results),
                )
            )
            results += run_results
            if progress is not None:
                mean = sum(r.score for r in run_results) / max(len(run_results), 1)
                progress(f"{run.label}: score {100 * mean:.1f} in {timings[-1].wall_s:.1f} s")
    finally:
        engine.set_compression(None)
    return EvalRun(results, timings)


def _batches(samples: Sequence[Sample], max_tokens: int) -> list[list[Sample]]:
    batches: list[list[Sample]] = [[]]
    used = 0
    for sample in samples:
        if batches[-1] and used + sample.num_prompt_tokens > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(sample)
        used += sample.num_prompt_tokens
    return [b for b in batches if b]


def _run_batch(engine: Any, batch: list[Sample], run: MethodRun) -> list[SampleResult]:
    from kvtier.engine import SamplingParams

    ids = {
        engine.add_request(
            s.prompt_token_ids, SamplingParams(temperature=0, max_tokens=s.max_tokens)
        ): s
        for s in batch
    }
    texts = {rid: "" for rid in ids}
    tokens = dict.fromkeys(ids, 0)
    finals: dict[str, Any] = {}
    while len(finals) < len(ids):
        for out in engine.step():
            if out.request_id not in ids:
                continue
            texts[out.request_id] += out.delta_text
            tokens[out.request_id] += len(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    results = []
    for rid, sample in ids.items():
        out = finals[rid]
        if out.error:
            raise RuntimeError(f"{sample.sample_id} under {run.spec}: {out.error}")
        metrics = out.metrics
        itl = metrics.itl_s if metrics else []
        results.append(
            SampleResult(
                sample_id=sample.sample_id,
                task=sample.task,
                length=sample.length,
                method=run.method,
                ratio=run.ratio,
                spec=run.spec,
                prediction=texts[rid],
                score=score(sample.metric, texts[rid], sample.answers),
                num_prompt_tokens=sample.num_prompt_tokens,
                num_output_tokens=tokens[rid],
                kv_tokens_held=out.kv_tokens_held,
                kv_bytes_held=out.kv_bytes_held,
                ttft_s=metrics.ttft_s if metrics else None,
                itl_s_mean=sum(itl) / len(itl) if itl else None,
            )
        )
    return results
