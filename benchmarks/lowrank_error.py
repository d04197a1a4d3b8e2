"""How well rank-r bases fitted on the calibration text rebuild KV of another text
(docs/compression.md, "Low rank"): relative error ||KV - rebuilt|| / ||KV|| of keys and
values at the share of bytes kept, per KV head vs per layer, and keys fitted after RoPE (what
the press does) vs before RoPE (Palu's choice; re-rotation makes the two errors comparable);
then the attention sink (position 0) against a typical token.

Calibration: 4,096 tokens of kvtier/data/calibration/workshop_notes.txt (repeated);
held out: 4,096 tokens of the prose `kvtier eval` hides its needles in. float32, 1 thread.

    python benchmarks/lowrank_error.py
"""

from __future__ import annotations

import torch

from kvtier.compress.lowrank import CALIBRATION_TOKENS, MomentAccumulator
from kvtier.engine import Engine, EngineConfig
from kvtier.engine.llama import rope_tables
from kvtier.lowrank.fit import calibration_text, calibration_tokens, prompt_kv

SHARES_KEPT = (0.75, 0.5, 0.25, 0.125)


def kv_of(engine: Engine, text: str) -> torch.Tensor:
    """[layers, 2, kv_heads, tokens, head_dim] of the text at positions 0..4095."""
    return prompt_kv(engine, calibration_tokens(engine.tokenizer, text, CALIBRATION_TOKENS))


def unrotate_keys(kv: torch.Tensor, engine: Engine) -> torch.Tensor:
    """Keys as they were before RoPE (position = token index); values unchanged."""
    cos, sin = rope_tables(engine.model_config, kv.shape[3])
    keys = kv[:, 0]
    half = keys.shape[-1] // 2
    rotated = torch.cat((-keys[..., half:], keys[..., :half]), dim=-1)
    out = kv.clone()
    out[:, 0] = keys * cos - rotated * sin  # the inverse rotation: angle -theta
    return out


def errors(calibration: torch.Tensor, held_out: torch.Tensor, grouping: str) -> list[str]:
    layers, _, heads, _, dim = calibration.shape
    moments = MomentAccumulator(layers, heads, dim, grouping)
    moments.add(calibration)
    basis = moments.basis()
    cells = []
    for share in SHARES_KEPT:
        rebuilt = basis.reconstruct(held_out, round(basis.width * share))
        diff = rebuilt - held_out
        k = diff[:, 0].norm() / held_out[:, 0].norm()
        v = diff[:, 1].norm() / held_out[:, 1].norm()
        cells.append(f"{k:.3f} / {v:.3f}")
    return cells


def main() -> None:
    engine = Engine(
        EngineConfig(dtype="float32", num_threads=1, kv_cache_bytes=CALIBRATION_TOKENS * 47_000)
    )
    calibration = kv_of(engine, calibration_text("workshop_notes"))
    held_out = kv_of(engine, calibration_text("prose"))
    print("| keys | grouping | " + " | ".join(f"{s:g} kept (K / V)" for s in SHARES_KEPT) + " |")
    print("|---|---|" + "---|" * len(SHARES_KEPT))
    for keys, (cal, test) in {
        "after RoPE": (calibration, held_out),
        "before RoPE": (unrotate_keys(calibration, engine), unrotate_keys(held_out, engine)),
    }.items():
        for grouping in ("head", "layer"):
            print(f"| {keys} | {grouping} | " + " | ".join(errors(cal, test, grouping)) + " |")
    sink_vs_typical(calibration, held_out)


def sink_vs_typical(calibration: torch.Tensor, held_out: torch.Tensor) -> None:
    """Error of position 0 (the attention sink) against the median token, layer bases,
    half the bytes kept: why the press keeps its first tokens exact."""
    layers, _, heads, _, dim = calibration.shape
    moments = MomentAccumulator(layers, heads, dim, "layer")
    moments.add(calibration)
    basis = moments.basis()
    diff = basis.reconstruct(held_out, basis.width // 2) - held_out
    for index, name in enumerate(("keys", "values")):
        per_token = diff[:, index].pow(2).sum((0, 1, 3)).sqrt()
        per_token = per_token / held_out[:, index].pow(2).sum((0, 1, 3)).sqrt()
        print(f"{name}: position 0 {per_token[0]:.3f}, median token {per_token.median():.3f}")


if __name__ == "__main__":
    main()
