"""The GPU check: CUDA logits against CPU, resumed-session restores timed, the h200 profile's
prediction printed beside them. Run by benchmarks/gpu_check.sh on a GPU machine (docs/gpu.md):

    python benchmarks/gpu_check.py --device cuda --out out/gpu_check
    python benchmarks/gpu_check.py --device cpu --smoke --out out/gpu_check_smoke   # anywhere

Phases, each under its own time budget (what does not fit is reported as skipped):

1. parity: the embedded SmolLM2's logits from `Engine.score` on `--device` against the same
   engine on CPU in float32 (the reference), for one ~500-token English prompt. float32 on
   the device must stay within FP32_TOL of the reference (max abs); bfloat16 on the device
   must be about as close to the reference as bfloat16 on the CPU is (mean abs error at most
   BF16_SLACK x the CPU's + 0.02, top-1 agreement at most 2 points lower): bf16 rounding
   differs between any two kernel libraries, so the CPU's own bf16 error is the yardstick.
2. resume: a Llama-3.1-8B geometry (src/kvtier/data/models/llama-3.1-8b.json) with RANDOM
   weights, bf16 - timing only, its outputs mean nothing. Per context (8K and 32K tokens):
   TTFT of a resumed turn (the history + 16 new tokens) restored from host and from disk (page
   cache), against recomputing the whole prompt (benchmarks/resume.py's procedure).
3. prediction: the simulator's step model on the h200 profile (kvtier.sim, `--profile`) for the
   same shapes: the recompute as prefill steps of `--step-tokens`, a restore as the chunks'
   transfers plus the new tokens' prefill, next to the measurement, so the profile can be
   corrected (`kvtier calibrate` writes a measured one).

`--smoke` shrinks phase 2 to a 2-layer model of the same kind and a short context, so the
whole script runs in seconds on CPU (tests/bench/test_gpu_check.py keeps it working).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import struct
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
from resume import recompute, restores

from kvtier.cache import TiersConfig
from kvtier.engine import Engine, EngineConfig
from kvtier.models import resolve_model_dir
from kvtier.plan.geometry import ModelGeometry
from kvtier.sim.profile import load_profile
from kvtier.sim.step_model import StepModel

MIB = 1 << 20
FP32_TOL = 1e-2  # 10x the CPU engine's bound against transformers (tests/engine/test_parity)
BF16_SLACK = 1.5
NEW_TOKENS = 17  # the resumed turn's tokens past the history (resume.py: 16 + the output)
CHUNK_TOKENS = 256  # TiersConfig's default chunk
SMOKE_MODEL = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32768,
}


class Budget:
    """Seconds left for one phase."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ----- phase 1: logits on the device against CPU ------------------------------------------


def parity(device: str, budget: Budget, smoke: bool) -> dict:
    text = resources.files("kvtier.data.text").joinpath("plain_english.txt").read_text()
    logits: dict[str, torch.Tensor] = {}
    runs = [("cpu", "float32"), (device, "float32"), ("cpu", "bfloat16"), (device, "bfloat16")]
    prompt: list[int] = []
    for where, dtype in runs:
        if budget.left() <= 0:
            return {"skipped": "time budget spent", "done": sorted(logits)}
        engine = Engine(EngineConfig(dtype=dtype, device=where, kv_cache_bytes=64 * MIB))
        try:
            if not prompt:
                prompt = engine.tokenizer.encode(text)[: 64 if smoke else 512]
            (out,) = engine.score([prompt])
            logits[f"{where} {dtype}"] = out.logits.float().cpu()
        finally:
            engine.close()
    ref = logits["cpu float32"]

    def compare(name: str) -> dict:
        got = logits[name]
        diff = (got - ref).abs()
        return {
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }

    fp32, bf16, cpu_bf16 = (
        compare(f"{device} float32"),
        compare(f"{device} bfloat16"),
        compare("cpu bfloat16"),
    )
    fp32_ok = fp32["max_abs_diff"] <= FP32_TOL
    bf16_ok = (
        bf16["mean_abs_diff"] <= BF16_SLACK * cpu_bf16["mean_abs_diff"] + 0.02
        and bf16["top1_agreement"] >= cpu_bf16["top1_agreement"] - 0.02
    )
    return {
        "prompt_tokens": len(prompt),
        "reference": "cpu float32",
        f"{device} float32": fp32,
        f"{device} bfloat16": bf16,
        "cpu bfloat16": cpu_bf16,
        "fp32_tolerance_max_abs": FP32_TOL,
        "passed": bool(fp32_ok and bf16_ok),
    }


# ----- phase 2: a random-weight model of a real geometry ----------------------------------

_HEADER_ALIGN = 8


def random_model_dir(config: dict, workdir: Path) -> Path:
    """A model folder for `config`: the embedded model's tokenizer files, the config, and a
    safetensors file of zeros written sparse (no time, no disk), randomised once loaded."""
    folder = workdir / "random-model"
    folder.mkdir(parents=True, exist_ok=True)
    for item in resolve_model_dir(None).iterdir():
        if item.name not in ("model.safetensors", "config.json") and item.is_file():
            shutil.copy(item, folder / item.name)
    (folder / "config.json").write_text(json.dumps(config))
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * head_dim, h),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": (h, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset]}
        header[name]["data_offsets"][1] = offset + nbytes
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the tensors: a hole that reads as zeros
    return folder


@torch.inference_mode()
def randomise(engine: Engine) -> None:
    """Random weights in place (std 0.02, norms 1): timing only, the outputs mean nothing.
    Weights packed for oneDNN (bf16 on CPU) stay zero; they only run in the smoke mode."""
    model = engine.model
    generator = torch.Generator(device=model.embed.device).manual_seed(0)
    model.embed.normal_(0, 0.02, generator=generator)
    model.final_norm.fill_(1.0)
    for layer in model.layers:
        layer.input_norm.fill_(1.0)
        layer.post_norm.fill_(1.0)
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if not linear.packed:
                linear.weight.normal_(0, 0.02, generator=generator)
    if not model.lm_head.packed and model.lm_head.weight is not model.embed:
        model.lm_head.weight.normal_(0, 0.02, generator=generator)


def resume_timings(args: argparse.Namespace, config: dict, budget: Budget) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-gpu-check-", dir=args.workdir))
    results: dict[str, dict] = {}
    try:
        model_dir = random_model_dir(config, workdir)
        kv_per_token = (
            config["num_hidden_layers"]
            * 2
            * config["num_key_value_heads"]
            * (config["hidden_size"] // config["num_attention_heads"])
            * 2
        )
        longest = max(args.contexts)
        history_bytes = (longest + NEW_TOKENS + 64) * kv_per_token
        started = time.perf_counter()
        engine = Engine(
            EngineConfig(
                model_dir=model_dir,
                device=args.device,
                dtype="bfloat16",
                kv_cache_bytes=int(history_bytes * 2.2),  # turn 2 beside turn 1's blocks
                max_model_len=longest + 64,
                max_num_batched_tokens=args.step_tokens,
            )
        )
        randomise(engine)
        results["load_s"] = time.perf_counter() - started
        try:
            for tokens in args.contexts:
                if budget.left() <= 0:
                    results[str(tokens)] = {"skipped": "time budget spent"}
                    continue
                results[str(tokens)] = one_context(
                    engine, tokens, history_bytes, workdir, args, budget
                )
                print(f"resume {tokens}: {json.dumps(results[str(tokens)])}", flush=True)
        finally:
            engine.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def one_context(
    engine: Engine,
    tokens: int,
    tier_bytes: int,
    workdir: Path,
    args: argparse.Namespace,
    budget: Budget,
) -> dict:
    # warm: the same turn with the history still on the device (the new tokens' prefill alone)
    ttft: dict[str, list[float]] = {"recompute": [], "host": [], "disk": [], "warm": []}
    for repeat in range(args.repeats):
        if repeat and budget.left() <= 0:
            break  # at least one repeat per context
        ttft["recompute"].append(recompute(engine, tokens, 1000 * repeat).metrics.ttft_s)
        tiers = TiersConfig(
            host_bytes=tier_bytes,
            disk_bytes=tier_bytes,
            disk_dir=workdir / f"disk-{tokens}-{repeat}",
        )
        outs, warm_s = restores(engine, tiers, tokens, 1000 * repeat + 1, ["host", "disk"])
        ttft["warm"].append(warm_s)
        for tier, (out, *_) in outs.items():  # (output, bytes held, chunks layered)
            if out.metrics.prompt_token_sources.get(tier, 0) < tokens // 2:
                raise RuntimeError(f"the {tier} restore restored too little: {out.metrics}")
            ttft[tier].append(out.metrics.ttft_s)
    row = {f"{k}_ttft_ms": statistics.median(v) * 1000 for k, v in ttft.items()}
    return row | {"repeats": len(ttft["recompute"])}


# ----- phase 3: the profile's prediction --------------------------------------------------


def predictions(args: argparse.Namespace, config: dict) -> dict:
    geometry = ModelGeometry.from_hf_config(config, name="llama-3.1-8b")
    model = StepModel(load_profile(args.profile), geometry)
    chunk_bytes = CHUNK_TOKENS * geometry.bytes_per_token("bf16")
    out = {}
    for tokens in args.contexts:
        total = tokens + NEW_TOKENS
        prefill = sum(
            model.prefill_s(min(args.step_tokens, total - p), p)
            for p in range(0, total, args.step_tokens)
        )
        chunks = tokens // CHUNK_TOKENS
        tail = model.prefill_s(total - chunks * CHUNK_TOKENS, chunks * CHUNK_TOKENS)
        row = {"recompute_ttft_ms": prefill * 1000}
        for tier in ("host", "disk"):
            row[f"{tier}_ttft_ms"] = (chunks * model.transfer_s(chunk_bytes, tier) + tail) * 1000
        out[str(tokens)] = row
    return out


# ----- report -----------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = [
        f"# GPU check ({report['device']}{', smoke' if report['smoke'] else ''})",
        "",
        f"torch {report['torch']}, {report['accelerator']}",
        "",
        "## 1. logits against CPU float32 (embedded SmolLM2)",
        "",
        "```",
        json.dumps(report["parity"], indent=2),
        "```",
        "",
        "## 2-3. resumed session TTFT, RANDOM-weight "
        f"{report['model']} geometry (timing only), measured vs {report['profile']} profile",
        "",
        "| context | source | measured ms | predicted ms | measured / predicted |",
        "|---|---|---|---|---|",
    ]
    for tokens, row in report["prediction"].items():
        measured = report["resume"].get(tokens, {})
        for key, predicted in row.items():
            source = key.removesuffix("_ttft_ms")
            got = measured.get(key)
            ratio = f"{got / predicted:.2f}" if got else "-"
            shown = f"{got:.1f}" if got else measured.get("skipped", "not run")
            lines.append(f"| {tokens} | {source} | {shown} | {predicted:.1f} | {ratio} |")
    lines += ["", f"verdict: {'PASS' if report['passed'] else 'FAIL'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds)")
    parser.add_argument("--contexts", default=None, help="history tokens, e.g. 8192,32768")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--parity-budget-s", type=float, default=None, help="45 (smoke: 600)")
    parser.add_argument("--resume-budget-s", type=float, default=None, help="170 (smoke: 600)")
    parser.add_argument("--workdir", default=None, help="where the disk tier writes (tmp)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check"))
    args = parser.parse_args(argv)
    default_contexts = "256" if args.smoke else "8192,32768"
    args.contexts = [int(x) for x in (args.contexts or default_contexts).split(",")]
    args.repeats = args.repeats or (1 if args.smoke else 2)
    # the smoke mode runs on busy CPUs (a test): its budgets only catch a hang
    args.parity_budget_s = args.parity_budget_s or (600 if args.smoke else 45)
    args.resume_budget_s = args.resume_budget_s or (600 if args.smoke else 170)
    if args.smoke:
        args.step_tokens = min(args.step_tokens, 128)
    config = json.loads(
        resources.files("kvtier.data.models").joinpath("llama-3.1-8b.json").read_text()
    )
    if args.smoke:
        config |= SMOKE_MODEL

    print("phase 1: logits on the device against CPU", flush=True)
    parity_result = parity(args.device, Budget(args.parity_budget_s), args.smoke)
    print(json.dumps(parity_result, indent=2), flush=True)
    print("phase 2: resumed session, RANDOM weights (timing only)", flush=True)
    resume_result = resume_timings(args, config, Budget(args.resume_budget_s))
    print("phase 3: the profile's prediction", flush=True)
    report = {
        "device": args.device,
        "smoke": args.smoke,
        "torch": torch.__version__,
        "accelerator": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": "llama-3.1-8b" + (" (smoke: 2 small layers)" if args.smoke else ""),
        "weights": "random (timing only)",
        "profile": args.profile,
        "step_tokens": args.step_tokens,
        "parity": parity_result,
        "resume": resume_result,
        "prediction": predictions(args, config),
    }
    report["passed"] = bool(parity_result.get("passed"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
