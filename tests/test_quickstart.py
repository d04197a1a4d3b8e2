"""Every command docs/quickstart.md shows runs as written and does what the page says.

The page is parsed into its ```bash blocks and its commands (continuation lines joined, a
quoted argument running over several lines kept whole, comments dropped); each command must
appear in `HOW` below, which says how this test runs it, so the page cannot grow a command
that nothing runs. The long-running servers are started as the page starts them, on a free
loopback port instead of 8000 / 8001, checked with one request, then stopped:

- `kvtier serve` with host and disk tiers under the `cost` policy, answering the page's curl
  line with the usage split by source, its disk folder made under `out/` (a temporary folder);
- the `kvtier.toml` the page shows gives the tiers and policy of those flags;
- the vLLM block (the model path, then vLLM's OpenAI server with kvtier's connector) runs as one
  bash script under .venv-vllm, which answers a chat completion. Skipped without .venv-vllm
  (`make vllm`), except in CI, where a missing venv is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.test_readme import _free_port, _run, _start, _stop

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "docs" / "quickstart.md"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _canon(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


SERVE = _canon("kvtier serve --host-bytes 1GiB --disk-dir out/kv-cache --policy cost")
CURL = _canon(
    "curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
    """-d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'"""
)

# command -> how it is run: "ci" (.ci/run runs it), "shell" (changes the reader's shell only),
# "serve" / "curl" (test_kvtier_serve_with_tiers), "vllm" (test_vllm_with_the_connector)
HOW = {
    "make demo": "ci",
    "make test": "ci",
    "make vllm": "ci",
    "source .venv/bin/activate": "shell",
    SERVE: "serve",
    CURL: "curl",
}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", QUICKSTART.read_text(), re.S)


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, a quoted argument over several lines
    kept whole (`shlex` says when a command is complete), comments dropped."""
    out, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            tokens = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        if tokens:
            out.append(shlex.join(tokens))
        pending = ""
    assert not pending, f"unterminated command in docs/quickstart.md: {pending!r}"
    return out


def _vllm_block() -> str:
    (block,) = [b for b in blocks("bash") if "vllm.entrypoints.openai.api_server" in b]
    return block


def test_every_quickstart_command_is_run_by_this_test() -> None:
    shown = [command for block in blocks("bash") for command in commands(block)]
    assert shown, "no ```bash blocks in docs/quickstart.md"
    vllm = commands(_vllm_block())
    missing = [c for c in shown if c not in HOW and c not in vllm]
    assert not missing, f"quick-start commands this test does not run: {missing}"
    stale = [c for c in HOW if c not in shown]
    assert not stale, f"commands in HOW that docs/quickstart.md no longer shows: {stale}"
    assert len(vllm) == 2 and vllm[0].startswith("'MODEL=$("), vllm


def test_the_toml_of_the_quick_start_is_the_serve_flags() -> None:
    """The page says the `kvtier serve` flags 'fit in a kvtier.toml': the same tiers, the
    same policy."""
    from kvtier.cache.tiers_file import tiers_from_table
    from kvtier.policy.config import PolicyConfig

    (text,) = blocks("toml")
    table = tomllib.loads(text)
    from_file = tiers_from_table(table["tiers"])
    from_flags = tiers_from_table({"host_bytes": "1GiB", "disk_dir": "out/kv-cache"})
    assert from_file == from_flags
    assert from_file.host_bytes == 1 << 30 and from_file.disk_persist
    assert PolicyConfig(**table["policy"]).name == "cost"


@pytest.mark.slow
def test_kvtier_serve_with_tiers(tmp_path: Path) -> None:
    """The serve line starts; the curl line gets a chat completion whose usage says where the
    prompt's KV came from; the disk tier's folder exists."""
    process, port = _start(SERVE, tmp_path)
    try:
        curl = [token.replace("localhost:8000", f"localhost:{port}") for token in shlex.split(CURL)]
        result = _run(curl, timeout_s=120)
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
        assert reply["choices"][0]["message"]["content"], reply
        sources = reply["usage"]["kvtier"]["prompt_token_sources"]
        assert set(sources) == {"device", "host", "disk", "remote", "recomputed"}
        assert sum(sources.values()) == reply["usage"]["prompt_tokens"]
    finally:
        _stop(process)
    assert any((tmp_path / "out/kv-cache").iterdir())  # the disk tier's folder (its lock file)


@pytest.mark.slow
def test_vllm_with_the_connector(tmp_path: Path) -> None:
    """The page's vLLM block, run by bash as written but on a free port, serves the embedded
    model with kvtier's connector: a chat completion comes back."""
    if not VLLM_PYTHON.exists():
        message = f"{VLLM_PYTHON} is missing: `make vllm` builds vLLM's venv"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = _free_port()
    script = _vllm_block().replace("--port 8001", f"--port {port}")
    assert f"--port {port}" in script
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    log = (tmp_path / "vllm.log").open("w")
    process = subprocess.Popen(
        ["bash", "-c", f"set -e\n{script}"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: bash and the server stop together
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                tail = (tmp_path / "vllm.log").read_text()[-3000:]
                pytest.fail(f"the quick start's vLLM block exited {process.returncode}: {tail}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM did not become healthy in 600 s"
            time.sleep(1)
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 8},
            timeout=120,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["message"]["content"], body
        assert "prompt_tokens_details" in body["usage"], body  # --enable-prompt-tokens-details
        log.flush()
        started = (tmp_path / "vllm.log").read_text()
        assert "kvtier: tiers host" in started  # the connector's settings, in vLLM's log
        assert "kv_load_failure_policy=recompute" in started
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
