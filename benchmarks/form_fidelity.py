"""How close a session restored from a quantized tier form is to recomputing it.

    .venv/bin/python benchmarks/form_fidelity.py \
        --out out/form_fidelity.json [--tokens 1536] [--prompts 3] [--new 32] [--threads 1]

One engine (the embedded SmolLM2, bf16). Per prompt (`--tokens` of the packaged prose, from a
different sentence each, then a question):

- reference: no tiers, empty prefix cache: the logits of every position of history + question
  (`Engine.score`) and `--new` greedy tokens;
- per form (full, int8, int4): turn 1 prefills the history in a session, the policy runner
  moves the whole session to a disk tier storing that form (encoded on the mover's worker),
  then the same history + question is scored: the history comes back from disk (decoded to
  bf16), only the question's tokens are computed, and their logits are compared with the
  reference's rows (max |diff|, whether the argmax agrees); then `--new` greedy tokens are
  generated over the same restored blocks and compared token by token.

Reported per form: the disk tier's `used_bytes` holding the session, the largest logit
difference, the share of question positions whose argmax agrees, and how many generated tokens
agree with the reference before the first difference (of `--new`). The row "rechunked" is the
noise floor of bf16 itself: the same prompt recomputed, no tiers, by an engine whose prefill
runs in 96-token chunks instead of 512 (the same math summed in another order).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from kvtier.bench.replay import common_prefix
from kvtier.cache import TiersConfig
from kvtier.cache.setup import attach_connector
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.eval.haystack import filler, prose_sentences
from kvtier.policy.actions import Move

MIB = 1 << 20
FORMS = ("full", "int8", "int4")
ROWS = ("rechunked", *FORMS)
QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"


def prose_prompt(engine: Engine, start: int, tokens: int) -> list[int]:
    """At least `tokens` tokens of prose from sentence `start`, cut to exactly `tokens`."""
    sentences = 32
    while True:
        ids = engine.tokenizer.encode(" ".join(filler("prose", start, sentences)))
        if len(ids) >= tokens:
            return ids[:tokens]
        sentences *= 2


def generate(engine: Engine, prompt: list[int], new: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            if step.request_id == rid:
                out.extend(step.new_token_ids)
    return out


def restored_run(
    engine: Engine, form: str, workdir: Path, history: list[int], prompt: list[int], new: int
) -> dict:
    tiers = TiersConfig(
        host_bytes=0, disk_bytes=1024 * MIB, disk_dir=workdir / form, forms={"disk": form}
    )
    connector = attach_connector(engine, tiers, "retain")
    session = f"fidelity-{form}"
    engine.add_request(history, SamplingParams(temperature=0, max_tokens=1), session_id=session)
    while engine.has_unfinished_requests():
        engine.step()
    connector.runner.execute(Move(session, None, "disk"))
    if not connector.flush(timeout=300):
        raise RuntimeError("moving the session to disk did not finish")
    stored = connector.store.tiers["disk"].used_bytes
    (scored,) = engine.score([prompt])
    restored_tokens = connector.counters["restored_blocks_disk"] * engine.config.block_size
    tokens = generate(engine, prompt, new)  # over the same restored blocks, now on device
    attach_connector(engine, None)
    return {
        "stored_bytes": stored,
        "restored_tokens": restored_tokens,
        "start": scored.start_position,
        "logits": scored.logits,
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = Engine(
        EngineConfig(
            kv_cache_bytes=256 * MIB, max_model_len=args.tokens + 256, num_threads=args.threads
        )
    )
    rechunked = Engine(
        EngineConfig(
            kv_cache_bytes=256 * MIB,
            max_model_len=args.tokens + 256,
            num_threads=args.threads,
            max_num_batched_tokens=96,
        )
    )
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-fidelity-"))
    question = engine.tokenizer.encode(QUESTION)
    n_sentences = len(prose_sentences())
    rows = []
    try:
        for p in range(args.prompts):
            history = prose_prompt(engine, p * n_sentences // args.prompts, args.tokens)
            prompt = history + question
            attach_connector(engine, None)
            engine.reset_prefix_cache()
            (reference,) = engine.score([prompt])
            ref_tokens = generate(engine, prompt, args.new)
            for form in ROWS:
                if form == "rechunked":
                    rechunked.reset_prefix_cache()
                    (scored,) = rechunked.score([prompt])
                    tokens = generate(rechunked, prompt, args.new)
                    run = {"stored_bytes": 0, "restored_tokens": 0, "start": len(history)}
                    run |= {"logits": scored.logits[len(history) :], "tokens": tokens}
                else:
                    run = restored_run(engine, form, workdir / str(p), history, prompt, args.new)
                ref_rows = reference.logits[run["start"] - reference.start_position :]
                diff = (run["logits"] - ref_rows).abs().max().item()
                argmax = (run["logits"].argmax(-1) == ref_rows.argmax(-1)).float().mean().item()
                row = {
                    "prompt": p,
                    "form": form,
                    "stored_bytes": run["stored_bytes"],
                    "restored_tokens": run["restored_tokens"],
                    "scored_positions": len(ref_rows),
                    "logit_max_abs_diff": diff,
                    "argmax_agree": argmax,
                    "greedy_agree": common_prefix(run["tokens"], ref_tokens),
                }
                rows.append(row)
                print(json.dumps(row))
    finally:
        engine.close()
        rechunked.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{args.tokens}-token history + {len(question)}-token question, embedded SmolLM2 bf16, "
        f"disk tier, {args.prompts} prompts\n"
    )
    print(
        "| form | disk used_bytes | logit max abs diff | argmax agree | greedy tokens agreeing "
        f"(of {args.new}) |"
    )
    print("|---|---:|---|---|---|")
    for form in ROWS:
        mine = [r for r in rows if r["form"] == form]

        def column(key: str, spec: str, rows: list[dict] = mine) -> str:
            return ", ".join(format(r[key], spec) for r in rows)

        print(
            f"| {form} | {column('stored_bytes', ',')} | {column('logit_max_abs_diff', '.3f')} "
            f"| {column('argmax_agree', '.2f')} | {column('greedy_agree', 'd')} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}))


if __name__ == "__main__":
    main()
