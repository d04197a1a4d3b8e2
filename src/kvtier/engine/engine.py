"""Engine: requests in, tokens out. Wires tokenizer -> scheduler -> runner -> sampler.

Three ways to drive it:
- `add_request` + `step()` in a loop (what a benchmark or a custom server does);
- `generate(prompts, params)` for offline batches;
- `async for out in engine.stream(prompt, params)` for a server: a background thread runs
  the steps; cancelling the consumer aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvtier.clock import Clock
from kvtier.compress.config import CompressionConfig
from kvtier.engine.attention import PagedAttention, settle_prefill_attention
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.compressor import Compressor
from kvtier.engine.config import EngineConfig
from kvtier.engine.connector import EngineContext, KVConnector, QueueDemand
from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.hashing import namespace_bytes
from kvtier.engine.hooks import AttentionObserver, BlockEventListener
from kvtier.engine.kv_cache_manager import KVCacheManager, cdiv
from kvtier.engine.kv_pool import KVPool
from kvtier.engine.llama import LlamaConfig, LlamaModel, load_weights
from kvtier.engine.outputs import EngineStats, GenerationOutput, RequestOutput, ScoreOutput
from kvtier.engine.prefault import Prefaulter
from kvtier.engine.quant_pool import QuantizedKVPool
from kvtier.engine.request import FinishReason, Request
from kvtier.engine.runner import ModelRunner, StepResult
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.sessions import SessionTracker
from kvtier.engine.stream_loop import StepLoop
from kvtier.errors import KvtierError
from kvtier.load_limit import NO_LOAD_LIMIT, LoadLimit
from kvtier.models import resolve_model_dir
from kvtier.models.identity import model_digest
from kvtier.models.tokenizer import chat_token_ids, load_tokenizer
from kvtier.session_hints import NO_HINTS, EndKind, SessionHints

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
Params = SamplingParams | Mapping[str, Any] | None


class Engine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.device = config.resolved_device()
        # from here on config.dtype is what runs ("auto" decided), for the namespace and logs
        self.config = config = replace(config, dtype=config.resolved_dtype())
        torch.set_num_threads(config.resolved_num_threads())
        model_dir = resolve_model_dir(str(config.model_dir) if config.model_dir else None)
        self.model_dir = model_dir
        self.model_config = mc = LlamaConfig.from_model_dir(model_dir)
        self.max_model_len = min(config.max_model_len or mc.max_context, mc.max_context)
        self.dtype = getattr(torch, config.dtype)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_ids = _eos_token_ids(model_dir, self.tokenizer)
        self.namespace = config.namespace or default_namespace(
            model_dir, config.dtype, config.deterministic
        )
        with torch.inference_mode():
            geometry = (mc.num_layers, mc.num_kv_heads, mc.head_dim, config.block_size)
            if config.kv_quant is None:
                self.kv_pool: KVPool | QuantizedKVPool = KVPool(
                    *geometry, self.dtype, self.device, config.kv_cache_bytes
                )
            else:
                self.kv_pool = QuantizedKVPool(
                    *geometry,
                    self.dtype,
                    self.device,
                    config.kv_cache_bytes,
                    kv_quant=config.kv_quant,
                    value_group=config.kv_quant_group,
                    staging_blocks=config.max_num_seqs,
                )
            # what runs, kept in the config as the dtype is (the startup line names it)
            prefill = settle_prefill_attention(
                config.prefill_attention, self.kv_pool, mc.head_dim, config.deterministic
            )
            self.config = config = replace(config, prefill_attention=prefill)
            attention = PagedAttention(
                self.kv_pool,
                mc.num_heads,
                mc.num_kv_heads,
                mc.head_dim,
                config.paged_decode,
                config.deterministic,
                prefill_kernel=prefill == "kernel",
            )
            if config.deterministic and (why := attention.deterministic_unavailable()):
                raise KvtierError(f"deterministic mode is not available here: {why}")
            self.model = LlamaModel(mc, load_weights(model_dir), attention, self.dtype, self.device)
        # Started once the weights are in, so it does not slow their loading (None: off).
        self.prefault = Prefaulter(self.kv_pool.buffers()) if config.prefault_kv_pool else None
        self.block_pool = BlockPool(self.kv_pool.num_blocks, config.enable_prefix_caching)
        if isinstance(self.kv_pool, QuantizedKVPool):
            # Lets the packed pool reclaim the full-precision tail of a released block.
            refcounts = self.block_pool.ref_counts
            self.kv_pool.block_in_use = lambda block_id: refcounts[block_id] > 0
        self.kv_manager = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs, config.priority
        )
        self.runner = ModelRunner(self.model, self.kv_pool, self.kv_manager, self.device)
        self.sampler = Sampler()
        self.sessions = SessionTracker(
            clock, config.session_resume_after_s, max_sessions=config.max_sessions
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # One lock around all state changes: the stream loop thread steps while callers add
        # and abort from other threads.
        self._lock = threading.RLock()
        # Per-request output callbacks: whichever thread runs a step, each output reaches
        # the consumer that asked for it (a stream's queue, a generate() call).
        self._subscribers: dict[str, Callable[[RequestOutput], None]] = {}
        self._step_loop: StepLoop | None = None
        self.num_steps = 0
        # KV slots and bytes each request held right after its prefill (and compression).
        self._kv_held: dict[str, tuple[int, int]] = {}
        self.compressor: Compressor | None = None
        self.set_compression(config.compression)
        self.connector: KVConnector | None = None
        if connector is not None:
            self.set_connector(connector)

    def set_connector(self, connector: KVConnector | None) -> None:
        """Use `connector` (None: device only) from now on, closing the one before.

        Only while no request is in flight. The prefix cache is reset first, so no device
        block outlives the store it was copied to. Raises KvtierError when the connector
        refuses this engine (`KVConnector.bind`)."""
        with self._lock:
            if self.scheduler.has_unfinished:
                raise KvtierError("set_connector: wait until no request is in flight")
            old = self.connector
            if old is not None:
                self.scheduler.connector = self.connector = None
                self.remove_block_listener(old)
                old.close()
            self.block_pool.reset_prefix_cache()
            if connector is None:
                return
            connector.bind(self._connector_context())
            self.connector = self.scheduler.connector = connector
            self.add_block_listener(connector)

    def _connector_context(self) -> EngineContext:
        return EngineContext(
            block_pool=self.block_pool,
            kv_port=self.kv_pool,
            block_size=self.config.block_size,
            kv_quant=self.config.kv_quant,
            sessions=self.sessions,
            queue=lambda: QueueDemand(self.scheduler.waiting),
            layer_hook=True,  # the forward calls layer_ready (ModelRunner.execute)
        )

    # ----- hooks -------------------------------------------------------------------------

    def add_attention_observer(self, observer: AttentionObserver) -> None:
        if self.config.deterministic:
            # observers read the masked path's keys and weights, which this mode never builds
            raise KvtierError(
                "deterministic mode does not combine with attention observers (KV compression "
                "presses that score keys)"
            )
        self.model.attention.observers.append(observer)

    def remove_attention_observer(self, observer: AttentionObserver) -> None:
        self.model.attention.observers.remove(observer)

    def add_block_listener(self, listener: BlockEventListener) -> None:
        self.block_pool.listeners.append(listener)

    def remove_block_listener(self, listener: BlockEventListener) -> None:
        self.block_pool.listeners.remove(listener)

    # ----- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: Params = None,
        request_id: str | None = None,
        session_id: str | None = None,
        tenant: str | None = None,
        hints: SessionHints = NO_HINTS,
        load_limit: LoadLimit = NO_LOAD_LIMIT,
    ) -> str:
        """Queue a request (text, token ids, or chat messages); returns its id.

        `tenant` salts the block keys: requests of different tenants never share KV.
        `hints` (with a `session_id`) tell the retention policy about the session's future.
        `load_limit` bounds what a restore of its history may load (tiers, tokens).
        Raises KvtierError for input that cannot be served (empty, too long, bad params).
        """
        request = self._add(
            prompt, sampling_params, request_id, session_id, tenant, hints=hints,
            load_limit=load_limit,
        )  # fmt: skip
        return request.request_id

    def _add(
        self,
        prompt: Prompt,
        sampling_params: Params,
        request_id: str | None,
        session_id: str | None,
        tenant: str | None,
        return_prompt_logits: bool = False,
        hints: SessionHints = NO_HINTS,
        load_limit: LoadLimit = NO_LOAD_LIMIT,
    ) -> Request:
        params = _to_params(sampling_params)
        token_ids = self._tokenize(prompt)
        self._check_fits(token_ids)
        request_id = request_id or uuid.uuid4().hex
        request = Request(
            request_id,
            token_ids,
            params,
            namespace_bytes(self.namespace, tenant),
            generator=params.make_generator(self.device),
            session_id=session_id,
            tenant=tenant,
            return_prompt_logits=return_prompt_logits,
        )
        request.load_limit = load_limit
        with self._lock:
            if request_id in self.scheduler.requests:
                raise KvtierError(f"request id {request_id!r} is already in flight")
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.stop
            )
            if session_id is not None:
                self.sessions.start_turn(session_id, request_id, len(token_ids), hints)
            self.scheduler.add(request)
            if self.connector is not None:
                self.connector.on_request_added(request)
        if self._step_loop is not None:
            self._step_loop.wake()
        return request

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif prompt and all(isinstance(m, Mapping) for m in prompt):
            token_ids = chat_token_ids(self.tokenizer, [dict(m) for m in prompt])
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise KvtierError("a prompt is a string, a list of token ids, or a list of messages")
        if not token_ids:
            raise KvtierError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise KvtierError(f"token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        return token_ids

    def _check_fits(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise KvtierError(
                f"prompt has {n} tokens but the model context is {self.max_model_len}, "
                "leaving no room to generate; shorten the prompt"
            )
        # The prompt plus the first generated token must fit the pool on their own.
        blocks = cdiv(n + 1, self.config.block_size)
        if blocks > self.kv_pool.num_blocks:
            raise KvtierError(
                f"prompt has {n} tokens, needing {blocks} KV blocks, but the pool holds "
                f"{self.kv_pool.num_blocks} (kv_cache_bytes={self.config.kv_cache_bytes}); "
                "raise kv_cache_bytes or shorten the prompt"
            )

    def abort(self, request_id: str) -> bool:
        """End a request now and free its blocks; False if it is not in flight."""
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                return False
            self.scheduler.finish(request, FinishReason.ABORT)
            self._dispatch([self._output(request, [], finished=True)])
            return True

    def fail_all(self, error: str) -> None:
        """End every in-flight request with `error` (used when a step raised)."""
        with self._lock:
            outputs = []
            for request in list(self.scheduler.requests.values()):
                request.error = error
                self.scheduler.finish(request, FinishReason.ERROR)
                outputs.append(self._output(request, [], finished=True))
            self._dispatch(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ----- stepping ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; return one output per request that moved.

        Work done for one request (admission, compression, sampling, detokenizing) that
        raises ends that request alone with finish_reason "error" (logged with its
        traceback); the others go on. Only a failure of the whole batch (the forward pass,
        the scheduler) raises out of here.
        """
        with self._lock:
            self.num_steps += 1
            sched = self.scheduler.schedule()
            if self.connector is not None:
                self._load_handed_over(sched)
            for request in sched.preempted:
                request.prompt_logits.clear()  # recomputed after re-admission
                self._forget_kv(request.request_id)  # recomputed and compressed again
            failed = []
            for request in sched.admitted:
                try:
                    self._on_admitted(request)
                except Exception:
                    failed.append(self._fail(request, "admitting it"))
            outputs = [self._output(r, [], finished=True) for r in sched.finished] + failed
            try:
                self._forward_and_sample(sched, outputs)
            finally:
                # Also when the batch failed: these requests have already left the scheduler,
                # so `fail_all` would not reach their streams.
                self._dispatch(outputs)
            if self.connector is not None:
                self.connector.after_step()
            return outputs

    def _load_handed_over(self, sched: SchedulerOutput) -> None:
        """Run the loads the scheduler handed the connector; a request whose load failed is
        rolled back to its first unfilled block and sits this step out: never wrong KV.

        It computes from there from the next step on, in the chunks the scheduler cuts from
        that position, as when the miss is known at admission (or a layer-wise load fails,
        `_discard`). Computing its scheduled tokens from the failed block in this step
        instead would cut the recompute where the planned load happened to end, and how
        soon a failing prefetch reports decides which of the two a request gets: bf16
        matmuls round some row counts differently, so the answer would depend on timing."""
        self.connector.start_loads()
        failed = self.connector.wait_for_loads()
        if not failed:
            return
        admitted = {r.request_id for r in sched.admitted}
        kept = []
        for request, n in sched.scheduled:
            first_bad = failed.get(request.request_id)
            if first_bad is None or not self._roll_back(
                request, first_bad, request.request_id in admitted
            ):
                kept.append((request, n))
        sched.scheduled = kept

    def _roll_back(self, request: Request, first_bad: int, admitted: bool) -> bool:
        """Make a request compute again from block `first_bad` (a load there failed); False
        when nothing it counts as computed lies there or after."""
        position = first_bad * self.config.block_size
        if position >= request.num_computed_tokens:
            return False
        if admitted and request.num_cached_tokens > position:
            self.kv_manager.prefix_hits -= request.num_cached_tokens - position
            request.num_cached_tokens = position
        request.num_computed_tokens = position
        return True

    def _forward(self, scheduled: list[tuple[Request, int]]) -> tuple[StepResult, dict[str, int]]:
        """The model's step, with the connector's layer-by-layer loads beside it; the
        requests whose overlapped loads failed (their step is to be thrown away)."""
        if self.connector is None:
            return self.runner.execute(scheduled), {}
        try:
            result = self.runner.execute(scheduled, layer_ready=self.connector.layer_ready)
        finally:
            discarded = self.connector.finish_layer_loads()  # no load writes after this
        return result, discarded

    def _forward_and_sample(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        # A request failed at admission has given its blocks back: the forward must skip it.
        scheduled = [(r, n) for r, n in sched.scheduled if not r.is_finished]
        if not scheduled:
            return
        result, discarded = self._forward(scheduled)
        if discarded:
            scheduled = self._discard(sched, scheduled, discarded)
        for request, n in scheduled:
            try:
                request.num_computed_tokens += n
                self.kv_manager.register_full_blocks(request)
                self._after_forward(request)
            except Exception:
                outputs.append(self._fail(request, "storing its KV"))
        live = [
            (row, r)
            for row, r in enumerate(result.sampled)
            if not r.is_finished and r.request_id not in discarded
        ]
        tokens = self._sample_all(result.logits, live)
        for (row, request), token_id in zip(live, tokens, strict=True):
            try:
                if token_id is None:
                    # One row at a time, so a row that cannot be sampled fails alone.
                    (token_id,) = self.sampler(
                        result.logits[row : row + 1],
                        [request.sampling_params],
                        [request.generator],
                    )
                outputs.append(self._accept_token(request, token_id))
            except Exception:
                outputs.append(self._fail(request, "sampling its next token"))

    def _discard(
        self,
        sched: SchedulerOutput,
        scheduled: list[tuple[Request, int]],
        discarded: dict[str, int],
    ) -> list[tuple[Request, int]]:
        """Throw away the step of requests a layer of whose restore failed mid-forward: no
        token, the new KV not counted (nor its prompt logits), computed again from the
        failed block next step. The rest of the batch goes on."""
        admitted = {r.request_id for r in sched.admitted}
        kept = []
        for request, n in scheduled:
            first_bad = discarded.get(request.request_id)
            if first_bad is None:
                kept.append((request, n))
                continue
            if request.return_prompt_logits:
                request.prompt_logits.pop()  # this step's rows
            self._roll_back(request, first_bad, request.request_id in admitted)
        return kept

    def _sample_all(
        self, logits: torch.Tensor, live: list[tuple[int, Request]]
    ) -> list[int] | list[None]:
        """The next token of every live row in one call: one copy of the ids to the host per
        step (on a GPU one synchronisation, not one per sequence). When any row raises, the
        generators are put back as they were and every row is left (None) to be sampled
        alone, so a row that cannot be sampled fails by itself, with the same draws."""
        if not live:
            return []
        generators = [r.generator for _, r in live]
        states = [g.get_state() if g is not None else None for g in generators]
        rows = [row for row, _ in live]
        # a slice when no row was dropped (the common case): a list index would be copied
        picked = logits[: len(rows)] if rows[-1] == len(rows) - 1 else logits[rows]
        try:
            return self.sampler(picked, [r.sampling_params for _, r in live], generators)
        except Exception:
            for generator, state in zip(generators, states, strict=True):
                if generator is not None:
                    generator.set_state(state)
            return [None] * len(live)

    def _on_admitted(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.on_admitted(request)
        else:
            cached = request.num_cached_tokens or 0
            request.metrics.prompt_token_sources = {
                "device": cached,
                "recomputed": request.num_prompt_tokens - cached,
            }
        if request.session_id is not None:
            self.sessions.record_prefix(request.request_id, request.num_cached_tokens)

    def _fail(self, request: Request, doing: str) -> RequestOutput:
        """End one request whose own work raised (call from an `except` block: the
        traceback is logged here); the client gets a message without the exception text."""
        log.exception("request %s failed while %s; ending it alone", request.request_id, doing)
        request.error = f"internal error while {doing} (request {request.request_id})"
        self.scheduler.finish(request, FinishReason.ERROR)
        return self._output(request, [], finished=True)

    def _after_forward(self, request: Request) -> None:
        """Compress a request whose prompt was just prefilled (or bound its decode cache),
        then note what its KV holds."""
        if self.compressor is not None:
            self.compressor.after_forward(request)
        rid = request.request_id
        if rid not in self._kv_held and request.num_computed_tokens == request.num_tokens:
            num_blocks = len(self.kv_manager.block_table(rid))
            self._kv_held[rid] = (
                self.kv_manager.num_slots(request),
                num_blocks * self.kv_pool.bytes_per_block,
            )

    def _forget_kv(self, request_id: str) -> tuple[int | None, int | None]:
        if self.compressor is not None:
            self.compressor.forget(request_id)
        return self._kv_held.pop(request_id, (None, None))

    def _accept_token(self, request: Request, token_id: int) -> RequestOutput:
        request.append_token(token_id)
        params = request.sampling_params
        hit_stop_string = self._detokenizers[request.request_id].add_token(token_id)
        is_eos = not params.ignore_eos and token_id in self.eos_token_ids
        if hit_stop_string or is_eos or token_id in params.stop_token_ids:
            reason = FinishReason.STOP
        elif (
            request.num_output_tokens >= params.max_tokens
            or request.num_tokens >= self.max_model_len
            or request.return_prompt_logits
        ):
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is not None:
            self.scheduler.finish(request, reason)
        return self._output(request, [token_id], finished=reason is not None)

    def _output(self, request: Request, new_ids: list[int], finished: bool) -> RequestOutput:
        detok = self._detokenizers[request.request_id]
        delta = detok.take_delta(finished)
        kv_tokens_held = kv_bytes_held = None
        if finished:
            del self._detokenizers[request.request_id]
            kv_tokens_held, kv_bytes_held = self._forget_kv(request.request_id)
            if request.session_id is not None:
                ended = "length" if request.finish_reason is FinishReason.LENGTH else "answer"
                self.sessions.end_turn(request.request_id, ended)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            delta_text=delta,
            finished=finished,
            finish_reason=request.finish_reason.value if finished else None,
            error=request.error,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics if finished else None,
            kv_tokens_held=kv_tokens_held,
            kv_bytes_held=kv_bytes_held,
        )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._subscribers.get(out.request_id)
            if callback is not None:
                callback(out)

    # ----- offline -----------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: Params | Sequence[Params] = None,
    ) -> list[GenerationOutput]:
        """Run a batch of prompts to completion (in order of `prompts`).

        A prompt that cannot be served gets an output with finish_reason "error" and the
        message; the others run normally. Drives `step()` until its own requests finish.
        """
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise KvtierError("give one sampling params per prompt, or a single one")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params] * len(prompts)
        results: list[GenerationOutput | None] = [None] * len(prompts)
        collected: dict[str, tuple[int, list[RequestOutput]]] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, per_prompt, strict=True)):
                request_id = uuid.uuid4().hex
                outs: list[RequestOutput] = []
                self._subscribers[request_id] = outs.append
                try:
                    self.add_request(prompt, params, request_id)
                except KvtierError as exc:
                    del self._subscribers[request_id]
                    results[i] = GenerationOutput(
                        None, "", [], FinishReason.ERROR.value, error=str(exc)
                    )
                    continue
                collected[request_id] = (i, outs)
            while not all(outs and outs[-1].finished for _, outs in collected.values()):
                self.step()  # serialized with the stream loop thread, if one runs
        finally:
            for request_id, (_, outs) in collected.items():
                if not (outs and outs[-1].finished):
                    self.abort(request_id)  # interrupted: do not leave work behind
                self._subscribers.pop(request_id, None)
        for request_id, (i, outs) in collected.items():
            last = outs[-1]
            results[i] = GenerationOutput(
                request_id,
                "".join(o.delta_text for o in outs),
                [t for o in outs for t in o.new_token_ids],
                last.finish_reason,
                last.num_prompt_tokens,
                last.num_cached_tokens,
                last.metrics,
                last.error,
                last.kv_tokens_held,
                last.kv_bytes_held,
            )
        return results  # type: ignore[return-value]

    def score(self, prompts: Sequence[Prompt], tenant: str | None = None) -> list[ScoreOutput]:
        """Logits of every computed prompt position, through the real scheduler and pool.

        Batching, chunked prefill and prefix-cache reuse apply exactly as in serving (so
        this is also how tests check them); used for perplexity-style evaluation.
        """
        greedy_one = SamplingParams(temperature=0, max_tokens=1)
        requests = [self._add(p, greedy_one, None, None, tenant, True) for p in prompts]
        while any(not r.is_finished for r in requests):
            self.step()
        return [
            ScoreOutput(torch.cat(r.prompt_logits), r.prompt_logits_start, r.num_cached_tokens or 0)
            for r in requests
        ]

    # ----- streaming ---------------------------------------------------------------------

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: Params = None,
        request_id: str | None = None,
        session_id: str | None = None,
        tenant: str | None = None,
        hints: SessionHints = NO_HINTS,
        load_limit: LoadLimit = NO_LOAD_LIMIT,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced; the last has finished=True.

        Leaving the loop early or cancelling the consuming task aborts the request.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._subscribers:
            raise KvtierError(f"request id {request_id!r} is already being streamed")
        if self._step_loop is None:
            with self._lock:
                self._step_loop = self._step_loop or StepLoop(self)

        def deliver(out: RequestOutput) -> None:
            # RuntimeError: the consumer's event loop is closed; nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, out)

        self._subscribers[request_id] = deliver
        try:
            await asyncio.to_thread(
                self.add_request,
                prompt, sampling_params, request_id, session_id, tenant, hints, load_limit,
            )  # fmt: skip
        except BaseException:
            self._subscribers.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._subscribers.pop(request_id, None)
            if not finished:
                self._step_loop.abort_soon(request_id)

    def close(self) -> None:
        """Stop the background step loop (if streaming started it) and the pool's prefault."""
        if self.prefault is not None:
            self.prefault.close()
        if self._step_loop is not None:
            self._step_loop.close()
            self._step_loop = None
        if self.connector is not None:
            self.connector.close()

    # ----- observability -----------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            pool = self.block_pool
            return EngineStats(
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                kv_blocks_total=pool.num_blocks,
                kv_blocks_used=pool.num_used,
                kv_blocks_cached_idle=pool.num_cached_idle,
                kv_usage=pool.num_used / pool.num_blocks,
                prefix_cache_queries=self.kv_manager.prefix_queries,
                prefix_cache_hits=self.kv_manager.prefix_hits,
                num_preemptions=self.scheduler.num_preemptions,
                num_evictions=pool.num_evictions,
                num_steps=self.num_steps,
                num_sessions=len(self.sessions.sessions),
                num_sessions_evicted=self.sessions.num_evicted,
                tiers=None if self.connector is None else self.connector.stats(),
            )

    def set_compression(self, compression: CompressionConfig | None) -> None:
        """Use this compression pipeline for requests from now on (None: full KV).

        Only between requests: a pipeline changed mid-request would compress it half-way.
        """
        with self._lock:
            if self.scheduler.has_unfinished:
                raise KvtierError("set_compression: wait until no request is in flight")
            compression = self._fit_to_pool(compression)
            compressor = None
            if compression is not None and not compression.is_identity:
                compressor = Compressor(
                    compression, self.kv_pool, self.kv_manager, self.model_config.num_heads
                )
                # attached before the old pipeline goes: a refusal (deterministic mode) leaves
                # the engine with the pipeline it had
                if compressor.recorder is not None:
                    self.add_attention_observer(compressor.recorder)
            if self.compressor is not None and self.compressor.recorder is not None:
                self.remove_attention_observer(self.compressor.recorder)
            self.compressor = compressor
            self.config.compression = compression

    def _fit_to_pool(self, compression: CompressionConfig | None) -> CompressionConfig | None:
        """On a packed pool (kv_quant) a `kivi` press of the pool's bit width is what the
        pool already does to every block, so it is dropped; any other width would quantize
        twice, and is refused. On a full-precision pool `kivi` stays a simulation
        (quantize, then store the dequantized values: its accuracy, not its bytes)."""
        pool = self.kv_pool
        if compression is None or not isinstance(pool, QuantizedKVPool):
            return compression
        kept = []
        for press in compression.presses:
            if press.name != "kivi":
                kept.append(press)
            elif press.options.get("bits", 4) != pool.bits:
                raise KvtierError(
                    f"the KV pool stores {self.config.kv_quant} (kv_quant); a kivi press with "
                    f"bits={press.options.get('bits', 4)} would quantize it twice: drop the "
                    "kivi stage or match kv_quant"
                )
        return compression.model_copy(update={"presses": kept})

    def reset_prefix_cache(self) -> int:
        """Drop all idle cached blocks (e.g. to measure a cold start); returns how many."""
        with self._lock:
            return self.block_pool.reset_prefix_cache()

    # ----- cache control (servers, admin tools) ------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine's state lock: no step, add or abort runs until the block exits.

        Block listeners are called with this lock held, so a listener that keeps its own
        state (per-tenant accounting, say) reads and changes it consistently inside the
        block. Re-entrant. Keep the body short: the step loop waits for it.
        """
        with self._lock:
            yield

    def drop_cached(self, block_ids: Iterable[int]) -> int:
        """Evict these idle cached blocks now (they become free; listeners see
        `on_block_evicted` first); returns how many were dropped. Blocks in use, pinned, or
        not cached are left alone, so a stale list is harmless."""
        with self._lock:
            return self.block_pool.drop_cached(list(block_ids))

    def mark_turn_end(
        self, session_id: str, request_id: str, end: EndKind, tool: str | None = None
    ) -> bool:
        """Record how a finished turn's reply ended, as the caller parsed it (a tool call:
        the engine itself only tells an answer from the length limit). The retention policy
        learns return times per end kind and tool. False when the session is forgotten."""
        with self._lock:
            return self.sessions.mark_end(session_id, request_id, end, tool)

    def withdraw_pin(self, session_id: str) -> bool:
        """The session's `pin` hint is not in force (refused over a quota, or unpinned by an
        admin): the retention policy no longer sees it pinned."""
        with self._lock:
            return self.sessions.withdraw_pin(session_id)

    def pin_blocks(self, block_ids: Iterable[int]) -> list[int]:
        """Hold a reference on cached blocks so the LRU never evicts them (a pinned session).

        Returns the ids pinned: blocks that are no longer cached are skipped. Each pinned id
        must be given back once with `unpin_blocks`.
        """
        with self._lock:
            pinned = [b for b in block_ids if self.block_pool.is_cached(b)]
            self.block_pool.touch(pinned)
            return pinned

    def unpin_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back references taken by `pin_blocks` (in the order pinned); blocks nobody
        else holds become idle cached blocks again, evictable by the LRU."""
        with self._lock:
            if any(self.block_pool.ref_counts[b] < 1 for b in block_ids):
                raise KvtierError("unpin_blocks: a block is not pinned (was it unpinned twice?)")
            # tail first, as requests release: the head (shared prefix) is evicted last
            self.block_pool.release(list(block_ids)[::-1])

    def block_owner(self, block_id: int) -> BlockOwner | None:
        """The request that filled `block_id`, computed or loaded from a tier, while its
        blocks enter the prefix cache; None otherwise (no request is filling it).

        Meant for `BlockEventListener.on_block_filled`, which runs exactly then: a block is
        filled by the one request it was allocated to, so this names who filled it (tenant,
        session), and a restore's blocks name the request that loaded them, so its tenant's
        quota counts what it brought back. O(1), however many blocks one step registers.
        """
        with self._lock:
            if self.kv_manager.filling is None:
                return None
            request_id, blocks = self.kv_manager.filling
            request = self.scheduler.requests.get(request_id)
            if request is None or block_id not in blocks:
                return None
            return BlockOwner(request_id, request.tenant, request.session_id)


@dataclass(frozen=True)
class BlockOwner:
    """Who holds a block: the request, and the tenant and session it was sent with."""

    request_id: str
    tenant: str | None
    session_id: str | None


def _to_params(params: Params) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams.from_dict(params)
    raise KvtierError(f"sampling params must be SamplingParams or a dict, got {type(params)}")


def _eos_token_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_config = model_dir / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def default_namespace(model_dir: Path, dtype: str, deterministic: bool = False) -> str:
    """Model id for block keys: folder name, dtype, and a digest of the model's bytes.

    The digest (`kvtier.models.identity`: weights, adapter, config and tokenizer contents)
    keeps two models in same-named folders apart, however small their difference; the dtype
    does because their KV bytes differ. So does deterministic mode: its attention rounds
    otherwise, and a turn restored from KV the default mode wrote would not be the same bits
    as that turn recomputed.
    """
    mode = ":deterministic" if deterministic else ""
    return f"{model_dir.name}:{dtype}{mode}:{model_digest(model_dir)}"
