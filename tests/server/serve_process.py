"""`kvtier serve` as a child process on a loopback port, and the conversation the tier tests
hold with it: one session's first turn, two other sessions that push it out of a device pool
of 16 blocks, then the first session's second turn."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI

from tests.host_dtype import BLOCK_BYTES

BIN = Path(sys.executable).parent
TEXT = Path(__file__).resolve().parents[2] / "src/kvtier/data/text"
# Small enough that two other sessions push an idle one out: 16 blocks = 256 tokens; each
# turn here holds about 10.
SMALL_POOL = [
    "--threads",
    "1",
    "--kv-cache-bytes",
    str(16 * BLOCK_BYTES),
    "--max-num-seqs",
    "2",
    "--log-level",
    "warning",
    "--tiers-set",
    "chunk_tokens=32",
]
MAX_TOKENS = 8


def _words(name: str, count: int) -> str:
    return " ".join((TEXT / name).read_text().split()[:count])


FIRST = "Summarise this speech in one line. " + _words("gettysburg_address.txt", 90)
SECOND = "Now say who gave it."
FLOODS = [
    "Who wrote this? " + _words("novel_openings.txt", 100),
    "What is this text? " + _words("declaration_of_independence.txt", 100),
]


class ServeProcess:
    """One `kvtier serve` child; its output goes to a file (an unread pipe could block it)."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.log = log
        self.flags = flags
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.returncode: int | None = None  # once stopped or killed

    def start(self, timeout: float = 120.0) -> ServeProcess:
        argv = [str(BIN / "kvtier"), "serve", "--host", "127.0.0.1", "--port", "0"]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [*argv, *self.flags], stdout=out, stderr=subprocess.STDOUT, env=os.environ
            )
        deadline = time.monotonic() + timeout
        while not self.base_url:
            found = re.search(r"listening on (http://\S+)", self.log.read_text())
            if found:
                self.base_url = found.group(1)
            elif self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve did not start:\n{self.log.read_text()}")
            else:
                time.sleep(0.1)
        while httpx.get(self.base_url + "/health", timeout=5).status_code != 200:
            time.sleep(0.1)
        return self

    @property
    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it: in-flight requests drain, tiers close."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.returncode = self.process.wait(timeout=60)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: a replica that dies without a word."""
        if self.process is not None:
            self.process.kill()
            self.returncode = self.process.wait()
        self.process = None

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10).text


@dataclass
class Turn:
    text: str
    cached_tokens: int
    sources: dict[str, int]  # usage.kvtier.prompt_token_sources


def chat(
    base_url: str, session: str, messages: list[dict[str, str]], extra: dict | None = None
) -> Turn:
    client = OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    response = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"X-Session-ID": session},
        extra_body={"ignore_eos": True, **(extra or {})},
    )
    usage = response.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    extension = (usage.model_extra or {})["kvtier"]
    return Turn(
        response.choices[0].message.content or "",
        usage.prompt_tokens_details.cached_tokens or 0,
        extension["prompt_token_sources"],
    )


def first_turn(base_url: str) -> Turn:
    """Session `a`'s first turn, then two other sessions' turns that push it off the device."""
    turn = chat(base_url, "a", [{"role": "user", "content": FIRST}])
    for index, text in enumerate(FLOODS):
        chat(base_url, f"flood-{index}", [{"role": "user", "content": text}])
    return turn


def second_turn(base_url: str, first: Turn, extra: dict | None = None) -> Turn:
    messages = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": SECOND},
    ]
    return chat(base_url, "a", messages, extra)


def conversation(base_url: str) -> tuple[Turn, Turn]:
    first = first_turn(base_url)
    return first, second_turn(base_url, first)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text `text` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
