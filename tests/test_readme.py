"""Every command README.md shows runs as written and exits 0.

The README is parsed (its ```bash blocks, continuation lines joined, comments dropped), and
each command must appear in `HOW` below, which says how this test runs it: as written, with
extra flags that keep it small (flags given later win), or as part of another example (the
server examples run together: the server starts, then the curl line talks to it). A README
command missing from `HOW` fails the first test, so the README cannot grow an example that
nothing runs. Output paths under `out/` go to a temporary folder; everything else is as
written, run from the repository root like a reader who has just run `make demo`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Run:
    """Run the command; `extra` flags are appended (argparse: the last one wins); `needs`
    names a README command whose output this one reads (it runs first, once)."""

    extra: tuple[str, ...] = ()
    needs: str | None = None


@dataclass(frozen=True)
class WithServer:
    """A `kvtier serve` line or a client line: run together in `test_server_examples`, which
    picks the serve lines by `role`."""

    role: str = "client"


@dataclass(frozen=True)
class ByCi:
    """Run by .ci/run itself (the README's two first commands)."""

    why: str = field(default="")


def _canon(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


BENCH_QUICK = "kvtier bench --quick --out out/bench"
CURL_CHAT = _canon(
    "curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
    """-d '{"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]}'"""
)

SERVE_TIERS = "kvtier serve --host-bytes 1GiB --disk-dir out/kv-cache --policy cost"

# Engine runs are kept small: fewer policies, sessions, tasks; the flags are the README's own.
HOW: dict[str, Run | WithServer | ByCi] = {
    _canon(command): how
    for command, how in {
        "make demo": ByCi(".ci/run runs make demo after make test"),
        "make test": ByCi(".ci/run runs it"),
        "kvtier plan --model seed-70b --context 8000,128000": Run(),
        "kvtier plan --model llama-3.1-70b --context 32768 --kv-dtype int4 --group-size 32": Run(),
        "kvtier plan --model src/kvtier/data/models/qwen2.5-7b.json --context 4096 "
        "--hardware h200 --json": Run(),
        "kvtier plan --layers 32 --kv-heads 8 --head-dim 128 --params 8e9 --context 8192": Run(),
        "kvtier analyze sample --out out/analyze-sample": Run(),
        "kvtier analyze tests/analyze/data/tiny_bailian.jsonl --trace-format bailian "
        "--model llama-3.1-8b --json out/analyze-bailian/figures.json "
        "--out out/analyze-bailian": Run(),
        "kvtier analyze --generate default --seed 1 --out out/analyze-generated": Run(),
        # one policy: each replay prefills the demo's two ~4.2K-token histories (seconds each)
        BENCH_QUICK: Run(("--policies", "offload")),
        "kvtier bench --workload default --sessions 4 --scale-to-context 2048 "
        "--policies offload,cost --kv-cache-bytes 128MiB --out out/bench-default": Run(
            ("--sessions", "1", "--policies", "offload")
        ),
        "kvtier bench --workload sample --scale-to-context 2048 --sessions 20 "
        "--out out/bench-sample": Run(("--sessions", "2", "--policies", "offload")),
        "kvtier simulate --workload default --policies offload,cost,oracle "
        "--device-kv-bytes 40GB --out out/simulate-default": Run(("--workload-set", "sessions=60")),
        "kvtier simulate sweep --resume-shares 0.2,0.8 --contexts 4000,32000 "
        "--hardware h100-sxm,l40s --out out/simulate-sweep": Run(("--sessions", "20")),
        "kvtier simulate seeds --workload multiclass --seeds 0-4 "
        "--policies offload,cost,oracle --out out/simulate-seeds": Run(
            ("--workload-set", "sessions=40", "--seeds", "0-1")
        ),
        "kvtier calibrate --quick --threads 1": Run(("--out", "out/local-cpu.toml")),
        "kvtier simulate --workload demo --hardware local-cpu --timer-after-steps "
        "--shared-prefixes --validate --against out/bench/results.json "
        "--out out/simulate-validate": Run(needs=BENCH_QUICK),
        "kvtier eval --quick --out out/eval-quick": Run(
            ("--tasks", "passkey", "--methods", "knorm")
        ),
        "kvtier eval --methods snapkv,tova --ratios 0,0.5,0.875 --lengths 4k --samples 4 "
        "--out out/eval-snapkv-tova": Run(("--tasks", "passkey", "--samples", "1")),
        "kvtier serve --port 8000": WithServer("plain"),
        "kvtier serve --tenant acme:sk-acme:268435456 --tenant beta:sk-beta "
        "--admin-key sk-admin": WithServer("tenants"),
        SERVE_TIERS: WithServer("tiers"),
        "kvtier config show --host-bytes 1GiB --disk-dir out/kv-cache --policy cost": Run(),
        CURL_CHAT: WithServer(),
        "kvtier model prepare": Run(),
        "kvtier model info": Run(),
        "kvtier model generate --prompt 'The capital of France is' --max-tokens 16": Run(),
        "kvtier model generate --chat --prompt 'Name three colours.'": Run(),
    }.items()
}


def readme_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            if tokens:
                commands.append(shlex.join(tokens))
    return commands


def test_every_readme_command_is_run_by_this_test() -> None:
    shown = readme_commands()
    assert shown, "no ```bash blocks found in README.md"
    missing = [command for command in shown if command not in HOW]
    assert not missing, f"README commands this test does not run: {missing}"
    stale = [command for command in HOW if command not in shown]
    assert not stale, f"commands in HOW that README no longer shows: {stale}"


WRITERS = ("analyze", "bench", "simulate", "eval")  # the commands that write results folders


def test_every_readme_command_writes_to_its_own_out_folder() -> None:
    """Run in order, no README command reads another's results by accident: each one that
    writes results names its own `--out` (the one that validates against `kvtier bench
    --quick` reads that run's folder, and only it writes there)."""
    folders: dict[str, str] = {}
    for command in readme_commands():
        tokens = shlex.split(command)
        if tokens[0] != "kvtier" or tokens[1] not in WRITERS:
            continue
        assert "--out" in tokens, f"{command} writes to the default folder"
        folder = tokens[tokens.index("--out") + 1]
        assert folder.startswith("out/"), command
        assert folder not in folders, f"{command} and {folders[folder]} both write {folder}"
        folders[folder] = command
    assert folders["out/bench"] == _canon(BENCH_QUICK)


def _argv(tokens: list[str], out_dir: Path, port: int | None = None) -> list[str]:
    """The command as a reader types it, but writing under `out_dir` and on a free port."""
    argv = []
    for token in tokens:
        if token == "kvtier":
            token = str(BIN / "kvtier")
        elif token.startswith("out/"):
            token = str(out_dir / token)
        elif port is not None and token == "8000":
            token = str(port)
        elif port is not None:
            token = token.replace("localhost:8000", f"localhost:{port}")
        argv.append(token)
    return argv


def _run(argv: list[str], timeout_s: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.fixture(scope="module")
def readme_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def run_once(readme_out: Path):
    """Runs a README command (as `HOW` says) at most once per test run; returns its result."""
    done: dict[str, subprocess.CompletedProcess[str]] = {}

    def run(command: str) -> subprocess.CompletedProcess[str]:
        how = HOW[command]
        assert isinstance(how, Run)
        if how.needs is not None:
            needed = run(how.needs)
            assert needed.returncode == 0, f"{how.needs} failed first"
        if command not in done:
            done[command] = _run(_argv([*shlex.split(command), *how.extra], readme_out))
        return done[command]

    return run


RUNS = [command for command, how in HOW.items() if isinstance(how, Run)]


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNS)
def test_readme_command_exits_0(command: str, run_once) -> None:
    result = run_once(command)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(command: str, out_dir: Path) -> tuple[subprocess.Popen[str], int]:
    port = _free_port()
    argv = _argv(shlex.split(command), out_dir, port)
    if "--port" not in argv:
        argv += ["--port", str(port)]
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
    log = (out_dir / f"serve-{port}.log").open("w")
    process = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{command} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, port
        except OSError:
            time.sleep(0.25)
    process.kill()
    raise AssertionError(f"{command} did not start listening")


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_server_examples(readme_out: Path) -> None:
    """Every serve line starts and answers: the curl line gets a chat completion from the
    plain one (no keys); a tenant key is needed on the tenants one; the tiers one answers with
    the usage split by source and has made its disk tier's folder."""
    roles = {how.role: c for c, how in HOW.items() if isinstance(how, WithServer)}
    process, port = _start(roles["plain"], readme_out)
    try:
        result = _run(_argv(shlex.split(CURL_CHAT), readme_out, port), timeout_s=120)
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
        assert reply["choices"][0]["message"]["content"], reply
    finally:
        _stop(process)
    process, port = _start(roles["tenants"], readme_out)
    try:
        curl = _argv(shlex.split(CURL_CHAT), readme_out, port)
        denied = _run([*curl, "-w", "\n%{http_code}"], timeout_s=120)
        assert denied.stdout.rsplit("\n", 1)[1] == "401", denied.stdout
        allowed = _run([*curl, "-H", "Authorization: Bearer sk-acme"], timeout_s=120)
        assert json.loads(allowed.stdout)["choices"][0]["message"]["content"], allowed.stdout
    finally:
        _stop(process)
    process, port = _start(roles["tiers"], readme_out)
    try:
        result = _run(_argv(shlex.split(CURL_CHAT), readme_out, port), timeout_s=120)
        usage = json.loads(result.stdout)["usage"]
        assert set(usage["kvtier"]["prompt_token_sources"]) >= {"host", "disk", "remote"}
    finally:
        _stop(process)
    assert any((readme_out / "out/kv-cache").iterdir())  # the disk tier's folder (its lock file)
