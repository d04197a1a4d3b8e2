"""`kvtier eval`: long-context accuracy of KV compression methods on the real engine.

Scores seeded RULER-style tasks (needles, variable tracking, word extraction, passkey) per
task x method x compression ratio, with the KV bytes each request really held and speed.
Writes results.json, results.md, score_vs_bytes.png and the samples (samples.jsonl, the
input of benchmarks/kvpress_compare.py) under --out. `--tasks perplexity` instead feeds the
shipped prose through the engine with a StreamingLLM cache bounded to each of --budgets
tokens and reports perplexity against the full cache (perplexity.json, perplexity.md).

Examples:
  kvtier eval --quick
  kvtier eval --methods snapkv,tova --ratios 0,0.5,0.875 --lengths 4096 --samples 4
  kvtier eval --methods full,kivi4,kivi8 --tasks niah_single,passkey --lengths 2k,4k
  kvtier eval --tasks perplexity --budgets 256,512,1024 --lengths 2048 --threads 1
  kvtier eval --methods full --kv-forms int8,int4 --quick --out out/eval-forms
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvtier.engine.config import DTYPE_HELP, DTYPES
from kvtier.errors import KvtierError
from kvtier.workload.flags import add_hidden_alias

DEFAULT_OUT = "out/eval"
DEFAULT_METHODS = "snapkv,streaming_llm,tova,knorm,h2o"
# --quick: every task once at 1K, five presses at half the KV: a few minutes on 2 CPU cores.
QUICK = {"lengths": "1024", "samples": 1, "ratios": "0,0.5"}
FULL = {"lengths": "1024,2048,4096", "samples": 4, "ratios": "0,0.25,0.5,0.75,0.875"}


# = tuple(kvtier.eval.tasks.TASKS), written out so that `kvtier --help` (which builds every
# sub-command's parser) does not import numpy; a test checks they match
TASK_NAMES = (
    "niah_single", "niah_single_noise", "niah_multikey", "niah_multivalue", "niah_multiquery",
    "passkey", "vt", "cwe", "fwe",
)  # fmt: skip
PERPLEXITY = "perplexity"  # not a RULER task: kvtier.eval.perplexity, run on its own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "Examples:" + __doc__.split("Examples:")[1]
    parser.add_argument(
        "--quick", action="store_true", help=f"small run: {QUICK} (flags given still win)"
    )
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma list: full, press names (run per ratio), or fixed specs such as "
        f"snapkv:0.5, streaming_llm@512, kivi4 (default {DEFAULT_METHODS})",
    )
    parser.add_argument("--ratios", help=f"comma list in [0, 1) (default {FULL['ratios']})")
    parser.add_argument(
        "--tasks",
        default=",".join(TASK_NAMES),
        help=f"comma list (default: all), or {PERPLEXITY} alone (long-text perplexity)",
    )
    parser.add_argument(
        "--budgets",
        help=f"{PERPLEXITY} only: KV tokens kept while decoding, comma list (default 256,512,1024)",
    )
    parser.add_argument(
        "--lengths", help=f"target lengths in tokens, e.g. 1k,4096 (default {FULL['lengths']})"
    )
    parser.add_argument(
        "--samples", type=int, help=f"samples per task and length (default {FULL['samples']})"
    )
    parser.add_argument(
        "--kv-forms",
        metavar="FORMS",
        help="also run the samples with the KV stored as each of these forms (int8,int4) and "
        "write their accuracy loss against full precision to DIR/forms.json, the figures "
        "[policy] accuracy_file reads",
    )
    parser.add_argument("--seed", type=int, default=0, help="task generator seed (default 0)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"({DEFAULT_OUT})")
    parser.add_argument("--model", help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help=DTYPE_HELP)
    threads = parser.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    add_hidden_alias(parser, threads, "--num-threads")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=16384,
        help="prompt tokens run together in one batch (default 16384)",
    )


def run(args: argparse.Namespace) -> int:
    if PERPLEXITY in _split(args.tasks):
        return _run_perplexity(args)
    if args.budgets is not None:
        raise KvtierError(f"--budgets is for --tasks {PERPLEXITY}")
    from kvtier.eval.methods import plan_runs
    from kvtier.eval.tasks import check_tasks

    preset = QUICK if args.quick else FULL
    tasks = check_tasks(_split(args.tasks))
    methods = _split(args.methods)
    kv_forms = None
    if args.kv_forms is not None:
        from kvtier.eval.forms import check_forms

        kv_forms = check_forms(_split(args.kv_forms))
        methods = ["full", *methods]  # the figures are losses against the full cache
    runs = plan_runs(methods, _floats(args.ratios or preset["ratios"], "--ratios"))
    lengths = [_length(v) for v in _split(args.lengths or preset["lengths"])]
    num_samples = args.samples if args.samples is not None else preset["samples"]
    if num_samples < 1:
        raise KvtierError(f"--samples must be >= 1, got {num_samples}")
    if args.threads is not None and args.threads < 1:
        raise KvtierError(f"--threads must be >= 1, got {args.threads}")
    if args.max_batch_tokens < 1:
        raise KvtierError(f"--max-batch-tokens must be >= 1, got {args.max_batch_tokens}")

    from kvtier.eval.report import markdown_table, print_table, summarize, write_json, write_plot
    from kvtier.eval.runner import RunnerConfig, make_engine, run_eval
    from kvtier.eval.sample import write_jsonl
    from kvtier.eval.tasks import generate_samples

    config = RunnerConfig(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        max_batch_tokens=args.max_batch_tokens,
    )
    engine = make_engine(config)
    too_long = [n for n in lengths if n > engine.max_model_len]
    if too_long:
        raise KvtierError(
            f"--lengths {too_long} exceed the model context of {engine.max_model_len} tokens"
        )
    samples = generate_samples(engine.tokenizer, tasks, lengths, num_samples, args.seed)
    model_dir, threads = str(engine.model_dir), engine.config.resolved_num_threads()
    dtype = engine.config.dtype  # "auto" decided
    out = Path(args.out)
    write_jsonl(samples, out / "samples.jsonl")
    print(f"{len(samples)} samples x {len(runs)} method runs: {', '.join(r.label for r in runs)}")
    started = time.perf_counter()
    result = run_eval(samples, runs, config, engine, progress=print)
    rows = summarize(result)
    if kv_forms:
        from kvtier.eval.forms import run_forms

        del engine  # one engine at a time: each form gets its own packed pool
        full_held = rows[0]["kv_bytes_held_mean"]  # the full-cache run comes first
        for row in run_forms(samples, kv_forms, config, progress=print):
            held = row["kv_bytes_held_mean"]
            row["kv_vs_full"] = held / full_held if held is not None and full_held else None
            rows.append(row)
    settings = {
        "tasks": tasks,
        "lengths": lengths,
        "samples_per_task": num_samples,
        "seed": args.seed,
        "runs": [r.spec for r in runs],
        "model": model_dir,
        "dtype": dtype,
        "threads": threads,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print_table(rows)
    (out / "results.md").write_text(markdown_table(rows) + "\n", encoding="utf-8")
    for path in (
        write_json(out / "results.json", settings, rows, result),
        out / "results.md",
        write_plot(rows, out / "score_vs_bytes.png"),
        out / "samples.jsonl",
    ):
        print(f"wrote {path}")
    if kv_forms:
        from kvtier.eval.forms import figures, write_figures
        from kvtier.policy.accuracy import FIGURES_FILE

        full = next(row for row in rows if row["spec"] == "full")
        from kvtier.models import EMBEDDED_MODEL_NAME

        # the names commands look figures up by: the engine's model folder, and for the
        # embedded model the names `serve` and `simulate --model` use for it
        given = [args.model] if args.model else [EMBEDDED_MODEL_NAME, "smollm2-135m"]
        names = [*given, Path(model_dir).name]
        document = figures(full, rows[-len(kv_forms) :], list(dict.fromkeys(names)), settings)
        print(f"wrote {write_figures(out / FIGURES_FILE, document)}")
    return 0


def _run_perplexity(args: argparse.Namespace) -> int:
    """Perplexity of the shipped prose, full cache vs StreamingLLM at each budget."""
    from kvtier.eval import perplexity
    from kvtier.models import resolve_model_dir
    from kvtier.models.tokenizer import load_tokenizer

    if args.kv_forms is not None:
        raise KvtierError(f"--kv-forms scores the RULER tasks, not --tasks {PERPLEXITY}")
    if _split(args.tasks) != [PERPLEXITY]:
        raise KvtierError(
            f"--tasks {PERPLEXITY} runs on its own (it scores a text, not answers); "
            "drop the other tasks"
        )
    if args.threads is not None and args.threads < 1:
        raise KvtierError(f"--threads must be >= 1, got {args.threads}")
    lengths = [_length(v) for v in _split(args.lengths or str(perplexity.DEFAULT_LENGTH))]
    budgets = list(perplexity.DEFAULT_BUDGETS)
    if args.budgets is not None:
        try:
            budgets = [int(v) for v in _split(args.budgets)]
        except ValueError:
            raise KvtierError(f"--budgets takes token counts, got {args.budgets!r}") from None
    # Checked with the tokenizer alone, before the model loads.
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    texts = {n: perplexity.long_text(tokenizer, n) for n in lengths}
    budgets = perplexity.check_budgets(budgets, min(lengths))

    from kvtier.eval.runner import RunnerConfig, make_engine

    engine = make_engine(RunnerConfig(model=args.model, dtype=args.dtype, num_threads=args.threads))
    started = time.perf_counter()
    runs = []
    for token_ids in texts.values():
        runs += perplexity.run_perplexity(engine, token_ids, budgets, progress=print)
    table = perplexity.markdown_table(runs)
    print(table)
    settings = {
        "lengths": lengths,
        "budgets": budgets,
        "num_sinks": perplexity.NUM_SINKS,
        "model": str(engine.model_dir),
        "dtype": engine.config.dtype,
        "threads": engine.config.resolved_num_threads(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out = Path(args.out)
    (out / "perplexity.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "perplexity.md").write_text(table + "\n", encoding="utf-8")
    print(f"wrote {perplexity.write_json(out / 'perplexity.json', settings, runs)}")
    print(f"wrote {out / 'perplexity.md'}")
    return 0


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(v) for v in _split(text)]
    except ValueError:
        raise KvtierError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def _length(text: str) -> int:
    value = text.lower()
    try:
        tokens = int(float(value[:-1]) * 1024) if value.endswith("k") else int(value)
    except ValueError:
        raise KvtierError(
            f"--lengths takes token counts such as 1024 or 4k, got {text!r}"
        ) from None
    if tokens < 256:
        raise KvtierError(f"--lengths values must be at least 256 tokens, got {tokens}")
    return tokens
