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
cache emptied before each resumed turn.
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


def user_tokens(turn: int) -> list[int]:
    rng = random.Random(f"kvtier-vllm-turn-{turn}")
    return [rng.randrange(100, 49152) for _ in range(EXTRA_TOKENS[turn])]


def flood_tokens() -> list[int]:
    rng = random.Random("kvtier-vllm-flood")
    return [rng.randrange(100, 49152) for _ in range(FLOOD_TOKENS)]


def tiers_config(mode: str, disk_dir: str | None, remote_url: str | None) -> dict | None:
    if mode == "baseline":
        return None
    tiers: dict = {"chunk_tokens": 128}
    policy: dict = {"name": "retain"}
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
        choices=("baseline", "host", "disk", "disk-resume", "redis", "hints", "load-control"),
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
                **delta(before, report()),
            }
        )
        return output

    if args.mode == "hints":
        result.update(hinted_sessions(llm))
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
            output = turn(prompt, f"turn {index + 1}", transfer)
            prompt = prompt + output + user_tokens(index + 1)
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
