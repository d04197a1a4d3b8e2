"""Replay a multi-turn workload against a running OpenAI-compatible server, over HTTP.

The HTTP twin of `replay.py`: the same requests, prompts, turn timing and records, so `kvtier
bench --server URL` writes the report an engine run writes, with the same field names.

- Turns are sent as `replay.py` sends them: a session's first turn (and any turn without a
  think time) at its trace time, a closed-loop turn its think time after the previous answer
  really finished. Sessions run concurrently (asyncio, one HTTP/1.1 connection per request in
  flight). There is no idle skip: the server's clock is the wall clock, so trace time is wall
  time, and a workload with minutes between turns takes minutes.
- Each turn carries `X-Session-ID: <session id>` (and `Authorization: Bearer <key>` with an
  API key: the server picks the tenant from the key). Text workloads are sent as chat messages
  to `/v1/chat/completions` (the server applies the chat template the engine replay applies),
  with the answers the server really gave resent as history; length-only traces as the engine
  replay's synthetic token ids to `/v1/completions`.
- A tool loop (a chat session whose workload says some replies are tool calls) is sent as an
  agent sends it (`tool_loop.py`): `tools`, `tool_choice` naming the tool on a turn that ends
  in a call, the calls in the history and the tools' results as `tool` messages. A turn's
  session hints go in the body's `kvtier_session`.
- Responses are streamed (SSE): the first chunk that carries text or a tool call is the first
  token, the gaps between such chunks are the inter-token latencies (a server that holds a
  call back until it is whole sends it in one chunk). Greedy, `ignore_eos`, answers as long as
  the workload says.
- Where the history came from is the server's usage: `usage.kvtier.prompt_token_sources`
  (device / host / disk / remote), or, from a server without the kvtier extension,
  `usage.prompt_tokens_details.cached_tokens` as device hits. `recomputed` is the session's
  earlier prompt + answer (in full blocks) that no source supplied, as in `replay.py`.
- Turn kinds are the client's view with the engine's rule: `continuing` when sent within
  `resume_after_s` of the session's previous answer, `resumed` later.

A request that fails (connection error, an HTTP error, an error event in the stream) is
recorded as failed with the reason, and the replay goes on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from kvtier.bench.replay import (
    ReplayResult,
    chat_messages,
    common_prefix,
    history_sources,
    synthetic_token_ids,
)
from kvtier.bench.tool_loop import (
    assistant_message,
    calls_tools,
    tool_choice,
    tool_definitions,
    tool_messages,
)
from kvtier.errors import KvtierError
from kvtier.results.records import RequestRecord, RunRecords, TurnKind

if TYPE_CHECKING:
    from kvtier.workload.model import Request

# `kvtier serve` has no block-size setting: its engine always pages KV in blocks of 16 tokens
# (EngineConfig.block_size), and only full blocks are ever cached.
SERVER_BLOCK_TOKENS = 16
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 600.0  # a long prefill on a busy CPU server is slow, not dead


@dataclass(frozen=True)
class Server:
    """A server that answered: its base URL (no `/v1`), the model id it serves, the API key."""

    base_url: str
    model: str
    api_key: str | None = None

    def headers(self, session_id: str | None = None) -> dict[str, str]:
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if session_id is not None:
            headers["X-Session-ID"] = session_id
        return headers


def connect(url: str, api_key: str | None = None) -> Server:
    """Check that `url` is an OpenAI-compatible server that generates, before any replay:
    `/v1/models` names its model, and one short completion (no session) comes back, which
    also warms the server up as `replay.warm_up` warms the engine. Raises KvtierError."""
    base = url.rstrip("/")
    base = base.removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        raise KvtierError(f"--server takes an http:// or https:// URL, got {url!r}")
    probe = Server(base, "", api_key)
    try:
        with httpx.Client(timeout=CONNECT_TIMEOUT_S) as client:
            response = client.get(base + "/v1/models", headers=probe.headers())
            _check_status(response, base + "/v1/models")
            models = response.json().get("data") or []
            if not models or "id" not in models[0]:
                raise KvtierError(f"{base}/v1/models lists no model")
            server = Server(base, str(models[0]["id"]), api_key)
            body = {"model": server.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
            warm = client.post(
                base + "/v1/completions",
                json=body,
                headers=server.headers(),
                timeout=REQUEST_TIMEOUT_S,
            )
            _check_status(warm, base + "/v1/completions")
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise KvtierError(f"cannot reach the server at {base}: {reason}") from None
    except ValueError as exc:  # a body that is not JSON: not an OpenAI-compatible server
        raise KvtierError(f"{base} did not answer as an OpenAI-compatible server: {exc}") from None
    return server


def _check_status(response: httpx.Response, what: str) -> None:
    if response.status_code != 200:
        raise KvtierError(f"{what} answered {response.status_code}: {_error_text(response.text)}")


def _error_text(body: str) -> str:
    """The message of an OpenAI error body, else the body's first 200 characters."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(body.split())[:200]


@dataclass
class _Session:
    """What the client remembers of a session: its last finished turn, as `replay.py` keeps
    `session_tokens`, and the answers it got (resent as history)."""

    answers: dict[int, str] = field(default_factory=dict)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # the server's tool calls
    last_finish_s: float | None = None
    last_messages: list[dict[str, Any]] | None = None
    last_token_ids: list[int] | None = None
    last_total_tokens: int = 0  # prompt + answer tokens of the last finished turn


@dataclass
class _Stream:
    """What one streamed response delivered."""

    token_times: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: Mapping[str, Any] | None = None
    error: str | None = None


def replay_server(
    server: Server,
    requests: Sequence[Request],
    label: str,
    *,
    resume_after_s: float = 30.0,
    max_output_tokens: int | None = None,
    vocab_size: int | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> ReplayResult:
    """Replay `requests` (e.g. `workload.flatten(...)`) against `server`; the run is named
    `label`. `vocab_size` is needed for length-only traces (synthetic token ids)."""
    driver = _Driver(server, requests, resume_after_s, max_output_tokens, vocab_size, on_finish)
    return asyncio.run(driver.run(label))


class _Driver:
    def __init__(
        self,
        server: Server,
        requests: Sequence[Request],
        resume_after_s: float,
        max_output_tokens: int | None,
        vocab_size: int | None,
        on_finish: Callable[[RequestRecord], None] | None,
    ) -> None:
        if any(not r.messages for r in requests) and vocab_size is None:
            raise KvtierError("a length-only trace needs the model's vocabulary size")
        self.server = server
        self.resume_after_s = resume_after_s
        self.max_output_tokens = max_output_tokens
        self.vocab_size = vocab_size or 0
        self.on_finish = on_finish
        self.origin = min((r.arrival_s for r in requests), default=0.0)
        by_session: dict[str, list[Request]] = {}
        for request in sorted(requests, key=lambda r: (r.session_id, r.turn_index)):
            by_session.setdefault(request.session_id, []).append(request)
        self.order = itertools.count()
        self.due: list[tuple[float, int, Request]] = []  # (send time, tie-break, request)
        for turns in by_session.values():
            for k, request in enumerate(turns):
                if k == 0 or request.think_s is None:
                    self._push(request.arrival_s - self.origin, request)
        # the closed-loop follower of each turn: sent think_s after that turn really finished
        self.next_turn = {
            r.request_id: turns[k + 1]
            for turns in by_session.values()
            for k, r in enumerate(turns[:-1])
            if turns[k + 1].think_s is not None
        }
        self.sessions = {session: _Session() for session in by_session}
        self.turns = by_session
        self.loops = {session for session, turns in by_session.items() if calls_tools(turns)}
        self.tools = tool_definitions(requests)
        self.records: list[RequestRecord] = []
        self.started = 0.0

    def _push(self, send_at: float, request: Request) -> None:
        heapq.heappush(self.due, (send_at, next(self.order), request))

    def now(self) -> float:
        return time.perf_counter() - self.started

    async def run(self, label: str) -> ReplayResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        pending: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            self.started = time.perf_counter()
            while self.due or pending:
                now = self.now()
                while self.due and self.due[0][0] <= now:
                    send_at, _, request = heapq.heappop(self.due)
                    pending.add(asyncio.create_task(self._turn(client, send_at, request)))
                wait_s = max(0.0, self.due[0][0] - now) if self.due else None
                if pending:
                    # a finished turn may have scheduled its follower: look at the queue again
                    done, pending = await asyncio.wait(
                        pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                    )
                    for task in done:
                        task.result()  # a bug in the driver surfaces; request errors are records
                elif wait_s is not None:
                    await asyncio.sleep(wait_s)
        wall_s = self.now()
        self.records.sort(key=lambda r: (r.arrival_s, r.request_id))
        end = max((r.finish_s or r.arrival_s for r in self.records), default=0.0)
        run = RunRecords(policy=label, duration_s=end, requests=self.records)
        return ReplayResult(run=run, wall_s=wall_s, trace_s=wall_s, skipped_s=0.0)

    async def _turn(self, client: httpx.AsyncClient, send_at: float, request: Request) -> None:
        session = self.sessions[request.session_id]
        record = RequestRecord(
            request_id=request.request_id,
            session_id=request.session_id,
            tenant=request.tenant,
            turn_index=request.turn_index,
            turn_kind=self._turn_kind(session, send_at),
            arrival_s=send_at,
            prompt_tokens=request.prompt_tokens,
            output_tokens=0,
        )
        path, body, history = self._body(request, session)
        stream = await self._send(client, path, body, request.session_id)
        finish_s = self.now()
        self._fill(record, stream, history, finish_s)
        if not record.failed:
            self._remember(session, request, body, stream, finish_s)
        self.records.append(record)
        if self.on_finish is not None:
            self.on_finish(record)
        follower = self.next_turn.get(request.request_id)
        if follower is not None:
            self._push(finish_s + (follower.think_s or 0.0), follower)

    def _turn_kind(self, session: _Session, send_at: float) -> TurnKind:
        """The engine's SessionTracker rule, on the client's clock."""
        if session.last_finish_s is None:
            return "new"
        return "continuing" if send_at - session.last_finish_s <= self.resume_after_s else "resumed"

    def _body(self, request: Request, session: _Session) -> tuple[str, dict[str, Any], int]:
        """The endpoint, the JSON body, and the history this session computed before (tokens
        in full blocks; 0 when the client cannot tell, e.g. the oldest turns were dropped)."""
        max_tokens = request.output_tokens
        if self.max_output_tokens is not None:
            max_tokens = min(max_tokens, self.max_output_tokens)
        body: dict[str, Any] = {
            "model": self.server.model,
            "max_tokens": max(1, max_tokens),
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not request.hints.empty:
            body["kvtier_session"] = request.hints.given()
        if request.session_id in self.loops:
            turns = self.turns[request.session_id]
            body["messages"] = tool_messages(request, turns, session.answers, session.calls)
            body["tools"] = self.tools
            body["tool_choice"] = tool_choice(request)
        elif request.messages:
            body["messages"] = chat_messages(request, session.answers)
        if "messages" in body:
            history = self._chat_history(session, body["messages"])
            return "/v1/chat/completions", body, history
        body["prompt"] = synthetic_token_ids(request, self.vocab_size)
        history = common_prefix(body["prompt"], session.last_token_ids or [])
        return "/v1/completions", body, _full_blocks(history)

    @staticmethod
    def _chat_history(session: _Session, messages: list[dict[str, Any]]) -> int:
        """The previous turn's prompt + answer when this prompt resends them unchanged: the
        chat template renders the earlier messages as the same leading tokens."""
        if session.last_messages is None:
            return 0
        n = len(session.last_messages)
        if len(messages) <= n or messages[:n] != session.last_messages:
            return 0
        return _full_blocks(session.last_total_tokens)

    async def _send(
        self, client: httpx.AsyncClient, path: str, body: Mapping[str, Any], session_id: str
    ) -> _Stream:
        stream = _Stream()
        url = self.server.base_url + path
        try:
            async with client.stream(
                "POST", url, json=body, headers=self.server.headers(session_id)
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    stream.error = f"HTTP {response.status_code}: {_error_text(text)}"
                    return stream
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._event(stream, json.loads(data))
        except httpx.HTTPError as exc:
            stream.error = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:
            stream.error = f"bad event in the stream: {exc}"
        return stream

    def _event(self, stream: _Stream, event: Mapping[str, Any]) -> None:
        if "error" in event:
            stream.error = _error_text(json.dumps(event))
            return
        if event.get("usage"):
            stream.usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            if text or calls:
                stream.token_times.append(self.now())
            if text:
                stream.text.append(text)
            for call in calls or ():  # each whole, as kvtier serve sends them
                stream.tool_calls.append({k: v for k, v in call.items() if k != "index"})

    def _fill(self, record: RequestRecord, stream: _Stream, history: int, finish_s: float) -> None:
        times = stream.token_times
        usage = stream.usage or {}
        record.finish_s = finish_s
        record.output_tokens = int(usage.get("completion_tokens") or len(times))
        record.prompt_tokens = int(usage.get("prompt_tokens") or record.prompt_tokens)
        if times:
            record.first_token_s = times[0]
            record.itl_s = [b - a for a, b in itertools.pairwise(times)]
            record.max_itl_s = max(record.itl_s) if record.itl_s else None
        if stream.error is None and not times:
            stream.error = "the stream ended without a token"
        if stream.error is not None:
            record.failed, record.error = True, stream.error
            return
        record.restored_tokens = history_sources(_sources(usage), history)

    @staticmethod
    def _remember(
        session: _Session,
        request: Request,
        body: Mapping[str, Any],
        stream: _Stream,
        finish_s: float,
    ) -> None:
        usage = stream.usage or {}
        answer = "".join(stream.text)
        session.answers[request.turn_index] = answer
        session.last_finish_s = finish_s
        prompt = int(usage.get("prompt_tokens") or 0)
        session.last_total_tokens = prompt + int(usage.get("completion_tokens") or 0)
        if "messages" in body:
            reply: dict[str, Any] = {"role": "assistant", "content": answer}
            if "tools" in body:
                if stream.tool_calls:
                    session.calls[request.turn_index] = stream.tool_calls[0]
                call = session.calls.get(request.turn_index)
                reply = assistant_message(request, answer, call)
                if request.end == "tool_call" and call is None:
                    # the history resends the workload's call, not the reply the server
                    # computed: of this turn, only its prompt is history
                    session.last_total_tokens = prompt
            session.last_messages = [*body["messages"], reply]
        else:
            session.last_token_ids = list(body["prompt"])


def _sources(usage: Mapping[str, Any]) -> dict[str, int]:
    """Prompt tokens by source from the usage: kvtier's split, else OpenAI's cached tokens
    (a server without the extension: counted as device hits)."""
    extension = usage.get("kvtier")
    if isinstance(extension, dict) and isinstance(extension.get("prompt_token_sources"), dict):
        return {k: int(v) for k, v in extension["prompt_token_sources"].items()}
    details = usage.get("prompt_tokens_details") or {}
    return {"device": int(details.get("cached_tokens") or 0)}


def _full_blocks(tokens: int) -> int:
    return tokens // SERVER_BLOCK_TOKENS * SERVER_BLOCK_TOKENS
