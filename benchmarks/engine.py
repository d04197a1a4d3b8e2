"""kvtier engine vs transformers `generate`, side by side in one process.

Same model (the embedded SmolLM2-135M-Instruct), same dtype, same thread count, same token
ids (random prompts from `vllm_cpu.make_prompt`, shared with the vLLM-CPU script):

- prefill tokens/s at 512 and 2,048 prompt tokens (time to the first token, cold cache);
- output tokens/s at 1, 8 and 32 concurrent sequences (512-token prompts, 64 new tokens each,
  eos ignored, prefill included), plus kvtier's decode-only rate once all prompts are in;
- TTFT of a 1,539-token prompt cold and with a full prefix-cache hit.
transformers runs requests one after another ("sequential") and as one padded batch
("batched"; the prompts have equal lengths, the best case for it). Figures are medians of
`--repeats` runs. `--vllm-json` adds a column from `benchmarks/vllm_cpu.py`'s output.

    .venv/bin/python benchmarks/engine.py --out out/engine_bench.json [--quick]

`--long` measures the long-context suite instead (`vllm_cpu.long_context`: prefill at 2K and
8K tokens, decode at 8K context) on kvtier only, and with `--vllm-python` runs
`benchmarks/vllm_cpu.py --long` in that interpreter first (a subprocess, so the two never
share the cores), then prints both side by side with kvtier / vLLM ratios:

    .venv/bin/python benchmarks/engine.py --long --vllm-python .venv-vllm/bin/python \
        --threads 2 --out out/engine_long.json [--vllm-eager]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from vllm_cpu import (
    CONCURRENCY,
    DECODE_NEW_TOKENS,
    DECODE_PROMPT_LEN,
    LONG_DECODE_PROMPT_LEN,
    LONG_PREFILL_LENGTHS,
    PREFILL_LENGTHS,
    TTFT_PROMPT_LEN,
    long_context,
    make_prompt,
)

from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.config import PREFILL_ATTENTIONS
from kvtier.host_cpu import host_cpu
from kvtier.models import resolve_model_dir


def median_of(fn: Callable[[int], float], repeats: int) -> float:
    return statistics.median(fn(i) for i in range(repeats))


class KvtierBench:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def ttft_s(self, prompt: list[int], cold: bool) -> float:
        if cold:
            self.engine.reset_prefix_cache()
        (out,) = self.engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        return out.metrics.ttft_s

    def generate_s(self, prompt: list[int], max_tokens: int, cold: bool) -> float:
        """Wall time of one greedy request, measured as `vllm_cpu.py` measures vLLM's."""
        if cold:
            self.engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        self.engine.generate([prompt], params)
        return time.perf_counter() - started

    def concurrent(self, prompts: list[list[int]]) -> tuple[float, float]:
        """(output tok/s including prefill, decode-only tok/s after every prompt is in)."""
        engine = self.engine
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=DECODE_NEW_TOKENS, ignore_eos=True)
        started = time.perf_counter()
        ids = {engine.add_request(p, params) for p in prompts}
        have_first: set[str] = set()
        all_in_at, tokens_after = None, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id not in ids or not out.new_token_ids:
                    continue
                if all_in_at is None:
                    have_first.add(out.request_id)
                else:
                    tokens_after += 1
            if all_in_at is None and len(have_first) == len(ids):
                all_in_at = time.perf_counter()
        ended = time.perf_counter()
        total = len(prompts) * DECODE_NEW_TOKENS
        decode_rate = tokens_after / (ended - all_in_at) if tokens_after else float("nan")
        return total / (ended - started), decode_rate


class TransformersBench:
    def __init__(self, model) -> None:
        self.model = model

    def _generate(self, batch: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(batch)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=2,
            )
        return time.perf_counter() - started

    def ttft_s(self, prompt: list[int]) -> float:
        return self._generate([prompt], 1)

    def sequential(self, prompts: list[list[int]]) -> float:
        seconds = sum(self._generate([p], DECODE_NEW_TOKENS) for p in prompts)
        return len(prompts) * DECODE_NEW_TOKENS / seconds

    def batched(self, prompts: list[list[int]]) -> float:
        return len(prompts) * DECODE_NEW_TOKENS / self._generate(prompts, DECODE_NEW_TOKENS)


def machine_busy_s() -> float | None:
    """CPU seconds all processes spent so far (Linux /proc/stat), None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def build_engine(args: argparse.Namespace, threads: int) -> Engine:
    engine = Engine(
        EngineConfig(
            dtype=args.dtype,
            num_threads=threads,
            paged_decode=args.paged_decode,
            prefill_attention=args.prefill_attention,
        )
    )
    print(f"kvtier: prefill attention by {engine.config.prefill_attention}", flush=True)
    return engine


def run(args: argparse.Namespace) -> dict:
    # Other processes on a 2-core machine wreck multi-threaded timings (a thread waiting
    # at an OpenMP barrier for a core loses whole scheduler slices): record how much CPU
    # everything else used during the run, so a disturbed run can be recognized.
    started, busy_before, own_before = time.perf_counter(), machine_busy_s(), _own_cpu_s()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    engine = build_engine(args, threads)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.dtype)
    ours, hf = KvtierBench(engine), TransformersBench(hf_model.eval())
    reps = args.repeats
    ours.ttft_s(make_prompt(64, 0), cold=True)  # warm-up both (first-call allocations)
    hf.ttft_s(make_prompt(64, 0))

    kv: dict[str, float] = {}
    seq: dict[str, float] = {}
    bat: dict[str, float] = {}
    for n in PREFILL_LENGTHS:
        # A fresh prompt per repeat: nothing can hit any cache.
        kv[f"prefill_{n}_tok_s"] = n / median_of(
            lambda i, n=n: ours.ttft_s(make_prompt(n, 100 + i), cold=True), reps
        )
        seq[f"prefill_{n}_tok_s"] = n / median_of(
            lambda i, n=n: hf.ttft_s(make_prompt(n, 100 + i)), reps
        )
        print(f"prefill {n}: kvtier {kv[f'prefill_{n}_tok_s']:.0f} tok/s", flush=True)
    for b in CONCURRENCY:
        prompts = [make_prompt(DECODE_PROMPT_LEN, 1000 + i) for i in range(b)]
        runs = [ours.concurrent(prompts) for _ in range(reps)]
        kv[f"decode_{b}_output_tok_s"] = statistics.median(r[0] for r in runs)
        kv[f"decode_{b}_decode_only_tok_s"] = statistics.median(r[1] for r in runs)
        # Sequential throughput does not depend on how many requests queue up, so a couple
        # of requests measure it; running all 32 one by one would only take longer.
        seq[f"decode_{b}_output_tok_s"] = median_of(
            lambda _, p=prompts: hf.sequential(p[: min(len(p), args.sequential_requests)]), reps
        )
        bat[f"decode_{b}_output_tok_s"] = median_of(lambda _, p=prompts: hf.batched(p), reps)
        print(f"decode x{b}: kvtier {kv[f'decode_{b}_output_tok_s']:.1f} tok/s", flush=True)
    ttft_prompt = make_prompt(TTFT_PROMPT_LEN, 7)
    kv["ttft_1539_cold_ms"] = 1000 * median_of(lambda _: ours.ttft_s(ttft_prompt, True), reps)
    kv["ttft_1539_prefix_hit_ms"] = 1000 * median_of(
        lambda _: ours.ttft_s(ttft_prompt, False), reps
    )
    seq["ttft_1539_cold_ms"] = 1000 * median_of(lambda _: hf.ttft_s(ttft_prompt), reps)

    return {
        **_context(args, engine, threads, started, busy_before, own_before),
        "results": {"kvtier": kv, "transformers_sequential": seq, "transformers_batched": bat},
    }


def run_long(args: argparse.Namespace) -> dict:
    """The long-context suite: vLLM-CPU first (when asked, in its own process), then kvtier."""
    vllm = run_vllm(args) if args.vllm_python else None
    started, busy_before, own_before = time.perf_counter(), machine_busy_s(), _own_cpu_s()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    engine = build_engine(args, threads)
    ours = KvtierBench(engine)
    ours.generate_s(make_prompt(LONG_DECODE_PROMPT_LEN, 999), 2, cold=True)  # warm-up
    kv = long_context(ours.generate_s, args.repeats)
    report = {
        **_context(args, engine, threads, started, busy_before, own_before),
        "results": {"kvtier": kv},
    }
    if vllm is not None:
        report["results"]["vllm_cpu"] = vllm
    return report


def run_vllm(args: argparse.Namespace) -> dict:
    """`benchmarks/vllm_cpu.py --long` in vLLM's interpreter; its JSON report."""
    out = args.out.with_name(args.out.stem + "_vllm.json")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    env.pop("PYTHONPATH", None)  # kvtier's path; vLLM's venv brings its own packages
    command = [
        str(args.vllm_python),
        str(Path(__file__).with_name("vllm_cpu.py")),
        str(resolve_model_dir(None)),
        "--long",
        "--repeats",
        str(args.repeats),
        "--out",
        str(out),
    ]
    if args.vllm_eager:
        command.append("--eager")
    subprocess.run(command, env=env, check=True)
    return json.loads(out.read_text())


def _context(
    args: argparse.Namespace,
    engine: Engine,
    threads: int,
    started: float,
    busy_before: float | None,
    own_before: float,
) -> dict:
    """What a report records besides its figures: command, machine, engine settings."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "environment": {
            "torch": torch.__version__,
            "threads": threads,
            "dtype": args.dtype,
            "paged_decode": args.paged_decode,
            "prefill_attention": engine.config.prefill_attention,  # what ran, "auto" decided
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            # the figures depend on it: vLLM-CPU prefills ~5x faster where the CPU has AMX
            "cpu": host_cpu().as_dict(),
            "wall_s": round(time.perf_counter() - started, 1),
            "other_processes_cpu_s": (
                None
                if busy_before is None
                else round(machine_busy_s() - busy_before - (_own_cpu_s() - own_before), 1)
            ),
        },
        "engine_config": {
            "block_size": engine.config.block_size,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "kv_cache_bytes": engine.config.kv_cache_bytes,
        },
        "repeats": args.repeats,
    }


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


METRICS = [
    ("prefill_512_tok_s", "prefill 512 tok (tok/s)"),
    ("prefill_2048_tok_s", "prefill 2048 tok (tok/s)"),
    ("decode_1_output_tok_s", "1 seq, output tok/s"),
    ("decode_8_output_tok_s", "8 seqs, output tok/s"),
    ("decode_32_output_tok_s", "32 seqs, output tok/s"),
    ("decode_1_decode_only_tok_s", "1 seq, decode-only tok/s"),
    ("decode_8_decode_only_tok_s", "8 seqs, decode-only tok/s"),
    ("decode_32_decode_only_tok_s", "32 seqs, decode-only tok/s"),
    ("ttft_1539_cold_ms", "TTFT 1539 tok cold (ms)"),
    ("ttft_1539_prefix_hit_ms", "TTFT 1539 tok prefix hit (ms)"),
]


LONG_METRICS = [
    *((f"prefill_{n}_tok_s", f"prefill {n} tok (tok/s)") for n in LONG_PREFILL_LENGTHS),
    (
        f"decode_{LONG_DECODE_PROMPT_LEN}_ctx_tok_s",
        f"decode at {LONG_DECODE_PROMPT_LEN} ctx (tok/s)",
    ),
]


def long_table(report: dict) -> str:
    """kvtier, vLLM-CPU and their ratio (> 1: kvtier faster), one row per figure."""
    ours = report["results"]["kvtier"]
    vllm = report["results"].get("vllm_cpu")
    theirs = vllm["results"] if vllm else {}
    name = vllm["system"] if vllm else "vllm-cpu"
    lines = [
        f"| {'metric':31s} | {'kvtier':>10s} | {name:>20s} | {'kvtier/vLLM':>11s} |",
        "|" + "-" * 33 + "|" + "-" * 12 + "|" + "-" * 22 + "|" + "-" * 13 + "|",
    ]
    for key, label in LONG_METRICS:
        other = theirs.get(key)
        ratio = f"{ours[key] / other:11.2f}" if other else f"{'-':>11s}"
        other_cell = f"{other:20.1f}" if other else f"{'-':>20s}"
        lines.append(f"| {label:31s} | {ours[key]:10.1f} | {other_cell} | {ratio} |")
    return "\n".join(lines)


def table(report: dict, vllm: dict | None) -> str:
    columns = [
        ("kvtier", report["results"]["kvtier"]),
        ("HF sequential", report["results"]["transformers_sequential"]),
        ("HF batched", report["results"]["transformers_batched"]),
    ]
    if vllm is not None:
        columns.append((vllm["system"], vllm["results"]))
    header = f"| {'metric':31s} | " + " | ".join(f"{name:>14s}" for name, _ in columns) + " |"
    lines = [header, "|" + "-" * 33 + "|" + "|".join("-" * 16 for _ in columns) + "|"]
    for key, label in METRICS:
        cells = []
        for _, values in columns:
            value = values.get(key)
            cells.append(f"{value:14.1f}" if value is not None else f"{'-':>14s}")
        lines.append(f"| {label:31s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/engine_bench.json"))
    parser.add_argument("--quick", action="store_true", help="one repeat of everything")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--paged-decode",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.paged_decode (kvtier; default on, as the engine's)",
    )
    parser.add_argument(
        "--prefill-attention",
        choices=PREFILL_ATTENTIONS,
        default="auto",
        help="EngineConfig.prefill_attention (kvtier's bf16 prefill: its kernel or torch's "
        "flash attention; default auto, as the engine's)",
    )
    parser.add_argument("--sequential-requests", type=int, default=2)
    parser.add_argument("--vllm-json", type=Path, default=None, help="vllm_cpu.py output")
    parser.add_argument("--long", action="store_true", help="the long-context suite")
    parser.add_argument(
        "--vllm-python", type=Path, default=None, help="with --long: run vLLM-CPU here too"
    )
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    print(f"host: {host_cpu().describe()}", flush=True)  # what every figure below depends on
    if args.long:
        report = run_long(args)
        report["table"] = long_table(report)
    else:
        report = run(args)
        vllm = json.loads(args.vllm_json.read_text()) if args.vllm_json else None
        if vllm is not None:
            report["results"]["vllm_cpu"] = vllm
        report["table"] = table(report, vllm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(report["table"])


if __name__ == "__main__":
    main()
