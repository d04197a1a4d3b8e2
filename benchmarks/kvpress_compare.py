"""kvpress 0.5.5 on the very samples `kvtier eval` scored, for a side-by-side of the presses
both projects have (StreamingLLM, SnapKV, TOVA, Knorm) plus kvpress's ExpectedAttention.

kvpress lives in its own venv, never in kvtier's dependencies (it pins transformers < 5.3):

    python3 -m venv $KVTIER_CACHE/venvs/kvpress
    $KVTIER_CACHE/venvs/kvpress/bin/pip install torch==2.13.0 kvpress==0.5.5 'transformers<5.3'

(`--setup` runs exactly that; torch is pinned so pip takes the CPU wheel, not a CUDA build.)

Run from kvtier's venv after `kvtier eval ... --out DIR`:

    python benchmarks/kvpress_compare.py --eval-dir DIR --methods snapkv,tova --ratios 0.5

It re-runs itself inside the kvpress venv (`--worker`), which reads DIR/samples.jsonl, loads
the converted embedded model (bf16 safetensors folder) with transformers, answers every
sample greedily through kvpress's pipeline, scores with `kvtier/eval/scoring.py` (standard
library only, loaded by path: kvtier itself is not installed there) and writes
DIR/kvpress_results.json. Back in kvtier's venv it prints and writes DIR/kvpress_compare.md:
kvpress's score next to ours from DIR/results.json, same samples, same model.

A difference in protocol, kept on purpose: kvpress compresses the document before the
question is seen (query-agnostic), kvtier after the whole prompt is prefilled (query-aware),
so SnapKV's observation window holds the question only in kvtier. kvpress's ratio applies to
the document's tokens, kvtier's to the whole prompt. The worker checks that kvpress's
tokenization equals the prompt ids kvtier ran and reports any mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCORING_FILE = REPO / "src" / "kvtier" / "eval" / "scoring.py"
# kvtier method name -> kvpress press class (None: no compression)
KVPRESS_PRESSES = {
    "full": None,
    "streaming_llm": "StreamingLLMPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "expected_attention": "ExpectedAttentionPress",  # kvpress only
}
PIP_INSTALL = ["torch==2.13.0", "kvpress==0.5.5", "transformers<5.3"]


def kvtier_cache() -> Path:
    return Path(os.environ.get("KVTIER_CACHE") or Path.home() / ".cache" / "kvtier").expanduser()


def venv_python() -> Path:
    return kvtier_cache() / "venvs" / "kvpress" / "bin" / "python"


# ----- worker: runs inside the kvpress venv -------------------------------------------------


def load_scoring():
    spec = importlib.util.spec_from_file_location("kvtier_eval_scoring", SCORING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_bytes(cache) -> int:
    """Bytes the compressed DynamicCache really holds (keys + values of every layer)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def worker(args: argparse.Namespace) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

    transformers.utils.logging.disable_progress_bar()  # no per-tensor loading bars in logs
    torch.set_num_threads(args.threads)
    scoring = load_scoring()
    samples = [json.loads(line) for line in args.samples.read_text().splitlines() if line]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    mismatched = []
    for sample in samples:
        tensors = pipe.preprocess(
            sample["context"],
            questions=[sample["question"]],
            answer_prefix=sample["answer_prefix"],
            max_context_length=10**9,
        )
        ids = tensors["context_ids"][0].tolist() + tensors["questions_ids"][0][0].tolist()
        if ids != sample["prompt_token_ids"]:
            mismatched.append(f"{sample['task']}/{sample['length']}/{sample['index']}")
    results = []
    for method in args.methods:
        ratios = [0.0] if method == "full" else args.ratios
        for ratio in ratios:
            name = KVPRESS_PRESSES[method]
            press = None if name is None else getattr(kvpress, name)(compression_ratio=ratio)
            spec = "full" if name is None else f"{method}:{ratio:g}"
            started = time.perf_counter()
            for sample in samples:
                cache = DynamicCache()
                t0 = time.perf_counter()
                answer = pipe(
                    sample["context"],
                    question=sample["question"],
                    answer_prefix=sample["answer_prefix"],
                    press=press,
                    max_new_tokens=sample["max_tokens"],
                    cache=cache,
                )["answer"]
                results.append(
                    {
                        "sample_id": f"{sample['task']}/{sample['length']}/{sample['index']}",
                        "task": sample["task"],
                        "spec": spec,
                        "prediction": answer,
                        "score": scoring.score(sample["metric"], answer, sample["answers"]),
                        "kv_bytes_held": cache_bytes(cache),
                        "seconds": round(time.perf_counter() - t0, 3),
                    }
                )
            mean = sum(r["score"] for r in results if r["spec"] == spec) / len(samples)
            print(f"kvpress {spec}: {100 * mean:.1f} in {time.perf_counter() - started:.1f} s")
    document = {
        "kvpress_version": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
        "torch_threads": args.threads,
        "num_samples": len(samples),
        "tokenization_mismatches": mismatched,
        "samples": results,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")


# ----- driver: runs in kvtier's venv -------------------------------------------------------


def setup_venv() -> None:
    python = venv_python()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(python.parent.parent)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PIP_INSTALL], check=True)


def summarize(samples: list[dict]) -> dict[str, dict]:
    """spec -> average over tasks of the per-task mean score (0-100), and bytes held."""
    by_spec: dict[str, dict[str, list[float]]] = {}
    held: dict[str, list[int]] = {}
    for s in samples:
        by_spec.setdefault(s["spec"], {}).setdefault(s["task"], []).append(s["score"])
        if s.get("kv_bytes_held") is not None:
            held.setdefault(s["spec"], []).append(s["kv_bytes_held"])
    out = {}
    for spec, tasks in by_spec.items():
        task_means = {t: 100 * sum(v) / len(v) for t, v in tasks.items()}
        out[spec] = {
            "tasks": task_means,
            "average": sum(task_means.values()) / len(task_means),
            "n": sum(len(v) for v in tasks.values()),
            "kv_mib": sum(held[spec]) / len(held[spec]) / 2**20 if held.get(spec) else None,
        }
    return out


def compare_table(ours: dict[str, dict], theirs: dict[str, dict]) -> str:
    tasks = sorted({t for row in theirs.values() for t in row["tasks"]})
    head = ["method", "n"] + [f"{t} (kvtier / kvpress)" for t in tasks]
    head += ["avg kvtier", "avg kvpress", "KV MiB kvtier", "KV MiB kvpress"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for spec, row in theirs.items():
        mine = ours.get(spec)
        cells = [spec, str(row["n"])]
        cells += [
            f"{fmt(mine['tasks'].get(t) if mine else None)} / {fmt(row['tasks'].get(t))}"
            for t in tasks
        ]
        cells += [
            fmt(mine["average"] if mine else None),
            fmt(row["average"]),
            fmt(mine["kv_mib"] if mine else None, 2),
            fmt(row["kv_mib"], 2),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eval-dir", type=Path, default=Path("out/eval"))
    parser.add_argument("--methods", default="full,streaming_llm,snapkv,tova,knorm")
    parser.add_argument("--ratios", default="0.5")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--setup", action="store_true", help="create the kvpress venv first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in KVPRESS_PRESSES]
    if unknown:
        parser.error(f"methods {unknown} have no kvpress counterpart: {', '.join(KVPRESS_PRESSES)}")
    args.ratios = [float(r) for r in args.ratios.split(",")]
    if not all(0 < r < 1 for r in args.ratios):
        parser.error("--ratios must be in (0, 1): ratio 0 is the 'full' method")
    if args.worker:
        worker(args)
        return

    from kvtier.models import resolve_model_dir

    if args.setup:
        setup_venv()
    if not venv_python().exists():
        parser.error(f"no kvpress venv at {venv_python().parent.parent}: run with --setup")
    samples = args.eval_dir / "samples.jsonl"
    if not samples.is_file():
        parser.error(f"{samples} is missing: run `kvtier eval --out {args.eval_dir}` first")
    out = args.eval_dir / "kvpress_results.json"
    command = [str(venv_python()), __file__, "--worker", "--samples", str(samples)]
    command += ["--model-dir", str(resolve_model_dir(None)), "--out", str(out)]
    command += ["--methods", ",".join(args.methods), "--ratios", ",".join(map(str, args.ratios))]
    command += ["--threads", str(args.threads)]
    subprocess.run(command, check=True)

    theirs_doc = json.loads(out.read_text())
    theirs = summarize(theirs_doc["samples"])
    ours_path = args.eval_dir / "results.json"
    ours = summarize(json.loads(ours_path.read_text())["samples"]) if ours_path.is_file() else {}
    table = compare_table(ours, theirs)
    note = f"{theirs_doc['num_samples']} samples from {samples}; "
    note += f"tokenization mismatches: {len(theirs_doc['tokenization_mismatches'])}"
    (args.eval_dir / "kvpress_compare.md").write_text(table + "\n\n" + note + "\n")
    print(table)
    print(note)
    print(f"wrote {args.eval_dir / 'kvpress_compare.md'}")


if __name__ == "__main__":
    main()
