"""Answers through `kvtier serve`, restored, batched or after a crash, against the same turns
on a server without tiers: how many differ, in the default mode and in deterministic mode.

Every scenario holds the same conversations (`--sessions` sessions, `--rounds` turns each,
greedy, `--answer-tokens` an answer) on the embedded model in bf16, with a device pool too
small for them all (`--pool-blocks`, 48 blocks of 16 tokens), so paused sessions leave the
device between their turns:

- reference: no tiers, one turn at a time; each resumed turn recomputes its history;
- host: a host tier; each round's turns sent together, so they share steps;
- disk: a disk tier written through; the server killed (SIGKILL) and restarted after every
  round;
- redis: a Redis tier written through; killed and restarted after every round;
- replicas: two replicas sharing Redis behind nginx (deploy/nginx/kvtier.conf); after the
  first round the replica that served the most is killed.

Each turn's prompt holds the reference's earlier answers, so every answer is compared with
the reference's answer to the same prompt. Needs redis-server and nginx on PATH.

    .venv/bin/python benchmarks/deterministic_serve.py --out out/deterministic_serve.json \
        [--modes default deterministic] [--sessions 6] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from local_nginx import start_nginx
from local_redis import start_redis
from serve_child import start_serve

TEXT = Path(__file__).resolve().parents[1] / "src/kvtier/data/text"
BLOCK_BYTES = 368_640  # SmolLM2, bf16, 16 tokens
COMMON = ["--max-num-seqs", "4", "--threads", "2", "--log-level", "warning"]
COMMON += ["--tiers-set", "chunk_tokens=32"]
# Waited before a kill: long enough for write-through to land the round's chunks (what it
# has not written is recomputed, which the comparison covers as well).
WRITE_THROUGH_S = 2.0
FOLLOW_UPS = ["Go on.", "Say that again in other words.", "Why?", "Give an example.", "And then?"]

Flags = list[str]


def openers(count: int) -> list[str]:
    texts = sorted(TEXT.glob("*.txt"))
    return [
        "Read this and answer briefly. "
        + " ".join(texts[i % len(texts)].read_text().split()[40 * (i // len(texts)) :][:110])
        for i in range(count)
    ]


def messages(opener: str, answers: list[str]) -> list[dict[str, str]]:
    """A session's prompt after `answers` (the reference's earlier answers)."""
    said = [{"role": "user", "content": opener}]
    for turn, answer in enumerate(answers):
        said.append({"role": "assistant", "content": answer})
        said.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})
    return said


def ask(
    base_url: str, session: str, said: list[dict[str, str]], tokens: int
) -> tuple[str, dict[str, int]]:
    """(answer, prompt token sources) of one greedy turn of `tokens` tokens."""
    reply = httpx.post(
        base_url + "/v1/chat/completions",
        json={
            "model": "smollm2",
            "messages": said,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers={"X-Session-ID": session},
        timeout=600,
    )
    reply.raise_for_status()
    body = reply.json()
    return body["choices"][0]["message"]["content"], body["usage"]["kvtier"]["prompt_token_sources"]


class Servers:
    """The servers of one scenario: started with the same flags, killed and restarted."""

    def __init__(self, work: Path, flags: Flags, count: int = 1) -> None:
        self.work, self.flags = work, flags
        self.started = [start_serve(flags, work / f"serve-{i}-0.log") for i in range(count)]
        self.restarts = 0

    def kill(self, index: int) -> None:
        self.started[index][1].send_signal(signal.SIGKILL)
        self.started[index][1].wait()

    def restart_all(self) -> None:
        self.restarts += 1
        for i in range(len(self.started)):
            self.kill(i)
            self.started[i] = start_serve(self.flags, self.work / f"serve-{i}-{self.restarts}.log")

    def served_most(self) -> int:
        """The replica that has computed or restored the most prompt tokens."""
        counts = []
        for url, _ in self.started:
            text = httpx.get(url + "/metrics", timeout=10).text
            counts.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("kvtier:prompt_tokens_total")
                )
            )
        return counts.index(max(counts))


def run_rounds(
    base_url: Callable[[], str],
    sessions: list[str],
    reference: list[list[str]] | None,
    rounds: int,
    together: bool,
    between: Callable[[int], None],
    tokens: int,
) -> tuple[list[list[str]], dict[str, int]]:
    """Every session's turns, round by round: prompts from the reference's answers (or, for
    the reference itself, its own). Returns the answers and the summed token sources."""
    answers: list[list[str]] = [[] for _ in sessions]
    sources: dict[str, int] = {}

    def turn(index: int, round_: int) -> None:
        earlier = (reference or answers)[index][:round_]
        text, used = ask(base_url(), f"s{index}", messages(sessions[index], earlier), tokens)
        answers[index].append(text)
        for source, count in used.items():
            sources[source] = sources.get(source, 0) + count

    for round_ in range(rounds):
        if together:
            with ThreadPoolExecutor(len(sessions)) as pool:
                list(pool.map(lambda i, r=round_: turn(i, r), range(len(sessions))))
        else:
            for index in range(len(sessions)):
                turn(index, round_)
        if round_ < rounds - 1:
            between(round_)
    return answers, sources


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scenario(
    name: str, work: Path, mode: Flags, sessions: list[str], reference, args: argparse.Namespace
) -> tuple[list[list[str]], dict[str, int]]:
    work.mkdir(parents=True)
    redis = nginx = None
    pool = ["--kv-cache-bytes", str(args.pool_blocks * BLOCK_BYTES)]
    flags = [*COMMON, *pool, *mode]
    if name in ("redis", "replicas"):
        redis, url = start_redis(work)
        flags += ["--host-bytes", "0", "--remote-url", url, "--remote-bytes", "128MiB"]
        flags += ["--write-through", "--tiers-set", "remote_timeout_s=10"]
        flags += ["--encrypt-key-file", str(work / "master.key"), "--create-key"]
    elif name == "disk":
        flags += ["--host-bytes", "0", "--disk-dir", str(work / "kv"), "--disk-bytes", "256MiB"]
        flags += ["--write-through"]
    elif name == "host":
        flags += ["--host-bytes", "256MiB"]
    else:
        flags += ["--host-bytes", "0"]
    # replicas start one after the other: the first creates the key file the second reads
    servers = Servers(work, flags, count=2 if name == "replicas" else 1)
    try:
        base = ""
        if name == "replicas":
            port = free_port()
            replicas = [url.removeprefix("http://") for url, _ in servers.started]
            nginx = start_nginx(work / "nginx", replicas, port)
            base = f"http://127.0.0.1:{port}"

        def between(round_: int) -> None:
            if name != "host":
                time.sleep(WRITE_THROUGH_S)
            if name in ("disk", "redis"):
                servers.restart_all()
            elif name == "replicas" and round_ == 0:
                servers.kill(servers.served_most())

        return run_rounds(
            lambda: base if name == "replicas" else servers.started[0][0],
            sessions,
            reference,
            args.rounds,
            together=name != "reference",
            between=between,
            tokens=args.answer_tokens,
        )
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(timeout=10)
        for _, process in servers.started:
            if process.poll() is None:
                process.kill()
                process.wait()
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=10)


SCENARIOS = ("host", "disk", "redis", "replicas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/deterministic_serve.json"))
    parser.add_argument("--modes", nargs="+", default=["default", "deterministic"])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument(
        "--pool-blocks", type=int, default=48, help="device KV pool, in blocks of 16 tokens"
    )
    args = parser.parse_args()
    sessions = openers(args.sessions)
    started = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-deterministic-") as tmp:
        for mode in args.modes:
            flags = ["--deterministic"] if mode == "deterministic" else ["--no-deterministic"]
            work = Path(tmp) / mode
            reference, _ = scenario("reference", work / "reference", flags, sessions, None, args)
            results[mode] = {}
            for name in args.scenarios:
                answers, sources = scenario(name, work / name, flags, sessions, reference, args)
                differing = [
                    (s, r)
                    for s in range(len(sessions))
                    for r in range(args.rounds)
                    if answers[s][r] != reference[s][r]
                ]
                results[mode][name] = {
                    "answers": len(sessions) * args.rounds,
                    "differing": len(differing),
                    "differing_turns": differing,
                    "prompt_token_sources": sources,
                }
                print(
                    f"{mode:13} {name:9} {len(differing):3} of {len(sessions) * args.rounds} "
                    f"differ; sources {sources}",
                    flush=True,
                )
    report = {
        "command": " ".join(sys.argv),
        "host": platform.processor() or platform.machine(),
        "wall_s": time.perf_counter() - started,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
