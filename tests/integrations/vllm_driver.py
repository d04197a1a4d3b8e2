"""Runs real vLLM (with or without the kvtier connector) through a multi-turn session and
writes what happened as JSON; tests/integrations/test_vllm_*.py read it.

It runs under .venv-vllm's python (vLLM lives in its own venv), one vLLM per process, with
the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the connector's
report is read directly from `kvtier.integrations.vllm.REGISTRY`.

    vllm_driver.py MODE --out FILE [--disk-dir DIR] [--history FILE]

MODE: `baseline` (no connector), `host` (host tier), `disk` (disk tier only): turns 1-3
with vLLM's prefix cache emptied (`reset_prefix_cache()`) before each resumed turn, then a
fourth after a flood that evicts the session from vLLM's small KV space. `disk-resume`:
turn 3 of `--history`'s session in a fresh process whose disk tier is `--disk-dir` (the
`disk` run's), then every record there corrupted and turn 3 again. `redis`: a Redis tier
only (a redis-server this script starts on `--redis-port`): turns 1-2, then the server is
stopped and turn 3 runs. `hints`: a host tier; two sessions' turns sent with session hints in
`kv_transfer_params["kvtier_session"]` (one of them invalid), then what the connector's
retention policy sees of each session. `load-control`: a host tier with `restore = "plan"`
and a cost profile whose full planner would recompute a front and load the back (which vLLM
cannot take): turn 1, turn 2 sent with `kv_load_tiers: []`, turn 3 as it comes, vLLM's prefix
cache emptied before each resumed turn; then turn 3 again after
`reset_prefix_cache(reset_connector=True)`. `events`: vLLM's KV events on, published over
ZMQ to a SUB socket this process binds on a free loopback port (vLLM's publisher connects);
a host tier of 3 chunks over a disk tier of 4: turns 1-3, the flood and turn 4 make the
host demote and the disk drop; then the events received, what each tier holds (as token
ids) and the store's moves. `pressure`: vLLM runs one request at a time (`max_num_seqs=1`) and
the policy (`offload`) has a timer of an hour: session A's turn (pinned by its hint), then
session B's, then three other prompts at once, two of which wait while vLLM's free blocks
not holding a paused session's KV are fewer than the head needs; then A's and B's second
turns. `pressure-baseline`: the same with vLLM alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import socket
import subprocess
import time
from pathlib import Path

BLOCKS = 24  # vLLM's KV space in 128-token blocks: a 2,400-token flood evicts the session
FLOOD_TOKENS = 2400
MAX_TOKENS = 16
EXTRA_TOKENS = (600, 150, 150, 150)  # new user tokens of turns 1-4
# one 128-token chunk of the embedded model in float32: 30 layers x K,V x 3 heads x 64 x 4 B
CHUNK_BYTES = 128 * 30 * 2 * 3 * 64 * 4


def user_tokens(turn: int) -> list[int]:
    rng = random.Random(f"kvtier-vllm-turn-{turn}")
    return [rng.randrange(100, 49152) for _ in range(EXTRA_TOKENS[turn])]


def flood_tokens() -> list[int]:
    rng = random.Random("kvtier-vllm-flood")
    return [rng.randrange(100, 49152) for _ in range(FLOOD_TOKENS)]


def tiers_config(mode: str, disk_dir: str | None, remote_url: str | None) -> dict | None:
    if mode in ("baseline", "pressure-baseline"):
        return None
    tiers: dict = {"chunk_tokens": 128}
    # the LRU cascade: under vLLM's pressure a paused session's chunks move down to a tier
    # that holds them (`retain` would drop them there, as it does in kvtier's own engine)
    policy: dict = {"name": "offload"}
    if mode in ("host", "hints"):
        tiers["host_bytes"] = "256MiB"
    elif mode == "load-control":
        tiers.update(host_bytes="256MiB", restore="plan")
        # a link slow enough that recomputing the cheap front while the back loads would beat
        # loading everything, and loading everything still beats recomputing everything
        policy["profile"] = {
            "prefill_fixed_s": 0.0,
            "prefill_token_s": 8e-5,
            "prefill_pair_s": 2e-7,
            "links": {"host": {"bandwidth": 5e8}},
        }
    elif mode == "pressure":
        tiers["host_bytes"] = "256MiB"
        policy["interval_s"] = 3600
    elif mode == "events":
        tiers.update(host_bytes=3 * CHUNK_BYTES + 4096, disk_dir=disk_dir)
        tiers["disk_bytes"] = 4 * CHUNK_BYTES + (256 << 10)  # records carry a small header
    elif mode == "redis":
        # a generous read timeout: the test counts tokens loaded, and a loaded CI machine once
        # took over the 0.25 s default for a loopback read (the fallback is recompute)
        tiers.update(
            host_bytes=0, remote_url=remote_url, remote_bytes="512MiB", remote_timeout_s=5.0
        )
    else:
        tiers.update(host_bytes=0, disk_dir=disk_dir, disk_bytes="1GiB")
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"tiers": tiers, "policy": policy},
    }


class EventSubscriber:
    """vLLM's KV event stream, decoded on its own thread: a SUB socket bound to a free loopback
    port (`endpoint`), which vLLM's publisher connects to, as a router's indexer would."""

    def __init__(self) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.events: list[dict] = []
        self.last_received = time.monotonic()
        self._running = True
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        import zmq

        while self._running:
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            for event in self._decode(payload).events:
                self.events.append({"type": type(event).__name__, **as_dict(event)})
            self.last_received = time.monotonic()

    def settle(self, quiet_s: float = 2.0, limit_s: float = 30.0) -> None:
        """Wait until nothing has arrived for `quiet_s`."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() - self.last_received < quiet_s and time.monotonic() < deadline:
            time.sleep(0.1)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._socket.close(linger=0)


def as_dict(event) -> dict:
    out = {}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, list):
            value = [v.hex() if isinstance(v, bytes) else v for v in value]
        out[name] = value
    return out


def tier_contents(sequences: list[list[int]]) -> dict[str, list[list[int]]]:
    """Each tier's chunks as their token ids, from the token sequences this run sent: kvtier's
    chunk ids of every full chunk of each sequence, matched against the store's index."""
    from kvtier.integrations.vllm import REGISTRY
    from kvtier.integrations.vllm.requests import RequestRecord, RequestView
    from kvtier.tiers import chunk_id

    engine = REGISTRY.all()[0]
    per_chunk = engine.connector.blocks_per_chunk
    tokens_of: dict[bytes, list[int]] = {}
    for tokens in sequences:
        view = RequestView(RequestRecord("seq", tokens, len(tokens)), engine.model, None, None)
        keys = view.keys_of_full_blocks(engine.block_size)
        span = per_chunk * engine.block_size
        for start in range(0, len(keys) - per_chunk + 1, per_chunk):
            first = start * engine.block_size
            tokens_of[chunk_id(keys[start : start + per_chunk])] = tokens[first : first + span]
    store = engine.connector.store
    return {tier: [tokens_of.get(cid) for cid in store.chunks_in(tier)] for tier in store.order}


def events_run(llm, subscriber: EventSubscriber) -> dict:
    """Turns 1-3, the flood, turn 4; then the settled tiers and the events about them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import REGISTRY

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sequences: list[list[int]] = []

    def send(prompt: list[int]) -> list[int]:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)
        output = list(out.outputs[0].token_ids)
        sequences.append(prompt + output)
        return output

    prompt = user_tokens(0)
    for index in range(3):
        if index:
            llm.reset_prefix_cache()
        prompt = prompt + send(prompt) + user_tokens(index + 1)
    send(flood_tokens())
    send(prompt)
    engine = REGISTRY.all()[0]
    engine.flush(30)
    # the last writes' placements leave with the next step: one short request drives it
    tick = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=[7, 8, 9])], tick, use_tqdm=False)
    subscriber.settle()
    subscriber.close()
    stats = engine.stats()
    return {
        "events": subscriber.events,
        "held": tier_contents(sequences),
        "moves": {name: move["ops"] for name, move in stats["moves"].items()},
        "counters": stats["counters"],
    }


def report() -> dict:
    from kvtier.integrations.vllm import REGISTRY

    engines = REGISTRY.all()
    if not engines:
        return {}
    engines[0].flush(30)
    return engines[0].stats()


def delta(before: dict, after: dict) -> dict:
    if not after:
        return {}
    keys = ("tokens", "counters")
    out = {}
    for key in keys:
        old = before.get(key, {})
        out[key] = {k: v - old.get(k, 0) for k, v in after[key].items() if v - old.get(k, 0)}
    out["tier_errors"] = sum(t.get("errors", 0) for t in after["tiers"].values()) - sum(
        t.get("errors", 0) for t in before.get("tiers", {}).values()
    )
    return out


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def hinted_sessions(llm) -> dict:
    """Turns with session hints in kv_transfer_params, then the policy's view of each session
    and the connector's warnings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import REGISTRY

    warnings = Warnings()
    logging.getLogger("kvtier.integrations.vllm").addHandler(warnings)
    sent = [
        ("agent-1", {"priority": 3, "pin": True, "expect_return_s": 30}),
        ("agent-2", {"priority": 99}),  # out of range: ignored, with a warning
        ("agent-1", {"close": True}),
    ]
    prompt: dict[str, list[int]] = {}
    for index, (session, hints) in enumerate(sent):
        prompt[session] = prompt.get(session, []) + user_tokens(index)[:200]
        params = SamplingParams(
            temperature=0,
            max_tokens=4,
            ignore_eos=True,
            extra_args={"kv_transfer_params": {"session_id": session, "kvtier_session": hints}},
        )
        prompts = [TokensPrompt(prompt_token_ids=prompt[session])]
        (out,) = llm.generate(prompts, params, use_tqdm=False)
        prompt[session] += list(out.outputs[0].token_ids)
    tiers = REGISTRY.all()[0]
    with tiers.lock:
        view = tiers.connector.runner.view()
    seen = {
        s.session_id: {
            "hints": dataclasses.asdict(s.hints),
            "pinned": s.pinned,
            "priority": s.priority,
            "turns": len(s.turns),
        }
        for s in view.sessions
    }
    return {"sessions": seen, "warnings": warnings.messages}


PRESSURE_OTHER_TOKENS = 900  # 8 blocks each: the head's need passes the blocks left free


def under_pressure(llm, turn) -> dict:
    """Paused sessions A (pinned) and B on vLLM's device, a queue that needs their blocks, then
    their second turns; the policy's runs and what its view showed of the device before."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm import REGISTRY

    prompts = {"A": user_tokens(0), "B": user_tokens(0)[::-1]}
    hints = {"A": {"pin": True}, "B": {}}
    for session, prompt in prompts.items():
        transfer = {"session_id": session, "kvtier_session": hints[session]}
        output = turn(prompt, f"{session}: turn 1", transfer)
        prompts[session] = prompt + output + user_tokens(1)[:100]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # B's finish reaches the worker with the next step: a 3-token request drives one
    llm.generate([TokensPrompt(prompt_token_ids=[7, 8, 9])], greedy, use_tqdm=False)
    on_device = {}
    for engine in REGISTRY.all():  # none for vLLM alone
        with engine.lock:
            view = engine.connector.runner.view()
        on_device = {
            s.session_id: sum(1 for c in s.chunks if c.tier == "device") for s in view.sessions
        }
    rng = random.Random("kvtier-vllm-pressure")
    others = [[rng.randrange(100, 49152) for _ in range(PRESSURE_OTHER_TOKENS)] for _ in range(3)]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in others], greedy, use_tqdm=False)
    queued = report()
    for session in ("A", "B"):
        turn(prompts[session], f"{session}: turn 2", {"session_id": session})
    if on_device:
        llm.reset_prefix_cache()
        turn(prompts["B"], "B: turn 2 recomputed", {"session_id": "B", "kv_load_tiers": []})
    return {"device_chunks_before": on_device, "after_queue": queued}


def corrupt(folder: Path) -> int:
    """Flip a byte every 256 KiB of every file: each record's body (MBs) is hit."""
    flipped = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = bytearray(path.read_bytes())
        for offset in range(4096, len(data), 256 << 10):
            data[offset] ^= 0xFF
            flipped += 1
        path.write_bytes(bytes(data))
    return flipped


def start_redis(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"redis-server on port {port} did not answer in 30 s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=(
            "baseline",
            "host",
            "disk",
            "disk-resume",
            "redis",
            "hints",
            "load-control",
            "events",
            "pressure",
            "pressure-baseline",
        ),
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--disk-dir")
    parser.add_argument("--history", type=Path)
    parser.add_argument("--redis-port", type=int)
    args = parser.parse_args()
    redis = remote_url = None
    if args.mode == "redis":
        redis = start_redis(args.redis_port)
        remote_url = f"redis://127.0.0.1:{args.redis_port}/0"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.models.embedded import ensure_embedded_model

    events_config = None
    subscriber = None
    if args.mode == "events":
        from vllm.config import KVEventsConfig

        subscriber = EventSubscriber()
        events_config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=subscriber.endpoint
        )
    started = time.perf_counter()
    llm = LLM(
        model=str(ensure_embedded_model()),
        dtype="float32",  # bf16 prefix-hit and recompute paths differ on this model
        max_model_len=(BLOCKS - 1) * 128,  # vLLM keeps one block back
        num_gpu_blocks_override=BLOCKS,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        # what the connector makes vLLM do anyway: the same KV manager in every mode
        disable_hybrid_kv_cache_manager=True,
        kv_transfer_config=tiers_config(args.mode, args.disk_dir, remote_url),
        kv_events_config=events_config,
        # one request at a time: the others wait in vLLM's queue (the pressure scenario)
        **({"max_num_seqs": 1} if args.mode.startswith("pressure") else {}),
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result: dict = {"mode": args.mode, "load_s": time.perf_counter() - started, "turns": []}

    def turn(prompt: list[int], note: str, transfer: dict | None = None) -> list[int]:
        before = report()
        t0 = time.perf_counter()
        params = greedy
        if transfer is not None:
            params = SamplingParams(
                temperature=0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                extra_args={"kv_transfer_params": transfer},
            )
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        output = list(out[0].outputs[0].token_ids)
        result["turns"].append(
            {
                "note": note,
                "prompt_tokens": len(prompt),
                "output": output,
                "seconds": time.perf_counter() - t0,
                "vllm_cached_tokens": out[0].num_cached_tokens,  # vLLM's own and the connector's
                **delta(before, report()),
            }
        )
        return output

    if args.mode == "hints":
        result.update(hinted_sessions(llm))
    elif args.mode.startswith("pressure"):
        result.update(under_pressure(llm, turn))
    elif subscriber is not None:
        result.update(events_run(llm, subscriber))
    elif args.mode == "disk-resume":
        history = json.loads(args.history.read_text())["turns"]
        prompt = user_tokens(0) + history[0]["output"] + user_tokens(1)
        prompt += history[1]["output"] + user_tokens(2)
        turn(prompt, "turn 3 in a new process")
        result["flipped_bytes"] = corrupt(Path(args.disk_dir))
        llm.reset_prefix_cache()
        turn(prompt, "turn 3 from corrupted records")
    elif args.mode == "load-control":
        prompt = user_tokens(0)
        for index, transfer in enumerate((None, {"kv_load_tiers": []}, None)):
            if index:
                llm.reset_prefix_cache()
            third = prompt
            output = turn(prompt, f"turn {index + 1}", transfer)
            prompt = prompt + output + user_tokens(index + 1)
        # as after a weight update: vLLM's cache and the connector's both emptied
        result["reset_ok"] = llm.reset_prefix_cache(reset_connector=True)
        turn(third, "turn 3 again after a reset of the connector")
    elif redis is not None:
        prompt = user_tokens(0)
        for index in range(3):
            if index:
                llm.reset_prefix_cache()
            if index == 2:
                redis.terminate()
                redis.wait(timeout=30)
            output = turn(prompt, f"turn {index + 1}")
            prompt = prompt + output + user_tokens(index + 1)
    else:
        prompt = user_tokens(0)
        for index in range(3):
            if index:
                llm.reset_prefix_cache()
            output = turn(prompt, f"turn {index + 1}")
            prompt = prompt + output + user_tokens(index + 1)
        turn(flood_tokens(), "flood")
        turn(prompt, "turn 4 after the flood")
    result["report"] = report()
    args.out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
